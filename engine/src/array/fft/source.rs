//! What a transform reads: a variable of a Zarr table, or the output of
//! another transform (`df.fft(...).ifft(...)`), as blocks of values.
//!
//! A source gives its dimensions (names, coordinates, xrft's `direct_lag`),
//! its shape, the chunk shape its blocks align to, and any block as values
//! in a precision. Reading a block of a transform's output reads the block
//! of its source that is whole along the inner transformed dimensions and
//! transforms it, so chained transforms run block by block too.

use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, AsArray};
use datafusion::arrow::buffer::NullBuffer;
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{
    ArrowPrimitiveType, DataType, Float32Type, Float64Type, Int64Type, TimeUnit,
};
use datafusion::common::plan_err;
use rustfft::num_complex::Complex;
use rustfft::num_traits::{Float, FromPrimitive, Zero};
use rustfft::FftNum;
use std::ops::Range;
use zarrfusion_udfs::complex::complex_part;

use super::table::FftTable;
use super::transform::InputCoordinate;
use crate::device::fft_cpu::BlockValues;
use crate::device::CpuFft;
use crate::table::GridTable;
use crate::zarr::{ChunkBufferPool, ZarrArray};

/// One dimension of a source.
#[derive(Debug, Clone)]
pub struct SourceDimension {
    /// The name.
    pub name: String,
    /// The coordinate values (the index without a coordinate array).
    pub values: ArrayRef,
    /// xrft's `direct_lag` of a frequency coordinate, when known.
    pub direct_lag: Option<f64>,
    /// Whether the coordinate descends.
    pub descends: bool,
}

impl SourceDimension {
    /// The coordinate as numbers (times in seconds, as xrft converts them).
    pub fn input_coordinate(&self) -> Result<InputCoordinate, String> {
        let values = &self.values;
        if values.null_count() > 0 {
            return Err(format!("coordinate '{}' has missing values", self.name));
        }
        let numbers: Vec<f64> = match values.data_type() {
            DataType::Timestamp(unit, _) => {
                let per_second = match unit {
                    TimeUnit::Second => 1.0,
                    TimeUnit::Millisecond => 1e3,
                    TimeUnit::Microsecond => 1e6,
                    TimeUnit::Nanosecond => 1e9,
                };
                let ints = cast(values, &DataType::Int64).map_err(|e| e.to_string())?;
                ints.as_primitive::<Int64Type>()
                    .values()
                    .iter()
                    .map(|&v| v as f64 / per_second)
                    .collect()
            }
            t if t.is_numeric() => cast(values, &DataType::Float64)
                .map_err(|e| e.to_string())?
                .as_primitive::<Float64Type>()
                .values()
                .to_vec(),
            other => {
                return Err(format!(
                    "coordinate '{}' is {other}, not numbers or times",
                    self.name
                ))
            }
        };
        Ok(InputCoordinate {
            values: numbers,
            direct_lag: self.direct_lag,
        })
    }
}

/// The CPU kernels of both precisions, shared by the tasks of a query.
#[derive(Debug, Default)]
pub struct Kernels {
    single: CpuFft<f32>,
    double: CpuFft<f64>,
}

/// A precision transforms compute in: `f32` (complex64) or `f64`
/// (complex128).
pub trait Precision: FftNum + Float + Default + bytemuck::Pod {
    /// The Arrow type of a part.
    type Arrow: ArrowPrimitiveType<Native = Self>;
    /// This precision's kernel.
    fn kernel(kernels: &Kernels) -> &CpuFft<Self>;
}

impl Precision for f32 {
    type Arrow = Float32Type;
    fn kernel(kernels: &Kernels) -> &CpuFft<f32> {
        &kernels.single
    }
}

impl Precision for f64 {
    type Arrow = Float64Type;
    fn kernel(kernels: &Kernels) -> &CpuFft<f64> {
        &kernels.double
    }
}

/// What a transform reads (see the module docs).
#[derive(Debug, Clone)]
pub enum ArraySource {
    /// A variable of a Zarr table.
    Zarr {
        /// The table.
        grid: Arc<GridTable>,
        /// Index of the variable in `grid.variables`.
        variable: usize,
    },
    /// The output of another transform.
    Transformed(Arc<FftTable>),
}

impl ArraySource {
    /// The variable `variable` of `grid` (its only one when `None`);
    /// `function` names the caller in errors.
    pub fn zarr_variable(
        grid: Arc<GridTable>,
        variable: Option<&str>,
        function: &str,
    ) -> datafusion::common::Result<Self> {
        let names = || {
            grid.variables
                .iter()
                .map(|v| v.name())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let index = match variable {
            Some(name) => grid.variables.iter().position(|v| v.name() == name),
            None if grid.variables.len() == 1 => Some(0),
            None => {
                return plan_err!(
                    "{function} of '{}': name the variable to transform (variables: {})",
                    grid.store,
                    names()
                )
            }
        };
        match index {
            Some(variable) => Ok(Self::Zarr { grid, variable }),
            None => plan_err!(
                "{function} of '{}': unknown variable '{}' (variables: {})",
                grid.store,
                variable.unwrap_or_default(),
                names()
            ),
        }
    }

    /// The store the values come from.
    pub fn store(&self) -> &str {
        match self {
            Self::Zarr { grid, .. } => &grid.store,
            Self::Transformed(inner) => inner.source().store(),
        }
    }

    /// The variable's name.
    pub fn variable(&self) -> &str {
        match self {
            Self::Zarr { grid, variable } => grid.variables[*variable].name(),
            Self::Transformed(inner) => inner.source().variable(),
        }
    }

    /// The dimensions, outermost first.
    pub fn dims(&self) -> Vec<SourceDimension> {
        match self {
            Self::Zarr { grid, .. } => grid
                .dims
                .iter()
                .map(|d| SourceDimension {
                    name: d.name.clone(),
                    values: Arc::clone(&d.values),
                    direct_lag: d.attributes.get("direct_lag").and_then(|v| v.as_f64()),
                    descends: d.descends(),
                })
                .collect(),
            Self::Transformed(inner) => inner.output_dims(),
        }
    }

    /// The shape.
    pub fn shape(&self) -> Vec<u64> {
        match self {
            Self::Zarr { grid, .. } => grid.shape(),
            Self::Transformed(inner) => inner.output_shape(),
        }
    }

    /// The chunk shape blocks align to: the variable's chunks, and for a
    /// transform's output its source's, whole along its transformed
    /// dimensions.
    pub fn chunk_shape(&self) -> Vec<u64> {
        match self {
            Self::Zarr { grid, variable } => grid.variables[*variable].chunk_shape(),
            Self::Transformed(inner) => {
                let mut chunk = inner.source().chunk_shape();
                let shape = inner.output_shape();
                for (axis, _) in &inner.transform().axes {
                    chunk[*axis] = shape[*axis];
                }
                chunk
            }
        }
    }

    /// The Arrow type of the values.
    pub fn value_type(&self) -> DataType {
        match self {
            Self::Zarr { grid, variable } => grid.variables[*variable].data_type().clone(),
            Self::Transformed(inner) => inner.value_type(),
        }
    }

    /// Bytes a cell holds at the peak of reading a block (for a
    /// transform's output: its source's, and the values before and after
    /// a pass).
    pub fn peak_bytes_per_cell(&self) -> usize {
        match self {
            Self::Zarr { grid, variable } => grid.variables[*variable].peak_bytes_per_cell(),
            Self::Transformed(inner) => {
                inner.source().peak_bytes_per_cell() + 2 * inner.complex_bytes()
            }
        }
    }

    /// Bytes per stored value of the variable read.
    pub fn element_size(&self) -> usize {
        match self {
            Self::Zarr { grid, variable } => grid.variables[*variable].element_size(),
            Self::Transformed(inner) => inner.source().element_size(),
        }
    }

    /// The values of block `extent` in precision `P` (missing values NaN).
    pub fn read<P: Precision>(
        &self,
        extent: &[Range<u64>],
        pool: &ChunkBufferPool,
        kernels: &Kernels,
    ) -> Result<BlockValues<P>, String> {
        match self {
            Self::Zarr { grid, variable } => {
                let array: &ZarrArray = &grid.variables[*variable];
                let read = array.read(extent, pool).map_err(|e| e.to_string())?;
                block_values::<P::Arrow>(&read)
            }
            Self::Transformed(inner) => {
                let source_shape = inner.source().shape();
                let transform = inner.transform();
                let source_extent: Vec<Range<u64>> = extent
                    .iter()
                    .enumerate()
                    .map(|(d, r)| {
                        if transform.transforms(d) {
                            0..source_shape[d]
                        } else {
                            r.clone()
                        }
                    })
                    .collect();
                let shape: Vec<usize> = source_extent
                    .iter()
                    .map(|r| (r.end - r.start) as usize)
                    .collect();
                let values = inner.source().read::<P>(&source_extent, pool, kernels)?;
                let (out, _) = transform.apply(P::kernel(kernels), values, &shape)?;
                Ok(out)
            }
        }
    }
}

/// The values of a block read as Arrow (numbers, or complex structs) in
/// precision `P`; missing values become NaN.
fn block_values<P>(read: &ArrayRef) -> Result<BlockValues<P::Native>, String>
where
    P: ArrowPrimitiveType,
    P::Native: FftNum,
{
    let nan = P::Native::from_f64(f64::NAN).unwrap_or_else(P::Native::zero);
    let part = |array: &ArrayRef, nulls: Option<&NullBuffer>| {
        let converted = cast(array, &P::DATA_TYPE).map_err(|e| e.to_string())?;
        let values = converted.as_primitive::<P>();
        let nulls = nulls.or(values.nulls());
        Ok::<_, String>(match nulls {
            Some(nulls) => values
                .values()
                .iter()
                .enumerate()
                .map(|(i, &v)| if nulls.is_null(i) { nan } else { v })
                .collect::<Vec<_>>(),
            None => values.values().to_vec(),
        })
    };
    if complex_part(read.data_type()).is_some() {
        let parts = read.as_struct();
        let re = part(parts.column(0), parts.nulls())?;
        let im = part(parts.column(1), parts.nulls())?;
        return Ok(BlockValues::Complex(
            re.into_iter()
                .zip(im)
                .map(|(r, i)| Complex::new(r, i))
                .collect(),
        ));
    }
    Ok(BlockValues::Real(part(read, None)?))
}

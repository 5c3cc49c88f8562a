//! What a transform reads: a variable of a Zarr table, or the output of
//! another transform (`df.fft(...).ifft(...)`), as blocks of values.
//!
//! A source gives its dimensions (names, coordinates, xrft's `direct_lag`),
//! its shape, the chunk shape its blocks align to, and any block as values
//! in a precision. Reading a block of a transform's output reads the block
//! of its source that is whole along the inner transformed dimensions and
//! transforms it, so chained transforms run block by block too.

pub mod detrended;
pub mod rechunked;

use std::any::Any;
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, Float64Array};
use datafusion::arrow::buffer::NullBuffer;
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{ArrowPrimitiveType, DataType, Int64Type};
use datafusion::common::plan_err;
use datafusion::physical_plan::ExecutionPlan;
use rustfft::num_complex::Complex;
use rustfft::num_traits::{FromPrimitive, Zero};
use rustfft::FftNum;
use std::ops::Range;
use zarrfusion_udfs::calendar::Date;
use zarrfusion_udfs::cf_time::CfTime;
use zarrfusion_udfs::complex::complex_part;

pub use detrended::DetrendedSource;
pub use rechunked::RechunkedVariable;

use super::kernels::{Kernels, Precision};
use super::transform::{FftTransform, InputCoordinate};
use crate::device::fft_cpu::BlockValues;
use crate::device::Device;
use crate::table::{
    ticks_per_second, CalendarSeconds, Coordinate, CoordinateFormula, GridTable, RegularCoordinate,
};
use crate::zarr::{ChunkBufferPool, ZarrArray};

/// One dimension of a source.
#[derive(Debug, Clone)]
pub struct SourceDimension {
    /// The name.
    pub name: String,
    /// The coordinate values (the index without a coordinate array).
    pub coordinate: Coordinate,
    /// xrft's `direct_lag` of a frequency coordinate, when known.
    pub direct_lag: Option<f64>,
    /// Whether the coordinate descends.
    pub descends: bool,
    /// The CF time encoding of a coordinate of dates of a model calendar
    /// (`noleap`, `360_day`, ...: xarray's cftime dates), whose times count
    /// in the calendar's own days.
    pub model_calendar: Option<CfTime>,
}

/// The date xrft counts the times of model calendars from (in seconds):
/// cftime's `date2num(..., "seconds since 1800-01-01 00:00:00", calendar)`.
const MODEL_CALENDAR_ORIGIN: Date = Date {
    year: 1800,
    month: 1,
    day: 1,
};

impl SourceDimension {
    /// The coordinate as numbers (times in seconds, as xrft converts them:
    /// since 1970-01-01 for timestamps, since 1800-01-01 of the calendar for
    /// the dates of a model calendar, which count in its own days).
    pub fn input_coordinate(&self) -> Result<InputCoordinate, String> {
        if let Some(time) = self.model_calendar {
            return Ok(InputCoordinate {
                numbers: Coordinate::Computed(Arc::new(CalendarSeconds::new(
                    &self.name,
                    &self.coordinate,
                    time,
                    MODEL_CALENDAR_ORIGIN,
                )?)),
                direct_lag: self.direct_lag,
            });
        }
        let values = match &self.coordinate {
            Coordinate::Values(values) => values,
            Coordinate::Regular(regular) => {
                let per_second = match regular.data_type() {
                    DataType::Timestamp(unit, _) => ticks_per_second(unit),
                    t if t.is_numeric() => 1.0,
                    other => {
                        return Err(format!(
                            "coordinate '{}' is {other}, not numbers or times",
                            self.name
                        ))
                    }
                };
                return Ok(InputCoordinate {
                    numbers: Coordinate::Computed(Arc::new(RegularNumbers {
                        values: Arc::clone(regular),
                        per_second,
                    })),
                    direct_lag: self.direct_lag,
                });
            }
            computed => {
                return Ok(InputCoordinate {
                    numbers: computed.clone(),
                    direct_lag: self.direct_lag,
                })
            }
        };
        if values.null_count() > 0 {
            return Err(format!("coordinate '{}' has missing values", self.name));
        }
        let numbers: ArrayRef = match values.data_type() {
            DataType::Timestamp(unit, _) => {
                let per_second = ticks_per_second(unit);
                let ints = cast(values, &DataType::Int64).map_err(|e| e.to_string())?;
                Arc::new(Float64Array::from_iter_values(
                    ints.as_primitive::<Int64Type>()
                        .values()
                        .iter()
                        .map(|&v| v as f64 / per_second),
                ))
            }
            t if t.is_numeric() => cast(values, &DataType::Float64).map_err(|e| e.to_string())?,
            other => {
                return Err(format!(
                    "coordinate '{}' is {other}, not numbers or times",
                    self.name
                ))
            }
        };
        Ok(InputCoordinate {
            numbers: Coordinate::Values(numbers),
            direct_lag: self.direct_lag,
        })
    }
}

/// A regular coordinate's values as numbers (times in seconds, as xrft
/// converts them), computed per position.
#[derive(Debug)]
struct RegularNumbers {
    values: Arc<RegularCoordinate>,
    per_second: f64,
}

impl CoordinateFormula for RegularNumbers {
    fn positions(&self) -> u64 {
        self.values.len()
    }

    fn value_at(&self, position: u64) -> f64 {
        self.values.number_at(position) / self.per_second
    }
}

/// The output of another transform, read as a source: what
/// [`ArraySource::Transformed`] holds (a `super::table::FftTable`).
pub trait TransformOutput: std::fmt::Debug + Send + Sync {
    /// What the transform reads.
    fn source(&self) -> &ArraySource;
    /// The transform.
    fn transform(&self) -> &FftTransform;
    /// The output's dimensions, outermost first.
    fn output_dims(&self) -> Vec<SourceDimension>;
    /// The output's shape.
    fn output_shape(&self) -> Vec<u64>;
    /// The Arrow type of the output's values.
    fn value_type(&self) -> DataType;
    /// Bytes of one complex value in the transform's precision.
    fn complex_bytes(&self) -> usize;
    /// This output as `Any`, for the planner to take the transform back.
    fn as_any(&self) -> &dyn Any;
}

/// The first stage of a transform stored in `work_dir`, read as a source:
/// what [`ArraySource::Staged`] holds (a `super::staged::StagedTransform`).
pub trait StoredStage: std::fmt::Debug + Send + Sync {
    /// The stored output, opened (readable once
    /// [`ensure_written`](Self::ensure_written)).
    fn grid(&self) -> &Arc<GridTable>;
    /// Index of the variable in the grid's variables.
    fn variable(&self) -> usize;
    /// The store the first stage reads.
    fn store(&self) -> &str;
    /// Runs the first stage unless done; every caller waits for it.
    fn ensure_written(&self, kernels: &Kernels) -> Result<(), String>;
    /// How `EXPLAIN` shows the first stage, before the later stage that
    /// runs along `later` (dimension names).
    fn describe(&self, later: &[&str]) -> String;
    /// The first stage as a cluster's stages whose tasks transform runs of
    /// its blocks on `device` and store them (after its four-step passes,
    /// when it takes that path; after the fit of its detrend, whose rows
    /// `broadcast` sends to every task of the first of them); `None` when
    /// it cannot travel (its source is made in this process: a rechunked
    /// one, or a table not opened from a location), and then runs in the
    /// session.
    fn on_cluster(&self, device: Device, broadcast: &Broadcast) -> Option<ClusterStage>;
    /// Runs the first stage by `run` (its cluster's tasks) unless done;
    /// every caller waits for it, and a later
    /// [`ensure_written`](Self::ensure_written) finds it done.
    fn written_by(&self, run: &mut dyn FnMut() -> Result<(), String>) -> Result<(), String>;
    /// This stage as `Any`, for the planner and the codec to take the
    /// first stage back.
    fn as_any(&self) -> &dyn Any;
}

/// What sends a stage's rows to every task of the stage that reads them
/// (on a cluster, datafusion-distributed's broadcast).
pub type Broadcast = dyn Fn(Arc<dyn ExecutionPlan>) -> Arc<dyn ExecutionPlan>;

/// The first stage of a transform as a cluster's stages
/// ([`StoredStage::on_cluster`]), run one after the other: the passes of
/// its four-step path, when it takes that path, then the runs of its
/// blocks, each task storing its own.
pub struct ClusterStage {
    /// Each stage's leaf, in the order they run.
    pub steps: Vec<ClusterStep>,
}

/// One stage of a [`ClusterStage`].
pub struct ClusterStep {
    /// The stage's leaf, whose tasks each yield how many blocks they ran.
    pub leaf: Arc<dyn ExecutionPlan>,
    /// The blocks every task's count must add up to.
    pub blocks: u64,
    /// What it is, for errors.
    pub what: String,
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
    Transformed(Arc<dyn TransformOutput>),
    /// A variable of a Zarr table, read from a copy of it in new chunks
    /// (whole along the transformed dimensions) in `work_dir`, made before
    /// the first block is read: when a block of whole lines in the store's
    /// own chunks does not fit the budget.
    Rechunked(Arc<RechunkedVariable>),
    /// The output of a transform along one dimension stored in `work_dir`
    /// before the first block is read: the first stage of a transform
    /// along several dimensions whose blocks do not fit the budget.
    Staged(Arc<dyn StoredStage>),
    /// Another source with a trend fitted over whole groups removed, for
    /// paths whose blocks do not hold whole groups (see
    /// [`detrended`]).
    Detrended(Arc<DetrendedSource>),
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

    /// Makes what the values are read from, unless made: the rechunked
    /// copy or the first stage's output in `work_dir` (nothing for the
    /// other sources). Every caller waits for it; [`read`](Self::read)
    /// calls it first.
    pub fn prepare(&self, kernels: &Kernels) -> Result<(), String> {
        match self {
            Self::Rechunked(copy) => copy.ensure_copied(),
            Self::Staged(stage) => stage.ensure_written(kernels),
            _ => Ok(()),
        }
    }

    /// The table and variable (index into its variables) whose chunks a
    /// block read decodes as they are stored: the Zarr variable, the
    /// rechunked copy or the first stage's output in `work_dir` (readable
    /// once [`prepare`](Self::prepare)d); `None` for the output of another
    /// transform or a detrended source, whose reads are computed.
    pub fn stored(&self) -> Option<(&Arc<GridTable>, usize)> {
        match self {
            Self::Zarr { grid, variable } => Some((grid, *variable)),
            Self::Rechunked(copy) => Some((&copy.grid, copy.variable)),
            Self::Staged(stage) => Some((stage.grid(), stage.variable())),
            Self::Transformed(_) | Self::Detrended(_) => None,
        }
    }

    /// The Zarr array read and its table, or the inner transform.
    fn origin(&self) -> Origin<'_> {
        match self {
            Self::Zarr { grid, variable } => Origin::Array(grid, &grid.variables[*variable]),
            Self::Rechunked(copy) => Origin::Array(&copy.grid, &copy.grid.variables[copy.variable]),
            Self::Staged(stage) => {
                Origin::Array(stage.grid(), &stage.grid().variables[stage.variable()])
            }
            Self::Transformed(inner) => Origin::Transform(inner),
            Self::Detrended(detrended) => detrended.source.origin(),
        }
    }

    /// The store the values come from.
    pub fn store(&self) -> &str {
        match self {
            Self::Rechunked(copy) => &copy.store,
            Self::Staged(stage) => stage.store(),
            Self::Detrended(detrended) => detrended.source.store(),
            _ => match self.origin() {
                Origin::Array(grid, _) => &grid.store,
                Origin::Transform(inner) => inner.source().store(),
            },
        }
    }

    /// The variable's name.
    pub fn variable(&self) -> &str {
        match self.origin() {
            Origin::Array(_, array) => array.name(),
            Origin::Transform(inner) => inner.source().variable(),
        }
    }

    /// The dimensions, outermost first.
    pub fn dims(&self) -> Vec<SourceDimension> {
        match self.origin() {
            Origin::Array(grid, _) => grid
                .dims
                .iter()
                .map(|d| SourceDimension {
                    name: d.name.clone(),
                    coordinate: d.coordinate.clone(),
                    direct_lag: d.attributes.get("direct_lag").and_then(|v| v.as_f64()),
                    descends: d.descends(),
                    model_calendar: d.model_calendar(),
                })
                .collect(),
            Origin::Transform(inner) => inner.output_dims(),
        }
    }

    /// The shape.
    pub fn shape(&self) -> Vec<u64> {
        match self.origin() {
            Origin::Array(grid, _) => grid.shape(),
            Origin::Transform(inner) => inner.output_shape(),
        }
    }

    /// The chunk shape blocks align to: the variable's chunks, and for a
    /// transform's output its source's, whole along its transformed
    /// dimensions.
    pub fn chunk_shape(&self) -> Vec<u64> {
        match self.origin() {
            Origin::Array(_, array) => array.chunk_shape(),
            Origin::Transform(inner) => {
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
        match self.origin() {
            Origin::Array(_, array) => array.data_type().clone(),
            Origin::Transform(inner) => inner.value_type(),
        }
    }

    /// Bytes a cell holds at the peak of reading a block (for a
    /// transform's output: its source's, and the values before and after
    /// a pass).
    pub fn peak_bytes_per_cell(&self) -> usize {
        match self.origin() {
            Origin::Array(_, array) => array.peak_bytes_per_cell(),
            Origin::Transform(inner) => {
                inner.source().peak_bytes_per_cell() + 2 * inner.complex_bytes()
            }
        }
    }

    /// Bytes per stored value of the variable read.
    pub fn element_size(&self) -> usize {
        match self.origin() {
            Origin::Array(_, array) => array.element_size(),
            Origin::Transform(inner) => inner.source().element_size(),
        }
    }

    /// The values of block `extent` in precision `P` (missing values NaN).
    pub fn read<P: Precision>(
        &self,
        extent: &[Range<u64>],
        pool: &ChunkBufferPool,
        kernels: &Kernels,
    ) -> Result<BlockValues<P>, String> {
        if let Self::Detrended(detrended) = self {
            return detrended.read(extent, pool, kernels);
        }
        self.prepare(kernels)?;
        match self.origin() {
            Origin::Array(_, array) => {
                let read = array.read(extent, pool).map_err(|e| e.to_string())?;
                block_values::<P::Arrow>(&read)
            }
            Origin::Transform(inner) => {
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
                let (out, _) = transform.apply(&kernels.timed::<P>(), values, &shape)?;
                Ok(out)
            }
        }
    }
}

/// Where a source's values come from: a Zarr array (of a table), or a
/// transform.
enum Origin<'a> {
    Array(&'a Arc<GridTable>, &'a ZarrArray),
    Transform(&'a Arc<dyn TransformOutput>),
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

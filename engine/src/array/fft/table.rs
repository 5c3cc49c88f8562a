//! The `fft(...)` and `ifft(...)` table functions: a variable of a Zarr
//! table transformed along dimensions, as rows.
//!
//! ```sql
//! SELECT * FROM fft('era5', 't2m', dims => 'lat', true_phase => true, true_amplitude => true);
//! SELECT * FROM ifft('spectrum', 't2m', dims => 'freq_lat', lag => 45);
//! ```
//!
//! The first argument is a registered Zarr table or a store location, the
//! second the variable (optional when the table has one); named arguments
//! are [`FftOptions`]. The result has one column per output dimension
//! (the transformed ones renamed `freq_<dim>` forward and back without the
//! prefix, with xrft's coordinates) and the transformed variable: complex
//! numbers as `Struct<re, im>` (complex64 from float32 input, complex128
//! otherwise), or real numbers for an inverse with a real dimension.
//!
//! [`FftExec`] reads blocks that hold whole lines along the transformed
//! dimensions (the store's chunks along the others, grown toward
//! `zarrfusion.target_partition_bytes`), transforms each with the CPU
//! kernel and streams its rows. Its projected memory (a block read,
//! transformed and turned into batches, per task) is checked against
//! `allowed_mem` while planning: fewer tasks run at once when that fits,
//! and a plan that cannot fit with one task is refused.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, Float64Array, PrimitiveArray, RecordBatch, RecordBatchOptions,
    UInt32Array,
};
use datafusion::arrow::compute::{cast, take};
use datafusion::arrow::datatypes::{
    ArrowPrimitiveType, DataType, Field, Float32Type, Float64Type, Schema, SchemaRef, TimeUnit,
};
use datafusion::catalog::{CatalogProviderList, Session};
use datafusion::common::stats::Precision;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{
    exec_err, human_readable_size, plan_err, DataFusionError, Result, Statistics, TableReference,
};
use datafusion::datasource::{provider_as_source, TableProvider, TableType};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryLimit};
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::planner::{
    PlannedRelation, RelationPlanner, RelationPlannerContext, RelationPlanning,
};
use datafusion::logical_expr::{Expr, LogicalPlan, LogicalPlanBuilder};
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricBuilder, MetricsSet};
use datafusion::physical_plan::stream::RecordBatchReceiverStreamBuilder;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties, StatisticsArgs,
};
use datafusion::sql::sqlparser::ast::TableFactor;
use rustfft::num_complex::Complex;
use rustfft::num_traits::{FromPrimitive, Zero};
use rustfft::FftNum;
use zarrfusion_udfs::complex::{complex_array, complex_part, complex_type};

use super::options::FftOptions;
use super::transform::{FftTransform, InputCoordinate};
use crate::config::ZarrConfig;
use crate::device::fft_cpu::BlockValues;
use crate::device::CpuFft;
use crate::table::cells::dimension_indices;
use crate::table::{
    literal_text, zarr_source, BlockGrid, Dimension, GridTable, Selection, TableFunctionCall,
    ZarrTable,
};
use crate::write::grid::{ZARR_ATTRIBUTES, ZARR_DIMENSION};
use crate::zarr::{ChunkBufferPool, ZarrArray};

/// Plans `fft(...)` and `ifft(...)` in `FROM` clauses.
#[derive(Debug)]
pub struct FftPlanner {
    runtime: Arc<RuntimeEnv>,
    catalogs: Arc<dyn CatalogProviderList>,
}

impl FftPlanner {
    /// A planner finding registered tables in `catalogs` and opening
    /// stores with `runtime`'s object stores.
    pub fn new(runtime: Arc<RuntimeEnv>, catalogs: Arc<dyn CatalogProviderList>) -> Self {
        Self { runtime, catalogs }
    }
}

impl RelationPlanner for FftPlanner {
    fn plan_relation(
        &self,
        relation: TableFactor,
        context: &mut dyn RelationPlannerContext,
    ) -> Result<RelationPlanning> {
        let (call, function) = match TableFunctionCall::parse(&relation, "fft", context)? {
            Some(call) => (call, "fft"),
            None => match TableFunctionCall::parse(&relation, "ifft", context)? {
                Some(call) => (call, "ifft"),
                None => return Ok(RelationPlanning::Original(Box::new(relation))),
            },
        };
        let (source, variable) = match call.positional.as_slice() {
            [source] => (literal_text(source, function, "the table or store")?, None),
            [source, variable] => (
                literal_text(source, function, "the table or store")?,
                Some(literal_text(variable, function, "the variable")?),
            ),
            _ => {
                return plan_err!(
                    "{function} takes a table or store, the variable, then options \
                     ({function}('era5', 't2m', dims => 'lat'))"
                )
            }
        };
        let mut options = if function == "ifft" {
            FftOptions::inverse(Vec::new())
        } else {
            FftOptions::forward(Vec::new())
        };
        options.set(&call.named, function)?;
        let table = zarr_source(&source, &self.catalogs, &self.runtime, context)?;
        let plan = fft_scan(&table, variable.as_deref(), options)?;
        Ok(RelationPlanning::Planned(Box::new(PlannedRelation::new(
            plan, call.alias,
        ))))
    }
}

/// A logical scan of `variable` of `table` transformed as `options` says:
/// what `fft(...)`, `ifft(...)` and `DataFrame.fft` plan.
pub fn fft_scan(
    table: &ZarrTable,
    variable: Option<&str>,
    options: FftOptions,
) -> Result<LogicalPlan> {
    let name = if options.inverse { "ifft()" } else { "fft()" };
    LogicalPlanBuilder::scan(
        TableReference::bare(name),
        provider_as_source(Arc::new(FftTable::new(table, variable, options)?)),
        None,
    )?
    .build()
}

/// The precision a transform computes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FloatWidth {
    /// float32 / complex64.
    Single,
    /// float64 / complex128.
    Double,
}

impl FloatWidth {
    /// The Arrow type of a part.
    fn part_type(self) -> DataType {
        match self {
            Self::Single => DataType::Float32,
            Self::Double => DataType::Float64,
        }
    }

    /// Bytes of one complex value.
    fn complex_bytes(self) -> usize {
        match self {
            Self::Single => 8,
            Self::Double => 16,
        }
    }
}

/// A variable of a Zarr table transformed along dimensions (see the
/// module docs).
#[derive(Debug)]
pub struct FftTable {
    source: Arc<GridTable>,
    /// Index of the variable in `source.variables`.
    variable: usize,
    transform: Arc<FftTransform>,
    width: FloatWidth,
    /// Output dimensions' values, outermost first.
    coords: Vec<ArrayRef>,
    schema: SchemaRef,
}

impl FftTable {
    /// `variable` of `table` (its only variable when `None`) transformed as
    /// `options` says. Errors (unknown variable or dimension, uneven or
    /// non-numeric coordinates, bad options) name the store and variable.
    pub fn new(table: &ZarrTable, variable: Option<&str>, options: FftOptions) -> Result<Self> {
        let grid = Arc::clone(table.grid());
        let names = || {
            grid.variables
                .iter()
                .map(|v| v.name())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let function = if options.inverse { "ifft" } else { "fft" };
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
        let Some(index) = index else {
            return plan_err!(
                "{function} of '{}': unknown variable '{}' (variables: {})",
                grid.store,
                variable.unwrap_or_default(),
                names()
            );
        };
        let array = &grid.variables[index];
        let fail = |message: String| {
            DataFusionError::Plan(format!(
                "{function} of '{}' variable '{}': {message}",
                grid.store,
                array.name()
            ))
        };
        let data_type = array.data_type();
        let part = complex_part(data_type).unwrap_or(data_type);
        if !part.is_numeric() {
            return Err(fail(format!("its values ({data_type}) are not numbers")));
        }
        let width = match part {
            DataType::Float32 | DataType::Float16 => FloatWidth::Single,
            _ => FloatWidth::Double,
        };
        let dims: Vec<String> = grid.dims.iter().map(|d| d.name.clone()).collect();
        let transform = FftTransform::new(&dims, &options, |name| {
            let dim = grid
                .dims
                .iter()
                .find(|d| d.name == name)
                .ok_or_else(|| format!("unknown dimension '{name}'"))?;
            input_coordinate(dim)
        })
        .map_err(fail)?;
        let value_type = if transform.real_output() {
            width.part_type()
        } else {
            complex_type(width.part_type())
        };
        let mut fields = Vec::with_capacity(dims.len() + 1);
        let mut coords = Vec::with_capacity(dims.len());
        for (d, dim) in grid.dims.iter().enumerate() {
            match transform.axes.iter().find(|(a, _)| *a == d) {
                Some((_, axis)) => {
                    // xrft's attributes of the output coordinate, kept by
                    // `COPY ... STORED AS ZARR` (an ifft of the copy finds its lag).
                    let mut attributes = serde_json::Map::new();
                    if !options.inverse {
                        attributes.insert("direct_lag".into(), axis.lag.into());
                    }
                    attributes.insert("spacing".into(), axis.spacing.into());
                    let metadata = HashMap::from([
                        (
                            ZARR_ATTRIBUTES.to_string(),
                            serde_json::Value::Object(attributes).to_string(),
                        ),
                        (ZARR_DIMENSION.to_string(), "ascending".to_string()),
                    ]);
                    fields.push(
                        Field::new(&axis.output_name, DataType::Float64, false)
                            .with_metadata(metadata),
                    );
                    coords.push(Arc::new(Float64Array::from(axis.coords.clone())) as ArrayRef);
                }
                None => {
                    let order = if dim.descends() {
                        "descending"
                    } else {
                        "ascending"
                    };
                    fields.push(
                        Field::new(
                            &dim.name,
                            dim.values.data_type().clone(),
                            dim.values.null_count() > 0,
                        )
                        .with_metadata(HashMap::from([(
                            ZARR_DIMENSION.to_string(),
                            order.to_string(),
                        )])),
                    );
                    coords.push(Arc::clone(&dim.values));
                }
            }
        }
        let output_dims = transform.output_dims();
        if output_dims.contains(&array.name().to_string()) {
            return Err(fail(
                "an output dimension is named like the variable; choose another prefix \
                 (prefix => 'k_')"
                    .to_string(),
            ));
        }
        fields.push(Field::new(array.name(), value_type, true));
        Ok(Self {
            variable: index,
            transform: Arc::new(transform),
            width,
            coords,
            schema: Arc::new(Schema::new(fields)),
            source: grid,
        })
    }

    /// The transform.
    pub fn transform(&self) -> &FftTransform {
        &self.transform
    }

    /// The output shape.
    fn output_shape(&self) -> Vec<u64> {
        self.transform.output_shape(&self.source.shape())
    }
}

/// A coordinate as numbers: numeric values as they are, times in seconds
/// (as xrft converts them).
fn input_coordinate(dim: &Dimension) -> Result<InputCoordinate, String> {
    let values = &dim.values;
    if values.null_count() > 0 {
        return Err(format!("coordinate '{}' has missing values", dim.name));
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
            ints.as_primitive::<datafusion::arrow::datatypes::Int64Type>()
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
                dim.name
            ))
        }
    };
    let direct_lag = dim.attributes.get("direct_lag").and_then(|v| v.as_f64());
    Ok(InputCoordinate {
        values: numbers,
        direct_lag,
    })
}

#[async_trait]
impl TableProvider for FftTable {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }

    fn table_type(&self) -> TableType {
        TableType::Temporary
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        _filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let projection = projection
            .cloned()
            .unwrap_or_else(|| (0..self.schema.fields().len()).collect());
        let memory_limit = match state.runtime_env().memory_pool.memory_limit() {
            MemoryLimit::Finite(bytes) => Some(bytes),
            _ => None,
        };
        let options = state.config_options();
        let exec = FftExec::try_new(self, projection, limit, options, memory_limit)?;
        Ok(Arc::new(exec))
    }

    fn statistics(&self) -> Option<Statistics> {
        let mut stats = Statistics::new_unknown(&self.schema);
        stats.num_rows = Precision::Exact(self.output_shape().iter().product::<u64>() as usize);
        Some(stats)
    }
}

/// What every partition of an [`FftExec`] shares.
#[derive(Debug)]
struct FftJob {
    source: Arc<GridTable>,
    variable: usize,
    transform: Arc<FftTransform>,
    width: FloatWidth,
    coords: Vec<ArrayRef>,
    /// Output columns (indices into the table's schema).
    projection: Vec<usize>,
    schema: SchemaRef,
    blocks: BlockGrid,
    batch_size: usize,
    limit: Option<usize>,
    single: CpuFft<f32>,
    double: CpuFft<f64>,
}

impl FftJob {
    fn array(&self) -> &ZarrArray {
        &self.source.variables[self.variable]
    }

    /// Whether the query reads the transformed values (else only the
    /// dimension columns, which cost no read and no transform).
    fn reads_values(&self) -> bool {
        self.projection.contains(&self.source.dims.len())
    }

    /// Bytes of one output row of the projected columns.
    fn row_bytes(&self) -> usize {
        let n_dims = self.source.dims.len();
        self.projection
            .iter()
            .map(|&i| {
                if i < n_dims {
                    self.coords[i].data_type().primitive_width().unwrap_or(16)
                } else {
                    self.width.complex_bytes()
                }
            })
            .sum()
    }

    /// Memory one task holds at its peak: a block read and decoded, its
    /// values before and after a pass (complex), and the batches in flight.
    fn per_task_memory(&self) -> usize {
        let batches = 3 * self.batch_size * self.row_bytes();
        if !self.reads_values() {
            return batches;
        }
        let in_cells = self.blocks.block_shape().iter().product::<u64>() as usize;
        let out_cells = self
            .transform
            .output_shape(self.blocks.block_shape())
            .iter()
            .product::<u64>() as usize;
        let read = in_cells * self.array().peak_bytes_per_cell();
        read + 2 * in_cells.max(out_cells) * self.width.complex_bytes() + batches
    }

    /// Memory the kernel's threads hold besides the blocks: per thread, a
    /// group of lines gathered and transformed.
    fn kernel_memory(&self) -> usize {
        if !self.reads_values() {
            return 0;
        }
        let longest = self
            .transform
            .axes
            .iter()
            .map(|(_, a)| a.len)
            .max()
            .unwrap_or(0);
        rayon::current_num_threads() * 3 * longest.max(1 << 14) * self.width.complex_bytes()
    }

    /// Reads, transforms and sends the rows of block `id`. Returns
    /// `Ok(false)` once the receiver is gone.
    fn run_block(
        &self,
        id: u64,
        remaining: &mut Option<u64>,
        pool: &ChunkBufferPool,
        tx: &tokio::sync::mpsc::Sender<Result<RecordBatch>>,
    ) -> Result<bool> {
        let extent = self.blocks.block(id);
        let shape: Vec<usize> = extent.iter().map(|r| (r.end - r.start) as usize).collect();
        let values = if self.reads_values() {
            let array = self.array();
            let fail = |message: String| {
                DataFusionError::Execution(format!(
                    "{} of '{}' variable '{}', block {extent:?}: {message}",
                    if self.transform.options.inverse {
                        "ifft"
                    } else {
                        "fft"
                    },
                    self.source.store,
                    array.name()
                ))
            };
            let read = array.read(&extent, pool)?;
            Some(match self.width {
                FloatWidth::Single => {
                    let values = block_values::<Float32Type>(&read).map_err(&fail)?;
                    drop(read);
                    let (out, _) = self
                        .transform
                        .apply(&self.single, values, &shape)
                        .map_err(&fail)?;
                    OutputValues::Single(out)
                }
                FloatWidth::Double => {
                    let values = block_values::<Float64Type>(&read).map_err(&fail)?;
                    drop(read);
                    let (out, _) = self
                        .transform
                        .apply(&self.double, values, &shape)
                        .map_err(&fail)?;
                    OutputValues::Double(out)
                }
            })
        } else {
            None
        };
        let out_shape = self
            .transform
            .output_shape(&extent.iter().map(|r| r.end - r.start).collect::<Vec<_>>());
        let offsets: Vec<u64> = extent
            .iter()
            .enumerate()
            .map(|(d, r)| {
                if self.transform.transforms(d) {
                    0
                } else {
                    r.start
                }
            })
            .collect();
        let mut n: u64 = out_shape.iter().product();
        if let Some(left) = remaining {
            n = n.min(*left);
        }
        let n_dims = self.source.dims.len();
        let mut start = 0u64;
        while start < n {
            let len = (self.batch_size as u64).min(n - start);
            let columns = self
                .projection
                .iter()
                .map(|&i| {
                    if i < n_dims {
                        let stride = out_shape[i + 1..].iter().product();
                        let indices = UInt32Array::from(dimension_indices(
                            offsets[i],
                            out_shape[i],
                            stride,
                            start,
                            len,
                        ));
                        Ok(take(self.coords[i].as_ref(), &indices, None)?)
                    } else {
                        let range = start as usize..(start + len) as usize;
                        Ok(match &values {
                            Some(OutputValues::Single(v)) => values_column::<Float32Type>(v, range),
                            Some(OutputValues::Double(v)) => values_column::<Float64Type>(v, range),
                            None => return exec_err!("the transformed values were not computed"),
                        })
                    }
                })
                .collect::<Result<Vec<_>>>()?;
            let options = RecordBatchOptions::new().with_row_count(Some(len as usize));
            let batch =
                RecordBatch::try_new_with_options(Arc::clone(&self.schema), columns, &options)?;
            if tx.blocking_send(Ok(batch)).is_err() {
                return Ok(false);
            }
            start += len;
        }
        if let Some(left) = remaining {
            *left -= n;
        }
        Ok(true)
    }
}

/// A transformed block, in its precision.
enum OutputValues {
    Single(BlockValues<f32>),
    Double(BlockValues<f64>),
}

/// The values of a block read as Arrow (numbers, or complex structs) in
/// precision `P`; missing values become NaN.
fn block_values<P>(read: &ArrayRef) -> Result<BlockValues<P::Native>, String>
where
    P: ArrowPrimitiveType,
    P::Native: FftNum,
{
    let nan = P::Native::from_f64(f64::NAN).unwrap_or_else(P::Native::zero);
    let part = |array: &ArrayRef, nulls: Option<&datafusion::arrow::buffer::NullBuffer>| {
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

/// Rows `range` of transformed values as an Arrow column (complex structs,
/// or numbers for a real output).
fn values_column<P>(values: &BlockValues<P::Native>, range: std::ops::Range<usize>) -> ArrayRef
where
    P: ArrowPrimitiveType,
{
    match values {
        BlockValues::Real(v) => Arc::new(PrimitiveArray::<P>::from_iter_values(
            v[range].iter().copied(),
        )),
        BlockValues::Complex(v) => {
            let v = &v[range];
            let re = PrimitiveArray::<P>::from_iter_values(v.iter().map(|c| c.re));
            let im = PrimitiveArray::<P>::from_iter_values(v.iter().map(|c| c.im));
            Arc::new(complex_array(Arc::new(re), Arc::new(im), None))
        }
    }
}

/// Transforms blocks of a Zarr variable and streams their rows (see the
/// module docs).
#[derive(Debug)]
pub struct FftExec {
    job: Arc<FftJob>,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl FftExec {
    /// Plans the transform of `table` for the columns `projection`:
    /// blocks whole along the transformed dimensions, as many tasks at
    /// once as `memory_limit` allows (refused when one does not fit).
    fn try_new(
        table: &FftTable,
        projection: Vec<usize>,
        limit: Option<usize>,
        options: &datafusion::common::config::ConfigOptions,
        memory_limit: Option<usize>,
    ) -> Result<Self> {
        let grid = &table.source;
        let shape = grid.shape();
        let mut chunk = grid.variables[table.variable].chunk_shape();
        for (axis, _) in &table.transform.axes {
            chunk[*axis] = shape[*axis];
        }
        let parallelism = options.execution.target_partitions.max(1);
        let bytes_per_cell = (grid.variables[table.variable].peak_bytes_per_cell()
            + 2 * table.width.complex_bytes()) as u64;
        let mut target = ZarrConfig::of(options).target_partition_bytes;
        if let Some(limit) = memory_limit {
            target = target.min(limit / (4 * parallelism));
        }
        let blocks = BlockGrid::plan(
            &shape,
            &chunk,
            &Selection::all(&shape),
            bytes_per_cell,
            target as u64,
            parallelism as u64,
        );
        let schema = Arc::new(table.schema.project(&projection)?);
        let job = FftJob {
            source: Arc::clone(grid),
            variable: table.variable,
            transform: Arc::clone(&table.transform),
            width: table.width,
            coords: table.coords.clone(),
            projection,
            schema: Arc::clone(&schema),
            batch_size: usize::from(options.execution.batch_size).max(1),
            limit,
            blocks,
            single: CpuFft::default(),
            double: CpuFft::default(),
        };
        let mut partitions = (job.blocks.num_blocks() as usize).clamp(1, parallelism);
        if let Some(limit) = memory_limit {
            let fits = |p: usize| p * job.per_task_memory() + job.kernel_memory() <= limit;
            while partitions > 1 && !fits(partitions) {
                partitions -= 1;
            }
            if !fits(partitions) {
                return plan_err!(
                    "FftExec of '{}' variable '{}' needs {} for one task (a block of shape {:?}, \
                     whole along the transformed dimensions, read, transformed and turned into \
                     rows) plus {} for the kernel's threads, but the memory limit \
                     (allowed_mem) is {}; raise it, or rechunk the store to smaller chunks along \
                     the other dimensions (transforms of lines larger than memory are not \
                     supported yet)",
                    grid.store,
                    job.array().name(),
                    human_readable_size(job.per_task_memory()),
                    job.blocks.block_shape(),
                    human_readable_size(job.kernel_memory()),
                    human_readable_size(limit)
                );
            }
        }
        let properties = Arc::new(PlanProperties::new(
            EquivalenceProperties::new(schema),
            Partitioning::UnknownPartitioning(partitions),
            EmissionType::Incremental,
            Boundedness::Bounded,
        ));
        Ok(Self {
            job: Arc::new(job),
            properties,
            metrics: ExecutionPlanMetricsSet::new(),
        })
    }

    /// Memory the whole operator is projected to hold at its peak.
    pub fn projected_memory(&self) -> usize {
        self.partitions() * self.job.per_task_memory() + self.job.kernel_memory()
    }

    fn partitions(&self) -> usize {
        self.properties.partitioning.partition_count()
    }

    fn partition_blocks(&self, partition: usize) -> std::ops::Range<u64> {
        let n = self.partitions() as u64;
        let total = self.job.blocks.num_blocks();
        let p = partition as u64;
        (p * total / n)..((p + 1) * total / n)
    }
}

impl DisplayAs for FftExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let job = &self.job;
        let options = &job.transform.options;
        let dims: Vec<&str> = job
            .transform
            .axes
            .iter()
            .map(|(_, a)| a.dim.as_str())
            .collect();
        let mut flags = Vec::new();
        if let Some(real) = &options.real_dim {
            flags.push(format!("real_dim={real}"));
        }
        for (set, name) in [
            (options.true_phase, "true_phase"),
            (options.true_amplitude, "true_amplitude"),
            (options.shift, "shift"),
        ] {
            if set {
                flags.push(name.to_string());
            }
        }
        if let Some(d) = options.detrend {
            flags.push(format!("detrend={d:?}").to_lowercase());
        }
        if let Some(w) = options.window {
            flags.push(format!("window={w:?}").to_lowercase());
        }
        write!(
            f,
            "FftExec: store={}, variable={}, {} along [{}] ({}), strategy=whole lines (blocks \
             of shape {:?}, {} blocks, {} tasks), device=cpu, precision={}, \
             projected_memory={}, read={}",
            job.source.store,
            job.array().name(),
            if options.inverse { "ifft" } else { "fft" },
            dims.join(", "),
            flags.join(", "),
            job.blocks.block_shape(),
            job.blocks.num_blocks(),
            self.partitions(),
            match job.width {
                FloatWidth::Single => "complex64",
                FloatWidth::Double => "complex128",
            },
            human_readable_size(self.projected_memory()),
            human_readable_size(if job.reads_values() {
                (job.source.num_rows() * job.array().element_size() as u64) as usize
            } else {
                0
            }),
        )
    }
}

impl ExecutionPlan for FftExec {
    fn name(&self) -> &str {
        "FftExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if !children.is_empty() {
            return exec_err!("FftExec has no children, got {}", children.len());
        }
        Ok(self)
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let blocks = self.partition_blocks(partition);
        let job = Arc::clone(&self.job);
        let memory = job.per_task_memory() + job.kernel_memory() / self.partitions();
        let reservation =
            MemoryConsumer::new(format!("FftExec[{partition}]")).register(context.memory_pool());
        reservation.try_grow(memory)?;
        MetricBuilder::new(&self.metrics)
            .gauge("memory_reserved", partition)
            .set(memory);
        let blocks_done = MetricBuilder::new(&self.metrics).counter("blocks", partition);
        let transform_time = MetricBuilder::new(&self.metrics).subset_time("block_time", partition);
        let mut builder = RecordBatchReceiverStreamBuilder::new(Arc::clone(&job.schema), 2);
        let tx = builder.tx();
        builder.spawn_blocking(move || {
            let _reservation = reservation;
            let pool = ChunkBufferPool::new();
            let mut remaining = job.limit.map(|l| l as u64);
            for id in blocks {
                if remaining == Some(0) {
                    break;
                }
                let timer = transform_time.timer();
                let sent = job.run_block(id, &mut remaining, &pool, &tx)?;
                timer.done();
                blocks_done.add(1);
                if !sent {
                    break;
                }
            }
            Ok(())
        });
        Ok(builder.build())
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    fn statistics_from_inputs(
        &self,
        _input_stats: &[Arc<Statistics>],
        args: &StatisticsArgs,
    ) -> Result<Arc<Statistics>> {
        let mut stats = Statistics::new_unknown(&self.job.schema);
        if args.partition().is_none() && self.job.limit.is_none() {
            let rows = self
                .job
                .transform
                .output_shape(&self.job.source.shape())
                .iter()
                .product::<u64>();
            stats.num_rows = Precision::Exact(rows as usize);
        }
        Ok(Arc::new(stats))
    }
}

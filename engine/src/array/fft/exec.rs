//! `FftExec`: transforms blocks of a source whole along the transformed
//! dimensions and streams their rows.
//!
//! Blocks align to the source's chunks along the other dimensions and grow
//! toward `zarrfusion.target_partition_bytes`; each partition owns a run of
//! blocks, reads and transforms one at a time on a blocking thread (the
//! kernel spreads the lines of a block over all cores) and sends batches
//! through a small channel. The projected memory (per task: a block read,
//! its values before and after a pass, the batches in flight; plus the
//! kernel threads' line buffers) is checked against `allowed_mem` while
//! planning: fewer tasks run at once when that fits, and a transform that
//! cannot fit with one task is refused with the numbers. A query that reads
//! only dimension columns reads and transforms nothing.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use datafusion::arrow::array::{
    ArrayRef, PrimitiveArray, RecordBatch, RecordBatchOptions, UInt64Array,
};
use datafusion::arrow::datatypes::{ArrowPrimitiveType, Float32Type, Float64Type, SchemaRef};
use datafusion::catalog::TableProvider;
use datafusion::common::{exec_err, human_readable_size, DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::EquivalenceProperties;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricBuilder};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties,
};
use zarrfusion_udfs::complex::complex_array;

use super::kernels::{Kernels, Precision, TransformClock};
use super::passes::PassBlocks;
use super::source::{ArraySource, Broadcast, ClusterStep, StoredStage};
use super::table::FftTable;
use super::transform::FftTransform;
use super::trend_pass::{DetrendFitExec, FittedExec};
use crate::array::rechunk::cluster::Round;
use crate::array::tasks::run_cluster_tasks;
use crate::config::ZarrConfig;
use crate::device::fft_cpu::BlockValues;
use crate::device::{choose_device, staging_memory, Device};
use crate::memory::{reserve, Projection};
use crate::plan_methods::{metered_plan_methods, named_plan_methods, no_expressions_method};
use crate::table::cells::dimension_indices;
use crate::table::{
    share_of, shown_tasks, task_share, BatchRuns, BlockGrid, Coordinate, ReadAheadPlan,
    RunStreamBuilder, Selection, TableReadAhead, TASKS_OF_STAGE,
};
use crate::zarr::ChunkBufferPool;

/// What every partition of an [`FftExec`] shares.
#[derive(Debug)]
struct FftJob {
    table: Arc<FftTable>,
    /// Output dimensions' values, outermost first.
    coords: Vec<Coordinate>,
    /// Output columns (indices into the table's schema).
    projection: Vec<usize>,
    schema: SchemaRef,
    blocks: BlockGrid,
    batch_size: usize,
    limit: Option<usize>,
    kernels: Kernels,
    /// Where the transforms run.
    device: Device,
    /// Page-locked bytes the kernels stage through on a GPU.
    staging: usize,
    /// The selection of the other dimensions filters chose the blocks by
    /// (rows are then a superset of the answer, filtered above).
    selection: Option<Selection>,
    /// Chunk requests in flight the read-ahead was planned for.
    io_concurrency: usize,
    /// Each task's reads ahead of it (a variable read from an object store
    /// block by block).
    read_ahead: ReadAheadPlan,
    /// The memory limit it was fitted to (the passes of a four-step path
    /// on a cluster are planned with it).
    memory_limit: Option<usize>,
}

impl FftJob {
    fn transform(&self) -> &FftTransform {
        self.table.transform()
    }

    fn source(&self) -> &ArraySource {
        self.table.source()
    }

    /// Whether the query reads the transformed values (else only the
    /// dimension columns, which cost no read and no transform).
    fn reads_values(&self) -> bool {
        self.projection.contains(&self.coords.len())
    }

    /// Bytes of one output row of the projected columns.
    fn row_bytes(&self) -> usize {
        self.projection
            .iter()
            .map(|&i| match self.coords.get(i) {
                Some(values) => values.data_type().primitive_width().unwrap_or(16),
                None => self.table.complex_bytes(),
            })
            .sum()
    }

    /// Memory one task holds at its peak: a block read and decoded, its
    /// values before and after a pass (complex), and the batches in flight.
    fn per_task_memory(&self) -> usize {
        // A batch never spans two blocks.
        let block: Vec<Range<u64>> = (self.blocks.block_shape().iter()).map(|&n| 0..n).collect();
        let block_cells = (self.table.output_extent(&block).iter())
            .fold(1u64, |cells, r| cells.saturating_mul(r.end - r.start));
        let batch_rows = self
            .batch_size
            .min(usize::try_from(block_cells).unwrap_or(usize::MAX));
        let batches = batch_rows.saturating_mul(3 * self.row_bytes());
        if !self.reads_values() {
            return batches;
        }
        block_memory(&self.table, self.blocks.block_shape()).saturating_add(batches)
    }

    /// Memory the kernel holds besides the blocks: per CPU thread, a group
    /// of lines gathered and transformed; on a GPU, the page-locked
    /// staging buffers too.
    fn kernel_memory(&self) -> usize {
        if !self.reads_values() {
            return 0;
        }
        kernel_memory(&self.table) + self.staging
    }

    /// Its projected memory with `tasks` tasks at once: each its block
    /// and the chunks it reads ahead, beside the kernel's threads.
    fn projection(&self, tasks: usize) -> Projection {
        let source = self.source();
        Projection::new(
            "FftExec",
            &format!("'{}' variable '{}'", source.store(), source.variable()),
            tasks,
            "task",
            (self.per_task_memory()).saturating_add(self.read_ahead.memory()),
        )
        .holding(format!(
            "a block of shape {:?}, whole along the transformed dimensions, read, transformed \
             and turned into rows",
            self.blocks.block_shape()
        ))
        .and(self.kernel_memory(), "the kernel's threads")
        .advice("raise it, or rechunk the store to smaller chunks along the other dimensions")
    }

    /// The transformed values of the block `extent`.
    fn transform_block<P: Precision>(
        &self,
        extent: &[Range<u64>],
        pool: &ChunkBufferPool,
    ) -> std::result::Result<BlockValues<P>, String> {
        transformed_block(&self.table, &self.kernels, extent, pool)
    }

    /// Reads, transforms and sends the rows of block `id`. Returns
    /// `Ok(false)` once the receiver is gone.
    fn run_block(
        &self,
        id: u64,
        remaining: &mut Option<u64>,
        pool: &ChunkBufferPool,
        runs: &mut BatchRuns,
    ) -> Result<bool> {
        let extent = self.blocks.block(id);
        let values = if self.reads_values() {
            let fail = |message: String| {
                DataFusionError::Execution(format!(
                    "{} of '{}' variable '{}', block {extent:?}: {message}",
                    if self.transform().options.inverse {
                        "ifft"
                    } else {
                        "fft"
                    },
                    self.source().store(),
                    self.source().variable()
                ))
            };
            Some(if self.table.single_precision() {
                OutputValues::Single(self.transform_block::<f32>(&extent, pool).map_err(fail)?)
            } else {
                OutputValues::Double(self.transform_block::<f64>(&extent, pool).map_err(fail)?)
            })
        } else {
            None
        };
        let out_extent = self.table.output_extent(&extent);
        let out_shape: Vec<u64> = out_extent.iter().map(|r| r.end - r.start).collect();
        let offsets: Vec<u64> = out_extent.iter().map(|r| r.start).collect();
        let mut n: u64 = out_shape.iter().product();
        if let Some(left) = remaining {
            n = n.min(*left);
        }
        let n_dims = self.coords.len();
        let mut start = 0u64;
        while start < n {
            let len = (self.batch_size as u64).min(n - start);
            let columns = self
                .projection
                .iter()
                .map(|&i| {
                    if i < n_dims {
                        let stride = out_shape[i + 1..].iter().product();
                        let indices = UInt64Array::from(dimension_indices(
                            offsets[i],
                            out_shape[i],
                            stride,
                            start,
                            len,
                        ));
                        Ok(self.coords[i].take(&indices)?)
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
            if !runs.push(batch) {
                return Ok(false);
            }
            start += len;
        }
        if let Some(left) = remaining {
            *left -= n;
        }
        Ok(runs.flush())
    }
}

/// The transformed values of block `extent` of `table`'s source (whole
/// along the transformed dimensions), in precision `P`; for the four-step
/// path, the output positions `extent` (the passes run first if not yet).
pub(crate) fn transformed_block<P: Precision>(
    table: &FftTable,
    kernels: &Kernels,
    extent: &[Range<u64>],
    pool: &ChunkBufferPool,
) -> std::result::Result<BlockValues<P>, String> {
    if let (Some(four_step), [(_, axis)]) = (table.four_step(), table.transform().axes.as_slice()) {
        four_step.ensure_done::<P>(table.source(), axis, kernels)?;
        return four_step.read_output::<P>(axis, extent);
    }
    let shape: Vec<usize> = extent.iter().map(|r| (r.end - r.start) as usize).collect();
    let values = table.source().read::<P>(extent, pool, kernels)?;
    let (out, _) = table
        .transform()
        .apply(&kernels.timed::<P>(), values, &shape)?;
    Ok(out)
}

/// How far tasks reading blocks of shape `block` of `table`'s source read
/// ahead of themselves, `readers` of them sharing one window: the chunks
/// of their blocks and `io_concurrency` more when the source is a stored
/// array ([`ArraySource::stored`]) in an object store read block by block,
/// or, on the four-step path, when its spectrum is in an object-store
/// `work_dir`; nothing otherwise (a local store, a computed source).
/// Callers fit it to the memory their tasks leave.
pub(crate) fn read_ahead_plan(
    table: &FftTable,
    block: &[u64],
    io_concurrency: usize,
    readers: usize,
) -> ReadAheadPlan {
    match (table.source().stored(), table.four_step()) {
        (_, Some(four_step)) => four_step.output_read_ahead(block, io_concurrency, readers),
        (Some((grid, variable)), None) => ReadAheadPlan::new(
            grid,
            &[grid.dims.len() + variable],
            io_concurrency,
            block,
            readers,
        ),
        _ => ReadAheadPlan::for_chunks(0, 0, 1, 0),
    }
}

/// Starts reading ahead (`plan`, from [`read_ahead_plan`]) the chunks of
/// the blocks `ids` of `blocks`, taken in order by `readers` tasks, once
/// the source exists: a copy in `work_dir` is made first, and the
/// four-step path's passes write the spectrum first (with `kernels`).
/// `None` without read-ahead; the tasks say when they are done with a
/// block.
pub(crate) fn start_read_ahead(
    table: &FftTable,
    plan: &ReadAheadPlan,
    kernels: &Kernels,
    blocks: &BlockGrid,
    ids: std::ops::Range<u64>,
    readers: usize,
) -> std::result::Result<Option<TableReadAhead>, String> {
    if plan.depth() == 0 {
        return Ok(None);
    }
    if let (Some(four_step), [(_, axis)]) = (table.four_step(), table.transform().axes.as_slice()) {
        if table.single_precision() {
            four_step.ensure_done::<f32>(table.source(), axis, kernels)?;
        } else {
            four_step.ensure_done::<f64>(table.source(), axis, kernels)?;
        }
        let blocks = blocks.clone();
        let window =
            four_step.start_output_read_ahead(plan, axis, ids, readers, move |id| blocks.block(id));
        return Ok(window.map(TableReadAhead::from));
    }
    let Some((grid, variable)) = table.source().stored() else {
        return Ok(None);
    };
    table.source().prepare(kernels)?;
    let blocks = blocks.clone();
    Ok(plan.start(
        grid,
        &[grid.dims.len() + variable],
        ids,
        readers,
        move |id| vec![blocks.block(id)],
    ))
}

/// The blocks of a transform of `table` that meet `selection` (of the
/// other dimensions): aligned to `chunk` (whole along the transformed
/// dimensions), grown toward the session's target partition bytes,
/// smaller under a memory limit.
pub(crate) fn plan_blocks(
    table: &FftTable,
    chunk: &[u64],
    selection: &Selection,
    options: &datafusion::common::config::ConfigOptions,
    memory_limit: Option<usize>,
) -> BlockGrid {
    let source = table.source();
    let shape = table.block_space();
    let parallelism = options.execution.target_partitions.max(1);
    let bytes_per_cell = (source.peak_bytes_per_cell() + 2 * table.complex_bytes()) as u64;
    let mut target = ZarrConfig::of(options).target_partition_bytes;
    if let Some(limit) = memory_limit {
        target = target.min(limit / (4 * parallelism));
    }
    BlockGrid::plan(
        &shape,
        chunk,
        selection,
        bytes_per_cell,
        target as u64,
        parallelism as u64,
    )
}

/// Memory a block of shape `block` takes read, decoded and transformed:
/// the source's peak per cell, and the values before and after a pass.
pub(crate) fn block_memory(table: &FftTable, block: &[u64]) -> usize {
    if let Some(four_step) = table.four_step() {
        // Output positions: spectrum rows read (a row more at each end of
        // a run) and the values taken from them.
        let cells = block.iter().product::<u64>() as usize;
        let lines = cells / block[four_step.plan.axis].max(1) as usize;
        return (2 * cells + 4 * lines * four_step.plan.rows) * table.complex_bytes();
    }
    let in_cells = block.iter().product::<u64>() as usize;
    let out_cells = table
        .transform()
        .output_shape(block)
        .iter()
        .product::<u64>() as usize;
    in_cells * table.source().peak_bytes_per_cell()
        + 2 * in_cells.max(out_cells) * table.complex_bytes()
}

/// Memory the kernel's threads hold besides the blocks: per thread, a group
/// of lines gathered and transformed.
pub(crate) fn kernel_memory(table: &FftTable) -> usize {
    if table.four_step().is_some() {
        // Reading the four-step output transforms nothing (the passes
        // budget their own kernels).
        return 0;
    }
    let longest = table
        .transform()
        .axes
        .iter()
        .map(|(_, a)| a.len)
        .max()
        .unwrap_or(0);
    kernel_lines_memory(longest, table.complex_bytes())
}

/// [`kernel_memory`] of transforms whose longest line is `longest`
/// complex values of `complex_bytes` each.
pub(crate) fn kernel_lines_memory(longest: usize, complex_bytes: usize) -> usize {
    rayon::current_num_threads() * 3 * longest.max(1 << 14) * complex_bytes
}

/// How `table` runs, as `EXPLAIN` shows it: by whole lines (of the store's
/// chunks, or of a rechunked copy), by the four-step path, or staged or
/// chained (through a store in `work_dir`), the first stage's or inner
/// transform's own strategy first.
pub(crate) fn strategy(table: &FftTable) -> String {
    let source = table.source();
    let before = match source {
        ArraySource::Rechunked(copy) => format!(
            "rechunked to {:?} in work_dir ({}), then ",
            copy.chunk_shape(),
            human_readable_size(copy.projected_memory() as usize)
        ),
        ArraySource::Staged(stage) => {
            let later: Vec<&str> = (table.transform().axes.iter())
                .map(|(_, a)| a.dim.as_str())
                .collect();
            stage.describe(&later)
        }
        _ => String::new(),
    };
    match table.four_step() {
        Some(four_step) => format!("{before}{}", four_step.describe(source)),
        None => format!("{before}whole lines"),
    }
}

/// A transformed block, in its precision.
enum OutputValues {
    Single(BlockValues<f32>),
    Double(BlockValues<f64>),
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
    /// The tasks of a cluster's stage the blocks are dealt to (1: one
    /// process transforms them all; see [`Self::with_tasks`]).
    tasks: usize,
    /// On a cluster, what the workers run before the output is read (see
    /// [`Self::on_cluster`]), each under the gathering of its blocks'
    /// counts: the four-step path's passes, a stage each
    /// (blockwise tasks of [`PassBlocks`]), or a staged transform's first stage.
    inputs: Vec<Arc<dyn ExecutionPlan>>,
    /// A staged transform's first stage when `inputs` runs it, and per
    /// input the blocks its tasks' counts add up to and what it is.
    first_stage: Option<(Arc<dyn StoredStage>, StageCounts)>,
}

/// A four-step pass as errors name it.
pub(super) fn pass_name(pass: usize) -> String {
    format!("pass {} of the four-step transform", pass + 1)
}

/// Per input of a first stage on a cluster, the blocks its tasks' counts
/// add up to and what it is (for errors).
type StageCounts = Vec<(u64, String)>;

/// The blocks an [`FftExec`] reads and how it sends their rows, as a
/// session plans them and a cluster's worker receives them.
#[derive(Debug, Clone)]
pub struct FftBlocks {
    /// The output columns (indices into the transform's schema).
    pub projection: Vec<usize>,
    /// The selection of the other dimensions that filters chose the
    /// blocks by (`None`: every block).
    pub selection: Option<Selection>,
    /// The blocks, whole along the transformed dimensions.
    pub blocks: BlockGrid,
    /// The most tasks run at once.
    pub partitions: usize,
    /// The most rows sent.
    pub limit: Option<usize>,
    /// Rows per batch.
    pub batch_size: usize,
    /// Chunk requests in flight when reading ahead.
    pub io_concurrency: usize,
}

impl FftExec {
    /// Plans the transform of `table` for the columns `projection`:
    /// blocks whole along the transformed dimensions, as many tasks at
    /// once as `memory_limit` allows (refused when one does not fit).
    pub(crate) fn try_new(
        table: &FftTable,
        projection: Vec<usize>,
        selection: Option<Selection>,
        limit: Option<usize>,
        options: &datafusion::common::config::ConfigOptions,
        memory_limit: Option<usize>,
    ) -> Result<Self> {
        let chunk = table.block_chunk();
        let parallelism = options.execution.target_partitions.max(1);
        let all = Selection::all(&table.block_space());
        let blocks = plan_blocks(
            table,
            &chunk,
            selection.as_ref().unwrap_or(&all),
            options,
            memory_limit,
        );
        let config = ZarrConfig::of(options);
        let run = FftBlocks {
            projection,
            partitions: (blocks.num_blocks() as usize).clamp(1, parallelism),
            selection,
            blocks,
            limit,
            batch_size: usize::from(options.execution.batch_size).max(1),
            io_concurrency: config.io_concurrency,
        };
        Self::with_blocks(table, run, &config.device, memory_limit)
    }

    /// The transform of `table` reading the blocks `run` plans (as a
    /// session planned them, or as a cluster's worker received them) on
    /// the device `device` names, with at most `run.partitions` tasks at
    /// once: fewer when `memory_limit` needs, refused when one does not
    /// fit.
    pub(crate) fn with_blocks(
        table: &FftTable,
        run: FftBlocks,
        device: &str,
        memory_limit: Option<usize>,
    ) -> Result<Self> {
        let source = table.source();
        let device = choose_device(device).map_err(|e| {
            DataFusionError::Plan(format!(
                "FftExec of '{}' variable '{}': {e}",
                source.store(),
                source.variable()
            ))
        })?;
        let full_schema = table.schema();
        let schema = Arc::new(full_schema.project(&run.projection)?);
        let metrics = ExecutionPlanMetricsSet::new();
        let staging = staging_memory(device, memory_limit);
        let job = FftJob {
            coords: table
                .output_dims()
                .into_iter()
                .map(|d| d.coordinate)
                .collect(),
            table: Arc::new(table.clone()),
            projection: run.projection,
            schema: Arc::clone(&schema),
            batch_size: run.batch_size.max(1),
            limit: run.limit,
            blocks: run.blocks,
            kernels: Kernels::on(device, staging, TransformClock::in_metrics(&metrics)),
            device,
            staging,
            selection: run.selection,
            io_concurrency: run.io_concurrency,
            read_ahead: ReadAheadPlan::for_chunks(0, 0, 1, 0),
            memory_limit,
        };
        let mut partitions = run
            .partitions
            .clamp(1, (job.blocks.num_blocks() as usize).max(1));
        if let Some(limit) = memory_limit {
            let fits = |p: usize| job.projection(p).total() <= limit;
            while partitions > 1 && !fits(partitions) {
                partitions -= 1;
            }
            job.projection(partitions).check(limit)?;
        }
        // Blocks of a stored array read as they are (the variable, or its
        // rechunked copy or first stage in work_dir): their chunks are read
        // ahead, in what memory the tasks leave.
        let mut job = job;
        if job.reads_values() {
            let mut plan = read_ahead_plan(table, job.blocks.block_shape(), job.io_concurrency, 1)
                .split(partitions);
            if let Some(limit) = memory_limit {
                let used = partitions * job.per_task_memory() + job.kernel_memory();
                plan = plan.within(limit.saturating_sub(used) / partitions);
            }
            job.read_ahead = plan;
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
            metrics,
            tasks: 1,
            inputs: Vec::new(),
            first_stage: None,
        })
    }

    /// This transform with its blocks dealt to `tasks` tasks of a
    /// cluster's stage ([`TASKS_OF_STAGE`]: as many as its stage runs):
    /// each (its index from its `DistributedTaskContext`) transforms its
    /// own run, split among its partitions.
    pub fn with_tasks(&self, tasks: usize) -> Self {
        Self {
            job: Arc::clone(&self.job),
            properties: Arc::clone(&self.properties),
            // The kernels' clock counts into these.
            metrics: self.metrics.clone(),
            tasks,
            inputs: self.inputs.clone(),
            first_stage: self.first_stage.clone(),
        }
    }

    /// The rounds of the first stage [`Self::on_cluster`] put on a
    /// cluster's workers, in the order they run: each stage's leaf (its
    /// tasks each yield how many blocks they ran), the blocks their counts
    /// add up to and what it is. `None` without such a first stage.
    pub fn first_stage_rounds(&self) -> Option<Vec<ClusterStep>> {
        let (_, steps) = self.first_stage.as_ref()?;
        (self.inputs.iter().zip(steps))
            .map(|(gathered, (blocks, what))| {
                let leaf = gathered.downcast_ref::<CoalescePartitionsExec>()?.input();
                Some(ClusterStep {
                    leaf: Arc::clone(leaf),
                    blocks: *blocks,
                    what: what.clone(),
                })
            })
            .collect()
    }

    /// The two passes [`Self::on_cluster`] put on a cluster's workers for
    /// the four-step path, in order: each pass's leaf (its tasks each
    /// yield how many blocks they ran), the blocks their counts add up to
    /// and what it is. `None` for other paths, or when they already run
    /// one after the other on the workers.
    pub fn pass_rounds(&self) -> Option<Vec<ClusterStep>> {
        let four_step = self.job.table.four_step()?;
        if self.first_stage.is_some() || self.inputs.len() != 2 {
            return None;
        }
        (self.inputs.iter().enumerate())
            .map(|(pass, gathered)| {
                let leaf = gathered.downcast_ref::<CoalescePartitionsExec>()?.input();
                Some(ClusterStep {
                    leaf: Arc::clone(leaf),
                    blocks: four_step.pass_tasks(pass),
                    what: pass_name(pass),
                })
            })
            .collect()
    }

    /// The rounds of the rechunked copy this transform reads, to run on a
    /// cluster's workers (see [`Self::reading_copy_on_workers`]); `None`
    /// for other sources, or once the copy is made (or made by them).
    pub fn copy_rounds(&self) -> Option<Result<Vec<Round>>> {
        match self.job.table.source() {
            ArraySource::Rechunked(copy) if !copy.is_copied() && self.inputs.is_empty() => {
                Some(copy.rounds())
            }
            _ => None,
        }
    }

    /// This transform reading its rechunked copy on a cluster's workers
    /// once they made it ([`Self::copy_rounds`], which whatever holds this
    /// runs first), its blocks dealt to the tasks of its stage.
    pub fn reading_copy_on_workers(&self) -> Self {
        if let ArraySource::Rechunked(copy) = self.job.table.source() {
            copy.copied_by_workers();
        }
        self.with_tasks(TASKS_OF_STAGE)
    }

    /// This transform on the four-step path reading its output on a
    /// cluster's workers once `input` (the second pass's counts, that pass
    /// run after the first on the workers) says every block of the last
    /// pass ran, its own blocks dealt to the tasks of its stage.
    pub fn after_passes(&self, input: Arc<dyn ExecutionPlan>) -> Self {
        Self {
            inputs: vec![input],
            first_stage: None,
            ..self.with_tasks(TASKS_OF_STAGE)
        }
    }

    /// This transform, the stage after a staged transform's first as a
    /// cluster's worker received it, reading `stage` once `input` (the
    /// first stage's counts of its `blocks` blocks) says every block is
    /// stored, its own blocks dealt to the tasks of its stage.
    pub fn after_first_stage(
        &self,
        input: Arc<dyn ExecutionPlan>,
        stage: Arc<dyn StoredStage>,
        blocks: u64,
    ) -> Self {
        let what = "the first stage of the staged transform".to_string();
        Self {
            inputs: vec![input],
            first_stage: Some((stage, vec![(blocks, what)])),
            ..self.with_tasks(TASKS_OF_STAGE)
        }
    }

    /// The first stage its inputs run on a cluster's workers (see
    /// [`Self::on_cluster`]), and the blocks of its last input (the runs
    /// of its blocks, each task storing its own).
    pub fn first_stage(&self) -> Option<(&Arc<dyn StoredStage>, u64)> {
        let (stage, steps) = self.first_stage.as_ref()?;
        Some((stage, steps.last()?.0))
    }

    /// This transform with what its path writes in `work_dir` first as
    /// its inputs, to run on a cluster's workers: the passes of its
    /// four-step path ([`super::passes`]: a stage each,
    /// blockwise tasks of [`PassBlocks`] under the gathering of their counts, run
    /// one after the other), or the first stage of a staged transform (or
    /// of a chain's stored inner transform, [`super::staged`]: a stage
    /// whose tasks transform runs of its blocks and store them, after its
    /// own four-step passes when it takes that path), before the output is
    /// read here. `None` when they already are, for the other paths (whole
    /// lines read from the variable go to the workers themselves, see
    /// [`Self::with_tasks`]) and for what a worker cannot make again (a
    /// detrended source but on the four-step path, a table not opened
    /// from a location), which runs in the session. A detrended source on
    /// the four-step path has its fit as a stage before the first pass
    /// ([`super::trend_pass`]), whose rows `broadcast` sends to every task
    /// of that pass.
    pub fn on_cluster(&self, broadcast: &Broadcast) -> Result<Option<Self>> {
        let table = &self.job.table;
        if !self.inputs.is_empty() {
            return Ok(None);
        }
        if let ArraySource::Staged(stage) = table.source() {
            let Some(cluster) = stage.on_cluster(self.job.device, broadcast) else {
                return Ok(None);
            };
            let (inputs, steps) = (cluster.steps.into_iter())
                .map(|s| {
                    let gathered = Arc::new(CoalescePartitionsExec::new(s.leaf));
                    (gathered as Arc<dyn ExecutionPlan>, (s.blocks, s.what))
                })
                .unzip();
            return Ok(Some(Self {
                inputs,
                first_stage: Some((Arc::clone(stage), steps)),
                ..self.with_tasks(self.tasks)
            }));
        }
        let Some(four_step) = table.four_step() else {
            return Ok(None);
        };
        if table.four_step_chain().is_none() {
            return Ok(None);
        }
        let passes = [0, 1]
            .into_iter()
            .map(|pass| {
                let exec: Arc<dyn ExecutionPlan> = Arc::new(PassBlocks::tasks(
                    Arc::clone(table),
                    Arc::clone(four_step),
                    pass,
                    self.job.device,
                    self.job.memory_limit,
                )?);
                // A detrend's fit is a stage before the first pass.
                let exec = match (pass, table.detrended()) {
                    (0, Some(detrended)) => {
                        let fit = Arc::new(DetrendFitExec::new(Arc::clone(table))?);
                        let detrended = Arc::clone(detrended);
                        Arc::new(FittedExec::new(broadcast(fit), exec, detrended)?) as _
                    }
                    _ => exec,
                };
                Ok(Arc::new(CoalescePartitionsExec::new(exec)) as _)
            })
            .collect::<Result<_>>()?;
        Ok(Some(Self {
            inputs: passes,
            ..self.with_tasks(self.tasks)
        }))
    }

    /// The tasks the blocks are dealt to.
    pub fn tasks(&self) -> usize {
        self.tasks
    }

    /// The transform.
    pub fn table(&self) -> &FftTable {
        &self.job.table
    }

    /// The blocks it reads and how, as [`Self::with_blocks`] takes them.
    pub fn blocks(&self) -> FftBlocks {
        let job = &self.job;
        FftBlocks {
            projection: job.projection.clone(),
            selection: job.selection.clone(),
            blocks: job.blocks.clone(),
            partitions: self.partitions(),
            limit: job.limit,
            batch_size: job.batch_size,
            io_concurrency: job.io_concurrency,
        }
    }

    /// Bytes of the variable its blocks read (what a cluster's tasks are
    /// sized by): the blocks' cells times a stored value's bytes.
    pub fn bytes_read(&self) -> u64 {
        let job = &self.job;
        if !job.reads_values() {
            return 0;
        }
        let cells: u64 = job.blocks.block_shape().iter().product();
        (job.blocks.num_blocks())
            .saturating_mul(cells)
            .saturating_mul(job.source().element_size() as u64)
    }

    /// Memory the whole operator is projected to hold at its peak.
    pub fn projected_memory(&self) -> usize {
        self.job.projection(self.partitions()).total()
    }

    fn partitions(&self) -> usize {
        self.properties.partitioning.partition_count()
    }

    /// The blocks partition `partition` transforms: its share of all of
    /// them, or on a cluster of the run of the task it runs as.
    fn partition_blocks(
        &self,
        partition: usize,
        context: &Arc<TaskContext>,
    ) -> Result<std::ops::Range<u64>> {
        let all = 0..self.job.blocks.num_blocks();
        let store = self.job.source().store();
        let run = task_share("FftExec", store, self.tasks, all, context)?;
        Ok(share_of(run, partition as u64, self.partitions() as u64))
    }
}

impl DisplayAs for FftExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let job = &self.job;
        let asked = job.table.asked_transform();
        let options = &asked.options;
        let dims: Vec<&str> = asked.axes.iter().map(|(_, a)| a.dim.as_str()).collect();
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
            "FftExec: store={}, variable={}, {} along [{}] ({}), strategy={} (blocks of shape \
             {:?}, {} blocks, {} tasks{}), device={}, precision={}, projected_memory={}, read={}{}",
            job.source().store(),
            job.source().variable(),
            if options.inverse { "ifft" } else { "fft" },
            dims.join(", "),
            flags.join(", "),
            strategy(&job.table),
            job.blocks.block_shape(),
            job.blocks.num_blocks(),
            self.partitions(),
            job.read_ahead,
            job.device,
            if job.table.single_precision() {
                "complex64"
            } else {
                "complex128"
            },
            human_readable_size(self.projected_memory()),
            human_readable_size(if job.reads_values() {
                job.source().shape().iter().product::<u64>() as usize * job.source().element_size()
            } else {
                0
            }),
            shown_tasks(self.tasks),
        )?;
        match (&self.first_stage, self.inputs.is_empty()) {
            (Some(_), _) => write!(f, ", first stage on the cluster's workers")?,
            (None, false) => write!(f, ", passes on the cluster's workers")?,
            (None, true) => {}
        }
        Ok(())
    }
}

impl ExecutionPlan for FftExec {
    named_plan_methods!("FftExec");

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        self.inputs.iter().collect()
    }

    no_expressions_method!();

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if children.len() != self.inputs.len() {
            return exec_err!(
                "FftExec has {} children, got {}",
                self.inputs.len(),
                children.len()
            );
        }
        Ok(Arc::new(Self {
            inputs: children,
            ..self.with_tasks(self.tasks)
        }))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let blocks = self.partition_blocks(partition, &context)?;
        let job = Arc::clone(&self.job);
        let memory = (job.per_task_memory())
            .saturating_add(job.read_ahead.memory())
            .saturating_add(job.kernel_memory() / self.partitions().max(1));
        let store = job.source().store().to_string();
        let reservation = reserve(
            "FftExec",
            &store,
            partition,
            memory,
            &context,
            &self.metrics,
        )?;
        let blocks_done = MetricBuilder::new(&self.metrics).counter("blocks", partition);
        let transform_time = MetricBuilder::new(&self.metrics).subset_time("block_time", partition);
        // On a cluster, the four-step path's passes or a staged
        // transform's first stage run on the workers first (once,
        // whichever partition comes first; the others wait).
        let inputs = match self.inputs.as_slice() {
            [] => None,
            inputs => {
                let handle = tokio::runtime::Handle::try_current().map_err(|e| {
                    DataFusionError::Execution(format!("FftExec needs a runtime: {e}"))
                })?;
                Some((handle, inputs.to_vec(), Arc::clone(&context)))
            }
        };
        let first_stage = self.first_stage.clone();
        // Batches sent one at a time: a block's transform takes far longer
        // than handing its batches over.
        let mut builder = RunStreamBuilder::new(Arc::clone(&job.schema));
        let mut runs = builder.runs(1);
        builder.spawn_blocking(move || {
            let _reservation = reservation;
            let failed = |e: String| {
                DataFusionError::Execution(format!(
                    "fft of '{}' variable '{}': {e}",
                    job.source().store(),
                    job.source().variable()
                ))
            };
            let stopped = || runs.is_closed();
            match (inputs, first_stage, job.table.four_step()) {
                (Some((handle, inputs, context)), Some((stage, steps)), _) => stage
                    .written_by(&mut || {
                        // One stage after the other: the four-step passes,
                        // when the first stage takes that path, then its
                        // blocks.
                        for (input, (blocks, what)) in inputs.iter().zip(&steps) {
                            let (input, context) = (Arc::clone(input), Arc::clone(&context));
                            run_cluster_tasks(&handle, input, context, &stopped, *blocks, what)
                                .map_err(|e| e.to_string())?;
                        }
                        Ok(())
                    })
                    .map_err(failed)?,
                (Some((handle, passes, context)), None, Some(four_step)) => four_step
                    .ensure_done_by(|| {
                        // Both passes' counts, run in turn; or the second
                        // pass's only, the first run before it on the
                        // workers (`after_passes`).
                        let first = 2usize.saturating_sub(passes.len());
                        for (pass, input) in (first..).zip(passes) {
                            let blocks = four_step.pass_tasks(pass);
                            let what = pass_name(pass);
                            run_cluster_tasks(
                                &handle,
                                input,
                                Arc::clone(&context),
                                &stopped,
                                blocks,
                                &what,
                            )
                            .map_err(|e| e.to_string())?;
                        }
                        Ok(())
                    })
                    .map_err(failed)?,
                _ => {}
            }
            // The blocks' chunks, read ahead once they exist (a copy in
            // work_dir is made first).
            let read_ahead = start_read_ahead(
                &job.table,
                &job.read_ahead,
                &job.kernels,
                &job.blocks,
                blocks.clone(),
                1,
            )
            .map_err(failed)?;
            let pool = ChunkBufferPool::new();
            let mut remaining = job.limit.map(|l| l as u64);
            for id in blocks {
                if remaining == Some(0) {
                    break;
                }
                let timer = transform_time.timer();
                let sent = job.run_block(id, &mut remaining, &pool, &mut runs);
                if let Some(read_ahead) = &read_ahead {
                    read_ahead.done_with(id);
                }
                let sent = sent?;
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

    metered_plan_methods!(|exec| {
        let job = &exec.job;
        (job.limit.is_none() && job.selection.is_none())
            .then(|| job.table.output_shape().iter().product())
    });
}

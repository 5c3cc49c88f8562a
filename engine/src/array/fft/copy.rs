//! `COPY` of a transform to Zarr, block by block: when a COPY's input is
//! a whole `fft(...)`/`ifft(...)` result (every column, no filter, no
//! `LIMIT`), each block is transformed and its values stored straight
//! into the new store's chunks, inside `allowed_mem`, instead of rows
//! gathered in memory first.
//!
//! ```sql
//! COPY (SELECT * FROM fft('era5', 't2m', dims => 'lat')) TO 'spectrum.zarr' STORED AS ZARR;
//! ```
//!
//! The store has the output dimensions' coordinates (frequencies with
//! xrft's `direct_lag` and `spacing` attributes) and the variable as
//! complex64/complex128 (real for an inverse with a real dimension). Its
//! chunks are the `chunks` option's lengths where given, else whole along
//! the transformed dimensions and the blocks' lengths along the others;
//! blocks align to them, so every chunk is written once, by one task. A
//! local store is written beside the target and renamed into place when
//! complete; an object-store target (which must be empty) gets its chunks
//! first and its metadata last, and is erased when the copy fails.
//!
//! Primitives (see [`crate::array`]): blockwise (the transform of each
//! block, written as whole target chunks: [`BlockWrites`] is the kernel of
//! a [`BlockwiseStep`]) + write. On a cluster the blocks are dealt in runs
//! to a stage's tasks (the blockwise primitive's [`BlockwiseTasksExec`]),
//! which write into the target the session staged; the session writes
//! the coordinates first and the metadata last.

use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use datafusion::catalog::Session;
use datafusion::common::config::ConfigOptions;
use datafusion::common::{
    exec_err, human_readable_size, internal_err, plan_err, DataFusionError, Result,
};
use datafusion::datasource::source_as_provider;
use datafusion::execution::memory_pool::MemoryLimit;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::dml::CopyTo;
use datafusion::logical_expr::{Expr, LogicalPlan, UserDefinedLogicalNodeCore};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use serde_json::Map;
use zarrfusion_udfs::complex::complex_part;
use zarrs::array::Array as ZarrsArray;
use zarrs::storage::ReadableWritableListableStorageTraits;

use super::exec::{
    block_memory, kernel_memory, pass_name, plan_blocks, read_ahead_plan, start_read_ahead,
    transformed_block,
};
use super::kernels::{Kernels, Precision, TransformClock};
use super::passes::PassBlocks;
use super::source::{ArraySource, Broadcast, ClusterStep};
use super::table::FftTable;
use super::trend_pass::{DetrendFitExec, FittedExec};
use crate::array::blockwise::{
    BlockwiseStep, BlockwiseTasks, BlockwiseTasksExec, ChunksInto, MayWrite, Step, StepBytes,
    StepGrid, StepWriters,
};
use crate::array::rechunk::cluster::Round;
use crate::array::rechunk::TargetEncoding;
use crate::array::tasks::{run_cluster_tasks, run_tasks};
use crate::config::ZarrConfig;
use crate::device::fft_cpu::BlockValues;
use crate::device::{choose_device, staging_memory, Device};
use crate::memory::Projection;
use crate::plan_methods::{
    leaf_node_methods, metered_plan_methods, named_plan_methods, no_expressions_method,
    node_identity,
};
use crate::table::{BlockGrid, BroadcastInputs, ReadAheadPlan, Selection};
use crate::write::grid::field_attributes;
use crate::write::store::{
    coordinate_projection, coordinate_write_memory, prepare_group, store_box, GroupCoordinate,
    GroupVariable,
};
use crate::write::target::{CopyTarget, StagedTarget};
use crate::write::write_job::{count_properties, WriteJob, Written};
use crate::zarr::ChunkBufferPool;

/// The [`FftCopy`] a COPY is, when its input is a whole transform result:
/// a scan of an `fft(...)`/`ifft(...)` table under aliases and projections
/// that keep every column as it is, to a Zarr target (local or object store).
pub(crate) fn fft_copy(copy: &CopyTo) -> Result<Option<FftCopy>> {
    let Some(to) = CopyTarget::of(copy)? else {
        return Ok(None);
    };
    let mut node = copy.input.as_ref();
    loop {
        node = match node {
            LogicalPlan::SubqueryAlias(alias) => alias.input.as_ref(),
            LogicalPlan::Projection(projection) => {
                let input_schema = projection.input.schema();
                let keeps = projection.expr.len() == input_schema.fields().len()
                    && projection.expr.iter().zip(input_schema.columns()).all(
                        |(expr, column)| matches!(expr, Expr::Column(c) if c.name == column.name),
                    );
                if !keeps {
                    return Ok(None);
                }
                projection.input.as_ref()
            }
            _ => break,
        };
    }
    let LogicalPlan::TableScan(scan) = node else {
        return Ok(None);
    };
    if !scan.filters.is_empty() || scan.fetch.is_some() {
        return Ok(None);
    }
    let provider = source_as_provider(&scan.source)?;
    let Some(table) = (provider.as_ref() as &dyn std::any::Any).downcast_ref::<FftTable>() else {
        return Ok(None);
    };
    let all_columns = (0..table.schema_ref().fields().len()).collect::<Vec<_>>();
    if scan.projection.as_ref().is_some_and(|p| *p != all_columns) {
        return Ok(None);
    }
    let names: Vec<String> = table.output_dims().into_iter().map(|d| d.name).collect();
    if to.options.dims.as_ref().is_some_and(|dims| *dims != names) {
        return Ok(None);
    }
    Ok(Some(FftCopy {
        table: Arc::new(table.clone()),
        to,
    }))
}

/// `COPY` of a transform result to a new Zarr store (see the module
/// docs). A leaf node whose output is the row count.
#[derive(Debug, Clone)]
pub struct FftCopy {
    table: Arc<FftTable>,
    to: CopyTarget,
}

impl FftCopy {
    /// Plans the copy: blocks aligned to the target's chunks, as many
    /// tasks as the session's memory limit allows; refused when the target
    /// exists, the chunks are bad, or one task does not fit.
    pub async fn plan(&self, session: &dyn Session) -> Result<FftCopyExec> {
        self.to.check()?;
        let table = &self.table.fitted(session).await?;
        let dims = table.output_dims();
        let shape = table.output_shape();
        for (dim, _) in &self.to.options.chunks {
            if !dims.iter().any(|d| &d.name == dim) {
                return plan_err!(
                    "Zarr option 'chunks' names '{dim}', which is not a dimension of the result ({})",
                    dims.iter().map(|d| d.name.as_str()).collect::<Vec<_>>().join(", ")
                );
            }
        }
        let given = |d: usize| {
            (self.to.options.chunks)
                .iter()
                .find(|(n, _)| *n == dims[d].name)
                .map(|(_, c)| (*c).clamp(1, shape[d].max(1)))
        };
        // Blocks align to the target's chunks along the other dimensions.
        // (Along the transformed dimensions, blocks are whole lines, or for
        // the four-step path the target's chunks.)
        let mut align = table.block_chunk();
        for (d, length) in align.iter_mut().enumerate() {
            let whole = table.transform().transforms(d) && table.four_step().is_none();
            if let (false, Some(c)) = (whole, given(d)) {
                *length = c;
            }
        }
        let options = session.config_options();
        let memory_limit = match session.runtime_env().memory_pool.memory_limit() {
            // The four-step passes hold half the limit while blocks are written.
            MemoryLimit::Finite(bytes) if table.runs_passes_first() => Some(bytes / 2),
            MemoryLimit::Finite(bytes) => Some(bytes),
            _ => None,
        };
        let device = choose_device(&ZarrConfig::of(options).device).map_err(|e| {
            DataFusionError::Plan(format!(
                "FftCopyExec of '{}' variable '{}': {e}",
                table.source().store(),
                table.source().variable()
            ))
        })?;
        let all = Selection::all(&table.block_space());
        let blocks = plan_blocks(table, &align, &all, options, memory_limit);
        let block_out: Vec<u64> = table
            .output_extent(&blocks.block(0))
            .iter()
            .map(|r| r.end - r.start)
            .collect();
        let chunks: Vec<u64> = (0..dims.len())
            .map(|d| given(d).unwrap_or(block_out[d]).max(1))
            .collect();
        let staging = staging_memory(device, memory_limit);
        let tasks = WriteTasks::plan(table, blocks, staging, memory_limit, options);
        if let Some(limit) = memory_limit {
            tasks.projection("FftCopyExec", table).check(limit)?;
            coordinate_projection(table.source().store(), &shape).check(limit)?;
        }
        let metrics = ExecutionPlanMetricsSet::new();
        Ok(FftCopyExec {
            job: Arc::new(CopyJob {
                writes: Arc::new(BlockWrites {
                    table: Arc::clone(table),
                    tasks,
                    kernels: Kernels::on(device, staging, TransformClock::in_metrics(&metrics)),
                    device,
                }),
                chunks,
                to: self.to.clone(),
                runtime: Arc::clone(session.runtime_env()),
            }),
            cluster: None,
            properties: count_properties(),
            metrics,
        })
    }
}

node_identity!(
    FftCopy,
    eq: |a, b| {
        Arc::ptr_eq(&a.table, &b.table) && a.to == b.to
    },
    hash: |node, mut state| node.to.location.hash(&mut state)
);

impl UserDefinedLogicalNodeCore for FftCopy {
    leaf_node_methods!("FftCopy", to.schema);

    fn fmt_for_explain(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "FftCopy: store={}, variable={}, target={}, chunks={:?}, codec={:?}, zarr_format={:?}",
            self.table.source().store(),
            self.table.source().variable(),
            self.to.location,
            self.to.options.chunks,
            self.to.options.codec,
            self.to.options.zarr_format
        )
    }
}

/// The copy, planned.
#[derive(Debug)]
struct CopyJob {
    /// The blocks and how they are written.
    writes: Arc<BlockWrites>,
    /// The target variable's chunk shape.
    chunks: Vec<u64>,
    to: CopyTarget,
    /// Where an object-store target's credentials are registered.
    runtime: Arc<RuntimeEnv>,
}

impl CopyJob {
    /// The most memory the write holds: its tasks', or its coordinates'
    /// (written before the tasks run).
    fn projected(&self) -> usize {
        (self.writes.tasks)
            .projected()
            .max(self.coordinate_memory())
    }

    /// The memory writing its coordinates holds.
    fn coordinate_memory(&self) -> usize {
        let memory = coordinate_write_memory(&self.writes.table.output_shape());
        usize::try_from(memory).unwrap_or(usize::MAX)
    }

    /// Writes the store atomically: a local one beside the target (the
    /// group, the coordinates and the variable's metadata, then every
    /// block), renamed into place; an object-store one (which must be
    /// empty) with its metadata last, erased when the copy fails.
    fn write(&self, cancelled: &AtomicBool) -> Result<Written> {
        let writes = &self.writes;
        self.to.write_group(
            &self.runtime,
            cancelled,
            |storage| {
                let (coordinates, variable) =
                    output_group(&writes.table, self.chunks.clone(), true);
                prepare_group(storage, &coordinates, &[variable], &self.to.options)
            },
            |group| {
                let blocks = writes.blockwise();
                let all = 0..blocks.tasks();
                let bytes = blocks.write_step(&group.variables, all, &|| Ok(()), cancelled)?;
                Ok(writes.written(bytes))
            },
        )
    }

    /// Writes the store with the blocks written by a cluster's workers:
    /// stages the target, stores the group and the coordinates, runs the
    /// tasks (`cluster`) and stores the metadata last, atomically (see
    /// [`CopyTarget::write_staged`]).
    fn write_on_cluster(
        &self,
        cluster: &ClusterCopy,
        handle: &tokio::runtime::Handle,
        context: &Arc<TaskContext>,
        cancelled: &AtomicBool,
    ) -> Result<Written> {
        let writes = &self.writes;
        let runtime = context.runtime_env();
        self.to
            .write_staged(&cluster.staged, &runtime, cancelled, |out| {
                let (coordinates, variable) =
                    output_group(&writes.table, self.chunks.clone(), true);
                let group = prepare_group(out, &coordinates, &[variable], &self.to.options)?;
                let stopped = || cancelled.load(Ordering::Relaxed);
                let blocks = writes.tasks.blocks.num_blocks();
                let tasks = Arc::clone(&cluster.tasks);
                run_cluster_tasks(
                    handle,
                    tasks,
                    Arc::clone(context),
                    &stopped,
                    blocks,
                    "the COPY",
                )?;
                group.store_metadata()
            })?;
        let cells = (writes.table.output_shape().iter()).fold(1u64, |n, &l| n.saturating_mul(l));
        Ok(writes.written(StepBytes {
            read: writes.bytes_read(),
            written: cells.saturating_mul(writes.value_bytes()),
        }))
    }
}

/// The blocks of a transform and how they are written into a store's
/// variable: the kernel of a COPY's blockwise step ([`Self::blockwise`]),
/// run by the session or, in runs of blocks, by a cluster's workers.
#[derive(Debug)]
pub(crate) struct BlockWrites {
    table: Arc<FftTable>,
    /// The blocks and the tasks writing them.
    tasks: WriteTasks,
    kernels: Kernels,
    /// Where the transforms run.
    device: Device,
}

type Array = ZarrsArray<dyn ReadableWritableListableStorageTraits>;

impl BlockWrites {
    /// Transforms the blocks numbered `ids` and stores them in `array`,
    /// each once `may_write` says the store still wants it, on the tasks'
    /// threads; the decoded bytes of the source's blocks read and the
    /// bytes stored.
    fn write(
        &self,
        array: &Array,
        ids: Range<u64>,
        may_write: &(dyn Fn() -> std::result::Result<(), String> + Sync),
        cancelled: &AtomicBool,
    ) -> Result<StepBytes> {
        let source = self.table.source();
        let source_failed = |e: String| {
            DataFusionError::Execution(format!(
                "writing the transform of '{}' variable '{}': {e}",
                source.store(),
                source.variable()
            ))
        };
        let blocks = self.tasks.blocks.num_blocks();
        if ids.end > blocks {
            return exec_err!(
                "the transform of '{}' has {blocks} blocks to write, not {}",
                source.store(),
                ids.end
            );
        }
        let element = source.element_size() as u64;
        let read = (ids.clone().map(|id| self.tasks.blocks.block(id)))
            .map(|extent| (extent.iter()).fold(element, |n, r| n.saturating_mul(r.end - r.start)))
            .fold(0u64, u64::saturating_add);
        let written = self.tasks.run(
            &self.table,
            &self.kernels,
            ids,
            cancelled,
            source_failed,
            |pool, id| {
                may_write().map_err(|e| {
                    DataFusionError::Execution(format!(
                        "writing the transform of '{}', block {id}: {e}",
                        source.store()
                    ))
                })?;
                self.write_block(id, array, pool)
            },
        )?;
        if cancelled.load(Ordering::Relaxed) {
            return exec_err!(
                "writing the transform of '{}' was cancelled",
                source.store()
            );
        }
        Ok(StepBytes { read, written })
    }

    /// These blocks as a blockwise step: the transform's output grid in
    /// the blocks' output shape, its one variable made by these writes.
    pub(crate) fn blockwise(self: &Arc<Self>) -> BlockwiseStep {
        let table = &self.table;
        let source = table.source();
        let blocks = &self.tasks.blocks;
        // The first block's output shape (the whole output when none).
        let block = match blocks.num_blocks() {
            0 => table.output_shape(),
            _ => (table.output_extent(&blocks.block(0)).iter())
                .map(|r| r.end - r.start)
                .collect(),
        };
        BlockwiseStep {
            grid: StepGrid::Output {
                store: source.store().to_string(),
                dims: table.output_dims().into_iter().map(|d| d.name).collect(),
            },
            shape: table.output_shape(),
            block,
            names: vec![source.variable().to_string()],
            types: vec![table.value_type()],
            attributes: vec![Map::new()],
            step: Step::Writers(Box::new(Arc::clone(self))),
        }
    }

    /// The transform.
    pub(crate) fn table(&self) -> &Arc<FftTable> {
        &self.table
    }

    /// Its blocks (of the transform's input).
    pub(crate) fn blocks(&self) -> &BlockGrid {
        &self.tasks.blocks
    }

    /// Bytes of one output value as stored.
    fn value_bytes(&self) -> u64 {
        let complex = complex_part(&self.table.value_type()).is_some();
        let complex_bytes = self.table.complex_bytes() as u64;
        if complex {
            complex_bytes
        } else {
            complex_bytes / 2
        }
    }

    /// Decoded bytes the blocks read: the whole source once.
    fn bytes_read(&self) -> u64 {
        let source = self.table.source();
        source.shape().iter().product::<u64>() * source.element_size() as u64
    }

    /// What a copy reading and writing `bytes` did.
    fn written(&self, bytes: StepBytes) -> Written {
        Written {
            rows: self.table.output_shape().iter().product(),
            bytes_read: bytes.read,
            bytes_written: bytes.written,
        }
    }

    /// Transforms block `id` and stores it; returns the bytes stored.
    fn write_block(&self, id: u64, array: &Array, pool: &ChunkBufferPool) -> Result<u64> {
        let extent = self.tasks.blocks.block(id);
        store_transformed_block(&self.table, &self.kernels, &extent, array, pool).map_err(|e| {
            DataFusionError::Execution(format!(
                "writing the transform of '{}' variable '{}', block {extent:?}: {e}",
                self.table.source().store(),
                self.table.source().variable()
            ))
        })
    }
}

impl fmt::Display for BlockWrites {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let source = self.table.source();
        write!(
            f,
            "the transform of variable '{}' in blocks={} of shape {:?}, workers={}, device={}",
            source.variable(),
            self.tasks.blocks.num_blocks(),
            self.tasks.blocks.block_shape(),
            self.tasks.workers,
            self.device
        )
    }
}

/// The transform's blocks as the kernel of a blockwise step: one task per
/// block, each writing whole chunks of the one variable.
impl StepWriters for Arc<BlockWrites> {
    fn memory(&self) -> u64 {
        self.tasks.projected() as u64
    }

    fn workers(&self) -> usize {
        self.tasks.workers
    }

    fn exprs(&self) -> &[Arc<dyn PhysicalExpr>] {
        &[]
    }

    fn tasks(&self, _copy: &BlockwiseStep) -> u64 {
        self.tasks.blocks.num_blocks()
    }

    fn task_bytes(&self, _copy: &BlockwiseStep) -> u64 {
        self.bytes_read()
    }

    fn write_chunks(
        &self,
        _copy: &BlockwiseStep,
        arrays: &[ZarrsArray<dyn ReadableWritableListableStorageTraits>],
        tasks: Range<u64>,
        may_write: &MayWrite<'_>,
        cancelled: &AtomicBool,
    ) -> Result<StepBytes> {
        let [array] = arrays else {
            return internal_err!(
                "the transform of '{}' writes one array, not {}",
                self.table.source().store(),
                arrays.len()
            );
        };
        self.write(array, tasks, may_write, cancelled)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Transforms the block `extent` of `table` with `kernels` and stores it
/// in `array` (a store of the table's output, whose chunks the block's
/// output covers whole); the bytes stored.
pub(crate) fn store_transformed_block(
    table: &FftTable,
    kernels: &Kernels,
    extent: &[Range<u64>],
    array: &Array,
    pool: &ChunkBufferPool,
) -> std::result::Result<u64, String> {
    let bytes = if table.single_precision() {
        block_bytes(transformed_block::<f32>(table, kernels, extent, pool))
    } else {
        block_bytes(transformed_block::<f64>(table, kernels, extent, pool))
    }?;
    store_box(array, &table.output_extent(extent), bytes.as_slice())?;
    Ok(bytes.len() as u64)
}

/// The tasks writing the blocks of a transform to Zarr: each holds a block
/// read, transformed and encoded, beside the kernel's threads; from an
/// object store, the blocks' chunks are read ahead of them in what memory
/// they leave.
#[derive(Debug, Clone)]
pub struct WriteTasks {
    /// The blocks.
    pub blocks: BlockGrid,
    /// Tasks at once.
    pub workers: usize,
    /// Memory of one task.
    pub task_memory: usize,
    /// Memory of the kernel's threads and the GPU's staging.
    pub kernel_memory: usize,
    /// Reading the blocks' chunks ahead of the tasks (one window for all).
    pub read_ahead: ReadAheadPlan,
}

impl WriteTasks {
    /// As many tasks over `blocks` of `table` (at most the session's
    /// target partitions) as fit `limit` beside the kernel's threads and
    /// `staging` (the GPU's page-locked buffers); one when not even one
    /// fits ([`Self::fits`]). The read-ahead (the session's
    /// `io_concurrency`) gets what memory the tasks leave.
    pub(crate) fn plan(
        table: &FftTable,
        blocks: BlockGrid,
        staging: usize,
        limit: Option<usize>,
        options: &ConfigOptions,
    ) -> Self {
        let partitions = options.execution.target_partitions;
        let out_cells = table
            .output_extent(&blocks.block(0))
            .iter()
            .map(|r| r.end - r.start)
            .product::<u64>() as usize;
        let mut tasks = Self {
            task_memory: block_memory(table, blocks.block_shape())
                + out_cells * table.complex_bytes(),
            kernel_memory: kernel_memory(table) + staging,
            workers: (blocks.num_blocks() as usize).clamp(1, partitions.max(1)),
            blocks,
            read_ahead: ReadAheadPlan::for_chunks(0, 0, 1, 0),
        };
        while tasks.workers > 1 && !tasks.fits(limit) {
            tasks.workers -= 1;
        }
        let io_concurrency = ZarrConfig::of(options).io_concurrency;
        let plan = read_ahead_plan(
            table,
            tasks.blocks.block_shape(),
            io_concurrency,
            tasks.workers,
        );
        tasks.read_ahead = match limit {
            Some(limit) => plan.within(limit.saturating_sub(tasks.projected())),
            None => plan,
        };
        tasks
    }

    /// The most memory the tasks hold together, their read-ahead included.
    pub fn projected(&self) -> usize {
        self.parts("FftCopyExec", String::new()).total()
    }

    /// Their projected memory in parts, as `operator` writing the blocks of
    /// `table` reports it (its total is [`Self::projected`]).
    pub(crate) fn projection(&self, operator: &'static str, table: &FftTable) -> Projection {
        let source = table.source();
        let store = format!("'{}' variable '{}'", source.store(), source.variable());
        self.parts(operator, store)
    }

    /// [`Self::projection`] of the blocks of `store`.
    fn parts(&self, operator: &'static str, store: String) -> Projection {
        Projection::new(operator, &store, self.workers, "task", self.task_memory)
            .holding(format!(
                "a block of shape {:?} read, transformed and encoded",
                self.blocks.block_shape()
            ))
            .and(self.kernel_memory, "the kernel's threads")
            .and(self.read_ahead.memory(), "chunks read ahead")
            .advice("raise it, or give smaller chunks along the other dimensions")
    }

    /// Runs `task` on the blocks numbered `ids` (given the number), on the
    /// workers, with the blocks' chunks read ahead of them when planned
    /// (what they read made first: a copy in `work_dir`, or the four-step
    /// path's spectrum, whose failure `source_failed` turns into the tasks'
    /// error); returns the sum of what the tasks return.
    pub(crate) fn run<E: Send + From<crate::error::Panicked>>(
        &self,
        table: &FftTable,
        kernels: &Kernels,
        ids: Range<u64>,
        cancelled: &AtomicBool,
        source_failed: impl FnOnce(String) -> E,
        task: impl Fn(&mut ChunkBufferPool, u64) -> std::result::Result<u64, E> + Sync,
    ) -> std::result::Result<u64, E> {
        let read_ahead = start_read_ahead(
            table,
            &self.read_ahead,
            kernels,
            &self.blocks,
            ids.clone(),
            self.workers,
        )
        .map_err(source_failed)?;
        run_tasks(
            ids.end.saturating_sub(ids.start),
            self.workers,
            cancelled,
            ChunkBufferPool::new,
            |pool, i| {
                let id = ids.start + i;
                let done = task(pool, id);
                if let Some(read_ahead) = &read_ahead {
                    read_ahead.done_with(id);
                }
                done
            },
        )
    }

    /// Whether they fit `limit`.
    pub fn fits(&self, limit: Option<usize>) -> bool {
        limit.is_none_or(|l| self.projected() <= l)
    }
}

/// The coordinates (with xrft's attributes; their values stored as
/// coordinate arrays when `stored`) and the variable (in chunks of
/// `chunks`) of a store holding `table`'s output.
pub(crate) fn output_group(
    table: &FftTable,
    chunks: Vec<u64>,
    stored: bool,
) -> (Vec<GroupCoordinate>, GroupVariable) {
    let schema = table.schema_ref();
    let coordinates = table
        .output_dims()
        .into_iter()
        .enumerate()
        .map(|(d, dim)| GroupCoordinate {
            name: dim.name,
            values: dim.coordinate,
            attributes: field_attributes(schema.field(d)),
            calendar: dim.model_calendar.map(|time| time.calendar()),
            stored,
        })
        .collect();
    let variable = GroupVariable {
        name: table.source().variable().to_string(),
        data_type: table.value_type(),
        shape: table.output_shape(),
        chunks,
        attributes: Map::new(),
    };
    (coordinates, variable)
}

/// A transformed block's values as Zarr stores them (complex numbers as
/// interleaved parts), native-endian.
pub(crate) fn block_bytes<P: Precision>(
    values: std::result::Result<BlockValues<P>, String>,
) -> std::result::Result<Vec<u8>, String> {
    Ok(match values? {
        BlockValues::Real(v) => bytemuck::cast_slice(&v).to_vec(),
        BlockValues::Complex(v) => bytemuck::cast_slice(&v).to_vec(),
    })
}

/// Transforms blocks of a source and stores them in a new Zarr store;
/// its output is the row count, as `COPY` gives.
///
/// On a cluster ([`on_cluster`](Self::on_cluster)) the blocks are written
/// by the workers, in runs of blocks (a [`BlockwiseTasksExec`], its
/// input), into the target the session stages, and the session commits it.
#[derive(Debug)]
pub struct FftCopyExec {
    job: Arc<CopyJob>,
    /// On a cluster: where the tasks write, and the tasks.
    cluster: Option<ClusterCopy>,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

/// A COPY of a transform on a cluster.
#[derive(Debug, Clone)]
struct ClusterCopy {
    /// The target, staged by the session.
    staged: StagedTarget,
    /// The blocks' tasks under the gathering of their counts.
    tasks: Arc<dyn ExecutionPlan>,
}

impl FftCopyExec {
    /// This copy with its blocks' tasks as its input, to run on a
    /// cluster's workers; `None` when they already are, or when the
    /// transform's path makes a store in `work_dir` first: a transform
    /// of a rechunked copy of its variable or on the four-step path has
    /// that store made on the workers first ([`Self::rounds_first`],
    /// [`Self::after_rounds_on_workers`]); a staged transform runs in the
    /// session. A local target's temporary directory is named now, for the
    /// workers to write into.
    pub fn on_cluster(&self) -> Result<Option<Self>> {
        if self.cluster.is_some() || self.job.writes.table.chain().is_none() {
            return Ok(None);
        }
        self.tasks_on_cluster(|tasks| tasks).map(Some)
    }

    /// The transform copied.
    pub fn table(&self) -> &Arc<FftTable> {
        &self.job.writes.table
    }

    /// What runs on a cluster's workers before the COPY's tasks, a stage
    /// each, one after the other: the rounds of the rechunked copy of the
    /// variable the transform reads, the two passes of its four-step path
    /// (after the fit of its detrend, whose rows `broadcast` sends to the
    /// first pass's tasks), or the first stage of a staged transform (its
    /// own passes first when it takes the four-step path), whose stored
    /// output the COPY's tasks then transform along the later dimensions
    /// (the caller checks a worker can make that stage again); `None` for
    /// other paths (whole lines of a stored variable need nothing first; a
    /// first stage a worker cannot make again runs in the session), for a
    /// four-step output whose blocks the target's chunks cut (in the
    /// session too), once the copy is made (or made by them), or when the
    /// tasks are on the workers already. See
    /// [`Self::after_rounds_on_workers`].
    pub fn rounds_first(&self, broadcast: &Broadcast) -> Option<Result<Vec<ClusterStep>>> {
        let table = &self.job.writes.table;
        if self.cluster.is_some() {
            return None;
        }
        if let ArraySource::Staged(stage) = table.source() {
            let stage = stage.on_cluster(self.job.writes.device, broadcast)?;
            return Some(Ok(stage.steps));
        }
        if let ArraySource::Rechunked(copy) = table.source() {
            let step = |r: Round| ClusterStep {
                leaf: r.leaf,
                blocks: r.tasks,
                what: r.what,
            };
            return (!copy.is_copied()).then(|| Ok(copy.rounds()?.into_iter().map(step).collect()));
        }
        let four_step = table.four_step()?;
        // A worker makes the transform again from the variable's table, and
        // reads its output in whole blocks only (the target's chunks may
        // cut them: the COPY then runs in the session).
        table.four_step_chain()?;
        let blocks = self.job.writes.tasks.blocks.block_shape();
        if table.cuts_output_blocks(blocks).is_some() {
            return None;
        }
        let pass = |pass: usize| {
            // Fitted to the plan's memory already: each worker fits it to
            // its own allowed_mem when it receives it.
            let (on, device) = (Arc::clone(four_step), self.job.writes.device);
            let exec = PassBlocks::tasks(Arc::clone(table), on, pass, device, None);
            let mut leaf: Arc<dyn ExecutionPlan> = Arc::new(exec?);
            if let (0, Some(detrended)) = (pass, table.detrended()) {
                let fit = Arc::new(DetrendFitExec::new(Arc::clone(table))?);
                let detrended = Arc::clone(detrended);
                leaf = Arc::new(FittedExec::new(broadcast(fit), leaf, detrended)?);
            }
            Ok(ClusterStep {
                leaf,
                blocks: four_step.pass_tasks(pass),
                what: pass_name(pass),
            })
        };
        Some((0..2).map(pass).collect())
    }

    /// This copy with its blocks' tasks on a cluster's workers after what
    /// [`Self::rounds_first`] gives: `after` puts the tasks' leaf after
    /// those rounds (whose last counts it runs first). A rechunked copy
    /// counts as made by the workers from then on.
    pub fn after_rounds_on_workers(
        &self,
        after: impl FnOnce(Arc<dyn ExecutionPlan>) -> Arc<dyn ExecutionPlan>,
    ) -> Result<Self> {
        if let ArraySource::Rechunked(copy) = self.job.writes.table.source() {
            copy.copied_by_workers();
        }
        self.tasks_on_cluster(after)
    }

    /// This copy with its blocks' tasks (their leaf passed through `leaf`)
    /// under the gathering of their counts as its input.
    fn tasks_on_cluster(
        &self,
        leaf: impl FnOnce(Arc<dyn ExecutionPlan>) -> Arc<dyn ExecutionPlan>,
    ) -> Result<Self> {
        let writes = &self.job.writes;
        let staged = self.job.to.staged()?;
        let encoding = TargetEncoding::of(&self.job.to.options);
        let chunks = self.job.chunks.clone();
        let metrics = ExecutionPlanMetricsSet::new();
        let exec = transform_tasks(writes, chunks, staged.clone(), encoding, metrics);
        let tasks = leaf(Arc::new(exec));
        Ok(Self {
            job: Arc::clone(&self.job),
            cluster: Some(ClusterCopy {
                staged,
                tasks: Arc::new(CoalescePartitionsExec::new(tasks)),
            }),
            properties: Arc::clone(&self.properties),
            metrics: ExecutionPlanMetricsSet::new(),
        })
    }
}

impl DisplayAs for FftCopyExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let job = &self.job;
        let writes = &job.writes;
        write!(
            f,
            "FftCopyExec: store={}, variable={}, target={}, blocks={} of shape {:?}, chunks={:?}, \
             workers={}{}, device={}, projected_memory={}",
            writes.table.source().store(),
            writes.table.source().variable(),
            job.to.location,
            writes.tasks.blocks.num_blocks(),
            writes.tasks.blocks.block_shape(),
            job.chunks,
            writes.tasks.workers,
            writes.tasks.read_ahead,
            writes.device,
            human_readable_size(job.projected())
        )?;
        match &self.cluster {
            Some(_) => write!(f, ", tasks on the cluster's workers"),
            None => Ok(()),
        }
    }
}

impl ExecutionPlan for FftCopyExec {
    named_plan_methods!("FftCopyExec");

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        self.cluster.iter().map(|c| &c.tasks).collect()
    }

    no_expressions_method!();

    fn with_new_children(
        self: Arc<Self>,
        mut children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        match (&self.cluster, children.len()) {
            (None, 0) => Ok(self),
            (Some(cluster), 1) => Ok(Arc::new(Self {
                job: Arc::clone(&self.job),
                cluster: Some(ClusterCopy {
                    staged: cluster.staged.clone(),
                    tasks: children.remove(0),
                }),
                properties: Arc::clone(&self.properties),
                metrics: ExecutionPlanMetricsSet::new(),
            })),
            (cluster, n) => exec_err!(
                "FftCopyExec has {} children, got {n}",
                usize::from(cluster.is_some())
            ),
        }
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let job = Arc::clone(&self.job);
        let cluster = self.cluster.clone();
        let handle = tokio::runtime::Handle::try_current()
            .map_err(|e| DataFusionError::Execution(format!("FftCopyExec needs a runtime: {e}")))?;
        let task_context = Arc::clone(&context);
        WriteJob {
            operator: "FftCopyExec",
            store: self.job.writes.table.source().store(),
            // The session holds the coordinates only when the tasks run on
            // the workers.
            projected: match &cluster {
                Some(_) => self.job.coordinate_memory(),
                None => self.job.projected(),
            },
            metrics: &self.metrics,
            properties: &self.properties,
        }
        .run(partition, &context, move |cancelled| match cluster {
            None => job.write(cancelled),
            Some(cluster) => job.write_on_cluster(&cluster, &handle, &task_context, cancelled),
        })
    }

    metered_plan_methods!(|_| None);
}

/// The blockwise tasks writing the blocks of `writes` into `into` (a
/// COPY's staged target, or the store a staged transform's first stage
/// made in `work_dir`) in chunks `chunks` encoded as `encoding`, reporting
/// to `metrics` (those of the kernels' clock, on a worker).
pub(crate) fn transform_tasks(
    writes: &Arc<BlockWrites>,
    chunks: Vec<u64>,
    into: StagedTarget,
    encoding: TargetEncoding,
    metrics: ExecutionPlanMetricsSet,
) -> BlockwiseTasksExec {
    let step = writes.blockwise();
    let sent = BlockwiseTasks {
        block: step.block.clone(),
        chunks,
        variables: (step.names.iter().zip(&step.types))
            .map(|(n, t)| (n.clone(), t.to_string()))
            .collect(),
        into: ChunksInto::Target { staged: into },
        encoding,
        workers: writes.tasks.workers,
    };
    let broadcasts = BroadcastInputs::default();
    BlockwiseTasksExec::new(Arc::new(step), Arc::new(sent), broadcasts, metrics)
}

/// The tasks writing the blocks of `tasks` of the transform `table` on
/// `device` (staging through `staging` page-locked bytes on a GPU) into
/// `into` in chunks `chunks` encoded as `encoding` (see
/// [`transform_tasks`]), reporting the kernels' time to their own
/// metrics: a worker's, or the session's for the first stage of a staged
/// transform.
pub(crate) fn transform_tasks_on(
    table: Arc<FftTable>,
    tasks: WriteTasks,
    (device, staging): (Device, usize),
    chunks: Vec<u64>,
    into: StagedTarget,
    encoding: TargetEncoding,
) -> BlockwiseTasksExec {
    let metrics = ExecutionPlanMetricsSet::new();
    let writes = Arc::new(BlockWrites {
        table,
        tasks,
        kernels: Kernels::on(device, staging, TransformClock::in_metrics(&metrics)),
        device,
    });
    transform_tasks(&writes, chunks, into, encoding, metrics)
}

/// The tasks of a COPY of a transform (or of a staged transform's first
/// stage) as a worker receives them: the transform `table` (made again
/// with SQL's checks) in `blocks` (read in the worker's session,
/// `options`), writing as `sent` says; refused when they write anything
/// but the transform's variable, into anything but a staged target, in
/// anything but whole chunks, or when one task does not fit the worker's
/// memory limit `limit` on its own device.
pub(crate) fn received_transform_tasks(
    table: Arc<FftTable>,
    blocks: BlockGrid,
    sent: BlockwiseTasks,
    limit: Option<usize>,
    options: &ConfigOptions,
) -> Result<BlockwiseTasksExec> {
    let store = table.source().store().to_string();
    if blocks.num_blocks() == 0 {
        return plan_err!("a COPY of the transform of {store} is sent no blocks");
    }
    let shape = table.output_shape();
    let block_out: Vec<u64> = (table.output_extent(&blocks.block(0)).iter())
        .map(|r| r.end - r.start)
        .collect();
    let aligned = |d: usize| {
        let (b, c, n) = (block_out[d], sent.chunks[d], shape[d]);
        c > 0 && c <= n.max(1) && (b == n || b % c == 0)
    };
    if sent.chunks.len() != shape.len() || !(0..shape.len()).all(aligned) {
        return plan_err!(
            "a COPY of the transform of {store} writes blocks of shape {block_out:?} into \
             chunks {:?} of an output of shape {shape:?}: not whole chunks",
            sent.chunks
        );
    }
    if sent.block != block_out {
        return plan_err!(
            "a COPY of the transform of {store} sends blocks of shape {:?}, not {block_out:?}",
            sent.block
        );
    }
    let variable = (
        table.source().variable().to_string(),
        table.value_type().to_string(),
    );
    if sent.variables != [variable.clone()] {
        return plan_err!(
            "a COPY of the transform of {store} writes {:?}, not {variable:?}",
            sent.variables
        );
    }
    let ChunksInto::Target { staged: into } = sent.into else {
        return plan_err!(
            "a COPY of the transform of {store} writes into {}, not a staged target",
            sent.into
        );
    };
    let device = choose_device(&ZarrConfig::of(options).device)
        .map_err(|e| DataFusionError::Plan(format!("a COPY of the transform of {store}: {e}")))?;
    let staging = staging_memory(device, limit);
    let tasks = WriteTasks::plan(&table, blocks, staging, limit, options);
    if let Some(limit) = limit {
        (tasks.projection("BlockwiseTasksExec", &table))
            .advice("raise the worker's allowed_mem")
            .check(limit)?;
    }
    let on = (device, staging);
    Ok(transform_tasks_on(
        table,
        tasks,
        on,
        sent.chunks,
        into,
        sent.encoding,
    ))
}

/// The transform's blocks that `tasks` write, when they do.
pub(crate) fn transform_writes(tasks: &BlockwiseTasksExec) -> Option<&Arc<BlockWrites>> {
    let Step::Writers(writers) = &tasks.blocks().step else {
        return None;
    };
    writers.as_any().downcast_ref::<Arc<BlockWrites>>()
}

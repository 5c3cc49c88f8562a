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

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use datafusion::catalog::Session;
use datafusion::common::config::ConfigOptions;
use datafusion::common::{
    exec_err, human_readable_size, plan_err, resources_err, DataFusionError, Result,
};
use datafusion::datasource::source_as_provider;
use datafusion::execution::memory_pool::MemoryLimit;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::dml::CopyTo;
use datafusion::logical_expr::{Expr, LogicalPlan, UserDefinedLogicalNodeCore};
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use zarrs::array::Array as ZarrsArray;
use zarrs::storage::ReadableWritableListableStorageTraits;

use super::exec::{
    block_memory, kernel_memory, plan_blocks, read_ahead_plan, start_read_ahead, transformed_block,
};
use super::kernels::{Kernels, Precision, TransformClock};
use super::table::FftTable;
use crate::array::tasks::run_tasks;
use crate::config::ZarrConfig;
use crate::device::fft_cpu::BlockValues;
use crate::device::{choose_device, staging_memory, Device};
use crate::plan_methods::{
    leaf_node_methods, leaf_plan_methods, metered_plan_methods, node_identity,
};
use crate::table::{BlockGrid, ReadAheadPlan, Selection};
use crate::write::grid::field_attributes;
use crate::write::store::{
    prepare_group, store_box, GroupCoordinate, GroupVariable, COORDINATE_WRITE_MEMORY,
};
use crate::write::target::CopyTarget;
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
        if let (false, Some(limit)) = (tasks.fits(memory_limit), memory_limit) {
            return resources_err!(
                "FftCopyExec of '{}' variable '{}' needs {} for one task (a block of shape \
                 {:?} read, transformed and encoded) plus {} for the kernel's threads, but \
                 the memory limit (allowed_mem) is {}; raise it, or give smaller chunks \
                 along the other dimensions",
                table.source().store(),
                table.source().variable(),
                human_readable_size(tasks.task_memory),
                tasks.blocks.block_shape(),
                human_readable_size(tasks.kernel_memory),
                human_readable_size(limit)
            );
        }
        let metrics = ExecutionPlanMetricsSet::new();
        Ok(FftCopyExec {
            job: Arc::new(CopyJob {
                table: Arc::clone(table),
                tasks,
                chunks,
                to: self.to.clone(),
                runtime: Arc::clone(session.runtime_env()),
                kernels: Kernels::on(device, staging, TransformClock::in_metrics(&metrics)),
                device,
            }),
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
    table: Arc<FftTable>,
    /// The blocks and the tasks writing them.
    tasks: WriteTasks,
    /// The target variable's chunk shape.
    chunks: Vec<u64>,
    to: CopyTarget,
    /// Where an object-store target's credentials are registered.
    runtime: Arc<RuntimeEnv>,
    kernels: Kernels,
    /// Where the transforms run.
    device: Device,
}

type Arrays = [ZarrsArray<dyn ReadableWritableListableStorageTraits>];

impl CopyJob {
    /// The most memory the write holds: its tasks', or its coordinates'
    /// (written before the tasks run).
    fn projected(&self) -> usize {
        self.tasks
            .projected()
            .max(usize::try_from(COORDINATE_WRITE_MEMORY).unwrap_or(usize::MAX))
    }

    /// Writes the store atomically: a local one beside the target (the
    /// group, the coordinates and the variable's metadata, then every
    /// block), renamed into place; an object-store one (which must be
    /// empty) with its metadata last, erased when the copy fails.
    fn write(&self, cancelled: &AtomicBool) -> Result<Written> {
        self.to.write_group(
            &self.runtime,
            cancelled,
            |storage| {
                let (coordinates, variable) = output_group(&self.table, self.chunks.clone(), true);
                prepare_group(storage, &coordinates, &[variable], &self.to.options)
            },
            |group| self.write_blocks(&group.variables, cancelled),
        )
    }

    /// Every block, on `workers` threads.
    fn write_blocks(&self, arrays: &Arrays, cancelled: &AtomicBool) -> Result<Written> {
        let source_failed = |e: String| {
            DataFusionError::Execution(format!(
                "COPY of the transform of '{}' variable '{}': {e}",
                self.table.source().store(),
                self.table.source().variable()
            ))
        };
        let bytes = self.tasks.run(
            &self.table,
            &self.kernels,
            cancelled,
            source_failed,
            |pool, id| self.write_block(id, arrays, pool),
        )?;
        if cancelled.load(Ordering::Relaxed) {
            return exec_err!(
                "the COPY of '{}' was cancelled",
                self.table.source().store()
            );
        }
        let source = self.table.source();
        Ok(Written {
            rows: self.table.output_shape().iter().product(),
            bytes_read: source.shape().iter().product::<u64>() * source.element_size() as u64,
            bytes_written: bytes,
        })
    }

    /// Transforms block `id` and stores it; returns the bytes stored.
    fn write_block(&self, id: u64, arrays: &Arrays, pool: &ChunkBufferPool) -> Result<u64> {
        let extent = self.tasks.blocks.block(id);
        let fail = |message: String| {
            DataFusionError::Execution(format!(
                "COPY of the transform of '{}' variable '{}', block {extent:?}: {message}",
                self.table.source().store(),
                self.table.source().variable()
            ))
        };
        let bytes = if self.table.single_precision() {
            block_bytes(transformed_block::<f32>(
                &self.table,
                &self.kernels,
                &extent,
                pool,
            ))
        } else {
            block_bytes(transformed_block::<f64>(
                &self.table,
                &self.kernels,
                &extent,
                pool,
            ))
        }
        .map_err(fail)?;
        let out_extent = self.table.output_extent(&extent);
        store_box(&arrays[0], &out_extent, bytes.as_slice()).map_err(fail)?;
        Ok(bytes.len() as u64)
    }
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
        (self.workers)
            .saturating_mul(self.task_memory)
            .saturating_add(self.kernel_memory)
            .saturating_add(self.read_ahead.memory())
    }

    /// Runs `task` on every block (its number), on the workers, with the
    /// blocks' chunks read ahead of them when planned (what they read
    /// made first: a copy in `work_dir`, or the four-step path's spectrum,
    /// whose failure `source_failed` turns into the tasks' error); returns
    /// the sum of what the tasks return.
    pub(crate) fn run<E: Send + From<crate::error::Panicked>>(
        &self,
        table: &FftTable,
        kernels: &Kernels,
        cancelled: &AtomicBool,
        source_failed: impl FnOnce(String) -> E,
        task: impl Fn(&mut ChunkBufferPool, u64) -> std::result::Result<u64, E> + Sync,
    ) -> std::result::Result<u64, E> {
        let blocks = self.blocks.num_blocks();
        let read_ahead = start_read_ahead(
            table,
            &self.read_ahead,
            kernels,
            &self.blocks,
            0..blocks,
            self.workers,
        )
        .map_err(source_failed)?;
        run_tasks(
            blocks,
            self.workers,
            cancelled,
            ChunkBufferPool::new,
            |pool, id| {
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
            stored,
        })
        .collect();
    let variable = GroupVariable {
        name: table.source().variable().to_string(),
        data_type: table.value_type(),
        shape: table.output_shape(),
        chunks,
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
#[derive(Debug)]
pub struct FftCopyExec {
    job: Arc<CopyJob>,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl DisplayAs for FftCopyExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let job = &self.job;
        write!(
            f,
            "FftCopyExec: store={}, variable={}, target={}, blocks={} of shape {:?}, chunks={:?}, \
             workers={}{}, device={}, projected_memory={}",
            job.table.source().store(),
            job.table.source().variable(),
            job.to.location,
            job.tasks.blocks.num_blocks(),
            job.tasks.blocks.block_shape(),
            job.chunks,
            job.tasks.workers,
            job.tasks.read_ahead,
            job.device,
            human_readable_size(job.projected())
        )
    }
}

impl ExecutionPlan for FftCopyExec {
    leaf_plan_methods!("FftCopyExec");

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let job = Arc::clone(&self.job);
        WriteJob {
            operator: "FftCopyExec",
            store: self.job.table.source().store(),
            projected: self.job.projected(),
            metrics: &self.metrics,
            properties: &self.properties,
        }
        .run(partition, &context, move |cancelled| job.write(cancelled))
    }

    metered_plan_methods!(|_| None);
}

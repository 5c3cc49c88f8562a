//! The four-step path's passes as blockwise steps on a cluster's workers.
//!
//! A transform on the four-step path ([`super::four_step`]) writes its two
//! intermediate arrays in two passes over blocks before its output is
//! read. On a cluster each pass is a stage of the query's plan: a
//! [`BlockwiseTasksExec`] whose kernel is the pass ([`PassBlocks`], a
//! [`StepWriters`]) runs a distributed task's contiguous run of the pass's
//! blocks on a worker, writing into the intermediates in the scratch
//! store the session made in `work_dir` (which every worker must reach: a
//! path they all see, or an object-store URL, [`ChunksInto::Intermediates`]),
//! and yields how many it ran. The session's
//! [`FftExec`](super::exec::FftExec) runs the first pass's stage to its
//! end, then the second's, checks that every block of each ran, and reads
//! the output (see `FftExec::on_cluster`).
//!
//! What travels (the codec's blockwise node with the kernel
//! `four_step_pass`) is plain data: the variable's table, the transform's
//! options as SQL names them, the plan, the scratch store's location and
//! the pass. A worker makes the transform again (SQL's checks), checks the
//! plan against it
//! ([`FourStepPlan::received`](super::four_step::FourStepPlan::received),
//! which also computes the blocks' memory again), opens the intermediates
//! ([`FourStep::open`]: their metadata must be what the plan makes) and
//! fits its threads to its own `allowed_mem`, refusing a block that cannot
//! fit; each block checks that the store is still there before it writes
//! (the session erases it when the query fails or ends).
//!
//! Primitives (see [`crate::array`]): blockwise, twice.

use std::fmt;
use std::ops::Range;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use datafusion::common::{internal_err, plan_err, DataFusionError, Result};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use zarrs::array::Array as ZarrsArray;
use zarrs::storage::ReadableWritableListableStorageTraits;

use super::four_step::FourStep;
use super::kernels::{Kernels, TransformClock};
use super::table::FftTable;
use crate::array::blockwise::{
    BlockwiseStep, BlockwiseTasks, BlockwiseTasksExec, ChunksInto, MayWrite, Step, StepBytes,
    StepGrid, StepWriters,
};
use crate::array::rechunk::TargetEncoding;
use crate::device::{staging_memory, Device};
use crate::memory::Projection;
use crate::table::BroadcastInputs;
use crate::write::options::ZarrWriteOptions;

/// What each pass does, for `EXPLAIN` and errors.
const PASSES: [&str; 2] = ["columns across chunks", "rows within chunks"];

/// The blocks of one pass of a four-step transform, writing into its
/// intermediates: the kernel of a cluster's pass stage (see the module
/// docs).
pub(crate) struct PassBlocks {
    /// The transform: its source and the dimension transformed.
    table: Arc<FftTable>,
    four_step: Arc<FourStep>,
    /// 0: across chunks, 1: within chunks.
    pass: usize,
    /// Blocks run at once by one task.
    workers: usize,
    kernels: Kernels,
    /// Page-locked bytes the kernels stage through on a GPU.
    staging: usize,
}

impl PassBlocks {
    /// The tasks of pass `pass` (0 or 1) of `four_step`, the four-step
    /// path of `table`'s transform, run on `device` with as many blocks at
    /// once as the plan allows and `memory_limit` fits (refused when one
    /// block and the pass's read-ahead do not), the kernels' time counted
    /// in the tasks' metrics.
    pub(crate) fn tasks(
        table: Arc<FftTable>,
        four_step: Arc<FourStep>,
        pass: usize,
        device: Device,
        memory_limit: Option<usize>,
    ) -> Result<BlockwiseTasksExec> {
        let source = table.source();
        let (Some(what), [_]) = (PASSES.get(pass), table.transform().axes.as_slice()) else {
            return plan_err!(
                "a four-step transform of '{}' variable '{}' has two passes along one \
                 dimension, not pass {} along {}",
                source.store(),
                source.variable(),
                pass + 1,
                table.transform().axes.len()
            );
        };
        let (block, read_ahead) = four_step.pass_memory(pass);
        let staging = staging_memory(device, memory_limit);
        let mut workers = four_step.plan.workers[pass].max(1);
        if let Some(limit) = memory_limit {
            // One block at a time must fit; then as many as do.
            Projection::new(
                "BlockwiseTasksExec",
                &format!("'{}' variable '{}'", source.store(), source.variable()),
                1,
                "block",
                block,
            )
            .holding(format!(
                "a block of its four-step pass {} ({what})",
                pass + 1
            ))
            .and(read_ahead, "chunks read ahead")
            .and(staging, "staging for the kernels")
            .advice("raise it on every worker")
            .check(limit)?;
            let room = limit.saturating_sub(read_ahead.saturating_add(staging));
            workers = workers.min(room / block.max(1)).max(1);
        }
        let metrics = ExecutionPlanMetricsSet::new();
        let kernels = Kernels::on(device, staging, TransformClock::in_metrics(&metrics));
        let location = four_step.location().to_string();
        let pass = Arc::new(Self {
            table,
            four_step,
            pass,
            workers,
            kernels,
            staging,
        });
        let step = pass.blockwise();
        let sent = BlockwiseTasks {
            block: step.block.clone(),
            chunks: step.block.clone(),
            variables: Vec::new(),
            into: ChunksInto::Intermediates { location },
            encoding: TargetEncoding::of(&ZarrWriteOptions::default()),
            workers,
        };
        let broadcasts = BroadcastInputs::default();
        Ok(BlockwiseTasksExec::new(
            Arc::new(step),
            Arc::new(sent),
            broadcasts,
            metrics,
        ))
    }

    /// This pass as a blockwise step over the intermediates' cells (the
    /// other dimensions, then the `N1` columns and `N2` rows), each task a
    /// batch of lines by a block of columns (pass 1) or rows (pass 2); it
    /// writes no variable of its own.
    fn blockwise(self: &Arc<Self>) -> BlockwiseStep {
        let plan = &self.four_step.plan;
        let mut shape = self.table.source().shape();
        shape.remove(plan.axis);
        let mut block: Vec<u64> = (plan.batch.iter().enumerate())
            .filter(|(d, _)| *d != plan.axis)
            .map(|(_, &b)| b)
            .collect();
        shape.extend([plan.columns as u64, plan.rows as u64]);
        block.extend(match self.pass {
            0 => [plan.column_block as u64, plan.rows as u64],
            _ => [plan.columns as u64, plan.row_block as u64],
        });
        let mut dims: Vec<String> = (self.table.source().dims().into_iter())
            .enumerate()
            .filter(|(d, _)| *d != plan.axis)
            .map(|(_, dim)| dim.name)
            .collect();
        dims.extend(["column".to_string(), "row".to_string()]);
        BlockwiseStep {
            grid: StepGrid::Output {
                store: self.table.source().store().to_string(),
                dims,
            },
            shape,
            block,
            names: Vec::new(),
            types: Vec::new(),
            attributes: Vec::new(),
            step: Step::Writers(Box::new(Arc::clone(self))),
        }
    }

    /// The transform.
    pub(crate) fn table(&self) -> &Arc<FftTable> {
        &self.table
    }

    /// Its four-step path: the plan and the intermediates.
    pub(crate) fn four_step(&self) -> &Arc<FourStep> {
        &self.four_step
    }

    /// The pass: 0 across chunks, 1 within chunks.
    pub(crate) fn pass(&self) -> usize {
        self.pass
    }
}

impl fmt::Display for PassBlocks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "four-step pass {} ({}) of variable '{}', workers={}",
            self.pass + 1,
            PASSES[self.pass],
            self.table.source().variable(),
            self.workers,
        )
    }
}

/// A pass's blocks as the kernel of a blockwise step: one task per block,
/// each writing its part of the intermediates.
impl StepWriters for Arc<PassBlocks> {
    fn memory(&self) -> u64 {
        let (block, read_ahead) = self.four_step.pass_memory(self.pass);
        (self.workers.saturating_mul(block))
            .saturating_add(read_ahead)
            .saturating_add(self.staging) as u64
    }

    fn workers(&self) -> usize {
        self.workers
    }

    fn exprs(&self) -> &[Arc<dyn PhysicalExpr>] {
        &[]
    }

    fn tasks(&self, _step: &BlockwiseStep) -> u64 {
        self.four_step.pass_tasks(self.pass)
    }

    fn task_bytes(&self, _step: &BlockwiseStep) -> u64 {
        let element = self.table.source().element_size();
        self.four_step.pass_bytes(self.pass, element)
    }

    fn write_chunks(
        &self,
        _step: &BlockwiseStep,
        arrays: &[ZarrsArray<dyn ReadableWritableListableStorageTraits>],
        tasks: Range<u64>,
        _may_write: &MayWrite<'_>,
        cancelled: &AtomicBool,
    ) -> Result<StepBytes> {
        let (table, four_step, pass) = (&self.table, &self.four_step, self.pass);
        let source = table.source();
        if !arrays.is_empty() {
            return internal_err!(
                "a four-step pass of '{}' writes its own intermediates, not {} arrays",
                source.store(),
                arrays.len()
            );
        }
        let [(_, axis)] = table.transform().axes.as_slice() else {
            return plan_err!("a four-step transform along more than one dimension");
        };
        let blocks = tasks.end.saturating_sub(tasks.start);
        // Each block checks the store is still there before it writes.
        let (kernels, workers) = (&self.kernels, self.workers);
        let ran = if table.single_precision() {
            four_step.run_pass::<f32>(pass, source, axis, kernels, tasks, workers, cancelled)
        } else {
            four_step.run_pass::<f64>(pass, source, axis, kernels, tasks, workers, cancelled)
        };
        ran.map_err(|e| {
            DataFusionError::Execution(format!(
                "pass {} ({}) of the four-step transform of '{}' variable '{}': {e}",
                pass + 1,
                PASSES[pass],
                source.store(),
                source.variable()
            ))
        })?;
        // Its share of what the pass reads (the source's values, or the
        // first pass's complex values) and writes (complex values).
        let read = four_step.pass_bytes(pass, source.element_size());
        let written = four_step.pass_bytes(1, 0);
        let all = four_step.pass_tasks(pass);
        Ok(StepBytes::share(read, written, blocks, all))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// The pass that `tasks` run, when they run one.
pub(crate) fn pass_writes(tasks: &BlockwiseTasksExec) -> Option<&Arc<PassBlocks>> {
    let Step::Writers(writers) = &tasks.blocks().step else {
        return None;
    };
    writers.as_any().downcast_ref::<Arc<PassBlocks>>()
}

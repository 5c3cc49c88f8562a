//! The four-step path's passes on a cluster's workers.
//!
//! A transform on the four-step path ([`super::four_step`]) writes its two
//! intermediate arrays in two passes over blocks before its output is
//! read. On a cluster each pass is a stage of the query's plan:
//! [`FourStepPassExec`] runs a distributed task's contiguous run of a
//! pass's blocks on a worker, writing into the scratch store the session
//! made in `work_dir` (which every worker must reach: a path they all see,
//! or an object-store URL), and yields how many it ran. The session's
//! [`FftExec`](super::exec::FftExec) runs the first pass's stage to its
//! end, then the second's, checks that every block of each ran, and reads
//! the output (see `FftExec::on_cluster`).
//!
//! What travels (the codec's four-step pass) is plain data: the variable's
//! table, the transform's options as SQL names them, the plan, the scratch
//! store's location and the pass. A worker makes the transform again
//! (SQL's checks), checks the plan against it
//! ([`FourStepPlan::received`](super::four_step::FourStepPlan::received),
//! which also computes the blocks' memory again), opens the intermediates
//! ([`FourStep::open`]: their metadata must be what the plan makes) and
//! fits its threads to its own `allowed_mem`, refusing a block that cannot
//! fit; each block checks that the store is still there before it writes
//! (the session erases it when the query fails or ends).
//!
//! Primitives (see [`crate::array`]): blockwise, twice.

use std::fmt;
use std::sync::Arc;

use datafusion::common::{human_readable_size, plan_err, DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};

use super::four_step::FourStep;
use super::kernels::{Kernels, TransformClock};
use super::table::FftTable;
use crate::device::{staging_memory, Device};
use crate::memory::Projection;
use crate::plan_methods::{leaf_plan_methods, metered_plan_methods};
use crate::table::task_share;
use crate::write::write_job::{counted_properties, WriteJob, Written};

/// What each pass does, for `EXPLAIN` and errors.
const PASSES: [&str; 2] = ["columns across chunks", "rows within chunks"];

/// A run of the blocks of one pass of a four-step transform, writing into
/// its intermediates: the leaf of a cluster's pass stage (see the module
/// docs). Its one partition yields one row, `tasks`: how many of the
/// pass's blocks it ran.
#[derive(Debug)]
pub struct FourStepPassExec {
    /// The transform: its source and the dimension transformed.
    table: Arc<FftTable>,
    four_step: Arc<FourStep>,
    /// 0: across chunks, 1: within chunks.
    pass: usize,
    /// The distributed tasks the pass's blocks are dealt to.
    tasks: usize,
    /// Blocks run at once by one task.
    workers: usize,
    kernels: Arc<Kernels>,
    /// Page-locked bytes the kernels stage through on a GPU.
    staging: usize,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl FourStepPassExec {
    /// Pass `pass` (0 or 1) of `four_step`, the four-step path of
    /// `table`'s transform, run on `device` with as many blocks at once as
    /// the plan allows and `memory_limit` fits; refused when one block (and
    /// the pass's read-ahead) does not.
    pub fn new(
        table: Arc<FftTable>,
        four_step: Arc<FourStep>,
        pass: usize,
        device: Device,
        memory_limit: Option<usize>,
    ) -> Result<Self> {
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
                "FourStepPassExec",
                &format!("'{}' variable '{}'", source.store(), source.variable()),
                1,
                "block",
                block,
            )
            .holding(format!("a block of its pass {} ({what})", pass + 1))
            .and(read_ahead, "chunks read ahead")
            .and(staging, "staging for the kernels")
            .advice("raise it on every worker")
            .check(limit)?;
            let room = limit.saturating_sub(read_ahead.saturating_add(staging));
            workers = workers.min(room / block.max(1)).max(1);
        }
        let metrics = ExecutionPlanMetricsSet::new();
        let kernels = Kernels::on(device, staging, TransformClock::in_metrics(&metrics));
        Ok(Self {
            table,
            four_step,
            pass,
            tasks: 1,
            workers,
            kernels: Arc::new(kernels),
            staging,
            properties: counted_properties("tasks"),
            metrics,
        })
    }

    /// This pass with its blocks dealt to `tasks` tasks of a cluster's
    /// stage, each (its index from its `DistributedTaskContext`) running a
    /// contiguous run of them.
    pub fn with_tasks(&self, tasks: usize) -> Self {
        Self {
            table: Arc::clone(&self.table),
            four_step: Arc::clone(&self.four_step),
            pass: self.pass,
            tasks: tasks.max(1),
            workers: self.workers,
            kernels: Arc::clone(&self.kernels),
            staging: self.staging,
            properties: Arc::clone(&self.properties),
            // The kernels' clock counts into these.
            metrics: self.metrics.clone(),
        }
    }

    /// The distributed tasks the blocks are dealt to.
    pub fn tasks(&self) -> usize {
        self.tasks
    }

    /// The pass: 0 across chunks, 1 within chunks.
    pub fn pass(&self) -> usize {
        self.pass
    }

    /// The transform.
    pub fn table(&self) -> &FftTable {
        &self.table
    }

    /// Its four-step path: the plan and the intermediates.
    pub fn four_step(&self) -> &FourStep {
        &self.four_step
    }

    /// The blocks of the pass.
    pub fn pass_tasks(&self) -> u64 {
        self.four_step.pass_tasks(self.pass)
    }

    /// Bytes the pass reads (what a cluster's tasks are sized by).
    pub fn bytes_read(&self) -> u64 {
        let element = self.table.source().element_size();
        self.four_step.pass_bytes(self.pass, element)
    }

    /// Memory one task holds at its peak: its blocks at once, the pass's
    /// read-ahead and the kernels' staging.
    pub fn projected_memory(&self) -> usize {
        let (block, read_ahead) = self.four_step.pass_memory(self.pass);
        (self.workers.saturating_mul(block))
            .saturating_add(read_ahead)
            .saturating_add(self.staging)
    }
}

impl DisplayAs for FourStepPassExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let source = self.table.source();
        write!(
            f,
            "FourStepPassExec: pass {} ({}) of '{}' variable '{}' in {}, blocks={}, workers={}, \
             projected_memory={}",
            self.pass + 1,
            PASSES[self.pass],
            source.store(),
            source.variable(),
            self.four_step.location(),
            self.pass_tasks(),
            self.workers,
            human_readable_size(self.projected_memory())
        )?;
        if self.tasks > 1 {
            write!(f, ", tasks={}", self.tasks)?;
        }
        Ok(())
    }
}

impl ExecutionPlan for FourStepPassExec {
    leaf_plan_methods!("FourStepPassExec");

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let store = self.table.source().store().to_string();
        let all = 0..self.pass_tasks();
        let run = task_share("FourStepPassExec", &store, self.tasks, all, &context)?;
        let job = WriteJob {
            operator: "FourStepPassExec",
            store: &store,
            projected: self.projected_memory(),
            metrics: &self.metrics,
            properties: &self.properties,
        };
        let (table, four_step) = (Arc::clone(&self.table), Arc::clone(&self.four_step));
        let (kernels, pass, workers) = (Arc::clone(&self.kernels), self.pass, self.workers);
        job.run(partition, &context, move |cancelled| {
            let source = table.source();
            let [(_, axis)] = table.transform().axes.as_slice() else {
                return plan_err!("a four-step transform along more than one dimension");
            };
            let blocks = run.end.saturating_sub(run.start);
            // Its share of what the pass reads and writes (complex values).
            let share = |bytes: u64| {
                (bytes as u128 * blocks as u128 / four_step.pass_tasks(pass).max(1) as u128) as u64
            };
            let bytes_read = share(four_step.pass_bytes(pass, source.element_size()));
            let bytes_written = share(four_step.pass_bytes(1, 0));
            let ran = if table.single_precision() {
                four_step.run_pass::<f32>(pass, source, axis, &kernels, run, workers, cancelled)
            } else {
                four_step.run_pass::<f64>(pass, source, axis, &kernels, run, workers, cancelled)
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
            Ok(Written {
                rows: blocks,
                bytes_read,
                bytes_written,
            })
        })
    }

    metered_plan_methods!(|_| Some(1));
}

//! Stages that must run one after the other, all on the workers.
//!
//! Some work runs in rounds: a staged transform's first stage on the
//! four-step path runs its two passes, then stores its blocks, and only
//! then can the stage after it read the store. The session can run such
//! rounds in turn (each a stage under the gathering of its tasks' counts),
//! but then what comes after the last round runs in the session too. An
//! [`AfterExec`] puts the order on the workers instead: it runs its first
//! input (the counts of the previous round's tasks, broadcast to every task
//! of its own stage by datafusion-distributed's `BroadcastExec`) to its end,
//! checks they add up to the blocks the round has, and only then runs its
//! second input (the next round's tasks) in the same task. A chain of them
//! ([`after_each_other`]) runs rounds in order with no round trip through
//! the session; the last round's counts are broadcast to whatever reads
//! its output.
//!
//! What travels (the codec's `after`) is the blocks and what the previous
//! round is; its two inputs travel as DataFusion's children.

use std::fmt;
use std::sync::Arc;

use datafusion::common::{exec_err, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use datafusion_distributed::BroadcastExec;

use crate::array::tasks::{after_once, cluster_tasks_ran, RanOnce};
use crate::plan_methods::{named_plan_methods, no_expressions_method, two_children};

/// Runs `then` once `before` (a previous round's counts) says every block
/// of that round ran (see the module docs). Its partitions and rows are
/// `then`'s.
#[derive(Debug)]
pub struct AfterExec {
    before: Arc<dyn ExecutionPlan>,
    then: Arc<dyn ExecutionPlan>,
    /// The blocks the previous round's counts add up to.
    blocks: u64,
    /// What the previous round is, for errors.
    what: String,
    properties: Arc<PlanProperties>,
    /// Whether the previous round ran, once for all of this node's
    /// partitions.
    ran: RanOnce,
}

impl AfterExec {
    /// `then` after `before` (its counts add up to `blocks`; `what` names
    /// that round).
    pub fn new(
        before: Arc<dyn ExecutionPlan>,
        then: Arc<dyn ExecutionPlan>,
        blocks: u64,
        what: String,
    ) -> Self {
        Self {
            properties: Arc::clone(then.properties()),
            before,
            then,
            blocks,
            what,
            ran: RanOnce::default(),
        }
    }

    /// The blocks the previous round's counts add up to.
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// What the previous round is.
    pub fn what(&self) -> &str {
        &self.what
    }

    /// What runs after the previous round.
    pub fn then(&self) -> &Arc<dyn ExecutionPlan> {
        &self.then
    }
}

/// Rounds `rounds` (each a stage's leaf whose tasks yield how many of its
/// blocks they ran, the blocks they add up to, and what it is) one after
/// the other on the workers: each after the previous one's counts,
/// broadcast. Gives the last round's counts broadcast to whatever reads
/// its output, with its blocks and what it is; `None` without rounds.
pub fn after_each_other(
    rounds: impl IntoIterator<Item = (Arc<dyn ExecutionPlan>, u64, String)>,
) -> Option<(Arc<dyn ExecutionPlan>, u64, String)> {
    let mut last: Option<(Arc<dyn ExecutionPlan>, u64, String)> = None;
    for (leaf, blocks, what) in rounds {
        let round: Arc<dyn ExecutionPlan> = match last.take() {
            None => leaf,
            Some((before, n, previous)) => Arc::new(AfterExec::new(before, leaf, n, previous)),
        };
        last = Some((Arc::new(BroadcastExec::new(round, 1)), blocks, what));
    }
    last
}

impl DisplayAs for AfterExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "AfterExec: after {} ({} blocks)", self.what, self.blocks)
    }
}

impl ExecutionPlan for AfterExec {
    named_plan_methods!("AfterExec");

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.before, &self.then]
    }

    no_expressions_method!();

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let [before, then] = two_children("AfterExec", children)?;
        Ok(Arc::new(Self::new(
            before,
            then,
            self.blocks,
            self.what.clone(),
        )))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let partitions = self.properties.partitioning.partition_count();
        if partition >= partitions {
            return exec_err!("AfterExec has {partitions} partitions, not partition {partition}");
        }
        let (before, blocks, what) = (Arc::clone(&self.before), self.blocks, self.what.clone());
        let counting = Arc::clone(&context);
        let counted =
            async move { cluster_tasks_ran(before, counting, || false, blocks, &what).await };
        let then = Arc::clone(&self.then);
        Ok(after_once(&self.ran, counted, then, partition, context))
    }
}

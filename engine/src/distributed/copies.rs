//! `COPY ... STORED AS ZARR` of a whole table on a cluster: a physical
//! optimizer rule of sessions with workers. [`ClusterCopies`] gives each
//! [`ArrayCopyExec`] its rechunk's rounds of tasks as inputs
//! ([`ArrayCopyExec::on_cluster`]: per round a
//! [`RechunkTasksExec`](crate::array::rechunk::RechunkTasksExec) under the
//! gathering of the tasks' counts). The distributed planner puts a network
//! boundary at each gathering, each round's stage is split into tasks by
//! the bytes it writes like a scan's by the bytes it decodes
//! ([`super::tasks`]), and the workers write the intermediate arrays and
//! the target's chunks while the session stages and commits the target.
//! A [`SelectionCopyExec`] (a COPY of a selection with computed variables)
//! gets its blockwise round first, then its rechunk's
//! ([`SelectionCopyExec::on_cluster`]). A `rechunk(...)`'s [`RechunkExec`]
//! runs all on the workers ([`rechunk_on_workers`]): its copy's rounds one
//! after the other (writing into the rechunked store the session made in
//! `work_dir`), then its scan, each task of which first runs the last
//! round's counts ([`AfterExec`]), so that what is above the scan (a
//! partial aggregate, a join's side) runs on the workers too. An [`FftCopyExec`] (a COPY of a
//! transform) gets its blocks' tasks ([`FftCopyExec::on_cluster`]: a
//! [`FftCopyTasksExec`](crate::array::fft::copy::FftCopyTasksExec) under
//! the gathering of their counts), the workers writing whole chunks of the
//! staged target.

use std::sync::Arc;

use datafusion::common::Result;
use datafusion::physical_plan::ExecutionPlan;

use crate::array::copy::selection::SelectionCopyExec;
use crate::array::copy::whole::ArrayCopyExec;
use crate::array::fft::FftCopyExec;
use crate::array::rechunk::RechunkExec;
use crate::distributed::barrier::{after_each_other, AfterExec};
use crate::plan_methods::physical_bottom_up_rule;

/// Runs the tasks of every `COPY` and `rechunk(...)` of a plan on the
/// workers.
#[derive(Debug, Default)]
pub struct ClusterCopies;

physical_bottom_up_rule!(ClusterCopies, "zarrfusion_cluster_copies", |node, _| {
    if let Some(copy) = node.downcast_ref::<SelectionCopyExec>() {
        return Ok(copy.on_cluster()?.map(|c| Arc::new(c) as _));
    }
    if let Some(copy) = node.downcast_ref::<FftCopyExec>() {
        return Ok(copy.on_cluster()?.map(|c| Arc::new(c) as _));
    }
    if let Some(rechunk) = node.downcast_ref::<RechunkExec>() {
        return Ok(rechunk_on_workers(rechunk)?.map(|r| Arc::new(r) as _));
    }
    let Some(copy) = node.downcast_ref::<ArrayCopyExec>() else {
        return Ok(None);
    };
    Ok(copy.on_cluster()?.map(|c| Arc::new(c) as _))
});

/// `rechunk` with its copy's rounds one after the other on the workers
/// ([`after_each_other`]) and its scan after the last one: each of the
/// scan's tasks runs that round's counts, broadcast, to their end and
/// checks they add up to its tasks before it reads. `None` when it runs on
/// the workers already.
pub fn rechunk_on_workers(rechunk: &RechunkExec) -> Result<Option<RechunkExec>> {
    let Some(rounds) = rechunk.cluster_rounds()? else {
        return Ok(None);
    };
    let rounds = rounds.into_iter().map(|r| (r.leaf, r.tasks, r.what));
    let scan = Arc::clone(rechunk.scan());
    let read: Arc<dyn ExecutionPlan> = match after_each_other(rounds) {
        Some((before, tasks, what)) => Arc::new(AfterExec::new(before, scan, tasks, what)),
        None => scan,
    };
    Ok(Some(rechunk.on_workers(read)))
}

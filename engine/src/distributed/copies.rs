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
//! ([`SelectionCopyExec::on_cluster`]); a `rechunk(...)`'s
//! [`RechunkExec`] gets its copy's rounds beside its scan
//! ([`RechunkExec::on_cluster`]), the workers writing into the rechunked
//! store the session made in `work_dir`. An [`FftCopyExec`] (a COPY of a
//! transform) gets its blocks' tasks ([`FftCopyExec::on_cluster`]: a
//! [`FftCopyTasksExec`](crate::array::fft::copy::FftCopyTasksExec) under
//! the gathering of their counts), the workers writing whole chunks of the
//! staged target.

use std::sync::Arc;

use crate::array::copy::selection::SelectionCopyExec;
use crate::array::copy::whole::ArrayCopyExec;
use crate::array::fft::FftCopyExec;
use crate::array::rechunk::RechunkExec;
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
        return Ok(rechunk.on_cluster()?.map(|r| Arc::new(r) as _));
    }
    let Some(copy) = node.downcast_ref::<ArrayCopyExec>() else {
        return Ok(None);
    };
    Ok(copy.on_cluster()?.map(|c| Arc::new(c) as _))
});

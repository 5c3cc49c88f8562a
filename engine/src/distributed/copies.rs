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
//! `work_dir`), then its scan (or a dense reduction's partial states),
//! each task of which first runs the last round's counts ([`AfterExec`]),
//! so that what is above the scan (a partial aggregate, a join's side)
//! runs on the workers too. An [`FftCopyExec`] (a COPY of a
//! transform) gets its blocks' tasks ([`FftCopyExec::on_cluster`]: a
//! [`BlockwiseTasksExec`](crate::array::blockwise::BlockwiseTasksExec) of its blocks under
//! the gathering of their counts), the workers writing whole chunks of the
//! staged target; when the transform reads a rechunked copy of its
//! variable or takes the four-step path, the copy's rounds or the two
//! passes (after the detrend's fit, when it has one) run on the workers
//! first and each task of the COPY after the last one's counts
//! ([`fft_copy_after_rounds`]); for a staged transform, the first stage's
//! rounds, then the COPY's tasks transforming its stored output along the
//! later dimensions.

use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{not_impl_err, Result};

use crate::array::copy::selection::SelectionCopyExec;
use crate::array::copy::whole::ArrayCopyExec;
use crate::array::fft::source::{ArraySource, ClusterStep};
use crate::array::fft::staged::StagedTransform;
use crate::array::fft::FftCopyExec;
use crate::array::rechunk::RechunkExec;
use crate::distributed::barrier::{after_each_other, AfterExec};
use crate::plan_methods::physical_bottom_up_rule;
use datafusion_distributed::BroadcastExec;

/// Runs the tasks of every `COPY` and `rechunk(...)` of a plan on the
/// workers.
#[derive(Debug, Default)]
pub struct ClusterCopies;

physical_bottom_up_rule!(ClusterCopies, "zarrfusion_cluster_copies", |node, _| {
    if let Some(copy) = node.downcast_ref::<SelectionCopyExec>() {
        return Ok(copy.on_cluster()?.map(|c| Arc::new(c) as _));
    }
    if let Some(copy) = node.downcast_ref::<FftCopyExec>() {
        let broadcast = |rows| Arc::new(BroadcastExec::new(rows, 1)) as _;
        // The stage after a staged transform's first must be one a worker
        // makes again (else the COPY runs in the session).
        let table = copy.table();
        let sendable = !matches!(table.source(), ArraySource::Staged(_))
            || StagedTransform::later_stage_of(table).is_some();
        if let Some(rounds) = sendable.then(|| copy.rounds_first(&broadcast)).flatten() {
            return Ok(fft_copy_after_rounds(copy, rounds?)?.map(|c| Arc::new(c) as _));
        }
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

/// `copy`, a COPY of a transform whose path makes a store in `work_dir`
/// first (a rechunked copy of its variable, the four-step passes), with
/// the rounds making it (`rounds`) one after the other on the workers and
/// its blocks' tasks there too, each once the last round's counts say
/// every task of it ran (an [`AfterExec`] over them). `None` without
/// rounds (the COPY then runs in the session).
fn fft_copy_after_rounds(
    copy: &FftCopyExec,
    rounds: Vec<ClusterStep>,
) -> Result<Option<FftCopyExec>> {
    let rounds = rounds.into_iter().map(|r| (r.leaf, r.blocks, r.what));
    let Some((before, tasks, what)) = after_each_other(rounds) else {
        return Ok(None);
    };
    let after = |leaf| Arc::new(AfterExec::new(before, leaf, tasks, what)) as _;
    copy.after_rounds_on_workers(after).map(Some)
}

/// `rechunk` with its copy's rounds one after the other on the workers
/// ([`after_each_other`]) and its read after the last one: each task of
/// the plan reading the rechunked store (its scan, or a dense reduction's
/// partial states) runs that round's counts, broadcast, to their end and
/// checks they add up to its tasks before it reads. `None` when it runs on
/// the workers already.
pub fn rechunk_on_workers(rechunk: &RechunkExec) -> Result<Option<RechunkExec>> {
    let Some(rounds) = rechunk.cluster_rounds()? else {
        return Ok(None);
    };
    let rounds = rounds.into_iter().map(|r| (r.leaf, r.tasks, r.what));
    let read = Arc::clone(rechunk.read());
    let Some((before, tasks, what)) = after_each_other(rounds) else {
        return Ok(Some(rechunk.on_workers(read)));
    };
    // The leaf reading the store (the plan above it, a reduction's merge,
    // stays where the distributed planner puts it).
    let mut leaves = 0;
    read.apply(|node| {
        leaves += usize::from(node.children().is_empty());
        Ok(TreeNodeRecursion::Continue)
    })?;
    if leaves != 1 {
        return not_impl_err!(
            "a rechunk(...) read by a plan of {leaves} leaves cannot run on a cluster's workers"
        );
    }
    let read = read
        .transform_up(|node| match node.children().is_empty() {
            true => {
                let (before, what) = (Arc::clone(&before), what.clone());
                Ok(Transformed::yes(
                    Arc::new(AfterExec::new(before, node, tasks, what)) as _,
                ))
            }
            false => Ok(Transformed::no(node)),
        })?
        .data;
    Ok(Some(rechunk.on_workers(read)))
}

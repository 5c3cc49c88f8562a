//! Transforms whose path writes a store in `work_dir` first, on a
//! cluster: a physical optimizer rule of sessions with workers.
//! [`ClusterPasses`] gives each [`FftExec`] on the four-step path its two
//! passes as inputs, and each staged transform (or chain whose inner
//! transform is stored first) its first stage ([`FftExec::on_cluster`]:
//! per pass and for a first stage a
//! [`BlockwiseTasksExec`](crate::array::blockwise::BlockwiseTasksExec) of its blocks, each
//! under the gathering of its blocks' counts). The distributed planner
//! puts a network boundary at each gathering, each stage is split into
//! tasks by the bytes it reads ([`super::tasks`]), the workers write the
//! intermediates or the first stage's output into the store the session
//! made in `work_dir`, and the session reads the output once they are
//! done. The stage after a staged transform's first, when it reads by
//! whole lines, runs on the workers too
//! ([`reading_on_cluster`]): the first stage's counts are
//! broadcast to each of its tasks, which reads its own blocks of the
//! stored output once every block is there; a first stage on the
//! four-step path runs its rounds (two passes, then its blocks) one after
//! the other on the workers for it ([`super::barrier`]). Transforms by
//! whole lines need no rule: their `FftExec` is a stage's leaf itself. A
//! transform reading a rechunked copy of its variable (when a block of
//! whole lines in the store's chunks does not fit) gets the copy's rounds
//! on the workers and reads the copy there ([`reading_copy_on_cluster`]).

use std::sync::Arc;

use crate::array::fft::staged::StagedTransform;
use crate::array::fft::FftExec;
use crate::array::rechunk::cluster::Round;
use crate::distributed::barrier::{after_each_other, AfterExec};
use crate::plan_methods::physical_bottom_up_rule;
use datafusion_distributed::BroadcastExec;

/// Runs the passes of every four-step transform of a plan, and the first
/// stage of every staged one, on the workers.
#[derive(Debug, Default)]
pub struct ClusterPasses;

physical_bottom_up_rule!(ClusterPasses, "zarrfusion_cluster_passes", |node, _| {
    let Some(fft) = node.downcast_ref::<FftExec>() else {
        return Ok(None);
    };
    if let Some(rounds) = fft.copy_rounds() {
        return Ok(reading_copy_on_cluster(fft, rounds?).map(|r| Arc::new(r) as _));
    }
    let broadcast = |rows| Arc::new(BroadcastExec::new(rows, 1)) as _;
    let Some(fft) = fft.on_cluster(&broadcast)? else {
        return Ok(None);
    };
    Ok(Some(Arc::new(reading_on_cluster(&fft).unwrap_or(fft))))
});

/// `fft` on the four-step path, whose passes [`FftExec::on_cluster`] put
/// on the workers, with the passes one after the other there and its
/// output read there too, each task once the second pass's counts say
/// every block ran. `fft`, whose first stage [`FftExec::on_cluster`] put
/// on the workers, with the stage after it on the workers too, when a worker can make it
/// again ([`StagedTransform::later_stage_of`]): the first stage's rounds
/// (its four-step passes, then its blocks) one after the other on the
/// workers ([`after_each_other`]), the last one's counts broadcast to each
/// task of the later stage, which reads its own blocks once every block
/// is stored. `None` otherwise (the session then runs the rounds in turn
/// and reads the store).
pub fn reading_on_cluster(fft: &FftExec) -> Option<FftExec> {
    if let Some(passes) = fft.pass_rounds() {
        let rounds = passes.into_iter().map(|r| (r.leaf, r.blocks, r.what));
        let (input, _, _) = after_each_other(rounds)?;
        return Some(fft.after_passes(input));
    }
    StagedTransform::later_stage_of(fft.table())?;
    let (stage, _) = fft.first_stage()?;
    let rounds = fft.first_stage_rounds()?.into_iter();
    let (input, blocks, _) = after_each_other(rounds.map(|r| (r.leaf, r.blocks, r.what)))?;
    Some(fft.after_first_stage(input, Arc::clone(stage), blocks))
}

/// `fft`, reading a rechunked copy of its variable, with the copy's
/// rounds (`rounds`) one after the other on the workers and its blocks
/// read there too, each task once the last round's counts say every task
/// of it ran (an [`AfterExec`] over it). `None` when the copy has no
/// round.
fn reading_copy_on_cluster(fft: &FftExec, rounds: Vec<Round>) -> Option<AfterExec> {
    let rounds = rounds.into_iter().map(|r| (r.leaf, r.tasks, r.what));
    let (before, tasks, what) = after_each_other(rounds)?;
    let reading = Arc::new(fft.reading_copy_on_workers());
    Some(AfterExec::new(before, reading, tasks, what))
}

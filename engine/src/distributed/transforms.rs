//! Transforms whose path writes a store in `work_dir` first, on a
//! cluster: a physical optimizer rule of sessions with workers.
//! [`ClusterPasses`] gives each [`FftExec`] on the four-step path its two
//! passes as inputs, and each staged transform (or chain whose inner
//! transform is stored first) its first stage ([`FftExec::on_cluster`]:
//! per pass a [`FourStepPassExec`](crate::array::fft::FourStepPassExec),
//! for a first stage an
//! [`FftCopyTasksExec`](crate::array::fft::copy::FftCopyTasksExec), each
//! under the gathering of its blocks' counts). The distributed planner
//! puts a network boundary at each gathering, each stage is split into
//! tasks by the bytes it reads ([`super::tasks`]), the workers write the
//! intermediates or the first stage's output into the store the session
//! made in `work_dir`, and the session reads the output once they are
//! done. The stage after a staged transform's first, when it reads by
//! whole lines, runs on the workers too
//! ([`FftExec::reading_on_cluster`]): the first stage's counts are
//! broadcast to each of its tasks, which reads its own blocks of the
//! stored output once every block is there. Transforms by whole lines
//! need no rule: their `FftExec` is a stage's leaf itself.

use std::sync::Arc;

use crate::array::fft::staged::StagedTransform;
use crate::array::fft::FftExec;
use crate::plan_methods::physical_bottom_up_rule;

/// Runs the passes of every four-step transform of a plan, and the first
/// stage of every staged one, on the workers.
#[derive(Debug, Default)]
pub struct ClusterPasses;

physical_bottom_up_rule!(ClusterPasses, "zarrfusion_cluster_passes", |node, _| {
    let Some(fft) = node.downcast_ref::<FftExec>() else {
        return Ok(None);
    };
    let Some(fft) = fft.on_cluster()? else {
        return Ok(None);
    };
    // The stage after a staged transform's first, on the workers too when
    // they can make it again.
    let reading =
        StagedTransform::later_stage_of(fft.table()).and_then(|_| fft.reading_on_cluster());
    Ok(Some(Arc::new(reading.unwrap_or(fft))))
});

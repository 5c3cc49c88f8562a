//! The blockwise primitive: a kernel making every chunk of a grid on its
//! own, written as whole chunks of a store (a scratch store in
//! `work_dir`, or the target).
//!
//! | module | owns |
//! |---|---|
//! | [`step`] | the step: the grid written, its chunks, its variables and its kernel (expressions over each chunk's source box, or another operator's writers), its memory, run on the task runner |
//! | [`exec`] | the step's tasks on a cluster: one plan node, whatever the kernel, dealing runs of chunks to a stage's tasks |
//!
//! The operators made of it: a COPY of a selection or of rolling windows
//! ([`crate::array::copy`]: blockwise, then rechunk), a COPY of a
//! transform and a staged transform's first stage ([`crate::array::fft`]:
//! the transform's blocks as its kernel). A new operator whose work is
//! chunk by chunk writes its kernel as a [`StepWriters`] and gets the
//! task runner, the memory check and the cluster's node (and, with a
//! codec entry for its kernel, the workers) from here.

pub mod exec;
pub(crate) mod step;

pub use exec::{BlockwiseTasks, BlockwiseTasksExec, ChunksInto};
pub(crate) use step::{
    source_long_block, BlockwiseStep, Evaluate, JoinedMemory, MayWrite, SelectedGrid, Step,
    StepBytes, StepGrid, StepWriters,
};

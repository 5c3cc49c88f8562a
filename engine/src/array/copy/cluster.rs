//! `COPY` of a selection with computed variables on a cluster's workers.
//! Its two steps become rounds of tasks, as the whole-table COPY's
//! rechunk does ([`crate::array::rechunk::RechunkTasksExec`]):
//!
//! 1. *blockwise* (the primitive's [`BlockwiseTasksExec`]): the workers
//!    evaluate the expressions chunk by chunk and write the chunks into the
//!    intermediate store the session made in `work_dir` (or, when they are
//!    whole chunks of the target, straight into the staged target);
//! 2. *rechunk*: the rounds of the rechunk of that intermediate store into
//!    the target, planned by the session from the metadata it is about to
//!    write ([`PreparedRechunk::planned_before_written`]) and by each
//!    worker again when its tasks run.
//!
//! The session stages the target, writes the intermediate store's group
//! (coordinates and metadata) before the first round and the target's
//! metadata after the last, and commits the target atomically; the
//! intermediate store is erased however the COPY ends.
//!
//! When the variables read a table joined in (an anomaly against its
//! climatology), its plan is step 1's input: the distributed planner makes
//! it a stage of its own and broadcasts its rows to each task of step 1
//! ([`crate::distributed::broadcasts`]), which holds them as a dense array
//! beside its chunks, as the session does on one machine.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use datafusion::common::{exec_err, DataFusionError, Result};
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::execution::TaskContext;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion::physical_plan::ExecutionPlan;
use zarrs::storage::store::MemoryStore;
use zarrs::storage::ReadableWritableListableStorage;

use super::steps::Blockwise;
use crate::array::blockwise::{BlockwiseTasks, BlockwiseTasksExec, ChunksInto};
use crate::array::rechunk::{ClusterRounds, PreparedRechunk, TargetEncoding};
use crate::array::tasks::run_cluster_tasks;
use crate::table::BroadcastInputs;
use crate::write::scratch::ScratchStore;
use crate::write::target::StagedTarget;
use crate::write::write_job::Written;
use crate::zarr::StoreLocation;

/// A COPY of a selection on a cluster: where its tasks write, and their
/// rounds.
#[derive(Debug, Clone)]
pub(crate) struct ClusterSelection {
    /// The target, staged by the session.
    staged: StagedTarget,
    /// Step 1's chunks under the gathering of their counts.
    blockwise: Arc<dyn ExecutionPlan>,
    /// Step 2, unless step 1 writes the target's chunks itself: the
    /// intermediate store, the rechunk planned from its metadata and its
    /// rounds.
    rechunk: Option<ClusterRechunk>,
}

/// Step 2 of a COPY of a selection on a cluster.
#[derive(Debug, Clone)]
struct ClusterRechunk {
    intermediate: StoreLocation,
    rounds: ClusterRounds,
}

impl ClusterSelection {
    /// The rounds of `copy` on a cluster's workers, its step 1 reading the
    /// tables joined in of `broadcasts` (their plans its inputs).
    pub(crate) fn plan(
        copy: &Blockwise,
        broadcasts: BroadcastInputs,
        runtime: &RuntimeEnv,
    ) -> Result<Self> {
        let staged = copy.to.staged()?;
        let work_dir = copy.work_dir();
        let (into, encoding, chunks, rechunk) = match copy.direct {
            true => (
                ChunksInto::Target {
                    staged: staged.clone(),
                },
                TargetEncoding::of(&copy.to.options),
                copy.target_chunks.clone(),
                None,
            ),
            false => {
                let intermediate = ScratchStore::name(&work_dir, "zarrfusion-copy", ".zarr");
                let plain = TargetEncoding::of(&copy.intermediate_options());
                let rechunk = ClusterRechunk::plan(copy, intermediate.clone(), &staged, runtime)?;
                (
                    ChunksInto::Scratch {
                        location: intermediate.to_string(),
                    },
                    plain,
                    copy.blocks.block.clone(),
                    Some(rechunk),
                )
            }
        };
        let sent = BlockwiseTasks {
            block: copy.blocks.block.clone(),
            chunks,
            variables: (copy.blocks.names.iter().zip(&copy.blocks.types))
                .map(|(n, t)| (n.clone(), t.to_string()))
                .collect(),
            into,
            encoding,
            workers: copy.blocks.step.workers(),
        };
        let blocks = Arc::clone(&copy.blocks);
        let metrics = ExecutionPlanMetricsSet::new();
        let exec = BlockwiseTasksExec::new(blocks, Arc::new(sent), broadcasts, metrics);
        Ok(Self {
            staged,
            blockwise: Arc::new(CoalescePartitionsExec::new(Arc::new(exec))),
            rechunk,
        })
    }

    /// Its rounds: step 1's, then the rechunk's.
    pub(crate) fn rounds(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        let rechunk = self.rechunk.iter().flat_map(|r| &r.rounds.rounds);
        std::iter::once(&self.blockwise).chain(rechunk).collect()
    }

    /// This with its rounds replaced by `rounds`.
    pub(crate) fn with_rounds(&self, mut rounds: Vec<Arc<dyn ExecutionPlan>>) -> Result<Self> {
        if rounds.len() != self.rounds().len() {
            return exec_err!(
                "a COPY of a selection has {} rounds, got {}",
                self.rounds().len(),
                rounds.len()
            );
        }
        let blockwise = rounds.remove(0);
        let rechunk = (self.rechunk.as_ref())
            .map(|r| {
                Ok::<_, DataFusionError>(ClusterRechunk {
                    intermediate: r.intermediate.clone(),
                    rounds: r.rounds.with_rounds(rounds)?,
                })
            })
            .transpose()?;
        Ok(Self {
            staged: self.staged.clone(),
            blockwise,
            rechunk,
        })
    }

    /// Runs the COPY `copy` on the cluster from a blocking thread: stages
    /// the target, writes the intermediate store's group, runs step 1's
    /// round and the rechunk's, and commits the target (metadata last).
    pub(crate) fn run(
        &self,
        copy: &Blockwise,
        handle: &tokio::runtime::Handle,
        context: &Arc<TaskContext>,
        cancelled: &AtomicBool,
    ) -> Result<Written> {
        let runtime = context.runtime_env();
        let step1 = |cancelled: &AtomicBool| {
            let tasks = copy.blocks.tasks();
            let input = Arc::clone(&self.blockwise);
            let stopped = || cancelled.load(Ordering::Relaxed);
            run_cluster_tasks(
                handle,
                input,
                Arc::clone(context),
                &stopped,
                tasks,
                "the COPY",
            )
        };
        copy.to
            .write_staged(&self.staged, &runtime, cancelled, |out| {
                match &self.rechunk {
                    None => {
                        let group =
                            (copy.blocks).group(out, &copy.to.options, &copy.target_chunks)?;
                        step1(cancelled)?;
                        group.store_metadata()
                    }
                    Some(rechunk) => {
                        let intermediate = ScratchStore::create_at(
                            &copy.work_dir(),
                            rechunk.intermediate.clone(),
                            &runtime,
                        )?;
                        copy.start_intermediate(intermediate.storage())?;
                        step1(cancelled)?;
                        rechunk.rounds.run(handle, context, cancelled, "the COPY")?;
                        rechunk.rounds.prepared().write_metadata(out)
                    }
                }
            })?;
        // The rechunk's decoded bytes read and written, as planned.
        let step2 = (self
            .rechunk
            .iter()
            .flat_map(|r| r.rounds.prepared().arrays()))
        .fold((0u64, 0u64), |(read, written), a| {
            (
                read.saturating_add(a.plan.bytes_read()),
                written.saturating_add(a.plan.bytes_written()),
            )
        });
        Ok(copy.written(copy.blocks.planned_bytes(), step2))
    }
}

impl ClusterRechunk {
    /// The rechunk of the intermediate store `intermediate` of `copy`
    /// into the target staged as `staged`, planned from the metadata its
    /// group will have.
    fn plan(
        copy: &Blockwise,
        intermediate: StoreLocation,
        staged: &StagedTarget,
        runtime: &RuntimeEnv,
    ) -> Result<Self> {
        let memory = Arc::new(MemoryStore::new());
        let metadata: ReadableWritableListableStorage = memory.clone();
        copy.start_intermediate(&metadata)?;
        let chunks: Vec<(String, u64)> = (copy.blocks.dim_names().into_iter())
            .zip(copy.target_chunks.iter().copied())
            .collect();
        let prepared = PreparedRechunk::planned_before_written(
            &intermediate.to_string(),
            memory,
            &chunks,
            Some(TargetEncoding::of(&copy.to.options)),
            &copy.rechunk,
            runtime,
        )?;
        Ok(Self {
            intermediate,
            rounds: ClusterRounds::plan(&Arc::new(prepared), staged.clone())?,
        })
    }
}

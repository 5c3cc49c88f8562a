//! The rechunk primitive on a cluster's workers. A rechunk (a `COPY` of a
//! whole table, see [`crate::array::copy::whole`]) runs its tasks on the
//! workers in rounds, round `r` every array's stage `r`: the workers write
//! intermediate arrays into a scratch store every worker reaches (named
//! by the session in `work_dir`) and whole target chunks straight into the
//! store being written; the session's process stages that store, runs the
//! rounds one after another and commits the store once every task is done
//! (metadata last), so the output stays atomic.
//!
//! - [`RechunkTasks`]: the rechunk as it travels, plain data: the source's
//!   location and object-store options, the chunk lengths asked for, the
//!   target encoding, the scratch store, and per array each stage's chunks
//!   and the region a task copies, its threads and the target metadata the
//!   session writes. A worker plans the
//!   rechunk again from the source ([`PreparedRechunk::for_cluster_tasks`]:
//!   its own `allowed_locations` and `allowed_mem`), so that what it
//!   writes matches that metadata or is refused.
//! - [`StagedTarget`] (of [`crate::write::target`]): where the chunks go: the temporary directory beside
//!   a local target (renamed into place by the session), or the claimed
//!   object-store prefix (the session stores the metadata last, or erases
//!   everything when a task fails).
//! - [`RechunkTasksExec`]: the leaf a distributed task runs: its contiguous
//!   run of a round's tasks (numbered across the arrays), yielding how many
//!   it ran; the session checks they add up to all of them.
//! - [`ClusterRounds`]: the rounds as the session holds and runs them, one
//!   input of the operator each (a `COPY` of a whole table or of a
//!   selection, a `rechunk(...)`).

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use datafusion::common::{exec_err, human_readable_size, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{PreparedRechunk, RechunkOptions, TargetEncoding};
use crate::array::tasks::run_cluster_tasks;
use crate::memory::reserve;
use crate::plan_methods::{leaf_plan_methods, metered_plan_methods};
use crate::table::task_index;
use crate::write::scratch::ScratchStore;
use crate::write::target::StagedTarget;
use crate::write::write_job::{counted_properties, WriteJob, Written};
use crate::zarr::StoreLocation;

/// A rechunk's tasks as they travel to a cluster's workers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RechunkTasks {
    /// The store read: a path or an object-store URL.
    pub source: String,
    /// Its object-store options (the table's `OPTIONS`).
    pub source_storage: BTreeMap<String, String>,
    /// The session's object-store settings.
    pub storage_defaults: BTreeMap<String, String>,
    /// The chunk length asked for each named dimension.
    pub chunks: Vec<(String, u64)>,
    /// The target's format and compression, when not the source's.
    pub encoding: Option<TargetEncoding>,
    /// Chunk reads kept in flight ahead of the tasks (a source in an
    /// object store).
    pub io_concurrency: usize,
    /// The scratch store of the intermediate arrays (a path or a URL),
    /// made by the session; `None` when every array takes one stage.
    pub work: Option<String>,
    /// The arrays, in the order their tasks are numbered.
    pub arrays: Vec<ArrayTasks>,
    /// Whether the source is written by an earlier round of the same
    /// query (the intermediate store of a `COPY` of a selection): a worker
    /// plans the tasks again when they run, not when it receives them.
    pub planned_when_run: bool,
}

impl RechunkTasks {
    /// Round `round`'s stages: every array's stage of that number, for the
    /// arrays that have one.
    fn round(&self, round: usize) -> impl Iterator<Item = &StageTasks> {
        self.arrays.iter().filter_map(move |a| a.stages.get(round))
    }

    /// The tasks of round `round`, numbered across the arrays in order.
    pub fn round_tasks(&self, round: usize) -> u64 {
        self.round(round).map(|s| s.tasks).sum()
    }

    /// Round `round`'s tasks as runs of `(count, bytes each)`, an array's
    /// stage a run (its tasks' decoded bytes written, on average).
    pub fn round_task_weights(&self, round: usize) -> Vec<(u64, u64)> {
        (self.round(round))
            .map(|s| (s.tasks, s.bytes_written / s.tasks.max(1)))
            .collect()
    }

    /// Decoded bytes round `round` writes.
    pub fn round_bytes_written(&self, round: usize) -> u64 {
        self.round(round).map(|s| s.bytes_written).sum()
    }
}

/// One array's tasks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArrayTasks {
    /// The array's name in the store.
    pub name: String,
    /// Its stages, in order: the last writes the target.
    pub stages: Vec<StageTasks>,
    /// Tasks run at once by one distributed task.
    pub workers: usize,
    /// The target array's metadata (JSON), as the session writes it.
    pub target: Value,
}

/// One stage of an array's rechunk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageTasks {
    /// The chunks it writes.
    pub to: Vec<u64>,
    /// The region one task copies: whole chunks of `to`.
    pub region: Vec<u64>,
    /// Its tasks.
    pub tasks: u64,
    /// The decoded bytes they write.
    pub bytes_written: u64,
}

/// A run of a round of a rechunk's tasks, writing intermediate arrays
/// into the scratch store and whole target chunks into a staged target:
/// the leaf of a cluster's rechunk stage. Its one partition yields one
/// row, `tasks`: how many of the round's tasks it ran.
#[derive(Debug)]
pub struct RechunkTasksExec {
    rechunk: Arc<RechunkTasks>,
    planned: Planned,
    target: StagedTarget,
    /// The round: every array's stage of this number.
    round: usize,
    /// The distributed tasks the rechunk's tasks are dealt to.
    tasks: usize,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

/// A [`RechunkTasksExec`]'s rechunk: planned, or planned when it runs
/// (under these options: its source is written by an earlier round).
#[derive(Debug, Clone)]
enum Planned {
    Now(Arc<PreparedRechunk>),
    WhenRun(Arc<RechunkOptions>),
}

impl RechunkTasksExec {
    /// The tasks of round `round` of `prepared` (as `rechunk` sends it)
    /// writing into `target`, in one distributed task.
    pub fn new(
        rechunk: Arc<RechunkTasks>,
        prepared: Arc<PreparedRechunk>,
        target: StagedTarget,
        round: usize,
    ) -> Self {
        Self::with_planned(rechunk, Planned::Now(prepared), target, round)
    }

    /// The tasks of round `round` of `rechunk` writing into `target`,
    /// planned under `options` when they run (a worker's, when the
    /// source is written by an earlier round:
    /// [`RechunkTasks::planned_when_run`]).
    pub fn planned_when_run(
        rechunk: Arc<RechunkTasks>,
        options: RechunkOptions,
        target: StagedTarget,
        round: usize,
    ) -> Self {
        Self::with_planned(rechunk, Planned::WhenRun(Arc::new(options)), target, round)
    }

    fn with_planned(
        rechunk: Arc<RechunkTasks>,
        planned: Planned,
        target: StagedTarget,
        round: usize,
    ) -> Self {
        Self {
            rechunk,
            planned,
            target,
            round,
            tasks: 1,
            properties: counted_properties("tasks"),
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }

    /// A copy dealing the rechunk's tasks to `tasks` distributed tasks.
    pub fn with_tasks(&self, tasks: usize) -> Self {
        Self {
            rechunk: Arc::clone(&self.rechunk),
            planned: self.planned.clone(),
            target: self.target.clone(),
            round: self.round,
            tasks: tasks.max(1),
            properties: Arc::clone(&self.properties),
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }

    /// The distributed tasks the rechunk's tasks are dealt to.
    pub fn tasks(&self) -> usize {
        self.tasks
    }

    /// The rechunk as it travels.
    pub fn rechunk(&self) -> &RechunkTasks {
        &self.rechunk
    }

    /// Where the chunks go.
    pub fn target(&self) -> &StagedTarget {
        &self.target
    }

    /// The round it runs.
    pub fn round(&self) -> usize {
        self.round
    }

    /// The round's tasks, numbered across the arrays.
    pub fn rechunk_tasks(&self) -> u64 {
        self.rechunk.round_tasks(self.round)
    }

    /// Decoded bytes the round writes.
    pub fn bytes_written(&self) -> u64 {
        self.rechunk.round_bytes_written(self.round)
    }

    /// The rechunk's tasks distributed task `task` (of [`tasks`](Self::tasks)) runs.
    fn run_of(&self, context: &Arc<TaskContext>) -> Result<Range<u64>> {
        let all = 0..self.rechunk_tasks();
        if self.tasks == 1 {
            return Ok(all);
        }
        let (task, count) = task_index(
            "RechunkTasksExec",
            &self.rechunk.source,
            self.tasks,
            context,
        )?;
        let segments = self.rechunk.round_task_weights(self.round);
        let (i, n) = (task as u64, count as u64);
        Ok(share_by_weight(&segments, i, n))
    }
}

/// A rechunk's rounds on a cluster's workers as the session holds them:
/// the rechunk, where its tasks write, the scratch store of its
/// intermediate arrays, and each round's tasks ([`RechunkTasksExec`])
/// under the gathering of their counts, where the distributed planner puts
/// a network boundary. The operator that holds them has them as inputs
/// and runs them in order ([`run`](Self::run)).
#[derive(Debug, Clone)]
pub(crate) struct ClusterRounds {
    prepared: Arc<PreparedRechunk>,
    /// Where the tasks write the target's chunks, staged by the session.
    pub(crate) staged: StagedTarget,
    /// The scratch store of the intermediate arrays, when an array takes
    /// more than one stage.
    work: Option<StoreLocation>,
    /// Each round's tasks (every array's stage of that number) under the
    /// gathering of their counts, in order.
    pub(crate) rounds: Vec<Arc<dyn ExecutionPlan>>,
}

impl ClusterRounds {
    /// The rounds of `prepared` writing into `staged`; the scratch store
    /// of the intermediate arrays is named now, in `work_dir` (which every
    /// worker must reach), and made when the rounds run.
    pub(crate) fn plan(prepared: &Arc<PreparedRechunk>, staged: StagedTarget) -> Result<Self> {
        let work = (prepared.has_intermediates())
            .then(|| ScratchStore::name(prepared.work_dir(), "zarrfusion-rechunk", ""));
        let rounds = (round_leaves(prepared, &staged, work.as_ref())?.into_iter())
            .map(|round| {
                Arc::new(CoalescePartitionsExec::new(round.leaf)) as Arc<dyn ExecutionPlan>
            })
            .collect();
        Ok(Self {
            prepared: Arc::clone(prepared),
            staged,
            work,
            rounds,
        })
    }

    /// The rechunk whose rounds these are.
    pub(crate) fn prepared(&self) -> &Arc<PreparedRechunk> {
        &self.prepared
    }

    /// These rounds replaced by `rounds` (the inputs the planner gave back).
    pub(crate) fn with_rounds(&self, rounds: Vec<Arc<dyn ExecutionPlan>>) -> Result<Self> {
        if rounds.len() != self.rounds.len() {
            return exec_err!(
                "the rechunk of '{}' has {} rounds, got {}",
                self.prepared.source(),
                self.rounds.len(),
                rounds.len()
            );
        }
        Ok(Self {
            rounds,
            ..self.clone()
        })
    }

    /// Makes the scratch store, runs the rounds one after another (each
    /// must have run all its tasks; `what` names the operation in errors),
    /// erasing each intermediate array once the next round has read it;
    /// the scratch store is erased when this ends, however it ends.
    pub(crate) fn run(
        &self,
        handle: &tokio::runtime::Handle,
        context: &Arc<TaskContext>,
        cancelled: &AtomicBool,
        what: &str,
    ) -> Result<()> {
        let prepared = &self.prepared;
        let work = (self.work.clone())
            .map(|w| ScratchStore::create_at(prepared.work_dir(), w, &context.runtime_env()))
            .transpose()?;
        for (round, input) in self.rounds.iter().enumerate() {
            let stopped = || cancelled.load(Ordering::Relaxed);
            run_cluster_tasks(
                handle,
                Arc::clone(input),
                Arc::clone(context),
                &stopped,
                prepared.round_tasks(round),
                what,
            )?;
            if let Some(work) = &work {
                for read in prepared.read_by_round(round) {
                    work.erase(&read);
                }
            }
        }
        Ok(())
    }
}

/// One round of a rechunk on a cluster: the leaf of its stage (a
/// [`RechunkTasksExec`], whose tasks yield how many of the round's tasks
/// they ran), the tasks they add up to, and what it is (in errors).
pub struct Round {
    /// The round's tasks.
    pub leaf: Arc<dyn ExecutionPlan>,
    /// How many tasks the round has.
    pub tasks: u64,
    /// What it is.
    pub what: String,
}

/// The rounds of `prepared` in order, writing into `staged` and their
/// intermediate arrays into the scratch store `work` (which must exist
/// when they run).
pub(crate) fn round_leaves(
    prepared: &Arc<PreparedRechunk>,
    staged: &StagedTarget,
    work: Option<&StoreLocation>,
) -> Result<Vec<Round>> {
    let tasks = Arc::new(prepared.cluster_tasks(work)?);
    Ok((0..prepared.rounds())
        .map(|round| Round {
            leaf: Arc::new(RechunkTasksExec::new(
                Arc::clone(&tasks),
                Arc::clone(prepared),
                staged.clone(),
                round,
            )),
            tasks: prepared.round_tasks(round),
            what: format!("round {round} of the rechunk of {}", prepared.source()),
        })
        .collect())
}

/// Share `i` of `n` of tasks numbered in order, given as runs of
/// `(count, weight of each)`: a contiguous run of them, the shares'
/// weights as near equal as whole tasks allow (a task goes to the share
/// its middle falls in, counting the weights in order). A rechunk's
/// arrays have tasks of very different sizes (a coordinate's one small
/// task beside a variable's large ones): dealt by count, one distributed
/// task would get every large one.
fn share_by_weight(segments: &[(u64, u64)], i: u64, n: u64) -> Range<u64> {
    let total: u128 = (segments.iter())
        .map(|&(count, weight)| u128::from(count) * u128::from(weight.max(1)))
        .sum();
    let n = u128::from(n.max(1));
    // The first task whose middle is at least `at` (in doubled units: a
    // task of weight `w` starting at `s` has its middle at `2s + w`).
    let first_at = |at: u128| {
        let (mut start, mut index) = (0u128, 0u64);
        for &(count, weight) in segments {
            let weight = u128::from(weight.max(1));
            let count_wide = u128::from(count);
            if count > 0 && 2 * at <= 2 * start + (2 * count_wide - 1) * weight {
                let within = (2 * at)
                    .saturating_sub(2 * start + weight)
                    .div_ceil(2 * weight);
                return index + u64::try_from(within).unwrap_or(count);
            }
            start += count_wide * weight;
            index += count;
        }
        index
    };
    let share = |j: u128| total * j / n;
    first_at(share(u128::from(i)))..first_at(share(u128::from(i) + 1))
}

impl DisplayAs for RechunkTasksExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        // A rechunk of a store an earlier round writes shows the same on
        // both sides: each worker plans its memory when the tasks run.
        let memory = match &self.planned {
            Planned::Now(p) if !self.rechunk.planned_when_run => {
                human_readable_size(p.projected_memory() as usize)
            }
            _ => "planned when it runs".to_string(),
        };
        write!(
            f,
            "RechunkTasksExec: store={}, staged={}, round={}, projected_memory={memory}, rechunk_tasks={}, tasks={}",
            self.rechunk.source,
            self.target,
            self.round,
            self.rechunk_tasks(),
            self.tasks
        )
    }
}

impl ExecutionPlan for RechunkTasksExec {
    leaf_plan_methods!("RechunkTasksExec");

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let run = self.run_of(&context)?;
        let (rechunk, planned) = (Arc::clone(&self.rechunk), self.planned.clone());
        let target = self.target.clone();
        let round = self.round;
        let job = WriteJob {
            operator: "RechunkTasksExec",
            store: &self.rechunk.source,
            projected: match &planned {
                Planned::Now(prepared) => prepared.projected_memory() as usize,
                // Reserved once planned.
                Planned::WhenRun(_) => 0,
            },
            metrics: &self.metrics,
            properties: &self.properties,
        };
        let (task_context, metrics) = (Arc::clone(&context), self.metrics.clone());
        job.run(partition, &context, move |cancelled| {
            let (writer, _reservation) = match planned {
                Planned::Now(prepared) => (prepared, None),
                Planned::WhenRun(options) => {
                    let runtime = task_context.runtime_env();
                    let options = Arc::unwrap_or_clone(options);
                    let prepared = PreparedRechunk::for_cluster_tasks(&rechunk, options, &runtime)?;
                    let reservation = reserve(
                        "RechunkTasksExec",
                        &rechunk.source,
                        partition,
                        prepared.projected_memory() as usize,
                        &task_context,
                        &metrics,
                    )?;
                    (Arc::new(prepared), Some(reservation))
                }
            };
            let out = target.open(writer.runtime())?;
            let work = (rechunk.work.as_deref())
                .map(|w| ScratchStore::open(w, writer.runtime()))
                .transpose()?;
            let may_write = || target.still_staged(&out);
            let done =
                writer.copy_task_run(&out, work.as_ref(), (round, run), &may_write, cancelled)?;
            Ok(Written {
                rows: done.tasks,
                bytes_read: done.bytes_read,
                bytes_written: done.bytes_written,
            })
        })
    }

    metered_plan_methods!(|_| Some(1));
}

#[cfg(test)]
mod tests {
    use super::share_by_weight;

    #[test]
    fn shares_by_weight_are_contiguous_cover_every_task_and_balance() {
        // A variable's two large tasks beside three coordinates' small ones.
        let segments = [(2u64, 500u64), (1, 1), (1, 1), (1, 1)];
        let shares: Vec<_> = (0..2).map(|i| share_by_weight(&segments, i, 2)).collect();
        assert_eq!(shares, [0..1, 1..5]);
        for (segments, n) in [
            (vec![(7u64, 3u64), (0, 9), (5, 1), (1, 40)], 3u64),
            (vec![(1, 10)], 4),
            (vec![(100, 1), (3, 1000)], 5),
            (vec![(4, 0)], 2),
        ] {
            let tasks: u64 = segments.iter().map(|s| s.0).sum();
            let mut next = 0;
            for i in 0..n {
                let run = share_by_weight(&segments, i, n);
                assert_eq!(run.start, next, "{segments:?} share {i} of {n}");
                assert!(run.end >= run.start);
                next = run.end;
            }
            assert_eq!(next, tasks, "{segments:?}: every task dealt once");
        }
        // Equal tasks: near-equal counts, as by count.
        let even: Vec<_> = (0..3).map(|i| share_by_weight(&[(10, 7)], i, 3)).collect();
        assert_eq!(even, [0..3, 3..7, 7..10]);
    }
}

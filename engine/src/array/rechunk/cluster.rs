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
//! - [`StagedTarget`]: where the chunks go: the temporary directory beside
//!   a local target (renamed into place by the session), or the claimed
//!   object-store prefix (the session stores the metadata last, or erases
//!   everything when a task fails).
//! - [`RechunkTasksExec`]: the leaf a distributed task runs: its contiguous
//!   run of a round's tasks (numbered across the arrays), yielding how many
//!   it ran; the session checks they add up to all of them.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::common::{exec_err, human_readable_size, DataFusionError, Result};
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::EquivalenceProperties;
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties,
};
use datafusion_distributed::DistributedTaskContext;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use zarrs::filesystem::FilesystemStore;
use zarrs::storage::{ReadableWritableListableStorage, StoreKey};

use super::{PreparedRechunk, TargetEncoding};
use crate::plan_methods::{leaf_plan_methods, metered_plan_methods};
use crate::table::share_of;
use crate::write::store::{io_error, CLAIM_KEY};
use crate::write::write_job::{WriteJob, Written};
use crate::zarr::{open_writable_remote, RemoteStorage, StoreLocation};

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
}

/// The scratch store of a rechunk's intermediate arrays, as a worker
/// opens it.
pub struct WorkStore {
    /// The store.
    pub storage: ReadableWritableListableStorage,
    /// Its object store, when it is in one (for reading ahead).
    pub remote: Option<Arc<RemoteStorage>>,
}

impl WorkStore {
    /// The scratch store at `location`, which the session made: a local
    /// one must exist (it is gone only when the rechunk failed or ended).
    fn open(location: &str, runtime: &RuntimeEnv) -> Result<Self> {
        match StoreLocation::parse(location)? {
            StoreLocation::Local(path) => {
                if !path.is_dir() {
                    return exec_err!(
                        "the rechunk's scratch store '{}' is gone (the COPY failed or was \
                         cancelled)",
                        path.display()
                    );
                }
                Ok(Self {
                    storage: Arc::new(FilesystemStore::new(&path).map_err(|e| io_error(&path, e))?),
                    remote: None,
                })
            }
            StoreLocation::Remote(url) => {
                let remote = open_writable_remote(location, &url, &HashMap::new(), runtime)?;
                Ok(Self {
                    storage: Arc::clone(&remote) as _,
                    remote: Some(remote),
                })
            }
        }
    }
}

/// Where a cluster's tasks write a target's chunks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum StagedTarget {
    /// The temporary directory beside a local target, made by the session
    /// before any task runs (every worker must see the same path).
    Local {
        /// The directory.
        path: PathBuf,
    },
    /// An object-store prefix the session has claimed.
    Remote {
        /// The prefix's URL.
        url: String,
        /// The COPY's object-store options.
        storage: BTreeMap<String, String>,
    },
}

impl StagedTarget {
    /// The storage the tasks write into. A local directory must exist: the
    /// session made it, and it is gone only when the COPY failed or was
    /// cancelled (a task must not make it again).
    fn open(&self, runtime: &RuntimeEnv) -> Result<ReadableWritableListableStorage> {
        match self {
            Self::Local { path } => {
                if !path.is_dir() {
                    return exec_err!(
                        "the COPY's staging directory '{}' is gone (the COPY failed or was \
                         cancelled)",
                        path.display()
                    );
                }
                Ok(Arc::new(
                    FilesystemStore::new(path).map_err(|e| io_error(path, e))?,
                ))
            }
            Self::Remote { url, storage } => {
                let parsed = url::Url::parse(url)
                    .map_err(|e| DataFusionError::Plan(format!("target '{url}': {e}")))?;
                let options = storage.clone().into_iter().collect();
                Ok(open_writable_remote(url, &parsed, &options, runtime)?)
            }
        }
    }
}

impl StagedTarget {
    /// Whether the session still stages the target (opened as `out`): its
    /// temporary directory exists, or its claim on the prefix does. A
    /// task checks before it writes, so that a task still running when
    /// the COPY failed elsewhere (and the session erased what was written)
    /// writes nothing more.
    fn still_staged(&self, out: &ReadableWritableListableStorage) -> Result<(), String> {
        let staged = match self {
            Self::Local { path } => path.is_dir(),
            Self::Remote { .. } => {
                let claim = StoreKey::new(CLAIM_KEY).map_err(|e| e.to_string())?;
                out.get(&claim).map_err(|e| e.to_string())?.is_some()
            }
        };
        match staged {
            true => Ok(()),
            false => Err(format!(
                "the COPY's target '{self}' is no longer staged (the COPY failed or was cancelled)"
            )),
        }
    }
}

impl fmt::Display for StagedTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Local { path } => write!(f, "{}", path.display()),
            Self::Remote { url, .. } => write!(f, "{url}"),
        }
    }
}

/// A run of a round of a rechunk's tasks, writing intermediate arrays
/// into the scratch store and whole target chunks into a staged target:
/// the leaf of a cluster's rechunk stage. Its one partition yields one
/// row, `tasks`: how many of the round's tasks it ran.
#[derive(Debug)]
pub struct RechunkTasksExec {
    rechunk: Arc<RechunkTasks>,
    prepared: Arc<PreparedRechunk>,
    target: StagedTarget,
    /// The round: every array's stage of this number.
    round: usize,
    /// The distributed tasks the rechunk's tasks are dealt to.
    tasks: usize,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
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
        let schema = Arc::new(Schema::new(vec![Field::new(
            "tasks",
            DataType::UInt64,
            false,
        )]));
        Self {
            rechunk,
            prepared,
            target,
            round,
            tasks: 1,
            properties: Arc::new(PlanProperties::new(
                EquivalenceProperties::new(schema),
                Partitioning::UnknownPartitioning(1),
                EmissionType::Final,
                Boundedness::Bounded,
            )),
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }

    /// A copy dealing the rechunk's tasks to `tasks` distributed tasks.
    pub fn with_tasks(&self, tasks: usize) -> Self {
        Self {
            rechunk: Arc::clone(&self.rechunk),
            prepared: Arc::clone(&self.prepared),
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
        self.prepared.round_tasks(self.round)
    }

    /// Decoded bytes the round writes.
    pub fn bytes_written(&self) -> u64 {
        self.prepared.round_bytes_written(self.round)
    }

    /// The rechunk's tasks distributed task `task` (of [`tasks`](Self::tasks)) runs.
    fn run_of(&self, context: &Arc<TaskContext>) -> Result<Range<u64>> {
        let all = 0..self.rechunk_tasks();
        if self.tasks == 1 {
            return Ok(all);
        }
        let ctx = DistributedTaskContext::from_ctx(context);
        if ctx.task_count != self.tasks || ctx.task_index >= self.tasks {
            return exec_err!(
                "RechunkTasksExec of {} was planned for {} tasks, but runs as task {} of {}",
                self.prepared.source(),
                self.tasks,
                ctx.task_index,
                ctx.task_count
            );
        }
        Ok(share_of(all, ctx.task_index as u64, self.tasks as u64))
    }
}

impl DisplayAs for RechunkTasksExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "RechunkTasksExec: store={}, staged={}, round={}, projected_memory={}, rechunk_tasks={}, tasks={}",
            self.prepared.source(),
            self.target,
            self.round,
            human_readable_size(self.prepared.projected_memory() as usize),
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
        let prepared = Arc::clone(&self.prepared);
        let target = self.target.clone();
        let (round, work) = (self.round, self.rechunk.work.clone());
        let job = WriteJob {
            operator: "RechunkTasksExec",
            store: prepared.source(),
            projected: prepared.projected_memory() as usize,
            metrics: &self.metrics,
            properties: &self.properties,
        };
        let writer = Arc::clone(&prepared);
        job.run(partition, &context, move |cancelled| {
            let out = target.open(writer.runtime())?;
            let work = (work.as_deref())
                .map(|w| WorkStore::open(w, writer.runtime()))
                .transpose()?;
            let may_write = || target.still_staged(&out);
            let done =
                writer.copy_task_run(&out, work.as_ref(), (round, run), &may_write, cancelled)?;
            Ok(Written {
                rows: done.tasks,
                bytes_read: 0,
                bytes_written: done.bytes_written,
            })
        })
    }

    metered_plan_methods!(|_| Some(1));
}

//! `COPY` of a selection with computed variables on a cluster's workers.
//! Its two steps become rounds of tasks, as the whole-table COPY's
//! rechunk does ([`crate::array::rechunk::RechunkTasksExec`]):
//!
//! 1. *blockwise* ([`BlockwiseTasksExec`]): the workers evaluate the
//!    expressions chunk by chunk and write the chunks into the
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

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use datafusion::arrow::datatypes::DataType;
use datafusion::common::{exec_err, human_readable_size, plan_err, DataFusionError, Result};
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use serde::{Deserialize, Serialize};
use zarrs::storage::store::MemoryStore;
use zarrs::storage::ReadableWritableListableStorage;

use super::blockwise::{Blockwise, BlockwiseStep, Evaluate, SelectedGrid, Step};
use crate::array::rechunk::{ClusterRounds, PreparedRechunk, TargetEncoding};
use crate::array::tasks::run_cluster_tasks;
use crate::plan_methods::{metered_plan_methods, named_plan_methods, no_expressions_method};
use crate::table::{
    task_share, BlockGrid, BlockRead, BroadcastInputs, GridTable, Selection, TASKS_OF_STAGE,
};
use crate::write::options::ZarrWriteOptions;
use crate::write::scratch::ScratchStore;
use crate::write::store::{variable_array, GroupVariable};
use crate::write::target::StagedTarget;
use crate::write::write_job::{counted_properties, Joined, WriteJob, Written};
use crate::zarr::StoreLocation;
use serde_json::Map;

/// The most chunks a received blockwise step may make.
const MAX_CHUNKS: u64 = 1 << 40;

/// Step 1 of a COPY of a selection as it travels to the workers (beside
/// the read and the expressions, which the codec carries).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlockwiseTasks {
    /// The chunks one task makes, in positions of the selection.
    pub block: Vec<u64>,
    /// The chunk shape of the arrays written (`block` is whole chunks of
    /// it).
    pub chunks: Vec<u64>,
    /// The variables: name and type (`Float32` or `Float64`).
    pub variables: Vec<(String, String)>,
    /// Where the chunks go.
    pub into: ChunksInto,
    /// The arrays' format and compression.
    pub encoding: TargetEncoding,
    /// Tasks run at once by one distributed task.
    pub workers: usize,
}

/// Where step 1 writes its chunks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ChunksInto {
    /// The intermediate store the session made in `work_dir`.
    Scratch {
        /// Its location.
        location: String,
    },
    /// The staged target itself (the chunks are whole target chunks).
    Target {
        /// Where it is staged.
        staged: StagedTarget,
    },
}

impl fmt::Display for ChunksInto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Scratch { location } => write!(f, "{location}"),
            Self::Target { staged } => write!(f, "{staged}"),
        }
    }
}

impl BlockwiseTasks {
    /// The variables as a group writes them.
    fn group_variables(&self, shape: &[u64]) -> Result<Vec<GroupVariable>> {
        (self.variables.iter())
            .map(|(name, data_type)| {
                let data_type = match data_type.as_str() {
                    "Float32" => DataType::Float32,
                    "Float64" => DataType::Float64,
                    other => {
                        return plan_err!("a blockwise step writes '{name}' as {other}, not floats")
                    }
                };
                Ok(GroupVariable {
                    name: name.clone(),
                    data_type,
                    shape: shape.to_vec(),
                    chunks: self.chunks.clone(),
                    // The session writes the metadata.
                    attributes: Map::new(),
                })
            })
            .collect()
    }

    /// The write options of the arrays written.
    fn write_options(&self) -> ZarrWriteOptions {
        ZarrWriteOptions {
            codec: self.encoding.codec,
            zarr_format: self.encoding.zarr_format,
            ..ZarrWriteOptions::default()
        }
    }
}

/// A run of the chunks of step 1 of a COPY of a selection: the leaf of a
/// cluster's blockwise stage (or, when its variables read tables joined
/// in, the node over their broadcasts). Its one partition yields one row,
/// `tasks`: how many chunks it made.
pub struct BlockwiseTasksExec {
    blocks: Arc<BlockwiseStep>,
    sent: Arc<BlockwiseTasks>,
    /// The distributed tasks the chunks are dealt to ([`TASKS_OF_STAGE`]:
    /// as many as its stage runs).
    tasks: usize,
    /// The tables joined in that its variables read (its children),
    /// computed first and held while it writes.
    broadcasts: BroadcastInputs,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl fmt::Debug for BlockwiseTasksExec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockwiseTasksExec")
            .field("store", &self.blocks.table.store)
            .field("into", &self.sent.into)
            .finish()
    }
}

impl BlockwiseTasksExec {
    fn new(
        blocks: Arc<BlockwiseStep>,
        sent: Arc<BlockwiseTasks>,
        broadcasts: BroadcastInputs,
    ) -> Self {
        Self {
            blocks,
            sent,
            tasks: 1,
            broadcasts,
            properties: counted_properties("tasks"),
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }

    /// Step 1 as a worker receives it: what `selection` keeps of `table`
    /// (opened again under the worker's policy) in the chunks `sent`,
    /// made by `step` (given the selected grid, the chunks' shape, the
    /// variables' types and the threads it may use, at most `threads`),
    /// reading the tables joined in of `broadcasts`; refused when the
    /// chunks do not fit the selection or the arrays written are not whole
    /// chunks of them (and by `step` when its tasks cannot fit the worker's
    /// `allowed_mem` beside the broadcasts).
    pub(crate) fn received(
        (table, selection): (Arc<GridTable>, Selection),
        (sent, broadcasts): (BlockwiseTasks, BroadcastInputs),
        threads: usize,
        step: impl FnOnce(&SelectedGrid<'_>, &[u64], &[DataType], usize) -> Result<Step>,
    ) -> Result<Self> {
        let store = table.store.clone();
        let shape: Vec<u64> = (0..table.dims.len())
            .map(|d| selection.ranges(d).iter().map(|r| r.end - r.start).sum())
            .collect();
        let n = shape.len();
        if sent.block.len() != n || sent.chunks.len() != n {
            return plan_err!(
                "a blockwise step over {store} sends chunks {:?} and {:?} for {n} dimensions",
                sent.block,
                sent.chunks
            );
        }
        for d in 0..n {
            let (b, c, len) = (sent.block[d], sent.chunks[d], shape[d]);
            if b == 0 || c == 0 || len == 0 || b > len || (b < len && b % c != 0) {
                return plan_err!(
                    "a blockwise step over {store} makes chunks {:?} of arrays in chunks {:?} \
                     of a selection of shape {shape:?}",
                    sent.block,
                    sent.chunks
                );
            }
        }
        let chunks = shape
            .iter()
            .zip(&sent.block)
            .fold(1u64, |n, (len, b)| n.saturating_mul(len.div_ceil(*b)));
        if chunks > MAX_CHUNKS {
            return plan_err!("a blockwise step over {store} makes {chunks} chunks");
        }
        let variables = sent.group_variables(&shape)?;
        let types: Vec<DataType> = variables.iter().map(|v| v.data_type.clone()).collect();
        let grid = SelectedGrid {
            table: &table,
            selection: &selection,
            shape: &shape,
            io_concurrency: 0,
        };
        let threads = sent.workers.clamp(1, threads.max(1));
        let step = step(&grid, &sent.block, &types, threads)?;
        if step.exprs().len() != types.len() {
            return plan_err!(
                "a blockwise step over {store} writes {} variables with {} expressions",
                types.len(),
                step.exprs().len()
            );
        }
        let blocks = BlockwiseStep {
            table,
            selection,
            shape,
            block: sent.block.clone(),
            // The session writes the metadata, attributes included.
            attributes: variables.iter().map(|v| v.attributes.clone()).collect(),
            names: variables.into_iter().map(|v| v.name).collect(),
            types,
            step,
        };
        Ok(Self::new(Arc::new(blocks), Arc::new(sent), broadcasts))
    }

    /// A copy dealing the chunks to `tasks` distributed tasks.
    pub fn with_tasks(&self, tasks: usize) -> Self {
        Self {
            tasks: tasks.max(1),
            ..self.rejoined(self.broadcasts.clone())
        }
    }

    /// A copy dealing the chunks to the tasks of its cluster's stage,
    /// however many the stage has (a step whose small sides are its
    /// inputs is not its stage's leaf, so the stage does not say).
    pub fn with_tasks_of_stage(&self) -> Self {
        Self {
            tasks: TASKS_OF_STAGE,
            ..self.rejoined(self.broadcasts.clone())
        }
    }

    /// A copy of this step joining `broadcasts` in (its children
    /// replaced).
    fn rejoined(&self, broadcasts: BroadcastInputs) -> Self {
        Self {
            tasks: self.tasks,
            ..Self::new(Arc::clone(&self.blocks), Arc::clone(&self.sent), broadcasts)
        }
    }

    /// The distributed tasks the chunks are dealt to.
    pub fn tasks(&self) -> usize {
        self.tasks
    }

    /// The step as it travels (beside its read and expressions).
    pub fn sent(&self) -> &BlockwiseTasks {
        &self.sent
    }

    /// The step's chunks and how they are made, for the codec.
    pub(crate) fn blocks(&self) -> &BlockwiseStep {
        &self.blocks
    }

    /// The read of a step by expressions, for the codec: the table, its
    /// columns read and the selection.
    pub(crate) fn evaluate_read(&self, evaluate: &Evaluate) -> Result<BlockRead> {
        let blocks = &self.blocks;
        let grid = BlockGrid::with_block_shape(
            &blocks.table.shape(),
            blocks.block.clone(),
            &blocks.selection,
        )
        .map_err(|e| DataFusionError::Plan(e.to_string()))?;
        BlockRead::new(
            Arc::clone(&blocks.table),
            evaluate.columns.clone(),
            blocks.selection.clone(),
            grid,
        )
    }

    /// The chunks made.
    pub fn chunk_tasks(&self) -> u64 {
        self.blocks.tasks()
    }

    /// Decoded bytes written.
    pub fn bytes_written(&self) -> u64 {
        let cells = (self.blocks.shape.iter()).fold(1u64, |n, &len| n.saturating_mul(len));
        cells.saturating_mul(self.blocks.cell_bytes())
    }
}

impl DisplayAs for BlockwiseTasksExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let dims = self.blocks.table.dim_names();
        write!(
            f,
            "BlockwiseTasksExec: store={}, into={}, chunks {:?} ({} tasks){}, projected_memory={}, tasks={}",
            self.blocks.table.store,
            self.sent.into,
            self.blocks.block,
            self.blocks.tasks(),
            self.broadcasts.display(&dims),
            human_readable_size(self.blocks.memory() as usize),
            match self.tasks {
                TASKS_OF_STAGE => "its stage's".to_string(),
                n => n.to_string(),
            }
        )
    }
}

impl ExecutionPlan for BlockwiseTasksExec {
    named_plan_methods!("BlockwiseTasksExec");

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        self.broadcasts.children()
    }

    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        vec![false; self.broadcasts.children().len()]
    }

    no_expressions_method!();

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if children.is_empty() && self.broadcasts.is_empty() {
            return Ok(self);
        }
        Ok(Arc::new(
            self.rejoined(self.broadcasts.with_children(children)?),
        ))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let all = self.blocks.tasks();
        let store = &self.blocks.table.store;
        let run = task_share("BlockwiseTasksExec", store, self.tasks, 0..all, &context)?;
        let (blocks, sent) = (Arc::clone(&self.blocks), Arc::clone(&self.sent));
        let runtime = context.runtime_env();
        let write = move |cancelled: &AtomicBool| {
            let dims: Vec<String> = blocks.table.dims.iter().map(|d| d.name.clone()).collect();
            let options = sent.write_options();
            let arrays_in = |storage: &ReadableWritableListableStorage| {
                (sent.group_variables(&blocks.shape)?.iter())
                    .map(|v| variable_array(storage, v, &dims, &options))
                    .collect::<Result<Vec<_>>>()
            };
            match &sent.into {
                ChunksInto::Scratch { location } => {
                    let scratch = ScratchStore::open(location, &runtime)?;
                    let arrays = arrays_in(scratch.storage())?;
                    let may_write = || scratch.still_there().map_err(|e| e.to_string());
                    blocks.write_step(&arrays, run.clone(), &may_write, cancelled)?;
                }
                ChunksInto::Target { staged } => {
                    let out = staged.open(&runtime)?;
                    let arrays = arrays_in(&out)?;
                    let may_write = || staged.still_staged(&out);
                    blocks.write_step(&arrays, run.clone(), &may_write, cancelled)?;
                }
            }
            let cells = run.clone().map(|t| blocks.chunk_cells(t)).sum::<u64>();
            Ok(Written {
                rows: run.end - run.start,
                bytes_read: 0,
                bytes_written: cells.saturating_mul(blocks.cell_bytes()),
            })
        };
        let job = WriteJob {
            operator: "BlockwiseTasksExec",
            store: &self.blocks.table.store,
            projected: self.blocks.memory() as usize,
            metrics: &self.metrics,
            properties: &self.properties,
        };
        match self.broadcasts.is_empty() {
            true => job.run(partition, &context, write),
            false => {
                // The small sides' rows are broadcast over the network.
                let joined = (self.broadcasts.clone(), Joined::Received);
                job.run_holding(joined, partition, context, write)
            }
        }
    }

    metered_plan_methods!(|_| Some(1));
}

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
        let exec = BlockwiseTasksExec::new(blocks, Arc::new(sent), broadcasts);
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
        Ok(copy.written(step2))
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
        let chunks: Vec<(String, u64)> = (copy.blocks.table.dims.iter())
            .zip(&copy.target_chunks)
            .map(|(d, &c)| (d.name.clone(), c))
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

//! The blockwise primitive's tasks on a cluster: a run of a
//! [`BlockwiseStep`]'s chunks as the leaf of a stage ([`BlockwiseTasksExec`]),
//! dealt to the stage's tasks in contiguous runs, writing into the
//! intermediate store the session made in `work_dir`, into the staged
//! target, or into a kernel's own intermediates ([`ChunksInto`]). Every
//! operator whose work is a blockwise step (a COPY of a selection or of
//! rolling windows, a COPY of a transform, a staged transform's first
//! stage, a four-step transform's passes) runs on the workers through this one
//! node, which the codec carries as the step's chunks and target
//! ([`BlockwiseTasks`]) beside its kernel.

use std::fmt;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use datafusion::arrow::datatypes::DataType;
use datafusion::common::{exec_err, human_readable_size, plan_err, DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use serde::{Deserialize, Serialize};
use serde_json::Map;
use zarrs::array::{Array as ZarrsArray, ArrayMetadataOptions};
use zarrs::storage::{ReadableWritableListableStorage, ReadableWritableListableStorageTraits};

use super::step::{BlockwiseStep, Evaluate, SelectedGrid, Step, StepGrid};
use crate::array::rechunk::TargetEncoding;
use crate::plan_methods::{metered_plan_methods, named_plan_methods, no_expressions_method};
use crate::table::{
    task_share, BlockGrid, BlockRead, BroadcastInputs, GridTable, Selection, TASKS_OF_STAGE,
};
use crate::write::options::ZarrWriteOptions;
use crate::write::scratch::ScratchStore;
use crate::write::store::{variable_array, GroupVariable};
use crate::write::target::StagedTarget;
use crate::write::write_job::{counted_properties, Joined, WriteJob, Written};

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
    /// The kernel's own intermediate arrays (a four-step transform's
    /// passes), in the scratch store the session made in `work_dir`: the
    /// kernel opens them and checks the store is still there before each
    /// block it writes.
    Intermediates {
        /// The scratch store's location.
        location: String,
    },
}

impl fmt::Display for ChunksInto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Scratch { location } | Self::Intermediates { location } => {
                write!(f, "{location}")
            }
            Self::Target { staged } => write!(f, "{staged}"),
        }
    }
}

impl BlockwiseTasks {
    /// The variables as a group writes them.
    fn group_variables(&self, shape: &[u64]) -> Result<Vec<GroupVariable>> {
        (self.variables.iter())
            .map(|(name, data_type)| {
                // Float expressions of a selection, a window's aggregates
                // (`count` gives Int64).
                let data_type = match data_type.as_str() {
                    "Float32" => DataType::Float32,
                    "Float64" => DataType::Float64,
                    "Int64" => DataType::Int64,
                    other => {
                        return plan_err!(
                            "a blockwise step writes '{name}' as {other}, not floats or Int64"
                        )
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

/// A run of the chunks of a blockwise step (step 1 of a COPY of a
/// selection or of rolling windows, the blocks of a COPY of a transform,
/// a staged transform's first stage): the leaf of a cluster's blockwise
/// stage (or, when its variables read tables joined in, the node over
/// their broadcasts). Its one partition yields one row, `tasks`: how many
/// chunks it made.
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
            .field("store", &self.blocks.store())
            .field("into", &self.sent.into)
            .finish()
    }
}

impl BlockwiseTasksExec {
    /// The tasks of `blocks` writing where `sent` says, holding the tables
    /// joined in of `broadcasts`, reporting to `metrics` (which a kernel's
    /// clock may report to as well).
    pub(crate) fn new(
        blocks: Arc<BlockwiseStep>,
        sent: Arc<BlockwiseTasks>,
        broadcasts: BroadcastInputs,
        metrics: ExecutionPlanMetricsSet,
    ) -> Self {
        Self {
            blocks,
            sent,
            tasks: 1,
            broadcasts,
            properties: counted_properties("tasks"),
            metrics,
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
            grid: StepGrid::Selected { table, selection },
            shape,
            block: sent.block.clone(),
            // The session writes the metadata, attributes included.
            attributes: variables.iter().map(|v| v.attributes.clone()).collect(),
            names: variables.into_iter().map(|v| v.name).collect(),
            types,
            step,
        };
        let metrics = ExecutionPlanMetricsSet::new();
        Ok(Self::new(
            Arc::new(blocks),
            Arc::new(sent),
            broadcasts,
            metrics,
        ))
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
    /// replaced), reporting to the same metrics.
    fn rejoined(&self, broadcasts: BroadcastInputs) -> Self {
        Self {
            tasks: self.tasks,
            ..Self::new(
                Arc::clone(&self.blocks),
                Arc::clone(&self.sent),
                broadcasts,
                self.metrics.clone(),
            )
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
        let (table, selection) = self.blocks.selected()?;
        let grid =
            BlockGrid::with_block_shape(&table.shape(), self.blocks.block.clone(), selection)
                .map_err(|e| DataFusionError::Plan(e.to_string()))?;
        BlockRead::new(
            Arc::clone(table),
            evaluate.columns.clone(),
            selection.clone(),
            grid,
        )
    }

    /// The chunks (or blocks) made.
    pub fn chunk_tasks(&self) -> u64 {
        self.blocks.tasks()
    }

    /// The decoded bytes a cluster sizes its tasks by: those written (a
    /// transform's: those its blocks read).
    pub fn task_bytes(&self) -> u64 {
        self.blocks.task_bytes()
    }
}

impl DisplayAs for BlockwiseTasksExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let dims = self.blocks.dim_names();
        let kernel = match &self.blocks.step {
            Step::Writers(writers) => format!(", {writers}"),
            Step::Evaluate(_) => String::new(),
        };
        write!(
            f,
            "BlockwiseTasksExec: store={}, into={}, chunks {:?} ({} tasks){kernel}{}, projected_memory={}, tasks={}",
            self.blocks.store(),
            self.sent.into,
            self.blocks.block,
            self.blocks.tasks(),
            self.broadcasts.display(&dims.iter().map(String::as_str).collect::<Vec<_>>()),
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
        let store = self.blocks.store();
        let run = task_share("BlockwiseTasksExec", store, self.tasks, 0..all, &context)?;
        let (blocks, sent) = (Arc::clone(&self.blocks), Arc::clone(&self.sent));
        let runtime = context.runtime_env();
        let write = move |cancelled: &AtomicBool| {
            let dims = blocks.dim_names();
            let options = sent.write_options();
            let arrays_in = |storage: &ReadableWritableListableStorage| {
                (blocks.variables(&sent.chunks).iter())
                    .map(|v| variable_array(storage, v, &dims, &options))
                    .collect::<Result<Vec<_>>>()
            };
            let bytes = match &sent.into {
                ChunksInto::Scratch { location } => {
                    let scratch = ScratchStore::open(location, &runtime)?;
                    let arrays = arrays_in(scratch.storage())?;
                    let may_write = || scratch.still_there().map_err(|e| e.to_string());
                    blocks.write_step(&arrays, run.clone(), &may_write, cancelled)?
                }
                ChunksInto::Target { staged } => {
                    let out = staged.open(&runtime)?;
                    let arrays = arrays_in(&out)?;
                    if let StagedTarget::Scratch { .. } = staged {
                        // The session stored their metadata first.
                        for array in &arrays {
                            check_stored(&out, array, staged)?;
                        }
                    }
                    let may_write = || staged.still_staged(&out);
                    blocks.write_step(&arrays, run.clone(), &may_write, cancelled)?
                }
                ChunksInto::Intermediates { .. } => {
                    blocks.write_step(&[], run.clone(), &|| Ok(()), cancelled)?
                }
            };
            Ok(Written {
                rows: run.end - run.start,
                bytes_read: bytes.read,
                bytes_written: bytes.written,
            })
        };
        let job = WriteJob {
            operator: "BlockwiseTasksExec",
            store: self.blocks.store(),
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

/// Refuses to write `array` into the store `into` (one the session made
/// with the arrays' metadata, a staged transform's) unless the store holds
/// the array as the tasks write it.
fn check_stored(
    out: &ReadableWritableListableStorage,
    array: &ZarrsArray<dyn ReadableWritableListableStorageTraits>,
    into: &StagedTarget,
) -> Result<()> {
    let path = array.path().as_str();
    let stored = ZarrsArray::open(Arc::clone(out), path).map_err(|e| {
        DataFusionError::Execution(format!("the store '{into}', array {path}: {e}"))
    })?;
    // As both would store it (zarrs' own attribute, canonical names).
    let options = ArrayMetadataOptions::default();
    if stored.metadata_opt(&options) != array.metadata_opt(&options) {
        return exec_err!(
            "the store '{into}' holds the array {path} otherwise than its tasks write it \
             (its metadata differ)"
        );
    }
    Ok(())
}

//! `DenseReductionExec`: the operator of a [`DenseReduction`].
//!
//! Workers (one per core, on the blocking pool) take chunk-aligned blocks
//! of the selection from a shared counter, decode only the columns the
//! expressions read, evaluate the expressions on runs of rows and fold them
//! straight into dense per-group state: the elementwise work and the first
//! level of the reduction happen in one pass, and no row is ever built
//! into a record batch downstream. The workers' partial states are then
//! merged pairwise, in a tree, and the result is one row per group, in C
//! order of the grouped dimensions.
//!
//! [`DenseReduction`]: super::DenseReduction

use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, BooleanArray, RecordBatch, RecordBatchOptions, UInt64Array,
};
use datafusion::arrow::compute::SortOptions;
use datafusion::arrow::compute::{filter_record_batch, prep_null_mask_filter, take};
use datafusion::arrow::datatypes::{DataType, SchemaRef};
use datafusion::catalog::Session;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{human_readable_size, DataFusionError, Result};
use datafusion::execution::memory_pool::MemoryReservation;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::physical_planning_context::PhysicalPlanningContext;
use datafusion::logical_expr::ColumnarValue;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr, PhysicalSortExpr};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::metrics::{Count, ExecutionPlanMetricsSet, MetricBuilder, Time};
use datafusion::physical_plan::projection::{
    try_embed_projection, EmbeddedProjection, ProjectionExec,
};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties,
};
use datafusion::physical_planner::PhysicalPlanner;
use futures::{Future, StreamExt, TryFutureExt, TryStreamExt};

use super::accumulators::{DenseAccumulator, ReduceOp, RowCounts};
use super::groups::{GroupSpace, Line};
use super::keys::{key_schema, physical_key, DimKeys, KeySpec, KEYED_POSITION_BYTES};
use super::node::DenseReduction;
use super::rule::MAX_STATE_BYTES;
use crate::array::elementwise::FusedExpr;
use crate::array::tasks::{run_tasks, run_tasks_keeping_states};
use crate::config::ZarrConfig;
use crate::memory::{Projection, Reservation};
use crate::plan_methods::{broadcast_children_methods, metered_plan_methods};
use crate::progress::ScanProgress;
use crate::table::{
    batch_rows, boxes_in_block, task_share, BlockGrid, BlockRead, BlockTemporaries, BoxCells,
    BroadcastInputs, GridTable, ReadAheadPlan, ReadsBroadcasts, RunStreamBuilder, TableReadAhead,
    RUN_BATCHES, TASKS_OF_STAGE,
};
use crate::write::rows::{RowBand, RowGrid};
use crate::zarr::ChunkBufferPool;

/// Rows evaluated and folded at a time.
const RUN_ROWS: u64 = 1 << 16;

/// The fewest rows a run is cut down to under a tight memory limit: a
/// tile's runs are never shorter (see `GroupSpace::tiles`), so no run is
/// longer than projected.
const MIN_RUN_ROWS: u64 = super::groups::MIN_TILE_RUN;

/// A worker's buffers for a run of rows (at most a block's, at most
/// `run_rows`) with `aggregates` aggregates over `columns` columns: a
/// value per row for each, and two more.
fn run_temporaries(aggregates: usize, columns: usize, run_rows: u64) -> BlockTemporaries {
    BlockTemporaries {
        per_cell: 8 * (aggregates + columns + 2) as u64,
        cells: run_rows,
    }
}

/// State and output a band of a reduction in bands holds (see [`Bands`]),
/// all its workers together: a fraction of the limit, leaving the rest to
/// what consumes its rows.
const BAND_BYTES: usize = 256 << 20;

/// Chunks of the cut dimension a band of a reduction in bands spans at
/// least, where it fits: a chunk a band boundary cuts is decoded twice.
const BAND_CHUNKS: u64 = 4;

/// Bytes of variables in one part of a box, when parts are read one by one
/// from chunk files: a part is folded while its read left it in cache.
const PART_BYTES: u64 = 4 << 20;

/// A part's contiguous runs in its chunk files are at least this long.
const MIN_PART_RUN_BYTES: u64 = 64 << 10;

/// One aggregate, planned.
#[derive(Debug, Clone)]
struct PhysicalReduce {
    op: ReduceOp,
    /// How it is shown (`avg(t2m)`).
    label: String,
    arg: Option<Arc<dyn PhysicalExpr>>,
    /// The argument as a fused expression, when it is `float64` arithmetic.
    fused: Option<FusedExpr>,
    arg_type: DataType,
    output_type: DataType,
}

/// Everything a worker needs, shared by all of them.
#[derive(Debug, Clone)]
pub(super) struct Reduction {
    /// The columns the expressions read, the cells and their blocks.
    read: BlockRead,
    space: GroupSpace,
    /// What is grouped by, in the order of the output columns.
    keys: Vec<KeySpec>,
    /// The grouped dimensions, in table order.
    dims: Vec<usize>,
    /// Per table dimension grouped by functions of its coordinate: the
    /// value of each function (in the order of `keys`) for each key.
    key_values: Vec<Option<Vec<ArrayRef>>>,
    /// Bytes the keys' maps and values hold.
    key_bytes: usize,
    aggregates: Vec<PhysicalReduce>,
    predicate: Option<Arc<dyn PhysicalExpr>>,
    /// The most rows evaluated and folded at a time ([`RUN_ROWS`], fewer
    /// under a tight memory limit).
    run_rows: u64,
    /// When its group state is too large to hold at once: the bands it
    /// runs in.
    bands: Option<Bands>,
    /// The result columns it gives, as indices into its keys then its
    /// aggregates, when a projection above it takes only some (see
    /// [`DenseReductionExec::projected`]): a key column not taken is
    /// never built. `None`: all of them.
    columns: Option<Vec<usize>>,
}

/// A dense reduction whose group state is too large to hold at once
/// (more than `zarrfusion.dense_state_bytes` for one worker, or more than fits
/// `allowed_mem`), run in bands: ranges of the keys of a grouped dimension
/// (the first in table order that can be cut), each folded from the cells
/// whose positions have those keys, finished and emitted before the next
/// is started. Its workers hold the state of one band's groups, its output
/// one band's rows. The keys must run along the positions (a dimension
/// grouped by its positions, or by `date_trunc` of an ordered time): each
/// band then reads one run of the dimension's positions. Cutting the first
/// grouped dimension, the bands' rows, one after the other, are the result
/// in its order; cutting another (`GROUP BY extract(month FROM time), lat,
/// lon` in bands of latitudes), each band's rows are in the order of its
/// own groups, and the result declares no order.
///
/// On a cluster the bands are dealt to the tasks of its stage in
/// contiguous runs (`Emit::Bands`): each task finishes the groups of its
/// own bands, so rows, not states, cross the network. The cut travels as
/// this plain data and a worker runs it as given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bands {
    /// The table dimension cut.
    pub dim: usize,
    /// Its keys per band.
    pub keys: usize,
    /// Whether its keys run backward along its positions.
    pub descending: bool,
    /// The workers the bands were sized for (each holding a band's
    /// state): the most that fold a band at once.
    pub workers: usize,
    /// Bands folded at once, each by its own workers (one where bands of
    /// a chunk or more leave only one worker a band): the next band is
    /// started when the band `at_once` before it is sent, so the rows stay
    /// in order and at most `at_once` bands' state and rows are held.
    pub at_once: usize,
}

/// What a dense reduction gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Emit {
    /// One row per group: the aggregates' results.
    Results,
    /// On a cluster: the partial states of one task's run of the blocks,
    /// the blocks dealt to `tasks` tasks (see `partial`;
    /// [`TASKS_OF_STAGE`]: as many as its stage runs), each group's row
    /// led by its group's coordinates, or when `positioned` by its
    /// position in the group space (see `merge`).
    States { tasks: usize, positioned: bool },
    /// On a cluster, a reduction in bands: the results of the bands dealt
    /// to `tasks` tasks in contiguous runs ([`TASKS_OF_STAGE`]: as many
    /// as its stage runs), each band's groups finished by its task.
    Bands { tasks: usize },
}

/// One aggregate of a dense reduction, as it crosses the network: what it
/// computes, its argument over the columns read and its result's type.
#[derive(Debug, Clone)]
pub struct ReduceSpec {
    /// What it computes.
    pub op: ReduceOp,
    /// Its argument (`None`: `count(*)`).
    pub arg: Option<Arc<dyn PhysicalExpr>>,
    /// The type of its result.
    pub output: DataType,
    /// How it is shown (`avg(t2m)`).
    pub label: String,
}

/// A dense reduction's parts, as a worker receives them: it plans them
/// with [`DenseReductionExec::of_task`].
#[derive(Debug)]
pub struct ReductionParts {
    /// The columns the expressions read, the cells reduced and their
    /// blocks.
    pub read: BlockRead,
    /// What is grouped by, in the order of the output columns.
    pub groups: Vec<KeySpec>,
    /// The aggregates.
    pub aggregates: Vec<ReduceSpec>,
    /// A row filter, if any.
    pub predicate: Option<Arc<dyn PhysicalExpr>>,
    /// The schema of the states (group columns, or when `positioned` the
    /// group's position, then each aggregate's state columns).
    pub schema: SchemaRef,
    /// Whether each group's row is led by its position in the group space
    /// instead of its coordinates (the states a [`DenseMergeExec`] merges).
    ///
    /// [`DenseMergeExec`]: super::DenseMergeExec
    pub positioned: bool,
    /// Tasks the blocks are dealt to ([`TASKS_OF_STAGE`]: as many as its
    /// stage runs).
    pub tasks: usize,
    /// Chunk requests in flight at once (remote stores).
    pub io_concurrency: usize,
    /// The bands of a reduction in bands (see [`Bands`]): the bands, not
    /// the blocks, are dealt to the tasks, and each gives its bands'
    /// results (`schema` is the results', `positioned` false).
    pub bands: Option<Bands>,
    /// In bands, the result columns its bands give (indices into `groups`
    /// then `aggregates`) where a projection took only some; `None`: all.
    pub columns: Option<Vec<usize>>,
}

/// The physical dense reduction.
#[derive(Debug)]
pub struct DenseReductionExec {
    reduction: Arc<Reduction>,
    emit: Emit,
    workers: usize,
    io_concurrency: usize,
    /// Reads ahead of the workers (remote stores), one window for all.
    read_ahead: ReadAheadPlan,
    /// The small sides of the broadcast columns read: the children.
    broadcasts: BroadcastInputs,
    /// The memory limit (allowed_mem) it was planned under, if any.
    memory_limit: Option<usize>,
    schema: SchemaRef,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl DenseReductionExec {
    /// Plans `node`: its selection, blocks, expressions and memory.
    ///
    /// Refuses (before anything runs) a reduction whose projected memory
    /// exceeds the session's memory limit.
    pub fn plan(
        node: &DenseReduction,
        planner: &dyn PhysicalPlanner,
        session: &dyn Session,
        planning: &PhysicalPlanningContext,
    ) -> Result<Self> {
        let table = &node.read.table;

        // The columns the expressions read, in the input schema's order.
        let (input_df, columns) = node.read.columns_read(node.exprs())?;
        let temporaries = run_temporaries(node.aggregates.len(), columns.len(), RUN_ROWS);
        let (read, memory_limit, parallelism) =
            node.read.block_read(columns, session, temporaries)?;
        let input_schema = Arc::clone(&read.schema);
        let physical = |e: &datafusion::logical_expr::Expr| {
            planner.create_physical_expr(e, &input_df, session, planning)
        };

        let n_groups = node.groups.len();
        let props = session.execution_props();
        let keys = node
            .groups
            .iter()
            .map(|g| {
                let expr = g.expr.as_ref();
                Ok(KeySpec {
                    dim: g.dim,
                    expr: expr
                        .map(|e| physical_key(e, &table.dims[g.dim], props))
                        .transpose()?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut aggregates = Vec::with_capacity(node.aggregates.len());
        for (i, a) in node.aggregates.iter().enumerate() {
            let arg = a.arg.as_ref().map(physical).transpose()?;
            let arg_type = match &arg {
                Some(e) => e.data_type(&input_schema)?,
                None => DataType::Null,
            };
            // Only accumulators folding in f64 take fused arguments; count
            // needs no values at all where there are no NULLs.
            let fused = match (&arg, a.op) {
                (Some(arg), op) if op != ReduceOp::Count => FusedExpr::compile(arg, &input_schema),
                _ => None,
            };
            aggregates.push(PhysicalReduce {
                op: a.op,
                label: a.to_string(),
                arg,
                fused,
                arg_type,
                output_type: node.schema.field(n_groups + i).data_type().clone(),
            });
        }
        let predicate = node.predicate.as_ref().map(physical).transpose()?;

        let options = session.config().options();
        let mut reduction = Reduction::new(read, keys, aggregates, predicate)?;
        let bound = ZarrConfig::of(options).dense_state_bytes;
        let parallelism = reduction.fit(parallelism, memory_limit, Some(bound));
        let schema: SchemaRef = Arc::new(node.schema.as_arrow().clone());
        Self::assemble(
            Arc::new(reduction),
            Emit::Results,
            schema,
            ZarrConfig::of(options).io_concurrency,
            parallelism,
            memory_limit,
        )
    }

    /// The reduction of `parts` a worker runs on a cluster: its task's
    /// partial states (or with bands, its bands' results), with at most
    /// `parallelism` threads, refused (before anything runs) if it cannot
    /// fit `memory_limit`.
    pub fn of_task(
        parts: ReductionParts,
        parallelism: usize,
        memory_limit: Option<usize>,
    ) -> Result<Self> {
        let input_schema = Arc::clone(&parts.read.schema);
        let mut aggregates = Vec::with_capacity(parts.aggregates.len());
        for a in parts.aggregates {
            let arg_type = match &a.arg {
                Some(e) => e.data_type(&input_schema)?,
                None => DataType::Null,
            };
            let fused = match &a.arg {
                Some(arg) if a.op != ReduceOp::Count => FusedExpr::compile(arg, &input_schema),
                _ => None,
            };
            if a.op.accumulator(&arg_type, &a.output, 0).is_none() {
                return datafusion::common::plan_err!(
                    "a dense reduction over {} cannot compute {} of {arg_type} as {}",
                    parts.read.table.store,
                    a.op.name(),
                    a.output
                );
            }
            aggregates.push(PhysicalReduce {
                op: a.op,
                label: a.label,
                arg: a.arg,
                fused,
                arg_type,
                output_type: a.output,
            });
        }
        let mut reduction = Reduction::new(parts.read, parts.groups, aggregates, parts.predicate)?;
        let emit = match parts.bands {
            Some(bands) => {
                if let Some(columns) = parts.columns {
                    reduction.give_only(columns)?;
                }
                reduction.cut_into(bands, &parts.schema, parts.positioned)?;
                Emit::Bands { tasks: parts.tasks }
            }
            None if parts.columns.is_some() => {
                return datafusion::common::plan_err!(
                    "the partial states of a dense reduction over {} are given whole, not some \
                     of its columns",
                    reduction.read.table.store
                );
            }
            None => {
                reduction.check_states(&parts.schema, parts.positioned)?;
                Emit::States {
                    tasks: parts.tasks,
                    positioned: parts.positioned,
                }
            }
        };
        // A task's states are of every group (merged by position); its
        // bands are the session's, as sent.
        let parallelism = reduction.fit(parallelism, memory_limit, None);
        Self::assemble(
            Arc::new(reduction),
            emit,
            parts.schema,
            parts.io_concurrency,
            parallelism.max(1),
            memory_limit,
        )
    }

    /// The operator over `reduction` giving `emit` as `schema`, with at
    /// most `parallelism` workers, refused if it cannot fit
    /// `memory_limit`.
    fn assemble(
        reduction: Arc<Reduction>,
        emit: Emit,
        schema: SchemaRef,
        io_concurrency: usize,
        parallelism: usize,
        memory_limit: Option<usize>,
    ) -> Result<Self> {
        let workers = (reduction.read.blocks.num_blocks() as usize).clamp(1, parallelism);
        let read_ahead = ReadAheadPlan::new(
            &reduction.read.table,
            &reduction.read.columns,
            io_concurrency,
            reduction.read.blocks.block_shape(),
            workers,
        );
        let ordering = match emit {
            // A task's bands are a run of the session's: in its order.
            Emit::Results | Emit::Bands { .. } => reduction.ordering(&schema),
            // States are shuffled by their groups' hash on a cluster.
            Emit::States { .. } => Vec::new(),
        };
        let properties = Arc::new(PlanProperties::new(
            EquivalenceProperties::new_with_orderings(Arc::clone(&schema), [ordering]),
            Partitioning::UnknownPartitioning(1),
            EmissionType::Final,
            Boundedness::Bounded,
        ));
        let mut exec = Self {
            reduction,
            emit,
            workers,
            io_concurrency,
            read_ahead,
            broadcasts: BroadcastInputs::default(),
            memory_limit,
            schema,
            properties,
            metrics: ExecutionPlanMetricsSet::new(),
        };
        if let Some(limit) = memory_limit {
            let room = limit.saturating_sub(exec.projected_memory() - exec.read_ahead.memory());
            exec.read_ahead = exec.read_ahead.within(room);
            exec.check_memory(limit)?;
        }
        Ok(exec)
    }

    /// A copy of this reduction joining `broadcasts` in (its children
    /// replaced).
    fn rejoined(&self, broadcasts: BroadcastInputs) -> Self {
        Self {
            reduction: Arc::clone(&self.reduction),
            emit: self.emit,
            workers: self.workers,
            io_concurrency: self.io_concurrency,
            read_ahead: self.read_ahead,
            broadcasts,
            memory_limit: self.memory_limit,
            schema: Arc::clone(&self.schema),
            properties: Arc::clone(&self.properties),
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }

    /// This reduction giving the partial states of its tasks' runs of the
    /// blocks as `schema` (see `partial`), each led by its group's
    /// position when `positioned`.
    pub(super) fn with_states(
        &self,
        schema: SchemaRef,
        tasks: usize,
        positioned: bool,
    ) -> Result<Self> {
        self.dealt(schema, tasks.max(1), positioned)
    }

    /// This reduction giving the partial states of its blocks dealt to
    /// the tasks of the cluster's stage it runs in, however many the
    /// distributed planner gives it (a reduction with a table joined in
    /// is not its stage's leaf: the planner counts its tasks without
    /// telling it).
    pub fn with_tasks_of_stage(&self) -> Result<Self> {
        self.dealt(Arc::clone(&self.schema), TASKS_OF_STAGE, self.positioned())
    }

    /// This reduction on `tasks` tasks: its blocks dealt to them, each
    /// giving partial states as `schema` (led by positions when
    /// `positioned`); or in bands, its bands dealt to them, each giving
    /// its bands' results (`schema` and `positioned` are then its own).
    fn dealt(&self, schema: SchemaRef, tasks: usize, positioned: bool) -> Result<Self> {
        let (emit, schema) = match self.in_bands() {
            true => (Emit::Bands { tasks }, Arc::clone(&self.schema)),
            false if self.reduction.columns.is_some() => {
                return datafusion::common::internal_err!(
                    "a dense reduction over {} giving some of its columns cannot give partial \
                     states",
                    self.reduction.store()
                );
            }
            false => {
                self.reduction.check_states(&schema, positioned)?;
                (Emit::States { tasks, positioned }, schema)
            }
        };
        let reduction = match self.reduction.evened(tasks) {
            Some(evened) => Arc::new(evened),
            None => Arc::clone(&self.reduction),
        };
        self.reassembled(reduction, emit, schema)
    }

    /// `reduction` giving `emit` as `schema` with this one's workers, read
    /// ahead, tables joined in and memory limit (checked when it was
    /// planned).
    fn reassembled(
        &self,
        reduction: Arc<Reduction>,
        emit: Emit,
        schema: SchemaRef,
    ) -> Result<Self> {
        let mut exec = Self::assemble(
            reduction,
            emit,
            schema,
            self.io_concurrency,
            self.workers,
            None,
        )?;
        exec.memory_limit = self.memory_limit;
        exec.read_ahead = self.read_ahead;
        exec.broadcasts = self.broadcasts.clone();
        Ok(exec)
    }

    /// This reduction with its blocks dealt to `tasks` tasks of a cluster's
    /// stage in contiguous runs (when it gives partial states), or in
    /// bands, its bands.
    pub fn with_tasks(&self, tasks: usize) -> Result<Self> {
        self.with_states(Arc::clone(&self.schema), tasks, self.positioned())
    }

    /// This reduction giving only its result columns `projection`
    /// (indices into its schema, in their order), as a projection above
    /// it asks: the key columns it no longer gives are never built. An
    /// error when it gives partial states (their merge needs them whole)
    /// or an index is not of its schema.
    fn projected(&self, projection: &[usize]) -> Result<Self> {
        let store = self.reduction.store();
        if matches!(self.emit, Emit::States { .. }) {
            return datafusion::common::internal_err!(
                "the partial states of a dense reduction over {store} are given whole"
            );
        }
        let given = self.reduction.result_columns();
        let columns = (projection.iter())
            .map(|&i| given.get(i).copied())
            .collect::<Option<Vec<_>>>();
        let Some(columns) = columns else {
            return datafusion::common::plan_err!(
                "a dense reduction over {store} gives {} columns, not {projection:?}",
                given.len()
            );
        };
        let mut reduction = (*self.reduction).clone();
        reduction.give_only(columns)?;
        let schema = Arc::new(self.schema.project(projection)?);
        self.reassembled(Arc::new(reduction), self.emit, schema)
    }

    /// The result columns it gives (indices into its grouping columns then
    /// its aggregates) where a projection took only some: what a worker
    /// is sent for its bands.
    pub fn result_columns(&self) -> Option<Vec<usize>> {
        self.reduction.columns.clone()
    }

    /// The memory limit (allowed_mem) it was planned under, if any.
    pub fn memory_limit(&self) -> Option<usize> {
        self.memory_limit
    }

    /// Whether its partial states are led by their groups' positions in
    /// the group space (merged by a [`DenseMergeExec`]) rather than their
    /// coordinates (merged by DataFusion's final aggregate).
    ///
    /// [`DenseMergeExec`]: super::DenseMergeExec
    pub fn positioned(&self) -> bool {
        matches!(
            self.emit,
            Emit::States {
                positioned: true,
                ..
            }
        )
    }

    /// What it folds, shared with the merge of its states.
    pub(super) fn reduction(&self) -> &Arc<Reduction> {
        &self.reduction
    }

    /// The grid its rows lay out, one per cell in C order (or in bands of
    /// a later grouped dimension, band by band), when it gives its results
    /// and every cell has a row (see [`RowGrid`]), with its projected
    /// memory: what `COPY ... STORED AS ZARR` writes as the rows come, a
    /// slab (or band) at a time, instead of holding them.
    pub fn row_grid(&self) -> Result<Option<RowGrid>> {
        if self.emit != Emit::Results {
            return Ok(None);
        }
        self.reduction.row_grid(self.projected_memory()).map(Some)
    }

    /// Whether it runs in bands of its groups (see [`Bands`]): its group
    /// state too large to deal out as partial states, on a cluster its
    /// bands are dealt to the tasks instead.
    pub fn in_bands(&self) -> bool {
        self.reduction.bands.is_some()
    }

    /// The bands it runs in, if any.
    pub fn bands(&self) -> Option<Bands> {
        self.reduction.bands
    }

    /// The bands it runs in (one without bands): what its tasks share
    /// when it runs in bands on a cluster.
    pub fn num_bands(&self) -> usize {
        self.reduction.num_bands()
    }

    /// Bytes of the group state one of its workers holds: all groups', or
    /// one band's.
    pub fn state_bytes(&self) -> usize {
        self.reduction.state_bytes()
    }

    /// The tasks of a cluster's stage the blocks (or in bands, the bands)
    /// are dealt to (`None`: the reduction gives its results, on one
    /// machine).
    pub fn tasks(&self) -> Option<usize> {
        match self.emit {
            Emit::Results => None,
            Emit::States { tasks, .. } | Emit::Bands { tasks } => Some(tasks),
        }
    }

    /// Whether it gives partial states (on a cluster, merged above it).
    pub fn gives_states(&self) -> bool {
        matches!(self.emit, Emit::States { .. })
    }

    /// The groups it folds the cells into (the product of each grouped
    /// dimension's distinct keys).
    pub fn num_groups(&self) -> usize {
        self.reduction.space.num_groups()
    }

    /// What it reads: the table, the columns the expressions read, the
    /// cells reduced and their blocks.
    pub fn read(&self) -> &BlockRead {
        &self.reduction.read
    }

    /// What is grouped by, in the order of the output columns.
    pub fn group_keys(&self) -> &[KeySpec] {
        &self.reduction.keys
    }

    /// The aggregates.
    pub fn aggregates(&self) -> Vec<ReduceSpec> {
        let r = &self.reduction;
        r.aggregates
            .iter()
            .map(|a| ReduceSpec {
                op: a.op,
                arg: a.arg.clone(),
                output: a.output_type.clone(),
                label: a.label.clone(),
            })
            .collect()
    }

    /// The row filter, if any.
    pub fn predicate(&self) -> Option<&Arc<dyn PhysicalExpr>> {
        self.reduction.predicate.as_ref()
    }

    /// Chunk requests in flight at once (remote stores).
    pub fn io_concurrency(&self) -> usize {
        self.io_concurrency
    }

    /// Bytes of the columns read, decoded.
    pub fn decoded_bytes(&self) -> u64 {
        let r = &self.reduction;
        r.read
            .selection
            .num_cells()
            .saturating_mul(r.read.row_bytes() as u64)
    }

    /// The blocks this execution folds: all of them, or on a cluster the
    /// run of the task it runs as (from its `DistributedTaskContext`).
    fn blocks_of_task(&self, context: &Arc<TaskContext>) -> Result<Range<u64>> {
        let all = 0..self.reduction.read.blocks.num_blocks();
        let tasks = match self.emit {
            Emit::Results | Emit::Bands { .. } | Emit::States { tasks: 1, .. } => return Ok(all),
            Emit::States { tasks, .. } => tasks,
        };
        let store = &self.reduction.read.table.store;
        task_share("DenseReductionExec", store, tasks, all, context)
    }

    /// The bands this execution runs (see [`Bands`]): all of them, or on a
    /// cluster the run of the task it runs as.
    fn bands_of_task(&self, context: &Arc<TaskContext>) -> Result<Range<usize>> {
        let all = 0..self.reduction.num_bands() as u64;
        let run = match self.emit {
            Emit::Bands { tasks } if tasks != 1 => {
                let store = &self.reduction.read.table.store;
                task_share("DenseReductionExec", store, tasks, all, context)?
            }
            _ => all,
        };
        Ok(run.start as usize..run.end as usize)
    }

    /// The results of bands `bands` of a reduction in bands (see
    /// [`Bands`]): once the tables joined in are held and its memory taken
    /// (`held`), the bands are the task runner's tasks, taken in order by
    /// as many threads as bands are folded at once; each band's blocks are
    /// folded by its share of the workers and its rows finished and sent
    /// (in slices of `batch_size`) once the bands before it are, so that
    /// they come in order. The threads stop when the stream is dropped.
    fn banded_results(
        &self,
        bands: Range<usize>,
        held: (BroadcastInputs, Reservation, Option<MemoryReservation>),
        (context, meters, output_rows): (Arc<TaskContext>, Arc<Meters>, Count),
        batch_size: usize,
    ) -> SendableRecordBatchStream {
        let (broadcasts, reservation, taken) = held;
        let (reduction, schema) = (Arc::clone(&self.reduction), Arc::clone(&self.schema));
        let (workers, plan) = (self.workers, self.read_ahead);
        let mut builder = RunStreamBuilder::new(Arc::clone(&self.schema));
        let runs = builder.runs(RUN_BATCHES);
        let stop = Arc::new(AtomicBool::new(false));
        builder.spawn(async move {
            let _held = broadcasts.hold(&context, 1).await?;
            let reservation = reservation.after(taken)?;
            // The stream dropped, this task is, and the workers stop.
            let _stop_on_drop = StopOnDrop(Arc::clone(&stop));
            tokio::task::spawn_blocking(move || {
                // Bands at once, each folded by its share of the workers.
                let at_once = (reduction.bands)
                    .map_or(1, |b| b.at_once)
                    .clamp(1, workers.max(1));
                let per_band = (workers / at_once).max(1);
                let first = bands.start;
                // The next band to send (its rows in order), and where.
                let sending = Mutex::new((first, runs));
                let sent = Condvar::new();
                let fold = |b: usize| -> Result<Option<RecordBatch>> {
                    let band = Arc::new(reduction.band(b)?);
                    let blocks = band.read.blocks.num_blocks();
                    if let Some(progress) = &meters.progress {
                        progress.add_planned(blocks);
                    }
                    let boxes = Arc::clone(&band);
                    let read = &band.read;
                    let read_ahead = plan.start(&read.table, &read.columns, 0..blocks, per_band, {
                        move |id| {
                            boxes_in_block(&boxes.read.selection, &boxes.read.blocks.block(id))
                        }
                    });
                    let merged =
                        band.fold_blocks(0..blocks, per_band, &stop, &meters, read_ahead)?;
                    if stop.load(Ordering::Relaxed) {
                        return Ok(None);
                    }
                    band.finish(merged, &schema).map(Some)
                };
                // A band is a task of the one runner, taken in order: its
                // rows wait for the bands before it to be sent, so each of
                // the `at_once` threads holds at most one band.
                run_tasks(
                    bands.len() as u64,
                    at_once,
                    &stop,
                    || (),
                    |_, n| {
                        let b = first + n as usize;
                        // An error or a panic stops the bands waiting to send.
                        let mut unsent = Unsent {
                            stop: &stop,
                            sent: &sent,
                            done: false,
                        };
                        let Some(batch) = fold(b)? else {
                            unsent.done = true;
                            return Ok(0);
                        };
                        let lost = || DataFusionError::Execution("a band's sender was lost".into());
                        let mut next = sending.lock().map_err(|_| lost())?;
                        while next.0 != b {
                            if stop.load(Ordering::Relaxed) {
                                unsent.done = true;
                                return Ok(0);
                            }
                            let waited = sent.wait_timeout(next, Duration::from_millis(50));
                            next = waited.map_err(|_| lost())?.0;
                        }
                        output_rows.add(batch.num_rows());
                        let runs = &mut next.1;
                        let mut open = true;
                        for start in (0..batch.num_rows()).step_by(batch_size) {
                            let len = batch_size.min(batch.num_rows() - start);
                            if !runs.push(batch_rows(&batch, start, len)?) {
                                open = false;
                                break;
                            }
                        }
                        if !(open && runs.flush()) {
                            // The stream is gone: the query has its rows.
                            stop.store(true, Ordering::Relaxed);
                        }
                        next.0 = b + 1;
                        unsent.done = true;
                        sent.notify_all();
                        Ok::<_, DataFusionError>(0)
                    },
                )?;
                drop(reservation);
                Ok(())
            })
            .await
            .map_err(|e| DataFusionError::ExecutionJoin(Box::new(e)))?
        });
        builder.build()
    }

    /// Memory one worker holds: a decoded block, the temporaries of one run
    /// of rows, and its group state.
    fn per_worker_memory(&self) -> usize {
        self.reduction.worker_memory()
    }

    /// Memory the whole reduction is projected to hold at its peak: the
    /// workers', the output and the keys, and the chunks read ahead.
    pub fn projected_memory(&self) -> usize {
        self.projection().total()
    }
}

impl Reduction {
    #[allow(clippy::too_many_arguments)]
    fn new(
        read: BlockRead,
        keys: Vec<KeySpec>,
        aggregates: Vec<PhysicalReduce>,
        predicate: Option<Arc<dyn PhysicalExpr>>,
    ) -> Result<Self> {
        let mut dims: Vec<usize> = keys.iter().map(|k| k.dim).collect();
        dims.sort_unstable();
        dims.dedup();
        // Dimensions grouped by functions of their coordinate: their keys
        // over the selected positions.
        let table = &read.table;
        let mut key_values = vec![None; table.dims.len()];
        let mut mapped = Vec::new();
        let mut key_bytes = 0usize;
        for &d in &dims {
            let exprs: Vec<Arc<dyn PhysicalExpr>> = keys
                .iter()
                .filter(|k| k.dim == d)
                .filter_map(|k| k.expr.clone())
                .collect();
            if exprs.is_empty() {
                continue;
            }
            let evaluated = DimKeys::evaluate(table, d, read.selection.ranges(d), &exprs)?;
            key_bytes += evaluated.map.keys.len() * KEYED_POSITION_BYTES
                + (evaluated.values.iter())
                    .map(|v| v.get_array_memory_size())
                    .sum::<usize>();
            key_values[d] = Some(evaluated.values);
            mapped.push((d, evaluated.map));
        }
        let space = GroupSpace::new(&read.selection, &dims, mapped);
        Ok(Self {
            read,
            space,
            keys,
            dims,
            key_values,
            key_bytes,
            aggregates,
            predicate,
            run_rows: RUN_ROWS,
            bands: None,
            columns: None,
        })
    }

    /// The groups whose state it holds at once: all of them, or one
    /// band's.
    fn groups_held(&self) -> usize {
        match self.bands {
            None => self.space.num_groups(),
            Some(bands) => self.groups_per_key(bands.dim).saturating_mul(bands.keys),
        }
    }

    /// The groups of each key of grouped dimension `dim`.
    fn groups_per_key(&self, dim: usize) -> usize {
        self.space.num_groups() / self.space.keys_of(dim).max(1)
    }

    /// The bands it runs in (one without bands).
    fn num_bands(&self) -> usize {
        match self.bands {
            None => 1,
            Some(bands) => self.space.keys_of(bands.dim).div_ceil(bands.keys.max(1)),
        }
    }

    /// Band `b` (see [`Bands`]) as a reduction of its own: the selected
    /// positions of the cut dimension whose keys are the band's, read in
    /// blocks of the same shape.
    fn band(&self, b: usize) -> Result<Reduction> {
        let Some(bands) = self.bands else {
            return datafusion::common::internal_err!("a reduction without bands has no band {b}");
        };
        let count = self.space.keys_of(bands.dim);
        let keys = (b * bands.keys).min(count)..((b + 1) * bands.keys).min(count);
        let positions = (self.space).positions_of_keys(bands.dim, keys.clone(), bands.descending);
        let selection = self.read.selection.clone().positions(bands.dim, positions);
        let table = &self.read.table;
        let block_shape = self.read.blocks.block_shape().to_vec();
        let blocks = BlockGrid::with_block_shape(&table.shape(), block_shape, &selection)
            .map_err(|e| DataFusionError::Internal(format!("{}: {e}", table.store)))?;
        let read = BlockRead::new(
            Arc::clone(table),
            self.read.columns.clone(),
            selection,
            blocks,
        )?;
        let keys_per_band = keys.len();
        let mut band = Reduction::new(
            read,
            self.keys.clone(),
            self.aggregates.clone(),
            self.predicate.clone(),
        )?;
        band.run_rows = self.run_rows;
        band.columns = self.columns.clone();
        if band.space.keys_of(bands.dim) != keys_per_band {
            return datafusion::common::internal_err!(
                "band {b} of the dense reduction over {} has {} keys of '{}', not {keys_per_band}",
                table.store,
                band.space.keys_of(bands.dim),
                table.dims[bands.dim].name
            );
        }
        Ok(band)
    }

    /// The bands to run in with `workers` workers under `limit`, and the
    /// workers: none when no grouped dimension's keys can be cut (see
    /// [`Bands`]). The first grouped dimension (in table order) that can
    /// be cut is cut: the result stays in the grid's order where that is
    /// the first grouped dimension. When the whole group state fits
    /// (within `bound` for one worker, and one worker fits `limit`), only
    /// bands of the first grouped dimension folded at once, each by its
    /// own worker (see [`Self::banding_along`]): each worker then holds a
    /// band's state instead of every group's, and no worker's state is
    /// merged into another's.
    fn banding(&self, workers: usize, limit: Option<usize>, bound: usize) -> Option<Bands> {
        let without_state = self.worker_buffers(MIN_RUN_ROWS);
        let groups = self.space.num_groups();
        let whole = self.state_per_group().saturating_mul(groups);
        let fits_whole = whole <= bound
            && limit.is_none_or(|l| {
                (without_state.saturating_add(whole)).saturating_add(self.shared_memory_of(groups))
                    <= l
            });
        if fits_whole {
            let first = *self.dims.first()?;
            let lanes = self.banding_along(first, workers, limit, bound)?;
            return (lanes.at_once > 1).then_some(lanes);
        }
        (self.dims.iter()).find_map(|&dim| self.banding_along(dim, workers, limit, bound))
    }

    /// [`Self::banding`] cutting grouped dimension `dim`: none when its
    /// keys do not run along its positions, or not even one key's state
    /// fits. A band holds about [`BAND_BYTES`] of state and output (a
    /// quarter of `bound` if less), or more keys where those span fewer
    /// than [`BAND_CHUNKS`] chunks of the cut dimension (a chunk a band
    /// boundary cuts is decoded by both bands), as far as they fit; as many
    /// of the workers run as fit a band of at least a chunk.
    fn banding_along(
        &self,
        dim: usize,
        workers: usize,
        limit: Option<usize>,
        bound: usize,
    ) -> Option<Bands> {
        let count = self.space.keys_of(dim);
        if count < 2 {
            return None;
        }
        let descending = self.space.key_direction(dim)?;
        let per_key = self.groups_per_key(dim);
        let state = self.state_per_group().saturating_mul(per_key);
        let output = 8usize
            .saturating_mul(self.keys.len() + self.aggregates.len())
            .saturating_mul(per_key);
        let without_state = self.worker_buffers(MIN_RUN_ROWS);
        // Positions of the cut dimension a key has, on average, and the
        // longest chunk of a variable read along it.
        let positions: u64 = (self.read.selection.ranges(dim).iter())
            .map(|r| r.end - r.start)
            .sum();
        let table = &self.read.table;
        let chunk = (self.read.columns.iter())
            .filter_map(|&c| table.variable(c))
            .map(|v| v.chunk_shape()[dim])
            .max()
            .unwrap_or(1);
        let spanning = |chunks: u64| {
            (chunks.saturating_mul(chunk).saturating_mul(count as u64)).div_ceil(positions.max(1))
        };
        // Keys per band for `w` workers a band and `a` bands at once.
        let keys_for = |w: usize, a: usize| -> usize {
            let band = w.saturating_mul(state).saturating_add(output).max(1);
            let target = BAND_BYTES.min(bound / 4);
            let wanted = (target / band).max(spanning(BAND_CHUNKS) as usize);
            let threads = a.saturating_mul(w);
            let most = match limit {
                // Without a limit, the workers' states within the bound
                // together.
                None => bound / threads.saturating_mul(state).max(1),
                Some(l) => {
                    let room = l
                        .saturating_sub(self.key_bytes)
                        .saturating_sub(threads.saturating_mul(without_state));
                    (room / a.saturating_mul(band).max(1)).min(bound / state.max(1))
                }
            };
            most.min(wanted).min(count)
        };
        let per_band = (1..=workers.max(1))
            .rev()
            .find(|&w| keys_for(w, 1) >= (spanning(1) as usize).max(1) || w == 1)?;
        let keys = keys_for(per_band, 1);
        if keys == 0 || keys >= count {
            return None;
        }
        let one_at_once = Bands {
            dim,
            keys,
            descending,
            workers: per_band,
            at_once: 1,
        };
        // Bands at once, each by its own worker, evened out over the rounds
        // (a round decodes the chunks its bands span): no worker's state is
        // merged into another's.
        let lanes = if per_band > 1 {
            // Workers that could share a band take a band each instead,
            // where there is a band for each and none spans fewer chunks
            // than wanted (or than the shared band).
            let k = keys_for(1, per_band);
            let shortest = keys.min(spanning(BAND_CHUNKS) as usize);
            let bands = count.div_ceil(k.max(1));
            let rounds = bands.div_ceil(per_band);
            (k >= shortest.max(1) && bands >= per_band)
                .then(|| (per_band, count.div_ceil(rounds.saturating_mul(per_band))))
        } else {
            // One worker a band: where they take no more rounds than one at
            // a time.
            let rounds_alone = count.div_ceil(keys);
            (2..=workers.min(count)).rev().find_map(|a| {
                let k = keys_for(1, a);
                let rounds = count.div_ceil(k.max(1)).div_ceil(a);
                (k > 0 && rounds <= rounds_alone)
                    .then(|| (a, count.div_ceil(rounds.saturating_mul(a))))
            })
        };
        Some(match lanes {
            Some((at_once, keys)) => Bands {
                keys,
                workers: 1,
                at_once,
                ..one_at_once
            },
            None => one_at_once,
        })
    }

    /// This reduction in bands with as many bands for each of `tasks`
    /// tasks (the same number, at least as many, each no larger), so that
    /// the tasks' runs of them are as even as the keys allow: `None` where
    /// they are already, for an unknown number of tasks, or without bands.
    fn evened(&self, tasks: usize) -> Option<Self> {
        let bands = self.bands?;
        if tasks <= 1 || tasks == TASKS_OF_STAGE {
            return None;
        }
        let count = self.space.keys_of(bands.dim);
        // A task's bands: a multiple of those folded at once.
        let at_once = bands.at_once.max(1);
        let per_task = self
            .num_bands()
            .div_ceil(tasks)
            .div_ceil(at_once)
            .saturating_mul(at_once);
        let keys = count.div_ceil(per_task.saturating_mul(tasks).max(1)).max(1);
        (keys < bands.keys).then(|| Self {
            bands: Some(Bands { keys, ..bands }),
            ..self.clone()
        })
    }

    /// Whether its rows come in the grid's order (C order of its grouped
    /// dimensions): unless it runs in bands of a dimension other than the
    /// first grouped one.
    fn rows_in_grid_order(&self) -> bool {
        self.bands
            .is_none_or(|bands| self.dims.first() == Some(&bands.dim))
    }

    /// Memory one worker holds: a decoded block, the temporaries of one run
    /// of rows, and its group state.
    fn worker_memory(&self) -> usize {
        (self.worker_buffers(self.run_rows)).saturating_add(self.state_bytes())
    }

    /// Memory one worker holds besides its group state: a decoded block
    /// and the temporaries of one run of `run_rows` rows.
    fn worker_buffers(&self, run_rows: u64) -> usize {
        let block = self.read.block_cells() as usize * self.read.row_bytes();
        let runs = run_temporaries(self.aggregates.len(), self.read.columns.len(), run_rows);
        block + runs.bytes(self.read.block_cells().max(1)) as usize
    }

    /// Memory held once, whatever the workers: the output (the bands'
    /// folded at once) and the keys.
    fn shared_memory(&self) -> usize {
        let at_once = self.bands.map_or(1, |b| b.at_once.max(1));
        self.shared_memory_of(self.groups_held().saturating_mul(at_once))
    }

    /// [`Self::shared_memory`] with the output of `groups` groups.
    fn shared_memory_of(&self, groups: usize) -> usize {
        groups
            .saturating_mul(8)
            .saturating_mul(self.keys.len() + self.aggregates.len())
            .saturating_add(self.key_bytes)
    }

    /// Fits the reduction's workers (at most `parallelism`, at most one
    /// per block) to `limit`: bands of its groups when `banding` (the most
    /// group state held at once) allows them and its state needs them (see
    /// [`Self::banding`]), shorter runs of rows (down to
    /// [`MIN_RUN_ROWS`]), then fewer workers, until they fit beside what
    /// is held once (when they can). Gives the workers.
    fn fit(&mut self, parallelism: usize, limit: Option<usize>, banding: Option<usize>) -> usize {
        let mut workers = (self.read.blocks.num_blocks() as usize).clamp(1, parallelism.max(1));
        let bound = banding.unwrap_or(MAX_STATE_BYTES);
        if let Some(bands) = banding.and_then(|b| self.banding(workers, limit, b)) {
            self.bands = Some(bands);
        }
        // No more workers than the bands were sized for (on a worker of a
        // cluster: by the session).
        if let Some(bands) = self.bands {
            workers = workers.min(bands.workers.max(1).saturating_mul(bands.at_once.max(1)));
        }
        let Some(limit) = limit else {
            // Without a limit, the workers' group states stay within the
            // bound the rule holds one worker's to.
            let most = bound / self.state_bytes().max(1);
            return workers.min(most.max(1));
        };
        let room = limit.saturating_sub(self.shared_memory());
        let over = |r: &Self, workers: usize| workers.saturating_mul(r.worker_memory()) > room;
        while over(self, workers) && self.run_rows > MIN_RUN_ROWS {
            self.run_rows = (self.run_rows / 2).max(MIN_RUN_ROWS);
        }
        while over(self, workers) && workers > 1 {
            workers -= 1;
        }
        workers
    }

    /// The type of each group column.
    pub(super) fn key_types(&self) -> Result<Vec<DataType>> {
        self.keys
            .iter()
            .map(|k| match &k.expr {
                Some(expr) => expr.data_type(&key_schema(&self.read.table.dims[k.dim])),
                None => Ok(self.read.table.dims[k.dim].coordinate.data_type()),
            })
            .collect()
    }

    /// The result columns it gives: indices into its keys then its
    /// aggregates.
    fn result_columns(&self) -> Vec<usize> {
        match &self.columns {
            Some(columns) => columns.clone(),
            None => (0..self.keys.len() + self.aggregates.len()).collect(),
        }
    }

    /// The type of each result column it gives.
    fn result_types(&self) -> Result<Vec<DataType>> {
        let mut all = self.key_types()?;
        all.extend(self.aggregates.iter().map(|a| a.output_type.clone()));
        Ok(self
            .result_columns()
            .into_iter()
            .map(|i| all[i].clone())
            .collect())
    }

    /// Gives only the result `columns` (indices into its keys then its
    /// aggregates): an error naming the store when one is neither.
    fn give_only(&mut self, columns: Vec<usize>) -> Result<()> {
        let width = self.keys.len() + self.aggregates.len();
        if let Some(bad) = columns.iter().find(|&&c| c >= width) {
            return datafusion::common::plan_err!(
                "a dense reduction over {} gives column {bad} of {width}",
                self.read.table.store
            );
        }
        let all = columns.iter().copied().eq(0..width);
        self.columns = (!all).then_some(columns);
        Ok(())
    }

    /// The position among the columns it gives of its key column `key`, if
    /// it gives it.
    fn given(&self, key: usize) -> Option<usize> {
        match &self.columns {
            Some(columns) => columns.iter().position(|&c| c == key),
            None => Some(key),
        }
    }

    /// Checks that `schema` is the group columns (when `positioned`: the
    /// group's position), then each aggregate's state columns
    /// ([`ReduceOp::state_types`]).
    fn check_states(&self, schema: &SchemaRef, positioned: bool) -> Result<()> {
        let mut expected = match positioned {
            true => vec![DataType::UInt64],
            false => self.key_types()?,
        };
        for a in &self.aggregates {
            expected.extend(a.op.state_types(&a.output_type));
        }
        let got: Vec<DataType> = schema
            .fields()
            .iter()
            .map(|f| f.data_type().clone())
            .collect();
        if got != expected {
            return datafusion::common::plan_err!(
                "the partial states of a dense reduction over {} are {expected:?}, not {got:?}",
                self.read.table.store
            );
        }
        Ok(())
    }

    /// Runs it in `bands` as sent by the session (a worker's task of a
    /// reduction in bands), its results as `schema`: an error naming the
    /// store when the cut dimension is not grouped, its keys do not run
    /// along its positions that way, a band has no keys, or `schema` is
    /// not the results' (`positioned`: states, not results).
    fn cut_into(&mut self, bands: Bands, schema: &SchemaRef, positioned: bool) -> Result<()> {
        let store = &self.read.table.store;
        let runs = self.dims.contains(&bands.dim)
            && self.space.key_direction(bands.dim) == Some(bands.descending);
        if !runs || bands.keys == 0 || bands.workers == 0 || bands.at_once == 0 {
            return datafusion::common::plan_err!(
                "a dense reduction over {store} cannot run in bands of {} keys of dimension {} \
                 (descending: {}) on {} workers, {} at once: its grouped dimensions are {:?}",
                bands.keys,
                bands.dim,
                bands.descending,
                bands.workers,
                bands.at_once,
                self.dims
            );
        }
        let expected = self.result_types()?;
        let got: Vec<DataType> = (schema.fields().iter())
            .map(|f| f.data_type().clone())
            .collect();
        if positioned || got != expected {
            return datafusion::common::plan_err!(
                "the results of a dense reduction over {store} in bands are {expected:?}, not \
                 {got:?}{}",
                if positioned { " led by positions" } else { "" }
            );
        }
        self.bands = Some(Bands {
            keys: bands.keys.min(self.space.keys_of(bands.dim)),
            ..bands
        });
        Ok(())
    }

    /// `extent` cut into parts of about [`PART_BYTES`] along one dimension
    /// when every variable read comes straight from chunk files (a part then
    /// costs only its own bytes, and is still in cache when folded); else
    /// `extent` whole. A grouped dimension is cut first, so that each part
    /// holds every reduced step of its groups; a dimension is cut only where
    /// the parts' runs in the chunk files stay long.
    fn parts(&self, extent: &[Range<u64>]) -> Vec<Vec<Range<u64>>> {
        let n_dims = self.read.table.dims.len();
        // A broadcast column is not read from chunk files.
        let sizes: Vec<u64> = (self.read.columns.iter())
            .filter(|&&c| c >= n_dims)
            .map(|&c| self.read.table.variable(c))
            .map(|v| v.filter(|v| v.reads_chunk_files()))
            .map(|v| v.map(|v| v.element_size() as u64))
            .collect::<Option<_>>()
            .unwrap_or_default();
        let cells: u64 = extent.iter().map(|r| r.end - r.start).product();
        let pieces = (cells * sizes.iter().sum::<u64>()).div_ceil(PART_BYTES);
        let smallest = sizes.iter().copied().min().unwrap_or(1);
        let cut = self
            .dims
            .iter()
            .copied()
            .chain(0..extent.len())
            .find_map(|d| {
                let len = extent[d].end - extent[d].start;
                let step = len.div_ceil(pieces.max(1));
                let row: u64 = extent[d + 1..].iter().map(|r| r.end - r.start).product();
                (len > 1 && step * row * smallest >= MIN_PART_RUN_BYTES).then_some((d, step))
            });
        match cut {
            Some((d, step)) if pieces > 1 && !sizes.is_empty() => extent[d]
                .clone()
                .step_by(step as usize)
                .map(|start| {
                    let mut part = extent.to_vec();
                    part[d] = start..(start + step).min(extent[d].end);
                    part
                })
                .collect(),
            _ => vec![extent.to_vec()],
        }
    }

    /// Bytes of accumulator state per group.
    fn state_per_group(&self) -> usize {
        // The aggregates' state and the row count they share.
        self.aggregates
            .iter()
            .map(|a| a.op.state_bytes())
            .sum::<usize>()
            + 8
    }

    /// Bytes of one worker's group state (one band's groups').
    fn state_bytes(&self) -> usize {
        self.state_per_group().saturating_mul(self.groups_held())
    }

    /// A fresh partial state: no rows, and one accumulator per aggregate.
    fn partial(&self) -> Result<Partial> {
        let groups = self.space.num_groups();
        let accumulators = self
            .aggregates
            .iter()
            .map(|a| {
                a.op.accumulator(&a.arg_type, &a.output_type, groups)
                    .ok_or_else(|| {
                        DataFusionError::Internal(format!(
                            "no dense accumulator for {} of {}",
                            a.label, a.arg_type
                        ))
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Partial {
            rows: RowCounts::new(groups),
            accumulators,
        })
    }

    /// Folds block `id` into `worker`'s partial state, telling
    /// `read_ahead` when the block is done.
    fn fold_block(
        &self,
        id: u64,
        worker: &mut Worker,
        meters: &Meters,
        read_ahead: Option<&TableReadAhead>,
    ) -> Result<()> {
        let partial = match &mut worker.partial {
            Some(partial) => partial,
            empty => empty.insert(self.partial()?),
        };
        let boxes = boxes_in_block(&self.read.selection, &self.read.blocks.block(id));
        for extent in boxes.iter().flat_map(|b| self.parts(b)) {
            let timer = meters.decode_time.timer();
            let cells = BoxCells::read(
                &self.read.table,
                &self.read.columns,
                &extent,
                &worker.buffers,
            )?;
            timer.done();
            meters.bytes_decoded.add(cells.decoded_bytes() as usize);
            let _compute = meters.fold_time.timer();
            let shape: Vec<u64> = extent.iter().map(|r| r.end - r.start).collect();
            // Runs of a tile one after the other: each is a batch of its
            // own (a slice, no copy), and together they reuse the state of
            // the tile's groups while it is in cache.
            for tile in (self.space).tiles(&shape, self.run_rows, self.state_per_group()) {
                for run in tile {
                    let len = run.end - run.start;
                    let batch = cells.batch(&self.read.schema, run.start, len)?;
                    worker.lines.clear();
                    (self.space).lines(&extent, run.start, len, &mut worker.lines);
                    self.fold(&batch, &worker.lines, partial)?;
                }
            }
        }
        if let Some(read_ahead) = read_ahead {
            read_ahead.done_with(id);
        }
        meters.blocks_read.add(1);
        if let Some(progress) = &meters.progress {
            progress.add_done(1);
        }
        Ok(())
    }

    /// Folds the blocks `run` on `workers` threads (reading ahead with
    /// `read_ahead`) and merges their partial states: every group's.
    fn fold_blocks(
        &self,
        run: Range<u64>,
        workers: usize,
        stop: &AtomicBool,
        meters: &Meters,
        read_ahead: Option<TableReadAhead>,
    ) -> Result<Partial> {
        let (first, read_ahead) = (run.start, read_ahead.as_ref());
        let blocks = run.end.saturating_sub(run.start);
        let (_, folded) =
            run_tasks_keeping_states(blocks, workers, stop, Worker::default, |worker, n| {
                self.fold_block(first + n, worker, meters, read_ahead)?;
                Ok::<_, DataFusionError>(0)
            })?;
        let partials = folded.into_iter().filter_map(|w| w.partial).collect();
        match merge_tree(partials)? {
            Some(merged) => Ok(merged),
            None => self.partial(),
        }
    }

    /// Folds one batch of rows into a partial state.
    fn fold(&self, batch: &RecordBatch, lines: &[Line], partial: &mut Partial) -> Result<()> {
        let rows = batch.num_rows();
        let mask = match &self.predicate {
            Some(predicate) => {
                let result = predicate.evaluate(batch)?.into_array(rows)?;
                let mask = result.as_boolean();
                let mask = match mask.null_count() {
                    0 => mask.values().clone(),
                    _ => prep_null_mask_filter(mask).values().clone(),
                };
                match mask.count_set_bits() {
                    0 => return Ok(()),
                    // Every row kept (a join's cells that all have a row):
                    // folded as without a predicate, fused where it can be.
                    kept if kept == rows => None,
                    _ => Some(mask),
                }
            }
            None => None,
        };
        partial.rows.add(lines, mask.as_ref());
        for (i, accumulator) in partial.accumulators.iter_mut().enumerate() {
            // Fused arithmetic, piece by piece, where no row is masked and
            // no input is NULL.
            let fused = self.aggregates.get(i).and_then(|a| a.fused.as_ref());
            if let Some((fused, inputs)) = fused
                .filter(|_| mask.is_none())
                .and_then(|f| Some((f, f.inputs(batch)?)))
            {
                let mut scratch = fused.scratch();
                accumulator.update_fused(lines, &mut |row, out| {
                    fused.eval(&inputs, row, out, &mut scratch)
                })?;
                continue;
            }
            let values = match self.aggregates.get(i).and_then(|a| a.arg.as_ref()) {
                Some(arg) => Some(match arg.evaluate(batch)? {
                    ColumnarValue::Array(values) => values,
                    ColumnarValue::Scalar(value) => value.to_array_of_size(rows)?,
                }),
                None => None,
            };
            accumulator.update(values.as_ref(), lines, mask.as_ref())?;
        }
        Ok(())
    }

    /// The groups it folds into (the product of each grouped dimension's
    /// distinct keys).
    pub(super) fn num_groups(&self) -> usize {
        self.space.num_groups()
    }

    /// Where it reads from, for messages.
    pub(super) fn store(&self) -> &str {
        &self.read.table.store
    }

    /// What it knows of its result rows, holding `memory` (see
    /// [`RowGrid`]): the grid they lay out one per cell, each grouped
    /// dimension in table order with the output column of its key and the
    /// keys' values in the order the rows run along it; and where its rows
    /// come in bands of a dimension other than the first grouped one, that
    /// dimension (its place among the grid's) and its keys per band (each
    /// band's rows in C order over the band's cells, the bands in order).
    /// No grid when a row filter decides which groups exist (a cell may
    /// have no row), or a dimension is grouped by more than one column (its
    /// keys are tuples, not a line of the grid).
    fn row_grid(&self, memory: usize) -> Result<RowGrid> {
        let unknown = RowGrid {
            dims: None,
            band: None,
            memory,
        };
        if self.keys.is_empty() || self.filters_groups() {
            return Ok(unknown);
        }
        let band = match self.bands {
            Some(bands) if !self.rows_in_grid_order() => {
                let Some(dim) = self.dims.iter().position(|&d| d == bands.dim) else {
                    return Ok(unknown);
                };
                Some(RowBand {
                    dim,
                    keys: bands.keys as u64,
                })
            }
            _ => None,
        };
        let mut dims = Vec::with_capacity(self.dims.len());
        for &d in &self.dims {
            let mut columns = (self.keys.iter().enumerate())
                .filter(|(_, k)| k.dim == d)
                .map(|(i, _)| i);
            let (Some(key), None) = (columns.next(), columns.next()) else {
                return Ok(unknown);
            };
            // A grid's rows are laid out by their keys' columns.
            let Some(column) = self.given(key) else {
                return Ok(unknown);
            };
            let values = match &self.key_values[d] {
                Some(values) => Arc::clone(&values[0]),
                None => {
                    let indices = UInt64Array::from(self.space.selected_indices(d));
                    self.read.table.dims[d].coordinate.take(&indices)?
                }
            };
            if values.len() != self.space.keys_of(d) {
                return Ok(unknown);
            }
            dims.push((column, values));
        }
        Ok(RowGrid {
            dims: Some(dims),
            band,
            memory,
        })
    }

    /// Whether some groups may have no row, and so do not exist: a row
    /// filter decides which do, or the selection holds no cell (a filter
    /// on a dimension not grouped selected none of its positions, while
    /// the grouped ones still have keys).
    pub(super) fn filters_groups(&self) -> bool {
        let empty = self.read.selection.num_cells() == 0;
        (self.predicate.is_some() || empty) && !self.keys.is_empty()
    }

    /// The order of its result rows (see [`output_ordering`]): none in
    /// bands of a dimension other than the first grouped one.
    pub(super) fn ordering(&self, schema: &SchemaRef) -> Vec<PhysicalSortExpr> {
        if !self.rows_in_grid_order() {
            return Vec::new();
        }
        output_ordering(schema, &self.read.table, &self.keys, |key| self.given(key))
    }

    /// Bytes of the keys' maps and values it holds.
    pub(super) fn key_bytes(&self) -> usize {
        self.key_bytes
    }

    /// The keys of every group, a column per grouping column.
    pub(super) fn group_columns(&self) -> Result<Vec<ArrayRef>> {
        (0..self.keys.len()).map(|i| self.group_column(i)).collect()
    }

    /// The keys of every group of grouping column `i`.
    fn group_column(&self, i: usize) -> Result<ArrayRef> {
        let d = self.keys[i].dim;
        Ok(match &self.key_values[d] {
            Some(values) => {
                // Which of the dimension's functions this column is.
                let slot = self.keys[..i].iter().filter(|o| o.dim == d).count();
                let indices = UInt64Array::from(self.space.key_indices(d));
                take(values[slot].as_ref(), &indices, None)?
            }
            None => {
                let indices = UInt64Array::from(self.space.coordinate_indices(d));
                self.read.table.dims[d].coordinate.take(&indices)?
            }
        })
    }

    /// The result rows: the columns it gives of the group coordinates then
    /// the aggregates (all of them unless a projection took some).
    fn finish(&self, mut partial: Partial, schema: &SchemaRef) -> Result<RecordBatch> {
        let rows = partial.rows.settled();
        let n_keys = self.keys.len();
        let columns = (self.result_columns().into_iter())
            .map(|i| match i.checked_sub(n_keys) {
                None => self.group_column(i),
                Some(a) => partial.accumulators[a].finish(rows),
            })
            .collect::<Result<Vec<_>>>()?;
        // A projection may take no column at all (`count(*)` of the groups).
        let options = RecordBatchOptions::new().with_row_count(Some(rows.len()));
        let batch = RecordBatch::try_new_with_options(Arc::clone(schema), columns, &options)?;
        // Groups where no row passed do not exist (with no GROUP BY, the
        // one group always does).
        if self.filters_groups() {
            let present: BooleanArray = rows.iter().map(|&n| Some(n > 0)).collect();
            return Ok(filter_record_batch(&batch, &present)?);
        }
        Ok(batch)
    }

    /// The partial states: group coordinates (when `positioned`: the
    /// group's position), then each aggregate's state columns, for the
    /// groups this task's rows fell in (with no GROUP BY, the one group
    /// always).
    fn states(
        &self,
        mut partial: Partial,
        schema: &SchemaRef,
        positioned: bool,
    ) -> Result<RecordBatch> {
        let rows = partial.rows.settled();
        let mut columns = match positioned {
            true => vec![Arc::new(UInt64Array::from_iter_values(0..rows.len() as u64)) as ArrayRef],
            false => self.group_columns()?,
        };
        for accumulator in &partial.accumulators {
            columns.extend(accumulator.state(rows)?);
        }
        let batch = RecordBatch::try_new(Arc::clone(schema), columns)?;
        if self.keys.is_empty() {
            return Ok(batch);
        }
        let present: BooleanArray = rows.iter().map(|&n| Some(n > 0)).collect();
        Ok(filter_record_batch(&batch, &present)?)
    }
}

/// The grid of `plan`'s rows when it is a [`DenseReductionExec`] that
/// knows it (see [`DenseReductionExec::row_grid`]): the session's
/// [`RowGrids`](crate::write::rows::RowGrids), which `COPY ... STORED AS ZARR` asks.
pub fn reduction_rows(plan: &dyn ExecutionPlan) -> Result<Option<RowGrid>> {
    match plan.downcast_ref::<DenseReductionExec>() {
        Some(exec) => exec.row_grid(),
        None => Ok(None),
    }
}

/// The one batch `result` makes, sent in slices of `batch_size` rows (one
/// empty batch when it has none): a reduction's output and its merge's.
pub(super) fn in_batches(
    schema: SchemaRef,
    result: impl Future<Output = Result<RecordBatch>> + Send + 'static,
    batch_size: usize,
) -> SendableRecordBatchStream {
    let batch_size = batch_size.max(1);
    let sliced = result.map_ok(move |batch| {
        let rows = batch.num_rows();
        let slices: Vec<Result<RecordBatch>> = (0..rows.max(1))
            .step_by(batch_size)
            .map(|start| batch_rows(&batch, start, batch_size.min(rows - start)))
            .collect();
        futures::stream::iter(slices)
    });
    let stream = futures::stream::once(sliced).try_flatten();
    Box::pin(RecordBatchStreamAdapter::new(schema, stream.boxed()))
}

/// The order of the result rows: C order of the grouped dimensions taken in
/// the table's order, which sorts them by the coordinate values of each
/// dimension grouped by its coordinate as far as those values are strictly
/// monotonic (ascending or descending), and by the values of the functions
/// of a dimension grouped by them (ascending, NULLs first, in the order
/// grouped by: their keys are sorted so). Declared so that an `ORDER BY` of
/// the grouping columns costs no sort.
///
/// `given` is the position among the columns of `schema` of each key's
/// column: the order stops before the first key not given.
fn output_ordering(
    schema: &SchemaRef,
    table: &GridTable,
    keys: &[KeySpec],
    given: impl Fn(usize) -> Option<usize>,
) -> Vec<PhysicalSortExpr> {
    let mut dims: Vec<usize> = keys.iter().map(|k| k.dim).collect();
    dims.sort_unstable();
    dims.dedup();
    let column = |key: usize| {
        let i = given(key)?;
        Some(Arc::new(Column::new(schema.field(i).name(), i)))
    };
    let mut ordering = Vec::new();
    for d in dims {
        let on_dim: Vec<usize> = (0..keys.len()).filter(|&i| keys[i].dim == d).collect();
        if keys[on_dim[0]].expr.is_some() {
            for i in on_dim {
                let Some(column) = column(i) else {
                    return ordering;
                };
                ordering.push(PhysicalSortExpr::new(column, SortOptions::new(false, true)));
            }
            continue;
        }
        let (Some(descending), Some(column)) = (table.dims[d].strict_order(), column(on_dim[0]))
        else {
            break;
        };
        ordering.push(PhysicalSortExpr::new(
            column,
            SortOptions::new(descending, descending),
        ));
    }
    ordering
}

/// What one worker folded: rows per group and the aggregates' state.
#[derive(Debug)]
struct Partial {
    rows: RowCounts,
    accumulators: Vec<Box<dyn DenseAccumulator>>,
}

impl Partial {
    /// Adds another partial state of the same reduction.
    fn merge(&mut self, other: Partial) -> Result<()> {
        let Partial {
            rows: mut other_rows,
            accumulators: other_accumulators,
        } = other;
        let other_rows = other_rows.settled();
        let rows = self.rows.settled();
        for (a, b) in self.accumulators.iter_mut().zip(other_accumulators) {
            a.merge(b, rows, other_rows)?;
        }
        self.rows.add_counts(other_rows);
        Ok(())
    }
}

/// Merges partial states pairwise, level by level, into one.
fn merge_tree(mut partials: Vec<Partial>) -> Result<Option<Partial>> {
    while partials.len() > 1 {
        let mut next = Vec::with_capacity(partials.len().div_ceil(2));
        let mut level = partials.into_iter();
        while let Some(mut left) = level.next() {
            if let Some(right) = level.next() {
                left.merge(right)?;
            }
            next.push(left);
        }
        partials = next;
    }
    Ok(partials.pop())
}

/// What a worker of the reduction keeps from one block to the next.
#[derive(Default)]
struct Worker {
    /// Its partial state, made with its first block.
    partial: Option<Partial>,
    lines: Vec<Line>,
    /// Each block is dropped before the next is read, into the same
    /// buffers.
    buffers: ChunkBufferPool,
}

/// Metrics and progress a worker reports to.
struct Meters {
    blocks_read: Count,
    bytes_decoded: Count,
    decode_time: Time,
    fold_time: Time,
    progress: Option<Arc<ScanProgress>>,
}

/// A band of a reduction in bands not sent yet: dropped so (an error, a
/// panic), it stops the bands waiting to send after it.
struct Unsent<'a> {
    stop: &'a AtomicBool,
    sent: &'a Condvar,
    done: bool,
}

impl Drop for Unsent<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.stop.store(true, Ordering::Relaxed);
            self.sent.notify_all();
        }
    }
}

/// Tells the workers to stop when the query's stream is dropped.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

impl ReadsBroadcasts for DenseReductionExec {
    fn broadcasts_mut(&mut self) -> &mut BroadcastInputs {
        &mut self.broadcasts
    }

    fn projection(&self) -> Projection {
        let r = &self.reduction;
        Projection::new(
            "DenseReductionExec",
            &r.read.table.store,
            self.workers,
            "worker",
            self.per_worker_memory(),
        )
        .holding(format!(
            "a block of {} decoded cells, {} of group state",
            r.read.block_cells(),
            human_readable_size(r.state_bytes())
        ))
        .and(r.shared_memory(), "the output and its keys")
        .and(self.read_ahead.memory(), "chunks read ahead")
        .and(self.broadcasts.memory(), "tables joined in")
        .advice(
            "raise the limit, group by fewer dimensions or lower \
             zarrfusion.target_partition_bytes",
        )
    }
}

impl DisplayAs for DenseReductionExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let r = &self.reduction;
        let group: Vec<String> = r
            .keys
            .iter()
            .map(|k| match &k.expr {
                Some(expr) => expr.to_string(),
                None => r.read.table.dims[k.dim].name.clone(),
            })
            .collect();
        // "(fused)": the argument is evaluated piece by piece as it is folded.
        let aggregates: Vec<String> = r
            .aggregates
            .iter()
            .map(|a| match a.fused {
                Some(_) => format!("{} (fused)", a.label),
                None => a.label.clone(),
            })
            .collect();
        write!(
            f,
            "DenseReductionExec: store={}, group=[{}], aggr=[{}], groups={}, rows={}, \
             blocks={} of shape {:?}, workers={}, projected_memory={}{}",
            r.read.table.store,
            group.join(", "),
            aggregates.join(", "),
            r.space.num_groups(),
            r.read.selection.num_cells(),
            r.read.blocks.num_blocks(),
            r.read.blocks.block_shape(),
            self.workers,
            human_readable_size(self.projected_memory()),
            self.read_ahead,
        )?;
        if r.run_rows < RUN_ROWS {
            // Shortened to fit the memory limit.
            write!(f, ", runs of {} rows", r.run_rows)?;
        }
        if let Some(bands) = r.bands {
            write!(
                f,
                ", bands={} of {} keys of {}",
                r.num_bands(),
                bands.keys,
                r.read.table.dims[bands.dim].name
            )?;
            if bands.at_once > 1 {
                write!(f, ", {} at once", bands.at_once)?;
            }
        }
        if r.columns.is_some() {
            // Key columns not given are never built.
            let names: Vec<&str> = self
                .schema
                .fields()
                .iter()
                .map(|f| f.name().as_str())
                .collect();
            write!(f, ", gives=[{}]", names.join(", "))?;
        }
        write!(f, "{}", self.broadcasts.display(&r.read.table.dim_names()))?;
        if let Some(predicate) = &r.predicate {
            write!(f, ", predicate={predicate}")?;
        }
        let (what, tasks) = match self.emit {
            Emit::Results => (String::new(), None),
            Emit::States { tasks, positioned } => {
                let by = if positioned { " by group position" } else { "" };
                (format!(", emits=partial states{by}"), Some(tasks))
            }
            Emit::Bands { tasks } => (", emits=the results of its bands".to_string(), Some(tasks)),
        };
        match tasks {
            None => {}
            Some(TASKS_OF_STAGE) => write!(f, "{what}, tasks=its stage's")?,
            Some(n) => write!(f, "{what}, tasks={n}")?,
        }
        if let Some(ordering) = self.properties.output_ordering() {
            write!(f, ", output_ordering=[{ordering}]")?;
        }
        Ok(())
    }
}

impl EmbeddedProjection for DenseReductionExec {
    fn with_projection(&self, projection: Option<Vec<usize>>) -> Result<Self> {
        match projection {
            Some(projection) => self.projected(&projection),
            None => {
                let all: Vec<usize> = (0..self.schema.fields().len()).collect();
                self.projected(&all)
            }
        }
    }
}

impl ExecutionPlan for DenseReductionExec {
    broadcast_children_methods!("DenseReductionExec");

    /// Takes in a projection above it that selects some of its columns
    /// (a query using only the aggregates of a `GROUP BY`): the keys not
    /// taken are never built. Not its partial states, merged whole.
    fn try_swapping_with_projection(
        &self,
        projection: &ProjectionExec,
    ) -> Result<Option<Arc<dyn ExecutionPlan>>> {
        if matches!(self.emit, Emit::States { .. }) {
            return Ok(None);
        }
        try_embed_projection(projection, self)
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        let r = &self.reduction;
        let exprs = r
            .aggregates
            .iter()
            .filter_map(|a| a.arg.as_ref())
            .chain(&r.predicate);
        for expr in exprs {
            if f(expr)? == TreeNodeRecursion::Stop {
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        Ok(TreeNodeRecursion::Continue)
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        if partition != 0 {
            return datafusion::common::internal_err!(
                "DenseReductionExec has one partition, asked for {partition}"
            );
        }
        let reduction = Arc::clone(&self.reduction);
        let schema = Arc::clone(&self.schema);
        let emit = self.emit;
        let run = self.blocks_of_task(&context)?;
        let workers = self.workers;
        let batch_size = context.session_config().batch_size().max(1);
        // The tables joined in reserve their own as they are held.
        let reservation = Reservation::new(
            "DenseReductionExec",
            &reduction.read.table.store,
            0,
            (self.projected_memory()).saturating_sub(self.broadcasts.memory()),
            &context,
            &self.metrics,
        );
        let taken = reservation.unless(!self.broadcasts.is_empty())?;
        let progress = context.session_config().get_extension::<ScanProgress>();
        // (A band's blocks are planned as it starts.)
        if let (Some(progress), None) = (&progress, reduction.bands) {
            progress.add_planned(run.end - run.start);
        }
        let meters = Arc::new(Meters {
            blocks_read: MetricBuilder::new(&self.metrics).counter("blocks_read", 0),
            bytes_decoded: MetricBuilder::new(&self.metrics).counter("bytes_decoded", 0),
            decode_time: MetricBuilder::new(&self.metrics).subset_time("decode_time", 0),
            fold_time: MetricBuilder::new(&self.metrics).subset_time("fold_time", 0),
            progress,
        });
        let output_rows = MetricBuilder::new(&self.metrics).output_rows(0);
        let (first, blocks) = (run.start, run.end - run.start);
        let stop = Arc::new(AtomicBool::new(false));
        // Workers take blocks in order from `next`: the window reads ahead
        // in that order, the blocks the workers read at once interleaved.
        // Reads ahead (of a remote store) once its memory is taken: after
        // the tables joined in are computed, if any.
        let start_read_ahead = {
            let (r, plan) = (Arc::clone(&reduction), self.read_ahead);
            move || {
                let boxes = Arc::clone(&r);
                plan.start(&r.read.table, &r.read.columns, run, workers, move |id| {
                    boxes_in_block(&boxes.read.selection, &boxes.read.blocks.block(id))
                })
            }
        };

        let broadcasts = self.broadcasts.clone();
        if reduction.bands.is_some() {
            return Ok(self.banded_results(
                self.bands_of_task(&context)?,
                (broadcasts, reservation, taken),
                (context, meters, output_rows),
                batch_size,
            ));
        }
        let result = async move {
            // The tables joined in, computed first and held while folding
            // (its one partition).
            let _held = broadcasts.hold(&context, 1).await?;
            // Its own memory, once their plans have run.
            let reservation = reservation.after(taken)?;
            let read_ahead = start_read_ahead();
            let _stop_on_drop = StopOnDrop(Arc::clone(&stop));
            let folding = Arc::clone(&reduction);
            let merged = tokio::task::spawn_blocking(move || {
                folding.fold_blocks(first..first + blocks, workers, &stop, &meters, read_ahead)
            })
            .await
            .map_err(|e| DataFusionError::ExecutionJoin(Box::new(e)))??;
            let batch = match emit {
                Emit::States { positioned, .. } => reduction.states(merged, &schema, positioned)?,
                Emit::Results | Emit::Bands { .. } => reduction.finish(merged, &schema)?,
            };
            drop(reservation);
            output_rows.add(batch.num_rows());
            Ok::<_, DataFusionError>(batch)
        };
        Ok(in_batches(Arc::clone(&self.schema), result, batch_size))
    }

    metered_plan_methods!(|exec| {
        let r = &exec.reduction;
        (!r.filters_groups() && exec.emit == Emit::Results).then(|| r.space.num_groups() as u64)
    });
}

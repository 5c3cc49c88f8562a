//! `RollingWindowExec`: the operator of a [`RollingWindow`].
//!
//! Each partition takes a run of chunk-aligned blocks visited with the
//! rolled dimension innermost, so that its blocks follow each other along
//! that dimension. For each box of the selection in a block, it decodes
//! the columns the window reads, lays each aggregate's argument out as
//! lines along the dimension (see [`frame`](super::frame)), with the
//! frames' overlap on both sides (the halo), computes every aggregate for
//! the box's cells, and streams the box's rows in C order with the
//! aggregates beside them.
//!
//! The lines are a ring along the dimension, kept from one box to the
//! next of the same run along it: the halo before a box is the end of the
//! box before it, left in place (read once, never copied), and the box's
//! cells are put after it. A window whose frames run to the series' end
//! walks it from there: blocks and boxes in reverse order along the
//! dimension, each box's positions put in the lines from its last, its
//! frames mirrored (so that a frame to the end is a running one), and its
//! rows sent in C order (only the order of the boxes is reversed). A partition's first box reads its halo before
//! from the store, and every box reads the halo after it (the frames'
//! FOLLOWING rows, the start of the next box). Memory per partition: two
//! decoded blocks, the ring (the argument lines of a block and its halo),
//! the halo read, the aggregates of two blocks (the batches in flight are
//! views of the one before's), and the batches in flight. A window whose
//! projected memory exceeds the session's limit holds less, a step at a
//! time, until it fits: its batches sent one by one, then blocks half as
//! long along the dimension and then across it (whole chunks still), then
//! half the partitions; one that does not fit even so is refused while
//! planning, with the numbers of the least it can hold.
//!
//! [`RollingWindow`]: super::RollingWindow

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, Float64Array, RecordBatch};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Schema, SchemaRef};
use datafusion::catalog::Session;
use datafusion::common::{human_readable_size, plan_err, DFSchema, DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::physical_planning_context::PhysicalPlanningContext;
use datafusion::logical_expr::{Cast, Expr, ExprSchemable};
use datafusion::physical_expr::expressions::{CastExpr, Column};
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::metrics::{Count, ExecutionPlanMetricsSet, MetricBuilder, Time};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties,
};
use datafusion::physical_planner::PhysicalPlanner;

use super::frame::{roll, Frame, Lines, RollOp, RollState, TILE};
use super::node::RollingWindow;
use super::running::{accumulate, add_positions, RunningState};
use crate::array::elementwise::{FusedExpr, PIECE};
use crate::memory::{Projection, Reservation};
use crate::plan_methods::{
    broadcast_children_methods, metered_plan_methods, no_expressions_method,
};
use crate::progress::ScanProgress;
use crate::table::{
    batch_slice, boxes_in_block, share_of_runs, shown_tasks, task_share, BatchRuns, BlockGrid,
    BlockRead, BlockTemporaries, BoxCells, BroadcastInputs, ReadsBroadcasts, RunStreamBuilder,
    RUNS_IN_FLIGHT, RUN_BATCHES, TASKS_OF_STAGE,
};
use crate::zarr::ChunkBufferPool;
use datafusion::execution::memory_pool::MemoryReservation;

/// One aggregate, planned.
#[derive(Debug, Clone)]
pub(crate) struct PhysicalRoll {
    pub(crate) op: RollOp,
    /// How it is shown (`avg(t2m) over [-23, +0]`).
    pub(crate) label: String,
    /// Which argument (index into the window's distinct arguments).
    pub(crate) arg: usize,
    pub(crate) frame: Frame,
    pub(crate) output_type: DataType,
}

/// What a [`RollingWindowExec`] is made of (as planned here, or as it
/// travels to a cluster's worker).
pub(crate) struct RollingParts {
    /// The columns read (in the order of the window's input), the cells
    /// and their blocks.
    pub(crate) read: BlockRead,
    /// The dimension rolled along.
    pub(crate) dim: usize,
    /// Those the arguments read: places among the columns read.
    pub(crate) arg_places: Vec<usize>,
    /// The window's input columns, over the columns read.
    pub(crate) outputs: Vec<Arc<dyn PhysicalExpr>>,
    /// The distinct arguments, over the columns at `arg_places`.
    pub(crate) args: Vec<Arc<dyn PhysicalExpr>>,
    pub(crate) aggregates: Vec<PhysicalRoll>,
    /// The rows sent: the input columns, then the aggregates.
    pub(crate) schema: SchemaRef,
    pub(crate) partitions: usize,
    pub(crate) batch_size: usize,
    /// The tasks of a cluster's stage the blocks are dealt to (1: all of
    /// them here).
    pub(crate) tasks: usize,
    /// Whether the dimension is walked from its end (the frames, in
    /// `aggregates`, are then mirrored: see [`GridFrame::walked`]).
    ///
    /// [`GridFrame::walked`]: super::GridFrame::walked
    pub(crate) backward: bool,
    /// Whether its blocks and partitions may be made smaller to fit the
    /// memory limit: planned in this session (a cluster's worker keeps
    /// those it was sent, which its stage's other tasks share).
    pub(crate) refit: bool,
}

/// Everything a partition needs, shared by all of them.
#[derive(Debug)]
pub(crate) struct Rolling {
    /// The columns read, the cells and their blocks.
    pub(crate) read: BlockRead,
    pub(crate) dim: usize,
    /// Those the arguments read: places among `columns`, table columns,
    /// and their schema.
    pub(crate) arg_places: Vec<usize>,
    pub(crate) arg_columns: Vec<usize>,
    pub(crate) arg_schema: SchemaRef,
    /// The window's input columns, over `input_schema`.
    pub(crate) outputs: Vec<Arc<dyn PhysicalExpr>>,
    /// The distinct arguments, over `arg_schema`, and whether each is a
    /// number (else only its NULLs count).
    pub(crate) args: Vec<(Arc<dyn PhysicalExpr>, bool)>,
    /// Each argument as a fused expression, when it is `float64`
    /// arithmetic (see [`FusedExpr`]).
    fused: Vec<Option<FusedExpr>>,
    /// Each argument's `float32` column in `arg_schema`, when it is one
    /// (as it is, or widened): its lines hold the column's values as
    /// `f32` (see [`Lines::holding`]).
    single: Vec<Option<usize>>,
    pub(crate) aggregates: Vec<PhysicalRoll>,
    /// The rows sent: the input columns, then the aggregates.
    pub(crate) output_schema: SchemaRef,
    /// Positions the frames reach before and after a cell, at most (in
    /// the walk's order).
    pub(crate) before: u64,
    pub(crate) after: u64,
    /// Whether the dimension is walked from its end.
    pub(crate) backward: bool,
}

/// The physical operator of a [`RollingWindow`].
#[derive(Debug)]
pub struct RollingWindowExec {
    rolling: Arc<Rolling>,
    partitions: usize,
    batch_size: usize,
    /// Batches sent to the stream at once ([`RUN_BATCHES`], or one where
    /// memory is short).
    run_batches: usize,
    /// The tasks of a cluster's stage its blocks are dealt to (1: all here).
    tasks: usize,
    /// Whether its blocks and partitions may still shrink to fit the
    /// memory limit (see [`RollingParts::refit`]).
    refit: bool,
    /// The small sides of the broadcast columns read: the children.
    broadcasts: BroadcastInputs,
    schema: SchemaRef,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl RollingWindowExec {
    /// Plans `node`: its selection, blocks, expressions and memory.
    ///
    /// Refuses (before anything runs) a window whose projected memory
    /// exceeds the session's memory limit.
    pub fn plan(
        node: &RollingWindow,
        planner: &dyn PhysicalPlanner,
        session: &dyn Session,
        planning: &PhysicalPlanningContext,
    ) -> Result<Self> {
        let table = &node.read.table;

        // The distinct arguments, and the columns everything reads.
        let mut arg_exprs: Vec<&Expr> = Vec::new();
        for a in &node.aggregates {
            if !arg_exprs.contains(&&a.arg) {
                arg_exprs.push(&a.arg);
            }
        }
        let arg_names = column_names(arg_exprs.iter().copied());
        let mut all_names = column_names(node.columns.iter());
        all_names.extend(arg_names.iter().cloned());
        let (mut fields, mut columns) = (Vec::new(), Vec::new());
        let (mut arg_fields, mut arg_places, mut arg_columns) =
            (Vec::new(), Vec::new(), Vec::new());
        for (qualifier, field) in node.read.input_schema.iter() {
            if !all_names.contains(field.name()) {
                continue;
            }
            let column = table.schema.index_of(field.name())?;
            if arg_names.contains(field.name()) {
                arg_fields.push((qualifier.cloned(), Arc::clone(field)));
                arg_places.push(columns.len());
                arg_columns.push(column);
            }
            fields.push((qualifier.cloned(), Arc::clone(field)));
            columns.push(column);
        }
        let input_df = DFSchema::new_with_metadata(fields, Default::default())?;
        let arg_df = DFSchema::new_with_metadata(arg_fields, Default::default())?;
        let outputs = node
            .columns
            .iter()
            .map(|e| planner.create_physical_expr(e, &input_df, session, planning))
            .collect::<Result<Vec<_>>>()?;
        let args = arg_exprs
            .iter()
            .map(|e| {
                planner.create_physical_expr(unwidened(e, &arg_df), &arg_df, session, planning)
            })
            .collect::<Result<Vec<_>>>()?;
        let n_columns = node.columns.len();
        let backward = node.backward();
        let aggregates = node
            .aggregates
            .iter()
            .enumerate()
            .map(|(i, a)| {
                let Some(frame) = a.frame.walked(backward) else {
                    return plan_err!(
                        "a rolling window over {} has frames from the series' start and to its \
                         end ({a}): not one walk along the dimension",
                        table.store
                    );
                };
                Ok(PhysicalRoll {
                    op: a.op,
                    label: a.to_string(),
                    arg: arg_exprs.iter().position(|e| *e == &a.arg).unwrap_or(0),
                    frame,
                    output_type: node.schema.field(n_columns + i).data_type().clone(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let (read, memory_limit, parallelism) =
            node.read
                .block_read(columns, session, BlockTemporaries::default())?;
        let partitions = (read.blocks.num_blocks() as usize).clamp(1, parallelism);
        let parts = RollingParts {
            read,
            dim: node.dim,
            arg_places,
            outputs,
            args,
            aggregates,
            schema: Arc::new(node.schema.as_arrow().clone()),
            partitions,
            batch_size: session.config().batch_size().max(1),
            tasks: 1,
            backward,
            refit: true,
        };
        Self::from_parts(parts, memory_limit)
    }

    /// The operator of `parts`; refused (before anything runs) when its
    /// projected memory exceeds `memory_limit`, or when its parts do not
    /// fit together (columns, arguments or aggregates out of range).
    pub(crate) fn from_parts(parts: RollingParts, memory_limit: Option<usize>) -> Result<Self> {
        let RollingParts {
            read,
            dim,
            arg_places,
            outputs,
            args,
            aggregates,
            schema,
            partitions,
            batch_size,
            tasks,
            backward,
            refit,
        } = parts;
        let (table, columns) = (&read.table, &read.columns);
        let store = &table.store;
        let width = table.schema.fields().len();
        let n_dims = table.dims.len();
        if dim >= n_dims
            || arg_places.iter().any(|&p| p >= columns.len())
            || aggregates.iter().any(|a| a.arg >= args.len())
            || schema.fields().len() != outputs.len() + aggregates.len()
        {
            return plan_err!(
                "a rolling window over {store} whose parts do not fit together: along dimension \
                 {dim} of {n_dims}, columns {columns:?} of {width}, arguments at {arg_places:?}, \
                 {} arguments and {} aggregates for {} output columns",
                args.len(),
                aggregates.len(),
                schema.fields().len()
            );
        }
        let arg_columns: Vec<usize> = arg_places.iter().map(|&p| columns[p]).collect();
        let arg_schema = Arc::new(table.schema.project(&arg_columns)?);
        let args = args
            .into_iter()
            .map(|arg| {
                let numeric = matches!(
                    arg.data_type(&arg_schema)?,
                    DataType::Float32 | DataType::Float64
                );
                Ok((arg, numeric))
            })
            .collect::<Result<Vec<_>>>()?;
        let fused = (args.iter())
            .map(|(arg, _)| FusedExpr::compile(arg, &arg_schema))
            .collect();
        let single = (args.iter())
            .map(|(arg, _)| float32_column(arg, &arg_schema))
            .collect();
        let before = (aggregates.iter())
            .map(|a| a.frame.before())
            .max()
            .unwrap_or(0);
        let after = (aggregates.iter())
            .map(|a| a.frame.after())
            .max()
            .unwrap_or(0);
        let rolling = Rolling {
            read,
            dim,
            arg_places,
            arg_columns,
            arg_schema,
            outputs,
            args,
            fused,
            single,
            aggregates,
            output_schema: Arc::clone(&schema),
            before,
            after,
            backward,
        };
        let exec = Self::with_parts(Arc::new(rolling), partitions, batch_size, tasks);
        Self { refit, ..exec }.fitted(memory_limit)
    }

    /// This window holding less until it fits `memory_limit` (see
    /// [`ReadsBroadcasts::hold_less`]); refused, with the numbers of the
    /// least it can hold, when it cannot.
    fn fitted(mut self, memory_limit: Option<usize>) -> Result<Self> {
        if let Some(limit) = memory_limit {
            while self.check_memory(limit).is_err() && self.hold_less() {}
            self.check_memory(limit)?;
        }
        Ok(self)
    }

    /// A copy of this window joining `broadcasts` in (its children
    /// replaced).
    fn rejoined(&self, broadcasts: BroadcastInputs) -> Self {
        Self {
            broadcasts,
            ..self.with_tasks(self.tasks)
        }
    }

    fn with_parts(
        rolling: Arc<Rolling>,
        partitions: usize,
        batch_size: usize,
        tasks: usize,
    ) -> Self {
        let schema = Arc::clone(&rolling.output_schema);
        let properties = Arc::new(PlanProperties::new(
            EquivalenceProperties::new(Arc::clone(&schema)),
            Partitioning::UnknownPartitioning(partitions),
            EmissionType::Incremental,
            Boundedness::Bounded,
        ));
        Self {
            rolling,
            partitions,
            batch_size: batch_size.max(1),
            run_batches: RUN_BATCHES,
            tasks,
            refit: false,
            broadcasts: BroadcastInputs::default(),
            schema,
            properties,
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }

    /// This window with its blocks dealt to `tasks` tasks of a cluster's
    /// stage, in contiguous runs (each task's split among its partitions).
    pub fn with_tasks(&self, tasks: usize) -> Self {
        Self {
            broadcasts: self.broadcasts.clone(),
            run_batches: self.run_batches,
            refit: self.refit && tasks == 1,
            ..Self::with_parts(
                Arc::clone(&self.rolling),
                self.partitions,
                self.batch_size,
                tasks,
            )
        }
    }

    /// This window with its blocks dealt to the tasks of its cluster's
    /// stage, however many the stage has (a window whose small sides are
    /// its inputs is not its stage's leaf, so the stage does not say).
    pub fn with_tasks_of_stage(&self) -> Self {
        self.with_tasks(TASKS_OF_STAGE)
    }

    /// The tasks its blocks are dealt to (1: all of them here).
    pub fn tasks(&self) -> usize {
        self.tasks
    }

    /// Rows per batch.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// What it reads: the table, the columns, the cells and their blocks.
    pub fn read(&self) -> &BlockRead {
        &self.rolling.read
    }

    /// The bytes of the columns it decodes, every selected cell once.
    pub fn decoded_bytes(&self) -> u64 {
        let r = &self.rolling;
        (r.read.selection.num_cells()).saturating_mul(r.read.row_bytes() as u64)
    }

    /// Memory one partition holds at its peak: two decoded blocks, the
    /// ring (the argument lines of a block with its overlap, kept from one
    /// block to the next; and the extremum passes' tile), the halo read,
    /// the aggregates of a block, their running states, and the batches in
    /// flight, which are views of the block before's aggregates and keep
    /// them alive while the next block rolls.
    pub fn per_partition_memory(&self) -> usize {
        let shape = self.rolling.read.blocks.block_shape();
        let cells = shape.iter().fold(1usize, |p, &n| {
            p.saturating_mul(usize::try_from(n).unwrap_or(usize::MAX))
        });
        let sent: usize = (self.rolling.aggregates.iter())
            .map(|a| a.output_type.primitive_width().unwrap_or(8) + 1)
            .sum();
        (self
            .rolling
            .partition_memory(shape, (self.batch_size, self.run_batches)))
        .saturating_add(cells.saturating_mul(sent))
    }

    /// What every partition reads and computes.
    pub(crate) fn rolling(&self) -> &Arc<Rolling> {
        &self.rolling
    }

    /// The number of partitions (each a run of blocks along the dimension).
    pub(crate) fn partitions(&self) -> usize {
        self.partitions
    }

    /// Memory the whole window is projected to hold at its peak: its
    /// partitions' and the broadcasts' (held once for all).
    pub fn projected_memory(&self) -> usize {
        self.projection().total()
    }

    /// The small sides of the broadcast columns it reads.
    pub fn broadcasts(&self) -> &BroadcastInputs {
        &self.broadcasts
    }

    /// The blocks partition `partition` reads (in the order along the
    /// dimension): its share of all of them, or on a cluster of the run of
    /// the task it runs as (from its `DistributedTaskContext`), in the
    /// units [`Rolling::share_unit`] says.
    fn partition_blocks(&self, partition: usize, context: &Arc<TaskContext>) -> Result<Range<u64>> {
        let all = 0..self.rolling.read.blocks.num_blocks();
        let store = &self.rolling.read.table.store;
        let run = task_share("RollingWindowExec", store, self.tasks, all, context)?;
        let n = self.partitions as u64;
        let unit = self.rolling.share_unit(&self.rolling.read.blocks, n);
        Ok(share_of_runs(run, partition as u64, n, unit))
    }
}

/// `arg` without a cast of a `float32` column to `float64` (the lines
/// widen its cells as they take them, without a copy of the column).
fn unwidened<'a>(arg: &'a Expr, schema: &DFSchema) -> &'a Expr {
    match arg {
        Expr::Cast(Cast { expr, field }) if *field.data_type() == DataType::Float64 => {
            match expr.get_type(schema) {
                Ok(DataType::Float32) if matches!(**expr, Expr::Column(_)) => expr,
                _ => arg,
            }
        }
        _ => arg,
    }
}

/// The names of the columns `exprs` read.
/// The `float32` column `arg` reads, as it is or widened (`CAST(t2m AS
/// Float64)`, as SQL's coercion makes `avg(t2m)`'s argument), when it is
/// one.
fn float32_column(arg: &Arc<dyn PhysicalExpr>, schema: &Schema) -> Option<usize> {
    let column = match arg.downcast_ref::<CastExpr>() {
        Some(cast) if cast.cast_type() == &DataType::Float64 => cast.expr(),
        Some(_) => return None,
        None => arg,
    };
    let column = column.downcast_ref::<Column>()?;
    let field = schema.fields().get(column.index())?;
    (field.data_type() == &DataType::Float32).then_some(column.index())
}

fn column_names<'a>(exprs: impl Iterator<Item = &'a Expr>) -> HashSet<String> {
    let mut names = HashSet::new();
    for e in exprs {
        names.extend(e.column_refs().into_iter().map(|c| c.name.clone()));
    }
    names
}

/// The metrics a partition reports to.
pub(crate) struct Meters {
    output_rows: Count,
    bytes_decoded: Count,
    halo_positions_read: Count,
    prefix_positions_read: Count,
    decode_time: Time,
    roll_time: Time,
}

impl Meters {
    /// Partition `partition`'s meters in `metrics`.
    pub(crate) fn new(metrics: &ExecutionPlanMetricsSet, partition: usize) -> Self {
        Self {
            output_rows: MetricBuilder::new(metrics).output_rows(partition),
            bytes_decoded: MetricBuilder::new(metrics).counter("bytes_decoded", partition),
            halo_positions_read: MetricBuilder::new(metrics)
                .counter("halo_positions_read", partition),
            prefix_positions_read: MetricBuilder::new(metrics)
                .counter("prefix_positions_read", partition),
            decode_time: MetricBuilder::new(metrics).subset_time("decode_time", partition),
            roll_time: MetricBuilder::new(metrics).subset_time("roll_time", partition),
        }
    }
}

/// The lines of one run of boxes along the dimension (boxes that differ
/// only there), kept from one box to the next: the positions a box leaves
/// to the next (the frames' overlap, and one more: the cells leaving the
/// first frame of the next box) stay in the ring while the next box is put
/// after them, and so does each aggregate's running state. Positions are
/// the series' (selected positions of the dimension, counted from
/// `before` before the first).
struct Ring {
    /// Each argument's lines.
    lines: Vec<Lines>,
    /// Each aggregate's state.
    states: Vec<AggState>,
    /// The positions whose cells the lines hold (missing ones included:
    /// before the series' start, after its end).
    held: Range<usize>,
}

/// What an aggregate carries from one box to the next along the
/// dimension: a sliding frame's running sums, or the totals of a frame
/// from the series' start.
enum AggState {
    Sliding(RollState),
    Running(RunningState),
}

impl AggState {
    /// No state for `aggregate` over `lanes` lanes.
    fn new(aggregate: &PhysicalRoll, lanes: usize) -> Self {
        if aggregate.frame.is_running() {
            Self::Running(RunningState::new(lanes, aggregate.op))
        } else {
            Self::Sliding(RollState::new(lanes, aggregate.op))
        }
    }

    fn forget(&mut self) {
        match self {
            Self::Sliding(state) => state.forget(),
            Self::Running(state) => state.forget(),
        }
    }

    /// Bytes per lane.
    fn lane_bytes(aggregate: &PhysicalRoll) -> usize {
        if aggregate.frame.is_running() {
            RunningState::LANE_BYTES
        } else {
            RollState::LANE_BYTES
        }
    }
}

/// The rings of the boxes of the current column of blocks, and those of
/// the column before, for reuse (same shapes: no new allocation).
#[derive(Default)]
struct Rings {
    active: HashMap<Vec<Range<u64>>, Ring>,
    spare: Vec<Ring>,
}

impl Rings {
    /// A new column of blocks: the rings held are of no use but their memory.
    fn next_column(&mut self) {
        self.spare = self.active.drain().map(|(_, ring)| ring).collect();
    }

    /// The ring of the boxes keyed `key`: kept, else lines of the
    /// arguments (`f32` values for those with a `single` column) of
    /// `outer x len x inner` cells holding nothing and no
    /// states of `aggregates` (reused from the column before when one has
    /// that shape; otherwise the column before's are freed first, so that
    /// at most one column's rings are held).
    fn take(
        &mut self,
        key: &[Range<u64>],
        single: &[Option<usize>],
        aggregates: &[PhysicalRoll],
        shape: [usize; 3],
    ) -> Ring {
        let [outer, len, inner] = shape;
        if let Some(ring) = self.active.remove(key) {
            return ring;
        }
        let fits = |r: &Ring| (r.lines.iter()).all(|l| l.has_shape(outer, len, inner));
        match self.spare.iter().position(fits) {
            Some(k) => {
                let mut ring = self.spare.swap_remove(k);
                ring.held = 0..0;
                ring.states.iter_mut().for_each(AggState::forget);
                ring
            }
            None => {
                self.spare.clear();
                Ring {
                    lines: (single.iter())
                        .map(|s| Lines::holding(outer, len, inner, s.is_some()))
                        .collect(),
                    states: (aggregates.iter())
                        .map(|a| AggState::new(a, outer * inner))
                        .collect(),
                    held: 0..0,
                }
            }
        }
    }
}

/// Selected positions of `ranges` (sorted, disjoint) before `position`.
fn ordinal(ranges: &[Range<u64>], position: u64) -> u64 {
    (ranges.iter())
        .map(|r| r.end.min(position).saturating_sub(r.start))
        .sum()
}

/// Selected positions of `ranges` (sorted, disjoint) before `position`,
/// at most `n` of them, as ranges in order.
fn selected_before(ranges: &[Range<u64>], position: u64, n: u64) -> Vec<Range<u64>> {
    let mut out = Vec::new();
    let mut left = n;
    for r in ranges.iter().rev() {
        if left == 0 {
            break;
        }
        let end = r.end.min(position);
        if r.start >= end {
            continue;
        }
        let start = end - (end - r.start).min(left);
        left -= end - start;
        out.push(start..end);
    }
    out.reverse();
    out
}

/// Selected positions of `ranges` (sorted, disjoint) from `position` on,
/// at most `n` of them, as ranges in order.
fn selected_after(ranges: &[Range<u64>], position: u64, n: u64) -> Vec<Range<u64>> {
    let mut out = Vec::new();
    let mut left = n;
    for r in ranges {
        if left == 0 {
            break;
        }
        let start = r.start.max(position);
        if start >= r.end {
            continue;
        }
        let end = start + (r.end - start).min(left);
        left -= end - start;
        out.push(start..end);
    }
    out
}

impl Rolling {
    /// Reads the partition's blocks `run` and sends their rows.
    fn run_partition(
        &self,
        run: Range<u64>,
        batch_size: usize,
        runs: &mut BatchRuns,
        meters: Meters,
        progress: Option<&ScanProgress>,
    ) -> Result<()> {
        let along = self.read.blocks.block_shape()[self.dim];
        let mut roller = Roller::new(self, along, batch_size, meters);
        for j in self.walked(run) {
            let extent = self.read.blocks.block_along(self.dim, j);
            roller.enter(&extent);
            let mut boxes = boxes_in_block(&self.read.selection, &extent);
            if self.backward {
                boxes.reverse();
            }
            for b in boxes {
                // A run of batches never holds two boxes'.
                if !roller.roll(&b, &mut |batch| Ok(runs.push(batch)))? || !runs.flush() {
                    return Ok(());
                }
            }
            if let Some(progress) = progress {
                progress.add_done(1);
            }
        }
        Ok(())
    }

    /// Memory one partition holds at its peak over blocks of `shape` with
    /// batches of `batch_size` rows sent `run_batches` at a time: two
    /// decoded blocks, the ring (the
    /// argument lines of a block with its overlap, kept from one block to
    /// the next; and the extremum passes' tile), the halo read, the
    /// aggregates of a block, their running states, and the batches in
    /// flight.
    pub(crate) fn partition_memory(
        &self,
        shape: &[u64],
        (batch_size, run_batches): (usize, usize),
    ) -> usize {
        let cells = usize::try_from(shape.iter().fold(1u64, |p, &n| p.saturating_mul(n)))
            .unwrap_or(usize::MAX);
        let along = shape[self.dim].max(1) as usize;
        let section = cells / along;
        let halo = (self.before + self.after) as usize;
        // The ring: a block, its halo, and the cells leaving the first frame.
        let held = along.saturating_add(halo).saturating_add(1);
        let width = |schema: &SchemaRef| -> usize {
            schema
                .fields()
                .iter()
                .map(|f| f.data_type().primitive_width().unwrap_or(16))
                .sum()
        };
        let extremes = (self.aggregates.iter())
            .filter(|a| matches!(a.op, RollOp::Min | RollOp::Max))
            .count();
        let row_bytes = width(&self.output_schema);
        // Saturating: the shape and frames may come from a plan received
        // over the network; a sum that saturates is refused by the limit.
        let product = |terms: &[usize]| terms.iter().fold(1usize, |p, &t| p.saturating_mul(t));
        [
            product(&[2, cells, width(&self.read.schema)]),
            product(&[
                section,
                held,
                (self.single.iter())
                    .map(|s| Lines::cell_bytes(s.is_some()))
                    .sum(),
            ]),
            product(&[extremes, held, TILE.min(section), 8]),
            product(&[section, halo, width(&self.arg_schema)]),
            product(&[cells, 8 * self.aggregates.len() + 16]),
            product(&[
                section,
                self.aggregates.iter().map(AggState::lane_bytes).sum(),
            ]),
            // A run of batches never spans two blocks.
            product(&[
                RUNS_IN_FLIGHT,
                batch_size.saturating_mul(run_batches).min(cells),
                row_bytes,
            ]),
        ]
        .into_iter()
        .fold(0usize, usize::saturating_add)
    }

    /// The same window over smaller blocks, whole chunks of the table
    /// still: half as long along its dimension, else (one chunk long
    /// there) half as many chunks along the other dimension that has the
    /// most (smaller sections: a shorter ring); `None` when a block is one
    /// chunk.
    fn with_smaller_blocks(&self) -> Option<Self> {
        let read = &self.read;
        let chunks = read.table.chunk_shape();
        let mut shape = read.blocks.block_shape().to_vec();
        let count = |d: usize| shape[d] / chunks.get(d).copied().unwrap_or(1).max(1);
        let d = match count(self.dim) {
            0 | 1 => (0..shape.len())
                .filter(|&d| d != self.dim)
                .max_by_key(|&d| count(d))
                .filter(|&d| count(d) > 1)?,
            _ => self.dim,
        };
        let halved = count(d).div_ceil(2) * chunks[d].max(1);
        shape[d] = halved;
        let grid = BlockGrid::with_block_shape(&read.table.shape(), shape, &read.selection).ok()?;
        let columns = read.columns.clone();
        let read = BlockRead::new(
            Arc::clone(&read.table),
            columns,
            read.selection.clone(),
            grid,
        );
        Some(Self {
            read: read.ok()?,
            arg_places: self.arg_places.clone(),
            arg_columns: self.arg_columns.clone(),
            arg_schema: Arc::clone(&self.arg_schema),
            outputs: self.outputs.clone(),
            args: self.args.clone(),
            fused: self.fused.clone(),
            single: self.single.clone(),
            aggregates: self.aggregates.clone(),
            output_schema: Arc::clone(&self.output_schema),
            ..*self
        })
    }

    /// Whether a frame starts at the series' start (in the walk's order).
    fn is_running(&self) -> bool {
        self.aggregates.iter().any(|a| a.frame.is_running())
    }

    /// `run` (blocks or chunks visited along the dimension) in the walk's
    /// order.
    pub(crate) fn walked(&self, run: Range<u64>) -> Box<dyn Iterator<Item = u64>> {
        if self.backward {
            Box::new(run.rev())
        } else {
            Box::new(run)
        }
    }

    /// Whether the dimension is walked from its end.
    pub(crate) fn backward(&self) -> bool {
        self.backward
    }

    /// The selected positions of the dimension rolled along.
    fn ranges(&self) -> &[Range<u64>] {
        self.read.selection.ranges(self.dim)
    }

    /// Selected positions walked before those of `r` (positions of the
    /// dimension).
    fn walked_before(&self, r: &Range<u64>) -> u64 {
        let ranges = self.ranges();
        if self.backward {
            ordinal(ranges, u64::MAX) - ordinal(ranges, r.end)
        } else {
            ordinal(ranges, r.start)
        }
    }

    /// At most `n` selected positions walked right before `r`, as ranges
    /// of the dimension in the walk's order (each read in it: see
    /// [`Rolling::read_halo`]).
    fn walked_just_before(&self, r: &Range<u64>, n: u64) -> Vec<Range<u64>> {
        if self.backward {
            let mut pieces = selected_after(self.ranges(), r.end, n);
            pieces.reverse();
            pieces
        } else {
            selected_before(self.ranges(), r.start, n)
        }
    }

    /// At most `n` selected positions walked right after `r`, as
    /// [`Rolling::walked_just_before`] gives them.
    fn walked_just_after(&self, r: &Range<u64>, n: u64) -> Vec<Range<u64>> {
        if self.backward {
            let mut pieces = selected_before(self.ranges(), r.start, n);
            pieces.reverse();
            pieces
        } else {
            selected_after(self.ranges(), r.end, n)
        }
    }

    /// The first `n` selected positions of the walk, in its order.
    fn walk_start(&self, n: u64) -> Vec<Range<u64>> {
        if self.backward {
            let mut pieces = selected_before(self.ranges(), u64::MAX, n);
            pieces.reverse();
            pieces
        } else {
            selected_after(self.ranges(), 0, n)
        }
    }

    /// The blocks of `grid` (visited along the dimension) that one of
    /// `shares` shares keeps together: a column of blocks along the
    /// dimension when a frame starts at the series' start and there are as
    /// many columns as shares (the totals then go from block to block, and
    /// the data is read once); else 1 (when there are fewer columns than
    /// shares, columns are cut so that every core gets work: a share that
    /// starts mid-series first adds the values before it, read again).
    pub(crate) fn share_unit(&self, grid: &BlockGrid, shares: u64) -> u64 {
        let column = grid.count_along(self.dim).max(1);
        if self.is_running() && grid.num_blocks().div_ceil(column) >= shares {
            column
        } else {
            1
        }
    }

    /// Starts the running totals of box `b` (at position `at` of the
    /// ring), which does not continue the box before: each holds the
    /// series' cells before its first frame's new ones. None at the
    /// series' start; from its middle (the first box of a task whose run
    /// starts mid-column), the cells before are read from the store, a
    /// block's length at a time, through the ring's lines (free until the
    /// box is put in them).
    fn start_running(
        &self,
        b: &[Range<u64>],
        at: usize,
        ring: &mut Ring,
        buffers: &ChunkBufferPool,
        meters: &Meters,
    ) -> Result<()> {
        let d = self.dim;
        let first = self.walked_before(&b[d]) as i64;
        // The series' positions each one's totals start with.
        let mut wanted: Vec<(usize, u64)> = Vec::new();
        for (k, (a, state)) in self.aggregates.iter().zip(&mut ring.states).enumerate() {
            if let AggState::Running(state) = state {
                let lag = a.frame.end.min(0);
                state.start(a.op, at as i64 - 1 + lag);
                let n = (first + lag).max(0) as u64;
                if n > 0 {
                    wanted.push((k, n));
                }
            }
        }
        let along = (self.read.blocks.block_shape()[d].max(1))
            .min(ring.lines.first().map_or(1, |l| l.len() as u64).max(1));
        // The longest prefix is read once; each aggregate adds its own
        // first positions of it, in the series' order.
        let longest = wanted.iter().map(|&(_, n)| n).max().unwrap_or(0);
        let mut done = 0u64;
        for mut range in self.walk_start(longest) {
            while !range.is_empty() {
                // A block's length of the range, in the walk's order.
                let len = (range.end - range.start).min(along);
                let piece = if self.backward {
                    range.end -= len;
                    range.end..range.end + len
                } else {
                    range.start += len;
                    range.start - len..range.start
                };
                let read = (meters, &meters.prefix_positions_read);
                self.read_halo(
                    b,
                    std::slice::from_ref(&piece),
                    0,
                    &mut ring.lines,
                    buffers,
                    read,
                )?;
                for &(k, n) in wanted.iter().filter(|&&(_, n)| n > done) {
                    let (a, state) = (&self.aggregates[k], &mut ring.states[k]);
                    if let AggState::Running(state) = state {
                        let used = len.min(n - done) as usize;
                        add_positions(a.op, &ring.lines[a.arg], 0..used, state)?;
                    }
                }
                done += len;
            }
        }
        Ok(())
    }

    /// The aggregates as shown, and the positions the frames reach before
    /// and after a cell.
    pub(crate) fn describe(&self) -> String {
        let aggregates: Vec<&str> = self.aggregates.iter().map(|a| a.label.as_str()).collect();
        format!(
            "rolled along {}{} ([{}], overlap {}+{})",
            self.read.table.dims[self.dim].name,
            if self.backward { " from its end" } else { "" },
            aggregates.join(", "),
            self.before,
            self.after
        )
    }

    /// Puts the arguments of `batch` (cells `offset..` of a box of `n`
    /// positions placed at position `at` of the lines) into `lines`, one
    /// per argument: a fused argument (`float64` arithmetic, as an
    /// anomaly's `t2m - c`) piece by piece, straight from the batch's
    /// columns; another (or a batch with NULLs) through Arrow's kernels,
    /// as `float64` or `float32` cells.
    fn put_args(
        &self,
        batch: &RecordBatch,
        lines: &mut [Lines],
        (at, n, offset): (usize, usize, usize),
    ) -> Result<()> {
        let rows = batch.num_rows();
        let args = (self.args.iter()).zip(&self.fused).zip(&self.single);
        for (lines, (((arg, numeric), fused), single)) in lines.iter_mut().zip(args) {
            if let Some(column) = single {
                let values = batch.column(*column);
                lines.put_walked(at, n, offset, values, self.backward)?;
                continue;
            }
            let fused = fused.as_ref().and_then(|f| Some((f, f.inputs(batch)?)));
            if let Some((fused, inputs)) = fused {
                let (mut piece, mut scratch) = ([0.0; PIECE], fused.scratch());
                for start in (0..rows).step_by(PIECE) {
                    let piece = &mut piece[..PIECE.min(rows - start)];
                    fused.eval(&inputs, start, piece, &mut scratch);
                    lines.put_numbers((at, n, offset + start), piece, self.backward)?;
                }
                continue;
            }
            let values = arg.evaluate(batch)?.into_array(rows)?;
            let values = if *numeric {
                values
            } else {
                // Only its NULLs count.
                let ones = vec![1.0; values.len()];
                let nulls = values.logical_nulls();
                Arc::new(Float64Array::new(ones.into(), nulls)) as ArrayRef
            };
            lines.put_walked(at, n, offset, &values, self.backward)?;
        }
        Ok(())
    }

    /// Reads the arguments over positions `pieces` of dimension `dim` of
    /// box `b` into `lines` from position `at` on, in the walk's order
    /// (each piece from its end, when walked backward).
    fn read_halo(
        &self,
        b: &[Range<u64>],
        pieces: &[Range<u64>],
        mut at: usize,
        lines: &mut [Lines],
        buffers: &ChunkBufferPool,
        (meters, positions_read): (&Meters, &Count),
    ) -> Result<()> {
        for piece in pieces {
            let mut extent = b.to_vec();
            extent[self.dim] = piece.clone();
            let timer = meters.decode_time.timer();
            let cells = BoxCells::read(&self.read.table, &self.arg_columns, &extent, buffers)?;
            timer.done();
            meters.bytes_decoded.add(cells.decoded_bytes() as usize);
            let n = (piece.end - piece.start) as usize;
            positions_read.add(n);
            // In pieces, so a broadcast column's rows are slices of its
            // dense array rather than one copy of the whole halo.
            let total = cells.num_cells() as usize;
            for start in (0..total).step_by(HALO_ROWS) {
                let len = HALO_ROWS.min(total - start);
                let batch = cells.batch(&self.arg_schema, start as u64, len as u64)?;
                self.put_args(&batch, lines, (at, n, start))?;
            }
            at += n;
        }
        Ok(())
    }
}

/// Rows of a halo's box put into the lines at a time.
const HALO_ROWS: usize = 8192;

/// One partition's (or one writer's) rolling of boxes in order: the rings
/// of the column of blocks being read (see [`Ring`]), the chunk buffers,
/// the meters.
pub(crate) struct Roller<'a> {
    rolling: &'a Rolling,
    rings: Rings,
    /// The column of blocks entered last (its extent, the rolled dimension
    /// left out).
    column: Option<Vec<Range<u64>>>,
    buffers: ChunkBufferPool,
    meters: Meters,
    batch_size: usize,
    /// The most positions along the rolled dimension a box it rolls has:
    /// its rings hold as many, with the frames' overlap.
    span: usize,
}

impl<'a> Roller<'a> {
    /// A roller of boxes of at most `span` positions along the rolled
    /// dimension (the window's blocks', or a COPY's chunks'), sending
    /// batches of `batch_size` rows, reporting to `meters`.
    pub(crate) fn new(rolling: &'a Rolling, span: u64, batch_size: usize, meters: Meters) -> Self {
        Self {
            rolling,
            rings: Rings::default(),
            column: None,
            buffers: ChunkBufferPool::new(),
            meters,
            batch_size: batch_size.max(1),
            span: usize::try_from(span).unwrap_or(usize::MAX).max(1),
        }
    }

    /// The decoded bytes it has read (its boxes and their halos).
    pub(crate) fn bytes_decoded(&self) -> u64 {
        self.meters.bytes_decoded.value() as u64
    }

    /// Enters the block `extent` (at most the blocks' shape): its boxes
    /// are rolled next. A block of another column than the one before
    /// leaves the rings held of no use (their memory is reused).
    pub(crate) fn enter(&mut self, extent: &[Range<u64>]) {
        let mut across = extent.to_vec();
        across[self.rolling.dim] = 0..0;
        if self.column.as_ref() != Some(&across) {
            self.rings.next_column();
            self.column = Some(across);
        }
    }

    /// Computes the rows of box `b` (inside the block last entered) and
    /// hands them to `sink`, in C order, in batches; returns `Ok(false)`
    /// when `sink` does (it wants no more).
    pub(crate) fn roll(
        &mut self,
        b: &[Range<u64>],
        sink: &mut dyn FnMut(RecordBatch) -> Result<bool>,
    ) -> Result<bool> {
        let Self {
            rolling,
            rings,
            buffers,
            meters,
            batch_size,
            span,
            ..
        } = self;
        let (rolling, batch_size, span) = (*rolling, *batch_size, *span);
        let d = rolling.dim;
        let lens: Vec<usize> = b.iter().map(|r| (r.end - r.start) as usize).collect();
        let outer: usize = lens[..d].iter().product();
        let inner: usize = lens[d + 1..].iter().product();
        let main = lens[d];
        if main > span {
            return datafusion::common::internal_err!(
                "a box of {main} positions along '{}' rolled in rings of {span}",
                rolling.read.table.dims[d].name
            );
        }
        let (before, after) = (rolling.before as usize, rolling.after as usize);
        // The same for every box, so a column's ring is reused as it is.
        let held = before + 1 + span + after;
        // The box's first position (in the walk) in the ring.
        let at = rolling.walked_before(&b[d]) as usize + before;
        let mut key = b.to_vec();
        key[d] = 0..0;
        let shape = [outer, held, inner];
        let mut ring = rings.take(&key, &rolling.single, &rolling.aggregates, shape);

        // The overlap before: kept from the box before, or read (and the
        // running states, of no use then, forgotten).
        let kept = ring.held.start <= at - before && at <= ring.held.end && !ring.held.is_empty();
        if !kept {
            ring.states.iter_mut().for_each(AggState::forget);
            rolling.start_running(b, at, &mut ring, buffers, meters)?;
        }
        if before > 0 && !kept {
            let pieces = rolling.walked_just_before(&b[d], rolling.before);
            let n = pieces.iter().map(|p| p.end - p.start).sum::<u64>() as usize;
            for lines in &mut ring.lines {
                lines.clear(at - before, before - n);
            }
            let read = (&*meters, &meters.halo_positions_read);
            rolling.read_halo(b, &pieces, at - n, &mut ring.lines, buffers, read)?;
        }

        // The box itself.
        let timer = meters.decode_time.timer();
        let cells = BoxCells::read(&rolling.read.table, &rolling.read.columns, b, buffers)?;
        timer.done();
        meters.bytes_decoded.add(cells.decoded_bytes() as usize);
        let total = cells.num_cells();
        let timer = meters.roll_time.timer();
        let mut start = 0u64;
        while start < total {
            let len = (batch_size as u64).min(total - start);
            let batch = cells.batch_of(&rolling.arg_schema, &rolling.arg_places, start, len)?;
            rolling.put_args(&batch, &mut ring.lines, (at, main, start as usize))?;
            start += len;
        }
        timer.done();

        // The overlap after: read (missing after the series' end).
        if after > 0 {
            let pieces = rolling.walked_just_after(&b[d], rolling.after);
            let n = pieces.iter().map(|p| p.end - p.start).sum::<u64>() as usize;
            let read = (&*meters, &meters.halo_positions_read);
            rolling.read_halo(b, &pieces, at + main, &mut ring.lines, buffers, read)?;
            for lines in &mut ring.lines {
                lines.clear(at + main + n, after - n);
            }
        }

        let timer = meters.roll_time.timer();
        let rolled = (rolling.aggregates.iter())
            .zip(&mut ring.states)
            .map(|(a, state)| {
                let (lines, out) = (&ring.lines[a.arg], at..at + main);
                // Walked backward, each box's aggregates come back in
                // grid order.
                let reversed = rolling.backward;
                let values = match state {
                    AggState::Sliding(state) => roll(a.op, lines, (a.frame, out), state, reversed)?,
                    AggState::Running(state) => {
                        accumulate(a.op, lines, (a.frame.end, out), state, reversed)?
                    }
                };
                Ok(cast(&values, &a.output_type)?)
            })
            .collect::<Result<Vec<ArrayRef>>>()?;
        ring.held = at - before..at + main + after;
        rings.active.insert(key, ring);
        timer.done();

        let mut start = 0u64;
        while start < total {
            let len = (batch_size as u64).min(total - start);
            let mut columns = if rolling.outputs.is_empty() {
                Vec::new()
            } else {
                let batch = cells.batch(&rolling.read.schema, start, len)?;
                (rolling.outputs.iter())
                    .map(|e| e.evaluate(&batch)?.into_array(len as usize))
                    .collect::<Result<Vec<_>>>()?
            };
            columns.extend(
                rolled
                    .iter()
                    .map(|values| batch_slice(values, start as usize, len as usize)),
            );
            let out = RecordBatch::try_new(Arc::clone(&rolling.output_schema), columns)?;
            meters.output_rows.add(len as usize);
            if !sink(out)? {
                return Ok(false);
            }
            start += len;
        }
        Ok(true)
    }
}

impl ReadsBroadcasts for RollingWindowExec {
    fn broadcasts_mut(&mut self) -> &mut BroadcastInputs {
        &mut self.broadcasts
    }

    /// Holds less, a step at a time: batches sent one by one; then,
    /// where the blocks are its own to change, smaller blocks (whole
    /// chunks still: see [`Rolling::with_smaller_blocks`]); then half the
    /// partitions.
    fn hold_less(&mut self) -> bool {
        if self.run_batches > 1 {
            self.run_batches = 1;
            return true;
        }
        if !self.refit || self.tasks != 1 {
            return false;
        }
        if let Some(smaller) = self.rolling.with_smaller_blocks() {
            self.rolling = Arc::new(smaller);
            return true;
        }
        if self.partitions < 2 {
            return false;
        }
        *self = Self {
            broadcasts: std::mem::take(&mut self.broadcasts),
            run_batches: 1,
            refit: true,
            ..Self::with_parts(
                Arc::clone(&self.rolling),
                self.partitions / 2,
                self.batch_size,
                self.tasks,
            )
        };
        true
    }

    fn projection(&self) -> Projection {
        let r = &self.rolling;
        Projection::new(
            "RollingWindowExec",
            &r.read.table.store,
            self.partitions,
            "partition",
            self.per_partition_memory(),
        )
        .holding(format!(
            "blocks of shape {:?}, {} positions of overlap",
            r.read.blocks.block_shape(),
            r.before + r.after
        ))
        .and(self.broadcasts.memory(), "tables joined in")
        .advice("raise the limit or shorten the frames")
    }
}

impl DisplayAs for RollingWindowExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let r = &self.rolling;
        let aggregates: Vec<&str> = r.aggregates.iter().map(|a| a.label.as_str()).collect();
        write!(
            f,
            "RollingWindowExec: store={}, along={}{}, aggr=[{}], rows={}, blocks={} of shape \
             {:?}, overlap={}+{}, partitions={}, projected_memory={}",
            r.read.table.store,
            r.read.table.dims[r.dim].name,
            if r.backward { " from its end" } else { "" },
            aggregates.join(", "),
            r.read.selection.num_cells(),
            r.read.blocks.num_blocks(),
            r.read.blocks.block_shape(),
            r.before,
            r.after,
            self.partitions,
            human_readable_size(self.projected_memory()),
        )?;
        write!(f, "{}", self.broadcasts.display(&r.read.table.dim_names()))?;
        write!(f, "{}", shown_tasks(self.tasks))
    }
}

impl ExecutionPlan for RollingWindowExec {
    broadcast_children_methods!("RollingWindowExec");
    no_expressions_method!();

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        if partition >= self.partitions {
            return datafusion::common::internal_err!(
                "RollingWindowExec has {} partitions, asked for {partition}",
                self.partitions
            );
        }
        let run = self.partition_blocks(partition, &context)?;
        let progress = context.session_config().get_extension::<ScanProgress>();
        if let Some(progress) = &progress {
            progress.add_planned(run.end - run.start);
        }
        let reservation = Reservation::new(
            "RollingWindowExec",
            &self.rolling.read.table.store,
            partition,
            self.per_partition_memory(),
            &context,
            &self.metrics,
        );
        let taken = reservation.unless(!self.broadcasts.is_empty())?;
        let meters = Meters::new(&self.metrics, partition);
        let rolling = Arc::clone(&self.rolling);
        let batch_size = self.batch_size;
        let mut builder = RunStreamBuilder::new(Arc::clone(&self.schema));
        let mut runs = builder.runs(self.run_batches);
        let roll = move |reservation: MemoryReservation| {
            let _reservation = reservation;
            rolling.run_partition(run, batch_size, &mut runs, meters, progress.as_deref())
        };
        if self.broadcasts.is_empty() {
            builder.spawn_blocking(move || roll(reservation.after(taken)?));
        } else {
            // The tables joined in are computed first, and held while the
            // blocks are rolled (the partition's memory taken once they are).
            let (broadcasts, partitions) = (self.broadcasts.clone(), self.partitions);
            builder.spawn(async move {
                let _held = broadcasts.hold(&context, partitions).await?;
                let taken = reservation.after(taken)?;
                tokio::task::spawn_blocking(move || roll(taken))
                    .await
                    .map_err(|e| DataFusionError::ExecutionJoin(Box::new(e)))?
            });
        }
        Ok(builder.build())
    }

    metered_plan_methods!(|exec| Some(exec.rolling.read.selection.num_cells()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selected_positions_before_and_after_skip_what_is_not_selected() {
        let ranges = [0..3, 5..6, 8..12];
        assert_eq!(selected_before(&ranges, 9, 3), vec![2..3, 5..6, 8..9]);
        assert_eq!(selected_before(&ranges, 9, 10), vec![0..3, 5..6, 8..9]);
        assert_eq!(selected_before(&ranges, 8, 2), vec![2..3, 5..6]);
        assert_eq!(selected_before(&ranges, 0, 2), Vec::<Range<u64>>::new());
        assert_eq!(selected_after(&ranges, 2, 3), vec![2..3, 5..6, 8..9]);
        assert_eq!(selected_after(&ranges, 6, 5), vec![8..12]);
        assert_eq!(selected_after(&ranges, 12, 5), Vec::<Range<u64>>::new());
        assert_eq!(selected_after(&ranges, 4, 0), Vec::<Range<u64>>::new());
    }
}

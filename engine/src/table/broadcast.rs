//! Broadcast columns: a small table joined into a grid on some of its
//! dimensions, held once as a dense array over its keys.
//!
//! An anomaly is a join of a grid with a result over some of its
//! dimensions: `era5 JOIN clim USING (lat, lon)`, or through a function of
//! a coordinate, `... ON extract(month FROM era5.time) = clim.month AND
//! ...`. When the small side has at most one row per key tuple (it is a
//! `GROUP BY` of the keys), every cell of the grid meets at most one of its
//! rows, the one whose keys are the cell's. So the small side becomes
//! columns of the grid ([`Broadcast`]): its rows are computed once, laid
//! out as a dense array over the distinct keys of each keyed dimension
//! (12 months x 721 latitudes x 1440 longitudes), and a block's column is
//! gathered from that array by the key of each of its cells' positions: no
//! hash table, no shuffle, the small side held once.
//!
//! Each keyed dimension's key per position is computed once, when the join
//! is planned (the functions evaluated over the coordinate, as grouping by
//! them does). Besides the small side's columns, a broadcast gives a
//! `matched` column, true where the cell has a row: an inner join keeps
//! the cells where it is true, a left join keeps every cell with NULLs
//! where it is false.
//!
//! The operators that read a grid with broadcast columns ([`BroadcastInputs`])
//! have the small sides' plans as their children, and compute each once
//! per execution, within the memory limit (projected while planning:
//! [`Broadcast::memory`]), before reading any block.

use std::ops::Range;
use std::sync::{Arc, Mutex, Weak};

use datafusion::arrow::array::{
    make_array, new_empty_array, Array, ArrayRef, AsArray, BooleanArray, MutableArrayData,
    RecordBatch, UInt32Array,
};
use datafusion::arrow::compute::{concat, take};
use datafusion::arrow::datatypes::{
    ArrowPrimitiveType, DataType, Field, Float16Type, Float32Type, Float64Type, Schema,
};
use datafusion::arrow::row::{RowConverter, Rows, SortField};
use datafusion::catalog::Session;
use datafusion::common::{exec_err, human_readable_size, internal_err, plan_err, Result};
use datafusion::execution::context::QueryPlanner;
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::execution::{SessionState, TaskContext};
use datafusion::logical_expr::LogicalPlan;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::execution_plan::reset_plan_states;
use datafusion::physical_plan::{execute_stream, ExecutionPlan};
use futures::StreamExt;

use super::slices::batch_slice;
use crate::memory::Projection;

/// One dimension a broadcast is keyed by.
#[derive(Debug)]
pub struct BroadcastDim {
    /// The dimension (index into the grid's dimensions).
    pub dim: usize,
    /// For each position of the dimension, its key: the index of its
    /// tuple among `distinct`.
    pub keys: Vec<u32>,
    /// The distinct key tuples over the dimension, in the order they first
    /// appear along it (one array per component, all as long; see
    /// [`BroadcastDim::in_order_met`]).
    pub distinct: Vec<ArrayRef>,
    /// The small side's output columns holding each component.
    pub columns: Vec<usize>,
    /// The functions of the dimension's coordinate the keys are, one per
    /// component, planned over its column alone (a cluster's worker
    /// evaluates them again over its own copy of the coordinate).
    pub exprs: Vec<Arc<dyn PhysicalExpr>>,
}

impl BroadcastDim {
    /// Dimension `dim` keyed by `exprs` (meeting the small side's
    /// `columns`): each position's key (`keys`, its index among the
    /// tuples `distinct`, in any order) renumbered in the order the keys
    /// are first met along the dimension, `distinct` in that order too.
    /// Neighbouring positions whose keys are met one after the other then
    /// have consecutive keys (a descending latitude keyed by itself as
    /// well as an ascending one), so the cells of a box meet long runs of
    /// the dense array, read as slices of it ([`BroadcastRuns::rows`])
    /// rather than copied.
    pub fn in_order_met(
        dim: usize,
        (keys, distinct): (Vec<u32>, Vec<ArrayRef>),
        columns: Vec<usize>,
        exprs: Vec<Arc<dyn PhysicalExpr>>,
    ) -> Result<Self> {
        let n = distinct.first().map_or(0, |a| a.len());
        if let Some(k) = keys.iter().find(|&&k| k as usize >= n) {
            return internal_err!("key {k} of dimension {dim} among {n} distinct ones");
        }
        let mut rank = vec![u32::MAX; n];
        let mut order: Vec<u32> = Vec::with_capacity(n);
        for &k in &keys {
            if rank[k as usize] == u32::MAX {
                rank[k as usize] = order.len() as u32;
                order.push(k);
            }
        }
        // Tuples no position has keep their place after the others.
        for (k, rank) in rank.iter_mut().enumerate() {
            if *rank == u32::MAX {
                *rank = order.len() as u32;
                order.push(k as u32);
            }
        }
        let order = UInt32Array::from(order);
        let distinct = (distinct.iter())
            .map(|a| take(a.as_ref(), &order, None))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(Self {
            dim,
            keys: keys.iter().map(|&k| rank[k as usize]).collect(),
            distinct,
            columns,
            exprs,
        })
    }

    /// Number of distinct keys.
    pub fn len(&self) -> usize {
        self.distinct.first().map_or(0, |a| a.len())
    }

    /// Whether the dimension has no key (an empty dimension).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A small table joined into a grid: its columns, as columns of the grid.
#[derive(Debug)]
pub struct Broadcast {
    /// The small side, at most one row per key tuple (`None` on a
    /// cluster's worker, where it arrives as its operator's input).
    pub plan: Option<LogicalPlan>,
    /// The dimensions it is keyed by, in the grid's order.
    pub dims: Vec<BroadcastDim>,
    /// The small side's output columns it gives the grid, in order.
    pub values: Vec<usize>,
    /// The grid's fields: one per value column, then the `matched` column.
    pub fields: Vec<Field>,
    /// How it is shown (`clim`).
    pub label: String,
    /// The values of the execution in progress, if any.
    current: Mutex<Weak<BroadcastValues>>,
    /// Per operator reading it (by the address of the small side's plan
    /// it runs), the values while some of its partitions are yet to take
    /// them, and how many. An execution stopped before all of its
    /// partitions started (a `LIMIT` met early) leaves its entry, and its
    /// memory, until the plan is dropped; the operator's next execution
    /// takes those values first.
    pending: Mutex<Vec<(usize, Arc<BroadcastValues>, usize)>>,
    /// Taken while the values are computed, so they are computed once.
    building: tokio::sync::Mutex<()>,
}

/// The most bytes the dense array of a broadcast may take; a larger small
/// side keeps DataFusion's hash join.
pub const MAX_BROADCAST_BYTES: u64 = 1 << 30;

impl Broadcast {
    /// A broadcast of `plan`'s columns `values`, named `names` in the grid
    /// (`names` has one more: the `matched` column's).
    pub fn new(
        plan: LogicalPlan,
        dims: Vec<BroadcastDim>,
        values: Vec<usize>,
        names: Vec<String>,
        label: String,
    ) -> Result<Self> {
        if names.len() != values.len() + 1 {
            return internal_err!("a broadcast of {} columns named {names:?}", values.len());
        }
        let schema = plan.schema();
        let mut fields: Vec<Field> = values
            .iter()
            .zip(&names)
            .map(|(&c, name)| {
                let field = schema.field(c);
                Field::new(name, field.data_type().clone(), true)
            })
            .collect();
        fields.push(Field::new(&names[values.len()], DataType::Boolean, false));
        Self::assemble(Some(plan), dims, values, fields, label)
    }

    /// A broadcast a cluster's worker received: its small side's plan is
    /// its operator's input, whose schema [`Self::check_input`] checks.
    /// `fields` are the grid's new columns (the values', then the
    /// `matched` column).
    pub fn received(
        dims: Vec<BroadcastDim>,
        values: Vec<usize>,
        fields: Vec<Field>,
        label: String,
    ) -> Result<Self> {
        if fields.len() != values.len() + 1 {
            return plan_err!(
                "the broadcast of {label} gives {} columns for {} values",
                fields.len(),
                values.len()
            );
        }
        for d in &dims {
            let lengths_agree = d.columns.len() == d.distinct.len()
                && d.exprs.len() == d.distinct.len()
                && d.distinct.iter().all(|a| a.len() == d.len());
            if d.distinct.is_empty() || !lengths_agree {
                return plan_err!("the broadcast of {label}: a keyed dimension's keys disagree");
            }
            if let Some(k) = d.keys.iter().find(|&&k| k as usize >= d.len()) {
                return plan_err!(
                    "the broadcast of {label}: key {k} of {} distinct ones",
                    d.len()
                );
            }
        }
        Self::assemble(None, dims, values, fields, label)
    }

    fn assemble(
        plan: Option<LogicalPlan>,
        dims: Vec<BroadcastDim>,
        values: Vec<usize>,
        fields: Vec<Field>,
        label: String,
    ) -> Result<Self> {
        let broadcast = Self {
            plan,
            dims,
            values,
            fields,
            label,
            current: Mutex::new(Weak::new()),
            pending: Mutex::new(Vec::new()),
            building: tokio::sync::Mutex::new(()),
        };
        if broadcast.dense_bytes() > MAX_BROADCAST_BYTES {
            return plan_err!(
                "the broadcast of {} would hold {} bytes",
                broadcast.label,
                broadcast.dense_bytes()
            );
        }
        Ok(broadcast)
    }

    /// Columns that pass [`Broadcast::check_input`], the others `Null`:
    /// the schema of a stand-in for a small side that is never run.
    pub fn stand_in_schema(&self) -> Schema {
        let mut types: Vec<(usize, DataType)> = Vec::new();
        for d in &self.dims {
            for (&c, keys) in d.columns.iter().zip(&d.distinct) {
                types.push((c, keys.data_type().clone()));
            }
        }
        for (&c, field) in self.values.iter().zip(&self.fields) {
            types.push((c, field.data_type().clone()));
        }
        let width = types.iter().map(|(c, _)| c + 1).max().unwrap_or(0);
        let mut fields: Vec<Field> = (0..width)
            .map(|c| Field::new(format!("c{c}"), DataType::Null, true))
            .collect();
        for (c, t) in types {
            fields[c] = Field::new(format!("c{c}"), t, true);
        }
        Schema::new(fields)
    }

    /// Checks that `schema`, the small side's as its operator's input
    /// gives it, has the key and value columns this broadcast reads, of
    /// their types.
    pub fn check_input(&self, schema: &Schema) -> Result<()> {
        let wrong = |what: &str, c: usize, expected: &DataType| {
            let found = schema.fields().get(c).map(|f| f.data_type().to_string());
            plan_err!(
                "the small side of the join with {} gives no {what} column {c} of type \
                 {expected} (found {found:?})",
                self.label
            )
        };
        for d in &self.dims {
            for (&c, keys) in d.columns.iter().zip(&d.distinct) {
                if schema.fields().get(c).map(|f| f.data_type()) != Some(keys.data_type()) {
                    return wrong("key", c, keys.data_type());
                }
            }
        }
        for (&c, field) in self.values.iter().zip(&self.fields) {
            if schema.fields().get(c).map(|f| f.data_type()) != Some(field.data_type()) {
                return wrong("value", c, field.data_type());
            }
        }
        Ok(())
    }

    /// Cells of the dense array: the product of the keyed dimensions'
    /// distinct keys.
    pub fn cells(&self) -> u64 {
        (self.dims.iter()).fold(1u64, |n, d| n.saturating_mul(d.len() as u64))
    }

    /// Bytes a cell of the dense array takes: each value (16 for values
    /// of no fixed width, an estimate), its validity and the match.
    fn cell_bytes(&self) -> u64 {
        let values: usize = (self.fields.iter().take(self.values.len()))
            .map(|f| f.data_type().primitive_width().unwrap_or(16))
            .sum();
        values as u64 + 1
    }

    /// Bytes of the dense array.
    fn dense_bytes(&self) -> u64 {
        self.cells().saturating_mul(self.cell_bytes())
    }

    /// Memory held while the broadcast is computed and read: the dense
    /// array, the small side's matched rows while they are laid out (at
    /// most as many), and the index of each cell's row.
    pub fn memory(&self) -> usize {
        let bytes = self
            .dense_bytes()
            .saturating_mul(2)
            .saturating_add(self.cells().saturating_mul(4));
        usize::try_from(bytes).unwrap_or(usize::MAX)
    }

    /// Bytes a grid cell of broadcast column `part` takes once gathered.
    pub fn part_bytes(&self, part: usize) -> usize {
        match self.fields.get(part) {
            Some(f) if part < self.values.len() => f.data_type().primitive_width().unwrap_or(16),
            _ => 1,
        }
    }

    /// The keyed dimensions and their numbers of keys (`month: 12`).
    fn describe_keys(&self, dim_names: &[&str]) -> String {
        let keys: Vec<String> = (self.dims.iter())
            .map(|d| {
                let name = dim_names.get(d.dim).copied().unwrap_or("?");
                format!("{name}: {}", d.len())
            })
            .collect();
        keys.join(", ")
    }

    /// Computes the small side by running `input` (its physical plan) and
    /// lays it out, once for the `partitions` partitions of the operator
    /// reading it: the first to ask computes it, the others take what it
    /// computed (the last one to take it leaves none behind, so that the
    /// memory goes with the partitions' own references, and a later
    /// execution computes it again). Values another operator holds at the
    /// time are taken as they are (an operator reading this broadcast
    /// inside another's small side, as stacked window totals do: computing
    /// them again would replace the values the other operator reads). On a
    /// cluster the small side's rows come from a broadcast, which sends
    /// each of its partitions once per task: running it twice in one
    /// execution would fail.
    async fn hold(
        &self,
        input: &Arc<dyn ExecutionPlan>,
        context: &Arc<TaskContext>,
        partitions: usize,
    ) -> Result<Arc<BroadcastValues>> {
        let _building = self.building.lock().await;
        let operator = Arc::as_ptr(input) as *const () as usize;
        if let Some(values) = self.take_pending(operator) {
            return Ok(values);
        }
        let values = match self.current() {
            Some(values) => values,
            None => {
                let reservation = MemoryConsumer::new(format!("Broadcast[{}]", self.label))
                    .register(context.memory_pool());
                reservation.try_grow(self.memory())?;
                let values = Arc::new(self.lay_out(input, context, reservation).await?);
                match self.current.lock() {
                    Ok(mut current) => *current = Arc::downgrade(&values),
                    Err(poisoned) => *poisoned.into_inner() = Arc::downgrade(&values),
                }
                values
            }
        };
        if partitions > 1 {
            let kept = (operator, Arc::clone(&values), partitions - 1);
            match self.pending.lock() {
                Ok(mut pending) => pending.push(kept),
                Err(poisoned) => poisoned.into_inner().push(kept),
            }
        }
        Ok(values)
    }

    /// The values of the execution in progress of the operator running
    /// `operator` (the address of its small side's plan), taken by one
    /// more of its partitions (none kept once all have).
    fn take_pending(&self, operator: usize) -> Option<Arc<BroadcastValues>> {
        let mut pending = match self.pending.lock() {
            Ok(pending) => pending,
            Err(poisoned) => poisoned.into_inner(),
        };
        let at = pending.iter().position(|(o, _, _)| *o == operator)?;
        let entry = &mut pending[at];
        let values = Arc::clone(&entry.1);
        entry.2 -= 1;
        if entry.2 == 0 {
            pending.swap_remove(at);
        }
        Some(values)
    }

    /// The values of the execution in progress.
    fn current(&self) -> Option<Arc<BroadcastValues>> {
        match self.current.lock() {
            Ok(current) => current.upgrade(),
            Err(poisoned) => poisoned.into_inner().upgrade(),
        }
    }

    /// Runs the small side and places each of its rows at its keys' cell
    /// of the dense array.
    async fn lay_out(
        &self,
        input: &Arc<dyn ExecutionPlan>,
        context: &Arc<TaskContext>,
        reservation: MemoryReservation,
    ) -> Result<BroadcastValues> {
        let converters = (self.dims.iter())
            .map(|d| {
                let fields = (d.distinct.iter())
                    .map(|a| SortField::new(a.data_type().clone()))
                    .collect();
                RowConverter::new(fields)
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let distinct = (converters.iter().zip(&self.dims))
            .map(|(c, d)| Ok(KeyRows::new(c.convert_columns(&d.distinct)?)))
            .collect::<Result<Vec<KeyRows>>>()?;
        let strides = c_strides(&self.dims);
        let cells = usize::try_from(self.cells()).unwrap_or(usize::MAX);
        // The row (among the kept ones) of each cell.
        let mut slot: Vec<u32> = vec![u32::MAX; cells];
        let mut kept: Vec<Vec<ArrayRef>> = vec![Vec::new(); self.values.len()];
        let mut kept_rows: usize = 0;
        // A fresh instance of the plan: it may have run before (an earlier
        // execution of the operator), and operators such as a repartition
        // run once per instance.
        let input = reset_plan_states(Arc::clone(input))?;
        let mut stream = execute_stream(input, Arc::clone(context))?;
        while let Some(batch) = stream.next().await {
            let batch = batch?;
            let rows = self.place(&batch, &converters, &distinct, &strides)?;
            let mut taken: Vec<u32> = Vec::new();
            for (row, cell) in rows.into_iter().enumerate() {
                let Some(cell) = cell else { continue };
                if slot[cell] != u32::MAX {
                    return exec_err!(
                        "the small side of the join with {} has two rows for the same keys",
                        self.label
                    );
                }
                slot[cell] = (kept_rows + taken.len()) as u32;
                taken.push(row as u32);
            }
            if taken.is_empty() {
                continue;
            }
            kept_rows += taken.len();
            let taken = UInt32Array::from(taken);
            for (out, &c) in kept.iter_mut().zip(&self.values) {
                out.push(take(batch.column(c).as_ref(), &taken, None)?);
            }
        }
        let indices: UInt32Array = slot.iter().map(|&s| (s != u32::MAX).then_some(s)).collect();
        let values = (kept.iter().zip(&self.fields))
            .map(|(parts, field)| {
                let all = match parts.as_slice() {
                    [] => new_empty_array(field.data_type()),
                    [one] => Arc::clone(one),
                    _ => {
                        let parts: Vec<&dyn Array> = parts.iter().map(|p| p.as_ref()).collect();
                        concat(&parts)?
                    }
                };
                Ok(take(all.as_ref(), &indices, None)?)
            })
            .collect::<Result<Vec<ArrayRef>>>()?;
        let matched: BooleanArray = slot.iter().map(|&s| Some(s != u32::MAX)).collect();
        Ok(BroadcastValues {
            values,
            matched,
            _reservation: reservation,
        })
    }

    /// The cell of the dense array of each row of `batch`: `None` for a
    /// row whose keys are NULL or not any position's.
    fn place(
        &self,
        batch: &RecordBatch,
        converters: &[RowConverter],
        distinct: &[KeyRows],
        strides: &[usize],
    ) -> Result<Vec<Option<usize>>> {
        let n = batch.num_rows();
        let mut cells: Vec<Option<usize>> = vec![Some(0); n];
        for (((d, converter), keys), &stride) in
            self.dims.iter().zip(converters).zip(distinct).zip(strides)
        {
            let columns: Vec<ArrayRef> = (d.columns.iter())
                .map(|&c| signed_zeros_folded(batch.column(c)))
                .collect();
            for column in &columns {
                if let Some(nulls) = column.logical_nulls() {
                    for (cell, valid) in cells.iter_mut().zip(nulls.iter()) {
                        if !valid {
                            *cell = None;
                        }
                    }
                }
            }
            let rows = converter.convert_columns(&columns)?;
            let mut last = None;
            for (i, cell) in cells.iter_mut().enumerate() {
                let Some(at) = cell else { continue };
                last = keys.find_near(rows.row(i), last);
                *cell = last.map(|k| *at + k * stride);
            }
        }
        Ok(cells)
    }

    /// Columns `parts` (indices among [`Self::fields`]) for the cells of
    /// `extent` (one range per grid dimension), in C order, as runs of
    /// their dense arrays: nothing is copied until rows are asked for
    /// ([`BroadcastRuns::rows`]), and rows within one run (a longitude
    /// keyed as it is, a whole plane of one month) are a slice of the
    /// dense array, never copied.
    pub fn read(&self, parts: &[usize], extent: &[Range<u64>]) -> Result<Vec<BroadcastRuns>> {
        let Some(values) = self.current() else {
            return internal_err!(
                "the broadcast of {} is read before it is computed",
                self.label
            );
        };
        let (starts, run) = self.runs(extent);
        let starts: Arc<[u32]> = starts.into();
        parts
            .iter()
            .map(|&part| {
                let dense = match values.values.get(part) {
                    Some(column) => Arc::clone(column),
                    None => Arc::new(values.matched.clone()) as ArrayRef,
                };
                Ok(BroadcastRuns {
                    dense,
                    starts: Arc::clone(&starts),
                    run,
                })
            })
            .collect()
    }

    /// The cells of the dense array the grid cells of `extent` meet, in C
    /// order, as runs of consecutive cells: the first cell of each run,
    /// and the runs' length (no runs when `extent` is empty).
    fn runs(&self, extent: &[Range<u64>]) -> (Vec<u32>, usize) {
        let strides = c_strides(&self.dims);
        // Each grid dimension's contribution at each position of the extent.
        let mut steps: Vec<Vec<u32>> = extent
            .iter()
            .enumerate()
            .map(|(g, range)| {
                let keyed = self.dims.iter().zip(&strides).find(|(d, _)| d.dim == g);
                match keyed {
                    Some((d, &stride)) => (range.clone())
                        .map(|p| d.keys[p as usize] * stride as u32)
                        .collect(),
                    None => vec![0; (range.end - range.start) as usize],
                }
            })
            .collect();
        if steps.iter().any(Vec::is_empty) {
            return (Vec::new(), 0);
        }
        // The innermost dimensions whose cells follow each other in the
        // dense array make one run.
        let (mut run, mut first) = (1usize, 0u32);
        while let Some(last) = steps.last() {
            let consecutive =
                (last.iter().enumerate()).all(|(i, &s)| s as usize == last[0] as usize + i * run);
            if !consecutive {
                break;
            }
            run *= last.len();
            first += last[0];
            steps.pop();
        }
        let mut starts = Vec::with_capacity(steps.iter().map(Vec::len).product());
        fill(&steps, first, &mut starts);
        (starts, run)
    }

    /// The cell of the dense array of each grid cell of `extent`, in C
    /// order.
    #[cfg(test)]
    fn gather(&self, extent: &[Range<u64>]) -> Vec<u32> {
        let (starts, run) = self.runs(extent);
        expand(&starts, run)
    }
}

/// One broadcast column over the cells of a box, in C order: runs of
/// `run` consecutive cells of its dense array, from each of `starts`.
#[derive(Debug, Clone)]
pub struct BroadcastRuns {
    dense: ArrayRef,
    starts: Arc<[u32]>,
    run: usize,
}

impl BroadcastRuns {
    /// Number of cells.
    pub fn len(&self) -> usize {
        self.starts.len() * self.run
    }

    /// Whether there is no cell.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Cells `start..start + len` as one array: a slice of the dense array
    /// when they lie in one run; else the runs' pieces copied, or (runs
    /// too short to copy one by one) each cell taken by its index.
    pub fn rows(&self, start: usize, len: usize) -> Result<ArrayRef> {
        if start + len > self.len() {
            return internal_err!(
                "rows {start}..{} of a broadcast column of {} cells",
                start + len,
                self.len()
            );
        }
        if len == 0 {
            return Ok(self.dense.slice(0, 0));
        }
        let (first, last) = (start / self.run, (start + len - 1) / self.run);
        if first == last {
            let at = self.starts[first] as usize + start % self.run;
            return Ok(batch_slice(&self.dense, at, len));
        }
        if self.run < MIN_COPIED_RUN {
            let indices: UInt32Array = (start..start + len)
                .map(|i| self.starts[i / self.run] + (i % self.run) as u32)
                .collect();
            return Ok(take(self.dense.as_ref(), &indices, None)?);
        }
        let data = self.dense.to_data();
        let mut out = MutableArrayData::new(vec![&data], false, len);
        let mut at = start;
        while at < start + len {
            let (r, offset) = (at / self.run, at % self.run);
            let piece = (self.run - offset).min(start + len - at);
            let from = self.starts[r] as usize + offset;
            out.try_extend(0, from, from + piece)?;
            at += piece;
        }
        Ok(make_array(out.freeze()))
    }
}

/// Runs shorter than this are gathered cell by cell (by index): copying
/// them one by one would cost more.
const MIN_COPIED_RUN: usize = 64;

/// The cells of runs of `run` cells from each of `starts`.
#[cfg(test)]
fn expand(starts: &[u32], run: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(starts.len() * run);
    for &start in starts {
        out.extend((0..run as u32).map(|i| start + i));
    }
    out
}

/// Appends, in C order, the sums of one step of each of `steps` from
/// `base` on.
fn fill(steps: &[Vec<u32>], base: u32, out: &mut Vec<u32>) {
    match steps {
        [] => out.push(base),
        [last] => out.extend(last.iter().map(|s| base + s)),
        [first, rest @ ..] => {
            for s in first {
                fill(rest, base + s, out);
            }
        }
    }
}

/// C-order strides of the dense array over `dims`.
fn c_strides(dims: &[BroadcastDim]) -> Vec<usize> {
    let mut strides = vec![1usize; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * dims[i + 1].len();
    }
    strides
}

/// A keyed dimension's distinct key tuples as rows, with their order
/// sorted, to find a row's tuple by binary search.
struct KeyRows {
    rows: Rows,
    /// The indices of `rows`, sorted by their rows.
    sorted: Vec<usize>,
}

impl KeyRows {
    fn new(rows: Rows) -> Self {
        let mut sorted: Vec<usize> = (0..rows.num_rows()).collect();
        sorted.sort_unstable_by(|&a, &b| rows.row(a).cmp(&rows.row(b)));
        Self { rows, sorted }
    }

    /// The index of the tuple `row` is, if any.
    fn find(&self, row: datafusion::arrow::row::Row<'_>) -> Option<usize> {
        let at = (self.sorted).binary_search_by(|&k| self.rows.row(k).cmp(&row));
        at.ok().map(|at| self.sorted[at])
    }

    /// [`Self::find`], trying the tuple `near` and the one after it first:
    /// a small side's rows come in runs of one key of a dimension (a
    /// climatology's latitude), or with its keys one after the other (its
    /// longitudes).
    fn find_near(
        &self,
        row: datafusion::arrow::row::Row<'_>,
        near: Option<usize>,
    ) -> Option<usize> {
        if let Some(k) = near {
            let n = self.rows.num_rows();
            if let Some(k) = [k, k + 1]
                .into_iter()
                .find(|&k| k < n && self.rows.row(k) == row)
            {
                return Some(k);
            }
        }
        self.find(row)
    }
}

/// A broadcast's small side, laid out for one execution.
#[derive(Debug)]
pub struct BroadcastValues {
    /// Each value column over the dense array's cells (NULL where no row).
    values: Vec<ArrayRef>,
    /// Whether each cell has a row.
    matched: BooleanArray,
    /// The memory pool's share.
    _reservation: MemoryReservation,
}

/// The planner a session with workers plans a join's small side with: its
/// own query planner, before the distributed planner (which would make the
/// small side a distributed plan of its own, run apart from the grid's).
#[derive(Clone)]
pub struct SmallSidePlanner(pub Arc<dyn QueryPlanner + Send + Sync>);

impl std::fmt::Debug for SmallSidePlanner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SmallSidePlanner")
    }
}

/// `column` with its `-0.0`s as `+0.0` when it holds floats (a key, as
/// DataFusion's hash aggregation and join fold them: in SQL `-0.0 = 0.0`,
/// one group, one key); itself otherwise. NaNs are left as they are.
pub(crate) fn signed_zeros_folded(column: &ArrayRef) -> ArrayRef {
    fn folded<T: ArrowPrimitiveType>(column: &ArrayRef) -> ArrayRef {
        let zero = T::Native::default();
        let column = column.as_primitive::<T>();
        Arc::new(column.unary::<_, T>(|v| if v == zero { zero } else { v }))
    }
    match column.data_type() {
        DataType::Float16 => folded::<Float16Type>(column),
        DataType::Float32 => folded::<Float32Type>(column),
        DataType::Float64 => folded::<Float64Type>(column),
        _ => Arc::clone(column),
    }
}

/// The broadcasts an operator reads, with their small sides planned: the
/// operator's children.
#[derive(Debug, Clone, Default)]
pub struct BroadcastInputs {
    entries: Vec<(Arc<Broadcast>, Arc<dyn ExecutionPlan>)>,
}

/// An operator reading broadcast columns within a memory limit of its
/// own (the dense reduction, the rolling window): given its tables joined
/// in, it checks again that it fits.
pub trait ReadsBroadcasts: Sized {
    /// Its tables joined in.
    fn broadcasts_mut(&mut self) -> &mut BroadcastInputs;

    /// Its projected memory, the tables' included.
    fn projection(&self) -> Projection;

    /// Refuses the operator, with the numbers, when its projected memory
    /// (the tables' included) exceeds `limit`.
    fn check_memory(&self, limit: usize) -> Result<()> {
        self.projection().check(limit)
    }

    /// Makes it hold less by a step, where it can (its batches sent one at
    /// a time rather than in runs, its blocks smaller); `false` when it
    /// cannot hold less.
    fn hold_less(&mut self) -> bool {
        false
    }

    /// This operator reading the broadcast columns of `broadcasts` (their
    /// small sides planned, or received by a cluster's worker), refused if
    /// it then cannot fit `memory_limit` (the session's or the worker's).
    fn with_broadcasts(
        mut self,
        broadcasts: BroadcastInputs,
        memory_limit: Option<usize>,
    ) -> Result<Self> {
        *self.broadcasts_mut() = broadcasts;
        if let Some(limit) = memory_limit {
            while self.check_memory(limit).is_err() && self.hold_less() {}
            self.check_memory(limit)?;
        }
        Ok(self)
    }
}

impl BroadcastInputs {
    /// Plans the small sides of `broadcasts` (those a scan reads:
    /// `GridTable::broadcasts_read`).
    /// In a session with workers, a small side is planned as part of the
    /// grid's plan ([`SmallSidePlanner`]), which the distributed planner
    /// then cuts into stages, the small side's broadcast to the grid's
    /// tasks.
    pub async fn plan(broadcasts: Vec<Arc<Broadcast>>, session: &dyn Session) -> Result<Self> {
        let mut entries = Vec::with_capacity(broadcasts.len());
        let own_planner = session.config().get_extension::<SmallSidePlanner>();
        let state = session.as_any().downcast_ref::<SessionState>();
        for broadcast in broadcasts {
            let Some(logical) = &broadcast.plan else {
                return internal_err!(
                    "the small side of the join with {} was received, not planned here",
                    broadcast.label
                );
            };
            let plan = match (&own_planner, state) {
                (Some(planner), Some(state)) => {
                    let optimized = state.optimize(logical)?;
                    (planner.0).create_physical_plan(&optimized, state).await?
                }
                _ => session.create_physical_plan(logical).await?,
            };
            entries.push((broadcast, plan));
        }
        Ok(Self { entries })
    }

    /// The broadcasts `broadcasts` with their small sides' plans `inputs`
    /// (as a cluster's worker receives them: each checked to give the
    /// columns its broadcast reads).
    pub fn received(
        broadcasts: Vec<Arc<Broadcast>>,
        inputs: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Self> {
        if broadcasts.len() != inputs.len() {
            return plan_err!(
                "an operator reading {} tables joined in was sent {} inputs",
                broadcasts.len(),
                inputs.len()
            );
        }
        for (broadcast, input) in broadcasts.iter().zip(&inputs) {
            broadcast.check_input(&input.schema())?;
        }
        Ok(Self {
            entries: broadcasts.into_iter().zip(inputs).collect(),
        })
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The small sides' plans.
    pub fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        self.entries.iter().map(|(_, plan)| plan).collect()
    }

    /// These broadcasts with their small sides' plans replaced.
    pub fn with_children(&self, children: Vec<Arc<dyn ExecutionPlan>>) -> Result<Self> {
        if children.len() != self.entries.len() {
            return internal_err!(
                "an operator reading {} broadcasts was given {} children",
                self.entries.len(),
                children.len()
            );
        }
        let entries = (self.entries.iter().zip(children))
            .map(|((b, _), plan)| (Arc::clone(b), plan))
            .collect();
        Ok(Self { entries })
    }

    /// Memory the broadcasts hold while the operator runs.
    pub fn memory(&self) -> usize {
        (self.entries.iter()).fold(0usize, |n, (b, _)| n.saturating_add(b.memory()))
    }

    /// Computes every broadcast, once for the `partitions` partitions of
    /// the operator reading them (each calls this once as it starts): what
    /// is returned must be held while the operator reads blocks.
    pub async fn hold(
        &self,
        context: &Arc<TaskContext>,
        partitions: usize,
    ) -> Result<Vec<Arc<BroadcastValues>>> {
        let mut held = Vec::with_capacity(self.entries.len());
        for (broadcast, plan) in &self.entries {
            held.push(broadcast.hold(plan, context, partitions).await?);
        }
        Ok(held)
    }

    /// How EXPLAIN shows them: `, broadcast=[clim by (month: 12, lat: 33)
    /// 1.2 MB]`, `dim_names` being the table's dimensions, outermost
    /// first.
    pub fn display(&self, dim_names: &[&str]) -> String {
        if self.entries.is_empty() {
            return String::new();
        }
        let shown: Vec<String> = (self.entries.iter())
            .map(|(b, _)| {
                format!(
                    "{} by ({}) {}",
                    b.label,
                    b.describe_keys(dim_names),
                    human_readable_size(b.memory())
                )
            })
            .collect();
        format!(", broadcast=[{}]", shown.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::datatypes::SchemaRef;

    /// A small side counting how often it is run.
    #[derive(Debug)]
    struct Counted {
        schema: SchemaRef,
        batch: RecordBatch,
        runs: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl datafusion::physical_plan::streaming::PartitionStream for Counted {
        fn schema(&self) -> &SchemaRef {
            &self.schema
        }

        fn execute(
            &self,
            _ctx: Arc<TaskContext>,
        ) -> datafusion::execution::SendableRecordBatchStream {
            self.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let batches = vec![self.batch.clone()];
            Box::pin(
                datafusion::physical_plan::memory::MemoryStream::try_new(
                    batches,
                    Arc::clone(&self.schema),
                    None,
                )
                .unwrap(),
            )
        }
    }

    /// The small side runs once per execution of the operator reading it,
    /// however its partitions interleave: a partition starting after the
    /// others dropped the values takes the same ones (on a cluster the
    /// small side's rows come from a broadcast, which sends each partition
    /// once per task); the next execution runs it again.
    #[tokio::test]
    async fn the_small_side_runs_once_for_all_the_partitions_of_an_execution() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::UInt32, false),
            Field::new("v", DataType::Float64, false),
        ]));
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(UInt32Array::from(vec![1, 2, 3])),
                Arc::new(datafusion::arrow::array::Float64Array::from(vec![
                    0.5, 1.5, 2.5,
                ])),
            ],
        )
        .unwrap();
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = Counted {
            schema: Arc::clone(&schema),
            batch,
            runs: Arc::clone(&runs),
        };
        let input: Arc<dyn ExecutionPlan> = Arc::new(
            datafusion::physical_plan::streaming::StreamingTableExec::try_new(
                Arc::clone(&schema),
                vec![Arc::new(counted)],
                None,
                Vec::new(),
                false,
                None,
            )
            .unwrap(),
        );
        let b = Broadcast {
            plan: None,
            dims: vec![BroadcastDim {
                dim: 0,
                keys: vec![0, 1, 2],
                distinct: vec![Arc::new(UInt32Array::from(vec![1, 2, 3])) as ArrayRef],
                columns: vec![0],
                exprs: Vec::new(),
            }],
            values: vec![1],
            fields: vec![
                Field::new("v", DataType::Float64, true),
                Field::new("matched", DataType::Boolean, false),
            ],
            label: "t".into(),
            current: Mutex::new(Weak::new()),
            pending: Mutex::new(Vec::new()),
            building: tokio::sync::Mutex::new(()),
        };
        let context = Arc::new(TaskContext::default());
        // Three partitions, one after the other, each dropping the values
        // before the next starts.
        for _ in 0..3 {
            let held = b.hold(&input, &context, 3).await.unwrap();
            assert_eq!(held.matched.true_count(), held.matched.len());
            drop(held);
        }
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
        // The next execution runs it again.
        drop(b.hold(&input, &context, 3).await.unwrap());
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    /// A broadcast keyed by `dims`, with no columns.
    fn keyed_by(dims: Vec<BroadcastDim>) -> Broadcast {
        Broadcast {
            plan: None,
            dims,
            values: vec![],
            fields: vec![],
            label: "t".into(),
            current: Mutex::new(Weak::new()),
            pending: Mutex::new(Vec::new()),
            building: tokio::sync::Mutex::new(()),
        }
    }

    #[test]
    fn gather_walks_the_cells_in_c_order() {
        // A grid (time, lat, lon) keyed by month of time (positions 0..4
        // in months 0, 0, 1, 1) and by lon (3 positions): 2 x 3 cells.
        let dims = vec![
            BroadcastDim {
                dim: 0,
                keys: vec![0, 0, 1, 1],
                distinct: vec![Arc::new(UInt32Array::from(vec![1, 2])) as ArrayRef],
                columns: vec![0],
                exprs: Vec::new(),
            },
            BroadcastDim {
                dim: 2,
                keys: vec![0, 1, 2],
                distinct: vec![Arc::new(UInt32Array::from(vec![10, 20, 30])) as ArrayRef],
                columns: vec![1],
                exprs: Vec::new(),
            },
        ];
        assert_eq!(c_strides(&dims), vec![3, 1]);
        let b = keyed_by(dims);
        let extent = [1..3, 0..2, 1..3];
        let expected: Vec<u32> = (1..3u32)
            .flat_map(|t| (0..2).flat_map(move |_| (1..3u32).map(move |x| (t / 2) * 3 + x)))
            .collect();
        assert_eq!(b.gather(&extent), expected);
        assert_eq!(b.cells(), 6);
    }

    #[test]
    fn keys_in_the_order_met_make_a_descending_dimension_one_run() {
        use datafusion::arrow::array::{AsArray, Float64Array};
        use datafusion::arrow::row::{RowConverter, SortField};
        // A grid (time, lat, lon) of 2 x 3 x 4 positions, latitudes
        // descending (10, 0, -10), keyed by lat and lon as the dense
        // reduction numbers them (sorted: lat 10 is key 2).
        let lat: ArrayRef = Arc::new(Float64Array::from(vec![-10.0, 0.0, 10.0]));
        let lon: ArrayRef = Arc::new(UInt32Array::from(vec![0, 90, 180, 270]));
        let dims = vec![
            BroadcastDim::in_order_met(1, (vec![2, 1, 0], vec![lat]), vec![0], Vec::new()).unwrap(),
            BroadcastDim::in_order_met(2, (vec![0, 1, 2, 3], vec![lon]), vec![1], Vec::new())
                .unwrap(),
        ];
        assert_eq!(dims[0].keys, vec![0, 1, 2]);
        let met = dims[0].distinct[0].as_primitive::<datafusion::arrow::datatypes::Float64Type>();
        assert_eq!(met.values().to_vec(), vec![10.0, 0.0, -10.0]);
        assert_eq!(dims[1].keys, vec![0, 1, 2, 3]);
        // A key never met keeps a place after the others; a key out of
        // range is refused.
        let three: ArrayRef = Arc::new(UInt32Array::from(vec![5, 6, 7]));
        let unmet = BroadcastDim::in_order_met(
            0,
            (vec![2, 2], vec![Arc::clone(&three)]),
            vec![0],
            Vec::new(),
        )
        .unwrap();
        assert_eq!(unmet.keys, vec![0, 0]);
        assert_eq!(
            unmet.distinct[0]
                .as_primitive::<datafusion::arrow::datatypes::UInt32Type>()
                .values()
                .to_vec(),
            vec![7, 5, 6]
        );
        assert!(
            BroadcastDim::in_order_met(0, (vec![3], vec![three]), vec![0], Vec::new()).is_err()
        );
        let b = keyed_by(dims);
        // Each time step's plane is one run (with sorted keys, a run per
        // latitude), and every cell meets its own keys' cell.
        let (starts, run) = b.runs(&[0..2, 0..3, 0..4]);
        assert_eq!((starts, run), (vec![0, 0], 12));
        let gathered = b.gather(&[1..2, 1..3, 1..3]);
        assert_eq!(gathered, vec![5, 6, 9, 10]);
        // A row's tuple is found among tuples in any order.
        let converter = RowConverter::new(vec![SortField::new(DataType::Float64)]).unwrap();
        let found = KeyRows::new(converter.convert_columns(&b.dims[0].distinct).unwrap());
        let asked: ArrayRef = Arc::new(Float64Array::from(vec![-10.0, 10.0, 5.0, 0.0]));
        let asked = converter.convert_columns(&[asked]).unwrap();
        let at: Vec<Option<usize>> = (0..4).map(|i| found.find(asked.row(i))).collect();
        assert_eq!(at, vec![Some(2), Some(0), None, Some(1)]);
        // Near a hint, or not: the same tuples.
        for near in [None, Some(0), Some(1), Some(2), Some(7)] {
            let at: Vec<Option<usize>> = (0..4)
                .map(|i| found.find_near(asked.row(i), near))
                .collect();
            assert_eq!(at, vec![Some(2), Some(0), None, Some(1)], "near {near:?}");
        }
    }

    #[test]
    fn rows_of_runs_are_the_cells_they_cover() {
        use datafusion::arrow::array::{AsArray, Float64Array};
        use datafusion::arrow::datatypes::Float64Type;
        // A dense array with NULLs (cells without a row), read as runs of
        // three lengths: by index, copied, and one run (sliced).
        let dense: Float64Array = (0..400)
            .map(|i| (i % 7 != 3).then_some(f64::from(i) * 0.5))
            .collect();
        let dense: ArrayRef = Arc::new(dense);
        for (starts, run) in [
            (vec![5u32, 40, 40, 90, 2, 300], 3usize),
            (vec![100, 0, 100, 250], 70),
            (vec![17], 350),
        ] {
            let runs = BroadcastRuns {
                dense: Arc::clone(&dense),
                starts: starts.clone().into(),
                run,
            };
            let cells = expand(&starts, run);
            assert_eq!(runs.len(), cells.len());
            for start in [0, 1, run - 1, run, cells.len() / 2, cells.len() - 1] {
                for len in [0, 1, 2, run, run + 1, 2 * run + 5, cells.len()] {
                    let len = len.min(cells.len() - start);
                    let got = runs.rows(start, len).unwrap();
                    let indices = UInt32Array::from(cells[start..start + len].to_vec());
                    let want = take(dense.as_ref(), &indices, None).unwrap();
                    assert_eq!(&got, &want, "runs of {run}, rows {start}+{len}");
                }
            }
            assert!(runs.rows(cells.len(), 1).is_err());
            // Rows within one run are the dense array's own values.
            if starts.len() > 1 {
                let got = runs.rows(run + 1, run - 2).unwrap();
                let got = got.as_primitive::<Float64Type>().values().as_ptr();
                let dense = dense.as_primitive::<Float64Type>().values();
                let at = starts[1] as usize + 1;
                assert_eq!(got, dense[at..].as_ptr(), "runs of {run}: copied");
            }
        }
    }
}

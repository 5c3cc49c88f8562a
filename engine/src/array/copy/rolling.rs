//! `COPY` of rolling windows, chunk by chunk: when the query is a
//! [`RollingWindow`] (see [`crate::array::rolling`]) with the table's
//! dimensions as they are (in its order) and variables that are
//! `float32`/`float64` expressions of its aggregates and input columns
//! (or its counts), the result is a grid known before anything is read:
//! the selected coordinates. It is written in the two steps of a
//! [`selection`](super::selection) copy, blockwise into an intermediate
//! store in `work_dir` and then rechunked into the target, where step 1
//! is the rolling operator's own: each writer takes a run of the
//! intermediate chunks along the rolled dimension, and the frames' overlap
//! before a chunk is the end of the chunk before it, kept, not read again.
//!
//! ```sql
//! COPY (SELECT time, lat, lon, avg(t2m) OVER (PARTITION BY lat, lon ORDER BY time
//!       ROWS BETWEEN 23 PRECEDING AND CURRENT ROW) AS t2m_24h FROM era5)
//! TO 'era5_24h.zarr' STORED AS ZARR;
//! ```
//!
//! Both steps run inside `allowed_mem` whatever the size of the result;
//! fewer writers run where they do not fit together, and a copy whose one
//! writer cannot fit is refused before it runs. A window over
//! `rechunk(...)` reads the source as it is stored (the frames reach
//! across any chunks) and is written in the rechunk's chunks. A window over
//! the columns of a table joined in (an anomaly's running mean) computes
//! that table first and holds it beside the writers, as a selection copy
//! does.

use std::collections::BTreeSet;
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, RecordBatch};
use datafusion::arrow::buffer::Buffer;
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::ArrowNativeType;
use datafusion::arrow::datatypes::{DataType, Float32Type, Float64Type, Int64Type};
use datafusion::catalog::Session;
use datafusion::common::{exec_err, human_readable_size, DataFusionError, Result};
use datafusion::logical_expr::dml::CopyTo;
use datafusion::logical_expr::physical_planning_context::PhysicalPlanningContext;
use datafusion::logical_expr::{Expr, ExprSchemable, LogicalPlan, UserDefinedLogicalNodeCore};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion::physical_planner::PhysicalPlanner;
use zarrs::array::Array as ZarrsArray;
use zarrs::storage::ReadableWritableListableStorageTraits;

use super::selection::SelectionCopyExec;
use super::steps::{CopyGrid, OutputVariable};
use super::whole::split_columns;
use crate::array::blockwise::{
    BlockwiseStep, JoinedMemory, MayWrite, Step, StepBytes, StepWriters,
};
use crate::array::rolling::exec::{Meters, Roller, Rolling};
use crate::array::rolling::{RollOp, RollingWindow, RollingWindowExec};
use crate::array::scan_path::through_projections;
use crate::array::tasks::{fitting_workers, run_tasks};
use crate::memory::Projection;
use crate::plan_methods::{leaf_node_methods, node_identity};
use crate::table::share_of_runs;
use crate::table::BlockGrid;
use crate::write::store::store_box;
use crate::write::target::CopyTarget;
use crate::zarr::StoreLocation;

/// The [`RollingCopy`] that a COPY is, when its query is a rolling window
/// over a Zarr table with every dimension as it is (in the table's order)
/// and at least one `float32`/`float64` expression of the window's columns
/// (or one of its counts, `int64`).
pub(crate) fn rolling_copy(copy: &CopyTo) -> Result<Option<RollingCopy>> {
    let Some(to) = CopyTarget::of(copy)? else {
        return Ok(None);
    };
    let columns = copy.input.schema().columns();
    let exprs = columns.iter().cloned().map(Expr::Column).collect();
    let Some((LogicalPlan::Extension(extension), exprs)) = through_projections(&copy.input, exprs)?
    else {
        return Ok(None);
    };
    let Some(window) = extension.node.as_any().downcast_ref::<RollingWindow>() else {
        return Ok(None);
    };
    let table = &window.read.table;
    let dims: Vec<&str> = table.dims.iter().map(|d| d.name.as_str()).collect();
    if table.dims.iter().any(|d| d.strict_order().is_none())
        || (to.options.dims)
            .as_ref()
            .is_some_and(|given| given.iter().ne(dims.iter()))
    {
        return Ok(None);
    }
    let n_columns = window.columns.len();
    let aggregate = |e: &Expr| match e {
        Expr::Column(c) => window
            .schema
            .index_of_column(c)
            .ok()
            .and_then(|i| i.checked_sub(n_columns))
            .map(|a| window.aggregates[a].op),
        _ => None,
    };
    let named = columns.iter().map(|c| c.name.as_str()).zip(&exprs);
    // A dimension's own coordinate, through the window.
    let coordinate = |name: &str, expr: &Expr| {
        let Expr::Column(c) = expr else {
            return Ok(false);
        };
        let i = window.schema.index_of_column(c)?;
        Ok(i < n_columns && matches!(&window.columns[i], Expr::Column(d) if d.name == name))
    };
    let variable = |name: &str, expr: &Expr| {
        let data_type = expr.get_type(&window.schema)?;
        let written = match data_type {
            DataType::Float32 | DataType::Float64 => true,
            // A count is never NULL.
            DataType::Int64 => aggregate(expr) == Some(RollOp::Count),
            _ => false,
        };
        Ok(written.then(|| OutputVariable::new(name, expr, data_type)))
    };
    let Some(outputs) = split_columns(&dims, named, coordinate, variable)? else {
        return Ok(None);
    };
    let mut used = BTreeSet::new();
    for c in outputs.iter().flat_map(|o| o.expr.column_refs()) {
        let i = window.schema.index_of_column(c)?;
        if i < n_columns {
            used.insert(i);
        }
    }
    // The window without the input columns no variable reads (the
    // dimensions are the written grid's).
    let keep: Vec<usize> = used.into_iter().collect();
    let mut window = window.keeping(&keep)?;
    // Over `rechunk(...)`: the window reads the source as it is stored
    // (its frames reach across chunks whatever they are) and the result
    // is written in the rechunk's chunks (the COPY's own win).
    let to = match window.read.rechunk.take() {
        Some(rechunk) => to.with_default_chunks(rechunk.chunks()),
        None => to,
    };
    Ok(Some(RollingCopy {
        window,
        outputs,
        to,
    }))
}

/// `COPY` of rolling windows over a Zarr table. A leaf node (its window
/// reads the table itself) whose output is the row count.
#[derive(Debug, Clone)]
pub struct RollingCopy {
    /// The window, with the input columns the variables read.
    pub window: RollingWindow,
    /// The variables written, over the window's columns.
    pub outputs: Vec<OutputVariable>,
    /// Where it writes.
    pub to: CopyTarget,
}

impl RollingCopy {
    /// Plans the copy over `exec`, its window's operator (with the tables
    /// joined in that it reads): the chunks of both steps and their
    /// memory; refused when the target exists, the selection is empty or
    /// a step cannot fit the memory budget beside the tables joined in.
    pub fn plan(
        &self,
        exec: RollingWindowExec,
        planner: &dyn PhysicalPlanner,
        session: &dyn Session,
        planning: &PhysicalPlanningContext,
    ) -> Result<SelectionCopyExec> {
        self.to.check()?;
        let rolling = Arc::clone(exec.rolling());
        let grid = CopyGrid::new(
            Arc::clone(&rolling.read.table),
            rolling.read.selection.clone(),
            &self.outputs,
            // An input column of the window, not an aggregate.
            &|expr| match expr {
                Expr::Column(c) => (self.window.schema.index_of_column(c).ok())
                    .and_then(|i| self.window.columns.get(i))
                    .cloned(),
                _ => None,
            },
            &self.to,
            session,
        )?;
        let (table, shape, types) = (&grid.table, &grid.shape, &grid.types);
        let exprs = self
            .outputs
            .iter()
            .map(|o| planner.create_physical_expr(&o.expr, &self.window.schema, session, planning))
            .collect::<Result<Vec<_>>>()?;
        let target = grid.target_chunks();
        let batch_size = session.config().batch_size().max(1);
        let broadcasts = exec.broadcasts().clone();
        let joined = JoinedMemory::of(session.runtime_env().memory_pool.as_ref(), &broadcasts);
        let limit = joined.left_bytes();
        let threads = exec.partitions() as u64;
        // Intermediate chunks of the window's blocks (in selected
        // positions), or of whole target chunks when those fit.
        let natural: Vec<u64> = (rolling.read.blocks.block_shape().iter())
            .zip(shape)
            .map(|(&b, &n)| b.clamp(1, n.max(1)))
            .collect();
        let aligned: Vec<u64> = (natural.iter().zip(target).zip(shape))
            .map(|((&b, &t), &n)| match b {
                b if b >= n => n,
                b if b >= t => b / t * t,
                _ => t.min(n),
            })
            .collect();
        let fits = |block: &[u64]| {
            let (memory, chunk) = writer_memory(&rolling, block, types, batch_size);
            let workers = threads.clamp(1, BlockGrid::covering(shape, block).num_blocks());
            limit.is_none_or(|limit| {
                workers.saturating_mul(memory.saturating_add(chunk.saturating_mul(2))) <= limit
            })
        };
        let block = if fits(&aligned) { aligned } else { natural };
        let metrics = ExecutionPlanMetricsSet::new();
        let writers = RollChunks::plan(
            rolling,
            exprs,
            (&block, shape, types),
            (threads, batch_size, joined),
            &table.store,
            metrics.clone(),
        )?;
        let step = Step::Writers(Box::new(writers));
        Ok(SelectionCopyExec::new(
            Arc::new(grid.blockwise(block, step, joined.left())?),
            metrics,
        )
        .with_broadcasts(broadcasts))
    }

    #[allow(clippy::type_complexity)]
    fn key(&self) -> (&RollingWindow, &Vec<OutputVariable>, &StoreLocation) {
        (&self.window, &self.outputs, &self.to.location)
    }
}

node_identity!(
    RollingCopy,
    eq: |a, b| a.key() == b.key() && a.to == b.to,
    hash: |node, mut state| node.key().hash(&mut state)
);

impl UserDefinedLogicalNodeCore for RollingCopy {
    leaf_node_methods!("RollingCopy", to.schema);

    fn fmt_for_explain(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let outputs: Vec<String> = self.outputs.iter().map(|o| o.to_string()).collect();
        write!(
            f,
            "RollingCopy: target={}, variables=[{}], ",
            self.to.location,
            outputs.join(", ")
        )?;
        self.window.fmt_for_explain(f)
    }
}

/// What a writer of chunks of shape `block` of variables of `types` holds:
/// the window's partition over a chunk and the chunk it fills (and
/// encodes, written straight into the target); and the chunk alone.
fn writer_memory(rolling: &Rolling, block: &[u64], types: &[DataType], batch: usize) -> (u64, u64) {
    let width: u64 = (types.iter())
        .map(|t| t.primitive_width().unwrap_or(8) as u64)
        .sum();
    let chunk = block.iter().fold(width, |n, &b| n.saturating_mul(b));
    (
        (rolling.partition_memory(block, (batch, 1)) as u64).saturating_add(chunk),
        chunk,
    )
}

/// Step 1 of a rolling copy: each writer rolls a run of the intermediate
/// chunks along the rolled dimension (chunks numbered with it innermost),
/// keeping the frames' overlap from one chunk to the next.
pub(crate) struct RollChunks {
    rolling: Arc<Rolling>,
    /// The variables, over the window's rows.
    exprs: Vec<Arc<dyn PhysicalExpr>>,
    workers: usize,
    per_worker: u64,
    batch_size: usize,
    metrics: ExecutionPlanMetricsSet,
}

impl StepWriters for RollChunks {
    fn memory(&self) -> u64 {
        self.workers as u64 * self.per_worker
    }

    fn workers(&self) -> usize {
        self.workers
    }

    fn exprs(&self) -> &[Arc<dyn PhysicalExpr>] {
        &self.exprs
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn planned_read(&self, copy: &BlockwiseStep) -> u64 {
        // The selected cells (their halos left out).
        let read = &self.rolling.read;
        let cells = (copy.shape.iter()).fold(1u64, |n, &len| n.saturating_mul(len));
        cells.saturating_mul(read.table.decoded_cell_bytes(&read.columns))
    }

    fn write_chunks(
        &self,
        copy: &BlockwiseStep,
        arrays: &[ZarrsArray<dyn ReadableWritableListableStorageTraits>],
        tasks: Range<u64>,
        may_write: &MayWrite<'_>,
        cancelled: &AtomicBool,
    ) -> Result<StepBytes> {
        let dim = self.rolling.dim;
        let workers = self.workers as u64;
        let chunks = copy.chunks();
        let unit = self.rolling.share_unit(&chunks, workers);
        let all = tasks;
        let read = run_tasks(
            workers,
            self.workers,
            cancelled,
            || (),
            |(), writer| {
                let meters = Meters::new(&self.metrics, writer as usize);
                // Boxes as long as the chunk along the dimension, at most.
                let span = copy.block[dim];
                let mut roller = Roller::new(&self.rolling, span, self.batch_size, meters);
                // The chunk's values, reused from one chunk to the next.
                let mut values: Vec<Values> = copy.types.iter().map(Values::new).collect();
                let run = share_of_runs(all.clone(), writer, workers, unit);
                for j in self.rolling.walked(run) {
                    if cancelled.load(Ordering::Relaxed) {
                        break;
                    }
                    let compact = chunks.block_along(dim, j);
                    may_write().map_err(|e| {
                        DataFusionError::Execution(format!(
                            "the COPY of '{}', chunk {j}: {e}",
                            copy.store()
                        ))
                    })?;
                    self.write_chunk(copy, &compact, &mut roller, &mut values, arrays)?;
                }
                Ok::<_, DataFusionError>(roller.bytes_decoded())
            },
        )?;
        let cells = all.map(|t| copy.chunk_cells(t)).sum::<u64>();
        Ok(StepBytes {
            read,
            written: cells.saturating_mul(copy.cell_bytes()),
        })
    }
}

impl RollChunks {
    /// The writers of `rolling`'s windows into chunks of shape `block` of
    /// the selected `shape`, variables `exprs` of `types` (over the
    /// window's rows), on at most `threads` threads of batches of
    /// `batch_size` rows; refused (naming `store`) when they cannot fit
    /// the session's limit beside the tables joined in (`joined`).
    pub(crate) fn plan(
        rolling: Arc<Rolling>,
        exprs: Vec<Arc<dyn PhysicalExpr>>,
        (block, shape, types): (&[u64], &[u64], &[DataType]),
        (threads, batch_size, joined): (u64, usize, JoinedMemory),
        store: &str,
        metrics: ExecutionPlanMetricsSet,
    ) -> Result<Self> {
        let (per_worker, chunk_bytes) = writer_memory(&rolling, block, types, batch_size);
        let chunks = BlockGrid::covering(shape, block).num_blocks();
        // As many writers as fit beside the tables (refused when one does
        // not).
        let workers = fitting_workers(threads, chunks, per_worker, joined.left_bytes()) as usize;
        if let Some(limit) = joined.limit {
            let bytes = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
            Projection::new(
                "COPY TO Zarr of rolling windows",
                store,
                workers,
                "writer",
                bytes(per_worker),
            )
            .holding(format!(
                "the window's blocks of shape {block:?} with their overlap, and a chunk of {}",
                human_readable_size(bytes(chunk_bytes))
            ))
            .and(joined.held, "tables joined in")
            .advice(
                "raise the limit, shorten the frames or lower zarrfusion.target_partition_bytes",
            )
            .check(limit)?;
        }
        Ok(Self {
            rolling,
            exprs,
            workers,
            per_worker,
            batch_size,
            metrics,
        })
    }

    /// The window the writers roll.
    pub(crate) fn rolling(&self) -> &Arc<Rolling> {
        &self.rolling
    }

    /// The rows of a batch the window rolls.
    pub(crate) fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// One chunk, `compact` (selected positions): the rolling windows of
    /// the source boxes it covers, evaluated and written.
    fn write_chunk(
        &self,
        copy: &BlockwiseStep,
        compact: &[Range<u64>],
        roller: &mut Roller<'_>,
        values: &mut [Values],
        arrays: &[ZarrsArray<dyn ReadableWritableListableStorageTraits>],
    ) -> Result<()> {
        let chunk: Vec<usize> = compact.iter().map(|r| (r.end - r.start) as usize).collect();
        let cells: usize = chunk.iter().product();
        values.iter_mut().for_each(|v| v.reset(cells));
        roller.enter(compact);
        // Per dimension, the source ranges the chunk covers and where
        // each starts in the chunk.
        let (_, selection) = copy.selected()?;
        let pieces: Vec<Vec<(Range<u64>, usize)>> = compact
            .iter()
            .enumerate()
            .map(|(d, r)| source_pieces(selection.ranges(d), r))
            .collect();
        let mut boxes = boxes(&pieces);
        if self.rolling.backward() {
            boxes.reverse();
        }
        for (b, offsets) in boxes {
            let shape: Vec<usize> = b.iter().map(|r| (r.end - r.start) as usize).collect();
            let mut row = 0;
            let mut sink = |batch: RecordBatch| -> Result<bool> {
                for ((expr, out), data_type) in
                    self.exprs.iter().zip(values.iter_mut()).zip(&copy.types)
                {
                    let v = expr.evaluate(&batch)?.into_array(batch.num_rows())?;
                    let v = cast(&v, data_type)?;
                    out.scatter(&v, row, &shape, &offsets, &chunk)?;
                }
                row += batch.num_rows();
                Ok(true)
            };
            roller.roll(&b, &mut sink)?;
        }
        for (array, values) in arrays.iter().zip(values) {
            values.with_bytes(|bytes| {
                store_box(array, compact, bytes)
                    .map_err(|e| DataFusionError::Execution(format!("COPY TO Zarr: {e}")))
            })?;
        }
        Ok(())
    }
}

impl fmt::Display for RollChunks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}, {} writers in runs along it, {} per writer",
            self.rolling.describe(),
            self.workers,
            human_readable_size(self.per_worker as usize)
        )
    }
}

/// The source ranges of selected positions `compact` of `ranges` (sorted,
/// disjoint), each with its offset from `compact.start`.
fn source_pieces(ranges: &[Range<u64>], compact: &Range<u64>) -> Vec<(Range<u64>, usize)> {
    let mut pieces = Vec::new();
    let mut ordinal = 0u64;
    for r in ranges {
        let len = r.end - r.start;
        let start = compact.start.max(ordinal);
        let end = compact.end.min(ordinal + len);
        if start < end {
            let source = r.start + (start - ordinal)..r.start + (end - ordinal);
            pieces.push((source, (start - compact.start) as usize));
        }
        ordinal += len;
        if ordinal >= compact.end {
            break;
        }
    }
    pieces
}

/// The boxes (C order) of the Cartesian product of per-dimension pieces,
/// each with its offsets in the chunk.
fn boxes(pieces: &[Vec<(Range<u64>, usize)>]) -> Vec<(Vec<Range<u64>>, Vec<usize>)> {
    let mut out = vec![(Vec::new(), Vec::new())];
    for dim in pieces {
        out = out
            .into_iter()
            .flat_map(|(b, o)| {
                dim.iter().map(move |(r, at)| {
                    let (mut b, mut o) = (b.clone(), o.clone());
                    b.push(r.clone());
                    o.push(*at);
                    (b, o)
                })
            })
            .collect();
    }
    out
}

/// A chunk of one variable being filled.
enum Values {
    F64(Vec<f64>),
    F32(Vec<f32>),
    I64(Vec<i64>),
}

impl Values {
    /// No values yet, of `data_type`.
    fn new(data_type: &DataType) -> Self {
        match data_type {
            DataType::Float32 => Values::F32(Vec::new()),
            DataType::Int64 => Values::I64(Vec::new()),
            _ => Values::F64(Vec::new()),
        }
    }

    /// `cells` missing values (the memory of those before reused).
    fn reset(&mut self, cells: usize) {
        match self {
            Values::F64(v) => {
                v.clear();
                v.resize(cells, f64::NAN);
            }
            Values::F32(v) => {
                v.clear();
                v.resize(cells, f32::NAN);
            }
            Values::I64(v) => {
                v.clear();
                v.resize(cells, 0);
            }
        }
    }

    /// Calls `f` with the values' little-endian bytes (without a copy: an
    /// Arrow buffer over them, taken back after).
    fn with_bytes<T>(&mut self, f: impl FnOnce(&[u8]) -> Result<T>) -> Result<T> {
        fn over<V: ArrowNativeType, T>(
            values: &mut Vec<V>,
            f: impl FnOnce(&[u8]) -> Result<T>,
        ) -> Result<T> {
            let buffer = Buffer::from_vec(std::mem::take(values));
            let out = f(buffer.as_slice());
            // The buffer holds the only reference: the vector comes back.
            *values = buffer.into_vec().unwrap_or_default();
            out
        }
        match self {
            Values::F64(v) => over(v, f),
            Values::F32(v) => over(v, f),
            Values::I64(v) => over(v, f),
        }
    }

    /// Puts `values`, rows `row..` (C order) of a box of `shape` that
    /// starts at `offsets` in a chunk of `chunk`, in place; NULL as NaN.
    fn scatter(
        &mut self,
        values: &ArrayRef,
        row: usize,
        shape: &[usize],
        offsets: &[usize],
        chunk: &[usize],
    ) -> Result<()> {
        let last = shape[shape.len() - 1];
        let mut done = 0;
        while done < values.len() {
            let at = row + done;
            let run = (last - at % last).min(values.len() - done);
            // The chunk position of box cell `at`.
            let (mut rest, mut position, mut stride) = (at, 0, 1);
            for d in (0..shape.len()).rev() {
                position += (offsets[d] + rest % shape[d]) * stride;
                rest /= shape[d];
                stride *= chunk[d];
            }
            let nulls = values.logical_nulls();
            let null = |k: usize| nulls.as_ref().is_some_and(|n| n.is_null(done + k));
            match self {
                Values::F64(out) => {
                    let v = &values.as_primitive::<Float64Type>().values()[done..done + run];
                    for (k, (o, &x)) in out[position..position + run].iter_mut().zip(v).enumerate()
                    {
                        *o = if null(k) { f64::NAN } else { x };
                    }
                }
                Values::F32(out) => {
                    let v = &values.as_primitive::<Float32Type>().values()[done..done + run];
                    for (k, (o, &x)) in out[position..position + run].iter_mut().zip(v).enumerate()
                    {
                        *o = if null(k) { f32::NAN } else { x };
                    }
                }
                Values::I64(out) => {
                    if (0..run).any(null) {
                        return exec_err!("COPY TO Zarr: a NULL count");
                    }
                    let v = &values.as_primitive::<Int64Type>().values()[done..done + run];
                    out[position..position + run].copy_from_slice(v);
                }
            }
            done += run;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_of_selected_positions_maps_to_its_source_pieces() {
        let ranges = [2..5, 7..8, 10..14];
        // Selected positions: 2 3 4 | 7 | 10 11 12 13 (ordinals 0..8).
        assert_eq!(source_pieces(&ranges, &(0..3)), vec![(2..5, 0)]);
        assert_eq!(
            source_pieces(&ranges, &(2..6)),
            vec![(4..5, 0), (7..8, 1), (10..12, 2)]
        );
        assert_eq!(source_pieces(&ranges, &(6..8)), vec![(12..14, 0)]);
    }

    #[test]
    fn a_box_s_rows_land_at_its_offsets_in_the_chunk() {
        use datafusion::arrow::array::Float64Array;
        // A 2 x 3 box at (1, 1) of a 3 x 4 chunk, in two batches.
        let mut chunk = Values::new(&DataType::Float64);
        chunk.reset(12);
        let first: ArrayRef = Arc::new(Float64Array::from(vec![Some(1.0), Some(2.0)]));
        let rest: ArrayRef = Arc::new(Float64Array::from(vec![
            Some(3.0),
            None,
            Some(5.0),
            Some(6.0),
        ]));
        chunk.scatter(&first, 0, &[2, 3], &[1, 1], &[3, 4]).unwrap();
        chunk.scatter(&rest, 2, &[2, 3], &[1, 1], &[3, 4]).unwrap();
        let Values::F64(got) = chunk else {
            unreachable!()
        };
        let n = f64::NAN;
        let want = [n, n, n, n, n, 1.0, 2.0, 3.0, n, n, 5.0, 6.0];
        assert_eq!(
            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        // The NULL (row 3, box cell (1, 0)) is NaN at (2, 1).
        assert!(got[9].is_nan());
    }
}

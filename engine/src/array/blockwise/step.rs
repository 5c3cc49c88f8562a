//! The blockwise step: every chunk of a grid's variables made on its own
//! by a kernel, into arrays of a store (a scratch store in `work_dir`, or
//! the target), each task writing whole chunks.
//!
//! - [`BlockwiseStep`]: the grid written ([`StepGrid`]: what a selection
//!   keeps of a table, or another operator's output), its chunks, its
//!   variables and how its chunks are made ([`Step`]);
//! - [`Evaluate`]: the kernel of a COPY of a selection: expressions over
//!   the source box each chunk covers, read ahead from object stores;
//! - [`StepWriters`]: another operator's kernel (the rolling copy's runs
//!   of chunks, a transform's blocks), which reports its memory, threads
//!   and tasks the same way.
//!
//! Its tasks run on the one task runner ([`crate::array::tasks`]); on a
//! cluster, in runs on the workers ([`super::exec::BlockwiseTasksExec`]).

use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use datafusion::arrow::array::{Array as _, ArrayRef, AsArray, RecordBatch, UInt64Array};
use datafusion::arrow::compute::{cast, take};
use datafusion::arrow::datatypes::{DataType, Float32Type, Float64Type, SchemaRef};
use datafusion::common::{exec_err, internal_err, DataFusionError, Result};
use datafusion::execution::memory_pool::{MemoryLimit, MemoryPool};
use datafusion::physical_expr::PhysicalExpr;
use serde_json::{Map, Value};
use zarrs::array::Array as ZarrsArray;
use zarrs::storage::{ReadableWritableListableStorage, ReadableWritableListableStorageTraits};

use crate::array::tasks::{fitting_workers, run_tasks};
use crate::memory::Projection;
use crate::table::{
    BlockGrid, BoxCells, BroadcastInputs, Coordinate, GridTable, ReadAheadPlan, Selection,
};
use crate::write::options::ZarrWriteOptions;
use crate::write::store::{prepare_group, store_box, GroupCoordinate, GroupVariable, GroupWrite};
use crate::zarr::{decoded_attributes, ChunkBufferPool};

/// The blockwise primitive (step 1 of a chunk-by-chunk COPY, the blocks
/// of a COPY of a transform, a staged transform's first stage): every
/// chunk of a grid's variables made on its own (on one machine, or in
/// runs of chunks on a cluster's workers).
pub(crate) struct BlockwiseStep {
    /// The grid written.
    pub(crate) grid: StepGrid,
    /// Its shape (positions per dimension).
    pub(crate) shape: Vec<u64>,
    /// The chunks made (of the intermediate store, or of the target).
    pub(crate) block: Vec<u64>,
    /// The variables written, and their types.
    pub(crate) names: Vec<String>,
    pub(crate) types: Vec<DataType>,
    /// The variables' attributes.
    pub(crate) attributes: Vec<Map<String, Value>>,
    /// How the chunks are made.
    pub(crate) step: Step,
}

/// The grid a [`BlockwiseStep`] writes.
pub(crate) enum StepGrid {
    /// What a selection keeps of a table (a COPY of a selection or of
    /// rolling windows): the coordinates are the selected ones.
    Selected {
        table: Arc<GridTable>,
        selection: Selection,
    },
    /// Another operator's output (a transform's), whose coordinates that
    /// operator writes: the store it is computed from and its dimensions.
    Output { store: String, dims: Vec<String> },
}

/// The decoded bytes a run of a step's tasks read and wrote (what
/// `EXPLAIN ANALYZE` shows as `bytes_read` and `bytes_written`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StepBytes {
    /// Decoded bytes read: the source boxes, blocks or intermediates.
    pub(crate) read: u64,
    /// Decoded bytes written.
    pub(crate) written: u64,
}

impl StepBytes {
    /// `part` of `all` tasks' share of `read` and `written` bytes (tasks
    /// that read and write alike).
    pub(crate) fn share(read: u64, written: u64, part: u64, all: u64) -> Self {
        let of = |bytes: u64| (bytes as u128 * part as u128 / all.max(1) as u128) as u64;
        Self {
            read: of(read),
            written: of(written),
        }
    }
}

/// Says whether a store being written still wants chunks (see
/// [`StagedTarget::still_staged`](crate::write::target::StagedTarget)).
pub(crate) type MayWrite<'a> = dyn Fn() -> Result<(), String> + Sync + 'a;

/// How a [`BlockwiseStep`] makes its chunks.
pub(crate) enum Step {
    /// Each chunk on its own: its source box read, the expressions
    /// evaluated over it.
    Evaluate(Evaluate),
    /// Chunks made by another operator's writers (a rolling copy's runs
    /// of chunks along a dimension, a transform's blocks).
    Writers(Box<dyn StepWriters>),
}

/// A [`BlockwiseStep`] made by another operator's writers, its kernel:
/// the rolling copy's, which roll runs of chunks along a dimension, or a
/// transform's, which transform blocks of whole lines.
pub(crate) trait StepWriters: fmt::Display + Send + Sync {
    /// Memory the writers hold together at their peak.
    fn memory(&self) -> u64;
    /// The threads they run on.
    fn workers(&self) -> usize;
    /// The variables' expressions (none for a kernel computing its one
    /// variable itself).
    fn exprs(&self) -> &[Arc<dyn PhysicalExpr>];
    /// The tasks they write the chunks of `copy` in: one per chunk of its
    /// block grid, unless they say otherwise.
    fn tasks(&self, copy: &BlockwiseStep) -> u64 {
        copy.chunks().num_blocks()
    }
    /// The decoded bytes a cluster sizes their tasks by: those written,
    /// unless they say otherwise (a transform's: those it reads).
    fn task_bytes(&self, copy: &BlockwiseStep) -> u64 {
        copy.bytes_written()
    }
    /// The decoded bytes all their tasks read, as planned (what a session
    /// whose tasks ran on a cluster reports): their task bytes, unless
    /// they say otherwise.
    fn planned_read(&self, copy: &BlockwiseStep) -> u64 {
        self.task_bytes(copy)
    }
    /// Writes the chunks numbered `tasks` (in the writers' own order) of
    /// the variables `arrays` of `copy`, each only once `may_write` says
    /// the store still wants it; the decoded bytes read and written.
    fn write_chunks(
        &self,
        copy: &BlockwiseStep,
        arrays: &[ZarrsArray<dyn ReadableWritableListableStorageTraits>],
        tasks: Range<u64>,
        may_write: &MayWrite<'_>,
        cancelled: &AtomicBool,
    ) -> Result<StepBytes>;
    /// The writers as they are, for a cluster's codec.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// Step 1 as expressions of a chunk's source box.
pub(crate) struct Evaluate {
    /// Table columns read (indices into its schema).
    pub(crate) columns: Vec<usize>,
    batch_schema: SchemaRef,
    pub(crate) exprs: Vec<Arc<dyn PhysicalExpr>>,
    pub(crate) workers: usize,
    pub(crate) task_memory: u64,
    /// The source chunks read ahead of the workers (a remote source).
    pub(crate) read_ahead: ReadAheadPlan,
}

/// Chunks as long as the longest of the source's chunks of the variables
/// among `columns` (the table's columns read), within `shape`.
pub(crate) fn source_long_block(table: &GridTable, columns: &[usize], shape: &[u64]) -> Vec<u64> {
    let n_dims = table.dims.len();
    (0..n_dims)
        .map(|d| {
            (columns.iter().filter_map(|&i| table.variable(i)))
                .map(|v| v.chunk_shape()[d])
                .max()
                .unwrap_or(shape[d])
                .clamp(1, shape[d].max(1))
        })
        .collect()
}

impl Evaluate {
    /// Step 1 evaluating `exprs` (over `batch_schema`: the table's
    /// `columns` read) for each chunk of shape `block` of what `grid`'s
    /// selection keeps, on at most `threads` threads; refused when its
    /// tasks cannot fit `limit`, its reads ahead fitted to what is left.
    pub(crate) fn plan(
        grid: &SelectedGrid<'_>,
        block: &[u64],
        columns: Vec<usize>,
        batch_schema: SchemaRef,
        exprs: Vec<Arc<dyn PhysicalExpr>>,
        threads: usize,
        joined: JoinedMemory,
    ) -> Result<Self> {
        let (table, selection, shape) = (grid.table, grid.selection, grid.shape);
        let n_dims = table.dims.len();
        let tasks = BlockGrid::covering(shape, block).num_blocks();
        // A task's source box: the longest source span a chunk covers.
        let spans: Vec<u64> = (0..n_dims)
            .map(|d| max_span(selection.ranges(d), shape[d], block[d]))
            .collect();
        let box_cells = spans.iter().fold(1u64, |n, &s| n.saturating_mul(s));
        let read_bytes: u64 = (columns.iter().filter(|&&i| i >= n_dims))
            .map(|&i| table.peak_cell_bytes(i) as u64)
            .sum::<u64>()
            + columns.iter().filter(|&&i| i < n_dims).count() as u64 * 8;
        let out_bytes: u64 = exprs.len() as u64 * 2 * 8;
        let task_memory = box_cells.saturating_mul(read_bytes + out_bytes);
        // As many workers as fit beside the tables joined in (fewer than
        // threads where their tasks together do not; refused when one
        // does not).
        let workers =
            fitting_workers(threads as u64, tasks, task_memory, joined.left_bytes()) as usize;
        // Each worker decodes a source box at once: its chunks are read
        // ahead whole, in the fewer chunks the memory left holds.
        let mut read_ahead =
            ReadAheadPlan::new(table, &columns, grid.io_concurrency, &spans, workers);
        if let Some(limit) = joined.limit {
            let projection = Projection::new(
                "SelectionCopyExec",
                &table.store,
                workers,
                "task",
                usize::try_from(task_memory).unwrap_or(usize::MAX),
            )
            .holding(format!(
                "a source box of {box_cells} cells and the computed chunk"
            ))
            .and(joined.held, "tables joined in")
            .advice("raise the limit or rechunk the source to smaller chunks");
            projection.check(limit)?;
            read_ahead = read_ahead.within(limit - projection.total());
        }
        Ok(Self {
            columns,
            batch_schema,
            exprs,
            workers,
            task_memory,
            read_ahead,
        })
    }
}

/// The memory limit (a session's, or a worker's) and what the tables
/// joined in (held while a copy writes) take of it: a copy's steps report
/// them as a part of their [`Projection`], checked against the whole
/// limit, so a refusal names them beside the steps' own parts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct JoinedMemory {
    /// Bytes the tables joined in hold.
    pub(crate) held: usize,
    /// The limit (`None`: none).
    pub(crate) limit: Option<usize>,
}

impl JoinedMemory {
    /// What `broadcasts` hold of the memory limit of `pool`.
    pub(crate) fn of(pool: &dyn MemoryPool, broadcasts: &BroadcastInputs) -> Self {
        Self {
            held: broadcasts.memory(),
            limit: match pool.memory_limit() {
                MemoryLimit::Finite(limit) => Some(limit),
                _ => None,
            },
        }
    }

    /// What the steps may hold beside the tables (nothing when they alone
    /// take the limit).
    pub(crate) fn left(&self) -> MemoryLimit {
        match self.limit {
            Some(limit) => MemoryLimit::Finite(limit.saturating_sub(self.held)),
            None => MemoryLimit::Infinite,
        }
    }

    /// [`Self::left`] in bytes, when there is a limit.
    pub(crate) fn left_bytes(&self) -> Option<u64> {
        (self.limit).map(|limit| limit.saturating_sub(self.held) as u64)
    }
}

/// What step 1 of a copy reads: the selection `selection` of `table`,
/// `shape` cells along each dimension, its source chunks read
/// `io_concurrency` at once ahead of the tasks.
pub(crate) struct SelectedGrid<'a> {
    pub(crate) table: &'a GridTable,
    pub(crate) selection: &'a Selection,
    pub(crate) shape: &'a [u64],
    pub(crate) io_concurrency: usize,
}

impl Step {
    /// Memory it holds at its peak.
    pub(crate) fn memory(&self) -> u64 {
        match self {
            Step::Evaluate(e) => (e.workers as u64)
                .saturating_mul(e.task_memory)
                .saturating_add(e.read_ahead.memory() as u64),
            Step::Writers(w) => w.memory(),
        }
    }

    /// The threads it runs on.
    pub(crate) fn workers(&self) -> usize {
        match self {
            Step::Evaluate(e) => e.workers,
            Step::Writers(w) => w.workers(),
        }
    }

    /// The variables' expressions, as shown.
    pub(crate) fn exprs(&self) -> &[Arc<dyn PhysicalExpr>] {
        match self {
            Step::Evaluate(e) => &e.exprs,
            Step::Writers(w) => w.exprs(),
        }
    }
}

impl BlockwiseStep {
    /// Memory it holds at its peak.
    pub(crate) fn memory(&self) -> u64 {
        self.step.memory()
    }

    /// The store its grid is computed from, in errors.
    pub(crate) fn store(&self) -> &str {
        match &self.grid {
            StepGrid::Selected { table, .. } => &table.store,
            StepGrid::Output { store, .. } => store,
        }
    }

    /// Its grid's dimensions.
    pub(crate) fn dim_names(&self) -> Vec<String> {
        match &self.grid {
            StepGrid::Selected { table, .. } => {
                table.dim_names().into_iter().map(String::from).collect()
            }
            StepGrid::Output { dims, .. } => dims.clone(),
        }
    }

    /// The table and selection of a grid that a selection keeps.
    pub(crate) fn selected(&self) -> Result<(&Arc<GridTable>, &Selection)> {
        match &self.grid {
            StepGrid::Selected { table, selection } => Ok((table, selection)),
            StepGrid::Output { store, .. } => {
                internal_err!("the blockwise step over '{store}' writes an operator's output, not a selection")
            }
        }
    }

    /// The variables as the arrays written hold them, in chunks
    /// `chunks` (attributes are the session's to write).
    pub(crate) fn variables(&self, chunks: &[u64]) -> Vec<GroupVariable> {
        (self.names.iter().zip(&self.types))
            .map(|(name, data_type)| GroupVariable {
                name: name.clone(),
                data_type: data_type.clone(),
                shape: self.shape.clone(),
                chunks: chunks.to_vec(),
                attributes: Map::new(),
            })
            .collect()
    }

    /// Decoded bytes of all its variables' cells.
    pub(crate) fn bytes_written(&self) -> u64 {
        let cells = (self.shape.iter()).fold(1u64, |n, &len| n.saturating_mul(len));
        cells.saturating_mul(self.cell_bytes())
    }

    /// The decoded bytes all its tasks read and write, as planned (what a
    /// session whose tasks ran on a cluster reports): for expressions, the
    /// selected cells of the variables they read.
    pub(crate) fn planned_bytes(&self) -> StepBytes {
        let read = match (&self.step, &self.grid) {
            (Step::Evaluate(e), StepGrid::Selected { table, selection }) => {
                (selection.num_cells()).saturating_mul(table.decoded_cell_bytes(&e.columns))
            }
            (Step::Evaluate(_), StepGrid::Output { .. }) => 0,
            (Step::Writers(w), _) => w.planned_read(self),
        };
        StepBytes {
            read,
            written: self.bytes_written(),
        }
    }

    /// The decoded bytes a cluster sizes its tasks by.
    pub(crate) fn task_bytes(&self) -> u64 {
        match &self.step {
            Step::Evaluate(_) => self.bytes_written(),
            Step::Writers(w) => w.task_bytes(self),
        }
    }

    /// Decoded bytes of a cell of the variables written.
    pub(crate) fn cell_bytes(&self) -> u64 {
        (self.types.iter())
            .map(|t| t.primitive_width().unwrap_or(8) as u64)
            .sum()
    }

    /// The cells of chunk `task`.
    pub(crate) fn chunk_cells(&self, task: u64) -> u64 {
        let chunk = self.chunks().block(task);
        chunk.iter().map(|r| r.end - r.start).product()
    }

    /// The chunks of the intermediate store (of the target, written
    /// directly): one task each, in C order.
    pub(crate) fn chunks(&self) -> BlockGrid {
        BlockGrid::covering(&self.shape, &self.block)
    }

    /// Its tasks: one per chunk, or as its writers say.
    pub(crate) fn tasks(&self) -> u64 {
        match &self.step {
            Step::Evaluate(_) => self.chunks().num_blocks(),
            Step::Writers(w) => w.tasks(self),
        }
    }

    /// Starts a store of the result in `storage`: its group, coordinates
    /// (the selected values) and variables in `chunks`, written with
    /// `options`; no metadata is stored yet (see [`prepare_group`]).
    pub(crate) fn group(
        &self,
        storage: &ReadableWritableListableStorage,
        options: &ZarrWriteOptions,
        chunks: &[u64],
    ) -> Result<GroupWrite> {
        let (table, selection) = self.selected()?;
        let mut coordinates = Vec::new();
        for (d, dim) in table.dims.iter().enumerate() {
            let indices: Vec<u64> = selection.ranges(d).iter().flat_map(|r| r.clone()).collect();
            let coords = dim.coordinate.take(&UInt64Array::from(indices))?;
            let attributes = decoded_attributes(&dim.attributes, coords.data_type());
            coordinates.push(GroupCoordinate {
                name: dim.name.clone(),
                values: Coordinate::Values(coords),
                attributes,
                calendar: dim.model_calendar().map(|time| time.calendar()),
                stored: true,
            });
        }
        let variables: Vec<GroupVariable> = self
            .names
            .iter()
            .zip(&self.types)
            .zip(&self.attributes)
            .map(|((name, data_type), attributes)| GroupVariable {
                name: name.clone(),
                data_type: data_type.clone(),
                shape: self.shape.clone(),
                chunks: chunks.to_vec(),
                attributes: attributes.clone(),
            })
            .collect();
        prepare_group(storage, &coordinates, &variables, options)
    }

    /// The chunks numbered `tasks` (in C order; in their own order for
    /// another operator's writers) into `arrays` (an intermediate store's,
    /// or the target's), each written only once `may_write` says the store
    /// still wants it; the decoded bytes written.
    pub(crate) fn write_step(
        &self,
        arrays: &[ZarrsArray<dyn ReadableWritableListableStorageTraits>],
        tasks: Range<u64>,
        may_write: &MayWrite<'_>,
        cancelled: &AtomicBool,
    ) -> Result<StepBytes> {
        if tasks.end > self.tasks() {
            return exec_err!(
                "the COPY of '{}' has {} chunks, not {}",
                self.store(),
                self.tasks(),
                tasks.end
            );
        }
        let bytes = match &self.step {
            Step::Evaluate(e) => {
                let cells = tasks.clone().map(|t| self.chunk_cells(t)).sum::<u64>();
                StepBytes {
                    read: self.write_chunks(e, arrays, tasks, may_write, cancelled)?,
                    written: cells.saturating_mul(self.cell_bytes()),
                }
            }
            Step::Writers(w) => w.write_chunks(self, arrays, tasks, may_write, cancelled)?,
        };
        if cancelled.load(Ordering::Relaxed) {
            return exec_err!("the COPY of '{}' was cancelled", self.store());
        }
        Ok(bytes)
    }

    /// Step 1 by expressions: the chunks numbered `tasks` of the
    /// variables, on `workers` threads; the decoded bytes of the source
    /// boxes read.
    fn write_chunks(
        &self,
        step: &Evaluate,
        arrays: &[ZarrsArray<dyn ReadableWritableListableStorageTraits>],
        tasks: Range<u64>,
        may_write: &MayWrite<'_>,
        cancelled: &AtomicBool,
    ) -> Result<u64> {
        let chunks = self.chunks();
        let (table, selection) = self.selected()?;
        let read_ahead = {
            let (selection, chunks) = (selection.clone(), chunks.clone());
            step.read_ahead.start(
                table,
                &step.columns,
                tasks.clone(),
                step.workers,
                move |task| {
                    let compact = chunks.block(task);
                    vec![source_box(&source_indices(&selection, &compact))]
                },
            )
        };
        run_tasks(
            tasks.end.saturating_sub(tasks.start),
            step.workers,
            cancelled,
            ChunkBufferPool::new,
            |pool, i| {
                let task = tasks.start + i;
                may_write().map_err(|e| {
                    DataFusionError::Execution(format!(
                        "the COPY of '{}', chunk {task}: {e}",
                        table.store
                    ))
                })?;
                let read = self.write_chunk(step, &chunks.block(task), arrays, pool);
                if let Some(read_ahead) = &read_ahead {
                    read_ahead.done_with(task);
                }
                read
            },
        )
    }

    /// One chunk: reads the source box it covers, evaluates the
    /// expressions, keeps the selected cells and writes them; the decoded
    /// bytes of the box read.
    fn write_chunk(
        &self,
        step: &Evaluate,
        compact: &[Range<u64>],
        arrays: &[ZarrsArray<dyn ReadableWritableListableStorageTraits>],
        pool: &ChunkBufferPool,
    ) -> Result<u64> {
        let (table, selection) = self.selected()?;
        let sources = source_indices(selection, compact);
        let extent = source_box(&sources);
        let cells = BoxCells::read(table, &step.columns, &extent, pool)
            .map_err(|e| DataFusionError::External(Box::new(e)))?;
        let batch: RecordBatch = cells.batch(&step.batch_schema, 0, cells.num_cells())?;
        // Positions of the selected cells in the box, unless all are.
        let box_shape: Vec<u64> = extent.iter().map(|r| r.end - r.start).collect();
        let gaps = sources
            .iter()
            .zip(&box_shape)
            .any(|(s, &n)| s.len() as u64 != n);
        let keep = gaps.then(|| selected_positions(&sources, &extent, &box_shape));
        for ((expr, array), data_type) in step.exprs.iter().zip(arrays).zip(&self.types) {
            let values = expr.evaluate(&batch)?.into_array(batch.num_rows())?;
            let values = match &keep {
                Some(keep) => take(values.as_ref(), keep, None)?,
                None => values,
            };
            let values = cast(&values, data_type)?;
            let bytes = nan_filled_bytes(&values)?;
            store_box(array, compact, &bytes)
                .map_err(|e| DataFusionError::Execution(format!("COPY TO Zarr: {e}")))?;
        }
        Ok(cells.decoded_bytes())
    }
}

/// The longest run of source indices that `chunk`-long pieces of the
/// compact positions of `ranges` (`n` positions in all) span.
fn max_span(ranges: &[Range<u64>], n: u64, chunk: u64) -> u64 {
    let mut longest = 0;
    let mut start = 0;
    while start < n {
        let end = (start + chunk).min(n);
        let first = source_index(ranges, start);
        let last = source_index(ranges, end - 1);
        longest = longest.max(last - first + 1);
        start = end;
    }
    longest
}

/// The source index of compact position `p` of the selected `ranges`.
fn source_index(ranges: &[Range<u64>], mut p: u64) -> u64 {
    for r in ranges {
        let len = r.end - r.start;
        if p < len {
            return r.start + p;
        }
        p -= len;
    }
    unreachable!("a position inside the selection")
}

/// Per dimension, the source indices of the compact positions `compact`
/// of `selection`.
fn source_indices(selection: &Selection, compact: &[Range<u64>]) -> Vec<Vec<u64>> {
    compact
        .iter()
        .enumerate()
        .map(|(d, r)| {
            r.clone()
                .map(|p| source_index(selection.ranges(d), p))
                .collect()
        })
        .collect()
}

/// The source box that per-dimension source indices span.
fn source_box(sources: &[Vec<u64>]) -> Vec<Range<u64>> {
    sources
        .iter()
        .map(|s| s.first().map_or(0..0, |&first| first..s[s.len() - 1] + 1))
        .collect()
}

/// Flat positions (C order) in a box of `box_shape` starting at `extent`
/// of the cells whose per-dimension source indices are `sources`.
fn selected_positions(
    sources: &[Vec<u64>],
    extent: &[Range<u64>],
    box_shape: &[u64],
) -> UInt64Array {
    let mut positions = vec![0u64];
    for (d, s) in sources.iter().enumerate() {
        let mut next = Vec::with_capacity(positions.len() * s.len());
        for p in &positions {
            for i in s {
                next.push(p * box_shape[d] + (i - extent[d].start));
            }
        }
        positions = next;
    }
    UInt64Array::from(positions)
}

/// Little-endian bytes of a float column, NULL as NaN.
fn nan_filled_bytes(values: &ArrayRef) -> Result<Vec<u8>> {
    Ok(match values.data_type() {
        DataType::Float64 => values
            .as_primitive::<Float64Type>()
            .iter()
            .flat_map(|v| v.unwrap_or(f64::NAN).to_le_bytes())
            .collect(),
        DataType::Float32 => values
            .as_primitive::<Float32Type>()
            .iter()
            .flat_map(|v| v.unwrap_or(f32::NAN).to_le_bytes())
            .collect(),
        other => return exec_err!("COPY TO Zarr: cannot write {other} chunk by chunk"),
    })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;

    use zarrs::array::ArraySubset;
    use zarrs::storage::store::MemoryStore;

    use super::*;
    use crate::write::store::variable_array;

    /// A kernel filling each chunk with its task's number, counting the
    /// chunks it writes.
    struct Numbered {
        written: AtomicU64,
    }

    impl fmt::Display for Numbered {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "numbered chunks")
        }
    }

    impl StepWriters for Numbered {
        fn memory(&self) -> u64 {
            1 << 10
        }

        fn workers(&self) -> usize {
            2
        }

        fn exprs(&self) -> &[Arc<dyn PhysicalExpr>] {
            &[]
        }

        fn write_chunks(
            &self,
            copy: &BlockwiseStep,
            arrays: &[ZarrsArray<dyn ReadableWritableListableStorageTraits>],
            tasks: Range<u64>,
            may_write: &MayWrite<'_>,
            cancelled: &AtomicBool,
        ) -> Result<StepBytes> {
            let chunks = copy.chunks();
            run_tasks(
                tasks.end - tasks.start,
                self.workers(),
                cancelled,
                || (),
                |(), i| {
                    let task = tasks.start + i;
                    may_write().map_err(DataFusionError::Execution)?;
                    let extent = chunks.block(task);
                    let cells: u64 = extent.iter().map(|r| r.end - r.start).product();
                    let bytes: Vec<u8> = (0..cells)
                        .flat_map(|_| (task as f64).to_le_bytes())
                        .collect();
                    store_box(&arrays[0], &extent, &bytes).map_err(DataFusionError::Execution)?;
                    self.written.fetch_add(1, Ordering::Relaxed);
                    Ok::<_, DataFusionError>(0)
                },
            )?;
            let cells = tasks.map(|t| copy.chunk_cells(t)).sum::<u64>();
            Ok(StepBytes {
                read: 0,
                written: cells * copy.cell_bytes(),
            })
        }

        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }

    fn step(shape: &[u64], block: &[u64]) -> BlockwiseStep {
        BlockwiseStep {
            grid: StepGrid::Output {
                store: "memory://grid".to_string(),
                dims: (0..shape.len()).map(|d| format!("d{d}")).collect(),
            },
            shape: shape.to_vec(),
            block: block.to_vec(),
            names: vec!["v".to_string()],
            types: vec![DataType::Float64],
            attributes: vec![Map::new()],
            step: Step::Writers(Box::new(Numbered {
                written: AtomicU64::new(0),
            })),
        }
    }

    fn array_of(step: &BlockwiseStep) -> ZarrsArray<dyn ReadableWritableListableStorageTraits> {
        let storage: ReadableWritableListableStorage = Arc::new(MemoryStore::new());
        let variables = step.variables(&step.block);
        let options = ZarrWriteOptions::default();
        variable_array(&storage, &variables[0], &step.dim_names(), &options).unwrap()
    }

    fn written(step: &BlockwiseStep) -> u64 {
        let Step::Writers(w) = &step.step else {
            unreachable!()
        };
        let numbered = w.as_any().downcast_ref::<Numbered>().unwrap();
        numbered.written.load(Ordering::Relaxed)
    }

    /// Every cell holds the number of the chunk it falls in, in C order
    /// (counted here by hand, cell by cell), for grids whose last chunks
    /// are cut; the bytes reported are every cell's once.
    #[test]
    fn every_chunk_is_written_once_by_its_task() {
        for (shape, block) in [
            (vec![5u64, 7], vec![2u64, 3]),
            (vec![4, 6], vec![4, 6]),
            (vec![3, 1, 5], vec![1, 1, 2]),
            (vec![9], vec![4]),
        ] {
            let step = step(&shape, &block);
            let array = array_of(&step);
            let tasks = step.tasks();
            let along: Vec<u64> = shape
                .iter()
                .zip(&block)
                .map(|(n, b)| n.div_ceil(*b))
                .collect();
            assert_eq!(
                tasks,
                along.iter().product::<u64>(),
                "{shape:?} in {block:?}"
            );
            let never = AtomicBool::new(false);
            let bytes =
                (step.write_step(std::slice::from_ref(&array), 0..tasks, &|| Ok(()), &never))
                    .unwrap();
            assert_eq!(bytes.written, shape.iter().product::<u64>() * 8);
            assert_eq!(written(&step), tasks);
            let all = ArraySubset::new_with_shape(shape.clone());
            let values: Vec<f64> = array.retrieve_array_subset(&all).unwrap();
            for (flat, value) in values.iter().enumerate() {
                // The cell's index along each dimension, then its chunk's.
                let mut rest = flat as u64;
                let mut index = vec![0u64; shape.len()];
                for d in (0..shape.len()).rev() {
                    index[d] = rest % shape[d];
                    rest /= shape[d];
                }
                let chunk = (0..shape.len()).fold(0u64, |n, d| n * along[d] + index[d] / block[d]);
                assert_eq!(
                    *value, chunk as f64,
                    "{shape:?} in {block:?}, cell {index:?}"
                );
            }
        }
    }

    /// Tasks past the last chunk, a cancelled run and a store that no
    /// longer wants chunks are errors naming the store; an operator's
    /// output grid has no selection or coordinates to give.
    #[test]
    fn a_bad_run_is_an_error_naming_the_store() {
        let step = step(&[5, 7], &[2, 3]);
        let array = array_of(&step);
        let arrays = std::slice::from_ref(&array);
        let never = AtomicBool::new(false);
        let past = step
            .write_step(arrays, 0..10, &|| Ok(()), &never)
            .unwrap_err();
        assert!(
            past.to_string()
                .contains("'memory://grid' has 9 chunks, not 10"),
            "{past}"
        );
        let cancelled = AtomicBool::new(true);
        let stopped = step
            .write_step(arrays, 0..9, &|| Ok(()), &cancelled)
            .unwrap_err();
        assert!(stopped.to_string().contains("cancelled"), "{stopped}");
        let gone = || Err("the store is gone".to_string());
        let refused = step.write_step(arrays, 0..9, &gone, &never).unwrap_err();
        assert!(
            refused.to_string().contains("the store is gone"),
            "{refused}"
        );
        assert_eq!(written(&step), 0);
        let not_selected = step.selected().unwrap_err().to_string();
        assert!(not_selected.contains("'memory://grid'"), "{not_selected}");
        let storage: ReadableWritableListableStorage = Arc::new(MemoryStore::new());
        let options = ZarrWriteOptions::default();
        assert!(step.group(&storage, &options, &step.block).is_err());
    }
}

//! The blockwise primitive of the chunk-by-chunk COPYs (Cubed's
//! `blockwise`, then `rechunk`): what a COPY of a selection or of rolling
//! windows writes, known before anything is read ([`CopyGrid`]: the
//! selected grid, the variables, the target and its chunks), and its two
//! steps ([`Blockwise`]):
//!
//! 1. *blockwise* ([`BlockwiseStep`]): one task per chunk, made by
//!    evaluating expressions over the source box it covers ([`Evaluate`])
//!    or by another operator's writers ([`StepWriters`]: the rolling
//!    copy's), written into an intermediate store in `work_dir`, or into
//!    the target itself when the chunks are whole target chunks;
//! 2. *rechunk*: the intermediate store rechunked into the target by
//!    [`crate::array::rechunk`].
//!
//! Both steps are planned inside `allowed_mem` before anything runs. On a
//! cluster the same steps run as rounds of tasks on the workers
//! ([`super::cluster`]).

use std::fmt;
use std::hash::Hash;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use datafusion::arrow::array::{Array as _, ArrayRef, AsArray, RecordBatch, UInt64Array};
use datafusion::arrow::compute::{cast, take};
use datafusion::arrow::datatypes::{DataType, Float32Type, Float64Type, SchemaRef};
use datafusion::catalog::Session;
use datafusion::common::{exec_err, plan_err, DataFusionError, Result};
use datafusion::execution::memory_pool::MemoryLimit;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::logical_expr::expr::{Cast, TryCast};
use datafusion::logical_expr::Expr;
use datafusion::physical_expr::PhysicalExpr;
use serde_json::{Map, Value};
use zarrs::array::Array as ZarrsArray;
use zarrs::storage::{ReadableWritableListableStorage, ReadableWritableListableStorageTraits};

use crate::array::rechunk::{PreparedRechunk, RechunkOptions, RechunkPlan, TargetEncoding};
use crate::array::tasks::{fitting_workers, run_tasks};
use crate::memory::Projection;
use crate::table::{BlockGrid, BoxCells, Coordinate, GridTable, ReadAheadPlan, Selection};
use crate::write::options::{Codec, ZarrWriteOptions};
use crate::write::scratch::{default_work_dir, ScratchStore};
use crate::write::store::{
    chunk_lengths, coordinate_projection, coordinate_write_memory, prepare_group, store_box,
    GroupCoordinate, GroupVariable, GroupWrite,
};
use crate::write::target::CopyTarget;
use crate::write::write_job::Written;
use crate::zarr::{decoded_attributes, ChunkBufferPool, StoreLocation};

/// One variable of the written store: its name and the expression of the
/// table's columns that computes it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd)]
pub struct OutputVariable {
    /// The variable's name.
    pub name: String,
    /// Its values, over the table's columns.
    pub expr: Expr,
    /// `Float32` or `Float64`.
    pub data_type: DataType,
}

impl OutputVariable {
    /// The variable `name` computed by `expr`, of type `data_type`.
    pub fn new(name: &str, expr: &Expr, data_type: DataType) -> Self {
        Self {
            name: name.to_string(),
            expr: expr.clone(),
            data_type,
        }
    }
}

impl fmt::Display for OutputVariable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} AS {}", self.expr, self.name)
    }
}

/// What a chunk-by-chunk copy writes, known before its step 1 is planned:
/// the grid a selection keeps, the variables, the target and its chunks.
pub(crate) struct CopyGrid {
    pub(crate) table: Arc<GridTable>,
    pub(crate) selection: Selection,
    /// Selected positions per dimension.
    pub(crate) shape: Vec<u64>,
    pub(crate) types: Vec<DataType>,
    pub(crate) rechunk: RechunkOptions,
    names: Vec<String>,
    /// Each variable's attributes: its source's, when it is a variable of
    /// the table as it is (see [`source_attributes`]).
    attributes: Vec<Map<String, Value>>,
    to: CopyTarget,
    target_chunks: Vec<u64>,
    runtime: Arc<RuntimeEnv>,
}

impl CopyGrid {
    /// The copy of what `selection` keeps of `table`, `outputs` written
    /// to `to`; refused when the selection keeps no cell or the options
    /// ask for chunks that cannot be. `copied` gives the expression over
    /// the table's columns an output's expression stands for, when there
    /// is one (an output that is a variable as it is keeps its attributes).
    pub(crate) fn new(
        table: Arc<GridTable>,
        selection: Selection,
        outputs: &[OutputVariable],
        copied: &dyn Fn(&Expr) -> Option<Expr>,
        to: &CopyTarget,
        session: &dyn Session,
    ) -> Result<Self> {
        let shape: Vec<u64> = (0..table.dims.len())
            .map(|d| selection.ranges(d).iter().map(|r| r.end - r.start).sum())
            .collect();
        if shape.contains(&0) {
            return plan_err!(
                "COPY TO Zarr: the filters select no cell of '{}'",
                table.store
            );
        }
        let types: Vec<DataType> = outputs.iter().map(|o| o.data_type.clone()).collect();
        let rechunk = RechunkOptions::for_session(session.config_options(), session.runtime_env())?;
        let target_chunks = target_chunks(&table, &shape, &types, &to.options, &rechunk)?;
        let attributes = (outputs.iter())
            .map(|o| match copied(&o.expr) {
                Some(expr) => source_attributes(&table, &expr),
                None => Map::new(),
            })
            .collect();
        Ok(Self {
            table,
            selection,
            shape,
            types,
            rechunk,
            names: outputs.iter().map(|o| o.name.clone()).collect(),
            attributes,
            to: to.clone(),
            target_chunks,
            runtime: Arc::clone(session.runtime_env()),
        })
    }

    /// What step 1 reads.
    pub(crate) fn selected(&self) -> SelectedGrid<'_> {
        SelectedGrid {
            table: &self.table,
            selection: &self.selection,
            shape: &self.shape,
            io_concurrency: self.rechunk.io_concurrency,
        }
    }

    /// The target's chunk shape.
    pub(crate) fn target_chunks(&self) -> &[u64] {
        &self.target_chunks
    }

    /// Both steps, step 1 being `step` writing chunks of shape `block`,
    /// planned within `limit` (see [`Blockwise::planned`]).
    pub(crate) fn blockwise(
        self,
        block: Vec<u64>,
        step: Step,
        limit: MemoryLimit,
    ) -> Result<Blockwise> {
        Blockwise {
            blocks: Arc::new(BlockwiseStep {
                table: self.table,
                selection: self.selection,
                shape: self.shape,
                block,
                names: self.names,
                types: self.types,
                attributes: self.attributes,
                step,
            }),
            to: self.to,
            target_chunks: self.target_chunks,
            rechunk: self.rechunk,
            stage2_memory: 0,
            direct: false,
            runtime: self.runtime,
        }
        .planned(limit)
    }
}

/// The attributes of a written variable computed by `expr`: those xarray
/// shows of the table's variable when `expr` is that variable as it is
/// (or cast), none when it computes something else.
fn source_attributes(table: &GridTable, expr: &Expr) -> Map<String, Value> {
    let mut expr = expr;
    while let Expr::Cast(Cast { expr: inner, .. }) | Expr::TryCast(TryCast { expr: inner, .. }) =
        expr
    {
        expr = inner;
    }
    let Expr::Column(column) = expr else {
        return Map::new();
    };
    let variable = (table.schema.index_of(&column.name).ok()).and_then(|i| table.variable(i));
    match variable {
        Some(v) => decoded_attributes(v.attributes(), v.data_type()),
        None => Map::new(),
    }
}

/// The target's chunks: as the options ask, else small enough for the
/// rechunk to hold one beside a source chunk and its encoding.
fn target_chunks(
    table: &GridTable,
    shape: &[u64],
    types: &[DataType],
    options: &ZarrWriteOptions,
    rechunk: &RechunkOptions,
) -> Result<Vec<u64>> {
    let names: Vec<&str> = table.dims.iter().map(|d| d.name.as_str()).collect();
    chunk_lengths(
        &names,
        shape,
        width_of(types),
        options,
        rechunk.allowed_mem / 8,
    )
}

/// The projected memory of step 2, the rechunk of an intermediate store
/// in chunks `block` of variables of `types` into `target_chunks`; refused
/// when it cannot fit `allowed_mem`.
fn second_step(
    table: &GridTable,
    shape: &[u64],
    block: &[u64],
    target_chunks: &[u64],
    types: &[DataType],
    rechunk: &RechunkOptions,
) -> Result<u64> {
    let stage2 = RechunkPlan::new(
        shape,
        block,
        target_chunks,
        width_of(types),
        rechunk.allowed_mem,
        rechunk.threads,
    )
    .map_err(|e| {
        DataFusionError::ResourcesExhausted(format!(
            "COPY TO Zarr of a selection of '{}': the rechunk from chunks {block:?} to \
             {target_chunks:?} cannot fit allowed_mem: {e}; raise allowed_mem or choose \
             smaller chunks",
            table.store
        ))
    })?;
    Ok(stage2.projected_memory())
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

/// Everything the two steps need, planned.
pub(crate) struct Blockwise {
    /// Step 1.
    pub(crate) blocks: Arc<BlockwiseStep>,
    pub(crate) to: CopyTarget,
    pub(crate) target_chunks: Vec<u64>,
    pub(crate) rechunk: RechunkOptions,
    pub(crate) stage2_memory: u64,
    /// Whether step 1 writes the target's chunks itself (see
    /// [`Blockwise::planned`]).
    pub(crate) direct: bool,
    /// The planning session's runtime (its object stores).
    pub(crate) runtime: Arc<RuntimeEnv>,
}

/// Step 1 of a [`Blockwise`] copy, the blockwise primitive: every chunk
/// of the selected grid's variables made on its own (on one machine, or
/// in runs of chunks on a cluster's workers).
pub(crate) struct BlockwiseStep {
    pub(crate) table: Arc<GridTable>,
    pub(crate) selection: Selection,
    /// The written grid's shape (selected positions per dimension).
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

/// Says whether a store being written still wants chunks (see
/// [`StagedTarget::still_staged`](crate::write::target::StagedTarget)).
pub(crate) type MayWrite<'a> = dyn Fn() -> Result<(), String> + Sync + 'a;

/// How step 1 of a [`Blockwise`] copy makes its chunks.
pub(crate) enum Step {
    /// Each chunk on its own: its source box read, the expressions
    /// evaluated over it.
    Evaluate(Evaluate),
    /// Chunks made by another operator's writers (a rolling copy's runs
    /// of chunks along a dimension).
    Writers(Box<dyn StepWriters>),
}

/// Step 1 of a [`Blockwise`] copy made by another operator's writers: the
/// rolling copy's, which roll runs of chunks along a dimension.
pub(crate) trait StepWriters: fmt::Display + Send + Sync {
    /// Memory the writers hold together at their peak.
    fn memory(&self) -> u64;
    /// The threads they run on.
    fn workers(&self) -> usize;
    /// The variables' expressions.
    fn exprs(&self) -> &[Arc<dyn PhysicalExpr>];
    /// Writes the chunks numbered `tasks` (in the writers' own order) of
    /// the intermediate variables `arrays` of `copy`, each only once
    /// `may_write` says the store still wants it.
    fn write_chunks(
        &self,
        copy: &BlockwiseStep,
        arrays: &[ZarrsArray<dyn ReadableWritableListableStorageTraits>],
        tasks: Range<u64>,
        may_write: &MayWrite<'_>,
        cancelled: &AtomicBool,
    ) -> Result<()>;
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
                .clamp(1, shape[d])
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
        limit: &MemoryLimit,
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
        // As many workers as fit (fewer than threads where their tasks
        // together do not; refused when one does not).
        let finite = match *limit {
            MemoryLimit::Finite(limit) => Some(limit as u64),
            _ => None,
        };
        let workers = fitting_workers(threads as u64, tasks, task_memory, finite) as usize;
        // Each worker decodes a source box at once: its chunks are read
        // ahead whole, in the fewer chunks the memory left holds.
        let mut read_ahead =
            ReadAheadPlan::new(table, &columns, grid.io_concurrency, &spans, workers);
        if let MemoryLimit::Finite(limit) = *limit {
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
    /// Memory step 1 holds at its peak.
    fn memory(&self) -> u64 {
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

    pub(crate) fn tasks(&self) -> u64 {
        self.chunks().num_blocks()
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
        let mut coordinates = Vec::new();
        for (d, dim) in self.table.dims.iter().enumerate() {
            let indices: Vec<u64> = self
                .selection
                .ranges(d)
                .iter()
                .flat_map(|r| r.clone())
                .collect();
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

    /// Step 1 into `arrays` (the intermediate store's, or the target's):
    /// the chunks numbered `tasks` (in C order; in their own order for
    /// another operator's writers).
    /// Each chunk is written only once `may_write` says the store still
    /// wants it.
    pub(crate) fn write_step(
        &self,
        arrays: &[ZarrsArray<dyn ReadableWritableListableStorageTraits>],
        tasks: Range<u64>,
        may_write: &MayWrite<'_>,
        cancelled: &AtomicBool,
    ) -> Result<()> {
        match &self.step {
            Step::Evaluate(e) => self.write_chunks(e, arrays, tasks, may_write, cancelled)?,
            Step::Writers(w) => {
                if tasks.end > self.tasks() {
                    return exec_err!(
                        "the COPY of '{}' has {} chunks, not {}",
                        self.table.store,
                        self.tasks(),
                        tasks.end
                    );
                }
                w.write_chunks(self, arrays, tasks, may_write, cancelled)?
            }
        }
        if cancelled.load(Ordering::Relaxed) {
            return exec_err!("the COPY of '{}' was cancelled", self.table.store);
        }
        Ok(())
    }

    /// Step 1 by expressions: the chunks numbered `tasks` of the
    /// variables, on `workers` threads.
    fn write_chunks(
        &self,
        step: &Evaluate,
        arrays: &[ZarrsArray<dyn ReadableWritableListableStorageTraits>],
        tasks: Range<u64>,
        may_write: &MayWrite<'_>,
        cancelled: &AtomicBool,
    ) -> Result<()> {
        let chunks = self.chunks();
        if tasks.end > chunks.num_blocks() {
            return exec_err!(
                "the COPY of '{}' has {} chunks, not {}",
                self.table.store,
                chunks.num_blocks(),
                tasks.end
            );
        }
        let read_ahead = {
            let (selection, chunks) = (self.selection.clone(), chunks.clone());
            step.read_ahead.start(
                &self.table,
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
                        self.table.store
                    ))
                })?;
                let written = self.write_chunk(step, &chunks.block(task), arrays, pool);
                if let Some(read_ahead) = &read_ahead {
                    read_ahead.done_with(task);
                }
                written.map(|()| 0)
            },
        )?;
        Ok(())
    }

    /// One chunk: reads the source box it covers, evaluates the
    /// expressions, keeps the selected cells and writes them.
    fn write_chunk(
        &self,
        step: &Evaluate,
        compact: &[Range<u64>],
        arrays: &[ZarrsArray<dyn ReadableWritableListableStorageTraits>],
        pool: &ChunkBufferPool,
    ) -> Result<()> {
        let sources = source_indices(&self.selection, compact);
        let extent = source_box(&sources);
        let cells = BoxCells::read(&self.table, &step.columns, &extent, pool)
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
        Ok(())
    }
}

impl Blockwise {
    pub(crate) fn projected_memory(&self) -> u64 {
        if self.direct {
            return self.direct_memory().max(self.coordinate_memory());
        }
        (self.blocks.step.memory())
            .max(self.stage2_memory)
            .max(self.coordinate_memory())
    }

    /// The memory writing the coordinates holds (before the steps run).
    pub(crate) fn coordinate_memory(&self) -> u64 {
        coordinate_write_memory(&self.blocks.shape)
    }

    /// What writing it did, step 2 (the rechunk, when there is one)
    /// having read and written `step2` decoded bytes.
    pub(crate) fn written(&self, step2: (u64, u64)) -> Written {
        let blocks = &self.blocks;
        let cells = (blocks.shape.iter()).fold(1u64, |n, &len| n.saturating_mul(len));
        Written {
            rows: cells,
            bytes_read: step2.0,
            bytes_written: cells
                .saturating_mul(blocks.cell_bytes())
                .saturating_add(step2.1),
        }
    }

    /// The directory (or prefix) of its intermediate store.
    pub(crate) fn work_dir(&self) -> StoreLocation {
        (self.rechunk.work_dir.clone()).unwrap_or_else(default_work_dir)
    }

    /// The write options of its intermediate store: the target's,
    /// uncompressed.
    pub(crate) fn intermediate_options(&self) -> ZarrWriteOptions {
        ZarrWriteOptions {
            codec: Codec::None,
            ..self.to.options.clone()
        }
    }

    /// Its intermediate store's group in `storage`, coordinates and
    /// metadata stored, in chunks of step 1.
    pub(crate) fn start_intermediate(
        &self,
        storage: &ReadableWritableListableStorage,
    ) -> Result<GroupWrite> {
        let options = self.intermediate_options();
        let group = self.blocks.group(storage, &options, &self.blocks.block)?;
        group.store_metadata()?;
        Ok(group)
    }

    /// Runs both steps.
    pub(crate) fn run(&self, runtime: &RuntimeEnv, cancelled: &AtomicBool) -> Result<Written> {
        if self.direct {
            self.write_direct(runtime, cancelled)?;
            return Ok(self.written((0, 0)));
        }
        let scratch = ScratchStore::create(&self.work_dir(), "zarrfusion-copy", ".zarr", runtime)?;
        let group = self.start_intermediate(scratch.storage())?;
        self.blocks.write_step(
            &group.variables,
            0..self.blocks.tasks(),
            &|| Ok(()),
            cancelled,
        )?;
        let chunks: Vec<(String, u64)> = (self.blocks.table.dims)
            .iter()
            .zip(&self.target_chunks)
            .map(|(d, &c)| (d.name.clone(), c))
            .collect();
        let prepared = PreparedRechunk::new_for(
            &scratch.location().to_string(),
            &chunks,
            None,
            Some(TargetEncoding::of(&self.to.options)),
            &self.rechunk,
            runtime,
        )?;
        let summary = prepared.write_to(&self.to, cancelled)?;
        Ok(self.written((summary.bytes_read, summary.bytes_written)))
    }

    /// Whether each intermediate chunk is whole chunks of the target (the
    /// last ones along a dimension cut at its end): step 1 can write the
    /// target's chunks itself.
    fn aligned(&self) -> bool {
        (self
            .blocks
            .block
            .iter()
            .zip(&self.target_chunks)
            .zip(&self.blocks.shape))
        .all(|((&b, &t), &n)| b >= n || b % t.max(1) == 0)
    }

    /// Memory step 1 holds writing the target itself: its own and, for
    /// each worker, a chunk's values and their encoding.
    fn direct_memory(&self) -> u64 {
        let cells = (self.blocks.block.iter()).fold(1u64, |cells, &n| cells.saturating_mul(n));
        let bytes = cells
            .saturating_mul(self.blocks.types.len() as u64)
            .saturating_mul(width_of(&self.blocks.types));
        (self.blocks.step.workers() as u64)
            .saturating_mul(bytes.saturating_mul(2))
            .saturating_add(self.blocks.step.memory())
    }

    /// Plans step 2: none when step 1's chunks are whole target chunks
    /// and it fits `limit` writing them itself (no intermediate store, no
    /// rechunk), else the rechunk (refused when it cannot fit).
    pub(crate) fn planned(mut self, limit: MemoryLimit) -> Result<Self> {
        if let MemoryLimit::Finite(limit) = limit {
            coordinate_projection(&self.blocks.table.store, &self.blocks.shape).check(limit)?;
        }
        self.direct = self.aligned()
            && match limit {
                MemoryLimit::Finite(limit) => self.direct_memory() <= limit as u64,
                _ => true,
            };
        if !self.direct {
            self.stage2_memory = second_step(
                &self.blocks.table,
                &self.blocks.shape,
                &self.blocks.block,
                &self.target_chunks,
                &self.blocks.types,
                &self.rechunk,
            )?;
        }
        Ok(self)
    }

    /// Step 1 straight into the target, atomically: a local one written
    /// beside it and renamed into place; an object-store one (which must be
    /// empty) with its metadata last, erased when the copy fails.
    fn write_direct(&self, runtime: &RuntimeEnv, cancelled: &AtomicBool) -> Result<()> {
        self.to.write_group(
            runtime,
            cancelled,
            |storage| {
                self.blocks
                    .group(storage, &self.to.options, &self.target_chunks)
            },
            |group| {
                let all = 0..self.blocks.tasks();
                (self.blocks).write_step(&group.variables, all, &|| Ok(()), cancelled)
            },
        )
    }
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

/// The widest element of `types`, in bytes.
fn width_of(types: &[DataType]) -> u64 {
    types
        .iter()
        .map(|t| t.primitive_width().unwrap_or(8) as u64)
        .max()
        .unwrap_or(8)
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

//! The two steps of the chunk-by-chunk COPYs (Cubed's `blockwise`, then
//! `rechunk`): what a COPY of a selection or of rolling windows writes,
//! known before anything is read ([`CopyGrid`]: the selected grid, the
//! variables, the target and its chunks), and its two steps
//! ([`Blockwise`]):
//!
//! 1. *blockwise* (the primitive, [`crate::array::blockwise`]): one task
//!    per chunk, made by evaluating expressions over the source box it
//!    covers ([`Evaluate`]) or by another operator's writers (the rolling
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
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use datafusion::arrow::datatypes::DataType;
use datafusion::catalog::Session;
use datafusion::common::{plan_err, Result};
use datafusion::execution::memory_pool::MemoryLimit;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::logical_expr::expr::{Cast, TryCast};
use datafusion::logical_expr::Expr;
use serde_json::{Map, Value};
use zarrs::storage::ReadableWritableListableStorage;

use crate::array::blockwise::{BlockwiseStep, SelectedGrid, Step, StepBytes, StepGrid};
use crate::array::rechunk::{PreparedRechunk, RechunkOptions, RechunkPlan, TargetEncoding};
use crate::table::{GridTable, Selection};
use crate::write::options::{Codec, ZarrWriteOptions};
use crate::write::scratch::{default_work_dir, ScratchStore};
use crate::write::store::{
    chunk_lengths, coordinate_projection, coordinate_write_memory, GroupWrite,
};
use crate::write::target::CopyTarget;
use crate::write::write_job::Written;
use crate::zarr::{decoded_attributes, StoreLocation};

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
                grid: StepGrid::Selected {
                    table: self.table,
                    selection: self.selection,
                },
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
    store: &str,
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
    .map_err(|no| {
        let what = format!("'{store}' (its rechunk)");
        no.refusal("COPY TO Zarr of a selection", &what, rechunk.allowed_mem, 0)
    })?;
    Ok(stage2.projected_memory())
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

    /// What writing it did: step 1's bytes `step1`, and step 2 (the
    /// rechunk, when there is one) having read and written `step2` decoded
    /// bytes.
    pub(crate) fn written(&self, step1: StepBytes, step2: (u64, u64)) -> Written {
        let cells = (self.blocks.shape.iter()).fold(1u64, |n, &len| n.saturating_mul(len));
        Written {
            rows: cells,
            bytes_read: step1.read.saturating_add(step2.0),
            bytes_written: step1.written.saturating_add(step2.1),
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
            let step1 = self.write_direct(runtime, cancelled)?;
            return Ok(self.written(step1, (0, 0)));
        }
        let scratch = ScratchStore::create(&self.work_dir(), "zarrfusion-copy", ".zarr", runtime)?;
        let group = self.start_intermediate(scratch.storage())?;
        let step1 = self.blocks.write_step(
            &group.variables,
            0..self.blocks.tasks(),
            &|| Ok(()),
            cancelled,
        )?;
        let chunks: Vec<(String, u64)> = (self.blocks.dim_names().into_iter())
            .zip(self.target_chunks.iter().copied())
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
        Ok(self.written(step1, (summary.bytes_read, summary.bytes_written)))
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
            coordinate_projection(self.blocks.store(), &self.blocks.shape).check(limit)?;
        }
        self.direct = self.aligned()
            && match limit {
                MemoryLimit::Finite(limit) => self.direct_memory() <= limit as u64,
                _ => true,
            };
        if !self.direct {
            self.stage2_memory = second_step(
                self.blocks.store(),
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
    fn write_direct(&self, runtime: &RuntimeEnv, cancelled: &AtomicBool) -> Result<StepBytes> {
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

/// The widest element of `types`, in bytes.
fn width_of(types: &[DataType]) -> u64 {
    types
        .iter()
        .map(|t| t.primitive_width().unwrap_or(8) as u64)
        .max()
        .unwrap_or(8)
}

//! Transforms along several dimensions whose blocks of whole lines do not
//! fit the memory limit, one dimension at a time.
//!
//! An FFT along `[lat, lon]` needs blocks whole along both: a whole plane
//! per block. When a plane does not fit `allowed_mem`, the transform is
//! staged, as distributed FFTs do with their transposes: the first
//! dimension's transform (with its window, phase, amplitude and shift
//! factors, which xrft applies per dimension) runs by itself, by whole
//! lines or the four-step path, and its output is stored, uncompressed, in
//! `work_dir`; the rest of the transform reads that store. The store's
//! chunks subdivide the first stage's blocks (so every chunk is written
//! once, by one task) and are small enough along the other dimensions that
//! a block whole along the remaining transformed dimensions fits the
//! memory the next stage has, so it reads whole chunks only. Each stage
//! has half the limit: the first runs while the operator reading the last
//! holds its blocks.
//!
//! The store is written once, on the first read; it goes when the last
//! plan holding it is dropped, and dropping it mid-write cancels the
//! write. A detrend, fitted over all the transformed dimensions at once,
//! is removed from what the first stage reads (see [`super::source::detrended`]);
//! the first stage's own four-step intermediates go once it is stored.
//!
//! A transform of another transform's output (`df.fft(...).ifft(...)`)
//! reads the inner one block by block while a block whole along both fits;
//! when it does not, the inner transform is stored the same way first (a
//! *chain*), and the outer one reads the store by whole lines or the
//! four-step path.
//!
//! On a cluster, a first stage by whole lines of a table opened from a
//! location is a stage of the query's plan
//! ([`StoredStage::on_cluster`]): its blocks are dealt in runs to tasks
//! on the workers, each transforming its blocks and storing them into the
//! store the session made in `work_dir` (which every worker must reach),
//! as a `COPY` of a transform's tasks store whole chunks of a target
//! (the blockwise primitive's [`BlockwiseTasksExec`](crate::array::blockwise::BlockwiseTasksExec)). The stage after it, when it reads by whole
//! lines, runs on the workers too ([`StagedTransform::later_stage_of`]):
//! each of its tasks gets every count of the first stage's tasks (a
//! broadcast), checks that every block was stored, and reads its own
//! blocks of the store ([`ReceivedStage`]: the store as a worker opens it,
//! refused unless it holds the array as the first stage writes it);
//! otherwise the session's operator runs the first stage to its end and
//! reads the store. A first stage on the four-step path runs its two
//! passes on the workers first, a stage each, then its blocks' stage,
//! which reads the intermediates (the session runs the three in turn and
//! reads the store itself). A first stage over a detrended source runs in
//! the session.

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use datafusion::common::{exec_err, Result};
use datafusion::execution::runtime_env::RuntimeEnv;

use super::copy::{output_group, store_transformed_block, transform_tasks_on, WriteTasks};
use super::exec::strategy;
use super::kernels::{Kernels, ScratchArray};
use super::options::FftOptions;
use super::passes::PassBlocks;
use super::source::{ArraySource, Broadcast, ClusterStage, ClusterStep, StoredStage};
use super::table::FftTable;
use super::trend_pass::{DetrendFitExec, FittedExec};
use crate::array::rechunk::TargetEncoding;
use crate::device::Device;
use crate::table::{open_dataset_blocking, Dimension, GridTable, ZarrTableOptions};
use crate::write::options::{Codec, ZarrWriteOptions};
use crate::write::scratch::ScratchStore;
use crate::write::store::write_group;
use crate::write::store::GroupCoordinate;
use crate::write::target::StagedTarget;
use crate::zarr::{ChunkBufferPool, StoreLocation};

/// The first stage of a staged transform and its output in `work_dir`
/// (see the module docs).
pub struct StagedTransform {
    /// The first stage: a transform along one dimension, fitted to its
    /// half of the memory limit.
    pub inner: Arc<FftTable>,
    /// The stored output, opened (metadata and coordinates are written
    /// when planned, values on the first read).
    pub grid: Arc<GridTable>,
    /// Index of the variable in `grid.variables`.
    pub variable: usize,
    /// Whether `inner` is a whole transform whose output another one
    /// reads (a chain), rather than the first dimension of a staged one.
    pub chained: bool,
    /// The tasks writing the first stage's blocks.
    tasks: WriteTasks,
    /// The page-locked bytes the first stage's kernels stage through on
    /// a GPU (counted in `tasks`).
    staging: usize,
    array: ScratchArray,
    scratch: ScratchStore,
    written: OnceLock<std::result::Result<(), String>>,
    cancelled: AtomicBool,
}

impl std::fmt::Debug for StagedTransform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagedTransform")
            .field("store", &self.inner.source().store())
            .field("work_dir", self.scratch.location())
            .finish()
    }
}

impl Drop for StagedTransform {
    fn drop(&mut self) {
        self.cancelled.store(true, Ordering::Relaxed);
    }
}

impl StoredStage for StagedTransform {
    fn grid(&self) -> &Arc<GridTable> {
        &self.grid
    }

    fn variable(&self) -> usize {
        self.variable
    }

    fn store(&self) -> &str {
        self.inner.source().store()
    }

    fn ensure_written(&self, kernels: &Kernels) -> std::result::Result<(), String> {
        StagedTransform::ensure_written(self, kernels)
    }

    fn on_cluster(&self, device: Device, broadcast: &Broadcast) -> Option<ClusterStage> {
        // A worker makes the first stage again from the variable's table:
        // whole lines of a table opened from a location, or the four-step
        // path over one, whose passes run first, a stage each.
        let mut steps = Vec::new();
        match self.inner.four_step() {
            Some(four_step) => {
                self.inner.four_step_chain()?;
                for pass in 0..2 {
                    // Fitted to the plan's memory already: each worker fits
                    // it to its own allowed_mem when it receives it.
                    let leaf = PassBlocks::tasks(
                        Arc::clone(&self.inner),
                        Arc::clone(four_step),
                        pass,
                        device,
                        None,
                    )
                    .ok()?;
                    steps.push(ClusterStep {
                        leaf: Arc::new(leaf),
                        blocks: four_step.pass_tasks(pass),
                        what: format!("pass {} of the first stage's four-step transform", pass + 1),
                    });
                }
            }
            None => {
                self.inner.chain()?;
            }
        }
        let tasks = transform_tasks_on(
            Arc::clone(&self.inner),
            self.tasks.clone(),
            (device, self.staging),
            self.chunk_shape(),
            StagedTarget::Scratch {
                location: self.location().to_string(),
            },
            TargetEncoding::of(&stage_encoding()),
        );
        steps.push(ClusterStep {
            leaf: Arc::new(tasks),
            blocks: self.blocks(),
            what: "the first stage of the staged transform".to_string(),
        });
        // A detrend's fit is a stage before the first that reads the
        // source (the first pass, or the blocks by whole lines).
        if let Some(detrended) = self.inner.detrended() {
            let fit = Arc::new(DetrendFitExec::new(Arc::clone(&self.inner)).ok()?);
            let first = &mut steps[0];
            let (then, detrended) = (Arc::clone(&first.leaf), Arc::clone(detrended));
            first.leaf = Arc::new(FittedExec::new(broadcast(fit), then, detrended).ok()?);
        }
        Some(ClusterStage { steps })
    }

    fn written_by(
        &self,
        run: &mut dyn FnMut() -> std::result::Result<(), String>,
    ) -> std::result::Result<(), String> {
        self.written
            .get_or_init(|| {
                run()?;
                // Nothing reads the stage's four-step intermediates again.
                if let Some(four_step) = self.inner.four_step() {
                    four_step.release();
                }
                Ok(())
            })
            .clone()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn describe(&self, later: &[&str]) -> String {
        let inner = &self.inner;
        let dims: Vec<&str> = (inner.asked_transform().axes.iter())
            .map(|(_, a)| a.dim.as_str())
            .collect();
        let (kind, function) = if self.chained {
            let inverse = inner.transform().options.inverse;
            ("chained", if inverse { "ifft " } else { "fft " })
        } else {
            ("staged", "")
        };
        format!(
            "{kind}: {function}along [{}] by {} ({}) into {} in chunks of {:?}, then along [{}] by ",
            dims.join(", "),
            strategy(inner),
            self.describe_tasks(),
            self.location(),
            self.chunk_shape(),
            later.join(", ")
        )
    }
}

/// The stage after a staged transform's first (or a chain's stored inner
/// transform) as a cluster's worker makes it again
/// ([`StagedTransform::later_stage_of`]).
pub struct LaterStage<'a> {
    /// The first stage.
    pub first: &'a StagedTransform,
    /// The transforms the first stage makes of the variable (of
    /// `asked`'s table), innermost first.
    pub first_transforms: Vec<&'a FftOptions>,
    /// The transform as asked: the variable (of a table opened from a
    /// location, its index in the grid's variables) and the transforms
    /// made of it, innermost first.
    pub asked: (&'a Arc<GridTable>, usize, Vec<&'a FftOptions>),
    /// This stage's transform of the first stage's output.
    pub later: &'a FftOptions,
}

impl StagedTransform {
    /// Writes the metadata and coordinates of `inner`'s output, in chunks
    /// of `chunks` (dividing its blocks' output extents), into a fresh
    /// store in `work_dir`, and opens it; `chained` when `inner` is a
    /// whole transform another one reads; `tasks` write its blocks, their
    /// kernels staging through `staging` page-locked bytes on a GPU.
    /// Blocking.
    pub fn prepare(
        inner: Arc<FftTable>,
        chained: bool,
        (tasks, staging): (WriteTasks, usize),
        chunks: Vec<u64>,
        work_dir: &StoreLocation,
        runtime: &Arc<RuntimeEnv>,
    ) -> Result<Self> {
        let scratch = ScratchStore::create(work_dir, "zarrfusion-fft-staged", ".zarr", runtime)?;
        // No coordinate arrays: the next stage takes the coordinates from
        // `inner` (computed frequencies need no memory; read back from the
        // store they would need as much as a line of values).
        let (coordinates, variable) = output_group(&inner, chunks, false);
        let name = variable.name.clone();
        let options = stage_encoding();
        let mut arrays = write_group(scratch.storage(), &coordinates, &[variable], &options)?;
        let array = arrays.remove(0);
        let location = scratch.location().to_string();
        let (grid, index) = open_stage(&inner, &location, coordinates, &name, runtime)?;
        Ok(Self {
            inner,
            grid,
            variable: index,
            chained,
            tasks,
            staging,
            array,
            scratch,
            written: OnceLock::new(),
            cancelled: AtomicBool::new(false),
        })
    }

    /// The stage after this first one as a cluster's worker makes it
    /// again, when `table` is that stage, reads by whole lines, and this
    /// first stage runs on the workers ([`StoredStage::on_cluster`]).
    pub fn later_stage_of(table: &FftTable) -> Option<LaterStage<'_>> {
        let ArraySource::Staged(stage) = table.source() else {
            return None;
        };
        let first = stage.as_any().downcast_ref::<Self>()?;
        if table.four_step().is_some() {
            return None;
        }
        // The first stage: whole lines or the four-step path of a table
        // opened from a location (its output is the same either way).
        let (grid, variable, transforms) = match first.inner.chain() {
            Some(chain) => chain,
            None => {
                let (grid, variable, options) = first.inner.four_step_chain()?;
                (grid, variable, vec![options])
            }
        };
        // The transform as asked: of what the first stage reads (the same
        // variable and inner transforms) or, for a chain, of its output.
        let mut asked = transforms.clone();
        if !first.chained {
            asked.pop();
        }
        asked.push(&table.asked_transform().options);
        let named = |o: &FftOptions| o.named().is_some();
        let sendable = asked.iter().chain(&transforms).all(|o| named(o));
        (sendable && named(&table.transform().options)).then_some(LaterStage {
            first,
            first_transforms: transforms,
            asked: (grid, variable, asked),
            later: &table.transform().options,
        })
    }

    /// The blocks its tasks store.
    pub fn blocks(&self) -> u64 {
        self.tasks.blocks.num_blocks()
    }

    /// Where the stored output is.
    pub fn location(&self) -> &StoreLocation {
        self.scratch.location()
    }

    /// The stored output's chunks.
    pub fn chunk_shape(&self) -> Vec<u64> {
        self.grid.variables[self.variable].chunk_shape()
    }

    /// The first stage's blocks, tasks and their memory, as `EXPLAIN`
    /// shows them.
    pub fn describe_tasks(&self) -> String {
        format!(
            "blocks of shape {:?}, {} blocks, {} tasks{}, {}",
            self.tasks.blocks.block_shape(),
            self.blocks(),
            self.tasks.workers,
            self.tasks.read_ahead,
            datafusion::common::human_readable_size(self.tasks.projected())
        )
    }

    /// Runs the first stage unless done (its kernels `kernels`); every
    /// caller waits for it.
    pub fn ensure_written(&self, kernels: &Kernels) -> std::result::Result<(), String> {
        self.written
            .get_or_init(|| {
                self.tasks.run(
                    &self.inner,
                    kernels,
                    0..self.blocks(),
                    &self.cancelled,
                    |e| e,
                    |pool, id| self.write_block(id, kernels, pool),
                )?;
                if self.cancelled.load(Ordering::Relaxed) {
                    return Err("cancelled".to_string());
                }
                // Nothing reads the stage's four-step intermediates again.
                if let Some(four_step) = self.inner.four_step() {
                    four_step.release();
                }
                Ok(())
            })
            .clone()
    }

    /// Transforms block `id` of the first stage and stores it.
    fn write_block(
        &self,
        id: u64,
        kernels: &Kernels,
        pool: &ChunkBufferPool,
    ) -> std::result::Result<u64, String> {
        let extent = self.tasks.blocks.block(id);
        store_transformed_block(&self.inner, kernels, &extent, &self.array, pool)
            .map_err(|e| format!("the first stage in work_dir: {e}"))
    }
}

/// Opens the store at `location` holding `inner`'s output as `coordinates`
/// and variable `name` describe it: its dimensions are `inner`'s output
/// coordinates (the store keeps none), and the variable's index among the
/// grid's. Blocking.
fn open_stage(
    inner: &FftTable,
    location: &str,
    coordinates: Vec<GroupCoordinate>,
    name: &str,
    runtime: &Arc<RuntimeEnv>,
) -> Result<(Arc<GridTable>, usize)> {
    let names: Vec<String> = coordinates.iter().map(|c| c.name.clone()).collect();
    let table_options = ZarrTableOptions {
        dims: Some(names.clone()),
        // A scratch store is opened once: nothing to keep for later.
        open_cache: Some(false),
        ..ZarrTableOptions::default()
    };
    let dims = coordinates
        .into_iter()
        .map(|c| {
            Arc::new(Dimension {
                name: c.name,
                len: c.values.len(),
                coordinate: c.values,
                attributes: c.attributes,
            })
        })
        .collect();
    let grid = open_dataset_blocking(location, &table_options, runtime)?
        .table(Some(&names))?
        .with_dimensions(dims)?;
    let Some(index) = grid.variables.iter().position(|v| v.name() == name) else {
        return exec_err!(
            "the staged transform of '{}' lacks variable '{name}' in {location}",
            inner.source().store()
        );
    };
    Ok((Arc::new(grid), index))
}

/// The stored output of a staged transform's first stage as a cluster's
/// worker reads it in the stage after it: the store the session made in
/// `work_dir`, which the first stage's tasks (the input of the operator
/// reading it) write before it is read (see the module docs).
#[derive(Debug)]
pub struct ReceivedStage {
    grid: Arc<GridTable>,
    variable: usize,
    /// The store the first stage reads.
    store: String,
    /// The first stage's transformed dimensions.
    dims: Vec<String>,
    location: String,
    written: OnceLock<std::result::Result<(), String>>,
}

impl ReceivedStage {
    /// The output of `first` (a first stage as a worker made it again) in
    /// the store at `location`, in chunks of `chunks`: refused unless the
    /// store holds the array as the first stage's tasks write it (the
    /// metadata the session wrote). Blocking.
    pub fn open(
        first: &FftTable,
        location: &str,
        chunks: Vec<u64>,
        runtime: &Arc<RuntimeEnv>,
    ) -> Result<Self> {
        let (coordinates, want) = output_group(first, chunks, false);
        let name = want.name.clone();
        let (grid, index) = open_stage(first, location, coordinates, &name, runtime)?;
        let stored = &grid.variables[index];
        let found = (stored.shape(), stored.chunk_shape(), stored.data_type());
        if found != (want.shape.as_slice(), want.chunks.clone(), &want.data_type) {
            return exec_err!(
                "the store '{location}' holds variable '{name}' as {:?} in chunks of {:?} ({}), \
                 otherwise than the first stage of the staged transform of '{}' writes it: \
                 {:?} in chunks of {:?} ({})",
                found.0,
                found.1,
                found.2,
                first.source().store(),
                want.shape,
                want.chunks,
                want.data_type
            );
        }
        Ok(Self {
            store: first.source().store().to_string(),
            dims: (first.transform.axes.iter())
                .map(|(_, a)| a.dim.clone())
                .collect(),
            grid,
            variable: index,
            location: location.to_string(),
            written: OnceLock::new(),
        })
    }
}

impl StoredStage for ReceivedStage {
    fn grid(&self) -> &Arc<GridTable> {
        &self.grid
    }

    fn variable(&self) -> usize {
        self.variable
    }

    fn store(&self) -> &str {
        &self.store
    }

    fn ensure_written(&self, _kernels: &Kernels) -> std::result::Result<(), String> {
        // Written by the first stage's tasks, which this worker's operator
        // runs first (`written_by`); nothing here writes it.
        self.written.get().cloned().unwrap_or_else(|| {
            Err(format!(
                "the first stage's output in {} is read before its tasks ran",
                self.location
            ))
        })
    }

    fn on_cluster(&self, _device: Device, _broadcast: &Broadcast) -> Option<ClusterStage> {
        None
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn written_by(
        &self,
        run: &mut dyn FnMut() -> std::result::Result<(), String>,
    ) -> std::result::Result<(), String> {
        self.written.get_or_init(run).clone()
    }

    fn describe(&self, later: &[&str]) -> String {
        format!(
            "staged: along [{}] on the cluster's workers into {}, then along [{}] by ",
            self.dims.join(", "),
            self.location,
            later.join(", ")
        )
    }
}

/// How the first stage's output is stored: uncompressed (written once
/// and read once, right away).
fn stage_encoding() -> ZarrWriteOptions {
    ZarrWriteOptions {
        codec: Codec::None,
        ..ZarrWriteOptions::default()
    }
}

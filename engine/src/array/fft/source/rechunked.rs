//! A variable copied into new chunks in `work_dir` before a transform
//! reads it: when a block of whole lines in the store's own chunks does
//! not fit the budget ([`super::ArraySource::Rechunked`]). On a cluster
//! the copy's rounds run on the workers ([`RechunkedVariable::rounds`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use datafusion::execution::runtime_env::RuntimeEnv;

use crate::array::rechunk::cluster::{round_leaves, Round};
use crate::array::rechunk::{PreparedRechunk, RechunkOptions};
use crate::table::{open_dataset_blocking, GridTable, ZarrTableOptions};
use crate::write::scratch::{default_work_dir, ScratchStore};
use crate::write::target::StagedTarget;

/// A variable copied into new chunks in `work_dir` (see
/// [`super::ArraySource::Rechunked`]). The copy runs once, on the first read;
/// the directory goes when the last plan holding it is dropped, and
/// dropping it mid-copy cancels the copy.
pub struct RechunkedVariable {
    /// The store the values come from.
    pub store: String,
    /// Its table.
    pub source: Arc<GridTable>,
    /// The copy, opened (its metadata is written when planned; its
    /// coordinates are the source's).
    pub grid: Arc<GridTable>,
    /// Index of the variable in `grid.variables`.
    pub variable: usize,
    prepared: Arc<PreparedRechunk>,
    scratch: ScratchStore,
    /// The scratch store of the copy's intermediate arrays, when it takes
    /// more than one stage (made when planned, so that a cluster's
    /// workers find it).
    work: Option<ScratchStore>,
    copied: OnceLock<Result<(), String>>,
    cancelled: AtomicBool,
}

impl std::fmt::Debug for RechunkedVariable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RechunkedVariable")
            .field("store", &self.store)
            .field("copy", self.scratch.location())
            .finish()
    }
}

impl Drop for RechunkedVariable {
    fn drop(&mut self) {
        self.cancelled.store(true, Ordering::Relaxed);
    }
}

impl RechunkedVariable {
    /// Plans the copy of `variable` of `grid` into `chunks` (`(dimension,
    /// length)` pairs) under `options` (refused when it cannot fit), writes
    /// its metadata and coordinates into a fresh store in `work_dir` and
    /// opens it. Blocking.
    pub fn prepare(
        grid: &Arc<GridTable>,
        variable: usize,
        chunks: &[(String, u64)],
        options: &RechunkOptions,
        runtime: &Arc<RuntimeEnv>,
    ) -> datafusion::common::Result<Self> {
        let name = grid.variables[variable].name().to_string();
        // The variable only: the copy's coordinates are the source's, held
        // already (reading them back would hold them twice).
        let arrays = vec![name.clone()];
        let options = &RechunkOptions {
            source_storage: grid.storage_options(),
            ..options.clone()
        };
        let prepared =
            PreparedRechunk::new_for(&grid.store, chunks, Some(&arrays), None, options, runtime)?;
        let work_dir = options.work_dir.clone().unwrap_or_else(default_work_dir);
        // Named as a rechunk(...)'s store: what a cluster's worker writes
        // the copy into.
        let scratch =
            ScratchStore::create(&work_dir, "zarrfusion-rechunked-fft", ".zarr", runtime)?;
        prepared.write_metadata(scratch.storage())?;
        let work = (prepared.has_intermediates())
            .then(|| ScratchStore::create(&work_dir, "zarrfusion-rechunk", "", runtime))
            .transpose()?;
        let dims: Vec<String> = grid.dims.iter().map(|d| d.name.clone()).collect();
        let table_options = ZarrTableOptions {
            dims: Some(dims.clone()),
            // A scratch store is opened once: nothing to keep for later.
            open_cache: Some(false),
            ..ZarrTableOptions::default()
        };
        let location = scratch.location().to_string();
        let copy = open_dataset_blocking(&location, &table_options, runtime)?
            .table(Some(&dims))?
            .with_dimensions(grid.dims.clone())?;
        let Some(index) = copy.variables.iter().position(|v| v.name() == name) else {
            return datafusion::common::exec_err!(
                "the rechunked copy of '{}' lacks variable '{name}'",
                grid.store
            );
        };
        Ok(Self {
            store: grid.store.clone(),
            source: Arc::clone(grid),
            grid: Arc::new(copy),
            variable: index,
            prepared: Arc::new(prepared),
            scratch,
            work,
            copied: OnceLock::new(),
            cancelled: AtomicBool::new(false),
        })
    }

    /// The most memory the copy's tasks hold together.
    pub fn projected_memory(&self) -> u64 {
        self.prepared.projected_memory()
    }

    /// The copy's chunks along every dimension.
    pub fn chunk_shape(&self) -> Vec<u64> {
        self.grid.variables[self.variable].chunk_shape()
    }

    /// Copies the variable unless done; every caller waits for the copy.
    pub(super) fn ensure_copied(&self) -> Result<(), String> {
        self.copied
            .get_or_init(|| {
                let name = self.grid.variables[self.variable].name();
                self.prepared
                    .copy_arrays(
                        self.scratch.storage(),
                        self.work.as_ref(),
                        |a| a.name == name,
                        &self.cancelled,
                    )
                    .map(|_| ())
                    .map_err(|e| format!("rechunking '{}' into work_dir: {e}", self.store))
            })
            .clone()
    }

    /// Where the copy is: a path or a URL that opens it again.
    pub fn location(&self) -> String {
        self.scratch.location().to_string()
    }

    /// The copy's rounds on a cluster's workers, in order, writing into
    /// the copy (and its intermediate arrays into their scratch store);
    /// the copy counts as made once they ran ([`Self::copied_by_workers`]).
    pub(crate) fn rounds(&self) -> datafusion::common::Result<Vec<Round>> {
        let staged = StagedTarget::Scratch {
            location: self.location(),
        };
        let work = self.work.as_ref().map(|w| w.location());
        round_leaves(&self.prepared, &staged, work)
    }

    /// Whether the copy is made (or was made by a cluster's workers).
    pub fn is_copied(&self) -> bool {
        self.copied.get().is_some()
    }

    /// Marks the copy made by a cluster's workers: whatever reads it runs
    /// after their rounds.
    pub(crate) fn copied_by_workers(&self) {
        let _ = self.copied.set(Ok(()));
    }
}

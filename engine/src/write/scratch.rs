//! Scratch stores: Zarr stores that exist only while an operation uses
//! them (a rechunk's intermediate arrays, the rechunked copy a query
//! scans, a COPY's blockwise step, the FFT's stages and passes), in
//! `work_dir`, a local directory or an object-store URL; erased when
//! dropped by the process that made them (a cluster's workers open them
//! without owning them), and swept by a later process when a killed one
//! left them.

use std::collections::HashMap;
use std::sync::Arc;

use datafusion::common::{DataFusionError, Result};
use datafusion::execution::runtime_env::RuntimeEnv;
use zarrs::storage::{
    ReadableWritableListableStorage, StoreKey, StorePrefix, WritableStorageTraits,
};

use crate::write::stamp::{
    owner_record, sweep, sweep_remote, unique_suffix, Leftover, SCRATCH_MARKER,
};
use crate::write::unflushed::unflushed_storage;
use crate::zarr::{open_writable_remote, RemoteStorage, StoreLocation};

/// The work directory when `work_dir` is not set: the system's temporary
/// directory.
pub fn default_work_dir() -> StoreLocation {
    StoreLocation::Local(std::env::temp_dir())
}

/// A fresh store under a work directory, erased (everything under its
/// root) when the one that made it drops it.
pub struct ScratchStore {
    storage: ReadableWritableListableStorage,
    location: StoreLocation,
    /// The object store, when `work_dir` is one (for reading ahead).
    remote: Option<Arc<RemoteStorage>>,
    /// Whether this process made it (and erases it when dropped), rather
    /// than opened one a session made ([`open`](Self::open)).
    owned: bool,
}

impl std::fmt::Debug for ScratchStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScratchStore")
            .field("location", &self.location)
            .finish()
    }
}

impl ScratchStore {
    /// Creates `<work_dir>/<stem>-<unique suffix><extension>` (a directory,
    /// or a prefix of the object store).
    pub fn create(
        work_dir: &StoreLocation,
        stem: &str,
        extension: &str,
        runtime: &RuntimeEnv,
    ) -> Result<Self> {
        Self::create_at(work_dir, Self::name(work_dir, stem, extension), runtime)
    }

    /// A fresh location `<work_dir>/<stem>-<unique suffix><extension>` for
    /// [`create_at`](Self::create_at), reading nothing. A cluster's rechunk
    /// names its scratch store while planning, so that its workers find it.
    pub fn name(work_dir: &StoreLocation, stem: &str, extension: &str) -> StoreLocation {
        work_dir.join(&format!("{stem}-{}{extension}", unique_suffix()))
    }

    /// Creates the scratch store at `location` (from [`name`](Self::name))
    /// in `work_dir`, where what killed processes left is swept first.
    pub fn create_at(
        work_dir: &StoreLocation,
        location: StoreLocation,
        runtime: &RuntimeEnv,
    ) -> Result<Self> {
        match work_dir {
            StoreLocation::Local(dir) => {
                sweep(dir, Leftover::Scratch);
            }
            StoreLocation::Remote(url) => {
                let display = work_dir.to_string();
                let parent = open_writable_remote(&display, url, &HashMap::new(), runtime)
                    .map_err(work_dir_error)?;
                sweep_remote(&display, parent.as_ref());
            }
        }
        let failed = work_dir_error;
        let display = location.to_string();
        let (storage, remote): (ReadableWritableListableStorage, _) = match &location {
            StoreLocation::Remote(url) => {
                let remote = open_writable_remote(&display, url, &HashMap::new(), runtime)
                    .map_err(failed)?;
                // Whose it is, for the sweep of another process when this
                // one is killed.
                let marker = StoreKey::new(SCRATCH_MARKER).map_err(|e| {
                    DataFusionError::Execution(format!("work_dir '{display}': {e}"))
                })?;
                remote
                    .set(&marker, owner_record().to_string().into_bytes().into())
                    .map_err(|e| {
                        DataFusionError::Execution(format!("work_dir '{display}': {e}"))
                    })?;
                (Arc::clone(&remote) as _, Some(remote))
            }
            StoreLocation::Local(path) => {
                (unflushed_storage(&display, path).map_err(failed)?, None)
            }
        };
        Ok(Self {
            storage,
            location,
            remote,
            owned: true,
        })
    }

    /// The scratch store at `location` that a session made, as a cluster's
    /// worker writes into it: not erased when dropped. A local one must
    /// exist (it is gone only when the operation that made it failed or
    /// ended).
    pub fn open(location: &str, runtime: &RuntimeEnv) -> Result<Self> {
        let parsed = StoreLocation::parse(location)?;
        if let StoreLocation::Local(path) = &parsed {
            if !path.is_dir() {
                return Err(gone(location));
            }
        }
        let (storage, remote): (ReadableWritableListableStorage, _) = match &parsed {
            StoreLocation::Remote(url) => {
                let remote = open_writable_remote(location, url, &HashMap::new(), runtime)?;
                (Arc::clone(&remote) as _, Some(remote))
            }
            StoreLocation::Local(path) => (unflushed_storage(location, path)?, None),
        };
        Ok(Self {
            storage,
            location: parsed,
            remote,
            owned: false,
        })
    }

    /// Whether the store is still there: a local directory exists, an
    /// object-store one still holds its owner's marker. A cluster's task
    /// checks before it writes, so that a task still running when the
    /// operation failed elsewhere (and the session erased the store)
    /// writes nothing more.
    pub fn still_there(&self) -> Result<()> {
        still_there(&self.location, &self.storage)
    }

    /// The object store, when the store is in one: what reading ahead of
    /// the arrays in it goes through.
    pub fn remote(&self) -> Option<&Arc<RemoteStorage>> {
        self.remote.as_ref()
    }

    /// The store, for reading and writing.
    pub fn storage(&self) -> &ReadableWritableListableStorage {
        &self.storage
    }

    /// Where it is: a path or a URL that opens it again.
    pub fn location(&self) -> &StoreLocation {
        &self.location
    }

    /// Erases the node at `path` (an intermediate array, once read).
    pub fn erase(&self, path: &str) {
        let prefix = format!("{}/", path.trim_matches('/'));
        if let Ok(prefix) = StorePrefix::new(prefix) {
            let _ = self.storage.erase_prefix(&prefix);
        }
    }
}

/// Whether the scratch store at `location` (opened as `storage`) is still
/// there: a local directory exists, an object-store one still holds its
/// owner's marker (see [`ScratchStore::still_there`]).
pub(crate) fn still_there(
    location: &StoreLocation,
    storage: &ReadableWritableListableStorage,
) -> Result<()> {
    let there = match location {
        StoreLocation::Local(path) => path.is_dir(),
        StoreLocation::Remote(_) => {
            let marker = StoreKey::new(SCRATCH_MARKER)
                .map_err(|e| DataFusionError::Execution(e.to_string()))?;
            (storage.get(&marker))
                .map_err(|e| DataFusionError::Execution(format!("{location}: {e}")))?
                .is_some()
        }
    };
    match there {
        true => Ok(()),
        false => Err(gone(&location.to_string())),
    }
}

/// An error opening a work directory.
fn work_dir_error(e: crate::error::ZarrFusionError) -> DataFusionError {
    DataFusionError::Execution(format!("work_dir: {e}"))
}

/// A scratch store that is no longer there.
fn gone(location: &str) -> DataFusionError {
    DataFusionError::Execution(format!(
        "the scratch store '{location}' is gone (the operation that made it failed or was \
         cancelled)"
    ))
}

impl Drop for ScratchStore {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        match &self.location {
            StoreLocation::Local(dir) => {
                let _ = std::fs::remove_dir_all(dir);
            }
            // Object-store calls block on the runtime, which must not
            // happen on one of its own threads: erase from a thread of our own.
            StoreLocation::Remote(_) => {
                let storage = Arc::clone(&self.storage);
                let _ =
                    std::thread::spawn(move || storage.erase_prefix(&StorePrefix::root())).join();
            }
        }
    }
}

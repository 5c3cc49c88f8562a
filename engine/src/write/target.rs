//! Where a `COPY ... STORED AS ZARR` writes: the new store, the write
//! options the COPY gave (chunks, codec, format, object-store settings)
//! and its output (one column, `count`). Every COPY (of a table, a
//! selection, rolling windows, a transform, or a result written from rows
//! by [`super::sink::ZarrSink`]) and `rechunk_store` hold one
//! [`CopyTarget`], refuse through it a target that exists while planning,
//! and write their store through it atomically (`CopyTarget::write_group`,
//! `CopyTarget::write_staged`): the one atomic writer. A write on a
//! cluster stages the store first ([`StagedTarget`]: where its workers
//! write chunks) and commits it once they are done
//! (`CopyTarget::write_staged`).

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::common::{exec_err, DFSchema, DFSchemaRef, DataFusionError, Result};
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::logical_expr::dml::CopyTo;
use serde::{Deserialize, Serialize};
use zarrs::filesystem::FilesystemStore;
use zarrs::storage::{ReadableWritableListableStorage, StoreKey};

use super::options::ZarrWriteOptions;
use super::scratch::{still_there, ScratchStore};
use super::store::{
    check_target, io_error, temporary_beside, write_atomically_at, write_claimed, GroupWrite,
    CLAIM_KEY,
};
use crate::zarr::{open_writable_remote, StoreLocation};

/// The store a `COPY ... STORED AS ZARR` writes and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyTarget {
    /// The new store: a local path or an object-store URL.
    pub location: StoreLocation,
    /// The write options (chunks, codec, format, object-store settings).
    pub options: ZarrWriteOptions,
    /// The COPY's output: one column, `count`.
    pub schema: DFSchemaRef,
}

impl CopyTarget {
    /// The target of `copy` when it writes one Zarr store (no
    /// `PARTITIONED BY`); an error when its location or options are
    /// malformed.
    pub fn of(copy: &CopyTo) -> Result<Option<Self>> {
        if copy.file_type.get_ext() != "zarr" || !copy.partition_by.is_empty() {
            return Ok(None);
        }
        Ok(Some(Self {
            location: StoreLocation::parse(&copy.output_url)?,
            options: ZarrWriteOptions::from_map(&copy.options)?,
            schema: Arc::clone(&copy.output_schema),
        }))
    }

    /// The store at `location` written with `options`, as a COPY's (its
    /// output one `count` column).
    pub fn new(location: StoreLocation, options: ZarrWriteOptions) -> Result<Self> {
        let count = Schema::new(vec![Field::new("count", DataType::UInt64, false)]);
        Ok(Self {
            location,
            options,
            schema: Arc::new(DFSchema::try_from(count)?),
        })
    }

    /// This target writing `chunks` (`(dimension, length)`) for the
    /// dimensions its options leave free: a COPY of a query over
    /// `rechunk(...)` writes the rechunk's chunks unless it names others.
    pub fn with_default_chunks(mut self, chunks: &[(String, u64)]) -> Self {
        for (dim, len) in chunks {
            if !self.options.chunks.iter().any(|(given, _)| given == dim) {
                self.options.chunks.push((dim.clone(), *len));
            }
        }
        self
    }

    /// Refuses a local target that exists: a write never replaces data.
    /// (An object-store target is claimed when written: it must be empty.)
    pub fn check(&self) -> Result<()> {
        match &self.location {
            StoreLocation::Local(path) => check_target(path),
            StoreLocation::Remote(_) => Ok(()),
        }
    }

    /// Where a write of this target puts its chunks until it commits: a
    /// new temporary directory beside a local target (named now, for a
    /// cluster's workers to write into), or the object-store prefix itself.
    pub(crate) fn staged(&self) -> Result<StagedTarget> {
        Ok(match &self.location {
            StoreLocation::Local(path) => StagedTarget::Local {
                path: temporary_beside(path)?,
            },
            StoreLocation::Remote(_) => StagedTarget::Remote {
                url: self.location.to_string(),
                storage: self.options.storage.clone().into_iter().collect(),
            },
        })
    }

    /// Writes a new store at the target through `staged` (from
    /// [`staged`](Self::staged)), atomically: `write` fills the storage
    /// it is given, metadata last. A local store is written in the
    /// temporary directory and renamed into place when complete; an
    /// object store's prefix (which must be empty) is claimed, and
    /// everything is erased when the write fails. Nothing is left when
    /// `cancelled` is set.
    pub(crate) fn write_staged<T>(
        &self,
        staged: &StagedTarget,
        runtime: &RuntimeEnv,
        cancelled: &AtomicBool,
        write: impl FnOnce(&ReadableWritableListableStorage) -> Result<T>,
    ) -> Result<T> {
        match (&self.location, staged) {
            (StoreLocation::Local(target), StagedTarget::Local { path }) => {
                write_atomically_at(target, path, cancelled, |dir| {
                    std::fs::create_dir(dir).map_err(|e| io_error(dir, e))?;
                    let storage: ReadableWritableListableStorage =
                        Arc::new(FilesystemStore::new(dir).map_err(|e| io_error(dir, e))?);
                    write(&storage)
                })
            }
            (StoreLocation::Remote(url), StagedTarget::Remote { .. }) => write_claimed(
                &self.location.to_string(),
                url,
                &self.options.storage,
                runtime,
                write,
            ),
            (_, staged) => exec_err!("the COPY to '{}' was staged as '{staged}'", self.location),
        }
    }

    /// Writes a new store at the target, atomically (see
    /// [`write_staged`](Self::write_staged)): `prepare` starts its group in
    /// the storage it is given (see
    /// [`prepare_group`](super::store::prepare_group)), `fill` stores the
    /// variables' chunks, and the group's metadata is stored last.
    pub(crate) fn write_group<T>(
        &self,
        runtime: &RuntimeEnv,
        cancelled: &AtomicBool,
        prepare: impl FnOnce(&ReadableWritableListableStorage) -> Result<GroupWrite>,
        fill: impl FnOnce(&GroupWrite) -> Result<T>,
    ) -> Result<T> {
        let staged = self.staged()?;
        self.write_staged(&staged, runtime, cancelled, |storage| {
            let group = prepare(storage)?;
            let written = fill(&group)?;
            group.store_metadata()?;
            Ok(written)
        })
    }
}

/// Where a cluster's tasks write a target's chunks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum StagedTarget {
    /// The temporary directory beside a local target, made by the session
    /// before any task runs (every worker must see the same path).
    Local {
        /// The directory.
        path: PathBuf,
    },
    /// An object-store prefix the session has claimed.
    Remote {
        /// The prefix's URL.
        url: String,
        /// The COPY's object-store options.
        storage: BTreeMap<String, String>,
    },
    /// The scratch store a `rechunk(...)` made in `work_dir` (a path or a
    /// URL) and wrote the metadata of, which its query then reads.
    Scratch {
        /// Its location.
        location: String,
    },
}

impl StagedTarget {
    /// The storage the tasks write into. A local directory must exist: the
    /// session made it, and it is gone only when the COPY failed or was
    /// cancelled (a task must not make it again).
    pub(crate) fn open(&self, runtime: &RuntimeEnv) -> Result<ReadableWritableListableStorage> {
        match self {
            Self::Local { path } => {
                if !path.is_dir() {
                    return exec_err!(
                        "the COPY's staging directory '{}' is gone (the COPY failed or was \
                         cancelled)",
                        path.display()
                    );
                }
                Ok(Arc::new(
                    FilesystemStore::new(path).map_err(|e| io_error(path, e))?,
                ))
            }
            Self::Remote { url, storage } => {
                let parsed = url::Url::parse(url)
                    .map_err(|e| DataFusionError::Plan(format!("target '{url}': {e}")))?;
                let options = storage.clone().into_iter().collect();
                Ok(open_writable_remote(url, &parsed, &options, runtime)?)
            }
            Self::Scratch { location } => {
                Ok(Arc::clone(ScratchStore::open(location, runtime)?.storage()))
            }
        }
    }
}

impl StagedTarget {
    /// Whether the session still stages the target (opened as `out`): its
    /// temporary directory exists, or its claim on the prefix does. A
    /// task checks before it writes, so that a task still running when
    /// the COPY failed elsewhere (and the session erased what was written)
    /// writes nothing more.
    pub(crate) fn still_staged(&self, out: &ReadableWritableListableStorage) -> Result<(), String> {
        let staged = match self {
            Self::Local { path } => path.is_dir(),
            Self::Remote { .. } => {
                let claim = StoreKey::new(CLAIM_KEY).map_err(|e| e.to_string())?;
                out.get(&claim).map_err(|e| e.to_string())?.is_some()
            }
            Self::Scratch { location } => {
                let parsed = StoreLocation::parse(location).map_err(|e| e.to_string())?;
                return still_there(&parsed, out).map_err(|e| e.to_string());
            }
        };
        match staged {
            true => Ok(()),
            false => Err(format!(
                "the COPY's target '{self}' is no longer staged (the COPY failed or was cancelled)"
            )),
        }
    }
}

impl fmt::Display for StagedTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Local { path } => write!(f, "{}", path.display()),
            Self::Remote { url, .. } => write!(f, "{url}"),
            Self::Scratch { location } => write!(f, "{location}"),
        }
    }
}

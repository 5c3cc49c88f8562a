//! Where a `COPY ... STORED AS ZARR` writes: the new store, the write
//! options the COPY gave (chunks, codec, format, object-store settings)
//! and its output (one column, `count`). Every array COPY (of a table, a
//! selection, rolling windows, a transform) holds one [`CopyTarget`],
//! refuses through it a target that exists while planning, and writes its
//! store through it atomically (`CopyTarget::write_group`).

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use datafusion::common::{DFSchemaRef, Result};
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::logical_expr::dml::CopyTo;
use zarrs::filesystem::FilesystemStore;
use zarrs::storage::ReadableWritableListableStorage;

use super::options::ZarrWriteOptions;
use super::store::{check_target, io_error, write_atomically, write_claimed, GroupWrite};
use crate::zarr::StoreLocation;

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

    /// Refuses a local target that exists: a write never replaces data.
    /// (An object-store target is claimed when written: it must be empty.)
    pub fn check(&self) -> Result<()> {
        match &self.location {
            StoreLocation::Local(path) => check_target(path),
            StoreLocation::Remote(_) => Ok(()),
        }
    }

    /// Writes a new store at the target, atomically: `prepare` starts its
    /// group in the storage it is given (see
    /// [`prepare_group`](super::store::prepare_group)) and `fill` stores
    /// the variables' chunks. A local store is written beside the target
    /// (metadata first) and renamed into place when complete; an object
    /// store's prefix (which must be empty) is claimed, the metadata stored
    /// last and everything erased when the write fails. Nothing is left
    /// when `cancelled` is set.
    pub(crate) fn write_group<T>(
        &self,
        runtime: &RuntimeEnv,
        cancelled: &AtomicBool,
        prepare: impl FnOnce(&ReadableWritableListableStorage) -> Result<GroupWrite>,
        fill: impl FnOnce(&GroupWrite) -> Result<T>,
    ) -> Result<T> {
        match &self.location {
            StoreLocation::Local(target) => write_atomically(target, cancelled, |dir| {
                std::fs::create_dir(dir).map_err(|e| io_error(dir, e))?;
                let storage: ReadableWritableListableStorage =
                    Arc::new(FilesystemStore::new(dir).map_err(|e| io_error(dir, e))?);
                let group = prepare(&storage)?;
                group.store_metadata()?;
                fill(&group)
            }),
            StoreLocation::Remote(url) => write_claimed(
                &self.location.to_string(),
                url,
                &self.options.storage,
                runtime,
                |storage| {
                    let group = prepare(storage)?;
                    let written = fill(&group)?;
                    group.store_metadata()?;
                    Ok(written)
                },
            ),
        }
    }
}

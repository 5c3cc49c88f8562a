//! Where an array `COPY` writes: the new store, the write options the COPY
//! gave (chunks, codec, format, object-store settings) and its output (one
//! column, `count`). Every array COPY node and operator holds one
//! [`CopyTarget`], refuses a target that exists through it while planning
//! and writes a rechunked store into it through [`CopyTarget::write`].

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use datafusion::common::{DFSchemaRef, Result};
use datafusion::logical_expr::dml::CopyTo;

use crate::array::rechunk::{PreparedRechunk, RechunkSummary, TargetEncoding};
use crate::write::options::ZarrWriteOptions;
use crate::write::store::{check_target, write_claimed};
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
    pub(crate) fn of(copy: &CopyTo) -> Result<Option<Self>> {
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

    /// How the target's arrays are encoded.
    pub(crate) fn encoding(&self) -> TargetEncoding {
        TargetEncoding {
            codec: self.options.codec,
            zarr_format: self.options.zarr_format,
        }
    }

    /// Writes `prepared` (a rechunk into the target's chunks): renamed into
    /// place when local; data, then metadata, into an empty object-store
    /// prefix otherwise (through a client built from the COPY's
    /// object-store settings, when it gave any).
    pub(crate) fn write(
        &self,
        prepared: &PreparedRechunk,
        cancelled: &AtomicBool,
    ) -> Result<RechunkSummary> {
        match &self.location {
            StoreLocation::Local(path) => prepared.write_local(path, cancelled),
            StoreLocation::Remote(url) => write_claimed(
                &self.location.to_string(),
                url,
                &self.options.storage,
                prepared.runtime(),
                |out| prepared.write_last_metadata(out, cancelled),
            ),
        }
    }
}

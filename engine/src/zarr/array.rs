//! One Zarr array: its dimensions, how its values decode, and reading
//! rectangular subsets of it as Arrow columns.

use std::io::Write;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::UNIX_EPOCH;

use datafusion::arrow::array::ArrayRef;
use datafusion::arrow::datatypes::DataType;
use serde_json::{Map, Value};
use zarrs::array::{Array, ArrayBytes, ArrayError, ArraySubset};
use zarrs::metadata::v2::DataTypeMetadataV2;
use zarrs::metadata::{ArrayMetadata, FillValueMetadata};
use zarrs::storage::{
    ReadableListableStorage, ReadableListableStorageTraits, StoreKey, StorePrefix,
};

use super::buffer_pool::ChunkBufferPool;
use super::decode::{ColumnDecoder, StoredType};
use super::hierarchy::ArrayEntry;
use super::raw_chunks::{RawChunkError, RawChunks};
use super::remote::RemoteStorage;
use super::store::StoreAccess;
use crate::error::{catch_panic, Result, ZarrFusionError};

/// Most bytes an array, or one of its chunks, may declare (its shape's
/// cells times its element size; 16 bytes for variable-length elements):
/// 2^56 bytes, 64 PiB. Metadata declaring more is refused when the array is
/// opened, so that no product of its sizes computed later can wrap.
pub const MAX_ARRAY_BYTES: u64 = 1 << 56;

/// The bytes `shape` declares in elements of `element` bytes, when they
/// are at most [`MAX_ARRAY_BYTES`] (0 when a dimension is empty).
fn declared_bytes(shape: &[u64], element: usize) -> Option<u64> {
    if shape.contains(&0) {
        return Some(0);
    }
    shape
        .iter()
        .try_fold(element as u64, |bytes, &n| bytes.checked_mul(n))
        .filter(|&bytes| bytes <= MAX_ARRAY_BYTES)
}

/// Refuses an array whose shape or chunk shape declares more than
/// [`MAX_ARRAY_BYTES`], with the numbers.
fn check_declared_sizes(
    shape: &[u64],
    chunk: &[u64],
    element: usize,
) -> std::result::Result<(), String> {
    for (what, dims) in [("shape", shape), ("chunk shape", chunk)] {
        if declared_bytes(dims, element).is_none() {
            let exact = dims
                .iter()
                .try_fold(element as u128, |bytes, &n| {
                    bytes.checked_mul(u128::from(n))
                })
                .map_or_else(|| "more than 2^128".to_string(), |b| b.to_string());
            return Err(format!(
                "its {what} {dims:?} of {element}-byte elements declares {exact} bytes, over the {} bytes (64 PiB) an array or chunk may have",
                MAX_ARRAY_BYTES
            ));
        }
    }
    Ok(())
}

/// Most bytes a shard's index may take: 2^28 (256 MiB, 16,777,216 inner
/// chunks). The index is read whole before any part of its shard, sized by
/// the shard's declared inner chunks whatever the array's extent.
pub const MAX_SHARD_INDEX_BYTES: u64 = 1 << 28;

/// Refuses sharding whose index (16 bytes per inner chunk of a shard, at
/// every level of nested sharding) would take more than
/// [`MAX_SHARD_INDEX_BYTES`], with the numbers.
fn check_shard_indexes(
    metadata: &ArrayMetadata,
    storage_chunk: &[u64],
) -> std::result::Result<(), String> {
    let ArrayMetadata::V3(m) = metadata else {
        return Ok(());
    };
    let mut outer = storage_chunk.to_vec();
    let mut codecs: Vec<Value> = (m.codecs.iter())
        .filter_map(|c| serde_json::to_value(c).ok())
        .collect();
    loop {
        let Some(sharding) = codecs.iter().find(|c| c["name"] == "sharding_indexed") else {
            return Ok(());
        };
        let config = sharding["configuration"].clone();
        let inner: Option<Vec<u64>> = (config["chunk_shape"].as_array())
            .and_then(|dims| dims.iter().map(Value::as_u64).collect());
        // Shapes zarrs refuses (rank, zeros) are its errors to give.
        let Some(inner) = inner.filter(|i| i.len() == outer.len() && !i.contains(&0)) else {
            return Ok(());
        };
        let entries = (outer.iter().zip(&inner))
            .try_fold(1u128, |n, (o, i)| n.checked_mul(u128::from(o.div_ceil(*i))));
        let bytes = entries.and_then(|n| n.checked_mul(16));
        if bytes.is_none_or(|b| b > u128::from(MAX_SHARD_INDEX_BYTES)) {
            let said = bytes.map_or_else(|| "more than 2^128".to_string(), |b| b.to_string());
            return Err(format!(
                "its shards of {outer:?} in inner chunks of {inner:?} have an index of {said} \
                 bytes, read whole for any read of a shard, over the {MAX_SHARD_INDEX_BYTES} \
                 bytes (256 MiB) a shard index may have"
            ));
        }
        outer = inner;
        codecs = config["codecs"].as_array().cloned().unwrap_or_default();
    }
}

/// A v2 complex array with a `null` fill value (as zarr-python and xarray
/// write them) with zero instead: zarrs maps a `null` fill to the scalar
/// `0`, which complex types refuse. The fill only gives the values of
/// chunks never written; masking follows the metadata as written.
fn with_complex_null_fill_as_zero(metadata: ArrayMetadata) -> ArrayMetadata {
    match metadata {
        ArrayMetadata::V2(mut m)
            if m.fill_value.is_null()
                && matches!(&m.dtype, DataTypeMetadataV2::Simple(d)
                    if d.trim_start_matches(['<', '>', '|', '=']).starts_with('c')) =>
        {
            m.fill_value = FillValueMetadata::Array(vec![
                FillValueMetadata::from(0.0),
                FillValueMetadata::from(0.0),
            ]);
            ArrayMetadata::V2(m)
        }
        other => other,
    }
}

/// A Zarr array opened for reading, with its CF decoding.
pub struct ZarrArray {
    store: String,
    name: String,
    array: Array<dyn ReadableListableStorageTraits>,
    dims: Vec<String>,
    decoder: ColumnDecoder,
    /// The directory the store's keys live under, for local stores.
    local_root: Option<PathBuf>,
    /// The object store of a remote store (its read-ahead windows).
    remote: Option<Arc<RemoteStorage>>,
    /// How to read chunk files directly, when they are uncompressed and local.
    raw: Option<RawChunks>,
}

impl ZarrArray {
    /// Opens an array from its discovered metadata. Unknown codecs and data
    /// types are reported here, naming the store and array. `access` says
    /// where the bytes are: a local directory lets [`Self::fingerprint_all`]
    /// see modification times and [`Self::read`] read uncompressed chunks
    /// straight from their files; an object store lets operators read
    /// ahead ([`Self::chunk_keys`]).
    pub fn open(
        storage: &ReadableListableStorage,
        store: &str,
        entry: ArrayEntry,
        access: &StoreAccess,
    ) -> Result<Self> {
        let (local_root, remote) = match access {
            StoreAccess::Local(path) => (Some(path.clone()), None),
            StoreAccess::Remote(remote) => (None, Some(Arc::clone(remote))),
        };
        let name = entry.name.clone();
        let fail = |message: String| ZarrFusionError::array(store, &name, message);
        let (attributes, v2_fill): (Map<String, Value>, Option<Value>) = match &entry.metadata {
            ArrayMetadata::V3(m) => (m.attributes.clone(), None),
            ArrayMetadata::V2(m) => (
                m.attributes.clone(),
                serde_json::to_value(&m.fill_value)
                    .ok()
                    .filter(|v| !v.is_null()),
            ),
        };
        let array = Array::new_with_metadata(
            Arc::clone(storage),
            &entry.path,
            with_complex_null_fill_as_zero(entry.metadata),
        )
        .map_err(|e| fail(format!("cannot open: {e}")))?;
        let stored = StoredType::from_zarr(array.data_type()).map_err(&fail)?;
        let decoder = ColumnDecoder::new(stored, &attributes, v2_fill.as_ref()).map_err(&fail)?;
        let dims = dimension_names(&array, &attributes);
        if dims.len() != array.shape().len() {
            return Err(fail(format!(
                "{} dimension names for {} dimensions",
                dims.len(),
                array.shape().len()
            )));
        }
        let mut opened = Self {
            store: store.to_string(),
            name: entry.name,
            array,
            dims,
            decoder,
            local_root,
            remote,
            raw: None,
        };
        // Before anything is sized from the metadata.
        check_declared_sizes(opened.shape(), &opened.chunk_shape(), opened.element_size())
            .map_err(&fail)?;
        check_shard_indexes(opened.array.metadata(), &opened.chunk_shape()).map_err(&fail)?;
        opened.raw = RawChunks::detect(
            &opened.array,
            opened.local_root.as_deref(),
            opened.decoder.nan_scan(),
        );
        Ok(opened)
    }

    /// The object store this array is read from, when it is remote.
    pub fn remote(&self) -> Option<&Arc<RemoteStorage>> {
        self.remote.as_ref()
    }

    /// The keys of the stored chunks (shards when sharded) that reading
    /// `ranges` fetches whole, in the order of the chunk grid (see
    /// [`chunk_keys`]): what a read-ahead window is given.
    pub fn chunk_keys(&self, ranges: &[Range<u64>]) -> Vec<StoreKey> {
        chunk_keys(&self.array, ranges)
    }

    /// Bytes of the largest stored chunk, decoded: what one read-ahead
    /// chunk is counted as (encoded chunks are rarely larger).
    pub fn chunk_bytes(&self) -> usize {
        let cells: u64 = self.chunk_shape().iter().product();
        (cells as usize).saturating_mul(self.element_size())
    }

    /// The array's name inside its group.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the array is stored as Zarr v3 (else v2).
    pub fn is_v3(&self) -> bool {
        matches!(self.array.metadata(), ArrayMetadata::V3(_))
    }

    /// The store this array belongs to.
    pub fn store(&self) -> &str {
        &self.store
    }

    /// Dimension names, outermost first.
    pub fn dims(&self) -> &[String] {
        &self.dims
    }

    /// The array's shape.
    pub fn shape(&self) -> &[u64] {
        self.array.shape()
    }

    /// The shape of the chunk at the grid's origin (storage chunks: shards when sharded).
    pub fn chunk_shape(&self) -> Vec<u64> {
        let origin = vec![0; self.shape().len()];
        match self.array.chunk_shape(&origin) {
            Ok(shape) => shape.iter().map(|n| n.get()).collect(),
            Err(_) => self.shape().to_vec(),
        }
    }

    /// The Arrow type of the decoded values.
    pub fn data_type(&self) -> &DataType {
        self.decoder.data_type()
    }

    /// How its values are decoded.
    pub fn decoder(&self) -> &ColumnDecoder {
        &self.decoder
    }

    /// Decodes its times and durations no more: they are read as their
    /// numbers (see [`ColumnDecoder::keeping_numbers`]).
    pub fn keep_numbers(&mut self) {
        self.decoder = self.decoder.keeping_numbers();
        self.raw = RawChunks::detect(
            &self.array,
            self.local_root.as_deref(),
            self.decoder.nan_scan(),
        );
    }

    /// The array's attributes, as stored (CF encoding attributes included).
    pub fn attributes(&self) -> &Map<String, Value> {
        self.array.attributes()
    }

    /// Bytes per stored element (an estimate for strings).
    pub fn element_size(&self) -> usize {
        self.array.data_type().fixed_size().unwrap_or(16)
    }

    /// Bytes a cell holds at the peak of decoding it: stored and decoded.
    pub fn peak_bytes_per_cell(&self) -> usize {
        self.decoder.peak_bytes_per_cell(self.element_size())
    }

    /// Writes what identifies the stored state of each of `arrays` to
    /// `out`, one after another: its name and metadata, and, in local
    /// stores, the keys stored under it with their sizes and modification
    /// times (a listing, no chunk read); in object stores, the size, ETag
    /// and modification time of its metadata objects only (nothing lists
    /// chunk keys, whose number has no bound; a chunk rewritten without its
    /// metadata is not seen). The metadata objects of all the arrays of one
    /// object store are asked for at once (one round trip, not one per
    /// array and object).
    pub fn fingerprint_all(arrays: &[&ZarrArray], out: &mut dyn Write) -> Result<()> {
        let mut versions: Vec<Option<Vec<String>>> = vec![None; arrays.len()];
        for (i, array) in arrays.iter().enumerate() {
            let Some(remote) = &array.remote else {
                continue;
            };
            if versions[i].is_some() {
                continue;
            }
            let same: Vec<usize> = (i..arrays.len())
                .filter(|&j| (arrays[j].remote.as_ref()).is_some_and(|r| Arc::ptr_eq(r, remote)))
                .collect();
            let keys = (same.iter())
                .map(|&j| arrays[j].metadata_keys())
                .collect::<Result<Vec<_>>>()?;
            let all: Vec<StoreKey> = keys.iter().flatten().cloned().collect();
            let mut answers = all.iter().zip(remote.stat_all(&all));
            for (&j, keys) in same.iter().zip(&keys) {
                let lines = (answers.by_ref().take(keys.len()))
                    .map(|(key, answer)| match answer {
                        Ok(stat) => Ok(format!(
                            "{} {}",
                            key.as_str(),
                            stat.as_deref().unwrap_or("absent")
                        )),
                        Err(e) => Err(arrays[j].fingerprint_error(&e)),
                    })
                    .collect::<Result<Vec<_>>>()?;
                versions[j] = Some(lines);
            }
        }
        for (array, versions) in arrays.iter().zip(versions) {
            array.fingerprint(out, versions)?;
        }
        Ok(())
    }

    fn fingerprint_error(&self, e: &dyn std::fmt::Display) -> ZarrFusionError {
        ZarrFusionError::array(&self.store, &self.name, format!("cannot list: {e}"))
    }

    /// The keys of this array's own metadata objects.
    fn metadata_keys(&self) -> Result<Vec<StoreKey>> {
        let path = self.array.path().as_str().trim_matches('/');
        let names: &[&str] = match self.is_v3() {
            true => &["zarr.json"],
            false => &[".zarray", ".zattrs"],
        };
        (names.iter())
            .map(|name| {
                let key = match path.is_empty() {
                    true => name.to_string(),
                    false => format!("{path}/{name}"),
                };
                StoreKey::new(key).map_err(|e| self.fingerprint_error(&e))
            })
            .collect()
    }

    /// One array's part of [`Self::fingerprint_all`]: `versions` are its
    /// metadata objects' lines when it is in an object store.
    fn fingerprint(&self, out: &mut dyn Write, versions: Option<Vec<String>>) -> Result<()> {
        let fail = |e: &dyn std::fmt::Display| self.fingerprint_error(e);
        let metadata = serde_json::to_string(self.array.metadata()).map_err(|e| fail(&e))?;
        let write = |out: &mut dyn Write, text: &str| {
            out.write_all(text.as_bytes())
                .and_then(|()| out.write_all(b"\n"))
                .map_err(|e| fail(&e))
        };
        write(out, &self.name)?;
        write(out, &metadata)?;
        if let Some(versions) = versions {
            for line in versions {
                write(out, &line)?;
            }
            return Ok(());
        }
        let path = self.array.path().as_str().trim_matches('/');
        let prefix = if path.is_empty() {
            StorePrefix::root()
        } else {
            StorePrefix::new(format!("{path}/")).map_err(|e| fail(&e))?
        };
        let storage = self.array.storage();
        let keys = storage.list_prefix(&prefix).map_err(|e| fail(&e))?;
        let total = storage.size_prefix(&prefix).map_err(|e| fail(&e))?;
        write(out, &format!("{} keys, {total} bytes", keys.len()))?;
        for key in &keys {
            let stat = self.local_root.as_ref().map(|root| {
                std::fs::metadata(root.join(key.as_str())).map_or((0, 0), |m| {
                    let modified = m
                        .modified()
                        .ok()
                        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                        .map_or(0, |d| d.as_nanos());
                    (m.len(), modified)
                })
            });
            match stat {
                Some((size, modified)) => {
                    write(out, &format!("{} {size} {modified}", key.as_str()))?
                }
                None => write(out, key.as_str())?,
            }
        }
        Ok(())
    }

    /// Reads and decodes the subset `ranges` (one range per dimension), in C
    /// order. Uncompressed chunks of local stores are read into buffers of
    /// `pool`, which get them back when the column is dropped.
    pub fn read(&self, ranges: &[Range<u64>], pool: &ChunkBufferPool) -> Result<ArrayRef> {
        let raw = match &self.raw {
            Some(raw) => raw.read(&self.array, ranges, pool).map_err(
                |RawChunkError {
                     chunk,
                     key,
                     message,
                 }| ZarrFusionError::Chunk {
                    store: self.store.clone(),
                    array: self.name.clone(),
                    chunk,
                    key,
                    message,
                },
            )?,
            None => None,
        };
        match raw {
            Some(raw) => self
                .decoder
                .decode_buffer(raw.buffer, raw.has_nan)
                .map_err(|message| ZarrFusionError::array(&self.store, &self.name, message)),
            None => self.read_through_codecs(ranges),
        }
    }

    /// Whether chunks are read straight from files (uncompressed, local):
    /// then a box smaller than a chunk costs only its own bytes.
    pub fn reads_chunk_files(&self) -> bool {
        self.raw.is_some()
    }

    /// Reads and decodes `ranges` through zarrs' codec pipeline, whatever
    /// the codecs: what [`Self::read`] does when it cannot read chunk files.
    pub fn read_through_codecs(&self, ranges: &[Range<u64>]) -> Result<ArrayRef> {
        let subset = ArraySubset::new_with_ranges(ranges);
        let decoded = match self.decoder.stored() {
            StoredType::String => {
                codec_read(|| self.array.retrieve_array_subset::<Vec<String>>(&subset))
                    .map(|strings| Ok(self.decoder.decode_strings(strings)))
            }
            _ => codec_read(|| (self.array).retrieve_array_subset::<ArrayBytes<'static>>(&subset))
                .map(|bytes| match bytes.into_fixed() {
                    Ok(raw) => self.decoder.decode_fixed(raw.into_owned()),
                    Err(e) => Err(e.to_string()),
                }),
        };
        match decoded {
            Ok(Ok(column)) => Ok(column),
            Ok(Err(message)) => Err(ZarrFusionError::array(&self.store, &self.name, message)),
            Err(message) => Err(self.locate_error(&subset, message)),
        }
    }

    /// Finds which chunk of `subset` fails, to name it in the error: the
    /// chunk whose key a failed read names (object stores: no request is
    /// sent again), else the first chunk whose part inside `subset` fails
    /// to read on its own.
    fn locate_error(&self, subset: &ArraySubset, message: String) -> ZarrFusionError {
        let chunk_error = |indices: &[u64], message: String| ZarrFusionError::Chunk {
            store: self.store.clone(),
            array: self.name.clone(),
            key: self.array.chunk_key(indices).to_string(),
            chunk: indices.to_vec(),
            message,
        };
        if let Ok(Some(chunks)) = self.array.chunks_in_array_subset(subset) {
            let named = chunks.indices().into_iter().find(|indices| {
                message.contains(&format!("'{}'", self.array.chunk_key(indices).as_str()))
            });
            if let Some(indices) = named {
                return chunk_error(&indices, message);
            }
            for indices in &chunks.indices() {
                // Only the chunk's cells inside the block (within the
                // budget the block was planned in): a chunk may declare
                // far more cells than the array has, and decoding it whole
                // would allocate them all.
                let inside = (self.array.chunk_subset(&indices).ok()).and_then(|chunk| {
                    (chunk.overlap(subset).ok())
                        .and_then(|part| part.relative_to(chunk.start()).ok())
                });
                let Some(inside) = inside else {
                    continue;
                };
                let read = codec_read(|| {
                    (self.array).retrieve_chunk_subset::<ArrayBytes<'static>>(&indices, &inside)
                });
                if let Err(message) = read {
                    return chunk_error(&indices, message);
                }
            }
        }
        ZarrFusionError::array(&self.store, &self.name, message)
    }
}

impl std::fmt::Debug for ZarrArray {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZarrArray")
            .field("store", &self.store)
            .field("name", &self.name)
            .field("shape", &self.shape())
            .field("dims", &self.dims)
            .field("decoder", &self.decoder)
            .finish()
    }
}

/// Runs a read through zarrs' codec pipeline, its failure as text. A
/// panic of a codec on damaged bytes (one indexing past its buffer, as
/// zarrs' `vlen-utf8` v2 codec does on a corrupt length) is such a failure
/// too, not the end of the query or of the process.
pub fn codec_read<T>(
    read: impl FnOnce() -> std::result::Result<T, ArrayError>,
) -> std::result::Result<T, String> {
    match catch_panic("codec", read) {
        Ok(answer) => answer.map_err(|e| e.to_string()),
        Err(p) => Err(format!("the codec failed on these bytes: {}", p.message)),
    }
}

/// The keys of the stored chunks of `array` that reading `ranges` fetches
/// whole, in the order of the chunk grid (C order): what a read-ahead
/// window is given. A shard is fetched whole when `ranges` covers at least
/// half of its cells (inside the array): its index and inner chunks are
/// then cut out of the one answer; a shard covered less is read by ranges
/// (its index, then the inner chunks needed) and left out.
pub fn chunk_keys<T: ?Sized>(array: &Array<T>, ranges: &[Range<u64>]) -> Vec<StoreKey> {
    let subset = ArraySubset::new_with_ranges(ranges);
    let Ok(Some(chunks)) = array.chunks_in_array_subset(&subset) else {
        return Vec::new();
    };
    let sharded = is_sharded(array.metadata());
    chunks
        .indices()
        .into_iter()
        .filter(|indices| !sharded || mostly_covered(array, indices, ranges))
        .map(|indices| array.chunk_key(&indices))
        .collect()
}

/// Whether `ranges` covers at least half of the cells the chunk at
/// `indices` has inside the array.
fn mostly_covered<T: ?Sized>(array: &Array<T>, indices: &[u64], ranges: &[Range<u64>]) -> bool {
    let Ok(chunk) = array.chunk_subset_bounded(indices) else {
        return false;
    };
    // The covered fraction, a factor per dimension: no product of sizes
    // from metadata that could overflow.
    let mut fraction = 1.0f64;
    for ((&start, &shape), range) in chunk.start().iter().zip(chunk.shape()).zip(ranges) {
        let end = start.saturating_add(shape);
        let covered = end.min(range.end).saturating_sub(start.max(range.start));
        fraction *= covered as f64 / shape.max(1) as f64;
    }
    fraction >= 0.5
}

/// Whether an array's stored chunks are shards (the sharding codec).
pub(crate) fn is_sharded(metadata: &ArrayMetadata) -> bool {
    match metadata {
        ArrayMetadata::V3(m) => m.codecs.iter().any(|c| c.name() == "sharding_indexed"),
        ArrayMetadata::V2(_) => false,
    }
}

/// The name given to an array stored at the root of a store: the store's base name.
pub fn root_name(store: &str) -> &str {
    let base = store
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or(store);
    base.strip_suffix(".zarr").unwrap_or(base)
}

/// Dimension names from v3 `dimension_names` or v2 `_ARRAY_DIMENSIONS`,
/// else `dim_0`, `dim_1`, ...
pub(crate) fn dimension_names(
    array: &Array<dyn ReadableListableStorageTraits>,
    attributes: &Map<String, Value>,
) -> Vec<String> {
    let rank = array.shape().len();
    if let Some(names) = array.dimension_names() {
        if names.iter().all(Option::is_some) {
            return names.iter().flatten().cloned().collect();
        }
    }
    if let Some(Value::Array(names)) = attributes.get("_ARRAY_DIMENSIONS") {
        let names: Vec<String> = names
            .iter()
            .filter_map(|n| n.as_str().map(str::to_string))
            .collect();
        if names.len() == rank {
            return names;
        }
    }
    (0..rank).map(|i| format!("dim_{i}")).collect()
}

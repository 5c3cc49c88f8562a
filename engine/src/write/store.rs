//! Writing Zarr stores: groups with their coordinates and consolidated
//! metadata ([`prepare_group`]), a [`Grid`]'s arrays and values, chunks
//! stored box by box, and the two atomic ways a store appears (used
//! through [`super::target::CopyTarget`]):
//!
//! - locally, everything is written into a temporary directory beside the
//!   target, flushed to disk and renamed onto the target only when
//!   complete: on an error or a cancellation the temporary directory is
//!   removed and nothing appears at the target. An existing target is
//!   refused, never overwritten. What a killed process left beside a
//!   target is removed by the next write there ([`super::stamp`]);
//! - in an object store, the empty prefix is claimed, chunks are written
//!   first and metadata last, and everything is erased on failure
//!   ([`write_claimed`]).

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, Int64Array};
use datafusion::arrow::buffer::Buffer;
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Int64Type, TimeUnit};
use datafusion::common::{exec_err, DataFusionError, Result};
use serde_json::{json, Map, Value};
use zarrfusion_udfs::calendar::Calendar;
use zarrfusion_udfs::cf_time::CfTime;
use zarrfusion_udfs::complex::complex_part;
use zarrs::array::{Array as ZarrsArray, ArrayBytes, ArraySubset};
use zarrs::metadata::ArrayMetadata;
use zarrs::storage::{
    ReadableWritableListableStorage, ReadableWritableListableStorageTraits,
    ReadableWritableStorageTraits, StoreKey, StorePrefix,
};

use super::grid::{Grid, GridDimension};
use super::options::{Codec, ZarrVersion, ZarrWriteOptions};
use super::stamp::{gone_owner, owner_record, sweep, unique_suffix, Leftover};
use crate::memory::Projection;
use crate::table::Coordinate;
use crate::zarr::open_writable_remote;

/// Decoded bytes a chosen chunk aims at.
const CHUNK_TARGET_BYTES: u64 = 8 << 20;

/// What was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteSummary {
    /// Cells in the grid.
    pub cells: u64,
    /// Uncompressed bytes of the variables and coordinates.
    pub bytes: u64,
}

/// Fails when `target` exists: a write never replaces data.
pub fn check_target(target: &Path) -> Result<()> {
    if target.exists() {
        return exec_err!(
            "cannot write Zarr to '{}': it already exists (remove it first or choose another path)",
            target.display()
        );
    }
    Ok(())
}

/// A fresh name for the temporary directory of a write to `target`, beside
/// it (what killed writers left there is swept first). An existing
/// `target`, or one whose directory does not exist, is refused.
pub fn temporary_beside(target: &Path) -> Result<PathBuf> {
    check_target(target)?;
    let parent = parent_of(target);
    if !parent.is_dir() {
        return exec_err!(
            "cannot write Zarr to '{}': directory '{}' does not exist",
            target.display(),
            parent.display()
        );
    }
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out.zarr".into());
    // What killed writers left beside their targets goes first.
    sweep(&parent, Leftover::TemporaryTarget);
    Ok(parent.join(format!(".{name}.{}.zarrfusion-tmp", unique_suffix())))
}

/// The directory `target` is in.
fn parent_of(target: &Path) -> PathBuf {
    match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Runs `write` on the temporary directory `temporary` beside `target`
/// (from [`temporary_beside`]; a write on a cluster names it while
/// planning, so that its workers write there) and renames it onto
/// `target` when `write` succeeds and `cancelled` is not set; otherwise
/// removes it, so nothing appears at `target`. An existing `target` is
/// refused. `write` creates the directory it is given.
pub fn write_atomically_at<T>(
    target: &Path,
    temporary: &Path,
    cancelled: &AtomicBool,
    write: impl FnOnce(&Path) -> Result<T>,
) -> Result<T> {
    check_target(target)?;
    let parent = parent_of(target);
    let result = write(temporary).and_then(|summary| {
        if cancelled.load(Ordering::Relaxed) {
            return exec_err!("the Zarr write to '{}' was cancelled", target.display());
        }
        check_target(target)?;
        // On disk before it is in place: a crash after the rename never
        // shows a store with missing or empty chunks.
        sync_tree(temporary)?;
        std::fs::rename(temporary, target).map_err(|e| {
            DataFusionError::Execution(format!(
                "cannot move the finished Zarr store into place at '{}': {e}",
                target.display()
            ))
        })?;
        sync_directory(&parent);
        Ok(summary)
    });
    if result.is_err() {
        let _ = std::fs::remove_dir_all(temporary);
    }
    result
}

/// The object at the root of an object-store target while a write holds
/// it: who holds it (`{"pid", "host", "boot", "started"}`).
pub const CLAIM_KEY: &str = ".zarrfusion-write";

/// Runs `write` on the empty object-store prefix at `url` (reached with
/// the write's object-store `options`), held for it alone: the claim
/// object is created first with a conditional `PUT` (so two writes to one
/// prefix cannot both start: the second is refused, naming the first), a
/// prefix that holds anything else is refused, and the claim is removed
/// last. When `write` fails, everything under the prefix (this write's
/// alone, since it held it) is erased, the claim last. A claim left by a
/// process of this boot of this machine that is gone (killed) is taken
/// over: its leftovers are erased first; one of another machine or boot
/// (two machines may share a host name; a boot id they do not) is reported
/// with the key to remove.
pub fn write_claimed<T>(
    display: &str,
    url: &url::Url,
    options: &std::collections::HashMap<String, String>,
    runtime: &datafusion::execution::runtime_env::RuntimeEnv,
    write: impl FnOnce(&ReadableWritableListableStorage) -> Result<T>,
) -> Result<T> {
    let failed = |e: &dyn std::fmt::Display| {
        DataFusionError::Execution(format!("cannot write Zarr to '{display}': {e}"))
    };
    let remote = open_writable_remote(display, url, options, runtime).map_err(|e| failed(&e))?;
    let storage: ReadableWritableListableStorage = remote.clone();
    let claim = StoreKey::new(CLAIM_KEY).map_err(|e| failed(&e))?;
    let mine = owner_record().to_string();
    let everything_but_claim = |storage: &ReadableWritableListableStorage| {
        (storage.list_prefix(&StorePrefix::root()))
            .map(|keys| keys.into_iter().filter(|k| *k != claim).collect::<Vec<_>>())
            .map_err(|e| failed(&e))
    };
    let mut taken_over = false;
    while !remote
        .put_if_absent(&claim, mine.clone().into_bytes().into())
        .map_err(|e| failed(&e))?
    {
        let holder: Value = (storage.get(&claim).ok().flatten())
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .unwrap_or(Value::Null);
        match gone_owner(&holder) {
            Some(pid) if !taken_over => {
                log::info!("'{display}': taking over the write of process {pid}, which is gone");
                let left = everything_but_claim(&storage)?;
                storage.erase_many(&left).map_err(|e| failed(&e))?;
                storage.erase(&claim).map_err(|e| failed(&e))?;
                taken_over = true;
            }
            _ => {
                return Err(failed(&format!(
                    "another write holds it ({holder}); if that write was killed, remove                      '{CLAIM_KEY}' under it and what that write left"
                )))
            }
        }
    }
    // Held: erases what this write made when it fails, the claim last.
    let give_up = |error: DataFusionError| {
        if let Ok(left) = everything_but_claim(&storage) {
            let _ = storage.erase_many(&left);
        }
        let _ = storage.erase(&claim);
        error
    };
    match everything_but_claim(&storage) {
        Ok(existing) if existing.is_empty() => {}
        Ok(_) => {
            // Nothing of this write's to erase: the claim only.
            let _ = storage.erase(&claim);
            return Err(failed(
                &"it already exists (remove it first or choose another path)",
            ));
        }
        Err(e) => return Err(give_up(e)),
    }
    let written = write(&storage).map_err(give_up)?;
    storage.erase(&claim).map_err(|e| failed(&e))?;
    Ok(written)
}

/// Flushes every file under `dir` to disk, then the directories (their
/// entries). A file that cannot be flushed fails the write.
fn sync_tree(dir: &Path) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| io_error(dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| io_error(dir, e))?;
        let path = entry.path();
        let kind = entry.file_type().map_err(|e| io_error(&path, e))?;
        if kind.is_dir() {
            sync_tree(&path)?;
        } else if kind.is_file() {
            (std::fs::File::open(&path))
                .and_then(|file| file.sync_all())
                .map_err(|e| io_error(&path, format!("cannot flush it to disk: {e}")))?;
        }
    }
    sync_directory(dir);
    Ok(())
}

/// Flushes a directory's entries (where the file system allows it).
fn sync_directory(dir: &Path) {
    if let Ok(handle) = std::fs::File::open(dir) {
        let _ = handle.sync_all();
    }
}

/// Adds array `name`'s metadata (its JSON, attributes inside) to a
/// group's consolidated metadata: v3 under its name, v2 as `name/.zarray`
/// and `name/.zattrs`.
pub fn consolidate(consolidated: &mut Map<String, Value>, name: &str, metadata: Value, v2: bool) {
    if !v2 {
        consolidated.insert(name.to_string(), metadata);
        return;
    }
    let mut zarray = metadata;
    let attrs = zarray
        .as_object_mut()
        .and_then(|m| m.remove("attributes"))
        .unwrap_or_else(|| json!({}));
    consolidated.insert(format!("{name}/.zarray"), zarray);
    consolidated.insert(format!("{name}/.zattrs"), attrs);
}

/// An error writing at `path`.
pub fn io_error(path: &Path, e: impl std::fmt::Display) -> DataFusionError {
    DataFusionError::Execution(format!("cannot write Zarr at '{}': {e}", path.display()))
}

/// The arrays a grid is written as: its coordinates and its variables (in
/// chunks of `chunks`), with the attributes the grid gives them.
pub(crate) fn grid_arrays(
    grid: &Grid,
    chunks: &[u64],
) -> (Vec<GroupCoordinate>, Vec<GroupVariable>) {
    let coordinates = grid.dims.iter().map(group_coordinate).collect();
    let variables = (grid.variables.iter())
        .map(|v| GroupVariable {
            name: v.name.clone(),
            data_type: v.values.data_type().clone(),
            shape: grid.shape(),
            chunks: chunks.to_vec(),
            attributes: v.attributes.clone(),
        })
        .collect();
    (coordinates, variables)
}

/// The coordinate array dimension `d` of a grid is written as.
pub(crate) fn group_coordinate(d: &GridDimension) -> GroupCoordinate {
    GroupCoordinate {
        name: d.name.clone(),
        values: Coordinate::Values(Arc::clone(&d.coords)),
        attributes: d.attributes.clone(),
        // Values computed from a model calendar's dates (`time +
        // INTERVAL '1 day'`) may be none of its dates: written as
        // timestamps then.
        calendar: d.calendar.filter(|&calendar| {
            let dates = dates_of(&d.coords, calendar);
            if !dates {
                log::warn!(
                    "COPY TO Zarr: column '{}' holds times that are no dates of the {} \
                     calendar of the coordinate it is named after; written as timestamps",
                    d.name,
                    calendar.name()
                );
            }
            dates
        }),
        stored: true,
    }
}

/// Stores the values of `grid`'s variables (in chunks of `chunks`) into
/// `group`'s arrays (made by [`prepare_group`] from [`grid_arrays`]),
/// stopping when `cancelled` is set; what was written.
pub(crate) fn store_grid(
    grid: &Grid,
    group: &GroupWrite,
    chunks: &[u64],
    cancelled: &AtomicBool,
) -> Result<WriteSummary> {
    let shape = grid.shape();
    let mut bytes: u64 = (grid.dims.iter())
        .map(|d| (d.coords.len() * d.coords.data_type().primitive_width().unwrap_or(8)) as u64)
        .sum();
    for (array, variable) in group.variables.iter().zip(&grid.variables) {
        if cancelled.load(Ordering::Relaxed) {
            return exec_err!("the Zarr write was cancelled");
        }
        bytes += write_values(array, &variable.values, &shape, chunks, cancelled).map_err(|e| {
            DataFusionError::Execution(format!("COPY TO Zarr: array '{}': {e}", variable.name))
        })?;
    }
    Ok(WriteSummary {
        cells: shape.iter().product(),
        bytes,
    })
}

/// Writes `value` as pretty JSON at `path`.
pub fn write_json(path: &Path, value: &Value) -> Result<()> {
    let text = serde_json::to_vec_pretty(value).map_err(|e| io_error(path, e))?;
    std::fs::write(path, text).map_err(|e| io_error(path, e))
}

/// Writes `bytes` (C order, the array's data type) into the box `ranges` of
/// `array`, encoding the chunks it covers (reading those it covers in part);
/// an error naming the box and the array.
pub fn store_box<S>(
    array: &ZarrsArray<S>,
    ranges: &[Range<u64>],
    bytes: &[u8],
) -> std::result::Result<(), String>
where
    S: ?Sized + ReadableWritableStorageTraits + 'static,
{
    array
        .store_array_subset(
            &ArraySubset::new_with_ranges(ranges),
            ArrayBytes::new_flen(bytes),
        )
        .map_err(|e| format!("writing {ranges:?} of '{}': {e}", array.path()))
}

/// Writes `values` (C order over `shape`) one slab of chunks along the
/// outermost dimension at a time, each slab holding enough chunks for
/// zarrs to encode one on every core at once; returns the bytes written
/// (uncompressed).
fn write_values(
    array: &ZarrsArray<dyn ReadableWritableListableStorageTraits>,
    values: &ArrayRef,
    shape: &[u64],
    chunk: &[u64],
    cancelled: &AtomicBool,
) -> std::result::Result<u64, String> {
    let (all, width) = value_bytes(values)?;
    let all = all.as_slice();
    if shape.is_empty() || shape.contains(&0) {
        return Ok(0);
    }
    let row_bytes = (shape[1..].iter().product::<u64>() as usize) * width;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let chunks_across = (shape[1..].iter().zip(&chunk[1..])).fold(1u64, |n, (&len, &c)| {
        n.saturating_mul(len.div_ceil(c.max(1)))
    });
    let slab = chunk[0]
        .max(1)
        .saturating_mul(cores.div_ceil(chunks_across).max(1));
    let mut start = 0u64;
    while start < shape[0] {
        if cancelled.load(Ordering::Relaxed) {
            return Err("cancelled".into());
        }
        let end = start.saturating_add(slab).min(shape[0]);
        let ranges: Vec<Range<u64>> = std::iter::once(start..end)
            .chain(shape[1..].iter().map(|&n| 0..n))
            .collect();
        let slab = &all[start as usize * row_bytes..end as usize * row_bytes];
        store_box(array, &ranges, slab)?;
        start = end;
    }
    Ok(all.len() as u64)
}

/// The values' bytes in C order as Zarr stores them (complex numbers as
/// interleaved real and imaginary parts), and the bytes per value.
pub(crate) fn value_bytes(values: &ArrayRef) -> std::result::Result<(Buffer, usize), String> {
    if complex_part(values.data_type()).is_some() {
        let parts = values.as_struct();
        let (re, im) = (parts.column(0).to_data(), parts.column(1).to_data());
        let width = re
            .data_type()
            .primitive_width()
            .ok_or("not a primitive type")?;
        let slice = |d: &datafusion::arrow::array::ArrayData| {
            d.buffers()[0].as_slice()[d.offset() * width..(d.offset() + d.len()) * width].to_vec()
        };
        let (re, im) = (slice(&re), slice(&im));
        let mut bytes = Vec::with_capacity(2 * re.len());
        for (r, i) in re.chunks_exact(width).zip(im.chunks_exact(width)) {
            bytes.extend_from_slice(r);
            bytes.extend_from_slice(i);
        }
        return Ok((Buffer::from_vec(bytes), 2 * width));
    }
    let data = values.to_data();
    let width = data
        .data_type()
        .primitive_width()
        .ok_or("not a primitive type")?;
    let bytes = data.buffers()[0].slice_with_length(data.offset() * width, data.len() * width);
    Ok((bytes, width))
}

/// A coordinate's stored values and attributes: times become CF numbers,
/// of their model calendar when they have one (microseconds since
/// 1970-01-01 of that calendar, so that xarray reads the same cftime
/// dates back; every time must be a date of it).
pub(crate) fn coordinate(
    coords: &ArrayRef,
    calendar: Option<Calendar>,
) -> Result<(ArrayRef, Map<String, Value>)> {
    if let (Some(calendar), DataType::Timestamp(..)) = (calendar, coords.data_type()) {
        return calendar_times(coords, calendar);
    }
    let mut attributes = Map::new();
    let cf = |unit: &str| -> Map<String, Value> {
        let mut m = Map::new();
        m.insert(
            "units".into(),
            json!(format!("{unit} since 1970-01-01T00:00:00")),
        );
        m.insert("calendar".into(), json!("proleptic_gregorian"));
        m
    };
    let values = match coords.data_type() {
        DataType::Timestamp(unit, _) => {
            attributes = cf(match unit {
                TimeUnit::Second => "seconds",
                TimeUnit::Millisecond => "milliseconds",
                TimeUnit::Microsecond => "microseconds",
                TimeUnit::Nanosecond => "nanoseconds",
            });
            cast(coords, &DataType::Int64)?
        }
        DataType::Date32 => {
            attributes = cf("days");
            cast(coords, &DataType::Int32)?
        }
        DataType::Date64 => {
            attributes = cf("milliseconds");
            cast(coords, &DataType::Int64)?
        }
        DataType::Float16 => cast(coords, &DataType::Float32)?,
        t if t.is_numeric() => Arc::clone(coords),
        other => return exec_err!("cannot write a Zarr coordinate of type {other}"),
    };
    Ok((values, attributes))
}

/// The units a model calendar's times are written in (see [`coordinate`]).
const CALENDAR_UNITS: &str = "microseconds since 1970-01-01 00:00:00";

/// The CF encoding of times of `calendar` (see [`coordinate`]).
fn calendar_encoding(calendar: Calendar) -> Result<CfTime> {
    match CfTime::parse(CALENDAR_UNITS, Some(calendar.name())) {
        Ok(Some(time)) => Ok(time),
        other => exec_err!(
            "cannot encode times of the {} calendar: {other:?}",
            calendar.name()
        ),
    }
}

/// Whether every timestamp of `coords` is a date of `calendar` that
/// [`coordinate`] can write.
fn dates_of(coords: &ArrayRef, calendar: Calendar) -> bool {
    calendar_times(coords, calendar).is_ok()
}

/// Times of a model calendar as [`coordinate`] writes them.
fn calendar_times(coords: &ArrayRef, calendar: Calendar) -> Result<(ArrayRef, Map<String, Value>)> {
    let time = calendar_encoding(calendar)?;
    let nanos = cast(coords, &DataType::Timestamp(TimeUnit::Nanosecond, None))?;
    let nanos = cast(&nanos, &DataType::Int64)?;
    let counts = (nanos.as_primitive::<Int64Type>().iter())
        .map(|t| match t {
            None => exec_err!(
                "a coordinate of {} dates holds a missing time",
                calendar.name()
            ),
            Some(t) => time.encode(t).ok_or_else(|| {
                DataFusionError::Execution(format!(
                    "the time {} is no date of the {} calendar (or is finer than a microsecond)",
                    datafusion::arrow::temporal_conversions::timestamp_ns_to_datetime(t)
                        .map_or_else(|| t.to_string(), |d| d.to_string()),
                    calendar.name()
                ))
            }),
        })
        .collect::<Result<Int64Array>>()?;
    let mut attributes = Map::new();
    attributes.insert("units".into(), json!(CALENDAR_UNITS));
    attributes.insert("calendar".into(), json!(calendar.name()));
    Ok((Arc::new(counts), attributes))
}

/// The Zarr v3 data type name and v2 dtype of an Arrow type.
fn zarr_type(t: &DataType) -> Result<(&'static str, &'static str)> {
    Ok(match t {
        DataType::Float32 => ("float32", "<f4"),
        DataType::Float64 => ("float64", "<f8"),
        DataType::Int8 => ("int8", "|i1"),
        DataType::Int16 => ("int16", "<i2"),
        DataType::Int32 => ("int32", "<i4"),
        DataType::Int64 => ("int64", "<i8"),
        DataType::UInt8 => ("uint8", "|u1"),
        DataType::UInt16 => ("uint16", "<u2"),
        DataType::UInt32 => ("uint32", "<u4"),
        DataType::UInt64 => ("uint64", "<u8"),
        t => match complex_part(t) {
            Some(DataType::Float32) => ("complex64", "<c8"),
            Some(DataType::Float64) => ("complex128", "<c16"),
            _ => return exec_err!("cannot write Zarr values of type {t}"),
        },
    })
}

/// The Zarr v3 bytes-to-bytes codec of `codec` (none for [`Codec::None`]),
/// for elements of `width` bytes.
pub(crate) fn v3_compressor(codec: Codec, width: usize) -> Option<Value> {
    match codec {
        Codec::Zstd => {
            Some(json!({"name": "zstd", "configuration": {"level": 3, "checksum": false}}))
        }
        Codec::Gzip => Some(json!({"name": "gzip", "configuration": {"level": 5}})),
        Codec::Blosc => Some(json!({"name": "blosc", "configuration": {
            "cname": "lz4", "clevel": 5, "shuffle": "shuffle", "typesize": width, "blocksize": 0}})),
        Codec::None => None,
    }
}

/// The Zarr v2 `compressor` of `codec` (null for [`Codec::None`]).
pub(crate) fn v2_compressor(codec: Codec) -> Value {
    match codec {
        Codec::Zstd => json!({"id": "zstd", "level": 3}),
        Codec::Gzip => json!({"id": "zlib", "level": 5}),
        Codec::Blosc => {
            json!({"id": "blosc", "cname": "lz4", "clevel": 5, "shuffle": 1, "blocksize": 0})
        }
        Codec::None => Value::Null,
    }
}

/// Metadata of one array as JSON (v2 with its attributes inline).
pub(crate) fn array_metadata(
    t: &DataType,
    shape: &[u64],
    chunks: &[u64],
    dims: &[String],
    mut attributes: Map<String, Value>,
    options: &ZarrWriteOptions,
) -> Result<Value> {
    let (v3_type, v2_type) = zarr_type(t)?;
    let float = matches!(t, DataType::Float32 | DataType::Float64);
    let complex = complex_part(t);
    let fill = match (float, complex) {
        (_, Some(_)) => json!(["NaN", "NaN"]),
        (true, None) => json!("NaN"),
        (false, None) => json!(0),
    };
    let width = match complex {
        Some(part) => 2 * part.primitive_width().unwrap_or(8),
        None => t.primitive_width().unwrap_or(1),
    };
    Ok(match options.zarr_format {
        ZarrVersion::V3 => {
            let mut codecs = vec![json!({"name": "bytes", "configuration": {"endian": "little"}})];
            codecs.extend(v3_compressor(options.codec, width));
            json!({
                "zarr_format": 3,
                "node_type": "array",
                "shape": shape,
                "data_type": v3_type,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
                "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
                "fill_value": fill,
                "codecs": codecs,
                "attributes": attributes,
                "dimension_names": dims,
            })
        }
        ZarrVersion::V2 => {
            let compressor = v2_compressor(options.codec);
            attributes.insert("_ARRAY_DIMENSIONS".into(), json!(dims));
            json!({
                "zarr_format": 2,
                "shape": shape,
                "chunks": chunks,
                "dtype": v2_type,
                "compressor": compressor,
                "fill_value": fill,
                "order": "C",
                "filters": null,
                "dimension_separator": ".",
                "attributes": attributes,
            })
        }
    })
}

/// The variables' chunk shape: the lengths `options.chunks` gives, the
/// others chosen so a chunk holds about `CHUNK_TARGET_BYTES`.
pub fn chunk_shape(grid: &Grid, options: &ZarrWriteOptions) -> Result<Vec<u64>> {
    let names: Vec<&str> = grid.dims.iter().map(|d| d.name.as_str()).collect();
    let width = grid
        .variables
        .iter()
        .map(|v| v.values.data_type().primitive_width().unwrap_or(8) as u64)
        .max()
        .unwrap_or(8);
    chunk_lengths(&names, &grid.shape(), width, options, u64::MAX)
}

/// The chunk shape of variables of `width`-byte elements over dimensions
/// `names` of lengths `shape`: the lengths `options.chunks` gives, the
/// others chosen so a chunk holds about [`CHUNK_TARGET_BYTES`], and at most
/// `max_bytes` (what the writer's memory leaves a chunk) while they can
/// shrink.
pub(crate) fn chunk_lengths(
    names: &[&str],
    shape: &[u64],
    width: u64,
    options: &ZarrWriteOptions,
    max_bytes: u64,
) -> Result<Vec<u64>> {
    let target = CHUNK_TARGET_BYTES.min(max_bytes);
    for (dim, _) in &options.chunks {
        if !names.contains(&dim.as_str()) {
            return exec_err!(
                "Zarr option 'chunks' names '{dim}', which is not a dimension of the result ({})",
                names.join(", ")
            );
        }
    }
    let given = |d: &str| options.chunks.iter().find(|(n, _)| n == d).map(|(_, c)| *c);
    let mut chunks: Vec<u64> = names
        .iter()
        .zip(shape)
        .map(|(d, &n)| given(d).unwrap_or(n).min(n).max(1))
        .collect();
    for d in 0..chunks.len() {
        if given(names[d]).is_some() {
            continue;
        }
        while chunks.iter().product::<u64>().saturating_mul(width) > target && chunks[d] > 1 {
            chunks[d] = chunks[d].div_ceil(2);
        }
    }
    Ok(chunks)
}

/// A coordinate array of a group [`write_group`] writes.
pub(crate) struct GroupCoordinate {
    /// The dimension's name.
    pub name: String,
    /// Its values (times become CF numbers).
    pub values: Coordinate,
    /// Attributes besides the CF time ones.
    pub attributes: Map<String, Value>,
    /// The model calendar of its times, when they are dates of one.
    pub calendar: Option<Calendar>,
    /// Whether the values are stored as a coordinate array; without one
    /// the dimension is named by the variables only (a store whose reader
    /// knows the coordinates, such as a staged transform's).
    pub stored: bool,
}

/// A variable of a group [`write_group`] writes (metadata only).
pub(crate) struct GroupVariable {
    /// The variable's name.
    pub name: String,
    /// The Arrow type of its values.
    pub data_type: DataType,
    /// Its shape.
    pub shape: Vec<u64>,
    /// Its chunk shape.
    pub chunks: Vec<u64>,
    /// Its attributes (besides the dimension names).
    pub attributes: Map<String, Value>,
}

/// The metadata (JSON) of `variable` of a group written by
/// [`prepare_group`] over dimensions `dims` with `options`.
fn variable_metadata(
    variable: &GroupVariable,
    dims: &[String],
    options: &ZarrWriteOptions,
) -> Result<Value> {
    array_metadata(
        &variable.data_type,
        &variable.shape,
        &variable.chunks,
        dims,
        variable.attributes.clone(),
        options,
    )
}

/// `variable` of a group [`prepare_group`] writes (or wrote) in `storage`
/// over dimensions `dims` with `options`, opened for writing chunks
/// without reading or writing anything: what a cluster's worker writes a
/// group's variables through while the session writes the metadata.
pub(crate) fn variable_array(
    storage: &ReadableWritableListableStorage,
    variable: &GroupVariable,
    dims: &[String],
    options: &ZarrWriteOptions,
) -> Result<ZarrsArray<dyn ReadableWritableListableStorageTraits>> {
    let fail = |e: String| {
        DataFusionError::Execution(format!("COPY TO Zarr: array '{}': {e}", variable.name))
    };
    let metadata = variable_metadata(variable, dims, options)?;
    let metadata: ArrayMetadata = match options.zarr_format {
        ZarrVersion::V2 => serde_json::from_value(metadata).map(ArrayMetadata::V2),
        ZarrVersion::V3 => serde_json::from_value(metadata).map(ArrayMetadata::V3),
    }
    .map_err(|e| fail(e.to_string()))?;
    ZarrsArray::new_with_metadata(
        Arc::clone(storage),
        &format!("/{}", variable.name),
        metadata,
    )
    .map_err(|e| fail(e.to_string()))
}

/// Positions per chunk of a written coordinate array: 1 MiB of `f64`, so
/// the usual coordinate (up to 131,072 values) is one read, and writing one
/// stays small beside any `allowed_mem`.
const COORDINATE_CHUNK: u64 = 1 << 17;

/// The most memory writing a group's coordinates of `lengths` positions
/// holds at once: a chunk of values (8 bytes each at most) as computed, as
/// stored and encoded, and the compressor's state (64 KiB at least). The
/// writers that call [`prepare_group`] count it in their projected memory
/// (it is written before their tasks run).
pub(crate) fn coordinate_write_memory(lengths: &[u64]) -> u64 {
    let longest = (lengths.iter().copied().max().unwrap_or(1)).clamp(1, COORDINATE_CHUNK);
    (4 * 8 * longest).max(64 << 10)
}

/// What writing the coordinates of a copy of `store` into a grid of
/// `shape` holds, before its steps run.
pub(crate) fn coordinate_projection(store: &str, shape: &[u64]) -> Projection {
    let memory = usize::try_from(coordinate_write_memory(shape)).unwrap_or(usize::MAX);
    Projection::new("COPY TO Zarr", store, 1, "writer", memory)
        .holding("a chunk of the coordinates' values, stored and encoded")
}

/// A group whose arrays' data are being written: its coordinates' values
/// are stored, its variables' chunks are the caller's to store, and its
/// metadata (arrays, group, consolidated) is stored by
/// [`Self::store_metadata`]: first for a local store written beside its
/// target, last for an object store (readers see no store until it is
/// complete).
pub(crate) struct GroupWrite {
    /// The variables' arrays, for their chunks to be stored.
    pub variables: Vec<ZarrsArray<dyn ReadableWritableListableStorageTraits>>,
    coordinates: Vec<ZarrsArray<dyn ReadableWritableListableStorageTraits>>,
    /// The group's documents: key and JSON.
    group: Vec<(String, Value)>,
    storage: ReadableWritableListableStorage,
}

impl GroupWrite {
    /// Stores every array's metadata, then the group's.
    pub fn store_metadata(&self) -> Result<()> {
        let fail = |e: String| DataFusionError::Execution(format!("COPY TO Zarr: {e}"));
        for array in self.coordinates.iter().chain(&self.variables) {
            array
                .store_metadata()
                .map_err(|e| fail(format!("array '{}': {e}", array.path())))?;
        }
        for (key, value) in &self.group {
            let key = StoreKey::new(key).map_err(|e| fail(e.to_string()))?;
            let text = serde_json::to_vec_pretty(value).map_err(|e| fail(e.to_string()))?;
            self.storage
                .set(&key, text.into())
                .map_err(|e| fail(e.to_string()))?;
        }
        Ok(())
    }
}

/// Writes a group into `storage` (see [`prepare_group`]), its metadata
/// first. Returns the variables' arrays, for their chunks to be stored.
pub(crate) fn write_group(
    storage: &ReadableWritableListableStorage,
    coordinates: &[GroupCoordinate],
    variables: &[GroupVariable],
    options: &ZarrWriteOptions,
) -> Result<Vec<ZarrsArray<dyn ReadableWritableListableStorageTraits>>> {
    let group = prepare_group(storage, coordinates, variables, options)?;
    group.store_metadata()?;
    Ok(group.variables)
}

/// Starts writing a group into `storage`: each coordinate's values (in
/// chunks of [`COORDINATE_CHUNK`] positions, a computed one made chunk by
/// chunk), each variable's array over all the coordinates' dimensions, and
/// the group with its consolidated metadata, in the format and codec of
/// `options`; no metadata is stored yet.
pub(crate) fn prepare_group(
    storage: &ReadableWritableListableStorage,
    coordinates: &[GroupCoordinate],
    variables: &[GroupVariable],
    options: &ZarrWriteOptions,
) -> Result<GroupWrite> {
    let v2 = options.zarr_format == ZarrVersion::V2;
    let fail = |e: String| DataFusionError::Execution(format!("COPY TO Zarr: {e}"));
    let mut consolidated = Map::new();
    let dims: Vec<String> = coordinates.iter().map(|c| c.name.clone()).collect();
    let store_array = |name: &str, metadata: Value, consolidated: &mut Map<String, Value>| {
        consolidate(consolidated, name, metadata.clone(), v2);
        let metadata: ArrayMetadata = if v2 {
            serde_json::from_value(metadata).map(ArrayMetadata::V2)
        } else {
            serde_json::from_value(metadata).map(ArrayMetadata::V3)
        }
        .map_err(|e| fail(format!("array '{name}': {e}")))?;
        ZarrsArray::new_with_metadata(Arc::clone(storage), &format!("/{name}"), metadata)
            .map_err(|e| fail(format!("array '{name}': {e}")))
    };
    let mut coordinate_arrays = Vec::with_capacity(coordinates.len());
    for coordinate_array in coordinates.iter().filter(|c| c.stored) {
        // Values as stored (times become CF numbers), made a chunk at a
        // time from coordinates held as formulas or computed.
        let values = &coordinate_array.values;
        let calendar = coordinate_array.calendar;
        let (empty, mut attributes) = coordinate(&values.slice(0, 0)?, calendar)?;
        attributes.extend(coordinate_array.attributes.clone());
        let len = values.len();
        let data_type = empty.data_type().clone();
        let name = &coordinate_array.name;
        let chunk = len.clamp(1, COORDINATE_CHUNK);
        let metadata = array_metadata(
            &data_type,
            &[len],
            &[chunk],
            std::slice::from_ref(name),
            attributes,
            options,
        )?;
        let array = store_array(name, metadata, &mut consolidated)?;
        for start in (0..len).step_by(chunk as usize) {
            let count = chunk.min(len - start);
            let (values, _) = coordinate(&values.slice(start, count)?, calendar)?;
            let (bytes, _) = value_bytes(&values).map_err(fail)?;
            store_box(
                &array,
                std::slice::from_ref(&(start..start + count)),
                bytes.as_slice(),
            )
            .map_err(|e| fail(format!("coordinate '{name}': {e}")))?;
        }
        coordinate_arrays.push(array);
    }
    let mut arrays = Vec::new();
    for variable in variables {
        let metadata = variable_metadata(variable, &dims, options)?;
        arrays.push(store_array(&variable.name, metadata, &mut consolidated)?);
    }
    let group = if v2 {
        consolidated.insert(".zgroup".into(), json!({"zarr_format": 2}));
        consolidated.insert(".zattrs".into(), json!({}));
        vec![
            (".zgroup".to_string(), json!({"zarr_format": 2})),
            (".zattrs".to_string(), json!({})),
            (
                ".zmetadata".to_string(),
                json!({"zarr_consolidated_format": 1, "metadata": consolidated}),
            ),
        ]
    } else {
        vec![(
            "zarr.json".to_string(),
            json!({
                "zarr_format": 3,
                "node_type": "group",
                "attributes": {},
                "consolidated_metadata": {
                    "kind": "inline",
                    "must_understand": false,
                    "metadata": consolidated,
                },
            }),
        )]
    };
    Ok(GroupWrite {
        variables: arrays,
        coordinates: coordinate_arrays,
        group,
        storage: Arc::clone(storage),
    })
}

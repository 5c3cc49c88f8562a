//! Reading uncompressed chunks of local stores straight from their files.
//!
//! An array whose only codec is a little-endian `bytes` codec (v3), or that
//! has no compressor, no filters and C order (v2), stores each chunk as the
//! bytes of its values in C order. When such an array lives in a local
//! directory, any box of it is a set of contiguous byte runs of chunk files:
//! they are read with positional file reads straight into their place in a
//! buffer from the query's [`ChunkBufferPool`], with no trip through the
//! codec pipeline, no freshly zeroed memory, and no more bytes than the box
//! holds, so reading a box smaller than a chunk costs no more than its
//! share. Float values are checked for NaN piece by piece while they are
//! still in cache.
//!
//! A box whose runs would be tiny (one cutting across the innermost
//! dimension of many rows) and a missing chunk file (which reads as the fill
//! value) go through zarrs.

use std::fs::File;
use std::io::ErrorKind;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use datafusion::arrow::buffer::Buffer;
use zarrs::array::codec::BytesCodec;
use zarrs::array::{Array, ArraySubset, CodecMetadataOptions, CodecTraits};
use zarrs::plugin::ZarrVersion;
use zarrs::storage::ReadableListableStorageTraits;

use super::buffer_pool::ChunkBufferPool;
use super::decode::{any_nan, StoredType};

/// Bytes read (and scanned for NaN) at a time: small enough to stay in cache.
const PIECE_BYTES: usize = 1 << 20;

/// Runs shorter than this go through zarrs, unless a chunk has only a few.
const MIN_RUN_BYTES: usize = 16 << 10;

/// A chunk may be read in this many runs whatever their length.
const FEW_RUNS: u64 = 64;

/// Where an array's uncompressed chunks live and how to check their values.
#[derive(Debug)]
pub(super) struct RawChunks {
    root: PathBuf,
    element_size: usize,
    nan_scan: Option<StoredType>,
}

/// A box read from chunk files: its bytes and whether a NaN was seen (when
/// the array's values were scanned).
pub(super) struct RawBox {
    pub buffer: Buffer,
    pub has_nan: Option<bool>,
}

/// A chunk file that cannot be what the metadata says.
pub(super) struct RawChunkError {
    pub chunk: Vec<u64>,
    pub key: String,
    pub message: String,
}

impl RawChunks {
    /// The raw layout of `array`, if its chunks are plain little-endian
    /// bytes in a local directory `root`. `nan_scan` is the float type whose
    /// NaNs the decoder turns into NULLs (see `ColumnDecoder::nan_scan`).
    pub fn detect(
        array: &Array<dyn ReadableListableStorageTraits>,
        root: Option<&Path>,
        nan_scan: Option<StoredType>,
    ) -> Option<Self> {
        let root = root?;
        let element_size = array.data_type().fixed_size()?;
        let codecs = array.codecs();
        let plain = cfg!(target_endian = "little")
            && codecs.array_to_array_codecs().is_empty()
            && codecs.bytes_to_bytes_codecs().is_empty();
        let codec = codecs.array_to_bytes_codec();
        let bytes = codec.as_any().downcast_ref::<BytesCodec>()?;
        let configuration = bytes.configuration(ZarrVersion::V3, &CodecMetadataOptions::default());
        let big_endian = configuration
            .as_ref()
            .and_then(|c| c.get("endian"))
            .is_some_and(|e| e == "big");
        (plain && !big_endian).then(|| Self {
            root: root.to_path_buf(),
            element_size,
            nan_scan,
        })
    }

    /// Reads the box `ranges` from chunk files, or `Ok(None)` when its runs
    /// would be tiny or a chunk it needs is not stored (zarrs then reads it,
    /// with the fill value).
    pub fn read(
        &self,
        array: &Array<dyn ReadableListableStorageTraits>,
        ranges: &[Range<u64>],
        pool: &ChunkBufferPool,
    ) -> Result<Option<RawBox>, RawChunkError> {
        let Some(chunks) = array
            .chunks_in_array_subset(&ArraySubset::new_with_ranges(ranges))
            .ok()
            .flatten()
        else {
            return Ok(None);
        };
        let box_shape: Vec<u64> = ranges.iter().map(|r| r.end - r.start).collect();
        let cells: u64 = box_shape.iter().product();
        let mut bytes = pool.take(cells as usize * self.element_size);
        let out = bytes.as_mut_bytes();
        let mut nan = NanScan::new(self.nan_scan);
        for indices in &chunks.indices() {
            let Ok(chunk) = array.chunk_subset(&indices) else {
                return Ok(None);
            };
            let runs = Runs::new(ranges, &chunk);
            if runs.run_cells as usize * self.element_size < MIN_RUN_BYTES
                && runs.count() > FEW_RUNS
            {
                return Ok(None);
            }
            let key = array.chunk_key(&indices);
            let fail = |message: String| RawChunkError {
                chunk: indices.to_vec(),
                key: key.to_string(),
                message,
            };
            let file = match File::open(self.root.join(key.as_str())) {
                Ok(file) => file,
                Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(fail(format!("cannot open: {e}"))),
            };
            let stored = file
                .metadata()
                .map_err(|e| fail(format!("cannot stat: {e}")))?
                .len();
            let chunk_bytes = chunk.num_elements() * self.element_size as u64;
            if stored != chunk_bytes {
                return Err(fail(format!(
                    "the chunk file holds {stored} bytes but an uncompressed chunk of shape \
                     {:?} holds {chunk_bytes}: it is truncated or corrupt",
                    chunk.shape()
                )));
            }
            let run_bytes = runs.run_cells as usize * self.element_size;
            for (in_chunk, in_box) in runs.offsets() {
                let start = in_box as usize * self.element_size;
                let mut at = in_chunk * self.element_size as u64;
                for piece in out[start..start + run_bytes].chunks_mut(PIECE_BYTES) {
                    file.read_exact_at(piece, at)
                        .map_err(|e| fail(format!("cannot read: {e}")))?;
                    nan.scan(piece);
                    at += piece.len() as u64;
                }
            }
        }
        Ok(Some(RawBox {
            buffer: bytes.into_buffer(),
            has_nan: nan.found(),
        }))
    }
}

/// What a scan for NaN has found so far.
struct NanScan {
    kind: Option<StoredType>,
    found: bool,
    complete: bool,
}

impl NanScan {
    fn new(kind: Option<StoredType>) -> Self {
        Self {
            kind,
            found: false,
            complete: kind.is_some(),
        }
    }

    /// Scans a piece of stored values (one not aligned for the type leaves
    /// the scan incomplete: the decoder scans again).
    fn scan(&mut self, piece: &[u8]) {
        let found = match self.kind {
            Some(StoredType::Float32) => bytemuck::try_cast_slice::<u8, f32>(piece)
                .ok()
                .map(|v| any_nan(v, f32::is_nan)),
            Some(StoredType::Float64) => bytemuck::try_cast_slice::<u8, f64>(piece)
                .ok()
                .map(|v| any_nan(v, f64::is_nan)),
            _ => None,
        };
        match found {
            Some(found) => self.found |= found,
            None => self.complete = false,
        }
    }

    /// Whether a NaN was seen, if every piece was scanned.
    fn found(&self) -> Option<bool> {
        self.complete.then_some(self.found)
    }
}

/// The contiguous runs shared by a chunk file and a box: the part of the
/// box inside the chunk, cut where either layout (both C order) stops being
/// contiguous.
struct Runs {
    /// The part of the box in the chunk, per dimension.
    part: Vec<Range<u64>>,
    /// Dimensions `..outer` are stepped through; the rest form one run.
    outer: usize,
    /// Cells in one run.
    run_cells: u64,
    chunk_start: Vec<u64>,
    chunk_strides: Vec<u64>,
    box_start: Vec<u64>,
    box_strides: Vec<u64>,
}

impl Runs {
    fn new(ranges: &[Range<u64>], chunk: &ArraySubset) -> Self {
        let rank = ranges.len();
        let chunk_start = chunk.start().to_vec();
        let part: Vec<Range<u64>> = (0..rank)
            .map(|d| {
                let end = chunk_start[d] + chunk.shape()[d];
                ranges[d].start.max(chunk_start[d])..ranges[d].end.min(end)
            })
            .collect();
        // Trailing dimensions the part covers whole in both the chunk and
        // the box, then one more: together one contiguous run.
        let mut outer = rank;
        while outer > 0 {
            let d = outer - 1;
            let whole = part[d].end - part[d].start;
            if whole != chunk.shape()[d] || whole != ranges[d].end - ranges[d].start {
                break;
            }
            outer -= 1;
        }
        let outer = outer.saturating_sub(1);
        let run_cells = part[outer..].iter().map(|r| r.end - r.start).product();
        Self {
            outer,
            run_cells,
            chunk_strides: strides(chunk.shape()),
            box_strides: strides(&ranges.iter().map(|r| r.end - r.start).collect::<Vec<_>>()),
            box_start: ranges.iter().map(|r| r.start).collect(),
            chunk_start,
            part,
        }
    }

    /// Number of runs.
    fn count(&self) -> u64 {
        self.part[..self.outer]
            .iter()
            .map(|r| r.end - r.start)
            .product()
    }

    /// Each run's first cell: its offset in the chunk and in the box.
    fn offsets(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        (0..self.count()).map(move |n| {
            let mut rest = n;
            let (mut in_chunk, mut in_box) = (0, 0);
            for d in (0..self.part.len()).rev() {
                let position = if d < self.outer {
                    let len = self.part[d].end - self.part[d].start;
                    let p = self.part[d].start + rest % len;
                    rest /= len;
                    p
                } else {
                    self.part[d].start
                };
                in_chunk += (position - self.chunk_start[d]) * self.chunk_strides[d];
                in_box += (position - self.box_start[d]) * self.box_strides[d];
            }
            (in_chunk, in_box)
        })
    }
}

/// C-order strides of `shape`, in cells.
fn strides(shape: &[u64]) -> Vec<u64> {
    let mut strides = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    strides
}

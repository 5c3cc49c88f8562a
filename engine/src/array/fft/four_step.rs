//! The four-step (Bailey) FFT of lines larger than memory.
//!
//! A line of length `L = N1 × N2` is seen as a matrix: input position
//! `j = j1 + N1·j2`, output position `f = f2 + N2·f1`. Then
//!
//! ```text
//! F[f2 + N2·f1] = Σ_j1 ω_N1^(j1·f1) · ω_L^(j1·f2) · Σ_j2 z[j1 + N1·j2] · ω_N2^(j2·f2)
//! ```
//!
//! and the transform runs in two passes over blocks that fit the memory
//! limit, with two intermediate Zarr arrays in `work_dir`:
//!
//! 1. **across chunks**: a block of `c1` columns (`j1`) is read from the
//!    source at stride `N1` (every position the column block meets, with
//!    xrft's flips, shifts, windows and phases applied on the way in; the
//!    rows that fall in one chunk of the source are read together, so a
//!    block decodes each chunk it meets once); each
//!    column is transformed (length `N2`) and multiplied by the twiddle
//!    factors `ω_L^(j1·f2)`; the block goes to `columns` (`[.., N2, N1]`,
//!    rows `f2` of `j1`, chunks of `r × c1`);
//! 2. **within chunks**: a block of `r` rows (`f2`) of `columns` is read,
//!    each row transformed in place (length `N1`), and written to
//!    `spectrum` (`[.., N2, N1]`, rows `f2` of `f1`, chunks of `r × q`);
//!    the chunks of `columns` a block read are erased once it is written,
//!    so `work_dir` holds about one copy of the data at any time;
//! 3. the operator then reads any range of output positions from
//!    `spectrum`: positions `f2 + N2·f1` for `f1` in a range are the
//!    columns of that range, read whole chunks at a time and transposed in
//!    memory (taking xrft's output shift and factors on the way out), so
//!    the output comes in natural order.
//!
//! Both arrays are laid out so that every read and write of a pass is a
//! set of whole chunks or of contiguous runs of `c1` or `q` values.
//!
//! From an object store, the first pass reads the source's chunks ahead in
//! the order its blocks read them, and the second pass its blocks of
//! `columns` (when `work_dir` is one), many reads in flight, in memory set
//! aside for it when planning; the operator reading the output reads the
//! spectrum's chunks of its blocks ahead the same way, once the passes
//! have written it.
//!
//! Other dimensions ride along in batches of the source's chunks (smaller
//! when memory asks). Each pass runs its blocks on as many workers as the
//! memory limit allows; the passes run once, on the first read, and the
//! intermediates go when the plan is dropped. On a cluster each pass is a
//! stage whose tasks run runs of its blocks on the workers
//! ([`FourStep::run_pass`], in a store the worker opens with
//! [`FourStep::open`]; see [`super::passes`]), and the session's operator
//! reads the output once both are done
//! ([`FourStep::ensure_done_by`]). Real-input transforms run as
//! complex ones; real-output ones (`irfft`) extend their input to its
//! Hermitian whole and keep the real part.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use datafusion::common::human_readable_size;
use rayon::prelude::*;
use rustfft::num_complex::Complex;
use rustfft::{Fft, FftDirection, FftPlanner};
use serde::{Deserialize, Serialize};
use zarrs::array::{Array, ArrayBuilder, ArraySubset};
use zarrs::storage::ReadableListableStorageTraits;

use super::axis::AxisTransform;
use super::kernels::{Kernels, Precision, ScratchArray, TimedKernel};
use super::source::ArraySource;
use crate::array::tasks::run_tasks;
use crate::device::fft_cpu::BlockValues;
use crate::device::{AxisPass, FftKernel, LineKind};
use crate::table::{BlockGrid, ReadAheadPlan};
use crate::write::scratch::ScratchStore;
use crate::zarr::{chunk_keys, ChunkBufferPool, ReadAhead, StoreLocation, ZarrArray};

/// The shape of a four-step transform (see the module docs); it travels
/// to a cluster's workers with the passes' tasks
/// ([`super::passes::PassBlocks`]), checked there by
/// [`received`](Self::received).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FourStepPlan {
    /// The transformed axis of the source.
    pub axis: usize,
    /// The transform's length `L`.
    pub len: usize,
    /// `N1`: the length of the second pass's transforms (within chunks).
    pub columns: usize,
    /// `N2`: the length of the first pass's transforms (across chunks).
    pub rows: usize,
    /// `c1`: columns per block of the first pass.
    pub column_block: usize,
    /// `r`: rows per block of the second pass.
    pub row_block: usize,
    /// `q`: rows of the spectrum (each `N2` outputs) per output chunk.
    pub spectrum_rows: usize,
    /// Extents of the other dimensions per batch (1 along the axis).
    pub batch: Vec<u64>,
    /// Workers of the first and second passes.
    pub workers: [usize; 2],
    /// Memory of one block of the first and second passes.
    pub task_memory: [usize; 2],
}

/// Why no four-step plan fits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoSplit {
    /// A line that cannot be split (its length has no factors).
    Unsplittable(String),
    /// Even the most even split's blocks of single lines do not fit: the
    /// split (columns × rows) and a block's bytes in the first and second
    /// passes.
    Least {
        /// `[N1, N2]`.
        split: [usize; 2],
        /// A block of the first pass, and of the second.
        blocks: [usize; 2],
    },
}

/// Bytes of one complex value in precision `single` or not.
fn complex_size(single: bool) -> usize {
    if single {
        8
    } else {
        16
    }
}

/// The divisors of `n`, increasing.
pub(crate) fn divisors(n: usize) -> Vec<usize> {
    let mut low = Vec::new();
    let mut high = Vec::new();
    let mut d = 1;
    while d * d <= n {
        if n.is_multiple_of(d) {
            low.push(d);
            if d * d != n {
                high.push(n / d);
            }
        }
        d += 1;
    }
    low.extend(high.into_iter().rev());
    low
}

/// The largest divisor of `n` for which `fits` holds (divisors only grow
/// the memory `fits` checks).
fn largest_divisor(n: usize, fits: impl Fn(usize) -> bool) -> Option<usize> {
    divisors(n).into_iter().rev().find(|&d| fits(d))
}

/// Memory of one block of each pass over `lines` lines a batch, a line
/// of `n1 × n2` split into blocks of `c1` columns (the first pass: their
/// values three times over, beside one decoded chunk of the source along
/// the axis) and of `r` rows (the second); saturating.
fn pass_memory(
    input: &FourStepInput,
    axis: usize,
    lines: usize,
    [n1, n2]: [usize; 2],
    [c1, r]: [usize; 2],
) -> [usize; 2] {
    let cb = complex_size(input.single);
    let chunk = input.chunk[axis].min(input.shape[axis]) as usize;
    let read = chunk
        .saturating_mul(lines)
        .saturating_mul(input.peak_bytes_per_cell.saturating_add(cb));
    let values = |n: usize, block: usize| {
        [3, lines, block, n, cb]
            .into_iter()
            .fold(1usize, usize::saturating_mul)
    };
    [values(n2, c1).saturating_add(read), values(n1, r)]
}

/// What planning a four-step transform needs to know of the source.
#[derive(Debug, Clone)]
pub struct FourStepInput {
    /// The source's shape.
    pub shape: Vec<u64>,
    /// The source's chunk shape.
    pub chunk: Vec<u64>,
    /// Bytes a source cell holds at the peak of a read.
    pub peak_bytes_per_cell: usize,
    /// Whether the transform computes in single precision.
    pub single: bool,
}

impl FourStepPlan {
    /// Plans the transform `axis_transform` along `axis` of `input` so
    /// that the passes' blocks, on their workers, fit `limit` bytes beside
    /// `reserved` (the operator reading the output); `threads` caps the
    /// workers. Errors say what does not fit, with the numbers.
    pub fn new(
        axis: usize,
        axis_transform: &AxisTransform,
        input: &FourStepInput,
        limit: usize,
        reserved: usize,
        threads: usize,
    ) -> Result<Self, NoSplit> {
        let len = axis_transform.len;
        let cb = complex_size(input.single);
        let room = limit.saturating_sub(reserved);
        let memory = |lines: u64, split: [usize; 2], blocks: [usize; 2]| {
            pass_memory(input, axis, lines as usize, split, blocks)
        };
        let factors: Vec<usize> = divisors(len)
            .into_iter()
            .filter(|&d| d > 1 && d < len)
            .collect();
        if factors.is_empty() {
            return Err(NoSplit::Unsplittable(format!(
                "the four-step path splits a line of length {len} into rows and columns, and \
                 {len} has no factors; pad or trim the dimension to a length with small factors"
            )));
        }
        // Other dimensions: the source's chunks, halved until a batch fits.
        let mut batch = input.chunk.clone();
        batch[axis] = 1;
        for (d, b) in batch.iter_mut().enumerate() {
            *b = (*b).min(input.shape[d]).max(1);
        }
        loop {
            let lines = batch.iter().product::<u64>();
            let second = |n1: usize, r: usize| memory(lines, [n1, 1], [0, r])[1];
            let first = |n2: usize, c1: usize| memory(lines, [1, n2], [c1, 0])[0];
            // The longest rows that fit, so columns are short and their
            // blocks wide (fewer, larger reads of the source).
            let columns = largest_divisor(len, |n1| {
                n1 < len && second(n1, 1) <= room && first(len / n1, 1) <= room
            })
            .filter(|&n1| n1 > 1);
            if let Some(n1) = columns {
                let n2 = len / n1;
                let c1 = largest_divisor(n1, |c| first(n2, c) <= room).unwrap_or(1);
                let r = largest_divisor(n2, |r| second(n1, r) <= room).unwrap_or(1);
                // Output chunks near 8 MiB of spectrum rows, and small
                // enough that the operator reading them (which holds a
                // block about three times over) fits what is reserved.
                let chunk_bytes = (8usize << 20).min(reserved / 4);
                let q = largest_divisor(n1, |q| q * n2 * lines as usize * cb <= chunk_bytes)
                    .unwrap_or(1);
                let task_memory = [first(n2, c1), second(n1, r)];
                let workers = task_memory.map(|m| (room / m.max(1)).clamp(1, threads.max(1)));
                return Ok(Self {
                    axis,
                    len,
                    columns: n1,
                    rows: n2,
                    column_block: c1,
                    row_block: r,
                    spectrum_rows: q,
                    batch,
                    workers,
                    task_memory,
                });
            }
            match batch.iter().position(|&b| b > 1) {
                Some(d) => batch[d] = batch[d].div_ceil(2),
                None => {
                    let n1 = factors[factors.len() / 2];
                    let n2 = len / n1;
                    let blocks = [first(n2, 1), second(n1, 1)];
                    return Err(NoSplit::Least {
                        split: [n1, n2],
                        blocks,
                    });
                }
            }
        }
    }

    /// A plan sent by a session, as a cluster's worker checks it before
    /// anything is opened: its split and blocks must divide a line of the
    /// transform's length `len` along `axis` of `input` and its batches fit
    /// the source; the blocks' memory is computed again here (the worker
    /// fits its tasks to its own `allowed_mem` with it), not taken from the
    /// plan.
    pub fn received(
        mut self,
        input: &FourStepInput,
        axis: usize,
        len: usize,
    ) -> Result<Self, String> {
        let rank = input.shape.len();
        let divides = |part: usize, whole: usize| part > 0 && whole.is_multiple_of(part);
        let split = self.columns.checked_mul(self.rows);
        if self.axis != axis || self.len != len || axis >= rank || input.chunk.len() != rank {
            return Err(format!(
                "a four-step plan along dimension {} of length {} for a transform along \
                 dimension {axis} of length {len}",
                self.axis, self.len
            ));
        }
        if split != Some(len) || self.columns < 2 || self.rows < 2 {
            return Err(format!(
                "a four-step plan splits a line of length {len} into {} × {}",
                self.columns, self.rows
            ));
        }
        if !divides(self.column_block, self.columns)
            || !divides(self.row_block, self.rows)
            || !divides(self.spectrum_rows, self.columns)
        {
            return Err(format!(
                "a four-step plan's blocks ({} columns, {} rows, {} spectrum rows) do not divide \
                 its {} × {} split",
                self.column_block, self.row_block, self.spectrum_rows, self.columns, self.rows
            ));
        }
        let batch_fits = self.batch.len() == rank
            && self.batch[axis] == 1
            && (self.batch.iter().zip(&input.shape)).all(|(&b, &n)| b >= 1 && b <= n.max(1));
        if !batch_fits || self.workers.contains(&0) {
            return Err(format!(
                "a four-step plan's batches {:?} (workers {:?}) for a source of shape {:?}",
                self.batch, self.workers, input.shape
            ));
        }
        let lines = self.batch.iter().fold(1u64, |n, &b| n.saturating_mul(b)) as usize;
        self.task_memory = pass_memory(
            input,
            axis,
            lines,
            [self.columns, self.rows],
            [self.column_block, self.row_block],
        );
        Ok(self)
    }

    /// Output positions per chunk of the output.
    pub fn output_chunk(&self) -> u64 {
        (self.spectrum_rows * self.rows) as u64
    }

    /// What the blocks of each pass, on their workers, leave of `room`.
    pub fn left_over(&self, room: usize) -> [usize; 2] {
        [0, 1].map(|pass| {
            room.saturating_sub(self.workers[pass].saturating_mul(self.task_memory[pass]))
        })
    }

    /// Bytes written to `work_dir` (and read back) for `lines` lines.
    pub fn intermediate_bytes(&self, lines: u64, single: bool) -> u64 {
        2 * lines * self.len as u64 * complex_size(single) as u64
    }
}

/// A four-step transform of a source: its plan, its intermediates in
/// `work_dir`, computed once on the first read (see the module docs).
pub struct FourStep {
    /// The plan.
    pub plan: FourStepPlan,
    /// Whether it computes in single precision.
    single: bool,
    scratch: ScratchStore,
    columns: ScratchArray,
    spectrum: ScratchArray,
    /// Reads kept in flight ahead of the first pass when the source is in
    /// an object store, and of the second when `work_dir` is
    /// (`zarrfusion.io_concurrency`), and the memory they may hold (set
    /// aside from the passes' share when planning).
    io_concurrency: usize,
    read_ahead_bytes: [usize; 2],
    done: OnceLock<Result<(), String>>,
    cancelled: AtomicBool,
    /// Opened by a cluster's worker in a store the session made
    /// ([`open`](Self::open)): each block checks the store is still there
    /// before it writes.
    received: bool,
}

impl std::fmt::Debug for FourStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FourStep")
            .field("plan", &self.plan)
            .field("work_dir", self.scratch.location())
            .finish()
    }
}

impl Drop for FourStep {
    fn drop(&mut self) {
        self.cancelled.store(true, Ordering::Relaxed);
    }
}

/// The shape of the intermediates of a source of shape `shape`: the other
/// dimensions, then `[N1, N2]`.
fn intermediate_shape(plan: &FourStepPlan, shape: &[u64]) -> Vec<u64> {
    let mut out: Vec<u64> = shape
        .iter()
        .enumerate()
        .filter(|(d, _)| *d != plan.axis)
        .map(|(_, &s)| s)
        .collect();
    out.extend([plan.rows as u64, plan.columns as u64]);
    out
}

/// The intermediates of `plan` over a source of shape `shape` in
/// `scratch` (not stored): `columns` (chunks of a batch of lines, `r`
/// rows of `c1`) and `spectrum` (`r` rows of `q`).
fn intermediates(
    plan: &FourStepPlan,
    shape: &[u64],
    single: bool,
    scratch: &ScratchStore,
) -> datafusion::common::Result<[ScratchArray; 2]> {
    let full = intermediate_shape(plan, shape);
    let data_type = if single {
        zarrs::array::data_type::complex64()
    } else {
        zarrs::array::data_type::complex128()
    };
    let mut chunk: Vec<u64> = (plan.batch.iter().enumerate())
        .filter(|(d, _)| *d != plan.axis)
        .map(|(_, &b)| b)
        .collect();
    chunk.extend([plan.row_block as u64, plan.column_block as u64]);
    let make = |name: &str, chunk: &[u64]| {
        ArrayBuilder::new(
            full.clone(),
            chunk,
            data_type.clone(),
            zarrs::array::FillValue::new(vec![0u8; complex_size(single)]),
        )
        .build(Arc::clone(scratch.storage()), name)
        .map_err(|e| {
            datafusion::common::DataFusionError::Execution(format!(
                "the four-step transform's '{name}' in '{}': {e}",
                scratch.location()
            ))
        })
    };
    let columns = make("/columns", &chunk)?;
    let n = chunk.len();
    chunk[n - 1] = plan.spectrum_rows as u64;
    Ok([columns, make("/spectrum", &chunk)?])
}

/// The other dimensions of `extent` (`extent` without the axis).
fn others(plan: &FourStepPlan, extent: &[Range<u64>]) -> Vec<Range<u64>> {
    extent
        .iter()
        .enumerate()
        .filter(|(d, _)| *d != plan.axis)
        .map(|(_, r)| r.clone())
        .collect()
}

/// How a block with `axis` among its dimensions lays out: lines are
/// `outer × inner`; value `p` of line `b` is at `(o·len + p)·inner + i`.
#[derive(Debug, Clone, Copy)]
struct LineLayout {
    inner: usize,
    len: usize,
}

impl LineLayout {
    fn of(extent: &[Range<u64>], axis: usize) -> Self {
        Self {
            inner: extent[axis + 1..]
                .iter()
                .map(|r| (r.end - r.start) as usize)
                .product(),
            len: (extent[axis].end - extent[axis].start) as usize,
        }
    }

    fn index(self, line: usize, p: usize) -> usize {
        let (o, i) = (line / self.inner, line % self.inner);
        (o * self.len + p) * self.inner + i
    }
}

/// The runs of `positions(0..n)`: maximal stretches stepping by +1 or -1
/// (with the same `tag`), as `(start index, count)`.
fn runs(n: usize, position: impl Fn(usize) -> (usize, bool)) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    let mut k = 0;
    while k < n {
        let (p0, t0) = position(k);
        let mut count = 1;
        if k + 1 < n {
            let (p1, t1) = position(k + 1);
            let step = p1 as i64 - p0 as i64;
            if t1 == t0 && step.abs() == 1 {
                count = 2;
                while k + count < n {
                    let (p, t) = position(k + count);
                    if t != t0 || p as i64 != p0 as i64 + step * count as i64 {
                        break;
                    }
                    count += 1;
                }
            }
        }
        out.push((k, count));
        k += count;
    }
    out
}

/// The source position of transform input `j` of `transform` (length
/// `len`), and whether its value is conjugated (the Hermitian half of a
/// real-output transform's input).
fn input_position(transform: &AxisTransform, len: usize, j: usize) -> (usize, bool) {
    if j < transform.input_len() {
        (transform.gather(j), false)
    } else {
        (transform.gather(len - j), true)
    }
}

/// A read of the output from the spectrum: output positions `first..first
/// + count` of an extent (indices into it), from `subset` of the spectrum
/// (every row `f2`, the columns `f1` they meet, last).
struct OutputRead {
    first: usize,
    count: usize,
    subset: Vec<Range<u64>>,
}

/// A read of the first pass: source positions `lo..hi` along the axis, and
/// the runs of its column block's rows they hold, as `(j2, first column,
/// count)`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ColumnRead {
    lo: usize,
    hi: usize,
    runs: Vec<(usize, usize, usize)>,
}

impl ColumnRead {
    /// The row (`j2`) of its first run: the read's number within its block
    /// for reading ahead.
    fn first_row(&self) -> usize {
        self.runs.first().map_or(0, |r| r.0)
    }
}

/// The reads of the column block starting at column `a` of `plan`, in
/// order: the rows' runs of source positions (`position` of a transform
/// input), those that fall in one chunk of `chunk` positions of the source
/// read together, so that a block decodes each chunk it meets once rather
/// than once per row.
fn column_reads(
    plan: &FourStepPlan,
    a: usize,
    chunk: usize,
    position: impl Fn(usize) -> (usize, bool),
) -> Vec<ColumnRead> {
    let (n1, n2, c1) = (plan.columns, plan.rows, plan.column_block);
    let chunk = chunk.max(1);
    let mut reads: Vec<ColumnRead> = Vec::new();
    for j2 in 0..n2 {
        let base = a + n1 * j2;
        for (start, count) in runs(c1, |jl| position(base + jl)) {
            let (first, _) = position(base + start);
            let (last, _) = position(base + start + count - 1);
            let (lo, hi) = (first.min(last), first.max(last) + 1);
            if let Some(read) = reads.last_mut() {
                let (l, h) = (read.lo.min(lo), read.hi.max(hi));
                if l / chunk == (h - 1) / chunk {
                    read.lo = l;
                    read.hi = h;
                    read.runs.push((j2, start, count));
                    continue;
                }
            }
            reads.push(ColumnRead {
                lo,
                hi,
                runs: vec![(j2, start, count)],
            });
        }
    }
    reads
}

impl FourStep {
    /// Creates the intermediates (metadata only) of `plan` over a source of
    /// shape `shape` in a fresh store in `work_dir`. The first pass reads
    /// the source's chunks ahead when they are in an object store, and the
    /// second pass its blocks when `work_dir` is one: up to
    /// `io_concurrency` reads in flight holding `read_ahead_bytes` at most
    /// (of the first pass, then of the second).
    pub fn create(
        plan: FourStepPlan,
        shape: &[u64],
        single: bool,
        work_dir: &StoreLocation,
        io_concurrency: usize,
        read_ahead_bytes: [usize; 2],
        runtime: &datafusion::execution::runtime_env::RuntimeEnv,
    ) -> datafusion::common::Result<Self> {
        let scratch = ScratchStore::create(work_dir, "zarrfusion-fft-four-step", ".zarr", runtime)?;
        let reads_ahead = (io_concurrency, read_ahead_bytes);
        let made = Self::in_store(plan, shape, single, scratch, reads_ahead, false)?;
        for array in [&made.columns, &made.spectrum] {
            array.store_metadata().map_err(|e| {
                datafusion::common::DataFusionError::Execution(format!(
                    "work_dir '{}': {e}",
                    made.location()
                ))
            })?;
        }
        Ok(made)
    }

    /// The intermediates of `plan` over a source of shape `shape` that a
    /// session made at `location` ([`create`](Self::create)), as a
    /// cluster's worker opens them to run its tasks of a pass: their
    /// metadata must be what `plan` makes, and they are not erased when
    /// this is dropped.
    pub fn open(
        plan: FourStepPlan,
        shape: &[u64],
        single: bool,
        location: &str,
        io_concurrency: usize,
        read_ahead_bytes: [usize; 2],
        runtime: &datafusion::execution::runtime_env::RuntimeEnv,
    ) -> datafusion::common::Result<Self> {
        let scratch = ScratchStore::open(location, runtime)?;
        let reads_ahead = (io_concurrency, read_ahead_bytes);
        let opened = Self::in_store(plan, shape, single, scratch, reads_ahead, true)?;
        for array in [&opened.columns, &opened.spectrum] {
            let path = array.path().as_str();
            let storage = Arc::clone(opened.scratch.storage());
            let stored = Array::open(storage, path).map_err(|e| {
                datafusion::common::DataFusionError::Execution(format!(
                    "the four-step transform's '{path}' in '{location}': {e}"
                ))
            })?;
            let zeros = vec![0; array.dimensionality()];
            let chunks = |a: &ScratchArray| a.chunk_shape(&zeros).ok();
            let same = stored.shape() == array.shape()
                && stored.data_type() == array.data_type()
                && chunks(&stored) == chunks(array);
            if !same {
                return datafusion::common::exec_err!(
                    "the four-step transform's '{path}' in '{location}' is not the array its \
                     plan makes (shape {:?} in chunks {:?}, not {:?} in {:?})",
                    stored.shape(),
                    chunks(&stored),
                    array.shape(),
                    chunks(array)
                );
            }
        }
        Ok(opened)
    }

    /// The transform `plan` with its intermediates in `scratch` (made or
    /// `received` from a session), reading ahead as `reads_ahead` says
    /// (requests in flight, each pass's bytes).
    fn in_store(
        plan: FourStepPlan,
        shape: &[u64],
        single: bool,
        scratch: ScratchStore,
        (io_concurrency, read_ahead_bytes): (usize, [usize; 2]),
        received: bool,
    ) -> datafusion::common::Result<Self> {
        let [columns, spectrum] = intermediates(&plan, shape, single, &scratch)?;
        Ok(Self {
            plan,
            single,
            scratch,
            columns,
            spectrum,
            io_concurrency,
            read_ahead_bytes,
            done: OnceLock::new(),
            cancelled: AtomicBool::new(false),
            received,
        })
    }

    /// Chunk requests kept in flight when reading ahead, and the bytes
    /// each pass's reading ahead may hold.
    pub fn reads_ahead(&self) -> (usize, [usize; 2]) {
        (self.io_concurrency, self.read_ahead_bytes)
    }

    /// Where the intermediates are.
    pub fn location(&self) -> &StoreLocation {
        self.scratch.location()
    }

    /// Erases the intermediates, once everything that reads the output has
    /// read it (the first stage of a staged transform or the inner
    /// transform of a chain, once stored).
    pub fn release(&self) {
        self.scratch.erase("columns");
        self.scratch.erase("spectrum");
    }

    /// The path as `EXPLAIN` shows it: the split, the blocks, their
    /// memory and the bytes each pass moves.
    pub fn describe(&self, source: &ArraySource) -> String {
        let plan = &self.plan;
        let shape = source.shape();
        let cells: u64 = shape.iter().product();
        let lines = cells / shape[plan.axis].max(1);
        let single = self.single;
        let chunk = source.chunk_shape()[plan.axis].min(shape[plan.axis]).max(1);
        // Each block decodes each chunk it meets once (the rows it reads
        // from one chunk are read together): a chunk is met by the blocks
        // of the columns it holds.
        let reread = chunk
            .min(plan.columns as u64)
            .div_ceil(plan.column_block as u64)
            .max(1);
        let once = cells * source.element_size() as u64;
        let intermediates = plan.intermediate_bytes(lines, single);
        // A detrend reads the source once more, first.
        let (detrend, detrend_reads) = match source {
            ArraySource::Detrended(detrended) => (format!("{}, then ", detrended.describe()), once),
            _ => (String::new(), 0),
        };
        let mut ahead = String::new();
        if let Some((_, read_ahead)) = self.first_pass_read_ahead(source) {
            ahead.push_str(&format!("; the first pass reads the source{read_ahead}"));
        }
        if let Some(read_ahead) = self.second_pass_read_ahead() {
            ahead.push_str(&format!("; the second pass reads columns{read_ahead}"));
        }
        format!(
            "four-step in {} (length {} = {} × {}: {detrend}columns of {} in blocks of {} across chunks, \
             then rows of {} in blocks of {} within chunks; batches of {:?}; {} and {} workers, \
             {} and {} per block; reads {} from the store (one pass: {}), writes and reads {} \
             in work_dir, at most {} there at once{ahead}), then output",
            self.scratch.location(),
            plan.len,
            plan.columns,
            plan.rows,
            plan.rows,
            plan.column_block,
            plan.columns,
            plan.row_block,
            plan.batch,
            plan.workers[0],
            plan.workers[1],
            human_readable_size(plan.task_memory[0]),
            human_readable_size(plan.task_memory[1]),
            human_readable_size((once * reread + detrend_reads) as usize),
            human_readable_size(once as usize),
            human_readable_size(intermediates as usize),
            human_readable_size((intermediates / 2) as usize),
        )
    }

    /// Runs both passes here unless done; every caller waits for them.
    pub fn ensure_done<P: Precision>(
        &self,
        source: &ArraySource,
        transform: &AxisTransform,
        kernels: &Kernels,
    ) -> Result<(), String> {
        self.ensure_done_by(|| {
            for pass in [0, 1] {
                let (tasks, workers) = (0..self.pass_tasks(pass), self.plan.workers[pass]);
                let cancelled = &self.cancelled;
                self.run_pass::<P>(pass, source, transform, kernels, tasks, workers, cancelled)?;
            }
            Ok(())
        })
    }

    /// Runs both passes by `run` unless done (a cluster's session runs
    /// them on the workers); every caller waits for them.
    pub fn ensure_done_by(&self, run: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
        self.done.get_or_init(run).clone()
    }

    /// The blocks (tasks) of pass `pass` (0: across chunks, 1: within).
    pub fn pass_tasks(&self, pass: usize) -> u64 {
        let full = self.columns.shape();
        let batches = self.batches(&full[..full.len() - 2]).num_blocks();
        let plan = &self.plan;
        let blocks = match pass {
            0 => plan.columns / plan.column_block,
            _ => plan.rows / plan.row_block,
        };
        batches.saturating_mul(blocks as u64)
    }

    /// Bytes pass `pass` reads: the source's values (once per column
    /// block meeting a chunk, counted once here), or the columns.
    pub fn pass_bytes(&self, pass: usize, element_size: usize) -> u64 {
        let cells = self.columns.shape().iter().product::<u64>();
        let size = match pass {
            0 => element_size,
            _ => complex_size(self.single),
        };
        cells.saturating_mul(size as u64)
    }

    /// Memory one block of pass `pass` holds, and what its read-ahead may
    /// hold beside its blocks.
    pub fn pass_memory(&self, pass: usize) -> (usize, usize) {
        (self.plan.task_memory[pass], self.read_ahead_bytes[pass])
    }

    /// Runs the blocks `tasks` of pass `pass` (of [`pass_tasks`](Self::pass_tasks)),
    /// `workers` at once, stopping when `cancelled` is set: all of both
    /// passes in the process that planned the transform, or a cluster
    /// task's run of them on a worker (pass 0 must be done everywhere
    /// before any block of pass 1 runs).
    #[allow(clippy::too_many_arguments)]
    pub fn run_pass<P: Precision>(
        &self,
        pass: usize,
        source: &ArraySource,
        transform: &AxisTransform,
        kernels: &Kernels,
        tasks: Range<u64>,
        workers: usize,
        cancelled: &AtomicBool,
    ) -> Result<(), String> {
        match pass {
            0 => self.across_chunks::<P>(source, transform, kernels, tasks, workers, cancelled)?,
            _ => self.within_chunks::<P>(transform, kernels, tasks, workers, cancelled)?,
        }
        if cancelled.load(Ordering::Relaxed) {
            return Err("cancelled".into());
        }
        Ok(())
    }

    /// On a worker, that the session's store is still there before a
    /// block writes into it.
    fn may_write(&self) -> Result<(), String> {
        match self.received {
            true => self.scratch.still_there().map_err(|e| e.to_string()),
            false => Ok(()),
        }
    }

    /// The batches of lines: blocks of the other dimensions, whose shape
    /// is `other_shape`.
    fn batches(&self, other_shape: &[u64]) -> BlockGrid {
        let batch: Vec<Range<u64>> = self.plan.batch.iter().map(|&b| 0..b).collect();
        let step: Vec<u64> = others(&self.plan, &batch).iter().map(|r| r.end).collect();
        BlockGrid::covering(other_shape, &step)
    }

    /// The first pass: column blocks read at stride `N1`, transformed along
    /// the columns, twiddled, written to `columns`.
    fn across_chunks<P: Precision>(
        &self,
        source: &ArraySource,
        transform: &AxisTransform,
        kernels: &Kernels,
        tasks: Range<u64>,
        workers: usize,
        cancelled: &AtomicBool,
    ) -> Result<(), String> {
        let plan = &self.plan;
        let (n1, n2, c1) = (plan.columns, plan.rows, plan.column_block);
        let shape = source.shape();
        let whole: Vec<Range<u64>> = shape.iter().map(|&s| 0..s).collect();
        let other_shape: Vec<u64> = others(plan, &whole).iter().map(|r| r.end).collect();
        let batches = self.batches(&other_shape);
        let blocks = (n1 / c1) as u64;
        let direction = complex_kind(transform.kind);
        let rows = RowTransform::<P>::new(kernels, n2, direction);
        let len = plan.len;
        let input = |j: usize| input_position(transform, len, j);
        let factor = |j: usize| {
            let k = if j < transform.input_len() {
                j
            } else {
                len - j
            };
            transform.pre(k)
        };
        let has_pre = transform.has_pre();
        let chunk = shape[plan.axis].min(source.chunk_shape()[plan.axis]) as usize;
        // The source exists (a copy in work_dir is made) before its chunks
        // are read ahead.
        source.prepare(kernels)?;
        let read_ahead = {
            let batches = batches.clone();
            let transform = transform.clone();
            let plan = plan.clone();
            self.read_ahead_first_pass(source, tasks.clone(), workers, move |task| {
                let cells = batches.block(task / blocks);
                let a = (task % blocks) as usize * plan.column_block;
                column_reads(&plan, a, chunk, |j| input_position(&transform, len, j))
                    .into_iter()
                    .map(|read| {
                        let mut extent = cells.clone();
                        extent.insert(plan.axis, read.lo as u64..read.hi as u64);
                        (task * n2 as u64 + read.first_row() as u64, extent)
                    })
                    .collect()
            })
        };
        let first = tasks.start;
        run_tasks(
            tasks.end.saturating_sub(tasks.start),
            workers,
            cancelled,
            ChunkBufferPool::new,
            |pool, task| {
                let task = first + task;
                let cells = batches.block(task / blocks);
                let a = (task % blocks) as usize * c1;
                let lines: usize = cells.iter().map(|r| (r.end - r.start) as usize).product();
                let mut z = vec![Complex::<P>::default(); lines * c1 * n2];
                let reads = column_reads(plan, a, chunk, input);
                for (i, read) in reads.iter().enumerate() {
                    let mut extent = cells.clone();
                    extent.insert(plan.axis, read.lo as u64..read.hi as u64);
                    let values = source.read::<P>(&extent, pool, kernels)?;
                    let layout = LineLayout::of(&extent, plan.axis);
                    for &(j2, start, count) in &read.runs {
                        let base = a + n1 * j2;
                        for jl in start..start + count {
                            let j = base + jl;
                            let (p, conj) = input(j);
                            let f = has_pre.then(|| factor(j));
                            for b in 0..lines {
                                let at = layout.index(b, p - read.lo);
                                let mut v = match &values {
                                    BlockValues::Real(v) => Complex::new(v[at], P::zero()),
                                    BlockValues::Complex(v) => v[at],
                                };
                                if let Some(f) = f {
                                    v = complex_times(v, f);
                                }
                                if conj {
                                    v = v.conj();
                                }
                                z[(b * c1 + jl) * n2 + j2] = v;
                            }
                        }
                    }
                    // Done with the rows up to the next read's first (the
                    // read-ahead's numbers of this block's reads).
                    if let Some(read_ahead) = &read_ahead {
                        let next = reads.get(i + 1).map_or(n2, ColumnRead::first_row);
                        for row in read.first_row()..next {
                            read_ahead.done_with(task * n2 as u64 + row as u64);
                        }
                    }
                }
                let z = rows.apply(z)?;
                // Rows f2 of the block's columns j1, times the twiddles
                // ω_L^(j1·f2) in double precision: a rotation by
                // ω_L^f2 per column, made exact every 64 columns.
                let sign = if direction == LineKind::Forward {
                    -1.0
                } else {
                    1.0
                };
                let twiddle = |turns: usize| {
                    let turn = (turns % len) as f64 / len as f64;
                    Complex::from_polar(1.0, sign * 2.0 * std::f64::consts::PI * turn)
                };
                let mut rows = vec![Complex::<P>::default(); z.len()];
                rows.par_chunks_mut(c1).enumerate().for_each(|(row, out)| {
                    let (b, f2) = (row / n2, row % n2);
                    let step = twiddle(f2);
                    let mut w = Complex::new(1.0, 0.0);
                    for (jl, value) in out.iter_mut().enumerate() {
                        if jl % 64 == 0 {
                            w = twiddle((a + jl) * f2);
                        }
                        *value = complex_times(z[(b * c1 + jl) * n2 + f2], w);
                        w *= step;
                    }
                });
                drop(z);
                let mut subset = cells.clone();
                subset.extend([0..n2 as u64, a as u64..(a + c1) as u64]);
                self.may_write()?;
                P::store_complex(&self.columns, &ArraySubset::new_with_ranges(&subset), &rows)
                    .map_err(|e| format!("writing columns {subset:?} to work_dir: {e}"))?;
                Ok::<u64, String>((rows.len() * std::mem::size_of::<Complex<P>>()) as u64)
            },
        )?;
        Ok(())
    }

    /// The second pass: row blocks of `columns` transformed along the rows
    /// and written to `spectrum` in natural order.
    fn within_chunks<P: Precision>(
        &self,
        transform: &AxisTransform,
        kernels: &Kernels,
        tasks: Range<u64>,
        workers: usize,
        cancelled: &AtomicBool,
    ) -> Result<(), String> {
        let plan = &self.plan;
        let (n1, n2, r) = (plan.columns, plan.rows, plan.row_block);
        let full = self.columns.shape().to_vec();
        let batches = self.batches(&full[..full.len() - 2]);
        let blocks = (n2 / r) as u64;
        let rows = RowTransform::<P>::new(kernels, n1, complex_kind(transform.kind));
        let block = move |task: u64| {
            let mut subset = batches.block(task / blocks);
            let s = (task % blocks) as usize * r;
            subset.extend([s as u64..(s + r) as u64, 0..n1 as u64]);
            subset
        };
        let read_ahead = self.read_ahead_second_pass(tasks.clone(), workers, block.clone())?;
        let first = tasks.start;
        run_tasks(
            tasks.end.saturating_sub(tasks.start),
            workers,
            cancelled,
            || (),
            |_, task| {
                let task = first + task;
                let subset = block(task);
                let region = ArraySubset::new_with_ranges(&subset);
                let read = P::retrieve_complex(&self.columns, &region)
                    .map_err(|e| format!("reading columns {subset:?} from work_dir: {e}"))?;
                // [line][f2][j1]: rows of j1 are contiguous.
                let read = rows.apply(read)?;
                self.may_write()?;
                P::store_complex(&self.spectrum, &region, &read)
                    .map_err(|e| format!("writing spectrum {subset:?} to work_dir: {e}"))?;
                // The region is whole chunks of `columns`, read by this
                // block only: they go now, so work_dir holds about one copy
                // of the data at a time rather than two.
                if let Some(chunks) = self
                    .columns
                    .chunks_in_array_subset(&region)
                    .map_err(|e| e.to_string())?
                {
                    self.columns
                        .erase_chunks(&chunks)
                        .map_err(|e| format!("erasing columns {subset:?} from work_dir: {e}"))?;
                }
                if let Some(read_ahead) = &read_ahead {
                    read_ahead.done_with(task);
                }
                Ok::<u64, String>((read.len() * std::mem::size_of::<Complex<P>>()) as u64)
            },
        )?;
        Ok(())
    }

    /// From an object-store `work_dir`: the chunks of `columns` the second
    /// pass reads, its `tasks` blocks (`block` gives each one's region) in
    /// the order its workers take them, read ahead in the memory set aside
    /// for it (each worker's block's chunks are held, as read, until it is
    /// done, and as many more as fit).
    fn read_ahead_second_pass(
        &self,
        tasks: Range<u64>,
        workers: usize,
        block: impl Fn(u64) -> Vec<Range<u64>> + Send + 'static,
    ) -> Result<Option<ReadAhead>, String> {
        let (Some(remote), Some(read_ahead)) =
            (self.scratch.remote(), self.second_pass_read_ahead())
        else {
            return Ok(None);
        };
        // The keys are found by the window's own copy of the array (an
        // array opens from its metadata alone).
        let columns = Array::new_with_metadata(
            Arc::clone(remote) as Arc<dyn ReadableListableStorageTraits>,
            self.columns.path().as_str(),
            self.columns.metadata().clone(),
        )
        .map_err(|e| e.to_string())?;
        Ok(
            read_ahead.start_keys(Arc::clone(remote), tasks, workers, move |task| {
                chunk_keys(&columns, &block(task))
            }),
        )
    }

    /// How far the second pass reads `columns` ahead when `work_dir` is an
    /// object store: each worker's block's chunks held, as read, until it
    /// is done, and as many more as fit the memory set aside.
    fn second_pass_read_ahead(&self) -> Option<ReadAheadPlan> {
        self.scratch.remote()?;
        let plan = &self.plan;
        // A chunk: a batch of lines (the other dimensions), `r` rows of `c1`.
        let lines = plan.batch.iter().product::<u64>() as usize;
        let chunk_bytes = [plan.row_block, plan.column_block, complex_size(self.single)]
            .into_iter()
            .fold(lines, usize::saturating_mul);
        let block_chunks = plan.columns / plan.column_block;
        let read_ahead = ReadAheadPlan::for_chunks(
            chunk_bytes,
            block_chunks,
            plan.workers[1],
            self.io_concurrency,
        )
        .within(self.read_ahead_bytes[1]);
        (read_ahead.depth() > 0).then_some(read_ahead)
    }

    /// The source array the first pass reads from an object store, and
    /// how far it reads it ahead: its chunks taken one after another, in
    /// the memory set aside for reading ahead. `None` for a source not in
    /// an object store (or computed), or without reading ahead.
    fn first_pass_read_ahead(
        &self,
        source: &ArraySource,
    ) -> Option<(Arc<ZarrArray>, ReadAheadPlan)> {
        let (grid, variable) = source.stored()?;
        let array = &grid.variables[variable];
        array.remote()?;
        let plan = ReadAheadPlan::for_chunks(
            array.chunk_bytes(),
            0,
            self.plan.workers[0],
            self.io_concurrency,
        )
        .within(self.read_ahead_bytes[0]);
        (plan.depth() > 0).then(|| (Arc::clone(array), plan))
    }

    /// Reads the source's chunks ahead of the first pass
    /// ([`first_pass_read_ahead`](Self::first_pass_read_ahead)): its
    /// `tasks` blocks in the order its workers take them, `reads` giving
    /// each block's reads (extents of the source) numbered as the workers
    /// say they are done with them.
    fn read_ahead_first_pass(
        &self,
        source: &ArraySource,
        tasks: Range<u64>,
        workers: usize,
        reads: impl Fn(u64) -> Vec<(u64, Vec<Range<u64>>)> + Send + 'static,
    ) -> Option<ReadAhead> {
        let (array, plan) = self.first_pass_read_ahead(source)?;
        let remote = Arc::clone(array.remote()?);
        plan.start_numbered(remote, tasks, workers, move |task| {
            reads(task)
                .into_iter()
                .flat_map(|(number, extent)| {
                    array
                        .chunk_keys(&extent)
                        .into_iter()
                        .map(move |key| (number, key))
                })
                .collect()
        })
    }

    /// The reads of the spectrum that give the output positions `extent`
    /// (along the axis), in order: a run of them stepping by one position
    /// of the spectrum each.
    fn output_reads(&self, transform: &AxisTransform, extent: &[Range<u64>]) -> Vec<OutputRead> {
        let plan = &self.plan;
        let n2 = plan.rows;
        let cells = others(plan, extent);
        let start = extent[plan.axis].start as usize;
        let count = (extent[plan.axis].end - extent[plan.axis].start) as usize;
        runs(count, |ql| (transform.take(start + ql), false))
            .into_iter()
            .map(|(first, length)| {
                let f_a = transform.take(start + first);
                let f_b = transform.take(start + first + length - 1);
                let (lo, hi) = (f_a.min(f_b), f_a.max(f_b));
                // Positions f2 + N2·f1 for f1 in lo / N2 ..= hi / N2: those
                // columns of every row f2.
                let mut subset = cells.clone();
                subset.extend([0..n2 as u64, (lo / n2) as u64..(hi / n2 + 1) as u64]);
                OutputRead {
                    first,
                    count: length,
                    subset,
                }
            })
            .collect()
    }

    /// How far the operator reading the output reads the spectrum ahead
    /// when `work_dir` is an object store: the chunks of `readers` blocks
    /// of shape `block` (output positions along the axis) and
    /// `io_concurrency` more; nothing otherwise.
    pub fn output_read_ahead(
        &self,
        block: &[u64],
        io_concurrency: usize,
        readers: usize,
    ) -> ReadAheadPlan {
        if self.scratch.remote().is_none() {
            return ReadAheadPlan::for_chunks(0, 0, readers, 0);
        }
        let plan = &self.plan;
        // A chunk of the spectrum: a batch of lines, `r` rows of `q`.
        let lines = plan.batch.iter().product::<u64>() as usize;
        let chunk_bytes = [
            plan.row_block,
            plan.spectrum_rows,
            complex_size(self.single),
        ]
        .into_iter()
        .fold(lines, usize::saturating_mul);
        // A block's: its batches of lines, every row, and the columns its
        // output positions meet (one more at each end when not aligned).
        let batches = block
            .iter()
            .zip(&plan.batch)
            .enumerate()
            .filter(|(d, _)| *d != plan.axis)
            .map(|(_, (&b, &step))| b.div_ceil(step.max(1)) as usize)
            .fold(1usize, usize::saturating_mul);
        let columns = (block[plan.axis] as usize)
            .div_ceil(plan.rows)
            .saturating_add(1)
            .div_ceil(plan.spectrum_rows)
            .saturating_add(1);
        let block_chunks = [plan.rows.div_ceil(plan.row_block), columns]
            .into_iter()
            .fold(batches, usize::saturating_mul);
        ReadAheadPlan::for_chunks(chunk_bytes, block_chunks, readers, io_concurrency)
    }

    /// Reads the spectrum ahead of the operator reading the output
    /// (`read_ahead`, from [`output_read_ahead`](Self::output_read_ahead)),
    /// once the passes have written it: the blocks `ids`, taken in order by
    /// `readers` tasks, `block` giving each one's extent of output
    /// positions. `None` without reading ahead; the tasks say when they are
    /// done with a block.
    pub fn start_output_read_ahead(
        self: &Arc<Self>,
        read_ahead: &ReadAheadPlan,
        transform: &AxisTransform,
        ids: Range<u64>,
        readers: usize,
        block: impl Fn(u64) -> Vec<Range<u64>> + Send + 'static,
    ) -> Option<ReadAhead> {
        let remote = Arc::clone(self.scratch.remote()?);
        let four_step = Arc::clone(self);
        let transform = transform.clone();
        read_ahead.start_keys(remote, ids, readers, move |id| {
            four_step
                .output_reads(&transform, &block(id))
                .iter()
                .flat_map(|read| chunk_keys(&four_step.spectrum, &read.subset))
                .collect()
        })
    }

    /// The output values of `extent` (output positions along the axis),
    /// read from the spectrum with xrft's output order and factors.
    pub fn read_output<P: Precision>(
        &self,
        transform: &AxisTransform,
        extent: &[Range<u64>],
    ) -> Result<BlockValues<P>, String> {
        let plan = &self.plan;
        let n2 = plan.rows;
        let layout = LineLayout::of(extent, plan.axis);
        let cells = others(plan, extent);
        let lines: usize = cells.iter().map(|r| (r.end - r.start) as usize).product();
        let start = extent[plan.axis].start as usize;
        let count = layout.len;
        let mut out = vec![Complex::<P>::default(); lines * count];
        let convert = |c: Complex<f64>| {
            Complex::new(
                P::from_f64(c.re).unwrap_or_else(P::zero),
                P::from_f64(c.im).unwrap_or_else(P::zero),
            )
        };
        let has_post = transform.has_post();
        for read in self.output_reads(transform, extent) {
            let (first, length, subset) = (read.first, read.count, read.subset);
            let f1 = &subset[subset.len() - 1];
            let (f1_lo, width) = (f1.start as usize, (f1.end - f1.start) as usize);
            let spectrum =
                P::retrieve_complex(&self.spectrum, &ArraySubset::new_with_ranges(&subset))
                    .map_err(|e| format!("reading the spectrum {subset:?} from work_dir: {e}"))?;
            let per_line = n2 * width;
            for ql in first..first + length {
                let q = start + ql;
                let f = transform.take(q);
                let at = (f % n2) * width + f / n2 - f1_lo;
                let factor = has_post.then(|| convert(transform.post(q)));
                for b in 0..lines {
                    let v = spectrum[b * per_line + at];
                    out[layout.index(b, ql)] = match factor {
                        Some(w) => v * w,
                        None => v,
                    };
                }
            }
        }
        Ok(if transform.kind == LineKind::RealInverse {
            BlockValues::Real(out.into_iter().map(|c| c.re).collect())
        } else {
            BlockValues::Complex(out)
        })
    }
}

/// The complex transforms (forward or inverse) a line kind runs as.
fn complex_kind(kind: LineKind) -> LineKind {
    match kind {
        LineKind::Forward | LineKind::RealForward => LineKind::Forward,
        LineKind::Inverse | LineKind::RealInverse => LineKind::Inverse,
    }
}

/// `v × w`, `w` in double precision.
fn complex_times<P: Precision>(v: Complex<P>, w: Complex<f64>) -> Complex<P> {
    let re = v.re.to_f64().unwrap_or(f64::NAN);
    let im = v.im.to_f64().unwrap_or(f64::NAN);
    let product = Complex::new(re, im) * w;
    Complex::new(
        P::from_f64(product.re).unwrap_or_else(P::zero),
        P::from_f64(product.im).unwrap_or_else(P::zero),
    )
}

/// The rows (of length `n`) of a pass's blocks transformed: in place with
/// rustfft on the CPU (no copy beside the block, as the plan's memory
/// counts), or by the query's GPU kernel.
enum RowTransform<'a, P: Precision> {
    InPlace(Arc<dyn Fft<P>>, usize, &'a Kernels),
    Device(TimedKernel<'a, P>, usize, LineKind),
}

impl<'a, P: Precision> RowTransform<'a, P> {
    /// Transforms of length `n`, `kind` forward or inverse, on `kernels`' device.
    fn new(kernels: &'a Kernels, n: usize, kind: LineKind) -> Self {
        if kernels.on_gpu() {
            return Self::Device(kernels.timed::<P>(), n, kind);
        }
        let direction = if kind == LineKind::Forward {
            FftDirection::Forward
        } else {
            FftDirection::Inverse
        };
        Self::InPlace(FftPlanner::<P>::new().plan_fft(n, direction), n, kernels)
    }

    /// Every row of `values` transformed.
    fn apply(&self, mut values: Vec<Complex<P>>) -> Result<Vec<Complex<P>>, String> {
        match self {
            Self::InPlace(fft, n, kernels) => {
                let _running = kernels.running();
                let group = n * (1usize << 16).div_ceil(*n).max(1);
                values.par_chunks_mut(group).for_each(|rows| {
                    let mut scratch = vec![Complex::<P>::default(); fft.get_inplace_scratch_len()];
                    fft.process_with_scratch(rows, &mut scratch);
                });
                Ok(values)
            }
            Self::Device(kernel, n, kind) => {
                let rows = values.len() / n.max(&1);
                let pass = AxisPass::plain(1, *kind, *n);
                match kernel.transform(BlockValues::Complex(values), &[rows, *n], &[pass])? {
                    (BlockValues::Complex(out), _) => Ok(out),
                    (BlockValues::Real(_), _) => Err("a complex FFT gave real values".to_string()),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divisors_and_runs() {
        assert_eq!(divisors(12), [1, 2, 3, 4, 6, 12]);
        assert_eq!(divisors(16), [1, 2, 4, 8, 16]);
        assert_eq!(largest_divisor(12, |d| d <= 5), Some(4));
        // 0 1 2 | 9 8 | 4
        let positions = [0, 1, 2, 9, 8, 4];
        assert_eq!(runs(6, |k| (positions[k], false)), [(0, 3), (3, 2), (5, 1)]);
    }

    /// A plan for a line of `len` values in one chunk, of one line of one
    /// other dimension, within `limit` (half reserved).
    fn plan_within(len: usize, limit: usize) -> Result<FourStepPlan, NoSplit> {
        let coords: Vec<f64> = (0..len).map(|i| i as f64).collect();
        let coordinate = crate::table::Coordinate::Values(Arc::new(
            datafusion::arrow::array::Float64Array::from(coords),
        ));
        let options = super::super::options::FftOptions::forward(vec!["x".into()]);
        let axis = AxisTransform::forward("x", &coordinate, false, &options).unwrap();
        let input = FourStepInput {
            shape: vec![len as u64, 3],
            chunk: vec![len as u64, 3],
            peak_bytes_per_cell: 8,
            single: false,
        };
        FourStepPlan::new(0, &axis, &input, limit, limit / 2, 2)
    }

    #[test]
    fn a_split_that_cannot_fit_says_its_least_blocks() {
        // A line of 1024 values fits a few MiB, split into rows and columns.
        let plan = plan_within(1024, 4 << 20).unwrap();
        assert_eq!(plan.columns * plan.rows, 1024);
        // Not in 1 KiB: the most even split's one-line blocks, both larger
        // than what is left beside what is reserved.
        let Err(NoSplit::Least {
            split: [n1, n2],
            blocks,
        }) = plan_within(1024, 1 << 10)
        else {
            panic!("a four-step plan in 1 KiB");
        };
        assert_eq!(n1 * n2, 1024);
        assert!(blocks.iter().any(|&b| b > 512), "{blocks:?}");
        // A prime length has no split.
        let Err(NoSplit::Unsplittable(message)) = plan_within(1021, 4 << 20) else {
            panic!("a split of 1021");
        };
        assert!(message.contains("1021 has no factors"), "{message}");
    }

    fn plan(n1: usize, n2: usize, c1: usize) -> FourStepPlan {
        FourStepPlan {
            axis: 0,
            len: n1 * n2,
            columns: n1,
            rows: n2,
            column_block: c1,
            row_block: 1,
            spectrum_rows: 1,
            batch: vec![1],
            workers: [1, 1],
            task_memory: [0, 0],
        }
    }

    /// Checks that `reads` give every column of the block at `a` of every
    /// row once, inside their read, a read within one chunk unless it is
    /// a single run; returns the chunks each read meets.
    fn check_reads(
        p: &FourStepPlan,
        a: usize,
        chunk: usize,
        position: impl Fn(usize) -> (usize, bool),
        reads: &[ColumnRead],
    ) -> Vec<Range<usize>> {
        let mut seen = vec![0; p.rows * p.column_block];
        for read in reads {
            for &(j2, start, count) in &read.runs {
                for jl in start..start + count {
                    seen[j2 * p.column_block + jl] += 1;
                    let (at, _) = position(a + p.columns * j2 + jl);
                    assert!((read.lo..read.hi).contains(&at), "{at} in {read:?}");
                }
            }
            assert!(read.lo / chunk == (read.hi - 1) / chunk || read.runs.len() == 1);
        }
        assert!(seen.iter().all(|&n| n == 1), "{seen:?}");
        reads
            .iter()
            .map(|r| r.lo / chunk..(r.hi - 1) / chunk + 1)
            .collect()
    }

    #[test]
    fn a_column_block_reads_each_chunk_it_meets_once() {
        // L = 64 = 8 columns × 8 rows, blocks of 2 columns.
        let p = plan(8, 8, 2);
        let identity = |j: usize| (j, false);
        // Chunks of 16 positions hold two rows each: one read per chunk.
        let reads = column_reads(&p, 2, 16, identity);
        let chunks = check_reads(&p, 2, 16, identity, &reads);
        assert_eq!(chunks, [0..1, 1..2, 2..3, 3..4]);
        for (k, read) in reads.iter().enumerate() {
            assert_eq!(read.runs, [(2 * k, 0, 2), (2 * k + 1, 0, 2)]);
            assert_eq!(read.first_row(), 2 * k);
        }
        // Chunks of 4 positions, shorter than a row: a read per row.
        let reads = column_reads(&p, 2, 4, identity);
        assert_eq!(check_reads(&p, 2, 4, identity, &reads).len(), 8);
        // A block straddling chunks of 3 positions: its runs span two.
        let reads = column_reads(&p, 2, 3, identity);
        check_reads(&p, 2, 3, identity, &reads);
        // A Hermitian half read backwards (conjugated): rows 4 (32, then
        // 31 back in chunk 1) and 6 (16, 15: a run across two chunks)
        // start new reads; a shifted start wraps around once.
        let hermitian = |j: usize| if j <= 32 { (j, false) } else { (64 - j, true) };
        let reads = column_reads(&p, 0, 16, hermitian);
        let chunks = check_reads(&p, 0, 16, hermitian, &reads);
        assert_eq!(chunks, [0..1, 1..2, 2..3, 1..2, 0..2, 0..1]);
        let shifted = |j: usize| ((j + 32) % 64, false);
        let reads = column_reads(&p, 6, 16, shifted);
        let chunks = check_reads(&p, 6, 16, shifted, &reads);
        assert_eq!(chunks, [2..3, 3..4, 0..1, 1..2]);
    }

    #[test]
    fn layouts_index_lines_around_the_axis() {
        // Shape [2, 3, 4], axis 1: lines are 2 × 4.
        let layout = LineLayout::of(&[0..2, 0..3, 0..4], 1);
        assert_eq!(layout.index(0, 0), 0);
        assert_eq!(layout.index(5, 2), 12 + 2 * 4 + 1);
    }
}

//! Rolling aggregates along one axis of a box of cells.
//!
//! The cells of one argument are [`Lines`]: a box laid out (outer, t,
//! inner) in C order, `t` the rolled axis, each cell a value and a flag
//! (missing, finite, NaN, +inf, -inf). The values are `f64`, or `f32` for
//! an argument that is a `float32` column (`avg(t2m)`, widened by SQL's
//! coercion): held as read, widened exactly as they are summed, so the
//! results are the same in little more than half the memory. [`roll`] gives, for a run of
//! positions `t`, the aggregate over each lane's frame `t + start ..= t +
//! end`, with SQL's semantics: `NULL` cells are skipped, an empty frame
//! gives `NULL` (`count`: 0), NaN is greater than every number (so it wins
//! `max` and loses `min`, as in DataFusion's total order) and poisons
//! `sum` and `avg`.
//!
//! The work runs across a tile of inner lanes at once (contiguous in
//! memory; 1024 of them, so that their state stays in cache), one
//! position after the other: `count`, `sum` and
//! `avg` keep a running sum and count per lane, adding the cell entering
//! the frame and removing the one leaving it. That state is kept from one
//! run of positions to the next ([`RollState`]), so a box that follows
//! another along the axis does not sum its frames' overlap again (it is
//! summed afresh every [`RESUME_POSITIONS`] positions, which bounds the
//! rounding a long running sum gathers); where the cells entering and
//! leaving a tile's frames are all finite the counts stay as they are and
//! are not touched; `min` and `max` fold the
//! frame in `log2(width)` passes (after pass `j` each cell holds the
//! extremum of the `2^j` cells from it on), so that each frame is the
//! extremum of two overlapping runs. Lanes whose frame holds a non-finite
//! value are computed cell by cell.

use std::ops::Range;
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, Float64Array, Int64Array};
use datafusion::arrow::buffer::{BooleanBuffer, NullBuffer, ScalarBuffer};
use datafusion::arrow::datatypes::{DataType, Float32Type, Float64Type};
use datafusion::common::{internal_err, Result};

use crate::array::reduce::ReduceOp;
use crate::zarr::{ChunkBufferPool, PooledBytes};

/// What a rolling aggregate computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd)]
pub enum RollOp {
    /// Non-NULL cells in the frame (`count(*)`: cells).
    Count,
    /// Their sum.
    Sum,
    /// Their mean.
    Avg,
    /// The smallest.
    Min,
    /// The largest.
    Max,
}

impl RollOp {
    /// The rolling aggregate computing what `op` does, when there is one.
    pub fn of(op: ReduceOp) -> Option<Self> {
        match op {
            ReduceOp::Count => Some(Self::Count),
            ReduceOp::Sum => Some(Self::Sum),
            ReduceOp::Avg => Some(Self::Avg),
            ReduceOp::Min => Some(Self::Min),
            ReduceOp::Max => Some(Self::Max),
            _ => None,
        }
    }

    /// The SQL name (the reduction's, [`ReduceOp::name`]).
    pub fn name(self) -> &'static str {
        let op = match self {
            Self::Count => ReduceOp::Count,
            Self::Sum => ReduceOp::Sum,
            Self::Avg => ReduceOp::Avg,
            Self::Min => ReduceOp::Min,
            Self::Max => ReduceOp::Max,
        };
        op.name()
    }

    /// The aggregate [`RollOp::name`] names.
    pub fn from_name(name: &str) -> Option<Self> {
        ReduceOp::from_name(name).and_then(Self::of)
    }
}

/// A cell without a value (NULL, or outside the selection).
pub(super) const MISSING: u8 = 0;
/// A finite value.
pub(super) const FINITE: u8 = 1;
/// NaN, +inf or -inf: stored as 0 in `values`, its kind in `flags`.
pub(super) const NAN: u8 = 2;
pub(super) const POS_INF: u8 = 3;
pub(super) const NEG_INF: u8 = 4;

/// A value lines hold: `f64`, or an `f32` read from a `float32` column
/// (only such values are put in `f32` lines, so narrowing is exact).
pub(super) trait Cell: Copy + Into<f64> {
    /// The value as held.
    fn narrowed(v: f64) -> Self;

    /// The value as a number.
    fn widened(self) -> f64 {
        self.into()
    }
}

impl Cell for f64 {
    fn narrowed(v: f64) -> Self {
        v
    }
}

impl Cell for f32 {
    fn narrowed(v: f64) -> Self {
        v as f32
    }
}

/// The finite values of lines (0 elsewhere), of either width.
#[derive(Debug, Clone)]
pub(super) enum Values {
    F64(Vec<f64>),
    F32(Vec<f32>),
}

/// Evaluates `$body` with `$v` bound to the values of `$values` (a
/// [`Values`], or a reference to one), whichever their width: the body is
/// compiled once for each.
macro_rules! with_values {
    ($values:expr, $v:ident => $body:expr) => {
        match $values {
            Values::F64($v) => $body,
            Values::F32($v) => $body,
        }
    };
}
pub(super) use with_values;

/// The cells of one argument over a box, laid out (outer, t, inner), the
/// positions `t` taken modulo the number of positions held: a ring along
/// the rolled axis, so that the positions one box leaves to the next stay
/// where they are while the next box's cells are put after them.
#[derive(Debug, Clone)]
pub struct Lines {
    pub(super) outer: usize,
    pub(super) len: usize,
    pub(super) inner: usize,
    /// The finite values (0 elsewhere).
    pub(super) values: Values,
    /// Each cell's kind: [`MISSING`], [`FINITE`], [`NAN`], [`POS_INF`], [`NEG_INF`].
    pub(super) flags: Vec<u8>,
}

impl Lines {
    /// `len` positions of `outer x inner` lanes, every cell missing,
    /// holding `f64` values.
    pub fn new(outer: usize, len: usize, inner: usize) -> Self {
        Self::holding(outer, len, inner, false)
    }

    /// [`Lines::new`], holding `f32` values when `single` (the lines of
    /// a `float32` column: only its values may be put).
    pub fn holding(outer: usize, len: usize, inner: usize, single: bool) -> Self {
        let cells = outer * len * inner;
        Self {
            outer,
            len,
            inner,
            values: match single {
                true => Values::F32(vec![0.0; cells]),
                false => Values::F64(vec![0.0; cells]),
            },
            flags: vec![MISSING; cells],
        }
    }

    /// Bytes per cell of lines holding `f32` values when `single`, else
    /// `f64` (a value and a flag).
    pub fn cell_bytes(single: bool) -> usize {
        if single {
            5
        } else {
            9
        }
    }

    /// Number of positions held along the rolled axis.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no positions are held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether these are lines of `outer x len x inner` cells.
    pub fn has_shape(&self, outer: usize, len: usize, inner: usize) -> bool {
        (self.outer, self.len, self.inner) == (outer, len, inner)
    }

    /// Whether they hold `f32` values.
    pub fn is_single(&self) -> bool {
        matches!(self.values, Values::F32(_))
    }

    /// Puts cells `offset..offset + piece.len()` (in C order) of a box of
    /// `n` positions laid out (outer, n, inner), the box placed at
    /// positions `at..at + n` (modulo the positions held); `piece` is
    /// `float64` or `float32` with NULLs.
    pub fn put(&mut self, at: usize, n: usize, offset: usize, piece: &ArrayRef) -> Result<()> {
        self.put_walked(at, n, offset, piece, false)
    }

    /// [`put`](Self::put), the box's positions in reverse order when
    /// `backward` (its position `t` at `at + n - 1 - t`): a box walked
    /// from its end.
    pub fn put_walked(
        &mut self,
        at: usize,
        n: usize,
        offset: usize,
        piece: &ArrayRef,
        backward: bool,
    ) -> Result<()> {
        self.check_fits(n, offset, piece.len())?;
        match piece.data_type() {
            DataType::Float64 if self.is_single() => {
                return internal_err!("float64 cells put in lines of float32 values")
            }
            DataType::Float64 => {
                let piece = piece.as_primitive::<Float64Type>();
                let cells = (piece.values().as_ref(), piece.nulls());
                self.put_values((at, n, offset), cells, backward);
            }
            DataType::Float32 => {
                let piece = piece.as_primitive::<Float32Type>();
                let cells = (piece.values().as_ref(), piece.nulls());
                self.put_values((at, n, offset), cells, backward);
            }
            other => return internal_err!("lines of {other} cells"),
        }
        Ok(())
    }

    /// [`put_walked`](Self::put_walked) of `float64` cells without NULLs
    /// (a piece of a fused argument).
    pub fn put_numbers(
        &mut self,
        (at, n, offset): (usize, usize, usize),
        values: &[f64],
        backward: bool,
    ) -> Result<()> {
        self.check_fits(n, offset, values.len())?;
        if self.is_single() {
            return internal_err!("numbers put in lines of float32 values");
        }
        self.put_values((at, n, offset), (values, None), backward);
        Ok(())
    }

    /// Refuses `cells` cells from `offset` on of a box of `n` positions
    /// that do not fit these lines.
    fn check_fits(&self, n: usize, offset: usize, cells: usize) -> Result<()> {
        let end = offset + cells;
        if n > self.len || end > self.outer * n * self.inner {
            return internal_err!(
                "cells {offset}..{end} of {n} positions do not fit lines of {} x {} x {}",
                self.outer,
                self.len,
                self.inner
            );
        }
        Ok(())
    }

    /// [`put_walked`](Self::put_walked) of checked numbers (`f32` ones
    /// only, into lines holding `f32`).
    fn put_values<T: Copy + Into<f64>>(
        &mut self,
        (at, n, offset): (usize, usize, usize),
        cells: (&[T], Option<&NullBuffer>),
        backward: bool,
    ) {
        let shape = (self.len, self.inner);
        let flags = &mut self.flags;
        with_values!(&mut self.values, held => {
            put_cells(held, flags, shape, (at, n, offset), cells, backward)
        })
    }

    /// Makes positions `at..at + n` (modulo the positions held) missing in
    /// every lane.
    pub fn clear(&mut self, at: usize, n: usize) {
        for t in at..at + n.min(self.len) {
            let p = t % self.len;
            for o in 0..self.outer {
                let dst = (o * self.len + p) * self.inner;
                with_values!(&mut self.values, v => v[dst..dst + self.inner].fill(Cell::narrowed(0.0)));
                self.flags[dst..dst + self.inner].fill(MISSING);
            }
        }
    }

    /// Where the cell of lane (`o`, `i`) at position `t` is.
    pub(super) fn index(&self, o: usize, t: usize, i: usize) -> usize {
        (o * self.len + t % self.len) * self.inner + i
    }

    /// The cell's value as a number (NaN and infinities included).
    fn value(&self, index: usize) -> Option<f64> {
        match self.flags[index] {
            MISSING => None,
            FINITE => Some(with_values!(&self.values, v => v[index].widened())),
            NAN => Some(f64::NAN),
            POS_INF => Some(f64::INFINITY),
            _ => Some(f64::NEG_INFINITY),
        }
    }
}

/// Puts the cells of [`Lines::put_values`] into `held` and `flags`, of
/// lines of `len` positions of `inner` lanes.
fn put_cells<T: Copy + Into<f64>, D: Cell>(
    held: &mut [D],
    flags: &mut [u8],
    (len, inner): (usize, usize),
    (at, n, offset): (usize, usize, usize),
    (values, nulls): (&[T], Option<&NullBuffer>),
    backward: bool,
) {
    let line = n * inner;
    let end = offset + values.len();
    let nulls = nulls.filter(|n| n.null_count() > 0);
    let mut k = offset;
    while k < end {
        let (o, within) = (k / line, k % line);
        let (t, i) = (within / inner, within % inner);
        // To the end of the line, the piece, or the ring (walked
        // backward: of the position, the next one being before it).
        let (p, run) = if backward {
            let p = (at + n - 1 - t) % len;
            (p, (inner - i).min(end - k))
        } else {
            let p = (at + t) % len;
            let run = (line - within).min(end - k).min((len - p) * inner - i);
            (p, run)
        };
        let dst = (o * len + p) * inner + i;
        let src = k - offset;
        let cells = &mut held[dst..dst + run];
        let flags = &mut flags[dst..dst + run];
        let mut finite = true;
        for ((cell, flag), &v) in cells
            .iter_mut()
            .zip(flags.iter_mut())
            .zip(&values[src..src + run])
        {
            let v: f64 = v.into();
            let f = v.is_finite();
            *cell = D::narrowed(v);
            *flag = if f { FINITE } else { MISSING };
            finite &= f;
        }
        // The rare cells: NaN and infinities, then NULLs.
        if !finite {
            for (flag, cell) in flags.iter_mut().zip(cells.iter_mut()) {
                let v: f64 = (*cell).into();
                if !v.is_finite() {
                    *flag = if v.is_nan() {
                        NAN
                    } else if v > 0.0 {
                        POS_INF
                    } else {
                        NEG_INF
                    };
                    *cell = D::narrowed(0.0);
                }
            }
        }
        if let Some(nulls) = nulls {
            for j in 0..run {
                if nulls.is_null(src + j) {
                    flags[j] = MISSING;
                    cells[j] = D::narrowed(0.0);
                }
            }
        }
        k += run;
    }
}

/// A frame in grid order: position `t` aggregates `t + start ..= t + end`,
/// or, without a `start` (`UNBOUNDED PRECEDING`), every position of the
/// series up to `t + end` (a running total: see [`running`](super::running)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd)]
pub struct Frame {
    /// Offset of the frame's first position (negative: before `t`);
    /// `None`: the series' first position.
    pub start: Option<i64>,
    /// Offset of its last position (`>= start`).
    pub end: i64,
}

impl Frame {
    /// Positions needed before the first output position (the cells a
    /// running total adds last, when its frame ends before `t`).
    pub fn before(&self) -> u64 {
        self.start.unwrap_or(self.end).min(0).unsigned_abs()
    }

    /// Positions needed after the last output position.
    pub fn after(&self) -> u64 {
        self.end.max(0) as u64
    }

    /// Whether the frame starts at the series' first position.
    pub fn is_running(&self) -> bool {
        self.start.is_none()
    }
}

/// A frame of rows around each position: `t + start ..= t + end`.
#[derive(Debug, Clone, Copy)]
struct Rows {
    start: i64,
    end: i64,
}

impl Rows {
    fn width(&self) -> usize {
        (self.end - self.start + 1) as usize
    }
}

/// Lanes computed together: their running state and frames stay in cache.
pub const TILE: usize = 1024;

/// Positions a running state is carried over before its frames are summed
/// afresh.
pub const RESUME_POSITIONS: usize = 4096;

/// The running state of one aggregate over every lane of some lines, for
/// the frame of one position: what the next run of positions resumes
/// from, instead of summing its first frame.
#[derive(Debug, Clone)]
pub struct RollState {
    /// The position whose frame the state is; `None`: no state.
    at: Option<usize>,
    /// Positions carried over since the frames were last summed afresh.
    age: usize,
    count: Vec<u32>,
    odd: Vec<u32>,
    sum: Vec<f64>,
    /// The buffers of the aggregate's columns, reused block after block.
    outputs: ChunkBufferPool,
}

impl RollState {
    /// No state, for lines of `lanes` lanes (outer times inner) and `op`.
    pub fn new(lanes: usize, op: RollOp) -> Self {
        let sums = matches!(op, RollOp::Sum | RollOp::Avg);
        Self {
            at: None,
            age: 0,
            count: vec![0; lanes],
            odd: vec![0; lanes],
            sum: vec![0.0; if sums { lanes } else { 0 }],
            outputs: ChunkBufferPool::new(),
        }
    }

    /// Forgets the state (the lines were filled afresh).
    pub fn forget(&mut self) {
        self.at = None;
    }

    /// Bytes per lane.
    pub const LANE_BYTES: usize = 16;
}

/// `op` over each lane's frame of `lines`, for positions `out`: a column
/// of `outer x out.len() x inner` cells in C order (`count`: `int64`,
/// else `float64`), its positions in reverse order when `reversed` (a box
/// walked backward, given back in grid order). The frames' positions must
/// be held by the lines, and when `state` is of position `out.start - 1`,
/// so must the cells that leave its frame. `state` is left of position
/// `out.end - 1`.
pub fn roll(
    op: RollOp,
    lines: &Lines,
    (frame, out): (Frame, Range<usize>),
    state: &mut RollState,
    reversed: bool,
) -> Result<ArrayRef> {
    let Some(start) = frame.start else {
        return internal_err!("{} over a running frame rolled as a sliding one", op.name());
    };
    let rows = Rows {
        start,
        end: frame.end,
    };
    let width = out.len();
    let column = roll_tiled(op, lines, rows, out, TILE, state)?;
    Ok(column.finish(reversed.then_some([lines.outer, width, lines.inner])))
}

/// [`roll`], `tile` lanes at a time.
fn roll_tiled(
    op: RollOp,
    lines: &Lines,
    frame: Rows,
    out: Range<usize>,
    tile: usize,
    state: &mut RollState,
) -> Result<Rolled> {
    let lanes_held = lines.outer * lines.inner;
    let resume = !out.is_empty()
        && state.at.map(|a| a + 1) == Some(out.start)
        && state.age + out.len() <= RESUME_POSITIONS;
    // The first position the frames (and, resuming, the transition to the
    // first of them) read, and the last.
    let first = out.start as i64 + frame.start - i64::from(resume);
    let last = out.end as i64 - 1 + frame.end;
    if frame.start > frame.end
        || state.count.len() != lanes_held
        || (!out.is_empty() && (first < 0 || last - first >= lines.len as i64))
    {
        return internal_err!(
            "frames {}..={} of positions {out:?} outside lines of {} positions, or a state \
             of {} lanes for {lanes_held}",
            frame.start,
            frame.end,
            lines.len,
            state.count.len()
        );
    }
    let (inner, width) = (lines.inner, out.len());
    let count_only = op == RollOp::Count;
    let mut column = Rolled::new(op, lines.outer * width * inner, &state.outputs);
    // Cells whose frame holds NaN or an infinity: computed one by one.
    let mut odd_cells = Vec::new();
    if width > 0 && inner > 0 {
        let tile = tile.max(1);
        let sums = matches!(op, RollOp::Sum | RollOp::Avg);
        if sums && state.sum.len() != lanes_held {
            return internal_err!("a running state without sums for {}", op.name());
        }
        let mut acc = Running::new(tile.min(inner), sums);
        let extremum = match op {
            RollOp::Min => Some((f64::min as fn(f64, f64) -> f64, f64::INFINITY)),
            RollOp::Max => Some((f64::max as fn(f64, f64) -> f64, f64::NEG_INFINITY)),
            _ => None,
        };
        let lo = (out.start as i64 + frame.start) as usize;
        let hi = last as usize + 1;
        let mut runs = vec![
            0.0f64;
            if extremum.is_some() {
                (hi - lo) * tile.min(inner)
            } else {
                0
            }
        ];
        for o in 0..lines.outer {
            for i0 in (0..inner).step_by(tile) {
                let lanes = tile.min(inner - i0);
                let lane = o * inner + i0;
                if resume {
                    // From the frame of the position before.
                    acc.load(state, lane, lanes);
                    let (enter, leave) = (out.start as i64 + frame.end, first);
                    acc.slide(
                        lines,
                        lines.index(o, enter as usize, i0),
                        lines.index(o, leave as usize, i0),
                    );
                } else {
                    acc.reset(lanes);
                    for t in lo..=(out.start as i64 + frame.end) as usize {
                        acc.add(lines, lines.index(o, t, i0));
                    }
                }
                let span = match extremum {
                    Some((pick, none)) => {
                        fold_runs(lines, o, i0, lanes, lo..hi, frame, pick, none, &mut runs)
                    }
                    None => 0,
                };
                for (w, t) in out.clone().enumerate() {
                    let at = (o * width + w) * inner + i0;
                    let empty = !count_only && acc.has_empty();
                    let count = &acc.count[..lanes];
                    if count_only {
                        for (c, &k) in column.counts[at..at + lanes].iter_mut().zip(count) {
                            *c = i64::from(k);
                        }
                    } else {
                        if empty {
                            let valid = column.valid();
                            for (v, &k) in valid[at..at + lanes].iter_mut().zip(count) {
                                *v = k > 0;
                            }
                        }
                        let cells = &mut column.values()[at..at + lanes];
                        match (op, extremum) {
                            (RollOp::Avg, _) => {
                                for ((v, &s), &k) in cells.iter_mut().zip(&acc.sum).zip(count) {
                                    *v = s / f64::from(k.max(1));
                                }
                            }
                            (_, Some((pick, _))) => {
                                let a = (t as i64 + frame.start) as usize - lo;
                                let b = (t as i64 + frame.end) as usize + 1 - span - lo;
                                let (a, b) = (&runs[a * lanes..], &runs[b * lanes..]);
                                for ((v, &x), &y) in cells.iter_mut().zip(a).zip(b) {
                                    *v = pick(x, y);
                                }
                            }
                            _ => cells.copy_from_slice(&acc.sum[..lanes]),
                        }
                        if acc.odd_cells > 0 {
                            let odd = acc.odd[..lanes].iter().zip(count).enumerate();
                            for (k, (&odd, &c)) in odd {
                                if odd > 0 && c > 0 {
                                    odd_cells.push(at + k);
                                }
                            }
                        }
                    }
                    if t + 1 < out.end {
                        acc.slide(
                            lines,
                            lines.index(o, (t as i64 + 1 + frame.end) as usize, i0),
                            lines.index(o, (t as i64 + frame.start) as usize, i0),
                        );
                    }
                }
                acc.store(state, lane);
            }
        }
        state.age = if resume { state.age + width } else { width };
        state.at = Some(out.end - 1);
    }
    for k in odd_cells {
        let (o, rest) = (k / (width * inner), k % (width * inner));
        let (t, i) = (out.start + rest / inner, rest % inner);
        column.values()[k] = exact(op, lines, frame, o, t, i);
    }
    Ok(column)
}

/// The column a rolling aggregate fills, in C order: `count`'s integers
/// or the others' numbers, and which cells have no value.
///
/// The numbers are written into a buffer of the aggregate's pool (see
/// [`Rolled::new`]), which every cell is written into before the column is
/// finished.
pub(super) struct Rolled {
    /// Cells.
    n: usize,
    /// The numbers (none for `count` or no cells).
    numbers: Option<PooledBytes>,
    /// The counts (`count` only).
    pub(super) counts: Vec<i64>,
    /// Which cells have a value, once one has none.
    valid: Option<Vec<bool>>,
}

impl Rolled {
    /// `n` cells of `op`, every one valid, the numbers in a buffer of
    /// `pool`: one a block's column left there once its batches are
    /// dropped, not a fresh allocation zeroed and mapped page by page (as
    /// large as a block's cells in `float64`, it would be each time). Its
    /// cells hold what they held before until written: the caller writes
    /// every one.
    pub(super) fn new(op: RollOp, n: usize, pool: &ChunkBufferPool) -> Self {
        let count_only = op == RollOp::Count;
        Self {
            n,
            numbers: (!count_only && n > 0).then(|| pool.take(n * 8)),
            counts: vec![0; if count_only { n } else { 0 }],
            valid: None,
        }
    }

    /// The numbers, to write (empty for `count`).
    pub(super) fn values(&mut self) -> &mut [f64] {
        match &mut self.numbers {
            Some(numbers) => numbers.as_mut_f64s(),
            None => &mut [],
        }
    }

    /// Which cells have a value (all, until one is marked).
    pub(super) fn valid(&mut self) -> &mut [bool] {
        let n = self.n;
        self.valid.get_or_insert_with(|| vec![true; n])
    }

    /// The column: `int64` for `count`, else `float64` with NULLs; with
    /// the positions of its `[outer, n, inner]` cells in reverse order
    /// when `reversed` gives that shape.
    pub(super) fn finish(mut self, reversed: Option<[usize; 3]>) -> ArrayRef {
        if let Some([outer, n, inner]) = reversed {
            reverse_positions(self.values(), [outer, n, inner]);
            reverse_positions(&mut self.counts, [outer, n, inner]);
            if let Some(valid) = &mut self.valid {
                reverse_positions(valid, [outer, n, inner]);
            }
        }
        if self.numbers.is_none() && !self.counts.is_empty() {
            return Arc::new(Int64Array::from(self.counts));
        }
        let nulls = (self.valid).map(|valid| NullBuffer::new(BooleanBuffer::from(valid)));
        let values = match self.numbers {
            Some(numbers) => ScalarBuffer::new(numbers.into_buffer(), 0, self.n),
            None => ScalarBuffer::from(Vec::<f64>::new()),
        };
        Arc::new(Float64Array::new(values, nulls))
    }
}

/// Swaps, in place, position `t` of `cells` laid out `[outer, n, inner]`
/// (C order) with position `n - 1 - t` (nothing when they are not that
/// many: an empty column).
fn reverse_positions<T>(cells: &mut [T], [outer, n, inner]: [usize; 3]) {
    if cells.is_empty() || cells.len() != outer * n * inner {
        return;
    }
    for slab in cells.chunks_exact_mut(n * inner) {
        for t in 0..n / 2 {
            let (head, tail) = slab.split_at_mut((n - 1 - t) * inner);
            head[t * inner..(t + 1) * inner].swap_with_slice(&mut tail[..inner]);
        }
    }
}

/// Per lane: non-NULL cells, non-finite cells and the sum of the finite
/// values of a frame (no sums when `sum` is empty); and the non-finite
/// cells of all lanes.
struct Running {
    lanes: usize,
    count: Vec<u32>,
    odd: Vec<u32>,
    odd_cells: u64,
    sum: Vec<f64>,
    /// Whether every lane's count is known to be above zero: checked once
    /// (see [`Running::has_empty`]) and kept while frames slide over
    /// finite cells only, which leave the counts as they are.
    nonempty: bool,
}

impl Running {
    fn new(lanes: usize, sums: bool) -> Self {
        Self {
            lanes,
            count: vec![0; lanes],
            odd: vec![0; lanes],
            odd_cells: 0,
            sum: vec![0.0; if sums { lanes } else { 0 }],
            nonempty: false,
        }
    }

    /// Whether a lane's frame holds no value (its count is 0).
    fn has_empty(&mut self) -> bool {
        if !self.nonempty {
            self.nonempty = !self.count[..self.lanes].contains(&0);
        }
        !self.nonempty
    }

    /// Empties the state, for `lanes` lanes.
    fn reset(&mut self, lanes: usize) {
        self.lanes = lanes;
        self.nonempty = false;
        self.count[..lanes].fill(0);
        self.odd[..lanes].fill(0);
        self.odd_cells = 0;
        if !self.sum.is_empty() {
            self.sum[..lanes].fill(0.0);
        }
    }

    /// Takes lanes `lane..lane + lanes` of `state`.
    fn load(&mut self, state: &RollState, lane: usize, lanes: usize) {
        self.lanes = lanes;
        self.nonempty = false;
        self.count[..lanes].copy_from_slice(&state.count[lane..lane + lanes]);
        self.odd[..lanes].copy_from_slice(&state.odd[lane..lane + lanes]);
        self.odd_cells = self.odd[..lanes].iter().map(|&n| u64::from(n)).sum();
        if !self.sum.is_empty() {
            self.sum[..lanes].copy_from_slice(&state.sum[lane..lane + lanes]);
        }
    }

    /// Leaves the state in lanes `lane..` of `state`.
    fn store(&self, state: &mut RollState, lane: usize) {
        let lanes = self.lanes;
        state.count[lane..lane + lanes].copy_from_slice(&self.count[..lanes]);
        state.odd[lane..lane + lanes].copy_from_slice(&self.odd[..lanes]);
        if !self.sum.is_empty() {
            state.sum[lane..lane + lanes].copy_from_slice(&self.sum[..lanes]);
        }
    }

    /// Adds the cells of one position, starting at cell `at` of `lines`.
    fn add(&mut self, lines: &Lines, at: usize) {
        let lanes = self.lanes;
        self.nonempty = false;
        let flags = &lines.flags[at..at + lanes];
        let counts = self.count[..lanes].iter_mut().zip(&mut self.odd[..lanes]);
        let mut odd_cells = 0u32;
        for ((count, odd), &flag) in counts.zip(flags) {
            let is_odd = u32::from(flag >= NAN);
            *count += u32::from(flag != MISSING);
            *odd += is_odd;
            odd_cells += is_odd;
        }
        self.odd_cells += u64::from(odd_cells);
        if !self.sum.is_empty() {
            let sums = &mut self.sum[..lanes];
            with_values!(&lines.values, values => {
                let values = &values[at..at + lanes];
                sums.iter_mut().zip(values).for_each(|(s, &v)| *s += v.widened());
            })
        }
    }

    /// Adds the cells of the position starting at cell `enter` of `lines`
    /// and takes out those of the one starting at `leave`: the frame of
    /// the next position.
    fn slide(&mut self, lines: &Lines, enter: usize, leave: usize) {
        let lanes = self.lanes;
        let (entering, leaving) = (
            &lines.flags[enter..enter + lanes],
            &lines.flags[leave..leave + lanes],
        );
        // A finite value for one: the counts stay as they are.
        if !(all_finite(entering) && all_finite(leaving)) {
            self.count_slide(entering, leaving);
        }
        if !self.sum.is_empty() {
            let sums = &mut self.sum[..lanes];
            with_values!(&lines.values, values => {
                let entering = &values[enter..enter + lanes];
                let leaving = &values[leave..leave + lanes];
                let sums = sums.iter_mut().zip(entering.iter().zip(leaving));
                sums.for_each(|(s, (&e, &l))| *s += e.widened() - l.widened());
            })
        }
    }

    /// The counts of [`Running::slide`], cells of flags `entering` coming
    /// in and of `leaving` going out.
    fn count_slide(&mut self, entering: &[u8], leaving: &[u8]) {
        let lanes = self.lanes;
        self.nonempty = false;
        let flags = entering.iter().zip(leaving);
        let counts = self.count[..lanes].iter_mut().zip(&mut self.odd[..lanes]);
        // Wrapping: a lane's count never goes below zero, but its terms may.
        let mut odd_cells = 0u32;
        for ((count, odd), (&e, &l)) in counts.zip(flags) {
            let (odd_in, odd_out) = (u32::from(e >= NAN), u32::from(l >= NAN));
            *count =
                (count.wrapping_add(u32::from(e != MISSING))).wrapping_sub(u32::from(l != MISSING));
            *odd = odd.wrapping_add(odd_in).wrapping_sub(odd_out);
            odd_cells = odd_cells.wrapping_add(odd_in).wrapping_sub(odd_out);
        }
        // The total changes by at most `lanes` either way.
        self.odd_cells = self
            .odd_cells
            .wrapping_add(i64::from(odd_cells as i32) as u64);
    }
}

/// Whether every flag is [`FINITE`] (without stopping early, so that the
/// check is a few vector compares).
fn all_finite(flags: &[u8]) -> bool {
    flags.iter().fold(true, |all, &f| all & (f == FINITE))
}

/// Folds positions `range` of lanes `i0..i0 + lanes` (outer lane `o`)
/// into `runs` (position-major) so that each holds the extremum (`pick`,
/// identity `none`) of the finite values of the `span` positions from it
/// on, `span` the largest power of two within the frame's width; returns
/// `span`. A frame is then the extremum of two overlapping runs.
#[allow(clippy::too_many_arguments)]
fn fold_runs(
    lines: &Lines,
    o: usize,
    i0: usize,
    lanes: usize,
    range: Range<usize>,
    frame: Rows,
    pick: fn(f64, f64) -> f64,
    none: f64,
    runs: &mut [f64],
) -> usize {
    let len = range.len();
    for (p, t) in range.enumerate() {
        let at = lines.index(o, t, i0);
        let (run, flags) = (
            &mut runs[p * lanes..(p + 1) * lanes],
            &lines.flags[at..at + lanes],
        );
        with_values!(&lines.values, values => {
            let cells = values[at..at + lanes].iter().zip(flags);
            for (run, (&v, &f)) in run.iter_mut().zip(cells) {
                *run = if f == FINITE { v.widened() } else { none };
            }
        })
    }
    let mut span = 1usize;
    while span * 2 <= frame.width() {
        for p in 0..len.saturating_sub(span) {
            let (head, tail) = runs.split_at_mut((p + span) * lanes);
            let here = &mut head[p * lanes..(p + 1) * lanes];
            for (a, &b) in here.iter_mut().zip(&tail[..lanes]) {
                *a = pick(*a, b);
            }
        }
        span *= 2;
    }
    span
}

/// `op` over one lane's frame, cell by cell (a frame with NaN or an
/// infinity; at least one value).
fn exact(op: RollOp, lines: &Lines, frame: Rows, o: usize, t: usize, i: usize) -> f64 {
    let cells = (t as i64 + frame.start) as usize..=(t as i64 + frame.end) as usize;
    let values = cells.filter_map(|p| lines.value(lines.index(o, p, i)));
    match op {
        RollOp::Sum => values.sum(),
        RollOp::Avg => {
            let (sum, n) = values.fold((0.0, 0u32), |(s, n), v| (s + v, n + 1));
            sum / f64::from(n)
        }
        RollOp::Min => values.min_by(f64::total_cmp).unwrap_or(f64::NAN),
        RollOp::Max => values.max_by(f64::total_cmp).unwrap_or(f64::NAN),
        RollOp::Count => values.count() as f64,
    }
}

#[cfg(test)]
pub(super) mod tests {
    use datafusion::arrow::array::Float32Array;

    use super::*;

    /// Every rolling aggregate.
    pub(in crate::array::rolling) const OPS: [RollOp; 5] = [
        RollOp::Count,
        RollOp::Sum,
        RollOp::Avg,
        RollOp::Min,
        RollOp::Max,
    ];

    #[test]
    fn rolling_aggregates_are_the_reductions_of_their_names() {
        for op in OPS {
            let reduce = ReduceOp::from_name(op.name()).unwrap();
            assert_eq!(
                (RollOp::of(reduce), RollOp::from_name(op.name())),
                (Some(op), Some(op))
            );
        }
        for name in ["var", "var_pop", "stddev", "stddev_pop", "median"] {
            assert_eq!(RollOp::from_name(name), None, "{name}");
        }
    }

    /// Each lane's frame, computed naively from the cells' numbers.
    fn naive(
        op: RollOp,
        cells: &[Option<f64>],
        (outer, len, inner): (usize, usize, usize),
        frame: Rows,
        out: Range<usize>,
    ) -> Vec<Option<f64>> {
        let mut result = Vec::new();
        for o in 0..outer {
            for t in out.clone() {
                for i in 0..inner {
                    let values: Vec<f64> = (t as i64 + frame.start..=t as i64 + frame.end)
                        .filter(|&p| p >= 0 && (p as usize) < len)
                        .filter_map(|p| cells[(o * len + p as usize) * inner + i])
                        .collect();
                    result.push(aggregate_of(op, &values));
                }
            }
        }
        result
    }

    /// `op` over `values` in order, as SQL has it (`count`: a number).
    pub(in crate::array::rolling) fn aggregate_of(op: RollOp, values: &[f64]) -> Option<f64> {
        match op {
            RollOp::Count => Some(values.len() as f64),
            _ if values.is_empty() => None,
            RollOp::Sum => Some(values.iter().sum()),
            RollOp::Avg => Some(values.iter().sum::<f64>() / values.len() as f64),
            RollOp::Min => values.iter().copied().min_by(f64::total_cmp),
            RollOp::Max => values.iter().copied().max_by(f64::total_cmp),
        }
    }

    /// A rolled column's cells as numbers.
    pub(in crate::array::rolling) fn numbers(column: &ArrayRef) -> Vec<Option<f64>> {
        match column.data_type() {
            DataType::Int64 => (column.as_primitive::<datafusion::arrow::datatypes::Int64Type>())
                .iter()
                .map(|v| v.map(|v| v as f64))
                .collect(),
            _ => column.as_primitive::<Float64Type>().iter().collect(),
        }
    }

    fn close(a: Option<f64>, b: Option<f64>) -> bool {
        match (a, b) {
            (None, None) => true,
            (Some(a), Some(b)) if a.is_nan() || b.is_nan() => a.is_nan() && b.is_nan(),
            (Some(a), Some(b)) => a == b || (a - b).abs() <= 1e-9 * a.abs().max(b.abs()),
            _ => false,
        }
    }

    #[test]
    fn rolled_frames_equal_the_naive_aggregate() {
        let (outer, len, inner) = (3usize, 23usize, 5usize);
        // Deterministic cells: gaps, NaN and infinities in some lanes.
        let cells: Vec<Option<f64>> = (0..outer * len * inner)
            .map(|k| {
                let x = ((k * 7919) % 1000) as f64 / 10.0 - 50.0;
                match k % 37 {
                    0 | 5 | 11 => None,
                    19 if k % 3 == 0 => Some(f64::NAN),
                    23 if k % 2 == 0 => Some(f64::INFINITY),
                    29 if k % 5 == 0 => Some(f64::NEG_INFINITY),
                    _ => Some(x),
                }
            })
            .collect();
        // Laid out from slot 0 and around the ring, from slot 7.
        check_laid_out(&cells, (outer, len, inner), [0, 7]);
    }

    /// [`check_frames`] of lines holding `cells` of `shape` from each
    /// position of `shifts` on.
    fn check_laid_out(cells: &[Option<f64>], shape: (usize, usize, usize), shifts: [usize; 2]) {
        let (outer, len, inner) = shape;
        let array: ArrayRef = Arc::new(Float64Array::from(cells.to_vec()));
        for shift in shifts {
            let mut lines = Lines::new(outer, len, inner);
            lines.put(shift, len, 0, &array).unwrap();
            check_frames(&lines, shift, cells, shape);
        }
    }

    #[test]
    fn frames_over_long_runs_of_finite_cells_between_rare_odd_ones_equal_the_naive_aggregate() {
        // Finite cells but for one NULL, one NaN, one +inf and a lane empty
        // for a while: most slides leave the counts as they are, and frames
        // pass from such runs to odd cells and back, in every tile.
        let (outer, len, inner) = (2usize, 61usize, 6usize);
        let cells: Vec<Option<f64>> = (0..outer * len * inner)
            .map(|k| {
                let (o, t, i) = (k / (len * inner), (k / inner) % len, k % inner);
                match (o, t, i) {
                    (0, 30, 2) => None,
                    (1, 12, 5) => Some(f64::NAN),
                    (1, 44, 0) => Some(f64::INFINITY),
                    (0, 40..=47, 4) => None,
                    // Positive: no frame sums to nearly zero, where the
                    // running sum's rounding would not be relatively small.
                    _ => Some(((k * 7919) % 1000) as f64 / 10.0 + 0.5),
                }
            })
            .collect();
        check_laid_out(&cells, (outer, len, inner), [0, 13]);
    }

    #[test]
    fn lines_of_float32_values_roll_as_float64_lines_of_the_same_values() {
        let (outer, len, inner) = (2usize, 29usize, 7usize);
        let singles: Vec<Option<f32>> = (0..outer * len * inner)
            .map(|k| match k % 31 {
                0 | 9 => None,
                17 if k % 2 == 0 => Some(f32::NAN),
                13 if k % 3 == 0 => Some(f32::INFINITY),
                _ => Some(((k * 7919) % 1000) as f32 / 7.0 - 70.0),
            })
            .collect();
        let widened: Vec<Option<f64>> = singles.iter().map(|c| c.map(f64::from)).collect();
        let f32s: ArrayRef = Arc::new(Float32Array::from(singles));
        let f64s: ArrayRef = Arc::new(Float64Array::from(widened.clone()));
        for shift in [0, 11] {
            let mut single = Lines::holding(outer, len, inner, true);
            single.put(shift, len, 0, &f32s).unwrap();
            assert!(single.is_single());
            check_frames(&single, shift, &widened, (outer, len, inner));
            let mut double = Lines::new(outer, len, inner);
            double.put(shift, len, 0, &f64s).unwrap();
            let bits = |c: &ArrayRef| -> Vec<Option<u64>> {
                numbers(c).iter().map(|v| v.map(f64::to_bits)).collect()
            };
            for op in OPS {
                for (start, end) in [(-23, 0), (-2, 3), (0, 0)] {
                    let frame = Frame {
                        start: Some(start),
                        end,
                    };
                    let out = frame.before() as usize..len - frame.after() as usize;
                    let out = out.start + shift..out.end + shift;
                    let rolled = |lines: &Lines| {
                        let mut state = RollState::new(outer * inner, op);
                        roll(op, lines, (frame, out.clone()), &mut state, false).unwrap()
                    };
                    let (a, b) = (rolled(&single), rolled(&double));
                    assert_eq!(bits(&a), bits(&b), "{} over {frame:?}", op.name());
                }
            }
            // Only a float32 column's values go into them.
            let err = single.put(shift, len, 0, &f64s).unwrap_err().to_string();
            assert!(
                err.contains("float64 cells put in lines of float32"),
                "{err}"
            );
            let numbers = vec![1.5; inner];
            let err = single.put_numbers((0, 1, 0), &numbers, false).unwrap_err();
            assert!(
                err.to_string().contains("numbers put in lines of float32"),
                "{err}"
            );
        }
    }

    /// Every op over several frames and runs of positions of `lines`,
    /// holding `cells` from position `shift` on, against [`naive`].
    fn check_frames(
        lines: &Lines,
        shift: usize,
        cells: &[Option<f64>],
        (outer, len, inner): (usize, usize, usize),
    ) {
        let frames = [
            (-3, 0),
            (0, 0),
            (-1, 2),
            (2, 4),
            (-6, -2),
            (-8, 8),
            (-22, 0),
        ];
        for (start, end) in frames {
            let frame = Frame {
                start: Some(start),
                end,
            };
            let rows = Rows { start, end };
            let lo = frame.before() as usize;
            let hi = len - frame.after() as usize;
            for out in [lo..hi, lo..lo + 1, hi - 1..hi, lo + 1..hi.min(lo + 5)] {
                for op in OPS {
                    // Tiles of lanes that split the 5 lanes, and one that
                    // does not; in one run, and in two, the second resuming
                    // from the first's running state.
                    let mid = out.start + out.len() / 2;
                    for tile in [1, 2, 3, TILE] {
                        let mut state = RollState::new(outer * inner, op);
                        let runs = if out.len() > 1 {
                            vec![out.start..mid, mid..out.end]
                        } else {
                            vec![out.clone()]
                        };
                        for run in runs {
                            let want = naive(op, cells, (outer, len, inner), rows, run.clone());
                            let shifted = run.start + shift..run.end + shift;
                            let got = roll_tiled(op, lines, rows, shifted, tile, &mut state)
                                .map(|c| c.finish(None));
                            let got = numbers(&got.unwrap());
                            assert_eq!(got.len(), want.len());
                            for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                                assert!(
                                    close(*g, *w),
                                    "{} frame {start}..={end} run {run:?} of {out:?} shift \
                                     {shift} tile {tile} cell {k}: {g:?} != {w:?}",
                                    op.name()
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn positions_reverse_in_place_within_each_outer_lane() {
        // [2 outer, 3 positions, 2 inner].
        let mut cells: Vec<i32> = (0..12).collect();
        reverse_positions(&mut cells, [2, 3, 2]);
        assert_eq!(cells, [4, 5, 2, 3, 0, 1, 10, 11, 8, 9, 6, 7]);
        let mut even: Vec<i32> = (0..4).collect();
        reverse_positions(&mut even, [1, 4, 1]);
        assert_eq!(even, [3, 2, 1, 0]);
        // Not of that shape (a count's empty numbers): left as it is.
        let mut empty: Vec<f64> = Vec::new();
        reverse_positions(&mut empty, [2, 3, 2]);
        assert!(empty.is_empty());
    }

    #[test]
    fn pieces_wrap_around_the_ring_and_positions_clear() {
        let piece: ArrayRef = Arc::new(Float64Array::from(
            (0..12).map(|v| Some(v as f64)).collect::<Vec<_>>(),
        ));
        // 2 outer lanes x 3 positions x 2 inner lanes, put at positions
        // 4..7 of a ring of 5: slots 4, 0, 1.
        let mut lines = Lines::new(2, 5, 2);
        // In two pieces, the second starting inside the first outer lane.
        lines.put(4, 3, 0, &piece.slice(0, 4)).unwrap();
        lines.put(4, 3, 4, &piece.slice(4, 8)).unwrap();
        let at = |lines: &Lines, o: usize, t: usize, i: usize| lines.value(lines.index(o, t, i));
        for o in 0..2 {
            for t in 0..3 {
                for i in 0..2 {
                    let want = Some((o * 6 + t * 2 + i) as f64);
                    assert_eq!(at(&lines, o, 4 + t, i), want, "o={o} t={t} i={i}");
                }
            }
        }
        // Slots 2 and 3 were not written.
        assert_eq!(at(&lines, 0, 2, 0), None);
        assert_eq!(at(&lines, 1, 3, 1), None);
        // Walked backward, in pieces that cut positions and lanes: the
        // box's position t at 4 + 2 - t.
        let mut walked = Lines::new(2, 5, 2);
        for cut in [0..3, 3..7, 7..12] {
            let part = piece.slice(cut.start, cut.end - cut.start);
            walked.put_walked(4, 3, cut.start, &part, true).unwrap();
        }
        for o in 0..2 {
            for t in 0..3 {
                for i in 0..2 {
                    let want = Some((o * 6 + t * 2 + i) as f64);
                    assert_eq!(at(&walked, o, 6 - t, i), want, "o={o} t={t} i={i}");
                }
            }
        }
        assert_eq!(at(&walked, 0, 3, 0), None);
        // A frame over positions 5..=6 of lane (1, 0): 8 + 10.
        let state = |op| RollState::new(4, op);
        let frame = Frame {
            start: Some(-1),
            end: 0,
        };
        let sum = roll(
            RollOp::Sum,
            &lines,
            (frame, 6..7),
            &mut state(RollOp::Sum),
            false,
        )
        .unwrap();
        assert_eq!(sum.as_primitive::<Float64Type>().value(2), 18.0);
        // Frames wider than the ring, pieces longer than the box, boxes
        // longer than the ring are refused.
        let wide = Frame {
            start: Some(-5),
            end: 0,
        };
        assert!(roll(
            RollOp::Sum,
            &lines,
            (wide, 5..6),
            &mut state(RollOp::Sum),
            false
        )
        .is_err());
        // So is a state of other lanes, or without the sums.
        let other_lanes = &mut RollState::new(3, RollOp::Sum);
        assert!(roll(RollOp::Sum, &lines, (frame, 6..7), other_lanes, false).is_err());
        assert!(roll(
            RollOp::Avg,
            &lines,
            (frame, 6..7),
            &mut state(RollOp::Max),
            false
        )
        .is_err());
        assert!(lines.put(1, 3, 1, &piece).is_err());
        assert!(lines.put(0, 6, 0, &piece).is_err());

        // float32 cells with a NULL and a NaN; then a position cleared.
        let small: ArrayRef = Arc::new(Float32Array::from(vec![
            Some(1.5),
            None,
            Some(f32::NAN),
            Some(2.0),
        ]));
        let mut ring = Lines::new(1, 3, 2);
        ring.put(2, 2, 0, &small).unwrap();
        assert_eq!(at(&ring, 0, 2, 0), Some(1.5));
        assert_eq!(at(&ring, 0, 2, 1), None);
        assert!(at(&ring, 0, 3, 0).is_some_and(f64::is_nan));
        assert_eq!(at(&ring, 0, 3, 1), Some(2.0));
        ring.clear(3, 1);
        assert_eq!((at(&ring, 0, 0, 0), at(&ring, 0, 0, 1)), (None, None));
        assert_eq!(at(&ring, 0, 2, 0), Some(1.5));
        let mut counted = RollState::new(2, RollOp::Count);
        let count = roll(RollOp::Count, &ring, (frame, 3..4), &mut counted, false).unwrap();
        let count = count.as_primitive::<datafusion::arrow::datatypes::Int64Type>();
        assert_eq!((count.value(0), count.value(1)), (1, 0));
    }

    /// A box's column, once dropped, lends its buffer to the next box's
    /// column of the same aggregate, which writes over every cell: the
    /// second box's sums are its own, not the first's left behind.
    #[test]
    fn a_dropped_column_lends_its_buffer_to_the_next_which_writes_every_cell() {
        let (lanes, len) = (3, 8);
        let mut lines = Lines::new(1, len, lanes);
        let cells: Vec<f64> = (0..len * lanes).map(|c| c as f64).collect();
        let piece: ArrayRef = Arc::new(Float64Array::from(cells));
        lines.put(0, len, 0, &piece).unwrap();
        let frame = Frame {
            start: Some(-1),
            end: 0,
        };
        let sum_of = |t: usize, i: usize| {
            let at = |t: usize| (t * lanes + i) as f64;
            at(t) + if t > 0 { at(t - 1) } else { 0.0 }
        };
        let mut state = RollState::new(lanes, RollOp::Sum);
        let first = roll(RollOp::Sum, &lines, (frame, 1..4), &mut state, false).unwrap();
        let first_buffer = first.to_data().buffers()[0].as_ptr();
        drop(first);
        // Not resumed from the first: summed afresh over positions 4..7.
        state.forget();
        let second = roll(RollOp::Sum, &lines, (frame, 4..7), &mut state, false).unwrap();
        assert_eq!(second.to_data().buffers()[0].as_ptr(), first_buffer);
        let second = numbers(&second);
        let want: Vec<Option<f64>> = (4..7)
            .flat_map(|t| (0..lanes).map(move |i| Some(sum_of(t, i))))
            .collect();
        assert_eq!(second, want);
        // Resumed from the second while it is alive: a buffer of its own.
        let kept = roll(
            RollOp::Sum,
            &lines,
            (frame, 4..5),
            &mut state.clone(),
            false,
        )
        .unwrap();
        let third = roll(RollOp::Sum, &lines, (frame, 7..8), &mut state, false).unwrap();
        assert_ne!(
            third.to_data().buffers()[0].as_ptr(),
            kept.to_data().buffers()[0].as_ptr()
        );
        let want: Vec<Option<f64>> = (0..lanes).map(|i| Some(sum_of(7, i))).collect();
        assert_eq!(numbers(&third), want);
    }
}

//! Rolling aggregates along one axis of a box of cells.
//!
//! The cells of one argument are [`Lines`]: a box laid out (outer, t,
//! inner) in C order, `t` the rolled axis, each cell a value and a flag
//! (missing, finite, NaN, +inf, -inf). [`roll`] gives, for a run of
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
//! the frame and removing the one leaving it; `min` and `max` fold the
//! frame in `log2(width)` passes (after pass `j` each cell holds the
//! extremum of the `2^j` cells from it on), so that each frame is the
//! extremum of two overlapping runs. Lanes whose frame holds a non-finite
//! value are computed cell by cell.

use std::ops::Range;
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, Float64Array, Int64Array};
use datafusion::arrow::buffer::{BooleanBuffer, NullBuffer};
use datafusion::arrow::datatypes::Float64Type;
use datafusion::common::{internal_err, Result};

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
    /// The SQL name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Count => "count",
            Self::Sum => "sum",
            Self::Avg => "avg",
            Self::Min => "min",
            Self::Max => "max",
        }
    }
}

/// A cell without a value (NULL, or outside the selection).
const MISSING: u8 = 0;
/// A finite value.
const FINITE: u8 = 1;
/// NaN, +inf or -inf: stored as 0 in `values`, its kind in `flags`.
const NAN: u8 = 2;
const POS_INF: u8 = 3;
const NEG_INF: u8 = 4;

/// The cells of one argument over a box, laid out (outer, t, inner).
#[derive(Debug, Clone)]
pub struct Lines {
    outer: usize,
    len: usize,
    inner: usize,
    /// The finite values (0 elsewhere).
    values: Vec<f64>,
    /// Each cell's kind: [`MISSING`], [`FINITE`], [`NAN`], [`POS_INF`], [`NEG_INF`].
    flags: Vec<u8>,
}

impl Lines {
    /// `len` positions of `outer x inner` lanes, every cell missing.
    pub fn new(outer: usize, len: usize, inner: usize) -> Self {
        let cells = outer * len * inner;
        Self {
            outer,
            len,
            inner,
            values: vec![0.0; cells],
            flags: vec![MISSING; cells],
        }
    }

    /// Bytes per cell.
    pub const CELL_BYTES: usize = 9;

    /// Number of positions along the rolled axis.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no positions.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Puts cells `offset..offset + piece.len()` (in C order) of a box of
    /// `n` positions laid out (outer, n, inner), the box placed at
    /// positions `at..at + n`; `piece` is `float64` with NULLs.
    pub fn put(&mut self, at: usize, n: usize, offset: usize, piece: &ArrayRef) -> Result<()> {
        let line = n * self.inner;
        let end = offset + piece.len();
        if at + n > self.len || end > self.outer * line {
            return internal_err!(
                "cells {offset}..{end} of {n} positions at {at} do not fit lines of {} x {} x {}",
                self.outer,
                self.len,
                self.inner
            );
        }
        let piece = piece.as_primitive::<Float64Type>();
        let values = piece.values();
        let nulls = piece.nulls().filter(|n| n.null_count() > 0);
        let mut k = offset;
        while k < end {
            let (o, within) = (k / line, k % line);
            let run = (line - within).min(end - k);
            let dst = (o * self.len + at) * self.inner + within;
            let src = k - offset;
            let cells = &mut self.values[dst..dst + run];
            let flags = &mut self.flags[dst..dst + run];
            cells.copy_from_slice(&values[src..src + run]);
            let mut finite = true;
            for (flag, v) in flags.iter_mut().zip(cells.iter()) {
                let f = v.is_finite();
                *flag = if f { FINITE } else { MISSING };
                finite &= f;
            }
            // The rare cells: NaN and infinities, then NULLs.
            if !finite {
                for (flag, v) in flags.iter_mut().zip(cells.iter_mut()) {
                    if !v.is_finite() {
                        *flag = if v.is_nan() {
                            NAN
                        } else if *v > 0.0 {
                            POS_INF
                        } else {
                            NEG_INF
                        };
                        *v = 0.0;
                    }
                }
            }
            if let Some(nulls) = nulls {
                for j in 0..run {
                    if nulls.is_null(src + j) {
                        flags[j] = MISSING;
                        cells[j] = 0.0;
                    }
                }
            }
            k += run;
        }
        Ok(())
    }

    /// Positions `end - n..end` (those before the first: missing), as lines
    /// of `n` positions.
    pub fn tail(&self, end: usize, n: usize) -> Lines {
        let mut out = Lines::new(self.outer, n, self.inner);
        let end = end.min(self.len);
        let kept = n.min(end);
        for o in 0..self.outer {
            let src = (o * self.len + end - kept) * self.inner;
            let dst = (o * n + n - kept) * self.inner;
            let run = kept * self.inner;
            out.values[dst..dst + run].copy_from_slice(&self.values[src..src + run]);
            out.flags[dst..dst + run].copy_from_slice(&self.flags[src..src + run]);
        }
        out
    }

    /// Copies `other` (same lanes) to positions `at..at + other.len`.
    pub fn put_lines(&mut self, at: usize, other: &Lines) -> Result<()> {
        if other.outer != self.outer || other.inner != self.inner || at + other.len > self.len {
            return internal_err!(
                "lines of {} x {} x {} do not fit at {at} in lines of {} x {} x {}",
                other.outer,
                other.len,
                other.inner,
                self.outer,
                self.len,
                self.inner
            );
        }
        let run = other.len * self.inner;
        for o in 0..self.outer {
            let src = o * run;
            let dst = (o * self.len + at) * self.inner;
            self.values[dst..dst + run].copy_from_slice(&other.values[src..src + run]);
            self.flags[dst..dst + run].copy_from_slice(&other.flags[src..src + run]);
        }
        Ok(())
    }

    fn index(&self, o: usize, t: usize, i: usize) -> usize {
        (o * self.len + t) * self.inner + i
    }

    /// The cell's value as a number (NaN and infinities included).
    fn value(&self, index: usize) -> Option<f64> {
        match self.flags[index] {
            MISSING => None,
            FINITE => Some(self.values[index]),
            NAN => Some(f64::NAN),
            POS_INF => Some(f64::INFINITY),
            _ => Some(f64::NEG_INFINITY),
        }
    }
}

/// A frame in grid order: position `t` aggregates `t + start ..= t + end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd)]
pub struct Frame {
    /// Offset of the frame's first position (negative: before `t`).
    pub start: i64,
    /// Offset of its last position (`>= start`).
    pub end: i64,
}

impl Frame {
    /// Positions needed before the first output position.
    pub fn before(&self) -> u64 {
        self.start.min(0).unsigned_abs()
    }

    /// Positions needed after the last output position.
    pub fn after(&self) -> u64 {
        self.end.max(0) as u64
    }

    fn width(&self) -> usize {
        (self.end - self.start + 1) as usize
    }
}

/// Lanes computed together: their running state and frames stay in cache.
const TILE: usize = 1024;

/// `op` over each lane's frame of `lines`, for positions `out`: a column
/// of `outer x out.len() x inner` cells in C order (`count`: `int64`,
/// else `float64`). Every frame must lie inside the lines.
pub fn roll(op: RollOp, lines: &Lines, frame: Frame, out: Range<usize>) -> Result<ArrayRef> {
    roll_tiled(op, lines, frame, out, TILE)
}

/// [`roll`], `tile` lanes at a time.
fn roll_tiled(
    op: RollOp,
    lines: &Lines,
    frame: Frame,
    out: Range<usize>,
    tile: usize,
) -> Result<ArrayRef> {
    let first = out.start as i64 + frame.start;
    let last = out.end as i64 - 1 + frame.end;
    if frame.start > frame.end || (!out.is_empty() && (first < 0 || last >= lines.len as i64)) {
        return internal_err!(
            "frames {}..={} of positions {out:?} outside lines of {} positions",
            frame.start,
            frame.end,
            lines.len
        );
    }
    let (inner, width) = (lines.inner, out.len());
    let n = lines.outer * width * inner;
    let mut values = vec![0.0f64; if op == RollOp::Count { 0 } else { n }];
    let mut counts = vec![0i64; if op == RollOp::Count { n } else { 0 }];
    let mut valid = vec![false; n];
    // Cells whose frame holds NaN or an infinity: computed one by one.
    let mut odd_cells = Vec::new();
    if width > 0 && inner > 0 {
        let tile = tile.max(1);
        let mut acc = Running::new(tile.min(inner), matches!(op, RollOp::Sum | RollOp::Avg));
        let extremum = match op {
            RollOp::Min => Some((f64::min as fn(f64, f64) -> f64, f64::INFINITY)),
            RollOp::Max => Some((f64::max as fn(f64, f64) -> f64, f64::NEG_INFINITY)),
            _ => None,
        };
        let (lo, hi) = (first as usize, last as usize + 1);
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
                acc.reset(lanes);
                for t in lo..=(out.start as i64 + frame.end) as usize {
                    acc.add(lines, lines.index(o, t, i0), false);
                }
                let span = match extremum {
                    Some((pick, none)) => {
                        fold_runs(lines, o, i0, lanes, lo..hi, frame, pick, none, &mut runs)
                    }
                    None => 0,
                };
                for (w, t) in out.clone().enumerate() {
                    let at = (o * width + w) * inner + i0;
                    for k in 0..lanes {
                        let c = acc.count[k];
                        valid[at + k] = c > 0 || op == RollOp::Count;
                        if op == RollOp::Count {
                            counts[at + k] = i64::from(c);
                        } else if c > 0 && acc.odd[k] > 0 {
                            odd_cells.push(at + k);
                        } else if c > 0 {
                            values[at + k] = match (op, extremum) {
                                (RollOp::Sum, _) => acc.sum[k],
                                (RollOp::Avg, _) => acc.sum[k] / f64::from(c),
                                (_, Some((pick, _))) => {
                                    let a = (t as i64 + frame.start) as usize - lo;
                                    let b = (t as i64 + frame.end) as usize + 1 - span - lo;
                                    pick(runs[a * lanes + k], runs[b * lanes + k])
                                }
                                _ => 0.0,
                            };
                        }
                    }
                    if t + 1 < out.end {
                        acc.add(
                            lines,
                            lines.index(o, (t as i64 + 1 + frame.end) as usize, i0),
                            false,
                        );
                        acc.add(
                            lines,
                            lines.index(o, (t as i64 + frame.start) as usize, i0),
                            true,
                        );
                    }
                }
            }
        }
    }
    if op == RollOp::Count {
        return Ok(Arc::new(Int64Array::from(counts)));
    }
    for k in odd_cells {
        let (o, rest) = (k / (width * inner), k % (width * inner));
        let (t, i) = (out.start + rest / inner, rest % inner);
        values[k] = exact(op, lines, frame, o, t, i);
    }
    let valid = BooleanBuffer::from(valid);
    let nulls = Some(NullBuffer::new(valid)).filter(|n| n.null_count() > 0);
    Ok(Arc::new(Float64Array::new(values.into(), nulls)))
}

/// Per lane: non-NULL cells, non-finite cells and the sum of the finite
/// values of a frame (no sums when `sum` is empty).
struct Running {
    lanes: usize,
    count: Vec<u32>,
    odd: Vec<u32>,
    sum: Vec<f64>,
}

impl Running {
    fn new(lanes: usize, sums: bool) -> Self {
        Self {
            lanes,
            count: vec![0; lanes],
            odd: vec![0; lanes],
            sum: vec![0.0; if sums { lanes } else { 0 }],
        }
    }

    /// Empties the state, for `lanes` lanes.
    fn reset(&mut self, lanes: usize) {
        self.lanes = lanes;
        self.count[..lanes].fill(0);
        self.odd[..lanes].fill(0);
        if !self.sum.is_empty() {
            self.sum[..lanes].fill(0.0);
        }
    }

    /// Adds (or, `remove`, takes out) the cells of one position, starting
    /// at cell `at` of `lines`.
    fn add(&mut self, lines: &Lines, at: usize, remove: bool) {
        let lanes = self.lanes;
        let flags = &lines.flags[at..at + lanes];
        // Wrapping: adding u32::MAX takes one away.
        let step = if remove { u32::MAX } else { 1 };
        let counts = self.count[..lanes].iter_mut().zip(&mut self.odd[..lanes]);
        for ((count, odd), &flag) in counts.zip(flags) {
            *count = count.wrapping_add(u32::from(flag != MISSING).wrapping_mul(step));
            *odd = odd.wrapping_add(u32::from(flag >= NAN).wrapping_mul(step));
        }
        if !self.sum.is_empty() {
            let values = &lines.values[at..at + lanes];
            let sums = self.sum[..lanes].iter_mut().zip(values);
            if remove {
                sums.for_each(|(s, v)| *s -= v);
            } else {
                sums.for_each(|(s, v)| *s += v);
            }
        }
    }
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
    frame: Frame,
    pick: fn(f64, f64) -> f64,
    none: f64,
    runs: &mut [f64],
) -> usize {
    let len = range.len();
    for (p, t) in range.enumerate() {
        let at = lines.index(o, t, i0);
        let cells = lines.values[at..at + lanes]
            .iter()
            .zip(&lines.flags[at..at + lanes]);
        for (run, (&v, &f)) in runs[p * lanes..(p + 1) * lanes].iter_mut().zip(cells) {
            *run = if f == FINITE { v } else { none };
        }
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
fn exact(op: RollOp, lines: &Lines, frame: Frame, o: usize, t: usize, i: usize) -> f64 {
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
mod tests {
    use super::*;

    /// Each lane's frame, computed naively from the cells' numbers.
    fn naive(
        op: RollOp,
        cells: &[Option<f64>],
        (outer, len, inner): (usize, usize, usize),
        frame: Frame,
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
                    result.push(match op {
                        RollOp::Count => Some(values.len() as f64),
                        _ if values.is_empty() => None,
                        RollOp::Sum => Some(values.iter().sum()),
                        RollOp::Avg => Some(values.iter().sum::<f64>() / values.len() as f64),
                        RollOp::Min => values.iter().copied().min_by(f64::total_cmp),
                        RollOp::Max => values.iter().copied().max_by(f64::total_cmp),
                    });
                }
            }
        }
        result
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
        let array: ArrayRef = Arc::new(Float64Array::from(cells.clone()));
        let mut lines = Lines::new(outer, len, inner);
        lines.put(0, len, 0, &array).unwrap();
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
            let frame = Frame { start, end };
            let lo = frame.before() as usize;
            let hi = len - frame.after() as usize;
            for out in [lo..hi, lo..lo + 1, hi - 1..hi, lo + 1..hi.min(lo + 5)] {
                for op in [
                    RollOp::Count,
                    RollOp::Sum,
                    RollOp::Avg,
                    RollOp::Min,
                    RollOp::Max,
                ] {
                    let want = naive(op, &cells, (outer, len, inner), frame, out.clone());
                    // Tiles of lanes that split the 5 lanes, and one that does not.
                    for tile in [1, 2, 3, TILE] {
                        let got = roll_tiled(op, &lines, frame, out.clone(), tile).unwrap();
                        let got: Vec<Option<f64>> = match op {
                            RollOp::Count => got
                                .as_primitive::<datafusion::arrow::datatypes::Int64Type>()
                                .iter()
                                .map(|v| v.map(|v| v as f64))
                                .collect(),
                            _ => got.as_primitive::<Float64Type>().iter().collect(),
                        };
                        assert_eq!(got.len(), want.len());
                        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                            assert!(
                                close(*g, *w),
                                "{} frame {start}..={end} out {out:?} tile {tile} cell {k}: \
                                 {g:?} != {w:?}",
                                op.name()
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn tails_and_pieces_keep_their_places() {
        let piece: ArrayRef = Arc::new(Float64Array::from(
            (0..12).map(|v| Some(v as f64)).collect::<Vec<_>>(),
        ));
        // 2 outer lanes x 3 positions x 2 inner lanes, put at position 1 of 5.
        let mut lines = Lines::new(2, 5, 2);
        // In two pieces, the second starting inside the first outer lane.
        lines.put(1, 3, 0, &piece.slice(0, 4)).unwrap();
        lines.put(1, 3, 4, &piece.slice(4, 8)).unwrap();
        let tail = lines.tail(5, 3);
        let mut again = Lines::new(2, 3, 2);
        again.put_lines(0, &tail).unwrap();
        // The tail of (o, t) = positions 2..5 of the lines: 1..3 of the piece, then missing.
        let got: Vec<Option<f64>> = (0..12).map(|k| again.value(k)).collect();
        let want = [
            Some(2.0),
            Some(3.0),
            Some(4.0),
            Some(5.0),
            None,
            None,
            Some(8.0),
            Some(9.0),
            Some(10.0),
            Some(11.0),
            None,
            None,
        ];
        assert_eq!(got, want);
        assert!(lines.put(4, 3, 0, &piece).is_err());
        assert!(lines.put(1, 3, 1, &piece).is_err());
        // The tail before position 2: positions 0 (missing) and 1.
        let head = lines.tail(2, 3);
        let got: Vec<Option<f64>> = (0..12).map(|k| head.value(k)).collect();
        assert_eq!(got[..6], [None, None, None, None, Some(0.0), Some(1.0)]);
        assert!(roll(RollOp::Sum, &lines, Frame { start: -2, end: 0 }, 0..3).is_err());
    }
}

//! Running aggregates: frames from the series' first position, SQL's
//! `ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW` (and its default
//! frame with an `ORDER BY`, `RANGE BETWEEN UNBOUNDED PRECEDING AND CURRENT
//! ROW`, along a dimension without ties): numpy's `nancumsum`, xarray's
//! `cumsum` or `cumulative(...).max()`, with SQL's NULL semantics.
//!
//! The frame of position `t` is the frame of `t - 1` and one more cell, so
//! each lane keeps totals ([`RunningState`]: its non-NULL cells, the sum or
//! the extremum of its finite values, and which of NaN, +inf and -inf it
//! has seen) and adds each cell once, whatever the length of the series.
//! The totals go from one box to the next along the dimension; a box that
//! starts a series in its middle (the first box of a task of a cluster's
//! stage) starts from the totals of the positions before it, added from
//! the store by [`add_positions`]. Lanes are taken [`TILE`] at a time, so
//! that their totals stay in cache. NaN is greater than every number (as
//! in DataFusion's order: it wins `max` and loses `min`) and poisons `sum`
//! and `avg`; +inf and -inf together make a sum NaN.

use std::ops::Range;

use datafusion::arrow::array::ArrayRef;
use datafusion::common::{internal_err, Result};

use super::frame::{
    with_values, Lines, RollOp, Rolled, Values, FINITE, MISSING, NAN, NEG_INF, POS_INF, TILE,
};
use crate::zarr::ChunkBufferPool;

/// Which non-finite values a lane has seen: bits of [`RunningState::seen`].
const SAW_NAN: u8 = 1;
const SAW_POS_INF: u8 = 2;
const SAW_NEG_INF: u8 = 4;

/// The totals of one running aggregate over every lane of some lines.
#[derive(Debug, Clone)]
pub struct RunningState {
    /// The last position (of the lines) whose cells the totals hold, `-1`
    /// before the first; `None`: no totals.
    through: Option<i64>,
    /// Non-NULL cells.
    count: Vec<u64>,
    /// The `SAW_*` bits.
    seen: Vec<u8>,
    /// The sum of the finite values (`sum`, `avg`), or their extremum
    /// (`min`: +inf when there is none; `max`: -inf); nothing for `count`.
    value: Vec<f64>,
    /// The buffers of the aggregate's columns, reused block after block.
    outputs: ChunkBufferPool,
}

impl RunningState {
    /// No totals, for lines of `lanes` lanes (outer times inner) and `op`.
    pub fn new(lanes: usize, op: RollOp) -> Self {
        Self {
            through: None,
            count: vec![0; lanes],
            seen: vec![0; lanes],
            value: vec![identity(op); if op == RollOp::Count { 0 } else { lanes }],
            outputs: ChunkBufferPool::new(),
        }
    }

    /// Bytes per lane, at most.
    pub const LANE_BYTES: usize = 17;

    /// Forgets the totals (the lines were filled afresh).
    pub fn forget(&mut self) {
        self.through = None;
    }

    /// Totals of no cell for `op`, as if they held the positions through
    /// `through`: what a series' first box starts from, and what the cells
    /// before a box that starts mid-series are added to.
    pub fn start(&mut self, op: RollOp, through: i64) {
        self.count.fill(0);
        self.seen.fill(0);
        self.value.fill(identity(op));
        self.through = Some(through);
    }

    /// The last position whose cells the totals hold; `None`: no totals.
    pub fn through(&self) -> Option<i64> {
        self.through
    }

    /// Adds the cells of position `at` (their index in `lines`) of lanes
    /// `lane..lane + lanes`.
    fn add(&mut self, op: RollOp, lines: &Lines, at: usize, lane: usize, lanes: usize) {
        let flags = &lines.flags[at..at + lanes];
        let counts = &mut self.count[lane..lane + lanes];
        let mut odd = false;
        for (count, &flag) in counts.iter_mut().zip(flags) {
            *count += u64::from(flag != MISSING);
            odd |= flag >= NAN;
        }
        if odd {
            for (seen, &flag) in self.seen[lane..lane + lanes].iter_mut().zip(flags) {
                *seen |= match flag {
                    NAN => SAW_NAN,
                    POS_INF => SAW_POS_INF,
                    NEG_INF => SAW_NEG_INF,
                    _ => 0,
                };
            }
        }
        let totals = self.value.get_mut(lane..lane + lanes).unwrap_or_default();
        with_values!(&lines.values, values => add_values(op, totals, &values[at..at + lanes], flags))
    }

    /// The aggregate of lane `lane`'s totals; `None` when it has no value.
    fn finish(&self, op: RollOp, lane: usize) -> Option<f64> {
        let (count, seen) = (self.count[lane], self.seen[lane]);
        if count == 0 {
            return None;
        }
        let value = self.value.get(lane).copied().unwrap_or(0.0);
        Some(match op {
            RollOp::Sum | RollOp::Avg => {
                let mut sum = value;
                if seen & SAW_POS_INF != 0 {
                    sum += f64::INFINITY;
                }
                if seen & SAW_NEG_INF != 0 {
                    sum += f64::NEG_INFINITY;
                }
                if seen & SAW_NAN != 0 {
                    sum = f64::NAN;
                }
                if op == RollOp::Avg {
                    sum / count as f64
                } else {
                    sum
                }
            }
            RollOp::Min if seen & SAW_NEG_INF != 0 => f64::NEG_INFINITY,
            RollOp::Min if value < f64::INFINITY => value,
            RollOp::Min if seen & SAW_POS_INF != 0 => f64::INFINITY,
            RollOp::Max if seen & SAW_NAN != 0 => f64::NAN,
            RollOp::Max if seen & SAW_POS_INF != 0 => f64::INFINITY,
            RollOp::Max if value > f64::NEG_INFINITY => value,
            RollOp::Max => f64::NEG_INFINITY,
            // Only NaN (min).
            RollOp::Min => f64::NAN,
            RollOp::Count => count as f64,
        })
    }
}

/// Adds `values` (their kinds `flags`) to the totals of `op`.
fn add_values<T: Copy + Into<f64>>(op: RollOp, totals: &mut [f64], values: &[T], flags: &[u8]) {
    match op {
        // Non-finite and missing cells hold 0.
        RollOp::Sum | RollOp::Avg => {
            for (total, &v) in totals.iter_mut().zip(values) {
                *total += v.into();
            }
        }
        RollOp::Min => {
            for (total, (&v, &flag)) in totals.iter_mut().zip(values.iter().zip(flags)) {
                let v = if flag == FINITE {
                    v.into()
                } else {
                    f64::INFINITY
                };
                *total = total.min(v);
            }
        }
        RollOp::Max => {
            for (total, (&v, &flag)) in totals.iter_mut().zip(values.iter().zip(flags)) {
                let v = if flag == FINITE {
                    v.into()
                } else {
                    f64::NEG_INFINITY
                };
                *total = total.max(v);
            }
        }
        RollOp::Count => {}
    }
}

/// The totals of no value.
fn identity(op: RollOp) -> f64 {
    match op {
        RollOp::Min => f64::INFINITY,
        RollOp::Max => f64::NEG_INFINITY,
        _ => 0.0,
    }
}

/// Adds the cells of positions `positions` of `lines` to the totals
/// (their [`through`](RunningState::through) is left as it is: the
/// positions are not the series', as when the cells before a box are read
/// into lines of their own).
pub fn add_positions(
    op: RollOp,
    lines: &Lines,
    positions: Range<usize>,
    state: &mut RunningState,
) -> Result<()> {
    let lanes = lines.outer * lines.inner;
    if state.count.len() != lanes || positions.len() > lines.len || state.through.is_none() {
        return internal_err!(
            "running totals of {} lanes (started: {}) over positions {positions:?} of lines of \
             {lanes} lanes and {} positions",
            state.count.len(),
            state.through.is_some(),
            lines.len
        );
    }
    for o in 0..lines.outer {
        for t in positions.clone() {
            for i0 in (0..lines.inner).step_by(TILE) {
                let n = TILE.min(lines.inner - i0);
                state.add(op, lines, lines.index(o, t, i0), o * lines.inner + i0, n);
            }
        }
    }
    Ok(())
}

/// `op` over each lane's frame for positions `out`: the cells from the
/// series' first position to `t + end`. A column of `outer x out.len() x
/// inner` cells in C order (`count`: `int64`, else `float64`), its
/// positions in reverse order when `reversed` (a box walked backward,
/// given back in grid order). The totals
/// must hold the cells through position `out.start - 1 + end`, or through
/// up to `end` positions before it when `end > 0` (a series' first box, or
/// one started mid-series), and the lines the cells after that up to
/// `out.end - 1 + end`. The totals are left through `out.end - 1 + end`.
pub fn accumulate(
    op: RollOp,
    lines: &Lines,
    (end, out): (i64, Range<usize>),
    state: &mut RunningState,
    reversed: bool,
) -> Result<ArrayRef> {
    let lanes_held = lines.outer * lines.inner;
    let target = out.start as i64 - 1 + end;
    let last = out.end as i64 - 1 + end;
    let from = state.through;
    let fits = from.is_some_and(|through| {
        (target - end.max(0)..=target).contains(&through)
            && through >= -1
            && last - through <= lines.len as i64
    });
    if !fits || state.count.len() != lanes_held || state.seen.len() != lanes_held {
        return internal_err!(
            "running totals through {from:?} of {} lanes for positions {out:?} of a frame ending \
             at {end:+}, over lines of {lanes_held} lanes and {} positions",
            state.count.len(),
            lines.len
        );
    }
    let through = from.unwrap_or(target);
    let (inner, width) = (lines.inner, out.len());
    let count_only = op == RollOp::Count;
    let mut column = Rolled::new(op, lines.outer * width * inner, &state.outputs);
    for o in 0..lines.outer {
        for i0 in (0..inner).step_by(TILE) {
            let lanes = TILE.min(inner - i0);
            let lane = o * inner + i0;
            for p in through + 1..=target {
                state.add(op, lines, lines.index(o, p as usize, i0), lane, lanes);
            }
            for (w, t) in out.clone().enumerate() {
                let p = (t as i64 + end) as usize;
                state.add(op, lines, lines.index(o, p, i0), lane, lanes);
                let at = (o * width + w) * inner + i0;
                if count_only {
                    let cells = column.counts[at..at + lanes].iter_mut();
                    for (c, &k) in cells.zip(&state.count[lane..lane + lanes]) {
                        *c = k as i64;
                    }
                    continue;
                }
                // Lanes of finite values only: their total (or mean) as it
                // is; others through `finish`.
                let avg = op == RollOp::Avg;
                let lane_counts = &state.count[lane..lane + lanes];
                let lane_seen = &state.seen[lane..lane + lanes];
                let lane_values = &state.value[lane..lane + lanes];
                let cells = column.values()[at..at + lanes].iter_mut().zip(lane_values);
                let mut odd = false;
                for ((cell, &v), (&c, &seen)) in cells.zip(lane_counts.iter().zip(lane_seen)) {
                    *cell = if avg { v / c as f64 } else { v };
                    odd |= c == 0 || seen != 0;
                }
                if odd {
                    for k in 0..lanes {
                        if lane_counts[k] == 0 || lane_seen[k] != 0 {
                            match state.finish(op, lane + k) {
                                Some(v) => column.values()[at + k] = v,
                                None => column.valid()[at + k] = false,
                            }
                        }
                    }
                }
            }
        }
    }
    if !out.is_empty() {
        state.through = Some(last);
    }
    Ok(column.finish(reversed.then_some([lines.outer, width, inner])))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use datafusion::arrow::array::Float64Array;

    use super::super::frame::tests::{aggregate_of, numbers, OPS};
    use super::*;

    /// Each lane's running aggregate through `t + end`, from the cells'
    /// numbers (in order, as DataFusion's window adds them).
    fn naive(
        op: RollOp,
        cells: &[Option<f64>],
        (outer, len, inner): (usize, usize, usize),
        end: i64,
        t: usize,
    ) -> Vec<Option<f64>> {
        let mut result = Vec::new();
        for o in 0..outer {
            for i in 0..inner {
                let last = (t as i64 + end).min(len as i64 - 1);
                let values: Vec<f64> = (0..=last)
                    .filter_map(|p| cells[(o * len + p as usize) * inner + i])
                    .collect();
                result.push(aggregate_of(op, &values));
            }
        }
        result
    }

    fn same(a: Option<f64>, b: Option<f64>) -> bool {
        match (a, b) {
            (Some(a), Some(b)) => a == b || (a.is_nan() && b.is_nan()),
            (a, b) => a == b,
        }
    }

    /// `outer x len x inner` cells with gaps, NaN and infinities in some
    /// lanes, from `seed`.
    fn cells(outer: usize, len: usize, inner: usize, seed: usize) -> Vec<Option<f64>> {
        (0..outer * len * inner)
            .map(|k| {
                let x = (((k + seed) * 7919) % 1000) as f64 / 10.0 - 50.0;
                match (k + seed) % 41 {
                    0 | 5 | 11 => None,
                    19 if k % 3 == 0 => Some(f64::NAN),
                    23 if k % 2 == 0 => Some(f64::INFINITY),
                    29 if k % 5 == 0 => Some(f64::NEG_INFINITY),
                    _ => Some(x),
                }
            })
            .collect()
    }

    /// Lines holding `cells` (`outer x len x inner`) at positions
    /// `shift..shift + len`, missing around them.
    fn lines_of(
        cells: &[Option<f64>],
        (outer, len, inner): (usize, usize, usize),
        shift: usize,
    ) -> Lines {
        let mut lines = Lines::new(outer, len + 2 * shift, inner);
        let array: ArrayRef = Arc::new(Float64Array::from(cells.to_vec()));
        lines.put(shift, len, 0, &array).unwrap();
        lines
    }

    #[test]
    fn running_totals_equal_the_naive_aggregate_in_runs_and_from_the_middle() {
        let shape @ (outer, len, inner) = (2usize, 19usize, 5usize);
        let cells = cells(outer, len, inner, 3);
        // The series at positions 4..23 of lines of 27: 4 missing before
        // and after, for frames ending up to 4 before or after `t`.
        let shift = 4;
        let lines = lines_of(&cells, shape, shift);
        for end in [-3i64, -1, 0, 2, 4] {
            for op in OPS {
                // From the series' start, in runs of 1, 5 and the rest.
                let mut state = RunningState::new(outer * inner, op);
                state.start(op, shift as i64 - 1 + end.min(0));
                let runs = [0..1, 1..6, 6..len];
                for run in runs {
                    let out = run.start + shift..run.end + shift;
                    let got =
                        numbers(&accumulate(op, &lines, (end, out), &mut state, false).unwrap());
                    for (w, t) in run.clone().enumerate() {
                        let want = naive(op, &cells, shape, end, t);
                        for o in 0..outer {
                            for i in 0..inner {
                                let (g, x) =
                                    (got[(o * run.len() + w) * inner + i], want[o * inner + i]);
                                assert!(
                                    same(g, x),
                                    "{} end {end:+} t {t} lane ({o}, {i}): {g:?} != {x:?}",
                                    op.name()
                                );
                            }
                        }
                    }
                }
                // From the middle: the positions before position 9's first
                // new cell added from lines of their own, then 9.. rolled.
                let from = 9usize;
                let before = (from as i64 + end.min(0)).max(0) as usize;
                let head: Vec<Option<f64>> = (0..outer)
                    .flat_map(|o| cells[o * len * inner..(o * len + before) * inner].to_vec())
                    .collect();
                let mut state = RunningState::new(outer * inner, op);
                let at = from + shift;
                state.start(op, at as i64 - 1 + end.min(0));
                if before > 0 {
                    let own = lines_of(&head, (outer, before, inner), 0);
                    add_positions(op, &own, 0..before, &mut state).unwrap();
                }
                let got =
                    accumulate(op, &lines, (end, at..len + shift), &mut state, false).unwrap();
                let got = numbers(&got);
                let width = len - from;
                for t in from..len {
                    let want = naive(op, &cells, shape, end, t);
                    for o in 0..outer {
                        for i in 0..inner {
                            let g = got[(o * width + t - from) * inner + i];
                            assert!(
                                same(g, want[o * inner + i]),
                                "{} from the middle",
                                op.name()
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn totals_out_of_step_with_the_positions_are_refused() {
        let shape @ (outer, len, inner) = (1usize, 6usize, 2usize);
        let lines = lines_of(&cells(outer, len, inner, 0), shape, 0);
        let mut state = RunningState::new(2, RollOp::Sum);
        // Not started.
        assert!(accumulate(RollOp::Sum, &lines, (0, 0..2), &mut state, false).is_err());
        assert!(add_positions(RollOp::Sum, &lines, 0..2, &mut state).is_err());
        // Started through position 0: positions 2.. would skip position 1.
        state.start(RollOp::Sum, 0);
        assert!(accumulate(RollOp::Sum, &lines, (0, 2..4), &mut state, false).is_err());
        // Of other lanes; more positions than the lines hold.
        let mut other = RunningState::new(3, RollOp::Sum);
        other.start(RollOp::Sum, -1);
        assert!(accumulate(RollOp::Sum, &lines, (0, 0..2), &mut other, false).is_err());
        assert!(add_positions(RollOp::Sum, &lines, 0..7, &mut state).is_err());
        // In step: through 1 (and no position before the first: -1).
        state.start(RollOp::Sum, 1);
        assert!(accumulate(RollOp::Sum, &lines, (0, 2..4), &mut state, false).is_ok());
        assert_eq!(state.through(), Some(3));
        state.forget();
        assert_eq!(state.through(), None);
    }
}

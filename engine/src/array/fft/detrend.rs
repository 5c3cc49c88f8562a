//! Trends removed before a forward transform, as xrft removes them: the
//! mean over the transformed dimensions (`constant`), or the least-squares
//! line along one dimension or plane over two (`linear`, in index
//! positions, as `scipy.signal.detrend` and xrft's 2-D fit do).
//!
//! A block holds whole lines along the transformed axes, so every group of
//! cells sharing the other axes' positions is detrended on its own; where
//! a block does not hold whole groups, [`TrendSums`] gathers a group's fit
//! piece by piece (see [`super::source::detrended`]).

use rustfft::num_complex::Complex;
use rustfft::num_traits::Float;
use rustfft::FftNum;

use super::options::Detrend;
use crate::device::fft_cpu::BlockValues;

/// Removes `detrend` over `axes` of `values` (shape `shape`). Linear
/// trends take one or two axes (refused before, when the plan is made).
pub fn detrend_block<T: FftNum + Float>(
    values: &mut BlockValues<T>,
    shape: &[usize],
    axes: &[usize],
    detrend: Detrend,
) {
    let narrow = |x: f64| T::from_f64(x).unwrap_or_else(T::nan);
    let wide = |x: T| x.to_f64().unwrap_or(f64::NAN);
    match values {
        BlockValues::Real(v) => detrend_values(
            v,
            shape,
            axes,
            detrend,
            |x| Complex::new(wide(x), 0.0),
            |x, fit| x - narrow(fit.re),
        ),
        BlockValues::Complex(v) => detrend_values(
            v,
            shape,
            axes,
            detrend,
            |x| Complex::new(wide(x.re), wide(x.im)),
            |x, fit| Complex::new(x.re - narrow(fit.re), x.im - narrow(fit.im)),
        ),
    }
}

/// The cells of `shape` in C order, each with its group (the index of its
/// positions along the axes not in `axes`) and its positions along `axes`.
fn for_each_cell(shape: &[usize], axes: &[usize], mut f: impl FnMut(usize, usize, &[usize])) {
    let rank = shape.len();
    let mut index = vec![0usize; rank];
    let mut along = vec![0usize; axes.len()];
    let total: usize = shape.iter().product();
    for cell in 0..total {
        let mut group = 0;
        for d in 0..rank {
            match axes.iter().position(|&a| a == d) {
                Some(i) => along[i] = index[d],
                None => group = group * shape[d] + index[d],
            }
        }
        f(cell, group, &along);
        for d in (0..rank).rev() {
            index[d] += 1;
            if index[d] < shape[d] {
                break;
            }
            index[d] = 0;
        }
    }
}

/// Removes the trend from `values`, read as complex `f64` by `widen` and
/// written back by `minus(value, fit)`.
fn detrend_values<V: Copy>(
    values: &mut [V],
    shape: &[usize],
    axes: &[usize],
    detrend: Detrend,
    widen: impl Fn(V) -> Complex<f64>,
    minus: impl Fn(V, Complex<f64>) -> V,
) {
    let groups: usize = (0..shape.len())
        .filter(|d| !axes.contains(d))
        .map(|d| shape[d])
        .product();
    let lengths: Vec<usize> = axes.iter().map(|&a| shape[a]).collect();
    let cells_per_group: usize = lengths.iter().product();
    let linear = detrend == Detrend::Linear;
    // Per group: the sum of values, and of values times each centred position.
    let slopes = if linear { axes.len() } else { 0 };
    let zero = Complex::new(0.0, 0.0);
    let mut sums = vec![zero; groups * (1 + slopes)];
    for_each_cell(shape, axes, |cell, group, along| {
        let v = widen(values[cell]);
        let s = &mut sums[group * (1 + slopes)..(group + 1) * (1 + slopes)];
        s[0] += v;
        for (i, &p) in along.iter().enumerate().take(slopes) {
            s[1 + i] += v * centred(p, lengths[i]);
        }
    });
    // Sum of squared centred positions along each axis, over a group.
    let squares: Vec<f64> = lengths
        .iter()
        .map(|&n| {
            let per_line: f64 = (0..n).map(|i| centred(i, n).powi(2)).sum();
            per_line * (cells_per_group / n) as f64
        })
        .collect();
    for_each_cell(shape, axes, |cell, group, along| {
        let s = &sums[group * (1 + slopes)..(group + 1) * (1 + slopes)];
        let mut fit = s[0] / cells_per_group as f64;
        for (i, &p) in along.iter().enumerate().take(slopes) {
            if squares[i] > 0.0 {
                fit += s[1 + i] / squares[i] * centred(p, lengths[i]);
            }
        }
        values[cell] = minus(values[cell], fit);
    });
}

/// The position `i` of a line of length `n` centred on the line's mean
/// position: on a full grid the intercept and the slope of a
/// least-squares fit are then independent.
fn centred(i: usize, n: usize) -> f64 {
    i as f64 - (n as f64 - 1.0) / 2.0
}

/// The sums a detrend fits over one group of cells (the cells sharing
/// their positions along the other dimensions), gathered piece by piece
/// where a group does not fit in one block (the four-step path, staged
/// transforms): Σ x, and Σ x·c(p) along each of the (at most two)
/// transformed dimensions a linear trend takes, `c` the centred position.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TrendSums {
    total: Complex<f64>,
    moments: [Complex<f64>; 2],
}

impl TrendSums {
    /// Adds `value`, at `positions` along the transformed dimensions
    /// (whose lengths are `lengths`).
    pub fn add(&mut self, value: Complex<f64>, positions: &[usize], lengths: &[usize]) {
        self.total += value;
        for (moment, (&p, &n)) in self.moments.iter_mut().zip(positions.iter().zip(lengths)) {
            *moment += value * centred(p, n);
        }
    }

    /// The sums as six numbers (Σ x, then Σ x·c(p) along each
    /// dimension; real part, imaginary part), as they travel between a
    /// cluster's tasks.
    pub fn parts(&self) -> [f64; 6] {
        let [a, b] = self.moments;
        let t = self.total;
        [t.re, t.im, a.re, a.im, b.re, b.im]
    }

    /// The sums [`Self::parts`] gave.
    pub fn from_parts([t_re, t_im, a_re, a_im, b_re, b_im]: [f64; 6]) -> Self {
        Self {
            total: Complex::new(t_re, t_im),
            moments: [Complex::new(a_re, a_im), Complex::new(b_re, b_im)],
        }
    }

    /// Adds the sums of another piece of the same group.
    pub fn merge(&mut self, other: &TrendSums) {
        self.total += other.total;
        for (moment, other) in self.moments.iter_mut().zip(&other.moments) {
            *moment += other;
        }
    }

    /// The trend `detrend` removes at `positions` of the group (of
    /// `lengths`), as [`detrend_block`] removes it from a whole group.
    pub fn fit(&self, detrend: Detrend, positions: &[usize], lengths: &[usize]) -> Complex<f64> {
        let cells: f64 = lengths.iter().map(|&n| n as f64).product();
        let mut fit = self.total / cells;
        if detrend == Detrend::Linear {
            for (moment, (&p, &n)) in self.moments.iter().zip(positions.iter().zip(lengths)) {
                if n > 1 {
                    // Σ c(p)² over the group: per line, times its lines.
                    let n = n as f64;
                    let squares = n * (n * n - 1.0) / 12.0 * (cells / n);
                    fit += moment * (centred(p, n as usize) / squares);
                }
            }
        }
        fit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plane_is_removed_exactly() {
        // shape (time 2, y 3, x 4): a plane over (y, x) per time, plus a constant.
        let shape = [2usize, 3, 4];
        let mut values = Vec::new();
        for t in 0..2 {
            for y in 0..3 {
                for x in 0..4 {
                    values.push(5.0 * t as f64 + 2.0 * y as f64 - 0.5 * x as f64 + 1.0);
                }
            }
        }
        let mut block = BlockValues::Real(values);
        detrend_block(&mut block, &shape, &[1, 2], Detrend::Linear);
        let BlockValues::Real(v) = block else {
            unreachable!()
        };
        assert!(v.iter().all(|x| x.abs() < 1e-12), "{v:?}");
    }

    #[test]
    fn constant_removes_each_groups_mean() {
        // shape (x 3, t 2), detrended along x: each column loses its mean.
        let mut block = BlockValues::Real(vec![1.0f32, 10.0, 2.0, 20.0, 6.0, 30.0]);
        detrend_block(&mut block, &[3, 2], &[0], Detrend::Constant);
        let BlockValues::Real(v) = block else {
            unreachable!()
        };
        assert_eq!(v, [-2.0, -10.0, -1.0, 0.0, 3.0, 10.0]);
    }

    #[test]
    fn sums_gathered_in_pieces_remove_what_a_whole_group_detrend_removes() {
        // shape (y 5, x 7) detrended over both, and along x alone (groups
        // of y), the cells added in an order no block would read them.
        let shape = [5usize, 7];
        let values: Vec<Complex<f64>> = (0..35)
            .map(|i| {
                let (y, x) = ((i / 7) as f64, (i % 7) as f64);
                Complex::new((i as f64 * 0.7).sin() + 0.3 * x - 0.2 * y, (i as f64).cos())
            })
            .collect();
        for detrend in [Detrend::Constant, Detrend::Linear] {
            for axes in [vec![0usize, 1], vec![1]] {
                let mut whole = BlockValues::Complex(values.clone());
                detrend_block(&mut whole, &shape, &axes, detrend);
                let BlockValues::Complex(want) = whole else {
                    unreachable!()
                };
                let lengths: Vec<usize> = axes.iter().map(|&a| shape[a]).collect();
                let group = |i: usize| if axes.len() == 2 { 0 } else { i / 7 };
                let positions = |i: usize| -> Vec<usize> {
                    axes.iter()
                        .map(|&a| if a == 0 { i / 7 } else { i % 7 })
                        .collect()
                };
                let mut sums = vec![TrendSums::default(); 5];
                for piece in (0..35).collect::<Vec<_>>().chunks(6).rev() {
                    let mut part = vec![TrendSums::default(); 5];
                    for &i in piece {
                        part[group(i)].add(values[i], &positions(i), &lengths);
                    }
                    for (s, p) in sums.iter_mut().zip(&part) {
                        s.merge(p);
                    }
                }
                for i in 0..35 {
                    let got = values[i] - sums[group(i)].fit(detrend, &positions(i), &lengths);
                    assert!(
                        (got - want[i]).norm() < 1e-12,
                        "{detrend:?} {axes:?} at {i}: {got} != {}",
                        want[i]
                    );
                }
            }
        }
    }
}

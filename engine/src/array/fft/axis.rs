//! One transformed dimension: the output coordinates xrft gives it and the
//! kernel pass that computes it.
//!
//! Everything xrft does per dimension is a reordering or a factor per
//! position, so it folds into an [`AxisPass`]: the input flip of a
//! descending coordinate and the `ifftshift` of `true_phase` become the
//! pass's gather order, windows and inverse phases its input factors, the
//! output `fftshift` its take order, and forward phases, spacings and the
//! `1/n` of inverse transforms its output factors. Each is a formula of
//! the position ([`AxisTransform::gather`], [`AxisTransform::pre`],
//! [`AxisTransform::take`], [`AxisTransform::post`],
//! [`AxisTransform::coord`]): whole-line transforms tabulate them into a
//! pass, the four-step path evaluates them a block at a time.

use std::f64::consts::PI;
use std::sync::Arc;

use rustfft::num_complex::Complex;
use rustfft::FftNum;

use super::options::FftOptions;
use super::window::Window;
use crate::device::{AxisPass, LineKind};
use crate::table::{Coordinate, CoordinateFormula};

/// A transformed dimension (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct AxisTransform {
    /// The input dimension.
    pub dim: String,
    /// The output dimension (`freq_<dim>` forward, `<dim>` without the
    /// prefix back).
    pub output_name: String,
    /// The transform.
    pub kind: LineKind,
    /// The transform's length (see [`AxisPass::len`]).
    pub len: usize,
    /// The output coordinate's spacing (xrft's `spacing` attribute).
    pub spacing: f64,
    /// Forward: the input coordinate's lag (xrft's `direct_lag` attribute
    /// of the output); inverse: the lag added to the output coordinate.
    pub lag: f64,
    positions: Positions,
}

/// How an inverse transform's input coordinate is ordered: the order that
/// sorts it.
#[derive(Debug, Clone, PartialEq)]
enum InputOrder {
    /// Increasing (shifted frequencies).
    Increasing,
    /// `fftfreq` order (unshifted frequencies): sorted by `fftshift`.
    Unshifted,
    /// Decreasing.
    Decreasing,
    /// Any other order, as the positions that sort it.
    Sorted(Arc<Vec<usize>>),
}

impl InputOrder {
    /// The position of the `rank`-th smallest coordinate value.
    #[inline]
    fn position(&self, rank: usize, n: usize) -> usize {
        match self {
            Self::Increasing => rank,
            Self::Unshifted => fftshift_source(rank, n),
            Self::Decreasing => n - 1 - rank,
            Self::Sorted(order) => order[rank],
        }
    }
}

/// The per-position formulas of a transformed dimension.
#[derive(Debug, Clone, PartialEq)]
enum Positions {
    Forward {
        /// Input length.
        n: usize,
        /// The input coordinate's spacing (positive).
        delta: f64,
        descending: bool,
        true_phase: bool,
        true_amplitude: bool,
        /// Whether the output is `fftshift`ed.
        shift: bool,
        window: Option<Window>,
    },
    Inverse {
        /// Input length.
        n: usize,
        /// The input coordinate's spacing (positive) and smallest value.
        delta: f64,
        lowest: f64,
        order: InputOrder,
        true_phase: bool,
        shift: bool,
        /// The output factor (`1/n`, over the spacing for `true_amplitude`).
        scale: f64,
    },
}

/// Value `i` of `numpy.fft.fftfreq(n, d)`, computed as numpy does (an
/// integer times `1 / (n d)`), so coordinates match to the last bit.
#[inline]
fn fftfreq_at(i: usize, n: usize, d: f64) -> f64 {
    let step = 1.0 / (n as f64 * d);
    let k = if i < n.div_ceil(2) {
        i as f64
    } else {
        i as f64 - n as f64
    };
    k * step
}

/// Position `q` of `fftshift(x)` is `x[fftshift_source(q, n)]`.
#[inline]
fn fftshift_source(q: usize, n: usize) -> usize {
    (q + n - n / 2) % n
}

/// Position `q` of `ifftshift(x)` is `x[ifftshift_source(q, n)]`.
#[inline]
fn ifftshift_source(q: usize, n: usize) -> usize {
    (q + n / 2) % n
}

/// Whether the differences of the `n` values `value(0..n)` are all within
/// `tol` (relative, numpy's `allclose` with its absolute 1e-8) of
/// `reference`.
fn evenly_spaced_by(n: usize, value: impl Fn(usize) -> f64, reference: f64, tol: f64) -> bool {
    (1..n).all(|i| ((value(i) - value(i - 1)) - reference).abs() <= 1e-8 + tol * reference.abs())
}

/// xrft's lag of the `n` values `coords(0..n)`: their middle value once in
/// increasing order.
fn lag_of(n: usize, coords: impl Fn(usize) -> f64) -> f64 {
    if coords(n - 1) > coords(0) {
        coords(n / 2)
    } else {
        coords(n - 1 - n / 2)
    }
}

/// A coordinate's value at a position, as a number: held `Float64`
/// values, a numeric formula's, the index, or computed ones (no copy of
/// any).
fn numbers(coords: &Coordinate) -> Result<Box<dyn Fn(usize) -> f64 + '_>, String> {
    use datafusion::arrow::array::AsArray;
    use datafusion::arrow::datatypes::Float64Type;
    Ok(match coords {
        Coordinate::Values(values) => {
            let values = values.as_primitive_opt::<Float64Type>().ok_or_else(|| {
                format!("coordinate values are {}, not Float64", values.data_type())
            })?;
            Box::new(move |i| values.value(i))
        }
        Coordinate::Regular(regular) if regular.data_type().is_numeric() => {
            Box::new(move |i| regular.number_at(i as u64))
        }
        Coordinate::Regular(regular) => {
            return Err(format!(
                "coordinate values are {}, not numbers",
                regular.data_type()
            ))
        }
        Coordinate::Index(_) => Box::new(|i| i as f64),
        Coordinate::Computed(formula) => Box::new(move |i| formula.value_at(i as u64)),
    })
}

/// The output coordinate, computed per position (see [`AxisTransform::coord`]).
impl CoordinateFormula for AxisTransform {
    fn positions(&self) -> u64 {
        self.output_len() as u64
    }
    fn value_at(&self, position: u64) -> f64 {
        self.coord(position as usize)
    }
}

impl AxisTransform {
    /// The forward transform (`xrft.fft`) of dimension `dim` with
    /// coordinate `coordinate` (numbers), real (`rfft`) when `real`.
    pub fn forward(
        dim: &str,
        coordinate: &Coordinate,
        real: bool,
        options: &FftOptions,
    ) -> Result<Self, String> {
        let n = coordinate.len() as usize;
        let coords = numbers(coordinate)?;
        if n < 2 {
            return Err(format!(
                "dimension '{dim}' has {n} point{}; a transform needs at least 2 to know the \
                 spacing",
                if n == 1 { "" } else { "s" }
            ));
        }
        let first = coords(1) - coords(0);
        // The index is evenly spaced by construction (and may be long).
        let index = matches!(coordinate, Coordinate::Index(_));
        if !index && !evenly_spaced_by(n, &coords, first, options.spacing_tol) {
            return Err(format!(
                "coordinate '{dim}' is not evenly spaced (spacing_tol {})",
                options.spacing_tol
            ));
        }
        let delta = first.abs();
        if delta == 0.0 || !delta.is_finite() {
            return Err(format!("coordinate '{dim}' has spacing {delta}"));
        }
        let kind = if real {
            LineKind::RealForward
        } else {
            LineKind::Forward
        };
        let mut axis = Self {
            dim: dim.to_string(),
            output_name: options.output_name(dim),
            kind,
            len: n,
            spacing: f64::NAN,
            lag: lag_of(n, &coords),
            positions: Positions::Forward {
                n,
                delta,
                descending: coords(n - 1) < coords(0),
                true_phase: options.true_phase,
                true_amplitude: options.true_amplitude,
                // xrft never shifts a transform with a real dimension.
                shift: options.shift && options.real_dim.is_none(),
                window: options.window,
            },
        };
        axis.spacing = axis.coord(1) - axis.coord(0);
        Ok(axis)
    }

    /// The inverse transform (`xrft.ifft`) of frequency dimension `dim`
    /// with coordinate `coordinate` (numbers in increasing or `fftfreq`
    /// order, centred on zero), real (`irfft`) when `real`, its output
    /// coordinate offset by `lag`.
    pub fn inverse(
        dim: &str,
        coordinate: &Coordinate,
        real: bool,
        lag: f64,
        options: &FftOptions,
    ) -> Result<Self, String> {
        let n = coordinate.len() as usize;
        let coords = numbers(coordinate)?;
        if n < 2 {
            return Err(format!(
                "dimension '{dim}' has {n} point{}; a transform needs at least 2",
                if n == 1 { "" } else { "s" }
            ));
        }
        let delta = (coords(1) - coords(0)).abs();
        let tol = options.spacing_tol;
        // xrft sorts a coordinate that is not evenly increasing (an
        // unshifted or descending frequency axis) and checks it again.
        let order = if evenly_spaced_by(n, &coords, delta, tol) {
            InputOrder::Increasing
        } else if evenly_spaced_by(n, |i| coords(fftshift_source(i, n)), delta, tol) {
            InputOrder::Unshifted
        } else if evenly_spaced_by(n, |i| coords(n - 1 - i), delta, tol) {
            InputOrder::Decreasing
        } else {
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| coords(a).total_cmp(&coords(b)));
            let step = coords(order[1]) - coords(order[0]);
            if !evenly_spaced_by(n, |i| coords(order[i]), step, tol) {
                return Err(format!(
                    "coordinate '{dim}' is not evenly spaced (spacing_tol {tol})"
                ));
            }
            InputOrder::Sorted(Arc::new(order))
        };
        let sorted = |i: usize| coords(order.position(i, n));
        let centre = if real && order == InputOrder::Increasing {
            coords(0)
        } else {
            sorted(n / 2)
        };
        if centre.abs() > tol {
            return Err(format!(
                "coordinate '{dim}' is not centred on zero frequency (its middle is {centre})"
            ));
        }
        if delta == 0.0 || !delta.is_finite() {
            return Err(format!("coordinate '{dim}' has spacing {delta}"));
        }
        let (kind, len) = if real {
            (LineKind::RealInverse, 2 * (n - 1))
        } else {
            (LineKind::Inverse, n)
        };
        let m = len;
        let first = fftfreq_at(
            if options.shift {
                fftshift_source(0, m)
            } else {
                0
            },
            m,
            delta,
        );
        let second = fftfreq_at(
            if options.shift {
                fftshift_source(1, m)
            } else {
                1
            },
            m,
            delta,
        );
        let spacing = second - first;
        let mut scale = 1.0 / m as f64;
        if options.true_amplitude {
            scale /= spacing;
        }
        Ok(Self {
            dim: dim.to_string(),
            output_name: options.output_name(dim),
            kind,
            len,
            spacing,
            lag,
            positions: Positions::Inverse {
                n,
                delta,
                lowest: sorted(0),
                order,
                true_phase: options.true_phase,
                shift: options.shift,
                scale,
            },
        })
    }

    /// The number of input positions.
    pub fn input_len(&self) -> usize {
        self.kind.lengths(self.len).0
    }

    /// The number of output positions.
    pub fn output_len(&self) -> usize {
        self.kind.lengths(self.len).1
    }

    /// The input position the transform reads at its position `k`.
    #[inline]
    pub fn gather(&self, k: usize) -> usize {
        match &self.positions {
            Positions::Forward {
                n,
                descending,
                true_phase,
                ..
            } => {
                if !true_phase {
                    return k;
                }
                let p = ifftshift_source(k, *n);
                if *descending {
                    n - 1 - p
                } else {
                    p
                }
            }
            Positions::Inverse { n, order, .. } => order.position(self.inverse_rank(k), *n),
        }
    }

    /// The rank (in increasing coordinate order) of the input an inverse
    /// transform reads at its position `k`.
    #[inline]
    fn inverse_rank(&self, k: usize) -> usize {
        match &self.positions {
            Positions::Inverse { n, .. } if self.kind == LineKind::Inverse => {
                ifftshift_source(k, *n)
            }
            _ => k,
        }
    }

    /// Whether the transform's inputs have factors.
    pub fn has_pre(&self) -> bool {
        match &self.positions {
            Positions::Forward { window, .. } => window.is_some(),
            Positions::Inverse { true_phase, .. } => *true_phase,
        }
    }

    /// The factor of the transform's input at its position `k` (one when
    /// there are none).
    pub fn pre(&self, k: usize) -> Complex<f64> {
        match &self.positions {
            Positions::Forward {
                n, window: Some(w), ..
            } => Complex::new(w.value(self.gather(k), *n), 0.0),
            Positions::Inverse {
                delta,
                lowest,
                true_phase: true,
                ..
            } => {
                let frequency = lowest + self.inverse_rank(k) as f64 * delta;
                Complex::from_polar(1.0, 2.0 * PI * frequency * self.lag)
            }
            _ => Complex::new(1.0, 0.0),
        }
    }

    /// The transform output that output position `q` takes.
    #[inline]
    pub fn take(&self, q: usize) -> usize {
        let m = self.output_len();
        match &self.positions {
            Positions::Forward { shift, .. } => {
                if *shift {
                    fftshift_source(q, m)
                } else {
                    q
                }
            }
            Positions::Inverse {
                shift, true_phase, ..
            } => {
                let q = if *shift { fftshift_source(q, m) } else { q };
                if *true_phase {
                    q
                } else {
                    ifftshift_source(q, m)
                }
            }
        }
    }

    /// Whether the outputs have factors.
    pub fn has_post(&self) -> bool {
        match &self.positions {
            Positions::Forward {
                true_phase,
                true_amplitude,
                ..
            } => *true_phase || *true_amplitude,
            Positions::Inverse { .. } => true,
        }
    }

    /// The factor of output position `q` (one when there are none).
    pub fn post(&self, q: usize) -> Complex<f64> {
        match &self.positions {
            Positions::Forward {
                delta,
                true_phase,
                true_amplitude,
                ..
            } => {
                let amplitude = if *true_amplitude { *delta } else { 1.0 };
                let phase = if *true_phase {
                    -2.0 * PI * self.coord(q) * self.lag
                } else {
                    0.0
                };
                Complex::from_polar(amplitude, phase)
            }
            Positions::Inverse { scale, .. } => Complex::new(*scale, 0.0),
        }
    }

    /// The output coordinate at output position `q`.
    #[inline]
    pub fn coord(&self, q: usize) -> f64 {
        let m = self.output_len();
        match &self.positions {
            Positions::Forward { n, delta, .. } => {
                let i = self.take(q);
                if self.kind == LineKind::RealForward {
                    i as f64 * (1.0 / (*n as f64 * delta))
                } else {
                    fftfreq_at(i, *n, *delta)
                }
            }
            Positions::Inverse { delta, shift, .. } => {
                let i = if *shift { fftshift_source(q, m) } else { q };
                fftfreq_at(i, m, *delta) + self.lag
            }
        }
    }

    /// The kernel pass along block axis `axis`, in precision `T`: the
    /// formulas tabulated for whole lines.
    pub fn pass<T: FftNum>(&self, axis: usize) -> AxisPass<T> {
        let convert = |c: Complex<f64>| {
            Complex::new(
                T::from_f64(c.re).unwrap_or_else(T::zero),
                T::from_f64(c.im).unwrap_or_else(T::zero),
            )
        };
        let (n_in, n_out) = (self.input_len(), self.output_len());
        AxisPass {
            axis,
            kind: self.kind,
            len: self.len,
            gather: (0..n_in).map(|k| self.gather(k)).collect(),
            pre: self
                .has_pre()
                .then(|| (0..n_in).map(|k| convert(self.pre(k))).collect()),
            take: (0..n_out).map(|q| self.take(q)).collect(),
            post: self
                .has_post()
                .then(|| (0..n_out).map(|q| convert(self.post(q))).collect()),
        }
    }
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::array::Float64Array;

    use super::*;

    fn held(values: &[f64]) -> Coordinate {
        Coordinate::Values(Arc::new(Float64Array::from(values.to_vec())))
    }

    #[test]
    fn frequencies_match_numpy() {
        // numpy.fft.fftfreq(5, 0.5) and rfftfreq(6, 0.5)
        let fftfreq: Vec<f64> = (0..5).map(|i| fftfreq_at(i, 5, 0.5)).collect();
        assert_eq!(fftfreq, [0.0, 0.4, 0.8, -0.8, -0.4]);
        // fftshift([0, 1, 2, 3, 4]) == [3, 4, 0, 1, 2]; ifftshift == [2, 3, 4, 0, 1]
        let shifted: Vec<usize> = (0..5).map(|q| fftshift_source(q, 5)).collect();
        assert_eq!(shifted, [3, 4, 0, 1, 2]);
        let unshifted: Vec<usize> = (0..5).map(|q| ifftshift_source(q, 5)).collect();
        assert_eq!(unshifted, [2, 3, 4, 0, 1]);
    }

    #[test]
    fn uneven_and_single_point_coordinates_are_refused() {
        let options = FftOptions::forward(vec!["x".into()]);
        let err =
            AxisTransform::forward("x", &held(&[0.0, 1.0, 3.0]), false, &options).unwrap_err();
        assert!(err.contains("not evenly spaced"), "{err}");
        let err = AxisTransform::forward("x", &held(&[2.0]), false, &options).unwrap_err();
        assert!(err.contains("at least 2"), "{err}");
        let inverse = FftOptions::inverse(vec!["freq_x".into()]);
        let err = AxisTransform::inverse("freq_x", &held(&[1.0, 2.0, 3.0]), false, 0.0, &inverse)
            .unwrap_err();
        assert!(err.contains("not centred on zero"), "{err}");
    }

    #[test]
    fn forward_coordinates_follow_xrft() {
        let options = FftOptions::forward(vec!["x".into()]);
        let coords: Vec<f64> = (0..6).map(|i| 10.0 - 2.0 * i as f64).collect();
        let axis = AxisTransform::forward("x", &held(&coords), false, &options).unwrap();
        assert_eq!(axis.output_name, "freq_x");
        // fftshift(fftfreq(6, 2))
        let expected = [-0.25, -1.0 / 6.0, -1.0 / 12.0, 0.0, 1.0 / 12.0, 1.0 / 6.0];
        for (a, b) in (0..6).map(|q| axis.coord(q)).zip(expected) {
            assert!((a - b).abs() < 1e-15);
        }
        // The lag of a descending coordinate is the middle of its increasing order.
        assert_eq!(axis.lag, 6.0);
    }
}

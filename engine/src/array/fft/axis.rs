//! One transformed dimension: the output coordinates xrft gives it and the
//! kernel pass that computes it.
//!
//! Everything xrft does per dimension is a reordering or a factor per
//! position, so it folds into an [`AxisPass`]: the input flip of a
//! descending coordinate and the `ifftshift` of `true_phase` become the
//! pass's gather order, windows and inverse phases its input factors, the
//! output `fftshift` its take order, and forward phases, spacings and the
//! `1/n` of inverse transforms its output factors.

use std::f64::consts::PI;

use rustfft::num_complex::Complex;
use rustfft::FftNum;

use super::options::FftOptions;
use crate::device::{AxisPass, LineKind};

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
    /// Input positions, in the order the transform reads them.
    pub gather: Vec<usize>,
    /// Input factors.
    pub pre: Option<Vec<Complex<f64>>>,
    /// For each output position, the transform output it takes.
    pub take: Vec<usize>,
    /// Output factors.
    pub post: Option<Vec<Complex<f64>>>,
    /// The output coordinate.
    pub coords: Vec<f64>,
    /// The output coordinate's spacing (xrft's `spacing` attribute).
    pub spacing: f64,
    /// Forward: the input coordinate's lag (xrft's `direct_lag` attribute
    /// of the output); inverse: the lag added to the output coordinate.
    pub lag: f64,
}

/// `numpy.fft.fftfreq(n, d)`, computed as numpy does (integers times
/// `1 / (n d)`), so coordinates match to the last bit.
fn fftfreq(n: usize, d: f64) -> Vec<f64> {
    let half = n.div_ceil(2);
    let step = 1.0 / (n as f64 * d);
    (0..n)
        .map(|i| {
            let k = if i < half {
                i as f64
            } else {
                i as f64 - n as f64
            };
            k * step
        })
        .collect()
}

/// `numpy.fft.rfftfreq(n, d)`, computed as numpy does.
fn rfftfreq(n: usize, d: f64) -> Vec<f64> {
    let step = 1.0 / (n as f64 * d);
    (0..n / 2 + 1).map(|i| i as f64 * step).collect()
}

/// Position `q` of `fftshift(x)` is `x[fftshift_source(q, n)]`.
fn fftshift_source(q: usize, n: usize) -> usize {
    (q + n - n / 2) % n
}

/// Position `q` of `ifftshift(x)` is `x[ifftshift_source(q, n)]`.
fn ifftshift_source(q: usize, n: usize) -> usize {
    (q + n / 2) % n
}

/// The differences of `coords` and whether they are all within `tol`
/// (relative, numpy's `allclose` with its absolute 1e-8) of `reference`.
fn evenly_spaced(coords: &[f64], reference: f64, tol: f64) -> bool {
    coords
        .windows(2)
        .all(|w| ((w[1] - w[0]) - reference).abs() <= 1e-8 + tol * reference.abs())
}

/// xrft's lag of a coordinate: its middle value once in increasing order.
fn lag_of(coords: &[f64]) -> f64 {
    let n = coords.len();
    if coords[n - 1] > coords[0] {
        coords[n / 2]
    } else {
        coords[n - 1 - n / 2]
    }
}

impl AxisTransform {
    /// The forward transform (`xrft.fft`) of dimension `dim` with
    /// coordinate `coords`, real (`rfft`) when `real`.
    pub fn forward(
        dim: &str,
        coords: &[f64],
        real: bool,
        options: &FftOptions,
    ) -> Result<Self, String> {
        let n = coords.len();
        if n < 2 {
            return Err(format!(
                "dimension '{dim}' has {n} point{}; a transform needs at least 2 to know the \
                 spacing",
                if n == 1 { "" } else { "s" }
            ));
        }
        let first = coords[1] - coords[0];
        if !evenly_spaced(coords, first, options.spacing_tol) {
            return Err(format!(
                "coordinate '{dim}' is not evenly spaced (spacing_tol {})",
                options.spacing_tol
            ));
        }
        let delta = first.abs();
        if delta == 0.0 || !delta.is_finite() {
            return Err(format!("coordinate '{dim}' has spacing {delta}"));
        }
        let descending = coords[n - 1] < coords[0];
        let lag = lag_of(coords);
        let gather: Vec<usize> = (0..n)
            .map(|k| {
                if !options.true_phase {
                    return k;
                }
                let p = ifftshift_source(k, n);
                if descending {
                    n - 1 - p
                } else {
                    p
                }
            })
            .collect();
        let pre = options.window.map(|w| {
            let values = w.values(n);
            gather
                .iter()
                .map(|&p| Complex::new(values[p], 0.0))
                .collect()
        });
        // xrft never shifts a transform with a real dimension.
        let shift = options.shift && options.real_dim.is_none();
        let (kind, freqs) = if real {
            (LineKind::RealForward, rfftfreq(n, delta))
        } else {
            (LineKind::Forward, fftfreq(n, delta))
        };
        let m = freqs.len();
        let take: Vec<usize> = (0..m)
            .map(|q| if shift { fftshift_source(q, m) } else { q })
            .collect();
        let coords: Vec<f64> = take.iter().map(|&i| freqs[i]).collect();
        let amplitude = if options.true_amplitude { delta } else { 1.0 };
        let post = (options.true_phase || options.true_amplitude).then(|| {
            coords
                .iter()
                .map(|&f| {
                    let phase = if options.true_phase {
                        -2.0 * PI * f * lag
                    } else {
                        0.0
                    };
                    Complex::from_polar(amplitude, phase)
                })
                .collect()
        });
        Ok(Self {
            dim: dim.to_string(),
            output_name: options.output_name(dim),
            kind,
            len: n,
            gather,
            pre,
            take,
            post,
            spacing: coords.get(1).map_or(f64::NAN, |c1| c1 - coords[0]),
            coords,
            lag,
        })
    }

    /// The inverse transform (`xrft.ifft`) of frequency dimension `dim`
    /// with coordinate `coords` (in increasing or `fftfreq` order, centred
    /// on zero), real (`irfft`) when `real`, its output coordinate offset by
    /// `lag`.
    pub fn inverse(
        dim: &str,
        coords: &[f64],
        real: bool,
        lag: f64,
        options: &FftOptions,
    ) -> Result<Self, String> {
        let n = coords.len();
        if n < 2 {
            return Err(format!(
                "dimension '{dim}' has {n} point{}; a transform needs at least 2",
                if n == 1 { "" } else { "s" }
            ));
        }
        let delta = (coords[1] - coords[0]).abs();
        // xrft sorts a coordinate that is not evenly increasing (an
        // unshifted or descending frequency axis) and checks it again.
        let mut order: Vec<usize> = (0..n).collect();
        let mut centre = if real { coords[0] } else { lag_of(coords) };
        if !evenly_spaced(coords, delta, options.spacing_tol) {
            order.sort_by(|&a, &b| coords[a].total_cmp(&coords[b]));
            let sorted: Vec<f64> = order.iter().map(|&i| coords[i]).collect();
            if !evenly_spaced(&sorted, sorted[1] - sorted[0], options.spacing_tol) {
                return Err(format!(
                    "coordinate '{dim}' is not evenly spaced (spacing_tol {})",
                    options.spacing_tol
                ));
            }
            centre = lag_of(&sorted);
        }
        if centre.abs() > options.spacing_tol {
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
        let gather: Vec<usize> = (0..n)
            .map(|k| {
                if real {
                    order[k]
                } else {
                    order[ifftshift_source(k, n)]
                }
            })
            .collect();
        let pre = options.true_phase.then(|| {
            gather
                .iter()
                .map(|&p| Complex::from_polar(1.0, 2.0 * PI * coords[p] * lag))
                .collect()
        });
        let m = len;
        let take: Vec<usize> = (0..m)
            .map(|q| {
                let q = if options.shift {
                    fftshift_source(q, m)
                } else {
                    q
                };
                if options.true_phase {
                    q
                } else {
                    ifftshift_source(q, m)
                }
            })
            .collect();
        let positions = fftfreq(m, delta);
        let positions: Vec<f64> = (0..m)
            .map(|q| {
                let i = if options.shift {
                    fftshift_source(q, m)
                } else {
                    q
                };
                positions[i]
            })
            .collect();
        let spacing = positions[1] - positions[0];
        let mut scale = 1.0 / m as f64;
        if options.true_amplitude {
            scale /= spacing;
        }
        Ok(Self {
            dim: dim.to_string(),
            output_name: options.output_name(dim),
            kind,
            len,
            gather,
            pre,
            take,
            post: Some(vec![Complex::new(scale, 0.0); m]),
            coords: positions.iter().map(|p| p + lag).collect(),
            spacing,
            lag,
        })
    }

    /// The kernel pass along block axis `axis`, in precision `T`.
    pub fn pass<T: FftNum>(&self, axis: usize) -> AxisPass<T> {
        let convert = |factors: &Option<Vec<Complex<f64>>>| {
            factors.as_ref().map(|f| {
                f.iter()
                    .map(|c| {
                        Complex::new(
                            T::from_f64(c.re).unwrap_or_else(T::zero),
                            T::from_f64(c.im).unwrap_or_else(T::zero),
                        )
                    })
                    .collect()
            })
        };
        AxisPass {
            axis,
            kind: self.kind,
            len: self.len,
            gather: self.gather.clone(),
            pre: convert(&self.pre),
            take: self.take.clone(),
            post: convert(&self.post),
        }
    }

    /// The number of output positions.
    pub fn output_len(&self) -> usize {
        self.take.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frequencies_match_numpy() {
        // numpy.fft.fftfreq(5, 0.5) and rfftfreq(6, 0.5)
        assert_eq!(fftfreq(5, 0.5), [0.0, 0.4, 0.8, -0.8, -0.4]);
        assert_eq!(rfftfreq(6, 0.5), [0.0, 1.0 / 3.0, 2.0 / 3.0, 1.0]);
        // fftshift([0, 1, 2, 3, 4]) == [3, 4, 0, 1, 2]; ifftshift == [2, 3, 4, 0, 1]
        let shifted: Vec<usize> = (0..5).map(|q| fftshift_source(q, 5)).collect();
        assert_eq!(shifted, [3, 4, 0, 1, 2]);
        let unshifted: Vec<usize> = (0..5).map(|q| ifftshift_source(q, 5)).collect();
        assert_eq!(unshifted, [2, 3, 4, 0, 1]);
    }

    #[test]
    fn uneven_and_single_point_coordinates_are_refused() {
        let options = FftOptions::forward(vec!["x".into()]);
        let err = AxisTransform::forward("x", &[0.0, 1.0, 3.0], false, &options).unwrap_err();
        assert!(err.contains("not evenly spaced"), "{err}");
        let err = AxisTransform::forward("x", &[2.0], false, &options).unwrap_err();
        assert!(err.contains("at least 2"), "{err}");
        let inverse = FftOptions::inverse(vec!["freq_x".into()]);
        let err =
            AxisTransform::inverse("freq_x", &[1.0, 2.0, 3.0], false, 0.0, &inverse).unwrap_err();
        assert!(err.contains("not centred on zero"), "{err}");
    }

    #[test]
    fn forward_coordinates_follow_xrft() {
        let options = FftOptions::forward(vec!["x".into()]);
        let coords: Vec<f64> = (0..6).map(|i| 10.0 - 2.0 * i as f64).collect();
        let axis = AxisTransform::forward("x", &coords, false, &options).unwrap();
        assert_eq!(axis.output_name, "freq_x");
        // fftshift(fftfreq(6, 2))
        let expected = [-0.25, -1.0 / 6.0, -1.0 / 12.0, 0.0, 1.0 / 12.0, 1.0 / 6.0];
        for (a, b) in axis.coords.iter().zip(expected) {
            assert!((a - b).abs() < 1e-15);
        }
        // The lag of a descending coordinate is the middle of its increasing order.
        assert_eq!(axis.lag, 6.0);
    }
}

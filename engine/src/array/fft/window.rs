//! Window functions, computed as `scipy.signal.windows.<name>(n, sym=False)`
//! computes them (the periodic windows xrft applies before a transform).

use std::f64::consts::PI;

/// A window function.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Window {
    /// `hann`: cosine-sum with coefficients (0.5, 0.5).
    Hann,
    /// `hamming`: cosine-sum with coefficients (0.54, 0.46).
    Hamming,
    /// `blackman`: cosine-sum with coefficients (0.42, 0.5, 0.08).
    Blackman,
    /// `blackmanharris`: four-term cosine-sum.
    BlackmanHarris,
    /// `nuttall`: four-term cosine-sum (Nuttall's minimum 4-term).
    Nuttall,
    /// `flattop`: five-term cosine-sum.
    Flattop,
    /// `tukey` with the given fraction of cosine taper (scipy's default 0.5).
    Tukey(f64),
    /// `boxcar`: all ones.
    Boxcar,
    /// `bartlett`: triangular, zero at the ends.
    Bartlett,
    /// `cosine`: a half period of sine.
    Cosine,
}

/// Every window name, for error messages.
const NAMES: &str =
    "hann, hamming, blackman, blackmanharris, nuttall, flattop, tukey, boxcar, bartlett, cosine";

impl Window {
    /// The window scipy calls `name` (`tukey` takes its fraction after a
    /// colon: `tukey:0.25`).
    pub fn parse(name: &str) -> Result<Self, String> {
        let (name, parameter) = match name.split_once(':') {
            Some((n, p)) => (n, Some(p)),
            None => (name, None),
        };
        let window = match name.trim() {
            "hann" => Self::Hann,
            "hamming" => Self::Hamming,
            "blackman" => Self::Blackman,
            "blackmanharris" => Self::BlackmanHarris,
            "nuttall" => Self::Nuttall,
            "flattop" => Self::Flattop,
            "tukey" => {
                let alpha = match parameter {
                    Some(p) => p
                        .trim()
                        .parse::<f64>()
                        .map_err(|_| format!("tukey's fraction must be a number, got '{p}'"))?,
                    None => 0.5,
                };
                return Ok(Self::Tukey(alpha));
            }
            "boxcar" => Self::Boxcar,
            "bartlett" => Self::Bartlett,
            "cosine" => Self::Cosine,
            other => return Err(format!("unknown window '{other}' (windows: {NAMES})")),
        };
        match parameter {
            Some(_) => Err(format!("the {name} window takes no parameter")),
            None => Ok(window),
        }
    }

    /// The name [`Self::parse`] takes (`tukey:0.5`).
    pub fn name(self) -> String {
        let name = match self {
            Self::Hann => "hann",
            Self::Hamming => "hamming",
            Self::Blackman => "blackman",
            Self::BlackmanHarris => "blackmanharris",
            Self::Nuttall => "nuttall",
            Self::Flattop => "flattop",
            Self::Tukey(alpha) => return format!("tukey:{alpha}"),
            Self::Boxcar => "boxcar",
            Self::Bartlett => "bartlett",
            Self::Cosine => "cosine",
        };
        name.to_string()
    }

    /// The `n` values of the periodic window (scipy's `sym=False`: the
    /// symmetric window of `n + 1` points without its last).
    pub fn values(self, n: usize) -> Vec<f64> {
        (0..n).map(|i| self.value(i, n)).collect()
    }

    /// Value `i` of the periodic window of `n` points (see [`Self::values`]),
    /// computed alone, so windows of lines larger than memory need no table.
    pub fn value(self, i: usize, n: usize) -> f64 {
        if n <= 1 {
            return 1.0;
        }
        let m = n + 1;
        match self {
            Self::Hann => cosine_sum(&[0.5, 0.5], i, m),
            Self::Hamming => cosine_sum(&[0.54, 0.46], i, m),
            Self::Blackman => cosine_sum(&[0.42, 0.50, 0.08], i, m),
            Self::BlackmanHarris => cosine_sum(&[0.35875, 0.48829, 0.14128, 0.01168], i, m),
            Self::Nuttall => cosine_sum(&[0.3635819, 0.4891775, 0.1365995, 0.0106411], i, m),
            Self::Flattop => cosine_sum(
                &[
                    0.21557895,
                    0.41663158,
                    0.277263158,
                    0.083578947,
                    0.006947368,
                ],
                i,
                m,
            ),
            Self::Tukey(alpha) => tukey(alpha, i, m),
            Self::Boxcar => 1.0,
            Self::Bartlett => {
                let x = 2.0 * i as f64 / (m - 1) as f64;
                if x <= 1.0 {
                    x
                } else {
                    2.0 - x
                }
            }
            Self::Cosine => (PI / m as f64 * (i as f64 + 0.5)).sin(),
        }
    }
}

/// Value `i` of scipy's `general_cosine(m, a, sym=True)`: `sum_k a[k]
/// cos(k x)` for `x` evenly from -pi to pi.
fn cosine_sum(a: &[f64], i: usize, m: usize) -> f64 {
    let x = -PI + 2.0 * PI * i as f64 / (m - 1) as f64;
    a.iter()
        .enumerate()
        .map(|(k, c)| c * (k as f64 * x).cos())
        .sum()
}

/// Value `i` of scipy's `tukey(m, alpha, sym=True)`.
fn tukey(alpha: f64, i: usize, m: usize) -> f64 {
    if alpha <= 0.0 {
        return 1.0;
    }
    if alpha >= 1.0 {
        return cosine_sum(&[0.5, 0.5], i, m);
    }
    let last = (m - 1) as f64;
    let width = (alpha * last / 2.0).floor() as usize;
    let n = i as f64;
    if i <= width {
        0.5 * (1.0 + (PI * (-1.0 + 2.0 * n / alpha / last)).cos())
    } else if i < m - width - 1 {
        1.0
    } else {
        0.5 * (1.0 + (PI * (-2.0 / alpha + 1.0 + 2.0 * n / alpha / last)).cos())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periodic_hann_is_the_textbook_formula() {
        // hann(n, sym=False)[k] = 0.5 - 0.5 cos(2 pi k / n)
        let n = 8;
        for (k, w) in Window::Hann.values(n).iter().enumerate() {
            let expected = 0.5 - 0.5 * (2.0 * PI * k as f64 / n as f64).cos();
            assert!((w - expected).abs() < 1e-15);
        }
    }

    #[test]
    fn names_parse_and_unknown_ones_are_listed() {
        assert_eq!(Window::parse("tukey:0.25"), Ok(Window::Tukey(0.25)));
        assert_eq!(Window::parse("hamming"), Ok(Window::Hamming));
        let err = Window::parse("kaiser").unwrap_err();
        assert!(
            err.contains("unknown window 'kaiser'") && err.contains("hann"),
            "{err}"
        );
    }
}

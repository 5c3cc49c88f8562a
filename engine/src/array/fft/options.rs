//! The options of an FFT, as xrft names them, parsed from `name => value`
//! arguments (SQL) or set directly (Rust, Python).

use datafusion::common::{plan_err, Result};

use super::window::Window;

/// What is removed from the data before a forward transform.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detrend {
    /// The mean over the transformed dimensions.
    Constant,
    /// The least-squares line (one dimension) or plane (two dimensions)
    /// over the transformed dimensions' positions.
    Linear,
}

impl Detrend {
    /// Its name as SQL and xrft write it.
    pub fn name(self) -> &'static str {
        match self {
            Detrend::Constant => "constant",
            Detrend::Linear => "linear",
        }
    }

    /// The trend named `name` (any case), if any.
    pub fn named(name: &str) -> Option<Self> {
        [Detrend::Constant, Detrend::Linear]
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(name))
    }
}

/// An FFT or inverse FFT along dimensions, with xrft's options (`xrft.fft`
/// and `xrft.ifft`, version 1.0).
#[derive(Debug, Clone, PartialEq)]
pub struct FftOptions {
    /// The dimensions transformed, in order (the real one, if any, is
    /// transformed last going forward and first going back, as numpy's
    /// `rfftn`/`irfftn` do).
    pub dims: Vec<String>,
    /// Inverse (`xrft.ifft`) rather than forward (`xrft.fft`).
    pub inverse: bool,
    /// The dimension of a real transform (`rfft` forward, `irfft` back).
    pub real_dim: Option<String>,
    /// Whether frequencies (forward) or positions (inverse) are put in
    /// increasing order (`fftshift`). Forward transforms with a real
    /// dimension are never shifted (as in xrft).
    pub shift: bool,
    /// Trend removed before a forward transform.
    pub detrend: Option<Detrend>,
    /// Window applied before a forward transform, along every transformed
    /// dimension.
    pub window: Option<Window>,
    /// Take the coordinates' positions into account: the input is centred
    /// (`ifftshift`) before the transform and the phase follows the
    /// coordinates' offset (the lag).
    pub true_phase: bool,
    /// Scale by the coordinate spacing (forward) or divide by it (inverse)
    /// to match the continuous transform's amplitude.
    pub true_amplitude: bool,
    /// Inverse only: the coordinate offset of each output dimension, in the
    /// order of `dims` with the real dimension moved last (xrft's order);
    /// `None` takes each input coordinate's `direct_lag` attribute (0
    /// without one).
    pub lag: Option<Vec<f64>>,
    /// Relative tolerance of the check that coordinates are evenly spaced.
    pub spacing_tol: f64,
    /// Prefix of the transformed dimensions' names (`freq_`): added going
    /// forward, removed going back.
    pub prefix: String,
}

impl FftOptions {
    /// A forward transform along `dims` with xrft's defaults (shifted,
    /// true phase and amplitude).
    pub fn forward(dims: Vec<String>) -> Self {
        Self {
            dims,
            inverse: false,
            real_dim: None,
            shift: true,
            detrend: None,
            window: None,
            true_phase: true,
            true_amplitude: true,
            lag: None,
            spacing_tol: 1e-3,
            prefix: "freq_".to_string(),
        }
    }

    /// An inverse transform along `dims` with xrft's defaults.
    pub fn inverse(dims: Vec<String>) -> Self {
        Self {
            inverse: true,
            ..Self::forward(dims)
        }
    }

    /// Sets the options named in `named` (`dims`, `real_dim`, `shift`,
    /// `detrend`, `window`, `true_phase`, `true_amplitude`, `lag`,
    /// `spacing_tol`, `prefix`), as SQL writes them; `function` names the
    /// caller in errors.
    pub fn set(&mut self, named: &[(String, String)], function: &str) -> Result<()> {
        for (name, value) in named {
            let flag = || parse_bool(value, function, name);
            match name.to_ascii_lowercase().as_str() {
                "dims" | "dim" => self.dims = parse_list(value),
                "real_dim" => self.real_dim = Some(value.trim().to_string()),
                "shift" => self.shift = flag()?,
                "true_phase" => self.true_phase = flag()?,
                "true_amplitude" => self.true_amplitude = flag()?,
                "detrend" if self.inverse => {
                    return plan_err!("{function}: detrend applies to forward transforms (fft)")
                }
                "detrend" => {
                    self.detrend = match value.trim().to_ascii_lowercase().as_str() {
                        "none" | "" => None,
                        other if Detrend::named(other).is_some() => Detrend::named(other),
                        other => {
                            return plan_err!(
                                "{function}: detrend must be 'constant' or 'linear', got '{other}'"
                            )
                        }
                    }
                }
                "window" if self.inverse => {
                    return plan_err!("{function}: window applies to forward transforms (fft)")
                }
                "window" => {
                    self.window = match value.trim().to_ascii_lowercase().as_str() {
                        "none" | "" => None,
                        other => Some(Window::parse(other).map_err(|e| {
                            datafusion::common::DataFusionError::Plan(format!("{function}: {e}"))
                        })?),
                    }
                }
                "lag" if !self.inverse => {
                    return plan_err!(
                        "{function}: lag applies to inverse transforms (ifft); a forward \
                         transform takes its lag from the coordinates"
                    )
                }
                "lag" => {
                    let lags = parse_list(value)
                        .iter()
                        .map(|v| v.parse::<f64>())
                        .collect::<std::result::Result<Vec<_>, _>>();
                    match lags {
                        Ok(lags) => self.lag = Some(lags),
                        Err(_) => {
                            return plan_err!(
                                "{function}: lag must be a number or a list of numbers \
                                 ('45' or '45,0'), got '{value}'"
                            )
                        }
                    }
                }
                "spacing_tol" => match value.trim().parse::<f64>() {
                    Ok(tol) if tol >= 0.0 => self.spacing_tol = tol,
                    _ => {
                        return plan_err!(
                            "{function}: spacing_tol must be a non-negative number, got '{value}'"
                        )
                    }
                },
                "prefix" => self.prefix = value.clone(),
                other => {
                    return plan_err!(
                        "{function}: unknown option '{other}' (options: dims, real_dim, shift, \
                         detrend, window, true_phase, true_amplitude, lag, spacing_tol, prefix)"
                    )
                }
            }
        }
        Ok(())
    }

    /// These options as SQL names them (`fft(..., dims => 'lat')`):
    /// what a cluster's worker is sent and sets again with [`Self::set`]
    /// (a function that cannot be said so, `None`: a dimension with a
    /// comma in its name, say).
    pub fn named(&self) -> Option<(&'static str, Vec<(String, String)>)> {
        let function = if self.inverse { "ifft" } else { "fft" };
        let list = |items: Vec<String>| items.join(",");
        let mut named = vec![
            ("dims".to_string(), list(self.dims.clone())),
            ("shift".to_string(), self.shift.to_string()),
            ("true_phase".to_string(), self.true_phase.to_string()),
            (
                "true_amplitude".to_string(),
                self.true_amplitude.to_string(),
            ),
            ("spacing_tol".to_string(), self.spacing_tol.to_string()),
            ("prefix".to_string(), self.prefix.clone()),
        ];
        if let Some(real) = &self.real_dim {
            named.push(("real_dim".to_string(), real.clone()));
        }
        if let Some(detrend) = self.detrend {
            named.push(("detrend".to_string(), detrend.name().to_string()));
        }
        if let Some(window) = self.window {
            named.push(("window".to_string(), window.name()));
        }
        if let Some(lag) = &self.lag {
            let lags = lag.iter().map(f64::to_string).collect();
            named.push(("lag".to_string(), list(lags)));
        }
        let mut again = Self::forward(Vec::new());
        again.inverse = self.inverse;
        let same = again.set(&named, function).is_ok() && again == *self;
        same.then_some((function, named))
    }

    /// The dimensions in the order they are transformed: the real one last
    /// going forward, first going back.
    pub fn transform_order(&self) -> Vec<String> {
        let mut dims: Vec<String> = self
            .dims
            .iter()
            .filter(|d| Some(*d) != self.real_dim.as_ref())
            .cloned()
            .collect();
        if let Some(real) = &self.real_dim {
            if self.inverse {
                dims.push(real.clone());
            } else {
                dims.insert(0, real.clone());
            }
        }
        dims
    }

    /// The name a transformed dimension gets: the prefix removed when it
    /// has it, else added (xrft's rule, both ways).
    pub fn output_name(&self, dim: &str) -> String {
        match dim.strip_prefix(self.prefix.as_str()) {
            Some(rest) if !self.prefix.is_empty() => rest.to_string(),
            _ => format!("{}{dim}", self.prefix),
        }
    }
}

/// A comma-separated list, trimmed (`'lat, lon'`), or a single name.
fn parse_list(value: &str) -> Vec<String> {
    value
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

fn parse_bool(value: &str, function: &str, name: &str) -> Result<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" => Ok(true),
        "false" | "0" | "no" => Ok(false),
        other => plan_err!("{function}: {name} must be true or false, got '{other}'"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn sql_arguments_set_the_options() {
        let mut options = FftOptions::forward(vec![]);
        options
            .set(
                &named(&[
                    ("dims", "lat, lon"),
                    ("real_dim", "lon"),
                    ("detrend", "linear"),
                    ("window", "hann"),
                    ("true_phase", "false"),
                ]),
                "fft",
            )
            .unwrap();
        assert_eq!(options.dims, ["lat", "lon"]);
        assert_eq!(options.detrend, Some(Detrend::Linear));
        assert!(!options.true_phase && options.true_amplitude);
        assert_eq!(options.transform_order(), ["lon", "lat"]);
        assert_eq!(options.output_name("lat"), "freq_lat");
        assert_eq!(FftOptions::inverse(vec![]).output_name("freq_lat"), "lat");
    }

    #[test]
    fn options_named_as_sql_set_the_same_options() {
        let mut forward = FftOptions::forward(vec!["lat".into(), "lon".into()]);
        forward.real_dim = Some("lon".into());
        forward.detrend = Some(Detrend::Linear);
        forward.window = Some(Window::Tukey(0.25));
        forward.spacing_tol = 0.1 + 0.2;
        let mut inverse = FftOptions::inverse(vec!["freq_x".into()]);
        inverse.lag = Some(vec![45.0, -1.0 / 3.0]);
        inverse.shift = false;
        inverse.prefix = "k_".into();
        for options in [forward, inverse, FftOptions::forward(vec!["t".into()])] {
            let (function, named) = options.named().expect("said in SQL");
            let mut again = if function == "ifft" {
                FftOptions::inverse(vec![])
            } else {
                FftOptions::forward(vec![])
            };
            again.set(&named, function).unwrap();
            assert_eq!(again, options);
        }
        let odd = FftOptions::forward(vec!["a,b".into()]);
        assert!(odd.named().is_none());
    }

    #[test]
    fn bad_arguments_are_named() {
        let mut options = FftOptions::inverse(vec![]);
        let err = options.set(&named(&[("lag", "east")]), "ifft").unwrap_err();
        assert!(err.to_string().contains("lag must be a number"), "{err}");
        let err = options
            .set(&named(&[("window", "hann")]), "ifft")
            .unwrap_err();
        assert!(err.to_string().contains("forward"), "{err}");
        let mut options = FftOptions::forward(vec![]);
        let err = options
            .set(&named(&[("shift", "maybe")]), "fft")
            .unwrap_err();
        assert!(
            err.to_string().contains("shift must be true or false"),
            "{err}"
        );
        let err = options
            .set(&named(&[("colour", "red")]), "fft")
            .unwrap_err();
        assert!(err.to_string().contains("unknown option 'colour'"), "{err}");
    }
}

//! What one training sample holds: inputs and targets along a lead
//! dimension, as channels.
//!
//! A sample is anchored at one origin of the window grid. Along the *lead
//! dimension* (usually `time`) its inputs are `history` steps ending at the
//! anchor and its targets are the anchor shifted by lead times, given in
//! steps (`"+1"`) or in the coordinate's units (`"+6h"`, a whole number of
//! the coordinate's evenly spaced steps). The lead dimension becomes a
//! window dimension of the grid spanning every step a sample uses, so the
//! blocks, the halo and the index need nothing new: a sample is a window,
//! and each of its channels is one variable at one step of it (a *plane*
//! over the other window dimensions).
//!
//! Each role (`inputs`, `targets`) has its own validity rule, counted over
//! its channels only. Jitter moves the window along the other window
//! dimensions by a seeded random offset per sample and epoch, within a
//! bound, for every channel of the sample together.
//!
//! Channel order, per role: steps outermost (oldest first), then the
//! variables in the windows' order; a `(B, C, ...)` batch reshapes to
//! `(B, steps, variables, ...)` when every step has the same variables.

use std::ops::Range;

use datafusion::arrow::array::{Array, AsArray};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Int64Type, TimeUnit};
use zarrfusion_udfs::calendar::Date;
use zarrfusion_udfs::cf_time::CfTime;

use super::geometry::{Validity, WindowShape};
use super::sources::{Link, Sources};
use super::WindowError;
use crate::table::{CalendarSeconds, Dimension, GridTable};

/// What a sample holds, as the user asks for it.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleSpec {
    /// The dimension history and lead times run along; `None`: the only
    /// dimension outside `input_dims` whose coordinate holds times.
    pub lead_dim: Option<String>,
    /// Input steps ending at the sample's own (1: that step only).
    pub history: u64,
    /// The input variables (`None`: every variable of the windows; an
    /// empty list is refused, naming `inputs`).
    pub inputs: Option<Vec<String>>,
    /// Target variables and their lead times (`"+6h"`, `"+1"` steps).
    pub targets: Vec<(String, Vec<String>)>,
    /// The rule the inputs of a kept sample meet.
    pub valid_inputs: Validity,
    /// The rule the targets of a kept sample meet.
    pub valid_targets: Validity,
    /// Largest random offset per sample along window dimensions.
    pub jitter: Vec<(String, u64)>,
}

impl Default for SampleSpec {
    /// Inputs only, at the sample's step, every window kept when complete.
    fn default() -> Self {
        Self {
            lead_dim: None,
            history: 1,
            inputs: None,
            targets: Vec::new(),
            valid_inputs: Validity::All,
            valid_targets: Validity::All,
            jitter: Vec::new(),
        }
    }
}

impl SampleSpec {
    /// Whether samples are split in roles (history, a lead dimension or
    /// targets given); otherwise a batch holds each variable's windows.
    pub fn has_roles(&self) -> bool {
        self.history > 1 || !self.targets.is_empty() || self.lead_dim.is_some()
    }
}

/// One channel of a role: a variable at one step of the lead dimension
/// (and one index of each of its source's channel dimensions, `level`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Channel {
    /// The variable, as a position among the windows' variables.
    pub variable: usize,
    /// Steps from the sample's anchor along the lead dimension.
    pub step: i64,
    /// Position along the window's lead axis (0 without a lead dimension).
    pub slot: u64,
    /// `(dimension of the variable's source, index)` of its channel dimensions.
    pub fixed: Vec<(usize, u64)>,
    /// Which of the variable's [`SampleLayout::parts`] `fixed` is.
    pub part: usize,
}

/// The inputs or the targets of a sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Role {
    /// `"inputs"` or `"targets"`.
    pub name: &'static str,
    /// The rule a kept sample meets, over this role's channels.
    pub validity: Validity,
    /// The channels, in batch order.
    pub channels: Vec<Channel>,
}

/// The lead dimension of the window grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeadAxis {
    /// The axis in the grid (the table's dimension number).
    pub axis: usize,
    /// The anchor's position within the window along it.
    pub anchor: u64,
    /// Steps the window spans along it.
    pub span: u64,
}

/// How a sample is cut: its roles and channels, resolved against a table.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleLayout {
    /// Whether batches are split by role (see [`SampleSpec::has_roles`]).
    pub roles_given: bool,
    /// The lead dimension, when there is one.
    pub lead: Option<LeadAxis>,
    /// Inputs, then targets when there are any.
    pub roles: Vec<Role>,
    /// Largest offset per table dimension (0: none).
    pub jitter: Vec<u64>,
    /// The reference's channel dimensions (window axes spanning their
    /// whole selection, each index a channel of every variable).
    pub channel_axes: Vec<usize>,
    /// Per variable (flat order): its channels at one step, as the
    /// `(source dimension, index)` of each channel dimension (one empty
    /// part for a variable without channel dimensions), in C order.
    pub parts: Vec<Vec<Vec<(usize, u64)>>>,
}

impl SampleLayout {
    /// Resolves `spec` for windows of `shape` over `sources` (their
    /// reference's grid), `lead` the reference's lead dimension (see
    /// [`lead_dimension`]). Returns the layout and the window shape of the
    /// grid, with the lead and channel dimensions added.
    pub fn resolve(
        sources: &Sources,
        shape: &WindowShape,
        spec: &SampleSpec,
        lead: Option<usize>,
    ) -> Result<(Self, WindowShape), WindowError> {
        let reference = sources.reference();
        let table = &reference.table;
        let selection = &reference.selection;
        let variables: Vec<&str> = (0..sources.flat.len())
            .map(|f| sources.variable_name(f))
            .collect();
        let dims: Vec<&str> = table.dims.iter().map(|d| d.name.as_str()).collect();
        let mut jitter = vec![0u64; dims.len()];
        for (dim, bound) in &spec.jitter {
            let in_window = shape.sizes.iter().any(|(d, _)| d == dim);
            let Some(d) = dims.iter().position(|n| n == dim).filter(|_| in_window) else {
                return Err(WindowError::argument(
                    "jitter",
                    format!(
                        "'{dim}' is not a window dimension (input_dims: {})",
                        shape
                            .sizes
                            .iter()
                            .map(|(d, _)| d.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            };
            jitter[d] = *bound;
        }
        let position = |name: &str, argument: &str| {
            variables.iter().position(|v| *v == name).ok_or_else(|| {
                WindowError::argument(
                    argument,
                    format!(
                        "unknown variable '{name}' (variables: {})",
                        variables.join(", ")
                    ),
                )
            })
        };
        let inputs: Vec<usize> = match &spec.inputs {
            None => (0..variables.len()).collect(),
            Some(given) if given.is_empty() => {
                return Err(WindowError::argument(
                    "inputs",
                    format!(
                        "names no variable (variables: {}); leave it out for every one",
                        variables.join(", ")
                    ),
                ))
            }
            Some(given) => {
                let mut inputs = Vec::new();
                for v in given {
                    let p = position(v, "inputs")?;
                    if inputs.contains(&p) {
                        return Err(WindowError::argument(
                            "inputs",
                            format!("'{v}' is given twice"),
                        ));
                    }
                    inputs.push(p);
                }
                inputs.sort_unstable();
                inputs
            }
        };
        if spec.history == 0 {
            return Err(WindowError::argument("history", "must be at least 1 step"));
        }
        if !spec.has_roles() && sources.list.len() == 1 {
            let layout = Self {
                roles_given: false,
                lead: None,
                roles: vec![Role {
                    name: "inputs",
                    validity: spec.valid_inputs,
                    channels: inputs
                        .into_iter()
                        .map(|variable| Channel {
                            variable,
                            step: 0,
                            slot: 0,
                            fixed: Vec::new(),
                            part: 0,
                        })
                        .collect(),
                }],
                jitter,
                channel_axes: Vec::new(),
                parts: vec![vec![Vec::new()]; variables.len()],
            };
            return Ok((layout, shape.clone()));
        }
        // The reference's dimensions outside the windows and the lead
        // dimension: every selected index a channel.
        let mut grid_shape = shape.clone();
        let mut channel_axes = Vec::new();
        for (d, name) in dims.iter().enumerate() {
            if Some(d) == lead || shape.sizes.iter().any(|(w, _)| w == name) {
                continue;
            }
            let len = match selection.ranges(d) {
                [one] => one.end - one.start,
                [] => 0,
                _ => {
                    return Err(WindowError::argument(
                        "where",
                        format!("selects separate ranges along '{name}', whose every index becomes channels; select one range"),
                    ))
                }
            };
            if len == 0 {
                return Err(WindowError::argument(
                    "where",
                    format!("selects nothing along '{name}'"),
                ));
            }
            grid_shape.sizes.push((name.to_string(), len));
            grid_shape.overlaps.push((name.to_string(), len - 1));
            channel_axes.push(d);
        }
        // Each variable's channel indices: its source's channel dimensions,
        // in C order.
        let fixed_of: Vec<Vec<Vec<(usize, u64)>>> = (0..sources.flat.len())
            .map(|f| {
                let (s, _) = sources.flat[f];
                let mut tuples: Vec<Vec<(usize, u64)>> = vec![Vec::new()];
                for (sd, link) in sources.links[s].iter().enumerate() {
                    let indices: Vec<u64> = if s == 0 && channel_axes.contains(&sd) {
                        selection
                            .ranges(sd)
                            .iter()
                            .flat_map(|r| r.clone())
                            .collect()
                    } else if let Link::Channel { indices } = link {
                        indices.clone()
                    } else {
                        continue;
                    };
                    tuples = tuples
                        .iter()
                        .flat_map(|t| {
                            indices.iter().map(move |&k| {
                                let mut t = t.clone();
                                t.push((sd, k));
                                t
                            })
                        })
                        .collect();
                }
                tuples
            })
            .collect();
        let channels_of = |variable: usize, step: i64, slot: u64| {
            fixed_of[variable]
                .iter()
                .enumerate()
                .map(move |(part, fixed)| Channel {
                    variable,
                    step,
                    slot,
                    fixed: fixed.clone(),
                    part,
                })
                .collect::<Vec<_>>()
        };
        let Some(d) = lead else {
            if spec.history > 1 || !spec.targets.is_empty() {
                return Err(WindowError::Internal(
                    "history or targets without a lead dimension".into(),
                ));
            }
            let layout = Self {
                roles_given: true,
                lead: None,
                roles: vec![Role {
                    name: "inputs",
                    validity: spec.valid_inputs,
                    channels: inputs.iter().flat_map(|&v| channels_of(v, 0, 0)).collect(),
                }],
                jitter,
                channel_axes,
                parts: fixed_of,
            };
            return Ok((layout, grid_shape));
        };
        let lead_name = dims[d];
        let ranges = selection.ranges(d);
        let range = match ranges {
            [] => 0..0,
            [one] => one.clone(),
            _ => {
                return Err(WindowError::argument(
                    "where",
                    format!("selects separate ranges along '{lead_name}', the dimension of history and lead times; select one range"),
                ))
            }
        };
        let step = StepSize::of(table, d, &range)?;
        // (variable, step) of the targets.
        let mut targets: Vec<(usize, i64)> = Vec::new();
        for (variable, leads) in &spec.targets {
            let v = position(variable, "targets")?;
            if leads.is_empty() {
                return Err(WindowError::argument(
                    "targets",
                    format!("'{variable}' has no lead time"),
                ));
            }
            for lead in leads {
                let steps = step.steps(lead, lead_name)?;
                if !targets.contains(&(v, steps)) {
                    targets.push((v, steps));
                }
            }
        }
        let history = i64::try_from(spec.history).unwrap_or(i64::MAX);
        let first = targets
            .iter()
            .map(|&(_, s)| s)
            .chain([1 - history])
            .min()
            .unwrap_or(0);
        let last = targets
            .iter()
            .map(|&(_, s)| s)
            .chain([0])
            .max()
            .unwrap_or(0);
        let span = last.abs_diff(first) + 1;
        let anchor = first.unsigned_abs();
        let length = range.end - range.start;
        if span > length {
            // The history alone past the selection names it, else the lead
            // times that reach furthest.
            let argument = if spec.history > length {
                "history"
            } else if targets.iter().any(|&(_, s)| s == last || s == first) {
                "targets"
            } else {
                "history"
            };
            return Err(WindowError::argument(
                argument,
                format!(
                    "a sample spans {span} steps of '{lead_name}' (history {} and lead times up to {last:+}), more than the {length} selected",
                    spec.history
                ),
            ));
        }
        let slot = |s: i64| (s - first).unsigned_abs();
        let mut input_channels = Vec::new();
        for s in (1 - history)..=0 {
            for &variable in &inputs {
                input_channels.extend(channels_of(variable, s, slot(s)));
            }
        }
        let mut roles = vec![Role {
            name: "inputs",
            validity: spec.valid_inputs,
            channels: input_channels,
        }];
        if !targets.is_empty() {
            targets.sort_unstable_by_key(|&(v, s)| (s, v));
            roles.push(Role {
                name: "targets",
                validity: spec.valid_targets,
                channels: targets
                    .into_iter()
                    .flat_map(|(variable, s)| channels_of(variable, s, slot(s)))
                    .collect(),
            });
        }
        grid_shape.sizes.push((lead_name.to_string(), span));
        grid_shape.overlaps.push((lead_name.to_string(), span - 1));
        Ok((
            Self {
                roles_given: true,
                lead: Some(LeadAxis {
                    axis: d,
                    anchor,
                    span,
                }),
                roles,
                jitter,
                channel_axes,
                parts: fixed_of,
            },
            grid_shape,
        ))
    }

    /// Whether any jitter is asked for.
    pub fn jittered(&self) -> bool {
        self.jitter.iter().any(|&j| j > 0)
    }

    /// Whether every sample is kept whatever is missing.
    pub fn keeps_everything(&self) -> bool {
        self.roles.iter().all(|r| r.validity == Validity::Any)
    }

    /// The box of channel `channel` of the window at `window` (its extent,
    /// jitter applied): the window, one step along the lead axis.
    pub fn plane(&self, window: &[Range<u64>], channel: &Channel) -> Vec<Range<u64>> {
        let mut plane = window.to_vec();
        if let Some(lead) = self.lead {
            let start = window[lead.axis].start + channel.slot;
            plane[lead.axis] = start..start + 1;
        }
        plane
    }

    /// Whether grid axis `d` is a plane's: a window dimension that is
    /// neither the lead dimension nor a channel dimension.
    pub fn in_plane(&self, d: usize) -> bool {
        self.lead.is_none_or(|l| l.axis != d) && !self.channel_axes.contains(&d)
    }

    /// The sizes of a channel's plane: the window sizes along window
    /// dimensions but the lead and channel dimensions.
    pub fn plane_sizes(&self, window_sizes: &[(usize, u64)]) -> Vec<u64> {
        window_sizes
            .iter()
            .filter(|(d, _)| self.in_plane(*d))
            .map(|&(_, s)| s)
            .collect()
    }

    /// A description of what decides which samples are kept (for the
    /// index cache's key).
    pub fn rule(&self) -> String {
        let roles: Vec<String> = self
            .roles
            .iter()
            .map(|r| {
                let channels: Vec<String> = r
                    .channels
                    .iter()
                    .map(|c| format!("{}@{}{:?}", c.variable, c.slot, c.fixed))
                    .collect();
                format!("{}:{:?}:[{}]", r.name, r.validity, channels.join(","))
            })
            .collect();
        format!("{:?} {}", self.lead, roles.join(" "))
    }
}

/// The lead dimension's number in `table` (the reference's): the one
/// named, else the only dimension outside the window dimensions whose
/// coordinate holds times (or a model calendar's dates as numbers); `None` when there is no such dimension and
/// neither history nor targets need one.
pub fn lead_dimension(
    table: &GridTable,
    shape: &WindowShape,
    spec: &SampleSpec,
) -> Result<Option<usize>, WindowError> {
    let dims: Vec<&str> = table.dims.iter().map(|d| d.name.as_str()).collect();
    let in_window = |name: &str| shape.sizes.iter().any(|(d, _)| d == name);
    if let Some(name) = &spec.lead_dim {
        let d = dims.iter().position(|d| d == name).ok_or_else(|| {
            WindowError::argument(
                "history",
                format!(
                    "unknown dimension '{name}' (dimensions: {})",
                    dims.join(", ")
                ),
            )
        })?;
        if in_window(name) {
            return Err(WindowError::argument(
                "history",
                format!("'{name}' is a window dimension (in input_dims); history and lead times run along a dimension outside input_dims"),
            ));
        }
        return Ok(Some(d));
    }
    // Times, or the numbers of a model calendar's dates kept as numbers
    // (a daily `360_day` coordinate holding the 30th of February).
    let times: Vec<usize> = (0..dims.len())
        .filter(|&d| {
            let dim = &table.dims[d];
            !in_window(dims[d])
                && (matches!(dim.coordinate.data_type(), DataType::Timestamp(_, _))
                    || dim.model_calendar().is_some())
        })
        .collect();
    let needed = spec.history > 1 || !spec.targets.is_empty();
    match times.as_slice() {
        [d] => Ok(Some(*d)),
        [] if !needed => Ok(None),
        _ => Err(WindowError::argument(
            "history",
            format!(
                "name the dimension of history and lead times (history={{'dim': steps}}): {} dimensions outside input_dims hold times",
                times.len()
            ),
        )),
    }
}

/// The step of the lead dimension's coordinate over the selected range,
/// to turn lead times in coordinate units into steps.
enum StepSize {
    /// Times evenly spaced by this many units of `unit`.
    Time { step: i64, unit: TimeUnit },
    /// Not times, or not evenly spaced: lead times in steps only.
    Steps { why: String },
}

impl StepSize {
    fn of(table: &GridTable, d: usize, range: &Range<u64>) -> Result<Self, WindowError> {
        let dim = &table.dims[d];
        let model_calendar = dim.model_calendar();
        let unit = match dim.coordinate.data_type() {
            DataType::Timestamp(unit, _) => unit,
            _ if model_calendar.is_some() => TimeUnit::Nanosecond,
            _ => {
                return Ok(Self::Steps {
                    why: format!("'{}' does not hold times", dim.name),
                })
            }
        };
        let len = range.end - range.start;
        if len < 2 {
            return Ok(Self::Steps {
                why: format!("one step of '{}' is selected", dim.name),
            });
        }
        if let Some(time) = model_calendar {
            return Ok(Self::in_calendar(dim, time, range));
        }
        let values = dim
            .coordinate
            .slice(range.start, len)
            .and_then(|a| cast(&a, &DataType::Int64))
            .map_err(|e| WindowError::Internal(e.to_string()))?;
        let values = values.as_primitive::<Int64Type>();
        if values.null_count() > 0 {
            return Ok(Self::Steps {
                why: format!("'{}' has missing times", dim.name),
            });
        }
        let step = values.value(1).wrapping_sub(values.value(0));
        let even = values
            .values()
            .windows(2)
            .all(|w| w[1].checked_sub(w[0]) == Some(step));
        Ok(if even && step > 0 {
            Self::Time { step, unit }
        } else {
            Self::Steps {
                why: format!("the times of '{}' are not evenly spaced", dim.name),
            }
        })
    }

    /// The step of times of a model calendar, in its own days (a 6-hourly
    /// `noleap` series is evenly spaced across the 29th of February its
    /// timestamps skip; see [`CalendarSeconds`]).
    fn in_calendar(dim: &Dimension, time: CfTime, range: &Range<u64>) -> Self {
        let not_even = || Self::Steps {
            why: format!(
                "the times of '{}' are not evenly spaced in its {} calendar",
                dim.name,
                time.calendar().name()
            ),
        };
        // Any date of every calendar: only differences count.
        let origin = Date {
            year: 2000,
            month: 1,
            day: 1,
        };
        let seconds = match CalendarSeconds::new(&dim.name, &dim.coordinate, time, origin) {
            Ok(seconds) => seconds,
            Err(why) => return Self::Steps { why },
        };
        let at = |position| seconds.seconds(position).unwrap_or(f64::NAN);
        let step = at(range.start + 1) - at(range.start);
        let even = (range.start + 1..range.end).all(|p| at(p) - at(p - 1) == step);
        let nanos = step * 1e9;
        if even && step > 0.0 && nanos.fract() == 0.0 && nanos < i64::MAX as f64 {
            Self::Time {
                step: nanos as i64,
                unit: TimeUnit::Nanosecond,
            }
        } else {
            not_even()
        }
    }

    /// The steps of lead time `text` (`"+6h"`, `"-1"`): a whole number of
    /// steps, or a duration (humantime's units: `30min`, `6h`, `1d`, `2w`).
    fn steps(&self, text: &str, dim: &str) -> Result<i64, WindowError> {
        let error =
            |m: String| WindowError::argument("targets", format!("lead time '{text}': {m}"));
        let trimmed = text.trim();
        let (sign, body) = match trimmed.strip_prefix('-') {
            Some(rest) => (-1i64, rest.trim()),
            None => (1, trimmed.strip_prefix('+').unwrap_or(trimmed).trim()),
        };
        if !body.is_empty() && body.bytes().all(|b| b.is_ascii_digit()) {
            let steps: i64 = body.parse().map_err(|_| error("too many steps".into()))?;
            return Ok(sign * steps);
        }
        let duration = humantime::parse_duration(body).map_err(|e| {
            error(format!(
                "{e}; expected steps ('+1') or a duration ('+6h', '+30min', '+1d')"
            ))
        })?;
        let (step, unit) = match self {
            Self::Time { step, unit } => (*step, *unit),
            Self::Steps { why } => {
                return Err(error(format!("{why}; give lead times in steps ('+1')")))
            }
        };
        let nanos_per: u128 = match unit {
            TimeUnit::Second => 1_000_000_000,
            TimeUnit::Millisecond => 1_000_000,
            TimeUnit::Microsecond => 1_000,
            TimeUnit::Nanosecond => 1,
        };
        let nanos = duration.as_nanos();
        let whole = nanos % nanos_per == 0 && (nanos / nanos_per).is_multiple_of(step as u128);
        if !whole {
            return Err(error(format!(
                "is not a whole number of the steps of '{dim}' ({})",
                humantime::format_duration(std::time::Duration::from_nanos(
                    (step as u128 * nanos_per).min(u64::MAX as u128) as u64
                ))
            )));
        }
        let steps = i64::try_from(nanos / nanos_per / step as u128)
            .map_err(|_| error("too long".into()))?;
        Ok(sign * steps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lead_times_become_steps() {
        let hours = StepSize::Time {
            step: 6 * 3_600_000_000_000,
            unit: TimeUnit::Nanosecond,
        };
        assert_eq!(hours.steps("+6h", "time").unwrap(), 1);
        assert_eq!(hours.steps("+12h", "time").unwrap(), 2);
        assert_eq!(hours.steps("-1d", "time").unwrap(), -4);
        assert_eq!(hours.steps("+2", "time").unwrap(), 2);
        assert_eq!(hours.steps("3", "time").unwrap(), 3);
        assert!(hours.steps("+3h", "time").is_err());
        assert!(hours.steps("+6 parsecs", "time").is_err());
        assert!(hours.steps("soon", "time").is_err());
        let steps = StepSize::Steps {
            why: "'level' does not hold times".into(),
        };
        assert_eq!(steps.steps("+1", "level").unwrap(), 1);
        let e = steps.steps("+6h", "level").unwrap_err().to_string();
        assert!(e.contains("does not hold times"), "{e}");
    }
}

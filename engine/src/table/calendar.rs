//! The times of model calendars (`noleap`, `all_leap`, `360_day`,
//! `julian`) in the calendar's own days.
//!
//! xarray decodes such dates to cftime objects, and a coordinate of them
//! is evenly spaced when the model's steps are (six hours, a day),
//! although the timestamps zarrfusion shows for them (the dates' fields)
//! skip the days the model lacks and cannot hold the ones it alone has
//! (a `360_day` coordinate holding the 30th of February keeps its numbers).
//! What needs the spacing of times (a transform's frequencies, a loader's
//! lead times) counts them here: seconds since a date of the calendar, as
//! cftime's `date2num` counts them.

use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, AsArray};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Float64Type, Int64Type, TimeUnit};
use zarrfusion_udfs::calendar::Date;
use zarrfusion_udfs::cf_time::CfTime;

use super::{Coordinate, CoordinateFormula, RegularCoordinate};

/// The CF time encoding of a coordinate array with these attributes, when
/// its dates are of a model calendar (the calendars xarray decodes to
/// cftime dates).
pub fn model_calendar(attributes: &serde_json::Map<String, serde_json::Value>) -> Option<CfTime> {
    let units = attributes.get("units")?.as_str()?;
    let calendar = attributes.get("calendar").and_then(|c| c.as_str());
    CfTime::parse(units, calendar)
        .ok()
        .flatten()
        .filter(|time| !time.calendar().is_gregorian())
}

/// The times of a coordinate of a model calendar's dates as seconds since
/// a date of the calendar, in the calendar's own days, computed per
/// position from the decoded timestamps (the dates' fields) or from the
/// numbers kept for dates without one (the 30th of February of `360_day`).
#[derive(Debug)]
pub struct CalendarSeconds {
    values: CalendarValues,
    time: CfTime,
    origin: Date,
}

/// The coordinate [`CalendarSeconds`] reads.
#[derive(Debug)]
enum CalendarValues {
    /// Decoded dates, as timestamps' nanoseconds.
    Timestamps(ArrayRef),
    /// Numbers of the encoding's units.
    Counts(ArrayRef),
    /// A regular coordinate of either: its timestamps' nanoseconds per
    /// stored count, or none for numbers.
    Regular {
        values: Arc<RegularCoordinate>,
        nanos: Option<f64>,
    },
}

impl CalendarSeconds {
    /// The seconds since `origin` of `dim`'s coordinate `coordinate`,
    /// encoded as `time`; every value is checked to have a date here, so
    /// that reading one later cannot fail.
    pub fn new(
        dim: &str,
        coordinate: &Coordinate,
        time: CfTime,
        origin: Date,
    ) -> Result<Self, String> {
        let timestamps = matches!(coordinate.data_type(), DataType::Timestamp(_, _));
        let bad = |other: &DataType| {
            format!(
                "coordinate '{dim}' of {} dates is {other}, not times or numbers",
                time.calendar().name()
            )
        };
        let values = match coordinate {
            Coordinate::Values(values) if values.null_count() > 0 => {
                return Err(format!("coordinate '{dim}' has missing values"))
            }
            Coordinate::Values(values) if timestamps => CalendarValues::Timestamps(
                cast(values, &DataType::Timestamp(TimeUnit::Nanosecond, None))
                    .and_then(|v| cast(&v, &DataType::Int64))
                    .map_err(|e| e.to_string())?,
            ),
            Coordinate::Values(values) if values.data_type().is_numeric() => {
                CalendarValues::Counts(cast(values, &DataType::Float64).map_err(|e| e.to_string())?)
            }
            Coordinate::Regular(regular) if timestamps || regular.data_type().is_numeric() => {
                CalendarValues::Regular {
                    values: Arc::clone(regular),
                    nanos: match regular.data_type() {
                        DataType::Timestamp(unit, _) => Some(1e9 / ticks_per_second(unit)),
                        _ => None,
                    },
                }
            }
            other => return Err(bad(&other.data_type())),
        };
        let seconds = Self {
            values,
            time,
            origin,
        };
        for position in 0..coordinate.len() {
            if seconds.seconds(position).is_none() {
                return Err(format!(
                    "coordinate '{dim}' holds a value at position {position} that is no date of the \
                     {} calendar",
                    time.calendar().name()
                ));
            }
        }
        Ok(seconds)
    }

    /// The seconds of the value at `position`.
    pub fn seconds(&self, position: u64) -> Option<f64> {
        let i = position as usize;
        let (timestamp, count) = match &self.values {
            CalendarValues::Timestamps(values) => {
                (Some(values.as_primitive::<Int64Type>().value(i)), None)
            }
            CalendarValues::Counts(values) => {
                (None, Some(values.as_primitive::<Float64Type>().value(i)))
            }
            CalendarValues::Regular {
                values,
                nanos: Some(nanos),
            } => (
                Some((values.number_at(position) * nanos).round() as i64),
                None,
            ),
            CalendarValues::Regular { values, .. } => (None, Some(values.number_at(position))),
        };
        match (timestamp, count) {
            (Some(timestamp), _) => self.time.timestamp_seconds_since(self.origin, timestamp),
            (_, Some(count)) => self.time.seconds_since(self.origin, count),
            _ => None,
        }
    }
}

impl CoordinateFormula for CalendarSeconds {
    fn positions(&self) -> u64 {
        match &self.values {
            CalendarValues::Timestamps(values) | CalendarValues::Counts(values) => {
                values.len() as u64
            }
            CalendarValues::Regular { values, .. } => values.len(),
        }
    }

    fn value_at(&self, position: u64) -> f64 {
        // Every position was checked when built.
        self.seconds(position).unwrap_or(f64::NAN)
    }
}

/// Ticks of a time `unit` per second.
pub fn ticks_per_second(unit: &TimeUnit) -> f64 {
    match unit {
        TimeUnit::Second => 1.0,
        TimeUnit::Millisecond => 1e3,
        TimeUnit::Microsecond => 1e6,
        TimeUnit::Nanosecond => 1e9,
    }
}

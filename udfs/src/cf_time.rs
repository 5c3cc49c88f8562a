//! CF time conventions: `<unit> since <reference date>` and durations.
//!
//! These are the encodings xarray decodes by default (`decode_times=True`):
//! a number of units since a reference instant becomes a timestamp, for the
//! `standard`, `gregorian` and `proleptic_gregorian` calendars. All results are
//! nanoseconds since the Unix epoch, as numpy's `datetime64[ns]`.

use std::fmt;

use chrono::{NaiveDate, NaiveDateTime, NaiveTime};

/// A time unit of the CF conventions, as nanoseconds per unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimeUnit {
    nanos: i64,
}

impl TimeUnit {
    /// Parses a CF unit name (`days`, `hours`, `h`, `minutes`, `seconds`, `ms`, ...).
    pub fn parse(name: &str) -> Option<Self> {
        let nanos = match name.trim().to_ascii_lowercase().as_str() {
            "days" | "day" | "d" => 86_400_000_000_000,
            "hours" | "hour" | "hrs" | "hr" | "h" => 3_600_000_000_000,
            "minutes" | "minute" | "mins" | "min" => 60_000_000_000,
            "seconds" | "second" | "secs" | "sec" | "s" => 1_000_000_000,
            "milliseconds" | "millisecond" | "msecs" | "msec" | "ms" => 1_000_000,
            "microseconds" | "microsecond" | "usecs" | "usec" | "us" => 1_000,
            "nanoseconds" | "nanosecond" | "nsecs" | "nsec" | "ns" => 1,
            _ => return None,
        };
        Some(Self { nanos })
    }

    /// Nanoseconds in one unit.
    pub fn nanos(self) -> i64 {
        self.nanos
    }
}

/// Errors from parsing CF time attributes or converting values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CfTimeError {
    /// The `units` attribute is not `<unit> since <date>`.
    InvalidUnits(String),
    /// A calendar other than standard, gregorian and proleptic_gregorian.
    UnsupportedCalendar(String),
    /// A value that does not fit in `datetime64[ns]`.
    OutOfRange(String),
}

impl fmt::Display for CfTimeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidUnits(u) => write!(f, "invalid CF time units '{u}'"),
            Self::UnsupportedCalendar(c) => write!(
                f,
                "unsupported CF calendar '{c}' (supported: standard, gregorian, proleptic_gregorian)"
            ),
            Self::OutOfRange(v) => write!(f, "time value {v} is outside the datetime64[ns] range"),
        }
    }
}

impl std::error::Error for CfTimeError {}

/// Returns true for the calendars that map onto proleptic Gregorian timestamps.
pub fn is_supported_calendar(calendar: &str) -> bool {
    matches!(
        calendar.trim().to_ascii_lowercase().as_str(),
        "standard" | "gregorian" | "proleptic_gregorian"
    )
}

/// A parsed `<unit> since <date>` encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CfTime {
    unit: TimeUnit,
    /// Reference instant, nanoseconds since the Unix epoch (UTC).
    epoch_nanos: i64,
}

impl CfTime {
    /// Parses `units` (and an optional `calendar`) into an encoding.
    ///
    /// Returns `Ok(None)` when `units` has no `since` (it is not a time).
    pub fn parse(units: &str, calendar: Option<&str>) -> Result<Option<Self>, CfTimeError> {
        let lower = units.to_ascii_lowercase();
        let Some(pos) = lower.find(" since ") else {
            return Ok(None);
        };
        if let Some(cal) = calendar {
            if !is_supported_calendar(cal) {
                return Err(CfTimeError::UnsupportedCalendar(cal.to_string()));
            }
        }
        let unit = TimeUnit::parse(&units[..pos])
            .ok_or_else(|| CfTimeError::InvalidUnits(units.to_string()))?;
        let reference = parse_reference(units[pos + 7..].trim())
            .ok_or_else(|| CfTimeError::InvalidUnits(units.to_string()))?;
        let epoch_nanos = reference
            .and_utc()
            .timestamp_nanos_opt()
            .ok_or_else(|| CfTimeError::OutOfRange(units.to_string()))?;
        Ok(Some(Self { unit, epoch_nanos }))
    }

    /// The unit of the encoded numbers.
    pub fn unit(&self) -> TimeUnit {
        self.unit
    }

    /// Decodes an integer count of units.
    pub fn decode_i64(&self, value: i64) -> Result<i64, CfTimeError> {
        value
            .checked_mul(self.unit.nanos)
            .and_then(|v| v.checked_add(self.epoch_nanos))
            .ok_or_else(|| CfTimeError::OutOfRange(value.to_string()))
    }

    /// Decodes a (possibly fractional) count of units, rounded to the nanosecond.
    pub fn decode_f64(&self, value: f64) -> Result<i64, CfTimeError> {
        // Offset in f64 (exact for fractions of the unit), reference in i64:
        // adding the reference as f64 would lose nanoseconds.
        let offset = (value * self.unit.nanos as f64).round();
        if !(offset.is_finite() && offset >= i64::MIN as f64 && offset < i64::MAX as f64) {
            return Err(CfTimeError::OutOfRange(value.to_string()));
        }
        (offset as i64)
            .checked_add(self.epoch_nanos)
            .ok_or_else(|| CfTimeError::OutOfRange(value.to_string()))
    }
}

/// Parses the reference date of CF units: `1900-01-01`, `1900-1-1 00:00:00`,
/// `2000-01-01T12:00:00.5Z`, `1970-01-01 00:00:00 UTC`, `2000-01-01 00:00 +00:00`.
fn parse_reference(text: &str) -> Option<NaiveDateTime> {
    let text = text.trim();
    let text = text
        .strip_suffix("UTC")
        .or_else(|| text.strip_suffix('Z'))
        .unwrap_or(text)
        .trim();
    let (date_part, rest) = match text.find(['T', ' ']) {
        Some(i) => (&text[..i], text[i + 1..].trim()),
        None => (text, ""),
    };
    let mut fields = date_part.splitn(3, '-');
    let year: i32 = fields.next()?.parse().ok()?;
    let month: u32 = fields.next().unwrap_or("1").parse().ok()?;
    let day: u32 = fields.next().unwrap_or("1").parse().ok()?;
    let date = NaiveDate::from_ymd_opt(year, month, day)?;
    // Split off a numeric timezone offset (`+00:00`, `-05`), which shifts the instant.
    let (time_part, offset_minutes) = split_offset(rest)?;
    let time = if time_part.is_empty() {
        NaiveTime::MIN
    } else {
        parse_time_of_day(time_part)?
    };
    date.and_time(time)
        .checked_sub_signed(chrono::TimeDelta::try_minutes(offset_minutes)?)
}

/// Splits a numeric timezone offset (`+00:00`, `-0530`, `+5`) off a time
/// of day: the time and the offset in minutes (at most a day either way).
fn split_offset(text: &str) -> Option<(&str, i64)> {
    let Some(i) = text.rfind(['+', '-']) else {
        return Some((text, 0));
    };
    let (time, offset) = (text[..i].trim(), &text[i..]);
    let sign = if offset.starts_with('-') { -1 } else { 1 };
    let digits = offset[1..].trim();
    let (hours, minutes): (i64, i64) = match digits.split_once(':') {
        Some((h, m)) => (h.parse().ok()?, m.parse().ok()?),
        None if digits.len() == 4 => (
            digits.get(..2)?.parse().ok()?,
            digits.get(2..)?.parse().ok()?,
        ),
        None => (digits.parse().ok()?, 0),
    };
    if !(0..=24).contains(&hours) || !(0..60).contains(&minutes) {
        return None;
    }
    Some((time, sign * (hours * 60 + minutes)))
}

fn parse_time_of_day(text: &str) -> Option<NaiveTime> {
    let mut fields = text.splitn(3, ':');
    let hour: u32 = fields.next()?.parse().ok()?;
    let minute: u32 = fields.next().unwrap_or("0").parse().ok()?;
    let seconds: f64 = fields.next().unwrap_or("0").parse().ok()?;
    let whole = seconds.trunc() as u32;
    let nanos = ((seconds - seconds.trunc()) * 1e9).round() as u32;
    NaiveTime::from_hms_nano_opt(hour, minute, whole, nanos)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(text: &str) -> i64 {
        NaiveDateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S")
            .unwrap()
            .and_utc()
            .timestamp_nanos_opt()
            .unwrap()
    }

    #[test]
    fn parses_common_units() {
        let t = CfTime::parse("hours since 1900-01-01", None)
            .unwrap()
            .unwrap();
        assert_eq!(t.decode_i64(24).unwrap(), ts("1900-01-02 00:00:00"));
        let t = CfTime::parse("days since 1970-1-1 00:00:00", Some("proleptic_gregorian"))
            .unwrap()
            .unwrap();
        assert_eq!(t.decode_f64(1.5).unwrap(), ts("1970-01-02 12:00:00"));
        let t = CfTime::parse("seconds since 2020-01-01", None)
            .unwrap()
            .unwrap();
        assert_eq!(
            t.decode_f64(1.25).unwrap(),
            ts("2020-01-01 00:00:01") + 250_000_000
        );
        let t = CfTime::parse("seconds since 2000-01-01T00:00:00Z", Some("standard"))
            .unwrap()
            .unwrap();
        assert_eq!(t.decode_i64(61).unwrap(), ts("2000-01-01 00:01:01"));
        let t = CfTime::parse("minutes since 2000-01-01 06:00 +06:00", None)
            .unwrap()
            .unwrap();
        assert_eq!(t.decode_i64(0).unwrap(), ts("2000-01-01 00:00:00"));
    }

    #[test]
    fn rejects_bad_input() {
        assert_eq!(CfTime::parse("kelvin", None), Ok(None));
        assert!(CfTime::parse("fortnights since 2000-01-01", None).is_err());
        assert!(CfTime::parse("days since 2000-01-01", Some("noleap")).is_err());
        let t = CfTime::parse("days since 2000-01-01", None)
            .unwrap()
            .unwrap();
        assert!(t.decode_i64(i64::MAX / 2).is_err());
    }

    #[test]
    fn hostile_offsets_are_invalid_units_not_panics() {
        for units in [
            "days since 2000-01-01 00:00 +99999999999999999:00",
            "days since 2000-01-01 00:00 +153722867280912930",
            "days since 2000-01-01 00:00 -9223372036854775807",
            "days since 2000-01-01 00:00 +1\u{e9}2",
            "days since 2000-01-01 00:00 +25:00",
            "days since 2000-01-01 00:00 +00:60",
        ] {
            assert!(
                matches!(
                    CfTime::parse(units, None),
                    Err(CfTimeError::InvalidUnits(_))
                ),
                "{units}"
            );
        }
        // The largest offsets still shift the instant.
        let east = CfTime::parse("hours since 2000-01-02 00:00 +24:00", None)
            .unwrap()
            .unwrap();
        assert_eq!(east.decode_i64(0).unwrap(), ts("2000-01-01 00:00:00"));
        let india = CfTime::parse("hours since 2000-01-01 05:30 +0530", None)
            .unwrap()
            .unwrap();
        assert_eq!(india.decode_i64(0).unwrap(), ts("2000-01-01 00:00:00"));
    }

    #[test]
    fn reference_dates_at_the_ends_of_the_calendar_are_errors() {
        for units in [
            "days since -262143-01-01 00:00 +01:00",
            "days since 262142-12-31 23:59 -01:00",
            "days since 9999999999-01-01",
        ] {
            assert!(CfTime::parse(units, None).is_err(), "{units}");
        }
    }

    proptest::proptest! {
        /// Any text parses to an encoding, `None` or an error, and any
        /// value decodes to a time or an error: never a panic.
        #[test]
        fn any_units_text_parses_without_panicking(units in "\\PC*", calendar in proptest::option::of("\\PC{0,12}"), value in proptest::num::f64::ANY, count in proptest::num::i64::ANY) {
            if let Ok(Some(t)) = CfTime::parse(&units, calendar.as_deref()) {
                let _ = t.decode_f64(value);
                let _ = t.decode_i64(count);
            }
        }

        /// Units shaped like CF's: dates near and past the ends of the
        /// calendar, fields just out of range, offsets of any length.
        #[test]
        fn cf_shaped_units_parse_without_panicking(
            unit in "(days|hours|minutes|seconds|milliseconds|weeks|d|h|s|[a-z]{0,6})",
            year in -400_000i64..400_000, month in 0i64..14, day in 0i64..33,
            hour in -1i64..26, minute in -1i64..62, second in proptest::num::f64::ANY,
            zone in "( ?[+-][0-9]{0,20}(:[0-9]{0,20})?| ?UTC| ?Z|)",
            separator in "[T ]",
            value in proptest::num::f64::ANY, count in proptest::num::i64::ANY,
        ) {
            let units = format!("{unit} since {year}-{month}-{day}{separator}{hour}:{minute}:{second}{zone}");
            if let Ok(Some(t)) = CfTime::parse(&units, Some("standard")) {
                let _ = t.decode_f64(value);
                let _ = t.decode_i64(count);
            }
        }
    }
}

//! CF time conventions: `<unit> since <reference date>` and durations.
//!
//! These are the encodings xarray decodes by default (`decode_times=True`):
//! a number of units since a reference date becomes a timestamp, in any of
//! CF's calendars ([`crate::calendar`]). All results are nanoseconds since
//! the Unix epoch, as numpy's `datetime64[ns]`.

use std::fmt;

use crate::calendar::{Calendar, Date};

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
    /// The `units` attribute is not `<unit> since <date>`, or its date is
    /// not a date of the calendar.
    InvalidUnits(String),
    /// A calendar that is none of CF's.
    UnsupportedCalendar(String),
    /// A value that does not fit in `datetime64[ns]`.
    OutOfRange(String),
    /// A date of the calendar that the proleptic Gregorian calendar lacks
    /// (the 30th of February of `360_day`), which has no timestamp.
    NoTimestamp {
        /// The calendar.
        calendar: Calendar,
        /// The date.
        date: Date,
    },
}

impl fmt::Display for CfTimeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidUnits(u) => write!(f, "invalid CF time units '{u}'"),
            Self::UnsupportedCalendar(c) => write!(
                f,
                "unsupported CF calendar '{c}' (supported: standard, gregorian, \
                 proleptic_gregorian, noleap, 365_day, all_leap, 366_day, 360_day, julian)"
            ),
            Self::OutOfRange(v) => write!(f, "time value {v} is outside the datetime64[ns] range"),
            Self::NoTimestamp { calendar, date } => write!(
                f,
                "the {} date {date} has no timestamp: the Gregorian calendar has no such day",
                calendar.name()
            ),
        }
    }
}

impl std::error::Error for CfTimeError {}

/// Returns true for the calendars of the CF conventions (see [`Calendar`]).
pub fn is_supported_calendar(calendar: &str) -> bool {
    Calendar::parse(calendar).is_some()
}

/// Nanoseconds in a day.
const DAY: i128 = 86_400_000_000_000;

/// The years a reference date may have (those of chrono's dates).
const REFERENCE_YEARS: std::ops::RangeInclusive<i64> = -262_142..=262_142;

/// A parsed `<unit> since <date>` encoding in a calendar.
///
/// Values become timestamps as xarray shows them: in the `standard` and
/// `proleptic_gregorian` calendars the instant they count to; in the others
/// (decoded by xarray to cftime dates) the timestamp with the same date and
/// time of day, as `CFTimeIndex.to_datetimeindex()` gives it. A date the
/// Gregorian calendar lacks is [`CfTimeError::NoTimestamp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CfTime {
    unit: TimeUnit,
    calendar: Calendar,
    /// The reference instant: nanoseconds since the calendar's day 0
    /// (1970-01-01 for the Gregorian calendars, see [`crate::calendar`]).
    reference: i128,
}

impl CfTime {
    /// Parses `units` (and an optional `calendar`, `standard` when absent)
    /// into an encoding.
    ///
    /// Returns `Ok(None)` when `units` has no `since` (it is not a time).
    pub fn parse(units: &str, calendar: Option<&str>) -> Result<Option<Self>, CfTimeError> {
        let lower = units.to_ascii_lowercase();
        let Some(pos) = lower.find(" since ") else {
            return Ok(None);
        };
        let calendar = match calendar {
            Some(name) => Calendar::parse(name)
                .ok_or_else(|| CfTimeError::UnsupportedCalendar(name.to_string()))?,
            None => Calendar::Standard,
        };
        let unit = TimeUnit::parse(&units[..pos])
            .ok_or_else(|| CfTimeError::InvalidUnits(units.to_string()))?;
        let reference = parse_reference(units[pos + 7..].trim(), calendar)
            .ok_or_else(|| CfTimeError::InvalidUnits(units.to_string()))?;
        Ok(Some(Self {
            unit,
            calendar,
            reference,
        }))
    }

    /// The unit of the encoded numbers.
    pub fn unit(&self) -> TimeUnit {
        self.unit
    }

    /// The calendar of the encoded dates.
    pub fn calendar(&self) -> Calendar {
        self.calendar
    }

    /// Seconds from midnight of `origin` (a date of the calendar) to the
    /// instant a count of units (`value`) encodes, counted in the
    /// calendar's own days: what cftime's `date2num(date, "seconds since
    /// <origin>", calendar)` gives for the decoded date, as xrft counts the
    /// times of model calendars. `None` when `origin` is no date of the
    /// calendar or `value` is not finite.
    pub fn seconds_since(&self, origin: Date, value: f64) -> Option<f64> {
        let origin = i128::from(self.calendar.day_number(origin)?) * DAY;
        let seconds = value * (self.unit.nanos as f64 / 1e9);
        seconds
            .is_finite()
            .then(|| (self.reference - origin) as f64 / 1e9 + seconds)
    }

    /// [`Self::seconds_since`] for a timestamp this encoding decoded (see
    /// [`Self::decode_i64`]): the instant in the Gregorian calendars, else
    /// the calendar's date and time of day with the timestamp's fields.
    pub fn timestamp_seconds_since(&self, origin: Date, timestamp: i64) -> Option<f64> {
        let origin = self.calendar.day_number(origin)?;
        let (day, nanos) = self.day_of(timestamp)?;
        Some((day - origin) as f64 * 86_400.0 + nanos as f64 / 1e9)
    }

    /// The count of units that decodes to `timestamp` (the inverse of
    /// [`Self::decode_i64`]): `None` when it is no whole number of units
    /// or stands for no date of the calendar (the 29th of February in
    /// `noleap`), or the count overflows.
    pub fn encode(&self, timestamp: i64) -> Option<i64> {
        let (day, nanos) = self.day_of(timestamp)?;
        let offset = i128::from(day) * DAY + nanos - self.reference;
        let unit = i128::from(self.unit.nanos);
        (offset % unit == 0)
            .then(|| i64::try_from(offset / unit).ok())
            .flatten()
    }

    /// The calendar's day number of the date a decoded timestamp stands
    /// for, and the nanoseconds into it (see [`Self::timestamp_seconds_since`]).
    fn day_of(&self, timestamp: i64) -> Option<(i64, i128)> {
        let timestamp = i128::from(timestamp);
        let day = i64::try_from(timestamp.div_euclid(DAY)).ok()?;
        let day = if self.calendar.is_gregorian() {
            // Their day numbers count from 1970-01-01, as timestamps do.
            day
        } else {
            self.calendar
                .day_number(Calendar::ProlepticGregorian.date(day))?
        };
        Some((day, timestamp.rem_euclid(DAY)))
    }

    /// Decodes an integer count of units.
    pub fn decode_i64(&self, value: i64) -> Result<i64, CfTimeError> {
        let offset = i128::from(value) * i128::from(self.unit.nanos);
        self.decode(offset)
            .ok_or_else(|| CfTimeError::OutOfRange(value.to_string()))?
    }

    /// Decodes a (possibly fractional) count of units, rounded to the nanosecond.
    pub fn decode_f64(&self, value: f64) -> Result<i64, CfTimeError> {
        // Offset in f64 (exact for fractions of the unit), reference in
        // integers: adding the reference as f64 would lose nanoseconds.
        let offset = (value * self.unit.nanos as f64).round();
        if !(offset.is_finite() && offset.abs() < 1e30) {
            return Err(CfTimeError::OutOfRange(value.to_string()));
        }
        self.decode(offset as i128)
            .ok_or_else(|| CfTimeError::OutOfRange(value.to_string()))?
    }

    /// The date of the calendar and the nanoseconds into it that a count
    /// of units (`value`) encodes, whether or not the date has a timestamp
    /// (the 30th of February of `360_day` has none): `None` when `value`
    /// is not finite or the date is past the years 10^9.
    pub fn date_of(&self, value: f64) -> Option<(Date, i64)> {
        let offset = (value * self.unit.nanos as f64).round();
        if !(offset.is_finite() && offset.abs() < 1e30) {
            return None;
        }
        let instant = self.reference + offset as i128;
        let number = i64::try_from(instant.div_euclid(DAY))
            .ok()
            .filter(|n| n.abs() < 1_000_000_000)?;
        let nanos = i64::try_from(instant.rem_euclid(DAY)).ok()?;
        Some((self.calendar.date(number), nanos))
    }

    /// The count of units that encodes `date` of the calendar and `nanos`
    /// into it (the inverse of [`Self::date_of`]), as a float; `None` when
    /// the calendar has no such date.
    pub fn count_of(&self, date: Date, nanos: i64) -> Option<f64> {
        let instant = i128::from(self.calendar.day_number(date)?) * DAY + i128::from(nanos);
        Some(self.count_of_instant(instant))
    }

    /// The count of units that encodes the date and time `text` names in
    /// the calendar, written as CF units write their reference date
    /// (`2000-02-30`, `2000-02-30 12:00`): `None` when it names no date of
    /// the calendar (a literal compared with a time kept as numbers).
    pub fn count_of_text(&self, text: &str) -> Option<f64> {
        Some(self.count_of_instant(parse_reference(text, self.calendar)?))
    }

    /// The count of units that encodes `instant` (nanoseconds since the
    /// calendar's day 0).
    fn count_of_instant(&self, instant: i128) -> f64 {
        let offset = instant - self.reference;
        let unit = i128::from(self.unit.nanos);
        // Whole units and their remainder apart, so that large counts keep
        // every unit.
        (offset.div_euclid(unit)) as f64 + (offset.rem_euclid(unit)) as f64 / unit as f64
    }

    /// The timestamp `offset` nanoseconds after the reference: `None` when
    /// it is outside the timestamps' range.
    fn decode(&self, offset: i128) -> Option<Result<i64, CfTimeError>> {
        let instant = self.reference + offset;
        if self.calendar.is_gregorian() {
            return i64::try_from(instant).ok().map(Ok);
        }
        // By the date's fields. Timestamps span years 1677 to 2262: a day
        // number past 10^9 is none of theirs in any calendar.
        let number = i64::try_from(instant.div_euclid(DAY))
            .ok()
            .filter(|n| n.abs() < 1_000_000_000)?;
        let date = self.calendar.date(number);
        let Some(day) = Calendar::ProlepticGregorian.day_number(date) else {
            let calendar = self.calendar;
            return Some(Err(CfTimeError::NoTimestamp { calendar, date }));
        };
        i64::try_from(i128::from(day) * DAY + instant.rem_euclid(DAY))
            .ok()
            .map(Ok)
    }
}

/// Parses the reference date of CF units (`1900-01-01`, `1900-1-1
/// 00:00:00`, `2000-01-01T12:00:00.5Z`, `1970-01-01 00:00:00 UTC`,
/// `2000-01-01 00:00 +00:00`) in `calendar`: nanoseconds since its day 0.
fn parse_reference(text: &str, calendar: Calendar) -> Option<i128> {
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
    let year: i64 = fields.next()?.parse().ok()?;
    let month: u32 = fields.next().unwrap_or("1").parse().ok()?;
    let day: u32 = fields.next().unwrap_or("1").parse().ok()?;
    if !REFERENCE_YEARS.contains(&year) {
        return None;
    }
    let number = calendar.day_number(Date { year, month, day })?;
    // Split off a numeric timezone offset (`+00:00`, `-05`), which shifts the instant.
    let (time_part, offset_minutes) = split_offset(rest)?;
    let time = if time_part.is_empty() {
        0
    } else {
        parse_time_of_day(time_part)?
    };
    let reference = i128::from(number) * DAY + time - i128::from(offset_minutes) * 60_000_000_000;
    // Shifted by its offset, still a date of those years.
    let shifted = calendar.date(i64::try_from(reference.div_euclid(DAY)).ok()?);
    REFERENCE_YEARS.contains(&shifted.year).then_some(reference)
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

/// Nanoseconds into the day of `hh[:mm[:ss[.f]]]`.
fn parse_time_of_day(text: &str) -> Option<i128> {
    let mut fields = text.splitn(3, ':');
    let hour: u32 = fields.next()?.parse().ok()?;
    let minute: u32 = fields.next().unwrap_or("0").parse().ok()?;
    let seconds: f64 = fields.next().unwrap_or("0").parse().ok()?;
    if hour > 23 || minute > 59 || !(0.0..60.0).contains(&seconds) {
        return None;
    }
    let nanos = (seconds * 1e9).round() as i128;
    Some((i128::from(hour) * 60 + i128::from(minute)) * 60_000_000_000 + nanos)
}

#[cfg(test)]
mod tests {
    use super::*;

    use chrono::NaiveDateTime;

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

    /// Numbers in units of every calendar decode to the timestamps cftime
    /// gives them (the dates' fields), or fail as cftime's dates have no
    /// timestamp (`tests/fixtures/expected/cf_calendars.json`, written by
    /// `make_calendar_fixture.py`).
    #[test]
    fn every_calendar_decodes_as_cftime() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/expected/cf_calendars.json"
        );
        let cases: Vec<serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        assert!(cases.len() >= 40, "{} cases", cases.len());
        let (mut stamps, mut lacking, mut outside) = (0, 0, 0);
        for case in &cases {
            let (units, calendar) = (case["units"].as_str().unwrap(), case["calendar"].as_str());
            let time = CfTime::parse(units, calendar).unwrap().unwrap();
            let expected = case["expected"].as_array().unwrap();
            for (value, expected) in case["values"].as_array().unwrap().iter().zip(expected) {
                let decoded = match case["dtype"].as_str().unwrap() {
                    "int64" => time.decode_i64(value.as_i64().unwrap()),
                    _ => time.decode_f64(value.as_f64().unwrap()),
                };
                let context = format!("{value} {units} ({calendar:?})");
                match decoded {
                    Ok(nanos) => {
                        let got = chrono::DateTime::from_timestamp_nanos(nanos)
                            .naive_utc()
                            .format("%Y-%m-%dT%H:%M:%S%.f")
                            .to_string();
                        assert_eq!(Some(got.as_str()), expected.as_str(), "{context}");
                        stamps += 1;
                    }
                    Err(CfTimeError::NoTimestamp { date, .. }) => {
                        let want = expected["no_timestamp"].as_str();
                        assert_eq!(Some(date.to_string().as_str()), want, "{context}");
                        lacking += 1;
                    }
                    Err(CfTimeError::OutOfRange(_)) => {
                        assert_eq!(expected.as_str(), Some("out_of_range"), "{context}");
                        outside += 1;
                    }
                    Err(other) => panic!("{context}: {other}"),
                }
            }
        }
        assert!(
            stamps > 500 && lacking > 20 && outside > 50,
            "{stamps} {lacking} {outside}"
        );
    }

    #[test]
    fn rejects_bad_input() {
        assert_eq!(CfTime::parse("kelvin", None), Ok(None));
        assert!(CfTime::parse("fortnights since 2000-01-01", None).is_err());
        assert!(CfTime::parse("days since 2000-01-01", Some("none")).is_err());
        assert!(CfTime::parse("days since 2001-02-29", Some("noleap")).is_err());
        assert!(CfTime::parse("days since 2001-02-30", Some("360_day")).is_ok());
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

        /// Units shaped like CF's, in each of its calendars: dates near and
        /// past the ends of the calendar, fields just out of range, offsets
        /// of any length.
        #[test]
        fn cf_shaped_units_parse_without_panicking(
            unit in "(days|hours|minutes|seconds|milliseconds|weeks|d|h|s|[a-z]{0,6})",
            year in -400_000i64..400_000, month in 0i64..14, day in 0i64..33,
            hour in -1i64..26, minute in -1i64..62, second in proptest::num::f64::ANY,
            zone in "( ?[+-][0-9]{0,20}(:[0-9]{0,20})?| ?UTC| ?Z|)",
            separator in "[T ]",
            calendar in "(standard|proleptic_gregorian|noleap|all_leap|360_day|julian)",
            value in proptest::num::f64::ANY, count in proptest::num::i64::ANY,
        ) {
            let units = format!("{unit} since {year}-{month}-{day}{separator}{hour}:{minute}:{second}{zone}");
            if let Ok(Some(t)) = CfTime::parse(&units, Some(&calendar)) {
                let _ = t.decode_f64(value);
                let _ = t.decode_i64(count);
            }
        }
    }

    #[test]
    fn seconds_since_count_the_calendars_own_days() {
        let origin = Date {
            year: 1800,
            month: 1,
            day: 1,
        };
        // Two hundred years of the calendar to 2000-01-01, then the days of
        // January and February.
        for (calendar, year_days, february) in [
            ("noleap", 365.0, 28.0),
            ("all_leap", 366.0, 29.0),
            ("360_day", 360.0, 30.0),
        ] {
            let t = CfTime::parse("hours since 2000-01-01", Some(calendar))
                .unwrap()
                .unwrap();
            let start = 200.0 * year_days * 86_400.0;
            assert_eq!(t.seconds_since(origin, 0.0), Some(start), "{calendar}");
            let january = if calendar == "360_day" { 30.0 } else { 31.0 };
            let march = (january + february) * 24.0;
            assert_eq!(
                t.seconds_since(origin, march - 6.0).map(|s| s - start),
                Some((march - 6.0) * 3600.0),
                "{calendar}"
            );
        }
        let bad = CfTime::parse("days since 2000-01-01", Some("360_day"))
            .unwrap()
            .unwrap();
        assert_eq!(bad.seconds_since(origin, f64::NAN), None);
        let no_day = Date {
            year: 1800,
            month: 2,
            day: 31,
        };
        assert_eq!(bad.seconds_since(no_day, 0.0), None);
        assert_eq!(bad.timestamp_seconds_since(no_day, 0), None);
        // The 29th of February 2000 is no date of `noleap`.
        let noleap = CfTime::parse("days since 2000-01-01", Some("noleap"))
            .unwrap()
            .unwrap();
        let leap_day = ts("2000-02-29 00:00:00");
        assert_eq!(noleap.encode(leap_day), None);
        assert_eq!(noleap.encode(ts("2000-03-01 00:00:00")), Some(59));
        assert_eq!(noleap.encode(ts("2000-03-01 06:00:00")), None);
        assert_eq!(noleap.encode(i64::MAX), None);
    }

    #[test]
    fn a_decoded_timestamp_counts_as_the_number_it_came_from() {
        let origin = Date {
            year: 1800,
            month: 1,
            day: 1,
        };
        for calendar in [
            "standard",
            "proleptic_gregorian",
            "noleap",
            "all_leap",
            "360_day",
            "julian",
        ] {
            for units in ["hours since 1999-12-01 06:00", "days since 1850-01-01"] {
                let t = CfTime::parse(units, Some(calendar)).unwrap().unwrap();
                let step = if units.starts_with("hours") {
                    7.0
                } else {
                    0.75
                };
                let mut decoded = 0;
                for i in 0..4000 {
                    let value = i as f64 * step;
                    // Dates the Gregorian calendar lacks have no timestamp.
                    let Ok(timestamp) = t.decode_f64(value) else {
                        continue;
                    };
                    decoded += 1;
                    assert_eq!(
                        t.timestamp_seconds_since(origin, timestamp),
                        t.seconds_since(origin, value),
                        "{calendar}, {value} {units}"
                    );
                    // Encoded back in whole units of the same calendar.
                    let micros = CfTime::parse("microseconds since 1970-01-01", Some(calendar))
                        .unwrap()
                        .unwrap();
                    let count = micros.encode(timestamp).unwrap();
                    assert_eq!(micros.decode_i64(count), Ok(timestamp), "{calendar}");
                    let whole = value.fract() == 0.0;
                    assert_eq!(t.encode(timestamp).is_some(), whole, "{calendar}, {value}");
                }
                assert!(decoded > 3900, "{calendar}: {decoded}");
            }
        }
    }
}

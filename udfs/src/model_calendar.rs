//! Time columns of a model calendar's dates (`noleap`, `360_day`, ...).
//!
//! Such a column holds timestamps with the dates' fields (see
//! [`crate::cf_time`]) and names its calendar in its field metadata
//! ([`CALENDAR_METADATA`]). What counts days over it counts the calendar's
//! own: [`crate::date_part`] (the day of the year and of the week),
//! [`crate::date_bin`] (bins of days), [`crate::date_trunc`] (weeks) and
//! [`crate::calendar_arithmetic`] (differences of times, times plus
//! intervals), which [`crate::calendar_rewrite::CalendarFunctionsRewrite`]
//! puts in place of DataFusion's functions and operators.

use datafusion::arrow::array::TimestampNanosecondArray;
use std::sync::Arc;

use std::collections::HashMap;

use datafusion::arrow::datatypes::{DataType, Field, FieldRef};
use datafusion::common::types::logical_string;
use datafusion::common::{exec_err, plan_err, DataFusionError, Result};
use datafusion::logical_expr::{
    Coercion, ScalarFunctionArgs, Signature, TypeSignature, TypeSignatureClass,
};

use crate::calendar::Calendar;

/// The field metadata key naming the model calendar whose dates a time
/// column holds (the engine sets it on such coordinates; `COPY` writes
/// the times in it).
pub const CALENDAR_METADATA: &str = "zarr.calendar";

/// The field metadata key holding the CF units (`hours since 2000-01-01`)
/// of a time column that keeps its numbers because some of its dates have
/// no timestamp (a daily `360_day` coordinate's 30th of February); its
/// calendar is under [`TIME_CALENDAR_METADATA`]. What reads dates from
/// such a column ([`crate::cf_numbers`]) decodes the numbers itself.
pub const TIME_UNITS_METADATA: &str = "zarr.time_units";

/// The field metadata key naming the calendar of a time column kept as
/// numbers (see [`TIME_UNITS_METADATA`]).
pub const TIME_CALENDAR_METADATA: &str = "zarr.time_calendar";

/// The `ScalarUDFImpl` methods of a function over DataFusion's own (its
/// field `inner`) that answer as that function does: name, aliases,
/// signature, return type, documentation (the caller imports their types);
/// `delegated_methods!(names)` leaves the signature and the return type to
/// the caller; `delegated_methods!(dates of numbers)` takes its own
/// `signature` field (DataFusion's, also taking times kept as numbers, see
/// [`with_numbers`]) and answers numbers (`Float64`, dates of the same
/// units) for numbers.
macro_rules! delegated_methods {
    () => {
        delegated_methods!(names);

        fn signature(&self) -> &Signature {
            self.inner.signature()
        }

        fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
            self.inner.return_type(arg_types)
        }
    };
    (dates of numbers) => {
        delegated_methods!(names);

        fn signature(&self) -> &Signature {
            &self.signature
        }

        fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
            match arg_types.get(1) {
                Some(numbers) if numbers.is_numeric() => Ok(DataType::Float64),
                _ => self.inner.return_type(arg_types),
            }
        }
    };
    (names) => {
        fn name(&self) -> &str {
            self.inner.name()
        }

        fn aliases(&self) -> &[String] {
            self.inner.aliases()
        }

        fn documentation(&self) -> Option<&Documentation> {
            self.inner.documentation()
        }
    };
}
pub(crate) use delegated_methods;

/// DataFusion's `signature` (of `date_part`, `date_trunc`) also taking
/// numbers as the time: a time column kept as numbers (see
/// [`crate::cf_numbers`]), which [`kept_numbers`] checks.
pub(crate) fn with_numbers(signature: &Signature) -> Signature {
    also_taking(
        signature,
        &[&[
            TypeSignatureClass::Native(logical_string()),
            TypeSignatureClass::Numeric,
        ]],
    )
}

/// `signature` also taking arguments of each list of `classes` (coerced
/// to a type of the class): `date_bin` over numbers, say.
pub(crate) fn also_taking(signature: &Signature, classes: &[&[TypeSignatureClass]]) -> Signature {
    let mut variants = match &signature.type_signature {
        TypeSignature::OneOf(variants) => variants.clone(),
        other => vec![other.clone()],
    };
    variants.extend(classes.iter().map(|classes| {
        TypeSignature::Coercible(classes.iter().cloned().map(Coercion::new_exact).collect())
    }));
    Signature::one_of(variants, signature.volatility)
}

/// Whether the time argument's `field` holds numbers, and then its units
/// and calendar ([`TIME_UNITS_METADATA`]): an error naming `function` for
/// numbers that are no times kept as numbers.
fn kept_numbers<'a>(
    function: &str,
    field: Option<&'a FieldRef>,
) -> Result<Option<(&'a str, &'a str)>> {
    let Some(field) = field.filter(|f| f.data_type().is_numeric()) else {
        return Ok(None);
    };
    let metadata = field.metadata();
    match (
        metadata.get(TIME_UNITS_METADATA),
        metadata.get(TIME_CALENDAR_METADATA),
    ) {
        (Some(units), Some(calendar)) => Ok(Some((units, calendar))),
        _ => plan_err!(
            "{function}: '{}' is a number, not a time (only a time coordinate that keeps its \
             numbers, for dates without a timestamp, has dates to read)",
            field.name()
        ),
    }
}

/// The field of `function`'s result (the model calendars' `date_part` or
/// `date_trunc`) over a time column kept as numbers: `data_type`, naming
/// the numbers' units and calendar when `dates` (truncated dates are
/// numbers of the same units); `None` when the time argument is no
/// number. The plan calls [`crate::cf_numbers`]'s function in its place
/// ([`crate::calendar_rewrite::CalendarFunctionsRewrite`]).
pub(crate) fn kept_numbers_field(
    function: &str,
    arg_fields: &[FieldRef],
    data_type: DataType,
    dates: bool,
) -> Result<Option<FieldRef>> {
    let Some((units, calendar)) = kept_numbers(function, arg_fields.get(1))? else {
        return Ok(None);
    };
    let nullable = arg_fields.get(1).is_none_or(|f| f.is_nullable());
    let field = Field::new(function, data_type, nullable);
    Ok(Some(Arc::new(if dates {
        field.with_metadata(kept_numbers_metadata(units, calendar))
    } else {
        field
    })))
}

/// The field metadata of numbers of `units` encoding dates of `calendar`.
pub(crate) fn kept_numbers_metadata(units: &str, calendar: &str) -> HashMap<String, String> {
    HashMap::from([
        (TIME_UNITS_METADATA.to_string(), units.to_string()),
        (TIME_CALENDAR_METADATA.to_string(), calendar.to_string()),
    ])
}

/// The units and calendar of the time column kept as numbers that
/// `field` is, if it is one.
pub(crate) fn kept_numbers_of(field: &FieldRef) -> Option<(&str, &str)> {
    kept_numbers("", Some(field)).ok().flatten()
}

/// An error when numbers reach `function`'s `invoke`: the plan calls
/// [`crate::cf_numbers`]'s function in its place.
pub(crate) fn refuse_numbers(function: &str, args: &ScalarFunctionArgs) -> Result<()> {
    match args
        .arg_fields
        .get(1)
        .filter(|f| f.data_type().is_numeric())
    {
        Some(field) => exec_err!(
            "{function} of the numbers of '{}' runs as cf_{function}, which the plan should call",
            field.name()
        ),
        None => Ok(()),
    }
}

/// Nanoseconds in a day.
pub(crate) const DAY: i64 = 86_400_000_000_000;

/// The model calendar `field`'s metadata gives its dates.
pub(crate) fn calendar_of(field: &FieldRef) -> Option<Calendar> {
    let calendar = Calendar::parse(field.metadata().get(CALENDAR_METADATA)?)?;
    (!calendar.is_gregorian()).then_some(calendar)
}

/// `field` (a function's result) naming `calendar` when it holds
/// timestamps: dates computed from a model calendar's are dates of it.
pub(crate) fn with_calendar(field: FieldRef, calendar: Option<Calendar>) -> FieldRef {
    match calendar {
        Some(calendar) if matches!(field.data_type(), DataType::Timestamp(..)) => {
            let mut metadata = field.metadata().clone();
            metadata.insert(CALENDAR_METADATA.to_string(), calendar.name().to_string());
            Arc::new(field.as_ref().clone().with_metadata(metadata))
        }
        _ => field,
    }
}

/// The calendar's date (and nanoseconds into it) a timestamp with its
/// fields stands for.
pub(crate) fn date_of(timestamp: i64) -> (crate::calendar::Date, i64) {
    let date = Calendar::ProlepticGregorian.date(timestamp.div_euclid(DAY));
    (date, timestamp.rem_euclid(DAY))
}

/// The day number of 1970-01-01 in `calendar`, where its scale of
/// nanoseconds starts (day numbers of the idealized calendars count from
/// year 0, too far for nanoseconds in 64 bits).
fn epoch_day(calendar: Calendar) -> i64 {
    let epoch = crate::calendar::Date {
        year: 1970,
        month: 1,
        day: 1,
    };
    // Every calendar has that date.
    calendar.day_number(epoch).unwrap_or(0)
}

/// A timestamp with the fields of a date of `calendar` as nanoseconds on
/// the calendar's own scale of days (its days since its 1970-01-01 times
/// a day, plus the time of day): `None` when the calendar has no such
/// date or the count overflows.
pub fn calendar_nanos(calendar: Calendar, timestamp: i64) -> Option<i64> {
    let (date, nanos) = date_of(timestamp);
    date_nanos(calendar, date, nanos)
}

/// `date` of `calendar` and `nanos` into it as nanoseconds on the
/// calendar's own scale of days (see [`calendar_nanos`]).
pub(crate) fn date_nanos(
    calendar: Calendar,
    date: crate::calendar::Date,
    nanos: i64,
) -> Option<i64> {
    let days = calendar.day_number(date)? - epoch_day(calendar);
    days.checked_mul(DAY)?.checked_add(nanos)
}

/// The inverse of [`calendar_nanos`]: `None` when the calendar's date has
/// no timestamp (the 30th of February of `360_day`).
pub(crate) fn calendar_timestamp(calendar: Calendar, nanos: i64) -> Option<i64> {
    let (date, nanos) = nanos_date(calendar, nanos);
    let day = Calendar::ProlepticGregorian.day_number(date)?;
    day.checked_mul(DAY)?.checked_add(nanos)
}

/// The date of `calendar` and the nanoseconds into it that nanoseconds on
/// the calendar's own scale of days stand for (the inverse of
/// [`date_nanos`]).
pub(crate) fn nanos_date(calendar: Calendar, nanos: i64) -> (crate::calendar::Date, i64) {
    let date = calendar.date(nanos.div_euclid(DAY) + epoch_day(calendar));
    (date, nanos.rem_euclid(DAY))
}

/// Timestamps (nanoseconds) mapped one by one, NULL kept; a value `map`
/// has no answer for is the error `refused` gives it.
pub(crate) fn mapped(
    values: &TimestampNanosecondArray,
    map: impl Fn(i64) -> Option<i64>,
    refused: impl Fn(i64) -> String,
) -> Result<TimestampNanosecondArray> {
    values
        .iter()
        .map(|value| match value {
            None => Ok(None),
            Some(value) => map(value)
                .map(Some)
                .ok_or_else(|| DataFusionError::Execution(refused(value))),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Timestamps of the dates of each calendar go to its scale and back.
    #[test]
    fn timestamps_go_to_the_calendars_days_and_back() {
        for calendar in [
            Calendar::NoLeap,
            Calendar::AllLeap,
            Calendar::Day360,
            Calendar::Julian,
        ] {
            // From 1999-12-30, across the February of 2000 and of 2001.
            let start = calendar_nanos(calendar, 946_512_000_000_000_000).unwrap();
            for step in 0..2000i64 {
                let nanos = start + step * (DAY / 4 + 7);
                match calendar_timestamp(calendar, nanos) {
                    Some(timestamp) => {
                        assert_eq!(calendar_nanos(calendar, timestamp), Some(nanos))
                    }
                    // Only dates the Gregorian calendar lacks have none.
                    None => assert!(Calendar::ProlepticGregorian
                        .day_number(calendar.date(nanos.div_euclid(DAY) + epoch_day(calendar)))
                        .is_none()),
                }
            }
        }
        // The 29th of February 2000 is no date of `noleap`; the ends of the
        // timestamps are no problem.
        assert_eq!(
            calendar_nanos(Calendar::NoLeap, 951_782_400_000_000_000),
            None
        );
        for calendar in [Calendar::NoLeap, Calendar::Day360] {
            for extreme in [i64::MIN, i64::MAX] {
                if let Some(nanos) = calendar_nanos(calendar, extreme) {
                    let _ = calendar_timestamp(calendar, nanos);
                }
            }
        }
    }
}

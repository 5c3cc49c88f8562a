//! `date_trunc` that knows the dates of model calendars.
//!
//! Over a time column of a model calendar's dates (see
//! [`crate::model_calendar`]), the week starts on the Monday of the
//! calendar's own days, as cftime's `dayofweek` counts them (and as
//! [`crate::date_part`]'s `isodow` does): in a `noleap` year the week of
//! the 1st of March starts on the Monday counted back over a February of
//! 28 days. The other units (`year`, `quarter`, `month`, `day`, `hour`,
//! ...) keep the date's fields, which every calendar has, so they are
//! DataFusion's. Truncated dates are dates of the calendar: the result
//! names the calendar as its input does.
//!
//! ```sql
//! SELECT date_trunc('week', time) AS week, avg(tas) FROM cmip_noleap GROUP BY 1;
//! ```

use std::sync::Arc;

use datafusion::arrow::array::AsArray;
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, FieldRef, TimeUnit, TimestampNanosecondType};
use datafusion::common::{Result, ScalarValue};
use datafusion::functions::datetime::date_trunc;
use datafusion::logical_expr::sort_properties::{ExprProperties, SortProperties};
use datafusion::logical_expr::{
    ColumnarValue, Documentation, ReturnFieldArgs, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl,
    Signature,
};

use crate::calendar::Calendar;
use crate::model_calendar::{
    calendar_of, date_of, delegated_methods, kept_numbers_field, mapped, refuse_numbers,
    with_calendar, with_numbers, DAY,
};

/// `date_trunc` over the dates of model calendars (see the module docs).
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct DateTruncFunc {
    /// DataFusion's `date_trunc`, which answers everything but weeks of
    /// model calendars.
    inner: Arc<ScalarUDF>,
    /// DataFusion's signature, also taking times kept as numbers.
    signature: Signature,
}

impl Default for DateTruncFunc {
    fn default() -> Self {
        Self::new()
    }
}

impl DateTruncFunc {
    /// The function, over DataFusion's own.
    pub fn new() -> Self {
        let inner = date_trunc();
        Self {
            signature: with_numbers(inner.signature()),
            inner,
        }
    }
}

/// Whether `unit` (the first argument) is the week.
fn is_week(unit: Option<&ColumnarValue>) -> bool {
    match unit {
        Some(ColumnarValue::Scalar(ScalarValue::Utf8(Some(unit))))
        | Some(ColumnarValue::Scalar(ScalarValue::Utf8View(Some(unit))))
        | Some(ColumnarValue::Scalar(ScalarValue::LargeUtf8(Some(unit)))) => unit
            .trim_matches(|c| c == '\'' || c == '"')
            .eq_ignore_ascii_case("week"),
        _ => false,
    }
}

/// Midnight of the Monday starting the week of `timestamp` (a timestamp
/// with the fields of a date of `calendar`), counted in the calendar's
/// days: `None` when the timestamp is no date of it, or that Monday has
/// no timestamp (the 30th of February of `360_day`).
fn week_start(calendar: Calendar, timestamp: i64) -> Option<i64> {
    let (date, _) = date_of(timestamp);
    let monday = calendar.day_number(date)? - calendar.weekday(date)?;
    let day = Calendar::ProlepticGregorian.day_number(calendar.date(monday))?;
    day.checked_mul(DAY)
}

impl ScalarUDFImpl for DateTruncFunc {
    delegated_methods!(dates of numbers);

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        if let Some(field) =
            kept_numbers_field(self.name(), args.arg_fields, DataType::Float64, true)?
        {
            return Ok(field);
        }
        // Truncated dates of a model calendar are dates of it too.
        let calendar = args.arg_fields.get(1).and_then(calendar_of);
        Ok(with_calendar(
            self.inner.return_field_from_args(args)?,
            calendar,
        ))
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        refuse_numbers(self.name(), &args)?;
        let nanosecond = DataType::Timestamp(TimeUnit::Nanosecond, None);
        let calendar = match (args.arg_fields.get(1), args.args.get(1)) {
            (Some(field), Some(_))
                if *field.data_type() == nanosecond && is_week(args.args.first()) =>
            {
                calendar_of(field)
            }
            _ => None,
        };
        let Some(calendar) = calendar else {
            return self.inner.invoke_with_args(args);
        };
        let scalar = matches!(args.args[1], ColumnarValue::Scalar(_));
        let times = cast(&args.args[1].to_array(args.number_rows)?, &nanosecond)?;
        let weeks = mapped(
            times.as_primitive::<TimestampNanosecondType>(),
            |t| week_start(calendar, t),
            |t| {
                let (date, _) = date_of(t);
                format!(
                    "date_trunc: the week of {date} of the {} calendar starts on a date that \
                     has no timestamp, or {date} is no date of it",
                    calendar.name()
                )
            },
        )?;
        Ok(if scalar {
            ColumnarValue::Scalar(ScalarValue::try_from_array(&weeks, 0)?)
        } else {
            ColumnarValue::Array(Arc::new(weeks))
        })
    }

    fn output_ordering(&self, input: &[ExprProperties]) -> Result<SortProperties> {
        self.inner.output_ordering(input)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The week of each day of three Februaries-to-Marches, counted back
    /// day by day over the calendar's own days to the day `isodow` 1.
    #[test]
    fn weeks_start_on_the_calendar_s_mondays() {
        for calendar in [
            Calendar::NoLeap,
            Calendar::AllLeap,
            Calendar::Julian,
            Calendar::ProlepticGregorian,
        ] {
            for year in [1999, 2000, 2001] {
                let first = crate::calendar::Date {
                    year,
                    month: 2,
                    day: 1,
                };
                let start = calendar.day_number(first).unwrap();
                for n in start..start + 60 {
                    let date = calendar.date(n);
                    let Some(gregorian) = Calendar::ProlepticGregorian.day_number(date) else {
                        continue;
                    };
                    let timestamp = gregorian * DAY + 13 * 3_600_000_000_000;
                    // The Monday: walk back a day at a time.
                    let mut monday = n;
                    while calendar.weekday(calendar.date(monday)).unwrap() != 0 {
                        monday -= 1;
                    }
                    let want = Calendar::ProlepticGregorian
                        .day_number(calendar.date(monday))
                        .map(|d| d * DAY);
                    assert_eq!(week_start(calendar, timestamp), want, "{calendar:?} {date}");
                }
            }
        }
        // A 360_day week starting on the 30th of February has no timestamp.
        let march_2 = crate::calendar::Date {
            year: 2001,
            month: 3,
            day: 2,
        };
        let n = Calendar::Day360.day_number(march_2).unwrap();
        let monday = n - Calendar::Day360.weekday(march_2).unwrap();
        let gregorian = Calendar::ProlepticGregorian.day_number(march_2).unwrap();
        let got = week_start(Calendar::Day360, gregorian * DAY);
        match Calendar::ProlepticGregorian.day_number(Calendar::Day360.date(monday)) {
            Some(day) => assert_eq!(got, Some(day * DAY)),
            None => assert_eq!(got, None),
        }
    }
}

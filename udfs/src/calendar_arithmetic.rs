//! `-` and `+` over the dates of model calendars.
//!
//! Over time columns of a model calendar's dates (see
//! [`crate::model_calendar`]), the difference of two times counts the
//! calendar's own days, as cftime's subtraction does: in a `noleap` year
//! the 1st of March minus the 28th of February is one day (the Gregorian
//! timestamps are two days apart in 2000). A time plus or minus an interval
//! steps over the calendar's days the same way: its months by the date's
//! fields (the day kept, or the month's last day of the calendar where it
//! is shorter, as DataFusion does for Gregorian dates), then its days and
//! time along the calendar's own days. The result is a date of the
//! calendar again.
//!
//! [`crate::calendar_rewrite::CalendarFunctionsRewrite`] puts these
//! functions in place of the operators where a side names a model calendar
//! (`time - lag(time) OVER (...)`, `time - TIMESTAMP '2000-01-01'`,
//! `time + INTERVAL '1 day'`); a plain timestamp on the other side (a
//! literal) is read as a date of that calendar. Their last argument names
//! the calendar:
//!
//! ```sql
//! SELECT calendar_difference(time, TIMESTAMP '2000-02-28', 'noleap') FROM cmip_noleap;
//! SELECT calendar_add(time, INTERVAL '1 day', 'noleap') FROM cmip_noleap;
//! ```
//!
//! A window's `RANGE` frame of days and hours over such times counts the
//! calendar's days the same way: the rewrite orders it by
//! `calendar_scale(time, calendar)`, the times on the calendar's own scale
//! of days, where distances are the calendar's.

use std::sync::Arc;

use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, DurationNanosecondArray, TimestampNanosecondArray,
};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{
    DataType, DurationNanosecondType, Field, FieldRef, IntervalMonthDayNanoType, IntervalUnit,
    TimeUnit, TimestampNanosecondType,
};
use datafusion::common::{exec_err, plan_err, DataFusionError, Result, ScalarValue};
use datafusion::logical_expr::sort_properties::{ExprProperties, SortProperties};
use datafusion::logical_expr::{
    ColumnarValue, ReturnFieldArgs, ScalarFunctionArgs, ScalarUDFImpl, Signature, Volatility,
};

use crate::calendar::{Calendar, Date};
use crate::model_calendar::{
    calendar_nanos, calendar_timestamp, date_nanos, date_of, mapped, with_calendar,
};

/// Timestamps in nanoseconds, without a time zone (what a model
/// calendar's time column holds).
const NANOSECONDS: DataType = DataType::Timestamp(TimeUnit::Nanosecond, None);

/// The calendar named by the last argument (a string literal).
fn named_calendar(function: &str, name: Option<&ScalarValue>) -> Result<Calendar> {
    let name = match name {
        Some(ScalarValue::Utf8(Some(name)))
        | Some(ScalarValue::Utf8View(Some(name)))
        | Some(ScalarValue::LargeUtf8(Some(name))) => name,
        _ => {
            return plan_err!("{function}: the last argument must name a calendar ('noleap', ...)")
        }
    };
    match Calendar::parse(name) {
        Some(calendar) => Ok(calendar),
        None => plan_err!("{function}: '{name}' is none of CF's calendars"),
    }
}

/// The calendar argument of a call, checked at planning and at execution.
fn calendar_argument(function: &str, args: &[ColumnarValue]) -> Result<Calendar> {
    match args.last() {
        Some(ColumnarValue::Scalar(name)) => named_calendar(function, Some(name)),
        _ => named_calendar(function, None),
    }
}

/// A time argument as nanoseconds.
fn times(value: &ColumnarValue, rows: usize) -> Result<TimestampNanosecondArray> {
    Ok(cast(&value.to_array(rows)?, &NANOSECONDS)?
        .as_primitive::<TimestampNanosecondType>()
        .clone())
}

/// The result as a scalar when every argument was one.
fn result(args: &[ColumnarValue], values: ArrayRef) -> Result<ColumnarValue> {
    Ok(
        if args.iter().all(|a| matches!(a, ColumnarValue::Scalar(_))) {
            ColumnarValue::Scalar(ScalarValue::try_from_array(&values, 0)?)
        } else {
            ColumnarValue::Array(values)
        },
    )
}

/// `calendar_difference(a, b, calendar)`: `a - b` counted in the
/// calendar's days, a duration (see the module docs).
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct CalendarDifferenceFunc {
    signature: Signature,
}

impl Default for CalendarDifferenceFunc {
    fn default() -> Self {
        Self::new()
    }
}

impl CalendarDifferenceFunc {
    /// The function.
    pub fn new() -> Self {
        Self {
            signature: Signature::user_defined(Volatility::Immutable),
        }
    }
}

/// `a - b` of two timestamps with the fields of dates of `calendar`, in
/// nanoseconds of its days.
fn difference(calendar: Calendar, a: i64, b: i64) -> Result<i64> {
    let on_scale = |t: i64| {
        calendar_nanos(calendar, t).ok_or_else(|| {
            DataFusionError::Execution(format!(
                "calendar_difference: {} is no date of the {} calendar",
                date_of(t).0,
                calendar.name()
            ))
        })
    };
    on_scale(a)?.checked_sub(on_scale(b)?).ok_or_else(|| {
        DataFusionError::Execution(format!(
            "calendar_difference: {} minus {} overflows a duration in nanoseconds",
            date_of(a).0,
            date_of(b).0
        ))
    })
}

impl ScalarUDFImpl for CalendarDifferenceFunc {
    fn name(&self) -> &str {
        "calendar_difference"
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        match arg_types {
            [DataType::Timestamp(_, None), DataType::Timestamp(_, None), name] => {
                Ok(vec![NANOSECONDS, NANOSECONDS, name.clone()])
            }
            _ => plan_err!(
                "calendar_difference takes two timestamps without a time zone and a calendar's name, not {arg_types:?}"
            ),
        }
    }

    fn return_type(&self, _arg_types: &[DataType]) -> Result<DataType> {
        Ok(DataType::Duration(TimeUnit::Nanosecond))
    }

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        named_calendar(self.name(), args.scalar_arguments.get(2).copied().flatten())?;
        let nullable = args.arg_fields.iter().any(|f| f.is_nullable());
        Ok(Arc::new(Field::new(
            self.name(),
            DataType::Duration(TimeUnit::Nanosecond),
            nullable,
        )))
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let calendar = calendar_argument(self.name(), &args.args)?;
        let [a, b, _] = args.args.as_slice() else {
            return exec_err!("calendar_difference takes three arguments");
        };
        let (a, b) = (times(a, args.number_rows)?, times(b, args.number_rows)?);
        let differences = a
            .iter()
            .zip(b.iter())
            .map(|pair| match pair {
                (Some(a), Some(b)) => difference(calendar, a, b).map(Some),
                _ => Ok(None),
            })
            .collect::<Result<DurationNanosecondArray>>()?;
        result(&args.args, Arc::new(differences))
    }
}

/// `calendar_scale(time, calendar)`: a time of a model calendar's dates
/// as a timestamp on the calendar's own scale of days (its days since its
/// 1970-01-01, and the time of day), where the distance between two times
/// is the calendar's: what a window's `RANGE` frame of days and hours over
/// such times orders by (see the module docs). It keeps the times' order.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct CalendarScaleFunc {
    signature: Signature,
}

impl Default for CalendarScaleFunc {
    fn default() -> Self {
        Self::new()
    }
}

impl CalendarScaleFunc {
    /// The function.
    pub fn new() -> Self {
        Self {
            signature: Signature::user_defined(Volatility::Immutable),
        }
    }
}

impl ScalarUDFImpl for CalendarScaleFunc {
    fn name(&self) -> &str {
        "calendar_scale"
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        match arg_types {
            [DataType::Timestamp(_, None), name] => Ok(vec![NANOSECONDS, name.clone()]),
            _ => plan_err!(
                "calendar_scale takes a timestamp without a time zone and a calendar's name, not {arg_types:?}"
            ),
        }
    }

    fn return_type(&self, _arg_types: &[DataType]) -> Result<DataType> {
        Ok(NANOSECONDS)
    }

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        named_calendar(self.name(), args.scalar_arguments.get(1).copied().flatten())?;
        let nullable = args.arg_fields.first().is_none_or(|f| f.is_nullable());
        Ok(Arc::new(Field::new(self.name(), NANOSECONDS, nullable)))
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let calendar = calendar_argument(self.name(), &args.args)?;
        let [time, _] = args.args.as_slice() else {
            return exec_err!("calendar_scale takes two arguments");
        };
        let scaled = mapped(
            &times(time, args.number_rows)?,
            |t| calendar_nanos(calendar, t),
            |t| {
                format!(
                    "calendar_scale: {} is no date of the {} calendar",
                    date_of(t).0,
                    calendar.name()
                )
            },
        )?;
        result(&args.args, Arc::new(scaled))
    }

    fn output_ordering(&self, input: &[ExprProperties]) -> Result<SortProperties> {
        Ok(input
            .first()
            .map_or(SortProperties::Unordered, |time| time.sort_properties))
    }

    fn preserves_lex_ordering(&self, _inputs: &[ExprProperties]) -> Result<bool> {
        Ok(true)
    }
}

/// `calendar_add(time, step, calendar)` and `calendar_subtract(...)`: a
/// time plus or minus an interval or a duration, stepped over the
/// calendar's days (see the module docs).
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct CalendarShiftFunc {
    signature: Signature,
    /// Whether the step is taken away (`calendar_subtract`).
    subtract: bool,
}

impl CalendarShiftFunc {
    /// `calendar_add`.
    pub fn add() -> Self {
        Self {
            signature: Signature::user_defined(Volatility::Immutable),
            subtract: false,
        }
    }

    /// `calendar_subtract`.
    pub fn subtract() -> Self {
        Self {
            subtract: true,
            ..Self::add()
        }
    }
}

/// A step: months, days and nanoseconds (an interval's fields, or a
/// duration's nanoseconds).
pub(crate) type Step = (i32, i32, i64);

/// The type a step argument (an interval or a duration) is taken as:
/// `None` for any other.
pub(crate) fn step_type(arg: Option<&DataType>) -> Option<DataType> {
    match arg {
        Some(DataType::Interval(_)) => Some(DataType::Interval(IntervalUnit::MonthDayNano)),
        Some(DataType::Duration(_)) => Some(DataType::Duration(TimeUnit::Nanosecond)),
        _ => None,
    }
}

/// Each row's step (an argument of [`step_type`]) as months, days and
/// nanoseconds (`None`: NULL).
pub(crate) fn steps(
    function: &str,
    step: &ColumnarValue,
    rows: usize,
) -> Result<Vec<Option<Step>>> {
    let step = step.to_array(rows)?;
    Ok(match step.data_type() {
        DataType::Interval(IntervalUnit::MonthDayNano) => step
            .as_primitive::<IntervalMonthDayNanoType>()
            .iter()
            .map(|s| s.map(|s| (s.months, s.days, s.nanoseconds)))
            .collect(),
        DataType::Duration(TimeUnit::Nanosecond) => step
            .as_primitive::<DurationNanosecondType>()
            .iter()
            .map(|s| s.map(|s| (0, 0, s)))
            .collect(),
        other => return exec_err!("{function}: a step of type {other}"),
    })
}

/// `step`, or its opposite when `subtract`: `None` when that overflows.
pub(crate) fn signed((months, days, nanos): Step, subtract: bool) -> Option<Step> {
    if subtract {
        Some((
            months.checked_neg()?,
            days.checked_neg()?,
            nanos.checked_neg()?,
        ))
    } else {
        Some((months, days, nanos))
    }
}

/// `date` of `calendar` (and `time_of_day` into it) moved by `step`: its
/// months by the date's fields (the day kept, or the calendar's last of
/// the month where that is shorter), then its days and nanoseconds along
/// the calendar's days; nanoseconds on the calendar's own scale of days
/// (see [`date_nanos`]). `None` when the calendar lacks the date or the
/// step overflows.
pub(crate) fn shifted_date(
    calendar: Calendar,
    date: Date,
    time_of_day: i64,
    (months, days, nanos): Step,
) -> Option<i64> {
    calendar.day_number(date)?;
    let month = (date.year.checked_mul(12)?)
        .checked_add(i64::from(date.month) - 1)?
        .checked_add(i64::from(months))?;
    let (year, month) = (month.div_euclid(12), month.rem_euclid(12) as u32 + 1);
    let date = Date {
        year,
        month,
        day: date.day.min(calendar.days_in_month(year, month)),
    };
    let start = date_nanos(calendar, date, time_of_day)?;
    let step = i64::from(days).checked_mul(crate::model_calendar::DAY)?;
    start.checked_add(step)?.checked_add(nanos)
}

/// The timestamp of `timestamp`'s date of `calendar` moved by `months`,
/// then `days` and `nanos` (see [`shifted_date`]): `None` when the
/// timestamp is no date of the calendar, the result has no timestamp (the
/// 30th of February of `360_day`) or the step overflows.
fn shifted(calendar: Calendar, timestamp: i64, months: i32, days: i32, nanos: i64) -> Option<i64> {
    let (date, time_of_day) = date_of(timestamp);
    let moved = shifted_date(calendar, date, time_of_day, (months, days, nanos))?;
    calendar_timestamp(calendar, moved)
}

impl ScalarUDFImpl for CalendarShiftFunc {
    fn name(&self) -> &str {
        if self.subtract {
            "calendar_subtract"
        } else {
            "calendar_add"
        }
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        let step = step_type(arg_types.get(1)).unwrap_or(DataType::Null);
        match arg_types {
            [DataType::Timestamp(_, None), _, name] if step != DataType::Null => {
                Ok(vec![NANOSECONDS, step, name.clone()])
            }
            _ => plan_err!(
                "{} takes a timestamp without a time zone, an interval or a duration and a calendar's name, not {arg_types:?}",
                self.name()
            ),
        }
    }

    fn return_type(&self, _arg_types: &[DataType]) -> Result<DataType> {
        Ok(NANOSECONDS)
    }

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        let calendar =
            named_calendar(self.name(), args.scalar_arguments.get(2).copied().flatten())?;
        let nullable = args.arg_fields.iter().any(|f| f.is_nullable());
        let field = Arc::new(Field::new(self.name(), NANOSECONDS, nullable));
        // Dates stepped over a model calendar's days are dates of it.
        Ok(with_calendar(
            field,
            Some(calendar).filter(|c| !c.is_gregorian()),
        ))
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let calendar = calendar_argument(self.name(), &args.args)?;
        let [time, step, _] = args.args.as_slice() else {
            return exec_err!("{} takes three arguments", self.name());
        };
        let rows = args.number_rows;
        let time = times(time, rows)?;
        let steps = steps(self.name(), step, rows)?;
        let stepped = time
            .iter()
            .zip(steps)
            .map(|pair| match pair {
                (Some(t), Some(step)) => signed(step, self.subtract)
                    .and_then(|(months, days, nanos)| shifted(calendar, t, months, days, nanos))
                    .map(Some)
                    .ok_or_else(|| {
                        DataFusionError::Execution(format!(
                            "{}: {} of the {} calendar {} {:?} (months, days, nanoseconds) \
                             is no date with a timestamp, or {0} is no date of it",
                            self.name(),
                            date_of(t).0,
                            calendar.name(),
                            if self.subtract { "minus" } else { "plus" },
                            step
                        ))
                    }),
                _ => Ok(None),
            })
            .collect::<Result<TimestampNanosecondArray>>()?;
        result(&args.args, Arc::new(stepped) as ArrayRef)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model_calendar::DAY;

    fn timestamp(year: i64, month: u32, day: u32) -> i64 {
        let date = Date { year, month, day };
        Calendar::ProlepticGregorian.day_number(date).unwrap() * DAY
    }

    /// Differences and steps count the calendar's days: each day of two
    /// years stepped to by whole days from the 1st of January, and back.
    #[test]
    fn steps_and_differences_count_the_calendar_s_days() {
        for calendar in [
            Calendar::NoLeap,
            Calendar::AllLeap,
            Calendar::Day360,
            Calendar::Julian,
        ] {
            let start = timestamp(2000, 1, 1);
            let first = calendar
                .day_number(Date {
                    year: 2000,
                    month: 1,
                    day: 1,
                })
                .unwrap();
            for n in 0..730 {
                let date = calendar.date(first + n);
                let Some(day) = Calendar::ProlepticGregorian.day_number(date) else {
                    // No timestamp for that day of the calendar.
                    assert_eq!(shifted(calendar, start, 0, n as i32, 0), None);
                    continue;
                };
                let t = day * DAY + 7;
                assert_eq!(
                    shifted(calendar, start, 0, n as i32, 7),
                    Some(t),
                    "{calendar:?} {date}"
                );
                assert_eq!(difference(calendar, t, start).unwrap(), n * DAY + 7);
                assert_eq!(shifted(calendar, t, 0, -(n as i32), -7), Some(start));
            }
        }
        // noleap: the 1st of March follows the 28th of February.
        let noleap = Calendar::NoLeap;
        assert_eq!(
            difference(noleap, timestamp(2000, 3, 1), timestamp(2000, 2, 28)).unwrap(),
            DAY
        );
        assert!(difference(noleap, timestamp(2000, 2, 29), timestamp(2000, 2, 28)).is_err());
        // Months keep the day, or the calendar's last of the month.
        assert_eq!(
            shifted(noleap, timestamp(2000, 1, 31), 1, 0, 0),
            Some(timestamp(2000, 2, 28))
        );
        assert_eq!(
            shifted(Calendar::Day360, timestamp(2000, 3, 30), -1, 0, 0),
            None,
            "the 30th of February has no timestamp"
        );
        assert_eq!(
            shifted(Calendar::Day360, timestamp(2000, 3, 30), -1, -1, 0),
            Some(timestamp(2000, 2, 29))
        );
        // Overflows are refused, not wrapped.
        assert_eq!(shifted(noleap, timestamp(2000, 1, 1), i32::MAX, 0, 0), None);
        assert_eq!(shifted(noleap, timestamp(2000, 1, 1), 0, 0, i64::MAX), None);
    }
}

//! `date_bin` that knows the dates of model calendars.
//!
//! Over a time column of a model calendar's dates (see
//! [`crate::model_calendar`]), a stride of days and hours counts the
//! calendar's own days, as xarray's `resample(time="5D")` does on cftime
//! dates: pentads of a `noleap` year are 73 bins of five model days, the
//! 28th of February and the 1st of March one day apart. The origin is a
//! date of the calendar too (the 1st of January 1970 when not given), and
//! so are the bins: the result names the calendar as its input does.
//! Strides of months count the dates' months, as DataFusion's do, the
//! bins starting on the origin's day of the calendar's months (or its
//! last day of a shorter one: a `noleap` February has no 29th, every
//! `360_day` month a 30th). Other columns and types are DataFusion's
//! `date_bin`. Over a time column kept as numbers (a daily `360_day`
//! calendar's, see [`crate::cf_numbers`]) it is `cf_date_bin`, which bins
//! the dates those numbers encode the same way.
//!
//! ```sql
//! SELECT date_bin(INTERVAL '5 days', time, TIMESTAMP '2000-01-01') AS pentad, avg(tas)
//! FROM cmip_noleap GROUP BY 1;
//! ```

use std::sync::Arc;

use datafusion::arrow::array::{Array, AsArray};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{
    DataType, FieldRef, IntervalMonthDayNanoType, TimeUnit, TimestampNanosecondType,
};
use datafusion::common::{exec_err, Result, ScalarValue};
use datafusion::functions::datetime::date_bin;
use datafusion::logical_expr::sort_properties::{ExprProperties, SortProperties};
use datafusion::logical_expr::{
    ColumnarValue, Documentation, ReturnFieldArgs, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl,
    Signature, TypeSignatureClass,
};

use crate::calendar::{Calendar, Date};
use crate::calendar_arithmetic::shifted_date;
use crate::model_calendar::{
    also_taking, calendar_nanos, calendar_of, calendar_timestamp, date_nanos, date_of,
    delegated_methods, kept_numbers_field, mapped, refuse_numbers, with_calendar, DAY,
};

/// `date_bin` over the dates of model calendars (see the module docs).
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct DateBinFunc {
    /// DataFusion's `date_bin`, which bins.
    inner: Arc<ScalarUDF>,
    /// DataFusion's signature, also taking times kept as numbers.
    signature: Signature,
}

impl Default for DateBinFunc {
    fn default() -> Self {
        Self::new()
    }
}

impl DateBinFunc {
    /// The function, over DataFusion's own.
    pub fn new() -> Self {
        let inner = date_bin();
        let (interval, numbers, time) = (
            TypeSignatureClass::Interval,
            TypeSignatureClass::Numeric,
            TypeSignatureClass::Timestamp,
        );
        Self {
            signature: also_taking(
                inner.signature(),
                &[
                    &[interval.clone(), numbers.clone()],
                    &[interval, numbers, time],
                ],
            ),
            inner,
        }
    }
}

/// The nanoseconds of a stride without months (days, hours, ...): `None`
/// for one with months, NULL, or too long for 64 bits.
pub(crate) fn stride_nanos(stride: &ScalarValue) -> Option<i64> {
    match stride {
        ScalarValue::IntervalDayTime(Some(v)) => i64::from(v.days)
            .checked_mul(DAY)?
            .checked_add(i64::from(v.milliseconds).checked_mul(1_000_000)?),
        ScalarValue::IntervalMonthDayNano(Some(v)) => {
            let (months, days, nanos) = IntervalMonthDayNanoType::to_parts(*v);
            (months == 0).then_some(())?;
            i64::from(days).checked_mul(DAY)?.checked_add(nanos)
        }
        _ => None,
    }
}

/// The months of a stride of months only: `None` for one with days or
/// less, NULL, or another type.
pub(crate) fn stride_months(stride: &ScalarValue) -> Option<i64> {
    match stride {
        ScalarValue::IntervalYearMonth(Some(months)) => Some(i64::from(*months)),
        ScalarValue::IntervalMonthDayNano(Some(v)) if v.days == 0 && v.nanoseconds == 0 => {
            Some(i64::from(v.months))
        }
        _ => None,
    }
}

/// The start of the bin of `stride` months from `origin` (a date of
/// `calendar` and the nanoseconds into it) holding `date` (and `nanos`
/// into it), on the calendar's own scale of days (see
/// [`crate::model_calendar::date_nanos`]): the months between the dates'
/// fields in whole strides, the bins starting on the origin's day of the
/// month (or the calendar's last day of a shorter month), one starting
/// after the date giving way to the one before, as DataFusion's `date_bin`
/// by months. `None` when the calendar lacks a date or a count overflows.
pub(crate) fn month_bin_start(
    calendar: Calendar,
    (origin, into): (Date, i64),
    stride: i64,
    (date, nanos): (Date, i64),
) -> Option<i64> {
    let at = date_nanos(calendar, date, nanos)?;
    let months = |d: Date| d.year.checked_mul(12)?.checked_add(i64::from(d.month));
    let since = months(date)?.checked_sub(months(origin)?)?;
    let start = |k: i64| shifted_date(calendar, origin, into, (i32::try_from(k).ok()?, 0, 0));
    let k = since.div_euclid(stride).checked_mul(stride)?;
    match start(k)? {
        first if first > at => start(k.checked_sub(stride)?),
        first => Some(first),
    }
}

/// Whether `stride` is an interval without months (days, hours, ...).
fn without_months(stride: &ColumnarValue) -> bool {
    matches!(stride, ColumnarValue::Scalar(stride) if stride_nanos(stride).is_some())
}

/// A timestamp argument's value in nanoseconds (`None`: NULL).
pub(crate) fn nanos_of(value: &ColumnarValue) -> Result<Option<i64>> {
    let value = cast(
        &value.to_array(1)?,
        &DataType::Timestamp(TimeUnit::Nanosecond, None),
    )?;
    let value = value.as_primitive::<TimestampNanosecondType>();
    Ok((value.len() == 1 && value.is_valid(0)).then(|| value.value(0)))
}

/// `date_bin` by `stride` months of `times`, dates of a model `calendar`,
/// from `origin` (a timestamp with the fields of one of its dates): the
/// bins start on the origin's day of the calendar's months
/// ([`month_bin_start`]), where DataFusion's would start on Gregorian
/// ones (a `noleap` 29th of February, a `360_day` 31st).
fn by_months(
    calendar: Calendar,
    stride: i64,
    origin: i64,
    times: &ColumnarValue,
    rows: usize,
) -> Result<ColumnarValue> {
    let name = calendar.name();
    let origin = date_of(origin);
    if date_nanos(calendar, origin.0, origin.1).is_none() {
        return exec_err!(
            "date_bin: the origin {} is no date of the {name} calendar",
            origin.0
        );
    }
    let nanosecond = DataType::Timestamp(TimeUnit::Nanosecond, None);
    let values = cast(&times.to_array(rows)?, &nanosecond)?;
    let binned = mapped(
        values.as_primitive::<TimestampNanosecondType>(),
        |t| {
            let start = month_bin_start(calendar, origin, stride, date_of(t))?;
            calendar_timestamp(calendar, start)
        },
        |t| {
            format!(
                "date_bin: {} of the {name} calendar has no bin of {stride} months from {} \
                 with a timestamp, or is no date of it",
                date_of(t).0,
                origin.0
            )
        },
    )?;
    Ok(match times {
        ColumnarValue::Scalar(_) => ColumnarValue::Scalar(ScalarValue::try_from_array(&binned, 0)?),
        ColumnarValue::Array(_) => ColumnarValue::Array(Arc::new(binned)),
    })
}

impl ScalarUDFImpl for DateBinFunc {
    delegated_methods!(dates of numbers);

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        // Bins of dates kept as numbers are numbers of the same units.
        if let Some(field) =
            kept_numbers_field(self.name(), args.arg_fields, DataType::Float64, true)?
        {
            return Ok(field);
        }
        // Bins of a model calendar's dates are dates of it too.
        let calendar = args.arg_fields.get(1).and_then(calendar_of);
        Ok(with_calendar(
            self.inner.return_field_from_args(args)?,
            calendar,
        ))
    }

    fn invoke_with_args(&self, mut args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        refuse_numbers(self.name(), &args)?;
        let nanosecond = DataType::Timestamp(TimeUnit::Nanosecond, None);
        let calendar = match (args.arg_fields.get(1), args.args.first()) {
            (Some(field), Some(stride))
                if *field.data_type() == nanosecond && without_months(stride) =>
            {
                calendar_of(field)
            }
            _ => None,
        };
        // The origin, 1970-01-01 when not given; a NULL one is DataFusion's.
        let origin = match args.args.get(2) {
            Some(origin) => nanos_of(origin)?,
            None => Some(0),
        };
        let months = match (args.arg_fields.get(1), args.args.first()) {
            (Some(field), Some(ColumnarValue::Scalar(stride)))
                if *field.data_type() == nanosecond =>
            {
                calendar_of(field).zip(stride_months(stride).filter(|&m| m > 0))
            }
            _ => None,
        };
        if let (Some((calendar, stride)), Some(origin)) = (months, origin) {
            return by_months(calendar, stride, origin, &args.args[1], args.number_rows);
        }
        let (Some(calendar), Some(origin)) = (calendar, origin) else {
            return self.inner.invoke_with_args(args);
        };
        let name = calendar.name();
        let no_date = |what: &str, timestamp: i64| {
            let (date, _) = date_of(timestamp);
            format!("date_bin: {what} {date} is no date of the {name} calendar")
        };
        // Bin on the calendar's scale of days, then back to timestamps.
        let Some(origin) = calendar_nanos(calendar, origin) else {
            return exec_err!("{}", no_date("the origin", origin));
        };
        let scalar = matches!(args.args[1], ColumnarValue::Scalar(_));
        let rows = args.number_rows;
        let times = cast(&args.args[1].to_array(rows)?, &nanosecond)?;
        let times = mapped(
            times.as_primitive::<TimestampNanosecondType>(),
            |t| calendar_nanos(calendar, t),
            |t| no_date("the time", t),
        )?;
        args.args[1] = ColumnarValue::Array(Arc::new(times));
        let origin = ColumnarValue::Scalar(ScalarValue::TimestampNanosecond(Some(origin), None));
        match args.args.get_mut(2) {
            Some(arg) => *arg = origin,
            None => args.args.push(origin),
        }
        let binned = cast(
            &self.inner.invoke_with_args(args)?.to_array(rows)?,
            &nanosecond,
        )?;
        let back = mapped(
            binned.as_primitive::<TimestampNanosecondType>(),
            |n| calendar_timestamp(calendar, n),
            |n| {
                format!(
                    "date_bin: a bin starts {} days after 1970-01-01 of the {name} calendar, \
                     on a date that has no timestamp",
                    n.div_euclid(DAY)
                )
            },
        )?;
        Ok(if scalar {
            ColumnarValue::Scalar(ScalarValue::try_from_array(&back, 0)?)
        } else {
            ColumnarValue::Array(Arc::new(back))
        })
    }

    fn output_ordering(&self, input: &[ExprProperties]) -> Result<SortProperties> {
        self.inner.output_ordering(input)
    }
}

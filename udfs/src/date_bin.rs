//! `date_bin` that knows the dates of model calendars.
//!
//! Over a time column of a model calendar's dates (see
//! [`crate::model_calendar`]), a stride of days and hours counts the
//! calendar's own days, as xarray's `resample(time="5D")` does on cftime
//! dates: pentads of a `noleap` year are 73 bins of five model days, the
//! 28th of February and the 1st of March one day apart. The origin is a
//! date of the calendar too (the 1st of January 1970 when not given), and
//! so are the bins: the result names the calendar as its input does.
//! Strides of months, other columns and other types are DataFusion's
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

use crate::model_calendar::{
    also_taking, calendar_nanos, calendar_of, calendar_timestamp, date_of, delegated_methods,
    kept_numbers_field, mapped, refuse_numbers, with_calendar, DAY,
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

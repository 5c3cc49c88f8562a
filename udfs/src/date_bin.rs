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
//! `date_bin`.
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
    Signature,
};

use crate::model_calendar::{
    calendar_nanos, calendar_of, calendar_timestamp, date_of, delegated_methods, mapped,
    with_calendar,
};

/// `date_bin` over the dates of model calendars (see the module docs).
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct DateBinFunc {
    /// DataFusion's `date_bin`, which bins.
    inner: Arc<ScalarUDF>,
}

impl Default for DateBinFunc {
    fn default() -> Self {
        Self::new()
    }
}

impl DateBinFunc {
    /// The function, over DataFusion's own.
    pub fn new() -> Self {
        Self { inner: date_bin() }
    }
}

/// Whether `stride` is an interval without months (days, hours, ...).
fn without_months(stride: &ColumnarValue) -> bool {
    match stride {
        ColumnarValue::Scalar(ScalarValue::IntervalDayTime(Some(_))) => true,
        ColumnarValue::Scalar(ScalarValue::IntervalMonthDayNano(Some(v))) => {
            IntervalMonthDayNanoType::to_parts(*v).0 == 0
        }
        _ => false,
    }
}

/// A timestamp argument's value in nanoseconds (`None`: NULL).
fn nanos_of(value: &ColumnarValue) -> Result<Option<i64>> {
    let value = cast(
        &value.to_array(1)?,
        &DataType::Timestamp(TimeUnit::Nanosecond, None),
    )?;
    let value = value.as_primitive::<TimestampNanosecondType>();
    Ok((value.len() == 1 && value.is_valid(0)).then(|| value.value(0)))
}

impl ScalarUDFImpl for DateBinFunc {
    delegated_methods!();

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        // Bins of a model calendar's dates are dates of it too.
        let calendar = args.arg_fields.get(1).and_then(calendar_of);
        Ok(with_calendar(
            self.inner.return_field_from_args(args)?,
            calendar,
        ))
    }

    fn invoke_with_args(&self, mut args: ScalarFunctionArgs) -> Result<ColumnarValue> {
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
                    n.div_euclid(86_400_000_000_000)
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

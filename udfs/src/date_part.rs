//! `date_part` (and `extract`) that knows the dates of model calendars.
//!
//! A time column of a model calendar's dates (`noleap`, `360_day`, ...)
//! holds timestamps with the dates' fields, and carries the calendar's
//! name in its field metadata ([`CALENDAR_METADATA`](crate::model_calendar::CALENDAR_METADATA)). The parts that
//! are fields (`year`, `month`, `day`, `hour`, ...) are right as they are;
//! the day of the year and of the week count the calendar's own days, as
//! xarray's `dt.dayofyear` and `dt.dayofweek` do on cftime dates: the 1st
//! of March is day 60 of every `noleap` year, and follows the 28th of
//! February in the week. This function answers `doy`, `dow` and `isodow`
//! so for such columns, and is DataFusion's `date_part` otherwise.
//!
//! ```sql
//! SELECT extract(doy FROM time) AS doy, avg(tas) FROM cmip_noleap GROUP BY 1;
//! ```

use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, AsArray, Int32Array};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, FieldRef, Int64Type, TimeUnit};
use datafusion::common::{exec_err, Result, ScalarValue};
use datafusion::functions::datetime::date_part;
use datafusion::logical_expr::preimage::PreimageResult;
use datafusion::logical_expr::simplify::SimplifyContext;
use datafusion::logical_expr::{
    ColumnarValue, Documentation, Expr, ReturnFieldArgs, ScalarFunctionArgs, ScalarUDF,
    ScalarUDFImpl, Signature,
};

use crate::calendar::{Calendar, Date};
use crate::model_calendar::{
    calendar_of, date_of, delegated_methods, kept_numbers_field, refuse_numbers, with_numbers,
};

/// `date_part` over the dates of model calendars (see the module docs).
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct DatePartFunc {
    /// DataFusion's `date_part`, which answers everything else.
    inner: Arc<ScalarUDF>,
    /// DataFusion's signature, also taking times kept as numbers.
    signature: Signature,
}

impl Default for DatePartFunc {
    fn default() -> Self {
        Self::new()
    }
}

impl DatePartFunc {
    /// The function, over DataFusion's own.
    pub fn new() -> Self {
        let inner = date_part();
        Self {
            signature: with_numbers(inner.signature()),
            inner,
        }
    }
}

/// A part that counts days (`doy`, `dow`, `isodow`), as a function of a
/// date of `calendar`.
fn day_part(part: &str) -> Option<fn(Calendar, Date) -> Option<i64>> {
    let part = part.trim_matches(|c| c == '\'' || c == '"').to_lowercase();
    Some(match part.as_str() {
        "doy" => Calendar::day_of_year,
        // Sunday 0 to Saturday 6.
        "dow" => |calendar, date| Some((calendar.weekday(date)? + 1) % 7),
        // Monday 1 to Sunday 7.
        "isodow" => |calendar, date| Some(calendar.weekday(date)? + 1),
        _ => return None,
    })
}

impl ScalarUDFImpl for DatePartFunc {
    delegated_methods!(names);

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        match arg_types.get(1) {
            Some(numbers) if numbers.is_numeric() => Ok(DataType::Int32),
            _ => self.inner.return_type(arg_types),
        }
    }

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        match kept_numbers_field(self.name(), args.arg_fields, DataType::Int32, false)? {
            Some(field) => Ok(field),
            None => self.inner.return_field_from_args(args),
        }
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        refuse_numbers(self.name(), &args)?;
        let part = match args.args.first() {
            Some(ColumnarValue::Scalar(ScalarValue::Utf8(Some(part))))
            | Some(ColumnarValue::Scalar(ScalarValue::Utf8View(Some(part)))) => part.clone(),
            _ => return self.inner.invoke_with_args(args),
        };
        let (Some(field), Some(value)) = (args.arg_fields.get(1), args.args.get(1)) else {
            return self.inner.invoke_with_args(args);
        };
        let (Some(calendar), Some(of_date), DataType::Timestamp(..)) =
            (calendar_of(field), day_part(&part), field.data_type())
        else {
            return self.inner.invoke_with_args(args);
        };
        let scalar = matches!(value, ColumnarValue::Scalar(_));
        let times = value.to_array(args.number_rows)?;
        let nanos = cast(&times, &DataType::Timestamp(TimeUnit::Nanosecond, None))?;
        let nanos = cast(&nanos, &DataType::Int64)?;
        let parts = (nanos.as_primitive::<Int64Type>().iter())
            .map(|time| {
                let Some(time) = time else { return Ok(None) };
                let (date, _) = date_of(time);
                match of_date(calendar, date) {
                    Some(part) => Ok(i32::try_from(part).ok()),
                    None => exec_err!(
                        "date_part: {date} is no date of the {} calendar of column '{}'",
                        calendar.name(),
                        field.name()
                    ),
                }
            })
            .collect::<Result<Int32Array>>()?;
        let parts: ArrayRef = Arc::new(parts);
        Ok(if scalar {
            ColumnarValue::Scalar(ScalarValue::try_from_array(&parts, 0)?)
        } else {
            ColumnarValue::Array(parts)
        })
    }

    fn preimage(
        &self,
        args: &[Expr],
        lit_expr: &Expr,
        info: &SimplifyContext,
    ) -> Result<PreimageResult> {
        // Only the year has one, the same in every calendar.
        self.inner.preimage(args, lit_expr, info)
    }
}

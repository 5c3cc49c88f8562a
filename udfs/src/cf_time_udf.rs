//! `cf_time(value, units [, calendar])`: decode CF-encoded numbers to timestamps.
//!
//! ```sql
//! SELECT cf_time(time_raw, 'hours since 1900-01-01') FROM t;
//! SELECT cf_time(36.5, 'days since 2000-01-01', 'proleptic_gregorian');
//! ```

use std::sync::Arc;

use datafusion::arrow::array::{Array, AsArray, TimestampNanosecondArray};
use datafusion::arrow::datatypes::{DataType, Field, FieldRef, Float64Type, Int64Type, TimeUnit};
use datafusion::common::{exec_err, plan_err, Result, ScalarValue};
use datafusion::logical_expr::{
    ColumnarValue, ReturnFieldArgs, ScalarFunctionArgs, ScalarUDFImpl, Signature, TypeSignature,
    Volatility,
};

use crate::calendar::Calendar;
use crate::cf_time::CfTime;
use crate::model_calendar::with_calendar;

/// The `cf_time` scalar function.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct CfTimeFunc {
    signature: Signature,
}

impl Default for CfTimeFunc {
    fn default() -> Self {
        Self::new()
    }
}

impl CfTimeFunc {
    /// Creates the function with its signature.
    pub fn new() -> Self {
        let mut variants = Vec::new();
        for value in [DataType::Int64, DataType::Float64] {
            variants.push(TypeSignature::Exact(vec![value.clone(), DataType::Utf8]));
            variants.push(TypeSignature::Exact(vec![
                value,
                DataType::Utf8,
                DataType::Utf8,
            ]));
        }
        Self {
            signature: Signature::one_of(variants, Volatility::Immutable),
        }
    }
}

fn literal_string(arg: &ColumnarValue, what: &str) -> Result<String> {
    match arg {
        ColumnarValue::Scalar(ScalarValue::Utf8(Some(s))) => Ok(s.clone()),
        _ => plan_err!("cf_time: {what} must be a non-null string literal"),
    }
}

impl ScalarUDFImpl for CfTimeFunc {
    fn name(&self) -> &str {
        "cf_time"
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, _arg_types: &[DataType]) -> Result<DataType> {
        Ok(DataType::Timestamp(TimeUnit::Nanosecond, None))
    }

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        // Dates of a model calendar name it, as its coordinates do, so
        // that what counts days over them counts the calendar's.
        let calendar = match args.scalar_arguments.get(2).copied().flatten() {
            Some(ScalarValue::Utf8(Some(name))) => Calendar::parse(name),
            _ => None,
        };
        let nullable = args.arg_fields.first().is_none_or(|f| f.is_nullable());
        let field = Arc::new(Field::new(
            self.name(),
            DataType::Timestamp(TimeUnit::Nanosecond, None),
            nullable,
        ));
        Ok(with_calendar(
            field,
            calendar.filter(|calendar| !calendar.is_gregorian()),
        ))
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let units = literal_string(&args.args[1], "units")?;
        let calendar = match args.args.get(2) {
            Some(arg) => Some(literal_string(arg, "calendar")?),
            None => None,
        };
        let encoding = match CfTime::parse(&units, calendar.as_deref()) {
            Ok(Some(encoding)) => encoding,
            Ok(None) => return plan_err!("cf_time: units '{units}' have no 'since <date>'"),
            Err(e) => return plan_err!("cf_time: {e}"),
        };
        let values = args.args[0].to_array(args.number_rows)?;
        let decoded: TimestampNanosecondArray = match values.data_type() {
            DataType::Int64 => values
                .as_primitive::<Int64Type>()
                .iter()
                .map(|v| v.map(|v| encoding.decode_i64(v)).transpose())
                .collect::<std::result::Result<_, _>>(),
            DataType::Float64 => values
                .as_primitive::<Float64Type>()
                .iter()
                .map(|v| {
                    v.filter(|v| !v.is_nan())
                        .map(|v| encoding.decode_f64(v))
                        .transpose()
                })
                .collect::<std::result::Result<_, _>>(),
            other => return exec_err!("cf_time: unsupported value type {other}"),
        }
        .or_else(|e| exec_err!("cf_time: {e}"))?;
        let decoded: Arc<dyn Array> = Arc::new(decoded);
        if matches!(args.args[0], ColumnarValue::Scalar(_)) {
            return Ok(ColumnarValue::Scalar(ScalarValue::try_from_array(
                &decoded, 0,
            )?));
        }
        Ok(ColumnarValue::Array(decoded))
    }
}

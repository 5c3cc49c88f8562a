//! `date_part`, `date_trunc`, `date_bin`, `+` and `-` over times kept as
//! CF numbers.
//!
//! A coordinate of a model calendar holding dates that have no timestamp
//! (the 29th and 30th of February of a daily `360_day` calendar) keeps its
//! numbers (`hours since 2000-01-01`), as xarray's `decode_times=False`
//! shows them; its field metadata names their units and calendar
//! ([`TIME_UNITS_METADATA`](crate::model_calendar::TIME_UNITS_METADATA),
//! [`TIME_CALENDAR_METADATA`](crate::model_calendar::TIME_CALENDAR_METADATA)). The dates are
//! still there, as cftime decodes them: these functions read the parts of
//! each number's date (`extract(month FROM time)`, `doy`, `dow`, ...) and
//! truncate dates to the start of their year, quarter, month, week, day,
//! hour, minute or second, bin them by strides of days and hours
//! counted in the calendar's days or of months (`date_bin`), and step them
//! by intervals (`time + INTERVAL '1 day'`), as numbers of the same units;
//! the difference of two (`time - lag(time) OVER (...)`) is a duration of
//! the calendar's time.
//! [`crate::calendar_rewrite::CalendarFunctionsRewrite`] puts them in
//! place of `date_part`, `date_trunc`, `date_bin`, `+` and `-` over such a
//! column (and gives a window's `RANGE` frame over it its distances in
//! the numbers' units), so that
//! climatologies and monthly means of a daily `360_day` store are written
//! as for any other:
//!
//! ```sql
//! SELECT extract(month FROM time) AS month, avg(tas) FROM hadgem_daily GROUP BY 1;
//! SELECT date_bin(INTERVAL '5 days', time, TIMESTAMP '2000-01-01') AS pentad, avg(tas)
//! FROM hadgem_daily GROUP BY 1;
//! SELECT cf_date_part('month', time, 'hours since 2000-01-01', '360_day') FROM hadgem_daily;
//! ```

use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, AsArray, DurationNanosecondArray, Float64Array};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Field, FieldRef, Float64Type, TimeUnit};
use datafusion::common::{exec_err, plan_err, Result, ScalarValue};
use datafusion::logical_expr::{
    ColumnarValue, ReturnFieldArgs, ScalarFunctionArgs, ScalarUDFImpl, Signature, Volatility,
};

use crate::calendar::{Calendar, Date};
use crate::calendar_arithmetic::{shifted_date, signed, step_type, steps};
use crate::cf_time::CfTime;
use crate::date_bin::{month_bin_start, nanos_of, stride_months, stride_nanos};
use crate::model_calendar::{date_nanos, date_of, kept_numbers_metadata, nanos_date};

/// Nanoseconds in an hour, a minute and a second.
const HOUR: i64 = 3_600_000_000_000;
const MINUTE: i64 = 60_000_000_000;
const SECOND: i64 = 1_000_000_000;

/// A string literal argument.
fn literal<'a>(function: &str, what: &str, value: Option<&'a ScalarValue>) -> Result<&'a str> {
    match value {
        Some(ScalarValue::Utf8(Some(s)))
        | Some(ScalarValue::Utf8View(Some(s)))
        | Some(ScalarValue::LargeUtf8(Some(s))) => Ok(s.trim_matches(|c| c == '\'' || c == '"')),
        _ => plan_err!("{function}: {what} must be a string literal"),
    }
}

/// The literal of argument `i` of a call.
fn argument(args: &[ColumnarValue], i: usize) -> Option<&ScalarValue> {
    match args.get(i) {
        Some(ColumnarValue::Scalar(value)) => Some(value),
        _ => None,
    }
}

/// The encoding the third and fourth arguments (units, calendar) name.
fn encoding(
    function: &str,
    units: Option<&ScalarValue>,
    calendar: Option<&ScalarValue>,
) -> Result<CfTime> {
    let units = literal(function, "the units", units)?;
    let calendar = literal(function, "the calendar", calendar)?;
    match CfTime::parse(units, Some(calendar)) {
        Ok(Some(time)) => Ok(time),
        Ok(None) => plan_err!("{function}: units '{units}' have no 'since <date>'"),
        Err(e) => plan_err!("{function}: {e}"),
    }
}

/// The numbers argument as floats (NULL kept).
fn counts(value: &ColumnarValue, rows: usize) -> Result<Float64Array> {
    Ok(cast(&value.to_array(rows)?, &DataType::Float64)?
        .as_primitive::<Float64Type>()
        .clone())
}

/// The result as a scalar when every input it was computed from was one.
fn result(inputs: &[ColumnarValue], values: ArrayRef) -> Result<ColumnarValue> {
    Ok(
        match inputs.iter().all(|a| matches!(a, ColumnarValue::Scalar(_))) {
            true => ColumnarValue::Scalar(ScalarValue::try_from_array(&values, 0)?),
            false => ColumnarValue::Array(values),
        },
    )
}

/// The signature both functions share: a part or unit, numbers, units and
/// a calendar.
fn signature(function: &str, arg_types: &[DataType]) -> Result<Vec<DataType>> {
    match arg_types {
        [part, numbers, units, calendar] if numbers.is_numeric() || *numbers == DataType::Null => {
            Ok(vec![
                part.clone(),
                DataType::Float64,
                units.clone(),
                calendar.clone(),
            ])
        }
        _ => plan_err!(
            "{function} takes a part, CF-encoded numbers, their units and calendar, not {arg_types:?}"
        ),
    }
}

/// A part of a date (and the nanoseconds into it) of a calendar.
type Part = fn(Calendar, Date, i64) -> Option<i64>;

/// The part named `part`, as `date_part` names them.
fn part(name: &str) -> Option<Part> {
    Some(match name.to_ascii_lowercase().as_str() {
        "year" | "years" => |_, d, _| Some(d.year),
        "quarter" => |_, d, _| Some(i64::from((d.month - 1) / 3 + 1)),
        "month" | "months" => |_, d, _| Some(i64::from(d.month)),
        "day" | "days" => |_, d, _| Some(i64::from(d.day)),
        "hour" | "hours" => |_, _, n| Some(n / HOUR),
        "minute" | "minutes" => |_, _, n| Some(n % HOUR / MINUTE),
        "second" | "seconds" => |_, _, n| Some(n % MINUTE / SECOND),
        "doy" => |c, d, _| c.day_of_year(d),
        // Sunday 0 to Saturday 6.
        "dow" => |c, d, _| Some((c.weekday(d)? + 1) % 7),
        // Monday 1 to Sunday 7.
        "isodow" => |c, d, _| Some(c.weekday(d)? + 1),
        _ => return None,
    })
}

/// The names [`part`] knows, for errors.
const PARTS: &str = "year, quarter, month, day, hour, minute, second, doy, dow, isodow";

/// `cf_date_part(part, numbers, units, calendar)`: a part of the dates CF
/// numbers encode; `cf_date_trunc(unit, numbers, units, calendar)`: those
/// dates truncated to the start of a period, as numbers of the same units
/// (see the module docs).
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct CfDateFunc {
    signature: Signature,
    /// Whether it truncates (`cf_date_trunc`) rather than takes a part.
    truncate: bool,
}

impl CfDateFunc {
    /// `cf_date_part`.
    pub fn part() -> Self {
        Self {
            signature: Signature::user_defined(Volatility::Immutable),
            truncate: false,
        }
    }

    /// `cf_date_trunc`.
    pub fn trunc() -> Self {
        Self {
            truncate: true,
            ..Self::part()
        }
    }

    /// What `name` asks of each date: an error unless it knows the part
    /// or unit.
    fn operation(&self, name: &str) -> Result<Operation> {
        let (known, what, names) = match self.truncate {
            true => (truncation(name).map(Operation::Truncate), "units", UNITS),
            false => (part(name).map(Operation::Part), "parts", PARTS),
        };
        match known {
            Some(operation) => Ok(operation),
            None => plan_err!(
                "{}: '{name}' of dates kept as numbers is not supported ({what}: {names})",
                self.name()
            ),
        }
    }

    /// The type of its results.
    fn data_type(&self) -> DataType {
        match self.truncate {
            true => DataType::Float64,
            false => DataType::Int32,
        }
    }
}

impl ScalarUDFImpl for CfDateFunc {
    fn name(&self) -> &str {
        match self.truncate {
            true => "cf_date_trunc",
            false => "cf_date_part",
        }
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        signature(self.name(), arg_types)
    }

    fn return_type(&self, _arg_types: &[DataType]) -> Result<DataType> {
        Ok(self.data_type())
    }

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        let scalar = |i: usize| args.scalar_arguments.get(i).copied().flatten();
        self.operation(literal(self.name(), "the part or unit", scalar(0))?)?;
        let time = encoding(self.name(), scalar(2), scalar(3))?;
        let nullable = args.arg_fields.get(1).is_none_or(|f| f.is_nullable());
        let field = Field::new(self.name(), self.data_type(), nullable);
        Ok(Arc::new(if self.truncate {
            // Truncated dates are numbers of the same units and calendar.
            let units = literal(self.name(), "the units", scalar(2))?;
            field.with_metadata(kept_numbers_metadata(units, time.calendar().name()))
        } else {
            field
        }))
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let name = literal(self.name(), "the part or unit", argument(&args.args, 0))?;
        let operation = self.operation(name)?;
        let time = encoding(
            self.name(),
            argument(&args.args, 2),
            argument(&args.args, 3),
        )?;
        let Some(numbers) = args.args.get(1) else {
            return exec_err!("{} takes four arguments", self.name());
        };
        let values = counts(numbers, args.number_rows)?
            .iter()
            .map(|value| {
                let Some(value) = value.filter(|v| !v.is_nan()) else {
                    return Ok(None);
                };
                match operation.of(&time, value) {
                    Some(result) => Ok(Some(result)),
                    None => exec_err!(
                        "{}: {value} {} has no date of the {} calendar",
                        self.name(),
                        time_units(args.args.get(2..).unwrap_or_default()),
                        time.calendar().name()
                    ),
                }
            })
            .collect::<Result<Float64Array>>()?;
        // Parts are small whole numbers.
        result(
            std::slice::from_ref(numbers),
            cast(&values, &self.data_type())?,
        )
    }
}

/// `cf_date_bin(stride, numbers, origin, units, calendar)`: the dates CF
/// numbers encode binned by a stride counted from `origin` (a timestamp
/// with the fields of a date of the calendar), each bin's start as a
/// number of the same units: what `date_bin` of a time column kept as
/// numbers becomes (see the module docs). A stride of days and hours
/// counts the calendar's days; one of months counts the dates' months, as
/// DataFusion's `date_bin` does (the bins start on the origin's day of the
/// month, or the calendar's last day of a shorter month).
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct CfDateBinFunc {
    signature: Signature,
}

impl Default for CfDateBinFunc {
    fn default() -> Self {
        Self::new()
    }
}

impl CfDateBinFunc {
    /// The function.
    pub fn new() -> Self {
        Self {
            signature: Signature::user_defined(Volatility::Immutable),
        }
    }

    /// The stride: nanoseconds (days, hours, ...) or months, never both;
    /// an error for none, one of no length, or one mixing months with days.
    fn stride(&self, stride: Option<&ScalarValue>) -> Result<Stride> {
        let months = stride.and_then(stride_months);
        match (stride.and_then(stride_nanos), months) {
            (Some(nanos), _) if nanos > 0 => Ok(Stride::Nanos(nanos)),
            (_, Some(months)) if months > 0 => Ok(Stride::Months(months)),
            _ => plan_err!(
                "{}: the stride must be a positive interval of months, or of days, hours or \
                 less, not both ({})",
                self.name(),
                stride.map_or("none".to_string(), |s| s.to_string())
            ),
        }
    }
}

/// A `date_bin` stride over dates kept as numbers.
#[derive(Debug, Clone, Copy)]
enum Stride {
    /// Nanoseconds of the calendar's days.
    Nanos(i64),
    /// Months of its dates.
    Months(i64),
}

impl ScalarUDFImpl for CfDateBinFunc {
    fn name(&self) -> &str {
        "cf_date_bin"
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        match arg_types {
            [stride @ DataType::Interval(_), numbers, origin, units, calendar]
                if numbers.is_numeric() || *numbers == DataType::Null =>
            {
                Ok(vec![
                    stride.clone(),
                    DataType::Float64,
                    match origin {
                        DataType::Timestamp(_, None) | DataType::Null => {
                            DataType::Timestamp(TimeUnit::Nanosecond, None)
                        }
                        other => other.clone(),
                    },
                    units.clone(),
                    calendar.clone(),
                ])
            }
            _ => plan_err!(
                "{} takes a stride, CF-encoded numbers, an origin, their units and calendar, \
                 not {arg_types:?}",
                self.name()
            ),
        }
    }

    fn return_type(&self, _arg_types: &[DataType]) -> Result<DataType> {
        Ok(DataType::Float64)
    }

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        let scalar = |i: usize| args.scalar_arguments.get(i).copied().flatten();
        self.stride(scalar(0))?;
        let time = encoding(self.name(), scalar(3), scalar(4))?;
        let units = literal(self.name(), "the units", scalar(3))?;
        let nullable = args.arg_fields.get(1).is_none_or(|f| f.is_nullable())
            || args.arg_fields.get(2).is_none_or(|f| f.is_nullable());
        let field = Field::new(self.name(), DataType::Float64, nullable);
        Ok(Arc::new(field.with_metadata(kept_numbers_metadata(
            units,
            time.calendar().name(),
        ))))
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let stride = self.stride(argument(&args.args, 0))?;
        let time = encoding(
            self.name(),
            argument(&args.args, 3),
            argument(&args.args, 4),
        )?;
        let (Some(numbers), Some(origin)) = (args.args.get(1), args.args.get(2)) else {
            return exec_err!("{} takes five arguments", self.name());
        };
        let calendar = time.calendar();
        let origin = match origin {
            ColumnarValue::Scalar(_) => nanos_of(origin)?,
            ColumnarValue::Array(_) => {
                return exec_err!("{}: the origin must be one timestamp", self.name())
            }
        };
        // A NULL origin bins nothing, as DataFusion's date_bin.
        let Some(origin) = origin else {
            let nulls = Float64Array::new_null(args.number_rows);
            return result(std::slice::from_ref(numbers), Arc::new(nulls));
        };
        let (date, nanos) = date_of(origin);
        if date_nanos(calendar, date, nanos).is_none() {
            return exec_err!(
                "{}: the origin {date} is no date of the {} calendar",
                self.name(),
                calendar.name()
            );
        }
        let values = counts(numbers, args.number_rows)?
            .iter()
            .map(|value| {
                let Some(value) = value.filter(|v| !v.is_nan()) else {
                    return Ok(None);
                };
                match bin_start(&time, (date, nanos), stride, value) {
                    Some(start) => Ok(Some(start)),
                    None => exec_err!(
                        "{}: {value} {} has no bin of the {} calendar from the origin",
                        self.name(),
                        time_units(args.args.get(3..).unwrap_or_default()),
                        calendar.name()
                    ),
                }
            })
            .collect::<Result<Float64Array>>()?;
        result(std::slice::from_ref(numbers), Arc::new(values))
    }
}

/// The start of the bin of `stride` from `origin` (a date of `time`'s
/// calendar and the nanoseconds into it) holding the date `value`
/// encodes, as a number of `time`'s units: `None` when there is no such
/// date or the count overflows. Bins of nanoseconds count the calendar's
/// own days (see [`crate::model_calendar::date_nanos`]); bins of months
/// count the months between the dates' fields, a bin starting after the
/// date (the origin's day is later in the month) giving way to the one
/// before, as DataFusion's `date_bin` by months.
fn bin_start(
    time: &CfTime,
    (origin, into): (Date, i64),
    stride: Stride,
    value: f64,
) -> Option<f64> {
    let calendar = time.calendar();
    let (date, nanos) = time.date_of(value)?;
    let start = match stride {
        Stride::Nanos(stride) => {
            let at = date_nanos(calendar, date, nanos)?;
            let origin = date_nanos(calendar, origin, into)?;
            let since = at.checked_sub(origin)?;
            origin.checked_add(since.div_euclid(stride).checked_mul(stride)?)?
        }
        Stride::Months(stride) => month_bin_start(calendar, (origin, into), stride, (date, nanos))?,
    };
    let (date, nanos) = nanos_date(calendar, start);
    time.count_of(date, nanos)
}

/// `cf_date_add(numbers, step, units, calendar)` and
/// `cf_date_subtract(...)`: the dates CF numbers encode plus or minus an
/// interval or a duration, stepped as a model calendar's times are (see
/// [`crate::calendar_arithmetic`]: months by the date's fields, then days
/// along the calendar's days), as numbers of the same units: what `+` and
/// `-` of a time column kept as numbers and a step become.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct CfDateShiftFunc {
    signature: Signature,
    /// Whether the step is taken away (`cf_date_subtract`).
    subtract: bool,
}

impl CfDateShiftFunc {
    /// `cf_date_add`.
    pub fn add() -> Self {
        Self {
            signature: Signature::user_defined(Volatility::Immutable),
            subtract: false,
        }
    }

    /// `cf_date_subtract`.
    pub fn subtract() -> Self {
        Self {
            subtract: true,
            ..Self::add()
        }
    }
}

impl ScalarUDFImpl for CfDateShiftFunc {
    fn name(&self) -> &str {
        match self.subtract {
            true => "cf_date_subtract",
            false => "cf_date_add",
        }
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        match (arg_types, step_type(arg_types.get(1))) {
            ([numbers, _, units, calendar], Some(step))
                if numbers.is_numeric() || *numbers == DataType::Null =>
            {
                Ok(vec![
                    DataType::Float64,
                    step,
                    units.clone(),
                    calendar.clone(),
                ])
            }
            _ => plan_err!(
                "{} takes CF-encoded numbers, an interval or a duration, their units and \
                 calendar, not {arg_types:?}",
                self.name()
            ),
        }
    }

    fn return_type(&self, _arg_types: &[DataType]) -> Result<DataType> {
        Ok(DataType::Float64)
    }

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        let scalar = |i: usize| args.scalar_arguments.get(i).copied().flatten();
        let time = encoding(self.name(), scalar(2), scalar(3))?;
        let units = literal(self.name(), "the units", scalar(2))?;
        let nullable = args.arg_fields.iter().take(2).any(|f| f.is_nullable());
        let field = Field::new(self.name(), DataType::Float64, nullable);
        // Dates stepped are dates of the same units and calendar.
        Ok(Arc::new(field.with_metadata(kept_numbers_metadata(
            units,
            time.calendar().name(),
        ))))
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let time = encoding(
            self.name(),
            argument(&args.args, 2),
            argument(&args.args, 3),
        )?;
        let (Some(numbers), Some(step)) = (args.args.first(), args.args.get(1)) else {
            return exec_err!("{} takes four arguments", self.name());
        };
        let rows = args.number_rows;
        let calendar = time.calendar();
        let stepped = counts(numbers, rows)?
            .iter()
            .zip(steps(self.name(), step, rows)?)
            .map(|pair| {
                let (Some(value), Some(step)) = pair else {
                    return Ok(None);
                };
                if value.is_nan() {
                    return Ok(None);
                }
                let moved = signed(step, self.subtract).and_then(|step| {
                    let (date, nanos) = time.date_of(value)?;
                    let moved = shifted_date(calendar, date, nanos, step)?;
                    let (date, nanos) = nanos_date(calendar, moved);
                    time.count_of(date, nanos)
                });
                match moved {
                    Some(moved) => Ok(Some(moved)),
                    None => exec_err!(
                        "{}: {value} {} of the {} calendar {} {step:?} (months, days, \
                         nanoseconds) is no date of it, or overflows",
                        self.name(),
                        time_units(args.args.get(2..).unwrap_or_default()),
                        calendar.name(),
                        if self.subtract { "minus" } else { "plus" }
                    ),
                }
            })
            .collect::<Result<Float64Array>>()?;
        result(args.args.get(..2).unwrap_or_default(), Arc::new(stepped))
    }
}

/// `cf_date_difference(a, b, units, calendar)`: `a - b` of two counts of
/// the same CF units and calendar as a duration: the calendar's own time
/// between the dates they encode (CF numbers count it), what `-` of two
/// times kept as numbers (or of one and a date) becomes.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct CfDateDifferenceFunc {
    signature: Signature,
}

impl Default for CfDateDifferenceFunc {
    fn default() -> Self {
        Self::new()
    }
}

impl CfDateDifferenceFunc {
    /// The function.
    pub fn new() -> Self {
        Self {
            signature: Signature::user_defined(Volatility::Immutable),
        }
    }
}

/// The nanoseconds from `b` to `a`, counts of `unit` nanoseconds: exact
/// for whole counts, rounded to the nanosecond otherwise; `None` when it
/// overflows.
fn nanos_between(unit: i64, a: f64, b: f64) -> Option<i64> {
    let whole = |v: f64| v.fract() == 0.0 && v.abs() < 2f64.powi(53);
    if whole(a) && whole(b) {
        return (a as i64).checked_sub(b as i64)?.checked_mul(unit);
    }
    let nanos = ((a - b) * unit as f64).round();
    (nanos.is_finite() && nanos.abs() < 9.2e18).then_some(nanos as i64)
}

impl ScalarUDFImpl for CfDateDifferenceFunc {
    fn name(&self) -> &str {
        "cf_date_difference"
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        let number = |t: &DataType| t.is_numeric() || *t == DataType::Null;
        match arg_types {
            [a, b, units, calendar] if number(a) && number(b) => Ok(vec![
                DataType::Float64,
                DataType::Float64,
                units.clone(),
                calendar.clone(),
            ]),
            _ => plan_err!(
                "{} takes two CF-encoded numbers, their units and calendar, not {arg_types:?}",
                self.name()
            ),
        }
    }

    fn return_type(&self, _arg_types: &[DataType]) -> Result<DataType> {
        Ok(DataType::Duration(TimeUnit::Nanosecond))
    }

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        let scalar = |i: usize| args.scalar_arguments.get(i).copied().flatten();
        encoding(self.name(), scalar(2), scalar(3))?;
        let nullable = args.arg_fields.iter().take(2).any(|f| f.is_nullable());
        Ok(Arc::new(Field::new(
            self.name(),
            DataType::Duration(TimeUnit::Nanosecond),
            nullable,
        )))
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let time = encoding(
            self.name(),
            argument(&args.args, 2),
            argument(&args.args, 3),
        )?;
        let (Some(a), Some(b)) = (args.args.first(), args.args.get(1)) else {
            return exec_err!("{} takes four arguments", self.name());
        };
        let rows = args.number_rows;
        let unit = time.unit().nanos();
        let differences = counts(a, rows)?
            .iter()
            .zip(counts(b, rows)?.iter())
            .map(|pair| match pair {
                (Some(a), Some(b)) if !a.is_nan() && !b.is_nan() => {
                    match nanos_between(unit, a, b) {
                        Some(nanos) => Ok(Some(nanos)),
                        None => exec_err!(
                            "{}: {a} minus {b} {} overflows a duration in nanoseconds",
                            self.name(),
                            time_units(args.args.get(2..).unwrap_or_default())
                        ),
                    }
                }
                _ => Ok(None),
            })
            .collect::<Result<DurationNanosecondArray>>()?;
        result(
            args.args.get(..2).unwrap_or_default(),
            Arc::new(differences),
        )
    }
}

/// The units argument (the first of `args`), for errors.
fn time_units(args: &[ColumnarValue]) -> String {
    match argument(args, 0) {
        Some(ScalarValue::Utf8(Some(units))) => units.clone(),
        _ => "units".to_string(),
    }
}

/// The start of a period holding a date and the nanoseconds into it, in a
/// calendar: `None` when the calendar lacks it.
type Truncation = fn(Calendar, Date, i64) -> Option<(Date, i64)>;

/// The truncation to the start of the period `unit` names.
fn truncation(unit: &str) -> Option<Truncation> {
    Some(match unit.to_ascii_lowercase().as_str() {
        "year" => |_, date, _| {
            let start = Date {
                month: 1,
                day: 1,
                ..date
            };
            Some((start, 0))
        },
        "quarter" => |_, date, _| {
            let start = Date {
                month: (date.month - 1) / 3 * 3 + 1,
                day: 1,
                ..date
            };
            Some((start, 0))
        },
        "month" => |_, date, _| Some((Date { day: 1, ..date }, 0)),
        "week" => |calendar, date, _| {
            let monday = calendar.day_number(date)? - calendar.weekday(date)?;
            Some((calendar.date(monday), 0))
        },
        "day" => |_, date, _| Some((date, 0)),
        "hour" => |_, date, nanos| Some((date, nanos - nanos % HOUR)),
        "minute" => |_, date, nanos| Some((date, nanos - nanos % MINUTE)),
        "second" => |_, date, nanos| Some((date, nanos - nanos % SECOND)),
        _ => return None,
    })
}

/// What a call asks of each date, resolved once from its part or unit.
#[derive(Clone, Copy)]
enum Operation {
    /// A part of the date (`cf_date_part`).
    Part(Part),
    /// The start of its period, as a number (`cf_date_trunc`).
    Truncate(Truncation),
}

impl Operation {
    /// The part, or the period's start, of the date `value` encodes:
    /// `None` when it has no date of the calendar.
    fn of(self, time: &CfTime, value: f64) -> Option<f64> {
        let (date, nanos) = time.date_of(value)?;
        match self {
            Self::Part(part) => part(time.calendar(), date, nanos).map(|p| p as f64),
            Self::Truncate(truncate) => {
                let (date, nanos) = truncate(time.calendar(), date, nanos)?;
                time.count_of(date, nanos)
            }
        }
    }
}

/// The units [`truncation`] knows, for errors.
const UNITS: &str = "year, quarter, month, week, day, hour, minute, second";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model_calendar::DAY;

    /// Every day of two `360_day` years, hourly numbers: the parts are the
    /// fields of the day counted from the reference, and each period's
    /// start decodes to its first day.
    #[test]
    fn parts_and_starts_of_360_day_numbers() {
        let time = CfTime::parse("hours since 2000-01-01", Some("360_day"))
            .unwrap()
            .unwrap();
        for n in 0..720i64 {
            let value = (n * 24 + 13) as f64;
            let (date, nanos) = time.date_of(value).unwrap();
            let want = Date {
                year: 2000 + n / 360,
                month: (n % 360 / 30 + 1) as u32,
                day: (n % 30 + 1) as u32,
            };
            assert_eq!((date, nanos), (want, 13 * HOUR), "day {n}");
            assert_eq!(time.count_of(date, nanos), Some(value));
            let month = part("month").unwrap();
            assert_eq!(
                month(Calendar::Day360, date, nanos),
                Some(i64::from(want.month))
            );
            let start = truncation("month").unwrap()(Calendar::Day360, date, nanos).unwrap();
            let start = time.count_of(start.0, start.1).unwrap();
            assert_eq!(start, ((n / 30) * 30 * 24) as f64);
            // Weeks of the calendar's Mondays: 0 to 6 days back.
            let week = truncation("week").unwrap()(Calendar::Day360, date, nanos).unwrap();
            let back = value - time.count_of(week.0, week.1).unwrap();
            assert!((13.0..13.0 + 7.0 * 24.0).contains(&back), "{back}");
            let dow = part("isodow").unwrap()(Calendar::Day360, week.0, 0);
            assert_eq!(dow, Some(1));
        }
        // The 30th of February is there.
        let (date, _) = time.date_of((59 * 24) as f64).unwrap();
        assert_eq!(
            date,
            Date {
                year: 2000,
                month: 2,
                day: 30
            }
        );
        // Bins of 7 days from the 3rd of January (day 2): each starts on a
        // day 2 + 7k at most 6 days back, and bins of 6 hours hold their hour.
        let origin = (
            Date {
                year: 2000,
                month: 1,
                day: 3,
            },
            0,
        );
        let (week, six_hours) = (Stride::Nanos(7 * DAY), Stride::Nanos(6 * HOUR));
        for n in 0..720i64 {
            let value = (n * 24 + 13) as f64;
            let start = bin_start(&time, origin, week, value).unwrap();
            let day = start / 24.0;
            assert_eq!(day.fract(), 0.0);
            assert_eq!((day as i64 - 2).rem_euclid(7), 0, "day {n}");
            assert!((0..7).contains(&(n - day as i64)), "day {n}");
            let quarter = bin_start(&time, origin, six_hours, value).unwrap();
            assert_eq!(quarter, (n * 24 + 12) as f64);
        }
        // Before the origin too, and no bin past the end of the scale.
        assert_eq!(bin_start(&time, origin, week, 0.0), Some(-5.0 * 24.0));
        assert_eq!(bin_start(&time, origin, week, 1e300), None);
        assert_eq!(time.date_of(f64::NAN), None);
        assert_eq!(time.date_of(1e300), None);
    }

    /// Bins of months start on the origin's day of the month (the
    /// calendar's last day of a shorter month): each date's bin is the
    /// latest of the origin's month steps (a multiple of the stride) that
    /// does not start after it, found by walking every step.
    #[test]
    fn bins_of_months_start_on_the_origin_s_day() {
        for (units, calendar) in [
            ("hours since 2000-01-01", "360_day"),
            ("days since 1999-06-01 06:00", "noleap"),
            ("hours since 2000-01-01", "all_leap"),
        ] {
            let time = CfTime::parse(units, Some(calendar)).unwrap().unwrap();
            let cal = time.calendar();
            let per_day = 86_400e9 / time.unit().nanos() as f64;
            for origin in [
                (
                    Date {
                        year: 1999,
                        month: 12,
                        day: 1,
                    },
                    0,
                ),
                (
                    Date {
                        year: 2000,
                        month: 1,
                        day: 30,
                    },
                    12 * HOUR,
                ),
            ] {
                let at = |(date, nanos): (Date, i64)| date_nanos(cal, date, nanos).unwrap();
                for months in [1i64, 3, 5] {
                    let starts: Vec<i64> = (-40..40)
                        .map(|k| {
                            shifted_date(cal, origin.0, origin.1, ((k * months) as i32, 0, 0))
                                .unwrap()
                        })
                        .collect();
                    for n in 0..800 {
                        let value = (n as f64 + 0.25) * per_day;
                        let (date, nanos) = time.date_of(value).unwrap();
                        let want = starts
                            .iter()
                            .filter(|&&s| s <= at((date, nanos)))
                            .max()
                            .unwrap();
                        let got = bin_start(&time, origin, Stride::Months(months), value).unwrap();
                        let (d, n2) = time.date_of(got).unwrap();
                        assert_eq!(
                            at((d, n2)),
                            *want,
                            "{calendar} {date} by {months} from {:?}",
                            origin.0
                        );
                    }
                }
            }
        }
    }
}

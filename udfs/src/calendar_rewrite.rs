//! [`CalendarFunctionsRewrite`]: the model calendars' `date_part`,
//! `date_bin`, `date_trunc`, `-` and `+` wherever a plan calls DataFusion's,
//! `RANGE` frames counting their days, dates compared with times kept as
//! numbers as those numbers,
//! and `date_part`, `date_trunc` and `date_bin` of times kept as numbers.

use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, IntervalUnit};
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::Transformed;
use datafusion::common::{plan_err, DFSchema, Result, ScalarValue};
use datafusion::logical_expr::expr::{ScalarFunction, WindowFunction};
use datafusion::logical_expr::expr_rewriter::FunctionRewrite;
use datafusion::logical_expr::planner::{ExprPlanner, PlannerResult};
use datafusion::logical_expr::{
    lit, BinaryExpr, Expr, ExprSchemable, Operator, ScalarUDF, WindowFrameBound, WindowFrameUnits,
};

use crate::calendar::Calendar;
use crate::calendar_arithmetic::{CalendarDifferenceFunc, CalendarScaleFunc, CalendarShiftFunc};
use crate::cf_numbers::{CfDateBinFunc, CfDateFunc};
use crate::cf_time::CfTime;
use crate::date_bin::stride_nanos;
use crate::date_bin::DateBinFunc;
use crate::date_part::DatePartFunc;
use crate::date_trunc::DateTruncFunc;
use crate::model_calendar::{calendar_of, date_of, kept_numbers_of, DAY};

/// Puts [`DatePartFunc`], [`DateBinFunc`] and [`DateTruncFunc`] in place
/// of DataFusion's `date_part`, `date_bin` and `date_trunc` wherever a plan
/// calls those directly (the SQL planner does for `extract(part FROM t)`,
/// DataFrame APIs may), and the functions of
/// [`crate::calendar_arithmetic`] in place of `-` and `+` where a side is a
/// time of a model calendar, and a window's `RANGE` frame of days and hours
/// over such a time is ordered by [`CalendarScaleFunc`] (so that its
/// distances count the calendar's days); `date_part`, `date_trunc` and
/// `date_bin` of a time column kept as numbers become
/// [`crate::cf_numbers`]'s.
#[derive(Debug, Default)]
pub struct CalendarFunctionsRewrite;

impl FunctionRewrite for CalendarFunctionsRewrite {
    fn name(&self) -> &str {
        "zarrfusion_model_calendars"
    }

    fn rewrite(
        &self,
        expr: Expr,
        schema: &DFSchema,
        _config: &ConfigOptions,
    ) -> Result<Transformed<Expr>> {
        let call = match expr {
            Expr::ScalarFunction(call) => call,
            Expr::BinaryExpr(binary)
                if matches!(
                    binary.op,
                    Operator::Eq
                        | Operator::NotEq
                        | Operator::Lt
                        | Operator::LtEq
                        | Operator::Gt
                        | Operator::GtEq
                        | Operator::IsDistinctFrom
                        | Operator::IsNotDistinctFrom
                ) =>
            {
                return compared_with_dates(Expr::BinaryExpr(binary), schema)
            }
            Expr::BinaryExpr(binary) => return Ok(arithmetic(binary, schema)),
            Expr::Between(_) | Expr::InList(_) => return compared_with_dates(expr, schema),
            Expr::WindowFunction(window) => return Ok(range_over_calendar(*window, schema)),
            _ => return Ok(Transformed::no(expr)),
        };
        if let Some(kept) = over_kept_numbers(&call, schema) {
            return Ok(Transformed::yes(kept));
        }
        let inner = call.func.inner();
        let ours = match call.func.name() {
            "date_part" if !inner.is::<DatePartFunc>() => ScalarUDF::from(DatePartFunc::new()),
            "date_bin" if !inner.is::<DateBinFunc>() => ScalarUDF::from(DateBinFunc::new()),
            "date_trunc" if !inner.is::<DateTruncFunc>() => ScalarUDF::from(DateTruncFunc::new()),
            _ => return Ok(Transformed::no(Expr::ScalarFunction(call))),
        };
        Ok(Transformed::yes(Expr::ScalarFunction(
            ScalarFunction::new_udf(Arc::new(ours), call.args),
        )))
    }
}

/// `date_part`, `date_trunc` or `date_bin` of a time column kept as
/// numbers (see [`crate::cf_numbers`]) as the function of that module
/// reading their dates, with the column's units and calendar (and
/// `date_bin`'s origin, 1970-01-01 when not given).
fn over_kept_numbers(call: &ScalarFunction, schema: &DFSchema) -> Option<Expr> {
    let epoch = || lit(ScalarValue::TimestampNanosecond(Some(0), None));
    let (func, origin) = match (call.func.name(), call.args.as_slice()) {
        ("date_part", [_, _]) => (ScalarUDF::from(CfDateFunc::part()), None),
        ("date_trunc", [_, _]) => (ScalarUDF::from(CfDateFunc::trunc()), None),
        ("date_bin", [_, _]) => (ScalarUDF::from(CfDateBinFunc::new()), Some(epoch())),
        ("date_bin", [_, _, origin]) => {
            (ScalarUDF::from(CfDateBinFunc::new()), Some(origin.clone()))
        }
        _ => return None,
    };
    let [first, numbers, ..] = call.args.as_slice() else {
        return None;
    };
    let (_, field) = numbers.to_field(schema).ok()?;
    let (units, calendar) = kept_numbers_of(&field)?;
    let mut args = vec![first.clone(), numbers.clone()];
    args.extend(origin);
    args.extend([lit(units), lit(calendar)]);
    Some(Expr::ScalarFunction(ScalarFunction::new_udf(
        Arc::new(func),
        args,
    )))
}

/// Plans SQL's `extract(part FROM time)` as [`DatePartFunc`] from the
/// start, before the types are checked: DataFusion's planner calls its own
/// `date_part`, which takes no numbers, so a time column kept as numbers
/// (see [`crate::cf_numbers`]) would be refused before
/// [`CalendarFunctionsRewrite`] could read its dates. A session puts it
/// ahead of DataFusion's planners.
#[derive(Debug, Default)]
pub struct CalendarExtractPlanner;

impl ExprPlanner for CalendarExtractPlanner {
    fn plan_extract(&self, args: Vec<Expr>) -> Result<PlannerResult<Vec<Expr>>> {
        Ok(PlannerResult::Planned(Expr::ScalarFunction(
            ScalarFunction::new_udf(Arc::new(ScalarUDF::from(DatePartFunc::new())), args),
        )))
    }
}

/// What a side of `-` or `+` is, as far as model calendars go.
enum Side {
    /// A timestamp without a time zone, of a model calendar's dates or not.
    Time(Option<Calendar>),
    /// An interval or a duration.
    Step,
    /// Anything else.
    Other,
}

/// What `expr` is (see [`Side`]).
fn side(expr: &Expr, schema: &DFSchema) -> Side {
    let Ok((_, field)) = expr.to_field(schema) else {
        return Side::Other;
    };
    match field.data_type() {
        DataType::Timestamp(_, None) => Side::Time(calendar_of(&field)),
        DataType::Interval(_) | DataType::Duration(_) => Side::Step,
        _ => Side::Other,
    }
}

/// `binary` over times of a model calendar as the function of
/// [`crate::calendar_arithmetic`] that counts its days; as it is
/// otherwise (no side names a calendar, two calendars, time zones).
fn arithmetic(binary: BinaryExpr, schema: &DFSchema) -> Transformed<Expr> {
    let (left, right) = (side(&binary.left, schema), side(&binary.right, schema));
    let call = |func: ScalarUDF, args: Vec<Expr>, calendar: Calendar| {
        let mut args = args;
        args.push(lit(calendar.name()));
        Transformed::yes(Expr::ScalarFunction(ScalarFunction::new_udf(
            Arc::new(func),
            args,
        )))
    };
    let BinaryExpr {
        left: l,
        op,
        right: r,
    } = binary;
    match (left, op, right) {
        (Side::Time(a), Operator::Minus, Side::Time(b)) => match (a, b) {
            (Some(a), Some(b)) if a != b => {}
            (Some(calendar), _) | (None, Some(calendar)) => {
                return call(
                    ScalarUDF::from(CalendarDifferenceFunc::new()),
                    vec![*l, *r],
                    calendar,
                )
            }
            (None, None) => {}
        },
        (Side::Time(Some(calendar)), Operator::Plus, Side::Step) => {
            return call(
                ScalarUDF::from(CalendarShiftFunc::add()),
                vec![*l, *r],
                calendar,
            )
        }
        (Side::Time(Some(calendar)), Operator::Minus, Side::Step) => {
            return call(
                ScalarUDF::from(CalendarShiftFunc::subtract()),
                vec![*l, *r],
                calendar,
            )
        }
        (Side::Step, Operator::Plus, Side::Time(Some(calendar))) => {
            return call(
                ScalarUDF::from(CalendarShiftFunc::add()),
                vec![*r, *l],
                calendar,
            )
        }
        _ => {}
    }
    Transformed::no(Expr::BinaryExpr(BinaryExpr::new(l, op, r)))
}

/// `window` with a `RANGE` frame of distances of days and hours (no
/// months) ordered by one time of a model calendar, ordered by that time
/// on the calendar's own scale of days instead ([`CalendarScaleFunc`]),
/// so that `INTERVAL '1 day' PRECEDING` from a `noleap` 1st of March
/// reaches the 28th of February; as it is otherwise.
fn range_over_calendar(mut window: WindowFunction, schema: &DFSchema) -> Transformed<Expr> {
    let frame = &window.params.window_frame;
    let distance = |bound: &WindowFrameBound| match bound {
        // The SQL planner leaves `INTERVAL '1 day'` as its text ('1 day')
        // for type coercion to read against the ORDER BY's type.
        WindowFrameBound::Preceding(value) | WindowFrameBound::Following(value) => {
            (!value.is_null()).then(|| {
                let interval = DataType::Interval(IntervalUnit::MonthDayNano);
                let value = match value.data_type() {
                    DataType::Utf8 | DataType::Utf8View | DataType::LargeUtf8 => {
                        value.cast_to(&interval).ok()
                    }
                    _ => Some(value.clone()),
                };
                value.as_ref().and_then(stride_nanos).is_some()
            })
        }
        WindowFrameBound::CurrentRow => None,
    };
    let distances = [distance(&frame.start_bound), distance(&frame.end_bound)];
    // Some distance, and all of them of days and hours.
    let of_days = distances.contains(&Some(true)) && !distances.contains(&Some(false));
    let calendar = match window.params.order_by.as_slice() {
        [order] if frame.units == WindowFrameUnits::Range && of_days => {
            match side(&order.expr, schema) {
                Side::Time(Some(calendar)) => Some(calendar),
                _ => None,
            }
        }
        _ => None,
    };
    let Some(calendar) = calendar else {
        return Transformed::no(Expr::WindowFunction(Box::new(window)));
    };
    if let Some(order) = window.params.order_by.first_mut() {
        order.expr = Expr::ScalarFunction(ScalarFunction::new_udf(
            Arc::new(ScalarUDF::from(CalendarScaleFunc::new())),
            vec![order.expr.clone(), lit(calendar.name())],
        ));
    }
    Transformed::yes(Expr::WindowFunction(Box::new(window)))
}

/// A date literal as written: `'2000-02-30'`, `TIMESTAMP '2000-02-10'`,
/// `DATE '2000-02-10'` (text the calendar reads), or a timestamp's value.
enum DateLiteral {
    /// The text of a date (and time).
    Text(String),
    /// A timestamp with the fields of a date, in nanoseconds.
    Nanos(i64),
}

/// `expr` as a date literal, if it is one.
fn date_literal(expr: &Expr) -> Option<DateLiteral> {
    let text = |value: &ScalarValue| match value {
        ScalarValue::Utf8(Some(s))
        | ScalarValue::LargeUtf8(Some(s))
        | ScalarValue::Utf8View(Some(s)) => Some(DateLiteral::Text(s.clone())),
        _ => None,
    };
    // Bare text names a date when written as one (`2000-02-30`): a number
    // as text (`'720'`) stays the number DataFusion reads.
    let dated = |literal: Option<DateLiteral>| match literal {
        Some(DateLiteral::Text(text)) if !text.trim().get(1..)?.contains('-') => None,
        literal => literal,
    };
    match expr {
        Expr::Literal(value, _) => dated(text(value)).or_else(|| {
            let nanos = match value {
                ScalarValue::TimestampNanosecond(Some(v), None) => Some(*v),
                ScalarValue::TimestampMicrosecond(Some(v), None) => v.checked_mul(1_000),
                ScalarValue::TimestampMillisecond(Some(v), None) => v.checked_mul(1_000_000),
                ScalarValue::TimestampSecond(Some(v), None) => v.checked_mul(1_000_000_000),
                ScalarValue::Date32(Some(days)) => i64::from(*days).checked_mul(DAY),
                _ => None,
            };
            nanos.map(DateLiteral::Nanos)
        }),
        // `TIMESTAMP '...'` and `DATE '...'` before type coercion.
        Expr::Cast(cast)
            if matches!(
                cast.field.data_type(),
                DataType::Timestamp(_, None) | DataType::Date32 | DataType::Date64
            ) =>
        {
            match cast.expr.as_ref() {
                Expr::Literal(value, _) => text(value),
                _ => None,
            }
        }
        _ => None,
    }
}

/// The encoding and type of `expr` when it is a time column kept as
/// numbers (see [`crate::cf_numbers`]).
fn kept_numbers(expr: &Expr, schema: &DFSchema) -> Option<(CfTime, DataType)> {
    let (_, field) = expr.to_field(schema).ok()?;
    let (units, calendar) = kept_numbers_of(&field)?;
    let time = CfTime::parse(units, Some(calendar)).ok()??;
    Some((time, field.data_type().clone()))
}

/// The number encoding `literal` for a time column kept as numbers of
/// `time`'s units and calendar, of the column's type `data_type` when it
/// is a whole number (so that the comparison is one of the column, which
/// the scan takes as a dimension filter): an error for a date the
/// calendar lacks.
fn encoded(literal: DateLiteral, time: &CfTime, data_type: &DataType) -> Result<Expr> {
    let (count, written) = match literal {
        DateLiteral::Text(text) => (time.count_of_text(text.trim()), text),
        DateLiteral::Nanos(nanos) => {
            let (date, time_of_day) = date_of(nanos);
            (time.count_of(date, time_of_day), date.to_string())
        }
    };
    let Some(count) = count else {
        return plan_err!(
            "'{written}' is no date of the {} calendar, whose times this column keeps as numbers",
            time.calendar().name()
        );
    };
    let value = ScalarValue::Float64(Some(count));
    let whole = count.fract() == 0.0 && data_type.is_integer();
    Ok(lit(match whole {
        true => value.cast_to(data_type).unwrap_or(value),
        false => value,
    }))
}

/// A comparison (`time >= '2000-02-30'`), `BETWEEN` or `IN` of a time
/// column kept as numbers with date literals, those literals as the
/// numbers encoding them in the column's units and calendar: a daily
/// `360_day` store's times are filtered by its dates (and the scan prunes
/// them as any dimension filter); as it is otherwise.
fn compared_with_dates(expr: Expr, schema: &DFSchema) -> Result<Transformed<Expr>> {
    let swap = |side: &mut Box<Expr>, kept: &(CfTime, DataType)| -> Result<bool> {
        match date_literal(side) {
            Some(literal) => {
                **side = encoded(literal, &kept.0, &kept.1)?;
                Ok(true)
            }
            None => Ok(false),
        }
    };
    let mut expr = expr;
    let changed = match &mut expr {
        Expr::BinaryExpr(binary) => match (
            kept_numbers(&binary.left, schema),
            kept_numbers(&binary.right, schema),
        ) {
            (Some(kept), None) => swap(&mut binary.right, &kept)?,
            (None, Some(kept)) => swap(&mut binary.left, &kept)?,
            _ => false,
        },
        Expr::Between(between) => match kept_numbers(&between.expr, schema) {
            Some(kept) => swap(&mut between.low, &kept)? | swap(&mut between.high, &kept)?,
            None => false,
        },
        Expr::InList(in_list) => match kept_numbers(&in_list.expr, schema) {
            Some(kept) => {
                let mut changed = false;
                for item in in_list.list.iter_mut() {
                    if let Some(literal) = date_literal(item) {
                        *item = encoded(literal, &kept.0, &kept.1)?;
                        changed = true;
                    }
                }
                changed
            }
            None => false,
        },
        _ => false,
    };
    Ok(match (changed, expr) {
        (true, expr) => Transformed::yes(expr),
        (false, Expr::BinaryExpr(binary)) => arithmetic(binary, schema),
        (false, expr) => Transformed::no(expr),
    })
}

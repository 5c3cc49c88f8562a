//! [`CalendarFunctionsRewrite`]: the model calendars' `date_part`,
//! `date_bin`, `date_trunc`, `-` and `+` wherever a plan calls DataFusion's,
//! `RANGE` frames counting their days, dates compared with times kept as
//! numbers as those numbers,
//! and `date_part`, `date_trunc`, `date_bin`, `+`, `-` and `RANGE` frames
//! of times kept as numbers.

use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, IntervalMonthDayNano, IntervalUnit};
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::Transformed;
use datafusion::common::{plan_err, DFSchema, Result, ScalarValue};
use datafusion::logical_expr::expr::{ScalarFunction, WindowFunction};
use datafusion::logical_expr::expr_rewriter::FunctionRewrite;
use datafusion::logical_expr::planner::{ExprPlanner, PlannerResult, RawBinaryExpr};
use datafusion::logical_expr::{
    lit, BinaryExpr, Expr, ExprSchemable, Operator, ScalarUDF, WindowFrameBound, WindowFrameUnits,
};
use datafusion::sql::sqlparser::ast::BinaryOperator;

use crate::calendar::Calendar;
use crate::calendar_arithmetic::{CalendarDifferenceFunc, CalendarScaleFunc, CalendarShiftFunc};
use crate::cf_numbers::{CfDateBinFunc, CfDateDifferenceFunc, CfDateFunc, CfDateShiftFunc};
use crate::cf_time::CfTime;
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
            Expr::BinaryExpr(binary) => return arithmetic(binary, schema),
            Expr::Between(_) | Expr::InList(_) => return compared_with_dates(expr, schema),
            Expr::WindowFunction(window) => return range_over_calendar(*window, schema),
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

/// Plans what over a time column kept as numbers (see
/// [`crate::cf_numbers`]) DataFusion's SQL planner would refuse before
/// [`CalendarFunctionsRewrite`] could read its dates: SQL's `extract(part
/// FROM time)` as [`DatePartFunc`] (DataFusion's planner calls its own
/// `date_part`, which takes no numbers), and `time - '2000-02-28'` (a date
/// written as text, whose type the planner cannot subtract from numbers)
/// as the difference of their dates, as the rewrite plans `-` and `+` of
/// such a column. A session puts it ahead of DataFusion's planners.
#[derive(Debug, Default)]
pub struct CalendarExprPlanner;

impl ExprPlanner for CalendarExprPlanner {
    fn plan_binary_op(
        &self,
        expr: RawBinaryExpr,
        schema: &DFSchema,
    ) -> Result<PlannerResult<RawBinaryExpr>> {
        let op = match expr.op {
            BinaryOperator::Minus => Operator::Minus,
            BinaryOperator::Plus => Operator::Plus,
            _ => return Ok(PlannerResult::Original(expr)),
        };
        let RawBinaryExpr {
            op: written,
            left,
            right,
        } = expr;
        let binary = BinaryExpr::new(Box::new(left), op, Box::new(right));
        Ok(match kept_arithmetic(&binary, schema)? {
            Some(planned) => PlannerResult::Planned(planned),
            None => PlannerResult::Original(RawBinaryExpr {
                op: written,
                left: *binary.left,
                right: *binary.right,
            }),
        })
    }

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
/// [`crate::calendar_arithmetic`] that counts its days, and over a time
/// column kept as numbers as the one of [`crate::cf_numbers`]; as it is
/// otherwise (no side names a calendar, two calendars, time zones).
fn arithmetic(binary: BinaryExpr, schema: &DFSchema) -> Result<Transformed<Expr>> {
    if let Some(kept) = kept_arithmetic(&binary, schema)? {
        return Ok(Transformed::yes(kept));
    }
    let (left, right) = (side(&binary.left, schema), side(&binary.right, schema));
    let call = |func: ScalarUDF, args: Vec<Expr>, calendar: Calendar| {
        let mut args = args;
        args.push(lit(calendar.name()));
        Ok(Transformed::yes(Expr::ScalarFunction(
            ScalarFunction::new_udf(Arc::new(func), args),
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
    Ok(Transformed::no(Expr::BinaryExpr(BinaryExpr::new(l, op, r))))
}

/// `binary` over a time column kept as numbers, as [`crate::cf_numbers`]'
/// arithmetic: minus another of the same units and calendar, or minus a
/// date (a literal the calendar reads), a duration of the calendar's
/// time (`cf_date_difference`); plus or minus an interval or a duration,
/// numbers of the same units (`cf_date_add`, `cf_date_subtract`). `None`
/// for anything else (numbers plus a number stay numbers); an error for
/// two such columns of other units or calendars.
fn kept_arithmetic(binary: &BinaryExpr, schema: &DFSchema) -> Result<Option<Expr>> {
    let (l, r) = (&binary.left, &binary.right);
    let difference = || ScalarUDF::from(CfDateDifferenceFunc::new());
    let step = |e: &Expr| matches!(side(e, schema), Side::Step);
    Ok(
        match (kept_numbers(l, schema), binary.op, kept_numbers(r, schema)) {
            (Some(a), Operator::Minus, Some(b)) => {
                if a.time != b.time {
                    return plan_err!(
                        "a time kept as numbers of '{}' ({}) minus one of '{}' ({}): both \
                         must count the same units of one calendar",
                        a.units,
                        a.calendar,
                        b.units,
                        b.calendar
                    );
                }
                Some(a.call(difference(), vec![(**l).clone(), (**r).clone()]))
            }
            (Some(a), Operator::Minus, None) => match date_literal(r) {
                Some(date) => Some(a.call(difference(), vec![(**l).clone(), encoded(date, &a)?])),
                None if step(r) => Some(a.call(
                    ScalarUDF::from(CfDateShiftFunc::subtract()),
                    vec![(**l).clone(), (**r).clone()],
                )),
                None => None,
            },
            (None, Operator::Minus, Some(b)) => match date_literal(l) {
                Some(date) => Some(b.call(difference(), vec![encoded(date, &b)?, (**r).clone()])),
                None => None,
            },
            (Some(a), Operator::Plus, None) if step(r) => Some(a.call(
                ScalarUDF::from(CfDateShiftFunc::add()),
                vec![(**l).clone(), (**r).clone()],
            )),
            (None, Operator::Plus, Some(b)) if step(l) => Some(b.call(
                ScalarUDF::from(CfDateShiftFunc::add()),
                vec![(**r).clone(), (**l).clone()],
            )),
            _ => None,
        },
    )
}

/// A `RANGE` bound's distance as an interval, when it is one (the SQL
/// planner leaves `INTERVAL '1 day'` as its text, `'1 day'`, for type
/// coercion to read against the `ORDER BY`'s type); `None` for `CURRENT
/// ROW`, `UNBOUNDED` and other values.
fn bound_interval(bound: &WindowFrameBound) -> Option<IntervalMonthDayNano> {
    let (WindowFrameBound::Preceding(value) | WindowFrameBound::Following(value)) = bound else {
        return None;
    };
    let value = match value.data_type() {
        DataType::Utf8 | DataType::Utf8View | DataType::LargeUtf8 | DataType::Interval(_) => value
            .cast_to(&DataType::Interval(IntervalUnit::MonthDayNano))
            .ok()?,
        _ => return None,
    };
    match value {
        ScalarValue::IntervalMonthDayNano(interval) => interval,
        _ => None,
    }
}

/// `window` with a `RANGE` frame of distances of days and hours (no
/// months) ordered by one time of a model calendar, ordered by that time
/// on the calendar's own scale of days instead ([`CalendarScaleFunc`]),
/// so that `INTERVAL '1 day' PRECEDING` from a `noleap` 1st of March
/// reaches the 28th of February; ordered by a time column kept as
/// numbers, its distances in the numbers' units ([`range_over_numbers`]);
/// as it is otherwise.
fn range_over_calendar(mut window: WindowFunction, schema: &DFSchema) -> Result<Transformed<Expr>> {
    let frame = &window.params.window_frame;
    let bounds = [&frame.start_bound, &frame.end_bound];
    let [order] = window.params.order_by.as_slice() else {
        return Ok(Transformed::no(Expr::WindowFunction(Box::new(window))));
    };
    if frame.units != WindowFrameUnits::Range || bounds.iter().all(|b| bound_interval(b).is_none())
    {
        return Ok(Transformed::no(Expr::WindowFunction(Box::new(window))));
    }
    if let Some(kept) = kept_numbers(&order.expr, schema) {
        return range_over_numbers(window, &kept);
    }
    // Some distance, and all of them of days and hours.
    let of_days = bounds.iter().all(|bound| match bound {
        WindowFrameBound::CurrentRow => true,
        WindowFrameBound::Preceding(v) | WindowFrameBound::Following(v) if v.is_null() => true,
        bound => bound_interval(bound).is_some_and(|i| i.months == 0),
    });
    let calendar = match side(&order.expr, schema) {
        Side::Time(Some(calendar)) if of_days => calendar,
        _ => return Ok(Transformed::no(Expr::WindowFunction(Box::new(window)))),
    };
    if let Some(order) = window.params.order_by.first_mut() {
        order.expr = Expr::ScalarFunction(ScalarFunction::new_udf(
            Arc::new(ScalarUDF::from(CalendarScaleFunc::new())),
            vec![order.expr.clone(), lit(calendar.name())],
        ));
    }
    Ok(Transformed::yes(Expr::WindowFunction(Box::new(window))))
}

/// `window`, a `RANGE` frame ordered by a time column kept as numbers,
/// with its interval distances as distances in the numbers' units (CF
/// numbers count the calendar's own time): `INTERVAL '2 days'` over
/// `hours since ...` is 48. Over whole numbers a distance is its whole
/// units, which holds the same rows (the frame of `t` holds `v` with
/// `t - d <= v`, and for whole `v` and `t` that is `t - floor(d) <= v`).
/// Months are 30 days of a `360_day` calendar and refused in the others,
/// whose months have no one length.
fn range_over_numbers(mut window: WindowFunction, kept: &Kept) -> Result<Transformed<Expr>> {
    let unit = kept.time.unit().nanos();
    let thirty_days = kept.time.calendar() == Calendar::Day360;
    let distance = |interval: IntervalMonthDayNano| -> Result<ScalarValue> {
        let months = match (interval.months, thirty_days) {
            (0, _) => 0,
            (months, true) => i64::from(months) * 30,
            (_, false) => {
                return plan_err!(
                    "a RANGE frame of months over a time kept as numbers of the {} calendar: \
                     its months have no one length (ROWS frames, or date_trunc('month', time), \
                     count months)",
                    kept.calendar
                )
            }
        };
        let days = i128::from(interval.days) + i128::from(months);
        let nanos = days * i128::from(DAY) + i128::from(interval.nanoseconds);
        Ok(match kept.data_type.is_integer() {
            true => {
                let whole = i64::try_from(nanos.div_euclid(i128::from(unit))).unwrap_or(i64::MAX);
                ScalarValue::Int64(Some(whole))
                    .cast_to(&kept.data_type)
                    .unwrap_or(ScalarValue::Int64(Some(whole)))
            }
            false => ScalarValue::Float64(Some(nanos as f64 / unit as f64)),
        })
    };
    let frame = &mut window.params.window_frame;
    for bound in [&mut frame.start_bound, &mut frame.end_bound] {
        if let Some(interval) = bound_interval(bound) {
            let value = distance(interval)?;
            *bound = match bound {
                WindowFrameBound::Preceding(_) => WindowFrameBound::Preceding(value),
                _ => WindowFrameBound::Following(value),
            };
        }
    }
    Ok(Transformed::yes(Expr::WindowFunction(Box::new(window))))
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

/// A time column kept as numbers (see [`crate::cf_numbers`]): its
/// encoding, type, units and calendar.
struct Kept {
    time: CfTime,
    data_type: DataType,
    units: String,
    calendar: String,
}

impl Kept {
    /// A call of `func` with `args` and the column's units and calendar.
    fn call(&self, func: ScalarUDF, mut args: Vec<Expr>) -> Expr {
        args.extend([lit(self.units.as_str()), lit(self.calendar.as_str())]);
        Expr::ScalarFunction(ScalarFunction::new_udf(Arc::new(func), args))
    }
}

/// `expr` as a time column kept as numbers, when it is one.
fn kept_numbers(expr: &Expr, schema: &DFSchema) -> Option<Kept> {
    let (_, field) = expr.to_field(schema).ok()?;
    let (units, calendar) = kept_numbers_of(&field)?;
    Some(Kept {
        time: CfTime::parse(units, Some(calendar)).ok()??,
        data_type: field.data_type().clone(),
        units: units.to_string(),
        calendar: calendar.to_string(),
    })
}

/// The number encoding `literal` for a time column kept as numbers (of
/// the column's type when it is a whole number, so that the comparison is
/// one of the column, which the scan takes as a dimension filter): an
/// error for a date the calendar lacks.
fn encoded(literal: DateLiteral, kept: &Kept) -> Result<Expr> {
    let time = &kept.time;
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
    let whole = count.fract() == 0.0 && kept.data_type.is_integer();
    Ok(lit(match whole {
        true => value.cast_to(&kept.data_type).unwrap_or(value),
        false => value,
    }))
}

/// A comparison (`time >= '2000-02-30'`), `BETWEEN` or `IN` of a time
/// column kept as numbers with date literals, those literals as the
/// numbers encoding them in the column's units and calendar: a daily
/// `360_day` store's times are filtered by its dates (and the scan prunes
/// them as any dimension filter); as it is otherwise.
fn compared_with_dates(expr: Expr, schema: &DFSchema) -> Result<Transformed<Expr>> {
    let swap = |side: &mut Box<Expr>, kept: &Kept| -> Result<bool> {
        match date_literal(side) {
            Some(literal) => {
                **side = encoded(literal, kept)?;
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
                        *item = encoded(literal, &kept)?;
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
        (false, Expr::BinaryExpr(binary)) => arithmetic(binary, schema)?,
        (false, expr) => Transformed::no(expr),
    })
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::datatypes::{Field, Schema};
    use datafusion::functions_aggregate::average::avg_udaf;
    use datafusion::logical_expr::{col, WindowFrame};

    use super::*;
    use crate::model_calendar::kept_numbers_metadata;

    /// A `RANGE` frame `preceding` back to the current row, ordered by a
    /// time kept as numbers of `data_type` (`days since 2000-01-01` of
    /// `calendar`), as the rewrite leaves it.
    fn rewritten(data_type: DataType, calendar: &str, preceding: &str) -> Result<WindowFrameBound> {
        let field = Field::new("time", data_type, true)
            .with_metadata(kept_numbers_metadata("days since 2000-01-01", calendar));
        let schema = DFSchema::try_from(Schema::new(vec![field]))?;
        let mut window = WindowFunction::new(avg_udaf(), vec![col("time")]);
        window.params.order_by = vec![col("time").sort(true, false)];
        window.params.window_frame = WindowFrame::new_bounds(
            WindowFrameUnits::Range,
            WindowFrameBound::Preceding(ScalarValue::Utf8(Some(preceding.to_string()))),
            WindowFrameBound::CurrentRow,
        );
        match range_over_calendar(window, &schema)?.data {
            Expr::WindowFunction(window) => Ok(window.params.window_frame.start_bound.clone()),
            other => plan_err!("not a window: {other}"),
        }
    }

    /// Distances over kept numbers are in their units: whole units over
    /// whole numbers, fractions over floats, months 30 days of `360_day`
    /// only.
    #[test]
    fn range_distances_over_kept_numbers_are_in_their_units() {
        let int = |v| WindowFrameBound::Preceding(ScalarValue::Int64(Some(v)));
        let float = |v| WindowFrameBound::Preceding(ScalarValue::Float64(Some(v)));
        let cases = [
            (DataType::Int64, "noleap", "2 days", int(2)),
            (DataType::Int64, "noleap", "36 hours", int(1)),
            (DataType::Int64, "360_day", "1 month 1 day", int(31)),
            (DataType::Float64, "noleap", "36 hours", float(1.5)),
        ];
        for (data_type, calendar, preceding, want) in cases {
            let got = rewritten(data_type, calendar, preceding).unwrap();
            assert_eq!(got, want, "{calendar} {preceding}");
        }
        let refused = rewritten(DataType::Int64, "noleap", "1 month").unwrap_err();
        assert!(
            refused.to_string().contains(
                "RANGE frame of months over a time kept as numbers of the noleap calendar"
            ),
            "{refused}"
        );
    }
}

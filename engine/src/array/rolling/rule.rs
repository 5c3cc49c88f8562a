//! `RollingWindowRule`: a SQL window of rolling aggregates along one
//! dimension of a Zarr table becomes a [`RollingWindow`].
//!
//! The rule matches a `Window` whose input is a Zarr table scan (or a
//! scan of `rechunk(...)`, whose rechunked store the operator then reads
//! after the copy), seen through any projections and aliases, where every
//! window expression is
//!
//! ```sql
//! count|sum|avg|min|max(<expr>) OVER (
//!     PARTITION BY <every other dimension>
//!     ORDER BY <dim> [ASC|DESC]
//!     ROWS BETWEEN <n> PRECEDING|CURRENT ROW|<n> FOLLOWING
//!          AND <m> PRECEDING|CURRENT ROW|<m> FOLLOWING)
//! ```
//!
//! or with `RANGE BETWEEN <d> PRECEDING|CURRENT ROW|<d> FOLLOWING AND ...`
//! over a `dim` whose values step by one integer (a regular time axis, an
//! integer or index dimension; a model calendar's times by its own days,
//! ordered by `calendar_scale(time, calendar)`): distances (`INTERVAL '1 day'` of days and
//! hours for times, integers for integers) then hold the same run of
//! neighbours at every position, a frame in rows. A frame may also start
//! at `UNBOUNDED PRECEDING` (`ROWS`, or `RANGE` to `CURRENT ROW` along any
//! run or to a distance along one run): running totals, as SQL's default
//! frame with an `ORDER BY` and no frame (`sum(tp) OVER (PARTITION BY lat,
//! lon ORDER BY time)`); or end at `UNBOUNDED FOLLOWING`, the same from
//! the series' end (so does the default frame under `ORDER BY time DESC`:
//! what is left of each series, walked from its end). The frames of one
//! window run to one end of the series at most (not some from its start
//! and others to its end, nor any over the whole series);
//! with one `dim` and one partition for all of them, a numeric argument
//! (`count`: any), no `DISTINCT` or `FILTER`, a frame of at most
//! [`MAX_FRAME`] positions, a `dim` whose coordinate is strictly monotonic
//! without NULL or NaN (so `ORDER BY` is the grid's order or its reverse,
//! without ties), and filters only on single dimensions (pushed into the
//! scan: a filter on the values would take cells out of the frames). The
//! table may have columns joined in by a broadcast join that keeps every
//! cell (a left join, or an inner join whose small side covers the grid:
//! [`crate::array::broadcast`]); an inner join that may leave cells out is
//! a filter on the values (its `matched` column), and keeps DataFusion's
//! window.
//!
//! Each partition is then one line of cells along `dim`, in grid order, and
//! each frame a run of neighbours on it: the operator reads blocks along
//! `dim` with the frame's overlap instead of sorting the rows. Anything
//! else keeps DataFusion's window. `SET zarrfusion.rolling_window = false`
//! turns the rule off.

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;

use datafusion::arrow::array::{Array, AsArray};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, TimeUnit, TimestampNanosecondType};
use datafusion::common::{Column, DFSchema, Result, ScalarValue};
use datafusion::logical_expr::expr::{BinaryExpr, Cast, TryCast, WindowFunction};
use datafusion::logical_expr::{
    Expr, ExprSchemable, Extension, LogicalPlan, Operator, Projection, Window, WindowFrameBound,
    WindowFrameUnits, WindowFunctionDefinition,
};
use zarrfusion_udfs::calendar::Calendar;
use zarrfusion_udfs::model_calendar::calendar_nanos;
use zarrfusion_udfs::CalendarScaleFunc;

use super::frame::RollOp;
use super::node::{GridFrame, RollExpr, RollingWindow};
use crate::array::reduce::{coordinate_repeats, ReduceOp};
use crate::array::scan_path::{down_to_scan_or_rechunk, replace_columns, TableRead};
use crate::config::ZarrConfig;
use crate::plan_methods::bottom_up_rule;
use crate::table::{pushed_dimension, Coordinate, GridTable};

/// The most positions one frame may span; wider frames keep DataFusion's
/// window.
pub const MAX_FRAME: u64 = 1 << 20;

/// Rewrites rolling windows along a dimension of a Zarr table into a
/// [`RollingWindow`].
#[derive(Debug, Default)]
pub struct RollingWindowRule;

bottom_up_rule!(
    RollingWindowRule,
    "zarrfusion_rolling_window",
    |plan, options| {
        if !ZarrConfig::of(options).rolling_window {
            return Ok(None);
        }
        match plan {
            LogicalPlan::Window(window) => Ok(rolling_window(window)?.map(|node| {
                LogicalPlan::Extension(Extension {
                    node: Arc::new(node),
                })
            })),
            LogicalPlan::Projection(projection) => pruned(projection),
            _ => Ok(None),
        }
    }
);

/// A projection over a rolling window (found below it first) whose
/// input columns it does not all use: the window without them, so that
/// they are never made (the dimension columns of every row, say, under a
/// reduction of the rolled values).
fn pruned(projection: &Projection) -> Result<Option<LogicalPlan>> {
    let LogicalPlan::Extension(extension) = projection.input.as_ref() else {
        return Ok(None);
    };
    let Some(node) = extension.node.as_any().downcast_ref::<RollingWindow>() else {
        return Ok(None);
    };
    let used: HashSet<&Column> = projection
        .expr
        .iter()
        .flat_map(|e| e.column_refs())
        .collect();
    let n = node.columns.len();
    let keep: Vec<usize> = (0..n)
        .filter(|&i| used.contains(&Column::from(node.schema.qualified_field(i))))
        .collect();
    if keep.len() == n {
        return Ok(None);
    }
    let input = Arc::new(LogicalPlan::Extension(Extension {
        node: Arc::new(node.keeping(&keep)?),
    }));
    Ok(Some(LogicalPlan::Projection(
        Projection::try_new_with_schema(
            projection.expr.clone(),
            input,
            Arc::clone(&projection.schema),
        )?,
    )))
}

/// One window expression, as written over the window's input.
struct Written {
    op: RollOp,
    arg: Expr,
    partition_by: Vec<Expr>,
    order_by: Expr,
    ascending: bool,
    /// The frame in the order of `ORDER BY`.
    frame: WrittenFrame,
}

/// A frame as written, in the order of `ORDER BY`.
enum WrittenFrame {
    /// `ROWS`: in positions.
    Rows(GridFrame),
    /// `RANGE`: in the `ORDER BY` column's units, from its start (`None`:
    /// `UNBOUNDED PRECEDING`) to its end (`None`: `UNBOUNDED FOLLOWING`).
    Range(Option<RangeBound>, Option<RangeBound>),
}

/// A bound of a `RANGE` frame: `CURRENT ROW` (`None`), or a distance
/// before (`PRECEDING`: `true`) or after the current row's value.
type RangeBound = Option<(ScalarValue, bool)>;

/// The rolling window computing `window`, if it is one.
fn rolling_window(window: &Window) -> Result<Option<RollingWindow>> {
    let mut written = Vec::with_capacity(window.window_expr.len());
    for expr in &window.window_expr {
        let Some(w) = written_expr(expr) else {
            return Ok(None);
        };
        written.push(w);
    }
    if let LogicalPlan::Extension(extension) = window.input.as_ref() {
        if let Some(below) = extension.node.as_any().downcast_ref::<RollingWindow>() {
            return stacked(window, &written, below);
        }
    }
    // Walk down to the scan, rewriting every expression into its columns:
    // the input's columns, then each window's argument, order and partition.
    let columns: Vec<Expr> = window
        .input
        .schema()
        .columns()
        .into_iter()
        .map(Expr::Column)
        .collect();
    let n_columns = columns.len();
    let mut exprs = columns;
    exprs.extend(window_parts(&written));
    let Some(path) = down_to_scan_or_rechunk(&window.input, exprs)? else {
        return Ok(None);
    };
    let table = path.table.grid();
    // Of `rechunk(...)`: the rechunked store is read, after the copy.
    let rechunk = path.rechunk;
    let scan = path.scan;
    // Cells filtered on their values would leave holes in the frames.
    if !path.predicates.is_empty()
        || scan
            .filters
            .iter()
            .any(|f| pushed_dimension(f, table).is_none())
    {
        return Ok(None);
    }
    let mut rewritten = path.exprs.into_iter();
    let columns: Vec<Expr> = rewritten.by_ref().take(n_columns).collect();
    let input_schema = &scan.projected_schema;
    let Some((dim, aggregates)) = roll_exprs(
        &written,
        rewritten,
        table,
        (input_schema, &scan.filters),
        window,
        n_columns,
        None,
    )?
    else {
        return Ok(None);
    };
    // One walk along the dimension: from its start or from its end.
    if GridFrame::direction(aggregates.iter().map(|a| &a.frame)).is_none() {
        return Ok(None);
    }
    Ok(Some(RollingWindow {
        read: TableRead::new(table, Arc::clone(input_schema), scan.filters.clone())
            .with_rechunk(rechunk),
        dim,
        columns,
        aggregates,
        schema: Arc::clone(&window.schema),
    }))
}

/// Each window's argument, order and partition, in that order.
fn window_parts(written: &[Written]) -> Vec<Expr> {
    let mut exprs = Vec::new();
    for w in written {
        exprs.push(w.arg.clone());
        exprs.push(w.order_by.clone());
        exprs.extend(w.partition_by.iter().cloned());
    }
    exprs
}

/// A window over a rolling window (DataFusion stacks windows whose
/// partitions are written in different orders, or are ordered the other
/// way): one rolling window with the aggregates of both, when the upper
/// one reads only the lower one's input columns and rolls along the same
/// dimension.
fn stacked(
    window: &Window,
    written: &[Written],
    below: &RollingWindow,
) -> Result<Option<RollingWindow>> {
    let n = below.columns.len();
    let exprs = window_parts(written);
    let over_inputs = exprs.iter().all(|e| {
        e.column_refs()
            .into_iter()
            .all(|c| below.schema.index_of_column(c).is_ok_and(|i| i < n))
    });
    if !over_inputs {
        return Ok(None);
    }
    let rewritten = exprs
        .into_iter()
        .map(|e| replace_columns(e, &below.schema, |i| below.columns[i].clone()))
        .collect::<Result<Vec<_>>>()?;
    let first_output = below.schema.fields().len();
    let Some((_, aggregates)) = roll_exprs(
        written,
        rewritten.into_iter(),
        &below.read.table,
        (&below.read.input_schema, &below.read.filters),
        window,
        first_output,
        Some(below.dim),
    )?
    else {
        return Ok(None);
    };
    let mut merged = below.clone();
    merged.aggregates.extend(aggregates);
    merged.schema = Arc::clone(&window.schema);
    if GridFrame::direction(merged.aggregates.iter().map(|a| &a.frame)).is_none() {
        return Ok(None);
    }
    Ok(Some(merged))
}

/// The rolling aggregates of `written`, whose parts (see
/// [`window_parts`]) come `rewritten` over the scan's columns (`input`:
/// their schema and the scan's dimension filters), if they all roll along
/// one dimension (`dim`, when given) partitioned by all the others, and
/// their types fit; with that dimension. Their output fields start at
/// `first_output` in `window`'s schema.
fn roll_exprs(
    written: &[Written],
    mut rewritten: impl Iterator<Item = Expr>,
    table: &GridTable,
    (input_schema, filters): (&DFSchema, &[Expr]),
    window: &Window,
    first_output: usize,
    mut dim: Option<usize>,
) -> Result<Option<(usize, Vec<RollExpr>)>> {
    let dim_of = |e: &Expr| match e {
        Expr::Column(c) => table.dims.iter().position(|d| d.name == c.name),
        _ => None,
    };
    let mut aggregates = Vec::with_capacity(written.len());
    for (i, w) in written.iter().enumerate() {
        let Some(arg) = rewritten.next() else {
            return Ok(None);
        };
        let order = rewritten
            .next()
            .as_ref()
            .and_then(|e| ordered_by(e, &dim_of));
        let partition: Option<BTreeSet<usize>> = rewritten
            .by_ref()
            .take(w.partition_by.len())
            .map(|e| dim_of(&e))
            .collect();
        let (Some((d, calendar)), Some(partition)) = (order, partition) else {
            return Ok(None);
        };
        // One line per partition: every other dimension, and only them.
        let others: BTreeSet<usize> = (0..table.dims.len()).filter(|&k| k != d).collect();
        if partition != others || dim.is_some_and(|first| first != d) {
            return Ok(None);
        }
        // Other dimensions whose values repeat would make positions with
        // equal values one partition, not one line each.
        if (partition.iter()).any(|&k| coordinate_repeats(table, k).unwrap_or(true)) {
            return Ok(None);
        }
        dim = Some(d);
        let Some(descends) = table.dims[d].coordinate.distinct_order() else {
            return Ok(None);
        };
        let frame = match &w.frame {
            WrittenFrame::Rows(frame) => *frame,
            WrittenFrame::Range(start, end) => {
                // Values a distance apart are as many positions apart
                // within one run of the dimension only (CURRENT ROW and
                // UNBOUNDED PRECEDING are the same rows along any run).
                let distances = start.as_ref().is_some_and(Option::is_some)
                    || end.as_ref().is_some_and(Option::is_some);
                let one_run = !distances
                    || (filters.iter())
                        .filter(|f| pushed_dimension(f, table) == Some(d))
                        .all(keeps_one_run);
                let coordinate = &table.dims[d].coordinate;
                // Over a model calendar's times, distances count its days.
                let step = match calendar {
                    Some(calendar) => calendar_step(coordinate, calendar),
                    None => coordinate.integer_step(),
                };
                match range_rows(start.as_ref(), end.as_ref(), step, coordinate) {
                    Some(frame) if one_run => frame,
                    _ => return Ok(None),
                }
            }
        };
        // Sorted against the grid's order, PRECEDING is later in the grid
        // (a frame from the series' start then runs to its end).
        let frame = if w.ascending != descends {
            frame
        } else {
            GridFrame {
                start: frame.end.map(|end| -end),
                end: frame.start.map(|start| -start),
            }
        };
        let arg_type = arg.get_type(input_schema)?;
        let output = window.schema.field(first_output + i).data_type();
        let numeric = matches!(arg_type, DataType::Float32 | DataType::Float64)
            && matches!(output, DataType::Float32 | DataType::Float64);
        let fits = match w.op {
            RollOp::Count => output == &DataType::Int64,
            _ => numeric,
        };
        if !fits {
            return Ok(None);
        }
        aggregates.push(RollExpr {
            op: w.op,
            arg,
            frame,
        });
    }
    Ok(dim.map(|d| (d, aggregates)))
}

/// The parts of a supported window expression, over the window's input.
fn written_expr(expr: &Expr) -> Option<Written> {
    let expr = match expr {
        Expr::Alias(alias) => alias.expr.as_ref(),
        other => other,
    };
    let Expr::WindowFunction(window) = expr else {
        return None;
    };
    let WindowFunction { fun, params } = window.as_ref();
    let WindowFunctionDefinition::AggregateUDF(function) = fun else {
        return None;
    };
    if params.distinct || params.filter.is_some() || params.null_treatment.is_some() {
        return None;
    }
    let [arg] = params.args.as_slice() else {
        return None;
    };
    let [order] = params.order_by.as_slice() else {
        return None;
    };
    let op = RollOp::of(ReduceOp::of_aggregate(function)?)?;
    let frame = &params.window_frame;
    let frame = match frame.units {
        WindowFrameUnits::Rows => WrittenFrame::Rows(fitting(GridFrame {
            start: bounded(&frame.start_bound, offset)?,
            end: bounded(&frame.end_bound, offset)?,
        })?),
        WindowFrameUnits::Range => WrittenFrame::Range(
            bounded(&frame.start_bound, range_bound)?,
            bounded(&frame.end_bound, range_bound)?,
        ),
        WindowFrameUnits::Groups => return None,
    };
    Some(Written {
        op,
        arg: arg.clone(),
        partition_by: params.partition_by.clone(),
        order_by: order.expr.clone(),
        ascending: order.asc,
        frame,
    })
}

/// `frame`, when it holds a position and at most [`MAX_FRAME`] (from the
/// series' start or to its end: when its other end is within
/// [`MAX_FRAME`] of the row).
fn fitting(frame: GridFrame) -> Option<GridFrame> {
    let most = MAX_FRAME as i64;
    match (frame.start, frame.end) {
        (Some(start), Some(end)) => {
            let width = end.checked_sub(start)?;
            (0..most).contains(&width).then_some(frame)
        }
        (Some(bound), None) | (None, Some(bound)) => {
            (-most < bound && bound < most).then_some(frame)
        }
        (None, None) => Some(frame),
    }
}

/// `bound` as `read` reads it (`None`: not supported), or `Some(None)`
/// when it is `UNBOUNDED PRECEDING` or `UNBOUNDED FOLLOWING`.
fn bounded<T>(
    bound: &WindowFrameBound,
    read: impl Fn(&WindowFrameBound) -> Option<T>,
) -> Option<Option<T>> {
    match bound {
        WindowFrameBound::Preceding(value) | WindowFrameBound::Following(value)
            if value.is_null() =>
        {
            Some(None)
        }
        bound => read(bound).map(Some),
    }
}

/// A `RANGE` bound as written (not unbounded); `None` when unsupported.
fn range_bound(bound: &WindowFrameBound) -> Option<RangeBound> {
    match bound {
        WindowFrameBound::CurrentRow => Some(None),
        WindowFrameBound::Preceding(value) if !value.is_null() => Some(Some((value.clone(), true))),
        WindowFrameBound::Following(value) if !value.is_null() => {
            Some(Some((value.clone(), false)))
        }
        _ => None,
    }
}

/// A `RANGE` frame in positions along `coordinate` (whose values are
/// strictly ordered, without ties), from `start` (`None`: the series'
/// start) to `end` (`None`: its end). `CURRENT ROW` is the row itself;
/// distances need values
/// that step by one integer, `step` (times: nanoseconds, of a model
/// calendar's own days when it orders by `calendar_scale`; `None` when
/// they do not), and distances in their
/// units: a position's frame then holds the positions whose values lie
/// within the distances of its value, the same run of neighbours at every
/// position (`RANGE BETWEEN INTERVAL '1 day' PRECEDING AND CURRENT ROW`
/// over 6-hourly times is `ROWS BETWEEN 4 PRECEDING AND CURRENT ROW`).
fn range_rows(
    start: Option<&RangeBound>,
    end: Option<&RangeBound>,
    step: Option<i64>,
    coordinate: &Coordinate,
) -> Option<GridFrame> {
    if start.is_none_or(Option::is_none) && end.is_none_or(Option::is_none) {
        return fitting(GridFrame {
            start: start.map(|_| 0),
            end: end.map(|_| 0),
        });
    }
    let step = step?.checked_abs().filter(|&s| s > 0)?;
    let data_type = coordinate.data_type();
    let distance = |bound: &RangeBound| -> Option<i64> {
        let Some((value, before)) = bound else {
            return Some(0);
        };
        let units = coordinate_units(value, &data_type)?;
        Some(if *before { -units } else { units })
    };
    // Offsets k with low <= k * step <= high: from ceil(low / step) to
    // floor(high / step).
    let start = match start {
        Some(bound) => Some(-(-distance(bound)?).div_euclid(step)),
        None => None,
    };
    let end = match end {
        Some(bound) => Some(distance(bound)?.div_euclid(step)),
        None => None,
    };
    fitting(GridFrame { start, end })
}

/// The dimension a window orders by (`dim_of` reads a column), and the
/// model calendar when it orders by its times on the calendar's own scale
/// of days (`calendar_scale(time, 'noleap')`, which a `RANGE` frame of
/// days over such times orders by).
fn ordered_by(
    order: &Expr,
    dim_of: &impl Fn(&Expr) -> Option<usize>,
) -> Option<(usize, Option<Calendar>)> {
    let Expr::ScalarFunction(call) = order else {
        return Some((dim_of(order)?, None));
    };
    if !call.func.inner().is::<CalendarScaleFunc>() {
        return None;
    }
    let [time, Expr::Literal(name, _)] = call.args.as_slice() else {
        return None;
    };
    let calendar = Calendar::parse(name.try_as_str()??)?;
    Some((dim_of(time)?, Some(calendar)))
}

/// The step between neighbouring times of `coordinate` on `calendar`'s own
/// scale of days, when they all follow the one before by it (a daily
/// `noleap` axis: one day, across the Gregorian 29th of February too).
fn calendar_step(coordinate: &Coordinate, calendar: Calendar) -> Option<i64> {
    let (mut previous, mut step) = (None::<i64>, None::<i64>);
    for piece in coordinate.pieces(Coordinate::PIECE) {
        let piece = cast(
            &piece.ok()?,
            &DataType::Timestamp(TimeUnit::Nanosecond, None),
        )
        .ok()?;
        let times = piece.as_primitive::<TimestampNanosecondType>();
        if times.null_count() > 0 {
            return None;
        }
        for &time in times.values() {
            let time = calendar_nanos(calendar, time)?;
            if let Some(previous) = previous {
                let difference = time.checked_sub(previous)?;
                if *step.get_or_insert(difference) != difference {
                    return None;
                }
            }
            previous = Some(time);
        }
    }
    step
}

/// Whether a filter on one strictly ordered dimension keeps one run of it:
/// comparisons of the column (or a numeric or temporal cast of it) with
/// constants, joined by `AND`.
fn keeps_one_run(filter: &Expr) -> bool {
    fn column(e: &Expr) -> bool {
        match e {
            Expr::Column(_) => true,
            Expr::Cast(Cast { expr, field }) | Expr::TryCast(TryCast { expr, field }) => {
                let data_type = field.data_type();
                (data_type.is_numeric() || data_type.is_temporal()) && column(expr)
            }
            _ => false,
        }
    }
    let constant = |e: &Expr| e.column_refs().is_empty() && !e.is_volatile();
    match filter {
        Expr::BinaryExpr(BinaryExpr {
            left,
            op: Operator::And,
            right,
        }) => keeps_one_run(left) && keeps_one_run(right),
        Expr::BinaryExpr(BinaryExpr {
            left,
            op: Operator::Eq | Operator::Lt | Operator::LtEq | Operator::Gt | Operator::GtEq,
            right,
        }) => (column(left) && constant(right)) || (constant(left) && column(right)),
        Expr::Between(between) if !between.negated => {
            column(&between.expr) && constant(&between.low) && constant(&between.high)
        }
        _ => false,
    }
}

/// A `RANGE` distance in the units of a coordinate's stored integers:
/// an interval of days and nanoseconds for nanosecond times, an integer
/// for integers. `None` for anything else (months, whose length varies;
/// floats, whose frames rounding could make differ between positions).
fn coordinate_units(distance: &ScalarValue, coordinate: &DataType) -> Option<i64> {
    let units = match (distance, coordinate) {
        (
            ScalarValue::IntervalMonthDayNano(Some(interval)),
            DataType::Timestamp(TimeUnit::Nanosecond, _),
        ) if interval.months == 0 => i64::from(interval.days)
            .checked_mul(NANOS_PER_DAY)?
            .checked_add(interval.nanoseconds)?,
        (
            ScalarValue::IntervalDayTime(Some(interval)),
            DataType::Timestamp(TimeUnit::Nanosecond, _),
        ) => i64::from(interval.days)
            .checked_mul(NANOS_PER_DAY)?
            .checked_add(i64::from(interval.milliseconds).checked_mul(1_000_000)?)?,
        (value, coordinate) if coordinate.is_integer() && value.data_type().is_integer() => {
            match value.cast_to(&DataType::Int64).ok()? {
                ScalarValue::Int64(Some(n)) => n,
                _ => return None,
            }
        }
        _ => return None,
    };
    (units >= 0).then_some(units)
}

/// Nanoseconds in a day (of a time without a time zone).
const NANOS_PER_DAY: i64 = 86_400_000_000_000;

/// A bound's offset in rows from the current one; `None` when unbounded
/// or farther than [`MAX_FRAME`].
fn offset(bound: &WindowFrameBound) -> Option<i64> {
    let rows = |value: &ScalarValue| -> Option<i64> {
        let rows = value.cast_to(&DataType::Int64).ok()?;
        match rows {
            ScalarValue::Int64(Some(n)) if (0..MAX_FRAME as i64).contains(&n) => Some(n),
            _ => None,
        }
    };
    match bound {
        WindowFrameBound::CurrentRow => Some(0),
        WindowFrameBound::Preceding(value) => rows(value).map(|n| -n),
        WindowFrameBound::Following(value) => rows(value),
    }
}

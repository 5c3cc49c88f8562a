//! `RollingWindowRule`: a SQL window of rolling aggregates along one
//! dimension of a Zarr table becomes a [`RollingWindow`].
//!
//! The rule matches a `Window` whose input is a Zarr table scan, seen
//! through any projections and aliases, where every window expression is
//!
//! ```sql
//! count|sum|avg|min|max(<expr>) OVER (
//!     PARTITION BY <every other dimension>
//!     ORDER BY <dim> [ASC|DESC]
//!     ROWS BETWEEN <n> PRECEDING|CURRENT ROW|<n> FOLLOWING
//!          AND <m> PRECEDING|CURRENT ROW|<m> FOLLOWING)
//! ```
//!
//! with one `dim` and one partition for all of them, a numeric argument
//! (`count`: any), no `DISTINCT` or `FILTER`, a frame of at most
//! [`MAX_FRAME`] positions, a `dim` whose coordinate is strictly monotonic
//! without NULL or NaN (so `ORDER BY` is the grid's order or its reverse,
//! without ties), and filters only on single dimensions (pushed into the
//! scan: a filter on the values would take cells out of the frames).
//!
//! Each partition is then one line of cells along `dim`, in grid order, and
//! each frame a run of neighbours on it: the operator reads blocks along
//! `dim` with the frame's overlap instead of sorting the rows. Anything
//! else keeps DataFusion's window. `SET zarrfusion.rolling_window = false`
//! turns the rule off.

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;

use datafusion::arrow::datatypes::DataType;
use datafusion::common::{Column, DFSchema, Result, ScalarValue};
use datafusion::logical_expr::expr::WindowFunction;
use datafusion::logical_expr::{
    Expr, ExprSchemable, Extension, LogicalPlan, Projection, Window, WindowFrameBound,
    WindowFrameUnits, WindowFunctionDefinition,
};

use super::frame::{Frame, RollOp};
use super::node::{RollExpr, RollingWindow};
use crate::array::reduce::ReduceOp;
use crate::array::scan_path::{down_to_scan, replace_columns, TableRead};
use crate::config::ZarrConfig;
use crate::plan_methods::bottom_up_rule;
use crate::table::{pushed_dimension, GridTable};

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
    frame: Frame,
}

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
    let Some(path) = down_to_scan(&window.input, exprs)? else {
        return Ok(None);
    };
    let table = path.table.grid();
    let scan = path.scan;
    // A table joined in keeps DataFusion's window (not yet rolled here).
    if !table.broadcasts.is_empty() {
        return Ok(None);
    }
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
        input_schema,
        window,
        n_columns,
        None,
    )?
    else {
        return Ok(None);
    };
    Ok(Some(RollingWindow {
        read: TableRead::new(table, Arc::clone(input_schema), scan.filters.clone()),
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
        &below.read.input_schema,
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
    Ok(Some(merged))
}

/// The rolling aggregates of `written`, whose parts (see
/// [`window_parts`]) come `rewritten` over the scan's columns, if they all
/// roll along one dimension (`dim`, when given) partitioned by all the
/// others, and their types fit; with that dimension. Their output fields
/// start at `first_output` in `window`'s schema.
fn roll_exprs(
    written: &[Written],
    mut rewritten: impl Iterator<Item = Expr>,
    table: &GridTable,
    input_schema: &DFSchema,
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
        let order = rewritten.next().as_ref().and_then(dim_of);
        let partition: Option<BTreeSet<usize>> = rewritten
            .by_ref()
            .take(w.partition_by.len())
            .map(|e| dim_of(&e))
            .collect();
        let (Some(d), Some(partition)) = (order, partition) else {
            return Ok(None);
        };
        // One line per partition: every other dimension, and only them.
        let others: BTreeSet<usize> = (0..table.dims.len()).filter(|&k| k != d).collect();
        if partition != others || dim.is_some_and(|first| first != d) {
            return Ok(None);
        }
        dim = Some(d);
        let Some(descends) = table.dims[d].coordinate.distinct_order() else {
            return Ok(None);
        };
        // Sorted against the grid's order, PRECEDING is later in the grid.
        let frame = if w.ascending != descends {
            w.frame
        } else {
            Frame {
                start: -w.frame.end,
                end: -w.frame.start,
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
    if frame.units != WindowFrameUnits::Rows {
        return None;
    }
    let frame = Frame {
        start: offset(&frame.start_bound)?,
        end: offset(&frame.end_bound)?,
    };
    let width = frame.end.checked_sub(frame.start)?;
    if width < 0 || width as u64 >= MAX_FRAME {
        return None;
    }
    Some(Written {
        op,
        arg: arg.clone(),
        partition_by: params.partition_by.clone(),
        order_by: order.expr.clone(),
        ascending: order.asc,
        frame,
    })
}

/// A bound's offset in rows from the current one; `None` when unbounded.
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

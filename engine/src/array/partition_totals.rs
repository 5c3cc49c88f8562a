//! `PartitionTotalsRule`: window aggregates over whole partitions of a
//! Zarr table become the reduction of the table by the partitions' keys,
//! joined back in as broadcast columns.
//!
//! ```sql
//! -- each hour's anomaly against its cell's monthly climatology
//! SELECT time, lat, lon,
//!        t2m - avg(t2m) OVER (PARTITION BY extract(month FROM time), lat, lon) AS anomaly
//! FROM era5;
//! ```
//!
//! A window aggregate whose frame is its whole partition (no `ORDER BY`,
//! or `UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING`) gives every row of a
//! partition the same value: the aggregate of the partition, which is
//! `GROUP BY` the partition's keys. So the window is the table joined with
//! that reduction on the keys:
//!
//! ```sql
//! SELECT time, lat, lon, t2m - c AS anomaly FROM era5 JOIN (
//!   SELECT extract(month FROM time) AS month, lat, lon, avg(t2m) AS c
//!   FROM era5 GROUP BY 1, 2, 3) clim
//! ON extract(month FROM era5.time) = clim.month AND era5.lat = clim.lat AND era5.lon = clim.lon;
//! ```
//!
//! which the dense reduction and the broadcast join compute without a sort
//! or a hash table (the join is made a [`crate::array::broadcast`] at
//! once, so that windows stacked on this one find the table under it): the
//! reduction in one pass
//! over the chunks, held as a dense array over its keys, gathered into the
//! blocks of a second pass. DataFusion's window would sort every row into
//! its partition first (a billion rows for a year of ERA5). Every row
//! meets its partition's row, as both sides read the same rows.
//!
//! The rule applies to a `Window` over a Zarr table (through projections,
//! aliases and filters) whose every expression is `count`, `sum`, `avg`,
//! `min`, `max`, `var`/`stddev` (sample or population: what the dense
//! reduction computes) without `DISTINCT`,
//! `FILTER` or `IGNORE NULLS`, over its whole partition, all partitioned by
//! the same keys, each a deterministic function of one dimension that is
//! never NULL (`lat`, `extract(month FROM time)`, `floor(lat / 2)`), when
//! the join is a broadcast (its dense array of totals within
//! [`MAX_BROADCAST_BYTES`](crate::table::MAX_BROADCAST_BYTES): 12 months x
//! 721 x 1440 cells for a climatology of ERA5). Anything else keeps
//! DataFusion's window. It runs when both `zarrfusion.broadcast_join` and
//! `zarrfusion.rolling_window` are on.

use std::sync::Arc;

use datafusion::common::{Column, Result};
use datafusion::logical_expr::expr::{AggregateFunction, WindowFunction};
use datafusion::logical_expr::{
    Expr, ExprSchemable, JoinType, LogicalPlan, LogicalPlanBuilder, Window, WindowFrameBound,
    WindowFunctionDefinition,
};

use super::broadcast::broadcast_join;
use super::reduce::ReduceOp;
use crate::config::ZarrConfig;
use crate::plan_methods::bottom_up_rule;

/// What the reduction joined in is called (`EXPLAIN` shows `broadcast=[
/// partition_totals by (...)]`).
const TOTALS: &str = "partition_totals";

/// Rewrites window aggregates over whole partitions of a Zarr table into a
/// join of the table with their reduction.
#[derive(Debug, Default)]
pub struct PartitionTotalsRule;

bottom_up_rule!(
    PartitionTotalsRule,
    "zarrfusion_partition_totals",
    |plan, options| {
        let config = ZarrConfig::of(options);
        if !config.broadcast_join || !config.rolling_window {
            return Ok(None);
        }
        match plan {
            LogicalPlan::Window(window) => partition_totals(window),
            _ => Ok(None),
        }
    }
);

/// The join computing `window`, if its aggregates are over whole
/// partitions of a Zarr table by functions of its dimensions.
fn partition_totals(window: &Window) -> Result<Option<LogicalPlan>> {
    let mut partition: Option<&Vec<Expr>> = None;
    let mut totals = Vec::with_capacity(window.window_expr.len());
    for expr in &window.window_expr {
        let expr = match expr {
            Expr::Alias(alias) => alias.expr.as_ref(),
            other => other,
        };
        let Expr::WindowFunction(function) = expr else {
            return Ok(None);
        };
        let WindowFunction { fun, params } = function.as_ref();
        let WindowFunctionDefinition::AggregateUDF(udf) = fun else {
            return Ok(None);
        };
        let whole = |bound: &WindowFrameBound| match bound {
            WindowFrameBound::Preceding(value) | WindowFrameBound::Following(value) => {
                value.is_null()
            }
            WindowFrameBound::CurrentRow => false,
        };
        let frame = &params.window_frame;
        if params.distinct
            || params.filter.is_some()
            || params.null_treatment.is_some()
            || ReduceOp::of_aggregate(udf).is_none()
            || !whole(&frame.start_bound)
            || !whole(&frame.end_bound)
            || params.partition_by.is_empty()
            || partition.is_some_and(|p| p != &params.partition_by)
        {
            return Ok(None);
        }
        partition = Some(&params.partition_by);
        totals.push(Expr::AggregateFunction(AggregateFunction::new_udf(
            Arc::clone(udf),
            params.args.clone(),
            false,
            None,
            vec![],
            None,
        )));
    }
    let Some(keys) = partition else {
        return Ok(None);
    };
    let input_schema = window.input.schema();
    for key in keys {
        if key.nullable(input_schema)? {
            return Ok(None);
        }
    }

    // The reduction by the keys, named apart from the input's columns.
    let taken = |name: &str| input_schema.fields().iter().any(|f| f.name() == name);
    let fresh = |stem: &str, i: usize| {
        let mut name = format!("__zarrfusion_{stem}{i}");
        while taken(&name) {
            name.push('_');
        }
        name
    };
    let key_names: Vec<String> = (0..keys.len()).map(|i| fresh("key", i)).collect();
    let total_names: Vec<String> = (0..totals.len()).map(|i| fresh("total", i)).collect();
    let group: Vec<Expr> = (keys.iter().zip(&key_names))
        .map(|(key, name)| key.clone().alias(name))
        .collect();
    let aggregates: Vec<Expr> = (totals.into_iter().zip(&total_names))
        .map(|(total, name)| total.alias(name))
        .collect();
    let reduction = LogicalPlanBuilder::from(Arc::clone(&window.input))
        .aggregate(group, aggregates)?
        .alias(TOTALS)?
        .build()?;
    let right_keys: Vec<Expr> = (key_names.iter())
        .map(|name| Expr::Column(Column::new(Some(TOTALS), name)))
        .collect();
    let joined = LogicalPlanBuilder::from(Arc::clone(&window.input))
        .join_with_expr_keys(reduction, JoinType::Inner, (keys.clone(), right_keys), None)?
        .build()?;
    // Read as broadcast columns at once, so that a window stacked on this
    // one finds the table under it; a join that is not one (not over a
    // Zarr table, keys that are not functions of single dimensions, totals
    // too large) keeps DataFusion's window.
    let LogicalPlan::Join(join) = &joined else {
        return Ok(None);
    };
    let Some(broadcast) = broadcast_join(join, true)? else {
        return Ok(None);
    };

    // The window's columns: its input's, then each aggregate's total.
    let n = input_schema.fields().len();
    let mut outputs: Vec<Expr> = input_schema
        .columns()
        .into_iter()
        .map(Expr::Column)
        .collect();
    for (i, name) in total_names.iter().enumerate() {
        let (qualifier, field) = window.schema.qualified_field(n + i);
        let total = Expr::Column(Column::new(Some(TOTALS), name));
        outputs.push(total.alias_qualified(qualifier.cloned(), field.name()));
    }
    let plan = LogicalPlanBuilder::from(broadcast).project(outputs)?;
    Ok(Some(plan.build()?))
}

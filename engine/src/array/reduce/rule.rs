//! `DenseReductionRule`: plain SQL `GROUP BY` over dimensions of a Zarr
//! table becomes a [`DenseReduction`].
//!
//! The rule matches an `Aggregate` whose input is a Zarr table scan (or a
//! scan of `rechunk(...)`, whose rechunked store it then reduces after the
//! copy), seen through any projections, aliases and filters, where
//! - every grouping expression is a dimension column of the table, or a
//!   deterministic function of one dimension column alone
//!   (`date_trunc('day', time)`, `extract(month FROM time)`,
//!   `floor(lat / 2) * 2`; see `keys`) over a dimension of at most
//!   [`MAX_KEYED_POSITIONS`] positions (2^24);
//! - every aggregate is `count`, `sum`, `avg`, `min`, `max`, `var`,
//!   `var_pop`, `stddev` or `stddev_pop` of one deterministic expression
//!   over the table's columns, without `DISTINCT`, `FILTER` or `ORDER BY`,
//!   over a numeric argument (`count`: any argument);
//! - the scan has no `LIMIT`, and the dense state fits
//!   `zarrfusion.dense_state_bytes` (1 GiB, [`MAX_STATE_BYTES`]),
//!   or the state of each key of a grouped dimension does and that
//!   dimension's keys run along its positions (it is grouped by its
//!   positions, or by `date_trunc` of an ordered time): the reduction then
//!   runs in bands of those keys, each band's groups folded and emitted
//!   before the next's (the first such dimension in table order; where
//!   that is not the first grouped one, the rows come band by band rather
//!   than in the grid's order).
//!
//! Anything else keeps DataFusion's hash aggregation. The rule is on by
//! default; `SET zarrfusion.dense_reduction = false` turns it off, and
//! `SET zarrfusion.dense_group_functions = false` keeps it to dimension
//! columns.

use std::sync::Arc;

use datafusion::common::{DFSchema, Result};
use datafusion::logical_expr::expr::{AggregateFunction, Cast};
use datafusion::logical_expr::utils::conjunction;
use datafusion::logical_expr::{Aggregate, Expr, ExprSchemable, Extension, LogicalPlan};
use datafusion::physical_expr::execution_props::ExecutionProps;

use super::accumulators::{numeric_domain, ReduceOp};
use super::keys::{coordinate_repeats, physical_key, DimKeys, MAX_KEYED_POSITIONS};
use super::node::{DenseReduction, GroupKey, ReduceExpr};
use crate::array::scan_path::{down_to_scan_or_rechunk, TableRead};
use crate::config::ZarrConfig;
use crate::plan_methods::bottom_up_rule;
use crate::table::{select_planning, GridTable, Selection};

/// The most memory the per-worker group state of a dense reduction may
/// take by default (`zarrfusion.dense_state_bytes`; an upper bound, before
/// filters), and what a worker of a cluster holds a reduction it is sent
/// to; larger reductions run in bands of a grouped dimension's keys, each
/// band's state within it (where a dimension can be cut so), else keep
/// DataFusion's hash aggregation.
pub const MAX_STATE_BYTES: usize = 1 << 30;

/// Rewrites `GROUP BY` over dimensions of a Zarr table into a dense reduction.
#[derive(Debug, Default)]
pub struct DenseReductionRule;

bottom_up_rule!(
    DenseReductionRule,
    "zarrfusion_dense_reduction",
    |plan, options| {
        let LogicalPlan::Aggregate(aggregate) = plan else {
            return Ok(None);
        };
        let config = ZarrConfig::of(options);
        if !config.dense_reduction {
            return Ok(None);
        }
        let (functions, bound) = (config.dense_group_functions, config.dense_state_bytes);
        Ok(dense_reduction(aggregate, functions, bound)?.map(|node| {
            LogicalPlan::Extension(Extension {
                node: Arc::new(node),
            })
        }))
    }
);

/// The dense reduction computing `aggregate`, if it is one.
/// `functions`: whether grouping by functions of one dimension is allowed;
/// `bound`: the most group state held at once.
fn dense_reduction(
    aggregate: &Aggregate,
    functions: bool,
    bound: usize,
) -> Result<Option<DenseReduction>> {
    let mut group = aggregate.group_expr.clone();
    let mut aggregates = Vec::new();
    for expr in &aggregate.aggr_expr {
        let Some(reduce) = reduce_expr(expr) else {
            return Ok(None);
        };
        aggregates.push(reduce);
    }
    // Walk down to the scan, rewriting every expression into its columns:
    // the grouping expressions, then the aggregates' arguments.
    let n_group = group.len();
    let args: Vec<Expr> = aggregates.iter().filter_map(|a| a.arg.clone()).collect();
    group.extend(args);
    let Some(path) = down_to_scan_or_rechunk(&aggregate.input, group)? else {
        return Ok(None);
    };
    let (scan, table, predicates) = (path.scan, path.table.grid(), path.predicates);
    let mut rewritten = path.exprs.into_iter();
    let group: Vec<Expr> = rewritten.by_ref().take(n_group).collect();
    for a in &mut aggregates {
        if a.arg.is_some() {
            a.arg = rewritten.next();
        }
    }

    let Some(groups) = group_keys(&group, table) else {
        return Ok(None);
    };
    if !functions && groups.iter().any(|g| g.expr.is_some()) {
        return Ok(None);
    }
    // The state is sized by the positions the scan's filters select (all
    // of them if the filters cannot be evaluated here).
    let props = ExecutionProps::new();
    let selection = select_planning(&scan.filters, table, &props).ok();
    let Some(key_counts) = key_counts(&groups, table, selection.as_ref()) else {
        return Ok(None);
    };

    let input_schema = &scan.projected_schema;
    // The aggregates' state and the rows per group, as the operator holds
    // them.
    let mut state_bytes = 8;
    for (i, a) in aggregates.iter().enumerate() {
        let arg_type = match &a.arg {
            Some(arg) => arg.get_type(input_schema)?,
            None => datafusion::arrow::datatypes::DataType::Null,
        };
        let output = aggregate.schema.field(group.len() + i).data_type();
        if a.op.accumulator(&arg_type, output, 0).is_none() {
            return Ok(None);
        }
        state_bytes += a.op.state_bytes();
    }
    for a in &mut aggregates {
        if let Some(arg) = a.arg.take() {
            a.arg = Some(strip_widening_cast(a.op, arg, input_schema)?);
        }
    }
    let state = key_counts
        .iter()
        // One worker's state (the operator runs as many as fit its memory
        // limit, and without one as many as keep their states within this
        // bound too).
        .fold(state_bytes as u128, |n, &(c, _)| {
            n.saturating_mul(c as u128)
        });
    // Over the bound, in bands of the keys of a grouped dimension whose
    // keys run along its positions, each key's state within it.
    let bound = bound as u128;
    let cut = |&(count, runs_along): &(u64, bool)| {
        runs_along && count > 1 && state / count as u128 <= bound
    };
    if state > bound && !key_counts.iter().any(cut) {
        return Ok(None);
    }

    Ok(Some(DenseReduction {
        read: TableRead::new(table, Arc::clone(input_schema), scan.filters.clone())
            .with_rechunk(path.rechunk),
        predicate: conjunction(predicates),
        groups,
        aggregates,
        schema: Arc::clone(&aggregate.schema),
    }))
}

/// What each grouping expression (over the scan's columns) groups by: a
/// dimension, or a deterministic function of one dimension alone; `None`
/// if one is neither, or a dimension is grouped by twice. A dimension
/// grouped by itself and by functions of itself is grouped by the tuple of
/// them all.
fn group_keys(group: &[Expr], table: &GridTable) -> Option<Vec<GroupKey>> {
    let dim_of = |name: &str| table.dims.iter().position(|d| d.name == name);
    let mut keys = Vec::with_capacity(group.len());
    for g in group {
        // An alias of a column (DataFusion's rewrite of `DISTINCT`) is the column.
        let g = match g {
            Expr::Alias(alias) if matches!(alias.expr.as_ref(), Expr::Column(_)) => {
                alias.expr.as_ref()
            }
            other => other,
        };
        let key = match g {
            Expr::Column(c) => {
                let dim = dim_of(&c.name)?;
                // A coordinate whose values repeat (or hold NULLs or NaNs)
                // groups by its values, as a function of itself: its equal
                // values are one group, as in DataFusion's aggregation. (A
                // dimension too long to key is grouped by position, its
                // values not gone through.)
                let keyed = table.dims[dim].len <= MAX_KEYED_POSITIONS
                    && coordinate_repeats(table, dim).ok()?;
                GroupKey {
                    dim,
                    expr: keyed.then(|| g.clone()),
                }
            }
            _ => {
                if g.is_volatile() {
                    return None;
                }
                let refs = g.column_refs();
                let [column] = refs.into_iter().collect::<Vec<_>>()[..] else {
                    return None;
                };
                let dim = dim_of(&column.name)?;
                if table.dims[dim].len > MAX_KEYED_POSITIONS {
                    return None;
                }
                GroupKey {
                    dim,
                    expr: Some(g.clone()),
                }
            }
        };
        keys.push(key);
    }
    for (i, g) in group.iter().enumerate() {
        let g = match g {
            Expr::Alias(alias) => alias.expr.as_ref(),
            other => other,
        };
        let dim = keys[i].dim;
        let on_dim = keys.iter().filter(|k| k.dim == dim);
        let (plain, functions) = on_dim.fold((0, 0), |(p, f), k| match k.expr {
            None => (p + 1, f),
            Some(_) => (p, f + 1),
        });
        if plain > 1 {
            return None;
        }
        if functions > 0 && keys[i].expr.is_none() {
            keys[i].expr = Some(g.clone());
        }
    }
    Some(keys)
}

/// Per grouped dimension (in table order), the number of its keys over its
/// positions in `selection` (all of them without one) and whether they run
/// along its positions (see `KeyMap::direction`); `None` if a function of
/// a dimension cannot be evaluated over its coordinate.
fn key_counts(
    groups: &[GroupKey],
    table: &GridTable,
    selection: Option<&Selection>,
) -> Option<Vec<(u64, bool)>> {
    let props = ExecutionProps::new();
    let mut dims: Vec<usize> = groups.iter().map(|g| g.dim).collect();
    dims.sort_unstable();
    dims.dedup();
    let mut counts = Vec::with_capacity(dims.len());
    for d in dims {
        let dim = &table.dims[d];
        let exprs: Vec<&Expr> = groups
            .iter()
            .filter(|g| g.dim == d)
            .filter_map(|g| g.expr.as_ref())
            .collect();
        let all = 0..dim.len;
        let ranges = selection.map_or(std::slice::from_ref(&all), |s| s.ranges(d));
        if exprs.is_empty() {
            counts.push((ranges.iter().map(|r| r.end - r.start).sum(), true));
            continue;
        }
        let physical = exprs
            .into_iter()
            .map(|e| physical_key(e, dim, &props))
            .collect::<Result<Vec<_>>>()
            .ok()?;
        let keys = DimKeys::evaluate(table, d, ranges, &physical).ok()?;
        counts.push((keys.map.count as u64, keys.map.direction().is_some()));
    }
    Some(counts)
}

/// The reduction an aggregate expression asks for, if supported.
fn reduce_expr(expr: &Expr) -> Option<ReduceExpr> {
    let expr = match expr {
        Expr::Alias(alias) => alias.expr.as_ref(),
        other => other,
    };
    let Expr::AggregateFunction(AggregateFunction { func, params }) = expr else {
        return None;
    };
    if params.distinct || params.filter.is_some() || !params.order_by.is_empty() {
        return None;
    }
    let [arg] = params.args.as_slice() else {
        return None;
    };
    let op = ReduceOp::of_aggregate(func)?;
    // `count(*)` (and `count` of any non-NULL literal) counts rows.
    let counts_rows = matches!(arg, Expr::Literal(value, _) if !value.is_null());
    Some(ReduceExpr {
        op,
        arg: (!(op == ReduceOp::Count && counts_rows)).then(|| arg.clone()),
    })
}

/// `CAST(x AS Float64)` (or `Int64`, `UInt64`) of an argument whose values
/// the fold widens into that type anyway: the fold converts each value as
/// it goes, exactly as the cast would, without materializing a wide copy.
fn strip_widening_cast(op: ReduceOp, arg: Expr, schema: &DFSchema) -> Result<Expr> {
    let folds_wide = !matches!(op, ReduceOp::Count | ReduceOp::Min | ReduceOp::Max);
    if let Expr::Cast(Cast { expr, field }) = &arg {
        if folds_wide && numeric_domain(&expr.get_type(schema)?).as_ref() == Some(field.data_type())
        {
            return Ok(expr.as_ref().clone());
        }
    }
    Ok(arg)
}

//! `BroadcastJoinRule`: a join of a Zarr table with a small result keyed
//! by some of its dimensions becomes columns of the table, broadcast along
//! the others, instead of a hash join.
//!
//! An anomaly is the grid minus a result over fewer dimensions:
//!
//! ```sql
//! WITH clim AS (
//!   SELECT extract(month FROM time) AS month, lat, lon, avg(t2m) AS t2m_clim
//!   FROM era5 GROUP BY 1, 2, 3)
//! SELECT time, lat, avg(t2m - t2m_clim) AS anomaly
//! FROM era5 JOIN clim
//!   ON extract(month FROM era5.time) = clim.month
//!  AND era5.lat = clim.lat AND era5.lon = clim.lon
//! GROUP BY time, lat;
//! ```
//!
//! `clim` has one row per (month, lat, lon), so each cell of `era5` meets at
//! most one of its rows: the one whose keys are the cell's month, latitude
//! and longitude. The rule rewrites the join into a scan of the grid with
//! `clim`'s other columns as [broadcast columns](crate::table::Broadcast):
//! the small side computed once when the query runs, held as a dense array
//! over its keys, each block's values gathered from it. The scan then gets
//! every Zarr optimization, and the `GROUP BY` above becomes a dense
//! reduction: the anomaly's zonal mean is one pass over the grid's chunks
//! after the climatology's pass.
//!
//! It applies to a join whose every equality pair links a deterministic
//! function of one dimension of a Zarr table (the dimension itself,
//! `extract(month FROM time)`, `floor(lat)`) with a column of the other
//! side, of the same type, when that side has at most one row per key
//! tuple by construction (a `GROUP BY` of its key columns, seen through
//! projections, aliases, filters, sorts and limits; or `DISTINCT`), its
//! dense array stays under [`MAX_BROADCAST_BYTES`](crate::table::MAX_BROADCAST_BYTES), and the join is inner
//! (its other conditions become a filter, and cells without a row are
//! filtered out by the broadcast's `matched` column) or keeps every cell of
//! the grid (`era5 LEFT JOIN clim`: cells without a row get NULLs). An
//! inner join whose small side is a dense reduction of the same table,
//! grouped by the join's keys themselves, without a row filter, over every
//! cell or cells among which the grid's are (a climatology of the data,
//! the anomalies of some of its cells), keeps every cell by
//! construction and filters nothing (see `Coverage`): the table then reads
//! as a whole grid, so that a rolling window can run over it. Anything else
//! stays DataFusion's join. `SET zarrfusion.broadcast_join = false` turns
//! the rule off. On a cluster the small side is a stage of its own,
//! broadcast to the grid's tasks ([`crate::distributed::broadcasts`]).

use std::collections::HashSet;
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, AsArray};
use datafusion::arrow::datatypes::{DataType, Float32Type, Float64Type};
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{plan_err, Column, NullEquality, Result};
use datafusion::logical_expr::{when, Distinct, Expr, ExprSchemable, Join, JoinType, LogicalPlan};
use datafusion::physical_expr::execution_props::ExecutionProps;
use datafusion::physical_expr::PhysicalExpr;

use super::reduce::{physical_key, DenseReduction, DimKeys, MAX_KEYED_POSITIONS};
use super::scan_path::{down_to_scan, join_as_scan};
use crate::config::ZarrConfig;
use crate::plan_methods::bottom_up_rule;
use crate::table::{Broadcast, BroadcastDim, GridTable, ZarrTable};

/// Rewrites joins of a Zarr table with a small result keyed by some of its
/// dimensions into broadcast columns of the table.
#[derive(Debug, Default)]
pub struct BroadcastJoinRule;

bottom_up_rule!(
    BroadcastJoinRule,
    "zarrfusion_broadcast_join",
    |plan, options| {
        if !ZarrConfig::of(options).broadcast_join {
            return Ok(None);
        }
        let LogicalPlan::Join(join) = plan else {
            return Ok(None);
        };
        if join.null_aware
            || join.on.is_empty()
            || join.null_equality != NullEquality::NullEqualsNothing
        {
            return Ok(None);
        }
        for grid_is_left in [true, false] {
            let keeps_grid = match join.join_type {
                JoinType::Inner => true,
                JoinType::Left => grid_is_left,
                JoinType::Right => !grid_is_left,
                _ => false,
            };
            if !keeps_grid || (join.join_type != JoinType::Inner && join.filter.is_some()) {
                continue;
            }
            if let Some(rewritten) = broadcast_join(join, grid_is_left)? {
                return Ok(Some(rewritten));
            }
        }
        Ok(None)
    }
);

/// The scan computing `join` with the side `grid_is_left` says as the
/// grid, if it is a broadcast join.
pub(crate) fn broadcast_join(join: &Join, grid_is_left: bool) -> Result<Option<LogicalPlan>> {
    let (grid_side, small_side) = match grid_is_left {
        true => (&join.left, &join.right),
        false => (&join.right, &join.left),
    };
    let (grid_keys, small_keys): (Vec<Expr>, Vec<Expr>) = (join.on.iter())
        .map(|(l, r)| match grid_is_left {
            true => (l.clone(), r.clone()),
            false => (r.clone(), l.clone()),
        })
        .unzip();

    // The small side: each key a column of it, together unique.
    let small_schema = small_side.schema();
    let Some(key_columns) = (small_keys.iter())
        .map(|e| match e {
            Expr::Column(c) => small_schema.index_of_column(c).ok(),
            _ => None,
        })
        .collect::<Option<Vec<usize>>>()
    else {
        return Ok(None);
    };
    let Some(unique) = unique_columns(small_side) else {
        return Ok(None);
    };
    if !unique.iter().all(|u| key_columns.contains(u)) {
        return Ok(None);
    }

    // The grid side: its columns and keys over the scan's columns.
    let width = grid_side.schema().fields().len();
    let mut exprs: Vec<Expr> = (grid_side.schema().columns().into_iter())
        .map(Expr::Column)
        .collect();
    exprs.extend(grid_keys);
    let Some(path) = down_to_scan(grid_side, exprs)? else {
        return Ok(None);
    };
    let table = path.table.grid();
    let scan_schema = &path.scan.projected_schema;
    let keys = &path.exprs[width..];
    let mut dims_of_keys = Vec::with_capacity(keys.len());
    for (key, &column) in keys.iter().zip(&key_columns) {
        let Some(d) = dimension_of(key, table) else {
            return Ok(None);
        };
        if key.get_type(scan_schema)? != *small_schema.field(column).data_type() {
            return Ok(None);
        }
        dims_of_keys.push(d);
    }
    let Some(dims) = keyed_dims(table, keys, &dims_of_keys, &key_columns) else {
        return Ok(None);
    };

    // The small side's other columns, named apart from the grid's.
    let values: Vec<usize> = (0..small_schema.fields().len())
        .filter(|c| !key_columns.contains(c))
        .collect();
    let mut taken: HashSet<String> = (table.schema.fields().iter())
        .map(|f| f.name().clone())
        .collect();
    let mut names: Vec<String> = (values.iter())
        .map(|&c| unique_name(small_schema.field(c).name(), &mut taken))
        .collect();
    let matched = unique_name("matched", &mut taken);
    names.push(matched.clone());
    let label = label_of(small_side);
    let broadcast = match Broadcast::new(small_side.as_ref().clone(), dims, values, names, label) {
        Ok(b) => b,
        // Too large to hold: the hash join.
        Err(_) => return Ok(None),
    };
    // An inner join drops the cells without a row, unless none lacks one.
    let inner = join.join_type == JoinType::Inner;
    let every_cell = Coverage {
        table,
        filters: &path.scan.filters,
        keys: &path.exprs[width..],
        dims_of_keys: &dims_of_keys,
    };
    let drops_cells = inner && !every_cell.met_by(small_side, &key_columns, &broadcast);
    let value_names: Vec<String> = (broadcast.fields.iter())
        .map(|f| f.name().clone())
        .collect();
    let grid = table.with_broadcast(broadcast);

    let name = path.scan.table_name.clone();
    let column = |field: &str| Expr::Column(Column::new(Some(name.clone()), field));
    let provider = ZarrTable::new(grid).with_pushdown(path.table.pushdown());

    // The join's columns: the grid side's as they were; the small side's
    // keys are the grid's (NULL where no row matched, in a left join),
    // its other columns the broadcast's.
    let mut small_outputs = Vec::with_capacity(small_schema.fields().len());
    let mut value = 0;
    for c in 0..small_schema.fields().len() {
        match key_columns.iter().position(|&k| k == c) {
            Some(i) if inner => small_outputs.push(keys[i].clone()),
            Some(i) => small_outputs.push(when(column(&matched), keys[i].clone()).end()?),
            None => {
                small_outputs.push(column(&value_names[value]));
                value += 1;
            }
        }
    }
    let grid_outputs = path.exprs[..width].to_vec();
    let outputs: Vec<Expr> = match grid_is_left {
        true => grid_outputs.into_iter().chain(small_outputs).collect(),
        false => small_outputs.into_iter().chain(grid_outputs).collect(),
    };

    let mut predicates = path.predicates.clone();
    if drops_cells {
        predicates.push(column(&matched));
    }
    let filters = path.scan.filters.clone();
    join_as_scan(join, name, provider, filters, predicates, outputs).map(Some)
}

/// The grid's side of a broadcast join: its cells (`table` under the
/// dimension filters `filters`) and its keys (`keys`, over the scan's
/// columns, functions of the dimensions `dims_of_keys`).
struct Coverage<'a> {
    table: &'a Arc<GridTable>,
    filters: &'a [Expr],
    keys: &'a [Expr],
    dims_of_keys: &'a [usize],
}

impl Coverage<'_> {
    /// Whether every cell meets a row of `small` (whose columns
    /// `key_columns` meet the keys; `broadcast` its columns) by
    /// construction, so that an inner join keeps every cell: `small` is
    /// a grouping ([`grouping_of`]) of the same table without a row filter, over
    /// every cell or cells among which the grid's are (its dimension
    /// filters some of the grid's), grouped by the keys themselves (each
    /// cell's group is its own keys), and no key is NULL or NaN at any
    /// position (such a key meets no row).
    fn met_by(&self, small: &LogicalPlan, key_columns: &[usize], broadcast: &Broadcast) -> bool {
        let Some((grouping, outputs)) = grouping_of(small) else {
            return false;
        };
        let all_unqualified = |exprs: &[Expr]| -> Option<Vec<Expr>> {
            exprs.iter().map(|e| unqualified(e.clone())).collect()
        };
        // The grid's cells are among the grouping's: each of its filters
        // is one of the grid's (the grid may be cut further).
        let among_its_cells = grouping.filters.is_empty()
            || (all_unqualified(&grouping.filters).zip(all_unqualified(self.filters)))
                .is_some_and(|(its, mine)| its.iter().all(|f| mine.contains(f)));
        if !Arc::ptr_eq(&grouping.table, self.table) || !among_its_cells {
            return false;
        }
        let grouped_by_keys = (self.keys.iter().zip(self.dims_of_keys).zip(key_columns)).all(
            |((key, &dim), &column)| {
                let Some(group) = outputs.get(column).copied().flatten() else {
                    return false;
                };
                let Some((group_dim, function)) = grouping.groups.get(group) else {
                    return false;
                };
                let function = unqualified(function.clone());
                *group_dim == dim && function.is_some() && function == unqualified(key.clone())
            },
        );
        let keys_valid = (broadcast.dims.iter())
            .flat_map(|d| &d.distinct)
            .all(|keys| keys.null_count() == 0 && !has_nan(keys));
        grouped_by_keys && keys_valid
    }
}

/// A `GROUP BY` of every row of a table's cells (no row filter): the
/// table, the dimension filters selecting the cells, and per group its
/// dimension and the function of that dimension's column it is, over the
/// table's columns (the column itself for a dimension grouped as it is).
struct Grouping {
    table: Arc<GridTable>,
    filters: Vec<Expr>,
    groups: Vec<(usize, Expr)>,
}

/// The grouping `plan` is (a dense reduction, or an aggregate over a
/// Zarr table's scan without a row filter), seen through projections of
/// its columns and aliases, and for each of `plan`'s output columns the
/// group it is (`None`: an aggregate or computed).
fn grouping_of(plan: &LogicalPlan) -> Option<(Grouping, Vec<Option<usize>>)> {
    match plan {
        LogicalPlan::Extension(e) => {
            let reduction = e.node.as_any().downcast_ref::<DenseReduction>()?;
            let read = &reduction.read;
            if read.rechunk.is_some() || reduction.predicate.is_some() {
                return None;
            }
            let table = Arc::clone(&read.table);
            let groups = (reduction.groups.iter())
                .map(|g| {
                    let column = || Expr::Column(Column::new_unqualified(&table.dims[g.dim].name));
                    (g.dim, g.expr.clone().unwrap_or_else(column))
                })
                .collect();
            let outputs = (0..reduction.schema.fields().len()).map(Some).collect();
            let filters = read.filters.clone();
            Some((
                Grouping {
                    table,
                    filters,
                    groups,
                },
                outputs,
            ))
        }
        LogicalPlan::Aggregate(a) => {
            let path = down_to_scan(&a.input, a.group_expr.clone()).ok()??;
            let table = Arc::clone(path.table.grid());
            if !path.predicates.is_empty()
                || (a.group_expr.iter()).any(|e| matches!(e, Expr::GroupingSet(_)))
            {
                return None;
            }
            let groups = (path.exprs.into_iter())
                .map(|e| Some((dimension_of(&e, &table)?, e)))
                .collect::<Option<Vec<_>>>()?;
            let outputs = (0..a.schema.fields().len())
                .map(|i| (i < groups.len()).then_some(i))
                .collect();
            let filters = path.scan.filters.clone();
            Some((
                Grouping {
                    table,
                    filters,
                    groups,
                },
                outputs,
            ))
        }
        LogicalPlan::SubqueryAlias(a) => grouping_of(&a.input),
        LogicalPlan::Projection(p) => {
            let (grouping, inner) = grouping_of(&p.input)?;
            let input_schema = p.input.schema();
            let outputs = (p.expr.iter())
                .map(|e| match e.clone().unalias() {
                    Expr::Column(c) => input_schema.index_of_column(&c).ok().and_then(|i| inner[i]),
                    _ => None,
                })
                .collect();
            Some((grouping, outputs))
        }
        _ => None,
    }
}

/// `expr` with its columns named without their tables and no aliases;
/// `None` if it holds what cannot be compared so (a subquery).
fn unqualified(expr: Expr) -> Option<Expr> {
    expr.unalias_nested()
        .data
        .transform(|e| match e {
            Expr::Column(c) => Ok(Transformed::yes(Expr::Column(Column::new_unqualified(
                c.name,
            )))),
            Expr::ScalarSubquery(_) | Expr::Exists(_) | Expr::InSubquery(_) => {
                plan_err!("a subquery")
            }
            other => Ok(Transformed::no(other)),
        })
        .ok()
        .map(|t| t.data)
}

/// Whether a float array holds a NaN.
fn has_nan(values: &ArrayRef) -> bool {
    match values.data_type() {
        DataType::Float32 => {
            (values.as_primitive::<Float32Type>().iter()).any(|v| v.is_some_and(f32::is_nan))
        }
        DataType::Float64 => {
            (values.as_primitive::<Float64Type>().iter()).any(|v| v.is_some_and(f64::is_nan))
        }
        _ => false,
    }
}

/// The dimension `key` (over the scan's columns) is a deterministic
/// function of, alone; `None` if it reads anything else.
fn dimension_of(key: &Expr, table: &GridTable) -> Option<usize> {
    if key.is_volatile() {
        return None;
    }
    let refs = key.column_refs();
    let [column] = refs.into_iter().collect::<Vec<_>>()[..] else {
        return None;
    };
    let d = table.dims.iter().position(|d| d.name == column.name)?;
    (table.dims[d].len <= MAX_KEYED_POSITIONS).then_some(d)
}

/// Each keyed dimension of the grid, in its order: the keys (functions of
/// its coordinate, evaluated at every position) and the small side's
/// columns they meet. `None` when a function cannot be evaluated.
fn keyed_dims(
    table: &GridTable,
    keys: &[Expr],
    dims_of_keys: &[usize],
    key_columns: &[usize],
) -> Option<Vec<BroadcastDim>> {
    let props = ExecutionProps::new();
    let mut dims: Vec<usize> = dims_of_keys.to_vec();
    dims.sort_unstable();
    dims.dedup();
    let mut out = Vec::with_capacity(dims.len());
    for d in dims {
        let dim = &table.dims[d];
        let on_dim: Vec<usize> = (0..keys.len()).filter(|&i| dims_of_keys[i] == d).collect();
        let physical = (on_dim.iter())
            .map(|&i| physical_key(&keys[i], dim, &props))
            .collect::<Result<Vec<_>>>()
            .ok()?;
        out.push(
            keyed_dim(
                table,
                d,
                physical,
                on_dim.iter().map(|&i| key_columns[i]).collect(),
            )
            .ok()?,
        );
    }
    Some(out)
}

/// Dimension `d` of `table` keyed by `exprs` (functions of its coordinate
/// over [`key_schema`](super::reduce::key_schema)), meeting the small
/// side's columns `columns`: the keys evaluated at every position,
/// numbered in the order they are met along it.
pub fn keyed_dim(
    table: &GridTable,
    d: usize,
    exprs: Vec<Arc<dyn PhysicalExpr>>,
    columns: Vec<usize>,
) -> Result<BroadcastDim> {
    let all = 0..table.dims[d].len;
    let evaluated = DimKeys::evaluate(table, d, std::slice::from_ref(&all), &exprs)?;
    let keys = (evaluated.map.keys, evaluated.values);
    BroadcastDim::in_order_met(d, keys, columns, exprs)
}

/// Output columns of `plan` that no two of its rows agree on, all
/// together, by construction: the grouping columns of an aggregate, seen
/// through what keeps rows apart (projections of them, aliases, filters,
/// sorts, limits), or every column after `DISTINCT`.
fn unique_columns(plan: &LogicalPlan) -> Option<Vec<usize>> {
    match plan {
        LogicalPlan::Aggregate(a) => {
            if (a.group_expr.iter()).any(|e| matches!(e, Expr::GroupingSet(_))) {
                return None;
            }
            Some((0..a.group_expr.len()).collect())
        }
        LogicalPlan::Extension(e) => {
            let reduction = e.node.as_any().downcast_ref::<DenseReduction>()?;
            Some((0..reduction.groups.len()).collect())
        }
        LogicalPlan::Distinct(Distinct::All(input)) => {
            Some((0..input.schema().fields().len()).collect())
        }
        LogicalPlan::Projection(p) => {
            let inner = unique_columns(&p.input)?;
            let input_schema = p.input.schema();
            inner
                .into_iter()
                .map(|u| {
                    p.expr.iter().position(|e| match e.clone().unalias() {
                        Expr::Column(c) => input_schema.index_of_column(&c).ok() == Some(u),
                        _ => false,
                    })
                })
                .collect()
        }
        LogicalPlan::SubqueryAlias(a) => unique_columns(&a.input),
        LogicalPlan::Filter(f) => unique_columns(&f.input),
        LogicalPlan::Sort(s) => unique_columns(&s.input),
        LogicalPlan::Limit(l) => unique_columns(&l.input),
        _ => None,
    }
}

/// `name`, or `name_1`, `name_2`, ... when taken; the one returned is
/// taken from then on.
fn unique_name(name: &str, taken: &mut HashSet<String>) -> String {
    let mut out = name.to_string();
    let mut n = 1;
    while taken.contains(&out) {
        out = format!("{name}_{n}");
        n += 1;
    }
    taken.insert(out.clone());
    out
}

/// How the small side is shown: its alias (`clim`), else its first
/// column's table.
fn label_of(plan: &LogicalPlan) -> String {
    match plan {
        LogicalPlan::SubqueryAlias(a) => a.alias.to_string(),
        other => (other.schema().iter().next())
            .and_then(|(q, _)| q.map(|q| q.to_string()))
            .unwrap_or_else(|| "the joined table".to_string()),
    }
}

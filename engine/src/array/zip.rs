//! `AlignedJoinRule`: a join of two Zarr tables on all their dimensions,
//! over the same coordinates, becomes one scan of both tables' variables
//! (a zip of aligned blocks) instead of a hash join.
//!
//! Two tables whose dimensions have the same coordinates, position by
//! position, share one grid: every cell of one meets exactly one cell of the
//! other, the one at the same position. So
//!
//! ```sql
//! SELECT a.time, a.lat, a.lon, a.t2m - b.t2m
//! FROM era5 a JOIN era5_forecast b
//!   ON a.time = b.time AND a.lat = b.lat AND a.lon = b.lon
//! ```
//!
//! reads the same block of `a` and `b` together and puts their columns side
//! by side: no hash table, no shuffle, and memory of one block per side.
//! The rule rewrites the join into a scan of a [`GridTable`] holding the
//! variables of both (each read from its own store), under a projection
//! giving the join's columns and a filter with whatever the two sides
//! filtered on. The scan then gets every Zarr optimization: filters on
//! dimensions pushed down, blocks, projected memory, and a `GROUP BY`
//! over its dimensions becomes a dense reduction.
//!
//! It applies to inner joins whose equality pairs link each dimension of
//! one table to the dimension at the same position in the other, when the
//! coordinates are equal, strictly monotonic and without NULL or NaN (so
//! each value matches once). Any other join stays DataFusion's.
//! `SET zarrfusion.aligned_join = false` turns the rule off.

use std::collections::HashSet;
use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode};
use datafusion::common::{Column, Result};
use datafusion::logical_expr::{Expr, JoinType, LogicalPlan};

use super::scan_path::{down_to_scan, join_as_scan, ScanPath};
use crate::config::ZarrConfig;
use crate::plan_methods::bottom_up_rule;
use crate::table::{GridTable, ZarrTable};

/// Rewrites joins of two Zarr tables on all their dimensions into a scan of
/// both tables' aligned blocks.
#[derive(Debug, Default)]
pub struct AlignedJoinRule;

bottom_up_rule!(
    AlignedJoinRule,
    "zarrfusion_aligned_join",
    |plan, options| match ZarrConfig::of(options).aligned_join {
        true => aligned_zip(plan),
        false => Ok(None),
    }
);

/// The zip computing `plan`, if it is an aligned join of two Zarr tables.
fn aligned_zip(plan: &LogicalPlan) -> Result<Option<LogicalPlan>> {
    let LogicalPlan::Join(join) = plan else {
        return Ok(None);
    };
    if join.join_type != JoinType::Inner || join.null_aware || join.on.is_empty() {
        return Ok(None);
    }
    // Each side's output columns, then its halves of the equality pairs.
    let side = |input: &Arc<LogicalPlan>, keys: Vec<Expr>| {
        let mut exprs: Vec<Expr> = input
            .schema()
            .columns()
            .into_iter()
            .map(Expr::Column)
            .collect();
        exprs.extend(keys);
        exprs
    };
    let left_keys: Vec<Expr> = join.on.iter().map(|(l, _)| l.clone()).collect();
    let right_keys: Vec<Expr> = join.on.iter().map(|(_, r)| r.clone()).collect();
    let Some(left) = down_to_scan(&join.left, side(&join.left, left_keys))? else {
        return Ok(None);
    };
    let Some(right) = down_to_scan(&join.right, side(&join.right, right_keys))? else {
        return Ok(None);
    };
    let (a, b) = (left.table.grid(), right.table.grid());
    if !keys_pair_all_dimensions(&left, &right, join.on.len()) {
        return Ok(None);
    }
    // Other coordinates, or a side with a table joined in already: the
    // join stays DataFusion's.
    let Some(table) = a.zip(b) else {
        return Ok(None);
    };
    let zipped = Zipped {
        table,
        right_offset: a.variables.len(),
    };
    let name = format!(
        "{}_{}",
        left.scan.table_name.table(),
        right.scan.table_name.table()
    );
    // A column of a side's table (by name: a table's names are unique; a
    // filter pushed into a scan may name columns it does not project) as
    // the zipped table's column.
    let n_dims = zipped.table.dims.len();
    let to_zipped = |path: &ScanPath<'_>, offset: usize, exprs: Vec<Expr>| {
        let schema = path.table.grid().schema.clone();
        exprs
            .into_iter()
            .map(|e| {
                e.transform(|e| match e {
                    Expr::Column(c) => {
                        let index = schema.index_of(&c.name)?;
                        let at = if index < n_dims {
                            index
                        } else {
                            index + offset
                        };
                        let zipped_name = zipped.table.schema.field(at).name();
                        Ok(Transformed::yes(Expr::Column(Column::new(
                            Some(name.clone()),
                            zipped_name,
                        ))))
                    }
                    other => Ok(Transformed::no(other)),
                })
                .data()
            })
            .collect::<Result<Vec<Expr>>>()
    };
    let left_width = join.left.schema().fields().len();
    let right_width = join.right.schema().fields().len();
    let mut outputs = to_zipped(&left, 0, left.exprs[..left_width].to_vec())?;
    outputs.extend(to_zipped(
        &right,
        zipped.right_offset,
        right.exprs[..right_width].to_vec(),
    )?);
    let mut filters = to_zipped(&left, 0, left.scan.filters.clone())?;
    filters.extend(to_zipped(
        &right,
        zipped.right_offset,
        right.scan.filters.clone(),
    )?);
    let mut predicates = to_zipped(&left, 0, left.predicates.clone())?;
    predicates.extend(to_zipped(
        &right,
        zipped.right_offset,
        right.predicates.clone(),
    )?);
    // A filter on a join key reaches both sides: keep one (a predicate
    // too: the join keeps each once).
    let mut seen = HashSet::new();
    filters.retain(|f| seen.insert(f.clone()));

    let pushdown = left.table.pushdown() && right.table.pushdown();
    let provider = ZarrTable::new(zipped.table).with_pushdown(pushdown);
    join_as_scan(join, name.as_str(), provider, filters, predicates, outputs).map(Some)
}

/// Whether the equality pairs (the last `n` expressions of each path) link
/// every dimension of one table to the dimension at the same position of
/// the other, and nothing else.
fn keys_pair_all_dimensions(left: &ScanPath<'_>, right: &ScanPath<'_>, n: usize) -> bool {
    let (a, b) = (left.table.grid(), right.table.grid());
    let rank = a.dims.len();
    if rank == 0 || b.dims.len() != rank {
        return false;
    }
    let position = |table: &GridTable, e: &Expr| match e {
        Expr::Column(c) => table.dims.iter().position(|d| d.name == c.name),
        _ => None,
    };
    let keys = left.exprs[left.exprs.len() - n..]
        .iter()
        .zip(&right.exprs[right.exprs.len() - n..]);
    let mut paired = HashSet::new();
    for (l, r) in keys {
        match (position(a, l), position(b, r)) {
            (Some(i), Some(j)) if i == j => {
                paired.insert(i);
            }
            _ => return false,
        }
    }
    paired.len() == rank
}

/// The grid of two aligned tables ([`GridTable::zip`]).
struct Zipped {
    table: GridTable,
    /// Where the second table's variables start, past the first's.
    right_offset: usize,
}

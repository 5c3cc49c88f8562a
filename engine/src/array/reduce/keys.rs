//! Group keys: grouping by functions of one dimension's coordinate.
//!
//! `GROUP BY date_trunc('day', time)` (resampling), `extract(month FROM
//! time)` (climatologies), `floor(lat / 2) * 2` (coarsening): each is a
//! deterministic function of one dimension's coordinate, so every cell of
//! a position of that dimension has the same key. The function is
//! evaluated once per selected position of the dimension (a million time
//! steps cost a million evaluations, not a billion), and its values are
//! factorized into the distinct keys, sorted ascending (NULLs first, all
//! one key): the dense reduction then numbers groups by key
//! ([`KeyMap`]) instead of by position, and folds exactly as it does over
//! a dimension grouped by its coordinate.
//!
//! Several functions of one dimension (`GROUP BY extract(year FROM time),
//! extract(month FROM time)`, or `time` beside `extract(hour FROM time)`)
//! make one key per distinct tuple of their values, sorted
//! lexicographically in the order they are grouped by.

use std::ops::Range;
use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, UInt32Array};
use datafusion::arrow::compute::{concat, take};
use datafusion::arrow::datatypes::{Schema, SchemaRef};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::arrow::row::{RowConverter, SortField};
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{plan_err, Column, DFSchema, Result};
use datafusion::logical_expr::physical_planning_context::PhysicalPlanningContext;
use datafusion::logical_expr::Expr;
use datafusion::physical_expr::execution_props::ExecutionProps;
use datafusion::physical_expr::{create_physical_expr, PhysicalExpr};

use super::groups::KeyMap;
use crate::table::{signed_zeros_folded, Coordinate};
use crate::table::{Dimension, GridTable};

/// The most positions a dimension grouped by functions of its coordinate
/// may have (2^24: almost 2,000 years of hourly steps): each is evaluated,
/// and its key held. Evaluating takes about `KEYED_POSITION_BYTES` a
/// position while it lasts.
pub const MAX_KEYED_POSITIONS: u64 = 1 << 24;

/// Bytes a position of a dimension grouped by functions of its coordinate
/// takes while its keys are made (its values, their row encoding, its key),
/// as the memory projection counts it.
pub const KEYED_POSITION_BYTES: usize = 32;

/// One grouping column of a dense reduction, planned: a dimension grouped
/// by its coordinate (`expr` is `None`) or by a function of it.
#[derive(Debug, Clone)]
pub struct KeySpec {
    /// The dimension (index into the table's dimensions).
    pub dim: usize,
    /// The function, over the one column [`key_schema`] of the dimension.
    pub expr: Option<Arc<dyn PhysicalExpr>>,
}

/// The schema a key's function is written against: the dimension's
/// column alone (with its field metadata: a model calendar's days).
pub fn key_schema(dim: &Dimension) -> SchemaRef {
    Arc::new(Schema::new(vec![dim.field().with_nullable(true)]))
}

/// `expr`, a function of the column of `dim` alone, planned over
/// [`key_schema`].
pub fn physical_key(
    expr: &Expr,
    dim: &Dimension,
    props: &ExecutionProps,
) -> Result<Arc<dyn PhysicalExpr>> {
    let unqualified = expr
        .clone()
        .transform(|e| {
            Ok(match e {
                Expr::Column(c) => Transformed::yes(Expr::Column(Column::new_unqualified(c.name))),
                other => Transformed::no(other),
            })
        })?
        .data;
    let schema = DFSchema::try_from(key_schema(dim))?;
    create_physical_expr(
        &unqualified,
        &schema,
        props,
        &PhysicalPlanningContext::default(),
    )
}

/// Whether dimension `d`'s coordinate has values that one `GROUP BY`
/// group holds together (equal values, NULLs, `-0.0` and `0.0`, NaNs of
/// one kind): grouped by, such a dimension groups by its values, as a
/// function of itself, rather than by position. A strictly ordered
/// coordinate without NaN is known not to, without going through its
/// values; another is factorized (an error past `MAX_KEYED_POSITIONS`
/// positions). Only a coordinate within that bound is walked: the index
/// and an integer formula with a step answer without their values, at any
/// length.
pub fn coordinate_repeats(table: &GridTable, d: usize) -> Result<bool> {
    let dim = &table.dims[d];
    let stepped = dim.coordinate.integer_step().is_some_and(|step| step != 0);
    if dim.len < 2 || stepped && dim.coordinate.strict_order().is_some() {
        return Ok(false);
    }
    if dim.len <= MAX_KEYED_POSITIONS && dim.coordinate.distinct_order().is_some() {
        return Ok(false);
    }
    if dim.len > MAX_KEYED_POSITIONS {
        return plan_err!(
            "'{}' of {} has {} positions, too many to look for repeated values",
            dim.name,
            table.store,
            dim.len
        );
    }
    let values = dim.coordinate.to_array()?;
    let n = values.len();
    Ok(DimKeys::factorize(&[values], n)?.map.count < n)
}

/// The keys of one dimension over its selected positions.
#[derive(Debug, Clone)]
pub struct DimKeys {
    /// The key of each selected position.
    pub map: KeyMap,
    /// Per function of the dimension (in the order given): its value for
    /// each key.
    pub values: Vec<ArrayRef>,
}

impl DimKeys {
    /// Evaluates `exprs` (over [`key_schema`]) at the positions `ranges`
    /// of dimension `d` of `table` and factorizes their values.
    pub fn evaluate(
        table: &GridTable,
        d: usize,
        ranges: &[Range<u64>],
        exprs: &[Arc<dyn PhysicalExpr>],
    ) -> Result<Self> {
        let dim = &table.dims[d];
        let positions: u64 = ranges.iter().map(|r| r.end - r.start).sum();
        if positions > MAX_KEYED_POSITIONS {
            return plan_err!(
                "grouping {} by a function of '{}' evaluates it at {positions} positions, more \
                 than the {MAX_KEYED_POSITIONS} allowed; filter '{}' first",
                table.store,
                dim.name,
                dim.name
            );
        }
        let schema = key_schema(dim);
        let mut pieces: Vec<Vec<ArrayRef>> = vec![Vec::new(); exprs.len()];
        for range in ranges {
            let mut at = range.start;
            while at < range.end {
                let len = Coordinate::PIECE.min(range.end - at);
                let values = dim.coordinate.slice(at, len)?;
                let batch = RecordBatch::try_new(Arc::clone(&schema), vec![values])?;
                for (out, expr) in pieces.iter_mut().zip(exprs) {
                    out.push(expr.evaluate(&batch)?.into_array(batch.num_rows())?);
                }
                at += len;
            }
        }
        let columns = pieces
            .iter()
            .map(|parts| {
                let parts: Vec<&dyn datafusion::arrow::array::Array> =
                    parts.iter().map(|p| p.as_ref()).collect();
                Ok(match parts.as_slice() {
                    [one] => one.slice(0, one.len()),
                    _ => concat(&parts)?,
                })
            })
            .collect::<Result<Vec<ArrayRef>>>()?;
        Self::factorize(&columns, positions as usize)
    }

    /// The distinct tuples of `columns` (each `n` long), sorted, and the
    /// key of each row.
    fn factorize(columns: &[ArrayRef], n: usize) -> Result<Self> {
        // `-0.0` and `+0.0` one key, as in DataFusion's hash aggregation
        // (`lat % 3` of -30 and of 30).
        let columns: Vec<ArrayRef> = columns.iter().map(signed_zeros_folded).collect();
        let columns = columns.as_slice();
        let fields = columns
            .iter()
            .map(|c| SortField::new(c.data_type().clone()))
            .collect();
        let converter = RowConverter::new(fields)?;
        let rows = converter.convert_columns(columns)?;
        // Runs of equal values first (a day of hourly steps, a month):
        // only one row of each run is sorted.
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for i in 0..n {
            match runs.last_mut() {
                Some((start, len)) if rows.row(*start) == rows.row(i) => *len += 1,
                _ => runs.push((i, 1)),
            }
        }
        let mut order: Vec<usize> = (0..runs.len()).collect();
        let sorted = runs
            .windows(2)
            .all(|w| rows.row(w[0].0) <= rows.row(w[1].0));
        if !sorted {
            order.sort_by(|&a, &b| rows.row(runs[a].0).cmp(&rows.row(runs[b].0)));
        }
        let mut key_of_run = vec![0u32; runs.len()];
        let mut firsts: Vec<u32> = Vec::new();
        for &r in &order {
            let start = runs[r].0;
            let new = match firsts.last() {
                Some(&last) => rows.row(last as usize) != rows.row(start),
                None => true,
            };
            if new {
                firsts.push(start as u32);
            }
            key_of_run[r] = (firsts.len() - 1) as u32;
        }
        let mut keys = Vec::with_capacity(n);
        for (&(_, len), &key) in runs.iter().zip(&key_of_run) {
            keys.extend(std::iter::repeat_n(key, len));
        }
        let firsts = UInt32Array::from(firsts);
        let values = columns
            .iter()
            .map(|c| Ok(take(c.as_ref(), &firsts, None)?))
            .collect::<Result<Vec<ArrayRef>>>()?;
        Ok(Self {
            map: KeyMap {
                keys,
                count: firsts.len(),
            },
            values,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{Array, AsArray, Float64Array, Int64Array};
    use datafusion::arrow::datatypes::{Float64Type, Int64Type};

    #[test]
    fn factorize_sorts_distinct_tuples_and_keys_every_row() {
        let month: ArrayRef = Arc::new(Int64Array::from(vec![
            Some(3),
            Some(3),
            Some(1),
            None,
            Some(3),
            Some(1),
            None,
        ]));
        let half: ArrayRef = Arc::new(Float64Array::from(vec![0.5, 0.5, 0.5, 0.0, 1.5, 0.5, 0.0]));
        let keys = DimKeys::factorize(&[month, half], 7).unwrap();
        // (NULL, 0), (1, 0.5), (3, 0.5), (3, 1.5).
        assert_eq!(keys.map.count, 4);
        assert_eq!(keys.map.keys, vec![2, 2, 1, 0, 3, 1, 0]);
        let months = keys.values[0].as_primitive::<Int64Type>();
        assert!(months.is_null(0));
        assert_eq!(months.value(1), 1);
        assert_eq!(months.value(3), 3);
        let halves = keys.values[1].as_primitive::<Float64Type>();
        assert_eq!(halves.values().to_vec(), vec![0.0, 0.5, 0.5, 1.5]);
    }

    /// `-0.0` and `+0.0` are one key, `+0.0` (as DataFusion's hash
    /// aggregation groups them: `lat % 3` of -30 and 30), NULLs another.
    #[test]
    fn factorize_folds_signed_zeros_into_one_key() {
        let rest: ArrayRef = Arc::new(Float64Array::from(vec![
            Some(-0.0),
            Some(0.0),
            Some(1.0),
            Some(-0.0),
            None,
            Some(-1.0),
        ]));
        let keys = DimKeys::factorize(&[rest], 6).unwrap();
        // NULL, -1, 0, 1.
        assert_eq!(keys.map.count, 4);
        assert_eq!(keys.map.keys, vec![2, 2, 3, 2, 0, 1]);
        let zero = keys.values[0].as_primitive::<Float64Type>().value(2);
        assert_eq!(zero.to_bits(), 0.0f64.to_bits());
    }

    /// An index of 10^12 positions answers at once, without a walk of its
    /// values (planning a rolling window partitioned by it asks).
    #[test]
    fn coordinate_repeats_answers_a_huge_index_without_walking_it() {
        let started = std::time::Instant::now();
        let huge = GridTable::of_coordinate(Coordinate::Index(1 << 40));
        assert!(!coordinate_repeats(&huge, 0).unwrap());
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
    }

    #[test]
    fn coordinate_repeats_finds_equal_values_nulls_and_nans() {
        let values = |v: Vec<Option<f64>>| Coordinate::Values(Arc::new(Float64Array::from(v)));
        let repeats = |v| coordinate_repeats(&GridTable::of_coordinate(values(v)), 0).unwrap();
        assert!(!repeats(vec![Some(1.0), Some(2.0), Some(3.0)]));
        assert!(!repeats(vec![Some(3.0), Some(2.0), Some(-1.0)]));
        assert!(repeats(vec![Some(1.0), Some(2.0), Some(1.0)]));
        assert!(repeats(vec![Some(1.0), None, None]));
        // One NaN is one group of its own; two are one group.
        assert!(!repeats(vec![Some(1.0), Some(f64::NAN), Some(2.0)]));
        assert!(repeats(vec![Some(f64::NAN), Some(2.0), Some(f64::NAN)]));
        assert!(repeats(vec![Some(-0.0), Some(1.0), Some(0.0)]));
    }

    #[test]
    fn factorize_of_sorted_runs_numbers_them_in_order() {
        let day: ArrayRef = Arc::new(Int64Array::from(vec![5, 5, 5, 6, 6, 9]));
        let keys = DimKeys::factorize(&[day], 6).unwrap();
        assert_eq!(keys.map.keys, vec![0, 0, 0, 1, 1, 2]);
        assert_eq!(keys.map.count, 3);
    }
}

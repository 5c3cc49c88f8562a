//! Filter pushdown: predicates on dimensions become index ranges.
//!
//! A filter conjunct that references exactly one dimension column (and
//! otherwise only literals and deterministic functions) is evaluated by
//! DataFusion itself over that dimension's coordinate values, so the
//! selected indices follow SQL semantics exactly: casts, timestamps,
//! `BETWEEN`, `IN`, `OR`, descending coordinates, functions. Such filters are
//! `Exact`: whole blocks outside them are never read, edge chunks are
//! sliced, and DataFusion does not evaluate them again.

use std::ops::Range;
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, BooleanArray, RecordBatch};
use datafusion::arrow::compute::concat;
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::catalog::Session;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{internal_err, Column, DFSchema, Result};
use datafusion::logical_expr::{Expr, TableProviderFilterPushDown};

use super::coordinate::Coordinate;
use super::dataset::GridTable;

/// The selected indices of each dimension, as sorted, disjoint ranges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    ranges: Vec<Vec<Range<u64>>>,
}

impl Selection {
    /// Everything in a grid of `shape`.
    pub fn all(shape: &[u64]) -> Self {
        Self {
            ranges: shape
                .iter()
                .map(|n| std::iter::once(0..*n).collect())
                .collect(),
        }
    }

    /// Ranges selected along dimension `d`.
    pub fn ranges(&self, d: usize) -> &[Range<u64>] {
        &self.ranges[d]
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.ranges.len()
    }

    /// Number of selected cells.
    pub fn num_cells(&self) -> u64 {
        self.ranges
            .iter()
            .map(|r| r.iter().map(|r| r.end - r.start).sum::<u64>())
            .product()
    }

    /// The smallest box holding the selection, or `None` when nothing is selected.
    pub fn bounding_box(&self) -> Option<Vec<Range<u64>>> {
        self.ranges
            .iter()
            .map(|r| Some(r.first()?.start..r.last()?.end))
            .collect()
    }

    /// This selection with only index `k` selected along dimension `d`.
    pub fn only(mut self, d: usize, k: u64) -> Self {
        self.ranges[d] = std::iter::once(k..k + 1).collect();
        self
    }

    /// Replaces the selected ranges of dimension `d` (sorted, disjoint).
    #[cfg(test)]
    pub(crate) fn restrict_ranges(&mut self, d: usize, ranges: Vec<Range<u64>>) {
        self.ranges[d] = ranges;
    }

    fn restrict(&mut self, d: usize, mask: &BooleanArray) {
        let keep = |i: u64| mask.is_valid(i as usize) && mask.value(i as usize);
        let mut out = Vec::new();
        for range in &self.ranges[d] {
            let mut start = None;
            for i in range.clone() {
                match (keep(i), start) {
                    (true, None) => start = Some(i),
                    (false, Some(s)) => {
                        out.push(s..i);
                        start = None;
                    }
                    _ => {}
                }
            }
            if let Some(s) = start {
                out.push(s..range.end);
            }
        }
        self.ranges[d] = out;
    }
}

/// The dimension a filter is about, if it references exactly one dimension
/// column and nothing volatile.
pub(crate) fn single_dimension(filter: &Expr, table: &GridTable) -> Option<usize> {
    if filter.is_volatile() {
        return None;
    }
    let refs = filter.column_refs();
    let mut names = refs.iter().map(|c| c.name.as_str());
    let first = names.next()?;
    if names.any(|n| n != first) {
        return None;
    }
    table.dims.iter().position(|d| d.name == first)
}

/// How each filter is pushed down: `Exact` for single-dimension filters.
pub fn classify_filters(filters: &[&Expr], table: &GridTable) -> Vec<TableProviderFilterPushDown> {
    filters
        .iter()
        .map(|f| match single_dimension(f, table) {
            Some(_) => TableProviderFilterPushDown::Exact,
            None => TableProviderFilterPushDown::Unsupported,
        })
        .collect()
}

/// Evaluates the pushed-down filters over the coordinates.
pub fn select(filters: &[Expr], table: &GridTable, session: &dyn Session) -> Result<Selection> {
    let mut selection = Selection::all(&table.shape());
    for filter in filters {
        let Some(d) = single_dimension(filter, table) else {
            continue;
        };
        let dim = &table.dims[d];
        let schema = Arc::new(Schema::new(vec![Field::new(
            &dim.name,
            dim.coordinate.data_type(),
            true,
        )]));
        let unqualified = filter
            .clone()
            .transform(|e| {
                Ok(match e {
                    Expr::Column(c) => {
                        Transformed::yes(Expr::Column(Column::new_unqualified(c.name)))
                    }
                    other => Transformed::no(other),
                })
            })?
            .data;
        let df_schema = DFSchema::try_from(Arc::clone(&schema))?;
        let predicate = session.create_physical_expr(unqualified, &df_schema)?;
        // A piece of the coordinate at a time, so that a coordinate held
        // as its formula is never made whole.
        let mut masks: Vec<ArrayRef> = Vec::new();
        for piece in dim.coordinate.pieces(Coordinate::PIECE) {
            let batch = RecordBatch::try_new(Arc::clone(&schema), vec![piece?])?;
            let result = predicate.evaluate(&batch)?.into_array(batch.num_rows())?;
            if result.data_type() != &DataType::Boolean {
                return internal_err!("filter {filter} did not evaluate to booleans");
            }
            masks.push(result);
        }
        let parts: Vec<&dyn Array> = masks.iter().map(|m| m.as_ref()).collect();
        let mask = match parts.as_slice() {
            [] => Arc::new(BooleanArray::from(Vec::<bool>::new())) as ArrayRef,
            [one] => one.slice(0, one.len()),
            _ => concat(&parts)?,
        };
        selection.restrict(d, mask.as_boolean());
    }
    Ok(selection)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restrict_builds_ranges() {
        let mut s = Selection::all(&[6, 3]);
        let mask = BooleanArray::from(vec![
            Some(true),
            Some(true),
            Some(false),
            None,
            Some(true),
            Some(true),
        ]);
        s.restrict(0, &mask);
        assert_eq!(s.ranges(0), &[0..2, 4..6]);
        assert_eq!(s.num_cells(), 12);
        assert_eq!(s.bounding_box(), Some(vec![0..6, 0..3]));
        s.restrict(1, &BooleanArray::from(vec![false, false, false]));
        assert_eq!(s.num_cells(), 0);
        assert_eq!(s.bounding_box(), None);
    }
}

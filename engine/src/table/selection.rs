//! Filter pushdown: predicates on dimensions become index ranges.
//!
//! A filter conjunct that references exactly one dimension column (and
//! otherwise only literals and deterministic functions) is evaluated by
//! DataFusion itself over that dimension's coordinate values, so the
//! selected indices follow SQL semantics exactly: casts, timestamps,
//! `BETWEEN`, `IN`, `OR`, descending coordinates, functions. Such filters are
//! `Exact`: whole blocks outside them are never read, edge chunks are
//! sliced, and DataFusion does not evaluate them again.
//!
//! Going through every value is bounded: a dimension longer than
//! [`EVALUATED_POSITIONS`] (a dimension of 10^12 positions without a
//! coordinate array, a regular axis held as its formula) is filtered here
//! only when its values are ordered by construction and the filter only
//! compares the dimension with literals (`=`, `<`, `BETWEEN`, `IN`, joined
//! by `AND`, `OR`, `NOT`): such a filter can change its answer only where
//! the values cross one of its literals, so each crossing is found by
//! bisection and the filter is evaluated once between two crossings.
//! Other filters on such a dimension are not pushed down: DataFusion
//! evaluates them on the rows, a batch at a time, as it does any filter.

use std::ops::Range;
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, BooleanArray, RecordBatch};
use datafusion::arrow::compute::concat;
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::catalog::Session;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{
    human_readable_size, internal_err, resources_err, Column, DFSchema, Result,
};
use datafusion::execution::memory_pool::MemoryLimit;
use datafusion::logical_expr::execution_props::ExecutionProps;
use datafusion::logical_expr::expr::{Between, BinaryExpr, Cast, InList, TryCast};
use datafusion::logical_expr::physical_planning_context::PhysicalPlanningContext;
use datafusion::logical_expr::simplify::SimplifyContext;
use datafusion::logical_expr::{Expr, Operator, TableProviderFilterPushDown};
use datafusion::optimizer::simplify_expressions::ExprSimplifier;
use datafusion::physical_expr::{create_physical_expr, PhysicalExpr};

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

    /// The selection of `ranges` (per dimension: sorted, not overlapping,
    /// not empty, within `shape`), as another process sent it; an error
    /// says what does not hold.
    pub fn from_ranges(
        ranges: Vec<Vec<Range<u64>>>,
        shape: &[u64],
    ) -> std::result::Result<Self, String> {
        if ranges.len() != shape.len() {
            return Err(format!(
                "a selection of {} dimensions over a grid of {}",
                ranges.len(),
                shape.len()
            ));
        }
        for (d, (runs, &len)) in ranges.iter().zip(shape).enumerate() {
            let mut end = 0u64;
            for (i, r) in runs.iter().enumerate() {
                if r.start >= r.end || r.end > len || (i > 0 && r.start < end) {
                    return Err(format!(
                        "dimension {d}: range {}..{} is empty, out of 0..{len} or overlaps \
                         the one before it",
                        r.start, r.end
                    ));
                }
                end = r.end;
            }
        }
        Ok(Self { ranges })
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

    /// This selection with, along dimension `d`, only its selected indices
    /// numbered `compact` (counting the selected indices in order from 0).
    pub fn positions(mut self, d: usize, compact: Range<u64>) -> Self {
        let mut out = Vec::new();
        let mut first = 0u64;
        for r in &self.ranges[d] {
            let len = r.end - r.start;
            let (start, end) = (compact.start.max(first), compact.end.min(first + len));
            if start < end {
                out.push(r.start + (start - first)..r.start + (end - first));
            }
            first += len;
        }
        self.ranges[d] = out;
        self
    }

    /// Replaces the selected ranges of dimension `d` (sorted, disjoint).
    #[cfg(test)]
    pub(crate) fn restrict_ranges(&mut self, d: usize, ranges: Vec<Range<u64>>) {
        self.ranges[d] = ranges;
    }

    /// Keeps, along dimension `d`, only what `keep` (sorted, disjoint)
    /// also selects.
    fn restrict_to(&mut self, d: usize, keep: &[Range<u64>]) {
        let mut out = Vec::new();
        let mut k = keep.iter().peekable();
        for range in &self.ranges[d] {
            while let Some(other) = k.peek() {
                let (start, end) = (range.start.max(other.start), range.end.min(other.end));
                if start < end {
                    out.push(start..end);
                }
                if other.end > range.end {
                    break;
                }
                k.next();
            }
        }
        self.ranges[d] = out;
    }
}

/// Positions of a dimension beyond which a filter is not evaluated over
/// every value (see the module docs): 2^26, a fraction of a second for a
/// comparison.
pub const EVALUATED_POSITIONS: u64 = 1 << 26;

/// Literals a filter on a long dimension may compare it with: each costs
/// two bisections of the dimension.
const MAX_CROSSING_LITERALS: usize = 1024;

/// The dimension a filter is about, if it references exactly one dimension
/// column and nothing volatile.
fn single_dimension(filter: &Expr, table: &GridTable) -> Option<usize> {
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

/// The dimension a filter selects positions of, when it is pushed down:
/// a filter on one dimension that is short enough to go through, or whose
/// values are ordered and which only compares them with literals.
pub(crate) fn pushed_dimension(filter: &Expr, table: &GridTable) -> Option<usize> {
    pushed_within(filter, table, EVALUATED_POSITIONS)
}

/// [`pushed_dimension`] with dimensions of up to `evaluated` positions
/// gone through.
fn pushed_within(filter: &Expr, table: &GridTable, evaluated: u64) -> Option<usize> {
    let d = single_dimension(filter, table)?;
    let coordinate = &table.dims[d].coordinate;
    let pushed = coordinate.len() <= evaluated
        || (coordinate.monotone()
            && crossing_literals(filter, &coordinate.data_type())
                .is_some_and(|l| l.len() <= MAX_CROSSING_LITERALS));
    pushed.then_some(d)
}

/// Why a filter on one dimension of `table` is not pushed down, when that
/// is the dimension's length (longer than `EVALUATED_POSITIONS`, and the
/// filter is not a comparison with literals over ordered values); `None`
/// when it is pushed down or not about one dimension.
pub fn long_dimension_refusal(filter: &Expr, table: &GridTable) -> Option<String> {
    let d = single_dimension(filter, table)?;
    if pushed_dimension(filter, table).is_some() {
        return None;
    }
    let dim = &table.dims[d];
    let ordered = if dim.coordinate.monotone() {
        ""
    } else {
        " (and its values are not ordered by construction: an index or a regular coordinate)"
    };
    Some(format!(
        "'{}' has {} positions, more than the {EVALUATED_POSITIONS} a condition is evaluated over; \
         over it only comparisons with literals are applied (=, <>, <, <=, >, >=, BETWEEN, IN; \
         at most {MAX_CROSSING_LITERALS} literals){ordered}",
        dim.name,
        dim.coordinate.len()
    ))
}

/// How each filter is pushed down: `Exact` for the filters
/// `pushed_dimension` takes.
pub fn classify_filters(filters: &[&Expr], table: &GridTable) -> Vec<TableProviderFilterPushDown> {
    filters
        .iter()
        .map(|f| match pushed_dimension(f, table) {
            Some(_) => TableProviderFilterPushDown::Exact,
            None => TableProviderFilterPushDown::Unsupported,
        })
        .collect()
}

/// Evaluates the pushed-down filters over the coordinates.
pub fn select(filters: &[Expr], table: &GridTable, session: &dyn Session) -> Result<Selection> {
    let limit = match session.runtime_env().memory_pool.memory_limit() {
        MemoryLimit::Finite(limit) => Some(limit),
        _ => None,
    };
    let compile = |e: Expr, schema: &DFSchema| session.create_physical_expr(e, schema);
    select_within(filters, table, &compile, limit, EVALUATED_POSITIONS)
}

/// [`select`] while the logical plan is optimized (without a session: no
/// memory limit to check the selection's size against), for operators
/// that size their state by the positions selected.
pub fn select_planning(
    filters: &[Expr],
    table: &GridTable,
    props: &ExecutionProps,
) -> Result<Selection> {
    let compile = |e: Expr, schema: &DFSchema| {
        // Types coerced as a session does (a literal against the column).
        let context = SimplifyContext::builder()
            .with_schema(Arc::new(schema.clone()))
            .build();
        let e = ExprSimplifier::new(context).coerce(e, schema)?;
        create_physical_expr(&e, schema, props, &PhysicalPlanningContext::default())
    };
    select_within(filters, table, &compile, None, EVALUATED_POSITIONS)
}

/// A filter (over one column) made a physical expression.
type Compile<'a> = dyn Fn(Expr, &DFSchema) -> Result<Arc<dyn PhysicalExpr>> + 'a;

/// [`select`] with dimensions of up to `evaluated` positions gone through,
/// the filters compiled by `compile`, the ranges of positions held
/// checked against `limit`.
fn select_within(
    filters: &[Expr],
    table: &GridTable,
    compile: &Compile,
    limit: Option<usize>,
    evaluated: u64,
) -> Result<Selection> {
    let mut selection = Selection::all(&table.shape());
    for filter in filters {
        let Some(d) = pushed_within(filter, table, evaluated) else {
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
        let predicate = compile(unqualified.clone(), &df_schema)?;
        if dim.coordinate.len() > evaluated {
            let Some(literals) = crossing_literals(&unqualified, &dim.coordinate.data_type())
            else {
                return internal_err!("filter {filter} cannot be bisected");
            };
            let crossings = Crossings {
                coordinate: &dim.coordinate,
                schema,
            };
            let mut cuts = vec![0, dim.coordinate.len()];
            for (side, literal) in literals {
                for op in [Operator::Lt, Operator::LtEq] {
                    let compared = Expr::BinaryExpr(BinaryExpr::new(
                        Box::new(side.clone()),
                        op,
                        Box::new(literal.clone()),
                    ));
                    let compared = compile(compared, &df_schema)?;
                    cuts.extend(crossings.switch(&compared)?);
                }
            }
            let kept = crossings.ranges(&predicate, cuts, filter)?;
            selection.restrict_to(d, &kept);
            continue;
        }
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
        // NULL selects nothing; each run of selected positions is a range.
        let mask = mask.as_boolean();
        let mask = match mask.nulls() {
            Some(valid) => mask.values() & valid.inner(),
            None => mask.values().clone(),
        };
        let runs = mask.set_slices().count();
        let bytes = runs.saturating_mul(std::mem::size_of::<Range<u64>>());
        if let Some(limit) = limit {
            if bytes > limit / 8 {
                return resources_err!(
                    "the filter {filter} on '{}' of {} selects {runs} separate runs of positions, \
                     {} to hold, over an eighth of allowed_mem ({}); filter on a coarser \
                     condition (a range) or raise allowed_mem",
                    dim.name,
                    table.store,
                    human_readable_size(bytes),
                    human_readable_size(limit)
                );
            }
        }
        let kept: Vec<Range<u64>> = mask
            .set_slices()
            .map(|(start, end)| start as u64..end as u64)
            .collect();
        selection.restrict_to(d, &kept);
    }
    Ok(selection)
}

/// The (dimension side, literal) pairs of a filter made only of
/// comparisons of its one column, or a widening cast of it, with literals
/// (or expressions of literals), joined by `AND`, `OR` and `NOT`; `None`
/// for any other filter.
fn crossing_literals(filter: &Expr, data_type: &DataType) -> Option<Vec<(Expr, Expr)>> {
    fn side(e: &Expr, data_type: &DataType) -> bool {
        match e {
            Expr::Column(_) => true,
            Expr::Cast(Cast { expr, field }) | Expr::TryCast(TryCast { expr, field }) => {
                matches!(expr.as_ref(), Expr::Column(_)) && widens(data_type, field.data_type())
            }
            _ => false,
        }
    }
    fn walk(e: &Expr, data_type: &DataType, out: &mut Vec<(Expr, Expr)>) -> bool {
        // A literal, or any expression of literals (a cast NULL, a
        // computed time): the same for every row.
        let literal = |e: &Expr| e.column_refs().is_empty() && !e.is_volatile();
        match e {
            Expr::BinaryExpr(BinaryExpr { left, op, right }) => match op {
                Operator::And | Operator::Or => {
                    walk(left, data_type, out) && walk(right, data_type, out)
                }
                Operator::Eq
                | Operator::NotEq
                | Operator::Lt
                | Operator::LtEq
                | Operator::Gt
                | Operator::GtEq => {
                    let (s, l) = match (side(left, data_type), side(right, data_type)) {
                        (true, false) => (left, right),
                        (false, true) => (right, left),
                        _ => return false,
                    };
                    literal(l) && {
                        out.push((s.as_ref().clone(), l.as_ref().clone()));
                        true
                    }
                }
                _ => false,
            },
            Expr::Not(inner) => walk(inner, data_type, out),
            Expr::Between(Between {
                expr, low, high, ..
            }) => {
                side(expr, data_type) && literal(low) && literal(high) && {
                    out.push((expr.as_ref().clone(), low.as_ref().clone()));
                    out.push((expr.as_ref().clone(), high.as_ref().clone()));
                    true
                }
            }
            Expr::InList(InList { expr, list, .. }) => {
                side(expr, data_type) && list.iter().all(literal) && {
                    out.extend(list.iter().map(|l| (expr.as_ref().clone(), l.clone())));
                    true
                }
            }
            _ => false,
        }
    }
    let mut out = Vec::new();
    walk(filter, data_type, &mut out).then_some(out)
}

/// Whether a cast from `from` to `to` keeps the order of values (equal
/// values may become equal, none swap): integers to a type that holds
/// them or to `Float64`, `Float32` to `Float64`, times to other units.
fn widens(from: &DataType, to: &DataType) -> bool {
    use DataType::*;
    match (from, to) {
        (a, b) if a == b => true,
        (Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32, Int64) => true,
        (Int8 | Int16 | UInt8, Int32) | (Int8 | UInt8, Int16) => true,
        (UInt8 | UInt16 | UInt32 | UInt64, UInt64) => true,
        (a, Float64) if a.is_integer() || a == &Float32 => true,
        (Timestamp(_, a), Timestamp(_, b)) => a == b,
        _ => false,
    }
}

/// Bisection over an ordered coordinate.
struct Crossings<'a> {
    coordinate: &'a Coordinate,
    schema: SchemaRef,
}

impl Crossings<'_> {
    /// `predicate` at `position` (`None`: NULL).
    fn at(&self, predicate: &Arc<dyn PhysicalExpr>, position: u64) -> Result<Option<bool>> {
        let one = self.coordinate.slice(position, 1)?;
        let batch = RecordBatch::try_new(Arc::clone(&self.schema), vec![one])?;
        let value = predicate.evaluate(&batch)?.into_array(1)?;
        let Some(value) = value.as_boolean_opt() else {
            return internal_err!("a filter did not evaluate to booleans");
        };
        Ok(value.is_valid(0).then(|| value.value(0)))
    }

    /// Where a comparison that changes at most once along the coordinate
    /// changes: the first position whose answer differs from the first's.
    fn switch(&self, compared: &Arc<dyn PhysicalExpr>) -> Result<Option<u64>> {
        let n = self.coordinate.len();
        if n == 0 {
            return Ok(None);
        }
        let first = self.at(compared, 0)?;
        if self.at(compared, n - 1)? == first {
            return Ok(None);
        }
        let (mut same, mut differs) = (0, n - 1);
        while differs - same > 1 {
            let middle = same + (differs - same) / 2;
            if self.at(compared, middle)? == first {
                same = middle;
            } else {
                differs = middle;
            }
        }
        Ok(Some(differs))
    }

    /// The ranges `predicate` holds on, given positions `cuts` between
    /// which it cannot change: evaluated at both ends of each stretch.
    fn ranges(
        &self,
        predicate: &Arc<dyn PhysicalExpr>,
        mut cuts: Vec<u64>,
        filter: &Expr,
    ) -> Result<Vec<Range<u64>>> {
        cuts.sort_unstable();
        cuts.dedup();
        let mut kept: Vec<Range<u64>> = Vec::new();
        for stretch in cuts.windows(2) {
            let (start, end) = (stretch[0], stretch[1]);
            let holds = self.at(predicate, start)?;
            if self.at(predicate, end - 1)? != holds {
                return internal_err!(
                    "filter {filter} changes between positions {start} and {} of an ordered dimension",
                    end - 1
                );
            }
            if holds == Some(true) {
                match kept.last_mut() {
                    Some(last) if last.end == start => last.end = end,
                    _ => kept.push(start..end),
                }
            }
        }
        Ok(kept)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use datafusion::arrow::array::{Float32Array, Int64Array, TimestampSecondArray};
    use datafusion::logical_expr::simplify::SimplifyContext;
    use datafusion::optimizer::simplify_expressions::ExprSimplifier;
    use datafusion::prelude::SessionContext;

    use super::super::regular::RegularCoordinateCheck;

    /// `values` held as their formula.
    fn regular(values: ArrayRef) -> Coordinate {
        let n = values.len();
        let mut check =
            RegularCoordinateCheck::new(&values.slice(0, 8), &values.slice(n - 1, 1), n as u64)
                .unwrap();
        assert!(check.check(&values));
        let regular = check.finish().unwrap();
        assert!(regular.monotone());
        Coordinate::Regular(Arc::new(regular))
    }

    /// `sql` as the filter a scan receives: parsed and type-coerced
    /// against the table's schema.
    fn filter(table: &GridTable, sql: &str) -> Expr {
        let schema = Arc::new(DFSchema::try_from(Arc::clone(&table.schema)).unwrap());
        let parsed = SessionContext::new().parse_sql_expr(sql, &schema).unwrap();
        let context = SimplifyContext::builder()
            .with_schema(Arc::clone(&schema))
            .build();
        ExprSimplifier::new(context)
            .coerce(parsed, &schema)
            .unwrap()
    }

    /// Bisecting between literals selects what evaluating every value
    /// selects, for comparisons of every kind on ascending, descending and
    /// repeating coordinates, integers, floats and times.
    #[test]
    fn bisection_selects_what_evaluation_selects() {
        let state = SessionContext::new().state();
        let n = 1000i64;
        let floats: Vec<f32> = (0..n).map(|i| 90.0 - 0.25 * i as f32).collect();
        let coordinates: Vec<(Coordinate, Vec<&str>)> = vec![
            (
                Coordinate::Index(n as u64),
                vec!["-1", "0", "5", "499", "999", "1000", "2.5", "NULL"],
            ),
            (
                regular(Arc::new(Int64Array::from_iter_values(
                    (0..n).map(|i| 7 - 3 * i),
                ))),
                vec!["7", "6", "-2", "-500", "-2990", "-2992", "-3000", "0.5"],
            ),
            (
                regular(Arc::new(Float32Array::from(floats))),
                vec!["90", "89.9", "45.25", "0", "-0.0", "-159.75", "-160", "1e9"],
            ),
            (
                regular(Arc::new(TimestampSecondArray::from_iter_values(
                    (0..n).map(|i| 1_600_000_000 + 3600 * i),
                ))),
                vec![
                    "TIMESTAMP '2020-09-13 12:26:40'",
                    "TIMESTAMP '2020-09-20 00:00:00'",
                    "TIMESTAMP '2020-10-01 00:00:00'",
                    "TIMESTAMP '2030-01-01 00:00:00'",
                ],
            ),
        ];
        for (coordinate, literals) in coordinates {
            let table = GridTable::of_coordinate(coordinate);
            let mut sqls = Vec::new();
            for (i, a) in literals.iter().enumerate() {
                let b = literals[(i * 3 + 1) % literals.len()];
                for op in ["=", "<>", "<", "<=", ">", ">="] {
                    sqls.push(format!("x {op} {a}"));
                    sqls.push(format!("{a} {op} x"));
                }
                sqls.push(format!("x BETWEEN {a} AND {b}"));
                sqls.push(format!("x NOT BETWEEN {b} AND {a}"));
                sqls.push(format!("x IN ({a}, {b})"));
                sqls.push(format!("x NOT IN ({a}, {b})"));
                sqls.push(format!("NOT (x < {a}) AND (x < {b} OR x = {a})"));
                sqls.push(format!("x > {a} OR x < {b}"));
            }
            for sql in sqls {
                let f = filter(&table, &sql);
                assert_eq!(
                    pushed_within(&f, &table, 0),
                    Some(0),
                    "{sql} is not bisected"
                );
                let compile = |e: Expr, schema: &DFSchema| state.create_physical_expr(e, schema);
                let one = std::slice::from_ref(&f);
                let evaluated = select_within(one, &table, &compile, None, u64::MAX);
                let bisected = select_within(one, &table, &compile, None, 0);
                match (evaluated, bisected) {
                    (Ok(e), Ok(b)) => assert_eq!(e, b, "{sql} over {:?}", table.dims[0].coordinate),
                    (Err(_), Err(_)) => {}
                    (e, b) => panic!("{sql}: evaluated {e:?}, bisected {b:?}"),
                }
            }
        }
    }

    /// A filter selecting runs too many to hold in allowed_mem is refused
    /// with the numbers; without a limit, every run is kept.
    #[test]
    fn runs_over_allowed_mem_are_refused_with_the_numbers() {
        use datafusion::execution::runtime_env::RuntimeEnvBuilder;
        use datafusion::prelude::SessionConfig;
        let table = GridTable::of_coordinate(Coordinate::Index(1 << 20));
        let f = filter(&table, "x % 2 = 0");
        let unlimited = select(
            std::slice::from_ref(&f),
            &table,
            &SessionContext::new().state(),
        );
        assert_eq!(unlimited.unwrap().ranges(0).len(), 1 << 19);
        let runtime = RuntimeEnvBuilder::new()
            .with_memory_limit(16 << 20, 1.0)
            .build_arc()
            .unwrap();
        let limited = SessionContext::new_with_config_rt(SessionConfig::new(), runtime).state();
        let message = select(&[f], &table, &limited).unwrap_err().to_string();
        for needle in [
            "524288 separate runs",
            "'x'",
            "8.0 MB",
            "allowed_mem (16.0 MB)",
        ] {
            assert!(message.contains(needle), "{needle}: {message}");
        }
    }

    /// On a long dimension, filters that are not comparisons with literals
    /// are left to DataFusion; comparisons are bisected at once.
    #[test]
    fn long_dimensions_bisect_comparisons_and_leave_the_rest() {
        let state = SessionContext::new().state();
        let table = GridTable::of_coordinate(Coordinate::Index(1_000_000_000_000));
        for sql in ["x % 7 = 3", "sin(x) > 0.5", "x IN (1, x)", "x IS NULL"] {
            assert_eq!(
                pushed_dimension(&filter(&table, sql), &table),
                None,
                "{sql}"
            );
        }
        let f = filter(
            &table,
            "x IN (5, 999999999999, 1000000000000) OR x BETWEEN 10 AND 12",
        );
        assert_eq!(pushed_dimension(&f, &table), Some(0));
        let started = std::time::Instant::now();
        let selection = select(&[f], &table, &state).unwrap();
        assert_eq!(
            selection.ranges(0),
            &[5..6, 10..13, 999_999_999_999..1_000_000_000_000]
        );
        assert!(started.elapsed().as_secs() < 2, "{:?}", started.elapsed());
    }

    #[test]
    fn restricting_keeps_what_both_select() {
        let mut s = Selection::all(&[20, 3]);
        s.restrict_to(0, &[0..2, 4..9, 12..20]);
        s.restrict_to(0, &[1..5, 8..13, 15..16, 19..30]);
        assert_eq!(s.ranges(0), &[1..2, 4..5, 8..9, 12..13, 15..16, 19..20]);
        assert_eq!(s.num_cells(), 18);
        assert_eq!(s.bounding_box(), Some(vec![1..20, 0..3]));
        s.restrict_to(1, &[]);
        assert_eq!(s.num_cells(), 0);
        assert_eq!(s.bounding_box(), None);
    }

    #[test]
    fn positions_keep_the_selected_indices_so_numbered() {
        let mut s = Selection::all(&[20, 3]);
        s.restrict_to(0, &[1..4, 6..7, 10..15]);
        // Numbered 0..9: 1 2 3 | 6 | 10 11 12 13 14.
        let naive = |compact: Range<u64>| -> Vec<u64> {
            let all: Vec<u64> = s.ranges(0).iter().flat_map(|r| r.clone()).collect();
            (compact.start as usize..(compact.end as usize).min(all.len()))
                .map(|i| all[i])
                .collect()
        };
        for start in 0..10 {
            for end in start..11 {
                let kept = s.clone().positions(0, start..end);
                let got: Vec<u64> = kept.ranges(0).iter().flat_map(|r| r.clone()).collect();
                assert_eq!(got, naive(start..end), "positions {start}..{end}");
                assert_eq!(kept.ranges(1), Selection::all(&[20, 3]).ranges(1));
            }
        }
        assert_eq!(
            s.clone().positions(0, 2..5).ranges(0),
            &[3..4, 6..7, 10..11]
        );
    }
}

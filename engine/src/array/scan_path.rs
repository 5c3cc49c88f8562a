//! Seeing through a logical plan down to the Zarr table scan it reads.
//!
//! The optimizer rules that turn plain SQL into array operations match a
//! Zarr table scan under any projections, aliases and filters. A
//! [`ScanPath`] is that walk: the scan, its table, the filters met on the
//! way, and expressions over the plan's output rewritten over the scan's
//! columns. A [`TableRead`] is where the walk ends for a leaf array node:
//! the table, the columns its expressions are over and the dimension
//! filters. A scan of `rechunk(...)` ([`RechunkTable`]) ends a walk where
//! an operator can read the rechunked store ([`down_to_scan_or_rechunk`]).

use std::any::Any;
use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use datafusion::catalog::Session;
use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode};
use datafusion::common::{Column, DFSchema, DFSchemaRef, Result, TableReference};
use datafusion::datasource::{provider_as_source, source_as_provider};
use datafusion::logical_expr::utils::conjunction;
use datafusion::logical_expr::{
    Expr, Filter, Join, LogicalPlan, Projection, SubqueryAlias, TableScan, TableScanBuilder,
};

use super::rechunk::RechunkTable;
use crate::table::{
    select, BlockGrid, BlockRead, BlockTemporaries, GridTable, Selection, ZarrTable,
};

/// A plan's way down to a Zarr table scan.
pub(crate) struct ScanPath<'a> {
    /// The scan at the bottom (without a `LIMIT`).
    pub scan: &'a TableScan,
    /// The scanned table (of a `rechunk(...)`: its source).
    pub table: ZarrTable,
    /// The `rechunk(...)` scanned, if the scan is of one.
    pub rechunk: Option<Arc<RechunkTable>>,
    /// The expressions asked for, over the scan's columns.
    pub exprs: Vec<Expr>,
    /// The filters met on the way, over the scan's columns.
    pub predicates: Vec<Expr>,
}

/// Walks `plan` down to a Zarr table scan through projections, aliases and
/// filters, rewriting `exprs` (over `plan`'s output) as it goes; `None`
/// when something else is in the way, the scan has a `LIMIT`, or an
/// expression is volatile or holds a subquery.
pub(crate) fn down_to_scan(plan: &LogicalPlan, exprs: Vec<Expr>) -> Result<Option<ScanPath<'_>>> {
    walk_down(plan, exprs, false)
}

/// [`down_to_scan`], also ending at a scan of `rechunk(...)`: for an
/// operator that reads the rechunked store (its table has the source's
/// dimensions, coordinates and columns) after the copy.
pub(crate) fn down_to_scan_or_rechunk(
    plan: &LogicalPlan,
    exprs: Vec<Expr>,
) -> Result<Option<ScanPath<'_>>> {
    walk_down(plan, exprs, true)
}

fn walk_down(
    plan: &LogicalPlan,
    exprs: Vec<Expr>,
    rechunked: bool,
) -> Result<Option<ScanPath<'_>>> {
    let mut exprs = exprs;
    let mut predicates: Vec<Expr> = Vec::new();
    let mut input = plan;
    let scan = loop {
        let rewrite: Box<dyn Fn(Expr) -> Result<Expr>> = match input {
            LogicalPlan::Projection(p) => Box::new(move |e| inline_projection(e, p)),
            LogicalPlan::SubqueryAlias(a) => Box::new(move |e| inline_alias(e, a)),
            LogicalPlan::Filter(f) => {
                predicates.push(f.predicate.clone());
                input = f.input.as_ref();
                continue;
            }
            LogicalPlan::TableScan(scan) => break scan,
            _ => return Ok(None),
        };
        exprs = exprs.into_iter().map(&rewrite).collect::<Result<_>>()?;
        predicates = predicates
            .into_iter()
            .map(&rewrite)
            .collect::<Result<_>>()?;
        input = match input {
            LogicalPlan::Projection(p) => p.input.as_ref(),
            LogicalPlan::SubqueryAlias(a) => a.input.as_ref(),
            _ => unreachable!("only projections and aliases are rewritten through"),
        };
    };
    if scan.fetch.is_some() {
        return Ok(None);
    }
    let Ok(provider) = source_as_provider(&scan.source) else {
        return Ok(None);
    };
    let provider: &dyn Any = provider.as_ref();
    let (table, rechunk) = match provider.downcast_ref::<RechunkTable>() {
        Some(r) if rechunked => (r.source().clone(), Some(Arc::new(r.clone()))),
        _ => match provider.downcast_ref::<ZarrTable>() {
            Some(table) => (table.clone(), None),
            None => return Ok(None),
        },
    };
    if exprs
        .iter()
        .chain(&predicates)
        .any(|e| e.is_volatile() || has_subquery(e))
    {
        return Ok(None);
    }
    Ok(Some(ScanPath {
        scan,
        table,
        rechunk,
        exprs,
        predicates,
    }))
}

/// The names of the columns `exprs` read, sorted, each once (of a read
/// of `rechunk(...)`: the variables its copy copies).
pub(crate) fn column_names<'a>(exprs: impl IntoIterator<Item = &'a Expr>) -> Vec<String> {
    let mut names: Vec<String> = (exprs.into_iter())
        .flat_map(|e| e.column_refs())
        .map(|c| c.name.clone())
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Walks `plan` down through projections and aliases to the first other
/// node, rewriting `exprs` (over `plan`'s output) over that node's output;
/// `None` when an expression is volatile or holds a subquery.
pub(crate) fn through_projections(
    plan: &LogicalPlan,
    exprs: Vec<Expr>,
) -> Result<Option<(&LogicalPlan, Vec<Expr>)>> {
    let mut exprs = exprs;
    let mut input = plan;
    loop {
        (exprs, input) = match input {
            LogicalPlan::Projection(p) => (
                (exprs.into_iter())
                    .map(|e| inline_projection(e, p))
                    .collect::<Result<_>>()?,
                p.input.as_ref(),
            ),
            LogicalPlan::SubqueryAlias(a) => (
                (exprs.into_iter())
                    .map(|e| inline_alias(e, a))
                    .collect::<Result<_>>()?,
                a.input.as_ref(),
            ),
            _ => break,
        };
    }
    if exprs.iter().any(|e| e.is_volatile() || has_subquery(e)) {
        return Ok(None);
    }
    Ok(Some((input, exprs)))
}

fn has_subquery(expr: &Expr) -> bool {
    expr.exists(|e| {
        Ok(matches!(
            e,
            Expr::ScalarSubquery(_)
                | Expr::Exists(_)
                | Expr::InSubquery(_)
                | Expr::OuterReferenceColumn(..)
        ))
    })
    .unwrap_or(true)
}

/// Replaces the columns of `schema` in `expr` by `replace(index)`.
pub(crate) fn replace_columns(
    expr: Expr,
    schema: &DFSchema,
    replace: impl Fn(usize) -> Expr,
) -> Result<Expr> {
    expr.transform(|e| match e {
        Expr::Column(c) => {
            let i = schema.index_of_column(&c)?;
            Ok(Transformed::yes(replace(i)))
        }
        other => Ok(Transformed::no(other)),
    })
    .data()
}

/// A join planned as one scan of `provider` (the aligned zip and the
/// broadcast join): the table scanned as `name` with `filters` pushed in,
/// its rows kept where `predicates` and the join's own condition hold, and
/// projected to `outputs` (over the scan's columns, one per column of the
/// join in its order) named as the join names its columns.
pub(crate) fn join_as_scan(
    join: &Join,
    name: impl Into<TableReference>,
    provider: ZarrTable,
    filters: Vec<Expr>,
    mut predicates: Vec<Expr>,
    outputs: Vec<Expr>,
) -> Result<LogicalPlan> {
    if let Some(filter) = &join.filter {
        // The join's own condition is over both sides' outputs.
        predicates.push(replace_columns(filter.clone(), &join.schema, |i| {
            outputs[i].clone()
        })?);
    }
    let mut seen = HashSet::new();
    predicates.retain(|p| seen.insert(p.clone()));
    let scan = TableScanBuilder::new(name, provider_as_source(Arc::new(provider)))
        .with_filters(filters)
        .build()?;
    let mut input = LogicalPlan::TableScan(scan);
    if let Some(predicate) = conjunction(predicates) {
        input = LogicalPlan::Filter(Filter::try_new(predicate, Arc::new(input))?);
    }
    let exprs = (outputs.into_iter().zip(join.schema.iter()))
        .map(|(e, (qualifier, field))| e.alias_qualified(qualifier.cloned(), field.name()))
        .collect();
    Ok(LogicalPlan::Projection(Projection::try_new(
        exprs,
        Arc::new(input),
    )?))
}

/// `expr` over a projection's output, rewritten over the projection's input.
fn inline_projection(expr: Expr, projection: &Projection) -> Result<Expr> {
    replace_columns(expr, &projection.schema, |i| {
        projection.expr[i].clone().unalias()
    })
}

/// `expr` over an alias's output, rewritten over the aliased plan.
fn inline_alias(expr: Expr, alias: &SubqueryAlias) -> Result<Expr> {
    let inner = alias.input.schema();
    replace_columns(expr, &alias.schema, |i| {
        let (qualifier, field) = inner.qualified_field(i);
        Expr::Column(Column::new(qualifier.cloned(), field.name()))
    })
}

/// What a leaf array node reads, as a logical plan says it: a Zarr table,
/// the schema its expressions are written against (the scan's columns)
/// and the filters on single dimensions that select its cells. The dense
/// reduction, the rolling window and the selection COPY start with one;
/// their operators turn it into a [`BlockRead`](crate::table::BlockRead).
#[derive(Debug, Clone)]
pub struct TableRead {
    /// The table read.
    pub table: Arc<GridTable>,
    /// The schema the expressions are written against.
    pub input_schema: DFSchemaRef,
    /// Filters on single dimensions, evaluated over coordinates.
    pub filters: Vec<Expr>,
    /// When the table is read in new chunks (`rechunk(...)`): the rechunk,
    /// of `table`. The operator reads its store, after the copy.
    pub rechunk: Option<Arc<RechunkTable>>,
}

impl TableRead {
    /// A read of `table` under `filters`, for expressions over
    /// `input_schema`.
    pub fn new(table: &Arc<GridTable>, input_schema: DFSchemaRef, filters: Vec<Expr>) -> Self {
        Self {
            table: Arc::clone(table),
            input_schema,
            filters,
            rechunk: None,
        }
    }

    /// This read in the chunks of `rechunk` (`None`: as stored), a rechunk
    /// of its table.
    pub fn with_rechunk(self, rechunk: Option<Arc<RechunkTable>>) -> Self {
        Self { rechunk, ..self }
    }

    /// This read of `table` (the rechunked store's, once made), in its
    /// chunks.
    pub fn reading(&self, table: &Arc<GridTable>) -> Self {
        Self::new(table, Arc::clone(&self.input_schema), self.filters.clone())
    }

    /// Whether `other` reads the same table (the same open table, not only
    /// the same store) under the same filters, in the same chunks.
    pub fn same_as(&self, other: &Self) -> bool {
        let chunks = |r: &Self| r.rechunk.as_ref().map(|r| r.chunks().to_vec());
        Arc::ptr_eq(&self.table, &other.table)
            && self.filters == other.filters
            && chunks(self) == chunks(other)
    }

    /// The cells the filters select, under the session's settings.
    pub fn select(&self, session: &dyn Session) -> Result<Selection> {
        select(&self.filters, &self.table, session)
    }

    /// The read of `columns` (indices into the table's schema) over the
    /// cells the filters select, in blocks sized for the session's workers
    /// (a share of its memory limit each, beside `temporaries`); with that
    /// limit and the number of workers.
    pub fn block_read(
        &self,
        columns: Vec<usize>,
        session: &dyn Session,
        temporaries: BlockTemporaries,
    ) -> Result<(BlockRead, Option<usize>, usize)> {
        let selection = self.select(session)?;
        let (blocks, memory_limit, parallelism) =
            BlockGrid::for_workers(&self.table, &columns, &selection, session, temporaries);
        let read = BlockRead::new(Arc::clone(&self.table), columns, selection, blocks)?;
        Ok((read, memory_limit, parallelism))
    }

    /// The columns of the input schema that `exprs` read, in its order: a
    /// schema of their fields for planning the expressions, and their
    /// indices in the table's schema (what a block reader decodes).
    pub fn columns_read<'a>(
        &self,
        exprs: impl IntoIterator<Item = &'a Expr>,
    ) -> Result<(DFSchema, Vec<usize>)> {
        let referenced: HashSet<String> = exprs
            .into_iter()
            .flat_map(|e| e.column_refs())
            .map(|c| c.name.clone())
            .collect();
        let mut fields = Vec::new();
        let mut columns = Vec::new();
        for (qualifier, field) in self.input_schema.iter() {
            if referenced.contains(field.name()) {
                fields.push((qualifier.cloned(), Arc::clone(field)));
                columns.push(self.table.schema.index_of(field.name())?);
            }
        }
        Ok((
            DFSchema::new_with_metadata(fields, Default::default())?,
            columns,
        ))
    }

    /// `store=..., dims=[...]`, as the nodes show it.
    pub fn fmt_table(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let dims = self.table.dims_name().replace('_', ", ");
        write!(f, "store={}, dims=[{dims}]", self.table.store)?;
        if let Some(rechunk) = &self.rechunk {
            let chunks: Vec<String> = (rechunk.chunks().iter())
                .map(|(dim, len)| format!("{dim} => {len}"))
                .collect();
            write!(f, ", rechunked=[{}]", chunks.join(", "))?;
        }
        Ok(())
    }

    /// `, dimension_filters=[...]` when there are filters.
    pub fn fmt_filters(&self, f: &mut fmt::Formatter) -> fmt::Result {
        if self.filters.is_empty() {
            return Ok(());
        }
        let filters: Vec<String> = self.filters.iter().map(|e| e.to_string()).collect();
        write!(f, ", dimension_filters=[{}]", filters.join(", "))
    }
}

//! `DenseReduction`: the logical plan node of a reduction over dimensions.

use std::fmt;
use std::hash::Hash;
use std::sync::Arc;

use datafusion::common::DFSchemaRef;
use datafusion::logical_expr::{Expr, UserDefinedLogicalNodeCore};

use super::accumulators::ReduceOp;
use crate::array::scan_path::{column_names, TableRead};
use crate::plan_methods::{leaf_node_methods, node_identity};

/// One aggregate of a reduction.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd)]
pub struct ReduceExpr {
    /// What it computes.
    pub op: ReduceOp,
    /// Its argument over the table's columns (`None`: `count(*)`).
    pub arg: Option<Expr>,
}

impl fmt::Display for ReduceExpr {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match &self.arg {
            Some(arg) => write!(f, "{}({arg})", self.op.name()),
            None => write!(f, "{}(*)", self.op.name()),
        }
    }
}

/// One grouping column of a reduction: a dimension, or a deterministic
/// function of its coordinate alone (see `keys`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd)]
pub struct GroupKey {
    /// The dimension (index into the table's dimensions).
    pub dim: usize,
    /// The function of its column (`None`: the column itself).
    pub expr: Option<Expr>,
}

/// `GROUP BY` some dimensions of a Zarr table (or functions of their
/// coordinates), as a dense array reduction.
///
/// A leaf node: it reads the table itself. `filters` are the pushed-down
/// dimension filters (they shrink the selection, as in a scan);
/// `predicate` is any other row filter, evaluated per row.
#[derive(Debug, Clone)]
pub struct DenseReduction {
    /// The table reduced, the columns the expressions are over, and the
    /// filters on single dimensions.
    pub read: TableRead,
    /// A row filter evaluated over the cells, if any.
    pub predicate: Option<Expr>,
    /// What is grouped by, in the order of the output columns.
    pub groups: Vec<GroupKey>,
    /// The aggregates, in the order of the output columns.
    pub aggregates: Vec<ReduceExpr>,
    /// Output: the group columns, then the aggregates.
    pub schema: DFSchemaRef,
}

impl DenseReduction {
    /// The expressions it evaluates over the table's columns: the
    /// aggregates' arguments, then the predicate.
    pub fn exprs(&self) -> impl Iterator<Item = &Expr> {
        (self.aggregates.iter())
            .filter_map(|a| a.arg.as_ref())
            .chain(self.predicate.as_ref())
    }

    /// The columns its expressions read (not its keys, which are
    /// dimensions), by name.
    pub fn variables(&self) -> Vec<String> {
        column_names(self.exprs())
    }

    fn key(&self) -> (&Vec<Expr>, &Option<Expr>, &Vec<GroupKey>, &Vec<ReduceExpr>) {
        let filters = &self.read.filters;
        (filters, &self.predicate, &self.groups, &self.aggregates)
    }
}

node_identity!(
    DenseReduction,
    eq: |a, b| a.read.same_as(&b.read) && a.key() == b.key() && a.schema == b.schema,
    hash: |node, mut state| (&node.read.table.store, node.key()).hash(&mut state),
    cmp: |a, b| match Arc::ptr_eq(&a.read.table, &b.read.table) {
        true => a.key().partial_cmp(&b.key()),
        false => None,
    }
);

impl UserDefinedLogicalNodeCore for DenseReduction {
    leaf_node_methods!("DenseReduction");

    fn fmt_for_explain(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let group: Vec<String> = self
            .groups
            .iter()
            .map(|g| match &g.expr {
                Some(expr) => expr.to_string(),
                None => self.read.table.dims[g.dim].name.clone(),
            })
            .collect();
        let aggregates: Vec<String> = self.aggregates.iter().map(|a| a.to_string()).collect();
        write!(f, "DenseReduction: ")?;
        self.read.fmt_table(f)?;
        let (group, aggregates) = (group.join(", "), aggregates.join(", "));
        write!(f, ", group=[{group}], aggr=[{aggregates}]")?;
        self.read.fmt_filters(f)?;
        if let Some(predicate) = &self.predicate {
            write!(f, ", predicate={predicate}")?;
        }
        Ok(())
    }
}

//! `RollingWindow`: the logical plan node of rolling aggregates along one
//! dimension of a Zarr table.

use std::fmt;
use std::hash::Hash;
use std::sync::Arc;

use datafusion::common::{DFSchema, DFSchemaRef, Result};
use datafusion::logical_expr::{Expr, UserDefinedLogicalNodeCore};

use super::frame::{Frame, RollOp};
use crate::array::scan_path::{column_names, TableRead};
use crate::plan_methods::{leaf_node_methods, node_identity};

/// A frame in grid order: position `t` aggregates `t + start ..= t + end`;
/// without a `start` (`UNBOUNDED PRECEDING` in grid order), from the
/// series' first position; without an `end` (`UNBOUNDED FOLLOWING`), to its
/// last. Shown `[-3, +0]`, `[unbounded, +0]`, `[+0, unbounded]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd)]
pub struct GridFrame {
    /// Offset of the first position; `None`: the series' first.
    pub start: Option<i64>,
    /// Offset of the last position; `None`: the series' last.
    pub end: Option<i64>,
}

impl GridFrame {
    /// The frame in the order the operator walks the positions: the grid's
    /// (`backward` false), or from the series' end (`backward`: the frame
    /// mirrored, so that a frame to the series' end is a running one);
    /// `None` when it is unbounded at the end the walk reaches last.
    pub fn walked(&self, backward: bool) -> Option<Frame> {
        if backward {
            Some(Frame {
                start: self.end.map(|end| -end),
                end: -self.start?,
            })
        } else {
            Some(Frame {
                start: self.start,
                end: self.end?,
            })
        }
    }

    /// The direction in which every one of `frames` can be walked: `false`
    /// (the grid's order) unless one runs to the series' end; `None` when
    /// one runs to each end of the series (or one to both).
    pub fn direction<'a>(frames: impl IntoIterator<Item = &'a GridFrame>) -> Option<bool> {
        let (mut from_start, mut to_end) = (false, false);
        for frame in frames {
            from_start |= frame.start.is_none();
            to_end |= frame.end.is_none();
        }
        (!(from_start && to_end)).then_some(to_end)
    }
}

impl fmt::Display for GridFrame {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let bound =
            |b: Option<i64>| b.map_or_else(|| "unbounded".to_string(), |b| format!("{b:+}"));
        write!(f, "[{}, {}]", bound(self.start), bound(self.end))
    }
}

/// One rolling aggregate: `op(arg) OVER (PARTITION BY <the other
/// dimensions> ORDER BY <dim> ROWS BETWEEN ...)`, its frame in grid order
/// (shown `over [-3, +0]`, `over [unbounded, +0]` from the series' start,
/// `over [+0, unbounded]` to its end).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd)]
pub struct RollExpr {
    /// What it computes.
    pub op: RollOp,
    /// Its argument over the table's columns.
    pub arg: Expr,
    /// The positions each cell aggregates, in grid order (an `ORDER BY`
    /// against the coordinate's order swaps PRECEDING and FOLLOWING).
    pub frame: GridFrame,
}

impl fmt::Display for RollExpr {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{}({}) over {}", self.op.name(), self.arg, self.frame)
    }
}

/// Rolling aggregates along dimension `dim` of a Zarr table, one value per
/// cell of the selection, beside the columns of the window's input.
///
/// A leaf node: it reads the table itself. `filters` are the pushed-down
/// dimension filters (they shrink the selection, as in a scan); every
/// frame runs over the selected positions of `dim`.
#[derive(Debug, Clone)]
pub struct RollingWindow {
    /// The table read, the columns the expressions are over, and the
    /// filters on single dimensions.
    pub read: TableRead,
    /// The dimension rolled along (index into the table's dimensions).
    pub dim: usize,
    /// The window's input columns, over the scan's columns.
    pub columns: Vec<Expr>,
    /// The aggregates, in the order of their output columns; their frames
    /// all run from the series' start, or none does (see
    /// [`GridFrame::direction`]).
    pub aggregates: Vec<RollExpr>,
    /// Output: the input columns, then the aggregates.
    pub schema: DFSchemaRef,
}

impl RollingWindow {
    /// This window with only its input columns `keep` (indices, in order),
    /// then its aggregates.
    pub fn keeping(&self, keep: &[usize]) -> Result<Self> {
        let n = self.columns.len();
        let fields = (keep.iter().copied())
            .chain(n..self.schema.fields().len())
            .map(|i| {
                let (qualifier, field) = self.schema.qualified_field(i);
                (qualifier.cloned(), Arc::clone(field))
            })
            .collect();
        let schema = DFSchema::new_with_metadata(fields, self.schema.metadata().clone())?;
        Ok(Self {
            columns: keep.iter().map(|&i| self.columns[i].clone()).collect(),
            schema: Arc::new(schema),
            ..self.clone()
        })
    }

    /// The columns its input columns and aggregates read, by name.
    pub fn variables(&self) -> Vec<String> {
        column_names(
            self.columns
                .iter()
                .chain(self.aggregates.iter().map(|a| &a.arg)),
        )
    }

    /// Whether its frames are walked from the series' end (one runs to
    /// it): see [`GridFrame::walked`].
    pub fn backward(&self) -> bool {
        self.aggregates.iter().any(|a| a.frame.end.is_none())
    }

    #[allow(clippy::type_complexity)]
    fn key(&self) -> (&Vec<Expr>, usize, &Vec<Expr>, &Vec<RollExpr>) {
        (
            &self.read.filters,
            self.dim,
            &self.columns,
            &self.aggregates,
        )
    }
}

node_identity!(
    RollingWindow,
    eq: |a, b| a.read.same_as(&b.read) && a.key() == b.key() && a.schema == b.schema,
    hash: |node, mut state| (&node.read.table.store, node.key()).hash(&mut state),
    cmp: |a, b| match Arc::ptr_eq(&a.read.table, &b.read.table) {
        true => a.key().partial_cmp(&b.key()),
        false => None,
    }
);

impl UserDefinedLogicalNodeCore for RollingWindow {
    leaf_node_methods!("RollingWindow");

    fn fmt_for_explain(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let aggregates: Vec<String> = self.aggregates.iter().map(|a| a.to_string()).collect();
        write!(f, "RollingWindow: ")?;
        self.read.fmt_table(f)?;
        let along = &self.read.table.dims[self.dim].name;
        write!(f, ", along={along}, aggr=[{}]", aggregates.join(", "))?;
        self.read.fmt_filters(f)
    }
}

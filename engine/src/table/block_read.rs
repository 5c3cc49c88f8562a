//! `BlockRead`: the read every leaf array operator starts with, as plain
//! data.
//!
//! Which columns of which table are read, over which cells, in which
//! chunk-aligned blocks: the scan primitive. The scan
//! ([`ZarrScanExec`](super::ZarrScanExec)), the dense reduction and the
//! rolling window each hold one and add only their kernel; a cluster sends
//! it the same way for all of them (`distributed::codec`), and a worker
//! makes it again with [`BlockRead::new`], which checks what it received.

use std::ops::Range;
use std::sync::Arc;

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::{plan_err, Result};

use super::blocks::BlockGrid;
use super::dataset::GridTable;
use super::selection::Selection;

/// The columns, cells and blocks of a table an operator reads.
#[derive(Debug, Clone)]
pub struct BlockRead {
    /// The table read.
    pub table: Arc<GridTable>,
    /// The columns read: indices into the table's schema, in the order of
    /// `schema`.
    pub columns: Vec<usize>,
    /// The columns' fields.
    pub schema: SchemaRef,
    /// The cells read.
    pub selection: Selection,
    /// The blocks the cells are read in.
    pub blocks: BlockGrid,
}

impl BlockRead {
    /// A read of `columns` of `table` over `selection` in `blocks`; an
    /// error naming the store when a column is not the table's or the
    /// blocks or selection are not of its grid.
    pub fn new(
        table: Arc<GridTable>,
        columns: Vec<usize>,
        selection: Selection,
        blocks: BlockGrid,
    ) -> Result<Self> {
        let width = table.schema.fields().len();
        if let Some(bad) = columns.iter().find(|&&c| c >= width) {
            return plan_err!("a read of {} asks for column {bad} of {width}", table.store);
        }
        let rank = table.dims.len();
        if selection.rank() != rank || blocks.block_shape().len() != rank {
            return plan_err!(
                "a read of {} over {rank} dimensions has a selection over {} and blocks over {}",
                table.store,
                selection.rank(),
                blocks.block_shape().len()
            );
        }
        let schema = Arc::new(table.schema.project(&columns)?);
        Ok(Self {
            table,
            columns,
            schema,
            selection,
            blocks,
        })
    }

    /// Cells of a full block.
    pub fn block_cells(&self) -> u64 {
        (self.blocks.block_shape().iter()).fold(1u64, |cells, &n| cells.saturating_mul(n))
    }

    /// Bytes of a row of the columns read, as record batch columns hold
    /// them (16 for a column of no fixed width).
    pub fn row_bytes(&self) -> usize {
        (self.schema.fields().iter())
            .map(|f| f.data_type().primitive_width().unwrap_or(16))
            .sum()
    }

    /// The selected ranges along each dimension.
    pub fn selection_ranges(&self) -> Vec<Vec<Range<u64>>> {
        (0..self.selection.rank())
            .map(|d| self.selection.ranges(d).to_vec())
            .collect()
    }
}

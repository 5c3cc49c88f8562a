//! The cells of one box of a grid table, as Arrow columns.
//!
//! Variables are read and decoded once per box; dimension columns are
//! generated from the coordinates for any run of rows, never stored per
//! cell; a broadcast column's rows are sliced from its dense array (copied
//! only where they cross from one of its runs to another). Both the scan and the array operators build their record batches
//! through [`BoxCells`].

use std::ops::Range;
use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, RecordBatch, RecordBatchOptions, UInt64Array};
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::Result;

use super::broadcast::BroadcastRuns;
use super::dataset::GridTable;
use super::slices::batch_slice;
use crate::error::ZarrFusionError;
use crate::zarr::ChunkBufferPool;

/// The decoded columns of one box: variables read, dimensions on demand.
pub struct BoxCells<'a> {
    table: &'a GridTable,
    columns: &'a [usize],
    extent: &'a [Range<u64>],
    shape: Vec<u64>,
    variables: Vec<Option<Values>>,
}

/// A column read for a box.
enum Values {
    /// A variable, decoded.
    Decoded(ArrayRef),
    /// A broadcast column, sliced from its dense array when rows are asked
    /// for.
    Broadcast(BroadcastRuns),
}

impl<'a> BoxCells<'a> {
    /// Reads the variables among `columns` (indices into the table's
    /// schema) over `extent`, one range per dimension, into buffers of `pool`
    /// where chunks are read straight from files.
    pub fn read(
        table: &'a GridTable,
        columns: &'a [usize],
        extent: &'a [Range<u64>],
        pool: &ChunkBufferPool,
    ) -> crate::error::Result<Self> {
        let mut variables: Vec<Option<Values>> = columns
            .iter()
            .map(|&i| {
                let read = table.variable(i).map(|v| v.read(extent, pool));
                read.transpose().map(|v| v.map(Values::Decoded))
            })
            .collect::<crate::error::Result<_>>()?;
        // Each broadcast's columns at once (the cells' places are found once).
        for (k, broadcast) in table.broadcasts.iter().enumerate() {
            let (places, parts): (Vec<usize>, Vec<usize>) = (columns.iter().enumerate())
                .filter_map(|(place, &i)| match table.broadcast_of(i) {
                    Some((b, part)) if b == k => Some((place, part)),
                    _ => None,
                })
                .unzip();
            if parts.is_empty() {
                continue;
            }
            let read = broadcast
                .read(&parts, extent)
                .map_err(|e| ZarrFusionError::store(&table.store, e.to_string()))?;
            for (place, runs) in places.into_iter().zip(read) {
                variables[place] = Some(Values::Broadcast(runs));
            }
        }
        Ok(Self {
            table,
            columns,
            extent,
            shape: extent.iter().map(|r| r.end - r.start).collect(),
            variables,
        })
    }

    /// Bytes of the variables as stored, decoded (cells times element size).
    pub fn decoded_bytes(&self) -> u64 {
        self.table.decoded_cell_bytes(self.columns) * self.num_cells()
    }

    /// Number of cells in the box.
    pub fn num_cells(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Rows `start..start + len` (C order) as a batch of `schema`, whose
    /// fields are the `columns` this box was read with.
    pub fn batch(&self, schema: &SchemaRef, start: u64, len: u64) -> Result<RecordBatch> {
        let all: Vec<usize> = (0..self.columns.len()).collect();
        self.batch_of(schema, &all, start, len)
    }

    /// Rows `start..start + len` (C order) of some of the columns this box
    /// was read with (`which`: their places among them), as a batch of
    /// `schema`, whose fields are those columns.
    pub fn batch_of(
        &self,
        schema: &SchemaRef,
        which: &[usize],
        start: u64,
        len: u64,
    ) -> Result<RecordBatch> {
        let columns = which
            .iter()
            .map(|&k| match &self.variables[k] {
                Some(Values::Decoded(values)) => {
                    Ok(batch_slice(values, start as usize, len as usize))
                }
                Some(Values::Broadcast(runs)) => runs.rows(start as usize, len as usize),
                None => self.dimension_column(self.columns[k], start, len),
            })
            .collect::<Result<Vec<_>>>()?;
        let options = RecordBatchOptions::new().with_row_count(Some(len as usize));
        Ok(RecordBatch::try_new_with_options(
            Arc::clone(schema),
            columns,
            &options,
        )?)
    }

    /// The values of dimension `d` for rows `start..start + len`.
    fn dimension_column(&self, d: usize, start: u64, len: u64) -> Result<ArrayRef> {
        let indices = UInt64Array::from(dimension_indices(
            self.extent[d].start,
            self.shape[d],
            self.shape[d + 1..].iter().product(),
            start,
            len,
        ));
        Ok(self.table.dims[d].coordinate.take(&indices)?)
    }
}

/// Coordinate indices of rows `start..start + len` of a box, along a
/// dimension that starts at `offset`, has `n` cells in the box and repeats
/// each value `stride` times (the product of the inner dimensions). Runs are
/// filled whole, with one division per run rather than per row. Indices are
/// 64-bit: a dimension may be longer than 2^32 (a signal, an index without
/// a coordinate array).
pub(crate) fn dimension_indices(
    offset: u64,
    n: u64,
    stride: u64,
    start: u64,
    len: u64,
) -> Vec<u64> {
    let mut out = Vec::with_capacity(len as usize);
    let end = start + len;
    let mut row = start;
    if stride == 1 {
        let mut pos = row % n;
        while row < end {
            let count = (n - pos).min(end - row);
            out.extend(offset + pos..offset + pos + count);
            row += count;
            pos = 0;
        }
        return out;
    }
    while row < end {
        let run = row / stride;
        let run_end = ((run + 1) * stride).min(end);
        let index = offset + run % n;
        out.extend(std::iter::repeat_n(index, (run_end - row) as usize));
        row = run_end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::dimension_indices;

    #[test]
    fn dimension_indices_follow_c_order() {
        // A box of shape (3, 2, 4) starting at (5, 0, 10): rows in C order.
        let shape = [3u64, 2, 4];
        let offsets = [5u64, 0, 10];
        for (start, len) in [(0, 24), (3, 7), (7, 1), (23, 1), (9, 15)] {
            for d in 0..3 {
                let stride: u64 = shape[d + 1..].iter().product();
                let expected: Vec<u64> = (start..start + len)
                    .map(|r| offsets[d] + (r / stride) % shape[d])
                    .collect();
                assert_eq!(
                    dimension_indices(offsets[d], shape[d], stride, start, len),
                    expected,
                    "d={d} start={start} len={len}"
                );
            }
        }
    }
}

//! Batches cut from a block's columns without copying, each counted as
//! the rows it holds.
//!
//! An operator that decodes or computes a whole block (the scan, the
//! rolling window, a reduction's result) sends it in batches of
//! `batch_size` rows. Arrow's `slice` shares the block's buffer, and
//! DataFusion counts every buffer a batch holds in full
//! (`get_record_batch_memory_size`, which a sort reserves for each batch
//! it keeps): blocks of 33 MB sent in slices of 8192 rows made a sort
//! above a scan reserve 33 MB a batch and spill every row of a 175 MB
//! input 35 times under a 1 GB budget. [`batch_slice`] shares the buffer
//! all the same, but gives each batch its own view of it whose size is
//! the bytes of its rows: the views of a block add up to the block, and
//! the block is freed when its last view is dropped (the operator counts
//! the blocks its batches in flight keep alive).

use std::ptr::NonNull;
use std::sync::Arc;

use datafusion::arrow::alloc::Allocation;
use datafusion::arrow::array::{make_array, Array, ArrayRef, RecordBatch, RecordBatchOptions};
use datafusion::arrow::buffer::{BooleanBuffer, Buffer, NullBuffer};
use datafusion::common::Result;

/// Rows `offset..offset + len` of `values`, sharing its buffers; a column
/// of fixed-width values (and its validity) comes as buffers that count
/// only those rows' bytes. Other columns are sliced as arrow slices them.
/// Panics where `slice` would: `offset + len` past the end.
pub fn batch_slice(values: &ArrayRef, offset: usize, len: usize) -> ArrayRef {
    let sliced = values.slice(offset, len);
    if !sliced.data_type().is_primitive() {
        return sliced;
    }
    let data = sliced.to_data();
    let [buffer] = data.buffers() else {
        return sliced;
    };
    let buffer = own_view(buffer);
    let nulls = data.nulls().map(own_nulls);
    match data
        .into_builder()
        .buffers(vec![buffer])
        .nulls(nulls)
        .build()
    {
        Ok(data) => make_array(data),
        // Not reached for a primitive array's slice; the plain slice is
        // the same rows.
        Err(_) => sliced,
    }
}

/// Rows `offset..offset + len` of `batch`, each column cut by
/// [`batch_slice`].
pub fn batch_rows(batch: &RecordBatch, offset: usize, len: usize) -> Result<RecordBatch> {
    let columns = (batch.columns().iter())
        .map(|c| batch_slice(c, offset, len))
        .collect();
    let options = RecordBatchOptions::new().with_row_count(Some(len));
    Ok(RecordBatch::try_new_with_options(
        batch.schema(),
        columns,
        &options,
    )?)
}

/// A buffer of the bytes `buffer` views, kept alive by a clone of it,
/// whose capacity is those bytes only.
fn own_view(buffer: &Buffer) -> Buffer {
    let Some(ptr) = NonNull::new(buffer.as_ptr().cast_mut()) else {
        return buffer.clone();
    };
    let owner: Arc<dyn Allocation> = Arc::new(buffer.clone());
    // SAFETY: `ptr` points at the `buffer.len()` initialised bytes that
    // `buffer` views. `owner` shares (and keeps alive) the allocation
    // holding them as long as the new buffer lives, and no one writes to
    // an allocation arrow buffers share: `Buffer::into_mutable` refuses
    // while `owner` holds it, and a custom allocation is never mutable.
    unsafe { Buffer::from_custom_allocation(ptr, buffer.len(), owner) }
}

/// `nulls` over the bytes its bits lie in only.
fn own_nulls(nulls: &NullBuffer) -> NullBuffer {
    let bits = nulls.inner();
    let (offset, len) = (bits.offset(), bits.len());
    let first = offset / 8;
    let bytes = bits
        .inner()
        .slice_with_length(first, (offset + len).div_ceil(8) - first);
    NullBuffer::new(BooleanBuffer::new(own_view(&bytes), offset % 8, len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{Float32Array, Int64Array, StringArray};
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::common::utils::memory::{
        get_record_batch_memory_size, RecordBatchMemoryCounter,
    };

    /// A block of `n` float32 values with a null every 7th.
    fn block(n: usize) -> ArrayRef {
        let values: Float32Array = (0..n)
            .map(|i| (i % 7 != 3).then_some(i as f32 * 0.5))
            .collect();
        Arc::new(values)
    }

    #[test]
    fn slices_hold_the_same_rows_and_count_only_their_bytes() {
        let n = 100_003;
        let values = block(n);
        let whole = values.get_array_memory_size();
        // Cuts at odd places: a null bitmap's bytes shared by two slices.
        for (offset, len) in [
            (0, 8192),
            (8192, 8192),
            (5, 13),
            (99_999, 4),
            (n, 0),
            (3, n - 3),
        ] {
            let ours = batch_slice(&values, offset, len);
            let arrows = values.slice(offset, len);
            assert_eq!(ours.to_data(), arrows.to_data(), "{offset}+{len}");
            assert_eq!(ours.null_count(), arrows.null_count(), "{offset}+{len}");
            let counted = ours.get_array_memory_size();
            // The values' bytes, the validity's (one more byte where the
            // cut is not on a byte), and the array's own few words.
            let bytes = 4 * len + len.div_ceil(8) + 1;
            assert!(
                counted <= bytes + 256,
                "{offset}+{len}: {counted} of {bytes}"
            );
            if len < n / 2 {
                assert!(counted < whole / 2, "{offset}+{len}: {counted} of {whole}");
            }
        }
    }

    #[test]
    fn a_blocks_batches_add_up_to_the_block_and_keep_it_alive() {
        let n = 65_536;
        let schema = Arc::new(Schema::new(vec![
            Field::new("v", DataType::Float32, true),
            Field::new("k", DataType::Int64, false),
            Field::new("s", DataType::Utf8, false),
        ]));
        let keys: ArrayRef = Arc::new(Int64Array::from_iter_values(0..n as i64));
        let names: ArrayRef =
            Arc::new(StringArray::from_iter_values((0..n).map(|i| i.to_string())));
        let values = block(n);
        let buffer = (values.as_any().downcast_ref::<Float32Array>().unwrap())
            .values()
            .inner()
            .clone();
        let batch = RecordBatch::try_new(schema, vec![values, keys, names]).unwrap();
        let batches: Vec<RecordBatch> = (0..n)
            .step_by(8192)
            .map(|at| batch_rows(&batch, at, 8192.min(n - at)).unwrap())
            .collect();
        drop(batch);
        // The fixed-width columns count their rows once over the batches;
        // the strings, sliced as arrow does, count their whole buffers in
        // each (DataFusion's own behaviour, which this leaves alone).
        let fixed = |b: &RecordBatch| b.project(&[0, 1]).unwrap();
        let summed: usize = batches
            .iter()
            .map(|b| get_record_batch_memory_size(&fixed(b)))
            .sum();
        let mut counter = RecordBatchMemoryCounter::new();
        batches.iter().for_each(|b| {
            counter.count_batch(&fixed(b));
        });
        assert_eq!(
            summed,
            counter.memory_usage(),
            "no buffer is shared by two batches"
        );
        let rows = 12 * n + n / 8;
        assert!(
            summed >= rows && summed <= rows + 8 * 1024,
            "{summed} bytes counted for {rows} bytes of rows"
        );
        assert_eq!(batches.iter().map(|b| b.num_rows()).sum::<usize>(), n);
        // The block's values live while a batch shares them, and only then.
        let last = batches.last().unwrap().clone();
        drop(batches);
        assert_eq!(buffer.strong_count(), 2, "the last batch's view and ours");
        let column = last
            .column(0)
            .as_any()
            .downcast_ref::<Float32Array>()
            .unwrap();
        assert_eq!(column.value(1), (n - 8192 + 1) as f32 * 0.5);
        drop(last);
        assert_eq!(buffer.strong_count(), 1, "no batch holds the block");
        assert!(
            buffer.into_mutable().is_ok(),
            "the block's buffer is free again"
        );
    }
}

//! Running one stage of a rechunk: tasks copy regions of whole output
//! chunks from one Zarr array to another, on a few threads.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use zarrs::array::{Array, ArrayBytes, ArraySubset, CodecOptions};
use zarrs::storage::{ReadableStorageTraits, ReadableWritableStorageTraits};

use super::plan::StagePlan;
use crate::array::tasks::run_tasks;
use crate::zarr::{codec_read, ReadAhead};

/// What a stage did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StageCounts {
    /// Tasks run.
    pub tasks: u64,
    /// Decoded bytes read: the input's chunks each task's region meets.
    pub bytes_read: u64,
    /// Decoded bytes written.
    pub bytes_written: u64,
}

impl StageCounts {
    /// These counts and `other`'s together.
    pub fn add(&mut self, other: &Self) {
        self.tasks += other.tasks;
        self.bytes_read += other.bytes_read;
        self.bytes_written += other.bytes_written;
    }
}

/// Copies `input` into `output` (same shape and data type) task by task
/// (the plan's tasks numbered `run`, all of them when `None`) on `workers` threads, telling `read_ahead` (a window over the input's
/// chunks, task by task) when each task is done; stops at the first error
/// or when `cancelled` is set. Errors name the region that failed. A task
/// writes only once `may_write` (when given) says the output still wants
/// it (a cluster's staged target, gone when the write failed elsewhere).
#[allow(clippy::too_many_arguments)]
pub fn run_stage<R, W>(
    plan: &StagePlan,
    run: Option<std::ops::Range<u64>>,
    input: &Array<R>,
    output: &Array<W>,
    workers: usize,
    read_ahead: Option<&ReadAhead>,
    may_write: Option<&(dyn Fn() -> Result<(), String> + Sync)>,
    cancelled: &AtomicBool,
) -> Result<StageCounts, String>
where
    R: ReadableStorageTraits + ?Sized + 'static,
    W: ReadableWritableStorageTraits + ?Sized + 'static,
{
    let regions = plan.regions(input.shape());
    // Each task decodes and encodes one chunk at a time: its memory is what
    // the plan projected.
    let options = CodecOptions::default().with_concurrent_target(1);
    let run = run.unwrap_or(0..plan.tasks);
    let read = AtomicU64::new(0);
    let written = run_tasks(
        run.end.saturating_sub(run.start),
        workers,
        cancelled,
        || (),
        |_, number| {
            let task = run.start + number;
            let ranges = regions.block(task);
            let subset = ArraySubset::new_with_ranges(&ranges);
            let bytes = codec_read(|| {
                input.retrieve_array_subset_opt::<ArrayBytes<'static>>(&subset, &options)
            })
            .map_err(|e| read_error(input, &subset, &options, e))?;
            let size = bytes.size() as u64;
            read.fetch_add(
                chunks_read(size, &ranges, &plan.from, input.shape()),
                Ordering::Relaxed,
            );
            if let Some(read_ahead) = read_ahead {
                read_ahead.done_with(task);
            }
            if let Some(may_write) = may_write {
                may_write()?;
            }
            output
                .store_array_subset_opt(&subset, bytes, &options)
                .map_err(|e| format!("writing {ranges:?}: {e}"))?;
            Ok::<u64, String>(size)
        },
    )?;
    if cancelled.load(Ordering::Relaxed) {
        return Err("cancelled".into());
    }
    Ok(StageCounts {
        tasks: run.end.saturating_sub(run.start),
        bytes_read: read.into_inner(),
        bytes_written: written,
    })
}

/// Decoded bytes of the chunks (of shape `chunk`, in an array of `shape`)
/// that the region `ranges`, `size` bytes decoded, meets.
fn chunks_read(size: u64, ranges: &[Range<u64>], chunk: &[u64], shape: &[u64]) -> u64 {
    let (mut cells, mut met) = (1u128, 1u128);
    for ((r, &c), &n) in ranges.iter().zip(chunk).zip(shape) {
        let c = c.max(1);
        let end = r.end.div_ceil(c).saturating_mul(c).min(n);
        cells = cells.saturating_mul(r.end.saturating_sub(r.start) as u128);
        met = met.saturating_mul(end.saturating_sub(r.start / c * c) as u128);
    }
    match cells {
        0 => 0,
        _ => u64::try_from((size as u128).saturating_mul(met) / cells).unwrap_or(u64::MAX),
    }
}

/// What failed while reading `subset`: the first of its chunks that
/// fails alone, by its key and indices (else the region), and why.
fn read_error<R>(
    input: &Array<R>,
    subset: &ArraySubset,
    options: &CodecOptions,
    region_error: String,
) -> String
where
    R: ReadableStorageTraits + ?Sized + 'static,
{
    if let Ok(Some(chunks)) = input.chunks_in_array_subset(subset) {
        for indices in &chunks.indices() {
            let read =
                codec_read(|| input.retrieve_chunk_opt::<ArrayBytes<'static>>(&indices, options));
            if let Err(e) = read {
                return format!(
                    "reading chunk '{}' (chunk {indices:?}): {e}",
                    input.chunk_key(&indices)
                );
            }
        }
    }
    format!("reading {:?}: {region_error}", subset.to_ranges())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_tile_the_array() {
        let plan = StagePlan {
            from: vec![1, 1],
            to: vec![2, 3],
            region: vec![4, 3],
            tasks: 3 * 3,
            task_memory: 0,
            bytes_read: 0,
            bytes_written: 0,
        };
        let shape = [10u64, 7];
        let mut covered = [0u8; 70];
        for task in 0..plan.tasks {
            let r = plan.regions(&shape).block(task);
            for i in r[0].clone() {
                for j in r[1].clone() {
                    covered[(i * 7 + j) as usize] += 1;
                }
            }
        }
        assert!(covered.iter().all(|&c| c == 1));
    }
}

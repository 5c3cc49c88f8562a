//! A source with its trend removed, for transforms whose blocks do not
//! hold whole groups of the transformed dimensions: the four-step path
//! (pieces of one line) and staged transforms (one dimension at a time,
//! while xrft fits a detrend over all of them at once).
//!
//! Before the first block is read, one pass over the source (a chunk at a
//! time, on as many workers as the memory limit allows) gathers each
//! group's [`TrendSums`]; every block read afterwards has the fitted trend
//! at its cells' positions subtracted, so the transform sees what
//! `super::detrend::detrend_block` would have given over whole groups.
//! The sums (48 bytes a group) are held for the whole query and counted in
//! its plan.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use rustfft::num_complex::Complex;

use super::ArraySource;
use crate::array::fft::detrend::TrendSums;
use crate::array::fft::kernels::{Kernels, Precision};
use crate::array::fft::options::Detrend;
use crate::array::tasks::run_tasks;
use crate::device::fft_cpu::BlockValues;
use crate::table::BlockGrid;
use crate::zarr::ChunkBufferPool;

/// A source detrended over `axes` (see the module docs).
pub struct DetrendedSource {
    /// The source.
    pub source: ArraySource,
    /// The dimensions the trend is fitted over.
    axes: Vec<usize>,
    detrend: Detrend,
    /// Workers of the pass gathering the sums.
    workers: usize,
    sums: OnceLock<Result<Vec<TrendSums>, String>>,
    /// Whether this process gathers the sums itself on the first read (a
    /// cluster's worker is given them instead, see [`Self::received`]).
    fit_here: bool,
    cancelled: AtomicBool,
}

impl std::fmt::Debug for DetrendedSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DetrendedSource")
            .field("store", &self.source.store())
            .field("axes", &self.axes)
            .field("detrend", &self.detrend)
            .finish()
    }
}

impl Drop for DetrendedSource {
    fn drop(&mut self) {
        self.cancelled.store(true, Ordering::Relaxed);
    }
}

/// The cells of `extent` (C order) with their group (the C-order index of
/// their positions along the dimensions not in `axes`, within `shape`),
/// that group's index among the extent's groups, and their positions
/// along `axes`.
fn for_each_cell(
    extent: &[Range<u64>],
    shape: &[u64],
    axes: &[usize],
    mut f: impl FnMut(usize, [usize; 2], &[usize]),
) {
    let mut index: Vec<u64> = extent.iter().map(|r| r.start).collect();
    let mut along = vec![0usize; axes.len()];
    // Each dimension's place among `axes`, looked up once.
    let place: Vec<Option<usize>> = (0..extent.len())
        .map(|d| axes.iter().position(|&a| a == d))
        .collect();
    let cells: u64 = extent.iter().map(|r| r.end - r.start).product();
    for cell in 0..cells as usize {
        let (mut group, mut local) = (0usize, 0usize);
        for (d, &i) in index.iter().enumerate() {
            match place[d] {
                Some(k) => along[k] = i as usize,
                None => {
                    group = group * shape[d] as usize + i as usize;
                    let r = &extent[d];
                    local = local * (r.end - r.start) as usize + (i - r.start) as usize;
                }
            }
        }
        f(cell, [group, local], &along);
        for d in (0..index.len()).rev() {
            index[d] += 1;
            if index[d] < extent[d].end {
                break;
            }
            index[d] = extent[d].start;
        }
    }
}

impl DetrendedSource {
    /// `source` with `detrend` removed over `axes`, its sums gathered by
    /// `workers` tasks reading a chunk each.
    pub fn new(source: ArraySource, axes: Vec<usize>, detrend: Detrend, workers: usize) -> Self {
        Self {
            source,
            axes,
            detrend,
            workers: workers.max(1),
            sums: OnceLock::new(),
            fit_here: true,
            cancelled: AtomicBool::new(false),
        }
    }

    /// Bytes one task of the pass gathering the sums holds: a chunk of a
    /// source read.
    pub fn task_memory(source: &ArraySource) -> usize {
        let shape = source.shape();
        let cells: u64 = source
            .chunk_shape()
            .iter()
            .zip(&shape)
            .map(|(&c, &s)| c.min(s).max(1))
            .product();
        cells as usize * (source.peak_bytes_per_cell() + 2 * std::mem::size_of::<TrendSums>())
    }

    /// Bytes the sums of a source of `shape` detrended over `axes` hold.
    pub fn sums_memory(shape: &[u64], axes: &[usize]) -> usize {
        let groups: u64 = (0..shape.len())
            .filter(|d| !axes.contains(d))
            .map(|d| shape[d])
            .product();
        groups as usize * std::mem::size_of::<TrendSums>()
    }

    /// The trend, for `EXPLAIN`.
    pub fn describe(&self) -> String {
        let dims = self.source.dims();
        let names: Vec<&str> = self.axes.iter().map(|&a| dims[a].name.as_str()).collect();
        format!(
            "{} detrend over [{}] fitted in a pass over the source first ({} workers, {} of sums)",
            self.kind(),
            names.join(", "),
            self.workers,
            datafusion::common::human_readable_size(Self::sums_memory(
                &self.source.shape(),
                &self.axes
            )),
        )
    }

    /// `constant` or `linear`.
    fn kind(&self) -> &'static str {
        self.detrend.name()
    }

    /// The lengths of the source along `axes`.
    fn lengths(&self) -> Vec<usize> {
        let shape = self.source.shape();
        self.axes.iter().map(|&a| shape[a] as usize).collect()
    }

    /// The number of groups (positions of the dimensions not in the
    /// fit's axes), each with its sums.
    pub fn groups(&self) -> usize {
        Self::sums_memory(&self.source.shape(), &self.axes) / std::mem::size_of::<TrendSums>()
    }

    /// The trend removed.
    pub fn detrend(&self) -> Detrend {
        self.detrend
    }

    /// This source with its sums gathered by `workers` when this process
    /// runs the fit (none gathered yet; a received source stays one).
    pub fn with_workers(&self, workers: usize) -> Self {
        let mut made = Self::new(
            self.source.clone(),
            self.axes.clone(),
            self.detrend,
            workers,
        );
        made.fit_here = self.fit_here;
        made
    }

    /// The dimensions the trend is fitted over.
    pub fn axes(&self) -> &[usize] {
        &self.axes
    }

    /// The blocks the pass gathering the sums reads: the source's chunks.
    pub fn fit_blocks(&self) -> BlockGrid {
        BlockGrid::covering(&self.source.shape(), &self.source.chunk_shape())
    }

    /// Workers of the pass gathering the sums.
    pub fn workers(&self) -> usize {
        self.workers
    }

    /// Bytes the pass gathering the sums holds at its peak: a chunk per
    /// worker and every group's sums.
    pub fn fit_memory(&self) -> usize {
        (self.workers.saturating_mul(Self::task_memory(&self.source)))
            .saturating_add(Self::sums_memory(&self.source.shape(), &self.axes))
    }

    /// [`Self::new`] as a cluster's worker makes it: its sums are not
    /// gathered on the first read but given by the fit's tasks
    /// ([`Self::set_fit`]), `workers` of them gathering them when this
    /// process runs one.
    pub fn received(
        source: ArraySource,
        axes: Vec<usize>,
        detrend: Detrend,
        workers: usize,
    ) -> Self {
        let mut made = Self::new(source, axes, detrend, workers);
        made.fit_here = false;
        made
    }

    /// Every group's sums, gathered by the fit's tasks on a cluster (see
    /// [`crate::array::fft::trend_pass`]); refused when not one per group.
    /// Sums already gathered are kept.
    pub fn set_fit(&self, sums: Vec<TrendSums>) -> Result<(), String> {
        if sums.len() != self.groups() {
            return Err(format!(
                "{} sums for the {} groups of the detrend of '{}' variable '{}'",
                sums.len(),
                self.groups(),
                self.source.store(),
                self.source.variable()
            ));
        }
        // Set once (a worker's node runs its fit once); a second fit of
        // the same source gives the same sums.
        let _ = self.sums.set(Ok(sums));
        Ok(())
    }

    /// The sums of every group over the source's chunks numbered `blocks`
    /// (of [`Self::fit_blocks`]), gathered by the pass's workers; groups
    /// those chunks do not reach hold zeros.
    pub fn gather<P: Precision>(
        &self,
        blocks: Range<u64>,
        kernels: &Kernels,
        cancelled: &AtomicBool,
    ) -> Result<Vec<TrendSums>, String> {
        let shape = self.source.shape();
        let lengths = self.lengths();
        let total = Mutex::new(vec![TrendSums::default(); self.groups()]);
        let wide = |x: P| x.to_f64().unwrap_or(f64::NAN);
        let grid = self.fit_blocks();
        if blocks.end > grid.num_blocks() {
            return Err(format!(
                "the detrend's fit has {} chunks, not {}",
                grid.num_blocks(),
                blocks.end
            ));
        }
        run_tasks(
            blocks.end.saturating_sub(blocks.start),
            self.workers,
            cancelled,
            ChunkBufferPool::new,
            |pool, task| {
                let extent = grid.block(blocks.start + task);
                let values = self.source.read::<P>(&extent, pool, kernels)?;
                // The block's groups, and their index in the source.
                let local_groups: u64 = (0..shape.len())
                    .filter(|d| !self.axes.contains(d))
                    .map(|d| extent[d].end - extent[d].start)
                    .product();
                let mut part = vec![(0, TrendSums::default()); local_groups as usize];
                for_each_cell(
                    &extent,
                    &shape,
                    &self.axes,
                    |cell, [group, local], along| {
                        let v = match &values {
                            BlockValues::Real(v) => Complex::new(wide(v[cell]), 0.0),
                            BlockValues::Complex(v) => {
                                Complex::new(wide(v[cell].re), wide(v[cell].im))
                            }
                        };
                        part[local].0 = group;
                        part[local].1.add(v, along, &lengths);
                    },
                );
                let mut total = total
                    .lock()
                    .map_err(|_| "a detrend task failed".to_string())?;
                for (group, sums) in &part {
                    total[*group].merge(sums);
                }
                Ok::<u64, String>(0)
            },
        )?;
        if cancelled.load(Ordering::Relaxed) {
            return Err("cancelled".to_string());
        }
        total
            .into_inner()
            .map_err(|_| "a detrend task failed".to_string())
    }

    /// Every group's sums, gathered once; every caller waits for them.
    fn sums<P: Precision>(&self, kernels: &Kernels) -> Result<&[TrendSums], String> {
        let sums = self.sums.get_or_init(|| {
            if !self.fit_here {
                return Err(
                    "its fit did not reach this worker before its blocks were read".to_string(),
                );
            }
            self.gather::<P>(0..self.fit_blocks().num_blocks(), kernels, &self.cancelled)
        });
        sums.as_deref().map_err(|e| {
            format!(
                "fitting the {} detrend of '{}' variable '{}': {e}",
                self.kind(),
                self.source.store(),
                self.source.variable()
            )
        })
    }

    /// The values of block `extent` in precision `P`, the trend removed.
    pub fn read<P: Precision>(
        &self,
        extent: &[Range<u64>],
        pool: &ChunkBufferPool,
        kernels: &Kernels,
    ) -> Result<BlockValues<P>, String> {
        let sums = self.sums::<P>(kernels)?;
        let shape = self.source.shape();
        let lengths = self.lengths();
        let narrow = |x: f64| P::from_f64(x).unwrap_or_else(P::nan);
        let mut values = self.source.read::<P>(extent, pool, kernels)?;
        match &mut values {
            BlockValues::Real(v) => {
                for_each_cell(extent, &shape, &self.axes, |cell, [group, _], along| {
                    let fit = sums[group].fit(self.detrend, along, &lengths);
                    v[cell] = v[cell] - narrow(fit.re);
                })
            }
            BlockValues::Complex(v) => {
                for_each_cell(extent, &shape, &self.axes, |cell, [group, _], along| {
                    let fit = sums[group].fit(self.detrend, along, &lengths);
                    v[cell] =
                        Complex::new(v[cell].re - narrow(fit.re), v[cell].im - narrow(fit.im));
                })
            }
        }
        Ok(values)
    }
}

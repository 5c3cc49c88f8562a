//! How a transform runs within the memory budget, and the operator a scan
//! of it plans.
//!
//! `FftTable::fitted` chooses the path (`zarrfusion.fft_strategy`):
//! blocks of whole lines in the store's chunks; over a rechunked copy of
//! the variable in `work_dir` when such a block does not fit; the
//! four-step path ([`super::four_step`]) when a single line does not;
//! staged one dimension at a time ([`super::staged`]) or through a stored
//! inner transform when several dimensions or a chain do not fit; a
//! detrend over whole groups first ([`super::source::detrended`]) when
//! blocks do not hold whole groups. The scan of an [`FftTable`] fits it and
//! plans its [`FftExec`].

use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::catalog::Session;
use datafusion::common::stats::Precision as Exactness;
use datafusion::common::{human_readable_size, plan_err, DataFusionError, Result, Statistics};
use datafusion::datasource::{TableProvider, TableType};
use datafusion::execution::memory_pool::MemoryLimit;
use datafusion::logical_expr::{Expr, TableProviderFilterPushDown};
use datafusion::physical_plan::ExecutionPlan;
use futures::future::BoxFuture;

use super::axis::AxisTransform;
use super::copy::WriteTasks;
use super::exec::{block_memory, kernel_lines_memory, kernel_memory, plan_blocks, FftExec};
use super::four_step::{divisors, FourStep, FourStepInput, FourStepPlan, NoSplit};
use super::options::FftOptions;
use super::source::{ArraySource, DetrendedSource, RechunkedVariable};
use super::staged::StagedTransform;
use super::table::FftTable;
use crate::array::rechunk::RechunkOptions;
use crate::config::ZarrConfig;
use crate::device::{choose_device, staging_memory};
use crate::memory::Projection;
use crate::table::{select, Selection};
use crate::write::scratch::default_work_dir;
use crate::zarr::StoreLocation;

impl FftTable {
    /// This transform as it runs in `session` (`zarrfusion.fft_strategy`):
    /// itself; over a rechunked copy of its variable when a block of whole
    /// lines in the store's chunks does not fit the memory limit; or by the
    /// four-step path when a single line does not.
    pub(crate) async fn fitted(&self, session: &dyn Session) -> Result<Arc<Self>> {
        let config = ZarrConfig::of(session.config_options());
        // The GPU's page-locked staging comes out of the limit first (an
        // unknown device is refused by the operator, with its name).
        let limit = match session.runtime_env().memory_pool.memory_limit() {
            MemoryLimit::Finite(limit) => Some(limit),
            _ => None,
        };
        let staging = choose_device(&config.device).map_or(0, |d| staging_memory(d, limit));
        let limit = limit.map(|limit| limit.saturating_sub(staging));
        Ok(Arc::new(self.fit(session, limit).await?))
    }

    /// [`Self::fitted`] within `limit`: a transform along several
    /// dimensions whose lines do not fit is staged, one dimension at a
    /// time, each stage fitted in turn; a transform of another one's output
    /// that does not fit block by block stores that output first.
    fn fit<'a>(
        &'a self,
        session: &'a dyn Session,
        limit: Option<usize>,
    ) -> BoxFuture<'a, Result<Self>> {
        Box::pin(async move {
            let strategy = ZarrConfig::of(session.config_options()).fft_strategy;
            let four_step = match strategy.trim().to_ascii_lowercase().as_str() {
                "four_step" => true,
                "whole_lines" => false,
                "auto" => limit.is_some_and(|l| !self.line_fits(l)),
                other => {
                    return plan_err!(
                        "zarrfusion.fft_strategy is '{other}'; it takes auto, whole_lines or \
                         four_step"
                    )
                }
            };
            let chained = matches!(self.source, ArraySource::Transformed(_));
            match limit {
                _ if chained && (four_step || limit.is_some_and(|l| !self.block_fits(l))) => {
                    self.chained(session, limit).await
                }
                _ if four_step && self.transform.axes.len() > 1 => {
                    self.staged(session, limit).await
                }
                _ if four_step => self.four_stepped(session, limit).await,
                Some(limit) if !self.block_fits(limit) => self.rechunked(session, limit).await,
                _ => Ok(self.clone()),
            }
        })
    }

    /// `units` units of work (`unit`) of this transform's operator, each
    /// holding `per_unit` bytes, as its refusals name them.
    fn projection(&self, units: usize, unit: &'static str, per_unit: usize) -> Projection {
        let store = format!(
            "'{}' variable '{}'",
            self.source.store(),
            self.source.variable()
        );
        Projection::new("FftExec", &store, units, unit, per_unit)
    }

    /// A planning error of this transform's operator, naming the store and
    /// variable.
    fn plan_error(&self, message: String) -> DataFusionError {
        DataFusionError::Plan(format!(
            "FftExec of '{}' variable '{}': {message}",
            self.source.store(),
            self.source.variable()
        ))
    }

    /// This transform staged (see [`super::staged`]): along its first
    /// dimension within half of `limit` (1 GiB without one), stored in
    /// `work_dir`, then along the others, reading that store, within the
    /// other half. A detrend (fitted over all the dimensions at once) is
    /// removed from the source read by the first stage.
    async fn staged(&self, state: &dyn Session, limit: Option<usize>) -> Result<FftTable> {
        let axes = &self.transform.axes;
        let dims: Vec<String> = axes.iter().map(|(_, a)| a.dim.clone()).collect();
        let half = limit.unwrap_or(1 << 30) / 2;
        // A detrend is fitted over all the dimensions at once: by a pass
        // over the source before the first stage, its sums held throughout.
        let positions: Vec<usize> = axes.iter().map(|(a, _)| *a).collect();
        let (source, sums) = self.detrended_source(positions, half)?;
        let half_first = half.saturating_sub(sums);
        let lags: Vec<f64> = axes.iter().map(|(_, a)| a.lag).collect();
        let options = &self.transform.options;
        let stage_options = |range: std::ops::Range<usize>| {
            let mut stage = options.clone();
            stage.dims = dims[range.clone()].to_vec();
            stage.detrend = None;
            stage.real_dim = stage.real_dim.filter(|r| stage.dims.contains(r));
            // xrft never shifts a forward transform with a real dimension,
            // even along the stages without it.
            if !stage.inverse && options.real_dim.is_some() {
                stage.shift = false;
            }
            if stage.inverse {
                // The lags as resolved (given, or the coordinates'
                // direct_lag, which the stored first stage does not keep).
                stage.lag = Some(lags[range].to_vec());
            }
            stage
        };
        let inner = FftTable::new(source, stage_options(0..1))?;
        self.through_work_dir(
            state,
            inner,
            stage_options(1..dims.len()),
            &self.transform.axes[1..],
            [half_first, half],
            false,
        )
        .await
    }

    /// This transform of another transform's output whose blocks of whole
    /// lines do not fit `limit` (or that takes the four-step path): the
    /// inner transform runs first within half of `limit` (1 GiB without
    /// one) and its output is stored in `work_dir`; this one reads that
    /// store within the other half, by whole lines or the four-step path.
    async fn chained(&self, state: &dyn Session, limit: Option<usize>) -> Result<FftTable> {
        let inner = match &self.source {
            ArraySource::Transformed(inner) => inner.as_any().downcast_ref::<FftTable>(),
            _ => None,
        };
        let Some(inner) = inner else {
            return Err(self.plan_error("only a transform's output is stored first".into()));
        };
        let mut options = self.transform.options.clone();
        if options.inverse {
            // The lags as resolved from the inner transform's coordinates.
            options.lag = Some(self.transform.axes.iter().map(|(_, a)| a.lag).collect());
        }
        let half = limit.unwrap_or(1 << 30) / 2;
        self.through_work_dir(
            state,
            inner.clone(),
            options,
            &self.transform.axes,
            [half, half],
            true,
        )
        .await
    }

    /// `inner` fitted to `memory[0]` bytes, its output stored in
    /// `work_dir` in chunks that let a block whole along `later` (this
    /// transform's axes still to run) fit `memory[1]`, then transformed as
    /// `options` say from there within `memory[1]`: a staged transform's
    /// first stage, or the inner transform of a chain (`chained`).
    async fn through_work_dir(
        &self,
        state: &dyn Session,
        inner: FftTable,
        options: FftOptions,
        later: &[(usize, AxisTransform)],
        memory: [usize; 2],
        chained: bool,
    ) -> Result<FftTable> {
        let [half, rest] = memory;
        let inner = Arc::new(inner.fit(state, Some(half)).await?);
        let inner_dims: Vec<&str> = inner
            .transform
            .axes
            .iter()
            .map(|(_, a)| a.dim.as_str())
            .collect();
        let config = state.config_options();
        // The first stage's tasks read the four-step output with half of
        // their half, like the operator does.
        let stage_limit = if inner.four_step.is_some() {
            half / 2
        } else {
            half
        };
        let staging = choose_device(&ZarrConfig::of(config).device)
            .map_or(0, |d| staging_memory(d, Some(stage_limit)));
        let blocks = plan_blocks(
            &inner,
            &inner.block_chunk(),
            &Selection::all(&inner.block_space()),
            config,
            Some(stage_limit),
        );
        let tasks = WriteTasks::plan(&inner, blocks, staging, Some(stage_limit), config);
        let stage = if chained {
            "the inner transform"
        } else {
            "the first stage"
        };
        (tasks.projection("FftExec", &inner))
            .holding(format!(
                "{stage} along [{}], a block of shape {:?} read, transformed and stored",
                inner_dims.join(", "),
                tasks.blocks.block_shape(),
            ))
            .share("the stage's tasks' share of")
            .advice("raise the limit")
            .check(stage_limit)?;
        let block_out: Vec<u64> = inner
            .output_extent(&tasks.blocks.block(0))
            .iter()
            .map(|r| r.end - r.start)
            .collect();
        let chunks = Self::stage_chunks(&inner, later, &block_out, rest.saturating_sub(staging));
        let runtime = Arc::clone(state.runtime_env());
        let work_dir = RechunkOptions::for_session(config, &runtime)?
            .work_dir
            .unwrap_or_else(default_work_dir);
        let stage = tokio::task::spawn_blocking(move || {
            StagedTransform::prepare(
                inner,
                chained,
                (tasks, staging),
                chunks,
                &work_dir,
                &runtime,
            )
        })
        .await
        .map_err(|e| DataFusionError::Execution(format!("the FFT planner stopped: {e}")))??;
        let outer = FftTable::new(ArraySource::Staged(Arc::new(stage)), options)?;
        Ok(outer.fit(state, Some(rest)).await?.giving_output_of(self))
    }

    /// The chunks of the stored output of `inner` (blocks of `block_out`
    /// values): its blocks subdivided along the dimensions `later` (the
    /// transforms still to run) do not touch until a block whole along the
    /// ones they do (read, transformed, and its kernel's threads) fits
    /// `limit`. The next stage then reads whole chunks.
    fn stage_chunks(
        inner: &FftTable,
        later: &[(usize, AxisTransform)],
        block_out: &[u64],
        limit: usize,
    ) -> Vec<u64> {
        let shape = inner.output_shape();
        let bytes = inner.complex_bytes();
        let longest = later.iter().map(|(_, a)| a.len).max().unwrap_or(0);
        let kernel = kernel_lines_memory(longest, bytes);
        // A block read (at the peak of a read of an uncompressed complex
        // chunk: the stored bytes and 16 more per value), its
        // values before and after a pass, as `block_memory` counts, and
        // its output encoded (a COPY's tasks hold that too).
        let memory = |chunk: &[u64]| {
            let (mut block, mut out) = (chunk.to_vec(), chunk.to_vec());
            for (axis, transform) in later {
                block[*axis] = shape[*axis];
                out[*axis] = transform.output_len() as u64;
            }
            let (cells, out) = (
                block.iter().product::<u64>() as usize,
                out.iter().product::<u64>() as usize,
            );
            cells * (bytes + 16) + 2 * cells.max(out) * bytes + out * bytes + kernel
        };
        let smaller = |chunk: &mut Vec<u64>, d: usize| {
            chunk[d] = divisors(block_out[d] as usize)
                .into_iter()
                .rev()
                .find(|&c| (c as u64) < chunk[d])
                .unwrap_or(1) as u64;
        };
        let mut chunk = block_out.to_vec();
        while memory(&chunk) > limit {
            let Some(d) = (0..chunk.len())
                .filter(|d| chunk[*d] > 1 && !later.iter().any(|(a, _)| a == d))
                .max_by_key(|d| chunk[*d])
            else {
                break;
            };
            smaller(&mut chunk, d);
        }
        if memory(&chunk) > limit {
            // Not even one line fits: the rest goes by the four-step path,
            // whose passes read runs of chunks and hold one chunk read per
            // task, so chunks along the remaining dimensions are made
            // small too (an eighth of the limit at the peak of a read).
            let read = |chunk: &[u64]| chunk.iter().product::<u64>() as usize * (2 * bytes + 16);
            while read(&chunk) > limit / 8 {
                let Some(d) = (0..chunk.len())
                    .filter(|d| chunk[*d] > 1)
                    .max_by_key(|d| chunk[*d])
                else {
                    break;
                };
                smaller(&mut chunk, d);
            }
        }
        chunk
    }

    /// Whether one task over the smallest block of whole lines in the
    /// source's chunks (and the kernel's threads) fits `limit`.
    fn block_fits(&self, limit: usize) -> bool {
        let mut block = self.source.chunk_shape();
        let shape = self.source.shape();
        for (axis, _) in &self.transform.axes {
            block[*axis] = shape[*axis];
        }
        block_memory(self, &block) + kernel_memory(self) <= limit
    }

    /// Whether one line (one position of every other dimension) fits half
    /// of what `limit` leaves beside the kernel's threads, as a rechunked
    /// block must.
    fn line_fits(&self, limit: usize) -> bool {
        let mut line = vec![1; self.source.shape().len()];
        for (axis, _) in &self.transform.axes {
            line[*axis] = self.source.shape()[*axis];
        }
        block_memory(self, &line) <= limit.saturating_sub(kernel_memory(self)) / 2
    }

    /// This transform by the four-step path, its intermediates planned for
    /// `limit` (1 GiB without one) and created in `work_dir` (computed on
    /// the first read). Refused for more than one dimension (those are
    /// staged first).
    async fn four_stepped(&self, state: &dyn Session, limit: Option<usize>) -> Result<FftTable> {
        let [(axis, axis_transform)] = self.transform.axes.as_slice() else {
            return Err(self.plan_error(format!(
                "the four-step path (for lines larger than memory) transforms one dimension \
                 at a time, not {}; transform them one after the other",
                self.transform.axes.len()
            )));
        };
        let limit = limit.unwrap_or(1 << 30);
        let input = FourStepInput {
            shape: self.source.shape(),
            chunk: self.source.chunk_shape(),
            peak_bytes_per_cell: self.source.peak_bytes_per_cell(),
            single: self.single_precision(),
        };
        // Half the limit for the passes, half for the operator reading
        // their output (which holds its memory while they run); a detrend
        // holds every line's sums through the first pass.
        let (source, sums) = self.detrended_source(vec![*axis], limit - limit / 2)?;
        let runtime = Arc::clone(state.runtime_env());
        let options = RechunkOptions::for_session(state.config_options(), &runtime)?;
        let work_dir = options.work_dir.clone().unwrap_or_else(default_work_dir);
        // A source or intermediates in an object store are read ahead in
        // what the passes' blocks leave of their half when that is at
        // least a sixteenth of the limit; else a quarter of their half is
        // set aside for it (smaller blocks: a chunk of the source is read
        // by more of them).
        let io_concurrency = ZarrConfig::of(state.config_options()).io_concurrency;
        let remote_source = source
            .stored()
            .is_some_and(|(grid, variable)| grid.variables[variable].remote().is_some());
        let remote_work_dir = matches!(work_dir, StoreLocation::Remote(_));
        let reads_ahead = [remote_source, remote_work_dir].map(|r| r && io_concurrency > 0);
        let reserved = limit / 2 + sums;
        let plan_with = |set_aside: usize| {
            FourStepPlan::new(
                *axis,
                axis_transform,
                &input,
                limit,
                reserved + set_aside,
                rayon::current_num_threads(),
            )
            .map_err(|no| match no {
                NoSplit::Unsplittable(message) => self.plan_error(message),
                NoSplit::Least {
                    split: [n1, n2],
                    blocks: [first, second],
                } => (self.projection(1, "block", first.max(second)))
                    .holding(format!(
                        "an even split of a line of length {} into rows and columns ({n1} × \
                         {n2}), one line a block at the least: {} in the first pass, {} in \
                         the second",
                        axis_transform.len,
                        human_readable_size(first),
                        human_readable_size(second)
                    ))
                    .and(
                        reserved + set_aside,
                        "what reading the output (half the limit), a detrend's sums and reads \
                         ahead hold",
                    )
                    .refusal(limit),
            })
        };
        let mut plan = plan_with(0)?;
        let mut read_ahead = [0, 0];
        if reads_ahead.contains(&true) {
            let room = limit.saturating_sub(reserved);
            let enough = |left: [usize; 2]| {
                (0..2).all(|pass| !reads_ahead[pass] || left[pass] >= limit / 16)
            };
            if !enough(plan.left_over(room)) {
                plan = plan_with(limit / 8)?;
            }
            let left = plan.left_over(room);
            read_ahead = [0, 1].map(|pass| if reads_ahead[pass] { left[pass] } else { 0 });
        }
        let (shape, single) = (input.shape, input.single);
        let four_step = tokio::task::spawn_blocking(move || {
            FourStep::create(
                plan,
                &shape,
                single,
                &work_dir,
                io_concurrency,
                read_ahead,
                &runtime,
            )
        })
        .await
        .map_err(|e| DataFusionError::Execution(format!("the FFT planner stopped: {e}")))??;
        Ok(Self {
            source,
            four_step: Some(Arc::new(four_step)),
            ..self.clone()
        })
    }

    /// The source with this transform's detrend (if any) removed over
    /// `axes` by a pass gathering the fit first (see
    /// [`super::source::detrended`]), and the bytes its sums hold: for paths whose
    /// blocks do not hold whole groups along `axes`. The pass's tasks and
    /// the sums fit `room` bytes.
    fn detrended_source(&self, axes: Vec<usize>, room: usize) -> Result<(ArraySource, usize)> {
        let Some(detrend) = self.transform.options.detrend else {
            return Ok((self.source.clone(), 0));
        };
        let sums = DetrendedSource::sums_memory(&self.source.shape(), &axes);
        let task = DetrendedSource::task_memory(&self.source);
        (self.projection(1, "chunk", task))
            .holding(format!(
                "the {} detrend's fit, a pass over the source first, a chunk at a time",
                detrend.name()
            ))
            .and(sums, "every group's sums")
            .share("half of")
            .check(room)?;
        let room = room.saturating_sub(sums);
        let workers = (room / task.max(1)).clamp(1, rayon::current_num_threads().max(1));
        let source = DetrendedSource::new(self.source.clone(), axes, detrend, workers);
        Ok((ArraySource::Detrended(Arc::new(source)), sums))
    }

    /// This transform reading a copy of its Zarr variable in chunks small
    /// enough along the other dimensions (and whole along the transformed
    /// ones) for a block to fit `limit` twice over: the copy's metadata and
    /// coordinates are written to `work_dir` now (the rechunk refused if it
    /// cannot fit), its values on the first read. Refused when even a
    /// single line does not fit, or the source is not a Zarr variable.
    async fn rechunked(&self, state: &dyn Session, limit: usize) -> Result<FftTable> {
        let ArraySource::Zarr { grid, variable } = &self.source else {
            return plan_err!(
                "FftExec of '{}' variable '{}': a block of whole lines does not fit the memory \
                 limit (allowed_mem) of {}, and only a Zarr variable can be rechunked for it",
                self.source.store(),
                self.source.variable(),
                human_readable_size(limit)
            );
        };
        let shape = grid.shape();
        let mut block = self.source.chunk_shape();
        for (axis, _) in &self.transform.axes {
            block[*axis] = shape[*axis];
        }
        let room = limit.saturating_sub(kernel_memory(self)) / 2;
        for d in 0..block.len() {
            while !self.transform.transforms(d) && block[d] > 1 && block_memory(self, &block) > room
            {
                block[d] = block[d].div_ceil(2);
            }
        }
        if block_memory(self, &block) > room {
            let dims: Vec<&str> = self
                .transform
                .axes
                .iter()
                .map(|(_, a)| a.dim.as_str())
                .collect();
            // A block read while the one before is transformed.
            (self.projection(2, "block", block_memory(self, &block)))
                .holding(format!(
                    "lines along [{}] of a rechunked copy, as few as one, read and transformed",
                    dims.join(", ")
                ))
                .and(kernel_memory(self), "the kernel's threads")
                .advice(
                    "raise it, or transform one dimension at a time by the four-step path (SET \
                     zarrfusion.fft_strategy = 'auto' or 'four_step')",
                )
                .check(limit)?;
        }
        let chunks: Vec<(String, u64)> = grid
            .dims
            .iter()
            .zip(&block)
            .map(|(d, &c)| (d.name.clone(), c))
            .collect();
        let runtime = Arc::clone(state.runtime_env());
        let options = RechunkOptions::for_session(state.config_options(), &runtime)?;
        let (grid, variable) = (Arc::clone(grid), *variable);
        let copy = tokio::task::spawn_blocking(move || {
            RechunkedVariable::prepare(&grid, variable, &chunks, &options, &runtime)
        })
        .await
        .map_err(|e| DataFusionError::Execution(format!("the FFT planner stopped: {e}")))??;
        Ok(Self {
            source: ArraySource::Rechunked(Arc::new(copy)),
            ..self.clone()
        })
    }
}

#[async_trait]
impl TableProvider for FftTable {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }

    fn table_type(&self) -> TableType {
        TableType::Temporary
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> Result<Vec<TableProviderFilterPushDown>> {
        Ok(filters
            .iter()
            .map(|f| match self.pushed_dimension(f) {
                // Blocks outside the filter are not read; rows of the blocks
                // read are filtered above.
                Some(_) => TableProviderFilterPushDown::Inexact,
                None => TableProviderFilterPushDown::Unsupported,
            })
            .collect())
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let selection = match &self.source {
            ArraySource::Zarr { grid, .. } => {
                let pushed: Vec<Expr> = filters
                    .iter()
                    .filter(|f| self.pushed_dimension(f).is_some())
                    .cloned()
                    .collect();
                (!pushed.is_empty())
                    .then(|| select(&pushed, grid, state))
                    .transpose()?
            }
            // A rechunked source is made while scanning, after this.
            ArraySource::Transformed(_)
            | ArraySource::Rechunked(_)
            | ArraySource::Staged(_)
            | ArraySource::Detrended(_) => None,
        };
        let projection = projection
            .cloned()
            .unwrap_or_else(|| (0..self.schema.fields().len()).collect());
        let mut memory_limit = match state.runtime_env().memory_pool.memory_limit() {
            MemoryLimit::Finite(bytes) => Some(bytes),
            _ => None,
        };
        let fitted = self.fitted(state).await?;
        let mut selection = selection;
        if fitted.runs_passes_first() {
            // The passes run for every line; filters apply above. They hold
            // half the limit while the operator reads their output.
            selection = None;
            memory_limit = memory_limit.map(|l| l / 2);
        }
        let exec = FftExec::try_new(
            &fitted,
            projection,
            selection,
            limit,
            state.config_options(),
            memory_limit,
        )?;
        Ok(Arc::new(exec))
    }

    fn statistics(&self) -> Option<Statistics> {
        let mut stats = Statistics::new_unknown(&self.schema);
        stats.num_rows = Exactness::Exact(self.output_shape().iter().product::<u64>() as usize);
        Some(stats)
    }
}

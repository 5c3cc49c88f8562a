//! The `fft(...)` and `ifft(...)` table functions: a variable of a Zarr
//! table transformed along dimensions, as rows.
//!
//! ```sql
//! SELECT * FROM fft('era5', 't2m', dims => 'lat', true_phase => true, true_amplitude => true);
//! SELECT * FROM ifft('spectrum', 't2m', dims => 'freq_lat', lag => 45);
//! ```
//!
//! The first argument is a registered Zarr table, a view of a transform
//! (`CREATE VIEW spectrum AS SELECT * FROM fft(...)`: how SQL chains
//! transforms) or a store location, the second the variable (optional when
//! the table has one); named arguments are [`FftOptions`]. The result has one column per output dimension
//! (the transformed ones renamed `freq_<dim>` forward and back without the
//! prefix, with xrft's coordinates) and the transformed variable: complex
//! numbers as `Struct<re, im>` (complex64 from float32 input, complex128
//! otherwise), or real numbers for an inverse with a real dimension.
//!
//! On DataFrames, `df.fft(...)` and `df.ifft(...)` ([`fft_plan`]) apply to
//! a Zarr table or to another transform's output, so a spectrum can be
//! transformed back without being stored.
//!
//! [`FftExec`] reads blocks that hold whole lines along the transformed
//! dimensions (the store's chunks along the others, grown toward
//! `zarrfusion.target_partition_bytes`), transforms each with the CPU
//! kernel and streams its rows. Its projected memory (a block read,
//! transformed and turned into batches, per task) is checked against
//! `allowed_mem` while planning: fewer tasks run at once when that fits,
//! and a plan that cannot fit with one task is refused.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::catalog::{CatalogProviderList, Session};
use datafusion::common::stats::Precision as Exactness;
use datafusion::common::{
    human_readable_size, plan_err, resources_err, DataFusionError, Result, Statistics,
    TableReference,
};
use datafusion::datasource::{
    provider_as_source, source_as_provider, TableProvider, TableType, ViewTable,
};
use datafusion::execution::memory_pool::MemoryLimit;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::logical_expr::planner::{
    PlannedRelation, RelationPlanner, RelationPlannerContext, RelationPlanning,
};
use datafusion::logical_expr::{
    Expr, LogicalPlan, LogicalPlanBuilder, TableProviderFilterPushDown,
};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::sql::sqlparser::ast::TableFactor;
use futures::future::BoxFuture;
use zarrfusion_udfs::complex::{complex_part, complex_type};

use super::axis::AxisTransform;
use super::copy::WriteTasks;
use super::detrended::DetrendedSource;
use super::exec::{block_memory, kernel_lines_memory, kernel_memory, plan_blocks, FftExec};
use super::four_step::{divisors, FourStep, FourStepInput, FourStepPlan};
use super::options::FftOptions;
use super::source::{ArraySource, RechunkedVariable, SourceDimension};
use super::staged::StagedTransform;
use super::transform::FftTransform;
use crate::array::rechunk::{default_work_dir, RechunkOptions};
use crate::config::ZarrConfig;
use crate::device::{choose_device, staging_memory};
use crate::table::{
    literal_text, pushed_dimension, registered_table, select, store_table, Coordinate, Selection,
    TableFunctionCall, ZarrTable,
};
use crate::write::grid::{ZARR_ATTRIBUTES, ZARR_DIMENSION};
use crate::zarr::StoreLocation;

/// Plans `fft(...)` and `ifft(...)` in `FROM` clauses.
#[derive(Debug)]
pub struct FftPlanner {
    runtime: Arc<RuntimeEnv>,
    catalogs: Arc<dyn CatalogProviderList>,
}

impl FftPlanner {
    /// A planner finding registered tables in `catalogs` and opening
    /// stores with `runtime`'s object stores.
    pub fn new(runtime: Arc<RuntimeEnv>, catalogs: Arc<dyn CatalogProviderList>) -> Self {
        Self { runtime, catalogs }
    }
}

impl RelationPlanner for FftPlanner {
    fn plan_relation(
        &self,
        relation: TableFactor,
        context: &mut dyn RelationPlannerContext,
    ) -> Result<RelationPlanning> {
        let (call, function) = match TableFunctionCall::parse(&relation, "fft", context)? {
            Some(call) => (call, "fft"),
            None => match TableFunctionCall::parse(&relation, "ifft", context)? {
                Some(call) => (call, "ifft"),
                None => return Ok(RelationPlanning::Original(Box::new(relation))),
            },
        };
        let (source, variable) = match call.positional.as_slice() {
            [source] => (literal_text(source, function, "the table or store")?, None),
            [source, variable] => (
                literal_text(source, function, "the table or store")?,
                Some(literal_text(variable, function, "the variable")?),
            ),
            _ => {
                return plan_err!(
                    "{function} takes a table or store, the variable, then options \
                     ({function}('era5', 't2m', dims => 'lat'))"
                )
            }
        };
        let mut options = if function == "ifft" {
            FftOptions::inverse(Vec::new())
        } else {
            FftOptions::forward(Vec::new())
        };
        options.set(&call.named, function)?;
        // A registered table (a Zarr table, or a view of a transform: how
        // SQL chains them) is transformed as a DataFrame of it would be;
        // anything else names a store.
        let plan = match registered_table(&source, &self.catalogs, context) {
            Some(provider) => {
                let scan =
                    LogicalPlanBuilder::scan(source.as_str(), provider_as_source(provider), None)?
                        .build()?;
                fft_plan(scan, variable.as_deref(), options)?
            }
            None => {
                let table = store_table(&source, &self.runtime, context)?;
                let source = ArraySource::zarr_variable(
                    Arc::clone(table.grid()),
                    variable.as_deref(),
                    function,
                )?;
                fft_scan(source, options)?
            }
        };
        Ok(RelationPlanning::Planned(Box::new(PlannedRelation::new(
            plan, call.alias,
        ))))
    }
}

/// A logical scan of `source` transformed as `options` says: what
/// `fft(...)` and `ifft(...)` plan.
pub fn fft_scan(source: ArraySource, options: FftOptions) -> Result<LogicalPlan> {
    let name = if options.inverse { "ifft()" } else { "fft()" };
    LogicalPlanBuilder::scan(
        TableReference::bare(name),
        provider_as_source(Arc::new(FftTable::new(source, options)?)),
        None,
    )?
    .build()
}

/// `plan` transformed: what `DataFrame.fft` and `DataFrame.ifft` do. The
/// plan must be a scan of a Zarr table or of another transform's output,
/// as it is or under aliases, views and projections of all its columns
/// (`SELECT *`).
pub fn fft_plan(
    plan: LogicalPlan,
    variable: Option<&str>,
    options: FftOptions,
) -> Result<LogicalPlan> {
    let function = if options.inverse { "ifft" } else { "fft" };
    let node = underlying_scan(&plan);
    let LogicalPlan::TableScan(scan) = node else {
        return plan_err!(
            "{function} applies to a Zarr table or to an fft/ifft result, not to other \
             queries; write the result to Zarr (to_zarr) and transform that"
        );
    };
    if !scan.filters.is_empty() || scan.fetch.is_some() {
        return plan_err!(
            "{function} applies to a whole Zarr table or fft/ifft result; filter its output instead"
        );
    }
    let provider = source_as_provider(&scan.source)?;
    let any = provider.as_ref() as &dyn std::any::Any;
    if let Some(view) = any.downcast_ref::<ViewTable>() {
        return fft_plan(view.logical_plan().clone(), variable, options);
    }
    let source = if let Some(zarr) = any.downcast_ref::<ZarrTable>() {
        ArraySource::zarr_variable(Arc::clone(zarr.grid()), variable, function)?
    } else if let Some(inner) = any.downcast_ref::<FftTable>() {
        let has = inner.source.variable();
        if variable.is_some_and(|name| name != has) {
            return plan_err!(
                "{function} of '{}': unknown variable '{}' (the transform has '{has}')",
                inner.source.store(),
                variable.unwrap_or_default()
            );
        }
        ArraySource::Transformed(Arc::new(inner.clone()))
    } else {
        return plan_err!(
            "{function} applies to Zarr tables and fft/ifft results; '{}' is neither",
            scan.table_name
        );
    };
    fft_scan(source, options)
}

/// The node under `plan`'s aliases and projections that keep every
/// column as it is (in any order): the scan a transform can read when
/// `plan` is one.
fn underlying_scan(plan: &LogicalPlan) -> &LogicalPlan {
    match plan {
        LogicalPlan::SubqueryAlias(alias) => underlying_scan(&alias.input),
        LogicalPlan::Projection(projection) => {
            let input = projection.input.schema();
            let columns: Option<Vec<usize>> = projection
                .expr
                .iter()
                .map(|e| match e {
                    Expr::Column(c) => input.index_of_column(c).ok(),
                    _ => None,
                })
                .collect();
            match columns {
                Some(mut kept) => {
                    kept.sort_unstable();
                    kept.dedup();
                    if kept.len() == input.fields().len() {
                        underlying_scan(&projection.input)
                    } else {
                        plan
                    }
                }
                None => plan,
            }
        }
        _ => plan,
    }
}

/// A variable transformed along dimensions (see the module docs).
#[derive(Debug, Clone)]
pub struct FftTable {
    source: ArraySource,
    transform: Arc<FftTransform>,
    /// Output dimensions, outermost first.
    dims: Vec<SourceDimension>,
    schema: SchemaRef,
    /// The four-step transform, when lines go that way (set by `fitted`).
    four_step: Option<Arc<FourStep>>,
    /// The transform as asked, when this one runs only its last stage
    /// (set by `fitted` for a staged transform).
    asked: Option<Arc<FftTransform>>,
}

impl FftTable {
    /// `source` transformed as `options` says. Errors (unknown dimension,
    /// uneven or non-numeric coordinates, bad options) name the store and
    /// variable.
    pub fn new(source: ArraySource, options: FftOptions) -> Result<Self> {
        let function = if options.inverse { "ifft" } else { "fft" };
        let fail = |message: String| {
            DataFusionError::Plan(format!(
                "{function} of '{}' variable '{}': {message}",
                source.store(),
                source.variable()
            ))
        };
        let data_type = source.value_type();
        let part = complex_part(&data_type).unwrap_or(&data_type);
        if !part.is_numeric() {
            return Err(fail(format!("its values ({data_type}) are not numbers")));
        }
        let part_type = match part {
            DataType::Float32 | DataType::Float16 => DataType::Float32,
            _ => DataType::Float64,
        };
        let input_dims = source.dims();
        let names: Vec<String> = input_dims.iter().map(|d| d.name.clone()).collect();
        let transform = FftTransform::new(&names, &options, |name| {
            let dim = input_dims
                .iter()
                .find(|d| d.name == name)
                .ok_or_else(|| format!("unknown dimension '{name}'"))?;
            dim.input_coordinate()
        })
        .map_err(fail)?;
        let value_type = if transform.real_output() {
            part_type.clone()
        } else {
            complex_type(part_type.clone())
        };
        let mut fields = Vec::with_capacity(names.len() + 1);
        let mut dims = Vec::with_capacity(names.len());
        for (d, dim) in input_dims.into_iter().enumerate() {
            let output = match transform.axes.iter().find(|(a, _)| *a == d) {
                Some((_, axis)) => SourceDimension {
                    name: axis.output_name.clone(),
                    coordinate: Coordinate::Computed(Arc::new(axis.clone())),
                    direct_lag: (!options.inverse).then_some(axis.lag),
                    descends: false,
                },
                None => dim,
            };
            // The dimension's order, and xrft's attributes of a transformed
            // coordinate, kept by `COPY ... STORED AS ZARR` (an ifft of the
            // copy finds its lag there).
            let order = if output.descends {
                "descending"
            } else {
                "ascending"
            };
            let mut metadata = HashMap::from([(ZARR_DIMENSION.to_string(), order.to_string())]);
            if let Some((_, axis)) = transform.axes.iter().find(|(a, _)| *a == d) {
                let mut attributes = serde_json::Map::new();
                if let Some(lag) = output.direct_lag {
                    attributes.insert("direct_lag".into(), lag.into());
                }
                attributes.insert("spacing".into(), axis.spacing.into());
                metadata.insert(
                    ZARR_ATTRIBUTES.to_string(),
                    serde_json::Value::Object(attributes).to_string(),
                );
            }
            fields.push(
                Field::new(
                    &output.name,
                    output.coordinate.data_type(),
                    output.coordinate.nullable(),
                )
                .with_metadata(metadata),
            );
            dims.push(output);
        }
        let variable = source.variable().to_string();
        if dims.iter().any(|d| d.name == variable) {
            return Err(fail(
                "an output dimension is named like the variable; choose another prefix \
                 (prefix => 'k_')"
                    .to_string(),
            ));
        }
        fields.push(Field::new(&variable, value_type, true));
        Ok(Self {
            source,
            transform: Arc::new(transform),
            dims,
            schema: Arc::new(Schema::new(fields)),
            four_step: None,
            asked: None,
        })
    }

    /// The output schema: the dimensions, then the variable.
    pub fn schema_ref(&self) -> &SchemaRef {
        &self.schema
    }

    /// The dimension (of a Zarr source) a filter restricts, when it
    /// restricts one dimension the transform does not touch: such filters
    /// select the blocks read.
    fn pushed_dimension(&self, filter: &Expr) -> Option<usize> {
        let ArraySource::Zarr { grid, .. } = &self.source else {
            return None;
        };
        pushed_dimension(filter, grid).filter(|&d| !self.transform.transforms(d))
    }

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

    /// Whether passes run before the operator reads its blocks (the
    /// four-step path, or the first stage of a staged transform), holding
    /// half the memory limit while the operator holds the other half.
    pub(crate) fn runs_passes_first(&self) -> bool {
        self.four_step.is_some() || matches!(self.source, ArraySource::Staged(_))
    }

    /// The transform as asked, for `EXPLAIN` (a staged transform runs
    /// only its last dimensions itself).
    pub(crate) fn asked_transform(&self) -> &FftTransform {
        self.asked.as_deref().unwrap_or(&self.transform)
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
        let ArraySource::Transformed(inner) = &self.source else {
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
            (**inner).clone(),
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
        if !tasks.fits(Some(stage_limit)) {
            let stage = if chained {
                "the inner transform"
            } else {
                "the first stage"
            };
            return Err(self.plan_error(format!(
                "{stage} (along [{}]) needs {} for one task (a block of shape {:?}) \
                 plus {} for the kernel's threads, more than the {} it has (half of the memory \
                 limit, allowed_mem); raise the limit",
                inner_dims.join(", "),
                human_readable_size(tasks.task_memory),
                tasks.blocks.block_shape(),
                human_readable_size(tasks.kernel_memory),
                human_readable_size(stage_limit)
            )));
        }
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
            StagedTransform::prepare(inner, chained, tasks, chunks, &work_dir, &runtime)
        })
        .await
        .map_err(|e| DataFusionError::Execution(format!("the FFT planner stopped: {e}")))??;
        let outer = FftTable::new(ArraySource::Staged(Arc::new(stage)), options)?;
        let outer = outer.fit(state, Some(rest)).await?;
        // The output is this transform's: its coordinates and attributes.
        Ok(FftTable {
            dims: self.dims.clone(),
            schema: Arc::clone(&self.schema),
            asked: Some(Arc::clone(&self.transform)),
            ..outer
        })
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
            .map_err(|e| self.plan_error(e))
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
    /// [`super::detrended`]), and the bytes its sums hold: for paths whose
    /// blocks do not hold whole groups along `axes`. The pass's tasks and
    /// the sums fit `room` bytes.
    fn detrended_source(&self, axes: Vec<usize>, room: usize) -> Result<(ArraySource, usize)> {
        let Some(detrend) = self.transform.options.detrend else {
            return Ok((self.source.clone(), 0));
        };
        let sums = DetrendedSource::sums_memory(&self.source.shape(), &axes);
        let room = room.saturating_sub(sums);
        let task = DetrendedSource::task_memory(&self.source);
        if task > room {
            return Err(self.plan_error(format!(
                "the {} detrend is fitted in a pass over the source first, a chunk at a time, \
                 and a chunk needs {}, more than the {} the memory limit (allowed_mem) leaves it",
                format!("{detrend:?}").to_lowercase(),
                human_readable_size(task),
                human_readable_size(room)
            )));
        }
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
            return resources_err!(
                "FftExec of '{}' variable '{}': one line along [{}] needs {} read and \
                 transformed, more than half of what the memory limit (allowed_mem) of {} \
                 leaves beside the kernel's threads; raise the limit, or transform one \
                 dimension at a time by the four-step path (SET zarrfusion.fft_strategy = \
                 'auto' or 'four_step')",
                grid.store,
                self.source.variable(),
                dims.join(", "),
                human_readable_size(block_memory(self, &block)),
                human_readable_size(limit)
            );
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

    /// The four-step transform, when lines take that path.
    pub fn four_step(&self) -> Option<&Arc<FourStep>> {
        self.four_step.as_ref()
    }

    /// The shape blocks of the operator index: the source's (blocks whole
    /// along the transformed dimensions), or for the four-step path the
    /// output's.
    pub(crate) fn block_space(&self) -> Vec<u64> {
        match &self.four_step {
            Some(_) => self.output_shape(),
            None => self.source.shape(),
        }
    }

    /// The chunk blocks align to: the source's chunks, whole along the
    /// transformed dimensions; or for the four-step path its batches of
    /// lines and output chunks.
    pub(crate) fn block_chunk(&self) -> Vec<u64> {
        match &self.four_step {
            Some(four_step) => {
                let mut chunk = four_step.plan.batch.clone();
                chunk[four_step.plan.axis] = four_step.plan.output_chunk();
                chunk
            }
            None => {
                let mut chunk = self.source.chunk_shape();
                let shape = self.source.shape();
                for (axis, _) in &self.transform.axes {
                    chunk[*axis] = shape[*axis];
                }
                chunk
            }
        }
    }

    /// The output positions of block `extent` (see [`Self::block_space`]).
    pub(crate) fn output_extent(&self, extent: &[Range<u64>]) -> Vec<Range<u64>> {
        if self.four_step.is_some() {
            return extent.to_vec();
        }
        extent
            .iter()
            .enumerate()
            .map(
                |(d, r)| match self.transform.axes.iter().find(|(a, _)| *a == d) {
                    Some((_, axis)) => 0..axis.output_len() as u64,
                    None => r.clone(),
                },
            )
            .collect()
    }

    /// What the transform reads.
    pub fn source(&self) -> &ArraySource {
        &self.source
    }

    /// The transform.
    pub fn transform(&self) -> &FftTransform {
        &self.transform
    }

    /// The output dimensions, outermost first.
    pub fn output_dims(&self) -> Vec<SourceDimension> {
        self.dims.clone()
    }

    /// The output shape.
    pub fn output_shape(&self) -> Vec<u64> {
        self.transform.output_shape(&self.source.shape())
    }

    /// The Arrow type of the output values.
    pub fn value_type(&self) -> DataType {
        self.schema.field(self.dims.len()).data_type().clone()
    }

    /// Whether the transform computes in single precision (complex64).
    pub fn single_precision(&self) -> bool {
        let t = self.value_type();
        complex_part(&t).unwrap_or(&t) == &DataType::Float32
    }

    /// Bytes of one complex value in the transform's precision.
    pub fn complex_bytes(&self) -> usize {
        if self.single_precision() {
            8
        } else {
            16
        }
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

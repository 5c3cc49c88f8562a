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
//! [`FftExec`](super::exec::FftExec) reads blocks that hold whole lines
//! along the transformed dimensions (the store's chunks along the others,
//! grown toward `zarrfusion.target_partition_bytes`), transforms each with
//! the CPU kernel and streams its rows. Its projected memory (a block
//! read, transformed and turned into batches, per task) is checked against
//! `allowed_mem` while planning: fewer tasks run at once when that fits,
//! and a plan that cannot fit with one task is refused. Which path a
//! transform takes within the budget is [`super::fit`]'s choice.

use std::any::Any;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::catalog::CatalogProviderList;
use datafusion::common::{plan_err, DataFusionError, Result, TableReference};
use datafusion::datasource::{provider_as_source, source_as_provider, ViewTable};
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::logical_expr::planner::{
    PlannedRelation, RelationPlanner, RelationPlannerContext, RelationPlanning,
};
use datafusion::logical_expr::{Expr, LogicalPlan, LogicalPlanBuilder};
use datafusion::sql::sqlparser::ast::TableFactor;
use zarrfusion_udfs::complex::{complex_part, complex_type};

use super::four_step::FourStep;
use super::options::{Detrend, FftOptions};
use super::source::{ArraySource, DetrendedSource, SourceDimension, TransformOutput};
use super::transform::FftTransform;
use crate::table::{
    literal_text, pushed_dimension, registered_table, store_table, Coordinate, GridTable,
    TableFunctionCall, ZarrTable,
};
use crate::write::grid::{ZARR_ATTRIBUTES, ZARR_DIMENSION};

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
    pub(super) source: ArraySource,
    pub(super) transform: Arc<FftTransform>,
    /// Output dimensions, outermost first.
    pub(super) dims: Vec<SourceDimension>,
    pub(super) schema: SchemaRef,
    /// The four-step transform, when lines go that way (set by `fitted`).
    pub(super) four_step: Option<Arc<FourStep>>,
    /// The transform as asked, when this one runs only its last stage
    /// (set by `fitted` for a staged transform).
    pub(super) asked: Option<Arc<FftTransform>>,
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
                    model_calendar: None,
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

    /// The variable and the transform of a four-step path that reads it
    /// (with its trend removed first when it has a detrend, see
    /// [`Self::detrended`]) from a table opened from a location: what a
    /// cluster's worker makes again ([`Self::of_chain`] of this one
    /// transform, then [`Self::with_received_detrend`]) to run its blocks of
    /// the passes ([`super::passes`]) and the detrend's fit
    /// ([`super::trend_pass`]). `None` for the other paths.
    pub fn four_step_chain(&self) -> Option<(&Arc<GridTable>, usize, &FftOptions)> {
        self.four_step.as_ref()?;
        let (grid, variable) = self.variable_read()?;
        grid.source.as_ref()?;
        Some((grid, variable, &self.transform.options))
    }

    /// The source with a trend removed that this transform reads (for the
    /// four-step path and a staged transform's first stage, whose blocks
    /// do not hold whole groups), `None` for other sources.
    pub fn detrended(&self) -> Option<&Arc<DetrendedSource>> {
        match &self.source {
            ArraySource::Detrended(detrended) => Some(detrended),
            _ => None,
        }
    }

    /// The Zarr variable this transform reads, as stored or with a trend
    /// removed.
    fn variable_read(&self) -> Option<(&Arc<GridTable>, usize)> {
        let source = match &self.source {
            ArraySource::Detrended(detrended) => &detrended.source,
            source => source,
        };
        match source {
            ArraySource::Zarr { grid, variable } => Some((grid, *variable)),
            _ => None,
        }
    }

    /// This transform of a Zarr variable as a cluster's worker makes it
    /// again when the session's removes a trend fitted over `axes` from
    /// its source: that source detrended, its sums given by the fit's
    /// tasks ([`super::trend_pass`]; `workers` of them gathering them
    /// when this process runs one of those tasks). Refused for another
    /// source, and for axes that are not one or two of the source's
    /// dimensions, in order, among them those this transform transforms.
    pub fn with_received_detrend(
        &self,
        detrend: Detrend,
        axes: Vec<usize>,
        workers: usize,
    ) -> Result<Self> {
        let source = match &self.source {
            ArraySource::Detrended(detrended) => &detrended.source,
            source => source,
        };
        let ArraySource::Zarr { .. } = source else {
            return plan_err!(
                "a detrend of '{}' is received for a transform of a stored variable only",
                self.source.store()
            );
        };
        let rank = source.shape().len();
        let ordered = axes.windows(2).all(|w| w[0] < w[1]);
        let covers = (self.transform.axes.iter()).all(|(a, _)| axes.contains(a));
        if axes.is_empty() || axes.len() > 2 || !ordered || !covers || axes[axes.len() - 1] >= rank
        {
            return plan_err!(
                "a detrend of '{}' fitted over dimensions {axes:?} of {rank}, for a transform \
                 along {:?}",
                self.source.store(),
                self.transform
                    .axes
                    .iter()
                    .map(|(a, _)| a)
                    .collect::<Vec<_>>()
            );
        }
        let detrended = DetrendedSource::received(source.clone(), axes, detrend, workers);
        Ok(Self {
            source: ArraySource::Detrended(Arc::new(detrended)),
            ..self.clone()
        })
    }

    /// This transform with its detrended source's sums gathered by
    /// `workers` when this process runs its fit (itself without one).
    pub fn with_fit_workers(&self, workers: usize) -> Self {
        match &self.source {
            ArraySource::Detrended(detrended) => Self {
                source: ArraySource::Detrended(Arc::new(detrended.with_workers(workers))),
                ..self.clone()
            },
            _ => self.clone(),
        }
    }

    /// The variable and the transforms this one makes of it, innermost
    /// first, when it reads a variable of a table opened from a location
    /// (itself, or through inner transforms; the variable with a trend
    /// removed first for a staged transform's first stage, see
    /// [`Self::detrended`]) block by block as planned, with nothing made
    /// in `work_dir` first: what a cluster's worker can make again
    /// ([`Self::of_chain`]). `None` for the other paths (a rechunked copy,
    /// the four-step path, a staged transform), which run in the session.
    pub fn chain(&self) -> Option<(&Arc<GridTable>, usize, Vec<&FftOptions>)> {
        if self.four_step.is_some() || self.asked.is_some() {
            return None;
        }
        let (grid, variable, mut transforms) = match &self.source {
            ArraySource::Transformed(inner) => {
                let inner = inner.as_any().downcast_ref::<Self>()?;
                // A detrend travels with the innermost transform only.
                inner.detrended().is_none().then_some(())?;
                inner.chain()?
            }
            _ => {
                let (grid, variable) = self.variable_read()?;
                (grid, variable, Vec::new())
            }
        };
        grid.source.as_ref()?;
        transforms.push(&self.transform.options);
        Some((grid, variable, transforms))
    }

    /// Variable `variable` of `grid` transformed by `transforms` in turn
    /// (innermost first): a [`Self::chain`] made again.
    pub fn of_chain(
        grid: Arc<GridTable>,
        variable: &str,
        transforms: Vec<FftOptions>,
    ) -> Result<Self> {
        let mut transforms = transforms.into_iter();
        let Some(first) = transforms.next() else {
            return plan_err!("a chain of transforms of '{}' has none", grid.store);
        };
        let function = if first.inverse { "ifft" } else { "fft" };
        let source = ArraySource::zarr_variable(grid, Some(variable), function)?;
        let mut table = Self::new(source, first)?;
        for options in transforms {
            table = Self::new(ArraySource::Transformed(Arc::new(table)), options)?;
        }
        Ok(table)
    }

    /// This transform reading variable `variable` of `copy` (a rechunked
    /// copy of its variable, with the same coordinates, as a cluster's
    /// worker opened it) instead of the variable as stored.
    pub fn reading_copy(self, copy: Arc<GridTable>, variable: usize) -> Self {
        Self {
            source: ArraySource::Zarr {
                grid: copy,
                variable,
            },
            ..self
        }
    }

    /// This transform by the four-step path whose plan and intermediates
    /// are `four_step` (as a cluster's worker opened them).
    pub fn with_four_step(self, four_step: Arc<FourStep>) -> Self {
        Self {
            four_step: Some(four_step),
            ..self
        }
    }

    /// This transform, the last stage of `asked` (a staged transform, or
    /// one whose inner transform is stored first), giving `asked`'s
    /// output: its coordinates, their attributes and its schema.
    pub fn giving_output_of(self, asked: &FftTable) -> Self {
        Self {
            dims: asked.dims.clone(),
            schema: Arc::clone(&asked.schema),
            asked: Some(Arc::clone(&asked.transform)),
            ..self
        }
    }

    /// The first dimension along which blocks of shape `block` (of
    /// [`Self::block_space`]) cut the lines of this transform or of an
    /// inner one, which blocks must hold whole; `None` when none does.
    pub(crate) fn cut_lines(&self, block: &[u64]) -> Option<usize> {
        let shape = self.block_space();
        let mut table = Some(self);
        while let Some(t) = table {
            for (axis, _) in &t.transform.axes {
                if block.get(*axis).is_none_or(|&b| b < shape[*axis]) {
                    return Some(*axis);
                }
            }
            table = match &t.source {
                ArraySource::Transformed(inner) => inner.as_any().downcast_ref::<Self>(),
                _ => None,
            };
        }
        None
    }

    /// The output schema: the dimensions, then the variable.
    pub fn schema_ref(&self) -> &SchemaRef {
        &self.schema
    }

    /// The dimension (of a Zarr source) a filter restricts, when it
    /// restricts one dimension the transform does not touch: such filters
    /// select the blocks read.
    pub(super) fn pushed_dimension(&self, filter: &Expr) -> Option<usize> {
        let ArraySource::Zarr { grid, .. } = &self.source else {
            return None;
        };
        pushed_dimension(filter, grid).filter(|&d| !self.transform.transforms(d))
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

    /// The four-step transform, when lines take that path.
    pub fn four_step(&self) -> Option<&Arc<FourStep>> {
        self.four_step.as_ref()
    }

    /// On the four-step path, the first dimension along which blocks of
    /// shape `block` (of [`Self::block_space`]) are not whole blocks of
    /// its output (multiples of [`Self::block_chunk`], or the whole
    /// dimension), which a cluster's worker reads only whole; `None` when
    /// none is.
    pub(crate) fn cuts_output_blocks(&self, block: &[u64]) -> Option<usize> {
        let (shape, chunk) = (self.block_space(), self.block_chunk());
        (0..shape.len()).find(|&d| !block[d].is_multiple_of(chunk[d].max(1)) && block[d] < shape[d])
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

impl TransformOutput for FftTable {
    fn source(&self) -> &ArraySource {
        FftTable::source(self)
    }

    fn transform(&self) -> &FftTransform {
        FftTable::transform(self)
    }

    fn output_dims(&self) -> Vec<SourceDimension> {
        FftTable::output_dims(self)
    }

    fn output_shape(&self) -> Vec<u64> {
        FftTable::output_shape(self)
    }

    fn value_type(&self) -> DataType {
        FftTable::value_type(self)
    }

    fn complex_bytes(&self) -> usize {
        FftTable::complex_bytes(self)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

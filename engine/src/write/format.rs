//! Registering Zarr as a DataFusion file format, so that `COPY ... TO
//! 'out.zarr'` and `STORED AS ZARR` reach [`ZarrSink`]. Zarr stores are
//! read as tables ([`crate::table`]), not through this format: its reading
//! methods say so.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::catalog::Session;
use datafusion::common::stats::Precision;
use datafusion::common::{
    human_readable_size, not_impl_err, plan_err, DataFusionError, GetExt, Result, Statistics,
};
use datafusion::datasource::file_format::file_compression_type::FileCompressionType;
use datafusion::datasource::file_format::{FileFormat, FileFormatFactory};
use datafusion::datasource::physical_plan::{
    FileOpener, FileScanConfig, FileSinkConfig, FileSource,
};
use datafusion::datasource::sink::DataSinkExec;
use datafusion::datasource::table_schema::TableSchema;
use datafusion::execution::memory_pool::MemoryLimit;
use datafusion::execution::session_state::SessionState;
use datafusion::physical_expr::LexRequirement;
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion::physical_plan::statistics::StatisticsContext;
use datafusion::physical_plan::{ExecutionPlan, StatisticsArgs};
use object_store::{ObjectMeta, ObjectStore};
use serde_json::{Map, Value};
use zarrfusion_udfs::calendar::Calendar;

use super::grid::grid_bytes;
use super::options::ZarrWriteOptions;
use super::rows::{input_memory, Streamed};
use super::sink::ZarrSink;
use super::target::CopyTarget;
use crate::config::ZarrConfig;
use crate::plan_methods::no_expressions_method;
use crate::table::registered_zarr_tables;
use crate::write::grid::{ZARR_ATTRIBUTES, ZARR_CALENDAR, ZARR_DIMENSION};
use crate::zarr::{decoded_attributes, StoreLocation};

const READ_HINT: &str = "Zarr stores are read with CREATE EXTERNAL TABLE ... STORED AS ZARR or read_zarr(...), not as files";

/// Makes [`ZarrFormat`]s from COPY options.
#[derive(Debug, Default)]
pub struct ZarrFormatFactory;

impl GetExt for ZarrFormatFactory {
    fn get_ext(&self) -> String {
        "zarr".into()
    }
}

impl FileFormatFactory for ZarrFormatFactory {
    fn create(
        &self,
        state: &dyn Session,
        format_options: &HashMap<String, String>,
    ) -> Result<Arc<dyn FileFormat>> {
        let options = ZarrWriteOptions::from_map(format_options)?;
        Ok(Arc::new(ZarrFormat {
            options,
            known: session_columns(state),
        }))
    }

    fn default(&self) -> Arc<dyn FileFormat> {
        Arc::new(ZarrFormat {
            options: ZarrWriteOptions::default(),
            known: KnownColumns::default(),
        })
    }
}

/// A column of the Zarr tables registered in the session, by name: a
/// dimension (what COPY treats as a dimension when no `dims` option is
/// given, and how its coordinate is ordered) or a variable, and the
/// attributes a result's column of that name is written with.
#[derive(Debug, Default)]
struct KnownColumn {
    /// Whether a registered table's coordinate of this name descends.
    descends: bool,
    /// The column's types in the registered tables.
    data_types: Vec<DataType>,
    /// The attributes xarray shows of the array (`units`, `long_name`,
    /// ...): those the registered tables' arrays of this name agree on.
    attributes: Map<String, Value>,
    /// The model calendar of each registered array's times (none for
    /// other values or Gregorian times).
    calendars: Vec<Option<Calendar>>,
}

impl KnownColumn {
    /// The attributes a result's column `field` of this name is written
    /// with: the registered arrays', when the column holds the same kind
    /// of values (numbers for numbers, times for times: a latitude
    /// coarsened, a time truncated to the day, a variable's daily mean
    /// keep their units and names; a month number named `time` does not).
    fn attributes_for(&self, field: &Field) -> Option<&Map<String, Value>> {
        let column = field.data_type();
        let timestamp = |t: &DataType| matches!(t, DataType::Timestamp(..));
        let same_kind = |known: &DataType| {
            known == column
                || (known.is_numeric() && column.is_numeric())
                || (timestamp(known) && timestamp(column))
        };
        (self.data_types.iter().all(same_kind) && !self.attributes.is_empty())
            .then_some(&self.attributes)
    }

    /// The model calendar a result's time column `field` of this name is
    /// written in: the one every registered array of this name has.
    fn calendar_for(&self, field: &Field) -> Option<Calendar> {
        let first = *self.calendars.first()?;
        let times = matches!(field.data_type(), DataType::Timestamp(..));
        (times && self.calendars.iter().all(|c| *c == first))
            .then_some(first)
            .flatten()
    }

    /// Adds a registered array of this name: of `data_type`, with
    /// `attributes` (as xarray shows them), a coordinate that `descends`,
    /// of times of the model calendar `calendar`.
    fn add(
        &mut self,
        descends: bool,
        data_type: DataType,
        attributes: Map<String, Value>,
        calendar: Option<Calendar>,
    ) {
        self.calendars.push(calendar);
        if self.data_types.is_empty() {
            self.attributes = attributes;
        } else {
            (self.attributes).retain(|key, value| attributes.get(key) == Some(value));
        }
        self.descends |= descends;
        if !self.data_types.contains(&data_type) {
            self.data_types.push(data_type);
        }
    }
}

/// The dimensions and variables of the Zarr tables registered in the
/// session, by name (see [`KnownColumn`]).
#[derive(Debug, Default)]
struct KnownColumns {
    dims: BTreeMap<String, KnownColumn>,
    variables: BTreeMap<String, KnownColumn>,
}

/// The columns of the Zarr tables registered in the session.
fn session_columns(state: &dyn Session) -> KnownColumns {
    let mut known = KnownColumns::default();
    let Some(state) = state.as_any().downcast_ref::<SessionState>() else {
        return known;
    };
    // Planning is synchronous here; the session's schemas answer at once.
    let tables = futures::executor::block_on(registered_zarr_tables(state.catalog_list().as_ref()));
    for grid in tables {
        for d in &grid.dims {
            let data_type = d.coordinate.data_type();
            let attributes = decoded_attributes(&d.attributes, &data_type);
            let calendar = (matches!(data_type, DataType::Timestamp(..)))
                .then(|| d.model_calendar().map(|time| time.calendar()))
                .flatten();
            let column = known.dims.entry(d.name.clone()).or_default();
            column.add(d.descends(), data_type, attributes, calendar);
        }
        for v in &grid.variables {
            let attributes = decoded_attributes(v.attributes(), v.data_type());
            let column = known.variables.entry(v.name().to_string()).or_default();
            column.add(false, v.data_type().clone(), attributes, None);
        }
    }
    known
}

/// Zarr as a write format.
#[derive(Debug)]
pub struct ZarrFormat {
    options: ZarrWriteOptions,
    known: KnownColumns,
}

impl ZarrFormat {
    /// The dimension columns of `schema`: the `dims` option, else the
    /// columns named like a registered Zarr table's dimensions or marked
    /// as dimensions in their field metadata ([`ZARR_DIMENSION`]: the
    /// output of `fft(...)`).
    fn dimension_columns(&self, schema: &SchemaRef) -> Result<Vec<usize>> {
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        let dims: Vec<usize> = match &self.options.dims {
            Some(dims) => dims
                .iter()
                .map(|d| match names.iter().position(|n| n == d) {
                    Some(i) => Ok(i),
                    None => plan_err!(
                        "Zarr option 'dims' names '{d}', which is not a column of the result ({})",
                        names.join(", ")
                    ),
                })
                .collect::<Result<_>>()?,
            None => (0..names.len())
                .filter(|&i| {
                    self.known.dims.contains_key(names[i])
                        || schema.field(i).metadata().contains_key(ZARR_DIMENSION)
                })
                .collect(),
        };
        if dims.is_empty() {
            return plan_err!(
                "cannot write Zarr: no column of the result ({}) is a dimension of a registered Zarr table; name them with OPTIONS ('dims' 'a,b')",
                names.join(", ")
            );
        }
        if dims.len() == names.len() {
            return plan_err!(
                "cannot write Zarr: the result has dimension columns but no variable"
            );
        }
        Ok(dims)
    }

    /// `schema` with the attributes of its columns that name a registered
    /// table's dimension (the columns `dims`) or variable (the others; see
    /// [`KnownColumn::attributes_for`]) in their field metadata
    /// ([`ZARR_ATTRIBUTES`], which the sink writes), where the column's
    /// metadata gives none (a transform's frequencies carry their own).
    fn with_attributes(&self, schema: &SchemaRef, dims: &[usize]) -> Result<SchemaRef> {
        let mut fields: Vec<Field> = schema.fields().iter().map(|f| f.as_ref().clone()).collect();
        for (i, field) in fields.iter_mut().enumerate() {
            let known = match dims.contains(&i) {
                true => &self.known.dims,
                false => &self.known.variables,
            };
            let Some(known) = known.get(field.name()) else {
                continue;
            };
            let mut metadata = field.metadata().clone();
            if !metadata.contains_key(ZARR_ATTRIBUTES) {
                if let Some(attributes) = known.attributes_for(field) {
                    let text = serde_json::to_string(attributes)
                        .map_err(|e| DataFusionError::Plan(format!("COPY TO Zarr: {e}")))?;
                    metadata.insert(ZARR_ATTRIBUTES.to_string(), text);
                }
            }
            if let Some(calendar) = known.calendar_for(field) {
                (metadata.entry(ZARR_CALENDAR.to_string()))
                    .or_insert_with(|| calendar.name().to_string());
            }
            field.set_metadata(metadata);
        }
        Ok(Arc::new(Schema::new_with_metadata(
            fields,
            schema.metadata().clone(),
        )))
    }
}

#[async_trait]
impl FileFormat for ZarrFormat {
    fn get_ext(&self) -> String {
        "zarr".into()
    }

    fn get_ext_with_compression(&self, _c: &FileCompressionType) -> Result<String> {
        Ok("zarr".into())
    }

    fn compression_type(&self) -> Option<FileCompressionType> {
        None
    }

    async fn infer_schema(
        &self,
        _state: &dyn Session,
        _store: &Arc<dyn ObjectStore>,
        _objects: &[ObjectMeta],
    ) -> Result<SchemaRef> {
        not_impl_err!("{READ_HINT}")
    }

    async fn infer_stats(
        &self,
        _state: &dyn Session,
        _store: &Arc<dyn ObjectStore>,
        _table_schema: SchemaRef,
        _object: &ObjectMeta,
    ) -> Result<Statistics> {
        not_impl_err!("{READ_HINT}")
    }

    async fn create_physical_plan(
        &self,
        _state: &dyn Session,
        _conf: FileScanConfig,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        not_impl_err!("{READ_HINT}")
    }

    async fn create_writer_physical_plan(
        &self,
        input: Arc<dyn ExecutionPlan>,
        state: &dyn Session,
        conf: FileSinkConfig,
        order_requirements: Option<LexRequirement>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if !conf.table_partition_cols.is_empty() {
            return not_impl_err!("COPY TO Zarr does not take PARTITIONED BY");
        }
        let location = StoreLocation::parse(&conf.original_url)?;
        let allowed = ZarrConfig::of(state.config_options()).allowed()?;
        allowed.check(&location, &conf.original_url)?;
        let target = CopyTarget::new(location, self.options.clone())?;
        target.check()?;
        let schema = input.schema();
        let dims = self.dimension_columns(&schema)?;
        let descending: Vec<bool> = dims
            .iter()
            .map(|&d| {
                let field = schema.field(d);
                match field.metadata().get(ZARR_DIMENSION) {
                    Some(order) => order == "descending",
                    None => (self.known.dims.get(field.name())).is_some_and(|k| k.descends),
                }
            })
            .collect();
        let streamed = Streamed::of(&input, state, &schema, &dims, &descending, &target)?;
        match &streamed {
            Some(streamed) => streamed.check_fits(&target.location, state)?,
            None => refuse_if_too_large(&input, &dims, &target.location, state)?,
        }
        let schema = self.with_attributes(&schema, &dims)?;
        let sink = ZarrSink::new(schema, target, dims, descending).streaming(streamed);
        Ok(Arc::new(DataSinkExec::new(
            input,
            Arc::new(sink),
            order_requirements,
        )))
    }

    fn file_source(&self, table_schema: TableSchema) -> Arc<dyn FileSource> {
        Arc::new(NoZarrFileSource {
            table_schema,
            metrics: ExecutionPlanMetricsSet::new(),
        })
    }
}

/// Refuses, before anything runs, a COPY whose result the sink could not
/// hold beside the query making it: the input's row count (where its
/// statistics know it) times the bytes of a row as batches, plus the dense
/// grid, plus what the query holds while it runs (where the session knows
/// it: a dense reduction's projection), over the memory limit. (Results
/// whose size is not known exactly are checked as their rows arrive.)
fn refuse_if_too_large(
    input: &Arc<dyn ExecutionPlan>,
    dims: &[usize],
    target: &StoreLocation,
    state: &dyn Session,
) -> Result<()> {
    let MemoryLimit::Finite(limit) = state.runtime_env().memory_pool.memory_limit() else {
        return Ok(());
    };
    let stats = StatisticsContext::new().compute(input.as_ref(), &StatisticsArgs::new())?;
    // Only a known count: an estimate could refuse a result that fits.
    let Precision::Exact(rows) = stats.num_rows else {
        return Ok(());
    };
    let schema = input.schema();
    let row_bytes: u64 = schema
        .fields()
        .iter()
        .map(|f| f.data_type().primitive_width().unwrap_or(16) as u64)
        .sum();
    let rows_bytes = rows as u64 * row_bytes;
    let grid = grid_bytes(&schema, dims, rows as u64);
    let query = input_memory(input, state, schema.fields().len())? as u64;
    let needed = rows_bytes.saturating_add(grid).saturating_add(query);
    if needed > limit as u64 {
        let beside = match query {
            0 => String::new(),
            held => format!(
                " beside {} the query holds",
                human_readable_size(held as usize)
            ),
        };
        // A refusal for memory, as every operator's (`ResourcesExhausted`:
        // Python's `ZarrMemoryError`).
        return Err(DataFusionError::ResourcesExhausted(format!(
            "ZarrSink: COPY TO Zarr ('{}') holds the whole result in memory before writing it: \
             about {rows} rows need {} as batches plus {} as the grid{beside} ({} in all), but \
             allowed_mem is {}. Write a smaller selection (WHERE on dimensions), copy the \
             table as it is (COPY t TO ..., which copies array by array), or raise allowed_mem",
            target,
            human_readable_size(rows_bytes as usize),
            human_readable_size(grid as usize),
            human_readable_size(needed as usize),
            human_readable_size(limit)
        )));
    }
    Ok(())
}

/// Zarr is not read as files; this source only refuses to open any.
struct NoZarrFileSource {
    table_schema: TableSchema,
    metrics: ExecutionPlanMetricsSet,
}

impl FileSource for NoZarrFileSource {
    fn create_file_opener(
        &self,
        _object_store: Arc<dyn ObjectStore>,
        _base_config: &FileScanConfig,
        _partition: usize,
    ) -> Result<Arc<dyn FileOpener>> {
        not_impl_err!("{READ_HINT}")
    }

    fn table_schema(&self) -> &TableSchema {
        &self.table_schema
    }

    fn with_batch_size(&self, _batch_size: usize) -> Arc<dyn FileSource> {
        Arc::new(Self {
            table_schema: self.table_schema.clone(),
            metrics: self.metrics.clone(),
        })
    }

    fn metrics(&self) -> &ExecutionPlanMetricsSet {
        &self.metrics
    }

    fn file_type(&self) -> &str {
        "zarr"
    }

    no_expressions_method!();
}

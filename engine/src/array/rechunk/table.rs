//! The `rechunk(...)` table function: a Zarr table read in new chunk shapes.
//!
//! ```sql
//! SELECT * FROM rechunk('era5', time => 240, lat => 16, lon => 16);
//! SELECT lat, lon, avg(t2m) FROM rechunk('demo/era5.zarr', time => 24) GROUP BY lat, lon;
//! ```
//!
//! The first argument is a registered Zarr table or a store location; each
//! named argument is a dimension and its new chunk length (other
//! dimensions keep theirs). The result has the rows of the source table,
//! and its partitions are the new chunks.
//!
//! When the query is planned ([`RechunkTable::scan`]), the rechunk is
//! planned against the session's `allowed_mem` (refused if it cannot fit)
//! and the rechunked store's metadata is written to a fresh directory in
//! the session's `work_dir`; [`RechunkExec`] copies the data there the
//! first time any partition runs (the variables the query reads, through
//! intermediate arrays when one pass does not fit) and then scans it. The
//! directory is removed when the plan is dropped, and a plan dropped
//! mid-copy cancels the copy. On a cluster the copy and the scan run on
//! the workers ([`RechunkExec::on_workers`]).

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use async_trait::async_trait;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::catalog::CatalogProviderList;
use datafusion::catalog::Session;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{
    exec_err, human_readable_size, plan_err, DataFusionError, Result, Statistics, TableReference,
};
use datafusion::datasource::{provider_as_source, source_as_provider, TableProvider, TableType};
use datafusion::execution::memory_pool::MemoryConsumer;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::planner::{
    PlannedRelation, RelationPlanner, RelationPlannerContext, RelationPlanning,
};
use datafusion::logical_expr::{
    Expr, LogicalPlan, LogicalPlanBuilder, TableProviderFilterPushDown, TableScanBuilder,
};
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricBuilder, MetricsSet};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties, StatisticsArgs,
};
use datafusion::sql::sqlparser::ast::TableFactor;
use futures::future::{BoxFuture, FutureExt, Shared};
use futures::{StreamExt, TryStreamExt};

use super::cluster::{round_leaves, Round};
use super::{fmt_array_plans, ArrayRechunk, PreparedRechunk, RechunkOptions, RechunkSummary};
use crate::plan_methods::{named_plan_methods, no_expressions_method};
use crate::table::{
    literal_text, open_dataset, zarr_source, TableFunctionCall, ZarrTable, ZarrTableOptions,
};
use crate::write::scratch::{default_work_dir, ScratchStore};
use crate::write::target::StagedTarget;

/// Plans `rechunk(...)` in `FROM` clauses.
#[derive(Debug)]
pub struct RechunkPlanner {
    runtime: Arc<RuntimeEnv>,
    catalogs: Arc<dyn CatalogProviderList>,
}

impl RechunkPlanner {
    /// A planner finding registered tables in `catalogs` and opening
    /// stores with `runtime`'s object stores.
    pub fn new(runtime: Arc<RuntimeEnv>, catalogs: Arc<dyn CatalogProviderList>) -> Self {
        Self { runtime, catalogs }
    }
}

impl RelationPlanner for RechunkPlanner {
    fn plan_relation(
        &self,
        relation: TableFactor,
        context: &mut dyn RelationPlannerContext,
    ) -> Result<RelationPlanning> {
        let Some(call) = TableFunctionCall::parse(&relation, "rechunk", context)? else {
            return Ok(RelationPlanning::Original(Box::new(relation)));
        };
        let usage = "rechunk takes a table or store, then dimension => chunk length \
                     (rechunk('era5', time => 240, lat => 16))";
        let [source] = call.positional.as_slice() else {
            return plan_err!("{usage}");
        };
        let source = literal_text(source, "rechunk", "the table or store")?;
        if call.named.is_empty() {
            return plan_err!("{usage}");
        }
        let mut chunks = Vec::new();
        for (dim, text) in &call.named {
            let Ok(len) = text.parse::<u64>() else {
                return plan_err!(
                    "rechunk: the chunk length of '{dim}' must be a positive integer, got '{text}'"
                );
            };
            chunks.push((dim.clone(), len));
        }
        let zarr = zarr_source(&source, &self.catalogs, &self.runtime, context)?;
        let plan = rechunk_scan(&zarr, chunks)?;
        Ok(RelationPlanning::Planned(Box::new(PlannedRelation::new(
            plan, call.alias,
        ))))
    }
}

/// A logical scan of `table` read in chunks `chunks` (`(dimension,
/// length)` pairs): what `rechunk(...)` and `DataFrame.rechunk` plan.
pub fn rechunk_scan(table: &ZarrTable, chunks: Vec<(String, u64)>) -> Result<LogicalPlan> {
    LogicalPlanBuilder::scan(
        TableReference::bare("rechunk()"),
        provider_as_source(Arc::new(RechunkTable::new(table, chunks)?)),
        None,
    )?
    .build()
}

/// `plan` reading its Zarr table in chunks `chunks`: what
/// `DataFrame.rechunk` does. The plan must be row-wise operations
/// (projections, filters, limits, aliases) over one scan of a Zarr table;
/// the scan is replaced by a scan of the rechunked table, which has the
/// same columns and rows.
pub fn rechunk_plan(plan: LogicalPlan, chunks: Vec<(String, u64)>) -> Result<LogicalPlan> {
    let mut scans = 0;
    let mut row_wise = true;
    plan.apply(|node| {
        match node {
            LogicalPlan::TableScan(_) => scans += 1,
            LogicalPlan::Projection(_)
            | LogicalPlan::Filter(_)
            | LogicalPlan::Limit(_)
            | LogicalPlan::SubqueryAlias(_) => {}
            _ => row_wise = false,
        }
        Ok(TreeNodeRecursion::Continue)
    })?;
    if scans != 1 || !row_wise {
        return plan_err!(
            "rechunk applies to a Zarr table and row-wise operations on it (select, filter, \
             limit); write a computed result in new chunks with to_zarr(path, chunks=...)"
        );
    }
    plan.transform_up(|node| {
        let LogicalPlan::TableScan(scan) = node else {
            return Ok(Transformed::no(node));
        };
        let provider = source_as_provider(&scan.source)?;
        let Some(zarr) = (provider.as_ref() as &dyn Any).downcast_ref::<ZarrTable>() else {
            return plan_err!(
                "rechunk applies to Zarr tables; '{}' is not one",
                scan.table_name
            );
        };
        let source = provider_as_source(Arc::new(RechunkTable::new(zarr, chunks.clone())?));
        let scan = TableScanBuilder::new(scan.table_name, source)
            .with_projection(scan.projection)
            .with_filters(scan.filters)
            .with_fetch(scan.fetch)
            .with_statistics_requests(scan.statistics_requests)
            .build()?;
        Ok(Transformed::yes(LogicalPlan::TableScan(scan)))
    })
    .map(|t| t.data)
}

/// A Zarr table in new chunk shapes (see the module docs).
#[derive(Debug, Clone)]
pub struct RechunkTable {
    source: ZarrTable,
    chunks: Vec<(String, u64)>,
}

impl RechunkTable {
    /// `source` read in chunks `chunks`; every named dimension must be one
    /// of the table's.
    pub fn new(source: &ZarrTable, chunks: Vec<(String, u64)>) -> Result<Self> {
        let grid = source.grid();
        for (dim, len) in &chunks {
            if !grid.dims.iter().any(|d| &d.name == dim) {
                return plan_err!(
                    "rechunk of '{}': unknown dimension '{dim}' (dimensions: {})",
                    grid.store,
                    grid.dims_name().replace('_', ", ")
                );
            }
            if *len == 0 {
                return plan_err!(
                    "rechunk of '{}': the chunk length of '{dim}' must be positive",
                    grid.store
                );
            }
        }
        Ok(Self {
            source: source.clone(),
            chunks,
        })
    }
}

impl RechunkTable {
    /// The table read.
    pub fn source(&self) -> &ZarrTable {
        &self.source
    }

    /// The new chunk lengths, `(dimension, length)`.
    pub fn chunks(&self) -> &[(String, u64)] {
        &self.chunks
    }

    /// Plans the rechunk of `variables` (the columns a query reads; only
    /// those are copied) against the session's `allowed_mem` (refused if
    /// it cannot fit) and writes the rechunked store's metadata and
    /// coordinates into a fresh directory of its `work_dir`: the store
    /// that the plan reading it ([`Rechunked::read_by`]) fills on first
    /// execution.
    pub async fn prepare(&self, state: &dyn Session, variables: Vec<String>) -> Result<Rechunked> {
        let runtime = Arc::clone(state.runtime_env());
        let mut options = RechunkOptions::for_session(state.config_options(), &runtime)?;
        let grid = self.source.grid();
        options.source_storage = grid.storage_options();
        let store = grid.store.clone();
        let chunks = self.chunks.clone();
        let (prepared, guard, work) = {
            let runtime = Arc::clone(&runtime);
            tokio::task::spawn_blocking(move || {
                let prepared = PreparedRechunk::new(&store, &chunks, &options, &runtime)?;
                let work_dir = options.work_dir.clone().unwrap_or_else(default_work_dir);
                let scratch =
                    ScratchStore::create(&work_dir, "zarrfusion-rechunked", ".zarr", &runtime)?;
                prepared.write_metadata(scratch.storage())?;
                // Coordinates now: opening the store reads them.
                let coordinates = AtomicBool::new(false);
                prepared.copy_arrays(scratch.storage(), None, is_coordinate, &coordinates)?;
                let copied = prepared.retained(|a| copied(a, &variables));
                // Made now (as the rechunked store is) so that a cluster's
                // workers find it when their rounds run.
                let work = (copied.has_intermediates())
                    .then(|| {
                        ScratchStore::create(copied.work_dir(), "zarrfusion-rechunk", "", &runtime)
                    })
                    .transpose()?;
                Ok::<_, DataFusionError>((copied, Arc::new(scratch), work.map(Arc::new)))
            })
            .await
            .map_err(|e| {
                DataFusionError::Execution(format!("the rechunk planner stopped: {e}"))
            })??
        };
        let dims: Vec<String> = grid.dims.iter().map(|d| d.name.clone()).collect();
        let table_options = ZarrTableOptions {
            dims: Some(dims),
            // A scratch store is opened once: nothing to keep for later.
            open_cache: Some(false),
            // In the source's bucket, with its client's options: what a
            // cluster's worker opens the store with (it may not have met
            // the bucket's client yet when it does).
            storage: match guard.location().in_bucket_of(&grid.store) {
                true => grid.storage_options(),
                false => HashMap::new(),
            },
            ..ZarrTableOptions::default()
        };
        let location = guard.location().to_string();
        let dataset = open_dataset(location, table_options.clone(), runtime).await?;
        let rechunked = ZarrTable::new(dataset.table(table_options.dims.as_deref())?)
            .with_pushdown(self.source.pushdown());
        if rechunked.schema().fields() != self.source.schema().fields() {
            return exec_err!(
                "rechunk of '{}': the rechunked store's columns ({}) differ from the source's ({})",
                grid.store,
                rechunked.schema(),
                self.source.schema()
            );
        }
        let job = Arc::new(CopyJob {
            prepared: Arc::new(prepared),
            store: guard,
            work,
            cancelled: Arc::new(AtomicBool::new(false)),
            copy: OnceLock::new(),
        });
        Ok(Rechunked {
            job,
            table: rechunked,
        })
    }
}

#[async_trait]
impl TableProvider for RechunkTable {
    fn schema(&self) -> SchemaRef {
        self.source.schema()
    }

    fn table_type(&self) -> TableType {
        TableType::Temporary
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> Result<Vec<TableProviderFilterPushDown>> {
        // The rechunked store has the source's coordinates.
        self.source.supports_filters_pushdown(filters)
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        // Only the variables the query reads are copied.
        let schema = self.source.schema();
        let variables: Vec<String> = match projection {
            Some(columns) => columns
                .iter()
                .map(|&i| schema.field(i).name().clone())
                .collect(),
            None => schema.fields().iter().map(|f| f.name().clone()).collect(),
        };
        let rechunked = self.prepare(state, variables).await?;
        let scan = (rechunked.table())
            .scan(state, projection, filters, limit)
            .await?;
        Ok(Arc::new(rechunked.read_by(scan)))
    }

    fn statistics(&self) -> Option<Statistics> {
        self.source.statistics()
    }
}

/// A rechunked store made while planning, its data not copied yet: a
/// table over it, and the copy that fills it.
#[derive(Debug)]
pub struct Rechunked {
    job: Arc<CopyJob>,
    table: ZarrTable,
}

impl Rechunked {
    /// The table over the rechunked store (the source's columns and rows).
    pub fn table(&self) -> &ZarrTable {
        &self.table
    }

    /// `plan`, which reads [`Self::table`], after the copy: it runs on its
    /// first execution.
    pub fn read_by(self, plan: Arc<dyn ExecutionPlan>) -> RechunkExec {
        RechunkExec::new(self.job, plan, false)
    }
}

/// Whether an array is a coordinate (a 1-D array named after its dimension).
fn is_coordinate(array: &ArrayRechunk) -> bool {
    array.dims.len() == 1 && array.dims[0] == array.name
}

/// Whether the copy of a query reading the columns `variables` includes
/// `array` (coordinates are copied while planning).
fn copied(array: &ArrayRechunk, variables: &[String]) -> bool {
    !is_coordinate(array) && variables.contains(&array.name)
}

/// The copy's outcome, shared by every partition waiting for it.
type CopyOutcome = Result<Arc<RechunkSummary>, Arc<DataFusionError>>;

/// The copy into the rechunked store, started once by whichever partition
/// runs first. Dropping the job (the plan) cancels a copy in flight; the
/// stores go when both the plan and the copy are done with them.
struct CopyJob {
    /// The rechunk of the arrays the query reads.
    prepared: Arc<PreparedRechunk>,
    store: Arc<ScratchStore>,
    /// The scratch store of the intermediate arrays, when an array takes
    /// more than one stage.
    work: Option<Arc<ScratchStore>>,
    cancelled: Arc<AtomicBool>,
    copy: OnceLock<Shared<BoxFuture<'static, CopyOutcome>>>,
}

impl fmt::Debug for CopyJob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CopyJob")
            .field("prepared", &self.prepared)
            .field("store", self.store.location())
            .finish()
    }
}

impl Drop for CopyJob {
    fn drop(&mut self) {
        self.cancelled.store(true, Ordering::Relaxed);
    }
}

impl CopyJob {
    /// The most memory the copy's tasks hold together.
    fn projected_memory(&self) -> u64 {
        (self.prepared.arrays())
            .map(ArrayRechunk::projected_memory)
            .max()
            .unwrap_or(0)
    }

    /// Starts the copy unless it has started, and waits for it. The copy
    /// reserves its projected memory in the session's memory pool.
    async fn run(&self, context: &Arc<TaskContext>) -> Result<Arc<RechunkSummary>> {
        let copy = self.copy.get_or_init(|| {
            let projected = self.projected_memory();
            let reservation = MemoryConsumer::new("RechunkExec").register(context.memory_pool());
            let reserved = reservation.try_grow(projected as usize).map_err(|e| {
                Arc::new(DataFusionError::ResourcesExhausted(format!(
                    "RechunkExec of '{}' needs {} for its tasks and the memory pool cannot \
                     give it: {e}",
                    self.prepared.source(),
                    human_readable_size(projected as usize)
                )))
            });
            let prepared = Arc::clone(&self.prepared);
            let (store, work) = (Arc::clone(&self.store), self.work.clone());
            let cancelled = Arc::clone(&self.cancelled);
            let handle = reserved.map(|()| {
                tokio::task::spawn_blocking(move || {
                    let work = work.as_deref();
                    let summary = prepared.copy_arrays(store.storage(), work, |_| true, &cancelled);
                    drop(reservation);
                    summary
                })
            });
            async move {
                let summary = handle?
                    .await
                    .map_err(|e| DataFusionError::Execution(format!("the rechunk stopped: {e}")))
                    .and_then(|s| s);
                summary.map(Arc::new).map_err(Arc::new)
            }
            .boxed()
            .shared()
        });
        copy.clone().await.map_err(DataFusionError::Shared)
    }
}

/// Copies the source into the rechunked store on first execution, then
/// runs its child, the plan reading the rechunked store: its scan, or a
/// dense reduction over it (a `GROUP BY` of `rechunk(...)`).
///
/// On a cluster ([`on_workers`](Self::on_workers)) the copy's tasks run on
/// the workers in rounds, one per stage of the rechunk
/// ([`crate::array::rechunk::RechunkTasksExec`]), writing into the
/// rechunked store, and its scan runs there too once the last round is
/// done (its child is then that scan after the rounds, which a
/// `distributed` rule puts together). The node itself only keeps the
/// stores for the query: a worker runs its child in its place.
#[derive(Debug)]
pub struct RechunkExec {
    job: Arc<CopyJob>,
    scan: Arc<dyn ExecutionPlan>,
    /// Whether the copy and the scan run on a cluster's workers.
    on_workers: bool,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl RechunkExec {
    fn new(job: Arc<CopyJob>, scan: Arc<dyn ExecutionPlan>, on_workers: bool) -> Self {
        Self {
            job,
            properties: Arc::clone(scan.properties()),
            scan,
            on_workers,
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }

    /// The copy's rounds on a cluster's workers (which write into the
    /// rechunked store, in `work_dir`: every worker must reach it), in
    /// order: each one's tasks, the tasks they add up to and what it is;
    /// none when the query copies no array (it reads coordinates only),
    /// `None` when this rechunk runs on the workers already.
    pub(crate) fn cluster_rounds(&self) -> Result<Option<Vec<Round>>> {
        if self.on_workers {
            return Ok(None);
        }
        let job = &self.job;
        let staged = StagedTarget::Scratch {
            location: job.store.location().to_string(),
        };
        let work = job.work.as_ref().map(|w| w.location());
        round_leaves(&job.prepared, &staged, work).map(Some)
    }

    /// The plan reading the rechunked store.
    pub fn read(&self) -> &Arc<dyn ExecutionPlan> {
        &self.scan
    }

    /// This rechunk with its copy and scan on a cluster's workers: `read`
    /// is its scan after the copy's rounds ([`Self::cluster_rounds`]).
    pub fn on_workers(&self, read: Arc<dyn ExecutionPlan>) -> Self {
        Self::new(Arc::clone(&self.job), read, true)
    }

    /// Whether the copy and the scan run on a cluster's workers.
    pub fn is_on_workers(&self) -> bool {
        self.on_workers
    }

    /// The plans of the arrays this query copies (the variables it reads).
    pub fn arrays(&self) -> impl Iterator<Item = &ArrayRechunk> {
        self.job.prepared.arrays()
    }
}

impl DisplayAs for RechunkExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let prepared = &self.job.prepared;
        write!(
            f,
            "RechunkExec: store={}, projected_memory={}, arrays=[",
            prepared.source(),
            human_readable_size(self.job.projected_memory() as usize)
        )?;
        fmt_array_plans(f, prepared.arrays())?;
        write!(f, "]")?;
        match self.on_workers {
            true => write!(f, ", copied and scanned by the cluster's workers"),
            false => Ok(()),
        }
    }
}

impl ExecutionPlan for RechunkExec {
    named_plan_methods!("RechunkExec");

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.scan]
    }

    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        vec![false]
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    no_expressions_method!();

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let [scan] = <[_; 1]>::try_from(children).map_err(|c| {
            DataFusionError::Internal(format!("RechunkExec takes one child, got {}", c.len()))
        })?;
        let job = Arc::clone(&self.job);
        Ok(Arc::new(Self::new(job, scan, self.on_workers)))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        if self.on_workers {
            // Run by the session, the rounds still run on the workers (the
            // scan waits for them); the stream keeps the stores alive.
            let keep = Arc::clone(&self.job);
            let stream = self.scan.execute(partition, context)?.map(move |batch| {
                let _stores = &keep;
                batch
            });
            return Ok(Box::pin(RecordBatchStreamAdapter::new(
                self.scan.schema(),
                stream.boxed(),
            )));
        }
        let job = Arc::clone(&self.job);
        let scan = Arc::clone(&self.scan);
        let bytes_read = MetricBuilder::new(&self.metrics).counter("bytes_read", partition);
        let bytes_written = MetricBuilder::new(&self.metrics).counter("bytes_written", partition);
        let copy_time = MetricBuilder::new(&self.metrics).subset_time("copy_time", partition);
        let reserved = MetricBuilder::new(&self.metrics).gauge("memory_reserved", partition);
        // The stream keeps the job (and so the rechunked store) alive: the
        // plan may be dropped once its streams exist.
        let keep = Arc::clone(&self.job);
        let stream = futures::stream::once(async move {
            let timer = copy_time.timer();
            let summary = job.run(&context).await?;
            timer.done();
            // Counted once, by partition 0.
            if partition == 0 {
                reserved.set(job.projected_memory() as usize);
                bytes_read.add(summary.bytes_read as usize);
                bytes_written.add(summary.bytes_written as usize);
            }
            scan.execute(partition, context)
        })
        .try_flatten()
        .map(move |batch| {
            let _stores = &keep;
            batch
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.scan.schema(),
            stream.boxed(),
        )))
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    fn statistics_from_inputs(
        &self,
        input_stats: &[Arc<Statistics>],
        _args: &StatisticsArgs,
    ) -> Result<Arc<Statistics>> {
        match input_stats {
            [stats, ..] => Ok(Arc::clone(stats)),
            _ => Ok(Arc::new(Statistics::new_unknown(&self.scan.schema()))),
        }
    }
}

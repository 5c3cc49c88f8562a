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
//! mid-copy cancels the copy.

use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

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

use super::{
    fmt_array_plans, ArrayRechunk, ClusterRounds, PreparedRechunk, RechunkOptions, RechunkSummary,
};
use crate::plan_methods::{named_plan_methods, no_expressions_method};
use crate::table::{
    literal_text, open_dataset, zarr_source, TableFunctionCall, ZarrScanExec, ZarrTable,
    ZarrTableOptions,
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
#[derive(Debug)]
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
        let runtime = Arc::clone(state.runtime_env());
        let mut options = RechunkOptions::for_session(state.config_options(), &runtime)?;
        let grid = self.source.grid();
        options.source_storage = grid.storage_options();
        let store = grid.store.clone();
        let chunks = self.chunks.clone();
        let (prepared, guard) = {
            let runtime = Arc::clone(&runtime);
            tokio::task::spawn_blocking(move || {
                let prepared = PreparedRechunk::new(&store, &chunks, &options, &runtime)?;
                let work_dir = options.work_dir.clone().unwrap_or_else(default_work_dir);
                let scratch =
                    ScratchStore::create(&work_dir, "zarrfusion-rechunked", ".zarr", &runtime)?;
                prepared.write_metadata(scratch.storage())?;
                // Coordinates now: opening the store reads them.
                prepared.copy_arrays(scratch.storage(), is_coordinate, &AtomicBool::new(false))?;
                Ok::<_, DataFusionError>((prepared, Arc::new(scratch)))
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
        let scan = rechunked.scan(state, projection, filters, limit).await?;
        // The copy is made by this process as the query starts: on a
        // cluster the scan (and what is above it) stays here.
        let scan = match scan.downcast_ref::<ZarrScanExec>() {
            Some(zarr) => Arc::new(zarr.with_tasks(1).on_the_session()) as _,
            None => scan,
        };
        // Only the variables the query reads are copied.
        let schema = self.source.schema();
        let variables = match projection {
            Some(columns) => columns
                .iter()
                .map(|&i| schema.field(i).name().clone())
                .collect(),
            None => schema.fields().iter().map(|f| f.name().clone()).collect(),
        };
        let job = Arc::new(CopyJob {
            prepared: Arc::new(prepared),
            variables,
            store: guard,
            cancelled: Arc::new(AtomicBool::new(false)),
            copy: OnceLock::new(),
        });
        Ok(Arc::new(RechunkExec::new(job, scan, None)))
    }

    fn statistics(&self) -> Option<Statistics> {
        self.source.statistics()
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
/// store's directory goes when both the plan and the copy are done with it.
struct CopyJob {
    prepared: Arc<PreparedRechunk>,
    /// The columns the query reads: the arrays to copy.
    variables: Vec<String>,
    store: Arc<ScratchStore>,
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
    /// Whether the copy includes `array` (coordinates were copied while planning).
    fn copies(&self, array: &ArrayRechunk) -> bool {
        copied(array, &self.variables)
    }

    /// The plans of the arrays the copy includes.
    fn arrays(&self) -> impl Iterator<Item = &ArrayRechunk> {
        self.prepared.arrays().filter(|a| self.copies(a))
    }

    /// The most memory the copy's tasks hold together.
    fn projected_memory(&self) -> u64 {
        self.arrays()
            .map(ArrayRechunk::projected_memory)
            .max()
            .unwrap_or(0)
    }

    /// Starts the copy unless it has started, and waits for it. The copy
    /// reserves its projected memory in the session's memory pool; on a
    /// cluster (`cluster`: its rounds) the workers copy and the session
    /// holds nothing for it.
    async fn run(
        &self,
        context: &Arc<TaskContext>,
        cluster: Option<&ClusterRounds>,
    ) -> Result<Arc<RechunkSummary>> {
        let copy = self.copy.get_or_init(|| {
            let projected = match cluster {
                Some(_) => 0,
                None => self.projected_memory(),
            };
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
            let store = Arc::clone(&self.store);
            let cancelled = Arc::clone(&self.cancelled);
            let variables = self.variables.clone();
            let (cluster, context) = (cluster.cloned(), Arc::clone(context));
            let handle = reserved.and_then(|()| {
                let runtime = tokio::runtime::Handle::try_current().map_err(|e| {
                    Arc::new(DataFusionError::Execution(format!(
                        "RechunkExec needs a runtime: {e}"
                    )))
                })?;
                Ok(tokio::task::spawn_blocking(move || {
                    let summary = match cluster {
                        Some(rounds) => {
                            let started = Instant::now();
                            (rounds.run(&runtime, &context, &cancelled, "the rechunk"))
                                .map(|()| planned_summary(rounds.prepared(), started))
                        }
                        None => {
                            let copies = |a: &ArrayRechunk| copied(a, &variables);
                            prepared.copy_arrays(store.storage(), copies, &cancelled)
                        }
                    };
                    drop(reservation);
                    summary
                }))
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

/// What the rechunk `prepared` did by its plan, its rounds having run on
/// a cluster's workers from `started`.
fn planned_summary(prepared: &PreparedRechunk, started: Instant) -> RechunkSummary {
    let arrays: Vec<ArrayRechunk> = prepared.arrays().cloned().collect();
    RechunkSummary {
        bytes_read: arrays.iter().map(|a| a.plan.bytes_read()).sum(),
        bytes_written: arrays.iter().map(|a| a.plan.bytes_written()).sum(),
        target_bytes: (arrays.iter())
            .filter_map(|a| a.plan.stages.last())
            .map(|s| s.bytes_written)
            .sum(),
        arrays,
        seconds: started.elapsed().as_secs_f64(),
    }
}

/// Copies the source into the rechunked store on first execution, then
/// runs its child, the scan of the rechunked store.
///
/// On a cluster ([`on_cluster`](Self::on_cluster)) the copy's tasks run on
/// the workers as its other inputs, one per round of the rechunk
/// ([`crate::array::rechunk::RechunkTasksExec`] under the gathering of
/// their counts), writing into the rechunked store; its scan stays in the
/// session.
#[derive(Debug)]
pub struct RechunkExec {
    job: Arc<CopyJob>,
    scan: Arc<dyn ExecutionPlan>,
    /// On a cluster: the copy's rounds.
    cluster: Option<ClusterRounds>,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl RechunkExec {
    fn new(
        job: Arc<CopyJob>,
        scan: Arc<dyn ExecutionPlan>,
        cluster: Option<ClusterRounds>,
    ) -> Self {
        Self {
            job,
            properties: Arc::clone(scan.properties()),
            scan,
            cluster,
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }

    /// This rechunk with its copy's rounds of tasks as inputs beside its
    /// scan, to run on a cluster's workers (which write into the rechunked
    /// store, in `work_dir`: every worker must reach it); `None` when they
    /// already are or the query copies no array (it reads coordinates
    /// only).
    pub fn on_cluster(&self) -> Result<Option<Self>> {
        if self.cluster.is_some() {
            return Ok(None);
        }
        let job = &self.job;
        let prepared = Arc::new(job.prepared.retained(|a| job.copies(a)));
        if prepared.rounds() == 0 {
            return Ok(None);
        }
        let staged = StagedTarget::Scratch {
            location: job.store.location().to_string(),
        };
        let rounds = ClusterRounds::plan(&prepared, staged)?;
        Ok(Some(Self::new(
            Arc::clone(job),
            Arc::clone(&self.scan),
            Some(rounds),
        )))
    }

    /// The plans of the arrays this query copies (the variables it reads).
    pub fn arrays(&self) -> impl Iterator<Item = &ArrayRechunk> {
        self.job.arrays()
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
        fmt_array_plans(f, self.job.arrays())?;
        write!(f, "]")?;
        match &self.cluster {
            Some(_) => write!(f, ", copied by the cluster's workers"),
            None => Ok(()),
        }
    }
}

impl ExecutionPlan for RechunkExec {
    named_plan_methods!("RechunkExec");

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        let rounds = self.cluster.iter().flat_map(|c| &c.rounds);
        std::iter::once(&self.scan).chain(rounds).collect()
    }

    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        vec![false; self.children().len()]
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        let mut kept = vec![false; self.children().len()];
        kept[0] = true;
        kept
    }

    no_expressions_method!();

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let Some((scan, rounds)) = children.split_first() else {
            return exec_err!("RechunkExec takes its scan and its rounds, got no child");
        };
        let cluster = match &self.cluster {
            Some(cluster) => Some(cluster.with_rounds(rounds.to_vec())?),
            None if rounds.is_empty() => None,
            None => return exec_err!("RechunkExec takes one child, got {}", children.len()),
        };
        let job = Arc::clone(&self.job);
        Ok(Arc::new(Self::new(job, Arc::clone(scan), cluster)))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let job = Arc::clone(&self.job);
        let scan = Arc::clone(&self.scan);
        let cluster = self.cluster.clone();
        let bytes_read = MetricBuilder::new(&self.metrics).counter("bytes_read", partition);
        let bytes_written = MetricBuilder::new(&self.metrics).counter("bytes_written", partition);
        let copy_time = MetricBuilder::new(&self.metrics).subset_time("copy_time", partition);
        let reserved = MetricBuilder::new(&self.metrics).gauge("memory_reserved", partition);
        // The stream keeps the job (and so the rechunked store) alive: the
        // plan may be dropped once its streams exist.
        let keep = Arc::clone(&self.job);
        let stream = futures::stream::once(async move {
            let timer = copy_time.timer();
            let summary = job.run(&context, cluster.as_ref()).await?;
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
            let _store = &keep.store;
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

//! The one place that builds a `SessionContext` with everything zarrfusion
//! adds: `STORED AS ZARR`, `read_zarr`, `rechunk`, the `zarrfusion.*` settings, scan
//! progress, the array plan nodes with their optimizer rules and planner,
//! and the functions of `zarrfusion-udfs`.
//!
//! ```no_run
//! use std::collections::HashMap;
//! use zarrfusion::{new_context, ZarrContextExt};
//!
//! # async fn example() -> datafusion::error::Result<()> {
//! let ctx = new_context();
//! ctx.register_zarr("era5", "demo/era5.zarr", HashMap::new()).await?;
//! let df = ctx.sql("SELECT lat, avg(t2m) FROM era5 GROUP BY lat ORDER BY lat").await?;
//! df.show().await?;
//! // Every dimension set is also a table in the schema named after the store:
//! ctx.sql("SELECT count(*) FROM era5.lat_lon").await?.show().await?;
//! # Ok(())
//! # }
//! ```

use datafusion::execution::FunctionRegistry;
use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::array::{ArrayRef, RecordBatch, StringArray};
use datafusion::catalog::{MemorySchemaProvider, SchemaProvider};
use datafusion::common::{exec_err, Result};
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::execution::session_state::SessionStateBuilder;
use datafusion::logical_expr::planner::RelationPlanner;
use datafusion::logical_expr::{LogicalPlan, SetVariable, Statement};
use datafusion::prelude::{DataFrame, SessionConfig, SessionContext};
use datafusion_distributed::display_plan_ascii;
use url::Url;

use crate::array::copy::CopyToArraysRule;
use crate::array::fft::FftPlanner;
use crate::array::planner::array_rows;
use crate::array::rechunk::RechunkPlanner;
use crate::array::{
    AlignedJoinRule, ArrayQueryPlanner, BroadcastJoinRule, DenseReductionRule, PartitionTotalsRule,
    RollingWindowRule,
};
use crate::config::{apply_runtime_settings, ZarrConfig, MAX_BATCH_ROWS, MAX_TARGET_PARTITIONS};
use crate::distributed::{distribute, keep_partial_aggregates, ClusterWorkers};
use crate::memory::unspilled_repartitions;
use crate::progress::ScanProgress;
use crate::table::{open_dataset, ReadZarrPlanner, ZarrTable, ZarrTableFactory, ZarrTableOptions};
use crate::window_frames::{physical_rules, CheckWindowFrames};
use crate::write::rows::RowGrids;
use crate::write::ZarrFormatFactory;

/// The default session configuration: information schema on, zarrfusion
/// settings and scan progress attached.
pub fn session_config() -> SessionConfig {
    SessionConfig::new()
        .with_information_schema(true)
        .with_option_extension(ZarrConfig::default())
        .with_extension(Arc::new(ScanProgress::default()))
}

/// A session with the default configuration and runtime.
pub fn new_context() -> SessionContext {
    new_context_with(session_config(), Arc::new(RuntimeEnv::default()))
}

/// A session with a given configuration (see [`session_config`]) and runtime
/// (memory pool, object stores, disk manager). A batch size or a number of
/// target partitions above [`MAX_BATCH_ROWS`] or [`MAX_TARGET_PARTITIONS`]
/// is lowered to it (`SET` refuses them).
pub fn new_context_with(config: SessionConfig, runtime: Arc<RuntimeEnv>) -> SessionContext {
    build_context(config, runtime, None)
}

/// A session whose queries run on `workers` (`zarrfusion worker`
/// processes; see [`crate::distributed`]): the stages of each physical plan
/// are handed to them, Zarr scans, dense reductions and rolling windows
/// split into tasks by their bytes (a dense reduction's tasks give partial
/// states, merged by DataFusion's final aggregate; a rolling window's tasks
/// each roll a run of blocks, reading the overlap before it; an aligned
/// join's zip is such a scan, of both stores; a join with a small result
/// keyed by dimensions runs its small side as a stage of its own, its rows
/// broadcast to the grid's tasks).
pub fn distributed_context(
    config: SessionConfig,
    runtime: Arc<RuntimeEnv>,
    workers: Vec<Url>,
) -> SessionContext {
    build_context(config, runtime, Some(workers))
}

fn build_context(
    config: SessionConfig,
    runtime: Arc<RuntimeEnv>,
    workers: Option<Vec<Url>>,
) -> SessionContext {
    let runtime = unspilled_repartitions(runtime);
    let config = if config.get_extension::<ScanProgress>().is_none() {
        config.with_extension(Arc::new(ScanProgress::default()))
    } else {
        config
    };
    let config = if config.options().extensions.get::<ZarrConfig>().is_none() {
        config.with_option_extension(ZarrConfig::default())
    } else {
        config
    };
    // Held to the bounds `SET` checks (`check_setting`), for a config built
    // in Rust with larger ones.
    let (rows, partitions) = (config.batch_size(), config.target_partitions());
    let mut config = config
        .with_batch_size(rows.clamp(1, MAX_BATCH_ROWS))
        .with_target_partitions(partitions.clamp(1, MAX_TARGET_PARTITIONS));
    if workers.is_some() {
        keep_partial_aggregates(config.options_mut());
    }
    // `COPY` of a dense reduction writes its rows as they come (the writer
    // asks the operators above it which rows are a grid's cells; on a
    // cluster, a reduction's runs of bands are gathered in order).
    let config = config.with_extension(Arc::new(RowGrids(array_rows)));
    let read_zarr: Arc<dyn RelationPlanner> = Arc::new(ReadZarrPlanner::new(Arc::clone(&runtime)));
    let builder = SessionStateBuilder::new()
        .with_config(config)
        .with_runtime_env(Arc::clone(&runtime))
        .with_default_features()
        .with_analyzer_rule(Arc::new(CheckWindowFrames))
        .with_physical_optimizer_rules(physical_rules())
        .with_table_factory("ZARR".to_string(), Arc::new(ZarrTableFactory))
        .with_relation_planners(vec![read_zarr])
        .with_optimizer_rule(Arc::new(AlignedJoinRule))
        .with_optimizer_rule(Arc::new(PartitionTotalsRule))
        .with_optimizer_rule(Arc::new(DenseReductionRule))
        .with_optimizer_rule(Arc::new(BroadcastJoinRule))
        .with_optimizer_rule(Arc::new(RollingWindowRule))
        .with_optimizer_rule(Arc::new(CopyToArraysRule))
        .with_query_planner(Arc::new(ArrayQueryPlanner));
    let mut builder = match workers {
        Some(workers) => distribute(builder, workers),
        None => builder,
    };
    // `extract(month FROM time)` and `time - '2000-02-28'` over a time
    // column kept as numbers (a daily 360_day calendar's) read its dates:
    // planned as the model calendars' functions, ahead of DataFusion's
    // planner.
    if let Some(planners) = builder.expr_planners() {
        planners.insert(0, Arc::new(zarrfusion_udfs::CalendarExprPlanner));
    }
    let mut state = builder.build();
    let catalogs = Arc::clone(state.catalog_list());
    // `rechunk(...)`, `fft(...)` and `ifft(...)` look registered tables up
    // in the session's catalogs.
    let planners: [(&str, Arc<dyn RelationPlanner>); 2] = [
        (
            "rechunk",
            Arc::new(RechunkPlanner::new(
                Arc::clone(&runtime),
                Arc::clone(&catalogs),
            )),
        ),
        ("fft", Arc::new(FftPlanner::new(runtime, catalogs))),
    ];
    for (name, planner) in planners {
        if let Err(e) = state.register_relation_planner(planner) {
            log::warn!("the {name} table function could not be registered: {e}");
        }
    }
    // `extract(doy FROM time)` and `date_bin` count a model calendar's own days.
    let rewrite = Arc::new(zarrfusion_udfs::CalendarFunctionsRewrite);
    if let Err(e) = FunctionRegistry::register_function_rewrite(&mut state, rewrite) {
        log::warn!("the model calendars' date_part and date_bin could not be registered: {e}");
    }
    // `COPY ... TO 'out.zarr'` (or `STORED AS ZARR`) writes a Zarr store.
    if let Err(e) = state.register_file_format(Arc::new(ZarrFormatFactory), true) {
        log::warn!("the Zarr write format could not be registered: {e}");
    }
    let ctx = SessionContext::new_with_state(state);
    for udf in zarrfusion_udfs::all_scalar_functions() {
        ctx.register_udf(udf.as_ref().clone());
    }
    ctx
}

/// Plans and runs one SQL statement as zarrfusion's front doors do: like
/// `SessionContext::sql`, with `SET zarrfusion.allowed_mem` and
/// `zarrfusion.work_dir` applied to the runtime
/// ([`apply_runtime_settings`]).
pub async fn sql(ctx: &SessionContext, text: &str) -> Result<DataFrame> {
    let plan = ctx.state().create_logical_plan(text).await?;
    execute_plan(ctx, plan).await
}

/// Runs a planned statement as [`sql`] does (for front doors that parse
/// statements themselves): runtime settings applied, `EXPLAIN` in a session
/// with workers showing the distributed plan.
pub async fn execute_plan(ctx: &SessionContext, plan: LogicalPlan) -> Result<DataFrame> {
    if let Some(explained) = explain_distributed(ctx, &plan).await? {
        return Ok(explained);
    }
    let plan = apply_runtime_settings(ctx, plan)?;
    let sets_limit = matches!(
        &plan,
        LogicalPlan::Statement(Statement::SetVariable(SetVariable { variable, .. }))
            if variable.eq_ignore_ascii_case("datafusion.runtime.memory_limit")
    );
    let done = ctx.execute_logical_plan(plan).await?;
    if sets_limit {
        // DataFusion made a new pool for the limit: wrapped as every
        // session's is (`memory::UnspilledRepartitions`).
        let shared = ctx.state_ref();
        let mut state = shared.write();
        let runtime = unspilled_repartitions(Arc::clone(state.runtime_env()));
        *state = SessionStateBuilder::from(state.clone())
            .with_runtime_env(runtime)
            .build();
    }
    Ok(done)
}

/// `EXPLAIN` (not `ANALYZE`) in a session with workers: the logical plan
/// and the distributed plan (stages, their tasks, what crosses the
/// network), which DataFusion's own `EXPLAIN` does not plan.
async fn explain_distributed(
    ctx: &SessionContext,
    plan: &LogicalPlan,
) -> Result<Option<DataFrame>> {
    let LogicalPlan::Explain(explain) = plan else {
        return Ok(None);
    };
    if ctx
        .state()
        .config()
        .get_extension::<ClusterWorkers>()
        .is_none()
    {
        return Ok(None);
    }
    let state = ctx.state();
    let physical = state.create_physical_plan(&explain.plan).await?;
    let logical = state.optimize(&explain.plan)?;
    let batch = RecordBatch::try_from_iter([
        (
            "plan_type",
            Arc::new(StringArray::from(vec!["logical_plan", "distributed_plan"])) as ArrayRef,
        ),
        (
            "plan",
            Arc::new(StringArray::from(vec![
                logical.display_indent().to_string(),
                display_plan_ascii(physical.as_ref(), false),
            ])) as ArrayRef,
        ),
    ])?;
    ctx.read_batch(batch).map(Some)
}

/// Registering Zarr stores with a `SessionContext`.
#[async_trait]
pub trait ZarrContextExt {
    /// Registers the store at `url` (a path or object-store URL).
    ///
    /// `name` becomes a table over the default dimension set (the one with
    /// the most dimensions, or `options["dims"]`), and a schema holding one
    /// table per dimension set, named by its dimensions joined with `_`
    /// (`era5.time_lat_lon`, `era5.lat_lon`), as xarray-sql does.
    async fn register_zarr(
        &self,
        name: &str,
        url: &str,
        options: HashMap<String, String>,
    ) -> Result<()>;
}

#[async_trait]
impl ZarrContextExt for SessionContext {
    async fn register_zarr(
        &self,
        name: &str,
        url: &str,
        options: HashMap<String, String>,
    ) -> Result<()> {
        let options =
            ZarrTableOptions::from_map(&options)?.with_session(self.state().config().options())?;
        let (dims, pushdown) = (options.dims.clone(), options.pushdown);
        let dataset = open_dataset(url.to_string(), options, self.runtime_env()).await?;
        let default_table = dataset.table(dims.as_deref())?;
        let schema = MemorySchemaProvider::new();
        for table in dataset.tables() {
            let name = table.dims_name();
            schema.register_table(
                name,
                Arc::new(ZarrTable::new(table).with_pushdown(pushdown)),
            )?;
        }
        let catalog_name = self
            .state()
            .config()
            .options()
            .catalog
            .default_catalog
            .clone();
        let Some(catalog) = self.catalog(&catalog_name) else {
            return exec_err!("no catalog '{catalog_name}' to register '{name}' in");
        };
        catalog.register_schema(name, Arc::new(schema))?;
        self.register_table(
            name,
            Arc::new(ZarrTable::new(default_table).with_pushdown(pushdown)),
        )?;
        Ok(())
    }
}

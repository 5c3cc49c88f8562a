//! `COPY` of a selection of a Zarr table with computed variables, chunk by
//! chunk (planned by [`super::rule::CopyToArraysRule`]): when the query is a scan of a Zarr table under dimension filters
//! only, with every dimension as it is (in the table's order) and
//! variables that are `float32`/`float64` expressions of the table's
//! columns, the result is a grid known before anything is read: the
//! selected coordinates. It is written in two steps, as Cubed lowers work
//! to blockwise and rechunk:
//!
//! 1. *blockwise*: one task per chunk of an intermediate store in
//!    `work_dir` (chunks as long as the source's): it reads the source
//!    cells the chunk covers, evaluates the expressions and writes the
//!    chunk (NULL as NaN);
//! 2. *rechunk*: the intermediate store is rechunked into the target by
//!    [`crate::array::rechunk`], in the requested chunks, codec and format.
//!
//! Both steps run inside `allowed_mem` whatever the size of the result;
//! a plan whose tasks cannot fit is refused before it runs.
//!
//! ```sql
//! COPY (SELECT time, lat, lon, t2m - 273.15 AS t2m_c FROM era5 WHERE lat > 0)
//! TO 'era5_north.zarr' STORED AS ZARR OPTIONS ('chunks' 'time=240,lat=16,lon=16');
//! ```
//!
//! A variable may read the columns of a table joined in as a broadcast
//! ([`crate::array::broadcast`]: an anomaly against a climatology, when
//! the join keeps every cell): the copy computes the small side first (its
//! plan is the copy's input), holds it beside its steps' memory while the
//! chunks are written, and gathers it into each chunk's cells as a scan
//! does. On a cluster the small side's rows are broadcast to the workers
//! making step 1's chunks, each holding them as the session does here
//! ([`super::cluster`]).
//!
//! ```sql
//! COPY (SELECT era5.time, era5.lat, era5.lon, era5.t2m - clim.c AS anomaly
//!       FROM era5 JOIN (SELECT extract(month FROM time) AS month, lat, lon, avg(t2m) AS c
//!                       FROM era5 GROUP BY 1, 2, 3) clim
//!       ON extract(month FROM era5.time) = clim.month
//!          AND era5.lat = clim.lat AND era5.lon = clim.lon)
//! TO 'era5_anomaly.zarr' STORED AS ZARR;
//! ```

use std::fmt;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, SchemaRef};
use datafusion::catalog::Session;
use datafusion::common::{human_readable_size, DFSchema, DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::physical_planning_context::PhysicalPlanningContext;
use datafusion::logical_expr::{
    Expr, ExprSchemable, TableProviderFilterPushDown, UserDefinedLogicalNodeCore,
};
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use datafusion::physical_planner::PhysicalPlanner;

use super::cluster::ClusterSelection;
use super::steps::{Blockwise, CopyGrid, OutputVariable};
use super::whole::{split_columns, CopyScan};
use crate::array::blockwise::{source_long_block, Evaluate, JoinedMemory, Step};
use crate::array::scan_path::TableRead;
use crate::plan_methods::{
    leaf_node_methods, metered_plan_methods, named_plan_methods, no_expressions_method,
    node_identity,
};
use crate::table::{classify_filters, Broadcast, BroadcastInputs};
use crate::write::target::CopyTarget;
use crate::write::write_job::{count_properties, Joined, WriteJob};
use crate::zarr::StoreLocation;

/// The [`SelectionCopy`] that a COPY is, when it reads a Zarr table under
/// dimension filters only, with the table's dimensions as they are (in its
/// order; each coordinate strictly monotonic) and at least one
/// `float32`/`float64` expression of its columns.
pub(crate) fn selection_copy(scan: &CopyScan<'_>) -> Result<Option<SelectionCopy>> {
    let (path, table) = (&scan.path, &scan.table);
    let mut filters = path.scan.filters.clone();
    filters.extend(path.predicates.iter().cloned());
    let refs: Vec<&Expr> = filters.iter().collect();
    if classify_filters(&refs, table)
        .iter()
        .any(|c| *c != TableProviderFilterPushDown::Exact)
    {
        return Ok(None);
    }
    if table.dims.iter().any(|d| d.strict_order().is_none()) {
        return Ok(None);
    }
    let dims: Vec<&str> = table.dims.iter().map(|d| d.name.as_str()).collect();
    let input_schema = Arc::new(DFSchema::try_from_qualified_schema(
        path.scan.table_name.clone(),
        &table.schema,
    )?);
    let coordinate =
        |name: &str, expr: &Expr| Ok(matches!(expr, Expr::Column(c) if c.name == name));
    let variable = |name: &str, expr: &Expr| {
        let data_type = expr.get_type(&input_schema)?;
        let float = matches!(data_type, DataType::Float32 | DataType::Float64);
        Ok(float.then(|| OutputVariable::new(name, expr, data_type)))
    };
    let Some(outputs) = split_columns(&dims, scan.named_columns(), coordinate, variable)? else {
        return Ok(None);
    };
    Ok(Some(SelectionCopy {
        read: TableRead::new(table, input_schema, filters),
        outputs,
        to: scan.to.clone(),
    }))
}

/// `COPY` of a selection of a Zarr table with computed variables. A leaf
/// node (it reads the table itself) whose output is the row count.
#[derive(Debug, Clone)]
pub struct SelectionCopy {
    /// The table read, its columns (qualified as the expressions name
    /// them), and the filters on single dimensions: the selection.
    pub read: TableRead,
    /// The variables written.
    pub outputs: Vec<OutputVariable>,
    /// Where it writes.
    pub to: CopyTarget,
}

impl SelectionCopy {
    fn key(&self) -> (&Vec<Expr>, &Vec<OutputVariable>, &StoreLocation) {
        (&self.read.filters, &self.outputs, &self.to.location)
    }

    /// Plans the copy: the selection, the expressions, the chunks of both
    /// steps and their memory; refused when the target exists, the
    /// selection is empty or a step cannot fit the memory budget.
    pub fn plan(
        &self,
        broadcasts: BroadcastInputs,
        planner: &dyn PhysicalPlanner,
        session: &dyn Session,
        planning: &PhysicalPlanningContext,
    ) -> Result<SelectionCopyExec> {
        self.to.check()?;
        let selection = self.read.select(session)?;
        let grid = CopyGrid::new(
            Arc::clone(&self.read.table),
            selection,
            &self.outputs,
            &|expr| Some(expr.clone()),
            &self.to,
            session,
        )?;
        // The columns the expressions read, in the table's order.
        let exprs = self.outputs.iter().map(|o| &o.expr);
        let (input_df, columns) = self.read.columns_read(exprs)?;
        let exprs = self
            .outputs
            .iter()
            .map(|o| planner.create_physical_expr(&o.expr, &input_df, session, planning))
            .collect::<Result<Vec<_>>>()?;
        let batch_schema: SchemaRef = Arc::new(input_df.as_arrow().clone());

        let block = source_long_block(&grid.table, &columns, &grid.shape);
        let joined = JoinedMemory::of(session.runtime_env().memory_pool.as_ref(), &broadcasts);
        let step = Evaluate::plan(
            &grid.selected(),
            &block,
            columns,
            batch_schema,
            exprs,
            grid.rechunk.threads,
            joined,
        )?;
        let blockwise = grid.blockwise(block, Step::Evaluate(step), joined.left())?;
        Ok(
            SelectionCopyExec::new(Arc::new(blockwise), ExecutionPlanMetricsSet::new())
                .with_broadcasts(broadcasts),
        )
    }

    /// The tables joined in that the variables read (an anomaly's
    /// climatology): what the copy computes first and holds.
    pub fn broadcasts_read(&self) -> Result<Vec<Arc<Broadcast>>> {
        let (_, columns) = self
            .read
            .columns_read(self.outputs.iter().map(|o| &o.expr))?;
        Ok(self.read.table.broadcasts_read(&columns))
    }
}

node_identity!(
    SelectionCopy,
    eq: |a, b| a.read.same_as(&b.read) && a.key() == b.key() && a.to == b.to,
    hash: |node, mut state| (&node.read.table.store, node.key()).hash(&mut state)
);

impl UserDefinedLogicalNodeCore for SelectionCopy {
    leaf_node_methods!("SelectionCopy", to.schema);

    fn fmt_for_explain(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let outputs: Vec<String> = self.outputs.iter().map(|o| o.to_string()).collect();
        write!(f, "SelectionCopy: ")?;
        self.read.fmt_table(f)?;
        let target = &self.to.location;
        write!(f, ", target={target}, variables=[{}]", outputs.join(", "))?;
        self.read.fmt_filters(f)
    }
}

/// Writes a selection of a Zarr table with computed variables: blockwise
/// into an intermediate store in `work_dir`, then rechunked into the target.
///
/// On a cluster ([`on_cluster`](Self::on_cluster)) both steps run on the
/// workers as its inputs, one per round ([`ClusterSelection`]).
pub struct SelectionCopyExec {
    blockwise: Arc<Blockwise>,
    /// On a cluster: where its tasks write, and their rounds.
    cluster: Option<ClusterSelection>,
    /// The tables joined in that its variables read (its children here),
    /// computed first and held while it writes.
    broadcasts: BroadcastInputs,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl fmt::Debug for SelectionCopyExec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SelectionCopyExec")
            .field("store", &self.blockwise.blocks.store())
            .field("target", &self.blockwise.to.location)
            .finish()
    }
}

impl SelectionCopyExec {
    /// The exec of `blockwise`, reporting to `metrics` (which its step 1
    /// may report to too).
    pub(crate) fn new(blockwise: Arc<Blockwise>, metrics: ExecutionPlanMetricsSet) -> Self {
        let properties = count_properties();
        Self {
            blockwise,
            cluster: None,
            broadcasts: BroadcastInputs::default(),
            properties,
            metrics,
        }
    }

    /// This copy computing the tables joined in `broadcasts` (that its
    /// variables read) first, holding them while it writes.
    pub(crate) fn with_broadcasts(self, broadcasts: BroadcastInputs) -> Self {
        Self { broadcasts, ..self }
    }

    /// Memory it holds while it writes (the tables joined in included).
    fn projected_memory(&self) -> usize {
        (self.blockwise.projected_memory() as usize).saturating_add(self.broadcasts.memory())
    }

    /// This copy with its steps' rounds of tasks as its inputs, to run on
    /// a cluster's workers; `None` when they already are. The tables
    /// joined in that its variables read become the inputs of its step 1,
    /// whose tasks hold them (they are not held here). A local target's
    /// temporary directory and the intermediate store (in `work_dir`,
    /// which every worker must reach) are named now, for the workers to
    /// write into.
    pub fn on_cluster(&self) -> Result<Option<Self>> {
        if self.cluster.is_some() {
            return Ok(None);
        }
        let runtime = Arc::clone(&self.blockwise.runtime);
        let broadcasts = self.broadcasts.clone();
        let cluster = ClusterSelection::plan(&self.blockwise, broadcasts, &runtime)?;
        Ok(Some(Self {
            blockwise: Arc::clone(&self.blockwise),
            cluster: Some(cluster),
            broadcasts: BroadcastInputs::default(),
            properties: Arc::clone(&self.properties),
            metrics: ExecutionPlanMetricsSet::new(),
        }))
    }
}

impl DisplayAs for SelectionCopyExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let b = &self.blockwise;
        let names: Vec<String> = (b.blocks.names.iter())
            .zip(b.blocks.step.exprs())
            .map(|(n, e)| format!("{e} AS {n}"))
            .collect();
        write!(
            f,
            "SelectionCopyExec: store={}, target={}, variables=[{}], shape={:?}, ",
            b.blocks.store(),
            b.to.location,
            names.join(", "),
            b.blocks.shape,
        )?;
        match &b.blocks.step {
            Step::Evaluate(e) => write!(
                f,
                "blockwise chunks {:?} ({} tasks, {} workers, {} per task{})",
                b.blocks.block,
                b.blocks.tasks(),
                e.workers,
                human_readable_size(e.task_memory as usize),
                e.read_ahead,
            )?,
            Step::Writers(w) => write!(
                f,
                "blockwise chunks {:?} ({} tasks, {w})",
                b.blocks.block,
                b.blocks.tasks()
            )?,
        }
        let second = if b.direct {
            "written straight into the target's chunks"
        } else {
            "-> rechunk to"
        };
        let dims = b.blocks.dim_names();
        write!(
            f,
            " {second} {:?}{}, projected_memory={}",
            b.target_chunks,
            self.broadcasts
                .display(&dims.iter().map(String::as_str).collect::<Vec<_>>()),
            human_readable_size(self.projected_memory())
        )?;
        match &self.cluster {
            Some(_) => write!(f, ", tasks on the cluster's workers"),
            None => Ok(()),
        }
    }
}

impl ExecutionPlan for SelectionCopyExec {
    named_plan_methods!("SelectionCopyExec");

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        match &self.cluster {
            Some(cluster) => cluster.rounds(),
            None => self.broadcasts.children(),
        }
    }

    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        vec![false; self.children().len()]
    }

    no_expressions_method!();

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        match &self.cluster {
            None if children.is_empty() && self.broadcasts.is_empty() => Ok(self),
            None => Ok(Arc::new(Self {
                blockwise: Arc::clone(&self.blockwise),
                cluster: None,
                broadcasts: self.broadcasts.with_children(children)?,
                properties: Arc::clone(&self.properties),
                metrics: ExecutionPlanMetricsSet::new(),
            })),
            Some(cluster) => Ok(Arc::new(Self {
                blockwise: Arc::clone(&self.blockwise),
                cluster: Some(cluster.with_rounds(children)?),
                broadcasts: BroadcastInputs::default(),
                properties: Arc::clone(&self.properties),
                metrics: ExecutionPlanMetricsSet::new(),
            })),
        }
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let blockwise = Arc::clone(&self.blockwise);
        let runtime = context.runtime_env();
        let Some(cluster) = self.cluster.clone() else {
            let job = write_job(&self.blockwise, &self.metrics, &self.properties);
            let write = move |cancelled: &AtomicBool| blockwise.run(&runtime, cancelled);
            // The tables joined in are computed first and held while the
            // chunks are written; the copy's memory is taken once their
            // plans have run.
            return match self.broadcasts.is_empty() {
                true => job.run(partition, &context, write),
                false => {
                    let joined = (self.broadcasts.clone(), Joined::ComputedFirst);
                    job.run_holding(joined, partition, context, write)
                }
            };
        };
        let handle = tokio::runtime::Handle::try_current().map_err(|e| {
            DataFusionError::Execution(format!("SelectionCopyExec needs a runtime: {e}"))
        })?;
        let task_context = Arc::clone(&context);
        let job = WriteJob {
            // The session's memory holds the coordinates only: the tasks
            // run on the workers.
            projected: usize::try_from(blockwise.coordinate_memory()).unwrap_or(usize::MAX),
            ..write_job(&self.blockwise, &self.metrics, &self.properties)
        };
        job.run(partition, &context, move |cancelled| {
            cluster.run(&blockwise, &handle, &task_context, cancelled)
        })
    }

    metered_plan_methods!(|_| None);
}

/// The write of `blockwise` on one machine, as an operator's job
/// reporting to `metrics` (the tables joined in reserve their own memory
/// as they are held).
fn write_job<'a>(
    blockwise: &'a Blockwise,
    metrics: &'a ExecutionPlanMetricsSet,
    properties: &'a PlanProperties,
) -> WriteJob<'a> {
    WriteJob {
        operator: "SelectionCopyExec",
        store: blockwise.blocks.store(),
        projected: blockwise.projected_memory() as usize,
        metrics,
        properties,
    }
}

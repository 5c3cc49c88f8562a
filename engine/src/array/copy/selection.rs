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

use std::fmt;
use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, SchemaRef};
use datafusion::catalog::Session;
use datafusion::common::{exec_err, human_readable_size, DFSchema, DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::physical_planning_context::PhysicalPlanningContext;
use datafusion::logical_expr::{
    Expr, ExprSchemable, TableProviderFilterPushDown, UserDefinedLogicalNodeCore,
};
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use datafusion::physical_planner::PhysicalPlanner;

use super::blockwise::{source_long_block, Blockwise, CopyGrid, Evaluate, OutputVariable, Step};
use super::cluster::ClusterSelection;
use super::whole::{split_columns, CopyScan};
use crate::array::scan_path::TableRead;
use crate::plan_methods::{
    leaf_node_methods, metered_plan_methods, named_plan_methods, no_expressions_method,
    node_identity,
};
use crate::table::classify_filters;
use crate::write::store::COORDINATE_WRITE_MEMORY;
use crate::write::target::CopyTarget;
use crate::write::write_job::{count_properties, WriteJob};
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
        let limit = session.runtime_env().memory_pool.memory_limit();
        let step = Step::Evaluate(Evaluate::plan(
            &grid.selected(),
            &block,
            columns,
            batch_schema,
            exprs,
            grid.rechunk.threads,
            &limit,
        )?);
        Ok(SelectionCopyExec::new(
            Arc::new(grid.blockwise(block, step, limit)?),
            ExecutionPlanMetricsSet::new(),
        ))
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
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl fmt::Debug for SelectionCopyExec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SelectionCopyExec")
            .field("store", &self.blockwise.blocks.table.store)
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
            properties,
            metrics,
        }
    }

    /// This copy with its steps' rounds of tasks as its inputs, to run on
    /// a cluster's workers; `None` when they already are. A local target's temporary directory and the
    /// intermediate store (in `work_dir`, which every worker must reach)
    /// are named now, for the workers to write into.
    pub fn on_cluster(&self) -> Result<Option<Self>> {
        if self.cluster.is_some() {
            return Ok(None);
        }
        let runtime = Arc::clone(&self.blockwise.runtime);
        let cluster = ClusterSelection::plan(&self.blockwise, &runtime)?;
        Ok(Some(Self {
            blockwise: Arc::clone(&self.blockwise),
            cluster: Some(cluster),
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
            b.blocks.table.store,
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
        write!(
            f,
            " {second} {:?}, projected_memory={}",
            b.target_chunks,
            human_readable_size(b.projected_memory() as usize)
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
        self.cluster.iter().flat_map(|c| c.rounds()).collect()
    }

    no_expressions_method!();

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        match &self.cluster {
            None if children.is_empty() => Ok(self),
            None => exec_err!("SelectionCopyExec has no children, got {}", children.len()),
            Some(cluster) => Ok(Arc::new(Self {
                blockwise: Arc::clone(&self.blockwise),
                cluster: Some(cluster.with_rounds(children)?),
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
        let cluster = self.cluster.clone();
        let job = WriteJob {
            operator: "SelectionCopyExec",
            store: &blockwise.blocks.table.store,
            // The session's memory holds the coordinates only when the
            // tasks run on the workers.
            projected: match cluster {
                Some(_) => COORDINATE_WRITE_MEMORY as usize,
                None => blockwise.projected_memory() as usize,
            },
            metrics: &self.metrics,
            properties: &self.properties,
        };
        let writer = Arc::clone(&blockwise);
        let handle = tokio::runtime::Handle::try_current().map_err(|e| {
            DataFusionError::Execution(format!("SelectionCopyExec needs a runtime: {e}"))
        })?;
        let task_context = Arc::clone(&context);
        job.run(partition, &context, move |cancelled| match cluster {
            None => writer.run(&runtime, cancelled),
            Some(cluster) => cluster.run(&writer, &handle, &task_context, cancelled),
        })
    }

    metered_plan_methods!(|_| None);
}

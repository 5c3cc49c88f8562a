//! `COPY` of a whole Zarr table, array by array: when the query is a plain
//! scan of every cell of a registered Zarr table (its dimensions and some
//! of its variables, no filter, no `LIMIT`, no computed column), the
//! result is those arrays themselves. They are copied chunk by chunk
//! through the rechunk planner ([`crate::array::rechunk`]) into the chunks
//! the `chunks` option asks for, inside `allowed_mem` (through intermediate
//! arrays in `work_dir` when one pass would read too much), instead of
//! collecting every row in memory first. Values are copied as stored
//! (packed integers stay packed, times stay CF-encoded, attributes stay),
//! so readers decode the same values; the `codec` and `zarr_format`
//! options re-encode them.
//!
//! ```sql
//! COPY era5 TO 'era5_space.zarr' STORED AS ZARR
//! OPTIONS ('chunks' 'time=240,lat=16,lon=16');
//! ```
//!
//! A COPY of `rechunk(...)` (the whole table here; a selection or rolling
//! windows) reads the source as it is stored and writes the rechunk's
//! chunks where the `chunks` option leaves them free: one copy, not a
//! rechunked store in `work_dir` and then a second.

use std::fmt;
use std::sync::Arc;

use datafusion::common::exec_err;

use datafusion::catalog::Session;
use datafusion::common::Column;
use datafusion::common::{human_readable_size, DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::dml::CopyTo;
use datafusion::logical_expr::{Expr, UserDefinedLogicalNodeCore};
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};

use crate::array::rechunk::{
    fmt_array_plans, ClusterRounds, PreparedRechunk, RechunkOptions, TargetEncoding,
};
use crate::array::scan_path::{down_to_scan_or_rechunk, ScanPath};
use crate::plan_methods::{
    leaf_node_methods, metered_plan_methods, named_plan_methods, no_expressions_method,
    node_identity,
};
use crate::table::GridTable;
use crate::write::options::ZarrVersion;
use crate::write::target::CopyTarget;
use crate::write::write_job::{count_properties, WriteJob, Written};
use crate::zarr::StoreLocation;

/// A `COPY ... STORED AS ZARR` (without `PARTITIONED BY`) whose input is a
/// Zarr table (or `rechunk(...)` of one) seen through projections, aliases
/// and filters.
pub(crate) struct CopyScan<'a> {
    /// Where the COPY writes.
    pub to: CopyTarget,
    /// The COPY's columns.
    pub columns: Vec<Column>,
    /// The way down to the scan, with the columns' expressions over it.
    pub path: ScanPath<'a>,
    /// The table read.
    pub table: Arc<GridTable>,
}

impl<'a> CopyScan<'a> {
    /// The COPY's columns: each name with its expression over the scan.
    pub(crate) fn named_columns(&self) -> impl Iterator<Item = (&str, &Expr)> {
        (self.columns.iter())
            .map(|c| c.name.as_str())
            .zip(&self.path.exprs)
    }

    /// The COPY `copy`, when it is one.
    pub(crate) fn of(copy: &'a CopyTo) -> Result<Option<Self>> {
        let Some(to) = CopyTarget::of(copy)? else {
            return Ok(None);
        };
        let columns = copy.input.schema().columns();
        let exprs = columns.iter().cloned().map(Expr::Column).collect();
        let Some(path) = down_to_scan_or_rechunk(&copy.input, exprs)? else {
            return Ok(None);
        };
        // Of `rechunk(...)`: the source is read as it is stored and
        // written in the rechunk's chunks (the COPY's own win), one
        // copy instead of two.
        let to = match &path.rechunk {
            Some(rechunk) => to.with_default_chunks(rechunk.chunks()),
            None => to,
        };
        // Columns of tables joined in (an anomaly's climatology) are read
        // as the table's own: a selection copy computes them first.
        let table = Arc::clone(path.table.grid());
        if let Some(given) = &to.options.dims {
            if given.iter().ne(table.dims.iter().map(|d| &d.name)) {
                return Ok(None);
            }
        }
        Ok(Some(Self {
            to,
            columns,
            path,
            table,
        }))
    }
}

/// A COPY's columns (names and their expressions) split into the table's
/// dimensions `dims` and the variables written: `variable` makes a column
/// into what is written, or refuses it (`None`); `is_dimension` says
/// whether a column named as a dimension is that dimension's coordinate.
/// `None` unless every dimension is there once, in the table's order,
/// beside at least one variable.
pub(crate) fn split_columns<'e, T>(
    dims: &[&str],
    columns: impl IntoIterator<Item = (&'e str, &'e Expr)>,
    mut is_dimension: impl FnMut(&str, &Expr) -> Result<bool>,
    mut variable: impl FnMut(&str, &Expr) -> Result<Option<T>>,
) -> Result<Option<Vec<T>>> {
    let mut dims_seen = Vec::new();
    let mut variables = Vec::new();
    for (name, expr) in columns {
        if dims.contains(&name) {
            if !is_dimension(name, expr)? {
                return Ok(None);
            }
            dims_seen.push(name);
            continue;
        }
        match variable(name, expr)? {
            Some(v) => variables.push(v),
            None => return Ok(None),
        }
    }
    Ok((dims_seen == dims && !variables.is_empty()).then_some(variables))
}

/// The [`ArrayCopy`] that a COPY is, when it reads every cell of a Zarr
/// table: the table's dimensions (in its order) and at least one variable,
/// under projections and aliases that only pick columns, with no filter
/// and no `LIMIT`; and when the arrays can be written as asked (not a v3
/// array as v2).
pub(crate) fn whole_table_copy(scan: &CopyScan<'_>) -> Result<Option<ArrayCopy>> {
    let (path, table, to) = (&scan.path, &scan.table, &scan.to);
    if !path.predicates.is_empty() || !path.scan.filters.is_empty() {
        return Ok(None);
    }
    // Each output column is a scan column under its own name: a dimension
    // or a variable of the table.
    let picks = |name: &str, expr: &Expr| matches!(expr, Expr::Column(c) if c.name == name);
    let dims: Vec<&str> = table.dims.iter().map(|d| d.name.as_str()).collect();
    let variable = |name: &str, expr: &Expr| {
        let stored = table.variables.iter().any(|v| v.name() == name);
        Ok((picks(name, expr) && stored).then(|| name.to_string()))
    };
    let Some(variables) = split_columns(
        &dims,
        scan.named_columns(),
        |n, e| Ok(picks(n, e)),
        variable,
    )?
    else {
        return Ok(None);
    };
    if to.options.zarr_format == ZarrVersion::V2 && table.variables.iter().any(|v| v.is_v3()) {
        return Ok(None);
    }
    Ok(Some(ArrayCopy {
        table: Arc::clone(table),
        variables,
        to: to.clone(),
    }))
}

/// `COPY` of a whole Zarr table: its arrays copied into a new store. A leaf
/// node (it reads the table itself) whose output is the row count.
#[derive(Debug, Clone)]
pub struct ArrayCopy {
    /// The table copied.
    pub table: Arc<GridTable>,
    /// The variables copied (with the coordinate arrays of the table's dimensions).
    pub variables: Vec<String>,
    /// Where it writes.
    pub to: CopyTarget,
}

impl ArrayCopy {
    fn key(&self) -> (&str, &Vec<String>, &StoreLocation) {
        (&self.table.store, &self.variables, &self.to.location)
    }

    /// Plans the copy (reading the source's metadata): refused when the
    /// target exists or its tasks cannot fit the session's memory budget.
    pub async fn plan(&self, session: &dyn Session) -> Result<ArrayCopyExec> {
        self.to.check()?;
        let mut arrays = self.variables.clone();
        arrays.extend(
            self.table
                .dims
                .iter()
                .filter(|d| d.has_coordinate())
                .map(|d| d.name.clone()),
        );
        let encoding = TargetEncoding::of(&self.to.options);
        let runtime = Arc::clone(session.runtime_env());
        let mut rechunk = RechunkOptions::for_session(session.config_options(), &runtime)?;
        rechunk.source_storage = self.table.storage_options();
        let source = self.table.store.clone();
        let chunks = self.to.options.chunks.clone();
        let prepared = tokio::task::spawn_blocking(move || {
            PreparedRechunk::new_for(
                &source,
                &chunks,
                Some(&arrays),
                Some(encoding),
                &rechunk,
                &runtime,
            )
        })
        .await
        .map_err(|e| DataFusionError::Execution(format!("the COPY planner stopped: {e}")))??;
        Ok(ArrayCopyExec::new(
            prepared,
            self.to.clone(),
            self.table.shape().iter().product(),
            self.variables.clone(),
        ))
    }
}

node_identity!(
    ArrayCopy,
    eq: |a, b| {
        Arc::ptr_eq(&a.table, &b.table) && a.key() == b.key() && a.to == b.to
    },
    hash: |node, mut state| node.key().hash(&mut state)
);

impl UserDefinedLogicalNodeCore for ArrayCopy {
    leaf_node_methods!("ArrayCopy", to.schema);

    fn fmt_for_explain(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "ArrayCopy: store={}, target={}, dims=[{}], variables=[{}], chunks={:?}, codec={:?}, zarr_format={:?}",
            self.table.store,
            self.to.location,
            self.table.dims_name().replace('_', ", "),
            self.variables.join(", "),
            self.to.options.chunks,
            self.to.options.codec,
            self.to.options.zarr_format,
        )
    }
}

/// Copies a Zarr table's arrays into a new store and returns the number of
/// rows (cells) written, as `COPY` does.
///
/// On a cluster ([`on_cluster`](Self::on_cluster)) its rechunk's tasks run
/// on the workers as its inputs, one per round ([`RechunkTasksExec`] under
/// the gathering of their counts), writing into the target it stages: it
/// makes the temporary directory beside a local target (or claims an
/// object-store prefix) and the scratch store of the intermediate arrays,
/// runs its inputs one after another, checks that every task of each ran,
/// and commits.
#[derive(Debug)]
pub struct ArrayCopyExec {
    prepared: Arc<PreparedRechunk>,
    to: CopyTarget,
    rows: u64,
    variables: Vec<String>,
    /// On a cluster: where its tasks write, and their rounds.
    cluster: Option<ClusterRounds>,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl ArrayCopyExec {
    fn new(prepared: PreparedRechunk, to: CopyTarget, rows: u64, variables: Vec<String>) -> Self {
        let properties = count_properties();
        Self {
            prepared: Arc::new(prepared),
            to,
            rows,
            variables,
            cluster: None,
            properties,
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }

    /// This copy with its rechunk's rounds of tasks as its inputs, to run
    /// on a cluster's workers; `None` when they already are. A local
    /// target's temporary directory and the scratch store of the
    /// intermediate arrays (in `work_dir`, which every worker must reach)
    /// are named now, for the workers to write into.
    pub fn on_cluster(&self) -> Result<Option<Self>> {
        if self.cluster.is_some() {
            return Ok(None);
        }
        let rounds = ClusterRounds::plan(&self.prepared, self.to.staged()?)?;
        Ok(Some(self.with_cluster(Some(rounds))))
    }

    fn with_cluster(&self, cluster: Option<ClusterRounds>) -> Self {
        Self {
            prepared: Arc::clone(&self.prepared),
            to: self.to.clone(),
            rows: self.rows,
            variables: self.variables.clone(),
            cluster,
            properties: Arc::clone(&self.properties),
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }
}

impl DisplayAs for ArrayCopyExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "ArrayCopyExec: store={}, target={}, variables=[{}], projected_memory={}, arrays=[",
            self.prepared.source(),
            self.to.location,
            self.variables.join(", "),
            human_readable_size(self.prepared.projected_memory() as usize)
        )?;
        fmt_array_plans(f, self.prepared.arrays())?;
        write!(f, "]")?;
        match &self.cluster {
            Some(_) => write!(f, ", tasks on the cluster's workers"),
            None => Ok(()),
        }
    }
}

impl ExecutionPlan for ArrayCopyExec {
    named_plan_methods!("ArrayCopyExec");

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        self.cluster.iter().flat_map(|c| &c.rounds).collect()
    }

    no_expressions_method!();

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if children.len() != self.children().len() {
            return exec_err!(
                "ArrayCopyExec has {} children, got {}",
                self.children().len(),
                children.len()
            );
        }
        match &self.cluster {
            None => Ok(self),
            Some(cluster) => Ok(Arc::new(
                self.with_cluster(Some(cluster.with_rounds(children)?)),
            )),
        }
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let prepared = Arc::clone(&self.prepared);
        let to = self.to.clone();
        let rows = self.rows;
        let cluster = self.cluster.clone();
        // The session's memory holds the target's metadata only when the
        // tasks run on the workers.
        let projected = match cluster {
            Some(_) => 0,
            None => prepared.projected_memory() as usize,
        };
        let handle = tokio::runtime::Handle::try_current().map_err(|e| {
            DataFusionError::Execution(format!("ArrayCopyExec needs a runtime: {e}"))
        })?;
        let job = WriteJob {
            operator: "ArrayCopyExec",
            store: prepared.source(),
            projected,
            metrics: &self.metrics,
            properties: &self.properties,
        };
        let writer = Arc::clone(&prepared);
        let task_context = Arc::clone(&context);
        job.run(partition, &context, move |cancelled| {
            let context = task_context;
            let Some(cluster) = cluster else {
                let summary = writer.write_to(&to, cancelled)?;
                return Ok(Written {
                    rows,
                    bytes_read: summary.bytes_read,
                    bytes_written: summary.bytes_written,
                });
            };
            to.write_staged(&cluster.staged, writer.runtime(), cancelled, |out| {
                cluster.run(&handle, &context, cancelled, "the COPY")?;
                writer.write_metadata(out)
            })?;
            let bytes_written = writer.arrays().map(|a| a.plan.bytes_written()).sum();
            Ok(Written {
                rows,
                bytes_read: writer.arrays().map(|a| a.plan.bytes_read()).sum(),
                bytes_written,
            })
        })
    }

    metered_plan_methods!(|_| None);
}

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

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use datafusion::catalog::Session;
use datafusion::common::Column;
use datafusion::common::{human_readable_size, DFSchemaRef, DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::dml::CopyTo;
use datafusion::logical_expr::{Expr, UserDefinedLogicalNodeCore};
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};

use crate::array::rechunk::{
    fmt_array_plans, PreparedRechunk, RechunkOptions, RechunkSummary, TargetEncoding,
};
use crate::array::scan_path::{down_to_scan, ScanPath};
use crate::plan_methods::{
    leaf_node_methods, leaf_plan_methods, metered_plan_methods, node_identity,
};
use crate::table::GridTable;
use crate::write::options::{ZarrVersion, ZarrWriteOptions};
use crate::write::store::check_target;
use crate::write::store::write_claimed;
use crate::write::write_job::{count_properties, WriteJob, Written};
use crate::zarr::StoreLocation;

/// A `COPY ... STORED AS ZARR` (without `PARTITIONED BY`) whose input is a
/// Zarr table seen through projections, aliases and filters.
pub(crate) struct CopyScan<'a> {
    /// The new store.
    pub target: StoreLocation,
    /// The write options.
    pub options: ZarrWriteOptions,
    /// The COPY's columns.
    pub columns: Vec<Column>,
    /// The way down to the scan, with the columns' expressions over it.
    pub path: ScanPath<'a>,
    /// The table read.
    pub table: Arc<GridTable>,
    /// The COPY's output: one column, `count`.
    pub schema: DFSchemaRef,
}

impl<'a> CopyScan<'a> {
    /// The COPY `copy`, when it is one.
    pub(crate) fn of(copy: &'a CopyTo) -> Result<Option<Self>> {
        if copy.file_type.get_ext() != "zarr" || !copy.partition_by.is_empty() {
            return Ok(None);
        }
        let target = StoreLocation::parse(&copy.output_url)?;
        let options = ZarrWriteOptions::from_map(&copy.options)?;
        let columns = copy.input.schema().columns();
        let exprs = columns.iter().cloned().map(Expr::Column).collect();
        let Some(path) = down_to_scan(&copy.input, exprs)? else {
            return Ok(None);
        };
        let table = Arc::clone(path.table.grid());
        // A table joined in (an anomaly) is written through the scan.
        if !table.broadcasts.is_empty() {
            return Ok(None);
        }
        if let Some(given) = &options.dims {
            if given.iter().ne(table.dims.iter().map(|d| &d.name)) {
                return Ok(None);
            }
        }
        Ok(Some(Self {
            target,
            options,
            columns,
            path,
            table,
            schema: Arc::clone(&copy.output_schema),
        }))
    }
}

/// The [`ArrayCopy`] that a COPY is, when it reads every cell of a Zarr
/// table: the table's dimensions (in its order) and at least one variable,
/// under projections and aliases that only pick columns, with no filter
/// and no `LIMIT`; and when the arrays can be written as asked (not a v3
/// array as v2).
pub(crate) fn whole_table_copy(scan: &CopyScan<'_>) -> Result<Option<ArrayCopy>> {
    let CopyScan {
        target,
        options,
        columns,
        path,
        table,
        ..
    } = scan;
    if !path.predicates.is_empty() || !path.scan.filters.is_empty() {
        return Ok(None);
    }
    // Each output column is a scan column under its own name.
    let picks_columns = path
        .exprs
        .iter()
        .zip(columns)
        .all(|(expr, column)| matches!(expr, Expr::Column(c) if c.name == column.name));
    if !picks_columns {
        return Ok(None);
    }
    let dims: Vec<&str> = table.dims.iter().map(|d| d.name.as_str()).collect();
    let mut variables = Vec::new();
    let mut dims_seen = Vec::new();
    for column in columns {
        let name = column.name.as_str();
        if dims.contains(&name) {
            dims_seen.push(name);
        } else if table.variables.iter().any(|v| v.name() == name) {
            variables.push(name.to_string());
        } else {
            return Ok(None);
        }
    }
    // Every dimension once, in the table's order, and a variable.
    if dims_seen != dims || variables.is_empty() {
        return Ok(None);
    }
    if options.zarr_format == ZarrVersion::V2 && table.variables.iter().any(|v| v.is_v3()) {
        return Ok(None);
    }
    Ok(Some(ArrayCopy {
        table: Arc::clone(table),
        variables,
        target: target.clone(),
        options: options.clone(),
        schema: Arc::clone(&scan.schema),
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
    /// The new store: a local path or an object-store URL.
    pub target: StoreLocation,
    /// The write options (chunks, codec, format).
    pub options: ZarrWriteOptions,
    /// One column, `count`.
    pub schema: DFSchemaRef,
}

impl ArrayCopy {
    fn key(&self) -> (&str, &Vec<String>, &StoreLocation) {
        (&self.table.store, &self.variables, &self.target)
    }

    /// Plans the copy (reading the source's metadata): refused when the
    /// target exists or its tasks cannot fit the session's memory budget.
    pub async fn plan(&self, session: &dyn Session) -> Result<ArrayCopyExec> {
        if let StoreLocation::Local(path) = &self.target {
            check_target(path)?;
        }
        let mut arrays = self.variables.clone();
        arrays.extend(
            self.table
                .dims
                .iter()
                .filter(|d| d.has_coordinate())
                .map(|d| d.name.clone()),
        );
        let encoding = TargetEncoding {
            codec: self.options.codec,
            zarr_format: self.options.zarr_format,
        };
        let runtime = Arc::clone(session.runtime_env());
        let mut rechunk = RechunkOptions::for_session(session.config_options(), &runtime)?;
        rechunk.source_storage = self.table.storage_options();
        let source = self.table.store.clone();
        let chunks = self.options.chunks.clone();
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
            self.target.clone(),
            self.options.storage.clone(),
            self.table.shape().iter().product(),
            self.variables.clone(),
        ))
    }
}

node_identity!(
    ArrayCopy,
    eq: |a, b| {
        Arc::ptr_eq(&a.table, &b.table) && a.key() == b.key() && a.options == b.options
    },
    hash: |node, mut state| node.key().hash(&mut state)
);

impl UserDefinedLogicalNodeCore for ArrayCopy {
    leaf_node_methods!("ArrayCopy");

    fn fmt_for_explain(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "ArrayCopy: store={}, target={}, dims=[{}], variables=[{}], chunks={:?}, codec={:?}, zarr_format={:?}",
            self.table.store,
            self.target,
            self.table.dims_name().replace('_', ", "),
            self.variables.join(", "),
            self.options.chunks,
            self.options.codec,
            self.options.zarr_format,
        )
    }
}

/// Copies a Zarr table's arrays into a new store and returns the number of
/// rows (cells) written, as `COPY` does.
#[derive(Debug)]
pub struct ArrayCopyExec {
    prepared: Arc<PreparedRechunk>,
    target: StoreLocation,
    /// The object-store settings the COPY gave for its target.
    storage: HashMap<String, String>,
    rows: u64,
    variables: Vec<String>,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl ArrayCopyExec {
    fn new(
        prepared: PreparedRechunk,
        target: StoreLocation,
        storage: HashMap<String, String>,
        rows: u64,
        variables: Vec<String>,
    ) -> Self {
        let properties = count_properties();
        Self {
            prepared: Arc::new(prepared),
            target,
            storage,
            rows,
            variables,
            properties,
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
            self.target,
            self.variables.join(", "),
            human_readable_size(self.prepared.projected_memory() as usize)
        )?;
        fmt_array_plans(f, self.prepared.arrays())?;
        write!(f, "]")
    }
}

/// Writes the copy to `target`: renamed into place when local; data, then
/// metadata, into an empty object-store prefix otherwise (through a client
/// built from `storage`, the COPY's object-store settings, when it gave
/// any).
pub(crate) fn write_target(
    prepared: &PreparedRechunk,
    target: &StoreLocation,
    storage: &HashMap<String, String>,
    cancelled: &AtomicBool,
) -> Result<RechunkSummary> {
    match target {
        StoreLocation::Local(path) => prepared.write_local(path, cancelled),
        StoreLocation::Remote(url) => {
            let display = target.to_string();
            write_claimed(&display, url, storage, prepared.runtime(), |out| {
                prepared.write_last_metadata(out, cancelled)
            })
        }
    }
}

impl ExecutionPlan for ArrayCopyExec {
    leaf_plan_methods!("ArrayCopyExec");

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let prepared = Arc::clone(&self.prepared);
        let target = self.target.clone();
        let storage = self.storage.clone();
        let rows = self.rows;
        let job = WriteJob {
            operator: "ArrayCopyExec",
            store: prepared.source(),
            projected: prepared.projected_memory() as usize,
            metrics: &self.metrics,
            properties: &self.properties,
        };
        let writer = Arc::clone(&prepared);
        job.run(partition, &context, move |cancelled| {
            let summary = write_target(&writer, &target, &storage, cancelled)?;
            Ok(Written {
                rows,
                bytes_read: summary.bytes_read,
                bytes_written: summary.bytes_written,
            })
        })
    }

    metered_plan_methods!(|_| None);
}

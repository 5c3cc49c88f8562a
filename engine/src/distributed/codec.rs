//! How zarrfusion's plan nodes cross the network to a worker.
//!
//! A [`ZarrScanExec`] is sent as the location and options its table was
//! opened with, the table's expected columns, and the scan's projection,
//! selection, blocks, partitions, limit, batch size, read-ahead and tasks
//! (JSON). The worker opens the table again (its own `allowed_locations`
//! apply, not the sender's), checks that the columns are still those the
//! plan was made for and that every number fits the table, fits the scan
//! to its own `allowed_mem`, and refuses a scan that cannot fit it. A node
//! the codec does not know is an error naming it.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::{Arc, Mutex};

use datafusion::common::{exec_datafusion_err, not_impl_err, plan_err, Result};
use datafusion::execution::memory_pool::MemoryLimit;
use datafusion::execution::TaskContext;
use datafusion::physical_plan::ExecutionPlan;
use datafusion_proto::physical_plan::{PhysicalExtensionCodec, PhysicalProtoConverterExtension};
use serde::{Deserialize, Serialize};

use crate::config::ZarrConfig;
use crate::error::lock;
use crate::table::{
    open_dataset_blocking, BlockGrid, GridTable, Selection, TableSource, ZarrScanExec,
    ZarrTableOptions,
};

/// The most partitions, tasks and rows per batch a received scan may ask
/// for (a malformed plan must not make a worker allocate per partition).
const MAX_PARTITIONS: usize = 1 << 12;
const MAX_TASKS: usize = 1 << 16;
const MAX_BATCH_ROWS: usize = 1 << 24;

/// zarrfusion's `PhysicalExtensionCodec`: registered on the session that
/// plans a distributed query and on every worker.
#[derive(Debug, Default)]
pub struct ZarrCodec {
    /// Tables opened for the nodes of one query, by their source.
    opened: Mutex<HashMap<String, Arc<GridTable>>>,
}

/// A zarrfusion node as it travels.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "node", rename_all = "snake_case")]
enum Node {
    Scan(Scan),
}

/// How to open a table again.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Source {
    location: String,
    dims: Vec<String>,
    group: Option<String>,
    pushdown: bool,
    open_cache: Option<bool>,
    storage: BTreeMap<String, String>,
    storage_defaults: BTreeMap<String, String>,
}

/// A Zarr scan as it travels.
#[derive(Debug, Serialize, Deserialize)]
struct Scan {
    source: Source,
    /// The table's columns when the plan was made: names and types.
    columns: Vec<(String, String)>,
    projection: Vec<usize>,
    selection: Vec<Vec<Range<u64>>>,
    block_shape: Vec<u64>,
    partitions: usize,
    limit: Option<usize>,
    batch_size: usize,
    io_concurrency: usize,
    tasks: usize,
}

impl Source {
    fn of(table: &GridTable) -> Result<Self> {
        let Some(TableSource { location, options }) = &table.source else {
            return not_impl_err!(
                "the Zarr table over {} cannot run on a cluster's workers: it was made in this \
                 process (a join's, a transform's or a rechunked copy's), not opened from a \
                 location",
                table.store
            );
        };
        Ok(Self {
            location: location.clone(),
            dims: table.dims.iter().map(|d| d.name.clone()).collect(),
            group: options.group.clone(),
            pushdown: options.pushdown,
            open_cache: options.open_cache,
            storage: options.storage.clone().into_iter().collect(),
            storage_defaults: options.storage_defaults.clone().into_iter().collect(),
        })
    }
}

/// Names and types of a table's columns.
fn columns_of(table: &GridTable) -> Vec<(String, String)> {
    table
        .schema
        .fields()
        .iter()
        .map(|f| (f.name().clone(), f.data_type().to_string()))
        .collect()
}

impl ZarrCodec {
    /// The table `source` names, opened on this worker (once per query).
    fn open(&self, source: &Source, ctx: &TaskContext) -> Result<Arc<GridTable>> {
        let key = serde_json::to_string(source)
            .map_err(|e| exec_datafusion_err!("a Zarr table's source: {e}"))?;
        if let Some(table) = lock(&self.opened).get(&key) {
            return Ok(Arc::clone(table));
        }
        let config = ZarrConfig::of(ctx.session_config().options());
        let options = ZarrTableOptions {
            dims: Some(source.dims.clone()),
            group: source.group.clone(),
            pushdown: source.pushdown,
            open_cache: source.open_cache,
            storage: source.storage.clone().into_iter().collect(),
            storage_defaults: source.storage_defaults.clone().into_iter().collect(),
            // The worker's own policy, not the sender's.
            allowed: config.allowed()?,
        };
        let dataset = open_dataset_blocking(&source.location, &options, &ctx.runtime_env())?;
        let table = Arc::new(dataset.table(Some(&source.dims))?);
        lock(&self.opened).insert(key, Arc::clone(&table));
        Ok(table)
    }

    fn decode_scan(&self, scan: Scan, ctx: &TaskContext) -> Result<Arc<dyn ExecutionPlan>> {
        let table = self.open(&scan.source, ctx)?;
        let store = &table.store;
        if columns_of(&table) != scan.columns {
            return plan_err!(
                "the Zarr table over {store} has changed since the query was planned: its \
                 columns are now {:?}, the plan expects {:?}",
                columns_of(&table),
                scan.columns
            );
        }
        let width = table.schema.fields().len();
        if let Some(bad) = scan.projection.iter().find(|&&i| i >= width) {
            return plan_err!("a scan of {store} projects column {bad} of {width}");
        }
        let limits = [
            ("partitions", scan.partitions, MAX_PARTITIONS),
            ("tasks", scan.tasks, MAX_TASKS),
            ("batch_size", scan.batch_size, MAX_BATCH_ROWS),
        ];
        for (what, n, most) in limits {
            if n == 0 || n > most {
                return plan_err!("a scan of {store} asks for {n} {what} (1 to {most})");
            }
        }
        let shape = table.shape();
        let selection = Selection::from_ranges(scan.selection, &shape)
            .map_err(|e| exec_datafusion_err!("a scan of {store}: its selection: {e}"))?;
        let blocks = BlockGrid::with_block_shape(&shape, scan.block_shape, &selection)
            .map_err(|e| exec_datafusion_err!("a scan of {store}: {e}"))?;
        let mut exec = ZarrScanExec::new(
            table,
            scan.projection,
            selection,
            blocks,
            scan.partitions,
            scan.limit,
            scan.batch_size,
            scan.io_concurrency,
        )?
        .with_tasks(scan.tasks);
        if let MemoryLimit::Finite(bytes) = ctx.memory_pool().memory_limit() {
            exec = exec.fit_batches(bytes).fit_read_ahead(bytes);
            exec.check_memory(bytes)?;
        }
        Ok(Arc::new(exec))
    }
}

impl PhysicalExtensionCodec for ZarrCodec {
    fn try_decode(
        &self,
        buf: &[u8],
        inputs: &[Arc<dyn ExecutionPlan>],
        ctx: &TaskContext,
        _proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let node: Node = serde_json::from_slice(buf)
            .map_err(|e| exec_datafusion_err!("a malformed zarrfusion plan node: {e}"))?;
        match node {
            Node::Scan(scan) => {
                if !inputs.is_empty() {
                    return plan_err!("a Zarr scan has no inputs, got {}", inputs.len());
                }
                self.decode_scan(scan, ctx)
            }
        }
    }

    fn try_encode(
        &self,
        node: Arc<dyn ExecutionPlan>,
        buf: &mut Vec<u8>,
        _proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<()> {
        let Some(scan) = node.downcast_ref::<ZarrScanExec>() else {
            return not_impl_err!(
                "{} cannot run on a cluster's workers yet (zarrfusion distributes Zarr scans)",
                node.name()
            );
        };
        let table = scan.table();
        let selection = scan.selection();
        let encoded = Node::Scan(Scan {
            source: Source::of(table)?,
            columns: columns_of(table),
            projection: scan.projection().to_vec(),
            selection: (0..selection.rank())
                .map(|d| selection.ranges(d).to_vec())
                .collect(),
            block_shape: scan.blocks().block_shape().to_vec(),
            partitions: scan.properties().partitioning.partition_count(),
            limit: scan.limit(),
            batch_size: scan.batch_size(),
            io_concurrency: scan.io_concurrency(),
            tasks: scan.tasks(),
        });
        serde_json::to_writer(buf, &encoded)
            .map_err(|e| exec_datafusion_err!("encoding a Zarr scan: {e}"))
    }
}

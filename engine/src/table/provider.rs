//! `ZarrTable`: one dimension set of a Zarr group as a DataFusion table.

use std::any::Any;
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::catalog::{CatalogProviderList, Session};
use datafusion::common::stats::Precision;
use datafusion::common::{Result, Statistics};
use datafusion::datasource::{TableProvider, TableType};
use datafusion::execution::memory_pool::MemoryLimit;
use datafusion::logical_expr::{Expr, TableProviderFilterPushDown};
use datafusion::physical_plan::ExecutionPlan;

use super::block_read::BlockRead;
use super::blocks::BlockGrid;
use super::broadcast::BroadcastInputs;
use super::dataset::GridTable;
use super::scan::ZarrScanExec;
use super::selection::{classify_filters, select};
use crate::config::ZarrConfig;

/// A table over the variables of one dimension set: one column per
/// dimension, one per variable, one row per grid cell.
#[derive(Debug, Clone)]
pub struct ZarrTable {
    table: Arc<GridTable>,
    pushdown: bool,
}

impl ZarrTable {
    /// Wraps a grid table.
    pub fn new(table: GridTable) -> Self {
        Self {
            table: Arc::new(table),
            pushdown: true,
        }
    }

    /// A table over a grid already shared elsewhere (a loader's windows).
    pub fn shared(table: Arc<GridTable>) -> Self {
        Self {
            table,
            pushdown: true,
        }
    }

    /// Turns filter pushdown on or off (off: DataFusion filters every row).
    pub fn with_pushdown(mut self, pushdown: bool) -> Self {
        self.pushdown = pushdown;
        self
    }

    /// Whether filters on dimensions are pushed into the scan.
    pub fn pushdown(&self) -> bool {
        self.pushdown
    }

    /// The grid behind the table.
    pub fn grid(&self) -> &Arc<GridTable> {
        &self.table
    }
}

#[async_trait]
impl TableProvider for ZarrTable {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.table.schema)
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> Result<Vec<TableProviderFilterPushDown>> {
        if !self.pushdown {
            return Ok(vec![
                TableProviderFilterPushDown::Unsupported;
                filters.len()
            ]);
        }
        Ok(classify_filters(filters, &self.table))
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let projection = projection
            .cloned()
            .unwrap_or_else(|| (0..self.table.schema.fields().len()).collect());
        let selection = select(filters, &self.table, state)?;
        let memory_limit = match state.runtime_env().memory_pool.memory_limit() {
            MemoryLimit::Finite(bytes) => Some(bytes),
            _ => None,
        };
        let parallelism = state.config().options().execution.target_partitions.max(1);
        // Under a memory limit, blocks shrink (to whole chunks at least) so
        // that each partition's two blocks, decoded, take at most about half
        // of its share of the limit.
        let blocks = BlockGrid::for_columns(
            &self.table,
            &projection,
            &selection,
            state.config().options(),
            memory_limit.map(|bytes| bytes / (8 * parallelism)),
        );
        let partitions = (blocks.num_blocks() as usize).clamp(1, parallelism);
        let broadcasts =
            BroadcastInputs::plan(self.table.broadcasts_read(&projection), state).await?;
        let joined_in = broadcasts.memory();
        let read = BlockRead::new(Arc::clone(&self.table), projection, selection, blocks)?;
        let mut scan = ZarrScanExec::new(
            read,
            partitions,
            limit,
            state.config().batch_size(),
            ZarrConfig::of(state.config().options()).io_concurrency,
        )
        .with_broadcasts(broadcasts);
        if let Some(bytes) = memory_limit {
            let left = bytes.saturating_sub(joined_in);
            scan = scan.fit_batches(left).fit_read_ahead(left);
            scan.check_memory(bytes)?;
        }
        Ok(Arc::new(scan))
    }

    fn statistics(&self) -> Option<Statistics> {
        let mut stats = Statistics::new_unknown(&self.table.schema);
        stats.num_rows = Precision::Exact(self.table.num_rows() as usize);
        Some(stats)
    }
}

/// The Zarr tables registered in `catalogs` (every catalog and schema), as
/// their grids: what COPY and `to_xarray` use to recognise dimension columns.
pub async fn registered_zarr_tables(catalogs: &dyn CatalogProviderList) -> Vec<Arc<GridTable>> {
    let mut out = Vec::new();
    for catalog in catalogs.catalog_names() {
        let Some(catalog) = catalogs.catalog(&catalog) else {
            continue;
        };
        for schema in catalog.schema_names() {
            let Some(schema) = catalog.schema(&schema) else {
                continue;
            };
            for table in schema.table_names() {
                let Ok(Some(provider)) = schema.table(&table).await else {
                    continue;
                };
                if let Some(zarr) = (provider.as_ref() as &dyn Any).downcast_ref::<ZarrTable>() {
                    out.push(Arc::clone(zarr.grid()));
                }
            }
        }
    }
    out
}

//! `ZarrTable`: one dimension set of a Zarr group as a DataFusion table.

use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::catalog::Session;
use datafusion::common::stats::Precision;
use datafusion::common::{Result, Statistics};
use datafusion::datasource::{TableProvider, TableType};
use datafusion::logical_expr::{Expr, TableProviderFilterPushDown};
use datafusion::physical_plan::ExecutionPlan;

use super::blocks::BlockGrid;
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

    /// Turns filter pushdown on or off (off: DataFusion filters every row).
    pub fn with_pushdown(mut self, pushdown: bool) -> Self {
        self.pushdown = pushdown;
        self
    }

    /// The grid behind the table.
    pub fn grid(&self) -> &GridTable {
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
        let n_dims = self.table.dims.len();
        let bytes_per_cell: u64 = projection
            .iter()
            .filter(|&&i| i >= n_dims)
            .map(|&i| self.table.variables[i - n_dims].element_size() as u64)
            .sum();
        let options = state.config().options();
        let target_bytes = options
            .extensions
            .get::<ZarrConfig>()
            .map(|c| c.target_partition_bytes)
            .unwrap_or_else(|| ZarrConfig::default().target_partition_bytes);
        let parallelism = options.execution.target_partitions.max(1);
        let blocks = BlockGrid::plan(
            &self.table.shape(),
            &self.table.chunk_shape(),
            &selection,
            bytes_per_cell,
            target_bytes as u64,
            parallelism as u64,
        );
        let partitions = (blocks.num_blocks() as usize).clamp(1, parallelism);
        Ok(Arc::new(ZarrScanExec::new(
            Arc::clone(&self.table),
            projection,
            selection,
            blocks,
            partitions,
            limit,
        )?))
    }

    fn statistics(&self) -> Option<Statistics> {
        let mut stats = Statistics::new_unknown(&self.table.schema);
        stats.num_rows = Precision::Exact(self.table.num_rows() as usize);
        Some(stats)
    }
}

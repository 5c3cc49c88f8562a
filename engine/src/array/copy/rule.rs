//! Which array plan a `COPY ... STORED AS ZARR` becomes: the rule that
//! tries each COPY operator in turn (FFT, rolling windows, the whole table,
//! a selection), and holds every COPY's target to the session's allowed
//! locations.

use std::sync::Arc;

use datafusion::common::tree_node::Transformed;
use datafusion::common::Result;
use datafusion::logical_expr::{Extension, LogicalPlan, UserDefinedLogicalNode};
use datafusion::optimizer::{ApplyOrder, OptimizerConfig, OptimizerRule};
use datafusion::physical_expr::execution_props::ExecutionProps;

use super::rolling::rolling_copy;
use super::selection::selection_copy;
use super::whole::{whole_table_copy, CopyScan};
use crate::array::fft::copy::fft_copy;
use crate::array::scan_path::TableRead;
use crate::config::ZarrConfig;
use crate::table::select_planning;
use crate::write::options::ZarrWriteOptions;
use crate::zarr::StoreLocation;

/// Rewrites a `COPY ... STORED AS ZARR` that reads a Zarr table into an
/// array plan: an [`FftCopy`](crate::array::fft::FftCopy) for a whole
/// `fft(...)` result, a [`RollingCopy`](super::rolling::RollingCopy) for
/// rolling windows, an [`ArrayCopy`](super::whole::ArrayCopy) for the whole table as it is, else a
/// [`SelectionCopy`](super::selection::SelectionCopy) for a selection
/// with computed float variables.
#[derive(Debug, Default)]
pub struct CopyToArraysRule;

impl OptimizerRule for CopyToArraysRule {
    fn name(&self) -> &str {
        "zarrfusion_copy_to_arrays"
    }

    fn apply_order(&self) -> Option<ApplyOrder> {
        // COPY is the root of its plan, or the input of EXPLAIN ANALYZE.
        Some(ApplyOrder::TopDown)
    }

    fn supports_rewrite(&self) -> bool {
        true
    }

    fn rewrite(
        &self,
        plan: LogicalPlan,
        config: &dyn OptimizerConfig,
    ) -> Result<Transformed<LogicalPlan>> {
        let LogicalPlan::Copy(copy) = &plan else {
            return Ok(Transformed::no(plan));
        };
        // Every COPY, of any format and from any front door, goes through
        // here: its target is held to the session's allowed locations.
        let allowed = ZarrConfig::of(&config.options()).allowed()?;
        allowed.check_text(&copy.output_url)?;
        if copy.file_type.get_ext() == "zarr" {
            allowed.check_options(&copy.options, &copy.output_url)?;
            let target = StoreLocation::parse(&copy.output_url)?;
            ZarrWriteOptions::from_map(&copy.options)?.check_storage_target(&target)?;
        }
        if let Some(node) = fft_copy(copy)? {
            let node: Arc<dyn UserDefinedLogicalNode> = Arc::new(node);
            return Ok(Transformed::yes(LogicalPlan::Extension(Extension { node })));
        }
        if let Some(node) = rolling_copy(copy)? {
            if selects_no_cell(&node.window.read) {
                return Ok(Transformed::no(plan));
            }
            let node: Arc<dyn UserDefinedLogicalNode> = Arc::new(node);
            return Ok(Transformed::yes(LogicalPlan::Extension(Extension { node })));
        }
        let Some(scan) = CopyScan::of(copy)? else {
            return Ok(Transformed::no(plan));
        };
        let node: Arc<dyn UserDefinedLogicalNode> = if let Some(node) = whole_table_copy(&scan)? {
            Arc::new(node)
        } else if let Some(node) = selection_copy(&scan)? {
            if selects_no_cell(&node.read) {
                return Ok(Transformed::no(plan));
            }
            Arc::new(node)
        } else {
            return Ok(Transformed::no(plan));
        };
        Ok(Transformed::yes(LogicalPlan::Extension(Extension { node })))
    }
}

/// Whether `read`'s filters select no cell of its table: its COPY then
/// writes the empty result through DataFusion's sink (a store of
/// zero-length dimensions, as for any empty result), not chunk by chunk.
/// Filters that cannot be evaluated here are taken to select some.
fn selects_no_cell(read: &TableRead) -> bool {
    let props = ExecutionProps::new();
    select_planning(&read.filters, &read.table, &props).is_ok_and(|s| s.num_cells() == 0)
}

//! How a Zarr scan's stage is split among a cluster's tasks: the
//! distributed planner asks each leaf how many tasks it wants
//! ([`scan_tasks`]: its decoded bytes over `zarrfusion.bytes_per_task`, at
//! most one per block), then tells it how many it got
//! ([`deal_scan_blocks`]: the scan deals its blocks to them in contiguous
//! runs, see [`ZarrScanExec::with_tasks`]).

use std::sync::Arc;

use datafusion::common::Result;
use datafusion_distributed::{
    DesiredTaskCountEvent, DesiredTaskCountEventResponse, ScaleUpLeafNodeEvent,
    ScaleUpLeafNodeEventResponse,
};

use crate::config::ZarrConfig;
use crate::table::ZarrScanExec;

/// The tasks a Zarr scan wants: one per `zarrfusion.bytes_per_task` of its
/// decoded bytes, at least one, at most one per block.
pub fn scan_tasks(ev: DesiredTaskCountEvent) -> Option<Result<DesiredTaskCountEventResponse>> {
    let scan = ev.plan.downcast_ref::<ZarrScanExec>()?;
    let per_task = ZarrConfig::of(ev.session_config.options())
        .bytes_per_task
        .max(1) as u64;
    let blocks = scan.blocks().num_blocks().max(1);
    let tasks = scan.decoded_bytes().div_ceil(per_task).clamp(1, blocks);
    Some(Ok(DesiredTaskCountEventResponse::desired(
        usize::try_from(tasks).unwrap_or(usize::MAX),
    )))
}

/// A Zarr scan dealing its blocks to the stage's tasks.
pub fn deal_scan_blocks(ev: ScaleUpLeafNodeEvent) -> Option<Result<ScaleUpLeafNodeEventResponse>> {
    let scan = ev.plan.downcast_ref::<ZarrScanExec>()?;
    Some(Ok(ScaleUpLeafNodeEventResponse::new(Arc::new(
        scan.with_tasks(ev.task_count),
    ))))
}

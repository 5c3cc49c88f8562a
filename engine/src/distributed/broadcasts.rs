//! Broadcast joins on a cluster: a physical optimizer rule of sessions
//! with workers. A Zarr scan, dense reduction, rolling window or a COPY's
//! blockwise step reading a table joined in on some of its dimensions
//! ([broadcast columns](crate::table::Broadcast), an anomaly's
//! climatology) has the small side's plan as its input.
//! [`ClusterBroadcasts`] puts datafusion-distributed's `BroadcastExec` over
//! each such input and deals the operator's blocks to the tasks of its
//! stage ([`ZarrScanExec::with_tasks_of_stage`]). The distributed planner
//! then makes the small side a stage of its own, run once on the workers
//! (a dense reduction's partial states, merged after a shuffle, as any
//! other), and sends its rows to every task of the grid's stage (a network
//! broadcast), where each worker lays them out as a dense array and
//! gathers each block's values from it, as on one machine. Only the small
//! side's rows cross the network to the grid's tasks; the grid's cells are
//! read where they are reduced.
//!
//! The small side is planned as part of the grid's plan
//! ([`SmallSidePlanner`](crate::table::SmallSidePlanner)), so that the two
//! are one distributed plan.

use std::sync::Arc;

use datafusion::physical_plan::{ChildrenPropertiesMode, ExecutionPlan, ReplaceChildrenOptions};
use datafusion_distributed::BroadcastExec;

use crate::array::blockwise::BlockwiseTasksExec;
use crate::array::rolling::RollingWindowExec;
use crate::array::DenseReductionExec;
use crate::plan_methods::physical_bottom_up_rule;
use crate::table::{ZarrScanExec, TASKS_OF_STAGE};

/// Broadcasts the small side of every broadcast join of a plan to the
/// tasks reading its grid.
#[derive(Debug, Default)]
pub struct ClusterBroadcasts;

physical_bottom_up_rule!(
    ClusterBroadcasts,
    "zarrfusion_cluster_broadcasts",
    |node, _| {
        if node.children().is_empty() {
            return Ok(None);
        }
        let dealt: Arc<dyn ExecutionPlan> = if let Some(scan) = node.downcast_ref::<ZarrScanExec>()
        {
            if scan.tasks() == TASKS_OF_STAGE {
                return Ok(None);
            }
            Arc::new(scan.with_tasks_of_stage())
        } else if let Some(window) = node.downcast_ref::<RollingWindowExec>() {
            if window.tasks() == TASKS_OF_STAGE {
                return Ok(None);
            }
            Arc::new(window.with_tasks_of_stage())
        } else if let Some(step) = node.downcast_ref::<BlockwiseTasksExec>() {
            if step.tasks() == TASKS_OF_STAGE {
                return Ok(None);
            }
            Arc::new(step.with_tasks_of_stage())
        } else if let Some(reduction) = node.downcast_ref::<DenseReductionExec>() {
            if matches!(reduction.tasks(), None | Some(TASKS_OF_STAGE)) {
                return Ok(None);
            }
            Arc::new(reduction.with_tasks_of_stage()?)
        } else {
            return Ok(None);
        };
        let broadcast = (dealt.children().into_iter())
            .map(|small| Arc::new(BroadcastExec::new(Arc::clone(small), 1)) as _)
            .collect();
        let options = ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute);
        Ok(Some(dealt.replace_children(broadcast, options)?))
    }
);

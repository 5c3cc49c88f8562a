//! `COPY ... STORED AS ZARR` of a whole table on a cluster: a physical
//! optimizer rule of sessions with workers. [`ClusterCopies`] gives each
//! [`ArrayCopyExec`] its rechunk's rounds of tasks as inputs
//! ([`ArrayCopyExec::on_cluster`]: per round a
//! [`RechunkTasksExec`](crate::array::rechunk::RechunkTasksExec) under the
//! gathering of the tasks' counts). The distributed planner puts a network
//! boundary at each gathering, each round's stage is split into tasks by
//! the bytes it writes like a scan's by the bytes it decodes
//! ([`super::tasks`]), and the workers write the intermediate arrays and
//! the target's chunks while the session stages and commits the target.

use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::Result;
use datafusion::config::ConfigOptions;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::ExecutionPlan;

use crate::array::copy::whole::ArrayCopyExec;

/// Runs the tasks of every whole-table `COPY` of a plan on the workers.
#[derive(Debug, Default)]
pub struct ClusterCopies;

impl PhysicalOptimizerRule for ClusterCopies {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| {
            let Some(copy) = node.downcast_ref::<ArrayCopyExec>() else {
                return Ok(Transformed::no(node));
            };
            match copy.on_cluster()? {
                Some(on_cluster) => Ok(Transformed::yes(Arc::new(on_cluster))),
                None => Ok(Transformed::no(node)),
            }
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "zarrfusion_cluster_copies"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

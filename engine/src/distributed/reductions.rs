//! Dense reductions on a cluster: physical optimizer rules of sessions
//! with workers. [`ClusterReductions`] plans each dense reduction as
//! partial states per task under their merge, a [`DenseMergeExec`] (or
//! DataFusion's final aggregate; see [`DenseReductionExec::on_cluster`]);
//! [`GatherStates`] keeps the gathering of the states under a merge or a
//! `Final` aggregate, which DataFusion drops as one partition needs none.
//! The distributed planner then puts a network gather (or shuffle) between
//! the two, and the reduction's stage is split into tasks by its decoded
//! bytes like a scan's ([`super::tasks`]).

use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::Result;
use datafusion::config::ConfigOptions;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::{ChildrenPropertiesMode, ExecutionPlan, ReplaceChildrenOptions};

use crate::array::{DenseMergeExec, DenseReductionExec};
use crate::plan_methods::physical_bottom_up_rule;

/// Plans every dense reduction of a plan for a cluster.
#[derive(Debug, Default)]
pub struct ClusterReductions;

physical_bottom_up_rule!(
    ClusterReductions,
    "zarrfusion_cluster_reductions",
    |node, config| match node.downcast_ref::<DenseReductionExec>() {
        Some(reduction) if reduction.tasks().is_none() => {
            let partitions = config.execution.target_partitions;
            reduction.on_cluster(partitions).map(Some)
        }
        _ => Ok(None),
    }
);

/// Gathers the partial states of a dense reduction under their merge (a
/// [`DenseMergeExec`], or the `Final` aggregate of a reduction without
/// `GROUP BY`): the gathering is where the distributed planner puts the
/// network boundary that sends the reduction's tasks to the workers.
#[derive(Debug, Default)]
pub struct GatherStates;

impl PhysicalOptimizerRule for GatherStates {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| {
            let states = if let Some(merge) = node.downcast_ref::<DenseMergeExec>() {
                merge.children()[0]
            } else {
                match node.downcast_ref::<AggregateExec>() {
                    Some(a) if *a.mode() == AggregateMode::Final => a.input(),
                    _ => return Ok(Transformed::no(node)),
                }
            };
            let gives_states = states
                .downcast_ref::<DenseReductionExec>()
                .is_some_and(|r| r.tasks().is_some());
            if !gives_states {
                return Ok(Transformed::no(node));
            }
            let gathered = Arc::new(CoalescePartitionsExec::new(Arc::clone(states)));
            let options = ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute);
            Ok(Transformed::yes(
                node.replace_children(vec![gathered], options)?,
            ))
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "zarrfusion_gather_states"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// The session's physical optimizer rules
/// ([`crate::window_frames::physical_rules`]) with [`ClusterReductions`] first
/// (before the rule that places repartitions and sorts, which then places
/// them for the final aggregate as for any other), and right after that
/// rule [`ClusterCopies`](super::copies::ClusterCopies),
/// [`ClusterPasses`](super::transforms::ClusterPasses), [`GatherStates`]
/// (which gather what they send to the workers) and
/// [`ClusterBroadcasts`](super::broadcasts::ClusterBroadcasts) (which
/// broadcasts the small sides of joins).
pub fn rules_with_cluster_reductions() -> Vec<Arc<dyn PhysicalOptimizerRule + Send + Sync>> {
    let mut rules = crate::window_frames::physical_rules();
    let requirements = rules
        .iter()
        .position(|r| r.name() == "EnsureRequirements")
        .map_or(rules.len(), |i| i + 1);
    rules.insert(requirements, Arc::new(super::broadcasts::ClusterBroadcasts));
    rules.insert(requirements, Arc::new(GatherStates));
    rules.insert(requirements, Arc::new(super::transforms::ClusterPasses));
    rules.insert(requirements, Arc::new(super::copies::ClusterCopies));
    rules.insert(0, Arc::new(ClusterReductions));
    rules
}

//! Stages checked while planning: every stage of a distributed plan that
//! the workers run is encoded once, in the session, before anything runs.
//!
//! datafusion-distributed encodes a stage when it sends it to a worker, in
//! a task of its own; a node that cannot be encoded (one of zarrfusion's
//! that runs in the session only, such as the copy of `rechunk(...)`, sent
//! to the workers because what it feeds is split among them) then left the
//! worker waiting for a plan that never came, and the query failed after
//! its time-out (10 s) with a message saying only that. [`CheckedStages`]
//! wraps the distributed query planner and refuses such a plan at once,
//! naming the stage and the node.

use std::sync::Arc;

use async_trait::async_trait;
use datafusion::catalog::Session;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{plan_err, DataFusionError, Result};
use datafusion::execution::context::QueryPlanner;
use datafusion::logical_expr::LogicalPlan;
use datafusion::physical_plan::empty::EmptyExec;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::SessionConfig;
use datafusion_distributed::{DistributedCodec, NetworkBoundaryExt};
use datafusion_proto::bytes::physical_plan_to_bytes_with_extension_codec;
use datafusion_proto::physical_plan::{DefaultPhysicalProtoConverter, PhysicalExtensionCodec};

use super::codec::ZarrCodec;
use super::reductions::gather_bands_in_order;

/// A query planner (the distributed one) whose plans' worker stages are
/// checked to travel ([`check_worker_stages`]), the runs of bands its
/// tasks send gathered in order ([`gather_bands_in_order`]).
#[derive(Debug)]
pub struct CheckedStages(pub Arc<dyn QueryPlanner + Send + Sync>);

#[async_trait]
impl QueryPlanner for CheckedStages {
    async fn create_physical_plan(
        &self,
        logical_plan: &LogicalPlan,
        session: &dyn Session,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let plan = self.0.create_physical_plan(logical_plan, session).await?;
        let plan = gather_bands_in_order(plan)?;
        check_worker_stages(&plan, session.config())?;
        Ok(plan)
    }
}

/// Encodes every stage of `plan` below a network boundary (those the
/// workers run), each without the stages below it, with the codecs of
/// `config`, as the coordinator will send them; an error names the first
/// stage that cannot be encoded and the node that cannot travel, in
/// zarrfusion's words.
pub fn check_worker_stages(plan: &Arc<dyn ExecutionPlan>, config: &SessionConfig) -> Result<()> {
    let codec = DistributedCodec::new_combined_with_user(config);
    let travels = |plan: &Arc<dyn ExecutionPlan>| {
        physical_plan_to_bytes_with_extension_codec(Arc::clone(plan), &codec).is_ok()
    };
    let mut stack = vec![Arc::clone(plan)];
    while let Some(node) = stack.pop() {
        let Some(boundary) = node.as_ref().as_network_boundary() else {
            stack.extend(node.children().into_iter().cloned());
            continue;
        };
        let stage = boundary.input_stage();
        let Some(stage_plan) = stage.local_plan() else {
            continue;
        };
        stack.push(Arc::clone(stage_plan));
        // The stage alone: the stages below it are sent on their own.
        let Some(alone) = without_stages_below(stage_plan) else {
            continue; // a node that takes no stand-in child: not checked
        };
        if !travels(&alone) {
            let culprit = first_not_travelling(&alone, &travels);
            let mut buf = Vec::new();
            let converter = DefaultPhysicalProtoConverter {};
            let why =
                match ZarrCodec::default().try_encode(Arc::clone(&culprit), &mut buf, &converter) {
                    Err(DataFusionError::NotImplemented(why)) => why,
                    Err(e) => e.to_string(),
                    Ok(()) => format!("{} cannot be sent to them", culprit.name()),
                };
            return plan_err!(
                "stage {} of this query would run on the cluster's workers, but {why}",
                stage.num()
            );
        }
    }
    Ok(())
}

/// A stage's `plan` with the network boundaries to the stages below it
/// replaced by empty stand-ins of their schema, as the coordinator sends
/// it (those stages travel on their own); `None` when a node does not
/// take the stand-in.
fn without_stages_below(plan: &Arc<dyn ExecutionPlan>) -> Option<Arc<dyn ExecutionPlan>> {
    let cut = Arc::clone(plan).transform_down(|node| {
        if !node.as_ref().is_network_boundary() {
            return Ok(Transformed::no(node));
        }
        let stand_in: Arc<dyn ExecutionPlan> = Arc::new(EmptyExec::new(node.schema()));
        Ok(Transformed::new(stand_in, true, TreeNodeRecursion::Jump))
    });
    cut.ok().map(|t| t.data)
}

/// The deepest node of a stage's `plan` that does not travel while every
/// node below it in the stage does.
fn first_not_travelling(
    plan: &Arc<dyn ExecutionPlan>,
    travels: &dyn Fn(&Arc<dyn ExecutionPlan>) -> bool,
) -> Arc<dyn ExecutionPlan> {
    let below = plan.children().into_iter().find(|child| !travels(child));
    match below {
        Some(child) => first_not_travelling(child, travels),
        None => Arc::clone(plan),
    }
}

//! Dense reductions on a cluster: physical optimizer rules of sessions
//! with workers. [`ClusterReductions`] plans each dense reduction as
//! partial states per task under their merge, a [`DenseMergeExec`] (or
//! DataFusion's final aggregate; see [`DenseReductionExec::on_cluster`]);
//! [`GatherStates`] keeps the gathering of the states under a merge or a
//! `Final` aggregate, which DataFusion drops as one partition needs none.
//! A reduction in bands (more group state than one pass holds) deals its
//! bands to the tasks instead, each finishing its bands' groups, and its
//! rows (or what a projection or partial aggregate beside it makes of
//! them) are gathered in its order.
//! Where those rows have no order (bands of a later dimension), the
//! session gathers the tasks one after the other
//! ([`gather_bands_in_order`]), so they come band by band.
//! The distributed planner then puts a network gather (or shuffle) between
//! the two, and the reduction's stage is split into tasks by its decoded
//! bytes like a scan's ([`super::tasks`]).

use std::any::Any;
use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{plan_err, Result};
use datafusion::config::ConfigOptions;
use datafusion::datasource::sink::DataSinkExec;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::coop::CooperativeExec;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec;
use datafusion::physical_plan::{
    replace_children_if_necessary, ChildrenPropertiesMode, ExecutionPlan, Partitioning,
    ReplaceChildrenOptions,
};

use datafusion_distributed::{DistributedConfig, NetworkBoundaryExt};

use super::barrier::AfterExec;
use super::in_order::InOrderGatherExec;
use super::tasks::tasks_for;
use crate::array::reduce::Bands;
use crate::array::{DenseMergeExec, DenseReductionExec, Merged, GROUP_POSITION};
use crate::config::ZarrConfig;
use crate::write::ZarrSink;

/// Plans every dense reduction of a plan for a cluster of `workers`
/// workers, its states merged in a tree or in the session
/// (`zarrfusion.state_merge`; see [`DenseReductionExec::on_cluster`]).
#[derive(Debug)]
pub struct ClusterReductions {
    workers: usize,
}

impl ClusterReductions {
    /// The rule for a cluster of `workers` workers.
    pub fn new(workers: usize) -> Self {
        Self { workers }
    }

    /// Whether `reduction`'s states merge in a tree under `config`: asked
    /// for, or (`auto`) when its stage runs more than two tasks, where the
    /// session would receive and merge more than two states per group.
    fn tree(&self, reduction: &DenseReductionExec, config: &ConfigOptions) -> Result<bool> {
        let setting = ZarrConfig::of(config).state_merge;
        match setting.trim().to_ascii_lowercase().as_str() {
            "tree" => Ok(true),
            "session" => Ok(false),
            "auto" => {
                let most = config
                    .extensions
                    .get::<DistributedConfig>()
                    .map_or(0, |d| d.max_tasks_per_stage);
                let most = if most == 0 { self.workers } else { most };
                let wanted = tasks_for(
                    reduction.decoded_bytes(),
                    reduction.read().blocks.num_blocks(),
                    config,
                );
                Ok(wanted.min(most) > 2)
            }
            other => {
                plan_err!("zarrfusion.state_merge is '{other}'; it takes auto, session or tree")
            }
        }
    }
}

impl PhysicalOptimizerRule for ClusterReductions {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| match node.downcast_ref::<DenseReductionExec>() {
            // One in bands of its groups deals its bands to the tasks, each
            // finishing its own bands' groups (gathered by `GatherStates`).
            Some(reduction) if reduction.tasks().is_none() && reduction.in_bands() => {
                Ok(Transformed::yes(Arc::new(reduction.with_tasks(1)?)))
            }
            Some(reduction) if reduction.tasks().is_none() => {
                let partitions = config.execution.target_partitions;
                let tree = self.tree(reduction, config)?;
                Ok(Transformed::yes(reduction.on_cluster(partitions, tree)?))
            }
            _ => Ok(Transformed::no(node)),
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "zarrfusion_cluster_reductions"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// Gathers the partial states of a dense reduction (or of a level of their
/// merge tree) under their merge (a [`DenseMergeExec`], or the `Final`
/// aggregate of a reduction without `GROUP BY`), and shuffles them by group
/// position under a level of the merge tree: the gathering (the shuffle)
/// is where the distributed planner puts the network boundary that sends
/// the reduction's tasks (or the level's) to the workers. The rows of a
/// reduction whose bands are dealt to the tasks are gathered too (above
/// what runs beside it partition by partition), merged in its order where
/// it has one.
#[derive(Debug, Default)]
pub struct GatherStates;

impl PhysicalOptimizerRule for GatherStates {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let partitions = config.execution.target_partitions.max(1);
        let plan = match gather_bands(plan)? {
            (plan, true) => gather(plan),
            (plan, false) => plan,
        };
        plan.transform_up(|node| {
            let (states, level) = if let Some(merge) = node.downcast_ref::<DenseMergeExec>() {
                (merge.children()[0], merge.merged() == Merged::States)
            } else {
                match node.downcast_ref::<AggregateExec>() {
                    Some(a) if *a.mode() == AggregateMode::Final => (a.input(), false),
                    _ => return Ok(Transformed::no(node)),
                }
            };
            // States read after a previous round (a rechunk's copy), or
            // through DataFusion's cooperative yielding (a small side of a
            // join planned on its own first has it already).
            let mut reading = states;
            loop {
                reading = match reading.downcast_ref::<AfterExec>() {
                    Some(after) => after.then(),
                    None if reading.is::<CooperativeExec>() => reading.children()[0],
                    None => break,
                };
            }
            let gives_states = match reading.downcast_ref::<DenseMergeExec>() {
                Some(below) => below.merged() == Merged::States,
                None => reading
                    .downcast_ref::<DenseReductionExec>()
                    .is_some_and(|r| r.gives_states()),
            };
            if !gives_states {
                return Ok(Transformed::no(node));
            }
            // A level takes the states shuffled by position; DataFusion
            // drops that shuffle too, as the states come in one partition
            // before the distributed planner splits them into tasks.
            let input: Arc<dyn ExecutionPlan> = match level {
                true => {
                    let position = Arc::new(Column::new(GROUP_POSITION, 0));
                    let hashed = Partitioning::Hash(vec![position], partitions);
                    Arc::new(RepartitionExec::try_new(Arc::clone(states), hashed)?)
                }
                false => Arc::new(CoalescePartitionsExec::new(Arc::clone(states))),
            };
            let options = ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute);
            Ok(Transformed::yes(
                node.replace_children(vec![input], options)?,
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

/// Whether `node` is a reduction in bands whose bands are dealt to a
/// cluster's tasks.
fn dealing_bands(node: &Arc<dyn ExecutionPlan>) -> bool {
    (node.downcast_ref::<DenseReductionExec>()).is_some_and(|r| r.in_bands() && r.tasks().is_some())
}

/// Whether `node` works partition by partition, each on its own, so that
/// it runs in each task beside a reduction dealing its bands: a
/// projection, a filter, a round-robin repartition, an aggregate's partial
/// states.
fn partition_wise(node: &Arc<dyn ExecutionPlan>) -> bool {
    if let Some(aggregate) = node.downcast_ref::<AggregateExec>() {
        return *aggregate.mode() == AggregateMode::Partial;
    }
    if let Some(repartition) = node.downcast_ref::<RepartitionExec>() {
        return matches!(repartition.partitioning(), Partitioning::RoundRobinBatch(_));
    }
    node.is::<ProjectionExec>() || node.is::<FilterExec>() || node.is::<CooperativeExec>()
}

/// The rows of each task of `plan` (a reduction dealing its bands, and
/// what runs beside it) gathered: merged in its order where it has one
/// (each task's bands are a run of them, in that order, and what runs
/// beside them keeps it), else concatenated. The gathering is where the
/// distributed planner puts the network boundary.
fn gather(plan: Arc<dyn ExecutionPlan>) -> Arc<dyn ExecutionPlan> {
    match plan.properties().output_ordering() {
        Some(ordering) => Arc::new(SortPreservingMergeExec::new(ordering.clone(), plan)),
        None => Arc::new(CoalescePartitionsExec::new(plan)),
    }
}

/// `plan` with the rows of every reduction dealing its bands to a
/// cluster's tasks gathered above what runs beside it partition by
/// partition ([`partition_wise`]: a projection, an aggregate's partial
/// states), below the first node that needs them together (unless that
/// gathers them itself); and whether `plan`'s own rows are still the
/// tasks' (to be gathered above it).
fn gather_bands(plan: Arc<dyn ExecutionPlan>) -> Result<(Arc<dyn ExecutionPlan>, bool)> {
    if dealing_bands(&plan) {
        return Ok((plan, true));
    }
    let children = plan.children();
    if children.is_empty() {
        return Ok((plan, false));
    }
    let mut changed = false;
    let mut below = Vec::with_capacity(children.len());
    for child in children {
        let (child_plan, tasks) = gather_bands(Arc::clone(child))?;
        changed |= tasks || !Arc::ptr_eq(&child_plan, child);
        below.push((child_plan, tasks));
    }
    if !changed {
        return Ok((plan, false));
    }
    let passes = partition_wise(&plan) && below.len() == 1;
    let gathers = plan.is::<CoalescePartitionsExec>() || plan.is::<SortPreservingMergeExec>();
    let dealt = below.iter().any(|(_, tasks)| *tasks);
    let children = (below.into_iter())
        .map(|(child, tasks)| match tasks && !passes && !gathers {
            true => gather(child),
            false => child,
        })
        .collect();
    let options = ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute);
    Ok((plan.replace_children(children, options)?, passes && dealt))
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
pub fn rules_with_cluster_reductions(
    workers: usize,
) -> Vec<Arc<dyn PhysicalOptimizerRule + Send + Sync>> {
    let mut rules = crate::window_frames::physical_rules();
    let requirements = rules
        .iter()
        .position(|r| r.name() == "EnsureRequirements")
        .map_or(rules.len(), |i| i + 1);
    rules.insert(requirements, Arc::new(super::broadcasts::ClusterBroadcasts));
    rules.insert(requirements, Arc::new(GatherStates));
    rules.insert(requirements, Arc::new(super::transforms::ClusterPasses));
    rules.insert(requirements, Arc::new(super::copies::ClusterCopies));
    rules.insert(0, Arc::new(ClusterReductions::new(workers)));
    rules
}

/// `plan` (a session's distributed plan) with each gathering, in the
/// session's own stage, of a stage whose tasks send runs of a reduction's
/// bands in no declared order (bands of a later dimension: the diurnal
/// cycle of every cell in bands of latitudes) made an
/// [`InOrderGatherExec`]: the tasks' rows one after the other, so they
/// come band by band as on one machine (what a `COPY` writing a band at a
/// time needs; DataFusion's gather interleaves them).
pub fn gather_bands_in_order(plan: Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
    if plan.as_network_boundary().is_some() {
        return Ok(plan);
    }
    if let Some(coalesce) = plan.downcast_ref::<CoalescePartitionsExec>() {
        if coalesce.fetch().is_none() && unordered_bands(coalesce.input()).is_some() {
            return Ok(Arc::new(InOrderGatherExec::new(Arc::clone(
                coalesce.input(),
            ))));
        }
    }
    let children = (plan.children().into_iter())
        .map(|child| gather_bands_in_order(Arc::clone(child)))
        .collect::<Result<Vec<_>>>()?;
    let plan = replace_children_if_necessary(plan, children)?;
    Ok(match plan.downcast_ref::<DataSinkExec>() {
        Some(sink) => sink_in_dealt_bands(sink).unwrap_or(plan),
        None => plan,
    })
}

/// The bands of the reduction of the stage whose network boundary is
/// `input`, where its tasks each send a run of them (through
/// projections) in no declared order.
fn unordered_bands(input: &Arc<dyn ExecutionPlan>) -> Option<Bands> {
    let stage = input.as_network_boundary()?.input_stage();
    let mut node = Arc::clone(stage.local_plan()?);
    if node.properties().output_ordering().is_some() {
        return None;
    }
    loop {
        if dealing_bands(&node) {
            return node.downcast_ref::<DenseReductionExec>()?.bands();
        }
        let passes = node.is::<ProjectionExec>() || node.is::<CooperativeExec>();
        match node.children().as_slice() {
            [child] if passes => node = Arc::clone(child),
            _ => return None,
        }
    }
}

/// A `COPY` writing the bands gathered in order as `sink` does, in the
/// bands its tasks fold: the stage's split evened them out for its tasks
/// (no larger than the session cut them, where the sink was planned).
fn sink_in_dealt_bands(sink: &DataSinkExec) -> Option<Arc<dyn ExecutionPlan>> {
    let zarr = (sink.sink() as &dyn Any).downcast_ref::<ZarrSink>()?;
    let mut node = Arc::clone(sink.input());
    while let Some(projection) = node.downcast_ref::<ProjectionExec>() {
        node = Arc::clone(projection.input());
    }
    let gather = node.downcast_ref::<InOrderGatherExec>()?;
    let bands = unordered_bands(gather.children()[0])?;
    let written = zarr.in_bands_of(bands.keys as u64)?;
    let input = Arc::clone(sink.input());
    let order = sink.sort_order().clone();
    Some(Arc::new(DataSinkExec::new(input, Arc::new(written), order)))
}

//! How a Zarr scan's, a dense reduction's, a rolling window's, a
//! transform's (or its detrend fit's), a rechunk's or a
//! blockwise step's (a COPY's, a COPY of a transform's, a four-step pass's) is split among a
//! cluster's tasks: the distributed
//! planner asks each leaf how many tasks it wants ([`scan_tasks`]: its
//! decoded bytes (a rechunk's: written) over `zarrfusion.bytes_per_task`,
//! at most one per block or rechunk task), then tells it how
//! many it got ([`deal_scan_blocks`]: the leaf deals its blocks to them in
//! contiguous runs, see [`ZarrScanExec::with_tasks`] and
//! [`DenseReductionExec::with_tasks`]). A node that needs all of an
//! input together where nothing gathers or shuffles it first keeps its
//! stage to one task ([`whole_input_tasks`]).

use std::sync::Arc;

use datafusion::common::Result;
use datafusion::config::ConfigOptions;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec;
use datafusion::physical_plan::{Distribution, ExecutionPlan, Partitioning};
use datafusion_distributed::{
    DesiredTaskCountEvent, DesiredTaskCountEventResponse, ScaleUpLeafNodeEvent,
    ScaleUpLeafNodeEventResponse,
};

use crate::array::blockwise::BlockwiseTasksExec;
use crate::array::fft::{DetrendFitExec, FftExec};
use crate::array::rechunk::RechunkTasksExec;
use crate::array::rolling::RollingWindowExec;
use crate::array::DenseReductionExec;
use crate::config::ZarrConfig;
use crate::table::{ZarrScanExec, TASKS_OF_STAGE};

/// The tasks a Zarr scan or a dense reduction's partial states want: one
/// per `zarrfusion.bytes_per_task` of decoded bytes, at least one, at most
/// one per block (a reduction in bands: one per band).
pub fn scan_tasks(ev: DesiredTaskCountEvent) -> Option<Result<DesiredTaskCountEventResponse>> {
    let (bytes, blocks) = if let Some(scan) = ev.plan.downcast_ref::<ZarrScanExec>() {
        (scan.decoded_bytes(), scan.read().blocks.num_blocks())
    } else if let Some(rechunk) = ev.plan.downcast_ref::<RechunkTasksExec>() {
        (rechunk.bytes_written(), rechunk.rechunk_tasks())
    } else if let Some(step) = ev.plan.downcast_ref::<BlockwiseTasksExec>() {
        (step.task_bytes(), step.chunk_tasks())
    } else if let Some(window) = ev.plan.downcast_ref::<RollingWindowExec>() {
        (window.decoded_bytes(), window.read().blocks.num_blocks())
    } else if let Some(fit) = ev.plan.downcast_ref::<DetrendFitExec>() {
        (fit.bytes_read(), fit.chunks())
    } else if let Some(fft) = ev.plan.downcast_ref::<FftExec>() {
        if fft.tasks() != TASKS_OF_STAGE && fft.table().chain().is_none() {
            // Its path makes a store in work_dir first: in the session
            // (but for the stage after a staged transform's first, which
            // reads that store on the workers).
            return Some(Ok(DesiredTaskCountEventResponse::desired(1)));
        }
        (fft.bytes_read(), fft.blocks().blocks.num_blocks())
    } else {
        let reduction = ev.plan.downcast_ref::<DenseReductionExec>()?;
        reduction.tasks()?;
        // In bands, its bands are dealt: at most one task a band.
        let units = match reduction.in_bands() {
            true => reduction.num_bands() as u64,
            false => reduction.read().blocks.num_blocks(),
        };
        (reduction.decoded_bytes(), units)
    };
    let tasks = tasks_for(bytes, blocks, ev.session_config.options());
    Some(Ok(DesiredTaskCountEventResponse::desired(tasks)))
}

/// One task for a node that needs all of an input's rows together (one
/// partition of them, or each hash partition whole: a `Single` aggregate,
/// a sort, a limit, a merge of a reduction's results) where that input is
/// not gathered or shuffled first (which the distributed planner makes a
/// network boundary): with one target partition DataFusion puts no
/// gathering there, and a stage split into tasks below a broadcast (a
/// join's small side) would give each task's part of the answer.
pub fn whole_input_tasks(
    ev: DesiredTaskCountEvent,
) -> Option<Result<DesiredTaskCountEventResponse>> {
    let plan = ev.plan;
    let required = plan.input_distribution_requirements().into_per_child();
    let split = plan
        .children()
        .into_iter()
        .zip(required)
        .any(|(child, wanted)| {
            match wanted {
                Distribution::UnspecifiedDistribution => false,
                Distribution::SinglePartition => !below_one(child, gathers),
                // Partitioned by keys (or by hash, its older name).
                _ => !below_one(child, shuffles),
            }
        });
    split.then(|| Ok(DesiredTaskCountEventResponse::maximum(1)))
}

/// Whether `plan`, or a node under it through nodes of one input each (a
/// sort within partitions, a projection, a filter), is one that `is`: a
/// window over a sort of a shuffle reads its input through the sort.
fn below_one(plan: &Arc<dyn ExecutionPlan>, is: fn(&Arc<dyn ExecutionPlan>) -> bool) -> bool {
    let mut node = plan;
    loop {
        if is(node) {
            return true;
        }
        match node.children().as_slice() {
            [only] => node = only,
            _ => return false,
        }
    }
}

/// Whether `plan` gathers its input's partitions into one (a network
/// gather across tasks on a cluster).
fn gathers(plan: &Arc<dyn ExecutionPlan>) -> bool {
    plan.is::<CoalescePartitionsExec>() || plan.is::<SortPreservingMergeExec>()
}

/// Whether `plan` shuffles its input by hash (a network shuffle across
/// tasks on a cluster).
fn shuffles(plan: &Arc<dyn ExecutionPlan>) -> bool {
    plan.downcast_ref::<RepartitionExec>()
        .is_some_and(|r| matches!(r.partitioning(), Partitioning::Hash(..)))
}

/// The tasks a leaf reading (or writing) `bytes` in `blocks` blocks wants
/// under `config`: one per `zarrfusion.bytes_per_task`, at least one, at
/// most one per block (the engine then gives at most its limit, a task per
/// worker unless set otherwise).
pub fn tasks_for(bytes: u64, blocks: u64, config: &ConfigOptions) -> usize {
    let per_task = ZarrConfig::of(config).bytes_per_task.max(1) as u64;
    let tasks = bytes.div_ceil(per_task).clamp(1, blocks.max(1));
    usize::try_from(tasks).unwrap_or(usize::MAX)
}

/// A Zarr scan or a dense reduction's partial states dealing its blocks to
/// the stage's tasks (a reduction in bands: its bands).
pub fn deal_scan_blocks(ev: ScaleUpLeafNodeEvent) -> Option<Result<ScaleUpLeafNodeEventResponse>> {
    if let Some(scan) = ev.plan.downcast_ref::<ZarrScanExec>() {
        return Some(Ok(ScaleUpLeafNodeEventResponse::new(Arc::new(
            scan.with_tasks(ev.task_count),
        ))));
    }
    if let Some(window) = ev.plan.downcast_ref::<RollingWindowExec>() {
        return Some(Ok(ScaleUpLeafNodeEventResponse::new(Arc::new(
            window.with_tasks(ev.task_count),
        ))));
    }
    if let Some(step) = ev.plan.downcast_ref::<BlockwiseTasksExec>() {
        return Some(Ok(ScaleUpLeafNodeEventResponse::new(Arc::new(
            step.with_tasks(ev.task_count),
        ))));
    }
    if let Some(fft) = ev.plan.downcast_ref::<FftExec>() {
        return Some(Ok(ScaleUpLeafNodeEventResponse::new(Arc::new(
            fft.with_tasks(ev.task_count),
        ))));
    }
    if let Some(fit) = ev.plan.downcast_ref::<DetrendFitExec>() {
        return Some(Ok(ScaleUpLeafNodeEventResponse::new(Arc::new(
            fit.with_tasks(ev.task_count),
        ))));
    }
    if let Some(rechunk) = ev.plan.downcast_ref::<RechunkTasksExec>() {
        return Some(Ok(ScaleUpLeafNodeEventResponse::new(Arc::new(
            rechunk.with_tasks(ev.task_count),
        ))));
    }
    let reduction = ev.plan.downcast_ref::<DenseReductionExec>()?;
    reduction.tasks()?;
    Some(
        reduction
            .with_tasks(ev.task_count)
            .map(|r| ScaleUpLeafNodeEventResponse::new(Arc::new(r))),
    )
}

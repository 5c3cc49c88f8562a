//! Physical planning of the array plan nodes.
//!
//! [`ArrayQueryPlanner`] is DataFusion's default planner with
//! [`ArrayExtensionPlanner`] added, which turns each array node into its
//! operator.

use std::sync::Arc;

use async_trait::async_trait;
use datafusion::catalog::Session;
use datafusion::common::Result;
use datafusion::execution::context::QueryPlanner;
use datafusion::execution::memory_pool::MemoryLimit;
use datafusion::logical_expr::physical_planning_context::PhysicalPlanningContext;
use datafusion::logical_expr::{LogicalPlan, UserDefinedLogicalNode};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_planner::{DefaultPhysicalPlanner, ExtensionPlanner, PhysicalPlanner};

use super::fft::FftCopy;
use super::rechunk::{RechunkExec, RechunkTable};
use super::reduce::{reduction_rows, DenseReduction, DenseReductionExec};
use super::rolling::{RollingWindow, RollingWindowExec};
use super::scan_path::TableRead;
use crate::array::copy::rolling::RollingCopy;
use crate::array::copy::selection::SelectionCopy;
use crate::array::copy::ArrayCopy;
use crate::table::{BlockRead, BroadcastInputs, ReadsBroadcasts};
use crate::write::rows::RowGrid;

/// Plans the array nodes of `engine::array`.
#[derive(Debug, Default)]
pub struct ArrayExtensionPlanner;

#[async_trait]
impl ExtensionPlanner for ArrayExtensionPlanner {
    async fn plan_extension(
        &self,
        planner: &dyn PhysicalPlanner,
        node: &dyn UserDefinedLogicalNode,
        _logical_inputs: &[&LogicalPlan],
        _physical_inputs: &[Arc<dyn ExecutionPlan>],
        session: &dyn Session,
        planning: &PhysicalPlanningContext,
    ) -> Result<Option<Arc<dyn ExecutionPlan>>> {
        if let Some(reduction) = node.as_any().downcast_ref::<DenseReduction>() {
            if let Some(read) = &reduction.read.rechunk {
                let variables = reduction.variables();
                return over_rechunk(read, &reduction.read, variables, session, |read| {
                    let node = DenseReduction {
                        read,
                        ..reduction.clone()
                    };
                    Ok(Arc::new(DenseReductionExec::plan(
                        &node, planner, session, planning,
                    )?))
                })
                .await;
            }
            let exec = DenseReductionExec::plan(reduction, planner, session, planning)?;
            let (broadcasts, limit) = joined_in(exec.read(), session).await?;
            let exec = exec.with_broadcasts(broadcasts, limit)?;
            return Ok(Some(Arc::new(exec)));
        }
        if let Some(window) = node.as_any().downcast_ref::<RollingWindow>() {
            if let Some(read) = &window.read.rechunk {
                let variables = window.variables();
                return over_rechunk(read, &window.read, variables, session, |read| {
                    let node = RollingWindow {
                        read,
                        ..window.clone()
                    };
                    Ok(Arc::new(RollingWindowExec::plan(
                        &node, planner, session, planning,
                    )?))
                })
                .await;
            }
            let exec = RollingWindowExec::plan(window, planner, session, planning)?;
            let (broadcasts, limit) = joined_in(exec.read(), session).await?;
            let exec = exec.with_broadcasts(broadcasts, limit)?;
            return Ok(Some(Arc::new(exec)));
        }
        if let Some(copy) = node.as_any().downcast_ref::<ArrayCopy>() {
            return Ok(Some(Arc::new(copy.plan(session).await?)));
        }
        if let Some(copy) = node.as_any().downcast_ref::<FftCopy>() {
            return Ok(Some(Arc::new(copy.plan(session).await?)));
        }
        if let Some(copy) = node.as_any().downcast_ref::<RollingCopy>() {
            let exec = RollingWindowExec::plan(&copy.window, planner, session, planning)?;
            let (broadcasts, limit) = joined_in(exec.read(), session).await?;
            let exec = exec.with_broadcasts(broadcasts, limit)?;
            return Ok(Some(Arc::new(copy.plan(exec, planner, session, planning)?)));
        }
        if let Some(copy) = node.as_any().downcast_ref::<SelectionCopy>() {
            let broadcasts = BroadcastInputs::plan(copy.broadcasts_read()?, session).await?;
            return Ok(Some(Arc::new(
                copy.plan(broadcasts, planner, session, planning)?,
            )));
        }
        Ok(None)
    }
}

/// The small sides of the broadcast columns `read` reads, planned, and
/// the session's memory limit their operator must fit with them.
async fn joined_in(
    read: &BlockRead,
    session: &dyn Session,
) -> Result<(BroadcastInputs, Option<usize>)> {
    let broadcasts =
        BroadcastInputs::plan(read.table.broadcasts_read(&read.columns), session).await?;
    let limit = match session.runtime_env().memory_pool.memory_limit() {
        MemoryLimit::Finite(limit) => Some(limit),
        _ => None,
    };
    Ok((broadcasts, limit))
}

/// A leaf operator reading `rechunk(...)` (`rechunk`, of `read`'s
/// table): the rechunked store of `variables` made, the operator `plan`
/// makes over the read of it, under the [`RechunkExec`] that copies the
/// variables into it on first execution.
async fn over_rechunk(
    rechunk: &RechunkTable,
    read: &TableRead,
    variables: Vec<String>,
    session: &dyn Session,
    plan: impl FnOnce(TableRead) -> Result<Arc<dyn ExecutionPlan>>,
) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let rechunked = rechunk.prepare(session, variables).await?;
    let exec = plan(read.reading(rechunked.table().grid()))?;
    let exec: RechunkExec = rechunked.read_by(exec);
    Ok(Some(Arc::new(exec)))
}

/// What a session's `COPY ... STORED AS ZARR` knows of `plan`'s rows before
/// they come (its [`RowGrids`](crate::write::rows::RowGrids)): a dense
/// reduction's grid ([`reduction_rows`]), also where the reduction reads
/// `rechunk(...)` (its copy runs first, so the query holds the larger of
/// the copy's memory and the reduction's while the rows are written).
pub fn array_rows(plan: &dyn ExecutionPlan) -> Result<Option<RowGrid>> {
    let Some(rechunk) = plan.downcast_ref::<RechunkExec>() else {
        return reduction_rows(plan);
    };
    let copy = (rechunk.arrays().map(|a| a.projected_memory()).max()).unwrap_or(0);
    let copy = usize::try_from(copy).unwrap_or(usize::MAX);
    Ok(
        reduction_rows(rechunk.read().as_ref())?.map(|grid| RowGrid {
            memory: grid.memory.max(copy),
            ..grid
        }),
    )
}

/// DataFusion's physical planner, knowing the array nodes.
#[derive(Debug, Default)]
pub struct ArrayQueryPlanner;

#[async_trait]
impl QueryPlanner for ArrayQueryPlanner {
    async fn create_physical_plan(
        &self,
        logical_plan: &LogicalPlan,
        session: &dyn Session,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        DefaultPhysicalPlanner::with_extension_planners(vec![Arc::new(ArrayExtensionPlanner)])
            .create_physical_plan(logical_plan, session)
            .await
    }
}

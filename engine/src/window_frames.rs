//! SQL window frames and limits DataFusion 55 overflows on.
//!
//! DataFusion's window operator computes a frame's end as the row plus its
//! `FOLLOWING` bound, unchecked, and its limit pushdown past windows
//! (`LimitPushPastWindows`) adds the rows a window looks ahead (its frame's
//! `FOLLOWING` bound, a `lead` offset) to the limit and offset above it and
//! pushes the sum into the sort below, unchecked too:
//! `ROWS BETWEEN CURRENT ROW AND 18446744073709551613 FOLLOWING` under
//! `LIMIT 5` wrapped to a sort keeping 2 rows (a wrong answer), under
//! `LIMIT 1` to a sort keeping none (a panic), and without a limit the
//! window panicked while it ran; `LIMIT 2^63 - 1 OFFSET 2^63 - 1` over
//! `2 FOLLOWING` wrapped to none as well. So:
//!
//! - [`CheckWindowFrames`] refuses `ROWS` and `GROUPS` bounds over
//!   [`MAX_FRAME_BOUND`] (2^62 rows, past any series) while planning,
//!   naming the bound and what to write instead (`UNBOUNDED FOLLOWING`);
//! - [`GuardedLimitPushPastWindows`] runs DataFusion's rule only on plans
//!   whose limits, offsets and look-aheads are all at most
//!   [`LOOKAHEAD_CAP`], where no sum of them can wrap; other plans keep
//!   their limits above the window (the same answer, without the
//!   shortcut).

use std::sync::Arc;

use datafusion::common::plan_err;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::common::ScalarValue;
use datafusion::config::ConfigOptions;
use datafusion::error::Result;
use datafusion::logical_expr::expr::WindowFunction;
use datafusion::logical_expr::{
    Expr, LimitEffect, LogicalPlan, WindowFrameBound, WindowFrameUnits,
};
use datafusion::optimizer::AnalyzerRule;
use datafusion::physical_expr::window::StandardWindowExpr;
use datafusion::physical_optimizer::optimizer::PhysicalOptimizer;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::limit::{GlobalLimitExec, LocalLimitExec};
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec;
use datafusion::physical_plan::windows::BoundedWindowAggExec;
use datafusion::physical_plan::ExecutionPlan;

/// The largest `ROWS` or `GROUPS` frame bound a query may give: 2^62 rows
/// is past any series, and a row number plus it cannot overflow.
pub const MAX_FRAME_BOUND: u64 = 1 << 62;

/// Refuses window frames whose `ROWS` or `GROUPS` bounds are over
/// [`MAX_FRAME_BOUND`], naming the bound (see the module docs).
#[derive(Debug, Default)]
pub struct CheckWindowFrames;

impl AnalyzerRule for CheckWindowFrames {
    fn analyze(&self, plan: LogicalPlan, _config: &ConfigOptions) -> Result<LogicalPlan> {
        plan.apply_with_subqueries(|node| {
            for expr in node.expressions() {
                expr.apply(|e| {
                    if let Expr::WindowFunction(function) = e {
                        check_frame(function)?;
                    }
                    Ok(TreeNodeRecursion::Continue)
                })?;
            }
            Ok(TreeNodeRecursion::Continue)
        })?;
        Ok(plan)
    }

    fn name(&self) -> &str {
        "zarrfusion_check_window_frames"
    }
}

/// An error when a bound of `function`'s frame is over [`MAX_FRAME_BOUND`].
fn check_frame(function: &WindowFunction) -> Result<()> {
    let frame = &function.params.window_frame;
    if frame.units == WindowFrameUnits::Range {
        return Ok(());
    }
    for (bound, side) in [(&frame.start_bound, "start"), (&frame.end_bound, "end")] {
        let (n, direction) = match bound {
            WindowFrameBound::Preceding(ScalarValue::UInt64(Some(n))) => (*n, "PRECEDING"),
            WindowFrameBound::Following(ScalarValue::UInt64(Some(n))) => (*n, "FOLLOWING"),
            _ => continue,
        };
        if n > MAX_FRAME_BOUND {
            return plan_err!(
                "window frame {side} {n} {direction} is past any series (at most \
                 {MAX_FRAME_BOUND}): write UNBOUNDED {direction}"
            );
        }
    }
    Ok(())
}

/// The largest limit, offset or look-ahead [`GuardedLimitPushPastWindows`]
/// runs DataFusion's rule with: far above any real limit, and far enough
/// below 2^64 that the rule's sums of them (a few per window of a plan)
/// cannot wrap.
pub const LOOKAHEAD_CAP: u64 = 1 << 40;

/// DataFusion's physical optimizer rules, `LimitPushPastWindows` guarded
/// ([`GuardedLimitPushPastWindows`]) in its place.
pub fn physical_rules() -> Vec<Arc<dyn PhysicalOptimizerRule + Send + Sync>> {
    (PhysicalOptimizer::new().rules.into_iter())
        .map(|rule| match rule.name() {
            "LimitPushPastWindows" => Arc::new(GuardedLimitPushPastWindows(rule)) as _,
            _ => rule,
        })
        .collect()
}

/// DataFusion's `LimitPushPastWindows`, run only on plans where its sums
/// cannot overflow (see the module docs).
#[derive(Debug)]
pub struct GuardedLimitPushPastWindows(Arc<dyn PhysicalOptimizerRule + Send + Sync>);

impl PhysicalOptimizerRule for GuardedLimitPushPastWindows {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        match within_cap(&plan)? {
            true => self.0.optimize(plan, config),
            false => Ok(plan),
        }
    }

    fn name(&self) -> &str {
        self.0.name()
    }

    fn schema_check(&self) -> bool {
        self.0.schema_check()
    }
}

/// Whether every limit, offset, window frame end and window function
/// look-ahead of `plan` is at most [`LOOKAHEAD_CAP`].
fn within_cap(plan: &Arc<dyn ExecutionPlan>) -> Result<bool> {
    let small = |n: usize| n as u64 <= LOOKAHEAD_CAP;
    let mut within = true;
    plan.apply(|node| {
        let fits = if let Some(limit) = node.downcast_ref::<GlobalLimitExec>() {
            limit.fetch().is_none_or(small) && small(limit.skip())
        } else if let Some(limit) = node.downcast_ref::<LocalLimitExec>() {
            small(limit.fetch())
        } else if let Some(merge) = node.downcast_ref::<SortPreservingMergeExec>() {
            merge.fetch().is_none_or(small)
        } else if let Some(sort) = node.downcast_ref::<SortExec>() {
            sort.fetch().is_none_or(small)
        } else if let Some(window) = node.downcast_ref::<BoundedWindowAggExec>() {
            window.window_expr().iter().all(|expr| {
                let frame_end = match &expr.get_window_frame().end_bound {
                    WindowFrameBound::Following(ScalarValue::UInt64(Some(n))) => {
                        n <= &LOOKAHEAD_CAP
                    }
                    _ => true,
                };
                let lookahead = match expr.as_any().downcast_ref::<StandardWindowExpr>() {
                    Some(standard) => match standard.get_standard_func_expr().limit_effect() {
                        LimitEffect::Relative(n) | LimitEffect::Absolute(n) => small(n),
                        LimitEffect::None | LimitEffect::Unknown => true,
                    },
                    None => true,
                };
                frame_end && lookahead
            })
        } else {
            true
        };
        within &= fits;
        Ok(match within {
            true => TreeNodeRecursion::Continue,
            false => TreeNodeRecursion::Stop,
        })
    })?;
    Ok(within)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_limit_rule_is_replaced_by_its_guard_in_place() {
        let theirs: Vec<String> = (PhysicalOptimizer::new().rules.iter())
            .map(|r| r.name().to_string())
            .collect();
        let ours = physical_rules();
        let names: Vec<String> = ours.iter().map(|r| r.name().to_string()).collect();
        assert_eq!(names, theirs);
        let guarded = ours.iter().find(|r| r.name() == "LimitPushPastWindows");
        assert!(
            guarded.is_some_and(|r| format!("{r:?}").contains("GuardedLimitPushPastWindows")),
            "{names:?}"
        );
    }
}

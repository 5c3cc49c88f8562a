//! What every plan node of zarrfusion writes the same way, written once:
//!
//! - in every `ExecutionPlan`: its name and its `properties` field
//!   ([`named_plan_methods`]);
//! - in a leaf `ExecutionPlan` (an operator that reads its table itself):
//!   those, no children, no expressions, refusing to be given children
//!   ([`leaf_plan_methods`]);
//! - in an `ExecutionPlan` whose only children are the tables joined into
//!   its scan (its `broadcasts` field): its name and properties, those
//!   children, none of them repartitioned, and new children given through
//!   `replace_children` ([`broadcast_children_methods`]);
//! - in every `ExecutionPlan`: its `metrics` field, and statistics that know
//!   the number of rows, or nothing ([`metered_plan_methods`]);
//! - in a leaf `UserDefinedLogicalNodeCore` (a logical node that reads its
//!   table itself): its name, its `schema` field, no inputs and no
//!   expressions ([`leaf_node_methods`]);
//! - in every logical node: equality, hashing and the partial order
//!   DataFusion asks of it, from what tells two nodes apart
//!   ([`node_identity`]);
//! - in an optimizer rule rewriting one node at a time, bottom up: all but
//!   the rewrite of one node ([`bottom_up_rule`]).

use std::sync::Arc;

use datafusion::common::stats::Precision;
use datafusion::common::{DataFusionError, Result, Statistics};
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties, StatisticsArgs};

/// Expands, inside an `impl` of `ExecutionPlan` (or of a sink), to
/// `apply_expressions` of a node that holds no physical expression.
macro_rules! no_expressions_method {
    () => {
        fn apply_expressions(
            &self,
            _f: &mut dyn FnMut(
                &std::sync::Arc<dyn datafusion::physical_expr::PhysicalExpr>,
            ) -> datafusion::common::Result<
                datafusion::common::tree_node::TreeNodeRecursion,
            >,
        ) -> datafusion::common::Result<datafusion::common::tree_node::TreeNodeRecursion> {
            Ok(datafusion::common::tree_node::TreeNodeRecursion::Continue)
        }
    };
}

/// Expands, inside `impl ExecutionPlan for T`, to `name` (the literal
/// given), `properties` (the struct's `properties: Arc<PlanProperties>`
/// field), `children` and `apply_expressions` (none), and
/// `with_new_children` (an error unless given none).
macro_rules! leaf_plan_methods {
    ($name:literal) => {
        $crate::plan_methods::named_plan_methods!($name);

        fn children(
            &self,
        ) -> Vec<&std::sync::Arc<dyn datafusion::physical_plan::ExecutionPlan>> {
            vec![]
        }

        $crate::plan_methods::no_expressions_method!();

        fn with_new_children(
            self: std::sync::Arc<Self>,
            children: Vec<std::sync::Arc<dyn datafusion::physical_plan::ExecutionPlan>>,
        ) -> datafusion::common::Result<
            std::sync::Arc<dyn datafusion::physical_plan::ExecutionPlan>,
        > {
            if !children.is_empty() {
                return datafusion::common::exec_err!(
                    "{} has no children, got {}",
                    $name,
                    children.len()
                );
            }
            Ok(self)
        }
    };
}

/// Expands, inside `impl UserDefinedLogicalNodeCore for T` (`T: Clone`),
/// to `name` (the literal given), `schema` (the struct's `schema:
/// DFSchemaRef` field, or the field path given after the name),
/// `inputs` and `expressions` (none) and `with_exprs_and_inputs` (a clone).
macro_rules! leaf_node_methods {
    ($name:literal) => {
        $crate::plan_methods::leaf_node_methods!($name, schema);
    };
    ($name:literal, $($schema:ident).+) => {
        fn name(&self) -> &str {
            $name
        }

        fn inputs(&self) -> Vec<&datafusion::logical_expr::LogicalPlan> {
            vec![]
        }

        fn schema(&self) -> &datafusion::common::DFSchemaRef {
            &self.$($schema).+
        }

        fn expressions(&self) -> Vec<datafusion::logical_expr::Expr> {
            vec![]
        }

        fn with_exprs_and_inputs(
            &self,
            _exprs: Vec<datafusion::logical_expr::Expr>,
            _inputs: Vec<datafusion::logical_expr::LogicalPlan>,
        ) -> datafusion::common::Result<Self> {
            Ok(self.clone())
        }
    };
}

/// Expands, inside `impl ExecutionPlan for T`, to `name` (the literal
/// given) and `properties` (the struct's `properties: Arc<PlanProperties>`
/// field).
macro_rules! named_plan_methods {
    ($name:literal) => {
        fn name(&self) -> &str {
            $name
        }

        fn properties(&self) -> &std::sync::Arc<datafusion::physical_plan::PlanProperties> {
            &self.properties
        }
    };
}

/// Expands, inside `impl ExecutionPlan for T`, to `name` and `properties`
/// (as [`named_plan_methods`]), `children` (those of the struct's
/// `broadcasts: BroadcastInputs` field), none of which benefits from being
/// repartitioned, `replace_children` (the plan itself when it joins
/// nothing in, else its `rejoined(&self, BroadcastInputs) -> Self` with
/// the new children) and `with_new_children` (`replace_children`, its
/// properties recomputed).
macro_rules! broadcast_children_methods {
    ($name:literal) => {
        $crate::plan_methods::named_plan_methods!($name);

        fn children(&self) -> Vec<&std::sync::Arc<dyn datafusion::physical_plan::ExecutionPlan>> {
            self.broadcasts.children()
        }

        fn benefits_from_input_partitioning(&self) -> Vec<bool> {
            vec![false; self.broadcasts.children().len()]
        }

        fn replace_children(
            self: std::sync::Arc<Self>,
            children: Vec<std::sync::Arc<dyn datafusion::physical_plan::ExecutionPlan>>,
            _options: datafusion::physical_plan::ReplaceChildrenOptions,
        ) -> datafusion::common::Result<
            std::sync::Arc<dyn datafusion::physical_plan::ExecutionPlan>,
        > {
            if children.is_empty() && self.broadcasts.is_empty() {
                return Ok(self);
            }
            let broadcasts = self.broadcasts.with_children(children)?;
            Ok(std::sync::Arc::new(self.rejoined(broadcasts)))
        }

        fn with_new_children(
            self: std::sync::Arc<Self>,
            children: Vec<std::sync::Arc<dyn datafusion::physical_plan::ExecutionPlan>>,
        ) -> datafusion::common::Result<
            std::sync::Arc<dyn datafusion::physical_plan::ExecutionPlan>,
        > {
            use datafusion::physical_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
            self.replace_children(
                children,
                ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute),
            )
        }
    };
}

/// Expands, inside `impl ExecutionPlan for T`, to `metrics` (the struct's
/// `metrics: ExecutionPlanMetricsSet` field) and `statistics_from_inputs`
/// ([`row_statistics`] with the rows `$rows` gives: an expression of type
/// `fn(&T) -> Option<u64>`, `Some` when the plan knows how many rows it
/// yields in all).
macro_rules! metered_plan_methods {
    ($rows:expr) => {
        fn metrics(&self) -> Option<datafusion::physical_plan::metrics::MetricsSet> {
            Some(self.metrics.clone_inner())
        }

        fn statistics_from_inputs(
            &self,
            _input_stats: &[std::sync::Arc<datafusion::common::Statistics>],
            args: &datafusion::physical_plan::StatisticsArgs,
        ) -> datafusion::common::Result<std::sync::Arc<datafusion::common::Statistics>> {
            let rows: fn(&Self) -> Option<u64> = $rows;
            $crate::plan_methods::row_statistics(self, args, rows(self))
        }
    };
}

/// The two children of the node `node` given to its `with_new_children`
/// (an operator run after its first input: a previous round, a fit), in
/// order; an error naming it for another count.
pub(crate) fn two_children(
    node: &str,
    children: Vec<Arc<dyn ExecutionPlan>>,
) -> Result<[Arc<dyn ExecutionPlan>; 2]> {
    <[_; 2]>::try_from(children)
        .map_err(|c| DataFusionError::Internal(format!("{node} has 2 children, got {}", c.len())))
}

/// The statistics of `plan`: nothing known but the number of rows, when
/// it yields `rows` in all and `args` asks for all of them (every
/// partition, or the only one).
pub(crate) fn row_statistics(
    plan: &dyn ExecutionPlan,
    args: &StatisticsArgs,
    rows: Option<u64>,
) -> Result<Arc<Statistics>> {
    let mut stats = Statistics::new_unknown(&plan.schema());
    let whole = args.partition().is_none() || plan.output_partitioning().partition_count() == 1;
    if let Some(rows) = rows.filter(|_| whole) {
        stats.num_rows = usize::try_from(rows).map_or(Precision::Absent, Precision::Exact);
    }
    Ok(Arc::new(stats))
}

/// Implements `PartialEq`, `Eq`, `Hash` and `PartialOrd` for the logical
/// node `$node`: two nodes are equal when `$eq` (an expression of type
/// `fn(&T, &T) -> bool`) says so, a node hashes what `$hash` (a
/// `fn(&T, &mut dyn Hasher)`) feeds the hasher (only what equal nodes
/// share), and nodes are ordered as `$cmp` says (a `fn(&T, &T) ->
/// Option<Ordering>`; without it, equal or unordered).
macro_rules! node_identity {
    ($node:ty, eq: $eq:expr, hash: $hash:expr) => {
        $crate::plan_methods::node_identity!($node, eq: $eq, hash: $hash, cmp: |a, b| {
            (a == b).then_some(std::cmp::Ordering::Equal)
        });
    };
    ($node:ty, eq: $eq:expr, hash: $hash:expr, cmp: $cmp:expr) => {
        impl PartialEq for $node {
            fn eq(&self, other: &Self) -> bool {
                let eq: fn(&Self, &Self) -> bool = $eq;
                eq(self, other)
            }
        }

        impl Eq for $node {}

        impl std::hash::Hash for $node {
            fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
                let hash: fn(&Self, &mut dyn std::hash::Hasher) = $hash;
                hash(self, state);
            }
        }

        impl PartialOrd for $node {
            fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
                let cmp: fn(&Self, &Self) -> Option<std::cmp::Ordering> = $cmp;
                cmp(self, other)
            }
        }
    };
}

/// Implements `OptimizerRule` for `$rule`, named `$name`, applied bottom
/// up: each node `plan` becomes what `$rewrite` (an expression of type
/// `fn(&LogicalPlan, &ConfigOptions) -> Result<Option<LogicalPlan>>`, the
/// session's options given) makes of it, `None` leaving it as it is.
macro_rules! bottom_up_rule {
    ($rule:ty, $name:literal, $rewrite:expr) => {
        impl datafusion::optimizer::OptimizerRule for $rule {
            fn name(&self) -> &str {
                $name
            }

            fn apply_order(&self) -> Option<datafusion::optimizer::ApplyOrder> {
                Some(datafusion::optimizer::ApplyOrder::BottomUp)
            }

            fn rewrite(
                &self,
                plan: datafusion::logical_expr::LogicalPlan,
                config: &dyn datafusion::optimizer::OptimizerConfig,
            ) -> datafusion::common::Result<
                datafusion::common::tree_node::Transformed<datafusion::logical_expr::LogicalPlan>,
            > {
                use datafusion::common::tree_node::Transformed;
                let rewrite: fn(
                    &datafusion::logical_expr::LogicalPlan,
                    &datafusion::config::ConfigOptions,
                ) -> datafusion::common::Result<
                    Option<datafusion::logical_expr::LogicalPlan>,
                > = $rewrite;
                Ok(match rewrite(&plan, &config.options())? {
                    Some(rewritten) => Transformed::yes(rewritten),
                    None => Transformed::no(plan),
                })
            }
        }
    };
}

/// Implements `PhysicalOptimizerRule` for `$rule`, named `$name`, rewriting
/// a physical plan from the bottom up: each node becomes what `$rewrite`
/// (an expression of type `fn(&Arc<dyn ExecutionPlan>, &ConfigOptions) ->
/// Result<Option<Arc<dyn ExecutionPlan>>>`) makes of it, `None` leaving it
/// as it is. The schema is checked.
macro_rules! physical_bottom_up_rule {
    ($rule:ty, $name:literal, $rewrite:expr) => {
        impl datafusion::physical_optimizer::PhysicalOptimizerRule for $rule {
            fn optimize(
                &self,
                plan: std::sync::Arc<dyn datafusion::physical_plan::ExecutionPlan>,
                config: &datafusion::config::ConfigOptions,
            ) -> datafusion::common::Result<
                std::sync::Arc<dyn datafusion::physical_plan::ExecutionPlan>,
            > {
                use datafusion::common::tree_node::{Transformed, TreeNode};
                let rewrite: fn(
                    &std::sync::Arc<dyn datafusion::physical_plan::ExecutionPlan>,
                    &datafusion::config::ConfigOptions,
                ) -> datafusion::common::Result<
                    Option<std::sync::Arc<dyn datafusion::physical_plan::ExecutionPlan>>,
                > = $rewrite;
                plan.transform_up(|node| {
                    Ok(match rewrite(&node, config)? {
                        Some(rewritten) => Transformed::yes(rewritten),
                        None => Transformed::no(node),
                    })
                })
                .map(|t| t.data)
            }

            fn name(&self) -> &str {
                $name
            }

            fn schema_check(&self) -> bool {
                true
            }
        }
    };
}

pub(crate) use {
    bottom_up_rule, broadcast_children_methods, leaf_node_methods, leaf_plan_methods,
    metered_plan_methods, named_plan_methods, no_expressions_method, node_identity,
    physical_bottom_up_rule,
};

#[cfg(test)]
mod tests {
    use std::cmp::Ordering;
    use std::hash::{DefaultHasher, Hash, Hasher};
    use std::sync::Arc;

    use datafusion::config::ConfigOptions;
    use datafusion::logical_expr::{col, lit, LogicalPlan, LogicalPlanBuilder};
    use datafusion::optimizer::{Optimizer, OptimizerContext, OptimizerRule};

    /// Told apart by `id` alone.
    #[derive(Debug)]
    struct Node {
        id: u32,
        note: &'static str,
    }

    node_identity!(Node, eq: |a, b| a.id == b.id, hash: |n, mut state| n.id.hash(&mut state));

    /// Ordered by its number.
    #[derive(Debug)]
    struct Ordered(u32);

    node_identity!(
        Ordered,
        eq: |a, b| a.0 == b.0,
        hash: |n, mut state| n.0.hash(&mut state),
        cmp: |a, b| a.0.partial_cmp(&b.0)
    );

    fn hash_of(value: &impl Hash) -> u64 {
        let mut hasher = DefaultHasher::new();
        value.hash(&mut hasher);
        hasher.finish()
    }

    #[test]
    fn nodes_are_equal_hash_alike_and_order_by_what_tells_them_apart() {
        let (a, b, c) = (
            Node { id: 1, note: "a" },
            Node { id: 1, note: "b" },
            Node { id: 2, note: "a" },
        );
        assert_ne!(a.note, b.note);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(hash_of(&a), hash_of(&b));
        assert_ne!(hash_of(&a), hash_of(&c));
        assert_eq!(a.partial_cmp(&b), Some(Ordering::Equal));
        assert_eq!(a.partial_cmp(&c), None);
        assert_eq!(Ordered(1).partial_cmp(&Ordered(2)), Some(Ordering::Less));
        assert_eq!(Ordered(3), Ordered(3));
    }

    /// Drops every `LIMIT` when the session normalizes identifiers (any
    /// setting would do).
    #[derive(Debug)]
    struct DropLimits;

    bottom_up_rule!(DropLimits, "drop_limits", |plan, options| {
        match (plan, options.sql_parser.enable_ident_normalization) {
            (LogicalPlan::Limit(limit), true) => Ok(Some(limit.input.as_ref().clone())),
            _ => Ok(None),
        }
    });

    #[test]
    fn a_bottom_up_rule_rewrites_every_node_it_makes_something_of() {
        let plan = LogicalPlanBuilder::empty(true)
            .project([lit(1).alias("x")])
            .unwrap()
            .limit(0, Some(5))
            .unwrap()
            .filter(col("x").gt(lit(0)))
            .unwrap()
            .limit(0, Some(3))
            .unwrap()
            .build()
            .unwrap();
        let rules: Vec<Arc<dyn OptimizerRule + Send + Sync>> = vec![Arc::new(DropLimits)];
        let optimized = |on: bool| {
            let mut options = ConfigOptions::new();
            options.sql_parser.enable_ident_normalization = on;
            let context = OptimizerContext::new_with_config_options(Arc::new(options));
            Optimizer::with_rules(rules.clone())
                .optimize(plan.clone(), &context, |_, _| {})
                .unwrap()
        };
        let limits =
            |plan: &LogicalPlan| plan.display_indent().to_string().matches("Limit").count();
        assert_eq!(DropLimits.name(), "drop_limits");
        assert_eq!(limits(&plan), 2);
        assert_eq!(limits(&optimized(true)), 0);
        assert_eq!(limits(&optimized(false)), 2);
    }
}

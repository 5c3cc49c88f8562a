//! What every leaf operator of zarrfusion writes the same way in its
//! `ExecutionPlan`: its name, its `properties` field, no children, no
//! expressions, and refusing to be given children.

/// Expands, inside `impl ExecutionPlan for T`, to `name` (the literal
/// given), `properties` (the struct's `properties: Arc<PlanProperties>`
/// field), `children` and `apply_expressions` (none), and
/// `with_new_children` (an error unless given none).
macro_rules! leaf_plan_methods {
    ($name:literal) => {
        fn name(&self) -> &str {
            $name
        }

        fn properties(&self) -> &std::sync::Arc<datafusion::physical_plan::PlanProperties> {
            &self.properties
        }

        fn children(
            &self,
        ) -> Vec<&std::sync::Arc<dyn datafusion::physical_plan::ExecutionPlan>> {
            vec![]
        }

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

pub(crate) use leaf_plan_methods;

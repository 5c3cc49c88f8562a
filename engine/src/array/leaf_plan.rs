//! What every leaf node of zarrfusion writes the same way: in its
//! `ExecutionPlan` (an operator) its name, its `properties` field, no
//! children, no expressions, refusing to be given children; in its
//! `UserDefinedLogicalNodeCore` (a logical node that reads its table
//! itself) its name, its `schema` field, no inputs and no expressions.

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

/// Expands, inside `impl UserDefinedLogicalNodeCore for T` (`T: Clone`),
/// to `name` (the literal given), `schema` (the struct's `schema:
/// DFSchemaRef` field), `inputs` and `expressions` (none) and
/// `with_exprs_and_inputs` (a clone).
macro_rules! leaf_node_methods {
    ($name:literal) => {
        fn name(&self) -> &str {
            $name
        }

        fn inputs(&self) -> Vec<&datafusion::logical_expr::LogicalPlan> {
            vec![]
        }

        fn schema(&self) -> &datafusion::common::DFSchemaRef {
            &self.schema
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

pub(crate) use {leaf_node_methods, leaf_plan_methods};

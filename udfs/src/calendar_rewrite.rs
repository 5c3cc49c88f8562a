//! [`CalendarFunctionsRewrite`]: the model calendars' `date_part` and
//! `date_bin` wherever a plan calls DataFusion's.

use std::sync::Arc;

use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::Transformed;
use datafusion::common::{DFSchema, Result};
use datafusion::logical_expr::expr::ScalarFunction;
use datafusion::logical_expr::expr_rewriter::FunctionRewrite;
use datafusion::logical_expr::{Expr, ScalarUDF};

use crate::date_bin::DateBinFunc;
use crate::date_part::DatePartFunc;

/// Puts [`DatePartFunc`] and [`DateBinFunc`] in place of DataFusion's
/// `date_part` and `date_bin` wherever a plan calls those directly (the
/// SQL planner does for `extract(part FROM t)`, DataFrame APIs may).
#[derive(Debug, Default)]
pub struct CalendarFunctionsRewrite;

impl FunctionRewrite for CalendarFunctionsRewrite {
    fn name(&self) -> &str {
        "zarrfusion_model_calendars"
    }

    fn rewrite(
        &self,
        expr: Expr,
        _schema: &DFSchema,
        _config: &ConfigOptions,
    ) -> Result<Transformed<Expr>> {
        let Expr::ScalarFunction(call) = expr else {
            return Ok(Transformed::no(expr));
        };
        let inner = call.func.inner();
        let ours = match call.func.name() {
            "date_part" if !inner.is::<DatePartFunc>() => ScalarUDF::from(DatePartFunc::new()),
            "date_bin" if !inner.is::<DateBinFunc>() => ScalarUDF::from(DateBinFunc::new()),
            _ => return Ok(Transformed::no(Expr::ScalarFunction(call))),
        };
        Ok(Transformed::yes(Expr::ScalarFunction(
            ScalarFunction::new_udf(Arc::new(ours), call.args),
        )))
    }
}

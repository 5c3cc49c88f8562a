//! The `read_zarr` table function.
//!
//! ```sql
//! SELECT * FROM read_zarr('demo/era5.zarr') LIMIT 5;
//! SELECT * FROM read_zarr('demo/era5.zarr', dims => 'lat,lon');
//! ```
//! DataFusion passes table-function arguments by position, so the second
//! argument is the dimension set whether or not it is written `dims => ...`.

use std::sync::Arc;

use datafusion::catalog::{TableFunctionArgs, TableFunctionImpl};
use datafusion::common::{plan_err, Result, ScalarValue};
use datafusion::datasource::TableProvider;
use datafusion::logical_expr::Expr;

use super::factory::open_dataset_blocking;
use super::options::{parse_dims, ZarrTableOptions};
use super::provider::ZarrTable;

/// `read_zarr(url [, dims])`.
#[derive(Debug, Default)]
pub struct ReadZarrFunc;

fn string_arg(expr: &Expr, what: &str) -> Result<String> {
    match expr {
        Expr::Literal(ScalarValue::Utf8(Some(s)), _)
        | Expr::Literal(ScalarValue::LargeUtf8(Some(s)), _)
        | Expr::Literal(ScalarValue::Utf8View(Some(s)), _) => Ok(s.clone()),
        other => plan_err!("read_zarr: {what} must be a string literal, got {other}"),
    }
}

impl TableFunctionImpl for ReadZarrFunc {
    fn call_with_args(&self, args: TableFunctionArgs) -> Result<Arc<dyn TableProvider>> {
        let exprs = args.exprs();
        let (url, dims) = match exprs {
            [url] => (string_arg(url, "the location")?, None),
            [url, dims] => (
                string_arg(url, "the location")?,
                Some(parse_dims(&string_arg(dims, "dims")?)?),
            ),
            _ => return plan_err!("read_zarr takes a location and optionally dims => 'a,b'"),
        };
        let options = ZarrTableOptions {
            dims: dims.clone(),
            ..Default::default()
        };
        let dataset = open_dataset_blocking(&url, &options, args.session().runtime_env())?;
        Ok(Arc::new(ZarrTable::new(dataset.table(dims.as_deref())?)))
    }
}

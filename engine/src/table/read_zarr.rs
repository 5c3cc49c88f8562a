//! The `read_zarr` table function, with named arguments.
//!
//! ```sql
//! SELECT * FROM read_zarr('demo/era5.zarr') LIMIT 5;
//! SELECT * FROM read_zarr('demo/era5.zarr', dims => 'lat,lon');
//! SELECT * FROM read_zarr('s3://bucket/store.zarr', group => 'surface', "aws.skip_signature" => 'true');
//! ```
//!
//! DataFusion's planner drops the names of table-function arguments, so
//! `read_zarr` is planned by a [`RelationPlanner`] that sees the SQL
//! arguments as written: the first positional argument is the location, a
//! second positional argument is `dims`, and named arguments are table
//! options (`dims`, `group`, `pushdown`, `aws.*`, ...).

use std::any::Any;
use std::collections::HashMap;
use std::sync::Arc;

use datafusion::catalog::CatalogProviderList;
use datafusion::common::{plan_err, DFSchema, Result, ScalarValue, TableReference};
use datafusion::datasource::{provider_as_source, TableProvider};
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::logical_expr::planner::{
    PlannedRelation, RelationPlanner, RelationPlannerContext, RelationPlanning,
};
use datafusion::logical_expr::{Expr, LogicalPlanBuilder};
use datafusion::sql::sqlparser::ast::{FunctionArg, FunctionArgExpr, TableAlias, TableFactor};

use super::factory::open_dataset_blocking;
use super::options::ZarrTableOptions;
use super::provider::ZarrTable;

/// Plans `read_zarr(...)` in `FROM` clauses.
#[derive(Debug)]
pub struct ReadZarrPlanner {
    runtime: Arc<RuntimeEnv>,
}

impl ReadZarrPlanner {
    /// A planner opening stores with `runtime`'s object stores.
    pub fn new(runtime: Arc<RuntimeEnv>) -> Self {
        Self { runtime }
    }
}

/// A table function's call as written in `FROM`: its positional arguments
/// and its named arguments (literals, as strings).
pub(crate) struct TableFunctionCall {
    /// Positional arguments, in order.
    pub positional: Vec<Expr>,
    /// Named arguments (`name => value`), in order.
    pub named: Vec<(String, String)>,
    /// The alias the relation is given.
    pub alias: Option<TableAlias>,
}

impl TableFunctionCall {
    /// The call of `function` in `relation`, or `None` when `relation` is
    /// something else.
    pub(crate) fn parse(
        relation: &TableFactor,
        function: &str,
        context: &mut dyn RelationPlannerContext,
    ) -> Result<Option<Self>> {
        let TableFactor::Table {
            name,
            alias,
            args: Some(args),
            ..
        } = relation
        else {
            return Ok(None);
        };
        let matches = name.0.len() == 1
            && name.0[0]
                .as_ident()
                .is_some_and(|i| i.value.eq_ignore_ascii_case(function));
        if !matches {
            return Ok(None);
        }
        let empty = DFSchema::empty();
        let mut call = Self {
            positional: Vec::new(),
            named: Vec::new(),
            alias: alias.clone(),
        };
        for arg in args.args.clone() {
            match arg {
                FunctionArg::Unnamed(FunctionArgExpr::Expr(e)) => {
                    call.positional.push(context.sql_to_expr(e, &empty)?)
                }
                FunctionArg::Named {
                    name,
                    arg: FunctionArgExpr::Expr(e),
                    ..
                } => {
                    let value = context.sql_to_expr(e, &empty)?;
                    let text = literal_text(&value, function, &name.value)?;
                    call.named.push((name.value.clone(), text));
                }
                other => return plan_err!("{function}: unsupported argument {other}"),
            }
        }
        Ok(Some(call))
    }
}

/// The table registered in `catalogs` under `source` (a table function's
/// first argument), if any. Table function arguments are not among the
/// tables DataFusion resolves before planning, so the catalogs are asked
/// directly.
pub(crate) fn registered_table(
    source: &str,
    catalogs: &Arc<dyn CatalogProviderList>,
    context: &dyn RelationPlannerContext,
) -> Option<Arc<dyn TableProvider>> {
    let options = context.context_provider().options();
    let reference = TableReference::parse_str(source).resolve(
        &options.catalog.default_catalog,
        &options.catalog.default_schema,
    );
    catalogs
        .catalog(&reference.catalog)
        .and_then(|c| c.schema(&reference.schema))
        // Zarr tables and views live in memory schemas, whose lookups do
        // not wait.
        .and_then(|schema| futures::executor::block_on(schema.table(&reference.table)).ok())
        .flatten()
}

/// The store at `location` as a table (opened with `runtime`'s object
/// stores and the session's settings, its largest dimension set): what a
/// table function's first argument names when no table is registered under
/// it.
pub(crate) fn store_table(
    location: &str,
    runtime: &Arc<RuntimeEnv>,
    context: &dyn RelationPlannerContext,
) -> Result<ZarrTable> {
    let options = ZarrTableOptions::default().with_session(context.context_provider().options())?;
    let dataset = open_dataset_blocking(location, &options, runtime)?;
    Ok(ZarrTable::new(dataset.table(None)?))
}

/// The Zarr table a table function's first argument names: a Zarr table
/// registered in `catalogs` under that name, else the store at that
/// location ([`store_table`]).
pub(crate) fn zarr_source(
    source: &str,
    catalogs: &Arc<dyn CatalogProviderList>,
    runtime: &Arc<RuntimeEnv>,
    context: &dyn RelationPlannerContext,
) -> Result<ZarrTable> {
    match registered_table(source, catalogs, context) {
        Some(provider) => match (provider.as_ref() as &dyn Any).downcast_ref::<ZarrTable>() {
            Some(zarr) => Ok(zarr.clone()),
            None => plan_err!("'{source}' is a table but not a Zarr table"),
        },
        None => store_table(source, runtime, context),
    }
}

/// The text of a literal argument (strings as they are, numbers and
/// booleans as SQL writes them, a list of literals such as `['lat',
/// 'lon']` as its items joined by commas).
pub(crate) fn literal_text(expr: &Expr, function: &str, what: &str) -> Result<String> {
    match expr {
        Expr::Literal(ScalarValue::Utf8(Some(s)), _)
        | Expr::Literal(ScalarValue::LargeUtf8(Some(s)), _)
        | Expr::Literal(ScalarValue::Utf8View(Some(s)), _) => Ok(s.clone()),
        Expr::Literal(value, _) if !value.is_null() => Ok(value.to_string()),
        Expr::ScalarFunction(call) if call.name() == "make_array" && !call.args.is_empty() => {
            let items: Result<Vec<String>> = call
                .args
                .iter()
                .map(|item| literal_text(item, function, what))
                .collect();
            Ok(items?.join(","))
        }
        other => plan_err!("{function}: {what} must be a literal, got {other}"),
    }
}

impl RelationPlanner for ReadZarrPlanner {
    fn plan_relation(
        &self,
        relation: TableFactor,
        context: &mut dyn RelationPlannerContext,
    ) -> Result<RelationPlanning> {
        let Some(call) = TableFunctionCall::parse(&relation, "read_zarr", context)? else {
            return Ok(RelationPlanning::Original(Box::new(relation)));
        };
        let mut named: HashMap<String, String> = call.named.into_iter().collect();
        let text = |e: &Expr, what: &str| literal_text(e, "read_zarr", what);
        let location = match call.positional.as_slice() {
            [location] => text(location, "the location")?,
            [location, dims] => {
                named.insert("dims".to_string(), text(dims, "dims")?);
                text(location, "the location")?
            }
            _ => {
                return plan_err!(
                    "read_zarr takes a location, then optionally dims => 'a,b' and other options"
                )
            }
        };
        let options = ZarrTableOptions::from_map(&named)?
            .with_session(context.context_provider().options())?;
        let dataset = open_dataset_blocking(&location, &options, &self.runtime)?;
        let table =
            ZarrTable::new(dataset.table(options.dims.as_deref())?).with_pushdown(options.pushdown);
        let plan = LogicalPlanBuilder::scan(
            TableReference::bare("read_zarr()"),
            provider_as_source(Arc::new(table)),
            None,
        )?
        .build()?;
        Ok(RelationPlanning::Planned(Box::new(PlannedRelation::new(
            plan, call.alias,
        ))))
    }
}

//! `CREATE EXTERNAL TABLE ... STORED AS ZARR` and opening datasets off the async threads.
//!
//! ```sql
//! CREATE EXTERNAL TABLE era5 STORED AS ZARR LOCATION 's3://bucket/era5.zarr'
//!   OPTIONS ('dims' 'time,lat,lon', 'aws.region' 'us-west-2', 'aws.skip_signature' 'true');
//! ```

use std::sync::Arc;

use async_trait::async_trait;
use datafusion::catalog::{Session, TableProviderFactory};
use datafusion::common::{plan_err, DataFusionError, Result};
use datafusion::datasource::TableProvider;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::logical_expr::CreateExternalTable;

use super::dataset::ZarrDataset;
use super::options::ZarrTableOptions;
use super::provider::ZarrTable;

/// Creates Zarr tables for `STORED AS ZARR`.
#[derive(Debug, Default)]
pub struct ZarrTableFactory;

#[async_trait]
impl TableProviderFactory for ZarrTableFactory {
    async fn create(
        &self,
        state: &dyn Session,
        cmd: &CreateExternalTable,
    ) -> Result<Arc<dyn TableProvider>> {
        if !cmd.schema.fields().is_empty() {
            return plan_err!(
                "a Zarr table takes its columns from the store; remove the column list from CREATE EXTERNAL TABLE {}",
                cmd.name
            );
        }
        let location = match cmd.locations.as_slice() {
            [one] => one.clone(),
            other => {
                return plan_err!("a Zarr table has exactly one LOCATION, got {}", other.len())
            }
        };
        let options =
            ZarrTableOptions::from_map(&cmd.options)?.with_session(state.config_options())?;
        let (dims, pushdown) = (options.dims.clone(), options.pushdown);
        let dataset = open_dataset(location, options, Arc::clone(state.runtime_env())).await?;
        Ok(Arc::new(
            ZarrTable::new(dataset.table(dims.as_deref())?).with_pushdown(pushdown),
        ))
    }
}

/// Opens a dataset on a blocking thread (metadata reads are blocking IO).
pub async fn open_dataset(
    location: String,
    options: ZarrTableOptions,
    runtime: Arc<RuntimeEnv>,
) -> Result<ZarrDataset> {
    tokio::task::spawn_blocking(move || ZarrDataset::open(&location, &options, &runtime))
        .await
        .map_err(|e| DataFusionError::External(Box::new(e)))?
        .map_err(DataFusionError::from)
}

/// Opens a dataset from synchronous code that may run on an async thread
/// (table functions are planned synchronously).
pub fn open_dataset_blocking(
    location: &str,
    options: &ZarrTableOptions,
    runtime: &RuntimeEnv,
) -> Result<ZarrDataset> {
    run_blocking(|| ZarrDataset::open(location, options, runtime).map_err(DataFusionError::from))
}

/// Runs `work`, which blocks on IO (a store in a bucket blocks on its
/// requests), from synchronous code that may be on a runtime's thread
/// (a plan decoded by a cluster's worker): on a multi-threaded runtime the
/// thread is handed over to blocking first.
pub fn run_blocking<T>(work: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(work)
        }
        _ => work(),
    }
}

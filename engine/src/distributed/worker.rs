//! A worker's side of a cluster: the session each query gets and the gRPC
//! server (`zarrfusion worker --listen ADDR` runs [`serve_worker`]).

use std::future::Future;
use std::sync::Arc;

use datafusion::common::{exec_datafusion_err, Result};
use datafusion::execution::registry::FunctionRegistry;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::execution::SessionState;
use datafusion_distributed::{DistributedExt, Worker, WorkerQueryContext};
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;

use super::channel::WorkerChannels;
use super::cluster::keep_partial_aggregates;
use super::codec::ZarrCodec;
use crate::config::ZarrConfig;
use crate::memory::unspilled_repartitions;

/// The session a worker runs one query's tasks in: DataFusion's defaults
/// with datafusion-distributed's settings as the query sent them (the
/// sender's other DataFusion settings do not travel; what a node needs
/// travels in the node), the worker's own zarrfusion settings (`config`:
/// `allowed_locations` and the rest, never taken from the sender),
/// zarrfusion's functions and codec, and `channels` to reach the other
/// workers (for shuffles). Partial aggregates are never skipped here
/// (`keep_partial_aggregates`).
pub fn worker_session(
    ctx: WorkerQueryContext,
    config: &ZarrConfig,
    channels: &WorkerChannels,
) -> SessionState {
    let mut builder = ctx.builder;
    let options = builder.config().get_or_insert_default().options_mut();
    options.extensions.insert(config.clone());
    keep_partial_aggregates(options);
    let mut state = builder
        .with_distributed_user_codec(ZarrCodec::default())
        .with_distributed_channel_resolver(channels.clone())
        .build();
    for udf in zarrfusion_udfs::all_scalar_functions() {
        if let Err(e) = state.register_udf(udf) {
            log::warn!("a worker could not register a zarrfusion function: {e}");
        }
    }
    state
}

/// Serves tasks on `listener` until `shutdown` completes, each query in a
/// [`worker_session`] with `config`, over `runtime` (its memory pool is
/// the worker's `allowed_mem`).
pub async fn serve_worker(
    listener: TcpListener,
    config: ZarrConfig,
    runtime: Arc<RuntimeEnv>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<()> {
    let address = listener.local_addr().ok();
    let config = Arc::new(config);
    let channels = WorkerChannels::default();
    let worker = Worker::from_session_builder(move |ctx: WorkerQueryContext| {
        let config = Arc::clone(&config);
        let channels = channels.clone();
        async move { Ok(worker_session(ctx, &config, &channels)) }
    })
    // Every worker's pool as every session's (`memory::UnspilledRepartitions`).
    .with_runtime_env(unspilled_repartitions(runtime));
    Server::builder()
        .add_service(worker.into_worker_server())
        .serve_with_incoming_shutdown(TcpIncoming::from(listener), shutdown)
        .await
        .map_err(|e| match address {
            Some(address) => exec_datafusion_err!("the worker on {address} stopped: {e}"),
            None => exec_datafusion_err!("the worker stopped: {e}"),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::execution::SessionStateBuilder;
    use tonic::codegen::http::HeaderMap;

    /// What a worker's session holds whatever the sender set: the worker's
    /// own zarrfusion settings, and partial aggregates that never skip
    /// themselves (their states, not the rows, must cross the network).
    #[test]
    fn a_worker_session_keeps_its_own_settings_and_its_partial_aggregates() {
        let config = ZarrConfig {
            allowed_locations: "/data/".to_string(),
            ..ZarrConfig::default()
        };
        let ctx = WorkerQueryContext {
            builder: SessionStateBuilder::new(),
            headers: HeaderMap::new(),
        };
        let state = worker_session(ctx, &config, &WorkerChannels::default());
        let options = state.config_options();
        assert_eq!(ZarrConfig::of(options).allowed_locations, "/data/");
        let threshold = options
            .execution
            .skip_partial_aggregation_probe_ratio_threshold;
        // The skip happens when groups / rows > threshold: never above 1.
        assert!(threshold >= 1.0, "{threshold}");
    }
}

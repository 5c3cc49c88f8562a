//! How a session (or a worker, for its shuffles) reaches workers: gRPC
//! channels that notice a worker gone quiet, and errors that say which
//! worker, stage and task they come from.
//!
//! datafusion-distributed's own channels report a worker that died
//! mid-stream as a bare transport error ("h2 protocol error: error reading
//! a body from connection"), and wait forever on one that stopped
//! answering without closing its connection (a stopped process, a machine
//! gone from the network). Here every channel sends HTTP/2 keep-alive
//! pings ([`KEEP_ALIVE_INTERVAL`]) and drops the connection when one goes
//! unanswered for [`KEEP_ALIVE_TIMEOUT`], and every error that comes
//! through one is put in the context of its worker, stage and task.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::common::{exec_datafusion_err, DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion_distributed::grpc::{create_worker_client, BoxCloneSyncChannel};
use datafusion_distributed::{
    ChannelResolver, CoordinatorToWorkerMsg, ExecuteTaskRequest, GetWorkerInfoRequest,
    GetWorkerInfoResponse, SetPlanRequest, TaskKey, WorkerChannel, WorkerToCoordinatorMsg,
};
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use tonic::codegen::http::HeaderMap;
use tonic::transport::Endpoint;
use url::Url;

/// How often an idle or busy connection to a worker is pinged.
pub const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(10);

/// How long a ping may go unanswered before the worker is taken for gone
/// (its tasks' streams then fail, naming it).
pub const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// How long connecting to a worker may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Channels to workers, one per address, kept for the session (or the
/// worker process) that holds this resolver.
#[derive(Clone, Default)]
pub struct WorkerChannels {
    channels: Arc<Mutex<HashMap<Url, BoxCloneSyncChannel>>>,
}

impl WorkerChannels {
    async fn channel(&self, url: &Url) -> Result<BoxCloneSyncChannel> {
        if let Some(channel) = crate::error::lock(&self.channels).get(url) {
            return Ok(channel.clone());
        }
        let unreachable =
            |e: &dyn std::fmt::Display| exec_datafusion_err!("cannot reach worker {url}: {e}");
        let channel = Endpoint::from_shared(url.to_string())
            .map_err(|e| unreachable(&e))?
            .connect_timeout(CONNECT_TIMEOUT)
            .http2_keep_alive_interval(KEEP_ALIVE_INTERVAL)
            .keep_alive_timeout(KEEP_ALIVE_TIMEOUT)
            .keep_alive_while_idle(true)
            .connect()
            .await
            .map_err(|e| unreachable(&e))?;
        let channel = BoxCloneSyncChannel::new(channel);
        crate::error::lock(&self.channels).insert(url.clone(), channel.clone());
        Ok(channel)
    }
}

#[async_trait]
impl ChannelResolver for WorkerChannels {
    async fn get_worker_client_for_url(&self, url: &Url) -> Result<Box<dyn WorkerChannel>> {
        Ok(Box::new(NamedWorker {
            url: url.clone(),
            inner: create_worker_client(self.channel(url).await?),
        }))
    }
}

/// A worker's client whose errors name the worker, stage and task.
struct NamedWorker {
    url: Url,
    inner: Box<dyn WorkerChannel>,
}

impl NamedWorker {
    fn task(&self, key: &TaskKey) -> String {
        format!(
            "worker {} (stage {}, task {})",
            self.url.as_str().trim_end_matches('/'),
            key.stage_id,
            key.task_number
        )
    }
}

/// `error` in the context of `what` (a worker, stage and task).
fn named(what: &str, error: DataFusionError) -> DataFusionError {
    DataFusionError::Context(what.to_string(), Box::new(error))
}

fn named_stream<T: Send + 'static>(
    what: String,
    stream: BoxStream<'static, Result<T>>,
) -> BoxStream<'static, Result<T>> {
    stream.map_err(move |e| named(&what, e)).boxed()
}

#[async_trait]
impl WorkerChannel for NamedWorker {
    async fn coordinator_channel(
        &mut self,
        headers: HeaderMap,
        set_plan_request: SetPlanRequest,
        c2w_stream: BoxStream<'static, CoordinatorToWorkerMsg>,
        metrics: ExecutionPlanMetricsSet,
        task_ctx: &Arc<TaskContext>,
    ) -> Result<BoxStream<'static, Result<WorkerToCoordinatorMsg>>> {
        let what = self.task(&set_plan_request.task_key);
        let stream = self
            .inner
            .coordinator_channel(headers, set_plan_request, c2w_stream, metrics, task_ctx)
            .await
            .map_err(|e| named(&what, e))?;
        Ok(named_stream(what, stream))
    }

    async fn execute_task(
        &mut self,
        headers: HeaderMap,
        request: ExecuteTaskRequest,
        metrics: ExecutionPlanMetricsSet,
        task_ctx: &Arc<TaskContext>,
    ) -> Result<Vec<BoxStream<'static, Result<RecordBatch>>>> {
        let what = self.task(&request.task_key);
        let streams = self
            .inner
            .execute_task(headers, request, metrics, task_ctx)
            .await
            .map_err(|e| named(&what, e))?;
        Ok(streams
            .into_iter()
            .map(|stream| named_stream(what.clone(), stream))
            .collect())
    }

    async fn get_worker_info(
        &mut self,
        request: GetWorkerInfoRequest,
    ) -> Result<GetWorkerInfoResponse> {
        let what = format!("worker {}", self.url.as_str().trim_end_matches('/'));
        self.inner
            .get_worker_info(request)
            .await
            .map_err(|e| named(&what, e))
    }
}

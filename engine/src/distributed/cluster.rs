//! A session's side of a cluster: where its workers are, and the
//! distributed planner with zarrfusion's codec and task handlers.

use std::sync::Arc;

use datafusion::common::{plan_err, Result};
use datafusion::config::ConfigOptions;
use datafusion::execution::SessionStateBuilder;
use datafusion_distributed::{DistributedExt, SessionStateBuilderExt, WorkerResolver};
use url::Url;

use super::channel::WorkerChannels;
use super::codec::ZarrCodec;
use super::reductions::rules_with_cluster_reductions;
use super::stages::CheckedStages;
use super::tasks::{deal_scan_blocks, scan_tasks, whole_input_tasks};
use crate::array::ArrayQueryPlanner;
use crate::table::SmallSidePlanner;

/// Workers at fixed addresses.
#[derive(Debug, Clone)]
struct FixedWorkers(Vec<Url>);

/// The workers of a session with workers (a session config extension).
#[derive(Debug, Clone)]
pub struct ClusterWorkers(pub Vec<Url>);

impl WorkerResolver for FixedWorkers {
    fn get_urls(&self) -> Result<Vec<Url>> {
        Ok(self.0.clone())
    }
}

/// Partial aggregates never skip themselves on a cluster (in a session
/// with workers, and in each worker's session): their states are what
/// crosses the network. DataFusion skips them when the groups come near
/// the rows (`GROUP BY lat, lon` over a time slice per chunk), and the rows
/// themselves would then be shuffled (6.1 GB for 650 MB on disk,
/// measured). The skip happens when groups over rows exceed the
/// threshold, which they never do above 1.
pub(crate) fn keep_partial_aggregates(options: &mut ConfigOptions) {
    options
        .execution
        .skip_partial_aggregation_probe_ratio_threshold = 1.0;
}

/// Parses a comma-separated list of workers, each `host:port` or an
/// `http://host:port` URL.
pub fn parse_workers(list: &str) -> Result<Vec<Url>> {
    let mut workers = Vec::new();
    for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let text = if item.contains("://") {
            item.to_string()
        } else {
            format!("http://{item}")
        };
        let url = match Url::parse(&text) {
            Ok(url) if url.host().is_some() && url.port_or_known_default().is_some() => url,
            Ok(_) => return plan_err!("worker '{item}' names no host and port"),
            Err(e) => return plan_err!("worker '{item}' is not host:port or a URL: {e}"),
        };
        if url.scheme() != "http" && url.scheme() != "https" {
            return plan_err!("worker '{item}': only http:// and https:// workers are reached");
        }
        workers.push(url);
    }
    if workers.is_empty() {
        return plan_err!("no worker in '{list}'");
    }
    Ok(workers)
}

/// `builder` planning its queries for `workers`: stages of the physical
/// plan run on them, zarrfusion's nodes serialized by [`ZarrCodec`], Zarr
/// scans and dense reductions split into tasks by their bytes (a dense
/// reduction's tasks give partial states: [`super::reductions`]), workers
/// reached through [`WorkerChannels`] (errors naming worker, stage and
/// task).
pub fn distribute(mut builder: SessionStateBuilder, workers: Vec<Url>) -> SessionStateBuilder {
    if let Some(config) = builder.config().as_mut() {
        config.set_extension(Arc::new(ClusterWorkers(workers.clone())));
        // A join's small side is planned as part of its grid's plan.
        config.set_extension(Arc::new(SmallSidePlanner(Arc::new(ArrayQueryPlanner))));
    }
    let mut builder = builder
        .with_physical_optimizer_rules(rules_with_cluster_reductions(workers.len()))
        .with_distributed_worker_resolver(FixedWorkers(workers))
        .with_distributed_channel_resolver(WorkerChannels::default())
        .with_distributed_planner()
        .with_distributed_user_codec(ZarrCodec::default())
        .with_distributed_desired_task_count_handler(whole_input_tasks)
        .with_distributed_desired_task_count_handler(scan_tasks)
        .with_distributed_scale_up_leaf_node_handler(deal_scan_blocks);
    // Every worker stage encoded once while planning.
    match builder.query_planner().take() {
        Some(distributed) => builder.with_query_planner(Arc::new(CheckedStages(distributed))),
        None => builder,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_are_host_port_pairs_or_urls() {
        let parsed = parse_workers("127.0.0.1:50051, http://node2:7000").unwrap();
        let as_text: Vec<String> = parsed.iter().map(Url::to_string).collect();
        assert_eq!(as_text, ["http://127.0.0.1:50051/", "http://node2:7000/"]);
        for bad in ["", " , ", "ftp://x:1", "http://:1"] {
            assert!(parse_workers(bad).is_err(), "{bad:?} accepted");
        }
    }
}

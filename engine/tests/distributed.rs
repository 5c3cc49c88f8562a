//! The same queries on a cluster: workers serving datafusion-distributed's
//! gRPC protocol on 127.0.0.1 (real servers and connections, in this
//! process), a session planning for them with Zarr scans split into many
//! tasks. Every oracle query must give xarray's answer
//! (`tests/fixtures/expected/queries.json`, written by `make_fixtures.py`);
//! zarrfusion's codec must carry a scan whole and refuse a malformed one
//! with an error. Real worker processes (`zarrfusion worker`) are started
//! by the shell's tests (`cli/tests/worker.rs`).

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::{assert_rows, fixture, query_rows, repo_root};
use datafusion::execution::runtime_env::{RuntimeEnv, RuntimeEnvBuilder};
use datafusion::physical_plan::{collect_partitioned, displayable, ExecutionPlan};
use datafusion_proto::bytes::{
    physical_plan_from_bytes_with_extension_codec, physical_plan_to_bytes_with_extension_codec,
};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use url::Url;
use zarrfusion::distributed::{serve_worker, ZarrCodec};
use zarrfusion::table::ZarrScanExec;
use zarrfusion::{distributed_context, new_context, session_config, ZarrConfig, ZarrContextExt};

/// Workers on 127.0.0.1, stopped when dropped.
struct Workers {
    urls: Vec<Url>,
    _stop: Vec<oneshot::Sender<()>>,
}

async fn start_workers(n: usize) -> Workers {
    start_workers_in(n, || Arc::new(RuntimeEnv::default())).await
}

/// Workers each with the runtime `runtime` makes (its memory pool is the
/// worker's allowed_mem).
async fn start_workers_in(n: usize, runtime: impl Fn() -> Arc<RuntimeEnv>) -> Workers {
    let mut urls = Vec::new();
    let mut stop = Vec::new();
    for _ in 0..n {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        tokio::spawn(serve_worker(
            listener,
            ZarrConfig::default(),
            runtime(),
            async move {
                let _ = rx.await;
            },
        ));
        urls.push(Url::parse(&format!("http://{address}")).unwrap());
        stop.push(tx);
    }
    Workers { urls, _stop: stop }
}

fn table_options(dims: Option<&Value>) -> HashMap<String, String> {
    let mut options = HashMap::new();
    if let Some(Value::Array(dims)) = dims {
        let names: Vec<&str> = dims.iter().map(|d| d.as_str().unwrap()).collect();
        options.insert("dims".to_string(), names.join(","));
    }
    options
}

/// A session planning for `workers`, every few bytes of a scan a task of
/// its own (each block its own task).
async fn cluster_session(workers: &Workers) -> datafusion::prelude::SessionContext {
    let ctx = distributed_context(
        session_config(),
        Arc::new(RuntimeEnv::default()),
        workers.urls.clone(),
    );
    ctx.sql("SET zarrfusion.bytes_per_task = 1").await.unwrap();
    ctx
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_oracle_query_gives_xarray_s_answer_through_two_workers() {
    let workers = start_workers(2).await;
    let path = repo_root().join("tests/fixtures/expected/queries.json");
    let queries: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert!(queries.len() >= 15);
    let mut distributed = 0;
    for q in &queries {
        let name = q["name"].as_str().unwrap();
        let store = q["store"].as_str().unwrap();
        let sql = q["sql"].as_str().unwrap();
        let want: Vec<Vec<Value>> = serde_json::from_value(q["rows"].clone()).unwrap();
        let ctx = cluster_session(&workers).await;
        ctx.register_zarr("t", &fixture(store), table_options(q.get("dims")))
            .await
            .unwrap_or_else(|e| panic!("registering {store}: {e}"));
        let plan = physical_plan(&ctx, sql).await;
        let shown = displayable(plan.as_ref()).indent(true).to_string();
        if shown.contains("tasks=") && shown.contains("Network") {
            distributed += 1;
        }
        let got = query_rows(&ctx, &format!("{name} through workers"), sql).await;
        assert_rows(&format!("{name} through workers"), &got, &want);
    }
    assert!(
        distributed * 2 >= queries.len(),
        "only {distributed} of {} queries had a scan split over workers",
        queries.len()
    );
}

/// The physical plan `ctx` makes of `sql`.
async fn physical_plan(
    ctx: &datafusion::prelude::SessionContext,
    sql: &str,
) -> Arc<dyn ExecutionPlan> {
    ctx.sql(sql)
        .await
        .unwrap()
        .create_physical_plan()
        .await
        .unwrap()
}

/// The scan of a filtered query, as the session planned it.
async fn planned_scan(sql: &str) -> (datafusion::prelude::SessionContext, Arc<dyn ExecutionPlan>) {
    let ctx = new_context();
    ctx.register_zarr("t", &fixture("v3_basic.zarr"), HashMap::new())
        .await
        .unwrap();
    let plan = physical_plan(&ctx, sql).await;
    let mut scans = Vec::new();
    find_scans(&plan, &mut scans);
    assert_eq!(scans.len(), 1, "one scan in {sql}");
    (ctx, scans.remove(0))
}

fn find_scans(plan: &Arc<dyn ExecutionPlan>, out: &mut Vec<Arc<dyn ExecutionPlan>>) {
    if plan.downcast_ref::<ZarrScanExec>().is_some() {
        out.push(Arc::clone(plan));
    }
    for child in plan.children() {
        find_scans(child, out);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scan_round_trips_through_the_codec_with_the_same_plan_and_rows() {
    let sql = "SELECT * FROM t WHERE lat > 10 LIMIT 7";
    let (ctx, scan) = planned_scan(sql).await;
    let codec = ZarrCodec::default();
    let bytes = physical_plan_to_bytes_with_extension_codec(Arc::clone(&scan), &codec).unwrap();
    let task = ctx.task_ctx();
    let back = physical_plan_from_bytes_with_extension_codec(&bytes, &task, &codec).unwrap();
    let show = |p: &Arc<dyn ExecutionPlan>| displayable(p.as_ref()).indent(true).to_string();
    assert_eq!(show(&back), show(&scan));
    // Partition by partition: each reads the same blocks in the same order.
    let want = collect_partitioned(scan, Arc::clone(&task)).await.unwrap();
    let got = collect_partitioned(back, task).await.unwrap();
    assert_eq!(got, want);
    assert!(want.iter().flatten().map(|b| b.num_rows()).sum::<usize>() > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_scan_is_an_error_naming_what_is_wrong() {
    let (ctx, scan) = planned_scan("SELECT * FROM t WHERE lat > 10").await;
    let codec = ZarrCodec::default();
    let proto = datafusion_proto::physical_plan::DefaultPhysicalProtoConverter {};
    let mut buf = Vec::new();
    use datafusion_proto::physical_plan::PhysicalExtensionCodec;
    codec.try_encode(scan, &mut buf, &proto).unwrap();
    let sent: Value = serde_json::from_slice(&buf).unwrap();
    let task = ctx.task_ctx();
    let decode = |v: &Value| {
        codec
            .try_decode(&serde_json::to_vec(v).unwrap(), &[], &task, &proto)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    decode(&sent).expect("the scan as sent");
    let cases: Vec<(&str, Value, &str)> = vec![
        ("partitions", Value::from(u64::MAX), "partitions"),
        ("partitions", Value::from(0), "partitions"),
        ("tasks", Value::from(1u64 << 40), "tasks"),
        ("batch_size", Value::from(0), "batch_size"),
        ("projection", serde_json::json!([0, 99]), "column 99"),
        (
            "selection",
            serde_json::json!([[{"start": 5, "end": 2}]]),
            "selection",
        ),
        (
            "selection",
            serde_json::json!([[{"start": 0, "end": 1}], [{"start": 0, "end": 1000000}], [{"start": 0, "end": 1}]]),
            "selection",
        ),
        ("block_shape", serde_json::json!([0, 1, 1]), "blocks"),
        ("block_shape", serde_json::json!([1]), "blocks"),
        ("columns", serde_json::json!([["x", "Int8"]]), "changed"),
    ];
    for (field, value, says) in cases {
        let mut bad = sent.clone();
        bad[field] = value.clone();
        let err = decode(&bad).expect_err(&format!("{field} = {value} accepted"));
        assert!(err.contains(says), "{field} = {value}: {err}");
    }
    for garbage in [&b""[..], b"{", b"{\"node\":\"nothing\"}", b"\xff\xfe"] {
        let err = codec
            .try_decode(garbage, &[], &task, &proto)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(err.contains("malformed zarrfusion plan node"), "{err}");
    }
}

/// A runtime whose memory pool (allowed_mem) is `bytes`.
fn limited(bytes: usize) -> Arc<RuntimeEnv> {
    RuntimeEnvBuilder::new()
        .with_memory_limit(bytes, 1.0)
        .build_arc()
        .unwrap()
}

/// The session's allowed_mem stands for each worker's: a scan whose task
/// cannot fit it is refused while the session plans, before any worker is
/// asked; a worker with less memory than the session assumed refuses the
/// task it receives before reading, naming itself, the stage and the
/// numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_task_too_big_for_a_worker_is_refused_before_it_runs() {
    let sql = "SELECT lat, avg(t2m) FROM t GROUP BY lat";
    let workers = start_workers(2).await;
    let small = distributed_context(session_config(), limited(1024), workers.urls.clone());
    small
        .sql("SET zarrfusion.bytes_per_task = 1")
        .await
        .unwrap();
    small
        .register_zarr("t", &fixture("v3_basic.zarr"), HashMap::new())
        .await
        .unwrap();
    let refused = small.sql(sql).await.unwrap().create_physical_plan().await;
    let message = refused.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        message.contains("allowed_mem") && message.contains("needs"),
        "planned a scan that cannot fit 1 KiB: {message}"
    );

    let tight = start_workers_in(2, || limited(1024)).await;
    let ctx = cluster_session(&tight).await;
    ctx.register_zarr("t", &fixture("v3_basic.zarr"), HashMap::new())
        .await
        .unwrap();
    let plan = physical_plan(&ctx, sql).await;
    let shown = displayable(plan.as_ref()).indent(true).to_string();
    assert!(shown.contains("tasks=2"), "{shown}");
    let failed = datafusion::physical_plan::collect(plan, ctx.task_ctx()).await;
    let message = failed.err().map(|e| e.to_string()).unwrap_or_default();
    let named = tight
        .urls
        .iter()
        .any(|url| message.contains(&format!("worker {}", url.as_str().trim_end_matches('/'))));
    assert!(
        named && message.contains("stage") && message.contains("allowed_mem"),
        "a worker with 1 KiB ran the task, or its refusal does not say so: {message}"
    );
}

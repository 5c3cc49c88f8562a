//! The same queries on a cluster: workers serving datafusion-distributed's
//! gRPC protocol on 127.0.0.1 (real servers and connections, in this
//! process), a session planning for them with Zarr scans split into many
//! tasks. Every oracle query must give xarray's answer
//! (`tests/fixtures/expected/queries.json`, written by `make_fixtures.py`);
//! aligned joins must run as zipped scans on the workers with the rows of
//! DataFusion's hash join; zarrfusion's codec must carry a scan and a dense
//! reduction's partial states whole and refuse malformed ones with an error. Real worker processes (`zarrfusion worker`) are started
//! by the shell's tests (`cli/tests/worker.rs`).

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;

use common::{assert_rows, assert_same_files, fixture, query_rows, repo_root, scratch, sort_rows};
use datafusion::execution::runtime_env::{RuntimeEnv, RuntimeEnvBuilder};
use datafusion::execution::TaskContext;
use datafusion::physical_plan::projection::EmbeddedProjection;
use datafusion::physical_plan::{collect_partitioned, displayable, ExecutionPlan};
use datafusion_distributed::DistributedTaskContext;
use datafusion_proto::bytes::{
    physical_plan_from_bytes_with_extension_codec, physical_plan_to_bytes_with_extension_codec,
};
use datafusion_proto::physical_plan::{DefaultPhysicalProtoConverter, PhysicalExtensionCodec};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use url::Url;
use zarrfusion::array::fft::FftExec;
use zarrfusion::array::rolling::RollingWindowExec;
use zarrfusion::array::{DenseMergeExec, DenseReductionExec, Merged};
use zarrfusion::distributed::barrier::AfterExec;
use zarrfusion::distributed::transforms::reading_on_cluster;
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
    // Two tasks: the states merge in the session.
    let (trees, _) = every_oracle_query_through(&workers, &[]).await;
    assert_eq!(trees, 0, "a merge tree for two tasks");
}

/// Dense reductions' states merged in a tree (a level on the workers, then
/// the session) give xarray's answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_oracle_query_gives_xarray_s_answer_with_states_merged_in_a_tree() {
    let workers = start_workers(3).await;
    // A block per chunk; a tree even where a stage has fewer than three
    // tasks (`auto` would merge those in the session).
    let settings = [
        "SET zarrfusion.target_partition_bytes = 1",
        "SET zarrfusion.state_merge = 'tree'",
    ];
    let (trees, merges) = every_oracle_query_through(&workers, &settings).await;
    assert!(
        trees >= 10 && trees == merges,
        "{trees} of {merges} merges by group position were trees"
    );
}

/// Runs every oracle query through `workers` after `settings`, asserting
/// xarray's answers and that scans and dense reductions were split among
/// the workers; the number of plans merging states in a tree, and by
/// group position.
async fn every_oracle_query_through(workers: &Workers, settings: &[&str]) -> (usize, usize) {
    let read = |name: &str| -> Vec<Value> {
        let path = repo_root().join("tests/fixtures/expected").join(name);
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    };
    let queries = read("queries.json");
    assert!(queries.len() >= 15);
    // Resampling, climatologies and coarsening: grouped by functions of a
    // coordinate, which travel with the reduction.
    let climate = read("climate_queries.json");
    let mut distributed = 0;
    let mut reductions = [0, 0];
    let mut keyed = 0;
    let (mut trees, mut merges) = (0, 0);
    for q in queries.iter().chain(&climate) {
        let name = q["name"].as_str().unwrap();
        let store = q["store"].as_str().unwrap();
        let sql = q["sql"].as_str().unwrap();
        let want: Vec<Vec<Value>> = serde_json::from_value(q["rows"].clone()).unwrap();
        let ctx = cluster_session(workers).await;
        for setting in settings {
            ctx.sql(setting).await.unwrap();
        }
        ctx.register_zarr("t", &fixture(store), table_options(q.get("dims")))
            .await
            .unwrap_or_else(|e| panic!("registering {store}: {e}"));
        let plan = physical_plan(&ctx, sql).await;
        let shown = displayable(plan.as_ref()).indent(true).to_string();
        if shown.contains("tasks=") && shown.contains("Network") {
            distributed += 1;
            // Dense reductions on workers: partial states under DataFusion's
            // final aggregate, with and without GROUP BY.
            if shown.contains("emits=partial states") {
                let grouped = !shown.contains("gby=[]");
                reductions[usize::from(grouped)] += 1;
                keyed += usize::from(climate.contains(q));
            }
        }
        trees += usize::from(shown.contains("a level of the merge tree"));
        merges += usize::from(shown.contains("merges=partial states by group position"));
        let got = query_rows(&ctx, &format!("{name} through workers"), sql).await;
        assert_rows(&format!("{name} through workers"), &got, &want);
    }
    assert!(
        distributed * 2 >= queries.len() + climate.len(),
        "only {distributed} of {} queries had a scan split over workers",
        queries.len() + climate.len()
    );
    assert!(
        keyed == climate.len(),
        "only {keyed} of {} climate queries ran as partial states on workers",
        climate.len()
    );
    assert!(
        reductions[0] >= 3 && reductions[1] >= 10,
        "dense reductions split over workers: {} without GROUP BY, {} with",
        reductions[0],
        reductions[1]
    );
    (trees, merges)
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

/// `plan` through the codec and back, checked to be the same plan; the
/// plan decoded.
fn through_codec(
    ctx: &datafusion::prelude::SessionContext,
    plan: &Arc<dyn ExecutionPlan>,
) -> Arc<dyn ExecutionPlan> {
    let codec = ZarrCodec::default();
    let bytes = physical_plan_to_bytes_with_extension_codec(Arc::clone(plan), &codec).unwrap();
    let back =
        physical_plan_from_bytes_with_extension_codec(&bytes, &ctx.task_ctx(), &codec).unwrap();
    let show = |p: &Arc<dyn ExecutionPlan>| displayable(p.as_ref()).indent(true).to_string();
    assert_eq!(show(&back), show(plan));
    back
}

/// `scan` through the codec and back: the same plan, and partition by
/// partition the same rows (each reads the same blocks in the same order).
async fn assert_round_trip(
    ctx: &datafusion::prelude::SessionContext,
    scan: &Arc<dyn ExecutionPlan>,
) {
    let codec = ZarrCodec::default();
    let bytes = physical_plan_to_bytes_with_extension_codec(Arc::clone(scan), &codec).unwrap();
    let task = ctx.task_ctx();
    let back = physical_plan_from_bytes_with_extension_codec(&bytes, &task, &codec).unwrap();
    let show = |p: &Arc<dyn ExecutionPlan>| displayable(p.as_ref()).indent(true).to_string();
    assert_eq!(show(&back), show(scan));
    let want = collect_partitioned(Arc::clone(scan), Arc::clone(&task))
        .await
        .unwrap();
    let got = collect_partitioned(back, task).await.unwrap();
    assert_eq!(got, want);
    assert!(want.iter().flatten().map(|b| b.num_rows()).sum::<usize>() > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scan_round_trips_through_the_codec_with_the_same_plan_and_rows() {
    let sql = "SELECT * FROM t WHERE lat > 10 LIMIT 7";
    let (ctx, scan) = planned_scan(sql).await;
    assert_round_trip(&ctx, &scan).await;
}

/// zarrfusion's codec on both ends of the wire: a node as it is sent
/// (JSON), and a worker's decoding of such JSON (`Err`: the error's text).
struct Wire {
    codec: ZarrCodec,
    task: Arc<datafusion::execution::TaskContext>,
}

impl Wire {
    fn new(ctx: &datafusion::prelude::SessionContext) -> Self {
        Self {
            codec: ZarrCodec::default(),
            task: ctx.task_ctx(),
        }
    }

    fn encode(&self, plan: Arc<dyn ExecutionPlan>) -> Value {
        let mut buf = Vec::new();
        self.codec.try_encode(plan, &mut buf, &CONVERTER).unwrap();
        serde_json::from_slice(&buf).unwrap()
    }

    fn decode_bytes(&self, bytes: &[u8]) -> Result<(), String> {
        self.decode_with(bytes, &[])
    }

    /// A worker's decoding of `bytes` with the node's inputs `inputs`.
    fn decode_with(&self, bytes: &[u8], inputs: &[Arc<dyn ExecutionPlan>]) -> Result<(), String> {
        self.codec
            .try_decode(bytes, inputs, &self.task, &CONVERTER)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    fn decode(&self, sent: &Value) -> Result<(), String> {
        self.decode_bytes(&serde_json::to_vec(sent).unwrap())
    }

    /// `sent` with each `(field, value)` put in its first aggregate is
    /// refused with an error saying `says`.
    fn refuses_aggregate(&self, sent: &Value, cases: Vec<(&str, Value, &str)>) {
        for (field, value, says) in cases {
            let mut bad = sent.clone();
            bad["aggregates"][0][field] = value.clone();
            let err = self
                .decode(&bad)
                .expect_err(&format!("aggregate {field} = {value} accepted"));
            assert!(err.contains(says), "aggregate {field} = {value}: {err}");
        }
    }

    /// `sent` changed by `change` is refused with an error saying `says`.
    fn refuses_changed(&self, sent: &Value, change: &dyn Fn(&mut Value), says: &str) {
        let mut bad = sent.clone();
        change(&mut bad);
        let err = self.decode(&bad).expect_err(&format!("accepted: {bad}"));
        assert!(err.contains(says), "{says}: {err}");
    }

    /// `sent` with each `(field, value)` put in is refused with an error
    /// saying `says`.
    fn refuses(&self, sent: &Value, cases: Vec<(&str, Value, &str)>) {
        for (field, value, says) in cases {
            let mut bad = sent.clone();
            bad[field] = value.clone();
            let err = self
                .decode(&bad)
                .expect_err(&format!("{field} = {value} accepted"));
            assert!(err.contains(says), "{field} = {value}: {err}");
        }
    }
}

const CONVERTER: DefaultPhysicalProtoConverter = DefaultPhysicalProtoConverter {};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_scan_is_an_error_naming_what_is_wrong() {
    let (ctx, scan) = planned_scan("SELECT * FROM t WHERE lat > 10").await;
    let wire = Wire::new(&ctx);
    let sent = wire.encode(scan);
    wire.decode(&sent).expect("the scan as sent");
    let cases: Vec<(&str, Value, &str)> = vec![
        ("partitions", Value::from(u64::MAX), "partitions"),
        ("partitions", Value::from(0), "partitions"),
        ("tasks", Value::from(1u64 << 40), "tasks"),
        // Tasks taken from the stage: only with a table joined in.
        ("tasks", Value::from(0), "tasks"),
        ("batch_size", Value::from(0), "batch_size"),
        ("read", serde_json::json!([0, 99]), "column 99"),
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
    wire.refuses(&sent, cases);
    for garbage in [&b""[..], b"{", b"{\"node\":\"nothing\"}", b"\xff\xfe"] {
        let err = wire.decode_bytes(garbage).unwrap_err();
        assert!(err.contains("malformed zarrfusion plan node"), "{err}");
    }
}

/// The partial states of the dense reduction of `sql` as a cluster runs
/// them (one task), the reduction as one machine runs it, and a session.
async fn planned_states(
    sql: &str,
) -> (
    datafusion::prelude::SessionContext,
    Arc<dyn ExecutionPlan>,
    Arc<dyn ExecutionPlan>,
    Arc<dyn ExecutionPlan>,
) {
    let ctx = new_context();
    ctx.register_zarr("t", &fixture("v3_basic.zarr"), HashMap::new())
        .await
        .unwrap();
    let plan = physical_plan(&ctx, sql).await;
    let find = |plan: &Arc<dyn ExecutionPlan>| {
        let mut stack = vec![Arc::clone(plan)];
        while let Some(node) = stack.pop() {
            if node.downcast_ref::<DenseReductionExec>().is_some() {
                return node;
            }
            stack.extend(node.children().into_iter().cloned());
        }
        panic!("no dense reduction in {sql}");
    };
    let whole = find(&plan);
    let reduction = whole.downcast_ref::<DenseReductionExec>().unwrap();
    let cluster = reduction.on_cluster(2, false).unwrap();
    let states = find(&cluster);
    (ctx, whole, cluster, states)
}

/// Rows of every partition of `plan`, sorted (as text).
async fn sorted_rows(
    plan: Arc<dyn ExecutionPlan>,
    ctx: &datafusion::prelude::SessionContext,
) -> Vec<String> {
    let mut rows = ordered_rows(plan, ctx).await;
    rows.sort();
    rows
}

/// A dense reduction's partial states cross the codec whole, and DataFusion's
/// final aggregate over them gives the rows the dense reduction gives alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dense_reduction_s_states_round_trip_and_merge_to_its_answer() {
    let sql = "SELECT lat, avg(t2m), var(u10), min(t2m), max(u10), sum(t2m), count(*) \
               FROM t WHERE t2m > 270 GROUP BY lat";
    let (ctx, whole, cluster, states) = planned_states(sql).await;
    let codec = ZarrCodec::default();
    let bytes = physical_plan_to_bytes_with_extension_codec(Arc::clone(&states), &codec).unwrap();
    let back =
        physical_plan_from_bytes_with_extension_codec(&bytes, &ctx.task_ctx(), &codec).unwrap();
    let show = |p: &Arc<dyn ExecutionPlan>| displayable(p.as_ref()).indent(true).to_string();
    assert_eq!(show(&back), show(&states));
    // Workers take blocks as they come: sums may differ in the last bits.
    let (got, sent) = (
        sorted_rows(back, &ctx).await,
        sorted_rows(states, &ctx).await,
    );
    assert_close(&got, &sent);
    let want = sorted_rows(whole, &ctx).await;
    assert!(want.len() > 1, "{want:?}");
    assert_close(&sorted_rows(cluster, &ctx).await, &want);
}

/// Rows of every partition of `plan` in the order they come, as text.
async fn ordered_rows(
    plan: Arc<dyn ExecutionPlan>,
    ctx: &datafusion::prelude::SessionContext,
) -> Vec<String> {
    let batches = collect_partitioned(plan, ctx.task_ctx()).await.unwrap();
    let batches: Vec<_> = batches.into_iter().flatten().collect();
    let text = datafusion::arrow::util::pretty::pretty_format_batches(&batches)
        .unwrap()
        .to_string();
    text.lines()
        .filter(|l| l.starts_with("| "))
        .map(String::from)
        .collect()
}

/// A dense reduction grouped by dimensions merges its tasks' states by
/// group position: the merge gives the rows of one machine's reduction in
/// the same order (groups no row passed the filter left out), crosses the
/// codec with its states whole, and a malformed merge is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reduction_s_states_merge_by_group_position_in_one_machine_s_order() {
    let sql = "SELECT lat, lon, avg(t2m), var(u10), min(t2m), max(u10), sum(t2m), count(*) \
               FROM t WHERE t2m > 285 GROUP BY lat, lon ORDER BY lat, lon";
    let (ctx, whole, cluster, states) = planned_states(sql).await;
    let merge = cluster.downcast_ref::<DenseMergeExec>().unwrap_or_else(|| {
        panic!(
            "not merged by position: {}",
            displayable(cluster.as_ref()).indent(true)
        )
    });
    let shown = displayable(cluster.as_ref()).indent(true).to_string();
    assert!(
        shown.contains("merges=partial states by group position"),
        "{shown}"
    );
    assert!(
        shown.contains("emits=partial states by group position"),
        "{shown}"
    );
    // One machine's order: no sort needed above either.
    assert_eq!(
        cluster.properties().output_ordering(),
        whole.properties().output_ordering()
    );
    let want = ordered_rows(Arc::clone(&whole), &ctx).await;
    let all_groups = ordered_rows(
        physical_plan(&ctx, "SELECT lat, lon, count(*) FROM t GROUP BY lat, lon").await,
        &ctx,
    )
    .await;
    assert!(
        want.len() > 1 && want.len() < all_groups.len(),
        "the filter should leave some groups out: {} of {}",
        want.len(),
        all_groups.len()
    );
    assert_close(&ordered_rows(Arc::clone(&cluster), &ctx).await, &want);
    // The merge and its states through the codec: the same plan, the same rows.
    let back = through_codec(&ctx, &cluster);
    assert_close(&ordered_rows(back, &ctx).await, &want);

    // A malformed merge is refused, naming what is wrong.
    let wire = Wire::new(&ctx);
    let sent = wire.encode(Arc::clone(&cluster));
    let input = [Arc::clone(&states)];
    let decode = |v: &Value| wire.decode_with(&serde_json::to_vec(v).unwrap(), &input);
    decode(&sent).expect("the merge as sent");
    let err = wire
        .decode(&sent)
        .expect_err("a merge without its input accepted");
    assert!(err.contains("1 inputs, got 0"), "{err}");
    let mut cases: Vec<(Value, &str)> = Vec::new();
    let mut bad = sent.clone();
    bad["reduction"]["positioned"] = Value::from(false);
    cases.push((bad, "positioned states"));
    let mut bad = sent.clone();
    bad["reduction"]["tasks"] = Value::from(2);
    cases.push((bad, "positioned states"));
    let mut bad = sent.clone();
    bad["results"][2][1] = Value::from("Utf8");
    cases.push((bad, "gives"));
    let mut bad = sent.clone();
    bad["results"] = serde_json::json!([]);
    cases.push((bad, "gives"));
    let mut bad = sent.clone();
    bad["reduction"]["states"][0][1] = Value::from("Float64");
    cases.push((bad, "partial states"));
    for (bad, says) in cases {
        let err = decode(&bad).expect_err(&format!("{bad} accepted"));
        assert!(err.contains(says), "{err}");
    }
    // Its input must give the states it merges.
    let err = wire
        .decode_with(&serde_json::to_vec(&sent).unwrap(), &[Arc::clone(&whole)])
        .expect_err("a merge of results accepted");
    assert!(err.contains("merges states"), "{err}");
    // (The rows as text start with their header.)
    assert_eq!(merge.states().num_groups(), all_groups.len() - 1);
}

/// A dense reduction's states merged in a tree: a level merging the
/// states each partition of a shuffle by group position receives (on the
/// workers), then the session's merge of one state per group. The same
/// rows in one machine's order; the level crosses the codec (a malformed
/// one refused); on three workers the session receives one state per
/// group, not one per group and task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reduction_s_states_merge_in_a_tree_on_the_workers() {
    let sql = "SELECT lat, lon, avg(t2m), var(u10), min(t2m), max(u10), sum(t2m), count(*) \
               FROM t WHERE t2m > 285 GROUP BY lat, lon ORDER BY lat, lon";
    let (ctx, whole, _, _) = planned_states(sql).await;
    let reduction = whole.downcast_ref::<DenseReductionExec>().unwrap();
    let tree = reduction.on_cluster(3, true).unwrap();
    let shown = displayable(tree.as_ref()).indent(true).to_string();
    assert!(
        shown.contains("gives=states by group position (a level of the merge tree)")
            && shown.contains("partitioning=Hash([__zarrfusion_group@0], 3)"),
        "{shown}"
    );
    assert_eq!(
        tree.properties().output_ordering(),
        whole.properties().output_ordering()
    );
    let want = ordered_rows(Arc::clone(&whole), &ctx).await;
    assert!(want.len() > 1, "{want:?}");
    assert_close(&ordered_rows(Arc::clone(&tree), &ctx).await, &want);
    // Through the codec, the root and its level: the same plan and rows.
    let back = through_codec(&ctx, &tree);
    assert_close(&ordered_rows(back, &ctx).await, &want);

    // A level travels on its own: its input is the shuffle by position.
    let root = tree.downcast_ref::<DenseMergeExec>().unwrap();
    let level = first_node_of::<DenseMergeExec>(root.children()[0]).expect(&shown);
    assert_eq!(
        level.downcast_ref::<DenseMergeExec>().unwrap().merged(),
        Merged::States
    );
    let wire = Wire::new(&ctx);
    let sent = wire.encode(Arc::clone(&level));
    assert_eq!(sent["level"], Value::from(true), "{sent}");
    let shuffled = [Arc::clone(level.children()[0])];
    let decode = |v: &Value| wire.decode_with(&serde_json::to_vec(v).unwrap(), &shuffled);
    decode(&sent).expect("the level as sent");
    let mut bad = sent.clone();
    bad["results"][2][1] = Value::from("Utf8");
    let err = decode(&bad).expect_err("a level giving other results accepted");
    assert!(err.contains("gives"), "{err}");
    let err = wire
        .decode_with(&serde_json::to_vec(&sent).unwrap(), &[Arc::clone(&whole)])
        .expect_err("a level over results accepted");
    assert!(err.contains("merges states"), "{err}");
    // A worker whose allowed_mem cannot hold the level refuses it.
    let small =
        datafusion::prelude::SessionContext::new_with_config_rt(session_config(), limited(1024));
    let err = Wire::new(&small)
        .decode_with(&serde_json::to_vec(&sent).unwrap(), &shuffled)
        .expect_err("a level beyond the worker's allowed_mem accepted");
    assert!(
        err.contains("DenseMergeExec") && err.contains("allowed_mem") && err.contains("1024"),
        "{err}"
    );

    // Three workers, a task each (a block per chunk, 8 chunks): the level
    // runs on them and the session receives each group's state once.
    let workers = start_workers(3).await;
    let cluster = cluster_session(&workers).await;
    cluster
        .sql("SET zarrfusion.target_partition_bytes = 1")
        .await
        .unwrap();
    cluster
        .register_zarr("t", &fixture("v3_basic.zarr"), HashMap::new())
        .await
        .unwrap();
    let plan = physical_plan(&cluster, sql).await;
    let shown = displayable(plan.as_ref()).indent(true).to_string();
    assert!(
        shown.contains("NetworkShuffleExec") && shown.contains("a level of the merge tree"),
        "{shown}"
    );
    let one_machine = ordered_rows(physical_plan(&ctx, sql).await, &ctx).await;
    assert_close(&ordered_rows(plan, &cluster).await, &one_machine);
    let analyzed = common::explain_text(&cluster, &format!("ANALYZE {sql}")).await;
    let rows_out = |node: &str| -> Vec<usize> {
        (analyzed.lines())
            .filter(|l| l.contains(node))
            .filter_map(|l| l.split("output_rows=").nth(1))
            .map(|r| r.split([',', ']']).next().unwrap().trim().parse().unwrap())
            .collect()
    };
    let groups = want.len() - 1; // its first line is the header
    assert_eq!(rows_out("NetworkCoalesceExec"), vec![groups], "{analyzed}");
    let shuffled = rows_out("NetworkShuffleExec");
    assert!(
        shuffled.len() == 1 && shuffled[0] > groups,
        "{shuffled:?} states shuffled for {groups} groups: {analyzed}"
    );
    // Asked for by name, the session merges every task's states itself.
    cluster
        .sql("SET zarrfusion.state_merge = 'session'")
        .await
        .unwrap();
    let plan = physical_plan(&cluster, sql).await;
    let shown = displayable(plan.as_ref()).indent(true).to_string();
    assert!(!shown.contains("a level of the merge tree"), "{shown}");
    // An unknown value is refused (by the front doors' SET, else when a
    // reduction is planned).
    let err = match cluster.sql("SET zarrfusion.state_merge = 'workers'").await {
        Err(e) => e.to_string(),
        Ok(_) => (cluster.sql(sql).await.unwrap().create_physical_plan().await)
            .expect_err("an unknown merge accepted")
            .to_string(),
    };
    assert!(err.contains("auto, session or tree"), "{err}");
}

/// Rows of text equal cell by cell, numbers within a relative 1e-9.
fn assert_close(got: &[String], want: &[String]) {
    assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
    for (g, w) in got.iter().zip(want) {
        let cells = |r: &str| {
            r.split('|')
                .map(|c| c.trim().to_string())
                .collect::<Vec<_>>()
        };
        for (a, b) in cells(g).iter().zip(cells(w)) {
            let close = match (a.parse::<f64>(), b.parse::<f64>()) {
                (Ok(x), Ok(y)) => (x - y).abs() <= 1e-9 * x.abs().max(y.abs()).max(1e-300),
                _ => *a == b,
            };
            assert!(close, "{g} vs {w}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_dense_reduction_is_an_error_naming_what_is_wrong() {
    let sql = "SELECT lat, avg(t2m), count(*) FROM t WHERE t2m > 270 GROUP BY lat";
    let (ctx, _, _, states) = planned_states(sql).await;
    let wire = Wire::new(&ctx);
    let sent = wire.encode(states);
    wire.decode(&sent).expect("the reduction as sent");
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "groups",
            serde_json::json!([{"dim": 1, "expr": null}, {"dim": 1, "expr": null}]),
            "twice",
        ),
        (
            "groups",
            serde_json::json!([{"dim": 7, "expr": null}]),
            "dimension 7",
        ),
        (
            "groups",
            serde_json::json!([{"dim": 1, "expr": "not base64!"}]),
            "base64",
        ),
        ("read", serde_json::json!([99]), "column 99"),
        ("tasks", Value::from(0), "tasks"),
        ("tasks", Value::from(1u64 << 40), "tasks"),
        ("states", serde_json::json!([]), "partial states"),
        (
            "states",
            serde_json::json!([["lat", "NoSuchType", true]]),
            "NoSuchType",
        ),
        ("predicate", Value::from("not base64!"), "base64"),
        ("predicate", Value::from("/////w=="), "malformed expression"),
        ("block_shape", serde_json::json!([0, 1, 1]), "blocks"),
        ("columns", serde_json::json!([["x", "Int8"]]), "changed"),
    ];
    wire.refuses(&sent, cases);
    let aggregate_cases: Vec<(&str, Value, &str)> = vec![
        ("op", Value::from("median"), "unknown"),
        ("output", Value::from("Utf8"), "cannot compute avg"),
        ("arg", Value::from("AAAA"), "expression"),
    ];
    wire.refuses_aggregate(&sent, aggregate_cases);
    let mut many = sent.clone();
    let one = many["aggregates"][0].clone();
    many["aggregates"] = Value::Array(vec![one; 5000]);
    let err = wire.decode(&many).expect_err("5000 aggregates accepted");
    assert!(err.contains("aggregates"), "{err}");
}

/// A runtime whose memory pool (allowed_mem) is `bytes`.
fn limited(bytes: usize) -> Arc<RuntimeEnv> {
    RuntimeEnvBuilder::new()
        .with_memory_limit(bytes, 1.0)
        .build_arc()
        .unwrap()
}

/// The session's allowed_mem stands for each worker's: a scan or a dense
/// reduction whose task cannot fit it is refused while the session plans,
/// before any worker is asked; a worker with less memory than the session
/// assumed refuses the task it receives before reading, naming itself, the
/// stage and the numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_task_too_big_for_a_worker_is_refused_before_it_runs() {
    let workers = start_workers(2).await;
    let tight = start_workers_in(2, || limited(512)).await;
    let queries = [
        (
            "SELECT lat, avg(t2m) FROM t GROUP BY lat",
            "DenseReductionExec",
        ),
        ("SELECT lat, t2m FROM t WHERE t2m > 0", "ZarrScanExec"),
    ];
    for (sql, node) in queries {
        let small = distributed_context(session_config(), limited(512), workers.urls.clone());
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
            message.contains(node) && message.contains("allowed_mem") && message.contains("needs"),
            "planned {sql} although it cannot fit 512 bytes: {message}"
        );

        let ctx = cluster_session(&tight).await;
        ctx.register_zarr("t", &fixture("v3_basic.zarr"), HashMap::new())
            .await
            .unwrap();
        let plan = physical_plan(&ctx, sql).await;
        let shown = displayable(plan.as_ref()).indent(true).to_string();
        assert!(shown.contains(node) && shown.contains("tasks=2"), "{shown}");
        let failed = datafusion::physical_plan::collect(plan, ctx.task_ctx()).await;
        let message = failed.err().map(|e| e.to_string()).unwrap_or_default();
        let named = tight
            .urls
            .iter()
            .any(|url| message.contains(&format!("worker {}", url.as_str().trim_end_matches('/'))));
        assert!(
            named && message.contains("stage") && message.contains("allowed_mem"),
            "a worker with 512 bytes ran the task of {sql}, or its refusal does not say so: {message}"
        );
    }
}

/// A Zarr v3 store in a scratch directory (`name`) holding one float32
/// array `v` over `time`, `lat`, `lon` of `shape` in chunks of `chunks`,
/// none written: every cell `fill`.
fn metadata_only_store(
    name: &str,
    shape: [u64; 3],
    chunks: [u64; 3],
    fill: f64,
) -> std::path::PathBuf {
    let dir = scratch(name).join("grid.zarr");
    std::fs::create_dir_all(dir.join("v")).unwrap();
    std::fs::write(
        dir.join("zarr.json"),
        r#"{"zarr_format": 3, "node_type": "group", "attributes": {}}"#,
    )
    .unwrap();
    let array = serde_json::json!({
        "zarr_format": 3, "node_type": "array", "shape": shape, "data_type": "float32",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": fill, "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        "dimension_names": ["time", "lat", "lon"], "attributes": {}
    });
    std::fs::write(dir.join("v/zarr.json"), array.to_string()).unwrap();
    dir
}

/// A merge of states that would not fit the session's allowed_mem is left
/// to DataFusion's final aggregate, spread over the workers, with the same
/// answer; one that fits is planned within it. Under the smallest limit,
/// where one worker's reduction of every group does not fit, the reduction
/// runs in bands of latitudes in the session, with the same answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_merge_too_big_for_the_session_is_left_to_the_final_aggregate() {
    use datafusion::arrow::array::{ArrayRef, AsArray};
    use datafusion::arrow::compute::{cast, concat_batches};
    use datafusion::arrow::datatypes::{DataType, Float64Type};
    // 8 x 512 x 1024 in small chunks, none written (every cell the fill
    // value): grouped by lat, lon, 524,288 groups, whose merge (their
    // states and results) holds more than one worker's reduction.
    let dir = metadata_only_store("cluster-big-merge", [8, 512, 1024], [1, 64, 128], 1.5);
    let workers = start_workers(2).await;
    let sql =
        "SELECT lat, lon, avg(v) AS a, count(v) AS n FROM g GROUP BY lat, lon ORDER BY lat, lon";
    let path = dir.to_str().unwrap().to_string();
    let session = |runtime: Arc<RuntimeEnv>| {
        let (urls, path) = (workers.urls.clone(), path.clone());
        async move {
            let ctx = distributed_context(session_config(), runtime, urls);
            ctx.sql("SET zarrfusion.bytes_per_task = 1").await.unwrap();
            ctx.sql("SET datafusion.execution.target_partitions = 1")
                .await
                .unwrap();
            ctx.register_zarr("g", &path, HashMap::new()).await.unwrap();
            ctx
        }
    };
    let (mut merged, mut left, mut banded) = (0, 0, 0);
    for mb in [16, 24, 32, 48, 64, 96] {
        let limit = mb << 20;
        let ctx = session(limited(limit)).await;
        let Ok(plan) = ctx.sql(sql).await.unwrap().create_physical_plan().await else {
            continue; // the reduction itself does not fit
        };
        let shown = displayable(plan.as_ref()).indent(true).to_string();
        let in_bands = shown.contains(", bands=");
        assert_eq!(shown.contains("emits=partial states"), !in_bands, "{shown}");
        match first_node_of::<DenseMergeExec>(&plan) {
            _ if in_bands => banded += 1,
            Some(merge) => {
                let bytes = merge
                    .downcast_ref::<DenseMergeExec>()
                    .unwrap()
                    .projected_memory();
                assert!(
                    bytes <= limit,
                    "a merge of {bytes} bytes under {limit}: {shown}"
                );
                merged += 1;
            }
            None => {
                assert!(shown.contains("mode=FinalPartitioned"), "{shown}");
                left += 1;
            }
        }
        // Either way, every group once, in order, with its 8 cells.
        let batches = datafusion::physical_plan::collect(plan, ctx.task_ctx())
            .await
            .unwrap_or_else(|e| panic!("under {mb} MB: {e}"));
        let batch = concat_batches(&batches[0].schema(), &batches).unwrap();
        assert_eq!(batch.num_rows(), 512 * 1024, "under {mb} MB");
        let columns: Vec<ArrayRef> = (0..4)
            .map(|i| cast(batch.column(i), &DataType::Float64).unwrap())
            .collect();
        let cell = |r: usize| -> Vec<f64> {
            (columns.iter())
                .map(|c| c.as_primitive::<Float64Type>().value(r))
                .collect()
        };
        for r in (0..batch.num_rows()).step_by(997) {
            let want = [(r / 1024) as f64, (r % 1024) as f64, 1.5, 8.0];
            assert_eq!(cell(r), want, "row {r} under {mb} MB");
        }
    }
    assert!(
        merged > 0 && left > 0 && banded > 0,
        "merged under {merged} limits, left to the aggregate under {left}, in bands under {banded}"
    );
}

/// The rolling-window oracle queries (`rolling_queries.json`).
/// Runs the oracle query `q` over `climate.zarr` (as `t`) through
/// `workers` after `settings`, asserting xarray's answer; its name and
/// distributed plan.
async fn climate_oracle_through(
    workers: &Workers,
    settings: &[&str],
    q: &Value,
) -> (String, String) {
    let (name, sql) = (q["name"].as_str().unwrap(), q["sql"].as_str().unwrap());
    let want: Vec<Vec<Value>> = serde_json::from_value(q["rows"].clone()).unwrap();
    let ctx = cluster_session(workers).await;
    for setting in settings {
        ctx.sql(setting).await.unwrap();
    }
    ctx.register_zarr("t", &fixture("climate.zarr"), HashMap::new())
        .await
        .unwrap();
    let plan = physical_plan(&ctx, sql).await;
    let shown = displayable(plan.as_ref()).indent(true).to_string();
    let got = query_rows(&ctx, &format!("{name} through workers"), sql).await;
    assert_rows(&format!("{name} through workers"), &got, &want);
    (name.to_string(), shown)
}

fn rolling_queries() -> Vec<Value> {
    let path = repo_root().join("tests/fixtures/expected/rolling_queries.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rolling_windows_run_on_the_workers_with_xarray_s_answers() {
    let workers = start_workers(2).await;
    let queries = rolling_queries();
    assert!(queries.len() >= 6);
    for q in &queries {
        // Blocks of a few steps: each task rolls its run, reading the
        // overlap before it from the store.
        let settings = ["SET zarrfusion.target_partition_bytes = 1024"];
        let (name, shown) = climate_oracle_through(&workers, &settings, q).await;
        assert!(
            shown.contains("RollingWindowExec") && shown.contains("Network"),
            "{name}:\n{shown}"
        );
        assert!(!shown.contains("WindowAggExec"), "{name}:\n{shown}");
    }
}

/// A rolling window over `rechunk(...)` on a cluster: the copy's rounds
/// and then the window over the rechunked store run on the workers (the
/// window under `AfterExec`), with xarray's answer and nothing left in
/// `work_dir`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rolling_windows_over_rechunk_run_on_the_workers_after_the_copy() {
    let dir = scratch("cluster-rolling-rechunk");
    let (work, set_work) = own_work_dir(&dir);
    let workers = start_workers(2).await;
    let settings = [
        "SET zarrfusion.target_partition_bytes = 1024",
        "SET zarrfusion.bytes_per_task = 1",
        set_work.as_str(),
    ];
    let queries = rolling_queries();
    for q in queries.iter().step_by(4) {
        let mut q = q.clone();
        let sql = (q["sql"].as_str().unwrap())
            .replace(" FROM t ", " FROM rechunk('t', time => 7, lat => 2) AS t ");
        q["sql"] = Value::String(sql);
        let (name, shown) = climate_oracle_through(&workers, &settings, &q).await;
        assert!(
            shown.contains("copied and scanned by the cluster's workers")
                && shown.contains("RechunkTasksExec")
                && shown.contains("AfterExec: after round")
                && shown.contains("RollingWindowExec")
                && !shown.contains("WindowAggExec")
                && shown.contains("Network"),
            "{name}:\n{shown}"
        );
        assert_eq!(work_left(&work), Vec::<String>::new(), "{name}");
    }
}

/// A reduction over more group state than one pass holds runs in bands on
/// the workers: its bands are dealt to the tasks, each finishing its own
/// bands' groups (their rows cross the network, not states), with xarray's
/// answers. In bands of time (a resampling) each task's rows are a run of
/// the result in its order: they are merged in order, with no sort; in
/// bands of latitudes (a climatology) they are not, and DataFusion sorts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reductions_in_bands_deal_their_bands_to_the_workers_with_xarray_s_answers() {
    let workers = start_workers(2).await;
    let path = repo_root().join("tests/fixtures/expected/climate_queries.json");
    let queries: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    // A bound under the state of every query grouped by the grid and over
    // one latitude's or one step's (as in dense_reduction.rs).
    let settings = ["SET zarrfusion.dense_state_bytes = 2048"];
    let mut banded = Vec::new();
    let (mut in_order, mut sorted) = (0, 0);
    for q in queries.iter().filter(|q| q["store"] == "climate.zarr") {
        let (name, shown) = climate_oracle_through(&workers, &settings, q).await;
        if !shown.contains("emits=the results of its bands") {
            continue;
        }
        assert!(
            shown.contains("bands=")
                && shown.contains("NetworkCoalesceExec")
                && !shown.contains("AggregateExec")
                && !shown.contains("DenseMergeExec"),
            "{name}:\n{shown}"
        );
        // In bands of time, a run of the result per task, merged in
        // order; of latitudes, gathered as they come and sorted.
        let merged = shown.contains("SortPreservingMergeExec");
        assert_eq!(merged, shown.contains(" keys of time"), "{name}:\n{shown}");
        assert!(merged || shown.contains("SortExec:"), "{name}:\n{shown}");
        match merged {
            true => in_order += 1,
            false => sorted += 1,
        }
        banded.push(name);
    }
    assert!(
        banded.len() >= 2 && in_order >= 1 && sorted >= 1,
        "in bands on the workers: {banded:?}"
    );
    // Ordered as the grid is (the fixture's latitudes descend), the
    // tasks' rows merged in order need no sort, and are one machine's.
    let sql = "SELECT date_trunc('day', time) AS day, lat, lon, avg(t2m) AS m, \
               max(u10) AS hi FROM t WHERE lon <= 120 GROUP BY 1, 2, 3 ORDER BY 1, 2 DESC, 3";
    let ctx = cluster_session(&workers).await;
    let alone = new_context();
    for ctx in [&ctx, &alone] {
        ctx.sql(settings[0]).await.unwrap();
        ctx.register_zarr("t", &fixture("climate.zarr"), HashMap::new())
            .await
            .unwrap();
    }
    let plan = physical_plan(&ctx, sql).await;
    let shown = displayable(plan.as_ref()).indent(true).to_string();
    assert!(
        shown.contains("emits=the results of its bands")
            && shown.contains("SortPreservingMergeExec")
            && !shown.contains("SortExec:"),
        "{shown}"
    );
    let got = query_rows(&ctx, "in bands through workers", sql).await;
    let want = query_rows(&alone, "in bands alone", sql).await;
    assert!(got.len() > 100, "{} rows", got.len());
    assert_rows("in bands through workers, in order", &got, &want);
    // An aggregate over its rows computes its partial states beside each
    // task's bands, on the workers: they cross the network, not the rows.
    let sql = "SELECT count(m) AS n, sum(m) AS s, max(hi) AS hi FROM (SELECT date_trunc('day', \
               time) AS day, lat, lon, avg(t2m) AS m, max(u10) AS hi FROM t GROUP BY 1, 2, 3)";
    let plan = physical_plan(&ctx, sql).await;
    let shown = displayable(plan.as_ref()).indent(true).to_string();
    let at = |what: &str| {
        shown
            .find(what)
            .unwrap_or_else(|| panic!("{what}:\n{shown}"))
    };
    assert!(
        at("NetworkCoalesceExec") < at("AggregateExec: mode=Partial")
            && at("AggregateExec: mode=Partial") < at("emits=the results of its bands"),
        "{shown}"
    );
    let got = query_rows(&ctx, "an aggregate over bands through workers", sql).await;
    let want = query_rows(&alone, "an aggregate over bands alone", sql).await;
    assert_rows("an aggregate over bands through workers", &got, &want);
    // Anomalies over the bound: the climatology in bands on the workers,
    // broadcast to the grid's tasks (whose own reduction may run in bands
    // of a table joined in), with xarray's answers.
    let mut joined = Vec::new();
    for q in &common::expected_queries("anomaly_queries.json") {
        let (name, shown) = climate_oracle_through(&workers, &settings, q).await;
        if shown.contains("emits=the results of its bands") {
            assert!(shown.contains("NetworkBroadcastExec"), "{name}:\n{shown}");
            joined.push(name);
        }
    }
    assert!(!joined.is_empty(), "no anomaly in bands");
}

/// The dense reduction of `sql` over the climate fixture, as planned here
/// after `settings`.
async fn planned_reduction(
    settings: &[&str],
    sql: &str,
) -> (datafusion::prelude::SessionContext, Arc<dyn ExecutionPlan>) {
    let is_reduction = |node: &Arc<dyn ExecutionPlan>| node.is::<DenseReductionExec>();
    planned_node(settings, sql, is_reduction, "dense reduction").await
}

/// The first node of `sql`'s plan over the climate fixture, planned here
/// after `settings`, that `is` picks (`what` it is, for the panic when
/// none is).
async fn planned_node(
    settings: &[&str],
    sql: &str,
    is: impl Fn(&Arc<dyn ExecutionPlan>) -> bool,
    what: &str,
) -> (datafusion::prelude::SessionContext, Arc<dyn ExecutionPlan>) {
    let ctx = new_context();
    for setting in settings {
        ctx.sql(setting).await.unwrap();
    }
    ctx.register_zarr("t", &fixture("climate.zarr"), HashMap::new())
        .await
        .unwrap();
    let mut stack = vec![physical_plan(&ctx, sql).await];
    while let Some(node) = stack.pop() {
        if is(&node) {
            return (ctx, node);
        }
        stack.extend(node.children().into_iter().cloned());
    }
    panic!("no {what} in {sql}");
}

/// A reduction in bands with its bands dealt to tasks crosses the codec
/// whole: the same plan, and its tasks' rows together, in task order, are
/// the reduction's rows on one machine. A malformed cut is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reduction_s_bands_round_trip_and_a_malformed_cut_is_refused() {
    let settings = [
        "SET zarrfusion.dense_state_bytes = 2048",
        "SET zarrfusion.target_partition_bytes = 1024",
    ];
    let sql = "SELECT date_trunc('day', time) AS day, lat, lon, avg(t2m) AS m, \
               max(u10) AS hi, count(t2m) AS n FROM t WHERE lat >= 20 GROUP BY 1, 2, 3";
    let (ctx, whole) = planned_reduction(&settings, sql).await;
    let reduction = whole.downcast_ref::<DenseReductionExec>().unwrap();
    let bands = reduction.num_bands();
    assert!(bands >= 3, "{bands} bands");
    let want = ordered_rows(Arc::clone(&whole), &ctx).await;
    let tasks = 3;
    let dealt: Arc<dyn ExecutionPlan> = Arc::new(reduction.with_tasks(tasks).unwrap());
    let shown = displayable(dealt.as_ref()).one_line().to_string();
    assert!(
        shown.contains("emits=the results of its bands, tasks=3"),
        "{shown}"
    );
    let back = through_codec(&ctx, &dealt);
    for plan in [dealt, back] {
        assert_eq!(rows_of_tasks(&ctx, &plan, tasks).await, want);
    }
    // Some of its columns (a projection taken in: `max(u10)` and `lat`): the
    // same rows from its tasks and through the codec.
    let some = reduction.with_projection(Some(vec![4, 1])).unwrap();
    let want_some = ordered_rows(
        Arc::new(reduction.with_projection(Some(vec![4, 1])).unwrap()),
        &ctx,
    )
    .await;
    assert_eq!(want_some.len(), want.len());
    let dealt: Arc<dyn ExecutionPlan> = Arc::new(some.with_tasks(tasks).unwrap());
    let shown = displayable(dealt.as_ref()).one_line().to_string();
    assert!(shown.contains("gives=[max(t.u10), lat]"), "{shown}");
    let back = through_codec(&ctx, &dealt);
    for plan in [dealt, back] {
        assert_eq!(rows_of_tasks(&ctx, &plan, tasks).await, want_some);
    }
    let wire = Wire::new(&ctx);
    let sent = wire.encode(whole_dealt(&whole));
    wire.decode(&sent).expect("the bands as sent");
    let cut = sent["bands"].clone();
    assert_eq!(cut["dim"], Value::from(0), "{cut}");
    let with = |field: &str, value: Value| {
        let mut bands = cut.clone();
        bands[field] = value;
        bands
    };
    let cases: Vec<(&str, Value, &str)> = vec![
        // Not a grouped dimension, none at all, backward, no keys.
        ("bands", with("dim", Value::from(9)), "cannot run in bands"),
        (
            "bands",
            with("descending", Value::from(true)),
            "cannot run in bands",
        ),
        ("bands", with("keys", Value::from(0)), "cannot run in bands"),
        (
            "bands",
            with("workers", Value::from(0)),
            "cannot run in bands",
        ),
        (
            "bands",
            with("at_once", Value::from(0)),
            "cannot run in bands",
        ),
        ("bands", serde_json::json!({"dim": 0}), "missing field"),
        // A column that is neither a key nor an aggregate; columns whose
        // types are not the results' sent.
        ("gives", serde_json::json!([9]), "gives column 9 of 6"),
        ("gives", serde_json::json!([4, 1]), "in bands"),
        // States, not results.
        ("positioned", Value::from(true), "in bands"),
        (
            "states",
            serde_json::json!([["day", "Int64", true]]),
            "in bands",
        ),
    ];
    wire.refuses(&sent, cases);
}

/// The rows of `plan` run as each of `tasks` tasks of a cluster's stage,
/// one task after the other, as text (with the header).
async fn rows_of_tasks(
    ctx: &datafusion::prelude::SessionContext,
    plan: &Arc<dyn ExecutionPlan>,
    tasks: usize,
) -> Vec<String> {
    let mut batches = Vec::new();
    for task_index in 0..tasks {
        let task = DistributedTaskContext {
            task_index,
            task_count: tasks,
        };
        let config = ctx.copied_config().with_extension(Arc::new(task));
        let task_ctx = Arc::new(TaskContext::from(&ctx.state()).with_session_config(config));
        let task_batches = collect_partitioned(Arc::clone(plan), task_ctx)
            .await
            .unwrap();
        batches.extend(task_batches.into_iter().flatten());
    }
    let text = datafusion::arrow::util::pretty::pretty_format_batches(&batches)
        .unwrap()
        .to_string();
    (text.lines())
        .filter(|l| l.starts_with("| "))
        .map(String::from)
        .collect()
}

/// Bands dealt to tasks are evened out: as many bands for each task, each
/// no larger than the session cut them (a climatology in 2 bands of 5 and
/// 1 latitudes runs on two tasks in bands of 3), and the tasks' rows are
/// the reduction's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bands_dealt_to_tasks_are_evened_out() {
    let sql = "SELECT extract(month FROM time) AS month, lat, lon, avg(t2m) AS m, \
               count(*) AS n FROM t GROUP BY 1, 2, 3";
    // One thread: one band at a time.
    let settings = [
        "SET zarrfusion.dense_state_bytes = 5000",
        "SET datafusion.execution.target_partitions = 1",
    ];
    let (ctx, whole) = planned_reduction(&settings, sql).await;
    let reduction = whole.downcast_ref::<DenseReductionExec>().unwrap();
    let cut = reduction.bands().expect("in bands");
    assert_eq!((reduction.num_bands(), cut.keys), (2, 5), "{cut:?}");
    let mut want = ordered_rows(Arc::clone(&whole), &ctx).await;
    want.sort();
    for (tasks, bands, keys) in [(2, 2, 3), (3, 3, 2), (4, 3, 2)] {
        let dealt: Arc<dyn ExecutionPlan> = Arc::new(reduction.with_tasks(tasks).unwrap());
        let evened = dealt.downcast_ref::<DenseReductionExec>().unwrap();
        let got = (evened.num_bands(), evened.bands().unwrap().keys);
        assert_eq!(got, (bands, keys), "{tasks} tasks");
        let mut rows = rows_of_tasks(&ctx, &dealt, tasks).await;
        rows.sort();
        assert_eq!(rows, want, "{tasks} tasks");
    }
}

/// `reduction` (a reduction in bands) with its bands dealt to two tasks.
fn whole_dealt(reduction: &Arc<dyn ExecutionPlan>) -> Arc<dyn ExecutionPlan> {
    let reduction = reduction.downcast_ref::<DenseReductionExec>().unwrap();
    Arc::new(reduction.with_tasks(2).unwrap())
}

/// The rolling window of `sql` over the climate fixture, as planned here.
async fn planned_window(
    sql: &str,
) -> (datafusion::prelude::SessionContext, Arc<dyn ExecutionPlan>) {
    planned_window_after(&[], sql).await
}

/// [`planned_window`] after `settings`.
async fn planned_window_after(
    settings: &[&str],
    sql: &str,
) -> (datafusion::prelude::SessionContext, Arc<dyn ExecutionPlan>) {
    let is_window = |node: &Arc<dyn ExecutionPlan>| node.is::<RollingWindowExec>();
    planned_node(settings, sql, is_window, "rolling window").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_window_round_trips_and_a_malformed_one_is_refused() {
    let sql = "SELECT time, lat, lon, avg(t2m) OVER (PARTITION BY lat, lon ORDER BY time \
               ROWS BETWEEN 3 PRECEDING AND 1 FOLLOWING) AS m, max(u10 * 2) OVER (PARTITION BY \
               lat, lon ORDER BY time ROWS BETWEEN 2 PRECEDING AND CURRENT ROW) AS hi FROM t \
               WHERE lat >= 30";
    let (ctx, window) = planned_window(sql).await;
    // Whole, through the codec: the same rows.
    let codec = ZarrCodec::default();
    let bytes = physical_plan_to_bytes_with_extension_codec(Arc::clone(&window), &codec).unwrap();
    let back =
        physical_plan_from_bytes_with_extension_codec(&bytes, &ctx.task_ctx(), &codec).unwrap();
    assert_eq!(
        sorted_rows(back, &ctx).await,
        sorted_rows(Arc::clone(&window), &ctx).await
    );
    let wire = Wire::new(&ctx);
    let sent = wire.encode(window);
    wire.decode(&sent).expect("the window as sent");
    let cases: Vec<(&str, Value, &str)> = vec![
        ("read", serde_json::json!([99]), "column 99"),
        (
            "arg_places",
            serde_json::json!([7]),
            "arguments from column 7",
        ),
        ("tasks", Value::from(0), "tasks"),
        ("partitions", Value::from(1u64 << 40), "partitions"),
        ("batch_size", Value::from(0), "batch_size"),
        ("dim", Value::from(9), "do not fit together"),
        ("schema", serde_json::json!([]), "do not fit together"),
        ("args", serde_json::json!(["not base64!"]), "base64"),
        (
            "outputs",
            serde_json::json!(["/////w=="]),
            "malformed expression",
        ),
        ("block_shape", serde_json::json!([0, 1, 1]), "blocks"),
        ("columns", serde_json::json!([["x", "Int8"]]), "changed"),
    ];
    wire.refuses(&sent, cases);
    let aggregate_cases: Vec<(&str, Value, &str)> = vec![
        ("op", Value::from("median"), "unknown"),
        ("start", Value::from(-(1i64 << 40)), "frame"),
        ("end", Value::from(-5), "frame"),
        ("arg", Value::from(9), "do not fit together"),
        ("output", Value::from("NoSuchType"), "NoSuchType"),
    ];
    wire.refuses_aggregate(&sent, aggregate_cases);
}

/// A running total dealt to tasks whose runs cut its series: each task
/// after the first starts from the totals of the positions before its
/// run, read from the store, and the tasks' rows together are the whole
/// window's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_total_split_mid_series_starts_from_the_totals_before_it() {
    let sql = "SELECT time, lat, lon, sum(t2m) OVER (PARTITION BY lat, lon ORDER BY time) AS s, \
               max(u10) OVER (PARTITION BY lat, lon ORDER BY time ROWS BETWEEN UNBOUNDED \
               PRECEDING AND 2 PRECEDING) AS hi, count(t2m) OVER (PARTITION BY lat, lon ORDER \
               BY time ROWS BETWEEN UNBOUNDED PRECEDING AND 3 FOLLOWING) AS n FROM t \
               WHERE lon = 0 AND lat >= 30";
    // Blocks of one chunk (50 steps): 13 blocks along time; one partition
    // per task.
    let settings = [
        "SET zarrfusion.target_partition_bytes = 1024",
        "SET datafusion.execution.target_partitions = 1",
    ];
    let (ctx, window) = planned_window_after(&settings, sql).await;
    let whole = sorted_rows(Arc::clone(&window), &ctx).await;
    // The rows and the header.
    assert_eq!(whole.len(), 608 * 3 + 1);
    let exec = window.downcast_ref::<RollingWindowExec>().unwrap();
    let tasks = 3;
    let split: Arc<dyn ExecutionPlan> = Arc::new(exec.with_tasks(tasks));
    let mut rows = rows_of_tasks(&ctx, &split, tasks).await;
    rows.sort();
    assert_eq!(rows, whole);
    // Tasks of 4, 4 and 5 blocks (of one box each): tasks 1 and 2 read the
    // 200 and 400 steps before their runs once, for the totals through the
    // step before (sum, count to 3 FOLLOWING) and, from the same read, for
    // those through 3 steps before (max to 2 PRECEDING): 200 + 400 steps.
    let metrics = split.metrics().unwrap();
    let read = metrics.sum_by_name("prefix_positions_read").unwrap();
    assert_eq!(read.as_usize(), 200 + 400, "{read}");
}

/// Registers the demo store as `era5` and `forecast` (its grid) in `ctx`.
async fn register_pair(ctx: &datafusion::prelude::SessionContext, forecast: &std::path::Path) {
    let demo = repo_root().join("demo/era5.zarr");
    for (name, path) in [("era5", demo.as_path()), ("forecast", forecast)] {
        ctx.register_zarr(name, path.to_str().unwrap(), HashMap::new())
            .await
            .unwrap();
    }
}

/// A COPY of a dense reduction whose states the workers send and the
/// session merges (`DenseMergeExec`) is written as its rows come
/// (`streamed=` in `EXPLAIN`: the sink is planned over the reduction, whose
/// merge gives the same rows in the same order), its store equal to the one
/// a machine alone writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_copy_of_a_reduction_merged_from_the_workers_is_written_as_its_rows_come() {
    let dir = scratch("cluster-copy-reduction");
    let workers = start_workers(2).await;
    let cluster = cluster_session(&workers).await;
    let alone = new_context();
    let demo = repo_root().join("demo/era5.zarr");
    for ctx in [&cluster, &alone] {
        (ctx.register_zarr("era5", demo.to_str().unwrap(), HashMap::new())
            .await)
            .unwrap();
    }
    let copy = |from: &str, name: &str| {
        format!(
            "COPY (SELECT date_trunc('day', time) AS day, lat, lon, avg(t2m) AS m, \
             count(t2m) AS n FROM {from} GROUP BY date_trunc('day', time), lat, lon) TO '{}' \
             STORED AS ZARR OPTIONS ('dims' 'day,lat,lon', 'chunks' 'day=2,lat=11,lon=16')",
            dir.join(name).display()
        )
    };
    let shown = common::explain_text(&cluster, &copy("era5", "shown.zarr")).await;
    for part in ["DenseMergeExec", "streamed=", "emits=partial states"] {
        assert!(shown.contains(part), "{part}:\n{shown}");
    }
    query_rows(
        &cluster,
        "the cluster's COPY",
        &copy("era5", "cluster.zarr"),
    )
    .await;
    query_rows(&alone, "one machine's COPY", &copy("era5", "alone.zarr")).await;
    let read = |name: &str| {
        format!(
            "SELECT * FROM read_zarr('{}') ORDER BY day, lat, lon",
            dir.join(name).display()
        )
    };
    let want = query_rows(&alone, "one machine's store", &read("alone.zarr")).await;
    let got = query_rows(&alone, "the cluster's store", &read("cluster.zarr")).await;
    assert!(want.len() > 1000, "{} rows", want.len());
    assert_eq!(got, want);
    // In bands of days (over a bound one pass may hold): the tasks' rows,
    // merged in the grid's order, are written as they come too.
    for ctx in [&cluster, &alone] {
        (ctx.sql("SET zarrfusion.dense_state_bytes = 1048576").await).unwrap();
    }
    let shown = common::explain_text(&cluster, &copy("era5", "shown.zarr")).await;
    for part in [
        "emits=the results of its bands",
        "streamed=",
        "SortPreservingMergeExec",
    ] {
        assert!(shown.contains(part), "{part}:\n{shown}");
    }
    let bands = copy("era5", "bands.zarr");
    query_rows(&cluster, "the cluster's COPY in bands", &bands).await;
    let got = query_rows(&alone, "the cluster's store in bands", &read("bands.zarr")).await;
    assert_rows("a COPY in bands through workers", &got, &want);
    // In bands of latitudes (the hours of the day repeat along time): one
    // machine writes a band at a time, and so does the session with
    // workers, their runs of bands gathered one task after the other. The
    // same store.
    let diurnal = |name: &str| {
        format!(
            "COPY (SELECT extract(hour FROM time) AS hour, lat, lon, min(t2m) AS lo, \
             count(u10) AS n FROM era5 GROUP BY 1, lat, lon) TO '{}' STORED AS ZARR \
             OPTIONS ('dims' 'hour,lat,lon', 'chunks' 'hour=5,lat=4,lon=16')",
            dir.join(name).display()
        )
    };
    for ctx in [&cluster, &alone] {
        (ctx.sql("SET zarrfusion.dense_state_bytes = 131072").await).unwrap();
    }
    let plan = physical_plan(&cluster, &diurnal("shown.zarr")).await;
    let shown = displayable(plan.as_ref()).indent(true).to_string();
    for part in [
        "emits=the results of its bands",
        "of lat per write (its bands)",
        "InOrderGatherExec",
        "NetworkCoalesceExec",
    ] {
        assert!(shown.contains(part), "{part}:\n{shown}");
    }
    let shown = common::explain_text(&alone, &diurnal("shown.zarr")).await;
    assert!(shown.contains("of lat per write (its bands)"), "{shown}");
    query_rows(&cluster, "the cluster's diurnal COPY", &diurnal("cd.zarr")).await;
    query_rows(&alone, "one machine's diurnal COPY", &diurnal("ad.zarr")).await;
    assert_same_files(&dir.join("ad.zarr"), &dir.join("cd.zarr"));
    // Over `rechunk(...)` (the copy made by the workers in the work_dir
    // first): written as its rows come too, the store of the table itself.
    let (_work, set_work) = own_work_dir(&dir);
    for ctx in [&cluster, &alone] {
        (ctx.sql("SET zarrfusion.dense_state_bytes = 1073741824")
            .await)
            .unwrap();
        (ctx.sql(&set_work).await).unwrap();
    }
    let rechunked = |name: &str| copy("rechunk('era5', time => 96, lat => 4, lon => 4)", name);
    let plan = physical_plan(&cluster, &rechunked("shown.zarr")).await;
    let shown = displayable(plan.as_ref()).indent(true).to_string();
    assert!(shown.contains("streamed=2 of day per write"), "{shown}");
    query_rows(
        &cluster,
        "the cluster's COPY over rechunk",
        &rechunked("cr.zarr"),
    )
    .await;
    assert_same_files(&dir.join("alone.zarr"), &dir.join("cr.zarr"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn aligned_joins_run_on_the_workers_as_zipped_scans() {
    // A second store on the demo's grid, in other chunks.
    let dir = scratch("cluster-zip");
    let forecast = dir.join("forecast.zarr");
    let writer = new_context();
    let demo = repo_root().join("demo/era5.zarr");
    (writer
        .register_zarr("era5", demo.to_str().unwrap(), HashMap::new())
        .await)
        .unwrap();
    let copy = format!(
        "COPY (SELECT time, lat, lon, t2m + 0.5 * u10 AS t2m, v10 AS w FROM era5) TO '{}' \
         STORED AS ZARR OPTIONS ('chunks' 'time=7,lat=11,lon=16')",
        forecast.display()
    );
    query_rows(&writer, "writing the forecast", &copy).await;

    let workers = start_workers(2).await;
    let on = "a.time = b.time AND a.lat = b.lat AND a.lon = b.lon";
    let queries = [
        // A GROUP BY over the zip: a dense reduction's partial states.
        (
            format!(
                "SELECT a.lat, avg(a.t2m - b.t2m) AS bias, count(b.w) AS n, max(b.w) AS w \
                 FROM era5 a JOIN forecast b ON {on} WHERE a.time >= '2020-01-03' \
                 GROUP BY a.lat"
            ),
            1,
            "emits=partial states",
        ),
        // Rows of both, filtered on each side's dimensions.
        (
            format!(
                "SELECT a.time, a.lat, a.lon, a.t2m - b.t2m AS d, b.w FROM era5 a \
                 JOIN forecast b ON {on} WHERE a.lat BETWEEN -20 AND 30 AND b.lon < 90"
            ),
            3,
            "ZarrScanExec",
        ),
        // USING, and a condition across the sides.
        (
            "SELECT lat, count(*) AS n, sum(era5.sst * forecast.w) AS s FROM era5 \
             JOIN forecast USING (time, lat, lon) WHERE era5.t2m < forecast.t2m GROUP BY lat"
                .to_string(),
            1,
            "emits=partial states",
        ),
    ];
    for (sql, keys, node) in &queries {
        // DataFusion's hash join, on one machine.
        let local = new_context();
        (local.sql("SET zarrfusion.aligned_join = false").await).unwrap();
        register_pair(&local, &forecast).await;
        let mut want = query_rows(&local, "hash join", sql).await;
        sort_rows(&mut want, *keys);

        let ctx = cluster_session(&workers).await;
        register_pair(&ctx, &forecast).await;
        let plan = physical_plan(&ctx, sql).await;
        let shown = displayable(plan.as_ref()).indent(true).to_string();
        assert!(
            shown.contains("era5.zarr + ")
                && shown.contains(node)
                && shown.contains("Network")
                && !shown.contains("HashJoinExec"),
            "{sql}:\n{shown}"
        );
        let mut got = query_rows(&ctx, "zip through workers", sql).await;
        sort_rows(&mut got, *keys);
        assert!(got.len() > 5, "{sql}: {} rows", got.len());
        assert_rows(&format!("{sql} through workers"), &got, &want);
    }

    // The zipped scan through the codec: the same plan and rows; a zip of
    // tables on different grids is refused.
    let ctx = new_context();
    register_pair(&ctx, &forecast).await;
    let plan = physical_plan(&ctx, &queries[1].0).await;
    let mut scans = Vec::new();
    find_scans(&plan, &mut scans);
    let scan = scans.remove(0);
    assert_round_trip(&ctx, &scan).await;
    let wire = Wire::new(&ctx);
    let sent = wire.encode(scan);
    assert_eq!(sent["source"]["kind"], "zip", "{sent}");
    let mut bad = sent.clone();
    bad["source"]["right"]["location"] = Value::from(fixture("climate.zarr"));
    let err = wire.decode(&bad).expect_err("a zip of two grids accepted");
    assert!(err.contains("not on one grid"), "{err}");
}

/// Every file under `dir`: its path below `dir` and its bytes.
/// Runs the COPY `plan` on `ctx` and asserts that its count is `want`'s
/// one value (a count on one machine).
async fn assert_copy_count(
    ctx: &datafusion::prelude::SessionContext,
    plan: Arc<dyn ExecutionPlan>,
    want: &[Vec<Value>],
) {
    let counts = datafusion::physical_plan::collect(plan, ctx.task_ctx())
        .await
        .unwrap();
    let got = datafusion::arrow::util::pretty::pretty_format_batches(&counts)
        .unwrap()
        .to_string();
    assert!(got.contains(&want[0][0].to_string()), "{got} vs {want:?}");
}

/// Asserts that the COPY `sql` to `target` on a session of `tight`'s
/// workers fails naming one of them and `allowed_mem` (else: `did`, what a
/// worker did), leaving no target.
async fn assert_refused_by_a_worker(
    ctx: &datafusion::prelude::SessionContext,
    tight: &Workers,
    sql: &str,
    target: &std::path::Path,
    did: &str,
) {
    let failed = ctx.sql(sql).await.unwrap().collect().await;
    let message = failed.err().map(|e| e.to_string()).unwrap_or_default();
    let named = (tight.urls.iter())
        .any(|url| message.contains(&format!("worker {}", url.as_str().trim_end_matches('/'))));
    assert!(
        named && message.contains("allowed_mem"),
        "{did}, or its refusal does not say so: {message}"
    );
    assert!(!target.exists());
}

/// The first node of type `T` down the first children of `plan`.
fn first_node<T: ExecutionPlan + 'static>(
    mut plan: Arc<dyn ExecutionPlan>,
) -> Arc<dyn ExecutionPlan> {
    while plan.downcast_ref::<T>().is_none() {
        let shown = displayable(plan.as_ref()).indent(true).to_string();
        plan = Arc::clone(plan.children().first().expect(&shown));
    }
    plan
}

/// The first node of type `T` in `plan`, depth first.
fn first_node_of<T: ExecutionPlan + 'static>(
    plan: &Arc<dyn ExecutionPlan>,
) -> Option<Arc<dyn ExecutionPlan>> {
    if plan.downcast_ref::<T>().is_some() {
        return Some(Arc::clone(plan));
    }
    plan.children().into_iter().find_map(first_node_of::<T>)
}

/// What a write left beside its targets in `dir`: temporary directories.
fn leftovers(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("zarrfusion-tmp"))
        .collect()
}

const WHOLE_COPY: &str =
    "COPY era5 TO '{}' STORED AS ZARR OPTIONS ('chunks' 'time=7,lat=11,lon=16')";

/// A `COPY` of a whole table on a cluster: its rechunk's tasks run on the
/// workers (a stage of two tasks under a network boundary), which write the
/// target's chunks into the session's temporary directory; the session
/// commits it. The store is the one the same COPY writes on one machine,
/// file for file (that COPY is checked against xarray in
/// `copy_to_zarr.rs`). A worker whose memory cannot hold its tasks refuses
/// them, naming itself and the numbers, and nothing is left at the target.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_whole_table_copy_writes_its_chunks_on_the_workers() {
    let dir = scratch("cluster-copy");
    let demo = repo_root().join("demo/era5.zarr");
    let copy_to = |target: &std::path::Path| WHOLE_COPY.replace("{}", &target.to_string_lossy());

    let local = new_context();
    (local
        .register_zarr("era5", demo.to_str().unwrap(), HashMap::new())
        .await)
        .unwrap();
    let alone = dir.join("alone.zarr");
    query_rows(&local, "COPY on one machine", &copy_to(&alone)).await;

    let workers = start_workers(2).await;
    let ctx = cluster_session(&workers).await;
    (ctx.register_zarr("era5", demo.to_str().unwrap(), HashMap::new())
        .await)
        .unwrap();
    let on_cluster = dir.join("cluster.zarr");
    let plan = physical_plan(&ctx, &copy_to(&on_cluster)).await;
    let shown = displayable(plan.as_ref()).indent(true).to_string();
    assert!(
        shown.contains("tasks on the cluster's workers")
            && shown.contains("Network")
            && shown.contains("RechunkTasksExec")
            && shown.contains("tasks=2"),
        "{shown}"
    );
    let want = query_rows(&local, "rows", "SELECT count(*) AS count FROM era5").await;
    assert_copy_count(&ctx, plan, &want).await;
    assert_same_files(&alone, &on_cluster);
    assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));

    // Time chunks to space chunks in 300 KiB: a rechunk in stages, a round of
    // tasks on the workers per stage, the intermediate arrays in a scratch
    // store of the session's work_dir (which every worker here sees). The
    // same bytes as the one-stage COPY on one machine.
    let deep = |target: &std::path::Path| {
        format!(
            "COPY era5 TO '{}' STORED AS ZARR OPTIONS ('chunks' 'time=96,lat=1,lon=2')",
            target.display()
        )
    };
    let alone = dir.join("deep_alone.zarr");
    query_rows(&local, "a COPY in one stage", &deep(&alone)).await;
    let ctx = distributed_context(session_config(), limited(300 << 10), workers.urls.clone());
    (ctx.sql("SET zarrfusion.bytes_per_task = 1").await).unwrap();
    (ctx.register_zarr("era5", demo.to_str().unwrap(), HashMap::new())
        .await)
        .unwrap();
    let on_cluster = dir.join("deep.zarr");
    let plan = physical_plan(&ctx, &deep(&on_cluster)).await;
    let shown = displayable(plan.as_ref()).indent(true).to_string();
    assert!(
        shown.contains("round=0") && shown.contains("round=1") && shown.contains("tasks=2"),
        "{shown}"
    );
    datafusion::physical_plan::collect(plan, ctx.task_ctx())
        .await
        .unwrap();
    assert_same_files(&alone, &on_cluster);
    assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
    let scratch_prefix = format!("zarrfusion-rechunk-{}-", std::process::id());
    let scratch_left: Vec<_> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&scratch_prefix))
        .collect();
    assert!(scratch_left.is_empty(), "{scratch_left:?}");

    // Workers that cannot hold a task: refused, nothing left.
    let tight = start_workers_in(2, || limited(512)).await;
    let ctx = cluster_session(&tight).await;
    (ctx.register_zarr("era5", demo.to_str().unwrap(), HashMap::new())
        .await)
        .unwrap();
    let refused = dir.join("refused.zarr");
    let did = "a worker with 512 bytes wrote the COPY's chunks";
    assert_refused_by_a_worker(&ctx, &tight, &copy_to(&refused), &refused, did).await;
    assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
}

/// The rechunk tasks of a whole-table COPY through the codec: the same
/// plan; a worker refuses tasks that do not match the source or would
/// write outside a COPY's temporary directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_s_rechunk_tasks_round_trip_and_malformed_ones_are_refused() {
    use zarrfusion::array::copy::whole::ArrayCopyExec;
    use zarrfusion::array::rechunk::RechunkTasksExec;

    let dir = scratch("cluster-copy-codec");
    let ctx = new_context();
    let demo = repo_root().join("demo/era5.zarr");
    (ctx.register_zarr("era5", demo.to_str().unwrap(), HashMap::new())
        .await)
        .unwrap();
    let sql = WHOLE_COPY.replace("{}", &dir.join("out.zarr").to_string_lossy());
    let plan = first_node::<ArrayCopyExec>(physical_plan(&ctx, &sql).await);
    let copy = plan.downcast_ref::<ArrayCopyExec>().unwrap();
    let on_cluster = copy.on_cluster().unwrap().expect("one stage per array");
    let gathered = on_cluster.children()[0];
    let tasks = Arc::clone(gathered.children()[0]);
    let tasks = Arc::new(
        (tasks
            .downcast_ref::<RechunkTasksExec>()
            .expect("the rechunk's tasks"))
        .with_tasks(3),
    ) as Arc<dyn ExecutionPlan>;
    let wire = Wire::new(&ctx);
    let sent = wire.encode(Arc::clone(&tasks));
    let codec = ZarrCodec::default();
    let bytes = physical_plan_to_bytes_with_extension_codec(Arc::clone(&tasks), &codec).unwrap();
    let back =
        physical_plan_from_bytes_with_extension_codec(&bytes, &ctx.task_ctx(), &codec).unwrap();
    let show = |p: &Arc<dyn ExecutionPlan>| displayable(p.as_ref()).indent(true).to_string();
    assert_eq!(show(&back), show(&tasks));
    assert!(show(&back).contains("tasks=3"), "{}", show(&back));

    wire.refuses_changed(&sent, &|v| v["tasks"] = Value::from(0), "tasks");
    wire.refuses_changed(&sent, &|v| v["tasks"] = Value::from(1u64 << 40), "tasks");
    wire.refuses_changed(
        &sent,
        &|v| v["rechunk"]["arrays"] = Value::Array(vec![]),
        "arrays",
    );
    wire.refuses_changed(
        &sent,
        &|v| v["rechunk"]["arrays"][0]["stages"][0]["region"] = serde_json::json!([3, 5]),
        "not whole chunks",
    );
    wire.refuses_changed(
        &sent,
        &|v| v["rechunk"]["arrays"][0]["stages"][0]["region"] = serde_json::json!([3, 5, 7]),
        "not whole chunks",
    );
    wire.refuses_changed(
        &sent,
        &|v| {
            let stage = &mut v["rechunk"]["arrays"][0]["stages"][0];
            let dims = stage["region"].as_array().unwrap().len();
            stage["to"] = serde_json::json!(vec![1; dims]);
        },
        "not the target's",
    );
    wire.refuses_changed(
        &sent,
        &|v| v["rechunk"]["arrays"][0]["stages"] = serde_json::json!([]),
        "stages sent",
    );
    wire.refuses_changed(&sent, &|v| v["round"] = Value::from(7), "round 7");
    wire.refuses_changed(
        &sent,
        &|v| v["rechunk"]["work"] = Value::from(dir.to_string_lossy().into_owned()),
        "not a rechunk's scratch store",
    );
    wire.refuses_changed(
        &sent,
        &|v| v["rechunk"]["arrays"][0]["target"]["fill_value"] = Value::from(7),
        "changed",
    );
    wire.refuses_changed(
        &sent,
        &|v| v["rechunk"]["arrays"][0]["name"] = Value::from("nothing"),
        "the plan was made for arrays",
    );
    wire.refuses_changed(
        &sent,
        &|v| v["target"]["path"] = Value::from(dir.to_string_lossy().into_owned()),
        "not a COPY's temporary directory",
    );
    wire.refuses_changed(
        &sent,
        &|v| v["rechunk"]["source"] = Value::from("/nonexistent/store.zarr"),
        "store.zarr",
    );
    assert!(wire.decode_bytes(b"{\"node\": \"rechunk_tasks\"}").is_err());
}

/// A work_dir of its own for a test under `dir` (tests of one process run
/// at once: another's scratch stores are not this one's leftovers), and
/// the statement setting it.
fn own_work_dir(dir: &std::path::Path) -> (std::path::PathBuf, String) {
    let work = dir.join("work");
    std::fs::create_dir_all(&work).unwrap();
    let set = format!("SET zarrfusion.work_dir = '{}'", work.display());
    (work, set)
}

/// What is left in the work_dir `work`.
fn work_left(work: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(work)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

const SELECTION_COPY: &str = "COPY (SELECT time, lat, lon, t2m - 273.15 AS t2m_c, \
     sqrt(u10 * u10 + v10 * v10) AS wind FROM era5 WHERE lat > 0) TO '{target}' \
     STORED AS ZARR OPTIONS ('chunks' '{chunks}')";

/// A `COPY` of a selection with computed variables on a cluster: its
/// blockwise step's chunks are made on the workers (a round of
/// `BlockwiseTasksExec` tasks), into the intermediate store the session
/// made, then the rechunk of that store runs on the workers too, planned
/// by the session from the metadata it writes and by each worker again
/// when its tasks run. When the chunks are whole target chunks the
/// workers write the target's own. Either way the store is the one the
/// same COPY writes on one machine, file for file (that COPY is checked
/// against xarray in `copy_to_zarr.rs`), and nothing is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_selection_copy_makes_its_chunks_on_the_workers() {
    let dir = scratch("cluster-selection-copy");
    let demo = repo_root().join("demo/era5.zarr");
    let copy_to = |target: &std::path::Path, chunks: &str| {
        (SELECTION_COPY.replace("{target}", &target.to_string_lossy())).replace("{chunks}", chunks)
    };
    let local = new_context();
    (local
        .register_zarr("era5", demo.to_str().unwrap(), HashMap::new())
        .await)
        .unwrap();
    let workers = start_workers(2).await;
    let ctx = cluster_session(&workers).await;
    let (work, set_work) = own_work_dir(&dir);
    (ctx.sql("SET zarrfusion.bytes_per_task = 1").await).unwrap();
    (ctx.sql(&set_work).await).unwrap();
    (ctx.register_zarr("era5", demo.to_str().unwrap(), HashMap::new())
        .await)
        .unwrap();
    // Through the intermediate store (the source's 24 time steps are not
    // whole chunks of 7), and straight into the target's chunks.
    for (name, chunks, rounds) in [
        ("rechunked", "time=7,lat=11,lon=16", "RechunkTasksExec"),
        ("direct", "time=12,lat=16,lon=32", "into=/"),
    ] {
        let alone = dir.join(format!("{name}_alone.zarr"));
        query_rows(&local, "COPY on one machine", &copy_to(&alone, chunks)).await;
        let on_cluster = dir.join(format!("{name}.zarr"));
        let plan = physical_plan(&ctx, &copy_to(&on_cluster, chunks)).await;
        let shown = displayable(plan.as_ref()).indent(true).to_string();
        assert!(
            shown.contains("tasks on the cluster's workers")
                && shown.contains("BlockwiseTasksExec")
                && shown.contains(rounds)
                && shown.contains("tasks=2"),
            "{shown}"
        );
        let want = query_rows(
            &local,
            "rows",
            "SELECT count(*) AS count FROM era5 WHERE lat > 0",
        )
        .await;
        assert_copy_count(&ctx, plan, &want).await;
        assert_same_files(&alone, &on_cluster);
        assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
        assert!(work_left(&work).is_empty(), "{:?}", work_left(&work));
    }

    // Workers that cannot hold a task: refused, nothing left.
    let tight = start_workers_in(2, || limited(4 << 10)).await;
    let ctx = cluster_session(&tight).await;
    (ctx.sql(&set_work).await).unwrap();
    (ctx.register_zarr("era5", demo.to_str().unwrap(), HashMap::new())
        .await)
        .unwrap();
    let refused = dir.join("refused.zarr");
    let sql = copy_to(&refused, "time=7,lat=11,lon=16");
    let did = "a worker with 4 KiB made the COPY's chunks";
    assert_refused_by_a_worker(&ctx, &tight, &sql, &refused, did).await;
    assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
    assert!(work_left(&work).is_empty(), "{:?}", work_left(&work));
}

/// A `COPY` of an anomaly, or of its running mean (variables reading a
/// climatology joined in as a broadcast), on a cluster: the climatology is
/// a stage of its own whose rows are broadcast to the tasks of the
/// blockwise step, which make the chunks on the workers holding it beside
/// them (and the rechunk of the intermediate store runs there too). The
/// store is the one the same COPY writes on one machine, file for file
/// (that COPY is checked against xarray in `broadcast_join.rs`), and
/// nothing is left. The step's tasks travel with the small side's plan as
/// their input: refused without it, and by a worker whose allowed_mem
/// cannot hold the small side's rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_copy_of_an_anomaly_broadcasts_its_climatology_to_the_workers_making_its_chunks() {
    let dir = scratch("cluster-anomaly-copy");
    let queries = common::expected_queries("anomaly_queries.json");
    let local = new_context();
    let workers = start_workers(2).await;
    let ctx = cluster_session(&workers).await;
    let (work, set_work) = own_work_dir(&dir);
    (ctx.sql(&set_work).await).unwrap();
    for c in [&local, &ctx] {
        (c.register_zarr("t", &fixture("climate.zarr"), HashMap::new())
            .await)
            .unwrap();
    }
    // Over the whole grid too.
    let whole = [
        (
            "whole_anomaly",
            "SELECT t.time, t.lat, t.lon, t.t2m - m.c AS a FROM t JOIN \
             (SELECT lat, lon, avg(t2m) AS c FROM t GROUP BY lat, lon) m \
             ON t.lat = m.lat AND t.lon = m.lon",
        ),
        (
            "whole_rolled",
            "WITH clim AS (SELECT extract(month FROM time) AS month, lat, lon, \
             avg(t2m) AS c FROM t GROUP BY 1, 2, 3) SELECT t.time, t.lat, t.lon, \
             avg(t.t2m - clim.c) OVER (PARTITION BY t.lat, t.lon ORDER BY t.time \
             ROWS BETWEEN 3 PRECEDING AND CURRENT ROW) AS m FROM t JOIN clim \
             ON extract(month FROM t.time) = clim.month AND t.lat = clim.lat \
             AND t.lon = clim.lon",
        ),
    ];
    for (name, chunks, rolled) in [
        ("anomaly_of_each_cell_using", "time=5,lat=3,lon=2", false),
        ("anomaly_of_each_cell_using", "time=4,lat=6,lon=3", false),
        ("rolling_anomaly_day_mean", "time=5,lat=1,lon=2", true),
        ("rolling_left_join_sum", "time=3,lat=1,lon=1", true),
        ("whole_anomaly", "time=50", false),
        ("whole_rolled", "time=50,lat=3,lon=3", true),
    ] {
        let sql = (queries.iter())
            .find(|q| q["name"] == name)
            .and_then(|q| q["sql"].as_str())
            .or_else(|| whole.iter().find(|(n, _)| *n == name).map(|(_, sql)| *sql))
            .unwrap_or_else(|| panic!("no oracle query {name}"));
        // The query without its final ORDER BY (the store is a grid).
        let query = match sql.rsplit_once(" ORDER BY ") {
            Some((query, order)) if !order.contains(')') => query,
            _ => sql,
        };
        let copy_to = |target: &std::path::Path| {
            format!(
                "COPY ({query}) TO '{}' STORED AS ZARR OPTIONS ('chunks' '{chunks}')",
                target.display()
            )
        };
        let alone = dir.join(format!("{name}-{chunks}-alone.zarr"));
        let want = query_rows(&local, "the COPY on one machine", &copy_to(&alone)).await;
        let on_cluster = dir.join(format!("{name}-{chunks}.zarr"));
        let plan = physical_plan(&ctx, &copy_to(&on_cluster)).await;
        let shown = displayable(plan.as_ref()).indent(true).to_string();
        let step = (shown.lines()).find(|l| l.contains("BlockwiseTasksExec"));
        assert!(
            shown.contains("tasks on the cluster's workers")
                && step.is_some_and(|l| l.contains("broadcast=[") && l.contains("its stage's"))
                && shown.contains("NetworkBroadcastExec")
                && !shown.contains("HashJoinExec"),
            "{name}:\n{shown}"
        );
        assert_eq!(shown.contains("rolled along"), rolled, "{name}:\n{shown}");
        assert_copy_count(&ctx, plan, &want).await;
        assert_same_files(&alone, &on_cluster);
        assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
        assert!(work_left(&work).is_empty(), "{:?}", work_left(&work));

        // The step's tasks through the codec, the small side's plan their
        // input.
        let (step, inputs, sent) = sent_step(&local, &copy_to(&dir.join("codec.zarr"))).await;
        let wire = Wire::new(&local);
        wire.decode_with(&sent, &inputs).expect("the step as sent");
        let err = wire
            .decode_with(&sent, &[])
            .expect_err("no inputs accepted");
        assert!(err.contains("sent 0 inputs"), "{err}");
        drop(step);
        assert!(work_left(&work).is_empty(), "{:?}", work_left(&work));
    }

    // A worker whose allowed_mem holds the demo store's coordinates but not
    // the climatology of each of its cells (2,112 of them).
    (local
        .register_zarr(
            "era5",
            &repo_root().join("demo/era5.zarr").to_string_lossy(),
            HashMap::new(),
        )
        .await)
        .unwrap();
    let sql = format!(
        "COPY (SELECT e.time, e.lat, e.lon, e.t2m - m.c AS a FROM era5 e JOIN \
         (SELECT lat, lon, avg(t2m) AS c FROM era5 GROUP BY lat, lon) m \
         ON e.lat = m.lat AND e.lon = m.lon) TO '{}' STORED AS ZARR",
        dir.join("refused.zarr").display()
    );
    let (step, inputs, sent) = sent_step(&local, &sql).await;
    let shown = displayable(step.as_ref()).one_line().to_string();
    assert!(
        shown.contains("broadcast=[m by (lat: 33, lon: 64)"),
        "{shown}"
    );
    let small = zarrfusion::new_context_with(session_config(), limited(8 << 10));
    let err = (Wire::new(&small).decode_with(&sent, &inputs)).expect_err("held in 8 KiB");
    let says = [
        "SelectionCopyExec over",
        "of tables joined in",
        "the memory limit (allowed_mem) is 8.0 KB",
    ];
    assert!(says.iter().all(|s| err.contains(s)), "{err}");
    drop(step);
    assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
    assert!(work_left(&work).is_empty(), "{:?}", work_left(&work));
}

/// datafusion-distributed's `BroadcastExec` keeps every batch its input
/// sends for all its consumer tasks and reserves each as arrow counts it
/// (`get_array_memory_size`, every buffer the batch holds, in full). A
/// climatology sent as arrow slices of its one result batch was reserved
/// once per batch: 2.5 GB for a 19.8 MB climatology on a worker of the
/// cluster benchmark (bench/RESULTS.md 2026-12-04 21:38). Sent as views
/// counting their own rows (`table::batch_rows`, through which a dense
/// reduction and the merge of a cluster's states both send their result),
/// the broadcast reserves the rows once, whatever the number of batches or
/// consumers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broadcast_of_a_climatology_reserves_its_rows_once() {
    use datafusion::arrow::array::Array;
    use datafusion_distributed::BroadcastExec;
    use futures::StreamExt;

    let pool = Arc::new(ByConsumer::default());
    let runtime = RuntimeEnvBuilder::new()
        .with_memory_pool(Arc::clone(&pool) as _)
        .build_arc()
        .unwrap();
    // Batches of 64 rows: the 2,112 cells' climatology in 33 of them.
    let ctx = zarrfusion::new_context_with(session_config().with_batch_size(64), runtime);
    let demo = repo_root().join("demo/era5.zarr");
    (ctx.register_zarr("era5", demo.to_str().unwrap(), HashMap::new())
        .await)
        .unwrap();
    let sql = "SELECT lat, lon, avg(t2m) AS c FROM era5 GROUP BY lat, lon";
    let plan = physical_plan(&ctx, sql).await;
    assert!(
        first_node_of::<DenseReductionExec>(&plan).is_some(),
        "{}",
        displayable(plan.as_ref()).indent(true)
    );
    let consumers = 3;
    let broadcast = Arc::new(BroadcastExec::new(plan, consumers));
    let partitions = broadcast.properties().partitioning.partition_count();
    let mut streams: Vec<_> = (0..partitions)
        .map(|p| broadcast.execute(p, ctx.task_ctx()).unwrap())
        .collect();
    let mut each = vec![(0, 0); consumers];
    for (p, stream) in streams.iter_mut().enumerate() {
        while let Some(batch) = stream.next().await {
            let batch = batch.unwrap();
            // The bytes of its rows: values and validity.
            let own: usize = (batch.columns().iter())
                .map(|c| {
                    let width = c.data_type().primitive_width().unwrap();
                    c.len() * width + c.nulls().map_or(0, |_| c.len().div_ceil(8))
                })
                .sum();
            let consumer = &mut each[p * consumers / partitions];
            *consumer = (consumer.0 + batch.num_rows(), consumer.1 + own);
        }
    }
    assert!(
        each.iter().all(|&(rows, _)| rows == 2112),
        "each consumer gets every cell's row: {each:?}"
    );
    let rows_bytes = each[0].1;
    let reserved = pool.broadcast_peak();
    assert!(
        reserved >= rows_bytes && reserved <= 2 * rows_bytes,
        "BroadcastExec reserved {reserved} bytes at most for {rows_bytes} bytes of rows"
    );
}

/// A memory pool without a limit that keeps, beside the total, the most
/// datafusion-distributed's `BroadcastExec` reserved at once.
#[derive(Debug, Default)]
struct ByConsumer {
    reserved: std::sync::atomic::AtomicUsize,
    broadcast: std::sync::atomic::AtomicUsize,
    broadcast_peak: std::sync::atomic::AtomicUsize,
}

impl ByConsumer {
    fn broadcast_peak(&self) -> usize {
        self.broadcast_peak
            .load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl std::fmt::Display for ByConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ByConsumer")
    }
}

impl datafusion::execution::memory_pool::MemoryPool for ByConsumer {
    fn name(&self) -> &str {
        "ByConsumer"
    }

    fn grow(&self, reservation: &datafusion::execution::memory_pool::MemoryReservation, n: usize) {
        use std::sync::atomic::Ordering::SeqCst;
        self.reserved.fetch_add(n, SeqCst);
        if reservation.consumer().name().starts_with("BroadcastExec") {
            let now = self.broadcast.fetch_add(n, SeqCst) + n;
            self.broadcast_peak.fetch_max(now, SeqCst);
        }
    }

    fn shrink(
        &self,
        reservation: &datafusion::execution::memory_pool::MemoryReservation,
        n: usize,
    ) {
        use std::sync::atomic::Ordering::SeqCst;
        self.reserved.fetch_sub(n, SeqCst);
        if reservation.consumer().name().starts_with("BroadcastExec") {
            self.broadcast.fetch_sub(n, SeqCst);
        }
    }

    fn try_grow(
        &self,
        reservation: &datafusion::execution::memory_pool::MemoryReservation,
        n: usize,
    ) -> datafusion::common::Result<()> {
        self.grow(reservation, n);
        Ok(())
    }

    fn reserved(&self) -> usize {
        self.reserved.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// The count `name` of a node's line of `EXPLAIN ANALYZE`, as it shows it
/// (`3.46 K`: to three digits).
fn shown_count(line: &str, name: &str) -> f64 {
    let shown =
        (line.split(&format!(" {name}=")).nth(1)).unwrap_or_else(|| panic!("no {name} in {line}"));
    let shown: String = shown
        .chars()
        .take_while(|&c| c != ',' && c != ']')
        .collect();
    let (number, unit) = shown.split_once(' ').unwrap_or((&shown, ""));
    let scale = match unit {
        "" => 1.0,
        "K" => 1e3,
        "M" => 1e6,
        "B" => 1e9,
        other => panic!("{name} in {other} in {line}"),
    };
    three_digits(number.parse::<f64>().unwrap() * scale)
}

/// `value` to three significant digits (as `EXPLAIN ANALYZE` shows counts).
fn three_digits(value: f64) -> f64 {
    let digits = 10f64.powi(value.log10().floor() as i32 - 2);
    (value / digits).round() * digits
}

/// The blockwise step of the `COPY` `sql` planned by `ctx` on one machine
/// (its tasks, as a cluster would get them), its inputs (the tables joined
/// in), and the step as the codec sends it.
async fn sent_step(
    ctx: &datafusion::prelude::SessionContext,
    sql: &str,
) -> (Arc<dyn ExecutionPlan>, Vec<Arc<dyn ExecutionPlan>>, Vec<u8>) {
    use zarrfusion::array::copy::selection::SelectionCopyExec;

    let plan = first_node::<SelectionCopyExec>(physical_plan(ctx, sql).await);
    let copy = plan.downcast_ref::<SelectionCopyExec>().unwrap();
    let on_cluster = copy.on_cluster().unwrap().expect("its rounds");
    let step = Arc::clone(on_cluster.children()[0].children()[0]);
    assert_eq!(step.name(), "BlockwiseTasksExec");
    let inputs: Vec<Arc<dyn ExecutionPlan>> = step.children().into_iter().cloned().collect();
    assert_eq!(inputs.len(), 1, "the table joined in");
    let sent = serde_json::to_vec(&Wire::new(ctx).encode(Arc::clone(&step))).unwrap();
    (step, inputs, sent)
}

/// The tasks of a COPY of a selection through the codec: the blockwise
/// step and the rechunk of its intermediate store give the same plan; a
/// worker refuses chunks that do not fit the selection, variables that do
/// not match the expressions, and writes outside a COPY's intermediate
/// store or temporary directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_selection_copy_s_tasks_round_trip_and_malformed_ones_are_refused() {
    use zarrfusion::array::copy::selection::SelectionCopyExec;

    let dir = scratch("cluster-selection-codec");
    let ctx = new_context();
    let demo = repo_root().join("demo/era5.zarr");
    (ctx.register_zarr("era5", demo.to_str().unwrap(), HashMap::new())
        .await)
        .unwrap();
    let sql = (SELECTION_COPY.replace("{target}", &dir.join("out.zarr").to_string_lossy()))
        .replace("{chunks}", "time=7,lat=11,lon=16");
    let plan = first_node::<SelectionCopyExec>(physical_plan(&ctx, &sql).await);
    let copy = plan.downcast_ref::<SelectionCopyExec>().unwrap();
    let on_cluster = copy.on_cluster().unwrap().expect("computed variables");
    let rounds = on_cluster.children();
    assert_eq!(rounds.len(), 2, "the blockwise round and one rechunk round");
    let show = |p: &Arc<dyn ExecutionPlan>| displayable(p.as_ref()).indent(true).to_string();
    let codec = ZarrCodec::default();
    let wire = Wire::new(&ctx);
    let mut sent = Vec::new();
    for round in rounds {
        let tasks = Arc::clone(round.children()[0]);
        let bytes =
            physical_plan_to_bytes_with_extension_codec(Arc::clone(&tasks), &codec).unwrap();
        let back =
            physical_plan_from_bytes_with_extension_codec(&bytes, &ctx.task_ctx(), &codec).unwrap();
        assert_eq!(show(&back), show(&tasks));
        sent.push(wire.encode(tasks));
    }
    let (blockwise, rechunk) = (&sent[0], &sent[1]);
    assert_eq!(blockwise["node"], "blockwise", "{blockwise}");
    assert_eq!(rechunk["rechunk"]["planned_when_run"], true, "{rechunk}");

    wire.refuses_changed(blockwise, &|v| v["tasks"] = Value::from(0), "tasks");
    wire.refuses_changed(
        blockwise,
        &|v| v["step"]["block"] = serde_json::json!([24, 16]),
        "for 3 dimensions",
    );
    wire.refuses_changed(
        blockwise,
        &|v| v["step"]["block"] = serde_json::json!([0, 16, 64]),
        "makes chunks",
    );
    wire.refuses_changed(
        blockwise,
        &|v| v["step"]["block"] = serde_json::json!([24, 17, 64]),
        "makes chunks",
    );
    wire.refuses_changed(
        blockwise,
        &|v| v["step"]["chunks"] = serde_json::json!([7, 16, 64]),
        "makes chunks",
    );
    wire.refuses_changed(
        blockwise,
        &|v| v["step"]["variables"][0][1] = Value::from("Int32"),
        "not floats",
    );
    wire.refuses_changed(
        blockwise,
        &|v| v["exprs"] = serde_json::json!([v["exprs"][0].clone()]),
        "2 variables with 1 expressions",
    );
    wire.refuses_changed(
        blockwise,
        &|v| v["exprs"][0] = Value::from("not an expression"),
        "base64",
    );
    wire.refuses_changed(
        blockwise,
        &|v| v["step"]["into"]["location"] = Value::from(dir.to_string_lossy().into_owned()),
        "not a COPY's intermediate store",
    );
    wire.refuses_changed(
        blockwise,
        &|v| {
            v["step"]["into"] = serde_json::json!({
                "kind": "target",
                "staged": {"kind": "local", "path": dir.to_string_lossy()},
            })
        },
        "not a COPY's temporary directory",
    );
    wire.refuses_changed(
        rechunk,
        &|v| v["rechunk"]["source"] = Value::from(fixture("climate.zarr")),
        "not a COPY's intermediate store",
    );
    wire.refuses_changed(rechunk, &|v| v["round"] = Value::from(3), "round 3");
}

const ROLLING_COPY: &str = "COPY (SELECT time, lat, lon, avg(t2m) OVER w AS m, \
     max(t2m) OVER w AS n FROM era5 WINDOW w AS (PARTITION BY lat, lon ORDER BY time \
     ROWS BETWEEN 23 PRECEDING AND CURRENT ROW)) TO '{target}' STORED AS ZARR \
     OPTIONS ('chunks' '{chunks}')";

/// A `COPY` of rolling windows on a cluster: its writers roll runs of
/// chunks along time on the workers (a round of `BlockwiseTasksExec`
/// tasks travelling with the window), straight into the target's chunks
/// or into the intermediate store and then through the rechunk's rounds.
/// The store is the one the same COPY writes on one machine, file for
/// file (that COPY is checked against xarray in `rolling_window.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rolling_copy_rolls_its_chunks_on_the_workers() {
    let dir = scratch("cluster-rolling-copy");
    let demo = repo_root().join("demo/era5.zarr");
    // Straight into the target's chunks with a count too: an Int64
    // variable among the floats (a worker refused it: "writes 'c' as
    // Int64, not floats"; found by the differential fuzzer).
    let copy_to = |target: &std::path::Path, chunks: &str| {
        let sql = (ROLLING_COPY.replace("{target}", &target.to_string_lossy()))
            .replace("{chunks}", chunks);
        match chunks {
            "time=24" => sql.replace("AS n FROM", "AS n, count(t2m) OVER w AS c FROM"),
            _ => sql,
        }
    };
    let workers = start_workers(2).await;
    let (work, set_work) = own_work_dir(&dir);
    // In 5 MB a writer cannot encode whole target chunks itself: the
    // chunks go through the intermediate store and the rechunk.
    let small = [
        "SET zarrfusion.target_partition_bytes = 65536",
        "SET datafusion.execution.target_partitions = 1",
        "SET datafusion.execution.batch_size = 1024",
    ];
    for (name, chunks, settings, shows) in [
        (
            "direct",
            "time=24",
            &[][..],
            "written straight into the target's chunks",
        ),
        (
            "rechunked",
            "time=7,lat=11,lon=16",
            &small[..],
            "RechunkTasksExec",
        ),
    ] {
        let runtime = || match settings.is_empty() {
            true => Arc::new(RuntimeEnv::default()),
            false => limited(5 << 20),
        };
        let local = zarrfusion::new_context_with(session_config(), runtime());
        let ctx = distributed_context(session_config(), runtime(), workers.urls.clone());
        for c in [&local, &ctx] {
            let own = ["SET zarrfusion.bytes_per_task = 1", set_work.as_str()];
            for setting in settings.iter().chain(&own) {
                (c.sql(setting).await.unwrap().collect().await).unwrap();
            }
            (c.register_zarr("era5", demo.to_str().unwrap(), HashMap::new())
                .await)
                .unwrap();
        }
        let alone = dir.join(format!("{name}_alone.zarr"));
        query_rows(&local, "COPY on one machine", &copy_to(&alone, chunks)).await;
        let on_cluster = dir.join(format!("{name}.zarr"));
        let plan = physical_plan(&ctx, &copy_to(&on_cluster, chunks)).await;
        let shown = displayable(plan.as_ref()).indent(true).to_string();
        assert!(
            shown.contains("tasks on the cluster's workers")
                && shown.contains("rolled along time")
                && shown.contains("BlockwiseTasksExec")
                && shown.contains(shows)
                && shown.contains("tasks=2"),
            "{shown}"
        );
        datafusion::physical_plan::collect(plan, ctx.task_ctx())
            .await
            .unwrap();
        assert_same_files(&alone, &on_cluster);
        assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
        assert!(work_left(&work).is_empty(), "{:?}", work_left(&work));
    }
}

/// The blockwise tasks of a COPY of rolling windows through the codec:
/// the same plan, the window travelling with them; a malformed window is
/// refused as the rolling window's own node is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_copy_s_tasks_round_trip_and_a_malformed_window_is_refused() {
    use zarrfusion::array::copy::selection::SelectionCopyExec;

    let dir = scratch("cluster-rolling-codec");
    let ctx = new_context();
    let demo = repo_root().join("demo/era5.zarr");
    (ctx.register_zarr("era5", demo.to_str().unwrap(), HashMap::new())
        .await)
        .unwrap();
    let sql = (ROLLING_COPY.replace("{target}", &dir.join("out.zarr").to_string_lossy()))
        .replace("{chunks}", "time=24");
    let plan = first_node::<SelectionCopyExec>(physical_plan(&ctx, &sql).await);
    let on_cluster = (plan.downcast_ref::<SelectionCopyExec>().unwrap())
        .on_cluster()
        .unwrap()
        .expect("rolling writers");
    let tasks = Arc::clone(on_cluster.children()[0].children()[0]);
    through_codec(&ctx, &tasks);
    let wire = Wire::new(&ctx);
    let sent = wire.encode(tasks);
    assert_eq!(sent["kernel"]["kernel"], "roll", "{sent}");
    let mut bad = sent.clone();
    bad["kernel"]["aggregates"][0]["start"] = Value::from(-(1i64 << 40));
    let err = wire
        .decode(&bad)
        .expect_err("a frame beyond the bound accepted");
    assert!(err.contains("frame"), "{err}");
    let mut bad = sent.clone();
    bad["exprs"] = serde_json::json!([sent["exprs"][0].clone()]);
    let err = wire
        .decode(&bad)
        .expect_err("fewer expressions than variables accepted");
    assert!(err.contains("2 variables with 1 expressions"), "{err}");
}

/// A stage the workers would run holding a node that cannot travel (here
/// the inverse of a transform along two dimensions, both staged on the
/// four-step path, which runs in the session only, on one side of a hash
/// join split among the workers) is refused while
/// planning, naming the node, instead of leaving a worker waiting for its
/// plan until its time-out (10 s, measured before the check); plans that
/// travel still run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_stage_that_cannot_travel_is_refused_while_planning() {
    let dir = scratch("cluster-stage-check");
    let (_work, set_work) = own_work_dir(&dir);
    let workers = start_workers(2).await;
    let ctx = cluster_session(&workers).await;
    ctx.sql(&set_work).await.unwrap();
    ctx.sql("SET zarrfusion.fft_strategy = 'four_step'")
        .await
        .unwrap();
    let demo = repo_root().join("demo/era5.zarr");
    ctx.register_zarr("era5", demo.to_str().unwrap(), HashMap::new())
        .await
        .unwrap();
    ctx.sql("CREATE VIEW spectrum AS SELECT * FROM fft('era5', 't2m', dims => 'lat,lon')")
        .await
        .unwrap();
    let sql = "SELECT a.lat, count(*) FROM ifft('spectrum', 't2m', dims => 'freq_lat,freq_lon', \
               lag => '30,90') a JOIN era5 b ON a.time = b.time AND b.lat = 80 AND b.t2m > \
               a.t2m['re'] GROUP BY a.lat";
    let started = std::time::Instant::now();
    let planned = ctx.sql(sql).await.unwrap().create_physical_plan().await;
    let err = planned
        .expect_err("a stage that cannot travel planned")
        .to_string();
    assert!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(
        err.contains("would run on the cluster's workers, but the transform of")
            && err.contains("makes a store in work_dir first")
            && !err.contains("Plan:"),
        "{err}"
    );
    // A query whose stages all travel plans and runs.
    let rows = query_rows(
        &ctx,
        "join of scans",
        "SELECT count(*) FROM era5 a JOIN era5 b \
        ON a.time = b.time AND a.lat = b.lat AND a.lon = b.lon AND b.t2m >= a.t2m",
    )
    .await;
    assert_eq!(rows.len(), 1, "{rows:?}");
}

/// `sql` (a `GROUP BY lat` over the demo store, planned as `plan`) gives
/// in `ctx` the rows `want` (sorted by lat), and nothing is left in `work`
/// once the plan is dropped.
async fn rows_by_lat_then_nothing_left(
    ctx: &datafusion::prelude::SessionContext,
    sql: &str,
    want: &[Vec<Value>],
    plan: Arc<dyn ExecutionPlan>,
    work: &std::path::Path,
) {
    let text = |rows: &[Vec<Value>]| -> Vec<String> {
        (rows.iter())
            .map(|r| r.iter().map(Value::to_string).collect::<Vec<_>>().join("|"))
            .collect()
    };
    let mut got = query_rows(ctx, "with workers", sql).await;
    sort_rows(&mut got, 1);
    assert_eq!(got.len(), 33, "{sql}");
    assert_close(&text(&got), &text(want));
    drop(plan);
    assert!(work_left(work).is_empty(), "{sql}: {:?}", work_left(work));
}

/// `rechunk(...)` in a session with workers: its copy's tasks run on the
/// workers as rounds (one per stage of the rechunk), writing into the
/// rechunked store the session made in its `work_dir` (which every worker
/// here sees), and the workers then read that store (a `GROUP BY`'s dense
/// reduction into partial states, a join's scan): the answer of a session
/// without workers, in one stage or through intermediate arrays, and
/// nothing left in `work_dir`. Before, the copy was made by the session's
/// process.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rechunk_table_s_copy_runs_on_the_workers_with_the_answer_of_one_machine() {
    let dir = scratch("cluster-rechunk-table");
    let (work, set_work) = own_work_dir(&dir);
    let demo = repo_root().join("demo/era5.zarr");
    let workers = start_workers(2).await;
    // One stage per array; then lat chunks of 1 in 300 KiB: through
    // intermediate arrays, a round of tasks per stage.
    let cases = [
        ("time => 96, lat => 4", None, 1),
        ("time => 96, lat => 1, lon => 2", Some(300usize << 10), 2),
    ];
    for (chunks, memory, at_least_rounds) in cases {
        // Sorted here: a sort in the session would want more than 300 KiB.
        let sql = format!(
            "SELECT lat, avg(t2m) AS m, max(u10) AS u, count(*) AS n FROM rechunk('era5', \
             {chunks}) GROUP BY lat"
        );
        let local = new_context();
        (local
            .register_zarr("era5", demo.to_str().unwrap(), HashMap::new())
            .await)
            .unwrap();
        let mut want = query_rows(&local, "without workers", &sql).await;
        sort_rows(&mut want, 1);
        let ctx = match memory {
            None => cluster_session(&workers).await,
            Some(bytes) => {
                distributed_context(session_config(), limited(bytes), workers.urls.clone())
            }
        };
        (ctx.sql("SET zarrfusion.bytes_per_task = 1").await).unwrap();
        (ctx.sql(&set_work).await).unwrap();
        (ctx.register_zarr("era5", demo.to_str().unwrap(), HashMap::new())
            .await)
            .unwrap();
        let plan = physical_plan(&ctx, &sql).await;
        let shown = displayable(plan.as_ref()).indent(true).to_string();
        assert!(
            shown.contains("RechunkExec")
                && shown.contains("copied and scanned by the cluster's workers")
                && shown.contains("RechunkTasksExec")
                && shown.contains("AfterExec: after round")
                && shown.contains("DenseReductionExec")
                && !shown.contains("ZarrScanExec")
                && shown.contains("tasks=2")
                && shown.contains("Network"),
            "{chunks}:\n{shown}"
        );
        // The reduction of the rechunked store runs in tasks on the
        // workers (their partial states merged above), after the copy.
        let lines: Vec<&str> = shown.lines().collect();
        let at = (lines.iter())
            .position(|l| l.contains("DenseReductionExec"))
            .unwrap();
        let indent = |l: &str| l.len() - l.trim_start().len();
        let mut parent = at;
        while parent == at || lines[parent].contains("CooperativeExec") {
            parent = (0..parent)
                .rev()
                .find(|&i| indent(lines[i]) < indent(lines[parent]))
                .unwrap();
        }
        assert!(lines[parent].contains("AfterExec"), "{chunks}:\n{shown}");
        let scan_line = lines[at];
        assert!(
            scan_line.contains("tasks=2") || scan_line.contains("tasks=its stage's"),
            "{chunks}:\n{shown}"
        );
        for round in 0..at_least_rounds {
            assert!(
                shown.contains(&format!("round={round}")),
                "{chunks}:\n{shown}"
            );
        }
        rows_by_lat_then_nothing_left(&ctx, &sql, &want, plan, &work).await;
        if memory.is_none() {
            // EXPLAIN ANALYZE gathers every task's metrics by the nodes of
            // its stage's plan (before, a worker's plan had one node fewer
            // in the rechunk's place, and it failed).
            let analyzed = common::explain_text(&ctx, &format!("ANALYZE {sql}")).await;
            let scan = (analyzed.lines())
                .find(|l| l.contains("DenseReductionExec"))
                .unwrap_or_default();
            assert!(
                analyzed.contains("RechunkExec") && scan.contains("output_rows="),
                "{analyzed}"
            );
            assert_eq!(work_left(&work), Vec::<String>::new());
        }

        // Joined with a table: both sides split among the workers (before,
        // refused while planning: the copy ran in the session only). Not
        // in 300 KiB, where the other side's scan alone does not fit.
        if memory.is_some() {
            continue;
        }
        let joined = format!(
            "SELECT a.lat, count(*) AS n, sum(b.u10 - a.t2m) AS d FROM rechunk('era5', {chunks}) \
             a JOIN era5 b ON a.time = b.time AND a.lat = b.lat AND a.lon = b.lon AND \
             b.t2m >= a.t2m GROUP BY a.lat"
        );
        let mut want = query_rows(&local, "joined without workers", &joined).await;
        sort_rows(&mut want, 1);
        let plan = physical_plan(&ctx, &joined).await;
        let shown = displayable(plan.as_ref()).indent(true).to_string();
        assert!(
            shown.contains("copied and scanned by the cluster's workers")
                && shown.contains("HashJoinExec"),
            "{chunks}:\n{shown}"
        );
        rows_by_lat_then_nothing_left(&ctx, &joined, &want, plan, &work).await;
    }

    // The copy's tasks through the codec: the same plan; a worker refuses
    // to write anywhere but a rechunk(...)'s store.
    use datafusion::physical_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
    use zarrfusion::array::rechunk::{RechunkExec, RechunkTasksExec};
    use zarrfusion::distributed::barrier::AfterExec;
    use zarrfusion::distributed::copies::rechunk_on_workers;
    let ctx = new_context();
    (ctx.sql(&set_work).await).unwrap();
    (ctx.register_zarr("era5", demo.to_str().unwrap(), HashMap::new())
        .await)
        .unwrap();
    let sql = "SELECT lat, t2m FROM rechunk('era5', time => 96) WHERE lon < 10";
    let plan = physical_plan(&ctx, sql).await;
    let mut found = vec![Arc::clone(&plan)];
    let rechunk = loop {
        let node = found.pop().expect("a RechunkExec");
        if node.downcast_ref::<RechunkExec>().is_some() {
            break node;
        }
        found.extend(node.children().into_iter().cloned());
    };
    let rechunk = rechunk.downcast_ref::<RechunkExec>().unwrap();
    let on_workers = rechunk_on_workers(rechunk)
        .unwrap()
        .expect("its copy on the workers");
    assert!(rechunk_on_workers(&on_workers).unwrap().is_none());
    // The scan after the one round's counts, broadcast (the leaf reading
    // the store, under what is above it).
    let mut after = on_workers.children()[0];
    while after.name() == "CooperativeExec" {
        after = after.children()[0];
    }
    assert!(
        after.downcast_ref::<AfterExec>().is_some(),
        "{}",
        after.name()
    );
    let broadcast = after.children()[0];
    let tasks = Arc::clone(broadcast.children()[0]);
    let tasks = Arc::new(
        (tasks.downcast_ref::<RechunkTasksExec>())
            .expect("the copy's tasks")
            .with_tasks(2),
    ) as Arc<dyn ExecutionPlan>;
    assert!(
        tasks
            .downcast_ref::<RechunkTasksExec>()
            .unwrap()
            .rechunk()
            .arrays
            .len()
            == 1
    );
    through_codec(&ctx, &tasks);
    // The session's node travels as its input: a worker runs the scan
    // after the rounds in its place (the session keeps the stores),
    // through a pass-through node (the stage keeps its count of nodes).
    let scan = Arc::clone(rechunk.children()[0]);
    let recompute = ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute);
    let kept = Arc::new(on_workers).replace_children(vec![Arc::clone(&scan)], recompute);
    let kept = kept.unwrap();
    let codec = ZarrCodec::default();
    let bytes = physical_plan_to_bytes_with_extension_codec(kept, &codec).unwrap();
    let back =
        physical_plan_from_bytes_with_extension_codec(&bytes, &ctx.task_ctx(), &codec).unwrap();
    let show = |p: &Arc<dyn ExecutionPlan>| displayable(p.as_ref()).indent(true).to_string();
    assert_eq!(back.name(), "CooperativeExec");
    assert_eq!(show(back.children()[0]), show(&scan));
    let wire = Wire::new(&ctx);
    let sent = wire.encode(Arc::clone(&tasks));
    assert_eq!(sent["target"]["kind"], "scratch", "{sent}");
    let mut elsewhere = sent.clone();
    elsewhere["target"]["location"] =
        Value::from(dir.join("mine.zarr").to_string_lossy().into_owned());
    let err = wire
        .decode(&elsewhere)
        .expect_err("wrote outside a rechunk's store");
    assert!(err.contains("not the store of a rechunk(...)"), "{err}");
}

const FFT_COPY: &str = "COPY (SELECT * FROM fft('tests/fixtures/fft/data/grid.zarr', 'z', \
     dims => 'lat')) TO '{target}' STORED AS ZARR OPTIONS ('chunks' 'time=1,lon=5', \
     'zarr_format' '2')";

/// A `COPY` of a transform on a cluster: the workers transform runs of
/// its blocks (a stage of `BlockwiseTasksExec` tasks) and write them as
/// whole chunks of the target the session staged; the session commits it
/// metadata last. The store is xrft's spectrum and the one the same COPY
/// writes on one machine, file for file; nothing is left beside it.
/// Workers that cannot hold a block refuse it, leaving nothing; the tasks
/// round-trip through the codec, and malformed ones are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_copy_of_a_transform_writes_its_blocks_on_the_workers() {
    use zarrfusion::array::fft::FftCopyExec;

    std::env::set_current_dir(repo_root()).unwrap();
    let dir = scratch("cluster-fft-copy");
    let copy_to =
        |target: &std::path::Path| FFT_COPY.replace("{target}", &target.to_string_lossy());
    let local = new_context();
    (local
        .sql("SET zarrfusion.target_partition_bytes = 2000")
        .await)
        .unwrap();
    let alone = dir.join("alone.zarr");
    query_rows(
        &local,
        "a COPY of a transform on one machine",
        &copy_to(&alone),
    )
    .await;

    let workers = start_workers(2).await;
    let ctx = cluster_session(&workers).await;
    for set in [
        "SET zarrfusion.target_partition_bytes = 2000",
        "SET zarrfusion.bytes_per_task = 1",
    ] {
        (ctx.sql(set).await).unwrap();
    }
    let on_cluster = dir.join("cluster.zarr");
    let plan = physical_plan(&ctx, &copy_to(&on_cluster)).await;
    let shown = displayable(plan.as_ref()).indent(true).to_string();
    assert!(
        shown.contains("FftCopyExec")
            && shown.contains("tasks on the cluster's workers")
            && shown.contains("Network")
            && shown.contains("BlockwiseTasksExec")
            && shown.contains("tasks=2"),
        "{shown}"
    );
    let want = query_rows(
        &local,
        "rows",
        "SELECT count(*) FROM read_zarr('tests/fixtures/fft/data/grid.zarr')",
    )
    .await;
    assert_copy_count(&ctx, plan, &want).await;
    assert_same_files(&alone, &on_cluster);
    assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
    crate::fft::assert_holds_xrfts_lat_spectrum(&local, on_cluster.to_str().unwrap()).await;

    // The workers' tasks report the source's blocks they read (its 432
    // float64 cells, once) and the spectrum's they wrote (complex128), as
    // `EXPLAIN ANALYZE` gathers them.
    let again = copy_to(&dir.join("analyzed.zarr"));
    let analyzed = common::explain_text(&ctx, &format!("ANALYZE {again}")).await;
    let tasks = (analyzed.lines())
        .find(|l| l.contains("BlockwiseTasksExec:"))
        .unwrap_or_else(|| panic!("{analyzed}"));
    for (name, bytes) in [("bytes_read", 432 * 8), ("bytes_written", 432 * 16)] {
        assert_eq!(
            shown_count(tasks, name),
            three_digits(bytes as f64),
            "{analyzed}"
        );
    }
    std::fs::remove_dir_all(dir.join("analyzed.zarr")).unwrap();

    // Workers that cannot hold a block: refused while planning, nothing left.
    let tight = start_workers_in(2, || limited(512)).await;
    let ctx = cluster_session(&tight).await;
    let refused = dir.join("refused.zarr");
    let did = "a worker with 512 bytes transformed the COPY's blocks";
    assert_refused_by_a_worker(&ctx, &tight, &copy_to(&refused), &refused, did).await;
    assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));

    // The tasks through the codec: the same plan; malformed ones refused.
    let plan =
        first_node::<FftCopyExec>(physical_plan(&local, &copy_to(&dir.join("codec.zarr"))).await);
    let copy = plan.downcast_ref::<FftCopyExec>().unwrap();
    let on_cluster = copy.on_cluster().unwrap().expect("a chain of transforms");
    let tasks = Arc::clone(on_cluster.children()[0].children()[0]);
    through_codec(&local, &tasks);
    let wire = Wire::new(&local);
    let sent = wire.encode(tasks);
    assert_eq!(sent["node"], "blockwise", "{sent}");
    assert_eq!(sent["kernel"]["kernel"], "transform", "{sent}");
    wire.refuses_changed(&sent, &|v| v["tasks"] = Value::from(0), "tasks");
    wire.refuses_changed(
        &sent,
        &|v| v["step"]["chunks"] = serde_json::json!([1, 9]),
        "not whole chunks",
    );
    wire.refuses_changed(
        &sent,
        &|v| v["step"]["chunks"] = serde_json::json!([1, 9, 0]),
        "not whole chunks",
    );
    wire.refuses_changed(
        &sent,
        &|v| v["step"]["chunks"] = serde_json::json!([1, 9, 3]),
        "not whole chunks",
    );
    wire.refuses_changed(
        &sent,
        &|v| v["kernel"]["block_shape"] = serde_json::json!([1, 4, 5]),
        "cut its lines",
    );
    wire.refuses_changed(
        &sent,
        &|v| v["kernel"]["chain"]["transforms"][0][0] = Value::from("dct"),
        "by 'dct'",
    );
    wire.refuses_changed(
        &sent,
        &|v| {
            v["step"]["into"]["staged"] =
                serde_json::json!({"kind": "local", "path": dir.to_string_lossy()})
        },
        "not a COPY's temporary directory",
    );
    wire.refuses_changed(
        &sent,
        &|v| {
            v["step"]["into"]["staged"] = serde_json::json!({
                "kind": "scratch",
                "location": dir.join("zarrfusion-rechunked-1.zarr").to_string_lossy(),
            })
        },
        "not a staged transform's store",
    );
}

/// A `COPY` of a transform on the four-step path on a cluster: its two
/// passes run on the workers (a stage each, the second after the first),
/// then the COPY's tasks there too, each once the second pass's counts
/// are in, writing whole chunks of the target the session staged; a
/// detrended transform fits its trend in a stage before the first pass,
/// its rows broadcast to that pass's tasks. Each store is the one the
/// same COPY writes on one machine: file for file (and xrft's spectrum),
/// the detrended one value for value within rounding; nothing is left in
/// work_dir or beside the targets.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_copy_of_a_four_step_transform_runs_its_passes_and_blocks_on_the_workers() {
    let (local, work, dir) = four_step_session("cluster-fft-copy-four-step").await;
    let workers = start_workers(2).await;
    let ctx = cluster_session(&workers).await;
    let set_work = format!("SET zarrfusion.work_dir = '{}'", work.display());
    for set in [
        set_work.as_str(),
        "SET zarrfusion.fft_strategy = 'four_step'",
    ] {
        ctx.sql(set).await.unwrap();
    }
    let want = query_rows(
        &local,
        "rows",
        "SELECT count(*) FROM read_zarr('tests/fixtures/fft/data/grid.zarr')",
    )
    .await;
    // xrft's detrend_linear_1d case: the trend's sums are added in another
    // order on two workers, so its values agree within rounding.
    let cases = [
        ("plain", "dims => 'lat'", "time=1,lon=5", None),
        (
            "detrended",
            "dims => 'lon', detrend => 'linear'",
            "time=2,lat=4",
            Some("time, lat, freq_lon"),
        ),
    ];
    for (name, args, chunks, rounded) in cases {
        let copy_to = |target: &std::path::Path| {
            format!(
                "COPY (SELECT * FROM fft('tests/fixtures/fft/data/grid.zarr', 'z', {args})) TO \
                 '{}' STORED AS ZARR OPTIONS ('chunks' '{chunks}')",
                target.display()
            )
        };
        let alone = dir.join(format!("{name}-alone.zarr"));
        query_rows(&local, "the COPY on one machine", &copy_to(&alone)).await;
        let on_cluster = dir.join(format!("{name}-cluster.zarr"));
        let plan = physical_plan(&ctx, &copy_to(&on_cluster)).await;
        let shown = displayable(plan.as_ref()).indent(true).to_string();
        for part in [
            "FftCopyExec",
            "tasks on the cluster's workers",
            "AfterExec: after pass 2 of the four-step transform",
            "BlockwiseTasksExec",
            "Network",
        ] {
            assert!(shown.contains(part), "{name}: {part}:\n{shown}");
        }
        assert_eq!(shown.matches("four-step pass ").count(), 2, "{shown}");
        let fitted = shown.contains("FittedExec: after the detrend's fit")
            && shown.contains("DetrendFitExec: the detrend of");
        assert_eq!(fitted, rounded.is_some(), "{name}:\n{shown}");
        assert_copy_count(&ctx, plan, &want).await;
        let Some(dims) = rounded else {
            assert_same_files(&alone, &on_cluster);
            continue;
        };
        let values = |store: &std::path::Path| {
            format!(
                "SELECT {dims}, z['re'] AS re, z['im'] AS im FROM read_zarr('{}') ORDER BY {dims}",
                store.display()
            )
        };
        let got = query_rows(&local, "the cluster's store", &values(&on_cluster)).await;
        let expected = query_rows(&local, "one machine's store", &values(&alone)).await;
        assert_eq!(expected.len(), 432);
        assert_rows(name, &got, &expected);
    }
    // Chunks that cut the four-step output's blocks: in the session.
    let cut = dir.join("cut.zarr");
    let sql = format!(
        "COPY (SELECT * FROM fft('tests/fixtures/fft/data/grid.zarr', 'z', dims => 'lon')) TO \
         '{}' STORED AS ZARR OPTIONS ('chunks' 'time=1,lat=3')",
        cut.display()
    );
    let plan = physical_plan(&ctx, &sql).await;
    let shown = displayable(plan.as_ref()).indent(true).to_string();
    assert!(!shown.contains("Network"), "{shown}");
    assert_copy_count(&ctx, plan, &want).await;
    let plain = dir.join("plain-cluster.zarr");
    crate::fft::assert_holds_xrfts_lat_spectrum(&local, plain.to_str().unwrap()).await;
    assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
    assert_eq!(work_left(&work), Vec::<String>::new());
}

/// The `FftExec` of `sql`, as `ctx` plans it.
async fn planned_fft(
    ctx: &datafusion::prelude::SessionContext,
    sql: &str,
) -> Arc<dyn ExecutionPlan> {
    let plan = physical_plan(ctx, sql).await;
    let mut stack = vec![plan];
    while let Some(node) = stack.pop() {
        if node.downcast_ref::<FftExec>().is_some() {
            return node;
        }
        stack.extend(node.children().into_iter().cloned());
    }
    panic!("no transform in {sql}");
}

/// Every case of the FFT fixture (xrft's answers) through two workers:
/// blocks whole along the transformed dimensions, dealt to tasks of a
/// stage on the workers, chains of transforms (views of views) included.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_fft_case_gives_xrft_s_answer_through_two_workers() {
    let workers = start_workers(2).await;
    let cases = common::fft::cases();
    assert!(cases.len() >= 20);
    let mut chains = 0;
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let ctx = cluster_session(&workers).await;
        // Blocks of a few lines: several per task.
        ctx.sql("SET zarrfusion.target_partition_bytes = 2000")
            .await
            .unwrap();
        common::fft::create_views(&ctx, case).await;
        let sql = format!("SELECT * FROM {}", common::fft::sql_call(case));
        let plan = physical_plan(&ctx, &sql).await;
        let shown = displayable(plan.as_ref()).indent(true).to_string();
        assert!(
            shown.contains("FftExec") && shown.contains("tasks=2") && shown.contains("Network"),
            "{name}: the transform is not on the workers:\n{shown}"
        );
        chains += usize::from(case["views"].as_array().is_some_and(|v| !v.is_empty()));
        common::fft::check_case(&ctx, case).await;
    }
    assert!(chains >= 2, "{chains} chained cases");
}

/// A transform on the four-step path runs its two passes on the workers:
/// a stage each (`BlockwiseTasksExec` of a four-step pass, its blocks dealt to tasks), writing
/// the intermediates into the scratch store the session made in work_dir,
/// the second after the first on the workers (`AfterExec`); the output is
/// read there too, by tasks of its own once the second pass's counts are
/// in, so a join above it is split among the workers. Every one-dimension
/// case gives xrft's answer that way, a detrended one after a stage
/// fitting its trend (`DetrendFitExec`, its rows broadcast to the first
/// pass's tasks through `FittedExec`). A staged transform (several
/// dimensions) and a chain whose inner transform is stored first run their
/// first stage's passes and blocks on the workers (three stages; a trend
/// fitted over both dimensions a stage before them), the rest in the
/// session; a chain of staged transforms runs in the session; all with
/// xrft's answer. Nothing is left in work_dir.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_step_passes_run_on_the_workers_and_other_work_dir_paths_in_the_session() {
    let workers = start_workers(2).await;
    let dir = scratch("fft-four-step-cluster");
    let (work, set_work) = own_work_dir(&dir);
    let (mut on_workers, mut first_stages, mut in_session) = (0, 0, 0);
    let mut fitted_on_workers = 0;
    for case in &common::fft::cases() {
        let name = case["name"].as_str().unwrap();
        let args = case["args"].as_object().unwrap();
        let ctx = cluster_session(&workers).await;
        for set in [
            set_work.as_str(),
            "SET zarrfusion.fft_strategy = 'four_step'",
        ] {
            ctx.sql(set).await.unwrap();
        }
        common::fft::create_views(&ctx, case).await;
        let sql = format!("SELECT * FROM {}", common::fft::sql_call(case));
        let plan = physical_plan(&ctx, &sql).await;
        let shown = displayable(plan.as_ref()).indent(true).to_string();
        let one_dimension = !args["dims"].as_str().unwrap().contains(',');
        if one_dimension && case.get("views").is_none() {
            assert_eq!(
                shown.matches("four-step pass ").count(),
                2,
                "{name}:\n{shown}"
            );
            assert!(
                shown.contains("passes on the cluster's workers")
                    && shown.contains("AfterExec: after pass 1 of the four-step transform"),
                "{name}:\n{shown}"
            );
            let fft_line = (shown.lines())
                .find(|l| l.contains("FftExec"))
                .unwrap_or_default();
            assert!(fft_line.contains("tasks=its stage's"), "{name}:\n{shown}");
            assert!(shown.contains("Network"), "{name}:\n{shown}");
            // Each pass's blocks dealt to several tasks.
            for line in shown.lines().filter(|l| l.contains("four-step pass ")) {
                assert!(line.contains(", tasks="), "{name}:\n{shown}");
            }
            // A detrend's fit is a stage of its own before the first pass,
            // its rows broadcast to that pass's tasks.
            let fitted = shown.contains("FittedExec: after the detrend's fit")
                && shown.contains("DetrendFitExec: the detrend of");
            assert_eq!(fitted, args.contains_key("detrend"), "{name}:\n{shown}");
            fitted_on_workers += usize::from(fitted);
            // Its chunks dealt to several tasks too.
            for line in shown.lines().filter(|l| l.contains("DetrendFitExec")) {
                assert!(line.contains(", tasks="), "{name}:\n{shown}");
            }
            on_workers += 1;
        } else if shown.contains("first stage on the cluster's workers") {
            // A staged transform's (or a chain's inner) first stage on the
            // four-step path: its two passes, then its blocks, on the
            // workers; the rest in the session.
            assert_eq!(
                shown.matches("four-step pass ").count(),
                2,
                "{name}:\n{shown}"
            );
            assert!(shown.contains("BlockwiseTasksExec"), "{name}:\n{shown}");
            // A trend fitted over both dimensions: its fit a stage before
            // the first pass.
            let fitted = shown.contains("FittedExec: after the detrend's fit")
                && shown.contains("DetrendFitExec: the detrend of");
            assert_eq!(fitted, args.contains_key("detrend"), "{name}:\n{shown}");
            fitted_on_workers += usize::from(fitted);
            first_stages += 1;
        } else {
            assert!(!shown.contains("four-step pass "), "{name}:\n{shown}");
            assert!(!shown.contains("Network"), "{name}:\n{shown}");
            in_session += 1;
        }
        common::fft::check_case(&ctx, case).await;
    }
    assert!(on_workers >= 12, "{on_workers} cases on the workers");
    assert!(
        first_stages >= 10,
        "{first_stages} first stages on the workers"
    );
    assert!(in_session >= 1, "{in_session} cases in the session");
    assert!(
        fitted_on_workers >= 4,
        "{fitted_on_workers} detrends fitted on the workers"
    );
    // An aggregate over a spectrum whose passes run on the workers: the
    // rows of a session without workers (whose four-step path is checked
    // against xrft in fft.rs).
    let sql = "SELECT freq_lat, sum(z['re'] * z['re'] + z['im'] * z['im']) AS power \
               FROM fft('tests/fixtures/fft/data/grid.zarr', 'z', dims => 'lat') \
               GROUP BY freq_lat ORDER BY freq_lat";
    let local = new_context();
    let cluster = cluster_session(&workers).await;
    for ctx in [&local, &cluster] {
        for set in [
            set_work.as_str(),
            "SET zarrfusion.fft_strategy = 'four_step'",
        ] {
            ctx.sql(set).await.unwrap();
        }
    }
    let shown = displayable(physical_plan(&cluster, sql).await.as_ref())
        .indent(true)
        .to_string();
    assert_eq!(shown.matches("four-step pass ").count(), 2, "{shown}");
    let want = query_rows(&local, "power", sql).await;
    assert_eq!(want.len(), 9);
    assert_rows("power", &query_rows(&cluster, "power", sql).await, &want);
    assert_eq!(work_left(&work), Vec::<String>::new());

    // Joined with a table: the spectrum is read on the workers, both sides
    // of the join split among them (before, refused while planning: the
    // session read the output); the rows of a session without workers.
    let demo = repo_root().join("demo/era5.zarr");
    for ctx in [&local, &cluster] {
        (ctx.register_zarr("era5", demo.to_str().unwrap(), HashMap::new())
            .await)
            .unwrap();
    }
    let sql = "SELECT a.freq_lat, count(*) AS n, sum(b.t2m * a.t2m['re']) AS s FROM fft('era5', \
               't2m', dims => 'lat') a JOIN era5 b ON a.time = b.time AND a.lon = b.lon \
               WHERE b.lat = 80 GROUP BY a.freq_lat ORDER BY a.freq_lat";
    let shown = displayable(physical_plan(&cluster, sql).await.as_ref())
        .indent(true)
        .to_string();
    assert!(
        shown.contains("HashJoinExec") && shown.contains("AfterExec: after pass 1"),
        "{shown}"
    );
    let want = query_rows(&local, "joined", sql).await;
    assert_eq!(want.len(), 33);
    assert_rows("joined", &query_rows(&cluster, "joined", sql).await, &want);
    assert_eq!(work_left(&work), Vec::<String>::new());
}

/// A session without workers that takes the four-step path, run from the
/// repository's root, with its own work_dir in the scratch directory
/// `name` (which it gives, with the directory, erased once dropped).
async fn four_step_session(
    name: &str,
) -> (
    datafusion::prelude::SessionContext,
    std::path::PathBuf,
    common::Scratch,
) {
    std::env::set_current_dir(repo_root()).unwrap();
    let dir = scratch(name);
    let (work, set_work) = own_work_dir(&dir);
    let alone = new_context();
    for set in [
        set_work.as_str(),
        "SET zarrfusion.fft_strategy = 'four_step'",
    ] {
        alone.sql(set).await.unwrap();
    }
    (alone, work, dir)
}

/// The transform `sql` plans in `ctx` (on the four-step path) and it with
/// its passes as a cluster's stages (their rows sent on as they are).
async fn passes_on_cluster(
    ctx: &datafusion::prelude::SessionContext,
    sql: &str,
) -> (Arc<dyn ExecutionPlan>, FftExec) {
    let fft = first_node::<FftExec>(physical_plan(ctx, sql).await);
    let on_cluster = (fft.downcast_ref::<FftExec>().unwrap())
        .on_cluster(&|rows| rows)
        .unwrap()
        .expect("its passes on the workers");
    (fft, on_cluster)
}

/// The output of a transform on the four-step path through the codec, as
/// a worker receives it once the passes run on the workers: its input is
/// the second pass's counts (the first pass run before it); the rows are
/// those of the session's own transform. A worker refuses it as a chain
/// of two transforms, with intermediates in a store that is not a four-step one, and without its
/// input.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_four_step_output_read_on_the_workers_round_trips_through_the_codec() {
    let (alone, work, _dir) = four_step_session("fft-four-step-output-codec").await;
    let sql = "SELECT * FROM fft('tests/fixtures/fft/data/grid.zarr', 'z', dims => 'lat')";
    // The rows of the session's own transform (a plan of its own: its
    // output read releases its intermediates).
    let own = first_node::<FftExec>(physical_plan(&alone, sql).await);
    let want = collect_partitioned(own, alone.task_ctx()).await.unwrap();
    let (fft, on_cluster) = passes_on_cluster(&alone, sql).await;
    let reading = reading_on_cluster(&on_cluster).expect("its output read on the workers");
    let shown = displayable(&reading).indent(true).to_string();
    assert!(
        shown.contains("tasks=its stage's")
            && shown.contains("AfterExec: after pass 1 of the four-step transform"),
        "{shown}"
    );
    let wire = Wire::new(&alone);
    let sent = wire.encode(Arc::new(reading));
    assert_eq!(sent["node"], "transform", "{sent}");
    assert!(sent["four_step"]["work"].is_string(), "{sent}");
    // Pass 1 runs first (on the workers, the AfterExec below the input);
    // the decoded output's input is pass 2's counts.
    let task = alone.task_ctx();
    let (pass1, pass2) = (on_cluster.children()[0], on_cluster.children()[1]);
    let counted = collect_partitioned(Arc::clone(pass1), Arc::clone(&task)).await;
    counted.unwrap();
    let codec = ZarrCodec::default();
    let decode = |sent: &Value, inputs: &[Arc<dyn ExecutionPlan>]| {
        let bytes = sent.to_string();
        codec.try_decode(bytes.as_bytes(), inputs, &alone.task_ctx(), &CONVERTER)
    };
    let back = decode(&sent, &[Arc::clone(pass2)]).unwrap();
    let shown = displayable(back.as_ref()).indent(true).to_string();
    assert!(
        shown.contains("tasks=its stage's") && shown.contains("passes on the cluster's workers"),
        "{shown}"
    );
    let got = collect_partitioned(back, task).await.unwrap();
    assert!(want.iter().flatten().map(|b| b.num_rows()).sum::<usize>() > 0);
    assert_eq!(got, want);
    let refused = |sent: &Value, inputs: &[Arc<dyn ExecutionPlan>], says: &str| {
        let err = decode(sent, inputs).expect_err(says).to_string();
        assert!(err.contains(says), "{says}: {err}");
    };
    let mut chain = sent.clone();
    let transform = chain["transforms"][0].clone();
    chain["transforms"] = Value::from(vec![transform.clone(), transform]);
    refused(
        &chain,
        &[Arc::clone(pass2)],
        "sent as a chain of 2 transforms",
    );
    let mut elsewhere = sent.clone();
    elsewhere["four_step"]["work"] =
        Value::from(work.join("zarrfusion-rechunked-1.zarr").to_string_lossy());
    refused(
        &elsewhere,
        &[Arc::clone(pass2)],
        "four-step transform's scratch store",
    );
    refused(&sent, &[], "has 1 inputs, got 0");
    drop((fft, on_cluster));
    assert_eq!(work_left(&work), Vec::<String>::new());
}

/// A detrended transform on the four-step path fits its trend in a stage
/// of its own before the first pass: the fit's tasks and the pass after
/// it through the codec (the same plans), the pass run on the fit's rows
/// decoded as a worker receives them. A worker refuses a fit of a
/// transform without a detrend, absurd task counts, a fit it cannot hold
/// in its `allowed_mem`, a pass after a fit without its inputs or over
/// another node, and fit rows naming a line the source does not have or
/// not counting every chunk.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_detrend_s_fit_runs_as_a_stage_before_the_first_pass() {
    use datafusion::arrow::array::{Float64Array, RecordBatch, UInt64Array};
    use datafusion::datasource::memory::MemorySourceConfig;
    use zarrfusion::array::fft::{DetrendFitExec, FittedExec};

    let (alone, work, _dir) = four_step_session("fft-detrend-fit-codec").await;
    let sql = "SELECT * FROM fft('tests/fixtures/fft/data/grid.zarr', 'z', dims => 'lat', \
               detrend => 'linear')";
    let (fft, on_cluster) = passes_on_cluster(&alone, sql).await;
    let pass1 = Arc::clone(on_cluster.children()[0].children()[0]);
    let fitted = pass1
        .downcast_ref::<FittedExec>()
        .expect("the fit before pass 1");
    let fit = Arc::clone(fitted.children()[0]);
    let fit_exec = fit.downcast_ref::<DetrendFitExec>().unwrap();
    let shown = displayable(pass1.as_ref()).indent(true).to_string();
    assert!(
        shown.contains("FittedExec: after the detrend's fit")
            && shown.contains("DetrendFitExec: the detrend of")
            && shown.contains("four-step pass 1"),
        "{shown}"
    );
    let wire = Wire::new(&alone);
    let sent_fit = wire.encode(Arc::new(fit_exec.with_tasks(3)));
    assert_eq!(sent_fit["node"], "detrend_fit", "{sent_fit}");
    assert_eq!(sent_fit["tasks"], 3, "{sent_fit}");
    // The fit and the pass after it decode to the same plan; the pass,
    // given the decoded fit's rows (its three tasks', as a broadcast would
    // give them), runs every block of pass 1.
    let back = through_codec(&alone, &pass1);
    let task = alone.task_ctx();
    let ran = collect_partitioned(back, Arc::clone(&task)).await.unwrap();
    let pass_blocks = fitted.children()[1]
        .downcast_ref::<zarrfusion::array::blockwise::BlockwiseTasksExec>()
        .unwrap()
        .chunk_tasks();
    let counts: Vec<u64> = (ran.iter().flatten())
        .flat_map(|b| {
            let c = b.column(0).as_any().downcast_ref::<UInt64Array>().unwrap();
            c.values().to_vec()
        })
        .collect();
    assert_eq!(counts.iter().sum::<u64>(), pass_blocks);
    let codec = ZarrCodec::default();
    let decode = |sent: &Value, inputs: &[Arc<dyn ExecutionPlan>]| {
        codec.try_decode(sent.to_string().as_bytes(), inputs, &task, &CONVERTER)
    };
    let three = decode(&sent_fit, &[]).unwrap();
    assert!(displayable(three.as_ref())
        .one_line()
        .to_string()
        .contains("tasks=3"));
    let refused = |sent: &Value, inputs: &[Arc<dyn ExecutionPlan>], says: &str| {
        let err = decode(sent, inputs).expect_err(says).to_string();
        assert!(err.contains(says), "{says}: {err}");
    };
    let mut many = sent_fit.clone();
    many["tasks"] = Value::from(1u64 << 40);
    refused(&many, &[], "tasks");
    let mut plain = sent_fit.clone();
    plain.as_object_mut().unwrap().remove("detrend");
    refused(&plain, &[], "with a detrend");
    let mut elsewhere = sent_fit.clone();
    elsewhere["detrend"]["axes"] = Value::from(vec![0, 5]);
    refused(&elsewhere, &[], "fitted over dimensions [0, 5]");
    let mut unknown = sent_fit.clone();
    unknown["detrend"]["detrend"] = Value::from("quadratic");
    refused(&unknown, &[], "constant or linear");
    let small = zarrfusion::new_context_with(session_config(), limited(1024));
    let err = codec
        .try_decode(
            sent_fit.to_string().as_bytes(),
            &[],
            &small.task_ctx(),
            &CONVERTER,
        )
        .expect_err("a fit in 1 KiB");
    assert!(err.to_string().contains("allowed_mem"), "{err}");
    let sent_fitted = wire.encode(Arc::clone(&pass1));
    assert_eq!(sent_fitted["node"], "fitted", "{sent_fitted}");
    refused(&sent_fitted, &[], "has 2 inputs, got 0");
    refused(
        &sent_fitted,
        &[Arc::clone(&three), Arc::clone(&three)],
        "comes before the first stage reading a detrended source",
    );
    // Fit rows from a hostile or broken cluster: a line past the
    // source's, or too few chunks counted.
    let schema = fit.schema();
    let rows = |line: Option<u64>, chunks: u64| {
        let mut columns: Vec<Arc<dyn datafusion::arrow::array::Array>> =
            vec![Arc::new(UInt64Array::from(vec![line]))];
        for _ in 0..6 {
            columns.push(Arc::new(Float64Array::from(vec![1.0])));
        }
        columns.push(Arc::new(UInt64Array::from(vec![chunks])));
        let batch = RecordBatch::try_new(Arc::clone(&schema), columns).unwrap();
        MemorySourceConfig::try_new_exec(&[vec![batch]], Arc::clone(&schema), None).unwrap()
            as Arc<dyn ExecutionPlan>
    };
    let pass = Arc::clone(fitted.children()[1]);
    let all = fit_exec.chunks();
    for (line, chunks, says) in [
        (
            Some(1u64 << 40),
            all,
            "names line 1099511627776".to_string(),
        ),
        (
            None,
            all - 1,
            format!("read {} of its {all} chunks", all - 1),
        ),
    ] {
        let detrended = Arc::clone(fit_exec.table().detrended().unwrap());
        let bad = FittedExec::new(rows(line, chunks), Arc::clone(&pass), detrended).unwrap();
        let err = collect_partitioned(Arc::new(bad), Arc::clone(&task))
            .await
            .expect_err(&says)
            .to_string();
        assert!(err.contains(&says), "{says}: {err}");
    }
    drop((fft, on_cluster, pass, pass1, fit, three));
    assert_eq!(work_left(&work), Vec::<String>::new());
}

/// A transform along x of planes whose store chunks (1, 1024, 32) make a
/// block of whole lines a whole plane, which does not fit the session's
/// allowed_mem: the variable is copied into chunks whole along x first
/// (the rechunked path). On a cluster the copy's rounds run on the
/// workers, then the transform reads the copy there, each task once the
/// last round's counts are in: the rows of a session without workers or
/// a limit (whole lines in the store's chunks), nothing left in work_dir.
/// The read through the codec gives the session's own rows; a worker
/// refuses a copy that is not a rechunk's store, and a chain.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transform_of_a_rechunked_copy_runs_the_copy_and_the_transform_on_the_workers() {
    let dir = scratch("cluster-fft-rechunked");
    let store = dir.join("planes.zarr");
    write_planes(&store);
    let (work, set_work) = own_work_dir(&dir);
    let sql = format!(
        "SELECT y, sum(v['re'] * cos(7 * freq_x + t)) AS a, sum(v['im'] * sin(5 * freq_x - t)) \
         AS b, sum(v['re'] * v['re'] + v['im'] * v['im']) AS power FROM fft('{}', 'v', dims => \
         'x') GROUP BY y ORDER BY y",
        store.display()
    );
    let local = new_context();
    let want = query_rows(&local, "whole planes", &sql).await;
    assert_eq!(want.len(), 1024);

    // A block of whole planes (over 20 MB) takes more than half of what
    // this limit leaves beside the kernel's threads.
    let kernel = rayon::current_num_threads() * 3 * 16384 * 16;
    let limit = 2 * kernel + (12 << 20);
    let workers = start_workers(2).await;
    let ctx = distributed_context(session_config(), limited(limit), workers.urls.clone());
    for set in ["SET zarrfusion.bytes_per_task = 1", set_work.as_str()] {
        ctx.sql(set).await.unwrap();
    }
    let plan = physical_plan(&ctx, &sql).await;
    let shown = displayable(plan.as_ref()).indent(true).to_string();
    for part in [
        "strategy=rechunked to",
        "AfterExec: after round 0 of the rechunk of",
        "RechunkTasksExec",
        "zarrfusion-rechunked-fft-",
        "Network",
    ] {
        assert!(shown.contains(part), "{part}:\n{shown}");
    }
    let got = query_rows(&ctx, "rechunked on the workers", &sql).await;
    assert_rows(&sql, &got, &want);
    drop(plan);
    assert_eq!(work_left(&work), Vec::<String>::new());

    // Through the codec: the copy's rounds run here first, then the read
    // a worker decodes gives the rows of the session's own transform.
    let alone = zarrfusion::new_context_with(session_config(), limited(limit));
    alone.sql(&set_work).await.unwrap();
    let select = format!("SELECT * FROM fft('{}', 'v', dims => 'x')", store.display());
    let own = first_node::<FftExec>(physical_plan(&alone, &select).await);
    let task = alone.task_ctx();
    let mine = collect_partitioned(own, Arc::clone(&task)).await.unwrap();
    let fft = first_node::<FftExec>(physical_plan(&alone, &select).await);
    let fft = fft.downcast_ref::<FftExec>().unwrap();
    let rounds = fft.copy_rounds().expect("a rechunked copy").unwrap();
    assert!(!rounds.is_empty());
    for round in rounds {
        collect_partitioned(round.leaf, Arc::clone(&task))
            .await
            .unwrap();
    }
    let reading = fft.reading_copy_on_workers();
    assert!(fft.copy_rounds().is_none(), "the copy made twice");
    let wire = Wire::new(&alone);
    let sent = wire.encode(Arc::new(reading));
    assert_eq!(sent["node"], "transform", "{sent}");
    let location = sent["rechunked"].as_str().expect("the copy's location");
    assert!(location.contains("zarrfusion-rechunked-fft-"), "{sent}");
    let codec = ZarrCodec::default();
    let decode = |sent: &Value| {
        let bytes = sent.to_string();
        codec.try_decode(bytes.as_bytes(), &[], &alone.task_ctx(), &CONVERTER)
    };
    let back = decode(&sent).unwrap();
    let theirs = collect_partitioned(back, task).await.unwrap();
    assert!(mine.iter().flatten().map(|b| b.num_rows()).sum::<usize>() == 2 * 1024 * 512);
    assert_eq!(theirs, mine);
    let refused = |sent: &Value, says: &str| {
        let err = decode(sent).expect_err(says).to_string();
        assert!(err.contains(says), "{says}: {err}");
    };
    let mut elsewhere = sent.clone();
    elsewhere["rechunked"] = Value::from(work.join("mine.zarr").to_string_lossy());
    refused(&elsewhere, "not a rechunked copy");
    let mut chain = sent.clone();
    let transform = chain["transforms"][0].clone();
    chain["transforms"] = Value::from(vec![transform.clone(), transform]);
    refused(&chain, "sent as a chain of 2 transforms");
}

/// A `COPY` of a transform whose blocks of whole lines do not fit in the
/// store's chunks (the planes above): the variable is copied into chunks
/// whole along x first. On a cluster the copy's rounds run on the
/// workers, then the COPY's tasks there too, each once the last round's
/// counts are in, writing whole chunks of the target the session staged.
/// The store is the one the same COPY writes on one machine under the same
/// limit, file for file; nothing is left in work_dir or beside the
/// target. The tasks through the codec carry the copy's location and give
/// the same plan; a worker refuses a copy that is not a rechunk's store,
/// and a chain.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_copy_of_a_transform_of_a_rechunked_copy_runs_on_the_workers() {
    use zarrfusion::array::fft::FftCopyExec;

    // As above: a block of whole planes does not fit beside the kernel.
    let case = TransformCopyCase::new("cluster-fft-copy-rechunked", "x", 12 << 20).await;
    case.copies_on_the_cluster(&[
        "AfterExec: after round 0 of the rechunk of",
        "RechunkTasksExec",
        "BlockwiseTasksExec",
    ])
    .await;
    let (alone, work) = (&case.alone, &case.work);

    // The tasks through the codec: the same plan, carrying the copy's
    // location; other locations and chains refused.
    let (plan, on_cluster, tasks, sent) = case.tasks_sent("its copy").await;
    let copy = plan.downcast_ref::<FftCopyExec>().unwrap();
    assert!(
        copy.rounds_first(&|rows| rows).is_none(),
        "the copy made twice"
    );
    let wire = Wire::new(alone);
    let location = sent["kernel"]["rechunked"]
        .as_str()
        .expect("the copy's location");
    assert!(location.contains("zarrfusion-rechunked-fft-"), "{sent}");
    // The worker's tasks read the copy (and name it), else the same plan.
    let bytes = sent.to_string();
    let codec = ZarrCodec::default();
    let back = (codec.try_decode(bytes.as_bytes(), &[], &alone.task_ctx(), &CONVERTER)).unwrap();
    let show = |p: &Arc<dyn ExecutionPlan>| displayable(p.as_ref()).indent(true).to_string();
    let store = case.store.display().to_string();
    assert_eq!(show(&back), show(&tasks).replace(&store, location));
    let elsewhere = work.join("mine.zarr").to_string_lossy().into_owned();
    wire.refuses_changed(
        &sent,
        &|v| v["kernel"]["rechunked"] = Value::from(elsewhere.as_str()),
        "not a rechunked copy",
    );
    wire.refuses_changed(
        &sent,
        &|v| {
            let transform = v["kernel"]["chain"]["transforms"][0].clone();
            v["kernel"]["chain"]["transforms"] = Value::from(vec![transform.clone(), transform]);
        },
        "sent as a chain of 2 transforms",
    );
    drop((plan, on_cluster, tasks, back));
    assert_eq!(work_left(work), Vec::<String>::new());
}

/// The setup of the tests of a COPY of a transform on the workers: the
/// planes store, a work_dir of the test's own, a session alone and one of
/// two workers (`bytes_per_task` 1) under a limit where the transform's
/// path makes a store in work_dir (the kernel's memory twice and `extra`
/// bytes), and the COPY written by the session alone (`one`).
struct TransformCopyCase {
    dir: common::Scratch,
    store: std::path::PathBuf,
    work: std::path::PathBuf,
    dims: &'static str,
    alone: datafusion::prelude::SessionContext,
    ctx: datafusion::prelude::SessionContext,
    one: std::path::PathBuf,
    _workers: Workers,
}

impl TransformCopyCase {
    async fn new(name: &str, dims: &'static str, extra: usize) -> Self {
        let dir = scratch(name);
        let store = dir.join("planes.zarr");
        write_planes(&store);
        let (work, set_work) = own_work_dir(&dir);
        let kernel = rayon::current_num_threads() * 3 * 16384 * 16;
        let limit = 2 * kernel + extra;
        let alone = zarrfusion::new_context_with(session_config(), limited(limit));
        alone.sql(&set_work).await.unwrap();
        let workers = start_workers(2).await;
        let ctx = distributed_context(session_config(), limited(limit), workers.urls.clone());
        for set in ["SET zarrfusion.bytes_per_task = 1", set_work.as_str()] {
            ctx.sql(set).await.unwrap();
        }
        let case = Self {
            one: dir.join("alone.zarr"),
            dir,
            store,
            work,
            dims,
            alone,
            ctx,
            _workers: workers,
        };
        let sql = case.copy_to(&case.one);
        query_rows(&case.alone, "the COPY on one machine", &sql).await;
        assert_eq!(work_left(&case.work), Vec::<String>::new());
        case
    }

    /// Runs the COPY with the workers, its plan showing it sent to them
    /// and each of `parts`: the store is `one`, file for file, and nothing
    /// is left. Returns the plan shown.
    async fn copies_on_the_cluster(&self, parts: &[&str]) -> String {
        let on_cluster = self.dir.join("cluster.zarr");
        let plan = physical_plan(&self.ctx, &self.copy_to(&on_cluster)).await;
        let shown = displayable(plan.as_ref()).indent(true).to_string();
        let sent = ["FftCopyExec", "tasks on the cluster's workers", "Network"];
        for part in sent.iter().chain(parts) {
            assert!(shown.contains(part), "{part}:\n{shown}");
        }
        let rows = vec![vec![Value::from(2 * 1024 * 512)]];
        assert_copy_count(&self.ctx, plan, &rows).await;
        assert_same_files(&self.one, &on_cluster);
        assert!(
            leftovers(&self.dir).is_empty(),
            "{:?}",
            leftovers(&self.dir)
        );
        assert_eq!(work_left(&self.work), Vec::<String>::new());
        shown
    }

    /// The COPY of the transform to `target`.
    fn copy_to(&self, target: &std::path::Path) -> String {
        format!(
            "COPY (SELECT * FROM fft('{}', 'v', dims => '{}')) TO '{}' STORED AS ZARR",
            self.store.display(),
            self.dims,
            target.display()
        )
    }

    /// The session alone's COPY (its `FftCopyExec`), given the rounds
    /// that make `first` (which must run before its tasks are sent) and its
    /// tasks after them; the tasks, and the tasks as the codec sends them.
    async fn tasks_sent(
        &self,
        first: &str,
    ) -> (
        Arc<dyn ExecutionPlan>,
        zarrfusion::array::fft::FftCopyExec,
        Arc<dyn ExecutionPlan>,
        Value,
    ) {
        use zarrfusion::array::fft::FftCopyExec;
        let target = self.dir.join("codec.zarr");
        let plan = physical_plan(&self.alone, &self.copy_to(&target)).await;
        let plan = first_node::<FftCopyExec>(plan);
        let copy = plan.downcast_ref::<FftCopyExec>().unwrap();
        let before = format!("sent before {first}");
        assert!(copy.on_cluster().unwrap().is_none(), "{before}");
        let rounds = copy.rounds_first(&|rows| rows).expect(first);
        assert!(!rounds.unwrap().is_empty());
        let on_cluster = copy.after_rounds_on_workers(|leaf| leaf).unwrap();
        let tasks = Arc::clone(on_cluster.children()[0].children()[0]);
        let sent = Wire::new(&self.alone).encode(Arc::clone(&tasks));
        assert_eq!(sent["node"], "blockwise", "{sent}");
        assert_eq!(sent["kernel"]["kernel"], "transform", "{sent}");
        (plan, on_cluster, tasks, sent)
    }
}

/// Writes a Zarr v3 store at `dir`: `v` over (t 2, y 1024, x 512),
/// float64, uncompressed, in chunks of (1, 1024, 32), with a smooth field
/// and a ripple on both axes; coordinates `t`, `y` and `x` (0, 1, ...).
fn write_planes(dir: &std::path::Path) {
    write_grid(dir, (2, 1024, 512, 32));
}

/// Writes a Zarr v3 store at `dir` as [`write_planes`] does, of `nt`
/// planes of `ny` x `nx`, in chunks of (1, `ny`, `cx`).
fn write_grid(dir: &std::path::Path, (nt, ny, nx, cx): (usize, usize, usize, usize)) {
    let write = |path: std::path::PathBuf, text: String| {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    let array = |shape: &[usize], chunks: &[usize], dims: &[&str]| {
        serde_json::json!({
            "zarr_format": 3, "node_type": "array", "shape": shape, "data_type": "float64",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": "NaN",
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
            "dimension_names": dims, "attributes": {}
        })
        .to_string()
    };
    let bytes = |values: &mut dyn Iterator<Item = f64>| -> Vec<u8> {
        values.flat_map(f64::to_le_bytes).collect()
    };
    write(
        dir.join("zarr.json"),
        r#"{"zarr_format": 3, "node_type": "group", "attributes": {}}"#.into(),
    );
    for (name, n) in [("t", nt), ("y", ny), ("x", nx)] {
        write(dir.join(name).join("zarr.json"), array(&[n], &[n], &[name]));
        let path = dir.join(name).join("c").join("0");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, bytes(&mut (0..n).map(|i| i as f64))).unwrap();
    }
    write(
        dir.join("v").join("zarr.json"),
        array(&[nt, ny, nx], &[1, ny, cx], &["t", "y", "x"]),
    );
    for t in 0..nt {
        for c in 0..nx / cx {
            let value = |y: usize, x: usize| {
                let (tf, yf, xf) = (t as f64, y as f64, x as f64);
                (0.05 * yf + 0.3 * tf).sin() * (0.07 * xf).cos()
                    + 0.01 * ((y * x) % 17) as f64
                    + 0.2 * (0.9 * xf - 0.4 * yf).sin()
            };
            let mut cells = (0..ny).flat_map(|y| (c * cx..(c + 1) * cx).map(move |x| (y, x)));
            let path = dir.join(format!("v/c/{t}/0/{c}"));
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, bytes(&mut cells.by_ref().map(|(y, x)| value(y, x)))).unwrap();
        }
    }
}

/// A store of planes (`write_planes`, returned first) in the directory `dir`, its
/// own work_dir (and the statement setting it), and a query of weighted
/// sums over the spectrum of the planes along `y` and `x`, per frequency
/// of `y`.
fn planes_query(dir: &std::path::Path) -> (std::path::PathBuf, std::path::PathBuf, String, String) {
    let store = dir.join("planes.zarr");
    write_planes(&store);
    let (work, set_work) = own_work_dir(dir);
    let sql = format!(
        "SELECT freq_y, sum(v['re'] * cos(7 * freq_x + 3 * freq_y)) AS a, \
         sum(v['im'] * sin(5 * freq_x - 2 * freq_y + t)) AS b, \
         sum(v['re'] * v['re'] + v['im'] * v['im']) AS power \
         FROM fft('{}', 'v', dims => 'y,x') GROUP BY freq_y ORDER BY freq_y",
        store.display()
    );
    (store, work, set_work, sql)
}

/// Runs `sql` in `ctx` (a session with workers) whose plan shows each of
/// `parts`, the `FftExec` reading a stored first stage on the workers (its
/// blocks dealt to the tasks of its stage, below a network boundary to the
/// session): its rows are `want`, and nothing is left in `work` once the
/// plan is dropped. Gives the plan as shown.
async fn read_on_the_workers(
    ctx: &datafusion::prelude::SessionContext,
    sql: &str,
    parts: &[&str],
    want: &[Vec<Value>],
    work: &std::path::Path,
) -> String {
    let plan = physical_plan(ctx, sql).await;
    let shown = displayable(plan.as_ref()).indent(true).to_string();
    for part in parts {
        assert!(shown.contains(part), "{part}:\n{shown}");
    }
    let reading = (shown.lines())
        .find(|l| l.contains("FftExec:"))
        .unwrap_or_else(|| panic!("no FftExec:\n{shown}"));
    assert!(reading.contains("tasks=its stage's"), "{shown}");
    let got = query_rows(ctx, sql, sql).await;
    assert_rows(sql, &got, want);
    drop(plan);
    assert_eq!(work_left(work), Vec::<String>::new());
    shown
}

/// A transform along two dimensions whose planes do not fit the session's
/// allowed_mem is staged: its first stage (along y, by whole lines) is a
/// stage of the plan whose tasks transform runs of its blocks on the
/// workers and store them in the store the session made in work_dir; the
/// stage after it reads that store along x on the workers too, each task
/// once the first stage's counts (broadcast) say every block is there.
/// The spectrum is the one a session without workers or a limit computes
/// by whole planes (checked against xrft in fft.rs): per frequency of y,
/// weighted sums over every cell; with a linear detrend, its fit a stage
/// before the first. Nothing is left in work_dir. Both
/// stages round trip through the codec (the later one: the same rows as
/// the session's own); a worker refuses a store not named as a staged
/// transform's, and one that holds the array otherwise than the first
/// stage writes it, a later stage of another variable than its first
/// stage's, or without its input.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_staged_transform_s_first_stage_runs_on_the_workers() {
    let dir = scratch("cluster-fft-staged");
    let (store, work, set_work, sql) = planes_query(&dir);
    let local = new_context();
    let shown = common::explain_text(&local, &sql).await;
    assert!(shown.contains("strategy=whole lines"), "{shown}");
    let want = query_rows(&local, "whole planes", &sql).await;
    assert_eq!(want.len(), 1024);

    // A plane needs over 20 MB, more than half of what the limit leaves
    // beside the kernel's threads; half the limit holds them and blocks of
    // whole lines of y, and the sort's reservation (10 MB) fits beside the
    // transform.
    let kernel = rayon::current_num_threads() * 3 * 16384 * 16;
    let limit = 2 * kernel + (24 << 20);
    let workers = start_workers(2).await;
    let ctx = distributed_context(session_config(), limited(limit), workers.urls.clone());
    for set in ["SET zarrfusion.bytes_per_task = 1", set_work.as_str()] {
        ctx.sql(set).await.unwrap();
    }
    let parts = [
        "strategy=staged: along [y] by whole lines",
        "first stage on the cluster's workers",
        "Network",
        "BlockwiseTasksExec",
        "zarrfusion-fft-staged-",
        "tasks=2",
        "BroadcastExec",
    ];
    read_on_the_workers(&ctx, &sql, &parts, &want, &work).await;

    // A chain: the transform along x of a view of the transform along y,
    // whose blocks (whole planes) do not fit: the inner transform is
    // stored first by the workers, and the outer one reads the store on
    // the workers too. The same spectrum.
    let planes = format!("fft('{}', 'v', dims => 'y,x')", store.display());
    let view = format!(
        "CREATE VIEW spec_y AS SELECT * FROM {}",
        planes.replace("y,x", "y")
    );
    ctx.sql(&view).await.unwrap();
    let chained = sql.replace(&planes, "fft('spec_y', 'v', dims => 'x')");
    let parts = [
        "strategy=chained: fft along [y] by whole lines",
        "first stage on the cluster's workers",
        "BroadcastExec",
    ];
    read_on_the_workers(&ctx, &chained, &parts, &want, &work).await;

    // Detrended: the plane's linear trend is fitted in a stage before the
    // first, its sums broadcast to the first stage's tasks; the spectrum
    // of a session removing it from whole planes.
    let detrended = sql.replace("dims => 'y,x'", "dims => 'y,x', detrend => 'linear'");
    let want_detrended = query_rows(&local, "whole planes detrended", &detrended).await;
    assert_eq!(want_detrended.len(), 1024);
    assert_ne!(want_detrended, want);
    let parts = [
        "strategy=staged: along [y] by whole lines",
        "first stage on the cluster's workers",
        "FittedExec: after the detrend's fit",
        "DetrendFitExec: the detrend of",
        "BlockwiseTasksExec",
    ];
    read_on_the_workers(&ctx, &detrended, &parts, &want_detrended, &work).await;

    // The first stage's tasks through the codec.
    let alone = zarrfusion::new_context_with(session_config(), limited(limit));
    alone.sql(&set_work).await.unwrap();
    let fft = first_node::<FftExec>(physical_plan(&alone, &sql).await);
    let on_cluster = (fft
        .downcast_ref::<FftExec>()
        .unwrap()
        .on_cluster(&|rows| rows))
    .unwrap()
    .expect("a first stage by whole lines");
    let tasks = Arc::clone(on_cluster.children()[0].children()[0]);
    through_codec(&alone, &tasks);
    let wire = Wire::new(&alone);
    let sent = wire.encode(tasks);
    assert_eq!(sent["node"], "blockwise", "{sent}");
    assert_eq!(sent["kernel"]["kernel"], "transform", "{sent}");
    let mut elsewhere = sent.clone();
    elsewhere["step"]["into"]["staged"]["location"] =
        Value::from(work.join("zarrfusion-rechunked-1.zarr").to_string_lossy());
    let err = wire
        .decode(&elsewhere)
        .expect_err("a rechunk's store accepted");
    assert!(err.contains("not a staged transform's store"), "{err}");
    // Chunks half as wide along x: accepted as whole chunks, refused when
    // the task finds the store's array otherwise.
    let mut other = sent.clone();
    other["step"]["chunks"][2] = Value::from(sent["step"]["chunks"][2].as_u64().unwrap() / 2);
    other["tasks"] = Value::from(1);
    let task = ZarrCodec::default()
        .try_decode(
            other.to_string().as_bytes(),
            &[],
            &alone.task_ctx(),
            &CONVERTER,
        )
        .unwrap();
    let err = datafusion::physical_plan::collect(task, alone.task_ctx())
        .await
        .expect_err("wrote into a store holding the array otherwise")
        .to_string();
    assert!(err.contains("otherwise than its tasks write it"), "{err}");

    // The stage after the first through the codec, its input the first
    // stage's tasks: the rows the session's own staged transform gives.
    let reading = reading_on_cluster(&on_cluster).expect("a later stage by whole lines");
    let sent = wire.encode(Arc::new(reading));
    assert_eq!(sent["node"], "transform", "{sent}");
    assert!(sent["staged"]["blocks"].as_u64().unwrap() > 1, "{sent}");
    let first = Arc::clone(on_cluster.children()[0]);
    let codec = ZarrCodec::default();
    let decode = |sent: &Value, inputs: &[Arc<dyn ExecutionPlan>]| {
        let bytes = sent.to_string();
        codec.try_decode(bytes.as_bytes(), inputs, &alone.task_ctx(), &CONVERTER)
    };
    let back = decode(&sent, &[Arc::clone(&first)]).unwrap();
    let shown = displayable(back.as_ref()).indent(true).to_string();
    assert!(shown.contains("tasks=its stage's"), "{shown}");
    assert!(
        shown.contains("first stage on the cluster's workers"),
        "{shown}"
    );
    let task = alone.task_ctx();
    let want = collect_partitioned(Arc::clone(&fft), Arc::clone(&task))
        .await
        .unwrap();
    let got = collect_partitioned(back, task).await.unwrap();
    assert_eq!(got, want);
    assert_eq!(
        want.iter().flatten().map(|b| b.num_rows()).sum::<usize>(),
        2 * 1024 * 512
    );
    let refused = |sent: &Value, inputs: &[Arc<dyn ExecutionPlan>], says: &str| {
        let err = decode(sent, inputs).expect_err(says).to_string();
        assert!(err.contains(says), "{says}: {err}");
    };
    let mut elsewhere = sent.clone();
    elsewhere["staged"]["location"] =
        Value::from(work.join("zarrfusion-rechunked-1.zarr").to_string_lossy());
    refused(
        &elsewhere,
        &[Arc::clone(&first)],
        "not a staged transform's store",
    );
    let mut other = sent.clone();
    other["staged"]["chunks"][2] = Value::from(sent["staged"]["chunks"][2].as_u64().unwrap() / 2);
    refused(
        &other,
        &[Arc::clone(&first)],
        "otherwise than the first stage",
    );
    let mut another = sent.clone();
    another["staged"]["first"]["variable"] = Value::from("t");
    refused(
        &another,
        &[Arc::clone(&first)],
        "but its first stage transforms 't'",
    );
    refused(&sent, &[], "has 1 inputs, got 0");
}

/// A `COPY` of a transform staged one dimension at a time (planes larger
/// than the session's allowed_mem): on a cluster its first stage's tasks
/// store their blocks in the store the session made in work_dir, then the
/// COPY's tasks, each once the first stage's counts are in, transform that
/// store along x and write whole chunks of the target the session staged.
/// The store is the one the same COPY writes on one machine under the
/// same limit, file for file (detrended, its trend fitted in a stage of
/// its own: within rounding); nothing is left in work_dir or beside the
/// target. The COPY's tasks round trip through the codec carrying the
/// first stage (the same plan); a worker refuses them sent as a later
/// stage and a rechunked copy's at once, and a first stage in a store that
/// is not a staged transform's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_copy_of_a_staged_transform_runs_its_stages_on_the_workers() {
    // As for the staged query above: a plane does not fit.
    let case = TransformCopyCase::new("cluster-fft-copy-staged", "y,x", 24 << 20).await;
    let TransformCopyCase {
        dir,
        work,
        alone,
        ctx,
        one,
        ..
    } = &case;
    let copy_to = |target: &std::path::Path| case.copy_to(target);
    let shown = common::explain_text(alone, &copy_to(&dir.join("shown.zarr"))).await;
    assert!(shown.contains("staged"), "{shown}");
    let shown = case
        .copies_on_the_cluster(&[
            "AfterExec: after the first stage of the staged transform",
            "zarrfusion-fft-staged-",
        ])
        .await;
    // The first stage's tasks and the COPY's.
    assert_eq!(shown.matches("BlockwiseTasksExec").count(), 2, "{shown}");
    let rows = vec![vec![Value::from(2 * 1024 * 512)]];

    // Detrended: the plane's linear trend fitted in a stage before the
    // first, its sums broadcast to the first stage's tasks. Added in
    // another order on two workers, the stores agree within rounding: per
    // frequency of y, weighted sums over every cell.
    let detrended = |target: &std::path::Path| {
        copy_to(target).replace("dims => 'y,x'", "dims => 'y,x', detrend => 'linear'")
    };
    let one_detrended = dir.join("alone-detrended.zarr");
    query_rows(alone, "the detrended COPY", &detrended(&one_detrended)).await;
    let cluster_detrended = dir.join("cluster-detrended.zarr");
    let plan = physical_plan(ctx, &detrended(&cluster_detrended)).await;
    let shown = displayable(plan.as_ref()).indent(true).to_string();
    for part in [
        "AfterExec: after the first stage of the staged transform",
        "FittedExec: after the detrend's fit",
        "DetrendFitExec: the detrend of",
    ] {
        assert!(shown.contains(part), "{part}:\n{shown}");
    }
    assert_copy_count(ctx, plan, &rows).await;
    let sums = |store: &std::path::Path| {
        format!(
            "SELECT freq_y, sum(v['re'] * cos(7 * freq_x + 3 * freq_y)) AS a, \
             sum(v['im'] * sin(5 * freq_x - 2 * freq_y + t)) AS b, \
             sum(v['re'] * v['re'] + v['im'] * v['im']) AS power \
             FROM read_zarr('{}') GROUP BY freq_y ORDER BY freq_y",
            store.display()
        )
    };
    let want = query_rows(alone, "one machine's store", &sums(&one_detrended)).await;
    let got = query_rows(alone, "the cluster's store", &sums(&cluster_detrended)).await;
    assert_eq!(want.len(), 1024);
    assert_rows("detrended", &got, &want);
    let plain = query_rows(alone, "the plain store", &sums(one)).await;
    assert_ne!(plain, want, "the trend removed");
    assert!(leftovers(dir).is_empty(), "{:?}", leftovers(dir));
    assert_eq!(work_left(work), Vec::<String>::new());

    // The COPY's tasks through the codec, after the first stage's.
    let (plan, on_cluster, tasks, sent) = case.tasks_sent("its first stage").await;
    let wire = Wire::new(alone);
    assert!(
        sent["kernel"]["staged"]["blocks"].as_u64().unwrap() > 1,
        "{sent}"
    );
    let bytes = sent.to_string();
    let codec = ZarrCodec::default();
    let back = (codec.try_decode(bytes.as_bytes(), &[], &alone.task_ctx(), &CONVERTER)).unwrap();
    // The same plan, but for the threads and memory of its blocks, which
    // the worker fits to its own allowed_mem (the session fitted them
    // beside the first stage's).
    let show = |p: &Arc<dyn ExecutionPlan>| {
        let shown = displayable(p.as_ref()).indent(true).to_string();
        let fitted =
            |part: &&str| part.starts_with("workers=") || part.starts_with("projected_memory=");
        let parts: Vec<&str> = shown.split(", ").filter(|p| !fitted(p)).collect();
        parts.join(", ")
    };
    assert_eq!(show(&back), show(&tasks));
    assert!(
        show(&back).contains("blocks=8 of shape [1, 256, 512]"),
        "{}",
        show(&back)
    );
    let elsewhere = work
        .join("zarrfusion-rechunked-1.zarr")
        .to_string_lossy()
        .into_owned();
    wire.refuses_changed(
        &sent,
        &|v| v["kernel"]["rechunked"] = Value::from(elsewhere.as_str()),
        "more than one of",
    );
    wire.refuses_changed(
        &sent,
        &|v| v["kernel"]["staged"]["location"] = Value::from(elsewhere.as_str()),
        "not a staged transform's store",
    );
    drop((plan, on_cluster, tasks, back));
    assert_eq!(work_left(work), Vec::<String>::new());
}

/// A staged transform whose first stage takes the four-step path
/// (`zarrfusion.fft_strategy = 'four_step'`) runs that stage's two passes
/// on the workers, a stage each, then its blocks' stage, whose tasks read
/// the intermediates and store the first stage's output; the session runs
/// the three in turn and reads the store (by the four-step path too). The
/// spectrum is the whole-plane one of a session without workers or a
/// limit; nothing is left in work_dir. The blocks' tasks round trip
/// through the codec with the four-step path they read; a worker refuses
/// them with intermediates in a store that is not a four-step one, or sent
/// as a chain of two transforms.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_staged_transform_s_four_step_first_stage_runs_its_passes_on_the_workers() {
    let dir = scratch("cluster-fft-staged-four-step");
    let (_, work, set_work, sql) = planes_query(&dir);
    let want = query_rows(&new_context(), "whole planes", &sql).await;
    assert_eq!(want.len(), 1024);

    let workers = start_workers(2).await;
    let ctx = distributed_context(session_config(), limited(256 << 20), workers.urls.clone());
    let four_step = "SET zarrfusion.fft_strategy = 'four_step'";
    for set in [
        "SET zarrfusion.bytes_per_task = 1",
        four_step,
        set_work.as_str(),
    ] {
        ctx.sql(set).await.unwrap();
    }
    let plan = physical_plan(&ctx, &sql).await;
    let shown = displayable(plan.as_ref()).indent(true).to_string();
    for part in [
        "strategy=staged: along [y] by four-step",
        "first stage on the cluster's workers",
        "four-step pass 1",
        "four-step pass 2",
        "BlockwiseTasksExec",
        "zarrfusion-fft-staged-",
    ] {
        assert!(shown.contains(part), "{part}:\n{shown}");
    }
    let got = query_rows(&ctx, "four-step first stage on the workers", &sql).await;
    assert_rows("four-step first stage on the workers", &got, &want);
    drop(plan);
    assert_eq!(work_left(&work), Vec::<String>::new());

    // The blocks' tasks through the codec, with the four-step path.
    let alone = zarrfusion::new_context_with(session_config(), limited(256 << 20));
    for set in [four_step, set_work.as_str()] {
        alone.sql(set).await.unwrap();
    }
    let fft = first_node::<FftExec>(physical_plan(&alone, &sql).await);
    let on_cluster = (fft
        .downcast_ref::<FftExec>()
        .unwrap()
        .on_cluster(&|rows| rows))
    .unwrap()
    .expect("a first stage on the four-step path");
    assert_eq!(on_cluster.children().len(), 3, "two passes and the blocks");
    assert!(reading_on_cluster(&on_cluster).is_none());
    let tasks = Arc::clone(on_cluster.children()[2].children()[0]);
    through_codec(&alone, &tasks);
    let wire = Wire::new(&alone);
    let sent = wire.encode(tasks);
    assert_eq!(sent["node"], "blockwise", "{sent}");
    assert_eq!(sent["kernel"]["kernel"], "transform", "{sent}");
    let mut elsewhere = sent.clone();
    elsewhere["kernel"]["four_step"]["work"] = sent["step"]["into"]["staged"]["location"].clone();
    let err = wire
        .decode(&elsewhere)
        .expect_err("a staged store accepted");
    assert!(
        err.contains("not a four-step transform's scratch store"),
        "{err}"
    );
    let mut chained = sent.clone();
    let transform = sent["kernel"]["chain"]["transforms"][0].clone();
    chained["kernel"]["chain"]["transforms"] = Value::from(vec![transform.clone(), transform]);
    let err = wire.decode(&chained).expect_err("a chain accepted");
    assert!(err.contains("chain of 2 transforms"), "{err}");
}

/// A staged transform whose first stage (along a long y) takes the
/// four-step path under allowed_mem while the stage after it (along a
/// short x) reads by whole lines runs all of it on the workers: the first
/// stage's passes and blocks one round after the other (each round's tasks
/// after every count of the previous one, broadcast: `AfterExec`), and the
/// later stage's tasks once the last round's counts say every block is
/// stored. The spectrum is the whole-plane one of a session without
/// workers or a limit; nothing is left in work_dir. A round after another
/// round trips through the codec.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_four_step_first_stage_and_the_stage_after_it_run_in_rounds_on_the_workers() {
    let dir = scratch("cluster-fft-rounds");
    let store = dir.join("long.zarr");
    let ny = 1 << 16;
    write_grid(&store, (2, ny, 8, 8));
    let (work, set_work) = own_work_dir(&dir);
    let sql = format!(
        "SELECT freq_x, sum(v['re'] * cos(7 * freq_x + 3000 * freq_y)) AS a, \
         sum(v['re'] * v['re'] + v['im'] * v['im']) AS power \
         FROM fft('{}', 'v', dims => 'y,x') GROUP BY freq_x ORDER BY freq_x",
        store.display()
    );
    let want = query_rows(&new_context(), "whole planes", &sql).await;
    assert_eq!(want.len(), 8);

    // A line of y (with its kernel's threads) does not fit half the limit,
    // a block of whole lines of x fits the other half.
    let kernel = rayon::current_num_threads() * 3 * ny * 16;
    let limit = 2 * kernel + (8 << 20);
    let workers = start_workers(2).await;
    let ctx = distributed_context(session_config(), limited(limit), workers.urls.clone());
    for set in ["SET zarrfusion.bytes_per_task = 1", set_work.as_str()] {
        ctx.sql(set).await.unwrap();
    }
    let parts = [
        "strategy=staged: along [y] by four-step",
        "AfterExec: after pass 1 of the first stage's four-step transform",
        "AfterExec: after pass 2 of the first stage's four-step transform",
        "four-step pass 1",
        "BlockwiseTasksExec",
        "then along [x] by whole lines",
    ];
    let shown = read_on_the_workers(&ctx, &sql, &parts, &want, &work).await;
    assert_eq!(shown.matches("NetworkBroadcastExec").count(), 3, "{shown}");

    // A round after another through the codec: its blocks and what the
    // previous round is; its two inputs as children.
    let alone = zarrfusion::new_context_with(session_config(), limited(limit));
    alone.sql(&set_work).await.unwrap();
    let fft = first_node::<FftExec>(physical_plan(&alone, &sql).await);
    let on_cluster = (fft
        .downcast_ref::<FftExec>()
        .unwrap()
        .on_cluster(&|rows| rows))
    .unwrap()
    .expect("a first stage on the four-step path");
    let reading = reading_on_cluster(&on_cluster).expect("a later stage by whole lines");
    let after = first_node_of::<AfterExec>(&(Arc::new(reading) as Arc<dyn ExecutionPlan>))
        .expect("rounds after each other");
    let wire = Wire::new(&alone);
    let sent = wire.encode(Arc::clone(&after));
    assert_eq!(sent["node"], "after", "{sent}");
    assert_eq!(
        sent["what"],
        "pass 2 of the first stage's four-step transform"
    );
    let children: Vec<_> = after.children().into_iter().cloned().collect();
    let bytes = sent.to_string();
    let back = ZarrCodec::default()
        .try_decode(bytes.as_bytes(), &children, &alone.task_ctx(), &CONVERTER)
        .unwrap();
    let show = |p: &Arc<dyn ExecutionPlan>| displayable(p.as_ref()).indent(true).to_string();
    assert_eq!(show(&back), show(&after));
    let err = wire.decode(&sent).expect_err("a round without its inputs");
    assert!(err.contains("has 2 inputs, got 0"), "{err}");
}

/// A four-step pass round trips through the codec (the same plan, the
/// same count of blocks run) and a malformed one is refused naming what is
/// wrong: a plan that does not fit the transform, a pass or tasks out of
/// range, a scratch store that is not a four-step one or is gone, one
/// whose intermediates are not what the plan makes, a transform or table
/// that changed; a worker whose allowed_mem cannot hold a block refuses
/// it with the numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_four_step_pass_round_trips_and_a_malformed_one_is_refused() {
    let dir = scratch("fft-four-step-codec");
    let (work, set_work) = own_work_dir(&dir);
    let ctx = new_context();
    for set in [
        set_work.as_str(),
        "SET zarrfusion.fft_strategy = 'four_step'",
    ] {
        ctx.sql(set).await.unwrap();
    }
    let cases = common::fft::cases();
    // Along lon (12 = 2 × 6 = 3 × 4): a line with more than one split.
    let case = cases.iter().find(|c| c["name"] == "lon_numpy").unwrap();
    let sql = format!("SELECT * FROM {}", common::fft::sql_call(case));
    let fft = planned_fft(&ctx, &sql).await;
    let fft = (fft
        .downcast_ref::<FftExec>()
        .unwrap()
        .on_cluster(&|rows| rows))
    .unwrap()
    .expect("a four-step path's passes");
    let passes: Vec<Arc<dyn ExecutionPlan>> = (fft.children().iter())
        .map(|gather| Arc::clone(gather.children()[0]))
        .collect();
    assert_eq!(passes.len(), 2);
    for pass in &passes {
        assert_round_trip(&ctx, pass).await;
    }
    let wire = Wire::new(&ctx);
    let sent = wire.encode(Arc::clone(&passes[0]));
    // A blockwise step whose kernel is the pass.
    assert_eq!(sent["node"], "blockwise", "{sent}");
    assert_eq!(sent["kernel"]["kernel"], "four_step_pass", "{sent}");
    wire.decode(&sent).expect("the pass as sent");
    let store = sent["kernel"]["work"].as_str().unwrap().to_string();
    assert_eq!(sent["step"]["into"]["location"], store.as_str(), "{sent}");
    wire.refuses(&sent, vec![("tasks", Value::from(0), "tasks")]);
    let step_changes: Vec<(&str, Value, &str)> = vec![
        (
            "into",
            serde_json::json!({"kind": "scratch", "location": store}),
            "not its intermediates",
        ),
        (
            "into",
            serde_json::json!({"kind": "intermediates", "location": dir.to_string_lossy()}),
            "writes its intermediates in",
        ),
        (
            "variables",
            serde_json::json!([["z", "Float64"]]),
            "and no variables",
        ),
    ];
    for (field, value, says) in step_changes {
        wire.refuses_changed(&sent, &|bad| bad["step"][field] = value.clone(), says);
    }
    let gone = work.join("zarrfusion-fft-four-step-gone.zarr");
    let cases: Vec<(&str, Value, &str)> = vec![
        ("pass", Value::from(2), "pass 3 of 2"),
        (
            "work",
            Value::from(dir.to_string_lossy()),
            "not a four-step transform",
        ),
        ("work", Value::from(gone.to_string_lossy()), "is gone"),
        (
            "transform",
            serde_json::json!(["fft", [["dims", "lat"]]]),
            "a four-step plan along dimension",
        ),
        (
            "transform",
            serde_json::json!(["fft", [["dims", "height"]]]),
            "unknown dimension 'height'",
        ),
        ("variable", Value::from("nothing"), "unknown variable"),
        ("columns", serde_json::json!([["x", "Int8"]]), "changed"),
    ];
    for (field, value, says) in cases {
        // Where the pass writes follows its store.
        let change = |bad: &mut Value| {
            bad["kernel"][field] = value.clone();
            if field == "work" {
                bad["step"]["into"]["location"] = value.clone();
            }
        };
        wire.refuses_changed(&sent, &change, says);
    }
    let plan = &sent["kernel"]["plan"];
    let (n1, n2) = (
        plan["columns"].as_u64().unwrap(),
        plan["rows"].as_u64().unwrap(),
    );
    let bad_plans: Vec<(&str, Value, &str)> = vec![
        ("columns", Value::from(n1 * n2), "splits a line"),
        ("rows", Value::from(n2 + 1), "splits a line"),
        ("column_block", Value::from(0), "do not divide"),
        ("row_block", Value::from(n2 + 1), "do not divide"),
        ("batch", serde_json::json!([1, 1]), "batches"),
        ("workers", serde_json::json!([0, 1]), "batches"),
    ];
    for (field, value, says) in bad_plans {
        let mut bad = sent.clone();
        bad["kernel"]["plan"][field] = value.clone();
        let err = wire
            .decode(&bad)
            .expect_err(&format!("plan {field} = {value} accepted"));
        assert!(err.contains(says), "plan {field} = {value}: {err}");
    }
    // Another split of the same line: the stored intermediates are not
    // what it makes.
    let other = (2..n1 * n2)
        .find(|&c| (n1 * n2) % c == 0 && c != n1)
        .expect("another split");
    let mut bad = sent.clone();
    bad["kernel"]["plan"]["columns"] = Value::from(other);
    bad["kernel"]["plan"]["rows"] = Value::from(n1 * n2 / other);
    for field in ["column_block", "row_block", "spectrum_rows"] {
        bad["kernel"]["plan"][field] = Value::from(1);
    }
    let err = wire.decode(&bad).expect_err("another split accepted");
    assert!(err.contains("is not the array its plan makes"), "{err}");
    // A worker whose allowed_mem cannot hold a block of the pass (half
    // of what the session's plan says one holds).
    let block = plan["task_memory"][0].as_u64().unwrap() as usize;
    let small = zarrfusion::new_context_with(session_config(), limited(block / 2));
    small.sql(&set_work).await.unwrap();
    let err = Wire::new(&small)
        .decode(&sent)
        .expect_err("a block over allowed_mem");
    assert!(err.contains("(1 block x"), "{err}");
    assert!(
        err.contains("per block: a block of its four-step pass 1"),
        "{err}"
    );
    assert!(err.contains("allowed_mem"), "{err}");
    assert!(std::path::Path::new(&store).is_dir(), "{store}");
    drop(fft);
    drop(passes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transform_round_trips_and_a_malformed_one_is_refused() {
    let cases = common::fft::cases();
    let ctx = new_context();
    ctx.sql("SET zarrfusion.target_partition_bytes = 2000")
        .await
        .unwrap();
    // Filters on a dimension not transformed choose the blocks read.
    let later = "WHERE time > TIMESTAMP '2020-01-01 00:00:00'";
    let queries = [
        ("lat_lon", later),
        ("window_detrend_f32", later),
        ("ifft_lag", ""),
        ("chain_lat_lon", ""),
    ];
    for (name, filter) in queries {
        let case = cases.iter().find(|c| c["name"] == name).unwrap();
        common::fft::create_views(&ctx, case).await;
        let sql = format!("SELECT * FROM {} {filter}", common::fft::sql_call(case));
        let fft = planned_fft(&ctx, &sql).await;
        // Whole, through the codec: the same plan and rows.
        assert_round_trip(&ctx, &fft).await;
    }
    let case = cases.iter().find(|c| c["name"] == "chain_lat_lon").unwrap();
    let sql = format!("SELECT * FROM {}", common::fft::sql_call(case));
    let fft = planned_fft(&ctx, &sql).await;
    let wire = Wire::new(&ctx);
    let sent = wire.encode(fft);
    assert_eq!(sent["transforms"].as_array().unwrap().len(), 2);
    wire.decode(&sent).expect("the transform as sent");
    let cases: Vec<(&str, Value, &str)> = vec![
        ("tasks", Value::from(0), "tasks"),
        ("partitions", Value::from(1u64 << 40), "partitions"),
        ("batch_size", Value::from(0), "batch_size"),
        ("transforms", serde_json::json!([]), "transforms"),
        (
            "transforms",
            serde_json::json!([["fft", [["dims", "lat"]]], ["fft", [["colour", "red"]]]]),
            "unknown option 'colour'",
        ),
        (
            "transforms",
            serde_json::json!([["rfft", [["dims", "lat"]]]]),
            "'rfft'",
        ),
        (
            "transforms",
            serde_json::json!([["fft", [["dims", "height"]]]]),
            "unknown dimension 'height'",
        ),
        ("variable", Value::from("nothing"), "unknown variable"),
        ("projection", serde_json::json!([0, 9]), "columns"),
        ("projection", serde_json::json!([]), "columns"),
        ("block_shape", serde_json::json!([1, 1, 1]), "cut its lines"),
        ("block_shape", serde_json::json!([0, 1, 1]), "blocks"),
        ("selection", serde_json::json!([[[5, 2]]]), "selection"),
        ("columns", serde_json::json!([["x", "Int8"]]), "changed"),
    ];
    wire.refuses(&sent, cases);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn anomalies_broadcast_their_small_side_to_the_workers_with_xarray_s_answers() {
    let workers = start_workers(2).await;
    let queries = common::expected_queries("anomaly_queries.json");
    assert!(queries.len() >= 5);
    for q in &queries {
        let (name, shown) = climate_oracle_through(&workers, &[], q).await;
        // The small side is a stage of its own, broadcast to the grid's
        // tasks, which read the grid on the workers: no hash join.
        assert!(
            shown.contains("NetworkBroadcastExec")
                && shown.contains("broadcast=[")
                && shown.contains("tasks=its stage's")
                && !shown.contains("HashJoinExec"),
            "{name}:\n{shown}"
        );
    }
}

/// A reduction reading a table joined in (an anomaly's zonal mean) merges
/// its states by group position too, in the session or in a tree, with
/// xarray's answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn anomalies_merge_their_states_by_group_position_in_the_session_or_a_tree() {
    let workers = start_workers(3).await;
    let queries = common::expected_queries("anomaly_queries.json");
    for merge in ["session", "tree"] {
        let setting = format!("SET zarrfusion.state_merge = '{merge}'");
        let mut by_position = 0;
        for q in &queries {
            let (name, shown) = climate_oracle_through(&workers, &[&setting], q).await;
            assert!(!shown.contains("FinalPartitioned"), "{name}:\n{shown}");
            // The grid's reduction, reading the broadcast.
            let joined = shown.lines().any(|l| {
                l.contains("DenseReductionExec")
                    && l.contains("broadcast=[")
                    && l.contains("emits=partial states by group position")
            });
            if joined {
                by_position += 1;
                let tree = shown.contains("a level of the merge tree");
                assert_eq!(tree, merge == "tree", "{name}:\n{shown}");
            }
        }
        assert!(
            by_position >= 3,
            "{by_position} anomalies merged by position"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scan_with_a_table_joined_in_round_trips_and_a_malformed_join_is_refused() {
    let ctx = new_context();
    ctx.register_zarr("t", &fixture("climate.zarr"), HashMap::new())
        .await
        .unwrap();
    let sql = "SELECT t.time, t.lat, t.lon, t.t2m - v.c AS a FROM t JOIN \
               (SELECT CAST(column1 AS REAL) AS lat, max(column2) AS c FROM \
               (VALUES (50, 1.0), (30, 2.5), (10, -1.0)) GROUP BY 1) v ON t.lat = v.lat \
               WHERE t.time < '2019-11-03'";
    let plan = physical_plan(&ctx, sql).await;
    let mut scans = Vec::new();
    find_scans(&plan, &mut scans);
    let scan = scans.remove(0);
    let shown = displayable(scan.as_ref()).indent(true).to_string();
    assert!(shown.contains("broadcast=[v by (lat: 6)"), "{shown}");
    // The scan and the small side's plan, its input, through the codec.
    assert_round_trip(&ctx, &scan).await;

    let wire = Wire::new(&ctx);
    let inputs: Vec<Arc<dyn ExecutionPlan>> = scan.children().into_iter().cloned().collect();
    let sent = wire.encode(Arc::clone(&scan));
    assert_eq!(sent["source"]["kind"], "joined", "{sent}");
    let decode = |sent: &Value, inputs: &[Arc<dyn ExecutionPlan>]| {
        wire.decode_with(&serde_json::to_vec(sent).unwrap(), inputs)
    };
    decode(&sent, &inputs).expect("the scan as sent");
    let err = decode(&sent, &[]).expect_err("no inputs accepted");
    assert!(err.contains("sent 0 inputs"), "{err}");
    let joined = |field: &str, value: Value| {
        let mut bad = sent.clone();
        bad["source"]["joined"][0][field] = value;
        bad
    };
    let mut cases = vec![
        (
            joined("values", serde_json::json!([7])),
            "no value column 7",
        ),
        (
            joined("values", serde_json::json!([1u64 << 40])),
            "column 1099511627776 of its small side",
        ),
        (
            joined(
                "fields",
                serde_json::json!([["c", "Float64"], ["matched", "Int8"]]),
            ),
            "matched",
        ),
        (
            joined(
                "dims",
                serde_json::json!([{"dim": 5, "keys": [], "columns": []}]),
            ),
            "dimension 5",
        ),
        (
            joined(
                "dims",
                serde_json::json!([{"dim": 1, "keys": ["%%"], "columns": [0]}]),
            ),
            "base64",
        ),
    ];
    let mut two_keys = sent.clone();
    two_keys["source"]["joined"][0]["dims"][0]["columns"] = serde_json::json!([0, 1]);
    cases.push((two_keys, "disagree"));
    for (bad, says) in cases {
        let err = decode(&bad, &inputs).expect_err(&format!("{bad} accepted"));
        assert!(err.contains(says), "{says}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reduction_by_functions_of_a_long_dimension_is_counted_by_its_keys_on_a_worker() {
    // 400,000 hours x 721 x 1440 (no chunk written: every cell the fill
    // value), grouped by a function of time with 4 keys: 4.2 M groups,
    // where the positions would make 415 G.
    let dir = metadata_only_store(
        "cluster-long-keys",
        [400000, 721, 1440],
        [1000, 73, 144],
        0.0,
    );
    let ctx = new_context();
    let path = dir.to_str().unwrap();
    ctx.register_zarr("big", path, HashMap::new())
        .await
        .unwrap();
    let plan = physical_plan(
        &ctx,
        "SELECT time / 100000 AS era, lat, lon, count(v) AS n FROM big GROUP BY 1, 2, 3",
    )
    .await;
    let reduction = first_node::<DenseReductionExec>(plan);
    let reduction = reduction.downcast_ref::<DenseReductionExec>().unwrap();
    let states = first_node::<DenseReductionExec>(reduction.on_cluster(2, false).unwrap());
    let wire = Wire::new(&ctx);
    let sent = wire.encode(states);
    wire.decode(&sent).expect("a reduction by 4 keys of time");
    // Grouped by time itself: 415 G groups, refused before any state.
    let mut by_time = sent.clone();
    by_time["groups"][0] = serde_json::json!({"dim": 0, "expr": null});
    let err = wire.decode(&by_time).expect_err("415 G groups accepted");
    assert!(err.contains("groups") && err.contains("exceed"), "{err}");
}

/// With one target partition DataFusion gathers nothing below a node that
/// needs all of its input, and a stage split into tasks there gave each
/// task's part of the answer; found by the differential fuzzer
/// (`differential.rs`), each query here failed through two workers: a
/// climatology broadcast into the grid whose states were merged task by
/// task (two rows for the same keys), a window total over whole partitions
/// whose small side is DataFusion's `Single` aggregate over a scan dealt to
/// two tasks (the same), and the means of groups without a value merged
/// from the tasks' states (NaN where SQL has NULL).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_target_partition_gives_one_machine_s_answers_through_two_workers() {
    let workers = start_workers(2).await;
    let cases: [(&str, &[&str]); 3] = [
        (
            "WITH clim AS (SELECT extract(month FROM time) AS k, lat, lon, avg(t2m) AS c FROM t \
             GROUP BY 1, 2, 3) SELECT t.time, t.lat, avg(t.t2m - clim.c) AS m FROM t JOIN clim \
             ON extract(month FROM t.time) = clim.k AND t.lat = clim.lat AND t.lon = clim.lon \
             GROUP BY 1, 2",
            &["SET zarrfusion.target_partition_bytes = 1024"],
        ),
        (
            "SELECT time, lat, avg(a) AS m FROM (SELECT time, lat, lon, t2m - avg(t2m) OVER \
             (PARTITION BY extract(month FROM time), lat, lon) AS a FROM t) GROUP BY 1, 2",
            &["SET zarrfusion.dense_state_bytes = 64"],
        ),
        (
            "SELECT date_bin(INTERVAL '12 hours', time) AS k, lat, lon, avg(t2m - 273.15) AS m, \
             count(t2m) AS n FROM t WHERE time >= '2019-12-15' GROUP BY 1, 2, 3",
            &[],
        ),
    ];
    let local = new_context();
    local
        .sql("SET zarrfusion.dense_reduction = false")
        .await
        .unwrap();
    local
        .register_zarr("t", &fixture("climate.zarr"), HashMap::new())
        .await
        .unwrap();
    for (sql, settings) in cases {
        let ctx = cluster_session(&workers).await;
        ctx.sql("SET datafusion.execution.target_partitions = 1")
            .await
            .unwrap();
        for setting in settings {
            ctx.sql(setting).await.unwrap();
        }
        ctx.register_zarr("t", &fixture("climate.zarr"), HashMap::new())
            .await
            .unwrap();
        let mut got = query_rows(&ctx, "through two workers", sql).await;
        let mut want = query_rows(&local, "one machine, no rule", sql).await;
        let keys = got.first().map_or(0, Vec::len);
        sort_rows(&mut got, keys);
        sort_rows(&mut want, keys);
        assert_rows(sql, &got, &want);
    }
}

/// A DataFusion window over a sort within partitions of a shuffle (the
/// rolling rule off) reads its whole input through the sort: its stage
/// keeps its tasks (`whole_input_tasks` looks below the nodes of one
/// input for the shuffle) and gives one machine's answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_over_a_sorted_shuffle_keeps_its_tasks() {
    let workers = start_workers(2).await;
    let ctx = cluster_session(&workers).await;
    for setting in [
        "SET datafusion.execution.target_partitions = 2",
        "SET zarrfusion.rolling_window = false",
        "SET zarrfusion.dense_reduction = false",
        "SET zarrfusion.bytes_per_task = 1",
        "SET zarrfusion.target_partition_bytes = 1024",
    ] {
        ctx.sql(setting).await.unwrap();
    }
    ctx.register_zarr("t", &fixture("climate.zarr"), HashMap::new())
        .await
        .unwrap();
    let sql = "SELECT lat, avg(m) AS m FROM (SELECT lat, avg(t2m) OVER (PARTITION BY lat, lon \
               ORDER BY time ROWS BETWEEN 3 PRECEDING AND CURRENT ROW) AS m FROM t) GROUP BY lat";
    let plan = physical_plan(&ctx, sql).await;
    let shown = datafusion_distributed::display_plan_ascii(plan.as_ref(), false);
    let stage = (shown.split("┌───── Stage"))
        .find(|stage| stage.contains("BoundedWindowAggExec"))
        .unwrap_or_else(|| panic!("no window in a stage: {shown}"));
    assert!(
        stage.contains("tasks=2")
            && stage.contains("SortExec")
            && stage.contains("NetworkShuffleExec"),
        "{shown}"
    );
    let local = new_context();
    local
        .register_zarr("t", &fixture("climate.zarr"), HashMap::new())
        .await
        .unwrap();
    let mut got = query_rows(&ctx, "through two workers", sql).await;
    let mut want = query_rows(&local, "one machine", sql).await;
    sort_rows(&mut got, 1);
    sort_rows(&mut want, 1);
    assert_rows(sql, &got, &want);
}

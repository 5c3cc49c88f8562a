//! Rolling windows along a dimension: which SQL windows become a
//! `RollingWindowExec`, their answers against xarray's `rolling`
//! (`tests/fixtures/expected/rolling_queries.json`, written by
//! `tests/fixtures/make_climate_fixture.py`), and DataFusion's own window
//! (the rule off) giving the same answers.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::{
    assert_rows, climate_session, error_text, expected_queries, explain_text, fixture, sort_rows,
    SMALL_BLOCKS,
};
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::prelude::SessionContext;
use serde_json::Value;
use zarrfusion::{new_context_with, session_config, ZarrContextExt};

/// A session with the rule on or off and `settings` run, `climate.zarr`
/// registered as `t`.
async fn session(rolling: bool, settings: &[&str]) -> SessionContext {
    climate_session("rolling_window", rolling, settings).await
}

async fn run(ctx: &SessionContext, sql: &str) -> Vec<Vec<Value>> {
    common::query_rows(ctx, "query", sql).await
}

fn rolling_queries() -> Vec<Value> {
    expected_queries("rolling_queries.json")
}

/// Whether the plan computes its windows with the rolling operator and
/// without DataFusion's window or sort.
fn rolled(plan: &str) -> bool {
    plan.contains("RollingWindowExec") && !plan.contains("WindowAggExec")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_windows_run_along_the_dimension_with_xarray_s_answers() {
    let queries = rolling_queries();
    assert!(queries.len() >= 6, "{} rolling queries", queries.len());
    for q in &queries {
        let (name, sql) = (q["name"].as_str().unwrap(), q["sql"].as_str().unwrap());
        let want: Vec<Vec<Value>> = serde_json::from_value(q["rows"].clone()).unwrap();
        assert!(want.len() >= 20, "{name}: {} expected rows", want.len());
        // Frames with no value at all give NULL, and some do.
        assert!(
            want.iter().any(|r| r[3..].iter().any(|v| v.is_null())) || !name.starts_with("running"),
            "{name}: the oracle has no empty frame"
        );
        for (on, settings) in [(true, &[][..]), (true, &SMALL_BLOCKS[..]), (false, &[][..])] {
            let ctx = session(on, settings).await;
            let plan = explain_text(&ctx, sql).await;
            assert_eq!(rolled(&plan), on, "{name} (rule {on}):\n{plan}");
            let got = run(&ctx, sql).await;
            assert_rows(&format!("{name} (rule {on}, {settings:?})"), &got, &want);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_block_s_overlap_comes_from_the_block_before_not_the_store() {
    let q = &rolling_queries()[0];
    let sql = q["sql"].as_str().unwrap();
    // One partition over blocks of one chunk: every frame but the first
    // reaches into the block before, which is kept, never read again.
    let settings = [
        "SET zarrfusion.target_partition_bytes = 1024",
        "SET datafusion.execution.target_partitions = 1",
    ];
    let ctx = session(true, &settings).await;
    let analyzed = explain_text(&ctx, &format!("ANALYZE {sql}")).await;
    assert!(analyzed.contains("RollingWindowExec"), "{analyzed}");
    assert!(analyzed.contains("halo_positions_read=0"), "{analyzed}");
    assert!(analyzed.contains("over [-3, +0]"), "{analyzed}");
    // Three partitions: the second and third read the 3 steps before their
    // first block (of each of the 2 longitudes' boxes... in one box).
    let ctx = session(
        true,
        &[
            settings[0],
            "SET datafusion.execution.target_partitions = 3",
        ],
    )
    .await;
    let analyzed = explain_text(&ctx, &format!("ANALYZE {sql}")).await;
    assert!(analyzed.contains("halo_positions_read=6"), "{analyzed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_windows_stay_datafusion_s_with_the_same_answers() {
    let cases = [
        // Partitioned by some of the other dimensions only.
        "SELECT time, lat, lon, avg(t2m) OVER (PARTITION BY lat ORDER BY time, lon \
         ROWS BETWEEN 2 PRECEDING AND CURRENT ROW) AS m FROM t WHERE lon = 0",
        // A filter on the values takes cells out of the frames.
        "SELECT time, lat, lon, avg(t2m) OVER (PARTITION BY lat, lon ORDER BY time \
         ROWS BETWEEN 2 PRECEDING AND CURRENT ROW) AS m FROM t WHERE t2m > 280 AND lon = 0",
        // Unbounded and RANGE frames, and the default frame.
        "SELECT time, lat, lon, sum(t2m) OVER (PARTITION BY lat, lon ORDER BY time \
         ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS s FROM t WHERE lon = 0",
        "SELECT time, lat, lon, sum(t2m) OVER (PARTITION BY lat, lon ORDER BY time) AS s \
         FROM t WHERE lon = 0",
        // Ordered by a variable; a ranking function.
        "SELECT time, lat, lon, max(t2m) OVER (PARTITION BY lat, lon ORDER BY u10 \
         ROWS BETWEEN 1 PRECEDING AND CURRENT ROW) AS m FROM t WHERE lon = 0",
        "SELECT time, lat, lon, row_number() OVER (PARTITION BY lat, lon ORDER BY time) AS r \
         FROM t WHERE lon = 0",
    ];
    let on = session(true, &[]).await;
    let off = session(false, &[]).await;
    for sql in cases {
        let plan = explain_text(&on, sql).await;
        assert!(!plan.contains("RollingWindowExec"), "{sql}:\n{plan}");
        if sql.contains("ORDER BY u10") {
            // Ties in u10 leave the frames' order to the sort.
            continue;
        }
        let mut got = run(&on, sql).await;
        let mut want = run(&off, sql).await;
        sort_rows(&mut got, 3);
        sort_rows(&mut want, 3);
        assert_rows(sql, &got, &want);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_that_cannot_fit_the_memory_limit_is_refused_with_the_numbers() {
    let runtime = RuntimeEnvBuilder::new()
        .with_memory_limit(16 * 1024, 1.0)
        .build()
        .unwrap();
    let ctx = new_context_with(session_config(), Arc::new(runtime));
    ctx.register_zarr("t", &fixture("climate.zarr"), HashMap::new())
        .await
        .unwrap();
    let sql = "SELECT time, lat, lon, avg(t2m) OVER (PARTITION BY lat, lon ORDER BY time \
               ROWS BETWEEN 23 PRECEDING AND CURRENT ROW) AS m FROM t";
    let error = error_text(&ctx, sql).await;
    for needle in [
        "RollingWindowExec over",
        "climate.zarr",
        "allowed_mem",
        "16.0 KB",
        "23 positions of overlap",
    ] {
        assert!(error.contains(needle), "{needle}: {error}");
    }
}

//! Joins of a Zarr table with a result over fewer of its dimensions
//! (anomalies): which become broadcast columns of the table, their answers
//! against xarray's broadcasting arithmetic
//! (`tests/fixtures/expected/anomaly_queries.json`, written by
//! `tests/fixtures/make_climate_fixture.py`), and DataFusion's hash join
//! (the rule off) giving the same answers.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;

use common::{
    assert_rows, climate_session, copied_back, error_text, expected_queries, explain_text, fixture,
    sort_rows, SMALL_BLOCKS,
};
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::prelude::SessionContext;
use serde_json::Value;
use zarrfusion::{new_context_with, session_config, ZarrContextExt};

/// A session with the rule on or off and `settings` run, `climate.zarr`
/// registered as `t`.
async fn session(on: bool, settings: &[&str]) -> SessionContext {
    climate_session("broadcast_join", on, settings).await
}

async fn run(ctx: &SessionContext, sql: &str) -> Vec<Vec<Value>> {
    common::query_rows(ctx, "query", sql).await
}

fn anomaly_queries() -> Vec<Value> {
    expected_queries("anomaly_queries.json")
}

/// Whether the plan reads the small side as broadcast columns, without a
/// hash join.
fn broadcast(plan: &str) -> bool {
    plan.contains("broadcast=[") && !plan.contains("HashJoinExec")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anomalies_broadcast_the_small_side_with_xarray_s_answers() {
    let queries = anomaly_queries();
    assert!(queries.len() >= 5, "{} anomaly queries", queries.len());
    for q in &queries {
        let (name, sql) = (q["name"].as_str().unwrap(), q["sql"].as_str().unwrap());
        let want: Vec<Vec<Value>> = serde_json::from_value(q["rows"].clone()).unwrap();
        for (on, settings) in [(true, &[][..]), (true, &SMALL_BLOCKS[..]), (false, &[][..])] {
            let ctx = session(on, settings).await;
            let plan = explain_text(&ctx, sql).await;
            assert_eq!(broadcast(&plan), on, "{name} (rule {on}):\n{plan}");
            if on && sql.contains("GROUP BY 1, 2 ORDER") {
                // The reduction above the join is dense, over the grid with
                // the broadcast columns.
                let dense = plan
                    .lines()
                    .find(|l| l.contains("DenseReductionExec: store"));
                assert!(
                    dense.is_some_and(|l| l.contains("broadcast=[")),
                    "{name}:\n{plan}"
                );
            }
            if on && name.starts_with("rolling_") {
                // Rolled along time over the grid with the broadcast
                // columns, not DataFusion's window over a join's rows.
                let rolling = (plan.lines()).find(|l| l.contains("RollingWindowExec: store"));
                assert!(
                    rolling.is_some_and(|l| l.contains("broadcast=["))
                        && !plan.contains("WindowAggExec"),
                    "{name}:\n{plan}"
                );
            }
            let got = run(&ctx, sql).await;
            assert_rows(&format!("{name} (rule {on}, {settings:?})"), &got, &want);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_shows_the_keys_and_the_small_side_runs_once_per_query() {
    let q = &anomaly_queries()[0];
    let sql = q["sql"].as_str().unwrap();
    let ctx = session(true, &[]).await;
    let plan = explain_text(&ctx, sql).await;
    // Keyed by the months of time (5 in the store), latitude and longitude.
    assert!(plan.contains("by (time: 5, lat: 6, lon: 6)"), "{plan}");
    // The climatology is the operator's child, itself a dense reduction.
    assert_eq!(
        plan.matches("DenseReductionExec: store").count(),
        2,
        "{plan}"
    );
    let analyzed = explain_text(&ctx, &format!("ANALYZE {sql}")).await;
    // The climatology's 180 groups are computed once for the 3 workers.
    assert!(analyzed.contains("output_rows=180"), "{analyzed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_joins_stay_datafusion_s_with_the_same_answers() {
    let cases = [
        // The other side may have several rows per key (not grouped by them).
        "SELECT t.time, t.lat, t.lon, t.t2m - x.c AS a FROM t JOIN \
         (SELECT lat, lon, u10 AS c FROM t WHERE time < '2019-11-02') x \
         ON t.lat = x.lat AND t.lon = x.lon WHERE t.time < '2019-11-02'",
        // Grouped by more than the keys.
        "SELECT t.time, t.lat, t.lon, x.c FROM t JOIN \
         (SELECT lat, lon, date_trunc('month', time) AS m, avg(t2m) AS c FROM t GROUP BY 1, 2, 3) x \
         ON t.lat = x.lat AND t.lon = x.lon WHERE t.time < '2019-11-02'",
        // A key that is a variable, not a dimension.
        "SELECT t.time, t.lat, t.lon, x.n FROM t JOIN \
         (SELECT lat AS v, count(*) AS n FROM t GROUP BY lat) x ON t.t2m = x.v",
        // A full join keeps the small side's rows too (with a filter on
        // the grid's side, DataFusion makes it a left join, which is
        // broadcast).
        "SELECT t.time, t.lat, t.lon, x.c FROM t FULL JOIN \
         (SELECT lat, lon, avg(t2m) AS c FROM t WHERE lat > 30 GROUP BY lat, lon) x \
         ON t.lat = x.lat AND t.lon = x.lon",
    ];
    let on = session(true, &[]).await;
    let off = session(false, &[]).await;
    for sql in cases {
        let plan = explain_text(&on, sql).await;
        assert!(!plan.contains("broadcast=["), "{sql}:\n{plan}");
        let mut got = run(&on, sql).await;
        let mut want = run(&off, sql).await;
        let width = got.first().map_or(0, Vec::len);
        sort_rows(&mut got, width);
        sort_rows(&mut want, width);
        assert_rows(sql, &got, &want);
    }
}

/// Window totals stacked on each other (four partitions, so four windows
/// one above the other) read each other's broadcast columns: a small side
/// holding a broadcast another operator holds too takes its values as they
/// are (computed again, they replaced what the other read: "read before it
/// is computed").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stacked_window_totals_are_broadcast_with_the_answers_of_datafusion_s_window() {
    let sql = "SELECT time, lat, lon, \
               t2m - avg(t2m) OVER (PARTITION BY extract(month FROM time), lat, lon) AS a, \
               max(u10) OVER (PARTITION BY lat, lon ORDER BY time \
                 ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING) AS hi, \
               t2m - avg(t2m) OVER (PARTITION BY time, lat) AS d, \
               count(*) OVER (PARTITION BY lat) AS n, \
               stddev(t2m) OVER (PARTITION BY lat) AS s FROM t WHERE lon >= 120";
    for settings in [&[][..], &SMALL_BLOCKS[..]] {
        let on = session(true, settings).await;
        let plan = explain_text(&on, sql).await;
        assert!(broadcast(&plan), "{plan}");
        for absent in ["WindowAggExec", "SortExec"] {
            assert!(!plan.contains(absent), "{absent}:\n{plan}");
        }
        assert!(plan.matches("partition_totals by").count() >= 4, "{plan}");
        let mut got = run(&on, sql).await;
        let mut want = run(&session(false, settings).await, sql).await;
        assert_eq!(want.len(), 608 * 6 * 4);
        sort_rows(&mut got, 3);
        sort_rows(&mut want, 3);
        assert_rows(&format!("stacked totals {settings:?}"), &got, &want);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn window_totals_that_are_not_a_broadcast_stay_datafusion_s_window() {
    let cases = [
        // Partitioned by a variable, or by nothing.
        "SELECT time, lat, lon, avg(t2m) OVER (PARTITION BY u10 > 0) AS m FROM t WHERE lon = 0",
        "SELECT time, lat, lon, avg(t2m) OVER () AS m FROM t WHERE lon = 0",
        // An aggregate the dense reduction does not compute, and a frame
        // short of the whole partition.
        "SELECT time, lat, lon, median(t2m) OVER (PARTITION BY lat, lon) AS m FROM t WHERE lon = 0",
        "SELECT time, lat, lon, avg(t2m) OVER (PARTITION BY lat ORDER BY time, lon \
         ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS m FROM t WHERE lon < 120",
    ];
    let on = session(true, &[]).await;
    let off = session(false, &[]).await;
    for sql in cases {
        let plan = explain_text(&on, sql).await;
        assert!(plan.contains("WindowAggExec"), "{sql}:\n{plan}");
        assert!(!plan.contains("partition_totals"), "{sql}:\n{plan}");
        let mut got = run(&on, sql).await;
        let mut want = run(&off, sql).await;
        sort_rows(&mut got, 3);
        sort_rows(&mut want, 3);
        assert_rows(sql, &got, &want);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_that_cannot_fit_the_memory_limit_is_refused_before_it_runs() {
    let ctx = common::budget_session(16 * 1024, "t", &fixture("climate.zarr")).await;
    let sql = anomaly_queries()[0]["sql"].as_str().unwrap().to_string();
    let error = error_text(&ctx, &sql).await;
    for needle in ["climate.zarr", "allowed_mem", "16.0 KB"] {
        assert!(error.contains(needle), "{needle}: {error}");
    }
}

/// An anomaly, and its running mean, written to Zarr chunk by chunk: the
/// copy runs the small side first and gathers it into each chunk's cells
/// (no hash join, no rows collected); read back, xarray's answers, in
/// whole chunks and small ones. An inner join that may leave cells out
/// writes its rows, the query's answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anomalies_copied_to_zarr_chunk_by_chunk_give_xarray_s_answers() {
    let dir = common::scratch("anomaly_copy");
    let copied = [
        "anomaly_of_each_cell_using",
        "anomaly_of_each_cell_window",
        "rolling_anomaly_day_mean",
        "rolling_anomaly_window_day_mean",
        "rolling_left_join_sum",
    ];
    let queries = anomaly_queries();
    for name in copied {
        let q = (queries.iter())
            .find(|q| q["name"] == name)
            .unwrap_or_else(|| panic!("no oracle query {name}"));
        let sql = q["sql"].as_str().unwrap();
        let mut want: Vec<Vec<Value>> = serde_json::from_value(q["rows"].clone()).unwrap();
        // The query without its final ORDER BY (the store is a grid).
        let query = match sql.rsplit_once(" ORDER BY ") {
            Some((query, order)) if !order.contains(')') => query,
            _ => sql,
        };
        for (i, settings) in [&[][..], &SMALL_BLOCKS[..]].into_iter().enumerate() {
            let ctx = session(true, settings).await;
            let out = dir.join(format!("{name}{i}.zarr"));
            let (plan, mut got) = copied_back(&ctx, query, &out, &format!("{name}{i}")).await;
            let writer = (plan.lines()).find(|l| l.contains("SelectionCopyExec: store"));
            assert!(
                writer.is_some_and(|l| l.contains("broadcast=["))
                    && !plan.contains("HashJoinExec")
                    && !plan.contains("DataSinkExec"),
                "{name}:\n{plan}"
            );
            if name.starts_with("rolling_") {
                assert!(plan.contains("rolled along"), "{name}:\n{plan}");
            }
            sort_rows(&mut got, 3);
            sort_rows(&mut want, 3);
            assert_rows(&format!("{name} copied ({settings:?})"), &got, &want);
        }
    }
    // The anomalies of some cells against a climatology of every cell
    // (the grid cut further than the climatology: a filter on the grid's
    // longitudes, which the join's keys also carry to the climatology,
    // and one on its times): every cell meets its row, so they are
    // written chunk by chunk, the rows of DataFusion's hash join.
    let query = "SELECT t.time, t.lat, t.lon, t.t2m - w.c AS a FROM t JOIN \
                 (SELECT extract(month FROM time) AS month, lat AS clat, lon AS clon, \
                 avg(t2m) AS c FROM t GROUP BY 1, 2, 3) w \
                 ON extract(month FROM t.time) = w.month AND t.lat = w.clat AND t.lon = w.clon \
                 WHERE t.lon BETWEEN 100 AND 200 AND t.time < '2019-12-15'";
    let ctx = session(true, &[]).await;
    let out = dir.join("some_cells.zarr");
    let (plan, mut got) = copied_back(&ctx, query, &out, "some_cells").await;
    assert!(
        plan.contains("SelectionCopyExec: store") && !plan.contains("HashJoinExec"),
        "{plan}"
    );
    let mut want = run(&session(false, &[]).await, query).await;
    assert!(want.len() >= 100, "{} rows", want.len());
    sort_rows(&mut want, 3);
    sort_rows(&mut got, 3);
    assert_rows("anomalies of some cells, copied", &got, &want);
    // A climatology of some cells only: the inner join leaves the others
    // out, so the rows are written (a grid of the cells kept).
    let query = "SELECT t.time, t.lat, t.lon, t.t2m - w.c AS a FROM t JOIN \
                 (SELECT extract(month FROM time) AS month, lat AS clat, lon AS clon, \
                 avg(t2m) AS c FROM t WHERE lat >= 30 GROUP BY 1, 2, 3) w \
                 ON extract(month FROM t.time) = w.month AND t.lat = w.clat AND t.lon = w.clon \
                 WHERE t.time < '2019-11-03'";
    let ctx = session(true, &[]).await;
    let out = dir.join("matched.zarr");
    let copy = format!("COPY ({query}) TO '{}' STORED AS ZARR", out.display());
    let plan = explain_text(&ctx, &copy).await;
    assert!(!plan.contains("SelectionCopyExec"), "{plan}");
    ctx.sql(&copy).await.unwrap().collect().await.unwrap();
    ctx.register_zarr("matched", out.to_str().unwrap(), HashMap::new())
        .await
        .unwrap();
    let mut want = run(&ctx, query).await;
    let mut got = run(&ctx, "SELECT time, lat, lon, a FROM matched").await;
    assert!(want.len() >= 100, "{} rows", want.len());
    sort_rows(&mut want, 3);
    sort_rows(&mut got, 3);
    assert_rows("an inner join leaving cells out, copied", &got, &want);
}

/// A copy of an anomaly holds the climatology beside its tasks and writes
/// chunk by chunk: in 8 MB it writes the anomaly of the demo grid (202,752
/// cells, two variables), whose rows the rows path cannot hold; its cells
/// read back are those of DataFusion's hash join (no budget); in 6 MB the
/// tasks do not fit beside the climatology and it is refused before it
/// runs, with the numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_of_an_anomaly_fits_a_budget_its_rows_do_not() {
    let dir = common::scratch("anomaly_copy_budget");
    let demo = common::repo_root().join("demo/era5.zarr");
    let demo = demo.to_str().unwrap();
    let limited = |bytes: usize| {
        let runtime = RuntimeEnvBuilder::new()
            .with_memory_limit(bytes, 1.0)
            .build()
            .unwrap();
        new_context_with(session_config(), Arc::new(runtime))
    };
    let query = "SELECT e.time, e.lat, e.lon, e.t2m - m.c AS a, e.sp - m.p AS b FROM era5 e \
                 JOIN (SELECT lat, lon, avg(t2m) AS c, avg(sp) AS p FROM era5 GROUP BY lat, lon) m \
                 ON e.lat = m.lat AND e.lon = m.lon";
    let (two, one, refused) = (limited(8 << 20), limited(6 << 20), limited(3 << 20));
    for ctx in [&two, &one, &refused] {
        ctx.register_zarr("era5", demo, HashMap::new())
            .await
            .unwrap();
    }
    let out = dir.join("anomaly.zarr");
    let copy = format!("COPY ({query}) TO '{}' STORED AS ZARR", out.display());
    let error = error_text(&refused, &copy).await;
    for needle in [
        "SelectionCopyExec over",
        "era5.zarr",
        "allowed_mem",
        "of tables joined in",
    ] {
        assert!(error.contains(needle), "{needle}: {error}");
    }
    assert!(!out.exists(), "{}", out.display());
    // Two tasks fit in 8 MB; in 6 MB one does, and the copy runs on one
    // worker rather than being refused.
    let plan = explain_text(&two, &copy).await;
    assert!(plan.contains("2 workers"), "{plan}");
    let plan = explain_text(&one, &copy).await;
    assert!(
        plan.contains("broadcast=[m by (lat: 33, lon: 64)") && plan.contains("1 workers"),
        "{plan}"
    );
    one.sql(&copy).await.unwrap().collect().await.unwrap();
    // The same rows through DataFusion's sink (a value filter keeps the
    // copy's rule away) do not fit.
    let rows = format!(
        "COPY (SELECT * FROM ({query}) WHERE a > -1000) TO '{}' STORED AS ZARR",
        dir.join("rows.zarr").display()
    );
    let error = error_text(&one, &rows).await;
    assert!(error.contains("allowed_mem"), "{error}");
    // Every cell, against the hash join.
    let free = session(false, &[]).await;
    free.register_zarr("era5", demo, HashMap::new())
        .await
        .unwrap();
    free.register_zarr("c", out.to_str().unwrap(), HashMap::new())
        .await
        .unwrap();
    let plan = explain_text(&free, query).await;
    assert!(plan.contains("HashJoinExec"), "{plan}");
    let mut want = run(&free, query).await;
    let mut got = run(&free, "SELECT time, lat, lon, a, b FROM c").await;
    assert_eq!(got.len(), 96 * 33 * 64);
    sort_rows(&mut want, 3);
    sort_rows(&mut got, 3);
    assert_rows("the anomaly copied", &got, &want);
}

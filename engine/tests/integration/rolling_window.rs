//! Rolling windows along a dimension: which SQL windows become a
//! `RollingWindowExec`, their answers against xarray's `rolling`
//! (`tests/fixtures/expected/rolling_queries.json`, written by
//! `tests/fixtures/make_climate_fixture.py`), and DataFusion's own window
//! (the rule off) giving the same answers.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;

use common::{
    assert_rows, budget_session, climate_session, copied_back, error_text, expected_queries,
    explain_text, fixture, sort_rows, SMALL_BLOCKS,
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

/// Runs the oracle query `name` over blocks of one chunk (13 along time,
/// in one column) in one partition, whose `EXPLAIN ANALYZE` must show
/// `needles` and nothing read twice, then in three partitions cutting the
/// column (blocks 0..4, 4..8, 8..13 of 50 steps, 608 in all), which must
/// read `prefix` positions outside their runs; xarray's answer both times.
async fn prefix_reads(name: &str, needles: &[&str], prefix: usize) {
    let queries = rolling_queries();
    let q = queries.iter().find(|q| q["name"] == name).unwrap();
    let sql = q["sql"].as_str().unwrap();
    let want: Vec<Vec<Value>> = serde_json::from_value(q["rows"].clone()).unwrap();
    let blocks = "SET zarrfusion.target_partition_bytes = 1024";
    for (partitions, read) in [(1, 0), (3, prefix)] {
        let setting = format!("SET datafusion.execution.target_partitions = {partitions}");
        let ctx = session(true, &[blocks, &setting]).await;
        let analyzed = explain_text(&ctx, &format!("ANALYZE {sql}")).await;
        let shown = [
            format!("partitions={partitions}"),
            format!("prefix_positions_read={read}"),
        ];
        for needle in needles
            .iter()
            .copied()
            .chain(shown.iter().map(String::as_str))
        {
            assert!(analyzed.contains(needle), "{name}, {needle}:\n{analyzed}");
        }
        let context = format!("{name} in {partitions} partitions");
        assert_rows(&context, &run(&ctx, sql).await, &want);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_total_reads_each_block_once_unless_its_series_is_cut() {
    // One partition carries the totals from block to block; cut in three,
    // the second and third first add the 200 and 400 steps before them.
    prefix_reads("cumulative_default_frame", &["over [unbounded, +0]"], 600).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_total_to_the_series_end_walks_it_from_there_reading_each_block_once() {
    // Walked from the last block, one partition carries the totals back
    // from block to block; cut in three, the first and second first add
    // the 408 and 208 steps after them, from the end.
    let needles = [
        "along=time from its end",
        "over [+0, unbounded]",
        "over [+2, unbounded]",
    ];
    prefix_reads("remaining_totals", &needles, 616).await;
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
        // RANGE frames whose distances are not the same positions
        // everywhere: over two runs of time (values a day apart across the
        // gap are not 4 steps apart), along the float latitude, in months.
        "SELECT time, lat, lon, max(t2m) OVER (PARTITION BY lat, lon ORDER BY time \
         RANGE BETWEEN INTERVAL '1 day' PRECEDING AND CURRENT ROW) AS m FROM t \
         WHERE (time < '2019-11-04' OR time >= '2020-03-29') AND lon = 0",
        "SELECT time, lat, lon, avg(t2m) OVER (PARTITION BY time, lon ORDER BY lat \
         RANGE BETWEEN 10 PRECEDING AND CURRENT ROW) AS m FROM t WHERE time < '2019-11-03'",
        "SELECT time, lat, lon, avg(t2m) OVER (PARTITION BY lat, lon ORDER BY time \
         RANGE BETWEEN INTERVAL '1 month' PRECEDING AND CURRENT ROW) AS m FROM t WHERE lon = 0",
        // One window with frames from the series' start beside frames to
        // its end (no one walk computes both; frames over whole series are
        // broadcast totals: broadcast_join.rs).
        "SELECT time, lat, lon, sum(t2m) OVER (PARTITION BY lat, lon ORDER BY time) AS so_far, \
         sum(t2m) OVER (PARTITION BY lat, lon ORDER BY time DESC) AS to_come \
         FROM t WHERE lon = 0",
        // From a distance to the end across two runs of time.
        "SELECT time, lat, lon, sum(t2m) OVER (PARTITION BY lat, lon ORDER BY time \
         RANGE BETWEEN INTERVAL '1 day' FOLLOWING AND UNBOUNDED FOLLOWING) AS s FROM t \
         WHERE (time < '2019-11-04' OR time >= '2020-03-29') AND lon = 0",
        // From the start to a distance across two runs of time.
        "SELECT time, lat, lon, sum(t2m) OVER (PARTITION BY lat, lon ORDER BY time \
         RANGE BETWEEN UNBOUNDED PRECEDING AND INTERVAL '1 day' FOLLOWING) AS s FROM t \
         WHERE (time < '2019-11-04' OR time >= '2020-03-29') AND lon = 0",
        // Ordered by a variable; a ranking function.
        "SELECT time, lat, lon, max(t2m) OVER (PARTITION BY lat, lon ORDER BY u10 \
         ROWS BETWEEN 1 PRECEDING AND CURRENT ROW) AS m FROM t WHERE lon = 0",
        "SELECT time, lat, lon, row_number() OVER (PARTITION BY lat, lon ORDER BY time) AS r \
         FROM t WHERE lon = 0",
    ];
    let on = session(true, &[]).await;
    let off = session(false, &[]).await;
    for sql in cases {
        // DataFusion's window computes them (the mixed window's frames to
        // the end are rolled below it, in a window of their own).
        let plan = explain_text(&on, sql).await;
        assert!(plan.contains("WindowAggExec"), "{sql}:\n{plan}");
        let rolled_below = sql.contains("so_far");
        assert_eq!(
            plan.contains("RollingWindowExec"),
            rolled_below,
            "{sql}:\n{plan}"
        );
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

/// Under a budget its first blocks and partitions do not fit, a window
/// holds less until it does (here blocks of one chunk, 50 steps, in one
/// partition), and gives the answers of DataFusion's window without a
/// budget, and xarray's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_fits_its_blocks_and_partitions_to_a_small_budget() {
    let ctx = budget_session(256 * 1024, "t", &fixture("climate.zarr")).await;
    let sql = "SELECT time, lat, lon, avg(t2m) OVER w AS m, count(t2m) OVER w AS n, \
               max(u10) OVER w AS hi FROM t WINDOW w AS (PARTITION BY lat, lon ORDER BY time \
               ROWS BETWEEN 23 PRECEDING AND CURRENT ROW)";
    // Without a budget: blocks of several chunks in two partitions.
    let free = explain_text(&session(true, &[]).await, sql).await;
    assert!(rolled(&free), "{free}");
    assert!(!free.contains("of shape [50, 4, 4]"), "{free}");
    assert!(free.contains("partitions=2"), "{free}");
    let plan = explain_text(&ctx, sql).await;
    assert!(rolled(&plan), "{plan}");
    assert!(plan.contains("of shape [50, 4, 4]"), "{plan}");
    assert!(plan.contains("partitions=1"), "{plan}");
    let mut got = run(&ctx, sql).await;
    let mut want = run(&session(false, &[]).await, sql).await;
    assert_eq!(got.len(), 608 * 36);
    sort_rows(&mut got, 3);
    sort_rows(&mut want, 3);
    assert_rows("under 256 KB", &got, &want);
    // xarray's answers, the rows sorted here (a sort of its own would not
    // fit the budget).
    for q in &rolling_queries() {
        let (name, sql) = (q["name"].as_str().unwrap(), q["sql"].as_str().unwrap());
        let unsorted = sql.trim_end_matches(" ORDER BY time, lat, lon");
        assert_ne!(unsorted, sql, "{name}");
        let mut want: Vec<Vec<Value>> = serde_json::from_value(q["rows"].clone()).unwrap();
        let plan = explain_text(&ctx, unsorted).await;
        assert!(rolled(&plan), "{name}:\n{plan}");
        let mut got = run(&ctx, unsorted).await;
        sort_rows(&mut got, 3);
        sort_rows(&mut want, 3);
        assert_rows(&format!("{name} (256 KB)"), &got, &want);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_that_cannot_fit_the_memory_limit_is_refused_with_the_numbers() {
    let ctx = budget_session(16 * 1024, "t", &fixture("climate.zarr")).await;
    let sql = "SELECT time, lat, lon, avg(t2m) OVER (PARTITION BY lat, lon ORDER BY time \
               ROWS BETWEEN 23 PRECEDING AND CURRENT ROW) AS m FROM t";
    let error = error_text(&ctx, sql).await;
    for needle in [
        "RollingWindowExec over",
        "climate.zarr",
        "allowed_mem",
        "16.0 KB",
        "23 positions of overlap",
        // The least it can hold: blocks of one chunk in one partition.
        "(1 partition x",
        "blocks of shape [50, 4, 4]",
    ] {
        assert!(error.contains(needle), "{needle}: {error}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_windows_copied_to_zarr_chunk_by_chunk_give_xarray_s_answers() {
    let dir = common::scratch("rolling_copy");
    let mut copies = 0;
    for q in &rolling_queries() {
        let (name, sql) = (q["name"].as_str().unwrap(), q["sql"].as_str().unwrap());
        let want: Vec<Vec<Value>> = serde_json::from_value(q["rows"].clone()).unwrap();
        let query = sql
            .strip_suffix(" ORDER BY time, lat, lon")
            .unwrap_or_else(|| panic!("{name}: {sql}"));
        for (i, settings) in [&[][..], &SMALL_BLOCKS[..]].into_iter().enumerate() {
            let ctx = session(true, settings).await;
            let out = dir.join(format!("{name}{i}.zarr"));
            let (plan, got) = copied_back(&ctx, query, &out, &format!("{name}{i}")).await;
            // Written chunk by chunk by the rolling operator, not collected.
            assert!(plan.contains("RollingCopy"), "{name}:\n{plan}");
            assert!(
                plan.contains("SelectionCopyExec") && plan.contains("rolled along"),
                "{name}:\n{plan}"
            );
            // Chunks of whole target chunks (5 steps): no intermediate store.
            assert!(
                plan.contains("written straight into the target's chunks"),
                "{name}:\n{plan}"
            );
            assert_rows(&format!("{name} copied ({settings:?})"), &got, &want);
            // Again in the default chunks (the whole selection along time,
            // longer than the small blocks: before, such a chunk's boxes
            // overflowed the writer's rings, an internal error), its
            // writers report the windows' cells they read (every selected
            // cell at least once, of a 4-byte variable at least) and the
            // chunks written, as the store's metadata sizes them.
            let again = dir.join(format!("{name}{i}_again.zarr"));
            let copy = format!("COPY ({query}) TO '{}' STORED AS ZARR", again.display());
            let counters = ["bytes_read", "bytes_written"];
            let ([read, written], shown) =
                common::executed_counters(&ctx, &copy, "SelectionCopyExec", counters).await;
            let schema = ctx.sql(query).await.unwrap().schema().clone();
            let names: Vec<&str> = (schema.fields().iter().skip(3))
                .map(|f| f.name().as_str())
                .collect();
            let cells = got.len() as u64;
            assert!(read >= cells * 4, "{name}: {shown}");
            assert_eq!(
                written,
                common::stored_bytes(&again, &names),
                "{name}: {shown}"
            );
            let table = format!("{name}{i}_again");
            (ctx.register_zarr(&table, again.to_str().unwrap(), HashMap::new())
                .await)
                .unwrap();
            let read_back = format!(
                "SELECT time, lat, lon, {} FROM {table} ORDER BY time, lat, lon",
                names.join(", ")
            );
            let got = common::query_rows(&ctx, "read back", &read_back).await;
            assert_rows(
                &format!("{name} in its own chunks ({settings:?})"),
                &got,
                &want,
            );
            copies += 1;
        }
    }
    assert!(copies >= 12, "{copies} copies");
}

/// A rolling window over `rechunk(...)` is the rolling operator over the
/// rechunked store, under the `RechunkExec` that copies what it reads
/// first (the rechunk and rolling primitives composed, as a dense
/// reduction of `rechunk(...)` is; before, DataFusion's window sorted the
/// rechunked scan's rows): every oracle query in chunks of 7, 2 and 3
/// along time, latitude and longitude, in whole blocks and small ones,
/// gives xarray's answer, and nothing is left in `work_dir`. A COPY of one
/// rolls the store as it is stored, chunk by chunk, and writes the
/// rechunk's chunks (the COPY's own where it names them); so does a COPY
/// of a selection or of the whole table of `rechunk(...)`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_windows_over_rechunk_roll_the_rechunked_store_with_xarray_s_answers() {
    let dir = common::scratch("rolling_rechunk");
    let work = dir.join("work");
    std::fs::create_dir_all(&work).unwrap();
    let set_work = format!("SET zarrfusion.work_dir = '{}'", work.display());
    let rechunked = " FROM rechunk('t', time => 7, lat => 2, lon => 3) AS t ";
    let queries = rolling_queries();
    for q in &queries {
        let name = q["name"].as_str().unwrap();
        let sql = q["sql"].as_str().unwrap().replace(" FROM t ", rechunked);
        assert!(sql.contains("rechunk("), "{name}: {sql}");
        let want: Vec<Vec<Value>> = serde_json::from_value(q["rows"].clone()).unwrap();
        let small: Vec<&str> = SMALL_BLOCKS
            .into_iter()
            .chain([set_work.as_str()])
            .collect();
        for settings in [&[set_work.as_str()][..], &small[..]] {
            let ctx = session(true, settings).await;
            let plan = explain_text(&ctx, &sql).await;
            assert!(
                rolled(&plan) && plan.contains("RechunkExec") && plan.contains("rechunked=["),
                "{name} ({settings:?}):\n{plan}"
            );
            let got = run(&ctx, &sql).await;
            assert_rows(&format!("{name} over rechunk ({settings:?})"), &got, &want);
        }
    }
    // Copied to Zarr: the same values read back.
    let q = &queries[0];
    let (name, sql) = (q["name"].as_str().unwrap(), q["sql"].as_str().unwrap());
    let want: Vec<Vec<Value>> = serde_json::from_value(q["rows"].clone()).unwrap();
    let query = (sql.replace(" FROM t ", rechunked))
        .strip_suffix(" ORDER BY time, lat, lon")
        .unwrap()
        .to_string();
    let ctx = session(true, &[set_work.as_str()]).await;
    let chunks_of = |store: &std::path::Path, array: &str| -> Vec<u64> {
        let meta = std::fs::read(store.join(array).join("zarr.json")).unwrap();
        let meta: Value = serde_json::from_slice(&meta).unwrap();
        serde_json::from_value(meta["chunk_grid"]["configuration"]["chunk_shape"].clone()).unwrap()
    };
    // (The query's grid is one latitude and two longitudes.)
    for (options, chunks) in [("", [7, 1, 2]), (" OPTIONS ('chunks' 'time=5')", [5, 1, 2])] {
        let out = dir.join(format!("copied{}.zarr", chunks[0]));
        let copy = format!(
            "COPY ({query}) TO '{}' STORED AS ZARR{options}",
            out.display()
        );
        let plan = explain_text(&ctx, &copy).await;
        assert!(
            plan.contains("rolled along time") && !plan.contains("RechunkExec"),
            "{plan}"
        );
        ctx.sql(&copy).await.unwrap().collect().await.unwrap();
        let copied = format!("copied{}", chunks[0]);
        ctx.register_zarr(&copied, out.to_str().unwrap(), HashMap::new())
            .await
            .unwrap();
        let read = format!("SELECT time, lat, lon, m, n, hi FROM {copied} ORDER BY time, lat, lon");
        assert_rows(&format!("{name} copied"), &run(&ctx, &read).await, &want);
        for array in ["m", "n", "hi"] {
            assert_eq!(chunks_of(&out, array), chunks, "{array}{options}");
        }
    }
    // A selection and the whole table of `rechunk(...)`, copied: the
    // source's values in the rechunk's chunks, one copy.
    let filtered = "SELECT time, lat, lon, t2m * 2 AS d FROM t WHERE lat > 0";
    for (select, array) in [("SELECT * FROM t", "t2m"), (filtered, "d")] {
        let out = dir.join(format!("{array}.zarr"));
        let copy = format!(
            "COPY ({}) TO '{}' STORED AS ZARR",
            select.replace(" FROM t", rechunked.trim_end()),
            out.display()
        );
        let plan = explain_text(&ctx, &copy).await;
        assert!(
            !plan.contains("RechunkExec") && !plan.contains("ZarrSink"),
            "{plan}"
        );
        ctx.sql(&copy).await.unwrap().collect().await.unwrap();
        assert_eq!(chunks_of(&out, array), [7, 2, 3], "{select}");
        ctx.register_zarr(array, out.to_str().unwrap(), HashMap::new())
            .await
            .unwrap();
        let (got, want) = match array {
            "t2m" => (
                run(
                    &ctx,
                    "SELECT time, lat, lon, t2m FROM t2m ORDER BY time, lat, lon",
                )
                .await,
                run(
                    &ctx,
                    "SELECT time, lat, lon, t2m FROM t ORDER BY time, lat, lon",
                )
                .await,
            ),
            _ => (
                run(&ctx, "SELECT * FROM d ORDER BY time, lat, lon").await,
                run(&ctx, &format!("{filtered} ORDER BY time, lat, lon")).await,
            ),
        };
        assert_rows(&format!("{select} copied"), &got, &want);
    }
    let left: Vec<_> = std::fs::read_dir(&work).unwrap().collect();
    assert!(left.is_empty(), "left in work_dir: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_of_rolling_windows_fits_a_budget_its_rows_do_not() {
    let dir = common::scratch("rolling_copy_budget");
    let demo = common::repo_root().join("demo/era5.zarr");
    let demo = demo.to_str().unwrap();
    // 6 MB: the 202,752 rows of the demo grid collected need 7.3 MB.
    let runtime = RuntimeEnvBuilder::new()
        .with_memory_limit(6 << 20, 1.0)
        .build()
        .unwrap();
    let ctx = new_context_with(session_config(), Arc::new(runtime));
    for setting in [
        "SET zarrfusion.target_partition_bytes = 65536",
        "SET datafusion.execution.target_partitions = 1",
        "SET datafusion.execution.batch_size = 1024",
    ] {
        ctx.sql(setting).await.unwrap().collect().await.unwrap();
    }
    ctx.register_zarr("era5", demo, HashMap::new())
        .await
        .unwrap();
    let query =
        "SELECT time, lat, lon, t2m, avg(t2m) OVER w AS m, count(t2m) OVER w AS n FROM era5 \
                 WINDOW w AS (PARTITION BY lat, lon ORDER BY time ROWS BETWEEN 23 PRECEDING AND \
                 CURRENT ROW)";
    let out = dir.join("all.zarr");
    let copy = format!("COPY ({query}) TO '{}' STORED AS ZARR", out.display());
    let plan = explain_text(&ctx, &copy).await;
    // 6 MB cannot hold a writer encoding the target's chunks itself: the
    // chunks go through an intermediate store and the rechunk.
    assert!(plan.contains("rolled along time"), "{plan}");
    assert!(plan.contains("-> rechunk to"), "{plan}");
    ctx.sql(&copy).await.unwrap().collect().await.unwrap();
    // The same rows through DataFusion's sink (a value filter keeps the
    // window from the copy's rule) do not fit.
    let rows = format!(
        "COPY (SELECT * FROM ({query}) WHERE n >= 0) TO '{}' STORED AS ZARR",
        dir.join("rows.zarr").display()
    );
    let error = error_text(&ctx, &rows).await;
    assert!(error.contains("allowed_mem"), "{error}");
    // Every cell, against the window itself (no budget).
    let free = new_context_with(
        session_config(),
        Arc::new(RuntimeEnvBuilder::new().build().unwrap()),
    );
    free.register_zarr("era5", demo, HashMap::new())
        .await
        .unwrap();
    free.register_zarr("c", out.to_str().unwrap(), HashMap::new())
        .await
        .unwrap();
    let got = run(
        &free,
        "SELECT time, lat, lon, t2m, m, n FROM c ORDER BY time, lat, lon",
    )
    .await;
    let want = run(&free, &format!("{query} ORDER BY time, lat, lon")).await;
    assert_eq!(got.len(), 96 * 33 * 64);
    assert_rows("the demo grid copied under 6 MB", &got, &want);
}

//! The dense reduction rule: which queries it plans as a `DenseReduction`,
//! which it leaves to DataFusion, and that both give the same answers.
//! (The answers themselves are checked against pandas in `fixtures.rs`,
//! with the rule on and off.)

use crate::common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use common::{assert_rows, explain_text, fixture, repo_root, sort_rows};
use datafusion::execution::runtime_env::{RuntimeEnv, RuntimeEnvBuilder};
use datafusion::prelude::SessionContext;
use serde_json::Value;
use zarrfusion::{
    new_context, new_context_with, session_config, ZarrContextExt, ZarrDataset, ZarrTableOptions,
};

async fn context(store: &str, dense: bool, pushdown: bool) -> SessionContext {
    let ctx = new_context();
    if !dense {
        ctx.sql("SET zarrfusion.dense_reduction = false")
            .await
            .unwrap();
    }
    let mut options = HashMap::new();
    if !pushdown {
        options.insert("pushdown".to_string(), "false".to_string());
    }
    ctx.register_zarr("t", &fixture(store), options)
        .await
        .unwrap();
    ctx
}

/// A session with the dense rule on or off, `settings` run, and `store`
/// registered as `name`.
async fn session(name: &str, store: &Path, dense: bool, settings: &[&str]) -> SessionContext {
    let ctx = new_context();
    ctx.sql(&format!("SET zarrfusion.dense_reduction = {dense}"))
        .await
        .unwrap();
    for setting in settings {
        ctx.sql(setting).await.unwrap();
    }
    ctx.register_zarr(name, store.to_str().unwrap(), HashMap::new())
        .await
        .unwrap();
    ctx
}

async fn run(ctx: &SessionContext, sql: &str) -> Vec<Vec<Value>> {
    common::query_rows(ctx, "query", sql).await
}

/// The reductions of `tests/fixtures/expected/queries.json` (SQL over a
/// fixture registered as `t`, and pandas' rows).
fn reduction_queries() -> Vec<Value> {
    let path = repo_root().join("tests/fixtures/expected/queries.json");
    let queries: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    (queries.into_iter())
        .filter(|q| {
            let name = q["name"].as_str().unwrap();
            name.starts_with("reduce_") || name.starts_with("group_by_lat")
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_by_dimensions_is_planned_as_a_dense_reduction() {
    let mut checked = 0;
    for q in &reduction_queries() {
        let name = q["name"].as_str().unwrap();
        let store = q["store"].as_str().unwrap();
        let sql = q["sql"].as_str().unwrap();
        for pushdown in [true, false] {
            let dense = explain_text(&context(store, true, pushdown).await, sql).await;
            assert!(
                dense.contains("DenseReductionExec") && !dense.contains("AggregateExec"),
                "{name} (pushdown={pushdown}) should be a dense reduction:\n{dense}"
            );
            let hashed = explain_text(&context(store, false, pushdown).await, sql).await;
            assert!(
                !hashed.contains("DenseReductionExec"),
                "{name}: the rule is off:\n{hashed}"
            );
        }
        checked += 1;
    }
    assert!(checked >= 10, "only {checked} reduction queries found");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_aggregates_stay_hash_aggregations_with_the_same_answers() {
    let cases = [
        // An unsupported function, grouping by a variable, an aggregate
        // FILTER, a string argument to min, LIMIT below the aggregate.
        "SELECT lat, median(t2m) AS m FROM t GROUP BY lat",
        "SELECT t2m, count(*) AS n FROM t GROUP BY t2m",
        "SELECT lat, avg(t2m) FILTER (WHERE lon > 100) AS m FROM t GROUP BY lat",
        "SELECT lat, max(CAST(lon AS VARCHAR)) AS m FROM t GROUP BY lat",
        "SELECT lat, avg(t2m) AS m FROM (SELECT * FROM t ORDER BY time, lat, lon LIMIT 50) s GROUP BY lat",
    ];
    let dense = context("v2_basic.zarr", true, true).await;
    let hashed = context("v2_basic.zarr", false, true).await;
    for sql in cases {
        let plan = explain_text(&dense, sql).await;
        assert!(
            !plan.contains("DenseReductionExec"),
            "{sql} must not be rewritten:\n{plan}"
        );
        let mut got = run(&dense, sql).await;
        let mut want = run(&hashed, sql).await;
        sort_rows(&mut got, 1);
        sort_rows(&mut want, 1);
        assert_rows(sql, &got, &want);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_equal_the_hash_aggregation_on_the_demo_store() {
    // Bigger than the fixtures: several blocks and workers, packed variables.
    let store = repo_root().join("demo/era5.zarr");
    let queries = [
        "SELECT lat, lon, avg(t2m) AS a, stddev(u10) AS s, min(sp) AS lo, max(sp) AS hi \
         FROM era5 GROUP BY lat, lon",
        "SELECT time, sum(t2m - 273.15) AS warm, count(sst) AS ocean FROM era5 \
         WHERE lat BETWEEN -30 AND 30 GROUP BY time",
        "SELECT lon, var_pop(sqrt(u10 * u10 + v10 * v10)) AS w FROM era5 \
         WHERE t2m > 280 AND time >= TIMESTAMP '2020-01-03' GROUP BY lon",
    ];
    for sql in queries {
        let mut results = Vec::new();
        for dense in [true, false] {
            // Small blocks, so many blocks are folded and merged.
            let small_blocks = "SET zarrfusion.target_partition_bytes = 65536";
            let ctx = session("era5", &store, dense, &[small_blocks]).await;
            let mut r = run(&ctx, sql).await;
            sort_rows(&mut r, 2);
            results.push(r);
        }
        assert!(!results[0].is_empty(), "{sql}: no rows");
        assert_rows(sql, &results[0], &results[1]);
    }
}

/// A reduction whose group state does not fit `allowed_mem` in one pass
/// runs in bands of its first grouped dimension's keys (days of hourly
/// steps; latitudes, descending in the demo store), each band's groups
/// emitted before the next band is read: the answers are the hash
/// aggregation's, with a row filter that leaves groups out, with a
/// selection, and when a band holds one key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reductions_in_bands_under_a_memory_limit_equal_the_hash_aggregation() {
    let store = repo_root().join("demo/era5.zarr");
    let queries = [
        "SELECT date_trunc('day', time) AS d, lat, lon, avg(t2m) AS a, max(u10) AS m \
         FROM era5 GROUP BY 1, 2, 3",
        "SELECT lat, lon, time, sum(t2m - 273.15) AS s, count(sst) AS n FROM era5 \
         WHERE t2m > 285 GROUP BY lat, lon, time",
        "SELECT floor(lat / 4) * 4 AS la, lon, date_trunc('day', time) AS d, stddev(u10) AS s \
         FROM era5 WHERE lon BETWEEN 10 AND 200 GROUP BY 1, 2, 3",
    ];
    for (sql, limit) in queries.iter().flat_map(|q| [(q, "2M"), (q, "1M")]) {
        let limited = format!("SET datafusion.runtime.memory_limit = '{limit}'");
        let ctx = session("era5", &store, true, &[&limited]).await;
        let plan = explain_text(&ctx, sql).await;
        assert!(plan.contains(", bands="), "{sql} ({limit}):\n{plan}");
        let mut got = run(&ctx, sql).await;
        let mut want = run(&session("era5", &store, false, &[]).await, sql).await;
        sort_rows(&mut got, 3);
        sort_rows(&mut want, 3);
        assert!(want.len() > 10_000, "{sql}: {} rows", want.len());
        assert_rows(&format!("{sql} ({limit})"), &got, &want);
    }
}

/// `GROUP BY` over `rechunk(...)`: a dense reduction of the rechunked
/// store, after the copy of the variables it reads (before, DataFusion's
/// hash aggregation over the rechunked store's scan). Every reduction of
/// the fixture oracles, read in chunks with ragged edges on every
/// dimension, gives pandas' answer; on the demo store, with many blocks,
/// the answer of the hash aggregation of the store as it is. Nothing is
/// left in `work_dir`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_by_of_rechunk_is_a_dense_reduction_of_the_rechunked_store() {
    let dir = common::scratch("dense-rechunk");
    let work = dir.join("work");
    let set_work = format!("SET zarrfusion.work_dir = '{}'", work.display());
    let runtime = RuntimeEnv::default();
    let mut checked = 0;
    for q in &reduction_queries() {
        let name = q["name"].as_str().unwrap();
        let store = q["store"].as_str().unwrap();
        let dataset =
            ZarrDataset::open(&fixture(store), &ZarrTableOptions::default(), &runtime).unwrap();
        let chunks: Vec<String> = (dataset.table(None).unwrap().dims.iter())
            .zip([2, 3, 1].iter().cycle())
            .map(|(d, len)| format!("{} => {len}", d.name))
            .collect();
        let sql = q["sql"].as_str().unwrap();
        let rechunked = format!(" FROM rechunk('t', {}) AS t", chunks.join(", "));
        let sql = sql.replace(" FROM t", &rechunked);
        assert!(sql.contains("rechunk("), "{name}: {sql}");
        let want: Vec<Vec<Value>> = serde_json::from_value(q["rows"].clone()).unwrap();
        for pushdown in [true, false] {
            let ctx = context(store, true, pushdown).await;
            ctx.sql(&set_work).await.unwrap();
            let plan = explain_text(&ctx, &sql).await;
            assert!(
                plan.contains("RechunkExec")
                    && plan.contains("DenseReductionExec")
                    && plan.contains("rechunked=[")
                    && !plan.contains("AggregateExec"),
                "{name} (pushdown={pushdown}):\n{plan}"
            );
            let got = run(&ctx, &sql).await;
            assert_rows(&format!("{name} (pushdown={pushdown})"), &got, &want);
        }
        checked += 1;
    }
    assert!(checked >= 10, "only {checked} reduction queries found");

    let era5 = repo_root().join("demo/era5.zarr");
    let small_blocks = "SET zarrfusion.target_partition_bytes = 65536";
    let dense = session("era5", &era5, true, &[small_blocks, &set_work]).await;
    let hashed = session("era5", &era5, false, &[]).await;
    for (chunks, keys, sql) in [
        (
            "time => 96, lat => 4, lon => 4",
            2,
            "SELECT lat, lon, avg(t2m) AS a, stddev(u10) AS s, min(sp) AS lo, count(sst) AS n \
             FROM {} GROUP BY lat, lon",
        ),
        (
            "time => 7, lat => 5",
            1,
            "SELECT time, sum(t2m - 273.15) AS warm, max(sst) AS hi FROM {} \
             WHERE lat BETWEEN -30 AND 30 AND u10 > 0 GROUP BY time",
        ),
    ] {
        let over = sql.replace("{}", &format!("rechunk('era5', {chunks})"));
        let plan = explain_text(&dense, &over).await;
        assert!(plan.contains("DenseReductionExec"), "{over}:\n{plan}");
        let mut got = run(&dense, &over).await;
        let mut want = run(&hashed, &sql.replace("{}", "era5")).await;
        sort_rows(&mut got, keys);
        sort_rows(&mut want, keys);
        assert!(!want.is_empty(), "{sql}: no rows");
        assert_rows(&over, &got, &want);
    }
    // In 300 KB, through chunks of (96, 3, 16): a chunk's block per
    // worker, each folded in runs shorter than a block (before, a run of
    // rows was a whole block, and the reduction was refused).
    let runtime = RuntimeEnvBuilder::new()
        .with_memory_limit(300 << 10, 1.0)
        .build()
        .unwrap();
    let small = new_context_with(session_config(), Arc::new(runtime));
    small.sql(&set_work).await.unwrap();
    small
        .register_zarr("era5", era5.to_str().unwrap(), HashMap::new())
        .await
        .unwrap();
    let sql = "SELECT lat, avg(t2m) AS a, max(u10) AS u, count(*) AS n FROM {} GROUP BY lat";
    let over = sql.replace("{}", "rechunk('era5', time => 96, lat => 3, lon => 16)");
    let plan = explain_text(&small, &over).await;
    assert!(
        plan.contains("DenseReductionExec") && plan.contains("runs of"),
        "{over}:\n{plan}"
    );
    let mut got = run(&small, &over).await;
    let mut want = run(&hashed, &sql.replace("{}", "era5")).await;
    sort_rows(&mut got, 1);
    sort_rows(&mut want, 1);
    assert_rows(&over, &got, &want);

    let left: Vec<_> = match std::fs::read_dir(&work) {
        Ok(entries) => entries.map(|e| e.unwrap().file_name()).collect(),
        Err(_) => Vec::new(),
    };
    assert!(left.is_empty(), "left in work_dir: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_by_the_grouped_dimensions_needs_no_sort() {
    // The reduction's rows come in C order of the grouped dimensions, so an
    // ORDER BY that follows the coordinates (latitude descends in the demo
    // store) is already satisfied; any other order is sorted. Rows are
    // compared in the order they come, against the hash aggregation sorted
    // by DataFusion.
    let era5 = repo_root().join("demo/era5.zarr");
    let stations = Path::new(&fixture("string_coords_v2.zarr")).to_path_buf();
    let cases = [
        (&era5, "SELECT lat, lon, avg(t2m) AS a FROM era5 GROUP BY lon, lat ORDER BY lat DESC, lon", false),
        (&era5, "SELECT lon, lat, max(sp) AS m FROM era5 WHERE lon > 100 GROUP BY lat, lon ORDER BY lat DESC, lon LIMIT 70", false),
        (&era5, "SELECT time, lat, count(sst) AS n FROM era5 GROUP BY time, lat ORDER BY time, lat DESC", false),
        (&era5, "SELECT time, avg(t2m) AS a FROM era5 WHERE lat < 0 GROUP BY time ORDER BY time DESC", true),
        (&era5, "SELECT lat, lon, avg(t2m) AS a FROM era5 GROUP BY lon, lat ORDER BY lat, lon", true),
        (&era5, "SELECT lat, lon, avg(t2m) AS a FROM era5 GROUP BY lon, lat ORDER BY lon, lat DESC", true),
        // Station names are not sorted in the store.
        (&stations, "SELECT station, time, avg(temperature) AS a FROM era5 GROUP BY station, time ORDER BY station, time", true),
        (&stations, "SELECT time, avg(temperature) AS a FROM era5 GROUP BY time ORDER BY time", false),
    ];
    for (store, sql, sorts) in cases {
        let dense = session("era5", store, true, &[]).await;
        let plan = explain_text(&dense, sql).await;
        assert!(plan.contains("DenseReductionExec"), "{sql}:\n{plan}");
        assert_eq!(plan.contains("SortExec"), sorts, "{sql}:\n{plan}");
        let got = run(&dense, sql).await;
        let want = run(&session("era5", store, false, &[]).await, sql).await;
        assert!(!got.is_empty(), "{sql}: no rows");
        assert_rows(sql, &got, &want);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiled_reductions_equal_the_hash_aggregation() {
    // Time-chunked data grouped by space with more group state than a
    // cache holds: blocks are folded in tiles (a few inner positions over
    // every time step of the block). 80,000 groups, chunks of 5 time steps
    // (the last one 2), NULLs scattered so that the aggregates skip
    // different rows, and two variables without NULLs whose arithmetic is
    // evaluated fused (w float64, x float32 widened). Uncompressed, the
    // chunks are read straight from their files, in parts of a few MB cut
    // along a grouped dimension.
    for codec in ["zstd", "none"] {
        let dir = common::scratch(&format!("dense-tiled-{codec}"));
        let store = dir.join("grid.zarr");
        let ctx = new_context();
        let grid = "SELECT t, j, i, \
             CASE WHEN (t * 7 + j * 3 + i) % 11 = 0 THEN NULL ELSE cos(t + j * 0.1 + i * 0.01) END AS u, \
             CASE WHEN (t + j + i) % 5 = 0 THEN NULL ELSE CAST(sin(t * 0.3 + i) AS FLOAT) END AS v, \
             t * 0.5 + sin(j * 0.7) * i AS w, CAST(cos(t + i * 0.3) AS FLOAT) AS x \
             FROM (SELECT unnest(range(12)) AS t) \
             CROSS JOIN (SELECT unnest(range(400)) AS j) \
             CROSS JOIN (SELECT unnest(range(200)) AS i)";
        ctx.sql(&format!(
            "COPY ({grid}) TO '{}' STORED AS ZARR \
             OPTIONS ('dims' 't,j,i', 'chunks' 't=5,j=400,i=200', 'codec' '{codec}')",
            store.display()
        ))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
        let dataset = ZarrDataset::open(
            store.to_str().unwrap(),
            &ZarrTableOptions::default(),
            &RuntimeEnv::default(),
        )
        .unwrap();
        for variable in &dataset.table(None).unwrap().variables {
            assert_eq!(variable.reads_chunk_files(), codec == "none", "{codec}");
        }
        let queries = [
            "SELECT j, i, avg(u * u) AS uu, avg(v * v) AS vv, avg(u * v) AS uv FROM g GROUP BY j, i",
            "SELECT j, i, count(u) AS n, sum(v) AS s, var(u) AS var, min(v) AS lo, max(u) AS hi \
             FROM g GROUP BY j, i",
            "SELECT j, i, stddev_pop(u + v) AS s, count(*) AS n FROM g WHERE t > 1 AND u > 0 GROUP BY j, i",
            "SELECT j, i, avg(w * w) AS ww, sum(w / (x + 2.0)) AS q, var(-w + x * 3.0) AS var, \
             min(w - x) AS lo, max(x) AS hi, avg(u * w) AS uw FROM g GROUP BY j, i",
            "SELECT j, i, avg(w * x) AS wx, count(*) AS n FROM g WHERE t > 2 GROUP BY j, i",
        ];
        for sql in queries {
            let mut results = Vec::new();
            for dense in [true, false] {
                let ctx = session("g", &store, dense, &[]).await;
                let plan = explain_text(&ctx, sql).await;
                assert_eq!(plan.contains("DenseReductionExec"), dense, "{plan}");
                if dense && sql.contains("w * w") {
                    // All but max(x), which folds float32 as it is.
                    assert_eq!(plan.matches("(fused)").count(), 5, "{plan}");
                }
                let mut r = run(&ctx, sql).await;
                sort_rows(&mut r, 2);
                results.push(r);
            }
            assert!(
                results[0].len() > 40_000,
                "{sql}: {} rows",
                results[0].len()
            );
            assert_rows(sql, &results[0], &results[1]);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reduction_over_the_memory_limit_is_refused_before_it_runs() {
    // One worker (a block of 12 cells, folded in a run of 12 rows, and
    // the state of 5 groups) needs more than 256 bytes.
    let ctx = common::budget_session(256, "t", &fixture("v2_basic.zarr")).await;
    let error = ctx
        .sql("SELECT lat, avg(t2m) FROM t GROUP BY lat")
        .await
        .unwrap()
        .create_physical_plan()
        .await
        .expect_err("the plan does not fit in 256 bytes")
        .to_string();
    for needle in [
        "DenseReductionExec",
        "memory limit",
        "1 worker x",
        "256.0 B",
        "v2_basic.zarr",
    ] {
        assert!(
            error.contains(needle),
            "error should mention {needle}: {error}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_chunk_fails_the_reduction_with_its_name() {
    let ctx = context("bad_corrupt_chunk.zarr", true, true).await;
    let sql = "SELECT lat, avg(t2m) FROM t GROUP BY lat";
    assert!(explain_text(&ctx, sql).await.contains("DenseReductionExec"));
    let error = ctx
        .sql(sql)
        .await
        .unwrap()
        .collect()
        .await
        .expect_err("a corrupt chunk must fail the query")
        .to_string();
    for needle in ["bad_corrupt_chunk.zarr", "t2m", "c/0/0/0"] {
        assert!(
            error.contains(needle),
            "error should mention {needle}: {error}"
        );
    }
}

/// The queries of `tests/fixtures/expected/climate_queries.json` and
/// `calendar_queries.json` (over stores in the `noleap`, `360_day`,
/// `all_leap` and `julian` calendars): SQL and answers computed with xarray
/// (`resample`, `groupby("time.month")`, `coarsen`; on cftime dates for the
/// calendars) or pandas from the stores read back by xarray.
fn climate_queries() -> Vec<Value> {
    ["climate_queries.json", "calendar_queries.json"]
        .into_iter()
        .flat_map(|file| {
            let path = repo_root().join("tests/fixtures/expected").join(file);
            let queries: Vec<Value> =
                serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
            queries
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resampling_climatologies_and_coarsening_are_dense_reductions_with_xarray_s_answers() {
    let queries = climate_queries();
    assert!(queries.len() >= 10, "{} climate queries", queries.len());
    let mut banded = 0;
    for q in &queries {
        let (name, store, sql) = (
            q["name"].as_str().unwrap(),
            q["store"].as_str().unwrap(),
            q["sql"].as_str().unwrap(),
        );
        let want: Vec<Vec<Value>> = serde_json::from_value(q["rows"].clone()).unwrap();
        assert!(!want.is_empty(), "{name}: no expected rows");
        // Blocks of a few chunks: keys are folded across blocks and
        // workers, and a day's steps fall in two blocks.
        let small_blocks = "SET zarrfusion.target_partition_bytes = 1024";
        // Group state held at once cut to 256 bytes: reductions whose first
        // grouped dimension's keys run along it (resampling, coarsening)
        // run in bands of a few keys; the others stay in one pass when
        // they fit, or become hash aggregations.
        let small_state = "SET zarrfusion.dense_state_bytes = 256";
        let cases: [(bool, &[&str]); 4] = [
            (true, &[]),
            (true, &[small_blocks]),
            (true, &[small_blocks, small_state]),
            (false, &[]),
        ];
        for (dense, settings) in cases {
            let ctx = session("t", Path::new(&fixture(store)), dense, settings).await;
            let plan = explain_text(&ctx, sql).await;
            if settings.contains(&small_state) {
                banded += usize::from(plan.contains(", bands="));
            } else {
                assert_eq!(
                    plan.contains("DenseReductionExec") && !plan.contains("AggregateExec"),
                    dense,
                    "{name} (dense={dense}):\n{plan}"
                );
            }
            let got = run(&ctx, sql).await;
            assert_rows(
                &format!("{name} (dense={dense}, {settings:?})"),
                &got,
                &want,
            );
        }
    }
    assert!(banded >= 8, "{banded} of the queries ran in bands");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn climatologies_over_the_bound_run_in_bands_of_a_later_dimension_with_xarray_s_answers() {
    // Grouped by the month (whose keys repeat along time: it cannot be cut)
    // and the grid, over a bound that one latitude's groups fit: the
    // reduction runs in bands of latitudes. Its rows come band by band, so
    // it declares no order (DataFusion sorts for ORDER BY) and gives
    // xarray's `groupby("time.month")` answers; without ORDER BY, the hash
    // plan's rows in some order.
    let queries = climate_queries();
    // A bound under each query's state (5 months or 4 hours x 36 cells)
    // and over one latitude's.
    let bound = "SET zarrfusion.dense_state_bytes = 2048";
    let small_blocks = "SET zarrfusion.target_partition_bytes = 1024";
    let q = (queries.iter().find(|q| q["name"] == "climatology_by_month")).unwrap();
    let (store, sql) = (q["store"].as_str().unwrap(), q["sql"].as_str().unwrap());
    let want: Vec<Vec<Value>> = serde_json::from_value(q["rows"].clone()).unwrap();
    let store = fixture(store);
    let hashed = session("t", Path::new(&store), false, &[]).await;
    // The hours of the day (6-hourly steps: 4 of them) and the grid, with
    // a variance, against the hash plan.
    let diurnal = "SELECT date_part('hour', time) AS hour, lat, lon, avg(t2m) AS m, \
                   stddev(u10) AS s, count(*) AS n FROM t GROUP BY 1, 2, 3";
    for settings in [&[bound][..], &[bound, small_blocks]] {
        let ctx = session("t", Path::new(&store), true, settings).await;
        for sql in [sql, diurnal] {
            let plan = explain_text(&ctx, sql).await;
            assert!(
                plan.contains("DenseReductionExec") && !plan.contains("AggregateExec"),
                "{sql}:\n{plan}"
            );
            assert!(plan.contains(" keys of lat"), "{sql}:\n{plan}");
            assert_eq!(
                plan.contains("SortExec"),
                sql.contains("ORDER BY"),
                "{plan}"
            );
        }
        let got = run(&ctx, sql).await;
        assert_rows(&format!("{settings:?}"), &got, &want);
        // Without ORDER BY, the hash plan's rows in some order.
        for sql in [sql.split(" ORDER BY").next().unwrap(), diurnal] {
            let mut got = run(&ctx, sql).await;
            let mut want = run(&hashed, sql).await;
            assert_eq!(got.len(), want.len(), "{sql}");
            sort_rows(&mut got, 3);
            sort_rows(&mut want, 3);
            assert_rows(&format!("{sql} ({settings:?})"), &got, &want);
        }
    }
    // A COPY of it writes its rows band by band (each band's in C order
    // over its cells): refused before it runs where a band's rows do not
    // fit beside what the reduction holds (3.5 KB and 65.7 KB in bands of
    // a latitude, over 68 KB), written where they do (72 KB, where
    // collecting the rows was refused).
    let clim = "SELECT extract(month FROM time) AS month, lat, lon, avg(t2m) AS t2m, \
                stddev_pop(u10) AS u10 FROM t GROUP BY 1, 2, 3";
    let dir = common::scratch("climatology_in_bands_copy");
    let out = dir.join("clim.zarr");
    let copy = format!(
        "COPY ({clim}) TO '{}' STORED AS ZARR OPTIONS ('dims' 'month,lat,lon')",
        out.display()
    );
    for (limit, fits) in [("68K", false), ("72K", true)] {
        let allowed = format!("SET datafusion.runtime.memory_limit = '{limit}'");
        let ctx = session("t", Path::new(&store), true, &[bound, allowed.as_str()]).await;
        let plan = explain_text(&ctx, clim).await;
        assert!(plan.contains(" keys of lat"), "{plan}");
        if fits {
            let plan = explain_text(&ctx, &copy).await;
            assert!(
                plan.contains("streamed=1 of lat per write (its bands)"),
                "{plan}"
            );
        }
        let result = ctx.sql(&copy).await;
        let result = match result {
            Ok(df) => df.collect().await.map(|_| ()),
            Err(e) => Err(e),
        };
        match result {
            Ok(()) => assert!(fits, "{limit}: the COPY ran"),
            Err(e) => {
                let e = e.to_string();
                assert!(!fits, "{limit}: {e}");
                assert!(
                    e.contains("Resources exhausted")
                        && e.contains("the query holds 65.7 KB")
                        && e.contains("at a time along 'lat'")
                        && e.contains("allowed_mem (68.0 KB)"),
                    "{e}"
                );
                assert!(!out.exists(), "a refused COPY wrote {}", out.display());
            }
        }
    }
    let ctx = session("t", &out, true, &[]).await;
    let rows = run(&ctx, "SELECT count(*) AS n, count(t2m) AS m FROM t").await;
    assert_eq!(rows, vec![vec![Value::from(180), Value::from(180)]]);
    // The month alone cannot be cut: over the bound, the hash aggregation.
    let ctx = session(
        "t",
        Path::new(&store),
        true,
        &["SET zarrfusion.dense_state_bytes = 64"],
    )
    .await;
    let sql = "SELECT extract(month FROM time) AS month, avg(t2m) AS m FROM t GROUP BY 1";
    let plan = explain_text(&ctx, sql).await;
    assert!(!plan.contains("DenseReductionExec"), "{plan}");
}

/// Bands folded at once, each by its own worker (where a band of a chunk
/// or more leaves one worker a band, or where workers would share a band,
/// and, under a bound every query's state fits, where bands of the first
/// grouped dimension leave each worker one), under bounds that cut each
/// query differently: xarray's answers, in order where the query asks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bands_folded_at_once_give_xarray_s_answers() {
    let store = fixture("climate.zarr");
    let mut at_once = Vec::new();
    for bound in [1000, 2048, 3000, 50_000] {
        let bound = format!("SET zarrfusion.dense_state_bytes = {bound}");
        let threads = "SET datafusion.execution.target_partitions = 4";
        let ctx = session("t", Path::new(&store), true, &[&bound, threads]).await;
        for q in climate_queries()
            .iter()
            .filter(|q| q["store"] == "climate.zarr")
        {
            let sql = q["sql"].as_str().unwrap();
            let plan = explain_text(&ctx, sql).await;
            if !plan.contains(" at once") {
                continue;
            }
            let want: Vec<Vec<Value>> = serde_json::from_value(q["rows"].clone()).unwrap();
            let name = format!("{} ({bound})", q["name"]);
            assert_rows(&name, &run(&ctx, sql).await, &want);
            at_once.push(name);
        }
    }
    assert!(at_once.len() >= 2, "bands folded at once: {at_once:?}");
    // (50 KB holds every query's state in one pass.)
    assert!(
        at_once.iter().any(|n| n.contains("50000")),
        "bands folded at once within the bound: {at_once:?}"
    );
}

/// A query that uses only some columns of a reduction (its aggregates
/// summed up, one key beside an aggregate, only its number of groups) has
/// the reduction give only those: the keys not used are never built
/// (`gives=[...]` in EXPLAIN), in one pass and in bands, and the answers
/// are xarray's rows taken the same way. Its rows are not declared in the
/// order of a key it no longer leads with: `ORDER BY` sorts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_using_some_columns_of_a_reduction_gets_only_those_with_xarray_s_answers() {
    let small_blocks = "SET zarrfusion.target_partition_bytes = 1024";
    let small_state = "SET zarrfusion.dense_state_bytes = 256";
    let mut projected = 0;
    for q in climate_queries() {
        let (name, store, sql) = (
            q["name"].as_str().unwrap(),
            q["store"].as_str().unwrap(),
            q["sql"].as_str().unwrap(),
        );
        let inner = sql.split(" ORDER BY").next().unwrap();
        let groups = inner
            .split(" GROUP BY ")
            .nth(1)
            .unwrap()
            .split(", ")
            .count();
        let want: Vec<Vec<Value>> = serde_json::from_value(q["rows"].clone()).unwrap();
        if groups < 2 {
            continue;
        }
        for settings in [&[][..], &[small_blocks, small_state]] {
            let ctx = session("t", Path::new(&fixture(store)), true, settings).await;
            let fields = ctx.sql(inner).await.unwrap().schema().clone();
            let names: Vec<&str> = (fields.fields().iter())
                .map(|f| f.name().as_str())
                .collect();
            let (key, agg) = (names[groups - 1], names[names.len() - 1]);
            let what = format!("{name} ({settings:?})");
            // The last key beside the last aggregate, sorted by the key.
            let pair = format!("SELECT \"{key}\" AS k, \"{agg}\" AS a FROM ({inner}) ORDER BY 1");
            let plan = explain_text(&ctx, &pair).await;
            // (Named as the reduction names them; the aliases above it.)
            let gives = |plan: &str, n: usize| {
                (plan.split(", gives=[").nth(1))
                    .map(|g| g.split(']').next().unwrap().split(", ").count())
                    == Some(n)
            };
            // (Under the small bound, a grouping none of whose dimensions
            // can be cut stays a hash aggregation.)
            let dense = plan.contains("DenseReductionExec");
            projected += usize::from(dense);
            assert_eq!(gives(&plan, 2), dense, "{what}:\n{plan}");
            assert!(plan.contains("SortExec"), "{what}:\n{plan}");
            let mut got = run(&ctx, &pair).await;
            let sorted = {
                let mut rows = got.clone();
                sort_rows(&mut rows, 1);
                rows
            };
            assert_eq!(got, sorted, "{what}: not ordered by {key}");
            let mut taken: Vec<Vec<Value>> = (want.iter())
                .map(|r| vec![r[groups - 1].clone(), r[r.len() - 1].clone()])
                .collect();
            sort_rows(&mut got, 2);
            sort_rows(&mut taken, 2);
            assert_rows(&what, &got, &taken);
            // Only the aggregate, summed up; only the number of groups.
            let summed =
                format!("SELECT sum(\"{agg}\") AS s, count(\"{agg}\") AS c FROM ({inner})");
            let plan = explain_text(&ctx, &summed).await;
            let dense = plan.contains("DenseReductionExec");
            assert_eq!(gives(&plan, 1), dense, "{what}:\n{plan}");
            let values: Vec<f64> = (want.iter())
                .filter_map(|r| r[r.len() - 1].as_f64())
                .collect();
            let expected = vec![vec![
                Value::from(values.iter().sum::<f64>()),
                Value::from(values.len()),
            ]];
            assert_rows(&what, &run(&ctx, &summed).await, &expected);
            let counted = format!("SELECT count(*) AS n FROM ({inner})");
            let expected = vec![vec![Value::from(want.len())]];
            assert_rows(&what, &run(&ctx, &counted).await, &expected);
        }
    }
    assert!(projected >= 14, "{projected} queries taken in part");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn functions_that_are_not_of_one_dimension_stay_hash_aggregations() {
    let cases = [
        // Two dimensions, a variable, a volatile function.
        "SELECT floor(lat + lon) AS k, avg(t2m) AS m FROM t GROUP BY 1",
        "SELECT date_trunc('day', time) AS d, round(t2m) AS r, count(*) AS n FROM t GROUP BY 1, 2",
        "SELECT floor(lat * random()) AS k, count(*) AS n FROM t GROUP BY 1",
    ];
    let store = fixture("climate.zarr");
    let dense = session("t", Path::new(&store), true, &[]).await;
    let hashed = session("t", Path::new(&store), false, &[]).await;
    for sql in cases {
        let plan = explain_text(&dense, sql).await;
        assert!(
            !plan.contains("DenseReductionExec"),
            "{sql} must not be rewritten:\n{plan}"
        );
        if sql.contains("random") {
            continue;
        }
        let mut got = run(&dense, sql).await;
        let mut want = run(&hashed, sql).await;
        sort_rows(&mut got, 2);
        sort_rows(&mut want, 2);
        assert_rows(sql, &got, &want);
    }
    // Functions of one dimension that were hash aggregations before: a
    // shifted coordinate, and DISTINCT (DataFusion groups by the distinct
    // column below the count, which is now a dense reduction).
    let v2 = fixture("v2_basic.zarr");
    for sql in [
        "SELECT lat + 1 AS l, avg(t2m) AS m FROM t GROUP BY lat + 1",
        "SELECT lat, count(DISTINCT lon) AS n FROM t GROUP BY lat",
    ] {
        let dense = session("t", Path::new(&v2), true, &[]).await;
        let plan = explain_text(&dense, sql).await;
        assert!(plan.contains("DenseReductionExec"), "{sql}:\n{plan}");
        let mut got = run(&dense, sql).await;
        let mut want = run(&session("t", Path::new(&v2), false, &[]).await, sql).await;
        sort_rows(&mut got, 1);
        sort_rows(&mut want, 1);
        assert_eq!(got.len(), 5, "{sql}");
        assert_rows(sql, &got, &want);
    }
    // Keys come sorted: ordering by them needs no sort.
    for sql in [
        "SELECT extract(month FROM time) AS mo, avg(t2m) AS m FROM t GROUP BY 1 ORDER BY 1",
        "SELECT date_trunc('day', time) AS d, lat, avg(t2m) AS m FROM t GROUP BY 1, 2 ORDER BY 1, 2 DESC",
    ] {
        let plan = explain_text(&dense, sql).await;
        assert!(
            plan.contains("DenseReductionExec") && !plan.contains("SortExec"),
            "{sql}:\n{plan}"
        );
    }
    // The setting keeps the dense reduction to dimension columns.
    let plain = session(
        "t",
        Path::new(&store),
        true,
        &["SET zarrfusion.dense_group_functions = false"],
    )
    .await;
    let by_month = "SELECT extract(month FROM time) AS mo, avg(t2m) AS m FROM t GROUP BY 1";
    assert!(!explain_text(&plain, by_month)
        .await
        .contains("DenseReductionExec"));
    assert!(
        explain_text(&plain, "SELECT lat, avg(t2m) FROM t GROUP BY lat")
            .await
            .contains("DenseReductionExec")
    );
    // EXPLAIN names the functions grouped by.
    let sql = "SELECT date_trunc('month', time) AS m, lat, avg(t2m) FROM t GROUP BY 1, 2";
    let plan = explain_text(&dense, sql).await;
    assert!(
        plan.contains("group=[date_trunc(Utf8(\"month\"), t.time), lat]")
            || plan.contains("group=[date_trunc(Utf8(\"month\"), time), lat]"),
        "{plan}"
    );
}

/// Writes a v3 store of one `float32` array `v` over dimensions `d0`,
/// `d1`, `d2` (indices, no coordinate arrays) of `shape`, one chunk per
/// step of `d0`, no chunk written: every cell is the fill value, 1.5.
fn store_of_fill_values(dir: &Path, shape: [u64; 3]) {
    std::fs::create_dir_all(dir.join("v")).unwrap();
    std::fs::write(
        dir.join("zarr.json"),
        r#"{"zarr_format":3,"node_type":"group","attributes":{}}"#,
    )
    .unwrap();
    let metadata = format!(
        r#"{{"zarr_format":3,"node_type":"array","shape":[{},{},{}],"data_type":"float32",
        "chunk_grid":{{"name":"regular","configuration":{{"chunk_shape":[1,{},{}]}}}},
        "chunk_key_encoding":{{"name":"default","configuration":{{"separator":"/"}}}},
        "fill_value":1.5,"codecs":[{{"name":"bytes","configuration":{{"endian":"little"}}}}],
        "dimension_names":["d0","d1","d2"],"attributes":{{}}}}"#,
        shape[0], shape[1], shape[2], shape[1], shape[2]
    );
    std::fs::write(dir.join("v/zarr.json"), metadata).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_group_state_is_sized_by_the_positions_the_filters_select() {
    // 2^20 x 256 x 256 cells: grouped by all three dimensions (halving
    // d1), the state of every position would be far over the rule's bound
    // (MAX_STATE_BYTES): the reduction runs in bands of d0's positions.
    // Three steps of d0 are 98304 groups, in one pass.
    let dir = common::scratch("dense_selected_state");
    store_of_fill_values(&dir, [1 << 20, 256, 256]);
    let dense = session("t", &dir, true, &[]).await;
    let hashed = session("t", &dir, false, &[]).await;
    let grouped = "SELECT d0, floor(d1 / 2) AS y, d2, count(*) AS n, sum(v) AS s FROM t";
    let everything = format!("{grouped} GROUP BY 1, 2, 3");
    let plan = explain_text(&dense, &everything).await;
    assert!(plan.contains(", bands="), "{plan}");
    for filter in [
        "d0 < 3",
        "d0 BETWEEN 1000 AND 1002",
        "d0 IN (7, 70000, 700000)",
    ] {
        let sql = format!("{grouped} WHERE {filter} GROUP BY 1, 2, 3");
        let plan = explain_text(&dense, &sql).await;
        assert!(plan.contains("DenseReductionExec"), "{sql}:\n{plan}");
        assert!(!plan.contains(", bands="), "{sql}:\n{plan}");
        let mut got = run(&dense, &sql).await;
        let mut want = run(&hashed, &sql).await;
        assert_eq!(got.len(), 3 * 128 * 256, "{sql}");
        sort_rows(&mut got, 3);
        sort_rows(&mut want, 3);
        assert_rows(&sql, &got, &want);
        assert!(
            got.iter().all(|row| row[3] == 2 && row[4] == 3.0),
            "{sql}: {:?}",
            &got[..2]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_workers_group_state_within_the_bound_is_a_dense_reduction_run_by_as_many_as_fit() {
    // count and sum: 24 bytes of state per group (with the rows per
    // group, as the operator holds them). 2^25 groups hold
    // 768 MiB per worker: two workers and the output were over the 1 GiB
    // bound, which left them to the hash aggregation; one worker ran it
    // (two would hold 1.5 GiB), and now two workers fold bands of d0's
    // positions at once, each holding its band's state. 2^24 groups: two
    // workers. 2^27: over the bound whatever the workers, in bands of d0's
    // positions (two workers, each holding a band's state).
    let grouped = "SELECT d0, d1, d2, count(*) AS n, sum(v) AS s FROM t GROUP BY 1, 2, 3";
    let two = "SET datafusion.execution.target_partitions = 2";
    let cases = [
        (1u64 << 9, Some(2), None),
        (1 << 10, Some(2), None),
        (1 << 12, Some(2), None),
        // Under a memory limit: one worker fitted it beside the output
        // (671 MB of keys and results, 400 MB of state per worker); now
        // two fold bands at once (456 MB in all).
        (
            1 << 9,
            Some(2),
            Some("SET datafusion.runtime.memory_limit = '1400M'"),
        ),
    ];
    for (d0, workers, limit) in cases {
        let dir = common::scratch(&format!("dense_state_bound_{d0}_{}", limit.is_some()));
        store_of_fill_values(&dir, [d0, 256, 128]);
        let settings: Vec<&str> = [Some(two), limit].into_iter().flatten().collect();
        let ctx = session("t", &dir, true, &settings).await;
        let plan = explain_text(&ctx, grouped).await;
        match workers {
            Some(w) => assert!(
                plan.contains("DenseReductionExec") && plan.contains(&format!("workers={w},")),
                "{d0}: {plan}"
            ),
            None => assert!(!plan.contains("DenseReductionExec"), "{d0}: {plan}"),
        }
        // Over the bound, in bands; within it, only in bands folded at
        // once, each by its own worker (none merging its state into
        // another's).
        match d0 == 1 << 12 {
            true => assert!(plan.contains(", bands="), "{d0}: {plan}"),
            false => assert!(
                !plan.contains(", bands=") || plan.contains(" at once"),
                "{d0}: {plan}"
            ),
        }
        if d0 == 1 << 12 {
            // Over the bound with a first grouped dimension whose keys do
            // not run along its positions: in bands of the next one.
            let wrapped = "SELECT d0 % 4095 AS k, d1, d2, sum(v) AS s FROM t GROUP BY 1, 2, 3";
            let plan = explain_text(&ctx, wrapped).await;
            assert!(
                plan.contains("DenseReductionExec") && plan.contains(" keys of d1"),
                "{plan}"
            );
            // None of whose grouped dimensions' keys do: the hash aggregation.
            let wrapped = "SELECT d0 % 4095 AS k, d1 % 255 AS j, d2 % 127 AS i, sum(v) AS s \
                           FROM t GROUP BY 1, 2, 3";
            let plan = explain_text(&ctx, wrapped).await;
            assert!(!plan.contains("DenseReductionExec"), "{plan}");
        }
    }
}

/// A filter that selects none of the positions of a dimension not grouped
/// (the latitudes above 60 of a store reaching 50) leaves no row in any
/// group: there are no groups, as DataFusion's hash aggregation gives (the
/// reduction gave every time step's group, its mean NULL, and told the
/// optimizer so: `count(*)` of them was 608). Found by the differential
/// fuzzer (`differential.rs`).
#[tokio::test]
async fn a_filter_selecting_no_position_of_a_dimension_not_grouped_leaves_no_groups() {
    let queries = [
        "SELECT time, avg(t2m) AS m FROM t WHERE lat > 60 GROUP BY time",
        "SELECT date_trunc('day', time) AS d, lon, max(u10) AS m FROM t WHERE lat > 60 GROUP BY 1, 2",
        "SELECT lat, count(t2m) AS n FROM t WHERE time > '2030-01-01' GROUP BY lat",
        "SELECT count(*) AS n FROM (SELECT time, avg(t2m) FROM t WHERE lat > 60 GROUP BY time)",
        // Without GROUP BY, the one group stays (its count 0).
        "SELECT count(t2m) AS n, count(*) AS r FROM t WHERE lat > 60",
    ];
    let (on, off) = (
        context("climate.zarr", true, true).await,
        context("climate.zarr", false, true).await,
    );
    for sql in queries {
        let plan = explain_text(&on, sql).await;
        assert!(plan.contains("DenseReductionExec"), "{sql}: {plan}");
        let (got, want) = (run(&on, sql).await, run(&off, sql).await);
        assert_rows(sql, &got, &want);
    }
    assert_eq!(
        run(&on, queries[3]).await,
        vec![vec![Value::from(0)]],
        "no groups"
    );
}

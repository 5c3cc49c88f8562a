//! Joins of two Zarr tables on all their dimensions over the same
//! coordinates are planned as one scan of aligned blocks (no hash join),
//! and give exactly what DataFusion's hash join gives; other joins stay
//! hash joins.

use crate::common;

use std::collections::HashMap;
use std::path::Path;

use common::{assert_rows, explain_text, repo_root, scratch, sort_rows};
use datafusion::prelude::SessionContext;
use serde_json::Value;
use zarrfusion::{new_context, ZarrContextExt};

/// Writes the second store: other variables, other chunks, same grid as
/// the demo store (and, for `shifted`, only part of its latitudes).
async fn write_stores(dir: &Path) {
    let ctx = new_context();
    let demo = repo_root().join("demo/era5.zarr");
    ctx.register_zarr("era5", demo.to_str().unwrap(), HashMap::new())
        .await
        .unwrap();
    for (name, filter) in [("forecast", "TRUE"), ("north", "lat > 0")] {
        let sql = format!(
            "COPY (SELECT time, lat, lon, t2m + 0.5 * u10 AS t2m, \
             CASE WHEN u10 > 5 THEN NULL ELSE v10 END AS w FROM era5 WHERE {filter}) \
             TO '{}' STORED AS ZARR OPTIONS ('chunks' 'time=7,lat=11,lon=16')",
            dir.join(format!("{name}.zarr")).display()
        );
        ctx.sql(&sql).await.unwrap().collect().await.unwrap();
    }
}

async fn session(dir: &Path, aligned: bool) -> SessionContext {
    let ctx = new_context();
    ctx.sql(&format!("SET zarrfusion.aligned_join = {aligned}"))
        .await
        .unwrap();
    let demo = repo_root().join("demo/era5.zarr");
    ctx.register_zarr("era5", demo.to_str().unwrap(), HashMap::new())
        .await
        .unwrap();
    for name in ["forecast", "north"] {
        let path = dir.join(format!("{name}.zarr"));
        ctx.register_zarr(name, path.to_str().unwrap(), HashMap::new())
            .await
            .unwrap();
    }
    ctx
}

async fn run(ctx: &SessionContext, sql: &str) -> Vec<Vec<Value>> {
    common::query_rows(ctx, "query", sql).await
}

/// Runs `sql` with the rule on and off: the same rows, and a hash join
/// only without the rule (or, when `zipped` is false, in both).
async fn check(dir: &Path, sql: &str, keys: usize, zipped: bool) -> usize {
    let mut results = Vec::new();
    for aligned in [true, false] {
        let ctx = session(dir, aligned).await;
        let plan = explain_text(&ctx, sql).await;
        let hash_join = plan.contains("HashJoinExec") || plan.contains("NestedLoopJoinExec");
        assert_eq!(
            hash_join,
            !(aligned && zipped),
            "aligned {aligned}: {sql}\n{plan}"
        );
        let mut r = run(&ctx, sql).await;
        sort_rows(&mut r, keys);
        results.push(r);
    }
    assert_rows(sql, &results[0], &results[1]);
    results[0].len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joins_on_all_dimensions_zip_aligned_blocks() {
    let dir = scratch("aligned-join");
    write_stores(&dir).await;
    let on = "a.time = b.time AND a.lat = b.lat AND a.lon = b.lon";
    let queries = [
        // Rows of both, filtered on a dimension of each side and a variable.
        (
            format!(
                "SELECT a.time, a.lat, a.lon, a.t2m, b.t2m AS t2m_b, b.w, a.t2m - b.t2m AS d \
                 FROM era5 a JOIN forecast b ON {on} \
                 WHERE a.lat BETWEEN -20 AND 30 AND b.lon < 90 AND a.u10 > 0"
            ),
            3,
        ),
        // Keys in another order, USING, a condition across the sides.
        (
            "SELECT time, lat, lon, era5.sst, forecast.w FROM era5 \
             JOIN forecast USING (lon, time, lat) WHERE era5.t2m < forecast.t2m"
                .to_string(),
            3,
        ),
        // A GROUP BY over the zip: a dense reduction.
        (
            format!(
                "SELECT a.lat, avg(a.t2m - b.t2m) AS bias, count(b.w) AS n, max(b.w) AS w \
                 FROM era5 a JOIN forecast b ON {on} WHERE a.time >= '2020-01-03' GROUP BY a.lat"
            ),
            1,
        ),
        // The same table twice.
        (
            format!(
                "SELECT a.lat, a.lon, sum(a.u10 * b.v10) AS s FROM era5 a JOIN era5 b ON {on} \
                 GROUP BY a.lat, a.lon"
            ),
            2,
        ),
    ];
    for (sql, keys) in &queries {
        let n = check(&dir, sql, *keys, true).await;
        assert!(n > 10, "{sql}: {n} rows");
    }
    // The GROUP BY over the zip is a dense reduction.
    let plan = explain_text(&session(&dir, true).await, &queries[2].0).await;
    assert!(plan.contains("DenseReductionExec"), "{plan}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_joins_stay_hash_joins() {
    let dir = scratch("unaligned-join");
    write_stores(&dir).await;
    let queries = [
        // Not every dimension is a key.
        "SELECT a.time, a.lat, count(*) AS n FROM era5 a JOIN forecast b \
         ON a.time = b.time AND a.lat = b.lat GROUP BY a.time, a.lat",
        // Dimensions paired crosswise.
        "SELECT count(*) AS n, sum(a.t2m) AS s FROM era5 a JOIN forecast b \
         ON a.time = b.time AND a.lat = b.lon AND a.lon = b.lat",
        // Other coordinates: only the northern half.
        "SELECT a.lat, avg(a.t2m - b.t2m) AS d, count(*) AS n FROM era5 a JOIN north b \
         ON a.time = b.time AND a.lat = b.lat AND a.lon = b.lon GROUP BY a.lat",
        // An outer join.
        "SELECT a.lat, count(b.w) AS n FROM era5 a LEFT JOIN forecast b \
         ON a.time = b.time AND a.lat = b.lat AND a.lon = b.lon GROUP BY a.lat",
    ];
    for sql in queries {
        check(&dir, sql, 2, false).await;
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

//! `COPY ... TO 'out.zarr' STORED AS ZARR`: the written store, read back,
//! equals the query that wrote it (v2 and v3, every codec); gaps and NULLs
//! become missing values; non-grids, existing targets, failures midway and
//! a small memory budget leave nothing at the target.

use crate::common;

use std::collections::HashMap;

use common::entries;
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::prelude::SessionContext;
use zarrfusion::{new_context, new_context_with, session_config, ZarrContextExt};

fn demo() -> String {
    common::repo_root()
        .join("demo/era5.zarr")
        .to_string_lossy()
        .into_owned()
}

/// A fresh directory for one test's outputs.
fn scratch(name: &str) -> common::Scratch {
    common::scratch(&format!("copy-{name}"))
}

async fn context() -> SessionContext {
    let ctx = new_context();
    ctx.register_zarr("era5", &demo(), HashMap::new())
        .await
        .unwrap();
    ctx
}

/// A session whose memory pool holds `bytes`, with the demo store as `era5`.
async fn budget_context(bytes: usize) -> SessionContext {
    common::budget_session(bytes, "era5", &demo()).await
}

async fn text(ctx: &SessionContext, sql: &str) -> String {
    let batches = ctx.sql(sql).await.unwrap().collect().await.unwrap();
    pretty_format_batches(&batches).unwrap().to_string()
}

/// Registers the store written at `path` as `name` and returns its
/// `columns` in (time, lat, lon) order, as text.
async fn read_back(
    ctx: &SessionContext,
    name: &str,
    path: &std::path::Path,
    columns: &str,
) -> String {
    ctx.register_zarr(name, &path.to_string_lossy(), HashMap::new())
        .await
        .unwrap();
    text(
        ctx,
        &format!("SELECT {columns} FROM {name} ORDER BY time, lat, lon"),
    )
    .await
}

async fn copy(ctx: &SessionContext, sql: &str) -> datafusion::common::Result<()> {
    ctx.sql(sql).await?.collect().await.map(|_| ())
}

#[tokio::test]
async fn written_stores_read_back_as_the_query_for_every_format_and_codec() {
    let dir = scratch("roundtrip");
    let ctx = context().await;
    let query = "SELECT time, lat, lon, t2m, u10 * 2 AS u2 FROM era5 WHERE lat > 0";
    let expected = text(&ctx, &format!("{query} ORDER BY time, lat, lon")).await;
    for format in ["2", "3"] {
        for codec in ["zstd", "gzip", "blosc", "none"] {
            let out = dir.join(format!("out_v{format}_{codec}.zarr"));
            copy(
                &ctx,
                &format!(
                    "COPY ({query}) TO '{}' STORED AS ZARR OPTIONS ('zarr_format' '{format}', 'codec' '{codec}', 'chunks' 'time=7,lat=5')",
                    out.display()
                ),
            )
            .await
            .unwrap();
            let name = format!("out_v{format}_{codec}");
            let got = read_back(&ctx, &name, &out, "time, lat, lon, t2m, u2").await;
            assert_eq!(got, expected, "v{format} {codec}");
        }
    }
    // The chunks option is applied.
    let zarray: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("out_v2_zstd.zarr/t2m/.zarray")).unwrap())
            .unwrap();
    assert_eq!(zarray["chunks"], serde_json::json!([7, 5, 64]));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn gaps_and_nulls_become_missing_values_and_aggregates_write_too() {
    let dir = scratch("gaps");
    let ctx = context().await;
    let out = dir.join("gaps.zarr");
    copy(
        &ctx,
        &format!(
            "COPY (SELECT time, lat, lon, CASE WHEN lon > 100 THEN NULL ELSE t2m END AS t \
             FROM era5 WHERE NOT (lat > 10 AND lon < 50)) TO '{}'",
            out.display()
        ),
    )
    .await
    .unwrap();
    ctx.register_zarr("gaps", &out.to_string_lossy(), HashMap::new())
        .await
        .unwrap();
    let got = text(
        &ctx,
        "SELECT count(*) AS cells, count(t) AS values FROM gaps",
    )
    .await;
    let expected = text(
        &ctx,
        "SELECT (SELECT count(*) FROM era5) AS cells, \
         count(*) AS values FROM era5 WHERE NOT (lat > 10 AND lon < 50) AND lon <= 100",
    )
    .await;
    assert_eq!(got, expected);
    // A reduction result is a grid over the kept dimensions.
    let mean = dir.join("mean.zarr");
    copy(
        &ctx,
        &format!(
            "COPY (SELECT lat, avg(t2m) AS t FROM era5 GROUP BY lat) TO '{}'",
            mean.display()
        ),
    )
    .await
    .unwrap();
    ctx.register_zarr("mean", &mean.to_string_lossy(), HashMap::new())
        .await
        .unwrap();
    assert_eq!(
        text(&ctx, "SELECT lat, t FROM mean ORDER BY lat").await,
        text(
            &ctx,
            "SELECT lat, avg(t2m) AS t FROM era5 GROUP BY lat ORDER BY lat"
        )
        .await
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn bad_writes_are_refused_and_leave_nothing() {
    let dir = scratch("bad");
    let ctx = context().await;
    let target = |name: &str| dir.join(name).display().to_string();
    let cases = [
        (
            format!("COPY (SELECT lat, t2m FROM era5) TO '{}'", target("dup.zarr")),
            "not a grid",
        ),
        (
            format!("COPY (SELECT 1 AS a, 2.0 AS b) TO '{}'", target("nodims.zarr")),
            "'dims'",
        ),
        (
            format!(
                "COPY (SELECT lat, t2m FROM era5) TO '{}' OPTIONS ('dims' 'height')",
                target("baddim.zarr")
            ),
            "height",
        ),
        (
            format!(
                "COPY (SELECT time, lat, lon, t2m FROM era5) TO '{}' OPTIONS ('chunks' 'depth=3')",
                target("badchunks.zarr")
            ),
            "depth",
        ),
        (
            format!(
                "COPY (SELECT time, lat, lon, t2m FROM era5) TO '{}' OPTIONS ('codec' 'lzma')",
                target("badcodec.zarr")
            ),
            "lzma",
        ),
        // Fails at run time, after some batches were produced.
        (
            format!(
                "COPY (SELECT time, lat, lon, CASE WHEN time > '2020-01-10' THEN CAST(concat('x', lon) AS DOUBLE) ELSE t2m END AS t FROM era5) TO '{}'",
                target("midway.zarr")
            ),
            "cast",
        ),
    ];
    for (sql, needle) in &cases {
        let err = copy(&ctx, sql).await.unwrap_err().to_string();
        assert!(
            err.to_lowercase().contains(&needle.to_lowercase()),
            "{sql}: {err}"
        );
    }
    assert!(entries(&dir).is_empty(), "left behind: {:?}", entries(&dir));
    // An existing target is never replaced.
    let existing = dir.join("existing.zarr");
    std::fs::create_dir(&existing).unwrap();
    std::fs::write(existing.join("keep.txt"), "data").unwrap();
    let err = copy(
        &ctx,
        &format!(
            "COPY (SELECT time, lat, lon, t2m FROM era5) TO '{}'",
            existing.display()
        ),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("already exists"), "{err}");
    assert_eq!(entries(&existing), vec!["keep.txt"]);
    // Explicit dimensions make any table a grid.
    copy(
        &ctx,
        &format!(
            "COPY (SELECT * FROM (VALUES (1, 10.0), (2, 20.0), (4, 40.0)) AS v(a, b)) TO '{}' OPTIONS ('dims' 'a')",
            target("values.zarr")
        ),
    )
    .await
    .unwrap();
    ctx.register_zarr("vals", &target("values.zarr"), HashMap::new())
        .await
        .unwrap();
    assert_eq!(
        text(&ctx, "SELECT a, b FROM vals ORDER BY a").await,
        text(
            &ctx,
            "SELECT * FROM (VALUES (1, 10.0), (2, 20.0), (4, 40.0)) AS v(a, b) ORDER BY a"
        )
        .await
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_write_that_does_not_fit_the_memory_budget_is_refused() {
    let dir = scratch("budget");
    // Enough for the scan (two blocks per partition, 5.4 MB), not for the
    // whole result the sink holds (8 MB). (An integer column: the table as
    // it is, or float variables, would be written chunk by chunk, inside
    // the budget.)
    let ctx = budget_context(7 << 20).await;
    let out = dir.join("big.zarr");
    // Refused while planning: the scan knows its row count.
    let err = ctx
        .sql(&format!(
            "COPY (SELECT time, lat, lon, t2m, CAST(u10 * 2 AS INT) AS u2, v10 FROM era5) TO '{}'",
            out.display()
        ))
        .await
        .unwrap()
        .create_physical_plan()
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("allowed_mem") && err.contains("ZarrSink") && err.contains("202752 rows"),
        "{err}"
    );
    // Of unknown size (a value filter): refused as the rows arrive.
    let err = copy(
        &ctx,
        &format!(
            "COPY (SELECT time, lat, lon, t2m, CAST(u10 * 2 AS INT) AS u2, v10 FROM era5 WHERE t2m > 0) TO '{}'",
            out.display()
        ),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("allowed_mem") && err.contains("ZarrSink"),
        "{err}"
    );
    assert!(entries(&dir).is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A COPY of a dense reduction writes its rows as they come, a slab of
/// whole chunks at a time (its rows are one per cell of a grid its keys
/// give, in the grid's order): under a budget that cannot hold the result,
/// the reduction runs in bands and the store reads back as the query, also where its rows run against the
/// store's order (latitudes named anew, so sorted ascending); a
/// slab that does not fit beside the reduction is refused before anything
/// runs, with the numbers.
#[tokio::test]
async fn a_reduction_is_written_as_its_rows_come_inside_the_budget() {
    let dir = scratch("streamed");
    let hourly =
        "SELECT time, lat, lon, avg(t2m) AS t2m, count(u10) AS n FROM era5 GROUP BY time, lat, lon";
    let renamed = "SELECT time, lat AS la, lon, max(v10) AS v FROM era5 GROUP BY time, lat, lon";
    // A variable computed over the aggregates: DataFusion spreads the
    // projection over partitions and merges them back in the reduction's
    // order (its declared ordering), which costs more than 4 MB here.
    let computed = "SELECT date_trunc('day', time) AS time, lat, lon, avg(t2m) - 273.15 AS c FROM era5 GROUP BY 1, lat, lon";
    let plain = context().await;
    // 202,752 rows of 40 bytes (8.1 MB) and their grid (3.2 MB), which the
    // collecting sink holds, do not fit in 4 MB.
    let small = budget_context(4 << 20).await;
    small
        .sql("SET zarrfusion.dense_state_bytes = 262144")
        .await
        .unwrap();
    for (ctx, name, sql, dims, columns) in [
        (
            &small,
            "hourly",
            hourly,
            "time,lat,lon",
            "time, lat, lon, t2m, n",
        ),
        (
            &small,
            "renamed",
            renamed,
            "time,la,lon",
            "time, la, lon, v",
        ),
        (
            &plain,
            "computed",
            computed,
            "time,lat,lon",
            "time, lat, lon, c",
        ),
    ] {
        let out = dir.join(format!("{name}.zarr"));
        let copy_sql = format!(
            "COPY ({sql}) TO '{}' STORED AS ZARR OPTIONS ('dims' '{dims}', 'chunks' 'time=1')",
            out.display()
        );
        let plan = text(ctx, &format!("EXPLAIN {copy_sql}")).await;
        assert!(
            plan.contains("streamed=") && plan.contains(" of time per write"),
            "{plan}"
        );
        assert_eq!(plan.contains(", bands="), name != "computed", "{plan}");
        copy(ctx, &copy_sql).await.unwrap();
        let order = dims.replace(',', ", ");
        plain
            .register_zarr(name, &out.to_string_lossy(), HashMap::new())
            .await
            .unwrap();
        let got = text(
            &plain,
            &format!("SELECT {columns} FROM {name} ORDER BY {order}"),
        )
        .await;
        let want = text(
            &plain,
            &format!("SELECT {columns} FROM ({sql}) ORDER BY {order}"),
        )
        .await;
        assert_eq!(got, want, "{name}");
    }
    // One slab of the whole grid (one chunk) does not fit beside the reduction.
    let err = small
        .sql(&format!(
            "COPY ({hourly}) TO '{}' STORED AS ZARR OPTIONS ('chunks' 'time=96')",
            dir.join("tiny.zarr").display()
        ))
        .await
        .unwrap()
        .create_physical_plan()
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("writing its rows 96 at a time along 'time' holds")
            && err.contains("allowed_mem"),
        "{err}"
    );
    assert!(!dir.join("tiny.zarr").exists() && !dir.join("collected.zarr").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A COPY of a dense reduction in bands of a later dimension (the hours
/// of the day repeat along time, so latitudes are cut) writes a band of
/// latitudes at a time, chunks the bands cut written in parts: the store
/// is the one written from rows in the grid's order, file for file, and
/// reads back as the query.
#[tokio::test]
async fn a_reduction_in_bands_of_a_later_dimension_is_written_a_band_at_a_time() {
    let dir = scratch("streamed-bands");
    // Aggregates whose results do not depend on the order of the folds
    // (the bands fold otherwise than one pass).
    let sql = "SELECT extract(hour FROM time) AS hour, lat, lon, min(t2m) AS lo, \
               max(u10) AS hi, count(v10) AS n FROM era5 GROUP BY 1, lat, lon";
    let copy_sql = |ctx_name: &str| {
        format!(
            "COPY ({sql}) TO '{}' STORED AS ZARR OPTIONS ('dims' 'hour,lat,lon', \
             'chunks' 'hour=5,lat=4,lon=7')",
            dir.join(format!("{ctx_name}.zarr")).display()
        )
    };
    let plain = context().await;
    let small = budget_context(4 << 20).await;
    small
        .sql("SET zarrfusion.dense_state_bytes = 131072")
        .await
        .unwrap();
    let plan = text(&small, &format!("EXPLAIN {}", copy_sql("banded"))).await;
    assert!(
        plan.contains("of lat per write (its bands)") && plan.contains(", bands="),
        "{plan}"
    );
    let plan = text(&plain, &format!("EXPLAIN {}", copy_sql("whole"))).await;
    assert!(
        plan.contains(" of hour per write") && !plan.contains(", bands="),
        "{plan}"
    );
    copy(&small, &copy_sql("banded")).await.unwrap();
    copy(&plain, &copy_sql("whole")).await.unwrap();
    common::assert_same_files(&dir.join("whole.zarr"), &dir.join("banded.zarr"));
    plain
        .register_zarr(
            "banded",
            &dir.join("banded.zarr").to_string_lossy(),
            HashMap::new(),
        )
        .await
        .unwrap();
    let order = "ORDER BY hour, lat, lon";
    let columns = "hour, lat, lon, lo, hi, n";
    let got = text(&plain, &format!("SELECT {columns} FROM banded {order}")).await;
    let want = text(&plain, &format!("SELECT {columns} FROM ({sql}) {order}")).await;
    assert_eq!(got, want);
}

/// A COPY of a dense reduction over `rechunk(...)` is written as its rows
/// come too (the copy runs first): the store is the one the reduction of
/// the table itself writes, file for file.
#[tokio::test]
async fn a_reduction_over_rechunk_is_written_as_its_rows_come() {
    let dir = scratch("streamed-rechunk");
    let ctx = context().await;
    let copy_sql = |from: &str, name: &str| {
        format!(
            "COPY (SELECT date_trunc('day', time) AS time, lat, lon, min(t2m) AS lo, \
             count(u10) AS n FROM {from} GROUP BY 1, lat, lon) TO '{}' STORED AS ZARR \
             OPTIONS ('chunks' 'time=2,lat=11,lon=16')",
            dir.join(name).display()
        )
    };
    let rechunked = "rechunk('era5', time => 96, lat => 4, lon => 4)";
    let plan = text(&ctx, &format!("EXPLAIN {}", copy_sql(rechunked, "r.zarr"))).await;
    assert!(
        plan.contains("RechunkExec") && plan.contains("streamed=2 of time per write"),
        "{plan}"
    );
    copy(&ctx, &copy_sql(rechunked, "r.zarr")).await.unwrap();
    copy(&ctx, &copy_sql("era5", "t.zarr")).await.unwrap();
    common::assert_same_files(&dir.join("t.zarr"), &dir.join("r.zarr"));
}

#[tokio::test]
async fn set_allowed_mem_resizes_the_budget_of_later_queries() {
    let dir = scratch("set-budget");
    let ctx = context().await;
    let run = |sql: String| {
        let ctx = ctx.clone();
        async move { zarrfusion::session::sql(&ctx, &sql).await?.collect().await }
    };
    let out = dir.join("small.zarr");
    let copy_sql = format!(
        "COPY (SELECT time, lat, lon, t2m FROM era5) TO '{}'",
        out.display()
    );
    run("SET zarrfusion.allowed_mem = '128kb'".into())
        .await
        .unwrap();
    let err = run(copy_sql.clone()).await.unwrap_err().to_string();
    assert!(err.contains("allowed_mem"), "{err}");
    let err = run("SELECT lat, lon, avg(t2m) FROM era5 GROUP BY lat, lon".into())
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("memory limit"), "{err}");
    assert!(entries(&dir).is_empty());
    let bad = run("SET zarrfusion.allowed_mem = 'lots'".into())
        .await
        .unwrap_err();
    assert!(bad.to_string().contains("zarrfusion.allowed_mem"), "{bad}");
    run("RESET zarrfusion.allowed_mem".into()).await.unwrap();
    run(copy_sql).await.unwrap();
    assert!(out.join("t2m").is_dir());
    let work = dir.join("work");
    run(format!("SET zarrfusion.work_dir = '{}'", work.display()))
        .await
        .unwrap();
    assert!(work.is_dir());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_whole_table_is_copied_array_by_array_inside_a_small_budget() {
    let dir = scratch("whole");
    // 1 MB: less than the scan's two blocks per partition (5 MB) and the
    // rows (8 MB) the sink would hold.
    let small = budget_context(1 << 20).await;
    let ctx = context().await;
    // (COPY, the query it equals, a metadata file, its chunks, its compression, the store's entries)
    let cases = [
        (
            "COPY era5 TO '{out}' STORED AS ZARR OPTIONS ('chunks' 'time=96,lat=4,lon=4')",
            "SELECT * FROM era5",
            "t2m/zarr.json",
            [96, 4, 4],
            "zstd",
            "lat lon sp sst t2m time u10 v10 zarr.json",
        ),
        (
            "COPY (SELECT time, lat, lon, sp, t2m FROM era5) TO '{out}' STORED AS ZARR \
             OPTIONS ('zarr_format' '2', 'codec' 'gzip')",
            "SELECT time, lat, lon, sp, t2m FROM era5",
            "sp/.zarray",
            [24, 33, 64],
            "zlib",
            ".zattrs .zgroup .zmetadata lat lon sp t2m time",
        ),
        (
            "COPY (SELECT * FROM (SELECT time, lat, lon, u10 FROM era5) AS s) TO '{out}' \
             STORED AS ZARR OPTIONS ('chunks' 'lat=11', 'codec' 'none')",
            "SELECT time, lat, lon, u10 FROM era5",
            "u10/zarr.json",
            [24, 11, 64],
            "bytes",
            "lat lon time u10 zarr.json",
        ),
    ];
    for (i, (copy_sql, query, metadata, chunks, compression, names)) in cases.iter().enumerate() {
        let out = dir.join(format!("whole{i}.zarr"));
        let sql = copy_sql.replace("{out}", &out.to_string_lossy());
        let plan = text(&small, &format!("EXPLAIN {sql}")).await;
        assert!(plan.contains("ArrayCopyExec"), "{plan}");
        assert!(text(&small, &sql).await.contains("202752"), "{sql}");
        let got = read_back(&ctx, &format!("whole{i}"), &out, "*").await;
        let want = text(&ctx, &format!("{query} ORDER BY time, lat, lon")).await;
        assert_eq!(got, want, "{sql}");
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join(metadata)).unwrap()).unwrap();
        let shape = if json["zarr_format"] == 3 {
            &json["chunk_grid"]["configuration"]["chunk_shape"]
        } else {
            &json["chunks"]
        };
        assert_eq!(shape, &serde_json::json!(chunks), "{sql}");
        let codecs = json.to_string();
        assert!(
            codecs.contains(&format!("\"{compression}\"")),
            "{sql}: {codecs}"
        );
        assert_eq!(entries(&out).join(" "), *names, "{sql}");
    }
    // A filter on values, an integer column or dimensions out of order
    // write rows.
    for sql in [
        "COPY (SELECT * FROM era5 WHERE t2m > 280) TO '{out}' STORED AS ZARR",
        "COPY (SELECT time, lat, lon, CAST(t2m AS INT) AS t2m FROM era5) TO '{out}' STORED AS ZARR",
        "COPY (SELECT lat, time, lon, t2m FROM era5) TO '{out}' STORED AS ZARR",
    ] {
        let sql = sql.replace("{out}", &dir.join("rows.zarr").to_string_lossy());
        let plan = text(&ctx, &format!("EXPLAIN {sql}")).await;
        assert!(
            !plan.contains("ArrayCopy")
                && !plan.contains("SelectionCopy")
                && plan.contains("ZarrSink"),
            "{plan}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_whole_v3_table_copies_as_stored_as_v3_and_decoded_as_v2() {
    let dir = scratch("whole-v3");
    let ctx = new_context();
    ctx.register_zarr("v3", &common::fixture("v3_basic.zarr"), HashMap::new())
        .await
        .unwrap();
    let want = text(&ctx, "SELECT * FROM v3 ORDER BY time, lat, lon").await;
    // As v2, its float variables are decoded and written chunk by chunk.
    for (format, exec) in [("3", "ArrayCopyExec"), ("2", "SelectionCopyExec")] {
        let out = dir.join(format!("v{format}.zarr"));
        let sql = format!(
            "COPY v3 TO '{}' STORED AS ZARR OPTIONS ('zarr_format' '{format}')",
            out.display()
        );
        let plan = text(&ctx, &format!("EXPLAIN {sql}")).await;
        assert!(plan.contains(exec), "{plan}");
        copy(&ctx, &sql).await.unwrap();
        let got = read_back(&ctx, &format!("out{format}"), &out, "*").await;
        assert_eq!(got, want, "v{format}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_whole_table_copy_that_fails_midway_leaves_nothing() {
    let dir = scratch("whole-corrupt");
    let ctx = new_context();
    let store = common::fixture("bad_corrupt_chunk.zarr");
    ctx.register_zarr("bad", &store, HashMap::new())
        .await
        .unwrap();
    let out = dir.join("out.zarr");
    let sql = format!("COPY bad TO '{}' STORED AS ZARR", out.display());
    assert!(text(&ctx, &format!("EXPLAIN {sql}"))
        .await
        .contains("ArrayCopyExec"));
    let err = copy(&ctx, &sql).await.unwrap_err().to_string();
    assert!(
        err.contains("bad_corrupt_chunk.zarr") && err.contains("chunk 't2m/"),
        "{err}"
    );
    assert!(entries(&dir).is_empty(), "{:?}", entries(&dir));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_table_is_copied_to_an_object_store() {
    let runtime = RuntimeEnvBuilder::new().build_arc().unwrap();
    let memory = common::memory_store(&runtime, "out");
    let ctx = new_context_with(session_config(), runtime);
    ctx.register_zarr("era5", &demo(), HashMap::new())
        .await
        .unwrap();
    let keys = |prefix: &'static str| common::objects(&memory, prefix);
    let sql = "COPY era5 TO 'memory://out/era5.zarr' STORED AS ZARR \
               OPTIONS ('chunks' 'time=96,lat=8,lon=8')";
    assert!(text(&ctx, sql).await.contains("202752"));
    assert!(keys("era5.zarr").await > 8);
    ctx.register_zarr("back", "memory://out/era5.zarr", HashMap::new())
        .await
        .unwrap();
    assert_eq!(
        text(&ctx, "SELECT * FROM back ORDER BY time, lat, lon").await,
        text(&ctx, "SELECT * FROM era5 ORDER BY time, lat, lon").await
    );
    // An existing target is refused, and stays.
    let before = keys("era5.zarr").await;
    let err = copy(&ctx, sql).await.unwrap_err().to_string();
    assert!(err.contains("already exists"), "{err}");
    assert_eq!(keys("era5.zarr").await, before);
    // A copy that fails midway erases what it wrote.
    ctx.register_zarr(
        "bad",
        &common::fixture("bad_corrupt_chunk.zarr"),
        HashMap::new(),
    )
    .await
    .unwrap();
    let err = copy(&ctx, "COPY bad TO 'memory://out/bad.zarr' STORED AS ZARR")
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("bad_corrupt_chunk.zarr"), "{err}");
    assert_eq!(keys("bad.zarr").await, 0);
    // A selection with computed variables goes chunk by chunk too.
    let north = "SELECT time, lat, lon, t2m - 273.15 AS t2m_c FROM era5 WHERE lat > 0";
    copy(
        &ctx,
        &format!("COPY ({north}) TO 'memory://out/north.zarr' STORED AS ZARR"),
    )
    .await
    .unwrap();
    ctx.register_zarr("north", "memory://out/north.zarr", HashMap::new())
        .await
        .unwrap();
    assert_eq!(
        text(&ctx, "SELECT * FROM north ORDER BY time, lat, lon").await,
        text(&ctx, &format!("{north} ORDER BY time, lat, lon")).await
    );
    // So do rolling windows.
    let rolling = "SELECT time, lat, lon, avg(t2m) OVER (PARTITION BY lat, lon ORDER BY time \
                   ROWS BETWEEN 5 PRECEDING AND CURRENT ROW) AS m FROM era5 WHERE lon < 90";
    copy(
        &ctx,
        &format!("COPY ({rolling}) TO 'memory://out/rolling.zarr' STORED AS ZARR"),
    )
    .await
    .unwrap();
    ctx.register_zarr("rolling", "memory://out/rolling.zarr", HashMap::new())
        .await
        .unwrap();
    assert_eq!(
        text(&ctx, "SELECT * FROM rolling ORDER BY time, lat, lon").await,
        text(&ctx, &format!("{rolling} ORDER BY time, lat, lon")).await
    );
    // Rows (an aggregate, and a filter on values: cells without a row are
    // missing) are written there too, through the same atomic writer.
    let rows = [
        (
            "mean",
            "SELECT lat, lon, avg(t2m) AS t FROM era5 GROUP BY lat, lon",
            "SELECT lat, lon, t FROM mean ORDER BY lat, lon",
            " ORDER BY lat, lon",
        ),
        (
            "warm",
            "SELECT time, lat, lon, t2m FROM era5 WHERE t2m > 280",
            "SELECT time, lat, lon, t2m FROM warm WHERE t2m IS NOT NULL ORDER BY time, lat, lon",
            " ORDER BY time, lat, lon",
        ),
    ];
    for (name, query, read, order) in rows {
        let url = format!("memory://out/{name}.zarr");
        copy(&ctx, &format!("COPY ({query}) TO '{url}' STORED AS ZARR"))
            .await
            .unwrap();
        ctx.register_zarr(name, &url, HashMap::new()).await.unwrap();
        let want = text(&ctx, &format!("{query}{order}")).await;
        assert_eq!(text(&ctx, read).await, want, "{name}");
    }
    // A target holding anything is refused, and keeps what it holds.
    let (_, mean, read, order) = rows[0];
    let err = copy(
        &ctx,
        &format!("COPY ({mean}) TO 'memory://out/mean.zarr' STORED AS ZARR"),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("already exists"), "{err}");
    ctx.deregister_table("mean").unwrap();
    ctx.register_zarr("mean", "memory://out/mean.zarr", HashMap::new())
        .await
        .unwrap();
    let want = text(&ctx, &format!("{mean}{order}")).await;
    assert_eq!(text(&ctx, read).await, want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_selection_with_computed_variables_is_written_chunk_by_chunk() {
    let dir = scratch("selection");
    // 5 MB: the scan alone would need 5.4 MB and the rows 8 MB.
    let small = budget_context(5 << 20).await;
    let ctx = context().await;
    let cases = [
        // A box, time and (descending) latitude cut mid-chunk.
        (
            "SELECT time, lat, lon, t2m - 273.15 AS t2m_c, u10 * 2 AS u2, sst FROM era5 \
             WHERE lat BETWEEN -31 AND 47 AND time >= TIMESTAMP '2020-01-03T06:00:00'",
            "'chunks' 'time=7,lat=5', 'codec' 'zstd'",
        ),
        // Scattered longitudes and a v2 target.
        (
            "SELECT time, lat, lon, sqrt(u10 * u10 + v10 * v10) AS wind FROM era5 \
             WHERE lon IN (0, 5.625, 90, 354.375) OR lon > 300",
            "'zarr_format' '2', 'codec' 'blosc'",
        ),
        // Every cell, a computed variable and a variable as it is.
        (
            "SELECT time, lat, lon, t2m, sp / 100.0 AS sp_hpa FROM era5",
            "'chunks' 'time=96,lat=4,lon=4'",
        ),
    ];
    for (i, (query, options)) in cases.iter().enumerate() {
        let out = dir.join(format!("sel{i}.zarr"));
        let sql = format!(
            "COPY ({query}) TO '{}' STORED AS ZARR OPTIONS ({options})",
            out.display()
        );
        let plan = text(&small, &format!("EXPLAIN {sql}")).await;
        assert!(plan.contains("SelectionCopyExec"), "{plan}");
        copy(&small, &sql).await.unwrap();
        let columns = query
            .split(" FROM ")
            .next()
            .unwrap()
            .trim_start_matches("SELECT ");
        let names: Vec<&str> = columns
            .split(", ")
            .map(|c| c.rsplit(" AS ").next().unwrap())
            .collect();
        let got = read_back(&ctx, &format!("sel{i}"), &out, &names.join(", ")).await;
        let want = text(&ctx, &format!("{query} ORDER BY time, lat, lon")).await;
        assert_eq!(got, want, "{sql}");
    }
    // Nothing stays in the work directory, and a failure leaves no target.
    let bad = new_context();
    bad.register_zarr(
        "bad",
        &common::fixture("bad_corrupt_chunk.zarr"),
        HashMap::new(),
    )
    .await
    .unwrap();
    let out = dir.join("bad.zarr");
    let err = copy(
        &bad,
        &format!(
            "COPY (SELECT time, lat, lon, t2m * 2 AS t2 FROM bad) TO '{}'",
            out.display()
        ),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("bad_corrupt_chunk.zarr"), "{err}");
    assert!(!out.exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A COPY of a selection reports the decoded bytes it read (the selected
/// cells of the variables its expressions read, as the store's metadata
/// sizes them) and wrote (every cell of the variables written), whether
/// its chunks go straight to the target or through a rechunk, which reads
/// and writes more.
#[tokio::test]
async fn a_copy_of_a_selection_reports_the_bytes_it_read_and_wrote() {
    let dir = scratch("selection_bytes");
    let ctx = context().await;
    let zarray: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{}/t2m/.zarray", demo())).unwrap())
            .unwrap();
    assert_eq!(zarray["dtype"], "<f4");
    let shape: Vec<u64> = (zarray["shape"].as_array().unwrap().iter())
        .map(|n| n.as_u64().unwrap())
        .collect();
    let lats = text(
        &ctx,
        "SELECT count(DISTINCT lat) AS n FROM era5 WHERE lat BETWEEN -31 AND 47",
    )
    .await;
    let lats: u64 = (lats
        .lines()
        .nth(3)
        .unwrap()
        .trim_matches(|c| c == '|' || c == ' '))
    .parse()
    .unwrap();
    let cells = shape[0] * lats * shape[2];
    let query = "SELECT time, lat, lon, t2m - 273.15 AS c, u10 * 2 AS u FROM era5 \
                 WHERE lat BETWEEN -31 AND 47";
    // Arrays written, sized as the written store's metadata says.
    let written_bytes = |store: &str, arrays: &[&str]| -> u64 {
        (arrays.iter())
            .map(|v| {
                let path = dir.join(store).join(v).join(".zarray");
                let zarray: serde_json::Value =
                    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
                let dtype = zarray["dtype"].as_str().unwrap().to_string();
                let cells: u64 = (zarray["shape"].as_array().unwrap().iter())
                    .map(|n| n.as_u64().unwrap())
                    .product();
                dtype[2..].parse::<u64>().unwrap() * cells
            })
            .sum::<u64>()
    };
    let variables = ["c", "u"];
    let (node, counters) = ("SelectionCopyExec", ["bytes_read", "bytes_written"]);
    // Chunks of the store's length along time: written straight.
    let direct = format!(
        "COPY ({query}) TO '{}' STORED AS ZARR OPTIONS ('chunks' 'time=24', 'zarr_format' '2')",
        dir.join("direct.zarr").display(),
    );
    let plan = text(&ctx, &format!("EXPLAIN {direct}")).await;
    assert!(!plan.contains("-> rechunk"), "{plan}");
    let ([read, written], shown) = common::executed_counters(&ctx, &direct, node, counters).await;
    assert_eq!(read, cells * 2 * 4, "{shown}");
    assert_eq!(written, written_bytes("direct.zarr", &variables), "{shown}");
    // Chunks that cut the store's: through an intermediate store and a rechunk,
    // which reads and writes them again.
    let rechunked = format!(
        "COPY ({query}) TO '{}' STORED AS ZARR OPTIONS ('chunks' 'time=5,lat=3', 'zarr_format' '2')",
        dir.join("rechunked.zarr").display()
    );
    let plan = text(&ctx, &format!("EXPLAIN {rechunked}")).await;
    assert!(plan.contains("-> rechunk"), "{plan}");
    let ([read, written], shown) =
        common::executed_counters(&ctx, &rechunked, node, counters).await;
    // The rechunk copies the coordinates too.
    let step1 = written_bytes("rechunked.zarr", &variables);
    let step2 = step1 + written_bytes("rechunked.zarr", &["time", "lat", "lon"]);
    assert!(read >= cells * 2 * 4 + step2, "{shown}");
    assert_eq!(written, step1 + step2, "{shown}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The attributes written for array `name` of the store at `dir` (v3's
/// `zarr.json` or v2's `.zattrs`), less the writer's own mark.
fn written_attributes(dir: &std::path::Path, name: &str) -> serde_json::Value {
    let v3 = dir.join(name).join("zarr.json");
    let mut attributes = match std::fs::read(&v3) {
        Ok(bytes) => {
            serde_json::from_slice::<serde_json::Value>(&bytes).unwrap()["attributes"].clone()
        }
        Err(_) => {
            let v2 = dir.join(name).join(".zattrs");
            let bytes = std::fs::read(&v2).unwrap_or_else(|e| panic!("{}: {e}", v2.display()));
            serde_json::from_slice(&bytes).unwrap()
        }
    };
    let map = attributes.as_object_mut().unwrap();
    map.remove("_zarrs");
    map.remove("_ARRAY_DIMENSIONS");
    attributes
}

/// The attributes xarray shows of a fixture's array: those of its
/// `zarr.json` less what decoding uses (the fixtures' writer, xarray, put
/// them there).
fn fixture_attributes(store: &str, name: &str, drop: &[&str]) -> serde_json::Value {
    let path = std::path::Path::new(&common::fixture(store))
        .join(name)
        .join("zarr.json");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let mut attributes = json["attributes"].clone();
    let map = attributes.as_object_mut().unwrap();
    for key in ["_FillValue"].iter().chain(drop) {
        map.remove(*key);
    }
    attributes
}

#[tokio::test]
async fn a_copied_aggregate_keeps_the_attributes_of_what_it_names() {
    let dir = scratch("coordinate-attributes");
    let ctx = new_context();
    ctx.register_zarr("b", &common::fixture("v3_basic.zarr"), HashMap::new())
        .await
        .unwrap();
    let lat = fixture_attributes("v3_basic.zarr", "lat", &[]);
    let lon = fixture_attributes("v3_basic.zarr", "lon", &[]);
    // A time decoded to timestamps keeps its names; its units and calendar
    // are the writer's own.
    let time = fixture_attributes("v3_basic.zarr", "time", &["units", "calendar"]);
    assert!(lat["units"] == "degrees_north" && time["long_name"] == "time");
    // (name, query, each coordinate's expected attributes)
    type Case<'a> = (&'a str, &'a str, &'a [(&'a str, &'a serde_json::Value)]);
    let cases: [Case; 4] = [
        // The dense reduction.
        (
            "zonal",
            "SELECT lat, lon, avg(t2m) AS t FROM b GROUP BY lat, lon",
            &[("lat", &lat), ("lon", &lon)],
        ),
        // Daily means: a time truncated to the day is still a time.
        (
            "daily",
            "SELECT date_trunc('day', time) AS time, lat, max(t2m) AS t FROM b GROUP BY 1, lat",
            &[("time", &time), ("lat", &lat)],
        ),
        // A coarser grid keeps the units of the one it coarsens.
        (
            "coarse",
            "SELECT floor(lon / 90) * 90 AS lon, avg(u10) AS t FROM b GROUP BY 1",
            &[("lon", &lon)],
        ),
        // A month number named `time` is not a time: no time attributes.
        (
            "month",
            "SELECT extract(month FROM time) AS time, avg(t2m) AS t FROM b GROUP BY 1",
            &[("time", &serde_json::json!({}))],
        ),
    ];
    for (name, query, expected) in cases {
        let out = dir.join(format!("{name}.zarr"));
        let sql = format!("COPY ({query}) TO '{}' STORED AS ZARR", out.display());
        copy(&ctx, &sql).await.unwrap();
        for (coordinate, want) in expected {
            let got = written_attributes(&out, coordinate);
            let want = match *coordinate {
                // The writer's CF encoding of a time.
                "time" if name != "month" => {
                    let mut want = (*want).clone();
                    want["units"] = got["units"].clone();
                    want["calendar"] = got["calendar"].clone();
                    want
                }
                _ => (*want).clone(),
            };
            assert_eq!(&got, &want, "{name}: {coordinate}");
        }
        // The variables computed are not the source's: no attributes.
        assert_eq!(
            written_attributes(&out, "t").as_object().map(|m| m.len()),
            Some(0)
        );
    }
    // A variable named as the table's keeps its attributes through a
    // reduction, as in xarray (`ds.t2m.resample(time="1D").mean()`).
    let out = dir.join("daily_t2m.zarr");
    let sql = format!(
        "COPY (SELECT date_trunc('day', time) AS time, lat, lon, avg(t2m) AS t2m FROM b \
         GROUP BY 1, lat, lon) TO '{}' STORED AS ZARR",
        out.display()
    );
    copy(&ctx, &sql).await.unwrap();
    let t2m = fixture_attributes("v3_basic.zarr", "t2m", &[]);
    assert!(t2m["units"] == "K");
    assert_eq!(written_attributes(&out, "t2m"), t2m);
    // Two registered tables whose latitudes disagree on an attribute: the
    // copy keeps what they agree on.
    ctx.register_zarr("c", &common::fixture("climate.zarr"), HashMap::new())
        .await
        .unwrap();
    let out = dir.join("two.zarr");
    let sql = format!(
        "COPY (SELECT lat, avg(t2m) AS t FROM b GROUP BY lat) TO '{}' STORED AS ZARR",
        out.display()
    );
    copy(&ctx, &sql).await.unwrap();
    assert_eq!(written_attributes(&out, "lat"), serde_json::json!({}));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A copy's coordinates are counted at what writing them holds (a chunk
/// of the longest one's values, 64 KiB at least), not at the most any
/// coordinate could (4 MiB): a copy of the demo runs in 1 MB, and a copy
/// of the climate fixture whose steps fit 48 KB is refused there while
/// planning, naming the coordinates.
#[tokio::test]
async fn a_copy_counts_its_coordinates_at_their_length() {
    let dir = scratch("coordinates");
    let query = "SELECT time, lat, lon, t2m - 273.15 AS c FROM era5 WHERE lat > 0";
    let small = budget_context(1 << 20).await;
    let out = dir.join("small.zarr");
    let sql = format!("COPY ({query}) TO '{}' STORED AS ZARR", out.display());
    let plan = text(&small, &format!("EXPLAIN {sql}")).await;
    assert!(plan.contains("SelectionCopyExec"), "{plan}");
    copy(&small, &sql).await.unwrap();
    let ctx = context().await;
    let got = read_back(&ctx, "small", &out, "time, lat, lon, c").await;
    let want = text(&ctx, &format!("{query} ORDER BY time, lat, lon")).await;
    assert_eq!(got, want);
    let tiny = common::budget_session(48 << 10, "c", &common::fixture("climate.zarr")).await;
    let out = dir.join("tiny.zarr");
    let sql = format!(
        "COPY (SELECT time, lat, lon, t2m - u10 AS v FROM c WHERE lat > 10) TO '{}' STORED AS ZARR",
        out.display()
    );
    let refused = copy(&tiny, &sql).await.unwrap_err().to_string();
    for needle in ["COPY TO Zarr over", "coordinates", "64.0 KB", "48.0 KB"] {
        assert!(refused.contains(needle), "{needle}: {refused}");
    }
    assert!(!out.exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A COPY whose dimension filters select no cell writes the empty result
/// as any empty result is written (a store of zero-length dimensions with
/// its variables), whether it is a selection with computed variables or
/// rolling windows, which are otherwise written chunk by chunk (they were
/// refused: "the filters select no cell"; found by the differential
/// fuzzer, `differential.rs`).
#[tokio::test]
async fn a_copy_selecting_no_cell_writes_an_empty_store() {
    let dir = scratch("empty");
    let ctx = context().await;
    let queries = [
        "SELECT time, lat, lon, t2m - 273.15 AS x FROM era5 WHERE lat > 1000",
        "SELECT time, lat, lon, avg(t2m) OVER (PARTITION BY lat, lon ORDER BY time ROWS \
         BETWEEN 3 PRECEDING AND CURRENT ROW) AS r FROM era5 WHERE time < '1900-01-01'",
    ];
    for (i, sql) in queries.iter().enumerate() {
        let target = dir.join(format!("empty{i}.zarr"));
        let target = target.to_string_lossy();
        copy(
            &ctx,
            &format!("COPY ({sql}) TO '{target}' STORED AS ZARR OPTIONS ('dims' 'time,lat,lon')"),
        )
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
        let back = text(
            &ctx,
            &format!("SELECT count(*) AS n FROM read_zarr('{target}')"),
        )
        .await;
        assert!(back.contains("| 0 "), "{sql}: {back}");
        let df = ctx
            .sql(&format!("SELECT * FROM read_zarr('{target}')"))
            .await
            .unwrap();
        let columns: Vec<String> = (df.schema().fields().iter())
            .map(|f| f.name().clone())
            .collect();
        let variable = if i == 0 { "x" } else { "r" };
        assert_eq!(columns, ["time", "lat", "lon", variable], "{sql}");
    }
}

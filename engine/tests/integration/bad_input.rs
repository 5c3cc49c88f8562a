//! Bad input gets a clear error naming the store, array and chunk, never a
//! panic and never a partial result.

use crate::common;

use std::collections::HashMap;

use common::fixture;
use zarrfusion::{new_context, ZarrContextExt};

/// Registers `store` and runs `SELECT *`; returns the error text.
async fn error_of(store: &str, options: &[(&str, &str)]) -> String {
    let ctx = new_context();
    let options: HashMap<String, String> = options
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let path = fixture(store);
    if let Err(e) = ctx.register_zarr("t", &path, options).await {
        return e.to_string();
    }
    match ctx.sql("SELECT * FROM t").await {
        Err(e) => e.to_string(),
        Ok(df) => match df.collect().await {
            Err(e) => e.to_string(),
            Ok(batches) => panic!("{store}: expected an error, got {} batches", batches.len()),
        },
    }
}

fn assert_mentions(store: &str, message: &str, needles: &[&str]) {
    for needle in needles {
        assert!(
            message.contains(needle),
            "{store}: error should mention '{needle}': {message}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_path() {
    let message = error_of("no_such_store.zarr", &[]).await;
    assert_mentions(
        "missing",
        &message,
        &["no_such_store.zarr", "no such directory"],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn array_folder_without_metadata_is_an_error_not_a_silent_drop() {
    let message = error_of("bad_missing_metadata.zarr", &[]).await;
    assert_mentions(
        "bad_missing_metadata",
        &message,
        &["bad_missing_metadata.zarr", "'t2m'", "no metadata"],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_metadata() {
    let message = error_of("bad_corrupt_metadata.zarr", &[]).await;
    assert_mentions(
        "bad_corrupt_metadata",
        &message,
        &[
            "bad_corrupt_metadata.zarr",
            "'t2m'",
            "malformed metadata 't2m/zarr.json'",
        ],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_codec() {
    let message = error_of("bad_unknown_codec.zarr", &[]).await;
    assert_mentions(
        "bad_unknown_codec",
        &message,
        &["bad_unknown_codec.zarr", "'t2m'", "no_such_codec"],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_chunk() {
    let message = error_of("bad_truncated_chunk.zarr", &[]).await;
    assert_mentions(
        "bad_truncated_chunk",
        &message,
        &[
            "bad_truncated_chunk.zarr",
            "'t2m'",
            "chunk [0, 0, 0]",
            "t2m/0.0.0",
        ],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_chunk() {
    let message = error_of("bad_corrupt_chunk.zarr", &[]).await;
    assert_mentions(
        "bad_corrupt_chunk",
        &message,
        &[
            "bad_corrupt_chunk.zarr",
            "'t2m'",
            "chunk [0, 0, 0]",
            "t2m/c/0/0/0",
        ],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shape_disagreeing_with_dimension() {
    let message = error_of("bad_shape_mismatch.zarr", &[]).await;
    assert_mentions(
        "bad_shape_mismatch",
        &message,
        &[
            "bad_shape_mismatch.zarr",
            "'t2m'",
            "dimension 'lat'",
            "length 4",
            "5",
        ],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dims_naming_no_dimension_set() {
    let message = error_of("two_dimsets.zarr", &[("dims", "time,depth")]).await;
    assert_mentions(
        "two_dimsets",
        &message,
        &[
            "two_dimsets.zarr",
            "time,depth",
            "(time, lat, lon)",
            "(lat, lon)",
        ],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_option() {
    let message = error_of("v2_basic.zarr", &[("dimz", "lat")]).await;
    assert_mentions("v2_basic", &message, &["unknown Zarr table option 'dimz'"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_chunk_fails_the_query_even_with_a_limit_elsewhere() {
    // The corrupt chunk is the first one: no row may be returned as if complete.
    let ctx = new_context();
    ctx.register_zarr("t", &fixture("bad_corrupt_chunk.zarr"), HashMap::new())
        .await
        .unwrap();
    let result = ctx
        .sql("SELECT sum(t2m) FROM t")
        .await
        .unwrap()
        .collect()
        .await;
    assert!(result.is_err(), "a sum over a corrupt chunk must fail");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codec_without_an_implementation() {
    // numcodecs Delta, a v2 filter zarrs does not implement.
    let message = error_of("codec_v2_delta_filter.zarr", &[]).await;
    assert_mentions(
        "codec_v2_delta_filter",
        &message,
        &["codec_v2_delta_filter.zarr", "'x'", "delta"],
    );
}

/// Chunks outside a filter are never read: in `bad_corrupt_chunk.zarr` only
/// chunk (0, 0, 0) of `t2m` is corrupt (time 0..4, lat 60..30, lon 0..90).
/// Filters that exclude it succeed; the same query without pushdown reads it and fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filters_never_read_chunks_outside_them() {
    for filter in [
        "lat <= 15",
        "lon >= 180",
        "time >= TIMESTAMP '2020-01-01T18:00:00'",
        "lat IN (15, 0) OR lat < -100",
    ] {
        let sql = format!("SELECT count(t2m) FROM t WHERE {filter}");
        for pushdown in [true, false] {
            let ctx = new_context();
            let mut options = HashMap::new();
            options.insert("pushdown".to_string(), pushdown.to_string());
            ctx.register_zarr("t", &fixture("bad_corrupt_chunk.zarr"), options)
                .await
                .unwrap();
            let result = ctx.sql(&sql).await.unwrap().collect().await;
            match (pushdown, result) {
                (true, Ok(_)) | (false, Err(_)) => {}
                (true, Err(e)) => panic!("{filter}: read a chunk outside the filter: {e}"),
                (false, Ok(_)) => panic!("{filter}: the corrupt chunk was not detected"),
            }
        }
    }
}

/// An FFT over a corrupt or truncated chunk fails by either path (whole
/// lines, four-step) with the store, variable and chunk named, and its
/// `COPY TO` leaves neither an output store nor scratch arrays behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_chunk_fails_a_transform_by_either_path_and_writes_nothing() {
    let cases = [
        ("bad_corrupt_chunk.zarr", "t2m/c/0/0/0"),
        ("bad_truncated_chunk.zarr", "t2m/0.0.0"),
    ];
    for (store, key) in cases {
        for strategy in ["whole_lines", "four_step"] {
            let dir = common::scratch(&format!("fft-bad-{strategy}"));
            let work = dir.join("work");
            std::fs::create_dir_all(&work).unwrap();
            let ctx = new_context();
            ctx.register_zarr("t", &fixture(store), HashMap::new())
                .await
                .unwrap();
            for set in [
                format!("SET zarrfusion.fft_strategy = '{strategy}'"),
                format!("SET zarrfusion.work_dir = '{}'", work.display()),
            ] {
                ctx.sql(&set).await.unwrap();
            }
            // time has 6 = 2 × 3 values: the four-step path can split it.
            let fft = "fft('t', 't2m', dims => 'time')";
            let out = dir.join("spec.zarr");
            for sql in [
                format!("SELECT * FROM {fft}"),
                format!(
                    "COPY (SELECT * FROM {fft}) TO '{}' STORED AS ZARR",
                    out.display()
                ),
            ] {
                let result = match ctx.sql(&sql).await {
                    Ok(df) => df.collect().await.map(|_| ()),
                    Err(e) => Err(e),
                };
                let message = result
                    .err()
                    .unwrap_or_else(|| panic!("{store} {strategy}: {sql} succeeded"))
                    .to_string();
                let context = format!("{store} {strategy}: {sql}");
                assert_mentions(&context, &message, &[store, "t2m", key]);
            }
            assert!(
                !out.exists(),
                "{store} {strategy}: a failed COPY left {out:?}"
            );
            assert_eq!(
                common::entries(&work),
                Vec::<String>::new(),
                "{store} {strategy}: scratch left in work_dir"
            );
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
}

/// Writes a v3 group at `dir` with a coordinate `x` of `len` `float64`
/// values in chunks of `chunk` (none stored, or `values` as chunk 0) and a
/// variable `t(x)`.
fn store_with_coordinate(dir: &std::path::Path, len: u64, chunk: u64, values: Option<&[f64]>) {
    let array = |shape: u64, dtype: &str, fill: &str| {
        format!(
            r#"{{"zarr_format":3,"node_type":"array","shape":[{shape}],"data_type":"{dtype}",
            "chunk_grid":{{"name":"regular","configuration":{{"chunk_shape":[{chunk}]}}}},
            "chunk_key_encoding":{{"name":"default","configuration":{{"separator":"/"}}}},
            "fill_value":{fill},"codecs":[{{"name":"bytes","configuration":{{"endian":"little"}}}}],
            "dimension_names":["x"],"attributes":{{}}}}"#
        )
    };
    std::fs::create_dir_all(dir.join("x/c")).unwrap();
    std::fs::create_dir_all(dir.join("t")).unwrap();
    std::fs::write(
        dir.join("zarr.json"),
        r#"{"zarr_format":3,"node_type":"group","attributes":{}}"#,
    )
    .unwrap();
    std::fs::write(dir.join("x/zarr.json"), array(len, "float64", "0.0")).unwrap();
    std::fs::write(dir.join("t/zarr.json"), array(len, "float32", "0.0")).unwrap();
    if let Some(values) = values {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(dir.join("x/c/0"), bytes).unwrap();
    }
}

/// The error registering the store at `path` gives, within 5 seconds.
async fn refused_at_once(path: &str) -> String {
    let started = std::time::Instant::now();
    let message = match new_context().register_zarr("t", path, HashMap::new()).await {
        Err(e) => e.to_string(),
        Ok(()) => panic!("{path} was accepted"),
    };
    assert!(started.elapsed().as_secs() < 5, "{:?}", started.elapsed());
    message
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinate_too_long_to_read_or_hold_is_refused_with_the_numbers() {
    use datafusion::execution::runtime_env::RuntimeEnvBuilder;
    use zarrfusion::session::new_context_with;

    // Metadata declaring 2^50 positions: refused at once, nothing read
    // (before, opening read fill values piece after piece for ever).
    let dir = common::scratch("huge-coordinate");
    store_with_coordinate(&dir, 1 << 50, 1000, None);
    let path = dir.to_string_lossy().into_owned();
    let message = refused_at_once(&path).await;
    assert_mentions(
        "huge-coordinate",
        &message,
        &[&path, "'x'", "1125899906842624 values", "4.0 GB"],
    );

    // 4096 values (32 KB decoded) that follow no formula: held whole, so
    // they must fit allowed_mem.
    let dir = common::scratch("held-coordinate");
    let values: Vec<f64> = (0..4096u32).map(|i| f64::from(i * i % 977)).collect();
    store_with_coordinate(&dir, 4096, 4096, Some(&values));
    let path = dir.to_string_lossy().into_owned();
    let runtime = |bytes: usize| {
        RuntimeEnvBuilder::new()
            .with_memory_limit(bytes, 1.0)
            .build_arc()
            .unwrap()
    };
    let small = new_context_with(datafusion::prelude::SessionConfig::new(), runtime(16 << 10));
    let message = match small.register_zarr("t", &path, HashMap::new()).await {
        Err(e) => e.to_string(),
        Ok(()) => panic!("a coordinate of 32 KB was held under allowed_mem 16 KB"),
    };
    assert_mentions(
        "held-coordinate",
        &message,
        &[
            &path,
            "'x'",
            "4096 values",
            "32.0 KB",
            "allowed_mem",
            "16.0 KB",
        ],
    );
    let roomy = new_context_with(datafusion::prelude::SessionConfig::new(), runtime(64 << 20));
    roomy
        .register_zarr("t", &path, HashMap::new())
        .await
        .unwrap();
    let batches = roomy
        .sql("SELECT max(x) FROM t")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let max = datafusion::arrow::util::pretty::pretty_format_batches(&batches)
        .unwrap()
        .to_string();
    assert!(max.contains("976"), "{max}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lengths_that_disagree_are_refused_before_a_coordinate_is_read() {
    // A coordinate of 2^24 positions in chunks of one (128 MiB decoded,
    // under the limit on what opening reads, but 16.7 million chunks)
    // whose variable says it has 3: refused from the metadata at once.
    // Before, opening read every chunk of the coordinate first (minutes);
    // the fuzzer met it as a coordinate's shape shifted left by 20 bits.
    let dir = common::scratch("disagreeing-coordinate");
    store_with_coordinate(&dir, 1 << 24, 1, None);
    let variable = std::fs::read_to_string(dir.join("t/zarr.json")).unwrap();
    let shorter = variable.replacen(r#""shape":[16777216]"#, r#""shape":[3]"#, 1);
    assert_ne!(variable, shorter);
    std::fs::write(dir.join("t/zarr.json"), shorter).unwrap();
    let path = dir.to_string_lossy().into_owned();
    let message = refused_at_once(&path).await;
    assert_mentions(
        "disagreeing-coordinate",
        &message,
        &[
            &path,
            "'t'",
            "length 3 here, 16777216 in its coordinate array 'x'",
        ],
    );
}

/// Writes a v3 store whose one array `v` has `shape` and `chunk` (both
/// JSON arrays) and elements of `dtype`.
fn store_with_array(dir: &std::path::Path, shape: &str, chunk: &str, dtype: &str) {
    std::fs::create_dir_all(dir.join("v")).unwrap();
    std::fs::write(
        dir.join("zarr.json"),
        r#"{"zarr_format":3,"node_type":"group","attributes":{}}"#,
    )
    .unwrap();
    let dims: Vec<String> = (0..shape.split(',').count())
        .map(|i| format!("\"d{i}\""))
        .collect();
    let metadata = format!(
        r#"{{"zarr_format":3,"node_type":"array","shape":{shape},"data_type":"{dtype}",
        "chunk_grid":{{"name":"regular","configuration":{{"chunk_shape":{chunk}}}}},
        "chunk_key_encoding":{{"name":"default","configuration":{{"separator":"/"}}}},
        "fill_value":0,"codecs":[{{"name":"bytes","configuration":{{"endian":"little"}}}}],
        "dimension_names":[{}],"attributes":{{}}}}"#,
        dims.join(",")
    );
    std::fs::write(dir.join("v/zarr.json"), metadata).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shapes_and_chunks_declaring_more_than_64_pib_are_refused_at_open() {
    // Each case: its shape and chunk shape, element type, and the numbers
    // the error gives. Products that wrap u64 (2^80 cells; 2^61 cells of
    // 8 bytes) were computed modulo 2^64 before.
    let cases = [
        (
            "[1099511627776,1099511627776]",
            "[1024,1024]",
            "float32",
            "its shape",
            "4835703278458516698824704 bytes",
        ),
        (
            "[2305843009213693952]",
            "[1000]",
            "float64",
            "its shape",
            "18446744073709551616 bytes",
        ),
        (
            "[10,10]",
            "[4294967296,4294967296]",
            "uint8",
            "its chunk shape",
            "18446744073709551616 bytes",
        ),
        (
            "[72057594037927937]",
            "[1024]",
            "uint8",
            "its shape",
            "72057594037927937 bytes",
        ),
    ];
    for (i, (shape, chunk, dtype, what, bytes)) in cases.into_iter().enumerate() {
        let dir = common::scratch(&format!("huge-array-{i}"));
        store_with_array(&dir, shape, chunk, dtype);
        let path = dir.to_string_lossy().into_owned();
        let started = std::time::Instant::now();
        let message = match new_context()
            .register_zarr("t", &path, HashMap::new())
            .await
        {
            Err(e) => e.to_string(),
            Ok(()) => panic!("{shape} / {chunk} of {dtype} was accepted"),
        };
        assert!(started.elapsed().as_secs() < 5, "{:?}", started.elapsed());
        assert_mentions(shape, &message, &[&path, "'v'", what, bytes, "64 PiB"]);
    }
    // At the limit itself the array opens (and is not read).
    let dir = common::scratch("huge-array-at-limit");
    store_with_array(&dir, "[72057594037927936]", "[1024]", "uint8");
    let path = dir.to_string_lossy().into_owned();
    new_context()
        .register_zarr("t", &path, HashMap::new())
        .await
        .unwrap();
}

/// Found by the fuzz targets (`fuzz.rs`): a v2 `vlen-utf8` chunk whose
/// string length is corrupt made zarrs' codec index past its buffer and
/// panic; the query got "task panicked". Now the error names the chunk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_string_chunk_with_a_corrupt_length_is_an_error_naming_the_chunk() {
    let dir = common::scratch("corrupt-vlen");
    let store = dir.join("s.zarr");
    let from = std::path::PathBuf::from(fixture("string_coords_v2.zarr"));
    common::copy_dir(&from, &store);
    let chunk = store.join("station/0");
    let mut bytes = std::fs::read(&chunk).unwrap();
    bytes[42..46].copy_from_slice(&1u32.to_le_bytes());
    std::fs::write(&chunk, bytes).unwrap();
    let path = store.to_string_lossy().into_owned();
    let message = error_of(&path, &[]).await;
    assert_mentions("corrupt vlen", &message, &["'station'", "station/0"]);
    assert!(!message.contains("panicked"), "{message}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_declaring_billions_of_cells_past_the_array_is_an_error_not_an_abort() {
    // Found by the metadata fuzz target: raw_v3's `t` with a chunk shape of
    // 335544320 along lon (10 shifted by 25 bits) over a [7, 9, 10] array.
    // Naming the chunk of a failed read decoded whole chunks: 30 GB
    // allocated, and the process aborted.
    let dir = common::scratch("huge-chunk-shape");
    let store = dir.join("s.zarr");
    common::copy_dir(&std::path::PathBuf::from(fixture("raw_v3.zarr")), &store);
    let metadata = store.join("zarr.json");
    let mut doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&metadata).unwrap()).unwrap();
    let grid = &mut doc["consolidated_metadata"]["metadata"]["t"]["chunk_grid"];
    let shape = grid["configuration"]["chunk_shape"].as_array_mut().unwrap();
    *shape.last_mut().unwrap() = 335_544_320u64.into();
    std::fs::write(&metadata, serde_json::to_vec(&doc).unwrap()).unwrap();
    let message = error_of(&store.to_string_lossy(), &[("pushdown", "false")]).await;
    assert_mentions("huge chunk shape", &message, &["'t'"]);
    assert!(!message.contains("panicked"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_declaring_half_a_billion_inner_chunks_is_refused_not_an_abort() {
    // Found by the metadata fuzz target: the sharded fixture's `z` with a
    // shard shape of [6, 2^30] (8 shifted by 27 bits) in inner chunks of
    // [3, 4]: an index of 536,870,912 entries, 8 GiB that zarrs allocated
    // to read it, whatever the array's [10, 12] extent; the process aborted.
    let dir = common::scratch("huge-shard-index");
    let store = dir.join("s.zarr");
    common::copy_dir(
        &std::path::PathBuf::from(fixture("codec_v3_sharded_unwritten.zarr")),
        &store,
    );
    let metadata = store.join("zarr.json");
    let mut doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&metadata).unwrap()).unwrap();
    let grid = &mut doc["consolidated_metadata"]["metadata"]["z"]["chunk_grid"];
    grid["configuration"]["chunk_shape"] = serde_json::json!([6, 1u64 << 30]);
    std::fs::write(&metadata, serde_json::to_vec(&doc).unwrap()).unwrap();
    let message = error_of(&store.to_string_lossy(), &[("pushdown", "true")]).await;
    assert_mentions(
        "huge shard index",
        &message,
        &["'z'", "8589934592 bytes", "shard index"],
    );
    assert!(!message.contains("panicked"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dimension_of_a_trillion_positions_is_filtered_at_once_with_its_positions_right() {
    // A dimension of 10^12 positions without a coordinate array. Before,
    // any filter on it went through every position at planning (an
    // hour-long, uninterruptible loop holding a 125 GB mask), and rows
    // past position 2^32 showed their position modulo 2^32.
    let dir = common::scratch("trillion-positions");
    store_with_array(&dir, "[1000000000000]", "[1000000]", "float32");
    let ctx = new_context();
    ctx.register_zarr("t", &dir.to_string_lossy(), HashMap::new())
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let rows = |sql: &'static str| {
        let ctx = ctx.clone();
        async move {
            let batches = ctx.sql(sql).await.unwrap().collect().await.unwrap();
            datafusion::arrow::util::pretty::pretty_format_batches(&batches)
                .unwrap()
                .to_string()
        }
    };
    let picked = rows(
        "SELECT d0 FROM t WHERE d0 IN (5, 4294967301, 999999999999, 1000000000000) ORDER BY d0",
    )
    .await;
    let values: Vec<&str> = picked
        .lines()
        .filter_map(|l| l.strip_prefix("| "))
        .map(|l| l.trim_end_matches('|').trim())
        .collect();
    assert_eq!(
        values,
        ["d0", "5", "4294967301", "999999999999"],
        "{picked}"
    );
    let counted = rows(
        "SELECT count(*) AS n, min(d0) AS lo, max(d0) AS hi FROM t \
         WHERE d0 BETWEEN 4294967290 AND 4294967300 OR NOT (d0 <= 999999999990)",
    )
    .await;
    assert!(
        counted.contains("| 20 | 4294967290 | 999999999999 |"),
        "{counted}"
    );
    assert!(started.elapsed().as_secs() < 5, "{:?}", started.elapsed());
    // A filter that is not a comparison with literals is left to
    // DataFusion: planned at once (running it is a scan of 10^12 rows).
    let started = std::time::Instant::now();
    let plan = rows("EXPLAIN SELECT count(*) FROM t WHERE d0 % 7 = 3").await;
    assert!(plan.contains("d0@0 % 7 = 3"), "{plan}");
    assert!(started.elapsed().as_secs() < 2, "{:?}", started.elapsed());
}

/// Windows of 2 x 2 cells over `climate.zarr`'s `t2m` (608 x 6 x 6),
/// blocks of `block_bytes`, indexed with `index_threads` threads.
fn climate_windows(
    block_bytes: u64,
    index_threads: usize,
) -> Result<std::sync::Arc<zarrfusion::windows::Windows>, zarrfusion::windows::WindowError> {
    climate_samples(
        &[("lat", 2), ("lon", 2)],
        &zarrfusion::windows::SampleSpec::default(),
        block_bytes,
        index_threads,
    )
}

/// Samples of `sample` in windows of `sizes` over `climate.zarr`'s `t2m`
/// (608 x 6 x 6), as [`climate_windows`].
fn climate_samples(
    sizes: &[(&str, u64)],
    sample: &zarrfusion::windows::SampleSpec,
    block_bytes: u64,
    index_threads: usize,
) -> Result<std::sync::Arc<zarrfusion::windows::Windows>, zarrfusion::windows::WindowError> {
    use zarrfusion::table::{Selection, ZarrDataset, ZarrTableOptions};
    use zarrfusion::windows::{IndexOptions, WindowShape, Windows};
    let env = datafusion::execution::runtime_env::RuntimeEnv::default();
    let dataset =
        ZarrDataset::open(&fixture("climate.zarr"), &ZarrTableOptions::default(), &env).unwrap();
    let table = std::sync::Arc::new(dataset.table(None).unwrap());
    let selection = Selection::all(&table.shape());
    let shape = WindowShape {
        sizes: sizes.iter().map(|&(d, n)| (d.to_string(), n)).collect(),
        overlaps: vec![],
    };
    let index = IndexOptions {
        block_bytes,
        threads: index_threads,
        ..IndexOptions::default()
    };
    let variables = ["t2m".to_string()];
    Windows::new(table, &variables, selection, &shape, sample, &index).map(std::sync::Arc::new)
}

/// Found by the loader's fuzzing (`python/tests/test_loader_fuzz.py`): an
/// empty list of inputs was taken as every variable, an unknown dimension
/// in `input_dims` beside a jitter was reported as the jitter's error, and
/// a history longer than the selection named `targets`. Each names its
/// argument now.
#[test]
fn empty_inputs_unknown_window_dimensions_and_long_histories_name_their_argument() {
    use zarrfusion::windows::SampleSpec;
    let history = |steps| SampleSpec {
        history: steps,
        ..SampleSpec::default()
    };
    let cases = [
        (
            vec![("lat", 2), ("lon", 2)],
            SampleSpec {
                inputs: Some(vec![]),
                ..history(2)
            },
            "inputs: names no variable",
        ),
        (
            vec![("nope", 2)],
            SampleSpec {
                jitter: vec![("lat".into(), 1)],
                ..history(2)
            },
            "input_dims: unknown dimension 'nope'",
        ),
        (
            vec![("lat", 2), ("lon", 2)],
            SampleSpec {
                targets: vec![("t2m".into(), vec!["+1".into()])],
                ..history(609)
            },
            "history: a sample spans 610 steps",
        ),
    ];
    for (sizes, sample, words) in cases {
        let err = climate_samples(&sizes, &sample, 16 << 20, 0)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.starts_with(words), "{words}: {err}");
    }
    // Inputs left out are every variable.
    let every = climate_samples(&[("lat", 2), ("lon", 2)], &history(2), 16 << 20, 0).unwrap();
    assert!(every.len().unwrap() > 0);
}

/// Found by the window-argument fuzz target: thread counts of 2^64 - 1
/// (the loader's, the index's) started threads until the system refused
/// one, and the failed start aborted the process; a prefetch of 2^64 - 1
/// wrapped the memory projection; a batch of 2^32 windows drawn from
/// several blocks allocated room for all of them (3 TB) before the first
/// window, and aborted. Now the counts are refused naming the argument,
/// and the batch grows as windows come.
#[test]
fn absurd_loader_arguments_are_refused_or_bounded_not_an_abort() {
    use zarrfusion::windows::{LoaderOptions, Shuffle, WindowLoader};
    let err = climate_windows(16 << 20, usize::MAX)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("threads:") && err.contains("at most"),
        "{err}"
    );
    let windows = climate_windows(16 << 20, 0).unwrap();
    for (options, argument) in [
        (
            LoaderOptions {
                threads: usize::MAX,
                ..LoaderOptions::default()
            },
            "threads",
        ),
        (
            LoaderOptions {
                prefetch: usize::MAX,
                ..LoaderOptions::default()
            },
            "prefetch",
        ),
    ] {
        let err = WindowLoader::new(std::sync::Arc::clone(&windows), options)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.starts_with(&format!("{argument}:")),
            "{argument}: {err}"
        );
    }
    // Blocks of a few time steps: one batch draws from all of them.
    let windows = climate_windows(1760, 1).unwrap();
    let total = windows.len().unwrap();
    for shuffle in [
        Shuffle::None,
        Shuffle::Block {
            buffer_bytes: u64::MAX,
        },
    ] {
        let options = LoaderOptions {
            batch_size: 1 << 32,
            shuffle,
            prefetch: 1,
            threads: 1,
            memory_limit: None,
            ..LoaderOptions::default()
        };
        let loader = WindowLoader::new(std::sync::Arc::clone(&windows), options).unwrap();
        let lens: Vec<usize> = loader.epoch(0).map(|b| b.unwrap().len).collect();
        assert_eq!(lens, [total as usize], "{shuffle:?}");
    }
}

/// The error of opening `s3://bucket/x.zarr` on an endpoint that refuses
/// connections (object_store retries those) with `options` added; `None`
/// if it opened.
async fn retried_open_error(port: u16, options: &[(&str, &str)]) -> Option<String> {
    let ctx = new_context();
    let endpoint = format!("http://127.0.0.1:{port}");
    let mut all: HashMap<String, String> = [
        ("aws.endpoint", endpoint.as_str()),
        ("aws.allow_http", "true"),
        ("aws.skip_signature", "true"),
        ("aws.region", "us-east-1"),
    ]
    .into_iter()
    .chain(options.iter().copied())
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    all.insert("retry.max_retries".into(), "3".into());
    ctx.register_zarr("t", "s3://bucket/x.zarr", all)
        .await
        .err()
        .map(|e| e.to_string())
}

/// object_store draws each retry's wait from a range between the first
/// wait and the last times the base, and panicked on an empty range
/// (`retry.backoff.base` 1, a first wait of 0 or above the longest) or an
/// infinite one (a base of 1e300); durations past a week overflowed the
/// clock. Such values are refused naming the option; the extremes still
/// accepted retry to a clear error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_settings_that_would_panic_object_store_are_refused() {
    // A port nothing listens on: every connection is refused, and retried.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    for (options, needle) in [
        (
            vec![("retry.backoff.base", "1")],
            "retry.backoff.base must be a number above 1",
        ),
        (
            vec![("retry.backoff.base", "1e300")],
            "retry.backoff.base must be a number above 1 and at most 1000",
        ),
        (
            vec![("retry.backoff.init_backoff", "0ms")],
            "retry.backoff.init_backoff must be above 0",
        ),
        (
            vec![
                ("retry.backoff.init_backoff", "20ms"),
                ("retry.backoff.max_backoff", "10ms"),
            ],
            "retry.backoff.init_backoff (20ms) is longer than retry.backoff.max_backoff (10ms)",
        ),
        (
            vec![("retry.backoff.max_backoff", "9999999999s")],
            "at most 7days",
        ),
        (
            vec![("client.pool_idle_timeout", "9999999999s")],
            "client.pool_idle_timeout must be a duration of at most 7days",
        ),
    ] {
        let err = retried_open_error(port, &options).await.unwrap_or_default();
        assert!(err.contains(needle), "{options:?}: {err}");
    }
    for options in [
        vec![
            ("retry.backoff.base", "1.000001"),
            ("retry.backoff.init_backoff", "1ms"),
            ("retry.backoff.max_backoff", "1ms"),
        ],
        vec![
            ("retry.backoff.base", "1000"),
            ("retry.backoff.init_backoff", "1ms"),
            ("retry.backoff.max_backoff", "2ms"),
        ],
    ] {
        let started = std::time::Instant::now();
        let err = retried_open_error(port, &options).await.unwrap_or_default();
        assert!(
            err.contains("s3://bucket/x.zarr") && err.contains("after 3 retries"),
            "{options:?}: {err}"
        );
        assert!(
            started.elapsed() < std::time::Duration::from_secs(20),
            "{options:?}"
        );
    }
}

/// A batch size or a number of partitions near 2^64 made sorts and the
/// dense reduction panic (capacity overflow, a channel over tokio's most
/// permits), and 2^20 partitions took over a minute and gigabytes to plan
/// a rechunk of 120 cells: `SET` refuses them with the bound, and a config
/// built in Rust is held to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absurd_batch_sizes_and_partition_counts_are_refused_not_a_panic() {
    use datafusion::prelude::SessionConfig;
    use zarrfusion::config::{MAX_BATCH_ROWS, MAX_TARGET_PARTITIONS};
    let store = fixture("v3_basic.zarr");
    let queries = [
        "SELECT * FROM t ORDER BY lat",
        "SELECT lat, avg(t2m) FROM t GROUP BY lat",
        "SELECT count(*) FROM rechunk('t', lat => 1)",
    ];
    for (setting, value, needle) in [
        ("batch_size", u64::MAX, "at most 16777216"),
        ("batch_size", 1 << 62, "at most 16777216"),
        ("target_partitions", u64::MAX, "at most 1024"),
        ("target_partitions", 1 << 20, "at most 1024"),
    ] {
        let ctx = new_context();
        ctx.register_zarr("t", &store, HashMap::new())
            .await
            .unwrap();
        let set = format!("SET datafusion.execution.{setting} = {value}");
        let err = zarrfusion::session::sql(&ctx, &set)
            .await
            .err()
            .map(|e| e.to_string());
        let err = err.unwrap_or_default();
        assert!(
            err.contains(setting) && err.contains(needle),
            "{set}: {err}"
        );
        // Refused, so the session still runs with its own values.
        for query in queries {
            assert!(rows_of(&ctx, query).await > 0, "{set}; {query}");
        }
    }
    let config = SessionConfig::new()
        .with_batch_size(usize::MAX)
        .with_target_partitions(usize::MAX);
    let ctx = zarrfusion::new_context_with(config, std::sync::Arc::default());
    let options = ctx.state().config_options().clone();
    assert_eq!(usize::from(options.execution.batch_size), MAX_BATCH_ROWS);
    assert_eq!(options.execution.target_partitions, MAX_TARGET_PARTITIONS);
    ctx.register_zarr("t", &store, HashMap::new())
        .await
        .unwrap();
    for query in queries {
        assert!(rows_of(&ctx, query).await > 0, "{query}");
    }
}

/// The rows `query` gives in `ctx` (panics on an error, naming it).
async fn rows_of(ctx: &datafusion::prelude::SessionContext, query: &str) -> usize {
    let batches = zarrfusion::session::sql(ctx, query).await;
    let batches = batches.unwrap_or_else(|e| panic!("{query}: {e}"));
    let batches = batches
        .collect()
        .await
        .unwrap_or_else(|e| panic!("{query}: {e}"));
    batches.iter().map(|b| b.num_rows()).sum()
}

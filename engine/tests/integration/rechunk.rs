//! Rechunking stores written by zarr-python: the output holds the same
//! values as the input (every array, every element, fill values included)
//! in the requested chunks, for many chunk shapes with irregular edges,
//! under budgets that force intermediate arrays; refusals and failures
//! leave nothing behind.

use crate::common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use common::{entries, fixture};
use datafusion::execution::runtime_env::RuntimeEnv;
use zarrfusion::array::rechunk::{plan_store_rechunk, rechunk_store, RechunkOptions};
use zarrfusion::zarr::{discover_arrays, open_storage, root_name, StoreLocation};
use zarrs::array::{Array, ArrayBytes};

/// Per array: shape, chunk shape and every element's bytes (C order).
type Contents = HashMap<String, (Vec<u64>, Vec<u64>, String)>;

fn contents(store: &str) -> Contents {
    let runtime = RuntimeEnv::default();
    let location = StoreLocation::parse(store).unwrap();
    let opened =
        open_storage(store, &location, &HashMap::new(), &HashMap::new(), &runtime).unwrap();
    let storage = Arc::clone(&opened.storage);
    let mut out = HashMap::new();
    for entry in discover_arrays(&opened, store, root_name(store)).unwrap() {
        let array =
            Array::new_with_metadata(Arc::clone(&storage), &entry.path, entry.metadata).unwrap();
        let all = array.subset_all();
        let values = array
            .retrieve_array_subset::<ArrayBytes<'static>>(&all)
            .unwrap();
        let chunks = array
            .chunk_shape(&vec![0; array.shape().len()])
            .unwrap()
            .iter()
            .map(|n| n.get())
            .collect();
        out.insert(
            entry.name,
            (array.shape().to_vec(), chunks, format!("{values:?}")),
        );
    }
    out
}

/// A fresh scratch directory for one test, with a `work` directory in it.
fn scratch(name: &str) -> common::Scratch {
    let dir = common::scratch(&format!("rechunk-{name}"));
    std::fs::create_dir_all(dir.join("work")).unwrap();
    dir
}

/// Whether every array of `store` has elements of a fixed size.
fn fixed_size(store: &str) -> bool {
    let runtime = RuntimeEnv::default();
    let location = StoreLocation::parse(store).unwrap();
    let opened =
        open_storage(store, &location, &HashMap::new(), &HashMap::new(), &runtime).unwrap();
    (discover_arrays(&opened, store, root_name(store))
        .unwrap()
        .into_iter())
    .all(|entry| {
        let array =
            Array::new_with_metadata(Arc::clone(&opened.storage), &entry.path, entry.metadata);
        array.unwrap().data_type().fixed_size().is_some()
    })
}

fn chunks(spec: &[(&str, u64)]) -> Vec<(String, u64)> {
    spec.iter().map(|(d, n)| (d.to_string(), *n)).collect()
}

fn options(dir: &Path, allowed_mem: u64) -> RechunkOptions {
    RechunkOptions {
        allowed_mem,
        work_dir: Some(StoreLocation::Local(dir.join("work"))),
        threads: 2,
        ..RechunkOptions::default()
    }
}

/// Rechunks `source` and checks the output against the input.
fn check_round_trip(source: &str, spec: &[(&str, u64)], allowed_mem: u64, dir: &Path) -> usize {
    let target = dir.join("out.zarr");
    let _ = std::fs::remove_dir_all(&target);
    let summary = rechunk_store(
        source,
        &target,
        &chunks(spec),
        &options(dir, allowed_mem),
        &RuntimeEnv::default(),
        &AtomicBool::new(false),
    )
    .unwrap_or_else(|e| panic!("{source} to {spec:?} in {allowed_mem}: {e}"));
    let before = contents(source);
    let after = contents(target.to_str().unwrap());
    assert_eq!(before.len(), after.len(), "{source}: arrays");
    let mut stages = 0;
    for plan in &summary.arrays {
        let (shape, _, values) = &before[&plan.name];
        let (out_shape, out_chunks, out_values) = &after[&plan.name];
        assert_eq!(shape, out_shape, "{source} {}", plan.name);
        assert!(
            values == out_values,
            "{source} {} to {spec:?}: values differ",
            plan.name
        );
        for ((dim, &len), &chunk) in plan.dims.iter().zip(shape).zip(out_chunks) {
            if let Some((_, want)) = spec.iter().find(|(d, _)| d == dim) {
                assert_eq!(
                    chunk,
                    (*want).min(len),
                    "{source} {} along {dim}",
                    plan.name
                );
            }
        }
        assert!(plan.plan.projected_memory() <= allowed_mem);
        stages = stages.max(plan.plan.stages.len());
    }
    assert!(
        entries(&dir.join("work")).is_empty(),
        "intermediates removed"
    );
    // The decoded bytes the tasks read (the chunks each task's region
    // meets, counted as they ran) are what the plans counted by axis
    // (which size a variable-length element at a guess).
    if fixed_size(source) {
        let planned: u64 = summary.arrays.iter().map(|a| a.plan.bytes_read()).sum();
        assert_eq!(summary.bytes_read, planned, "{source} to {spec:?}");
    }
    stages
}

#[test]
fn every_fixture_store_round_trips() {
    let dir = scratch("fixtures");
    for store in [
        "v2_basic.zarr",
        "v3_basic.zarr",
        "nan_holes.zarr",
        "cf_time.zarr",
        "cf_packed.zarr",
        "cf_packed_v3.zarr",
        "desc_lat.zarr",
        "dtypes_v2.zarr",
        "dtypes_v3.zarr",
        "string_coords_v3.zarr",
        "codec_v2_blosc_lz4.zarr",
        "codec_v3_zstd.zarr",
        "codec_v3_transpose.zarr",
        "codec_v3_bytes_big_endian.zarr",
        "two_dimsets.zarr",
    ] {
        let source = fixture(store);
        // Every dimension of every array to 3: irregular edges everywhere.
        let plans = plan_store_rechunk(
            &source,
            &[],
            &RechunkOptions::default(),
            &RuntimeEnv::default(),
        )
        .unwrap();
        let mut all: Vec<(&str, u64)> = Vec::new();
        for p in &plans {
            for d in &p.dims {
                if !all.iter().any(|(n, _)| n == d) {
                    all.push((d.as_str(), 3));
                }
            }
        }
        check_round_trip(&source, &all, 64 << 20, &dir);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn chunk_shape_pairs_round_trip_through_intermediates() {
    let dir = scratch("pairs");
    let mut multistage = 0;
    for store in ["rechunk_source.zarr", "rechunk_source_v2.zarr"] {
        let source = fixture(store);
        for (spec, tight) in [
            (vec![("time", 37), ("lat", 4), ("lon", 4)], true),
            (vec![("time", 5), ("lat", 7), ("lon", 3)], true),
            (vec![("time", 37), ("lat", 1), ("lon", 1)], false),
            (vec![("time", 2)], true),
            (vec![("lat", 10), ("lon", 10)], false),
            (vec![("time", 1), ("lat", 29), ("lon", 31)], false),
        ] {
            // A loose budget: one pass. A tight one: a few source chunks.
            check_round_trip(&source, &spec, 256 << 20, &dir);
            if tight && check_round_trip(&source, &spec, 160 << 10, &dir) > 1 {
                multistage += 1;
            }
        }
    }
    assert!(multistage > 0, "no tight budget used an intermediate array");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_plan_that_cannot_fit_is_refused_before_anything_is_written() {
    let dir = scratch("refused");
    let target = dir.join("out.zarr");
    let run = |source: &str, spec: &[(&str, u64)], mem: u64| {
        rechunk_store(
            &fixture(source),
            &target,
            &chunks(spec),
            &options(&dir, mem),
            &RuntimeEnv::default(),
            &AtomicBool::new(false),
        )
        .unwrap_err()
        .to_string()
    };
    let small = run(
        "rechunk_source.zarr",
        &[("time", 37), ("lat", 29)],
        64 << 10,
    );
    assert!(
        small.contains("Rechunk over") && small.contains("allowed_mem) is 64.0 KB"),
        "{small}"
    );
    let unknown = run("rechunk_source.zarr", &[("level", 2)], 64 << 20);
    assert!(unknown.contains("unknown dimension 'level'"), "{unknown}");
    let sharded = run("codec_v3_sharded_unwritten.zarr", &[], 64 << 20);
    assert!(sharded.contains("sharded"), "{sharded}");
    assert!(!target.exists());
    assert_eq!(entries(&dir), vec!["work".to_string()]);
    // An existing target is never replaced.
    std::fs::create_dir(&target).unwrap();
    let existing = run("v2_basic.zarr", &[], 64 << 20);
    assert!(existing.contains("already exists"), "{existing}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_failing_rechunk_leaves_nothing() {
    let dir = scratch("failing");
    let target = dir.join("out.zarr");
    for store in ["bad_corrupt_chunk.zarr", "bad_truncated_chunk.zarr"] {
        let err = rechunk_store(
            &fixture(store),
            &target,
            &[],
            &options(&dir, 64 << 20),
            &RuntimeEnv::default(),
            &AtomicBool::new(false),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains(store) && err.contains("array") && err.contains("reading chunk '"),
            "{err}"
        );
        assert!(!target.exists(), "{store}");
        assert_eq!(entries(&dir), vec!["work".to_string()], "{store}");
        assert!(entries(&dir.join("work")).is_empty(), "{store}");
    }
    // Cancelled before it starts: nothing either.
    let err = rechunk_store(
        &fixture("v3_basic.zarr"),
        &target,
        &[],
        &options(&dir, 64 << 20),
        &RuntimeEnv::default(),
        &AtomicBool::new(true),
    )
    .unwrap_err();
    assert!(err.to_string().contains("cancel"), "{err}");
    assert_eq!(entries(&dir), vec!["work".to_string()]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A session whose temporary files go under `dir/work`, with `allowed_mem`.
fn sql_session(dir: &Path, allowed_mem: &str) -> datafusion::prelude::SessionContext {
    let runtime = datafusion::execution::runtime_env::RuntimeEnvBuilder::new()
        .with_memory_limit(zarrfusion::memory::parse_size(allowed_mem).unwrap(), 1.0)
        .with_temp_file_path(dir.join("work"))
        .build_arc()
        .unwrap();
    zarrfusion::new_context_with(zarrfusion::session_config(), runtime)
}

/// The rows of `sql`, sorted by their first three columns.
async fn sorted_rows(
    ctx: &datafusion::prelude::SessionContext,
    sql: &str,
) -> Vec<Vec<serde_json::Value>> {
    let batches = ctx.sql(sql).await.unwrap().collect().await.unwrap();
    let mut rows = common::rows(&batches);
    common::sort_rows(&mut rows, 3);
    rows
}

/// Everything under `dir`, recursively, as paths relative to it.
fn tree(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = e.path();
            out.push(path.strip_prefix(dir).unwrap().display().to_string());
            if path.is_dir() {
                stack.push(path);
            }
        }
    }
    out.sort();
    out
}

/// Checks that no rechunked store or intermediate is left in the work
/// directory. Plans are dropped by the tasks that ran them, just after the
/// result is returned: wait a little for them.
async fn assert_no_rechunk_files(dir: &Path) {
    let left = || -> Vec<String> {
        tree(&dir.join("work"))
            .into_iter()
            .filter(|p| p.contains("zarrfusion-rechunk"))
            .collect()
    };
    for _ in 0..50 {
        if left().is_empty() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("left behind: {:?}", left());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rechunk_table_function_reads_the_source_in_new_chunks_and_cleans_up() {
    use zarrfusion::ZarrContextExt;
    let dir = scratch("table-function");
    let ctx = sql_session(&dir, "256MB");
    let source = fixture("rechunk_source.zarr");
    ctx.register_zarr("src", &source, HashMap::new())
        .await
        .unwrap();
    // The plan shows the rechunk; planning it wrote only metadata and
    // coordinates, which go with the plan.
    let explain = ctx
        .sql("EXPLAIN SELECT * FROM rechunk('src', time => 5, lat => 7)")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let text = datafusion::arrow::util::pretty::pretty_format_batches(&explain)
        .unwrap()
        .to_string();
    assert!(text.contains("RechunkExec: store="), "{text}");
    assert!(text.contains("projected_memory="), "{text}");
    assert!(text.contains("ZarrScanExec"), "{text}");
    assert_no_rechunk_files(&dir).await;

    // Same rows as the source, in the new chunks' order of partitions.
    let expected = sorted_rows(&ctx, "SELECT * FROM src").await;
    for (time, lat) in [(5, 7), (1, 1), (1000, 3)] {
        let sql = format!("SELECT * FROM rechunk('src', time => {time}, lat => {lat})");
        let actual = sorted_rows(&ctx, &sql).await;
        common::assert_rows(&sql, &actual, &expected);
    }
    // A LIMIT stops early and still leaves nothing.
    let limited = ctx
        .sql("SELECT * FROM rechunk('src', lon => 3) LIMIT 5")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    assert_eq!(limited.iter().map(|b| b.num_rows()).sum::<usize>(), 5);
    assert_no_rechunk_files(&dir).await;

    // A budget the rechunk cannot fit is refused while planning.
    let small = sql_session(&dir, "16KB");
    small
        .register_zarr("src", &source, HashMap::new())
        .await
        .unwrap();
    let err = small
        .sql("SELECT * FROM rechunk('src', time => 37, lat => 29)")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("cannot fit allowed_mem"), "{err}");
    assert_no_rechunk_files(&dir).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Registers the rechunk fixture as `src` and checks that
/// `rechunk('src', time => 5)` gives its rows.
async fn rechunk_the_fixture_as_it_is(ctx: &datafusion::prelude::SessionContext) {
    use zarrfusion::ZarrContextExt;
    let source = fixture("rechunk_source.zarr");
    ctx.register_zarr("src", &source, HashMap::new())
        .await
        .unwrap();
    let expected = sorted_rows(ctx, "SELECT * FROM src").await;
    let actual = sorted_rows(ctx, "SELECT * FROM rechunk('src', time => 5)").await;
    common::assert_rows("rechunk", &actual, &expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scratch_stores_a_killed_process_left_are_swept_by_the_next_rechunk() {
    let dir = scratch("swept");
    let work = dir.join("work");
    // This machine's name, as stamps carry it.
    let stamp = zarrfusion::write::stamp::unique_suffix();
    let host = stamp.splitn(3, '-').nth(2).unwrap().to_string();
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let gone = child.id();
    child.wait().unwrap();
    let ours = std::process::id();
    let dead = work.join(format!("zarrfusion-rechunked-{gone}-1-{host}.zarr"));
    let running = work.join(format!("zarrfusion-rechunked-{ours}-2-{host}.zarr"));
    let elsewhere = work.join(format!("zarrfusion-rechunked-{gone}-3-x{host}.zarr"));
    for left in [&dead, &running, &elsewhere] {
        std::fs::create_dir_all(left.join("t2m")).unwrap();
    }
    let ctx = sql_session(&dir, "256MB");
    rechunk_the_fixture_as_it_is(&ctx).await;
    assert!(!dead.exists(), "a dead process's scratch store was kept");
    assert!(running.exists() && elsewhere.exists());
}

/// In an object-store work dir, a scratch store is swept only when its
/// marker names this boot of this machine and a process that is gone: a
/// host name alone (two machines may share one) is not enough.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scratch_stores_a_killed_process_left_in_an_object_store_are_swept_by_its_boot() {
    use futures::TryStreamExt;
    use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
    let runtime = Arc::new(datafusion::execution::runtime_env::RuntimeEnv::default());
    let memory = common::memory_store(&runtime, "sweep");
    let stamp = zarrfusion::write::stamp::unique_suffix();
    let host = stamp.splitn(3, '-').nth(2).unwrap().to_string();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .unwrap()
        .trim()
        .to_string();
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let gone = child.id();
    child.wait().unwrap();
    let ours = std::process::id();
    let marker = |pid: u32, boot: &str| {
        serde_json::json!({"pid": pid, "host": host, "boot": boot, "started": 1}).to_string()
    };
    // name -> (marker, whether the sweep removes it)
    let left = [
        (
            format!("zarrfusion-rechunked-{gone}-1-{host}.zarr"),
            Some(marker(gone, &boot)),
            true,
        ),
        (
            format!("zarrfusion-rechunked-{ours}-2-{host}.zarr"),
            Some(marker(ours, &boot)),
            false,
        ),
        (
            format!("zarrfusion-rechunked-{gone}-3-{host}.zarr"),
            Some(marker(gone, "another-boot")),
            false,
        ),
        (
            format!("zarrfusion-rechunked-{gone}-4-{host}.zarr"),
            None,
            false,
        ),
        (
            format!("zarrfusion-rechunked-{gone}-5-x{host}.zarr"),
            Some(marker(gone, &boot)),
            false,
        ),
    ];
    for (name, marker, _) in &left {
        let chunk = object_store::path::Path::from(format!("work/{name}/t2m/c/0/0/0"));
        memory
            .put(&chunk, PutPayload::from_static(b"chunk"))
            .await
            .unwrap();
        if let Some(marker) = marker {
            let key = object_store::path::Path::from(format!("work/{name}/.zarrfusion-scratch"));
            memory
                .put(&key, PutPayload::from(marker.clone().into_bytes()))
                .await
                .unwrap();
        }
    }
    let ctx = zarrfusion::new_context_with(zarrfusion::session_config(), runtime);
    ctx.sql("SET zarrfusion.work_dir = 'memory://sweep/work'")
        .await
        .unwrap();
    rechunk_the_fixture_as_it_is(&ctx).await;
    let keys: Vec<String> = memory
        .list(None)
        .map_ok(|m| m.location.to_string())
        .try_collect()
        .await
        .unwrap();
    for (name, _, swept) in &left {
        let kept = keys
            .iter()
            .filter(|k| k.starts_with(&format!("work/{name}/")))
            .count();
        assert_eq!(kept == 0, *swept, "{name}: {keys:?}");
    }
    // The query's own scratch store, marker included, is gone too.
    assert!(
        keys.iter().all(|k| left
            .iter()
            .any(|(name, _, _)| k.starts_with(&format!("work/{name}/")))),
        "{keys:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_object_store_work_dir_holds_the_intermediates_and_is_emptied() {
    use futures::TryStreamExt;
    use object_store::ObjectStore;
    use zarrfusion::ZarrContextExt;
    let dir = scratch("object-work");
    // An object store registered for memory:// URLs, as an s3:// one would be.
    let memory = Arc::new(object_store::memory::InMemory::new());
    let runtime = datafusion::execution::runtime_env::RuntimeEnvBuilder::new()
        .with_memory_limit(160 << 10, 1.0)
        .build_arc()
        .unwrap();
    runtime.register_object_store(
        &url::Url::parse("memory://scratch").unwrap(),
        Arc::clone(&memory) as Arc<dyn ObjectStore>,
    );
    let ctx = zarrfusion::new_context_with(zarrfusion::session_config(), runtime);
    let source = fixture("rechunk_source.zarr");
    ctx.register_zarr("src", &source, HashMap::new())
        .await
        .unwrap();
    let run = |sql: String| {
        let ctx = ctx.clone();
        async move {
            let batches = zarrfusion::session::sql(&ctx, &sql)
                .await?
                .collect()
                .await?;
            let mut rows = common::rows(&batches);
            common::sort_rows(&mut rows, 3);
            Ok::<_, datafusion::common::DataFusionError>(rows)
        }
    };
    let left = || async {
        memory
            .list(None)
            .try_collect::<Vec<_>>()
            .await
            .unwrap()
            .into_iter()
            .map(|m| m.location.to_string())
            .collect::<Vec<_>>()
    };
    run("SET zarrfusion.work_dir = 'memory://scratch/zf'".into())
        .await
        .unwrap();

    // A COPY whose tight budget needs an intermediate array.
    let out = dir.join("out.zarr");
    let copy = format!(
        "COPY src TO '{}' STORED AS ZARR OPTIONS ('chunks' 'time=37,lat=4,lon=4')",
        out.display()
    );
    let plan = run(format!("EXPLAIN {copy}")).await.unwrap();
    assert!(format!("{plan:?}").contains("2 stages"), "{plan:?}");
    run(copy.clone()).await.unwrap();
    // Read back without the tight budget.
    let reader = zarrfusion::new_context();
    reader
        .register_zarr("src", &source, HashMap::new())
        .await
        .unwrap();
    reader
        .register_zarr("out", out.to_str().unwrap(), HashMap::new())
        .await
        .unwrap();
    let expected = sorted_rows(&reader, "SELECT * FROM src").await;
    let copied = sorted_rows(&reader, "SELECT * FROM out").await;
    common::assert_rows("copy", &copied, &expected);
    assert!(left().await.is_empty(), "{:?}", left().await);

    // The rechunked store a query scans lives in the work directory too.
    let sql = "SELECT * FROM rechunk('src', time => 37, lat => 4, lon => 4)".to_string();
    common::assert_rows(&sql, &run(sql.clone()).await.unwrap(), &expected);
    for _ in 0..50 {
        if left().await.is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(left().await.is_empty(), "{:?}", left().await);

    // Nothing went to the local temporary directory's rechunk folders
    // either way: an unknown object store fails where the intermediates go.
    run("SET zarrfusion.work_dir = 'nowhere://bucket/zf'".into())
        .await
        .unwrap();
    let err = run(copy.replace("out.zarr", "out2.zarr"))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("work_dir") && err.contains("nowhere"), "{err}");
    assert!(!dir.join("out2.zarr").exists());
    let err = run(sql.clone()).await.unwrap_err().to_string();
    assert!(err.contains("work_dir") && err.contains("nowhere"), "{err}");
    // Back to a local path.
    let work = dir.join("work");
    run(format!("SET zarrfusion.work_dir = '{}'", work.display()))
        .await
        .unwrap();
    run(copy.replace("out.zarr", "out3.zarr")).await.unwrap();
    assert_no_rechunk_files(&dir).await;
    let _ = std::fs::remove_dir_all(&dir);
}

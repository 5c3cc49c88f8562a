//! The memory promise, measured: this test binary counts every byte the
//! process allocates (its global allocator wraps the system's), and each
//! test runs an operation over a store larger than `allowed_mem` and
//! checks that the bytes live at once never exceeded `allowed_mem`
//! (beyond what was live before it started; the allocator's own free
//! pages, which RSS also shows, are not counted: see docs/memory.md).
//!
//! The stores are written here with zarrs; the answers are checked
//! elsewhere (fft.rs, rechunk.rs, copy_to_zarr.rs against xarray and
//! numpy): these tests check the memory only, and that the operation ran.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::{Arc, Mutex};

use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::prelude::SessionContext;
use futures::StreamExt;
use zarrfusion::{new_context_with, session_config};
use zarrs::array::{Array, ArrayBytes, ArraySubset};
use zarrs::filesystem::FilesystemStore;

/// Counts the bytes live and the most live at once since the last reset.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

fn grew(bytes: isize) {
    let now = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is passed to the system allocator as it came; the
// counters only observe the sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size() as isize);
        // SAFETY: the caller's layout, as GlobalAlloc requires.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grew(layout.size() as isize);
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: `ptr` came from this allocator with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        grew(new_size as isize - layout.size() as isize);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// One measured operation at a time (the counters are the process's).
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The most bytes live at once while `run` ran, over those live when it
/// started.
fn peak_during(run: impl FnOnce()) -> u64 {
    let start = LIVE.load(Ordering::Relaxed);
    PEAK.store(start, Ordering::Relaxed);
    run();
    (PEAK.load(Ordering::Relaxed) - start).max(0) as u64
}

/// An array [`write_store`] writes.
struct ArraySpec<'a> {
    name: &'a str,
    data_type: &'a str,
    fill_value: serde_json::Value,
    dims: &'a [&'a str],
    shape: &'a [u64],
    chunks: &'a [u64],
}

/// Writes a Zarr v3 group at `dir` holding one uncompressed array (no
/// coordinate arrays), filled with `bytes`.
fn write_store(dir: &Path, spec: &ArraySpec, bytes: &[u8]) {
    let name = spec.name;
    std::fs::create_dir_all(dir.join(name)).unwrap();
    let group = serde_json::json!({"zarr_format": 3, "node_type": "group", "attributes": {}});
    std::fs::write(dir.join("zarr.json"), group.to_string()).unwrap();
    let array = serde_json::json!({
        "zarr_format": 3,
        "node_type": "array",
        "shape": spec.shape,
        "data_type": spec.data_type,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": spec.chunks}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": spec.fill_value,
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        "dimension_names": spec.dims,
        "attributes": {},
    });
    std::fs::write(dir.join(name).join("zarr.json"), array.to_string()).unwrap();
    let storage = Arc::new(FilesystemStore::new(dir).unwrap());
    let array = Array::open(storage, &format!("/{name}")).unwrap();
    let all = ArraySubset::new_with_shape(spec.shape.to_vec());
    array
        .store_array_subset(&all, ArrayBytes::new_flen(bytes))
        .unwrap();
}

/// Writes t(64, 180, 360) of float32 (16.6 MB) in chunks (8, 90, 90)
/// under `dir`; returns its path.
fn grid_store(dir: &Path) -> std::path::PathBuf {
    let shape = [64u64, 180, 360];
    let store = dir.join("grid.zarr");
    let spec = ArraySpec {
        name: "t",
        data_type: "float32",
        fill_value: serde_json::json!("NaN"),
        dims: &["time", "lat", "lon"],
        shape: &shape,
        chunks: &[8, 90, 90],
    };
    write_store(
        &store,
        &spec,
        &values(shape.iter().product::<u64>() as usize),
    );
    store
}

/// Pseudo-random values (a linear congruential sequence), as f32 bytes.
fn values(count: usize) -> Vec<u8> {
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let mut out = Vec::with_capacity(count * 4);
    for _ in 0..count {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let v = ((state >> 40) as f32 / (1u64 << 24) as f32) - 0.5;
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// A session whose memory pool holds `allowed_mem` bytes, with its
/// scratch in `work`.
fn session(runtime: &tokio::runtime::Runtime, allowed_mem: usize, work: &Path) -> SessionContext {
    let env = RuntimeEnvBuilder::new()
        .with_memory_limit(allowed_mem, 1.0)
        .build_arc()
        .unwrap();
    let ctx = new_context_with(session_config(), env);
    let work = work.display().to_string();
    runtime.block_on(async {
        ctx.sql(&format!("SET zarrfusion.work_dir = '{work}'"))
            .await
            .unwrap();
    });
    ctx
}

/// Runs `sql` to the end, a batch at a time, in `runtime`; returns the rows.
fn run_sql(runtime: &tokio::runtime::Runtime, ctx: &SessionContext, sql: &str) -> usize {
    runtime.block_on(async {
        let mut stream = ctx
            .sql(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .execute_stream()
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        let mut rows = 0;
        while let Some(batch) = stream.next().await {
            rows += batch.unwrap_or_else(|e| panic!("{sql}: {e}")).num_rows();
        }
        rows
    })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Fails naming the operation when `peak` exceeds `allowed_mem`.
fn assert_within(what: &str, peak: u64, allowed_mem: usize) {
    eprintln!(
        "{what}: {:.2} MiB live at most under {:.2} MiB",
        peak as f64 / (1 << 20) as f64,
        allowed_mem as f64 / (1 << 20) as f64
    );
    assert!(
        peak <= allowed_mem as u64,
        "{what}: {peak} bytes live at once ({:.1} MiB) under allowed_mem {allowed_mem} \
         ({:.1} MiB)",
        peak as f64 / (1 << 20) as f64,
        allowed_mem as f64 / (1 << 20) as f64
    );
}

/// The FFT of a complex64 line of 2^21 values (16 MiB) written to Zarr
/// under 8 MiB: the four-step path, then the spectrum and its frequency
/// coordinate (2^21 float64 values) written chunk by chunk.
#[test]
fn an_fft_copy_of_a_line_twice_allowed_mem_stays_within_it() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = common::scratch("heap-fft");
    let n: u64 = 1 << 21;
    let store = dir.join("signal.zarr");
    let spec = ArraySpec {
        name: "s",
        data_type: "complex64",
        fill_value: serde_json::json!([0.0, 0.0]),
        dims: &["t"],
        shape: &[n],
        chunks: &[1 << 14],
    };
    write_store(&store, &spec, &values(2 * n as usize));
    let allowed_mem = 8 << 20;
    let runtime = runtime();
    let ctx = session(&runtime, allowed_mem, &dir.join("work"));
    let out = dir.join("spectrum.zarr");
    let call = format!(
        "fft('{}', 's', dims => 't', true_phase => false, true_amplitude => false, \
         shift => false)",
        store.display()
    );
    let plan = runtime.block_on(common::explain_text(&ctx, &format!("SELECT * FROM {call}")));
    assert!(plan.contains("strategy=four-step"), "{plan}");
    let sql = format!(
        "COPY (SELECT * FROM {call}) TO '{}' STORED AS ZARR",
        out.display()
    );
    let mut rows = 0;
    let peak = peak_during(|| rows = run_sql(&runtime, &ctx, &sql));
    assert_eq!(rows, 1, "COPY answers one row");
    assert!(out.join("s").is_dir(), "the spectrum was written");
    assert_within("FFT copy (four-step)", peak, allowed_mem);
}

/// A grid t(64, 180, 360) of float32 (16.6 MB) in chunks (8, 90, 90),
/// under 8 MiB: a scan streamed to the end, a dense reduction, a COPY of
/// a selection with a computed variable, a rechunk streamed to the end and
/// a COPY of the table in new chunks.
#[test]
fn scans_reductions_copies_and_rechunks_of_a_grid_twice_allowed_mem_stay_within_it() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = common::scratch("heap-grid");
    let store = grid_store(&dir);
    let allowed_mem = 8 << 20;
    let runtime = runtime();
    let ctx = session(&runtime, allowed_mem, &dir.join("work"));
    let location = store.display().to_string();
    runtime.block_on(async {
        ctx.sql(&format!(
            "CREATE EXTERNAL TABLE grid STORED AS ZARR LOCATION '{location}'"
        ))
        .await
        .unwrap();
    });
    let out = |name: &str| dir.join(name).display().to_string();
    let cases = [
        ("scan", "SELECT * FROM grid".to_string(), 64 * 180 * 360),
        (
            "dense reduction",
            "SELECT lat, avg(t) FROM grid GROUP BY lat".to_string(),
            180,
        ),
        (
            "COPY of a selection",
            format!(
                "COPY (SELECT time, lat, lon, t * 2 AS u FROM grid WHERE lat < 120) TO '{}' \
                 STORED AS ZARR",
                out("selection.zarr")
            ),
            1,
        ),
        (
            "rechunk",
            "SELECT * FROM rechunk('grid', time => 64, lat => 10, lon => 10)".to_string(),
            64 * 180 * 360,
        ),
        (
            "COPY of a table in new chunks",
            format!(
                "COPY grid TO '{}' STORED AS ZARR OPTIONS ('chunks' 'time=64,lat=10,lon=10')",
                out("rechunked.zarr")
            ),
            1,
        ),
    ];
    for (what, sql, want_rows) in cases {
        let mut rows = 0;
        let peak = peak_during(|| rows = run_sql(&runtime, &ctx, &sql));
        assert_eq!(rows, want_rows, "{what}: {sql}");
        assert_within(what, peak, allowed_mem);
    }
}

/// Windows of `sizes` over variable `t` of the store at `store`, every
/// window of its default table, indexed with `index`.
fn windows_of_t(
    store: &Path,
    env: &datafusion::execution::runtime_env::RuntimeEnv,
    sizes: &[(&str, u64)],
    index: &zarrfusion::windows::IndexOptions,
) -> zarrfusion::windows::Windows {
    use zarrfusion::table::{Selection, ZarrDataset, ZarrTableOptions};
    use zarrfusion::windows::{SampleSpec, WindowShape, Windows};
    let dataset = ZarrDataset::open(
        &store.display().to_string(),
        &ZarrTableOptions::default(),
        env,
    )
    .unwrap();
    let table = Arc::new(dataset.table(None).unwrap());
    let window_shape = WindowShape {
        sizes: sizes.iter().map(|&(d, n)| (d.to_string(), n)).collect(),
        overlaps: vec![],
    };
    let selection = Selection::all(&table.shape());
    Windows::new(
        table,
        &["t".to_string()],
        selection,
        &window_shape,
        &SampleSpec::default(),
        index,
    )
    .unwrap()
}

/// The window loader over the same grid, blocks of 512 KiB, a shuffle
/// buffer of 1 MiB: an epoch of 5x5 windows in batches of 64, the index
/// built beside it (at most half of the budget).
#[test]
fn a_loader_epoch_over_a_grid_twice_allowed_mem_stays_within_it() {
    use zarrfusion::windows::{IndexOptions, LoaderOptions, Shuffle, WindowLoader};
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = common::scratch("heap-loader");
    let store = grid_store(&dir);
    let allowed_mem: usize = 8 << 20;
    let runtime = runtime();
    let _entered = runtime.enter();
    let env = datafusion::execution::runtime_env::RuntimeEnv::default();
    let mut windows_seen = 0u64;
    let peak = peak_during(|| {
        let index = IndexOptions {
            block_bytes: (allowed_mem / 16) as u64,
            threads: 1,
            memory_limit: Some(allowed_mem / 2),
            ..IndexOptions::default()
        };
        let windows = windows_of_t(&store, &env, &[("lat", 5), ("lon", 5)], &index);
        let options = LoaderOptions {
            batch_size: 64,
            shuffle: Shuffle::Block {
                buffer_bytes: 1 << 20,
            },
            prefetch: 2,
            threads: 2,
            memory_limit: Some(allowed_mem),
            ..LoaderOptions::default()
        };
        let loader = WindowLoader::new(Arc::new(windows), options).unwrap();
        for batch in loader.epoch(0) {
            windows_seen += batch.unwrap().len as u64;
        }
    });
    assert_eq!(windows_seen, 64 * 36 * 72, "every window of the epoch");
    assert_within("loader epoch", peak, allowed_mem);
}

/// A batch drawing from many more blocks than the shuffle buffer holds:
/// 8x15x15 windows over chunks of 8x90x90 missing everywhere but one
/// window's patch each (the other 35 windows of a chunk dropped by the
/// default rule), batches of 32. The blocks a batch exhausts must not all
/// stay alive until it is sent.
#[test]
fn a_batch_drawing_from_many_blocks_stays_within_allowed_mem() {
    use zarrfusion::windows::{IndexOptions, LoaderOptions, Shuffle, WindowLoader};
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = common::scratch("heap-loader-sparse");
    let shape = [64u64, 180, 360];
    let store = dir.join("sparse.zarr");
    let spec = ArraySpec {
        name: "t",
        data_type: "float32",
        fill_value: serde_json::json!("NaN"),
        dims: &["time", "lat", "lon"],
        shape: &shape,
        chunks: &[8, 90, 90],
    };
    let mut bytes = values(shape.iter().product::<u64>() as usize);
    for (i, cell) in bytes.chunks_exact_mut(4).enumerate() {
        let (lat, lon) = ((i / 360) % 180, i % 360);
        if lat % 90 >= 15 || lon % 90 >= 15 {
            cell.copy_from_slice(&f32::NAN.to_le_bytes());
        }
    }
    write_store(&store, &spec, &bytes);
    let allowed_mem: usize = 8 << 20;
    let runtime = runtime();
    let _entered = runtime.enter();
    let env = datafusion::execution::runtime_env::RuntimeEnv::default();
    let index = IndexOptions {
        block_bytes: 512 << 10,
        threads: 1,
        cache: None,
        ..IndexOptions::default()
    };
    let windows = windows_of_t(
        &store,
        &env,
        &[("time", 8), ("lat", 15), ("lon", 15)],
        &index,
    );
    // Indexed first: nothing is built beside the epoch.
    let total = windows.index().unwrap().total;
    assert_eq!(total, 8 * 2 * 4, "one window a chunk");
    let options = LoaderOptions {
        batch_size: 32,
        shuffle: Shuffle::Block {
            buffer_bytes: 512 << 10,
        },
        prefetch: 1,
        threads: 2,
        memory_limit: Some(allowed_mem),
        ..LoaderOptions::default()
    };
    let loader = WindowLoader::new(Arc::new(windows), options).unwrap();
    let mut windows_seen = 0u64;
    let peak = peak_during(|| {
        for batch in loader.epoch(0) {
            windows_seen += batch.unwrap().len as u64;
        }
    });
    assert_eq!(windows_seen, total, "every window of the epoch");
    assert_within("loader epoch, batches over many blocks", peak, allowed_mem);
    let projected = loader.memory().total();
    assert_within("the same epoch, against its projection", peak, projected);
}

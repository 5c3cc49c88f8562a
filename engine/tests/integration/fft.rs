//! `fft(...)` and `ifft(...)` against xrft: every case of
//! `tests/fixtures/fft/cases.json` (written with xrft by
//! `tests/fixtures/fft/make_fft_fixtures.py`) is run through SQL and
//! compared, coordinates and values, with the expected store; plus the
//! errors a bad call gets and the memory refusal.

use crate::common;

use std::sync::Arc;

use common::fft::{cases, check_case, collect, create_views, numbers, parts, sql_call};
use common::{explain_text, repo_root};
use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::compute::concat_batches;
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::prelude::{col, DataFrame, SessionContext};
use zarrfusion::array::fft::{fft_plan, FftOptions};
use zarrfusion::{new_context, new_context_with, session_config, ZarrContextExt};

/// A session with `settings` (`SET ...` statements) run.
async fn context_with(settings: &[&str]) -> SessionContext {
    let ctx = new_context();
    for set in settings {
        ctx.sql(set).await.unwrap();
    }
    ctx
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_case_matches_xrft() {
    let cases = cases();
    assert!(cases.len() >= 20, "the fixture lists {} cases", cases.len());
    // Small batches and partitions: several blocks and batches per case.
    let ctx = new_context();
    ctx.sql("SET datafusion.execution.batch_size = 7")
        .await
        .unwrap();
    ctx.sql("SET zarrfusion.target_partition_bytes = 2000")
        .await
        .unwrap();
    for case in &cases {
        check_case(&ctx, case).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_dimension_cases_match_xrft_by_the_four_step_path() {
    four_step_cases("cpu").await;
}

/// Every one-dimension case by the four-step path on `device`.
async fn four_step_cases(device: &str) {
    let cases = cases();
    let ctx = context_with(&[
        "SET datafusion.execution.batch_size = 7",
        "SET zarrfusion.fft_strategy = 'four_step'",
        &format!("SET zarrfusion.device = '{device}'"),
    ])
    .await;
    let mut ran = 0;
    for case in &cases {
        let args = case["args"].as_object().unwrap();
        if args["dims"].as_str().unwrap().contains(',') {
            continue;
        }
        create_views(&ctx, case).await;
        let plan = explain_text(&ctx, &format!("SELECT * FROM {}", sql_call(case))).await;
        // A chain's inner transform is stored first, then read by the
        // four-step path.
        let path = match case.get("views") {
            Some(_) => "strategy=chained: fft along [lat] by four-step",
            None => "strategy=four-step",
        };
        assert!(plan.contains(path), "{plan}");
        assert!(plan.contains(&format!("device={device}")), "{plan}");
        check_case(&ctx, case).await;
        ran += 1;
    }
    assert!(ran >= 10, "{ran} cases ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_dimension_cases_match_xrft_when_staged() {
    staged_cases("cpu").await;
}

/// Every multi-dimension case staged, each stage by the four-step path on
/// `device`.
async fn staged_cases(device: &str) {
    let cases = cases();
    let ctx = context_with(&[
        "SET zarrfusion.fft_strategy = 'four_step'",
        &format!("SET zarrfusion.device = '{device}'"),
    ])
    .await;
    let mut ran = 0;
    for case in &cases {
        let args = case["args"].as_object().unwrap();
        if !args["dims"].as_str().unwrap().contains(',') {
            continue;
        }
        create_views(&ctx, case).await;
        let sql = format!("SELECT * FROM {}", sql_call(case));
        let plan = explain_text(&ctx, &sql).await;
        assert!(plan.contains(&format!("device={device}")), "{plan}");
        if case.get("views").is_some() {
            // The forward transform stored first (staged), then read by the
            // inverse's stages.
            assert!(
                plan.contains("chained: fft along [lat, lon] by staged"),
                "{plan}"
            );
            check_case(&ctx, case).await;
            ran += 1;
            continue;
        }
        if args.contains_key("detrend") {
            // Fitted over both dimensions at once, in a pass before the
            // first stage.
            assert!(
                plan.contains("detrend over [lat, lon] fitted in a pass"),
                "{plan}"
            );
        }
        // Both stages by the four-step path, the second reading the first's store.
        assert!(plan.contains("strategy=staged: along ["), "{plan}");
        assert!(plan.matches("four-step in").count() == 2, "{plan}");
        check_case(&ctx, case).await;
        ran += 1;
    }
    assert!(ran >= 6, "{ran} cases ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_calls_are_refused_with_the_store_and_variable_named() {
    std::env::set_current_dir(repo_root()).unwrap();
    let ctx = new_context();
    let store = "tests/fixtures/fft/data/grid.zarr";
    for (call, message) in [
        (
            format!("fft('{store}', 'nope', dims => 'lat')"),
            "unknown variable 'nope'",
        ),
        (
            format!("fft('{store}', 'z', dims => 'height')"),
            "unknown dimension 'height'",
        ),
        (format!("fft('{store}', 'z')"), "no dimension to transform"),
        (
            format!("fft('{store}', dims => 'lat')"),
            "name the variable",
        ),
        (
            format!("fft('{store}', 'z', dims => 'lat', window => 'kaiser')"),
            "unknown window 'kaiser'",
        ),
        (
            format!("fft('{store}', 'z', dims => 'lat', lag => 3)"),
            "lag applies to inverse",
        ),
        (
            format!("fft('{store}', 'z', dims => 'time,lat,lon', detrend => 'linear')"),
            "one or two dimensions",
        ),
        (
            format!("ifft('{store}', 'z', dims => 'lon')"),
            "not centred on zero frequency",
        ),
        (
            format!("ifft('{store}', 'z', dims => 'lat', lag => '1,2')"),
            "2 lags for 1 dimension",
        ),
    ] {
        let sql = format!("SELECT * FROM {call}");
        let err = match ctx.sql(&sql).await {
            Ok(df) => df.collect().await.map(|_| ()).unwrap_err(),
            Err(e) => e,
        }
        .to_string();
        assert!(err.contains(message), "{sql}: {err}");
        // Options are checked before the store is opened.
        if !message.contains("window") && !message.contains("lag applies") {
            assert!(err.contains(store), "{sql}: the store is not named: {err}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_shows_the_strategy_and_memory_and_a_small_budget_is_refused() {
    std::env::set_current_dir(repo_root()).unwrap();
    let sql = "SELECT * FROM fft('tests/fixtures/fft/data/grid.zarr', 'z', dims => 'lat')";
    let text = explain_text(&new_context(), sql).await;
    assert!(
        text.contains("FftExec")
            && text.contains("strategy=whole lines")
            && text.contains("projected_memory="),
        "{text}"
    );
    // In 64 KB the whole lines' kernel does not fit; the four-step path
    // (passes over a copy in work_dir) does.
    let budget = |bytes: usize| {
        let runtime = RuntimeEnvBuilder::new()
            .with_memory_limit(bytes, 1.0)
            .build_arc()
            .unwrap();
        new_context_with(session_config(), runtime)
    };
    let text = explain_text(&budget(64 << 10), sql).await;
    assert!(text.contains("strategy=four-step"), "{text}");
    let refused = |bytes: usize, sql: &'static str| async move {
        let ctx = budget(bytes);
        let ran = ctx.sql(sql).await.unwrap().collect().await;
        ran.unwrap_err().to_string()
    };
    // In 1 KB not even a block of single lines fits.
    let err = refused(1 << 10, sql).await;
    assert!(
        err.contains("FftExec") && err.contains("allowed_mem") && err.contains("grid.zarr"),
        "{err}"
    );
    // A trend fitted over both dimensions by a pass over the source first
    // (a chunk at a time, every line's sums held) within half the limit:
    // refused with the parts, the share of the limit named.
    let detrended = "SELECT sum(z['re']) FROM fft('tests/fixtures/fft/data/grid.zarr', 'z', \
                     dims => 'lat,lon', detrend => 'linear')";
    let err = refused(8 << 10, detrended).await;
    assert!(
        err.contains("FftExec over 'tests/fixtures/fft/data/grid.zarr' variable 'z' needs")
            && err.contains("per chunk: the linear detrend's fit")
            && err.contains("of every group's sums")
            && err.contains("but half of the memory limit (allowed_mem) is 4.0 KB"),
        "{err}"
    );
}

/// Copies the FFT of `variable` along lat and lon to a Zarr store, runs the
/// inverse over the copy (lags from the stored `direct_lag` attributes)
/// and compares with the input; both transforms by `strategy`.
async fn round_trip(variable: &str, rtol: f64, strategy: &str) {
    std::env::set_current_dir(repo_root()).unwrap();
    let dir = common::scratch(&format!("fft_round_trip_{variable}_{strategy}"));
    let spec = dir.join("spec.zarr");
    let spec = spec.to_str().unwrap();
    let store = "tests/fixtures/fft/data/grid.zarr";
    let ctx = new_context();
    ctx.sql(&format!("SET zarrfusion.fft_strategy = '{strategy}'"))
        .await
        .unwrap();
    ctx.sql(&format!(
        "COPY (SELECT * FROM fft('{store}', '{variable}', dims => 'lat,lon')) TO '{spec}' \
         STORED AS ZARR"
    ))
    .await
    .unwrap()
    .collect()
    .await
    .unwrap();
    let back = collect(
        &ctx,
        &format!(
            "SELECT time, lat, lon, {variable} FROM ifft('{spec}', '{variable}', \
             dims => 'freq_lat,freq_lon') ORDER BY time, lat, lon"
        ),
    )
    .await;
    let original = collect(
        &ctx,
        &format!(
            "SELECT time, lat, lon, {variable} FROM read_zarr('{store}') ORDER BY time, lat, lon"
        ),
    )
    .await;
    assert_eq!(back.num_rows(), original.num_rows());
    for c in 0..3 {
        let (a, b) = (numbers(back.column(c)), numbers(original.column(c)));
        for (x, y) in a.iter().zip(&b) {
            assert!(
                (x - y).abs() <= 1e-9 * y.abs().max(1.0),
                "column {c}: {x} != {y}"
            );
        }
    }
    assert_values_are(&back, &original, rtol);
}

/// Asserts that the values (column 3) of `back` are those of `original`
/// (real), to `rtol` of the largest magnitude.
fn assert_values_are(back: &RecordBatch, original: &RecordBatch, rtol: f64) {
    let (re, im) = parts(back.column(3));
    let expected = numbers(original.column(3));
    let largest = expected.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    for row in 0..re.len() {
        let error = (re[row] - expected[row]).hypot(im[row]);
        assert!(
            error <= rtol * largest,
            "row {row}: {}+{}i != {}",
            re[row],
            im[row],
            expected[row]
        );
    }
}

/// `df.fft(...).ifft(...)` on DataFrames where the inverse cannot read the
/// forward transform block by block (fft_strategy four_step here; a memory
/// limit does the same): the forward transform is stored in work_dir first
/// (EXPLAIN says `chained: fft along`), the inverse reads that store by the
/// four-step path or staged, the result is the input, and work_dir is
/// emptied afterwards. Along one dimension and along two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_that_does_not_fit_block_by_block_stores_the_inner_transform_first() {
    std::env::set_current_dir(repo_root()).unwrap();
    let work = common::scratch("fft_chained");
    let ctx = context_with(&[
        "SET zarrfusion.fft_strategy = 'four_step'",
        &format!("SET zarrfusion.work_dir = '{}'", work.display()),
    ])
    .await;
    let store = "tests/fixtures/fft/data/grid.zarr";
    ctx.register_zarr("grid", store, std::collections::HashMap::new())
        .await
        .unwrap();
    let original = collect(
        &ctx,
        &format!("SELECT time, lat, lon, z FROM read_zarr('{store}') ORDER BY time, lat, lon"),
    )
    .await;
    for dims in [vec!["lat"], vec!["lat", "lon"]] {
        let forward = FftOptions::forward(dims.iter().map(|d| d.to_string()).collect());
        let inverse = FftOptions::inverse(dims.iter().map(|d| format!("freq_{d}")).collect());
        let (state, plan) = ctx.table("grid").await.unwrap().into_parts();
        let plan = fft_plan(plan, Some("z"), forward).unwrap();
        let plan = fft_plan(plan, Some("z"), inverse).unwrap();
        let back = DataFrame::new(state, plan);
        let explained = back.clone().explain(false, false).unwrap().collect().await;
        let explained = pretty_format_batches(&explained.unwrap())
            .unwrap()
            .to_string();
        let asked = format!("chained: fft along [{}] by ", dims.join(", "));
        assert!(explained.contains(&asked), "{explained}");
        let back = back
            .sort_by(vec![col("time"), col("lat"), col("lon")])
            .unwrap()
            .select_columns(&["time", "lat", "lon", "z"])
            .unwrap();
        let schema = Arc::new(back.schema().as_arrow().clone());
        let back = concat_batches(&schema, &back.collect().await.unwrap()).unwrap();
        assert_eq!(back.num_rows(), original.num_rows(), "{dims:?}");
        assert_values_are(&back, &original, 1e-9);
    }
    assert_eq!(common::entries(&work), Vec::<String>::new());
}

/// SQL chains transforms through views: `ifft('spectrum', ...)` over
/// `CREATE VIEW spectrum AS SELECT * FROM fft(...)` reads the forward
/// transform without a store between them (lags from its coordinates),
/// and gives the input back, block by block and by the four-step path.
/// A view that filters or computes is refused with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_chains_transforms_through_views() {
    std::env::set_current_dir(repo_root()).unwrap();
    let store = "tests/fixtures/fft/data/grid.zarr";
    for strategy in ["auto", "four_step"] {
        let work = common::scratch(&format!("fft_views_{strategy}"));
        let ctx = context_with(&[
            &format!("SET zarrfusion.fft_strategy = '{strategy}'"),
            &format!("SET zarrfusion.work_dir = '{}'", work.display()),
        ])
        .await;
        for statement in [
            format!(
                "CREATE VIEW spectrum AS SELECT * FROM fft('{store}', 'z', dims => 'lat,lon', \
                 true_phase => true, true_amplitude => true)"
            ),
            "CREATE VIEW renamed AS SELECT freq_lon, z, time, freq_lat FROM spectrum".to_string(),
            "CREATE VIEW filtered AS SELECT * FROM spectrum WHERE freq_lat > 0".to_string(),
        ] {
            ctx.sql(&statement).await.unwrap().collect().await.unwrap();
        }
        let original = collect(
            &ctx,
            &format!("SELECT time, lat, lon, z FROM read_zarr('{store}') ORDER BY time, lat, lon"),
        )
        .await;
        for view in ["spectrum", "renamed"] {
            let back = collect(
                &ctx,
                &format!(
                    "SELECT time, lat, lon, z FROM ifft('{view}', 'z', dims => 'freq_lat,freq_lon', \
                     true_phase => true, true_amplitude => true) ORDER BY time, lat, lon"
                ),
            )
            .await;
            assert_eq!(back.num_rows(), original.num_rows(), "{view} {strategy}");
            assert_values_are(&back, &original, 1e-9);
        }
        let err = match ctx
            .sql("SELECT * FROM ifft('filtered', 'z', dims => 'freq_lat')")
            .await
        {
            Ok(df) => df.collect().await.map(|_| ()).unwrap_err(),
            Err(e) => e,
        }
        .to_string();
        assert!(err.contains("not to other queries"), "{err}");
        assert_eq!(common::entries(&work), Vec::<String>::new());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spectrum_copied_to_zarr_transforms_back_to_the_input() {
    for strategy in ["auto", "four_step"] {
        // complex128 through Zarr.
        round_trip("z", 1e-9, strategy).await;
        // complex64 through Zarr.
        round_trip("t2m", 1e-5, strategy).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_of_a_transform_is_written_block_by_block_in_the_chunks_asked() {
    std::env::set_current_dir(repo_root()).unwrap();
    let dir = common::scratch("fft_copy_chunks");
    let spec = dir.join("spec.zarr");
    let spec = spec.to_str().unwrap();
    let copy = format!(
        "COPY (SELECT * FROM fft('tests/fixtures/fft/data/grid.zarr', 'z', dims => 'lat')) \
         TO '{spec}' STORED AS ZARR OPTIONS ('chunks' 'time=1,lon=5', 'zarr_format' '2')"
    );
    let ctx = new_context();
    ctx.sql("SET zarrfusion.target_partition_bytes = 2000")
        .await
        .unwrap();
    let text = explain_text(&ctx, &copy).await;
    assert!(
        text.contains("FftCopyExec") && text.contains("chunks=[1, 9, 5]"),
        "{text}"
    );
    ctx.sql(&copy).await.unwrap().collect().await.unwrap();
    let zarray: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{spec}/z/.zarray")).unwrap())
            .unwrap();
    assert_eq!(zarray["chunks"], serde_json::json!([1, 9, 5]));
    assert_eq!(zarray["dtype"], "<c16");
    assert_holds_xrfts_lat_spectrum(&ctx, spec).await;

    // The blocks read are the source once (its cells, float64, as its
    // metadata says), the bytes written the spectrum's (complex128).
    let source: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string("tests/fixtures/fft/data/grid.zarr/z/zarr.json").unwrap(),
    )
    .unwrap();
    assert_eq!(source["data_type"], "float64");
    let cells: u64 = (source["shape"].as_array().unwrap().iter())
        .map(|n| n.as_u64().unwrap())
        .product();
    let again = copy.replace("spec.zarr", "spec_again.zarr");
    let counters = ["bytes_read", "bytes_written"];
    let ([read, written], shown) =
        common::executed_counters(&ctx, &again, "FftCopyExec", counters).await;
    assert_eq!((read, written), (cells * 8, cells * 16), "{shown}");
}

/// Asserts that the store at `spec` holds xrft's spectrum of `z` along lat
/// (`lat_f64`).
pub(crate) async fn assert_holds_xrfts_lat_spectrum(ctx: &SessionContext, spec: &str) {
    let got = collect(
        ctx,
        &format!(
            "SELECT time, freq_lat, lon, z FROM read_zarr('{spec}') ORDER BY time, freq_lat, lon"
        ),
    )
    .await;
    let expected = collect(
        ctx,
        "SELECT time, freq_lat, lon, re, im FROM read_zarr('tests/fixtures/fft/expected/lat_f64.zarr') \
         ORDER BY time, freq_lat, lon",
    )
    .await;
    let (re, im) = parts(got.column(3));
    let (ere, eim) = (numbers(expected.column(3)), numbers(expected.column(4)));
    let largest = ere
        .iter()
        .zip(&eim)
        .map(|(r, i)| r.hypot(*i))
        .fold(0.0, f64::max);
    for row in 0..re.len() {
        assert!(
            (re[row] - ere[row]).hypot(im[row] - eim[row]) <= 1e-9 * largest,
            "row {row}"
        );
    }
}

/// COPY of a transform to an object store (an in-memory one registered
/// for memory:// URLs, as an s3:// one would be) runs block by block too:
/// chunks first, metadata last; an existing target is refused and kept; a
/// copy that fails midway (a corrupt chunk) erases what it wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transform_is_copied_to_an_object_store_block_by_block() {
    std::env::set_current_dir(repo_root()).unwrap();
    let runtime = RuntimeEnvBuilder::new().build_arc().unwrap();
    let memory = common::memory_store(&runtime, "out");
    let ctx = new_context_with(session_config(), runtime);
    let copy = "COPY (SELECT * FROM fft('tests/fixtures/fft/data/grid.zarr', 'z', dims => 'lat')) \
                TO 'memory://out/spec.zarr' STORED AS ZARR OPTIONS ('chunks' 'time=1')";
    let text = explain_text(&ctx, copy).await;
    assert!(
        text.contains("FftCopyExec") && text.contains("target=memory://out/spec.zarr"),
        "{text}"
    );
    ctx.sql(copy).await.unwrap().collect().await.unwrap();
    assert!(common::objects(&memory, "spec.zarr").await > 4);
    assert_holds_xrfts_lat_spectrum(&ctx, "memory://out/spec.zarr").await;
    let before = common::objects(&memory, "spec.zarr").await;
    let err = common::error_text(&ctx, copy).await;
    assert!(err.contains("already exists"), "{err}");
    assert_eq!(common::objects(&memory, "spec.zarr").await, before);
    let bad = common::fixture("bad_corrupt_chunk.zarr");
    let err = common::error_text(
        &ctx,
        &format!(
            "COPY (SELECT * FROM fft('{bad}', 't2m', dims => 'time')) \
             TO 'memory://out/bad.zarr' STORED AS ZARR"
        ),
    )
    .await;
    assert!(err.contains("bad_corrupt_chunk.zarr"), "{err}");
    assert_eq!(common::objects(&memory, "bad.zarr").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_device_setting_chooses_where_transforms_run() {
    std::env::set_current_dir(repo_root()).unwrap();
    let sql = "SELECT * FROM fft('tests/fixtures/fft/data/grid.zarr', 'z', dims => 'lat')";
    let ctx = new_context();
    // A build with the `gpu` feature on a machine with a GPU runs `auto`
    // and `cuda` there.
    let gpu = zarrfusion::device::choose_device("cuda").is_ok();
    let (auto, cuda) = if gpu {
        (Ok("device=cuda"), Ok("device=cuda"))
    } else {
        (Ok("device=cpu"), Err("no GPU is usable"))
    };
    for (setting, outcome) in [
        ("auto", auto),
        ("cpu", Ok("device=cpu")),
        ("cuda", cuda),
        ("tpu", Err("must be 'auto', 'cpu' or 'cuda'")),
    ] {
        ctx.sql(&format!("SET zarrfusion.device = '{setting}'"))
            .await
            .unwrap();
        let planned = match ctx.sql(sql).await {
            Ok(df) => df.collect().await.map(|_| ()),
            Err(e) => Err(e),
        };
        match outcome {
            Ok(shown) => {
                let text = explain_text(&ctx, sql).await;
                assert!(text.contains(shown), "{setting}: {text}");
            }
            Err(message) => {
                let err = planned.expect_err(setting).to_string();
                assert!(
                    err.contains(message) && err.contains("grid.zarr"),
                    "{setting}: {err}"
                );
            }
        }
    }
}

/// GPU runs need a usable GPU: with `REQUIRE_GPU=1` its absence fails;
/// without, the test says it skipped.
#[test]
fn a_gpu_is_there_when_required() {
    match zarrfusion::device::gpu_probe() {
        Ok(found) => println!("GPU: {found}"),
        Err(why) if std::env::var("REQUIRE_GPU").as_deref() == Ok("1") => {
            panic!("REQUIRE_GPU=1 but no GPU is usable: {why}")
        }
        Err(why) => println!("skipped: no GPU is usable ({why})"),
    }
}

/// Every xrft case with the transforms on the GPU (cuFFT), within the same
/// tolerances as on the CPU; skipped with a notice without a usable GPU,
/// failed under `REQUIRE_GPU=1`.
#[cfg(feature = "gpu")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_case_matches_xrft_on_the_gpu() {
    if !gpu_usable() {
        return;
    }
    let cases = cases();
    let ctx = context_with(&[
        "SET zarrfusion.device = 'cuda'",
        "SET zarrfusion.target_partition_bytes = 2000",
    ])
    .await;
    for case in &cases {
        create_views(&ctx, case).await;
        let plan = explain_text(&ctx, &format!("SELECT * FROM {}", sql_call(case))).await;
        assert!(plan.contains("device=cuda"), "{plan}");
        check_case(&ctx, case).await;
    }
}

/// Whether a GPU is usable: without one the test says it skipped, and under
/// `REQUIRE_GPU=1` it fails.
#[cfg(feature = "gpu")]
fn gpu_usable() -> bool {
    match zarrfusion::device::choose_device("cuda") {
        Ok(_) => true,
        Err(why) if std::env::var("REQUIRE_GPU").as_deref() == Ok("1") => {
            panic!("REQUIRE_GPU=1 but {why}")
        }
        Err(why) => {
            println!("skipped: {why}");
            false
        }
    }
}

/// The four-step path's row and column passes with cuFFT: every
/// one-dimension case within the CPU's tolerances.
#[cfg(feature = "gpu")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_dimension_cases_match_xrft_by_the_four_step_path_on_the_gpu() {
    if gpu_usable() {
        four_step_cases("cuda").await;
    }
}

/// Staged multi-dimension transforms with cuFFT: every multi-dimension
/// case within the CPU's tolerances.
#[cfg(feature = "gpu")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_dimension_cases_match_xrft_when_staged_on_the_gpu() {
    if gpu_usable() {
        staged_cases("cuda").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filters_on_other_dimensions_choose_the_blocks_transformed() {
    std::env::set_current_dir(repo_root()).unwrap();
    let ctx = new_context();
    // One block per time chunk (time chunks of 2).
    ctx.sql("SET zarrfusion.target_partition_bytes = 100")
        .await
        .unwrap();
    let call = "fft('tests/fixtures/fft/data/grid.zarr', 'z', dims => 'lat')";
    let filter = "time = TIMESTAMP '2020-01-01T06:00:00' AND freq_lat > -0.01";
    let filtered = collect(
        &ctx,
        &format!("SELECT * FROM {call} WHERE {filter} ORDER BY freq_lat, lon"),
    )
    .await;
    // xrft's spectrum, read with its own pushdown.
    let expected = collect(
        &ctx,
        &format!(
            "SELECT time, freq_lat, lon, re, im FROM \
             read_zarr('tests/fixtures/fft/expected/lat_f64.zarr') WHERE {filter} \
             ORDER BY freq_lat, lon"
        ),
    )
    .await;
    assert_eq!(filtered.num_rows(), 6 * 12);
    assert_eq!(expected.num_rows(), 6 * 12);
    let (re, im) = parts(filtered.column(3));
    let (ere, eim) = (numbers(expected.column(3)), numbers(expected.column(4)));
    for row in 0..re.len() {
        let error = (re[row] - ere[row]).hypot(im[row] - eim[row]);
        assert!(
            error <= 1e-9 * ere[row].hypot(eim[row]).max(1.0),
            "row {row}"
        );
    }
    let plan = ctx
        .sql(&format!("SELECT count(z) FROM {call} WHERE {filter}"))
        .await
        .unwrap()
        .create_physical_plan()
        .await
        .unwrap();
    datafusion::physical_plan::collect(Arc::clone(&plan), ctx.task_ctx())
        .await
        .unwrap();
    let text =
        datafusion::physical_plan::display::DisplayableExecutionPlan::with_metrics(plan.as_ref())
            .indent(true)
            .to_string();
    // Blocks of (time 2, lat 9, lon 5): of the 2 x 3, the filter keeps the
    // 3 of the time chunk holding 06:00.
    assert!(
        text.contains("FftExec") && text.contains("blocks=3,"),
        "{text}"
    );
}

/// The `transform_time` of the operator `operator` in `EXPLAIN ANALYZE
/// sql`, as seconds, and the wall time of the whole statement.
async fn transform_time(ctx: &SessionContext, sql: &str, operator: &str) -> (f64, f64) {
    let started = std::time::Instant::now();
    let batches = ctx
        .sql(&format!("EXPLAIN ANALYZE {sql}"))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let wall = started.elapsed().as_secs_f64();
    let text = datafusion::arrow::util::pretty::pretty_format_batches(&batches)
        .unwrap()
        .to_string();
    let line = text
        .lines()
        .find(|l| l.contains(&format!("{operator}:")))
        .unwrap_or_else(|| panic!("no {operator} in {text}"));
    let value = line
        .split("transform_time=")
        .nth(1)
        .unwrap_or_else(|| panic!("no transform_time in {line}"));
    let value: String = value
        .chars()
        .take_while(|c| !matches!(c, ',' | ']' | ' '))
        .collect();
    let unit_at = value.find(|c: char| c.is_alphabetic()).unwrap();
    let number: f64 = value[..unit_at].parse().unwrap();
    let scale = match &value[unit_at..] {
        "ns" => 1e-9,
        "µs" => 1e-6,
        "ms" => 1e-3,
        "s" => 1.0,
        other => panic!("unit {other} in {line}"),
    };
    (number * scale, wall)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_analyze_times_the_transform_phase_apart() {
    std::env::set_current_dir(repo_root()).unwrap();
    let ctx = new_context();
    let select =
        "SELECT * FROM fft('tests/fixtures/fft/data/grid.zarr', 'z', dims => ['lat', 'lon'])";
    let dir = common::scratch("fft_transform_time");
    let spec = dir.join("spec.zarr");
    let copy = format!("COPY ({select}) TO '{}' STORED AS ZARR", spec.display());
    for (sql, operator) in [(select.to_string(), "FftExec"), (copy, "FftCopyExec")] {
        let (transform, wall) = transform_time(&ctx, &sql, operator).await;
        // Some time in the kernels, and less than the whole statement.
        assert!(
            transform > 0.0 && transform < wall,
            "{operator}: transform_time {transform} s of {wall} s"
        );
    }
}

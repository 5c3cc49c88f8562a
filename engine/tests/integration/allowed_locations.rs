//! `zarrfusion.allowed_locations`: a session restricted to some directories
//! and URL prefixes reads, writes and works only under them, whatever the
//! SQL, and SQL cannot lift the restriction.

use crate::common;

use std::path::Path;
use std::sync::Arc;

use datafusion::arrow::array::RecordBatch;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::prelude::SessionContext;
use zarrfusion::array::rechunk::{rechunk_store_async, RechunkOptions};
use zarrfusion::{new_context_with, session_config};

/// A session that may reach only `list` (comma-separated), or anything
/// when `list` is empty.
fn restricted(list: &str) -> SessionContext {
    let mut config = session_config();
    (config.options_mut())
        .set("zarrfusion.allowed_locations", list)
        .unwrap();
    new_context_with(config, Arc::new(RuntimeEnv::default()))
}

/// Rows of a statement run as the front doors run it, or its error.
async fn run(ctx: &SessionContext, sql: &str) -> Result<usize, String> {
    let df = zarrfusion::session::sql(ctx, sql)
        .await
        .map_err(|e| e.to_string())?;
    let batches = df.collect().await.map_err(|e| e.to_string())?;
    Ok(batches.iter().map(RecordBatch::num_rows).sum())
}

/// The error of a statement that must be refused for its location.
async fn refused(ctx: &SessionContext, sql: &str, location: &Path) -> String {
    let message = run(ctx, sql).await.expect_err(sql);
    let place = location.to_string_lossy();
    assert!(
        message.contains("allowed_locations") && message.contains(place.as_ref()),
        "{sql}: {message}"
    );
    message
}

/// `inside/` (allowed) and `outside/`, each with a copy of the same store.
struct Places {
    dir: common::Scratch,
}

impl Places {
    fn new(name: &str) -> Places {
        let dir = common::scratch(name);
        for side in ["inside", "outside"] {
            common::copy_dir(
                Path::new(&common::fixture("v3_basic.zarr")),
                &dir.join(side).join("s.zarr"),
            );
        }
        Places { dir }
    }

    fn at(&self, path: &str) -> std::path::PathBuf {
        self.dir.join(path)
    }

    fn allowed(&self) -> String {
        self.at("inside").to_string_lossy().into_owned()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_outside_the_allowed_locations_are_refused_in_every_form() {
    let places = Places::new("allowed-reads");
    let ctx = restricted(&places.allowed());
    let (inside, outside) = (places.at("inside/s.zarr"), places.at("outside/s.zarr"));
    let (inside_text, outside_text) = (inside.display(), outside.display());
    let count = "SELECT * FROM read_zarr('{}')";

    // Inside: the same answer as an unrestricted session's.
    let open = restricted("");
    let all = run(&open, &count.replace("{}", &outside_text.to_string()))
        .await
        .unwrap();
    assert!(all > 0);
    let sql = count.replace("{}", &inside_text.to_string());
    assert_eq!(run(&ctx, &sql).await.unwrap(), all);

    let sql = count.replace("{}", &outside_text.to_string());
    refused(&ctx, &sql, &outside).await;
    let dotted = places.at("inside/../outside/s.zarr");
    let sql = count.replace("{}", &dotted.display().to_string());
    refused(&ctx, &sql, &dotted).await;
    // A link inside that points outside.
    std::os::unix::fs::symlink(&outside, places.at("inside/link.zarr")).unwrap();
    let link = places.at("inside/link.zarr");
    let sql = count.replace("{}", &link.display().to_string());
    refused(&ctx, &sql, &link).await;

    let create = format!("CREATE EXTERNAL TABLE o STORED AS ZARR LOCATION '{outside_text}'");
    refused(&ctx, &create, &outside).await;
    let csv = places.at("outside/rows.csv");
    std::fs::write(&csv, "a,b\n1,2\n").unwrap();
    let create = format!(
        "CREATE EXTERNAL TABLE c STORED AS CSV LOCATION '{}' OPTIONS ('format.has_header' 'true')",
        csv.display()
    );
    refused(&ctx, &create, &csv).await;
    let rechunk = format!("SELECT * FROM rechunk('{outside_text}', time => 1) LIMIT 1");
    refused(&ctx, &rechunk, &outside).await;
    let fft = format!("SELECT * FROM fft('{outside_text}', 't2m', dims => 'lon') LIMIT 1");
    refused(&ctx, &fft, &outside).await;
    let registered = ctx
        .state()
        .config()
        .options()
        .extensions
        .get::<zarrfusion::config::ZarrConfig>()
        .map(|c| c.allowed_locations.clone());
    assert_eq!(registered, Some(places.allowed()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_and_work_dirs_outside_are_refused_and_create_nothing() {
    let places = Places::new("allowed-writes");
    let ctx = restricted(&places.allowed());
    let inside = places.at("inside/s.zarr");
    let register = format!(
        "CREATE EXTERNAL TABLE t STORED AS ZARR LOCATION '{}'",
        inside.display()
    );
    run(&ctx, &register).await.unwrap();

    let target = places.at("outside/copy.zarr");
    let csv = places.at("outside/copy.csv");
    let work = places.at("outside/work");
    for (sql, place) in [
        ("COPY t TO '{}' STORED AS ZARR", &target),
        (
            "COPY (SELECT * FROM t WHERE lat > 0) TO '{}' STORED AS ZARR",
            &target,
        ),
        ("COPY (SELECT lat FROM t) TO '{}' STORED AS CSV", &csv),
        ("SET zarrfusion.work_dir = '{}'", &work),
        ("SET datafusion.runtime.temp_directory = '{}'", &work),
    ] {
        let sql = sql.replace("{}", &place.display().to_string());
        refused(&ctx, &sql, place).await;
    }
    assert!(!target.exists() && !csv.exists() && !work.exists());
    // Inside, the same COPY writes the store.
    let fine = places.at("inside/copy.zarr");
    let copy = format!("COPY t TO '{}' STORED AS ZARR", fine.display());
    run(&ctx, &copy).await.unwrap();
    assert!(fine.join("zarr.json").exists() || fine.join(".zmetadata").exists());

    let set = format!(
        "SET zarrfusion.work_dir = '{}'",
        places.at("inside/work").display()
    );
    run(&ctx, &set).await.unwrap();

    // The Rust API's rechunk: its target too.
    let options =
        RechunkOptions::for_session(ctx.state().config_options(), &ctx.runtime_env()).unwrap();
    let rechunked = places.at("outside/rechunked.zarr");
    let chunks = vec![("time".to_string(), 1)];
    let run_it = |target| {
        rechunk_store_async(
            inside.to_string_lossy().into_owned(),
            target,
            chunks.clone(),
            options.clone(),
            ctx.runtime_env(),
        )
    };
    let message = run_it(rechunked.clone()).await.unwrap_err().to_string();
    assert!(message.contains("allowed_locations"), "{message}");
    assert!(!rechunked.exists());
    run_it(places.at("inside/rechunked.zarr")).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_cannot_change_the_list() {
    for list in ["/nowhere-in-particular", ""] {
        let ctx = restricted(list);
        for sql in [
            "SET zarrfusion.allowed_locations = '/'",
            "SET zarrfusion.allowed_locations = ''",
            "RESET zarrfusion.allowed_locations",
        ] {
            let message = run(&ctx, sql).await.unwrap_err();
            assert!(message.contains("when the session is built"), "{message}");
        }
        let config = ctx.state().config_options().clone();
        let kept = config
            .extensions
            .get::<zarrfusion::config::ZarrConfig>()
            .unwrap();
        assert_eq!(kept.allowed_locations, list);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn options_that_send_requests_elsewhere_are_refused_before_any_request() {
    let ctx = restricted("s3://bucket/team");
    for (key, value) in [
        ("aws.endpoint", "http://169.254.169.254"),
        ("aws.allow_http", "true"),
        ("gcp.service_account_path", "/etc/passwd"),
    ] {
        let sql = format!(
            "CREATE EXTERNAL TABLE r STORED AS ZARR LOCATION 's3://bucket/team/x.zarr' \
             OPTIONS ('{key}' '{value}')"
        );
        let started = std::time::Instant::now();
        let message = run(&ctx, &sql).await.unwrap_err();
        assert!(message.contains(key), "{message}");
        assert!(started.elapsed().as_secs() < 5, "{message}");
    }
    // Outside the bucket's prefix, whatever the options.
    let message = run(&ctx, "SELECT * FROM read_zarr('s3://bucket/other/x.zarr')")
        .await
        .unwrap_err();
    assert!(message.contains("allowed_locations"), "{message}");
}

//! Stores read through `object_store` give the same answers as the same
//! stores read from disk: over HTTP from a local server, and from a real S3
//! server (moto's, behind a fault-injecting proxy).

use crate::common;

use std::collections::HashMap;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{assert_rows, query_rows, repo_root, rows};
use zarrfusion::{new_context, ZarrContextExt};

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Serves `tests/fixtures/data` over HTTP (with Range requests) on a free
/// loopback port, or `None` without Python.
fn serve_fixtures() -> Option<(Server, u16)> {
    let port = TcpListener::bind("127.0.0.1:0")
        .ok()?
        .local_addr()
        .ok()?
        .port();
    let script = repo_root().join("tests/fixtures/range_http_server.py");
    let child = Command::new("python3")
        .arg(script)
        .arg(port.to_string())
        .current_dir(repo_root().join("tests/fixtures/data"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let server = Server(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Some((server, port));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_store_equals_local_store() {
    let Some((_server, port)) = serve_fixtures() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "python3 is needed for the object-store test"
        );
        eprintln!("skipping: the HTTP test server (python3) could not start");
        return;
    };
    // Consolidated v2 (.zmetadata) and v3 (inline) stores need no listing.
    for store in ["v2_basic.zarr", "v3_basic.zarr"] {
        let local = repo_root().join("tests/fixtures/data").join(store);
        let sql = |location: &str| {
            format!(
                "SELECT time, lat, lon, t2m, u10 FROM read_zarr('{location}') \
                 WHERE lat >= 30 ORDER BY time, lat, lon"
            )
        };
        let ctx = new_context();
        let want = rows(
            &ctx.sql(&sql(&local.to_string_lossy()))
                .await
                .unwrap()
                .collect()
                .await
                .unwrap(),
        );
        let url = format!("http://127.0.0.1:{port}/{store}");
        let got = ctx
            .sql(&sql(&url))
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"))
            .collect()
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        assert!(!want.is_empty());
        assert_eq!(rows(&got), want, "{store} over HTTP");
        // Reads in flight past what a semaphore holds (2^62, given to the
        // session's options directly, as a Rust service may): a tokio
        // semaphore of that many permits panicked; now they are bounded.
        let mut config = zarrfusion::session_config();
        config
            .options_mut()
            .set("zarrfusion.io_concurrency", &(1u64 << 62).to_string())
            .unwrap();
        let runtime = datafusion::execution::runtime_env::RuntimeEnvBuilder::new()
            .build_arc()
            .unwrap();
        let many = zarrfusion::new_context_with(config, runtime);
        let got = many
            .sql(&sql(&url))
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"))
            .collect()
            .await
            .unwrap_or_else(|e| panic!("{url} with 2^62 reads in flight: {e}"));
        assert_eq!(rows(&got), want, "{store} over HTTP, 2^62 reads in flight");
    }
    // SET refuses such a number, naming the setting and its bound.
    let err = zarrfusion::session::sql(&new_context(), "SET zarrfusion.io_concurrency = 5000")
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("zarrfusion.io_concurrency") && err.contains("at most 4096"),
        "{err}"
    );
    // A missing store over HTTP is a clear error, not a panic.
    let ctx = new_context();
    let err = ctx
        .sql(&format!(
            "SELECT * FROM read_zarr('http://127.0.0.1:{port}/nothing.zarr')"
        ))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("nothing.zarr"), "{err}");
}

/// moto's S3 server with the fixture stores, behind the fault proxy
/// (`tests/s3/s3_server.py`), run by the Python of the test environment
/// (`ZARRFUSION_TEST_PYTHON`, set by `scripts/test`). Stops when dropped
/// (its standard input closes).
struct S3Server {
    child: Child,
    info: serde_json::Value,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl S3Server {
    /// `None` when no Python with moto is configured (outside CI only).
    fn start() -> Option<Self> {
        use std::io::BufRead;
        let python = std::env::var_os("ZARRFUSION_TEST_PYTHON")?;
        let mut child = Command::new(python)
            .arg(repo_root().join("tests/s3/s3_server.py"))
            .args([
                "--bucket",
                "fixtures",
                "--max-seconds",
                "600",
                "--upload-dir-contents",
            ])
            .arg(repo_root().join("tests/fixtures/data"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("the S3 test server starts");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .expect("the S3 server prints its endpoints");
        let info = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("the S3 server's line '{line}': {e}"));
        Some(Self { child, info })
    }

    fn text(&self, key: &str) -> String {
        self.info[key].as_str().unwrap().to_string()
    }

    /// Table options reaching the server through the proxy, with quick retries.
    fn options(&self) -> HashMap<String, String> {
        [
            ("aws.endpoint", self.text("proxy")),
            ("aws.allow_http", "true".into()),
            ("aws.access_key_id", self.text("access_key_id")),
            ("aws.secret_access_key", self.text("secret_access_key")),
            ("aws.region", self.text("region")),
            ("retry.backoff.init_backoff", "5ms".into()),
            ("retry.backoff.max_backoff", "20ms".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// Sends a control request to the proxy and returns its JSON answer.
    fn proxy(&self, path_and_query: &str) -> serde_json::Value {
        use std::io::{Read, Write};
        let proxy = self.text("proxy");
        let address = proxy.trim_start_matches("http://");
        let mut stream = std::net::TcpStream::connect(address).unwrap();
        write!(
            stream,
            "GET /__proxy__/{path_and_query} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
        serde_json::from_str(body).unwrap_or_else(|e| panic!("proxy answer '{answer}': {e}"))
    }
}

/// Every xarray oracle query answered from the stores in a real S3 server
/// gives xarray's rows, while the proxy refuses the first read of every
/// object with a 503 (retried): the scans of `queries.json`, and the array
/// operations over a remote store, reading ahead (`climate_queries.json`,
/// `calendar_queries.json`: dense reductions; `anomaly_queries.json`:
/// broadcast joins, the climatology computed before the scan or
/// reduction reads ahead; `rolling_queries.json`: rolling windows, some
/// over an anomaly).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_oracle_query_answers_from_s3_through_faults() {
    let Some(server) = S3Server::start() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "ZARRFUSION_TEST_PYTHON (a Python with moto) is needed for the S3 tests"
        );
        eprintln!("skipping: ZARRFUSION_TEST_PYTHON is not set");
        return;
    };
    server.proxy("config?fault=503&first_n=1");
    let queries: Vec<serde_json::Value> = [
        "queries.json",
        "climate_queries.json",
        "calendar_queries.json",
        "anomaly_queries.json",
        "rolling_queries.json",
    ]
    .into_iter()
    .flat_map(common::expected_queries)
    .collect();
    for q in &queries {
        let name = q["name"].as_str().unwrap();
        let store = q["store"].as_str().unwrap();
        let mut options = server.options();
        if let Some(serde_json::Value::Array(dims)) = q.get("dims") {
            let dims: Vec<&str> = dims.iter().map(|d| d.as_str().unwrap()).collect();
            options.insert("dims".to_string(), dims.join(","));
        }
        let ctx = new_context();
        ctx.register_zarr("t", &format!("s3://fixtures/{store}"), options)
            .await
            .unwrap_or_else(|e| panic!("{name}: registering {store} from S3: {e}"));
        let got = query_rows(&ctx, name, q["sql"].as_str().unwrap()).await;
        let want: Vec<Vec<serde_json::Value>> = serde_json::from_value(q["rows"].clone()).unwrap();
        assert_rows(&format!("{name} from S3"), &got, &want);
    }
    let stats = server.proxy("stats");
    assert!(
        stats["faults"]["503"].as_u64().unwrap_or(0) >= queries.len() as u64,
        "{stats}"
    );
    // Chunks are read with one GET each: no HEAD before them.
    assert!(stats["methods"].get("HEAD").is_none(), "{stats}");
}

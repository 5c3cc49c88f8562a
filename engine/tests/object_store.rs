//! Stores read through `object_store` (here over HTTP from a local server)
//! give the same answers as the same stores read from disk.

mod common;

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{repo_root, rows};
use zarrfusion::new_context;

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
    }
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

//! The `zarrfusion` binary: the SQL examples give the answers xarray gives
//! (`sql-examples/expected/*.csv`, written by `demo/make_demo.py`), also
//! through two `zarrfusion worker` processes, whose COPYs (anomalies,
//! transforms) write the stores one machine writes; output formats,
//! backslash commands, and errors (message on stderr, exit 1, no panic).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn zarrfusion(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_zarrfusion"))
        .args(args)
        .current_dir(repo_root())
        .output()
        .expect("the zarrfusion binary runs")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Parses simple CSV (no quoted commas in our outputs).
fn csv(text: &str) -> Vec<Vec<String>> {
    text.lines()
        .filter(|l| !l.is_empty())
        .map(|l| l.split(',').map(str::to_string).collect())
        .collect()
}

/// The relative tolerance an example states in a `-- tolerance: 1e-5` line
/// (results computed in single precision), else 1e-6.
fn tolerance(sql: &str) -> f64 {
    sql.lines()
        .find_map(|l| l.strip_prefix("-- tolerance:"))
        .and_then(|t| t.split_whitespace().next()?.parse().ok())
        .unwrap_or(1e-6)
}

fn same_cell(actual: &str, expected: &str, tolerance: f64) -> bool {
    if actual == expected {
        return true;
    }
    match (actual.parse::<f64>(), expected.parse::<f64>()) {
        (Ok(a), Ok(e)) => (a - e).abs() <= tolerance * e.abs().max(1.0),
        _ => {
            actual
                .trim_end_matches(".000000000")
                .trim_end_matches(".000")
                == expected
        }
    }
}

fn check_example(sql: &Path, expected: &Path) {
    check_example_with(sql, expected, &[]);
}

/// [`check_example`] with more arguments before the file.
fn check_example_with(sql: &Path, expected: &Path, before: &[&str]) {
    let mut args = vec!["-q", "--format", "csv"];
    args.extend_from_slice(before);
    args.extend(["-f", sql.to_str().unwrap()]);
    let output = zarrfusion(&args);
    assert!(
        output.status.success(),
        "{}: exit {:?}\n{}",
        sql.display(),
        output.status,
        stderr(&output)
    );
    let got = csv(&stdout(&output));
    let want = csv(&std::fs::read_to_string(expected).unwrap());
    let tolerance = tolerance(&std::fs::read_to_string(sql).unwrap());
    assert_eq!(
        got.len(),
        want.len(),
        "{}: rows\n{}",
        sql.display(),
        stdout(&output)
    );
    assert_eq!(got[0], want[0], "{}: header", sql.display());
    for (i, (g, w)) in got.iter().zip(&want).enumerate().skip(1) {
        assert_eq!(g.len(), w.len(), "{}: row {i}", sql.display());
        for (a, e) in g.iter().zip(w) {
            assert!(
                same_cell(a, e, tolerance),
                "{}: row {i}: got {g:?}, expected {w:?}",
                sql.display()
            );
        }
    }
}

#[test]
fn sql_examples_match_their_expected_output() {
    let dir = repo_root().join("sql-examples");
    let mut checked = 0;
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "sql"))
        .collect();
    files.sort();
    for sql in files {
        let expected = dir
            .join("expected")
            .join(sql.with_extension("csv").file_name().unwrap());
        assert!(
            expected.exists(),
            "{} has no expected output",
            sql.display()
        );
        check_example(&sql, &expected);
        checked += 1;
    }
    assert!(checked >= 6, "only {checked} examples");
}

#[test]
fn all_examples_run_in_one_session() {
    let mut args = vec!["-q", "-f"];
    let files: Vec<String> = (1..=8)
        .filter_map(|i| {
            std::fs::read_dir(repo_root().join("sql-examples"))
                .unwrap()
                .map(|e| e.unwrap().path())
                .find(|p| {
                    p.file_name()
                        .unwrap()
                        .to_string_lossy()
                        .starts_with(&format!("{i:02}_"))
                })
                .map(|p| p.to_string_lossy().into_owned())
        })
        .collect();
    args.extend(files.iter().map(String::as_str));
    let output = zarrfusion(&args);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(stdout(&output).contains("t2m_mean"));
}

#[test]
fn ndjson_prints_one_object_per_row() {
    let output = zarrfusion(&[
        "-q",
        "--format",
        "ndjson",
        "-c",
        "SELECT lat, count(*) AS n FROM read_zarr('demo/era5.zarr') WHERE lat >= 70 GROUP BY lat ORDER BY lat",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let lines: Vec<serde_json::Value> = stdout(&output)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3, "lat 70, 75, 80");
    assert_eq!(lines[0]["lat"], 70.0);
    assert_eq!(lines[0]["n"], 96 * 64);
}

#[test]
fn commands_run_in_order_and_quiet_prints_results_only() {
    let output = zarrfusion(&[
        "-q",
        "--format",
        "csv",
        "-c",
        "CREATE EXTERNAL TABLE era5 STORED AS ZARR LOCATION 'demo/era5.zarr'",
        "-c",
        "SELECT count(*) AS n FROM era5",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(stdout(&output), format!("n\n{}\n", 96 * 33 * 64));
    let loud = zarrfusion(&["-c", "SELECT 1 AS one"]);
    assert!(stdout(&loud).contains("1 row(s) fetched"));
}

#[test]
fn backslash_commands_describe_tables() {
    let output = zarrfusion(&[
        "-q",
        "--format",
        "csv",
        "-c",
        "CREATE EXTERNAL TABLE era5 STORED AS ZARR LOCATION 'demo/era5.zarr'",
        "-c",
        "\\d",
        "-c",
        "\\d era5",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = stdout(&output);
    assert!(text.contains("era5,BASE TABLE"), "{text}");
    assert!(text.contains("t2m,Float32"), "{text}");
}

#[test]
fn dot_draws_the_plan_with_metrics_after_running_it() {
    let create = "CREATE EXTERNAL TABLE era5 STORED AS ZARR LOCATION 'demo/era5.zarr'";
    let query = "SELECT lat, avg(t2m) FROM era5 GROUP BY lat";
    let plain = zarrfusion(&["-q", "-c", create, "-c", &format!("\\dot {query}")]);
    assert!(plain.status.success(), "{}", stderr(&plain));
    let text = stdout(&plain);
    assert!(
        text.starts_with("digraph plan {") && text.trim_end().ends_with('}'),
        "{text}"
    );
    assert!(
        text.contains("DenseReductionExec: store=demo/era5.zarr"),
        "{text}"
    );
    assert!(text.contains("projected_memory="), "{text}");
    assert!(!text.contains("metrics:"), "{text}");
    let analyzed = zarrfusion(&["-q", "-c", create, "-c", &format!("\\dot analyze {query};")]);
    assert!(analyzed.status.success(), "{}", stderr(&analyzed));
    let text = stdout(&analyzed);
    assert!(text.contains("metrics: output_rows=33"), "{text}");
    assert!(text.contains("blocks_read="), "{text}");
    // Edges go from each input to the operator reading it.
    assert!(text.contains("n1 -> n0;"), "{text}");
    let missing = zarrfusion(&["-c", "\\dot"]);
    assert_eq!(missing.status.code(), Some(1));
}

#[test]
fn errors_go_to_stderr_with_exit_status_one() {
    for (args, needle) in [
        (vec!["-c", "SELECT * FROM read_zarr('no/such/store.zarr')"], "no/such/store.zarr"),
        (vec!["-c", "SELEC 1"], "SELEC"),
        (
            vec!["-c", "CREATE EXTERNAL TABLE x STORED AS ZARR LOCATION 'demo/era5.zarr' OPTIONS ('dims' 'foo,bar')"],
            "foo,bar",
        ),
        (vec!["--memory-limit", "lots", "-c", "SELECT 1"], "--memory-limit"),
        (vec!["-c", "\\nope"], "unknown command"),
        // An object-store work_dir takes the intermediates: an unknown
        // store fails where they go.
        (
            vec![
                "--work-dir",
                "nowhere://bucket/scratch",
                "-c",
                "CREATE EXTERNAL TABLE era5 STORED AS ZARR LOCATION 'demo/era5.zarr'",
                "-c",
                "SELECT count(*) FROM rechunk('era5', lat => 4)",
            ],
            "nowhere",
        ),
    ] {
        let output = zarrfusion(&args);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {}", stderr(&output));
        let err = stderr(&output);
        assert!(err.contains(needle), "{args:?}: stderr was {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(!err.contains("RUST_BACKTRACE"), "{args:?}: {err}");
    }
}

#[test]
fn allow_restricts_the_locations_statements_reach() {
    // demo/ is allowed: the demo store answers as without --allow.
    let count = "SELECT count(*) AS n FROM read_zarr('demo/era5.zarr')";
    let open = zarrfusion(&["--format", "csv", "-q", "-c", count]);
    assert!(open.status.success(), "{}", stderr(&open));
    let allowed = zarrfusion(&["--allow", "demo", "--format", "csv", "-q", "-c", count]);
    assert!(allowed.status.success(), "{}", stderr(&allowed));
    assert_eq!(stdout(&allowed), stdout(&open));
    // The same store reached through a path outside, and writes outside.
    for sql in [
        "SELECT count(*) FROM read_zarr('sql-examples/../demo/../tests/fixtures/data/v3_basic.zarr')",
        "COPY (SELECT 1 AS x) TO 'not-allowed.csv' STORED AS CSV",
        "SET zarrfusion.allowed_locations = ''",
    ] {
        let output = zarrfusion(&["--allow", "demo", "-c", sql]);
        assert_eq!(output.status.code(), Some(1), "{sql}: {}", stderr(&output));
        let err = stderr(&output);
        assert!(err.contains("allowed_locations"), "{sql}: stderr was {err}");
        assert!(!err.contains("panicked"), "{sql}: {err}");
    }
    assert!(!repo_root().join("not-allowed.csv").exists());
    let bad = zarrfusion(&["--allow", "s3://", "-c", "SELECT 1"]);
    assert_eq!(bad.status.code(), Some(1));
    assert!(stderr(&bad).contains("--allow"), "{}", stderr(&bad));
}

#[test]
fn a_closed_pipe_ends_the_shell_quietly() {
    use std::io::Read;
    use std::process::Stdio;
    // `zarrfusion ... | head -c 100`: the reader goes away mid-result.
    let mut child = Command::new(env!("CARGO_BIN_EXE_zarrfusion"))
        .args([
            "-q",
            "--format",
            "csv",
            "-c",
            "CREATE EXTERNAL TABLE era5 STORED AS ZARR LOCATION 'demo/era5.zarr'",
            "-c",
            "SELECT * FROM era5",
        ])
        .current_dir(repo_root())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the zarrfusion binary runs");
    let mut head = [0u8; 100];
    child
        .stdout
        .take()
        .unwrap()
        .read_exact(&mut head)
        .expect("the result starts");
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success(), "exit status {:?}", output.status);
    assert_eq!(stderr(&output), "");
}

/// A server on 127.0.0.1 that accepts connections and never answers: a
/// store behind it takes for ever to open. Its port; it lives as long as
/// the test process.
fn silent_server() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            held.push(stream);
        }
    });
    port
}

/// Runs the shell with `args`, sends it SIGINT after `delay`, and returns
/// its output and how long it took to end after the signal.
fn interrupted_after(
    args: &[&str],
    delay: std::time::Duration,
) -> (std::process::Output, std::time::Duration) {
    use std::process::Stdio;
    use std::time::Instant;
    let child = Command::new(env!("CARGO_BIN_EXE_zarrfusion"))
        .args(args)
        .current_dir(repo_root())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the zarrfusion binary runs");
    std::thread::sleep(delay);
    let interrupted = Instant::now();
    // The shell's builtin `kill`: no procps needed.
    let kill = Command::new("sh")
        .args(["-c", &format!("kill -INT {}", child.id())])
        .status()
        .expect("sh runs");
    assert!(kill.success());
    let output = child.wait_with_output().unwrap();
    (output, interrupted.elapsed())
}

/// Asserts that an interrupted run ended within 2 s, cancelled, without
/// a panic.
fn assert_cancelled(output: &std::process::Output, waited: std::time::Duration) {
    assert!(
        waited < std::time::Duration::from_secs(2),
        "cancelled after {waited:?}"
    );
    assert_eq!(output.status.code(), Some(1), "{:?}", output.status);
    let err = stderr(output);
    assert!(err.contains("cancelled"), "stderr was {err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn ctrl_c_cancels_the_opening_of_a_store_that_does_not_answer() {
    let port = silent_server();
    let create = format!(
        "CREATE EXTERNAL TABLE t STORED AS ZARR LOCATION 'http://127.0.0.1:{port}/store.zarr' \
         OPTIONS ('client.timeout' '120s', 'retry.max_retries' '0')"
    );
    let (output, waited) = interrupted_after(
        &["-q", "-c", &create, "-c", "SELECT 1"],
        std::time::Duration::from_millis(1500),
    );
    assert_cancelled(&output, waited);
}

/// A v3 store in a new directory whose one array `t` runs along a dimension
/// `x` of 10^12 positions with no coordinate array (nothing written: every
/// chunk is the fill value).
fn trillion_positions() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("zf-trillion-{}.zarr", std::process::id()));
    std::fs::create_dir_all(dir.join("t")).unwrap();
    std::fs::write(
        dir.join("zarr.json"),
        r#"{"zarr_format":3,"node_type":"group","attributes":{}}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("t/zarr.json"),
        r#"{"zarr_format":3,"node_type":"array","shape":[1000000000000],"data_type":"float32",
            "chunk_grid":{"name":"regular","configuration":{"chunk_shape":[1000000]}},
            "chunk_key_encoding":{"name":"default","configuration":{"separator":"/"}},
            "fill_value":0.0,"codecs":[{"name":"bytes","configuration":{"endian":"little"}}],
            "dimension_names":["x"],"attributes":{}}"#,
    )
    .unwrap();
    dir
}

#[test]
fn ctrl_c_cancels_a_filter_over_a_dimension_of_a_trillion_positions() {
    let dir = trillion_positions();
    let store = dir.to_string_lossy().into_owned();
    // Not a comparison with literals: every position goes through the
    // filter (hours of work), which SIGINT must stop.
    let query = format!("SELECT count(*) FROM read_zarr('{store}') WHERE x % 7 = 3");
    let (output, waited) = interrupted_after(
        &["-q", "-c", &query],
        std::time::Duration::from_millis(1500),
    );
    std::fs::remove_dir_all(&dir).unwrap();
    assert_cancelled(&output, waited);
}

#[test]
fn a_copy_killed_midway_leaves_no_target_and_the_next_copy_sweeps_its_leftovers() {
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let dir = std::env::temp_dir().join(format!("zf-killed-copy-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let target = dir.join("out.zarr");
    // A grid of 36 million cells: written for long enough to be caught.
    let copy = format!(
        "COPY (SELECT a.value AS x, b.value AS y, CAST(a.value * b.value AS DOUBLE) AS v \
         FROM range(0, 6000) AS a CROSS JOIN range(0, 6000) AS b) \
         TO '{}' STORED AS ZARR OPTIONS ('dims' 'x,y', 'codec' 'none')",
        target.display()
    );
    let leftovers = || -> Vec<String> {
        (std::fs::read_dir(&dir).unwrap().flatten())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".zarrfusion-tmp"))
            .collect()
    };
    let mut child = Command::new(env!("CARGO_BIN_EXE_zarrfusion"))
        .args(["-q", "-c", &copy])
        .current_dir(repo_root())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the zarrfusion binary runs");
    let started = Instant::now();
    while leftovers().is_empty() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the COPY ended before its temporary store was seen"
        );
        assert!(started.elapsed() < Duration::from_secs(120));
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().unwrap(); // SIGKILL: nothing of the process runs after it.
    child.wait().unwrap();
    let left = leftovers();
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(!target.exists(), "a killed COPY left a target");

    // A clean re-run: the target written whole, the killed run's
    // temporary store removed.
    let output = zarrfusion(&["-q", "-c", &copy.replace("6000", "300")]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(target.join("zarr.json").exists());
    assert_eq!(leftovers(), Vec::<String>::new());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `zarrfusion worker` process on 127.0.0.1, killed when dropped.
struct WorkerProcess {
    child: std::process::Child,
    address: String,
}

impl WorkerProcess {
    /// Starts a worker on a free port and waits (up to 60 s) for the line
    /// saying where it listens.
    fn start() -> Self {
        Self::start_with(&[])
    }

    /// [`start`](Self::start) with more arguments after `worker --listen`.
    fn start_with(more: &[&str]) -> Self {
        use std::io::{BufRead, BufReader};
        use std::process::Stdio;
        let mut child = Command::new(env!("CARGO_BIN_EXE_zarrfusion"))
            .args(["worker", "--listen", "127.0.0.1:0"])
            .args(more)
            .current_dir(repo_root())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("the zarrfusion binary runs");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("the worker says where it listens within 60 s");
        let address = line
            .trim()
            .strip_prefix("zarrfusion worker listening on ")
            .unwrap_or_else(|| panic!("the worker printed {line:?}"))
            .to_string();
        Self { child, address }
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `sql` over the demo's era5 on `workers` (every block a task of its
/// own), printing CSV.
fn on_workers(workers: &str, sql: &str) -> Output {
    zarrfusion(&[
        "-q",
        "--format",
        "csv",
        "--workers",
        workers,
        "-c",
        "SET zarrfusion.bytes_per_task = 1",
        "-c",
        "CREATE EXTERNAL TABLE era5 STORED AS ZARR LOCATION 'demo/era5.zarr'",
        "-c",
        sql,
    ])
}

#[test]
fn sql_examples_give_the_same_answers_through_two_worker_processes() {
    let workers = [WorkerProcess::start(), WorkerProcess::start()];
    let list = format!("{},{}", workers[0].address, workers[1].address);
    let dir = repo_root().join("sql-examples");
    // Every scan split into a task per block.
    let before = [
        "--workers",
        &list,
        "-c",
        "SET zarrfusion.bytes_per_task = 1",
    ];
    let mut checked = 0;
    for name in [
        "02_zonal_mean",
        "03_box_time_filter",
        "04_cf_packed",
        "05_wind_speed",
        "06_join",
        "07_sst_holes",
        "08_land_sea_mask",
    ] {
        let sql = dir.join(format!("{name}.sql"));
        let expected = dir.join("expected").join(format!("{name}.csv"));
        check_example_with(&sql, &expected, &before);
        checked += 1;
    }
    assert_eq!(checked, 7);
    // The plan did go to the workers: the dense reduction is split into
    // tasks giving partial states.
    let explain = on_workers(&list, "EXPLAIN SELECT lat, avg(t2m) FROM era5 GROUP BY lat");
    let plan = stdout(&explain);
    assert!(explain.status.success(), "{}", stderr(&explain));
    assert!(
        plan.contains("tasks=") && plan.contains("emits=partial states"),
        "{plan}"
    );
    // After running: each stage's metrics, and only the partial states
    // cross the network (a row per latitude and task, gathered into the
    // session and merged there by group position), not the cells.
    let analyze = on_workers(
        &list,
        "EXPLAIN ANALYZE SELECT lat, avg(t2m) FROM era5 GROUP BY lat",
    );
    let plan = stdout(&analyze);
    assert!(analyze.status.success(), "{}", stderr(&analyze));
    let number_after = |line: &str, key: &str| -> u64 {
        let rest = &line[line.find(key).unwrap_or_else(|| panic!("{key} in {line}")) + key.len()..];
        rest.chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse()
            .unwrap()
    };
    let shuffle = plan
        .lines()
        .find(|l| l.contains("NetworkCoalesceExec") && l.contains("metrics="))
        .unwrap_or_else(|| panic!("no gather with metrics in {plan}"));
    assert!(plan.contains("DenseMergeExec"), "{plan}");
    let scan = plan
        .lines()
        .find(|l| l.contains("DenseReductionExec"))
        .unwrap_or_else(|| panic!("no dense reduction in {plan}"));
    let (shuffled, scanned) = (
        number_after(shuffle, "output_rows="),
        number_after(scan, "rows="),
    );
    assert!(
        shuffled > 0 && shuffled * 100 < scanned,
        "{shuffled} of {scanned} rows shuffled"
    );
}

/// A reduction over more group state than one pass holds runs in bands on
/// two worker processes: its bands dealt to the tasks, each finishing its
/// own bands' groups, their rows merged in the grid's order: the rows of
/// one machine, in its order (sums within rounding: a band's blocks are
/// folded by its workers as they come).
#[test]
fn a_reduction_in_bands_runs_its_bands_on_two_worker_processes() {
    let workers = [WorkerProcess::start(), WorkerProcess::start()];
    let list = format!("{},{}", workers[0].address, workers[1].address);
    let create = "CREATE EXTERNAL TABLE era5 STORED AS ZARR LOCATION 'demo/era5.zarr'";
    let bound = "SET zarrfusion.dense_state_bytes = 1048576";
    let sql = "SELECT date_trunc('day', time) AS day, lat, lon, avg(t2m) AS m, max(t2m) AS hi, \
               count(*) AS n FROM era5 GROUP BY 1, 2, 3 ORDER BY 1, 2 DESC, 3";
    let run = |workers: &[&str], statement: &str| {
        let mut args = vec!["-q", "--format", "csv"];
        args.extend_from_slice(workers);
        for s in [
            "SET zarrfusion.bytes_per_task = 1",
            bound,
            create,
            statement,
        ] {
            args.extend_from_slice(&["-c", s]);
        }
        let out = zarrfusion(&args);
        assert!(out.status.success(), "{statement}: {}", stderr(&out));
        stdout(&out)
    };
    let on_workers = ["--workers", list.as_str()];
    let plan = run(&on_workers, &format!("EXPLAIN {sql}"));
    assert!(
        plan.contains("emits=the results of its bands, tasks=2")
            && plan.contains("SortPreservingMergeExec")
            && plan.contains("NetworkCoalesceExec"),
        "{plan}"
    );
    let alone = run(&[], sql);
    let got = run(&on_workers, sql);
    let (got, want) = (csv(&got), csv(&alone));
    assert!(want.len() > 1000, "{} rows", want.len());
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.len(), w.len(), "row {i}");
        for (a, e) in g.iter().zip(w) {
            assert!(same_cell(a, e, 1e-9), "row {i}: got {g:?}, expected {w:?}");
        }
    }
}

#[test]
fn a_query_on_a_dead_worker_fails_at_once_naming_it() {
    let alive = WorkerProcess::start();
    let dead = WorkerProcess::start();
    let dead_address = dead.address.clone();
    drop(dead);
    let list = format!("{},{}", alive.address, dead_address);
    let started = std::time::Instant::now();
    let output = on_workers(&list, "SELECT lat, avg(t2m) FROM era5 GROUP BY lat");
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(1), "{err}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(60),
        "{:?}",
        started.elapsed()
    );
    assert!(err.contains(&dead_address), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// `--memory-limit` after `worker` (as docs/distributed.md writes it) is
/// the worker's allowed_mem: workers of 1 KB refuse their tasks before
/// reading, and the query fails naming a worker, its stage and allowed_mem.
#[test]
fn a_worker_s_memory_limit_refuses_a_task_that_cannot_fit_it() {
    let workers = [
        WorkerProcess::start_with(&["--memory-limit", "1KB"]),
        WorkerProcess::start_with(&["--memory-limit", "1KB"]),
    ];
    let list = format!("{},{}", workers[0].address, workers[1].address);
    let out = on_workers(&list, "SELECT lat, avg(t2m) FROM era5 GROUP BY lat");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "ran on workers of 1 KB");
    let named = workers
        .iter()
        .any(|w| stderr.contains(&format!("worker http://{}", w.address)));
    assert!(
        named && stderr.contains("stage") && stderr.contains("allowed_mem"),
        "{stderr}"
    );
}

/// The files under `dir`, by their path inside it.
fn files_under(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let mut files = std::collections::BTreeMap::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(next) = pending.pop() {
        for entry in std::fs::read_dir(&next).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else {
                let name = path.strip_prefix(dir).unwrap().display().to_string();
                files.insert(name, std::fs::read(&path).unwrap());
            }
        }
    }
    files
}

/// An anomaly against the monthly climatology, and its running mean, copied
/// to Zarr by a session with two worker processes (the climatology a stage
/// on the workers, held as a broadcast beside the session's chunk writers)
/// are the stores the same COPYs write on one machine, file for file (those
/// are checked against xarray in engine/tests/integration).
#[test]
fn anomaly_copies_through_two_worker_processes_are_the_copies_of_one_machine() {
    let workers = [WorkerProcess::start(), WorkerProcess::start()];
    let list = format!("{},{}", workers[0].address, workers[1].address);
    let dir = std::env::temp_dir().join(format!("zf-anomaly-copy-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let clim = "WITH clim AS (SELECT extract(month FROM time) AS month, lat, lon, \
                avg(t2m) AS c FROM era5 GROUP BY 1, 2, 3) ";
    let on = " FROM era5 e JOIN clim ON extract(month FROM e.time) = clim.month \
              AND e.lat = clim.lat AND e.lon = clim.lon";
    let anomaly = format!("{clim}SELECT e.time, e.lat, e.lon, e.t2m - clim.c AS a{on}");
    let rolled = format!(
        "{clim}SELECT e.time, e.lat, e.lon, avg(e.t2m - clim.c) OVER (PARTITION BY e.lat, \
         e.lon ORDER BY e.time ROWS BETWEEN 5 PRECEDING AND CURRENT ROW) AS m{on}"
    );
    for (name, query) in [("anomaly", anomaly), ("rolled", rolled)] {
        let copy = |target: &Path| {
            format!(
                "COPY ({query}) TO '{}' STORED AS ZARR OPTIONS ('chunks' 'time=10')",
                target.display()
            )
        };
        let alone = dir.join(format!("{name}_alone.zarr"));
        let output = zarrfusion(&[
            "-q",
            "-c",
            "CREATE EXTERNAL TABLE era5 STORED AS ZARR LOCATION 'demo/era5.zarr'",
            "-c",
            &copy(&alone),
        ]);
        assert!(output.status.success(), "{}", stderr(&output));
        let on_cluster = dir.join(format!("{name}.zarr"));
        let explain = on_workers(&list, &format!("EXPLAIN {}", copy(&on_cluster)));
        let plan = stdout(&explain);
        assert!(explain.status.success(), "{}", stderr(&explain));
        assert!(
            plan.contains("SelectionCopyExec")
                && plan.contains("broadcast=[")
                && plan.contains("tasks=")
                && !plan.contains("HashJoinExec"),
            "{name}:\n{plan}"
        );
        let output = on_workers(&list, &copy(&on_cluster));
        assert!(output.status.success(), "{}", stderr(&output));
        let (want, got) = (files_under(&alone), files_under(&on_cluster));
        assert!(want.len() > 10, "{name}: {:?}", want.keys());
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "{name}"
        );
        for (file, bytes) in &want {
            assert!(&got[file] == bytes, "{name}: {file} differs");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `COPY`s of transforms by a session with two worker processes: on the
/// four-step path its passes (after a linear detrend's fit) and then the
/// COPY's tasks run on the workers, through the scratch store in
/// `work_dir`; under a memory limit too small for a block of whole lines
/// in the store's chunks, the rounds of the variable's rechunked copy and
/// then the COPY's tasks over it. Each store is the one the same COPY
/// writes on one machine: file for file, the detrended one value for value
/// within rounding (the trend's sums are added in another order); nothing
/// is left in `work_dir` (those stores are checked against xrft in
/// engine/tests/integration).
#[test]
fn transform_copies_through_two_worker_processes_are_the_copies_of_one_machine() {
    let workers = [WorkerProcess::start(), WorkerProcess::start()];
    let list = format!("{},{}", workers[0].address, workers[1].address);
    let dir = std::env::temp_dir().join(format!("zf-fft-copy-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let work = dir.join("work");
    std::fs::create_dir_all(&work).unwrap();
    let set_work = format!("SET zarrfusion.work_dir = '{}'", work.display());
    let run = |workers: Option<&str>, before: &[&str], sql: &str| {
        let mut args = vec!["-q", "--format", "csv"];
        if let Some(list) = workers {
            args.extend(["--workers", list, "-c", "SET zarrfusion.bytes_per_task = 1"]);
        }
        args.extend(before);
        args.extend(["-c", &set_work, "-c", sql]);
        let output = zarrfusion(&args);
        assert!(output.status.success(), "{sql}:\n{}", stderr(&output));
        stdout(&output)
    };
    let four_step = ["-c", "SET zarrfusion.fft_strategy = 'four_step'"];
    let passes = ["four-step pass "].as_slice();
    let rounds = [
        "AfterExec: after round 0 of the rechunk of demo/era5.zarr",
        "RechunkTasksExec",
    ];
    let cases = [
        (
            "plain",
            "dims => 'lon'",
            false,
            four_step.as_slice(),
            passes,
        ),
        (
            "detrended",
            "dims => 'time', detrend => 'linear'",
            true,
            four_step.as_slice(),
            passes,
        ),
        // A block of whole time lines in the store's chunks is the whole
        // array (3.2 MB as complex numbers).
        (
            "rechunked",
            "dims => 'time'",
            false,
            ["--memory-limit", "4MB"].as_slice(),
            rounds.as_slice(),
        ),
    ];
    for (name, args, rounded, before, stages) in cases {
        let copy = |target: &Path| {
            format!(
                "COPY (SELECT * FROM fft('demo/era5.zarr', 't2m', {args})) TO '{}' STORED AS ZARR",
                target.display()
            )
        };
        let alone = dir.join(format!("{name}_alone.zarr"));
        run(None, before, &copy(&alone));
        let on_cluster = dir.join(format!("{name}.zarr"));
        let plan = run(
            Some(&list),
            before,
            &format!("EXPLAIN {}", copy(&on_cluster)),
        );
        let common = [
            "FftCopyExec",
            "tasks on the cluster's workers",
            "BlockwiseTasksExec",
            "Network",
        ];
        for part in common.iter().chain(stages) {
            assert!(plan.contains(part), "{name}: {part}:\n{plan}");
        }
        assert_eq!(plan.contains("DetrendFitExec"), rounded, "{name}:\n{plan}");
        run(Some(&list), before, &copy(&on_cluster));
        let (want, got) = (files_under(&alone), files_under(&on_cluster));
        assert!(want.len() > 4, "{name}: {:?}", want.keys());
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "{name}"
        );
        if !rounded {
            for (file, bytes) in &want {
                assert!(&got[file] == bytes, "{name}: {file} differs");
            }
            continue;
        }
        let values = |store: &Path| {
            run(
                None,
                &[],
                &format!(
                    "SELECT freq_time, lat, lon, t2m['re'], t2m['im'] FROM read_zarr('{}') \
                     ORDER BY freq_time, lat, lon",
                    store.display()
                ),
            )
        };
        let (want, got) = (csv(&values(&alone)), csv(&values(&on_cluster)));
        assert_eq!(want.len(), 96 * 33 * 64 + 1, "{name}: rows");
        assert_eq!(got.len(), want.len(), "{name}: rows");
        let scale = want
            .iter()
            .skip(1)
            .flat_map(|row| row[3..].iter().filter_map(|v| v.parse::<f64>().ok()))
            .fold(0f64, |m, v| m.max(v.abs()));
        for (g, w) in got.iter().zip(&want).skip(1) {
            assert_eq!(g[..3], w[..3], "{name}: coordinates");
            for (a, e) in g[3..].iter().zip(&w[3..]) {
                let close = match (a.parse::<f64>(), e.parse::<f64>()) {
                    (Ok(a), Ok(e)) => a == e || (a - e).abs() <= 1e-9 * scale,
                    _ => a == e,
                };
                assert!(close, "{name}: got {g:?}, expected {w:?}");
            }
        }
    }
    let left: Vec<_> = std::fs::read_dir(&work).unwrap().flatten().collect();
    assert!(left.is_empty(), "left in work_dir: {left:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

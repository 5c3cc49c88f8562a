//! Helpers shared by the integration tests: paths, sessions, and turning
//! Arrow results into JSON values comparable with the xarray oracles.

#![allow(dead_code)]

pub mod fft;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use datafusion::arrow::array::{Array, AsArray, RecordBatch};
use datafusion::arrow::datatypes::{
    DataType, DurationNanosecondType, Float32Type, Float64Type, Int16Type, Int32Type, Int64Type,
    Int8Type, TimeUnit, UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};
use datafusion::arrow::util::display::{ArrayFormatter, FormatOptions};
use serde_json::Value;

/// The repository's root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Entries of `dir`, sorted (to check nothing is left behind).
pub fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// The paths of the files under `dir`, below it, sorted.
pub fn file_paths(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(at) = stack.pop() {
        for entry in std::fs::read_dir(&at).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let name = path.strip_prefix(dir).unwrap().to_string_lossy();
                found.push(name.into_owned());
            }
        }
    }
    found.sort();
    found
}

/// Every file under `dir`, by its path below it, with its bytes.
pub fn files_under(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    (file_paths(dir).into_iter())
        .map(|name| {
            let bytes = std::fs::read(dir.join(&name)).unwrap();
            (name, bytes)
        })
        .collect()
}

/// The stores at `want` and `got` hold the same files with the same bytes
/// (more than ten of them).
pub fn assert_same_files(want: &Path, got: &Path) {
    let (want, got) = (files_under(want), files_under(got));
    assert!(want.len() > 10, "{:?}", want.keys());
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (name, bytes) in &want {
        assert!(&got[name] == bytes, "{name} differs");
    }
}

/// A fresh, empty directory for one test (named after `name` and the
/// process), removed with everything in it when dropped.
pub fn scratch(name: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!("zf-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    Scratch(dir)
}

/// A test's scratch directory: a path while it lives, gone once dropped
/// (also when the test fails), so test runs leave nothing in the temp dir.
pub struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Copies the directory tree `from` to `to`.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// A fixture store's path.
pub fn fixture(name: &str) -> String {
    repo_root()
        .join("tests/fixtures/data")
        .join(name)
        .to_string_lossy()
        .into_owned()
}

/// The JSON value of one cell, with the fixture conventions: timestamps as
/// ISO strings, durations as integer nanoseconds, NULL as null.
pub fn cell(array: &dyn Array, row: usize) -> Value {
    if array.is_null(row) {
        return Value::Null;
    }
    macro_rules! num {
        ($t:ty) => {
            serde_json::json!(array.as_primitive::<$t>().value(row))
        };
    }
    match array.data_type() {
        DataType::Boolean => Value::Bool(array.as_boolean().value(row)),
        DataType::Int8 => num!(Int8Type),
        DataType::Int16 => num!(Int16Type),
        DataType::Int32 => num!(Int32Type),
        DataType::Int64 => num!(Int64Type),
        DataType::UInt8 => num!(UInt8Type),
        DataType::UInt16 => num!(UInt16Type),
        DataType::UInt32 => num!(UInt32Type),
        DataType::UInt64 => num!(UInt64Type),
        DataType::Float32 => {
            serde_json::json!(array.as_primitive::<Float32Type>().value(row) as f64)
        }
        DataType::Float64 => serde_json::json!(array.as_primitive::<Float64Type>().value(row)),
        DataType::Duration(TimeUnit::Nanosecond) => {
            serde_json::json!(array.as_primitive::<DurationNanosecondType>().value(row))
        }
        _ => {
            let formatter = ArrayFormatter::try_new(array, &FormatOptions::default()).unwrap();
            Value::String(formatter.value(row).to_string())
        }
    }
}

/// All rows of a result as JSON values.
pub fn rows(batches: &[RecordBatch]) -> Vec<Vec<Value>> {
    let mut out = Vec::new();
    for batch in batches {
        for row in 0..batch.num_rows() {
            out.push(
                batch
                    .columns()
                    .iter()
                    .map(|c| cell(c.as_ref(), row))
                    .collect(),
            );
        }
    }
    out
}

/// Whether two cells agree: numbers within a relative 1e-6, timestamps by
/// instant (`2020-01-01T00:00:00` equals `2020-01-01T00:00:00.000`).
pub fn same(actual: &Value, expected: &Value) -> bool {
    match (actual, expected) {
        (Value::Number(a), Value::Number(b)) => {
            let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
            (a - b).abs() <= 1e-6 * b.abs().max(1.0)
        }
        (Value::String(a), Value::String(b)) => {
            a == b || a.trim_end_matches(".000000000").trim_end_matches(".000") == b.as_str()
        }
        (a, b) => a == b,
    }
}

/// Asserts two row lists agree cell by cell, with a readable message.
pub fn assert_rows(context: &str, actual: &[Vec<Value>], expected: &[Vec<Value>]) {
    assert_eq!(
        actual.len(),
        expected.len(),
        "{context}: {} rows, expected {}\nfirst actual rows: {:?}",
        actual.len(),
        expected.len(),
        &actual[..actual.len().min(5)]
    );
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        assert_eq!(a.len(), e.len(), "{context}: row {i} width: {a:?} vs {e:?}");
        for (j, (x, y)) in a.iter().zip(e).enumerate() {
            assert!(
                same(x, y),
                "{context}: row {i} column {j}: got {x}, expected {y}\n  row: {a:?}\n  expected: {e:?}"
            );
        }
    }
}

/// Sorts rows by their first `keys` cells (a total order on JSON scalars).
pub fn sort_rows(rows: &mut [Vec<Value>], keys: usize) {
    fn key(v: &Value) -> (u8, f64, String) {
        match v {
            Value::Null => (0, 0.0, String::new()),
            Value::Bool(b) => (1, f64::from(u8::from(*b)), String::new()),
            Value::Number(n) => (2, n.as_f64().unwrap(), String::new()),
            Value::String(s) => (3, 0.0, s.clone()),
            other => (4, 0.0, other.to_string()),
        }
    }
    rows.sort_by(|a, b| {
        for k in 0..keys {
            let (x, y) = (key(&a[k]), key(&b[k]));
            let ord = x.0.cmp(&y.0).then(x.1.total_cmp(&y.1)).then(x.2.cmp(&y.2));
            if ord.is_ne() {
                return ord;
            }
        }
        std::cmp::Ordering::Equal
    });
}

/// The rows of `sql` as JSON values; panics naming `sql` (and `context`,
/// such as the store) when it fails.
pub async fn query_rows(
    ctx: &datafusion::prelude::SessionContext,
    context: &str,
    sql: &str,
) -> Vec<Vec<Value>> {
    let batches = ctx
        .sql(sql)
        .await
        .unwrap_or_else(|e| panic!("{context}: planning {sql}: {e}"))
        .collect()
        .await
        .unwrap_or_else(|e| panic!("{context}: running {sql}: {e}"));
    rows(&batches)
}

/// A session with the boolean setting `zarrfusion.{rule}` set to `on`,
/// then `settings` run, and the climate fixture (`climate.zarr`, written
/// by `tests/fixtures/make_climate_fixture.py`) registered as `t`.
pub async fn climate_session(
    rule: &str,
    on: bool,
    settings: &[&str],
) -> datafusion::prelude::SessionContext {
    use zarrfusion::ZarrContextExt;
    let ctx = zarrfusion::new_context();
    ctx.sql(&format!("SET zarrfusion.{rule} = {on}"))
        .await
        .unwrap();
    for setting in settings {
        ctx.sql(setting).await.unwrap();
    }
    ctx.register_zarr("t", &fixture("climate.zarr"), Default::default())
        .await
        .unwrap();
    ctx
}

/// Blocks of one chunk of the climate fixture (50 steps), three
/// partitions (some start in the middle of the series) and batches of 7
/// rows (a box's cells come in pieces).
pub const SMALL_BLOCKS: [&str; 3] = [
    "SET zarrfusion.target_partition_bytes = 1024",
    "SET datafusion.execution.target_partitions = 3",
    "SET datafusion.execution.batch_size = 7",
];

/// The queries and their answers in `tests/fixtures/expected/{file}`.
pub fn expected_queries(file: &str) -> Vec<Value> {
    let path = repo_root().join("tests/fixtures/expected").join(file);
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The text of `EXPLAIN sql` (logical and physical plans), as a table.
pub async fn explain_text(ctx: &datafusion::prelude::SessionContext, sql: &str) -> String {
    let batches = ctx
        .sql(&format!("EXPLAIN {sql}"))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    datafusion::arrow::util::pretty::pretty_format_batches(&batches)
        .unwrap()
        .to_string()
}

/// Runs `sql` and gives the counters `names` of its plan's (first) node
/// named `operator`, each summed over its partitions (exact, where
/// `EXPLAIN ANALYZE` rounds them), and the plan with the node's metrics; a
/// panic naming what is missing when the node or a counter is not there.
pub async fn executed_counters<const N: usize>(
    ctx: &datafusion::prelude::SessionContext,
    sql: &str,
    operator: &str,
    names: [&str; N],
) -> ([u64; N], String) {
    use datafusion::physical_plan::{collect, displayable, ExecutionPlan};
    let plan = (ctx.sql(sql).await.unwrap())
        .create_physical_plan()
        .await
        .unwrap();
    (collect(Arc::clone(&plan), ctx.task_ctx()).await).unwrap_or_else(|e| panic!("{sql}: {e}"));
    let shown = displayable(plan.as_ref()).indent(true).to_string();
    fn find<'a>(
        plan: &'a Arc<dyn ExecutionPlan>,
        operator: &str,
    ) -> Option<&'a Arc<dyn ExecutionPlan>> {
        if plan.name() == operator {
            return Some(plan);
        }
        plan.children().into_iter().find_map(|c| find(c, operator))
    }
    let node = find(&plan, operator).unwrap_or_else(|| panic!("no {operator} in {shown}"));
    let metrics = node
        .metrics()
        .unwrap_or_else(|| panic!("{operator} has no metrics"));
    let values = names.map(|name| {
        let value = (metrics.sum_by_name(name))
            .unwrap_or_else(|| panic!("no {name} in {operator}'s metrics: {shown}"));
        value.as_usize() as u64
    });
    (values, format!("{shown}\n{metrics}"))
}

/// A COPY of `query` (whose first three columns are the grid's `time`,
/// `lat` and `lon`) to `out` in chunks of 5 steps along time: the COPY's
/// plan, then the copied store read back, registered as `table`, in the
/// order of its grid, its columns those of the query.
pub async fn copied_back(
    ctx: &datafusion::prelude::SessionContext,
    query: &str,
    out: &Path,
    table: &str,
) -> (String, Vec<Vec<Value>>) {
    use zarrfusion::ZarrContextExt;
    let schema = ctx.sql(query).await.unwrap().schema().clone();
    let names: Vec<&String> = schema.fields().iter().skip(3).map(|f| f.name()).collect();
    let copy = format!(
        "COPY ({query}) TO '{}' STORED AS ZARR OPTIONS ('chunks' 'time=5')",
        out.display()
    );
    let plan = explain_text(ctx, &copy).await;
    ctx.sql(&copy).await.unwrap().collect().await.unwrap();
    (ctx.register_zarr(table, out.to_str().unwrap(), Default::default())
        .await)
        .unwrap();
    let names: Vec<&str> = names.iter().map(|n| n.as_str()).collect();
    let read = format!(
        "SELECT time, lat, lon, {} FROM {table} ORDER BY time, lat, lon",
        names.join(", ")
    );
    (plan, query_rows(ctx, "read back", &read).await)
}

/// Decoded bytes of the arrays `arrays` of the store at `store` (cells
/// times element size, as their v2 or v3 metadata gives them).
pub fn stored_bytes(store: &Path, arrays: &[&str]) -> u64 {
    (arrays.iter())
        .map(|name| {
            let (v3, v2) = (
                store.join(name).join("zarr.json"),
                store.join(name).join(".zarray"),
            );
            let text = std::fs::read_to_string(&v3)
                .or_else(|_| std::fs::read_to_string(&v2))
                .unwrap_or_else(|e| panic!("{name} of {}: {e}", store.display()));
            let meta: Value = serde_json::from_str(&text).unwrap();
            let cells: u64 = (meta["shape"].as_array().unwrap().iter())
                .map(|n| n.as_u64().unwrap())
                .product();
            let size = match (&meta["data_type"], &meta["dtype"]) {
                (Value::String(t), _) => match t.as_str() {
                    "float64" | "int64" | "uint64" => 8,
                    "float32" | "int32" | "uint32" => 4,
                    "complex128" => 16,
                    "complex64" => 8,
                    other => panic!("{name}: {other}"),
                },
                (_, Value::String(t)) => t[2..].parse::<u64>().unwrap(),
                _ => panic!("{name}: no data type in {text}"),
            };
            cells * size
        })
        .sum()
}

/// A session whose memory pool holds `bytes`, with the store at `path`
/// registered as `name`.
pub async fn budget_session(
    bytes: usize,
    name: &str,
    path: &str,
) -> datafusion::prelude::SessionContext {
    use zarrfusion::ZarrContextExt;
    let runtime = datafusion::execution::runtime_env::RuntimeEnvBuilder::new()
        .with_memory_limit(bytes, 1.0)
        .build_arc()
        .unwrap();
    let ctx = zarrfusion::new_context_with(zarrfusion::session_config(), runtime);
    ctx.register_zarr(name, path, Default::default())
        .await
        .unwrap();
    ctx
}

/// The error `sql` fails with, while planning or running, as text.
pub async fn error_text(ctx: &datafusion::prelude::SessionContext, sql: &str) -> String {
    let result = match ctx.sql(sql).await {
        Ok(df) => df.collect().await.map(|_| ()),
        Err(e) => Err(e),
    };
    result
        .err()
        .unwrap_or_else(|| panic!("{sql} succeeded"))
        .to_string()
}

/// An in-memory object store registered with `runtime` for
/// `memory://{bucket}` URLs, as an s3:// one would be.
pub fn memory_store(
    runtime: &datafusion::execution::runtime_env::RuntimeEnv,
    bucket: &str,
) -> std::sync::Arc<object_store::memory::InMemory> {
    let memory = std::sync::Arc::new(object_store::memory::InMemory::new());
    runtime.register_object_store(
        &url::Url::parse(&format!("memory://{bucket}")).unwrap(),
        std::sync::Arc::clone(&memory) as std::sync::Arc<dyn object_store::ObjectStore>,
    );
    memory
}

/// How many objects `memory` holds under `prefix`.
pub async fn objects(memory: &object_store::memory::InMemory, prefix: &str) -> usize {
    use futures::TryStreamExt;
    use object_store::ObjectStore;
    let prefix = object_store::path::Path::from(prefix);
    memory
        .list(Some(&prefix))
        .try_collect::<Vec<_>>()
        .await
        .unwrap()
        .len()
}

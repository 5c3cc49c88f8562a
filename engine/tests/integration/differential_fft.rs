//! Differential fuzzing of the transforms: random `fft(...)` calls
//! (dimensions, a real dimension, detrending, windows, xrft's flags) over
//! the FFT fixtures and the climate fixture, with what is done above them
//! (filters on other dimensions and on frequencies, the power by a
//! frequency, an order and a limit, a count, the inverse of the spectrum
//! through a view), give the rows the same query gives in a plain session,
//! whatever path the transform takes: whole lines or the four-step path
//! (`zarrfusion.fft_strategy`), rechunked first or staged a dimension at
//! a time where a memory limit asks it (a refusal for memory, naming
//! `allowed_mem` or "Resources exhausted", is then an answer too, and so
//! is the four-step path's refusal of a length with no factors), blocks
//! of one chunk or more, one to four partitions, batches of 7 rows or
//! more, and now and then through two workers of a cluster.
//!
//! Values are compared within a tolerance relative to the largest of their
//! column in the oracle's answer, 1e-4 for single-precision transforms and
//! 1e-9 for double (as `fft.rs` compares with xrft); coordinates within
//! 1e-6. Like the other fuzz targets, CI runs `ZARRFUSION_FUZZ_CASES`
//! cases (default 128) from `ZARRFUSION_FUZZ_SEED`.

use datafusion::arrow::array::{Array, AsArray, RecordBatch};
use datafusion::arrow::datatypes::DataType;
use datafusion::prelude::SessionContext;
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError};
use serde_json::Value;
use zarrfusion::new_context;
use zarrfusion::session::sql;

use super::differential::{session_for, work_dir, WorkDir};
use super::fuzz::{check_error, config, record, run};
use crate::common::{cell, repo_root, same, sort_rows};

// ---------------------------------------------------------------------------
// The calls
// ---------------------------------------------------------------------------

/// A variable transformed: its store (under `tests/fixtures`), its name,
/// and whether it is single precision (transformed in complex64).
struct Source {
    store: &'static str,
    variable: &'static str,
    single: bool,
}

/// Every source has the dimensions time, lat (descending) and lon.
const SOURCES: &[Source] = &[
    Source {
        store: "fft/data/grid.zarr",
        variable: "t2m",
        single: true,
    },
    Source {
        store: "fft/data/grid.zarr",
        variable: "z",
        single: false,
    },
    Source {
        store: "fft/data/grid.zarr",
        variable: "count",
        single: false,
    },
    Source {
        store: "fft/data/grid_v2.zarr",
        variable: "z",
        single: false,
    },
    Source {
        store: "fft/data/noleap_6h.zarr",
        variable: "v",
        single: false,
    },
    Source {
        store: "fft/data/day360_daily.zarr",
        variable: "v",
        single: false,
    },
    // 608 times (2^5 x 19) in chunks of 50, NaN holes.
    Source {
        store: "data/climate.zarr",
        variable: "t2m",
        single: true,
    },
    Source {
        store: "data/climate.zarr",
        variable: "u10",
        single: true,
    },
];

const DIMS: [&str; 3] = ["time", "lat", "lon"];

const WINDOWS: &[&str] = &[
    "hann",
    "hamming",
    "blackman",
    "tukey",
    "tukey:0.25",
    "blackmanharris",
    "nuttall",
    "flattop",
    "boxcar",
    "bartlett",
    "cosine",
];

/// One `fft(...)` call.
#[derive(Debug, Clone)]
struct Call {
    source: usize,
    /// The dimensions transformed: a mask over [`DIMS`] (none: lat).
    dims: u8,
    /// The real dimension, an index into those transformed.
    real: Option<u8>,
    /// `detrend`: constant (false) or linear (true).
    detrend: Option<bool>,
    window: Option<usize>,
    /// `shift`, `true_phase`, `true_amplitude`, when given.
    flags: [Option<bool>; 3],
}

impl Call {
    fn source(&self) -> &'static Source {
        &SOURCES[self.source % SOURCES.len()]
    }

    fn transformed(&self) -> Vec<&'static str> {
        let dims: Vec<&str> = (0..3)
            .filter(|d| self.dims & (1 << d) != 0)
            .map(|d| DIMS[d])
            .collect();
        match dims.is_empty() {
            true => vec!["lat"],
            false => dims,
        }
    }

    fn real_dim(&self) -> Option<&'static str> {
        let dims = self.transformed();
        self.real.map(|r| dims[r as usize % dims.len()])
    }

    /// xrft's flags as options (`shift => 'true'`, ...).
    fn flags(&self) -> Vec<String> {
        (["shift", "true_phase", "true_amplitude"]
            .iter()
            .zip(self.flags))
        .filter_map(|(name, flag)| flag.map(|f| format!("{name} => '{f}'")))
        .collect()
    }

    fn sql(&self) -> String {
        let source = self.source();
        let store = repo_root().join("tests/fixtures").join(source.store);
        let mut args = vec![
            format!("'{}'", store.display()),
            format!("'{}'", source.variable),
            format!("dims => '{}'", self.transformed().join(",")),
        ];
        if let Some(real) = self.real_dim() {
            args.push(format!("real_dim => '{real}'"));
        }
        if let Some(linear) = self.detrend {
            let how = if linear { "linear" } else { "constant" };
            args.push(format!("detrend => '{how}'"));
        }
        if let Some(w) = self.window {
            args.push(format!("window => '{}'", WINDOWS[w % WINDOWS.len()]));
        }
        args.extend(self.flags());
        format!("fft({})", args.join(", "))
    }

    /// The spectrum's dimension columns, in the source's order.
    fn spectrum_dims(&self) -> Vec<String> {
        let transformed = self.transformed();
        (DIMS.iter())
            .map(|d| match transformed.contains(d) {
                true => format!("freq_{d}"),
                false => d.to_string(),
            })
            .collect()
    }

    /// The inverse of this call's spectrum (registered as the view `spec`):
    /// the same dimensions, real dimension and flags, and lags of 0 when
    /// `lag` (else each coordinate's own).
    fn inverse_sql(&self, lag: bool) -> String {
        let dims: Vec<String> = (self.transformed().iter())
            .map(|d| format!("freq_{d}"))
            .collect();
        let mut args = vec![
            "'spec'".to_string(),
            format!("'{}'", self.source().variable),
            format!("dims => '{}'", dims.join(",")),
        ];
        if let Some(real) = self.real_dim() {
            args.push(format!("real_dim => 'freq_{real}'"));
        }
        if lag {
            args.push(format!("lag => '{}'", vec!["0"; dims.len()].join(",")));
        }
        args.extend(self.flags());
        format!("ifft({})", args.join(", "))
    }
}

/// Filters by kind of column: a dimension as stored, a frequency.
fn filter_menu(column: &str) -> &'static [&'static str] {
    match column {
        "time" => &["time < '2020-01-01T09:00:00'", "time >= '2000-02-29'"],
        "lat" => &["lat > 0", "lat <= 10"],
        "lon" => &["lon < 100", "lon >= 120"],
        _ => &["{} >= 0", "{} <> 0"],
    }
}

/// What is done with the transform's rows.
#[derive(Debug, Clone)]
enum Above {
    All,
    /// The power summed by one dimension column, and the rows counted.
    Power {
        by: u8,
    },
    /// Ordered by every dimension (each way as `descending` says), the
    /// first `limit`.
    Ordered {
        descending: u8,
        limit: u16,
    },
    Count,
    /// The spectrum transformed back (`ifft` over it as a view), lags of
    /// 0 or the coordinates' own.
    Inverse {
        lag: bool,
    },
}

#[derive(Debug, Clone)]
struct Query {
    call: Call,
    above: Above,
    /// Filters on the output's columns: a column and a pick of its menu.
    filters: Vec<(u8, u8)>,
}

impl Query {
    /// The statements to run first (a view), the query, how many leading
    /// columns are its keys (the rest compared within the tolerance), and
    /// whether it orders its rows totally.
    fn sql(&self) -> (Vec<String>, String, usize, bool) {
        let call = &self.call;
        let (statements, from, dims) = match self.above {
            Above::Inverse { lag } => (
                vec![format!("CREATE VIEW spec AS SELECT * FROM {}", call.sql())],
                call.inverse_sql(lag),
                DIMS.map(String::from).to_vec(),
            ),
            _ => (Vec::new(), call.sql(), call.spectrum_dims()),
        };
        let mut terms: Vec<String> = Vec::new();
        for &(column, pick) in &self.filters {
            let column = &dims[column as usize % dims.len()];
            let menu = filter_menu(column);
            let term = menu[pick as usize % menu.len()].replace("{}", column);
            if !terms.contains(&term) {
                terms.push(term);
            }
        }
        let filtered = match terms.is_empty() {
            true => from,
            false => format!("{from} WHERE {}", terms.join(" AND ")),
        };
        let variable = call.source().variable;
        let (query, keys, ordered) = match self.above {
            Above::All | Above::Inverse { .. } => {
                (format!("SELECT * FROM {filtered}"), dims.len(), false)
            }
            Above::Power { by } => {
                let by = &dims[by as usize % dims.len()];
                let power = format!(
                    "{variable}['re'] * {variable}['re'] + {variable}['im'] * {variable}['im']"
                );
                let sql = format!(
                    "SELECT {by}, sum({power}) AS p, count(*) AS n FROM {filtered} GROUP BY 1"
                );
                (sql, 1, false)
            }
            Above::Ordered { descending, limit } => {
                let order: Vec<String> = (dims.iter().enumerate())
                    .map(|(i, d)| match descending & (1 << i) != 0 {
                        true => format!("{d} DESC"),
                        false => d.clone(),
                    })
                    .collect();
                let sql = format!(
                    "SELECT * FROM {filtered} ORDER BY {} LIMIT {}",
                    order.join(", "),
                    1 + limit % 300
                );
                (sql, dims.len(), true)
            }
            Above::Count => (format!("SELECT count(*) AS n FROM {filtered}"), 0, false),
        };
        (statements, query, keys, ordered)
    }
}

/// How the transform runs in the session under test.
#[derive(Debug, Clone)]
struct Shape {
    /// `zarrfusion.fft_strategy`: auto, whole_lines, four_step.
    strategy: u8,
    partitions: u8,
    batch_size: u16,
    /// `zarrfusion.target_partition_bytes`, when small.
    block_bytes: Option<u32>,
    /// `zarrfusion.allowed_mem`, when limited.
    allowed_mem: Option<u32>,
    /// Through two workers of a cluster.
    cluster: bool,
}

impl Shape {
    fn settings(&self) -> Vec<String> {
        let strategy = ["auto", "whole_lines", "four_step"][self.strategy as usize % 3];
        let mut settings = vec![
            format!("SET zarrfusion.fft_strategy = '{strategy}'"),
            format!(
                "SET datafusion.execution.target_partitions = {}",
                self.partitions
            ),
            format!("SET datafusion.execution.batch_size = {}", self.batch_size),
        ];
        if let Some(bytes) = self.block_bytes {
            settings.push(format!("SET zarrfusion.target_partition_bytes = {bytes}"));
        }
        if let Some(bytes) = self.allowed_mem {
            settings.push(format!("SET zarrfusion.allowed_mem = '{bytes}B'"));
        }
        settings
    }
}

#[derive(Debug, Clone)]
struct Case {
    query: Query,
    shape: Shape,
}

fn call() -> impl Strategy<Value = Call> {
    (
        0..SOURCES.len(),
        0u8..8,
        prop::option::weighted(0.3, any::<u8>()),
        prop::option::weighted(0.3, any::<bool>()),
        prop::option::weighted(0.3, 0..WINDOWS.len()),
        any::<[Option<bool>; 3]>(),
    )
        .prop_map(|(source, dims, real, detrend, window, flags)| Call {
            source,
            dims,
            real,
            detrend,
            window,
            flags,
        })
}

fn above() -> impl Strategy<Value = Above> {
    prop_oneof![
        3 => Just(Above::All),
        2 => any::<u8>().prop_map(|by| Above::Power { by }),
        2 => (any::<u8>(), any::<u16>())
            .prop_map(|(descending, limit)| Above::Ordered { descending, limit }),
        1 => Just(Above::Count),
        2 => any::<bool>().prop_map(|lag| Above::Inverse { lag }),
    ]
}

fn shape() -> impl Strategy<Value = Shape> {
    (
        0u8..3,
        1u8..=4,
        prop::sample::select(vec![7u16, 64, 1000, 8192]),
        prop::option::weighted(0.5, prop::sample::select(vec![256u32, 2048, 65536])),
        prop::option::weighted(
            0.3,
            prop::sample::select(vec![16u32 << 10, 64 << 10, 256 << 10, 1 << 20]),
        ),
        prop::bool::weighted(0.15),
    )
        .prop_map(
            |(strategy, partitions, batch_size, block_bytes, allowed_mem, cluster)| Shape {
                strategy,
                partitions,
                batch_size,
                block_bytes,
                allowed_mem,
                cluster,
            },
        )
}

fn case() -> impl Strategy<Value = Case> {
    let filters = prop::collection::vec(any::<(u8, u8)>(), 0..3);
    ((call(), above(), filters), shape()).prop_map(|((call, above, filters), mut shape)| {
        // The climate fixture's 3,648 short lines through the four-step
        // path (forced), or a chain of its transforms stored first under
        // less than 1 MB, write some 16,000 chunks of a few bytes into
        // work_dir: 5-20 s of creating and removing files, near or past
        // what a case may take (docs/development.md). Forced four-step on
        // the FFT fixtures only, and such chains with 1 MB.
        if call.source().store.starts_with("data/") {
            if shape.strategy % 3 == 2 {
                shape.strategy = 0;
            }
            if matches!(above, Above::Inverse { .. }) {
                shape.allowed_mem = shape.allowed_mem.map(|bytes| bytes.max(1 << 20));
            }
        }
        Case {
            query: Query {
                call,
                above,
                filters,
            },
            shape,
        }
    })
}

// ---------------------------------------------------------------------------
// Running and comparing
// ---------------------------------------------------------------------------

/// A result: its columns (name and type) and its rows, a complex number's
/// two parts as two cells.
type Answer = (Vec<String>, Vec<Vec<Value>>);

/// The cells of `batches`' rows, the fields of a struct (a complex
/// number) each a cell (NaN is a null cell, as `common::cell` gives it).
fn flat_rows(batches: &[RecordBatch]) -> Vec<Vec<Value>> {
    let mut out = Vec::new();
    for batch in batches {
        for row in 0..batch.num_rows() {
            let mut cells = Vec::new();
            for column in batch.columns() {
                match column.data_type() {
                    DataType::Struct(_) => {
                        let parts: Vec<Value> = (column.as_struct().columns().iter())
                            .map(|part| cell(part.as_ref(), row))
                            .collect();
                        // A complex number with a NaN part is NaN (numpy's
                        // `isnan`), whichever part the kernel's order of
                        // operations left NaN (the real-input transform
                        // gives a line with a NaN `nan+0j` at its ends).
                        let nan = column.is_null(row) || parts.contains(&Value::Null);
                        for part in parts {
                            cells.push(if nan { Value::Null } else { part });
                        }
                    }
                    _ => cells.push(cell(column.as_ref(), row)),
                }
            }
            out.push(cells);
        }
    }
    out
}

/// Runs `settings`, then `statements`, then `query` in `ctx`.
async fn answer(
    ctx: SessionContext,
    settings: &[String],
    statements: &[String],
    query: &str,
) -> Result<Answer, String> {
    let work = format!(
        "SET zarrfusion.work_dir = '{}'",
        work_dir("transforms").display()
    );
    for statement in std::iter::once(&work).chain(settings).chain(statements) {
        sql(&ctx, statement)
            .await
            .map_err(|e| format!("{statement}: {e}"))?;
    }
    let df = sql(&ctx, query).await.map_err(|e| e.to_string())?;
    let columns = (df.schema().fields().iter())
        .map(|f| format!("{}: {}", f.name(), f.data_type()))
        .collect();
    let batches: Vec<RecordBatch> = df.collect().await.map_err(|e| e.to_string())?;
    Ok((columns, flat_rows(&batches)))
}

impl Shape {
    /// Whether `error` is a refusal this shape may meet where the plain
    /// session answers: for memory under a limit (the plan's, naming
    /// `allowed_mem`, or an operator's), and a line whose length has no
    /// factors on the four-step path (forced, or chosen for memory).
    fn may_refuse(&self, error: &str) -> bool {
        let limited = self.allowed_mem.is_some();
        let for_memory = error.contains("Resources exhausted") || error.contains("allowed_mem");
        let four_step = limited || self.strategy % 3 == 2;
        (limited && for_memory) || (four_step && error.contains("has no factors"))
    }
}

/// Checks the answer under test against the plain session's: the `keys`
/// leading columns alike, the others within `rtol` of their column's
/// largest value.
fn compare(
    context: &str,
    (ours, oracle): (Result<Answer, String>, Result<Answer, String>),
    keys: usize,
    ordered: bool,
    rtol: f64,
    shape: &Shape,
) -> Result<(), TestCaseError> {
    let (theirs_columns, mut theirs) = match oracle {
        Ok(answer) => answer,
        // A call the plain session refuses too (a linear detrend over
        // three dimensions, a real dimension not last): both must be
        // clear errors.
        Err(e) => {
            if let Ok((_, rows)) = &ours {
                prop_assert!(
                    false,
                    "{context}: {} rows where the plain session refused: {e}",
                    rows.len()
                );
            }
            if let Err(ours) = &ours {
                check_error(context, ours)?;
            }
            return check_error(context, &e);
        }
    };
    let (columns, mut rows) = match ours {
        Ok(answer) => answer,
        Err(e) if shape.may_refuse(&e) => return check_error(context, &e),
        Err(e) => {
            return Err(TestCaseError::fail(format!(
                "{context}: failed where the plain session answered: {e}"
            )))
        }
    };
    prop_assert_eq!(&columns, &theirs_columns, "{}: columns", context);
    prop_assert_eq!(rows.len(), theirs.len(), "{}: rows", context);
    if !ordered {
        sort_rows(&mut rows, keys);
        sort_rows(&mut theirs, keys);
    }
    // Each value within `rtol` of the largest of its column, both parts of
    // a complex column together (the parts of a transform's output).
    let column_of: Vec<usize> = (columns.iter().enumerate())
        .flat_map(|(k, c)| std::iter::repeat_n(k, if c.contains(": Struct") { 2 } else { 1 }))
        .collect();
    let mut scale = vec![0.0_f64; columns.len()];
    for row in &theirs {
        for (cell, &k) in row.iter().zip(&column_of) {
            scale[k] = scale[k].max(cell.as_f64().map_or(0.0, f64::abs));
        }
    }
    for (i, (a, b)) in rows.iter().zip(&theirs).enumerate() {
        prop_assert_eq!(a.len(), b.len(), "{}: row {} width", context, i);
        for (j, (x, y)) in a.iter().zip(b).enumerate() {
            let alike = match (x, y) {
                _ if j < keys => same(x, y),
                (Value::Number(x), Value::Number(y)) => {
                    let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
                    (x - y).abs() <= rtol * scale[column_of[j]]
                }
                (x, y) => x == y,
            };
            prop_assert!(
                alike,
                "{}: row {} cell {}: {:?}, the plain session {:?}",
                context,
                i,
                j,
                a,
                b
            );
        }
    }
    Ok(())
}

/// The target's configuration, failures kept beside this file.
fn transforms_config() -> Config {
    Config {
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "tests/integration/differential_fft.proptest-regressions",
        ))),
        ..config()
    }
}

proptest! {
    #![proptest_config(transforms_config())]

    /// A transform and what is done above it give the plain session's
    /// rows (within the precision's tolerance) whatever the strategy,
    /// memory limit, blocks, partitions, batches and cluster it runs in
    /// (or are refused for memory, naming it).
    #[test]
    fn transforms_give_the_plain_session_s_rows(case in case()) {
        record("differential_fft", &case);
        let _work = WorkDir("transforms");
        let (statements, query, keys, ordered) = case.query.sql();
        let settings = case.shape.settings();
        let context = format!(
            "{statements:?} {query} with {settings:?} (cluster: {})",
            case.shape.cluster
        );
        let rtol = match case.query.call.source().single {
            true => 1e-4,
            false => 1e-9,
        };
        let (ctx, settings) = session_for(settings, case.shape.cluster);
        let answers = run(&context, async {
            (
                answer(ctx, &settings, &statements, &query).await,
                answer(new_context(), &[], &statements, &query).await,
            )
        })?;
        compare(&context, answers, keys, ordered, rtol, &case.shape)?;
    }
}

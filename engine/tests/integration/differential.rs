//! Differential fuzzing of the array plans: random climate queries over
//! the climate fixture and the model-calendar fixtures
//! (groupings by functions of the coordinates, aggregates, filters on
//! dimensions and values, projections, sums, orders and limits above a
//! reduction; rolling windows and window totals; anomaly joins) give the
//! same rows with zarrfusion's rules on as DataFusion's own hash
//! aggregations, sorts, windows and joins give with every rule off.
//!
//! The rules run under random shapes of the work: blocks of one chunk or
//! more, one to four partitions, batches of 7 rows or more, the group
//! state bound cut so far that reductions run in bands (one or several at
//! once), a memory limit (a refusal, "Resources exhausted", is then an
//! answer too), now and then through two workers of a cluster, and now
//! and then over the table rechunked (`rechunk('t', ...)` in random chunk
//! lengths, larger than the grid too). The oracle is the same query over
//! the table as stored in a plain session: no limit, no rule.
//!
//! Rows are compared as sets (sorted), or in order where the query orders
//! them totally; numbers within a relative 1e-6 (sums taken in another
//! order), column names and types exactly. Like the fuzz targets, CI runs
//! `ZARRFUSION_FUZZ_CASES` cases (default 128) from `ZARRFUSION_FUZZ_SEED`;
//! longer runs are recorded in `docs/development.md`.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use datafusion::arrow::array::RecordBatch;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::prelude::SessionContext;
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use url::Url;
use zarrfusion::distributed::serve_worker;
use zarrfusion::session::sql;
use zarrfusion::{distributed_context, new_context, session_config, ZarrConfig, ZarrContextExt};

use super::fuzz::{check_error, config, record, run, runtime};
use crate::common::{fixture, rows, same, sort_rows};

// ---------------------------------------------------------------------------
// The queries
// ---------------------------------------------------------------------------

/// Keys of the time dimension: itself, resamplings, calendar parts, seasons.
const TIME_KEYS: &[&str] = &[
    "time",
    "date_trunc('day', time)",
    "date_trunc('month', time)",
    "date_trunc('week', time)",
    "date_bin(INTERVAL '12 hours', time)",
    "date_bin(INTERVAL '3 days', time, TIMESTAMP '2019-11-02T06:00:00')",
    "extract(month FROM time)",
    "extract(hour FROM time)",
    "extract(doy FROM time)",
    "extract(dow FROM time)",
    "date_part('year', time)",
    "CASE WHEN extract(month FROM time) IN (12, 1, 2) THEN 'DJF' ELSE 'SON/MAM' END",
];

/// Keys of the (descending) latitude: itself, bins, remainders, halves.
const LAT_KEYS: &[&str] = &[
    "lat",
    "floor(lat / 20) * 20",
    "floor((lat - 5) / 15)",
    "lat % 30",
    "CAST(lat AS INT) / 20",
    "-lat",
    "CASE WHEN lat >= 25 THEN 'N' ELSE 'S' END",
];

/// Keys of the longitude.
const LON_KEYS: &[&str] = &[
    "lon",
    "floor(lon / 120) * 120",
    "CAST(lon AS BIGINT) / 100",
    "lon % 180",
    "CASE WHEN lon < 180 THEN 'E' ELSE 'W' END",
];

/// Aggregates a dense reduction computes (and DataFusion's the same way).
const AGGREGATES: &[&str] = &[
    "avg(t2m)",
    "sum(u10)",
    "min(t2m)",
    "max(u10)",
    "count(*)",
    "count(t2m)",
    "var(t2m)",
    "stddev_pop(u10)",
    "avg(t2m - 273.15)",
    "sum(t2m * u10)",
    "max(t2m + u10)",
];

/// Filters on the dimensions (pushed down) and on the values.
const FILTERS: &[&str] = &[
    "time >= '2019-12-15'",
    "time < '2020-02-01T12:00:00'",
    "lat BETWEEN 10 AND 40",
    "lon <> 60",
    "lat > 25 AND lon < 200",
    "t2m > 280",
    "u10 < 3",
    "t2m IS NOT NULL",
];

/// A query over the climate fixture (`t`), as indices into the menus.
#[derive(Debug, Clone)]
enum Query {
    /// `GROUP BY` keys of one to three dimensions, with what is done above.
    Reduction {
        /// Per dimension (time, lat, lon): the key, if grouped by.
        keys: [Option<usize>; 3],
        /// A second key of the time dimension (month beside hour).
        second_time_key: Option<usize>,
        aggregates: Vec<usize>,
        filters: Vec<usize>,
        above: Above,
    },
    /// A window along time per cell, then summed up or kept.
    Rolling {
        aggregate: usize,
        frame: usize,
        descending: bool,
        filters: Vec<usize>,
        above: usize,
    },
    /// Each value less a climatology of the same table, reduced.
    Anomaly {
        key: usize,
        grid: usize,
        filters: Vec<usize>,
    },
}

/// What is done with a reduction's rows.
#[derive(Debug, Clone)]
enum Above {
    /// Every row.
    All,
    /// Some columns (given by a mask over keys then aggregates).
    Some(u16),
    /// Its rows counted and an aggregate summed.
    Totals,
    /// Ordered by every key (each way as `descending` says), the first
    /// `limit`, some columns kept.
    Ordered {
        descending: u8,
        limit: u16,
        columns: u16,
    },
    /// The rows whose first aggregate passes a threshold.
    Having,
    /// A key beside two aggregates added.
    Combined,
}

/// Frames of a rolling window along time.
const FRAMES: &[&str] = &[
    "ROWS BETWEEN 3 PRECEDING AND CURRENT ROW",
    "ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW",
    "ROWS BETWEEN CURRENT ROW AND UNBOUNDED FOLLOWING",
    "RANGE BETWEEN INTERVAL '1 day' PRECEDING AND CURRENT ROW",
    "ROWS BETWEEN 2 PRECEDING AND 1 FOLLOWING",
    "",
];

const WINDOW_AGGREGATES: &[&str] = &["avg(t2m)", "sum(u10)", "min(t2m)", "max(u10)", "count(t2m)"];

/// Keys of a climatology an anomaly is taken against (of the time
/// dimension), and the grids it is over.
const ANOMALY_KEYS: &[&str] = &["extract(month FROM time)", "extract(hour FROM time)"];

impl Query {
    /// The SQL, and whether it orders its rows totally.
    fn sql(&self) -> (String, bool) {
        match self {
            Query::Reduction {
                keys,
                second_time_key,
                aggregates,
                filters,
                above,
            } => {
                let key_exprs = key_exprs(keys, *second_time_key);
                let mut aggs: Vec<&str> = Vec::new();
                for &a in aggregates {
                    let agg = AGGREGATES[a % AGGREGATES.len()];
                    if !aggs.contains(&agg) {
                        aggs.push(agg);
                    }
                }
                let k = key_exprs.len();
                let select: Vec<String> = (key_exprs.iter().enumerate())
                    .map(|(i, e)| format!("{e} AS k{i}"))
                    .chain(aggs.iter().enumerate().map(|(i, a)| format!("{a} AS a{i}")))
                    .collect();
                let group: Vec<String> = (1..=k).map(|i| i.to_string()).collect();
                let inner = format!(
                    "SELECT {} FROM t{} GROUP BY {}",
                    select.join(", "),
                    where_clause(filters),
                    group.join(", ")
                );
                let names: Vec<String> = (0..k)
                    .map(|i| format!("k{i}"))
                    .chain((0..aggs.len()).map(|i| format!("a{i}")))
                    .collect();
                let masked = |mask: u16| {
                    let kept: Vec<&str> = (names.iter().enumerate())
                        .filter(|(i, _)| mask & (1 << i) != 0)
                        .map(|(_, n)| n.as_str())
                        .collect();
                    match kept.is_empty() {
                        true => names[names.len() - 1].clone(),
                        false => kept.join(", "),
                    }
                };
                match above {
                    Above::All => (inner, false),
                    Above::Some(mask) => {
                        (format!("SELECT {} FROM ({inner})", masked(*mask)), false)
                    }
                    Above::Totals => (
                        format!("SELECT count(*) AS n, sum(a0) AS s FROM ({inner})"),
                        false,
                    ),
                    Above::Ordered {
                        descending,
                        limit,
                        columns,
                    } => {
                        let order: Vec<String> = (0..k)
                            .map(|i| match descending & (1 << i) != 0 {
                                true => format!("k{i} DESC"),
                                false => format!("k{i}"),
                            })
                            .collect();
                        let sql = format!(
                            "SELECT {} FROM ({inner}) ORDER BY {} LIMIT {}",
                            masked(*columns),
                            order.join(", "),
                            1 + limit % 500
                        );
                        (sql, true)
                    }
                    Above::Having => (format!("SELECT * FROM ({inner}) WHERE a0 > 100"), false),
                    Above::Combined => (
                        format!(
                            "SELECT k0, a0 + {} AS e FROM ({inner})",
                            if aggs.len() > 1 { "a1" } else { "1" }
                        ),
                        false,
                    ),
                }
            }
            Query::Rolling {
                aggregate,
                frame,
                descending,
                filters,
                above,
            } => {
                let order = if *descending { "time DESC" } else { "time" };
                let window = format!(
                    "{} OVER (PARTITION BY lat, lon ORDER BY {order} {})",
                    WINDOW_AGGREGATES[aggregate % WINDOW_AGGREGATES.len()],
                    FRAMES[frame % FRAMES.len()]
                );
                let inner = format!(
                    "SELECT time, lat, lon, {window} AS r FROM t{}",
                    where_clause(filters)
                );
                match above % 3 {
                    0 => (inner, false),
                    1 => (
                        format!("SELECT count(r) AS n, sum(r) AS s FROM ({inner})"),
                        false,
                    ),
                    _ => (
                        format!("SELECT lat, avg(r) AS m FROM ({inner}) GROUP BY lat"),
                        false,
                    ),
                }
            }
            Query::Anomaly { key, grid, filters } => {
                let key = ANOMALY_KEYS[key % ANOMALY_KEYS.len()];
                let qualified = key.replace("time", "t.time");
                let sql = match grid % 3 {
                    // A climatology by (key, lat, lon).
                    0 => format!(
                        "WITH clim AS (SELECT {key} AS k, lat, lon, avg(t2m) AS c FROM t GROUP BY \
                         1, 2, 3) SELECT t.time, t.lat, avg(t.t2m - clim.c) AS m FROM t JOIN clim \
                         ON {qualified} = clim.k AND t.lat = clim.lat AND t.lon = clim.lon{} \
                         GROUP BY 1, 2",
                        and_clause(filters, "t.")
                    ),
                    // A mean over time by cell.
                    1 => format!(
                        "WITH clim AS (SELECT lat, lon, avg(t2m) AS c FROM t GROUP BY 1, 2) \
                         SELECT t.time, avg(t.t2m - clim.c) AS m FROM t JOIN clim USING (lat, lon)\
                         {} GROUP BY 1",
                        where_clause_qualified(filters, "t.")
                    ),
                    // The same as a window total over whole partitions.
                    _ => format!(
                        "SELECT time, lat, avg(a) AS m FROM (SELECT time, lat, lon, t2m - \
                         avg(t2m) OVER (PARTITION BY {key}, lat, lon) AS a FROM t{}) GROUP BY 1, 2",
                        where_clause(filters)
                    ),
                };
                (sql, false)
            }
        }
    }
}

/// A reduction's keys: per dimension (time, lat, lon) the one drawn, a
/// second of time, or the latitude when none is.
fn key_exprs(keys: &[Option<usize>; 3], second_time_key: Option<usize>) -> Vec<&'static str> {
    let mut exprs: Vec<&'static str> = Vec::new();
    for (d, menu) in [TIME_KEYS, LAT_KEYS, LON_KEYS].iter().enumerate() {
        if let Some(k) = keys[d] {
            exprs.push(menu[k % menu.len()]);
        }
    }
    if let Some(k) = second_time_key {
        let extra = TIME_KEYS[k % TIME_KEYS.len()];
        if !exprs.contains(&extra) {
            exprs.push(extra);
        }
    }
    if exprs.is_empty() {
        exprs.push("lat");
    }
    exprs
}

fn where_clause(filters: &[usize]) -> String {
    where_clause_qualified(filters, "")
}

/// `WHERE` and the filters, their columns qualified with `prefix`.
fn where_clause_qualified(filters: &[usize], prefix: &str) -> String {
    match filters.is_empty() {
        true => String::new(),
        false => format!(" WHERE {}", conjunction(filters, prefix)),
    }
}

/// ` AND ` and the filters (qualified), for a join's condition.
fn and_clause(filters: &[usize], prefix: &str) -> String {
    match filters.is_empty() {
        true => String::new(),
        false => format!(" AND {}", conjunction(filters, prefix)),
    }
}

fn conjunction(filters: &[usize], prefix: &str) -> String {
    let mut terms: Vec<String> = Vec::new();
    for &f in filters {
        let mut term = FILTERS[f % FILTERS.len()].to_string();
        for column in ["time", "lat", "lon", "t2m", "u10"] {
            term = term.replace(column, &format!("{prefix}{column}"));
        }
        if !terms.contains(&term) {
            terms.push(term);
        }
    }
    terms.join(" AND ")
}

/// How the rules' session runs.
#[derive(Debug, Clone)]
struct Shape {
    /// `zarrfusion.dense_state_bytes`, when cut (bands).
    state_bytes: Option<u32>,
    partitions: u8,
    batch_size: u16,
    /// `zarrfusion.target_partition_bytes`, when small (blocks of a chunk).
    block_bytes: Option<u32>,
    /// `zarrfusion.allowed_mem`, when limited.
    allowed_mem: Option<u32>,
    /// Through two workers of a cluster.
    cluster: bool,
    /// Reading `t` through `rechunk('t', ...)` with these chunk lengths
    /// (of time, lat and lon), when drawn.
    rechunk: Option<[u8; 3]>,
}

impl Shape {
    /// `query` with each `FROM t` reading `rechunk('t', ...)` when this
    /// shape rechunks (the oracle reads `t` as stored).
    fn reading(&self, query: &str) -> String {
        let Some([time, lat, lon]) = self.rechunk else {
            return query.to_string();
        };
        let call = format!(
            "FROM rechunk('t', time => {}, lat => {}, lon => {}) AS t",
            1 + u32::from(time) * 3,
            1 + lat % 8,
            1 + lon % 8
        );
        let mut out = String::new();
        let mut rest = query;
        while let Some(at) = rest.find("FROM t") {
            let after = &rest[at + "FROM t".len()..];
            // `FROM t` itself, not `FROM t2m`.
            let whole = after.is_empty() || after.starts_with([' ', ')']);
            out.push_str(&rest[..at]);
            out.push_str(if whole { &call } else { "FROM t" });
            rest = after;
        }
        out.push_str(rest);
        out
    }

    fn settings(&self) -> Vec<String> {
        let mut settings = vec![
            format!(
                "SET datafusion.execution.target_partitions = {}",
                self.partitions
            ),
            format!("SET datafusion.execution.batch_size = {}", self.batch_size),
        ];
        if let Some(bytes) = self.state_bytes {
            settings.push(format!("SET zarrfusion.dense_state_bytes = {bytes}"));
        }
        if let Some(bytes) = self.block_bytes {
            settings.push(format!("SET zarrfusion.target_partition_bytes = {bytes}"));
        }
        if let Some(bytes) = self.allowed_mem {
            settings.push(format!("SET zarrfusion.allowed_mem = '{bytes}B'"));
        }
        settings
    }
}

/// The fixtures queried: the climate store (6-hourly `t2m` and `u10`,
/// descending latitudes, NaN holes), and daily `tas` in climate models'
/// calendars (whose months, days of the year and bins count the model's
/// days).
const STORES: &[&str] = &[
    "climate.zarr",
    "cal_noleap.zarr",
    "cal_360_day.zarr",
    "cal_all_leap.zarr",
    "cal_julian.zarr",
];

#[derive(Debug, Clone)]
struct Case {
    /// The fixture (of [`STORES`]).
    store: usize,
    query: Query,
    shape: Shape,
}

impl Case {
    /// The SQL over this case's store (whose one variable is `tas` unless
    /// it is the climate store), and whether it orders its rows totally.
    fn sql(&self) -> (String, bool) {
        let (sql, ordered) = self.query.sql();
        match self.store {
            0 => (sql, ordered),
            _ => (sql.replace("t2m", "tas").replace("u10", "tas"), ordered),
        }
    }
}

fn filters() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(0..FILTERS.len(), 0..3)
}

fn above() -> impl Strategy<Value = Above> {
    prop_oneof![
        3 => Just(Above::All),
        2 => any::<u16>().prop_map(Above::Some),
        1 => Just(Above::Totals),
        2 => (any::<u8>(), any::<u16>(), any::<u16>()).prop_map(|(descending, limit, columns)| {
            Above::Ordered { descending, limit, columns }
        }),
        1 => Just(Above::Having),
        1 => Just(Above::Combined),
    ]
}

fn query() -> impl Strategy<Value = Query> {
    let key = |n: usize| prop::option::weighted(0.7, 0..n);
    let reduction = (
        (
            key(TIME_KEYS.len()),
            key(LAT_KEYS.len()),
            key(LON_KEYS.len()),
        ),
        prop::option::weighted(0.15, 0..TIME_KEYS.len()),
        prop::collection::vec(0..AGGREGATES.len(), 1..4),
        filters(),
        above(),
    )
        .prop_map(
            |((time, lat, lon), second_time_key, aggregates, filters, above)| Query::Reduction {
                keys: [time, lat, lon],
                second_time_key,
                aggregates,
                filters,
                above,
            },
        );
    let rolling = (
        0..WINDOW_AGGREGATES.len(),
        0..FRAMES.len(),
        any::<bool>(),
        filters(),
        0..3usize,
    )
        .prop_map(
            |(aggregate, frame, descending, filters, above)| Query::Rolling {
                aggregate,
                frame,
                descending,
                filters,
                above,
            },
        );
    let anomaly = (0..ANOMALY_KEYS.len(), 0..3usize, filters())
        .prop_map(|(key, grid, filters)| Query::Anomaly { key, grid, filters });
    prop_oneof![6 => reduction, 2 => rolling, 1 => anomaly]
}

fn shape() -> impl Strategy<Value = Shape> {
    (
        prop::option::weighted(
            0.4,
            prop::sample::select(vec![64u32, 256, 1024, 4096, 65536]),
        ),
        1u8..=4,
        prop::sample::select(vec![7u16, 64, 1000, 8192]),
        prop::option::weighted(0.5, prop::sample::select(vec![1024u32, 4096, 65536])),
        // Under 1 MB, DataFusion's own hash aggregations spill (and
        // their repartitions would, into a spill pool that can stop a
        // query for good: `zarrfusion::memory::UnspilledRepartitions`).
        prop::option::weighted(
            0.2,
            prop::sample::select(vec![64u32 << 10, 256 << 10, 1 << 20, 8 << 20]),
        ),
        prop::bool::weighted(0.1),
        prop::option::weighted(0.15, any::<[u8; 3]>()),
    )
        .prop_map(
            |(state_bytes, partitions, batch_size, block_bytes, allowed_mem, cluster, rechunk)| {
                Shape {
                    state_bytes,
                    partitions,
                    batch_size,
                    block_bytes,
                    allowed_mem,
                    cluster,
                    rechunk,
                }
            },
        )
}

fn case() -> impl Strategy<Value = Case> {
    let store = prop_oneof![4 => Just(0), 1 => 1..STORES.len()];
    (store, query(), shape()).prop_map(|(store, query, shape)| Case {
        store,
        query,
        shape,
    })
}

// ---------------------------------------------------------------------------
// Running and comparing
// ---------------------------------------------------------------------------

/// The URLs of two workers on 127.0.0.1, started once on the fuzz runtime
/// (they live as long as the test process).
pub(crate) fn workers() -> Vec<Url> {
    static URLS: OnceLock<Vec<Url>> = OnceLock::new();
    URLS.get_or_init(|| {
        runtime().block_on(async {
            let mut urls = Vec::new();
            for _ in 0..2 {
                let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
                let address = listener.local_addr().unwrap();
                let (stop, stopped) = oneshot::channel::<()>();
                // Never sent: the workers serve until the process ends.
                std::mem::forget(stop);
                tokio::spawn(serve_worker(
                    listener,
                    ZarrConfig::default(),
                    Arc::new(RuntimeEnv::default()),
                    async move {
                        let _ = stopped.await;
                    },
                ));
                urls.push(Url::parse(&format!("http://{address}")).unwrap());
            }
            urls
        })
    })
    .clone()
}

/// The session the rules run in, and the settings to run first:
/// `settings`, and with `cluster` (a session with two workers) a task for
/// each block.
pub(crate) fn session_for(settings: Vec<String>, cluster: bool) -> (SessionContext, Vec<String>) {
    if !cluster {
        return (new_context(), settings);
    }
    let urls = workers();
    // Made as the cases run it, on the fuzz runtime.
    let _on_runtime = runtime().enter();
    let ctx = distributed_context(session_config(), Arc::new(RuntimeEnv::default()), urls);
    let per_task = "SET zarrfusion.bytes_per_task = 1".to_string();
    (ctx, settings.into_iter().chain([per_task]).collect())
}

/// Where a target's intermediates go: a directory of its own (other tests
/// of the binary check that none are left in the system's), removed after
/// each case ([`WorkDir`]).
pub(crate) fn work_dir(target: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("zf-differential-{target}-{}", std::process::id()))
}

/// Removes the [`work_dir`] of the target it names when dropped (the cases
/// of a target run one after the other).
pub(crate) struct WorkDir(pub(crate) &'static str);

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(work_dir(self.0));
    }
}

/// A result: its columns (name and type) and its rows.
type Answer = (Vec<String>, Vec<Vec<Value>>);

/// Runs `settings` then `query` over the fixture `store` registered as
/// `t` in `ctx`; with `copy` (a directory and the COPY's options), copies
/// its result there and reads the store back (in a plain session).
async fn answer(
    ctx: SessionContext,
    store: &str,
    settings: &[String],
    query: &str,
    copy: Option<(&std::path::Path, &str)>,
) -> Result<Answer, String> {
    let work = format!(
        "SET zarrfusion.work_dir = '{}'",
        work_dir(if copy.is_some() { "copies" } else { "queries" }).display()
    );
    for setting in std::iter::once(&work).chain(settings) {
        sql(&ctx, setting)
            .await
            .map_err(|e| format!("{setting}: {e}"))?;
    }
    ctx.register_zarr("t", &fixture(store), HashMap::new())
        .await
        .map_err(|e| e.to_string())?;
    let (ctx, query) = match copy {
        None => (ctx, query.to_string()),
        Some((dir, options)) => {
            let target = dir.to_string_lossy();
            let copy = format!("COPY ({query}) TO '{target}' STORED AS ZARR OPTIONS ({options})");
            let df = sql(&ctx, &copy).await.map_err(|e| e.to_string())?;
            df.collect().await.map_err(|e| e.to_string())?;
            (
                new_context(),
                format!("SELECT * FROM read_zarr('{target}')"),
            )
        }
    };
    let df = sql(&ctx, &query).await.map_err(|e| e.to_string())?;
    let columns = (df.schema().fields().iter())
        .map(|f| format!("{}: {}", f.name(), f.data_type()))
        .collect();
    let batches: Vec<RecordBatch> = df.collect().await.map_err(|e| e.to_string())?;
    Ok((columns, rows(&batches)))
}

const RULES_OFF: [&str; 4] = [
    "SET zarrfusion.dense_reduction = false",
    "SET zarrfusion.rolling_window = false",
    "SET zarrfusion.broadcast_join = false",
    "SET zarrfusion.aligned_join = false",
];

/// Checks the rules' answer against DataFusion's.
fn compare(
    context: &str,
    ordered: bool,
    ours: Result<Answer, String>,
    oracle: Result<Answer, String>,
    limited: bool,
) -> Result<(), TestCaseError> {
    let (theirs_columns, mut theirs) = match oracle {
        Ok(answer) => answer,
        // A query DataFusion cannot run either (not one the generator
        // means to make): nothing to compare, but no panic either.
        Err(e) => {
            if let Err(ours) = &ours {
                check_error(context, ours)?;
            }
            return check_error(context, &e);
        }
    };
    let (columns, mut rows) = match ours {
        Ok(answer) => answer,
        Err(e) if limited && e.contains("Resources exhausted") => return Ok(()),
        Err(e) => {
            return Err(TestCaseError::fail(format!(
                "{context}: failed where DataFusion answered: {e}"
            )))
        }
    };
    prop_assert_eq!(&columns, &theirs_columns, "{}: columns", context);
    prop_assert_eq!(
        rows.len(),
        theirs.len(),
        "{}: {} rows, DataFusion {}; first: {:?} vs {:?}",
        context,
        rows.len(),
        theirs.len(),
        rows.first(),
        theirs.first()
    );
    let alike =
        |a: &[Value], b: &[Value]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| same(x, y));
    let width = columns.len();
    if !ordered {
        sort_rows(&mut rows, width);
        sort_rows(&mut theirs, width);
    }
    for i in 0..rows.len() {
        if alike(&rows[i], &theirs[i]) {
            continue;
        }
        // Rows alike but for sums taken in another order may sort the
        // other way round where they (nearly) tie: look a little further.
        let near =
            (i + 1..theirs.len().min(i + 64)).find(|&j| !ordered && alike(&rows[i], &theirs[j]));
        match near {
            Some(j) => theirs.swap(i, j),
            None => prop_assert!(
                false,
                "{}: row {}: {:?}, DataFusion {:?}",
                context,
                i,
                rows[i],
                theirs[i]
            ),
        }
    }
    Ok(())
}

/// The fuzz targets' configuration, failures kept beside this file.
fn differential_config() -> Config {
    Config {
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "tests/integration/differential.proptest-regressions",
        ))),
        ..config()
    }
}

proptest! {
    #![proptest_config(differential_config())]

    /// A climate query gives DataFusion's rows with every array rule on,
    /// whatever the blocks, partitions, batches, bands, memory limit and
    /// cluster it runs in (or is refused for memory, naming it).
    #[test]
    fn array_plans_give_datafusion_s_rows(case in case()) {
        record("differential", &case);
        let _work = WorkDir("queries");
        let (query, ordered) = case.sql();
        let store = STORES[case.store];
        let settings = case.shape.settings();
        let read = case.shape.reading(&query);
        let context = format!(
            "{read} over {store} with {settings:?} (cluster: {})",
            case.shape.cluster
        );
        let off = RULES_OFF.map(String::from);
        let (ctx, settings) = session_for(settings, case.shape.cluster);
        let (ours, oracle) = run(&context, async {
            (
                answer(ctx, store, &settings, &read, None).await,
                answer(new_context(), store, &off, &query, None).await,
            )
        })?;
        compare(&context, ordered, ours, oracle, case.shape.allowed_mem.is_some())?;
    }
}

// ---------------------------------------------------------------------------
// COPY ... STORED AS ZARR
// ---------------------------------------------------------------------------

/// What a COPY writes.
#[derive(Debug, Clone)]
enum Written {
    /// A reduction's every row (its keys the store's dimensions): streamed
    /// a slab at a time, or collected, in bands or not.
    Reduction {
        keys: [Option<usize>; 3],
        second_time_key: Option<usize>,
        aggregates: Vec<usize>,
        filters: Vec<usize>,
    },
    /// A selection with computed variables: chunk by chunk.
    Selection { filters: Vec<usize>, exprs: u8 },
    /// A rolling window's rows: the rolling copy.
    Rolling {
        aggregate: usize,
        frame: usize,
        filters: Vec<usize>,
    },
    /// Each value less a climatology: the anomaly's copy.
    Anomaly { key: usize, filters: Vec<usize> },
}

/// Filters on the dimensions only (a copy of a selection keeps its grid).
const DIMENSION_FILTERS: &[usize] = &[0, 1, 2, 3, 4];

impl Written {
    /// The query and its dimension columns.
    fn sql(&self) -> (String, Vec<String>) {
        let grid = || ["time", "lat", "lon"].map(String::from).to_vec();
        match self {
            Written::Reduction {
                keys,
                second_time_key,
                aggregates,
                filters,
            } => {
                let query = Query::Reduction {
                    keys: *keys,
                    second_time_key: *second_time_key,
                    aggregates: aggregates.clone(),
                    filters: filters.clone(),
                    above: Above::All,
                };
                let n = key_exprs(keys, *second_time_key).len();
                (query.sql().0, (0..n).map(|i| format!("k{i}")).collect())
            }
            Written::Selection { filters, exprs } => {
                let computed = [
                    "t2m - 273.15 AS x",
                    "u10 * 2 AS y, t2m",
                    "t2m + u10 AS z, u10",
                    "CAST(t2m AS DOUBLE) AS w",
                ];
                let sql = format!(
                    "SELECT time, lat, lon, {} FROM t{}",
                    computed[*exprs as usize % computed.len()],
                    where_clause(filters)
                );
                (sql, grid())
            }
            Written::Rolling {
                aggregate,
                frame,
                filters,
            } => {
                let sql = format!(
                    "SELECT time, lat, lon, {} OVER (PARTITION BY lat, lon ORDER BY time {}) AS r \
                     FROM t{}",
                    WINDOW_AGGREGATES[aggregate % WINDOW_AGGREGATES.len()],
                    FRAMES[frame % FRAMES.len()],
                    where_clause(filters)
                );
                (sql, grid())
            }
            Written::Anomaly { key, filters } => {
                let key = ANOMALY_KEYS[key % ANOMALY_KEYS.len()];
                let qualified = key.replace("time", "t.time");
                let sql = format!(
                    "WITH clim AS (SELECT {key} AS k, lat, lon, avg(t2m) AS c FROM t GROUP BY 1, \
                     2, 3) SELECT t.time, t.lat, t.lon, t.t2m - clim.c AS a FROM t JOIN clim ON \
                     {qualified} = clim.k AND t.lat = clim.lat AND t.lon = clim.lon{}",
                    and_clause(filters, "t.")
                );
                (sql, grid())
            }
        }
    }
}

#[derive(Debug, Clone)]
struct CopyCase {
    store: usize,
    written: Written,
    /// Per dimension column, a chunk length when given.
    chunks: Vec<Option<u8>>,
    shape: Shape,
}

impl CopyCase {
    /// The query (over this case's store) and the COPY's options.
    fn sql(&self) -> (String, String) {
        let (sql, dims) = self.written.sql();
        let sql = match self.store {
            0 => sql,
            _ => sql.replace("t2m", "tas").replace("u10", "tas"),
        };
        let chunks: Vec<String> = (dims.iter().zip(&self.chunks))
            .filter_map(|(d, c)| c.map(|c| format!("{d}={}", 1 + c % 60)))
            .collect();
        let mut options = format!("'dims' '{}'", dims.join(","));
        if !chunks.is_empty() {
            options.push_str(&format!(", 'chunks' '{}'", chunks.join(",")));
        }
        (sql, options)
    }
}

fn dimension_filters() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(prop::sample::select(DIMENSION_FILTERS.to_vec()), 0..3)
}

fn written() -> impl Strategy<Value = Written> {
    let key = |n: usize| prop::option::weighted(0.7, 0..n);
    let reduction = (
        (
            key(TIME_KEYS.len()),
            key(LAT_KEYS.len()),
            key(LON_KEYS.len()),
        ),
        prop::option::weighted(0.15, 0..TIME_KEYS.len()),
        prop::collection::vec(0..AGGREGATES.len(), 1..4),
        filters(),
    )
        .prop_map(|((time, lat, lon), second_time_key, aggregates, filters)| {
            Written::Reduction {
                keys: [time, lat, lon],
                second_time_key,
                aggregates,
                filters,
            }
        });
    let selection = (dimension_filters(), any::<u8>())
        .prop_map(|(filters, exprs)| Written::Selection { filters, exprs });
    let rolling = (
        0..WINDOW_AGGREGATES.len(),
        0..FRAMES.len(),
        dimension_filters(),
    )
        .prop_map(|(aggregate, frame, filters)| Written::Rolling {
            aggregate,
            frame,
            filters,
        });
    let anomaly = (0..ANOMALY_KEYS.len(), dimension_filters())
        .prop_map(|(key, filters)| Written::Anomaly { key, filters });
    prop_oneof![4 => reduction, 2 => selection, 2 => rolling, 1 => anomaly]
}

fn copy_case() -> impl Strategy<Value = CopyCase> {
    let store = prop_oneof![4 => Just(0), 1 => 1..STORES.len()];
    let chunks = prop::collection::vec(prop::option::weighted(0.4, any::<u8>()), 4);
    (store, written(), chunks, shape()).prop_map(|(store, written, chunks, shape)| CopyCase {
        store,
        written,
        chunks,
        shape,
    })
}

/// A scratch directory for one COPY, erased when dropped.
struct CopyDir(std::path::PathBuf);

impl CopyDir {
    fn new(name: &str) -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "zf-differential-{}-{n}-{name}.zarr",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        Self(dir)
    }
}

impl Drop for CopyDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

proptest! {
    #![proptest_config(differential_config())]

    /// A COPY of a climate query to Zarr with every array rule on (the
    /// streamed reduction, the chunk-by-chunk selection, rolling and
    /// anomaly copies) writes a store that reads back as the store the
    /// same COPY writes with every rule off (DataFusion's rows, collected
    /// by the sink), whatever the chunks, blocks, partitions, batches,
    /// bands, memory limit and cluster.
    #[test]
    fn copies_write_the_store_datafusion_s_rows_make(case in copy_case()) {
        record("differential_copy", &case);
        let _work = WorkDir("copies");
        let (query, options) = case.sql();
        let store = STORES[case.store];
        let settings = case.shape.settings();
        let read = case.shape.reading(&query);
        let context = format!(
            "COPY ({read}) OPTIONS ({options}) over {store} with {settings:?} (cluster: {})",
            case.shape.cluster
        );
        let off = RULES_OFF.map(String::from);
        let (ours_dir, theirs_dir) = (CopyDir::new("on"), CopyDir::new("off"));
        let (ctx, settings) = session_for(settings, case.shape.cluster);
        let (ours, oracle) = run(&context, async {
            let ours = answer(ctx, store, &settings, &read, Some((&ours_dir.0, &options))).await;
            let theirs_copy = Some((theirs_dir.0.as_path(), options.as_str()));
            let theirs = answer(new_context(), store, &off, &query, theirs_copy).await;
            (ours, theirs)
        })?;
        let limited = case.shape.allowed_mem.is_some();
        if ours.is_err() {
            // A failed COPY leaves nothing at its target.
            prop_assert!(!ours_dir.0.exists(), "{}: a failed COPY left {:?}", context, ours_dir.0);
        }
        compare(&context, false, ours, oracle, limited)?;
    }
}

//! Session settings of zarrfusion, under the `zarrfusion.` prefix.
//!
//! ```sql
//! SET zarrfusion.target_partition_bytes = 16777216;
//! SET zarrfusion.dense_reduction = false;
//! SET zarrfusion.aligned_join = false;
//! SET zarrfusion.broadcast_join = false;
//! SET zarrfusion.rolling_window = false;
//! SET zarrfusion.allowed_mem = '2GB';        -- the session's memory pool
//! SET zarrfusion.work_dir = '/scratch/zf';   -- where intermediates and spills go
//! SET zarrfusion.work_dir = 's3://bucket/zf'; -- intermediates in an object store
//! SET zarrfusion.device = 'cpu';             -- where FFTs run: auto, cpu, cuda
//! SET zarrfusion.io_concurrency = 64;        -- object-store reads in flight per query
//! SET zarrfusion.open_cache = false;         -- open object-store tables without the cache
//! SET zarrfusion.retry.max_retries = 3;      -- retries of stores opened from now on
//! SET zarrfusion.client.timeout = '10s';     -- their HTTP client's time-out a request
//! ```
//!
//! The `retry.*` and `client.*` settings are the session's defaults for
//! the object stores zarrfusion builds after they are set (a table's own
//! `OPTIONS` win over them); a store already registered for a bucket is
//! reused as it is by tables that give no object-store options.
//!
//! `allowed_mem` and `work_dir` live on DataFusion's runtime (its memory
//! pool and disk manager): [`translate_runtime_settings`] turns them into
//! `datafusion.runtime.memory_limit` and `datafusion.runtime.temp_directory`,
//! with sizes written as `2GB`, `2G`, `512MB`, `100KB` (any case).

use std::collections::HashMap;

use datafusion::common::config::{ConfigExtension, ConfigOptions};
use datafusion::common::{config_namespace, extensions_options, plan_err, Result};
use datafusion::logical_expr::{DdlStatement, LogicalPlan, ResetVariable, SetVariable, Statement};
use datafusion::prelude::SessionContext;

use crate::memory::parse_size;
use crate::zarr::{
    option_duration, set_retry_option, AllowedLocations, StoreLocation, MAX_IO_CONCURRENCY,
};

extensions_options! {
    /// Settings of the Zarr scan and the array operators.
    pub struct ZarrConfig {
        /// Decoded bytes a scan partition block aims for (blocks are whole chunks).
        pub target_partition_bytes: usize, default = 32 * 1024 * 1024
        /// Plan `GROUP BY` over dimensions of a Zarr table as a dense array
        /// reduction (accumulators indexed by coordinate position) instead
        /// of a hash aggregation.
        pub dense_reduction: bool, default = true
        /// Let the dense reduction group by deterministic functions of one
        /// dimension's coordinate (`date_trunc('day', time)`,
        /// `extract(month FROM time)`, `floor(lat / 2)`): resampling,
        /// climatologies and coarsening. Off: only dimension columns.
        pub dense_group_functions: bool, default = true
        /// The most group state a dense reduction holds at once (one
        /// worker's; without a memory limit, its workers' together). One
        /// with more runs in bands of a grouped dimension's keys (the first
        /// in table order whose keys run along its positions: it is grouped
        /// by them, or by `date_trunc` of an ordered time), each band's
        /// groups folded and emitted before the next's; where no grouped
        /// dimension's keys do, it stays DataFusion's hash aggregation.
        pub dense_state_bytes: usize, default = 1 << 30
        /// Plan a join of two Zarr tables on all their dimensions, over the
        /// same coordinates, as one scan of their aligned blocks instead of
        /// a hash join.
        pub aligned_join: bool, default = true
        /// Plan a join of a Zarr table with a small result keyed by some of
        /// its dimensions or functions of their coordinates (an anomaly:
        /// `era5 JOIN clim USING (lat, lon)`) as columns of the table,
        /// broadcast from the small side held once as a dense array,
        /// instead of a hash join; with `rolling_window`, window aggregates
        /// over whole partitions as such a join of their reduction.
        pub broadcast_join: bool, default = true
        /// Plan rolling windows along a dimension of a Zarr table
        /// (`avg(x) OVER (PARTITION BY <the other dimensions> ORDER BY
        /// <dim> ROWS BETWEEN ...)`, frames from the series' start or to
        /// its end) as reads of overlapping blocks along the dimension
        /// instead of DataFusion's sort and window.
        pub rolling_window: bool, default = true
        /// Where intermediate arrays go (a rechunk's stages, the rechunked
        /// copy a query scans): a local path or an object-store URL; empty:
        /// the runtime's temporary directory. Set it with
        /// `SET zarrfusion.work_dir`, which also moves DataFusion's spill
        /// files to a local path.
        pub work_dir: String, default = String::new()
        /// Where FFTs run: `auto` (a GPU when the probe finds one usable,
        /// else the CPU, said in a log line), `cpu`, or `cuda` (refused
        /// when no GPU is usable).
        pub device: String, default = "auto".to_string()
        /// How FFTs handle lines: `auto` (whole lines when one fits
        /// `allowed_mem`, rechunking the variable if its chunks split them;
        /// the four-step path when one does not), `whole_lines`, or
        /// `four_step` (lines split into blocks and intermediates in
        /// `work_dir`, whatever their length). Under `auto` or
        /// `four_step`, a transform along several dimensions whose blocks
        /// do not fit runs one dimension at a time (staged in `work_dir`).
        pub fft_strategy: String, default = "auto".to_string()
        /// Object-store reads an operator keeps in flight ahead of its
        /// decoders (shared among its partitions), each holding up to a
        /// chunk counted in the operator's memory; fewer when `allowed_mem`
        /// leaves less room; 0 turns reading ahead off. Local stores do
        /// not read ahead.
        pub io_concurrency: usize, default = 64
        /// Decoded bytes of a Zarr scan each task of a cluster reads (a
        /// session with workers, see [`crate::distributed`]): the scan's
        /// stage runs on as many tasks as this divides its bytes into (at
        /// most one per block, at most the engine's limit).
        pub bytes_per_task: usize, default = 256 * 1024 * 1024
        /// Where a cluster merges a dense reduction's partial states:
        /// `auto` (in a tree when its stage runs more than two tasks),
        /// `session` (every task's states into the session, merged there),
        /// or `tree` (merged first on the workers, each merging a share of
        /// the groups from every task, then once more in the session).
        pub state_merge: String, default = "auto".to_string()
        /// Keep the metadata and coordinates read when opening an
        /// object-store table in the cache directory
        /// (`$ZARRFUSION_CACHE_DIR/opening`, else
        /// `~/.cache/zarrfusion/opening`), and at the next opening of the
        /// store request them all at once, each only if it changed (one
        /// round trip instead of two or three).
        pub open_cache: bool, default = true
        /// The locations statements may read, write and work in: a
        /// comma-separated list of directories and URL prefixes (see
        /// [`AllowedLocations`]); empty: everywhere. Set when the session
        /// is built; `SET` and `RESET` refuse it.
        pub allowed_locations: String, default = String::new()
        /// Retries of failed object-store requests, for stores built from
        /// now on (`retry.max_retries`, `retry.retry_timeout`,
        /// `retry.backoff.*`, as the table options).
        pub retry: RetrySettings, default = RetrySettings::default()
        /// The HTTP client of object stores built from now on
        /// (`client.timeout`, `client.connect_timeout`).
        pub client: ClientSettings, default = ClientSettings::default()
    }
}

config_namespace! {
    /// Session defaults of object stores' retries (object_store's
    /// `RetryConfig`); unset: object_store's defaults.
    pub struct RetrySettings {
        /// Retries of one request (object_store: 10).
        pub max_retries: Option<usize>, default = None
        /// No retry starts after this long since the first attempt, e.g.
        /// `'3min'` (object_store: 3 minutes).
        pub retry_timeout: Option<String>, default = None
        /// The waits between attempts.
        pub backoff: BackoffSettings, default = BackoffSettings::default()
    }
}

config_namespace! {
    /// Session defaults of the waits between retries.
    pub struct BackoffSettings {
        /// The first wait, e.g. `'100ms'`.
        pub init_backoff: Option<String>, default = None
        /// The longest wait, e.g. `'15s'`.
        pub max_backoff: Option<String>, default = None
        /// How much each wait grows, e.g. `2`.
        pub base: Option<String>, default = None
    }
}

config_namespace! {
    /// Session defaults of object stores' HTTP client.
    pub struct ClientSettings {
        /// Time-out of one request, body included, e.g. `'30s'`.
        pub timeout: Option<String>, default = None
        /// Time-out of connecting, e.g. `'5s'`.
        pub connect_timeout: Option<String>, default = None
    }
}

impl ConfigExtension for ZarrConfig {
    const PREFIX: &'static str = "zarrfusion";
}

impl ZarrConfig {
    /// The zarrfusion settings of a session's options (the defaults where
    /// the session has none).
    pub fn of(options: &ConfigOptions) -> ZarrConfig {
        options
            .extensions
            .get::<ZarrConfig>()
            .cloned()
            .unwrap_or_default()
    }

    /// The locations the session may reach (`allowed_locations`).
    pub fn allowed(&self) -> crate::error::Result<AllowedLocations> {
        AllowedLocations::parse(&self.allowed_locations)
    }

    /// The object-store options the session's `retry.*` and `client.*`
    /// settings stand for, named as table options (`retry.max_retries`).
    pub fn object_store_defaults(&self) -> HashMap<String, String> {
        let (retry, backoff, client) = (&self.retry, &self.retry.backoff, &self.client);
        [
            (
                "retry.max_retries",
                retry.max_retries.map(|n| n.to_string()),
            ),
            ("retry.retry_timeout", retry.retry_timeout.clone()),
            ("retry.backoff.init_backoff", backoff.init_backoff.clone()),
            ("retry.backoff.max_backoff", backoff.max_backoff.clone()),
            ("retry.backoff.base", backoff.base.clone()),
            ("client.timeout", client.timeout.clone()),
            ("client.connect_timeout", client.connect_timeout.clone()),
        ]
        .into_iter()
        .filter_map(|(key, value)| value.map(|v| (key.to_string(), v)))
        .collect()
    }
}

/// The most rows a record batch may be asked for
/// (`datafusion.execution.batch_size`): DataFusion's sorts and zarrfusion's
/// operators set room aside for a batch before its rows come, so a larger
/// one fails to allocate instead of being refused.
pub const MAX_BATCH_ROWS: usize = 1 << 24;

/// The most threads any of zarrfusion's APIs starts for one job (a
/// loader's decoders, a window index's, a rechunk's or a COPY's workers):
/// more is a mistaken argument (each holds a block or a chunk), not a
/// speed-up.
pub const MAX_THREADS: usize = 1024;

/// The most partitions a plan may be asked for
/// (`datafusion.execution.target_partitions`): each costs channels, tasks
/// and buffers before any data moves (2^20 of them took over a minute and
/// gigabytes to plan a rechunk of 120 cells).
pub const MAX_TARGET_PARTITIONS: usize = 1024;

/// Checks a setting's value where the setting's type does not say enough,
/// so that a bad value is refused when it is set (by `SET`, the shell's
/// flags, Python's `SessionContext`): `zarrfusion.io_concurrency` at most
/// [`MAX_IO_CONCURRENCY`], `zarrfusion.state_merge` one of its values,
/// `zarrfusion.retry.*` and `zarrfusion.client.*`
/// the way the table options of the same names are checked, and
/// DataFusion's `datafusion.execution.batch_size` and `target_partitions`
/// at most [`MAX_BATCH_ROWS`] and [`MAX_TARGET_PARTITIONS`]. Other
/// settings pass.
pub fn check_setting(variable: &str, value: &str) -> Result<()> {
    let lower = variable.trim().to_ascii_lowercase();
    let bound = match lower.as_str() {
        "datafusion.execution.batch_size" => Some((MAX_BATCH_ROWS, "rows a batch")),
        "datafusion.execution.target_partitions" => Some((MAX_TARGET_PARTITIONS, "partitions")),
        _ => None,
    };
    if let Some((most, what)) = bound {
        return match value.trim().parse::<u64>() {
            Ok(n) if n > most as u64 => plan_err!("{variable}: {n} {what}; at most {most}"),
            // What does not parse is refused by the setting itself.
            _ => Ok(()),
        };
    }
    let Some(key) = lower.strip_prefix("zarrfusion.") else {
        return Ok(());
    };
    if key == "state_merge" {
        return match value.trim().to_ascii_lowercase().as_str() {
            "auto" | "session" | "tree" => Ok(()),
            other => plan_err!("{variable} is '{other}'; it takes auto, session or tree"),
        };
    }
    if key == "io_concurrency" {
        return match value.trim().parse::<usize>() {
            Ok(n) if n > MAX_IO_CONCURRENCY => {
                plan_err!("{variable}: {n} reads in flight asked for; at most {MAX_IO_CONCURRENCY}")
            }
            // What does not parse is refused by the setting itself.
            _ => Ok(()),
        };
    }
    if !(key.starts_with("retry.") || key.starts_with("client.")) {
        return Ok(());
    }
    // Each value on its own: the first and longest backoff are checked
    // against each other when a store is built, whatever order they were
    // set in.
    let checked = match key.strip_prefix("client.") {
        Some(_) => option_duration(value).map(|_| ()),
        None => set_retry_option(key, value, &mut Default::default(), &mut Default::default()),
    };
    match checked {
        Ok(()) => Ok(()),
        Err(e) => plan_err!("{variable}: {e}"),
    }
}

/// The runtime setting a zarrfusion setting stands for.
fn runtime_name(variable: &str) -> Option<&'static str> {
    match variable.trim().to_ascii_lowercase().as_str() {
        "zarrfusion.allowed_mem" => Some("datafusion.runtime.memory_limit"),
        "zarrfusion.work_dir" => Some("datafusion.runtime.temp_directory"),
        _ => None,
    }
}

/// Applies `SET`/`RESET zarrfusion.allowed_mem` and `zarrfusion.work_dir`
/// to `ctx` as zarrfusion's front doors do: `work_dir` (a path or an
/// object-store URL) is recorded in the session's [`ZarrConfig`] at once,
/// and the plan is rewritten into the DataFusion runtime settings the
/// values stand for ([`translate_runtime_settings`]).
pub fn apply_runtime_settings(ctx: &SessionContext, plan: LogicalPlan) -> Result<LogicalPlan> {
    check_locations(
        &ZarrConfig::of(ctx.state().config_options()).allowed()?,
        &plan,
    )?;
    let work_dir = match &plan {
        LogicalPlan::Statement(Statement::SetVariable(SetVariable { variable, value }))
            if is_work_dir(variable) =>
        {
            Some(value.clone())
        }
        LogicalPlan::Statement(Statement::ResetVariable(ResetVariable { variable }))
            if is_work_dir(variable) =>
        {
            Some(String::new())
        }
        _ => None,
    };
    let plan = translate_runtime_settings(plan)?;
    if let Some(value) = work_dir {
        ctx.state_ref()
            .write()
            .config_mut()
            .options_mut()
            .set("zarrfusion.work_dir", &value)?;
    }
    Ok(plan)
}

/// Holds a statement to the session's allowed locations: the list itself
/// cannot be set or reset from SQL; work and temporary directories, the
/// locations of `CREATE EXTERNAL TABLE` and the targets of `COPY` (of any
/// format) must be under it.
fn check_locations(allowed: &AllowedLocations, plan: &LogicalPlan) -> Result<()> {
    let is_list =
        |variable: &str| (variable.trim()).eq_ignore_ascii_case("zarrfusion.allowed_locations");
    match plan {
        LogicalPlan::Statement(Statement::SetVariable(SetVariable { variable, .. }))
        | LogicalPlan::Statement(Statement::ResetVariable(ResetVariable { variable }))
            if is_list(variable) =>
        {
            plan_err!(
                "zarrfusion.allowed_locations is set when the session is built                  (Rust: its config; Python: SessionContext(allowed_locations=...);                  the shell: --allow), not from SQL"
            )
        }
        _ if !allowed.is_restricted() => Ok(()),
        LogicalPlan::Statement(Statement::SetVariable(SetVariable { variable, value }))
            if is_work_dir(variable)
                || (variable.trim()).eq_ignore_ascii_case("datafusion.runtime.temp_directory") =>
        {
            Ok(allowed.check_text(value)?)
        }
        LogicalPlan::Ddl(DdlStatement::CreateExternalTable(table)) => {
            for location in &table.locations {
                allowed.check_text(location)?;
            }
            Ok(())
        }
        LogicalPlan::Copy(copy) => Ok(allowed.check_text(&copy.output_url)?),
        _ => Ok(()),
    }
}

fn is_work_dir(variable: &str) -> bool {
    variable.trim().eq_ignore_ascii_case("zarrfusion.work_dir")
}

/// Rewrites `SET`/`RESET zarrfusion.allowed_mem` and `zarrfusion.work_dir`
/// into the DataFusion runtime settings they stand for (an object-store
/// `work_dir` stays a zarrfusion setting: DataFusion spills to local
/// disk only); other plans pass through. A size that does not parse, or a
/// local work directory that cannot be created, is an error naming the
/// setting.
pub fn translate_runtime_settings(plan: LogicalPlan) -> Result<LogicalPlan> {
    match plan {
        LogicalPlan::Statement(Statement::SetVariable(SetVariable { variable, value })) => {
            check_setting(&variable, &value)?;
            let Some(runtime) = runtime_name(&variable) else {
                return Ok(LogicalPlan::Statement(Statement::SetVariable(
                    SetVariable { variable, value },
                )));
            };
            if !runtime.ends_with("memory_limit") {
                if let Ok(StoreLocation::Remote(_)) = StoreLocation::parse(&value) {
                    return Ok(LogicalPlan::Statement(Statement::SetVariable(
                        SetVariable { variable, value },
                    )));
                }
            }
            let value = if runtime.ends_with("memory_limit") {
                let bytes = match parse_size(&value) {
                    Ok(b) => b,
                    Err(e) => return plan_err!("zarrfusion.allowed_mem: {e}"),
                };
                // DataFusion takes K/M/G units; KiB keep the size to 1 KiB.
                format!("{}K", bytes.div_ceil(1024))
            } else {
                if let Err(e) = std::fs::create_dir_all(&value) {
                    return plan_err!("zarrfusion.work_dir: cannot use '{value}': {e}");
                }
                value
            };
            Ok(LogicalPlan::Statement(Statement::SetVariable(
                SetVariable {
                    variable: runtime.to_string(),
                    value,
                },
            )))
        }
        LogicalPlan::Statement(Statement::ResetVariable(ResetVariable { variable })) => {
            let variable = runtime_name(&variable).map_or(variable, str::to_string);
            Ok(LogicalPlan::Statement(Statement::ResetVariable(
                ResetVariable { variable },
            )))
        }
        other => Ok(other),
    }
}

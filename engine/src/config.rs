//! Session settings of zarrfusion, under the `zarrfusion.` prefix.
//!
//! ```sql
//! SET zarrfusion.target_partition_bytes = 16777216;
//! SET zarrfusion.dense_reduction = false;
//! SET zarrfusion.aligned_join = false;
//! SET zarrfusion.allowed_mem = '2GB';        -- the session's memory pool
//! SET zarrfusion.work_dir = '/scratch/zf';   -- where intermediates and spills go
//! SET zarrfusion.work_dir = 's3://bucket/zf'; -- intermediates in an object store
//! SET zarrfusion.device = 'cpu';             -- where FFTs run: auto, cpu, cuda
//! SET zarrfusion.io_concurrency = 64;        -- object-store reads in flight per query
//! ```
//!
//! `allowed_mem` and `work_dir` live on DataFusion's runtime (its memory
//! pool and disk manager): [`translate_runtime_settings`] turns them into
//! `datafusion.runtime.memory_limit` and `datafusion.runtime.temp_directory`,
//! with sizes written as `2GB`, `2G`, `512MB`, `100KB` (any case).

use datafusion::common::config::{ConfigExtension, ConfigOptions};
use datafusion::common::{extensions_options, plan_err, Result};
use datafusion::logical_expr::{LogicalPlan, ResetVariable, SetVariable, Statement};
use datafusion::prelude::SessionContext;

use crate::memory::parse_size;
use crate::zarr::StoreLocation;

extensions_options! {
    /// Settings of the Zarr scan and the array operators.
    pub struct ZarrConfig {
        /// Decoded bytes a scan partition block aims for (blocks are whole chunks).
        pub target_partition_bytes: usize, default = 32 * 1024 * 1024
        /// Plan `GROUP BY` over dimensions of a Zarr table as a dense array
        /// reduction (accumulators indexed by coordinate position) instead
        /// of a hash aggregation.
        pub dense_reduction: bool, default = true
        /// Plan a join of two Zarr tables on all their dimensions, over the
        /// same coordinates, as one scan of their aligned blocks instead of
        /// a hash join.
        pub aligned_join: bool, default = true
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

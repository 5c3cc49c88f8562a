//! Session settings of zarrfusion, under the `zarrfusion.` prefix.
//!
//! ```sql
//! SET zarrfusion.target_partition_bytes = 16777216;
//! SET zarrfusion.dense_reduction = false;
//! SET zarrfusion.aligned_join = false;
//! SET zarrfusion.allowed_mem = '2GB';        -- the session's memory pool
//! SET zarrfusion.work_dir = '/scratch/zf';   -- where intermediates and spills go
//! ```
//!
//! `allowed_mem` and `work_dir` live on DataFusion's runtime (its memory
//! pool and disk manager): [`translate_runtime_settings`] turns them into
//! `datafusion.runtime.memory_limit` and `datafusion.runtime.temp_directory`,
//! with sizes written as `2GB`, `2G`, `512MB`, `100KB` (any case).

use datafusion::common::config::{ConfigExtension, ConfigOptions};
use datafusion::common::{extensions_options, plan_err, Result};
use datafusion::logical_expr::{LogicalPlan, ResetVariable, SetVariable, Statement};

use crate::memory::parse_size;

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

/// Rewrites `SET`/`RESET zarrfusion.allowed_mem` and `zarrfusion.work_dir`
/// into the DataFusion runtime settings they stand for; other plans pass
/// through. A size that does not parse, or a work directory that cannot be
/// created, is an error naming the setting.
pub fn translate_runtime_settings(plan: LogicalPlan) -> Result<LogicalPlan> {
    match plan {
        LogicalPlan::Statement(Statement::SetVariable(SetVariable { variable, value })) => {
            let Some(runtime) = runtime_name(&variable) else {
                return Ok(LogicalPlan::Statement(Statement::SetVariable(
                    SetVariable { variable, value },
                )));
            };
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

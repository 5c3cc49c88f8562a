//! Dense reductions: `GROUP BY` over dimensions of a Zarr table, computed
//! with accumulators indexed by coordinate position instead of a hash table.
//!
//! Primitives (see [`crate::array`]): read + blockwise (the arguments,
//! fused) + reduce.
//!
//! | module | owns |
//! |---|---|
//! | `rule` | [`DenseReductionRule`], which finds such aggregates in plain SQL |
//! | `node` | [`DenseReduction`], the logical plan node |
//! | `exec` | [`DenseReductionExec`], the operator: fused decode, evaluate and fold, then a tree merge |
//! | `partial` | the same on a cluster: each task's partial states, merged by `merge` (or DataFusion's final aggregate) |
//! | `merge` | [`DenseMergeExec`], the tasks' partial states merged by group position |
//! | `groups` | the dense group space and how rows of a box map onto it |
//! | `keys` | grouping by functions of one dimension's coordinate (resampling, climatologies, coarsening) |
//! | `accumulators` | per-group state of `count`, `sum`, `avg`, `min`, `max`, `var`, `stddev` |
//!
//! ```no_run
//! # async fn example() -> datafusion::error::Result<()> {
//! let ctx = zarrfusion::new_context();
//! ctx.sql("CREATE EXTERNAL TABLE era5 STORED AS ZARR LOCATION 'demo/era5.zarr'").await?;
//! // Planned as a DenseReduction: no hash table, one pass over the chunks.
//! let df = ctx.sql("SELECT lat, avg(t2m), stddev(t2m) FROM era5 GROUP BY lat").await?;
//! df.explain(false, false)?.show().await?;
//! # Ok(())
//! # }
//! ```

mod accumulators;
mod exec;
mod groups;
mod keys;
mod merge;
mod node;
mod partial;
mod rule;

pub use accumulators::{numeric_domain, DenseAccumulator, ReduceOp};
pub use exec::{reduction_rows, Bands, DenseReductionExec, ReduceSpec, ReductionParts};
pub use groups::{GroupSpace, KeyMap, Line};
pub use keys::{
    coordinate_repeats, key_schema, physical_key, DimKeys, KeySpec, MAX_KEYED_POSITIONS,
};
pub use merge::{DenseMergeExec, Merged, GROUP_POSITION};
pub use node::{DenseReduction, GroupKey, ReduceExpr};
pub use rule::{DenseReductionRule, MAX_STATE_BYTES};

//! Array operations as DataFusion plan nodes: logical nodes carrying the
//! array semantics, their operators, the optimizer rules that find them in
//! plain SQL, and the planner that turns one into the other.
//!
//! | module | owns |
//! |---|---|
//! | [`broadcast`] | joins of a Zarr table with a small result keyed by some of its dimensions, as columns broadcast into it |
//! | [`copy`] | `COPY ... STORED AS ZARR` of a table's selection, block by block |
//! | [`fft`] | FFTs along dimensions (`fft(...)`, `ifft(...)`), xrft's semantics |
//! | [`reduce`] | dense reductions over dimensions (`GROUP BY` dimensions) |
//! | [`rechunk`] | copying a store into new chunk shapes within the budget |
//! | [`rolling`] | rolling windows along a dimension (`avg(x) OVER (... ROWS BETWEEN ...)`) |
//! | [`zip`] | joins of two Zarr tables on all their dimensions, as one scan of aligned blocks |
//! | [`planner`] | the query planner that knows the array nodes |

pub mod broadcast;
pub mod copy;
pub mod fft;
pub mod planner;
pub mod rechunk;
pub mod reduce;
pub mod rolling;
pub(crate) mod scan_path;
pub(crate) mod tasks;
pub mod zip;

pub use broadcast::BroadcastJoinRule;
pub use planner::{ArrayExtensionPlanner, ArrayQueryPlanner};
pub use reduce::{
    key_schema, DenseReduction, DenseReductionExec, DenseReductionRule, GroupKey, KeySpec,
    ReduceOp, ReduceSpec, ReductionParts,
};
pub use rolling::{RollingWindow, RollingWindowExec, RollingWindowRule};
pub use zip::AlignedJoinRule;

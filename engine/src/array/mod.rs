//! Array operations as DataFusion plan nodes: logical nodes carrying the
//! array semantics, their operators, the optimizer rules that find them in
//! plain SQL, and the planner that turns one into the other.
//!
//! | module | owns |
//! |---|---|
//! | [`blockwise`] | the blockwise primitive: a kernel making a grid's chunks one by one, on the task runner or a cluster's tasks (one node for every operator built on it) |
//! | [`broadcast`] | joins of a Zarr table with a small result keyed by some of its dimensions, as columns broadcast into it |
//! | [`copy`] | `COPY ... STORED AS ZARR` of a table's selection, block by block |
//! | `elementwise` | `float64` arithmetic arguments evaluated in cache-sized pieces (a dense reduction's folds, a rolling window's lines) |
//! | [`fft`] | FFTs along dimensions (`fft(...)`, `ifft(...)`), xrft's semantics |
//! | [`partition_totals`] | window aggregates over whole partitions (`avg(x) OVER (PARTITION BY lat, lon)`), as a broadcast of their reduction |
//! | [`reduce`] | dense reductions over dimensions (`GROUP BY` dimensions) |
//! | [`rechunk`] | copying a store into new chunk shapes within the budget |
//! | [`rolling`] | rolling windows along a dimension (`avg(x) OVER (... ROWS BETWEEN ...)`) |
//! | [`zip`] | joins of two Zarr tables on all their dimensions, as one scan of aligned blocks |
//! | [`planner`] | the query planner that knows the array nodes |
//!
//! # Primitives
//!
//! Every operator is made of four primitives, as Cubed lowers array work,
//! each implemented once:
//!
//! - **read**: the columns, cells and chunk-aligned blocks of a table an
//!   operator reads ([`crate::table::BlockRead`], planned from a logical
//!   [`TableRead`]; blocks by [`crate::table::BlockGrid`],
//!   boxes decoded by [`crate::table::BoxCells`], read ahead from object
//!   stores by [`crate::table::ReadAheadPlan`]); one codec entry sends it
//!   to a cluster's workers;
//! - **blockwise**: a kernel applied block by block, by the one task
//!   runner (`tasks`: workers taking the next block, the first error or a
//!   cancellation stopping them, a panic an error naming the task; the
//!   rechunk's stages, the COPYs' writes and the dense reduction's folds)
//!   or in DataFusion's partitions, each a contiguous run of blocks (the
//!   scan, the rolling window, the FFT's reads); its projected memory held
//!   in the session's pool ([`crate::memory::reserve`]), what it writes
//!   written through one box writer into a scratch store or the target
//!   ([`crate::write::scratch`], [`crate::write::target`]);
//! - **rechunk**: stored arrays copied into other chunks within the budget,
//!   in one pass or through intermediate arrays ([`rechunk`]);
//! - **reduce**: blocks folded into dense per-group state, merged in a tree
//!   (here) or by DataFusion's final aggregate (on a cluster).
//!
//! | operator | primitives |
//! |---|---|
//! | the scan ([`crate::table::ZarrScanExec`]), an aligned join ([`zip`]), a broadcast join ([`broadcast`]) | read (of a zipped table; with broadcast columns) |
//! | a dense reduction ([`reduce`]) | read + blockwise (fused elementwise arguments) + reduce |
//! | a rolling window ([`rolling`]) | read (blocks along the rolled dimension, with a halo; with broadcast columns) + blockwise (fused elementwise arguments, the frames) |
//! | a dense reduction or rolling window over `rechunk(...)` | rechunk, then the operator's primitives over the rechunked store |
//! | rechunk, COPY of a whole table ([`copy::whole`]) | rechunk |
//! | COPY of a selection ([`copy::selection`]) | read + blockwise into a scratch store + rechunk into the target |
//! | COPY of rolling windows ([`copy::rolling`]) | the rolling window's read + blockwise into a scratch store + rechunk |
//! | an FFT by whole lines ([`fft`]) | rechunk (when lines span chunks) + blockwise (the kernel) |
//! | the four-step FFT ([`fft::four_step`]) | two blockwise passes into scratch arrays laid out as the transpose, then a read of the spectrum |
//! | an FFT staged by dimension ([`fft::staged`]) | one FFT stored in a scratch store, read by the next |
//!
//! A new operator writes its kernel and its plan: the logical node starts
//! from a `TableRead`, the operator holds a `BlockRead` and runs its kernel
//! on the task runner; it reports its projected memory and is refused by
//! the one check before it runs (a [`crate::memory::Projection`]: its
//! units of work, what each holds and what is held once, added up for
//! `EXPLAIN` and the pool, and checked against `allowed_mem` with every
//! part named: the scan's, the dense reduction's, the rolling window's,
//! the FFT's and its four-step passes', and the COPYs' steps' and
//! writers').

pub mod blockwise;
pub mod broadcast;
pub mod copy;
pub(crate) mod elementwise;
pub mod fft;
pub mod partition_totals;
pub mod planner;
pub mod rechunk;
pub mod reduce;
pub mod rolling;
pub(crate) mod scan_path;
pub(crate) mod tasks;
pub mod zip;

pub use broadcast::BroadcastJoinRule;
pub use partition_totals::PartitionTotalsRule;
pub use planner::{ArrayExtensionPlanner, ArrayQueryPlanner};
pub use reduce::{
    key_schema, Bands, DenseMergeExec, DenseReduction, DenseReductionExec, DenseReductionRule,
    GroupKey, KeySpec, Merged, ReduceOp, ReduceSpec, ReductionParts, GROUP_POSITION,
};
pub use rolling::{RollingWindow, RollingWindowExec, RollingWindowRule};
pub use scan_path::TableRead;
pub use zip::AlignedJoinRule;

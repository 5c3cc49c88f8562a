//! Rolling windows along a dimension: SQL's
//! `avg(t2m) OVER (PARTITION BY lat, lon ORDER BY time ROWS BETWEEN 23
//! PRECEDING AND CURRENT ROW)` over a Zarr table, computed along the
//! dimension over blocks that overlap by the frame, in grid order, instead
//! of sorting every row into partitions (xarray's
//! `ds.t2m.rolling(time=24).mean()`, with SQL's NULL semantics).
//!
//! Primitives (see [`crate::array`]): read (blocks visited along the
//! rolled dimension, with the frames' halo) + blockwise (the frames; a
//! frame from the series' start carries running totals from one block to
//! the next instead of a halo; a frame to the series' end is walked from
//! it, the blocks in reverse order).
//!
//! | module | owns |
//! |---|---|
//! | [`rule`] | finding rolling windows in plain SQL |
//! | [`node`] | the logical node, [`RollingWindow`] |
//! | [`exec`] | its operator, [`RollingWindowExec`] |
//! | [`frame`] | the aggregates over the frames of lines of cells |
//! | [`running`] | the aggregates over frames from the series' start |

pub mod exec;
pub mod frame;
pub mod node;
pub mod rule;
pub mod running;

pub use exec::RollingWindowExec;
pub use frame::{Frame, RollOp};
pub use node::{GridFrame, RollExpr, RollingWindow};
pub use rule::{RollingWindowRule, MAX_FRAME};

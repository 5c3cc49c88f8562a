//! `COPY ... STORED AS ZARR` as array operations: what the optimizer rule
//! [`CopyToArraysRule`] turns a COPY into when its query is a Zarr table's
//! selection, so that it runs block by block inside the memory budget
//! rather than through DataFusion's sink (which holds the result).
//!
//! | module | owns |
//! |---|---|
//! | [`whole`] | a whole table (or an FFT) copied array by array: the rechunk primitive into the target's chunks |
//! | [`steps`] | the two steps of a chunk-by-chunk COPY: the blockwise primitive ([`crate::array::blockwise`]) into a scratch store (or the target's chunks), then the rechunk primitive |
//! | [`cluster`] | those steps on a cluster's workers: a round of blockwise tasks, then the rechunk's rounds |
//! | [`selection`] | a selection with computed variables, written through those steps |
//! | [`rolling`] | rolling windows: the same two steps, step 1 the rolling operator's runs of chunks (a [`crate::array::blockwise::StepWriters`]) |
//! | [`rule`] | the optimizer rule choosing among them (and the FFT's copy) |
//!
//! Each module uses only those above it in this table. All write through the writer below the operators ([`crate::write`]):
//! its options, its claimed or atomic targets, its write jobs.

pub mod cluster;
pub mod rolling;
pub mod rule;
pub mod selection;
pub mod steps;
pub mod whole;

pub use rule::CopyToArraysRule;
pub use whole::ArrayCopy;

//! # zarrfusion
//!
//! Zarr arrays as SQL tables on Apache DataFusion.
//!
//! A Zarr group (v2 or v3, local or in an object store) is registered as a
//! table: every dimension is a column, every variable sharing those
//! dimensions is a column, every chunk-aligned block is a partition.
//! Projection, filters on dimensions and `LIMIT` are pushed down so only the
//! chunks a query needs are read. Values are decoded the way
//! `xarray.open_zarr` decodes them (CF scale/offset, fill values, CF time).
//!
//! | module | owns |
//! |---|---|
//! | [`zarr`] | opening stores, discovering arrays, decoding values |
//! | [`table`] | the table mapping, the scan, pushdown, registration |
//! | [`array`](mod@array) | array operations as plan nodes (dense reductions, rechunk) |
//! | [`device`] | kernels (FFT) on the CPU, and on GPUs behind the `gpu` feature |
//! | [`explain`] | drawing plans (Graphviz DOT, SVG) |
//! | [`memory`] | sizes and the memory budget |
//! | [`distributed`] | the same plans on a cluster of workers (datafusion-distributed) |
//! | [`session`] | building a `SessionContext` with all of the above |
//! | [`windows`] | training windows cut from Zarr just in time (the ML loader) |
//! | [`window_frames`] | guarding SQL window frames and limits DataFusion overflows on |
//!
//! ```no_run
//! # async fn example() -> datafusion::error::Result<()> {
//! let ctx = zarrfusion::new_context();
//! ctx.sql("CREATE EXTERNAL TABLE era5 STORED AS ZARR LOCATION 'demo/era5.zarr'").await?;
//! ctx.sql("SELECT lat, avg(t2m) FROM era5 GROUP BY lat ORDER BY lat").await?.show().await?;
//! # Ok(())
//! # }
//! ```

// Input must never panic: no unwrap, expect or panic outside tests;
// an invariant proven where it is used is written without them.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

pub mod array;
pub mod config;
pub mod device;
pub mod distributed;
pub mod error;
pub mod explain;
pub mod memory;
pub(crate) mod plan_methods;
pub mod progress;
pub mod session;
pub mod table;
pub mod window_frames;
pub mod windows;
pub mod write;
pub mod zarr;

pub use config::ZarrConfig;
pub use error::{Result, ZarrFusionError};
pub use progress::ScanProgress;
pub use session::{
    distributed_context, new_context, new_context_with, session_config, ZarrContextExt,
};
pub use table::{ZarrDataset, ZarrTable, ZarrTableOptions};

//! Writing query results to Zarr: `COPY (query) TO 'out.zarr' STORED AS ZARR`.
//!
//! ```sql
//! COPY (SELECT time, lat, lon, t2m - 273.15 AS t2m_c FROM era5)
//! TO 'era5_celsius.zarr' STORED AS ZARR
//! OPTIONS ('chunks' 'time=24,lat=721,lon=1440', 'codec' 'zstd', 'zarr_format' '3');
//! ```
//!
//! Dimension columns become dimensions with coordinate arrays (timestamps
//! as CF times), the other columns become variables, NULL becomes the fill
//! value (NaN). The store is written beside the target and renamed into
//! place when complete: a failed or cancelled write leaves nothing. A
//! query that reads a Zarr table's selection (`COPY era5 TO ...`) is
//! copied block by block instead, by the array operations of
//! [`crate::array::copy`], which write through this module: it is the
//! writer, below every operator that writes Zarr.
//!
//! | module | owns |
//! |---|---|
//! | [`options`] | `chunks`, `codec`, `zarr_format`, `dims`, an object-store target's settings |
//! | [`grid`] | laying rows out on a grid (coordinates, cells, not-a-grid errors) |
//! | [`store`] | Zarr v2/v3 metadata and chunks, atomic rename |
//! | [`stamp`] | the owner stamp on temporary targets and scratch stores, and the sweep of a killed process's |
//! | [`scratch`] | scratch stores in `work_dir` (local or object store) that the array operators write their intermediate arrays to, erased when dropped |
//! | [`unflushed`] | the local scratch store's files, written without the filesystem store's flush to disk |
//! | [`target`] | where an array COPY writes (location, options, output) and its atomic write of a new store's group |
//! | [`sink`] | the DataFusion sink: memory budget, cancellation |
//! | [`rows`] | rows one per cell of a grid known in advance (a dense reduction's), written by the sink as they come |
//! | [`format`](mod@format) | Zarr registered as a file format for `COPY` |

pub mod format;
pub mod grid;
pub mod options;
pub mod rows;
pub mod scratch;
pub mod sink;
pub mod stamp;
pub mod store;
pub mod target;
pub mod unflushed;
pub(crate) mod write_job;

pub use format::ZarrFormatFactory;
pub use options::ZarrWriteOptions;
pub use sink::ZarrSink;

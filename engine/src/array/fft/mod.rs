//! FFT along any dimensions of a Zarr variable, with xrft's semantics.
//!
//! Primitives (see [`crate::array`]): by whole lines, rechunk (a source
//! whose lines span chunks is copied into whole-line chunks first) +
//! blockwise (the kernel); the four-step path, two blockwise passes into
//! scratch arrays laid out as the transpose; a staged transform, one
//! dimension's output stored in a scratch store and read by the next.
//!
//! | module | owns |
//! |---|---|
//! | [`window`] | window functions as scipy computes them |
//! | [`options`] | the options (`dims`, `real_dim`, `shift`, `detrend`, `window`, `true_phase`, `true_amplitude`, `lag`) |
//! | [`axis`] | one transformed dimension: output coordinates and the kernel pass |
//! | [`detrend`] | trends removed before a forward transform |
//! | [`transform`] | a whole transform of a block |
//! | [`kernels`] | the query's kernels, the clock of their transform phase (`transform_time`), the precisions |
//! | [`source`] | what a transform reads: a Zarr variable, a rechunked copy of one, a detrended source (its trend fitted in a pass first), another transform's output |
//! | [`four_step`] | the four-step (Bailey) path for lines larger than memory |
//! | [`table`] | the `fft(...)`/`ifft(...)` table functions, `DataFrame.fft` |
//! | [`passes`] | the four-step path's passes as a cluster's blockwise stages (`PassBlocks`, their kernel) |
//! | [`trend_pass`] | a detrend's fit as a cluster's stage before the first pass (`DetrendFitExec`, `FittedExec`) |
//! | [`exec`] | `FftExec`, the operator |
//! | [`copy`] | `COPY` of a transform to Zarr, block by block (`FftCopyExec`), on a cluster in runs of blocks on the workers (the blockwise primitive's `BlockwiseTasksExec`, its kernel the transform's blocks) |
//! | [`staged`] | transforms along several dimensions, one dimension at a time, when blocks of whole lines do not fit |
//! | [`fit`] | the path a transform takes within the memory budget, and the operator its scan plans |
//!
//! Each module uses only those above it in this table (a source reads
//! another transform's output and a stored first stage through the
//! traits [`source::TransformOutput`] and [`source::StoredStage`]).
//!
//! `fft('era5', 't2m', dims => 'lat')` gives what
//! `xrft.fft(ds.t2m, dim='lat')` gives (xrft 1.0's defaults: `true_phase`,
//! `true_amplitude`, `shift`), as rows; `ifft` what `xrft.ifft` gives.

pub mod axis;
pub mod copy;
pub mod detrend;
pub mod exec;
pub mod fit;
pub mod four_step;
pub mod kernels;
pub mod options;
pub mod passes;
pub mod source;
pub mod staged;
pub mod table;
pub mod transform;
pub mod trend_pass;
pub mod window;

pub use copy::{FftCopy, FftCopyExec};
pub use exec::FftExec;
pub use options::{Detrend, FftOptions};
pub use source::ArraySource;
pub use table::{fft_plan, fft_scan, FftPlanner, FftTable};
pub use transform::FftTransform;
pub use trend_pass::{DetrendFitExec, FittedExec};
pub use window::Window;

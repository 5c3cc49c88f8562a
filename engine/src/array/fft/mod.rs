//! FFT along any dimensions of a Zarr variable, with xrft's semantics.
//!
//! | module | owns |
//! |---|---|
//! | [`options`] | the options (`dims`, `real_dim`, `shift`, `detrend`, `window`, `true_phase`, `true_amplitude`, `lag`) |
//! | [`axis`] | one transformed dimension: output coordinates and the kernel pass |
//! | [`window`] | window functions as scipy computes them |
//! | [`detrend`] | trends removed before a forward transform |
//! | [`transform`] | a whole transform of a block |
//! | [`table`] | the `fft(...)`/`ifft(...)` table functions and their operator |
//!
//! `fft('era5', 't2m', dims => 'lat')` gives what
//! `xrft.fft(ds.t2m, dim='lat')` gives (xrft 1.0's defaults: `true_phase`,
//! `true_amplitude`, `shift`), as rows; `ifft` what `xrft.ifft` gives.

pub mod axis;
pub mod detrend;
pub mod options;
pub mod table;
pub mod transform;
pub mod window;

pub use options::{Detrend, FftOptions};
pub use table::{fft_scan, FftExec, FftPlanner, FftTable};
pub use transform::FftTransform;
pub use window::Window;

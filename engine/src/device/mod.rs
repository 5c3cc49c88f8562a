//! Kernels: the numeric work of the array operators, on the CPU (and, behind
//! the `gpu` feature, on NVIDIA GPUs).
//!
//! | module | owns |
//! |---|---|
//! | [`fft_cpu`] | FFTs along axes of C-ordered blocks with `rustfft`/`realfft`, lines in parallel |
//!
//! A kernel sees blocks (flat C-ordered buffers and their shape), never
//! Zarr stores or Arrow batches: the operators in `engine::array` read the
//! blocks and turn results into rows.

pub mod fft_cpu;

pub use fft_cpu::{AxisPass, CpuFft, LineKind};

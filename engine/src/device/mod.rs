//! Kernels: the numeric work of the array operators, on the CPU (and, behind
//! the `gpu` feature, on NVIDIA GPUs).
//!
//! | module | owns |
//! |---|---|
//! | [`fft_cpu`] | FFTs along axes of C-ordered blocks with `rustfft`/`realfft`, lines in parallel |
//! | `fft_cuda` (feature `gpu`) | the same passes with cuFFT: batched plans, page-locked staging, two streams |
//! | this module | the [`FftKernel`] trait, choosing the device (`zarrfusion.device`) and probing for a GPU |
//!
//! A kernel sees blocks (flat C-ordered buffers and their shape), never
//! Zarr stores or Arrow batches: the operators in `engine::array` read the
//! blocks and turn results into rows.

pub mod fft_cpu;
#[cfg(feature = "gpu")]
pub mod fft_cuda;

use std::fmt;
use std::sync::OnceLock;

use rustfft::FftNum;

pub use fft_cpu::{AxisPass, BlockValues, CpuFft, LineKind};

/// A kernel that runs the passes of a transform over a block, on some
/// device: [`CpuFft`], or `fft_cuda::CudaLanes` with the `gpu` feature.
pub trait FftKernel<T>: Send + Sync {
    /// Runs `passes`, in order, over `values` of shape `shape`; returns the
    /// result and its shape. Errors name a pass that does not fit the block,
    /// or what failed on the device.
    fn transform(
        &self,
        values: BlockValues<T>,
        shape: &[usize],
        passes: &[AxisPass<T>],
    ) -> Result<(BlockValues<T>, Vec<usize>), String>;
}

impl<T: FftNum + Default> FftKernel<T> for CpuFft<T> {
    fn transform(
        &self,
        values: BlockValues<T>,
        shape: &[usize],
        passes: &[AxisPass<T>],
    ) -> Result<(BlockValues<T>, Vec<usize>), String> {
        CpuFft::transform(self, values, shape, passes)
    }
}

/// Page-locked host memory the GPU kernel stages a query's blocks through
/// on `device` under `memory_limit` (none on the CPU; see
/// `fft_cuda::staging_bytes`).
pub fn staging_memory(device: Device, memory_limit: Option<usize>) -> usize {
    match device {
        Device::Cpu => 0,
        #[cfg(feature = "gpu")]
        Device::Cuda => fft_cuda::staging_bytes(memory_limit),
        #[cfg(not(feature = "gpu"))]
        Device::Cuda => {
            let _ = memory_limit;
            0
        }
    }
}

/// Where a kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The CPU, on all cores.
    Cpu,
    /// An NVIDIA GPU, through CUDA.
    Cuda,
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
        })
    }
}

/// Whether a GPU is usable, probed once per process: `Ok` with what was
/// found, or `Err` with why not. A build without the `gpu` feature has no
/// GPU support; the probe never panics (a missing library is an `Err`).
pub fn gpu_probe() -> &'static Result<String, String> {
    static PROBE: OnceLock<Result<String, String>> = OnceLock::new();
    PROBE.get_or_init(probe)
}

/// Looks for a usable GPU: the CUDA driver and cuFFT libraries present, a
/// device the driver sees and a context on it. cudarc's loaders panic
/// when a library is missing, so the libraries are looked for first and
/// the whole probe runs under `catch_unwind`.
#[cfg(feature = "gpu")]
fn probe() -> Result<String, String> {
    use cudarc::driver::CudaContext;
    let found = std::panic::catch_unwind(|| {
        // SAFETY: these only try to open the libraries by name.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err("the CUDA driver library (libcuda) was not found".to_string());
        }
        // SAFETY: as above.
        if !unsafe { cudarc::cufft::sys::is_culib_present() } {
            return Err("the cuFFT library (libcufft) was not found".to_string());
        }
        let count =
            CudaContext::device_count().map_err(|e| format!("the CUDA driver failed: {e}"))?;
        if count < 1 {
            return Err("the CUDA driver sees no device".to_string());
        }
        let context = CudaContext::new(0).map_err(|e| format!("no context on device 0: {e}"))?;
        let name = context.name().unwrap_or_else(|_| "unnamed".to_string());
        Ok(format!("{count} CUDA device(s); device 0 is {name}"))
    });
    found.unwrap_or_else(|_| Err("probing CUDA panicked".to_string()))
}

/// Whether the GPU kernel can run: the probe found a GPU and the kernel
/// was made on it.
#[cfg(feature = "gpu")]
fn usable_gpu() -> Result<(), String> {
    fft_cuda::CudaKernel::shared().map(|_| ())
}

/// Without the `gpu` feature no GPU is usable.
#[cfg(not(feature = "gpu"))]
fn usable_gpu() -> Result<(), String> {
    gpu_probe().clone().map(|_| ())
}

/// Without the `gpu` feature there is nothing to probe.
#[cfg(not(feature = "gpu"))]
fn probe() -> Result<String, String> {
    Err("this build of zarrfusion has no GPU support (the `gpu` feature)".to_string())
}

/// The device the setting `zarrfusion.device` chooses: `cpu`; `cuda`,
/// refused with the reason when no GPU is usable; `auto`, a GPU when one is
/// usable, else the CPU (with a log line, once). Without the `gpu` feature
/// no GPU is ever usable.
pub fn choose_device(setting: &str) -> Result<Device, String> {
    match setting.trim().to_ascii_lowercase().as_str() {
        "cpu" => Ok(Device::Cpu),
        "cuda" | "gpu" => usable_gpu()
            .map(|()| Device::Cuda)
            .map_err(|why| format!("zarrfusion.device = 'cuda' but no GPU is usable: {why}")),
        "auto" | "" => {
            static LOGGED: OnceLock<()> = OnceLock::new();
            match usable_gpu() {
                Ok(()) => Ok(Device::Cuda),
                Err(why) => {
                    LOGGED.get_or_init(|| log::info!("no usable GPU ({why}); FFTs run on the CPU"));
                    Ok(Device::Cpu)
                }
            }
        }
        other => Err(format!(
            "zarrfusion.device must be 'auto', 'cpu' or 'cuda', got '{other}'"
        )),
    }
}

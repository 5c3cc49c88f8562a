//! The kernels a transform runs on, the clock of its transform phase, and
//! the precisions it computes in ([`Precision`]).
//!
//! [`Kernels`] holds the query's kernels of both precisions (the CPU's, or
//! with the `gpu` feature the process's CUDA kernel) and a
//! [`TransformClock`]: every block a task hands to a kernel goes through
//! [`Kernels::timed`], so the operator's `transform_time` metric (`EXPLAIN
//! ANALYZE`) is the wall time during which at least one block was being
//! transformed, apart from the reads, decodes and writes around it.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use datafusion::arrow::datatypes::{ArrowPrimitiveType, Float32Type, Float64Type};
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricBuilder, Time};
use rustfft::num_complex::Complex;
use rustfft::num_traits::Float;
use rustfft::FftNum;
use zarrs::array::{Array, ArrayError, ArraySubset};
use zarrs::storage::ReadableWritableListableStorageTraits;

use crate::device::{AxisPass, BlockValues, CpuFft, Device, FftKernel};

/// The kernels of both precisions on the query's device, shared by its
/// tasks, and the clock of their transform phase.
#[derive(Debug, Default)]
pub struct Kernels {
    pub(super) single: CpuFft<f32>,
    pub(super) double: CpuFft<f64>,
    #[cfg(feature = "gpu")]
    pub(super) cuda: Option<crate::device::fft_cuda::CudaLanes>,
    clock: TransformClock,
}

impl Kernels {
    /// The kernels of `device` (chosen by `choose_device`, so a GPU is
    /// usable when it is `Cuda`), staging through at most `staging`
    /// page-locked bytes on a GPU (`staging_memory`), timed by `clock`.
    pub fn on(device: Device, staging: usize, clock: TransformClock) -> Self {
        let cpu = Self {
            clock,
            ..Self::default()
        };
        match device {
            Device::Cpu => cpu,
            #[cfg(feature = "gpu")]
            Device::Cuda => Self {
                cuda: crate::device::fft_cuda::CudaKernel::shared()
                    .ok()
                    .map(|kernel| crate::device::fft_cuda::CudaLanes::new(kernel, staging)),
                ..cpu
            },
            #[cfg(not(feature = "gpu"))]
            Device::Cuda => {
                let _ = staging;
                cpu
            }
        }
    }

    /// Whether the kernels run on a GPU.
    pub fn on_gpu(&self) -> bool {
        #[cfg(feature = "gpu")]
        return self.cuda.is_some();
        #[cfg(not(feature = "gpu"))]
        false
    }

    /// Counts work done outside the kernels (the four-step path's in-place
    /// CPU passes) in the transform phase until the guard is dropped.
    pub(super) fn running(&self) -> impl Drop + '_ {
        self.clock.start()
    }

    /// The kernel of precision `P`, its calls timed by this clock.
    pub fn timed<P: Precision>(&self) -> TimedKernel<'_, P> {
        TimedKernel {
            kernel: P::kernel(self),
            clock: &self.clock,
        }
    }
}

/// The CUDA kernel of `kernels`, as the kernel of precision `T`, when
/// there is one.
#[cfg(feature = "gpu")]
fn cuda_kernel<T: crate::device::fft_cuda::CudaPrecision>(
    kernels: &Kernels,
) -> Option<&dyn FftKernel<T>> {
    kernels.cuda.as_ref().map(|k| k as &dyn FftKernel<T>)
}

/// The CUDA kernel of `kernels` (none without the `gpu` feature).
#[cfg(not(feature = "gpu"))]
fn cuda_kernel<T>(_: &Kernels) -> Option<&dyn FftKernel<T>> {
    None
}

/// A kernel whose calls add to a [`TransformClock`].
pub struct TimedKernel<'a, P> {
    kernel: &'a dyn FftKernel<P>,
    clock: &'a TransformClock,
}

impl<P> FftKernel<P> for TimedKernel<'_, P> {
    fn transform(
        &self,
        values: BlockValues<P>,
        shape: &[usize],
        passes: &[AxisPass<P>],
    ) -> Result<(BlockValues<P>, Vec<usize>), String> {
        let _running = self.clock.start();
        self.kernel.transform(values, shape, passes)
    }
}

/// Wall time during which at least one block is in a kernel, however many
/// tasks transform at once, added to a [`Time`] metric as each busy
/// stretch ends.
#[derive(Debug, Clone, Default)]
pub struct TransformClock {
    /// Blocks in a kernel now, and since when one has been.
    running: Arc<Mutex<(usize, Option<Instant>)>>,
    time: Time,
}

impl TransformClock {
    /// A clock adding to the metric `transform_time` of `metrics`.
    pub fn in_metrics(metrics: &ExecutionPlanMetricsSet) -> Self {
        Self {
            running: Arc::default(),
            time: MetricBuilder::new(metrics).subset_time("transform_time", 0),
        }
    }

    /// Counts a block in a kernel until the guard is dropped.
    fn start(&self) -> Running<'_> {
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        if running.0 == 0 {
            running.1 = Some(Instant::now());
        }
        running.0 += 1;
        Running(self)
    }
}

/// A block in a kernel (see [`TransformClock::start`]).
struct Running<'a>(&'a TransformClock);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let mut running = self.0.running.lock().unwrap_or_else(|e| e.into_inner());
        running.0 -= 1;
        if running.0 == 0 {
            if let Some(since) = running.1.take() {
                self.0.time.add_duration(since.elapsed());
            }
        }
    }
}

/// An intermediate array in `work_dir`.
pub type ScratchArray = Array<dyn ReadableWritableListableStorageTraits>;

/// A precision transforms compute in: `f32` (complex64) or `f64`
/// (complex128).
pub trait Precision: FftNum + Float + Default + bytemuck::Pod {
    /// The Arrow type of a part.
    type Arrow: ArrowPrimitiveType<Native = Self>;
    /// This precision's kernel.
    fn kernel(kernels: &Kernels) -> &dyn FftKernel<Self>;
    /// Complex values of this precision read from `subset` of `array`.
    fn retrieve_complex(
        array: &ScratchArray,
        subset: &ArraySubset,
    ) -> Result<Vec<Complex<Self>>, ArrayError>;
    /// Complex values of this precision written to `subset` of `array`.
    fn store_complex(
        array: &ScratchArray,
        subset: &ArraySubset,
        values: &[Complex<Self>],
    ) -> Result<(), ArrayError>;
}

/// [`Precision`]'s reads and writes of complex values, alike for both.
macro_rules! complex_io {
    () => {
        fn retrieve_complex(
            array: &ScratchArray,
            subset: &ArraySubset,
        ) -> Result<Vec<Complex<Self>>, ArrayError> {
            array.retrieve_array_subset(subset)
        }
        fn store_complex(
            array: &ScratchArray,
            subset: &ArraySubset,
            values: &[Complex<Self>],
        ) -> Result<(), ArrayError> {
            array.store_array_subset(subset, values)
        }
    };
}

impl Precision for f32 {
    type Arrow = Float32Type;
    fn kernel(kernels: &Kernels) -> &dyn FftKernel<f32> {
        cuda_kernel(kernels).unwrap_or(&kernels.single)
    }
    complex_io!();
}

impl Precision for f64 {
    type Arrow = Float64Type;
    fn kernel(kernels: &Kernels) -> &dyn FftKernel<f64> {
        cuda_kernel(kernels).unwrap_or(&kernels.double)
    }
    complex_io!();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn overlapping_blocks_count_once_and_gaps_not_at_all() {
        let clock = TransformClock::default();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    let _running = clock.start();
                    std::thread::sleep(Duration::from_millis(40));
                });
            }
        });
        let busy = Duration::from_nanos(clock.time.value() as u64);
        std::thread::sleep(Duration::from_millis(60));
        {
            let _running = clock.start();
            std::thread::sleep(Duration::from_millis(20));
        }
        let total = Duration::from_nanos(clock.time.value() as u64);
        // Four overlapping 40 ms blocks: at least 40 ms, far from 160.
        assert!(
            busy >= Duration::from_millis(40) && busy < Duration::from_millis(120),
            "{busy:?}"
        );
        // The 60 ms gap is not counted, the 20 ms block is.
        let added = total - busy;
        assert!(
            added >= Duration::from_millis(20) && added < Duration::from_millis(55),
            "{added:?}"
        );
    }
}

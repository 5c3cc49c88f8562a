//! FFTs along the axes of a C-ordered block on an NVIDIA GPU, with cuFFT
//! through `cudarc` (feature `gpu`; the CUDA libraries are loaded at run
//! time, so the build needs no CUDA toolkit).
//!
//! A pass means what it means on the CPU ([`super::fft_cpu`]): gather each
//! line along the axis (in the pass's order, with its input factors),
//! transform, scatter (in the output order, with the output factors). Here
//! the gather and scatter run on all CPU cores, and the transforms on the
//! GPU:
//!
//! - the block's lines go to the device in batches, each gathered on all
//!   cores straight into a page-locked host buffer (with its input factors,
//!   real values made complex on the way) and transformed by one batched
//!   cuFFT plan (`cufftPlanMany`; plans are kept per length, kind, batch
//!   and stream); its results are scattered straight out of the page-locked
//!   output buffer into the new block, so a pass copies each value once on
//!   the way up and once on the way back;
//! - batches alternate between two streams, so one batch's gathering,
//!   copies and transform overlap the other's;
//! - memory is budgeted on both sides: a stream's input and output buffers
//!   hold at most [`LANE_BYTES`], half of what a query's plan set aside
//!   for staging ([`staging_bytes`]: an eighth of `allowed_mem`, at most
//!   [`STAGING_BYTES`], counted in the operators' projected memory) and an
//!   eighth of the device memory free when the kernel was made (the rest
//!   left to cuFFT's work areas and other users). The buffers are sized to
//!   a block's batches, so a small block stages little; a line that does
//!   not fit is an error, never an allocation failure.
//!
//! One block uses the GPU at a time (the staging buffers are shared); the
//! operators' tasks gather and scatter on the CPU meanwhile.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cufft::sys::{cufftType, double2, float2};
use cudarc::cufft::{CudaFft as CufftPlan, FftDirection};
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DeviceRepr, PinnedHostSlice, ValidAsZeroBits,
};
use rayon::prelude::*;
use rustfft::num_complex::Complex;
use rustfft::num_traits::Float;
use rustfft::FftNum;

use super::fft_cpu::{
    complex_post, complex_pre, run_passes, wrong_values, AxisPass, BlockValues, LineKind,
};
use super::FftKernel;

/// Bytes of input and output buffers one stream holds at most.
pub const LANE_BYTES: usize = 32 << 20;

/// Page-locked host bytes the staging of one precision holds at most (two
/// streams).
pub const STAGING_BYTES: usize = 2 * LANE_BYTES;

/// Page-locked host bytes a query under `memory_limit` (`allowed_mem`)
/// stages through: an eighth of it, at most [`STAGING_BYTES`].
pub fn staging_bytes(memory_limit: Option<usize>) -> usize {
    memory_limit.map_or(STAGING_BYTES, |limit| (limit / 8).min(STAGING_BYTES))
}

/// A precision cuFFT computes in: `f32` (C2C, R2C, C2R) or `f64` (Z2Z,
/// D2Z, Z2D).
pub trait CudaPrecision: FftNum + Float + Default + DeviceRepr + ValidAsZeroBits {
    /// cuFFT's complex value of this precision.
    type Pair: DeviceRepr + ValidAsZeroBits + Copy + Send + Sync;
    /// The plan type of complex, real-input and real-output transforms.
    const PLAN_TYPES: [cufftType; 3];
    /// A complex value as cuFFT holds it.
    fn pair(value: Complex<Self>) -> Self::Pair;
    /// A cuFFT complex value.
    fn unpair(value: Self::Pair) -> Complex<Self>;
    /// Runs `plan` (of kind `kind`) from `input` to `output`.
    fn exec(
        plan: &CufftPlan,
        kind: LineKind,
        input: &mut DeviceLines<Self>,
        output: &mut DeviceLines<Self>,
    ) -> Result<(), String>;
    /// The kernel's staging state of this precision.
    fn staging(kernel: &CudaKernel) -> &Mutex<Staging<Self>>;
}

/// Lines on the device: real or complex values.
pub enum DeviceLines<T: CudaPrecision> {
    /// Real values.
    Real(CudaSlice<T>),
    /// Complex values.
    Complex(CudaSlice<T::Pair>),
}

/// Writes lines of a block into a batch's page-locked input buffer.
type Fill<'a, T> = dyn Fn(&mut HostLines<T>, Range<usize>) -> Result<(), String> + 'a;

/// Takes the results of lines out of a batch's page-locked output buffer.
type Take<'a, T> = dyn FnMut(&HostLines<T>, Range<usize>) -> Result<(), String> + 'a;

/// Lines in page-locked host memory.
enum HostLines<T: CudaPrecision> {
    Real(PinnedHostSlice<T>),
    Complex(PinnedHostSlice<T::Pair>),
}

/// One stream's buffers and plans.
struct Lane<T: CudaPrecision> {
    stream: Arc<CudaStream>,
    host_in: Option<HostLines<T>>,
    host_out: Option<HostLines<T>>,
    device_in: Option<DeviceLines<T>>,
    device_out: Option<DeviceLines<T>>,
    /// Plans by (type, length, batch).
    plans: HashMap<(cufftType, usize, usize), CufftPlan>,
    /// The lines whose results are on their way back.
    pending: Option<Range<usize>>,
}

/// The staging state of one precision: two lanes (streams).
pub struct Staging<T: CudaPrecision> {
    lanes: Vec<Lane<T>>,
}

/// The GPU FFT kernel of the process (see the module docs).
pub struct CudaKernel {
    context: Arc<CudaContext>,
    /// Bytes of input and output buffers one stream may hold.
    lane_budget: usize,
    single: Mutex<Staging<f32>>,
    double: Mutex<Staging<f64>>,
}

impl std::fmt::Debug for CudaKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaKernel")
            .field("lane_budget", &self.lane_budget)
            .finish_non_exhaustive()
    }
}

/// A failure of the CUDA driver or cuFFT, as text.
fn cuda<E: std::fmt::Debug>(what: &'static str) -> impl Fn(E) -> String {
    move |e| format!("CUDA: {what} failed: {e:?}")
}

impl CudaKernel {
    /// The kernel of the process on device 0, made on first use; `Err`
    /// says why no GPU is usable (see [`super::gpu_probe`]).
    pub fn shared() -> Result<Arc<CudaKernel>, String> {
        static KERNEL: OnceLock<Result<Arc<CudaKernel>, String>> = OnceLock::new();
        KERNEL
            .get_or_init(|| {
                super::gpu_probe().clone()?;
                std::panic::catch_unwind(CudaKernel::new)
                    .unwrap_or_else(|_| Err("making the CUDA kernel panicked".to_string()))
                    .map(Arc::new)
            })
            .clone()
    }

    fn new() -> Result<Self, String> {
        let context = CudaContext::new(0).map_err(cuda("creating a context"))?;
        let (free, _total) = context.mem_get_info().map_err(cuda("querying memory"))?;
        Ok(Self {
            single: staging(&context)?,
            double: staging(&context)?,
            lane_budget: (free / 8).min(LANE_BYTES),
            context,
        })
    }

    /// Transforms the `count` lines of a pass (`kind`, length `len`) on
    /// the device, batch by batch through the page-locked buffers: `fill`
    /// writes lines `first..first + n` into a batch's input buffer, and
    /// `take` reads their results out of its output buffer, while the other
    /// stream's batch is on the device.
    #[allow(clippy::too_many_arguments)]
    fn run_lines<T: CudaPrecision>(
        &self,
        lane_bytes: usize,
        kind: LineKind,
        len: usize,
        count: usize,
        fill: &Fill<'_, T>,
        take: &mut Take<'_, T>,
    ) -> Result<(), String> {
        let (n_in, n_out) = kind.lengths(len);
        let real_in = kind == LineKind::RealForward;
        let real_out = kind == LineKind::RealInverse;
        let value = std::mem::size_of::<T>();
        let line_bytes = n_in * value * if real_in { 1 } else { 2 }
            + n_out * value * if real_out { 1 } else { 2 };
        let lane_budget = self.lane_budget.min(lane_bytes);
        if line_bytes > lane_budget {
            return Err(format!(
                "CUDA: one line of length {len} needs {line_bytes} bytes of staging, more than \
                 the {lane_budget} a stream may use (a sixteenth of allowed_mem, at most \
                 {LANE_BYTES}, and an eighth of the device memory free); raise allowed_mem or \
                 set zarrfusion.device = 'cpu'"
            ));
        }
        let batch = (lane_budget / line_bytes).clamp(1, count.max(1));
        let plan_type = T::PLAN_TYPES[match kind {
            LineKind::Forward | LineKind::Inverse => 0,
            LineKind::RealForward => 1,
            LineKind::RealInverse => 2,
        }];
        let mut staging = T::staging(self)
            .lock()
            .map_err(|_| "CUDA: the kernel failed earlier".to_string())?;
        self.context
            .bind_to_thread()
            .map_err(cuda("binding the context"))?;
        for (b, first) in (0..count).step_by(batch).enumerate() {
            let lane = &mut staging.lanes[b % 2];
            // The lane's previous batch is back: take its results.
            collect(lane, take)?;
            let lines_here = batch.min(count - first);
            prepare(lane, &self.context, batch, n_in, n_out, real_in, real_out)?;
            // Input lines straight into the page-locked buffer (the rest of
            // a last, shorter batch keeps old values; its results are not
            // read).
            let host_in = lane
                .host_in
                .as_mut()
                .ok_or_else(|| "CUDA: a staging buffer went missing".to_string())?;
            fill(host_in, first..first + lines_here)?;
            let stream = Arc::clone(&lane.stream);
            match (lane.host_in.as_ref(), lane.device_in.as_mut()) {
                (Some(HostLines::Real(h)), Some(DeviceLines::Real(d))) => stream
                    .memcpy_htod(h, d)
                    .map_err(cuda("copying to the device"))?,
                (Some(HostLines::Complex(h)), Some(DeviceLines::Complex(d))) => stream
                    .memcpy_htod(h, d)
                    .map_err(cuda("copying to the device"))?,
                _ => return Err("CUDA: staging buffers of the wrong kind".to_string()),
            }
            let key = (plan_type, len, batch);
            if let Entry::Vacant(entry) = lane.plans.entry(key) {
                entry.insert(
                    CufftPlan::plan_many(
                        &[len as i32],
                        None,
                        1,
                        n_in as i32,
                        None,
                        1,
                        n_out as i32,
                        plan_type,
                        batch as i32,
                        Arc::clone(&stream),
                    )
                    .map_err(cuda("planning"))?,
                );
            }
            let (Some(plan), Some(input), Some(output)) = (
                lane.plans.get(&key),
                lane.device_in.as_mut(),
                lane.device_out.as_mut(),
            ) else {
                return Err("CUDA: a plan or buffer went missing".to_string());
            };
            T::exec(plan, kind, input, output)?;
            match (lane.device_out.as_ref(), lane.host_out.as_mut()) {
                (Some(DeviceLines::Real(d)), Some(HostLines::Real(h))) => {
                    stream.memcpy_dtoh(d, h).map_err(cuda("copying back"))?
                }
                (Some(DeviceLines::Complex(d)), Some(HostLines::Complex(h))) => {
                    stream.memcpy_dtoh(d, h).map_err(cuda("copying back"))?
                }
                _ => return Err("CUDA: staging buffers of the wrong kind".to_string()),
            }
            lane.pending = Some(first..first + lines_here);
        }
        for lane in staging.lanes.iter_mut() {
            collect(lane, take)?;
        }
        Ok(())
    }

    /// One pass of the block `v` (shape `shape`) through the device: each
    /// line gathered straight into the page-locked input buffer as `up`
    /// stages its values (`up(k, x)` for input position `k`), and each
    /// result scattered straight out of the output buffer into the new
    /// block as `down` finds it (`down(q, y)` for output position `q`).
    #[allow(clippy::too_many_arguments)]
    fn through_device<T: CudaPrecision, I, U, D, O>(
        &self,
        lane_bytes: usize,
        v: &[I],
        shape: &[usize],
        pass: &AxisPass<T>,
        up: impl Fn(usize, I) -> U + Sync,
        down: impl Fn(usize, D) -> O + Sync,
        staged_in: fn(&mut HostLines<T>) -> Option<&mut PinnedHostSlice<U>>,
        staged_out: fn(&HostLines<T>) -> Option<&PinnedHostSlice<D>>,
    ) -> Result<Vec<O>, String>
    where
        I: Copy + Sync,
        U: Send + ValidAsZeroBits,
        D: Copy + Sync + ValidAsZeroBits,
        O: Copy + Send + Sync + Default,
    {
        let (n_in, n_out) = pass.kind.lengths(pass.len);
        let stride: usize = shape[pass.axis + 1..].iter().product();
        let outer: usize = shape[..pass.axis].iter().product();
        let mut output = vec![O::default(); outer * pass.take.len() * stride];
        let wrong = || "CUDA: staging buffers of the wrong kind".to_string();
        let fill = |host: &mut HostLines<T>, lines: Range<usize>| {
            let host = staged_in(host).ok_or_else(wrong)?;
            let host = host.as_mut_slice().map_err(cuda("staging"))?;
            gather_into(
                v,
                shape,
                pass,
                lines.clone(),
                &mut host[..lines.len() * n_in],
                &up,
            );
            Ok(())
        };
        let mut take = |host: &HostLines<T>, lines: Range<usize>| {
            let host = staged_out(host).ok_or_else(wrong)?;
            let host = host.as_slice().map_err(cuda("reading results"))?;
            let results = &host[..lines.len() * n_out];
            scatter_from(results, n_out, shape, pass, lines, &mut output, &down)
        };
        self.run_lines(
            lane_bytes,
            pass.kind,
            pass.len,
            line_count(shape, pass.axis),
            &fill,
            &mut take,
        )?;
        Ok(output)
    }

    fn run_pass<T: CudaPrecision>(
        &self,
        lane_bytes: usize,
        values: BlockValues<T>,
        shape: &[usize],
        pass: &AxisPass<T>,
    ) -> Result<BlockValues<T>, String> {
        let pre = complex_pre(pass);
        match (values, pass.kind) {
            (BlockValues::Real(v), LineKind::RealForward) => {
                let up = |k: usize, x: T| match &pass.pre {
                    Some(f) => x * f[k].re,
                    None => x,
                };
                self.to_complex(lane_bytes, &v, shape, pass, up, real_lines)
            }
            (BlockValues::Complex(v), LineKind::RealInverse) => {
                let up = |k: usize, x: Complex<T>| T::pair(pre(k, x));
                let down = |q: usize, y: T| match &pass.post {
                    Some(f) => y * f[q].re,
                    None => y,
                };
                let out = self.through_device(
                    lane_bytes,
                    &v,
                    shape,
                    pass,
                    up,
                    down,
                    complex_lines,
                    real_lines_ref,
                )?;
                Ok(BlockValues::Real(out))
            }
            (BlockValues::Real(v), LineKind::Forward | LineKind::Inverse) => {
                // Real values go up as complex ones, converted as they are
                // gathered.
                let up = |k: usize, x: T| T::pair(pre(k, Complex::new(x, T::zero())));
                self.to_complex(lane_bytes, &v, shape, pass, up, complex_lines)
            }
            (BlockValues::Complex(v), LineKind::Forward | LineKind::Inverse) => {
                let up = |k: usize, x: Complex<T>| T::pair(pre(k, x));
                self.to_complex(lane_bytes, &v, shape, pass, up, complex_lines)
            }
            (BlockValues::Complex(_), LineKind::RealForward)
            | (BlockValues::Real(_), LineKind::RealInverse) => Err(wrong_values(pass)),
        }
    }

    /// A pass with complex results ([`Self::through_device`]): values
    /// staged by `up` into the buffers `staged_in` finds, results taken with
    /// the pass's output factors.
    fn to_complex<T: CudaPrecision, I: Copy + Sync, U: Send + ValidAsZeroBits>(
        &self,
        lane_bytes: usize,
        v: &[I],
        shape: &[usize],
        pass: &AxisPass<T>,
        up: impl Fn(usize, I) -> U + Sync,
        staged_in: fn(&mut HostLines<T>) -> Option<&mut PinnedHostSlice<U>>,
    ) -> Result<BlockValues<T>, String> {
        let post = complex_post(pass);
        let down = |q: usize, y: T::Pair| post(q, T::unpair(y));
        let out = self.through_device(
            lane_bytes,
            v,
            shape,
            pass,
            up,
            down,
            staged_in,
            complex_lines_ref,
        )?;
        Ok(BlockValues::Complex(out))
    }
}

/// The process's CUDA kernel as one query runs it: with the page-locked
/// staging its plan set aside ([`staging_bytes`]).
#[derive(Debug, Clone)]
pub struct CudaLanes {
    kernel: Arc<CudaKernel>,
    /// Bytes of input and output buffers one stream may hold.
    lane_bytes: usize,
}

impl CudaLanes {
    /// `kernel` staging through at most `staging` page-locked bytes.
    pub fn new(kernel: Arc<CudaKernel>, staging: usize) -> Self {
        Self {
            kernel,
            lane_bytes: staging / 2,
        }
    }
}

impl<T: CudaPrecision> FftKernel<T> for CudaLanes {
    fn transform(
        &self,
        values: BlockValues<T>,
        shape: &[usize],
        passes: &[AxisPass<T>],
    ) -> Result<(BlockValues<T>, Vec<usize>), String> {
        run_passes(values, shape, passes, |v, s, p| {
            self.kernel.run_pass(self.lane_bytes, v, s, p)
        })
    }
}

/// The staging state of one precision on `context`: two lanes, each
/// with its own stream, no buffers yet.
fn staging<T: CudaPrecision>(context: &Arc<CudaContext>) -> Result<Mutex<Staging<T>>, String> {
    let lanes = (0..2)
        .map(|_| {
            Ok(Lane {
                stream: context.new_stream().map_err(cuda("creating a stream"))?,
                host_in: None,
                host_out: None,
                device_in: None,
                device_out: None,
                plans: HashMap::new(),
                pending: None,
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(Mutex::new(Staging { lanes }))
}

/// Makes the lane's buffers hold `batch` lines of `n_in` inputs and
/// `n_out` outputs of the kinds asked, reusing them when they do.
fn prepare<T: CudaPrecision>(
    lane: &mut Lane<T>,
    context: &Arc<CudaContext>,
    batch: usize,
    n_in: usize,
    n_out: usize,
    real_in: bool,
    real_out: bool,
) -> Result<(), String> {
    let host_fits = |h: &Option<HostLines<T>>, len: usize, real: bool| match h {
        Some(HostLines::Real(s)) => real && s.len() == len,
        Some(HostLines::Complex(s)) => !real && s.len() == len,
        None => false,
    };
    let device_fits = |d: &Option<DeviceLines<T>>, len: usize, real: bool| match d {
        Some(DeviceLines::Real(s)) => real && s.len() == len,
        Some(DeviceLines::Complex(s)) => !real && s.len() == len,
        None => false,
    };
    let pinned = |len: usize, real: bool, flags: u32| -> Result<HostLines<T>, String> {
        // SAFETY: the buffers are zeroed before any read (below).
        Ok(if real {
            let mut s = unsafe { context.alloc_pinned_with_flags::<T>(len, flags) }
                .map_err(cuda("allocating page-locked memory"))?;
            zero(s.as_mut_ptr().map_err(cuda("staging"))?, len);
            HostLines::Real(s)
        } else {
            let mut s = unsafe { context.alloc_pinned_with_flags::<T::Pair>(len, flags) }
                .map_err(cuda("allocating page-locked memory"))?;
            zero(s.as_mut_ptr().map_err(cuda("staging"))?, len);
            HostLines::Complex(s)
        })
    };
    let stream = Arc::clone(&lane.stream);
    let device = |len: usize, real: bool| -> Result<DeviceLines<T>, String> {
        Ok(if real {
            DeviceLines::Real(
                stream
                    .alloc_zeros::<T>(len)
                    .map_err(cuda("allocating device memory"))?,
            )
        } else {
            DeviceLines::Complex(
                stream
                    .alloc_zeros::<T::Pair>(len)
                    .map_err(cuda("allocating device memory"))?,
            )
        })
    };
    let write_combined = cudarc::driver::sys::CU_MEMHOSTALLOC_WRITECOMBINED;
    if !host_fits(&lane.host_in, batch * n_in, real_in) {
        let buffer = pinned(batch * n_in, real_in, write_combined)?;
        lane.host_in = Some(buffer);
    }
    if !host_fits(&lane.host_out, batch * n_out, real_out) {
        let buffer = pinned(batch * n_out, real_out, 0)?;
        lane.host_out = Some(buffer);
    }
    if !device_fits(&lane.device_in, batch * n_in, real_in) {
        lane.device_in = None;
        let buffer = device(batch * n_in, real_in)?;
        lane.device_in = Some(buffer);
    }
    if !device_fits(&lane.device_out, batch * n_out, real_out) {
        lane.device_out = None;
        let buffer = device(batch * n_out, real_out)?;
        lane.device_out = Some(buffer);
    }
    Ok(())
}

/// Zeroes `len` values at `ptr` (page-locked memory just allocated).
fn zero<V>(ptr: *mut V, len: usize) {
    // SAFETY: `ptr` holds `len` values of `V` (its allocation), and every
    // `V` here (f32, f64, float2, double2) is valid as zero bits.
    unsafe { std::ptr::write_bytes(ptr, 0, len) };
}

/// Waits for the lane's pending batch and hands its results to `take`.
fn collect<T: CudaPrecision>(lane: &mut Lane<T>, take: &mut Take<'_, T>) -> Result<(), String> {
    let Some(lines) = lane.pending.take() else {
        return Ok(());
    };
    lane.stream
        .synchronize()
        .map_err(cuda("waiting for the stream"))?;
    let host = lane
        .host_out
        .as_ref()
        .ok_or_else(|| "CUDA: a staging buffer went missing".to_string())?;
    take(host, lines)
}

/// The page-locked buffer of real values, if `host` holds them.
fn real_lines<T: CudaPrecision>(host: &mut HostLines<T>) -> Option<&mut PinnedHostSlice<T>> {
    match host {
        HostLines::Real(h) => Some(h),
        HostLines::Complex(_) => None,
    }
}

/// The page-locked buffer of complex values, if `host` holds them.
fn complex_lines<T: CudaPrecision>(
    host: &mut HostLines<T>,
) -> Option<&mut PinnedHostSlice<T::Pair>> {
    match host {
        HostLines::Complex(h) => Some(h),
        HostLines::Real(_) => None,
    }
}

/// [`real_lines`], to read.
fn real_lines_ref<T: CudaPrecision>(host: &HostLines<T>) -> Option<&PinnedHostSlice<T>> {
    match host {
        HostLines::Real(h) => Some(h),
        HostLines::Complex(_) => None,
    }
}

/// [`complex_lines`], to read.
fn complex_lines_ref<T: CudaPrecision>(host: &HostLines<T>) -> Option<&PinnedHostSlice<T::Pair>> {
    match host {
        HostLines::Complex(h) => Some(h),
        HostLines::Real(_) => None,
    }
}

/// The number of lines along `axis` of a block of shape `shape`.
fn line_count(shape: &[usize], axis: usize) -> usize {
    shape
        .iter()
        .enumerate()
        .filter(|(d, _)| *d != axis)
        .map(|(_, &n)| n)
        .product()
}

/// The lines `lines` of `input` (shape `shape`) along `pass.axis`, staged
/// by `up` into `out`, one after the other. Line `o·stride + j` (outer
/// index `o`, inner position `j`) holds input position `k` of the
/// transform at block position `pass.gather[k]` along the axis.
fn gather_into<I: Copy + Sync, U: Send>(
    input: &[I],
    shape: &[usize],
    pass: &AxisPass<impl Sync>,
    lines: Range<usize>,
    out: &mut [U],
    up: &(impl Fn(usize, I) -> U + Sync),
) {
    let axis = pass.axis;
    let n = shape[axis];
    let stride: usize = shape[axis + 1..].iter().product();
    let g = pass.gather.len();
    if g == 0 {
        return;
    }
    out.par_chunks_mut(g)
        .zip(lines.into_par_iter())
        .for_each(|(line, l)| {
            let (o, j) = (l / stride, l % stride);
            let base = o * n * stride + j;
            for (k, (value, &p)) in line.iter_mut().zip(&pass.gather).enumerate() {
                *value = up(k, input[base + p * stride]);
            }
        });
}

/// Writes the transformed `results` of the lines `lines` (`n_out` each,
/// as [`gather_into`] orders lines) into `output`, the block after the
/// pass (shape `shape` with `pass.take.len()` positions along the axis),
/// each taken by `down`.
fn scatter_from<D: Copy + Sync, O: Copy + Send>(
    results: &[D],
    n_out: usize,
    shape: &[usize],
    pass: &AxisPass<impl Sync>,
    lines: Range<usize>,
    output: &mut [O],
    down: &(impl Fn(usize, D) -> O + Sync),
) -> Result<(), String> {
    let stride: usize = shape[pass.axis + 1..].iter().product();
    let m = pass.take.len();
    if n_out == 0 || m == 0 {
        return Ok(());
    }
    if lines.end > output.len() / m || results.len() < lines.len() * n_out {
        return Err(format!(
            "CUDA: results of lines {lines:?} do not fit a block of {} values",
            output.len()
        ));
    }
    let out = SharedOut(output.as_mut_ptr());
    results
        .par_chunks(n_out)
        .zip(lines.into_par_iter())
        .for_each(|(line, l)| {
            let (o, j) = (l / stride, l % stride);
            let base = o * m * stride + j;
            for (q, &i) in pass.take.iter().enumerate() {
                // SAFETY: `base + q·stride` is inside `output` (`l` is a line
                // of the block, checked above, and `q < m`), and it is
                // written by line `l` alone: lines differ in `o` or `j`.
                unsafe { out.write(base + q * stride, down(q, line[i])) };
            }
        });
    Ok(())
}

/// The block after a pass, written by many lines at once, each at its own
/// positions (see [`scatter_from`]).
struct SharedOut<O>(*mut O);

// SAFETY: the lines write disjoint positions of one live buffer.
unsafe impl<O: Send> Sync for SharedOut<O> {}

impl<O> SharedOut<O> {
    /// Writes `value` at `at`.
    ///
    /// # Safety
    /// `at` is inside the buffer, and no other thread touches it meanwhile.
    unsafe fn write(&self, at: usize, value: O) {
        // SAFETY: as the caller promises.
        unsafe { self.0.add(at).write(value) };
    }
}

/// [`CudaPrecision`] of one precision: its cuFFT complex type, plan types
/// and calls, and staging.
macro_rules! cuda_precision {
    ($t:ty, $pair:ident, [$c2c_type:ident, $r2c_type:ident, $c2r_type:ident],
     $c2c:ident, $r2c:ident, $c2r:ident, $staging:ident) => {
        impl CudaPrecision for $t {
            type Pair = $pair;
            const PLAN_TYPES: [cufftType; 3] = [
                cufftType::$c2c_type,
                cufftType::$r2c_type,
                cufftType::$c2r_type,
            ];
            fn pair(value: Complex<$t>) -> $pair {
                $pair {
                    x: value.re,
                    y: value.im,
                }
            }
            fn unpair(value: $pair) -> Complex<$t> {
                Complex::new(value.x, value.y)
            }
            fn exec(
                plan: &CufftPlan,
                kind: LineKind,
                input: &mut DeviceLines<Self>,
                output: &mut DeviceLines<Self>,
            ) -> Result<(), String> {
                match (kind, input, output) {
                    (LineKind::Forward, DeviceLines::Complex(i), DeviceLines::Complex(o)) => {
                        plan.$c2c(i, o, FftDirection::Forward)
                    }
                    (LineKind::Inverse, DeviceLines::Complex(i), DeviceLines::Complex(o)) => {
                        plan.$c2c(i, o, FftDirection::Inverse)
                    }
                    (LineKind::RealForward, DeviceLines::Real(i), DeviceLines::Complex(o)) => {
                        plan.$r2c(i, o)
                    }
                    (LineKind::RealInverse, DeviceLines::Complex(i), DeviceLines::Real(o)) => {
                        plan.$c2r(i, o)
                    }
                    _ => {
                        return Err("CUDA: buffers of the wrong kind for the transform".to_string())
                    }
                }
                .map_err(cuda("running a transform"))
            }
            fn staging(kernel: &CudaKernel) -> &Mutex<Staging<$t>> {
                &kernel.$staging
            }
        }
    };
}

cuda_precision!(
    f32,
    float2,
    [CUFFT_C2C, CUFFT_R2C, CUFFT_C2R],
    exec_c2c,
    exec_r2c,
    exec_c2r,
    single
);
cuda_precision!(
    f64,
    double2,
    [CUFFT_Z2Z, CUFFT_D2Z, CUFFT_Z2D],
    exec_z2z,
    exec_d2z,
    exec_z2d,
    double
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_gathered_and_scattered_back_are_the_block() {
        // Shape [2, 3, 4] along axis 1: 8 lines of 3, with a reversal,
        // gathered and scattered in two batches of lines.
        let shape = [2usize, 3, 4];
        let values: Vec<f64> = (0..24).map(f64::from).collect();
        let mut pass = AxisPass::<f64>::plain(1, LineKind::Forward, 3);
        pass.gather = vec![2, 1, 0];
        pass.take = vec![2, 1, 0];
        let mut lines = [0.0; 8 * 3];
        let (first, second) = lines.split_at_mut(5 * 3);
        gather_into(&values, &shape, &pass, 0..5, first, &|_, x| x);
        gather_into(&values, &shape, &pass, 5..8, second, &|_, x| x);
        // Line (o = 1, j = 2): positions 12 + 2 + 4·p, reversed.
        assert_eq!(&lines[(4 + 2) * 3..(4 + 3) * 3], &[22.0, 18.0, 14.0]);
        let mut back = [0.0; 24];
        scatter_from(&lines[..9], 3, &shape, &pass, 0..3, &mut back, &|_, x| x).unwrap();
        scatter_from(&lines[9..], 3, &shape, &pass, 3..8, &mut back, &|_, x| x).unwrap();
        // Lines past the block are refused.
        assert!(scatter_from(&lines[..9], 3, &shape, &pass, 6..9, &mut back, &|_, x| x).is_err());
        assert_eq!(back.to_vec(), values);
    }
}

//! FFTs along the axes of a C-ordered block on the CPU, with `rustfft`
//! (complex transforms) and `realfft` (real-input and real-output ones).
//!
//! A transform of a block is a list of [`AxisPass`]es, one per transformed
//! axis. A pass gathers each line along its axis into a contiguous buffer
//! (in any order, with a factor per position: this is where flips, shifts
//! and windows go), transforms the lines, and scatters the results (again
//! in any order, with a factor per position: shifts, phases and scalings).
//! Lines run in parallel on rayon's pool, in groups large enough to amortize
//! the gather and small enough to stay in cache; plans are made once per
//! length and shared ([`CpuFft`] keeps them).
//!
//! ```
//! use zarrfusion::device::{AxisPass, CpuFft, LineKind};
//! use zarrfusion::device::fft_cpu::BlockValues;
//!
//! // numpy.fft.fft([1, 2, 3, 4]) == [10, -2+2j, -2, -2-2j]
//! let fft = CpuFft::<f64>::default();
//! let pass = AxisPass::plain(0, LineKind::Forward, 4);
//! let (out, shape) = fft.transform(BlockValues::Real(vec![1.0, 2.0, 3.0, 4.0]), &[4], &[pass]).unwrap();
//! let BlockValues::Complex(out) = out else { unreachable!() };
//! assert_eq!(shape, vec![4]);
//! assert_eq!((out[1].re, out[1].im), (-2.0, 2.0));
//! ```

use std::sync::Mutex;

use rayon::prelude::*;
use realfft::RealFftPlanner;
use rustfft::num_complex::Complex;
use rustfft::{FftNum, FftPlanner};

/// Elements gathered per group of lines: enough to amortize a group's
/// bookkeeping, little enough to stay in cache.
const GROUP_ELEMENTS: usize = 1 << 14;

/// What a pass does to each line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineKind {
    /// Complex to complex, forward (`numpy.fft.fft`).
    Forward,
    /// Complex to complex, inverse, unnormalized (the pass's factors hold
    /// the `1/n` of `numpy.fft.ifft`).
    Inverse,
    /// `n` real values to `n / 2 + 1` complex ones (`numpy.fft.rfft`).
    RealForward,
    /// `n / 2 + 1` complex values to `n` real ones, unnormalized
    /// (`numpy.fft.irfft` times `n`); imaginary parts the real output
    /// cannot hold (of the first and, for even `n`, last value) are
    /// ignored, as numpy does.
    RealInverse,
}

/// One axis of a block transformed.
///
/// Line position `k` of the transform's input is the block's position
/// `gather[k]` along `axis`, times `pre[k]`; output position `q` is the
/// transform's output `take[q]`, times `post[q]`. For a real-input pass the
/// `pre` factors must be real, for a real-output pass the `post` factors
/// (their imaginary parts are ignored).
#[derive(Debug, Clone, PartialEq)]
pub struct AxisPass<T> {
    /// The axis of the block.
    pub axis: usize,
    /// The transform.
    pub kind: LineKind,
    /// The transform's length: of its input and output for complex
    /// transforms, of the real side for real ones.
    pub len: usize,
    /// For each input position of the transform, the block position it reads.
    pub gather: Vec<usize>,
    /// Factors of the transform's input, by input position.
    pub pre: Option<Vec<Complex<T>>>,
    /// For each output position along the axis, the transform output it takes.
    pub take: Vec<usize>,
    /// Factors of the output, by output position.
    pub post: Option<Vec<Complex<T>>>,
}

impl<T> AxisPass<T> {
    /// A pass of length `len` with no reordering and no factors.
    pub fn plain(axis: usize, kind: LineKind, len: usize) -> Self {
        let (n_in, n_out) = kind.lengths(len);
        Self {
            axis,
            kind,
            len,
            gather: (0..n_in).collect(),
            pre: None,
            take: (0..n_out).collect(),
            post: None,
        }
    }
}

impl LineKind {
    /// The input and output lengths of a transform of length `len`.
    pub fn lengths(self, len: usize) -> (usize, usize) {
        match self {
            Self::Forward | Self::Inverse => (len, len),
            Self::RealForward => (len, len / 2 + 1),
            Self::RealInverse => (len / 2 + 1, len),
        }
    }
}

/// The values of a block: real or complex, C order.
#[derive(Debug, Clone, PartialEq)]
pub enum BlockValues<T> {
    /// Real values.
    Real(Vec<T>),
    /// Complex values.
    Complex(Vec<Complex<T>>),
}

impl<T> BlockValues<T> {
    /// The number of values.
    pub fn len(&self) -> usize {
        match self {
            Self::Real(v) => v.len(),
            Self::Complex(v) => v.len(),
        }
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The CPU FFT kernel: plans made once per length and kind, shared by
/// every block and thread.
pub struct CpuFft<T: FftNum> {
    complex: Mutex<FftPlanner<T>>,
    real: Mutex<RealFftPlanner<T>>,
}

impl<T: FftNum> Default for CpuFft<T> {
    fn default() -> Self {
        Self {
            complex: Mutex::new(FftPlanner::new()),
            real: Mutex::new(RealFftPlanner::new()),
        }
    }
}

impl<T: FftNum> std::fmt::Debug for CpuFft<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CpuFft")
    }
}

impl<T: FftNum + Default> CpuFft<T> {
    /// Runs `passes`, in order, over `values` of shape `shape`; returns the
    /// result and its shape. Errors name a pass that does not fit the block
    /// (an axis out of range, positions outside the line, a real pass over
    /// complex values or the reverse).
    pub fn transform(
        &self,
        values: BlockValues<T>,
        shape: &[usize],
        passes: &[AxisPass<T>],
    ) -> Result<(BlockValues<T>, Vec<usize>), String> {
        run_passes(values, shape, passes, |v, s, p| self.run_pass(v, s, p))
    }

    fn run_pass(
        &self,
        values: BlockValues<T>,
        shape: &[usize],
        pass: &AxisPass<T>,
    ) -> Result<BlockValues<T>, String> {
        let (n_in, n_out) = pass.kind.lengths(pass.len);
        match (values, pass.kind) {
            (BlockValues::Real(v), LineKind::Inverse) => {
                self.run_pass(real_as_complex(v), shape, pass)
            }
            (BlockValues::Real(v), LineKind::Forward) if !real_factors(&pass.pre) => {
                self.run_pass(real_as_complex(v), shape, pass)
            }
            // Real input: a real-to-complex transform; for a complex
            // forward pass with real factors, its other half filled in as
            // the conjugates (half the work of a complex transform).
            (BlockValues::Real(v), kind @ (LineKind::RealForward | LineKind::Forward)) => {
                let plan = self
                    .real
                    .lock()
                    .map_err(poisoned)?
                    .plan_fft_forward(pass.len);
                let half = if kind == LineKind::Forward {
                    pass.len / 2 + 1
                } else {
                    0
                };
                let scratch = half + plan.get_scratch_len();
                let pre = |k: usize, x: T| match &pass.pre {
                    Some(f) => x * f[k].re,
                    None => x,
                };
                let out = along(
                    &v,
                    shape,
                    pass,
                    n_out,
                    pre,
                    complex_post(pass),
                    |lines, out| {
                        each_line(lines, out, (n_in, n_out), scratch, |line, result, s| {
                            // The lengths match the plan's: no error is possible.
                            if half == 0 {
                                let _ = plan.process_with_scratch(line, result, s);
                            } else {
                                let (spectrum, s) = s.split_at_mut(half);
                                let _ = plan.process_with_scratch(line, spectrum, s);
                                hermitian_fill(spectrum, result);
                            }
                        })
                    },
                );
                Ok(BlockValues::Complex(out))
            }
            (BlockValues::Complex(v), LineKind::RealInverse) => {
                let plan = self
                    .real
                    .lock()
                    .map_err(poisoned)?
                    .plan_fft_inverse(pass.len);
                let scratch = plan.get_scratch_len();
                let post = |q: usize, x: T| match &pass.post {
                    Some(f) => x * f[q].re,
                    None => x,
                };
                let out = along(
                    &v,
                    shape,
                    pass,
                    n_out,
                    complex_pre(pass),
                    post,
                    |lines, out| {
                        each_line(lines, out, (n_in, n_out), scratch, |line, result, s| {
                            // Non-zero imaginary parts the output cannot hold are
                            // reported after the transform ran; numpy ignores them too.
                            let _ = plan.process_with_scratch(line, result, s);
                        })
                    },
                );
                Ok(BlockValues::Real(out))
            }
            (BlockValues::Complex(v), kind @ (LineKind::Forward | LineKind::Inverse)) => {
                let plan = {
                    let mut planner = self.complex.lock().map_err(poisoned)?;
                    if kind == LineKind::Forward {
                        planner.plan_fft_forward(pass.len)
                    } else {
                        planner.plan_fft_inverse(pass.len)
                    }
                };
                let scratch = plan.get_outofplace_scratch_len();
                let out = along(
                    &v,
                    shape,
                    pass,
                    n_out,
                    complex_pre(pass),
                    complex_post(pass),
                    |lines, out| {
                        let mut scratch = vec![Complex::new(T::zero(), T::zero()); scratch];
                        plan.process_outofplace_with_scratch(lines, out, &mut scratch);
                    },
                );
                Ok(BlockValues::Complex(out))
            }
            (BlockValues::Complex(_), LineKind::RealForward)
            | (BlockValues::Real(_), LineKind::RealInverse) => Err(wrong_values(pass)),
        }
    }
}

/// Runs `passes`, in order, over `values` of shape `shape` with
/// `run_pass(values, shape, pass)` after checking that each pass fits;
/// returns the result and its shape. Any kernel's `transform`.
pub(crate) fn run_passes<T>(
    mut values: BlockValues<T>,
    shape: &[usize],
    passes: &[AxisPass<T>],
    mut run_pass: impl FnMut(BlockValues<T>, &[usize], &AxisPass<T>) -> Result<BlockValues<T>, String>,
) -> Result<(BlockValues<T>, Vec<usize>), String> {
    let mut shape = shape.to_vec();
    if values.len() != shape.iter().product::<usize>() {
        return Err(format!(
            "a block of {} values does not have shape {shape:?}",
            values.len()
        ));
    }
    for pass in passes {
        check_pass(pass, &shape)?;
        values = run_pass(values, &shape, pass)?;
        shape[pass.axis] = pass.take.len();
    }
    Ok((values, shape))
}

/// Runs `transform(line, result, scratch)` over the lines of `lines` and
/// their results in `out` (`n_in` and `n_out` values per line),
/// with one scratch buffer of `scratch` values.
fn each_line<T: FftNum, I, O>(
    lines: &mut [I],
    out: &mut [O],
    (n_in, n_out): (usize, usize),
    scratch: usize,
    transform: impl Fn(&mut [I], &mut [O], &mut [Complex<T>]),
) {
    let mut scratch = vec![Complex::new(T::zero(), T::zero()); scratch];
    for (line, result) in lines
        .chunks_exact_mut(n_in)
        .zip(out.chunks_exact_mut(n_out))
    {
        transform(line, result, &mut scratch);
    }
}

/// Real values as complex ones.
pub(crate) fn real_as_complex<T: FftNum>(values: Vec<T>) -> BlockValues<T> {
    BlockValues::Complex(
        values
            .into_iter()
            .map(|x| Complex::new(x, T::zero()))
            .collect(),
    )
}

/// The error of a real pass given values of the other kind: complex
/// values to a real-input pass, real ones to a real-output inverse.
pub(crate) fn wrong_values<T>(pass: &AxisPass<T>) -> String {
    if pass.kind == LineKind::RealForward {
        format!(
            "a real-input FFT along axis {} of complex values",
            pass.axis
        )
    } else {
        format!(
            "a real-output inverse FFT along axis {} of real values",
            pass.axis
        )
    }
}

/// Whether `factors` are all real (or there are none).
fn real_factors<T: FftNum>(factors: &Option<Vec<Complex<T>>>) -> bool {
    factors
        .as_ref()
        .is_none_or(|f| f.iter().all(|c| c.im == T::zero()))
}

/// The whole spectrum of a real line from its first half (`rfft`):
/// position `k` past the half is the conjugate of position `n - k`.
fn hermitian_fill<T: FftNum>(half: &[Complex<T>], full: &mut [Complex<T>]) {
    let (n, h) = (full.len(), half.len());
    full[..h].copy_from_slice(half);
    for k in h..n {
        full[k] = half[n - k].conj();
    }
}

/// The error of a planner lock whose holder panicked.
fn poisoned<E: std::fmt::Display>(e: E) -> String {
    format!("an FFT planner failed earlier: {e}")
}

/// The `pre` factors of a complex-input pass, as a function.
pub(crate) fn complex_pre<T: FftNum>(
    pass: &AxisPass<T>,
) -> impl Fn(usize, Complex<T>) -> Complex<T> + Sync + '_ {
    move |k, x| match &pass.pre {
        Some(f) => x * f[k],
        None => x,
    }
}

/// The `post` factors of a complex-output pass, as a function.
pub(crate) fn complex_post<T: FftNum>(
    pass: &AxisPass<T>,
) -> impl Fn(usize, Complex<T>) -> Complex<T> + Sync + '_ {
    move |q, x| match &pass.post {
        Some(f) => x * f[q],
        None => x,
    }
}

/// Checks that `pass` fits a block of shape `shape`.
fn check_pass<T>(pass: &AxisPass<T>, shape: &[usize]) -> Result<(), String> {
    let Some(&n) = shape.get(pass.axis) else {
        return Err(format!(
            "an FFT along axis {} of a {}-D block",
            pass.axis,
            shape.len()
        ));
    };
    let (n_in, n_out) = pass.kind.lengths(pass.len);
    if pass.len == 0 || pass.gather.len() != n_in || pass.gather.iter().any(|&p| p >= n) {
        return Err(format!(
            "an FFT of length {} along axis {} (length {n}) gathers {} positions",
            pass.len,
            pass.axis,
            pass.gather.len()
        ));
    }
    if pass.take.iter().any(|&i| i >= n_out) {
        return Err(format!(
            "an FFT along axis {} takes outputs beyond {n_out}",
            pass.axis
        ));
    }
    let factors_fit =
        |f: &Option<Vec<Complex<T>>>, len: usize| f.as_ref().is_none_or(|f| f.len() == len);
    if !factors_fit(&pass.pre, n_in) || !factors_fit(&pass.post, pass.take.len()) {
        return Err(format!(
            "an FFT along axis {} has factors of the wrong length",
            pass.axis
        ));
    }
    Ok(())
}

/// The output buffer, written by several threads at distinct positions.
struct SharedOutput<O>(*mut O);

// SAFETY: threads write distinct elements only (see `along`), and the
// buffer outlives them (rayon joins before `along` returns).
unsafe impl<O: Send> Send for SharedOutput<O> {}
unsafe impl<O: Send> Sync for SharedOutput<O> {}

/// Transforms every line of `input` (shape `shape`) along `pass.axis`:
/// gathers groups of lines with `pre`, calls `transform(lines, results)`
/// on them (`n_out` results per line), and scatters the results with
/// `post` into a new block whose axis has `pass.take.len()` positions.
fn along<I, O>(
    input: &[I],
    shape: &[usize],
    pass: &AxisPass<impl Sync>,
    n_out: usize,
    pre: impl Fn(usize, I) -> I + Sync,
    post: impl Fn(usize, O) -> O + Sync,
    transform: impl Fn(&mut [I], &mut [O]) + Sync,
) -> Vec<O>
where
    I: Copy + Send + Sync + Default,
    O: Copy + Send + Sync + Default,
{
    let axis = pass.axis;
    let outer: usize = shape[..axis].iter().product();
    let n = shape[axis];
    let stride: usize = shape[axis + 1..].iter().product();
    let (gather, take) = (&pass.gather, &pass.take);
    let (g, m) = (gather.len(), take.len());
    let mut output = vec![O::default(); outer * m * stride];
    if output.is_empty() {
        return output;
    }
    // A unit is a group of lines: consecutive outer indices when lines are
    // contiguous (stride 1), else consecutive inner positions of one outer index.
    let group = (GROUP_ELEMENTS / g.max(1)).clamp(1, 256);
    let (units_per_outer, lines_per_unit) = if stride == 1 {
        (1, group.min(outer))
    } else {
        (stride.div_ceil(group), group.min(stride))
    };
    let units = if stride == 1 {
        outer.div_ceil(lines_per_unit)
    } else {
        outer * units_per_outer
    };
    let shared = SharedOutput(output.as_mut_ptr());
    let shared = &shared;
    (0..units).into_par_iter().for_each_init(
        || (Vec::<I>::new(), Vec::<O>::new()),
        |(lines, results), unit| {
            // The lines of this unit, as (outer index, inner position).
            let (o0, o1, j0, j1) = if stride == 1 {
                let o0 = unit * lines_per_unit;
                (o0, (o0 + lines_per_unit).min(outer), 0, 1)
            } else {
                let (o, u) = (unit / units_per_outer, unit % units_per_outer);
                let j0 = u * lines_per_unit;
                (o, o + 1, j0, (j0 + lines_per_unit).min(stride))
            };
            // Line t of the unit is (o0 + t / w, j0 + t % w); each
            // position's values of the unit's lines are contiguous in the
            // block (a run of w), so gathers and scatters go by position.
            let w = j1 - j0;
            let count = (o1 - o0) * w;
            lines.clear();
            lines.resize(count * g, I::default());
            for o in o0..o1 {
                let (base, first) = (o * n * stride, (o - o0) * w);
                for (k, &p) in gather.iter().enumerate() {
                    let run = &input[base + p * stride + j0..base + p * stride + j1];
                    for (t, &x) in run.iter().enumerate() {
                        lines[(first + t) * g + k] = pre(k, x);
                    }
                }
            }
            results.clear();
            results.resize(count * n_out, O::default());
            transform(lines, results);
            for o in o0..o1 {
                let (base, first) = (o * m * stride, (o - o0) * w);
                for (q, &i) in take.iter().enumerate() {
                    for t in 0..w {
                        let value = post(q, results[(first + t) * n_out + i]);
                        // SAFETY: (o, j) pairs belong to one unit only, so
                        // every index base + q * stride + j is written once,
                        // and it is within `output` (o < outer, q < m, j < stride).
                        unsafe { *shared.0.add(base + q * stride + j0 + t) = value };
                    }
                }
            }
        },
    );
    output
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The discrete Fourier transform by its definition.
    fn dft(x: &[Complex<f64>], inverse: bool) -> Vec<Complex<f64>> {
        let n = x.len();
        let sign = if inverse { 1.0 } else { -1.0 };
        (0..n)
            .map(|k| {
                x.iter()
                    .enumerate()
                    .map(|(j, v)| {
                        let angle = sign * 2.0 * std::f64::consts::PI * (j * k) as f64 / n as f64;
                        v * Complex::new(angle.cos(), angle.sin())
                    })
                    .sum()
            })
            .collect()
    }

    fn close(a: &[Complex<f64>], b: &[Complex<f64>]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).norm() < 1e-9, "{x} != {y}");
        }
    }

    #[test]
    fn every_axis_of_a_3d_block_matches_the_definition() {
        let shape = [3usize, 5, 4];
        let values: Vec<f64> = (0..60).map(|i| ((i * 7919) % 61) as f64 - 30.0).collect();
        let fft = CpuFft::<f64>::default();
        for axis in 0..3 {
            let pass = AxisPass::plain(axis, LineKind::Forward, shape[axis]);
            let (out, out_shape) = fft
                .transform(BlockValues::Real(values.clone()), &shape, &[pass])
                .unwrap();
            assert_eq!(out_shape, shape);
            let BlockValues::Complex(out) = out else {
                panic!("complex expected")
            };
            let strides = [20usize, 4, 1];
            // Every line along `axis` against the definition.
            for start in 0..60usize {
                if !(start / strides[axis]).is_multiple_of(shape[axis]) {
                    continue;
                }
                let idx = |k: usize| start + k * strides[axis];
                let line: Vec<Complex<f64>> = (0..shape[axis])
                    .map(|k| Complex::new(values[idx(k)], 0.0))
                    .collect();
                let got: Vec<Complex<f64>> = (0..shape[axis]).map(|k| out[idx(k)]).collect();
                close(&got, &dft(&line, false));
            }
        }
    }

    #[test]
    fn real_forward_then_real_inverse_returns_the_input() {
        for n in [7usize, 8] {
            let shape = [n, 3];
            let values: Vec<f64> = (0..n * 3).map(|i| (i as f64).sin()).collect();
            let fft = CpuFft::<f64>::default();
            let forward = AxisPass::plain(0, LineKind::RealForward, n);
            let (spectrum, spectrum_shape) = fft
                .transform(BlockValues::Real(values.clone()), &shape, &[forward])
                .unwrap();
            assert_eq!(spectrum_shape, vec![n / 2 + 1, 3]);
            let mut inverse = AxisPass::plain(0, LineKind::RealInverse, n);
            inverse.post = Some(vec![Complex::new(1.0 / n as f64, 0.0); n]);
            let (back, back_shape) = fft
                .transform(spectrum, &spectrum_shape, &[inverse])
                .unwrap();
            assert_eq!(back_shape, shape);
            let BlockValues::Real(back) = back else {
                panic!("real expected")
            };
            for (a, b) in back.iter().zip(&values) {
                assert!((a - b).abs() < 1e-12);
            }
        }
    }

    #[test]
    fn real_input_with_real_or_complex_factors_matches_the_definition() {
        let fft = CpuFft::<f64>::default();
        for n in [6usize, 9] {
            let x: Vec<f64> = (0..n).map(|i| (i as f64 * 1.3).cos() + 0.2).collect();
            // Real factors take the real-to-complex path, complex ones the
            // complex transform.
            for factors in [
                (0..n)
                    .map(|k| Complex::new(0.5 + k as f64, 0.0))
                    .collect::<Vec<_>>(),
                (0..n).map(|k| Complex::new(1.0, k as f64 * 0.1)).collect(),
            ] {
                let mut pass = AxisPass::plain(0, LineKind::Forward, n);
                pass.pre = Some(factors.clone());
                let (out, _) = fft
                    .transform(BlockValues::Real(x.clone()), &[n], &[pass])
                    .unwrap();
                let BlockValues::Complex(out) = out else {
                    panic!("complex expected")
                };
                let line: Vec<Complex<f64>> = x.iter().zip(&factors).map(|(&v, f)| f * v).collect();
                close(&out, &dft(&line, false));
            }
        }
    }

    #[test]
    fn gather_and_take_reorder_lines() {
        // Reversed input, output rotated by one, doubled.
        let fft = CpuFft::<f64>::default();
        let x = [1.0, 2.0, 0.5, -1.0, 3.0];
        let mut pass = AxisPass::plain(0, LineKind::Forward, 5);
        pass.gather = vec![4, 3, 2, 1, 0];
        pass.take = vec![1, 2, 3, 4, 0];
        pass.post = Some(vec![Complex::new(2.0, 0.0); 5]);
        let (out, _) = fft
            .transform(BlockValues::Real(x.to_vec()), &[5], &[pass])
            .unwrap();
        let BlockValues::Complex(out) = out else {
            panic!("complex expected")
        };
        let reversed: Vec<Complex<f64>> = x.iter().rev().map(|&v| Complex::new(v, 0.0)).collect();
        let spectrum = dft(&reversed, false);
        let expected: Vec<Complex<f64>> =
            [1, 2, 3, 4, 0].iter().map(|&i| spectrum[i] * 2.0).collect();
        close(&out, &expected);
    }

    #[test]
    fn a_pass_that_does_not_fit_is_an_error() {
        let fft = CpuFft::<f64>::default();
        let pass = AxisPass::plain(2, LineKind::Forward, 4);
        let err = fft
            .transform(BlockValues::Real(vec![0.0; 4]), &[4], &[pass])
            .unwrap_err();
        assert!(err.contains("axis 2"), "{err}");
        let pass = AxisPass::plain(0, LineKind::Forward, 5);
        assert!(fft
            .transform(BlockValues::Real(vec![0.0; 4]), &[4], &[pass])
            .is_err());
    }
}

//! A whole FFT of a block: the trend removed, then one kernel pass per
//! transformed dimension, in numpy's order.

use rustfft::num_traits::Float;
use rustfft::FftNum;

use super::axis::AxisTransform;
use super::detrend::detrend_block;
use super::options::{Detrend, FftOptions};
use crate::device::fft_cpu::BlockValues;
use crate::device::FftKernel;
use crate::table::Coordinate;

/// The input coordinate of a transformed dimension, as numbers (seconds
/// for times), and its `direct_lag` attribute when it has one.
#[derive(Debug, Clone)]
pub struct InputCoordinate {
    /// The values: `Float64` values held, the index, or computed.
    pub numbers: Coordinate,
    /// The `direct_lag` attribute of a frequency coordinate xrft (or
    /// zarrfusion) wrote.
    pub direct_lag: Option<f64>,
}

/// An FFT of blocks whose dimensions are `dims` (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct FftTransform {
    /// The options it was made with.
    pub options: FftOptions,
    /// The block's dimensions, outermost first.
    pub dims: Vec<String>,
    /// The transformed dimensions in transform order, with their block axis.
    pub axes: Vec<(usize, AxisTransform)>,
}

impl FftTransform {
    /// The transform `options` asks for, of blocks with dimensions `dims`,
    /// given each transformed dimension's coordinate (`coordinate(dim)`).
    /// Errors name the dimension at fault.
    pub fn new(
        dims: &[String],
        options: &FftOptions,
        coordinate: impl Fn(&str) -> Result<InputCoordinate, String>,
    ) -> Result<Self, String> {
        if options.dims.is_empty() {
            return Err("no dimension to transform (dims => 'lat' or dims => 'lat,lon')".into());
        }
        let known = dims.join(", ");
        let axis_of = |dim: &str| {
            dims.iter()
                .position(|d| d == dim)
                .ok_or_else(|| format!("unknown dimension '{dim}' (dimensions: {known})"))
        };
        for (i, dim) in options.dims.iter().enumerate() {
            axis_of(dim)?;
            if options.dims[..i].contains(dim) {
                return Err(format!("dimension '{dim}' is named twice"));
            }
        }
        if let Some(real) = &options.real_dim {
            axis_of(real)?;
        }
        if options.detrend == Some(Detrend::Linear) && options.dims.len() > 2 {
            return Err(format!(
                "a linear detrend takes one or two dimensions, not {} (as in xrft)",
                options.dims.len()
            ));
        }
        let order = options.transform_order();
        if let Some(lags) = &options.lag {
            if lags.len() != order.len() {
                return Err(format!(
                    "{} lag{} for {} dimension{}: give one per transformed dimension",
                    lags.len(),
                    if lags.len() == 1 { "" } else { "s" },
                    order.len(),
                    if order.len() == 1 { "" } else { "s" },
                ));
            }
        }
        let mut axes = Vec::with_capacity(order.len());
        for (i, dim) in order.iter().enumerate() {
            let coordinate = coordinate(dim)?;
            let real = options.real_dim.as_deref() == Some(dim.as_str());
            let transform = if options.inverse {
                // Lags follow the transform order (the real dimension
                // last), as xrft zips them.
                let lag = options
                    .lag
                    .as_ref()
                    .map(|l| l[i])
                    .or(coordinate.direct_lag)
                    .unwrap_or(0.0);
                AxisTransform::inverse(dim, &coordinate.numbers, real, lag, options)?
            } else {
                AxisTransform::forward(dim, &coordinate.numbers, real, options)?
            };
            axes.push((axis_of(dim)?, transform));
        }
        Ok(Self {
            options: options.clone(),
            dims: dims.to_vec(),
            axes,
        })
    }

    /// The output dimensions, outermost first (the input's, with the
    /// transformed ones renamed).
    pub fn output_dims(&self) -> Vec<String> {
        let mut dims = self.dims.clone();
        for (axis, transform) in &self.axes {
            dims[*axis] = transform.output_name.clone();
        }
        dims
    }

    /// The shape of the output of a block of shape `shape`.
    pub fn output_shape(&self, shape: &[u64]) -> Vec<u64> {
        let mut shape = shape.to_vec();
        for (axis, transform) in &self.axes {
            shape[*axis] = transform.output_len() as u64;
        }
        shape
    }

    /// Whether a dimension is transformed.
    pub fn transforms(&self, axis: usize) -> bool {
        self.axes.iter().any(|(a, _)| *a == axis)
    }

    /// Whether the output is real (an inverse with a real dimension).
    pub fn real_output(&self) -> bool {
        self.options.inverse && self.options.real_dim.is_some()
    }

    /// Transforms a block of shape `shape` (whole along every transformed
    /// dimension) with `kernel`.
    pub fn apply<T: FftNum + Float + Default>(
        &self,
        kernel: &dyn FftKernel<T>,
        mut values: BlockValues<T>,
        shape: &[usize],
    ) -> Result<(BlockValues<T>, Vec<usize>), String> {
        if let Some(detrend) = self.options.detrend {
            let axes: Vec<usize> = self.axes.iter().map(|(a, _)| *a).collect();
            detrend_block(&mut values, shape, &axes, detrend);
        }
        let passes: Vec<_> = self.axes.iter().map(|(a, t)| t.pass::<T>(*a)).collect();
        kernel.transform(values, shape, &passes)
    }
}

//! Typed cell values of a decoded block, and cutting windows out of them.
//!
//! Floating-point variables carry `NaN` where a value is missing (the fill
//! value, as xarray shows it); integer variables keep their stored value,
//! so select windows with `valid` when they have missing values.

use std::ops::Range;

use datafusion::arrow::array::{Array, ArrayRef, AsArray};
use datafusion::arrow::buffer::BooleanBuffer;
use datafusion::arrow::datatypes::{
    ArrowPrimitiveType, DataType, Float32Type, Float64Type, Int16Type, Int32Type, Int64Type,
    Int8Type, UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};

/// A column of cells of one numeric type.
#[derive(Debug, Clone, PartialEq)]
pub enum Values {
    /// `float32`
    F32(Vec<f32>),
    /// `float64`
    F64(Vec<f64>),
    /// `int8`
    I8(Vec<i8>),
    /// `int16`
    I16(Vec<i16>),
    /// `int32`
    I32(Vec<i32>),
    /// `int64`
    I64(Vec<i64>),
    /// `uint8`
    U8(Vec<u8>),
    /// `uint16`
    U16(Vec<u16>),
    /// `uint32`
    U32(Vec<u32>),
    /// `uint64`
    U64(Vec<u64>),
}

/// Applies `$body` to the vector inside any variant, bound as `$v`.
macro_rules! each_variant {
    ($values:expr, $v:ident => $body:expr) => {
        match $values {
            Values::F32($v) => $body,
            Values::F64($v) => $body,
            Values::I8($v) => $body,
            Values::I16($v) => $body,
            Values::I32($v) => $body,
            Values::I64($v) => $body,
            Values::U8($v) => $body,
            Values::U16($v) => $body,
            Values::U32($v) => $body,
            Values::U64($v) => $body,
        }
    };
}

/// Whether the loader can cut windows of a variable of this type.
pub fn is_supported(data_type: &DataType) -> bool {
    (data_type.is_floating() && *data_type != DataType::Float16) || data_type.is_integer()
}

fn primitive<T: ArrowPrimitiveType>(array: &ArrayRef) -> Vec<T::Native> {
    array.as_primitive::<T>().values().to_vec()
}

fn float<T: ArrowPrimitiveType>(array: &ArrayRef, nan: T::Native) -> Vec<T::Native> {
    let mut values = primitive::<T>(array);
    if let Some(nulls) = array.nulls().filter(|n| n.null_count() > 0) {
        for i in nulls.iter().enumerate().filter(|(_, v)| !v).map(|(i, _)| i) {
            values[i] = nan;
        }
    }
    values
}

impl Values {
    /// Takes the values of a decoded column (missing floats become `NaN`).
    /// `None` for types windows do not support.
    pub fn from_array(array: &ArrayRef) -> Option<Self> {
        Some(match array.data_type() {
            DataType::Float32 => Self::F32(float::<Float32Type>(array, f32::NAN)),
            DataType::Float64 => Self::F64(float::<Float64Type>(array, f64::NAN)),
            DataType::Int8 => Self::I8(primitive::<Int8Type>(array)),
            DataType::Int16 => Self::I16(primitive::<Int16Type>(array)),
            DataType::Int32 => Self::I32(primitive::<Int32Type>(array)),
            DataType::Int64 => Self::I64(primitive::<Int64Type>(array)),
            DataType::UInt8 => Self::U8(primitive::<UInt8Type>(array)),
            DataType::UInt16 => Self::U16(primitive::<UInt16Type>(array)),
            DataType::UInt32 => Self::U32(primitive::<UInt32Type>(array)),
            DataType::UInt64 => Self::U64(primitive::<UInt64Type>(array)),
            _ => return None,
        })
    }

    /// An empty column of the same type with room for `capacity` values.
    pub fn empty_like(&self, capacity: usize) -> Self {
        match self {
            Self::F32(_) => Self::F32(Vec::with_capacity(capacity)),
            Self::F64(_) => Self::F64(Vec::with_capacity(capacity)),
            Self::I8(_) => Self::I8(Vec::with_capacity(capacity)),
            Self::I16(_) => Self::I16(Vec::with_capacity(capacity)),
            Self::I32(_) => Self::I32(Vec::with_capacity(capacity)),
            Self::I64(_) => Self::I64(Vec::with_capacity(capacity)),
            Self::U8(_) => Self::U8(Vec::with_capacity(capacity)),
            Self::U16(_) => Self::U16(Vec::with_capacity(capacity)),
            Self::U32(_) => Self::U32(Vec::with_capacity(capacity)),
            Self::U64(_) => Self::U64(Vec::with_capacity(capacity)),
        }
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        each_variant!(self, v => v.len())
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes per value.
    pub fn element_size(&self) -> usize {
        each_variant!(self, v => element_size_of(v))
    }

    /// Appends the cells of `window` (a box inside `extent`, the box these
    /// values cover, in C order) to `out`, which must be of the same type.
    pub fn append_window(&self, extent: &[Range<u64>], window: &[Range<u64>], out: &mut Values) {
        macro_rules! copy {
            ($($variant:ident),*) => {
                match (self, out) {
                    $((Self::$variant(src), Self::$variant(dst)) => copy_box(src, extent, window, dst),)*
                    _ => unreachable!("windows are appended to a column of their own type"),
                }
            };
        }
        copy!(F32, F64, I8, I16, I32, I64, U8, U16, U32, U64)
    }

    /// Appends the cells of `window` (a box inside `extent`) to `out` as
    /// `float32`, scaled by `scale` when given.
    // `as f32` converts every type but float32 itself (one body for all).
    #[allow(clippy::unnecessary_cast)]
    pub fn append_window_f32(
        &self,
        extent: &[Range<u64>],
        window: &[Range<u64>],
        scale: Option<Scale>,
        out: &mut Vec<f32>,
    ) {
        let (offset, factor) = scale.map_or((0.0, 1.0), Scale::coefficients);
        let plain = scale.is_none();
        each_variant!(self, src => for_each_run(extent, window, |start, run| {
            let cells = src[start..start + run].iter();
            if plain {
                out.extend(cells.map(|&x| x as f32));
            } else {
                out.extend(cells.map(|&x| (x as f32 - offset) * factor));
            }
        }))
    }
}

fn element_size_of<T>(_: &[T]) -> usize {
    std::mem::size_of::<T>()
}

/// Copies the box `window` of `src` (which covers `extent` in C order) to the
/// end of `dst`, one contiguous run of the innermost dimensions at a time.
pub fn copy_box<T: Copy>(
    src: &[T],
    extent: &[Range<u64>],
    window: &[Range<u64>],
    dst: &mut Vec<T>,
) {
    for_each_run(extent, window, |start, run| {
        dst.extend_from_slice(&src[start..start + run]);
    });
}

/// Calls `f(start, len)` for each contiguous run of the box `window` in a
/// C-order box covering `extent`, in order (the innermost dimensions the
/// window spans whole make one run).
pub fn for_each_run(extent: &[Range<u64>], window: &[Range<u64>], mut f: impl FnMut(usize, usize)) {
    let rank = extent.len();
    let shape: Vec<usize> = extent.iter().map(|r| (r.end - r.start) as usize).collect();
    let mut strides = vec![1usize; rank];
    for d in (0..rank.saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    let mut inner = rank;
    let mut run = 1usize;
    while inner > 0 {
        let d = inner - 1;
        let len = (window[d].end - window[d].start) as usize;
        run *= len;
        inner -= 1;
        if len != shape[d] {
            break;
        }
    }
    if run == 0 {
        return;
    }
    let offset = |index: &[u64]| -> usize {
        (0..rank)
            .map(|d| (index[d] - extent[d].start) as usize * strides[d])
            .sum()
    };
    let mut index: Vec<u64> = window.iter().map(|r| r.start).collect();
    loop {
        f(offset(&index), run);
        // Advance the outer dimensions (those before `inner`), last fastest.
        let mut d = inner;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            index[d] += 1;
            if index[d] < window[d].end {
                break;
            }
            index[d] = window[d].start;
        }
    }
}

/// Missing cells (unset bits of `validity`, the Arrow validity of a
/// column covering `extent`) in the box `window`.
pub fn count_missing_in(
    validity: &BooleanBuffer,
    extent: &[Range<u64>],
    window: &[Range<u64>],
) -> u64 {
    let mut missing = 0u64;
    for_each_run(extent, window, |start, run| {
        missing += (run - validity.slice(start, run).count_set_bits()) as u64;
    });
    missing
}

/// Adds one to `missing` at every unset bit of `validity` (an Arrow null
/// buffer), 64 cells at a time.
pub fn count_missing(validity: &BooleanBuffer, missing: &mut [u32]) {
    let chunks = validity.bit_chunks();
    let mut cell = 0usize;
    for word in chunks.iter() {
        let mut unset = !word;
        while unset != 0 {
            missing[cell + unset.trailing_zeros() as usize] += 1;
            unset &= unset - 1;
        }
        cell += 64;
    }
    let mut unset = !chunks.remainder_bits() & ((1u64 << chunks.remainder_len()) - 1);
    while unset != 0 {
        missing[cell + unset.trailing_zeros() as usize] += 1;
        unset &= unset - 1;
    }
}

/// `(x - mean) / std` for each value, as `float32`; a channel with no
/// spread (`std` 0) is only centered.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scale {
    /// Subtracted from each value.
    pub mean: f64,
    /// Divides the centered value.
    pub std: f64,
}

impl Scale {
    /// `(offset, factor)` in `float32`: `(x - offset) * factor`.
    fn coefficients(self) -> (f32, f32) {
        let factor = if self.std > 0.0 && self.std.is_finite() {
            (1.0 / self.std) as f32
        } else {
            1.0
        };
        (self.mean as f32, factor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_box_matches_naive_indexing() {
        // A 4 x 5 x 6 extent starting at (10, 20, 30).
        let extent = [10..14, 20..25, 30..36];
        let src: Vec<u32> = (0..120).collect();
        let naive = |w: &[Range<u64>]| {
            let mut out = Vec::new();
            for i in w[0].clone() {
                for j in w[1].clone() {
                    for k in w[2].clone() {
                        out.push(((i - 10) * 30 + (j - 20) * 6 + (k - 30)) as u32);
                    }
                }
            }
            out
        };
        for window in [
            vec![11..12, 21..24, 31..34],
            vec![10..14, 20..25, 30..36],
            vec![12..13, 20..25, 30..36],
            vec![10..14, 22..23, 33..34],
            vec![13..14, 24..25, 35..36],
        ] {
            let mut dst = Vec::new();
            copy_box(&src, &extent, &window, &mut dst);
            assert_eq!(dst, naive(&window), "{window:?}");
        }
    }

    #[test]
    fn missing_floats_become_nan() {
        use datafusion::arrow::array::Float32Array;
        use std::sync::Arc;
        let array: ArrayRef = Arc::new(Float32Array::from(vec![Some(1.0), None, Some(3.0)]));
        let Some(Values::F32(v)) = Values::from_array(&array) else {
            panic!("float32 expected")
        };
        assert_eq!(v[0], 1.0);
        assert!(v[1].is_nan());
        assert_eq!(v[2], 3.0);
    }
}

//! Coordinate arrays held as their formula.
//!
//! Most coordinate arrays are regular: `numpy.arange`, `numpy.linspace`,
//! `pandas.date_range` and ERA5's grids all store `first + position ×
//! step`. Such an array is read once, chunk by chunk, when its store is
//! opened, each value checked against the formula bit for bit, and then
//! held as the formula: a 2^26-long float64 time axis costs a few bytes
//! instead of 512 MB outside any memory budget. The few values that differ
//! from the formula by rounding (`linspace` sets its last value to `stop`)
//! are kept beside it as exceptions; an array with more than one exception
//! in 64 positions, or with NULLs, is held as values instead.
//!
//! Integers, times, dates and durations are checked with exact integer
//! arithmetic; float64 and float32 arrays against `first + position ×
//! step` computed in float64 (and rounded to float32), with the step taken
//! either as the difference of the first two values (what `arange` uses)
//! or as the span over the number of steps (what `linspace` uses).

use std::sync::Arc;

use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, BooleanArray, Float32Array, Float64Array, Int64Array,
};
use datafusion::arrow::compute::kernels::cmp::eq;
use datafusion::arrow::compute::{can_cast_types, cast, concat, interleave};
use datafusion::arrow::datatypes::{DataType, Float64Type, Int64Type};
use datafusion::arrow::error::ArrowError;

/// Positions made at a time by whoever goes through a whole coordinate
/// (order checks, comparisons, filters): 512 KB of float64.
pub const PIECE: u64 = 1 << 16;

/// The arithmetic a regular coordinate's values follow.
#[derive(Debug, Clone, Copy)]
enum Formula {
    /// `first + position × step` in `i64` (integers, times, dates,
    /// durations: their stored integers).
    Integer { first: i64, step: i64 },
    /// `first + position × step` in `f64`.
    Real { first: f64, step: f64 },
}

impl Formula {
    /// The formula's values at `positions`, of `data_type`: made in that
    /// type for floats (float32 rounded from float64, as a cast would),
    /// else as `Int64` and cast.
    fn values(
        &self,
        positions: impl Iterator<Item = u64>,
        data_type: &DataType,
    ) -> Result<ArrayRef, ArrowError> {
        match (*self, data_type) {
            (Self::Integer { first, step }, _) => cast(
                &Int64Array::from_iter_values(
                    positions.map(|p| first.wrapping_add((p as i64).wrapping_mul(step))),
                ),
                data_type,
            ),
            (Self::Real { first, step }, DataType::Float32) => Ok(Arc::new(
                Float32Array::from_iter_values(positions.map(|p| (first + p as f64 * step) as f32)),
            )),
            (Self::Real { first, step }, _) => cast(
                &Float64Array::from_iter_values(positions.map(|p| first + p as f64 * step)),
                data_type,
            ),
        }
    }
}

/// Formulas are the same when they give the same bits (`-0.0` is not
/// `0.0` here).
impl PartialEq for Formula {
    fn eq(&self, other: &Self) -> bool {
        match (*self, *other) {
            (Self::Integer { first: a, step: s }, Self::Integer { first: b, step: t }) => {
                a == b && s == t
            }
            (Self::Real { first: a, step: s }, Self::Real { first: b, step: t }) => {
                a.to_bits() == b.to_bits() && s.to_bits() == t.to_bits()
            }
            _ => false,
        }
    }
}

/// The number class a coordinate type is checked in, when it is regular
/// at all.
fn arithmetic(data_type: &DataType) -> Option<DataType> {
    let class = match data_type {
        DataType::Float32 | DataType::Float64 => DataType::Float64,
        t if t.is_integer() => DataType::Int64,
        DataType::Timestamp(_, _) | DataType::Date32 | DataType::Date64 | DataType::Duration(_) => {
            DataType::Int64
        }
        _ => return None,
    };
    (can_cast_types(data_type, &class) && can_cast_types(&class, data_type)).then_some(class)
}

/// A coordinate array held as its formula plus the positions where the
/// stored value differs from it (see the module docs).
#[derive(Debug)]
pub struct RegularCoordinate {
    data_type: DataType,
    len: u64,
    formula: Formula,
    /// Positions whose stored value is not the formula's, increasing.
    exception_positions: Vec<u64>,
    /// The stored values at those positions, of `data_type`.
    exception_values: ArrayRef,
    /// Those values as numbers (see [`RegularCoordinate::number_at`]).
    exception_numbers: Vec<f64>,
}

impl RegularCoordinate {
    /// The number of positions.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether there are no positions.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The values' type, the stored array's.
    pub fn data_type(&self) -> &DataType {
        &self.data_type
    }

    /// How many stored values differ from the formula.
    pub fn exceptions(&self) -> usize {
        self.exception_positions.len()
    }

    /// The step between neighbouring values, when they are integers (or
    /// times, dates, durations: their stored counts) that all follow the
    /// formula.
    pub fn integer_step(&self) -> Option<i64> {
        match self.formula {
            Formula::Integer { step, .. } if self.exception_positions.is_empty() => Some(step),
            _ => None,
        }
    }

    /// The stored value at `position` as a number: an integer's, a
    /// time's or date's stored count, a float's value.
    pub fn number_at(&self, position: u64) -> f64 {
        if let Ok(k) = self.exception_positions.binary_search(&position) {
            return self.exception_numbers[k];
        }
        match self.formula {
            Formula::Integer { first, step } => {
                first.wrapping_add((position as i64).wrapping_mul(step)) as f64
            }
            Formula::Real { first, step } => match self.data_type {
                DataType::Float32 => (first + position as f64 * step) as f32 as f64,
                _ => first + position as f64 * step,
            },
        }
    }

    /// The values at `positions` (each below [`RegularCoordinate::len`]).
    pub fn take(
        &self,
        positions: impl ExactSizeIterator<Item = u64> + Clone,
    ) -> Result<ArrayRef, ArrowError> {
        let values = self.formula.values(positions.clone(), &self.data_type)?;
        if self.exception_positions.is_empty() {
            return Ok(values);
        }
        let exception = |position: &u64| self.exception_positions.binary_search(position).ok();
        if !positions.clone().any(|p| exception(&p).is_some()) {
            return Ok(values);
        }
        let picks: Vec<(usize, usize)> = positions
            .enumerate()
            .map(|(row, position)| match exception(&position) {
                Some(k) => (1, k),
                None => (0, row),
            })
            .collect();
        interleave(&[values.as_ref(), self.exception_values.as_ref()], &picks)
    }

    /// The `len` values from position `offset` on.
    pub fn slice(&self, offset: u64, len: u64) -> Result<ArrayRef, ArrowError> {
        let values = self.formula.values(offset..offset + len, &self.data_type)?;
        let from = self.exception_positions.partition_point(|&p| p < offset);
        let to = self
            .exception_positions
            .partition_point(|&p| p < offset + len);
        if from == to {
            return Ok(values);
        }
        let mut picks: Vec<(usize, usize)> = (0..len as usize).map(|row| (0, row)).collect();
        for k in from..to {
            picks[(self.exception_positions[k] - offset) as usize] = (1, k);
        }
        interleave(&[values.as_ref(), self.exception_values.as_ref()], &picks)
    }

    /// Whether `other` holds the same values by the same formula.
    pub(crate) fn same_formula(&self, other: &Self) -> bool {
        self.data_type == other.data_type
            && self.len == other.len
            && self.formula == other.formula
            && self.exception_positions == other.exception_positions
            && self.exception_values.to_data() == other.exception_values.to_data()
    }

    /// Whether the values never turn back (rise, fall or repeat): no
    /// exceptions, and a formula that stays within its type (an integer
    /// formula that does not overflow; a real one whose last value is
    /// finite: rounding repeats values but never reverses them).
    pub(crate) fn monotone(&self) -> bool {
        self.exception_positions.is_empty()
            && match self.formula {
                Formula::Integer { step, .. } => step == 0 || self.formula_order().is_some(),
                Formula::Real { first, step } => {
                    (first + (self.len.max(1) - 1) as f64 * step).is_finite()
                }
            }
    }

    /// The order of the values when the formula alone tells it: integer
    /// formulas without exceptions that do not overflow strictly increase
    /// (`Some(false)`) or decrease (`Some(true)`) with a nonzero step.
    /// `None` when the values must be compared (floats can repeat when the
    /// step is small beside the first value).
    pub(crate) fn formula_order(&self) -> Option<bool> {
        let Formula::Integer { first, step } = self.formula else {
            return None;
        };
        let last = first as i128 + (self.len.max(1) as i128 - 1) * step as i128;
        (self.exception_positions.is_empty() && step != 0 && i64::try_from(last).is_ok())
            .then_some(step < 0)
    }
}

/// A candidate formula and the values that differ from it so far.
#[derive(Debug)]
struct Candidate {
    formula: Formula,
    positions: Vec<u64>,
    values: Vec<ArrayRef>,
}

/// Checks a coordinate array, read in pieces from its start, against the
/// formulas its first values suggest (see the module docs).
#[derive(Debug)]
pub(crate) struct RegularCoordinateCheck {
    data_type: DataType,
    len: u64,
    /// Exceptions allowed.
    most: usize,
    candidates: Vec<Candidate>,
    checked: u64,
}

impl RegularCoordinateCheck {
    /// The check of an array of `len` values that begins with `head` (at
    /// least two values) and ends with `last` (one value); `None` when its
    /// type is not one a formula is kept for.
    pub(crate) fn new(head: &ArrayRef, last: &ArrayRef, len: u64) -> Option<Self> {
        let data_type = head.data_type().clone();
        let class = arithmetic(&data_type)?;
        if head.len() < 2 || last.len() != 1 || head.null_count() + last.null_count() > 0 {
            return None;
        }
        let ends = concat(&[&head.slice(0, 2), last.as_ref()]).ok()?;
        let ends = cast(&ends, &class).ok()?;
        if ends.null_count() > 0 {
            return None;
        }
        let formulas = match class {
            DataType::Int64 => {
                let v = ends.as_primitive::<Int64Type>();
                vec![Formula::Integer {
                    first: v.value(0),
                    step: v.value(1).checked_sub(v.value(0))?,
                }]
            }
            _ => {
                let v = ends.as_primitive::<Float64Type>();
                let (first, second, last) = (v.value(0), v.value(1), v.value(2));
                let arange = second - first;
                let linspace = (last - first) / (len - 1) as f64;
                let mut formulas = vec![Formula::Real {
                    first,
                    step: arange,
                }];
                if linspace.to_bits() != arange.to_bits() {
                    formulas.push(Formula::Real {
                        first,
                        step: linspace,
                    });
                }
                formulas
            }
        };
        Some(Self {
            data_type,
            len,
            most: (len / 64) as usize,
            candidates: formulas
                .into_iter()
                .map(|formula| Candidate {
                    formula,
                    positions: Vec::new(),
                    values: Vec::new(),
                })
                .collect(),
            checked: 0,
        })
    }

    /// Checks the next piece of values (they continue the ones checked);
    /// `false` once no formula holds, when the array is to be held as
    /// values.
    pub(crate) fn check(&mut self, values: &ArrayRef) -> bool {
        if values.data_type() != &self.data_type || values.null_count() > 0 {
            self.candidates.clear();
            return false;
        }
        // In small pieces, so the formula's values made to compare with
        // cost little beside the values read.
        let n = values.len();
        let mut start = 0;
        while start < n && !self.candidates.is_empty() {
            let len = (PIECE as usize).min(n - start);
            self.check_piece(&values.slice(start, len));
            start += len;
        }
        if start < n {
            self.checked += (n - start) as u64;
        }
        !self.candidates.is_empty()
    }

    /// [`RegularCoordinateCheck::check`] of one small piece.
    fn check_piece(&mut self, values: &ArrayRef) {
        let offset = self.checked;
        let n = values.len() as u64;
        self.checked += n;
        let most = self.most;
        self.candidates.retain_mut(|candidate| {
            let Ok(formula) = candidate
                .formula
                .values(offset..offset + n, values.data_type())
            else {
                return false;
            };
            let Ok(same) = eq(&formula, values) else {
                return false;
            };
            let differ: Vec<u64> = differing(&same).collect();
            if candidate.positions.len() + differ.len() > most {
                return false;
            }
            if !differ.is_empty() {
                let rows = Int64Array::from_iter_values(differ.iter().map(|&p| p as i64));
                let Ok(kept) = datafusion::arrow::compute::take(values, &rows, None) else {
                    return false;
                };
                candidate.values.push(kept);
                candidate
                    .positions
                    .extend(differ.iter().map(|&p| offset + p));
            }
            true
        });
    }

    /// The coordinate, once every value is checked: the candidate with the
    /// fewest exceptions; `None` when none holds or values are missing.
    pub(crate) fn finish(self) -> Option<RegularCoordinate> {
        if self.checked != self.len {
            return None;
        }
        let best = self
            .candidates
            .into_iter()
            .min_by_key(|c| c.positions.len())?;
        let parts: Vec<&dyn Array> = best.values.iter().map(|v| v.as_ref()).collect();
        let exception_values = if parts.is_empty() {
            datafusion::arrow::array::new_empty_array(&self.data_type)
        } else {
            concat(&parts).ok()?
        };
        let class = arithmetic(&self.data_type)?;
        let numbers = cast(&cast(&exception_values, &class).ok()?, &DataType::Float64).ok()?;
        let exception_numbers = numbers.as_primitive::<Float64Type>().values().to_vec();
        Some(RegularCoordinate {
            exception_numbers,
            data_type: self.data_type,
            len: self.len,
            formula: best.formula,
            exception_positions: best.positions,
            exception_values,
        })
    }
}

/// The rows of `same` that are not `true`.
fn differing(same: &BooleanArray) -> impl Iterator<Item = u64> + '_ {
    (0..same.len())
        .filter(move |&i| !(same.is_valid(i) && same.value(i)))
        .map(|i| i as u64)
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::array::{Int32Array, TimestampNanosecondArray, UInt64Array};
    use datafusion::arrow::compute::take;

    use super::*;
    use crate::table::Coordinate;

    /// The check of `values` read in pieces of `piece`.
    fn checked(values: &ArrayRef, piece: usize) -> Option<RegularCoordinate> {
        let n = values.len();
        let mut check = RegularCoordinateCheck::new(
            &values.slice(0, piece.min(n)),
            &values.slice(n - 1, 1),
            n as u64,
        )?;
        for start in (0..n).step_by(piece) {
            if !check.check(&values.slice(start, piece.min(n - start))) {
                return None;
            }
        }
        check.finish()
    }

    /// Asserts that `regular` gives back `values` bit for bit, whole, in
    /// slices, at scattered positions and as numbers.
    fn gives_back(regular: &RegularCoordinate, values: &ArrayRef) {
        let n = values.len() as u64;
        assert_eq!(regular.len(), n);
        assert_eq!(regular.slice(0, n).unwrap().to_data(), values.to_data());
        assert_eq!(
            regular.slice(n / 3, n / 2).unwrap().to_data(),
            values.slice(n as usize / 3, n as usize / 2).to_data()
        );
        let positions: Vec<u64> = (0..n).rev().step_by(7).chain([n - 1, 0, n - 1]).collect();
        assert_eq!(
            regular.take(positions.iter().copied()).unwrap().to_data(),
            take(values, &UInt64Array::from(positions.clone()), None)
                .unwrap()
                .to_data()
        );
        let class = arithmetic(values.data_type()).unwrap();
        let numbers = cast(&cast(values, &class).unwrap(), &DataType::Float64).unwrap();
        let numbers = numbers.as_primitive::<Float64Type>();
        for p in positions {
            assert_eq!(
                regular.number_at(p).to_bits(),
                numbers.value(p as usize).to_bits()
            );
        }
    }

    #[test]
    fn numpy_style_grids_are_held_as_formulas_and_give_back_every_bit() {
        let n = 10_007usize;
        // numpy.arange(-3.7, ..., 0.1): first + i × (second - first).
        let delta = (-3.7f64 + 0.1) - -3.7;
        let arange: ArrayRef = Arc::new(Float64Array::from_iter_values(
            (0..n).map(|i| -3.7 + i as f64 * delta),
        ));
        // numpy.linspace(90, -90, n): i × step + start, the last set to stop.
        let step = -180.0 / (n - 1) as f64;
        let mut linspace: Vec<f64> = (0..n).map(|i| i as f64 * step + 90.0).collect();
        linspace[n - 1] = -90.0;
        let linspace: ArrayRef = Arc::new(Float64Array::from(linspace));
        // float32 ERA5-like latitudes, hourly times, integer levels.
        let lat32: ArrayRef = Arc::new(Float32Array::from_iter_values(
            (0..721).map(|i| 90.0 - 0.25 * i as f32),
        ));
        let hours: ArrayRef = Arc::new(TimestampNanosecondArray::from_iter_values(
            (0..n as i64).map(|i| 1_577_836_800_000_000_000 + i * 3_600_000_000_000),
        ));
        let levels: ArrayRef =
            Arc::new(Int32Array::from_iter_values((0..37).map(|i| 1000 - 25 * i)));
        for (values, piece) in [
            (&arange, 1000),
            (&arange, n),
            (&linspace, 333),
            (&lat32, 100),
            (&hours, 4096),
            (&levels, 5),
        ] {
            let regular = checked(values, piece)
                .unwrap_or_else(|| panic!("{} not held as a formula", values.data_type()));
            assert!(
                regular.exceptions() <= 1,
                "{} exceptions",
                regular.exceptions()
            );
            gives_back(&regular, values);
        }
        let hours = checked(&hours, 4096).unwrap();
        assert_eq!(hours.formula_order(), Some(false));
        assert_eq!(checked(&levels, 37).unwrap().formula_order(), Some(true));
    }

    #[test]
    fn a_few_stray_values_are_exceptions_and_more_are_values() {
        let n = 6400usize;
        let mut values: Vec<f64> = (0..n).map(|i| i as f64 * 0.5).collect();
        values[4000] = f64::NAN;
        values[17] = 8.6;
        let strays: ArrayRef = Arc::new(Float64Array::from(values.clone()));
        let regular = checked(&strays, 1000).expect("two strays in 6400 are exceptions");
        assert_eq!(regular.exceptions(), 2);
        assert_eq!(regular.formula_order(), None);
        gives_back(&regular, &strays);
        // One stray in 64 at most (100 here).
        for i in (0..n).step_by(50) {
            values[i] += 0.25;
        }
        let many: ArrayRef = Arc::new(Float64Array::from(values));
        assert!(checked(&many, 1000).is_none());
        // Irregular from the start; missing values; text.
        let squares: ArrayRef = Arc::new(Int32Array::from_iter_values((0..200).map(|i| i * i)));
        assert!(checked(&squares, 64).is_none());
        let missing: ArrayRef = Arc::new(Int32Array::from(vec![Some(1), Some(2), None, Some(4)]));
        assert!(checked(&missing, 2).is_none());
        let text: ArrayRef = Arc::new(datafusion::arrow::array::StringArray::from(vec!["a", "b"]));
        assert!(checked(&text, 2).is_none());
    }

    #[test]
    fn formulas_are_the_same_only_when_every_bit_is() {
        let real = |first: f64| Formula::Real { first, step: 0.5 };
        assert_eq!(real(0.0), real(0.0));
        assert_ne!(real(0.0), real(-0.0));
        assert_ne!(real(0.0), Formula::Integer { first: 0, step: 1 });
        // A coordinate starting at -0.0 keeps that value as an exception
        // (-0.0 + 0 × 0.5 is 0.0), so it is not the one starting at 0.0.
        let from = |first: f64| -> ArrayRef {
            Arc::new(Float64Array::from_iter_values(
                std::iter::once(first).chain((1..100).map(|i| i as f64 * 0.5)),
            ))
        };
        let coordinate =
            |values: &ArrayRef| Coordinate::Regular(Arc::new(checked(values, 30).unwrap()));
        assert!(coordinate(&from(0.0)).same_values(&coordinate(&from(0.0))));
        assert!(!coordinate(&from(0.0)).same_values(&coordinate(&from(-0.0))));
        assert!(coordinate(&from(-0.0)).same_values(&Coordinate::Values(from(-0.0))));
    }

    #[test]
    fn a_check_that_misses_values_holds_no_formula() {
        let values: ArrayRef = Arc::new(Int32Array::from_iter_values(0..100));
        let mut check =
            RegularCoordinateCheck::new(&values.slice(0, 10), &values.slice(99, 1), 100).unwrap();
        assert!(check.check(&values.slice(0, 50)));
        assert!(check.finish().is_none());
    }
}

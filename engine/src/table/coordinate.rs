//! The values of a dimension column.
//!
//! A dimension's coordinate is either decoded from its coordinate array and
//! held in memory, held as the formula its stored values follow (a regular
//! coordinate array, see [`RegularCoordinate`]), or computed position by
//! position: the index of a dimension without a coordinate array, the
//! frequencies of a transformed dimension. Only the first costs memory
//! beside the rows made from it, so a 1-D signal of 2^30 samples with a
//! regular time axis is registered, transformed and copied without 8 bytes
//! per position held anywhere. Rows take their values with
//! [`Coordinate::take`] or [`Coordinate::slice`]; [`Coordinate::to_array`]
//! makes all of them, for the few callers that need the whole column.

use std::fmt;
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, Float64Array, Int64Array, PrimitiveArray};
use datafusion::arrow::compute::take;

use super::regular::{RegularCoordinate, PIECE};

use datafusion::arrow::datatypes::{ArrowNativeType, ArrowPrimitiveType, DataType};
use datafusion::arrow::error::ArrowError;

/// Numbers computed from the position, as a coordinate.
pub trait CoordinateFormula: fmt::Debug + Send + Sync {
    /// The number of positions.
    fn positions(&self) -> u64;
    /// The value at `position` (below [`CoordinateFormula::positions`]).
    fn value_at(&self, position: u64) -> f64;
}

/// The values of a dimension column (see the module docs).
#[derive(Debug, Clone)]
pub enum Coordinate {
    /// Values decoded from a coordinate array, held in memory.
    Values(ArrayRef),
    /// A coordinate array's values, held as the formula they follow.
    Regular(Arc<RegularCoordinate>),
    /// The index `0..len` (`Int64`) of a dimension without a coordinate
    /// array.
    Index(u64),
    /// `Float64` values computed from the position.
    Computed(Arc<dyn CoordinateFormula>),
}

impl Coordinate {
    /// Positions made at a time by whoever goes through a whole coordinate
    /// (see `PIECE`).
    pub const PIECE: u64 = PIECE;

    /// The number of positions.
    pub fn len(&self) -> u64 {
        match self {
            Self::Values(values) => values.len() as u64,
            Self::Regular(regular) => regular.len(),
            Self::Index(len) => *len,
            Self::Computed(formula) => formula.positions(),
        }
    }

    /// Whether the dimension has no positions.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The column's type.
    pub fn data_type(&self) -> DataType {
        match self {
            Self::Values(values) => values.data_type().clone(),
            Self::Regular(regular) => regular.data_type().clone(),
            Self::Index(_) => DataType::Int64,
            Self::Computed(_) => DataType::Float64,
        }
    }

    /// Whether some value is missing.
    pub fn nullable(&self) -> bool {
        match self {
            Self::Values(values) => values.null_count() > 0,
            Self::Regular(_) | Self::Index(_) | Self::Computed(_) => false,
        }
    }

    /// The values at `positions`.
    pub fn take<I: ArrowPrimitiveType>(
        &self,
        positions: &PrimitiveArray<I>,
    ) -> Result<ArrayRef, ArrowError> {
        let positions_iter = || positions.values().iter().map(|p| p.as_usize() as u64);
        Ok(match self {
            Self::Values(values) => take(values.as_ref(), positions, None)?,
            Self::Regular(regular) => regular.take(positions_iter())?,
            Self::Index(_) => Arc::new(Int64Array::from_iter_values(
                positions_iter().map(|p| p as i64),
            )),
            Self::Computed(formula) => Arc::new(Float64Array::from_iter_values(
                positions_iter().map(|p| formula.value_at(p)),
            )),
        })
    }

    /// The `len` values from position `offset` on.
    pub fn slice(&self, offset: u64, len: u64) -> Result<ArrayRef, ArrowError> {
        Ok(match self {
            Self::Values(values) => values.slice(offset as usize, len as usize),
            Self::Regular(regular) => regular.slice(offset, len)?,
            Self::Index(_) => Arc::new(Int64Array::from_iter_values(
                offset as i64..(offset + len) as i64,
            )),
            Self::Computed(formula) => Arc::new(Float64Array::from_iter_values(
                (offset..offset + len).map(|p| formula.value_at(p)),
            )),
        })
    }

    /// Every value, made now unless held (8 bytes a position for most
    /// types).
    pub fn to_array(&self) -> Result<ArrayRef, ArrowError> {
        self.slice(0, self.len())
    }

    /// The values in pieces of at most `piece` positions, from the first;
    /// each piece is made when the iterator reaches it.
    pub fn pieces(&self, piece: u64) -> impl Iterator<Item = Result<ArrayRef, ArrowError>> + '_ {
        let piece = piece.max(1);
        (0..self.len())
            .step_by(piece as usize)
            .map(move |offset| self.slice(offset, piece.min(self.len() - offset)))
    }

    /// The value at `position` as a number, when it is one (integers and
    /// floats; not times or text).
    pub fn number(&self, position: u64) -> Option<f64> {
        use datafusion::arrow::array::AsArray;
        use datafusion::arrow::compute::cast;
        match self {
            Self::Values(_) | Self::Regular(_) => {
                let one = self.slice(position, 1).ok()?;
                if !one.data_type().is_numeric() || one.null_count() > 0 {
                    return None;
                }
                let number = cast(&one, &DataType::Float64).ok()?;
                Some(
                    number
                        .as_primitive::<datafusion::arrow::datatypes::Float64Type>()
                        .value(0),
                )
            }
            Self::Index(_) => Some(position as f64),
            Self::Computed(formula) => Some(formula.value_at(position)),
        }
    }

    /// Whether the values never turn back along the dimension (they rise,
    /// or fall, or repeat), known without going through them: the index,
    /// and a regular coordinate without exceptions to its formula.
    pub fn monotone(&self) -> bool {
        match self {
            Self::Index(_) => true,
            Self::Regular(regular) => regular.monotone(),
            Self::Values(_) | Self::Computed(_) => false,
        }
    }

    /// Whether the values run from high to low (the first is larger than
    /// the last), as ERA5's latitude does.
    pub fn descends(&self) -> bool {
        let n = self.len();
        if n < 2 {
            return false;
        }
        match self {
            Self::Values(_) | Self::Regular(_) => {
                let end = |position| {
                    self.slice(position, 1).ok().and_then(|one| {
                        datafusion::common::ScalarValue::try_from_array(&one, 0).ok()
                    })
                };
                match (end(0), end(n - 1)) {
                    (Some(first), Some(last)) => first > last,
                    _ => false,
                }
            }
            Self::Index(_) => false,
            Self::Computed(formula) => formula.value_at(0) > formula.value_at(n - 1),
        }
    }

    /// The order of the values along the dimension, when they are strictly
    /// monotonic without NULLs: `Some(false)` ascending, `Some(true)`
    /// descending; `None` for repeated, unordered or NULL values. Rows that
    /// follow the dimension's index order follow this order of its values
    /// too.
    pub fn strict_order(&self) -> Option<bool> {
        let n = self.len();
        if self.nullable() {
            return None;
        }
        if n < 2 {
            return Some(false);
        }
        match self {
            Self::Index(_) => Some(false),
            Self::Regular(regular) => regular.formula_order().or_else(|| self.compared_order()),
            Self::Values(_) => self.compared_order(),
            Self::Computed(formula) => {
                let steps = || (1..n).map(|p| (formula.value_at(p - 1), formula.value_at(p)));
                if steps().all(|(a, b)| a < b) {
                    Some(false)
                } else if steps().all(|(a, b)| a > b) {
                    Some(true)
                } else {
                    None
                }
            }
        }
    }

    /// The step between neighbouring values, when they are integers (or
    /// times, dates, durations: their stored counts) that each follow the
    /// one before by that step (an index's: 1).
    pub fn integer_step(&self) -> Option<i64> {
        match self {
            Self::Regular(regular) => regular.integer_step(),
            Self::Index(_) => Some(1),
            _ => None,
        }
    }

    /// [`Coordinate::strict_order`] when, besides, no value is NaN (looked
    /// for a piece of values at a time): every value is distinct and
    /// comparable, so each matches once and sorting by the coordinate
    /// follows the index (`Some(false)`) or runs against it (`Some(true)`).
    pub fn distinct_order(&self) -> Option<bool> {
        use datafusion::arrow::array::AsArray;
        use datafusion::arrow::datatypes::{Float32Type, Float64Type};
        let has_nan = |values: &ArrayRef| match values.data_type() {
            DataType::Float32 => values
                .as_primitive::<Float32Type>()
                .values()
                .iter()
                .any(|v| v.is_nan()),
            DataType::Float64 => values
                .as_primitive::<Float64Type>()
                .values()
                .iter()
                .any(|v| v.is_nan()),
            _ => false,
        };
        let order = self.strict_order()?;
        // Only floats hold NaN: other values are not walked again.
        if !matches!(self.data_type(), DataType::Float32 | DataType::Float64) {
            return Some(order);
        }
        self.pieces(Self::PIECE)
            .all(|piece| piece.is_ok_and(|values| !has_nan(&values)))
            .then_some(order)
    }

    /// [`Coordinate::strict_order`] by comparing each value with the next,
    /// a piece of values at a time (of at least two values).
    fn compared_order(&self) -> Option<bool> {
        use datafusion::arrow::compute::kernels::cmp::{gt, lt};
        let n = self.len();
        let (mut ascending, mut descending) = (true, true);
        let mut offset = 0;
        while offset + 1 < n && (ascending || descending) {
            let len = Self::PIECE.min(n - offset);
            let values = self.slice(offset, len).ok()?;
            let pairs = len as usize - 1;
            let (before, after) = (values.slice(0, pairs), values.slice(1, pairs));
            let all = |holds: Result<datafusion::arrow::array::BooleanArray, _>| {
                holds.is_ok_and(|h| h.true_count() == pairs)
            };
            ascending = ascending && all(lt(&before, &after));
            descending = descending && all(gt(&before, &after));
            offset += len - 1;
        }
        if ascending {
            Some(false)
        } else if descending {
            Some(true)
        } else {
            None
        }
    }

    /// Whether both have the same values, of the same type.
    pub fn same_values(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Index(a), Self::Index(b)) => a == b,
            (Self::Values(a), Self::Values(b)) => {
                a.data_type() == b.data_type() && a.to_data() == b.to_data()
            }
            (Self::Regular(a), Self::Regular(b)) if a.same_formula(b) => true,
            _ => {
                self.len() == other.len()
                    && self.data_type() == other.data_type()
                    && self.pieces(Self::PIECE).zip(other.pieces(Self::PIECE)).all(
                        |pair| match pair {
                            (Ok(a), Ok(b)) => a.to_data() == b.to_data(),
                            _ => false,
                        },
                    )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::array::UInt64Array;

    use super::*;

    #[derive(Debug)]
    struct Halves(u64);

    impl CoordinateFormula for Halves {
        fn positions(&self) -> u64 {
            self.0
        }
        fn value_at(&self, position: u64) -> f64 {
            10.0 - position as f64 / 2.0
        }
    }

    #[test]
    fn computed_coordinates_give_the_values_held_ones_would() {
        let held = Coordinate::Values(Arc::new(Float64Array::from(vec![10.0, 9.5, 9.0, 8.5])));
        let computed = Coordinate::Computed(Arc::new(Halves(4)));
        assert!(held.same_values(&computed));
        let positions = UInt64Array::from(vec![3, 0, 2]);
        assert_eq!(
            held.take(&positions).unwrap().to_data(),
            computed.take(&positions).unwrap().to_data()
        );
        assert_eq!(
            held.slice(1, 2).unwrap().to_data(),
            computed.slice(1, 2).unwrap().to_data()
        );
        assert_eq!(held.strict_order(), Some(true));
        assert_eq!(computed.strict_order(), Some(true));
        assert!(held.descends() && computed.descends());
        assert_eq!(computed.number(3), Some(8.5));
        assert_eq!(held.number(3), Some(8.5));
    }

    #[test]
    fn an_index_is_made_only_for_the_rows_asked() {
        let index = Coordinate::Index(1 << 40);
        assert_eq!(index.len(), 1 << 40);
        assert_eq!(index.data_type(), DataType::Int64);
        let rows = index
            .take(&UInt64Array::from(vec![5, (1 << 40) - 1]))
            .unwrap();
        assert_eq!(
            rows.to_data(),
            Int64Array::from(vec![5, (1 << 40) - 1]).to_data()
        );
        assert_eq!(index.strict_order(), Some(false));
        assert!(!index.descends());
        assert!(!index.same_values(&Coordinate::Index(3)));
    }
}

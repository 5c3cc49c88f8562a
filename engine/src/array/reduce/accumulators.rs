//! Dense accumulators: one slot per group, folded a [`Line`] at a time.
//!
//! Every accumulator keeps plain vectors indexed by group position (no hash
//! table) and follows SQL semantics: NULL arguments are skipped, a group
//! with no non-NULL value gives NULL (`count` gives 0). Numbers are folded
//! in a wide domain (`f64`, `i64` or `u64`, wrapping on integer overflow as
//! DataFusion's `sum` does); `min`/`max` order floats by IEEE total order,
//! as Arrow does. Variances fold shifted sums (the shift is the group's
//! first value, which keeps them accurate far from zero) and merge partial
//! results with Chan's formula.
//!
//! The rows of each group are counted once per reduction (see
//! [`count_rows`]), not once per aggregate: an accumulator records only the
//! rows it skipped because its argument was NULL, and learns the rows
//! counted when it merges and finishes. Arguments without NULLs, the common
//! case, then cost no counting at all.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, Float64Array, PrimitiveArray};
use datafusion::arrow::buffer::{BooleanBuffer, NullBuffer};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{
    ArrowNativeTypeOp, ArrowPrimitiveType, DataType, Float32Type, Float64Type, Int16Type,
    Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};
use datafusion::common::{internal_err, Result};
use datafusion::functions_aggregate::average::Avg;
use datafusion::functions_aggregate::count::Count;
use datafusion::functions_aggregate::min_max::{Max, Min};
use datafusion::functions_aggregate::stddev::{Stddev, StddevPop};
use datafusion::functions_aggregate::sum::Sum;
use datafusion::functions_aggregate::variance::{VariancePopulation, VarianceSample};
use datafusion::logical_expr::AggregateUDF;

use super::groups::Line;
use crate::array::elementwise::PIECE;

/// An aggregate function a dense reduction computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd)]
pub enum ReduceOp {
    /// `count(x)`: non-NULL values (`count(*)`: rows).
    Count,
    /// `sum(x)`.
    Sum,
    /// `avg(x)`.
    Avg,
    /// `min(x)`.
    Min,
    /// `max(x)`.
    Max,
    /// `var(x)`, `var_samp(x)`: sample variance.
    Var,
    /// `var_pop(x)`: population variance.
    VarPop,
    /// `stddev(x)`, `stddev_samp(x)`: sample standard deviation.
    Stddev,
    /// `stddev_pop(x)`: population standard deviation.
    StddevPop,
}

impl ReduceOp {
    /// The SQL name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Count => "count",
            Self::Sum => "sum",
            Self::Avg => "avg",
            Self::Min => "min",
            Self::Max => "max",
            Self::Var => "var",
            Self::VarPop => "var_pop",
            Self::Stddev => "stddev",
            Self::StddevPop => "stddev_pop",
        }
    }

    /// The operation DataFusion's aggregate function `udf` computes, when
    /// it is one of these (the rolling windows compute some of them too).
    pub fn of_aggregate(udf: &AggregateUDF) -> Option<Self> {
        let function: &dyn Any = udf.inner().as_ref();
        let ops: [(TypeId, Self); 9] = [
            (TypeId::of::<Count>(), Self::Count),
            (TypeId::of::<Sum>(), Self::Sum),
            (TypeId::of::<Avg>(), Self::Avg),
            (TypeId::of::<Min>(), Self::Min),
            (TypeId::of::<Max>(), Self::Max),
            (TypeId::of::<VarianceSample>(), Self::Var),
            (TypeId::of::<VariancePopulation>(), Self::VarPop),
            (TypeId::of::<Stddev>(), Self::Stddev),
            (TypeId::of::<StddevPop>(), Self::StddevPop),
        ];
        let id = Any::type_id(function);
        ops.into_iter().find(|(t, _)| *t == id).map(|(_, op)| op)
    }

    /// The operation named `name` (as [`ReduceOp::name`] gives it).
    pub fn from_name(name: &str) -> Option<Self> {
        [
            Self::Count,
            Self::Sum,
            Self::Avg,
            Self::Min,
            Self::Max,
            Self::Var,
            Self::VarPop,
            Self::Stddev,
            Self::StddevPop,
        ]
        .into_iter()
        .find(|op| op.name() == name)
    }

    /// The types of the columns of [`DenseAccumulator::state`] for an
    /// aggregate giving `output`: those of DataFusion's own function's
    /// state (`count`: the count; `sum`, `min`, `max`: the value; `avg`:
    /// count and sum; variances and deviations: count, mean and the sum of
    /// squared deviations).
    pub fn state_types(self, output: &DataType) -> Vec<DataType> {
        match self {
            Self::Count => vec![DataType::Int64],
            Self::Sum | Self::Min | Self::Max => vec![output.clone()],
            Self::Avg => vec![DataType::UInt64, DataType::Float64],
            Self::Var | Self::VarPop | Self::Stddev | Self::StddevPop => {
                vec![DataType::UInt64, DataType::Float64, DataType::Float64]
            }
        }
    }

    /// Bytes of state per group.
    pub fn state_bytes(self) -> usize {
        match self {
            Self::Count => 8,
            Self::Var | Self::VarPop | Self::Stddev | Self::StddevPop => 32,
            _ => 16,
        }
    }

    /// An accumulator over `groups` groups for an argument of type `arg`
    /// giving `output`, or `None` when this combination is not supported
    /// (the query then keeps DataFusion's hash aggregation).
    pub fn accumulator(
        self,
        arg: &DataType,
        output: &DataType,
        groups: usize,
    ) -> Option<Box<dyn DenseAccumulator>> {
        let domain = numeric_domain(arg);
        Some(match (self, output) {
            (Self::Count, DataType::Int64) => Box::new(CountAccumulator::new(groups)),
            (Self::Sum, DataType::Float64) if domain.is_some() => {
                Box::new(Folded(SumFold::<Float64Type>::new(groups)))
            }
            (Self::Sum, DataType::Int64) if domain == Some(DataType::Int64) => {
                Box::new(Folded(SumFold::<Int64Type>::new(groups)))
            }
            (Self::Sum, DataType::UInt64) if domain == Some(DataType::UInt64) => {
                Box::new(Folded(SumFold::<UInt64Type>::new(groups)))
            }
            (Self::Avg, DataType::Float64) if domain.is_some() => {
                Box::new(Folded(MeanFold::new(groups)))
            }
            (Self::Min | Self::Max, output) if output == arg => {
                let max = self == Self::Max;
                match domain? {
                    DataType::Float64 => min_max::<Float64Type>(groups, max, output),
                    DataType::Int64 => min_max::<Int64Type>(groups, max, output),
                    _ => min_max::<UInt64Type>(groups, max, output),
                }
            }
            (Self::Var | Self::VarPop | Self::Stddev | Self::StddevPop, DataType::Float64)
                if domain.is_some() =>
            {
                Box::new(Folded(VarianceFold::new(
                    groups,
                    matches!(self, Self::VarPop | Self::StddevPop),
                    matches!(self, Self::Stddev | Self::StddevPop),
                )))
            }
            _ => return None,
        })
    }
}

/// The wide type numbers of `t` are folded in, if `t` is numeric.
pub fn numeric_domain(t: &DataType) -> Option<DataType> {
    use DataType::*;
    match t {
        Float16 | Float32 | Float64 => Some(Float64),
        Int8 | Int16 | Int32 | Int64 => Some(Int64),
        UInt8 | UInt16 | UInt32 | UInt64 => Some(UInt64),
        _ => None,
    }
}

fn min_max<T: ArrowPrimitiveType<Native: Wide> + Debug>(
    groups: usize,
    max: bool,
    output: &DataType,
) -> Box<dyn DenseAccumulator> {
    let output = output.clone();
    if max {
        Box::new(Folded(MinMaxFold::<T, true>::new(groups, output)))
    } else {
        Box::new(Folded(MinMaxFold::<T, false>::new(groups, output)))
    }
}

/// Per-group state of one aggregate, updated with batches of argument values.
///
/// `rows` arguments are the rows counted into each group (by
/// `count_rows`, with the same lines and mask) for the state they go with.
pub trait DenseAccumulator: Send + Debug {
    /// Folds the rows of `lines`. `values` holds the argument for every row
    /// of the batch (`None`: an argument that is never NULL, as in
    /// `count(*)`); only rows set in `mask` (when given) count, and those
    /// whose argument is NULL are recorded as skipped.
    fn update(
        &mut self,
        values: Option<&ArrayRef>,
        lines: &[Line],
        mask: Option<&BooleanBuffer>,
    ) -> Result<()>;

    /// Folds the rows of `lines`, none masked and no argument NULL, whose
    /// `float64` arguments `eval(row, out)` writes for rows `row..row +
    /// out.len()` (at most `PIECE` at a time), each piece folded before
    /// the next is evaluated. Only accumulators folding in `f64` support it.
    fn update_fused(
        &mut self,
        lines: &[Line],
        eval: &mut dyn FnMut(usize, &mut [f64]),
    ) -> Result<()> {
        let _ = (lines, eval);
        internal_err!("{self:?} does not fold fused arguments")
    }

    /// Adds the state of another accumulator of the same kind and groups;
    /// `rows` were counted for this one, `other_rows` for the other.
    fn merge(
        &mut self,
        other: Box<dyn DenseAccumulator>,
        rows: &[u64],
        other_rows: &[u64],
    ) -> Result<()>;

    /// The result for every group.
    fn finish(&self, rows: &[u64]) -> Result<ArrayRef>;

    /// The partial state of every group, as the columns of DataFusion's
    /// own aggregate function's state (see [`ReduceOp::state_types`]), for
    /// DataFusion's final aggregate to merge (on a cluster).
    fn state(&self, rows: &[u64]) -> Result<Vec<ArrayRef>>;

    /// The accumulator as `Any`, to merge two of the same kind.
    fn into_any(self: Box<Self>) -> Box<dyn Any>;
}

/// Which rows count: the argument's validity and the row mask together.
fn valid_rows(nulls: Option<&NullBuffer>, mask: Option<&BooleanBuffer>) -> Option<BooleanBuffer> {
    match (nulls, mask) {
        (None, None) => None,
        (Some(n), None) => Some(n.inner().clone()),
        (None, Some(m)) => Some(m.clone()),
        (Some(n), Some(m)) => Some(n.inner() & m),
    }
}

/// Adds to `counts` the rows of each group in `lines` (only those set in
/// `valid`, when given).
fn count_rows(counts: &mut [u64], lines: &[Line], valid: Option<&BooleanBuffer>) {
    for line in lines {
        match (valid, line.spread) {
            (None, false) => counts[line.group] += line.len as u64,
            (None, true) => counts[line.group..line.group + line.len]
                .iter_mut()
                .for_each(|c| *c += 1),
            (Some(valid), false) => {
                counts[line.group] += valid.slice(line.offset, line.len).count_set_bits() as u64
            }
            (Some(valid), true) => {
                for i in valid.slice(line.offset, line.len).set_indices() {
                    counts[line.group + i] += 1;
                }
            }
        }
    }
}

/// Spread lines at least this long are counted once per distinct line.
const MIN_DEFERRED_LINE: usize = 64;

/// Distinct lines [`RowCounts`] holds before it adds them up.
const MAX_DEFERRED_LINES: usize = 1 << 12;

/// Rows counted into each group of a partial state.
///
/// The unmasked spread lines of a reduction over outer dimensions repeat
/// (the same groups, once per outer step): rather than adding one to each
/// of a line's groups every time, each distinct line is counted in a small
/// map and added to the groups when the counts are read.
#[derive(Debug)]
pub struct RowCounts {
    counts: Vec<u64>,
    deferred: HashMap<(usize, usize), u64>,
}

impl RowCounts {
    /// No rows in any of `groups` groups.
    pub fn new(groups: usize) -> Self {
        Self {
            counts: vec![0; groups],
            deferred: HashMap::new(),
        }
    }

    /// Counts the rows of `lines` (only those set in `mask`, when given).
    pub fn add(&mut self, lines: &[Line], mask: Option<&BooleanBuffer>) {
        if mask.is_some() {
            return count_rows(&mut self.counts, lines, mask);
        }
        for line in lines {
            if line.spread && line.len >= MIN_DEFERRED_LINE {
                *self.deferred.entry((line.group, line.len)).or_default() += 1;
            } else {
                count_rows(&mut self.counts, std::slice::from_ref(line), None);
            }
        }
        if self.deferred.len() > MAX_DEFERRED_LINES {
            self.settle();
        }
    }

    /// The rows of each group.
    pub fn settled(&mut self) -> &[u64] {
        self.settle();
        &self.counts
    }

    /// Adds the rows of another partial state's groups.
    pub fn add_counts(&mut self, other: &[u64]) {
        for (a, b) in self.counts.iter_mut().zip(other) {
            *a += b;
        }
    }

    fn settle(&mut self) {
        for ((group, len), n) in self.deferred.drain() {
            self.counts[group..group + len]
                .iter_mut()
                .for_each(|c| *c += n);
        }
    }
}

/// Adds to `skipped` the rows of `lines` in `mask` whose argument is NULL
/// (nothing without NULLs).
fn count_skipped(
    skipped: &mut [u64],
    lines: &[Line],
    nulls: Option<&NullBuffer>,
    mask: Option<&BooleanBuffer>,
) {
    let Some(nulls) = nulls.filter(|n| n.null_count() > 0) else {
        return;
    };
    let null_rows = !nulls.inner();
    let null_rows = match mask {
        Some(mask) => &null_rows & mask,
        None => null_rows,
    };
    count_rows(skipped, lines, Some(&null_rows));
}

/// Values folded into group `g`: its rows less those skipped.
fn folded(rows: &[u64], skipped: &[u64], g: usize) -> u64 {
    rows[g] - skipped[g]
}

/// Validity of a result: a group is NULL when no value was folded into it.
fn nulls_where_empty(rows: &[u64], skipped: &[u64]) -> Option<NullBuffer> {
    let validity = NullBuffer::new(BooleanBuffer::from_iter(
        (0..skipped.len()).map(|g| folded(rows, skipped, g) > 0),
    ));
    (validity.null_count() > 0).then_some(validity)
}

/// `count`: only the validity of the argument matters.
#[derive(Debug)]
struct CountAccumulator {
    skipped: Vec<u64>,
}

impl CountAccumulator {
    fn new(groups: usize) -> Self {
        Self {
            skipped: vec![0; groups],
        }
    }
}

impl DenseAccumulator for CountAccumulator {
    fn update(
        &mut self,
        values: Option<&ArrayRef>,
        lines: &[Line],
        mask: Option<&BooleanBuffer>,
    ) -> Result<()> {
        let nulls = values.and_then(|v| v.logical_nulls());
        count_skipped(&mut self.skipped, lines, nulls.as_ref(), mask);
        Ok(())
    }

    fn merge(
        &mut self,
        other: Box<dyn DenseAccumulator>,
        _rows: &[u64],
        _other_rows: &[u64],
    ) -> Result<()> {
        let Ok(other) = other.into_any().downcast::<Self>() else {
            return internal_err!("merging count with another accumulator");
        };
        for (a, b) in self.skipped.iter_mut().zip(&other.skipped) {
            *a += b;
        }
        Ok(())
    }

    fn finish(&self, rows: &[u64]) -> Result<ArrayRef> {
        Ok(Arc::new(PrimitiveArray::<Int64Type>::from_iter_values(
            (0..self.skipped.len()).map(|g| folded(rows, &self.skipped, g) as i64),
        )))
    }

    fn state(&self, rows: &[u64]) -> Result<Vec<ArrayRef>> {
        Ok(vec![self.finish(rows)?])
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

/// A number widened into a fold's domain (`f64`, `i64` or `u64`) with
/// `as`, exactly as Arrow casts between these types. Only conversions into
/// the argument's own domain are ever used; the others exist so that one
/// bound covers every input type.
pub trait WideFrom<S> {
    /// `value as Self`.
    fn wide_from(value: S) -> Self;
}

macro_rules! wide_from {
    ($($wide:ty),*) => {$(
        wide_from!(@ $wide; i8, i16, i32, i64, u8, u16, u32, u64, f32, f64);
    )*};
    (@ $wide:ty; $($narrow:ty),*) => {$(
        impl WideFrom<$narrow> for $wide {
            #[inline(always)]
            fn wide_from(value: $narrow) -> Self {
                value as $wide
            }
        }
    )*};
}
wide_from!(f64, i64, u64);

/// The domain types folds run in.
pub trait Wide:
    ArrowNativeTypeOp
    + WideFrom<i8>
    + WideFrom<i16>
    + WideFrom<i32>
    + WideFrom<i64>
    + WideFrom<u8>
    + WideFrom<u16>
    + WideFrom<u32>
    + WideFrom<u64>
    + WideFrom<f32>
    + WideFrom<f64>
{
}

impl<T> Wide for T where
    T: ArrowNativeTypeOp
        + WideFrom<i8>
        + WideFrom<i16>
        + WideFrom<i32>
        + WideFrom<i64>
        + WideFrom<u8>
        + WideFrom<u16>
        + WideFrom<u32>
        + WideFrom<u64>
        + WideFrom<f32>
        + WideFrom<f64>
{
}

/// The wide native type of a fold.
type WideOf<F> = <<F as Fold>::T as ArrowPrimitiveType>::Native;

/// A fold of numbers, widened into one domain, into per-group state.
trait Fold: Send + Debug + Sized + 'static {
    /// The domain values are folded in.
    type T: ArrowPrimitiveType<Native: Wide>;

    /// Rows of each group skipped so far (their argument was NULL).
    fn skipped(&mut self) -> &mut [u64];

    /// Folds one value into group `g` (without counting it).
    fn fold_one(&mut self, g: usize, v: WideOf<Self>);

    /// Folds a run of values into group `g` (without counting them).
    fn fold_run<S: Copy>(&mut self, g: usize, values: &[S])
    where
        WideOf<Self>: WideFrom<S>,
    {
        for &v in values {
            self.fold_one(g, WideOf::<Self>::wide_from(v));
        }
    }

    /// Folds `values[i]` into group `g + i`, for every `i` (without
    /// counting them).
    fn fold_spread<S: Copy>(&mut self, g: usize, values: &[S])
    where
        WideOf<Self>: WideFrom<S>,
    {
        for (i, &v) in values.iter().enumerate() {
            self.fold_one(g + i, WideOf::<Self>::wide_from(v));
        }
    }

    /// Adds another fold's state (`rows`, `other_rows`: see
    /// [`DenseAccumulator`]).
    fn merge(&mut self, other: &Self, rows: &[u64], other_rows: &[u64]);

    /// The result per group.
    fn finish(&self, rows: &[u64]) -> Result<ArrayRef>;

    /// The partial state per group (see [`DenseAccumulator::state`]).
    fn state(&self, rows: &[u64]) -> Result<Vec<ArrayRef>> {
        Ok(vec![self.finish(rows)?])
    }
}

/// Drives a [`Fold`] over lines of rows.
#[derive(Debug)]
struct Folded<F>(F);

impl<F: Fold> Folded<F> {
    /// Folds values of Arrow type `S`, widening each on the fly.
    fn fold_values<S: ArrowPrimitiveType>(
        &mut self,
        values: &PrimitiveArray<S>,
        lines: &[Line],
        mask: Option<&BooleanBuffer>,
    ) where
        WideOf<F>: WideFrom<S::Native>,
    {
        count_skipped(self.0.skipped(), lines, values.nulls(), mask);
        let valid = valid_rows(values.nulls(), mask);
        let all = values.values();
        let widen = WideOf::<F>::wide_from;
        for line in lines {
            let run = &all[line.offset..line.offset + line.len];
            match (&valid, line.spread) {
                (None, false) => self.0.fold_run(line.group, run),
                (None, true) => self.0.fold_spread(line.group, run),
                (Some(valid), spread) => {
                    for i in valid.slice(line.offset, line.len).set_indices() {
                        let g = if spread { line.group + i } else { line.group };
                        self.0.fold_one(g, widen(run[i]));
                    }
                }
            }
        }
    }
}

impl<F: Fold> DenseAccumulator for Folded<F> {
    fn update_fused(
        &mut self,
        lines: &[Line],
        eval: &mut dyn FnMut(usize, &mut [f64]),
    ) -> Result<()> {
        if F::T::DATA_TYPE != DataType::Float64 {
            return internal_err!("fused float64 arguments folded in {}", F::T::DATA_TYPE);
        }
        let mut piece = [0.0; PIECE];
        for line in lines {
            for start in (0..line.len).step_by(PIECE) {
                let values = &mut piece[..PIECE.min(line.len - start)];
                eval(line.offset + start, values);
                if line.spread {
                    self.0.fold_spread(line.group + start, values);
                } else {
                    self.0.fold_run(line.group, values);
                }
            }
        }
        Ok(())
    }

    fn update(
        &mut self,
        values: Option<&ArrayRef>,
        lines: &[Line],
        mask: Option<&BooleanBuffer>,
    ) -> Result<()> {
        let Some(values) = values else {
            return internal_err!("a dense accumulator needs argument values");
        };
        // Arguments in the fold's domain are widened while folding; anything
        // else (float16, say) is cast to the domain by Arrow first.
        let cast_values;
        let values = if numeric_domain(values.data_type()).as_ref() == Some(&F::T::DATA_TYPE) {
            values
        } else {
            cast_values = cast(values, &F::T::DATA_TYPE)?;
            &cast_values
        };
        macro_rules! fold_as {
            ($t:ty) => {
                self.fold_values(values.as_primitive::<$t>(), lines, mask)
            };
        }
        match values.data_type() {
            DataType::Int8 => fold_as!(Int8Type),
            DataType::Int16 => fold_as!(Int16Type),
            DataType::Int32 => fold_as!(Int32Type),
            DataType::Int64 => fold_as!(Int64Type),
            DataType::UInt8 => fold_as!(UInt8Type),
            DataType::UInt16 => fold_as!(UInt16Type),
            DataType::UInt32 => fold_as!(UInt32Type),
            DataType::UInt64 => fold_as!(UInt64Type),
            DataType::Float32 => fold_as!(Float32Type),
            DataType::Float64 => fold_as!(Float64Type),
            other => return internal_err!("cannot fold values of type {other}"),
        }
        Ok(())
    }

    fn merge(
        &mut self,
        other: Box<dyn DenseAccumulator>,
        rows: &[u64],
        other_rows: &[u64],
    ) -> Result<()> {
        let Ok(other) = other.into_any().downcast::<Self>() else {
            return internal_err!("merging dense accumulators of different kinds");
        };
        self.0.merge(&other.0, rows, other_rows);
        Ok(())
    }

    fn finish(&self, rows: &[u64]) -> Result<ArrayRef> {
        self.0.finish(rows)
    }

    fn state(&self, rows: &[u64]) -> Result<Vec<ArrayRef>> {
        self.0.state(rows)
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

/// Lanes of independent partial sums in a run, so additions pipeline.
const LANES: usize = 8;

/// Sums a run of values widened into `W`, in [`LANES`] partial sums.
fn run_sum<W: Wide + WideFrom<S>, S: Copy>(values: &[S]) -> W {
    let mut lanes = [W::ZERO; LANES];
    let chunks = values.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane = lane.add_wrapping(W::wide_from(v));
        }
    }
    let mut sum = lanes.iter().fold(W::ZERO, |a, &b| a.add_wrapping(b));
    for &v in tail {
        sum = sum.add_wrapping(W::wide_from(v));
    }
    sum
}

/// `sum`, in the argument's wide type.
#[derive(Debug)]
struct SumFold<T: ArrowPrimitiveType> {
    skipped: Vec<u64>,
    sums: Vec<T::Native>,
}

impl<T: ArrowPrimitiveType> SumFold<T> {
    fn new(groups: usize) -> Self {
        Self {
            skipped: vec![0; groups],
            sums: vec![T::Native::ZERO; groups],
        }
    }
}

impl<T: ArrowPrimitiveType<Native: Wide> + Debug> Fold for SumFold<T> {
    type T = T;

    fn skipped(&mut self) -> &mut [u64] {
        &mut self.skipped
    }

    fn fold_one(&mut self, g: usize, v: T::Native) {
        self.sums[g] = self.sums[g].add_wrapping(v);
    }

    fn fold_run<S: Copy>(&mut self, g: usize, values: &[S])
    where
        T::Native: WideFrom<S>,
    {
        self.sums[g] = self.sums[g].add_wrapping(run_sum::<T::Native, S>(values));
    }

    fn fold_spread<S: Copy>(&mut self, g: usize, values: &[S])
    where
        T::Native: WideFrom<S>,
    {
        // Slices rather than indices: no bounds checks, so the loop vectorizes.
        let sums = &mut self.sums[g..g + values.len()];
        for (sum, &v) in sums.iter_mut().zip(values) {
            *sum = sum.add_wrapping(T::Native::wide_from(v));
        }
    }

    fn merge(&mut self, other: &Self, _rows: &[u64], _other_rows: &[u64]) {
        for g in 0..self.sums.len() {
            self.skipped[g] += other.skipped[g];
            self.sums[g] = self.sums[g].add_wrapping(other.sums[g]);
        }
    }

    fn finish(&self, rows: &[u64]) -> Result<ArrayRef> {
        Ok(Arc::new(PrimitiveArray::<T>::new(
            self.sums.clone().into(),
            nulls_where_empty(rows, &self.skipped),
        )))
    }
}

/// `avg`, in `f64`.
#[derive(Debug)]
struct MeanFold {
    sum: SumFold<Float64Type>,
}

impl MeanFold {
    fn new(groups: usize) -> Self {
        Self {
            sum: SumFold::new(groups),
        }
    }
}

impl Fold for MeanFold {
    type T = Float64Type;

    fn skipped(&mut self) -> &mut [u64] {
        &mut self.sum.skipped
    }

    fn fold_one(&mut self, g: usize, v: f64) {
        self.sum.fold_one(g, v);
    }

    fn fold_run<S: Copy>(&mut self, g: usize, values: &[S])
    where
        f64: WideFrom<S>,
    {
        self.sum.fold_run(g, values);
    }

    fn fold_spread<S: Copy>(&mut self, g: usize, values: &[S])
    where
        f64: WideFrom<S>,
    {
        self.sum.fold_spread(g, values);
    }

    fn merge(&mut self, other: &Self, rows: &[u64], other_rows: &[u64]) {
        self.sum.merge(&other.sum, rows, other_rows);
    }

    fn finish(&self, rows: &[u64]) -> Result<ArrayRef> {
        let means = self.sum.sums.iter().enumerate().map(|(g, &s)| {
            match folded(rows, &self.sum.skipped, g) {
                0 => 0.0,
                n => s / n as f64,
            }
        });
        Ok(Arc::new(Float64Array::new(
            means.collect(),
            nulls_where_empty(rows, &self.sum.skipped),
        )))
    }

    /// DataFusion's `avg` state: the values' count and sum, both NULL for a
    /// group without a value (as DataFusion's own partial `avg` gives them:
    /// its merge counts a group with a non-NULL state as one with values,
    /// whose mean would be 0 / 0).
    fn state(&self, rows: &[u64]) -> Result<Vec<ArrayRef>> {
        let counts = (0..self.sum.sums.len()).map(|g| folded(rows, &self.sum.skipped, g));
        let nulls = nulls_where_empty(rows, &self.sum.skipped);
        Ok(vec![
            Arc::new(PrimitiveArray::<UInt64Type>::new(
                counts.collect::<Vec<u64>>().into(),
                nulls.clone(),
            )),
            Arc::new(Float64Array::new(self.sum.sums.clone().into(), nulls)),
        ])
    }
}

/// `min` (`MAX = false`) or `max` (`MAX = true`), in the wide type, cast
/// back to the argument's type at the end.
#[derive(Debug)]
struct MinMaxFold<T: ArrowPrimitiveType, const MAX: bool> {
    skipped: Vec<u64>,
    values: Vec<T::Native>,
    output: DataType,
}

impl<T: ArrowPrimitiveType, const MAX: bool> MinMaxFold<T, MAX> {
    fn new(groups: usize, output: DataType) -> Self {
        Self {
            skipped: vec![0; groups],
            // The identity of the fold: nothing is below (above) it.
            values: vec![
                if MAX {
                    T::Native::MIN_TOTAL_ORDER
                } else {
                    T::Native::MAX_TOTAL_ORDER
                };
                groups
            ],
            output,
        }
    }

    /// Whether `v` replaces the current extreme `current`.
    fn better(v: T::Native, current: T::Native) -> bool {
        if MAX {
            v.is_gt(current)
        } else {
            v.is_lt(current)
        }
    }
}

impl<T: ArrowPrimitiveType<Native: Wide> + Debug, const MAX: bool> Fold for MinMaxFold<T, MAX> {
    type T = T;

    fn skipped(&mut self) -> &mut [u64] {
        &mut self.skipped
    }

    fn fold_one(&mut self, g: usize, v: T::Native) {
        if Self::better(v, self.values[g]) {
            self.values[g] = v;
        }
    }

    fn fold_run<S: Copy>(&mut self, g: usize, values: &[S])
    where
        T::Native: WideFrom<S>,
    {
        let extreme = values.iter().fold(self.values[g], |current, &v| {
            let v = T::Native::wide_from(v);
            if Self::better(v, current) {
                v
            } else {
                current
            }
        });
        self.values[g] = extreme;
    }

    fn merge(&mut self, other: &Self, _rows: &[u64], _other_rows: &[u64]) {
        for g in 0..self.values.len() {
            if Self::better(other.values[g], self.values[g]) {
                self.values[g] = other.values[g];
            }
            self.skipped[g] += other.skipped[g];
        }
    }

    fn finish(&self, rows: &[u64]) -> Result<ArrayRef> {
        let wide: ArrayRef = Arc::new(PrimitiveArray::<T>::new(
            self.values.clone().into(),
            nulls_where_empty(rows, &self.skipped),
        ));
        Ok(cast(&wide, &self.output)?)
    }
}

/// Variance and standard deviation (sample or population), in `f64`.
#[derive(Debug)]
struct VarianceFold {
    skipped: Vec<u64>,
    shift: Vec<f64>,
    s1: Vec<f64>,
    s2: Vec<f64>,
    population: bool,
    sqrt: bool,
}

impl VarianceFold {
    fn new(groups: usize, population: bool, sqrt: bool) -> Self {
        Self {
            skipped: vec![0; groups],
            shift: vec![f64::NAN; groups],
            s1: vec![0.0; groups],
            s2: vec![0.0; groups],
            population,
            sqrt,
        }
    }

    /// Count, mean and sum of squared deviations of group `g`.
    fn moments(&self, g: usize, rows: &[u64]) -> (f64, f64, f64) {
        let n = folded(rows, &self.skipped, g);
        if n == 0 {
            return (0.0, 0.0, 0.0);
        }
        let n = n as f64;
        let mean = self.shift[g] + self.s1[g] / n;
        let m2 = (self.s2[g] - self.s1[g] * self.s1[g] / n).max(0.0);
        (n, mean, m2)
    }
}

impl Fold for VarianceFold {
    type T = Float64Type;

    fn skipped(&mut self) -> &mut [u64] {
        &mut self.skipped
    }

    fn fold_one(&mut self, g: usize, v: f64) {
        if self.shift[g].is_nan() {
            self.shift[g] = v;
        }
        let d = v - self.shift[g];
        self.s1[g] += d;
        self.s2[g] += d * d;
    }

    fn fold_run<S: Copy>(&mut self, g: usize, values: &[S])
    where
        f64: WideFrom<S>,
    {
        let Some(&first) = values.first() else {
            return;
        };
        if self.shift[g].is_nan() {
            self.shift[g] = f64::wide_from(first);
        }
        let shift = self.shift[g];
        let (s1, s2) = values.iter().fold((0.0, 0.0), |(s1, s2), &v| {
            let d = f64::wide_from(v) - shift;
            (s1 + d, s2 + d * d)
        });
        self.s1[g] += s1;
        self.s2[g] += s2;
    }

    fn merge(&mut self, other: &Self, rows: &[u64], other_rows: &[u64]) {
        for g in 0..self.skipped.len() {
            // Both sides' moments first: this side's count changes below.
            if folded(other_rows, &other.skipped, g) > 0 {
                let (na, ma, m2a) = self.moments(g, rows);
                let (nb, mb, m2b) = other.moments(g, other_rows);
                let n = na + nb;
                let delta = mb - ma;
                self.shift[g] = ma + delta * nb / n;
                self.s1[g] = 0.0;
                self.s2[g] = m2a + m2b + delta * delta * na * nb / n;
            }
            self.skipped[g] += other.skipped[g];
        }
    }

    fn finish(&self, rows: &[u64]) -> Result<ArrayRef> {
        let mut valid = Vec::with_capacity(self.skipped.len());
        let values: Vec<f64> = (0..self.skipped.len())
            .map(|g| {
                let (n, _, m2) = self.moments(g, rows);
                let divisor = if self.population { n } else { n - 1.0 };
                let defined = divisor > 0.0 || (self.population && n == 1.0);
                valid.push(defined && n > 0.0);
                if !(defined && n > 0.0) {
                    return 0.0;
                }
                let var = if divisor > 0.0 { m2 / divisor } else { 0.0 };
                if self.sqrt {
                    var.sqrt()
                } else {
                    var
                }
            })
            .collect();
        let nulls = NullBuffer::new(BooleanBuffer::from_iter(valid));
        Ok(Arc::new(Float64Array::new(
            values.into(),
            (nulls.null_count() > 0).then_some(nulls),
        )))
    }

    /// DataFusion's variance state: count, mean and sum of squared
    /// deviations (a group without values: all zero, which it skips).
    fn state(&self, rows: &[u64]) -> Result<Vec<ArrayRef>> {
        let groups = self.skipped.len();
        let moments: Vec<(f64, f64, f64)> = (0..groups).map(|g| self.moments(g, rows)).collect();
        let counts = (0..groups).map(|g| folded(rows, &self.skipped, g));
        Ok(vec![
            Arc::new(PrimitiveArray::<UInt64Type>::from_iter_values(counts)),
            Arc::new(Float64Array::from_iter_values(moments.iter().map(|m| m.1))),
            Arc::new(Float64Array::from_iter_values(moments.iter().map(|m| m.2))),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{Float32Array, Int32Array};

    fn lines(groups: &[usize]) -> Vec<Line> {
        groups
            .iter()
            .enumerate()
            .map(|(i, &g)| Line {
                offset: i,
                len: 1,
                group: g,
                spread: false,
            })
            .collect()
    }

    fn run(op: ReduceOp, values: ArrayRef, groups: &[usize], n: usize) -> ArrayRef {
        let output = match op {
            ReduceOp::Count => DataType::Int64,
            ReduceOp::Min | ReduceOp::Max => values.data_type().clone(),
            ReduceOp::Sum if values.data_type() == &DataType::Int32 => DataType::Int64,
            _ => DataType::Float64,
        };
        // Fold the first half and the second half separately, then merge.
        let half = groups.len() / 2;
        let mut a = op.accumulator(values.data_type(), &output, n).unwrap();
        let mut b = op.accumulator(values.data_type(), &output, n).unwrap();
        let (mut rows_a, mut rows_b) = (vec![0; n], vec![0; n]);
        let (lines_a, lines_b) = (lines(&groups[..half]), lines(&groups[half..]));
        a.update(Some(&values.slice(0, half)), &lines_a, None)
            .unwrap();
        count_rows(&mut rows_a, &lines_a, None);
        b.update(
            Some(&values.slice(half, groups.len() - half)),
            &lines_b,
            None,
        )
        .unwrap();
        count_rows(&mut rows_b, &lines_b, None);
        a.merge(b, &rows_a, &rows_b).unwrap();
        let rows: Vec<u64> = rows_a.iter().zip(&rows_b).map(|(a, b)| a + b).collect();
        a.finish(&rows).unwrap()
    }

    #[test]
    fn reductions_follow_sql_null_semantics() {
        let values: ArrayRef = Arc::new(Float32Array::from(vec![
            Some(1.0),
            None,
            Some(3.0),
            Some(-2.0),
            None,
            Some(5.0),
        ]));
        // Groups 0: [1, 3, 5]   1: [NULL, -2]   2: [NULL]   3: none
        let groups = [0, 1, 0, 1, 2, 0];
        let f = |a: ArrayRef| -> Vec<Option<f64>> {
            let a = cast(&a, &DataType::Float64).unwrap();
            a.as_primitive::<Float64Type>().iter().collect()
        };
        assert_eq!(
            f(run(ReduceOp::Sum, values.clone(), &groups, 4)),
            vec![Some(9.0), Some(-2.0), None, None]
        );
        assert_eq!(
            f(run(ReduceOp::Avg, values.clone(), &groups, 4)),
            vec![Some(3.0), Some(-2.0), None, None]
        );
        assert_eq!(
            f(run(ReduceOp::Min, values.clone(), &groups, 4)),
            vec![Some(1.0), Some(-2.0), None, None]
        );
        assert_eq!(
            f(run(ReduceOp::Max, values.clone(), &groups, 4)),
            vec![Some(5.0), Some(-2.0), None, None]
        );
        assert_eq!(
            f(run(ReduceOp::Count, values.clone(), &groups, 4)),
            vec![Some(3.0), Some(1.0), Some(0.0), Some(0.0)]
        );
        assert_eq!(
            f(run(ReduceOp::Var, values.clone(), &groups, 4)),
            vec![Some(4.0), None, None, None]
        );
        let pop = f(run(ReduceOp::VarPop, values.clone(), &groups, 4));
        assert!((pop[0].unwrap() - 8.0 / 3.0).abs() < 1e-12);
        assert_eq!(pop[1..], [Some(0.0), None, None]);
        assert_eq!(
            f(run(ReduceOp::Stddev, values, &groups, 4)),
            vec![Some(2.0), None, None, None]
        );
    }

    #[test]
    fn integer_sums_and_extremes_stay_integers() {
        let values: ArrayRef = Arc::new(Int32Array::from(vec![7, -3, i32::MAX, 2]));
        let sum = run(ReduceOp::Sum, values.clone(), &[0, 0, 1, 1], 2);
        assert_eq!(sum.data_type(), &DataType::Int64);
        assert_eq!(
            sum.as_primitive::<Int64Type>().values(),
            &[4, i32::MAX as i64 + 2]
        );
        let max = run(ReduceOp::Max, values, &[0, 0, 1, 1], 2);
        assert_eq!(
            max.as_primitive::<datafusion::arrow::datatypes::Int32Type>()
                .values(),
            &[7, i32::MAX]
        );
    }

    #[test]
    fn deferred_row_counts_equal_counting_every_row() {
        let groups = 5000;
        let mut direct = vec![0; groups];
        let mut deferred = RowCounts::new(groups);
        // Lines of every kind, repeated as outer steps repeat them, more
        // distinct ones than are held before they are added up.
        for step in 0..3 {
            for start in (0..groups - 300).step_by(7) {
                let lines = [
                    Line {
                        offset: 0,
                        len: 200 + start % 90,
                        group: start,
                        spread: true,
                    },
                    Line {
                        offset: 0,
                        len: 3 + step,
                        group: start + 1,
                        spread: true,
                    },
                    Line {
                        offset: 0,
                        len: 100,
                        group: start + 2,
                        spread: false,
                    },
                ];
                count_rows(&mut direct, &lines, None);
                deferred.add(&lines, None);
            }
            let mask = BooleanBuffer::from_iter((0..300).map(|i| i % 3 != step));
            let lines = [Line {
                offset: 10,
                len: 250,
                group: 4000,
                spread: true,
            }];
            count_rows(&mut direct, &lines, Some(&mask));
            deferred.add(&lines, Some(&mask));
        }
        assert_eq!(deferred.settled(), direct);
        let mut merged = RowCounts::new(groups);
        merged.add_counts(&direct);
        merged.add_counts(deferred.settled());
        assert_eq!(merged.settled()[4100], 2 * direct[4100]);
    }

    #[test]
    fn variance_is_accurate_far_from_zero() {
        let values: Vec<f64> = (0..1000).map(|i| 1e9 + (i % 7) as f64).collect();
        let mean = values.iter().sum::<f64>() / 1000.0;
        let want = values.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / 999.0;
        let got = run(
            ReduceOp::Var,
            Arc::new(Float64Array::from(values)),
            &[0; 1000],
            1,
        );
        let got = got.as_primitive::<Float64Type>().value(0);
        assert!((got - want).abs() < 1e-9 * want, "{got} vs {want}");
    }
}

//! Elementwise arguments of a dense reduction or a rolling window, evaluated
//! in pieces that stay in L1 cache and are used right away (folded into a
//! reduction's groups, put into a window's lines).
//!
//! An aggregate's argument such as `u * v` (or an anomaly's `t2m - c`)
//! evaluated by Arrow writes a whole run of results to a fresh array that
//! the fold then reads back: two more passes over memory than the
//! arithmetic needs. For arguments built only
//! from `float64` arithmetic (`+`, `-`, `*`, `/`, unary `-`) over columns
//! (`float64`, or `float32` widened by a cast) and literals, a
//! [`FusedExpr`] instead computes [`PIECE`] rows at a time into a small
//! buffer, which is used before the next piece is computed.
//! The arithmetic is IEEE `f64`, as Arrow's kernels do it, so results are
//! the same; batches whose input columns hold NULLs keep Arrow's path.

use std::sync::Arc;

use datafusion::arrow::array::{Array, AsArray, RecordBatch};
use datafusion::arrow::datatypes::{DataType, Float32Type, Float64Type, Schema};
use datafusion::common::ScalarValue;
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::expressions::{BinaryExpr, CastExpr, Column, Literal, NegativeExpr};
use datafusion::physical_expr::PhysicalExpr;

/// Rows evaluated at a time: a piece and its temporaries stay in L1.
pub const PIECE: usize = 512;

/// An arithmetic operator on `f64`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arith {
    Add,
    Sub,
    Mul,
    Div,
}

impl Arith {
    #[inline(always)]
    fn apply(self, a: f64, b: f64) -> f64 {
        match self {
            Self::Add => a + b,
            Self::Sub => a - b,
            Self::Mul => a * b,
            Self::Div => a / b,
        }
    }
}

/// A node of a fused expression.
#[derive(Debug, Clone, PartialEq)]
enum Node {
    /// Column `index` of the batch, `float64` or `float32` widened.
    Column(usize),
    /// A constant.
    Literal(f64),
    /// `-x`.
    Negative(Box<Node>),
    /// `left op right`.
    Binary(Arith, Box<Node>, Box<Node>),
}

/// A `float64` expression over columns of a batch, evaluated piece by piece.
#[derive(Debug, Clone, PartialEq)]
pub struct FusedExpr {
    root: Node,
    /// Columns of the batch the expression reads.
    columns: Vec<usize>,
    /// Temporary pieces an evaluation needs.
    temporaries: usize,
}

/// The values of one input column of a batch.
#[derive(Debug, Clone, Copy)]
enum Values<'a> {
    F64(&'a [f64]),
    F32(&'a [f32]),
}

/// The input columns of one batch, ready to evaluate a [`FusedExpr`] on.
#[derive(Debug)]
pub struct FusedInputs<'a> {
    /// Indexed by batch column (`None`: not read by the expression).
    columns: Vec<Option<Values<'a>>>,
}

impl FusedExpr {
    /// `expr` as a fused expression over a batch of `schema`, when it is
    /// `float64` arithmetic over `float64`/`float32` columns and literals.
    pub fn compile(expr: &Arc<dyn PhysicalExpr>, schema: &Schema) -> Option<Self> {
        if expr.data_type(schema).ok()? != DataType::Float64 {
            return None;
        }
        let mut columns = Vec::new();
        let root = node(expr, schema, &mut columns)?;
        columns.sort_unstable();
        columns.dedup();
        let temporaries = temporaries(&root);
        Some(Self {
            root,
            columns,
            temporaries,
        })
    }

    /// The columns of `batch` this reads, or `None` when one of them holds
    /// NULLs (the batch then goes through Arrow's kernels).
    pub fn inputs<'a>(&self, batch: &'a RecordBatch) -> Option<FusedInputs<'a>> {
        let mut columns = vec![None; batch.num_columns()];
        for &c in &self.columns {
            let array = batch.column(c);
            if array.null_count() > 0 {
                return None;
            }
            columns[c] = Some(match array.data_type() {
                DataType::Float64 => Values::F64(array.as_primitive::<Float64Type>().values()),
                DataType::Float32 => Values::F32(array.as_primitive::<Float32Type>().values()),
                _ => return None,
            });
        }
        Some(FusedInputs { columns })
    }

    /// Scratch space for [`FusedExpr::eval`].
    pub fn scratch(&self) -> Vec<f64> {
        vec![0.0; self.temporaries * PIECE]
    }

    /// Writes the expression's values for rows `offset..offset + out.len()`
    /// of the batch of `inputs` to `out` (at most [`PIECE`] rows).
    pub fn eval(&self, inputs: &FusedInputs, offset: usize, out: &mut [f64], scratch: &mut [f64]) {
        debug_assert!(out.len() <= PIECE);
        eval(&self.root, inputs, offset, out, scratch);
    }
}

/// Compiles one node, noting the columns it reads.
fn node(expr: &Arc<dyn PhysicalExpr>, schema: &Schema, columns: &mut Vec<usize>) -> Option<Node> {
    if let Some(column) = expr.downcast_ref::<Column>() {
        return match schema.field(column.index()).data_type() {
            DataType::Float64 => {
                columns.push(column.index());
                Some(Node::Column(column.index()))
            }
            _ => None,
        };
    }
    if let Some(cast) = expr.downcast_ref::<CastExpr>() {
        // Only float32 columns widened to float64: exact, as Arrow's cast.
        let column = cast.expr().downcast_ref::<Column>()?;
        let from = schema.field(column.index()).data_type();
        return match (from, cast.cast_type()) {
            (DataType::Float32 | DataType::Float64, DataType::Float64) => {
                columns.push(column.index());
                Some(Node::Column(column.index()))
            }
            _ => None,
        };
    }
    if let Some(literal) = expr.downcast_ref::<Literal>() {
        return match literal.value() {
            ScalarValue::Float64(Some(v)) => Some(Node::Literal(*v)),
            _ => None,
        };
    }
    if let Some(negative) = expr.downcast_ref::<NegativeExpr>() {
        let inner = float64(negative.arg(), schema, columns)?;
        return Some(Node::Negative(Box::new(inner)));
    }
    if let Some(binary) = expr.downcast_ref::<BinaryExpr>() {
        let op = match binary.op() {
            Operator::Plus => Arith::Add,
            Operator::Minus => Arith::Sub,
            Operator::Multiply => Arith::Mul,
            Operator::Divide => Arith::Div,
            _ => return None,
        };
        let left = float64(binary.left(), schema, columns)?;
        let right = float64(binary.right(), schema, columns)?;
        return Some(Node::Binary(op, Box::new(left), Box::new(right)));
    }
    None
}

/// Compiles a sub-expression that must itself be `float64`.
fn float64(
    expr: &Arc<dyn PhysicalExpr>,
    schema: &Schema,
    columns: &mut Vec<usize>,
) -> Option<Node> {
    (expr.data_type(schema).ok()? == DataType::Float64)
        .then(|| node(expr, schema, columns))
        .flatten()
}

/// Temporary pieces evaluating `node` needs (see [`eval`]).
fn temporaries(node: &Node) -> usize {
    match node {
        Node::Column(_) | Node::Literal(_) => 0,
        Node::Negative(inner) => temporaries(inner),
        Node::Binary(_, left, right) => match **right {
            Node::Column(_) | Node::Literal(_) => temporaries(left),
            _ => temporaries(left).max(1 + temporaries(right)),
        },
    }
}

/// Evaluates `node` for rows `offset..offset + out.len()` into `out`. A
/// binary node computes its left side into `out` and combines its right
/// side in place: straight from the column or constant when it is one,
/// else from a temporary piece of `scratch`.
fn eval(node: &Node, inputs: &FusedInputs, offset: usize, out: &mut [f64], scratch: &mut [f64]) {
    let n = out.len();
    match node {
        Node::Column(c) => match inputs.columns[*c] {
            Some(Values::F64(values)) => out.copy_from_slice(&values[offset..offset + n]),
            Some(Values::F32(values)) => {
                for (o, &v) in out.iter_mut().zip(&values[offset..offset + n]) {
                    *o = f64::from(v);
                }
            }
            None => unreachable!("inputs hold every column the expression reads"),
        },
        Node::Literal(v) => out.fill(*v),
        Node::Negative(inner) => {
            eval(inner, inputs, offset, out, scratch);
            out.iter_mut().for_each(|o| *o = -*o);
        }
        Node::Binary(op, left, right) => {
            // Two float64 columns, as in `u * v`: one pass, no copy.
            if let (Node::Column(a), Node::Column(b)) = (&**left, &**right) {
                if let (Some(Values::F64(a)), Some(Values::F64(b))) =
                    (inputs.columns[*a], inputs.columns[*b])
                {
                    let (a, b) = (&a[offset..offset + n], &b[offset..offset + n]);
                    return apply(*op, out, a, b);
                }
            }
            eval(left, inputs, offset, out, scratch);
            match **right {
                Node::Literal(v) => out.iter_mut().for_each(|o| *o = op.apply(*o, v)),
                Node::Column(c) => match inputs.columns[c] {
                    Some(Values::F64(values)) => combine(*op, out, &values[offset..offset + n]),
                    Some(Values::F32(values)) => {
                        for (o, &v) in out.iter_mut().zip(&values[offset..offset + n]) {
                            *o = op.apply(*o, f64::from(v));
                        }
                    }
                    None => unreachable!("inputs hold every column the expression reads"),
                },
                _ => {
                    let (piece, rest) = scratch.split_at_mut(PIECE);
                    let piece = &mut piece[..n];
                    eval(right, inputs, offset, piece, rest);
                    combine(*op, out, piece);
                }
            }
        }
    }
}

/// `out[i] = a[i] op b[i]`, one loop per operator so each vectorizes.
fn apply(op: Arith, out: &mut [f64], a: &[f64], b: &[f64]) {
    let triples = out.iter_mut().zip(a.iter().zip(b));
    match op {
        Arith::Add => triples.for_each(|(o, (&x, &y))| *o = x + y),
        Arith::Sub => triples.for_each(|(o, (&x, &y))| *o = x - y),
        Arith::Mul => triples.for_each(|(o, (&x, &y))| *o = x * y),
        Arith::Div => triples.for_each(|(o, (&x, &y))| *o = x / y),
    }
}

/// `out[i] = out[i] op right[i]`, one loop per operator so each vectorizes.
fn combine(op: Arith, out: &mut [f64], right: &[f64]) {
    let pairs = out.iter_mut().zip(right);
    match op {
        Arith::Add => pairs.for_each(|(o, &r)| *o += r),
        Arith::Sub => pairs.for_each(|(o, &r)| *o -= r),
        Arith::Mul => pairs.for_each(|(o, &r)| *o *= r),
        Arith::Div => pairs.for_each(|(o, &r)| *o /= r),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{ArrayRef, Float32Array, Float64Array, Int64Array};
    use datafusion::arrow::datatypes::Field;
    use datafusion::common::DFSchema;
    use datafusion::execution::context::SessionContext;
    use datafusion::logical_expr::{col, lit, Expr};

    fn batch() -> RecordBatch {
        let n = 1500;
        let u: Vec<f64> = (0..n).map(|i| (i as f64 * 0.37).sin() * 10.0).collect();
        let v: Vec<f64> = (0..n)
            .map(|i| if i % 97 == 0 { 0.0 } else { i as f64 - 700.0 })
            .collect();
        let w: Vec<f32> = (0..n).map(|i| (i as f32).sqrt() + 0.1).collect();
        let k: Vec<i64> = (0..n as i64).collect();
        let schema = Schema::new(vec![
            Field::new("u", DataType::Float64, true),
            Field::new("v", DataType::Float64, true),
            Field::new("w", DataType::Float32, true),
            Field::new("k", DataType::Int64, true),
        ]);
        let columns: Vec<ArrayRef> = vec![
            Arc::new(Float64Array::from(u)),
            Arc::new(Float64Array::from(v)),
            Arc::new(Float32Array::from(w)),
            Arc::new(Int64Array::from(k)),
        ];
        RecordBatch::try_new(Arc::new(schema), columns).unwrap()
    }

    fn physical(expr: Expr, batch: &RecordBatch) -> Arc<dyn PhysicalExpr> {
        let schema = DFSchema::try_from(batch.schema().as_ref().clone()).unwrap();
        // Type coercion as the planner applies it (float32 widened by a cast).
        SessionContext::new()
            .create_physical_expr(expr, &schema)
            .unwrap()
    }

    /// Fused values for every row, piece by piece at an awkward offset.
    fn fused_values(fused: &FusedExpr, batch: &RecordBatch) -> Vec<f64> {
        let inputs = fused.inputs(batch).unwrap();
        let mut scratch = fused.scratch();
        let mut values = vec![0.0; batch.num_rows()];
        for (i, piece) in values.chunks_mut(PIECE - 3).enumerate() {
            fused.eval(&inputs, i * (PIECE - 3), piece, &mut scratch);
        }
        values
    }

    #[test]
    fn fused_arithmetic_equals_arrows_kernels() {
        let batch = batch();
        let exprs = [
            col("u") * col("u"),
            col("u") * col("v"),
            col("u") / col("v"),
            -(col("u") - lit(2.5)) * (col("v") + col("u") / lit(3.0)),
            (col("u") + col("v")) * (col("u") - col("v")) / (col("v") * col("v") + lit(1.0)),
            col("w") * lit(2.0),
            col("u") - col("w"),
            datafusion::prelude::cast(col("w"), DataType::Float64),
        ];
        for expr in exprs {
            let name = expr.to_string();
            let physical = physical(expr, &batch);
            let fused = FusedExpr::compile(&physical, &batch.schema())
                .unwrap_or_else(|| panic!("{name} is not fused: {physical}"));
            let want = physical
                .evaluate(&batch)
                .unwrap()
                .into_array(batch.num_rows())
                .unwrap();
            let want = want.as_primitive::<Float64Type>().values();
            let got = fused_values(&fused, &batch);
            for (row, (a, b)) in got.iter().zip(want.iter()).enumerate() {
                assert!(
                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                    "{name} row {row}: fused {a}, Arrow {b}"
                );
            }
        }
    }

    #[test]
    fn other_expressions_and_nulls_keep_arrows_path() {
        let batch = batch();
        for expr in [
            col("k") * lit(2i64),
            datafusion::prelude::cast(col("k"), DataType::Float64),
            col("w"),
            col("u") % col("v"),
            datafusion::prelude::abs(col("u")),
        ] {
            let physical = physical(expr, &batch);
            assert_eq!(
                FusedExpr::compile(&physical, &batch.schema()),
                None,
                "{physical}"
            );
        }
        let physical = physical(col("u") * col("v"), &batch);
        let fused = FusedExpr::compile(&physical, &batch.schema()).unwrap();
        let mut columns = batch.columns().to_vec();
        columns[1] = Arc::new(Float64Array::from([None, Some(1.0)].repeat(750)));
        let with_nulls = RecordBatch::try_new(batch.schema(), columns).unwrap();
        assert!(fused.inputs(&with_nulls).is_none());
    }
}

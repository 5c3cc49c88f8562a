//! The FFT fixture's cases (`tests/fixtures/fft/cases.json`, written with
//! xrft by `tests/fixtures/fft/make_fft_fixtures.py`): running one through
//! SQL and comparing coordinates and values with xrft's.

use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, AsArray, RecordBatch};
use datafusion::arrow::compute::{cast, concat_batches};
use datafusion::arrow::datatypes::{DataType, Float64Type};
use datafusion::prelude::SessionContext;
use serde_json::Value;

use super::repo_root;

/// The rows of `sql`, as one batch.
pub async fn collect(ctx: &SessionContext, sql: &str) -> RecordBatch {
    let df = ctx.sql(sql).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    let schema = Arc::new(df.schema().as_arrow().clone());
    let batches = df.collect().await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    concat_batches(&schema, &batches).unwrap()
}

/// A column as numbers (times as nanoseconds).
pub fn numbers(column: &ArrayRef) -> Vec<f64> {
    let column = match column.data_type() {
        DataType::Timestamp(_, _) => cast(column, &DataType::Int64).unwrap(),
        _ => Arc::clone(column),
    };
    let column = cast(&column, &DataType::Float64).unwrap();
    column.as_primitive::<Float64Type>().values().to_vec()
}

/// The real and imaginary parts of a value column (complex structs, or
/// real numbers with zero imaginary parts).
pub fn parts(column: &ArrayRef) -> (Vec<f64>, Vec<f64>) {
    match column.data_type() {
        DataType::Struct(_) => {
            let s = column.as_struct();
            (numbers(s.column(0)), numbers(s.column(1)))
        }
        _ => {
            let re = numbers(column);
            let im = vec![0.0; re.len()];
            (re, im)
        }
    }
}

pub fn sql_call(case: &Value) -> String {
    let mut args = vec![
        format!("'{}'", case["store"].as_str().unwrap()),
        format!("'{}'", case["variable"].as_str().unwrap()),
    ];
    for (k, v) in case["args"].as_object().unwrap() {
        args.push(format!("{k} => '{}'", v.as_str().unwrap()));
    }
    format!(
        "{}({})",
        case["function"].as_str().unwrap(),
        args.join(", ")
    )
}

/// The cases of `tests/fixtures/fft/cases.json` (the working directory
/// set to the repository's root, where their paths start).
pub fn cases() -> Vec<Value> {
    std::env::set_current_dir(repo_root()).unwrap();
    serde_json::from_str(&std::fs::read_to_string("tests/fixtures/fft/cases.json").unwrap())
        .unwrap()
}

/// Creates the views `case` reads (a chain of transforms: its source is a
/// view of another transform).
pub async fn create_views(ctx: &SessionContext, case: &Value) {
    for view in case["views"].as_array().into_iter().flatten() {
        let (name, query) = (view[0].as_str().unwrap(), view[1].as_str().unwrap());
        let sql = format!("CREATE OR REPLACE VIEW {name} AS {query}");
        ctx.sql(&sql).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
}

/// Runs `case` in `ctx` and compares coordinates and values with xrft's.
pub async fn check_case(ctx: &SessionContext, case: &Value) {
    let name = case["name"].as_str().unwrap();
    let dims: Vec<&str> = case["dims"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_str().unwrap())
        .collect();
    let order = dims.join(", ");
    create_views(ctx, case).await;
    let got = collect(
        ctx,
        &format!("SELECT * FROM {} ORDER BY {order}", sql_call(case)),
    )
    .await;
    let expected = collect(
        ctx,
        &format!(
            "SELECT {order}, re, im FROM read_zarr('{}') ORDER BY {order}",
            case["expected"].as_str().unwrap()
        ),
    )
    .await;
    assert_eq!(got.num_rows(), expected.num_rows(), "{name}: rows");
    for (i, dim) in dims.iter().enumerate() {
        assert_eq!(got.schema().field(i).name(), dim, "{name}: column {i}");
        let (a, b) = (numbers(got.column(i)), numbers(expected.column(i)));
        for (x, y) in a.iter().zip(&b) {
            assert!(
                (x - y).abs() <= 1e-9 * y.abs().max(1.0),
                "{name}: coordinate {dim}: {x} != {y}"
            );
        }
    }
    let (re, im) = parts(got.column(dims.len()));
    let (ere, eim) = (
        numbers(expected.column(dims.len())),
        numbers(expected.column(dims.len() + 1)),
    );
    let largest = ere
        .iter()
        .zip(&eim)
        .map(|(r, i)| r.hypot(*i))
        .fold(0.0, f64::max);
    let tolerance = case["rtol"].as_f64().unwrap() * largest.max(1e-300);
    for row in 0..re.len() {
        let error = (re[row] - ere[row]).hypot(im[row] - eim[row]);
        assert!(
            error <= tolerance,
            "{name}: row {row}: {}+{}i != {}+{}i (tolerance {tolerance})",
            re[row],
            im[row],
            ere[row],
            eim[row]
        );
    }
}

//! Every fixture store read through SQL equals what xarray read from it
//! (`tests/fixtures/expected/*.json`, written by `make_fixtures.py`), with
//! and without filter pushdown, for every dimension set; every oracle query
//! also gives the same answer with and without the dense reduction rule.

use crate::common;

use std::collections::HashMap;

use common::{assert_rows, fixture, query_rows, repo_root, sort_rows};
use serde_json::Value;
use zarrfusion::{new_context, ZarrContextExt, ZarrTableOptions};

fn expected_files() -> Vec<(String, Value)> {
    let dir = repo_root().join("tests/fixtures/expected");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        // The tables: `<store>__<dims>.json`.
        .filter(|p| {
            p.file_stem()
                .is_some_and(|s| s.to_string_lossy().contains("__"))
        })
        .collect();
    files.sort();
    assert!(
        files.len() >= 20,
        "expected the fixture oracles in {}",
        dir.display()
    );
    files
        .into_iter()
        .map(|p| {
            let name = p.file_stem().unwrap().to_string_lossy().into_owned();
            let json = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            (name, json)
        })
        .collect()
}

/// How a query is run: filter pushdown and the dense reduction rule on or off.
#[derive(Debug, Clone, Copy)]
struct Mode {
    pushdown: bool,
    dense: bool,
}

const ALL_MODES: [Mode; 4] = [
    Mode {
        pushdown: true,
        dense: true,
    },
    Mode {
        pushdown: false,
        dense: true,
    },
    Mode {
        pushdown: true,
        dense: false,
    },
    Mode {
        pushdown: false,
        dense: false,
    },
];

async fn query(store: &str, dims: Option<&Value>, mode: Mode, sql: &str) -> Vec<Vec<Value>> {
    let ctx = new_context();
    if !mode.dense {
        ctx.sql("SET zarrfusion.dense_reduction = false")
            .await
            .unwrap();
    }
    let mut options = HashMap::new();
    if let Some(Value::Array(dims)) = dims {
        let names: Vec<&str> = dims.iter().map(|d| d.as_str().unwrap()).collect();
        options.insert("dims".to_string(), names.join(","));
    }
    if !mode.pushdown {
        options.insert("pushdown".to_string(), "false".to_string());
    }
    ctx.register_zarr("t", &fixture(store), options)
        .await
        .unwrap_or_else(|e| panic!("registering {store}: {e}"));
    query_rows(&ctx, store, sql).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fixture_table_equals_xarray() {
    for (name, expected) in expected_files() {
        let store = expected["store"].as_str().unwrap();
        let dims = &expected["dims"];
        let columns: Vec<String> = expected["columns"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| format!("\"{}\"", c["name"].as_str().unwrap()))
            .collect();
        let n_dims = dims.as_array().unwrap().len();
        let mut want: Vec<Vec<Value>> = serde_json::from_value(expected["rows"].clone()).unwrap();
        sort_rows(&mut want, n_dims);
        let sql = format!("SELECT {} FROM t", columns.join(", "));
        let mut got = query(store, Some(dims), ALL_MODES[0], &sql).await;
        sort_rows(&mut got, n_dims);
        assert_rows(&name, &got, &want);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_oracle_query_matches_with_and_without_pushdown_and_dense_reduction() {
    let path = repo_root().join("tests/fixtures/expected/queries.json");
    let queries: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert!(queries.len() >= 15);
    for q in &queries {
        let name = q["name"].as_str().unwrap();
        let store = q["store"].as_str().unwrap();
        let sql = q["sql"].as_str().unwrap();
        let want: Vec<Vec<Value>> = serde_json::from_value(q["rows"].clone()).unwrap();
        for mode in ALL_MODES {
            let got = query(store, q.get("dims"), mode, sql).await;
            assert_rows(&format!("{name} ({mode:?})"), &got, &want);
        }
    }
}

/// The regular coordinates xarray wrote (`pandas.date_range`,
/// `numpy.linspace`, `numpy.arange` in float32 and float64, int64 steps)
/// are held as formulas, and text coordinates as values; the tests above
/// check that both give xarray's values in every row.
#[test]
fn regular_fixture_coordinates_are_held_as_formulas() {
    use datafusion::execution::runtime_env::RuntimeEnv;
    use zarrfusion::table::Coordinate;
    let runtime = RuntimeEnv::default();
    let kinds = |store: &str| {
        let dataset =
            zarrfusion::ZarrDataset::open(&fixture(store), &ZarrTableOptions::default(), &runtime)
                .unwrap();
        let table = dataset.table(None).unwrap();
        table
            .dims
            .iter()
            .map(|d| {
                let kind = match &d.coordinate {
                    Coordinate::Values(_) => "values",
                    Coordinate::Regular(_) => "formula",
                    Coordinate::Index(_) => "index",
                    Coordinate::Computed(_) => "computed",
                };
                (d.name.clone(), kind)
            })
            .collect::<Vec<_>>()
    };
    let pairs = |p: &[(&str, &'static str)]| {
        p.iter()
            .map(|(n, k)| (n.to_string(), *k))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        kinds("rechunk_source.zarr"),
        pairs(&[("time", "formula"), ("lat", "formula"), ("lon", "formula")])
    );
    assert_eq!(
        kinds("string_coords_v3.zarr"),
        pairs(&[("station", "values"), ("time", "formula")])
    );
    assert_eq!(
        kinds("codec_v2_zstd.zarr"),
        pairs(&[("y", "index"), ("x_dim", "index")])
    );
}

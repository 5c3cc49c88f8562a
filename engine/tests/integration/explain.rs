//! Drawing plans: the DOT text has a box per operator with what EXPLAIN
//! shows of it, edges from inputs to their readers, metrics after running;
//! SVG through Graphviz where it is installed, a clear error where not.

use crate::common;

use zarrfusion::explain::{plan_dot, render_svg};

async fn demo_session() -> datafusion::prelude::SessionContext {
    let ctx = zarrfusion::new_context();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let store = root.join("demo/era5.zarr");
    ctx.sql(&format!(
        "CREATE EXTERNAL TABLE era5 STORED AS ZARR LOCATION '{}'",
        store.display()
    ))
    .await
    .unwrap();
    ctx
}

/// Node ids and edges of DOT text written by `plan_dot`.
fn graph(dot: &str) -> (Vec<String>, Vec<(String, String)>) {
    let mut nodes = Vec::new();
    let mut edges = Vec::new();
    for line in dot.lines().map(str::trim) {
        if let Some((id, _)) = line.split_once(" [label=") {
            nodes.push(id.to_string());
        } else if let Some((from, to)) = line.trim_end_matches(';').split_once(" -> ") {
            edges.push((from.to_string(), to.to_string()));
        }
    }
    (nodes, edges)
}

#[tokio::test]
async fn the_dot_graph_has_every_operator_and_its_inputs() {
    let ctx = demo_session().await;
    let sql = "SELECT lat, avg(t2m) FROM rechunk('era5', time => 48) WHERE lon < 30 GROUP BY lat";
    let df = ctx.sql(sql).await.unwrap();
    let indent = datafusion::physical_plan::displayable(
        df.clone().create_physical_plan().await.unwrap().as_ref(),
    )
    .indent(false)
    .to_string();
    let dot = plan_dot(df, false).await.unwrap();
    assert!(
        dot.starts_with("digraph plan {") && dot.ends_with("}\n"),
        "{dot}"
    );
    let (nodes, edges) = graph(&dot);
    // One node per line of the indented plan, a tree: one edge fewer.
    assert_eq!(nodes.len(), indent.lines().count(), "{dot}\n{indent}");
    assert_eq!(edges.len(), nodes.len() - 1, "{dot}");
    for (from, to) in &edges {
        assert!(nodes.contains(from) && nodes.contains(to), "{dot}");
    }
    // Labels wrap at spaces, wherever the store path (its length varies by
    // checkout) pushes them: undo the wrapping before looking for text.
    let unwrapped = dot.replace("\\l    ", " ");
    assert!(unwrapped.contains("RechunkExec: store="), "{dot}");
    assert!(
        unwrapped.contains("t2m: [24, 33, 64] -> [48, 33, 64]"),
        "{dot}"
    );
    assert!(!dot.contains("metrics:"), "{dot}");
    // Quotes in labels are escaped.
    let quoted = ctx
        .sql("SELECT lat AS \"a \"\"quoted\"\" name\" FROM era5 LIMIT 1")
        .await
        .unwrap();
    let dot = plan_dot(quoted, false).await.unwrap();
    assert!(
        dot.contains("\\\"\\\"quoted") || dot.contains("\\\"quoted"),
        "{dot}"
    );
    for line in dot.lines().filter(|l| l.contains("[label=")) {
        let label = line.split_once("[label=\"").unwrap().1;
        let body = label.strip_suffix("\"];").unwrap();
        assert!(!body.replace("\\\"", "").contains('"'), "{line}");
    }
}

#[tokio::test]
async fn analyze_runs_the_query_and_shows_metrics() {
    let ctx = demo_session().await;
    let df = ctx
        .sql("SELECT lat, avg(t2m) FROM era5 GROUP BY lat")
        .await
        .unwrap();
    let dot = plan_dot(df, true).await.unwrap();
    let unwrapped = dot.replace("\\l    ", " ");
    assert!(unwrapped.contains("DenseReductionExec"), "{dot}");
    assert!(unwrapped.contains("metrics: output_rows=33"), "{dot}");
    assert!(unwrapped.contains("blocks_read=2"), "{dot}");
    // t2m is float32: 4 bytes for each of the 96 * 33 * 64 cells.
    assert!(unwrapped.contains("bytes_decoded=811.0 K"), "{dot}");
    assert!(unwrapped.contains("memory_reserved="), "{dot}");
}

#[test]
fn svg_needs_graphviz() {
    let dot = "digraph plan {\n  n0 [label=\"x\"];\n}\n";
    match render_svg(dot) {
        Ok(svg) => assert!(String::from_utf8_lossy(&svg).contains("<svg"), "{svg:?}"),
        Err(e) => {
            let text = e.to_string();
            println!("Graphviz is not installed: {text}");
            assert!(text.contains("install Graphviz"), "{text}");
        }
    }
}

/// The scan's `projected_memory` in the EXPLAIN of `sql`, in bytes.
async fn scan_projected_memory(ctx: &datafusion::prelude::SessionContext, sql: &str) -> f64 {
    let text = common::explain_text(ctx, sql).await;
    let line = text
        .lines()
        .find(|l| l.contains("ZarrScanExec:"))
        .unwrap_or_else(|| panic!("no scan in {text}"));
    let size = line.split("projected_memory=").nth(1).unwrap();
    let mut words = size.split_whitespace();
    let number: f64 = words.next().unwrap().parse().unwrap();
    let unit = match words.next().unwrap().trim_end_matches(['|', ',']) {
        "B" => 1.0,
        "KB" => 1024.0,
        "MB" => 1024.0 * 1024.0,
        other => panic!("unit {other} in {line}"),
    };
    number * unit
}

#[tokio::test]
async fn the_scan_states_its_projected_memory_and_reserves_it() {
    let ctx = demo_session().await;
    // t2m is float32, u10 and v10 too: three variables hold about three
    // times the decoded blocks of one (the batches in flight add a little).
    let one = scan_projected_memory(&ctx, "SELECT t2m FROM era5").await;
    let three = scan_projected_memory(&ctx, "SELECT t2m, u10, v10 FROM era5").await;
    assert!(one > 0.0 && three > 2.0 * one, "{one} then {three}");
    let df = ctx.sql("SELECT t2m FROM era5").await.unwrap();
    let dot = plan_dot(df, true).await.unwrap().replace("\\l    ", " ");
    assert!(dot.contains("memory_reserved="), "{dot}");
}

#[tokio::test]
async fn a_batch_size_beyond_a_block_does_not_swell_the_projection() {
    // A batch never spans two blocks: batches of up to 2^24 rows over a
    // store of 120 cells hold 120 rows at most. Projected as 2^24 rows, the
    // scan's partitions took the whole pool and a sort beside them failed.
    let ctx = zarrfusion::new_context();
    for sql in [
        format!(
            "CREATE EXTERNAL TABLE t STORED AS ZARR LOCATION '{}'",
            common::fixture("v3_basic.zarr")
        ),
        "SET zarrfusion.allowed_mem = '1GB'".to_string(),
        "SET datafusion.execution.target_partitions = 2".to_string(),
        "SET datafusion.execution.batch_size = 16777216".to_string(),
    ] {
        zarrfusion::session::sql(&ctx, &sql).await.unwrap();
    }
    let sql = "SELECT * FROM t ORDER BY lat";
    let projected = scan_projected_memory(&ctx, sql).await;
    assert!(projected < 64.0 * 1024.0, "{projected} bytes");
    let batches = ctx.sql(sql).await.unwrap().collect().await.unwrap();
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    assert_eq!(rows, 6 * 5 * 4);
}

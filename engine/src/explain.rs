//! Drawing a query's plan: Graphviz DOT of the physical plan (the operators
//! with what `EXPLAIN` shows of them: chunk grids, tasks, projected memory),
//! after running it when asked (then with each operator's metrics, as
//! `EXPLAIN ANALYZE` shows them), and SVG through Graphviz's `dot` when it
//! is installed.
//!
//! ```no_run
//! # async fn example() -> datafusion::error::Result<()> {
//! let ctx = zarrfusion::new_context();
//! ctx.sql("CREATE EXTERNAL TABLE era5 STORED AS ZARR LOCATION 'demo/era5.zarr'").await?;
//! let df = ctx.sql("SELECT lat, avg(t2m) FROM era5 GROUP BY lat").await?;
//! let dot = zarrfusion::explain::plan_dot(df, true).await?;
//! std::fs::write("plan.svg", zarrfusion::explain::render_svg(&dot)?)?;
//! # Ok(())
//! # }
//! ```

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Arc;

use datafusion::common::{exec_err, DataFusionError, Result};
use datafusion::physical_plan::{collect, displayable, ExecutionPlan};
use datafusion::prelude::DataFrame;

/// The physical plan of `df` as Graphviz DOT: one box per operator,
/// labelled with what `EXPLAIN` shows of it. With `analyze`, the query runs
/// first (its rows are discarded) and every box adds the operator's
/// metrics, as `EXPLAIN ANALYZE` shows them.
pub async fn plan_dot(df: DataFrame, analyze: bool) -> Result<String> {
    let task = Arc::new(df.task_ctx());
    let plan = df.create_physical_plan().await?;
    if analyze {
        collect(Arc::clone(&plan), task).await?;
    }
    let mut dot = String::from(
        "digraph plan {\n  rankdir=BT;\n  node [shape=box, fontname=\"Helvetica\", fontsize=10];\n",
    );
    let mut next = 0;
    add_node(&mut dot, plan.as_ref(), analyze, &mut next);
    dot.push_str("}\n");
    Ok(dot)
}

/// Adds `plan` and its inputs to `dot`; returns the node's id.
fn add_node(dot: &mut String, plan: &dyn ExecutionPlan, analyze: bool, next: &mut usize) -> usize {
    let id = *next;
    *next += 1;
    let mut lines = wrap(&displayable(plan).one_line().to_string());
    if analyze {
        if let Some(metrics) = plan.metrics() {
            let metrics = metrics
                .aggregate_by_name()
                .sorted_for_display()
                .timestamps_removed();
            lines.extend(wrap(&format!("metrics: {metrics}")));
        }
    }
    let label: String = lines.iter().map(|l| format!("{}\\l", escape(l))).collect();
    dot.push_str(&format!("  n{id} [label=\"{label}\"];\n"));
    for child in plan.children() {
        let child_id = add_node(dot, child.as_ref(), analyze, next);
        dot.push_str(&format!("  n{child_id} -> n{id};\n"));
    }
    id
}

/// Splits a long description into lines of about 80 characters at ", ".
fn wrap(text: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut line = String::new();
    for (i, part) in text.trim_end().split(", ").enumerate() {
        if i > 0 {
            line.push(',');
            if line.len() + part.len() > 80 {
                lines.push(std::mem::replace(&mut line, "    ".to_string()));
            } else {
                line.push(' ');
            }
        }
        line.push_str(part);
    }
    lines.push(line);
    lines
}

/// A label's text with DOT's special characters escaped.
fn escape(text: &str) -> String {
    text.replace('\\', "\\\\").replace('"', "\\\"")
}

/// Renders DOT text as SVG with Graphviz's `dot` program.
pub fn render_svg(dot: &str) -> Result<Vec<u8>> {
    let missing = |e: std::io::Error| {
        DataFusionError::Execution(format!(
            "cannot run Graphviz's `dot` to draw the plan ({e}); install Graphviz, or save \
             the DOT text and render it elsewhere"
        ))
    };
    let mut child = Command::new("dot")
        .arg("-Tsvg")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(missing)?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(dot.as_bytes()).map_err(missing)?;
    }
    let output = child.wait_with_output().map_err(missing)?;
    if !output.status.success() {
        return exec_err!(
            "Graphviz's `dot` could not draw the plan: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(output.stdout)
}

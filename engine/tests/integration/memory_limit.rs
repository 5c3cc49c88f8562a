//! DataFusion's own operators under `allowed_mem` end, spilling or refused,
//! never stopping for good: a grouped `count(DISTINCT ...)` whose
//! repartitions spill under a small limit stopped, every thread idle, in
//! one run of a few in DataFusion 55 (apache/datafusion#24883); every
//! session's pool keeps repartitions off that path
//! (`zarrfusion::memory::UnspilledRepartitions`).

use std::time::Duration;

use datafusion::arrow::array::RecordBatch;
use zarrfusion::new_context;
use zarrfusion::session::sql;

/// Runs `statements` in order in `ctx`, the last one's batches returned.
async fn run_all(
    ctx: &datafusion::prelude::SessionContext,
    statements: &[&str],
) -> Vec<RecordBatch> {
    let mut last = Vec::new();
    for statement in statements {
        let df = sql(ctx, statement)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
        last = df
            .collect()
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grouped_distinct_count_whose_repartitions_spill_ends_every_time() {
    let ctx = new_context();
    run_all(
        &ctx,
        &[
            "SET datafusion.execution.target_partitions = 2",
            "SET datafusion.execution.batch_size = 64",
            "CREATE TABLE t AS SELECT v % 13 AS g, concat(CAST(v % 337 AS VARCHAR), '-', \
             repeat('x', 28)) AS trace_id FROM generate_series(1, 40000) AS s(v)",
            "SET zarrfusion.allowed_mem = '2MB'",
        ],
    )
    .await;
    let query = "SELECT g, count(DISTINCT trace_id) AS n FROM t GROUP BY g";
    // In DataFusion 55 without the wrapped pool, the first run or one of
    // the next few stops for good (checked: with DataFusion's own session
    // and pool, the first); each takes well under a second when it ends.
    for attempt in 0..12 {
        let batches = tokio::time::timeout(Duration::from_secs(30), run_all(&ctx, &[query]))
            .await
            .unwrap_or_else(|_| panic!("attempt {attempt}: no answer after 30 s"));
        let rows = crate::common::rows(&batches);
        assert_eq!(rows.len(), 13, "attempt {attempt}");
        // v % 13 = g and v % 337 both run over 40,000 values: every g meets
        // every one of the 337 remainders (13 and 337 are coprime and
        // 40,000 > 13 * 337).
        for row in &rows {
            assert_eq!(row[1], serde_json::json!(337), "attempt {attempt}: {row:?}");
        }
    }
}

//! A sort above the array operators keeps their rows in memory when they
//! fit: the scan, the rolling window and the dense reduction send a
//! block (or a result) in batches that share its buffers, and each batch
//! must count as its own rows in the memory pool, not as the whole block
//! (which DataFusion's sort reserves for every batch it keeps: a block
//! counted once a batch made it spill rows fifty times smaller than its
//! budget).

use datafusion::arrow::array::{Array, Float32Array, Float64Array};
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::prelude::SessionContext;
use zarrfusion::{new_context_with, session_config, ZarrContextExt};

use crate::common::{self, fixture};

/// The climate fixture (t2m and u10 over time 608 x lat 6 x lon 6, in one
/// block) as `t`, in a pool of `allowed_mem` bytes, sent in batches of 16
/// rows: some 1,400 batches of a block of 175 KB.
async fn session(allowed_mem: usize) -> SessionContext {
    let env = RuntimeEnvBuilder::new()
        .with_memory_limit(allowed_mem, 1.0)
        .build_arc()
        .unwrap();
    let ctx = new_context_with(session_config(), env);
    for setting in [
        "SET datafusion.execution.batch_size = 16",
        "SET datafusion.execution.target_partitions = 1",
    ] {
        ctx.sql(setting).await.unwrap();
    }
    ctx.register_zarr("t", &fixture("climate.zarr"), Default::default())
        .await
        .unwrap();
    ctx
}

/// The `spill_count` of the sort in `EXPLAIN ANALYZE sql`.
async fn sort_spills(ctx: &SessionContext, sql: &str, operator: &str) -> usize {
    let analyzed = common::explain_text(ctx, &format!("ANALYZE {sql}")).await;
    assert!(analyzed.contains(operator), "{sql}:\n{analyzed}");
    let line = (analyzed.lines())
        .find(|l| l.contains("SortExec:"))
        .unwrap_or_else(|| panic!("{sql} sorts:\n{analyzed}"));
    let count = line
        .split("spill_count=")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .unwrap_or_else(|| panic!("{sql}: no spill_count in {line}"));
    count.parse().unwrap()
}

/// The sorted column of `sql`'s rows, as f64 (NULLs last).
async fn sorted_column(ctx: &SessionContext, sql: &str) -> Vec<Option<f64>> {
    let batches = ctx.sql(sql).await.unwrap().collect().await.unwrap();
    let mut out = Vec::new();
    for batch in &batches {
        let column = batch.column(batch.num_columns() - 1);
        if let Some(values) = column.as_any().downcast_ref::<Float32Array>() {
            out.extend(values.iter().map(|v| v.map(f64::from)));
        } else {
            let values = column.as_any().downcast_ref::<Float64Array>().unwrap();
            out.extend(values.iter());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sort_above_a_scan_a_rolling_window_or_a_reduction_does_not_spill_what_fits() {
    // 21,888 rows of four or five columns (about 0.6 MB, reserved twice
    // by the sort) under 32 MiB, of which the sort sets 10 MiB aside to
    // merge; counted a block a batch, the 1,368 batches asked for 240 MB
    // (the scan) to 718 MB (the reduction's result) and the sort spilled
    // 11 to 37 times.
    let allowed_mem = 32 << 20;
    let ctx = session(allowed_mem).await;
    let cases = [
        (
            "SELECT time, lat, lon, u10, t2m FROM t ORDER BY t2m",
            "ZarrScanExec",
            608 * 36,
        ),
        (
            "SELECT time, lat, lon, avg(t2m) OVER (PARTITION BY lat, lon ORDER BY time \
             ROWS BETWEEN 3 PRECEDING AND CURRENT ROW) AS m FROM t ORDER BY m",
            "RollingWindowExec",
            608 * 36,
        ),
        (
            "SELECT time, lat, lon, avg(t2m) AS m FROM t GROUP BY time, lat, lon ORDER BY m",
            "DenseReductionExec",
            608 * 36,
        ),
    ];
    for (sql, operator, rows) in cases {
        assert_eq!(sort_spills(&ctx, sql, operator).await, 0, "{sql}");
        // The rows are all there, in order.
        let sorted = sorted_column(&ctx, sql).await;
        assert_eq!(sorted.len(), rows, "{sql}");
        let values: Vec<f64> = sorted.iter().map_while(|v| *v).collect();
        assert!(values.windows(2).all(|w| w[0] <= w[1]), "{sql}: not sorted");
        assert!(
            sorted[values.len()..].iter().all(Option::is_none),
            "{sql}: NULLs last"
        );
    }
}

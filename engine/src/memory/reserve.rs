//! An operator's projected memory, held in the session's pool while it runs.
//!
//! Every operator knows before it runs how much memory a partition holds at
//! its peak (its blocks, read-ahead, buffers and batches in flight); the
//! planner refuses a plan whose projection cannot fit `allowed_mem`. When a
//! partition starts, [`reserve`] takes that much from the session's memory
//! pool (so concurrent queries share the budget), refuses with the numbers
//! when the pool cannot give it, and shows it as the operator's
//! `memory_reserved` metric in `EXPLAIN ANALYZE`.
//!
//! An operator holding tables joined in ([`Reservation::after`]) takes its
//! own memory once their plans have run and freed their working memory, so
//! that the two are never held at once: each was checked against the limit
//! on its own when planned.

use std::sync::Arc;

use datafusion::common::{human_readable_size, DataFusionError, Result};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::execution::TaskContext;
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricBuilder};

/// Reserves `bytes`, the projected memory of partition `partition` of
/// `operator` over `store`, in `context`'s memory pool for as long as the
/// reservation lives, and reports it as the `memory_reserved` gauge of
/// `metrics`; an error naming the operator, the store and the numbers when
/// the pool cannot give it.
pub fn reserve(
    operator: &str,
    store: &str,
    partition: usize,
    bytes: usize,
    context: &TaskContext,
    metrics: &ExecutionPlanMetricsSet,
) -> Result<MemoryReservation> {
    let reservation =
        MemoryConsumer::new(format!("{operator}[{partition}]")).register(context.memory_pool());
    reservation.try_grow(bytes).map_err(|e| {
        DataFusionError::ResourcesExhausted(format!(
            "{operator} of '{store}' needs {} for partition {partition} and the memory pool \
             cannot give it: {e}",
            human_readable_size(bytes)
        ))
    })?;
    MetricBuilder::new(metrics)
        .gauge("memory_reserved", partition)
        .set(bytes);
    Ok(reservation)
}

/// A partition's projected memory, reserved as [`reserve`] does, at once
/// or later.
pub struct Reservation {
    operator: &'static str,
    store: String,
    partition: usize,
    bytes: usize,
    context: Arc<TaskContext>,
    metrics: ExecutionPlanMetricsSet,
}

impl Reservation {
    /// `bytes` for partition `partition` of `operator` over `store`, in
    /// `context`'s pool, reported to `metrics`.
    pub fn new(
        operator: &'static str,
        store: &str,
        partition: usize,
        bytes: usize,
        context: &Arc<TaskContext>,
        metrics: &ExecutionPlanMetricsSet,
    ) -> Self {
        Self {
            operator,
            store: store.to_string(),
            partition,
            bytes,
            context: Arc::clone(context),
            metrics: metrics.clone(),
        }
    }

    /// Takes it now.
    pub fn take(&self) -> Result<MemoryReservation> {
        reserve(
            self.operator,
            &self.store,
            self.partition,
            self.bytes,
            &self.context,
            &self.metrics,
        )
    }

    /// Taken now, unless the partition first waits for something
    /// (`later`: tables joined in, computed before it starts): then `None`,
    /// for [`Self::take`] once that is done.
    pub fn unless(&self, later: bool) -> Result<Option<MemoryReservation>> {
        (!later).then(|| self.take()).transpose()
    }

    /// The reservation taken by [`Self::unless`], or taken now.
    pub fn after(&self, taken: Option<MemoryReservation>) -> Result<MemoryReservation> {
        match taken {
            Some(taken) => Ok(taken),
            None => self.take(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use datafusion::execution::memory_pool::{GreedyMemoryPool, MemoryPool};
    use datafusion::execution::runtime_env::RuntimeEnvBuilder;

    use super::*;

    #[test]
    fn a_reservation_holds_its_bytes_until_dropped_and_a_pool_too_small_refuses() {
        let pool: Arc<dyn MemoryPool> = Arc::new(GreedyMemoryPool::new(1000));
        let runtime = RuntimeEnvBuilder::new()
            .with_memory_pool(Arc::clone(&pool))
            .build_arc()
            .unwrap();
        let context = TaskContext::default().with_runtime(runtime);
        let metrics = ExecutionPlanMetricsSet::new();
        let held = reserve("ScanExec", "a.zarr", 3, 600, &context, &metrics).unwrap();
        assert_eq!(pool.reserved(), 600);
        let shown = metrics.clone_inner().sum_by_name("memory_reserved");
        assert_eq!(shown.map(|m| m.as_usize()), Some(600));
        let err = reserve("ScanExec", "a.zarr", 4, 600, &context, &metrics).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("ScanExec of 'a.zarr' needs 600.0 B for partition 4"),
            "{text}"
        );
        drop(held);
        assert_eq!(pool.reserved(), 0);
        reserve("ScanExec", "a.zarr", 4, 600, &context, &metrics).unwrap();
    }
}

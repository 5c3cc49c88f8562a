//! The session's memory pool, with DataFusion 55's repartitions kept off
//! its spill path.
//!
//! When DataFusion 55's `RepartitionExec` cannot reserve memory for a batch
//! it writes the batch to a spill pool its input tasks share and sends a
//! marker; when two input tasks spill at once, a reader can wait on the
//! older spill file for a batch that is in the newer one while every
//! writer waits for the readers, and the query stops for good, no error
//! given (apache/datafusion#24883, fixed upstream by apache/datafusion#24891
//! after 55.2.0). zarrfusion's differential fuzzing met it as a grouped
//! aggregation that never ended under a small `allowed_mem`.
//!
//! Until zarrfusion's DataFusion has the fix, [`UnspilledRepartitions`]
//! wraps every session's and worker's pool: a repartition's batches in
//! flight are granted without being counted, as DataFusion leaves its other
//! operators' batches in flight uncounted, instead of being spilled.
//! (Counted, they took the pool from the operators reading them: the
//! aggregation above the repartition was refused where DataFusion's spill
//! would have finished it; the sizes DataFusion gives those batches count
//! the buffers their slices share once a slice.) What the limit then does
//! not hold is those batches between a repartition and its readers.

use std::fmt;
use std::sync::Arc;

use datafusion::common::Result;
use datafusion::execution::memory_pool::{
    MemoryConsumer, MemoryLimit, MemoryPool, MemoryReservation,
};
use datafusion::execution::runtime_env::{RuntimeEnv, RuntimeEnvBuilder};

/// A memory pool granting DataFusion's repartitions whatever they ask,
/// uncounted (see the [module docs](self)); every other consumer as the
/// pool it wraps.
#[derive(Debug)]
pub struct UnspilledRepartitions {
    inner: Arc<dyn MemoryPool>,
}

impl UnspilledRepartitions {
    /// `pool` wrapped (once: a wrapped pool is returned as it is).
    pub fn wrap(pool: Arc<dyn MemoryPool>) -> Arc<dyn MemoryPool> {
        match pool.is::<Self>() {
            true => pool,
            false => Arc::new(Self { inner: pool }),
        }
    }
}

/// Whether `consumer` is a `RepartitionExec`'s output (DataFusion names
/// them `RepartitionExec[partition]`, and `RepartitionExec[Merge
/// partition]` when they keep their inputs' order).
fn is_repartition(consumer: &MemoryConsumer) -> bool {
    consumer.name().starts_with("RepartitionExec[")
}

impl fmt::Display for UnspilledRepartitions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.inner, f)
    }
}

impl MemoryPool for UnspilledRepartitions {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn register(&self, consumer: &MemoryConsumer) {
        self.inner.register(consumer)
    }

    fn unregister(&self, consumer: &MemoryConsumer) {
        self.inner.unregister(consumer)
    }

    fn grow(&self, reservation: &MemoryReservation, additional: usize) {
        if !is_repartition(reservation.consumer()) {
            self.inner.grow(reservation, additional)
        }
    }

    fn shrink(&self, reservation: &MemoryReservation, shrink: usize) {
        if !is_repartition(reservation.consumer()) {
            self.inner.shrink(reservation, shrink)
        }
    }

    fn try_grow(&self, reservation: &MemoryReservation, additional: usize) -> Result<()> {
        match is_repartition(reservation.consumer()) {
            true => Ok(()),
            false => self.inner.try_grow(reservation, additional),
        }
    }

    fn reserved(&self) -> usize {
        self.inner.reserved()
    }

    fn memory_limit(&self) -> MemoryLimit {
        self.inner.memory_limit()
    }
}

/// `runtime` with its memory pool wrapped in [`UnspilledRepartitions`]
/// (itself when it already is).
pub fn unspilled_repartitions(runtime: Arc<RuntimeEnv>) -> Arc<RuntimeEnv> {
    if runtime.memory_pool.is::<UnspilledRepartitions>() {
        return runtime;
    }
    let pool = UnspilledRepartitions::wrap(Arc::clone(&runtime.memory_pool));
    match RuntimeEnvBuilder::from_runtime_env(&runtime)
        .with_memory_pool(pool)
        .build_arc()
    {
        Ok(wrapped) => wrapped,
        // Building from a built runtime does not fail; if it ever did, the
        // runtime as given still works (with the upstream bug).
        Err(e) => {
            log::warn!("the memory pool could not be wrapped: {e}");
            runtime
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::execution::memory_pool::GreedyMemoryPool;

    #[test]
    fn repartitions_are_granted_uncounted_and_others_refused_past_the_limit() {
        let pool = UnspilledRepartitions::wrap(Arc::new(GreedyMemoryPool::new(1000)));
        // Wrapped once.
        assert!(UnspilledRepartitions::wrap(Arc::clone(&pool)).is::<UnspilledRepartitions>());
        let repartition = MemoryConsumer::new("RepartitionExec[1]").register(&pool);
        let sort = MemoryConsumer::new("ExternalSorter[0]").register(&pool);
        sort.try_grow(600).unwrap();
        // Past the limit, granted to the repartition only, not counted.
        repartition.try_grow(700).unwrap();
        repartition.grow(300);
        assert_eq!(repartition.size(), 1000);
        assert_eq!(pool.reserved(), 600);
        sort.try_grow(400).unwrap();
        let refused = sort.try_grow(1).unwrap_err().to_string();
        assert!(refused.contains("Resources exhausted"), "{refused}");
        // Freeing the repartition's frees nothing counted.
        drop(repartition);
        assert_eq!(pool.reserved(), 1000);
        sort.shrink(500);
        assert_eq!(pool.reserved(), 500);
    }

    #[test]
    fn a_runtime_s_pool_is_wrapped_once_and_keeps_its_limit() {
        let runtime = RuntimeEnvBuilder::new()
            .with_memory_limit(4096, 1.0)
            .build_arc()
            .unwrap();
        let wrapped = unspilled_repartitions(runtime);
        assert!(wrapped.memory_pool.is::<UnspilledRepartitions>());
        assert!(matches!(
            wrapped.memory_pool.memory_limit(),
            MemoryLimit::Finite(4096)
        ));
        let again = unspilled_repartitions(Arc::clone(&wrapped));
        assert!(Arc::ptr_eq(&again, &wrapped));
    }
}

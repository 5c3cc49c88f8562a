//! Running numbered tasks on a fixed number of worker threads: each worker
//! takes the next task until all are taken, the first error stops them,
//! and so does cancellation. The rechunk's stages, the blockwise writes
//! (`COPY` of a selection, of a transform) and the dense reduction's folds
//! run their blocks this way, so at most `workers` tasks hold memory at
//! once; a task's box is a block of a
//! [`BlockGrid::covering`](crate::table::BlockGrid::covering) grid or of
//! an operator's [`BlockRead`](crate::table::BlockRead).
//!
//! On a cluster, a round of tasks is a stage of the query's plan run on the
//! workers; the session runs each round to its end
//! ([`run_cluster_tasks`]) before the next.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use datafusion::arrow::array::AsArray;
use datafusion::arrow::datatypes::UInt64Type;
use datafusion::common::{exec_err, DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{execute_stream, ExecutionPlan};
use futures::{Future, StreamExt, TryStreamExt};
use tokio::sync::OnceCell;

use crate::config::MAX_THREADS;
use crate::error::{catch_panic, Panicked};

/// The workers to run `tasks` tasks of `per_task` bytes each on: at most
/// `threads` and one a task, fewer when that many do not fit `limit`
/// (at least one: whether one fits is the caller's to check, naming what
/// it plans).
pub(crate) fn fitting_workers(threads: u64, tasks: u64, per_task: u64, limit: Option<u64>) -> u64 {
    let most = threads.clamp(1, tasks.max(1));
    match limit.and_then(|limit| limit.checked_div(per_task)) {
        Some(fit) => most.min(fit).max(1),
        None => most,
    }
}

/// Runs tasks `0..tasks` on `workers` threads (at least one, at most
/// [`MAX_THREADS`] and at most one a task; the calling thread is one of
/// them, and a thread the system will not start leaves fewer). Each worker
/// makes its state with `init` and runs `task(state, number)`, which
/// returns a count (bytes written); the counts are summed. Returns the
/// first error (a task that panics is an error naming it), or the sum;
/// when `cancelled` is set the workers stop taking tasks and the sum
/// covers the tasks that ran (the caller checks the flag).
pub(crate) fn run_tasks<S: Send, E: Send + From<Panicked>>(
    tasks: u64,
    workers: usize,
    cancelled: &AtomicBool,
    init: impl Fn() -> S + Sync,
    task: impl Fn(&mut S, u64) -> Result<u64, E> + Sync,
) -> Result<u64, E> {
    run_tasks_keeping_states(tasks, workers, cancelled, init, task).map(|(sum, _)| sum)
}

/// [`run_tasks`], giving back each worker's state as its last task left it
/// beside the sum (what a reduction merges).
pub(crate) fn run_tasks_keeping_states<S: Send, E: Send + From<Panicked>>(
    tasks: u64,
    workers: usize,
    cancelled: &AtomicBool,
    init: impl Fn() -> S + Sync,
    task: impl Fn(&mut S, u64) -> Result<u64, E> + Sync,
) -> Result<(u64, Vec<S>), E> {
    let workers = workers
        .min(MAX_THREADS)
        .min(usize::try_from(tasks).unwrap_or(usize::MAX))
        .max(1);
    let next = AtomicU64::new(0);
    let total = AtomicU64::new(0);
    let failure: Mutex<Option<E>> = Mutex::new(None);
    let failed = || failure.lock().map_or(true, |f| f.is_some());
    let fail = |e: E| {
        if let Ok(mut f) = failure.lock() {
            f.get_or_insert(e);
        }
    };
    let states: Mutex<Vec<S>> = Mutex::new(Vec::with_capacity(workers));
    let work = || {
        let mut state = match catch_panic("task runner", &init) {
            Ok(state) => state,
            Err(p) => return fail(p.into()),
        };
        loop {
            let number = next.fetch_add(1, Ordering::Relaxed);
            if number >= tasks || cancelled.load(Ordering::Relaxed) || failed() {
                break;
            }
            let outcome = catch_panic(&format!("task ({number} of {tasks})"), || {
                task(&mut state, number)
            });
            match outcome.unwrap_or_else(|p| Err(p.into())) {
                Ok(count) => {
                    total.fetch_add(count, Ordering::Relaxed);
                }
                Err(e) => return fail(e),
            }
        }
        if let Ok(mut states) = states.lock() {
            states.push(state);
        }
    };
    std::thread::scope(|scope| {
        for _ in 1..workers {
            let started = std::thread::Builder::new()
                .name("zarrfusion task".to_string())
                .spawn_scoped(scope, work);
            if started.is_err() {
                break;
            }
        }
        work();
    });
    match failure.into_inner() {
        Ok(Some(e)) => Err(e),
        _ => Ok((total.into_inner(), states.into_inner().unwrap_or_default())),
    }
}

/// Runs `input` (a round of tasks on a cluster's workers under the
/// gathering of their counts: each row one `UInt64` count of tasks run) to
/// its end from a blocking thread, stopping when `cancelled` says so; an
/// error unless the tasks it ran add up to `expected`. `what` names the
/// operation in errors.
pub(crate) fn run_cluster_tasks(
    handle: &tokio::runtime::Handle,
    input: Arc<dyn ExecutionPlan>,
    context: Arc<TaskContext>,
    cancelled: &dyn Fn() -> bool,
    expected: u64,
    what: &str,
) -> Result<()> {
    handle.block_on(cluster_tasks_ran(input, context, cancelled, expected, what))
}

/// Whether what a node runs before its input (a previous round's counts,
/// a detrend's fit) succeeded, once for all of the node's partitions.
pub(crate) type RanOnce = Arc<OnceCell<std::result::Result<(), String>>>;

/// Partition `partition` of `then`, once `before` ran: the first of a
/// node's partitions to get here runs it, the others wait for it, and its
/// error is every partition's.
pub(crate) fn after_once(
    ran: &RanOnce,
    before: impl Future<Output = Result<()>> + Send + 'static,
    then: Arc<dyn ExecutionPlan>,
    partition: usize,
    context: Arc<TaskContext>,
) -> SendableRecordBatchStream {
    let ran = Arc::clone(ran);
    let schema = then.schema();
    let stream = futures::stream::once(async move {
        let done = ran
            .get_or_init(|| async move { before.await.map_err(|e| e.to_string()) })
            .await;
        done.clone().map_err(DataFusionError::Execution)?;
        then.execute(partition, context)
    })
    .try_flatten();
    Box::pin(RecordBatchStreamAdapter::new(schema, stream.boxed()))
}

/// [`run_cluster_tasks`] from an async task.
pub(crate) async fn cluster_tasks_ran(
    input: Arc<dyn ExecutionPlan>,
    context: Arc<TaskContext>,
    cancelled: impl Fn() -> bool,
    expected: u64,
    what: &str,
) -> Result<()> {
    let mut stream = execute_stream(input, context)?;
    let mut ran = 0u64;
    loop {
        tokio::select! {
            batch = stream.next() => match batch {
                None => break,
                Some(batch) => {
                    let batch = batch?;
                    let counts = batch.column(0).as_primitive_opt::<UInt64Type>().ok_or_else(|| {
                        DataFusionError::Internal(format!("a count of {what}'s tasks is not a UInt64"))
                    })?;
                    ran = ran.saturating_add(counts.iter().flatten().fold(0u64, u64::saturating_add));
                }
            },
            _ = tokio::time::sleep(std::time::Duration::from_millis(100)) => {
                if cancelled() {
                    return exec_err!("{what} was cancelled");
                }
            }
        }
    }
    if ran != expected {
        return exec_err!("{what}'s tasks on the cluster ran {ran} of its {expected} tasks");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_are_as_many_as_fit() {
        // As many as threads and tasks allow when nothing limits them.
        assert_eq!(fitting_workers(8, 100, 10, None), 8);
        assert_eq!(fitting_workers(8, 3, 10, None), 3);
        assert_eq!(fitting_workers(0, 0, 10, None), 1);
        // Fewer when the limit holds fewer tasks at once.
        assert_eq!(fitting_workers(8, 100, 10, Some(35)), 3);
        assert_eq!(fitting_workers(8, 100, 10, Some(1000)), 8);
        // At least one, even when one does not fit (the caller refuses).
        assert_eq!(fitting_workers(8, 100, 10, Some(5)), 1);
        assert_eq!(fitting_workers(8, 100, 0, Some(5)), 8);
    }

    #[test]
    fn every_task_runs_once_and_the_first_error_stops_the_rest() {
        let cancelled = AtomicBool::new(false);
        let sum = run_tasks(100, 3, &cancelled, || (), |_, n| Ok::<_, String>(n)).unwrap();
        assert_eq!(sum, (0..100).sum::<u64>());
        let ran = AtomicU64::new(0);
        let err = run_tasks(
            1000,
            2,
            &cancelled,
            || (),
            |_, n| {
                ran.fetch_add(1, Ordering::Relaxed);
                if n == 5 {
                    Err(format!("task {n} failed"))
                } else {
                    Ok(1)
                }
            },
        )
        .unwrap_err();
        assert_eq!(err, "task 5 failed");
        assert!(ran.into_inner() < 1000);
    }

    #[test]
    fn each_worker_gives_back_its_state() {
        // Each worker's state: the tasks it ran.
        let run = |workers: usize, cancelled: bool| {
            let cancelled = AtomicBool::new(cancelled);
            run_tasks_keeping_states(
                50,
                workers,
                &cancelled,
                Vec::new,
                |seen: &mut Vec<u64>, n| {
                    seen.push(n);
                    Ok::<_, String>(1)
                },
            )
            .unwrap()
        };
        let (sum, states) = run(3, false);
        assert_eq!(sum, 50);
        assert!((1..=3).contains(&states.len()), "{} states", states.len());
        let mut seen: Vec<u64> = states.into_iter().flatten().collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..50).collect::<Vec<_>>());
        // Cancelled before it starts: no task runs, every worker's state
        // comes back untouched.
        let (sum, states) = run(2, true);
        assert_eq!(sum, 0);
        assert!(states.iter().all(Vec::is_empty));
    }

    /// `threads` of 2^64 - 1 given to a rechunk started threads until the
    /// system refused one: at most one a task now, at most `MAX_THREADS`.
    #[test]
    fn workers_are_at_most_one_a_task_and_at_most_max_threads() {
        let cancelled = AtomicBool::new(false);
        for (tasks, most) in [(3u64, 3usize), (5000, MAX_THREADS), (0, 1)] {
            let threads = Mutex::new(std::collections::HashSet::new());
            let sum = run_tasks(
                tasks,
                usize::MAX,
                &cancelled,
                || {
                    if let Ok(mut t) = threads.lock() {
                        t.insert(std::thread::current().id());
                    }
                },
                |_, n| Ok::<_, String>(n),
            )
            .unwrap();
            assert_eq!(sum, (0..tasks).sum::<u64>());
            let used = threads.into_inner().unwrap().len();
            assert!((1..=most).contains(&used), "{tasks} tasks: {used} threads");
        }
    }

    #[test]
    fn a_task_or_state_that_panics_is_an_error_naming_it() {
        let cancelled = AtomicBool::new(false);
        let err = run_tasks(
            1000,
            2,
            &cancelled,
            || (),
            |_, n| {
                // A bug at task 7: an index out of bounds.
                let sizes: Vec<u64> = if n == 7 { Vec::new() } else { vec![1] };
                Ok::<_, String>(sizes[0])
            },
        )
        .unwrap_err();
        assert!(
            err.starts_with("internal error: a task (7 of 1000) panicked: index out of bounds"),
            "{err}"
        );
        let err = run_tasks(
            3,
            2,
            &cancelled,
            || -> u8 { panic!("no state") },
            |_, _| Ok::<_, String>(1),
        )
        .unwrap_err();
        assert_eq!(err, "internal error: a task runner panicked: no state");
    }
}

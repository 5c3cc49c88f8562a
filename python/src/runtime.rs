//! The Tokio runtime the bindings run queries on, and waiting for a future
//! with the GIL released while still answering Ctrl-C.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use pyo3::prelude::*;
use tokio::runtime::Runtime;
use tokio::sync::Notify;

use crate::errors::general_error;

/// The process-wide multi-threaded runtime. A process forked from the one
/// that started it has none of its threads, so it is refused there (with
/// the way out) instead of waiting for them forever.
pub fn runtime() -> PyResult<&'static Runtime> {
    static RUNTIME: OnceLock<(u32, std::io::Result<Runtime>)> = OnceLock::new();
    let (pid, runtime) = RUNTIME.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("zarrfusion")
            .build();
        (std::process::id(), runtime)
    });
    if *pid != std::process::id() {
        return Err(general_error(FORKED));
    }
    runtime
        .as_ref()
        .map_err(|e| general_error(format!("cannot start the Tokio runtime: {e}")))
}

/// Why zarrfusion refuses to run in a forked process.
pub const FORKED: &str = "this process was forked from one that had started zarrfusion, whose \
    threads do not survive fork(); start worker processes with 'spawn' or 'forkserver' (for a \
    DataLoader: multiprocessing_context='spawn')";

/// How often a waiting thread checks for Ctrl-C.
pub const SIGNAL_CHECK: Duration = Duration::from_millis(100);

/// Runs `future` to completion with the GIL released. Every
/// [`SIGNAL_CHECK`] the GIL is taken back briefly to run Python's signal
/// handlers; a `KeyboardInterrupt` drops the future, which cancels the
/// query, and is raised. The checks are woken by a thread of their own as
/// well as by the runtime's timer, which a runtime whose workers are all
/// busy may not drive in time.
pub fn wait_for<F>(py: Python<'_>, future: F) -> PyResult<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    let runtime = runtime()?;
    let tick = Arc::new(Notify::new());
    let done = Arc::new(AtomicBool::new(false));
    // Without the thread (the system refuses one), the timer alone wakes
    // the checks.
    let _ticker = {
        let (tick, done) = (Arc::clone(&tick), Arc::clone(&done));
        std::thread::Builder::new()
            .name("zarrfusion-signals".into())
            .spawn(move || {
                while !done.load(Ordering::Relaxed) {
                    std::thread::sleep(SIGNAL_CHECK);
                    tick.notify_one();
                }
            })
    };
    let waited = py.detach(|| {
        runtime.block_on(async {
            tokio::pin!(future);
            loop {
                tokio::select! {
                    output = &mut future => return Ok(output),
                    _ = tick.notified() => Python::attach(|py| py.check_signals())?,
                    _ = tokio::time::sleep(SIGNAL_CHECK) => {
                        Python::attach(|py| py.check_signals())?;
                    }
                }
            }
        })
    });
    done.store(true, Ordering::Relaxed);
    waited
}

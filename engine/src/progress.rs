//! Progress of the scans of the running query: blocks done out of blocks planned.
//!
//! The shell reads it to draw a progress bar; scans update it as they go.
//! It lives in the session's configuration as an extension.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of scan blocks, shared between the scans and whoever watches.
#[derive(Debug, Default)]
pub struct ScanProgress {
    total: AtomicU64,
    done: AtomicU64,
}

impl ScanProgress {
    /// Starts counting afresh (before a query).
    pub fn reset(&self) {
        self.total.store(0, Ordering::Relaxed);
        self.done.store(0, Ordering::Relaxed);
    }

    /// A scan partition announces the blocks it will read.
    pub fn add_planned(&self, blocks: u64) {
        self.total.fetch_add(blocks, Ordering::Relaxed);
    }

    /// A block has been read.
    pub fn add_done(&self, blocks: u64) {
        self.done.fetch_add(blocks, Ordering::Relaxed);
    }

    /// `(done, total)`.
    pub fn snapshot(&self) -> (u64, u64) {
        (
            self.done.load(Ordering::Relaxed),
            self.total.load(Ordering::Relaxed),
        )
    }
}

//! The valid-window index while it is being built: blocks fill in one by
//! one, in the background, and a loader can start on the blocks it needs
//! before the rest are read.
//!
//! Building the index reads the whole dataset once, which takes seconds to
//! minutes. Nothing about the first batches needs all of it: with one rank
//! and block (or no) shuffle, the loader only needs the index of the blocks
//! entering its buffer, and it decodes those blocks anyway. So
//! [`Windows::new`](super::Windows::new) returns at once and
//!
//! - background threads index the blocks in storage order (after those a
//!   sharded loader asks for first, [`LiveIndex::prefer`]), at the lowest
//!   scheduling priority, so they use the cores a loader leaves idle;
//! - a loader that needs a block not indexed yet decodes it itself and
//!   publishes that block's index from the same decoded values (the
//!   background threads skip blocks someone else has claimed, and pause
//!   while a loader waits);
//! - what needs the whole index (the number of windows, sharding, a full
//!   shuffle, the index cache) indexes the blocks nobody has started in its
//!   own thread, then waits for the last block.
//!
//! A block that cannot be read fails the whole index: everyone waiting gets
//! the error, naming the store, array and chunk.
//!
//! From an object store, the chunks of the blocks the background threads
//! will read are requested ahead of them, in storage order
//! ([`crate::table::ReadAheadPlan`]).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::cache::IndexCache;
use super::geometry::WindowGrid;
use super::index::{block_read_ahead, index_block, read_blocks_ahead, BlockIndex, ValidIndex};
use super::sample::SampleLayout;
use super::sources::Sources;
use super::{IndexSource, WindowError};
use crate::table::TableReadAhead;
use crate::zarr::ChunkBufferPool;

/// How often a paused background thread looks again.
const PAUSE: Duration = Duration::from_millis(2);

/// An index whose blocks fill in as they are read.
pub struct LiveIndex {
    blocks: Vec<OnceLock<Arc<BlockIndex>>>,
    /// Set by whoever starts reading a block, so it is read once.
    claimed: Vec<AtomicBool>,
    progress: Mutex<Progress>,
    changed: Condvar,
    complete: OnceLock<ValidIndex>,
    source: OnceLock<IndexSource>,
    /// Loaders waiting for a block's index: background threads pause.
    demand: AtomicUsize,
    cancelled: AtomicBool,
    started: Instant,
    /// Where the finished index is kept, and its key.
    cache: Option<(IndexCache, String)>,
    /// What to read, while the index is incomplete.
    job: Option<IndexJob>,
    /// The next block in storage order not taken by the background threads.
    next: AtomicUsize,
    /// Blocks to index before the rest, in order (see [`Self::prefer`]).
    preferred: Mutex<VecDeque<usize>>,
    /// Buffers the blocks of this dataset are read into, shared by the
    /// index threads and the loaders.
    buffers: ChunkBufferPool,
    /// The chunks of the blocks in the order the index threads take them
    /// (preferred, then storage order), read ahead of them (remote stores).
    read_ahead: Mutex<Option<Arc<IndexReadAhead>>>,
    /// Threads reading the index in the background.
    threads: usize,
}

#[derive(Debug, Default)]
struct Progress {
    indexed: usize,
    failure: Option<String>,
}

impl std::fmt::Debug for LiveIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (done, blocks) = self.progress();
        f.debug_struct("LiveIndex")
            .field("indexed", &done)
            .field("blocks", &blocks)
            .finish_non_exhaustive()
    }
}

/// What the background threads need to index blocks.
pub struct IndexJob {
    /// The sources read (the reference's chunks are read ahead).
    pub sources: Arc<Sources>,
    /// The window grid.
    pub grid: Arc<WindowGrid>,
    /// What a sample holds, and the rules it must meet.
    pub layout: Arc<SampleLayout>,
    /// Chunk reads kept in flight ahead of the index threads (a remote
    /// store).
    pub io_concurrency: usize,
}

impl LiveIndex {
    /// An index that is already complete (loaded from the cache, or needing no read).
    pub fn finished(index: ValidIndex, source: IndexSource) -> Arc<Self> {
        let live = Self::pending(index.blocks.len(), None);
        for (slot, block) in live.blocks.iter().zip(&index.blocks) {
            let _ = slot.set(Arc::clone(block));
        }
        if let Ok(mut p) = live.progress.lock() {
            p.indexed = index.blocks.len();
        }
        let _ = live.complete.set(index);
        let _ = live.source.set(source);
        Arc::new(live)
    }

    fn pending(blocks: usize, cache: Option<(IndexCache, String)>) -> Self {
        Self {
            blocks: (0..blocks).map(|_| OnceLock::new()).collect(),
            claimed: (0..blocks).map(|_| AtomicBool::new(false)).collect(),
            progress: Mutex::new(Progress::default()),
            changed: Condvar::new(),
            complete: OnceLock::new(),
            source: OnceLock::new(),
            demand: AtomicUsize::new(0),
            cancelled: AtomicBool::new(false),
            started: Instant::now(),
            cache,
            job: None,
            next: AtomicUsize::new(0),
            preferred: Mutex::default(),
            buffers: ChunkBufferPool::new(),
            read_ahead: Mutex::default(),
            threads: 0,
        }
    }

    /// Starts indexing `job`'s blocks on `threads` background threads (0:
    /// only as loaders read blocks and when someone waits for the whole
    /// index); the finished index goes to `cache` (directory and key)
    /// before anyone sees it complete.
    pub fn build(job: IndexJob, threads: usize, cache: Option<(IndexCache, String)>) -> Arc<Self> {
        let blocks = job.grid.blocks.len();
        let mut live = Self::pending(blocks, cache);
        live.threads = threads;
        live.read_ahead = Mutex::new(IndexReadAhead::new(&job, (0..blocks).collect(), threads));
        live.job = Some(job);
        let live = Arc::new(live);
        if blocks == 0 {
            live.finish();
        }
        for _ in 0..threads.min(blocks) {
            let live = Arc::clone(&live);
            std::thread::spawn(move || {
                lower_thread_priority();
                live.index_in_background();
            });
        }
        live
    }

    fn index_in_background(&self) {
        loop {
            while self.demand.load(Ordering::Acquire) > 0 && !self.is_cancelled() {
                std::thread::sleep(PAUSE);
            }
            if self.is_cancelled() || !matches!(self.index_next_block(), Ok(true)) {
                return;
            }
        }
    }

    /// Makes the blocks the index reads next `blocks`, in order (those not
    /// indexed yet), before the rest in storage order: what a sharded
    /// loader needs to know first (see [`super::order::Quota`]).
    pub fn prefer(&self, blocks: Vec<usize>) {
        if self.complete.get().is_some() {
            return;
        }
        let blocks: VecDeque<usize> = blocks
            .into_iter()
            .filter(|&b| b < self.blocks.len() && self.blocks[b].get().is_none())
            .collect();
        // The chunks read ahead follow: the preferred blocks, then those
        // left in storage order.
        if let (Some(job), Ok(mut read_ahead)) = (&self.job, self.read_ahead.lock()) {
            if read_ahead.is_some() {
                let next = self.next.load(Ordering::Relaxed);
                let preferred: std::collections::HashSet<usize> = blocks.iter().copied().collect();
                let order = blocks
                    .iter()
                    .copied()
                    .chain((next..self.blocks.len()).filter(|b| !preferred.contains(b)))
                    .filter(|&b| !self.claimed[b].load(Ordering::Acquire))
                    .collect();
                *read_ahead = IndexReadAhead::new(job, order, self.threads);
            }
        }
        if let Ok(mut preferred) = self.preferred.lock() {
            *preferred = blocks;
        }
    }

    /// Reads and indexes the next block nobody has claimed (a preferred
    /// one first), in the calling thread; `Ok(false)` when there is none
    /// left.
    pub fn index_next_block(&self) -> Result<bool, WindowError> {
        let Some(job) = &self.job else {
            return Ok(false);
        };
        loop {
            let preferred = self.preferred.lock().ok().and_then(|mut p| p.pop_front());
            let id = match preferred {
                Some(id) => id,
                None => self.next.fetch_add(1, Ordering::Relaxed),
            };
            if id >= job.grid.blocks.len() || self.has_failed() {
                return Ok(false);
            }
            if !self.claim(id) {
                // Read by someone else: the read-ahead moves past it.
                self.done_reading(id);
                continue;
            }
            let block = &job.grid.blocks[id];
            let data = job.sources.read(&block.extent, &self.buffers);
            self.done_reading(id);
            return match data {
                Ok(data) => {
                    let index = index_block(&job.grid, block, &data, &job.layout, &job.sources);
                    self.publish(id, index);
                    Ok(true)
                }
                Err(e) => {
                    self.fail(e.to_string());
                    Err(e)
                }
            };
        }
    }

    /// Says the read-ahead window block `id` is read (or skipped).
    fn done_reading(&self, id: usize) {
        let read_ahead = self.read_ahead.lock().ok().and_then(|r| r.clone());
        if let Some(read_ahead) = read_ahead {
            read_ahead.done_with(id);
        }
    }

    /// The buffers blocks of this dataset are read into.
    pub fn buffers(&self) -> &ChunkBufferPool {
        &self.buffers
    }

    /// Claims block `id` for reading; `false` when someone already has.
    pub fn claim(&self, id: usize) -> bool {
        !self.claimed[id].swap(true, Ordering::AcqRel) && self.blocks[id].get().is_none()
    }

    /// Records the index of block `id` (the first record wins; any other is
    /// the same, from the same data).
    pub fn publish(&self, id: usize, index: BlockIndex) {
        if self.blocks[id].set(Arc::new(index)).is_err() {
            return;
        }
        let last = match self.progress.lock() {
            Ok(mut p) => {
                p.indexed += 1;
                p.indexed == self.blocks.len()
            }
            Err(_) => false,
        };
        if last {
            self.finish();
        } else {
            self.changed.notify_all();
        }
    }

    /// Completes the index (every block is in), storing it in the cache first.
    fn finish(&self) {
        let blocks = self
            .blocks
            .iter()
            .filter_map(|b| b.get().map(Arc::clone))
            .collect();
        let index = ValidIndex::from_shared(blocks);
        if let Some((cache, key)) = &self.cache {
            if let Err(e) = cache.store(key, &index) {
                log::warn!("window index not cached in {}: {e}", cache.dir().display());
            }
        }
        let seconds = self.started.elapsed().as_secs_f64();
        // Under the lock, so no waiter misses the wake-up.
        let guard = self.progress.lock();
        let _ = self.source.set(IndexSource::Built { seconds });
        let _ = self.complete.set(index);
        drop(guard);
        self.changed.notify_all();
    }

    /// Fails the index: a block could not be read.
    pub fn fail(&self, message: String) {
        if let Ok(mut p) = self.progress.lock() {
            p.failure.get_or_insert(message);
        }
        self.changed.notify_all();
    }

    fn has_failed(&self) -> bool {
        self.progress.lock().map_or(true, |p| p.failure.is_some())
    }

    /// Stops the background threads (the windows are gone).
    pub fn cancel(&self) {
        let guard = self.progress.lock();
        self.cancelled.store(true, Ordering::Release);
        drop(guard);
        self.changed.notify_all();
    }

    fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    /// The index of block `id` when it is known, without waiting.
    pub fn ready_block(&self, id: usize) -> Option<Arc<BlockIndex>> {
        self.blocks[id].get().map(Arc::clone)
    }

    /// Runs `read` (which publishes blocks) while background threads pause.
    pub fn with_priority<T>(&self, read: impl FnOnce() -> T) -> T {
        self.demand.fetch_add(1, Ordering::AcqRel);
        let out = read();
        self.demand.fetch_sub(1, Ordering::AcqRel);
        out
    }

    /// The whole index, waiting up to `timeout` for the last block;
    /// `Ok(None)` when it is not complete yet.
    pub fn wait_index(&self, timeout: Duration) -> Result<Option<&ValidIndex>, WindowError> {
        let deadline = Instant::now() + timeout;
        let mut progress = self
            .progress
            .lock()
            .map_err(|_| WindowError::Internal("the window index's lock is poisoned".into()))?;
        loop {
            if let Some(failure) = &progress.failure {
                return Err(WindowError::Read(failure.clone()));
            }
            if let Some(index) = self.complete.get() {
                return Ok(Some(index));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || self.is_cancelled() {
                return Ok(None);
            }
            progress = self
                .changed
                .wait_timeout(progress, left)
                .map_err(|_| WindowError::Internal("the window index's lock is poisoned".into()))?
                .0;
        }
    }

    /// Waits up to `timeout` for another block to be indexed (or the index
    /// to fail or be cancelled).
    pub fn wait_block(&self, timeout: Duration) -> Result<(), WindowError> {
        let progress = self
            .progress
            .lock()
            .map_err(|_| WindowError::Internal("the window index's lock is poisoned".into()))?;
        if let Some(failure) = &progress.failure {
            return Err(WindowError::Read(failure.clone()));
        }
        if self.complete.get().is_some() || self.is_cancelled() {
            return Ok(());
        }
        let progress = self
            .changed
            .wait_timeout(progress, timeout)
            .map_err(|_| WindowError::Internal("the window index's lock is poisoned".into()))?
            .0;
        match &progress.failure {
            Some(failure) => Err(WindowError::Read(failure.clone())),
            None => Ok(()),
        }
    }

    /// The whole index: indexes the blocks nobody has started in the
    /// calling thread, then waits for the last block.
    pub fn index(&self) -> Result<&ValidIndex, WindowError> {
        while self.index_next_block()? {}
        loop {
            if let Some(index) = self.wait_index(Duration::from_secs(3600))? {
                return Ok(index);
            }
            if self.is_cancelled() {
                return Err(WindowError::Internal(
                    "the window index was cancelled".into(),
                ));
            }
        }
    }

    /// Where the index came from (waits for it to be complete).
    pub fn source(&self) -> Result<IndexSource, WindowError> {
        self.index()?;
        self.source
            .get()
            .copied()
            .ok_or_else(|| WindowError::Internal("a complete index without a source".into()))
    }

    /// Blocks indexed so far, and in all.
    pub fn progress(&self) -> (usize, usize) {
        let done = self.progress.lock().map_or(0, |p| p.indexed);
        (done, self.blocks.len())
    }
}

/// The chunks of blocks read ahead of the index threads, in the order
/// they take the blocks.
struct IndexReadAhead {
    window: TableReadAhead,
    /// Each block's number in the window's order (`u64::MAX`: not in it).
    number: Vec<u64>,
}

impl IndexReadAhead {
    /// The read-ahead of `order`'s blocks (`None` for local stores).
    fn new(job: &IndexJob, order: Vec<usize>, threads: usize) -> Option<Arc<Self>> {
        let plans = block_read_ahead(&job.sources, &job.grid, job.io_concurrency, threads, None)?;
        let mut number = vec![u64::MAX; job.grid.blocks.len()];
        for (n, &b) in order.iter().enumerate() {
            number[b] = n as u64;
        }
        let window = read_blocks_ahead(&job.sources, &job.grid, order, plans, threads)?;
        Some(Arc::new(Self { window, number }))
    }

    /// Block `id` is read (or skipped).
    fn done_with(&self, id: usize) {
        if let Some(&n) = self.number.get(id).filter(|&&n| n != u64::MAX) {
            self.window.done_with(n);
        }
    }
}

/// Gives the calling thread the lowest scheduling priority (Linux: nice 19
/// for this thread only), so background indexing yields to loader threads.
fn lower_thread_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: plain system calls on the calling thread's own id.
    unsafe {
        let tid = libc::gettid();
        if libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 19) != 0 {
            log::debug!("window index threads keep the default priority");
        }
    }
}

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
//! With a cache directory, processes building the same index (DataLoader
//! workers, ranks on one machine) share its blocks ([`super::shared`]): a
//! block another process has claimed is not read again but waited for,
//! polled by whoever waits for blocks (every few milliseconds in a
//! directory, a few times a second in an object store).
//!
//! The background threads take blocks in one order, decided block by
//! block as the first of them gets there (`Schedule`): preferred blocks
//! first, then storage order, skipping blocks someone has claimed. From an
//! object store, the chunks of the blocks next in that order are requested
//! ahead of the threads ([`crate::table::ReadAheadPlan`]); the read-ahead
//! decides the order as it gets there, so the threads then take the blocks
//! it read, and blocks preferred later follow those already requested.
//! While someone reads the blocks in that order (background threads, a
//! caller waiting for the whole index, or a loader's epoch indexing what
//! its quota needs), a block shared with other processes is claimed as
//! the order decides it: the read-ahead requests only blocks this process
//! reads, and skips those others hold. Without background threads the
//! read-ahead starts with the first block read, after a loader has said
//! which blocks it needs first.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use super::cache::IndexCache;
use super::geometry::WindowGrid;
use super::index::{block_read_ahead, index_block, read_blocks_ahead, BlockIndex, ValidIndex};
use super::sample::SampleLayout;
use super::shared::{Claim, SharedBlocks};
use super::sources::Sources;
use super::{IndexSource, WindowError};
use crate::error::{catch_panic, lock};
use crate::table::{ReadAheadPlan, TableReadAhead};
use crate::zarr::ChunkBufferPool;

/// Opens an index's read-ahead (see [`LiveIndex::start_read_ahead`]).
type StartReadAhead = Box<dyn FnOnce() -> Option<TableReadAhead> + Send>;

/// How often a paused background thread looks again.
const PAUSE: Duration = Duration::from_millis(2);

/// Blocks other processes read that a waiter looks for at a time (the
/// first it needs).
const POLLED: usize = 16;

/// An index whose blocks fill in as they are read.
pub struct LiveIndex {
    blocks: Vec<OnceLock<Arc<BlockIndex>>>,
    progress: Mutex<Progress>,
    changed: Condvar,
    complete: OnceLock<ValidIndex>,
    source: OnceLock<IndexSource>,
    /// Loaders waiting for a block's index: background threads pause.
    demand: AtomicUsize,
    cancelled: AtomicBool,
    /// The background threads stop (see [`Self::stop_background`]).
    foreground_only: AtomicBool,
    /// Someone has waited for the whole index.
    whole_wanted: AtomicBool,
    /// Whether background threads read the blocks in the schedule's order.
    background: AtomicBool,
    /// Readers indexing blocks in their own threads now ([`Self::reading`]).
    readers: Mutex<usize>,
    started: Instant,
    /// Where the finished index is kept, and its key.
    cache: Option<(IndexCache, String)>,
    /// What to read, while the index is incomplete.
    job: Option<IndexJob>,
    /// The order the blocks are indexed in, and who has claimed which.
    schedule: Arc<Schedule>,
    /// Buffers the blocks of this dataset are read into, shared by the
    /// index threads and the loaders.
    buffers: ChunkBufferPool,
    /// The chunks of the blocks next in the schedule, read ahead of the
    /// threads that index them (remote stores), until the index is
    /// complete.
    read_ahead: Mutex<Option<TableReadAhead>>,
    /// Starts the read-ahead when the first block is read, where no
    /// background thread starts reading at once: by then a loader has said
    /// which blocks it needs first ([`Self::prefer`]), so the read-ahead
    /// does not decide the first blocks of the storage order before them.
    start_read_ahead: Mutex<Option<StartReadAhead>>,
    /// What the threads and the read-ahead hold while the index is built.
    memory: IndexMemory,
    /// Blocks shared with other processes building the same index.
    shared: Option<Arc<SharedBlocks>>,
    /// Blocks other processes are reading, in the order they were met.
    remote: Mutex<Remote>,
    /// Blocks indexed from values this process read, and taken from other
    /// processes.
    read: AtomicUsize,
    from_others: AtomicUsize,
}

/// The blocks other processes are reading, and when their owners were
/// last checked.
#[derive(Debug, Default)]
struct Remote {
    blocks: Vec<usize>,
    /// When the blocks were last looked for (at most once a poll
    /// interval: in an object store each look is requests).
    polled: Option<Instant>,
    owners_checked: Option<Instant>,
}

/// Where the blocks of an index came from so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexCounts {
    /// Blocks in all.
    pub blocks: usize,
    /// Blocks indexed (from any source).
    pub indexed: usize,
    /// Blocks indexed from values this process read.
    pub read: usize,
    /// Blocks indexed by other processes sharing the cache directory.
    pub from_other_processes: usize,
}

/// The memory the background indexing holds at its peak while the index
/// is being built (none once it is complete), by part (bytes).
///
/// Under a memory limit the indexing takes at most half of it
/// (`IndexMemory::plan`): as many threads as blocks fit (none when one
/// does not: blocks are then indexed only by the loaders that read them
/// and by whoever waits for the whole index), and a read-ahead in what the
/// threads leave of that half.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexMemory {
    /// Background threads indexing blocks.
    pub threads: usize,
    /// A block of every source decoded by each thread.
    pub decoding: usize,
    /// Chunks read ahead of the threads from an object store.
    pub read_ahead: usize,
}

impl IndexMemory {
    /// All the parts.
    pub fn total(&self) -> usize {
        self.decoding.saturating_add(self.read_ahead)
    }

    /// The threads (of `threads` asked for) and read-ahead that indexing
    /// `job`'s blocks can have within half of `memory_limit` (`None`: no
    /// limit), and the read-ahead's plans (`None` when nothing is read
    /// ahead).
    fn plan(
        job: &IndexJob,
        threads: usize,
        memory_limit: Option<usize>,
    ) -> (Self, Option<Vec<ReadAheadPlan>>) {
        let block =
            usize::try_from(job.sources.largest_block_bytes(&job.grid)).unwrap_or(usize::MAX);
        let room = memory_limit.map(|limit| limit / 2);
        let threads = match room {
            Some(room) => threads.min(room.checked_div(block).unwrap_or(threads)),
            None => threads,
        };
        let decoding = threads.saturating_mul(block);
        // The index threads and a loader waiting for the blocks it needs
        // (see [`LiveIndex::index_next_block`]) read at once.
        let plans = block_read_ahead(
            &job.sources,
            &job.grid,
            job.io_concurrency,
            threads.saturating_add(1),
            room.map(|room| room.saturating_sub(decoding)),
        );
        let read_ahead = plans
            .as_ref()
            .map_or(0, |plans| plans.iter().map(ReadAheadPlan::memory).sum());
        let memory = Self {
            threads,
            decoding,
            read_ahead,
        };
        (memory, plans)
    }
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
            progress: Mutex::new(Progress::default()),
            changed: Condvar::new(),
            complete: OnceLock::new(),
            source: OnceLock::new(),
            demand: AtomicUsize::new(0),
            cancelled: AtomicBool::new(false),
            foreground_only: AtomicBool::new(false),
            whole_wanted: AtomicBool::new(false),
            background: AtomicBool::new(false),
            readers: Mutex::new(0),
            started: Instant::now(),
            cache,
            job: None,
            schedule: Arc::new(Schedule::new(blocks, None)),
            buffers: ChunkBufferPool::new(),
            read_ahead: Mutex::default(),
            start_read_ahead: Mutex::default(),
            memory: IndexMemory::default(),
            shared: None,
            remote: Mutex::default(),
            read: AtomicUsize::new(0),
            from_others: AtomicUsize::new(0),
        }
    }

    /// Starts indexing `job`'s blocks on up to `threads` background
    /// threads (0: only as loaders read blocks and when someone waits for
    /// the whole index), as many as half of `memory_limit` holds with their
    /// read-ahead (see [`IndexMemory`]); the finished index goes to `cache`
    /// (directory and key) before anyone sees it complete, and its blocks
    /// are shared there with other processes building it meanwhile.
    pub fn build(
        job: IndexJob,
        threads: usize,
        memory_limit: Option<usize>,
        cache: Option<(IndexCache, String)>,
    ) -> Arc<Self> {
        let blocks = job.grid.blocks.len();
        let shared = (cache.as_ref())
            .filter(|_| blocks > 0)
            .and_then(|(cache, key)| SharedBlocks::open(cache.dir(), key))
            .map(Arc::new);
        let mut live = Self::pending(blocks, cache);
        live.schedule = Arc::new(Schedule::new(blocks, shared.clone()));
        live.shared = shared;
        let (memory, plans) = IndexMemory::plan(&job, threads, memory_limit);
        let threads = memory.threads;
        let background = threads.min(blocks) > 0;
        if background {
            // Nothing is decided yet.
            live.background.store(true, Ordering::Release);
            live.schedule.claim_ahead(true);
        }
        if let Some(plans) = plans {
            let schedule = Arc::clone(&live.schedule);
            let (sources, grid) = (Arc::clone(&job.sources), Arc::clone(&job.grid));
            let start: StartReadAhead = Box::new(move || {
                read_blocks_ahead(
                    &sources,
                    &grid,
                    blocks as u64,
                    move |n| schedule.block_at(n),
                    plans,
                    threads.saturating_add(1),
                )
            });
            if background {
                live.read_ahead = Mutex::new(start());
            } else {
                live.start_read_ahead = Mutex::new(Some(start));
            }
        }
        live.memory = memory;
        live.job = Some(job);
        let live = Arc::new(live);
        if blocks == 0 {
            live.finish();
        }
        for spawned in 0..threads.min(blocks) {
            let index = Arc::clone(&live);
            let started = super::spawn("window index", move || {
                lower_thread_priority();
                if let Err(p) = catch_panic("window index thread", || index.index_in_background()) {
                    index.fail(p.to_string());
                }
            });
            if let Err(e) = started {
                // Fewer background threads: loaders and waiters index
                // the rest themselves.
                log::debug!("{e}");
                if spawned == 0 {
                    live.background.store(false, Ordering::Release);
                    live.stop_claiming_ahead();
                }
                break;
            }
        }
        live
    }

    fn index_in_background(&self) {
        loop {
            while self.demand.load(Ordering::Acquire) > 0 && !self.is_cancelled() {
                std::thread::sleep(PAUSE);
            }
            if self.is_cancelled()
                || self.foreground_only.load(Ordering::Acquire)
                || !matches!(self.index_next_block(), Ok(true))
            {
                return;
            }
        }
    }

    /// Makes `blocks`, in order (those not indexed yet), the next the index
    /// reads after those already next in its schedule (read ahead, or being
    /// read), before the rest in storage order: what a sharded loader needs
    /// to know first (see [`super::order::Quota`]).
    pub fn prefer(&self, blocks: Vec<usize>) {
        if self.complete.get().is_some() {
            return;
        }
        self.schedule.prefer(
            blocks
                .into_iter()
                .filter(|&b| self.blocks.get(b).is_some_and(|b| b.get().is_none())),
        );
    }

    /// Reads and indexes the next block of the schedule nobody has claimed,
    /// in the calling thread, or takes blocks other processes have indexed
    /// meanwhile (those needed first come first); `Ok(false)` when there is
    /// none left.
    pub fn index_next_block(&self) -> Result<bool, WindowError> {
        let Some(job) = &self.job else {
            return Ok(false);
        };
        if self.awaits_remote() && self.poll_remote()? {
            return Ok(true);
        }
        self.start_reading_ahead();
        loop {
            if self.has_failed() {
                return Ok(false);
            }
            let Some((number, id)) = self.schedule.take() else {
                return Ok(false);
            };
            if !self.claim_here(id) {
                // Read by someone else: the read-ahead moves past it.
                self.done_reading(number);
                continue;
            }
            match self.claim_shared(job, id) {
                Shared::Read => {}
                Shared::Known => {
                    self.done_reading(number);
                    return Ok(true);
                }
                Shared::Elsewhere => {
                    self.done_reading(number);
                    lock(&self.remote).blocks.push(id);
                    continue;
                }
            }
            return self.read_block(job, id, Some(number));
        }
    }

    /// Reads and indexes block `id` in the calling thread (`number`: its
    /// number in the schedule, for the read-ahead).
    fn read_block(
        &self,
        job: &IndexJob,
        id: usize,
        number: Option<u64>,
    ) -> Result<bool, WindowError> {
        let block = &job.grid.blocks[id];
        let data = job.sources.read(&block.extent, &self.buffers);
        if let Some(number) = number {
            self.done_reading(number);
        }
        match data {
            Ok(data) => {
                let index = index_block(&job.grid, block, &data, &job.layout, &job.sources);
                self.publish(id, index);
                Ok(true)
            }
            Err(e) => {
                self.fail(e.to_string());
                Err(e)
            }
        }
    }

    /// What to do with block `id`, claimed in this process, given the other
    /// processes sharing the index: read it, or nothing (another process
    /// has indexed it, or the whole index came from the cache), or wait for
    /// another process reading it.
    fn claim_shared(&self, job: &IndexJob, id: usize) -> Shared {
        let Some(shared) = &self.shared else {
            return Shared::Read;
        };
        let origins = job.grid.blocks[id].num_origins();
        let loaded = shared.load(id, origins);
        if shared.holds(id) {
            // Claimed when the schedule decided it (written only by a
            // process it was taken over from).
            return match loaded {
                Some(index) => {
                    self.record(id, index, true);
                    Shared::Known
                }
                None => Shared::Read,
            };
        }
        if let Some(index) = loaded {
            self.record(id, index, true);
            return Shared::Known;
        }
        if !shared.exists() && self.adopt_cached(job) {
            return Shared::Known;
        }
        match shared.claim(id) {
            // Written between the look and the claim (then taken over).
            Claim::Ours => match shared.load(id, origins) {
                Some(index) => {
                    self.record(id, index, true);
                    Shared::Known
                }
                None => Shared::Read,
            },
            Claim::Theirs => Shared::Elsewhere,
            Claim::Finished if self.adopt_cached(job) => Shared::Known,
            Claim::Finished => Shared::Read,
        }
    }

    /// Takes every block from the whole index another process finished and
    /// stored in the cache; `false` when it is not there.
    fn adopt_cached(&self, job: &IndexJob) -> bool {
        let Some(index) = (self.cache.as_ref()).and_then(|(cache, key)| cache.load(key, &job.grid))
        else {
            return false;
        };
        for (id, block) in index.blocks.iter().enumerate() {
            if self.blocks[id].get().is_none() {
                self.record(id, Arc::clone(block), true);
            }
        }
        true
    }

    /// Looks for the blocks other processes are reading (the first
    /// [`POLLED`] not indexed yet): takes those written, and reads those
    /// whose process is gone. `true` when a block was indexed.
    fn poll_remote(&self) -> Result<bool, WindowError> {
        let (Some(shared), Some(job)) = (&self.shared, &self.job) else {
            return Ok(false);
        };
        let (pending, mut check_owners) = {
            let mut remote = self.remote_with_elsewhere();
            remote.blocks.retain(|&b| self.blocks[b].get().is_none());
            if remote.blocks.is_empty() {
                return Ok(false);
            }
            if (remote.polled).is_some_and(|at| at.elapsed() < shared.poll_interval()) {
                return Ok(false);
            }
            remote.polled = Some(Instant::now());
            let check = remote
                .owners_checked
                .is_none_or(|at| at.elapsed() >= shared.owner_check_interval());
            if check {
                remote.owners_checked = Some(Instant::now());
            }
            let pending: Vec<usize> = remote.blocks.iter().take(POLLED).copied().collect();
            (pending, check)
        };
        if !shared.exists() {
            if self.adopt_cached(job) {
                return Ok(true);
            }
            // Unreadable: the blocks are read here.
            if let Some((cache, key)) = &self.cache {
                let file = IndexCache::file_name(key);
                log::warn!(
                    "window index {}/{file} unusable: its blocks are read",
                    cache.dir()
                );
            }
            self.schedule.whole_is_unusable();
            check_owners = true;
        }
        let blocks: Vec<(usize, u64)> = (pending.iter())
            .map(|&id| (id, job.grid.blocks[id].num_origins()))
            .collect();
        let mut indexed = false;
        let mut unwritten = Vec::new();
        for (id, index) in pending.into_iter().zip(shared.load_all(&blocks)) {
            match index {
                Some(index) => {
                    self.record(id, index, true);
                    indexed = true;
                }
                None => unwritten.push(id),
            }
        }
        if check_owners && !unwritten.is_empty() {
            for id in shared.abandoned(&unwritten) {
                match self.claim_shared(job, id) {
                    Shared::Elsewhere => {}
                    Shared::Known => indexed = true,
                    // Its process is gone: read it here.
                    Shared::Read => indexed |= self.read_block(job, id, None)?,
                }
            }
        }
        Ok(indexed)
    }

    /// Whether blocks other processes are reading are awaited.
    fn awaits_remote(&self) -> bool {
        if self.shared.is_none() {
            return false;
        }
        !self.remote_with_elsewhere().blocks.is_empty()
    }

    /// The blocks awaited from other processes, with those the schedule
    /// set aside as held elsewhere since the last look added to them.
    fn remote_with_elsewhere(&self) -> MutexGuard<'_, Remote> {
        let elsewhere = self.schedule.take_elsewhere();
        let mut remote = lock(&self.remote);
        remote.blocks.extend(elsewhere);
        remote
    }

    /// Says the read-ahead the block of number `number` in the schedule is
    /// read (or skipped).
    fn done_reading(&self, number: u64) {
        if let Some(read_ahead) = lock(&self.read_ahead).as_ref() {
            read_ahead.done_with(number);
        }
    }

    /// Starts the read-ahead if it waited for the first block to be read
    /// (see [`Self::start_read_ahead`]).
    fn start_reading_ahead(&self) {
        let Some(start) = lock(&self.start_read_ahead).take() else {
            return;
        };
        let read_ahead = start();
        let mut held = lock(&self.read_ahead);
        if self.complete.get().is_none() && !self.has_failed() && !self.is_cancelled() {
            *held = read_ahead;
        }
    }

    /// Drops what is read ahead (the index is complete, failed or cancelled).
    fn stop_reading_ahead(&self) {
        lock(&self.start_read_ahead).take();
        let read_ahead = lock(&self.read_ahead).take();
        drop(read_ahead);
    }

    /// What the background indexing holds at its peak while the index is
    /// built; nothing once it is complete.
    pub fn memory(&self) -> IndexMemory {
        match self.complete.get() {
            Some(_) => IndexMemory::default(),
            None => self.memory,
        }
    }

    /// The buffers blocks of this dataset are read into.
    pub fn buffers(&self) -> &ChunkBufferPool {
        &self.buffers
    }

    /// Claims block `id` for reading; `false` when someone already has
    /// (in this process; other processes sharing the index are told this
    /// one reads it).
    pub fn claim(&self, id: usize) -> bool {
        let claimed = self.claim_here(id);
        if let (true, Some(shared)) = (claimed, &self.shared) {
            shared.claim(id);
        }
        claimed
    }

    fn claim_here(&self, id: usize) -> bool {
        self.schedule.claim(id) && self.blocks[id].get().is_none()
    }

    /// Records the index of block `id`, read by this process (the first
    /// record wins; any other is the same, from the same data), and shares
    /// it with other processes.
    pub fn publish(&self, id: usize, index: BlockIndex) {
        if self.blocks[id].get().is_some() {
            return;
        }
        if let Some(shared) = &self.shared {
            shared.store(id, &index);
        }
        self.record(id, index, false);
    }

    /// Records the index of block `id`, from another process or not.
    fn record(&self, id: usize, index: impl Into<Arc<BlockIndex>>, from_others: bool) {
        if self.blocks[id].set(index.into()).is_err() {
            return;
        }
        let counter = if from_others {
            &self.from_others
        } else {
            &self.read
        };
        counter.fetch_add(1, Ordering::Relaxed);
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
            match cache.store(key, &index) {
                // Whoever still waits for a block finds the whole index.
                Ok(()) => self.shared.iter().for_each(|shared| shared.remove()),
                Err(e) => log::warn!("window index not cached in {}: {e}", cache.dir()),
            }
        }
        self.stop_reading_ahead();
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
        self.shared.iter().for_each(|shared| shared.release());
        self.stop_reading_ahead();
        self.changed.notify_all();
    }

    fn has_failed(&self) -> bool {
        self.progress.lock().map_or(true, |p| p.failure.is_some())
    }

    /// Stops the background threads after the blocks they are reading: the
    /// index fills in only as loaders read blocks or someone waits for it,
    /// in their own threads, the chunks of the blocks next in the schedule
    /// still read ahead of them (a process whose loader runs in DataLoader
    /// workers, which index what they need themselves).
    pub fn stop_background(&self) {
        self.foreground_only.store(true, Ordering::Release);
        self.background.store(false, Ordering::Release);
        self.stop_claiming_ahead();
    }

    /// Claims blocks only as readers take them, unless someone reads the
    /// blocks in the schedule's order (see [`Schedule`]).
    fn stop_claiming_ahead(&self) {
        self.claim_ahead_while_read(*lock(&self.readers));
    }

    /// Gives up claiming ahead unless someone reads the blocks in the
    /// schedule's order: background threads, a wait for the whole index,
    /// or some of `readers` ([`Self::reading`], counted under its lock).
    fn claim_ahead_while_read(&self, readers: usize) {
        if readers == 0
            && !self.background.load(Ordering::Acquire)
            && !self.whole_wanted.load(Ordering::Acquire)
        {
            self.schedule.claim_ahead(false);
        }
    }

    /// Says a reader indexes the blocks it needs in its own thread, in the
    /// schedule's order, until the guard is dropped (a loader's epoch that
    /// waits to know whether every stream fills its batches, from the
    /// first block it indexes to its end): meanwhile the blocks the
    /// schedule decides are claimed as they are decided (see
    /// `Schedule`), and those claimed and not taken when the last reader
    /// stops are given up again, unless background threads or a wait for
    /// the whole index read on.
    pub fn reading(&self) -> Reading<'_> {
        let mut readers = lock(&self.readers);
        *readers += 1;
        if *readers == 1 {
            for number in self.schedule.claim_ahead(true) {
                self.done_reading(number);
            }
        }
        Reading(self)
    }

    /// Stops the background threads (the windows are gone).
    pub fn cancel(&self) {
        let guard = self.progress.lock();
        self.cancelled.store(true, Ordering::Release);
        drop(guard);
        self.shared.iter().for_each(|shared| shared.release());
        self.stop_reading_ahead();
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
        loop {
            // Outside the lock: taking a block locks it.
            let polling = self.awaits_remote();
            if polling {
                self.poll_remote()?;
            }
            let progress = self
                .progress
                .lock()
                .map_err(|_| WindowError::Internal("the window index's lock is poisoned".into()))?;
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
            let wait = match (polling, &self.shared) {
                (true, Some(shared)) => left.min(shared.poll_interval()),
                _ => left,
            };
            drop(self.changed.wait_timeout(progress, wait).map_err(|_| {
                WindowError::Internal("the window index's lock is poisoned".into())
            })?);
        }
    }

    /// Waits up to `timeout` for another block to be indexed (or the index
    /// to fail or be cancelled).
    pub fn wait_block(&self, timeout: Duration) -> Result<(), WindowError> {
        let timeout = if self.awaits_remote() {
            if self.poll_remote()? {
                return Ok(());
            }
            timeout.min(
                self.shared
                    .as_ref()
                    .map_or(timeout, |shared| shared.poll_interval()),
            )
        } else {
            timeout
        };
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
        loop {
            if let Some(index) = self.index_for(Duration::from_secs(3600))? {
                return Ok(index);
            }
            if self.is_cancelled() {
                return Err(WindowError::Internal(
                    "the window index was cancelled".into(),
                ));
            }
        }
    }

    /// Works towards the whole index for a while: indexes the next block
    /// nobody has started in the calling thread, or when there is none,
    /// waits up to `timeout` for the last block; the index once complete.
    ///
    /// From the first call, the blocks the schedule decides are claimed
    /// as they are decided (see `Schedule`): someone reads them all.
    pub fn index_for(&self, timeout: Duration) -> Result<Option<&ValidIndex>, WindowError> {
        if let Some(index) = self.complete.get() {
            return Ok(Some(index));
        }
        if !self.whole_wanted.swap(true, Ordering::AcqRel) {
            // Blocks read ahead that other processes hold are not waited on.
            for number in self.schedule.claim_ahead(true) {
                self.done_reading(number);
            }
        }
        if self.index_next_block()? {
            return Ok(self.complete.get());
        }
        self.wait_index(timeout)
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

    /// Where the blocks indexed so far came from.
    pub fn counts(&self) -> IndexCounts {
        let (indexed, blocks) = self.progress();
        IndexCounts {
            blocks,
            indexed,
            read: self.read.load(Ordering::Relaxed),
            from_other_processes: self.from_others.load(Ordering::Relaxed),
        }
    }
}

/// A reader indexing blocks in its own thread (see [`LiveIndex::reading`]).
pub struct Reading<'a>(&'a LiveIndex);

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        let mut readers = lock(&self.0.readers);
        *readers = readers.saturating_sub(1);
        self.0.claim_ahead_while_read(*readers);
    }
}

/// What [`LiveIndex::claim_shared`] says to do with a block.
enum Shared {
    /// Read it here.
    Read,
    /// Nothing: it is indexed.
    Known,
    /// Wait: another process is reading it.
    Elsewhere,
}

/// The order blocks are indexed in, decided block by block as the first
/// reader (or the read-ahead before them) gets there: the preferred blocks,
/// then the rest in storage order, each block once, skipping blocks someone
/// has claimed.
///
/// Where the storage order meets a block another process holds, it goes on
/// from the middle of what is left of its run of blocks, and comes back to
/// the blocks it jumped over last: processes starting together each take
/// long runs of neighbouring blocks (whose windows share the chunks along
/// their borders) instead of one trailing the other block by block.
///
/// With blocks shared between processes, while someone reads the blocks
/// in this order (background threads, a caller waiting for the whole
/// index, or a loader's epoch indexing what its quota needs:
/// [`LiveIndex::reading`]) a block is claimed for this process as it is
/// decided, so the read-ahead requests only the chunks of blocks this
/// process reads; a block another process holds is skipped and waited for
/// instead ([`Schedule::take_elsewhere`]). Otherwise (no background
/// threads, stopped ones, no epoch reading) nothing guarantees a decided
/// block is read soon: a block is claimed when a reader takes it, and the
/// claims of blocks decided and not taken are given up, so other
/// processes never wait on them.
struct Schedule {
    /// Set by whoever starts reading a block, so it is read once.
    claimed: Vec<AtomicBool>,
    order: Mutex<Order>,
    /// The blocks shared with other processes.
    shared: Option<Arc<SharedBlocks>>,
    /// Whether blocks are claimed in `shared` as they are decided.
    claiming_ahead: AtomicBool,
}

#[derive(Debug, Default)]
struct Order {
    /// The blocks decided so far, by number.
    blocks: Vec<usize>,
    /// Whether each block is in `blocks`.
    decided: Vec<bool>,
    /// Numbers below this are taken by readers.
    taken: usize,
    /// Blocks to decide before the rest, in order.
    preferred: VecDeque<usize>,
    /// The runs of blocks of the storage order not gone through yet, the
    /// one being gone through first.
    runs: VecDeque<Range<usize>>,
    /// Blocks found held by other processes, not yet handed to a waiter.
    elsewhere: Vec<usize>,
    /// The whole index was found in the cache: nothing more is decided
    /// (those waiting take it from there).
    whole_found: bool,
    /// The whole index in the cache could not be taken: blocks are decided
    /// whatever their claims say of it.
    whole_unusable: bool,
}

impl Schedule {
    fn new(blocks: usize, shared: Option<Arc<SharedBlocks>>) -> Self {
        Self {
            claimed: (0..blocks).map(|_| AtomicBool::new(false)).collect(),
            order: Mutex::new(Order {
                decided: vec![false; blocks],
                runs: std::iter::once(0..blocks).collect(),
                ..Order::default()
            }),
            shared,
            claiming_ahead: AtomicBool::new(false),
        }
    }

    /// Claims blocks as they are decided from now on (`true`: the decided
    /// blocks no reader has taken are claimed now), or no more (their
    /// claims are given up). The numbers of decided blocks found held by
    /// other processes, which nobody here reads (see
    /// [`Self::take_elsewhere`]).
    fn claim_ahead(&self, on: bool) -> Vec<u64> {
        let Some(shared) = &self.shared else {
            return Vec::new();
        };
        if self.claiming_ahead.load(Ordering::Acquire) == on {
            return Vec::new();
        }
        let mut order = lock(&self.order);
        if self.claiming_ahead.swap(on, Ordering::AcqRel) == on {
            return Vec::new();
        }
        let mut elsewhere = Vec::new();
        for n in order.taken..order.blocks.len() {
            let b = order.blocks[n];
            if self.claimed[b].load(Ordering::Acquire) {
                continue;
            }
            if !on {
                shared.unclaim(b);
            } else if shared.claim_if_free(b) == Claim::Theirs {
                self.claimed[b].store(true, Ordering::Release);
                order.elsewhere.push(b);
                elsewhere.push(n as u64);
            }
        }
        elsewhere
    }

    /// Claims block `id` for reading; `false` when someone already has.
    fn claim(&self, id: usize) -> bool {
        self.claimed
            .get(id)
            .is_some_and(|c| !c.swap(true, Ordering::AcqRel))
    }

    /// Block number `n` of the order, deciding it (and those before it)
    /// when nobody has yet; `None` when there are fewer blocks left.
    fn block_at(&self, n: u64) -> Option<usize> {
        let n = usize::try_from(n).ok()?;
        let mut order = lock(&self.order);
        while order.blocks.len() <= n {
            self.decide(&mut order)?;
        }
        order.blocks.get(n).copied()
    }

    /// The next block for a reader, with its number in the order.
    fn take(&self) -> Option<(u64, usize)> {
        let mut order = lock(&self.order);
        if order.taken == order.blocks.len() {
            self.decide(&mut order)?;
        }
        let n = order.taken;
        order.taken += 1;
        Some((n as u64, order.blocks[n]))
    }

    /// Decides the next block of the order: the first preferred one, else
    /// the next in storage order, that is neither decided nor claimed (in
    /// this process, or by another sharing the blocks: such a block is
    /// claimed here and set aside for [`Self::take_elsewhere`]).
    fn decide(&self, order: &mut Order) -> Option<()> {
        if order.whole_found {
            return None;
        }
        let open =
            |order: &Order, b: usize| !order.decided[b] && !self.claimed[b].load(Ordering::Acquire);
        let block = loop {
            let (candidate, preferred) = match order.preferred.pop_front() {
                Some(b) if open(order, b) => (b, true),
                Some(_) => continue,
                None => (self.next_in_storage_order(order)?, false),
            };
            let claiming = self.claiming_ahead.load(Ordering::Acquire);
            let shared = self.shared.as_ref().filter(|_| claiming);
            match shared.map(|shared| shared.claim_if_free(candidate)) {
                Some(Claim::Theirs) => {
                    self.claimed[candidate].store(true, Ordering::Release);
                    order.elsewhere.push(candidate);
                    if !preferred {
                        jump_over(&mut order.runs, candidate);
                    }
                }
                // Waiting for it finds the whole index.
                Some(Claim::Finished) if !order.whole_unusable => {
                    self.claimed[candidate].store(true, Ordering::Release);
                    order.elsewhere.push(candidate);
                    order.whole_found = true;
                    return None;
                }
                _ => break candidate,
            }
        };
        order.decided[block] = true;
        order.blocks.push(block);
        Some(())
    }

    /// The first block of the storage order's runs neither decided nor
    /// claimed; `None` when none is left.
    fn next_in_storage_order(&self, order: &mut Order) -> Option<usize> {
        let Order { runs, decided, .. } = order;
        loop {
            let run = runs.front_mut()?;
            while run.start < run.end
                && (decided[run.start] || self.claimed[run.start].load(Ordering::Acquire))
            {
                run.start += 1;
            }
            if run.start < run.end {
                return Some(run.start);
            }
            runs.pop_front();
        }
    }

    /// The blocks found held by other processes since the last call.
    fn take_elsewhere(&self) -> Vec<usize> {
        std::mem::take(&mut lock(&self.order).elsewhere)
    }

    /// Decides the blocks left after all: the whole index in the cache
    /// cannot be taken.
    fn whole_is_unusable(&self) {
        let mut order = lock(&self.order);
        order.whole_found = false;
        order.whole_unusable = true;
    }

    /// Makes `blocks` the next decided, in order.
    fn prefer(&self, blocks: impl Iterator<Item = usize>) {
        let mut order = lock(&self.order);
        let total = order.decided.len();
        order.preferred = blocks.filter(|&b| b < total).collect();
    }
}

/// The shortest rest of a run the storage order jumps into the middle of
/// when it meets a block another process holds.
const JUMP_OVER: usize = 4;

/// The storage order met `held`, the first block of the first of `runs`,
/// held by another process: it goes on from the middle of the rest of that
/// run, the blocks before the middle left for last.
fn jump_over(runs: &mut VecDeque<Range<usize>>, held: usize) {
    let Some(run) = runs.front_mut() else {
        return;
    };
    let rest = held + 1..run.end;
    if rest.len() < JUMP_OVER {
        run.start = rest.start;
        return;
    }
    let middle = rest.start + rest.len() / 2;
    run.start = middle;
    runs.push_back(rest.start..middle);
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use object_store::memory::InMemory;

    use super::*;
    use crate::windows::cache_dir::CacheDir;
    use crate::zarr::RemoteStorage;

    /// Two schedules of `blocks` blocks sharing them through an object
    /// store (a real `object_store` in memory, with its conditional `PUT`),
    /// as two processes building one index do.
    fn two_schedules(runtime: &tokio::runtime::Runtime, blocks: usize) -> (Schedule, Schedule) {
        let cache = CacheDir::Remote {
            location: "memory://cache".into(),
            storage: Arc::new(RemoteStorage::new(
                Arc::new(InMemory::new()),
                runtime.handle().clone(),
            )),
        };
        let open = || Schedule::new(blocks, SharedBlocks::open(&cache, "k").map(Arc::new));
        (open(), open())
    }

    /// The first `n` blocks `schedule` decides from number `from` on.
    fn decided(schedule: &Schedule, from: u64, n: u64) -> Vec<usize> {
        (from..from + n)
            .filter_map(|k| schedule.block_at(k))
            .collect()
    }

    #[test]
    fn schedules_claiming_ahead_split_the_blocks_between_processes() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let (a, b) = two_schedules(&runtime, 16);
        a.claim_ahead(true);
        b.claim_ahead(true);
        // `a` reads ahead 4 blocks; `b` meets them held, skips them (known
        // held elsewhere) and goes on from the middle of the rest.
        assert_eq!(decided(&a, 0, 4), [0, 1, 2, 3]);
        assert_eq!(decided(&b, 0, 4), [8, 9, 10, 11]);
        assert_eq!(b.take_elsewhere(), [0]);
        assert_eq!(b.take_elsewhere(), Vec::<usize>::new());
        // `a` runs into `b`'s blocks in turn and jumps the same way.
        assert_eq!(decided(&a, 4, 5), [4, 5, 6, 7, 12]);
        assert_eq!(a.take_elsewhere(), [8]);
        // Each long run of neighbouring blocks; the rest comes last, past
        // the blocks the other holds (a run too short to jump into is
        // gone through block by block).
        assert_eq!(decided(&b, 4, 10), [13, 14, 15]);
        assert_eq!(b.take_elsewhere(), [12, 1, 5, 6, 7, 2, 3, 4]);
        assert_eq!(decided(&a, 9, 10), Vec::<usize>::new());
        assert_eq!(a.take_elsewhere(), [13, 14, 15, 9, 10, 11]);
        // Readers take the decided blocks in order.
        assert_eq!(a.take(), Some((0, 0)));
        assert_eq!(b.take(), Some((0, 8)));
    }

    #[test]
    fn a_schedule_alone_goes_through_the_blocks_in_storage_order() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let (a, _) = two_schedules(&runtime, 16);
        a.claim_ahead(true);
        // Blocks this process reads itself are passed over, without a jump.
        assert!(a.claim(2) && a.claim(9));
        let expected: Vec<usize> = (0..16).filter(|b| ![2, 9].contains(b)).collect();
        assert_eq!(decided(&a, 0, 16), expected);
    }

    #[test]
    fn blocks_decided_before_claiming_ahead_are_claimed_when_it_starts() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let (a, b) = two_schedules(&runtime, 8);
        // Both read ahead the first 4 blocks before anyone reads.
        for n in 0..4 {
            assert_eq!(
                (a.block_at(n), b.block_at(n)),
                (Some(n as usize), Some(n as usize))
            );
        }
        // `a` reads block 0; then both wait for the whole index: `a` claims
        // the rest of what it decided, `b` finds those held and gives up
        // reading them (by their numbers in its order), but block 0, which
        // `a` took without claiming ahead, is still `b`'s to read.
        assert_eq!(a.take(), Some((0, 0)));
        assert_eq!(a.claim_ahead(true), Vec::<u64>::new());
        assert_eq!(b.claim_ahead(true), [1, 2, 3]);
        assert_eq!(b.take_elsewhere(), [1, 2, 3]);
        assert_eq!(b.take(), Some((0, 0)));
        // `b`'s readers skip the blocks held elsewhere.
        for id in 1..4 {
            assert!(!b.claim(id), "block {id}");
        }
        // New decisions go on splitting the blocks.
        assert_eq!(b.block_at(4), Some(4));
        assert_eq!(a.block_at(4), Some(5));
        // Claiming ahead stops: the claims of blocks decided and not taken
        // are given up, so `b` reads them.
        assert_eq!(a.claim_ahead(false), Vec::<u64>::new());
        assert_eq!(b.block_at(5), Some(5));
        assert_eq!(b.take_elsewhere(), Vec::<usize>::new());
    }
}

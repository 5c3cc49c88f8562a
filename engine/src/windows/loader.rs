//! The loader: batches of windows assembled on Rust threads, just in time.
//!
//! One planner thread decides, per epoch, which windows go in which batch
//! (see [`super::order`]); a pool of worker threads decodes blocks as they
//! enter the shuffle buffer and cuts the windows of each batch out of them.
//! At most `prefetch` batches are in flight or waiting; a block's decoded
//! values are dropped when the buffer and every batch using them are done
//! with it, so memory is bounded by the buffer and the prefetch depth,
//! whatever the dataset's size. Batches come out in plan order, so a seed
//! gives the same batches whatever the number of threads.
//!
//! From an object store, the chunks of the blocks about to enter the
//! shuffle buffer are requested ahead of the workers, in the order the
//! epoch's plan takes the blocks (`io_concurrency` reads in flight, beside
//! the chunks of the blocks the workers decode at once), so that decoding
//! never waits a round trip per chunk.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::ops::Range;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::assemble::{outputs, sample_bytes, Cutter, Decoded, Filling, Output};
use super::index::{
    block_read_ahead, index_block, read_ahead_plans, read_blocks_ahead, read_boxes_ahead,
};
use super::live_index::Reading;
use super::order::{
    block_order, resume_in_turn, share, stream_of, stream_segments, BlockSampler, Permutation,
    Quota, Segment, Shard, Shuffle,
};
use super::values::{Scale, Values};
use super::{WindowError, Windows};
use datafusion::common::human_readable_size;

use crate::error::{catch_panic, Panicked};
use crate::table::{ReadAheadPlan, TableReadAhead};
use crate::zarr::IoTotals;

/// Blocks decoded ahead of the shuffle buffer (or of the block read in
/// storage order), counted in the buffer's memory.
const AHEAD: usize = 2;

/// Blocks that left the buffer but are still held by batches waiting to
/// be assembled: the planner waits for them before opening more blocks,
/// so the buffer's memory holds them too. A batch being planned that
/// holds them (drawing from more blocks than the buffer holds) has the
/// windows drawn so far cut into it by the planner, which frees them.
const RETIRED: usize = 2;

/// The most streams (ranks x DataLoader workers) an epoch is dealt to:
/// `drop_last` keeps a count per stream.
const MAX_STREAMS: u64 = 1 << 20;

/// The most batches assembled ahead: each is held until consumed, so
/// more is a mistaken argument (without a memory limit, a whole epoch).
const MAX_PREFETCH: usize = 1 << 16;

/// The most windows a batch's plan makes room for before drawing them (it
/// grows past that as they come): a batch size is the user's, unbounded.
const PLAN_ROOM: usize = 1 << 16;

/// The streams of `world_size` ranks of `workers` workers each, refused
/// (naming `argument`) beyond [`MAX_STREAMS`].
fn checked_streams(world_size: u64, workers: u64, argument: &str) -> Result<u64, WindowError> {
    world_size
        .checked_mul(workers)
        .filter(|&n| n <= MAX_STREAMS)
        .ok_or_else(|| {
            WindowError::argument(
                argument,
                format!(
                    "{world_size} ranks of {workers} workers each are more than the \
                     {MAX_STREAMS} streams a loader deals an epoch to"
                ),
            )
        })
}

/// How a loader batches, orders and prefetches windows.
#[derive(Debug, Clone, PartialEq)]
pub struct LoaderOptions {
    /// Windows per batch.
    pub batch_size: usize,
    /// How windows are shuffled.
    pub shuffle: Shuffle,
    /// Seed of every random choice; epochs derive their own from it.
    pub seed: u64,
    /// Drop the last, incomplete batch (and make every rank yield as many batches).
    pub drop_last: bool,
    /// Batches assembled ahead of the consumer.
    pub prefetch: usize,
    /// Worker threads decoding and assembling.
    pub threads: usize,
    /// This process's share of the windows.
    pub shard: Shard,
    /// This worker's share of the rank's windows, for a loader split among
    /// the worker processes of a `DataLoader` (`rank` is the worker's id):
    /// each worker of each rank is a stream of its own (see
    /// [`super::order`]); under the full shuffle, runs of whole batches of
    /// the rank's share, its batch `j` counting for worker `j mod
    /// world_size` (see [`super::order::share`]).
    pub worker: Shard,
    /// Chunk reads kept in flight ahead of the workers when the store is
    /// in an object store (`zarrfusion.io_concurrency`; 0: on demand only):
    /// whole blocks in the order the epoch takes them, or the full
    /// shuffle's single windows in the order of its sequence.
    pub io_concurrency: usize,
    /// The session's `allowed_mem`: a loader whose buffer, batches and
    /// decoding threads do not fit it is refused, and its read-ahead gets
    /// what they leave (`None`: no limit; see [`LoaderMemory`]).
    pub memory_limit: Option<usize>,
    /// One `float32` array per role with every channel stacked, instead of
    /// an array per variable (see [`super::assemble`]).
    pub stack: bool,
    /// Scales of the windows' variables (in their order), one per part
    /// of each ([`super::SampleLayout::parts`]: per level), applied while
    /// assembling; the arrays are then `float32`.
    pub normalize: Option<Vec<Vec<Scale>>>,
}

impl Default for LoaderOptions {
    fn default() -> Self {
        Self {
            batch_size: 256,
            shuffle: Shuffle::Block {
                buffer_bytes: 256 << 20,
            },
            seed: 0,
            drop_last: false,
            prefetch: 8,
            threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            shard: Shard::WHOLE,
            worker: Shard::WHOLE,
            io_concurrency: 64,
            memory_limit: None,
            stack: false,
            normalize: None,
        }
    }
}

/// The memory an epoch of a loader holds at its peak, by part (bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoaderMemory {
    /// Decoded values the planner draws windows from: the shuffle buffer's
    /// blocks (`buffer_size`, at least one block) or the one block read in
    /// storage order, with the blocks decoded ahead of them; or a full
    /// shuffle's single windows of the batches in flight.
    pub buffer: usize,
    /// The batches assembled ahead of the consumer (`prefetch`) and the one
    /// being planned.
    pub batches: usize,
    /// A block's columns as each thread decodes them, before they become
    /// the block's values.
    pub decoding: usize,
    /// What building the window index in the background holds while it
    /// is incomplete, beside the loader (see [`super::IndexMemory`]; none
    /// once the index is complete or came from the cache).
    pub index: usize,
    /// Chunks read ahead from an object store, in what the rest leaves of
    /// `allowed_mem`.
    pub read_ahead: usize,
}

impl LoaderMemory {
    /// All the parts.
    pub fn total(&self) -> usize {
        self.fixed().saturating_add(self.read_ahead)
    }

    /// All but the read-ahead: what `allowed_mem` must hold.
    pub fn fixed(&self) -> usize {
        self.buffer
            .saturating_add(self.batches)
            .saturating_add(self.decoding)
            .saturating_add(self.index)
    }
}

/// One batch: its arrays, and where each sample is.
#[derive(Debug, Clone, PartialEq)]
pub struct WindowBatch {
    /// Number of samples.
    pub len: usize,
    /// One per [`Output`] of the loader (one per variable for the classic
    /// windows): `len` samples, each in C order.
    pub arrays: Vec<Values>,
    /// Per dimension: the array index of each sample's first cell (jitter
    /// included), or of its own step along the lead dimension.
    pub origins: Vec<Vec<u64>>,
    /// Per dimension: each sample's jitter offset (empty where there is none).
    pub jitter: Vec<Vec<i64>>,
}

/// Counters of a loader, over all its epochs.
#[derive(Debug, Default)]
struct Counters {
    batches: AtomicU64,
    samples: AtomicU64,
    blocks_read: AtomicU64,
    bytes_decoded: AtomicU64,
    decode_ns: AtomicU64,
    assemble_ns: AtomicU64,
    wait_ns: AtomicU64,
}

/// What a loader has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LoaderStats {
    /// Batches handed to the consumer.
    pub batches: u64,
    /// Windows handed to the consumer.
    pub samples: u64,
    /// Blocks (or, with full shuffle, windows) read and decoded.
    pub blocks_read: u64,
    /// Decoded bytes of those reads.
    pub bytes_decoded: u64,
    /// Thread time spent reading and decoding, in seconds.
    pub decode_seconds: f64,
    /// Thread time spent cutting windows into batches, in seconds.
    pub assemble_seconds: f64,
    /// Time the consumer waited for batches, in seconds.
    pub wait_seconds: f64,
    /// What the sources' object stores fetched since they were opened (for
    /// every loader over the same windows, and their index): requests,
    /// bytes and reads served from a read-ahead window.
    pub network: IoTotals,
}

/// A loader of batches of windows, for any number of epochs.
pub struct WindowLoader {
    windows: Arc<Windows>,
    options: LoaderOptions,
    outputs: Arc<Vec<Output>>,
    counters: Arc<Counters>,
}

impl WindowLoader {
    /// A loader over `windows`.
    pub fn new(windows: Arc<Windows>, options: LoaderOptions) -> Result<Self, WindowError> {
        if options.batch_size == 0 {
            return Err(WindowError::argument("batch_size", "must be at least 1"));
        }
        for (argument, share, of) in [
            ("shard", options.shard, "rank"),
            ("worker", options.worker, "worker"),
        ] {
            if share.rank >= share.world_size {
                return Err(WindowError::argument(
                    argument,
                    format!("{of} {} is not in 0..{}", share.rank, share.world_size),
                ));
            }
        }
        checked_streams(options.shard.world_size, options.worker.world_size, "shard")?;
        super::checked_threads(options.threads, "threads")?;
        if options.prefetch == 0 || options.prefetch > MAX_PREFETCH {
            return Err(WindowError::argument(
                "prefetch",
                format!("must be 1 to {MAX_PREFETCH}, not {}", options.prefetch),
            ));
        }
        if let Some(scales) = &options.normalize {
            let parts = &windows.layout.parts;
            let fits = scales.len() == parts.len()
                && scales.iter().zip(parts).all(|(s, p)| s.len() == p.len());
            if !fits {
                return Err(WindowError::argument(
                    "normalize",
                    format!(
                        "scales for {} variables ({:?} parts), not {} variables ({:?} parts)",
                        scales.len(),
                        scales.iter().map(Vec::len).collect::<Vec<_>>(),
                        parts.len(),
                        parts.iter().map(Vec::len).collect::<Vec<_>>()
                    ),
                ));
            }
        }
        let outputs = Arc::new(outputs(
            &windows.layout,
            options.stack,
            options.normalize.is_some(),
        ));
        let loader = Self {
            windows,
            options: LoaderOptions {
                threads: options.threads.max(1),
                ..options
            },
            outputs,
            counters: Arc::default(),
        };
        let memory = loader.memory();
        if let Some(limit) = loader.options.memory_limit {
            if memory.fixed() > limit {
                return Err(WindowError::argument(
                    "allowed_mem",
                    format!(
                        "the loader needs {} for its buffer of decoded blocks (buffer_size), {} \
                         for {} batches of {} windows (prefetch + 1) and {} for {} threads \
                         decoding a block each{}, more than the {} allowed; lower buffer_size, \
                         prefetch, batch_size or threads, or raise allowed_mem",
                        human_readable_size(memory.buffer),
                        human_readable_size(memory.batches),
                        loader.options.prefetch.saturating_add(1),
                        loader.options.batch_size,
                        human_readable_size(memory.decoding),
                        loader.options.threads,
                        match memory.index {
                            0 => String::new(),
                            index => format!(
                                ", beside {} held by the window index being built in the \
                                 background until it is complete (cached indices hold none)",
                                human_readable_size(index)
                            ),
                        },
                        human_readable_size(limit)
                    ),
                ));
            }
        }
        Ok(loader)
    }

    /// The memory an epoch holds at its peak, by part: the read-ahead
    /// gets what the buffer and batches leave of `memory_limit`.
    pub fn memory(&self) -> LoaderMemory {
        loader_memory(&self.windows, &self.outputs, &self.options)
    }

    /// The arrays of each batch, in order.
    pub fn outputs(&self) -> &[Output] {
        &self.outputs
    }

    /// The options in use.
    pub fn options(&self) -> &LoaderOptions {
        &self.options
    }

    /// Windows this loader yields in epoch `epoch` (waits for the index).
    pub fn num_samples(&self, epoch: u64) -> Result<u64, WindowError> {
        samples_per_epoch(&self.windows, &self.options, epoch)
    }

    /// Batches this loader yields in epoch `epoch`, the same on every rank
    /// with `drop_last` (waits for the index).
    pub fn num_batches(&self, epoch: u64) -> Result<u64, WindowError> {
        Ok(self
            .num_samples(epoch)?
            .div_ceil(self.options.batch_size as u64))
    }

    /// Where each of the `workers` workers of a `DataLoader` resumes epoch
    /// `epoch` after the first `consumed` batches it took from them (in
    /// turn, from worker 0): per worker, the share (`worker` option) it
    /// takes and the batches of it to skip. Without `drop_last` the
    /// workers' shares end at different batches, which takes the index.
    pub fn resume_workers(
        &self,
        epoch: u64,
        consumed: u64,
        workers: u64,
    ) -> Result<Vec<(u64, u64)>, WindowError> {
        if workers == 0 {
            return Err(WindowError::argument("workers", "must be at least 1"));
        }
        checked_streams(self.options.shard.world_size, workers, "workers")?;
        let o = &self.options;
        let lengths = if o.drop_last || o.shuffle == Shuffle::Full {
            // As many batches each (the full shuffle's last may be one
            // short, after every batch of the others).
            vec![u64::MAX; workers as usize]
        } else {
            let batch = o.batch_size as u64;
            (0..workers)
                .map(|rank| {
                    let worker = Shard {
                        rank,
                        world_size: workers,
                    };
                    let options = LoaderOptions {
                        worker,
                        ..o.clone()
                    };
                    Ok(samples_per_epoch(&self.windows, &options, epoch)?.div_ceil(batch))
                })
                .collect::<Result<_, WindowError>>()?
        };
        Ok(resume_in_turn(&lengths, consumed)
            .into_iter()
            .map(|(worker, skip)| (worker as u64, skip))
            .collect())
    }

    /// What the loader has done so far.
    pub fn stats(&self) -> LoaderStats {
        let c = &self.counters;
        let secs = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64 * 1e-9;
        LoaderStats {
            batches: c.batches.load(Ordering::Relaxed),
            samples: c.samples.load(Ordering::Relaxed),
            blocks_read: c.blocks_read.load(Ordering::Relaxed),
            bytes_decoded: c.bytes_decoded.load(Ordering::Relaxed),
            decode_seconds: secs(&c.decode_ns),
            assemble_seconds: secs(&c.assemble_ns),
            wait_seconds: secs(&c.wait_ns),
            network: self.windows.sources.network(),
        }
    }

    /// Starts the threads of one epoch and returns its batches.
    pub fn epoch(&self, epoch: u64) -> BatchStream {
        self.epoch_from(epoch, 0)
    }

    /// Starts the threads of one epoch and returns its batches after the
    /// first `skip` ones: exactly those an uninterrupted epoch yields after
    /// them (to resume). The skipped batches are planned, not assembled,
    /// and their blocks are not decoded unless the index needs them.
    pub fn epoch_from(&self, epoch: u64, skip: u64) -> BatchStream {
        let flow = Arc::new(Flow::new(self.options.prefetch));
        let (jobs_tx, jobs_rx) = channel::<Job>();
        let (results_tx, results_rx) = channel();
        let jobs_rx = Arc::new(Mutex::new(jobs_rx));
        let mut started = 0;
        for _ in 0..self.options.threads {
            let worker = Worker {
                windows: Arc::clone(&self.windows),
                outputs: Arc::clone(&self.outputs),
                scales: self.options.normalize.clone(),
                seed: self.options.seed,
                epoch,
                counters: Arc::clone(&self.counters),
                flow: Arc::clone(&flow),
                jobs: Arc::clone(&jobs_rx),
                results: results_tx.clone(),
            };
            match super::spawn("window loader", move || worker.run()) {
                Ok(()) => started += 1,
                Err(e) if started == 0 => {
                    let _ = results_tx.send(Outcome::Failed(e));
                    break;
                }
                // Fewer threads decode: slower, not wrong.
                Err(e) => {
                    log::debug!("{e}");
                    break;
                }
            }
        }
        let planner = Planner {
            windows: Arc::clone(&self.windows),
            outputs: Arc::clone(&self.outputs),
            options: self.options.clone(),
            epoch,
            skip,
            flow: Arc::clone(&flow),
            jobs: jobs_tx,
            results: results_tx,
            counters: Arc::clone(&self.counters),
        };
        if started > 0 {
            let failed = planner.results.clone();
            if let Err(e) = super::spawn("window planner", move || planner.run()) {
                let _ = failed.send(Outcome::Failed(e));
            }
        }
        BatchStream {
            results: results_rx,
            pending: BTreeMap::new(),
            next: skip,
            end: None,
            flow,
            counters: Arc::clone(&self.counters),
        }
    }
}

/// The memory an epoch of a loader of `windows` with options `o`, making
/// batches of `outputs`, holds at its peak (see [`WindowLoader::memory`]).
fn loader_memory(windows: &Windows, outputs: &[Output], o: &LoaderOptions) -> LoaderMemory {
    // A full shuffle decodes each window with its jitter's reach.
    let window_bytes = windows.window_bytes();
    let sample_bytes = sample_bytes(windows, outputs);
    let block_bytes = windows.largest_block_bytes();
    let buffer = match o.shuffle {
        Shuffle::Block { buffer_bytes } => (buffer_blocks(windows, buffer_bytes)
            .saturating_add(AHEAD + RETIRED) as u64)
            .saturating_mul(block_bytes),
        Shuffle::None => ((1 + AHEAD + RETIRED) as u64).saturating_mul(block_bytes),
        Shuffle::Full => (o.prefetch as u64)
            .saturating_add(1)
            .saturating_mul(o.batch_size as u64)
            .saturating_mul(window_bytes),
    };
    let batches = (o.prefetch as u64)
        .saturating_add(1)
        .saturating_mul(o.batch_size as u64)
        .saturating_mul(sample_bytes);
    // A full shuffle decodes single windows.
    let decoded = match o.shuffle {
        Shuffle::Full => window_bytes,
        _ => block_bytes,
    };
    let mut memory = LoaderMemory {
        buffer: clamp(buffer),
        batches: clamp(batches),
        decoding: clamp((o.threads as u64).saturating_mul(decoded)),
        index: windows.index_memory().total(),
        read_ahead: 0,
    };
    memory.read_ahead = loader_read_ahead(windows, o, memory.fixed())
        .map_or(0, |plans| plans.iter().map(ReadAheadPlan::memory).sum());
    memory
}

/// How far a loader reads the chunks of its blocks (under the full
/// shuffle: of its single windows) ahead of its threads, per source, in
/// what `used` bytes leave of its memory limit.
fn loader_read_ahead(
    windows: &Windows,
    o: &LoaderOptions,
    used: usize,
) -> Option<Vec<ReadAheadPlan>> {
    let room = o.memory_limit.map(|limit| limit.saturating_sub(used));
    match o.shuffle {
        Shuffle::Full => windows.widest_reach().map(|reach| {
            read_ahead_plans(&windows.sources, &reach, o.io_concurrency, o.threads, room)
        }),
        _ => block_read_ahead(
            &windows.sources,
            &windows.grid,
            o.io_concurrency,
            o.threads,
            room,
        ),
    }
}

/// Blocks a shuffle buffer of `buffer_bytes` holds: as many as it holds of
/// the average block of `windows`, at least one.
fn buffer_blocks(windows: &Windows, buffer_bytes: u64) -> usize {
    (buffer_bytes / windows.block_bytes().max(1)).max(1) as usize
}

/// `bytes` as `usize`, the largest when it does not fit.
fn clamp(bytes: u64) -> usize {
    usize::try_from(bytes).unwrap_or(usize::MAX)
}

/// Windows a loader of options `o` yields in epoch `epoch` (waits for the
/// index): its stream's valid windows, with `drop_last` the whole batches
/// of the stream with the fewest; under the full shuffle, its share.
fn samples_per_epoch(windows: &Windows, o: &LoaderOptions, epoch: u64) -> Result<u64, WindowError> {
    let index = windows.index()?;
    if o.shuffle == Shuffle::Full {
        let r = share_of(index.total, o);
        return Ok(r.end - r.start);
    }
    let origins = block_origins(windows);
    let order = epoch_order(windows, o, epoch);
    let count = |stream: Shard| -> u64 {
        stream_segments(&origins, &order, stream)
            .iter()
            .map(|s| index.blocks[s.block].count_in(s.range(origins[s.block])))
            .sum()
    };
    let stream = stream_of(o.shard, o.worker);
    if !o.drop_last {
        return Ok(count(stream));
    }
    let fewest = (0..stream.world_size)
        .map(|rank| count(Shard { rank, ..stream }))
        .min()
        .unwrap_or(0);
    let batch = o.batch_size as u64;
    Ok(fewest / batch * batch)
}

/// The positions of an epoch's sequence of `total` windows a loader under
/// the full shuffle yields (its rank's and worker's share).
fn share_of(total: u64, o: &LoaderOptions) -> Range<u64> {
    share(total, o.shard, o.worker, o.batch_size as u64, o.drop_last)
}

/// The number of window origins (valid or not) of each block.
fn block_origins(windows: &Windows) -> Vec<u64> {
    windows
        .grid
        .blocks
        .iter()
        .map(|b| b.num_origins())
        .collect()
}

/// The blocks of epoch `epoch` in the order the loader takes them.
fn epoch_order(windows: &Windows, o: &LoaderOptions, epoch: u64) -> Vec<usize> {
    let shuffled = matches!(o.shuffle, Shuffle::Block { .. });
    block_order(windows.grid.blocks.len(), shuffled, o.seed, epoch)
}

/// The decoded values of a block (or a window), decoded once by whichever
/// thread needs them first.
struct Slot {
    block: usize,
    /// Whether this is a whole block, whose index can be taken from it.
    whole_block: bool,
    extent: Vec<Range<u64>>,
    data: OnceLock<Result<Decoded, String>>,
    /// The window reading this block's chunks ahead, and the block's
    /// number in it (its place in the epoch's order).
    read_ahead: Option<(Arc<TableReadAhead>, u64)>,
    /// The count of the epoch's live blocks, this one among them.
    alive: Option<Arc<Alive>>,
}

/// The blocks of an epoch alive at once (in the buffer, opened ahead of it,
/// or held by batches not assembled yet).
#[derive(Default)]
struct Alive {
    count: Mutex<usize>,
    freed: Condvar,
}

impl Alive {
    /// Counts one more block once fewer than `limit` are alive: at the
    /// limit, first has the batch being planned free the blocks it holds
    /// (`make_room`: its windows so far cut into it), then waits for the
    /// batches sent to the workers to free theirs (while any is waiting);
    /// `false` when `flow` is cancelled meanwhile.
    fn enter(&self, limit: usize, flow: &Flow, make_room: &mut dyn FnMut()) -> bool {
        let Ok(mut n) = self.count.lock() else {
            return false;
        };
        let mut made_room = false;
        while *n >= limit && !flow.is_cancelled() {
            if !made_room {
                made_room = true;
                drop(n);
                make_room();
                n = match self.count.lock() {
                    Ok(n) => n,
                    Err(_) => return false,
                };
                continue;
            }
            if flow.in_flight() == 0 {
                break;
            }
            n = match self.freed.wait_timeout(n, Duration::from_millis(100)) {
                Ok((n, _)) => n,
                Err(_) => return false,
            };
        }
        *n += 1;
        !flow.is_cancelled()
    }

    fn leave(&self) {
        if let Ok(mut n) = self.count.lock() {
            *n = n.saturating_sub(1);
        }
        self.freed.notify_all();
    }
}

impl Slot {
    /// The slot of block `block` of `windows`, read ahead by `read_ahead`
    /// when given.
    fn block(
        windows: &Windows,
        block: usize,
        read_ahead: Option<(Arc<TableReadAhead>, u64)>,
        alive: Arc<Alive>,
    ) -> Arc<Self> {
        Arc::new(Self {
            block,
            whole_block: true,
            extent: windows.grid.blocks[block].extent.clone(),
            data: OnceLock::new(),
            read_ahead,
            alive: Some(alive),
        })
    }

    /// The slot of the single window at `local` in block `block`, read
    /// ahead by `read_ahead` when given.
    fn window(
        windows: &Windows,
        block: usize,
        local: u64,
        read_ahead: Option<(Arc<TableReadAhead>, u64)>,
    ) -> Arc<Self> {
        let origin = windows.grid.blocks[block].origin(local);
        Arc::new(Self {
            block,
            whole_block: false,
            extent: windows.grid.window_reach(&origin),
            data: OnceLock::new(),
            read_ahead,
            alive: None,
        })
    }

    /// Decodes the values (once); a whole block not indexed yet is indexed
    /// from them, and a block that cannot be read fails the index.
    fn values(&self, windows: &Windows, counters: &Counters) -> Result<&Decoded, WindowError> {
        let data = self.data.get_or_init(|| {
            let started = Instant::now();
            let live = windows.live_index();
            if self.whole_block {
                // Background threads skip it from now on.
                live.claim(self.block);
            }
            #[cfg(test)]
            tests::inject_decoding();
            let data = windows.sources.read(&self.extent, live.buffers());
            self.done_reading();
            let data = data.map_err(|e| {
                if self.whole_block {
                    live.fail(e.to_string());
                }
                e.to_string()
            })?;
            if self.whole_block && live.ready_block(self.block).is_none() {
                let block = &windows.grid.blocks[self.block];
                let index = index_block(
                    &windows.grid,
                    block,
                    &data,
                    &windows.layout,
                    &windows.sources,
                );
                live.publish(self.block, index);
            }
            let columns = &data.columns;
            // Jittered samples are checked against the rules from the nulls.
            let checks = windows.layout.jittered() && !windows.layout.keeps_everything();
            let nulls = columns
                .iter()
                .map(|c| {
                    c.nulls()
                        .filter(|n| checks && n.null_count() > 0)
                        .map(|n| n.inner().clone())
                })
                .collect();
            let values: Vec<Values> = columns
                .iter()
                .map(|c| {
                    Values::from_array(c)
                        .ok_or_else(|| format!("unsupported type {}", c.data_type()))
                })
                .collect::<Result<_, _>>()?;
            let bytes: usize = values.iter().map(|v| v.len() * v.element_size()).sum();
            counters.blocks_read.fetch_add(1, Ordering::Relaxed);
            counters
                .bytes_decoded
                .fetch_add(bytes as u64, Ordering::Relaxed);
            counters
                .decode_ns
                .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
            Ok(Decoded {
                values,
                nulls,
                extents: data.extents,
            })
        });
        data.as_ref().map_err(|e| WindowError::Read(e.clone()))
    }

    /// Says the read-ahead window this block is done with.
    fn done_reading(&self) {
        if let Some((read_ahead, number)) = &self.read_ahead {
            read_ahead.done_with(*number);
        }
    }

    /// Local origin numbers of the valid windows of `segment` (this slot's
    /// block); decodes the block first when it is not indexed yet.
    fn origins(
        &self,
        segment: &Segment,
        windows: &Windows,
        counters: &Counters,
    ) -> Result<Vec<u32>, WindowError> {
        let live = windows.live_index();
        let index = match live.ready_block(self.block) {
            Some(index) => index,
            None => live.with_priority(|| {
                self.values(windows, counters)?;
                live.ready_block(self.block).ok_or_else(|| {
                    WindowError::Internal(format!("block {} was read but not indexed", self.block))
                })
            })?,
        };
        let origins = windows.grid.blocks[self.block].num_origins();
        Ok(index.origins_in(segment.range(origins)))
    }
}

impl Drop for Slot {
    /// A block that was never decoded (no valid window in it) is done too.
    fn drop(&mut self) {
        self.done_reading();
        if let Some(alive) = &self.alive {
            alive.leave();
        }
    }
}

/// The windows of one batch, in order: the first `cut` already cut into
/// `head` (by the planner, to free the blocks they came from), then the
/// rest, as slots and local origin numbers.
#[derive(Default)]
struct Plan {
    head: Option<Filling>,
    cut: usize,
    windows: Vec<(Arc<Slot>, u64)>,
}

impl Plan {
    fn len(&self) -> usize {
        self.cut + self.windows.len()
    }
}

/// Cuts `todo` (slots and local origin numbers) into `batch` in order,
/// starting it with room for `capacity` samples if need be.
fn cut_windows(
    windows: &Windows,
    cutter: &Cutter,
    todo: &[(Arc<Slot>, u64)],
    batch: &mut Option<Filling>,
    capacity: usize,
    counters: &Counters,
) -> Result<(), WindowError> {
    let mut assemble_ns = 0u64;
    for (slot, local) in todo {
        let data = slot.values(windows, counters)?;
        let started = Instant::now();
        let filling = batch.get_or_insert_with(|| cutter.start(data, capacity));
        cutter.cut(data, slot.block, *local, filling);
        assemble_ns += started.elapsed().as_nanos() as u64;
    }
    counters
        .assemble_ns
        .fetch_add(assemble_ns, Ordering::Relaxed);
    Ok(())
}

enum Job {
    /// Decode a block that entered the shuffle buffer (or a window the full
    /// shuffle drew), unless it has left it (and every batch) by the time a
    /// thread gets to it: a queued job must not keep a block alive past the
    /// limit of blocks alive at once.
    Warm(Weak<Slot>),
    /// Assemble batch number `.0`.
    Assemble(u64, Plan),
}

/// Bounds the batches in flight, and stops everything when the consumer leaves.
struct Flow {
    in_flight: Mutex<usize>,
    changed: Condvar,
    limit: usize,
    cancelled: AtomicBool,
}

impl Flow {
    fn new(limit: usize) -> Self {
        Self {
            in_flight: Mutex::new(0),
            changed: Condvar::new(),
            limit,
            cancelled: AtomicBool::new(false),
        }
    }

    /// Waits for room for one more batch; `false` when cancelled.
    fn acquire(&self) -> bool {
        let Ok(mut n) = self.in_flight.lock() else {
            return false;
        };
        while *n >= self.limit && !self.is_cancelled() {
            n = match self.changed.wait(n) {
                Ok(n) => n,
                Err(_) => return false,
            };
        }
        *n += 1;
        !self.is_cancelled()
    }

    fn release(&self) {
        if let Ok(mut n) = self.in_flight.lock() {
            *n = n.saturating_sub(1);
        }
        self.changed.notify_all();
    }

    fn cancel(&self) {
        self.cancelled.store(true, Ordering::Relaxed);
        self.changed.notify_all();
    }

    /// Batches sent and not handed to the consumer yet.
    fn in_flight(&self) -> usize {
        self.in_flight.lock().map_or(0, |n| *n)
    }

    fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
    }
}

struct Planner {
    windows: Arc<Windows>,
    outputs: Arc<Vec<Output>>,
    options: LoaderOptions,
    epoch: u64,
    /// Batches planned but not assembled (see [`WindowLoader::epoch_from`]).
    skip: u64,
    flow: Arc<Flow>,
    jobs: Sender<Job>,
    results: Sender<Outcome>,
    counters: Arc<Counters>,
}

/// What the threads of an epoch send the consumer.
enum Outcome {
    /// Batch number `.0`, or the error that stopped it.
    Batch(u64, Result<WindowBatch, WindowError>),
    /// The epoch has this many batches.
    End(u64),
    /// The planner stopped (it panicked): the epoch ends with this error.
    Failed(WindowError),
}

/// Draws the next window of an epoch: its slot and local origin number;
/// before opening a block at the limit of blocks alive, calls its argument
/// to free those the batch being planned holds (see [`Alive::enter`]).
type Draw<'a> =
    Box<dyn FnMut(&mut dyn FnMut()) -> Result<Option<(Arc<Slot>, u64)>, WindowError> + 'a>;

impl Planner {
    fn run(self) {
        match catch_panic("loader's planner thread", || {
            #[cfg(test)]
            tests::inject(self.options.seed, tests::PANIC_PLANNING);
            self.plan()
        }) {
            Ok(end) => {
                let _ = self.results.send(Outcome::End(end));
            }
            // The consumer gets the error in place of the next batch.
            Err(p) => {
                let _ = self.results.send(Outcome::Failed(p.into()));
            }
        }
    }

    /// Sends the batches' plans to the workers (or the error that stops
    /// one to the consumer); returns the number of batches.
    fn plan(&self) -> u64 {
        // An error while skipping is the first batch the consumer waits for.
        let failed = |seq: u64, e: WindowError| {
            let seq = seq.max(self.skip);
            let _ = self.results.send(Outcome::Batch(seq, Err(e)));
            seq + 1
        };
        let o = &self.options;
        // The full shuffle needs the total first; in block or storage
        // order each stream starts at once (with `drop_last`, each batch
        // waits until every stream is known to fill it).
        let full = o.shuffle == Shuffle::Full;
        let limit = if full {
            match self.windows.len() {
                Ok(total) => {
                    let r = share_of(total, o);
                    Some(r.end - r.start)
                }
                Err(e) => return failed(0, e),
            }
        } else {
            None
        };
        let streams = stream_of(o.shard, o.worker).world_size;
        let origins = block_origins(&self.windows);
        let mut quota = (!full && o.drop_last && streams > 1).then(|| {
            let quota = Quota::new(
                &origins,
                &epoch_order(&self.windows, o, self.epoch),
                streams,
            );
            self.windows.live_index().prefer(quota.blocks());
            quota
        });
        // Held from the first block this epoch indexes for its quota to
        // its end: meanwhile the blocks the index's schedule decides are
        // claimed for this process (see `LiveIndex::reading`).
        let mut reading = None;
        let skipping = Rc::new(Cell::new(self.skip > 0));
        let mut draw = match self.draw(Rc::clone(&skipping), &origins) {
            Ok(draw) => draw,
            Err(e) => return failed(0, e),
        };
        let batch = o.batch_size as u64;
        let mut produced = 0u64;
        let mut seq = 0u64;
        loop {
            skipping.set(seq < self.skip);
            let n = limit.map_or(batch, |l| batch.min(l - produced));
            let capacity = usize::try_from(n).unwrap_or(usize::MAX);
            let mut plan = Plan {
                windows: Vec::with_capacity(capacity.min(PLAN_ROOM)),
                ..Plan::default()
            };
            while (plan.len() as u64) < n {
                let mut cut_failed = None;
                let drawn = draw(&mut || {
                    if let Err(e) = self.cut_ahead(&mut plan, capacity, seq < self.skip) {
                        cut_failed = Some(e);
                    }
                });
                if let Some(e) = cut_failed {
                    return failed(seq, e);
                }
                match drawn {
                    Ok(Some(window)) => plan.windows.push(window),
                    Ok(None) => break,
                    Err(e) => return failed(seq, e),
                }
            }
            let short = (plan.len() as u64) < batch;
            if plan.len() == 0 || (short && o.drop_last && limit.is_none()) {
                return seq;
            }
            let len = plan.len() as u64;
            if seq >= self.skip {
                if let Some(quota) = &mut quota {
                    match self.wait_quota(quota, (seq + 1) * batch, &origins, &mut reading) {
                        Ok(true) => {}
                        Ok(false) => return seq,
                        Err(e) => return failed(seq, e),
                    }
                }
                if !self.flow.acquire() || self.jobs.send(Job::Assemble(seq, plan)).is_err() {
                    return seq;
                }
            }
            seq += 1;
            produced += len;
            if limit.is_some_and(|l| produced >= l) {
                return seq;
            }
        }
    }

    /// Cuts the windows `plan` holds so far into it (a batch of
    /// `capacity`), dropping their slots: the blocks only it held are
    /// freed. A batch that is `skipped` drops them uncut.
    fn cut_ahead(
        &self,
        plan: &mut Plan,
        capacity: usize,
        skipped: bool,
    ) -> Result<(), WindowError> {
        let todo = std::mem::take(&mut plan.windows);
        plan.cut += todo.len();
        if skipped || todo.is_empty() {
            return Ok(());
        }
        let cutter = Cutter::new(
            &self.windows,
            &self.outputs,
            self.options.normalize.as_deref(),
            self.options.seed,
            self.epoch,
        );
        // Room for the batch's windows, growing past a batch size larger
        // than any epoch as they come.
        cut_windows(
            &self.windows,
            &cutter,
            &todo,
            &mut plan.head,
            capacity.min(PLAN_ROOM),
            &self.counters,
        )
    }

    /// Whether every stream of the epoch holds `windows` windows (see
    /// [`Quota`]), indexing the blocks that tells in this thread (from the
    /// first, `reading` says so to the index) or waiting for the index
    /// threads; `false` also when the epoch is cancelled.
    fn wait_quota<'a>(
        &'a self,
        quota: &mut Quota,
        windows: u64,
        origins: &[u64],
        reading: &mut Option<Reading<'a>>,
    ) -> Result<bool, WindowError> {
        let live = self.windows.live_index();
        loop {
            if let Some(holds) = quota.holds(windows, |b| live.ready_block(b), origins) {
                return Ok(holds);
            }
            if self.flow.is_cancelled() {
                return Ok(false);
            }
            reading.get_or_insert_with(|| live.reading());
            if !live.index_next_block()? {
                live.wait_block(Duration::from_millis(20))?;
            }
        }
    }

    /// The draws of the epoch. While `skipping`, blocks entering the
    /// buffer are not decoded ahead; those still in it when skipping ends
    /// are.
    fn draw<'a>(
        &'a self,
        skipping: Rc<Cell<bool>>,
        origins: &[u64],
    ) -> Result<Draw<'a>, WindowError> {
        let o = &self.options;
        let windows = &self.windows;
        if o.shuffle == Shuffle::Full {
            let index = windows.index()?;
            let permutation = Permutation::new(index.total, o.seed, self.epoch);
            let share = share_of(index.total, o);
            // The windows of the batches skipped (a resume) are neither
            // read nor decoded; the rest are read ahead in their order
            // from a remote store, and decoded as they are drawn, each by
            // the next free thread (a batch's windows by every thread).
            let first = self
                .skip
                .saturating_mul(o.batch_size as u64)
                .min(share.end - share.start);
            let read_ahead = self.read_windows_ahead(share.start + first..share.end, &permutation);
            let jobs = self.jobs.clone();
            let mut i = 0u64;
            return Ok(Box::new(move |_| {
                let (block, local) = index.locate(permutation.apply(share.start + i));
                let number = i.checked_sub(first);
                i += 1;
                let ahead = number
                    .zip(read_ahead.as_ref())
                    .map(|(n, r)| (Arc::clone(r), n));
                let slot = Slot::window(windows, block, local, ahead);
                if number.is_some() {
                    let _ = jobs.send(Job::Warm(Arc::downgrade(&slot)));
                }
                Ok(Some((slot, local)))
            }));
        }
        let shuffled = matches!(o.shuffle, Shuffle::Block { .. });
        let stream = stream_of(o.shard, o.worker);
        let segs = stream_segments(origins, &epoch_order(windows, o, self.epoch), stream);
        let capacity = match o.shuffle {
            Shuffle::Block { buffer_bytes } => buffer_blocks(windows, buffer_bytes),
            _ => 1,
        };
        // Each stream draws with its own generator.
        let shuffle = shuffled.then_some((o.seed, self.epoch, stream.rank));
        // The chunks of the blocks, in the order they enter the shuffle
        // buffer, read ahead of the workers (a remote store).
        let fixed = loader_memory(windows, &self.outputs, o).fixed();
        let read_ahead = loader_read_ahead(windows, o, fixed)
            .and_then(|plans| {
                let order: Arc<Vec<usize>> = Arc::new(segs.iter().map(|s| s.block).collect());
                read_blocks_ahead(
                    &windows.sources,
                    &windows.grid,
                    order.len() as u64,
                    move |n| order.get(n as usize).copied(),
                    plans,
                    1,
                )
            })
            .map(Arc::new);
        // Blocks are opened (decoded) this many before the buffer takes
        // them, and the buffer grows by a block a batch: the first batch
        // waits for one block, not a buffer's worth.
        let mut sampler = BlockSampler::new(segs, capacity, AHEAD, o.batch_size as u64, shuffle);
        let jobs = self.jobs.clone();
        let counters = &self.counters;
        let mut entered = 0u64;
        let mut not_warmed: Vec<Weak<Slot>> = Vec::new();
        // Blocks alive at once: the buffer's, those opened ahead and a few
        // retired ones still held by batches (see `loader_memory`).
        let alive = Arc::new(Alive::default());
        let limit = capacity.saturating_add(AHEAD + RETIRED);
        let flow = &self.flow;
        Ok(Box::new(move |make_room| {
            if !skipping.get() {
                for slot in not_warmed.drain(..) {
                    let _ = jobs.send(Job::Warm(slot));
                }
            }
            let drawn = sampler.draw(
                |block| {
                    let number = entered;
                    entered += 1;
                    let read_ahead = read_ahead.as_ref().map(|r| (Arc::clone(r), number));
                    // Waits for batches to free retired blocks (a cancelled
                    // epoch stops at its next batch).
                    alive.enter(limit, flow, make_room);
                    let slot = Slot::block(windows, block, read_ahead, Arc::clone(&alive));
                    if skipping.get() {
                        not_warmed.push(Arc::downgrade(&slot));
                    } else {
                        let _ = jobs.send(Job::Warm(Arc::downgrade(&slot)));
                    }
                    slot
                },
                |slot, segment| slot.origins(segment, windows, counters),
            )?;
            Ok(drawn.map(|(slot, local)| (slot, u64::from(local))))
        }))
    }
}

impl Planner {
    /// Under the full shuffle, the chunks of the windows at `positions` of
    /// the epoch's sequence (`permutation` of the valid windows' ranks),
    /// read ahead of the threads in that order when a store is remote:
    /// window number `n` of the read-ahead is the one at position
    /// `positions.start + n`. Neighbouring windows in the sequence that
    /// share a chunk share its request.
    fn read_windows_ahead(
        &self,
        positions: Range<u64>,
        permutation: &Permutation,
    ) -> Option<Arc<TableReadAhead>> {
        let o = &self.options;
        let fixed = loader_memory(&self.windows, &self.outputs, o).fixed();
        let plans = loader_read_ahead(&self.windows, o, fixed)?;
        let windows = Arc::clone(&self.windows);
        let permutation = permutation.clone();
        let count = positions.end - positions.start;
        let extent_at = move |n: u64| {
            let position = positions
                .start
                .checked_add(n)
                .filter(|&p| p < positions.end)?;
            let (block, local) = windows.index().ok()?.locate(permutation.apply(position));
            let origin = windows.grid.blocks[block].origin(local);
            Some(windows.grid.window_reach(&origin))
        };
        read_boxes_ahead(&self.windows.sources, count, extent_at, plans, 1).map(Arc::new)
    }
}

struct Worker {
    windows: Arc<Windows>,
    outputs: Arc<Vec<Output>>,
    scales: Option<Vec<Vec<Scale>>>,
    seed: u64,
    epoch: u64,
    counters: Arc<Counters>,
    flow: Arc<Flow>,
    jobs: Arc<Mutex<Receiver<Job>>>,
    results: Sender<Outcome>,
}

impl Worker {
    fn run(self) {
        loop {
            let job = match self.jobs.lock() {
                Ok(jobs) => jobs.recv(),
                Err(_) => return,
            };
            if self.flow.is_cancelled() {
                return;
            }
            match job {
                Ok(Job::Warm(slot)) => {
                    let Some(slot) = slot.upgrade() else {
                        continue;
                    };
                    // An error here is reported by the batch that needs the block.
                    let warmed = catch_panic("loader thread", || {
                        slot.values(&self.windows, &self.counters).map(|_| ())
                    });
                    if let Err(p) = warmed {
                        self.panicked(p);
                    }
                }
                Ok(Job::Assemble(seq, plan)) => {
                    let batch =
                        catch_panic(&format!("loader thread assembling batch {seq}"), || {
                            #[cfg(test)]
                            if seq == 2 {
                                tests::inject(self.seed, tests::PANIC_ASSEMBLING);
                            }
                            self.assemble(plan)
                        })
                        .unwrap_or_else(|p| Err(self.panicked(p)));
                    if self.results.send(Outcome::Batch(seq, batch)).is_err() {
                        return;
                    }
                }
                Err(_) => return,
            }
        }
    }

    /// A panic in this thread (a bug): the index fails with it too (a
    /// block claimed for it may never be published), so nobody waits for
    /// it; the error for the batch.
    fn panicked(&self, p: Panicked) -> WindowError {
        self.windows.live_index().fail(p.to_string());
        p.into()
    }

    fn assemble(&self, plan: Plan) -> Result<WindowBatch, WindowError> {
        let cutter = Cutter::new(
            &self.windows,
            &self.outputs,
            self.scales.as_deref(),
            self.seed,
            self.epoch,
        );
        let len = plan.len();
        let mut batch = plan.head;
        cut_windows(
            &self.windows,
            &cutter,
            &plan.windows,
            &mut batch,
            len,
            &self.counters,
        )?;
        drop(plan.windows);
        let batch = batch.ok_or_else(|| WindowError::Internal("an empty batch".into()))?;
        Ok(WindowBatch {
            len,
            arrays: batch.arrays,
            origins: batch.origins,
            jitter: batch.jitter,
        })
    }
}

/// What [`BatchStream::poll`] found.
#[derive(Debug)]
pub enum Polled {
    /// The next batch.
    Batch(WindowBatch),
    /// The epoch is over.
    Done,
    /// Nothing yet within the timeout.
    Waiting,
}

/// The batches of one epoch, in order. Dropping it stops the threads.
pub struct BatchStream {
    results: Receiver<Outcome>,
    pending: BTreeMap<u64, Result<WindowBatch, WindowError>>,
    next: u64,
    /// The number of batches, once the planner knows it.
    end: Option<u64>,
    flow: Arc<Flow>,
    counters: Arc<Counters>,
}

impl BatchStream {
    fn is_done(&self) -> bool {
        self.end.is_some_and(|end| self.next >= end)
    }

    /// Waits up to `timeout` for the next batch.
    pub fn poll(&mut self, timeout: Duration) -> Result<Polled, WindowError> {
        if self.is_done() {
            return Ok(Polled::Done);
        }
        let started = Instant::now();
        let outcome = loop {
            if let Some(result) = self.pending.remove(&self.next) {
                self.next += 1;
                self.flow.release();
                break match result {
                    Ok(batch) => {
                        self.counters.batches.fetch_add(1, Ordering::Relaxed);
                        self.counters
                            .samples
                            .fetch_add(batch.len as u64, Ordering::Relaxed);
                        Ok(Polled::Batch(batch))
                    }
                    Err(e) => {
                        self.end = Some(self.next);
                        self.flow.cancel();
                        Err(e)
                    }
                };
            }
            if self.is_done() {
                break Ok(Polled::Done);
            }
            match self
                .results
                .recv_timeout(timeout.saturating_sub(started.elapsed()))
            {
                Ok(Outcome::Batch(seq, result)) => {
                    self.pending.insert(seq, result);
                }
                Ok(Outcome::End(batches)) => self.end = Some(batches),
                Ok(Outcome::Failed(e)) => {
                    self.end = Some(self.next);
                    self.flow.cancel();
                    break Err(e);
                }
                Err(RecvTimeoutError::Timeout) => break Ok(Polled::Waiting),
                Err(RecvTimeoutError::Disconnected) => {
                    self.end = Some(self.next);
                    break Err(WindowError::Internal(
                        "the loader's threads stopped before the epoch ended".into(),
                    ));
                }
            }
        };
        self.counters
            .wait_ns
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        outcome
    }
}

impl Iterator for BatchStream {
    type Item = Result<WindowBatch, WindowError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            match self.poll(Duration::from_secs(3600)) {
                Ok(Polled::Batch(b)) => return Some(Ok(b)),
                Ok(Polled::Done) => return None,
                Ok(Polled::Waiting) => continue,
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

impl Drop for BatchStream {
    fn drop(&mut self) {
        self.flow.cancel();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;
    use crate::table::{Selection, ZarrDataset, ZarrTableOptions};
    use crate::windows::{IndexOptions, SampleSpec, WindowShape};

    /// Seeds that make a test build's loader panic: in its planner, in the
    /// thread assembling batch 2.
    pub(super) const PANIC_PLANNING: u64 = 0xdead_0001;
    pub(super) const PANIC_ASSEMBLING: u64 = 0xdead_0003;

    /// While set, every thread that starts decoding a block panics (after
    /// claiming it from the index's background threads). Only the test
    /// below sets it, and no other test of this crate runs a loader.
    static PANIC_DECODING: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);

    pub(super) fn inject_decoding() {
        if PANIC_DECODING.load(Ordering::SeqCst) {
            panic!("injected panic (decoding)");
        }
    }

    /// Panics when a loader seeded with `seed` reaches the point `at`
    /// (the panic-injection tests' hook; absent from other builds).
    pub(super) fn inject(seed: u64, at: u64) {
        if seed == at {
            panic!("injected panic ({at:#x})");
        }
    }

    /// 3x3 windows over the raw_v3 fixture's `t` (7 x 9 x 10; those
    /// without a missing value).
    fn windows() -> Arc<Windows> {
        let store = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/data/raw_v3.zarr"
        );
        let env = datafusion::execution::runtime_env::RuntimeEnv::default();
        let dataset = ZarrDataset::open(store, &ZarrTableOptions::default(), &env).unwrap();
        let table = Arc::new(dataset.table(None).unwrap());
        let shape = WindowShape {
            sizes: vec![("lat".into(), 3), ("lon".into(), 3)],
            overlaps: vec![],
        };
        let selection = Selection::all(&table.shape());
        let windows = Windows::new(
            table,
            &["t".to_string()],
            selection,
            &shape,
            &SampleSpec::default(),
            &IndexOptions::default(),
        )
        .unwrap();
        Arc::new(windows)
    }

    /// The batches of an epoch of a loader seeded with `seed`, or their
    /// errors' texts, taken on another thread: the test fails (rather than
    /// hangs) when the epoch does not end within 30 s.
    fn epoch(windows: &Arc<Windows>, seed: u64, shuffle: Shuffle) -> Vec<Result<u64, String>> {
        let options = LoaderOptions {
            batch_size: 4,
            shuffle,
            seed,
            threads: 2,
            prefetch: 2,
            ..LoaderOptions::default()
        };
        let loader = WindowLoader::new(Arc::clone(windows), options).unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for batch in loader.epoch(0) {
                let _ = tx.send(batch.map(|b| b.len as u64).map_err(|e| e.to_string()));
            }
        });
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let mut out = Vec::new();
        loop {
            match rx.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now())) {
                Ok(item) => out.push(item),
                Err(mpsc::RecvTimeoutError::Disconnected) => return out,
                Err(mpsc::RecvTimeoutError::Timeout) => panic!("the epoch hung after {out:?}"),
            }
        }
    }

    #[test]
    fn a_panic_in_any_loader_thread_is_an_error_for_the_consumer_not_a_hang() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let _entered = runtime.enter();
        let windows = windows();
        let block = Shuffle::Block {
            buffer_bytes: 1 << 10,
        };
        let whole: Vec<_> = epoch(&windows, 7, block);
        let count: u64 = whole.iter().map(|b| b.clone().unwrap()).sum();
        assert_eq!(count, windows.len().unwrap());
        assert!(whole.len() > 3, "{whole:?}");
        let first_error = |batches: &[Result<u64, String>], injected: &str| {
            let Some(first) = batches.iter().position(Result::is_err) else {
                panic!("{injected}: no error in {batches:?}");
            };
            let message = batches[first].clone().unwrap_err();
            assert!(
                message.contains("panicked") && message.contains(injected),
                "{injected}: {message}"
            );
            first
        };
        for (seed, shuffle) in [
            (PANIC_PLANNING, block),
            (PANIC_ASSEMBLING, block),
            (PANIC_ASSEMBLING, Shuffle::None),
            (PANIC_ASSEMBLING, Shuffle::Full),
        ] {
            let batches = epoch(&windows, seed, shuffle);
            let first = first_error(&batches, &format!("injected panic ({seed:#x})"));
            if seed == PANIC_ASSEMBLING {
                assert_eq!(first, 2, "{shuffle:?}: {batches:?}");
            }
        }
        // A panic in the middle of decoding a block (claimed, never
        // published): the batches that need it fail; nothing waits on it.
        // So does a panic decoding a window the full shuffle drew (decoded
        // by whichever thread gets to it first, before its batch).
        for shuffle in [block, Shuffle::Full] {
            let windows = self::windows();
            windows.len().unwrap();
            PANIC_DECODING.store(true, Ordering::SeqCst);
            let batches = epoch(&windows, 7, shuffle);
            PANIC_DECODING.store(false, Ordering::SeqCst);
            first_error(&batches, "injected panic (decoding)");
        }
    }
}

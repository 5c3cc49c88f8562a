//! The order windows come out in: shuffling, sharding and epochs.
//!
//! In block or storage order, an epoch's windows are dealt to *streams*,
//! one per data-parallel rank and `DataLoader` worker: the blocks in the
//! epoch's order (the same on every rank) line up their window origins,
//! valid or not, and each stream takes a contiguous, equal run of them
//! (cutting at most the blocks at its ends). What a stream yields is the
//! valid windows of its run, so it starts at once, without the index of
//! the whole dataset; streams never overlap and together cover every
//! window. With `drop_last` every stream yields the same number of whole
//! batches (the fewest any stream fills, see [`Quota`]), so every rank
//! yields as many batches.
//!
//! - `None`: blocks in order, windows in order.
//! - `Block`: blocks in a seeded random order; windows drawn at random from a
//!   buffer of decoded blocks, each draw weighted by what is left in a
//!   block, so the buffer mixes like a uniform sample of its windows.
//! - `Full`: a seeded pseudo-random permutation of all valid windows,
//!   computed (a Feistel network with cycle walking), never stored; each
//!   rank takes a contiguous share of it ([`share`]), which needs the
//!   complete index.

use std::collections::VecDeque;
use std::ops::Range;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use std::sync::Arc;

use super::index::BlockIndex;

/// How windows are shuffled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shuffle {
    /// In storage order.
    None,
    /// Chunk-aware: blocks in random order, windows sampled from a buffer of
    /// decoded blocks of about this many bytes.
    Block {
        /// Bytes of decoded blocks held for sampling.
        buffer_bytes: u64,
    },
    /// A global permutation of all valid windows (reads windows one by one).
    Full,
}

/// Which share of the windows a data-parallel rank takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// This rank, `0..world_size`.
    pub rank: u64,
    /// Number of ranks.
    pub world_size: u64,
}

impl Shard {
    /// The whole sequence, for a single process.
    pub const WHOLE: Self = Self {
        rank: 0,
        world_size: 1,
    };

    /// This rank's share of a sequence of `n` windows.
    pub fn range(&self, n: u64) -> Range<u64> {
        let at = |r: u64| (u128::from(n) * u128::from(r) / u128::from(self.world_size)) as u64;
        at(self.rank)..at(self.rank + 1)
    }
}

/// The positions of an epoch's sequence of `total` windows that one worker
/// of one rank yields, in batches of `batch`: the rank's share
/// ([`Shard::range`], cut to whole batches, as many on every rank, with
/// `drop_last`), then the worker's run of it: the rank's batch `j` counts
/// for worker `j mod workers`, so the workers' runs hold whole batches,
/// and a `DataLoader` taking one batch from each worker in turn yields as
/// many batches as the rank alone.
pub fn share(total: u64, shard: Shard, worker: Shard, batch: u64, drop_last: bool) -> Range<u64> {
    let rank = shard.range(total);
    let len = if drop_last {
        (total / shard.world_size) / batch * batch
    } else {
        rank.end - rank.start
    };
    let batches = if drop_last {
        len / batch
    } else {
        len.div_ceil(batch)
    };
    let (each, extra) = (batches / worker.world_size, batches % worker.world_size);
    let before = worker.rank * each + worker.rank.min(extra);
    let own = each + u64::from(worker.rank < extra);
    let start = (before * batch).min(len);
    let end = ((before + own) * batch).min(len);
    rank.start + start..rank.start + end
}

/// The random generator of one epoch, the same on every rank for `stream` 0.
fn epoch_rng(seed: u64, epoch: u64, stream: u64) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(epoch.wrapping_mul(0x1_0000).wrapping_add(stream));
    rng
}

/// A pseudo-random permutation of `0..n`: a balanced Feistel network over
/// the next even power of two, walked until it lands inside `0..n`.
#[derive(Debug, Clone)]
pub struct Permutation {
    n: u64,
    half_bits: u32,
    keys: [u64; 4],
}

impl Permutation {
    /// The permutation of `0..n` for `seed` and `epoch`.
    pub fn new(n: u64, seed: u64, epoch: u64) -> Self {
        let bits = 64 - n.saturating_sub(1).leading_zeros();
        let mut rng = epoch_rng(seed, epoch, 0);
        Self {
            n,
            half_bits: bits.div_ceil(2).max(1),
            keys: std::array::from_fn(|_| rng.random()),
        }
    }

    /// The image of `i` (for `i < n`).
    pub fn apply(&self, i: u64) -> u64 {
        let mut x = i;
        loop {
            x = self.round_trip(x);
            if x < self.n {
                return x;
            }
        }
    }

    fn round_trip(&self, x: u64) -> u64 {
        let mask = (1u64 << self.half_bits) - 1;
        let (mut left, mut right) = (x >> self.half_bits, x & mask);
        for key in self.keys {
            let mixed = left ^ (splitmix(right ^ key) & mask);
            left = right;
            right = mixed;
        }
        (left << self.half_bits) | right
    }
}

/// A 64-bit mix (SplitMix64's finalizer): a seeded hash of `z`.
pub(super) fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A run of one block's windows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// The block.
    pub block: usize,
    /// Its local origin numbers in the run (valid or not); `None`: all.
    pub local: Option<Range<u64>>,
}

impl Segment {
    /// The local origin numbers of the run, out of the block's `origins`.
    pub fn range(&self, origins: u64) -> Range<u64> {
        self.local.clone().unwrap_or(0..origins)
    }
}

/// The blocks of an epoch in order: shuffled by `seed` and `epoch`, or in
/// storage order.
pub fn block_order(blocks: usize, shuffle_blocks: bool, seed: u64, epoch: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..blocks).collect();
    if shuffle_blocks {
        let mut rng = epoch_rng(seed, epoch, 0);
        for i in (1..order.len()).rev() {
            order.swap(i, rng.random_range(0..=i));
        }
    }
    order
}

/// The stream of worker `worker` of rank `shard`, among all of them.
pub fn stream_of(shard: Shard, worker: Shard) -> Shard {
    Shard {
        rank: shard.rank * worker.world_size + worker.rank,
        world_size: shard.world_size * worker.world_size,
    }
}

/// The segments of `stream`: with the blocks in `order` lined up, each
/// with `origins[block]` window origins, the stream's contiguous share
/// ([`Shard::range`]) of them.
pub fn stream_segments(origins: &[u64], order: &[usize], stream: Shard) -> VecDeque<Segment> {
    let total = order
        .iter()
        .fold(0u64, |sum, &b| sum.saturating_add(origins[b]));
    let share = stream.range(total);
    let mut out = VecDeque::new();
    let mut before = 0u64;
    for &block in order {
        let n = origins[block];
        let (start, end) = (
            share.start.max(before),
            share.end.min(before.saturating_add(n)),
        );
        if start < end {
            let local = (start - before, end - before);
            out.push_back(Segment {
                block,
                local: (local != (0, n)).then_some(local.0..local.1),
            });
        }
        before = before.saturating_add(n);
        if before >= share.end {
            break;
        }
    }
    out
}

/// Whether every stream of an epoch holds enough valid windows for a
/// batch, with `drop_last`: each yields as many whole batches as the one
/// with the fewest valid windows fills, so every rank yields as many.
///
/// A stream knows its own windows as it reads them; the others' come from
/// the index as it fills in. Batch `j` may go once every stream is known to
/// hold `(j + 1) * batch` windows; the epoch ends at the first batch some
/// stream cannot fill, once the index is complete.
#[derive(Debug)]
pub struct Quota {
    streams: Vec<Counted>,
}

/// One stream's segments, and the valid windows of those indexed so far.
#[derive(Debug)]
struct Counted {
    segments: Vec<Segment>,
    /// Segments counted (a prefix).
    next: usize,
    known: u64,
}

impl Quota {
    /// The quota of the `streams` streams of an epoch.
    pub fn new(origins: &[u64], order: &[usize], streams: u64) -> Self {
        let streams = (0..streams)
            .map(|rank| Counted {
                segments: stream_segments(
                    origins,
                    order,
                    Shard {
                        rank,
                        world_size: streams,
                    },
                )
                .into(),
                next: 0,
                known: 0,
            })
            .collect();
        Self { streams }
    }

    /// The blocks whose index the quota needs, in the order it needs them:
    /// the first block of every stream, then the second, and so on.
    pub fn blocks(&self) -> Vec<usize> {
        let mut seen = std::collections::HashSet::new();
        let longest = self.streams.iter().map(|s| s.segments.len()).max();
        (0..longest.unwrap_or(0))
            .flat_map(|k| self.streams.iter().filter_map(move |s| s.segments.get(k)))
            .map(|s| s.block)
            .filter(|b| seen.insert(*b))
            .collect()
    }

    /// Whether every stream holds `windows` valid windows: `Some(true)`,
    /// `Some(false)` (one does not, and all are indexed), or `None` (not
    /// known yet). `index` gives a block's index when it is known, and its
    /// number of origins.
    pub fn holds(
        &mut self,
        windows: u64,
        index: impl Fn(usize) -> Option<Arc<BlockIndex>>,
        origins: &[u64],
    ) -> Option<bool> {
        let mut known = true;
        for stream in &mut self.streams {
            while stream.known < windows {
                let Some(segment) = stream.segments.get(stream.next) else {
                    break;
                };
                let Some(block) = index(segment.block) else {
                    break;
                };
                stream.known += block.count_in(segment.range(origins[segment.block]));
                stream.next += 1;
            }
            if stream.known < windows {
                if stream.next == stream.segments.len() {
                    return Some(false);
                }
                known = false;
            }
        }
        known.then_some(true)
    }
}

/// Where each of `lengths.len()` workers a `DataLoader` takes batches from
/// in turn (skipping those that have ended) resumes after `consumed`
/// batches: per new worker, the old worker whose batches it yields and how
/// many of them were consumed. The new workers start from the old worker
/// the next batch comes from, so the `DataLoader` takes them in the same
/// order.
pub fn resume_in_turn(lengths: &[u64], consumed: u64) -> Vec<(usize, u64)> {
    // Batches in the rounds before round `r` (round `r` takes batch `r` of
    // every worker that has one).
    let before = |r: u64| {
        lengths
            .iter()
            .fold(0u64, |sum, &n| sum.saturating_add(n.min(r)))
    };
    // The round of the next batch: the last whose start is not past it.
    let (mut round, mut hi) = (0u64, lengths.iter().copied().max().unwrap_or(0));
    while round < hi {
        let mid = round + (hi - round).div_ceil(2);
        if before(mid) <= consumed {
            round = mid;
        } else {
            hi = mid - 1;
        }
    }
    let mut taken: Vec<u64> = lengths.iter().map(|&n| n.min(round)).collect();
    let mut left = consumed.saturating_sub(before(round));
    let mut next = 0;
    for (w, &n) in lengths.iter().enumerate() {
        if left == 0 {
            break;
        }
        if n > round {
            taken[w] += 1;
            left -= 1;
            next = w + 1;
        }
    }
    let k = lengths.len();
    (0..k)
        .map(|i| {
            let old = (next + i) % k;
            (old, taken[old])
        })
        .collect()
}

/// A block buffered for drawing: its slot and its remaining origins.
#[derive(Debug)]
struct Buffered<S> {
    slot: S,
    /// Local origin numbers not drawn yet.
    remaining: Vec<u32>,
}

/// Draws windows from a buffer of blocks, filled from segments.
///
/// With a generator, each draw picks uniformly among all windows left in
/// the buffer (a block is picked in proportion to what it has left, then a
/// window of it, removed by swapping with the last); without, windows come
/// in order, one block at a time.
///
/// Blocks are opened (their decoding started) `ahead` blocks before they
/// join the buffer (from the first draw on), so that draws rarely wait for
/// one; and the buffer
/// grows by a block every `ramp` draws up to its capacity, so that the
/// first draws need one block, not a whole buffer. Both depend on the
/// number of draws only: the same seed gives the same windows.
pub struct BlockSampler<S> {
    segments: VecDeque<Segment>,
    /// Opened blocks not in the buffer yet.
    staged: VecDeque<(S, Segment)>,
    buffer: Vec<Buffered<S>>,
    /// Windows left in the buffer.
    left: usize,
    capacity: usize,
    ahead: usize,
    ramp: u64,
    drawn: u64,
    rng: Option<ChaCha8Rng>,
}

impl<S: Clone> BlockSampler<S> {
    /// A sampler over `segments` holding up to `capacity` blocks, growing
    /// to it by a block every `ramp` draws (0: full at once), with `ahead`
    /// more opened; `shuffle` `None` draws in order (one block at a time).
    pub fn new(
        segments: VecDeque<Segment>,
        capacity: usize,
        ahead: usize,
        ramp: u64,
        shuffle: Option<(u64, u64, u64)>,
    ) -> Self {
        let rng = shuffle.map(|(seed, epoch, rank)| epoch_rng(seed, epoch, rank + 1));
        Self {
            segments,
            staged: VecDeque::new(),
            buffer: Vec::new(),
            left: 0,
            capacity: if rng.is_some() { capacity.max(1) } else { 1 },
            ahead,
            ramp,
            drawn: 0,
            rng,
        }
    }

    /// Draws the next window, filling the buffer first: `open` makes the
    /// slot of each block entering the buffer (all are opened before any is
    /// waited on), then `origins` gives the local origin numbers of its
    /// segment's windows.
    pub fn draw<E>(
        &mut self,
        mut open: impl FnMut(usize) -> S,
        mut origins: impl FnMut(&S, &Segment) -> Result<Vec<u32>, E>,
    ) -> Result<Option<(S, u32)>, E> {
        let target = match self.ramp {
            0 => self.capacity,
            ramp => self
                .capacity
                .min(usize::try_from(1 + self.drawn / ramp).unwrap_or(usize::MAX)),
        };
        while self.buffer.len() < target {
            // Open what the buffer takes now and `ahead` more, before
            // waiting on any; none more before the first draw, so that the
            // first batch waits for one block alone.
            let ahead = if self.drawn == 0 { 0 } else { self.ahead };
            while self.buffer.len() + self.staged.len() < target + ahead {
                let Some(segment) = self.segments.pop_front() else {
                    break;
                };
                self.staged.push_back((open(segment.block), segment));
            }
            let Some((slot, segment)) = self.staged.pop_front() else {
                break;
            };
            let mut remaining = origins(&slot, &segment)?;
            if remaining.is_empty() {
                continue;
            }
            if self.rng.is_none() {
                remaining.reverse();
            }
            self.left += remaining.len();
            self.buffer.push(Buffered { slot, remaining });
        }
        if self.left == 0 {
            return Ok(None);
        }
        self.drawn += 1;
        let (which, local) = match &mut self.rng {
            Some(rng) => {
                let mut pick = rng.random_range(0..self.left);
                let which = self
                    .buffer
                    .iter()
                    .position(|b| {
                        if pick < b.remaining.len() {
                            true
                        } else {
                            pick -= b.remaining.len();
                            false
                        }
                    })
                    .unwrap_or(0);
                let entry = &mut self.buffer[which];
                let pick = pick.min(entry.remaining.len() - 1);
                (which, entry.remaining.swap_remove(pick))
            }
            None => (0, self.buffer[0].remaining.pop().unwrap_or_default()),
        };
        self.left -= 1;
        let entry = &self.buffer[which];
        let slot = entry.slot.clone();
        if entry.remaining.is_empty() {
            self.buffer.remove(which);
        }
        Ok(Some((slot, local)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::windows::index::ValidIndex;

    #[test]
    fn permutation_is_a_bijection() {
        for n in [1u64, 2, 3, 7, 64, 1000, 4097] {
            let p = Permutation::new(n, 42, 3);
            let mut seen = vec![false; n as usize];
            for i in 0..n {
                let j = p.apply(i) as usize;
                assert!(!seen[j], "n={n}: {j} twice");
                seen[j] = true;
            }
        }
        let a: Vec<u64> = (0..100)
            .map(|i| Permutation::new(100, 1, 0).apply(i))
            .collect();
        let b: Vec<u64> = (0..100)
            .map(|i| Permutation::new(100, 1, 1).apply(i))
            .collect();
        assert_ne!(a, b, "epochs permute differently");
    }

    #[test]
    fn streams_take_equal_disjoint_runs_of_every_origin() {
        let origins = [5u64, 0, 7, 4, 9];
        for streams in 1..=7u64 {
            let order = block_order(origins.len(), true, 9, 2);
            let mut seen = std::collections::HashSet::new();
            let mut sizes = Vec::new();
            for rank in 0..streams {
                let stream = Shard {
                    rank,
                    world_size: streams,
                };
                let mut size = 0;
                for segment in stream_segments(&origins, &order, stream) {
                    for local in segment.range(origins[segment.block]) {
                        assert!(seen.insert((segment.block, local)), "{streams}: twice");
                        size += 1;
                    }
                }
                sizes.push(size);
            }
            assert_eq!(seen.len(), 25, "{streams} streams cover everything");
            let (min, max) = (sizes.iter().min(), sizes.iter().max());
            assert!(max.zip(min).is_some_and(|(a, b)| a - b <= 1), "{sizes:?}");
        }
        let two = stream_of(
            Shard {
                rank: 1,
                world_size: 2,
            },
            Shard {
                rank: 2,
                world_size: 3,
            },
        );
        assert_eq!((two.rank, two.world_size), (5, 6));
    }

    /// Blocks of `origins` origins, every third one invalid.
    fn thirds(origins: &[u64]) -> Vec<Arc<BlockIndex>> {
        origins
            .iter()
            .map(|&n| {
                let mut bits = vec![0u64; (n as usize).div_ceil(64)];
                for i in (0..n).filter(|i| i % 3 != 0) {
                    bits[(i / 64) as usize] |= 1 << (i % 64);
                }
                Arc::new(BlockIndex::from_bits(bits))
            })
            .collect()
    }

    #[test]
    fn the_quota_is_the_fewest_windows_any_stream_holds() {
        let origins = [50u64, 80, 10, 130, 70, 3];
        let blocks = thirds(&origins);
        let order = block_order(origins.len(), true, 3, 1);
        for streams in [1u64, 2, 3, 5] {
            let counts: Vec<u64> = (0..streams)
                .map(|rank| {
                    stream_segments(
                        &origins,
                        &order,
                        Shard {
                            rank,
                            world_size: streams,
                        },
                    )
                    .iter()
                    .map(|s| blocks[s.block].count_in(s.range(origins[s.block])))
                    .sum()
                })
                .collect();
            let fewest = counts.iter().copied().min().unwrap_or(0);
            let mut quota = Quota::new(&origins, &order, streams);
            // Nothing indexed: not known, unless nothing is asked.
            assert_eq!(quota.holds(1, |_| None, &origins), None);
            assert_eq!(quota.holds(0, |_| None, &origins), Some(true));
            for windows in [1, fewest, fewest + 1] {
                let mut quota = Quota::new(&origins, &order, streams);
                let known = quota.holds(windows, |b| Some(Arc::clone(&blocks[b])), &origins);
                assert_eq!(known, Some(windows <= fewest), "{streams} {windows}");
            }
            // The blocks it needs come first block of every stream first.
            let needed = quota.blocks();
            let mut sorted = needed.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), needed.len());
            assert!(needed.len() <= origins.len());
        }
    }

    #[test]
    fn resuming_in_turn_continues_the_same_sequence() {
        for lengths in [
            vec![3u64, 3, 3],
            vec![4, 1, 0, 6],
            vec![2],
            vec![0, 0],
            vec![5, 2, 7],
        ] {
            // The DataLoader's order: in turn, skipping workers that ended.
            let sequence = |lengths: &[u64], start: &[u64], map: &dyn Fn(usize) -> usize| {
                let mut taken = start.to_vec();
                let mut out = Vec::new();
                loop {
                    let mut any = false;
                    for w in 0..lengths.len() {
                        let old = map(w);
                        if taken[old] < lengths[old] {
                            out.push((old, taken[old]));
                            taken[old] += 1;
                            any = true;
                        }
                    }
                    if !any {
                        return out;
                    }
                }
            };
            let zeros = vec![0; lengths.len()];
            let whole = sequence(&lengths, &zeros, &|w| w);
            for consumed in 0..=whole.len() as u64 + 2 {
                let resumed = resume_in_turn(&lengths, consumed);
                let mut start = zeros.clone();
                for &(old, skip) in &resumed {
                    start[old] = skip;
                }
                let rest = sequence(&lengths, &start, &|w| resumed[w].0);
                let want = &whole[(consumed as usize).min(whole.len())..];
                assert_eq!(rest, want, "{lengths:?} after {consumed}");
            }
        }
    }

    #[test]
    fn workers_share_whole_batches_of_their_rank() {
        for (total, world, drop_last) in [(100u64, 3u64, false), (100, 3, true), (7, 2, false)] {
            for rank in 0..world {
                let shard = Shard {
                    rank,
                    world_size: world,
                };
                let whole = share(total, shard, Shard::WHOLE, 8, drop_last);
                for workers in 1..=4u64 {
                    let mut next = whole.start;
                    let mut batches = Vec::new();
                    for w in 0..workers {
                        let worker = Shard {
                            rank: w,
                            world_size: workers,
                        };
                        let run = share(total, shard, worker, 8, drop_last);
                        // Contiguous runs covering the rank's share, in order.
                        assert_eq!(run.start, next, "{total} {rank}/{world} {w}/{workers}");
                        next = run.end;
                        batches.push((run.end - run.start).div_ceil(8));
                        // Only the last run of the rank may end in a short batch.
                        if run.end != whole.end {
                            assert_eq!((run.end - run.start) % 8, 0);
                        }
                    }
                    assert_eq!(next, whole.end);
                    // Batch j of the rank counts for worker j mod workers.
                    let rank_batches = (whole.end - whole.start).div_ceil(8);
                    for (w, &n) in batches.iter().enumerate() {
                        let want = (0..rank_batches)
                            .filter(|j| j % workers == w as u64)
                            .count();
                        assert_eq!(n, want as u64);
                    }
                }
                if drop_last {
                    assert_eq!(whole.end - whole.start, total / world / 8 * 8);
                }
            }
        }
    }

    #[test]
    fn sampler_draws_every_window_once() {
        let index = ValidIndex::from_blocks(vec![BlockIndex::all(30), BlockIndex::all(20)]);
        for shuffle in [None, Some((7, 0, 0))] {
            let order = block_order(2, shuffle.is_some(), 7, 0);
            let counts = [30u64, 20];
            let halves = [0u64, 1].map(|rank| {
                stream_segments(
                    &counts,
                    &order,
                    Shard {
                        rank,
                        world_size: 2,
                    },
                )
            });
            let whole = stream_segments(&counts, &order, Shard::WHOLE);
            assert!(whole.iter().all(|s| s.local.is_none()));
            for segs in [whole, halves[0].iter().chain(&halves[1]).cloned().collect()] {
                let mut sampler = BlockSampler::new(segs, 2, 1, 7, shuffle);
                let mut seen = std::collections::HashSet::new();
                let origins = |b: &usize, s: &Segment| {
                    Ok::<_, ()>(index.blocks[*b].origins_in(s.range(counts[*b])))
                };
                while let Some((block, local)) = sampler.draw(|b| b, origins).unwrap() {
                    assert!(seen.insert((block, local)));
                }
                assert_eq!(seen.len(), 50);
            }
        }
    }
}

//! The order windows come out in: shuffling, sharding and epochs.
//!
//! All ranks agree on one global sequence of the valid windows per epoch
//! and each takes a contiguous, disjoint share of it, so shards never
//! overlap and together cover every window.
//!
//! - `None`: blocks in order, windows in order.
//! - `Block`: blocks in a seeded random order; windows drawn at random from a
//!   buffer of decoded blocks, each draw weighted by what is left in a
//!   block, so the buffer mixes like a uniform sample of its windows.
//! - `Full`: a seeded pseudo-random permutation of all valid windows,
//!   computed (a Feistel network with cycle walking), never stored.

use std::collections::VecDeque;
use std::ops::Range;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::index::ValidIndex;

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

/// A run of one block's valid windows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// The block.
    pub block: usize,
    /// Ranks of its valid windows; `None`: all of them (known once the
    /// block is indexed).
    pub ranks: Option<Range<u64>>,
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

/// Every block of `order`, whole: the segments of a single process, known
/// before the index is.
pub fn whole_segments(order: Vec<usize>) -> VecDeque<Segment> {
    order
        .into_iter()
        .map(|block| Segment { block, ranks: None })
        .collect()
}

/// The segments of the positions `share` of an epoch's sequence (see
/// [`share`]): blocks in `order`, cut to those positions.
pub fn segments(index: &ValidIndex, order: Vec<usize>, share: Range<u64>) -> VecDeque<Segment> {
    let mut out = VecDeque::new();
    let mut before = 0u64;
    for block in order {
        let count = index.blocks[block].count;
        let start = share.start.max(before);
        let end = share.end.min(before + count);
        if start < end {
            out.push_back(Segment {
                block,
                ranks: Some(start - before..end - before),
            });
        }
        before += count;
        if before >= share.end {
            break;
        }
    }
    out
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
/// join the buffer, so that draws rarely wait for one; and the buffer
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
            // waiting on any.
            while self.buffer.len() + self.staged.len() < target + self.ahead {
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
    use crate::windows::index::BlockIndex;

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
    fn shards_split_segments_disjointly() {
        let index = ValidIndex::from_blocks(vec![
            BlockIndex::all(5),
            BlockIndex::all(0),
            BlockIndex::all(7),
            BlockIndex::all(4),
        ]);
        for world in 1..=5 {
            let mut total = 0;
            for rank in 0..world {
                let shard = Shard {
                    rank,
                    world_size: world,
                };
                let range = share(16, shard, Shard::WHOLE, 1, false);
                let segs = segments(&index, block_order(4, true, 9, 2), range);
                total += segs
                    .iter()
                    .map(|s| s.ranks.as_ref().map_or(0, |r| r.end - r.start))
                    .sum::<u64>();
            }
            assert_eq!(total, 16, "world {world}");
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
            let sharded = segments(&index, order.clone(), 0..index.total);
            for segs in [sharded, whole_segments(order)] {
                let mut sampler = BlockSampler::new(segs, 2, 1, 7, shuffle);
                let mut seen = std::collections::HashSet::new();
                let origins = |b: &usize, s: &Segment| {
                    let ranks = s.ranks.clone().unwrap_or(0..index.blocks[*b].count);
                    Ok::<_, ()>(index.blocks[*b].origins(ranks))
                };
                while let Some((block, local)) = sampler.draw(|b| b, origins).unwrap() {
                    assert!(seen.insert((block, local)));
                }
                assert_eq!(seen.len(), 50);
            }
        }
    }
}

//! The valid-window index: one bit per window origin, built once per
//! dataset, window shape and validity rule by reading every block once.
//!
//! Missing values are counted per cell over all variables, summed over each
//! window with sliding sums along the window dimensions (linear in the
//! cells, whatever the window size), and compared with the rule. The index
//! holds bits, not data: changing the window from 3x3 to 5x5 costs one pass
//! over the data and no rewrite. The pass runs in the background
//! ([`super::live_index`]).

use std::ops::Range;
use std::sync::Arc;

use datafusion::arrow::array::Array;

use super::geometry::{WindowBlock, WindowGrid};
use super::sample::SampleLayout;
use super::sources::{BlockData, Sources};
use crate::table::{ReadAheadPlan, TableReadAhead};

/// The valid origins of one block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockIndex {
    /// One bit per origin (C order over the block's origins); `None` when all are valid.
    bits: Option<Vec<u64>>,
    /// Set bits before each word of `bits`.
    ranks: Vec<u32>,
    /// Number of valid origins.
    pub count: u64,
}

impl BlockIndex {
    /// Every origin of a block with `n` origins is valid.
    pub fn all(n: u64) -> Self {
        Self {
            bits: None,
            ranks: Vec::new(),
            count: n,
        }
    }

    /// Valid origins given by a bit per origin.
    pub fn from_bits(bits: Vec<u64>) -> Self {
        let mut ranks = Vec::with_capacity(bits.len());
        let mut count = 0u64;
        for word in &bits {
            ranks.push(count as u32);
            count += u64::from(word.count_ones());
        }
        Self {
            bits: Some(bits),
            ranks,
            count,
        }
    }

    /// The bits, one per origin; `None` when every origin is valid.
    pub fn bits(&self) -> Option<&[u64]> {
        self.bits.as_deref()
    }

    /// The local origin number of the `rank`-th valid origin.
    pub fn select(&self, rank: u64) -> u64 {
        let Some(bits) = &self.bits else {
            return rank;
        };
        let w = self.ranks.partition_point(|&r| u64::from(r) <= rank) - 1;
        let mut word = bits[w];
        for _ in 0..(rank - u64::from(self.ranks[w])) {
            word &= word - 1;
        }
        w as u64 * 64 + u64::from(word.trailing_zeros())
    }

    /// Local origin numbers of the valid origins among `local` (local
    /// origin numbers, valid or not), in order.
    pub fn origins_in(&self, local: Range<u64>) -> Vec<u32> {
        let Some(bits) = &self.bits else {
            return local.map(|r| r as u32).collect();
        };
        let mut out = Vec::new();
        for_words(bits, &local, |w, word| {
            let mut word = word;
            while word != 0 {
                out.push((w as u64 * 64 + u64::from(word.trailing_zeros())) as u32);
                word &= word - 1;
            }
        });
        out
    }

    /// Number of valid origins among `local` (local origin numbers).
    pub fn count_in(&self, local: Range<u64>) -> u64 {
        let Some(bits) = &self.bits else {
            return local.end.saturating_sub(local.start);
        };
        let mut count = 0u64;
        for_words(bits, &local, |_, word| {
            count += u64::from(word.count_ones())
        });
        count
    }
}

/// Calls `each` with every word of `bits` overlapping `local`, masked to it.
fn for_words(bits: &[u64], local: &Range<u64>, mut each: impl FnMut(usize, u64)) {
    let end = local.end.min(bits.len() as u64 * 64);
    if local.start >= end {
        return;
    }
    let (first, last) = ((local.start / 64) as usize, ((end - 1) / 64) as usize);
    for (w, &word) in bits.iter().enumerate().take(last + 1).skip(first) {
        let mut word = word;
        if w == first {
            word &= !0u64 << (local.start % 64);
        }
        if w == last && !end.is_multiple_of(64) {
            word &= (1u64 << (end % 64)) - 1;
        }
        each(w, word);
    }
}

/// Valid origins of every block of a window grid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidIndex {
    /// Per block, in the grid's block order.
    pub blocks: Vec<Arc<BlockIndex>>,
    /// Valid origins before each block.
    before: Vec<u64>,
    /// Number of valid windows.
    pub total: u64,
}

impl ValidIndex {
    /// An index from per-block indices.
    pub fn from_blocks(blocks: Vec<BlockIndex>) -> Self {
        Self::from_shared(blocks.into_iter().map(Arc::new).collect())
    }

    /// An index from shared per-block indices.
    pub fn from_shared(blocks: Vec<Arc<BlockIndex>>) -> Self {
        let mut before = Vec::with_capacity(blocks.len());
        let mut total = 0;
        for b in &blocks {
            before.push(total);
            total += b.count;
        }
        Self {
            blocks,
            before,
            total,
        }
    }

    /// The block and local origin of the `rank`-th valid window (natural order).
    pub fn locate(&self, rank: u64) -> (usize, u64) {
        let b = self.before.partition_point(|&n| n <= rank) - 1;
        (b, self.blocks[b].select(rank - self.before[b]))
    }
}

/// How far reading the chunks of every source over the blocks of `grid`
/// reads ahead of `decoders` threads when a store is remote, per source
/// (see [`read_ahead_plans`]). `None` without blocks.
pub(super) fn block_read_ahead(
    sources: &Sources,
    grid: &WindowGrid,
    io_concurrency: usize,
    decoders: usize,
    room: Option<usize>,
) -> Option<Vec<ReadAheadPlan>> {
    let largest = grid
        .blocks
        .iter()
        .max_by_key(|b| b.num_cells())
        .map(|b| b.extent.clone())?;
    Some(read_ahead_plans(
        sources,
        &largest,
        io_concurrency,
        decoders,
        room,
    ))
}

/// How far reading the chunks of every source over boxes as large as the
/// reference box `largest` reads ahead of `decoders` threads (each
/// decoding a box at once) when a store is remote, per source: the chunks
/// of their boxes and up to `io_concurrency` more (shared among the
/// sources), in flight at once, no more than `room` bytes hold in all
/// (`None`: no limit).
pub(super) fn read_ahead_plans(
    sources: &Sources,
    largest: &[Range<u64>],
    io_concurrency: usize,
    decoders: usize,
    room: Option<usize>,
) -> Vec<ReadAheadPlan> {
    let parts = sources.list.len();
    sources
        .list
        .iter()
        .enumerate()
        .map(|(s, source)| {
            let table = &source.table;
            let columns = source.columns();
            let shape: Vec<u64> = sources
                .source_box(s, largest, &[])
                .iter()
                .map(|r| r.end - r.start)
                .collect();
            let plan = ReadAheadPlan::new(table, &columns, io_concurrency, &shape, decoders.max(1))
                .split(parts);
            match room {
                Some(room) => plan.within(room / parts),
                None => plan,
            }
        })
        .collect()
}

/// A window reading the chunks of every source over blocks of `grid`, as
/// `plans` (from [`block_read_ahead`]) say, where a store is remote, the
/// keys of `interleave` blocks read at once interleaved. Block number `i`
/// of the window is `block_at(i)`, asked for as the window gets there; the
/// window ends at the first number without a block or at `count`.
pub(super) fn read_blocks_ahead<F>(
    sources: &Arc<Sources>,
    grid: &Arc<WindowGrid>,
    count: u64,
    block_at: F,
    plans: Vec<ReadAheadPlan>,
    interleave: usize,
) -> Option<TableReadAhead>
where
    F: Fn(u64) -> Option<usize> + Clone + Send + 'static,
{
    let grid = Arc::clone(grid);
    let extent_at = move |n| block_at(n).map(|b| grid.blocks[b].extent.clone());
    read_boxes_ahead(sources, count, extent_at, plans, interleave)
}

/// A window reading the chunks of every source over reference boxes, as
/// `plans` (from [`read_ahead_plans`]) say, where a store is remote, the
/// keys of `interleave` boxes read at once interleaved. Box number `i` of
/// the window is `extent_at(i)`, asked for as the window gets there; the
/// window ends at the first number without a box or at `count`.
pub(super) fn read_boxes_ahead<F>(
    sources: &Arc<Sources>,
    count: u64,
    extent_at: F,
    plans: Vec<ReadAheadPlan>,
    interleave: usize,
) -> Option<TableReadAhead>
where
    F: Fn(u64) -> Option<Vec<Range<u64>>> + Clone + Send + 'static,
{
    let parts: Vec<TableReadAhead> = plans
        .into_iter()
        .enumerate()
        .filter_map(|(s, plan)| {
            let source = &sources.list[s];
            let table = &source.table;
            let columns = source.columns();
            let sources = Arc::clone(sources);
            let (known, boxes) = (extent_at.clone(), extent_at.clone());
            plan.start(
                table,
                &columns,
                (0..count).take_while(move |&n| known(n).is_some()),
                interleave.max(1),
                move |number| {
                    boxes(number)
                        .map(|extent| vec![sources.source_box(s, &extent, &[])])
                        .unwrap_or_default()
                },
            )
        })
        .collect();
    (!parts.is_empty()).then(|| TableReadAhead::merge(parts))
}

/// The valid origins of one block, from its decoded columns (`data`, of
/// every source, read for the block's extent).
///
/// Per role, missing values are counted per cell over the variables of
/// each step the role uses, summed over each window's plane with sliding
/// sums, added up over the role's steps, and compared with the largest
/// count the role's rule allows. Blocks without a missing value skip all
/// of it.
pub(super) fn index_block(
    grid: &WindowGrid,
    block: &WindowBlock,
    data: &BlockData,
    layout: &SampleLayout,
    sources: &Sources,
) -> BlockIndex {
    let n = block.num_origins() as usize;
    let any_missing = data.columns.iter().any(|c| c.null_count() > 0);
    if !any_missing || layout.keeps_everything() {
        return BlockIndex::all(n as u64);
    }
    let lead = layout.lead.map(|l| l.axis);
    let shape: Vec<usize> = block
        .extent
        .iter()
        .map(|r| (r.end - r.start) as usize)
        .collect();
    // The box of plane sums: sliding along window axes but the lead axis.
    let mut summed = shape.clone();
    for (d, axis) in grid.axes.iter().enumerate() {
        if axis.window && Some(d) != lead {
            summed[d] -= axis.size as usize - 1;
        }
    }
    let rank = shape.len();
    let mut strides = vec![1usize; rank];
    for d in (0..rank.saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * summed[d + 1];
    }
    // Offset of each origin along each dimension, within the summed box.
    let offsets: Vec<Vec<usize>> = grid
        .axes
        .iter()
        .zip(&block.origins)
        .zip(&block.extent)
        .zip(&strides)
        .map(|(((axis, origins), extent), stride)| {
            origins
                .clone()
                .map(|k| (axis.index(k) - extent.start) as usize * stride)
                .collect()
        })
        .collect();
    let plane_cells: u64 = grid
        .axes
        .iter()
        .enumerate()
        .filter(|(d, _)| layout.in_plane(*d))
        .map(|(_, a)| a.size)
        .product();
    let mut bits = vec![!0u64; n.div_ceil(64)];
    if !n.is_multiple_of(64) {
        if let Some(last) = bits.last_mut() {
            *last = (1u64 << (n % 64)) - 1;
        }
    }
    for role in &layout.roles {
        let total = plane_cells * role.channels.len() as u64;
        let allowed = role.validity.max_missing(total);
        if allowed >= total {
            continue;
        }
        let mut counts = vec![0u32; n];
        let mut slots: Vec<u64> = role.channels.iter().map(|c| c.slot).collect();
        slots.sort_unstable();
        slots.dedup();
        for slot in slots {
            // A variable's channels of one step are counted together
            // (over its channel dimensions).
            let mut variables: Vec<usize> = role
                .channels
                .iter()
                .filter(|c| c.slot == slot)
                .map(|c| c.variable)
                .collect();
            variables.sort_unstable();
            variables.dedup();
            let mut missing: Option<Vec<u32>> = None;
            for f in variables {
                let Some(counts) = sources.missing(f, data, &block.extent, &layout.channel_axes)
                else {
                    continue;
                };
                match &mut missing {
                    None => missing = Some(counts),
                    Some(sum) => sum.iter_mut().zip(counts).for_each(|(a, b)| *a += b),
                }
            }
            let Some(mut missing) = missing else {
                continue;
            };
            let mut box_shape = shape.clone();
            for (d, axis) in grid.axes.iter().enumerate() {
                if axis.window && axis.size > 1 && Some(d) != lead {
                    missing = sliding_sum(&missing, &box_shape, d, axis.size as usize);
                    box_shape[d] -= axis.size as usize - 1;
                }
            }
            let shift = lead.map_or(0, |d| slot as usize * strides[d]);
            for_each_origin(&offsets, |local, base| {
                counts[local] += missing[base + shift];
            });
        }
        let allowed = allowed as u32;
        for (local, &count) in counts.iter().enumerate() {
            if count > allowed {
                bits[local / 64] &= !(1u64 << (local % 64));
            }
        }
    }
    BlockIndex::from_bits(bits)
}

/// Calls `f(local, offset)` for each origin of a block in C order, with its
/// offset: the sum of its per-dimension offsets (`offsets[d][k]`).
fn for_each_origin(offsets: &[Vec<usize>], mut f: impl FnMut(usize, usize)) {
    let Some((inner, outer)) = offsets.split_last() else {
        return;
    };
    let n: usize = offsets.iter().map(Vec::len).product();
    let mut position = vec![0usize; outer.len()];
    let mut local = 0usize;
    while local < n {
        let base: usize = outer.iter().zip(&position).map(|(o, &p)| o[p]).sum();
        for &offset in inner {
            f(local, base + offset);
            local += 1;
        }
        for d in (0..outer.len()).rev() {
            position[d] += 1;
            if position[d] < outer[d].len() {
                break;
            }
            position[d] = 0;
        }
    }
}

/// Sums of `size` consecutive cells along dimension `d` of a C-order box of
/// `shape`; the result has `shape[d] - size + 1` cells along `d`.
fn sliding_sum(values: &[u32], shape: &[usize], d: usize, size: usize) -> Vec<u32> {
    let outer: usize = shape[..d].iter().product();
    let len = shape[d];
    let inner: usize = shape[d + 1..].iter().product();
    let out_len = len + 1 - size;
    let mut out = vec![0u32; outer * out_len * inner];
    if inner == 1 {
        for (src, dst) in values.chunks_exact(len).zip(out.chunks_exact_mut(out_len)) {
            let mut sum: u32 = src[..size].iter().sum();
            dst[0] = sum;
            for j in 1..out_len {
                sum = sum + src[j + size - 1] - src[j - 1];
                dst[j] = sum;
            }
        }
        return out;
    }
    for o in 0..outer {
        let src = &values[o * len * inner..(o + 1) * len * inner];
        let dst = &mut out[o * out_len * inner..(o + 1) * out_len * inner];
        let (first, rest) = dst.split_at_mut(inner);
        for t in 0..size {
            for (acc, v) in first.iter_mut().zip(&src[t * inner..(t + 1) * inner]) {
                *acc += v;
            }
        }
        let mut previous: &[u32] = first;
        for (j, row) in rest.chunks_exact_mut(inner).enumerate() {
            let entering = &src[(j + size) * inner..(j + size + 1) * inner];
            let leaving = &src[j * inner..(j + 1) * inner];
            for i in 0..inner {
                row[i] = previous[i] + entering[i] - leaving[i];
            }
            previous = row;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_and_counts_in_a_local_range_match_the_bits() {
        let bits: Vec<u64> = vec![0xF0F0_0000_0000_0F0F, 0, !0, 0x8000_0000_0000_0001];
        let index = BlockIndex::from_bits(bits.clone());
        let valid = |i: u64| bits[(i / 64) as usize] >> (i % 64) & 1 == 1;
        for (a, b) in [
            (0, 256),
            (3, 9),
            (60, 130),
            (64, 128),
            (127, 129),
            (200, 256),
            (5, 5),
            (250, 300),
        ] {
            let want: Vec<u32> = (a..b.min(256))
                .filter(|&i| valid(i))
                .map(|i| i as u32)
                .collect();
            assert_eq!(index.origins_in(a..b), want, "{a}..{b}");
            assert_eq!(index.count_in(a..b), want.len() as u64, "{a}..{b}");
        }
        assert_eq!(BlockIndex::all(10).origins_in(2..5), vec![2, 3, 4]);
        assert_eq!(BlockIndex::all(10).count_in(2..5), 3);
    }

    #[test]
    fn sliding_sum_matches_naive() {
        let shape = [3usize, 7, 4];
        let values: Vec<u32> = (0..84).map(|i| (i * 7 % 5) as u32).collect();
        for d in 0..3 {
            for size in 1..=shape[d] {
                let out = sliding_sum(&values, &shape, d, size);
                let mut out_shape = shape;
                out_shape[d] = shape[d] - size + 1;
                for a in 0..out_shape[0] {
                    for b in 0..out_shape[1] {
                        for c in 0..out_shape[2] {
                            let mut expected = 0;
                            for t in 0..size {
                                let mut idx = [a, b, c];
                                idx[d] += t;
                                expected += values[idx[0] * 28 + idx[1] * 4 + idx[2]];
                            }
                            let got = out[a * out_shape[1] * out_shape[2] + b * out_shape[2] + c];
                            assert_eq!(got, expected, "d={d} size={size} at {a},{b},{c}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn select_and_origins_in_follow_the_bits() {
        let mut bits = vec![0u64; 3];
        let set = [1u64, 5, 63, 64, 100, 130, 191];
        for &i in &set {
            bits[(i / 64) as usize] |= 1 << (i % 64);
        }
        let index = BlockIndex::from_bits(bits);
        assert_eq!(index.count, set.len() as u64);
        for (rank, &i) in set.iter().enumerate() {
            assert_eq!(index.select(rank as u64), i);
        }
        assert_eq!(index.origins_in(60..131), vec![63, 64, 100, 130]);
        assert_eq!(index.origins_in(0..192).len(), 7);
        let all = ValidIndex::from_blocks(vec![BlockIndex::all(3), index]);
        assert_eq!(all.total, 10);
        assert_eq!(all.locate(2), (0, 2));
        assert_eq!(all.locate(3), (1, 1));
        assert_eq!(all.locate(9), (1, 191));
    }
}

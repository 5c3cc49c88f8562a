//! Blocks of a grid: the one block planner and enumerator of every
//! operator.
//!
//! A scan's or an operator's block is a box of whole storage chunks, grown
//! (outermost dimension first) toward a target number of decoded bytes,
//! but kept small enough that every core gets work ([`BlockGrid::plan`]).
//! Only blocks inside the selection's bounding box are enumerated, lazily,
//! so planning costs nothing per chunk. The regular grids that task runners
//! deal out (a rechunk's regions, a copy's chunks, the FFT passes' batches)
//! are block grids too ([`BlockGrid::covering`]), numbered in C order or
//! with one dimension innermost ([`BlockGrid::block_along`]).

use std::ops::Range;
use std::sync::Arc;

use datafusion::catalog::Session;
use datafusion::common::config::ConfigOptions;
use datafusion::common::{exec_err, Result};
use datafusion::execution::memory_pool::MemoryLimit;
use datafusion::execution::TaskContext;
use datafusion_distributed::DistributedTaskContext;

use super::dataset::GridTable;
use super::selection::Selection;
use crate::config::ZarrConfig;

/// What an operator holds per block beside the block's decoded columns:
/// `per_cell` bytes for each of the block's first `cells` cells (buffers
/// sized by the block up to a cap, such as a reduction's runs of rows).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockTemporaries {
    /// Bytes per cell.
    pub per_cell: u64,
    /// The most cells they are held for.
    pub cells: u64,
}

impl BlockTemporaries {
    /// Their bytes beside a block of `block_cells` cells.
    pub fn bytes(&self, block_cells: u64) -> u64 {
        self.cells.min(block_cells).saturating_mul(self.per_cell)
    }

    /// The most decoded bytes (at `cell_bytes` a cell) a block may hold so
    /// that it and these temporaries take at most `room` bytes.
    pub fn block_bytes_within(&self, room: u64, cell_bytes: u64) -> u64 {
        if self.per_cell == 0 || self.cells == 0 || cell_bytes == 0 {
            return u64::MAX;
        }
        let capped = self.cells.saturating_mul(self.per_cell);
        let cells = match self.cells.saturating_mul(cell_bytes).saturating_add(capped) <= room {
            // Beyond the cap, every cell costs its decoded bytes only.
            true => (room - capped) / cell_bytes,
            false => room / (cell_bytes + self.per_cell),
        };
        cells.saturating_mul(cell_bytes)
    }
}

/// The blocks of a scan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockGrid {
    shape: Vec<u64>,
    block_shape: Vec<u64>,
    /// First block index, per dimension, inside the bounding box.
    first: Vec<u64>,
    /// Number of blocks, per dimension, inside the bounding box.
    counts: Vec<u64>,
}

impl BlockGrid {
    /// Plans blocks over `shape`, aligned to `chunk_shape`, for a selection.
    ///
    /// `bytes_per_cell` is the decoded size of one row of the projected
    /// variables; `parallelism` is the number of partitions wanted.
    pub fn plan(
        shape: &[u64],
        chunk_shape: &[u64],
        selection: &Selection,
        bytes_per_cell: u64,
        target_bytes: u64,
        parallelism: u64,
    ) -> Self {
        let rank = shape.len();
        let chunk: Vec<u64> = (0..rank)
            .map(|d| {
                chunk_shape
                    .get(d)
                    .copied()
                    .unwrap_or(shape[d])
                    .clamp(1, shape[d].max(1))
            })
            .collect();
        let bounding = selection.bounding_box();
        let chunks_in_box: u64 = match &bounding {
            Some(b) => (0..rank)
                .map(|d| b[d].end.div_ceil(chunk[d]) - b[d].start / chunk[d])
                .product(),
            None => 0,
        };
        let chunk_bytes = chunk.iter().product::<u64>().max(1) * bytes_per_cell.max(1);
        let mut factor = (target_bytes / chunk_bytes)
            .min(chunks_in_box / parallelism.max(1))
            .max(1);
        let mut block_shape = chunk.clone();
        for d in 0..rank {
            if factor < 2 {
                break;
            }
            let grid = shape[d].div_ceil(chunk[d]).max(1);
            let m = factor.min(grid);
            block_shape[d] = chunk[d] * m;
            factor /= m;
        }
        Self::over(shape, block_shape, bounding)
    }

    /// Blocks of `block_shape` over the box `bounding` (none when `None`).
    fn over(shape: &[u64], block_shape: Vec<u64>, bounding: Option<Vec<Range<u64>>>) -> Self {
        let rank = shape.len();
        let (first, counts) = match bounding {
            Some(b) => (0..rank)
                .map(|d| {
                    let first = b[d].start / block_shape[d];
                    (first, b[d].end.div_ceil(block_shape[d]) - first)
                })
                .unzip(),
            None => (vec![0; rank], vec![0; rank]),
        };
        Self {
            shape: shape.to_vec(),
            block_shape,
            first,
            counts,
        }
    }

    /// Every block of `block_shape` (each length at least 1) over a grid of
    /// `shape`, the last along a dimension cut at its end; none when the
    /// grid is empty.
    pub fn covering(shape: &[u64], block_shape: &[u64]) -> Self {
        let block_shape = (0..shape.len())
            .map(|d| block_shape.get(d).copied().unwrap_or(1).max(1))
            .collect();
        Self::over(
            shape,
            block_shape,
            Some(shape.iter().map(|&n| 0..n).collect()),
        )
    }

    /// Blocks of `block_shape` (as another process planned them) over
    /// `selection` of a grid of `shape`; an error when the shape does not
    /// fit the grid.
    pub fn with_block_shape(
        shape: &[u64],
        block_shape: Vec<u64>,
        selection: &Selection,
    ) -> std::result::Result<Self, String> {
        let fits = block_shape.len() == shape.len()
            && selection.rank() == shape.len()
            && block_shape.iter().all(|&b| b >= 1);
        if !fits {
            return Err(format!(
                "blocks of shape {block_shape:?} over a grid of shape {shape:?}"
            ));
        }
        Ok(Self::over(shape, block_shape, selection.bounding_box()))
    }

    /// Plans the blocks that read `columns` (indices into the table's
    /// schema) of `table` over `selection`, with the session's target
    /// partition bytes and parallelism, and blocks of at most
    /// `max_block_bytes` stored bytes where given (a block is still at least
    /// one chunk).
    pub fn for_columns(
        table: &GridTable,
        columns: &[usize],
        selection: &Selection,
        options: &ConfigOptions,
        max_block_bytes: Option<usize>,
    ) -> Self {
        let bytes_per_cell: u64 = columns.iter().map(|&i| table.cell_bytes(i) as u64).sum();
        let target_bytes = ZarrConfig::of(options)
            .target_partition_bytes
            .min(max_block_bytes.unwrap_or(usize::MAX));
        Self::plan(
            &table.shape(),
            &table.chunk_shape(),
            selection,
            bytes_per_cell,
            target_bytes as u64,
            options.execution.target_partitions.max(1) as u64,
        )
    }

    /// The blocks of an operator that reads `columns` of `table` over
    /// `selection` with a worker per partition of the session: under a
    /// memory limit, blocks shrink (to whole chunks at least) so that each
    /// worker's block takes at most a quarter of its share of the limit
    /// (the rest: its temporaries, state and reads ahead), and its block
    /// and `temporaries` together at most half. Returns them with the
    /// limit (if any) and the number of workers.
    pub fn for_workers(
        table: &GridTable,
        columns: &[usize],
        selection: &Selection,
        session: &dyn Session,
        temporaries: BlockTemporaries,
    ) -> (Self, Option<usize>, usize) {
        let options = session.config().options();
        let memory_limit = match session.runtime_env().memory_pool.memory_limit() {
            MemoryLimit::Finite(bytes) => Some(bytes),
            _ => None,
        };
        let parallelism = options.execution.target_partitions.max(1);
        let cell_bytes: u64 = columns.iter().map(|&i| table.cell_bytes(i) as u64).sum();
        let max_block_bytes = memory_limit.map(|bytes| {
            let quarter = bytes / (4 * parallelism);
            let half = (bytes / (2 * parallelism)) as u64;
            let most = temporaries.block_bytes_within(half, cell_bytes);
            quarter.min(usize::try_from(most).unwrap_or(usize::MAX))
        });
        let blocks = Self::for_columns(table, columns, selection, options, max_block_bytes);
        (blocks, memory_limit, parallelism)
    }

    /// Number of blocks to visit.
    pub fn num_blocks(&self) -> u64 {
        self.counts.iter().product()
    }

    /// Number of blocks along dimension `d`: a column of blocks when they
    /// are visited with `d` innermost ([`BlockGrid::block_along`]).
    pub fn count_along(&self, d: usize) -> u64 {
        self.counts.get(d).copied().unwrap_or(1)
    }

    /// The shape of a (full) block.
    pub fn block_shape(&self) -> &[u64] {
        &self.block_shape
    }

    /// The extent of block `id` (0-based, C order over the bounding box).
    pub fn block(&self, id: u64) -> Vec<Range<u64>> {
        let mut rest = id;
        let mut extent = vec![0..0; self.shape.len()];
        for d in (0..self.shape.len()).rev() {
            let index = self.first[d] + rest % self.counts[d];
            rest /= self.counts[d];
            let start = index * self.block_shape[d];
            extent[d] = start..(start + self.block_shape[d]).min(self.shape[d]);
        }
        extent
    }

    /// The extent of block `j` when the blocks are visited with dimension
    /// `d` innermost (C order over the other dimensions, then along `d`):
    /// consecutive blocks along `d` come one after the other.
    pub fn block_along(&self, d: usize, j: u64) -> Vec<Range<u64>> {
        let mut extent = vec![0..0; self.shape.len()];
        let mut put = |k: usize, p: u64| {
            let start = (self.first[k] + p) * self.block_shape[k];
            extent[k] = start..(start + self.block_shape[k]).min(self.shape[k]);
        };
        put(d, j % self.counts[d].max(1));
        let mut rest = j / self.counts[d].max(1);
        for k in (0..self.shape.len()).rev().filter(|&k| k != d) {
            put(k, rest % self.counts[k].max(1));
            rest /= self.counts[k].max(1);
        }
        extent
    }
}

/// Share `i` of `n` contiguous, near-equal shares of `range` (a task's
/// or a partition's run of blocks).
pub fn share_of(range: Range<u64>, i: u64, n: u64) -> Range<u64> {
    let len = u128::from(range.end.saturating_sub(range.start));
    let n = u128::from(n.max(1));
    let at = |i: u64| range.start + (len * u128::from(i).min(n) / n) as u64;
    at(i)..at(i.saturating_add(1))
}

/// Share `i` of `n` of `range`, cut only between runs of `unit` blocks
/// (counted from block 0: the columns of blocks along one dimension):
/// near-equal in runs, the range's first and last runs clipped to it.
/// [`share_of`] when `unit` is 1.
pub fn share_of_runs(range: Range<u64>, i: u64, n: u64, unit: u64) -> Range<u64> {
    let unit = unit.max(1);
    let runs = share_of(range.start / unit..range.end.div_ceil(unit), i, n);
    let clip = |run: u64| {
        run.saturating_mul(unit)
            .clamp(range.start, range.end.max(range.start))
    };
    clip(runs.start)..clip(runs.end)
}

/// A node's tasks when it takes them from its stage (a node that is not
/// a stage's leaf, such as a scan with a table joined in, whose stage's
/// tasks the distributed planner counts without telling it): each
/// execution runs as the task its `DistributedTaskContext` names, of as
/// many as that says.
pub const TASKS_OF_STAGE: usize = 0;

/// How `EXPLAIN` shows a node's `tasks`: nothing for one, `, tasks=N`,
/// or `, tasks=its stage's` ([`TASKS_OF_STAGE`]).
pub fn shown_tasks(tasks: usize) -> String {
    match tasks {
        1 => String::new(),
        TASKS_OF_STAGE => ", tasks=its stage's".to_string(),
        n => format!(", tasks={n}"),
    }
}

/// Which of `tasks` tasks of a cluster's stage this execution of `node`
/// (over `of`, a store) runs as, and of how many: task 0 of 1 when `tasks`
/// is 1 (one process runs them all), else the task its
/// `DistributedTaskContext` names, which must be one of the `tasks` it was
/// planned for ([`TASKS_OF_STAGE`]: of as many as it says).
pub fn task_index(
    node: &str,
    of: &str,
    tasks: usize,
    context: &Arc<TaskContext>,
) -> Result<(usize, usize)> {
    if tasks == 1 {
        return Ok((0, 1));
    }
    let ctx = DistributedTaskContext::from_ctx(context);
    let planned = ctx.task_count == tasks || tasks == TASKS_OF_STAGE;
    if !planned || ctx.task_index >= ctx.task_count {
        return exec_err!(
            "{node} over {of} was planned for {tasks} tasks, but runs as task {} of {}",
            ctx.task_index,
            ctx.task_count
        );
    }
    Ok((ctx.task_index, ctx.task_count))
}

/// The share of `all` (blocks, or tasks of a node) that this execution of
/// `node` runs as task [`task_index`] of `tasks`: contiguous runs in order.
pub fn task_share(
    node: &str,
    of: &str,
    tasks: usize,
    all: Range<u64>,
    context: &Arc<TaskContext>,
) -> Result<Range<u64>> {
    let (task, count) = task_index(node, of, tasks, context)?;
    Ok(share_of(all, task as u64, count as u64))
}

/// The boxes of `selection` inside `extent`: the Cartesian product of the
/// selected ranges of each dimension, clipped to the block.
pub fn boxes_in_block(selection: &Selection, extent: &[Range<u64>]) -> Vec<Vec<Range<u64>>> {
    let mut boxes: Vec<Vec<Range<u64>>> = vec![Vec::new()];
    for (d, block_range) in extent.iter().enumerate() {
        let clipped: Vec<Range<u64>> = selection
            .ranges(d)
            .iter()
            .filter_map(|r| {
                let start = r.start.max(block_range.start);
                let end = r.end.min(block_range.end);
                (start < end).then_some(start..end)
            })
            .collect();
        if clipped.is_empty() {
            return Vec::new();
        }
        boxes = boxes
            .into_iter()
            .flat_map(|prefix| {
                clipped.iter().map(move |r| {
                    let mut b = prefix.clone();
                    b.push(r.clone());
                    b
                })
            })
            .collect();
    }
    boxes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_and_its_temporaries_fit_the_room_given() {
        // A naive search: the most cells whose bytes and temporaries fit.
        let naive = |t: BlockTemporaries, room: u64, cell: u64| {
            let fits = |n: u64| n * cell + t.bytes(n) <= room;
            (0..=room).take_while(|&n| fits(n)).last().unwrap_or(0) * cell
        };
        for (per_cell, cells) in [(56, 16), (8, 1), (100, 1000), (3, 7)] {
            let t = BlockTemporaries { per_cell, cells };
            for room in [0, 1, 63, 64, 500, 1000, 4099, 20_000] {
                for cell in [1, 4, 8, 12] {
                    let got = t.block_bytes_within(room, cell);
                    assert_eq!(got, naive(t, room, cell), "{t:?} {room} {cell}");
                }
            }
        }
        let none = BlockTemporaries::default();
        assert_eq!(none.block_bytes_within(100, 8), u64::MAX);
        assert_eq!(none.bytes(1000), 0);
    }

    #[test]
    fn shares_in_runs_cover_the_range_once_cut_between_runs() {
        for (range, unit) in [
            (0..12, 4),
            (0..13, 4),
            (5..23, 4),
            (3..4, 5),
            (0..0, 3),
            (7..20, 1),
        ] {
            for n in 1..6u64 {
                let shares: Vec<Range<u64>> = (0..n)
                    .map(|i| share_of_runs(range.clone(), i, n, unit))
                    .collect();
                // In order, end to end, over the whole range.
                let mut at = range.start;
                for share in &shares {
                    assert_eq!(share.start, at, "{range:?} / {unit} in {n}: {shares:?}");
                    assert!(share.end >= share.start);
                    at = share.end;
                }
                assert_eq!(at, range.end, "{range:?} / {unit} in {n}: {shares:?}");
                // Cut only between runs (or at the range's ends).
                for share in &shares {
                    let inside = share.start != range.start && share.start != range.end;
                    assert!(
                        !inside || share.start % unit == 0,
                        "{range:?} / {unit}: {shares:?}"
                    );
                }
                if unit == 1 {
                    let plain: Vec<_> = (0..n).map(|i| share_of(range.clone(), i, n)).collect();
                    assert_eq!(shares, plain);
                }
            }
        }
    }

    #[test]
    fn blocks_cover_the_grid_once() {
        let shape = [10, 7];
        let selection = Selection::all(&shape);
        for target in [1, 50, 10_000] {
            let grid = BlockGrid::plan(&shape, &[3, 4], &selection, 1, target, 2);
            let mut seen = vec![0u8; 70];
            for id in 0..grid.num_blocks() {
                for b in boxes_in_block(&selection, &grid.block(id)) {
                    for i in b[0].clone() {
                        for j in b[1].clone() {
                            seen[(i * 7 + j) as usize] += 1;
                        }
                    }
                }
            }
            assert!(seen.iter().all(|n| *n == 1), "target {target}: {seen:?}");
        }
    }

    #[test]
    fn blocks_along_a_dimension_visit_each_block_once_in_runs_along_it() {
        let shape = [10, 7, 5];
        let selection = Selection::all(&shape);
        let grid = BlockGrid::plan(&shape, &[3, 4, 2], &selection, 1, 1, 2);
        let n = grid.num_blocks();
        for d in 0..3 {
            let mut seen: Vec<Vec<Range<u64>>> = (0..n).map(|j| grid.block_along(d, j)).collect();
            // Within a run, the other dimensions stay and `d` steps on.
            let along = shape[d].div_ceil(grid.block_shape()[d]);
            for j in 1..n {
                let (a, b) = (&seen[j as usize - 1], &seen[j as usize]);
                if j % along != 0 {
                    assert_eq!(a[d].end, b[d].start, "d={d} j={j}");
                    assert!((0..3).filter(|&k| k != d).all(|k| a[k] == b[k]));
                }
            }
            let mut all: Vec<Vec<Range<u64>>> = (0..n).map(|id| grid.block(id)).collect();
            let key = |e: &Vec<Range<u64>>| e.iter().map(|r| (r.start, r.end)).collect::<Vec<_>>();
            seen.sort_by_key(key);
            all.sort_by_key(key);
            assert_eq!(seen, all, "d={d}");
        }
    }

    /// The blocks of `step` over `shape`, enumerated naively in C order.
    fn naive_blocks(shape: &[u64], step: &[u64]) -> Vec<Vec<Range<u64>>> {
        let mut out = vec![Vec::new()];
        for (&n, &s) in shape.iter().zip(step) {
            let starts: Vec<u64> = (0..n).step_by(s as usize).collect();
            out = out
                .into_iter()
                .flat_map(|prefix| {
                    starts.iter().map(move |&a| {
                        let mut b = prefix.clone();
                        b.push(a..(a + s).min(n));
                        b
                    })
                })
                .collect();
        }
        out
    }

    #[test]
    fn a_covering_grid_enumerates_the_naive_blocks_in_c_order_and_along_each_dimension() {
        let cases: [(&[u64], &[u64]); 6] = [
            (&[5, 7, 3], &[2, 3, 2]),
            (&[10, 1], &[4, 1]),
            (&[6], &[6]),
            (&[4, 4], &[9, 1]),
            (&[], &[]),
            (&[3, 0, 2], &[1, 1, 1]),
        ];
        for (shape, step) in cases {
            let grid = BlockGrid::covering(shape, step);
            let expected = if shape.contains(&0) {
                Vec::new()
            } else {
                naive_blocks(shape, step)
            };
            let blocks: Vec<_> = (0..grid.num_blocks()).map(|i| grid.block(i)).collect();
            assert_eq!(blocks, expected, "{shape:?} by {step:?}");
            for along in 0..shape.len() {
                let mut seen: Vec<_> = (0..grid.num_blocks())
                    .map(|j| grid.block_along(along, j))
                    .collect();
                // Runs along `along`: consecutive blocks of a run differ
                // only there, each starting where the last ended.
                let run = shape[along].div_ceil(step[along]).max(1) as usize;
                for blocks in seen.chunks(run) {
                    for w in blocks.windows(2) {
                        assert_eq!(w[0][along].end, w[1][along].start);
                        let others = (0..shape.len()).filter(|&d| d != along);
                        assert!(others.clone().all(|d| w[0][d] == w[1][d]));
                    }
                }
                seen.sort_by_key(|b| b.iter().map(|r| r.start).collect::<Vec<_>>());
                assert_eq!(seen, expected, "{shape:?} by {step:?} along {along}");
            }
        }
        // A zero block length is taken as 1.
        assert_eq!(BlockGrid::covering(&[3], &[0]).num_blocks(), 3);
    }

    #[test]
    fn blocks_align_to_chunks_and_grow_outermost_first() {
        let shape = [100, 20, 20];
        let grid = BlockGrid::plan(&shape, &[1, 20, 20], &Selection::all(&shape), 4, 16_000, 2);
        assert_eq!(grid.block_shape(), &[10, 20, 20]);
        assert_eq!(grid.num_blocks(), 10);
        assert_eq!(grid.block(9), vec![90..100, 0..20, 0..20]);
    }
}

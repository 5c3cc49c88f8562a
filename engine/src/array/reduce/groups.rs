//! The dense group space of a reduction, and how the rows of a box map to it.
//!
//! Grouping by a subset of a grid's dimensions, every group is a position
//! in the Cartesian product of the grouped dimensions' keys, numbered in C
//! order (table order of the dimensions). A dimension's keys are its
//! selected coordinates, or, when it is grouped by functions of its
//! coordinate (`date_trunc('day', time)`, `floor(lat / 2)`), the distinct
//! values those take ([`KeyMap`]: the key of each selected position). The
//! rows of a box (C order too) fall into groups in long regular runs:
//! along a line of the innermost dimension the group either stays the same
//! (the innermost dimension is reduced away, or runs of its positions share
//! a key) or advances by one per row (it is kept). [`GroupSpace::lines`]
//! describes a run of rows as such lines, merged where consecutive lines
//! continue each other, so accumulators work on slices instead of looking
//! up a group per row.
//!
//! When a box's outer dimensions are reduced away and its inner ones kept
//! (time-chunked data grouped by space, as in `GROUP BY lat, lon`), every
//! outer step sweeps the state of all the box's groups; once that state is
//! larger than a cache, folding row runs in order streams it through memory
//! once per step. [`GroupSpace::tiles`] then cuts the box into tiles: a
//! narrow range of inner positions over several outer steps, whose groups'
//! state stays in cache while the tile's runs are folded one after the
//! other.

use std::ops::Range;

use crate::table::Selection;

/// A run of consecutive rows of a batch that map to groups regularly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Line {
    /// First row, relative to the batch.
    pub offset: usize,
    /// Number of rows.
    pub len: usize,
    /// The group of the first row.
    pub group: usize,
    /// Whether row `i` of the line belongs to group `group + i` (`true`) or
    /// every row to `group` (`false`).
    pub spread: bool,
}

/// Row ranges of a box (C order) folded one after the other.
pub type Tile = Vec<Range<u64>>;

/// Group state a box may have before [`GroupSpace::tiles`] tiles it: about
/// what a core's L2 cache holds.
pub const TILE_STATE_BYTES: u64 = 512 * 1024;

/// The fewest inner positions a tile spans, so that its row ranges stay
/// long enough to copy and fold efficiently.
pub const MIN_TILE_RUN: u64 = 1024;

/// The keys of a dimension grouped by functions of its coordinate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyMap {
    /// The key of each selected position, in selection order.
    pub keys: Vec<u32>,
    /// The number of keys (every one is some position's).
    pub count: usize,
}

impl KeyMap {
    /// Which way the keys run along the positions: `Some(false)` never
    /// decreasing, `Some(true)` never increasing (each key's positions one
    /// run, the runs in the order of their keys, forward or backward),
    /// `None` otherwise.
    pub fn direction(&self) -> Option<bool> {
        if self.keys.windows(2).all(|w| w[0] <= w[1]) {
            Some(false)
        } else if self.keys.windows(2).all(|w| w[0] >= w[1]) {
            Some(true)
        } else {
            None
        }
    }

    /// The positions (in selection order) of the keys `keys`, the keys
    /// running along the positions as [`Self::direction`] says
    /// (`descending`).
    pub fn positions_of(&self, keys: Range<usize>, descending: bool) -> Range<u64> {
        let key = |k: usize| u32::try_from(k).unwrap_or(u32::MAX);
        let (low, high) = (key(keys.start), key(keys.end));
        let (start, end) = match descending {
            false => (
                self.keys.partition_point(|&k| k < low),
                self.keys.partition_point(|&k| k < high),
            ),
            true => (
                self.keys.partition_point(|&k| k >= high),
                self.keys.partition_point(|&k| k >= low),
            ),
        };
        start as u64..end.max(start) as u64
    }
}

/// The groups of a reduction over some dimensions of a selection.
#[derive(Debug, Clone)]
pub struct GroupSpace {
    /// Per table dimension: its stride in the group numbering when grouped.
    strides: Vec<Option<usize>>,
    /// Per table dimension: the selected ranges and the compact position of
    /// each range's first index (empty when not grouped).
    ranges: Vec<Vec<(Range<u64>, usize)>>,
    /// Per table dimension: the keys of its selected positions, when it is
    /// grouped by functions of its coordinate.
    maps: Vec<Option<KeyMap>>,
    /// Per table dimension: number of keys (grouped ones).
    counts: Vec<usize>,
    num_groups: usize,
}

impl GroupSpace {
    /// The groups of `selection` over the table dimensions `grouped`, the
    /// dimensions of `mapped` (grouped ones) by their keys.
    pub fn new(selection: &Selection, grouped: &[usize], mapped: Vec<(usize, KeyMap)>) -> Self {
        let rank = selection.rank();
        let mut ranges = vec![Vec::new(); rank];
        let mut counts = vec![1usize; rank];
        let mut maps = vec![None; rank];
        for &d in grouped {
            let mut position = 0usize;
            for r in selection.ranges(d) {
                ranges[d].push((r.clone(), position));
                position += (r.end - r.start) as usize;
            }
            counts[d] = position;
        }
        for (d, map) in mapped {
            if grouped.contains(&d) {
                counts[d] = map.count;
                maps[d] = Some(map);
            }
        }
        let mut strides = vec![None; rank];
        let mut stride = 1usize;
        for d in (0..rank).rev() {
            if grouped.contains(&d) {
                strides[d] = Some(stride);
                stride = stride.saturating_mul(counts[d]);
            }
        }
        Self {
            strides,
            ranges,
            maps,
            counts,
            num_groups: stride,
        }
    }

    /// Number of groups.
    pub fn num_groups(&self) -> usize {
        self.num_groups
    }

    /// The number of keys of grouped dimension `d`.
    pub fn keys_of(&self, d: usize) -> usize {
        self.counts[d]
    }

    /// Which way the keys of grouped dimension `d` run along its selected
    /// positions (see [`KeyMap::direction`]; a dimension grouped by its
    /// positions runs forward).
    pub fn key_direction(&self, d: usize) -> Option<bool> {
        match &self.maps[d] {
            Some(map) => map.direction(),
            None => Some(false),
        }
    }

    /// The selected positions (numbered in selection order) of the keys
    /// `keys` of grouped dimension `d`, whose keys run `descending` (see
    /// [`Self::key_direction`]).
    pub fn positions_of_keys(&self, d: usize, keys: Range<usize>, descending: bool) -> Range<u64> {
        match &self.maps[d] {
            Some(map) => map.positions_of(keys, descending),
            None => keys.start as u64..keys.end as u64,
        }
    }

    /// The compact position of index `i` of grouped dimension `d`.
    fn position(&self, d: usize, i: u64) -> usize {
        let ranges = &self.ranges[d];
        let k = ranges.partition_point(|(r, _)| r.end <= i);
        let (r, first) = &ranges[k.min(ranges.len() - 1)];
        first + (i - r.start) as usize
    }

    /// The key of compact position `p` of grouped dimension `d`.
    fn key(&self, d: usize, p: usize) -> usize {
        match &self.maps[d] {
            Some(map) => map.keys[p] as usize,
            None => p,
        }
    }

    /// For grouped dimension `d`: the coordinate index of every group, in
    /// group order (a dimension grouped by its coordinate).
    pub fn coordinate_indices(&self, d: usize) -> Vec<u64> {
        let by_position = self.selected_indices(d);
        self.per_group(d, |k| by_position[k])
    }

    /// For grouped dimension `d`: the coordinate index of each selected
    /// position, in order (a dimension grouped by its coordinate: of each
    /// key).
    pub fn selected_indices(&self, d: usize) -> Vec<u64> {
        self.ranges[d].iter().flat_map(|(r, _)| r.clone()).collect()
    }

    /// For grouped dimension `d`: the key of every group, in group order
    /// (for a dimension grouped by its coordinate, the compact position).
    pub fn key_indices(&self, d: usize) -> Vec<u64> {
        self.per_group(d, |k| k as u64)
    }

    /// For grouped dimension `d`: `value` of each group's key, in group
    /// order (each key's value repeated over the groups of the dimensions
    /// after it, the keys over and over for those before).
    fn per_group(&self, d: usize, value: impl Fn(usize) -> u64) -> Vec<u64> {
        let Some(stride) = self.strides[d] else {
            return Vec::new();
        };
        let count = self.counts[d];
        let mut out = Vec::with_capacity(self.num_groups);
        let values: Vec<u64> = (0..count).map(value).collect();
        let cycles = self.num_groups / stride.saturating_mul(count).max(1);
        for _ in 0..cycles {
            for &v in &values {
                out.extend(std::iter::repeat_n(v, stride));
            }
        }
        out
    }

    /// Cuts the rows of a box of `shape` into tiles of at most `max_rows`
    /// rows, each a list of row ranges (C order) to fold one after the
    /// other. Boxes whose groups' state (`state_per_group` bytes each)
    /// fits in `TILE_STATE_BYTES`, or whose outer dimensions are kept, are
    /// cut into consecutive runs; the others into tiles of `MIN_TILE_RUN`
    /// or more inner positions over as many outer steps as fit in `max_rows`,
    /// inner ranges outermost, so consecutive tiles reuse the same state.
    pub fn tiles(&self, shape: &[u64], max_rows: u64, state_per_group: usize) -> Vec<Tile> {
        let max_rows = max_rows.max(1);
        let total: u64 = shape.iter().product();
        // Leading dimensions reduced away, and the rest.
        let p = self.strides.iter().take_while(|s| s.is_none()).count();
        let outer: u64 = shape[..p].iter().product();
        let inner: u64 = shape[p..].iter().product();
        let groups_in_box: u64 = (0..shape.len())
            .filter(|&d| self.strides[d].is_some())
            .map(|d| shape[d])
            .product();
        let state = groups_in_box.saturating_mul(state_per_group as u64);
        if outer <= 1 || p == shape.len() || state <= TILE_STATE_BYTES || total <= max_rows {
            return (0..total)
                .step_by(max_rows as usize)
                .map(|start| std::iter::once(start..(start + max_rows).min(total)).collect())
                .collect();
        }
        let width = (max_rows / outer).max(MIN_TILE_RUN).min(inner);
        let steps = (max_rows / width).clamp(1, outer);
        let mut tiles = Vec::new();
        for a in (0..inner).step_by(width as usize) {
            let b = (a + width).min(inner);
            for o in (0..outer).step_by(steps as usize) {
                tiles.push(
                    (o..(o + steps).min(outer))
                        .map(|o| o * inner + a..o * inner + b)
                        .collect(),
                );
            }
        }
        tiles
    }

    /// Appends to `out` the lines of rows `start..start + len` of a box
    /// with extent `extent` (every index of which is selected).
    pub fn lines(&self, extent: &[Range<u64>], start: u64, len: u64, out: &mut Vec<Line>) {
        let rank = extent.len();
        if rank == 0 || len == 0 {
            return;
        }
        let shape: Vec<u64> = extent.iter().map(|r| r.end - r.start).collect();
        let first: Vec<usize> = (0..rank)
            .map(|d| match self.strides[d] {
                Some(_) => self.position(d, extent[d].start),
                None => 0,
            })
            .collect();
        // Multi-index of the first row within the box.
        let mut index = vec![0u64; rank];
        let mut rest = start;
        for d in (0..rank).rev() {
            index[d] = rest % shape[d];
            rest /= shape[d];
        }
        let last = rank - 1;
        let last_map = self.maps[last]
            .as_ref()
            .filter(|_| self.strides[last].is_some());
        let spread = self.strides[last].is_some() && last_map.is_none();
        let mut row = 0u64;
        while row < len {
            let n = (shape[last] - index[last]).min(len - row);
            let outer: usize = (0..last)
                .filter_map(|d| Some(self.strides[d]? * self.key(d, first[d] + index[d] as usize)))
                .sum();
            let p = first[last] + index[last] as usize;
            match (last_map, self.strides[last]) {
                // Runs of positions sharing a key each fold into one group.
                (Some(map), Some(stride)) => {
                    let keys = &map.keys[p..p + n as usize];
                    let mut i = 0;
                    while i < keys.len() {
                        let key = keys[i];
                        let run = keys[i..].iter().take_while(|&&k| k == key).count();
                        push_line(
                            out,
                            Line {
                                offset: (row as usize) + i,
                                len: run,
                                group: outer + stride * key as usize,
                                spread: false,
                            },
                        );
                        i += run;
                    }
                }
                (_, stride) => push_line(
                    out,
                    Line {
                        offset: row as usize,
                        len: n as usize,
                        group: outer + stride.map_or(0, |s| s * p),
                        spread,
                    },
                ),
            }
            row += n;
            index[last] += n;
            let mut d = last;
            while d > 0 && index[d] == shape[d] {
                index[d] = 0;
                d -= 1;
                index[d] += 1;
            }
        }
    }
}

/// Appends `line` to `out`, merged into the last line when it continues it.
fn push_line(out: &mut Vec<Line>, line: Line) {
    match out.last_mut() {
        Some(prev)
            if prev.offset + prev.len == line.offset
                && prev.spread == line.spread
                && (if line.spread {
                    prev.group + prev.len == line.group
                } else {
                    prev.group == line.group
                }) =>
        {
            prev.len += line.len;
        }
        _ => out.push(line),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The group of every row of `extent` in C order, computed naively.
    fn naive_groups(
        space_dims: &[usize],
        selection: &Selection,
        extent: &[Range<u64>],
    ) -> Vec<usize> {
        naive_mapped_groups(space_dims, selection, extent, &[])
    }

    /// The same, with the dimensions of `mapped` grouped by their keys.
    fn naive_mapped_groups(
        space_dims: &[usize],
        selection: &Selection,
        extent: &[Range<u64>],
        mapped: &[(usize, KeyMap)],
    ) -> Vec<usize> {
        let selected: Vec<Vec<u64>> = (0..selection.rank())
            .map(|d| selection.ranges(d).iter().flat_map(|r| r.clone()).collect())
            .collect();
        let mut rows = vec![Vec::<u64>::new()];
        for r in extent {
            rows = rows
                .into_iter()
                .flat_map(|prefix| {
                    r.clone().map(move |i| {
                        let mut p = prefix.clone();
                        p.push(i);
                        p
                    })
                })
                .collect();
        }
        rows.iter()
            .map(|idx| {
                space_dims.iter().fold(0usize, |g, &d| {
                    let pos = selected[d].iter().position(|&x| x == idx[d]).unwrap();
                    match mapped.iter().find(|(m, _)| *m == d) {
                        Some((_, map)) => g * map.count + map.keys[pos] as usize,
                        None => g * selected[d].len() + pos,
                    }
                })
            })
            .collect()
    }

    fn expand(lines: &[Line]) -> Vec<usize> {
        let mut out = Vec::new();
        for l in lines {
            assert_eq!(l.offset, out.len());
            for i in 0..l.len {
                out.push(if l.spread { l.group + i } else { l.group });
            }
        }
        out
    }

    /// Asserts that the lines of runs of rows of `extent` (the whole, from
    /// the second row, two inside, the last) give the groups `want`.
    fn assert_lines_follow(space: &GroupSpace, extent: &[Range<u64>], want: &[usize], what: &str) {
        let n = want.len() as u64;
        for (start, len) in [(0, n), (1, n - 3), (3, 2), (n - 1, 1)] {
            let mut lines = Vec::new();
            space.lines(extent, start, len, &mut lines);
            assert_eq!(
                expand(&lines),
                want[start as usize..(start + len) as usize],
                "{what} extent {extent:?} rows {start}+{len}"
            );
        }
    }

    #[test]
    fn lines_match_a_row_by_row_mapping() {
        let shape = [5u64, 4, 6];
        let mut selection = Selection::all(&shape);
        selection.restrict_ranges(1, vec![0..1, 2..4]);
        selection.restrict_ranges(2, vec![1..3, 4..6]);
        let extents = [vec![1..3, 2..4, 4..6], vec![0..5, 0..1, 1..3]];
        for grouped in [
            vec![],
            vec![0],
            vec![1],
            vec![2],
            vec![0, 2],
            vec![1, 2],
            vec![0, 1, 2],
        ] {
            let space = GroupSpace::new(&selection, &grouped, Vec::new());
            for extent in &extents {
                let want = naive_groups(&grouped, &selection, extent);
                assert_lines_follow(&space, extent, &want, &format!("grouped {grouped:?}"));
            }
        }
    }

    #[test]
    fn tiles_cover_every_row_once_and_their_lines_follow_the_rows() {
        let shape = [6u64, 1, 40, 50];
        let extent: Vec<Range<u64>> = shape.iter().map(|&n| 0..n).collect();
        let selection = Selection::all(&shape);
        for (grouped, state, max_rows, tiled) in [
            // Reduced outer dimension, kept inner ones, large state: tiled.
            (vec![2, 3], TILE_STATE_BYTES as usize, 3000, true),
            (vec![1, 2, 3], TILE_STATE_BYTES as usize, 1 << 20, false),
            // Small state, or the outer dimension kept: consecutive runs.
            (vec![2, 3], 8, 3000, false),
            (vec![0, 2], TILE_STATE_BYTES as usize, 3000, false),
            (vec![], TILE_STATE_BYTES as usize, 3000, false),
        ] {
            let space = GroupSpace::new(&selection, &grouped, Vec::new());
            let want = naive_groups(&grouped, &selection, &extent);
            let tiles = space.tiles(&shape, max_rows, state);
            let mut seen = vec![0u8; want.len()];
            for tile in &tiles {
                let rows: u64 = tile.iter().map(|r| r.end - r.start).sum();
                assert!(rows <= max_rows.max(MIN_TILE_RUN), "{tile:?}");
                for run in tile {
                    let mut lines = Vec::new();
                    space.lines(&extent, run.start, run.end - run.start, &mut lines);
                    let rows = run.start as usize..run.end as usize;
                    assert_eq!(expand(&lines), want[rows.clone()], "grouped {grouped:?}");
                    rows.for_each(|row| seen[row] += 1);
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "grouped {grouped:?}");
            let runs_per_tile = tiles.iter().map(Vec::len).max().unwrap();
            assert_eq!(runs_per_tile > 1, tiled, "grouped {grouped:?}: {tiles:?}");
        }
    }

    #[test]
    fn lines_merge_across_rows_and_planes() {
        let selection = Selection::all(&[10, 3, 4]);
        let mut lines = Vec::new();
        GroupSpace::new(&selection, &[], Vec::new()).lines(
            &[0..10, 0..3, 0..4],
            0,
            120,
            &mut lines,
        );
        assert_eq!(lines.len(), 1);
        lines.clear();
        // Grouping by (lat, lon): one spread line per time step.
        GroupSpace::new(&selection, &[1, 2], Vec::new()).lines(
            &[0..10, 0..3, 0..4],
            0,
            120,
            &mut lines,
        );
        assert_eq!(lines.len(), 10);
        assert!(lines
            .iter()
            .all(|l| l.len == 12 && l.group == 0 && l.spread));
    }

    #[test]
    fn coordinate_indices_follow_group_order() {
        let mut selection = Selection::all(&[3, 5]);
        selection.restrict_ranges(1, vec![1..2, 3..5]);
        let space = GroupSpace::new(&selection, &[0, 1], Vec::new());
        assert_eq!(space.num_groups(), 9);
        assert_eq!(space.coordinate_indices(0), vec![0, 0, 0, 1, 1, 1, 2, 2, 2]);
        assert_eq!(space.coordinate_indices(1), vec![1, 3, 4, 1, 3, 4, 1, 3, 4]);
    }

    #[test]
    fn lines_of_keyed_dimensions_match_a_row_by_row_mapping() {
        let shape = [5u64, 4, 6];
        let mut selection = Selection::all(&shape);
        selection.restrict_ranges(0, vec![0..2, 3..5]);
        selection.restrict_ranges(2, std::iter::once(0..5).collect());
        // Keys of the selected positions: 4 of dimension 0 and 5 of 2.
        let outer = KeyMap {
            keys: vec![0, 0, 1, 2],
            count: 3,
        };
        let inner = KeyMap {
            keys: vec![1, 1, 0, 0, 1],
            count: 2,
        };
        let extents = [vec![0..2, 0..4, 0..5], vec![3..5, 1..3, 1..4]];
        for (grouped, mapped) in [
            (vec![0], vec![(0, outer.clone())]),
            (vec![2], vec![(2, inner.clone())]),
            (vec![0, 2], vec![(0, outer.clone()), (2, inner.clone())]),
            (vec![0, 1, 2], vec![(2, inner.clone())]),
            (vec![1, 2], vec![(2, inner.clone())]),
        ] {
            let space = GroupSpace::new(&selection, &grouped, mapped.clone());
            let counts: usize = grouped
                .iter()
                .map(|&d| match mapped.iter().find(|(m, _)| *m == d) {
                    Some((_, map)) => map.count,
                    None => selection
                        .ranges(d)
                        .iter()
                        .map(|r| r.end - r.start)
                        .sum::<u64>() as usize,
                })
                .product();
            assert_eq!(space.num_groups(), counts);
            for extent in &extents {
                let want = naive_mapped_groups(&grouped, &selection, extent, &mapped);
                assert_lines_follow(&space, extent, &want, &format!("grouped {grouped:?}"));
            }
        }
    }

    #[test]
    fn key_indices_follow_group_order() {
        let selection = Selection::all(&[4, 3]);
        let map = KeyMap {
            keys: vec![0, 0, 1, 1],
            count: 2,
        };
        let space = GroupSpace::new(&selection, &[0, 1], vec![(0, map)]);
        assert_eq!(space.num_groups(), 6);
        assert_eq!(space.key_indices(0), vec![0, 0, 0, 1, 1, 1]);
        assert_eq!(space.coordinate_indices(1), vec![0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn key_indices_of_three_dimensions_follow_the_numbering() {
        let selection = Selection::all(&[3, 4, 5]);
        let map = KeyMap {
            keys: vec![0, 1, 1, 0],
            count: 2,
        };
        let space = GroupSpace::new(&selection, &[0, 1, 2], vec![(1, map)]);
        let (n0, n1, n2) = (3, 2, 5);
        assert_eq!(space.num_groups(), n0 * n1 * n2);
        for (d, div, n) in [(0, n1 * n2, n0), (1, n2, n1), (2, 1, n2)] {
            let naive: Vec<u64> = (0..n0 * n1 * n2).map(|g| ((g / div) % n) as u64).collect();
            assert_eq!(space.key_indices(d), naive, "dimension {d}");
        }
    }

    #[test]
    fn keys_running_along_the_positions_give_the_positions_of_a_range_of_keys() {
        let forward = KeyMap {
            keys: vec![0, 0, 0, 1, 2, 2, 3],
            count: 4,
        };
        let backward = KeyMap {
            keys: forward.keys.iter().rev().copied().collect(),
            count: 4,
        };
        let neither = KeyMap {
            keys: vec![0, 1, 0],
            count: 2,
        };
        assert_eq!(forward.direction(), Some(false));
        assert_eq!(backward.direction(), Some(true));
        assert_eq!(neither.direction(), None);
        for (map, descending) in [(&forward, false), (&backward, true)] {
            for start in 0..=4 {
                for end in start..=4 {
                    let got = map.positions_of(start..end, descending);
                    let naive: Vec<u64> = (0..map.keys.len() as u64)
                        .filter(|&p| (start..end).contains(&(map.keys[p as usize] as usize)))
                        .collect();
                    let got: Vec<u64> = got.collect();
                    assert_eq!(got, naive, "keys {start}..{end}, descending {descending}");
                }
            }
        }
    }
}

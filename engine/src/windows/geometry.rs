//! Where windows are: window shapes, the grid of window origins, and the
//! chunk-aligned blocks that group them.
//!
//! A window spans `size` cells along each *window dimension* (xbatcher's
//! `input_dims`) and one cell along every other dimension, which is squeezed
//! from the batch. Origins step by `size - overlap` along window dimensions
//! and visit every selected index along the others. Each origin belongs to
//! the block that holds its first cell; reading a block means reading its
//! extent plus a halo of `size - 1` cells along window dimensions.

use std::ops::Range;

use super::WindowError;
use crate::table::{BlockGrid, GridTable, Selection};

/// Which windows are kept, by their share of non-missing values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Validity {
    /// Only windows without a missing value in any variable.
    All,
    /// Every window, missing values included.
    Any,
    /// Windows whose share of non-missing values (over all variables) is at least this.
    AtLeast(f64),
}

impl Validity {
    /// Parses `"all"`, `"any"` or a fraction in `[0, 1]`.
    pub fn parse(text: &str) -> Result<Self, WindowError> {
        match text.trim().to_ascii_lowercase().as_str() {
            "all" => Ok(Self::All),
            "any" => Ok(Self::Any),
            other => match other.parse::<f64>() {
                Ok(f) => Self::fraction(f),
                Err(_) => Err(WindowError::argument(
                    "valid",
                    format!("'{text}' is not 'all', 'any' or a fraction between 0 and 1"),
                )),
            },
        }
    }

    /// A minimum share of non-missing values, in `[0, 1]`.
    pub fn fraction(f: f64) -> Result<Self, WindowError> {
        if !(0.0..=1.0).contains(&f) {
            return Err(WindowError::argument(
                "valid",
                format!("fraction {f} is not between 0 and 1"),
            ));
        }
        Ok(if f == 1.0 {
            Self::All
        } else if f == 0.0 {
            Self::Any
        } else {
            Self::AtLeast(f)
        })
    }

    /// Whether a window with `missing` missing values out of `total` is kept.
    pub fn keeps(self, missing: u64, total: u64) -> bool {
        match self {
            Self::All => missing == 0,
            Self::Any => true,
            Self::AtLeast(f) => (total - missing) as f64 >= f * total as f64,
        }
    }

    /// The most missing values a kept window may hold, out of `total`.
    pub fn max_missing(self, total: u64) -> u64 {
        match self {
            Self::All => 0,
            Self::Any => total,
            Self::AtLeast(f) => {
                // Start from the real-valued bound and settle on the exact
                // integer `keeps` agrees with (rounding may be off by one).
                let mut m = ((1.0 - f) * total as f64).floor().clamp(0.0, total as f64) as u64;
                while m > 0 && !self.keeps(m, total) {
                    m -= 1;
                }
                while m < total && self.keeps(m + 1, total) {
                    m += 1;
                }
                m
            }
        }
    }
}

/// One dimension of the window grid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Axis {
    /// The dimension's name.
    pub name: String,
    /// Whether windows extend along it (a window dimension).
    pub window: bool,
    /// Cells a window spans along it (1 for other dimensions).
    pub size: u64,
    /// Step between consecutive origins (window dimensions).
    pub stride: u64,
    /// Selected index ranges, sorted and disjoint (one range for window dimensions).
    ranges: Vec<Range<u64>>,
    /// Number of origins before each range.
    before: Vec<u64>,
    /// Number of origins along this dimension.
    pub count: u64,
    /// Largest random offset of a window along it (window dimensions).
    pub jitter: u64,
}

impl Axis {
    fn window(name: &str, range: Range<u64>, size: u64, stride: u64, jitter: u64) -> Self {
        let len = range.end - range.start;
        let count = if len >= size {
            (len - size) / stride + 1
        } else {
            0
        };
        Self {
            name: name.to_string(),
            window: true,
            size,
            stride,
            ranges: vec![range],
            before: vec![0],
            count,
            jitter,
        }
    }

    fn other(name: &str, ranges: Vec<Range<u64>>) -> Self {
        let mut before = Vec::with_capacity(ranges.len());
        let mut count = 0;
        for r in &ranges {
            before.push(count);
            count += r.end - r.start;
        }
        Self {
            name: name.to_string(),
            window: false,
            size: 1,
            stride: 1,
            ranges,
            before,
            count,
            jitter: 0,
        }
    }

    /// The array index of origin `k`.
    pub fn index(&self, k: u64) -> u64 {
        if self.window {
            return self.ranges[0].start + k * self.stride;
        }
        let r = self.before.partition_point(|&b| b <= k) - 1;
        self.ranges[r].start + (k - self.before[r])
    }

    /// Number of origins whose array index is below `index`.
    fn origins_below(&self, index: u64) -> u64 {
        if self.window {
            let start = self.ranges[0].start;
            return if index <= start {
                0
            } else {
                (index - start).div_ceil(self.stride).min(self.count)
            };
        }
        self.ranges
            .iter()
            .zip(&self.before)
            .map(|(r, b)| {
                if index <= r.start {
                    0
                } else {
                    b + (index.min(r.end) - r.start)
                }
            })
            .max()
            .unwrap_or(0)
            .min(self.count)
    }

    /// The selected cells along a window dimension.
    pub fn range(&self) -> Range<u64> {
        self.ranges.first().cloned().unwrap_or(0..0)
    }

    /// `cells` widened by the largest jitter either side, within the selection.
    fn reach(&self, cells: Range<u64>) -> Range<u64> {
        if self.jitter == 0 {
            return cells;
        }
        let within = self.range();
        cells.start.saturating_sub(self.jitter).max(within.start)
            ..cells
                .end
                .saturating_add(self.jitter)
                .min(within.end)
                .max(cells.end)
    }

    /// The origins whose index lies in `extent`.
    pub fn origins_in(&self, extent: &Range<u64>) -> Range<u64> {
        self.origins_below(extent.start)..self.origins_below(extent.end)
    }
}

/// A chunk-aligned group of window origins: a box in origin space.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowBlock {
    /// Origins per dimension (a box in origin space).
    pub origins: Vec<Range<u64>>,
    /// The array cells its windows cover: the origins' cells plus the halo.
    pub extent: Vec<Range<u64>>,
}

impl WindowBlock {
    /// Number of origins in the block.
    pub fn num_origins(&self) -> u64 {
        self.origins.iter().map(|r| r.end - r.start).product()
    }

    /// Number of cells read for the block.
    pub fn num_cells(&self) -> u64 {
        self.extent.iter().map(|r| r.end - r.start).product()
    }

    /// The origin (per dimension) of the `local`-th origin, in C order.
    pub fn origin(&self, local: u64) -> Vec<u64> {
        let mut rest = local;
        let mut out = vec![0; self.origins.len()];
        for d in (0..self.origins.len()).rev() {
            let len = self.origins[d].end - self.origins[d].start;
            out[d] = self.origins[d].start + rest % len;
            rest /= len;
        }
        out
    }
}

/// The window origins of a grid table over a selection.
#[derive(Debug, Clone)]
pub struct WindowGrid {
    /// One axis per table dimension, in the table's order.
    pub axes: Vec<Axis>,
    /// Blocks holding at least one origin, in C order of the block grid.
    pub blocks: Vec<WindowBlock>,
}

/// The shape of the windows: `(dimension, size, overlap)` triples.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowShape {
    /// `(dimension, size)` pairs: xbatcher's `input_dims`.
    pub sizes: Vec<(String, u64)>,
    /// `(dimension, overlap)` pairs: xbatcher's `input_overlap`; stride is size - overlap.
    pub overlaps: Vec<(String, u64)>,
}

impl WindowShape {
    /// Checks that the shape names some of `dims` (a table's dimensions),
    /// each once, in `input_dims` and in `input_overlap`.
    pub fn check_names(&self, dims: &[&str]) -> Result<(), WindowError> {
        let known = || dims.join(", ");
        if self.sizes.is_empty() {
            return Err(WindowError::argument(
                "input_dims",
                format!("names no dimension (dimensions: {})", known()),
            ));
        }
        for (arg, list) in [
            ("input_dims", &self.sizes),
            ("input_overlap", &self.overlaps),
        ] {
            for (i, (dim, _)) in list.iter().enumerate() {
                if !dims.contains(&dim.as_str()) {
                    return Err(WindowError::argument(
                        arg,
                        format!("unknown dimension '{dim}' (dimensions: {})", known()),
                    ));
                }
                if list[..i].iter().any(|(d, _)| d == dim) {
                    return Err(WindowError::argument(
                        arg,
                        format!("'{dim}' is given twice"),
                    ));
                }
            }
        }
        Ok(())
    }
}

impl WindowGrid {
    /// Plans the origins of windows of `shape` over `selection` of `table`,
    /// grouped in blocks of about `block_bytes` decoded bytes (`bytes_per_cell`
    /// for the variables read). `jitter` (per dimension; empty: none) widens
    /// each block's extent by the windows' largest random offsets, within
    /// the selection.
    pub fn new(
        table: &GridTable,
        selection: &Selection,
        shape: &WindowShape,
        jitter: &[u64],
        bytes_per_cell: u64,
        block_bytes: u64,
    ) -> Result<Self, WindowError> {
        let names: Vec<&str> = table.dims.iter().map(|d| d.name.as_str()).collect();
        shape.check_names(&names)?;
        let mut axes = Vec::with_capacity(names.len());
        for (d, name) in names.iter().enumerate() {
            let size = shape.sizes.iter().find(|(n, _)| n == name).map(|(_, s)| *s);
            let overlap = shape
                .overlaps
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, o)| *o);
            let ranges = selection.ranges(d).to_vec();
            let Some(size) = size else {
                if overlap.is_some() {
                    return Err(WindowError::argument(
                        "input_overlap",
                        format!("'{name}' is not a window dimension (not in input_dims)"),
                    ));
                }
                axes.push(Axis::other(name, ranges));
                continue;
            };
            let overlap = overlap.unwrap_or(0);
            if size == 0 {
                return Err(WindowError::argument(
                    "input_dims",
                    format!("window size along '{name}' must be at least 1"),
                ));
            }
            if overlap >= size {
                return Err(WindowError::argument(
                    "input_overlap",
                    format!("overlap {overlap} along '{name}' must be smaller than the window size {size}"),
                ));
            }
            let len = table.dims[d].len;
            if size > len {
                return Err(WindowError::argument(
                    "input_dims",
                    format!(
                        "window size {size} along '{name}' is larger than the array ({len} cells)"
                    ),
                ));
            }
            let range = match ranges.as_slice() {
                [] => 0..0,
                [one] => one.clone(),
                _ => {
                    return Err(WindowError::argument(
                        "where",
                        format!("selects separate ranges along window dimension '{name}'; windows need one contiguous range"),
                    ))
                }
            };
            if range.end - range.start < size && range.end > range.start {
                return Err(WindowError::argument(
                    "input_dims",
                    format!(
                        "window size {size} along '{name}' is larger than the {} selected cells",
                        range.end - range.start
                    ),
                ));
            }
            let jitter = jitter.get(d).copied().unwrap_or(0);
            axes.push(Axis::window(name, range, size, size - overlap, jitter));
        }
        let grid = BlockGrid::plan(
            &table.shape(),
            &table.chunk_shape(),
            selection,
            bytes_per_cell,
            block_bytes,
            1,
        );
        let blocks = (0..grid.num_blocks())
            .filter_map(|id| block_of(&axes, &grid.block(id), &table.shape()))
            .collect();
        Ok(Self { axes, blocks })
    }

    /// Cells per window (the product of window sizes).
    pub fn window_cells(&self) -> u64 {
        self.axes.iter().map(|a| a.size).product()
    }

    /// The cells the window at `origin` may read with its jitter: its
    /// extent widened by the largest offset along each dimension, within
    /// the selection.
    pub fn window_reach(&self, origin: &[u64]) -> Vec<Range<u64>> {
        self.window_extent(origin)
            .into_iter()
            .zip(&self.axes)
            .map(|(r, a)| a.reach(r))
            .collect()
    }

    /// Window sizes along the window dimensions, in table order.
    pub fn window_sizes(&self) -> Vec<u64> {
        self.axes
            .iter()
            .filter(|a| a.window)
            .map(|a| a.size)
            .collect()
    }

    /// The array extent of the window at `origin` (per-dimension origin numbers).
    pub fn window_extent(&self, origin: &[u64]) -> Vec<Range<u64>> {
        self.axes
            .iter()
            .zip(origin)
            .map(|(a, &k)| {
                let start = a.index(k);
                start..start + a.size
            })
            .collect()
    }
}

/// The origins of one block of the block grid, or `None` when it holds none.
fn block_of(axes: &[Axis], block: &[Range<u64>], shape: &[u64]) -> Option<WindowBlock> {
    let origins: Vec<Range<u64>> = axes
        .iter()
        .zip(block)
        .map(|(a, r)| a.origins_in(r))
        .collect();
    if origins.iter().any(|r| r.is_empty()) {
        return None;
    }
    let extent = axes
        .iter()
        .zip(&origins)
        .zip(shape)
        .map(|((a, r), &len)| a.reach(a.index(r.start)..(a.index(r.end - 1) + a.size).min(len)))
        .collect();
    Some(WindowBlock { origins, extent })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_axis_counts_origins() {
        let a = Axis::window("x", 2..12, 4, 3, 0);
        // origins at 2, 5, 8 (8 + 4 = 12 fits), not 11.
        assert_eq!(a.count, 3);
        assert_eq!(
            (0..3).map(|k| a.index(k)).collect::<Vec<_>>(),
            vec![2, 5, 8]
        );
        assert_eq!(a.origins_in(&(0..5)), 0..1);
        assert_eq!(a.origins_in(&(5..9)), 1..3);
        assert_eq!(a.origins_in(&(9..20)), 3..3);
    }

    #[test]
    fn other_axis_maps_ranges() {
        let a = Axis::other("t", vec![1..3, 6..8]);
        assert_eq!(a.count, 4);
        assert_eq!(
            (0..4).map(|k| a.index(k)).collect::<Vec<_>>(),
            vec![1, 2, 6, 7]
        );
        assert_eq!(a.origins_in(&(0..4)), 0..2);
        assert_eq!(a.origins_in(&(4..7)), 2..3);
        assert_eq!(a.origins_in(&(7..100)), 3..4);
    }

    #[test]
    fn validity_parses_and_decides() {
        assert_eq!(Validity::parse("ALL").unwrap(), Validity::All);
        assert_eq!(Validity::parse("any").unwrap(), Validity::Any);
        assert_eq!(Validity::parse("0.5").unwrap(), Validity::AtLeast(0.5));
        assert!(Validity::parse("1.5").is_err());
        assert!(Validity::parse("most").is_err());
        assert!(Validity::AtLeast(0.5).keeps(5, 10));
        assert!(!Validity::AtLeast(0.5).keeps(6, 10));
        assert!(!Validity::All.keeps(1, 10));
        for total in [1u64, 7, 75, 6912] {
            for v in [
                Validity::All,
                Validity::Any,
                Validity::AtLeast(0.5),
                Validity::AtLeast(0.9),
                Validity::AtLeast(1.0 / 3.0),
            ] {
                let m = v.max_missing(total);
                assert!(v.keeps(m, total), "{v:?} {total}");
                assert!(m == total || !v.keeps(m + 1, total), "{v:?} {total}");
            }
        }
    }
}

//! Several sources joined on their coordinates: different stores,
//! dimension sets, chunkings and time steps, cut into one sample.
//!
//! The first source is the *reference*: its grid of window origins makes
//! the samples, its blocks are the blocks every source is read in. Each
//! other source's dimensions are [`Link`]ed to the reference's:
//!
//! - a window dimension (`lat`, `lon`) must hold the same coordinate
//!   values over the reference's selection (the same grid, possibly a
//!   larger one around it): its index is the reference's, shifted;
//! - the lead dimension (`time`) is matched by value, step by step, so a
//!   source every 30 minutes joins one every hour; a reference step the
//!   source lacks is an error naming both;
//! - any other dimension (`level`) is the source's own: each selected index
//!   becomes channels;
//! - a reference dimension the source lacks (a static field without
//!   `time`) is broadcast.
//!
//! Sources on different grids are errors with the numbers: regridding is
//! not the loader's business.

use std::ops::Range;
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, AsArray};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Float64Type, Int64Type, TimeUnit};

use super::geometry::WindowGrid;
use super::values::count_missing;
use super::WindowError;
use crate::table::{GridTable, Selection};
use crate::zarr::{ChunkBufferPool, IoTotals, RemoteStorage};

/// Some variables of one dimension set of a store, under a name.
#[derive(Debug, Clone)]
pub struct Source {
    /// The name the user gave the store.
    pub name: String,
    /// The variables' table.
    pub table: Arc<GridTable>,
    /// The variables, as indices into `table.variables`.
    pub variables: Vec<usize>,
    /// The cells selected (`where`'s conditions on this table's dimensions).
    pub selection: Selection,
}

impl Source {
    /// The source `name` of the named `variables` of `table` (all when
    /// empty) over `selection`; unknown variables and types windows do not
    /// support are errors naming them.
    pub fn new(
        name: &str,
        table: Arc<GridTable>,
        variables: &[String],
        selection: Selection,
    ) -> Result<Self, WindowError> {
        let names: Vec<&str> = table.variables.iter().map(|v| v.name()).collect();
        let variables: Vec<usize> = if variables.is_empty() {
            (0..names.len()).collect()
        } else {
            variables
                .iter()
                .map(|v| {
                    names.iter().position(|n| n == v).ok_or_else(|| {
                        WindowError::argument(
                            "variables",
                            format!(
                                "unknown variable '{v}' of '{name}' (variables: {})",
                                names.join(", ")
                            ),
                        )
                    })
                })
                .collect::<Result<_, _>>()?
        };
        if variables.is_empty() {
            return Err(WindowError::argument(
                "variables",
                format!("'{name}' has no variables"),
            ));
        }
        for &v in &variables {
            let var = &table.variables[v];
            if !super::values::is_supported(var.data_type()) {
                return Err(WindowError::argument(
                    "variables",
                    format!(
                        "variable '{}' has type {}; windows need integers or float32/float64",
                        var.name(),
                        var.data_type()
                    ),
                ));
            }
        }
        Ok(Self {
            name: name.to_string(),
            table,
            variables,
            selection,
        })
    }
}

impl Source {
    /// The schema columns of its variables (after the dimension columns).
    pub fn columns(&self) -> Vec<usize> {
        let dims = self.table.dims.len();
        self.variables.iter().map(|&v| dims + v).collect()
    }

    /// `(dimension name, coordinate)` of each `(dimension, index)` of
    /// `fixed`, the coordinate as a number (its index when it is not one).
    pub fn coordinates(&self, fixed: &[(usize, u64)]) -> Vec<(String, f64)> {
        fixed
            .iter()
            .map(|&(d, k)| {
                let dim = &self.table.dims[d];
                (
                    dim.name.clone(),
                    dim.coordinate.number(k).unwrap_or(k as f64),
                )
            })
            .collect()
    }
}

/// Where one dimension of a source finds its index, given the reference's.
#[derive(Debug, Clone, PartialEq)]
pub enum Link {
    /// The reference's dimension `dim`, shifted by `offset` cells.
    Shift {
        /// The reference's dimension number.
        dim: usize,
        /// Added to the reference's index.
        offset: i64,
    },
    /// The reference's dimension `dim`, matched by coordinate value:
    /// reference index `i` is this source's `index[i - start]`.
    Lookup {
        /// The reference's dimension number.
        dim: usize,
        /// The first reference index mapped.
        start: u64,
        /// This source's index of each mapped reference index.
        index: Vec<u64>,
    },
    /// This source's own dimension: each of `indices` gives channels.
    Channel {
        /// The selected indices.
        indices: Vec<u64>,
    },
}

/// The sources of some windows, joined on the reference's coordinates.
#[derive(Debug)]
pub struct Sources {
    /// The reference first.
    pub list: Vec<Source>,
    /// Per source, per dimension: its link to the reference.
    pub links: Vec<Vec<Link>>,
    /// Per variable of the windows (sources in order, each source's
    /// variables in order): `(source, index into its table's variables)`.
    pub flat: Vec<(usize, usize)>,
}

/// The decoded columns of one block of every source.
#[derive(Debug)]
pub struct BlockData {
    /// Per source: the box its columns cover.
    pub extents: Vec<Vec<Range<u64>>>,
    /// Per variable of the windows (flat order).
    pub columns: Vec<ArrayRef>,
}

impl Sources {
    /// One source, linked to itself.
    pub fn single(source: Source) -> Self {
        let links = (0..source.table.dims.len())
            .map(|dim| Link::Shift { dim, offset: 0 })
            .collect();
        let flat = source.variables.iter().map(|&v| (0, v)).collect();
        Self {
            list: vec![source],
            links: vec![links],
            flat,
        }
    }

    /// Joins `others` to `reference` for windows along `window_dims` with
    /// `lead` (a reference dimension) matched by value.
    pub fn join(
        reference: Source,
        others: Vec<Source>,
        window_dims: &[String],
        lead: Option<usize>,
    ) -> Result<Self, WindowError> {
        let mut joined = Self::single(reference);
        for source in others {
            let links = link(&joined.list[0], &source, window_dims, lead)?;
            let s = joined.list.len();
            joined.flat.extend(source.variables.iter().map(|&v| (s, v)));
            joined.links.push(links);
            joined.list.push(source);
        }
        Ok(joined)
    }

    /// What the object stores the sources read from fetched since they
    /// were opened (each store once, however many sources and variables
    /// share it): zero for local files.
    pub fn network(&self) -> IoTotals {
        let mut stores: Vec<&Arc<RemoteStorage>> = Vec::new();
        for source in &self.list {
            for storage in source.table.variables.iter().filter_map(|v| v.remote()) {
                if !stores.iter().any(|s| Arc::ptr_eq(s, storage)) {
                    stores.push(storage);
                }
            }
        }
        stores
            .iter()
            .fold(IoTotals::default(), |sum, s| sum + s.counters().totals())
    }

    /// The reference source.
    pub fn reference(&self) -> &Source {
        &self.list[0]
    }

    /// The name of variable `f` (flat order).
    pub fn variable_name(&self, f: usize) -> &str {
        let (s, v) = self.flat[f];
        self.list[s].table.variables[v].name()
    }

    /// Bytes of one value of variable `f`.
    pub fn element_size(&self, f: usize) -> u64 {
        let (s, v) = self.flat[f];
        self.list[s].table.variables[v].element_size() as u64
    }

    /// The box of source `s` read for the reference box `cells`, with the
    /// dimensions in `fixed` (`(source dimension, index)`) at one index.
    pub fn source_box(
        &self,
        s: usize,
        cells: &[Range<u64>],
        fixed: &[(usize, u64)],
    ) -> Vec<Range<u64>> {
        self.links[s]
            .iter()
            .enumerate()
            .map(|(sd, link)| {
                if let Some(&(_, k)) = fixed.iter().find(|(d, _)| *d == sd) {
                    return k..k + 1;
                }
                match link {
                    Link::Shift { dim, offset } => {
                        let r = &cells[*dim];
                        r.start.saturating_add_signed(*offset)..r.end.saturating_add_signed(*offset)
                    }
                    Link::Lookup { dim, start, index } => {
                        let r = &cells[*dim];
                        let from = (r.start - start) as usize;
                        let to = (r.end - start) as usize;
                        let mapped = &index[from.min(index.len())..to.min(index.len())];
                        match (mapped.iter().min(), mapped.iter().max()) {
                            (Some(&a), Some(&b)) => a..b + 1,
                            _ => 0..0,
                        }
                    }
                    Link::Channel { indices } => match (indices.first(), indices.last()) {
                        (Some(&a), Some(&b)) => a.min(b)..a.max(b) + 1,
                        _ => 0..0,
                    },
                }
            })
            .collect()
    }

    /// Reads every source's variables for the reference box `extent`.
    pub fn read(
        &self,
        extent: &[Range<u64>],
        pool: &ChunkBufferPool,
    ) -> Result<BlockData, WindowError> {
        let mut extents = Vec::with_capacity(self.list.len());
        let mut columns = Vec::with_capacity(self.flat.len());
        for (s, source) in self.list.iter().enumerate() {
            let cells = self.source_box(s, extent, &[]);
            for &v in &source.variables {
                let read = source.table.variables[v].read(&cells, pool);
                columns.push(read.map_err(WindowError::Data)?);
            }
            extents.push(cells);
        }
        Ok(BlockData { extents, columns })
    }

    /// Decoded bytes of every source's variables for the largest block of
    /// `grid`: what one block read holds.
    pub fn largest_block_bytes(&self, grid: &WindowGrid) -> u64 {
        grid.blocks
            .iter()
            .map(|b| self.decoded_bytes(&b.extent))
            .max()
            .unwrap_or(0)
    }

    /// Decoded bytes of every source's variables for the reference box `extent`.
    pub fn decoded_bytes(&self, extent: &[Range<u64>]) -> u64 {
        (0..self.list.len())
            .map(|s| {
                let cells: u64 = self
                    .source_box(s, extent, &[])
                    .iter()
                    .map(|r| r.end - r.start)
                    .product();
                let bytes: u64 = self
                    .flat
                    .iter()
                    .enumerate()
                    .filter(|(_, (source, _))| *source == s)
                    .map(|(f, _)| self.element_size(f))
                    .sum();
                cells.saturating_mul(bytes)
            })
            .sum()
    }

    /// Missing values of variable `f` counted onto the reference box
    /// `extent` (C order): per reference cell, over the source's own
    /// channel dimensions; a reference dimension the source lacks is
    /// broadcast, except those in `summed` (the reference's channel axes,
    /// summed whole by the index), where the count goes to the first cell.
    /// `None` when nothing is missing.
    pub fn missing(
        &self,
        f: usize,
        data: &BlockData,
        extent: &[Range<u64>],
        summed: &[usize],
    ) -> Option<Vec<u32>> {
        let nulls = data.columns[f].nulls().filter(|n| n.null_count() > 0)?;
        let (s, _) = self.flat[f];
        let cells: usize = extent.iter().map(|r| (r.end - r.start) as usize).product();
        let mut missing = vec![0u32; cells];
        if s == 0 {
            count_missing(nulls.inner(), &mut missing);
            return Some(missing);
        }
        let links = &self.links[s];
        let source_extent = &data.extents[s];
        let mut strides = vec![1usize; links.len()];
        for d in (0..links.len().saturating_sub(1)).rev() {
            strides[d] =
                strides[d + 1] * (source_extent[d + 1].end - source_extent[d + 1].start) as usize;
        }
        // The offsets of the source's own channel cells from a base cell.
        let mut channel_offsets = vec![0usize];
        for (sd, link) in links.iter().enumerate() {
            if let Link::Channel { indices } = link {
                let (stride, first) = (strides[sd], source_extent[sd].start);
                channel_offsets = channel_offsets
                    .iter()
                    .flat_map(|&o| {
                        indices
                            .iter()
                            .map(move |&k| o + (k - first) as usize * stride)
                    })
                    .collect();
            }
        }
        let linked: Vec<bool> = (0..extent.len())
            .map(|d| {
                links.iter().any(|l| match l {
                    Link::Shift { dim, .. } | Link::Lookup { dim, .. } => *dim == d,
                    Link::Channel { .. } => false,
                })
            })
            .collect();
        let valid = nulls.inner();
        let mut position: Vec<u64> = extent.iter().map(|r| r.start).collect();
        for count in missing.iter_mut() {
            let counted = summed
                .iter()
                .all(|&d| linked[d] || position[d] == extent[d].start);
            if counted {
                let mut base = 0usize;
                for (sd, link) in links.iter().enumerate() {
                    let index = match link {
                        Link::Shift { dim, offset } => {
                            position[*dim].saturating_add_signed(*offset)
                        }
                        Link::Lookup { dim, start, index } => {
                            index[(position[*dim] - start) as usize]
                        }
                        Link::Channel { .. } => source_extent[sd].start,
                    };
                    base += (index - source_extent[sd].start) as usize * strides[sd];
                }
                *count = channel_offsets
                    .iter()
                    .filter(|&&o| !valid.value(base + o))
                    .count() as u32;
            }
            for d in (0..extent.len()).rev() {
                position[d] += 1;
                if position[d] < extent[d].end {
                    break;
                }
                position[d] = extent[d].start;
            }
        }
        Some(missing)
    }
}

/// The links of `source`'s dimensions to `reference`'s.
fn link(
    reference: &Source,
    source: &Source,
    window_dims: &[String],
    lead: Option<usize>,
) -> Result<Vec<Link>, WindowError> {
    let error =
        |m: String| WindowError::argument("sources", format!("source '{}': {m}", source.name));
    let ref_dims: Vec<&str> = reference
        .table
        .dims
        .iter()
        .map(|d| d.name.as_str())
        .collect();
    let dims: Vec<&str> = source.table.dims.iter().map(|d| d.name.as_str()).collect();
    for w in window_dims {
        if !dims.contains(&w.as_str()) {
            return Err(error(format!(
                "has no dimension '{w}' of the windows (its dimensions: {})",
                dims.join(", ")
            )));
        }
    }
    let order: Vec<&str> = dims
        .iter()
        .copied()
        .filter(|d| window_dims.iter().any(|w| w == d))
        .collect();
    let ref_order: Vec<&str> = ref_dims
        .iter()
        .copied()
        .filter(|d| window_dims.iter().any(|w| w == d))
        .collect();
    if order != ref_order {
        return Err(error(format!(
            "orders the window dimensions ({}) unlike '{}' ({})",
            order.join(", "),
            reference.name,
            ref_order.join(", ")
        )));
    }
    let mut links = Vec::with_capacity(dims.len());
    for (sd, name) in dims.iter().enumerate() {
        let Some(d) = ref_dims.iter().position(|r| r == name) else {
            links.push(Link::Channel {
                indices: indices(source.selection.ranges(sd)),
            });
            continue;
        };
        let is_window = window_dims.iter().any(|w| w == name);
        if !is_window && Some(d) != lead {
            links.push(Link::Channel {
                indices: indices(source.selection.ranges(sd)),
            });
            continue;
        }
        let range = match reference.selection.ranges(d) {
            [] => 0..0,
            [one] => one.clone(),
            many => many[0].start..many[many.len() - 1].end,
        };
        let theirs =
            values(&reference.table, d, &range).map_err(|e| error(format!("its '{name}': {e}")))?;
        let ours = values(&source.table, sd, &(0..source.table.dims[sd].len))
            .map_err(|e| error(format!("its '{name}': {e}")))?;
        if is_window {
            links.push(shift(&theirs, &ours, d, range.start).ok_or_else(|| {
                error(format!(
                    "its '{name}' ({}) is not the grid of '{}' ({}); regrid one of them first",
                    ours.describe(),
                    reference.name,
                    theirs.describe()
                ))
            })?);
        } else {
            let index = ours.find_all(&theirs).map_err(|i| {
                error(format!(
                    "has no {name} {} that '{}' has (its {name}: {}); select the steps both have with `where`",
                    show(&reference.table, d, range.start + i as u64),
                    reference.name,
                    ours.describe()
                ))
            })?;
            links.push(Link::Lookup {
                dim: d,
                start: range.start,
                index,
            });
        }
    }
    Ok(links)
}

/// Every index of `ranges`.
fn indices(ranges: &[Range<u64>]) -> Vec<u64> {
    ranges.iter().flat_map(|r| r.clone()).collect()
}

/// The shift mapping `theirs` (the reference's values from index `start`
/// of dimension `dim`) onto the same values in `ours`, if they are there.
fn shift(theirs: &Points, ours: &Points, dim: usize, start: u64) -> Option<Link> {
    let n = theirs.len();
    let at = ours.find(theirs, 0)?;
    let matches = ours.len() >= at + n && (0..n).all(|i| ours.same(at + i, theirs, i));
    matches.then(|| Link::Shift {
        dim,
        offset: at as i64 - start as i64,
    })
}

/// Coordinate values, compared exactly (times) or within a relative 1e-6
/// (numbers, as float32 and float64 copies of a grid differ).
enum Points {
    /// Nanoseconds since 1970.
    Times(Vec<i64>),
    /// Numbers as float64.
    Numbers(Vec<f64>),
}

impl Points {
    fn len(&self) -> usize {
        match self {
            Self::Times(v) => v.len(),
            Self::Numbers(v) => v.len(),
        }
    }

    /// Whether our value `i` is their value `j`.
    fn same(&self, i: usize, theirs: &Points, j: usize) -> bool {
        match (self, theirs) {
            (Self::Times(a), Self::Times(b)) => a[i] == b[j],
            (Self::Numbers(a), Self::Numbers(b)) => {
                let (x, y) = (a[i], b[j]);
                x == y || (x - y).abs() <= 1e-6 * x.abs().max(y.abs()).max(1.0)
            }
            _ => false,
        }
    }

    /// Our first index holding their value `j`.
    fn find(&self, theirs: &Points, j: usize) -> Option<usize> {
        (0..self.len()).find(|&i| self.same(i, theirs, j))
    }

    /// Our index of each of their values, or the position of the first we lack.
    fn find_all(&self, theirs: &Points) -> Result<Vec<u64>, usize> {
        if let (Self::Times(ours), Self::Times(wanted)) = (self, theirs) {
            let at: std::collections::HashMap<i64, u64> = ours
                .iter()
                .enumerate()
                .map(|(i, &t)| (t, i as u64))
                .collect();
            return wanted
                .iter()
                .enumerate()
                .map(|(j, t)| at.get(t).copied().ok_or(j))
                .collect();
        }
        (0..theirs.len())
            .map(|j| self.find(theirs, j).map(|i| i as u64).ok_or(j))
            .collect()
    }

    /// `n values from a to b by step`, for messages.
    fn describe(&self) -> String {
        let numbers: Vec<f64> = match self {
            Self::Times(v) => v.iter().map(|&t| t as f64).collect(),
            Self::Numbers(v) => v.clone(),
        };
        let unit = if matches!(self, Self::Times(_)) {
            " ns"
        } else {
            ""
        };
        match numbers.as_slice() {
            [] => "no values".into(),
            [one] => format!("1 value, {one}{unit}"),
            [a, b, ..] => format!(
                "{} values from {a} to {}{unit} by {}{unit}",
                numbers.len(),
                numbers[numbers.len() - 1],
                b - a
            ),
        }
    }
}

/// The coordinate value at `index` of dimension `d`, for messages.
fn show(table: &GridTable, d: usize, index: u64) -> String {
    let dim = &table.dims[d];
    match dim.coordinate.slice(index, 1) {
        Ok(one) => cast(&one, &DataType::Utf8)
            .ok()
            .and_then(|t| t.as_string_opt::<i32>().map(|s| s.value(0).to_string()))
            .unwrap_or_else(|| format!("#{index}")),
        Err(_) => format!("#{index}"),
    }
}

/// The coordinate values of `range` of dimension `d` (times as
/// nanoseconds since 1970, whatever their unit).
fn values(table: &GridTable, d: usize, range: &Range<u64>) -> Result<Points, String> {
    let dim = &table.dims[d];
    let array = dim
        .coordinate
        .slice(range.start, range.end - range.start)
        .map_err(|e| e.to_string())?;
    if array.null_count() > 0 {
        return Err("has missing coordinate values".into());
    }
    Ok(match array.data_type() {
        DataType::Timestamp(_, _) => {
            let nanos = cast(&array, &DataType::Timestamp(TimeUnit::Nanosecond, None))
                .and_then(|a| cast(&a, &DataType::Int64))
                .map_err(|e| e.to_string())?;
            Points::Times(nanos.as_primitive::<Int64Type>().values().to_vec())
        }
        t if t.is_numeric() => {
            let numbers = cast(&array, &DataType::Float64).map_err(|e| e.to_string())?;
            Points::Numbers(numbers.as_primitive::<Float64Type>().values().to_vec())
        }
        other => return Err(format!("holds {other}, not numbers or times")),
    })
}

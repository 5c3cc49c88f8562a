//! Rows written as they come: a query whose rows are one per cell of a
//! grid known before the first arrives, in the grid's C order (a dense
//! reduction's result: its keys are its coordinates), is written by
//! `COPY ... STORED AS ZARR` a slab of whole chunks at a time, so the COPY
//! holds a slab of rows and its chunks, not the result and its grid. Rows
//! that come band by band along a later dimension (a reduction in bands of
//! latitudes, each band's rows in C order over its cells) are written a
//! band at a time.
//!
//! ```sql
//! -- 91 M groups: written 2 time steps at a time, in bands of the reduction.
//! COPY (SELECT date_bin(INTERVAL '3 hours', time) AS time, lat, lon, avg(t2m) AS t2m
//!       FROM era5 GROUP BY 1, 2, 3) TO 'era5_3h.zarr' STORED AS ZARR;
//! -- 25 M groups in bands of latitudes: written a band of latitudes at a time.
//! COPY (SELECT extract(hour FROM time) AS hour, lat, lon, avg(t2m) AS t2m
//!       FROM era5 GROUP BY 1, 2, 3) TO 'era5_diurnal.zarr' STORED AS ZARR;
//! ```
//!
//! The operators that know the grid of their rows are above this writer:
//! the session names them in its [`RowGrids`] (a [`SessionConfig`]
//! extension), which [`ZarrSink`](super::sink::ZarrSink)'s planning asks
//! through the projections over the operator. The store is the one the
//! collecting sink writes from the same rows (coordinates sorted the same
//! way, the same types, attributes and chunks): where that cannot be known
//! before the rows arrive (an integer variable that may be NULL, a
//! coordinate not strictly ordered) the sink collects them instead. The
//! rows are checked as they come (their coordinates against their cells',
//! their number against the grid's): a query that does not keep its
//! promise fails and leaves nothing.
//!
//! [`SessionConfig`]: datafusion::prelude::SessionConfig

use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use datafusion::arrow::array::Scalar;
use datafusion::arrow::array::{Array, ArrayRef, RecordBatch, UInt32Array};
use datafusion::arrow::compute::kernels::cmp::eq;
use datafusion::arrow::compute::{cast, concat, take};
use datafusion::arrow::datatypes::{DataType, SchemaRef};
use datafusion::catalog::Session;
use datafusion::common::{exec_err, human_readable_size, DataFusionError, Result};
use datafusion::execution::memory_pool::MemoryLimit;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::ExecutionPlan;
use tokio::sync::mpsc::Receiver;

use super::grid::{
    field_attributes, field_calendar, laid_out, reversal, written_type, GridDimension,
};
use super::store::{
    chunk_lengths, group_coordinate, prepare_group, store_box, value_bytes, GroupVariable,
    WriteSummary,
};
use super::target::CopyTarget;
use crate::zarr::StoreLocation;

/// What a plan knows of its rows before they come: the memory it holds,
/// and the grid they lay out, one per cell, in C order (or band by band),
/// where they do.
#[derive(Debug, Clone)]
pub struct RowGrid {
    /// Per dimension, outermost first: the plan's output column holding
    /// its coordinate, and its coordinates in the order the rows run along
    /// it (`None`: its rows are not one per cell of a grid in its order).
    pub dims: Option<Vec<(usize, ArrayRef)>>,
    /// Where the rows come band by band along a dimension other than the
    /// outermost (`None`: in C order over the whole grid).
    pub band: Option<RowBand>,
    /// Bytes the plan holds while it runs (its projected memory).
    pub memory: usize,
}

/// Rows that come band by band: the first `keys` coordinates of dimension
/// `dim` (in the order the rows run along it), then the next `keys`, ...,
/// each band's rows in C order over its cells (every coordinate of the
/// other dimensions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowBand {
    /// The dimension cut into bands: its place among the grid's.
    pub dim: usize,
    /// Coordinates of it per band.
    pub keys: u64,
}

/// How a session finds what a plan knows of its rows (`None`: the plan
/// does not know it): a [`SessionConfig`](datafusion::prelude::SessionConfig)
/// extension the session sets.
pub struct RowGrids(pub fn(&dyn ExecutionPlan) -> Result<Option<RowGrid>>);

/// Bytes `input` (whose rows a COPY of `width` columns writes) holds while
/// it runs, where the session's [`RowGrids`] knows them through the
/// projections over the plan that makes the rows (0 where it does not).
pub(crate) fn input_memory(
    input: &Arc<dyn ExecutionPlan>,
    session: &dyn Session,
    width: usize,
) -> Result<usize> {
    let Some(grids) = session.config().get_extension::<RowGrids>() else {
        return Ok(0);
    };
    let (plan, _) = through_projections(input, width);
    Ok((grids.0)(plan.as_ref())?.map_or(0, |grid| grid.memory))
}

/// A result written as it comes: the grid, and how its rows are laid out.
#[derive(Debug, Clone)]
pub(crate) struct Streamed {
    /// Per dimension (the sink's order): its column, and its coordinates
    /// in the order the rows run along it.
    arrival: Vec<(usize, ArrayRef)>,
    /// Per dimension: whether the store runs the other way (its
    /// coordinates sorted the other way than the rows run).
    reversed: Vec<bool>,
    /// Per variable: its column and the type it is written as.
    variables: Vec<(usize, DataType)>,
    /// The grid's shape.
    shape: Vec<u64>,
    /// The variables' chunk shape.
    chunks: Vec<u64>,
    /// The dimension written a slab at a time: the outermost, or the one
    /// the rows come in bands of.
    along: usize,
    /// Positions of `along` written at a time: whole chunks, enough for
    /// every core to encode one, or a band of the rows.
    slab: u64,
    /// Whether the slabs are the rows' bands (else any run of positions of
    /// the outermost dimension: the rows are in the grid's order).
    banded: bool,
    /// Bytes of one row as the input holds it.
    row_bytes: u64,
    /// Bytes the input plan holds (its projected memory).
    input_memory: usize,
    /// The name of the dimension written a slab at a time.
    along_name: String,
}

impl Streamed {
    /// How `input`'s rows (of `schema`, its columns `dims` the dimensions,
    /// sorted descending where `descending` says) are written as they
    /// come, when the session's [`RowGrids`] knows their grid through the
    /// projections over the plan that makes them, the dimensions are its
    /// dimensions in its order, and the store written from the rows as
    /// they come is the one collecting them would write; `None` otherwise.
    pub(crate) fn of(
        input: &Arc<dyn ExecutionPlan>,
        session: &dyn Session,
        schema: &SchemaRef,
        dims: &[usize],
        descending: &[bool],
        target: &CopyTarget,
    ) -> Result<Option<Self>> {
        let Some(grids) = session.config().get_extension::<RowGrids>() else {
            return Ok(None);
        };
        let (plan, columns) = through_projections(input, schema.fields().len());
        let Some(grid) = (grids.0)(plan.as_ref())? else {
            return Ok(None);
        };
        let streamed = Self::over(grid, &columns, schema, dims, descending, target)?;
        // Bands the size of the result (two of them, say) are held no
        // better than the whole result: collected, as before.
        Ok(streamed.filter(|s| !s.banded || s.memory() < s.collected_memory()))
    }

    /// How rows of `grid`'s plan, passed on as `columns` (per column of
    /// `schema`, the plan's column it is, if any), are written as they come
    /// (see [`Self::of`]).
    fn over(
        grid: RowGrid,
        columns: &[Option<usize>],
        schema: &SchemaRef,
        dims: &[usize],
        descending: &[bool],
        target: &CopyTarget,
    ) -> Result<Option<Self>> {
        let Some(grid_dims) = grid.dims.filter(|g| g.len() == dims.len()) else {
            return Ok(None);
        };
        let band = match grid.band {
            Some(band) if band.dim == 0 || band.dim >= dims.len() => return Ok(None),
            band => band,
        };
        let mut arrival = Vec::with_capacity(dims.len());
        let mut reversed = Vec::with_capacity(dims.len());
        for ((&d, &down), (column, coords)) in dims.iter().zip(descending).zip(grid_dims) {
            let Some(ascending) = (columns[d] == Some(column))
                .then(|| strictly_ordered(&coords))
                .flatten()
            else {
                return Ok(None);
            };
            reversed.push(coords.len() > 1 && ascending == down);
            arrival.push((d, coords));
        }
        let mut variables = Vec::new();
        for (i, field) in schema.fields().iter().enumerate() {
            if dims.contains(&i) {
                continue;
            }
            // Whether an integer may be NULL is known from its values only.
            let t = field.data_type();
            if (t.is_integer() || *t == DataType::Boolean) && field.is_nullable() {
                return Ok(None);
            }
            let Ok(written) = written_type(field, true) else {
                return Ok(None);
            };
            variables.push((i, written));
        }
        let shape: Vec<u64> = arrival.iter().map(|(_, c)| c.len() as u64).collect();
        let along = band.map_or(0, |b| b.dim);
        let others = (shape.iter().enumerate())
            .filter(|&(d, _)| d != along)
            .try_fold(1u64, |n, (_, &len)| n.checked_mul(len));
        let Some(others) = others.filter(|_| !shape.contains(&0)) else {
            return Ok(None);
        };
        let names: Vec<&str> = dims
            .iter()
            .map(|&d| schema.field(d).name().as_str())
            .collect();
        let width = (variables.iter())
            .map(|(_, t)| t.primitive_width().unwrap_or(8) as u64)
            .max()
            .unwrap_or(8);
        let chunks = chunk_lengths(&names, &shape, width, &target.options, u64::MAX)?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
        let across = (shape[1..].iter().zip(&chunks[1..])).fold(1u64, |n, (&len, &c)| {
            n.saturating_mul(len.div_ceil(c.max(1)))
        });
        let slab = match band {
            Some(band) => band.keys.clamp(1, shape[along]),
            None => (chunks[0].max(1))
                .saturating_mul(cores.div_ceil(across).max(1))
                .min(shape[0]),
        };
        // A slab's cells are numbered with u32 where it is reversed.
        if slab.saturating_mul(others) > u32::MAX as u64 {
            return Ok(None);
        }
        let row_bytes = (schema.fields().iter())
            .map(|f| f.data_type().primitive_width().unwrap_or(16) as u64)
            .sum();
        Ok(Some(Self {
            arrival,
            reversed,
            variables,
            shape,
            chunks,
            along,
            slab,
            banded: band.is_some(),
            row_bytes,
            input_memory: grid.memory,
            along_name: names[along].to_string(),
        }))
    }

    /// Cells of the grid per position of the dimension written a slab at
    /// a time.
    fn others(&self) -> u64 {
        (self.shape.iter().enumerate())
            .filter(|&(d, _)| d != self.along)
            .map(|(_, &n)| n)
            .product()
    }

    /// This write with the rows' bands `keys` positions each, where it
    /// writes bands at least that large (a cluster's tasks fold the bands
    /// evened out for them, never larger than the session cut them);
    /// `None` otherwise.
    pub(crate) fn in_bands_of(&self, keys: u64) -> Option<Self> {
        (self.banded && (1..=self.slab).contains(&keys)).then(|| Self {
            slab: keys,
            ..self.clone()
        })
    }

    /// What collecting the rows holds: every row, and the grid they lay
    /// out.
    fn collected_memory(&self) -> u64 {
        let cells = self.shape.iter().product::<u64>();
        let widths: u64 = (self.variables.iter())
            .map(|(_, t)| t.primitive_width().unwrap_or(16) as u64)
            .sum();
        cells.saturating_mul(self.row_bytes.saturating_add(widths))
    }

    /// Batches of `batch_size` rows the query may send ahead of the writer:
    /// two slabs' rows (at least two batches).
    pub(crate) fn batches_in_flight(&self, batch_size: usize) -> usize {
        let rows = 2 * self.slab * self.others();
        usize::try_from(rows.div_ceil(batch_size.max(1) as u64))
            .unwrap_or(usize::MAX)
            .clamp(2, 1 << 20)
    }

    /// The most bytes writing holds at once: a slab's rows as they came and
    /// two more slabs' in flight, its variables laid out, the largest of
    /// them encoded, and where the store runs the other way, a cell number
    /// per cell.
    pub(crate) fn memory(&self) -> u64 {
        let cells = self.slab * self.others();
        let widths: Vec<u64> = (self.variables.iter())
            .map(|(_, t)| t.primitive_width().unwrap_or(16) as u64)
            .collect();
        let laid_out: u64 = widths.iter().sum::<u64>() * cells;
        let encoded = widths.iter().max().copied().unwrap_or(0) * cells;
        let numbers = if self.reversed.contains(&true) {
            4 * cells
        } else {
            0
        };
        3 * self.row_bytes * cells + laid_out + encoded + numbers
    }

    /// Refuses, before anything runs, a write whose input and slab do not
    /// fit the session's memory limit together.
    pub(crate) fn check_fits(&self, target: &StoreLocation, session: &dyn Session) -> Result<()> {
        let MemoryLimit::Finite(limit) = session.runtime_env().memory_pool.memory_limit() else {
            return Ok(());
        };
        let writing = self.memory();
        let needed = (self.input_memory as u64).saturating_add(writing);
        if needed > limit as u64 {
            let smaller = match self.banded {
                true => "Lower zarrfusion.dense_state_bytes (smaller bands)".to_string(),
                false => format!(
                    "Write smaller chunks along '{}' (OPTIONS ('chunks' ...))",
                    self.along_name
                ),
            };
            return Err(DataFusionError::ResourcesExhausted(format!(
                "COPY TO Zarr ('{target}'): the query holds {} and writing its rows {} at a time \
                 along '{}' holds {}: {} does not fit in allowed_mem ({}). {smaller}, a smaller \
                 selection, or raise allowed_mem",
                human_readable_size(self.input_memory),
                self.slab,
                self.along_name,
                human_readable_size(writing as usize),
                human_readable_size(needed as usize),
                human_readable_size(limit),
            )));
        }
        Ok(())
    }

    /// How it is shown in plans.
    pub(crate) fn describe(&self) -> String {
        let bands = if self.banded { " (its bands)" } else { "" };
        format!(
            "streamed={} of {} per write{bands}",
            self.slab, self.along_name
        )
    }

    /// The positions of the dimension written a slab at a time, slab by
    /// slab, in the order the rows arrive: runs of whole chunks (the rows
    /// in the grid's order), or the rows' bands.
    fn slabs(&self) -> Vec<Range<u64>> {
        let (n, step) = (self.shape[self.along], self.slab.max(1));
        let back = self.reversed[self.along];
        let runs = (0..n).step_by(step as usize);
        if self.banded {
            // Bands count in the order the rows run.
            return runs
                .map(|start| self.stored(start..(start + step).min(n)))
                .collect();
        }
        let mut slabs: Vec<Range<u64>> = runs.map(|start| start..(start + step).min(n)).collect();
        if back {
            slabs.reverse();
        }
        slabs
    }

    /// Positions `run` of the dimension written a slab at a time, counted
    /// in the order the rows run along it, as the store counts them (and
    /// back).
    fn stored(&self, run: Range<u64>) -> Range<u64> {
        let n = self.shape[self.along];
        match self.reversed[self.along] {
            true => n - run.end..n - run.start,
            false => run,
        }
    }

    /// Writes the rows `rows` brings (of `schema`) into a new store at
    /// `target`, a slab at a time as they come, stopping when `cancelled`
    /// is set; what was written. Fails, leaving nothing, when the rows
    /// are not the grid's cells in its order.
    pub(crate) fn write(
        &self,
        schema: &SchemaRef,
        target: &CopyTarget,
        runtime: &RuntimeEnv,
        cancelled: &AtomicBool,
        mut rows: Receiver<RecordBatch>,
    ) -> Result<WriteSummary> {
        let coordinates: Vec<_> = (self.arrival.iter().zip(&self.reversed))
            .map(|((d, coords), &back)| {
                let coords = match back {
                    true => backward(coords)?,
                    false => Arc::clone(coords),
                };
                let field = schema.field(*d);
                Ok(group_coordinate(&GridDimension {
                    name: field.name().clone(),
                    coords,
                    attributes: field_attributes(field),
                    calendar: field_calendar(field),
                }))
            })
            .collect::<Result<_>>()?;
        let variables: Vec<GroupVariable> = (self.variables.iter())
            .map(|(i, t)| GroupVariable {
                name: schema.field(*i).name().clone(),
                data_type: t.clone(),
                shape: self.shape.clone(),
                chunks: self.chunks.clone(),
                attributes: field_attributes(schema.field(*i)),
            })
            .collect();
        let options = &target.options;
        let others = self.others();
        let cells: u64 = self.shape.iter().product();
        target.write_group(
            runtime,
            cancelled,
            |storage| prepare_group(storage, &coordinates, &variables, options),
            |group| {
                let mut held: Vec<RecordBatch> = Vec::new();
                let mut held_rows = 0u64;
                let mut arrived = 0u64;
                let mut written = 0u64;
                let mut bytes = 0u64;
                let mut slabs = self.slabs().into_iter().peekable();
                while let Some(batch) = rows.blocking_recv() {
                    if cancelled.load(Ordering::Relaxed) {
                        return exec_err!("the Zarr write was cancelled");
                    }
                    let n = batch.num_rows() as u64;
                    if n == 0 {
                        continue;
                    }
                    arrived += n;
                    held_rows += n;
                    held.push(batch);
                    while let Some(slab) = slabs.peek() {
                        let slab_rows = (slab.end - slab.start) * others;
                        if held_rows < slab_rows {
                            break;
                        }
                        let taken = take_front(&mut held, slab_rows as usize);
                        held_rows -= slab_rows;
                        self.check_cells(&taken, written, slab, schema)?;
                        bytes += self.write_slab(group, &taken, slab.clone())?;
                        written += slab_rows;
                        slabs.next();
                    }
                }
                if cancelled.load(Ordering::Relaxed) {
                    return exec_err!("the Zarr write was cancelled");
                }
                if arrived != cells {
                    return exec_err!(
                        "COPY TO Zarr: the query gave {arrived} rows for a grid of {cells} cells \
                         ({:?}); nothing was written",
                        self.shape
                    );
                }
                Ok(WriteSummary { cells, bytes })
            },
        )
    }

    /// Checks that `taken`, rows `first..` of the result, hold the
    /// coordinates of the cells of the slab `slab` (stored positions of the
    /// dimension written a slab at a time) in C order over them.
    fn check_cells(
        &self,
        taken: &[RecordBatch],
        first: u64,
        slab: &Range<u64>,
        schema: &SchemaRef,
    ) -> Result<()> {
        // The slab's cells, as the rows run along each dimension.
        let cells: Vec<Range<u64>> = (self.shape.iter().enumerate())
            .map(|(d, &n)| match d == self.along {
                true => self.stored(slab.clone()),
                false => 0..n,
            })
            .collect();
        let mut row = 0u64;
        for batch in taken {
            self.check_batch(batch, row, &cells, first, schema)?;
            row += batch.num_rows() as u64;
        }
        Ok(())
    }

    /// Checks that `batch`, rows `arrived..` of the box `cells` (ranges of
    /// each dimension's coordinates as the rows run; the box starts at row
    /// `first` of the result), holds the coordinates of its cells, run by
    /// run: a dimension's coordinate is one value over each run of its
    /// stride's rows (compared with it), and the innermost one runs through
    /// its coordinates (compared as slices).
    fn check_batch(
        &self,
        batch: &RecordBatch,
        arrived: u64,
        cells: &[Range<u64>],
        first: u64,
        schema: &SchemaRef,
    ) -> Result<()> {
        let rows = batch.num_rows() as u64;
        let mut stride = 1u64;
        for j in (0..self.arrival.len()).rev() {
            let (column, coords) = &self.arrival[j];
            let (start, len) = (cells[j].start, cells[j].end - cells[j].start);
            let values = batch.column(*column);
            let mut r = 0u64;
            while r < rows {
                let cell = arrived + r;
                let position = (start + (cell / stride) % len) as usize;
                let (run, same) = if stride == 1 {
                    let run = (start + len - position as u64).min(rows - r);
                    let got = values.slice(r as usize, run as usize);
                    (
                        run,
                        got.as_ref() == coords.slice(position, run as usize).as_ref(),
                    )
                } else {
                    let run = (stride - cell % stride).min(rows - r);
                    let got = values.slice(r as usize, run as usize);
                    let equal = eq(&got, &Scalar::new(coords.slice(position, 1)))?;
                    (run, equal.true_count() == run as usize)
                };
                if !same {
                    return exec_err!(
                        "COPY TO Zarr: rows {}..{} of the result do not hold the '{}' of their \
                         cells in the grid's order; nothing was written",
                        first + cell,
                        first + cell + run,
                        schema.field(*column).name()
                    );
                }
                r += run;
            }
            stride = stride.saturating_mul(len);
        }
        Ok(())
    }

    /// Writes the rows `taken` (in arrival order) as the slab `positions`
    /// of the dimension written a slab at a time; the bytes written
    /// (uncompressed).
    fn write_slab(
        &self,
        group: &super::store::GroupWrite,
        taken: &[RecordBatch],
        positions: Range<u64>,
    ) -> Result<u64> {
        let ranges: Vec<Range<u64>> = (self.shape.iter().enumerate())
            .map(|(d, &n)| match d == self.along {
                true => positions.clone(),
                false => 0..n,
            })
            .collect();
        let shape: Vec<usize> = ranges.iter().map(|r| (r.end - r.start) as usize).collect();
        let gather: Option<UInt32Array> = self
            .reversed
            .contains(&true)
            .then(|| reversal(&shape, &self.reversed));
        let mut bytes = 0u64;
        for ((column, written), array) in self.variables.iter().zip(&group.variables) {
            let parts: Vec<&dyn Array> = taken.iter().map(|b| b.column(*column).as_ref()).collect();
            let values = laid_out(&concat(&parts)?, written, gather.as_ref())?;
            let fail = |e: String| {
                DataFusionError::Execution(format!("COPY TO Zarr: array '{}': {e}", array.path()))
            };
            let (data, _) = value_bytes(&values).map_err(fail)?;
            store_box(array, &ranges, data.as_slice()).map_err(fail)?;
            bytes += data.len() as u64;
        }
        Ok(bytes)
    }
}

/// The first `rows` rows of `held` (taken out of it), as batches.
fn take_front(held: &mut Vec<RecordBatch>, mut rows: usize) -> Vec<RecordBatch> {
    let mut taken = Vec::new();
    while rows > 0 {
        let first = &held[0];
        let n = first.num_rows();
        if n <= rows {
            rows -= n;
            taken.push(held.remove(0));
        } else {
            taken.push(first.slice(0, rows));
            held[0] = first.slice(rows, n - rows);
            rows = 0;
        }
    }
    taken
}

/// `values` in the other order.
fn backward(values: &ArrayRef) -> Result<ArrayRef> {
    let n = values.len() as u32;
    Ok(take(
        values,
        &UInt32Array::from_iter_values((0..n).rev()),
        None,
    )?)
}

/// Whether `values` (numbers, dates or timestamps without NULLs) are
/// strictly ascending (`Some(true)`) or descending (`Some(false)`), as the
/// collecting sink orders coordinates (`-0.0` and `0.0` one value, NaN
/// none); `None` when they are neither.
fn strictly_ordered(values: &ArrayRef) -> Option<bool> {
    if values.null_count() > 0 {
        return None;
    }
    let t = values.data_type();
    let keys: Vec<f64> = if matches!(t, DataType::Float16 | DataType::Float32 | DataType::Float64) {
        let v = cast(values, &DataType::Float64).ok()?;
        v.as_any()
            .downcast_ref::<datafusion::arrow::array::Float64Array>()?
            .values()
            .to_vec()
    } else if t.is_integer() || t.is_temporal() {
        let v = cast(values, &DataType::Int64).ok()?;
        let v = v
            .as_any()
            .downcast_ref::<datafusion::arrow::array::Int64Array>()?;
        // Compared as integers below: f64 would merge neighbours.
        return ordered_by(v.values(), |a, b| a.cmp(b));
    } else {
        return None;
    };
    ordered_by(&keys, |a, b| {
        a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal)
    })
}

/// Whether `values` strictly ascend or descend under `cmp` (one value or
/// none: ascending).
fn ordered_by<T>(values: &[T], cmp: impl Fn(&T, &T) -> std::cmp::Ordering) -> Option<bool> {
    use std::cmp::Ordering::{Greater, Less};
    let ascending = values.windows(2).all(|w| cmp(&w[0], &w[1]) == Less);
    let descending = values.windows(2).all(|w| cmp(&w[0], &w[1]) == Greater);
    match (ascending, descending) {
        (true, _) => Some(true),
        (false, true) => Some(false),
        _ => None,
    }
}

/// The plan under `plan`'s projections (which keep its rows and their
/// order), and for each of `plan`'s `width` output columns the
/// column of that plan it passes on as it is, if any.
fn through_projections(
    plan: &Arc<dyn ExecutionPlan>,
    width: usize,
) -> (Arc<dyn ExecutionPlan>, Vec<Option<usize>>) {
    let mut plan = Arc::clone(plan);
    let mut columns: Vec<Option<usize>> = (0..width).map(Some).collect();
    loop {
        if let Some(projection) = plan.downcast_ref::<ProjectionExec>() {
            let exprs = projection.expr();
            for c in columns.iter_mut() {
                *c = c
                    .and_then(|i| exprs.get(i))
                    .and_then(|e| e.expr.downcast_ref::<Column>().map(|c| c.index()));
            }
            plan = Arc::clone(projection.input());
        } else {
            return (plan, columns);
        }
    }
}

impl fmt::Debug for RowGrids {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("RowGrids")
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashMap};
    use std::path::Path;

    use datafusion::arrow::array::{Float64Array, Int64Array};
    use datafusion::arrow::datatypes::{Field, Schema};

    use super::*;
    use crate::write::grid::assemble;
    use crate::write::options::ZarrWriteOptions;
    use crate::write::store::{chunk_shape, grid_arrays, store_grid};

    /// A small deterministic generator (xorshift).
    struct Draw(u64);

    impl Draw {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n.max(1)
        }
    }

    /// Every file under `dir`, by path relative to it, with its bytes.
    fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
        let mut out = BTreeMap::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for entry in std::fs::read_dir(&d).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    stack.push(path);
                } else {
                    let key = path
                        .strip_prefix(dir)
                        .unwrap()
                        .to_string_lossy()
                        .into_owned();
                    out.insert(key, std::fs::read(&path).unwrap());
                }
            }
        }
        out
    }

    fn local(target: &CopyTarget) -> std::path::PathBuf {
        match &target.location {
            StoreLocation::Local(path) => path.clone(),
            StoreLocation::Remote(url) => panic!("{url} is not local"),
        }
    }

    fn target(path: &Path, chunks: &str) -> CopyTarget {
        let options = HashMap::from([("chunks".to_string(), chunks.to_string())]);
        let options = ZarrWriteOptions::from_map(&options).unwrap();
        CopyTarget::new(
            StoreLocation::parse(&path.to_string_lossy()).unwrap(),
            options,
        )
        .unwrap()
    }

    /// The store the collecting sink writes from `batches` (what
    /// `ZarrSink` does without a row grid).
    fn collected(
        schema: &SchemaRef,
        batches: &[RecordBatch],
        descending: &[bool],
        to: &CopyTarget,
    ) {
        let grid = assemble(schema, batches, &[0, 1], descending).unwrap();
        let chunks = chunk_shape(&grid, &to.options).unwrap();
        let (coordinates, variables) = grid_arrays(&grid, &chunks);
        let cancelled = AtomicBool::new(false);
        to.write_group(
            &RuntimeEnv::default(),
            &cancelled,
            |storage| prepare_group(storage, &coordinates, &variables, &to.options),
            |group| store_grid(&grid, group, &chunks, &cancelled),
        )
        .unwrap();
    }

    /// Writes `batches` as they come through a channel, as the sink does.
    fn streamed(
        streamed: &Streamed,
        schema: &SchemaRef,
        batches: Vec<RecordBatch>,
        to: &CopyTarget,
    ) -> Result<WriteSummary> {
        let (send, receive) = tokio::sync::mpsc::channel(2);
        let feeder = std::thread::spawn(move || {
            for batch in batches {
                if send.blocking_send(batch).is_err() {
                    break;
                }
            }
        });
        let written = streamed.write(
            schema,
            to,
            &RuntimeEnv::default(),
            &AtomicBool::new(false),
            receive,
        );
        feeder.join().unwrap();
        written
    }

    /// A grid of `x` (floats) by `y` (integers) whose rows arrive with each
    /// coordinate ascending or descending, a float variable with NULLs and
    /// a count, in C order or, where `band` is given, band by band of so
    /// many `y`s, cut into batches at random rows.
    fn rows(
        draw: &mut Draw,
        band: Option<u64>,
    ) -> (SchemaRef, Vec<(usize, ArrayRef)>, Vec<RecordBatch>) {
        let (nx, ny) = (1 + draw.below(7) as usize, 1 + draw.below(6) as usize);
        let mut xs: Vec<f64> = (0..nx).map(|i| i as f64 * 0.5 - 1.0).collect();
        let mut ys: Vec<i64> = (0..ny).map(|i| 10 * i as i64).collect();
        if draw.below(2) == 1 {
            xs.reverse();
        }
        if draw.below(2) == 1 {
            ys.reverse();
        }
        let schema = Arc::new(Schema::new(vec![
            Field::new("x", DataType::Float64, false),
            Field::new("y", DataType::Int64, false),
            Field::new("v", DataType::Float64, true),
            Field::new("n", DataType::Int64, false),
        ]));
        let cells = nx * ny;
        let x: Vec<f64> = (0..cells).map(|c| xs[c / ny]).collect();
        let y: Vec<i64> = (0..cells).map(|c| ys[c % ny]).collect();
        let v: Vec<Option<f64>> = (0..cells)
            .map(|c| (draw.below(5) != 0).then_some(c as f64 * 1.5))
            .collect();
        let n: Vec<i64> = (0..cells as i64).collect();
        let all = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Float64Array::from(x)),
                Arc::new(Int64Array::from(y)),
                Arc::new(Float64Array::from(v)),
                Arc::new(Int64Array::from(n)),
            ],
        )
        .unwrap();
        let all = match band {
            // Band by band: every x over the band's ys, in C order.
            Some(keys) => {
                let keys = keys.max(1) as usize;
                let order: Vec<u32> = (0..ny)
                    .step_by(keys)
                    .flat_map(|b| {
                        (0..nx).flat_map(move |i| {
                            (b..(b + keys).min(ny)).map(move |j| (i * ny + j) as u32)
                        })
                    })
                    .collect();
                datafusion::arrow::compute::take_record_batch(&all, &UInt32Array::from(order))
                    .unwrap()
            }
            None => all,
        };
        let mut batches = Vec::new();
        let mut start = 0;
        while start < cells {
            let len = (1 + draw.below(5) as usize).min(cells - start);
            batches.push(all.slice(start, len));
            start += len;
        }
        let coords: Vec<(usize, ArrayRef)> = vec![
            (0, Arc::new(Float64Array::from(xs))),
            (1, Arc::new(Int64Array::from(ys))),
        ];
        (schema, coords, batches)
    }

    #[test]
    fn rows_written_as_they_come_make_the_store_collecting_them_makes() {
        let root = std::env::temp_dir().join(format!("zf-rows-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        let mut draw = Draw(0x9e37_79b9_7f4a_7c15);
        let (mut reversed, mut banded) = (0, 0);
        for case in 0..120 {
            // Half the cases band by band of `y`s.
            let band = (case % 2 == 1).then(|| 1 + draw.below(4));
            let (schema, coords, batches) = rows(&mut draw, band);
            let descending = [draw.below(2) == 1, draw.below(2) == 1];
            let chunks = format!("x={},y={}", 1 + draw.below(4), 1 + draw.below(4));
            let grid = RowGrid {
                dims: Some(coords),
                band: band.map(|keys| RowBand { dim: 1, keys }),
                memory: 0,
            };
            let columns = [Some(0), Some(1), Some(2), Some(3)];
            let to = target(&root.join(format!("{case}-streamed.zarr")), &chunks);
            let plan = Streamed::over(grid, &columns, &schema, &[0, 1], &descending, &to)
                .unwrap()
                .expect("ordered coordinates, a float and a count that is never NULL");
            reversed += usize::from(plan.reversed.contains(&true));
            banded += usize::from(plan.banded && plan.slab < plan.shape[1]);
            let written = streamed(&plan, &schema, batches.clone(), &to).unwrap();
            assert_eq!(
                written.cells,
                batches.iter().map(|b| b.num_rows() as u64).sum::<u64>()
            );
            let want = target(&root.join(format!("{case}-collected.zarr")), &chunks);
            collected(&schema, &batches, &descending, &want);
            let (got, want) = (files(&local(&to)), files(&local(&want)));
            assert_eq!(
                got.keys().collect::<Vec<_>>(),
                want.keys().collect::<Vec<_>>(),
                "case {case}"
            );
            assert!(
                got == want,
                "case {case} ({chunks}, descending {descending:?})"
            );
        }
        assert!(
            reversed > 10,
            "{reversed} cases ran against the store's order"
        );
        assert!(banded > 10, "{banded} cases came in more than one band");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn rows_out_of_their_cells_order_or_too_few_fail_and_leave_nothing() {
        let root = std::env::temp_dir().join(format!("zf-rows-bad-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        let mut draw = Draw(7);
        let (schema, coords, batches) = loop {
            let (schema, coords, batches) = rows(&mut draw, None);
            if coords.iter().all(|(_, c)| c.len() >= 3) {
                break (schema, coords, batches);
            }
        };
        let all = datafusion::arrow::compute::concat_batches(&schema, &batches).unwrap();
        let grid = RowGrid {
            dims: Some(coords),
            band: None,
            memory: 0,
        };
        let bands = grid.clone();
        let columns = [Some(0), Some(1), Some(2), Some(3)];
        let to = target(&root.join("out.zarr"), "x=1,y=2");
        let plan = Streamed::over(grid, &columns, &schema, &[0, 1], &[false, false], &to)
            .unwrap()
            .unwrap();
        // Two rows in the middle swapped; the last row missing.
        let n = all.num_rows();
        let mut order: Vec<u32> = (0..n as u32).collect();
        order.swap(n / 2, n / 2 + 1);
        let swapped =
            datafusion::arrow::compute::take_record_batch(&all, &UInt32Array::from(order)).unwrap();
        let err = streamed(&plan, &schema, vec![swapped], &to)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("do not hold the") && err.contains("nothing was written"),
            "{err}"
        );
        let err = streamed(&plan, &schema, vec![all.slice(0, n - 1)], &to)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("gave {} rows for a grid of {n} cells", n - 1)),
            "{err}"
        );
        // Said to come in bands of one `y`, the rows in C order.
        let grid = RowGrid {
            band: Some(RowBand { dim: 1, keys: 1 }),
            ..bands
        };
        let plan = Streamed::over(grid, &columns, &schema, &[0, 1], &[false, false], &to)
            .unwrap()
            .unwrap();
        assert!(plan.describe().ends_with("of y per write (its bands)"));
        let err = streamed(&plan, &schema, vec![all.clone()], &to)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rows 1..2 of the result do not hold the 'y'"),
            "{err}"
        );
        assert!(!local(&to).exists());
        assert!(std::fs::read_dir(&root).unwrap().next().is_none());
        std::fs::remove_dir_all(&root).unwrap();
    }
}

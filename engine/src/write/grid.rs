//! Turning a query result into a grid: the dimension columns give each row
//! its cell, the other columns become dense arrays over those cells.
//!
//! Coordinates are sorted, ascending or, for dimensions asked to (a
//! descending latitude in the source store), descending: the layout never
//! depends on the order rows arrive in. Cells no row reaches, and NULL values, hold the fill value (NaN);
//! two rows on one cell mean the result is not a grid, which is an error.

use std::collections::HashMap;

use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, Float32Array, Float64Array, Int64Array, RecordBatch, UInt32Array,
};
use datafusion::arrow::compute::{cast, concat, interleave, sort_to_indices, take, SortOptions};
use datafusion::arrow::datatypes::{
    DataType, Field, Float32Type, Float64Type, Int64Type, SchemaRef, UInt32Type,
};
use datafusion::common::{exec_err, plan_err, Result};
use zarrfusion_udfs::calendar::Calendar;
use zarrfusion_udfs::complex::{complex_array, complex_part};
use zarrfusion_udfs::model_calendar::{TIME_CALENDAR_METADATA, TIME_UNITS_METADATA};

/// One dimension of the grid.
#[derive(Debug)]
pub struct GridDimension {
    /// The column's name.
    pub name: String,
    /// Its coordinate values, in grid order (the column's type).
    pub coords: ArrayRef,
    /// Attributes its coordinate array gets: the JSON object in the
    /// column's field metadata under [`ZARR_ATTRIBUTES`] (xrft's
    /// `direct_lag` and `spacing` of a frequency coordinate, a registered
    /// table's coordinate's `units`), else none.
    pub attributes: serde_json::Map<String, serde_json::Value>,
    /// The model calendar of its times: the column's field metadata under
    /// [`ZARR_CALENDAR`] (a registered table's coordinate of `noleap`
    /// dates), else none.
    pub calendar: Option<Calendar>,
}

/// The field metadata key naming the model calendar (`noleap`, `360_day`,
/// ...) whose dates a time column holds, which a written coordinate keeps.
pub const ZARR_CALENDAR: &str = zarrfusion_udfs::model_calendar::CALENDAR_METADATA;

/// The model calendar a column's field metadata gives its times
/// ([`ZARR_CALENDAR`]).
pub fn field_calendar(field: &datafusion::arrow::datatypes::Field) -> Option<Calendar> {
    (field.metadata().get(ZARR_CALENDAR)).and_then(|name| Calendar::parse(name))
}

/// The field metadata key whose value (a JSON object) becomes a written
/// coordinate's or variable's Zarr attributes.
pub const ZARR_ATTRIBUTES: &str = "zarr.attributes";

/// The Zarr attributes a column's field metadata gives its array
/// ([`ZARR_ATTRIBUTES`]), none when it gives none; times kept as numbers
/// (a daily `360_day` coordinate, its `date_trunc` or `date_bin`) are
/// written with their units and calendar, so that readers decode them.
pub fn field_attributes(
    field: &datafusion::arrow::datatypes::Field,
) -> serde_json::Map<String, serde_json::Value> {
    let metadata = field.metadata();
    let mut attributes: serde_json::Map<String, serde_json::Value> = metadata
        .get(ZARR_ATTRIBUTES)
        .and_then(|text| serde_json::from_str(text).ok())
        .unwrap_or_default();
    if let (Some(units), Some(calendar)) = (
        metadata.get(TIME_UNITS_METADATA),
        metadata.get(TIME_CALENDAR_METADATA),
    ) {
        attributes.insert("units".into(), units.clone().into());
        attributes.insert("calendar".into(), calendar.clone().into());
    }
    attributes
}

/// The field metadata key marking a column as a dimension for `COPY ...
/// STORED AS ZARR`; its value is the coordinate's order, `ascending` or
/// `descending`.
pub const ZARR_DIMENSION: &str = "zarr.dimension";

/// A dense variable over the grid.
#[derive(Debug)]
pub struct GridVariable {
    /// The column's name.
    pub name: String,
    /// The values in C order over the grid (NaN where missing for floats).
    pub values: ArrayRef,
    /// Attributes its array gets (from the column's field metadata, as a
    /// dimension's).
    pub attributes: serde_json::Map<String, serde_json::Value>,
}

/// A query result laid out as a grid.
#[derive(Debug)]
pub struct Grid {
    /// Dimensions, outermost first.
    pub dims: Vec<GridDimension>,
    /// Variables, in column order.
    pub variables: Vec<GridVariable>,
}

impl Grid {
    /// The grid's shape.
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().map(|d| d.coords.len() as u64).collect()
    }
}

/// Bytes a grid of `cells` cells takes for `schema`'s non-dimension columns
/// (what [`assemble`] allocates besides its input).
pub fn grid_bytes(schema: &SchemaRef, dims: &[usize], cells: u64) -> u64 {
    schema
        .fields()
        .iter()
        .enumerate()
        .filter(|(i, _)| !dims.contains(i))
        .map(|(_, f)| cells * stored_width(f.data_type()))
        .sum()
}

/// Bytes per value a column is written with.
fn stored_width(t: &DataType) -> u64 {
    if let Some(part) = complex_part(t) {
        return 2 * stored_width(part);
    }
    match t {
        DataType::Float32 | DataType::Int32 | DataType::UInt32 => 4,
        DataType::Int8 | DataType::UInt8 | DataType::Boolean => 1,
        DataType::Int16 | DataType::UInt16 | DataType::Float16 => 2,
        _ => 8,
    }
}

/// Positions of each row along one dimension, and the coordinates.
struct Axis {
    coords: ArrayRef,
    /// Per input row, its position along the axis.
    positions: Vec<u32>,
}

/// A dimension column's values as keys: one key, one coordinate (`-0.0`
/// and `0.0` are one), read in place.
enum KeyValues {
    F32(Float32Array),
    F64(Float64Array),
    I64(Int64Array),
}

impl KeyValues {
    /// The keys of dimension column `column` (named `name`); refused when
    /// it holds NULLs or is not of numbers, dates or timestamps.
    fn of(column: &ArrayRef, name: &str) -> Result<Self> {
        if column.null_count() > 0 {
            return plan_err!("cannot write Zarr: dimension column '{name}' has NULL values");
        }
        Ok(match column.data_type() {
            DataType::Float32 => Self::F32(column.as_primitive::<Float32Type>().clone()),
            DataType::Float16 | DataType::Float64 => {
                Self::F64(cast(column, &DataType::Float64)?.as_primitive::<Float64Type>().clone())
            }
            t if t.is_integer() || t.is_temporal() => {
                Self::I64(cast(column, &DataType::Int64)?.as_primitive::<Int64Type>().clone())
            }
            other => {
                return plan_err!(
                    "cannot write Zarr: dimension column '{name}' has type {other}; dimensions must be numbers, dates or timestamps"
                )
            }
        })
    }

    fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::F64(v) => v.len(),
            Self::I64(v) => v.len(),
        }
    }

    /// The key of row `i`.
    fn key(&self, i: usize) -> u64 {
        let float = |v: f64| if v == 0.0 { 0 } else { v.to_bits() };
        match self {
            Self::F32(v) => float(f64::from(v.value(i))),
            Self::F64(v) => float(v.value(i)),
            Self::I64(v) => v.value(i) as u64,
        }
    }

    /// Every row's key, in order.
    fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        (0..self.len()).map(|i| self.key(i))
    }

    /// Gives `f` each row's key in order until it says `false`; whether
    /// it never did.
    fn all(&self, mut f: impl FnMut(u64) -> bool) -> bool {
        let float = |v: f64| if v == 0.0 { 0 } else { v.to_bits() };
        match self {
            Self::F32(v) => v.values().iter().all(|&x| f(float(f64::from(x)))),
            Self::F64(v) => v.values().iter().all(|&x| f(float(x))),
            Self::I64(v) => v.values().iter().all(|&x| f(x as u64)),
        }
    }
}

/// The sorted distinct values of a dimension `column` (its `keys`) and
/// each row's position among them.
fn axis(column: &ArrayRef, keys: &KeyValues, descending: bool) -> Result<Axis> {
    let mut first_seen: Vec<u32> = Vec::new(); // row of each distinct value
    let mut index: HashMap<u64, u32> = HashMap::new();
    let mut ids: Vec<u32> = Vec::with_capacity(keys.len());
    for (row, key) in keys.keys().enumerate() {
        let next = first_seen.len() as u32;
        let id = *index.entry(key).or_insert(next);
        if id == next {
            first_seen.push(row as u32);
        }
        ids.push(id);
    }
    let distinct = take(column, &UInt32Array::from(first_seen), None)?;
    let order = sort_to_indices(
        &distinct,
        Some(SortOptions {
            descending,
            nulls_first: false,
        }),
        None,
    )?;
    let mut rank = vec![0u32; distinct.len()];
    for (position, &id) in order.values().iter().enumerate() {
        rank[id as usize] = position as u32;
    }
    let coords = take(&distinct, &order, None)?;
    let positions = ids.into_iter().map(|id| rank[id as usize]).collect();
    Ok(Axis { coords, positions })
}

/// Lays out `batches` (of `schema`) as a grid over the columns `dims`,
/// with coordinates descending where `descending` says so.
///
/// Rows already in the grid's order, one per cell (a dense reduction's
/// result, or any result sorted so), are recognized in one pass over their
/// keys ([`in_grid_order`]) and their columns become the variables as they
/// are (or, where a dimension runs the other way, reversed along it);
/// other rows find their cells through the coordinates' sorted distinct
/// values. Both give the same grid.
pub fn assemble(
    schema: &SchemaRef,
    batches: &[RecordBatch],
    dims: &[usize],
    descending: &[bool],
) -> Result<Grid> {
    let column = |i: usize| -> Result<ArrayRef> {
        let parts: Vec<&dyn Array> = batches.iter().map(|b| b.column(i).as_ref()).collect();
        if parts.is_empty() {
            return Ok(datafusion::arrow::array::new_empty_array(
                schema.field(i).data_type(),
            ));
        }
        Ok(concat(&parts)?)
    };
    let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
    // The dimension columns are read in place, batch by batch; only rows
    // out of the grid's order are gathered into one column per dimension.
    let parts = (dims.iter())
        .map(|&d| {
            (batches.iter())
                .map(|b| KeyValues::of(b.column(d), names[d]))
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()?;
    let coords = in_grid_order(batches, dims, &parts, descending)?;
    drop(parts);
    let (coords, gather) = match coords {
        Some((coords, reversed)) => {
            let shape: Vec<usize> = coords.iter().map(|c| c.len()).collect();
            let gather = reversed
                .contains(&true)
                .then(|| reversal(&shape, &reversed));
            (coords, gather)
        }
        None => {
            let columns = dims
                .iter()
                .map(|&d| column(d))
                .collect::<Result<Vec<_>>>()?;
            let keys = (columns.iter().zip(dims))
                .map(|(c, &d)| KeyValues::of(c, names[d]))
                .collect::<Result<Vec<_>>>()?;
            let (coords, gather) = scattered(&columns, &keys, descending, dims, &names)?;
            (coords, Some(gather))
        }
    };
    let cells = coords.iter().fold(1usize, |n, c| n.saturating_mul(c.len()));
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    let complete = rows == cells;
    let mut variables = Vec::new();
    for (i, field) in schema.fields().iter().enumerate() {
        if dims.contains(&i) {
            continue;
        }
        let values = column(i)?;
        let target = written_type(field, complete && values.null_count() == 0)?;
        let dense = laid_out(&values, &target, gather.as_ref())?;
        variables.push(GridVariable {
            name: field.name().clone(),
            values: dense,
            attributes: field_attributes(field),
        });
    }
    let dims = dims
        .iter()
        .zip(coords)
        .map(|(&d, coords)| GridDimension {
            name: names[d].to_string(),
            coords,
            attributes: field_attributes(schema.field(d)),
            calendar: field_calendar(schema.field(d)),
        })
        .collect();
    Ok(Grid { dims, variables })
}

/// The type variable column `field` is written as: floats and complex
/// numbers as they are (`float16` as `float32`), integers and booleans
/// (as `uint8`) as they are when `whole` (every cell has a value), else as
/// `float64` (NaN where a cell has none); other types are refused.
pub(crate) fn written_type(field: &Field, whole: bool) -> Result<DataType> {
    Ok(match field.data_type() {
        DataType::Float32 | DataType::Float64 => field.data_type().clone(),
        DataType::Float16 => DataType::Float32,
        t if complex_part(t).is_some() => t.clone(),
        DataType::Boolean if whole => DataType::UInt8,
        t if t.is_integer() && whole => t.clone(),
        t if t.is_integer() || *t == DataType::Boolean => DataType::Float64,
        other => {
            return plan_err!(
                "cannot write Zarr: column '{}' has type {other}; variables must be numbers or booleans",
                field.name()
            )
        }
    })
}

/// A variable column's `values` as written: cast to its `written` type
/// (see [`written_type`]), placed on the cells by `gather` (each cell's
/// row) when they are not in the cells' order, NULLs as NaN.
pub(crate) fn laid_out(
    values: &ArrayRef,
    written: &DataType,
    gather: Option<&UInt32Array>,
) -> Result<ArrayRef> {
    let values = cast(values, written)?;
    let values = match gather {
        Some(gather) => take(&values, gather, None)?,
        None => values,
    };
    match values.null_count() {
        0 => Ok(values),
        _ => fill_nan(&values),
    }
}

/// The grid's coordinates when the rows of `batches` (their dimension
/// columns `dims`, keyed batch by batch as `parts`) are one per cell in its
/// C order: along each dimension, runs of one value whose length divides
/// the run of the dimension before it, the values of each dimension
/// distinct and in the order the grid sorts them (descending where
/// `descending` says so) or in the opposite order (the dimension is then
/// reversed: said beside the coordinates). `None` when they are not (the
/// rows are then placed one by one).
fn in_grid_order(
    batches: &[RecordBatch],
    dims: &[usize],
    parts: &[Vec<KeyValues>],
    descending: &[bool],
) -> Result<Option<(Vec<ArrayRef>, Vec<bool>)>> {
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    if rows == 0 || rows > u32::MAX as usize {
        return Ok(None);
    }
    // Where each row is: its batch and its row there.
    let mut starts = Vec::with_capacity(batches.len());
    let mut start = 0;
    for b in batches {
        starts.push(start);
        start += b.num_rows();
    }
    let place = |row: usize| {
        let b = starts.partition_point(|&s| s <= row) - 1;
        (b, row - starts[b])
    };
    let mut coords = Vec::with_capacity(dims.len());
    let mut reversed = vec![false; dims.len()];
    // Rows per value of each dimension, within the run of the one before.
    let mut span = rows;
    for (d, &column) in dims.iter().enumerate() {
        let (b, i) = place(0);
        let first = parts[d][b].key(i);
        let mut run = 0;
        for part in &parts[d] {
            let counting = |k: u64| {
                let more = run < span && k == first;
                run += usize::from(more);
                more
            };
            if !part.all(counting) {
                break;
            }
        }
        if !span.is_multiple_of(run) {
            return Ok(None);
        }
        let length = span / run;
        // Every row holds the value of its place along the dimension.
        let at: Vec<(usize, usize)> = (0..length).map(|j| place(j * run)).collect();
        let values: Vec<u64> = at.iter().map(|&(b, i)| parts[d][b].key(i)).collect();
        let mut expected = values.iter().cycle();
        let (mut want, mut left) = (0, 0);
        let placed = parts[d].iter().all(|part| {
            part.all(|k| {
                if left == 0 {
                    want = expected.next().copied().unwrap_or(u64::MAX);
                    left = run;
                }
                left -= 1;
                k == want
            })
        });
        let distinct = values
            .iter()
            .collect::<std::collections::HashSet<_>>()
            .len()
            == length;
        if !placed || !distinct {
            return Ok(None);
        }
        let columns: Vec<&dyn Array> = batches.iter().map(|b| b.column(column).as_ref()).collect();
        let coordinate = interleave(&columns, &at)?;
        let order = sort_to_indices(
            &coordinate,
            Some(SortOptions {
                descending: descending[d],
                nulls_first: false,
            }),
            None,
        )?;
        let sorted = order.values();
        let forward = (sorted.iter().enumerate()).all(|(j, &i)| i as usize == j);
        let backward = (sorted.iter().enumerate()).all(|(j, &i)| i as usize == length - 1 - j);
        match (forward, backward) {
            (true, _) => coords.push(coordinate),
            (false, true) => {
                coords.push(take(&coordinate, &order, None)?);
                reversed[d] = true;
            }
            (false, false) => return Ok(None),
        }
        span = run;
    }
    Ok((span == 1).then_some((coords, reversed)))
}

/// Per cell of a grid of `shape` in C order, the row that fills it, for
/// rows in C order along every dimension but those `reversed`, which run
/// the other way.
pub(crate) fn reversal(shape: &[usize], reversed: &[bool]) -> UInt32Array {
    let cells = shape.iter().product::<usize>();
    let mut strides = vec![1usize; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    let mut rows = Vec::with_capacity(cells);
    let mut position = vec![0usize; shape.len()];
    for _ in 0..cells {
        let row = (position.iter().zip(shape).zip(&strides).zip(reversed))
            .map(|(((&p, &n), &stride), &back)| (if back { n - 1 - p } else { p }) * stride)
            .sum::<usize>();
        rows.push(row as u32);
        // The next cell: the odometer turns, innermost first.
        for d in (0..shape.len()).rev() {
            position[d] += 1;
            if position[d] < shape[d] {
                break;
            }
            position[d] = 0;
        }
    }
    UInt32Array::from(rows)
}

/// The grid's coordinates (each dimension's distinct values, sorted) and,
/// per cell in C order, the row that fills it (none: a gap), for rows in
/// any order; two rows on one cell are refused.
fn scattered(
    columns: &[ArrayRef],
    keys: &[KeyValues],
    descending: &[bool],
    dims: &[usize],
    names: &[&str],
) -> Result<(Vec<ArrayRef>, UInt32Array)> {
    let axes = (columns.iter().zip(keys))
        .zip(descending)
        .map(|((c, k), &desc)| axis(c, k, desc))
        .collect::<Result<Vec<_>>>()?;
    let shape: Vec<usize> = axes.iter().map(|a| a.coords.len()).collect();
    // Cells are addressed with u32 (as rows are): a larger grid is refused
    // before any cell number is computed.
    let Some(cells) = shape
        .iter()
        .try_fold(1usize, |acc, &n| acc.checked_mul(n))
        .filter(|&c| c <= u32::MAX as usize)
    else {
        return exec_err!(
            "cannot write Zarr: the grid {shape:?} has more cells than one write can hold"
        );
    };
    let rows = keys.first().map_or(0, KeyValues::len);
    // Cell of each row, in C order.
    let mut cell = vec![0u32; rows];
    let mut stride = 1usize;
    for (a, len) in axes.iter().zip(&shape).rev() {
        for (c, p) in cell.iter_mut().zip(&a.positions) {
            *c += *p * stride as u32;
        }
        stride *= len;
    }
    // Which row fills each cell; a second row on a cell is not a grid.
    let mut source = vec![u32::MAX; cells];
    for (row, &c) in cell.iter().enumerate() {
        let slot = &mut source[c as usize];
        if *slot != u32::MAX {
            let at: Vec<String> = dims
                .iter()
                .zip(&axes)
                .map(|(&d, a)| {
                    let value = datafusion::arrow::util::display::array_value_to_string(
                        &a.coords,
                        a.positions[row] as usize,
                    )
                    .unwrap_or_default();
                    format!("{}={value}", names[d])
                })
                .collect();
            return plan_err!(
                "cannot write Zarr: the result is not a grid over ({}): two rows at {}",
                dims.iter()
                    .map(|&d| names[d])
                    .collect::<Vec<_>>()
                    .join(", "),
                at.join(", ")
            );
        }
        *slot = row as u32;
    }
    let gather = datafusion::arrow::array::PrimitiveArray::<UInt32Type>::from_iter(
        source.iter().map(|&r| (r != u32::MAX).then_some(r)),
    );
    Ok((axes.into_iter().map(|a| a.coords).collect(), gather))
}

/// Replaces NULLs of a float or complex array by NaN (the Zarr fill value).
fn fill_nan(values: &ArrayRef) -> Result<ArrayRef> {
    use datafusion::arrow::array::{Float32Array, Float64Array};
    Ok(match values.data_type() {
        t if complex_part(t).is_some() => {
            // A NULL complex value: both parts NaN.
            let parts = values.as_struct();
            let nan_where_null = |part: &ArrayRef| -> Result<ArrayRef> {
                let part = datafusion::arrow::array::make_array(
                    part.to_data()
                        .into_builder()
                        .nulls(parts.nulls().cloned())
                        .build()?,
                );
                fill_nan(&part)
            };
            std::sync::Arc::new(complex_array(
                nan_where_null(parts.column(0))?,
                nan_where_null(parts.column(1))?,
                None,
            ))
        }
        DataType::Float32 => std::sync::Arc::new(Float32Array::from_iter_values(
            values
                .as_primitive::<datafusion::arrow::datatypes::Float32Type>()
                .iter()
                .map(|v| v.unwrap_or(f32::NAN)),
        )),
        _ => std::sync::Arc::new(Float64Array::from_iter_values(
            values
                .as_primitive::<Float64Type>()
                .iter()
                .map(|v| v.unwrap_or(f64::NAN)),
        )),
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use datafusion::arrow::array::{Float32Array, Int64Array};
    use datafusion::arrow::datatypes::{Field, Schema};

    use super::*;

    #[test]
    fn rows_land_on_their_cells_and_gaps_are_nan() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("y", DataType::Float32, false),
            Field::new("x", DataType::Int64, false),
            Field::new("v", DataType::Float32, true),
            Field::new("n", DataType::Int64, true),
        ]));
        // y is asked to descend; x appears unsorted; (y=1, x=20) is missing.
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Float32Array::from(vec![2.0, 2.0, 1.0, 2.0, 1.0])),
                Arc::new(Int64Array::from(vec![30, 10, 10, 20, 30])),
                Arc::new(Float32Array::from(vec![
                    Some(1.0),
                    Some(2.0),
                    None,
                    Some(4.0),
                    Some(5.0),
                ])),
                Arc::new(Int64Array::from(vec![1, 2, 3, 4, 5])),
            ],
        )
        .unwrap();
        let grid = assemble(
            &schema,
            std::slice::from_ref(&batch),
            &[0, 1],
            &[true, false],
        )
        .unwrap();
        assert_eq!(grid.shape(), vec![2, 3]);
        let y = grid.dims[0]
            .coords
            .as_primitive::<datafusion::arrow::datatypes::Float32Type>();
        assert_eq!(y.values().to_vec(), vec![2.0, 1.0]);
        let x = grid.dims[1].coords.as_primitive::<Int64Type>();
        assert_eq!(x.values().to_vec(), vec![10, 20, 30]);
        let v = grid.variables[0]
            .values
            .as_primitive::<datafusion::arrow::datatypes::Float32Type>();
        let v: Vec<f32> = v.values().to_vec();
        assert_eq!(&v[..3], &[2.0, 4.0, 1.0]);
        assert!(v[3].is_nan() && v[4].is_nan() && v[5] == 5.0);
        // An integer variable with a gap becomes float64 with NaN.
        assert_eq!(grid.variables[1].values.data_type(), &DataType::Float64);
        // A duplicate cell is not a grid.
        let twice =
            assemble(&schema, &[batch.clone(), batch], &[0, 1], &[true, false]).unwrap_err();
        assert!(twice.to_string().contains("not a grid"), "{twice}");
    }

    /// Rows of a grid of `shape` in C order (dimension `d` descending
    /// where `descending[d]`): dimension columns `d0`, `d1`, ... (float64,
    /// int64, timestamps by turn) and a variable `v` (NULL where `holes`
    /// says), the cell numbers of the rows kept.
    fn grid_rows(
        shape: &[usize],
        descending: &[bool],
        holes: &[bool],
    ) -> (SchemaRef, Vec<ArrayRef>) {
        use datafusion::arrow::array::{Float64Array, TimestampSecondArray};
        use datafusion::arrow::datatypes::{Field, Schema, TimeUnit};
        let cells: usize = shape.iter().product();
        let mut fields = Vec::new();
        let mut columns: Vec<ArrayRef> = Vec::new();
        for (d, &n) in shape.iter().enumerate() {
            let stride: usize = shape[d + 1..].iter().product();
            let place = |c: usize| {
                let j = (c / stride % n) as i64;
                if descending[d] {
                    n as i64 - 1 - j
                } else {
                    j
                }
            };
            let name = format!("d{d}");
            let (field, column): (Field, ArrayRef) = match d % 3 {
                0 => (
                    Field::new(name, DataType::Float64, false),
                    Arc::new(Float64Array::from_iter_values(
                        (0..cells).map(|c| place(c) as f64 * 0.5 - 1.0),
                    )),
                ),
                1 => (
                    Field::new(name, DataType::Int64, false),
                    Arc::new(Int64Array::from_iter_values(
                        (0..cells).map(|c| place(c) * 7),
                    )),
                ),
                _ => (
                    Field::new(name, DataType::Timestamp(TimeUnit::Second, None), false),
                    Arc::new(TimestampSecondArray::from_iter_values(
                        (0..cells).map(|c| place(c) * 3600),
                    )),
                ),
            };
            fields.push(field);
            columns.push(column);
        }
        fields.push(Field::new("v", DataType::Float64, true));
        columns.push(Arc::new(Float64Array::from_iter(
            (0..cells).map(|c| (!holes[c % holes.len()]).then_some(c as f64 * 1.25)),
        )));
        (Arc::new(Schema::new(fields)), columns)
    }

    /// Whether the rows of `batch` are in the order of the grid over `dims`
    /// (laid out as they are).
    fn in_order_of(batch: &RecordBatch, dims: &[usize], descending: &[bool]) -> bool {
        // Each row a batch of its own, after an empty one: runs cross the
        // batches' edges, and empty batches start where the next one does.
        let batches: Vec<RecordBatch> = (0..batch.num_rows())
            .flat_map(|i| [batch.slice(i, 0), batch.slice(i, 1)])
            .collect();
        let parts: Vec<Vec<KeyValues>> = (dims.iter())
            .map(|&d| {
                batches
                    .iter()
                    .map(|b| KeyValues::of(b.column(d), "d").unwrap())
                    .collect()
            })
            .collect();
        let one = in_grid_order(
            std::slice::from_ref(batch),
            dims,
            &(dims.iter())
                .map(|&d| vec![KeyValues::of(batch.column(d), "d").unwrap()])
                .collect::<Vec<_>>(),
            descending,
        )
        .unwrap();
        let many = in_grid_order(&batches, dims, &parts, descending).unwrap();
        assert_eq!(one.is_some(), many.is_some());
        one.is_some()
    }

    /// The grid's coordinates and values as comparable numbers.
    fn laid_out(grid: &Grid) -> (Vec<String>, Vec<u64>) {
        let coords = (grid.dims.iter())
            .map(|d| format!("{} {:?}", d.name, d.coords))
            .collect();
        let values = grid.variables[0].values.as_primitive::<Float64Type>();
        (
            coords,
            values.values().iter().map(|v| v.to_bits()).collect(),
        )
    }

    proptest::proptest! {
        #[test]
        fn rows_in_grid_order_are_laid_out_as_rows_in_any_order(
            shape in proptest::collection::vec(1usize..5, 1..4),
            flags in proptest::collection::vec(proptest::bool::ANY, 3),
            holes in proptest::collection::vec(proptest::bool::weighted(0.2), 1..7),
            seed in 0u64..1000,
            drop in proptest::option::of(0usize..64),
        ) {
            let descending = &flags[..shape.len()];
            let (schema, columns) = grid_rows(&shape, descending, &holes);
            let dims: Vec<usize> = (0..shape.len()).collect();
            let cells = columns[0].len();
            // Rows in order, then shuffled, then with a row left out.
            let mut order: Vec<u32> = (0..cells as u32).collect();
            let in_order = RecordBatch::try_new(Arc::clone(&schema), columns.clone()).unwrap();
            let ordered = assemble(&schema, std::slice::from_ref(&in_order), &dims, descending).unwrap();
            proptest::prop_assert!(in_order_of(&in_order, &dims, descending));
            let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            for i in (1..order.len()).rev() {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                order.swap(i, (state >> 33) as usize % (i + 1));
            }
            let taken = |rows: &[u32]| {
                let at = UInt32Array::from(rows.to_vec());
                let cols = columns.iter().map(|c| take(c, &at, None).unwrap()).collect();
                RecordBatch::try_new(Arc::clone(&schema), cols).unwrap()
            };
            let shuffled = assemble(&schema, &[taken(&order)], &dims, descending).unwrap();
            proptest::prop_assert_eq!(laid_out(&ordered), laid_out(&shuffled));
            // A dimension asked the other way round: the rows are still
            // laid out in one pass, that dimension reversed.
            if let Some(d) = (0..dims.len()).find(|&d| shape[d] > 1) {
                let mut other = descending.to_vec();
                other[d] = !other[d];
                proptest::prop_assert!(in_order_of(&in_order, &dims, &other));
                let flipped = assemble(&schema, std::slice::from_ref(&in_order), &dims, &other).unwrap();
                let shuffled = assemble(&schema, &[taken(&order)], &dims, &other).unwrap();
                proptest::prop_assert_eq!(laid_out(&flipped), laid_out(&shuffled));
            }
            // A row left out: a gap where it was, unless its values left
            // with it (a grid of fewer cells, in order or not).
            if let Some(gone) = drop.filter(|_| cells > 1).map(|k| k % cells) {
                let kept: Vec<u32> = (0..cells as u32).filter(|&c| c as usize != gone).collect();
                let batch = taken(&kept);
                let fast = in_order_of(&batch, &dims, descending);
                let with_gap = assemble(&schema, std::slice::from_ref(&batch), &dims, descending).unwrap();
                let reversed: Vec<u32> = kept.iter().rev().copied().collect();
                let any_order = assemble(&schema, &[taken(&reversed)], &dims, descending).unwrap();
                proptest::prop_assert_eq!(laid_out(&with_gap), laid_out(&any_order));
                if with_gap.shape() == ordered.shape() {
                    proptest::prop_assert!(!fast);
                    proptest::prop_assert!(f64::from_bits(laid_out(&with_gap).1[gone]).is_nan());
                }
            }
            // Two rows swapped along a dimension of three values or more:
            // neither way round.
            if shape[shape.len() - 1] >= 3 {
                let mut swapped: Vec<u32> = (0..cells as u32).collect();
                swapped.swap(0, 1);
                proptest::prop_assert!(!in_order_of(&taken(&swapped), &dims, descending));
            }
            // The rows twice are not a grid, in order or not.
            let twice = assemble(&schema, &[in_order.clone(), in_order], &dims, descending).unwrap_err();
            proptest::prop_assert!(twice.to_string().contains("not a grid"));
        }
    }
}

//! Turning a query result into a grid: the dimension columns give each row
//! its cell, the other columns become dense arrays over those cells.
//!
//! Coordinates are sorted, ascending or, for dimensions asked to (a
//! descending latitude in the source store), descending: the layout never
//! depends on the order rows arrive in. Cells no row reaches, and NULL values, hold the fill value (NaN);
//! two rows on one cell mean the result is not a grid, which is an error.

use std::collections::HashMap;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, RecordBatch, UInt32Array};
use datafusion::arrow::compute::{cast, concat, sort_to_indices, take, SortOptions};
use datafusion::arrow::datatypes::{DataType, Float64Type, Int64Type, SchemaRef, UInt32Type};
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

/// Keys of a dimension column's values for hashing.
fn keys(column: &ArrayRef, name: &str) -> Result<Vec<u64>> {
    if column.null_count() > 0 {
        return plan_err!("cannot write Zarr: dimension column '{name}' has NULL values");
    }
    Ok(match column.data_type() {
        DataType::Float16 | DataType::Float32 | DataType::Float64 => {
            let f = cast(column, &DataType::Float64)?;
            f.as_primitive::<Float64Type>()
                .values()
                .iter()
                // -0.0 and 0.0 are one coordinate.
                .map(|v| if *v == 0.0 { 0 } else { v.to_bits() })
                .collect()
        }
        t if t.is_integer() || t.is_temporal() => {
            let i = cast(column, &DataType::Int64)?;
            i.as_primitive::<Int64Type>()
                .values()
                .iter()
                .map(|&v| v as u64)
                .collect()
        }
        other => {
            return plan_err!(
                "cannot write Zarr: dimension column '{name}' has type {other}; dimensions must be numbers, dates or timestamps"
            )
        }
    })
}

fn axis(column: &ArrayRef, name: &str, descending: bool) -> Result<Axis> {
    let keys = keys(column, name)?;
    let mut first_seen: Vec<u32> = Vec::new(); // row of each distinct value
    let mut index: HashMap<u64, u32> = HashMap::new();
    let mut ids: Vec<u32> = Vec::with_capacity(keys.len());
    for (row, key) in keys.iter().enumerate() {
        let next = first_seen.len() as u32;
        let id = *index.entry(*key).or_insert(next);
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
    let axes = dims
        .iter()
        .zip(descending)
        .map(|(&d, &desc)| column(d).and_then(|c| axis(&c, names[d], desc)))
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
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
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
    let complete = rows == cells;
    let gather = datafusion::arrow::array::PrimitiveArray::<UInt32Type>::from_iter(
        source.iter().map(|&r| (r != u32::MAX).then_some(r)),
    );
    let mut variables = Vec::new();
    for (i, field) in schema.fields().iter().enumerate() {
        if dims.contains(&i) {
            continue;
        }
        let values = column(i)?;
        let target = match field.data_type() {
            DataType::Float32 | DataType::Float64 => field.data_type().clone(),
            DataType::Float16 => DataType::Float32,
            t if complex_part(t).is_some() => t.clone(),
            DataType::Boolean if complete && values.null_count() == 0 => DataType::UInt8,
            t if t.is_integer() && complete && values.null_count() == 0 => t.clone(),
            t if t.is_integer() || *t == DataType::Boolean => DataType::Float64,
            other => {
                return plan_err!(
                    "cannot write Zarr: column '{}' has type {other}; variables must be numbers or booleans",
                    field.name()
                )
            }
        };
        let values = cast(&values, &target)?;
        let dense = if complete && values.null_count() == 0 {
            take(&values, &gather, None)?
        } else {
            fill_nan(&take(&values, &gather, None)?)?
        };
        variables.push(GridVariable {
            name: field.name().clone(),
            values: dense,
            attributes: field_attributes(field),
        });
    }
    let dims = dims
        .iter()
        .zip(axes)
        .map(|(&d, a)| GridDimension {
            name: names[d].to_string(),
            coords: a.coords,
            attributes: field_attributes(schema.field(d)),
            calendar: field_calendar(schema.field(d)),
        })
        .collect();
    Ok(Grid { dims, variables })
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
}

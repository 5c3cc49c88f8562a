//! Complex numbers in Arrow: a struct of two floats, `re` and `im`.
//!
//! Arrow has no complex type. zarrfusion represents a complex64 value as
//! `Struct<re: Float32, im: Float32>` and a complex128 value as
//! `Struct<re: Float64, im: Float64>`; SQL reads the parts as `z['re']` and
//! `z['im']`, and `COPY ... STORED AS ZARR` writes such a column as a
//! complex Zarr array.

use datafusion::arrow::array::{ArrayRef, StructArray};
use datafusion::arrow::buffer::NullBuffer;
use datafusion::arrow::datatypes::{DataType, Field, Fields};

/// The fields of a complex struct whose parts have type `part`.
pub fn complex_fields(part: DataType) -> Fields {
    Fields::from(vec![
        Field::new("re", part.clone(), false),
        Field::new("im", part, false),
    ])
}

/// The Arrow type of complex numbers whose parts have type `part`
/// (`Float32` for complex64, `Float64` for complex128).
pub fn complex_type(part: DataType) -> DataType {
    DataType::Struct(complex_fields(part))
}

/// The part type of a complex Arrow type, or `None` for any other type.
pub fn complex_part(data_type: &DataType) -> Option<&DataType> {
    match data_type {
        DataType::Struct(fields)
            if fields.len() == 2
                && fields[0].name() == "re"
                && fields[1].name() == "im"
                && fields[0].data_type() == fields[1].data_type()
                && matches!(fields[0].data_type(), DataType::Float32 | DataType::Float64) =>
        {
            Some(fields[0].data_type())
        }
        _ => None,
    }
}

/// A complex column from its real and imaginary parts (same type and
/// length) and the rows that are NULL.
pub fn complex_array(re: ArrayRef, im: ArrayRef, nulls: Option<NullBuffer>) -> StructArray {
    let fields = complex_fields(re.data_type().clone());
    StructArray::new(fields, vec![re, im], nulls)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn complex_types_are_recognised() {
        let t = complex_type(DataType::Float32);
        assert_eq!(complex_part(&t), Some(&DataType::Float32));
        let other = DataType::Struct(Fields::from(vec![
            Field::new("re", DataType::Float32, false),
            Field::new("im", DataType::Float64, false),
        ]));
        assert_eq!(complex_part(&other), None);
        assert_eq!(complex_part(&DataType::Float64), None);
    }
}

//! Decoding array values the way `xarray.open_zarr` does with its defaults.
//!
//! A [`ColumnDecoder`] is built once per array from its metadata and turns
//! the decoded bytes of any subset into an Arrow array:
//!
//! | stored as | attributes | column |
//! |---|---|---|
//! | float16/32/64 | | Float32/Float64, NaN as NULL |
//! | any number | `_FillValue`, `missing_value` (v2: also the zarr `fill_value`) | Float32/Float64, those values as NULL |
//! | any number | `scale_factor`, `add_offset` | Float64 (Float32 when both are absent and the source is small), unpacked |
//! | any number | `units: <unit> since <date>`, any CF `calendar` | Timestamp(ns), via [`zarrfusion_udfs::cf_time`] (dates of model calendars by their fields) |
//! | numpy datetime64 / timedelta64 | | Timestamp(ns) / Duration(ns), NaT as NULL |
//! | integers, bool | | themselves |
//! | string, fixed-length UTF-32 | | Utf8 |
//! | complex64 / complex128 | | `Struct<re, im>` of Float32 / Float64 ([`zarrfusion_udfs::complex`]) |

use std::sync::Arc;

use datafusion::arrow::array::{
    ArrayRef, BooleanArray, DurationNanosecondArray, Float32Array, Float64Array, PrimitiveArray,
    StringArray, TimestampNanosecondArray,
};
use datafusion::arrow::buffer::{BooleanBuffer, Buffer, NullBuffer, ScalarBuffer};
use datafusion::arrow::datatypes::{
    ArrowNativeType, ArrowPrimitiveType, DataType, Float32Type, Float64Type, Int16Type, Int32Type,
    Int64Type, Int8Type, TimeUnit as ArrowTimeUnit, UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};
use serde_json::{Map, Value};
use zarrfusion_udfs::cf_time::{is_supported_calendar, CfTime, TimeUnit};
use zarrfusion_udfs::complex::{complex_array, complex_type};
use zarrs::array::data_type::{
    BoolDataType, Complex128DataType, Complex64DataType, FixedLengthUTF32DataType, Float16DataType,
    Float32DataType, Float64DataType, Int16DataType, Int32DataType, Int64DataType, Int8DataType,
    NumpyDateTime64DataType, NumpyTimeDelta64DataType, NumpyTimeUnit, StringDataType,
    UInt16DataType, UInt32DataType, UInt64DataType, UInt8DataType,
};
use zarrs::array::DataType as ZarrDataType;

/// How values are stored in the array (after the codecs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StoredType {
    /// `bool`
    Bool,
    /// `int8`
    Int8,
    /// `int16`
    Int16,
    /// `int32`
    Int32,
    /// `int64`
    Int64,
    /// `uint8`
    UInt8,
    /// `uint16`
    UInt16,
    /// `uint32`
    UInt32,
    /// `uint64`
    UInt64,
    /// `float16`
    Float16,
    /// `float32`
    Float32,
    /// `float64`
    Float64,
    /// `complex64`: two float32.
    Complex64,
    /// `complex128`: two float64.
    Complex128,
    /// numpy `datetime64`, with nanoseconds per stored unit.
    DateTime64(i64),
    /// numpy `timedelta64`, with nanoseconds per stored unit.
    TimeDelta64(i64),
    /// Variable-length UTF-8 strings.
    String,
    /// numpy `<U n`: fixed-length UTF-32 strings, with the bytes per item.
    FixedUtf32(usize),
}

impl StoredType {
    /// Classifies a zarrs data type, or names it as unsupported.
    pub fn from_zarr(data_type: &ZarrDataType) -> Result<Self, String> {
        macro_rules! classify {
            ($($zarr:ty => $stored:expr),* $(,)?) => {
                $(if data_type.is::<$zarr>() { return Ok($stored); })*
            };
        }
        classify!(
            BoolDataType => Self::Bool,
            Int8DataType => Self::Int8,
            Int16DataType => Self::Int16,
            Int32DataType => Self::Int32,
            Int64DataType => Self::Int64,
            UInt8DataType => Self::UInt8,
            UInt16DataType => Self::UInt16,
            UInt32DataType => Self::UInt32,
            UInt64DataType => Self::UInt64,
            Float16DataType => Self::Float16,
            Float32DataType => Self::Float32,
            Float64DataType => Self::Float64,
            Complex64DataType => Self::Complex64,
            Complex128DataType => Self::Complex128,
            StringDataType => Self::String,
        );
        if let Some(dt) = data_type.downcast_ref::<FixedLengthUTF32DataType>() {
            return Ok(Self::FixedUtf32(dt.length_bytes().get() as usize));
        }
        if let Some(dt) = data_type.downcast_ref::<NumpyDateTime64DataType>() {
            return numpy_unit_nanos(dt.unit, dt.scale_factor.get()).map(Self::DateTime64);
        }
        if let Some(dt) = data_type.downcast_ref::<NumpyTimeDelta64DataType>() {
            return numpy_unit_nanos(dt.unit, dt.scale_factor.get()).map(Self::TimeDelta64);
        }
        Err(format!("unsupported data type '{data_type}'"))
    }

    /// True for the integer and floating point types.
    pub fn is_numeric(self) -> bool {
        !matches!(
            self,
            Self::Bool
                | Self::Complex64
                | Self::Complex128
                | Self::String
                | Self::FixedUtf32(_)
                | Self::DateTime64(_)
                | Self::TimeDelta64(_)
        )
    }

    fn is_small(self) -> bool {
        matches!(
            self,
            Self::Int8 | Self::Int16 | Self::UInt8 | Self::UInt16 | Self::Float16 | Self::Float32
        )
    }

    fn is_float(self) -> bool {
        matches!(self, Self::Float16 | Self::Float32 | Self::Float64)
    }
}

fn numpy_unit_nanos(unit: NumpyTimeUnit, scale: u32) -> Result<i64, String> {
    let nanos: i64 = match unit {
        NumpyTimeUnit::Week => 7 * 86_400_000_000_000,
        NumpyTimeUnit::Day => 86_400_000_000_000,
        NumpyTimeUnit::Hour => 3_600_000_000_000,
        NumpyTimeUnit::Minute => 60_000_000_000,
        NumpyTimeUnit::Second => 1_000_000_000,
        NumpyTimeUnit::Millisecond => 1_000_000,
        NumpyTimeUnit::Microsecond => 1_000,
        NumpyTimeUnit::Nanosecond => 1,
        other => return Err(format!("unsupported numpy time unit {other:?}")),
    };
    Ok(nanos * i64::from(scale))
}

/// What the stored numbers mean.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Meaning {
    /// The values themselves (floats: NaN as NULL).
    Plain,
    /// Masked and/or packed numbers, unpacked to a float column.
    Unpacked { scale: f64, offset: f64, wide: bool },
    /// CF time: units since a reference date.
    Time(CfTime),
    /// CF duration: a count of units.
    Duration(TimeUnit),
}

/// Turns decoded array bytes into an Arrow column, applying CF conventions.
#[derive(Debug, Clone)]
pub struct ColumnDecoder {
    stored: StoredType,
    meaning: Meaning,
    /// What the values mean as numbers (`meaning`, unless they are times
    /// or durations).
    numbers: Meaning,
    /// Stored values that mean "missing" (`_FillValue`, `missing_value`, v2 `fill_value`).
    missing: Vec<f64>,
    data_type: DataType,
}

/// Reads a number from an attribute, including the strings `NaN`, `Infinity`, `-Infinity`.
fn attr_number(value: &Value) -> Option<f64> {
    match value {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => match s.as_str() {
            "NaN" | "nan" => Some(f64::NAN),
            "Infinity" | "inf" => Some(f64::INFINITY),
            "-Infinity" | "-inf" => Some(f64::NEG_INFINITY),
            _ => s.parse().ok().or_else(|| base64_number(s)),
        },
        Value::Array(items) => items.iter().filter_map(attr_number).next(),
        _ => None,
    }
}

/// xarray writes a float `_FillValue` of a Zarr v3 array as the base64 text
/// of its little-endian bytes (`"AAAAAAAA+H8="` is a float64 NaN).
fn base64_number(text: &str) -> Option<f64> {
    use base64::Engine;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(text)
        .ok()?;
    match bytes.len() {
        8 => Some(f64::from_le_bytes(bytes.try_into().ok()?)),
        4 => Some(f64::from(f32::from_le_bytes(bytes.try_into().ok()?))),
        2 => Some(half::f16::from_le_bytes(bytes.try_into().ok()?).to_f64()),
        _ => None,
    }
}

fn attr_numbers(value: &Value) -> Vec<f64> {
    match value {
        Value::Array(items) => items.iter().filter_map(attr_number).collect(),
        other => attr_number(other).into_iter().collect(),
    }
}

impl ColumnDecoder {
    /// Builds the decoder for an array from its stored type, attributes and,
    /// for Zarr v2, its `fill_value` (which xarray uses as a mask).
    pub fn new(
        stored: StoredType,
        attributes: &Map<String, Value>,
        v2_fill_value: Option<&Value>,
    ) -> Result<Self, String> {
        let mut missing = Vec::new();
        if stored.is_numeric() {
            for key in ["_FillValue", "missing_value"] {
                if let Some(v) = attributes.get(key) {
                    missing.extend(attr_numbers(v));
                }
            }
            if let Some(v) = v2_fill_value {
                missing.extend(attr_number(v));
            }
        }
        let units = attributes.get("units").and_then(Value::as_str);
        let calendar = attributes.get("calendar").and_then(Value::as_str);
        let scale = attributes.get("scale_factor").and_then(attr_number);
        let offset = attributes.get("add_offset").and_then(attr_number);
        // The numbers themselves, when they are no time or duration.
        let numbers = if !stored.is_numeric() {
            Meaning::Plain
        } else if scale.is_some() || offset.is_some() || !missing.is_empty() {
            // xarray's _choose_float_dtype: attribute numbers are Python floats
            // (float64); without them, small sources unpack to float32.
            let wide = scale.is_some() || offset.is_some() || !stored.is_small();
            Meaning::Unpacked {
                scale: scale.unwrap_or(1.0),
                offset: offset.unwrap_or(0.0),
                wide,
            }
        } else {
            Meaning::Plain
        };
        let meaning = if !stored.is_numeric() {
            Meaning::Plain
        } else if let Some(time) = units
            .map(|u| parse_time(u, calendar))
            .transpose()?
            .flatten()
        {
            Meaning::Time(time)
        } else if let Some(unit) = duration_unit(units, attributes) {
            Meaning::Duration(unit)
        } else {
            numbers
        };
        Ok(Self::with_meaning(stored, meaning, numbers, missing))
    }

    /// The decoder of `stored` values that mean `meaning` (`numbers` when
    /// they are taken as numbers).
    fn with_meaning(
        stored: StoredType,
        meaning: Meaning,
        numbers: Meaning,
        missing: Vec<f64>,
    ) -> Self {
        let data_type = match (meaning, stored) {
            (Meaning::Time(_), _) | (Meaning::Plain, StoredType::DateTime64(_)) => {
                DataType::Timestamp(ArrowTimeUnit::Nanosecond, None)
            }
            (Meaning::Duration(_), _) | (Meaning::Plain, StoredType::TimeDelta64(_)) => {
                DataType::Duration(ArrowTimeUnit::Nanosecond)
            }
            (Meaning::Unpacked { wide: true, .. }, _) => DataType::Float64,
            (Meaning::Unpacked { wide: false, .. }, _) => DataType::Float32,
            (Meaning::Plain, s) => match s {
                StoredType::Bool => DataType::Boolean,
                StoredType::Int8 => DataType::Int8,
                StoredType::Int16 => DataType::Int16,
                StoredType::Int32 => DataType::Int32,
                StoredType::Int64 => DataType::Int64,
                StoredType::UInt8 => DataType::UInt8,
                StoredType::UInt16 => DataType::UInt16,
                StoredType::UInt32 => DataType::UInt32,
                StoredType::UInt64 => DataType::UInt64,
                StoredType::Float16 | StoredType::Float32 => DataType::Float32,
                StoredType::Float64 => DataType::Float64,
                StoredType::Complex64 => complex_type(DataType::Float32),
                StoredType::Complex128 => complex_type(DataType::Float64),
                StoredType::String | StoredType::FixedUtf32(_) => DataType::Utf8,
                StoredType::DateTime64(_) | StoredType::TimeDelta64(_) => unreachable!(),
            },
        };
        Self {
            stored,
            meaning,
            numbers,
            missing,
            data_type,
        }
    }

    /// The dates it decodes, when they are of a calendar some of whose
    /// days have no timestamp (`360_day`, `all_leap`, `julian`; see
    /// [`Self::keeping_numbers`]).
    pub fn dates_lacking_timestamps(&self) -> Option<&CfTime> {
        match &self.meaning {
            Meaning::Time(time) if time.calendar().lacks_gregorian_days() => Some(time),
            _ => None,
        }
    }

    /// This decoder with times and durations kept as their numbers (as
    /// xarray's `decode_times=False`).
    pub fn keeping_numbers(&self) -> Self {
        Self::with_meaning(
            self.stored,
            self.numbers,
            self.numbers,
            self.missing.clone(),
        )
    }

    /// The stored type.
    pub fn stored(&self) -> StoredType {
        self.stored
    }

    /// The Arrow type of the decoded column.
    pub fn data_type(&self) -> &DataType {
        &self.data_type
    }

    /// Bytes a decoded cell holds at the peak of decoding: the stored
    /// element (`stored_size` bytes) and, when decoding converts rather
    /// than adopting the stored buffer, the Arrow value as well.
    pub fn peak_bytes_per_cell(&self, stored_size: usize) -> usize {
        let adopted = match self.meaning {
            Meaning::Plain => self.stored.is_numeric() && self.stored != StoredType::Float16,
            _ => self.nan_scan().is_some(),
        };
        let width = self.data_type.primitive_width().unwrap_or(16);
        if adopted {
            stored_size.max(width)
        } else {
            stored_size + width
        }
    }

    /// Decodes native-endian fixed-size element bytes into a column.
    ///
    /// Plain numbers become the column's buffer without a copy when the
    /// allocation is aligned for their type.
    pub fn decode_fixed(&self, owned: Vec<u8>) -> Result<ArrayRef, String> {
        let buffer = if owned.as_ptr().align_offset(8) == 0 {
            Buffer::from_vec(owned)
        } else {
            Buffer::from_slice_ref(&owned)
        };
        self.decode_buffer(buffer, None)
    }

    /// The stored float type whose NaNs become NULLs in a column that adopts
    /// the stored buffer, if that is how this array decodes: a reader that
    /// scans the bytes while they are in cache passes what it found to
    /// [`Self::decode_buffer`].
    pub fn nan_scan(&self) -> Option<StoredType> {
        let adopts = match self.meaning {
            Meaning::Plain => true,
            Meaning::Unpacked {
                scale,
                offset,
                wide,
            } => {
                scale == 1.0
                    && offset == 0.0
                    && self.missing.iter().all(|m| m.is_nan())
                    && wide == (self.stored == StoredType::Float64)
            }
            _ => false,
        };
        (adopts && matches!(self.stored, StoredType::Float32 | StoredType::Float64))
            .then_some(self.stored)
    }

    /// Decodes native-endian fixed-size element bytes, aligned for 8-byte
    /// types, into a column. `has_nan` is what a scan for NaN found (see
    /// [`Self::nan_scan`]); `None` scans here.
    pub fn decode_buffer(&self, buffer: Buffer, has_nan: Option<bool>) -> Result<ArrayRef, String> {
        let bytes = buffer.as_slice();
        match self.meaning {
            Meaning::Plain => self.decode_plain(buffer, has_nan),
            Meaning::Unpacked {
                scale,
                offset,
                wide,
            } => {
                if self.nan_scan().is_some() {
                    return Ok(match self.stored {
                        StoredType::Float32 => {
                            nan_as_null::<Float32Type>(buffer, has_nan, f32::is_nan)
                        }
                        _ => nan_as_null::<Float64Type>(buffer, has_nan, f64::is_nan),
                    });
                }
                let values = self.to_f64(bytes);
                let valid =
                    BooleanBuffer::collect_bool(values.len(), |i| self.valid(values[i]).is_some());
                let nulls = Some(NullBuffer::new(valid)).filter(|n| n.null_count() > 0);
                let unpacked = values.iter().map(|v| v * scale + offset);
                Ok(if wide {
                    Arc::new(Float64Array::new(unpacked.collect(), nulls))
                } else {
                    Arc::new(Float32Array::new(
                        unpacked.map(|v| v as f32).collect(),
                        nulls,
                    ))
                })
            }
            Meaning::Time(time) => {
                let out: TimestampNanosecondArray = if self.stored.is_float() {
                    self.to_f64(bytes)
                        .into_iter()
                        .map(|v| self.valid(v).map(|v| time.decode_f64(v)).transpose())
                        .collect::<Result<_, _>>()
                } else {
                    self.to_i64(bytes)
                        .into_iter()
                        .map(|v| self.valid_int(v).map(|v| time.decode_i64(v)).transpose())
                        .collect::<Result<_, _>>()
                }
                .map_err(|e| e.to_string())?;
                Ok(Arc::new(out))
            }
            Meaning::Duration(unit) => {
                let nanos = unit.nanos();
                let out: DurationNanosecondArray = if self.stored.is_float() {
                    self.to_f64(bytes)
                        .into_iter()
                        .map(|v| Ok(self.valid(v).map(|v| (v * nanos as f64).round() as i64)))
                        .collect::<Result<_, String>>()
                } else {
                    self.to_i64(bytes)
                        .into_iter()
                        .map(|v| {
                            self.valid_int(v)
                                .map(|v| {
                                    v.checked_mul(nanos).ok_or_else(|| {
                                        format!("duration {v} overflows timedelta64[ns]")
                                    })
                                })
                                .transpose()
                        })
                        .collect::<Result<_, String>>()
                }?;
                Ok(Arc::new(out))
            }
        }
    }

    /// Decodes variable-length strings into a column.
    pub fn decode_strings(&self, strings: Vec<String>) -> ArrayRef {
        Arc::new(StringArray::from(strings))
    }

    fn is_missing(&self, v: f64) -> bool {
        self.missing
            .iter()
            .any(|m| *m == v || (m.is_nan() && v.is_nan()))
    }

    fn valid(&self, v: f64) -> Option<f64> {
        (!(v.is_nan() || self.is_missing(v))).then_some(v)
    }

    /// An encoded integer time, unless it is missing or numpy's NaT (`i64::MIN`).
    fn valid_int(&self, v: i64) -> Option<i64> {
        (v != i64::MIN && !self.is_missing(v as f64)).then_some(v)
    }

    /// The stored numbers as `f64`, one typed loop per stored type.
    fn to_f64(&self, bytes: &[u8]) -> Vec<f64> {
        macro_rules! convert {
            ($t:ty) => {
                bytes
                    .chunks_exact(std::mem::size_of::<$t>())
                    .map(|c| <$t>::from_ne_bytes(c.try_into().unwrap()) as f64)
                    .collect()
            };
        }
        match self.stored {
            StoredType::Int8 => convert!(i8),
            StoredType::Int16 => convert!(i16),
            StoredType::Int32 => convert!(i32),
            StoredType::Int64 => convert!(i64),
            StoredType::UInt8 => convert!(u8),
            StoredType::UInt16 => convert!(u16),
            StoredType::UInt32 => convert!(u32),
            StoredType::UInt64 => convert!(u64),
            StoredType::Float16 => bytes
                .as_chunks::<2>()
                .0
                .iter()
                .map(|c| half::f16::from_ne_bytes(*c).to_f64())
                .collect(),
            StoredType::Float32 => convert!(f32),
            StoredType::Float64 => convert!(f64),
            _ => Vec::new(),
        }
    }

    /// The stored integers as `i64`, one typed loop per stored type.
    fn to_i64(&self, bytes: &[u8]) -> Vec<i64> {
        macro_rules! convert {
            ($t:ty) => {
                bytes
                    .chunks_exact(std::mem::size_of::<$t>())
                    .map(|c| <$t>::from_ne_bytes(c.try_into().unwrap()) as i64)
                    .collect()
            };
        }
        match self.stored {
            StoredType::Int8 => convert!(i8),
            StoredType::Int16 => convert!(i16),
            StoredType::Int32 => convert!(i32),
            StoredType::Int64 => convert!(i64),
            StoredType::UInt8 => convert!(u8),
            StoredType::UInt16 => convert!(u16),
            StoredType::UInt32 => convert!(u32),
            StoredType::UInt64 => convert!(u64),
            _ => Vec::new(),
        }
    }

    fn decode_plain(&self, buffer: Buffer, has_nan: Option<bool>) -> Result<ArrayRef, String> {
        let bytes = buffer.as_slice();
        Ok(match self.stored {
            StoredType::Bool => Arc::new(BooleanArray::from(
                bytes.iter().map(|b| *b != 0).collect::<Vec<_>>(),
            )),
            StoredType::Int8 => primitive::<Int8Type>(buffer.clone()),
            StoredType::Int16 => primitive::<Int16Type>(buffer.clone()),
            StoredType::Int32 => primitive::<Int32Type>(buffer.clone()),
            StoredType::Int64 => primitive::<Int64Type>(buffer.clone()),
            StoredType::UInt8 => primitive::<UInt8Type>(buffer.clone()),
            StoredType::UInt16 => primitive::<UInt16Type>(buffer.clone()),
            StoredType::UInt32 => primitive::<UInt32Type>(buffer.clone()),
            StoredType::UInt64 => primitive::<UInt64Type>(buffer.clone()),
            StoredType::Float16 => Arc::new(
                bytes
                    .as_chunks::<2>()
                    .0
                    .iter()
                    .map(|c| {
                        let v = half::f16::from_ne_bytes(*c).to_f32();
                        (!v.is_nan()).then_some(v)
                    })
                    .collect::<Float32Array>(),
            ),
            StoredType::Float32 => nan_as_null::<Float32Type>(buffer.clone(), has_nan, f32::is_nan),
            StoredType::Float64 => nan_as_null::<Float64Type>(buffer.clone(), has_nan, f64::is_nan),
            StoredType::Complex64 => complex_column::<Float32Type, 4>(bytes, f32::from_ne_bytes),
            StoredType::Complex128 => complex_column::<Float64Type, 8>(bytes, f64::from_ne_bytes),
            StoredType::DateTime64(nanos) => Arc::new(
                self.nat_as_null(bytes, nanos)?
                    .collect::<TimestampNanosecondArray>(),
            ),
            StoredType::TimeDelta64(nanos) => Arc::new(
                self.nat_as_null(bytes, nanos)?
                    .collect::<DurationNanosecondArray>(),
            ),
            StoredType::FixedUtf32(item_bytes) => {
                let strings: Vec<String> = bytes
                    .chunks_exact(item_bytes.max(4))
                    .map(|item| {
                        item.as_chunks::<4>()
                            .0
                            .iter()
                            .map(|c| u32::from_ne_bytes(*c))
                            .take_while(|c| *c != 0)
                            .map(|c| char::from_u32(c).unwrap_or('\u{fffd}'))
                            .collect()
                    })
                    .collect();
                Arc::new(StringArray::from(strings))
            }
            StoredType::String => return Err("strings are not fixed-size".into()),
        })
    }

    fn nat_as_null<'a>(
        &self,
        bytes: &'a [u8],
        nanos: i64,
    ) -> Result<impl Iterator<Item = Option<i64>> + 'a, String> {
        let values: Vec<Option<i64>> = bytes
            .as_chunks::<8>()
            .0
            .iter()
            .map(|c| i64::from_ne_bytes(*c))
            .map(|v| {
                if v == i64::MIN {
                    Ok(None)
                } else {
                    v.checked_mul(nanos)
                        .map(Some)
                        .ok_or_else(|| format!("time value {v} overflows datetime64[ns]"))
                }
            })
            .collect::<Result<_, _>>()?;
        Ok(values.into_iter())
    }
}

fn parse_time(units: &str, calendar: Option<&str>) -> Result<Option<CfTime>, String> {
    if let Some(cal) = calendar {
        if !is_supported_calendar(cal) {
            // None of CF's calendars (xarray fails to decode it): the numbers.
            log::warn!("calendar '{cal}' is not supported; keeping raw numbers");
            return Ok(None);
        }
    }
    CfTime::parse(units, calendar).map_err(|e| e.to_string())
}

/// The attributes xarray shows (`.attrs`) of an array decoded into a
/// column of `data_type`: the array's own less those its decoding used,
/// which xarray keeps in `.encoding` (fill and missing values, packing,
/// `_Unsigned`, `dtype`, the dimension names, `coordinates`; a time's or
/// duration's `units` and `calendar`), and zarrs' mark of its writes.
pub fn decoded_attributes(
    attributes: &Map<String, Value>,
    data_type: &DataType,
) -> Map<String, Value> {
    const ENCODING: [&str; 9] = [
        "_FillValue",
        "missing_value",
        "scale_factor",
        "add_offset",
        "_Unsigned",
        "dtype",
        "_ARRAY_DIMENSIONS",
        "coordinates",
        "_zarrs",
    ];
    let time = matches!(
        data_type,
        DataType::Timestamp(..) | DataType::Date32 | DataType::Date64 | DataType::Duration(_)
    );
    (attributes.iter())
        .filter(|(key, _)| !ENCODING.contains(&key.as_str()))
        .filter(|(key, _)| !(time && matches!(key.as_str(), "units" | "calendar")))
        .map(|(key, value)| (key.clone(), value.clone()))
        .collect()
}

/// xarray decodes a CF duration when the variable was encoded from timedelta64
/// (it records `dtype: timedelta64[...]`) and `units` is a plain time unit.
fn duration_unit(units: Option<&str>, attributes: &Map<String, Value>) -> Option<TimeUnit> {
    let from_timedelta = attributes
        .get("dtype")
        .and_then(Value::as_str)
        .is_some_and(|d| d.starts_with("timedelta64"));
    if from_timedelta {
        units.and_then(TimeUnit::parse)
    } else {
        None
    }
}

/// Native-endian bytes, aligned for `T`, as a buffer of `T` (no copy).
fn typed_buffer<T: ArrowNativeType>(buffer: Buffer) -> ScalarBuffer<T> {
    let n = buffer.len() / std::mem::size_of::<T>();
    ScalarBuffer::new(buffer, 0, n)
}

/// Interleaved (real, imaginary) pairs as a complex struct column, each
/// part read from its native-endian bytes by `read`.
fn complex_column<T: ArrowPrimitiveType, const WIDTH: usize>(
    bytes: &[u8],
    read: impl Fn([u8; WIDTH]) -> T::Native,
) -> ArrayRef {
    // Values of WIDTH bytes, real and imaginary parts in turn (a trailing
    // half pair ignored).
    let (values, _) = bytes.as_chunks::<WIDTH>();
    let values = &values[..values.len() / 2 * 2];
    let part = |offset: usize| {
        let values: Vec<T::Native> = values
            .iter()
            .skip(offset)
            .step_by(2)
            .map(|v| read(*v))
            .collect();
        Arc::new(PrimitiveArray::<T>::new(ScalarBuffer::from(values), None)) as ArrayRef
    };
    Arc::new(complex_array(part(0), part(1), None))
}

fn primitive<T: ArrowPrimitiveType>(buffer: Buffer) -> ArrayRef {
    Arc::new(PrimitiveArray::<T>::new(typed_buffer(buffer), None))
}

/// Whether any of `values` is NaN.
pub fn any_nan<T: Copy>(values: &[T], is_nan: impl Fn(T) -> bool) -> bool {
    // Blocks of lanes without an early exit inside, so the scan vectorizes.
    values
        .chunks(64)
        .any(|block| block.iter().fold(false, |nan, v| nan | is_nan(*v)))
}

fn nan_as_null<T: ArrowPrimitiveType>(
    buffer: Buffer,
    has_nan: Option<bool>,
    is_nan: impl Fn(T::Native) -> bool + Copy,
) -> ArrayRef {
    let values = typed_buffer::<T::Native>(buffer);
    let has_nan = has_nan.unwrap_or_else(|| any_nan(&values, is_nan));
    let nulls = has_nan.then(|| {
        NullBuffer::new(BooleanBuffer::collect_bool(values.len(), |i| {
            !is_nan(values[i])
        }))
    });
    Arc::new(PrimitiveArray::<T>::new(values, nulls))
}

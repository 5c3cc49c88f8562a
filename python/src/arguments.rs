//! Python arguments as the engine's values: sizes, counts, thread counts,
//! row counts and option maps, each refused with a `ValueError` or
//! `TypeError` naming the argument.

use std::collections::HashMap;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict};
use zarrfusion::config::MAX_THREADS;

/// A size given as a number of bytes or a string such as `"2GB"`.
pub fn size_argument(name: &str, value: &Bound<'_, PyAny>) -> PyResult<usize> {
    if let Ok(bytes) = value.extract::<usize>() {
        if bytes == 0 {
            // As `parse_size` refuses "0".
            return Err(PyValueError::new_err(format!(
                "{name}: a size of 0 bytes; give at least 1"
            )));
        }
        return Ok(bytes);
    }
    let text: String = value.extract().map_err(|_| {
        PyValueError::new_err(format!(
            "{name}: expected a size like '2GB' or a number of bytes"
        ))
    })?;
    zarrfusion::memory::parse_size(&text).map_err(|e| PyValueError::new_err(format!("{name}: {e}")))
}

/// A non-negative integer argument (a Python `int`, or anything with
/// `__index__` such as numpy's integers): a `ValueError` naming `name` when
/// it is negative or past 2^64 - 1, a `TypeError` when it is no integer.
pub fn count_argument(name: &str, value: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(n) = value.extract::<u64>() {
        return Ok(n);
    }
    match value.call_method0("__index__") {
        Ok(n) => Err(PyValueError::new_err(format!(
            "{name}: must be an integer from 0 to 2^64 - 1, got {n}"
        ))),
        Err(_) => Err(PyTypeError::new_err(format!(
            "{name}: expected an integer, got {}",
            value
                .repr()
                .map_or_else(|_| "?".to_string(), |r| r.to_string())
        ))),
    }
}

/// [`count_argument`] as a thread count: at most [`MAX_THREADS`].
pub fn threads_argument(name: &str, value: &Bound<'_, PyAny>) -> PyResult<usize> {
    let n = count_argument(name, value)?;
    match usize::try_from(n) {
        Ok(n) if n <= MAX_THREADS => Ok(n),
        _ => Err(PyValueError::new_err(format!(
            "{name}: {n} threads asked for; at most {MAX_THREADS}"
        ))),
    }
}

/// Keyword options as the strings SQL `OPTIONS` takes (`True` is `'true'`).
pub fn string_options(options: Option<&Bound<'_, PyDict>>) -> PyResult<HashMap<String, String>> {
    let mut out = HashMap::new();
    if let Some(options) = options {
        for (key, value) in options.iter() {
            let text = if value.is_instance_of::<PyBool>() {
                value.extract::<bool>()?.to_string()
            } else {
                value.str()?.to_string()
            };
            out.insert(key.extract::<String>()?, text);
        }
    }
    Ok(out)
}

/// A number of rows given from Python (`argument` names it in the error):
/// 0 to 2^63 - 1, as DataFusion plans limits in `i64`.
pub fn rows_argument(argument: &str, value: i128) -> PyResult<usize> {
    usize::try_from(value)
        .ok()
        .filter(|&v| i64::try_from(v).is_ok())
        .ok_or_else(|| {
            PyValueError::new_err(format!(
                "{argument} must be from 0 to {} (2^63 - 1), got {value}",
                i64::MAX
            ))
        })
}

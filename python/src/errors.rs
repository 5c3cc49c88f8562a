//! Engine errors as Python exceptions: bad arguments are `ValueError`,
//! everything else `zarrfusion.ZarrFusionError`, carrying the engine's
//! message (which names the store, array and chunk).

use datafusion::error::DataFusionError;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::PyErr;
use zarrfusion::windows::WindowError;

pyo3::create_exception!(
    zarrfusion,
    ZarrFusionError,
    PyException,
    "An error from the zarrfusion engine: bad SQL, unreadable data, a refused plan."
);

/// A DataFusion error as a Python exception.
pub fn datafusion_error(e: DataFusionError) -> PyErr {
    ZarrFusionError::new_err(e.to_string())
}

/// A zarrfusion error as a Python exception.
pub fn engine_error(e: zarrfusion::ZarrFusionError) -> PyErr {
    match e {
        zarrfusion::ZarrFusionError::Invalid(message) => PyValueError::new_err(message),
        other => ZarrFusionError::new_err(other.to_string()),
    }
}

/// A window error as a Python exception.
pub fn window_error(e: WindowError) -> PyErr {
    match e {
        WindowError::Argument { .. } => PyValueError::new_err(e.to_string()),
        WindowError::Data(inner) => engine_error(inner),
        other => ZarrFusionError::new_err(other.to_string()),
    }
}

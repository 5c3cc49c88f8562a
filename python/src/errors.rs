//! Engine errors as Python exceptions (the classes of
//! `zarrfusion.errors`): bad arguments are `ValueError`; an unreadable
//! store, array or chunk is `ZarrDataError` (an `OSError`); a plan refused
//! for `allowed_mem` is `ZarrMemoryError` (a `MemoryError`); a location
//! the session may not reach is `ZarrPermissionError` (a
//! `PermissionError`, its `store` the location); the rest is
//! `ZarrFusionError`. Each carries the engine's message and, where the
//! engine knows them, `store`, `array`, `chunk` and `key`.

use datafusion::arrow::error::ArrowError;
use datafusion::error::DataFusionError;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use zarrfusion::windows::WindowError;
use zarrfusion::ZarrFusionError;

/// Which Python class an error becomes.
#[derive(Debug, Clone, Copy)]
enum Kind {
    General,
    Data,
    Memory,
    Permission,
}

impl Kind {
    fn class(self) -> &'static str {
        match self {
            Kind::General => "ZarrFusionError",
            Kind::Data => "ZarrDataError",
            Kind::Memory => "ZarrMemoryError",
            Kind::Permission => "ZarrPermissionError",
        }
    }
}

/// Where an error happened, as far as the engine knows.
#[derive(Debug, Default)]
struct Location {
    store: Option<String>,
    array: Option<String>,
    chunk: Option<Vec<u64>>,
    key: Option<String>,
}

impl Location {
    fn of(e: &ZarrFusionError) -> Self {
        match e {
            ZarrFusionError::Store { store, .. } => Self {
                store: Some(store.clone()),
                ..Self::default()
            },
            ZarrFusionError::Array { store, array, .. } => Self {
                store: Some(store.clone()),
                array: Some(array.clone()),
                ..Self::default()
            },
            ZarrFusionError::Chunk {
                store,
                array,
                chunk,
                key,
                ..
            } => Self {
                store: Some(store.clone()),
                array: Some(array.clone()),
                chunk: Some(chunk.clone()),
                key: Some(key.clone()),
            },
            ZarrFusionError::Forbidden { location, .. } => Self {
                store: Some(location.clone()),
                ..Self::default()
            },
            ZarrFusionError::Invalid(_) | ZarrFusionError::Internal(_) => Self::default(),
        }
    }
}

/// An exception of class `kind` of `zarrfusion.errors`, with `message` and
/// `location` as attributes.
fn raise(kind: Kind, message: String, location: Location) -> PyErr {
    Python::attach(|py| {
        let made = (|| -> PyResult<PyErr> {
            let class = py.import("zarrfusion.errors")?.getattr(kind.class())?;
            let kwargs = PyDict::new(py);
            kwargs.set_item("store", location.store)?;
            kwargs.set_item("array", location.array)?;
            kwargs.set_item("chunk", location.chunk)?;
            kwargs.set_item("key", location.key)?;
            Ok(PyErr::from_value(class.call((&message,), Some(&kwargs))?))
        })();
        made.unwrap_or_else(|e| {
            PyRuntimeError::new_err(format!("{message} (and raising it failed: {e})"))
        })
    })
}

/// The zarrfusion error a DataFusion error carries, if any (through
/// contexts, shared errors and Arrow's external errors).
fn engine_error_in(e: &DataFusionError) -> Option<&ZarrFusionError> {
    match e {
        DataFusionError::External(inner) => inner.downcast_ref::<ZarrFusionError>(),
        DataFusionError::ArrowError(inner, _) => match inner.as_ref() {
            ArrowError::ExternalError(inner) => inner.downcast_ref::<ZarrFusionError>(),
            _ => None,
        },
        DataFusionError::Context(_, inner) => engine_error_in(inner),
        DataFusionError::Shared(inner) => engine_error_in(inner),
        _ => None,
    }
}

/// Whether a DataFusion error is a refusal for memory (through contexts
/// and shared errors).
fn is_memory_refusal(e: &DataFusionError) -> bool {
    match e {
        DataFusionError::ResourcesExhausted(_) => true,
        DataFusionError::Context(_, inner) => is_memory_refusal(inner),
        DataFusionError::Shared(inner) => is_memory_refusal(inner),
        _ => false,
    }
}

/// The Python class of a zarrfusion error.
fn kind_of(e: &ZarrFusionError) -> Kind {
    match e {
        ZarrFusionError::Invalid(_) | ZarrFusionError::Internal(_) => Kind::General,
        ZarrFusionError::Forbidden { .. } => Kind::Permission,
        _ => Kind::Data,
    }
}

/// A DataFusion error as a Python exception.
pub fn datafusion_error(e: DataFusionError) -> PyErr {
    let message = e.to_string();
    if let Some(inner) = engine_error_in(&e) {
        return raise(kind_of(inner), message, Location::of(inner));
    }
    let kind = if is_memory_refusal(&e) {
        Kind::Memory
    } else {
        Kind::General
    };
    raise(kind, message, Location::default())
}

/// A zarrfusion error as a Python exception.
pub fn engine_error(e: ZarrFusionError) -> PyErr {
    match e {
        ZarrFusionError::Invalid(message) => PyValueError::new_err(message),
        other => raise(kind_of(&other), other.to_string(), Location::of(&other)),
    }
}

/// A window error as a Python exception.
pub fn window_error(e: WindowError) -> PyErr {
    match e {
        WindowError::Argument { .. } => PyValueError::new_err(e.to_string()),
        WindowError::Data(inner) => engine_error(inner),
        WindowError::Read(message) => raise(Kind::Data, message, Location::default()),
        // As Python's `threading` says it.
        WindowError::Resources(message) => PyRuntimeError::new_err(message),
        other => raise(Kind::General, other.to_string(), Location::default()),
    }
}

/// A `ZarrFusionError` with `message` and no location.
pub fn general_error(message: impl Into<String>) -> PyErr {
    raise(Kind::General, message.into(), Location::default())
}

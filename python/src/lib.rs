//! Python bindings of zarrfusion: the `zarrfusion._zarrfusion` extension
//! module. The Python package `zarrfusion` is a thin layer over it.
//!
//! | module | Python class |
//! |---|---|
//! | [`context`] | `SessionContext`: registering stores, SQL, opening datasets |
//! | [`dataframe`] | `DataFrame`: building, running and exporting queries (Arrow C stream) |
//! | [`windows`] | `Dataset`, `Windows`, `WindowLoader`: the ML window loader |
//! | [`runtime`] | the Tokio runtime, waiting with the GIL released, Ctrl-C |

// Input must never panic: no unwrap, expect or panic outside tests;
// an invariant proven where it is used is written without them.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod arguments;
mod context;
mod dataframe;
mod errors;
mod runtime;
mod windows;

use pyo3::prelude::*;

/// mimalloc keeps freed chunk buffers for reuse instead of handing them back
/// to the system at once, so decoding a store does not page-fault on every
/// chunk (about a fifth of the time of a full pass with the system allocator).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// HTTP requests sent to object stores since the process started, and
/// those answered with an error the client retried (5xx, 429, 408, or a
/// failure in transport), and those answered `304 Not Modified` (objects
/// an opening took from its cache): `{"requests": n, "errors": m,
/// "not_modified": k}`.
#[pyfunction]
fn network_stats() -> std::collections::HashMap<&'static str, u64> {
    let stats = zarrfusion::zarr::network_stats();
    [
        ("requests", stats.requests),
        ("errors", stats.errors),
        ("not_modified", stats.not_modified),
    ]
    .into()
}

/// The extension module.
#[pymodule]
fn _zarrfusion(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<context::PySessionContext>()?;
    m.add_class::<dataframe::PyDataFrame>()?;
    m.add_class::<dataframe::PyRecordBatchStream>()?;
    m.add_class::<windows::PyDataset>()?;
    m.add_class::<windows::PyWindows>()?;
    m.add_class::<windows::PyWindowLoader>()?;
    m.add_class::<windows::PyBatchIterator>()?;
    m.add_function(wrap_pyfunction!(network_stats, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

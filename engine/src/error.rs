//! Errors at the library's edge.
//!
//! Every error about data names where it happened: the store, and where it
//! applies the array and the chunk. They convert into DataFusion errors so
//! they travel through query execution unchanged.

use datafusion::error::DataFusionError;

/// The result type of this crate.
pub type Result<T, E = ZarrFusionError> = std::result::Result<T, E>;

/// An error reading or interpreting a Zarr store.
#[derive(Debug, thiserror::Error)]
pub enum ZarrFusionError {
    /// The store could not be opened (missing path, unreachable URL, no metadata).
    #[error("store '{store}': {message}")]
    Store {
        /// The store's location as the user gave it.
        store: String,
        /// What went wrong.
        message: String,
    },
    /// An array's metadata is missing, malformed or unsupported.
    #[error("store '{store}', array '{array}': {message}")]
    Array {
        /// The store's location.
        store: String,
        /// The array's path inside the store.
        array: String,
        /// What went wrong.
        message: String,
    },
    /// A chunk could not be read or decoded.
    #[error("store '{store}', array '{array}', chunk {chunk:?} (key '{key}'): {message}")]
    Chunk {
        /// The store's location.
        store: String,
        /// The array's path inside the store.
        array: String,
        /// The chunk's grid indices.
        chunk: Vec<u64>,
        /// The chunk's store key.
        key: String,
        /// What went wrong.
        message: String,
    },
    /// The user asked for something the store does not have (a dimension set, an option).
    #[error("{0}")]
    Invalid(String),
}

impl ZarrFusionError {
    /// An error about the whole store.
    pub fn store(store: impl Into<String>, message: impl std::fmt::Display) -> Self {
        Self::Store {
            store: store.into(),
            message: message.to_string(),
        }
    }

    /// An error about one array of a store.
    pub fn array(
        store: impl Into<String>,
        array: impl Into<String>,
        message: impl std::fmt::Display,
    ) -> Self {
        Self::Array {
            store: store.into(),
            array: array.into(),
            message: message.to_string(),
        }
    }
}

impl From<ZarrFusionError> for DataFusionError {
    fn from(e: ZarrFusionError) -> Self {
        DataFusionError::External(Box::new(e))
    }
}

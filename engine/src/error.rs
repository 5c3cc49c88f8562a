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
    /// A location the session may not reach
    /// (`zarrfusion.allowed_locations`), or an option that would reach
    /// past the locations it may.
    #[error("location '{location}': {message}")]
    Forbidden {
        /// The location as the user gave it.
        location: String,
        /// Why it was refused.
        message: String,
    },
    /// The user asked for something the store does not have (a dimension set, an option).
    #[error("{0}")]
    Invalid(String),
    /// A bug in zarrfusion, not in the input: a worker thread panicked
    /// ([`Panicked`]).
    #[error("{0}")]
    Internal(String),
}

impl ZarrFusionError {
    /// A location refused to the session.
    pub fn forbidden(location: impl Into<String>, message: impl std::fmt::Display) -> Self {
        Self::Forbidden {
            location: location.into(),
            message: message.to_string(),
        }
    }

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

/// A panic caught in a worker thread (a bug), turned into an error for
/// whoever waits on that thread's work, instead of a hang or an abort.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("internal error: a {what} panicked: {message}")]
pub struct Panicked {
    /// The work that panicked (`"loader thread"`, `"task"`).
    pub what: String,
    /// The panic's message.
    pub message: String,
}

impl From<Panicked> for String {
    fn from(p: Panicked) -> Self {
        p.to_string()
    }
}

impl From<Panicked> for ZarrFusionError {
    fn from(p: Panicked) -> Self {
        Self::Internal(p.to_string())
    }
}

impl From<Panicked> for DataFusionError {
    fn from(p: Panicked) -> Self {
        DataFusionError::Internal(p.to_string())
    }
}

/// Runs `work`, turning a panic in it into [`Panicked`] naming `what`.
pub fn catch_panic<T>(what: &str, work: impl FnOnce() -> T) -> Result<T, Panicked> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)).map_err(|payload| {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(no message)".to_string());
        Panicked {
            what: what.to_string(),
            message,
        }
    })
}

/// Locks a mutex whose data stays valid if a holder panicked (a panic is
/// turned into an error elsewhere; the data behind the lock is whole).
pub(crate) fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_an_error_naming_the_work_and_the_message() {
        assert_eq!(catch_panic("task", || 7), Ok(7));
        let index = 9;
        let err = catch_panic("task", || -> u8 { panic!("index {index} out of range") });
        assert_eq!(
            err.unwrap_err().to_string(),
            "internal error: a task panicked: index 9 out of range"
        );
        let err = catch_panic("loader thread", || -> u8 { std::panic::panic_any(3u8) });
        assert_eq!(err.unwrap_err().message, "(no message)");
    }
}

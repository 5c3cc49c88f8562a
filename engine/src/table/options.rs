//! Options of a Zarr table, from `OPTIONS (...)`, `read_zarr` arguments or
//! the Rust and Python APIs.
//!
//! | option | meaning |
//! |---|---|
//! | `dims` | the dimension set to expose, e.g. `'lat,lon'` (default: the one with the most dimensions) |
//! | `group` | a group inside the store, e.g. `'atmosphere/surface'` |
//! | `pushdown` | `'false'` turns filter pushdown off (for checking results; default `'true'`) |
//! | `open_cache` | `'false'` opens an object-store table without the opening cache (default: the session's `zarrfusion.open_cache`, `true`) |
//! | `aws.*`, `gcp.*`, `azure.*`, `http.*` | object-store settings, as in `datafusion-cli` |
//! | `retry.*`, `client.*` | the object store's retries and HTTP client: `retry.max_retries`, `retry.retry_timeout`, `retry.backoff.init_backoff`, `retry.backoff.max_backoff`, `retry.backoff.base`, `client.timeout`, `client.connect_timeout`, ... |

use std::collections::HashMap;

use datafusion::common::config::ConfigOptions;

use crate::config::ZarrConfig;
use crate::error::{Result, ZarrFusionError};
use crate::zarr::{is_object_store_option, AllowedLocations};

/// Parsed table options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZarrTableOptions {
    /// The dimension set to expose; `None` picks the one with the most dimensions.
    pub dims: Option<Vec<String>>,
    /// A group below the store's root.
    pub group: Option<String>,
    /// Whether filters on dimensions are pushed into the scan.
    pub pushdown: bool,
    /// Whether an object-store table is opened with the opening cache
    /// ([`crate::zarr::Opening`]); `None`: the session's setting.
    pub open_cache: Option<bool>,
    /// Object-store settings (`aws.region`, ...), passed through.
    pub storage: HashMap<String, String>,
    /// The session's object-store settings (`zarrfusion.retry.*`,
    /// `zarrfusion.client.*`), under `storage` when a store is built.
    pub storage_defaults: HashMap<String, String>,
    /// The locations the session may reach (`zarrfusion.allowed_locations`).
    pub allowed: AllowedLocations,
}

impl Default for ZarrTableOptions {
    fn default() -> Self {
        Self {
            dims: None,
            group: None,
            pushdown: true,
            open_cache: None,
            storage: HashMap::new(),
            storage_defaults: HashMap::new(),
            allowed: AllowedLocations::default(),
        }
    }
}

impl ZarrTableOptions {
    /// Parses options given as key/value pairs. Unknown keys are an error.
    pub fn from_map(options: &HashMap<String, String>) -> Result<Self> {
        let mut parsed = Self::default();
        for (key, value) in options {
            let lower = key.to_ascii_lowercase();
            let short = lower
                .strip_prefix("format.")
                .or_else(|| lower.strip_prefix("zarr."))
                .unwrap_or(&lower);
            match short {
                "dims" => parsed.dims = Some(parse_dims(value)?),
                "group" => parsed.group = Some(value.trim_matches('/').to_string()),
                "pushdown" => {
                    parsed.pushdown = value.parse().map_err(|_| {
                        ZarrFusionError::Invalid(format!(
                            "option pushdown must be 'true' or 'false', got '{value}'"
                        ))
                    })?
                }
                "open_cache" => {
                    parsed.open_cache = Some(value.parse().map_err(|_| {
                        ZarrFusionError::Invalid(format!(
                            "option open_cache must be 'true' or 'false', got '{value}'"
                        ))
                    })?)
                }
                _ if is_object_store_option(&lower) => {
                    parsed.storage.insert(lower.clone(), value.clone());
                }
                _ => {
                    return Err(ZarrFusionError::Invalid(format!(
                        "unknown Zarr table option '{short}' (known: dims, group, pushdown, open_cache, aws.*, gcp.*, azure.*, http.*, retry.*, client.*)"
                    )))
                }
            }
        }
        Ok(parsed)
    }

    /// These options with the session's object-store settings and opening
    /// cache as defaults (see [`ZarrConfig::object_store_defaults`]), held
    /// to the session's allowed locations.
    pub fn with_session(mut self, config: &ConfigOptions) -> Result<Self> {
        let zarr = ZarrConfig::of(config);
        self.storage_defaults = zarr.object_store_defaults();
        self.open_cache = self.open_cache.or(Some(zarr.open_cache));
        self.allowed = zarr.allowed()?;
        Ok(self)
    }

    /// Whether the opening cache is used: the table's option, else the
    /// session's setting, else yes.
    pub fn uses_open_cache(&self) -> bool {
        self.open_cache.unwrap_or(true)
    }
}

/// Parses a comma-separated list of dimension names.
pub fn parse_dims(text: &str) -> Result<Vec<String>> {
    let dims: Vec<String> = text
        .split(',')
        .map(|d| d.trim().to_string())
        .filter(|d| !d.is_empty())
        .collect();
    if dims.is_empty() {
        return Err(ZarrFusionError::Invalid(format!(
            "option dims '{text}' names no dimension"
        )));
    }
    Ok(dims)
}

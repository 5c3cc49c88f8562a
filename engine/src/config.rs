//! Session settings of zarrfusion, under the `zarrfusion.` prefix.
//!
//! ```sql
//! SET zarrfusion.target_partition_bytes = 16777216;
//! ```

use datafusion::common::config::ConfigExtension;
use datafusion::common::extensions_options;

extensions_options! {
    /// Settings of the Zarr scan.
    pub struct ZarrConfig {
        /// Decoded bytes a scan partition block aims for (blocks are whole chunks).
        pub target_partition_bytes: usize, default = 32 * 1024 * 1024
    }
}

impl ConfigExtension for ZarrConfig {
    const PREFIX: &'static str = "zarrfusion";
}

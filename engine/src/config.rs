//! Session settings of zarrfusion, under the `zarrfusion.` prefix.
//!
//! ```sql
//! SET zarrfusion.target_partition_bytes = 16777216;
//! SET zarrfusion.dense_reduction = false;
//! ```

use datafusion::common::config::ConfigExtension;
use datafusion::common::extensions_options;

extensions_options! {
    /// Settings of the Zarr scan and the array operators.
    pub struct ZarrConfig {
        /// Decoded bytes a scan partition block aims for (blocks are whole chunks).
        pub target_partition_bytes: usize, default = 32 * 1024 * 1024
        /// Plan `GROUP BY` over dimensions of a Zarr table as a dense array
        /// reduction (accumulators indexed by coordinate position) instead
        /// of a hash aggregation.
        pub dense_reduction: bool, default = true
    }
}

impl ConfigExtension for ZarrConfig {
    const PREFIX: &'static str = "zarrfusion";
}

//! Zarr groups as chunk-partitioned tables: the mapping, the scan and its
//! pushdown, and the ways to register them (`CREATE EXTERNAL TABLE`,
//! `read_zarr`, `register_zarr`).

mod batch_runs;
mod block_read;
mod blocks;
mod broadcast;
mod calendar;
pub(crate) mod cells;
mod coordinate;
mod dataset;
mod factory;
mod options;
mod provider;
mod read_ahead;
mod read_zarr;
mod regular;
mod scan;
mod selection;
mod slices;

pub use batch_runs::{BatchRuns, RunStreamBuilder, RUNS_IN_FLIGHT, RUN_BATCHES};
pub use block_read::BlockRead;
pub use blocks::{
    boxes_in_block, share_of, share_of_runs, shown_tasks, task_index, task_share, BlockGrid,
    BlockTemporaries, TASKS_OF_STAGE,
};
pub(crate) use broadcast::signed_zeros_folded;
pub use broadcast::{
    Broadcast, BroadcastDim, BroadcastInputs, BroadcastRuns, BroadcastValues, ReadsBroadcasts,
    SmallSidePlanner, MAX_BROADCAST_BYTES,
};
pub use calendar::{model_calendar, ticks_per_second, CalendarSeconds};
pub use cells::BoxCells;
pub use coordinate::{Coordinate, CoordinateFormula};
pub use dataset::{Dimension, GridColumn, GridSource, GridTable, TableSource, ZarrDataset};
pub use factory::{open_dataset, open_dataset_blocking, run_blocking, ZarrTableFactory};
pub use options::{parse_dims, ZarrTableOptions};
pub use provider::{registered_zarr_tables, ZarrTable};
pub use read_ahead::{ReadAheadPlan, TableReadAhead};
pub use read_zarr::ReadZarrPlanner;
pub(crate) use read_zarr::{
    literal_text, registered_table, store_table, zarr_source, TableFunctionCall,
};
pub use regular::RegularCoordinate;
pub use scan::ZarrScanExec;
pub(crate) use selection::pushed_dimension;
pub use selection::{classify_filters, long_dimension_refusal, select, select_planning, Selection};
pub use slices::{batch_rows, batch_slice};

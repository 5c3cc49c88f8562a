//! Training windows cut from Zarr just in time: the ML data loader.
//!
//! Training examples are windows of a gridded dataset (xbatcher's
//! `input_dims` and `input_overlap`), with windows holding missing values
//! dropped, shuffled, sharded across data-parallel ranks and batched. No
//! intermediate copy of the dataset is written: an index of valid window
//! origins ([`index`]) is built once per dataset and window shape, and
//! batches are cut from decoded chunks as they are needed ([`loader`]).
//!
//! | module | owns |
//! |---|---|
//! | [`geometry`] | window shapes, origins, chunk-aligned blocks of origins |
//! | [`index`] | which origins hold a valid window |
//! | [`live_index`] | the index filling in while a loader starts |
//! | [`cache`] | the index kept on disk between runs |
//! | [`sample`] | what a sample holds: inputs, targets, lead times, channels, jitter |
//! | [`order`] | shuffling, sharding, epochs |
//! | [`values`] | typed cell values and cutting windows out of them |
//! | [`statistics`] | per-variable mean, std, min, max for normalization |
//! | [`assemble`] | cutting samples into a batch's arrays: channels, jitter, normalization |
//! | [`loader`] | the threads that decode blocks and assemble batches |
//!
//! ```no_run
//! use std::sync::Arc;
//! use zarrfusion::table::{Selection, ZarrDataset, ZarrTableOptions};
//! use zarrfusion::windows::{IndexOptions, LoaderOptions, SampleSpec, WindowShape, Windows};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let runtime = datafusion::execution::runtime_env::RuntimeEnv::default();
//! let dataset = ZarrDataset::open("demo/era5.zarr", &ZarrTableOptions::default(), &runtime)?;
//! let table = Arc::new(dataset.table(None)?);
//! let shape = WindowShape {
//!     sizes: vec![("lat".into(), 5), ("lon".into(), 5)],
//!     overlaps: vec![("lat".into(), 4), ("lon".into(), 4)],
//! };
//! let selection = Selection::all(&table.shape());
//! let options = IndexOptions::default();
//! let sample = SampleSpec::default();
//! let windows = Windows::new(table, &["t2m".to_string()], selection, &shape, &sample, &options)?;
//! println!("{} valid windows", windows.len()?);
//! let loader = zarrfusion::windows::WindowLoader::new(Arc::new(windows), LoaderOptions::default())?;
//! for batch in loader.epoch(0) {
//!     let batch = batch?;
//!     println!("{} windows", batch.len);
//! }
//! # Ok(())
//! # }
//! ```

pub mod assemble;
pub mod cache;
pub mod geometry;
pub mod index;
pub mod live_index;
pub mod loader;
pub mod order;
pub mod sample;
pub mod statistics;
pub mod values;

use std::sync::Arc;

pub use assemble::Output;
pub use cache::IndexCache;
pub use geometry::{Validity, WindowGrid, WindowShape};
use index::BlockIndex;
pub use index::ValidIndex;
use live_index::IndexJob;
pub use live_index::LiveIndex;
pub use loader::{
    BatchStream, LoaderMemory, LoaderOptions, LoaderStats, Polled, WindowBatch, WindowLoader,
};
pub use order::{Shard, Shuffle};
pub use sample::{Channel, Role, SampleLayout, SampleSpec};
pub use statistics::{statistics, Moments};
pub use values::{Scale, Values};

use datafusion::common::DFSchema;
use datafusion::logical_expr::utils::split_conjunction_owned;
use datafusion::logical_expr::{Expr, TableProviderFilterPushDown};
use datafusion::prelude::SessionContext;

use crate::error::ZarrFusionError;
use crate::table::{classify_filters, select, GridTable, Selection};

/// An error making or reading windows.
#[derive(Debug, thiserror::Error)]
pub enum WindowError {
    /// An argument is wrong; the message names it.
    #[error("{argument}: {message}")]
    Argument {
        /// The argument's name, as the API spells it.
        argument: String,
        /// What is wrong with it.
        message: String,
    },
    /// The data could not be read (the message names store, array and chunk).
    #[error(transparent)]
    Data(#[from] ZarrFusionError),
    /// The data could not be read while loading (message of the original error).
    #[error("{0}")]
    Read(String),
    /// A bug: something that should not happen.
    #[error("internal error: {0}")]
    Internal(String),
}

impl WindowError {
    /// An error about argument `argument`.
    pub fn argument(argument: &str, message: impl std::fmt::Display) -> Self {
        Self::Argument {
            argument: argument.to_string(),
            message: message.to_string(),
        }
    }
}

/// How the valid-window index is built.
#[derive(Debug, Clone)]
pub struct IndexOptions {
    /// Decoded bytes a block of origins aims at.
    pub block_bytes: u64,
    /// Threads indexing blocks in the background (0: only as loaders read
    /// blocks and when the whole index is asked for).
    pub threads: usize,
    /// Where indices are kept between runs; `None` builds every time.
    pub cache: Option<IndexCache>,
    /// Chunk reads the index threads keep in flight ahead of them when the
    /// store is in an object store (`zarrfusion.io_concurrency`; 0: on
    /// demand only).
    pub io_concurrency: usize,
}

impl Default for IndexOptions {
    /// 16 MiB blocks, one thread per core, no cache.
    fn default() -> Self {
        Self {
            block_bytes: 16 << 20,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cache: None,
            io_concurrency: 64,
        }
    }
}

/// Where a [`Windows`]' index came from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum IndexSource {
    /// Built by reading the data, in this many seconds.
    Built {
        /// Seconds spent reading and indexing.
        seconds: f64,
    },
    /// Loaded from the cache.
    Cached,
}

/// The valid windows of some variables of a grid table.
///
/// The index of valid windows fills in in the background ([`live_index`]):
/// what needs all of it ([`Windows::len`], [`Windows::index`]) waits for the
/// last block; a loader starts on the first blocks before.
#[derive(Debug)]
pub struct Windows {
    /// The table the windows are cut from.
    pub table: Arc<GridTable>,
    /// The variables, as indices into `table.variables`.
    pub variables: Vec<usize>,
    /// Where the window origins are, grouped in blocks.
    pub grid: Arc<WindowGrid>,
    /// What a sample holds (roles and channels) and the rules it meets.
    pub layout: Arc<SampleLayout>,
    /// Which origins hold a valid window, as far as known.
    live: Arc<LiveIndex>,
}

impl Windows {
    /// Plans windows of `shape` over `selection` of `table`, for the named
    /// variables (all of the table's when empty), holding what `sample`
    /// says (inputs, targets at lead times, validity rules, jitter), and loads the index of
    /// valid windows from `options.cache` or starts building it in the
    /// background. Argument errors are returned here; a block that cannot
    /// be read fails whatever waits for the index. A cache that cannot be
    /// written is reported in the log and otherwise ignored.
    pub fn new(
        table: Arc<GridTable>,
        variables: &[String],
        selection: Selection,
        shape: &WindowShape,
        sample: &SampleSpec,
        options: &IndexOptions,
    ) -> Result<Self, WindowError> {
        let names: Vec<&str> = table.variables.iter().map(|v| v.name()).collect();
        let variables: Vec<usize> = if variables.is_empty() {
            (0..names.len()).collect()
        } else {
            variables
                .iter()
                .map(|v| {
                    names.iter().position(|n| n == v).ok_or_else(|| {
                        WindowError::argument(
                            "variables",
                            format!("unknown variable '{v}' (variables: {})", names.join(", ")),
                        )
                    })
                })
                .collect::<Result<_, _>>()?
        };
        if variables.is_empty() {
            return Err(WindowError::argument(
                "variables",
                "the table has no variables",
            ));
        }
        for &v in &variables {
            let var = &table.variables[v];
            if !values::is_supported(var.data_type()) {
                return Err(WindowError::argument(
                    "variables",
                    format!(
                        "variable '{}' has type {}; windows need integers or float32/float64",
                        var.name(),
                        var.data_type()
                    ),
                ));
            }
        }
        let bytes_per_cell: u64 = variables
            .iter()
            .map(|&v| table.variables[v].element_size() as u64)
            .sum();
        let variable_names: Vec<&str> = variables.iter().map(|&v| names[v]).collect();
        let (layout, grid_shape) =
            SampleLayout::resolve(&table, &variable_names, &selection, shape, sample)?;
        let layout = Arc::new(layout);
        let grid = Arc::new(WindowGrid::new(
            &table,
            &selection,
            &grid_shape,
            &layout.jitter,
            bytes_per_cell,
            options.block_bytes,
        )?);
        let live = if layout.keeps_everything() {
            // Every window is valid: nothing to read, nothing to keep.
            let all = grid.blocks.iter().map(|b| BlockIndex::all(b.num_origins()));
            LiveIndex::finished(
                ValidIndex::from_blocks(all.collect()),
                IndexSource::Built { seconds: 0.0 },
            )
        } else {
            let cache = match &options.cache {
                Some(cache) => Some((
                    cache.clone(),
                    IndexCache::key(&table, &variables, &grid, &layout)?,
                )),
                None => None,
            };
            match cache.as_ref().and_then(|(c, key)| c.load(key, &grid)) {
                Some(index) => LiveIndex::finished(index, IndexSource::Cached),
                None => LiveIndex::build(
                    IndexJob {
                        table: Arc::clone(&table),
                        variables: variables.clone(),
                        grid: Arc::clone(&grid),
                        layout: Arc::clone(&layout),
                        io_concurrency: options.io_concurrency,
                    },
                    options.threads,
                    cache,
                ),
            }
        };
        Ok(Self {
            table,
            variables,
            grid,
            layout,
            live,
        })
    }

    /// Number of valid windows (waits for the index).
    pub fn len(&self) -> Result<u64, WindowError> {
        Ok(self.index()?.total)
    }

    /// Whether there is no valid window (waits for the index).
    pub fn is_empty(&self) -> Result<bool, WindowError> {
        Ok(self.len()? == 0)
    }

    /// The whole index of valid windows (waits for the last block).
    pub fn index(&self) -> Result<&ValidIndex, WindowError> {
        self.live.index()
    }

    /// The index as it fills in.
    pub fn live_index(&self) -> &LiveIndex {
        &self.live
    }

    /// Whether the index was built or loaded from the cache (waits for it).
    pub fn index_source(&self) -> Result<IndexSource, WindowError> {
        self.live.source()
    }

    /// Names of the variables, in batch order.
    pub fn variable_names(&self) -> Vec<&str> {
        self.variables
            .iter()
            .map(|&v| self.table.variables[v].name())
            .collect()
    }

    /// Decoded bytes of an average block (what one shuffle-buffer entry costs).
    pub fn block_bytes(&self) -> u64 {
        let blocks = self.grid.blocks.len().max(1) as u64;
        let cells: u64 = self.grid.blocks.iter().map(|b| b.num_cells()).sum();
        (cells / blocks).saturating_mul(self.cell_bytes())
    }

    /// Decoded bytes of the largest block.
    pub fn largest_block_bytes(&self) -> u64 {
        let cells = self.grid.blocks.iter().map(|b| b.num_cells()).max();
        cells.unwrap_or(0).saturating_mul(self.cell_bytes())
    }

    /// Decoded bytes of one cell of every variable.
    pub fn cell_bytes(&self) -> u64 {
        self.variables
            .iter()
            .map(|&v| self.table.variables[v].element_size() as u64)
            .sum()
    }
}

impl Drop for Windows {
    /// Stops indexing: nobody can use the index any more.
    fn drop(&mut self) {
        self.live.cancel();
    }
}

/// The cells selected by `predicate`, a SQL condition on coordinates (the
/// loader's `where`), evaluated like a filter pushed into a scan.
pub fn select_where(
    table: &GridTable,
    predicate: &str,
    ctx: &SessionContext,
) -> Result<Selection, WindowError> {
    let where_error = |e: &dyn std::fmt::Display| WindowError::argument("where", e);
    let schema = DFSchema::try_from(Arc::clone(&table.schema)).map_err(|e| where_error(&e))?;
    let expr = ctx
        .parse_sql_expr(predicate, &schema)
        .map_err(|e| where_error(&e))?;
    let conjuncts = split_conjunction_owned(expr);
    let refs: Vec<&Expr> = conjuncts.iter().collect();
    for (conjunct, how) in conjuncts.iter().zip(classify_filters(&refs, table)) {
        if how != TableProviderFilterPushDown::Exact {
            return Err(where_error(&format!(
                "'{conjunct}' is not a condition on one coordinate; windows are selected by coordinates only"
            )));
        }
    }
    select(&conjuncts, table, &ctx.state()).map_err(|e| where_error(&e))
}

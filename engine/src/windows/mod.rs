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
//! | [`shared`] | blocks of an index shared by the processes building it |
//! | [`sample`] | what a sample holds: inputs, targets, lead times, channels, jitter |
//! | [`sources`] | several stores and dimension sets joined on coordinates |
//! | [`order`] | shuffling, sharding, epochs |
//! | [`values`] | typed cell values and cutting windows out of them |
//! | [`statistics`](mod@statistics) | per-variable mean, std, min, max for normalization |
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
pub mod cache_dir;
pub mod geometry;
pub mod index;
pub mod live_index;
pub mod loader;
pub mod order;
pub mod sample;
pub mod shared;
pub mod sources;
pub mod statistics;
pub mod values;

use std::ops::Range;
use std::sync::Arc;

pub use assemble::Output;
pub use cache::IndexCache;
pub use cache_dir::CacheDir;
pub use geometry::{Validity, WindowGrid, WindowShape};
use index::BlockIndex;
pub use index::ValidIndex;
use live_index::IndexJob;
pub use live_index::{IndexMemory, LiveIndex};
pub use loader::{
    BatchStream, LoaderMemory, LoaderOptions, LoaderStats, Polled, WindowBatch, WindowLoader,
};
pub use order::{Shard, Shuffle};
pub use sample::{Channel, Role, SampleLayout, SampleSpec};
pub use sources::{Link, Source, Sources};
pub use statistics::{statistics, Moments};
pub use values::{Scale, Values};

use datafusion::common::DFSchema;
use datafusion::logical_expr::utils::split_conjunction_owned;
use datafusion::logical_expr::{Expr, TableProviderFilterPushDown};
use datafusion::prelude::SessionContext;

use crate::error::ZarrFusionError;
use crate::table::{classify_filters, long_dimension_refusal, select, GridTable, Selection};

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
    /// The system refused what the loader needs to run (a thread); the
    /// message says what. Nothing about the data or the arguments.
    #[error("{0}")]
    Resources(String),
    /// A bug: something that should not happen.
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<crate::error::Panicked> for WindowError {
    fn from(p: crate::error::Panicked) -> Self {
        Self::Internal(format!("a {} panicked: {}", p.what, p.message))
    }
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

pub use crate::config::MAX_THREADS;

/// `threads` (the argument `argument`) when it is at most [`MAX_THREADS`].
fn checked_threads(threads: usize, argument: &str) -> Result<usize, WindowError> {
    if threads > MAX_THREADS {
        return Err(WindowError::argument(
            argument,
            format!("{threads} threads asked for; at most {MAX_THREADS}"),
        ));
    }
    Ok(threads)
}

/// Starts `work` on a thread named `name`; an error (naming it) when the
/// system has no thread to give.
fn spawn(name: &str, work: impl FnOnce() + Send + 'static) -> Result<(), WindowError> {
    std::thread::Builder::new()
        .name(name.to_string())
        .spawn(work)
        .map(drop)
        .map_err(|e| thread_refused(name, e))
}

/// The error for a thread named `name` that the system did not start.
fn thread_refused(name: &str, e: std::io::Error) -> WindowError {
    WindowError::Resources(format!("could not start the {name} thread: {e}"))
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
    /// The session's `allowed_mem`: while the index is built, its threads
    /// and read-ahead take at most half of it, fewer threads when their
    /// blocks do not fit (see [`IndexMemory`]); a loader counts what they
    /// take (`None`: no limit).
    pub memory_limit: Option<usize>,
}

impl Default for IndexOptions {
    /// 16 MiB blocks, one thread per core, no cache, no memory limit.
    fn default() -> Self {
        Self {
            block_bytes: 16 << 20,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cache: None,
            io_concurrency: 64,
            memory_limit: None,
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
    /// The table the windows are cut from (the reference source's).
    pub table: Arc<GridTable>,
    /// The reference's variables, as indices into `table.variables`.
    pub variables: Vec<usize>,
    /// Every source (the reference first) and how they join.
    pub sources: Arc<Sources>,
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
    /// says: [`Windows::of_sources`] with one source.
    pub fn new(
        table: Arc<GridTable>,
        variables: &[String],
        selection: Selection,
        shape: &WindowShape,
        sample: &SampleSpec,
        options: &IndexOptions,
    ) -> Result<Self, WindowError> {
        let name = table.store.clone();
        let source = Source::new(&name, table, variables, selection)?;
        Self::of_sources(vec![source], shape, sample, options)
    }

    /// Plans windows of `shape` over the grid of the first of `sources`
    /// (the reference; the others are joined to it on their coordinates,
    /// see [`sources`]), holding what `sample` says (inputs, targets at
    /// lead times, validity rules, jitter), and loads the index of valid
    /// windows from `options.cache` or starts building it in the
    /// background. Argument errors are returned here; a block that cannot
    /// be read fails whatever waits for the index. A cache that cannot be
    /// written is reported in the log and otherwise ignored.
    pub fn of_sources(
        sources: Vec<Source>,
        shape: &WindowShape,
        sample: &SampleSpec,
        options: &IndexOptions,
    ) -> Result<Self, WindowError> {
        checked_threads(options.threads, "threads")?;
        let mut sources = sources.into_iter();
        let reference = sources
            .next()
            .ok_or_else(|| WindowError::argument("sources", "no source given"))?;
        let others: Vec<Source> = sources.collect();
        let table = Arc::clone(&reference.table);
        // The shape's dimensions first: every later check speaks of them.
        let dims: Vec<&str> = table.dims.iter().map(|d| d.name.as_str()).collect();
        shape.check_names(&dims)?;
        let variables = reference.variables.clone();
        let several = !others.is_empty();
        let lead = if sample.has_roles() || several {
            sample::lead_dimension(&table, shape, sample)?
        } else {
            None
        };
        let window_dims: Vec<String> = shape.sizes.iter().map(|(d, _)| d.clone()).collect();
        let sources = Arc::new(Sources::join(reference, others, &window_dims, lead)?);
        let mut seen: Vec<(&str, &str)> = Vec::new();
        for (f, &(s, _)) in sources.flat.iter().enumerate() {
            let name = sources.variable_name(f);
            let source = sources.list[s].name.as_str();
            if let Some((_, other)) = seen.iter().find(|(n, _)| *n == name) {
                let message = match *other == source {
                    true => format!("'{name}' is given twice (in '{source}')"),
                    false => format!(
                        "'{name}' is a variable of '{other}' and of '{source}'; keep it in one source"
                    ),
                };
                return Err(WindowError::argument("variables", message));
            }
            seen.push((name, source));
        }
        let (layout, grid_shape) = SampleLayout::resolve(&sources, shape, sample, lead)?;
        let layout = Arc::new(layout);
        let selection = &sources.reference().selection;
        // Decoded bytes of every source per reference cell, for the blocks' size.
        let whole: Vec<std::ops::Range<u64>> = (0..table.dims.len())
            .map(|d| match selection.ranges(d) {
                [] => 0..0,
                ranges => ranges[0].start..ranges[ranges.len() - 1].end,
            })
            .collect();
        let cells: u64 = whole.iter().map(|r| r.end - r.start).product();
        let bytes_per_cell = sources.decoded_bytes(&whole).div_ceil(cells.max(1)).max(1);
        let grid = Arc::new(WindowGrid::new(
            &table,
            selection,
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
                Some(cache) => Some((cache.clone(), IndexCache::key(&sources, &grid, &layout)?)),
                None => None,
            };
            match cache.as_ref().and_then(|(c, key)| c.load(key, &grid)) {
                Some(index) => LiveIndex::finished(index, IndexSource::Cached),
                None => LiveIndex::build(
                    IndexJob {
                        sources: Arc::clone(&sources),
                        grid: Arc::clone(&grid),
                        layout: Arc::clone(&layout),
                        io_concurrency: options.io_concurrency,
                    },
                    options.threads,
                    options.memory_limit,
                    cache,
                ),
            }
        };
        Ok(Self {
            table,
            variables,
            sources,
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

    /// Names of the variables of every source, in batch order.
    pub fn variable_names(&self) -> Vec<&str> {
        (0..self.sources.flat.len())
            .map(|f| self.sources.variable_name(f))
            .collect()
    }

    /// Decoded bytes of an average block (what one shuffle-buffer entry costs).
    pub fn block_bytes(&self) -> u64 {
        let blocks = self.grid.blocks.len().max(1) as u64;
        let bytes: u64 = self
            .grid
            .blocks
            .iter()
            .map(|b| self.sources.decoded_bytes(&b.extent))
            .sum();
        bytes / blocks
    }

    /// What building the index in the background holds at its peak while
    /// it is incomplete (nothing once complete or loaded from the cache).
    pub fn index_memory(&self) -> IndexMemory {
        self.live.memory()
    }

    /// Decoded bytes of the largest block.
    pub fn largest_block_bytes(&self) -> u64 {
        self.sources.largest_block_bytes(&self.grid)
    }

    /// Decoded bytes of the largest single window a full shuffle reads
    /// (its reach, with jitter, in every source).
    pub fn window_bytes(&self) -> u64 {
        self.widest_reach()
            .map_or(0, |reach| self.sources.decoded_bytes(&reach))
    }

    /// The reach (jitter included) of the window that reads the most
    /// decoded bytes: a block's first, per block. `None` without blocks.
    fn widest_reach(&self) -> Option<Vec<Range<u64>>> {
        self.grid
            .blocks
            .iter()
            .map(|b| self.grid.window_reach(&b.origin(0)))
            .max_by_key(|reach| self.sources.decoded_bytes(reach))
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
    let mut selections = select_where_each(&[table], predicate, ctx)?;
    selections
        .pop()
        .ok_or_else(|| WindowError::Internal("no selection".into()))
}

/// The cells of each of `tables` (the sources of some windows) selected
/// by `predicate`: each condition on one coordinate applies to every
/// table with that dimension, and must apply to one at least.
pub fn select_where_each(
    tables: &[&GridTable],
    predicate: &str,
    ctx: &SessionContext,
) -> Result<Vec<Selection>, WindowError> {
    let where_error = |e: &dyn std::fmt::Display| WindowError::argument("where", e);
    // Every dimension column, the first table's first.
    let mut fields: Vec<datafusion::arrow::datatypes::Field> = Vec::new();
    for table in tables {
        for dim in &table.dims {
            if !fields.iter().any(|f| f.name() == &dim.name) {
                fields.push(dim.field());
            }
        }
    }
    let schema = DFSchema::try_from(datafusion::arrow::datatypes::Schema::new(fields))
        .map_err(|e| where_error(&e))?;
    let expr = ctx
        .parse_sql_expr(predicate, &schema)
        .map_err(|e| where_error(&e))?;
    let conjuncts = split_conjunction_owned(expr);
    for conjunct in &conjuncts {
        let applies = tables.iter().any(|table| {
            classify_filters(&[conjunct], table) == [TableProviderFilterPushDown::Exact]
        });
        if !applies {
            let long = (tables.iter()).find_map(|table| long_dimension_refusal(conjunct, table));
            return Err(where_error(&match long {
                Some(reason) => format!("'{conjunct}' cannot select windows: {reason}"),
                None => format!(
                    "'{conjunct}' is not a condition on one coordinate; windows are selected by coordinates only"
                ),
            }));
        }
    }
    tables
        .iter()
        .map(|table| {
            let own: Vec<Expr> = conjuncts
                .iter()
                .filter(|c| classify_filters(&[c], table) == [TableProviderFilterPushDown::Exact])
                .cloned()
                .collect();
            select(&own, table, &ctx.state()).map_err(|e| where_error(&e))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_the_system_refuses_is_a_resources_error_naming_it() {
        let refused = std::io::Error::from(std::io::ErrorKind::WouldBlock);
        let e = thread_refused("window loader", refused);
        assert!(
            matches!(&e, WindowError::Resources(m) if m.starts_with("could not start the window loader thread")),
            "{e:?}"
        );
    }
}

//! The window loader in Python: `Dataset.windows(...)` starts the index of
//! valid windows (built in the background), `Windows.loader(...)` yields batches as dicts of numpy
//! arrays that own the buffers Rust filled (no copy).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arrow::array::{Array, ArrayRef, AsArray, UInt64Array};
use arrow::compute::cast;
use arrow::datatypes::{
    DataType, Float32Type, Float64Type, Int16Type, Int32Type, Int64Type, Int8Type, TimeUnit,
    UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};
use datafusion::execution::memory_pool::MemoryLimit;
use datafusion::prelude::SessionContext;
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use zarrfusion::config::ZarrConfig;
use zarrfusion::table::{GridTable, Selection};
use zarrfusion::windows::{
    select_where_each, statistics, BatchStream, IndexCache, IndexOptions, IndexSource,
    LoaderOptions, Polled, SampleSpec, Scale, Shard, Shuffle, Source, ValidIndex, Validity, Values,
    WindowBatch, WindowLoader, WindowShape, Windows,
};

use crate::arguments::{count_argument, size_argument};
use crate::errors::window_error;
use crate::runtime::{wait_for, SIGNAL_CHECK};

/// The whole index of valid windows, with the GIL released: indexes the
/// blocks nobody has started in this thread, a block at a time, then waits
/// for the last one, letting Ctrl-C interrupt in between.
fn wait_index<'w>(py: Python<'_>, windows: &'w Windows) -> PyResult<&'w ValidIndex> {
    let live = windows.live_index();
    loop {
        let found = py.detach(|| live.index_for(SIGNAL_CHECK));
        if let Some(index) = found.map_err(window_error)? {
            return Ok(index);
        }
        py.check_signals()?;
    }
}

fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get())
}

/// `{dim: n}` as pairs, checking every value is a non-negative integer.
fn dim_counts(name: &str, value: Option<&Bound<'_, PyDict>>) -> PyResult<Vec<(String, u64)>> {
    let Some(dict) = value else {
        return Ok(Vec::new());
    };
    dict.iter()
        .map(|(k, v)| {
            let dim: String = k.extract().map_err(|_| {
                PyValueError::new_err(format!("{name}: keys must be dimension names"))
            })?;
            let n: u64 = v.extract().map_err(|_| {
                PyValueError::new_err(format!(
                    "{name}: '{dim}' must map to a non-negative integer"
                ))
            })?;
            Ok((dim, n))
        })
        .collect()
}

/// A pair of non-negative integers such as `shard=(rank, world_size)`
/// (`what` says which), or `None`.
fn pair_argument(
    name: &str,
    what: &str,
    value: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<(u64, u64)>> {
    let Some(value) = value.filter(|v| !v.is_none()) else {
        return Ok(None);
    };
    let (a, b): (Bound<'_, PyAny>, Bound<'_, PyAny>) = value
        .extract()
        .map_err(|_| PyValueError::new_err(format!("{name}: expected {what}, got {value}")))?;
    Ok(Some((count_argument(name, &a)?, count_argument(name, &b)?)))
}

/// One validity rule: `"all"`, `"any"` or a fraction.
fn validity_rule(v: &Bound<'_, PyAny>) -> PyResult<Validity> {
    match v.extract::<f64>() {
        Ok(f) if !v.is_instance_of::<pyo3::types::PyString>() => Validity::fraction(f),
        _ => Validity::parse(&v.extract::<String>().map_err(|_| {
            PyValueError::new_err("valid: expected 'all', 'any', a fraction, or a dict of them by role ('inputs', 'targets')")
        })?),
    }
    .map_err(window_error)
}

/// The `valid` argument: one rule for every role, or `{role: rule}`
/// (a role left out keeps `"all"`). Returns the inputs' and targets' rules.
fn validity_argument(valid: Option<&Bound<'_, PyAny>>) -> PyResult<(Validity, Validity)> {
    let Some(valid) = valid.filter(|v| !v.is_none()) else {
        return Ok((Validity::All, Validity::All));
    };
    let Ok(dict) = valid.cast::<PyDict>() else {
        let rule = validity_rule(valid)?;
        return Ok((rule, rule));
    };
    let (mut inputs, mut targets) = (Validity::All, Validity::All);
    for (k, v) in dict.iter() {
        let role: String = k.extract()?;
        match role.as_str() {
            "inputs" => inputs = validity_rule(&v)?,
            "targets" => targets = validity_rule(&v)?,
            other => {
                return Err(PyValueError::new_err(format!(
                    "valid: unknown role '{other}' (roles: inputs, targets)"
                )))
            }
        }
    }
    Ok((inputs, targets))
}

/// The `targets` argument: `{variable: lead}` or `{variable: [leads]}`.
fn targets_argument(targets: Option<&Bound<'_, PyDict>>) -> PyResult<Vec<(String, Vec<String>)>> {
    let Some(targets) = targets else {
        return Ok(Vec::new());
    };
    targets
        .iter()
        .map(|(k, v)| {
            let variable: String = k
                .extract()
                .map_err(|_| PyValueError::new_err("targets: keys must be variable names"))?;
            let leads: Vec<String> = match v.extract::<String>() {
                Ok(one) => vec![one],
                Err(_) => v.extract::<Vec<String>>().map_err(|_| {
                    PyValueError::new_err(format!(
                        "targets: '{variable}' must map to a lead time ('+6h', '+1') or a list of them"
                    ))
                })?,
            };
            Ok((variable, leads))
        })
        .collect()
}

/// The `cache` argument: `None`/`True` for the default cache directory,
/// `False` for none, or a directory or object-store URL (held to the
/// session's `allowed_locations`).
fn cache_argument(
    py: Python<'_>,
    value: Option<&Bound<'_, PyAny>>,
    ctx: &SessionContext,
) -> PyResult<Option<IndexCache>> {
    let value = match value {
        None => return Ok(IndexCache::default_location()),
        Some(v) if v.is_none() => return Ok(IndexCache::default_location()),
        Some(v) => v,
    };
    if let Ok(flag) = value.extract::<bool>() {
        return Ok(flag.then(IndexCache::default_location).flatten());
    }
    let location: String = match value.extract::<String>() {
        Ok(text) => text,
        Err(_) => value
            .extract::<std::path::PathBuf>()
            .map_err(|_| {
                PyValueError::new_err("cache: expected True, False, a directory or a URL")
            })?
            .to_string_lossy()
            .into_owned(),
    };
    let allowed = ZarrConfig::of(ctx.state().config().options())
        .allowed()
        .map_err(|e| PyValueError::new_err(format!("cache: {e}")))?;
    let runtime = ctx.runtime_env();
    // An object-store cache is opened on the runtime its requests run on.
    let opened = wait_for(py, async move {
        IndexCache::open(&location, &allowed, &runtime)
    })?;
    opened.map(Some).map_err(window_error)
}

/// Zarr stores opened for windowing: sources of variables over one
/// dimension set each, the first the reference.
#[pyclass(name = "Dataset", module = "zarrfusion._zarrfusion", frozen)]
pub struct PyDataset {
    /// `(name, table, variables)` per source.
    sources: Vec<(String, Arc<GridTable>, Vec<String>)>,
    ctx: SessionContext,
}

impl PyDataset {
    /// A dataset of `sources`: `(name, table, variables)`, all of a
    /// table's variables when empty.
    pub fn new(
        sources: Vec<(String, Arc<GridTable>, Vec<String>)>,
        ctx: SessionContext,
    ) -> PyResult<Self> {
        if sources.is_empty() {
            return Err(PyValueError::new_err("sources: no store given"));
        }
        let mut checked = Vec::with_capacity(sources.len());
        for (name, table, variables) in sources {
            let names: Vec<String> = table
                .variables
                .iter()
                .map(|v| v.name().to_string())
                .collect();
            for v in &variables {
                if !names.contains(v) {
                    return Err(PyValueError::new_err(format!(
                        "variables: unknown variable '{v}' of '{name}' (variables over ({}): {})",
                        table
                            .dims
                            .iter()
                            .map(|d| d.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", "),
                        names.join(", ")
                    )));
                }
            }
            let variables = if variables.is_empty() {
                names
            } else {
                variables
            };
            checked.push((name, table, variables));
        }
        Ok(Self {
            sources: checked,
            ctx,
        })
    }

    /// The reference source's table.
    fn table(&self) -> &Arc<GridTable> {
        &self.sources[0].1
    }
}

#[pymethods]
impl PyDataset {
    /// Dimension names of the reference source, outermost first.
    #[getter]
    fn dims(&self) -> Vec<String> {
        self.table().dims.iter().map(|d| d.name.clone()).collect()
    }

    /// Dimension lengths of the reference source, as a dict.
    #[getter]
    fn sizes(&self) -> Vec<(String, u64)> {
        self.table()
            .dims
            .iter()
            .map(|d| (d.name.clone(), d.len))
            .collect()
    }

    /// The variables windows are cut from, source after source.
    #[getter]
    fn variables(&self) -> Vec<String> {
        self.sources
            .iter()
            .flat_map(|(_, _, v)| v.iter().cloned())
            .collect()
    }

    /// Per source: its name, dimensions and variables.
    #[getter]
    fn sources(&self) -> Vec<(String, Vec<String>, Vec<String>)> {
        self.sources
            .iter()
            .map(|(name, table, variables)| {
                let dims = table.dims.iter().map(|d| d.name.clone()).collect();
                (name.clone(), dims, variables.clone())
            })
            .collect()
    }

    /// The valid windows of `input_dims` (cells per window dimension) with
    /// `input_overlap`, kept by `valid` (`"all"`, `"any"` or a fraction of
    /// non-missing values, or `{role: rule}`) over the cells selected by
    /// `where` (SQL on coordinates); with `history` (`{dim: steps}`),
    /// `targets` (`{variable: lead or [leads]}`), `inputs` (variables) and
    /// `jitter` (`{dim: cells}`), samples of inputs and targets. Builds the
    /// valid-window index (one pass over the data), or loads it from
    /// `cache` (`True`: the default cache directory, a path: that
    /// directory, `False`: always build).
    #[pyo3(signature = (input_dims, input_overlap=None, valid=None, r#where=None, block_size=None, threads=None, cache=None, history=None, targets=None, inputs=None, jitter=None))]
    #[allow(clippy::too_many_arguments)] // one per Python keyword
    fn windows(
        &self,
        py: Python<'_>,
        input_dims: &Bound<'_, PyDict>,
        input_overlap: Option<&Bound<'_, PyDict>>,
        valid: Option<&Bound<'_, PyAny>>,
        r#where: Option<String>,
        block_size: Option<&Bound<'_, PyAny>>,
        threads: Option<&Bound<'_, PyAny>>,
        cache: Option<&Bound<'_, PyAny>>,
        history: Option<&Bound<'_, PyDict>>,
        targets: Option<&Bound<'_, PyDict>>,
        inputs: Option<Vec<String>>,
        jitter: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PyWindows> {
        let shape = WindowShape {
            sizes: dim_counts("input_dims", Some(input_dims))?,
            overlaps: dim_counts("input_overlap", input_overlap)?,
        };
        let (valid_inputs, valid_targets) = validity_argument(valid)?;
        let history = dim_counts("history", history)?;
        let (lead_dim, history) = match history.as_slice() {
            [] => (None, 1),
            [(dim, steps)] => (Some(dim.clone()), *steps),
            _ => {
                return Err(PyValueError::new_err(
                    "history: give one dimension ({'time': steps})",
                ))
            }
        };
        let sample = SampleSpec {
            lead_dim,
            history,
            inputs,
            targets: targets_argument(targets)?,
            valid_inputs,
            valid_targets,
            jitter: dim_counts("jitter", jitter)?,
        };
        let block_bytes = match block_size {
            Some(b) => size_argument("block_size", b)? as u64,
            None => 16 << 20,
        };
        let tables: Vec<&GridTable> = self.sources.iter().map(|(_, t, _)| t.as_ref()).collect();
        let selections = match &r#where {
            Some(predicate) => {
                select_where_each(&tables, predicate, &self.ctx).map_err(window_error)?
            }
            None => tables.iter().map(|t| Selection::all(&t.shape())).collect(),
        };
        let sources = self
            .sources
            .iter()
            .zip(selections)
            .map(|((name, table, variables), selection)| {
                Source::new(name, Arc::clone(table), variables, selection)
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(window_error)?;
        let io_concurrency = ZarrConfig::of(self.ctx.state().config().options()).io_concurrency;
        let memory_limit = match self.ctx.runtime_env().memory_pool.memory_limit() {
            MemoryLimit::Finite(limit) => Some(limit),
            _ => None,
        };
        let cache = cache_argument(py, cache, &self.ctx)?;
        let options = IndexOptions {
            block_bytes,
            threads: match threads {
                Some(t) => usize::try_from(count_argument("threads", t)?).unwrap_or(usize::MAX),
                None => default_threads(),
            },
            cache: cache.clone(),
            io_concurrency,
            memory_limit,
        };
        let windows = py
            .detach(move || Windows::of_sources(sources, &shape, &sample, &options))
            .map_err(window_error)?;
        Ok(PyWindows {
            windows: Arc::new(windows),
            io_concurrency,
            memory_limit,
            ctx: self.ctx.clone(),
            cache,
        })
    }

    fn __repr__(&self) -> String {
        format!("Dataset(sources={:?})", self.sources())
    }
}

/// The valid windows of a dataset.
#[pyclass(name = "Windows", module = "zarrfusion._zarrfusion", frozen)]
pub struct PyWindows {
    windows: Arc<Windows>,
    /// The session's `zarrfusion.io_concurrency`, for its loaders.
    io_concurrency: usize,
    /// The session's `allowed_mem`, for its loaders.
    memory_limit: Option<usize>,
    /// The session, for statistics.
    ctx: SessionContext,
    /// Where the index and statistics are kept.
    cache: Option<IndexCache>,
}

#[pymethods]
impl PyWindows {
    /// Number of valid windows (waits for the index to be complete).
    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(wait_index(py, &self.windows)?.total as usize)
    }

    /// Blocks of the index built so far, and in all (the index is built in
    /// the background; a loader starts before it is complete).
    #[getter]
    fn index_progress(&self) -> (usize, usize) {
        self.windows.live_index().progress()
    }

    /// Where the index's blocks came from so far: `blocks` (in all),
    /// `indexed`, `read` (from values this process read) and
    /// `from_other_processes` (indexed by other processes building the
    /// same index in the same cache directory).
    #[getter]
    fn index_counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let counts = self.windows.live_index().counts();
        let dict = PyDict::new(py);
        dict.set_item("blocks", counts.blocks)?;
        dict.set_item("indexed", counts.indexed)?;
        dict.set_item("read", counts.read)?;
        dict.set_item("from_other_processes", counts.from_other_processes)?;
        Ok(dict)
    }

    /// What building the index in the background holds while it is
    /// incomplete, in bytes: `threads` indexing blocks (as many as half of
    /// the session's `allowed_mem` holds), `decoding` (a block per
    /// thread), `read_ahead` (chunks read ahead of them from an object
    /// store) and `total`; zeros once the index is complete.
    #[getter]
    fn index_memory<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let m = self.windows.index_memory();
        let d = PyDict::new(py);
        d.set_item("threads", m.threads)?;
        d.set_item("decoding", m.decoding)?;
        d.set_item("read_ahead", m.read_ahead)?;
        d.set_item("total", m.total())?;
        Ok(d)
    }

    /// The variables in each batch.
    #[getter]
    fn variables(&self) -> Vec<String> {
        self.windows
            .variable_names()
            .into_iter()
            .map(String::from)
            .collect()
    }

    /// Where the valid-window index came from: `"cache"`, or `"built"`
    /// (waits for the index to be complete).
    #[getter]
    fn index_source(&self, py: Python<'_>) -> PyResult<&'static str> {
        wait_index(py, &self.windows)?;
        Ok(match self.windows.index_source().map_err(window_error)? {
            IndexSource::Cached => "cache",
            IndexSource::Built { .. } => "built",
        })
    }

    /// Seconds spent building the index, 0 when it came from the cache
    /// (waits for the index to be complete).
    #[getter]
    fn index_seconds(&self, py: Python<'_>) -> PyResult<f64> {
        wait_index(py, &self.windows)?;
        Ok(match self.windows.index_source().map_err(window_error)? {
            IndexSource::Cached => 0.0,
            IndexSource::Built { seconds } => seconds,
        })
    }

    /// The window dimensions and sizes, in array order.
    #[getter]
    fn window_shape(&self) -> Vec<(String, u64)> {
        self.windows
            .grid
            .axes
            .iter()
            .filter(|a| a.window)
            .map(|a| (a.name.clone(), a.size))
            .collect()
    }

    /// Per variable (in the windows' order), per part of it (one index of
    /// each channel dimension, such as a level: `[(dim, coordinate)]`):
    /// count, mean, std, min and max over the selected cells, by the
    /// engine's dense reduction, kept in the cache beside the index.
    #[allow(clippy::type_complexity)] // plain values for Python
    fn statistics(
        &self,
        py: Python<'_>,
    ) -> PyResult<Vec<(String, Vec<(Vec<(String, f64)>, [f64; 5])>)>> {
        let run = {
            let ctx = self.ctx.clone();
            let windows = Arc::clone(&self.windows);
            let cache = self.cache.clone();
            async move {
                statistics(
                    &ctx,
                    &windows.sources,
                    &windows.layout.parts,
                    cache.as_ref(),
                )
                .await
            }
        };
        let moments = wait_for(py, run)?.map_err(window_error)?;
        let sources = &self.windows.sources;
        Ok(moments
            .into_iter()
            .enumerate()
            .map(|(f, per_part)| {
                let source = &sources.list[sources.flat[f].0];
                let parts = self.windows.layout.parts[f]
                    .iter()
                    .zip(per_part)
                    .map(|(fixed, m)| {
                        let at = source.coordinates(fixed);
                        (at, [m.count as f64, m.mean, m.std, m.min, m.max])
                    })
                    .collect();
                (sources.variable_name(f).to_string(), parts)
            })
            .collect())
    }

    /// Per role (`inputs`, then `targets` when given): its channels, in
    /// batch order, as `(variable, step)` pairs (steps from the sample's
    /// own along the lead dimension).
    #[getter]
    fn channels(&self) -> Vec<(String, Vec<Channel>)> {
        role_channels(&self.windows)
    }

    /// Channels per step of each variable (its levels; 1 without channel
    /// dimensions), in the windows' order.
    fn statistics_parts(&self) -> Vec<usize> {
        self.windows.layout.parts.iter().map(Vec::len).collect()
    }

    /// The lead dimension (history and lead times), when there is one.
    #[getter]
    fn lead_dim(&self) -> Option<String> {
        self.windows
            .layout
            .lead
            .map(|l| self.windows.table.dims[l.axis].name.clone())
    }

    /// A loader of batches. `shuffle`: `None`, `"block"` (a buffer of
    /// `buffer_size` bytes of decoded blocks) or `"full"`; `shard`:
    /// `(rank, world_size)`; `worker`: `(id, workers)` of a `DataLoader`;
    /// `stack`: one float32 array of channels per role; `normalize`:
    /// `(mean, std)` per variable (in the windows' order) and part of it.
    /// Integers are checked here, naming the argument (`ValueError` when
    /// negative or past 2^64 - 1), and bounded by the loader.
    #[pyo3(signature = (batch_size=None, shuffle=Some("block".to_string()), seed=None, drop_last=false, prefetch=None, threads=None, shard=None, buffer_size=None, worker=None, stack=false, normalize=None))]
    #[allow(clippy::too_many_arguments)]
    fn loader(
        &self,
        batch_size: Option<&Bound<'_, PyAny>>,
        shuffle: Option<String>,
        seed: Option<&Bound<'_, PyAny>>,
        drop_last: bool,
        prefetch: Option<&Bound<'_, PyAny>>,
        threads: Option<&Bound<'_, PyAny>>,
        shard: Option<&Bound<'_, PyAny>>,
        buffer_size: Option<&Bound<'_, PyAny>>,
        worker: Option<&Bound<'_, PyAny>>,
        stack: bool,
        normalize: Option<Vec<Vec<(f64, f64)>>>,
    ) -> PyResult<PyWindowLoader> {
        let count = |name: &str, value: Option<&Bound<'_, PyAny>>, default: u64| {
            value.map_or(Ok(default), |v| count_argument(name, v))
        };
        let size = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
        let batch_size = size(count("batch_size", batch_size, 256)?);
        let seed = count("seed", seed, 0)?;
        let prefetch = size(count("prefetch", prefetch, 8)?);
        let threads = threads
            .map(|t| count("threads", Some(t), 0))
            .transpose()?
            .map(size);
        let shard = pair_argument("shard", "(rank, world_size)", shard)?;
        let worker = pair_argument("worker", "(id, workers)", worker)?;
        let buffer_bytes = match buffer_size {
            Some(b) => size_argument("buffer_size", b)? as u64,
            None => 256 << 20,
        };
        let shuffle = match shuffle.as_deref().map(str::to_ascii_lowercase).as_deref() {
            None | Some("none") => Shuffle::None,
            Some("block") => Shuffle::Block { buffer_bytes },
            Some("full") => Shuffle::Full,
            Some(other) => {
                return Err(PyValueError::new_err(format!(
                    "shuffle: '{other}' is not None, 'block' or 'full'"
                )))
            }
        };
        let shard = shard.map_or(Shard::WHOLE, |(rank, world_size)| Shard {
            rank,
            world_size,
        });
        let worker = worker.map_or(Shard::WHOLE, |(rank, world_size)| Shard {
            rank,
            world_size,
        });
        let options = LoaderOptions {
            batch_size,
            shuffle,
            seed,
            drop_last,
            prefetch,
            threads: threads.unwrap_or_else(default_threads),
            shard,
            worker,
            io_concurrency: self.io_concurrency,
            memory_limit: self.memory_limit,
            stack,
            normalize: normalize.map(|n| {
                n.into_iter()
                    .map(|parts| {
                        parts
                            .into_iter()
                            .map(|(mean, std)| Scale { mean, std })
                            .collect()
                    })
                    .collect()
            }),
        };
        let loader = WindowLoader::new(Arc::clone(&self.windows), options).map_err(window_error)?;
        Ok(PyWindowLoader {
            loader: Arc::new(loader),
            windows: Arc::clone(&self.windows),
            epoch: AtomicU64::new(0),
            skip: AtomicU64::new(0),
            position: Arc::new(AtomicU64::new(0)),
        })
    }

    fn __repr__(&self) -> String {
        let n = match self.windows.live_index().wait_index(Duration::ZERO) {
            Ok(Some(index)) => index.total.to_string(),
            Ok(None) => "? (indexing)".to_string(),
            Err(_) => "? (index failed)".to_string(),
        };
        format!(
            "Windows(n={n}, window={:?}, variables={:?})",
            self.window_shape(),
            self.variables()
        )
    }
}

/// Batches of windows, epoch after epoch.
#[pyclass(name = "WindowLoader", module = "zarrfusion._zarrfusion", frozen)]
pub struct PyWindowLoader {
    loader: Arc<WindowLoader>,
    windows: Arc<Windows>,
    epoch: AtomicU64,
    /// Batches the next iteration skips (to resume).
    skip: AtomicU64,
    /// Batches of the current epoch yielded so far (skipped ones included).
    position: Arc<AtomicU64>,
}

#[pymethods]
impl PyWindowLoader {
    /// Batches of the next epoch for this shard (waits for the index).
    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        wait_index(py, &self.windows)?;
        Ok(self
            .loader
            .num_batches(self.epoch())
            .map_err(window_error)? as usize)
    }

    /// Windows of the next epoch for this shard (waits for the index).
    #[getter]
    fn num_samples(&self, py: Python<'_>) -> PyResult<u64> {
        wait_index(py, &self.windows)?;
        self.loader.num_samples(self.epoch()).map_err(window_error)
    }

    /// Where each of `workers` `DataLoader` workers resumes epoch `epoch`
    /// after the `consumed` batches the `DataLoader` took from them: per
    /// worker, `(share, skip)`: the worker share it yields and the batches
    /// of it to skip (may wait for the index).
    fn resume_workers(
        &self,
        py: Python<'_>,
        epoch: u64,
        consumed: u64,
        workers: u64,
    ) -> PyResult<Vec<(u64, u64)>> {
        let o = self.loader.options();
        if !o.drop_last && o.shuffle != Shuffle::Full {
            wait_index(py, &self.windows)?;
        }
        self.loader
            .resume_workers(epoch, consumed, workers)
            .map_err(window_error)
    }

    /// Per role, its channels as `(variable, step)` pairs.
    #[getter]
    fn channels(&self) -> Vec<(String, Vec<Channel>)> {
        role_channels(&self.windows)
    }

    /// Stops this process's background index threads (the loader is handed
    /// to DataLoader workers, which index what they need): the index still
    /// fills in when this process reads blocks or waits for it.
    fn stop_background_index(&self) {
        self.windows.live_index().stop_background();
    }

    /// The batch size.
    #[getter]
    fn batch_size(&self) -> usize {
        self.loader.options().batch_size
    }

    /// The epoch the next iteration runs (it seeds the shuffle).
    #[getter]
    fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    /// Sets the epoch of the next iteration (from its start).
    fn set_epoch(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::Relaxed);
        self.skip.store(0, Ordering::Relaxed);
        self.position.store(0, Ordering::Relaxed);
    }

    /// Batches of the current epoch yielded so far, those a resumed
    /// iteration skipped included.
    #[getter]
    fn position(&self) -> u64 {
        self.position.load(Ordering::Relaxed)
    }

    /// Makes the next iteration run epoch `epoch` from its batch `batches`
    /// on: the batches an uninterrupted epoch yields after its first
    /// `batches`.
    fn resume_at(&self, epoch: u64, batches: u64) {
        self.epoch.store(epoch, Ordering::Relaxed);
        self.skip.store(batches, Ordering::Relaxed);
        self.position.store(batches, Ordering::Relaxed);
    }

    /// Starts an epoch: the batches, assembled ahead on Rust threads (after
    /// those skipped to resume, once).
    fn __iter__(&self) -> PyBatchIterator {
        let skip = self.skip.swap(0, Ordering::Relaxed);
        self.position.store(skip, Ordering::Relaxed);
        PyBatchIterator {
            stream: Mutex::new(self.loader.epoch_from(self.epoch(), skip)),
            loader: Arc::clone(&self.loader),
            windows: Arc::clone(&self.windows),
            position: Arc::clone(&self.position),
            epoch: self.epoch(),
        }
    }

    /// The memory an epoch holds at its peak, in bytes, by part: `buffer`
    /// (decoded blocks the windows are drawn from), `batches` (prefetched
    /// and being planned), `decoding` (a block per thread as it is
    /// decoded), `index` (the window index being built beside it, until it
    /// is complete), `read_ahead` (chunks read ahead from an object store,
    /// in what the rest leaves of the session's `allowed_mem`) and `total`.
    #[getter]
    fn memory<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let m = self.loader.memory();
        let d = PyDict::new(py);
        d.set_item("buffer", m.buffer)?;
        d.set_item("batches", m.batches)?;
        d.set_item("decoding", m.decoding)?;
        d.set_item("index", m.index)?;
        d.set_item("read_ahead", m.read_ahead)?;
        d.set_item("total", m.total())?;
        Ok(d)
    }

    /// Counters over all epochs: batches, samples, blocks read, bytes
    /// decoded, decode/assembly thread time and time waited for batches;
    /// and what the sources' object stores fetched since they were opened.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.loader.stats();
        let d = PyDict::new(py);
        d.set_item("batches", s.batches)?;
        d.set_item("samples", s.samples)?;
        d.set_item("blocks_read", s.blocks_read)?;
        d.set_item("bytes_read", s.bytes_decoded)?;
        d.set_item("decode_time_s", s.decode_seconds)?;
        d.set_item("assemble_time_s", s.assemble_seconds)?;
        d.set_item("wait_time_s", s.wait_seconds)?;
        d.set_item("requests", s.network.requests)?;
        d.set_item("bytes_fetched", s.network.bytes)?;
        d.set_item("read_ahead_hits", s.network.read_ahead_hits)?;
        d.set_item("read_ahead_misses", s.network.read_ahead_misses)?;
        d.set_item("read_ahead_requests", s.network.read_ahead_requests)?;
        Ok(d)
    }
}

/// Per role of `windows`, its channels as `(variable, step, [(dimension,
/// coordinate)])`: the coordinate of each channel dimension (`level`) as a
/// number (its index when it is not one).
fn role_channels(windows: &Windows) -> Vec<(String, Vec<Channel>)> {
    let sources = &windows.sources;
    windows
        .layout
        .roles
        .iter()
        .map(|r| {
            let channels = r
                .channels
                .iter()
                .map(|c| {
                    let at = sources.list[sources.flat[c.variable].0].coordinates(&c.fixed);
                    (sources.variable_name(c.variable).to_string(), c.step, at)
                })
                .collect();
            (r.name.to_string(), channels)
        })
        .collect()
}

/// A channel for Python: variable, step, and the coordinate of each channel dimension.
type Channel = (String, i64, Vec<(String, f64)>);

/// The batches of one epoch.
#[pyclass(name = "BatchIterator", module = "zarrfusion._zarrfusion", frozen)]
pub struct PyBatchIterator {
    stream: Mutex<BatchStream>,
    loader: Arc<WindowLoader>,
    windows: Arc<Windows>,
    /// The loader's count of batches yielded in the epoch.
    position: Arc<AtomicU64>,
    /// The epoch.
    epoch: u64,
}

#[pymethods]
impl PyBatchIterator {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        loop {
            let polled = py.detach(|| {
                let mut stream = self
                    .stream
                    .lock()
                    .map_err(|_| PyRuntimeError::new_err("the loader's lock is poisoned"))?;
                stream.poll(SIGNAL_CHECK).map_err(window_error)
            })?;
            match polled {
                Polled::Batch(batch) => {
                    self.position.fetch_add(1, Ordering::Relaxed);
                    return batch_dict(py, &self.loader, &self.windows, batch).map(Some);
                }
                Polled::Done => return Ok(None),
                Polled::Waiting => py.check_signals()?,
            }
        }
    }

    /// Number of batches in the epoch (waits for the index).
    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        wait_index(py, &self.windows)?;
        Ok(self.loader.num_batches(self.epoch).map_err(window_error)? as usize)
    }
}

/// A batch as a dict: the classic windows as `{variable: array (n,
/// *window)}`; samples with roles as `{role: array (n, channels, *plane)}`
/// (stacked) or `{role: {variable: array (n, steps, *plane)}}`; then
/// `"coords"` and `"index"` (`{dim: per sample}`: the first cell, or the
/// sample's own step along the lead dimension) and, with jitter,
/// `"jitter"` (`{dim: offsets}`).
fn batch_dict<'py>(
    py: Python<'py>,
    loader: &WindowLoader,
    windows: &Windows,
    batch: WindowBatch,
) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    let layout = &windows.layout;
    let names = windows.variable_names();
    let by_role = layout.roles_given || loader.options().stack;
    for (output, values) in loader.outputs().iter().zip(batch.arrays) {
        let mut shape = vec![batch.len];
        shape.extend(zarrfusion::windows::assemble::sample_shape(windows, output));
        let array = values_array(py, values, &shape)?;
        let role = layout.roles[output.role].name;
        match output.variable {
            Some(v) if by_role => {
                let group = match out.get_item(role)? {
                    Some(group) => group.cast_into::<PyDict>()?,
                    None => {
                        let group = PyDict::new(py);
                        out.set_item(role, &group)?;
                        group
                    }
                };
                group.set_item(names[v], array)?;
            }
            Some(v) => out.set_item(names[v], array)?,
            None => out.set_item(role, array)?,
        }
    }
    let coords = PyDict::new(py);
    let index = PyDict::new(py);
    for (d, (dim, origins)) in windows.table.dims.iter().zip(batch.origins).enumerate() {
        if layout.channel_axes.contains(&d) {
            continue;
        }
        let positions = UInt64Array::from(origins.clone());
        let values = dim
            .coordinate
            .take(&positions)
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        coords.set_item(&dim.name, arrow_to_numpy(py, &values)?)?;
        let origins: Vec<i64> = origins.into_iter().map(|i| i as i64).collect();
        index.set_item(&dim.name, PyArray1::from_vec(py, origins))?;
    }
    out.set_item("coords", coords)?;
    out.set_item("index", index)?;
    if layout.jittered() {
        let jitter = PyDict::new(py);
        for (dim, offsets) in windows.table.dims.iter().zip(batch.jitter) {
            if !offsets.is_empty() {
                jitter.set_item(&dim.name, PyArray1::from_vec(py, offsets))?;
            }
        }
        out.set_item("jitter", jitter)?;
    }
    Ok(out)
}

/// Moves typed values into a numpy array of `shape` (no copy).
fn values_array<'py>(
    py: Python<'py>,
    values: Values,
    shape: &[usize],
) -> PyResult<Bound<'py, PyAny>> {
    macro_rules! to_numpy {
        ($($variant:ident),*) => {
            match values {
                $(Values::$variant(v) => PyArray1::from_vec(py, v).reshape(shape.to_vec())?.into_any(),)*
            }
        };
    }
    Ok(to_numpy!(F32, F64, I8, I16, I32, I64, U8, U16, U32, U64))
}

/// A 1-D Arrow array (coordinates) as numpy: numbers as numbers, timestamps
/// as `datetime64`, anything else as objects.
fn arrow_to_numpy<'py>(py: Python<'py>, array: &ArrayRef) -> PyResult<Bound<'py, PyAny>> {
    macro_rules! numbers {
        ($t:ty) => {
            PyArray1::from_vec(py, array.as_primitive::<$t>().values().to_vec()).into_any()
        };
    }
    Ok(match array.data_type() {
        DataType::Float32 => numbers!(Float32Type),
        DataType::Float64 => numbers!(Float64Type),
        DataType::Int8 => numbers!(Int8Type),
        DataType::Int16 => numbers!(Int16Type),
        DataType::Int32 => numbers!(Int32Type),
        DataType::Int64 => numbers!(Int64Type),
        DataType::UInt8 => numbers!(UInt8Type),
        DataType::UInt16 => numbers!(UInt16Type),
        DataType::UInt32 => numbers!(UInt32Type),
        DataType::UInt64 => numbers!(UInt64Type),
        DataType::Timestamp(unit, _) => {
            let unit = match unit {
                TimeUnit::Second => "s",
                TimeUnit::Millisecond => "ms",
                TimeUnit::Microsecond => "us",
                TimeUnit::Nanosecond => "ns",
            };
            let raw = cast(array, &DataType::Int64)
                .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
            let values = PyArray1::from_vec(py, raw.as_primitive::<Int64Type>().values().to_vec());
            values.call_method1("view", (format!("datetime64[{unit}]"),))?
        }
        _ => {
            let text =
                cast(array, &DataType::Utf8).map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
            let strings: Vec<Option<&str>> = text.as_string::<i32>().iter().collect();
            py.import("numpy")?
                .call_method1("array", (strings, "object"))?
        }
    })
}

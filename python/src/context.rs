//! `SessionContext`: a zarrfusion session (memory budget, work directory,
//! settings), its tables, SQL, and datasets opened for windowing.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::prelude::SessionContext;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use zarrfusion::array::rechunk::{rechunk_store_async, RechunkOptions};
use zarrfusion::table::registered_zarr_tables;
use zarrfusion::table::{open_dataset, parse_dims, ZarrTable, ZarrTableOptions};
use zarrfusion::zarr::{AllowedLocations, StoreLocation};
use zarrfusion::ZarrContextExt;

use crate::arguments::{size_argument, string_options, threads_argument};
use crate::dataframe::PyDataFrame;
use crate::errors::{datafusion_error, engine_error};
use crate::runtime::wait_for;
use crate::windows::PyDataset;

/// A zarrfusion session: registered tables, settings and a memory budget.
#[pyclass(name = "SessionContext", module = "zarrfusion._zarrfusion", frozen)]
pub struct PySessionContext {
    pub(crate) ctx: SessionContext,
}

#[pymethods]
impl PySessionContext {
    /// A session. `allowed_mem` bounds the memory of queries (`"4GB"`, or
    /// bytes); `work_dir` holds intermediate files; `allowed_locations`
    /// (directories and URL prefixes) restricts where statements may read,
    /// write and work (SQL cannot change it); `config` sets any session
    /// setting (`{"zarrfusion.dense_reduction": "false"}`; also
    /// `zarrfusion.allowed_mem`, as `SET` takes it, in place of the
    /// argument); `workers`
    /// (`host:port` addresses) runs queries on `zarrfusion worker`s.
    #[new]
    #[pyo3(signature = (allowed_mem=None, work_dir=None, target_partitions=None, batch_size=None, config=None, allowed_locations=None, workers=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        allowed_mem: Option<&Bound<'_, PyAny>>,
        work_dir: Option<String>,
        target_partitions: Option<usize>,
        batch_size: Option<usize>,
        config: Option<HashMap<String, String>>,
        allowed_locations: Option<Vec<String>>,
        workers: Option<Vec<String>>,
    ) -> PyResult<Self> {
        let mut config = config.unwrap_or_default();
        // `zarrfusion.allowed_mem` given in `config` as to `SET` (the
        // runtime's memory pool, not a session setting).
        let key = (config.keys())
            .find(|k| k.trim().eq_ignore_ascii_case("zarrfusion.allowed_mem"))
            .cloned();
        let configured_mem = match key.and_then(|k| config.remove(&k)) {
            Some(_) if allowed_mem.is_some() => {
                return Err(PyValueError::new_err(
                    "allowed_mem is given twice: as an argument and as config's \
                     zarrfusion.allowed_mem",
                ))
            }
            value => value,
        };
        let mut builder = RuntimeEnvBuilder::new();
        let limit = match (allowed_mem, configured_mem) {
            (Some(limit), _) => Some(size_argument("allowed_mem", limit)?),
            (None, Some(text)) => Some(zarrfusion::memory::parse_size(&text).map_err(|e| {
                PyValueError::new_err(format!("config: zarrfusion.allowed_mem: {e}"))
            })?),
            (None, None) => None,
        };
        if let Some(limit) = limit {
            builder = builder.with_memory_limit(limit, 1.0);
        }
        // A local work_dir also takes DataFusion's spill files; an
        // object-store URL takes the intermediate arrays only.
        let remote_work_dir = match work_dir.as_deref().map(StoreLocation::parse).transpose() {
            Ok(Some(StoreLocation::Local(dir))) => {
                std::fs::create_dir_all(&dir).map_err(|e| {
                    PyValueError::new_err(format!("work_dir {}: {e}", dir.display()))
                })?;
                builder = builder.with_temp_file_path(dir);
                None
            }
            Ok(Some(StoreLocation::Remote(url))) => Some(url),
            Ok(None) => None,
            Err(e) => return Err(PyValueError::new_err(format!("work_dir: {e}"))),
        };
        let runtime = builder.build_arc().map_err(datafusion_error)?;
        let mut session = zarrfusion::session_config();
        for (name, value) in [
            ("target_partitions", target_partitions),
            ("batch_size", batch_size),
        ] {
            if let Some(n) = value {
                zarrfusion::config::check_setting(
                    &format!("datafusion.execution.{name}"),
                    &n.to_string(),
                )
                .map_err(|e| PyValueError::new_err(format!("{name}: {e}")))?;
            }
        }
        if let Some(n) = target_partitions {
            session = session.with_target_partitions(n.max(1));
        }
        if let Some(n) = batch_size {
            session = session.with_batch_size(n.max(1));
        }
        if let Some(url) = remote_work_dir {
            session
                .options_mut()
                .set("zarrfusion.work_dir", url.as_str())
                .map_err(|e| PyValueError::new_err(format!("work_dir: {e}")))?;
        }
        for (key, value) in config {
            zarrfusion::config::check_setting(&key, &value)
                .map_err(|e| PyValueError::new_err(format!("config: {e}")))?;
            session
                .options_mut()
                .set(&key, &value)
                .map_err(|e| PyValueError::new_err(format!("config: {e}")))?;
        }
        if let Some(locations) = allowed_locations {
            let list = locations.join(",");
            AllowedLocations::parse(&list).map_err(engine_error)?;
            session
                .options_mut()
                .set("zarrfusion.allowed_locations", &list)
                .map_err(|e| PyValueError::new_err(format!("allowed_locations: {e}")))?;
        }
        let ctx = match workers {
            Some(workers) => {
                let workers = zarrfusion::distributed::parse_workers(&workers.join(","))
                    .map_err(|e| PyValueError::new_err(format!("workers: {e}")))?;
                zarrfusion::distributed_context(session, runtime, workers)
            }
            None => zarrfusion::new_context_with(session, runtime),
        };
        Ok(Self { ctx })
    }

    /// Registers the Zarr store at `path` (a path or URL) as table `name`,
    /// with the options of `CREATE EXTERNAL TABLE ... OPTIONS (...)`.
    #[pyo3(signature = (name, path, **options))]
    fn register_zarr(
        &self,
        py: Python<'_>,
        name: &str,
        path: &str,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<()> {
        let options = string_options(options)?;
        ZarrTableOptions::from_map(&options).map_err(engine_error)?;
        wait_for(py, self.ctx.register_zarr(name, path, options))?.map_err(datafusion_error)
    }

    /// Plans a SQL statement; DDL and `SET` run at once (`SET
    /// zarrfusion.allowed_mem = '2GB'` resizes the memory pool).
    fn sql(&self, py: Python<'_>, query: &str) -> PyResult<PyDataFrame> {
        let df =
            wait_for(py, zarrfusion::session::sql(&self.ctx, query))?.map_err(datafusion_error)?;
        Ok(PyDataFrame::new(df))
    }

    /// The whole of a registered table.
    fn table(&self, py: Python<'_>, name: &str) -> PyResult<PyDataFrame> {
        let df = wait_for(py, self.ctx.table(name))?.map_err(datafusion_error)?;
        Ok(PyDataFrame::new(df))
    }

    /// Removes a table; `True` when it existed.
    fn deregister_table(&self, name: &str) -> PyResult<bool> {
        Ok(self
            .ctx
            .deregister_table(name)
            .map_err(datafusion_error)?
            .is_some())
    }

    /// Names of the tables in the default schema.
    fn table_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .ctx
            .catalog("datafusion")
            .and_then(|c| c.schema("public"))
            .map(|s| s.table_names())
            .unwrap_or_default();
        names.sort();
        names
    }

    /// The dimension and variable names of every registered Zarr table,
    /// with their attributes as JSON and whether a dimension's coordinate
    /// descends: `{column: (is_dimension, attrs_json, descending)}`.
    fn _zarr_columns(&self, py: Python<'_>) -> PyResult<HashMap<String, (bool, String, bool)>> {
        let ctx = self.ctx.clone();
        wait_for(py, async move {
            let mut out = HashMap::new();
            for grid in registered_zarr_tables(ctx.state().catalog_list().as_ref()).await {
                for dim in &grid.dims {
                    let attrs = serde_json::Value::Object(dim.attributes.clone());
                    out.insert(dim.name.clone(), (true, attrs.to_string(), dim.descends()));
                }
                for var in &grid.variables {
                    let attrs = serde_json::Value::Object(var.attributes().clone());
                    out.entry(var.name().to_string())
                        .or_insert((false, attrs.to_string(), false));
                }
            }
            out
        })
    }

    /// Opens Zarr stores for windowing: `sources` are `(name, path,
    /// variables)`; each store gives its variables (all that share the
    /// dimension set `dims`, by default the largest, when `None`), one
    /// source per dimension set they span. The first is the reference.
    #[pyo3(signature = (sources, dims=None, **options))]
    fn open_zarr(
        &self,
        py: Python<'_>,
        sources: Vec<(String, String, Option<Vec<String>>)>,
        dims: Option<&Bound<'_, PyAny>>,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PyDataset> {
        let mut options = ZarrTableOptions::from_map(&string_options(options)?)
            .map_err(engine_error)?
            .with_session(self.ctx.state().config().options())
            .map_err(engine_error)?;
        if let Some(dims) = dims {
            options.dims = Some(match dims.extract::<String>() {
                Ok(text) => parse_dims(&text).map_err(engine_error)?,
                Err(_) => dims.extract::<Vec<String>>()?,
            });
        }
        let dims = options.dims.clone();
        // Every store opened at once (from an object store, each open is
        // a few round trips).
        let opens = sources.iter().map(|(_, path, _)| {
            open_dataset(path.clone(), options.clone(), self.ctx.runtime_env())
        });
        let datasets =
            wait_for(py, futures::future::try_join_all(opens))?.map_err(datafusion_error)?;
        let mut opened = Vec::new();
        for ((name, _, variables), dataset) in sources.into_iter().zip(datasets) {
            let variables = match variables {
                Some(v) if dims.is_none() => v,
                variables => {
                    let table = dataset.table(dims.as_deref()).map_err(engine_error)?;
                    opened.push((name, Arc::new(table), variables.unwrap_or_default()));
                    continue;
                }
            };
            // The variables' dimension sets, in the order they come first.
            let mut tables: Vec<Option<_>> = dataset.tables().into_iter().map(Some).collect();
            let mut groups: Vec<(usize, Vec<String>)> = Vec::new();
            for v in variables {
                let Some(t) = tables.iter().position(|t| {
                    t.as_ref()
                        .is_some_and(|t| t.variables.iter().any(|a| a.name() == v))
                }) else {
                    let all: Vec<String> = tables
                        .iter()
                        .flatten()
                        .flat_map(|t| t.variables.iter().map(|a| a.name().to_string()))
                        .collect();
                    return Err(PyValueError::new_err(format!(
                        "variables: unknown variable '{v}' of '{name}' (variables: {})",
                        all.join(", ")
                    )));
                };
                match groups.iter_mut().find(|(g, _)| *g == t) {
                    Some((_, names)) => names.push(v),
                    None => groups.push((t, vec![v])),
                }
            }
            for (t, names) in groups {
                if let Some(table) = tables[t].take() {
                    opened.push((name.clone(), Arc::new(table), names));
                }
            }
        }
        PyDataset::new(opened, self.ctx.clone())
    }

    /// Rechunks the store at `source` (a path, a URL or a registered
    /// table's name) into a new store at `target`, with `chunks`
    /// (`{dim: length}`; other dimensions keep theirs), inside the
    /// session's `allowed_mem` (2 GiB when unset), intermediates in its
    /// `work_dir`. Returns what it did: per array the stages and projected
    /// memory, bytes read and written, seconds.
    #[pyo3(signature = (source, target, chunks, threads=None))]
    fn rechunk<'py>(
        &self,
        py: Python<'py>,
        source: String,
        target: PathBuf,
        chunks: HashMap<String, u64>,
        threads: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let threads = threads
            .map(|t| threads_argument("threads", t))
            .transpose()?;
        let registered = if self.table_names().contains(&source) {
            wait_for(py, self.ctx.table_provider(source.as_str()))?.ok()
        } else {
            None
        };
        let source = registered
            .as_ref()
            .and_then(|p| (p.as_ref() as &dyn std::any::Any).downcast_ref::<ZarrTable>())
            .map_or(source.clone(), |t| t.grid().store.clone());
        let runtime = self.ctx.runtime_env();
        // `zarrfusion.work_dir` (a path or an object-store URL) when set,
        // else the session's temporary directory, removed with the session.
        let mut options = RechunkOptions::for_session(self.ctx.state().config_options(), &runtime)
            .map_err(datafusion_error)?;
        if let Some(threads) = threads {
            options.threads = threads.max(1);
        }
        let chunks: Vec<(String, u64)> = chunks.into_iter().collect();
        let run = rechunk_store_async(source, target, chunks, options, runtime);
        let summary = wait_for(py, run)?.map_err(datafusion_error)?;
        let out = PyDict::new(py);
        let arrays = PyDict::new(py);
        for a in &summary.arrays {
            let d = PyDict::new(py);
            d.set_item("dims", a.dims.clone())?;
            d.set_item("stages", a.plan.stages.len())?;
            d.set_item(
                "chunks",
                a.plan
                    .stages
                    .iter()
                    .map(|s| s.to.clone())
                    .collect::<Vec<_>>(),
            )?;
            d.set_item(
                "tasks",
                a.plan.stages.iter().map(|s| s.tasks).collect::<Vec<_>>(),
            )?;
            d.set_item("workers", a.plan.workers)?;
            d.set_item("projected_memory", a.projected_memory())?;
            arrays.set_item(&a.name, d)?;
        }
        out.set_item("arrays", arrays)?;
        out.set_item("bytes_read", summary.bytes_read)?;
        out.set_item("bytes_written", summary.bytes_written)?;
        out.set_item("target_bytes", summary.target_bytes)?;
        out.set_item("seconds", summary.seconds)?;
        Ok(out)
    }

    fn __repr__(&self) -> String {
        format!("SessionContext(tables={:?})", self.table_names())
    }
}

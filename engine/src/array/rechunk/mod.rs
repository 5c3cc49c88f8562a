//! Rechunk: a Zarr store's arrays copied into new chunk shapes inside a
//! memory budget. The rechunk primitive (see [`crate::array`]).
//!
//! Every array of the store is copied as stored (data type, fill value,
//! codecs, attributes: no decoding), with the chunk length given for each
//! named dimension and its own elsewhere. [`plan`] decides, per array, the
//! stages and what each task copies, so that every task fits its share of
//! `allowed_mem` and a plan that cannot is refused before anything is
//! read; [`copy`] runs the stages ([`cluster`]: a rechunk's
//! tasks on a cluster's workers). Intermediate arrays live under
//! `work_dir` (uncompressed) and are removed when the rechunk ends,
//! however it ends. The target is written beside itself and renamed into
//! place when complete, so a failed or cancelled rechunk leaves nothing.
//!
//! ```no_run
//! use std::sync::atomic::AtomicBool;
//! use zarrfusion::array::rechunk::{rechunk_store, RechunkOptions};
//!
//! # fn main() -> datafusion::common::Result<()> {
//! let runtime = datafusion::execution::runtime_env::RuntimeEnv::default();
//! let options = RechunkOptions { allowed_mem: 500 << 20, ..RechunkOptions::default() };
//! let chunks = vec![("time".to_string(), 240), ("lat".to_string(), 16), ("lon".to_string(), 16)];
//! let summary = rechunk_store("era5.zarr", "era5_space.zarr".as_ref(), &chunks, &options,
//!                             &runtime, &AtomicBool::new(false))?;
//! println!("{} bytes written", summary.bytes_written);
//! # Ok(())
//! # }
//! ```

pub mod cluster;
pub mod copy;
pub mod plan;
pub mod table;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use datafusion::common::config::ConfigOptions;
use datafusion::common::{
    exec_err, human_readable_size, internal_err, plan_err, DataFusionError, Result,
};
use datafusion::execution::memory_pool::MemoryLimit;
use datafusion::execution::runtime_env::RuntimeEnv;
use serde_json::{json, Map, Value};
use zarrs::array::Array;
use zarrs::metadata::ArrayMetadata;
use zarrs::storage::{ReadableListableStorageTraits, ReadableWritableListableStorage, StoreKey};

pub(crate) use cluster::ClusterRounds;
pub use cluster::{ArrayTasks, RechunkTasks, RechunkTasksExec, StageTasks};
pub use plan::{NoPlan, RechunkPlan, StagePlan};
pub use table::{rechunk_plan, rechunk_scan, RechunkExec, RechunkPlanner, RechunkTable};

use crate::config::ZarrConfig;
use crate::memory::Projection;
use crate::write::options::{Codec, ZarrVersion, ZarrWriteOptions};
use crate::write::scratch::{default_work_dir, ScratchStore};
use crate::write::sink::CancelOnDrop;
use crate::write::store::{consolidate, v2_compressor, v3_compressor};
use crate::write::target::CopyTarget;

use crate::table::ReadAheadPlan;
use crate::zarr::{
    chunk_keys, dimension_names, discover_arrays, is_sharded, open_storage, read_json, root_name,
    AllowedLocations, ArrayEntry, OpenedStore, ReadAhead, RemoteStorage, StoreAccess,
    StoreLocation,
};

/// Bytes planned per element of a variable-length data type.
const VARIABLE_ITEMSIZE: u64 = 64;

/// How a rechunk runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RechunkOptions {
    /// Bytes all tasks together may hold.
    pub allowed_mem: u64,
    /// Where intermediate arrays go (a fresh directory or object-store
    /// prefix inside it, removed at the end); `None`: the system's
    /// temporary directory.
    pub work_dir: Option<StoreLocation>,
    /// Most tasks at once.
    pub threads: usize,
    /// Chunk reads kept in flight ahead of the tasks when the source is in
    /// an object store (`zarrfusion.io_concurrency`; 0: on demand only).
    pub io_concurrency: usize,
    /// The session's object-store settings, for a source in a bucket with
    /// no store registered yet.
    pub storage_defaults: HashMap<String, String>,
    /// The source's own object-store options (the `OPTIONS` of the table
    /// it is read for); empty: the client registered for its bucket.
    pub source_storage: HashMap<String, String>,
    /// The locations the session may reach: the source, the target and the
    /// work directory must be under them.
    pub allowed: AllowedLocations,
}

impl Default for RechunkOptions {
    /// 2 GiB, the system's temporary directory, one task per core.
    fn default() -> Self {
        Self {
            allowed_mem: 2 << 30,
            work_dir: None,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            io_concurrency: ZarrConfig::default().io_concurrency,
            storage_defaults: HashMap::new(),
            source_storage: HashMap::new(),
            allowed: AllowedLocations::default(),
        }
    }
}

impl RechunkOptions {
    /// The options a session's runtime implies: its memory limit (2 GiB
    /// when unlimited), the directory its temporary files go to (`work_dir`,
    /// not the `datafusion-*` directory DataFusion makes in it for one
    /// process: there the scratch stores a killed process left would never
    /// be swept), one task per core.
    pub fn for_runtime(runtime: &RuntimeEnv) -> Self {
        let work_dir = (runtime.disk_manager.temp_dir_paths().into_iter().next()).map(|dir| {
            let per_process = (dir.file_name())
                .is_some_and(|name| name.to_string_lossy().starts_with("datafusion-"));
            match (per_process, dir.parent()) {
                (true, Some(parent)) => parent.to_path_buf(),
                _ => dir,
            }
        });
        let mut options = Self {
            work_dir: work_dir.map(StoreLocation::Local),
            ..Self::default()
        };
        if let MemoryLimit::Finite(limit) = runtime.memory_pool.memory_limit() {
            options.allowed_mem = limit as u64;
        }
        options
    }

    /// The options of a session: [`for_runtime`](Self::for_runtime), with
    /// `zarrfusion.work_dir` (a path or an object-store URL) when set.
    pub fn for_session(config: &ConfigOptions, runtime: &RuntimeEnv) -> Result<Self> {
        let mut options = Self::for_runtime(runtime);
        let zarr = ZarrConfig::of(config);
        options.allowed = zarr.allowed()?;
        if !zarr.work_dir.is_empty() {
            let work_dir = StoreLocation::parse(&zarr.work_dir)?;
            options.allowed.check(&work_dir, &zarr.work_dir)?;
            options.work_dir = Some(work_dir);
        }
        options.io_concurrency = zarr.io_concurrency;
        options.storage_defaults = zarr.object_store_defaults();
        Ok(options)
    }
}

/// How the target's arrays are encoded when not as the source's are: the
/// format version and the compression (`COPY ... STORED AS ZARR` options).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TargetEncoding {
    /// The compression of every target array.
    pub codec: Codec,
    /// The target's format version (a v3 source cannot be written as v2).
    pub zarr_format: ZarrVersion,
}

impl TargetEncoding {
    /// The encoding a COPY's write options ask for.
    pub fn of(options: &ZarrWriteOptions) -> Self {
        Self {
            codec: options.codec,
            zarr_format: options.zarr_format,
        }
    }
}

/// One array's rechunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArrayRechunk {
    /// The array's name in the store.
    pub name: String,
    /// Its dimension names.
    pub dims: Vec<String>,
    /// Its stages, memory and bytes.
    pub plan: RechunkPlan,
    /// The reads ahead of the tasks (of the first stage: a source in an
    /// object store; of the later ones: a `work_dir` in one, in the same
    /// memory), counted beside the plan's memory.
    pub read_ahead: ReadAheadPlan,
}

impl ArrayRechunk {
    /// Memory its tasks and reads ahead hold together at their peak.
    pub fn projected_memory(&self) -> u64 {
        (self.plan.projected_memory()).saturating_add(self.read_ahead.memory() as u64)
    }
}

/// What a rechunk did.
#[derive(Debug, Clone, PartialEq)]
pub struct RechunkSummary {
    /// Per array, the plan that ran.
    pub arrays: Vec<ArrayRechunk>,
    /// Decoded bytes read (a chunk read twice counts twice).
    pub bytes_read: u64,
    /// Decoded bytes written, intermediates included.
    pub bytes_written: u64,
    /// Decoded bytes written to the target.
    pub target_bytes: u64,
    /// Wall time.
    pub seconds: f64,
}

/// Writes each array's plan for `EXPLAIN`: chunks of every stage, tasks,
/// workers and bytes read and written, separated by commas.
pub fn fmt_array_plans<'a>(
    f: &mut std::fmt::Formatter<'_>,
    arrays: impl Iterator<Item = &'a ArrayRechunk>,
) -> std::fmt::Result {
    for (i, array) in arrays.enumerate() {
        let plan = &array.plan;
        let chunks: Vec<String> = plan.stages.iter().map(|s| format!("{:?}", s.to)).collect();
        let tasks: Vec<String> = plan.stages.iter().map(|s| s.tasks.to_string()).collect();
        write!(
            f,
            "{}{}: {:?} -> {} in {} stage{} (tasks {}, workers {}, read {}, write {}{})",
            if i == 0 { "" } else { ", " },
            array.name,
            plan.stages[0].from,
            chunks.join(" -> "),
            plan.stages.len(),
            if plan.stages.len() == 1 { "" } else { "s" },
            tasks.join("+"),
            plan.workers,
            human_readable_size(plan.bytes_read() as usize),
            human_readable_size(plan.bytes_written() as usize),
            array.read_ahead,
        )?;
    }
    Ok(())
}

/// An array to rechunk: the opened source and its plan.
struct Job {
    entry: ArrayEntry,
    source: Array<dyn ReadableListableStorageTraits>,
    rechunk: ArrayRechunk,
}

impl Clone for Job {
    fn clone(&self) -> Self {
        Self {
            entry: self.entry.clone(),
            source: self.source.with_storage(self.source.storage()),
            rechunk: self.rechunk.clone(),
        }
    }
}

/// Plans the rechunk of every array of the store at `source` to `chunks`
/// (`(dimension, length)` pairs) under `options`, reading metadata only.
/// Refuses unknown dimensions, sharded arrays and plans that do not fit
/// `allowed_mem`.
pub fn plan_store_rechunk(
    source: &str,
    chunks: &[(String, u64)],
    options: &RechunkOptions,
    runtime: &RuntimeEnv,
) -> Result<Vec<ArrayRechunk>> {
    Ok(open_jobs(source, chunks, None, options, runtime)?
        .2
        .into_iter()
        .map(|job| job.rechunk)
        .collect())
}

/// A store's storage, its object store when it is remote, and its arrays
/// opened and planned.
type OpenedJobs = (
    Arc<dyn ReadableListableStorageTraits>,
    Option<Arc<RemoteStorage>>,
    Vec<Job>,
);

/// Opens and plans the arrays of the store at `source` (only those named
/// in `arrays`, when given).
fn open_jobs(
    source: &str,
    chunks: &[(String, u64)],
    arrays: Option<&[String]>,
    options: &RechunkOptions,
    runtime: &RuntimeEnv,
) -> Result<OpenedJobs> {
    let location = StoreLocation::parse(source)?;
    options.allowed.check(&location, source)?;
    let opened = open_storage(
        source,
        &location,
        &options.source_storage,
        &options.storage_defaults,
        runtime,
    )?;
    plan_jobs(source, opened, chunks, arrays, options)
}

/// Plans the arrays of the store at `source`, opened as `opened` (only
/// those named in `arrays`, when given).
fn plan_jobs(
    source: &str,
    opened: OpenedStore,
    chunks: &[(String, u64)],
    arrays: Option<&[String]>,
    options: &RechunkOptions,
) -> Result<OpenedJobs> {
    let mut entries = discover_arrays(&opened, source, root_name(source))?;
    let storage = opened.storage;
    let remote = match opened.access {
        StoreAccess::Remote(remote) => Some(remote),
        StoreAccess::Local(_) => None,
    };
    if let Some(names) = arrays {
        entries.retain(|entry| names.contains(&entry.name));
    }
    let fail = |array: &str, message: String| {
        DataFusionError::Plan(format!(
            "rechunk of store '{source}', array '{array}': {message}"
        ))
    };
    let mut jobs = Vec::new();
    let mut all_dims: Vec<String> = Vec::new();
    for entry in entries {
        let array =
            Array::new_with_metadata(Arc::clone(&storage), &entry.path, entry.metadata.clone())
                .map_err(|e| fail(&entry.name, format!("cannot open: {e}")))?;
        if is_sharded(&entry.metadata) {
            return Err(fail(
                &entry.name,
                "sharded arrays cannot be rechunked yet".into(),
            ));
        }
        // Variable-length elements (strings) are planned at a nominal size.
        let itemsize = array
            .data_type()
            .fixed_size()
            .map_or(VARIABLE_ITEMSIZE, |n| n as u64);
        let attributes = match &entry.metadata {
            ArrayMetadata::V3(m) => m.attributes.clone(),
            ArrayMetadata::V2(m) => m.attributes.clone(),
        };
        let dims = dimension_names(&array, &attributes);
        let shape = array.shape().to_vec();
        let origin = vec![0; shape.len()];
        let source_chunks: Vec<u64> = match array.chunk_shape(&origin) {
            Ok(c) => c.iter().map(|n| n.get()).collect(),
            Err(_) => shape.clone(),
        };
        let target_chunks: Vec<u64> = dims
            .iter()
            .zip(&source_chunks)
            .map(|(d, &c)| chunks.iter().find(|(n, _)| n == d).map_or(c, |(_, n)| *n))
            .collect();
        // Reads ahead of the tasks (each decodes its chunks one after
        // another) of the first stage (a source in an object store) and of
        // the later ones (a work_dir in one) take at most a quarter of the
        // budget.
        let chunk_bytes = source_chunks
            .iter()
            .product::<u64>()
            .saturating_mul(itemsize);
        let remote_work_dir = matches!(options.work_dir, Some(StoreLocation::Remote(_)));
        let read_ahead = match remote.is_some() || remote_work_dir {
            true => ReadAheadPlan::for_chunks(
                usize::try_from(chunk_bytes).unwrap_or(usize::MAX),
                0,
                options.threads,
                options.io_concurrency,
            )
            .within(usize::try_from(options.allowed_mem / 4).unwrap_or(usize::MAX)),
            false => ReadAheadPlan::for_chunks(0, 0, 1, 0),
        };
        let plan = RechunkPlan::new(
            &shape,
            &source_chunks,
            &target_chunks,
            itemsize,
            options.allowed_mem - read_ahead.memory() as u64,
            options.threads,
        )
        .map_err(|no| {
            let store = format!("store '{source}', array '{}'", entry.name);
            no.refusal("Rechunk", &store, options.allowed_mem, read_ahead.memory())
        })?;
        for d in &dims {
            if !all_dims.contains(d) {
                all_dims.push(d.clone());
            }
        }
        jobs.push(Job {
            rechunk: ArrayRechunk {
                name: entry.name.clone(),
                dims,
                plan,
                read_ahead,
            },
            entry,
            source: array,
        });
    }
    for (dim, len) in chunks {
        if !all_dims.contains(dim) {
            return plan_err!(
                "rechunk of store '{source}': unknown dimension '{dim}' (dimensions: {})",
                all_dims.join(", ")
            );
        }
        if *len == 0 {
            return plan_err!(
                "rechunk of store '{source}': chunk length of '{dim}' must be positive"
            );
        }
    }
    Ok((storage, remote, jobs))
}

/// `metadata` with chunk shape `chunks`; `plain` also drops compression
/// (for intermediate arrays).
fn with_chunks(
    metadata: &ArrayMetadata,
    chunks: &[u64],
    plain: bool,
) -> Result<ArrayMetadata, String> {
    let text = |e: serde_json::Error| e.to_string();
    match metadata {
        ArrayMetadata::V3(m) => {
            let mut v = serde_json::to_value(m).map_err(text)?;
            v["chunk_grid"] = json!({"name": "regular", "configuration": {"chunk_shape": chunks}});
            if plain {
                v["codecs"] = json!([{"name": "bytes", "configuration": {"endian": "little"}}]);
            }
            serde_json::from_value(v)
                .map(ArrayMetadata::V3)
                .map_err(text)
        }
        ArrayMetadata::V2(m) => {
            let mut v = serde_json::to_value(m).map_err(text)?;
            v["chunks"] = json!(chunks);
            if plain {
                v["compressor"] = Value::Null;
                v["filters"] = Value::Null;
            }
            serde_json::from_value(v)
                .map(ArrayMetadata::V2)
                .map_err(text)
        }
    }
}

/// `metadata` in the format and compression of `encoding`: a v2 array
/// becomes v3 (its `_ARRAY_DIMENSIONS` becoming `dimension_names`, chunk
/// keys the v3 default), and the codecs after the array-to-bytes codec (or
/// the v2 compressor) are replaced by `encoding.codec`; filters and
/// array-to-array codecs stay. `dims` are the array's dimension names,
/// `width` its element size.
fn encode_as(
    metadata: ArrayMetadata,
    encoding: TargetEncoding,
    dims: &[String],
    width: usize,
) -> Result<ArrayMetadata, String> {
    let text = |e: serde_json::Error| e.to_string();
    let v3 = match (metadata, encoding.zarr_format) {
        (ArrayMetadata::V2(m), ZarrVersion::V2) => {
            let mut v = serde_json::to_value(&m).map_err(text)?;
            v["compressor"] = v2_compressor(encoding.codec);
            return serde_json::from_value(v)
                .map(ArrayMetadata::V2)
                .map_err(text);
        }
        (ArrayMetadata::V3(_), ZarrVersion::V2) => {
            return Err("a Zarr v3 array cannot be written as Zarr v2".into())
        }
        (ArrayMetadata::V2(m), ZarrVersion::V3) => {
            let v2 = serde_json::to_value(&m).map_err(text)?;
            let m = zarrs::convert::array_metadata_v2_to_v3(&m).map_err(|e| e.to_string())?;
            let mut v = serde_json::to_value(&m).map_err(text)?;
            v["chunk_key_encoding"] =
                json!({"name": "default", "configuration": {"separator": "/"}});
            v["dimension_names"] = json!(dims);
            let mut attributes = match v["attributes"].take() {
                serde_json::Value::Object(attributes) => attributes,
                _ => serde_json::Map::new(),
            };
            attributes.remove("_ARRAY_DIMENSIONS");
            // Readers mask a v2 array's fill value, but only a v3 array's
            // `_FillValue` attribute: keep the mask.
            if let Some(fill) = fill_value_attribute(&v2) {
                attributes.entry("_FillValue").or_insert(fill);
            }
            v["attributes"] = serde_json::Value::Object(attributes);
            v
        }
        (ArrayMetadata::V3(m), ZarrVersion::V3) => serde_json::to_value(&m).map_err(text)?,
    };
    let mut v = v3;
    let codecs = v["codecs"].as_array().cloned().unwrap_or_default();
    // The array-to-bytes codec: the one that is neither an array-to-array
    // codec before it nor a compressor after it.
    const ARRAY_TO_BYTES: [&str; 5] = ["bytes", "vlen-utf8", "vlen-bytes", "vlen_utf8", "packbits"];
    let Some(at) = codecs
        .iter()
        .position(|c| ARRAY_TO_BYTES.contains(&c["name"].as_str().unwrap_or_default()))
    else {
        return Err(format!(
            "cannot change the compression of codecs {}",
            Value::Array(codecs)
        ));
    };
    let mut kept: Vec<Value> = codecs[..=at].to_vec();
    kept.extend(v3_compressor(encoding.codec, width));
    v["codecs"] = Value::Array(kept);
    serde_json::from_value(v)
        .map(ArrayMetadata::V3)
        .map_err(text)
}

/// The `_FillValue` attribute xarray writes for the fill value of the v2
/// array metadata `v2` (as JSON): the number for integers, the base64 text
/// of the little-endian float64 bytes for floats; `None` without a fill
/// value.
fn fill_value_attribute(v2: &Value) -> Option<Value> {
    use base64::Engine;
    let fill = &v2["fill_value"];
    if fill.is_null() {
        return None;
    }
    let dtype = v2["dtype"].as_str()?;
    let kind = dtype.trim_start_matches(['<', '>', '|', '=']);
    let Some(width) = kind.strip_prefix('f') else {
        return Some(fill.clone());
    };
    let value = match fill {
        Value::Number(n) => n.as_f64()?,
        Value::String(s) => match s.as_str() {
            "NaN" => f64::NAN,
            "Infinity" => f64::INFINITY,
            "-Infinity" => f64::NEG_INFINITY,
            _ => return None,
        },
        _ => return None,
    };
    if !["2", "4", "8"].contains(&width) {
        return None;
    }
    // xarray writes (and reads) every float fill value as 8 bytes.
    Some(json!(
        base64::engine::general_purpose::STANDARD.encode(value.to_le_bytes())
    ))
}

/// Rechunks every array of the store at `source` (local path or URL) into
/// a new local store at `target` (which must not exist), with the chunk
/// lengths `chunks` (`(dimension, length)` pairs; other dimensions keep
/// theirs), inside `options.allowed_mem`. Stops, leaving nothing, when
/// `cancelled` is set.
pub fn rechunk_store(
    source: &str,
    target: &Path,
    chunks: &[(String, u64)],
    options: &RechunkOptions,
    runtime: &RuntimeEnv,
    cancelled: &AtomicBool,
) -> Result<RechunkSummary> {
    let display = target.to_string_lossy();
    let location = StoreLocation::Local(target.to_path_buf());
    (options.allowed).check(&location, &display)?;
    let to = CopyTarget::new(location, ZarrWriteOptions::default())?;
    to.check()?;
    PreparedRechunk::new(source, chunks, options, runtime)?.write_to(&to, cancelled)
}

/// A planned rechunk of a store: its arrays opened and their plans made
/// (metadata read, nothing copied yet). Writing it is two steps, so that
/// the target's metadata can be opened (and scanned) before its data exists:
/// [`write_metadata`](Self::write_metadata), then [`copy_data`](Self::copy_data).
pub struct PreparedRechunk {
    source: String,
    storage: Arc<dyn ReadableListableStorageTraits>,
    /// The source's object store, when it is remote (its reads ahead).
    remote: Option<Arc<RemoteStorage>>,
    jobs: Vec<Job>,
    work_dir: StoreLocation,
    runtime: Arc<RuntimeEnv>,
    encoding: Option<TargetEncoding>,
    /// The chunk lengths asked for and the options planned with (what a
    /// cluster's worker plans again from).
    chunks: Vec<(String, u64)>,
    options: RechunkOptions,
    /// Planned from the metadata of a store not written yet
    /// ([`planned_before_written`](PreparedRechunk::planned_before_written)):
    /// its tasks run elsewhere, once it is.
    before_written: bool,
}

impl std::fmt::Debug for PreparedRechunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedRechunk")
            .field("source", &self.source)
            .field("arrays", &self.arrays().collect::<Vec<_>>())
            .finish()
    }
}

impl PreparedRechunk {
    /// Plans the rechunk of every array of the store at `source` to
    /// `chunks` under `options` (see [`plan_store_rechunk`]).
    pub fn new(
        source: &str,
        chunks: &[(String, u64)],
        options: &RechunkOptions,
        runtime: &RuntimeEnv,
    ) -> Result<Self> {
        Self::new_for(source, chunks, None, None, options, runtime)
    }

    /// [`new`](Self::new) for the arrays named in `arrays` only (all when
    /// `None`), written with `encoding` instead of the source's codecs and
    /// format when given. Refuses to write a v3 array as v2.
    pub fn new_for(
        source: &str,
        chunks: &[(String, u64)],
        arrays: Option<&[String]>,
        encoding: Option<TargetEncoding>,
        options: &RechunkOptions,
        runtime: &RuntimeEnv,
    ) -> Result<Self> {
        let opened = open_jobs(source, chunks, arrays, options, runtime)?;
        Self::of_jobs(source, opened, chunks, encoding, options, runtime)
    }

    /// The rechunk of the store a cluster's tasks will write at `source`
    /// (an intermediate store of a COPY in `work_dir`), planned from its
    /// metadata held in `metadata` (what will be written there, written
    /// nowhere yet): what the session sends the workers and shows, never
    /// run itself (its tasks are refused); the workers plan it again from
    /// the store once it is written
    /// ([`RechunkTasks::planned_when_run`]).
    pub fn planned_before_written(
        source: &str,
        metadata: zarrs::storage::ReadableListableStorage,
        chunks: &[(String, u64)],
        encoding: Option<TargetEncoding>,
        options: &RechunkOptions,
        runtime: &RuntimeEnv,
    ) -> Result<Self> {
        let location = StoreLocation::parse(source)?;
        options.allowed.check(&location, source)?;
        let opened = OpenedStore {
            storage: metadata,
            access: StoreAccess::Local(PathBuf::new()),
        };
        let jobs = plan_jobs(source, opened, chunks, None, options)?;
        let mut prepared = Self::of_jobs(source, jobs, chunks, encoding, options, runtime)?;
        prepared.before_written = true;
        Ok(prepared)
    }

    fn of_jobs(
        source: &str,
        (storage, remote, jobs): OpenedJobs,
        chunks: &[(String, u64)],
        encoding: Option<TargetEncoding>,
        options: &RechunkOptions,
        runtime: &RuntimeEnv,
    ) -> Result<Self> {
        let prepared = Self {
            source: source.to_string(),
            storage,
            remote,
            jobs,
            work_dir: options.work_dir.clone().unwrap_or_else(default_work_dir),
            runtime: Arc::new(runtime.clone()),
            encoding,
            chunks: chunks.to_vec(),
            options: options.clone(),
            before_written: false,
        };
        for job in &prepared.jobs {
            prepared.target_metadata(job)?;
        }
        Ok(prepared)
    }

    /// Refuses to copy a rechunk planned before its source was written.
    fn check_written(&self) -> Result<()> {
        match self.before_written {
            true => internal_err!(
                "the rechunk of '{}' was planned before the store was written: its tasks run \
                 on a cluster's workers",
                self.source
            ),
            false => Ok(()),
        }
    }

    /// The rechunk of the arrays `which` accepts only (a `rechunk(...)`
    /// copies the variables its query reads).
    pub fn retained(&self, which: impl Fn(&ArrayRechunk) -> bool) -> Self {
        Self {
            source: self.source.clone(),
            storage: Arc::clone(&self.storage),
            remote: self.remote.clone(),
            jobs: (self.jobs.iter())
                .filter(|job| which(&job.rechunk))
                .cloned()
                .collect(),
            work_dir: self.work_dir.clone(),
            runtime: Arc::clone(&self.runtime),
            encoding: self.encoding,
            chunks: self.chunks.clone(),
            options: self.options.clone(),
            before_written: self.before_written,
        }
    }

    /// Where intermediate arrays go (a scratch store inside it).
    pub fn work_dir(&self) -> &StoreLocation {
        &self.work_dir
    }

    /// The runtime the rechunk opens stores with.
    pub fn runtime(&self) -> &RuntimeEnv {
        &self.runtime
    }

    /// The store being rechunked, as given.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Each array's plan.
    pub fn arrays(&self) -> impl Iterator<Item = &ArrayRechunk> {
        self.jobs.iter().map(|job| &job.rechunk)
    }

    /// The most memory any array's tasks hold together.
    pub fn projected_memory(&self) -> u64 {
        self.arrays()
            .map(ArrayRechunk::projected_memory)
            .max()
            .unwrap_or(0)
    }

    /// The rechunk as its tasks travel to a cluster's workers, its
    /// intermediate arrays (when an array takes more than one stage) in
    /// the scratch store at `work` (a location every worker reaches).
    pub fn cluster_tasks(&self, work: Option<&StoreLocation>) -> Result<RechunkTasks> {
        let mut arrays = Vec::new();
        for job in &self.jobs {
            let target =
                metadata_json(&self.target_metadata(job)?).map_err(|e| self.fail(job, e))?;
            let stages = (job.rechunk.plan.stages.iter())
                .map(|s| StageTasks {
                    to: s.to.clone(),
                    region: s.region.clone(),
                    tasks: s.tasks,
                    bytes_written: s.bytes_written,
                })
                .collect();
            arrays.push(ArrayTasks {
                name: job.rechunk.name.clone(),
                stages,
                workers: job.rechunk.plan.workers,
                target,
            });
        }
        let sorted = |map: &HashMap<String, String>| map.clone().into_iter().collect();
        Ok(RechunkTasks {
            source: self.source.clone(),
            source_storage: sorted(&self.options.source_storage),
            storage_defaults: sorted(&self.options.storage_defaults),
            chunks: self.chunks.clone(),
            encoding: self.encoding,
            io_concurrency: self.options.io_concurrency,
            work: work.map(StoreLocation::to_string),
            arrays,
            planned_when_run: self.before_written,
        })
    }

    /// The rounds a cluster runs: one per stage of the array with the most.
    pub fn rounds(&self) -> usize {
        (self.arrays())
            .map(|a| a.plan.stages.len())
            .max()
            .unwrap_or(0)
    }

    /// Whether an array takes more than one stage (its intermediate arrays
    /// go to a scratch store).
    pub fn has_intermediates(&self) -> bool {
        self.rounds() > 1
    }

    /// The rechunk `tasks` received by a cluster's worker, planned again
    /// under the worker's `options` (its own `allowed_locations` and
    /// memory; the source's storage options and the reads ahead as sent):
    /// each array's stages write the chunks and copy the regions sent,
    /// refused when the arrays, their target metadata or the stages no
    /// longer match the source, or when the tasks cannot fit the worker's
    /// `allowed_mem`.
    pub fn for_cluster_tasks(
        tasks: &RechunkTasks,
        mut options: RechunkOptions,
        runtime: &RuntimeEnv,
    ) -> Result<Self> {
        let map = |m: &BTreeMap<String, String>| m.clone().into_iter().collect();
        options.source_storage = map(&tasks.source_storage);
        options.storage_defaults = map(&tasks.storage_defaults);
        options.io_concurrency = tasks.io_concurrency;
        let names: Vec<String> = tasks.arrays.iter().map(|a| a.name.clone()).collect();
        let mut prepared = Self::new_for(
            &tasks.source,
            &tasks.chunks,
            Some(&names),
            tasks.encoding,
            &options,
            runtime,
        )?;
        let found: Vec<&str> = prepared.arrays().map(|a| a.name.as_str()).collect();
        if found != names {
            return plan_err!(
                "rechunk of store '{}': the plan was made for arrays [{}], the store has [{}]",
                tasks.source,
                names.join(", "),
                found.join(", ")
            );
        }
        let mut memory = 0u64;
        for (i, sent) in tasks.arrays.iter().enumerate() {
            let job = &prepared.jobs[i];
            let fail = |e: String| prepared.fail(job, e);
            let target = metadata_json(&prepared.target_metadata(job)?).map_err(fail)?;
            if target != sent.target {
                return Err(fail("its metadata changed since the plan was made".into()));
            }
            let plan = &job.rechunk.plan;
            let (source, target) = (&plan.stages[0].from, &plan.stages[plan.stages.len() - 1].to);
            if sent.stages.is_empty() || sent.stages.len() > plan::MAX_STAGES {
                return Err(fail(format!(
                    "{} stages sent (1 to {})",
                    sent.stages.len(),
                    plan::MAX_STAGES
                )));
            }
            let mut stages: Vec<StagePlan> = Vec::new();
            for s in &sent.stages {
                let from = stages.last().map_or(source, |before| &before.to);
                let stage =
                    StagePlan::for_region(&plan.shape, from, &s.to, &s.region, plan.itemsize)
                        .map_err(fail)?;
                if (stage.tasks, stage.bytes_written) != (s.tasks, s.bytes_written) {
                    return Err(fail(format!(
                        "a stage sent as {} tasks writing {} bytes makes {} tasks writing {} \
                         bytes",
                        s.tasks, s.bytes_written, stage.tasks, stage.bytes_written
                    )));
                }
                stages.push(stage);
            }
            if stages.last().map(|s| &s.to) != Some(target) {
                return Err(fail(format!(
                    "its stages end in chunks {:?}, not the target's {target:?}",
                    sent.stages.last().map(|s| &s.to)
                )));
            }
            // At most the threads this worker has (fewer hold less memory).
            let threads = options.threads.clamp(1, crate::config::MAX_THREADS);
            let rechunk = ArrayRechunk {
                plan: RechunkPlan {
                    shape: plan.shape.clone(),
                    itemsize: plan.itemsize,
                    stages,
                    workers: sent.workers.clamp(1, threads),
                },
                ..job.rechunk.clone()
            };
            memory = memory.max(rechunk.projected_memory());
            prepared.jobs[i].rechunk = rechunk;
        }
        let store = format!("store '{}'", tasks.source);
        let memory = usize::try_from(memory).unwrap_or(usize::MAX);
        Projection::new("RechunkTasksExec", &store, 1, "round", memory)
            .holding("its largest array's tasks at once")
            .advice("raise this worker's allowed_mem")
            .check(usize::try_from(options.allowed_mem).unwrap_or(usize::MAX))?;
        Ok(prepared)
    }

    /// The tasks of round `round` (every array's stage `round`, for the
    /// arrays that have one), numbered across the arrays in order.
    pub fn round_tasks(&self, round: usize) -> u64 {
        (self.arrays())
            .filter_map(|a| a.plan.stages.get(round))
            .map(|s| s.tasks)
            .sum()
    }

    /// Where array number `array` (of this rechunk's) keeps the output of
    /// its stage `stage` in the scratch store.
    fn intermediate_path(array: usize, stage: usize) -> String {
        format!("/{array}/stage{stage}")
    }

    /// The scratch paths round `round` has read and no later round reads:
    /// each array's intermediate array of the stage before.
    pub fn read_by_round(&self, round: usize) -> Vec<String> {
        match round {
            0 => Vec::new(),
            _ => (self.arrays().enumerate())
                .filter(|(_, a)| a.plan.stages.len() > round)
                .map(|(i, _)| Self::intermediate_path(i, round - 1))
                .collect(),
        }
    }

    /// Copies the tasks numbered `run` (across the arrays, see
    /// [`round_tasks`](Self::round_tasks)) of round `round` into the store
    /// `out`, whose metadata the session wrote, and the intermediate
    /// arrays in `work` (a cluster's task): the tasks run and the decoded
    /// bytes written. Each task writes only once `may_write` says the
    /// target still wants it.
    pub fn copy_task_run(
        &self,
        out: &ReadableWritableListableStorage,
        work: Option<&ScratchStore>,
        (round, run): (usize, std::ops::Range<u64>),
        may_write: &(dyn Fn() -> Result<(), String> + Sync),
        cancelled: &AtomicBool,
    ) -> Result<copy::StageCounts> {
        self.check_written()?;
        let (done, _) = self.run_round(
            out,
            work,
            (round, run),
            &|_| true,
            Some(may_write),
            cancelled,
        )?;
        Ok(done)
    }

    /// The tasks numbered `run` of round `round`, of the arrays `which`
    /// accepts (numbered across all the arrays all the same): the tasks
    /// run and the decoded bytes written, and of those the bytes written
    /// into `out` (the arrays whose last stage this round is). One
    /// implementation for a cluster's tasks and a single process's rounds
    /// ([`copy_arrays`](Self::copy_arrays)).
    fn run_round(
        &self,
        out: &ReadableWritableListableStorage,
        work: Option<&ScratchStore>,
        (round, run): (usize, std::ops::Range<u64>),
        which: &dyn Fn(&ArrayRechunk) -> bool,
        may_write: Option<&(dyn Fn() -> Result<(), String> + Sync)>,
        cancelled: &AtomicBool,
    ) -> Result<(copy::StageCounts, u64)> {
        let mut first = 0u64;
        let mut done = copy::StageCounts::default();
        let mut target_bytes = 0u64;
        for (index, job) in self.jobs.iter().enumerate() {
            let fail = |e: String| self.fail(job, e);
            let plan = &job.rechunk.plan;
            let Some(stage) = plan.stages.get(round) else {
                continue;
            };
            let tasks = first..first + stage.tasks;
            first = tasks.end;
            let mine = run.start.max(tasks.start)..run.end.min(tasks.end);
            if mine.is_empty() || !which(&job.rechunk) {
                continue;
            }
            let mine = mine.start - tasks.start..mine.end - tasks.start;
            let work_for = |stage: usize| {
                let work = work.ok_or_else(|| {
                    fail("its rechunk has intermediate stages but no work store".into())
                })?;
                let plain = job.source.data_type().fixed_size().is_some();
                let md = with_chunks(&job.entry.metadata, &plan.stages[stage].to, plain)
                    .map_err(fail)?;
                let path = Self::intermediate_path(index, stage);
                Array::new_with_metadata(Arc::clone(work.storage()), &path, md)
                    .map_err(|e| fail(e.to_string()))
            };
            let last = round + 1 == plan.stages.len();
            let output = match last {
                true => Array::new_with_metadata(
                    Arc::clone(out),
                    &job.entry.path,
                    self.target_metadata(job)?,
                )
                .map_err(|e| fail(e.to_string()))?,
                false => work_for(round)?,
            };
            let counts = match round {
                0 => {
                    let read_ahead = match &self.remote {
                        Some(remote) => self.source_read_ahead(job, stage, remote, mine.clone())?,
                        None => None,
                    };
                    let ahead = read_ahead.as_ref();
                    let source = &job.source;
                    copy::run_stage(
                        stage,
                        Some(mine),
                        source,
                        &output,
                        plan.workers,
                        ahead,
                        may_write,
                        cancelled,
                    )
                }
                _ => {
                    let input = work_for(round - 1)?;
                    let read_ahead = match work.and_then(|w| w.remote()) {
                        Some(remote) => {
                            self.intermediate_read_ahead(job, stage, &input, remote, mine.clone())?
                        }
                        None => None,
                    };
                    let ahead = read_ahead.as_ref();
                    copy::run_stage(
                        stage,
                        Some(mine),
                        &input,
                        &output,
                        plan.workers,
                        ahead,
                        may_write,
                        cancelled,
                    )
                }
            }
            .map_err(&fail)?;
            done.add(&counts);
            if last {
                target_bytes += counts.bytes_written;
            }
        }
        if cancelled.load(std::sync::atomic::Ordering::Relaxed) {
            return exec_err!("the rechunk of '{}' was cancelled", self.source);
        }
        Ok((done, target_bytes))
    }

    /// Reads of an intermediate array `input` (in an object-store
    /// `work_dir`) ahead of the tasks `tasks` of `job`'s stage `stage`.
    fn intermediate_read_ahead<S: ?Sized>(
        &self,
        job: &Job,
        stage: &StagePlan,
        input: &Array<S>,
        remote: &Arc<RemoteStorage>,
        tasks: std::ops::Range<u64>,
    ) -> Result<Option<ReadAhead>> {
        let input = Array::new_with_metadata(
            Arc::clone(remote) as Arc<dyn ReadableListableStorageTraits>,
            input.path().as_str(),
            input.metadata().clone(),
        )
        .map_err(|e| self.fail(job, e.to_string()))?;
        let cells: u64 = stage.from.iter().product();
        let chunk_bytes = cells.saturating_mul(job.rechunk.plan.itemsize);
        let regions = stage.regions(input.shape());
        Ok(job
            .rechunk
            .read_ahead
            .for_chunk_bytes(usize::try_from(chunk_bytes).unwrap_or(usize::MAX))
            .start_keys(
                Arc::clone(remote),
                tasks,
                job.rechunk.plan.workers,
                move |task| chunk_keys(&input, &regions.block(task)),
            ))
    }
    /// Reads of `job`'s source (in an object store) ahead of the tasks
    /// `tasks` of its first stage `stage`.
    fn source_read_ahead(
        &self,
        job: &Job,
        stage: &StagePlan,
        remote: &Arc<RemoteStorage>,
        tasks: std::ops::Range<u64>,
    ) -> Result<Option<ReadAhead>> {
        // The keys are found by the window's own copy of the source (an
        // array opens from its metadata alone).
        let source = Array::new_with_metadata(
            Arc::clone(&self.storage),
            &job.entry.path,
            job.entry.metadata.clone(),
        )
        .map_err(|e| self.fail(job, e.to_string()))?;
        let regions = stage.regions(source.shape());
        Ok(job.rechunk.read_ahead.start_keys(
            Arc::clone(remote),
            tasks,
            job.rechunk.plan.workers,
            move |task| chunk_keys(&source, &regions.block(task)),
        ))
    }

    fn target_metadata(&self, job: &Job) -> Result<ArrayMetadata> {
        let plan = &job.rechunk.plan;
        let last = &plan.stages[plan.stages.len() - 1];
        let metadata =
            with_chunks(&job.entry.metadata, &last.to, false).map_err(|e| self.fail(job, e))?;
        match self.encoding {
            None => Ok(metadata),
            Some(encoding) => {
                let width = job.source.data_type().fixed_size().unwrap_or(1);
                encode_as(metadata, encoding, &job.rechunk.dims, width)
                    .map_err(|e| self.fail(job, e))
            }
        }
    }

    fn fail(&self, job: &Job, message: String) -> DataFusionError {
        DataFusionError::Execution(format!(
            "rechunk of store '{}', array '{}': {message}",
            self.source, job.rechunk.name
        ))
    }

    /// Writes the whole target into a COPY's target `to`, atomically
    /// ([`CopyTarget::write_staged`]: beside a local target and renamed
    /// into place, or into an empty object-store prefix claimed with the
    /// COPY's object-store settings, erased when this fails or `cancelled`
    /// is set): the data first, the metadata last, so that readers of an
    /// object store see no store until it is complete.
    pub fn write_to(&self, to: &CopyTarget, cancelled: &AtomicBool) -> Result<RechunkSummary> {
        to.write_staged(&to.staged()?, self.runtime(), cancelled, |out| {
            let summary = self.copy_data(out, cancelled)?;
            self.write_metadata(out)?;
            Ok(summary)
        })
    }

    /// Writes the target's metadata (arrays in their new chunks, the
    /// group's attributes, consolidated metadata) into the store `out`.
    pub fn write_metadata(&self, out: &ReadableWritableListableStorage) -> Result<()> {
        let mut consolidated = Map::new();
        for job in &self.jobs {
            let metadata = self.target_metadata(job)?;
            record(&mut consolidated, &job.rechunk.name, &metadata)
                .map_err(|e| self.fail(job, e))?;
            let output = Array::new_with_metadata(Arc::clone(out), &job.entry.path, metadata)
                .map_err(|e| self.fail(job, e.to_string()))?;
            output
                .store_metadata()
                .map_err(|e| self.fail(job, e.to_string()))?;
        }
        let v3 = self.encoding.map(|e| e.zarr_format == ZarrVersion::V3);
        write_group(
            &self.storage,
            &self.source,
            out,
            &self.jobs,
            v3,
            consolidated,
        )
    }

    /// Copies every array's data into the store `out`, whose metadata
    /// [`write_metadata`](Self::write_metadata) wrote, through intermediate
    /// arrays in a fresh scratch store under the work directory (erased
    /// however the copy ends). Stops with an error when `cancelled` is set.
    pub fn copy_data(
        &self,
        out: &ReadableWritableListableStorage,
        cancelled: &AtomicBool,
    ) -> Result<RechunkSummary> {
        self.copy_arrays(out, None, |_| true, cancelled)
    }

    /// [`copy_data`](Self::copy_data) for the arrays `which` accepts: the
    /// rounds a cluster runs ([`copy_task_run`](Self::copy_task_run)),
    /// every task of each in this process, each round's intermediate
    /// arrays erased once the next round has read them (in `work` when
    /// given, else in a scratch store of their own in `work_dir`).
    pub fn copy_arrays(
        &self,
        out: &ReadableWritableListableStorage,
        work: Option<&ScratchStore>,
        which: impl Fn(&ArrayRechunk) -> bool,
        cancelled: &AtomicBool,
    ) -> Result<RechunkSummary> {
        self.check_written()?;
        let started = Instant::now();
        let arrays: Vec<ArrayRechunk> = self.arrays().filter(|a| which(a)).cloned().collect();
        let rounds = arrays.iter().map(|a| a.plan.stages.len()).max();
        let own = match (rounds.unwrap_or(0) > 1, work) {
            (true, None) => Some(ScratchStore::create(
                &self.work_dir,
                "zarrfusion-rechunk",
                "",
                &self.runtime,
            )?),
            _ => None,
        };
        let scratch = own.as_ref().or(work);
        let mut summary = RechunkSummary {
            bytes_read: 0,
            arrays,
            bytes_written: 0,
            target_bytes: 0,
            seconds: 0.0,
        };
        for round in 0..rounds.unwrap_or(0) {
            let run = (round, 0..self.round_tasks(round));
            let (counts, target_bytes) =
                self.run_round(out, scratch, run, &which, None, cancelled)?;
            summary.bytes_read += counts.bytes_read;
            summary.bytes_written += counts.bytes_written;
            summary.target_bytes += target_bytes;
            if let Some(work) = scratch {
                for read in self.read_by_round(round) {
                    work.erase(&read);
                }
            }
        }
        summary.seconds = started.elapsed().as_secs_f64();
        Ok(summary)
    }
}

/// [`rechunk_store`] on a blocking thread; dropping the future (a
/// cancelled query, Ctrl-C) cancels the rechunk, which leaves nothing.
pub async fn rechunk_store_async(
    source: String,
    target: PathBuf,
    chunks: Vec<(String, u64)>,
    options: RechunkOptions,
    runtime: Arc<RuntimeEnv>,
) -> Result<RechunkSummary> {
    let cancelled = Arc::new(AtomicBool::new(false));
    let mut guard = CancelOnDrop(Arc::clone(&cancelled), false);
    let summary = tokio::task::spawn_blocking(move || {
        rechunk_store(&source, &target, &chunks, &options, &runtime, &cancelled)
    })
    .await
    .map_err(|e| DataFusionError::Execution(format!("the rechunk stopped: {e}")))?;
    guard.1 = true;
    summary
}

/// An array's metadata as JSON.
fn metadata_json(metadata: &ArrayMetadata) -> Result<Value, String> {
    match metadata {
        ArrayMetadata::V3(m) => serde_json::to_value(m),
        ArrayMetadata::V2(m) => serde_json::to_value(m),
    }
    .map_err(|e| e.to_string())
}

/// Adds an array's metadata to the consolidated metadata.
fn record(
    consolidated: &mut Map<String, Value>,
    name: &str,
    metadata: &ArrayMetadata,
) -> Result<(), String> {
    let (json, v2) = match metadata {
        ArrayMetadata::V3(m) => (serde_json::to_value(m), false),
        ArrayMetadata::V2(m) => (serde_json::to_value(m), true),
    };
    consolidate(consolidated, name, json.map_err(|e| e.to_string())?, v2);
    Ok(())
}

/// Writes the group's metadata (its attributes copied, consolidated
/// metadata of the new arrays), unless the store's root is an array.
///
/// The group is written in the source's format, or as v3 when `v3` says so
/// (a v2 group's attributes then become the v3 group's).
fn write_group(
    storage: &Arc<dyn ReadableListableStorageTraits>,
    source: &str,
    out: &ReadableWritableListableStorage,
    jobs: &[Job],
    v3: Option<bool>,
    mut consolidated: Map<String, Value>,
) -> Result<()> {
    if jobs.iter().any(|j| j.entry.path == "/") {
        return Ok(());
    }
    let source_v3 = read_json(storage, source, "", "zarr.json")?;
    let attrs = match &source_v3 {
        Some(root) => root.get("attributes").cloned(),
        None => read_json(storage, source, "", ".zattrs")?,
    }
    .unwrap_or_else(|| json!({}));
    if v3.unwrap_or(source_v3.is_some()) {
        let mut root = source_v3.unwrap_or_else(
            || json!({"zarr_format": 3, "node_type": "group", "attributes": attrs}),
        );
        root["consolidated_metadata"] = json!({
            "kind": "inline",
            "must_understand": false,
            "metadata": consolidated,
        });
        return set_json(out, "zarr.json", &root);
    }
    let group =
        read_json(storage, source, "", ".zgroup")?.unwrap_or_else(|| json!({"zarr_format": 2}));
    set_json(out, ".zgroup", &group)?;
    set_json(out, ".zattrs", &attrs)?;
    consolidated.insert(".zgroup".into(), group);
    consolidated.insert(".zattrs".into(), attrs);
    set_json(
        out,
        ".zmetadata",
        &json!({"zarr_consolidated_format": 1, "metadata": consolidated}),
    )
}

/// Writes `value` as indented JSON at `key` of the store `out`.
fn set_json(out: &ReadableWritableListableStorage, key: &str, value: &Value) -> Result<()> {
    let text = serde_json::to_vec_pretty(value)
        .map_err(|e| DataFusionError::Execution(format!("cannot write {key}: {e}")))?;
    let key = StoreKey::new(key)
        .map_err(|e| DataFusionError::Execution(format!("cannot write {key}: {e}")))?;
    out.set(&key, text.into())
        .map_err(|e| DataFusionError::Execution(format!("cannot write {key}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v2_fill_values_become_the_fill_value_attributes_xarray_writes() {
        let attribute = |dtype: &str, fill: Value| {
            fill_value_attribute(&json!({"dtype": dtype, "fill_value": fill}))
        };
        assert_eq!(attribute("<i2", json!(-32767)), Some(json!(-32767)));
        assert_eq!(attribute("|u1", json!(255)), Some(json!(255)));
        // float64 bytes, whatever the float's width (as xarray decodes them).
        assert_eq!(attribute("<f4", json!("NaN")), Some(json!("AAAAAAAA+H8=")));
        assert_eq!(attribute("<f8", json!(1.5)), Some(json!("AAAAAAAA+D8=")));
        assert_eq!(attribute("<f8", Value::Null), None);
    }
}

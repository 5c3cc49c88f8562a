//! How zarrfusion's plan nodes cross the network to a worker.
//!
//! A [`ZarrScanExec`] is sent as the location and options its table was
//! opened with, the table's expected columns, and the scan's projection,
//! selection, blocks, partitions, limit, batch size, read-ahead and tasks
//! (JSON). The worker opens the table again (its own `allowed_locations`
//! apply, not the sender's), checks that the columns are still those the
//! plan was made for and that every number fits the table, fits the scan
//! to its own `allowed_mem`, and refuses a scan that cannot fit it. A node
//! the codec does not know is an error naming it. The table of an aligned
//! join's zip travels as both tables' sources: the worker opens each and
//! zips them again ([`GridTable::zip`]), refusing tables no longer on one
//! grid.
//!
//! A [`RollingWindowExec`] travels as its table's source, the columns it
//! reads, its arguments and input columns (protobuf physical
//! expressions), its aggregates and frames, its selection, blocks,
//! partitions and tasks; the worker checks them as a scan's, bounds the
//! frames as the planner does ([`MAX_FRAME`]) and fits the window to its
//! own `allowed_mem`.
//!
//! An [`FftExec`] reading a variable block by block (itself, or through
//! inner transforms: a chain) travels as the variable's table source, its
//! name, each transform's function and options as SQL names them, its
//! output columns, selection, block shape, partitions, limit, batch size,
//! read-ahead and tasks; the worker opens the table, makes the transforms
//! again with SQL's checks, refuses blocks that cut a transformed line
//! and fits the transform to its own `allowed_mem` on its own device. A
//! transform whose path makes a store in `work_dir` first (a rechunked
//! copy, the four-step passes, a staged transform) is sent only once that
//! store is made on the workers (the copy's rounds, the passes or the
//! first stage as stages of their own before it: it then carries the
//! copy's location or the four-step plan), else it runs in the session
//! ([`crate::distributed::tasks`] gives it one task); the stage
//! after a staged transform's first, reading its stored output by whole
//! lines, travels as the transform as asked (the chain), the first stage
//! (its chain), the store the session made in `work_dir` and its chunks,
//! the first stage's blocks and this stage's transform: the worker makes
//! both again, refuses a store not named as a staged transform's or not
//! holding the array as the first stage writes it, and reads it once its
//! input (the first stage's counts, broadcast) says every block is there.
//! A
//! [`BlockwiseTasksExec`] whose kernel is a transform's blocks (a run of a
//! `COPY` of a transform's blocks, or of the blocks of a staged transform's
//! first stage) sends, as the kernel, the same chain and its blocks' shape
//! beside the step's [`BlockwiseTasks`] (the target's chunks and encoding,
//! where it is staged); the worker also refuses blocks that are
//! not whole chunks of the target and targets that are not a COPY's or a
//! staged transform's store (which must hold the array as the tasks write
//! it). A COPY of a transform, or a staged transform's first stage, on
//! the four-step path sends its one transform and its four-step plan and
//! intermediates as a pass does;
//! the worker opens them as a pass's (the passes ran before, as stages of
//! their own) and refuses blocks that are not whole blocks of its output.
//! A COPY of a transform of a rechunked copy of its variable (the copy's
//! rounds ran on the workers before) sends the transform of the variable
//! as stored and the copy's location, which the worker opens and checks
//! as a transform's read of the copy. A COPY of a staged transform (its
//! first stage's rounds ran on the workers before) sends the transform as
//! asked and the first stage as the stage after it does for a query,
//! which the worker makes and checks the same way.
//!
//! A [`RechunkTasksExec`] (a round of a `COPY`'s rechunk tasks) travels as
//! the rechunk's plain data ([`RechunkTasks`]: source, chunk lengths, each
//! array's stages (chunks and task regions) and target metadata, the
//! scratch store), where it writes, its round and its task count; the
//! worker plans the rechunk again from the source, refuses it when the
//! metadata or stages no longer match or its tasks cannot fit the worker's
//! `allowed_mem`, and writes only into a COPY's temporary directory, a
//! rechunk's scratch store or an object-store prefix its
//! `allowed_locations` permit.
//!
//! A [`DenseReductionExec`] giving a task's partial states travels the
//! same way, with the columns it reads, its grouped dimensions, its
//! aggregates (their arguments and row filter as DataFusion's protobuf
//! physical expressions) and the schema of its states. The worker checks
//! them as a scan's, bounds the group state as the planner does
//! ([`MAX_STATE_BYTES`]: the dimensions grouped by as they are before any
//! key is evaluated, then the groups the keys of functions of a coordinate
//! make, such as 12 months of a long time axis), and fits the reduction to
//! its own `allowed_mem`. A scan or reduction reading tables joined in (a
//! broadcast join's) travels with them: per table, the functions of the
//! grid's coordinates it is keyed by and the columns it gives; its rows
//! are the node's inputs, checked to have those columns.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::{Arc, Mutex};

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::common::{
    exec_datafusion_err, human_readable_size, internal_err, not_impl_err, plan_err, resources_err,
    Result,
};
use datafusion::execution::memory_pool::MemoryLimit;
use datafusion::execution::TaskContext;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::coop::CooperativeExec;
use datafusion::physical_plan::empty::EmptyExec;
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion::physical_plan::ExecutionPlan;
use datafusion_proto::physical_plan::from_proto::parse_physical_expr;
use datafusion_proto::physical_plan::to_proto::serialize_physical_expr;
use datafusion_proto::physical_plan::{PhysicalExtensionCodec, PhysicalProtoConverterExtension};
use datafusion_proto::protobuf::PhysicalExprNode;
use prost::Message;
use serde::{Deserialize, Serialize};

use crate::array::blockwise::{
    BlockwiseTasks, BlockwiseTasksExec, ChunksInto, Evaluate, JoinedMemory, SelectedGrid, Step,
    StepWriters,
};
use crate::array::broadcast::keyed_dim;
use crate::array::copy::rolling::RollChunks;
use crate::array::fft::copy::{received_transform_tasks, transform_writes};
use crate::array::fft::exec::FftBlocks;
use crate::array::fft::four_step::{FourStep, FourStepInput, FourStepPlan};
use crate::array::fft::passes::{pass_writes, PassBlocks};
use crate::array::fft::source::StoredStage;
use crate::array::fft::source::{DetrendedSource, RechunkedVariable};
use crate::array::fft::staged::{LaterStage, ReceivedStage, StagedTransform};
use crate::array::fft::{
    ArraySource, Detrend, DetrendFitExec, FftExec, FftOptions, FftTable, FittedExec,
};
use crate::array::rechunk::{
    PreparedRechunk, RechunkExec, RechunkOptions, RechunkTasks, RechunkTasksExec,
};
use crate::array::reduce::MAX_STATE_BYTES;
use crate::array::rolling::exec::{PhysicalRoll, Rolling, RollingParts};
use crate::array::rolling::{Frame, RollOp, RollingWindowExec, MAX_FRAME};
use crate::array::{
    key_schema, Bands, DenseMergeExec, DenseReductionExec, KeySpec, Merged, ReduceOp, ReduceSpec,
    ReductionParts,
};
use crate::config::{ZarrConfig, MAX_BATCH_ROWS};
use crate::device::choose_device;
use crate::distributed::barrier::AfterExec;
use crate::error::lock;
use crate::table::{
    open_dataset_blocking, run_blocking, BlockGrid, BlockRead, Broadcast, BroadcastInputs,
    GridSource, GridTable, ReadsBroadcasts, Selection, TableSource, ZarrScanExec, ZarrTableOptions,
    TASKS_OF_STAGE,
};
use crate::write::target::StagedTarget;
use crate::zarr::{StoreLocation, MAX_IO_CONCURRENCY};

/// The most partitions and tasks a received scan may ask for (a malformed
/// plan must not make a worker allocate per partition); its rows per batch
/// are held to [`MAX_BATCH_ROWS`], as a session's are.
const MAX_PARTITIONS: usize = 1 << 12;

/// The most tables a received read may have joined in.
const MAX_JOINED: usize = 64;
/// The most columns a small side joined in may have.
const MAX_JOINED_COLUMNS: usize = 1 << 12;
const MAX_TASKS: usize = 1 << 16;
/// The most aggregates a received reduction may have.
const MAX_AGGREGATES: usize = 1 << 10;

/// The most transforms a received chain may make, one of another.
const MAX_TRANSFORMS: usize = 1 << 6;

/// The most arrays a received rechunk may copy.
const MAX_ARRAYS: usize = 1 << 12;

/// Refuses a received node asking for a count out of its bounds: each
/// `(what, n, most)` must have `n` from 1 to `most`; `subject` names the
/// node and what it reads ("a scan of {store}").
fn check_counts(subject: &str, counts: &[(&str, usize, usize)]) -> Result<()> {
    for &(what, n, most) in counts {
        if n == 0 || n > most {
            return plan_err!("{subject} asks for {n} {what} (1 to {most})");
        }
    }
    Ok(())
}

/// The worker's memory budget, when it has one.
fn memory_limit(ctx: &TaskContext) -> Option<usize> {
    match ctx.memory_pool().memory_limit() {
        MemoryLimit::Finite(bytes) => Some(bytes),
        _ => None,
    }
}

/// The detrended source `plan` reads the values of: the first pass of a
/// four-step transform, or the blocks of a staged transform's first stage
/// by whole lines, whose source is detrended (looked for under what
/// DataFusion wraps a leaf in, `CooperativeExec`).
fn reading_detrended(plan: &Arc<dyn ExecutionPlan>) -> Option<&Arc<DetrendedSource>> {
    let tasks = plan.downcast_ref::<BlockwiseTasksExec>();
    if let Some(pass) = tasks.and_then(pass_writes) {
        return (pass.pass() == 0).then(|| pass.table().detrended())?;
    }
    if let Some(table) = tasks.and_then(transform_writes).map(|w| w.table()) {
        return (table.four_step().is_none()).then(|| table.detrended())?;
    }
    match plan.children().as_slice() {
        [only] => reading_detrended(only),
        _ => None,
    }
}

/// Refuses `bytes` of `what` a worker's `allowed_mem` cannot hold, with
/// the numbers.
fn fits_on_worker(bytes: usize, what: &str, ctx: &TaskContext) -> Result<()> {
    match memory_limit(ctx) {
        Some(limit) if bytes > limit => resources_err!(
            "{what} needs {}, but this worker's memory limit (allowed_mem) is {}; raise it on \
             every worker",
            human_readable_size(bytes),
            human_readable_size(limit)
        ),
        _ => Ok(()),
    }
}

/// A received type's name (as Arrow writes it) read back, or an error
/// naming `subject`.
fn parse_type(subject: &str, text: &str) -> Result<DataType> {
    (text.parse::<DataType>()).map_err(|e| exec_datafusion_err!("{subject}: type {text:?}: {e}"))
}

/// A received schema: each field's name, type and nullability.
fn schema_of(subject: &str, fields: &[(String, String, bool)]) -> Result<SchemaRef> {
    let fields = (fields.iter())
        .map(|(name, data_type, nullable)| {
            Ok(Field::new(name, parse_type(subject, data_type)?, *nullable))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Arc::new(Schema::new(fields)))
}

/// The columns of `schema` as they travel: name, type, nullable.
fn columns(schema: &Schema) -> Vec<(String, String, bool)> {
    (schema.fields().iter())
        .map(|f| (f.name().clone(), f.data_type().to_string(), f.is_nullable()))
        .collect()
}

/// The blocks of shape `block_shape` of a received transform `table` over
/// `selection` of its grid; refused when they cut its lines.
fn line_blocks(
    table: &FftTable,
    block_shape: Vec<u64>,
    selection: &Selection,
) -> Result<BlockGrid> {
    let store = table.source().store();
    let shape = table.block_space();
    let blocks = BlockGrid::with_block_shape(&shape, block_shape, selection)
        .map_err(|e| exec_datafusion_err!("a transform of {store}: {e}"))?;
    if table.four_step().is_some() {
        // Blocks of the output, whole batches of lines and output chunks.
        let (chunk, block) = (table.block_chunk(), blocks.block_shape());
        if let Some(d) = table.cuts_output_blocks(block) {
            return plan_err!(
                "a four-step transform of {store} reads blocks of shape {block:?}, not whole \
                 blocks of {chunk:?} along dimension {d}"
            );
        }
        return Ok(blocks);
    }
    if let Some(d) = table.cut_lines(blocks.block_shape()) {
        return plan_err!(
            "a transform of {store} reads blocks of shape {:?}, which cut its lines along \
             dimension {d} (of length {})",
            blocks.block_shape(),
            shape[d]
        );
    }
    Ok(blocks)
}

/// A run of a rechunk's tasks received by a worker: planned again from the
/// source under the worker's settings ([`PreparedRechunk::for_cluster_tasks`]:
/// its `allowed_locations` and `allowed_mem`), writing into a staged target
/// the worker may reach (a local one only a COPY's temporary directory).
fn decode_rechunk(run: RechunkRun, ctx: &TaskContext) -> Result<Arc<dyn ExecutionPlan>> {
    let RechunkRun {
        rechunk,
        target,
        round,
        tasks,
    } = run;
    check_counts(
        &format!("a rechunk of {}", rechunk.source),
        &[
            ("tasks", tasks, MAX_TASKS),
            ("arrays", rechunk.arrays.len(), MAX_ARRAYS),
        ],
    )?;
    let options = RechunkOptions::for_session(ctx.session_config().options(), &ctx.runtime_env())?;
    check_staged(&target, &options, &rechunk.source)?;
    if let Some(work) = &rechunk.work {
        let what = ("zarrfusion-rechunk-", "a rechunk's scratch store");
        check_scratch(work, what, &options, &rechunk.source)?;
    }
    let rounds = (rechunk.arrays.iter()).map(|a| a.stages.len()).max();
    if round >= rounds.unwrap_or(0) {
        return plan_err!(
            "a rechunk of {} runs round {round} of {}",
            rechunk.source,
            rounds.unwrap_or(0)
        );
    }
    if rechunk.planned_when_run {
        // The intermediate store of a COPY of a selection, written by the
        // query's first round: planned again when the tasks run.
        let what = ("zarrfusion-copy-", "a COPY's intermediate store");
        check_scratch(&rechunk.source, what, &options, &rechunk.source)?;
        let exec = RechunkTasksExec::planned_when_run(Arc::new(rechunk), options, target, round);
        return Ok(Arc::new(exec.with_tasks(tasks)));
    }
    let runtime = ctx.runtime_env();
    let prepared =
        run_blocking(|| PreparedRechunk::for_cluster_tasks(&rechunk, options, &runtime))?;
    let exec = RechunkTasksExec::new(Arc::new(rechunk), Arc::new(prepared), target, round)
        .with_tasks(tasks);
    Ok(Arc::new(exec))
}

/// Refuses a staged target a received write from `source` may not write
/// into: a local one that is not a COPY's temporary directory, a scratch
/// store that is not a `rechunk(...)`'s, or one the worker's
/// `allowed_locations` do not permit.
fn check_staged(target: &StagedTarget, options: &RechunkOptions, source: &str) -> Result<()> {
    let location = match target {
        StagedTarget::Local { path } => {
            let staging = (path.file_name()).map(|n| n.to_string_lossy().into_owned());
            if !staging.is_some_and(|n| n.starts_with('.') && n.ends_with(".zarrfusion-tmp")) {
                return plan_err!(
                    "a write from {source} goes into '{}', not a COPY's temporary directory",
                    path.display()
                );
            }
            StoreLocation::Local(path.clone())
        }
        StagedTarget::Remote { url, .. } => StoreLocation::parse(url)?,
        StagedTarget::Scratch { location } => {
            let what = ("zarrfusion-rechunked-", "the store of a rechunk(...)");
            return check_scratch(location, what, options, source);
        }
    };
    Ok(options.allowed.check(&location, &target.to_string())?)
}

/// Refuses a scratch store `location` a received write from `source` may
/// not use: one not named `stem`... (a `what`), or one the worker's
/// `allowed_locations` do not permit.
fn check_scratch(
    location: &str,
    (stem, what): (&str, &str),
    options: &RechunkOptions,
    source: &str,
) -> Result<()> {
    let parsed = StoreLocation::parse(location)?;
    if !scratch_name(&parsed).is_some_and(|n| n.starts_with(stem)) {
        return plan_err!("a write from {source} uses '{location}', not {what}");
    }
    Ok(options.allowed.check(&parsed, location)?)
}

/// The last name of a scratch store's location.
fn scratch_name(location: &StoreLocation) -> Option<String> {
    match location {
        StoreLocation::Local(path) => path.file_name().map(|n| n.to_string_lossy().into_owned()),
        StoreLocation::Remote(url) => url
            .path_segments()
            .and_then(|mut s| s.next_back())
            .map(str::to_string),
    }
}

/// The intermediates of a four-step transform of `table` received by a
/// worker (`at`): only a four-step scratch store its `allowed_locations`
/// permit, the plan checked against the transform (and its blocks' memory
/// computed again), the intermediates' metadata what the plan makes.
fn open_four_step(table: &FftTable, at: FourStepAt, ctx: &TaskContext) -> Result<FourStep> {
    let store = table.source().store().to_string();
    let options = RechunkOptions::for_session(ctx.session_config().options(), &ctx.runtime_env())?;
    let what = (
        "zarrfusion-fft-four-step-",
        "a four-step transform's scratch store",
    );
    check_scratch(&at.work, what, &options, &store)?;
    let [(axis, axis_transform)] = table.transform().axes.as_slice() else {
        return plan_err!(
            "a four-step transform of {store} along {} dimensions",
            table.transform().axes.len()
        );
    };
    let source = table.source();
    let input = FourStepInput {
        shape: source.shape(),
        chunk: source.chunk_shape(),
        peak_bytes_per_cell: source.peak_bytes_per_cell(),
        single: table.single_precision(),
    };
    let plan = (at.plan.received(&input, *axis, axis_transform.len))
        .map_err(|e| exec_datafusion_err!("a four-step transform of {store}: {e}"))?;
    let runtime = ctx.runtime_env();
    let io_concurrency = at.io_concurrency.min(MAX_IO_CONCURRENCY);
    run_blocking(|| {
        FourStep::open(
            plan,
            &input.shape,
            input.single,
            &at.work,
            io_concurrency,
            at.read_ahead,
            &runtime,
        )
    })
}

/// zarrfusion's `PhysicalExtensionCodec`: registered on the session that
/// plans a distributed query and on every worker.
#[derive(Debug, Default)]
pub struct ZarrCodec {
    /// Tables opened for the nodes of one query, by their source.
    opened: Mutex<HashMap<String, Arc<GridTable>>>,
}

/// The kernel of a blockwise step writing the blocks `blocks` of the
/// transform `table`, as it travels: how a worker makes the transform
/// again (by the path that made what it reads first) and the blocks'
/// shape.
fn encode_transform_blocks(table: &Arc<FftTable>, blocks: &BlockGrid) -> Result<TransformBlocks> {
    type Paths = (
        Option<Box<FourStepAt>>,
        Option<String>,
        Option<Box<LaterStageRead>>,
    );
    let (chain, (four_step, rechunked, staged)): (Chain, Paths) =
        match (table.source(), table.four_step()) {
            (ArraySource::Rechunked(copied), _) => (
                Chain::of_rechunked(table, copied)?,
                (None, Some(copied.location()), None),
            ),
            (ArraySource::Staged(_), None) => {
                let Some(later) = StagedTransform::later_stage_of(table) else {
                    return not_impl_err!(
                        "a COPY of the staged transform of '{}' cannot run on a \
                         cluster's workers: its later stage is not one they make again",
                        table.source().store()
                    );
                };
                let blocks = later.first.blocks();
                let (asked, read) = LaterStageRead::of_later(later, blocks)?;
                (asked, (None, None, Some(Box::new(read))))
            }
            (_, Some(at)) => (
                Chain::of_four_step(table)?,
                (Some(Box::new(FourStepAt::of(at))), None, None),
            ),
            (_, None) => (Chain::of(table)?, (None, None, None)),
        };
    Ok(TransformBlocks {
        chain,
        four_step,
        rechunked,
        staged,
        block_shape: blocks.block_shape().to_vec(),
    })
}

/// A zarrfusion node as it travels.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "node", rename_all = "snake_case")]
enum Node {
    Scan(Scan),
    Reduction(Reduction),
    Merge(Merge),
    Window(Window),
    RechunkTasks(RechunkRun),
    Blockwise(BlockwiseRun),
    Transform(Transform),
    After(After),
    DetrendFit(DetrendFit),
    /// The first pass of a detrended four-step transform after its fit
    /// ([`FittedExec`]): its two inputs are the fit's rows and the pass.
    Fitted,
    /// A `rechunk(...)` whose copy and scan run on the workers
    /// ([`RechunkExec::on_workers`]): the session's node keeps its stores
    /// for the query, a worker runs its one input (the scan after the
    /// copy's rounds) through a pass-through node in its place.
    Rechunked,
}

/// A round run after the previous one's counts ([`AfterExec`]): the blocks
/// they add up to and what that round is; its two inputs are the counts
/// and the round.
#[derive(Debug, Serialize, Deserialize)]
struct After {
    blocks: u64,
    what: String,
}

impl Node {
    /// What the node is, in errors.
    fn what(&self) -> &'static str {
        match self {
            Self::Scan(_) => "a Zarr scan",
            Self::Reduction(_) => "a dense reduction",
            Self::Merge(_) => "a merge of a dense reduction's states",
            Self::Window(_) => "a rolling window",
            Self::RechunkTasks(_) => "a rechunk's tasks",
            Self::Blockwise(_) => "a blockwise step",
            Self::Transform(_) => "a transform",
            Self::After(_) => "a round after another",
            Self::DetrendFit(_) => "a detrend's fit",
            Self::Fitted => "a four-step pass after a detrend's fit",
            Self::Rechunked => "a rechunk(...) on the workers",
        }
    }
}

/// A transform's blocks as they travel ([`FftExec`]): the variable's
/// table, the transforms (innermost first, as SQL names their options),
/// the blocks and how their rows are sent.
#[derive(Debug, Serialize, Deserialize)]
struct Transform {
    #[serde(flatten)]
    chain: Chain,
    /// The output columns: indices into the transform's schema.
    projection: Vec<usize>,
    /// The filters' selection of the other dimensions, over the
    /// variable's grid (`None`: every block).
    selection: Option<Vec<Vec<Range<u64>>>>,
    block_shape: Vec<u64>,
    partitions: usize,
    limit: Option<usize>,
    batch_size: usize,
    io_concurrency: usize,
    tasks: usize,
    /// For the stage after a staged transform's first: that first stage
    /// (the chain is then the transform as asked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    staged: Option<Box<LaterStageRead>>,
    /// For the output of a transform on the four-step path, read once its
    /// passes ran on the workers: the plan and intermediates (the chain is
    /// then the one transform).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    four_step: Option<Box<FourStepAt>>,
    /// For a transform reading a rechunked copy of its variable, made by
    /// the workers before (the chain is then the one transform of the
    /// variable as stored): where the copy is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rechunked: Option<String>,
}

/// The stage after a staged transform's first as it travels (see
/// [`StagedTransform::later_stage_of`]): the first stage, where the
/// session stores its output and in what chunks, the blocks its tasks
/// store, and this stage's transform of that output.
#[derive(Debug, Serialize, Deserialize)]
struct LaterStageRead {
    first: Chain,
    /// The store in `work_dir`: a path or a URL.
    location: String,
    chunks: Vec<u64>,
    /// The first stage's blocks, which its tasks' counts add up to.
    blocks: u64,
    /// This stage's function (`fft`, `ifft`) and options.
    later: (String, Vec<(String, String)>),
}

/// A run of the chunks of a detrend's fit as it travels
/// ([`DetrendFitExec`]): the detrended four-step transform (one, of the
/// variable) and the distributed tasks its chunks are dealt to.
#[derive(Debug, Serialize, Deserialize)]
struct DetrendFit {
    #[serde(flatten)]
    chain: Chain,
    tasks: usize,
}

/// A chain of transforms of a stored variable as it travels: the
/// variable's table, the transforms (innermost first, as SQL names their
/// options).
#[derive(Debug, Serialize, Deserialize)]
struct Chain {
    source: Source,
    /// The table's columns when the plan was made: names and types.
    columns: Vec<(String, String)>,
    variable: String,
    /// Each transform's function (`fft`, `ifft`) and options.
    transforms: Vec<(String, Vec<(String, String)>)>,
    /// A trend removed from the variable before the innermost transform
    /// reads it (the four-step path, a staged transform's first stage).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    detrend: Option<SentDetrend>,
}

/// A trend removed from a transform's source as it travels: `constant` or
/// `linear`, and the dimensions (indices) it is fitted over.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SentDetrend {
    detrend: String,
    axes: Vec<usize>,
}

impl SentDetrend {
    /// The trend `table` removes from its source, if any.
    fn of(table: &FftTable) -> Option<Self> {
        let detrended = table.detrended()?;
        Some(Self {
            detrend: detrended.detrend().name().to_string(),
            axes: detrended.axes().to_vec(),
        })
    }

    /// `table` (made again from the variable) removing this trend, its
    /// sums from the fit's tasks.
    fn received(&self, table: &FftTable) -> Result<FftTable> {
        let Some(detrend) = Detrend::named(&self.detrend) else {
            return plan_err!("a detrend {:?} (constant or linear)", self.detrend);
        };
        table.with_received_detrend(detrend, self.axes.clone(), 1)
    }
}

/// The kernel of a blockwise step writing a transform's blocks (a `COPY`
/// of a transform, a staged transform's first stage) as it travels: the
/// transform and its blocks.
#[derive(Debug, Serialize, Deserialize)]
struct TransformBlocks {
    chain: Chain,
    /// For a transform on the four-step path (a COPY's, or a staged
    /// transform's first stage): its intermediates, which its passes wrote
    /// before (the chain is then its one transform).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    four_step: Option<Box<FourStepAt>>,
    /// For a transform reading a rechunked copy of its variable, made by
    /// the workers' rounds before the tasks run: where the copy is (the
    /// chain is then its one transform of the variable as stored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rechunked: Option<String>,
    /// For the stage after a staged transform's first, whose rounds ran on
    /// the workers before the tasks: that first stage (the chain is then
    /// the transform as asked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    staged: Option<Box<LaterStageRead>>,
    block_shape: Vec<u64>,
}

/// A four-step transform's plan and intermediates as they travel: the
/// plan, the scratch store the session made in `work_dir` and how it is
/// read.
#[derive(Debug, Serialize, Deserialize)]
struct FourStepAt {
    plan: FourStepPlan,
    /// The scratch store of the intermediates: a path or a URL.
    work: String,
    io_concurrency: usize,
    /// Bytes each pass may read ahead.
    read_ahead: [usize; 2],
}

/// What a received transform reads after (its one input's counts).
enum ReadAfter {
    /// A staged transform's first stage, of so many blocks, stored in
    /// this store.
    FirstStage(Arc<dyn StoredStage>, u64),
    /// The four-step path's passes.
    Passes,
}

impl FourStepAt {
    fn of(four_step: &FourStep) -> Self {
        let (io_concurrency, read_ahead) = four_step.reads_ahead();
        Self {
            plan: four_step.plan.clone(),
            work: four_step.location().to_string(),
            io_concurrency,
            read_ahead,
        }
    }
}

/// The kernel of a blockwise step running one pass of a four-step
/// transform ([`PassBlocks`]) as it travels: the variable's table, the
/// transform (as SQL names its options), the plan, the scratch store the
/// session made in `work_dir` and the pass.
#[derive(Debug, Serialize, Deserialize)]
struct FourStepPass {
    source: Source,
    /// The table's columns when the plan was made: names and types.
    columns: Vec<(String, String)>,
    variable: String,
    /// The transform's function (`fft`, `ifft`) and options.
    transform: (String, Vec<(String, String)>),
    /// A trend removed from the variable before the first pass reads it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    detrend: Option<SentDetrend>,
    #[serde(flatten)]
    at: FourStepAt,
    /// 0: across chunks, 1: within chunks.
    pass: usize,
}

/// A run of step 1 of a chunk-by-chunk COPY as it travels: how its chunks
/// are made, the variables' expressions (protobuf physical expressions, in
/// base64), the chunks and where they go, and the distributed tasks it is
/// dealt to.
#[derive(Debug, Serialize, Deserialize)]
struct BlockwiseRun {
    kernel: Kernel,
    exprs: Vec<String>,
    step: BlockwiseTasks,
    tasks: usize,
}

/// How a blockwise step makes its chunks.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "kernel", rename_all = "snake_case")]
enum Kernel {
    /// The expressions over the source box each chunk covers (a COPY of a
    /// selection): the read, the expressions over its columns.
    Evaluate(Box<Read>),
    /// Rolling windows rolled along runs of chunks (a COPY of rolling
    /// windows): the window, the expressions over its rows.
    Roll(Box<Window>),
    /// A transform's blocks (a COPY of a transform, a staged transform's
    /// first stage): no expressions.
    Transform(Box<TransformBlocks>),
    /// A pass of a four-step transform, into its intermediates: no
    /// expressions.
    FourStepPass(Box<FourStepPass>),
}

/// A run of a rechunk's tasks as it travels: the rechunk, where it writes,
/// and the distributed tasks it is dealt to.
#[derive(Debug, Serialize, Deserialize)]
struct RechunkRun {
    rechunk: RechunkTasks,
    target: StagedTarget,
    round: usize,
    tasks: usize,
}

/// How to make a table again ([`GridSource`]).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Source {
    /// Opened from a location.
    Opened(Opened),
    /// Two tables side by side: an aligned join's zip ([`GridTable::zip`]).
    Zip {
        left: Box<Source>,
        right: Box<Source>,
    },
    /// A grid with small tables joined in on some of its dimensions
    /// (broadcast columns, [`GridTable::with_broadcast`]); their rows are
    /// the node's inputs.
    Joined {
        grid: Box<Source>,
        joined: Vec<Joined>,
    },
}

/// A small table joined into a grid as it travels: how its keys are made
/// from the grid's coordinates and which of its columns the grid gets
/// ([`Broadcast`]).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Joined {
    dims: Vec<JoinedDim>,
    /// The small side's columns the grid gets.
    values: Vec<usize>,
    /// The grid's new columns (names and types): the values', then the
    /// `matched` column.
    fields: Vec<(String, String)>,
    label: String,
}

/// A dimension a joined table is keyed by: the functions of its
/// coordinate (protobuf physical expressions over its column alone, in
/// base64) and the small side's columns they meet.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct JoinedDim {
    dim: usize,
    keys: Vec<String>,
    columns: Vec<usize>,
}

/// How to open a table again.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Opened {
    location: String,
    dims: Vec<String>,
    group: Option<String>,
    pushdown: bool,
    open_cache: Option<bool>,
    storage: BTreeMap<String, String>,
    storage_defaults: BTreeMap<String, String>,
}

/// A [`BlockRead`] as it travels: the read every Zarr leaf starts with
/// (its fields among the node's own).
#[derive(Debug, Serialize, Deserialize)]
struct Read {
    source: Source,
    /// The table's columns when the plan was made: names and types.
    columns: Vec<(String, String)>,
    /// The columns read: indices into `columns`.
    read: Vec<usize>,
    selection: Vec<Vec<Range<u64>>>,
    block_shape: Vec<u64>,
}

/// A Zarr scan as it travels.
#[derive(Debug, Serialize, Deserialize)]
struct Scan {
    /// Its columns (the projection), cells and blocks.
    #[serde(flatten)]
    read: Read,
    partitions: usize,
    limit: Option<usize>,
    batch_size: usize,
    io_concurrency: usize,
    tasks: usize,
}

/// A dense reduction's partial states as they travel.
#[derive(Debug, Serialize, Deserialize)]
struct Reduction {
    /// The columns the expressions read (their input, in order), the
    /// cells and their blocks.
    #[serde(flatten)]
    read: Read,
    groups: Vec<GroupKey>,
    aggregates: Vec<Aggregate>,
    /// The row filter, a protobuf physical expression in base64.
    predicate: Option<String>,
    /// The states' columns: name, type, nullable.
    states: Vec<(String, String, bool)>,
    /// Whether each state row is led by its group's position instead of
    /// its coordinates.
    #[serde(default)]
    positioned: bool,
    io_concurrency: usize,
    tasks: usize,
    /// A reduction in bands: its cut (the bands are dealt to the tasks,
    /// which give their bands' results as `states`).
    #[serde(default)]
    bands: Option<BandCut>,
    /// In bands, the result columns its bands give (indices into `groups`
    /// then `aggregates`) where a projection took only some.
    #[serde(default)]
    gives: Option<Vec<usize>>,
}

/// The bands of a reduction in bands as they travel
/// ([`Bands`](crate::array::Bands)): the grouped dimension cut, its keys
/// per band, which way they run along its positions, the workers they
/// were sized for and how many are folded at once.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct BandCut {
    dim: usize,
    keys: usize,
    descending: bool,
    workers: usize,
    /// Bands folded at once.
    #[serde(default = "one")]
    at_once: usize,
}

/// One band at a time, where a plan sent does not say.
fn one() -> usize {
    1
}

/// The merge of a dense reduction's positioned states as it travels
/// ([`DenseMergeExec`]): the reduction (its groups and aggregates) and the
/// result's columns; its one input is the gathered states (a level of the
/// merge tree: the states hashed by position).
#[derive(Debug, Serialize, Deserialize)]
struct Merge {
    reduction: Reduction,
    /// The result's columns: name, type, nullable.
    results: Vec<(String, String, bool)>,
    /// A level of the merge tree, giving merged states, not results.
    #[serde(default)]
    level: bool,
}

/// The rows of the tables a received node joins in: its inputs, or (the
/// reduction of a merge, which is not run) empty stand-ins of their
/// columns.
enum JoinedRows<'a> {
    Inputs(&'a [Arc<dyn ExecutionPlan>]),
    StandIns,
}

/// A rolling window's runs of blocks as they travel.
#[derive(Debug, Serialize, Deserialize)]
struct Window {
    /// The columns the window reads (its input, in order), the cells and
    /// their blocks.
    #[serde(flatten)]
    read: Read,
    /// Those the arguments read: places among the columns read.
    arg_places: Vec<usize>,
    /// The window's input columns, protobuf physical expressions over the
    /// columns read, in base64.
    outputs: Vec<String>,
    /// The distinct arguments, over the columns at `arg_places`.
    args: Vec<String>,
    aggregates: Vec<Roll>,
    dim: usize,
    /// Whether `dim` is walked from its end (frames to the series' end).
    #[serde(default)]
    backward: bool,
    /// The rows' columns: name, type, nullable.
    schema: Vec<(String, String, bool)>,
    partitions: usize,
    batch_size: usize,
    tasks: usize,
}

/// One rolling aggregate as it travels.
#[derive(Debug, Serialize, Deserialize)]
struct Roll {
    op: String,
    /// Which argument (index into `Window::args`).
    arg: usize,
    /// The frame in the walk's order: `t + start ..= t + end` (no
    /// `start`: from the walk's first position).
    start: Option<i64>,
    end: i64,
    output: String,
    /// How it is shown.
    label: String,
}

/// One grouping column of a reduction as it travels: a dimension, or a
/// function of its coordinate (a protobuf physical expression over the
/// dimension's column alone, in base64).
#[derive(Debug, Serialize, Deserialize)]
struct GroupKey {
    dim: usize,
    expr: Option<String>,
}

/// One aggregate of a reduction as it travels.
#[derive(Debug, Serialize, Deserialize)]
struct Aggregate {
    op: String,
    /// The argument, a protobuf physical expression in base64 (`None`:
    /// `count(*)`).
    arg: Option<String>,
    output: String,
    /// How it is shown.
    label: String,
}

impl Source {
    /// How to make `table` again, with no table joined in (those travel
    /// with their inputs: [`ZarrCodec::joined_read`]).
    fn of(table: &GridTable) -> Result<Self> {
        if !table.broadcasts.is_empty() {
            return not_impl_err!(
                "the Zarr table over {} with a table joined in (a broadcast join) runs on a \
                 cluster's workers in scans and GROUP BYs only",
                table.store
            );
        }
        let Some(source) = &table.source else {
            return not_impl_err!(
                "the Zarr table over {} cannot run on a cluster's workers: it was made in this \
                 process (a broadcast join's, a transform's or a rechunked copy's), not opened \
                 from a location",
                table.store
            );
        };
        Self::of_grid(source, &table.store)
    }

    fn of_grid(source: &GridSource, store: &str) -> Result<Self> {
        Ok(match source {
            GridSource::Opened(TableSource { location, options }) => {
                let Some(dims) = options.dims.clone() else {
                    return internal_err!("the Zarr table over {store} has no dimensions to open");
                };
                Self::Opened(Opened {
                    location: location.clone(),
                    dims,
                    group: options.group.clone(),
                    pushdown: options.pushdown,
                    open_cache: options.open_cache,
                    storage: options.storage.clone().into_iter().collect(),
                    storage_defaults: options.storage_defaults.clone().into_iter().collect(),
                })
            }
            GridSource::Zip(left, right) => Self::Zip {
                left: Box::new(Self::of_grid(left, store)?),
                right: Box::new(Self::of_grid(right, store)?),
            },
        })
    }
}

impl Chain {
    fn of(table: &FftTable) -> Result<Self> {
        let Some((grid, variable, options)) = table.chain() else {
            return not_impl_err!(
                "the transform of '{}' variable '{}' cannot run on a cluster's workers: its path \
                 makes a store in work_dir first, which runs in the session",
                table.source().store(),
                table.source().variable()
            );
        };
        Ok(Self {
            detrend: SentDetrend::of(table),
            ..Self::of_variable(grid, variable, &options)?
        })
    }

    /// The one transform of `table` on the four-step path (its variable's
    /// trend removed first when it has one).
    fn of_four_step(table: &FftTable) -> Result<Self> {
        let Some((grid, variable, options)) = table.four_step_chain() else {
            return not_impl_err!(
                "the transform of '{}' variable '{}' cannot run on a cluster's workers: its \
                 path makes a store in work_dir first from a source made in the session",
                table.source().store(),
                table.source().variable()
            );
        };
        Ok(Self {
            detrend: SentDetrend::of(table),
            ..Self::of_variable(grid, variable, &[options])?
        })
    }

    /// The one transform of `table`, reading `copy`, a rechunked copy of
    /// its variable: the transform of the variable as stored (the worker
    /// reads the copy instead).
    fn of_rechunked(table: &FftTable, copy: &RechunkedVariable) -> Result<Self> {
        let source = &copy.source;
        let name = table.source().variable();
        let Some(variable) = source.variables.iter().position(|v| v.name() == name) else {
            return internal_err!("the rechunked copy of {} lacks '{name}'", source.store);
        };
        Self::of_variable(source, variable, &[&table.transform().options])
    }

    /// Variable `variable` of `grid` transformed by `options` in turn.
    fn of_variable(grid: &GridTable, variable: usize, options: &[&FftOptions]) -> Result<Self> {
        let transforms = (options.iter())
            .map(|o| sent_options(o, &grid.store))
            .collect::<Result<_>>()?;
        Ok(Self {
            source: Source::of(grid)?,
            columns: columns_of(grid),
            variable: grid.variables[variable].name().to_string(),
            transforms,
            detrend: None,
        })
    }
}

/// A transform's function and options as SQL names them, to send.
fn sent_options(options: &FftOptions, store: &str) -> Result<(String, Vec<(String, String)>)> {
    let (function, named) = options.named().ok_or_else(|| {
        exec_datafusion_err!(
            "the transform of '{store}' has options that cannot be sent: {options:?}"
        )
    })?;
    Ok((function.to_string(), named))
}

/// A transform's options received as SQL names them, checked as SQL's.
fn received_options(
    (function, named): &(String, Vec<(String, String)>),
    store: &str,
) -> Result<FftOptions> {
    let mut options = match function.as_str() {
        "fft" => FftOptions::forward(Vec::new()),
        "ifft" => FftOptions::inverse(Vec::new()),
        other => return plan_err!("a transform of {store} by '{other}'"),
    };
    options.set(named, function)?;
    Ok(options)
}

impl LaterStageRead {
    /// What a stage after a staged transform's first (`exec`) sends
    /// besides the transform as asked: `None` for other transforms.
    fn of(exec: &FftExec) -> Result<Option<(Chain, Self)>> {
        let (Some(later), Some((_, blocks))) = (
            StagedTransform::later_stage_of(exec.table()),
            exec.first_stage(),
        ) else {
            return Ok(None);
        };
        Self::of_later(later, blocks).map(Some)
    }

    /// What `later` sends besides the transform as asked (the chain
    /// returned with it), the first stage's tasks storing `blocks`.
    fn of_later(later: LaterStage<'_>, blocks: u64) -> Result<(Chain, Self)> {
        let (grid, variable, asked) = &later.asked;
        let first = later.first;
        let read = Self {
            first: Chain::of_variable(grid, *variable, &later.first_transforms)?,
            location: first.location().to_string(),
            chunks: first.chunk_shape(),
            blocks,
            later: sent_options(later.later, &grid.store)?,
        };
        Ok((Chain::of_variable(grid, *variable, asked)?, read))
    }
}

impl Transform {
    fn of(exec: &FftExec) -> Result<Self> {
        let table = exec.table();
        if let ArraySource::Rechunked(copy) = table.source() {
            let chain = Chain::of_rechunked(table, copy)?;
            return Ok(Self::with(exec, chain, None, None, Some(copy.location())));
        }
        let (chain, staged, four_step) = match (LaterStageRead::of(exec)?, table.four_step()) {
            (Some((asked, read)), _) => (asked, Some(Box::new(read)), None),
            (None, Some(four_step)) => {
                let chain = Chain::of_four_step(table)?;
                (chain, None, Some(Box::new(FourStepAt::of(four_step))))
            }
            (None, None) => (Chain::of(table)?, None, None),
        };
        Ok(Self::with(exec, chain, staged, four_step, None))
    }

    /// `exec`'s blocks as they travel, reading `chain` (through the later
    /// stage `staged`, the four-step path `four_step` or the rechunked
    /// copy at `rechunked`, when given).
    fn with(
        exec: &FftExec,
        chain: Chain,
        staged: Option<Box<LaterStageRead>>,
        four_step: Option<Box<FourStepAt>>,
        rechunked: Option<String>,
    ) -> Self {
        let table = exec.table();
        let blocks = exec.blocks();
        let shape = table.block_space();
        Self {
            chain,
            staged,
            four_step,
            rechunked,
            projection: blocks.projection,
            selection: blocks
                .selection
                .map(|s| (0..shape.len()).map(|d| s.ranges(d).to_vec()).collect()),
            block_shape: blocks.blocks.block_shape().to_vec(),
            partitions: blocks.partitions,
            limit: blocks.limit,
            batch_size: blocks.batch_size,
            io_concurrency: blocks.io_concurrency,
            tasks: exec.tasks(),
        }
    }
}

impl FourStepPass {
    fn of(pass: &PassBlocks) -> Result<Self> {
        let table = pass.table();
        let Some((grid, variable, options)) = table.four_step_chain() else {
            return not_impl_err!(
                "the four-step transform of '{}' variable '{}' cannot run on a cluster's \
                 workers: its source is made in the session first",
                table.source().store(),
                table.source().variable()
            );
        };
        let (function, named) = options.named().ok_or_else(|| {
            exec_datafusion_err!(
                "the transform of '{}' has options that cannot be sent: {options:?}",
                grid.store
            )
        })?;
        Ok(Self {
            source: Source::of(grid)?,
            columns: columns_of(grid),
            variable: grid.variables[variable].name().to_string(),
            transform: (function.to_string(), named),
            detrend: SentDetrend::of(table),
            at: FourStepAt::of(pass.four_step()),
            pass: pass.pass(),
        })
    }
}

impl Read {
    fn of(read: &BlockRead) -> Result<Self> {
        Ok(Self {
            source: Source::of(&read.table)?,
            columns: columns_of(&read.table),
            read: read.columns.clone(),
            selection: read.selection_ranges(),
            block_shape: read.blocks.block_shape().to_vec(),
        })
    }
}

/// Names and types of a table's columns.
fn columns_of(table: &GridTable) -> Vec<(String, String)> {
    table
        .schema
        .fields()
        .iter()
        .map(|f| (f.name().clone(), f.data_type().to_string()))
        .collect()
}

impl ZarrCodec {
    /// The table `source` names, opened on this worker (once per query).
    fn open(&self, source: &Source, ctx: &TaskContext) -> Result<Arc<GridTable>> {
        let key = serde_json::to_string(source)
            .map_err(|e| exec_datafusion_err!("a Zarr table's source: {e}"))?;
        if let Some(table) = lock(&self.opened).get(&key) {
            return Ok(Arc::clone(table));
        }
        let table = match source {
            Source::Opened(source) => {
                let config = ZarrConfig::of(ctx.session_config().options());
                let options = ZarrTableOptions {
                    dims: Some(source.dims.clone()),
                    group: source.group.clone(),
                    pushdown: source.pushdown,
                    open_cache: source.open_cache,
                    storage: source.storage.clone().into_iter().collect(),
                    storage_defaults: source.storage_defaults.clone().into_iter().collect(),
                    // The worker's own policy, not the sender's.
                    allowed: config.allowed()?,
                };
                let dataset =
                    open_dataset_blocking(&source.location, &options, &ctx.runtime_env())?;
                Arc::new(dataset.table(Some(&source.dims))?)
            }
            Source::Zip { left, right } => {
                let (a, b) = (self.open(left, ctx)?, self.open(right, ctx)?);
                let Some(zipped) = a.zip(&b) else {
                    return plan_err!(
                        "the Zarr tables over {} and {} are not on one grid: their dimensions' \
                         coordinates differ",
                        a.store,
                        b.store
                    );
                };
                Arc::new(zipped)
            }
            Source::Joined { grid, joined } => {
                let mut table = self.open(grid, ctx)?;
                check_counts(
                    &format!("a join with {}", table.store),
                    &[("joined tables", joined.len(), MAX_JOINED)],
                )?;
                for j in joined {
                    table = Arc::new(table.with_broadcast(self.joined(&table, j, ctx)?));
                }
                table
            }
        };
        lock(&self.opened).insert(key, Arc::clone(&table));
        Ok(table)
    }

    /// The read `read` describes, made again on this worker: its table
    /// opened and checked to have the columns the plan was made for, its
    /// selection and blocks checked against the table's grid. The tables
    /// it joins in are those of the node receiving it (its inputs: a scan,
    /// a reduction, a rolling window or a COPY's blockwise step).
    fn decode_joined_read(&self, read: Read, ctx: &TaskContext) -> Result<BlockRead> {
        let table = self.open(&read.source, ctx)?;
        let store = &table.store;
        if columns_of(&table) != read.columns {
            return plan_err!(
                "the Zarr table over {store} has changed since the query was planned: its \
                 columns are now {:?}, the plan expects {:?}",
                columns_of(&table),
                read.columns
            );
        }
        let shape = table.shape();
        let selection = Selection::from_ranges(read.selection, &shape)
            .map_err(|e| exec_datafusion_err!("a read of {store}: its selection: {e}"))?;
        let blocks = BlockGrid::with_block_shape(&shape, read.block_shape, &selection)
            .map_err(|e| exec_datafusion_err!("a read of {store}: {e}"))?;
        BlockRead::new(table, read.read, selection, blocks)
    }

    fn decode_scan(
        &self,
        scan: Scan,
        inputs: &[Arc<dyn ExecutionPlan>],
        ctx: &TaskContext,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let (read, broadcasts) = self.joined_inputs(scan.read, JoinedRows::Inputs(inputs), ctx)?;
        let store = &read.table.store;
        let stage_tasks = scan.tasks == TASKS_OF_STAGE && !broadcasts.is_empty();
        check_counts(
            &format!("a scan of {store}"),
            &[
                ("partitions", scan.partitions, MAX_PARTITIONS),
                ("tasks", scan.tasks.max(usize::from(stage_tasks)), MAX_TASKS),
                ("batch_size", scan.batch_size, MAX_BATCH_ROWS),
            ],
        )?;
        let exec = ZarrScanExec::new(
            read,
            scan.partitions,
            scan.limit,
            scan.batch_size,
            scan.io_concurrency,
        );
        let exec = match stage_tasks {
            true => exec.with_tasks_of_stage(),
            false => exec.with_tasks(scan.tasks),
        };
        let mut exec = exec.with_broadcasts(broadcasts);
        if let MemoryLimit::Finite(bytes) = ctx.memory_pool().memory_limit() {
            exec = exec.fit_batches(bytes).fit_read_ahead(bytes);
            exec.check_memory(bytes)?;
        }
        Ok(Arc::new(exec))
    }
}

impl ZarrCodec {
    /// `read` as it travels from a node that joins the small tables it
    /// reads (a scan or a reduction): its table's joined tables with it.
    fn joined_read(&self, read: &BlockRead) -> Result<Read> {
        let table = &read.table;
        if table.broadcasts.is_empty() {
            return Read::of(read);
        }
        let Some(grid) = &table.source else {
            return internal_err!("the Zarr table over {} has no source", table.store);
        };
        let mut joined = Vec::with_capacity(table.broadcasts.len());
        for b in &table.broadcasts {
            let dims = (b.dims.iter())
                .map(|d| {
                    Ok(JoinedDim {
                        dim: d.dim,
                        keys: (d.exprs.iter())
                            .map(|e| self.encode_expr(e))
                            .collect::<Result<_>>()?,
                        columns: d.columns.clone(),
                    })
                })
                .collect::<Result<_>>()?;
            joined.push(Joined {
                dims,
                values: b.values.clone(),
                fields: (b.fields.iter())
                    .map(|f| (f.name().clone(), f.data_type().to_string()))
                    .collect(),
                label: b.label.clone(),
            });
        }
        Ok(Read {
            source: Source::Joined {
                grid: Box::new(Source::of_grid(grid, &table.store)?),
                joined,
            },
            columns: columns_of(table),
            read: read.columns.clone(),
            selection: read.selection_ranges(),
            block_shape: read.blocks.block_shape().to_vec(),
        })
    }

    /// The table `joined` describes, joined into `table` on this worker:
    /// its keys evaluated again over the worker's own coordinates.
    fn joined(&self, table: &GridTable, joined: &Joined, ctx: &TaskContext) -> Result<Broadcast> {
        let store = &table.store;
        let n_dims = table.dims.len();
        let mut dims = Vec::with_capacity(joined.dims.len());
        for (i, d) in joined.dims.iter().enumerate() {
            let ordered = i == 0 || joined.dims[i - 1].dim < d.dim;
            if d.dim >= n_dims || !ordered {
                return plan_err!(
                    "a join with {store} is keyed by dimension {} of {n_dims} (dimensions in \
                     order, each once)",
                    d.dim
                );
            }
            check_counts(
                &format!("a join with {store}"),
                &[("keys", d.keys.len(), MAX_AGGREGATES)],
            )?;
            if d.columns.len() != d.keys.len() {
                return plan_err!("a join with {store}: keys and columns disagree");
            }
            let schema = key_schema(&table.dims[d.dim]);
            let exprs = (d.keys.iter())
                .map(|e| self.decode_expr(e, ctx, &schema))
                .collect::<Result<Vec<_>>>()?;
            dims.push(keyed_dim(table, d.dim, exprs, d.columns.clone())?);
        }
        let subject = format!("a join with {store}");
        let mut fields = Vec::with_capacity(joined.fields.len());
        for (k, (name, data_type)) in joined.fields.iter().enumerate() {
            let data_type = parse_type(&subject, data_type)?;
            let matched = k + 1 == joined.fields.len();
            fields.push(Field::new(name, data_type, !matched));
        }
        if fields.last().map(|f| f.data_type()) != Some(&DataType::Boolean) {
            return plan_err!("{subject}: its last column is not the `matched` column");
        }
        // Bounded before anything is sized by them (a merge's stand-ins of
        // the small side have as many columns as the largest index).
        let columns = joined.dims.iter().flat_map(|d| &d.columns);
        if let Some(c) = columns
            .chain(&joined.values)
            .find(|&&c| c >= MAX_JOINED_COLUMNS)
        {
            return plan_err!(
                "{subject}: column {c} of its small side (at most {MAX_JOINED_COLUMNS} columns)"
            );
        }
        Broadcast::received(dims, joined.values.clone(), fields, joined.label.clone())
    }

    /// A read received with the small tables it joins (`inputs`, their
    /// rows): the read made again and the broadcasts it reads, each
    /// checked to meet its input's columns.
    fn joined_inputs(
        &self,
        read: Read,
        inputs: JoinedRows,
        ctx: &TaskContext,
    ) -> Result<(BlockRead, BroadcastInputs)> {
        let read = self.decode_joined_read(read, ctx)?;
        let broadcasts = read.table.broadcasts_read(&read.columns);
        let inputs = match inputs {
            JoinedRows::Inputs(inputs) => inputs.to_vec(),
            JoinedRows::StandIns => (broadcasts.iter())
                .map(|b| Arc::new(EmptyExec::new(Arc::new(b.stand_in_schema()))) as _)
                .collect(),
        };
        let broadcasts = BroadcastInputs::received(broadcasts, inputs)?;
        Ok((read, broadcasts))
    }

    /// A transform's blocks received by a worker: its table opened again
    /// and checked to have the columns the plan was made for, the
    /// transforms made again from their options (checked as SQL's are),
    /// the blocks checked to be whole along every transformed dimension,
    /// its tasks fitted to the worker's `allowed_mem` on the worker's own
    /// device (`zarrfusion.device`).
    /// The transforms `transforms` (innermost first) of variable
    /// `variable` of the table `source` received with the columns
    /// `columns`, made again with SQL's checks.
    fn transform_table(&self, chain: &Chain, ctx: &TaskContext) -> Result<FftTable> {
        let Chain {
            source,
            columns,
            variable,
            transforms,
            detrend,
        } = chain;
        let grid = self.open(source, ctx)?;
        let store = grid.store.clone();
        if &columns_of(&grid) != columns {
            return plan_err!(
                "the Zarr table over {store} has changed since the query was planned: its \
                 columns are now {:?}, the plan expects {:?}",
                columns_of(&grid),
                columns
            );
        }
        check_counts(
            &format!("a transform of {store}"),
            &[("transforms", transforms.len(), MAX_TRANSFORMS)],
        )?;
        let transforms = (transforms.iter())
            .map(|sent| received_options(sent, &store))
            .collect::<Result<Vec<_>>>()?;
        let one = transforms.len() == 1;
        let table = FftTable::of_chain(grid, variable, transforms)?;
        match detrend {
            Some(_) if !one => plan_err!("a detrend of {store} sent with a chain of transforms"),
            Some(detrend) => detrend.received(&table),
            None => Ok(table),
        }
    }

    /// A transform reading a rechunked copy of its variable received by a
    /// worker (its copy made by the workers' rounds before it reads): the
    /// transform of `chain` (one, of the variable as stored) made again
    /// with SQL's checks, reading the copy at `location`, which must be a
    /// rechunk's store the worker's `allowed_locations` permit holding the
    /// variable in the source's shape; the coordinates are the source's.
    fn rechunked_copy(&self, chain: &Chain, location: &str, ctx: &TaskContext) -> Result<FftTable> {
        if chain.transforms.len() != 1 {
            return plan_err!(
                "a transform of a rechunked copy of {:?} sent as a chain of {} transforms",
                chain.variable,
                chain.transforms.len()
            );
        }
        let table = self.transform_table(chain, ctx)?;
        let Some((source, variable)) = table.source().stored() else {
            return internal_err!(
                "a transform of {:?} reads no stored variable",
                chain.variable
            );
        };
        let store = source.store.clone();
        let options =
            RechunkOptions::for_session(ctx.session_config().options(), &ctx.runtime_env())?;
        let what = ("zarrfusion-rechunked-", "a rechunked copy");
        check_scratch(location, what, &options, &store)?;
        let dims: Vec<String> = source.dims.iter().map(|d| d.name.clone()).collect();
        let parsed = StoreLocation::parse(location)?;
        let opening = ZarrTableOptions {
            dims: Some(dims.clone()),
            open_cache: Some(false),
            storage: match parsed.in_bucket_of(&store) {
                true => source.storage_options(),
                false => HashMap::new(),
            },
            allowed: ZarrConfig::of(ctx.session_config().options()).allowed()?,
            ..ZarrTableOptions::default()
        };
        let runtime = ctx.runtime_env();
        let copy = open_dataset_blocking(location, &opening, &runtime)?
            .table(Some(&dims))?
            .with_dimensions(source.dims.clone())?;
        let name = source.variables[variable].name();
        let stored = &source.variables[variable];
        let Some(index) = copy.variables.iter().position(|v| v.name() == name) else {
            return plan_err!("the rechunked copy '{location}' of {store} lacks '{name}'");
        };
        let copied = &copy.variables[index];
        if copied.shape() != stored.shape() || copied.data_type() != stored.data_type() {
            return plan_err!(
                "the rechunked copy '{location}' holds '{name}' otherwise than {store} does \
                 (shape {:?} of {}, not {:?} of {})",
                copied.shape(),
                copied.data_type(),
                stored.shape(),
                stored.data_type()
            );
        }
        Ok(table.reading_copy(Arc::new(copy), index))
    }

    /// The stage after a staged transform's first received by a worker
    /// (the transform as asked, `asked`): the first stage made again, its
    /// output opened from the store `read` names, which must be a staged
    /// transform's the worker's `allowed_locations` permit and hold the
    /// array as the first stage writes it, and this stage's transform of
    /// it, which must give the asked transform's output.
    fn later_stage_table(
        &self,
        asked: &Chain,
        read: LaterStageRead,
        ctx: &TaskContext,
    ) -> Result<(FftTable, Arc<dyn StoredStage>)> {
        let what = |chain: &Chain| {
            serde_json::to_value((&chain.source, &chain.columns, &chain.variable)).ok()
        };
        if what(asked) != what(&read.first) {
            return plan_err!(
                "the stage after a staged transform's first reads variable '{}' but its first \
                 stage transforms '{}' (or another table)",
                asked.variable,
                read.first.variable
            );
        }
        let first = self.transform_table(&read.first, ctx)?;
        let store = first.source().store().to_string();
        let options =
            RechunkOptions::for_session(ctx.session_config().options(), &ctx.runtime_env())?;
        let names = ("zarrfusion-fft-staged-", "a staged transform's store");
        check_scratch(&read.location, names, &options, &store)?;
        let later = received_options(&read.later, &store)?;
        let asked = self.transform_table(asked, ctx)?;
        let runtime = ctx.runtime_env();
        let stage =
            run_blocking(|| ReceivedStage::open(&first, &read.location, read.chunks, &runtime))?;
        let stage: Arc<dyn StoredStage> = Arc::new(stage);
        let table = FftTable::new(ArraySource::Staged(Arc::clone(&stage)), later)?;
        let gives = |t: &FftTable| {
            let dims = t.output_dims().into_iter().map(|d| d.name);
            (dims.collect::<Vec<_>>(), t.output_shape(), t.value_type())
        };
        if gives(&table) != gives(&asked) {
            return plan_err!(
                "the stage after the staged transform of {store} gives {:?}, not the output of \
                 the transform as asked, {:?}",
                gives(&table),
                gives(&asked)
            );
        }
        Ok((table.giving_output_of(&asked), stage))
    }

    fn decode_transform(
        &self,
        t: Transform,
        inputs: &[Arc<dyn ExecutionPlan>],
        ctx: &TaskContext,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        // A read after a first stage, the passes or a copy's rounds may
        // take its tasks from its stage.
        let of_stage = t.staged.is_some() || t.four_step.is_some() || t.rechunked.is_some();
        let (table, first_stage) = match (t.staged, t.four_step) {
            (Some(_), Some(_)) => {
                return plan_err!(
                    "a transform of {:?} sent as both a staged transform's later stage and a \
                     four-step output",
                    t.chain.variable
                );
            }
            (Some(read), None) => {
                let blocks = read.blocks;
                let (table, stage) = self.later_stage_table(&t.chain, *read, ctx)?;
                (table, Some(ReadAfter::FirstStage(stage, blocks)))
            }
            (None, Some(at)) => {
                if t.chain.transforms.len() != 1 {
                    return plan_err!(
                        "a four-step transform of {:?} sent as a chain of {} transforms",
                        t.chain.variable,
                        t.chain.transforms.len()
                    );
                }
                let table = self.transform_table(&t.chain, ctx)?;
                // Its passes run on the workers before it reads: this
                // stage's input is the second pass's counts.
                let four_step = open_four_step(&table, *at, ctx)?;
                (
                    table.with_four_step(Arc::new(four_step)),
                    Some(ReadAfter::Passes),
                )
            }
            (None, None) => match t.rechunked {
                Some(location) => (self.rechunked_copy(&t.chain, &location, ctx)?, None),
                None => (self.transform_table(&t.chain, ctx)?, None),
            },
        };
        let store = table.source().store().to_string();
        check_counts(
            &format!("a transform of {store}"),
            &[
                ("partitions", t.partitions, MAX_PARTITIONS),
                ("tasks", t.tasks.max(usize::from(of_stage)), MAX_TASKS),
                ("batch_size", t.batch_size, MAX_BATCH_ROWS),
            ],
        )?;
        let fields = table.schema_ref().fields().len();
        if t.projection.is_empty() || t.projection.iter().any(|&i| i >= fields) {
            return plan_err!(
                "a transform of {store} sends columns {:?} of {fields}",
                t.projection
            );
        }
        let shape = table.block_space();
        let selection = match t.selection {
            Some(ranges) => Some(
                Selection::from_ranges(ranges, &shape)
                    .map_err(|e| exec_datafusion_err!("a transform of {store}: {e}"))?,
            ),
            None => None,
        };
        let all = Selection::all(&shape);
        let blocks = line_blocks(&table, t.block_shape, selection.as_ref().unwrap_or(&all))?;
        let config = ZarrConfig::of(ctx.session_config().options());
        let memory_limit = memory_limit(ctx);
        let run = FftBlocks {
            projection: t.projection,
            selection,
            blocks,
            partitions: t.partitions,
            limit: t.limit,
            batch_size: t.batch_size,
            io_concurrency: t.io_concurrency,
        };
        let exec = FftExec::with_blocks(&table, run, &config.device, memory_limit)?;
        Ok(Arc::new(match (first_stage, inputs) {
            (Some(ReadAfter::FirstStage(stage, blocks)), [input]) => {
                exec.after_first_stage(Arc::clone(input), stage, blocks)
            }
            (Some(ReadAfter::Passes), [input]) => exec.after_passes(Arc::clone(input)),
            _ => exec.with_tasks(t.tasks),
        }))
    }

    /// A run of the blocks of a COPY of a transform (or of a staged
    /// transform's first stage) received by a worker: the transform made
    /// again with SQL's checks, its blocks whole lines, writing only into a
    /// COPY's staged target (or a staged transform's store, which must
    /// hold the array as the tasks write it) the worker's
    /// `allowed_locations` permit, its tasks fitted to the worker's
    /// `allowed_mem` on the worker's own device.
    fn decode_transform_blocks(
        &self,
        c: TransformBlocks,
        (sent, tasks): (BlockwiseTasks, usize),
        ctx: &TaskContext,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if c.four_step.is_some() && c.chain.transforms.len() != 1 {
            return plan_err!(
                "a four-step transform of {:?} sent as a chain of {} transforms",
                c.chain.variable,
                c.chain.transforms.len()
            );
        }
        let paths = [
            c.rechunked.is_some(),
            c.four_step.is_some(),
            c.staged.is_some(),
        ];
        if paths.iter().filter(|&&p| p).count() > 1 {
            return plan_err!(
                "a COPY of a transform of {:?} sent as more than one of a rechunked copy's, a \
                 four-step output's and a staged transform's later stage",
                c.chain.variable
            );
        }
        let mut table = match (&c.rechunked, c.staged) {
            // Its copy's rounds ran on the workers before this stage.
            (Some(location), _) => self.rechunked_copy(&c.chain, location, ctx)?,
            // The first stage's rounds ran on the workers before this
            // stage (the session runs them first, and each task checks
            // their counts before it reads): this stage reads its store.
            (None, Some(read)) => {
                let (table, stage) = self.later_stage_table(&c.chain, *read, ctx)?;
                stage
                    .written_by(&mut || Ok(()))
                    .map_err(|e| exec_datafusion_err!("a staged transform: {e}"))?;
                table
            }
            (None, None) => self.transform_table(&c.chain, ctx)?,
        };
        let store = table.source().store().to_string();
        check_counts(
            &format!("a COPY of the transform of {store}"),
            &[("tasks", tasks, MAX_TASKS)],
        )?;
        if let Some(at) = c.four_step {
            let four_step = open_four_step(&table, *at, ctx)?;
            // Its passes ran before, as stages of their own (the session
            // runs them first): this stage reads the output.
            four_step
                .ensure_done_by(|| Ok(()))
                .map_err(|e| exec_datafusion_err!("a four-step transform of {store}: {e}"))?;
            table = table.with_four_step(Arc::new(four_step));
        }
        let options =
            RechunkOptions::for_session(ctx.session_config().options(), &ctx.runtime_env())?;
        match &sent.into {
            // The first stage of a staged transform, into the store the
            // session made in its work_dir.
            ChunksInto::Target {
                staged: StagedTarget::Scratch { location },
            } => {
                let what = ("zarrfusion-fft-staged-", "a staged transform's store");
                check_scratch(location, what, &options, &store)?
            }
            ChunksInto::Target { staged } => check_staged(staged, &options, &store)?,
            ChunksInto::Scratch { .. } | ChunksInto::Intermediates { .. } => {
                return plan_err!(
                    "a COPY of the transform of {store} writes into {}, not a staged target",
                    sent.into
                )
            }
        }
        let shape = table.block_space();
        let blocks = line_blocks(&table, c.block_shape, &Selection::all(&shape))?;
        let exec = received_transform_tasks(
            Arc::new(table),
            blocks,
            sent,
            memory_limit(ctx),
            ctx.session_config().options(),
        )?;
        Ok(Arc::new(exec.with_tasks(tasks)))
    }

    /// A run of a four-step transform's pass received by a worker: the
    /// transform made again with SQL's checks, its plan checked against it
    /// (and its blocks' memory computed again), writing only into a
    /// four-step scratch store its `allowed_locations` permit whose
    /// intermediates are what the plan makes (the step's, which writes no
    /// variable of its own), its blocks fitted to the worker's
    /// `allowed_mem` on the worker's own device.
    fn decode_four_step_pass(
        &self,
        p: FourStepPass,
        (sent, tasks): (BlockwiseTasks, usize),
        ctx: &TaskContext,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let chain = Chain {
            source: p.source.clone(),
            columns: p.columns.clone(),
            variable: p.variable.clone(),
            transforms: vec![p.transform.clone()],
            detrend: p.detrend.clone(),
        };
        let table = self.transform_table(&chain, ctx)?;
        let store = table.source().store().to_string();
        check_counts(
            &format!("a four-step transform of {store}"),
            &[("tasks", tasks, MAX_TASKS)],
        )?;
        if p.pass > 1 {
            return plan_err!(
                "a four-step transform of {store} runs pass {} of 2",
                p.pass + 1
            );
        }
        // The first pass reads the source with its trend removed (when it
        // has one), the sums given by the fit before it (`Fitted`).
        let ChunksInto::Intermediates { location } = &sent.into else {
            return plan_err!(
                "a four-step transform of {store} writes into {}, not its intermediates",
                sent.into
            );
        };
        if *location != p.at.work || !sent.variables.is_empty() {
            return plan_err!(
                "a four-step transform of {store} writes its intermediates in {}, not {location} \
                 (and no variables, not {:?})",
                p.at.work,
                sent.variables
            );
        }
        let four_step = open_four_step(&table, p.at, ctx)?;
        let config = ZarrConfig::of(ctx.session_config().options());
        let device = choose_device(&config.device)
            .map_err(|e| exec_datafusion_err!("a four-step transform of {store}: {e}"))?;
        let memory_limit = memory_limit(ctx);
        let exec = PassBlocks::tasks(
            Arc::new(table),
            Arc::new(four_step),
            p.pass,
            device,
            memory_limit,
        )?;
        Ok(Arc::new(exec.with_tasks(tasks)))
    }

    /// A detrend's fit received by a worker: the detrended transform (one,
    /// of a variable: the four-step path, a staged transform's first
    /// stage) made again with SQL's checks, as many chunks at once as the
    /// worker's `allowed_mem` holds beside every line's sums (refused when
    /// one does not fit).
    fn decode_detrend_fit(
        &self,
        fit: DetrendFit,
        ctx: &TaskContext,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let table = self.transform_table(&fit.chain, ctx)?;
        let store = table.source().store().to_string();
        check_counts(
            &format!("a detrend's fit of {store}"),
            &[("tasks", fit.tasks, MAX_TASKS)],
        )?;
        let Some(detrended) = table.detrended() else {
            return plan_err!("a detrend's fit of {store} is sent for a transform with a detrend");
        };
        let (sums, task) = (
            DetrendedSource::sums_memory(&detrended.source.shape(), detrended.axes()),
            DetrendedSource::task_memory(&detrended.source),
        );
        fits_on_worker(
            sums.saturating_add(task),
            "a chunk of a detrend's fit beside every line's sums",
            ctx,
        )?;
        let room = memory_limit(ctx).map_or(usize::MAX, |l| l.saturating_sub(sums));
        let workers = (room / task.max(1)).clamp(1, rayon::current_num_threads().max(1));
        let table = table.with_fit_workers(workers);
        let exec = DetrendFitExec::new(Arc::new(table))?;
        Ok(Arc::new(exec.with_tasks(fit.tasks)))
    }

    /// Step 1 of a COPY of a selection received by a worker: its read
    /// made again, its expressions over the columns read (and those of
    /// the tables it joins in, whose rows are its `inputs`), writing only
    /// into a COPY's intermediate store or temporary directory (or an
    /// object-store prefix its `allowed_locations` permit), its tasks
    /// fitted to the worker's `allowed_mem` beside the tables joined in.
    fn decode_blockwise(
        &self,
        run: BlockwiseRun,
        inputs: &[Arc<dyn ExecutionPlan>],
        ctx: &TaskContext,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        // A transform's kernels compute their one variable (or their
        // intermediates) themselves, from no table joined in.
        let computed = |what: &str| match (inputs.len(), run.exprs.len()) {
            (0, 0) => Ok(()),
            (i, e) => plan_err!("{what} have no inputs and no expressions, got {i} and {e}"),
        };
        let (read, broadcasts, rolling) = match run.kernel {
            Kernel::Transform(blocks) => {
                computed("a transform's blocks")?;
                return self.decode_transform_blocks(*blocks, (run.step, run.tasks), ctx);
            }
            Kernel::FourStepPass(pass) => {
                computed("a four-step pass's blocks")?;
                return self.decode_four_step_pass(*pass, (run.step, run.tasks), ctx);
            }
            Kernel::Evaluate(read) => {
                let (read, broadcasts) =
                    self.joined_inputs(*read, JoinedRows::Inputs(inputs), ctx)?;
                (read, broadcasts, None)
            }
            Kernel::Roll(window) => {
                let window = self.decode_window(*window, JoinedRows::Inputs(inputs), ctx)?;
                let Some(window) = window.downcast_ref::<RollingWindowExec>() else {
                    return internal_err!("a rolling window decoded as {}", window.name());
                };
                let rolling = Arc::clone(window.rolling());
                let broadcasts = window.broadcasts().clone();
                (rolling.read.clone(), broadcasts, Some(rolling))
            }
        };
        let store = read.table.store.clone();
        let stage_tasks = run.tasks == TASKS_OF_STAGE && !broadcasts.is_empty();
        check_counts(
            &format!("a blockwise step over {store}"),
            &[("tasks", run.tasks.max(usize::from(stage_tasks)), MAX_TASKS)],
        )?;
        if run.exprs.len() > MAX_ARRAYS {
            return plan_err!(
                "a blockwise step over {store} writes {} variables",
                run.exprs.len()
            );
        }
        let options =
            RechunkOptions::for_session(ctx.session_config().options(), &ctx.runtime_env())?;
        match &run.step.into {
            ChunksInto::Scratch { location } => {
                let what = ("zarrfusion-copy-", "a COPY's intermediate store");
                check_scratch(location, what, &options, &store)?
            }
            ChunksInto::Target { staged } => check_staged(staged, &options, &store)?,
            ChunksInto::Intermediates { .. } => {
                return plan_err!(
                    "a blockwise step over {store} writes into {}, not a COPY's store",
                    run.step.into
                )
            }
        }
        let schema = match &rolling {
            Some(rolling) => Arc::clone(&rolling.output_schema),
            None => Arc::clone(&read.schema),
        };
        let exprs = (run.exprs.iter())
            .map(|e| self.decode_expr(e, ctx, &schema))
            .collect::<Result<Vec<_>>>()?;
        // The tables joined in are held beside the chunks being made.
        let joined = JoinedMemory::of(ctx.memory_pool().as_ref(), &broadcasts);
        let batch_size = ctx.session_config().batch_size().max(1);
        let BlockRead {
            table,
            columns,
            schema,
            selection,
            ..
        } = read;
        let threads = options.threads;
        let exec = BlockwiseTasksExec::received(
            (table, selection),
            (run.step, broadcasts),
            threads,
            |grid, block, types, threads| match rolling {
                None => {
                    let grid = SelectedGrid {
                        io_concurrency: options.io_concurrency,
                        ..*grid
                    };
                    Ok(Step::Evaluate(Evaluate::plan(
                        &grid, block, columns, schema, exprs, threads, joined,
                    )?))
                }
                Some(rolling) => {
                    let writers = RollChunks::plan(
                        rolling,
                        exprs,
                        (block, grid.shape, types),
                        (threads as u64, batch_size, joined),
                        &grid.table.store,
                        ExecutionPlanMetricsSet::new(),
                    )?;
                    Ok(Step::Writers(Box::new(writers)))
                }
            },
        )?;
        Ok(Arc::new(match stage_tasks {
            true => exec.with_tasks_of_stage(),
            false => exec.with_tasks(run.tasks),
        }))
    }

    /// `expr` as it travels.
    fn encode_expr(&self, expr: &Arc<dyn PhysicalExpr>) -> Result<String> {
        Ok(BASE64.encode(serialize_physical_expr(expr, self)?.encode_to_vec()))
    }

    /// An expression as it travelled, over `schema`.
    fn decode_expr(
        &self,
        text: &str,
        ctx: &TaskContext,
        schema: &Schema,
    ) -> Result<Arc<dyn PhysicalExpr>> {
        let bytes = BASE64
            .decode(text)
            .map_err(|e| exec_datafusion_err!("an expression that is not base64: {e}"))?;
        let proto = PhysicalExprNode::decode(bytes.as_slice())
            .map_err(|e| exec_datafusion_err!("a malformed expression: {e}"))?;
        parse_physical_expr(&proto, ctx, schema, self)
    }

    fn encode_reduction(&self, r: &DenseReductionExec, tasks: usize) -> Result<Reduction> {
        let mut aggregates = Vec::new();
        for a in r.aggregates() {
            aggregates.push(Aggregate {
                op: a.op.name().to_string(),
                arg: a.arg.as_ref().map(|e| self.encode_expr(e)).transpose()?,
                output: a.output.to_string(),
                label: a.label,
            });
        }
        let states = r.schema();
        Ok(Reduction {
            read: self.joined_read(r.read())?,
            groups: r
                .group_keys()
                .iter()
                .map(|k| {
                    Ok(GroupKey {
                        dim: k.dim,
                        expr: k.expr.as_ref().map(|e| self.encode_expr(e)).transpose()?,
                    })
                })
                .collect::<Result<_>>()?,
            aggregates,
            predicate: r.predicate().map(|e| self.encode_expr(e)).transpose()?,
            states: columns(&states),
            positioned: r.positioned(),
            io_concurrency: r.io_concurrency(),
            tasks,
            bands: r.bands().map(|b| BandCut {
                dim: b.dim,
                keys: b.keys,
                descending: b.descending,
                workers: b.workers,
                at_once: b.at_once,
            }),
            gives: r.result_columns(),
        })
    }

    fn decode_reduction(
        &self,
        reduction: Reduction,
        inputs: JoinedRows,
        ctx: &TaskContext,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        // A merge's reduction is not run: only the merge is fitted to the
        // worker's allowed_mem.
        let runs = matches!(inputs, JoinedRows::Inputs(_));
        let (read, broadcasts) = self.joined_inputs(reduction.read, inputs, ctx)?;
        let stage_tasks = reduction.tasks == TASKS_OF_STAGE && !broadcasts.is_empty();
        let (table, selection) = (&read.table, &read.selection);
        let store = &table.store;
        let n_dims = table.dims.len();
        // Per dimension: grouped by its coordinate, or by functions of it.
        let mut plain = vec![0usize; n_dims];
        let mut functions = vec![0usize; n_dims];
        for key in &reduction.groups {
            let d = key.dim;
            if d >= n_dims {
                return plan_err!("a reduction of {store} groups by dimension {d} of {n_dims}");
            }
            match key.expr {
                None => plain[d] += 1,
                Some(_) => functions[d] += 1,
            }
            if plain[d] > 1 || (plain[d] > 0 && functions[d] > 0) {
                return plan_err!(
                    "a reduction of {store} groups by dimension {d} twice, or by it and by \
                     functions of it"
                );
            }
        }
        if reduction.groups.len() > MAX_AGGREGATES {
            return plan_err!(
                "a reduction of {store} has {} grouping columns (at most {MAX_AGGREGATES})",
                reduction.groups.len()
            );
        }
        let n = reduction.aggregates.len();
        let tasks_known = (1..=MAX_TASKS).contains(&reduction.tasks);
        if n > MAX_AGGREGATES || !(tasks_known || stage_tasks) {
            return plan_err!(
                "a reduction of {store} has {n} aggregates (at most {MAX_AGGREGATES}) over {} \
                 tasks (1 to {MAX_TASKS})",
                reduction.tasks
            );
        }
        // The groups of the dimensions grouped by as they are, before any
        // key is evaluated; those grouped by functions of their coordinate
        // (at most one group per position, often far fewer: 12 months)
        // are counted once their keys are (below).
        let state_per_group = 8 + 32 * n as u128;
        let of = store.clone();
        let check_state = move |groups: u128| {
            if groups.saturating_mul(state_per_group) > MAX_STATE_BYTES as u128 {
                return plan_err!(
                    "a reduction of {of} has {groups} groups: their state would exceed {} bytes",
                    MAX_STATE_BYTES
                );
            }
            Ok(())
        };
        // In bands, a band's groups: the cut dimension's keys per band.
        let cut = reduction.bands.map(|b| (b.dim, b.keys as u64));
        check_state((0..n_dims).filter(|&d| plain[d] > 0).fold(1u128, |n, d| {
            let len: u64 = selection.ranges(d).iter().map(|r| r.end - r.start).sum();
            let len = match cut {
                Some((dim, keys)) if dim == d => len.min(keys),
                _ => len,
            };
            n.saturating_mul(u128::from(len))
        }))?;
        let input = Arc::clone(&read.schema);
        let subject = format!("a reduction of {store}");
        let parse_type = |text: &str| parse_type(&subject, text);
        let mut aggregates = Vec::with_capacity(n);
        for a in reduction.aggregates {
            let Some(op) = ReduceOp::from_name(&a.op) else {
                return plan_err!("a reduction of {store} computes {:?}, unknown", a.op);
            };
            aggregates.push(ReduceSpec {
                op,
                arg: a
                    .arg
                    .map(|e| self.decode_expr(&e, ctx, &input))
                    .transpose()?,
                output: parse_type(&a.output)?,
                label: a.label,
            });
        }
        let predicate = reduction
            .predicate
            .map(|e| self.decode_expr(&e, ctx, &input))
            .transpose()?;
        let groups = reduction
            .groups
            .into_iter()
            .map(|k| {
                let schema = key_schema(&table.dims[k.dim]);
                Ok(KeySpec {
                    dim: k.dim,
                    expr: (k.expr)
                        .map(|e| self.decode_expr(&e, ctx, &schema))
                        .transpose()?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let schema = schema_of(&subject, &reduction.states)?;
        let memory_limit = memory_limit(ctx).filter(|_| runs);
        let parts = ReductionParts {
            read,
            groups,
            aggregates,
            predicate,
            schema,
            positioned: reduction.positioned,
            tasks: reduction.tasks,
            io_concurrency: reduction.io_concurrency,
            bands: reduction.bands.map(|b| Bands {
                dim: b.dim,
                keys: b.keys,
                descending: b.descending,
                workers: b.workers,
                at_once: b.at_once,
            }),
            columns: reduction.gives,
        };
        let parallelism = ctx.session_config().target_partitions();
        let exec = DenseReductionExec::of_task(parts, parallelism, memory_limit)?;
        match exec.in_bands() {
            // A band's state, as the session sized it.
            true => {
                if exec.state_bytes() > MAX_STATE_BYTES {
                    return plan_err!(
                        "{subject} in bands holds {} of state a band: over {}",
                        human_readable_size(exec.state_bytes()),
                        human_readable_size(MAX_STATE_BYTES)
                    );
                }
            }
            false => check_state(exec.num_groups() as u128)?,
        }
        Ok(Arc::new(exec.with_broadcasts(broadcasts, memory_limit)?))
    }
}

impl ZarrCodec {
    /// A merge of a dense reduction's positioned states: the reduction
    /// made again (and checked) as a reduction would be, merging what
    /// `input` gathers.
    fn decode_merge(
        &self,
        merge: Merge,
        input: &Arc<dyn ExecutionPlan>,
        ctx: &TaskContext,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if !merge.reduction.positioned
            || merge.reduction.tasks != 1
            || merge.reduction.bands.is_some()
        {
            return plan_err!(
                "a merge of a dense reduction's states merges positioned states of one task's \
                 plan"
            );
        }
        // The merge reads nothing: the tables its reduction joins in are
        // stand-ins, never run.
        let states = self.decode_reduction(merge.reduction, JoinedRows::StandIns, ctx)?;
        let Some(states) = states.downcast_ref::<DenseReductionExec>() else {
            return internal_err!("a dense reduction decoded as {}", states.name());
        };
        let store = states.read().table.store.clone();
        let results = schema_of(
            &format!("a merge of a reduction of {store}"),
            &merge.results,
        )?;
        let states = Arc::new(states.with_tasks(1)?);
        let input = Arc::clone(input);
        let merge = match merge.level {
            true => DenseMergeExec::level(states, input, results)?,
            false => DenseMergeExec::new(states, input, results)?,
        };
        // Fitted to this worker's own allowed_mem, as the session fitted
        // it to its own.
        let needs = merge.projected_memory();
        if let Some(limit) = memory_limit(ctx).filter(|&limit| needs > limit) {
            return resources_err!(
                "DenseMergeExec over {store} needs {} to merge {} groups' states but this \
                 worker's memory limit (allowed_mem) is {}",
                human_readable_size(needs),
                merge.states().num_groups(),
                human_readable_size(limit)
            );
        }
        Ok(Arc::new(merge))
    }

    fn encode_blockwise(&self, step: &BlockwiseTasksExec) -> Result<Node> {
        let (kernel, exprs) = match &step.blocks().step {
            Step::Evaluate(evaluate) => (
                Kernel::Evaluate(Box::new(self.joined_read(&step.evaluate_read(evaluate)?)?)),
                evaluate.exprs.as_slice(),
            ),
            Step::Writers(writers) => {
                if let Some(writes) = transform_writes(step) {
                    let blocks = encode_transform_blocks(writes.table(), writes.blocks())?;
                    (Kernel::Transform(Box::new(blocks)), [].as_slice())
                } else if let Some(pass) = pass_writes(step) {
                    let pass = FourStepPass::of(pass)?;
                    (Kernel::FourStepPass(Box::new(pass)), [].as_slice())
                } else {
                    let Some(roll) = writers.as_any().downcast_ref::<RollChunks>() else {
                        return not_impl_err!(
                            "the chunk-by-chunk COPY of {} cannot run on a cluster's workers yet",
                            step.blocks().store()
                        );
                    };
                    let window = self.encode_rolling(roll.rolling(), 1, roll.batch_size(), 1)?;
                    (Kernel::Roll(Box::new(window)), roll.exprs())
                }
            }
        };
        Ok(Node::Blockwise(BlockwiseRun {
            kernel,
            exprs: exprs
                .iter()
                .map(|e| self.encode_expr(e))
                .collect::<Result<_>>()?,
            step: step.sent().clone(),
            tasks: step.tasks(),
        }))
    }

    fn encode_window(&self, w: &RollingWindowExec) -> Result<Node> {
        let partitions = w.properties().partitioning.partition_count();
        let window = self.encode_rolling(w.rolling(), partitions, w.batch_size(), w.tasks())?;
        Ok(Node::Window(window))
    }

    /// A rolling window's parts as they travel.
    fn encode_rolling(
        &self,
        r: &Rolling,
        partitions: usize,
        batch_size: usize,
        tasks: usize,
    ) -> Result<Window> {
        Ok(Window {
            read: self.joined_read(&r.read)?,
            arg_places: r.arg_places.clone(),
            outputs: (r.outputs.iter())
                .map(|e| self.encode_expr(e))
                .collect::<Result<_>>()?,
            args: (r.args.iter())
                .map(|(e, _)| self.encode_expr(e))
                .collect::<Result<_>>()?,
            aggregates: (r.aggregates.iter())
                .map(|a| Roll {
                    op: a.op.name().to_string(),
                    arg: a.arg,
                    start: a.frame.start,
                    end: a.frame.end,
                    output: a.output_type.to_string(),
                    label: a.label.clone(),
                })
                .collect(),
            dim: r.dim,
            backward: r.backward(),
            schema: (r.output_schema.fields().iter())
                .map(|f| (f.name().clone(), f.data_type().to_string(), f.is_nullable()))
                .collect(),
            partitions,
            batch_size,
            tasks,
        })
    }

    fn decode_window(
        &self,
        w: Window,
        inputs: JoinedRows,
        ctx: &TaskContext,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let (read, broadcasts) = self.joined_inputs(w.read, inputs, ctx)?;
        let store = &read.table.store;
        let stage_tasks = w.tasks == TASKS_OF_STAGE && !broadcasts.is_empty();
        check_counts(
            &format!("a rolling window over {store}"),
            &[
                ("partitions", w.partitions, MAX_PARTITIONS),
                ("tasks", w.tasks.max(usize::from(stage_tasks)), MAX_TASKS),
                ("batch_size", w.batch_size, MAX_BATCH_ROWS),
                ("aggregates", w.aggregates.len(), MAX_AGGREGATES),
            ],
        )?;
        if let Some(bad) = w.arg_places.iter().find(|&&p| p >= read.columns.len()) {
            return plan_err!(
                "a rolling window over {store} takes its arguments from column {bad} of {}",
                read.columns.len()
            );
        }
        if w.args.len() > MAX_AGGREGATES || w.outputs.len() > MAX_AGGREGATES {
            return plan_err!(
                "a rolling window over {store} has {} arguments and {} input columns",
                w.args.len(),
                w.outputs.len()
            );
        }
        let input = Arc::clone(&read.schema);
        let arg_input = Schema::new(
            (w.arg_places.iter())
                .map(|&p| input.field(p).clone())
                .collect::<Vec<_>>(),
        );
        let subject = format!("a rolling window over {store}");
        let parse_type = |text: &str| parse_type(&subject, text);
        let mut aggregates = Vec::with_capacity(w.aggregates.len());
        for a in w.aggregates {
            let Some(op) = RollOp::from_name(&a.op) else {
                return plan_err!("a rolling window over {store} computes {:?}, unknown", a.op);
            };
            let most = MAX_FRAME as i64;
            let bad_start = (a.start)
                .is_some_and(|start| start > a.end || start < -most || a.end - start >= most);
            if bad_start || !(-most..=most).contains(&a.end) {
                return plan_err!(
                    "a rolling window over {store} has the frame [{:?}, {}] (at most {MAX_FRAME} \
                     positions, each end within {MAX_FRAME})",
                    a.start,
                    a.end
                );
            }
            aggregates.push(PhysicalRoll {
                op,
                label: a.label,
                arg: a.arg,
                frame: Frame {
                    start: a.start,
                    end: a.end,
                },
                output_type: parse_type(&a.output)?,
            });
        }
        let outputs = (w.outputs.iter())
            .map(|e| self.decode_expr(e, ctx, &input))
            .collect::<Result<Vec<_>>>()?;
        let args = (w.args.iter())
            .map(|e| self.decode_expr(e, ctx, &arg_input))
            .collect::<Result<Vec<_>>>()?;
        let schema = schema_of(&subject, &w.schema)?;
        let memory_limit = memory_limit(ctx);
        let parts = RollingParts {
            read,
            dim: w.dim,
            arg_places: w.arg_places,
            outputs,
            args,
            aggregates,
            schema,
            partitions: w.partitions,
            batch_size: w.batch_size,
            tasks: w.tasks,
            backward: w.backward,
            refit: false,
        };
        let exec = RollingWindowExec::from_parts(parts, memory_limit)?;
        Ok(Arc::new(exec.with_broadcasts(broadcasts, memory_limit)?))
    }
}

impl PhysicalExtensionCodec for ZarrCodec {
    fn try_decode(
        &self,
        buf: &[u8],
        inputs: &[Arc<dyn ExecutionPlan>],
        ctx: &TaskContext,
        _proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let node: Node = serde_json::from_slice(buf)
            .map_err(|e| exec_datafusion_err!("a malformed zarrfusion plan node: {e}"))?;
        // Every zarrfusion node that travels is a leaf, but for the rows of
        // the tables a scan, a reduction, a rolling window or a COPY's
        // blockwise step joins in.
        // A merge's one input is the states it merges.
        // The stage after a staged transform's first: the first stage's
        // counts.
        let joins = matches!(
            node,
            Node::Scan(_) | Node::Reduction(_) | Node::Window(_) | Node::Blockwise(_)
        );
        let expected = match &node {
            Node::Merge(_) => 1,
            Node::Transform(t) => usize::from(t.staged.is_some() || t.four_step.is_some()),
            Node::After(_) | Node::Fitted => 2,
            Node::Rechunked => 1,
            _ => 0,
        };
        if !joins && inputs.len() != expected {
            return plan_err!(
                "{} has {expected} inputs, got {}",
                node.what(),
                inputs.len()
            );
        }
        match node {
            Node::Scan(scan) => self.decode_scan(scan, inputs, ctx),
            Node::Reduction(reduction) => {
                self.decode_reduction(reduction, JoinedRows::Inputs(inputs), ctx)
            }
            Node::Merge(merge) => self.decode_merge(merge, &inputs[0], ctx),
            Node::Window(window) => self.decode_window(window, JoinedRows::Inputs(inputs), ctx),
            Node::RechunkTasks(run) => decode_rechunk(run, ctx),
            Node::Blockwise(run) => self.decode_blockwise(run, inputs, ctx),
            Node::Transform(transform) => self.decode_transform(transform, inputs, ctx),
            Node::After(After { blocks, what }) => {
                // A name for errors: kept short.
                let what: String = what.chars().take(200).collect();
                let [before, then] = inputs else {
                    return internal_err!("a round after another without its two inputs");
                };
                let (before, then) = (Arc::clone(before), Arc::clone(then));
                Ok(Arc::new(AfterExec::new(before, then, blocks, what)))
            }
            Node::DetrendFit(fit) => self.decode_detrend_fit(fit, ctx),
            Node::Fitted => {
                let [fit, then] = inputs else {
                    return internal_err!("a pass after a detrend's fit without its two inputs");
                };
                let Some(detrended) = reading_detrended(then).cloned() else {
                    return plan_err!(
                        "a detrend's fit comes before the first stage reading a detrended \
                         source (the first pass of a four-step transform, or a staged \
                         transform's first stage by whole lines), not before {}",
                        then.name()
                    );
                };
                let fitted = FittedExec::new(Arc::clone(fit), Arc::clone(then), detrended)?;
                fits_on_worker(fitted.memory(), "the sums of a detrend's lines", ctx)?;
                Ok(Arc::new(fitted))
            }
            // A node in its place (its input's partitions and rows as
            // they are): the stage's plan keeps the nodes the session's
            // has, by which `EXPLAIN ANALYZE` gathers each task's metrics.
            Node::Rechunked => Ok(Arc::new(CooperativeExec::new(Arc::clone(&inputs[0])))),
        }
    }

    fn try_encode(
        &self,
        node: Arc<dyn ExecutionPlan>,
        buf: &mut Vec<u8>,
        _proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<()> {
        if let Some(reduction) = node.downcast_ref::<DenseReductionExec>() {
            let Some(tasks) = reduction.tasks() else {
                return not_impl_err!(
                    "a dense reduction runs on a cluster's workers as partial states or bands only"
                );
            };
            let encoded = Node::Reduction(self.encode_reduction(reduction, tasks)?);
            return serde_json::to_writer(buf, &encoded)
                .map_err(|e| exec_datafusion_err!("encoding a dense reduction: {e}"));
        }
        if let Some(merge) = node.downcast_ref::<DenseMergeExec>() {
            let encoded = Node::Merge(Merge {
                reduction: self.encode_reduction(merge.states(), 1)?,
                results: columns(merge.results()),
                level: merge.merged() == Merged::States,
            });
            return serde_json::to_writer(buf, &encoded)
                .map_err(|e| exec_datafusion_err!("encoding a dense reduction's merge: {e}"));
        }
        if let Some(rechunk) = node.downcast_ref::<RechunkTasksExec>() {
            let encoded = Node::RechunkTasks(RechunkRun {
                rechunk: rechunk.rechunk().clone(),
                target: rechunk.target().clone(),
                round: rechunk.round(),
                tasks: rechunk.tasks(),
            });
            return serde_json::to_writer(buf, &encoded)
                .map_err(|e| exec_datafusion_err!("encoding a rechunk's tasks: {e}"));
        }
        if let Some(step) = node.downcast_ref::<BlockwiseTasksExec>() {
            let encoded = self.encode_blockwise(step)?;
            return serde_json::to_writer(buf, &encoded)
                .map_err(|e| exec_datafusion_err!("encoding a blockwise step: {e}"));
        }
        if let Some(window) = node.downcast_ref::<RollingWindowExec>() {
            let encoded = self.encode_window(window)?;
            return serde_json::to_writer(buf, &encoded)
                .map_err(|e| exec_datafusion_err!("encoding a rolling window: {e}"));
        }
        if let Some(rechunk) = node.downcast_ref::<RechunkExec>() {
            if !rechunk.is_on_workers() {
                return not_impl_err!(
                    "a rechunk(...) copied in the session cannot run on a cluster's workers"
                );
            }
            return serde_json::to_writer(buf, &Node::Rechunked)
                .map_err(|e| exec_datafusion_err!("encoding a rechunk(...): {e}"));
        }
        if let Some(fit) = node.downcast_ref::<DetrendFitExec>() {
            let table = fit.table();
            let chain = match table.four_step() {
                Some(_) => Chain::of_four_step(table)?,
                None => Chain::of(table)?,
            };
            let encoded = Node::DetrendFit(DetrendFit {
                chain,
                tasks: fit.tasks(),
            });
            return serde_json::to_writer(buf, &encoded)
                .map_err(|e| exec_datafusion_err!("encoding a detrend's fit: {e}"));
        }
        if node.downcast_ref::<FittedExec>().is_some() {
            return serde_json::to_writer(buf, &Node::Fitted)
                .map_err(|e| exec_datafusion_err!("encoding a pass after a detrend's fit: {e}"));
        }
        if let Some(after) = node.downcast_ref::<AfterExec>() {
            let encoded = Node::After(After {
                blocks: after.blocks(),
                what: after.what().to_string(),
            });
            return serde_json::to_writer(buf, &encoded)
                .map_err(|e| exec_datafusion_err!("encoding a round after another: {e}"));
        }
        if let Some(fft) = node.downcast_ref::<FftExec>() {
            let encoded = Node::Transform(Transform::of(fft)?);
            return serde_json::to_writer(buf, &encoded)
                .map_err(|e| exec_datafusion_err!("encoding a transform: {e}"));
        }
        let Some(scan) = node.downcast_ref::<ZarrScanExec>() else {
            return not_impl_err!(
                "{} cannot run on a cluster's workers yet (zarrfusion distributes Zarr scans, \
                 dense reductions, rolling windows, transforms and the steps of a COPY)",
                node.name()
            );
        };
        let encoded = Node::Scan(Scan {
            read: self.joined_read(scan.read())?,
            partitions: scan.properties().partitioning.partition_count(),
            limit: scan.limit(),
            batch_size: scan.batch_size(),
            io_concurrency: scan.io_concurrency(),
            tasks: scan.tasks(),
        });
        serde_json::to_writer(buf, &encoded)
            .map_err(|e| exec_datafusion_err!("encoding a Zarr scan: {e}"))
    }
}

//! The tasks' rows gathered in task order: [`InOrderGatherExec`].
//!
//! DataFusion gathers a stage's tasks (`CoalescePartitionsExec` over
//! datafusion-distributed's `NetworkCoalesceExec`) as their batches come,
//! interleaved. A reduction in bands of a later dimension (the diurnal
//! cycle of every cell, in bands of latitudes) deals its bands to the
//! tasks in contiguous runs, so its rows are in band order only task after
//! task: gathered in that order, a `COPY` writes them a band at a time, as
//! on one machine, instead of holding the whole result.
//!
//! Every task runs at once, as they would under DataFusion's gather: the
//! first task's rows pass straight on, the later tasks' are held in memory
//! up to a bound ([`GATHER_MEMORY`], taken from the session's pool) and
//! spilled to the session's temporary files beyond it (DataFusion's spill
//! files, in its disk manager's directories), then read back in order
//! when their task's turn comes. A task that fails fails the query at once.

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex};

use datafusion::arrow::array::RecordBatch;
use datafusion::common::{exec_datafusion_err, human_readable_size, internal_err, Result};
use datafusion::error::DataFusionError;
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::{EquivalenceProperties, Partitioning};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricsSet, SpillMetrics};
use datafusion::physical_plan::spill::spill_pool::spsc_channel;
use datafusion::physical_plan::spill::SpillManager;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
};
use futures::{Stream, StreamExt, TryStreamExt};
use tokio::sync::Notify;
use tokio::task::JoinSet;

use crate::plan_methods::{named_plan_methods, no_expressions_method};

/// Bytes of the later tasks' rows an [`InOrderGatherExec`] holds in
/// memory (beyond them, they are spilled until their task's turn).
pub const GATHER_MEMORY: usize = 32 << 20;

/// Bytes of a spill file before the next one is started (a file is
/// removed once read).
const SPILL_FILE_BYTES: usize = 64 << 20;

/// Gathers its input's partitions (a stage's tasks, one partition each)
/// into one, the partitions' rows one after the other in partition order.
/// Every partition runs at once; the later ones' rows are held up to
/// [`GATHER_MEMORY`] and spilled beyond it.
#[derive(Debug)]
pub struct InOrderGatherExec {
    input: Arc<dyn ExecutionPlan>,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl InOrderGatherExec {
    /// The partitions of `input` gathered in their order.
    pub fn new(input: Arc<dyn ExecutionPlan>) -> Self {
        let properties = PlanProperties::new(
            EquivalenceProperties::new(input.schema()),
            Partitioning::UnknownPartitioning(1),
            EmissionType::Incremental,
            Boundedness::Bounded,
        );
        Self {
            input,
            properties: Arc::new(properties),
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }
}

impl DisplayAs for InOrderGatherExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        match t {
            DisplayFormatType::TreeRender => write!(f, "order=partition by partition"),
            _ => write!(
                f,
                "InOrderGatherExec: partitions one after the other, the later ones held in {} \
                 (then spilled)",
                human_readable_size(GATHER_MEMORY)
            ),
        }
    }
}

impl ExecutionPlan for InOrderGatherExec {
    named_plan_methods!("InOrderGatherExec");

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    no_expressions_method!();

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        match <[_; 1]>::try_from(children) {
            Ok([input]) => Ok(Arc::new(Self::new(input))),
            Err(children) => internal_err!(
                "InOrderGatherExec takes one child, given {}",
                children.len()
            ),
        }
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        if partition != 0 {
            return internal_err!("InOrderGatherExec has one partition, asked for {partition}");
        }
        let schema = self.schema();
        let count = self.input.output_partitioning().partition_count();
        let mut inputs = (0..count)
            .map(|i| self.input.execute(i, Arc::clone(&context)))
            .collect::<Result<VecDeque<_>>>()?;
        let Some(first) = inputs.pop_front() else {
            let empty = futures::stream::empty::<Result<RecordBatch>>();
            return Ok(Box::pin(RecordBatchStreamAdapter::new(schema, empty)));
        };
        let reservation = MemoryConsumer::new("InOrderGatherExec").register(context.memory_pool());
        let spills = Arc::new(SpillManager::new(
            context.runtime_env(),
            SpillMetrics::new(&self.metrics, partition),
            Arc::clone(&schema),
        ));
        let held = Arc::new(Held {
            reservation,
            spills,
            failed: Mutex::new(None),
            failure: Notify::new(),
        });
        // Each later partition driven into its spool at once.
        let mut tasks = JoinSet::new();
        let spools: Vec<Arc<Spool>> = inputs
            .into_iter()
            .map(|input| {
                let spool = Arc::new(Spool::default());
                tasks.spawn(fill(input, Arc::clone(&spool), Arc::clone(&held)));
                spool
            })
            .collect();
        let spooled = Arc::clone(&held);
        let later = futures::stream::iter(spools)
            .map(move |spool| drain(spool, Arc::clone(&spooled)))
            .flatten();
        // The first partition's rows as they come, then each spool's; the
        // tasks stop when the stream is dropped.
        let gathered = until_failed(first.chain(later).boxed(), held).map(move |batch| {
            let _running = &tasks;
            batch
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, gathered)))
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }
}

/// What the spools of one gather share: the memory they hold, where they
/// spill, and the first failure of a later partition (which fails the
/// gather at once, whichever partition it is reading).
struct Held {
    reservation: MemoryReservation,
    spills: Arc<SpillManager>,
    failed: Mutex<Option<DataFusionError>>,
    failure: Notify,
}

impl Held {
    /// Records `error` as the gather's failure (the first one kept).
    fn fail(&self, error: DataFusionError) {
        if let Ok(mut failed) = self.failed.lock() {
            failed.get_or_insert(error);
        }
        self.failure.notify_one();
    }

    /// The failure of a later partition, once (taken).
    fn failure(&self) -> Option<DataFusionError> {
        self.failed.lock().ok().and_then(|mut f| f.take())
    }
}

/// A later partition's rows until its turn: in memory while the gather's
/// memory allows, then every later batch in a spill file (DataFusion's
/// spill channel, read while it is written), so the memory's batches
/// always come before the file's.
#[derive(Default)]
struct Spool {
    state: Mutex<SpoolState>,
    ready: Notify,
}

#[derive(Default)]
struct SpoolState {
    queue: VecDeque<RecordBatch>,
    /// The spilled batches, once the partition spills (until the reader
    /// takes them).
    spilled: Option<SendableRecordBatchStream>,
    /// Whether it spills (its later batches go to the file).
    spilling: bool,
    /// Whether the partition has given all of its rows.
    done: bool,
}

/// What a reader takes from a spool next.
enum Next {
    Batch(RecordBatch),
    Spilled(SendableRecordBatchStream),
    Wait,
    Done,
}

impl Spool {
    fn state(&self) -> Result<std::sync::MutexGuard<'_, SpoolState>> {
        self.state
            .lock()
            .map_err(|_| exec_datafusion_err!("a gathered partition's rows were lost"))
    }

    /// Holds `batch` in memory when nothing is spilled yet and the
    /// gather's memory allows; else gives it back (to be spilled), the
    /// spool from then on spilling.
    fn hold(&self, batch: RecordBatch, held: &Held) -> Result<Option<RecordBatch>> {
        let mut state = self.state()?;
        let size = batch.get_array_memory_size();
        let fits = !state.spilling
            && held.reservation.size() + size <= GATHER_MEMORY
            && held.reservation.try_grow(size).is_ok();
        if !fits {
            state.spilling = true;
            return Ok(Some(batch));
        }
        state.queue.push_back(batch);
        drop(state);
        self.ready.notify_one();
        Ok(None)
    }

    /// What the reader takes next.
    fn take(&self, held: &Held) -> Result<Next> {
        let mut state = self.state()?;
        if let Some(batch) = state.queue.pop_front() {
            held.reservation.shrink(batch.get_array_memory_size());
            return Ok(Next::Batch(batch));
        }
        if let Some(spilled) = state.spilled.take() {
            return Ok(Next::Spilled(spilled));
        }
        Ok(if state.done { Next::Done } else { Next::Wait })
    }
}

/// Drives a later partition's `input` into its `spool` (spilling once the
/// gather's memory is taken); a failure is the gather's. The spool is
/// done only when every row came.
async fn fill(mut input: SendableRecordBatchStream, spool: Arc<Spool>, held: Arc<Held>) {
    let mut sink = None;
    let result = async {
        while let Some(batch) = input.next().await {
            let Some(batch) = spool.hold(batch?, &held)? else {
                continue;
            };
            let sink = match sink.as_mut() {
                Some(sink) => sink,
                None => {
                    let (new, read) = spsc_channel(SPILL_FILE_BYTES, Arc::clone(&held.spills));
                    spool.state()?.spilled = Some(read);
                    sink.insert(new)
                }
            };
            sink.push_batch(&batch)?;
            spool.ready.notify_one();
        }
        spool.state()?.done = true;
        Ok::<_, DataFusionError>(())
    }
    .await;
    if let Err(e) = result {
        held.fail(e);
    }
    // The spill file's reader ends here (after `done`, or after the
    // failure is recorded).
    drop(sink);
    spool.ready.notify_one();
}

/// A later partition's rows from its `spool`, in the order they came:
/// what it holds in memory, then its spill file as it is written, until
/// it is done.
fn drain(spool: Arc<Spool>, held: Arc<Held>) -> impl Stream<Item = Result<RecordBatch>> {
    futures::stream::try_unfold((spool, held), |(spool, held)| async move {
        loop {
            match spool.take(&held)? {
                Next::Batch(batch) => {
                    let one = futures::stream::once(async { Ok(batch) }).boxed();
                    return Ok::<_, DataFusionError>(Some((one, (spool, held))));
                }
                Next::Spilled(read) => {
                    // The file ends when its writer stops: done, or failed.
                    let (checked, failed) = (Arc::clone(&spool), Arc::clone(&held));
                    let end = futures::stream::once(async move {
                        match checked.state()?.done {
                            true => Ok(None),
                            false => Err(failed.failure().unwrap_or_else(|| {
                                exec_datafusion_err!(
                                    "a gathered partition stopped before its last rows"
                                )
                            })),
                        }
                    });
                    let read = read.map_ok(Some).chain(end);
                    let read = read.try_filter_map(|b| async move { Ok(b) }).boxed();
                    return Ok(Some((read, (spool, held))));
                }
                Next::Done => return Ok(None),
                Next::Wait => spool.ready.notified().await,
            }
        }
    })
    .try_flatten()
}

/// `stream` until a later partition of the gather fails: then that
/// failure, at once, and nothing more.
fn until_failed(
    stream: impl Stream<Item = Result<RecordBatch>> + Send + Unpin + 'static,
    held: Arc<Held>,
) -> impl Stream<Item = Result<RecordBatch>> + Send + 'static {
    futures::stream::unfold(Some((stream, held)), |state| async move {
        let (mut stream, held) = state?;
        if let Some(e) = held.failure() {
            return Some((Err(e), None));
        }
        tokio::select! {
            next = stream.next() => next.map(|batch| (batch, Some((stream, held)))),
            _ = held.failure.notified() => {
                let e = held.failure().unwrap_or_else(|| {
                    exec_datafusion_err!("a gathered partition failed")
                });
                Some((Err(e), None))
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use datafusion::arrow::array::{Int64Array, UInt32Array};
    use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
    use datafusion::common::exec_err;
    use datafusion::execution::memory_pool::{GreedyMemoryPool, MemoryPool};
    use datafusion::execution::runtime_env::RuntimeEnvBuilder;
    use datafusion::physical_plan::streaming::{PartitionStream, StreamingTableExec};

    use super::*;

    /// A partition's rows: `batches` batches of `rows` rows, each row its
    /// partition and its place in it, then an error where `fails`, or
    /// nothing ever more where `hangs`.
    #[derive(Debug)]
    struct Part {
        schema: SchemaRef,
        partition: u32,
        batches: usize,
        rows: usize,
        fails: bool,
        hangs: bool,
    }

    impl PartitionStream for Part {
        fn schema(&self) -> &SchemaRef {
            &self.schema
        }

        fn execute(&self, _ctx: Arc<TaskContext>) -> SendableRecordBatchStream {
            let (schema, partition, rows) = (Arc::clone(&self.schema), self.partition, self.rows);
            let batches = (0..self.batches).map(move |b| {
                let places = (b * rows..(b + 1) * rows).map(|r| r as i64);
                let columns: Vec<Arc<dyn datafusion::arrow::array::Array>> = vec![
                    Arc::new(UInt32Array::from(vec![partition; rows])),
                    Arc::new(Int64Array::from_iter_values(places)),
                ];
                Ok(RecordBatch::try_new(Arc::clone(&schema), columns)?)
            });
            let fails = self
                .fails
                .then(|| exec_err!("partition {partition} failed"));
            let stream = futures::stream::iter(batches).chain(futures::stream::iter(fails));
            let stream = match self.hangs {
                true => stream.chain(futures::stream::pending()).boxed(),
                false => stream.boxed(),
            };
            Box::pin(RecordBatchStreamAdapter::new(
                Arc::clone(&self.schema),
                stream,
            ))
        }
    }

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("partition", DataType::UInt32, false),
            Field::new("place", DataType::Int64, false),
        ]))
    }

    /// The gather of `parts` (their partitions in order) under a memory
    /// pool of `pool` bytes (`None`: unbounded).
    fn gather(parts: Vec<Part>, pool: Option<usize>) -> (InOrderGatherExec, Arc<TaskContext>) {
        let partitions = (parts.into_iter())
            .map(|p| Arc::new(p) as Arc<dyn PartitionStream>)
            .collect();
        let input = StreamingTableExec::try_new(schema(), partitions, None, [], false, None);
        let mut runtime = RuntimeEnvBuilder::new();
        if let Some(bytes) = pool {
            let pool: Arc<dyn MemoryPool> = Arc::new(GreedyMemoryPool::new(bytes));
            runtime = runtime.with_memory_pool(pool);
        }
        let context = TaskContext::default().with_runtime(runtime.build_arc().unwrap());
        (
            InOrderGatherExec::new(Arc::new(input.unwrap())),
            Arc::new(context),
        )
    }

    fn part(partition: u32, batches: usize, rows: usize) -> Part {
        Part {
            schema: schema(),
            partition,
            batches,
            rows,
            fails: false,
            hangs: false,
        }
    }

    /// Every partition's rows, one partition after the other, each in its
    /// order: held in memory, spilled where the pool is small (also
    /// mid-partition), or straight through.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn partitions_come_one_after_the_other_held_or_spilled() {
        for (pool, spills) in [(None, false), (Some(64 << 10), true), (Some(0), true)] {
            let sizes = [(7, 300), (0, 10), (25, 500), (1, 1), (40, 256), (3, 1000)];
            let parts = (sizes.iter().enumerate())
                .map(|(i, &(batches, rows))| part(i as u32, batches, rows))
                .collect();
            let (exec, context) = gather(parts, pool);
            assert_eq!(exec.properties().partitioning.partition_count(), 1);
            let stream = exec.execute(0, context).unwrap();
            let batches: Vec<RecordBatch> = stream.try_collect().await.unwrap();
            let mut got = Vec::new();
            for batch in &batches {
                let partition = batch.column(0).as_any().downcast_ref::<UInt32Array>();
                let place = batch.column(1).as_any().downcast_ref::<Int64Array>();
                got.extend(
                    partition
                        .unwrap()
                        .values()
                        .iter()
                        .zip(place.unwrap().values()),
                );
            }
            let want: Vec<(u32, i64)> = (sizes.iter().enumerate())
                .flat_map(|(i, &(batches, rows))| {
                    (0..(batches * rows) as i64).map(move |r| (i as u32, r))
                })
                .collect();
            let got: Vec<(u32, i64)> = got.into_iter().map(|(&p, &r)| (p, r)).collect();
            assert_eq!(got, want, "pool {pool:?}");
            let spilled = (exec.metrics().unwrap().spilled_rows()).unwrap_or(0);
            assert_eq!(spilled > 0, spills, "pool {pool:?}: {spilled} rows spilled");
        }
    }

    /// A later partition's failure fails the gather at once, while the
    /// first still runs (it never ends here), held or spilled.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_later_partition_failing_fails_the_gather_at_once() {
        for pool in [None, Some(0)] {
            let mut first = part(0, 2, 10);
            first.hangs = true;
            let mut failing = part(2, 5, 100);
            failing.fails = true;
            let (exec, context) = gather(vec![first, part(1, 3, 10), failing], pool);
            let stream = exec.execute(0, context).unwrap();
            let collected = tokio::time::timeout(Duration::from_secs(20), async {
                stream.try_collect::<Vec<_>>().await
            });
            let error = collected.await.expect("the gather hung").unwrap_err();
            assert!(error.to_string().contains("partition 2 failed"), "{error}");
        }
    }

    /// A spilled partition failing after some of its rows were read gives
    /// the failure, not a shorter result.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_spilled_partition_that_fails_gives_no_partial_result() {
        let mut failing = part(1, 30, 100);
        failing.fails = true;
        let (exec, context) = gather(vec![part(0, 4, 100), failing, part(2, 2, 5)], Some(0));
        let stream = exec.execute(0, context).unwrap();
        let error = stream.try_collect::<Vec<_>>().await.unwrap_err();
        assert!(error.to_string().contains("partition 1 failed"), "{error}");
    }
}

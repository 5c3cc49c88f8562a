//! Running a Zarr write as a plan operator whose output is COPY's row
//! count: its plan properties, and the stream that runs the write on a
//! blocking thread inside a memory reservation (cancelled, leaving
//! nothing, when the stream is dropped).

use std::future::Future;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use datafusion::arrow::array::{RecordBatch, UInt64Array};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::common::{exec_err, DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::EquivalenceProperties;
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricBuilder};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{Partitioning, PlanProperties};
use futures::TryStreamExt;

use super::sink::CancelOnDrop;
use crate::memory::reserve;
use crate::table::BroadcastInputs;

/// Plan properties of an operator whose output is one `count` row.
pub(crate) fn count_properties() -> Arc<PlanProperties> {
    counted_properties("count")
}

/// Plan properties of an operator whose output is one row of one
/// `UInt64` column, `column` (a write's row count, a run's tasks).
pub(crate) fn counted_properties(column: &str) -> Arc<PlanProperties> {
    let schema = Arc::new(Schema::new(vec![Field::new(
        column,
        DataType::UInt64,
        false,
    )]));
    Arc::new(PlanProperties::new(
        EquivalenceProperties::new(schema),
        Partitioning::UnknownPartitioning(1),
        EmissionType::Final,
        Boundedness::Bounded,
    ))
}

/// What a write did.
pub(crate) struct Written {
    /// Rows (cells) of the result written.
    pub rows: u64,
    /// Decoded bytes read.
    pub bytes_read: u64,
    /// Decoded bytes written, intermediates included.
    pub bytes_written: u64,
}

/// When a write reading tables joined in takes its memory
/// ([`WriteJob::run_holding`]).
pub(crate) enum Joined {
    /// After the tables are computed: their plans run in this process
    /// first and give back what they used before the write reserves its
    /// own (the session).
    ComputedFirst,
    /// Before the tables are received: their rows come over the network,
    /// whose buffers the engine keeps in the memory pool while they are
    /// held, so the write reserves its own first (a cluster's worker).
    Received,
}

/// `written`, with the batch of its row count (of `schema`: one `UInt64`
/// column).
fn with_count(schema: SchemaRef, written: Written) -> Result<(Written, RecordBatch)> {
    let count = UInt64Array::from(vec![written.rows]);
    let batch = RecordBatch::try_new(schema, vec![Arc::new(count)])?;
    Ok((written, batch))
}

/// A write run by an operator.
pub(crate) struct WriteJob<'a> {
    /// The operator's name, for messages.
    pub operator: &'static str,
    /// The store read, for messages.
    pub store: &'a str,
    /// Memory its tasks hold together.
    pub projected: usize,
    /// The operator's metrics.
    pub metrics: &'a ExecutionPlanMetricsSet,
    /// Its plan properties (from [`count_properties`]).
    pub properties: &'a PlanProperties,
}

impl WriteJob<'_> {
    /// Reserves the projected memory, then runs `write` (given the
    /// cancellation flag) on a blocking thread; the stream yields the row
    /// count.
    pub fn run(
        self,
        partition: usize,
        context: &TaskContext,
        write: impl FnOnce(&AtomicBool) -> Result<Written> + Send + 'static,
    ) -> Result<SendableRecordBatchStream> {
        let schema = Arc::clone(self.properties.eq_properties.schema());
        self.run_to_batch(partition, context, move |cancelled| {
            with_count(schema, write(cancelled)?)
        })
    }

    /// [`Self::run`] for an operator whose write reads tables joined in
    /// (`broadcasts`, computed as `joined` says, each reserving its own
    /// memory as it is held): `write` runs as [`Self::run`] runs it, the
    /// tables held until it is done.
    pub fn run_holding(
        self,
        (broadcasts, joined): (BroadcastInputs, Joined),
        partition: usize,
        context: Arc<TaskContext>,
        write: impl FnOnce(&AtomicBool) -> Result<Written> + Send + 'static,
    ) -> Result<SendableRecordBatchStream> {
        let schema = Arc::clone(self.properties.eq_properties.schema());
        if let Joined::ComputedFirst = joined {
            let (operator, store, projected) =
                (self.operator, self.store.to_string(), self.projected);
            let (metrics, properties) = (self.metrics.clone(), self.properties.clone());
            let stream = futures::stream::once(async move {
                let held = broadcasts.hold(&context, 1).await?;
                let job = WriteJob {
                    operator,
                    store: &store,
                    projected,
                    metrics: &metrics,
                    properties: &properties,
                };
                job.run(partition, &context, move |cancelled| {
                    let _held = held;
                    write(cancelled)
                })
            })
            .try_flatten();
            return Ok(Box::pin(RecordBatchStreamAdapter::new(schema, stream)));
        }
        let task = Arc::clone(&context);
        let hold = async move { broadcasts.hold(&task, 1).await };
        self.run_prepared(partition, &context, hold, move |cancelled, held| {
            let written = {
                let _held = held;
                write(cancelled)?
            };
            with_count(schema, written)
        })
    }

    /// [`Self::run`] for a job whose output is a batch of its own (of the
    /// schema of its plan properties): the stream yields it.
    pub fn run_to_batch(
        self,
        partition: usize,
        context: &TaskContext,
        write: impl FnOnce(&AtomicBool) -> Result<(Written, RecordBatch)> + Send + 'static,
    ) -> Result<SendableRecordBatchStream> {
        let ready = futures::future::ready(Ok(()));
        self.run_prepared(partition, context, ready, move |cancelled, ()| {
            write(cancelled)
        })
    }

    /// Reserves the projected memory, then awaits `prepare` (what the
    /// write needs made first), then runs `write` (given the cancellation
    /// flag and what `prepare` gave) on a blocking thread; the stream
    /// yields its batch.
    fn run_prepared<P: Send + 'static>(
        self,
        partition: usize,
        context: &TaskContext,
        prepare: impl Future<Output = Result<P>> + Send + 'static,
        write: impl FnOnce(&AtomicBool, P) -> Result<(Written, RecordBatch)> + Send + 'static,
    ) -> Result<SendableRecordBatchStream> {
        if partition != 0 {
            return exec_err!("{} has one partition, asked for {partition}", self.operator);
        }
        let reservation = reserve(
            self.operator,
            self.store,
            0,
            self.projected,
            context,
            self.metrics,
        )?;
        let bytes_read = MetricBuilder::new(self.metrics).counter("bytes_read", 0);
        let bytes_written = MetricBuilder::new(self.metrics).counter("bytes_written", 0);
        let copy_time = MetricBuilder::new(self.metrics).subset_time("copy_time", 0);
        let output_rows = MetricBuilder::new(self.metrics).output_rows(0);
        let schema = Arc::clone(self.properties.eq_properties.schema());
        let stream = futures::stream::once(async move {
            let prepared = prepare.await?;
            let timer = copy_time.timer();
            let cancelled = Arc::new(AtomicBool::new(false));
            let mut guard = CancelOnDrop(Arc::clone(&cancelled), false);
            let (written, batch) = tokio::task::spawn_blocking(move || write(&cancelled, prepared))
                .await
                .map_err(|e| {
                    DataFusionError::Execution(format!("the Zarr write stopped: {e}"))
                })??;
            guard.1 = true;
            drop(reservation);
            timer.done();
            bytes_read.add(written.bytes_read as usize);
            bytes_written.add(written.bytes_written as usize);
            output_rows.add(batch.num_rows());
            Ok(batch)
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, stream)))
    }
}

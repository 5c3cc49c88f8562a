//! Batches from a partition's blocking thread to its stream, a run at a
//! time.
//!
//! The scan, the rolling window and the transform make their batches on
//! a blocking thread, one box of cells after the other, and hand them to
//! the stream DataFusion polls. Handed over one by one through a channel,
//! each batch woke the other side once: at 8,192 rows a batch, 33,000
//! wake-ups and context switches for a 1 GB grid, a fifth of a scan's time
//! on two cores. [`BatchRuns`] sends them in runs of up to
//! [`RUN_BATCHES`] batches (never more than one box's, so that a run holds
//! what the box's batches hold already), and the stream gives them out one
//! by one: a wake-up per run.
//!
//! [`RunStreamBuilder`] makes the stream and runs its producers: a task or
//! blocking thread the stream aborts when it is dropped, whose error ends
//! the stream and whose panic is an error for whoever polls it, not a
//! hang.
//!
//! ```
//! use std::sync::Arc;
//! use datafusion::arrow::array::Int32Array;
//! use datafusion::arrow::datatypes::{DataType, Field, Schema};
//! use datafusion::arrow::record_batch::RecordBatch;
//! use futures::StreamExt;
//! use zarrfusion::table::{RunStreamBuilder, RUN_BATCHES};
//!
//! let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Int32, false)]));
//! let runtime = tokio::runtime::Runtime::new().unwrap();
//! let rows = runtime.block_on(async {
//!     let mut builder = RunStreamBuilder::new(Arc::clone(&schema));
//!     let mut runs = builder.runs(RUN_BATCHES);
//!     let made = Arc::clone(&schema);
//!     builder.spawn_blocking(move || {
//!         for i in 0..20 {
//!             let column = Arc::new(Int32Array::from(vec![i, i]));
//!             if !runs.push(RecordBatch::try_new(Arc::clone(&made), vec![column])?) {
//!                 return Ok(()); // the stream is gone
//!             }
//!         }
//!         runs.flush();
//!         Ok(())
//!     });
//!     let batches: Vec<_> = builder.build().collect().await;
//!     batches.into_iter().map(|b| b.unwrap().num_rows()).sum::<usize>()
//! });
//! assert_eq!(rows, 40);
//! ```

use std::collections::VecDeque;
use std::future::Future;

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::SendableRecordBatchStream;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::StreamExt;
use tokio::sync::mpsc::{channel, Receiver, Sender};
use tokio::task::JoinSet;

/// The most batches a run holds: at 8,192 rows a batch, 65,536 rows.
pub const RUN_BATCHES: usize = 8;

/// Runs in the channel at once; with the run being made and the one the
/// stream gives out, three runs are held at most.
const RUNS_IN_CHANNEL: usize = 1;

/// Runs of batches in flight at once at most (see [`RUNS_IN_CHANNEL`]):
/// what an operator projects for its batches in flight is this many runs
/// of [`RUN_BATCHES`] batches.
pub const RUNS_IN_FLIGHT: usize = RUNS_IN_CHANNEL + 2;

/// The sending end: batches gathered into a run, sent when it is full or
/// flushed.
#[derive(Debug)]
pub struct BatchRuns {
    tx: Sender<Result<Vec<RecordBatch>>>,
    run: Vec<RecordBatch>,
    /// The most batches a run holds.
    most: usize,
}

impl BatchRuns {
    /// Adds `batch` to the run, and sends the run once it is full;
    /// `false` when the stream is gone (the query was cancelled or has
    /// enough rows).
    pub fn push(&mut self, batch: RecordBatch) -> bool {
        self.run.push(batch);
        self.run.len() < self.most || self.flush()
    }

    /// Sends the batches of the run (at the end of a box and of the
    /// partition); `false` when the stream is gone.
    pub fn flush(&mut self) -> bool {
        if self.run.is_empty() {
            return !self.tx.is_closed();
        }
        let run = std::mem::take(&mut self.run);
        self.tx.blocking_send(Ok(run)).is_ok()
    }

    /// Whether the stream is gone.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

/// A stream of the batches [`BatchRuns`] send, and the tasks that make
/// them (see the module docs).
pub struct RunStreamBuilder {
    schema: SchemaRef,
    tx: Sender<Result<Vec<RecordBatch>>>,
    rx: Receiver<Result<Vec<RecordBatch>>>,
    tasks: JoinSet<Result<()>>,
}

impl RunStreamBuilder {
    /// A stream of batches of `schema`.
    pub fn new(schema: SchemaRef) -> Self {
        let (tx, rx) = channel(RUNS_IN_CHANNEL);
        Self {
            schema,
            tx,
            rx,
            tasks: JoinSet::new(),
        }
    }

    /// A sender for a producer, sending runs of `most` batches at most
    /// ([`RUN_BATCHES`], or 1 to send each batch as it comes).
    pub fn runs(&self, most: usize) -> BatchRuns {
        let most = most.clamp(1, RUN_BATCHES);
        BatchRuns {
            tx: self.tx.clone(),
            run: Vec::with_capacity(most),
            most,
        }
    }

    /// Runs `task` until it ends or the stream is dropped.
    pub fn spawn(&mut self, task: impl Future<Output = Result<()>> + Send + 'static) {
        self.tasks.spawn(task);
    }

    /// Runs `work` on a blocking thread; the stream dropped, its result
    /// is not waited for.
    pub fn spawn_blocking(&mut self, work: impl FnOnce() -> Result<()> + Send + 'static) {
        self.tasks.spawn_blocking(work);
    }

    /// The stream: every batch sent, in the order sent, then the first
    /// error of a producer (a panic as an error).
    pub fn build(self) -> SendableRecordBatchStream {
        let Self {
            schema,
            tx,
            rx,
            tasks,
        } = self;
        drop(tx);
        let state = Flow {
            rx: Some(rx),
            tasks,
            run: VecDeque::new(),
            ended: false,
        };
        let batches = futures::stream::unfold(state, |mut state| async move {
            if state.ended {
                return None;
            }
            let next = state.next().await?;
            // The first error is the last item.
            state.ended = next.is_err();
            Some((next, state))
        });
        Box::pin(RecordBatchStreamAdapter::new(schema, batches.boxed()))
    }
}

/// What the stream holds between polls.
struct Flow {
    /// The channel, until every sender is gone.
    rx: Option<Receiver<Result<Vec<RecordBatch>>>>,
    /// The producers (aborted when dropped with the stream).
    tasks: JoinSet<Result<()>>,
    /// What is left of the run given out.
    run: VecDeque<RecordBatch>,
    /// Whether an error was given out.
    ended: bool,
}

impl Flow {
    /// The next batch, or a producer's error; `None` at the end.
    async fn next(&mut self) -> Option<Result<RecordBatch>> {
        loop {
            if let Some(batch) = self.run.pop_front() {
                return Some(Ok(batch));
            }
            if let Some(rx) = &mut self.rx {
                match rx.recv().await {
                    Some(Ok(run)) => {
                        self.run = run.into();
                        continue;
                    }
                    Some(Err(e)) => return Some(Err(e)),
                    None => self.rx = None,
                }
            }
            // Every sender is gone: the producers' results, the first
            // error ending the stream.
            match self.tasks.join_next().await? {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => {
                    self.tasks.abort_all();
                    return Some(Err(e));
                }
                Err(e) => {
                    self.tasks.abort_all();
                    let what = if e.is_panic() {
                        "panicked"
                    } else {
                        "was cancelled"
                    };
                    return Some(Err(DataFusionError::Execution(format!(
                        "a partition's thread {what}: {e}"
                    ))));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use datafusion::arrow::array::Int64Array;
    use datafusion::arrow::datatypes::{DataType, Field, Schema};

    use super::*;

    fn int_schema() -> SchemaRef {
        Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, false)]))
    }

    fn batch(schema: &SchemaRef, values: Vec<i64>) -> RecordBatch {
        let column = Arc::new(Int64Array::from(values));
        RecordBatch::try_new(Arc::clone(schema), vec![column]).unwrap()
    }

    /// The items of the stream `make` builds, run in a runtime.
    fn collect(make: impl FnOnce() -> RunStreamBuilder) -> Vec<Result<RecordBatch>> {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(async { make().build().collect::<Vec<_>>().await })
    }

    /// Two producers, each sending runs of different lengths with flushes
    /// between: every batch arrives once, each producer's in its order.
    #[test]
    fn every_batch_arrives_once_in_each_producers_order() {
        let n = 3 * RUN_BATCHES as i64 + 5;
        let out = collect(|| {
            let schema = int_schema();
            let mut builder = RunStreamBuilder::new(Arc::clone(&schema));
            for producer in 0..2i64 {
                let (mut runs, schema) = (builder.runs(RUN_BATCHES), Arc::clone(&schema));
                builder.spawn_blocking(move || {
                    for i in 0..n {
                        assert!(runs.push(batch(&schema, vec![producer, i])));
                        if i % 7 == 6 {
                            assert!(runs.flush());
                        }
                    }
                    assert!(runs.flush());
                    Ok(())
                });
            }
            builder
        });
        let mut seen = [Vec::new(), Vec::new()];
        for b in out {
            let b = b.unwrap();
            let x = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
            seen[x.value(0) as usize].push(x.value(1));
        }
        let all: Vec<i64> = (0..n).collect();
        assert_eq!(seen, [all.clone(), all]);
    }

    /// A producer's error ends the stream after what it sent; a panic is
    /// an error too.
    #[test]
    fn errors_and_panics_end_the_stream_as_errors() {
        let out = collect(|| {
            let schema = int_schema();
            let mut builder = RunStreamBuilder::new(Arc::clone(&schema));
            let mut runs = builder.runs(RUN_BATCHES);
            builder.spawn_blocking(move || {
                runs.push(batch(&schema, vec![1]));
                runs.flush();
                Err(DataFusionError::Execution("the chunk is bad".into()))
            });
            builder
        });
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].as_ref().unwrap().num_rows(), 1);
        let error = out[1].as_ref().unwrap_err().to_string();
        assert!(error.contains("the chunk is bad"), "{error}");

        let out = collect(|| {
            let mut builder = RunStreamBuilder::new(int_schema());
            builder.spawn_blocking(|| panic!("a bug"));
            builder
        });
        assert_eq!(out.len(), 1);
        let error = out[0].as_ref().unwrap_err().to_string();
        assert!(error.contains("panicked"), "{error}");
    }

    /// A stream dropped early leaves its producer a closed channel: it
    /// stops instead of waiting forever.
    #[test]
    fn a_dropped_stream_stops_its_producer() {
        let schema = int_schema();
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        runtime.block_on(async {
            let mut builder = RunStreamBuilder::new(Arc::clone(&schema));
            let mut runs = builder.runs(RUN_BATCHES);
            builder.spawn_blocking(move || {
                let mut sent = 0;
                while runs.push(batch(&schema, vec![sent])) {
                    sent += 1;
                }
                done_tx.send(sent).unwrap();
                Ok(())
            });
            let mut stream = builder.build();
            assert!(stream.next().await.unwrap().is_ok());
        });
        let sent = done_rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .unwrap();
        assert!(sent >= 1, "{sent}");
    }
}

//! A detrend's fit as a cluster's stage, before the first round that
//! reads the source.
//!
//! A detrended transform whose blocks hold pieces of the groups its trend
//! is fitted over (the four-step path: pieces of lines; a staged
//! transform's first stage: lines of one dimension, while xrft fits the
//! trend over all of them) removes a trend gathered first
//! ([`super::source::detrended`]): one pass over the source gathers each
//! group's sums before the first block is read. On a cluster that pass is
//! a stage of its own: [`DetrendFitExec`] reads a distributed task's
//! contiguous run of the source's chunks on a worker and yields the sums
//! of the groups they reach, one row a group, then a row counting its
//! chunks. Every task of the first round reading the source (the first
//! four-step pass, or a staged transform's first stage by whole lines)
//! gets all of them (broadcast) through a [`FittedExec`], which adds them
//! up into every group's sums, checks that every chunk was read once, and
//! gives them to the round's detrended source before it reads a block.
//! Only the sums cross between stages (48 bytes a group and task), never
//! values.
//!
//! What travels (the codec's `detrend_fit` and `fitted`) is the transform
//! as its first round sends it, with the trend (its kind and dimensions),
//! and the tasks; a worker makes the detrended source again with SQL's
//! checks and its own memory limit.
//!
//! Primitives (see [`crate::array`]): read + reduce (per-group sums,
//! merged where they are used).

use std::fmt;
use std::sync::Arc;

use datafusion::arrow::array::{Array, AsArray, Float64Array, RecordBatch, UInt64Array};
use datafusion::arrow::datatypes::{DataType, Field, Float64Type, Schema, SchemaRef, UInt64Type};
use datafusion::common::{exec_err, human_readable_size, plan_err, DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::EquivalenceProperties;
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion::physical_plan::{
    execute_stream, DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties,
};
use futures::StreamExt;

use super::detrend::TrendSums;
use super::kernels::{Kernels, TransformClock};
use super::source::DetrendedSource;
use super::table::FftTable;
use crate::array::tasks::{after_once, RanOnce};
use crate::device::Device;
use crate::plan_methods::{
    leaf_plan_methods, metered_plan_methods, named_plan_methods, no_expressions_method,
    two_children,
};
use crate::table::task_share;
use crate::write::write_job::{WriteJob, Written};

/// The columns of a fit task's rows: the line (null on the row counting
/// the task's chunks), its sums ([`TrendSums::parts`]), and the chunks.
fn fit_schema() -> SchemaRef {
    let part = |name: &str| Field::new(name, DataType::Float64, false);
    Arc::new(Schema::new(vec![
        Field::new("line", DataType::UInt64, true),
        part("total_re"),
        part("total_im"),
        part("moment_re"),
        part("moment_im"),
        part("moment2_re"),
        part("moment2_im"),
        Field::new("chunks", DataType::UInt64, false),
    ]))
}

/// A run of the source's chunks of a detrended transform,
/// gathering the sums of the groups they reach: the leaf of a cluster's fit
/// stage (see the module docs).
#[derive(Debug)]
pub struct DetrendFitExec {
    /// The transform, whose source is detrended.
    table: Arc<FftTable>,
    detrended: Arc<DetrendedSource>,
    /// The distributed tasks the chunks are dealt to.
    tasks: usize,
    kernels: Arc<Kernels>,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl DetrendFitExec {
    /// The fit of `table`'s detrended source, on one task; refused for a
    /// source that is not detrended.
    pub fn new(table: Arc<FftTable>) -> Result<Self> {
        let Some(detrended) = table.detrended().cloned() else {
            return plan_err!(
                "the transform of '{}' variable '{}' has no detrend to fit",
                table.source().store(),
                table.source().variable()
            );
        };
        let metrics = ExecutionPlanMetricsSet::new();
        let kernels = Kernels::on(Device::Cpu, 0, TransformClock::in_metrics(&metrics));
        Ok(Self {
            table,
            detrended,
            tasks: 1,
            kernels: Arc::new(kernels),
            properties: Arc::new(PlanProperties::new(
                EquivalenceProperties::new(fit_schema()),
                Partitioning::UnknownPartitioning(1),
                EmissionType::Final,
                Boundedness::Bounded,
            )),
            metrics,
        })
    }

    /// This fit with its chunks dealt to `tasks` tasks of a cluster's
    /// stage, each (its index from its `DistributedTaskContext`) reading
    /// a contiguous run of them.
    pub fn with_tasks(&self, tasks: usize) -> Self {
        Self {
            table: Arc::clone(&self.table),
            detrended: Arc::clone(&self.detrended),
            tasks: tasks.max(1),
            kernels: Arc::clone(&self.kernels),
            properties: Arc::clone(&self.properties),
            metrics: self.metrics.clone(),
        }
    }

    /// The distributed tasks the chunks are dealt to.
    pub fn tasks(&self) -> usize {
        self.tasks
    }

    /// The transform whose detrend this fits.
    pub fn table(&self) -> &FftTable {
        &self.table
    }

    /// The source's chunks the fit reads.
    pub fn chunks(&self) -> u64 {
        self.detrended.fit_blocks().num_blocks()
    }

    /// Bytes the fit reads (what a cluster's tasks are sized by).
    pub fn bytes_read(&self) -> u64 {
        let source = &self.detrended.source;
        let cells = source
            .shape()
            .iter()
            .fold(1u64, |a, &n| a.saturating_mul(n));
        cells.saturating_mul(source.element_size() as u64)
    }

    /// Memory one task holds at its peak: a chunk per worker and every
    /// line's sums.
    pub fn projected_memory(&self) -> usize {
        self.detrended.fit_memory()
    }
}

impl DisplayAs for DetrendFitExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let source = &self.detrended.source;
        write!(
            f,
            "DetrendFitExec: the detrend of '{}' variable '{}', chunks={}, lines={}, \
             workers={}, projected_memory={}",
            source.store(),
            source.variable(),
            self.chunks(),
            self.detrended.groups(),
            self.detrended.workers(),
            human_readable_size(self.projected_memory())
        )?;
        if self.tasks > 1 {
            write!(f, ", tasks={}", self.tasks)?;
        }
        Ok(())
    }
}

impl ExecutionPlan for DetrendFitExec {
    leaf_plan_methods!("DetrendFitExec");

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let store = self.detrended.source.store().to_string();
        let run = task_share(
            "DetrendFitExec",
            &store,
            self.tasks,
            0..self.chunks(),
            &context,
        )?;
        let job = WriteJob {
            operator: "DetrendFitExec",
            store: &store,
            projected: self.projected_memory(),
            metrics: &self.metrics,
            properties: &self.properties,
        };
        let (detrended, kernels) = (Arc::clone(&self.detrended), Arc::clone(&self.kernels));
        let single = self.table.single_precision();
        let bytes = self.bytes_read();
        let all = self.chunks().max(1);
        job.run_to_batch(partition, &context, move |cancelled| {
            let chunks = run.end.saturating_sub(run.start);
            let sums = match single {
                true => detrended.gather::<f32>(run, &kernels, cancelled),
                false => detrended.gather::<f64>(run, &kernels, cancelled),
            }
            .map_err(|e| {
                DataFusionError::Execution(format!(
                    "fitting the detrend of '{}' variable '{}': {e}",
                    detrended.source.store(),
                    detrended.source.variable()
                ))
            })?;
            // The lines its chunks reach (the others' sums are zeros,
            // which add nothing), then its count of chunks.
            let reached: Vec<(u64, [f64; 6])> = (sums.iter().enumerate())
                .map(|(line, s)| (line as u64, s.parts()))
                .filter(|(_, parts)| parts.iter().any(|&x| x != 0.0))
                .collect();
            let mut lines: Vec<Option<u64>> = reached.iter().map(|(l, _)| Some(*l)).collect();
            lines.push(None);
            let mut columns: Vec<Arc<dyn Array>> = vec![Arc::new(UInt64Array::from(lines))];
            for k in 0..6 {
                let values = reached.iter().map(|(_, parts)| parts[k]).chain([0.0]);
                columns.push(Arc::new(Float64Array::from_iter_values(values)));
            }
            let counts = (reached.iter().map(|_| 0)).chain([chunks]);
            columns.push(Arc::new(UInt64Array::from_iter_values(counts)));
            let batch = RecordBatch::try_new(fit_schema(), columns)?;
            let written = Written {
                rows: chunks,
                bytes_read: (bytes as u128 * chunks as u128 / all as u128) as u64,
                bytes_written: 0,
            };
            Ok((written, batch))
        })
    }

    metered_plan_methods!(|_| None);
}

/// The first round reading a detrended source (a four-step transform's
/// first pass, a staged transform's first stage by whole lines), run once
/// the fit (every fit task's rows, broadcast) is added up and given to
/// that source (see the module docs). Its partitions and rows are the
/// round's.
#[derive(Debug)]
pub struct FittedExec {
    fit: Arc<dyn ExecutionPlan>,
    then: Arc<dyn ExecutionPlan>,
    detrended: Arc<DetrendedSource>,
    properties: Arc<PlanProperties>,
    /// Whether the fit was added up, once for all of this node's
    /// partitions.
    ran: RanOnce,
}

impl FittedExec {
    /// `then` (the first stage reading `detrended`: the first pass of a
    /// four-step transform, or a staged transform's first stage by whole
    /// lines) once `fit` (the fit's rows) is added up and given to
    /// `detrended`; refused when `fit` does not give a fit's rows.
    pub fn new(
        fit: Arc<dyn ExecutionPlan>,
        then: Arc<dyn ExecutionPlan>,
        detrended: Arc<DetrendedSource>,
    ) -> Result<Self> {
        if fit.schema().fields() != fit_schema().fields() {
            return plan_err!(
                "the fit of the detrend of '{}' gives rows of {:?}, not a fit's",
                detrended.source.store(),
                fit.schema()
            );
        }
        Ok(Self {
            properties: Arc::clone(then.properties()),
            fit,
            then,
            detrended,
            ran: RanOnce::default(),
        })
    }

    /// Bytes it holds: every line's sums.
    pub fn memory(&self) -> usize {
        self.detrended
            .groups()
            .saturating_mul(std::mem::size_of::<TrendSums>())
    }
}

/// Adds up the fit's rows (`fit`, every task's) into every line's sums of
/// `detrended` and gives them to it; an error when a row names a line it
/// does not have or the tasks did not read every chunk once.
async fn add_up(
    fit: Arc<dyn ExecutionPlan>,
    context: Arc<TaskContext>,
    detrended: Arc<DetrendedSource>,
) -> Result<()> {
    let source = &detrended.source;
    let what = || {
        format!(
            "the detrend of '{}' variable '{}'",
            source.store(),
            source.variable()
        )
    };
    let mut sums = vec![TrendSums::default(); detrended.groups()];
    let mut chunks = 0u64;
    let mut stream = execute_stream(fit, context)?;
    while let Some(batch) = stream.next().await {
        let batch = batch?;
        let malformed = || DataFusionError::Execution(format!("malformed fit rows for {}", what()));
        if batch.num_columns() != 8 {
            return Err(malformed());
        }
        let lines = batch
            .column(0)
            .as_primitive_opt::<UInt64Type>()
            .ok_or_else(malformed)?;
        let parts: Vec<&Float64Array> = (1..7)
            .map(|c| batch.column(c).as_primitive_opt::<Float64Type>())
            .collect::<Option<_>>()
            .ok_or_else(malformed)?;
        let counts = batch
            .column(7)
            .as_primitive_opt::<UInt64Type>()
            .ok_or_else(malformed)?;
        for row in 0..batch.num_rows() {
            chunks = chunks.saturating_add(counts.value(row));
            if lines.is_null(row) {
                continue;
            }
            let line = lines.value(row);
            let Some(sum) = usize::try_from(line).ok().and_then(|l| sums.get_mut(l)) else {
                return exec_err!(
                    "the fit of {} names line {line} of its {}",
                    what(),
                    detrended.groups()
                );
            };
            sum.merge(&TrendSums::from_parts(std::array::from_fn(|k| {
                parts[k].value(row)
            })));
        }
    }
    let expected = detrended.fit_blocks().num_blocks();
    if chunks != expected {
        return exec_err!(
            "the fit of {}'s tasks on the cluster read {chunks} of its {expected} chunks",
            what()
        );
    }
    detrended.set_fit(sums).map_err(DataFusionError::Execution)
}

impl DisplayAs for FittedExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "FittedExec: after the detrend's fit ({} chunks, {} lines, {})",
            self.detrended.fit_blocks().num_blocks(),
            self.detrended.groups(),
            human_readable_size(self.memory())
        )
    }
}

impl ExecutionPlan for FittedExec {
    named_plan_methods!("FittedExec");

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.fit, &self.then]
    }

    no_expressions_method!();

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let [fit, then] = two_children("FittedExec", children)?;
        Ok(Arc::new(Self::new(fit, then, Arc::clone(&self.detrended))?))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let partitions = self.properties.partitioning.partition_count();
        if partition >= partitions {
            return exec_err!("FittedExec has {partitions} partitions, not partition {partition}");
        }
        let added = add_up(
            Arc::clone(&self.fit),
            Arc::clone(&context),
            Arc::clone(&self.detrended),
        );
        let then = Arc::clone(&self.then);
        Ok(after_once(&self.ran, added, then, partition, context))
    }
}

//! `DenseMergeExec`: a dense reduction's partial states from a cluster's
//! tasks, merged by group position.
//!
//! On a cluster each task of a dense reduction folds its run of the blocks
//! into dense per-group state and sends one row per group it touched (see
//! `partial`). When those rows are led by the group's position in the
//! group space (C order of the grouped dimensions' keys) instead of its
//! coordinates, merging them needs no hash table: each row's state is
//! added into slot `position` of DataFusion's own accumulators
//! (`GroupsAccumulator::merge_batch`, the same merge its final aggregate
//! does once it has looked the group up; a group's slot there is found in
//! a dense array of positions), and the result comes out in C order of the
//! groups the tasks sent, the order of the reduction on one machine, so an
//! `ORDER BY` of the grouping columns costs no sort. The group columns are
//! made from the coordinates here and never cross the network.
//!
//! The merge holds every group's state and the result: what one machine's
//! reduction holds as its output, and less than its workers' states, so a
//! reduction the session planned fits it.

use std::fmt;
use std::sync::Arc;

use datafusion::arrow::array::{Array, AsArray, RecordBatch, UInt32Array, UInt64Array};
use datafusion::arrow::compute::take;
use datafusion::arrow::datatypes::{DataType, SchemaRef, UInt64Type};
use datafusion::common::{exec_err, human_readable_size, internal_err, plan_err, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::EmitTo;
use datafusion::physical_expr::aggregate::AggregateFunctionExpr;
use datafusion::physical_expr::{Distribution, EquivalenceProperties};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricBuilder};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties,
};
use futures::StreamExt;

use super::exec::{in_batches, DenseReductionExec, Reduction};
use crate::memory::reserve;
use crate::plan_methods::{metered_plan_methods, named_plan_methods, no_expressions_method};

/// The name of the column leading a task's partial states with each
/// group's position in the group space.
pub const GROUP_POSITION: &str = "__zarrfusion_group";

/// A position no task has sent yet.
const NO_SLOT: u32 = u32::MAX;

/// Merges the partial states of a dense reduction's tasks by group
/// position into its results (see the module docs).
#[derive(Debug)]
pub struct DenseMergeExec {
    /// The reduction whose states it merges (its tasks' leaf).
    states: Arc<DenseReductionExec>,
    reduction: Arc<Reduction>,
    /// DataFusion's functions of the aggregates, whose state the tasks
    /// send.
    aggregates: Vec<Arc<AggregateFunctionExpr>>,
    /// Per aggregate: its number of state columns.
    state_columns: Vec<usize>,
    /// The gathered states.
    input: Arc<dyn ExecutionPlan>,
    schema: SchemaRef,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl DenseMergeExec {
    /// Merges the positioned states of `states` (a dense reduction giving
    /// them) that `input` gathers into one partition, giving `results`
    /// (the reduction's result columns). Refused (while planning) when an
    /// aggregate has no accumulator merging states by group index, or when
    /// the columns do not match.
    pub fn new(
        states: Arc<DenseReductionExec>,
        input: Arc<dyn ExecutionPlan>,
        results: SchemaRef,
    ) -> Result<Self> {
        let reduction = Arc::clone(states.reduction());
        let store = reduction.store().to_string();
        if !states.positioned() {
            return internal_err!(
                "DenseMergeExec over {store} merges states led by their group's position"
            );
        }
        let (n_keys, n_aggregates) = (states.group_keys().len(), states.aggregates().len());
        if results.fields().len() != n_keys + n_aggregates {
            return plan_err!(
                "DenseMergeExec over {store} gives {n_keys} group and {n_aggregates} aggregate \
                 columns, not {}",
                results.fields().len()
            );
        }
        if reduction.num_groups() >= NO_SLOT as usize {
            return plan_err!(
                "DenseMergeExec over {store}: {} groups, at most {NO_SLOT}",
                reduction.num_groups()
            );
        }
        let aggregates = states.datafusion_aggregates(&results)?;
        let mut state_columns = Vec::with_capacity(aggregates.len());
        let mut expected = vec![DataType::UInt64];
        for a in &aggregates {
            if !a.groups_accumulator_supported() {
                return plan_err!(
                    "DenseMergeExec over {store}: {} has no accumulator merging by group",
                    a.name()
                );
            }
            let fields = a.state_fields()?;
            state_columns.push(fields.len());
            expected.extend(fields.iter().map(|f| f.data_type().clone()));
        }
        let types = |s: &SchemaRef| -> Vec<DataType> {
            s.fields().iter().map(|f| f.data_type().clone()).collect()
        };
        if types(&input.schema()) != expected {
            return plan_err!(
                "DenseMergeExec over {store} merges states {expected:?}, its input gives {:?}",
                types(&input.schema())
            );
        }
        let mut produced = reduction.key_types()?;
        produced.extend(aggregates.iter().map(|a| a.field().data_type().clone()));
        if produced != types(&results) {
            return plan_err!(
                "DenseMergeExec over {store} gives {produced:?}, not {:?}",
                types(&results)
            );
        }
        let ordering = reduction.ordering(&results);
        let properties = Arc::new(PlanProperties::new(
            EquivalenceProperties::new_with_orderings(Arc::clone(&results), [ordering]),
            Partitioning::UnknownPartitioning(1),
            EmissionType::Final,
            Boundedness::Bounded,
        ));
        Ok(Self {
            states,
            reduction,
            aggregates,
            state_columns,
            input,
            schema: results,
            properties,
            metrics: ExecutionPlanMetricsSet::new(),
        })
    }

    /// The reduction whose states it merges.
    pub fn states(&self) -> &DenseReductionExec {
        &self.states
    }

    /// Memory it holds at its peak: every group's state, each group's slot
    /// among them, the group columns and the results (and the order they
    /// are taken in).
    pub fn projected_memory(&self) -> usize {
        let groups = self.reduction.num_groups();
        let state: usize = (self.aggregates.iter())
            .filter_map(|a| a.state_fields().ok())
            .flatten()
            .map(|f| f.data_type().primitive_width().unwrap_or(16))
            .sum();
        let output: usize = (self.schema.fields().iter())
            .map(|f| f.data_type().primitive_width().unwrap_or(16))
            .sum();
        groups
            .saturating_mul(state + 2 * output + 4 + 12)
            .saturating_add(self.reduction.key_bytes())
    }
}

impl DisplayAs for DenseMergeExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let aggregates: Vec<String> = self
            .aggregates
            .iter()
            .map(|a| a.name().to_string())
            .collect();
        write!(
            f,
            "DenseMergeExec: store={}, aggr=[{}], groups={}, merges=partial states by group position, \
             projected_memory={}",
            self.reduction.store(),
            aggregates.join(", "),
            self.reduction.num_groups(),
            human_readable_size(self.projected_memory())
        )
    }
}

impl ExecutionPlan for DenseMergeExec {
    named_plan_methods!("DenseMergeExec");

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    no_expressions_method!();

    fn required_input_distribution(&self) -> Vec<Distribution> {
        vec![Distribution::SinglePartition]
    }

    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        vec![false]
    }

    fn with_new_children(
        self: Arc<Self>,
        mut children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if children.len() != 1 {
            return exec_err!("DenseMergeExec has one child, got {}", children.len());
        }
        let input = children.remove(0);
        Ok(Arc::new(Self::new(
            Arc::clone(&self.states),
            input,
            Arc::clone(&self.schema),
        )?))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        if partition != 0 {
            return internal_err!("DenseMergeExec has one partition, asked for {partition}");
        }
        let reduction = Arc::clone(&self.reduction);
        let store = reduction.store().to_string();
        let projected = self.projected_memory();
        let metrics = self.metrics.clone();
        let reserving = Arc::clone(&context);
        let mut accumulators = (self.aggregates.iter())
            .map(|a| a.create_groups_accumulator())
            .collect::<Result<Vec<_>>>()?;
        let state_columns = self.state_columns.clone();
        let schema = Arc::clone(&self.schema);
        let mut input = self.input.execute(0, Arc::clone(&context))?;
        let batch_size = context.session_config().batch_size().max(1);
        let output_rows = MetricBuilder::new(&self.metrics).output_rows(0);
        let merge_time = MetricBuilder::new(&self.metrics).subset_time("merge_time", 0);
        let result = async move {
            let groups = reduction.num_groups();
            // Reserved once the states come: a task of the stage below that
            // runs in this process has then let its own memory go.
            let mut reservation = None;
            let mut reserve_once = || -> Result<()> {
                if reservation.is_none() {
                    let r = reserve("DenseMergeExec", &store, 0, projected, &reserving, &metrics)?;
                    reservation = Some(r);
                }
                Ok(())
            };
            // DataFusion's accumulators number groups in the order they
            // are first met (each new one in the batch that meets it), so
            // each position gets the next slot when first sent: a lookup
            // in a dense array, not a hash table.
            let mut slot_of = Vec::new();
            let mut slots = 0usize;
            let mut indices: Vec<usize> = Vec::new();
            while let Some(batch) = input.next().await {
                let batch = batch?;
                reserve_once()?;
                if slot_of.is_empty() {
                    slot_of = vec![NO_SLOT; groups];
                }
                let _timer = merge_time.timer();
                let Some(positions) = batch.column(0).as_primitive_opt::<UInt64Type>() else {
                    return internal_err!(
                        "DenseMergeExec over {store}: group positions are not u64"
                    );
                };
                if positions.null_count() > 0 {
                    return exec_err!(
                        "DenseMergeExec over {store}: a task sent a state without its group"
                    );
                }
                indices.clear();
                for &p in positions.values() {
                    let Some(slot) = usize::try_from(p).ok().and_then(|p| slot_of.get_mut(p))
                    else {
                        return exec_err!(
                            "DenseMergeExec over {store}: a task sent the state of group {p}, \
                             of {groups}"
                        );
                    };
                    if *slot == NO_SLOT {
                        *slot = slots as u32;
                        slots += 1;
                    }
                    indices.push(*slot as usize);
                }
                let mut column = 1;
                for (acc, &n) in accumulators.iter_mut().zip(&state_columns) {
                    acc.merge_batch(&batch.columns()[column..column + n], &indices, slots)?;
                    column += n;
                }
            }
            reserve_once()?;
            let timer = merge_time.timer();
            // The groups sent, in C order: their positions and slots.
            let (mut positions, mut order) = (Vec::with_capacity(slots), Vec::with_capacity(slots));
            for (p, &slot) in slot_of.iter().enumerate() {
                if slot != NO_SLOT {
                    positions.push(p as u64);
                    order.push(slot);
                }
            }
            drop(slot_of);
            let positions = UInt64Array::from(positions);
            let order = UInt32Array::from(order);
            let mut columns = Vec::with_capacity(schema.fields().len());
            for column in reduction.group_columns()? {
                columns.push(take(column.as_ref(), &positions, None)?);
            }
            for acc in &mut accumulators {
                columns.push(take(acc.evaluate(EmitTo::All)?.as_ref(), &order, None)?);
            }
            let batch = RecordBatch::try_new(Arc::clone(&schema), columns)?;
            drop(timer);
            drop(reservation);
            output_rows.add(batch.num_rows());
            Ok(batch)
        };
        Ok(in_batches(Arc::clone(&self.schema), result, batch_size))
    }

    metered_plan_methods!(|exec| {
        let r = &exec.reduction;
        (!r.filters_groups()).then(|| r.num_groups() as u64)
    });
}

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
//!
//! On a cluster of more than a few workers the session would receive and
//! merge `G * T` rows (`G` groups, `T` tasks); the merge is then a tree: a
//! level of it ([`Merged::States`]) runs on the workers, each of its
//! partitions merging the states of the groups whose positions hash to it
//! (from every task, through a network shuffle) into one state per group,
//! led by its position again, and the root ([`Merged::Results`]) in the
//! session merges those, `G` rows, into the results.

use std::fmt;
use std::sync::Arc;

use datafusion::arrow::array::{Array, AsArray, RecordBatch, UInt32Array, UInt64Array};
use datafusion::arrow::compute::take;
use datafusion::arrow::datatypes::{DataType, SchemaRef, UInt64Type};
use datafusion::common::{exec_err, human_readable_size, internal_err, plan_err, HashMap, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::EmitTo;
use datafusion::physical_expr::aggregate::AggregateFunctionExpr;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::{Distribution, EquivalenceProperties, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricBuilder};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, Partitioning,
    PlanProperties,
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

/// What a [`DenseMergeExec`] gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Merged {
    /// The reduction's results, in one partition, in C order of the groups
    /// (the merge's root, in the session).
    Results,
    /// One state per group, led by its position, in each of the partitions
    /// the states were hashed to by position (a level of the merge tree,
    /// on the workers).
    States,
}

/// The position column leading a reduction's positioned states.
fn position_column() -> Arc<dyn PhysicalExpr> {
    Arc::new(Column::new(GROUP_POSITION, 0))
}

/// Merges the partial states of a dense reduction's tasks by group
/// position into its results, or into one state per group (see the module
/// docs).
#[derive(Debug)]
pub struct DenseMergeExec {
    /// What it gives.
    merged: Merged,
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
    /// The reduction's result columns.
    results: SchemaRef,
    /// Its columns: the results, or (a level) the states.
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
        Self::with_output(Merged::Results, states, input, results)
    }

    /// A level of the merge tree: merges the positioned states of `states`
    /// that `input` hashes into partitions by position into one state per
    /// group of each partition (same columns as its input; `results` are
    /// the reduction's result columns, which name its aggregates). Refused as
    /// [`DenseMergeExec::new`] is. A level needs its input hashed by
    /// position (it asks for it) to send each group's state once, but the
    /// root's answer does not depend on it: the root merges whatever
    /// states of a group come.
    pub fn level(
        states: Arc<DenseReductionExec>,
        input: Arc<dyn ExecutionPlan>,
        results: SchemaRef,
    ) -> Result<Self> {
        Self::with_output(Merged::States, states, input, results)
    }

    /// What it gives.
    pub fn merged(&self) -> Merged {
        self.merged
    }

    /// The reduction's result columns (those of the root of the tree).
    pub fn results(&self) -> &SchemaRef {
        &self.results
    }

    fn with_output(
        merged: Merged,
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
        let schema = match merged {
            Merged::Results => Arc::clone(&results),
            Merged::States => input.schema(),
        };
        let properties = match merged {
            Merged::Results => {
                let ordering = reduction.ordering(&results);
                PlanProperties::new(
                    EquivalenceProperties::new_with_orderings(Arc::clone(&results), [ordering]),
                    Partitioning::UnknownPartitioning(1),
                    EmissionType::Final,
                    Boundedness::Bounded,
                )
            }
            Merged::States => PlanProperties::new(
                EquivalenceProperties::new(Arc::clone(&schema)),
                input.output_partitioning().clone(),
                EmissionType::Final,
                Boundedness::Bounded,
            ),
        };
        Ok(Self {
            merged,
            states,
            reduction,
            aggregates,
            state_columns,
            input,
            results,
            schema,
            properties: Arc::new(properties),
            metrics: ExecutionPlanMetricsSet::new(),
        })
    }

    /// The reduction whose states it merges.
    pub fn states(&self) -> &DenseReductionExec {
        &self.states
    }

    /// Memory it holds at its peak. The root: every group's state, each
    /// group's slot among them, the group columns and the results (and the
    /// order they are taken in). A level of the tree, all its partitions
    /// in one task together (as when the level runs in one task): the
    /// states of every group, their positions, slots and hash table, and
    /// the merged states it sends.
    pub fn projected_memory(&self) -> usize {
        let groups = self.reduction.num_groups();
        let state: usize = (self.aggregates.iter())
            .filter_map(|a| a.state_fields().ok())
            .flatten()
            .map(|f| f.data_type().primitive_width().unwrap_or(16))
            .sum();
        match self.merged {
            Merged::Results => {
                let output: usize = (self.schema.fields().iter())
                    .map(|f| f.data_type().primitive_width().unwrap_or(16))
                    .sum();
                // A slot per position (4), the position of each slot (8),
                // the positions and slots taken in C order (12).
                groups
                    .saturating_mul(state + 2 * output + 24)
                    .saturating_add(self.reduction.key_bytes())
            }
            // A hash table entry (position and slot, with its control
            // byte, at 7/8 load) ~20 bytes, the position by slot and the
            // position sent 16.
            Merged::States => groups.saturating_mul(2 * state + 36),
        }
    }
}

impl DisplayAs for DenseMergeExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let aggregates: Vec<String> = self
            .aggregates
            .iter()
            .map(|a| a.name().to_string())
            .collect();
        let gives = match self.merged {
            Merged::Results => "",
            Merged::States => ", gives=states by group position (a level of the merge tree)",
        };
        write!(
            f,
            "DenseMergeExec: store={}, aggr=[{}], groups={}, merges=partial states by group position{gives}, \
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
        match self.merged {
            Merged::Results => vec![Distribution::SinglePartition],
            Merged::States => vec![Distribution::KeyPartitioned(vec![position_column()])],
        }
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
        Ok(Arc::new(match self.merged {
            Merged::Results => {
                Self::new(Arc::clone(&self.states), input, Arc::clone(&self.results))?
            }
            Merged::States => {
                Self::level(Arc::clone(&self.states), input, Arc::clone(&self.results))?
            }
        }))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let partitions = self.properties.output_partitioning().partition_count();
        if partition >= partitions {
            return internal_err!(
                "DenseMergeExec has {partitions} partitions, asked for partition {partition}"
            );
        }
        let merged = self.merged;
        let reduction = Arc::clone(&self.reduction);
        let store = reduction.store().to_string();
        // A level's partitions share the groups.
        let projected = self.projected_memory().div_ceil(partitions);
        let metrics = self.metrics.clone();
        let reserving = Arc::clone(&context);
        let mut accumulators = (self.aggregates.iter())
            .map(|a| a.create_groups_accumulator())
            .collect::<Result<Vec<_>>>()?;
        let state_columns = self.state_columns.clone();
        let schema = Arc::clone(&self.schema);
        let mut input = self.input.execute(partition, Arc::clone(&context))?;
        let batch_size = context.session_config().batch_size().max(1);
        let output_rows = MetricBuilder::new(&self.metrics).output_rows(partition);
        let merge_time = MetricBuilder::new(&self.metrics).subset_time("merge_time", partition);
        let result = async move {
            let groups = reduction.num_groups();
            // Reserved once the states come: a task of the stage below that
            // runs in this process has then let its own memory go.
            let mut reservation = None;
            let mut reserve_once = || -> Result<()> {
                if reservation.is_none() {
                    let r = reserve(
                        "DenseMergeExec",
                        &store,
                        partition,
                        projected,
                        &reserving,
                        &metrics,
                    )?;
                    reservation = Some(r);
                }
                Ok(())
            };
            let mut slots = Slots::new(merged, groups);
            let mut indices: Vec<usize> = Vec::new();
            while let Some(batch) = input.next().await {
                let batch = batch?;
                reserve_once()?;
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
                    let Some(slot) = slots.slot(p) else {
                        return exec_err!(
                            "DenseMergeExec over {store}: a task sent the state of group {p}, \
                             of {groups}"
                        );
                    };
                    indices.push(slot);
                }
                let mut column = 1;
                for (acc, &n) in accumulators.iter_mut().zip(&state_columns) {
                    let values = &batch.columns()[column..column + n];
                    acc.merge_batch(values, &indices, slots.len())?;
                    column += n;
                }
            }
            reserve_once()?;
            let timer = merge_time.timer();
            let mut columns = Vec::with_capacity(schema.fields().len());
            match merged {
                Merged::Results => {
                    // The groups sent, in C order: their positions and slots.
                    let (positions, order) = slots.in_position_order();
                    let positions = UInt64Array::from(positions);
                    let order = UInt32Array::from(order);
                    for column in reduction.group_columns()? {
                        columns.push(take(column.as_ref(), &positions, None)?);
                    }
                    for acc in &mut accumulators {
                        columns.push(take(acc.evaluate(EmitTo::All)?.as_ref(), &order, None)?);
                    }
                }
                Merged::States => {
                    // In slot order: each group's position, then its states.
                    columns.push(Arc::new(UInt64Array::from(slots.positions)) as _);
                    for acc in &mut accumulators {
                        columns.extend(acc.state(EmitTo::All)?);
                    }
                }
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

/// Where each group's state is among the accumulators' slots. DataFusion's
/// accumulators number groups in the order they are first met (each new
/// one in the batch that meets it), so each position gets the next slot
/// when first sent.
struct Slots {
    /// The slot of each position: a dense array of every position (the
    /// root), or a hash table of those sent to a level's partition (which
    /// receives a share of them).
    of: SlotsOf,
    /// The position of each slot.
    positions: Vec<u64>,
    /// The groups' positions are below this.
    groups: usize,
}

enum SlotsOf {
    Dense(Vec<u32>),
    Hashed(HashMap<u64, u32>),
}

impl Slots {
    fn new(merged: Merged, groups: usize) -> Self {
        let of = match merged {
            // Made when the first state comes (a level of the tree keeps
            // no array of every position).
            Merged::Results => SlotsOf::Dense(Vec::new()),
            Merged::States => SlotsOf::Hashed(HashMap::new()),
        };
        Self {
            of,
            positions: Vec::new(),
            groups,
        }
    }

    /// Slots given so far.
    fn len(&self) -> usize {
        self.positions.len()
    }

    /// The slot of position `p` (a new one when first sent); `None` when
    /// `p` is no group's position.
    fn slot(&mut self, p: u64) -> Option<usize> {
        let next = self.positions.len() as u32;
        let index = usize::try_from(p).ok().filter(|&i| i < self.groups)?;
        let slot = match &mut self.of {
            SlotsOf::Dense(of) => {
                if of.is_empty() {
                    *of = vec![NO_SLOT; self.groups];
                }
                let slot = &mut of[index];
                if *slot == NO_SLOT {
                    *slot = next;
                }
                *slot
            }
            SlotsOf::Hashed(of) => *of.entry(p).or_insert(next),
        };
        if slot == next {
            self.positions.push(p);
        }
        Some(slot as usize)
    }

    /// The positions sent, ascending (C order of the groups), with their
    /// slots.
    fn in_position_order(self) -> (Vec<u64>, Vec<u32>) {
        match self.of {
            SlotsOf::Dense(of) => (of.iter().enumerate())
                .filter(|(_, &slot)| slot != NO_SLOT)
                .map(|(p, &slot)| (p as u64, slot))
                .unzip(),
            SlotsOf::Hashed(_) => {
                let mut sent: Vec<(u64, u32)> = (self.positions.iter().enumerate())
                    .map(|(slot, &p)| (p, slot as u32))
                    .collect();
                sent.sort_unstable();
                sent.into_iter().unzip()
            }
        }
    }
}

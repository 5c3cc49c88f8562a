//! A dense reduction on a cluster: partial states per task, merged by
//! group position (or by DataFusion's final aggregate).
//!
//! Each task of the reduction's stage folds its run of the blocks into
//! dense per-group state, as on one machine, and sends that state as rows:
//! the group's position in the group space (or its coordinates), then
//! each aggregate's state in the layout of DataFusion's own aggregate
//! function (`avg`: count and sum; `var`: count, mean and sum of squared
//! deviations, ...; see [`ReduceOp::state_types`]). A [`DenseMergeExec`]
//! adds them up by position (see `merge`); a reduction reading a table
//! joined in, or without `GROUP BY`, is merged by DataFusion's final
//! aggregate instead, after a hash shuffle of the groups (or gathered):
//! what crosses the network is one row per group per task, never the
//! cells.

use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{internal_err, Result, ScalarValue};
use datafusion::functions_aggregate::average::avg_udaf;
use datafusion::functions_aggregate::count::count_udaf;
use datafusion::functions_aggregate::min_max::{max_udaf, min_udaf};
use datafusion::functions_aggregate::stddev::{stddev_pop_udaf, stddev_udaf};
use datafusion::functions_aggregate::sum::sum_udaf;
use datafusion::functions_aggregate::variance::{var_pop_udaf, var_samp_udaf};
use datafusion::logical_expr::AggregateUDF;
use datafusion::physical_expr::aggregate::{AggregateExprBuilder, AggregateFunctionExpr};
use datafusion::physical_expr::expressions::{cast, lit, Column};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode, PhysicalGroupBy};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::empty::EmptyExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::{ExecutionPlan, Partitioning};

use super::accumulators::{numeric_domain, ReduceOp};
use super::exec::DenseReductionExec;
use super::merge::{DenseMergeExec, GROUP_POSITION};

/// DataFusion's aggregate function computing `op`.
fn function(op: ReduceOp) -> Arc<AggregateUDF> {
    match op {
        ReduceOp::Count => count_udaf(),
        ReduceOp::Sum => sum_udaf(),
        ReduceOp::Avg => avg_udaf(),
        ReduceOp::Min => min_udaf(),
        ReduceOp::Max => max_udaf(),
        ReduceOp::Var => var_samp_udaf(),
        ReduceOp::VarPop => var_pop_udaf(),
        ReduceOp::Stddev => stddev_udaf(),
        ReduceOp::StddevPop => stddev_pop_udaf(),
    }
}

impl DenseReductionExec {
    /// DataFusion's partial aggregate computing what this reduction
    /// computes, named as `results` names its columns (its grouping
    /// columns, then its aggregates), over the columns read and the grouped
    /// dimensions; the schema of that input.
    fn partial_aggregate(&self, results: &Schema) -> Result<(AggregateExec, SchemaRef)> {
        let read = self.read();
        let table = &read.table;
        let keys = self.group_keys();
        let n_groups = keys.len();
        let output = results;
        // The aggregates' input: the columns read, then the grouped
        // dimensions (the arguments' column indices stay valid).
        let mut fields: Vec<Field> = (read.columns.iter())
            .map(|&c| table.schema.field(c).clone())
            .collect();
        let mut group_by = Vec::with_capacity(n_groups);
        for (i, key) in keys.iter().enumerate() {
            let name = &table.dims[key.dim].name;
            let index = match fields.iter().position(|f| f.name() == name) {
                Some(index) => index,
                None => {
                    fields.push(table.schema.field(key.dim).clone());
                    fields.len() - 1
                }
            };
            let column: Arc<dyn PhysicalExpr> = Arc::new(Column::new(name, index));
            // A function of the dimension reads its column where it is here.
            let expr = match &key.expr {
                Some(expr) => {
                    Arc::clone(expr)
                        .transform(|e| match e.downcast_ref::<Column>() {
                            Some(_) => Ok(Transformed::yes(Arc::clone(&column))),
                            None => Ok(Transformed::no(e)),
                        })?
                        .data
                }
                None => column,
            };
            group_by.push((expr, output.field(i).name().clone()));
        }
        let input: SchemaRef = Arc::new(Schema::new(fields));

        let mut aggregates = Vec::new();
        for (i, a) in self.aggregates().into_iter().enumerate() {
            let arg = match a.arg {
                Some(arg) => arg,
                // `count(*)`.
                None => lit(ScalarValue::Int64(Some(1))),
            };
            // The rule took off the cast to the fold's domain that type
            // coercion had put on the argument: DataFusion's function gets
            // it back.
            let arg_type = arg.data_type(&input)?;
            let folds_wide = !matches!(a.op, ReduceOp::Count | ReduceOp::Min | ReduceOp::Max);
            let arg = match numeric_domain(&arg_type) {
                Some(domain) if folds_wide && domain != arg_type => cast(arg, &input, domain)?,
                _ => arg,
            };
            let expr = AggregateExprBuilder::new(function(a.op), vec![arg])
                .schema(Arc::clone(&input))
                .alias(output.field(n_groups + i).name())
                .build()?;
            aggregates.push(Arc::new(expr));
        }
        let filters = vec![None; aggregates.len()];
        let partial = AggregateExec::try_new(
            AggregateMode::Partial,
            PhysicalGroupBy::new_single(group_by),
            aggregates,
            filters,
            Arc::new(EmptyExec::new(Arc::clone(&input))),
            Arc::clone(&input),
        )?;
        Ok((partial, input))
    }

    /// DataFusion's functions of the aggregates this reduction computes,
    /// named as `results` names them: those whose state its tasks send.
    pub(super) fn datafusion_aggregates(
        &self,
        results: &Schema,
    ) -> Result<Vec<Arc<AggregateFunctionExpr>>> {
        Ok(self.partial_aggregate(results)?.0.aggr_expr().to_vec())
    }

    /// This reduction as a cluster runs it: the reduction giving the
    /// partial states of each task's blocks, under their merge. Grouped by
    /// dimensions (when the merge fits the memory limit this reduction was
    /// planned under; tables joined in or not), the states are led
    /// by their groups' positions and gathered into a [`DenseMergeExec`],
    /// which gives the rows in the order of one machine's reduction;
    /// otherwise DataFusion's final aggregate merges them (`FinalPartitioned`
    /// over a hash shuffle of the groups into `target_partitions`, gathered
    /// into one partition; `Final` over the gathered states without
    /// `GROUP BY`), and the rows' order is not kept (a sort above it
    /// stays). Same columns, same rows.
    ///
    /// With `tree`, the positioned states are first merged on the workers
    /// (a [`DenseMergeExec`] level over a shuffle of the states by position
    /// into `target_partitions` per task), so that the session receives
    /// and merges one state per group instead of one per group and task;
    /// not when that level would not fit the memory limit.
    pub fn on_cluster(
        &self,
        target_partitions: usize,
        tree: bool,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let read = self.read();
        let table = &read.table;
        let n_groups = self.group_keys().len();
        let output = self.schema();
        let (partial, input) = self.partial_aggregate(&output)?;
        let by_group = (partial.aggr_expr().iter()).all(|a| a.groups_accumulator_supported());
        if n_groups > 0 && by_group {
            let partial_schema = partial.schema();
            let mut fields = vec![Field::new(GROUP_POSITION, DataType::UInt64, false)];
            fields.extend(
                partial_schema.fields()[n_groups..]
                    .iter()
                    .map(|f| f.as_ref().clone()),
            );
            let states = Arc::new(self.with_states(Arc::new(Schema::new(fields)), 1, true)?);
            let fits = |bytes: usize| self.memory_limit().is_none_or(|limit| bytes <= limit);
            let mut merged: Arc<dyn ExecutionPlan> = Arc::clone(&states) as _;
            if tree {
                let position = Arc::new(Column::new(GROUP_POSITION, 0)) as Arc<dyn PhysicalExpr>;
                let hashed = Partitioning::Hash(vec![position], target_partitions.max(1));
                let shuffled = Arc::new(RepartitionExec::try_new(merged, hashed)?);
                let level =
                    DenseMergeExec::level(Arc::clone(&states), shuffled, Arc::clone(&output))?;
                merged = match fits(level.projected_memory()) {
                    true => Arc::new(level),
                    false => Arc::clone(&states) as _,
                };
            }
            let gathered = Arc::new(CoalescePartitionsExec::new(merged));
            let merge = DenseMergeExec::new(states, gathered, Arc::clone(&output))?;
            // The merge runs in the session: within its allowed_mem, or
            // left to the final aggregate, spread over the workers.
            if fits(merge.projected_memory()) {
                return Ok(Arc::new(merge));
            }
        }

        let states: Arc<dyn ExecutionPlan> =
            Arc::new(self.with_states(partial.schema(), 1, false)?);
        let (mode, gathered): (_, Arc<dyn ExecutionPlan>) = if n_groups == 0 {
            (
                AggregateMode::Final,
                Arc::new(CoalescePartitionsExec::new(states)),
            )
        } else {
            let keys: Vec<Arc<dyn PhysicalExpr>> = (0..n_groups)
                .map(|i| {
                    let name = partial.schema().field(i).name().clone();
                    Arc::new(Column::new(&name, i)) as Arc<dyn PhysicalExpr>
                })
                .collect();
            let partitioning = Partitioning::Hash(keys, target_partitions.max(1));
            (
                AggregateMode::FinalPartitioned,
                Arc::new(RepartitionExec::try_new(states, partitioning)?),
            )
        };
        let merged: Arc<dyn ExecutionPlan> = Arc::new(AggregateExec::try_new(
            mode,
            partial.group_expr().as_final(),
            partial.aggr_expr().to_vec(),
            partial.filter_expr().to_vec(),
            gathered,
            input,
        )?);
        let merged = match n_groups {
            0 => merged,
            _ => Arc::new(CoalescePartitionsExec::new(merged)),
        };
        let same = |a: &Schema, b: &Schema| {
            let shape = |s: &Schema| -> Vec<(String, DataType)> {
                let fields = s.fields().iter();
                fields
                    .map(|f| (f.name().clone(), f.data_type().clone()))
                    .collect()
            };
            shape(a) == shape(b)
        };
        if !same(&merged.schema(), &output) {
            return internal_err!(
                "a dense reduction over {} on a cluster gives {:?}, not {:?}",
                table.store,
                merged.schema(),
                output
            );
        }
        Ok(merged)
    }
}

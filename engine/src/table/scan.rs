//! `ZarrScanExec`: reads chunk-aligned blocks of a Zarr table as record batches.
//!
//! Each partition owns a contiguous run of blocks. A blocking task decodes
//! one block at a time (only the projected arrays, only the selected boxes)
//! and streams record batches of the session's batch size through a small
//! bounded channel, so decoding overlaps with the consumer and memory stays
//! at about two blocks per partition (batches are slices of their block, so
//! the block the channel still holds stays alive while the next one is
//! decoded), plus, over an object store, the chunks its read-ahead window
//! holds ([`ReadAheadPlan`]: reads in flight ahead of the decoder, in the
//! order the partition reads its blocks): that is the scan's projected
//! memory, and a scan whose projected memory exceeds the session's memory
//! limit is refused while planning. Dimension columns are generated from
//! the coordinates, never stored per cell.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use datafusion::common::{human_readable_size, DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::EquivalenceProperties;
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::metrics::{Count, ExecutionPlanMetricsSet, MetricBuilder, Time};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties,
};

use super::batch_runs::{BatchRuns, RunStreamBuilder, RUNS_IN_FLIGHT, RUN_BATCHES};
use super::block_read::BlockRead;
use super::blocks::{boxes_in_block, share_of, shown_tasks, task_index, TASKS_OF_STAGE};
use super::broadcast::BroadcastInputs;
use super::cells::BoxCells;
use super::read_ahead::{ReadAheadPlan, TableReadAhead};
use crate::memory::{Projection, Reservation};
use crate::plan_methods::{
    broadcast_children_methods, metered_plan_methods, no_expressions_method,
};
use crate::progress::ScanProgress;
use crate::zarr::ChunkBufferPool;
use datafusion::execution::memory_pool::MemoryReservation;

/// The smallest batch [`ZarrScanExec::fit_batches`] shrinks batches to.
pub const MIN_BATCH_ROWS: usize = 64;

/// The physical scan of a Zarr table.
#[derive(Debug)]
pub struct ZarrScanExec {
    /// What it reads: its columns (the projection), cells and blocks.
    read: Arc<BlockRead>,
    limit: Option<usize>,
    /// Rows per batch, as planned.
    batch_size: usize,
    /// Batches sent to the stream at once ([`RUN_BATCHES`], or one where
    /// memory is short: see [`Self::fit_batches`]).
    run_batches: usize,
    /// Each partition's reads ahead of its decoder (remote stores).
    read_ahead: ReadAheadPlan,
    /// Chunk reads the scan may keep in flight (`zarrfusion.io_concurrency`).
    io_concurrency: usize,
    /// The tasks of a cluster's stage the blocks are dealt to (1: one
    /// process reads them all; see [`Self::with_tasks`];
    /// [`TASKS_OF_STAGE`]: as many as its stage runs).
    tasks: usize,
    /// The small sides of the broadcast columns read: the scan's children.
    broadcasts: BroadcastInputs,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl ZarrScanExec {
    /// A scan of `read` (its columns are the projection) in `partitions`
    /// partitions, in batches of `batch_size` rows, keeping up to
    /// `io_concurrency` reads in flight (shared among the partitions) when
    /// the store is remote.
    pub fn new(
        read: BlockRead,
        partitions: usize,
        limit: Option<usize>,
        batch_size: usize,
        io_concurrency: usize,
    ) -> Self {
        let read_ahead = ReadAheadPlan::new(
            &read.table,
            &read.columns,
            io_concurrency,
            read.blocks.block_shape(),
            1,
        )
        .split(partitions.max(1));
        let properties = Arc::new(PlanProperties::new(
            EquivalenceProperties::new(Arc::clone(&read.schema)),
            Partitioning::UnknownPartitioning(partitions.max(1)),
            EmissionType::Incremental,
            Boundedness::Bounded,
        ));
        Self {
            read: Arc::new(read),
            limit,
            batch_size: batch_size.max(1),
            run_batches: RUN_BATCHES,
            read_ahead,
            io_concurrency,
            tasks: 1,
            broadcasts: BroadcastInputs::default(),
            properties,
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }

    /// This scan reading the broadcast columns of `broadcasts` (their
    /// small sides planned).
    pub fn with_broadcasts(mut self, broadcasts: BroadcastInputs) -> Self {
        self.broadcasts = broadcasts;
        self
    }

    /// This scan with its blocks dealt to `tasks` tasks of a cluster's
    /// stage in contiguous runs: each task (its index from the task's
    /// `DistributedTaskContext`) reads its own run, split among its
    /// partitions.
    pub fn with_tasks(&self, tasks: usize) -> Self {
        self.dealt(tasks.max(1))
    }

    /// This scan with its blocks dealt to the tasks of the cluster's
    /// stage it runs in, however many the distributed planner gives it
    /// (a scan with a table joined in is not its stage's leaf: the planner
    /// counts its tasks without telling it).
    pub fn with_tasks_of_stage(&self) -> Self {
        self.dealt(TASKS_OF_STAGE)
    }

    fn dealt(&self, tasks: usize) -> Self {
        Self {
            read: Arc::clone(&self.read),
            limit: self.limit,
            batch_size: self.batch_size,
            run_batches: self.run_batches,
            read_ahead: self.read_ahead,
            io_concurrency: self.io_concurrency,
            tasks,
            broadcasts: self.broadcasts.clone(),
            properties: Arc::clone(&self.properties),
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }

    /// A copy of this scan joining `broadcasts` in (its children
    /// replaced).
    fn rejoined(&self, broadcasts: BroadcastInputs) -> Self {
        let mut scan = self.dealt(self.tasks);
        scan.broadcasts = broadcasts;
        scan
    }

    /// The tasks the blocks are dealt to.
    pub fn tasks(&self) -> usize {
        self.tasks
    }

    /// What it reads: the table, its columns (the projection), cells and
    /// blocks.
    pub fn read(&self) -> &BlockRead {
        &self.read
    }

    /// The most rows produced.
    pub fn limit(&self) -> Option<usize> {
        self.limit
    }

    /// Rows per batch.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Chunk reads kept in flight, as planned.
    pub fn io_concurrency(&self) -> usize {
        self.io_concurrency
    }

    /// Decoded bytes of every block's projected variables (what a cluster
    /// sizes the scan's tasks by).
    pub fn decoded_bytes(&self) -> u64 {
        let r = &self.read;
        let per_cell = r.table.decoded_cell_bytes(&r.columns);
        r.selection.num_cells().saturating_mul(per_cell.max(1))
    }

    /// Memory one partition holds at its peak: two decoded blocks of the
    /// projected variables (stored and decoded bytes), the dimension
    /// columns of the batches in flight (the channel's two and the one being
    /// built; variables in a batch are slices of its block) and the chunks
    /// read ahead.
    pub fn per_partition_memory(&self) -> usize {
        self.block_memory()
            .saturating_add(
                self.run_rows()
                    .saturating_mul(RUNS_IN_FLIGHT)
                    .saturating_mul(self.dimension_row_bytes()),
            )
            .saturating_add(self.read_ahead.memory())
    }

    /// Cells of one block (the largest, at the grid's origin).
    fn block_cells(&self) -> usize {
        usize::try_from(self.read.block_cells()).unwrap_or(usize::MAX)
    }

    /// Rows of the largest run of batches sent at once: a run never
    /// spans two blocks.
    fn run_rows(&self) -> usize {
        (self.batch_size.saturating_mul(self.run_batches)).min(self.block_cells())
    }

    /// Two decoded blocks of the projected variables.
    fn block_memory(&self) -> usize {
        let r = &self.read;
        let block_bytes: usize = (r.columns.iter())
            .map(|&i| r.table.peak_cell_bytes(i))
            .fold(0usize, usize::saturating_add)
            .saturating_mul(self.block_cells());
        block_bytes.saturating_mul(2)
    }

    /// Bytes per row of the projected dimension columns.
    fn dimension_row_bytes(&self) -> usize {
        let r = &self.read;
        let n_dims = r.table.dims.len();
        (r.columns.iter())
            .filter(|&&i| i < n_dims)
            .map(|&i| {
                let field = r.table.schema.field(i);
                field.data_type().primitive_width().unwrap_or(16)
            })
            .sum()
    }

    /// Sends batches one at a time, and then lowers the batch size (to
    /// `MIN_BATCH_ROWS` at least), so that the batches in flight fit what
    /// `limit` leaves beside the blocks.
    pub fn fit_batches(mut self, limit: usize) -> Self {
        let partitions = self.properties.partitioning.partition_count();
        let share = limit / partitions.max(1);
        if self.per_partition_memory() > share {
            self.run_batches = 1;
        }
        let row_bytes = RUNS_IN_FLIGHT * self.dimension_row_bytes();
        if row_bytes > 0 && self.per_partition_memory() > share {
            let room = share.saturating_sub(self.block_memory()) / row_bytes;
            // Never above the session's batch size (which may be under
            // `MIN_BATCH_ROWS`).
            self.batch_size = room.max(MIN_BATCH_ROWS).min(self.batch_size);
        }
        self
    }

    /// Lowers the reads ahead of each partition's decoder so that the
    /// chunks they hold fit what `limit` leaves beside the blocks and
    /// batches (none when nothing is left).
    pub fn fit_read_ahead(mut self, limit: usize) -> Self {
        let partitions = self.properties.partitioning.partition_count();
        let share = limit / partitions.max(1);
        let room = share.saturating_sub(self.per_partition_memory() - self.read_ahead.memory());
        self.read_ahead = self.read_ahead.within(room);
        self
    }

    /// Memory the whole scan is projected to hold at its peak: its
    /// partitions' and the broadcasts' (held once for all).
    pub fn projected_memory(&self) -> usize {
        self.projection().total()
    }

    /// Its projected memory in parts: each partition's two blocks, batches
    /// and reads ahead, and the tables joined in.
    pub fn projection(&self) -> Projection {
        let read_ahead = match self.read_ahead.depth() {
            0 => String::new(),
            n => format!(", and {n} chunks read ahead"),
        };
        Projection::new(
            "ZarrScanExec",
            &self.read.table.store,
            self.properties.partitioning.partition_count(),
            "partition",
            self.per_partition_memory(),
        )
        .holding(format!(
            "two blocks of shape {:?} and the batches in flight{read_ahead}",
            self.read.blocks.block_shape()
        ))
        .and(self.broadcasts.memory(), "tables joined in")
        .advice(
            "raise it, read fewer columns, or rechunk the store to smaller chunks (a block is at \
             least one chunk)",
        )
    }

    /// Refuses the scan when its projected memory exceeds `limit`.
    pub fn check_memory(&self, limit: usize) -> Result<()> {
        self.projection().check(limit)
    }

    /// Rows the scan produces.
    fn num_rows(&self) -> u64 {
        let cells = self.read.selection.num_cells();
        match self.limit {
            Some(limit) => cells.min(limit as u64),
            None => cells,
        }
    }

    /// The blocks partition `partition` of task `task` of `tasks` reads.
    fn partition_blocks(&self, (task, tasks): (usize, usize), partition: usize) -> Range<u64> {
        let total = self.read.blocks.num_blocks();
        let run = share_of(0..total, task as u64, tasks as u64);
        let n = self.properties.partitioning.partition_count() as u64;
        share_of(run, partition as u64, n)
    }
}

impl DisplayAs for ZarrScanExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let r = &self.read;
        let columns: Vec<&str> = (r.schema.fields().iter())
            .map(|f| f.name().as_str())
            .collect();
        write!(
            f,
            "ZarrScanExec: store={}, dims=[{}], projection=[{}], rows={}, blocks={} of shape {:?}, \
             projected_memory={}{}",
            r.table.store,
            r.table.dims_name().replace('_', ", "),
            columns.join(", "),
            r.selection.num_cells(),
            r.blocks.num_blocks(),
            r.blocks.block_shape(),
            human_readable_size(self.projected_memory()),
            self.read_ahead,
        )?;
        write!(f, "{}", self.broadcasts.display(&r.table.dim_names()))?;
        if let Some(limit) = self.limit {
            write!(f, ", limit={limit}")?;
        }
        write!(f, "{}", shown_tasks(self.tasks))
    }
}

impl ExecutionPlan for ZarrScanExec {
    broadcast_children_methods!("ZarrScanExec");

    no_expressions_method!();

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let store = &self.read.table.store;
        let task = task_index("ZarrScanExec", store, self.tasks, &context)?;
        let blocks = self.partition_blocks(task, partition);
        let progress = context.session_config().get_extension::<ScanProgress>();
        if let Some(progress) = &progress {
            progress.add_planned(blocks.end - blocks.start);
        }
        let reader = BlockReader {
            read: Arc::clone(&self.read),
            batch_size: self.batch_size,
            buffers: ChunkBufferPool::new(),
        };
        // The partition's projected memory, held in the pool while it runs.
        let reservation = Reservation::new(
            "ZarrScanExec",
            &self.read.table.store,
            partition,
            self.per_partition_memory(),
            &context,
            &self.metrics,
        );
        let taken = reservation.unless(!self.broadcasts.is_empty())?;
        let mut remaining = self.limit.map(|l| l as u64);
        let blocks_read = MetricBuilder::new(&self.metrics).counter("blocks_read", partition);
        let output_rows = MetricBuilder::new(&self.metrics).output_rows(partition);
        let decode_time = MetricBuilder::new(&self.metrics).subset_time("decode_time", partition);
        let bytes_decoded = MetricBuilder::new(&self.metrics).counter("bytes_decoded", partition);
        // Reads ahead (of a remote store) once the partition's memory is
        // taken: after the tables joined in are computed, if any.
        let start_read_ahead = {
            let (read, plan, blocks) = (Arc::clone(&self.read), self.read_ahead, blocks.clone());
            move || {
                let boxes = Arc::clone(&read);
                plan.start(&read.table, &read.columns, blocks, 1, move |id| {
                    boxes_in_block(&boxes.selection, &boxes.blocks.block(id))
                })
            }
        };
        let mut builder = RunStreamBuilder::new(Arc::clone(&self.read.schema));
        let mut runs = builder.runs(self.run_batches);
        let broadcasts = self.broadcasts.clone();
        let partitions = self.properties.partitioning.partition_count();
        let read = move |reservation: MemoryReservation, read_ahead: Option<TableReadAhead>| {
            let _reservation = reservation;
            for id in blocks {
                if remaining == Some(0) {
                    break;
                }
                let extent = reader.read.blocks.block(id);
                for b in boxes_in_block(&reader.read.selection, &extent) {
                    let meters = ScanMeters {
                        output_rows: &output_rows,
                        decode_time: &decode_time,
                        bytes_decoded: &bytes_decoded,
                    };
                    let sent = reader.read_box(&b, &mut remaining, &mut runs, &meters);
                    if !sent? {
                        return Ok(());
                    }
                }
                if let Some(read_ahead) = &read_ahead {
                    read_ahead.done_with(id);
                }
                blocks_read.add(1);
                if let Some(progress) = &progress {
                    progress.add_done(1);
                }
            }
            Ok(())
        };
        if broadcasts.is_empty() {
            let taken = reservation.after(taken)?;
            let read_ahead = start_read_ahead();
            builder.spawn_blocking(move || read(taken, read_ahead));
        } else {
            // The tables joined in are computed first, and held while the
            // blocks are read (the partition's memory taken once they are).
            builder.spawn(async move {
                let _held = broadcasts.hold(&context, partitions).await?;
                let taken = reservation.after(taken)?;
                let read_ahead = start_read_ahead();
                tokio::task::spawn_blocking(move || read(taken, read_ahead))
                    .await
                    .map_err(|e| DataFusionError::ExecutionJoin(Box::new(e)))?
            });
        }
        Ok(builder.build())
    }

    metered_plan_methods!(|scan| Some(scan.num_rows()));
}

/// The metrics a partition's reader reports to.
struct ScanMeters<'a> {
    output_rows: &'a Count,
    decode_time: &'a Time,
    bytes_decoded: &'a Count,
}

/// Reads boxes of one table and turns them into record batches.
struct BlockReader {
    read: Arc<BlockRead>,
    batch_size: usize,
    /// Buffers the partition's chunks are read into, reused once the
    /// batches made from them are dropped.
    buffers: ChunkBufferPool,
}

impl BlockReader {
    /// Reads one box and sends its batches. Returns `Ok(false)` when the
    /// receiver is gone (the query was cancelled or has enough rows).
    fn read_box(
        &self,
        b: &[Range<u64>],
        remaining: &mut Option<u64>,
        runs: &mut BatchRuns,
        meters: &ScanMeters<'_>,
    ) -> Result<bool> {
        let timer = meters.decode_time.timer();
        let r = &self.read;
        let cells = BoxCells::read(&r.table, &r.columns, b, &self.buffers)?;
        timer.done();
        meters.bytes_decoded.add(cells.decoded_bytes() as usize);
        let output_rows = meters.output_rows;
        let mut n = cells.num_cells();
        if let Some(left) = remaining {
            n = n.min(*left);
        }
        let mut start = 0u64;
        while start < n {
            let len = (self.batch_size as u64).min(n - start);
            let batch = cells.batch(&r.schema, start, len)?;
            output_rows.add(len as usize);
            if !runs.push(batch) {
                return Ok(false);
            }
            start += len;
        }
        if let Some(left) = remaining {
            *left -= n;
        }
        // A run never holds two boxes' batches.
        Ok(runs.flush())
    }
}

//! The physical side of `COPY ... STORED AS ZARR` for results that are
//! not arrays as they are (aggregates, joins, any query): a DataFusion
//! [`DataSink`] that collects the result inside the memory budget, lays it
//! out as a grid and writes the store atomically through its
//! [`CopyTarget`] (a local path, or an object-store prefix: chunks first,
//! metadata last, erased on failure), as the array COPYs do.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::{human_readable_size, DataFusionError, Result};
use datafusion::datasource::sink::DataSink;
use datafusion::execution::memory_pool::MemoryConsumer;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::{DisplayAs, DisplayFormatType};
use futures::StreamExt;

use super::grid::{assemble, grid_bytes};
use super::rows::Streamed;
use super::store::{chunk_shape, grid_arrays, prepare_group, store_grid};
use super::target::CopyTarget;

/// Writes a query result to a new Zarr store.
#[derive(Debug, Clone)]
pub struct ZarrSink {
    schema: SchemaRef,
    target: CopyTarget,
    dims: Vec<usize>,
    descending: Vec<bool>,
    /// When the rows are a grid's cells in its order: how they are written
    /// as they come (see [`super::rows`]).
    streamed: Option<Streamed>,
}

impl ZarrSink {
    /// A sink writing rows of `schema` to `target`, with the columns `dims`
    /// as dimensions (coordinates descending where `descending` says so),
    /// with the target's write options.
    pub fn new(
        schema: SchemaRef,
        target: CopyTarget,
        dims: Vec<usize>,
        descending: Vec<bool>,
    ) -> Self {
        Self {
            schema,
            target,
            dims,
            descending,
            streamed: None,
        }
    }

    /// The sink writing the rows as they come, as `streamed` says.
    pub(crate) fn streaming(self, streamed: Option<Streamed>) -> Self {
        Self { streamed, ..self }
    }

    /// This sink writing the rows in bands of `keys` positions (see
    /// [`Streamed::in_bands_of`]); `None` where it writes no bands that
    /// large.
    pub(crate) fn in_bands_of(&self, keys: u64) -> Option<Self> {
        let streamed = self.streamed.as_ref()?.in_bands_of(keys)?;
        Some(Self {
            streamed: Some(streamed),
            ..self.clone()
        })
    }

    /// Writes the rows `data` brings as they come (see [`super::rows`]),
    /// within the memory `streamed` projects.
    async fn write_streamed(
        &self,
        streamed: &Streamed,
        mut data: SendableRecordBatchStream,
        context: &Arc<TaskContext>,
    ) -> Result<u64> {
        let reservation = MemoryConsumer::new("ZarrSink").register(context.memory_pool());
        let memory = usize::try_from(streamed.memory()).unwrap_or(usize::MAX);
        reservation.try_grow(memory).map_err(|e| {
            DataFusionError::ResourcesExhausted(format!(
                "COPY TO Zarr ('{}'): writing the rows as they come holds {}, which does not fit in allowed_mem: {e}",
                self.target.location,
                human_readable_size(memory)
            ))
        })?;
        let cancelled = Arc::new(AtomicBool::new(false));
        let mut guard = CancelOnDrop(Arc::clone(&cancelled), false);
        // Two slabs of rows in flight: the query goes on (folding its next
        // band) while the writer encodes, and runs ahead of it by no more.
        let batch_size = context.session_config().batch_size();
        let (send, receive) = tokio::sync::mpsc::channel(streamed.batches_in_flight(batch_size));
        let writer = {
            let (schema, target) = (Arc::clone(&self.schema), self.target.clone());
            let (runtime, cancelled) = (context.runtime_env(), Arc::clone(&cancelled));
            let streamed = streamed.clone();
            tokio::task::spawn_blocking(move || {
                streamed.write(&schema, &target, &runtime, &cancelled, receive)
            })
        };
        let mut rows = 0u64;
        let mut failed = None;
        while let Some(batch) = data.next().await {
            match batch {
                Ok(batch) => {
                    rows += batch.num_rows() as u64;
                    // The writer stopped: its error says why.
                    if send.send(batch).await.is_err() {
                        break;
                    }
                }
                Err(e) => {
                    // The writer must not take the rows so far for the result.
                    cancelled.store(true, Ordering::Relaxed);
                    failed = Some(e);
                    break;
                }
            }
        }
        drop(send);
        let written = writer
            .await
            .map_err(|e| DataFusionError::Execution(format!("the Zarr writer stopped: {e}")));
        if let Some(e) = failed {
            return Err(e);
        }
        let written = written??;
        guard.1 = true;
        drop(reservation);
        log::info!(
            "wrote {} cells ({} bytes uncompressed) to {} as they came",
            written.cells,
            written.bytes,
            self.target.location
        );
        Ok(rows)
    }
}

impl DisplayAs for ZarrSink {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let dims: Vec<&str> = self
            .dims
            .iter()
            .map(|&d| self.schema.field(d).name().as_str())
            .collect();
        write!(
            f,
            "ZarrSink: target={}, dims=[{}], zarr_format={:?}, codec={:?}",
            self.target.location,
            dims.join(", "),
            self.target.options.zarr_format,
            self.target.options.codec
        )?;
        match &self.streamed {
            Some(streamed) => write!(f, ", {}", streamed.describe()),
            None => Ok(()),
        }
    }
}

/// Sets the flag when dropped: a cancelled query drops the writing future,
/// and the blocking writer sees the flag and leaves nothing behind.
pub(crate) struct CancelOnDrop(pub(crate) Arc<AtomicBool>, pub(crate) bool);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if !self.1 {
            self.0.store(true, Ordering::Relaxed);
        }
    }
}

#[async_trait]
impl DataSink for ZarrSink {
    fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    async fn write_all(
        &self,
        mut data: SendableRecordBatchStream,
        context: &Arc<TaskContext>,
    ) -> Result<u64> {
        if let Some(streamed) = &self.streamed {
            return self.write_streamed(streamed, data, context).await;
        }
        let budget = |e: DataFusionError, what: &str| {
            DataFusionError::ResourcesExhausted(format!(
                "COPY TO Zarr ('{}') holds the whole result in memory before writing it, and {what} does not fit in allowed_mem: {e}. Write a smaller selection (WHERE on dimensions) or raise allowed_mem",
                self.target.location
            ))
        };
        let reservation = MemoryConsumer::new("ZarrSink").register(context.memory_pool());
        let mut batches = Vec::new();
        let mut rows = 0u64;
        while let Some(batch) = data.next().await {
            let batch = batch?;
            reservation
                .try_grow(batch.get_array_memory_size())
                .map_err(|e| budget(e, "the result"))?;
            rows += batch.num_rows() as u64;
            batches.push(batch);
        }
        // The dense arrays are at most the rows times the widths when the
        // grid is complete; a sparse grid is checked again once its shape is known.
        let grid_estimate = grid_bytes(&self.schema, &self.dims, rows);
        reservation
            .try_grow(grid_estimate as usize)
            .map_err(|e| budget(e, "the grid"))?;
        let schema = Arc::clone(&self.schema);
        let dims = self.dims.clone();
        let descending = self.descending.clone();
        let target = self.target.clone();
        let runtime = context.runtime_env();
        let cancelled = Arc::new(AtomicBool::new(false));
        let mut guard = CancelOnDrop(Arc::clone(&cancelled), false);
        let pool_check = Arc::clone(context.memory_pool());
        let written = tokio::task::spawn_blocking(move || {
            let grid = assemble(&schema, &batches, &dims, &descending)?;
            let cells: u64 = grid.shape().iter().product();
            // A sparse grid holds more cells than rows: reserve the difference.
            let _sparse = if cells > rows {
                let extra = grid_bytes(&schema, &dims, cells - rows) as usize;
                let more = MemoryConsumer::new("ZarrSink grid").register(&pool_check);
                more.try_grow(extra).map_err(|e| {
                    DataFusionError::ResourcesExhausted(format!(
                        "COPY TO Zarr: the result covers {rows} of {cells} grid cells and the dense grid does not fit in allowed_mem: {e}"
                    ))
                })?;
                Some(more)
            } else {
                None
            };
            drop(batches);
            let chunks = chunk_shape(&grid, &target.options)?;
            let (coordinates, variables) = grid_arrays(&grid, &chunks);
            target.write_group(
                &runtime,
                &cancelled,
                |storage| prepare_group(storage, &coordinates, &variables, &target.options),
                |group| store_grid(&grid, group, &chunks, &cancelled),
            )
        })
        .await
        .map_err(|e| DataFusionError::Execution(format!("the Zarr writer stopped: {e}")))??;
        guard.1 = true;
        drop(reservation);
        log::info!(
            "wrote {} cells ({} bytes uncompressed) to {}",
            written.cells,
            written.bytes,
            self.target.location
        );
        Ok(rows)
    }
}

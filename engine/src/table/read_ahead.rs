//! Reading ahead of the decoders on remote stores.
//!
//! An operator over a table in an object store plans how far it reads
//! ahead of its decoders ([`ReadAheadPlan`]): every chunk of the blocks its
//! workers are decoding, plus as many again as the session's
//! `zarrfusion.io_concurrency` (shared among the operator's partitions),
//! with at most that many reads in flight at once, and no more than its
//! memory leaves room for (each read holds up to a chunk until it is
//! decoded). Decoders take a block's chunks in any order (zarrs splits a
//! block among threads), so a block's reads are all sent before it is
//! decoded. When it runs, it hands the
//! chunk keys of its blocks, in the order it reads them, to a
//! [`ReadAhead`] window of that depth (one per store, sharing the depth,
//! when the table's variables come from several: an aligned join). Local
//! stores do not read ahead.

use std::ops::Range;
use std::sync::Arc;

use datafusion::common::human_readable_size;

use super::dataset::GridTable;
use zarrs::storage::StoreKey;

use crate::zarr::{RangedReads, ReadAhead, RemoteStorage, ZarrArray};

/// How far an operator reads ahead of its decoders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadAheadPlan {
    /// Chunks held: requested and not yet decoded.
    depth: usize,
    /// Reads in flight at once.
    concurrency: usize,
    chunk_bytes: usize,
    /// Whether the readers decode blocks of chunks at once (a key read by
    /// ranges stays held until its block is done) or chunks one after
    /// another (it is taken).
    ranges: RangedReads,
}

impl ReadAheadPlan {
    /// Reading ahead when a variable among `columns` (indices into the
    /// table's schema) is in an object store, nothing otherwise: the chunks
    /// of `readers` blocks of shape `block` and `concurrency` more, at most
    /// `concurrency` in flight (0: no reading ahead).
    pub fn new(
        table: &GridTable,
        columns: &[usize],
        concurrency: usize,
        block: &[u64],
        readers: usize,
    ) -> Self {
        let remote = remote_variables(table, columns);
        if remote.is_empty() {
            return Self::for_chunks(0, 0, readers, 0);
        }
        let chunk_bytes = remote.iter().map(|v| v.chunk_bytes()).max().unwrap_or(0);
        let block_chunks: usize = remote
            .iter()
            .map(|v| {
                v.chunk_shape()
                    .iter()
                    .zip(block)
                    .map(|(&c, &b)| b.div_ceil(c.max(1)) as usize)
                    .fold(1usize, usize::saturating_mul)
            })
            .fold(0usize, usize::saturating_add);
        Self::for_chunks(chunk_bytes, block_chunks, readers, concurrency)
    }

    /// Reading ahead of `readers` workers that each decode `block_chunks`
    /// chunks of up to `chunk_bytes` at once (0 for workers that decode
    /// their chunks one after another, in the order they were requested):
    /// those chunks and `concurrency` more, at most `concurrency` in flight
    /// (0: no reading ahead).
    pub fn for_chunks(
        chunk_bytes: usize,
        block_chunks: usize,
        readers: usize,
        concurrency: usize,
    ) -> Self {
        let concurrency = concurrency.min(crate::zarr::MAX_IO_CONCURRENCY);
        let depth = match concurrency {
            0 => 0,
            _ => block_chunks
                .saturating_mul(readers.max(1))
                .saturating_add(concurrency),
        };
        let ranges = match block_chunks {
            0 => RangedReads::Take,
            _ => RangedReads::Keep,
        };
        Self {
            depth,
            concurrency,
            chunk_bytes,
            ranges,
        }
    }

    /// The reads kept in flight ahead of the decoders.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// This plan's reads in flight split among `parts` readers (each with
    /// its own window; the chunks of each one's block stay its own).
    pub fn split(self, parts: usize) -> Self {
        let parts = parts.max(1);
        let share = self.concurrency.div_ceil(parts);
        Self {
            depth: self.depth.saturating_sub(self.concurrency - share),
            concurrency: share,
            ..self
        }
    }

    /// This plan for chunks of `chunk_bytes` each, in the memory this one
    /// holds (the reads of another array with this plan's budget).
    pub fn for_chunk_bytes(self, chunk_bytes: usize) -> Self {
        let room = self.memory();
        Self {
            chunk_bytes,
            ..self
        }
        .within(room)
    }

    /// Memory the read-ahead holds at its peak: a chunk per read.
    pub fn memory(&self) -> usize {
        self.depth.saturating_mul(self.chunk_bytes)
    }

    /// This plan with no more chunks held than `room` bytes hold.
    pub fn within(self, room: usize) -> Self {
        let fit = room.checked_div(self.chunk_bytes).unwrap_or(self.depth);
        let depth = self.depth.min(fit);
        Self {
            depth,
            concurrency: self.concurrency.min(depth),
            ..self
        }
    }

    /// Opens the windows over the chunk keys that reading `columns` of
    /// `table` block by block fetches: `blocks` in the order they are read
    /// by `readers` workers (each taking the next block: the keys of the
    /// `readers` blocks read at once are interleaved), `boxes` giving each
    /// block's boxes. `None` without read-ahead. The readers say when they
    /// are done with a block ([`TableReadAhead::done_with`], the block's
    /// number).
    pub fn start<I, B>(
        &self,
        table: &GridTable,
        columns: &[usize],
        blocks: I,
        readers: usize,
        boxes: B,
    ) -> Option<TableReadAhead>
    where
        I: Iterator<Item = u64> + Clone + Send + 'static,
        B: Fn(u64) -> Vec<Vec<Range<u64>>> + Clone + Send + 'static,
    {
        let mut stores: Vec<(Arc<RemoteStorage>, Vec<Arc<ZarrArray>>)> = Vec::new();
        for variable in remote_variables(table, columns) {
            let Some(storage) = variable.remote() else {
                continue;
            };
            match stores.iter_mut().find(|(s, _)| Arc::ptr_eq(s, storage)) {
                Some((_, variables)) => variables.push(variable),
                None => stores.push((Arc::clone(storage), vec![variable])),
            }
        }
        let share = Self {
            depth: self.depth / stores.len().max(1),
            concurrency: (self.concurrency / stores.len().max(1)).max(1),
            ..*self
        };
        let windows: Vec<ReadAhead> = stores
            .into_iter()
            .filter_map(|(storage, variables)| {
                let boxes = boxes.clone();
                share.start_keys(storage, blocks.clone(), readers, move |id| {
                    let mut keys = Vec::new();
                    for b in boxes(id) {
                        for variable in &variables {
                            keys.extend(variable.chunk_keys(&b));
                        }
                    }
                    keys
                })
            })
            .collect();
        if windows.is_empty() {
            return None;
        }
        Some(TableReadAhead { windows })
    }

    /// Opens a window over `storage` for keys read block by block:
    /// `blocks` in the order `readers` workers take them (each taking the
    /// next; the keys of the blocks read at once are interleaved),
    /// `block_keys` giving each block's keys in the order it reads them.
    /// `None` without read-ahead. The readers say when they are done with
    /// a block ([`ReadAhead::done_with`], the block's number).
    pub fn start_keys<I, K>(
        &self,
        storage: Arc<RemoteStorage>,
        blocks: I,
        readers: usize,
        block_keys: K,
    ) -> Option<ReadAhead>
    where
        I: Iterator<Item = u64> + Send + 'static,
        K: Fn(u64) -> Vec<StoreKey> + Send + 'static,
    {
        self.start_numbered(storage, blocks, readers, move |id| {
            block_keys(id).into_iter().map(|k| (id, k)).collect()
        })
    }

    /// As [`start_keys`](Self::start_keys), for readers done with the keys
    /// of a block part by part: `block_keys` gives each key of a block
    /// with the number of its part (numbers counting up from 0 across the
    /// blocks, each of which the readers say they are done with once).
    pub fn start_numbered<I, K>(
        &self,
        storage: Arc<RemoteStorage>,
        blocks: I,
        readers: usize,
        block_keys: K,
    ) -> Option<ReadAhead>
    where
        I: Iterator<Item = u64> + Send + 'static,
        K: Fn(u64) -> Vec<(u64, StoreKey)> + Send + 'static,
    {
        if self.depth == 0 {
            return None;
        }
        let mut blocks = blocks;
        let readers = readers.max(1);
        let keys = std::iter::from_fn(move || {
            let group: Vec<Vec<(u64, StoreKey)>> =
                blocks.by_ref().take(readers).map(&block_keys).collect();
            (!group.is_empty()).then(|| interleave(group))
        })
        .flatten();
        Some(ReadAhead::new(
            storage,
            Box::new(keys),
            self.depth,
            self.concurrency,
            self.ranges,
        ))
    }
}

/// The read-ahead windows of one reader of a table, one per store.
pub struct TableReadAhead {
    windows: Vec<ReadAhead>,
}

impl From<ReadAhead> for TableReadAhead {
    /// The reads ahead of one window.
    fn from(window: ReadAhead) -> Self {
        Self {
            windows: vec![window],
        }
    }
}

impl TableReadAhead {
    /// The windows of several tables read block by block together (the
    /// sources of a window loader): one reader, one block numbering.
    pub fn merge(parts: Vec<TableReadAhead>) -> Self {
        Self {
            windows: parts.into_iter().flat_map(|p| p.windows).collect(),
        }
    }

    /// Says the reader is done with block `number` (see
    /// [`ReadAhead::done_with`]).
    pub fn done_with(&self, number: u64) {
        for window in &self.windows {
            window.done_with(number);
        }
    }
}

impl std::fmt::Display for ReadAheadPlan {
    /// `read_ahead=N chunks (SIZE)`, or nothing without read-ahead.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.depth > 0 {
            write!(
                f,
                ", read_ahead={} chunks ({}), {} reads in flight",
                self.depth,
                human_readable_size(self.memory()),
                self.concurrency
            )?;
        }
        Ok(())
    }
}

/// The keys of blocks read at once, one of each in turn.
fn interleave(group: Vec<Vec<(u64, StoreKey)>>) -> Vec<(u64, StoreKey)> {
    let longest = group.iter().map(Vec::len).max().unwrap_or(0);
    let mut lists: Vec<_> = group.into_iter().map(Vec::into_iter).collect();
    let mut keys = Vec::new();
    for _ in 0..longest {
        keys.extend(lists.iter_mut().filter_map(Iterator::next));
    }
    keys
}

/// The variables among `columns` read from an object store.
fn remote_variables(table: &GridTable, columns: &[usize]) -> Vec<Arc<ZarrArray>> {
    columns
        .iter()
        .filter_map(|&i| table.variable(i))
        .filter(|v| v.remote().is_some())
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_read_at_once_have_their_keys_interleaved() {
        let key = |s: &str| StoreKey::new(s).unwrap();
        let group = vec![
            vec![(0, key("a0")), (0, key("a1")), (0, key("a2"))],
            vec![(1, key("b0"))],
        ];
        let order: Vec<String> = interleave(group)
            .into_iter()
            .map(|(_, k)| k.as_str().to_string())
            .collect();
        assert_eq!(order, ["a0", "b0", "a1", "a2"]);
    }
}

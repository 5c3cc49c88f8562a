//! Object-store storage for zarrs: one request per read, many in flight.
//!
//! [`RemoteStorage`] serves zarrs' synchronous storage traits from an
//! `object_store` store, blocking the calling (decode) thread on the Tokio
//! runtime. A whole-object read is one `GET` (zarrs' own adapter asks for
//! the object's size with a `HEAD` first: two round trips per chunk), and
//! byte ranges are read without knowing the size, bounded ranges of one
//! object coalesced by `object_store::ObjectStore::get_ranges`.
//!
//! Latency is hidden by [`ReadAhead`]: an operator that knows which chunk
//! keys it will read, in order, hands them to a read-ahead window before it
//! reads. The window keeps up to `depth` keys requested ahead of the
//! decoder, each fetched by its own task on the runtime, many in flight at
//! once and apart from the decode threads; when zarrs then asks for one of
//! those keys, the bytes are taken from the window (waiting for the request
//! if it is still in flight) and the window requests the next key; a read
//! of ranges of such a key (a shard's index, then its inner chunks) is cut
//! out of the answer, which stays in the window until the operator is done
//! with its box, for the ranges read after it. The bytes
//! the window may hold are `depth` times the largest chunk, which the
//! operator counts in its projected memory. Keys the decoder never asked
//! for are dropped when the operator says it is done with their box, and
//! everything outstanding is dropped (requests aborted) with the window.
//! A key a decoder read before its window requested it (the decoder ran
//! ahead of the window) is remembered while windows are open, so that the
//! window skips it instead of reading it a second time.
//!
//! Errors name the key: `cannot read 'KEY': ...`, with the object store's
//! message (the HTTP status and the retries made) after it.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};

use crate::error::lock;

use futures::future::try_join_all;
use futures::StreamExt;
use object_store::path::Path;
use object_store::{GetOptions, GetRange, ObjectStore, ObjectStoreExt};
use tokio::runtime::Handle;
use tokio::sync::Semaphore;
use tokio::task::AbortHandle;
use zarrs::storage::byte_range::{ByteRange, ByteRangeIterator};
use zarrs::storage::storage_adapter::async_to_sync::{
    AsyncToSyncBlockOn, AsyncToSyncStorageAdapter,
};
use zarrs::storage::{
    Bytes, ListableStorageTraits, MaybeBytes, MaybeBytesIterator, OffsetBytesIterator,
    ReadableStorageTraits, StorageError, StoreKey, StoreKeys, StoreKeysPrefixes, StorePrefix,
    WritableStorageTraits,
};
use zarrs_object_store::AsyncObjectStore;

/// Runs object-store futures from the blocking threads that decode chunks.
struct TokioBlockOn(Handle);

impl AsyncToSyncBlockOn for TokioBlockOn {
    fn block_on<F: std::future::Future>(&self, future: F) -> F::Output {
        self.0.block_on(future)
    }
}

/// What went over the network for a store, counted since it was opened.
#[derive(Debug, Default)]
pub struct IoCounters {
    /// Requests answered, with data or an error (each `GET`, ranged or
    /// whole, and `HEAD`; retries inside the object store's client not
    /// counted, nor requests cancelled before their answer: a read-ahead
    /// dropped with requests in flight).
    pub requests: AtomicU64,
    /// Bytes received in answers.
    pub bytes: AtomicU64,
    /// Reads served from a read-ahead window.
    pub read_ahead_hits: AtomicU64,
    /// Reads of keys no window had requested, while windows were open
    /// (each a request the reader waited for).
    pub read_ahead_misses: AtomicU64,
    /// Read-ahead requests sent.
    pub read_ahead_requests: AtomicU64,
    /// Conditional requests answered "not modified": objects an opening
    /// took from its cache ([`crate::zarr::Opening`]).
    pub unchanged: AtomicU64,
    /// Requests in flight now.
    in_flight: AtomicUsize,
    /// The most requests seen in flight at once.
    pub max_in_flight: AtomicUsize,
}

/// A reading of [`IoCounters`] (or a sum of several stores').
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct IoTotals {
    /// Requests answered (see [`IoCounters::requests`]).
    pub requests: u64,
    /// Bytes received in answers.
    pub bytes: u64,
    /// Reads served from a read-ahead window.
    pub read_ahead_hits: u64,
    /// Reads of keys no window had requested, while windows were open.
    pub read_ahead_misses: u64,
    /// Read-ahead requests sent.
    pub read_ahead_requests: u64,
    /// Conditional requests answered "not modified".
    pub unchanged: u64,
}

impl std::ops::Add for IoTotals {
    type Output = Self;

    fn add(self, other: Self) -> Self {
        Self {
            requests: self.requests + other.requests,
            bytes: self.bytes + other.bytes,
            read_ahead_hits: self.read_ahead_hits + other.read_ahead_hits,
            read_ahead_misses: self.read_ahead_misses + other.read_ahead_misses,
            read_ahead_requests: self.read_ahead_requests + other.read_ahead_requests,
            unchanged: self.unchanged + other.unchanged,
        }
    }
}

impl IoCounters {
    /// The counts now.
    pub fn totals(&self) -> IoTotals {
        IoTotals {
            requests: self.requests.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            read_ahead_hits: self.read_ahead_hits.load(Ordering::Relaxed),
            read_ahead_misses: self.read_ahead_misses.load(Ordering::Relaxed),
            read_ahead_requests: self.read_ahead_requests.load(Ordering::Relaxed),
            unchanged: self.unchanged.load(Ordering::Relaxed),
        }
    }

    fn start(&self) -> InFlight<'_> {
        let now = self.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        self.max_in_flight.fetch_max(now, Ordering::Relaxed);
        InFlight(self)
    }
}

/// A request in flight, counted until dropped.
struct InFlight<'a>(&'a IoCounters);

impl InFlight<'_> {
    /// The request was answered (with data or an error).
    fn answered(&self) {
        self.0.requests.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A read-ahead request: pending, then its answer, until taken or released.
struct Slot {
    answer: Mutex<Option<Result<MaybeBytes, String>>>,
    filled: Condvar,
    abort: Mutex<Option<AbortHandle>>,
}

impl Slot {
    fn fill(&self, answer: Result<MaybeBytes, String>) {
        *lock(&self.answer) = Some(answer);
        self.filled.notify_all();
    }

    /// Waits for the answer (the request runs on the runtime, not here);
    /// it stays in the slot for later readers of ranges of it.
    fn wait(&self) -> Result<MaybeBytes, String> {
        let mut answer = lock(&self.answer);
        loop {
            if let Some(answer) = answer.as_ref() {
                return answer.clone();
            }
            answer = self
                .filled
                .wait(answer)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }

    fn abort(&self) {
        if let Some(handle) = lock(&self.abort).take() {
            handle.abort();
        }
    }
}

/// Answers a read-ahead request whose task ends without an answer (aborted
/// before it was first polled or while in flight, or the runtime shutting
/// down), so that no reader waits for it for ever.
struct FillOnDrop(Option<Arc<Slot>>);

impl FillOnDrop {
    fn fill(mut self, answer: Result<MaybeBytes, String>) {
        if let Some(slot) = self.0.take() {
            slot.fill(answer);
        }
    }
}

impl Drop for FillOnDrop {
    fn drop(&mut self) {
        if let Some(slot) = self.0.take() {
            slot.fill(Err(CANCELLED.to_string()));
        }
    }
}

/// The answer of a read-ahead request that was aborted: every window that
/// wanted the key released it (or the runtime shut down). A reader that
/// found the request in flight without owning it reads the key itself.
const CANCELLED: &str = "the read was cancelled";

/// Zarr storage over an object store (see the module docs).
pub struct RemoteStorage {
    store: Arc<dyn ObjectStore>,
    runtime: Handle,
    /// Listing, writing and erasing, through zarrs' adapter.
    adapter: AsyncToSyncStorageAdapter<AsyncObjectStore<Arc<dyn ObjectStore>>, TokioBlockOn>,
    /// Keys requested ahead of the decoder, and keys read before a window
    /// asked for them.
    wanted: Mutex<Wanted>,
    /// Read-ahead windows open over this storage.
    windows: AtomicUsize,
    counters: IoCounters,
    /// What identifies the store among stores with the same keys (its URL
    /// and endpoint), for caches kept between runs.
    identity: String,
    /// Whether an opening records what it reads ([`crate::zarr::Opening`]).
    opening_active: AtomicBool,
    /// What the opening under way knows and has read.
    opening: Mutex<OpeningState>,
}

/// The reads of an opening (see [`RemoteStorage::begin_opening`]).
#[derive(Default)]
struct OpeningState {
    /// Objects the opening may already hold, by key: their ETag and
    /// bytes. Requests for them ask for the object only if it changed.
    validators: HashMap<StoreKey, (String, Bytes)>,
    /// The ETag of each object fetched whole while opening.
    etags: HashMap<StoreKey, String>,
    /// The objects read whole, in the order first read (`None`: absent).
    read: Vec<(StoreKey, Option<Bytes>)>,
    /// The keys in `read`, and those left out of it.
    read_keys: HashSet<StoreKey>,
    /// Most bytes of objects `read` keeps: those past it are left out.
    keep_bytes: u64,
    /// Bytes of the objects in `read`.
    kept_bytes: u64,
}

/// An object read whole while a store was opened, as [`crate::zarr::Opening`] keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpenedObject {
    /// It exists: its ETag and bytes.
    Present {
        /// The ETag the store gave it.
        etag: String,
        /// Its bytes.
        bytes: Bytes,
    },
    /// It did not exist.
    Absent,
}

/// A key requested ahead of the decoders, and the windows that want it.
struct Wish {
    slot: Arc<Slot>,
    /// The windows holding the key, once per box of theirs that reads it.
    /// When several boxes do (of two windows: the loader and its index
    /// threads reading the same block; or of one: tasks sharing a chunk),
    /// the answer stays until the last of them is done: each reader takes
    /// it from the one request.
    owners: Vec<Weak<Window>>,
}

/// Most HEADs in flight at once in [`RemoteStorage::stat_all`].
const STAT_CONCURRENCY: usize = 64;

/// Most keys remembered as read before their window asked for them.
const MISSED_KEYS: usize = 1 << 16;

/// The keys windows want, and those read before they did.
#[derive(Default)]
struct Wanted {
    /// Keys requested ahead of the decoder, by key.
    slots: HashMap<StoreKey, Wish>,
    /// Keys read on demand while windows were open: a window does not
    /// request them afterwards.
    missed: HashSet<StoreKey>,
}

impl std::fmt::Debug for RemoteStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteStorage")
            .field("store", &self.store.to_string())
            .finish()
    }
}

impl RemoteStorage {
    /// Storage over `store` (rooted where the Zarr store is), running its
    /// requests on `runtime`.
    pub fn new(store: Arc<dyn ObjectStore>, runtime: Handle) -> Self {
        let identity = store.to_string();
        let adapter = AsyncToSyncStorageAdapter::new(
            Arc::new(AsyncObjectStore::new(Arc::clone(&store))),
            TokioBlockOn(runtime.clone()),
        );
        Self {
            store,
            runtime,
            adapter,
            wanted: Mutex::new(Wanted::default()),
            windows: AtomicUsize::new(0),
            counters: IoCounters::default(),
            identity,
            opening_active: AtomicBool::new(false),
            opening: Mutex::new(OpeningState::default()),
        }
    }

    /// This storage, identified by `identity` (the store's URL and
    /// endpoint) in caches kept between runs.
    pub fn with_identity(mut self, identity: String) -> Self {
        self.identity = identity;
        self
    }

    /// What identifies the store in caches kept between runs.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Starts recording the objects read whole (until
    /// [`end_opening`](Self::end_opening)), up to `keep_bytes` of them in
    /// all (an object that would pass it is left out, and not held), with
    /// `known` objects (key, ETag, bytes) that a request asks for only if
    /// they changed: answered "not modified", the read gives the known bytes.
    pub fn begin_opening(&self, known: Vec<(StoreKey, String, Bytes)>, keep_bytes: u64) {
        let mut opening = lock(&self.opening);
        *opening = OpeningState {
            validators: known
                .into_iter()
                .map(|(key, etag, bytes)| (key, (etag, bytes)))
                .collect(),
            keep_bytes,
            ..OpeningState::default()
        };
        self.opening_active.store(true, Ordering::Release);
    }

    /// Stops recording: the objects read whole since
    /// [`begin_opening`](Self::begin_opening), in the order first read,
    /// those whose ETag is unknown left out. Empty when no opening was
    /// under way.
    pub fn end_opening(&self) -> Vec<(StoreKey, OpenedObject)> {
        self.opening_active.store(false, Ordering::Release);
        let opening = std::mem::take(&mut *lock(&self.opening));
        let mut etags = opening.etags;
        opening
            .read
            .into_iter()
            .filter_map(|(key, bytes)| {
                let object = match bytes {
                    Some(bytes) => OpenedObject::Present {
                        etag: etags.remove(&key)?,
                        bytes,
                    },
                    None => OpenedObject::Absent,
                };
                Some((key, object))
            })
            .collect()
    }

    /// Records a whole read of `key` while an opening is under way.
    fn note_read(&self, key: &StoreKey, answer: &MaybeBytes) {
        if !self.opening_active.load(Ordering::Acquire) {
            return;
        }
        let mut opening = lock(&self.opening);
        if !opening.read_keys.insert(key.clone()) {
            return;
        }
        let size = answer.as_ref().map_or(0, |bytes| bytes.len() as u64);
        let kept = opening.kept_bytes.saturating_add(size);
        if kept <= opening.keep_bytes {
            opening.kept_bytes = kept;
            opening.read.push((key.clone(), answer.clone()));
        }
    }

    /// What went over the network so far.
    pub fn counters(&self) -> &IoCounters {
        &self.counters
    }

    /// What identifies the stored state of each of `keys` without reading
    /// it: its size, ETag and last modification (one HEAD each, all in
    /// flight at once, up to the object store's usual concurrency), or
    /// `None` when absent; in the order of `keys`.
    pub fn stat_all(&self, keys: &[StoreKey]) -> Vec<Result<Option<String>, String>> {
        let heads = keys.iter().map(|key| async move {
            let in_flight = self.counters.start();
            let answer = self.store.head(&path(key)).await;
            in_flight.answered();
            match answer {
                Ok(meta) => Ok(Some(format!(
                    "{} {} {}",
                    meta.size,
                    meta.e_tag.unwrap_or_default(),
                    meta.last_modified.to_rfc3339()
                ))),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(read_error(key, &e)),
            }
        });
        self.runtime.block_on(
            futures::stream::iter(heads)
                .buffered(STAT_CONCURRENCY)
                .collect(),
        )
    }

    /// The objects at `keys` (`None` when absent), each of at most its
    /// number of bytes (a larger one is an error, found from the answer's
    /// headers: its body is not read), with all their requests in flight
    /// at once (up to the object store's usual concurrency), in the order
    /// of `keys`.
    pub fn get_all(&self, keys: &[(StoreKey, u64)]) -> Vec<Result<MaybeBytes, String>> {
        let gets = keys
            .iter()
            .map(|(key, limit)| self.fetch_within(key, *limit));
        self.runtime.block_on(
            futures::stream::iter(gets)
                .buffered(STAT_CONCURRENCY)
                .collect(),
        )
    }

    /// Writes `value` at `key` only if no object is there (a conditional
    /// `PUT`, atomic on the server): `Ok(true)` when written, `Ok(false)`
    /// when an object was already there. A store that cannot put
    /// conditionally is asked whether the key exists first (not atomic).
    pub fn put_if_absent(&self, key: &StoreKey, value: Bytes) -> Result<bool, String> {
        let location = path(key);
        let options = object_store::PutOptions {
            mode: object_store::PutMode::Create,
            ..Default::default()
        };
        let payload = object_store::PutPayload::from_bytes(value.clone());
        let answer = self
            .runtime
            .block_on(self.store.put_opts(&location, payload, options));
        match answer {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. })
            | Err(object_store::Error::Precondition { .. }) => Ok(false),
            Err(object_store::Error::NotImplemented { .. }) => {
                match self.runtime.block_on(self.store.head(&location)) {
                    Ok(_) => Ok(false),
                    Err(object_store::Error::NotFound { .. }) => {
                        let payload = object_store::PutPayload::from_bytes(value);
                        (self.runtime.block_on(self.store.put(&location, payload)))
                            .map(|_| true)
                            .map_err(|e| format!("cannot write '{}': {e}", key.as_str()))
                    }
                    Err(e) => Err(read_error(key, &e)),
                }
            }
            Err(e) => Err(format!("cannot write '{}': {e}", key.as_str())),
        }
    }

    /// The read-ahead request for `key`, taken out of its window when one
    /// box wants it and it is read whole (or by ranges, by a window that
    /// takes them: [`RangedReads`]); else left there, for the reads of
    /// ranges of it that follow (a shard's index, then its inner chunks) or
    /// the readers of the other boxes that want it, until they are done. `None` when no
    /// window has requested it, which is remembered (while windows are
    /// open) so that none does later.
    fn find_slot(&self, key: &StoreKey, whole: bool) -> Option<Arc<Slot>> {
        let (slot, taken_from) = {
            let mut wanted = lock(&self.wanted);
            let take = wanted.slots.get(key).is_some_and(|w| match &w.owners[..] {
                [owner] => {
                    whole
                        || owner
                            .upgrade()
                            .is_some_and(|w| w.ranges == RangedReads::Take)
                }
                _ => false,
            });
            match take {
                true => wanted
                    .slots
                    .remove(key)
                    .map(|wish| (wish.slot, wish.owners.into_iter().next())),
                false => wanted.slots.get(key).map(|w| (Arc::clone(&w.slot), None)),
            }
            .or_else(|| {
                if self.windows.load(Ordering::Acquire) > 0 {
                    self.counters
                        .read_ahead_misses
                        .fetch_add(1, Ordering::Relaxed);
                    if wanted.missed.len() < MISSED_KEYS {
                        wanted.missed.insert(key.clone());
                    }
                }
                None
            })?
        };
        if let Some(window) = taken_from.and_then(|w| w.upgrade()) {
            window.taken(key);
        }
        self.counters
            .read_ahead_hits
            .fetch_add(1, Ordering::Relaxed);
        Some(slot)
    }

    /// Reads a whole object of at most `limit` bytes: `None` when it does
    /// not exist, an error when it is larger (its body is not read).
    async fn fetch_within(&self, key: &StoreKey, limit: u64) -> Result<MaybeBytes, String> {
        let in_flight = self.counters.start();
        let answer = self.store.get(&path(key)).await;
        in_flight.answered();
        match answer {
            Ok(result) if result.meta.size > limit => Err(format!(
                "{key}: an object of {} bytes where at most {limit} are expected",
                result.meta.size
            )),
            Ok(result) => {
                let bytes = result.bytes().await.map_err(|e| read_error(key, &e))?;
                self.counters
                    .bytes
                    .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                Ok(Some(bytes))
            }
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(read_error(key, &e)),
        }
    }

    /// Reads a whole object: `None` when it does not exist. While an
    /// opening is under way, an object it already holds is asked for only
    /// if it changed, and the ETag of what comes back is kept.
    async fn fetch(&self, key: &StoreKey) -> Result<MaybeBytes, String> {
        let known = match self.opening_active.load(Ordering::Acquire) {
            true => lock(&self.opening).validators.get(key).cloned(),
            false => None,
        };
        let options = GetOptions {
            if_none_match: known.as_ref().map(|(etag, _)| etag.clone()),
            ..GetOptions::default()
        };
        let in_flight = self.counters.start();
        let answer = self.store.get_opts(&path(key), options).await;
        in_flight.answered();
        let (bytes, etag) = match (answer, known) {
            (Ok(result), _) => {
                let etag = result.meta.e_tag.clone();
                let bytes = result.bytes().await.map_err(|e| read_error(key, &e))?;
                self.counters
                    .bytes
                    .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                (Some(bytes), etag)
            }
            (Err(object_store::Error::NotModified { .. }), Some((etag, bytes))) => {
                self.counters.unchanged.fetch_add(1, Ordering::Relaxed);
                (Some(bytes), Some(etag))
            }
            (Err(object_store::Error::NotFound { .. }), _) => (None, None),
            (Err(e), _) => return Err(read_error(key, &e)),
        };
        if let Some(etag) = etag.filter(|_| self.opening_active.load(Ordering::Acquire)) {
            lock(&self.opening).etags.insert(key.clone(), etag);
        }
        Ok(bytes)
    }

    /// Reads ranges of one object, coalescing bounded ones; `None` when it
    /// does not exist.
    async fn fetch_ranges(
        &self,
        key: &StoreKey,
        ranges: &[ByteRange],
    ) -> Result<Option<Vec<Bytes>>, String> {
        let location = path(key);
        let bounded: Option<Vec<Range<u64>>> = ranges
            .iter()
            .map(|r| match r {
                ByteRange::FromStart(offset, Some(len)) => Some(*offset..offset + len),
                _ => None,
            })
            .collect();
        let answer = match bounded {
            Some(bounded) if bounded.len() > 1 => {
                let in_flight = self.counters.start();
                let answer = self.store.get_ranges(&location, &bounded).await;
                in_flight.answered();
                answer
            }
            _ => {
                try_join_all(ranges.iter().map(|range| {
                    let options = GetOptions {
                        range: Some(get_range(range)),
                        ..GetOptions::default()
                    };
                    let location = &location;
                    async move {
                        let in_flight = self.counters.start();
                        let answer = self.store.get_opts(location, options).await;
                        in_flight.answered();
                        answer?.bytes().await
                    }
                }))
                .await
            }
        };
        match answer {
            Ok(parts) => {
                let total: usize = parts.iter().map(Bytes::len).sum();
                self.counters
                    .bytes
                    .fetch_add(total as u64, Ordering::Relaxed);
                Ok(Some(parts))
            }
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(read_error(key, &e)),
        }
    }

    /// Starts fetching `key` for `window` (once one of `permits` is free);
    /// when another window already wants it, `window` shares that request.
    /// `false` when the key was read on demand before any window asked.
    fn request(
        self: &Arc<Self>,
        key: StoreKey,
        window: &Arc<Window>,
        permits: &Arc<Semaphore>,
    ) -> bool {
        let slot = {
            let mut wanted = lock(&self.wanted);
            if wanted.missed.remove(&key) {
                return false;
            }
            if let Some(wish) = wanted.slots.get_mut(&key) {
                wish.owners.push(Arc::downgrade(window));
                return true;
            }
            let slot = Arc::new(Slot {
                answer: Mutex::new(None),
                filled: Condvar::new(),
                abort: Mutex::new(None),
            });
            let wish = Wish {
                slot: Arc::clone(&slot),
                owners: vec![Arc::downgrade(window)],
            };
            wanted.slots.insert(key.clone(), wish);
            slot
        };
        self.counters
            .read_ahead_requests
            .fetch_add(1, Ordering::Relaxed);
        let storage = Arc::clone(self);
        // Made before the task and moved into it: a task aborted before its
        // first poll drops it unpolled, which answers the slot too.
        let guard = FillOnDrop(Some(Arc::clone(&slot)));
        let permits = Arc::clone(permits);
        let task = self.runtime.spawn(async move {
            // Permits are handed out in the order they are asked for: reads
            // start in the order the keys were requested.
            let _permit = permits.acquire_owned().await;
            let answer = storage.fetch(&key).await;
            guard.fill(answer);
        });
        *lock(&slot.abort) = Some(task.abort_handle());
        true
    }

    /// `window` no longer wants `key`: the read-ahead request is dropped
    /// (aborted if still in flight) when no other window wants it.
    fn release(&self, key: &StoreKey, window: &Window) {
        let mut wanted = lock(&self.wanted);
        let Some(wish) = wanted.slots.get_mut(key) else {
            return;
        };
        // One hold of it: a window holds a key once per box that reads it.
        let Some(i) = wish
            .owners
            .iter()
            .position(|w| std::ptr::eq(w.as_ptr(), window))
        else {
            return;
        };
        wish.owners.swap_remove(i);
        if wish.owners.is_empty() {
            if let Some(wish) = wanted.slots.remove(key) {
                wish.slot.abort();
            }
        }
    }
}

/// The object path of a store key.
fn path(key: &StoreKey) -> Path {
    Path::from(key.as_str())
}

/// An object-store range for a zarrs byte range.
fn get_range(range: &ByteRange) -> GetRange {
    match *range {
        ByteRange::FromStart(offset, Some(len)) => GetRange::Bounded(offset..offset + len),
        ByteRange::FromStart(offset, None) => GetRange::Offset(offset),
        ByteRange::Suffix(len) => GetRange::Suffix(len),
    }
}

/// The message of a failed read, naming the key first.
fn read_error(key: &StoreKey, error: &object_store::Error) -> String {
    format!("cannot read '{}': {error}", key.as_str())
}

/// Cuts `ranges` out of a whole object.
fn slice_ranges(bytes: &Bytes, ranges: &[ByteRange]) -> Result<Vec<Bytes>, StorageError> {
    let size = bytes.len() as u64;
    ranges
        .iter()
        .map(|range| {
            let start = range.start(size);
            let end = range.end(size);
            if start > end || end > size {
                return Err(StorageError::Other(format!(
                    "byte range {range} out of an object of {size} bytes"
                )));
            }
            Ok(bytes.slice(start as usize..end as usize))
        })
        .collect()
}

impl ReadableStorageTraits for RemoteStorage {
    fn get(&self, key: &StoreKey) -> Result<MaybeBytes, StorageError> {
        let found = self
            .find_slot(key, true)
            .and_then(|slot| match slot.wait() {
                Err(e) if e == CANCELLED => None,
                answer => Some(answer),
            });
        let answer = found
            .unwrap_or_else(|| self.runtime.block_on(self.fetch(key)))
            .map_err(StorageError::Other)?;
        self.note_read(key, &answer);
        Ok(answer)
    }

    fn get_partial_many<'a>(
        &'a self,
        key: &StoreKey,
        byte_ranges: ByteRangeIterator<'a>,
    ) -> Result<MaybeBytesIterator<'a>, StorageError> {
        let ranges: Vec<ByteRange> = byte_ranges.collect();
        let found = match self.find_slot(key, false) {
            Some(slot) => match slot.wait() {
                Err(e) if e == CANCELLED => None,
                answer => Some(answer.map_err(StorageError::Other)?),
            },
            None => None,
        };
        if let Some(answer) = &found {
            self.note_read(key, answer);
        }
        let parts = match found {
            Some(Some(bytes)) => Some(slice_ranges(&bytes, &ranges)?),
            Some(None) => None,
            None => self
                .runtime
                .block_on(self.fetch_ranges(key, &ranges))
                .map_err(StorageError::Other)?,
        };
        Ok(parts
            .map(|parts| Box::new(parts.into_iter().map(Ok)) as Box<dyn Iterator<Item = _> + 'a>))
    }

    fn size_key(&self, key: &StoreKey) -> Result<Option<u64>, StorageError> {
        self.adapter.size_key(key)
    }

    fn supports_get_partial(&self) -> bool {
        true
    }
}

impl ListableStorageTraits for RemoteStorage {
    fn list(&self) -> Result<StoreKeys, StorageError> {
        self.adapter.list()
    }

    fn list_prefix(&self, prefix: &StorePrefix) -> Result<StoreKeys, StorageError> {
        self.adapter.list_prefix(prefix)
    }

    fn list_dir(&self, prefix: &StorePrefix) -> Result<StoreKeysPrefixes, StorageError> {
        self.adapter.list_dir(prefix)
    }

    fn size_prefix(&self, prefix: &StorePrefix) -> Result<u64, StorageError> {
        self.adapter.size_prefix(prefix)
    }
}

impl WritableStorageTraits for RemoteStorage {
    fn set(&self, key: &StoreKey, value: Bytes) -> Result<(), StorageError> {
        self.adapter.set(key, value)
    }

    fn set_partial_many(
        &self,
        key: &StoreKey,
        offset_values: OffsetBytesIterator,
    ) -> Result<(), StorageError> {
        self.adapter.set_partial_many(key, offset_values)
    }

    fn erase(&self, key: &StoreKey) -> Result<(), StorageError> {
        self.adapter.erase(key)
    }

    fn erase_many(&self, keys: &[StoreKey]) -> Result<(), StorageError> {
        self.adapter.erase_many(keys)
    }

    fn erase_prefix(&self, prefix: &StorePrefix) -> Result<(), StorageError> {
        self.adapter.erase_prefix(prefix)
    }

    fn supports_set_partial(&self) -> bool {
        self.adapter.supports_set_partial()
    }
}

/// Keys an operator will read, box by box, in the order it reads them:
/// `(box number, key)`, box numbers counting up from 0.
pub type UpcomingKeys = Box<dyn Iterator<Item = (u64, StoreKey)> + Send>;

/// A read-ahead window over one store (see the module docs). Dropping it
/// drops what it holds and aborts its requests.
pub struct ReadAhead {
    window: Arc<Window>,
}

/// What a read of ranges of a key a window holds does with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangedReads {
    /// Leaves it held until the reader is done with its box, for the
    /// ranges read after it (a shard's index, then its inner chunks):
    /// readers that decode a block's chunks at once, which the window's
    /// depth holds.
    Keep,
    /// Takes it, as a whole read does: readers that decode chunks one
    /// after another, which the window runs ahead of.
    Take,
}

/// The shared state of a [`ReadAhead`], reached from its requests.
struct Window {
    storage: Arc<RemoteStorage>,
    depth: usize,
    ranges: RangedReads,
    /// Reads in flight at once.
    permits: Arc<Semaphore>,
    state: Mutex<WindowState>,
}

struct WindowState {
    upcoming: UpcomingKeys,
    /// Keys requested and not yet taken or released, with their box.
    held: VecDeque<(u64, StoreKey)>,
    /// Boxes below this are done: their keys are not requested any more.
    done_below: u64,
    /// Boxes above `done_below` that are done.
    done: BTreeSet<u64>,
}

impl WindowState {
    fn mark_done(&mut self, number: u64) {
        if number >= self.done_below {
            self.done.insert(number);
        }
        while self.done.remove(&self.done_below) {
            self.done_below += 1;
        }
    }

    fn is_done(&self, number: u64) -> bool {
        number < self.done_below || self.done.contains(&number)
    }
}

/// The most object-store reads an operator keeps in flight
/// (`zarrfusion.io_concurrency`): each holds a connection and up to a
/// chunk, so more is a mistaken setting, not a speed-up.
pub const MAX_IO_CONCURRENCY: usize = 4096;

impl ReadAhead {
    /// A window holding up to `depth` keys of `upcoming` requested ahead
    /// of the reader, from `storage`, with up to `concurrency` of them in
    /// flight at once, `ranges` saying what a read of ranges of one does.
    pub fn new(
        storage: Arc<RemoteStorage>,
        upcoming: UpcomingKeys,
        depth: usize,
        concurrency: usize,
        ranges: RangedReads,
    ) -> Self {
        storage.windows.fetch_add(1, Ordering::AcqRel);
        let window = Arc::new(Window {
            storage,
            depth: depth.max(1),
            ranges,
            permits: Arc::new(Semaphore::new(concurrency.clamp(1, MAX_IO_CONCURRENCY))),
            state: Mutex::new(WindowState {
                upcoming,
                held: VecDeque::new(),
                done_below: 0,
                done: BTreeSet::new(),
            }),
        });
        window.fill();
        Self { window }
    }

    /// A window over `keys`, read in that order by one reader, each taken
    /// when read (metadata documents, coordinate chunks): up to `depth` of
    /// them requested ahead and in flight at once.
    pub fn keys(storage: Arc<RemoteStorage>, keys: Vec<StoreKey>, depth: usize) -> Self {
        let upcoming = keys.into_iter().map(|key| (0, key));
        Self::new(storage, Box::new(upcoming), depth, depth, RangedReads::Take)
    }

    /// Says the reader is done with box `number`: keys of its still held
    /// are dropped (the reader did not need them), none of its keys are
    /// requested any more, and the window moves on. Boxes may be done in
    /// any order (workers taking boxes from a shared counter).
    pub fn done_with(&self, number: u64) {
        let released: Vec<StoreKey> = {
            let mut state = lock(&self.window.state);
            state.mark_done(number);
            let (released, kept) = std::mem::take(&mut state.held)
                .into_iter()
                .partition(|(b, _)| *b == number);
            state.held = kept;
            released.into_iter().map(|(_, key)| key).collect()
        };
        for key in &released {
            self.window.storage.release(key, &self.window);
        }
        self.window.fill();
    }
}

impl Drop for ReadAhead {
    fn drop(&mut self) {
        let held: Vec<StoreKey> = lock(&self.window.state)
            .held
            .drain(..)
            .map(|(_, key)| key)
            .collect();
        for key in &held {
            self.window.storage.release(key, &self.window);
        }
        let storage = &self.window.storage;
        if storage.windows.fetch_sub(1, Ordering::AcqRel) == 1 {
            lock(&storage.wanted).missed.clear();
        }
    }
}

impl Window {
    /// Requests keys until `depth` are held or none are left.
    fn fill(self: &Arc<Self>) {
        let mut state = lock(&self.state);
        while state.held.len() < self.depth {
            let Some((number, key)) = state.upcoming.next() else {
                break;
            };
            if state.is_done(number) {
                continue;
            }
            if self.storage.request(key.clone(), self, &self.permits) {
                state.held.push_back((number, key));
            }
        }
    }

    /// The reader took `key`: it is no longer held here.
    fn taken(self: &Arc<Self>, key: &StoreKey) {
        {
            let mut state = lock(&self.state);
            if let Some(i) = state.held.iter().position(|(_, k)| k == key) {
                state.held.remove(i);
            }
        }
        self.fill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::memory::InMemory;
    use object_store::{ObjectStoreExt, PutPayload};

    /// A window over `upcoming` that keeps keys read by ranges.
    fn keep(
        storage: &Arc<RemoteStorage>,
        upcoming: impl Iterator<Item = (u64, StoreKey)> + Send + 'static,
        depth: usize,
        concurrency: usize,
    ) -> ReadAhead {
        let upcoming = Box::new(upcoming);
        ReadAhead::new(
            Arc::clone(storage),
            upcoming,
            depth,
            concurrency,
            RangedReads::Keep,
        )
    }

    fn key(name: &str) -> StoreKey {
        StoreKey::new(name).unwrap()
    }

    fn storage(runtime: &tokio::runtime::Runtime, objects: &[(&str, &[u8])]) -> Arc<RemoteStorage> {
        let store = Arc::new(InMemory::new());
        runtime.block_on(async {
            for (name, bytes) in objects {
                store
                    .put(&Path::from(*name), PutPayload::from(bytes.to_vec()))
                    .await
                    .unwrap();
            }
        });
        Arc::new(RemoteStorage::new(store, runtime.handle().clone()))
    }

    #[test]
    fn an_opening_keeps_the_objects_read_up_to_its_bytes() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let storage = storage(
            &runtime,
            &[("a", b"12345"), ("b", b"123456"), ("c", b"1234")],
        );
        storage.begin_opening(Vec::new(), 10);
        for name in ["a", "b", "missing", "c", "a"] {
            storage.get(&key(name)).unwrap();
        }
        let kept: Vec<(String, Option<usize>)> = storage
            .end_opening()
            .into_iter()
            .map(|(key, object)| {
                let size = match object {
                    OpenedObject::Present { bytes, .. } => Some(bytes.len()),
                    OpenedObject::Absent => None,
                };
                (key.as_str().to_string(), size)
            })
            .collect();
        // "b" would pass 10 bytes: left out; "c" still fits after it.
        let want = [("a", Some(5)), ("missing", None), ("c", Some(4))];
        assert_eq!(kept, want.map(|(k, s)| (k.to_string(), s)));
        // Nothing is recorded once the opening ended.
        storage.get(&key("a")).unwrap();
        assert!(storage.end_opening().is_empty());
    }

    #[test]
    fn reads_whole_objects_ranges_and_missing_keys() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let storage = storage(&runtime, &[("a/c/0", b"0123456789")]);
        assert_eq!(
            storage.get(&key("a/c/0")).unwrap().unwrap().as_ref(),
            b"0123456789"
        );
        assert!(storage.get(&key("a/c/1")).unwrap().is_none());
        let ranges = [
            ByteRange::FromStart(1, Some(2)),
            ByteRange::FromStart(5, Some(3)),
        ];
        let parts: Vec<Bytes> = storage
            .get_partial_many(&key("a/c/0"), Box::new(ranges.into_iter()))
            .unwrap()
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(
            parts,
            [Bytes::from_static(b"12"), Bytes::from_static(b"567")]
        );
        let suffix = storage
            .get_partial(&key("a/c/0"), ByteRange::Suffix(4))
            .unwrap()
            .unwrap();
        assert_eq!(suffix.as_ref(), b"6789");
        let from = storage
            .get_partial(&key("a/c/0"), ByteRange::FromStart(7, None))
            .unwrap()
            .unwrap();
        assert_eq!(from.as_ref(), b"789");
        // One request a read: no HEAD before a GET.
        assert_eq!(storage.counters().requests.load(Ordering::Relaxed), 5);
    }

    #[test]
    fn a_reader_of_a_request_cancelled_under_it_reads_the_key_itself() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let storage = storage(&runtime, &[("k/0", b"0123")]);
        // A request another window made, then released (aborted) while this
        // reader waited on it.
        let cancelled = || Wish {
            slot: Arc::new(Slot {
                answer: Mutex::new(Some(Err(CANCELLED.to_string()))),
                filled: Condvar::new(),
                abort: Mutex::new(None),
            }),
            owners: Vec::new(),
        };
        lock(&storage.wanted).slots.insert(key("k/0"), cancelled());
        assert_eq!(storage.get(&key("k/0")).unwrap().unwrap().as_ref(), b"0123");
        lock(&storage.wanted).slots.insert(key("k/0"), cancelled());
        let parts: Vec<Bytes> = storage
            .get_partial_many(
                &key("k/0"),
                Box::new([ByteRange::FromStart(1, Some(2))].into_iter()),
            )
            .unwrap()
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(parts, [Bytes::from_static(b"12")]);
    }

    #[test]
    fn a_window_reads_ahead_in_order_and_serves_the_reader() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let names: Vec<String> = (0..10).map(|i| format!("v/c/{i}")).collect();
        let objects: Vec<(&str, &[u8])> =
            names.iter().map(|n| (n.as_str(), n.as_bytes())).collect();
        let storage = storage(&runtime, &objects);
        let upcoming = names
            .clone()
            .into_iter()
            .enumerate()
            .map(|(i, n)| (i as u64, key(&n)));
        let window = keep(&storage, upcoming, 3, 2);
        assert_eq!(lock(&storage.wanted).slots.len(), 3);
        for (i, name) in names.iter().enumerate() {
            let bytes = storage.get(&key(name)).unwrap().unwrap();
            assert_eq!(bytes.as_ref(), name.as_bytes());
            window.done_with(i as u64);
            assert!(lock(&storage.wanted).slots.len() <= 3);
        }
        let counters = storage.counters();
        assert_eq!(counters.read_ahead_hits.load(Ordering::Relaxed), 10);
        assert_eq!(counters.requests.load(Ordering::Relaxed), 10);
        assert!(counters.max_in_flight.load(Ordering::Relaxed) <= 2);
        assert!(lock(&storage.wanted).slots.is_empty());
    }

    #[test]
    fn a_key_read_before_its_window_asked_is_not_read_again() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let storage = storage(&runtime, &[("k/0", b"a"), ("k/1", b"b"), ("k/2", b"c")]);
        let upcoming = vec![(0, key("k/0")), (0, key("k/1")), (0, key("k/2"))];
        // One key held at a time: k/2 is read before the window reaches it.
        let window = keep(&storage, upcoming.into_iter(), 1, 1);
        assert_eq!(storage.get(&key("k/2")).unwrap().unwrap().as_ref(), b"c");
        assert_eq!(storage.get(&key("k/0")).unwrap().unwrap().as_ref(), b"a");
        assert_eq!(storage.get(&key("k/1")).unwrap().unwrap().as_ref(), b"b");
        window.done_with(0);
        let counters = storage.counters();
        assert_eq!(counters.requests.load(Ordering::Relaxed), 3);
        assert_eq!(counters.read_ahead_hits.load(Ordering::Relaxed), 2);
        assert!(lock(&storage.wanted).slots.is_empty());
        drop(window);
        // With no window open, nothing is remembered.
        assert!(lock(&storage.wanted).missed.is_empty());
        storage.get(&key("k/0")).unwrap();
        assert!(lock(&storage.wanted).missed.is_empty());
    }

    #[test]
    fn ranges_of_a_key_read_ahead_come_from_one_request_until_its_box_is_done() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let storage = storage(&runtime, &[("s/0", b"0123456789"), ("s/1", b"abcdef")]);
        let upcoming = vec![(0, key("s/0")), (1, key("s/1"))];
        let window = keep(&storage, upcoming.into_iter(), 8, 8);
        let read = |name: &str, range: ByteRange| {
            storage
                .get_partial(&key(name), range)
                .unwrap()
                .unwrap()
                .to_vec()
        };
        // A shard's index (its last bytes), then two of its inner chunks.
        assert_eq!(read("s/0", ByteRange::Suffix(2)), b"89");
        assert_eq!(read("s/0", ByteRange::FromStart(0, Some(3))), b"012");
        assert_eq!(read("s/0", ByteRange::FromStart(4, Some(2))), b"45");
        let counters = storage.counters();
        assert_eq!(counters.read_ahead_hits.load(Ordering::Relaxed), 3);
        // A whole read of a key takes it out of the window.
        assert_eq!(
            storage.get(&key("s/1")).unwrap().unwrap().as_ref(),
            b"abcdef"
        );
        assert_eq!(counters.requests.load(Ordering::Relaxed), 2);
        // The answer stays until its box is done, then it is dropped.
        window.done_with(0);
        assert!(lock(&storage.wanted).slots.is_empty());
        assert_eq!(read("s/0", ByteRange::FromStart(8, None)), b"89");
        assert_eq!(counters.requests.load(Ordering::Relaxed), 3);
        drop(window);
    }

    #[test]
    fn a_window_of_one_chunk_at_a_time_readers_is_taken_by_ranges() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let storage = storage(&runtime, &[("u/0", b"0123"), ("u/1", b"4567")]);
        let upcoming = vec![(0, key("u/0")), (0, key("u/1"))];
        // One key held: a range of the first takes it, and the window
        // moves on to the second.
        let window = ReadAhead::new(
            Arc::clone(&storage),
            Box::new(upcoming.into_iter()),
            1,
            1,
            RangedReads::Take,
        );
        let part = storage
            .get_partial(&key("u/0"), ByteRange::FromStart(1, Some(2)))
            .unwrap()
            .unwrap();
        assert_eq!(part.as_ref(), b"12");
        let part = storage
            .get_partial(&key("u/1"), ByteRange::FromStart(0, Some(1)))
            .unwrap()
            .unwrap();
        assert_eq!(part.as_ref(), b"4");
        let counters = storage.counters();
        assert_eq!(counters.read_ahead_hits.load(Ordering::Relaxed), 2);
        assert_eq!(counters.requests.load(Ordering::Relaxed), 2);
        drop(window);
    }

    #[test]
    fn windows_wanting_the_same_key_share_one_request() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let storage = storage(&runtime, &[("b/0", b"a"), ("b/1", b"b")]);
        let keys = || vec![(0, key("b/0")), (1, key("b/1"))].into_iter();
        // An index thread's window and a loader's, over the same blocks.
        let index = keep(&storage, keys(), 8, 8);
        let loader = keep(&storage, keys(), 8, 8);
        // b/0: the loader reads it and is done with it before the index
        // thread reads it; b/1: the other way round.
        assert_eq!(storage.get(&key("b/0")).unwrap().unwrap().as_ref(), b"a");
        loader.done_with(0);
        assert_eq!(storage.get(&key("b/0")).unwrap().unwrap().as_ref(), b"a");
        index.done_with(0);
        assert_eq!(storage.get(&key("b/1")).unwrap().unwrap().as_ref(), b"b");
        index.done_with(1);
        assert_eq!(storage.get(&key("b/1")).unwrap().unwrap().as_ref(), b"b");
        loader.done_with(1);
        let counters = storage.counters();
        assert_eq!(counters.requests.load(Ordering::Relaxed), 2);
        assert_eq!(counters.read_ahead_hits.load(Ordering::Relaxed), 4);
        assert!(lock(&storage.wanted).slots.is_empty());
        // A key one window no longer wants stays for the other; it is
        // dropped with the last.
        let index = keep(&storage, keys(), 8, 8);
        let loader = keep(&storage, keys(), 8, 8);
        index.done_with(0);
        assert_eq!(storage.get(&key("b/0")).unwrap().unwrap().as_ref(), b"a");
        drop(loader);
        assert_eq!(lock(&storage.wanted).slots.len(), 1);
        drop(index);
        assert!(lock(&storage.wanted).slots.is_empty());
    }

    #[test]
    fn a_key_two_boxes_read_is_requested_once() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let storage = storage(&runtime, &[("c/0", b"a")]);
        // Two tasks whose regions share a chunk.
        let upcoming = vec![(0, key("c/0")), (1, key("c/0"))];
        let window = keep(&storage, upcoming.into_iter(), 8, 8);
        assert_eq!(storage.get(&key("c/0")).unwrap().unwrap().as_ref(), b"a");
        window.done_with(0);
        assert_eq!(storage.get(&key("c/0")).unwrap().unwrap().as_ref(), b"a");
        window.done_with(1);
        assert_eq!(storage.counters().requests.load(Ordering::Relaxed), 1);
        assert!(lock(&storage.wanted).slots.is_empty());
        assert!(lock(&window.window.state).held.is_empty());
    }

    #[test]
    fn keys_not_read_are_released_with_their_box_and_the_window() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let storage = storage(&runtime, &[("x/0", b"a"), ("x/1", b"b"), ("x/2", b"c")]);
        let upcoming = vec![(0, key("x/0")), (0, key("x/1")), (1, key("x/2"))];
        let window = keep(&storage, upcoming.into_iter(), 8, 8);
        assert_eq!(lock(&storage.wanted).slots.len(), 3);
        // Box 1 is done first (another worker), box 0 later: each releases
        // only its own keys.
        window.done_with(1);
        assert_eq!(lock(&storage.wanted).slots.len(), 2);
        window.done_with(0);
        assert!(lock(&storage.wanted).slots.is_empty());
        drop(window);
        // Dropping a window drops what it still holds.
        let upcoming = vec![(0, key("x/0")), (1, key("x/1"))];
        let window = keep(&storage, upcoming.into_iter(), 8, 8);
        assert_eq!(lock(&storage.wanted).slots.len(), 2);
        drop(window);
        assert!(lock(&storage.wanted).slots.is_empty());
        // A key no window holds is read directly.
        assert_eq!(storage.get(&key("x/2")).unwrap().unwrap().as_ref(), b"c");
    }

    #[test]
    fn a_request_aborted_before_its_task_ever_ran_answers_its_readers() {
        // A runtime nobody drives: the request's task is spawned, not polled.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let storage = storage(&runtime, &[("y/0", b"abc")]);
        let window = keep(&storage, vec![(0, key("y/0"))].into_iter(), 8, 8);
        // A reader of ranges found the request (and would wait on it)...
        let slot = Arc::clone(&lock(&storage.wanted).slots[&key("y/0")].slot);
        // ... when the window let go of it: the task is aborted unpolled.
        drop(window);
        runtime.block_on(async { tokio::time::sleep(std::time::Duration::from_millis(20)).await });
        let answer = lock(&slot.answer).clone();
        assert!(
            matches!(&answer, Some(Err(e)) if e == CANCELLED),
            "the slot was left unanswered: {answer:?}"
        );
        // That reader reads the key itself.
        assert_eq!(storage.get(&key("y/0")).unwrap().unwrap().as_ref(), b"abc");
    }
}

//! Blocks of a window index shared between the processes building it.
//!
//! DataLoader workers and the ranks of a training job each open the same
//! windows, and with `drop_last` or a validity rule each needs the index of
//! blocks the others read for their own batches. Without sharing, every
//! process decodes every block to count it. With a cache
//! ([`super::IndexCache`]: a directory, or a prefix in an object store that
//! ranks on several machines share), the processes building the index
//! under one key share its blocks in `<key>.blocks/` there:
//!
//! - `<block>.claim` says who reads a block: its process, machine and boot,
//!   a nonce naming one index in that process
//!   (`owner_record`) and when it was
//!   claimed. It is created whole and only if absent ([`CacheDir::create_new`]:
//!   a hard link in a directory, a conditional `PUT` in an object store),
//!   so exactly one claimant wins;
//! - `<block>.block` is the block's index once read (written whole);
//! - a process that finds a block claimed by a running process waits for
//!   its `.block` (polling: every few milliseconds in a directory, a few
//!   times a second in an object store). A claim of a process of this
//!   machine that is gone, of another boot, unreadable, or older than
//!   [`STALE_CLAIM`] is taken over, so a killed (or hung) process never
//!   leaves the others waiting for ever. A claim of another machine is
//!   waited for in an object store (the ranks of a job on several
//!   machines: each block is read by one of them), taken over in a
//!   directory (a file system shared by machines: a block is at worst read
//!   twice);
//! - claims whose block was not written are removed when their index fails
//!   or is dropped; the blocks go once the whole index is in the cache
//!   (whoever then still waits finds the whole index there). In a
//!   directory they go at once ([`CacheDir::remove_dir`]): a process
//!   looking meanwhile never finds claims gone and a block unread; in an
//!   object store, where they go one by one, a claim made then is no
//!   claim (the whole index is there).
//!
//! Blocks a killed build left are valid for their key (the key digests the
//! data and the windows), so the next build starts from them.

use std::collections::HashSet;
use std::io::ErrorKind;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use super::cache::{decode_block, encode_block, IndexCache, Reader};
use super::cache_dir::CacheDir;
use super::index::BlockIndex;
use crate::error::lock;
use crate::write::stamp::{boot, host, is_gone, owner_record, unique_suffix};

const MAGIC: &[u8; 8] = b"ZFWBLOCK";
const VERSION: u32 = 1;

/// The most bytes a claim is read of (its record is a few hundred).
const CLAIM_BYTES: u64 = 64 << 10;

/// The most bytes the file of a block of `origins` window origins can
/// hold (its header and its index: see [`encode_block`]).
fn block_bytes(origins: u64) -> u64 {
    let header = MAGIC.len() as u64 + 4 + 8;
    header + super::cache::block_bytes(origins)
}

/// A claim older than this whose block was not written is taken over:
/// reading one block takes seconds, so its process is hung or stopped.
pub const STALE_CLAIM: Duration = Duration::from_secs(300);

/// Who holds a block's claim, as [`SharedBlocks::claim`] finds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// This index reads the block (it claimed it, or sharing is off).
    Ours,
    /// A running process reads it: wait for its `.block`.
    Theirs,
    /// The blocks are gone: the whole index is in the cache.
    Finished,
}

/// The blocks of one index key shared through a cache.
#[derive(Debug)]
pub struct SharedBlocks {
    cache: CacheDir,
    /// `<key>.blocks`, the directory of the blocks in the cache.
    dir: String,
    /// The file of the whole index.
    whole: String,
    /// Names this index in its claims.
    nonce: String,
    /// Blocks this index claimed and has not written yet.
    ours: Mutex<HashSet<usize>>,
}

impl SharedBlocks {
    /// The shared blocks of the index `key` in `cache`; `None` when its
    /// directory cannot be made.
    pub fn open(cache: &CacheDir, key: &str) -> Option<Self> {
        let dir = format!("{key}.blocks");
        if let Err(e) = cache.make_dir(&dir) {
            log::debug!("window index blocks not shared in {cache}/{dir}: {e}");
            return None;
        }
        Some(Self {
            cache: cache.clone(),
            dir,
            whole: IndexCache::file_name(key),
            nonce: unique_suffix(),
            ours: Mutex::default(),
        })
    }

    /// Whether the blocks are still shared: the whole index is not in the
    /// cache yet (in a directory, the blocks' directory goes once it is).
    pub fn exists(&self) -> bool {
        match self.cache.is_remote() {
            true => !self.cache.contains(&self.whole),
            false => self.cache.has_dir(&self.dir),
        }
    }

    /// How often a process waiting for blocks others read looks for them.
    pub fn poll_interval(&self) -> Duration {
        match self.cache.is_remote() {
            true => Duration::from_millis(200),
            false => Duration::from_millis(5),
        }
    }

    /// How often a process waiting for blocks others read checks that
    /// their claims still hold.
    pub fn owner_check_interval(&self) -> Duration {
        match self.cache.is_remote() {
            true => Duration::from_secs(2),
            false => Duration::from_millis(250),
        }
    }

    fn block_name(&self, id: usize) -> String {
        format!("{}/{id}.block", self.dir)
    }

    fn claim_name(&self, id: usize) -> String {
        format!("{}/{id}.claim", self.dir)
    }

    /// The index of block `id` (of `origins` window origins) when some
    /// process has written it.
    pub fn load(&self, id: usize, origins: u64) -> Option<BlockIndex> {
        Self::decode(
            id,
            origins,
            &self
                .cache
                .read(&self.block_name(id), block_bytes(origins))?,
        )
    }

    /// As [`Self::load`] for each `(block, origins)` of `blocks`, all read
    /// at once.
    pub fn load_all(&self, blocks: &[(usize, u64)]) -> Vec<Option<BlockIndex>> {
        let names: Vec<(String, u64)> = (blocks.iter())
            .map(|&(id, origins)| (self.block_name(id), block_bytes(origins)))
            .collect();
        (self.cache.read_all(&names).into_iter())
            .zip(blocks)
            .map(|(bytes, &(id, origins))| Self::decode(id, origins, &bytes?))
            .collect()
    }

    fn decode(id: usize, origins: u64, bytes: &[u8]) -> Option<BlockIndex> {
        let mut r = Reader(bytes);
        if r.take(MAGIC.len())? != MAGIC || r.u32()? != VERSION || r.u64()? != id as u64 {
            return None;
        }
        let index = decode_block(&mut r, origins)?;
        r.0.is_empty().then_some(index)
    }

    /// Writes block `id`'s index for the other processes (errors only
    /// logged: sharing is an optimization).
    pub fn store(&self, id: usize, index: &BlockIndex) {
        let mut bytes = Vec::with_capacity(32);
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&VERSION.to_le_bytes());
        bytes.extend_from_slice(&(id as u64).to_le_bytes());
        let written = encode_block(&mut bytes, index)
            .and_then(|()| self.cache.write(&self.block_name(id), &bytes));
        match written {
            Ok(()) => {
                lock(&self.ours).remove(&id);
            }
            Err(e) => log::debug!("window index block {id} not shared: {e}"),
        }
    }

    /// Claims block `id` for this index: [`Claim::Ours`] when this index
    /// should read it (claimed now or before, taken over from a process
    /// that is gone, or the cache cannot be written), [`Claim::Theirs`]
    /// when a running process has, [`Claim::Finished`] when the whole index
    /// is in the cache.
    pub fn claim(&self, id: usize) -> Claim {
        let name = self.claim_name(id);
        // Twice at most: once more after taking over a stale claim.
        for _ in 0..2 {
            match self.claim_if_free(id) {
                Claim::Theirs => {}
                claim => return claim,
            }
            match self.claimant(&name) {
                Claimant::Us => return Claim::Ours,
                Claimant::Running => return Claim::Theirs,
                Claimant::Gone => {
                    // Taken over; if another process took it over first,
                    // the next try finds its claim.
                    self.cache.remove(&name);
                }
            }
        }
        Claim::Theirs
    }

    /// Claims block `id` for this index when nobody has: as
    /// [`Self::claim`], but any claim there is [`Claim::Theirs`] without
    /// looking whose it is (one request: for a reader walking past the
    /// blocks others read; a waiter finds out later whether their
    /// process is gone).
    pub fn claim_if_free(&self, id: usize) -> Claim {
        if self.holds(id) {
            return Claim::Ours;
        }
        let name = self.claim_name(id);
        match self.create_claim(&name) {
            // A claim made as the blocks went (in an object store, where
            // they go one by one) is no claim.
            Ok(()) if !self.exists() => {
                self.cache.remove(&name);
                Claim::Finished
            }
            Ok(()) => {
                lock(&self.ours).insert(id);
                Claim::Ours
            }
            Err(e) if e.kind() == ErrorKind::AlreadyExists => Claim::Theirs,
            Err(_) if !self.exists() => Claim::Finished,
            Err(e) => {
                log::debug!("window index block {id} not claimed: {e}");
                Claim::Ours
            }
        }
    }

    /// Whether this index holds the claim of block `id` and has not written
    /// the block yet.
    pub fn holds(&self, id: usize) -> bool {
        lock(&self.ours).contains(&id)
    }

    /// Creates the claim `name`, whole and only if it is not there.
    fn create_claim(&self, name: &str) -> std::io::Result<()> {
        let mut record = owner_record();
        record["nonce"] = Value::String(self.nonce.clone());
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        record["claimed_at"] = Value::from(now.as_secs_f64());
        self.cache.create_new(name, record.to_string().as_bytes())
    }

    /// Of `ids`, the blocks nobody running holds any more (their claims
    /// are gone, stale or of a process that is gone), their claims all
    /// read at once: a waiter reads those itself.
    pub fn abandoned(&self, ids: &[usize]) -> Vec<usize> {
        let names: Vec<(String, u64)> = (ids.iter())
            .map(|&id| (self.claim_name(id), CLAIM_BYTES))
            .collect();
        let records = self.cache.read_all(&names);
        (ids.iter()
            .zip(names.iter().map(|(name, _)| name))
            .zip(records))
        .filter(|((_, name), record)| {
            !matches!(self.judge(name, record.as_deref()), Claimant::Running)
        })
        .map(|((&id, _), _)| id)
        .collect()
    }

    fn claimant(&self, name: &str) -> Claimant {
        self.judge(name, self.cache.read(name, CLAIM_BYTES).as_deref())
    }

    /// Who holds the claim `name` whose bytes are `record` (`None`: absent).
    fn judge(&self, name: &str, record: Option<&[u8]>) -> Claimant {
        let record: Value = match record {
            Some(bytes) => serde_json::from_slice(bytes).unwrap_or(Value::Null),
            // Gone since (written and dropped): try again.
            None => return Claimant::Gone,
        };
        if record["nonce"].as_str() == Some(self.nonce.as_str()) {
            return Claimant::Us;
        }
        // Its age by the claimant's clock, else the file's; a claim in an
        // object store whose age cannot be told is stale.
        let age = record["claimed_at"]
            .as_f64()
            .filter(|at| at.is_finite() && *at >= 0.0)
            .map(|at| {
                let now = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default();
                now.saturating_sub(Duration::from_secs_f64(at.min(now.as_secs_f64())))
            })
            .or_else(|| self.cache.age(name));
        let stale = age.map_or(self.cache.is_remote(), |age| age > STALE_CLAIM);
        let pid = record["pid"].as_u64().and_then(|p| u32::try_from(p).ok());
        let here = record["host"].as_str().is_some_and(|h| Some(h) == host());
        let this_boot = record["boot"].as_str().is_some_and(|b| Some(b) == boot());
        match pid {
            _ if stale => Claimant::Gone,
            Some(pid) if here && this_boot && !is_gone(pid) => Claimant::Running,
            // Another machine sharing the object store.
            Some(_) if !here && record["host"].is_string() && self.cache.is_remote() => {
                Claimant::Running
            }
            _ => Claimant::Gone,
        }
    }

    /// Removes this index's claims of blocks it did not write (its index
    /// failed or is dropped), so others read them instead of waiting.
    pub fn release(&self) {
        let ours: Vec<usize> = lock(&self.ours).drain().collect();
        for id in ours {
            self.remove_claim(id);
        }
    }

    /// Removes this index's claim of block `id` when it holds it and has
    /// not written the block (it will not read it after all).
    pub fn unclaim(&self, id: usize) {
        if lock(&self.ours).remove(&id) {
            self.remove_claim(id);
        }
    }

    fn remove_claim(&self, id: usize) {
        let name = self.claim_name(id);
        if matches!(self.claimant(&name), Claimant::Us) {
            self.cache.remove(&name);
        }
    }

    /// Removes the blocks (the whole index is in the cache).
    pub fn remove(&self) {
        lock(&self.ours).clear();
        self.cache.remove_dir(&self.dir);
    }
}

impl Drop for SharedBlocks {
    fn drop(&mut self) {
        self.release();
    }
}

enum Claimant {
    /// This index.
    Us,
    /// A running process of this machine and boot, or of another machine
    /// sharing an object store.
    Running,
    /// A process of this machine that is gone, of another boot (or of
    /// another machine, in a directory), a claim that cannot be read, or
    /// one older than [`STALE_CLAIM`].
    Gone,
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::Arc;

    use object_store::memory::InMemory;

    use super::*;
    use crate::zarr::RemoteStorage;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("zf-shared-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    /// Two indices sharing `cache`: one claimant wins, blocks round trip,
    /// a written block's claim stays when its index goes and an unwritten
    /// one goes; `b`, still open, is returned.
    fn one_claimant_wins_and_blocks_round_trip_in(cache: &CacheDir) -> SharedBlocks {
        let a = SharedBlocks::open(cache, "k").unwrap();
        let b = SharedBlocks::open(cache, "k").unwrap();
        assert!(a.exists());
        assert_eq!(a.claim(3), Claim::Ours);
        assert_eq!(a.claim(3), Claim::Ours, "claimed again by the same index");
        // Another index of a running process (this one) waits.
        assert_eq!(b.claim(3), Claim::Theirs);
        assert_eq!(b.load(3, 100), None);
        let index = BlockIndex::from_bits(vec![0xFF, 0b1011]);
        a.store(3, &index);
        assert_eq!(b.load(3, 100), Some(index.clone()));
        // Several at once, each checked as one.
        let loaded = b.load_all(&[(4, 100), (3, 100), (3, 200)]);
        assert_eq!(loaded, [None, Some(index.clone()), None]);
        // Another block size, another block: misses.
        assert_eq!(b.load(3, 200), None);
        assert_eq!(b.load(4, 100), None);
        // A stored block's claim stays when `a` goes; an unwritten one goes.
        assert_eq!(a.claim(5), Claim::Ours);
        drop(a);
        assert!(cache.contains("k.blocks/3.claim"));
        assert!(!cache.contains("k.blocks/5.claim"));
        assert_eq!(b.claim(5), Claim::Ours);
        b
    }

    #[test]
    fn one_claimant_wins_and_blocks_round_trip() {
        let dir = temp_dir("claims");
        let b = one_claimant_wins_and_blocks_round_trip_in(&CacheDir::Local(dir.clone()));
        // No temporary file is left.
        let names: Vec<String> = std::fs::read_dir(dir.join("k.blocks"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
        b.remove();
        assert!(!b.exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn claims_of_gone_or_foreign_processes_are_taken_over() {
        let dir = temp_dir("stale");
        let shared = SharedBlocks::open(&CacheDir::Local(dir.clone()), "k").unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        let mine = |pid: u32, host: &str, boot: &str| {
            serde_json::json!({"pid": pid, "host": host, "boot": boot, "nonce": "x"}).to_string()
        };
        let (h, b) = (host().unwrap(), boot().unwrap());
        let claims = [
            (0, mine(gone, h, b), Claim::Ours),
            (1, mine(std::process::id(), "another-host", b), Claim::Ours),
            (2, mine(std::process::id(), h, "another-boot"), Claim::Ours),
            (3, "{not json".to_string(), Claim::Ours),
            // A running process of this machine (this one, another index).
            (4, mine(std::process::id(), h, b), Claim::Theirs),
            // The same, but claimed longer ago than a block can take.
            (5, mine(std::process::id(), h, b), Claim::Ours),
        ];
        for (id, record, _) in &claims {
            std::fs::write(dir.join(format!("k.blocks/{id}.claim")), record).unwrap();
        }
        let old = std::time::SystemTime::now() - STALE_CLAIM - Duration::from_secs(1);
        (std::fs::File::options()
            .write(true)
            .open(dir.join("k.blocks/5.claim")))
        .unwrap()
        .set_modified(old)
        .unwrap();
        for (id, _, expected) in claims {
            assert_eq!(shared.claim(id), expected, "block {id}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The blocks shared through an object store (a real `object_store`
    /// in memory, with its conditional `PUT`).
    fn remote(runtime: &tokio::runtime::Runtime) -> CacheDir {
        let store = Arc::new(InMemory::new());
        CacheDir::Remote {
            location: "memory://cache".into(),
            storage: Arc::new(RemoteStorage::new(store, runtime.handle().clone())),
        }
    }

    #[test]
    fn blocks_are_shared_through_an_object_store() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let cache = remote(&runtime);
        let b = one_claimant_wins_and_blocks_round_trip_in(&cache);
        // The whole index stored: the blocks are no longer shared, and go.
        cache.write(&IndexCache::file_name("k"), b"whole").unwrap();
        assert!(!b.exists());
        // A claim made now is no claim: the index is there.
        assert_eq!(b.claim(6), Claim::Finished);
        assert!(!cache.contains("k.blocks/6.claim"));
        b.remove();
        assert!(!cache.contains("k.blocks/3.block"));
        assert!(!cache.contains("k.blocks/3.claim"));
        assert!(cache.contains("k.idx"));
    }

    #[test]
    fn in_an_object_store_claims_of_other_machines_are_waited_for_until_stale() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let cache = remote(&runtime);
        let shared = SharedBlocks::open(&cache, "k").unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let old = now - STALE_CLAIM.as_secs_f64() - 1.0;
        let record = |pid: u32, host: &str, boot: &str, at: Option<f64>| {
            let mut r = serde_json::json!({"pid": pid, "host": host, "boot": boot, "nonce": "x"});
            if let Some(at) = at {
                r["claimed_at"] = Value::from(at);
            }
            r.to_string()
        };
        let (h, b) = (host().unwrap(), boot().unwrap());
        let me = std::process::id();
        let claims = [
            // Another machine, claimed just now: a rank there reads it.
            (
                0,
                record(me, "another-host", "another-boot", Some(now)),
                Claim::Theirs,
            ),
            // Another machine, claimed longer ago than a block can take.
            (
                1,
                record(me, "another-host", "another-boot", Some(old)),
                Claim::Ours,
            ),
            // Another machine, no time: its age cannot be told.
            (
                2,
                record(me, "another-host", "another-boot", None),
                Claim::Ours,
            ),
            // This machine: a process that is gone, and a running one.
            (3, record(gone, h, b, Some(now)), Claim::Ours),
            (4, record(me, h, b, Some(now)), Claim::Theirs),
            (5, "{not json".to_string(), Claim::Ours),
            // Claimed in the future by a skewed clock: not stale.
            (
                6,
                record(me, "another-host", "x", Some(now + 60.0)),
                Claim::Theirs,
            ),
        ];
        for (id, text, _) in &claims {
            cache
                .write(&format!("k.blocks/{id}.claim"), text.as_bytes())
                .unwrap();
        }
        // Read all at once, the claims taken over are abandoned, and so is
        // a block nobody claimed.
        let abandoned: Vec<usize> = (claims.iter())
            .filter(|c| c.2 == Claim::Ours)
            .map(|c| c.0)
            .chain([7])
            .collect();
        assert_eq!(shared.abandoned(&[0, 1, 2, 3, 4, 5, 6, 7]), abandoned);
        for (id, _, expected) in claims {
            assert_eq!(shared.claim(id), expected, "block {id}");
        }
    }

    #[test]
    fn in_a_directory_claims_of_other_machines_are_taken_over() {
        let dir = temp_dir("foreign");
        let cache = CacheDir::Local(dir.clone());
        let shared = SharedBlocks::open(&cache, "k").unwrap();
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let record = serde_json::json!({
            "pid": std::process::id(), "host": "another-host", "boot": "b", "nonce": "x",
            "claimed_at": now,
        });
        cache
            .write("k.blocks/0.claim", record.to_string().as_bytes())
            .unwrap();
        assert_eq!(shared.claim(0), Claim::Ours);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

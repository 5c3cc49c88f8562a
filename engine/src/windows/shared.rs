//! Blocks of a window index shared between the processes building it.
//!
//! DataLoader workers and the ranks of a training job on one machine each
//! open the same windows, and with `drop_last` or a validity rule each
//! needs the index of blocks the others read for their own batches.
//! Without sharing, every process decodes every block to count it. With a
//! cache directory ([`super::IndexCache`]), the processes building the
//! index under one key share its blocks in `<key>.blocks/` there:
//!
//! - `<block>.claim` says who reads a block: its process, machine and boot
//!   and a nonce naming one index in that process
//!   ([`owner_record`](crate::write::stamp::owner_record)). It is created
//!   whole (written beside it, then hard-linked to its name, which fails
//!   when it exists), so exactly one claimant wins;
//! - `<block>.block` is the block's index once read (written to a
//!   temporary name and renamed);
//! - a process that finds a block claimed by a running process of this
//!   machine waits for its `.block` (polling); a claim of a process that is
//!   gone, of another boot or machine, unreadable, or older than
//!   [`STALE_CLAIM`] is taken over, so a killed (or hung) process never
//!   leaves the others waiting for ever, and a block read on another
//!   machine (a shared file system) is at worst read twice;
//! - claims whose block was not written are removed when their index fails
//!   or is dropped; the directory goes once the whole index is in the cache
//!   (whoever then still waits finds the whole index there).
//!
//! Blocks a killed build left in the directory are valid for their key
//! (the key digests the data and the windows), so the next build starts
//! from them.

use std::collections::HashSet;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use serde_json::Value;

use super::cache::{decode_block, encode_block, Reader};
use super::index::BlockIndex;
use crate::error::lock;
use crate::write::stamp::{boot, host, is_gone, owner_record, unique_suffix};
use crate::zarr::write_file_atomically;

const MAGIC: &[u8; 8] = b"ZFWBLOCK";
const VERSION: u32 = 1;

/// A claim older than this whose block was not written is taken over:
/// reading one block takes seconds, so its process is hung or stopped.
pub const STALE_CLAIM: Duration = Duration::from_secs(300);

/// Who holds a block's claim, as [`SharedBlocks::claim`] finds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// This index reads the block (it claimed it, or sharing is off).
    Ours,
    /// A running process of this machine reads it: wait for its `.block`.
    Theirs,
    /// The directory is gone: the whole index is in the cache.
    Finished,
}

/// The blocks of one index key shared through a directory.
#[derive(Debug)]
pub struct SharedBlocks {
    dir: PathBuf,
    /// Names this index in its claims.
    nonce: String,
    /// Blocks this index claimed and has not written yet.
    ours: Mutex<HashSet<usize>>,
}

impl SharedBlocks {
    /// The shared blocks of the index `key` in the cache directory `cache`;
    /// `None` when the directory cannot be made.
    pub fn open(cache: &Path, key: &str) -> Option<Self> {
        let dir = cache.join(format!("{key}.blocks"));
        if let Err(e) = std::fs::create_dir_all(&dir) {
            log::debug!("window index blocks not shared in {}: {e}", dir.display());
            return None;
        }
        Some(Self {
            dir,
            nonce: unique_suffix(),
            ours: Mutex::default(),
        })
    }

    /// Whether the directory is still there (it goes once the whole index
    /// is in the cache).
    pub fn exists(&self) -> bool {
        self.dir.is_dir()
    }

    fn block_path(&self, id: usize) -> PathBuf {
        self.dir.join(format!("{id}.block"))
    }

    fn claim_path(&self, id: usize) -> PathBuf {
        self.dir.join(format!("{id}.claim"))
    }

    /// The index of block `id` (of `origins` window origins) when some
    /// process has written it.
    pub fn load(&self, id: usize, origins: u64) -> Option<BlockIndex> {
        let bytes = std::fs::read(self.block_path(id)).ok()?;
        let mut r = Reader(&bytes);
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
            .and_then(|()| write_file_atomically(&self.block_path(id), &bytes));
        match written {
            Ok(()) => {
                lock(&self.ours).remove(&id);
            }
            Err(e) => log::debug!("window index block {id} not shared: {e}"),
        }
    }

    /// Claims block `id` for this index: [`Claim::Ours`] when this index
    /// should read it (claimed now or before, taken over from a process
    /// that is gone, or the directory cannot be written), [`Claim::Theirs`]
    /// when a running process of this machine has, [`Claim::Finished`] when
    /// the directory is gone.
    pub fn claim(&self, id: usize) -> Claim {
        let path = self.claim_path(id);
        // Twice at most: once more after taking over a stale claim.
        for _ in 0..2 {
            match self.create_claim(&path) {
                Ok(()) => {
                    lock(&self.ours).insert(id);
                    return Claim::Ours;
                }
                Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
                Err(_) if !self.exists() => return Claim::Finished,
                Err(e) => {
                    log::debug!("window index block {id} not claimed: {e}");
                    return Claim::Ours;
                }
            }
            match self.claimant(&path) {
                Claimant::Us => return Claim::Ours,
                Claimant::Running => return Claim::Theirs,
                Claimant::Gone => {
                    // Taken over; if another process took it over first,
                    // the next try finds its claim.
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        Claim::Theirs
    }

    /// Creates the claim at `path`, whole: written beside it, then linked
    /// to its name (which fails when someone holds it).
    fn create_claim(&self, path: &Path) -> std::io::Result<()> {
        let mut record = owner_record();
        record["nonce"] = Value::String(self.nonce.clone());
        let temporary = path.with_extension(format!("claim.{}.tmp", self.nonce));
        std::fs::write(&temporary, record.to_string())?;
        let linked = std::fs::hard_link(&temporary, path);
        let _ = std::fs::remove_file(&temporary);
        linked
    }

    fn claimant(&self, path: &Path) -> Claimant {
        let record: Value = match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or(Value::Null),
            // Gone since (written and dropped): try again.
            Err(_) => return Claimant::Gone,
        };
        let stale = (std::fs::metadata(path).and_then(|m| m.modified()))
            .ok()
            .and_then(|at| at.elapsed().ok())
            .is_some_and(|age| age > STALE_CLAIM);
        if record["nonce"].as_str() == Some(self.nonce.as_str()) {
            return Claimant::Us;
        }
        let pid = record["pid"].as_u64().and_then(|p| u32::try_from(p).ok());
        let here = record["host"].as_str().is_some_and(|h| Some(h) == host());
        let this_boot = record["boot"].as_str().is_some_and(|b| Some(b) == boot());
        match pid {
            Some(pid) if here && this_boot && !is_gone(pid) && !stale => Claimant::Running,
            _ => Claimant::Gone,
        }
    }

    /// Removes this index's claims of blocks it did not write (its index
    /// failed or is dropped), so others read them instead of waiting.
    pub fn release(&self) {
        let ours: Vec<usize> = lock(&self.ours).drain().collect();
        for id in ours {
            let path = self.claim_path(id);
            if matches!(self.claimant(&path), Claimant::Us) {
                let _ = std::fs::remove_file(path);
            }
        }
    }

    /// Removes the directory (the whole index is in the cache).
    pub fn remove(&self) {
        lock(&self.ours).clear();
        let _ = std::fs::remove_dir_all(&self.dir);
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
    /// A running process of this machine and boot.
    Running,
    /// A process that is gone, of another machine or boot, a claim that
    /// cannot be read, or one older than [`STALE_CLAIM`].
    Gone,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("zf-shared-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn one_claimant_wins_and_blocks_round_trip() {
        let dir = temp_dir("claims");
        let a = SharedBlocks::open(&dir, "k").unwrap();
        let b = SharedBlocks::open(&dir, "k").unwrap();
        assert_eq!(a.claim(3), Claim::Ours);
        assert_eq!(a.claim(3), Claim::Ours, "claimed again by the same index");
        // Another index of a running process (this one) waits.
        assert_eq!(b.claim(3), Claim::Theirs);
        assert_eq!(b.load(3, 100), None);
        let index = BlockIndex::from_bits(vec![0xFF, 0b1011]);
        a.store(3, &index);
        assert_eq!(b.load(3, 100), Some(index.clone()));
        // Another block size, another block: misses.
        assert_eq!(b.load(3, 200), None);
        assert_eq!(b.load(4, 100), None);
        // A stored block's claim stays when `a` goes; an unwritten one goes.
        assert_eq!(a.claim(5), Claim::Ours);
        drop(a);
        assert!(dir.join("k.blocks/3.claim").exists());
        assert!(!dir.join("k.blocks/5.claim").exists());
        assert_eq!(b.claim(5), Claim::Ours);
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
        let shared = SharedBlocks::open(&dir, "k").unwrap();
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
}

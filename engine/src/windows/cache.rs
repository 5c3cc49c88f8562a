//! The valid-window index kept on disk between runs.
//!
//! Building the index reads every block once; a training script that opens
//! the same dataset with the same windows every run should pay that once.
//! The index is stored in a cache directory under a key that digests all it
//! depends on: the store, its variables' [fingerprints](crate::zarr::ZarrArray::fingerprint_all)
//! (metadata; in local stores the stored keys, sizes and modification
//! times; in object stores the metadata objects' size, ETag and
//! modification time only, one round trip a store, so opening costs no
//! listing), the window
//! grid (selection, window sizes, strides, blocks) and the samples' roles
//! and validity rules.
//! Rewriting the data, changing the window or the rule gives another key.
//!
//! A cache file that is missing, truncated or does not match the grid is a
//! miss, never an error; files are written whole (a temporary name renamed,
//! or one `PUT`: [`CacheDir`]), so a reader never sees half a file. The
//! cache is a directory on this machine or a prefix in an object store
//! (`s3://bucket/cache/`), which the ranks of a job on several machines
//! share.
//!
//! File layout (little-endian): the magic `ZFWINDEX`, a format version
//! (`u32`), the key (`u32` length and bytes), the block count (`u64`), then
//! per block its valid count (`u64`) and word count (`u64`, `u64::MAX` when
//! every origin is valid) followed by the words.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;

use datafusion::execution::runtime_env::RuntimeEnv;

use md5::{Digest, Md5};

use super::cache_dir::CacheDir;
use super::geometry::WindowGrid;
use super::index::{BlockIndex, ValidIndex};
use super::sample::SampleLayout;
use super::sources::Sources;
use super::WindowError;
use crate::zarr::{cache_root, open_writable_remote, AllowedLocations, StoreLocation, ZarrArray};

const MAGIC: &[u8; 8] = b"ZFWINDEX";
const VERSION: u32 = 1;
const ALL_VALID: u64 = u64::MAX;

/// A directory (or object-store prefix) of persisted window indices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexCache {
    dir: CacheDir,
}

impl IndexCache {
    /// A cache in the local directory `dir` (created when the first index
    /// is stored).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: CacheDir::Local(dir.into()),
        }
    }

    /// A cache at `location`: a local directory, or an object-store URL
    /// (`s3://bucket/cache/`) reached through the client registered for
    /// its bucket (the one its stores were opened with), else one built
    /// from the environment. `allowed` holds it to the session's
    /// `zarrfusion.allowed_locations`. An object-store cache must be
    /// opened inside a Tokio runtime.
    pub fn open(
        location: &str,
        allowed: &AllowedLocations,
        runtime: &RuntimeEnv,
    ) -> Result<Self, WindowError> {
        let bad = |e: &dyn std::fmt::Display| WindowError::argument("cache", e);
        let resolved = StoreLocation::parse(location).map_err(|e| bad(&e))?;
        allowed.check(&resolved, location).map_err(|e| bad(&e))?;
        match resolved {
            StoreLocation::Local(dir) => Ok(Self::new(dir)),
            StoreLocation::Remote(url) => {
                let storage = open_writable_remote(location, &url, &HashMap::new(), runtime)
                    .map_err(|e| bad(&e))?;
                Ok(Self {
                    dir: CacheDir::Remote {
                        location: location.to_string(),
                        storage,
                    },
                })
            }
        }
    }

    /// The default cache: `$ZARRFUSION_CACHE_DIR/window-index`, else the
    /// user's cache directory (`~/.cache/zarrfusion/window-index` on Linux).
    pub fn default_location() -> Option<Self> {
        cache_root().map(|root| Self::new(root.join("window-index")))
    }

    /// Where the cache's files are.
    pub fn dir(&self) -> &CacheDir {
        &self.dir
    }

    /// The key of the index of the windows of `sources` over `grid` for
    /// samples of `layout` (its rules): a hex digest of everything the
    /// index depends on. Lists the variables' stored keys in local stores,
    /// reads their metadata objects' attributes in object stores; reads no
    /// chunk.
    pub fn key(
        sources: &Sources,
        grid: &WindowGrid,
        layout: &SampleLayout,
    ) -> Result<String, WindowError> {
        let mut digest = Md5::new();
        let text = format!(
            "zarrfusion window index {VERSION}\n{}\n{:?}\n",
            layout.rule(),
            grid.axes
        );
        digest.update(text.as_bytes());
        for (source, links) in sources.list.iter().zip(&sources.links) {
            digest.update(format!("{}\n{links:?}\n", source.table.store).as_bytes());
            let variables: Vec<&ZarrArray> = (source.variables.iter())
                .map(|&v| &*source.table.variables[v])
                .collect();
            ZarrArray::fingerprint_all(&variables, &mut digest)?;
        }
        for block in &grid.blocks {
            digest.update(format!("{:?} {:?}\n", block.origins, block.extent).as_bytes());
        }
        Ok(format!("{:x}", digest.finalize()))
    }

    /// The name of the file of the whole index stored under `key`.
    pub fn file_name(key: &str) -> String {
        format!("{key}.idx")
    }

    /// The index stored under `key`, when there is one that fits `grid`.
    pub fn load(&self, key: &str, grid: &WindowGrid) -> Option<ValidIndex> {
        let header = MAGIC.len() as u64 + 4 + 4 + key.len() as u64 + 8;
        let limit = (grid.blocks.iter()).fold(header, |n, b| {
            n.saturating_add(block_bytes(b.num_origins()))
        });
        let bytes = self.dir.read(&Self::file_name(key), limit)?;
        decode(&bytes, key, grid)
    }

    /// Stores `index` under `key`, whole.
    pub fn store(&self, key: &str, index: &ValidIndex) -> std::io::Result<()> {
        let mut bytes = Vec::new();
        encode(&mut bytes, key, index)?;
        self.dir.write(&Self::file_name(key), &bytes)
    }
}

fn encode(out: &mut impl Write, key: &str, index: &ValidIndex) -> std::io::Result<()> {
    out.write_all(MAGIC)?;
    out.write_all(&VERSION.to_le_bytes())?;
    out.write_all(&(key.len() as u32).to_le_bytes())?;
    out.write_all(key.as_bytes())?;
    out.write_all(&(index.blocks.len() as u64).to_le_bytes())?;
    for block in &index.blocks {
        encode_block(out, block)?;
    }
    Ok(())
}

/// The most bytes [`encode_block`] writes for a block of `origins` window
/// origins.
pub(super) fn block_bytes(origins: u64) -> u64 {
    origins.div_ceil(64).saturating_mul(8).saturating_add(16)
}

/// Writes one block's index: its valid count, then its word count
/// (`u64::MAX` when every origin is valid) and words.
pub(super) fn encode_block(out: &mut impl Write, block: &BlockIndex) -> std::io::Result<()> {
    out.write_all(&block.count.to_le_bytes())?;
    match block.bits() {
        None => out.write_all(&ALL_VALID.to_le_bytes())?,
        Some(words) => {
            out.write_all(&(words.len() as u64).to_le_bytes())?;
            for w in words {
                out.write_all(&w.to_le_bytes())?;
            }
        }
    }
    Ok(())
}

/// Reads little-endian words from a byte slice, failing past its end.
pub(super) struct Reader<'a>(pub(super) &'a [u8]);

impl Reader<'_> {
    pub(super) fn take(&mut self, n: usize) -> Option<&[u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    pub(super) fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    pub(super) fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}

fn decode(bytes: &[u8], key: &str, grid: &WindowGrid) -> Option<ValidIndex> {
    let mut r = Reader(bytes);
    if r.take(MAGIC.len())? != MAGIC || r.u32()? != VERSION {
        return None;
    }
    let key_len = r.u32()? as usize;
    if r.take(key_len)? != key.as_bytes() || r.u64()? != grid.blocks.len() as u64 {
        return None;
    }
    let mut blocks = Vec::with_capacity(grid.blocks.len());
    for block in &grid.blocks {
        blocks.push(decode_block(&mut r, block.num_origins())?);
    }
    r.0.is_empty().then(|| ValidIndex::from_blocks(blocks))
}

/// Reads one block's index ([`encode_block`]) of a block of `origins`
/// window origins; `None` when it does not fit them.
pub(super) fn decode_block(r: &mut Reader<'_>, origins: u64) -> Option<BlockIndex> {
    let count = r.u64()?;
    let words = r.u64()?;
    let index = if words == ALL_VALID {
        BlockIndex::all(origins)
    } else {
        if words != origins.div_ceil(64) {
            return None;
        }
        let bits = (0..words).map(|_| r.u64()).collect::<Option<Vec<u64>>>()?;
        BlockIndex::from_bits(bits)
    };
    // The count is stored to check the bits, and bits past the block's
    // origins must be clear.
    let tail_clear = index
        .bits()
        .and_then(|b| b.last())
        .is_none_or(|&w| origins.is_multiple_of(64) || w >> (origins % 64) == 0);
    (index.count == count && tail_clear).then_some(index)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::windows::geometry::WindowBlock;

    fn grid(blocks: &[u64]) -> WindowGrid {
        WindowGrid {
            axes: Vec::new(),
            blocks: blocks
                .iter()
                .map(|&n| WindowBlock {
                    origins: std::iter::once(0..n).collect(),
                    extent: std::iter::once(0..n).collect(),
                })
                .collect(),
        }
    }

    #[test]
    fn stored_index_loads_back_and_bad_files_are_misses() {
        let dir = std::env::temp_dir().join(format!("zf-index-cache-{}", std::process::id()));
        let cache = IndexCache::new(&dir);
        let grid = grid(&[100, 64, 7]);
        let index = ValidIndex::from_blocks(vec![
            BlockIndex::from_bits(vec![0xF0F0_F0F0_F0F0_F0F0, 0x0F]),
            BlockIndex::all(64),
            BlockIndex::from_bits(vec![0b101]),
        ]);
        assert!(cache.load("k1", &grid).is_none());
        cache.store("k1", &index).unwrap();
        assert_eq!(cache.load("k1", &grid), Some(index.clone()));
        // Another key, another grid, a truncated file: misses.
        assert!(cache.load("k2", &grid).is_none());
        assert!(cache.load("k1", &self::grid(&[100, 64])).is_none());
        assert!(cache.load("k1", &self::grid(&[100, 64, 8])).is_some());
        assert!(cache.load("k1", &self::grid(&[100, 64, 2])).is_none());
        let path = dir.join(IndexCache::file_name("k1"));
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
        assert!(cache.load("k1", &grid).is_none());
        let mut flipped = bytes.clone();
        let last = flipped.len() - 8;
        flipped[last] ^= 0x01;
        std::fs::write(&path, &flipped).unwrap();
        assert!(cache.load("k1", &grid).is_none());
        // A file far larger than the index of this grid (64 GiB, sparse)
        // is a miss, and is not read.
        std::fs::write(&path, &bytes).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(64 << 30)
            .unwrap();
        let started = std::time::Instant::now();
        assert!(cache.load("k1", &grid).is_none());
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        let leftovers: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

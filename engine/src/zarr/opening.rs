//! Opening a store from an object store in one round trip when it was
//! opened before.
//!
//! Opening a table reads objects one round trip after another: the group's
//! metadata, then the coordinates it names (to turn filters into chunk
//! ranges), and only then the chunks a query needs. At 100 ms a request,
//! the first two cost a fifth of a second before any chunk is asked for.
//!
//! [`Opening`] keeps the objects an opening read whole (metadata documents,
//! absent ones included, and coordinate chunks) with their ETags in an
//! [`OpeningCache`] on disk, and at the next opening of the same store asks
//! for all of them at once, each with `If-None-Match` on its ETag: an
//! object that did not change comes back `304 Not Modified` without its
//! bytes and is taken from the cache; one that changed comes back whole.
//! Every object is checked by the store in that one round, so what an
//! opening sees is what the store holds (as without the cache: objects
//! read one after another are not a snapshot either); only the round trips
//! are saved. Keys the store's new metadata no longer names are dropped
//! unread; keys it newly names are read as they would be without a cache.
//!
//! Only stores reached over the network (S3, GCS, Azure, HTTP) use it:
//! their ETags tell versions of an object apart, and an opening's identity
//! names the URL and endpoint, so one store's objects are never taken for
//! another's. An in-process store (`memory://`) has no round trip to save.
//!
//! The cache holds at most [`OPENING_CACHE_BYTES`] a store (what an
//! opening may hold at once); objects past it are not kept. A cache file
//! that is missing, truncated or for another store is a miss, never an
//! error; files are written to a temporary name and renamed. Turned off
//! with `SET zarrfusion.open_cache = false` (or the table option
//! `open_cache 'false'`).
//!
//! File layout (little-endian): the magic `ZFOPENED`, a format version
//! (`u32`), the store's identity (`u32` length and UTF-8), the object count
//! (`u32`), then per object its key (`u32` length and UTF-8), its ETag
//! (`u32` length and UTF-8; `u32::MAX` for an absent object, which has no
//! bytes) and its bytes (`u64` length and the bytes).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use md5::{Digest, Md5};
use zarrs::storage::{Bytes, StoreKey};

use super::remote::{OpenedObject, ReadAhead, RemoteStorage};

/// Most bytes of objects kept for one store.
pub const OPENING_CACHE_BYTES: u64 = 64 << 20;

/// Most bytes of all the stores' files in a cache directory: past it, the
/// files used longest ago are removed.
pub const OPENING_CACHE_DIR_BYTES: u64 = 1 << 30;

/// Most requests an opening keeps in flight at once.
const OPENING_CONCURRENCY: usize = 64;

const MAGIC: &[u8; 8] = b"ZFOPENED";
const VERSION: u32 = 1;
const ABSENT: u32 = u32::MAX;

/// zarrfusion's cache directory: `$ZARRFUSION_CACHE_DIR`, else the user's
/// cache directory's `zarrfusion` (`~/.cache/zarrfusion` on Linux).
pub fn cache_root() -> Option<PathBuf> {
    std::env::var_os("ZARRFUSION_CACHE_DIR")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| dirs::cache_dir().map(|d| d.join("zarrfusion")))
}

/// Writes `bytes` to the file `target`: to a temporary file beside it
/// first, synced, then renamed, so a reader never sees half a file (the
/// caches kept between runs).
pub fn write_file_atomically(target: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let name = target.file_name().map(|n| n.to_string_lossy().into_owned());
    let temporary = target.with_file_name(format!(
        ".{}.{}.tmp",
        name.unwrap_or_default(),
        std::process::id()
    ));
    let written = std::fs::File::create(&temporary).and_then(|mut file| {
        file.write_all(bytes)?;
        file.sync_all()
    });
    match written.and_then(|()| std::fs::rename(&temporary, target)) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = std::fs::remove_file(&temporary);
            Err(e)
        }
    }
}

/// A directory of the objects read when stores were opened, a file per
/// store (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpeningCache {
    dir: PathBuf,
}

/// The objects of one store as a cache file holds them.
type Remembered = Vec<(StoreKey, OpenedObject)>;

impl OpeningCache {
    /// A cache in `dir` (created when the first store is kept).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// The default cache: `opening` in [`cache_root`].
    pub fn default_location() -> Option<Self> {
        cache_root().map(|root| Self::new(root.join("opening")))
    }

    /// The cache's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn file(&self, identity: &str) -> PathBuf {
        let digest = Md5::digest(identity.as_bytes());
        let name: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        self.dir.join(name)
    }

    /// The objects kept for the store `identity`; empty when none are (or
    /// the file cannot be read or is not this store's).
    /// A file read is marked as used now (see `OPENING_CACHE_DIR_BYTES`).
    pub fn load(&self, identity: &str) -> Remembered {
        let file = self.file(identity);
        let Some(objects) = std::fs::read(&file)
            .ok()
            .and_then(|data| parse(&data, identity))
        else {
            return Vec::new();
        };
        if let Ok(opened) = std::fs::File::options().append(true).open(&file) {
            let _ = opened.set_modified(std::time::SystemTime::now());
        }
        objects
    }

    /// Keeps `objects` for the store `identity`, replacing what was kept.
    pub fn save(
        &self,
        identity: &str,
        objects: &[(StoreKey, OpenedObject)],
    ) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        write_file_atomically(&self.file(identity), &serialize(identity, objects))?;
        self.sweep(OPENING_CACHE_DIR_BYTES);
        Ok(())
    }

    /// Removes the files used longest ago until those left hold at most
    /// `limit` bytes.
    fn sweep(&self, limit: u64) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let mut files: Vec<(std::time::SystemTime, u64, PathBuf)> = entries
            .flatten()
            .filter_map(|entry| {
                let meta = entry.metadata().ok()?;
                meta.is_file()
                    .then(|| Some((meta.modified().ok()?, meta.len(), entry.path())))
                    .flatten()
            })
            .collect();
        let mut total: u64 = files.iter().map(|(_, len, _)| len).sum();
        files.sort();
        for (_, len, path) in files {
            if total <= limit {
                break;
            }
            if std::fs::remove_file(&path).is_ok() {
                total -= len;
            }
        }
    }
}

fn put_text(out: &mut Vec<u8>, text: &str) {
    out.extend_from_slice(&(text.len() as u32).to_le_bytes());
    out.extend_from_slice(text.as_bytes());
}

fn serialize(identity: &str, objects: &[(StoreKey, OpenedObject)]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    put_text(&mut out, identity);
    out.extend_from_slice(&(objects.len() as u32).to_le_bytes());
    for (key, object) in objects {
        put_text(&mut out, key.as_str());
        match object {
            OpenedObject::Present { etag, bytes } => {
                put_text(&mut out, etag);
                out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
                out.extend_from_slice(bytes);
            }
            OpenedObject::Absent => out.extend_from_slice(&ABSENT.to_le_bytes()),
        }
    }
    out
}

/// Reads a cache file; `None` when it is damaged or another store's.
/// Every length is checked against what is left before it is used.
fn parse(data: &[u8], identity: &str) -> Option<Remembered> {
    let mut reader = Reader(data);
    if reader.take(MAGIC.len())? != MAGIC || reader.u32()? != VERSION {
        return None;
    }
    if reader.text()? != identity {
        return None;
    }
    let count = reader.u32()?;
    let mut objects = Vec::new();
    for _ in 0..count {
        let key = StoreKey::new(reader.text()?).ok()?;
        let etag_len = reader.u32()?;
        let object = if etag_len == ABSENT {
            OpenedObject::Absent
        } else {
            let etag = std::str::from_utf8(reader.take(etag_len as usize)?).ok()?;
            let len = usize::try_from(reader.u64()?).ok()?;
            OpenedObject::Present {
                etag: etag.to_string(),
                bytes: Bytes::copy_from_slice(reader.take(len)?),
            }
        };
        objects.push((key, object));
    }
    reader.0.is_empty().then_some(objects)
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, len: usize) -> Option<&'a [u8]> {
        if len > self.0.len() {
            return None;
        }
        let (head, rest) = self.0.split_at(len);
        self.0 = rest;
        Some(head)
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }

    fn text(&mut self) -> Option<&'a str> {
        let len = self.u32()? as usize;
        std::str::from_utf8(self.take(len)?).ok()
    }
}

/// What identifies a cache's version of an object: key and ETag.
fn versions(objects: &Remembered) -> Vec<(&StoreKey, Option<&str>)> {
    objects
        .iter()
        .map(|(key, object)| match object {
            OpenedObject::Present { etag, .. } => (key, Some(etag.as_str())),
            OpenedObject::Absent => (key, None),
        })
        .collect()
}

/// An opening of a remote store under way (see the module docs): from
/// [`start`](Self::start) to [`finish`](Self::finish), the storage records
/// what is read, and the objects the cache remembers are requested at once,
/// each only if it changed. Dropped without `finish` (the opening failed),
/// nothing is kept.
pub struct Opening {
    storage: Arc<RemoteStorage>,
    cache: Option<OpeningCache>,
    remembered: Vec<(StoreKey, Option<String>)>,
    _window: ReadAhead,
}

impl Opening {
    /// Starts opening `storage`: with a `cache`, the objects it kept for
    /// this store are requested at once (conditionally); without one, or
    /// when it kept none, `first_keys` are (the metadata documents an
    /// opening reads first).
    pub fn start(
        storage: Arc<RemoteStorage>,
        cache: Option<OpeningCache>,
        first_keys: Vec<StoreKey>,
    ) -> Self {
        let remembered = cache
            .as_ref()
            .map(|c| c.load(storage.identity()))
            .unwrap_or_default();
        let keys: Vec<StoreKey> = match remembered.is_empty() {
            true => first_keys,
            false => remembered.iter().map(|(key, _)| key.clone()).collect(),
        };
        let known = remembered
            .iter()
            .filter_map(|(key, object)| match object {
                OpenedObject::Present { etag, bytes } => {
                    Some((key.clone(), etag.clone(), bytes.clone()))
                }
                OpenedObject::Absent => None,
            })
            .collect();
        if cache.is_some() {
            storage.begin_opening(known, OPENING_CACHE_BYTES);
        }
        let versions = versions(&remembered)
            .into_iter()
            .map(|(key, etag)| (key.clone(), etag.map(str::to_string)))
            .collect();
        let depth = keys.len();
        let upcoming = Box::new(keys.into_iter().map(|key| (0, key)));
        let window = ReadAhead::new(
            Arc::clone(&storage),
            upcoming,
            depth,
            depth.min(OPENING_CONCURRENCY),
            super::RangedReads::Take,
        );
        Self {
            storage,
            cache,
            remembered: versions,
            _window: window,
        }
    }

    /// The opening succeeded: what it read is kept for the next one (when
    /// it differs from what was kept). A cache that cannot be written is
    /// left as it was (the next opening reads as if it had none).
    pub fn finish(self) {
        let read = self.storage.end_opening();
        let Some(cache) = &self.cache else {
            return;
        };
        let changed = versions(&read)
            .into_iter()
            .ne(self.remembered.iter().map(|(k, e)| (k, e.as_deref())));
        if changed && !read.is_empty() {
            let _ = cache.save(self.storage.identity(), &read);
        }
    }
}

impl Drop for Opening {
    fn drop(&mut self) {
        // Nothing is recorded any more (a no-op after `finish`).
        self.storage.end_opening();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::memory::InMemory;
    use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
    use std::sync::atomic::Ordering;
    use zarrs::storage::ReadableStorageTraits;

    /// An empty directory of its own for a test, removed when dropped.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("zf-opening-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }

        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn key(name: &str) -> StoreKey {
        StoreKey::new(name).unwrap()
    }

    fn put(runtime: &tokio::runtime::Runtime, store: &InMemory, name: &str, data: &[u8]) {
        runtime
            .block_on(store.put(&name.into(), PutPayload::from(data.to_vec())))
            .unwrap();
    }

    /// Opens `store` as an opening does: reads `names` one after another.
    fn open(
        runtime: &tokio::runtime::Runtime,
        store: &Arc<InMemory>,
        cache: &OpeningCache,
        names: &[&str],
    ) -> (Vec<Option<Vec<u8>>>, Arc<RemoteStorage>) {
        let storage = Arc::new(
            RemoteStorage::new(
                Arc::clone(store) as Arc<dyn ObjectStore>,
                runtime.handle().clone(),
            )
            .with_identity("memory://test".to_string()),
        );
        let opening = Opening::start(
            Arc::clone(&storage),
            Some(cache.clone()),
            vec![key("zarr.json"), key(".zmetadata")],
        );
        let read = names
            .iter()
            .map(|name| storage.get(&key(name)).unwrap().map(|b| b.to_vec()))
            .collect();
        opening.finish();
        (read, storage)
    }

    #[test]
    fn a_second_opening_asks_for_every_object_at_once_and_takes_the_unchanged_from_the_cache() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let store = Arc::new(InMemory::new());
        put(&runtime, &store, ".zmetadata", b"{\"metadata\": {}}");
        put(&runtime, &store, "lat/0", b"latitudes");
        put(&runtime, &store, "lon/0", b"longitudes");
        let dir = TempDir::new("second");
        let cache = OpeningCache::new(dir.path());
        let names = ["zarr.json", ".zmetadata", "lat/0", "lon/0"];

        let (first, storage) = open(&runtime, &store, &cache, &names);
        assert_eq!(first[0], None);
        assert_eq!(first[2].as_deref(), Some(&b"latitudes"[..]));
        let counters = storage.counters().totals();
        assert_eq!((counters.requests, counters.unchanged), (4, 0));
        // Only the two metadata documents were read ahead; the coordinates
        // were read on demand.
        assert_eq!(counters.read_ahead_requests, 2);

        // A coordinate changes between the openings.
        put(&runtime, &store, "lon/0", b"new longitudes");
        let (second, storage) = open(&runtime, &store, &cache, &names);
        assert_eq!(second[2].as_deref(), Some(&b"latitudes"[..]));
        assert_eq!(second[3].as_deref(), Some(&b"new longitudes"[..]));
        assert_eq!(second[0], None);
        let counters = storage.counters().totals();
        // All four requested ahead at once; two unchanged, the changed one
        // read again, the absent one asked again.
        assert_eq!(counters.read_ahead_requests, 4);
        assert_eq!(counters.read_ahead_misses, 0);
        assert_eq!(counters.requests, 4);
        assert_eq!(counters.unchanged, 2);
        assert_eq!(counters.bytes, b"new longitudes".len() as u64);

        // The cache now holds the new version: a third opening reads no byte.
        let (third, storage) = open(&runtime, &store, &cache, &names);
        assert_eq!(third, second);
        let counters = storage.counters().totals();
        assert_eq!((counters.unchanged, counters.bytes), (3, 0));

        // An object deleted since is read as absent, not from the cache.
        runtime.block_on(store.delete(&"lat/0".into())).unwrap();
        let (fourth, _) = open(&runtime, &store, &cache, &names);
        assert_eq!(fourth[2], None);
        assert_eq!(fourth[3], third[3]);
    }

    #[test]
    fn a_damaged_or_foreign_cache_file_is_a_miss() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let store = Arc::new(InMemory::new());
        put(&runtime, &store, ".zmetadata", b"{}");
        let dir = TempDir::new("damaged");
        let cache = OpeningCache::new(dir.path());
        let objects = vec![
            (key("zarr.json"), OpenedObject::Absent),
            (
                key(".zmetadata"),
                OpenedObject::Present {
                    etag: "e1".to_string(),
                    bytes: Bytes::from_static(b"{}"),
                },
            ),
        ];
        cache.save("store a", &objects).unwrap();
        assert_eq!(cache.load("store a"), objects);
        assert!(cache.load("store b").is_empty());
        let file = cache.file("store a");
        let data = std::fs::read(&file).unwrap();
        for cut in [0, 7, 12, data.len() - 1] {
            std::fs::write(&file, &data[..cut]).unwrap();
            assert!(cache.load("store a").is_empty(), "cut at {cut}");
        }
        // A length far past the file's end is refused before anything is
        // allocated for it.
        let mut huge = data.clone();
        let at = data.len() - 2 - 8;
        huge[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        std::fs::write(&file, &huge).unwrap();
        assert!(cache.load("store a").is_empty());
        // An opening over a damaged file reads as if there were no cache.
        std::fs::write(&file, b"ZFOPENED garbage").unwrap();
        let storage = Arc::new(
            RemoteStorage::new(
                Arc::clone(&store) as Arc<dyn ObjectStore>,
                runtime.handle().clone(),
            )
            .with_identity("store a".to_string()),
        );
        let opening = Opening::start(
            Arc::clone(&storage),
            Some(cache.clone()),
            vec![key(".zmetadata")],
        );
        assert_eq!(
            storage.get(&key(".zmetadata")).unwrap().unwrap().as_ref(),
            b"{}"
        );
        opening.finish();
        assert_eq!(storage.counters().unchanged.load(Ordering::Relaxed), 0);
        assert_eq!(cache.load("store a").len(), 1);
    }

    #[test]
    fn the_files_used_longest_ago_are_removed_past_the_directory_limit() {
        let dir = TempDir::new("sweep");
        let cache = OpeningCache::new(dir.path());
        let object = |n: u8| {
            vec![(
                key("zarr.json"),
                OpenedObject::Present {
                    etag: n.to_string(),
                    bytes: Bytes::from(vec![n; 1000]),
                },
            )]
        };
        for store in ["a", "b", "c"] {
            cache.save(store, &object(1)).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        // "a" is used again: "b" is now the one used longest ago.
        assert_eq!(cache.load("a"), object(1));
        let size = std::fs::metadata(cache.file("a")).unwrap().len();
        cache.sweep(2 * size);
        assert_eq!(cache.load("a"), object(1));
        assert!(cache.load("b").is_empty());
        assert_eq!(cache.load("c"), object(1));
    }
}

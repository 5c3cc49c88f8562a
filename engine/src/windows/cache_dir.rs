//! Where the window cache's files live: a directory on this machine, or a
//! prefix in an object store that the ranks of a job on several machines
//! share.
//!
//! [`super::IndexCache`] keeps the finished index and the statistics there,
//! and [`super::shared`] the blocks of an index being built, as files named
//! relative to that root (`<key>.idx`, `<key>.blocks/<id>.block`). The two
//! kinds differ only in how a file is written whole:
//!
//! - in a directory, a file is written to a temporary name and renamed, and
//!   a file that must be created once (a claim) is written beside its name
//!   and hard-linked to it, which fails when it exists;
//! - in an object store, a `PUT` is atomic, and a file that must be created
//!   once is put conditionally (`If-None-Match: *`), which the server
//!   refuses when the object exists.
//!
//! Reads that fail are misses: the cache is an optimization, never the
//! reason a loader fails.

use std::io::{ErrorKind, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use zarrs::storage::{ReadableStorageTraits, StoreKey, StorePrefix, WritableStorageTraits};

use crate::write::stamp::{sweep, unique_suffix, Leftover};
use crate::zarr::{write_file_atomically, RemoteStorage};

/// The root the cache's files are named under.
#[derive(Clone)]
pub enum CacheDir {
    /// A directory on this machine (created when the first file is
    /// written).
    Local(PathBuf),
    /// A prefix in an object store.
    Remote {
        /// The URL, as the user wrote it.
        location: String,
        /// The object store, rooted at the prefix.
        storage: Arc<RemoteStorage>,
    },
}

impl PartialEq for CacheDir {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Local(a), Self::Local(b)) => a == b,
            (Self::Remote { location: a, .. }, Self::Remote { location: b, .. }) => a == b,
            _ => false,
        }
    }
}

impl Eq for CacheDir {}

impl std::fmt::Debug for CacheDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CacheDir({self})")
    }
}

impl std::fmt::Display for CacheDir {
    /// The directory, or the URL.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Local(dir) => write!(f, "{}", dir.display()),
            Self::Remote { location, .. } => write!(f, "{location}"),
        }
    }
}

impl CacheDir {
    /// Whether the files are in an object store (shared by machines).
    pub fn is_remote(&self) -> bool {
        matches!(self, Self::Remote { .. })
    }

    /// The file `name` (a path relative to the root, `/`-separated) in a
    /// directory cache.
    fn path(dir: &Path, name: &str) -> PathBuf {
        dir.join(name)
    }

    fn key(name: &str) -> std::io::Result<StoreKey> {
        StoreKey::new(name).map_err(|e| std::io::Error::new(ErrorKind::InvalidInput, e))
    }

    /// The bytes of the file `name`, of at most `limit` bytes; `None` when
    /// it is absent, larger (nothing of it is read) or cannot be read.
    pub fn read(&self, name: &str, limit: u64) -> Option<Vec<u8>> {
        match self {
            Self::Local(dir) => {
                let read = || -> std::io::Result<Option<Vec<u8>>> {
                    let file = std::fs::File::open(Self::path(dir, name))?;
                    if file.metadata()?.len() > limit {
                        return Ok(None);
                    }
                    let mut bytes = Vec::new();
                    // It may have grown since.
                    file.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
                    Ok((bytes.len() as u64 <= limit).then_some(bytes))
                };
                match read() {
                    Ok(Some(bytes)) => Some(bytes),
                    Ok(None) => {
                        log::warn!("cache file {name} in {self} is over {limit} bytes: not read");
                        None
                    }
                    Err(_) => None,
                }
            }
            Self::Remote { .. } => self
                .read_all(&[(name.to_string(), limit)])
                .into_iter()
                .next()
                .flatten(),
        }
    }

    /// The bytes of each of the files `(name, limit)`, as [`Self::read`]
    /// gives them; in an object store all requested at once.
    pub fn read_all(&self, names: &[(String, u64)]) -> Vec<Option<Vec<u8>>> {
        let Self::Remote { storage, .. } = self else {
            return names
                .iter()
                .map(|(name, limit)| self.read(name, *limit))
                .collect();
        };
        let keys: Vec<Option<(StoreKey, u64)>> = (names.iter())
            .map(|(name, limit)| Some((Self::key(name).ok()?, *limit)))
            .collect();
        let valid: Vec<(StoreKey, u64)> = keys.iter().flatten().cloned().collect();
        let mut answers = storage.get_all(&valid).into_iter();
        keys.iter()
            .zip(names)
            .map(|(key, (name, _))| {
                key.as_ref()?;
                match answers.next()? {
                    Ok(bytes) => bytes.map(|b| b.to_vec()),
                    Err(e) => {
                        log::debug!("cache file {name} not read from {self}: {e}");
                        None
                    }
                }
            })
            .collect()
    }

    /// Whether the file `name` is there (`false` when that cannot be told).
    pub fn contains(&self, name: &str) -> bool {
        match self {
            Self::Local(dir) => Self::path(dir, name).exists(),
            Self::Remote { storage, .. } => Self::key(name)
                .ok()
                .and_then(|key| storage.size_key(&key).ok())
                .is_some_and(|size| size.is_some()),
        }
    }

    /// Writes the file `name` whole: a reader sees the old file or the new
    /// one, never half of one. In a directory, the root is made when it is
    /// not there, a directory below it never ([`Self::make_dir`]): a file
    /// is not written into a directory removed meanwhile.
    pub fn write(&self, name: &str, bytes: &[u8]) -> std::io::Result<()> {
        match self {
            Self::Local(dir) => {
                std::fs::create_dir_all(dir)?;
                write_file_atomically(&Self::path(dir, name), bytes)
            }
            Self::Remote { storage, .. } => storage
                .set(&Self::key(name)?, bytes.to_vec().into())
                .map_err(std::io::Error::other),
        }
    }

    /// Creates the file `name` whole if it is not there: an error of kind
    /// [`ErrorKind::AlreadyExists`] when it is, so of processes creating
    /// it at once exactly one succeeds.
    pub fn create_new(&self, name: &str, bytes: &[u8]) -> std::io::Result<()> {
        match self {
            Self::Local(dir) => {
                let path = Self::path(dir, name);
                let temporary = dir.join(format!("{name}.{}.tmp", unique_suffix()));
                std::fs::write(&temporary, bytes)?;
                let linked = std::fs::hard_link(&temporary, &path);
                let _ = std::fs::remove_file(&temporary);
                linked
            }
            Self::Remote { storage, .. } => {
                match storage.put_if_absent(&Self::key(name)?, bytes.to_vec().into()) {
                    Ok(true) => Ok(()),
                    Ok(false) => Err(ErrorKind::AlreadyExists.into()),
                    Err(e) => Err(std::io::Error::other(e)),
                }
            }
        }
    }

    /// How long ago the file `name` was last written, where the file
    /// system says (`None` in an object store: what needs an age there
    /// records its time in the file).
    pub fn age(&self, name: &str) -> Option<Duration> {
        match self {
            Self::Local(dir) => std::fs::metadata(Self::path(dir, name))
                .and_then(|m| m.modified())
                .ok()
                .and_then(|at| at.elapsed().ok()),
            Self::Remote { .. } => None,
        }
    }

    /// Removes the file `name` (errors only logged).
    pub fn remove(&self, name: &str) {
        let removed = match self {
            Self::Local(dir) => std::fs::remove_file(Self::path(dir, name)),
            Self::Remote { storage, .. } => {
                Self::key(name).and_then(|key| storage.erase(&key).map_err(std::io::Error::other))
            }
        };
        if let Err(e) = removed {
            if e.kind() != ErrorKind::NotFound {
                log::debug!("cache file {name} not removed from {self}: {e}");
            }
        }
    }

    /// Makes the directory `name` for files below it (nothing to make in
    /// an object store).
    pub fn make_dir(&self, name: &str) -> std::io::Result<()> {
        match self {
            Self::Local(dir) => std::fs::create_dir_all(Self::path(dir, name)),
            Self::Remote { .. } => Ok(()),
        }
    }

    /// Whether the directory `name` is there (in an object store, where
    /// directories are only prefixes: always).
    pub fn has_dir(&self, name: &str) -> bool {
        match self {
            Self::Local(dir) => Self::path(dir, name).is_dir(),
            Self::Remote { .. } => true,
        }
    }

    /// Removes the directory `name` and every file below it (errors only
    /// logged). In a directory it goes at once: it is renamed first (to a
    /// temporary name, [`Leftover::TemporaryTarget`]), so nobody finds
    /// part of its files gone, or creates a file in it meanwhile; what a
    /// removal cut short by a killed process left is swept.
    pub fn remove_dir(&self, name: &str) {
        let removed = match self {
            Self::Local(dir) => {
                let path = Self::path(dir, name);
                let leaf = path.file_name().map(|n| n.to_string_lossy().into_owned());
                let parent = path.parent().unwrap_or(dir);
                let gone = parent.join(format!(
                    ".{}.{}.zarrfusion-tmp",
                    leaf.unwrap_or_default(),
                    unique_suffix()
                ));
                let removed =
                    std::fs::rename(&path, &gone).and_then(|()| std::fs::remove_dir_all(&gone));
                sweep(parent, Leftover::TemporaryTarget);
                removed
            }
            Self::Remote { storage, .. } => StorePrefix::new(format!("{name}/"))
                .map_err(|e| std::io::Error::new(ErrorKind::InvalidInput, e))
                .and_then(|prefix| storage.erase_prefix(&prefix).map_err(std::io::Error::other)),
        };
        if let Err(e) = removed {
            if e.kind() != ErrorKind::NotFound {
                log::debug!("cache directory {name} not removed from {self}: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use object_store::memory::InMemory;

    use super::*;

    /// A file over the size its reader expects is not read, in a
    /// directory and in an object store (a real `object_store` in memory).
    fn files_over_their_limit_are_not_read_in(cache: &CacheDir) {
        cache.write("a/f", &[7u8; 100]).unwrap();
        assert_eq!(cache.read("a/f", 100), Some(vec![7u8; 100]));
        assert_eq!(cache.read("a/f", 99), None);
        assert_eq!(cache.read("a/missing", 99), None);
        let names = [
            ("a/f".to_string(), 100),
            ("a/f".to_string(), 10),
            ("a/g".to_string(), 10),
        ];
        assert_eq!(cache.read_all(&names), [Some(vec![7u8; 100]), None, None]);
    }

    #[test]
    fn a_removed_directory_takes_no_more_files_and_leaves_nothing() {
        let dir = std::env::temp_dir().join(format!("zf-cache-dir-rm-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cache = CacheDir::Local(dir.clone());
        cache.make_dir("d").unwrap();
        cache.write("d/f", b"x").unwrap();
        // What a removal of a process that is gone left, half done.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        let host = crate::write::stamp::host().unwrap();
        let leftover = dir.join(format!(".d.{gone}-1-{host}.zarrfusion-tmp"));
        std::fs::create_dir_all(&leftover).unwrap();
        std::fs::write(leftover.join("g"), b"y").unwrap();
        cache.remove_dir("d");
        assert!(!cache.has_dir("d"));
        // A file written after is not written (its directory is not made
        // again), a file at the root is.
        let late = cache.write("d/h", b"z").unwrap_err();
        assert_eq!(late.kind(), ErrorKind::NotFound);
        cache.write("i", b"w").unwrap();
        let names: Vec<String> = (std::fs::read_dir(&dir).unwrap())
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["i"]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn files_over_their_limit_are_not_read() {
        let dir = std::env::temp_dir().join(format!("zf-cache-dir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("a")).unwrap();
        files_over_their_limit_are_not_read_in(&CacheDir::Local(dir.clone()));
        let _ = std::fs::remove_dir_all(&dir);
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let storage = RemoteStorage::new(Arc::new(InMemory::new()), runtime.handle().clone());
        files_over_their_limit_are_not_read_in(&CacheDir::Remote {
            location: "memory://cache".into(),
            storage: Arc::new(storage),
        });
    }
}

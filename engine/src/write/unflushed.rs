//! Local scratch stores that leave their writes to the page cache.
//!
//! zarrs' `FilesystemStore` flushes every value it writes to disk
//! (`fsync`) before returning: right for a store that must survive a crash,
//! wasted on a scratch store (a rechunk's intermediate arrays, the FFT's
//! passes and stages, a chain's stored transform), erased when its
//! operation ends and useless after a crash, which fails the operation
//! anyway. Flushed, a chain of two transforms of the climate fixture under
//! a 64 KB `allowed_mem` (some 16,000 chunks of a few bytes) took 18.5 s,
//! 1.2 s in memory (tmpfs); large intermediates were forced onto the disk
//! that the page cache would have held until they were read and erased.
//!
//! [`UnflushedStore`] reads, lists and erases through a `FilesystemStore`
//! and writes the files itself, without the flush. A value is written whole
//! into a fresh file renamed into place (a reader sees the old file or the
//! new one); partial writes go into the file in place, as the filesystem
//! store's do.

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;
use std::sync::Arc;

use zarrs::filesystem::FilesystemStore;
use zarrs::storage::byte_range::ByteRangeIterator;
use zarrs::storage::{
    Bytes, ListableStorageTraits, MaybeBytesIterator, OffsetBytesIterator, ReadableStorageTraits,
    ReadableWritableListableStorage, StorageError, StoreKey, StoreKeys, StoreKeysPrefixes,
    StorePrefix, WritableStorageTraits,
};

use crate::error::ZarrFusionError;
use crate::write::stamp::unique_suffix;

/// A local store whose writes are not flushed to disk (see the
/// [module docs](self)).
#[derive(Debug)]
pub struct UnflushedStore {
    inner: FilesystemStore,
}

/// The scratch store in directory `path` (created with its parents),
/// `display` naming it in errors.
pub fn unflushed_storage(
    display: &str,
    path: &Path,
) -> Result<ReadableWritableListableStorage, ZarrFusionError> {
    std::fs::create_dir_all(path).map_err(|e| ZarrFusionError::store(display, e))?;
    let inner = FilesystemStore::new(path).map_err(|e| ZarrFusionError::store(display, e))?;
    Ok(Arc::new(UnflushedStore { inner }))
}

impl UnflushedStore {
    /// The file of `key`, its directory created.
    fn file_path(&self, key: &StoreKey) -> Result<std::path::PathBuf, StorageError> {
        let path = self.inner.key_to_fspath(key);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        Ok(path)
    }
}

impl ReadableStorageTraits for UnflushedStore {
    fn get_partial_many<'a>(
        &'a self,
        key: &StoreKey,
        byte_ranges: ByteRangeIterator<'a>,
    ) -> Result<MaybeBytesIterator<'a>, StorageError> {
        self.inner.get_partial_many(key, byte_ranges)
    }

    fn size_key(&self, key: &StoreKey) -> Result<Option<u64>, StorageError> {
        self.inner.size_key(key)
    }

    fn supports_get_partial(&self) -> bool {
        self.inner.supports_get_partial()
    }
}

impl ListableStorageTraits for UnflushedStore {
    fn list(&self) -> Result<StoreKeys, StorageError> {
        self.inner.list()
    }

    fn list_prefix(&self, prefix: &StorePrefix) -> Result<StoreKeys, StorageError> {
        self.inner.list_prefix(prefix)
    }

    fn list_dir(&self, prefix: &StorePrefix) -> Result<StoreKeysPrefixes, StorageError> {
        self.inner.list_dir(prefix)
    }

    fn size_prefix(&self, prefix: &StorePrefix) -> Result<u64, StorageError> {
        self.inner.size_prefix(prefix)
    }
}

impl WritableStorageTraits for UnflushedStore {
    fn set(&self, key: &StoreKey, value: Bytes) -> Result<(), StorageError> {
        let path = self.file_path(key)?;
        let mut fresh = path.clone().into_os_string();
        fresh.push(format!(".{}.part", unique_suffix()));
        let written = File::create(&fresh)
            .and_then(|mut file| file.write_all(&value))
            .and_then(|()| std::fs::rename(&fresh, &path));
        if written.is_err() {
            let _ = std::fs::remove_file(&fresh);
        }
        Ok(written?)
    }

    fn set_partial_many(
        &self,
        key: &StoreKey,
        offset_values: OffsetBytesIterator,
    ) -> Result<(), StorageError> {
        let path = self.file_path(key)?;
        let mut file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        for (offset, value) in offset_values {
            file.seek(SeekFrom::Start(offset))?;
            file.write_all(&value)?;
        }
        Ok(())
    }

    fn erase(&self, key: &StoreKey) -> Result<(), StorageError> {
        self.inner.erase(key)
    }

    fn erase_prefix(&self, prefix: &StorePrefix) -> Result<(), StorageError> {
        self.inner.erase_prefix(prefix)
    }

    fn supports_set_partial(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_written_whole_and_in_part_read_back_and_erase() {
        let dir = std::env::temp_dir().join(format!("zf-unflushed-{}", unique_suffix()));
        let store = unflushed_storage("scratch", &dir).unwrap();
        let key = StoreKey::new("a/c/0/1").unwrap();
        store.set(&key, Bytes::from_static(b"0123456789")).unwrap();
        assert_eq!(store.get(&key).unwrap().unwrap().as_ref(), b"0123456789");
        // Replaced whole; no temporary file left beside it.
        store.set(&key, Bytes::from_static(b"abc")).unwrap();
        assert_eq!(store.get(&key).unwrap().unwrap().as_ref(), b"abc");
        let beside: Vec<_> = std::fs::read_dir(dir.join("a/c/0")).unwrap().collect();
        assert_eq!(beside.len(), 1);
        // In part: in place, growing the file, a new file from nothing.
        let parts = vec![
            (1, Bytes::from_static(b"XY")),
            (5, Bytes::from_static(b"Z")),
        ];
        store
            .set_partial_many(&key, Box::new(parts.into_iter()))
            .unwrap();
        assert_eq!(store.get(&key).unwrap().unwrap().as_ref(), b"aXY\0\0Z");
        let other = StoreKey::new("b/c/0").unwrap();
        store
            .set_partial(&other, 2, Bytes::from_static(b"q"))
            .unwrap();
        assert_eq!(store.get(&other).unwrap().unwrap().as_ref(), b"\0\0q");
        assert_eq!(store.list().unwrap().len(), 2);
        store.erase(&key).unwrap();
        assert!(store.get(&key).unwrap().is_none());
        store
            .erase_prefix(&StorePrefix::new("b/").unwrap())
            .unwrap();
        assert!(store.list().unwrap().is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

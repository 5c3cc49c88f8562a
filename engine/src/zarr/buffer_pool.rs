//! Reusable buffers for chunk bytes read straight from files.
//!
//! Reading a 150 MB chunk into a fresh allocation costs more than the copy
//! itself: the allocator hands large blocks back to the operating system
//! when they are freed, so each new one is mapped and zeroed page by page
//! again. A [`ChunkBufferPool`] keeps the buffers of one query: an Arrow
//! [`Buffer`] taken from it returns its allocation to the pool when the last
//! array using it is dropped, and the next chunk is read into it.
//!
//! The pool never holds more buffers than were in use at once, so it adds
//! nothing to the memory the query's operators already account for, and
//! everything it holds is freed with the query (the pool's last handle).

use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

use datafusion::arrow::buffer::Buffer;

/// Free buffers of one query (8-byte words, so every numeric type is
/// aligned). Cloning shares the pool.
#[derive(Clone, Default, Debug)]
pub struct ChunkBufferPool {
    free: Arc<Mutex<Vec<Vec<u64>>>>,
}

impl ChunkBufferPool {
    /// An empty pool.
    pub fn new() -> Self {
        Self::default()
    }

    /// A buffer of at least `bytes` bytes: the smallest free one that is
    /// large enough, else a new one. When none is large enough, one free
    /// buffer is dropped first, so that the pool never grows past the
    /// number of buffers in use at once.
    pub fn take(&self, bytes: usize) -> PooledBytes {
        let words = bytes.div_ceil(8);
        let reused = self.free.lock().ok().and_then(|mut free| {
            let best = free
                .iter()
                .enumerate()
                .filter(|(_, w)| w.len() >= words)
                .min_by_key(|(_, w)| w.len())
                .map(|(i, _)| i);
            match best {
                Some(i) => Some(free.swap_remove(i)),
                None => {
                    free.pop();
                    None
                }
            }
        });
        PooledBytes {
            words: reused.unwrap_or_else(|| vec![0; words]),
            bytes,
            home: Arc::downgrade(&self.free),
        }
    }

    /// Number of free buffers (for tests).
    #[cfg(test)]
    fn free_buffers(&self) -> usize {
        self.free.lock().map_or(0, |f| f.len())
    }
}

/// A buffer taken from a [`ChunkBufferPool`], to fill and then turn into an
/// Arrow [`Buffer`]. Dropped unused, it goes back to the pool.
#[derive(Debug)]
pub struct PooledBytes {
    words: Vec<u64>,
    bytes: usize,
    home: Weak<Mutex<Vec<Vec<u64>>>>,
}

impl PooledBytes {
    /// The buffer's bytes, to fill.
    pub fn as_mut_bytes(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[..self.bytes]
    }

    /// The buffer as `f64`s (as many as its bytes hold), to fill.
    pub fn as_mut_f64s(&mut self) -> &mut [f64] {
        &mut bytemuck::cast_slice_mut::<u64, f64>(&mut self.words)[..self.bytes / 8]
    }

    /// The bytes as an Arrow buffer, which returns the allocation to the
    /// pool when its last reference is dropped.
    pub fn into_buffer(self) -> Buffer {
        let len = self.bytes;
        let owner = Arc::new(self);
        let ptr = NonNull::from(bytemuck::cast_slice::<u64, u8>(&owner.words)).cast::<u8>();
        // SAFETY: `ptr` points to the heap allocation of `owner.words`,
        // which holds at least `len` initialized bytes. The allocation never
        // moves or changes while `owner` lives (nothing can reach it but the
        // buffer), and the buffer keeps `owner` alive.
        unsafe { Buffer::from_custom_allocation(ptr, len, owner) }
    }
}

impl Drop for PooledBytes {
    fn drop(&mut self) {
        if let Some(home) = self.home.upgrade() {
            if let Ok(mut free) = home.lock() {
                free.push(std::mem::take(&mut self.words));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_return_to_the_pool_and_are_reused() {
        let pool = ChunkBufferPool::new();
        let mut bytes = pool.take(20);
        bytes.as_mut_bytes().copy_from_slice(&[7; 20]);
        let buffer = bytes.into_buffer();
        assert_eq!(buffer.as_slice(), &[7; 20]);
        let first = buffer.as_ptr();
        let slice = buffer.slice(8);
        drop(buffer);
        assert_eq!(pool.free_buffers(), 0, "a slice still uses it");
        drop(slice);
        assert_eq!(pool.free_buffers(), 1);
        // A smaller request reuses it; a larger one replaces it.
        let again = pool.take(16).into_buffer();
        assert_eq!(again.as_ptr(), first);
        assert_eq!(again.len(), 16);
        drop(again);
        let larger = pool.take(4096);
        assert_eq!(pool.free_buffers(), 0);
        drop(larger);
        assert_eq!(pool.free_buffers(), 1);
    }

    #[test]
    fn buffers_outliving_their_pool_are_freed() {
        let pool = ChunkBufferPool::new();
        let buffer = pool.take(64).into_buffer();
        drop(pool);
        assert_eq!(buffer.len(), 64);
        drop(buffer);
    }
}

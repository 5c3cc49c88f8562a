//! Reading Zarr: opening stores (zarrs + object_store), discovering arrays,
//! and decoding their values the way xarray does.

mod allowed;
mod array;
mod bucket;
mod buffer_pool;
mod decode;
mod hierarchy;
mod network;
mod opening;
mod raw_chunks;
mod remote;
mod store;

pub use allowed::AllowedLocations;
pub use array::{chunk_keys, codec_read, root_name, ZarrArray, MAX_ARRAY_BYTES};
pub(crate) use array::{dimension_names, is_sharded};
pub use buffer_pool::{ChunkBufferPool, PooledBytes};
pub use decode::{decoded_attributes, ColumnDecoder, StoredType};
pub(crate) use hierarchy::read_json;
pub use hierarchy::{discover_arrays, ArrayEntry};
pub use network::{network_stats, NetworkStats};
pub use opening::{cache_root, write_file_atomically, Opening, OpeningCache, OPENING_CACHE_BYTES};
pub use remote::{
    IoCounters, IoTotals, OpenedObject, RangedReads, ReadAhead, RemoteStorage, UpcomingKeys,
    MAX_IO_CONCURRENCY,
};
pub use store::{
    is_object_store_option, open_storage, open_writable_remote, open_writable_storage,
    retry_config, OpenedStore, StoreAccess, StoreLocation, MAX_BACKOFF_BASE, MAX_OPTION_DURATION,
};
pub(crate) use store::{option_duration, set_retry_option};

//! Opening a Zarr store from a path or URL.
//!
//! Local paths (and `file://` URLs) are read with zarrs' filesystem store.
//! Everything else (`s3://`, `gs://`, `az://`, `abfs://`, `http(s)://`) goes
//! through `object_store`, the same version DataFusion uses: a store already
//! registered with the session's runtime for that URL is reused (so its
//! credentials apply), otherwise one is built from the environment and the
//! table's `OPTIONS`, as `datafusion-cli` does (`aws.region`,
//! `aws.access_key_id`, `aws.skip_signature`, `gcp.service_account_path`,
//! `azure.account_name`, ...), and registered for later queries.

use std::collections::HashMap;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::execution::runtime_env::RuntimeEnv;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::http::HttpBuilder;
use object_store::prefix::PrefixStore;
use object_store::{ClientConfigKey, ObjectStore};
use url::Url;
use zarrs::filesystem::FilesystemStore;
use zarrs::storage::storage_adapter::async_to_sync::{
    AsyncToSyncBlockOn, AsyncToSyncStorageAdapter,
};
use zarrs::storage::{ReadableListableStorage, ReadableWritableListableStorage};
use zarrs_object_store::AsyncObjectStore;

use crate::error::{Result, ZarrFusionError};

/// Runs object-store futures from the blocking threads that decode chunks.
struct TokioBlockOn(tokio::runtime::Handle);

impl AsyncToSyncBlockOn for TokioBlockOn {
    fn block_on<F: std::future::Future>(&self, future: F) -> F::Output {
        self.0.block_on(future)
    }
}

/// Where a store lives, resolved from what the user wrote.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum StoreLocation {
    /// A directory on this machine.
    Local(PathBuf),
    /// A URL served by an object store.
    Remote(Url),
}

impl StoreLocation {
    /// Parses a local path, a `file://` URL or an object-store URL.
    pub fn parse(location: &str) -> Result<Self> {
        let trimmed = location.trim();
        if trimmed.is_empty() {
            return Err(ZarrFusionError::store(location, "empty location"));
        }
        match Url::parse(trimmed) {
            Ok(url) if url.scheme() == "file" => url
                .to_file_path()
                .map(Self::Local)
                .map_err(|_| ZarrFusionError::store(location, "invalid file:// URL")),
            // One-letter schemes are Windows drive letters, not URLs.
            Ok(url) if url.scheme().len() > 1 => Ok(Self::Remote(url)),
            _ => Ok(Self::Local(PathBuf::from(trimmed))),
        }
    }

    /// Appends a sub-path (a group inside the store).
    pub fn join(&self, sub_path: &str) -> Self {
        let sub_path = sub_path.trim_matches('/');
        match self {
            Self::Local(p) => Self::Local(p.join(sub_path)),
            Self::Remote(url) => {
                let mut url = url.clone();
                let path = format!("{}/{}", url.path().trim_end_matches('/'), sub_path);
                url.set_path(&path);
                Self::Remote(url)
            }
        }
    }
}

impl std::fmt::Display for StoreLocation {
    /// The path, or the URL.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Local(path) => write!(f, "{}", path.display()),
            Self::Remote(url) => write!(f, "{url}"),
        }
    }
}

/// Opens the storage of a store for reading and listing.
///
/// Must run outside an async context (remote stores block on the runtime).
pub fn open_storage(
    display: &str,
    location: &StoreLocation,
    options: &HashMap<String, String>,
    runtime: &RuntimeEnv,
) -> Result<ReadableListableStorage> {
    match location {
        StoreLocation::Local(path) => {
            if !path.is_dir() {
                return Err(ZarrFusionError::store(
                    display,
                    if path.exists() {
                        "not a directory"
                    } else {
                        "no such directory"
                    },
                ));
            }
            let store =
                FilesystemStore::new(path).map_err(|e| ZarrFusionError::store(display, e))?;
            Ok(Arc::new(store))
        }
        StoreLocation::Remote(url) => Ok(remote_storage(display, url, options, runtime)?),
    }
}

/// Opens the store at `location` for writing: a local directory (created
/// with its parents) or an object-store URL.
pub fn open_writable_storage(
    display: &str,
    location: &StoreLocation,
    runtime: &RuntimeEnv,
) -> Result<ReadableWritableListableStorage> {
    match location {
        StoreLocation::Local(path) => {
            std::fs::create_dir_all(path).map_err(|e| ZarrFusionError::store(display, e))?;
            let store =
                FilesystemStore::new(path).map_err(|e| ZarrFusionError::store(display, e))?;
            Ok(Arc::new(store))
        }
        StoreLocation::Remote(url) => Ok(remote_storage(display, url, &HashMap::new(), runtime)?),
    }
}

/// An object store as synchronous zarrs storage.
type RemoteStorage =
    AsyncToSyncStorageAdapter<AsyncObjectStore<Arc<dyn ObjectStore>>, TokioBlockOn>;

/// The object store serving `url`, rooted at its path, as synchronous
/// zarrs storage (futures run on the current Tokio runtime).
fn remote_storage(
    display: &str,
    url: &Url,
    options: &HashMap<String, String>,
    runtime: &RuntimeEnv,
) -> Result<Arc<RemoteStorage>> {
    let handle = tokio::runtime::Handle::try_current()
        .map_err(|_| ZarrFusionError::store(display, "remote stores need a Tokio runtime"))?;
    let object_store = object_store_for(display, url, options, runtime)?;
    let prefix = url.path().trim_matches('/').to_string();
    let store: Arc<dyn ObjectStore> = if prefix.is_empty() {
        object_store
    } else {
        Arc::new(PrefixStore::new(object_store, prefix))
    };
    Ok(Arc::new(AsyncToSyncStorageAdapter::new(
        Arc::new(AsyncObjectStore::new(store)),
        TokioBlockOn(handle),
    )))
}

/// The session's object store for `url`, or a new one built from the
/// environment and `options` and registered with the runtime.
fn object_store_for(
    display: &str,
    url: &Url,
    options: &HashMap<String, String>,
    runtime: &RuntimeEnv,
) -> Result<Arc<dyn ObjectStore>> {
    let root = ObjectStoreUrl::parse(format!("{}://{}", url.scheme(), url.authority()))
        .map_err(|e| ZarrFusionError::store(display, e))?;
    if let Ok(store) = runtime.object_store(&root) {
        return Ok(store);
    }
    let err = |e: &dyn std::fmt::Display| ZarrFusionError::store(display, e);
    let scoped = |prefixes: &[&str]| -> Vec<(String, String)> {
        options
            .iter()
            .filter_map(|(k, v)| {
                let k = k.to_ascii_lowercase();
                prefixes
                    .iter()
                    .find_map(|p| k.strip_prefix(p))
                    .map(|rest| (rest.to_string(), v.clone()))
            })
            .collect()
    };
    let store: Arc<dyn ObjectStore> = match url.scheme() {
        "s3" | "s3a" => {
            let mut builder = AmazonS3Builder::from_env().with_url(url.as_str());
            for (key, value) in scoped(&["aws.", "s3."]) {
                let key = AmazonS3ConfigKey::from_str(&key).map_err(|e| err(&e))?;
                builder = builder.with_config(key, value);
            }
            Arc::new(builder.build().map_err(|e| err(&e))?)
        }
        "gs" | "gcs" => {
            let mut builder = GoogleCloudStorageBuilder::from_env().with_url(url.as_str());
            for (key, value) in scoped(&["gcp.", "gcs.", "google."]) {
                let key = GoogleConfigKey::from_str(&key).map_err(|e| err(&e))?;
                builder = builder.with_config(key, value);
            }
            Arc::new(builder.build().map_err(|e| err(&e))?)
        }
        "az" | "azure" | "abfs" | "abfss" | "adl" => {
            let mut builder = MicrosoftAzureBuilder::from_env().with_url(url.as_str());
            for (key, value) in scoped(&["azure.", "az."]) {
                let key = AzureConfigKey::from_str(&key).map_err(|e| err(&e))?;
                builder = builder.with_config(key, value);
            }
            Arc::new(builder.build().map_err(|e| err(&e))?)
        }
        "http" | "https" => {
            let mut builder = HttpBuilder::new().with_url(root.as_str());
            if url.scheme() == "http" {
                // The user wrote http:// on purpose; object_store refuses it by default.
                builder = builder.with_config(ClientConfigKey::AllowHttp, "true");
            }
            for (key, value) in scoped(&["http."]) {
                let key = ClientConfigKey::from_str(&key).map_err(|e| err(&e))?;
                builder = builder.with_config(key, value);
            }
            Arc::new(builder.build().map_err(|e| err(&e))?)
        }
        other => {
            return Err(ZarrFusionError::store(
                display,
                format!("unsupported URL scheme '{other}' (use a path, file://, s3://, gs://, az:// or http(s)://)"),
            ))
        }
    };
    runtime.register_object_store(root.as_ref(), Arc::clone(&store));
    Ok(store)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_locations() {
        assert_eq!(
            StoreLocation::parse("demo/era5.zarr").unwrap(),
            StoreLocation::Local(PathBuf::from("demo/era5.zarr"))
        );
        assert_eq!(
            StoreLocation::parse("file:///data/a.zarr").unwrap(),
            StoreLocation::Local(PathBuf::from("/data/a.zarr"))
        );
        let remote = StoreLocation::parse("s3://bucket/era5.zarr").unwrap();
        assert!(matches!(remote, StoreLocation::Remote(ref u) if u.host_str() == Some("bucket")));
        assert_eq!(
            remote.join("group"),
            StoreLocation::parse("s3://bucket/era5.zarr/group").unwrap()
        );
        assert!(StoreLocation::parse("  ").is_err());
    }
}

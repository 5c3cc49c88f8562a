//! Opening a Zarr store from a path or URL.
//!
//! Local paths (and `file://` URLs) are read with zarrs' filesystem store.
//! Everything else (`s3://`, `gs://`, `az://`, `abfs://`, `http(s)://`) goes
//! through `object_store`, the same version DataFusion uses: a store already
//! registered with the session's runtime for that URL is reused (so its
//! credentials apply), otherwise one is built from the environment and the
//! table's `OPTIONS`, as `datafusion-cli` does (`aws.region`,
//! `aws.access_key_id`, `aws.skip_signature`, `gcp.service_account_path`,
//! `azure.account_name`, ...), and registered for later queries. A table
//! that gives object-store options gets a store built from them, so its
//! settings apply to it; two statements that give a bucket options reaching
//! different servers or principals leave it ambiguous for statements
//! without options (see `bucket.rs`).
//!
//! Retries and time-outs are the object store's, set with `retry.*` and
//! `client.*` options in the ecosystem's naming ([`retry_config`]):
//! `retry.max_retries`, `retry.retry_timeout`, `retry.backoff.init_backoff`,
//! `retry.backoff.max_backoff`, `retry.backoff.base`, `client.timeout`,
//! `client.connect_timeout` and every other `object_store` client key.

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
use object_store::{BackoffConfig, ClientConfigKey, ObjectStore, RetryConfig};
use url::Url;
use zarrs::filesystem::FilesystemStore;
use zarrs::storage::{ReadableListableStorage, ReadableWritableListableStorage};

use super::bucket::{self, ClientOptions};
use super::network::CountingConnector;
use super::remote::RemoteStorage;
use crate::error::{Result, ZarrFusionError};

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

    /// Whether this is in the bucket of the store at `store`: both
    /// object-store URLs of one scheme and authority (what one client
    /// reaches with the same options).
    pub fn in_bucket_of(&self, store: &str) -> bool {
        match (self, Self::parse(store)) {
            (Self::Remote(a), Ok(Self::Remote(b))) => {
                a.scheme() == b.scheme() && a.authority() == b.authority()
            }
            _ => false,
        }
    }

    /// Whether the store is reached over the network by an object store
    /// zarrfusion builds (S3, GCS, Azure, HTTP), whose ETags tell versions
    /// of an object apart; not a local path, nor a store registered for
    /// another scheme (`memory://`).
    pub fn is_networked(&self) -> bool {
        matches!(self, Self::Remote(url) if matches!(
            url.scheme(),
            "s3" | "s3a" | "gs" | "gcs" | "az" | "azure" | "abfs" | "abfss" | "adl" | "http" | "https"
        ))
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

/// How a store's bytes are reached, beside its zarrs storage.
#[derive(Debug, Clone)]
pub enum StoreAccess {
    /// Files under this directory.
    Local(PathBuf),
    /// An object store, with its read-ahead and counters.
    Remote(Arc<RemoteStorage>),
}

/// A store opened for reading: its zarrs storage and how it is reached.
pub struct OpenedStore {
    /// The storage zarrs reads through.
    pub storage: ReadableListableStorage,
    /// The directory or the object store behind it.
    pub access: StoreAccess,
}

/// Opens the storage of a store for reading and listing. A remote store
/// uses the object store registered for its bucket when `options` (the
/// table's object-store options) are empty, else one built from the
/// environment, `defaults` (the session's settings) and `options`.
///
/// Must run outside an async context (remote stores block on the runtime).
pub fn open_storage(
    display: &str,
    location: &StoreLocation,
    options: &HashMap<String, String>,
    defaults: &HashMap<String, String>,
    runtime: &RuntimeEnv,
) -> Result<OpenedStore> {
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
            Ok(OpenedStore {
                storage: Arc::new(store),
                access: StoreAccess::Local(path.clone()),
            })
        }
        StoreLocation::Remote(url) => {
            let remote = remote_storage(display, url, options, defaults, runtime)?;
            Ok(OpenedStore {
                storage: Arc::clone(&remote) as ReadableListableStorage,
                access: StoreAccess::Remote(remote),
            })
        }
    }
}

/// Opens the store at `location` for writing: a local directory (created
/// with its parents) or an object-store URL (through a client built from
/// `options`, the write's object-store settings, when it gives any; else
/// the object store registered for its bucket, else one built from the
/// environment).
pub fn open_writable_storage(
    display: &str,
    location: &StoreLocation,
    options: &HashMap<String, String>,
    runtime: &RuntimeEnv,
) -> Result<ReadableWritableListableStorage> {
    match location {
        StoreLocation::Local(path) => {
            std::fs::create_dir_all(path).map_err(|e| ZarrFusionError::store(display, e))?;
            let store =
                FilesystemStore::new(path).map_err(|e| ZarrFusionError::store(display, e))?;
            Ok(Arc::new(store))
        }
        StoreLocation::Remote(url) => Ok(open_writable_remote(display, url, options, runtime)?),
    }
}

/// The store at `url` for reading and writing, as [`open_writable_storage`]
/// opens it, with its object store (for read-ahead windows).
pub fn open_writable_remote(
    display: &str,
    url: &Url,
    options: &HashMap<String, String>,
    runtime: &RuntimeEnv,
) -> Result<Arc<RemoteStorage>> {
    remote_storage(display, url, options, &HashMap::new(), runtime)
}

/// The object store serving `url`, rooted at its path, as synchronous
/// zarrs storage (futures run on the current Tokio runtime).
fn remote_storage(
    display: &str,
    url: &Url,
    options: &HashMap<String, String>,
    defaults: &HashMap<String, String>,
    runtime: &RuntimeEnv,
) -> Result<Arc<RemoteStorage>> {
    let handle = tokio::runtime::Handle::try_current()
        .map_err(|_| ZarrFusionError::store(display, "remote stores need a Tokio runtime"))?;
    let object_store = object_store_for(display, url, options, defaults, runtime)?;
    let identity = identity(url, options, defaults, object_store.as_ref());
    let prefix = url.path().trim_matches('/').to_string();
    let store: Arc<dyn ObjectStore> = if prefix.is_empty() {
        object_store
    } else {
        Arc::new(PrefixStore::new(object_store, prefix))
    };
    Ok(Arc::new(
        RemoteStorage::new(store, handle).with_identity(identity),
    ))
}

/// What tells the store at `url` from another with the same URL, for
/// caches kept between runs: the endpoint it is reached at (from the
/// options, the session's settings or the environment) and the object
/// store serving it.
fn identity(
    url: &Url,
    options: &HashMap<String, String>,
    defaults: &HashMap<String, String>,
    store: &dyn ObjectStore,
) -> String {
    let mut endpoints: Vec<String> = defaults
        .iter()
        .chain(options)
        .filter(|(key, _)| key.to_ascii_lowercase().contains("endpoint"))
        .map(|(key, value)| format!("{key}={value}"))
        .chain(
            ["AWS_ENDPOINT_URL", "AWS_ENDPOINT"]
                .into_iter()
                .filter_map(|var| Some(format!("{var}={}", std::env::var(var).ok()?))),
        )
        .collect();
    endpoints.sort();
    format!("{url}\n{}\n{store}", endpoints.join("\n"))
}

/// The client the bucket's statements without options use when `options`
/// set nothing (refused when statements disagreed about the bucket), else
/// one built from the environment, `defaults` (the session's settings) and
/// `options` (which win), shared with statements giving the same options
/// ([`bucket`] says which one the bucket's registration then is).
fn object_store_for(
    display: &str,
    url: &Url,
    options: &HashMap<String, String>,
    defaults: &HashMap<String, String>,
    runtime: &RuntimeEnv,
) -> Result<Arc<dyn ObjectStore>> {
    let root = ObjectStoreUrl::parse(format!("{}://{}", url.scheme(), url.authority()))
        .map_err(|e| ZarrFusionError::store(display, e))?;
    if options.is_empty() {
        if let Some(store) = bucket::registered_client(&root, runtime)
            .map_err(|e| ZarrFusionError::store(display, e))?
        {
            return Ok(store);
        }
    }
    let mut merged = defaults.clone();
    merged.extend(options.iter().map(|(k, v)| (k.clone(), v.clone())));
    bucket::client_for(&root, ClientOptions::new(&merged), runtime, || {
        build_object_store(display, url, &root, &merged)
    })
}

/// A client for the bucket of `url` built from the environment and
/// `options`.
fn build_object_store(
    display: &str,
    url: &Url,
    root: &ObjectStoreUrl,
    options: &HashMap<String, String>,
) -> Result<Arc<dyn ObjectStore>> {
    let err = |e: &dyn std::fmt::Display| ZarrFusionError::store(display, e);
    let retry = retry_config(options).map_err(|e| err(&e))?;
    let client = client_options(options).map_err(|e| err(&e))?;
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
    // Every builder takes the retries and counts its requests.
    macro_rules! finish {
        ($builder:expr) => {
            Arc::new(
                $builder
                    .with_retry(retry)
                    .with_http_connector(CountingConnector::default())
                    .build()
                    .map_err(|e| err(&e))?,
            )
        };
    }
    let store: Arc<dyn ObjectStore> = match url.scheme() {
        "s3" | "s3a" => {
            let mut builder = AmazonS3Builder::from_env().with_url(url.as_str());
            for (key, value) in scoped(&["aws.", "s3."]) {
                let key = AmazonS3ConfigKey::from_str(&key).map_err(|e| err(&e))?;
                builder = builder.with_config(key, value);
            }
            for (key, value) in &client {
                builder = builder.with_config(AmazonS3ConfigKey::Client(*key), value);
            }
finish!(builder)
        }
        "gs" | "gcs" => {
            let mut builder = GoogleCloudStorageBuilder::from_env().with_url(url.as_str());
            for (key, value) in scoped(&["gcp.", "gcs.", "google."]) {
                let key = GoogleConfigKey::from_str(&key).map_err(|e| err(&e))?;
                builder = builder.with_config(key, value);
            }
            for (key, value) in &client {
                builder = builder.with_config(GoogleConfigKey::Client(*key), value);
            }
finish!(builder)
        }
        "az" | "azure" | "abfs" | "abfss" | "adl" => {
            let mut builder = MicrosoftAzureBuilder::from_env().with_url(url.as_str());
            for (key, value) in scoped(&["azure.", "az."]) {
                let key = AzureConfigKey::from_str(&key).map_err(|e| err(&e))?;
                builder = builder.with_config(key, value);
            }
            for (key, value) in &client {
                builder = builder.with_config(AzureConfigKey::Client(*key), value);
            }
finish!(builder)
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
            for (key, value) in &client {
                builder = builder.with_config(*key, value);
            }
finish!(builder)
        }
        other => {
            return Err(ZarrFusionError::store(
                display,
                format!("unsupported URL scheme '{other}' (use a path, file://, s3://, gs://, az:// or http(s)://)"),
            ))
        }
    };
    Ok(store)
}

/// Whether an option (lowercase) is an object store's: `aws.*`, `s3.*`,
/// `gcp.*`, `gcs.*`, `google.*`, `azure.*`, `az.*`, `http.*`, `retry.*`,
/// `client.*`.
pub fn is_object_store_option(key: &str) -> bool {
    [
        "aws.", "s3.", "gcp.", "gcs.", "google.", "azure.", "az.", "http.", "retry.", "client.",
    ]
    .iter()
    .any(|prefix| key.starts_with(prefix))
}

/// The longest duration any `retry.*` or `client.*` option may give: a
/// week. object_store computes each backoff as seconds in `f64` and the
/// HTTP client adds time-outs to the clock, so unbounded values panic
/// there instead of failing cleanly.
pub const MAX_OPTION_DURATION: std::time::Duration = std::time::Duration::from_secs(7 * 24 * 3600);

/// The largest `retry.backoff.base`: with it and [`MAX_OPTION_DURATION`]
/// the backoff's next range stays finite.
pub const MAX_BACKOFF_BASE: f64 = 1000.0;

/// The retry settings among `options` (`retry.*`), over object_store's
/// defaults (10 retries within 3 minutes, backoff from 100 ms doubling up
/// to 15 s). Each value is checked on its own (`set_retry_option`), then
/// together: the first wait above 0 and at most the longest (object_store
/// draws each wait between the first one and the last times the base, and
/// panics on an empty or infinite range).
pub fn retry_config(options: &HashMap<String, String>) -> std::result::Result<RetryConfig, String> {
    let mut retry = RetryConfig::default();
    let mut backoff = BackoffConfig::default();
    for (key, value) in options {
        set_retry_option(key, value, &mut retry, &mut backoff)?;
    }
    // An option as the user wrote it, or as the default it was left at.
    let named = |key: &str| match options.keys().find(|k| k.eq_ignore_ascii_case(key)) {
        Some(k) => k.clone(),
        None => format!("{key} (the default)"),
    };
    if backoff.init_backoff.is_zero() {
        return Err(format!(
            "option {} must be above 0: each wait is drawn between it and a multiple of it",
            named("retry.backoff.init_backoff")
        ));
    }
    if backoff.init_backoff > backoff.max_backoff {
        return Err(format!(
            "option {} ({:?}) is longer than {} ({:?}): the first wait cannot exceed the longest",
            named("retry.backoff.init_backoff"),
            backoff.init_backoff,
            named("retry.backoff.max_backoff"),
            backoff.max_backoff,
        ));
    }
    retry.backoff = backoff;
    Ok(retry)
}

/// Sets the retry option `key` (ignored unless it starts with `retry.`) to
/// `value` in `retry` and `backoff`, checked on its own: a count, a
/// duration up to [`MAX_OPTION_DURATION`], or a base above 1 and at most
/// [`MAX_BACKOFF_BASE`].
pub(crate) fn set_retry_option(
    key: &str,
    value: &str,
    retry: &mut RetryConfig,
    backoff: &mut BackoffConfig,
) -> std::result::Result<(), String> {
    let Some(name) = key
        .to_ascii_lowercase()
        .strip_prefix("retry.")
        .map(str::to_string)
    else {
        return Ok(());
    };
    let bad = |what: &str| format!("option {key} must be {what}, got '{value}'");
    let duration = || option_duration(value).map_err(|e| bad(&e));
    match name.as_str() {
        "max_retries" => retry.max_retries = value.trim().parse().map_err(|_| bad("a count"))?,
        "retry_timeout" => retry.retry_timeout = duration()?,
        "backoff.init_backoff" => backoff.init_backoff = duration()?,
        "backoff.max_backoff" => backoff.max_backoff = duration()?,
        "backoff.base" => {
            backoff.base = value
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|b| *b > 1.0 && *b <= MAX_BACKOFF_BASE)
                .ok_or_else(|| bad(&format!("a number above 1 and at most {MAX_BACKOFF_BASE}")))?
        }
        _ => {
            return Err(format!(
                "unknown option {key} (known: retry.max_retries, retry.retry_timeout, \
                 retry.backoff.init_backoff, retry.backoff.max_backoff, retry.backoff.base)"
            ))
        }
    }
    Ok(())
}

/// A duration written as `10ms`, `2s`, `1min` (humantime's syntax).
fn parse_duration(text: &str) -> std::result::Result<std::time::Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|e| format!("a duration such as 10ms or 2s ({e})"))
}

/// A duration option's value: [`parse_duration`], at most
/// [`MAX_OPTION_DURATION`].
pub(crate) fn option_duration(text: &str) -> std::result::Result<std::time::Duration, String> {
    let duration = parse_duration(text)?;
    if duration > MAX_OPTION_DURATION {
        return Err(format!(
            "a duration of at most {}",
            humantime::format_duration(MAX_OPTION_DURATION)
        ));
    }
    Ok(duration)
}

/// Whether object_store's client option `name` (after `client.`) is a
/// duration: its time-outs and intervals.
pub(crate) fn is_duration_client_option(name: &str) -> bool {
    name.ends_with("timeout") || name.ends_with("interval")
}

/// The HTTP client settings among `options` (`client.timeout`,
/// `client.connect_timeout`, ...: object_store's client keys).
fn client_options(
    options: &HashMap<String, String>,
) -> std::result::Result<Vec<(ClientConfigKey, String)>, String> {
    options
        .iter()
        .filter_map(|(key, value)| {
            let name = key.to_ascii_lowercase();
            let name = name.strip_prefix("client.")?.to_string();
            let key = ClientConfigKey::from_str(&name).map_err(|e| format!("option {key}: {e}"));
            Some(key.and_then(|k| {
                if is_duration_client_option(&name) {
                    option_duration(value)
                        .map_err(|e| format!("option client.{name} must be {e}, got '{value}'"))?;
                }
                Ok((k, value.clone()))
            }))
        })
        .collect()
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
        assert!(remote.is_networked());
        assert!(!StoreLocation::parse("memory://bucket/a.zarr")
            .unwrap()
            .is_networked());
        assert!(!StoreLocation::parse("demo/era5.zarr")
            .unwrap()
            .is_networked());
        assert_eq!(
            remote.join("group"),
            StoreLocation::parse("s3://bucket/era5.zarr/group").unwrap()
        );
        assert!(StoreLocation::parse("  ").is_err());
    }

    #[test]
    fn retry_settings_parse_in_the_ecosystems_naming() {
        let options: HashMap<String, String> = [
            ("retry.max_retries", "3"),
            ("retry.retry_timeout", "20s"),
            ("retry.backoff.init_backoff", "10ms"),
            ("retry.backoff.max_backoff", "1s"),
            ("retry.backoff.base", "3"),
            ("aws.region", "us-east-1"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let retry = retry_config(&options).unwrap();
        assert_eq!(retry.max_retries, 3);
        assert_eq!(retry.retry_timeout, std::time::Duration::from_secs(20));
        assert_eq!(
            retry.backoff.init_backoff,
            std::time::Duration::from_millis(10)
        );
        assert_eq!(retry.backoff.max_backoff, std::time::Duration::from_secs(1));
        assert_eq!(retry.backoff.base, 3.0);
        let bad = |k: &str, v: &str| {
            retry_config(&HashMap::from([(k.to_string(), v.to_string())])).unwrap_err()
        };
        assert!(bad("retry.max_retries", "-1").contains("retry.max_retries"));
        assert!(bad("retry.backoff.base", "0.5").contains("above 1"));
        // object_store would draw from an empty range (1) or an infinite one.
        assert!(bad("retry.backoff.base", "1").contains("above 1"));
        assert!(bad("retry.backoff.base", "1e300").contains("at most 1000"));
        assert!(bad("retry.backoff.base", "NaN").contains("above 1"));
        assert!(bad("retry.backoff.max_backoff", "1000000years").contains("at most 7days"));
        assert!(bad("retry.backoff.init_backoff", "0s").contains("above 0"));
        // Checked together, naming the default a value is compared with.
        let late = bad("retry.backoff.init_backoff", "1min");
        assert!(
            late.contains("retry.backoff.max_backoff (the default)") && late.contains("15s"),
            "{late}"
        );
        let both = retry_config(&HashMap::from([
            ("retry.backoff.init_backoff".to_string(), "1min".to_string()),
            ("retry.backoff.max_backoff".to_string(), "2min".to_string()),
        ]))
        .unwrap();
        assert_eq!(
            both.backoff.max_backoff,
            std::time::Duration::from_secs(120)
        );
        assert!(bad("retry.retry_timeout", "soon").contains("retry.retry_timeout"));
        assert!(bad("retry.tries", "3").contains("unknown option retry.tries"));
        let client = client_options(&HashMap::from([
            ("client.timeout".to_string(), "5s".to_string()),
            ("client.connect_timeout".to_string(), "1s".to_string()),
        ]))
        .unwrap();
        assert_eq!(client.len(), 2);
        let slow = client_options(&HashMap::from([(
            "client.http2_keep_alive_interval".to_string(),
            "500000000years".to_string(),
        )]))
        .unwrap_err();
        assert!(
            slow.contains("client.http2_keep_alive_interval must be a duration of at most 7days"),
            "{slow}"
        );
        assert!(client_options(&HashMap::from([(
            "client.speed".to_string(),
            "fast".to_string()
        )]))
        .is_err());
    }
}

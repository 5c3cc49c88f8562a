//! Which object-store client a bucket's statements use.
//!
//! A statement that gives object-store `OPTIONS` (a table, a `COPY`, a
//! rechunk target) reads and writes with a client built from them. Its
//! client is also registered with the session's runtime for the bucket,
//! so that statements on that bucket *without* options (another table, a
//! `COPY`, a `work_dir`, DataFusion's own readers) reach the same server as
//! the same principal, the way `datafusion-cli` does.
//!
//! That convention stays safe only while it names one server and one
//! principal. When two statements give a bucket options that differ in
//! where or as whom they reach it (anything but `retry.*` and `client.*`:
//! endpoint, region, credentials, addressing), the bucket's registration
//! becomes [`AmbiguousBucket`]: the two statements keep their own clients,
//! and a later statement without options is refused, naming the keys that
//! differ, instead of silently using whichever came last. A client the
//! program registered itself (Rust API) is never replaced. Statements with
//! the same options share one client (and its connection pool).

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, Weak};

use async_trait::async_trait;
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::execution::runtime_env::RuntimeEnv;
use futures::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult,
};

/// The options a client was built from: everything, and the part that
/// says where and as whom (everything but `retry.*` and `client.*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ClientOptions {
    all: BTreeMap<String, String>,
}

impl ClientOptions {
    /// The options (keys lowercased) a client is built from.
    pub(crate) fn new(options: &HashMap<String, String>) -> Self {
        Self {
            all: options
                .iter()
                .map(|(k, v)| (k.to_ascii_lowercase(), v.clone()))
                .collect(),
        }
    }

    /// The options that choose the server and the principal.
    fn reach(&self) -> impl Iterator<Item = (&String, &String)> {
        self.all
            .iter()
            .filter(|(k, _)| !k.starts_with("retry.") && !k.starts_with("client."))
    }

    /// Whether both reach the same server as the same principal.
    fn same_reach(&self, other: &ClientOptions) -> bool {
        self.reach().eq(other.reach())
    }

    /// The keys whose values tell the two apart (never the values:
    /// they may be secrets).
    fn differing_keys(&self, other: &ClientOptions) -> Vec<String> {
        let mine: BTreeMap<_, _> = self.reach().collect();
        let theirs: BTreeMap<_, _> = other.reach().collect();
        let mut keys: Vec<String> = mine
            .keys()
            .chain(theirs.keys())
            .filter(|k| mine.get(*k) != theirs.get(*k))
            .map(|k| k.to_string())
            .collect();
        keys.sort();
        keys.dedup();
        keys
    }
}

/// What this process registered for buckets: clients with their options,
/// and ambiguous buckets. Weak, so that a client goes with its last user.
enum Registered {
    Client(Weak<dyn ObjectStore>, ClientOptions),
    Ambiguous(Weak<dyn ObjectStore>),
}

static REGISTERED: Mutex<Vec<Registered>> = Mutex::new(Vec::new());

/// What zarrfusion knows about the store `registered` for a bucket.
enum Known {
    /// A client built by a statement with these options.
    Client(ClientOptions),
    /// Statements gave the bucket options that disagree.
    Ambiguous,
    /// The program's own (or nothing zarrfusion built).
    Foreign,
}

fn known(store: &Arc<dyn ObjectStore>) -> Known {
    let registered = crate::error::lock(&REGISTERED);
    for entry in registered.iter() {
        match entry {
            Registered::Client(weak, options) if same(weak, store) => {
                return Known::Client(options.clone())
            }
            Registered::Ambiguous(weak) if same(weak, store) => return Known::Ambiguous,
            _ => {}
        }
    }
    Known::Foreign
}

fn same(weak: &Weak<dyn ObjectStore>, store: &Arc<dyn ObjectStore>) -> bool {
    weak.upgrade().is_some_and(|live| Arc::ptr_eq(&live, store))
}

fn remember(entry: Registered) {
    let mut registered = crate::error::lock(&REGISTERED);
    registered.retain(|e| match e {
        Registered::Client(weak, _) | Registered::Ambiguous(weak) => weak.strong_count() > 0,
    });
    registered.push(entry);
}

/// The client a statement *without* object-store options uses for the
/// bucket `root`: the registered one, unless statements disagreed about
/// the bucket (an error naming the keys), or none (then `None`).
pub(crate) fn registered_client(
    root: &ObjectStoreUrl,
    runtime: &RuntimeEnv,
) -> std::result::Result<Option<Arc<dyn ObjectStore>>, String> {
    let Ok(store) = runtime.object_store(root) else {
        return Ok(None);
    };
    match known(&store) {
        Known::Ambiguous => Err(store.to_string()),
        _ => Ok(Some(store)),
    }
}

/// The client for a statement that gives `options` (merged over the
/// session's settings) on the bucket `root`: the registered one when it was
/// built from the same options, else `build()`'s, registered for the
/// bucket as the module's docs say.
pub(crate) fn client_for<E>(
    root: &ObjectStoreUrl,
    options: ClientOptions,
    runtime: &RuntimeEnv,
    build: impl FnOnce() -> std::result::Result<Arc<dyn ObjectStore>, E>,
) -> std::result::Result<Arc<dyn ObjectStore>, E> {
    let registered = runtime.object_store(root).ok();
    let known = registered.as_ref().map(known);
    if let (Some(store), Some(Known::Client(theirs))) = (&registered, &known) {
        if *theirs == options {
            return Ok(Arc::clone(store));
        }
    }
    let client = build()?;
    remember(Registered::Client(Arc::downgrade(&client), options.clone()));
    match known {
        // Nothing registered, or a client reaching the same server as the
        // same principal (its retries and time-outs are the newer ones).
        None => {
            runtime.register_object_store(root.as_ref(), Arc::clone(&client));
        }
        Some(Known::Client(theirs)) if theirs.same_reach(&options) => {
            runtime.register_object_store(root.as_ref(), Arc::clone(&client));
        }
        Some(Known::Client(theirs)) => {
            let ambiguous: Arc<dyn ObjectStore> = Arc::new(AmbiguousBucket {
                bucket: root.as_str().trim_end_matches('/').to_string(),
                keys: theirs.differing_keys(&options),
            });
            remember(Registered::Ambiguous(Arc::downgrade(&ambiguous)));
            runtime.register_object_store(root.as_ref(), ambiguous);
        }
        Some(Known::Ambiguous) | Some(Known::Foreign) => {}
    }
    Ok(client)
}

/// The registration of a bucket that statements gave disagreeing
/// object-store options: every request through it fails, saying so.
#[derive(Debug)]
pub struct AmbiguousBucket {
    bucket: String,
    keys: Vec<String>,
}

impl fmt::Display for AmbiguousBucket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} was given different object-store options by two statements \
             (they differ in {}); a statement on it without OPTIONS cannot tell \
             which to use: give it its own OPTIONS",
            self.bucket,
            self.keys.join(", ")
        )
    }
}

impl AmbiguousBucket {
    fn refuse<T>(&self) -> object_store::Result<T> {
        Err(object_store::Error::Generic {
            store: "zarrfusion",
            source: self.to_string().into(),
        })
    }
}

#[async_trait]
impl ObjectStore for AmbiguousBucket {
    async fn put_opts(
        &self,
        _: &Path,
        _: PutPayload,
        _: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.refuse()
    }

    async fn put_multipart_opts(
        &self,
        _: &Path,
        _: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.refuse()
    }

    async fn get_opts(&self, _: &Path, _: GetOptions) -> object_store::Result<GetResult> {
        self.refuse()
    }

    fn delete_stream(
        &self,
        _: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        Box::pin(futures::stream::once(futures::future::ready(self.refuse())))
    }

    fn list(&self, _: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        Box::pin(futures::stream::once(futures::future::ready(self.refuse())))
    }

    async fn list_with_delimiter(&self, _: Option<&Path>) -> object_store::Result<ListResult> {
        self.refuse()
    }

    async fn copy_opts(&self, _: &Path, _: &Path, _: CopyOptions) -> object_store::Result<()> {
        self.refuse()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::memory::InMemory;
    use object_store::ObjectStoreExt;

    fn options(pairs: &[(&str, &str)]) -> ClientOptions {
        ClientOptions::new(
            &pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    fn client(
        root: &ObjectStoreUrl,
        runtime: &RuntimeEnv,
        pairs: &[(&str, &str)],
    ) -> Arc<dyn ObjectStore> {
        client_for::<()>(root, options(pairs), runtime, || {
            Ok(Arc::new(InMemory::new()) as Arc<dyn ObjectStore>)
        })
        .unwrap()
    }

    #[test]
    fn statements_agreeing_share_and_register_one_client() {
        let runtime = RuntimeEnv::default();
        let root = ObjectStoreUrl::parse("s3://agree").unwrap();
        assert!(registered_client(&root, &runtime).unwrap().is_none());
        let endpoint = [("aws.endpoint", "http://127.0.0.1:9000")];
        let first = client(&root, &runtime, &endpoint);
        let second = client(&root, &runtime, &endpoint);
        assert!(Arc::ptr_eq(&first, &second), "same options, one client");
        let registered = registered_client(&root, &runtime).unwrap().unwrap();
        assert!(Arc::ptr_eq(&registered, &first));
        // Other retries reach the same server as the same principal: the
        // newer client is registered, nothing is ambiguous.
        let retried = client(
            &root,
            &runtime,
            &[
                ("aws.endpoint", "http://127.0.0.1:9000"),
                ("retry.max_retries", "2"),
            ],
        );
        assert!(!Arc::ptr_eq(&retried, &first));
        let registered = registered_client(&root, &runtime).unwrap().unwrap();
        assert!(Arc::ptr_eq(&registered, &retried));
    }

    #[test]
    fn statements_disagreeing_leave_the_bucket_to_their_own_clients() {
        let runtime = RuntimeEnv::default();
        let root = ObjectStoreUrl::parse("s3://disagree").unwrap();
        let a = client(
            &root,
            &runtime,
            &[("aws.access_key_id", "alice"), ("aws.region", "x")],
        );
        let b = client(
            &root,
            &runtime,
            &[("aws.access_key_id", "bob"), ("aws.region", "x")],
        );
        assert!(!Arc::ptr_eq(&a, &b));
        let refused = registered_client(&root, &runtime).unwrap_err();
        assert!(refused.contains("s3://disagree"), "{refused}");
        assert!(refused.contains("aws.access_key_id"), "{refused}");
        assert!(!refused.contains("aws.region"), "{refused}");
        assert!(
            !refused.contains("alice") && !refused.contains("bob"),
            "{refused}"
        );
        // DataFusion's own readers and writers, which ask the runtime, are
        // refused the same way.
        let store = runtime.object_store(&root).unwrap();
        let err = futures::executor::block_on(store.head(&Path::from("x"))).unwrap_err();
        assert!(err.to_string().contains("cannot tell which"), "{err}");
        // A third statement with options still gets its own client.
        let c = client(&root, &runtime, &[("aws.access_key_id", "carol")]);
        assert!(!Arc::ptr_eq(&c, &a) && !Arc::ptr_eq(&c, &b));
        assert!(registered_client(&root, &runtime).is_err());
    }

    #[test]
    fn a_client_the_program_registered_is_never_replaced() {
        let runtime = RuntimeEnv::default();
        let root = ObjectStoreUrl::parse("s3://program").unwrap();
        let own: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        runtime.register_object_store(root.as_ref(), Arc::clone(&own));
        let table = client(&root, &runtime, &[("aws.region", "x")]);
        assert!(!Arc::ptr_eq(&table, &own));
        let registered = registered_client(&root, &runtime).unwrap().unwrap();
        assert!(Arc::ptr_eq(&registered, &own));
    }
}

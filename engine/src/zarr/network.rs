//! What went over the network to object stores, counted at the HTTP layer.
//!
//! Every object store zarrfusion builds (S3, GCS, Azure, HTTP) sends its
//! requests through [`CountingConnector`], which counts each HTTP request
//! sent, retries included, and each answer the client retries: a server
//! error (5xx), `429 Too Many Requests` (S3's SlowDown), `408 Request
//! Timeout`, or a request that failed in transport (refused, reset, timed
//! out). object_store retries these inside its client without saying so;
//! here they can be seen ([`network_stats`]): after a query that succeeded,
//! every error counted was retried. A body cut short is read again with a
//! new request, so it shows as one more request, not as an error.

use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpRequest, HttpResponse, HttpService, ReqwestConnector,
};
use object_store::ClientOptions;

/// Requests and retried errors, counted over the whole process.
static COUNTERS: Counters = Counters {
    requests: AtomicU64::new(0),
    errors: AtomicU64::new(0),
    not_modified: AtomicU64::new(0),
};

struct Counters {
    requests: AtomicU64,
    errors: AtomicU64,
    not_modified: AtomicU64,
}

/// HTTP requests sent to object stores since the process started.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct NetworkStats {
    /// Requests sent, each retry one more.
    pub requests: u64,
    /// Requests answered with an error the client retries (5xx, 429, 408)
    /// or failed in transport.
    pub errors: u64,
    /// Requests answered `304 Not Modified`: conditional requests of an
    /// opening whose objects had not changed ([`crate::zarr::Opening`]).
    pub not_modified: u64,
}

impl NetworkStats {
    /// What was counted since `earlier`.
    pub fn since(&self, earlier: &NetworkStats) -> NetworkStats {
        NetworkStats {
            requests: self.requests.saturating_sub(earlier.requests),
            errors: self.errors.saturating_sub(earlier.errors),
            not_modified: self.not_modified.saturating_sub(earlier.not_modified),
        }
    }
}

/// The HTTP requests zarrfusion's object stores sent so far (see the
/// module docs).
pub fn network_stats() -> NetworkStats {
    NetworkStats {
        requests: COUNTERS.requests.load(Ordering::Relaxed),
        errors: COUNTERS.errors.load(Ordering::Relaxed),
        not_modified: COUNTERS.not_modified.load(Ordering::Relaxed),
    }
}

/// object_store's reqwest client, counting what it sends.
#[derive(Debug, Default)]
pub struct CountingConnector(ReqwestConnector);

impl HttpConnector for CountingConnector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        Ok(HttpClient::new(CountingService(self.0.connect(options)?)))
    }
}

#[derive(Debug)]
struct CountingService(HttpClient);

#[async_trait]
impl HttpService for CountingService {
    async fn call(&self, request: HttpRequest) -> Result<HttpResponse, HttpError> {
        COUNTERS.requests.fetch_add(1, Ordering::Relaxed);
        let answer = self.0.execute(request).await;
        let retried = match &answer {
            Ok(response) => {
                let status = response.status();
                if status.as_u16() == 304 {
                    COUNTERS.not_modified.fetch_add(1, Ordering::Relaxed);
                }
                status.is_server_error() || matches!(status.as_u16(), 408 | 429)
            }
            Err(_) => true,
        };
        if retried {
            COUNTERS.errors.fetch_add(1, Ordering::Relaxed);
        }
        answer
    }
}

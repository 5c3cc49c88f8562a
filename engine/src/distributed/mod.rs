//! The same plans on a cluster: a session with workers hands the stages of
//! its physical plans to `zarrfusion worker` processes through
//! [datafusion-distributed](https://github.com/datafusion-contrib/datafusion-distributed)
//! (Arrow Flight over gRPC); zarrfusion adds no protocol or scheduler of
//! its own.
//!
//! - [`codec`]: how zarrfusion's plan nodes cross the network. A Zarr scan
//!   travels as the location and options of its table, its projection,
//!   selection and blocks (a dense reduction's partial states: also its
//!   groups and aggregates, their expressions in DataFusion's protobuf
//!   form); the worker opens the table again (with its own
//!   `allowed_locations`) and checks everything it was sent.
//! - [`tasks`]: how many tasks a scan's stage gets (its decoded bytes over
//!   `zarrfusion.bytes_per_task`) and how its blocks are dealt to them.
//! - [`reductions`]: a dense reduction on a cluster: each task's partial
//!   states, merged by DataFusion's final aggregate after a shuffle.
//! - [`copies`]: a `COPY` of a whole table on a cluster: the workers write
//!   the target's chunks (the rechunk's tasks), the session stages the
//!   target and commits it.
//! - [`broadcasts`]: a join of a grid with a small result keyed by some
//!   of its dimensions (an anomaly) on a cluster: the small side runs as a
//!   stage of its own and its rows are broadcast to the grid's tasks.
//! - [`transforms`]: a transform on the four-step path on a cluster: the
//!   workers run its two passes' blocks, a stage each, into a scratch
//!   store the session made; the session reads the output.
//! - [`in_order`]: a stage's tasks gathered one after the other (a
//!   reduction's runs of bands of a later dimension, in band order).
//! - [`barrier`]: rounds that run one after the other on the workers
//!   (each task of a round waits for every count of the previous one).
//! - [`cluster`]: a session's side: the workers' addresses and the
//!   distributed planner, added to the session state ([`crate::session`]
//!   builds it).
//! - [`stages`]: every stage the workers run encoded once while planning,
//!   so a node that cannot travel fails the query at once, named.
//! - [`channel`]: how workers are reached: keep-alive pings that notice a
//!   worker gone quiet, errors naming the worker, stage and task.
//! - [`worker`]: a worker's side: the session each query gets (zarrfusion's
//!   functions, settings and codec, the worker's memory limit) and the gRPC
//!   server.
//!
//! ```no_run
//! # async fn example() -> datafusion::error::Result<()> {
//! use zarrfusion::distributed::parse_workers;
//! use zarrfusion::{distributed_context, session_config, ZarrContextExt};
//! use std::collections::HashMap;
//! use std::sync::Arc;
//!
//! // `zarrfusion worker --listen 127.0.0.1:50051` runs on each machine.
//! let workers = parse_workers("127.0.0.1:50051,127.0.0.1:50052")?;
//! let runtime = Arc::new(datafusion::execution::runtime_env::RuntimeEnv::default());
//! let ctx = distributed_context(session_config(), runtime, workers);
//! ctx.register_zarr("era5", "s3://bucket/era5.zarr", HashMap::new()).await?;
//! ctx.sql("SELECT lat, avg(t2m) FROM era5 GROUP BY lat").await?.show().await?;
//! # Ok(())
//! # }
//! ```
//!
//! The protocol is unauthenticated: workers must listen on a private
//! network (or behind a TLS-terminating proxy), and a plan carries its
//! tables' options, credentials given in `OPTIONS` included (credentials
//! from the workers' own environment travel nowhere).

pub mod barrier;
pub mod broadcasts;
pub mod channel;
pub mod cluster;
pub mod codec;
pub mod copies;
pub mod in_order;
pub mod reductions;
pub mod stages;
pub mod tasks;
pub mod transforms;
pub mod worker;

pub(crate) use cluster::keep_partial_aggregates;
pub use cluster::{distribute, parse_workers, ClusterWorkers};
pub use codec::ZarrCodec;
pub use worker::{serve_worker, worker_session};

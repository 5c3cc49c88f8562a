//! The engine's integration tests, one module a subject, in one test binary.
//!
//! Every test binary links the whole engine, DataFusion and the object-store
//! clients (about 290 MB each); built one file a binary, the integration
//! tests were 16 such links and 16 instantiations of the same generic code,
//! most of a cold CI run. Here they link once. Run one subject with a filter
//! on its module, e.g. `cargo test --test integration distributed::`.
//!
//! Tests that need a process of their own stay apart: `heap_budget.rs`
//! (its counting global allocator), `docs_sql.rs` (runs the docs' SQL from
//! a scratch working directory) and `module_layers.rs` (reads the sources,
//! links no engine). Tests here may set the working directory only to the
//! repository's root (some read fixtures by relative paths).

#[path = "../common/mod.rs"]
mod common;

mod aligned_join;
mod allowed_locations;
mod bad_input;
mod broadcast_join;
mod chunk_files;
mod copy_to_zarr;
mod dense_reduction;
mod differential;
mod differential_fft;
mod distributed;
mod explain;
mod fft;
mod fixtures;
mod fuzz;
mod memory_limit;
mod object_store;
mod rechunk;
mod rolling_window;
mod sorted_output;
mod sqllogictest;

//! `zarrfusion`: the SQL shell over Zarr stores.
//!
//! ```text
//! zarrfusion                                 # interactive shell
//! zarrfusion -c "SELECT 1" -c "SELECT 2"     # run commands and exit
//! zarrfusion -f sql-examples/02_zonal_mean.sql --format csv -q
//! ```

mod args;
mod commands;
mod exec;
mod output;
mod progress;
mod repl;

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::prelude::SessionContext;

use crate::args::Args;
use crate::exec::Shell;

/// mimalloc keeps freed chunk buffers for reuse instead of handing them back
/// to the system at once, so decoding a store does not page-fault on every
/// chunk (as in the Python module).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // A bug must never print a Rust backtrace at a user: one line, exit 1.
    std::panic::set_hook(Box::new(|info| {
        eprintln!("Error: internal error: {info}");
    }));
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("Error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| runtime.block_on(run(args))));
    // The runtime is not shut down on the way out: a statement cancelled
    // with Ctrl-C may leave blocking work behind it (a store being opened,
    // waiting on the network), which would fail on a runtime shutting down
    // (or keep the process waiting for it); the process ends at once.
    std::mem::forget(runtime);
    match result {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(message)) => {
            eprintln!("Error: {message}");
            ExitCode::FAILURE
        }
        Err(_) => ExitCode::FAILURE,
    }
}

async fn run(args: Args) -> Result<(), String> {
    let ctx = build_context(&args)?;
    let mut shell = Shell::new(ctx, args.format, args.quiet);
    if args.command.is_empty() && args.file.is_empty() {
        return repl::run(&mut shell).await.map_err(|e| e.to_string());
    }
    for command in &args.command {
        shell.run_text(command).await?;
    }
    for file in &args.file {
        let text = std::fs::read_to_string(file)
            .map_err(|e| format!("cannot read {}: {e}", file.display()))?;
        shell.run_text(&text).await?;
    }
    Ok(())
}

fn build_context(args: &Args) -> Result<SessionContext, String> {
    let mut builder = RuntimeEnvBuilder::new();
    if let Some(limit) = &args.memory_limit {
        let bytes =
            zarrfusion::memory::parse_size(limit).map_err(|e| format!("--memory-limit: {e}"))?;
        builder = builder.with_memory_limit(bytes, 1.0);
    }
    let mut config = zarrfusion::session_config();
    // A local directory also takes DataFusion's spill files; an
    // object-store URL takes the intermediate arrays only.
    if let Some(dir) = &args.work_dir {
        match zarrfusion::zarr::StoreLocation::parse(dir).map_err(|e| format!("--work-dir: {e}"))? {
            zarrfusion::zarr::StoreLocation::Local(path) => {
                std::fs::create_dir_all(&path)
                    .map_err(|e| format!("--work-dir {}: {e}", path.display()))?;
                builder = builder.with_temp_file_path(path);
            }
            zarrfusion::zarr::StoreLocation::Remote(url) => {
                config
                    .options_mut()
                    .set("zarrfusion.work_dir", url.as_str())
                    .map_err(|e| format!("--work-dir: {e}"))?;
            }
        }
    }
    if let Some(device) = &args.device {
        config
            .options_mut()
            .set("zarrfusion.device", device)
            .map_err(|e| format!("--device: {e}"))?;
    }
    if let Some(n) = args.io_concurrency {
        config
            .options_mut()
            .set("zarrfusion.io_concurrency", &n.to_string())
            .map_err(|e| format!("--io-concurrency: {e}"))?;
    }
    if !args.allow.is_empty() {
        let list = args.allow.join(",");
        zarrfusion::zarr::AllowedLocations::parse(&list).map_err(|e| format!("--allow: {e}"))?;
        config
            .options_mut()
            .set("zarrfusion.allowed_locations", &list)
            .map_err(|e| format!("--allow: {e}"))?;
    }
    let runtime = builder.build_arc().map_err(|e| e.to_string())?;
    if let Some(batch_size) = args.batch_size {
        config = config.with_batch_size(batch_size);
    }
    Ok(zarrfusion::new_context_with(config, Arc::clone(&runtime)))
}

//! `zarrfusion`: the SQL shell over Zarr stores.
//!
//! ```text
//! zarrfusion                                 # interactive shell
//! zarrfusion -c "SELECT 1" -c "SELECT 2"     # run commands and exit
//! zarrfusion -f sql-examples/02_zonal_mean.sql --format csv -q
//! zarrfusion worker --listen 0.0.0.0:50051   # serve a cluster's tasks
//! zarrfusion --workers host1:50051,host2:50051 -c "SELECT ..."
//! ```

mod args;
mod commands;
mod exec;
mod output;
mod progress;
mod repl;

use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use datafusion::execution::runtime_env::{RuntimeEnv, RuntimeEnvBuilder};
use datafusion::prelude::{SessionConfig, SessionContext};

use crate::args::{Args, Mode};
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
    if let Some(Mode::Worker { listen }) = &args.mode {
        return run_worker(&args, *listen).await;
    }
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

/// Serves a cluster's tasks on `listen` until Ctrl-C or SIGTERM.
async fn run_worker(args: &Args, listen: SocketAddr) -> Result<(), String> {
    if args.workers.is_some() || !args.command.is_empty() || !args.file.is_empty() {
        return Err("a worker runs no SQL of its own: --workers, -c and -f are the shell's".into());
    }
    let (config, runtime) = settings(args)?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    let address = listener
        .local_addr()
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    println!("zarrfusion worker listening on {address}");
    let _ = std::io::stdout().flush();
    let zarr = zarrfusion::ZarrConfig::of(config.options());
    zarrfusion::distributed::serve_worker(listener, zarr, runtime, stop_signal())
        .await
        .map_err(|e| e.to_string())
}

/// Completes at Ctrl-C or SIGTERM.
async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

fn build_context(args: &Args) -> Result<SessionContext, String> {
    let (config, runtime) = settings(args)?;
    Ok(match &args.workers {
        Some(list) => {
            let workers = zarrfusion::distributed::parse_workers(list)
                .map_err(|e| format!("--workers: {e}"))?;
            zarrfusion::distributed_context(config, runtime, workers)
        }
        None => zarrfusion::new_context_with(config, runtime),
    })
}

/// The session's configuration and runtime the arguments ask for.
fn settings(args: &Args) -> Result<(SessionConfig, Arc<RuntimeEnv>), String> {
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
        zarrfusion::config::check_setting("zarrfusion.io_concurrency", &n.to_string())
            .map_err(|e| format!("--io-concurrency: {e}"))?;
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
        zarrfusion::config::check_setting(
            "datafusion.execution.batch_size",
            &batch_size.to_string(),
        )
        .map_err(|e| format!("--batch-size: {e}"))?;
        config = config.with_batch_size(batch_size.max(1));
    }
    Ok((config, runtime))
}

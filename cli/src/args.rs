//! Command-line arguments.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

/// How results are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// A bordered table.
    Table,
    /// CSV with a header line.
    Csv,
    /// One JSON array of objects per result.
    Json,
    /// One JSON object per row.
    Ndjson,
}

/// The zarrfusion SQL shell: Zarr stores as SQL tables.
#[derive(Debug, Parser)]
#[command(name = "zarrfusion", version, about)]
pub struct Args {
    /// Run SQL (or a backslash command) and exit; repeatable, run in order.
    #[arg(short = 'c', long = "command")]
    pub command: Vec<String>,

    /// Run the SQL statements in a file and exit; repeatable, run after -c.
    #[arg(short = 'f', long = "file", num_args = 1..)]
    pub file: Vec<PathBuf>,

    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,

    /// Memory the query engine may use, like 2GB or 512MB.
    #[arg(short = 'm', long = "memory-limit", global = true)]
    pub memory_limit: Option<String>,

    /// Where intermediates go: a directory (also for spills) or an
    /// object-store URL (intermediate arrays).
    #[arg(long = "work-dir", global = true)]
    pub work_dir: Option<String>,

    /// Where FFTs run: auto (a GPU when one is usable, else the CPU), cpu
    /// or cuda (`SET zarrfusion.device`).
    #[arg(long = "device")]
    pub device: Option<String>,

    /// Object-store reads kept in flight ahead of the decoders, per
    /// operator (`SET zarrfusion.io_concurrency`; default 64; 0: none).
    #[arg(long = "io-concurrency")]
    pub io_concurrency: Option<u64>,

    /// Restrict the locations statements may read, write and work in to
    /// these directories and URL prefixes (repeatable; default: any), for
    /// a shell that runs SQL written by others. SQL cannot change it.
    #[arg(long = "allow", value_name = "LOCATION", global = true)]
    pub allow: Vec<String>,

    /// Rows per record batch (at most 16,777,216).
    #[arg(long = "batch-size")]
    pub batch_size: Option<usize>,

    /// Print results only: no banner, row counts, timing or progress.
    #[arg(short = 'q', long)]
    pub quiet: bool,

    /// Run queries on these workers (`zarrfusion worker` processes):
    /// comma-separated `host:port` or URLs.
    #[arg(long = "workers", value_name = "HOST:PORT,...")]
    pub workers: Option<String>,

    /// What to run (default: the shell).
    #[command(subcommand)]
    pub mode: Option<Mode>,
}

/// What the binary runs besides the shell.
#[derive(Debug, Subcommand)]
pub enum Mode {
    /// Serve a cluster's tasks (datafusion-distributed over gRPC) until
    /// Ctrl-C or SIGTERM. The protocol is unauthenticated: listen on a
    /// private network. --memory-limit is this worker's allowed_mem,
    /// --allow its allowed locations (the sender's are not used), --work-dir
    /// where it spills; they may come before or after `worker`.
    Worker {
        /// Address to listen on, like 0.0.0.0:50051 (port 0: any free port;
        /// the address is printed on stdout once listening).
        #[arg(long, value_name = "ADDR")]
        listen: SocketAddr,
    },
}

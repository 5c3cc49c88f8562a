//! Running SQL text: split into statements, plan, execute, print.

use std::io::{IsTerminal, Write};
use std::time::Instant;

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::error::ArrowError;
use datafusion::error::DataFusionError;
use datafusion::prelude::SessionContext;
use datafusion::sql::parser::{DFParser, Statement};
use futures::StreamExt;
use zarrfusion::zarr::NetworkStats;

use crate::args::Format;
use crate::commands;
use crate::output::write_batches;
use crate::progress::ProgressBar;

/// The shell's state: the session and how to print.
pub struct Shell {
    /// The session queries run in.
    pub ctx: SessionContext,
    format: Format,
    quiet: bool,
}

impl Shell {
    /// A shell over `ctx`.
    pub fn new(ctx: SessionContext, format: Format, quiet: bool) -> Self {
        Self { ctx, format, quiet }
    }

    /// Runs a backslash command or SQL text (one or more statements).
    /// Stops at the first error.
    pub async fn run_text(&mut self, text: &str) -> Result<(), String> {
        let trimmed = text.trim();
        let sql = if trimmed.starts_with('\\') {
            match commands::run(trimmed)? {
                commands::Outcome::Done => return Ok(()),
                commands::Outcome::Quit => std::process::exit(0),
                commands::Outcome::Sql(sql) => sql,
                commands::Outcome::Draw { sql, analyze, svg } => {
                    return self.draw(&sql, analyze, svg.as_deref()).await;
                }
            }
        } else {
            text.to_string()
        };
        let statements = DFParser::parse_sql(&sql).map_err(|e| e.to_string())?;
        for statement in statements {
            self.run_statement(statement).await?;
        }
        Ok(())
    }

    /// Prints the plan of `sql` as DOT, or writes it as SVG to `svg`.
    async fn draw(&self, sql: &str, analyze: bool, svg: Option<&str>) -> Result<(), String> {
        let df = zarrfusion::session::sql(&self.ctx, sql)
            .await
            .map_err(|e| describe_error(&e))?;
        let dot = zarrfusion::explain::plan_dot(df, analyze)
            .await
            .map_err(|e| describe_error(&e))?;
        match svg {
            None => println!("{dot}"),
            Some(path) => {
                let image =
                    zarrfusion::explain::render_svg(&dot).map_err(|e| describe_error(&e))?;
                std::fs::write(path, image).map_err(|e| format!("cannot write '{path}': {e}"))?;
                if !self.quiet {
                    println!("plan drawn in {path}");
                }
            }
        }
        Ok(())
    }

    async fn run_statement(&mut self, statement: Statement) -> Result<(), String> {
        let start = Instant::now();
        let network_before = zarrfusion::zarr::network_stats();
        let progress =
            ProgressBar::start(&self.ctx, !self.quiet && std::io::stderr().is_terminal());
        let result = tokio::select! {
            r = self.execute(statement) => r,
            _ = tokio::signal::ctrl_c() => Err(DataFusionError::Execution("query cancelled".into())),
        };
        progress.finish();
        let (schema, batches) = result.map_err(|e| describe_error(&e))?;
        // Line-buffered stdout would make one system call per CSV row.
        let mut stdout = std::io::BufWriter::with_capacity(1 << 16, std::io::stdout().lock());
        if let Err(e) = write_batches(&mut stdout, self.format, &schema, &batches) {
            // The reader went away (`zarrfusion ... | head`): stop quietly, as Unix tools do.
            if is_broken_pipe(&e) {
                std::process::exit(0);
            }
            return Err(e.to_string());
        }
        if !self.quiet {
            let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
            let network = zarrfusion::zarr::network_stats().since(&network_before);
            let requests = match network {
                NetworkStats { requests: 0, .. } => String::new(),
                NetworkStats {
                    requests,
                    errors,
                    not_modified: 0,
                } => format!(
                    " {requests} request(s) to object storage, {errors} failed and retried."
                ),
                NetworkStats {
                    requests,
                    errors,
                    not_modified,
                } => format!(
                    " {requests} request(s) to object storage, {errors} failed and retried, {not_modified} found unchanged (cached)."
                ),
            };
            let _ = writeln!(
                stdout,
                "{rows} row(s) fetched. Elapsed {:.3} seconds.{requests}\n",
                start.elapsed().as_secs_f64()
            );
        }
        let _ = stdout.flush();
        Ok(())
    }

    async fn execute(
        &self,
        statement: Statement,
    ) -> Result<(datafusion::arrow::datatypes::SchemaRef, Vec<RecordBatch>), DataFusionError> {
        let plan = self.ctx.state().statement_to_plan(statement).await?;
        let df = zarrfusion::session::execute_plan(&self.ctx, plan).await?;
        let schema = df.schema().inner().clone();
        let mut stream = df.execute_stream().await?;
        let mut batches = Vec::new();
        while let Some(batch) = stream.next().await {
            batches.push(batch?);
        }
        Ok((schema, batches))
    }
}

/// The message of an error, without DataFusion's wrapping noise.
pub fn describe_error(error: &DataFusionError) -> String {
    match error {
        DataFusionError::External(e) => e.to_string(),
        DataFusionError::Context(context, inner) => {
            format!("{context}: {}", describe_error(inner))
        }
        other => other.to_string(),
    }
}

/// Whether writing failed because the reader closed the pipe (the CSV
/// writer reports it as a message, the others as an I/O error).
fn is_broken_pipe(e: &ArrowError) -> bool {
    match e {
        ArrowError::IoError(_, io) => io.kind() == std::io::ErrorKind::BrokenPipe,
        other => other.to_string().contains("Broken pipe"),
    }
}

//! Backslash commands: `\d`, `\d name`, `\dot`, `\svg`, `\q`, `\?`.

/// What the shell does after a command.
pub enum Outcome {
    /// Nothing more: the command printed what it had to.
    Done,
    /// Run this SQL.
    Sql(String),
    /// Draw this SQL's plan: DOT on stdout, or SVG into a file.
    Draw {
        /// The query.
        sql: String,
        /// Run it first and show each operator's metrics.
        analyze: bool,
        /// Where the SVG goes; `None`: print DOT.
        svg: Option<String>,
    },
    /// Leave the shell.
    Quit,
}

const HELP: &str = "\
Commands:
  \\d            list tables
  \\d NAME       describe a table's columns
  \\q            quit
  \\?            this help
SQL statements end with ';'. Register a store with:
  CREATE EXTERNAL TABLE era5 STORED AS ZARR LOCATION 'demo/era5.zarr';
  SELECT * FROM read_zarr('demo/era5.zarr') LIMIT 5;";

/// `[analyze] QUERY` after a drawing command.
fn draw(rest: &str, svg: Option<String>) -> Result<Outcome, String> {
    let rest = rest.trim().trim_end_matches(';').trim();
    let (analyze, sql) = match rest.split_once(char::is_whitespace) {
        Some((first, sql)) if first.eq_ignore_ascii_case("analyze") => (true, sql.trim()),
        _ => (false, rest),
    };
    if sql.is_empty() {
        return Err("\\dot and \\svg take a query: \\dot SELECT ...".to_string());
    }
    Ok(Outcome::Draw {
        sql: sql.to_string(),
        analyze,
        svg,
    })
}

/// Interprets one backslash command.
pub fn run(command: &str) -> Result<Outcome, String> {
    let command = command.trim();
    if let Some(rest) = command.strip_prefix("\\dot ") {
        return draw(rest, None);
    }
    if let Some(rest) = command.strip_prefix("\\svg ") {
        let rest = rest.trim_start();
        let (file, query) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
        return draw(query, Some(file.to_string()));
    }
    let mut words = command.trim_end_matches(';').split_whitespace();
    match (words.next(), words.next(), words.next()) {
        (Some("\\q"), None, _) => Ok(Outcome::Quit),
        (Some("\\?"), None, _) => {
            println!("{HELP}");
            Ok(Outcome::Done)
        }
        (Some("\\d"), None, _) => Ok(Outcome::Sql(
            "SELECT table_catalog, table_schema, table_name, table_type \
             FROM information_schema.tables \
             WHERE table_schema <> 'information_schema' \
             ORDER BY table_schema, table_name"
                .to_string(),
        )),
        (Some("\\d"), Some(name), None) => Ok(Outcome::Sql(format!("DESCRIBE {name}"))),
        _ => Err(format!(
            "unknown command '{command}'; \\? lists the commands"
        )),
    }
}

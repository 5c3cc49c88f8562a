//! Backslash commands: `\d`, `\d name`, `\q`, `\?`.

/// What the shell does after a command.
pub enum Outcome {
    /// Nothing more: the command printed what it had to.
    Done,
    /// Run this SQL.
    Sql(String),
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

/// Interprets one backslash command.
pub fn run(command: &str) -> Result<Outcome, String> {
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

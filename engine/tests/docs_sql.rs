//! The SQL the documentation shows runs as written.
//!
//! Every fenced `sql` block of `README.md` and `docs/*.md` is read, its
//! statements split at the `;` ending a line, and:
//!
//! - in a block fenced ` ```sql `, each statement is planned and run to the
//!   end, in order, in one session per page (a page's blocks build on each
//!   other: its first block registers the tables the rest use), from a
//!   scratch directory where `demo/` is the repository's demo data, so
//!   relative paths read the demo and writes land in the scratch;
//! - the `-- ` comment lines that follow an `EXPLAIN` are what its plan
//!   shows: their text, `...` standing for anything, must appear in the
//!   physical plan in order (whitespace and line breaks aside);
//! - a block fenced ` ```sql no_run ` (a bucket, credentials) is parsed only.
//!
//! Syntax templates (`[IF NOT EXISTS]`) belong in `text` blocks. The answers
//! themselves are checked against xarray by the other tests; this keeps the
//! pages honest.

mod common;

use datafusion::arrow::array::{AsArray, RecordBatch};

/// One fenced `sql` block: where it starts, whether it runs, its text.
struct Block {
    line: usize,
    run: bool,
    text: String,
}

/// The `sql` blocks of a Markdown page, indented ones (inside list items)
/// included, with their indentation removed.
fn sql_blocks(page: &str) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut lines = page.lines().enumerate();
    while let Some((number, line)) = lines.next() {
        let indent = line.len() - line.trim_start().len();
        let Some(info) = line.trim_start().strip_prefix("```") else {
            continue;
        };
        let mut words = info.split_whitespace();
        let is_sql = words.next() == Some("sql");
        let no_run = words.any(|w| w == "no_run");
        let mut text = String::new();
        for (_, body) in lines.by_ref() {
            if body.trim_start().starts_with("```") {
                break;
            }
            text.push_str(body.get(indent..).unwrap_or(body.trim_start()));
            text.push('\n');
        }
        if is_sql {
            blocks.push(Block {
                line: number + 1,
                run: !no_run,
                text,
            });
        }
    }
    blocks
}

/// A statement of a block and, for an `EXPLAIN`, the comment lines after it.
struct Statement {
    sql: String,
    shown: Vec<String>,
}

/// `line` without a trailing `-- comment` (outside quotes).
fn code_of(line: &str) -> &str {
    let mut quoted = false;
    let bytes = line.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            b'\'' => quoted = !quoted,
            b'-' if !quoted && bytes.get(i + 1) == Some(&b'-') => return &line[..i],
            _ => {}
        }
    }
    line
}

/// Whether a statement's first code (comments aside) is an `EXPLAIN`.
fn is_explain(sql: &str) -> bool {
    let first = sql
        .lines()
        .map(|l| code_of(l).trim())
        .find(|l| !l.is_empty());
    first.is_some_and(|l| l.to_uppercase().starts_with("EXPLAIN"))
}

/// Splits a block into statements at the `;` that ends a line's code; the
/// comment lines right after an `EXPLAIN` (up to a blank line or code) are
/// what it shows.
fn statements(block: &str) -> Vec<Statement> {
    let mut out: Vec<Statement> = Vec::new();
    let mut current = String::new();
    let mut showing = false;
    for line in block.lines() {
        if showing {
            if let (Some(shown), Some(last)) =
                (line.trim_start().strip_prefix("--"), out.last_mut())
            {
                last.shown.push(shown.to_string());
                continue;
            }
            showing = false;
        }
        current.push_str(line);
        current.push('\n');
        if code_of(line).trim_end().ends_with(';') {
            showing = is_explain(&current);
            out.push(Statement {
                sql: std::mem::take(&mut current),
                shown: Vec::new(),
            });
        }
    }
    assert!(
        current.lines().all(|l| code_of(l).trim().is_empty()),
        "a statement without its `;`: {current}"
    );
    out
}

/// Whether `plan` shows `shown`: the pieces of `shown` between `...` appear
/// in `plan` in order, whitespace runs compared as one space.
fn shows(plan: &str, shown: &[String]) -> Result<(), String> {
    let squash = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
    let plan = squash(plan);
    let mut from = 0;
    for piece in squash(&shown.join(" ")).split("...") {
        let piece = piece.trim();
        if piece.is_empty() {
            continue;
        }
        match plan[from..].find(piece) {
            Some(at) => from += at + piece.len(),
            None => {
                return Err(format!(
                    "`{piece}` is not in the plan (after byte {from}):\n{plan}"
                ))
            }
        }
    }
    Ok(())
}

/// The physical plan of an `EXPLAIN`'s result, as text.
fn physical_plan(batches: &[RecordBatch]) -> String {
    let mut text = String::new();
    for batch in batches {
        let (Some(kind), Some(plan)) = (
            batch.column_by_name("plan_type"),
            batch.column_by_name("plan"),
        ) else {
            continue;
        };
        let (kind, plan) = (kind.as_string::<i32>(), plan.as_string::<i32>());
        for row in 0..batch.num_rows() {
            if kind.value(row) == "physical_plan" {
                text.push_str(plan.value(row));
                text.push('\n');
            }
        }
    }
    text
}

/// Runs (or parses) one page's blocks; the failures, each naming the page's
/// line and the statement, and how many statements ran.
async fn check_page(name: &str, page: &str) -> (Vec<String>, usize) {
    let ctx = zarrfusion::new_context();
    let dialect = ctx.state().config().options().sql_parser.dialect;
    let (mut failures, mut ran) = (Vec::new(), 0);
    for block in sql_blocks(page) {
        for statement in statements(&block.text) {
            let sql = statement.sql.trim();
            let place = format!("{name}:{} `{sql}`", block.line);
            if !block.run {
                if let Err(e) = ctx.state().sql_to_statement(sql, &dialect) {
                    failures.push(format!("{place}: does not parse: {e}"));
                }
                continue;
            }
            ran += 1;
            let batches = match zarrfusion::session::sql(&ctx, sql).await {
                Ok(df) => df.collect().await,
                Err(e) => Err(e),
            };
            match batches {
                Err(e) => failures.push(format!("{place}: {e}")),
                Ok(batches) if !statement.shown.is_empty() => {
                    if let Err(e) = shows(&physical_plan(&batches), &statement.shown) {
                        failures.push(format!("{place}: {e}"));
                    }
                }
                Ok(_) => {}
            }
        }
    }
    (failures, ran)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sql_in_the_docs_runs_as_shown() {
    let root = common::repo_root();
    let mut pages = vec![root.join("README.md")];
    let mut docs: Vec<_> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    let scratch = common::scratch("docs-sql");
    std::os::unix::fs::symlink(root.join("demo"), scratch.join("demo")).unwrap();
    std::env::set_current_dir(&*scratch).unwrap();
    let (mut failures, mut blocks, mut ran) = (Vec::new(), 0, 0);
    for page in &pages {
        let name = page
            .strip_prefix(&root)
            .unwrap_or(page)
            .display()
            .to_string();
        let text = std::fs::read_to_string(page).unwrap();
        blocks += sql_blocks(&text).len();
        let (failed, statements) = check_page(&name, &text).await;
        failures.extend(failed);
        ran += statements;
    }
    std::env::set_current_dir(root).unwrap();
    assert!(blocks >= 20, "only {blocks} sql blocks found in the docs");
    assert!(ran >= 40, "only {ran} statements of the docs ran");
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn blocks_statements_and_shown_plans_are_read_as_written() {
    let page = "text\n```sql\nSELECT 1; -- one\nSELECT 'a;--' ||\n  'b';\nEXPLAIN SELECT 2;\n-- Exec: a=...,\n--   b\n\n-- not shown\nSELECT 4;\n```\n  ```sql no_run\n  SELECT 3;\n  ```\n";
    let blocks = sql_blocks(page);
    assert_eq!(blocks.len(), 2);
    assert!(blocks[0].run && !blocks[1].run);
    assert_eq!((blocks[0].line, blocks[1].line), (2, 13));
    assert_eq!(blocks[1].text, "SELECT 3;\n");
    let parts = statements(&blocks[0].text);
    let sql: Vec<_> = parts.iter().map(|s| s.sql.trim()).collect();
    assert_eq!(
        sql,
        [
            "SELECT 1; -- one",
            "SELECT 'a;--' ||\n  'b';",
            "EXPLAIN SELECT 2;",
            "-- not shown\nSELECT 4;"
        ]
    );
    assert_eq!(parts[2].shown, [" Exec: a=...,", "   b"]);
    assert!(parts[3].shown.is_empty() && !is_explain(&parts[3].sql));
    assert!(shows("Exec: a=12, b=3\n  Scan", &parts[2].shown).is_ok());
    assert!(shows("Exec: a=12,\n b", &["Exec: a=...,".into(), "b".into()]).is_ok());
    assert!(shows("Exec: b, a=1,", &["Exec: a=...,".into(), "b".into()]).is_err());
}

//! Runs the sqllogictest files in `tests/sqllogictest/` against a zarrfusion
//! session, from the repository's root (paths in the files are relative to it).

use std::path::PathBuf;

use async_trait::async_trait;
use datafusion::arrow::array::{Array, AsArray, RecordBatch};
use datafusion::arrow::datatypes::{DataType, Float32Type, Float64Type};
use datafusion::arrow::util::display::{ArrayFormatter, FormatOptions};
use datafusion::error::DataFusionError;
use datafusion::prelude::SessionContext;
use sqllogictest::{DBOutput, DefaultColumnType};

struct ZarrDb {
    ctx: SessionContext,
}

fn format_cell(array: &dyn Array, row: usize) -> Result<String, DataFusionError> {
    if array.is_null(row) {
        return Ok("NULL".into());
    }
    Ok(match array.data_type() {
        DataType::Float32 => format!("{}", array.as_primitive::<Float32Type>().value(row)),
        DataType::Float64 => format!("{}", array.as_primitive::<Float64Type>().value(row)),
        _ => {
            let text = ArrayFormatter::try_new(array, &FormatOptions::default())?
                .value(row)
                .to_string();
            if text.is_empty() {
                "(empty)".into()
            } else {
                text
            }
        }
    })
}

fn column_type(data_type: &DataType) -> DefaultColumnType {
    match data_type {
        DataType::Int8
        | DataType::Int16
        | DataType::Int32
        | DataType::Int64
        | DataType::UInt8
        | DataType::UInt16
        | DataType::UInt32
        | DataType::UInt64 => DefaultColumnType::Integer,
        DataType::Float16 | DataType::Float32 | DataType::Float64 | DataType::Decimal128(_, _) => {
            DefaultColumnType::FloatingPoint
        }
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => DefaultColumnType::Text,
        _ => DefaultColumnType::Any,
    }
}

#[async_trait]
impl sqllogictest::AsyncDB for ZarrDb {
    type Error = DataFusionError;
    type ColumnType = DefaultColumnType;

    async fn run(&mut self, sql: &str) -> Result<DBOutput<DefaultColumnType>, DataFusionError> {
        // As the front doors run SQL (`SET zarrfusion.allowed_mem` applied).
        let df = zarrfusion::session::sql(&self.ctx, sql).await?;
        let schema = df.schema().inner().clone();
        let batches: Vec<RecordBatch> = df.collect().await?;
        if schema.fields().is_empty() {
            return Ok(DBOutput::StatementComplete(0));
        }
        let types = schema
            .fields()
            .iter()
            .map(|f| column_type(f.data_type()))
            .collect();
        let mut rows = Vec::new();
        for batch in &batches {
            for row in 0..batch.num_rows() {
                rows.push(
                    batch
                        .columns()
                        .iter()
                        .map(|c| format_cell(c.as_ref(), row))
                        .collect::<Result<Vec<_>, _>>()?,
                );
            }
        }
        Ok(DBOutput::Rows { types, rows })
    }

    async fn shutdown(&mut self) {}

    fn engine_name(&self) -> &str {
        "zarrfusion"
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqllogictest_files() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    std::env::set_current_dir(&root).unwrap();
    let mut files: Vec<PathBuf> = std::fs::read_dir(root.join("tests/sqllogictest"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "slt"))
        .collect();
    files.sort();
    assert!(!files.is_empty());
    let mut failures = Vec::new();
    for file in &files {
        let mut runner = sqllogictest::Runner::new(|| async {
            Ok(ZarrDb {
                ctx: zarrfusion::new_context(),
            })
        });
        if let Err(e) = runner.run_file_async(file).await {
            failures.push(format!("{}: {e}", file.display()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

//! Printing results as a table, CSV, JSON or NDJSON.

use std::io::Write;

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::error::ArrowError;
use datafusion::arrow::util::pretty::pretty_format_batches;

use crate::args::Format;

/// Writes one statement's result in `format`. Empty results still print
/// their header (table and CSV).
pub fn write_batches(
    out: &mut dyn Write,
    format: Format,
    schema: &SchemaRef,
    batches: &[RecordBatch],
) -> Result<(), ArrowError> {
    // Statements without a result (CREATE, SET) print nothing.
    if schema.fields().is_empty() {
        return Ok(());
    }
    let empty;
    let batches = if batches.iter().all(|b| b.num_rows() == 0) {
        empty = [RecordBatch::new_empty(schema.clone())];
        &empty[..]
    } else {
        batches
    };
    match format {
        Format::Table => {
            writeln!(out, "{}", pretty_format_batches(batches)?)?;
        }
        Format::Csv => {
            let mut writer = arrow::csv::WriterBuilder::new()
                .with_header(true)
                .build(&mut *out);
            for batch in batches {
                writer.write(batch)?;
            }
        }
        Format::Json => {
            let mut writer = arrow::json::ArrayWriter::new(&mut *out);
            for batch in batches {
                writer.write(batch)?;
            }
            writer.finish()?;
            writeln!(out)?;
        }
        Format::Ndjson => {
            let mut writer = arrow::json::LineDelimitedWriter::new(&mut *out);
            for batch in batches {
                writer.write(batch)?;
            }
            writer.finish()?;
        }
    }
    Ok(())
}

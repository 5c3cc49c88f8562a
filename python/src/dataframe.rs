//! `DataFrame`: a lazy query. Building it plans; running it (`collect`,
//! the Arrow C stream export, `show`, `count`) executes with the GIL
//! released and can be cancelled with Ctrl-C.
//!
//! Expressions are SQL text, parsed against the frame's schema:
//! `df.filter("lat > 10").select("lat", "t2m * 2 AS t").sort("lat DESC")`.

use std::collections::HashMap;
use std::ffi::CStr;
use std::sync::{Arc, Mutex};

use arrow::array::AsArray;
use arrow::datatypes::SchemaRef;
use arrow::datatypes::UInt64Type;
use arrow::error::ArrowError;
use arrow::ffi::FFI_ArrowSchema;
use arrow::ffi_stream::FFI_ArrowArrayStream;
use arrow::record_batch::{RecordBatch, RecordBatchIterator};
use arrow::util::pretty::pretty_format_batches;
use datafusion::datasource::file_format::format_as_file_type;
use datafusion::logical_expr::{Expr, LogicalPlanBuilder, SortExpr};
use datafusion::prelude::DataFrame;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

use zarrfusion::array::fft::{fft_plan, FftOptions};
use zarrfusion::array::rechunk::rechunk_plan;
use zarrfusion::explain::{plan_dot, render_svg};
use zarrfusion::write::{ZarrFormatFactory, ZarrWriteOptions};

use crate::arguments::rows_argument;
use crate::errors::datafusion_error;
use crate::runtime::wait_for;

const STREAM_NAME: &CStr = c"arrow_array_stream";
const SCHEMA_NAME: &CStr = c"arrow_schema";

/// A query over registered tables, planned but not run.
#[pyclass(name = "DataFrame", module = "zarrfusion._zarrfusion", frozen)]
pub struct PyDataFrame {
    df: DataFrame,
}

impl PyDataFrame {
    /// Wraps a DataFusion data frame.
    pub fn new(df: DataFrame) -> Self {
        Self { df }
    }

    fn parse(&self, argument: &str, sql: &str) -> PyResult<Expr> {
        self.df
            .parse_sql_expr(sql)
            .map_err(|e| PyValueError::new_err(format!("{argument}: cannot use '{sql}': {e}")))
    }

    fn parse_sort(&self, sql: &str) -> PyResult<SortExpr> {
        let mut text = sql.trim();
        let mut nulls_first = None;
        let mut ascending = true;
        let upper = text.to_ascii_uppercase();
        for (suffix, first) in [(" NULLS FIRST", true), (" NULLS LAST", false)] {
            if upper.ends_with(suffix) {
                nulls_first = Some(first);
                text = text[..text.len() - suffix.len()].trim_end();
                break;
            }
        }
        let upper = text.to_ascii_uppercase();
        for (suffix, asc) in [(" ASC", true), (" DESC", false)] {
            if upper.ends_with(suffix) {
                ascending = asc;
                text = text[..text.len() - suffix.len()].trim_end();
                break;
            }
        }
        let expr = self.parse("sort", text)?;
        Ok(expr.sort(ascending, nulls_first.unwrap_or(!ascending)))
    }

    fn derive(&self, df: datafusion::error::Result<DataFrame>) -> PyResult<Self> {
        Ok(Self::new(df.map_err(datafusion_error)?))
    }

    fn run(&self, py: Python<'_>) -> PyResult<(SchemaRef, Vec<RecordBatch>)> {
        let df = self.df.clone();
        let schema = SchemaRef::new(df.schema().as_arrow().clone());
        let batches = wait_for(py, df.collect())?.map_err(datafusion_error)?;
        Ok((schema, batches))
    }
}

#[pymethods]
impl PyDataFrame {
    /// Keeps the given expressions (`"lat"`, `"t2m * 2 AS t"`).
    #[pyo3(signature = (*exprs))]
    fn select(&self, exprs: Vec<String>) -> PyResult<Self> {
        if exprs.is_empty() {
            return Err(PyValueError::new_err(
                "select: give at least one expression",
            ));
        }
        let exprs = exprs
            .iter()
            .map(|e| self.parse("select", e))
            .collect::<PyResult<Vec<_>>>()?;
        self.derive(self.df.clone().select(exprs))
    }

    /// Keeps the rows where `predicate` holds.
    fn filter(&self, predicate: &str) -> PyResult<Self> {
        let expr = self.parse("filter", predicate)?;
        self.derive(self.df.clone().filter(expr))
    }

    /// Groups by `group_by` and computes `aggs` (`["avg(t2m) AS t"]`).
    #[pyo3(signature = (group_by, aggs))]
    fn aggregate(&self, group_by: Vec<String>, aggs: Vec<String>) -> PyResult<Self> {
        let group = group_by
            .iter()
            .map(|e| self.parse("group_by", e))
            .collect::<PyResult<Vec<_>>>()?;
        let aggs = aggs
            .iter()
            .map(|e| self.parse("aggs", e))
            .collect::<PyResult<Vec<_>>>()?;
        self.derive(self.df.clone().aggregate(group, aggs))
    }

    /// Sorts by expressions with optional `ASC`/`DESC` and `NULLS FIRST`/`NULLS LAST`.
    #[pyo3(signature = (*exprs))]
    fn sort(&self, exprs: Vec<String>) -> PyResult<Self> {
        let exprs = exprs
            .iter()
            .map(|e| self.parse_sort(e))
            .collect::<PyResult<Vec<_>>>()?;
        self.derive(self.df.clone().sort(exprs))
    }

    /// At most `count` rows, after skipping `offset`: each from 0 to 2^63 - 1
    /// (DataFusion plans limits as `i64`; a larger one became "LIMIT must be
    /// >= 0, '-1' was provided").
    #[pyo3(signature = (count, offset=0))]
    fn limit(&self, count: i128, offset: i128) -> PyResult<Self> {
        let count = rows_argument("limit: count", count)?;
        let offset = rows_argument("limit: offset", offset)?;
        self.derive(self.df.clone().limit(offset, Some(count)))
    }

    /// The same rows read in new chunks: `chunks` maps dimensions to chunk
    /// lengths (see the `rechunk(...)` table function).
    fn rechunk(&self, chunks: HashMap<String, u64>) -> PyResult<Self> {
        let (state, plan) = self.df.clone().into_parts();
        let chunks: Vec<(String, u64)> = chunks.into_iter().collect();
        let plan = rechunk_plan(plan, chunks).map_err(datafusion_error)?;
        Ok(Self::new(DataFrame::new(state, plan)))
    }

    /// The forward (`inverse` false) or inverse FFT of `variable`, with
    /// the SQL functions' `name => value` options (see `fft(...)`).
    #[pyo3(signature = (variable, inverse, options))]
    fn fft(
        &self,
        variable: Option<String>,
        inverse: bool,
        options: Vec<(String, String)>,
    ) -> PyResult<Self> {
        let (state, plan) = self.df.clone().into_parts();
        let (mut fft, function) = if inverse {
            (FftOptions::inverse(Vec::new()), "ifft")
        } else {
            (FftOptions::forward(Vec::new()), "fft")
        };
        fft.set(&options, function).map_err(datafusion_error)?;
        let plan = fft_plan(plan, variable.as_deref(), fft).map_err(datafusion_error)?;
        Ok(Self::new(DataFrame::new(state, plan)))
    }

    /// Column names.
    #[getter]
    fn columns(&self) -> Vec<String> {
        self.df
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect()
    }

    /// The Arrow schema, for `pyarrow.schema(df)`.
    fn __arrow_c_schema__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyCapsule>> {
        let schema = FFI_ArrowSchema::try_from(self.df.schema().as_arrow())
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        PyCapsule::new_with_value(py, schema, SCHEMA_NAME)
    }

    /// Runs the query and returns its batches as an Arrow C stream
    /// (`pyarrow.table(df)`, `polars.from_arrow`, DuckDB): the batches are
    /// handed over without a copy.
    #[pyo3(signature = (requested_schema=None))]
    fn __arrow_c_stream__<'py>(
        &self,
        py: Python<'py>,
        requested_schema: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        let _ = requested_schema;
        let (schema, batches) = self.run(py)?;
        export_stream(py, schema, batches)
    }

    /// Runs the query; the result exports itself as an Arrow C stream.
    fn _collect(&self, py: Python<'_>) -> PyResult<PyRecordBatchStream> {
        let (schema, batches) = self.run(py)?;
        Ok(PyRecordBatchStream {
            batches: Mutex::new(Some((schema, batches))),
        })
    }

    /// Number of rows.
    fn count(&self, py: Python<'_>) -> PyResult<usize> {
        wait_for(py, self.df.clone().count())?.map_err(datafusion_error)
    }

    /// The first `n` rows as a text table.
    #[pyo3(signature = (n=20))]
    fn _show(&self, py: Python<'_>, n: i128) -> PyResult<String> {
        let n = rows_argument("show: n", n)?;
        let limited = Self::new(
            self.df
                .clone()
                .limit(0, Some(n))
                .map_err(datafusion_error)?,
        );
        let (_, batches) = limited.run(py)?;
        pretty_format_batches(&batches)
            .map(|t| t.to_string())
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// The plan as text (`analyze` runs the query and adds metrics).
    #[pyo3(signature = (verbose=false, analyze=false))]
    fn _explain(&self, py: Python<'_>, verbose: bool, analyze: bool) -> PyResult<String> {
        let explained = Self::new(
            self.df
                .clone()
                .explain(verbose, analyze)
                .map_err(datafusion_error)?,
        );
        let (_, batches) = explained.run(py)?;
        pretty_format_batches(&batches)
            .map(|t| t.to_string())
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// The physical plan as Graphviz DOT (`analyze` runs the query and adds
    /// each operator's metrics).
    #[pyo3(signature = (analyze=false))]
    fn _explain_dot(&self, py: Python<'_>, analyze: bool) -> PyResult<String> {
        wait_for(py, plan_dot(self.df.clone(), analyze))?.map_err(datafusion_error)
    }

    /// DOT text rendered as SVG by Graphviz's `dot`.
    #[staticmethod]
    fn _render_svg(py: Python<'_>, dot: String) -> PyResult<String> {
        let svg = py.detach(|| render_svg(&dot)).map_err(datafusion_error)?;
        Ok(String::from_utf8_lossy(&svg).into_owned())
    }

    /// Writes the result as a new Zarr store at `path` (`COPY ... STORED AS
    /// ZARR` with `options`: chunks, codec, zarr_format, dims). Returns the
    /// number of rows written.
    fn _to_zarr(
        &self,
        py: Python<'_>,
        path: String,
        options: HashMap<String, String>,
    ) -> PyResult<u64> {
        let options: HashMap<String, String> = options
            .into_iter()
            .map(|(k, v)| (format!("format.{k}"), v))
            .collect();
        ZarrWriteOptions::from_map(&options).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let (state, plan) = self.df.clone().into_parts();
        let copy = LogicalPlanBuilder::copy_to(
            plan,
            path,
            format_as_file_type(Arc::new(ZarrFormatFactory)),
            options,
            Vec::new(),
        )
        .and_then(|b| b.build())
        .map_err(datafusion_error)?;
        let (_, batches) = Self::new(DataFrame::new(state, copy)).run(py)?;
        Ok(batches
            .first()
            .and_then(|b| b.column(0).as_primitive_opt::<UInt64Type>())
            .map_or(0, |c| c.value(0)))
    }

    fn __repr__(&self) -> String {
        format!("DataFrame(columns={:?})", self.columns())
    }
}

/// Hands batches to a consumer of the Arrow C stream interface.
fn export_stream<'py>(
    py: Python<'py>,
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
) -> PyResult<Bound<'py, PyCapsule>> {
    let reader = RecordBatchIterator::new(batches.into_iter().map(Ok::<_, ArrowError>), schema);
    let stream = FFI_ArrowArrayStream::new(Box::new(reader));
    PyCapsule::new_with_value(py, stream, STREAM_NAME)
}

/// The batches of a query that has run, exported once as an Arrow C stream.
#[pyclass(name = "RecordBatchStream", module = "zarrfusion._zarrfusion", frozen)]
pub struct PyRecordBatchStream {
    batches: Mutex<Option<(SchemaRef, Vec<RecordBatch>)>>,
}

#[pymethods]
impl PyRecordBatchStream {
    /// The batches as an Arrow C stream (once).
    #[pyo3(signature = (requested_schema=None))]
    fn __arrow_c_stream__<'py>(
        &self,
        py: Python<'py>,
        requested_schema: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        let _ = requested_schema;
        let taken = self
            .batches
            .lock()
            .map_err(|_| PyRuntimeError::new_err("the result's lock is poisoned"))?
            .take();
        let (schema, batches) =
            taken.ok_or_else(|| PyRuntimeError::new_err("this result was already exported"))?;
        export_stream(py, schema, batches)
    }
}

//! Per-variable statistics of the cells windows are cut from, for
//! normalization: count, mean, standard deviation, minimum and maximum.
//!
//! They are computed by the engine's dense reduction (a SQL aggregate over
//! the table, the selection pushed into its scan), so they stream through
//! the data inside `allowed_mem` like any query, and are kept beside the
//! window index under a key that digests the store's fingerprints, the
//! variables and the selection (a miss recomputes; a cache that cannot be
//! written is ignored).

use std::sync::Arc;

use datafusion::arrow::array::{Array, AsArray};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Float64Type};
use datafusion::common::{Column, ScalarValue};
use datafusion::functions_aggregate::expr_fn::{avg, count, max, min, stddev_pop};
use datafusion::logical_expr::Expr;
use datafusion::prelude::{col, lit, SessionContext};
use md5::{Digest, Md5};

use super::sources::{Source, Sources};
use super::values::Scale;
use super::{IndexCache, WindowError};
use crate::table::{GridTable, Selection, ZarrTable};
use crate::zarr::ZarrArray;

/// Statistics of one variable over the selected cells (missing values left out).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Moments {
    /// Non-missing cells.
    pub count: u64,
    /// Their mean.
    pub mean: f64,
    /// Their population standard deviation.
    pub std: f64,
    /// The smallest.
    pub min: f64,
    /// The largest.
    pub max: f64,
}

impl Moments {
    /// The scale normalizing by these statistics: `(x - mean) / std`.
    pub fn scale(&self) -> Scale {
        Scale {
            mean: self.mean,
            std: self.std,
        }
    }
}

/// Statistics of every variable of `sources` (flat order) over each
/// source's selection, per part of the variable (`parts`, from
/// [`super::SampleLayout::parts`]: one index of each of its channel
/// dimensions, such as one pressure level), from `cache` when it holds them.
pub async fn statistics(
    ctx: &SessionContext,
    sources: &Sources,
    parts: &[Vec<Vec<(usize, u64)>>],
    cache: Option<&IndexCache>,
) -> Result<Vec<Vec<Moments>>, WindowError> {
    let mut out: Vec<Vec<Moments>> = vec![Vec::new(); sources.flat.len()];
    for (s, source) in sources.list.iter().enumerate() {
        let flat: Vec<usize> = (0..sources.flat.len())
            .filter(|&f| sources.flat[f].0 == s)
            .collect();
        // Every variable of a source has the same channel dimensions.
        let Some(source_parts) = flat.first().map(|&f| &parts[f]) else {
            continue;
        };
        for part in source_parts {
            let selection = part
                .iter()
                .fold(source.selection.clone(), |sel, &(d, k)| sel.only(d, k));
            let moments = source_statistics(ctx, source, &selection, cache).await?;
            for (&f, m) in flat.iter().zip(moments) {
                out[f].push(m);
            }
        }
    }
    Ok(out)
}

/// Statistics of the variables of one source over `selection`.
async fn source_statistics(
    ctx: &SessionContext,
    source: &Source,
    selection: &Selection,
    cache: Option<&IndexCache>,
) -> Result<Vec<Moments>, WindowError> {
    let table = &source.table;
    let key = match cache {
        Some(_) => Some(key(table, &source.variables, selection)?),
        None => None,
    };
    if let (Some(cache), Some(key)) = (cache, &key) {
        if let Some(found) = load(cache, key, source.variables.len()) {
            return Ok(found);
        }
    }
    let computed = compute(ctx, table, &source.variables, selection).await?;
    if let (Some(cache), Some(key)) = (cache, &key) {
        if let Err(e) = store(cache, key, &computed) {
            log::warn!(
                "statistics of {} not kept in {}: {e}",
                table.store,
                cache.dir()
            );
        }
    }
    Ok(computed)
}

/// Conditions on coordinates selecting `selection` of `table`: per
/// dimension not wholly selected, its ranges as `BETWEEN` first and last
/// coordinate (either way round, for descending coordinates).
fn selection_filter(table: &GridTable, selection: &Selection) -> Result<Vec<Expr>, WindowError> {
    let mut filters = Vec::new();
    for (d, dim) in table.dims.iter().enumerate() {
        let ranges = selection.ranges(d);
        if ranges.len() == 1 && ranges[0] == (0..dim.len) {
            continue;
        }
        let value = |i: u64| -> Result<Expr, WindowError> {
            let one = dim
                .coordinate
                .slice(i, 1)
                .map_err(|e| WindowError::Internal(e.to_string()))?;
            let scalar = ScalarValue::try_from_array(&one, 0)
                .map_err(|e| WindowError::Internal(e.to_string()))?;
            Ok(lit(scalar))
        };
        let column = col(Column::new_unqualified(&dim.name));
        let mut any: Option<Expr> = None;
        for r in ranges.iter().filter(|r| !r.is_empty()) {
            let (a, b) = (value(r.start)?, value(r.end - 1)?);
            let low = column
                .clone()
                .gt_eq(a.clone())
                .and(column.clone().lt_eq(b.clone()));
            let high = column.clone().gt_eq(b).and(column.clone().lt_eq(a));
            let one = low.or(high);
            any = Some(match any {
                None => one,
                Some(e) => e.or(one),
            });
        }
        filters.push(any.unwrap_or_else(|| lit(false)));
    }
    Ok(filters)
}

/// Runs the aggregate: one row of count, mean, std, min, max per variable.
async fn compute(
    ctx: &SessionContext,
    table: &Arc<GridTable>,
    variables: &[usize],
    selection: &Selection,
) -> Result<Vec<Moments>, WindowError> {
    let data = |e: datafusion::error::DataFusionError| {
        WindowError::Data(crate::error::ZarrFusionError::store(
            &table.store,
            e.to_string(),
        ))
    };
    let mut frame = ctx
        .read_table(Arc::new(ZarrTable::shared(Arc::clone(table))))
        .map_err(data)?;
    for filter in selection_filter(table, selection)? {
        frame = frame.filter(filter).map_err(data)?;
    }
    let mut aggregates = Vec::with_capacity(variables.len() * 5);
    for &v in variables {
        let name = table.variables[v].name();
        let c = col(format!("\"{name}\""));
        aggregates.push(count(c.clone()).alias(format!("{name}.count")));
        aggregates.push(avg(c.clone()).alias(format!("{name}.mean")));
        aggregates.push(stddev_pop(c.clone()).alias(format!("{name}.std")));
        aggregates.push(min(c.clone()).alias(format!("{name}.min")));
        aggregates.push(max(c).alias(format!("{name}.max")));
    }
    let batches = frame
        .aggregate(vec![], aggregates)
        .map_err(data)?
        .collect()
        .await
        .map_err(data)?;
    let Some(row) = batches.iter().find(|b| b.num_rows() > 0) else {
        return Err(WindowError::Internal(
            "the statistics query returned no row".into(),
        ));
    };
    let number = |i: usize| -> Result<f64, WindowError> {
        let column = cast(row.column(i), &DataType::Float64)
            .map_err(|e| WindowError::Internal(e.to_string()))?;
        let values = column.as_primitive::<Float64Type>();
        Ok(if values.is_null(0) {
            f64::NAN
        } else {
            values.value(0)
        })
    };
    (0..variables.len())
        .map(|k| {
            Ok(Moments {
                count: number(5 * k)? as u64,
                mean: number(5 * k + 1)?,
                std: number(5 * k + 2)?,
                min: number(5 * k + 3)?,
                max: number(5 * k + 4)?,
            })
        })
        .collect()
}

/// The cache key of the statistics of `variables` of `table` over `selection`.
fn key(
    table: &GridTable,
    variables: &[usize],
    selection: &Selection,
) -> Result<String, WindowError> {
    let mut digest = Md5::new();
    digest.update(format!("zarrfusion statistics 1\n{}\n{selection:?}\n", table.store).as_bytes());
    let variables: Vec<&ZarrArray> = variables.iter().map(|&v| &*table.variables[v]).collect();
    ZarrArray::fingerprint_all(&variables, &mut digest)?;
    Ok(format!("{:x}", digest.finalize()))
}

fn file_name(key: &str) -> String {
    format!("{key}.stats.json")
}

/// The statistics stored under `key`, when they are whole.
fn load(cache: &IndexCache, key: &str, n: usize) -> Option<Vec<Moments>> {
    // Five numbers a row, written by serde_json (at most 24 characters each).
    let limit = (n as u64).saturating_mul(5 * 32).saturating_add(64);
    let text = String::from_utf8(cache.dir().read(&file_name(key), limit)?).ok()?;
    let rows: Vec<Vec<f64>> = serde_json::from_str(&text).ok()?;
    if rows.len() != n || rows.iter().any(|r| r.len() != 5) {
        return None;
    }
    Some(
        rows.iter()
            .map(|r| Moments {
                count: r[0] as u64,
                mean: r[1],
                std: r[2],
                min: r[3],
                max: r[4],
            })
            .collect(),
    )
}

/// Stores `moments` under `key`, atomically (`NaN`, of a variable with no
/// value, is not JSON: such statistics are not kept).
fn store(cache: &IndexCache, key: &str, moments: &[Moments]) -> std::io::Result<()> {
    let rows: Vec<[f64; 5]> = moments
        .iter()
        .map(|m| [m.count as f64, m.mean, m.std, m.min, m.max])
        .collect();
    if rows.iter().flatten().any(|x| !x.is_finite()) {
        return Ok(());
    }
    let text = serde_json::to_string(&rows).map_err(std::io::Error::other)?;
    cache.dir().write(&file_name(key), text.as_bytes())
}

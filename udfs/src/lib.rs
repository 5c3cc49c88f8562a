//! Scalar functions over Arrow arrays used by zarrfusion.
//!
//! This crate does not know about Zarr stores or the engine: it holds the
//! pure conversions (CF time and its calendars first) and exposes them as DataFusion functions.
//! The engine reuses the conversions when it decodes coordinates and
//! registers the functions with every session, the way DataFusion's core
//! registers its own functions crates. Complex numbers are Arrow structs
//! of `re` and `im` ([`complex`]).
//!
//! | function | what it does |
//! |---|---|
//! | `cf_time(value, units [, calendar])` | numbers in CF units (`hours since 1900-01-01`) to timestamps |
//! | `date_part(part, time)`, `extract` | DataFusion's, with the day of the year and of the week of a model calendar's dates counted in its own days |
//! | `date_bin(stride, time [, origin])` | DataFusion's, with strides of days over a model calendar's dates counted in its own days |
//! | `date_trunc(unit, time)` | DataFusion's, with the week of a model calendar's dates starting on its own Mondays |
//! | `calendar_difference(a, b, calendar)` | `a - b` in a model calendar's days (what `-` of its times becomes) |
//! | `cf_date_part(part, numbers, units, calendar)`, `cf_date_trunc(unit, ...)`, `cf_date_bin(stride, numbers, origin, units, calendar)` | parts, periods and bins of the dates of a time column kept as CF numbers (a daily `360_day` calendar's; what `extract`, `date_trunc` and `date_bin` of it become) |
//! | `cf_date_add(numbers, step, units, calendar)`, `cf_date_subtract`, `cf_date_difference(a, b, units, calendar)` | steps and differences of the dates of a time column kept as CF numbers (what `+` and `-` of it become) |
//! | `calendar_add(time, step, calendar)`, `calendar_subtract` | a time plus or minus an interval over a model calendar's days (what `+` and `-` become) |
//! | `calendar_scale(time, calendar)` | a time of a model calendar on its own scale of days (what a `RANGE` frame's `ORDER BY` over its times becomes) |

// Input must never panic: no unwrap, expect or panic outside tests;
// an invariant proven where it is used is written without them.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

pub mod calendar;
pub mod calendar_arithmetic;
pub mod calendar_rewrite;
pub mod cf_numbers;
pub mod cf_time;
mod cf_time_udf;
pub mod complex;
pub mod date_bin;
pub mod date_part;
pub mod date_trunc;
pub mod model_calendar;

pub use calendar_arithmetic::{CalendarDifferenceFunc, CalendarScaleFunc, CalendarShiftFunc};
pub use calendar_rewrite::{CalendarExprPlanner, CalendarFunctionsRewrite};
pub use cf_numbers::{CfDateBinFunc, CfDateDifferenceFunc, CfDateFunc, CfDateShiftFunc};
pub use cf_time_udf::CfTimeFunc;
pub use date_bin::DateBinFunc;
pub use date_part::DatePartFunc;
pub use date_trunc::DateTruncFunc;

use std::sync::Arc;

use datafusion::logical_expr::ScalarUDF;

/// Every scalar function of this crate, ready to register with a session.
pub fn all_scalar_functions() -> Vec<Arc<ScalarUDF>> {
    vec![
        Arc::new(ScalarUDF::from(CfTimeFunc::new())),
        Arc::new(ScalarUDF::from(DatePartFunc::new())),
        Arc::new(ScalarUDF::from(DateBinFunc::new())),
        Arc::new(ScalarUDF::from(DateTruncFunc::new())),
        Arc::new(ScalarUDF::from(CalendarDifferenceFunc::new())),
        Arc::new(ScalarUDF::from(CalendarShiftFunc::add())),
        Arc::new(ScalarUDF::from(CalendarShiftFunc::subtract())),
        Arc::new(ScalarUDF::from(CalendarScaleFunc::new())),
        Arc::new(ScalarUDF::from(CfDateFunc::part())),
        Arc::new(ScalarUDF::from(CfDateFunc::trunc())),
        Arc::new(ScalarUDF::from(CfDateBinFunc::new())),
        Arc::new(ScalarUDF::from(CfDateShiftFunc::add())),
        Arc::new(ScalarUDF::from(CfDateShiftFunc::subtract())),
        Arc::new(ScalarUDF::from(CfDateDifferenceFunc::new())),
    ]
}

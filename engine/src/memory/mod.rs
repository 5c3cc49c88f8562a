//! Memory: sizes written by people (`2GB`, `512MB`), an operator's
//! projected memory as it reports it and the planner checks it
//! ([`Projection`]), the session's budget, which every operator's
//! projection is reserved in ([`reserve`]), and that budget's pool, which
//! keeps DataFusion's repartitions off a spill path that can stop a query
//! for good ([`UnspilledRepartitions`]).

mod pool;
mod projection;
mod reserve;
mod size;

pub use pool::{unspilled_repartitions, UnspilledRepartitions};
pub use projection::Projection;
pub use reserve::{reserve, Reservation};
pub use size::parse_size;

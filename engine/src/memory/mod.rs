//! Memory: sizes written by people (`2GB`, `512MB`), an operator's
//! projected memory as it reports it and the planner checks it
//! ([`Projection`]), and the session's budget, which every operator's
//! projection is reserved in ([`reserve`]).

mod projection;
mod reserve;
mod size;

pub use projection::Projection;
pub use reserve::{reserve, Reservation};
pub use size::parse_size;

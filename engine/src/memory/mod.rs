//! Memory: sizes written by people (`2GB`, `512MB`) and the session's
//! budget, which every operator's projected memory is reserved in.

mod reserve;
mod size;

pub use reserve::{reserve, Reservation};
pub use size::parse_size;

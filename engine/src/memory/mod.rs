//! Memory: sizes written by people (`2GB`, `512MB`) and the session's budget.

mod size;

pub use size::parse_size;

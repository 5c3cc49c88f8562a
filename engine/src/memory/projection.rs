//! An operator's projected memory, reported and checked one way.
//!
//! An operator runs units of work at once (its partitions, or its
//! workers), each holding as much as the others at its peak, beside what
//! is held once for all of them (a reduction's output, chunks read ahead,
//! tables joined in). [`Projection`] names those parts, adds them up
//! (what `EXPLAIN` shows as `projected_memory` and what a partition
//! reserves, [`super::reserve`]), and refuses a plan whose total exceeds
//! `allowed_mem` with every part in the message, so that its numbers add
//! up:
//!
//! ```
//! use zarrfusion::memory::Projection;
//!
//! let projection = Projection::new("ZarrScanExec", "era5.zarr", 2, "partition", 3 << 20)
//!     .holding("two blocks")
//!     .and(2 << 20, "tables joined in")
//!     .advice("raise it");
//! assert_eq!(projection.total(), 8 << 20);
//! let refused = projection.check(4 << 20).unwrap_err().to_string();
//! assert!(refused.contains(
//!     "ZarrScanExec over era5.zarr needs 8.0 MB (2 partitions x 3.0 MB per partition: two \
//!      blocks; and 2.0 MB of tables joined in) but the memory limit (allowed_mem) is 4.0 MB; \
//!      raise it"
//! ));
//! projection.check(8 << 20).unwrap();
//! ```

use datafusion::common::{human_readable_size, resources_datafusion_err, DataFusionError, Result};

/// What an operator projects to hold at its peak, in parts (see the
/// module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Projection {
    operator: &'static str,
    store: String,
    units: usize,
    unit: &'static str,
    per_unit: usize,
    /// What one unit holds, in words.
    held: String,
    /// What is held once for all the units: bytes, and what in words.
    shared: Vec<(usize, String)>,
    /// What to do when it does not fit.
    advice: String,
    /// The share of `allowed_mem` the limit checked is (`"half of"`), or
    /// empty for all of it.
    share: &'static str,
}

impl Projection {
    /// `units` units of work (`unit`: "partition", "worker") of
    /// `operator` over `store`, each holding `per_unit` bytes.
    pub fn new(
        operator: &'static str,
        store: &str,
        units: usize,
        unit: &'static str,
        per_unit: usize,
    ) -> Self {
        Self {
            operator,
            store: store.to_string(),
            units,
            unit,
            per_unit,
            held: String::new(),
            shared: Vec::new(),
            advice: "raise the limit".to_string(),
            share: "",
        }
    }

    /// With what one unit holds, in words.
    pub fn holding(mut self, held: impl Into<String>) -> Self {
        self.held = held.into();
        self
    }

    /// With `bytes` held once for all the units (`what`: "chunks read
    /// ahead"); named in a refusal unless they are none.
    pub fn and(mut self, bytes: usize, what: &str) -> Self {
        self.shared.push((bytes, what.to_string()));
        self
    }

    /// With what to do when it does not fit (`"raise the limit"` unless
    /// said).
    pub fn advice(mut self, advice: impl Into<String>) -> Self {
        self.advice = advice.into();
        self
    }

    /// With the limit it is checked against being `share` of
    /// `allowed_mem` (`"half of"`: a planner giving each of two steps
    /// half), as a refusal then says.
    pub fn share(mut self, share: &'static str) -> Self {
        self.share = share;
        self
    }

    /// The most it holds at once: every unit's and what is held once.
    pub fn total(&self) -> usize {
        (self.shared.iter()).fold(
            self.units.saturating_mul(self.per_unit),
            |total, (bytes, _)| total.saturating_add(*bytes),
        )
    }

    /// Refuses the operator, naming every part, when its total exceeds
    /// `limit`.
    pub fn check(&self, limit: usize) -> Result<()> {
        match self.total() <= limit {
            true => Ok(()),
            false => Err(self.refusal(limit)),
        }
    }

    /// The refusal [`Self::check`] gives, for a planner that found that
    /// nothing it could plan fits `limit` (this its least).
    pub fn refusal(&self, limit: usize) -> DataFusionError {
        let total = self.total();
        let shared: String = (self.shared.iter())
            .filter(|(bytes, _)| *bytes > 0)
            .map(|(bytes, what)| format!("; and {} of {what}", human_readable_size(*bytes)))
            .collect();
        let held = match self.held.as_str() {
            "" => String::new(),
            held => format!(": {held}"),
        };
        let plural = if self.units == 1 { "" } else { "s" };
        let share = match self.share {
            "" => String::new(),
            share => format!("{share} "),
        };
        resources_datafusion_err!(
            "{} over {} needs {} ({} {}{plural} x {} per {}{held}{shared}) but {share}the memory \
             limit (allowed_mem) is {}; {}",
            self.operator,
            self.store,
            human_readable_size(total),
            self.units,
            self.unit,
            human_readable_size(self.per_unit),
            self.unit,
            human_readable_size(limit),
            self.advice
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parts_add_up_and_a_refusal_names_those_held() {
        let projection = Projection::new("DenseReductionExec", "a.zarr", 3, "worker", 100)
            .holding("a block")
            .and(0, "chunks read ahead")
            .and(50, "the output and keys")
            .and(usize::MAX, "tables joined in");
        assert_eq!(projection.total(), usize::MAX);
        let text = projection.check(1000).unwrap_err().to_string();
        assert!(
            text.contains(
                "DenseReductionExec over a.zarr needs 16777216.0 TB (3 workers x 100.0 B per worker: \
                 a block; and 50.0 B of the output and keys; and 16777216.0 TB of tables joined in) \
                 but the memory limit (allowed_mem) is 1000.0 B; raise the limit"
            ),
            "{text}"
        );
        assert!(!text.contains("chunks read ahead"), "{text}");
        let fits = Projection::new("X", "a.zarr", 2, "partition", 10).and(5, "y");
        assert_eq!(fits.total(), 25);
        fits.check(25).unwrap();
        assert!(fits.check(24).is_err());
        let one = Projection::new("X", "a.zarr", 1, "task", 10).check(9);
        let text = one.unwrap_err().to_string();
        assert!(
            text.contains("needs 10.0 B (1 task x 10.0 B per task)"),
            "{text}"
        );
        let half = Projection::new("X", "a.zarr", 1, "task", 10).share("half of");
        let text = half.check(9).unwrap_err().to_string();
        assert!(
            text.contains("but half of the memory limit (allowed_mem) is 9.0 B; raise the limit"),
            "{text}"
        );
    }
}

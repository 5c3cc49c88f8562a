//! Planning a rechunk: how many stages, the chunk shapes of the
//! intermediate arrays, the region each task copies, and the projected
//! memory and bytes of every stage, before anything is read.
//!
//! A stage copies an array chunked one way into an array chunked another
//! way. Its tasks each copy a region made of whole chunks of the array
//! written (so no two tasks ever write the same chunk) and decode every
//! chunk of the array read that touches the region, one at a time. A task
//! holds the region, one decoded input chunk and one output chunk being
//! encoded; regions grow, to one task fewer at a time along the axis that
//! saves the most reading per byte, while they fit their share of the
//! budget.
//!
//! When one stage would decode the same input chunks over and over
//! (time-chunked data to space chunks), intermediate arrays whose chunk
//! shapes step geometrically from the source's to the target's (rechunker's
//! multistage plan) cut the bytes read; the plan with the fewest bytes read
//! and written per worker wins.

use datafusion::common::DataFusionError;

use crate::config::MAX_THREADS;
use crate::memory::Projection;
use crate::table::BlockGrid;

/// Most stages tried.
pub(crate) const MAX_STAGES: usize = 4;

/// One copy from an array chunked `from` into an array chunked `to`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagePlan {
    /// Chunk shape of the array read.
    pub from: Vec<u64>,
    /// Chunk shape of the array written.
    pub to: Vec<u64>,
    /// Shape of the region one task copies (whole `to` chunks, clipped at
    /// the array's edge).
    pub region: Vec<u64>,
    /// Number of tasks.
    pub tasks: u64,
    /// Memory one task holds at its peak, in bytes.
    pub task_memory: u64,
    /// Decoded bytes read (a chunk read by two tasks counts twice).
    pub bytes_read: u64,
    /// Decoded bytes written.
    pub bytes_written: u64,
}

impl StagePlan {
    /// The regions of the stage's tasks over an array of `shape`, task
    /// `i` copying block `i`.
    pub fn regions(&self, shape: &[u64]) -> BlockGrid {
        BlockGrid::covering(shape, &self.region)
    }

    /// The one stage copying an array of `shape` (`itemsize` bytes per
    /// element) from chunks `from` into chunks `to` by tasks of `region`
    /// (another process's plan, received on a cluster's worker): refused
    /// unless `region` is made of whole `to` chunks within the array (so
    /// that no two tasks write one chunk).
    pub fn for_region(
        shape: &[u64],
        from: &[u64],
        to: &[u64],
        region: &[u64],
        itemsize: u64,
    ) -> Result<Self, String> {
        let (from, to) = (clip(from, shape), clip(to, shape));
        let whole =
            |(&r, (&t, &n)): (&u64, (&u64, &u64))| r >= 1 && r <= n && (r % t == 0 || r == n);
        if region.len() != shape.len() || !region.iter().zip(to.iter().zip(shape)).all(whole) {
            return Err(format!(
                "a task's region {region:?} is not whole chunks {to:?} of an array of shape {shape:?}"
            ));
        }
        Ok(Self {
            tasks: BlockGrid::covering(shape, region).num_blocks(),
            task_memory: task_memory(region, &from, &to, itemsize),
            bytes_read: reads(shape, region, &from).saturating_mul(itemsize),
            bytes_written: cells(shape).saturating_mul(itemsize),
            from,
            to,
            region: region.to_vec(),
        })
    }
}

/// A rechunk no plan fits the budget of: what its smallest task needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoPlan {
    /// Bytes of the smallest task: a target chunk, a source chunk and the
    /// encoding buffers.
    pub least: u64,
    /// The budget planned for.
    pub budget: u64,
    /// The chunks rechunked from and to.
    pub source: Vec<u64>,
    pub target: Vec<u64>,
}

impl NoPlan {
    /// The refusal of `operator` rechunking `store` (`"store 's', array
    /// 'a'"`) under `limit` bytes, of which the rechunk had the budget and
    /// `read_ahead` bytes read chunks ahead.
    pub fn refusal(
        &self,
        operator: &'static str,
        store: &str,
        limit: u64,
        read_ahead: usize,
    ) -> DataFusionError {
        let (source, target) = (&self.source, &self.target);
        let least = usize::try_from(self.least).unwrap_or(usize::MAX);
        Projection::new(operator, store, 1, "task", least)
            .holding(format!(
                "a target chunk {target:?}, a source chunk {source:?} and the encoding buffers \
                 at the least"
            ))
            .and(read_ahead, "chunks read ahead")
            .advice(format!(
                "from chunks {source:?} to {target:?} it cannot fit allowed_mem: raise \
                 allowed_mem or choose smaller chunks"
            ))
            .refusal(usize::try_from(limit).unwrap_or(usize::MAX))
    }
}

/// How one array is rechunked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RechunkPlan {
    /// The array's shape.
    pub shape: Vec<u64>,
    /// Bytes per element.
    pub itemsize: u64,
    /// The copies, in order; the first reads the source, the last writes
    /// the target, the others go through intermediate arrays.
    pub stages: Vec<StagePlan>,
    /// Tasks run at once (each within its share of the budget).
    pub workers: usize,
}

impl RechunkPlan {
    /// Plans rechunking an array of `shape` (`itemsize` bytes per element)
    /// from `source` chunks to `target` chunks within `budget` bytes, with
    /// up to `threads` tasks at once (at most [`MAX_THREADS`]). The error
    /// says what the smallest task needs.
    pub fn new(
        shape: &[u64],
        source: &[u64],
        target: &[u64],
        itemsize: u64,
        budget: u64,
        threads: usize,
    ) -> Result<Self, NoPlan> {
        let source = clip(source, shape);
        let target = clip(target, shape);
        let mut best: Option<(f64, Self)> = None;
        let mut workers = threads.clamp(1, MAX_THREADS);
        loop {
            let share = budget / workers as u64;
            for count in 1..=MAX_STAGES {
                let chain = stage_chunks(shape, &source, &target, count);
                let stages: Option<Vec<StagePlan>> = chain
                    .windows(2)
                    .map(|pair| plan_stage(shape, &pair[0], &pair[1], itemsize, share))
                    .collect();
                let Some(stages) = stages else { continue };
                let tasks = stages.iter().map(|s| s.tasks).min().unwrap_or(1);
                let parallel = (workers as u64).min(tasks).max(1) as f64;
                let bytes: u64 = stages.iter().map(|s| s.bytes_read + s.bytes_written).sum();
                let cost = bytes as f64 / parallel;
                if best.as_ref().is_none_or(|(c, _)| cost < *c) {
                    best = Some((
                        cost,
                        Self {
                            shape: shape.to_vec(),
                            itemsize,
                            stages,
                            workers,
                        },
                    ));
                }
            }
            if workers == 1 {
                break;
            }
            workers = workers.div_ceil(2);
        }
        best.map(|(_, plan)| plan).ok_or_else(|| NoPlan {
            least: task_memory(&target, &source, &target, itemsize),
            budget,
            source,
            target,
        })
    }

    /// Decoded bytes read by all stages.
    pub fn bytes_read(&self) -> u64 {
        self.stages.iter().map(|s| s.bytes_read).sum()
    }

    /// Decoded bytes written by all stages (intermediates included).
    pub fn bytes_written(&self) -> u64 {
        self.stages.iter().map(|s| s.bytes_written).sum()
    }

    /// Memory at the peak: every worker running its largest task.
    pub fn projected_memory(&self) -> u64 {
        let task = self.stages.iter().map(|s| s.task_memory).max().unwrap_or(0);
        task * self.workers as u64
    }
}

/// `chunks` clipped to `shape` (at least one element per axis).
fn clip(chunks: &[u64], shape: &[u64]) -> Vec<u64> {
    chunks
        .iter()
        .zip(shape)
        .map(|(&c, &s)| c.min(s).max(1))
        .collect()
}

/// The chunk shapes of a chain of `count` stages: the source, shapes
/// stepping geometrically towards the target, the target; equal
/// neighbours merged.
fn stage_chunks(shape: &[u64], source: &[u64], target: &[u64], count: usize) -> Vec<Vec<u64>> {
    let mut chain = vec![source.to_vec()];
    for step in 1..count {
        let t = step as f64 / count as f64;
        let chunks: Vec<u64> = source
            .iter()
            .zip(target)
            .zip(shape)
            .map(|((&a, &b), &s)| {
                let c = ((a as f64).ln() * (1.0 - t) + (b as f64).ln() * t).exp();
                (c.round() as u64).clamp(1, s.max(1))
            })
            .collect();
        if chain.last() != Some(&chunks) {
            chain.push(chunks);
        }
    }
    if chain.len() == 1 || chain.last().map(Vec::as_slice) != Some(target) {
        chain.push(target.to_vec());
    }
    chain
}

/// Elements in a box of `shape`.
fn cells(shape: &[u64]) -> u64 {
    shape.iter().product()
}

/// Peak memory of a task copying `region` from chunks `from` into chunks
/// `to`: the region, one decoded input chunk, one output chunk and its
/// encoded bytes.
fn task_memory(region: &[u64], from: &[u64], to: &[u64], itemsize: u64) -> u64 {
    (cells(region) + cells(from) + 2 * cells(to)) * itemsize
}

/// Elements of `chunk`-long pieces of an axis of `len` decoded by tasks of
/// `region`-long pieces (a piece decoded by two tasks counts twice).
fn axis_reads(len: u64, region: u64, chunk: u64) -> u64 {
    let mut total = 0;
    let mut start = 0;
    while start < len {
        let end = (start + region).min(len);
        let first = start / chunk;
        let last = (end - 1) / chunk;
        total += ((last + 1) * chunk).min(len) - first * chunk;
        start = end;
    }
    total
}

/// Elements decoded by tasks of `region` reading chunks `from`.
fn reads(shape: &[u64], region: &[u64], from: &[u64]) -> u64 {
    shape
        .iter()
        .zip(region)
        .zip(from)
        .map(|((&len, &r), &c)| axis_reads(len, r, c))
        .product()
}

/// Plans one stage within `budget` bytes per task; `None` when even a
/// single output chunk does not fit.
fn plan_stage(
    shape: &[u64],
    from: &[u64],
    to: &[u64],
    itemsize: u64,
    budget: u64,
) -> Option<StagePlan> {
    let mut region = to.to_vec();
    if task_memory(&region, from, to, itemsize) > budget {
        return None;
    }
    let mut read = reads(shape, &region, from);
    loop {
        let memory = task_memory(&region, from, to, itemsize);
        let mut best: Option<(f64, usize, u64, u64)> = None;
        for d in 0..shape.len() {
            if region[d] >= shape[d] {
                continue;
            }
            // The next length giving one task fewer along `d` (a longer
            // region with as many tasks reads no less), in whole chunks.
            let fewer = shape[d].div_ceil(region[d]) - 1;
            let mut grown = region.clone();
            grown[d] = shape[d]
                .div_ceil(fewer.max(1))
                .next_multiple_of(to[d])
                .min(shape[d]);
            let grown_memory = task_memory(&grown, from, to, itemsize);
            if grown_memory > budget {
                continue;
            }
            let grown_read = reads(shape, &grown, from);
            if grown_read >= read {
                continue;
            }
            let score = (read - grown_read) as f64 / (grown_memory - memory).max(1) as f64;
            if best.is_none_or(|(s, ..)| score > s) {
                best = Some((score, d, grown[d], grown_read));
            }
        }
        match best {
            Some((_, d, len, grown_read)) => {
                region[d] = len;
                read = grown_read;
            }
            None => break,
        }
    }
    let tasks = BlockGrid::covering(shape, &region).num_blocks();
    Some(StagePlan {
        from: from.to_vec(),
        to: to.to_vec(),
        tasks,
        task_memory: task_memory(&region, from, to, itemsize),
        bytes_read: read * itemsize,
        bytes_written: cells(shape) * itemsize,
        region,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads counted by visiting every (task, chunk) pair.
    fn reads_by_enumeration(shape: &[u64], region: &[u64], from: &[u64]) -> u64 {
        let per_axis: Vec<u64> = (0..shape.len())
            .map(|d| {
                let mut total = 0;
                for t in (0..shape[d]).step_by(region[d] as usize) {
                    let t_end = (t + region[d]).min(shape[d]);
                    for c in (0..shape[d]).step_by(from[d] as usize) {
                        let c_end = (c + from[d]).min(shape[d]);
                        if c < t_end && t < c_end {
                            total += c_end - c;
                        }
                    }
                }
                total
            })
            .collect();
        per_axis.iter().product()
    }

    #[test]
    fn reads_match_enumeration() {
        for (shape, region, from) in [
            (vec![10u64, 7], vec![3u64, 7], vec![4u64, 2]),
            (vec![100, 13], vec![30, 5], vec![100, 1]),
            (vec![9], vec![9], vec![2]),
            (vec![17, 5, 3], vec![4, 2, 3], vec![5, 5, 1]),
        ] {
            assert_eq!(
                reads(&shape, &region, &from),
                reads_by_enumeration(&shape, &region, &from)
            );
        }
    }

    #[test]
    fn every_stage_fits_the_budget() {
        let shape = [168u64, 721, 1440];
        let plan =
            RechunkPlan::new(&shape, &[1, 721, 1440], &[168, 16, 16], 4, 500 << 20, 2).unwrap();
        assert!(plan.projected_memory() <= 500 << 20, "{plan:?}");
        assert_eq!(plan.stages.first().unwrap().from, vec![1, 721, 1440]);
        assert_eq!(plan.stages.last().unwrap().to, vec![168, 16, 16]);
        for s in &plan.stages {
            for ((r, t), n) in s.region.iter().zip(&s.to).zip(&shape) {
                assert!(
                    r % t == 0 || r == n,
                    "{s:?}: regions are whole output chunks"
                );
            }
        }
    }

    #[test]
    fn a_tight_budget_takes_more_stages_than_a_loose_one() {
        let shape = [240u64, 200, 200];
        let (source, target) = ([1u64, 200, 200], [240u64, 5, 5]);
        let loose = RechunkPlan::new(&shape, &source, &target, 8, 1 << 30, 1).unwrap();
        assert_eq!(loose.stages.len(), 1);
        assert_eq!(
            loose.bytes_read(),
            cells(&shape) * 8,
            "one pass reads everything once"
        );
        let tight = RechunkPlan::new(&shape, &source, &target, 8, 4 << 20, 1).unwrap();
        assert!(tight.stages.len() > 1, "{tight:?}");
        let single = plan_stage(&shape, &source, &target, 8, 4 << 20).unwrap();
        assert!(
            tight.bytes_read() + tight.bytes_written() < single.bytes_read + single.bytes_written
        );
    }

    #[test]
    fn a_stage_for_a_received_region_is_the_stage_planned() {
        let shape = [240u64, 200, 50];
        let (source, target) = ([1u64, 200, 50], [240u64, 20, 10]);
        for budget in [16 << 20, 1 << 30] {
            let planned = plan_stage(&shape, &source, &target, 4, budget).unwrap();
            let received =
                StagePlan::for_region(&shape, &source, &target, &planned.region, 4).unwrap();
            assert_eq!(received, planned);
        }
        // Regions that are not whole target chunks, or outside the array.
        for region in [
            vec![240, 15, 10],
            vec![240, 20],
            vec![240, 20, 0],
            vec![480, 20, 10],
        ] {
            let err = StagePlan::for_region(&shape, &source, &target, &region, 4).unwrap_err();
            assert!(err.contains("not whole chunks"), "{region:?}: {err}");
        }
        // At the array's edge a region may be the whole axis.
        assert!(StagePlan::for_region(&shape, &source, &target, &[240, 200, 50], 4).is_ok());
    }

    #[test]
    fn a_budget_below_one_chunk_is_refused() {
        let err = RechunkPlan::new(&[100, 100], &[100, 1], &[1, 100], 8, 1000, 1).unwrap_err();
        assert_eq!(
            (err.budget, &err.source[..], &err.target[..]),
            (1000, &[100, 1][..], &[1, 100][..])
        );
        // A target chunk and a source chunk at the least.
        assert!(err.least >= 2 * 800, "{}", err.least);
        let refused = err.refusal("Rechunk", "store 's'", 1200, 200).to_string();
        assert!(
            refused.contains("Rechunk over store 's' needs ")
                && refused.contains("(1 task x ")
                && refused.contains("and 200.0 B of chunks read ahead")
                && refused.contains("the memory limit (allowed_mem) is 1200.0 B")
                && refused.contains("from chunks [100, 1] to [1, 100] it cannot fit allowed_mem"),
            "{refused}"
        );
    }
}

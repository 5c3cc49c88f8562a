//! Cutting samples out of decoded blocks into the arrays of a batch:
//! roles and channels, jitter, stacking and normalization.
//!
//! A batch is a list of arrays ([`Output`]s): one per variable (the
//! classic loader, or a role's variables side by side), or one per role
//! with every channel stacked as `float32` (`stack`). Each sample
//! appends, per array, its channels one after the other, so an array is
//! `(batch, channels, *plane)` in C order with no copy after assembly.

use std::ops::Range;

use datafusion::arrow::buffer::BooleanBuffer;

use super::order::splitmix;
use super::sample::{Channel, SampleLayout};
use super::values::{count_missing_in, Scale, Values};
use super::Windows;

/// Times a jitter offset is drawn for a sample before it goes without:
/// an offset whose window breaks a role's validity rule is drawn again.
const JITTER_DRAWS: u64 = 8;

/// One array of a batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    /// The role it belongs to (a position in [`SampleLayout::roles`]).
    pub role: usize,
    /// The variable of a per-variable array (a position among the windows'
    /// variables); `None` for a role's stacked channels.
    pub variable: Option<usize>,
    /// The role's channels it holds, in order (positions in its channels).
    pub channels: Vec<usize>,
    /// Whether its values are `float32` (stacked or normalized) rather than
    /// the variable's own type.
    pub float32: bool,
}

/// The arrays of the batches of `layout`: per role, its stacked channels
/// (`stack`) or one array per variable; `float32` when stacked or
/// `normalized`.
pub fn outputs(layout: &SampleLayout, stack: bool, normalized: bool) -> Vec<Output> {
    let mut out = Vec::new();
    for (r, role) in layout.roles.iter().enumerate() {
        if stack {
            out.push(Output {
                role: r,
                variable: None,
                channels: (0..role.channels.len()).collect(),
                float32: true,
            });
            continue;
        }
        let mut variables: Vec<usize> = role.channels.iter().map(|c| c.variable).collect();
        variables.sort_unstable();
        variables.dedup();
        for v in variables {
            out.push(Output {
                role: r,
                variable: Some(v),
                channels: (0..role.channels.len())
                    .filter(|&c| role.channels[c].variable == v)
                    .collect(),
                float32: normalized,
            });
        }
    }
    out
}

/// The shape of one sample's part of `output` (the batch's array without
/// its first dimension): `(channels, *plane)`, or the plane alone for the
/// classic per-variable windows.
pub fn sample_shape(windows: &Windows, output: &Output) -> Vec<usize> {
    let layout = &windows.layout;
    let sizes: Vec<(usize, u64)> = windows
        .grid
        .axes
        .iter()
        .enumerate()
        .filter(|(_, a)| a.window)
        .map(|(d, a)| (d, a.size))
        .collect();
    let plane = layout.plane_sizes(&sizes).into_iter().map(|s| s as usize);
    if layout.roles_given || output.variable.is_none() {
        std::iter::once(output.channels.len())
            .chain(plane)
            .collect()
    } else {
        plane.collect()
    }
}

/// Bytes of one sample over all `outputs`.
pub fn sample_bytes(windows: &Windows, outputs: &[Output]) -> u64 {
    outputs
        .iter()
        .map(|o| {
            let cells: u64 = sample_shape(windows, o).iter().map(|&s| s as u64).product();
            let element = match o.variable {
                Some(v) if !o.float32 => windows.sources.element_size(v),
                _ => 4,
            };
            cells.saturating_mul(element)
        })
        .sum()
}

/// The decoded values of a block or a window, per variable of the windows.
#[derive(Debug)]
pub struct Decoded {
    /// The values, in the windows' variable order.
    pub values: Vec<Values>,
    /// Each variable's validity (one bit per cell), kept where jittered
    /// samples are checked against the rules; `None`: nothing missing.
    pub nulls: Vec<Option<BooleanBuffer>>,
    /// Per source: the box its values cover.
    pub extents: Vec<Vec<Range<u64>>>,
}

/// Cuts the samples of one epoch into batches.
pub struct Cutter<'a> {
    windows: &'a Windows,
    outputs: &'a [Output],
    /// Per variable of the windows and part of it, when normalizing.
    scales: Option<&'a [Vec<Scale>]>,
    seed: u64,
    epoch: u64,
}

/// A batch being filled.
pub struct Filling {
    /// One per output.
    pub arrays: Vec<Values>,
    /// Per dimension: each sample's first cell (its anchor step along the lead dimension).
    pub origins: Vec<Vec<u64>>,
    /// Per dimension: each sample's jitter offset (empty where none).
    pub jitter: Vec<Vec<i64>>,
}

impl<'a> Cutter<'a> {
    /// A cutter of the samples of `windows` into `outputs`, normalized by
    /// `scales` when given, jittered for `epoch` of a loader seeded `seed`.
    pub fn new(
        windows: &'a Windows,
        outputs: &'a [Output],
        scales: Option<&'a [Vec<Scale>]>,
        seed: u64,
        epoch: u64,
    ) -> Self {
        Self {
            windows,
            outputs,
            scales,
            seed,
            epoch,
        }
    }

    /// An empty batch with room for `capacity` samples, typed like `first`
    /// (the first sample's decoded values).
    pub fn start(&self, first: &Decoded, capacity: usize) -> Filling {
        let windows = self.windows;
        let arrays = self
            .outputs
            .iter()
            .map(|o| {
                let cells =
                    (sample_shape(windows, o).iter().product::<usize>()).saturating_mul(capacity);
                match o.variable {
                    Some(v) if !o.float32 => first.values[v].empty_like(cells),
                    _ => Values::F32(Vec::with_capacity(cells)),
                }
            })
            .collect();
        let rank = windows.grid.axes.len();
        let jitter = windows
            .layout
            .jitter
            .iter()
            .map(|&j| {
                if j > 0 {
                    Vec::with_capacity(capacity)
                } else {
                    Vec::new()
                }
            })
            .collect();
        Filling {
            arrays,
            origins: vec![Vec::with_capacity(capacity); rank],
            jitter,
        }
    }

    /// Appends the sample at origin `local` of block `block` to `batch`,
    /// from `data` (decoded over `extent`).
    pub fn cut(&self, data: &Decoded, block: usize, local: u64, batch: &mut Filling) {
        let windows = self.windows;
        let layout = &windows.layout;
        let origin = windows.grid.blocks[block].origin(local);
        let mut window = windows.grid.window_extent(&origin);
        if layout.jittered() {
            let offsets = self.jitter(data, block, local, &window);
            for (d, &offset) in offsets.iter().enumerate() {
                if layout.jitter[d] > 0 {
                    let r = &mut window[d];
                    *r = r.start.saturating_add_signed(offset)..r.end.saturating_add_signed(offset);
                    batch.jitter[d].push(offset);
                }
            }
        }
        for (output, array) in self.outputs.iter().zip(batch.arrays.iter_mut()) {
            let role = &layout.roles[output.role];
            for &c in &output.channels {
                let channel = &role.channels[c];
                let (extent, plane) = self.plane(data, &window, channel);
                let values = &data.values[channel.variable];
                if output.float32 {
                    if let Values::F32(out) = &mut *array {
                        let scale = self.scales.map(|s| s[channel.variable][channel.part]);
                        values.append_window_f32(extent, &plane, scale, out);
                    }
                } else {
                    values.append_window(extent, &plane, array);
                }
            }
        }
        for (d, r) in window.iter().enumerate() {
            let anchor = match layout.lead {
                Some(lead) if lead.axis == d => r.start + lead.anchor,
                _ => r.start,
            };
            batch.origins[d].push(anchor);
        }
    }

    /// The jitter offsets (per dimension) of the sample at origin `local`
    /// of block `block`, whose window is `window`: drawn from the sample's
    /// own seeded stream within the bounds and the selection, again while
    /// the moved window breaks a role's rule, none after
    /// [`JITTER_DRAWS`] tries (the window itself is valid).
    fn jitter(&self, data: &Decoded, block: usize, local: u64, window: &[Range<u64>]) -> Vec<i64> {
        let layout = &self.windows.layout;
        let axes = &self.windows.grid.axes;
        let mut state = splitmix(self.seed ^ splitmix(self.epoch ^ splitmix(block as u64)));
        state = splitmix(state ^ local);
        let mut offsets = vec![0i64; window.len()];
        for _ in 0..JITTER_DRAWS {
            for (d, r) in window.iter().enumerate() {
                let bound = i64::try_from(layout.jitter[d]).unwrap_or(i64::MAX);
                if bound == 0 {
                    continue;
                }
                let within = axes[d].range();
                let low = (-bound).max(within.start as i64 - r.start as i64);
                let high = bound.min(within.end as i64 - r.end as i64);
                state = splitmix(state);
                // The window itself lies in the selection: low <= 0 <= high.
                offsets[d] = if high > low {
                    low + (state % (high - low + 1) as u64) as i64
                } else {
                    0
                };
            }
            if layout.keeps_everything() || self.valid(data, window, &offsets) {
                return offsets;
            }
        }
        vec![0; window.len()]
    }

    /// The box `channel` reads of its source for the reference window
    /// `window`, and the box the source's decoded values cover.
    fn plane<'d>(
        &self,
        data: &'d Decoded,
        window: &[Range<u64>],
        channel: &Channel,
    ) -> (&'d [Range<u64>], Vec<Range<u64>>) {
        let windows = self.windows;
        let (s, _) = windows.sources.flat[channel.variable];
        let reference = windows.layout.plane(window, channel);
        let plane = windows.sources.source_box(s, &reference, &channel.fixed);
        (&data.extents[s], plane)
    }

    /// Whether the window at `window` moved by `offsets` meets every role's rule.
    fn valid(&self, data: &Decoded, window: &[Range<u64>], offsets: &[i64]) -> bool {
        let layout = &self.windows.layout;
        let moved: Vec<Range<u64>> = window
            .iter()
            .zip(offsets)
            .map(|(r, &o)| r.start.saturating_add_signed(o)..r.end.saturating_add_signed(o))
            .collect();
        layout.roles.iter().all(|role| {
            let mut missing = 0u64;
            let mut total = 0u64;
            for channel in &role.channels {
                let (extent, plane) = self.plane(data, &moved, channel);
                total += plane.iter().map(|r| r.end - r.start).product::<u64>();
                if let Some(nulls) = &data.nulls[channel.variable] {
                    missing += count_missing_in(nulls, extent, &plane);
                }
            }
            role.validity.keeps(missing, total)
        })
    }
}

"""Differential fuzzing of the window loader against numpy.

Each case draws, from its own seed, a store written by xarray (shape,
chunks, Zarr format, float32/float64 variables, missing values, holes), a
selection (`where` on time and latitude), windows (sizes, overlaps,
validity rules), or samples (history, lead times in steps or hours,
input variables, a rule per role, jitter), how they are read (block size,
index threads, an index cache) and loaders (batch size, shuffle, seed,
`drop_last`, prefetch, threads, buffer, shards of several ranks and the
shares of several DataLoader workers). Every batch is checked against the
same windows cut with numpy: the values, the window kept by the rules, the
jitter within its bounds and the selection; then the epoch as a whole: no
window twice, none missing (or, with `drop_last`, whole batches and as
many for every stream), the same order when iterated again, `len`, and a
resume from a random batch (through the workers' shares too) yielding
exactly the rest.

A failing case names its seed: `ZARRFUSION_LOADER_FUZZ_SEED=<seed>` runs
that case alone; `ZARRFUSION_LOADER_FUZZ_CASES=<n>` runs `n` cases from
`ZARRFUSION_LOADER_FUZZ_FIRST` (default 0) instead of CI's 40 (long runs
are recorded in docs/development.md).
"""

from __future__ import annotations

import os
import pathlib
import sys
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pytest
import xarray as xr

import zarrfusion as zf

CASES = int(os.environ.get("ZARRFUSION_LOADER_FUZZ_CASES", "40"))
FIRST = int(os.environ.get("ZARRFUSION_LOADER_FUZZ_FIRST", "0"))
ONLY = os.environ.get("ZARRFUSION_LOADER_FUZZ_SEED")
SEEDS = [int(ONLY)] if ONLY else list(range(FIRST, FIRST + CASES))
NAMES = ["a", "b", "c"]
BUCKET = "loaderfuzz"


@dataclass
class Case:
    """One drawn case: the store, the windows and the loaders."""

    seed: int
    shape: tuple[int, int, int]
    chunks: tuple[int, int, int]
    dtypes: dict[str, str]
    zarr_format: int
    time_range: tuple[int, int]
    lat_range: tuple[int, int]
    sizes: dict[str, int]
    overlaps: dict[str, int]
    history: int
    targets: dict[str, list[int]]
    hours: bool
    inputs: list[str] | None
    valid: object
    jitter: dict[str, int]
    block_size: str | None
    threads: int | None
    cache: bool
    margin: int = -1
    other_chunks: tuple[int, int, int] = (1, 1, 1)
    static: bool = False
    levels: int = 0
    latency_ms: int = -1
    loaders: list[dict] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        return self.history > 1 or bool(self.targets)

    @property
    def other(self) -> bool:
        """Whether a second store joins the first: `p` every 3 hours on a
        grid `margin` cells larger on each side (and a static `s`, and `z`
        on `levels` pressure levels, each level a channel)."""
        return self.margin >= 0

    @property
    def remote(self) -> bool:
        """Whether the stores are read from the S3 server, `latency_ms` a request."""
        return self.latency_ms >= 0

    @property
    def names(self) -> list[str]:
        """Every variable, source after source."""
        extra = (["p"] if self.other else []) + (["z"] if self.levels else []) + (["s"] if self.static else [])
        return list(self.dtypes) + extra


def draw(seed: int) -> Case:
    rng = np.random.default_rng(seed)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731 (inclusive bounds)
    shape = (r(1, 16), r(1, 15), r(1, 15)) if rng.random() < 0.2 else (r(3, 16), r(3, 15), r(3, 15))
    chunks = tuple(r(1, n) for n in shape)
    names = NAMES[: r(1, 3)]
    dtypes = {v: str(rng.choice(["float32", "float64"])) for v in names}
    t0 = r(0, shape[0] - 1) if rng.random() < 0.3 else 0
    t1 = r(t0 + 1, shape[0]) if rng.random() < 0.3 else shape[0]
    y0 = r(0, shape[1] - 1) if rng.random() < 0.2 else 0
    y1 = r(y0 + 1, shape[1]) if rng.random() < 0.2 else shape[1]
    samples = rng.random() < 0.6
    window_dims = ["lat", "lon"] + (["time"] if not samples and rng.random() < 0.25 else [])
    extent = {"time": t1 - t0, "lat": y1 - y0, "lon": shape[2]}
    sizes = {d: r(1, max(1, extent[d])) for d in window_dims}
    overlaps = {d: r(0, sizes[d] - 1) for d in window_dims if rng.random() < 0.7}
    history, targets, hours, inputs = 1, {}, False, None
    if samples:
        steps = t1 - t0
        history = r(1, min(3, steps))
        room = steps - history  # lead steps left after the history
        if room > 0 and rng.random() < 0.8:
            for v in rng.choice(names, size=r(1, len(names)), replace=False):
                targets[str(v)] = sorted({r(1, min(3, room)) for _ in range(r(1, 2))})
        if history == 1 and not targets:
            history = min(2, steps)
        hours = rng.random() < 0.5
        samples = history > 1 or bool(targets)
    other = samples and rng.random() < 0.4
    static = other and rng.random() < 0.5
    levels = r(1, 3) if other and rng.random() < 0.4 else 0
    if other:
        names = names + ["p"]
        if targets and rng.random() < 0.5:
            targets["p"] = sorted({r(1, min(3, room)) for _ in range(r(1, 2))})
    if samples and rng.random() < 0.4:
        pool = names + (["z"] if levels else []) + (["s"] if static else [])
        inputs = [str(v) for v in rng.choice(pool, size=r(1, len(pool)), replace=False)]
    rules = ["all", "any", 0.5, 0.9, 0.97, 0.0, 1.0, 0.75]
    rule = lambda: rules[r(0, len(rules) - 1)]  # noqa: E731
    if targets and rng.random() < 0.6:
        valid = {role: rule() for role in ("inputs", "targets") if rng.random() < 0.8}
    else:
        valid = rule()
    jitter = {}
    if rng.random() < 0.35:
        jitter = {d: r(0, 3) for d in ("lat", "lon") if rng.random() < 0.7}
    case = Case(
        seed=seed,
        shape=shape,
        chunks=chunks,
        dtypes=dtypes,
        zarr_format=int(rng.choice([2, 3])),
        time_range=(t0, t1),
        lat_range=(y0, y1),
        sizes=sizes,
        overlaps=overlaps,
        history=history,
        targets=targets,
        hours=hours,
        inputs=inputs,
        valid=valid,
        jitter=jitter,
        block_size=[None, "1KB", "4KB", "32KB"][r(0, 3)],
        threads=[None, 0, 1, 2][r(0, 3)],
        cache=bool(rng.random() < 0.4),
        margin=r(0, 2) if other else -1,
        other_chunks=tuple(r(1, 2 * n) for n in shape),
        static=static,
        levels=levels,
        latency_ms=[0, 2, 10][r(0, 2)] if rng.random() < 0.2 else -1,
    )
    if case.remote:
        # Chunks of at least half of each dimension: the full shuffle reads
        # each window's chunks (read ahead, tens of GETs a window of one-step
        # chunks, from a server that serves a few hundred a second on these
        # cores).
        case.chunks = tuple(max(c, (n + 1) // 2) for c, n in zip(case.chunks, shape))
        case.other_chunks = tuple(max(c, n + 2) for c, n in zip(case.other_chunks, shape))
    for _ in range(r(1, 3)):
        case.loaders.append(
            dict(
                batch_size=r(1, 12),
                shuffle=[None, "block", "full"][r(0, 2)],
                seed=r(0, 1000),
                drop_last=bool(rng.random() < 0.4),
                prefetch=r(1, 4),
                threads=r(1, 2),
                buffer_size=["4KB", "16KB", "256KB", "256MB"][r(0, 3)],
                world=[1, 1, 2, 3][r(0, 3)],
                workers=[1, 1, 2, 3][r(0, 3)],
                epoch=r(0, 2),
                normalize=None,
            )
        )
        if samples and rng.random() < 0.3:
            case.loaders[-1]["normalize"] = {
                v: {"mean": float(rng.normal()), "std": [0.0, 0.5, 3.0][r(0, 2)]}
                for v in case.names
            }
    return case


def random_values(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Normal values with missing ones scattered, and sometimes a hole."""
    values = rng.normal(size=shape).astype(dtype)
    values[rng.random(shape) < float(rng.choice([0.0, 0.002, 0.02, 0.1]))] = np.nan
    if rng.random() < 0.3:  # a hole over a few steps
        at = tuple(slice(k, k + 3) for k in (int(rng.integers(0, n)) for n in shape))
        values[at] = np.nan
    return values


def write_stores(case: Case, rng: np.random.Generator, folder) -> dict[str, np.ndarray]:
    """The case's store (and the second one), written by xarray; returns
    every variable's values on the first store's grid (`p` at its steps,
    `s` repeated along time)."""
    nt, ny, nx = case.shape
    data = {v: random_values(rng, case.shape, dtype) for v, dtype in case.dtypes.items()}
    ds = xr.Dataset(
        {v: (("time", "lat", "lon"), data[v]) for v in case.dtypes},
        coords={
            "time": pd.date_range("2020-01-01", periods=nt, freq="6h"),
            "lat": 60.0 - 2.5 * np.arange(ny),
            "lon": 1.25 * np.arange(nx),
        },
    )
    encoding = {v: {"chunks": case.chunks} for v in case.dtypes}
    ds.to_zarr(folder / "store.zarr", encoding=encoding, zarr_format=case.zarr_format)
    if case.other:
        m = case.margin
        shape = (2 * nt, ny + 2 * m, nx + 2 * m)
        p = random_values(rng, shape, "float32")
        other = {"p": (("time", "lat", "lon"), p)}
        if case.static:
            s = random_values(rng, shape[1:], "float64")
            other["s"] = (("lat", "lon"), s)
            data["s"] = np.broadcast_to(s[m : m + ny, m : m + nx], case.shape)
        data["p"] = p[::2, m : m + ny, m : m + nx]
        coords = {}
        if case.levels:
            z = random_values(rng, (2 * nt, case.levels, ny + 2 * m, nx + 2 * m), "float32")
            other["z"] = (("time", "level", "lat", "lon"), z)
            coords["level"] = [1000, 850, 500][: case.levels]
            data["z"] = z[::2, :, m : m + ny, m : m + nx]
        xr.Dataset(
            other,
            coords={
                "time": pd.date_range("2020-01-01", periods=2 * nt, freq="3h"),
                "lat": 60.0 - 2.5 * np.arange(-m, ny + m),
                "lon": 1.25 * np.arange(-m, nx + m),
                **coords,
            },
        ).to_zarr(
            folder / "other.zarr",
            encoding={
                "p": {"chunks": case.other_chunks},
                **({"s": {"chunks": case.other_chunks[1:]}} if case.static else {}),
                **({"z": {"chunks": (case.other_chunks[0], 1, *case.other_chunks[1:])}} if case.levels else {}),
            },
            zarr_format=case.zarr_format,
        )
    return data


def where_of(case: Case, ds: xr.Dataset) -> str | None:
    (t0, t1), (y0, y1) = case.time_range, case.lat_range
    parts = []
    if (t0, t1) != (0, case.shape[0]):
        times = pd.DatetimeIndex(ds.time.values)
        parts.append(f"time >= '{times[t0].isoformat()}' AND time <= '{times[t1 - 1].isoformat()}'")
    if (y0, y1) != (0, case.shape[1]):
        lat = [float(x) for x in ds.lat.values]  # descending
        parts.append(f"lat <= {lat[y0]!r} AND lat >= {lat[y1 - 1]!r}")
    return " AND ".join(parts) or None


def keeps(rule, missing: int, total: int) -> bool:
    """`valid`'s rule: the least share of non-missing cells."""
    if rule == "all" or rule == 1.0:
        return missing == 0
    if rule == "any" or rule == 0.0:
        return True
    return (total - missing) >= rule * total


class Oracle:
    """The windows and samples of a case, cut with numpy."""

    def __init__(self, case: Case, data: dict[str, np.ndarray]):
        self.case, self.data = case, data
        self.names = case.names
        # Channels keep the dataset's order of variables, whatever `inputs`' order.
        self.inputs = [v for v in self.names if v in (case.inputs or self.names)]
        c = case
        if c.samples:
            rules = c.valid if isinstance(c.valid, dict) else {"inputs": c.valid, "targets": c.valid}
            self.rules = {role: rules.get(role, "all") for role in ("inputs", "targets")}
            self.leads = sorted(
                {(lead, v) for v, ls in c.targets.items() for lead in ls}, key=lambda p: (p[0], self.names.index(p[1]))
            )
        self.anchors = self._anchors()

    def origins(self, dim: str) -> list[int]:
        c = self.case
        lo, hi = {"time": c.time_range, "lat": c.lat_range, "lon": (0, c.shape[2])}[dim]
        size = c.sizes.get(dim, 1)
        stride = size - c.overlaps.get(dim, 0)
        if dim == "time" and c.samples:
            last = max([0] + [lead for lead, _ in self.leads])
            return list(range(lo + c.history - 1, hi - last))
        return list(range(lo, hi - size + 1, stride))

    def bounds(self, dim: str) -> tuple[int, int]:
        """The first and last origin a shifted window may take."""
        c = self.case
        lo, hi = {"lat": c.lat_range, "lon": (0, c.shape[2])}[dim]
        return lo, hi - c.sizes[dim]

    def box(self, t: int, i: int, j: int) -> tuple[slice, slice]:
        s = self.case.sizes
        return slice(i, i + s["lat"]), slice(j, j + s["lon"])

    def sample(self, t: int, i: int, j: int):
        """(inputs, targets) of the sample at (t, i, j): channels as the
        loader documents them (steps outermost, then variables; targets
        by lead, then variable); plain windows: {variable: window}."""
        c = self.case
        if not c.samples:
            tt = slice(t, t + c.sizes["time"]) if "time" in c.sizes else t
            return {v: self.data[v][(tt, *self.box(t, i, j))] for v in self.names}, None
        box = self.box(t, i, j)
        inputs = np.stack([x for s in range(1 - c.history, 1) for v in self.inputs for x in self.cut(v, t + s, box)])
        targets = np.stack([x for lead, v in self.leads for x in self.cut(v, t + lead, box)]) if self.leads else None
        return inputs, targets

    def cut(self, variable: str, t: int, box: tuple[slice, slice]) -> list[np.ndarray]:
        """The windows of `variable` at step `t`: one, or one per level."""
        values = self.data[variable]
        if values.ndim == 4:
            return [values[(t, level, *box)] for level in range(values.shape[1])]
        return [values[(t, *box)]]

    def channels_of(self, variable: str, step: int) -> list[dict]:
        """The channels of `variable` at `step`, as `Windows.channels` lists them."""
        if self.data[variable].ndim == 4:
            levels = [1000, 850, 500][: self.case.levels]
            return [{"variable": variable, "step": step, "level": level} for level in levels]
        return [{"variable": variable, "step": step}]

    def kept(self, t: int, i: int, j: int) -> bool:
        inputs, targets = self.sample(t, i, j)
        if not self.case.samples:
            cells = np.concatenate([w.ravel() for w in inputs.values()])
            return keeps(self.case.valid, int(np.isnan(cells).sum()), cells.size)
        ok = keeps(self.rules["inputs"], int(np.isnan(inputs).sum()), inputs.size)
        if targets is not None:
            ok = ok and keeps(self.rules["targets"], int(np.isnan(targets).sum()), targets.size)
        return ok

    def _anchors(self) -> set[tuple[int, int, int]]:
        return {
            (t, i, j)
            for t in self.origins("time")
            for i in self.origins("lat")
            for j in self.origins("lon")
            if self.kept(t, i, j)
        }

    def channels(self) -> dict:
        if not self.case.samples:
            return None
        steps = range(1 - self.case.history, 1)
        out = {"inputs": [c for s in steps for v in self.inputs for c in self.channels_of(v, s)]}
        if self.leads:
            out["targets"] = [c for lead, v in self.leads for c in self.channels_of(v, lead)]
        return out


def batch_samples(batch: dict, case: Case) -> list[tuple]:
    """(index, jitter, inputs, targets) of each sample of a batch."""
    idx = batch["index"]
    n = len(idx["lat"])
    jitter = batch.get("jitter", {})
    out = []
    for k in range(n):
        key = (int(idx["time"][k]), int(idx["lat"][k]), int(idx["lon"][k]))
        shift = tuple(int(jitter[d][k]) if d in jitter else 0 for d in ("lat", "lon"))
        if case.samples:
            inputs = batch["inputs"][k]
            targets = batch["targets"][k] if "targets" in batch else None
        else:
            inputs, targets = {v: batch[v][k] for v in case.dtypes}, None
        out.append((key, shift, inputs, targets))
    return out


def normalized(values: np.ndarray, channels: list[dict], normalize: dict | None) -> np.ndarray:
    """`(x - mean) / std` by each channel's variable (`std` 0: centered), in float32."""
    if normalize is None:
        return values.astype(np.float32)
    out = np.empty(values.shape, np.float32)
    for c, channel in enumerate(channels):
        scale = normalize[channel["variable"]]
        x = values[c].astype(np.float64) - scale["mean"]
        out[c] = x / scale["std"] if scale["std"] else x
    return out


def check_batch(batch: dict, case: Case, oracle: Oracle, jitters: dict, normalize: dict | None = None) -> list[tuple]:
    """Checks every sample of `batch` against numpy; returns their
    (anchor, shift) in order."""
    seen = []
    channels = oracle.channels()
    for key, (di, dj), inputs, targets in batch_samples(batch, case):
        t, i, j = key
        anchor = (t, i - di, j - dj)
        assert anchor in oracle.anchors, f"window {anchor} (index {key}, jitter {(di, dj)}) is not one numpy keeps"
        for d, shift in zip(("lat", "lon"), (di, dj)):
            assert abs(shift) <= case.jitter.get(d, 0), f"jitter {shift} along {d} past its bound"
        lo, hi = oracle.bounds("lat")
        assert lo <= i <= hi, f"shifted window at lat {i} leaves the selection {lo}..{hi}"
        lo, hi = oracle.bounds("lon")
        assert lo <= j <= hi, f"shifted window at lon {j} leaves the selection {lo}..{hi}"
        if (di, dj) != (0, 0):
            assert oracle.kept(t, i, j), f"jitter {(di, dj)} of {anchor} gives a window the rules refuse"
        want_inputs, want_targets = oracle.sample(t, i, j)
        if case.samples:
            assert inputs.dtype == np.float32
            close = dict(rtol=1e-5, atol=1e-5) if normalize else dict(rtol=0, atol=0)
            want = normalized(want_inputs, channels["inputs"], normalize)
            np.testing.assert_allclose(inputs, want, **close, err_msg=f"inputs of {key}")
            if want_targets is None:
                assert targets is None
            else:
                want = normalized(want_targets, channels["targets"], normalize)
                np.testing.assert_allclose(targets, want, **close, err_msg=f"targets of {key}")
        else:
            for v, window in want_inputs.items():
                np.testing.assert_array_equal(inputs[v], window, err_msg=f"{v} of {key}")
        # The offset depends on the seed, the epoch and the sample only.
        if anchor in jitters:
            assert jitters[anchor] == (di, dj), f"jitter of {anchor} differs between streams"
        jitters[anchor] = (di, dj)
        seen.append((anchor, (di, dj)))
    return seen


def interleave(streams: list[list]) -> list:
    """A DataLoader's order: its workers' batches in turn, skipping those that ended."""
    out, its, active = [], [iter(s) for s in streams], list(range(len(streams)))
    while active:
        for w in list(active):
            try:
                out.append(next(its[w]))
            except StopIteration:
                active.remove(w)
    return out


def run_stream(loader, case, oracle, jitters, batch_size, drop_last, normalize=None) -> list[list[tuple]]:
    batches = []
    for batch in loader:
        samples = check_batch(batch, case, oracle, jitters, normalize)
        assert len(samples) <= batch_size and samples
        batches.append(samples)
    for b in batches[:-1]:
        assert len(b) == batch_size, f"a short batch ({len(b)} of {batch_size}) before the last"
    if drop_last and batches:
        assert len(batches[-1]) == batch_size, "drop_last yielded a short batch"
    return batches


def check_loader(case: Case, windows, oracle: Oracle, options: dict) -> None:
    o = dict(options)
    world, workers, epoch = o.pop("world"), o.pop("workers"), o.pop("epoch")
    stack = "channels" if case.samples else None
    jitters: dict = {}
    streams = []  # per rank, per worker: batches
    for rank in range(world):
        shard = None if world == 1 else (rank, world)
        loader = windows.loader(**o, shard=shard, stack=stack)
        loader.set_epoch(epoch)
        if workers == 1:
            mine = [run_stream(loader, case, oracle, jitters, o["batch_size"], o["drop_last"], o["normalize"])]
            assert len(loader) == len(mine[0]), f"len(loader) {len(loader)}, batches {len(mine[0])}"
        else:
            mine = [
                run_stream(loader._for_worker(w, workers), case, oracle, jitters, o["batch_size"], o["drop_last"], o["normalize"])
                for w in range(workers)
            ]
        streams.append(mine)
        if rank == 0:
            check_again_and_resume(case, windows, oracle, o, shard, stack, epoch, workers, mine)
    every = [s for b in (b for rank in streams for stream in rank for b in stream) for s in b]
    anchors = [a for a, _ in every]
    assert len(anchors) == len(set(anchors)), "a window came twice"
    if o["drop_last"]:
        # Every rank yields as many batches; in block or storage order every
        # stream (each worker of each rank) does, while under the full
        # shuffle a rank's workers take turns at its whole batches.
        counts = {sum(len(stream) for stream in rank) for rank in streams}
        assert len(counts) == 1, f"ranks yielded different numbers of batches with drop_last: {counts}"
        if o["shuffle"] != "full":
            counts = {len(stream) for rank in streams for stream in rank}
            assert len(counts) == 1, f"streams yielded different numbers of batches with drop_last: {counts}"
        assert set(anchors) <= oracle.anchors
    else:
        missing = oracle.anchors - set(anchors)
        assert not missing, f"{len(missing)} windows never came, e.g. {sorted(missing)[:3]}"


def check_again_and_resume(case, windows, oracle, o, shard, stack, epoch, workers, first) -> None:
    """The epoch again gives the same batches; a loader resumed after `n`
    of them (counted as a DataLoader takes them from its workers) gives
    the rest."""
    order = interleave(first)
    rng = np.random.default_rng(case.seed + 7)
    n = int(rng.integers(0, len(order) + 1))
    again = windows.loader(**o, shard=shard, stack=stack)
    again.set_epoch(epoch)
    state = again.state_dict(batches=n)
    resumed = windows.loader(**o, shard=shard, stack=stack)
    resumed.load_state_dict(state)
    jitters: dict = {}
    if workers == 1:
        rest = run_stream(resumed, case, oracle, jitters, o["batch_size"], o["drop_last"], o["normalize"])
        whole = run_stream(again, case, oracle, jitters, o["batch_size"], o["drop_last"], o["normalize"])
        assert whole == order, "the same epoch iterated again gave other batches"
    else:
        rest = interleave(
            [
                run_stream(resumed._for_worker(w, workers), case, oracle, jitters, o["batch_size"], o["drop_last"], o["normalize"])
                for w in range(workers)
            ]
        )
    assert rest == order[n:], f"resumed after {n} of {len(order)} batches: other batches"


class LazyServer:
    """The S3 server (moto behind the fault proxy, tests/s3/s3_server.py),
    started by the first case that reads from it."""

    def __init__(self):
        self.server = None

    def get(self):
        if self.server is None:
            sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "s3"))
            import s3_server

            self.server = s3_server.start({}, bucket=BUCKET)
        return self.server


@pytest.fixture(scope="module")
def bucket():
    lazy = LazyServer()
    yield lazy
    if lazy.server is not None:
        lazy.server.stop()


@pytest.mark.filterwarnings("ignore:Consolidated metadata")
@pytest.mark.parametrize("seed", SEEDS)
def test_loader_equals_numpy(seed, tmp_path, bucket):
    case = draw(seed)
    data = write_stores(case, np.random.default_rng(seed + 1), tmp_path)
    path = tmp_path / "store.zarr"
    ds = xr.open_zarr(path)
    options, locations = {}, {"main": path, "other": tmp_path / "other.zarr"}
    if case.remote:
        server = bucket.get()
        for name in ("store", "other") if case.other else ("store",):
            server.upload(f"case{seed}/{name}.zarr", tmp_path / f"{name}.zarr")
        server.proxy.configure(latency_ms=case.latency_ms)
        options = server.options()
        locations = {k: f"s3://{BUCKET}/case{seed}/{n}.zarr" for k, n in (("main", "store"), ("other", "other"))}
    oracle = Oracle(case, data)
    kwargs = dict(
        valid=case.valid,
        where=where_of(case, ds),
        block_size=case.block_size,
        threads=case.threads,
        cache=tmp_path / "cache" if case.cache else False,
        jitter=case.jitter or None,
    )
    if case.samples:
        unit = lambda n: f"+{6 * n}h" if case.hours else f"+{n}"  # noqa: E731
        kwargs.update(
            history={"time": case.history} if case.history > 1 else None,
            targets={v: [unit(n) for n in ls] for v, ls in case.targets.items()} or None,
            inputs=case.inputs,
        )
    ctx = zf.SessionContext()
    if case.other:
        variables = {"main": list(case.dtypes), "other": case.names[len(case.dtypes) :]}
        dataset = ctx.open_zarr(locations, variables=variables, **options)
    else:
        dataset = ctx.open_zarr(locations["main"], variables=list(case.dtypes), **options)
    windows = dataset.windows(case.sizes, case.overlaps or None, **kwargs)
    assert len(windows) == len(oracle.anchors), f"{case}"
    if case.samples:
        assert windows.channels == oracle.channels()
    try:
        for loader_options in case.loaders:
            try:
                check_loader(case, windows, oracle, loader_options)
            except AssertionError as e:
                raise AssertionError(f"{e}\nloader {loader_options}\ncase {case}") from None
    finally:
        if case.remote:
            bucket.get().proxy.configure()


# Bad arguments: one argument of a valid call made wrong at a time.
BAD_WINDOWS = {
    "input_dims": [{"lat": 0}, {"lat": -1}, {"lat": 99}, {"nope": 2}, {"lat": 2**63}, {"lat": 2**64}, {"lat": 1.5}, {}, "lat", 3, {3: 2}],
    "input_overlap": [{"lat": 3}, {"lat": 9}, {"lat": -1}, {"nope": 1}, {"time": 1}, {"lat": 2**63}, "lat", {"lat": "1"}],
    "valid": [1.5, -0.1, "some", float("nan"), float("inf"), {"inputs": 2}, {"outputs": "all"}, {"inputs": "nope"}, [1], {"inputs": None}],
    "history": [{"time": 0}, {"time": -1}, {"time": 13}, {"lat": 2}, {"nope": 2}, {"time": 2**40}, {"time": 2**64}, {"time": "2"}, 2, {"time": 2, "lon": 2}],
    "targets": [
        {"zz": "+1"}, {"a": "+1000"}, {"a": "+7h"}, {"a": "+1e400"}, {"a": "+99999999999999999999"}, {"a": "+-3"},
        {"a": "+1 fortnight"}, {"a": ""}, {"a": []}, {"a": "+600000000000000h"}, {"a": 1}, "a", {"a": ["+1", 2]},
        {"a": "+1", "b": "+1e3h"}, {"a": "+1.5"}, {"a": "+NaNh"}, {"a": "+infh"},
    ],
    "inputs": [["zz"], ["a", "a"], [], [3], 3],
    "jitter": [{"time": 1}, {"lat": -1}, {"lat": 2**64}, {"nope": 1}, {"lat": "1"}, ["lat"]],
    "where": ["nonsense ((", "a > 1", "time >= 'not a date'", "time >= '2020-01-01' OR", "1/0 = 1", 3, "time >= '2020-01-01'; DROP TABLE x"],
    "block_size": ["0", "-1KB", "1EB", "abc", 0, -5, 2**70],
    "threads": [-1, 2**40, 2**70, "2", 1.5],
    "cache": [3, ["x"]],
}
BAD_LOADERS = {
    "batch_size": [0, -1, 2**70, "4", 4.0],
    "shuffle": ["sometimes", 3],
    "buffer_size": ["0", "-1", "1EB", "abc", 2**70, 0],
    "prefetch": [0, -1, 2**40, 2**70, "2"],
    "threads": [-1, 2**40, 2**70, "2"],
    "drop_last": ["yes", 2],
    "shard": [(2, 2), (-1, 2), (0, 0), (0, 2**63), (0, -1), (0,), "one", (0, 2**70)],
    "seed": [-1, 2**64, 2**70, "x", 1.5],
    "stack": ["rows", 3],
    "normalize": [{"a": {"mean": "x", "std": 1}}, {"b": {"mean": 0, "std": 1}}, {"a": {"mean": 0}}, {"a": 3}],
}
# Odd but allowed: a target at the sample's own step, a jitter bound past
# the grid (offsets stay in the selection), a selection of nothing, one
# batch of everything.
ODD_WINDOWS = {
    "targets": [{"a": "+0"}, {"a": ("+1", "+2")}],
    "jitter": [{"lat": 2**62}, {"lat": 99}],
    "where": ["lat > 1000"],
    "valid": [None],
    "inputs": [("b", "a"), {"a": 1}.keys(), np.array(["a"])],
}
ODD_LOADERS = {"batch_size": [2**62, None]}


@pytest.fixture(scope="module")
def small_store(tmp_path_factory):
    case = draw(0)
    case.shape, case.chunks, case.dtypes, case.margin = (12, 8, 9), (5, 3, 4), {"a": "float32", "b": "float64"}, -1
    folder = tmp_path_factory.mktemp("bad")
    write_stores(case, np.random.default_rng(5), folder)
    return folder / "store.zarr"


def calls(windows: dict, loaders: dict):
    for stage, table in (("windows", windows), ("loader", loaders)):
        for argument, values in table.items():
            for value in values:
                yield stage, argument, value


def call(store, stage: str, argument: str, value) -> None:
    """Samples of `store` with `argument` of `stage` set to `value`: three batches."""
    windows_args = dict(
        input_dims={"lat": 3, "lon": 4}, input_overlap={"lat": 1}, valid={"inputs": 0.5, "targets": "all"},
        history={"time": 2}, targets={"a": "+1"}, jitter={"lat": 1}, cache=False,
    )
    loader_args = dict(batch_size=4, shuffle="block", stack="channels", buffer_size="64KB")
    (windows_args if stage == "windows" else loader_args)[argument] = value
    dataset = zf.SessionContext().open_zarr(store, variables=["a", "b"])
    windows = dataset.windows(**windows_args)
    loader = windows.loader(**loader_args)
    for batches, batch in enumerate(loader, 1):
        assert batch["inputs"].shape[0] <= (loader_args["batch_size"] or 256)
        if batches == 3:
            break
    assert len(windows) >= 0


@pytest.mark.filterwarnings("ignore:Consolidated metadata")
@pytest.mark.parametrize("stage,argument,value", list(calls(BAD_WINDOWS, BAD_LOADERS)), ids=lambda v: repr(v)[:40])
def test_a_bad_argument_is_an_error_naming_it_never_a_panic(small_store, stage, argument, value):
    """Each argument made wrong: a `ValueError` (a `TypeError` for a value
    of another type) whose message starts with the argument's name, raised
    before anything is read; never a panic (pyo3's `PanicException` is not
    an `Exception`: it fails the test), a hang or an allocation of the
    size asked."""
    with pytest.raises((ValueError, TypeError)) as error:
        call(small_store, stage, argument, value)
    assert str(error.value).startswith(f"{argument}:"), f"{argument}={value!r}: {error.value}"


@pytest.mark.filterwarnings("ignore:Consolidated metadata")
@pytest.mark.parametrize("stage,argument,value", list(calls(ODD_WINDOWS, ODD_LOADERS)), ids=lambda v: repr(v)[:40])
def test_an_odd_argument_that_is_allowed_works(small_store, stage, argument, value):
    call(small_store, stage, argument, value)

"""Benchmark (issue 24): the loader on the forecasting example, against xbatcher + DataLoader
and a plain xarray random-window loader, on the same windows of two sources.

The example: ERA5-like surface fields t2m, u10, v10 (time, lat, lon) and pressure levels z
(time, level=3, lat, lon) every 6 hours, beside an IMERG-like precip every 3 hours on the same
grid; samples of 64x64 cells every 32 cells, two input steps (t-6h, t) of every field (levels and
precip as channels: 14 channels) and targets t2m and precip at t+6h; batches of 32. Every arm
cuts the same windows from the same time range (anchors 1 .. nt-2): zarrfusion from the two
stores joined on time; xbatcher from an ``xr.merge`` of the sources with precip taken at ERA5's
times and the targets shifted by one step (``BatchGenerator`` with ``input_dims`` time 2 and
``input_overlap`` time 1, wrapped in a map-style Dataset for ``DataLoader(num_workers=2,
shuffle=True)``, as xbatcher's torch loader does); the plain loader draws random windows with
``isel`` from lazily opened stores, one process.

The zarrfusion arm keeps every window, as the peers do; "zarrfusion (valid rules)" builds the
validity index in the background while it loads (inputs at least 90 % present, targets complete:
fewer windows, not comparable one for one). The "rank 1/4" arms load rank 1 of 4 with those rules
and ``drop_last`` (every rank as many batches), in this process or through ``DataLoader`` workers
(``--workers``, spawned; each reopens the stores), from a cold index: the first batch waits until
every rank's and worker's first blocks are indexed, not for the whole index. ``--cache DIR``
keeps the index there: a second run with it starts from the cached index; ``--cache fresh`` gives
each arm an empty cache directory of its own (a cold index whose blocks the arm's processes share). The stores are read once before the arms (every arm reads them from the page cache). Per arm, in
its own process: time to the first batch (from opening the stores), samples/s over
the following batches, the wait per batch with a simulated 10 ms training step (p50, p95), and
the peak RSS of the process tree. Run:

    python bench/bench_forecast.py --make        # bench/data/forecast/{era5,imerg}.zarr, ~2.2 GB
    python bench/bench_forecast.py               # all arms, table on stdout and in bench/RESULTS.md
    python bench/bench_forecast.py --s3-latency 100 --arms zarrfusion   # from the local S3 server

With ``--s3-latency MS`` the stores are uploaded to the tests' S3 server (moto, on 127.0.0.1,
tests/s3/s3_server.py; ``--s3-server s3s`` for the s3s-fs binary, which unlike moto does not spend
~12 ms of Python CPU per GET on the benchmark's own cores) and read through its proxy adding MS
milliseconds to every request (``--s3-bandwidth MB/S``: and sending every answer through a
link of that bandwidth, shared by the answers in flight, as a slow network would); the
zarrfusion arms open ``s3://`` URLs, the peers zarr-python's ``ObjectStore`` over obstore (the
xbatcher arm's DataLoader workers then start with ``spawn``: obstore's runtime does not survive
``fork``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import shlex
import sys
import time

import numpy as np

HERE = Path(__file__).resolve().parent
NT, NY, NX = 576, 256, 512
DATA = HERE / "data" / "forecast"
WIN, STRIDE, BATCH = 64, 32, 32
INPUTS = ["t2m", "u10", "v10", "z", "precip"]


def make() -> None:
    """Writes the two stores with xarray, 32 ERA5 steps at a time."""
    import pandas as pd
    import xarray as xr

    DATA.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    lat = np.linspace(60.0, -3.75, NY)
    lon = np.arange(NX) * 0.25
    times = pd.date_range("2020-01-01", periods=NT, freq="6h")
    half = pd.date_range("2020-01-01", periods=2 * NT, freq="3h")
    for start in range(0, NT, 32):
        step = slice(start, start + 32)
        n = min(32, NT - start)
        era5 = xr.Dataset(
            {v: (("time", "lat", "lon"), rng.normal(size=(n, NY, NX)).astype("float32")) for v in ("t2m", "u10", "v10")}
            | {"z": (("time", "level", "lat", "lon"), rng.normal(size=(n, 3, NY, NX)).astype("float32"))},
            coords={"time": times[step], "level": [1000, 850, 500], "lat": lat, "lon": lon},
        )
        precip = rng.gamma(0.3, 2.0, size=(2 * n, NY, NX)).astype("float32")
        precip[rng.random(precip.shape) < 1e-4] = np.nan
        imerg = xr.Dataset({"precip": (("time", "lat", "lon"), precip)},
                           coords={"time": half[2 * start : 2 * start + 2 * n], "lat": lat, "lon": lon})
        if start == 0:
            era5.to_zarr(DATA / "era5.zarr", mode="w", zarr_format=3,
                         encoding={v: {"chunks": (4, 128, 128)} for v in ("t2m", "u10", "v10")} | {"z": {"chunks": (4, 3, 128, 128)}})
            imerg.to_zarr(DATA / "imerg.zarr", mode="w", zarr_format=3, encoding={"precip": {"chunks": (8, 128, 128)}})
        else:
            era5.to_zarr(DATA / "era5.zarr", append_dim="time")
            imerg.to_zarr(DATA / "imerg.zarr", append_dim="time")
        print(f"  steps {start + n}/{NT}", flush=True)


def anchors() -> list[tuple[int, int, int]]:
    """Every sample: (time, lat, lon) of its own step and first cell."""
    return [(t, i, j) for t in range(1, NT - 1) for i in range(0, NY - WIN + 1, STRIDE) for j in range(0, NX - WIN + 1, STRIDE)]


def timed(batches, first_started: float, n_rate: int, n_wait: int) -> dict:
    """First batch time, then the rate over `n_rate` batches, then waits over `n_wait` batches
    each followed by a 10 ms step."""
    it = iter(batches)
    first = next(it)
    check_shapes(first)
    t_first = time.perf_counter() - first_started
    started = time.perf_counter()
    for _ in range(n_rate):
        next(it)
    rate = n_rate * BATCH / (time.perf_counter() - started)
    waits = []
    for _ in range(n_wait):
        time.sleep(0.010)
        t0 = time.perf_counter()
        next(it)
        waits.append(time.perf_counter() - t0)
    return {"first_s": t_first, "samples_per_s": rate, "wait_p50_ms": 1e3 * float(np.percentile(waits, 50)),
            "wait_p95_ms": 1e3 * float(np.percentile(waits, 95)), "batches": 1 + n_rate + n_wait}


def check_shapes(batch) -> None:
    x, y = batch
    assert tuple(x.shape) == (BATCH, 14, WIN, WIN), x.shape
    assert tuple(y.shape) == (BATCH, 2, WIN, WIN), y.shape


def arm_zarrfusion(a, valid="any", shard=None, workers=0, shuffle="block") -> dict:
    import zarrfusion as zf
    if workers:
        # Imports are not timed (a training script has imported torch).
        import torch.utils.data

    started = time.perf_counter()
    ctx = zf.SessionContext()
    stores = {"era5": DATA / "era5.zarr", "imerg": DATA / "imerg.zarr"}
    options = {}
    if a.conn:
        conn = json.loads(a.conn)
        stores = {k: f"s3://{conn['bucket']}/{k}.zarr" for k in stores}
        options = conn["options"]
    src = ctx.open_zarr(stores, variables={"era5": ["t2m", "u10", "v10", "z"], "imerg": ["precip"]}, **options)
    cache = a.cache or False
    if cache == "fresh":
        # An empty cache directory of this arm's own: the index is built
        # cold, and the processes building it share its blocks there.
        import tempfile

        cache = tempfile.mkdtemp(prefix="zf-forecast-cache-")
    w = src.windows({"lat": WIN, "lon": WIN}, {"lat": WIN - STRIDE, "lon": WIN - STRIDE}, history={"time": 2},
                    targets={"t2m": "+6h", "precip": "+6h"}, valid=valid, cache=cache)
    loader = w.loader(batch_size=BATCH, shuffle=shuffle, seed=0, stack="channels", shard=shard,
                      drop_last=shard is not None)
    if workers:
        loader = torch.utils.data.DataLoader(loader.torch(), batch_size=None, num_workers=workers,
                                             multiprocessing_context="spawn")
    result = timed(((b["inputs"], b["targets"]) for b in loader), started, a.batches, a.wait_batches)
    result["windows"] = len(w)
    if a.cache == "fresh":
        import shutil

        shutil.rmtree(cache, ignore_errors=True)
    return result


def peer_store(name: str, conn: str | None):
    """What the peers open for store ``name``: the local path, or with ``conn`` (from the S3
    server) zarr-python's ObjectStore over obstore through the latency proxy."""
    if not conn:
        return DATA / f"{name}.zarr"
    import zarr
    from obstore.store import S3Store

    c = json.loads(conn)
    o = c["options"]
    s3 = S3Store(c["bucket"], prefix=f"{name}.zarr", endpoint=o["aws.endpoint"], access_key_id=o["aws.access_key_id"],
                 secret_access_key=o["aws.secret_access_key"], region=o["aws.region"],
                 client_options={"allow_http": True})
    return zarr.storage.ObjectStore(s3, read_only=True)


class XbatcherDataset:
    """xbatcher's windows of the merged sources as a map-style torch dataset: inputs (14, 64, 64)
    and targets (2, 64, 64) per window, as xbatcher.loaders.torch.MapDataset does."""

    def __init__(self, conn: str | None = None) -> None:
        self.gen = None
        self.conn = conn

    def __getstate__(self):
        # Workers open the stores themselves (an object store's client does not cross processes).
        return {"gen": None, "conn": self.conn}

    def _generator(self):
        if self.gen is None:
            import xarray as xr
            import xbatcher

            era5 = xr.open_zarr(peer_store("era5", self.conn), chunks=None)
            imerg = xr.open_zarr(peer_store("imerg", self.conn), chunks=None)
            merged = xr.merge([era5[["t2m", "u10", "v10", "z"]], imerg.precip.sel(time=era5.time)])
            targets = merged[["t2m", "precip"]].shift(time=-1).rename(t2m="t2m_next", precip="precip_next")
            ds = xr.merge([merged, targets]).isel(time=slice(0, NT - 1))
            self.gen = xbatcher.BatchGenerator(ds, input_dims={"time": 2, "lat": WIN, "lon": WIN},
                                               input_overlap={"time": 1, "lat": WIN - STRIDE, "lon": WIN - STRIDE})
        return self.gen

    def __len__(self) -> int:
        return len(self._generator())

    def __getitem__(self, i):
        w = self._generator()[i]
        x = np.concatenate([np.stack([w[v].values for v in ("t2m", "u10", "v10")], 1), w.z.values,
                            w.precip.values[:, None]], 1).reshape(14, WIN, WIN)
        y = np.stack([w.t2m_next.values[-1], w.precip_next.values[-1]])
        return x.astype(np.float32), y.astype(np.float32)


def arm_xbatcher(a) -> dict:
    import torch

    started = time.perf_counter()
    dataset = XbatcherDataset(a.conn)
    n = len(dataset)
    # From S3 the workers are spawned: obstore's runtime does not survive fork.
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=a.workers,
                                         generator=torch.Generator().manual_seed(0),
                                         multiprocessing_context="spawn" if a.conn else None)
    result = timed(loader, started, a.peer_batches, a.peer_wait_batches)
    result["windows"] = n
    return result


def arm_xarray(a) -> dict:
    import xarray as xr

    started = time.perf_counter()
    era5 = xr.open_zarr(peer_store("era5", a.conn), chunks=None)
    imerg = xr.open_zarr(peer_store("imerg", a.conn), chunks=None)
    everything = anchors()
    rng = np.random.default_rng(0)

    def batches():
        while True:
            xs, ys = [], []
            for k in rng.integers(0, len(everything), BATCH):
                t, i, j = everything[k]
                box = {"lat": slice(i, i + WIN), "lon": slice(j, j + WIN)}
                e = era5.isel(time=slice(t - 1, t + 2), **box)
                p = imerg.precip.isel(time=slice(2 * t - 2, 2 * t + 3, 2), **box).values
                steps = [np.concatenate([np.stack([e[v].values[s] for v in ("t2m", "u10", "v10")]), e.z.values[s], p[s][None]])
                         for s in (0, 1)]
                xs.append(np.concatenate(steps))
                ys.append(np.stack([e.t2m.values[2], p[2]]))
            yield np.stack(xs), np.stack(ys)

    result = timed(batches(), started, a.peer_batches, a.peer_wait_batches)
    result["windows"] = len(everything)
    return result


def arm_zarrfusion_full(a) -> dict:
    return arm_zarrfusion(a, shuffle="full")


def arm_zarrfusion_valid(a) -> dict:
    return arm_zarrfusion(a, valid={"inputs": 0.9, "targets": "all"})


def arm_zarrfusion_rank(a) -> dict:
    return arm_zarrfusion(a, valid={"inputs": 0.9, "targets": "all"}, shard=(1, 4))


def arm_zarrfusion_rank_workers(a) -> dict:
    return arm_zarrfusion(a, valid={"inputs": 0.9, "targets": "all"}, shard=(1, 4), workers=a.workers)


ARMS = {"zarrfusion": arm_zarrfusion, "zarrfusion (full shuffle)": arm_zarrfusion_full,
        "zarrfusion (valid rules)": arm_zarrfusion_valid,
        "zarrfusion rank 1/4 drop_last (valid rules)": arm_zarrfusion_rank,
        "zarrfusion rank 1/4 drop_last in DataLoader workers (valid rules)": arm_zarrfusion_rank_workers,
        "xbatcher+DataLoader": arm_xbatcher, "xarray random windows": arm_xarray}
DEFAULT_ARMS = [arm for arm in ARMS if "rank" not in arm]


def main() -> int:
    global NT, DATA
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--make", action="store_true", help="write the stores and stop")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                    help="comma-separated (default: the single-process arms and the peers; the rank arms "
                         "yield an epoch of a quarter of the windows: pass --batches 150 --wait-batches 100)")
    ap.add_argument("--batches", type=int, default=300, help="zarrfusion batches timed for the rate")
    ap.add_argument("--wait-batches", type=int, default=200, help="zarrfusion batches waited for after a 10 ms step")
    ap.add_argument("--peer-batches", type=int, default=6, help="peer batches timed for the rate")
    ap.add_argument("--peer-wait-batches", type=int, default=6, help="peer batches waited for")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers for xbatcher")
    ap.add_argument("--nt", type=int, default=NT, help=f"ERA5 steps (default {NT}: 2.2 GB; others in data/forecast-NT)")
    ap.add_argument("--s3-latency", type=float, default=None, help="read from the local S3 server with this latency (ms)")
    ap.add_argument("--s3-server", choices=("moto", "s3s"), default="moto",
                    help="the S3 server: moto (Python) or s3s-fs (Rust; ZARRFUSION_S3S_FS or PATH)")
    ap.add_argument("--s3-bandwidth", type=float, default=0,
                    help="with --s3-latency: the proxy's link in MB/s, shared by the answers in flight (0: unlimited)")
    ap.add_argument("--cache", help="the window index's cache directory (default: none, every arm builds it; "
                    "'fresh': an empty directory per arm, shared by its processes)")
    ap.add_argument("--conn", help=argparse.SUPPRESS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.nt != NT:
        # Another size, in a directory of its own.
        NT, DATA = a.nt, HERE / "data" / f"forecast-{a.nt}"
    if a.make:
        make()
        return 0
    if a.child:
        print(json.dumps(ARMS[a.child](a)))
        return 0
    sys.path.insert(0, str(HERE))
    from measure import report, run_child

    files = [f for f in DATA.rglob("*") if f.is_file()]
    size = sum(f.stat().st_size for f in files)
    # Every arm reads the stores from the page cache (or the S3 server's memory).
    for f in files:
        f.read_bytes()
    server = None
    extra = []
    if a.s3_latency is not None:
        sys.path.insert(0, str(HERE.parent / "tests" / "s3"))
        import s3_server

        server = s3_server.start({"era5.zarr": DATA / "era5.zarr", "imerg.zarr": DATA / "imerg.zarr"}, bucket="bench",
                                 backend=a.s3_server)
        server.proxy.configure(latency_ms=a.s3_latency, bandwidth_mb_s=a.s3_bandwidth)
        extra = ["--conn", json.dumps({"bucket": "bench", "options": server.options()})]
    rows = {}
    try:
        for arm in a.arms.split(","):
            cmd = [sys.executable, __file__, "--child", arm] + extra + [
                f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
                if k in ("batches", "wait_batches", "peer_batches", "peer_wait_batches", "workers", "nt", "cache") and v is not None]
            rows[arm] = run_child(cmd, timeout=1800)
            print(arm, rows[arm], flush=True)
    finally:
        if server is not None:
            server.stop()
    zf = rows.get("zarrfusion", {})
    lines = [
        f"## Forecast loader run {time.strftime('%Y-%m-%d %H:%M')} (issue 24: two sources, history 2, target +6h"
        + (f", from the local S3 server ({a.s3_server}) at {a.s3_latency:g} ms a request)" if server is not None
           else ", local files)"),
        "",
        f"- Command: `python bench/bench_forecast.py {shlex.join(sys.argv[1:])}`".replace(" `", "`"),
        f"- Machine: {os.cpu_count()} cores; stores `{DATA.relative_to(HERE.parent)}/` {size / 1e9:.2f} GB on disk "
        f"(era5 {NT} steps of 6 h, imerg {2 * NT} of 3 h, {NY}x{NX}); batch {BATCH} of {WIN}x{WIN} every {STRIDE}, "
        "14 input channels (2 steps x t2m, u10, v10, z at 3 levels, precip), 2 targets.",
        "",
        "| arm | windows | first batch s | samples/s | vs zarrfusion | wait p50 ms | wait p95 ms | peak RSS MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, r in rows.items():
        if "error" in r:
            lines.append(f"| {arm} | - | - | - | - | - | - | failed: {r['error']} |")
            continue
        peer = not arm.startswith("zarrfusion")
        ratio = zf.get("samples_per_s", 0) / r["samples_per_s"] if peer and r["samples_per_s"] else None
        lines.append(f"| {arm} | {r['windows']} | {r['first_s']:.2f} | {r['samples_per_s']:.0f} | "
                     f"{'-' if ratio is None else f'{ratio:.0f}x slower'} | {r['wait_p50_ms']:.2f} | {r['wait_p95_ms']:.2f} | "
                     f"{r['peak_rss'] / 2**20:.0f} |")
    full = rows.get("zarrfusion (full shuffle)", {})
    if full.get("samples_per_s"):
        ratios = [f"{arm} {full['samples_per_s'] / r['samples_per_s']:.0f}x slower" for arm, r in rows.items()
                  if not arm.startswith("zarrfusion") and r.get("samples_per_s")]
        if ratios:
            lines += ["", "- Against zarrfusion's full shuffle (a permutation of all windows, the order "
                      "xbatcher's `DataLoader(shuffle=True)` takes): " + ", ".join(ratios) + "."]
    report(lines, HERE / "RESULTS.md", write=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

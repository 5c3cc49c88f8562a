#!/usr/bin/env python3
"""Rechunk then reduce per cell: each grid cell's mean and standard
deviation over time, from a store chunked by time (one step a chunk),
through a copy in space chunks (all time, 16, 16): the pattern rechunking is
for, as one query.

Arms, each in a fresh subprocess (so its peak RSS is its own), same store,
same budget, same threads:

* zarrfusion:  ``SELECT lat, lon, avg(t2m), stddev_pop(t2m) FROM rechunk('era5',
  time => T, lat => 16, lon => 16) GROUP BY lat, lon`` (the dense reduction of
  the rechunked store, after the copy);
* zarrfusion-hash:  the same query with ``zarrfusion.dense_reduction = false``
  (DataFusion's hash aggregate over the rechunked store's scan: what the
  query ran as before the dense reduction saw through ``rechunk(...)``);
* zarrfusion-direct:  the same ``GROUP BY`` of the store as it is (no copy:
  the dense reduction folds every time step into per-cell state), the
  reference for what the copy costs;
* dask:  ``xarray.open_zarr(store).t2m.chunk(time=-1, lat=16, lon=16)`` then
  ``mean("time")`` and ``std("time")`` on Dask's threads scheduler (Dask
  rechunks in memory, with no budget; nothing is written).

Per arm: wall time (imports excluded), peak RSS of the process, and a check
against numpy: the mean and standard deviation of 16 random cells' full time
series read with zarr-python.

    ~/.cache/zarrfusion-venv/bin/python bench/bench_rechunk_reduce.py [--store bench/data/era5_1gb.zarr]
        [--allowed-mem 500MB] [--arms zarrfusion,zarrfusion-hash,zarrfusion-direct,dask]

Appends a section to bench/RESULTS.md unless --no-write.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from measure import arm_table, parse_mem, print_arm, report, run_child

ROOT = Path(__file__).resolve().parent.parent
ARMS = ["zarrfusion", "zarrfusion-hash", "zarrfusion-direct", "dask"]
SQL = ("SELECT lat, lon, avg(t2m) AS mean, stddev_pop(t2m) AS std FROM {source} "
       "GROUP BY lat, lon")


def child(arm: str, store: str, mem: str, work: str, threads: int, steps: int, space: int, out: str) -> dict:
    # Imports before the clock starts.
    if arm.startswith("zarrfusion"):
        import zarrfusion as zf
    else:
        import dask
        import xarray as xr
    time.sleep(0.5)
    t0 = time.perf_counter()
    if arm.startswith("zarrfusion"):
        config = {"datafusion.execution.target_partitions": str(threads)}
        if arm == "zarrfusion-hash":
            config["zarrfusion.dense_reduction"] = "false"
        ctx = zf.SessionContext(allowed_mem=mem, work_dir=work, config=config)
        ctx.register_zarr("era5", store)
        source = "era5" if arm == "zarrfusion-direct" else (
            f"rechunk('era5', time => {steps}, lat => {space}, lon => {space})")
        grids = ctx.sql(SQL.format(source=source)).to_xarray()
        grids = grids.sortby("lat").sortby("lon")
        mean, std = grids["mean"].values, grids["std"].values
    else:
        with dask.config.set(scheduler="threads", num_workers=threads):
            t2m = xr.open_zarr(store)["t2m"].chunk({"time": -1, "lat": space, "lon": space})
            t2m = t2m.sortby("lat").sortby("lon")
            mean, std = dask.compute(t2m.mean("time").data, t2m.std("time").data)
    seconds = time.perf_counter() - t0
    np.save(out, np.stack([mean, std]))
    return {"seconds": seconds}


def check(store: str, out: str, seed: int = 0) -> str:
    """The arm's mean and std of 16 random cells against numpy's."""
    import zarr

    group = zarr.open_group(store, mode="r")
    t2m, lat, lon = group["t2m"], group["lat"][:], group["lon"][:]
    lat_order, lon_order = np.argsort(lat), np.argsort(lon)
    got = np.load(out)
    rng = np.random.default_rng(seed)
    worst = 0.0
    for _ in range(16):
        i, j = int(rng.integers(len(lat))), int(rng.integers(len(lon)))
        series = t2m[:, lat_order[i], lon_order[j]].astype(np.float64)
        for k, want in enumerate([series.mean(), series.std()]):
            worst = max(worst, abs(got[k, i, j] - want) / max(abs(want), 1e-12))
    return "ok" if worst < 1e-5 else f"FAILED (relative error {worst:.2e})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=str(ROOT / "bench/data/era5_1gb.zarr"))
    ap.add_argument("--space", type=int, default=16, help="chunk length along lat and lon of the copy")
    ap.add_argument("--allowed-mem", default="500MB")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--child", nargs=8, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        arm, store, mem, work, threads, steps, space, out = a.child
        print(json.dumps(child(arm, store, mem, work, int(threads), int(steps), int(space), out)))
        return
    import zarr

    src = zarr.open_array(a.store, path="t2m", mode="r")
    print(f"{a.store} t2m {src.shape} {src.dtype} chunks {src.chunks} -> ({src.shape[0]}, {a.space}, {a.space}), "
          f"{src.nbytes / 1e9:.2f} GB raw, allowed_mem {a.allowed_mem}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="zf-bench-rechunk-reduce-", dir=ROOT / "bench/data") as tmp:
        for arm in a.arms.split(","):
            work = Path(tmp) / f"{arm}-work"
            work.mkdir()
            out = str(Path(tmp) / f"{arm}.npy")
            cmd = [sys.executable, __file__, "--child", arm, a.store, a.allowed_mem, str(work),
                   str(a.threads), str(src.shape[0]), str(a.space), out]
            r = run_child(cmd, a.timeout)
            r["arm"] = arm
            if "error" not in r:
                r["check"] = check(a.store, out)
                left = list(work.iterdir())
                if left:
                    r["note"] = f"left in work_dir: {[p.name for p in left]}"
            shutil.rmtree(work, ignore_errors=True)
            results.append(r)
            print_arm(r)
    ok = {r["arm"]: r for r in results if "error" not in r}
    base = ok.get("zarrfusion")
    budget = parse_mem(a.allowed_mem)
    lines = [
        f"## Rechunk then reduce run {dt.datetime.now():%Y-%m-%d %H:%M} (issues 26/28: a GROUP BY of rechunk(...))",
        "",
        f"- Command: `~/.cache/zarrfusion-venv/bin/python bench/bench_rechunk_reduce.py {' '.join(sys.argv[1:])}`"
        .rstrip(),
        f"- Machine: {os.cpu_count()} cores; load average before the run {os.getloadavg()[0]:.1f}",
        f"- Store: `{Path(a.store).name}`, `t2m` {src.shape} {src.dtype}, chunks {src.chunks}, copied into "
        f"({src.shape[0]}, {a.space}, {a.space}); {src.nbytes / 1e9:.2f} GB raw; allowed_mem {a.allowed_mem} "
        f"({budget / 2**20:.0f} MiB); {a.threads} threads",
        "",
        *arm_table(results, base, budget),
    ]
    lines.append("")
    report(lines, ROOT / "bench/RESULTS.md", write=not a.no_write)


if __name__ == "__main__":
    main()

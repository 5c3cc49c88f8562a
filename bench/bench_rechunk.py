#!/usr/bin/env python3
"""Rechunk benchmark (issue 4): an ERA5-like variable from time chunks
(1, lat, lon) to space chunks (all time, 16, 16) under a memory budget.

Arms, each in a fresh subprocess (so its peak RSS is its own), same store,
same budget, same target chunks:

* zarrfusion:  ``SessionContext(allowed_mem=..., work_dir=...).rechunk(src, dst, {...})``
  (every array of the store; coordinates too);
* cubed-threads / cubed-processes:  ``cubed.from_zarr(src, path=var, spec=Spec(work_dir,
  allowed_mem)).rechunk(target)`` then ``cubed.to_zarr`` with the threads / processes
  executor (the variable only);
* dask:  ``dask.array.from_zarr(...).rechunk(target).to_zarr(...)`` on the threads
  scheduler (the variable only; Dask has no memory budget).

Per arm: wall time (process start and imports excluded: from before opening the
store to the output complete), peak RSS of the process tree sampled every 0.05 s, bytes on
disk of the output, and a check: the output's chunks are the target's and 8
random full time series equal the source (read with zarr-python).

    .venv/bin/python bench/bench_rechunk.py [--store bench/data/era5_1gb.zarr]
        [--var t2m] [--allowed-mem 500MB] [--arms zarrfusion,cubed-threads,...]

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
from measure import parse_mem, print_arm, report, run_child

ROOT = Path(__file__).resolve().parent.parent
ARMS = ["zarrfusion", "cubed-threads", "cubed-processes", "dask"]


def child(arm: str, src: str, dst: str, var: str, target: tuple, mem: str, work: str, threads: int) -> dict:
    # Imports before the clock starts.
    if arm == "zarrfusion":
        import zarrfusion as zf
    elif arm.startswith("cubed"):
        import cubed
        from cubed.runtime.executors.local import ProcessesExecutor, ThreadsExecutor
    else:
        import dask
        import dask.array as da
    t0 = time.perf_counter()
    out: dict = {}
    if arm == "zarrfusion":
        ctx = zf.SessionContext(allowed_mem=mem, work_dir=work)
        summary = ctx.rechunk(src, dst, {"time": target[0], "lat": target[1], "lon": target[2]}, threads=threads)
        a = summary["arrays"][var]
        out["note"] = (f"{a['stages']} stage(s), chunks {a['chunks']}, tasks {a['tasks']}, workers {a['workers']}, "
                       f"projected {a['projected_memory'] / 2**20:.0f} MiB; read {summary['bytes_read'] / 1e9:.2f} GB, "
                       f"written {summary['bytes_written'] / 1e9:.2f} GB decoded")
    elif arm.startswith("cubed"):
        spec = cubed.Spec(work_dir=work, allowed_mem=mem)
        a = cubed.from_zarr(src, path=var, spec=spec)
        b = a.rechunk(target)
        executor = ThreadsExecutor() if arm == "cubed-threads" else ProcessesExecutor()
        cubed.to_zarr(b, dst, path=var, executor=executor, max_workers=threads)
    elif arm == "dask":
        with dask.config.set(scheduler="threads", num_workers=threads):
            a = da.from_zarr(src, component=var)
            a.rechunk(target).to_zarr(dst, component=var)
    else:
        raise SystemExit(f"unknown arm {arm}")
    out["seconds"] = time.perf_counter() - t0
    return out


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def check(src: str, dst: Path, var: str, target: tuple, seed: int = 0) -> str:
    import zarr

    a = zarr.open_array(src, path=var, mode="r")
    b = zarr.open_array(str(dst), path=var, mode="r")
    if tuple(b.chunks) != tuple(min(t, n) for t, n in zip(target, a.shape)):
        return f"chunks {b.chunks} != {target}"
    rng = np.random.default_rng(seed)
    for _ in range(8):
        i, j = rng.integers(a.shape[1]), rng.integers(a.shape[2])
        if not np.array_equal(a[:, i, j], b[:, i, j], equal_nan=True):
            return f"series ({i}, {j}) differs"
    return "ok"


def run_arm(arm: str, a, target: tuple, scratch: Path) -> dict:
    dst = scratch / f"{arm}.zarr"
    work = scratch / f"{arm}-work"
    work.mkdir()
    cmd = [sys.executable, __file__, "--child", arm, a.store, str(dst), a.var, ",".join(map(str, target)),
           a.allowed_mem, str(work), str(a.threads)]
    r = run_child(cmd, a.timeout)
    r["arm"] = arm
    if "error" not in r:
        r.update(bytes_on_disk=du(dst), check=check(a.store, dst, a.var, target))
    shutil.rmtree(dst, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=str(ROOT / "bench/data/era5_1gb.zarr"))
    ap.add_argument("--var", default="t2m")
    ap.add_argument("--space", type=int, default=16, help="target chunk length along lat and lon")
    ap.add_argument("--allowed-mem", default="500MB")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--child", nargs=8, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        arm, src, dst, var, target, mem, work, threads = a.child
        print(json.dumps(child(arm, src, dst, var, tuple(map(int, target.split(","))), mem, work, int(threads))))
        return
    import zarr

    src = zarr.open_array(a.store, path=a.var, mode="r")
    target = (src.shape[0], a.space, a.space)
    raw = src.nbytes
    print(f"{a.store} {a.var} {src.shape} {src.dtype} chunks {src.chunks} -> {target}, "
          f"{raw / 1e9:.2f} GB raw, allowed_mem {a.allowed_mem}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="zf-bench-rechunk-", dir=ROOT / "bench/data") as tmp:
        for arm in a.arms.split(","):
            r = run_arm(arm, a, target, Path(tmp))
            results.append(r)
            print_arm(r, f", {r['bytes_on_disk'] / 1e9:.2f} GB on disk" if "error" not in r else "")
    ok = {r["arm"]: r for r in results if "error" not in r}
    base = ok.get("zarrfusion")
    budget = parse_mem(a.allowed_mem)
    lines = [
        f"## Rechunk run {dt.datetime.now():%Y-%m-%d %H:%M} (issue 4: rechunk)",
        "",
        f"- Command: `.venv/bin/python bench/bench_rechunk.py {' '.join(sys.argv[1:])}`".rstrip() + "",
        f"- Machine: {os.cpu_count()} cores; load average before the run {os.getloadavg()[0]:.1f}",
        f"- Store: `{Path(a.store).name}`, `{a.var}` {src.shape} {src.dtype}, chunks {src.chunks} -> {target}; "
        f"{raw / 1e9:.2f} GB raw; allowed_mem {a.allowed_mem} ({budget / 2**20:.0f} MiB); {a.threads} threads",
        "",
        "| arm | seconds | zarrfusion is | peak RSS MiB | RSS over allowed_mem MiB | output on disk GB | check | notes |",
        "|---|---:|---:|---:|---|---:|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['arm']} | - | - | - | - | - | error | {r['error']} |")
            continue
        ratio = f"{r['seconds'] / base['seconds']:.1f}x faster" if base and r is not base else "-"
        lines.append(f"| {r['arm']} | {r['seconds']:.2f} | {ratio} | {r['peak_rss'] / 2**20:.0f} | "
                     f"{max(0, r['peak_rss'] - budget) / 2**20:.0f} | {r['bytes_on_disk'] / 1e9:.2f} | {r['check']} | "
                     f"{r.get('note', '')} |")
    lines.append("")
    report(lines, ROOT / "bench/RESULTS.md", write=not a.no_write)


if __name__ == "__main__":
    main()

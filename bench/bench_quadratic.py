#!/usr/bin/env python3
"""Quadratic Means benchmark (issue 4), the workload of the "Optimizing Cubed"
seed: for u, v of shape (T, 1, 987, 1920) float64 in chunks (10, 1, 987, 1920),

    SELECT j, i, avg(u*u), avg(v*v), avg(u*v) FROM quad GROUP BY j, i ORDER BY j, i

that is, the means of u*u, v*v and u*v over time, under a 2 GB budget.

Arms, each in a fresh subprocess (so its peak RSS is its own), same store:

* zarrfusion:  the SQL above through ``SessionContext(allowed_mem=...)`` (a
  dense reduction: elementwise products and the first level of the means in
  one pass over each block), the result as gridded ``xarray`` variables
  (``to_xarray``: the rows come in C order of (j, i), so they are reshaped
  without a scatter);
* numpy:  u and v read whole into memory with zarr-python, then
  ``(u*u).mean(axis=0)`` etc.; its time is reported twice, end to end and the
  compute alone (data already in memory);
* dask:  ``da.from_zarr`` and the three means computed together (threads);
* cubed-threads / cubed-processes:  ``cubed.from_zarr`` with
  ``Spec(work_dir, allowed_mem)`` and ``xp.mean`` of the products, computed
  together with each executor.

Per arm: wall time (imports, and 0.5 s for their side effects to settle, excluded), peak RSS of the process tree sampled
every 0.05 s, and a check against the numpy arm's means (relative 1e-9).

    .venv/bin/python bench/bench_quadratic.py --make      # writes bench/data/quad.zarr (T=200: 6 GB)
    .venv/bin/python bench/bench_quadratic.py [--allowed-mem 2GB] [--arms zarrfusion,numpy,...]

Appends a section to bench/RESULTS.md unless --no-write.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from measure import arm_table, parse_mem, report, run_child

ROOT = Path(__file__).resolve().parent.parent
STORE = ROOT / "bench/data/quad.zarr"
ARMS = ["zarrfusion", "numpy", "dask", "cubed-threads", "cubed-processes"]
SQL = "SELECT j, i, avg(u*u) AS uu, avg(v*v) AS vv, avg(u*v) AS uv FROM quad GROUP BY j, i ORDER BY j, i"
NAMES = ("uu", "vv", "uv")


def make(store: Path, t: int) -> None:
    """u and v, (t, 1, 987, 1920) float64 in (10, 1, 987, 1920) chunks,
    uncompressed (random values do not compress), dimensions (t, k, j, i)."""
    import zarr

    shape, chunks = (t, 1, 987, 1920), (10, 1, 987, 1920)
    group = zarr.open_group(str(store), mode="w", zarr_format=3)
    rng = np.random.default_rng(42)
    for name in ("u", "v"):
        a = group.create_array(name, shape=shape, chunks=chunks, dtype="f8", compressors=None,
                               fill_value=np.nan, dimension_names=("t", "k", "j", "i"))
        for start in range(0, t, 10):
            n = min(10, t - start)
            a[start:start + n] = rng.standard_normal((n, 1, 987, 1920))
        print(f"wrote {name} {shape}", flush=True)


def child(arm: str, store: str, mem: str, work: str, threads: int, out: str) -> dict:
    # Imports before the clock starts.
    if arm == "zarrfusion":
        import xarray
        import zarrfusion as zf

        # xarray imports its duck-array modules (dask among them) when it
        # makes its first variable.
        xarray.Dataset({"x": ("d", np.zeros(1))})
    elif arm == "numpy":
        import zarr
    elif arm == "dask":
        import dask
        import dask.array as da
    else:
        import cubed
        import cubed.array_api as xp
        from cubed.runtime.executors.local import ProcessesExecutor, ThreadsExecutor
    # Let import side effects settle: OpenBLAS's threads, started when numpy
    # loads, spin for about 0.1 s of CPU before they sleep.
    time.sleep(0.5)
    result: dict = {}
    t0 = time.perf_counter()
    if arm == "zarrfusion":
        ctx = zf.SessionContext(allowed_mem=mem, work_dir=work)
        ctx.register_zarr("quad", store)
        grids = ctx.sql(SQL).to_xarray()
        means = [grids[name].values for name in NAMES]
    elif arm == "numpy":
        u = zarr.open_array(store, path="u", mode="r")[:]
        v = zarr.open_array(store, path="v", mode="r")[:]
        t1 = time.perf_counter()
        means = [(u * u).mean(axis=0)[0], (v * v).mean(axis=0)[0], (u * v).mean(axis=0)[0]]
        result["compute_seconds"] = time.perf_counter() - t1
    elif arm == "dask":
        with dask.config.set(scheduler="threads", num_workers=threads):
            u = da.from_zarr(store, component="u")
            v = da.from_zarr(store, component="v")
            means = [m[0] for m in dask.compute((u * u).mean(axis=0), (v * v).mean(axis=0), (u * v).mean(axis=0))]
    else:
        spec = cubed.Spec(work_dir=work, allowed_mem=mem)
        u = cubed.from_zarr(store, path="u", spec=spec)
        v = cubed.from_zarr(store, path="v", spec=spec)
        executor = ThreadsExecutor() if arm == "cubed-threads" else ProcessesExecutor()
        computed = cubed.compute(xp.mean(u * u, axis=0), xp.mean(v * v, axis=0), xp.mean(u * v, axis=0),
                                 executor=executor, max_workers=threads)
        means = [np.asarray(m)[0] for m in computed]
    result["seconds"] = time.perf_counter() - t0
    np.save(out, np.stack(means))
    return result


def compute_note(r: dict, base: dict | None) -> str:
    """The numpy arm's compute time alone, against zarrfusion end to end."""
    if "compute_seconds" not in r:
        return ""
    note = f"compute alone (data in memory): {r['compute_seconds']:.2f} s"
    if base:
        note += f"; zarrfusion end to end / numpy compute = {base['seconds'] / r['compute_seconds']:.2f}"
    return note


def run_arm(arm: str, a, scratch: Path) -> dict:
    work = scratch / f"{arm}-work"
    work.mkdir()
    out = scratch / f"{arm}.npy"
    cmd = [sys.executable, __file__, "--child", arm, a.store, a.allowed_mem, str(work), str(a.threads), str(out)]
    r = run_child(cmd, a.timeout)
    r.update(arm=arm, means=str(out))
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=str(STORE))
    ap.add_argument("--make", action="store_true", help="write the store, then stop")
    ap.add_argument("--t", type=int, default=200, help="time steps written by --make")
    ap.add_argument("--allowed-mem", default="2GB")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        arm, store, mem, work, threads, out = a.child
        print(json.dumps(child(arm, store, mem, work, int(threads), out)))
        return
    if a.make:
        make(Path(a.store), a.t)
        return
    import zarr

    u = zarr.open_array(a.store, path="u", mode="r")
    raw = 2 * u.nbytes
    print(f"{a.store}: u, v {u.shape} {u.dtype} chunks {u.chunks}, {raw / 1e9:.2f} GB raw, "
          f"allowed_mem {a.allowed_mem}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="zf-bench-quad-", dir=ROOT / "bench/data") as tmp:
        for arm in a.arms.split(","):
            r = run_arm(arm, a, Path(tmp))
            results.append(r)
            if "error" in r:
                print(f"{arm}: ERROR {r['error']}", flush=True)
            else:
                print(f"{arm}: {r['seconds']:.2f} s, peak RSS {r['peak_rss'] / 2**20:.0f} MiB", flush=True)
        reference = next((np.load(r["means"]) for r in results if r["arm"] == "numpy" and "error" not in r), None)
        for r in results:
            if "error" in r:
                continue
            if reference is None:
                r["check"] = "no numpy reference"
            else:
                means = np.load(r["means"])
                r["check"] = "ok" if np.allclose(means, reference, rtol=1e-9, atol=0) else "DIFFERS"
    ok = {r["arm"]: r for r in results if "error" not in r}
    base = ok.get("zarrfusion")
    budget = parse_mem(a.allowed_mem)
    lines = [
        f"## Quadratic Means run {dt.datetime.now():%Y-%m-%d %H:%M} (issue 4)",
        "",
        f"- Command: `.venv/bin/python bench/bench_quadratic.py {' '.join(sys.argv[1:])}`".rstrip(),
        f"- Machine: {os.cpu_count()} cores; load average before the run {os.getloadavg()[0]:.1f}",
        f"- Store: `{Path(a.store).name}`, u and v {u.shape} {u.dtype}, chunks {u.chunks}, uncompressed; "
        f"{raw / 1e9:.2f} GB raw; allowed_mem {a.allowed_mem} ({budget / 2**20:.0f} MiB); {a.threads} threads",
        f"- Query: `{SQL}`",
        "",
        *arm_table(results, base, budget, notes=lambda r: compute_note(r, base), digits=1),
    ]
    lines.append("")
    report(lines, ROOT / "bench/RESULTS.md", write=not a.no_write)


if __name__ == "__main__":
    main()

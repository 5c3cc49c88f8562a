#!/usr/bin/env python3
"""FFT along a dimension split into several chunks (issue 5, benchmark 1).

    .venv/bin/python bench/bench_fft.py [--nt 1008] [--allowed-mem 1GB] [--arms ...]

The store (`bench/data/fft_era5.zarr`, written here when missing): float32
t2m (time nt, lat 721, lon 1440), chunks (8, 145, 1440) -- lat in five
chunks --, zstd; nt 1008 is 4.19 GB raw. Every arm computes the plain
forward FFT along lat (numpy's `fft(axis=1)`, complex64 out) and, except the
in-memory ones, writes it to a new Zarr store:

- zarrfusion: `EXPLAIN ANALYZE COPY (SELECT * FROM fft('era5', 't2m',
  dims => 'lat', true_phase => false, true_amplitude => false, shift =>
  false)) TO ...` in `allowed_mem` (the transform phase is the operator's
  `transform_time` metric: wall time with a block in the kernel);
- zarrfusion-serial: the same with one task (`target_partitions = 1`), so
  no read, decode or write runs beside a transform and the transform
  phase is the kernel's time on all cores alone;
- io-once: the one-pass lower bound, zarr-python reading each slab of 8
  time steps and writing it back as complex64 (no transform);
- scipy / numpy: `scipy.fft.fft(a, axis=1, workers=2)` / `numpy.fft.fft`
  on the array loaded in memory (load and transform timed apart);
- xrft-dask: `xrft.fft(da.chunk({'lat': -1}), dim='lat', true_phase=False,
  true_amplitude=False, shift=False).to_zarr(...)` on dask threads;
- cubed: `from_zarr -> rechunk (lat whole) -> map_blocks(np.fft.fft) ->
  to_zarr` with the same allowed_mem.

Per arm: wall time (imports excluded), peak RSS of the process tree, and a
check of eight random lat lines against numpy.fft of the input. Appends a
section to bench/RESULTS.md unless --no-write.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from measure import arm_arguments, parse_mem, report, run_arms, run_child_arm

ROOT = Path(__file__).resolve().parent.parent
STORE = ROOT / "bench/data/fft_era5.zarr"
ARMS = ["zarrfusion", "zarrfusion-serial", "io-once", "scipy", "numpy", "xrft-dask", "cubed"]
CHUNKS = (8, 145, 1440)


def make_store(nt: int) -> None:
    """Writes the store slab by slab (a smooth field plus noise)."""
    import zarr

    if STORE.exists():
        a = zarr.open_array(STORE, path="t2m", mode="r")
        if a.shape[0] == nt:
            return
        shutil.rmtree(STORE)
    print(f"writing {STORE} ({nt} time steps)", flush=True)
    root = zarr.open_group(STORE, mode="w", zarr_format=3)
    lat = root.create_array("lat", shape=(721,), dtype="float64", dimension_names=["lat"])
    lat[:] = np.linspace(90.0, -90.0, 721)
    lon = root.create_array("lon", shape=(1440,), dtype="float64", dimension_names=["lon"])
    lon[:] = np.arange(1440) * 0.25
    time_ = root.create_array("time", shape=(nt,), dtype="int64", dimension_names=["time"],
                              attributes={"units": "hours since 2020-01-01", "calendar": "proleptic_gregorian"})
    time_[:] = np.arange(nt)
    t2m = root.create_array("t2m", shape=(nt, 721, 1440), chunks=CHUNKS, dtype="float32",
                            dimension_names=["time", "lat", "lon"], fill_value=np.nan)
    rng = np.random.default_rng(0)
    base = (280 + 25 * np.cos(np.deg2rad(np.linspace(90, -90, 721)))[:, None]
            + 3 * np.sin(np.deg2rad(np.arange(1440) * 0.25))[None, :]).astype("float32")
    for t0 in range(0, nt, CHUNKS[0]):
        t1 = min(nt, t0 + CHUNKS[0])
        noise = rng.standard_normal((t1 - t0, 721, 1440), dtype=np.float32)
        t2m[t0:t1] = base[None] + noise
    zarr.consolidate_metadata(STORE)


def child(arm: str, dst: str, mem: str, work: str, threads: int) -> dict:
    # Imports before the clock starts.
    import zarr

    if arm.startswith("zarrfusion"):
        import zarrfusion as zf
    elif arm == "scipy":
        import scipy.fft
    elif arm == "xrft-dask":
        import dask
        import xarray as xr
        import xrft
    elif arm == "cubed":
        import cubed
        from cubed.runtime.executors.local import ThreadsExecutor
    t0 = time.perf_counter()
    out: dict = {}
    if arm.startswith("zarrfusion"):
        serial = ["SET datafusion.execution.target_partitions = 1"] if arm == "zarrfusion-serial" else []
        out.update(zarrfusion_copy(zf, mem, work, dst, serial))
    elif arm == "io-once":
        src = zarr.open_array(STORE, path="t2m", mode="r")
        out_array = zarr.create_array(dst, shape=src.shape, chunks=(CHUNKS[0], 721, 1440), dtype="complex64")
        for s in range(0, src.shape[0], CHUNKS[0]):
            out_array[s:s + CHUNKS[0]] = src[s:s + CHUNKS[0]].astype(np.complex64)
    elif arm in ("scipy", "numpy"):
        a = zarr.open_array(STORE, path="t2m", mode="r")[:]
        loaded = time.perf_counter()
        if arm == "scipy":
            spectrum = scipy.fft.fft(a, axis=1, workers=threads)
        else:
            spectrum = np.fft.fft(a, axis=1)
        out["transform_seconds"] = time.perf_counter() - loaded
        out["load_seconds"] = loaded - t0
        out["note"] = f"load {out['load_seconds']:.1f} s + transform {out['transform_seconds']:.1f} s, {spectrum.dtype}"
        np.save(Path(dst).with_suffix(".lines.npy"), spectrum[:, :, :: 97][:8])
    elif arm == "xrft-dask":
        with dask.config.set(scheduler="threads", num_workers=threads):
            da = xr.open_zarr(STORE).t2m.chunk({"time": CHUNKS[0], "lat": -1, "lon": -1})
            spec = xrft.fft(da, dim="lat", true_phase=False, true_amplitude=False, shift=False)
            spec.to_dataset(name="t2m").to_zarr(dst)
    elif arm == "cubed":
        spec = cubed.Spec(work_dir=work, allowed_mem=mem)
        a = cubed.from_zarr(str(STORE), path="t2m", spec=spec)
        b = a.rechunk((CHUNKS[0], 721, 1440))
        c = cubed.map_blocks(lambda x: np.fft.fft(x, axis=1).astype(np.complex64), b, dtype=np.complex64)
        cubed.to_zarr(c, dst, executor=ThreadsExecutor(), max_workers=threads)
    else:
        raise SystemExit(f"unknown arm {arm}")
    out["seconds"] = time.perf_counter() - t0
    return out


def zarrfusion_copy(zf, mem: str, work: str, dst: str, settings: list[str]) -> dict:
    """The zarrfusion arms: `settings` (SET statements), then the FFT along
    lat copied to `dst` under EXPLAIN ANALYZE, which runs the COPY and gives
    the operator's `transform_time`."""
    ctx = zf.SessionContext(allowed_mem=mem, work_dir=work)
    for setting in settings:
        ctx.sql(setting).collect()
    ctx.register_zarr("era5", str(STORE))
    plan = ctx.sql(
        "EXPLAIN ANALYZE COPY (SELECT * FROM fft('era5', 't2m', dims => 'lat', true_phase => false, "
        f"true_amplitude => false, shift => false)) TO '{dst}' STORED AS ZARR"
    ).to_arrow_table()
    seconds = metric_seconds(" ".join(plan.column("plan").to_pylist()), "transform_time")
    return {"transform_seconds": seconds, "note": f"transform phase {seconds:.1f} s (transform_time)"}


def run_era5_arms(script: str, arms: list[str], child, describe) -> tuple:
    """A benchmark over this store: parses the options (``--nt`` and
    :func:`arm_arguments`'), runs ``child`` when in an arm's subprocess
    (then returns None), else writes the store when missing, prints
    ``describe(a, src)`` and runs every arm. Returns ``(a, src, results)``."""
    ap = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nt", type=int, default=1008)
    a = arm_arguments(ap, arms, "1GB")
    if run_child_arm(a, child):
        return None
    make_store(a.nt)
    import zarr

    src = zarr.open_array(STORE, path="t2m", mode="r")
    print(describe(a, src), flush=True)
    with tempfile.TemporaryDirectory(prefix=f"zf-{Path(script).stem}-", dir=ROOT / "bench/data") as tmp:
        results = run_arms(script, a, Path(tmp), check, lambda arm, dst: {"bytes_on_disk": du(dst)})
    return a, src, results


def metric_seconds(plan: str, name: str) -> float:
    """A time metric of an EXPLAIN ANALYZE plan (`name=1.5s`), in seconds."""
    import re

    match = re.search(rf"{name}=([0-9.]+)(ns|µs|ms|s)\b", plan)
    if not match:
        raise SystemExit(f"no {name} in the plan: {plan}")
    return float(match[1]) * {"ns": 1e-9, "µs": 1e-6, "ms": 1e-3, "s": 1.0}[match[2]]


def check(arm: str, dst: Path) -> str:
    """Eight lat lines of the output against numpy.fft of the input (for
    the in-memory arms, the lines they saved beside `dst`)."""
    import zarr

    src = zarr.open_array(STORE, path="t2m", mode="r")
    if dst.with_suffix(".lines.npy").exists():  # in-memory arms: [:8, :, ::97]
        lines = np.load(dst.with_suffix(".lines.npy"))
        want = np.fft.fft(src[:8, :, ::97].astype(np.float64), axis=1)
        got = lines
    elif arm == "io-once":
        return "-"
    else:
        try:
            out = zarr.open_group(str(dst), mode="r")["t2m"]
        except Exception:  # cubed writes a bare array
            out = zarr.open_array(str(dst), mode="r")
        rng = np.random.default_rng(1)
        ts, ls = rng.integers(src.shape[0], size=8), rng.integers(src.shape[2], size=8)
        want = np.stack([np.fft.fft(src[t, :, l].astype(np.float64)) for t, l in zip(ts, ls)])
        # Every output keeps (time, lat or freq_lat, lon), frequencies unshifted.
        got = np.stack([out[t, :, l] for t, l in zip(ts, ls)])
    error = float(np.abs(got - want).max() / np.abs(want).max())
    return f"ok ({error:.1e})" if error < 1e-5 else f"differs ({error:.1e})"


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def main() -> None:
    run = run_era5_arms(__file__, ARMS, child, lambda a, src: (
        f"{STORE.name} t2m {src.shape} {src.dtype} chunks {src.chunks}, {src.nbytes / 1e9:.2f} GB raw, "
        f"allowed_mem {a.allowed_mem}"))
    if run is None:
        return
    a, src, results = run
    raw = src.nbytes
    ok = {r["arm"]: r for r in results if "error" not in r}
    base = ok.get("zarrfusion")
    budget = parse_mem(a.allowed_mem)
    lines = [
        f"## FFT run {dt.datetime.now():%Y-%m-%d %H:%M} (issue 5: FFT along lat, benchmark 1)",
        "",
        f"- Command: `.venv/bin/python bench/bench_fft.py {' '.join(sys.argv[1:])}`".rstrip(),
        f"- Machine: {os.cpu_count()} cores; load average before the run {os.getloadavg()[0]:.1f}; no GPU",
        f"- Store: `{STORE.name}`, t2m {src.shape} {src.dtype}, chunks {src.chunks} (lat in "
        f"{-(-721 // src.chunks[1])} chunks), zstd; {raw / 1e9:.2f} GB raw; allowed_mem {a.allowed_mem}; "
        f"{a.threads} threads. Plain FFT along lat (complex64 out).",
        "",
        "| arm | seconds | vs zarrfusion | transform s | peak RSS MiB | RSS over allowed_mem MiB | output on disk GB | check | notes |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['arm']} | - | - | - | - | - | - | error | {r['error']} |")
            continue
        ratio = f"{r['seconds'] / base['seconds']:.2f}x" if base and r is not base else "-"
        transform = f"{r['transform_seconds']:.2f}" if "transform_seconds" in r else "-"
        lines.append(f"| {r['arm']} | {r['seconds']:.2f} | {ratio} | {transform} | {r['peak_rss'] / 2**20:.0f} | "
                     f"{max(0, r['peak_rss'] - budget) / 2**20:.0f} | {r.get('bytes_on_disk', 0) / 1e9:.2f} | "
                     f"{r['check']} | {r.get('note', '')} |")
    lines.append("")
    report(lines, ROOT / "bench/RESULTS.md", write=not a.no_write)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The four-step FFT of one line larger than memory (issue 5, benchmark 2).

    .venv/bin/python bench/bench_fft_four_step.py [--log2n 27] [--allowed-mem 256MB] [--arms ...]

The store (`bench/data/fft_long.zarr`, written here when missing): one
complex64 signal `s` of 2^log2n values along `t`, chunks of 2^20 (8 MiB),
uncompressed (random values do not compress); 2^27 is 1 GiB, four times
allowed_mem 256MB. Every arm computes the plain FFT of the whole line
(numpy's `fft`, complex64 out):

- zarrfusion: `COPY (SELECT * FROM fft('long', 's', dims => 't',
  true_phase => false, true_amplitude => false, shift => false)) TO ...`
  in `allowed_mem`; no line fits, so the planner takes the four-step path;
- io-once: the one-pass lower bound, zarr-python reading each chunk and
  writing it to a new store unchanged (no transform);
- scipy / numpy: `scipy.fft.fft(a, workers=2)` / `numpy.fft.fft` on the
  line loaded in memory (load and transform timed apart);
- dask: `da.fft.fft(x.rechunk(-1))` to Zarr (Dask's FFT wants the axis in
  one chunk: the whole line in memory);
- cubed: the same with `allowed_mem` (Cubed refuses a chunk larger than
  its budget).

Per arm: wall time (imports excluded), peak RSS of the process tree, bytes
read and written by the process (`rchar`/`wchar` of /proc/self/io, so the
page cache does not hide them) against the one-pass bound (input size read,
output size written), and a check of 2^16 output values spread over the
spectrum against numpy.fft of the input. Appends a section to
bench/RESULTS.md unless --no-write.
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
STORE = ROOT / "bench/data/fft_long.zarr"
ARMS = ["zarrfusion", "io-once", "scipy", "numpy", "dask", "cubed"]
CHUNK = 1 << 20


def make_store(n: int) -> None:
    """Writes the signal chunk by chunk (white noise)."""
    import zarr

    if STORE.exists():
        if zarr.open_array(STORE, path="s", mode="r").shape[0] == n:
            return
        shutil.rmtree(STORE)
    print(f"writing {STORE} ({n} values)", flush=True)
    root = zarr.open_group(STORE, mode="w", zarr_format=3)
    s = root.create_array("s", shape=(n,), chunks=(CHUNK,), dtype="complex64", compressors=None,
                          dimension_names=["t"], fill_value=0)
    rng = np.random.default_rng(0)
    for start in range(0, n, 16 * CHUNK):
        size = min(16 * CHUNK, n - start)
        s[start:start + size] = (rng.standard_normal(size, dtype=np.float32)
                                 + 1j * rng.standard_normal(size, dtype=np.float32)).astype(np.complex64)


def io_counters() -> tuple[int, int]:
    """Bytes this process read and wrote through system calls."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["rchar"]), int(fields["wchar"])


def child(arm: str, dst: str, mem: str, work: str, threads: int) -> dict:
    # Imports before the clock starts.
    import zarr

    if arm == "zarrfusion":
        import zarrfusion as zf
    elif arm == "scipy":
        import scipy.fft
    elif arm == "dask":
        import dask
        import dask.array as da
    elif arm == "cubed":
        import cubed
        import cubed.array_api as xp
        from cubed.runtime.executors.local import ThreadsExecutor
    read0, written0 = io_counters()
    t0 = time.perf_counter()
    out: dict = {}
    if arm == "zarrfusion":
        ctx = zf.SessionContext(allowed_mem=mem, work_dir=work)
        ctx.register_zarr("long", str(STORE))
        query = ("SELECT * FROM fft('long', 's', dims => 't', true_phase => false, "
                 "true_amplitude => false, shift => false)")
        plan = ctx.sql(f"EXPLAIN {query}").to_arrow_table().column("plan")[1].as_py()
        if "strategy=" not in plan:
            raise SystemExit(plan)
        out["strategy"] = plan[plan.index("strategy="):].split(", device=")[0]
        ctx.sql(f"COPY ({query}) TO '{dst}' STORED AS ZARR OPTIONS ('codec' 'none')").collect()
    elif arm == "io-once":
        src = zarr.open_array(STORE, path="s", mode="r")
        copy = zarr.create_array(dst, shape=src.shape, chunks=(CHUNK,), dtype="complex64", compressors=None)
        for s in range(0, src.shape[0], CHUNK):
            copy[s:s + CHUNK] = src[s:s + CHUNK]
    elif arm in ("scipy", "numpy"):
        a = zarr.open_array(STORE, path="s", mode="r")[:]
        loaded = time.perf_counter()
        spectrum = scipy.fft.fft(a, workers=threads) if arm == "scipy" else np.fft.fft(a)
        out["transform_seconds"] = time.perf_counter() - loaded
        out["load_seconds"] = loaded - t0
        out["note"] = f"load {out['load_seconds']:.1f} s + transform {out['transform_seconds']:.1f} s, {spectrum.dtype}"
        np.save(Path(dst).with_suffix(".sample.npy"), spectrum[:: max(1, spectrum.size >> 16)])
    elif arm == "dask":
        with dask.config.set(scheduler="threads", num_workers=threads):
            x = da.from_zarr(str(STORE), component="s")
            da.fft.fft(x.rechunk(-1)).astype(np.complex64).rechunk(CHUNK).to_zarr(dst)
    elif arm == "cubed":
        spec = cubed.Spec(work_dir=work, allowed_mem=mem)
        x = cubed.from_zarr(str(STORE), path="s", spec=spec)
        y = cubed.map_blocks(lambda b: np.fft.fft(b).astype(np.complex64), x.rechunk(x.shape), dtype=np.complex64)
        cubed.to_zarr(xp.asarray(y), dst, executor=ThreadsExecutor(), max_workers=threads)
    else:
        raise SystemExit(f"unknown arm {arm}")
    out["seconds"] = time.perf_counter() - t0
    read1, written1 = io_counters()
    out["read_bytes"], out["written_bytes"] = read1 - read0, written1 - written0
    return out


def check(arm: str, dst: Path) -> str:
    """2^16 spectrum values, evenly spread, against numpy.fft of the input."""
    import zarr

    if arm == "io-once":
        return "-"
    signal = zarr.open_array(STORE, path="s", mode="r")[:]
    want = np.fft.fft(signal)
    step = max(1, want.size >> 16)
    if arm in ("scipy", "numpy"):
        got = np.load(dst.with_suffix(".sample.npy"))
    else:
        try:
            out = zarr.open_group(str(dst), mode="r")["s"]
        except Exception:  # dask and cubed write a bare array
            out = zarr.open_array(str(dst), mode="r")
        got = out[:][::step]
    want = want[::step]
    error = float(np.abs(got - want).max() / np.abs(want).max())
    return f"ok ({error:.1e})" if error < 1e-5 else f"differs ({error:.1e})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--log2n", type=int, default=27)
    a = arm_arguments(ap, ARMS, "256MB")
    if run_child_arm(a, child):
        return
    n = 1 << a.log2n
    make_store(n)
    raw = n * 8
    budget = parse_mem(a.allowed_mem)
    load = os.getloadavg()[0]
    print(f"{STORE.name} s ({n},) complex64, {raw / 2**30:.2f} GiB = {raw / budget:.1f}x allowed_mem "
          f"{a.allowed_mem}", flush=True)
    with tempfile.TemporaryDirectory(prefix="zf-bench-fft4-", dir=ROOT / "bench/data") as tmp:
        results = run_arms(__file__, a, Path(tmp), check)
    ok = {r["arm"]: r for r in results if "error" not in r}
    base = ok.get("zarrfusion")
    lines = [
        f"## FFT run {dt.datetime.now():%Y-%m-%d %H:%M} (issue 5: four-step path, benchmark 2)",
        "",
        f"- Command: `.venv/bin/python bench/bench_fft_four_step.py {' '.join(sys.argv[1:])}`".rstrip(),
        f"- Machine: {os.cpu_count()} cores; load average before the run {load:.1f}; no GPU",
        f"- Store: `{STORE.name}`, s ({n},) complex64, chunks ({CHUNK},), uncompressed; "
        f"{raw / 2**30:.2f} GiB, {raw / budget:.1f}x allowed_mem {a.allowed_mem}; {a.threads} threads. "
        "Plain FFT of the whole line (complex64 out). One-pass bound: read "
        f"{raw / 2**30:.2f} GiB, write {raw / 2**30:.2f} GiB.",
    ]
    if base:
        lines.append(f"- zarrfusion's plan: `{base['strategy']}`")
    lines += [
        "",
        "| arm | seconds | vs zarrfusion | peak RSS MiB | RSS over allowed_mem MiB | read GiB (x one pass) "
        "| written GiB (x one pass) | check | notes |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['arm']} | - | - | - | - | - | - | error | {r['error']} |")
            continue
        ratio = f"{r['seconds'] / base['seconds']:.2f}x" if base and r is not base else "-"
        read, written = r["read_bytes"], r["written_bytes"]
        lines.append(f"| {r['arm']} | {r['seconds']:.2f} | {ratio} | {r['peak_rss'] / 2**20:.0f} | "
                     f"{max(0, r['peak_rss'] - budget) / 2**20:.0f} | {read / 2**30:.2f} ({read / raw:.1f}x) | "
                     f"{written / 2**30:.2f} ({written / raw:.1f}x) | {r['check']} | {r.get('note', '')} |")
    lines.append("")
    report(lines, ROOT / "bench/RESULTS.md", write=not a.no_write)


if __name__ == "__main__":
    main()

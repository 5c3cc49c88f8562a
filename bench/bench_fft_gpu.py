#!/usr/bin/env python3
"""FFT along lat on a GPU (issue 5, benchmark 3).

    python3 bench/bench_fft_gpu.py [--nt 1008] [--allowed-mem 1GB] [--arms ...]

The store and the transform are benchmark 1's (`bench_fft.py`: float32
t2m (nt, 721, 1440), lat in five chunks, plain FFT along lat, complex64
out). Arms:

- zarrfusion-cuda / zarrfusion-cpu: `SET zarrfusion.device = 'cuda'` (or
  `'cpu'`), then `EXPLAIN ANALYZE COPY (SELECT * FROM fft(...)) TO ...` in
  `allowed_mem`; the transform phase is the operator's `transform_time`
  (wall time with a block in the kernel: for cuFFT, the gathers, copies
  and transforms of the batches);
- cupy: the array loaded in host memory, copied to the device,
  `cupy.fft.fft(x, axis=1)`, copied back; the transform (CUDA events, on
  the second call: the first makes cuFFT's plan, timed apart) and
  the copies timed apart;
- jax: the same with `jax.device_put` and a jitted `jnp.fft.fft(x,
  axis=1)`; the transform timed on the second call (the first compiles).

End to end is each arm's wall time (imports excluded): for zarrfusion,
reading, transforming and writing the spectrum to Zarr; for CuPy and JAX,
loading, copying, transforming and copying back (no write). Arms that find
no usable GPU report the reason as their error. Appends a section to
bench/RESULTS.md unless --no-write.

On the GPU machine (no Rust, no network), build the wheel here and carry it
with zarr-python's wheels (see bench/README.md, "Benchmark 3"):

    MATURIN_PEP517_ARGS="--features gpu" pip wheel --no-deps -w .whl ./python
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from bench_fft import STORE, run_era5_arms, zarrfusion_copy
from measure import parse_mem, report

ROOT = Path(__file__).resolve().parent.parent
ARMS = ["zarrfusion-cuda", "zarrfusion-cpu", "cupy", "jax"]


def child(arm: str, dst: str, mem: str, work: str, threads: int) -> dict:
    # Imports before the clock starts.
    import zarr

    if arm.startswith("zarrfusion"):
        import zarrfusion as zf
    elif arm == "cupy":
        import cupy as cp
    elif arm == "jax":
        import jax
        import jax.numpy as jnp
    t0 = time.perf_counter()
    out: dict = {}
    if arm.startswith("zarrfusion"):
        out.update(zarrfusion_copy(zf, mem, work, dst, [f"SET zarrfusion.device = '{arm.split('-')[1]}'"]))
    elif arm in ("cupy", "jax"):
        a = zarr.open_array(STORE, path="t2m", mode="r")[:]
        loaded = time.perf_counter()
        if arm == "cupy":
            x = cp.asarray(a)
            cp.cuda.Device().synchronize()
            copied = time.perf_counter()
            start, end = cp.cuda.Event(), cp.cuda.Event()
            # The first call makes and caches cuFFT's plan (timed apart),
            # the second is the transform.
            for call in ("plan_seconds", "transform_seconds"):
                if call == "transform_seconds":
                    del y
                start.record()
                y = cp.fft.fft(x, axis=1)
                end.record()
                end.synchronize()
                out[call] = cp.cuda.get_elapsed_time(start, end) / 1e3
            back_started = time.perf_counter()
            spectrum = cp.asnumpy(y)
            copy_seconds = (copied - loaded) + (time.perf_counter() - back_started)
        else:
            fft = jax.jit(lambda v: jnp.fft.fft(v, axis=1))
            x = jax.device_put(a)
            x.block_until_ready()
            copied = time.perf_counter()
            fft(x).block_until_ready()  # compiles
            compiled = time.perf_counter()
            y = fft(x)
            y.block_until_ready()
            out["transform_seconds"] = time.perf_counter() - compiled
            back_started = time.perf_counter()
            spectrum = np.asarray(y)
            copy_seconds = (copied - loaded) + (time.perf_counter() - back_started)
            out["compile_seconds"] = compiled - copied - out["transform_seconds"]
        first = (f"first call {out['plan_seconds']:.2f} s + " if "plan_seconds" in out
                 else f"compile {out['compile_seconds']:.2f} s + ")
        out["note"] = (f"load {loaded - t0:.1f} s + copies {copy_seconds:.1f} s + {first}transform "
                       f"{out['transform_seconds']:.3f} s, {spectrum.dtype}")
        np.save(Path(dst).with_suffix(".lines.npy"), spectrum[:, :, ::97][:8])
    else:
        raise SystemExit(f"unknown arm {arm}")
    out["seconds"] = time.perf_counter() - t0
    return out


def gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip() or "no GPU"
    except (OSError, subprocess.SubprocessError):
        return "no GPU (no nvidia-smi)"


def main() -> None:
    run = run_era5_arms(__file__, ARMS, child, lambda a, src: (
        f"{STORE.name} t2m {src.shape} {src.dtype}, {src.nbytes / 1e9:.2f} GB raw; GPU: {gpu_name()}"))
    if run is None:
        return
    a, src, results = run
    raw = src.nbytes
    ok = {r["arm"]: r for r in results if "error" not in r}
    base = ok.get("zarrfusion-cuda")
    budget = parse_mem(a.allowed_mem)
    lines = [
        f"## FFT run {dt.datetime.now():%Y-%m-%d %H:%M} (issue 5: FFT along lat on a GPU, benchmark 3)",
        "",
        f"- Command: `python3 bench/bench_fft_gpu.py {' '.join(sys.argv[1:])}`".rstrip(),
        f"- Machine: {os.cpu_count()} cores; GPU: {gpu_name()}",
        f"- Store: `{STORE.name}`, t2m {src.shape} {src.dtype}, chunks {src.chunks}, zstd; {raw / 1e9:.2f} GB "
        f"raw; allowed_mem {a.allowed_mem}; {a.threads} threads. Plain FFT along lat (complex64 out).",
        "",
        "| arm | end to end s | vs zarrfusion-cuda | transform s | transform vs cupy | peak RSS MiB | "
        "RSS over allowed_mem MiB | check | notes |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    cupy = ok.get("cupy")
    for r in results:
        if "error" in r:
            lines.append(f"| {r['arm']} | - | - | - | - | - | - | error | {r['error']} |")
            continue
        ratio = f"{r['seconds'] / base['seconds']:.2f}x" if base and r is not base else "-"
        vs_cupy = (f"{r['transform_seconds'] / cupy['transform_seconds']:.2f}x"
                   if cupy and r is not cupy else "-")
        lines.append(f"| {r['arm']} | {r['seconds']:.2f} | {ratio} | {r['transform_seconds']:.2f} | {vs_cupy} | "
                     f"{r['peak_rss'] / 2**20:.0f} | {max(0, r['peak_rss'] - budget) / 2**20:.0f} | "
                     f"{r['check']} | {r.get('note', '')} |")
    lines.append("")
    report(lines, ROOT / "bench/RESULTS.md", write=not a.no_write)


if __name__ == "__main__":
    main()

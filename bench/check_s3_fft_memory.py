"""Memory check (issue 23): the four-step FFT of a complex64 line larger than
``allowed_mem``, from local files and from the local S3 server (moto behind the tests'
proxy, no latency), copied to a local Zarr store; each run a fresh process of the test
venv's build of the Python package. Reports, over the process's anonymous memory after
opening (``RssAnon``, sampled every 2 ms), the peak during the FFT and what is left at its
end: the engine's buffers plus the pages the allocator (mimalloc) keeps after they are
freed. Each case can set environment variables (``MIMALLOC_PURGE_DELAY=0`` returns freed
pages at once).

    .venv/bin/python bench/check_s3_fft_memory.py [--log2n 22] [--log2chunk 15] \\
        local:0:32MB s3:0:32MB s3:16:32MB s3:16:32MB:MIMALLOC_PURGE_DELAY=0

A case is ``where:io_concurrency:allowed_mem[:VAR=value...]``; two runs each.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "s3"))

import s3_server  # noqa: E402

CHILD = r"""
import json, sys, time, threading
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
import zarrfusion as zf
a = json.loads(sys.argv[1])
ctx = zf.SessionContext(allowed_mem=a["mem"], io_concurrency=a["io"], work_dir=a["work"])
ctx.register_zarr("t", a["loc"], **a["options"])
peak = [0]
def sample():
    while True:
        peak[0] = max(peak[0], anon())
        time.sleep(0.002)
base = anon()
threading.Thread(target=sample, daemon=True).start()
t0 = time.perf_counter()
ctx.table("t").fft("s", dims="t", true_phase=False, true_amplitude=False, shift=False).to_zarr(a["out"])
seconds = time.perf_counter() - t0
time.sleep(0.01)
print(json.dumps({"s": seconds, "base": base, "peak": max(peak[0], anon()), "end": anon()}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--log2n", type=int, default=22)
    ap.add_argument("--log2chunk", type=int, default=15)
    ap.add_argument("--zf-python", default=str(pathlib.Path.home() / ".cache/zarrfusion-venv/bin/python"))
    args = ap.parse_args()
    import zarr

    n, chunk = 1 << args.log2n, 1 << args.log2chunk
    tmp = pathlib.Path(tempfile.mkdtemp())
    rng = np.random.default_rng(1)
    values = (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(np.complex64)
    signal = zarr.create_array(
        tmp / "signal.zarr", name="s", shape=(n,), chunks=(chunk,), dtype="complex64",
        dimension_names=["t"], fill_value=0,
    )
    signal[:] = values
    server = s3_server.start({"signal.zarr": tmp / "signal.zarr"}, bucket="fftmem")
    print(f"line 2^{args.log2n} complex64 ({n * 8 / 2**20:.0f} MiB), chunks 2^{args.log2chunk}")
    print("| case | s | RssAnon after opening MiB | peak over it MiB | left at the end MiB |")
    print("|---|---:|---:|---:|---:|")
    try:
        for case in args.cases:
            where, io, mem, *envs = case.split(":")
            env = dict(os.environ)
            env.update(e.split("=", 1) for e in envs)
            local = where == "local"
            for run in range(2):
                out = tmp / f"out-{run}-{abs(hash(case))}.zarr"
                a = dict(
                    mem=mem, io=int(io), work=str(tmp / "work"), out=str(out),
                    loc=str(tmp / "signal.zarr") if local else "s3://fftmem/signal.zarr",
                    options={} if local else server.options(),
                )
                done = subprocess.run([args.zf_python, "-c", CHILD, json.dumps(a)], capture_output=True, text=True, env=env)
                if done.returncode:
                    sys.exit(done.stderr[-3000:])
                r = json.loads(done.stdout.splitlines()[-1])
                mib = 2**20
                print(f"| {case} | {r['s']:.2f} | {r['base'] / mib:.1f} | {(r['peak'] - r['base']) / mib:.1f} | {(r['end'] - r['base']) / mib:.1f} |", flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()

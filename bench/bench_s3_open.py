"""Object-store benchmark, opening (issue 23): how long the shell takes to register a Zarr
group without consolidated metadata from the local S3 server (moto, behind the latency
proxy of tests/s3/s3_server.py) and count its rows, for two zarrfusion binaries (e.g. before
and after a change), at 0 and 100 ms added to every request.

    .venv/bin/python bench/bench_s3_open.py --binary before=/tmp/zf-old --binary after=~/.cache/zarrfusion-target/debug/zarrfusion

Peer: xarray + zarr-python over obstore (``xr.open_zarr(..., consolidated=False)`` on
``zarr.storage.ObjectStore``, then the number of cells of a variable, from the metadata and
the coordinates as zarrfusion's count), in a fresh process whose imports are excluded
(zarrfusion's time is its whole process).

The group: 12 float32 variables (time 8, lat 48, lon 64) and their 3 coordinates, written by
xarray with ``consolidated=False`` as Zarr v2 and v3. Each cell of the table is the best of
3 fresh processes (the whole process: start, registration, the count); GETs, LISTs and the
most GETs in flight come from the proxy. Prints a Markdown table (for bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "s3"))

import s3_server  # noqa: E402


PEER = """
import json, sys, time
import xarray as xr, zarr
from obstore.store import S3Store
conn = json.loads(sys.argv[1])
t0 = time.perf_counter()
s3 = S3Store("bench", prefix=conn["prefix"], endpoint=conn["endpoint"], access_key_id=conn["key"],
             secret_access_key=conn["secret"], region=conn["region"], client_options={"allow_http": True})
ds = xr.open_zarr(zarr.storage.ObjectStore(s3, read_only=True), consolidated=False)
cells = int(ds["v00"].size)
print(json.dumps({"seconds": time.perf_counter() - t0, "cells": cells}))
"""


def run_peer(conn: dict) -> float:
    """xarray + zarr-python (obstore) opening the group in a fresh process: seconds, imports excluded."""
    import json

    done = subprocess.run([sys.executable, "-c", PEER, json.dumps(conn)], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-400:])
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    if answer["cells"] != 8 * 48 * 64:
        raise RuntimeError(f"xarray counted {answer['cells']} cells")
    return answer["seconds"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", action="append", required=True, metavar="NAME=PATH",
                    help="a zarrfusion shell binary to measure, with its name in the table")
    ap.add_argument("--latencies", default="0,100", help="added latency per request, ms (default 0,100)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per cell, the best shown (default 3)")
    a = ap.parse_args()
    import numpy as np
    import xarray as xr

    binaries = [(b.split("=", 1)[0], os.path.expanduser(b.split("=", 1)[1])) for b in a.binary]
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="zf_bench_open_"))
    rng = np.random.default_rng(0)
    base = xr.DataArray(rng.normal(size=(8, 48, 64)).astype("float32"), dims=("time", "lat", "lon"))
    ds = xr.Dataset({f"v{i:02d}": base * (i + 1) for i in range(12)},
                    coords={"time": np.arange(8), "lat": np.linspace(60, -60, 48), "lon": np.arange(64.0)})
    for fmt in (2, 3):
        ds.to_zarr(tmp / f"wide_v{fmt}.zarr", consolidated=False, zarr_format=fmt)
    server = s3_server.start({f"wide_v{f}.zarr": tmp / f"wide_v{f}.zarr" for f in (2, 3)}, bucket="bench")
    options = ", ".join(f"'{k}' '{v}'" for k, v in server.options().items())
    print("| latency ms | store (12 variables + 3 coordinates, not consolidated) | binary | s (best) | GET | LIST "
          "| most GETs in flight |")
    print("|---:|---|---|---:|---:|---:|---:|")
    try:
        for latency in (float(x) for x in a.latencies.split(",")):
            server.proxy.configure(latency_ms=latency)
            for fmt in (2, 3):
                conn = {"prefix": f"wide_v{fmt}.zarr", "endpoint": server.proxy_endpoint, "key": s3_server.ACCESS_KEY,
                        "secret": s3_server.SECRET_KEY, "region": s3_server.REGION}
                for name, binary in binaries + [("xarray + zarr-python (obstore)", None)]:
                    best = None
                    for _ in range(a.repeat):
                        server.proxy.reset()
                        if binary is None:
                            seconds = run_peer(conn)
                            if best is None or seconds < best[0]:
                                best = (seconds, server.proxy.stats())
                            continue
                        t0 = time.perf_counter()
                        done = subprocess.run(
                            [binary, "-q", "--format", "csv", "-c",
                             f"CREATE EXTERNAL TABLE w STORED AS ZARR LOCATION 's3://bench/wide_v{fmt}.zarr' "
                             f"OPTIONS ({options})", "-c", "SELECT count(*) FROM w"],
                            capture_output=True, text=True, timeout=300,
                            # Cold every time: an empty opening cache (bench_s3_reopen.py
                            # measures openings with the cache).
                            env=dict(os.environ, ZARRFUSION_CACHE_DIR=tempfile.mkdtemp(prefix="zf_open_")))
                        seconds = time.perf_counter() - t0
                        if done.returncode != 0 or str(8 * 48 * 64) not in done.stdout:
                            print(f"{name} failed: {done.stderr[-400:]}", file=sys.stderr)
                            return 1
                        if best is None or seconds < best[0]:
                            best = (seconds, server.proxy.stats())
                    seconds, stats = best
                    print(f"| {latency:g} | v{fmt} | {name} | {seconds:.3f} | {stats['methods'].get('GET', 0)} | "
                          f"{stats['lists']} | {stats['max_in_flight_by_method'].get('GET', 0)} |", flush=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Probe (issue 24): what the forecast loader's first batch waits for when it reads the
forecast stores (``bench_forecast.py --make``) from the local S3 server through a slow link.

Serves the stores with moto behind the tests' proxy (``tests/s3/s3_server.py``) with a link
of ``--bandwidth`` MB/s shared by the answers in flight, opens them as ``bench_forecast.py``
does, and takes the first batch: block shuffle, batch 32 of 64x64 windows, history 2, targets
+6h; with ``--rules``, rank 1 of 4 with ``drop_last`` and the validity rules (the window
index must count the other ranks' windows first). It prints the time to the first batch, the
bytes the proxy sent before it, the loader's request counters and the index's progress. With
``--trace`` it also runs the same loader reading on demand only (``io_concurrency=0``) to
learn the chunk requests the first batch needs, and reports when the last of them was
answered in the run with read-ahead (every answer's path and time is taken at the proxy).

    python bench/probe_first_batch.py --bandwidth 40
    python bench/probe_first_batch.py --bandwidth 40 --rules
    python bench/probe_first_batch.py --bandwidth 40 --trace
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
DATA = HERE / "data" / "forecast"


def first_batch(server, io_concurrency: int, rules: bool, log: list) -> dict:
    import zarrfusion as zf

    ctx = zf.SessionContext(io_concurrency=io_concurrency)
    stores = {k: f"s3://bench/{k}.zarr" for k in ("era5", "imerg")}
    src = ctx.open_zarr(stores, variables={"era5": ["t2m", "u10", "v10", "z"], "imerg": ["precip"]},
                        **server.options())
    valid = {"inputs": 0.9, "targets": "all"} if rules else "any"
    w = src.windows({"lat": 64, "lon": 64}, {"lat": 32, "lon": 32}, history={"time": 2},
                    targets={"t2m": "+6h", "precip": "+6h"}, valid=valid, cache=False)
    shard = (1, 4) if rules else None
    loader = w.loader(batch_size=32, shuffle="block", seed=0, stack="channels", shard=shard,
                      drop_last=shard is not None)
    server.proxy.reset()
    log.clear()
    started = time.perf_counter()
    batches = iter(loader)
    next(batches)
    elapsed = time.perf_counter() - started
    stats = loader.stats()
    answered = [(a - started, b - started, path) for a, b, path in log if b - started <= elapsed]
    return {"first_s": elapsed, "mb_sent": server.proxy.stats()["bytes"] / 1e6, "stats": stats,
            "index": w.index_progress, "answered": answered}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bandwidth", type=float, default=40, help="the link's MB/s (0: unlimited)")
    ap.add_argument("--latency", type=float, default=0, help="ms added to each request")
    ap.add_argument("--io-concurrency", type=int, default=64)
    ap.add_argument("--rules", action="store_true", help="rank 1/4, drop_last, validity rules")
    ap.add_argument("--trace", action="store_true", help="also find the requests the batch needs")
    a = ap.parse_args()
    if not (DATA / "era5.zarr").exists():
        print(f"no stores in {DATA}: run python bench/bench_forecast.py --make", file=sys.stderr)
        return 1
    sys.path.insert(0, str(HERE.parent / "tests" / "s3"))
    import s3_server

    server = s3_server.start({"era5.zarr": DATA / "era5.zarr", "imerg.zarr": DATA / "imerg.zarr"}, bucket="bench")
    log: list = []
    forward = server.proxy._forward

    def traced(request, body, truncate, answered):
        sent = time.perf_counter()
        forward(request, body, truncate, answered)
        log.append((sent, time.perf_counter(), request.path))

    server.proxy._forward = traced
    try:
        server.proxy.configure(latency_ms=a.latency, bandwidth_mb_s=a.bandwidth)
        needed = None
        if a.trace:
            r = first_batch(server, 0, a.rules, log)
            needed = {path for _, _, path in r["answered"]}
            print(f"on demand: first batch {r['first_s']:.2f} s, {r['mb_sent']:.1f} MB, "
                  f"{len(needed)} requests", flush=True)
        r = first_batch(server, a.io_concurrency, a.rules, log)
        s = r["stats"]
        print(f"io_concurrency={a.io_concurrency}: first batch {r['first_s']:.2f} s, {r['mb_sent']:.1f} MB sent, "
              f"{s['requests']} requests, {s['read_ahead_hits']} read-ahead hits, "
              f"{s['read_ahead_misses']} misses, {s['blocks_read']} blocks read, index {r['index']}", flush=True)
        if needed is not None:
            times = [end for _, end, path in r["answered"] if path in needed]
            print(f"  {len(times)} of the {len(needed)} requests the batch needs answered before it, "
                  f"the last at {max(times, default=0):.2f} s; {len(r['answered'])} answered in all")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

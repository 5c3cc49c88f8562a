"""Probe (issue 24): an epoch of the window loader's full shuffle from the local S3 server,
against the same epoch reading on demand (``io_concurrency=0``: every window's chunks fetched
when a thread decodes it, as the full shuffle did before it read ahead) and against the block
shuffle, which reads each chunk once.

Writes with xarray a store of ``--steps`` time steps of t and u over 64 x 64 cells, one chunk
per step and 32 x 32 cells (``--chunk``), serves it with moto behind the tests' proxy
(``tests/s3/s3_server.py``) at ``--latency`` ms a request, and takes one epoch of batches of
16 windows of 3 steps (history) of 16 x 16 cells, overlapping by half, with each loader. It
prints per arm: seconds for the epoch, windows, the GETs and MB the proxy served, the most
requests it had in flight, and the loader's read-ahead hits and misses.

    python bench/probe_full_shuffle.py                  # 10 ms a request
    python bench/probe_full_shuffle.py --latency 100
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "s3"))

ARMS = {
    "full, read ahead": ("full", 64),
    "full, on demand": ("full", 0),
    "block, read ahead": ("block", 64),
}


def write_store(path: pathlib.Path, steps: int, chunk: int) -> None:
    import numpy as np
    import xarray as xr

    rng = np.random.default_rng(0)
    shape = (steps, 64, 64)
    ds = xr.Dataset(
        {v: (("time", "lat", "lon"), rng.normal(size=shape).astype("float32")) for v in ("t", "u")},
        coords={"time": np.arange(steps), "lat": np.arange(64.0), "lon": np.arange(64.0)},
    )
    ds.to_zarr(path, encoding={v: {"chunks": (1, chunk, chunk)} for v in ("t", "u")}, zarr_format=3)


def epoch(server, shuffle: str, io_concurrency: int) -> dict:
    import zarrfusion as zf

    ctx = zf.SessionContext(io_concurrency=io_concurrency)
    ds = ctx.open_zarr("s3://bench/probe.zarr", **server.options())
    windows = ds.windows({"lat": 16, "lon": 16}, {"lat": 8, "lon": 8}, history={"time": 3}, cache=False)
    total = len(windows)  # the index first: the epoch's reads alone are counted
    loader = windows.loader(batch_size=16, shuffle=shuffle, seed=0, threads=2)
    server.proxy.reset()
    before = loader.stats()
    started = time.perf_counter()
    n = sum(len(b["index"]["time"]) for b in loader)
    seconds = time.perf_counter() - started
    after = loader.stats()
    proxy = server.proxy.stats()
    assert n == total, (n, total)
    return {
        "seconds": seconds,
        "windows": n,
        "GETs": sum(proxy["methods"].values()),
        "MB": proxy["bytes"] / 1e6,
        "in flight": proxy["max_in_flight"],
        "hits": after["read_ahead_hits"] - before["read_ahead_hits"],
        "misses": after["read_ahead_misses"] - before["read_ahead_misses"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--latency", type=float, default=10, help="ms added to every request (default 10)")
    ap.add_argument("--steps", type=int, default=16, help="time steps (default 16)")
    ap.add_argument("--chunk", type=int, default=32, help="chunk cells along lat and lon (default 32)")
    args = ap.parse_args()

    import s3_server

    with tempfile.TemporaryDirectory() as tmp:
        store = pathlib.Path(tmp) / "probe.zarr"
        write_store(store, args.steps, args.chunk)
        server = s3_server.start({"probe.zarr": store}, bucket="bench")
        try:
            server.proxy.configure(latency_ms=args.latency)
            print(f"{args.steps} steps of 64x64, chunks (1, {args.chunk}, {args.chunk}), "
                  f"{args.latency:g} ms a request")
            for name, (shuffle, concurrency) in ARMS.items():
                r = epoch(server, shuffle, concurrency)
                print(f"{name:18} {r['seconds']:7.2f} s  {r['windows']} windows  {r['GETs']} GETs  "
                      f"{r['MB']:.1f} MB  {r['in flight']} in flight  "
                      f"read-ahead hits {r['hits']}, misses {r['misses']}")
        finally:
            server.stop()


if __name__ == "__main__":
    main()

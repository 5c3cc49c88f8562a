"""Latency check (issue 23): zarrfusion reading a store from an S3 server
on this machine with 0, 20 and 100 ms added to every request, reading on
demand (`--io-concurrency 0`) and reading ahead (`--io-concurrency 64`).

Not the issue's benchmark (no peers, a small store): a check that reading
ahead hides latency. The store is written by xarray (float32, zstd, 288
chunks of (8, 30, 60)); the server is the tests' moto server behind their
fault proxy (`tests/s3/s3_server.py`), which adds the latency and counts
requests and the most in flight at once.

    ~/.cache/zarrfusion-venv/bin/python bench/check_s3_latency.py [--repeat 3]

Prints a Markdown table (best of the repeats, seconds, with the proxy's
counts of the last repeat).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "s3"))
import s3_server  # noqa: E402

BIN = os.environ.get("ZARRFUSION_BIN", str(pathlib.Path.home() / ".cache/zarrfusion-target/debug/zarrfusion"))
QUERIES = {
    "zonal mean": "SELECT lat, avg(t2m) AS t FROM t GROUP BY lat ORDER BY lat",
    "box + time filter": "SELECT count(*), sum(t2m) FROM t WHERE lat > 0 AND lon < 180 AND time < 20",
}


def make_store(path: pathlib.Path) -> None:
    import xarray as xr

    rng = np.random.default_rng(0)
    ds = xr.Dataset(
        {"t2m": (("time", "lat", "lon"), (280 + rng.normal(size=(64, 180, 360))).astype("float32"))},
        coords={"time": np.arange(64), "lat": np.linspace(89.5, -89.5, 180), "lon": np.arange(360) * 1.0},
    )
    ds.to_zarr(path, encoding={"t2m": {"chunks": (8, 30, 60)}}, consolidated=True, zarr_format=2)


def run(server, concurrency: int, sql: str) -> tuple[float, str]:
    options = ", ".join(f"'{k}' '{v}'" for k, v in server.options().items())
    create = f"CREATE EXTERNAL TABLE t STORED AS ZARR LOCATION 's3://bench/era5.zarr' OPTIONS ({options})"
    start = time.monotonic()
    out = subprocess.run(
        [BIN, "-q", "--format", "csv", "--io-concurrency", str(concurrency), "-c", create, "-c", sql],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return time.monotonic() - start, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = pathlib.Path(tmp) / "era5.zarr"
        make_store(store)
        server = s3_server.start({"era5.zarr": store}, bucket="bench")
        try:
            print("| query | latency | io_concurrency | best of %d (s) | GETs | most in flight |" % args.repeat)
            print("|---|---|---|---|---|---|")
            for name, sql in QUERIES.items():
                answers = set()
                for latency in (0, 20, 100):
                    for concurrency in (0, 64):
                        times = []
                        for _ in range(args.repeat):
                            server.proxy.configure(latency_ms=latency)
                            server.proxy.reset()
                            seconds, out = run(server, concurrency, sql)
                            times.append(seconds)
                            answers.add(out)
                        stats = server.proxy.stats()
                        print(
                            f"| {name} | {latency} ms | {concurrency} | {min(times):.2f} | "
                            f"{stats['methods'].get('GET', 0)} | {stats['max_in_flight']} |"
                        )
                assert len(answers) == 1, f"{name}: answers differ"
        finally:
            server.stop()


if __name__ == "__main__":
    main()

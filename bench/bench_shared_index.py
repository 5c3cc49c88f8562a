"""Ranks on several machines building one window index from a bucket (issue 24).

The forecast stores of ``bench_forecast.py`` (two sources, 2.24 GB) in the
local S3 server behind the test proxy, whose link is shared by every answer
(``--bandwidth`` MB/s, the case of a network that bounds the job). ``--ranks``
processes start at once and each builds the index of the forecast windows
with validity rules (``len(windows)``, what ``drop_last`` and ``len(loader)``
need), in two modes:

- ``own cache each``: each process with a cache directory of its own, as
  ranks on separate machines had before a cache could be in a bucket: each
  reads every block;
- ``one cache in the bucket``: every process with ``cache="s3://bench/..."``:
  the ranks share the index's blocks there (each block read by one of them).

Reported per mode: the time until every rank has the whole index, the bytes
the link carried, blocks read and peak RSS per rank, and that every rank
counted the same windows. The physical limit is one read of the data through the link.

    python bench/bench_shared_index.py                  # 2 ranks, 40 MB/s
    python bench/bench_shared_index.py --ranks 3 --bandwidth 80
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import report  # noqa: E402

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "forecast"

CHILD = """
import json, sys, time
import zarrfusion as zf
conn, cache = json.loads(sys.argv[1]), sys.argv[2]
stores = {k: f"s3://{conn['bucket']}/{k}.zarr" for k in ("era5", "imerg")}
started = time.perf_counter()
src = zf.SessionContext().open_zarr(stores, variables={"era5": ["t2m", "u10", "v10", "z"], "imerg": ["precip"]},
                                    **conn["options"])
w = src.windows({"lat": 64, "lon": 64}, {"lat": 32, "lon": 32}, history={"time": 2},
                targets={"t2m": "+6h", "precip": "+6h"}, valid={"inputs": 0.9, "targets": "all"}, cache=cache)
n = len(w)
# VmHWM: ru_maxrss would start at the parent's RSS at fork (moto's stores).
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
peak = int(status["VmHWM"].split()[0]) * 1024
print(json.dumps({"len": n, "seconds": time.perf_counter() - started, "peak_rss": peak, **w.index_counts}))
"""


def run_mode(conn: dict, caches: list[str], server) -> dict:
    """Starts one process per cache at once; their results and the link's bytes."""
    server.proxy.reset()
    started = time.perf_counter()
    children = [subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(conn), c], stdout=subprocess.PIPE, text=True)
                for c in caches]
    try:
        results = [json.loads(c.communicate(timeout=3600)[0].strip().splitlines()[-1]) for c in children]
    finally:
        for c in children:
            c.kill()
    return {"wall": time.perf_counter() - started, "ranks": results, "bytes": server.proxy.stats()["bytes"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="processes building the index at once")
    ap.add_argument("--bandwidth", type=float, default=40, help="the link's MB/s (shared by every answer)")
    ap.add_argument("--latency", type=float, default=0, help="ms added to every request")
    a = ap.parse_args()
    sys.path.insert(0, str(HERE.parent / "tests" / "s3"))
    import s3_server

    files = [f for f in DATA.rglob("*") if f.is_file()]
    if not files:
        print(f"no stores in {DATA}: run bench/bench_forecast.py --make first", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in files)
    server = s3_server.start({"era5.zarr": DATA / "era5.zarr", "imerg.zarr": DATA / "imerg.zarr"}, bucket="bench")
    rows = {}
    try:
        server.proxy.configure(latency_ms=a.latency, bandwidth_mb_s=a.bandwidth)
        conn = {"bucket": "bench", "options": server.options()}
        with tempfile.TemporaryDirectory(prefix="zf-shared-index-") as tmp:
            modes = {
                "own cache each": [os.path.join(tmp, f"rank{r}") for r in range(a.ranks)],
                "one cache in the bucket": [f"s3://bench/index-cache-{uuid.uuid4().hex}"] * a.ranks,
            }
            for mode, caches in modes.items():
                rows[mode] = run_mode(conn, caches, server)
                print(mode, rows[mode], flush=True)
    finally:
        server.stop()
    limit = size / (a.bandwidth * 1e6)
    lines = [
        f"## Shared window index from a bucket, {time.strftime('%Y-%m-%d %H:%M')} (issue 24: ranks on several machines)",
        "",
        f"- Command: `python bench/bench_shared_index.py {shlex.join(sys.argv[1:])}`".replace(" `", "`"),
        f"- Machine: {os.cpu_count()} cores; stores `{DATA.relative_to(HERE.parent)}/` {size / 1e9:.2f} GB in moto's "
        f"S3 server behind the test proxy: one link of {a.bandwidth:g} MB/s shared by every answer, "
        f"{a.latency:g} ms a request. {a.ranks} processes start at once, each building the index of the forecast "
        "windows with validity rules (`len(windows)`).",
        f"- Physical limit: one read of the stores through the link, {limit:.1f} s.",
        "",
        "| mode | every rank's index s | MB through the link | blocks read per rank | peak RSS per rank MB "
        "| windows (every rank) |",
        "|---|---:|---:|---|---|---|",
    ]
    for mode, r in rows.items():
        lens = {x["len"] for x in r["ranks"]}
        lines.append(f"| {mode} | {r['wall']:.1f} | {r['bytes'] / 1e6:.0f} | "
                     f"{', '.join(str(x['read']) for x in r['ranks'])} of {r['ranks'][0]['blocks']} | "
                     f"{', '.join(str(round(x['peak_rss'] / 2**20)) for x in r['ranks'])} | "
                     f"{'same: ' + str(lens.pop()) if len(lens) == 1 else 'DIFFER: ' + str(sorted(lens))} |")
    report(lines, HERE / "RESULTS.md", write=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

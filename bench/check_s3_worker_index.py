"""Check (issue 24): the first batch of DataLoader workers building a cold window index from a bucket.

Two processes stand for the two DataLoader workers of rank 1 of 4 (``drop_last``, validity rules,
the forecast windows of ``bench_forecast.py``, one loader thread and no background index threads
each, as ``DataLoader(num_workers=2)`` gives on 2 cores; a fresh cache directory they share). The
stores are served by the tests' S3 server (``moto``, or ``s3s`` for the s3s-fs binary named by
``ZARRFUSION_S3S_FS``) behind the latency proxy. Each process prints its opening time, its first
batch (from the windows made), where its index's blocks came from and what its stores fetched by
then, and the time of the 20 batches after it; then the proxy's totals. Without torch and
spawning, so only the loader's own time shows (each process iterates on its own: the 20 batches
after the first are not taken in turn as a DataLoader takes them). Run:

    ZARRFUSION_S3S_FS=~/.cache/s3s/bin/s3s-fs python bench/check_s3_worker_index.py s3s 100 [workers]

Nothing is written to bench/RESULTS.md (copy the lines there).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "forecast"


def worker(worker_id: int, workers: int, conn: str, cache: str) -> None:
    import zarrfusion as zf
    from zarrfusion.loader import WindowLoader, _raw_loader

    c = json.loads(conn)
    started = time.perf_counter()
    src = zf.SessionContext().open_zarr(
        {k: f"s3://{c['bucket']}/{k}.zarr" for k in ("era5", "imerg")},
        variables={"era5": ["t2m", "u10", "v10", "z"], "imerg": ["precip"]},
        **c["options"],
    )
    w = src.windows({"lat": 64, "lon": 64}, {"lat": 32, "lon": 32}, history={"time": 2},
                    targets={"t2m": "+6h", "precip": "+6h"}, valid={"inputs": 0.9, "targets": "all"},
                    cache=cache, threads=0)
    opened = time.perf_counter()
    loader = w.loader(batch_size=32, shuffle="block", seed=0, stack="channels", shard=(1, 4), drop_last=True)
    raw = _raw_loader(w._raw, {**loader._description["loader"], "threads": 1}, (worker_id, workers))
    mine = WindowLoader(raw, loader._description, (worker_id, workers))
    batches = iter(mine)
    next(batches)
    first = time.perf_counter()
    stats = mine.stats()
    print(json.dumps({"worker": worker_id, "open_s": round(opened - started, 3),
                      "first_batch_s": round(first - opened, 3), "index": w.index_counts,
                      "requests": stats["requests"], "mb_fetched": round(stats["bytes_fetched"] / 1e6, 1)}),
          flush=True)
    for _ in range(20):
        next(batches)
    print(json.dumps({"worker": worker_id, "next_20_s": round(time.perf_counter() - first, 3)}), flush=True)


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
        return 0
    backend, latency = sys.argv[1], float(sys.argv[2])
    workers = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    if not DATA.exists():
        print("make the stores first: python bench/bench_forecast.py --make", file=sys.stderr)
        return 1
    sys.path.insert(0, str(HERE.parent / "tests" / "s3"))
    import s3_server

    server = s3_server.start({"era5.zarr": DATA / "era5.zarr", "imerg.zarr": DATA / "imerg.zarr"},
                             bucket="bench", backend=backend)
    cache = tempfile.mkdtemp(prefix="zf-s3-worker-index-")
    try:
        server.proxy.configure(latency_ms=latency)
        server.proxy.reset()
        conn = json.dumps({"bucket": "bench", "options": server.options()})
        children = [subprocess.Popen([sys.executable, __file__, "--worker", str(k), str(workers), conn, cache])
                    for k in range(workers)]
        for child in children:
            child.wait()
        stats = server.proxy.stats()
        print(json.dumps({"proxy_requests": stats["requests"], "proxy_mb": round(stats["bytes"] / 1e6, 1)}))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Check (issue 24): how many background index threads a DataLoader worker should run.

Two processes stand for two DataLoader workers of rank 1 of 4 (``drop_last``, validity rules,
the forecast windows of ``bench_forecast.py``, a cold index in one fresh cache directory they
share). Each opens the stores and windows with ``threads`` background index threads, takes its
worker's loader (one loader thread, as ``DataLoader(num_workers=2)`` gives on 2 cores) and
times the first batch and the 20 after it. Without spawning or torch, so only the loader's own
time shows. Run for each value given (default ``none 2 1 0``; ``none``: the windows' default,
one per core):

    python bench/check_worker_index_threads.py [none 1 0 ...]

Prints one line per worker; nothing is written to bench/RESULTS.md (copy the lines there).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "forecast"


def worker(worker_id: int, threads: str, cache: str) -> None:
    import zarrfusion as zf
    from zarrfusion.loader import WindowLoader, _raw_loader

    started = time.perf_counter()
    src = zf.SessionContext().open_zarr(
        {"era5": str(DATA / "era5.zarr"), "imerg": str(DATA / "imerg.zarr")},
        variables={"era5": ["t2m", "u10", "v10", "z"], "imerg": ["precip"]},
    )
    w = src.windows({"lat": 64, "lon": 64}, {"lat": 32, "lon": 32}, history={"time": 2},
                    targets={"t2m": "+6h", "precip": "+6h"}, valid={"inputs": 0.9, "targets": "all"},
                    cache=cache, threads=None if threads == "none" else int(threads))
    opened = time.perf_counter()
    loader = w.loader(batch_size=32, shuffle="block", seed=0, stack="channels", shard=(1, 4), drop_last=True)
    raw = _raw_loader(w._raw, {**loader._description["loader"], "threads": 1}, (worker_id, 2))
    batches = iter(WindowLoader(raw, loader._description, (worker_id, 2)))
    next(batches)
    first = time.perf_counter()
    for _ in range(20):
        next(batches)
    done = time.perf_counter()
    print(json.dumps({"threads": threads, "worker": worker_id, "open_s": round(opened - started, 3),
                      "first_batch_s": round(first - opened, 3), "next_20_s": round(done - first, 3),
                      "index": w.index_counts}), flush=True)


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        worker(int(sys.argv[2]), sys.argv[3], sys.argv[4])
        return 0
    if not DATA.exists():
        print("make the stores first: python bench/bench_forecast.py --make", file=sys.stderr)
        return 1
    for threads in sys.argv[1:] or ["none", "2", "1", "0"]:
        cache = tempfile.mkdtemp(prefix="zf-worker-threads-")
        try:
            children = [subprocess.Popen([sys.executable, __file__, "--worker", str(k), threads, cache])
                        for k in range(2)]
            for child in children:
                child.wait()
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

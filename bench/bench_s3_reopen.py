"""Opening a store from the bucket again: cold, then with the opening cache (issue 23).

The shell opens the table (``CREATE EXTERNAL TABLE``) and runs Q2 of
``bench_s3.py`` in a fresh process each time, through the fault proxy at
each latency, cold (an empty cache directory) and warm (the cache a first
run left) in turn. The shell prints each statement's
elapsed time; the proxy counts the requests and the server's answers by
status (304: an object the opening took from its cache).

    .venv/bin/python bench/bench_s3_reopen.py                      # appends to bench/RESULTS.md
    .venv/bin/python bench/bench_s3_reopen.py --store bench/data/era5_small.zarr --no-write

The physical limit of an opening is one round trip (the latency plus the
server's time for the metadata and coordinate objects); a cold opening
needs two (the metadata, then the coordinates it names).
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "s3"))
import s3_server  # noqa: E402

DEFAULT_BIN = pathlib.Path.home() / ".cache" / "zarrfusion-target" / "debug" / "zarrfusion"
Q2 = ("SELECT count(*), avg(t2m) FROM era5 WHERE lat BETWEEN 30 AND 60 AND lon BETWEEN 0 AND 40 "
      "AND time >= TIMESTAMP '2020-01-03 18:00:00' AND time < TIMESTAMP '2020-01-06 12:00:00'")
ELAPSED = re.compile(r"Elapsed ([0-9.]+) seconds")


def run(zbin: str, server, create: str, cache: str) -> dict:
    """One fresh shell: the table's opening and Q2, timed by the shell; the
    proxy's counts of the whole run."""
    server.proxy.reset()
    env = dict(os.environ, ZARRFUSION_CACHE_DIR=cache)
    start = time.perf_counter()
    out = subprocess.run([zbin, "-c", create, "-c", Q2], capture_output=True, text=True, env=env, timeout=300)
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-1000:])
    elapsed = [float(x) for x in ELAPSED.findall(out.stdout)]
    stats = server.proxy.stats()
    return {"open": elapsed[0], "query": elapsed[1], "wall": wall, "gets": stats["methods"].get("GET", 0),
            "statuses": stats["statuses"], "answer": out.stdout.split("Elapsed")[1].splitlines()[-3:]}


def median(runs: list[dict], what: str) -> float:
    return statistics.median(r[what] for r in runs)


def spread(runs: list[dict], what: str) -> str:
    values = [r[what] for r in runs]
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=str(ROOT / "bench" / "data" / "era5_1gb.zarr"))
    ap.add_argument("--latencies", default="0,20,100")
    ap.add_argument("--runs", type=int, default=5, help="cold and warm runs per latency (each)")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    zbin = os.environ.get("ZARRFUSION_BIN", str(DEFAULT_BIN))
    store = pathlib.Path(a.store).resolve()
    load0 = os.getloadavg()
    server = s3_server.start({"era5.zarr": store}, bucket="bench")
    rows = []
    try:
        options = ", ".join(f"'{k}' '{v}'" for k, v in server.options().items())
        create = f"CREATE EXTERNAL TABLE era5 STORED AS ZARR LOCATION 's3://bench/era5.zarr' OPTIONS ({options})"
        for latency in [float(x) for x in a.latencies.split(",")]:
            server.proxy.configure(latency_ms=latency)
            # A first run (not counted) fills the warm cache; then cold runs (each
            # with an empty cache) and warm ones alternate, so that neither kind
            # is the first to reach the server at this latency.
            warm_cache = tempfile.mkdtemp(prefix="zf_open_cache_")
            run(zbin, server, create, warm_cache)
            cold, warm = [], []
            for _ in range(a.runs):
                cold.append(run(zbin, server, create, tempfile.mkdtemp(prefix="zf_open_cold_")))
                warm.append(run(zbin, server, create, warm_cache))
            answers = {tuple(r["answer"]) for r in cold + warm}
            row = {"latency": latency, "cold": cold, "warm": warm, "same": len(answers) == 1}
            rows.append(row)
            print(f"{latency:g} ms: open cold median {median(cold, 'open'):.3f} s, warm "
                  f"{median(warm, 'open'):.3f} s; whole run cold {median(cold, 'wall'):.3f} s, warm "
                  f"{median(warm, 'wall'):.3f} s; statuses cold {cold[-1]['statuses']} warm "
                  f"{warm[-1]['statuses']}; same answers: {row['same']}", flush=True)
    finally:
        server.stop()
    load1 = os.getloadavg()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = [
        f"## Object-store benchmark, opening cold and with the opening cache, {now} (issue 23)",
        "",
        f"- Command: `{' '.join(['ZARRFUSION_BIN=' + shlex.quote(zbin)] if 'ZARRFUSION_BIN' in os.environ else [])}"
        f"{' ' if 'ZARRFUSION_BIN' in os.environ else ''}.venv/bin/python bench/bench_s3_reopen.py"
        f"{' --store ' + a.store if a.store != ap.get_default('store') else ''}"
        f"{' --latencies ' + a.latencies if a.latencies != '0,20,100' else ''}"
        f"{' --runs ' + str(a.runs) if a.runs != 5 else ''}`",
        f"- Machine: {os.cpu_count()} cores; load average {load0[0]:.2f} at the start, {load1[0]:.2f} at the end.",
        f"- zarrfusion: `{zbin}`, tree at {head.stdout.strip()}{' + uncommitted work' if dirty else ''}.",
        f"- Store: `{a.store}` in moto's S3 server behind the fault proxy (tests/s3/s3_server.py), the latency "
        "added to every request. Each run a fresh shell: `CREATE EXTERNAL TABLE` then Q2 (bench_s3.py). At "
        f"each latency a first run (not counted) fills a cache directory, then {a.runs} cold runs (each with "
        "an empty cache directory) alternate with as many warm ones (with that cache). Times are the shell's "
        "elapsed time per statement, median (min-max); `whole run` is the process; statuses are the last run's.",
        "",
        "| latency ms | open cold s | open warm s | Q2 cold s | Q2 warm s | whole run cold s | whole run warm s | GETs | answers cold | answers warm | same answer |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in rows:
        c, w = r["cold"], r["warm"]
        lines.append(
            f"| {r['latency']:g} | {spread(c, 'open')} | {spread(w, 'open')} | {spread(c, 'query')} | "
            f"{spread(w, 'query')} | {spread(c, 'wall')} | {spread(w, 'wall')} | {c[-1]['gets']} | "
            f"{c[-1]['statuses']} | {w[-1]['statuses']} | {'yes' if r['same'] else 'NO'} |")
    lines.append("")
    text = "\n".join(lines) + "\n"
    print(text)
    if not a.no_write:
        with open(ROOT / "bench" / "RESULTS.md", "a") as f:
            f.write("\n" + text)
        print("appended to bench/RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

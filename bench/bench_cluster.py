#!/usr/bin/env python3
"""Scale-out benchmark (issue 27): the same queries on one core in one process, and on two
``zarrfusion worker`` processes each pinned to its own core, on this machine.

    python bench/bench_cluster.py [--repeat 3] [--queries Q1,Q3] [--store bench/data/era5_1gb.zarr]

Queries: Q1 and Q3 (dense reductions), QM (Quadratic Means: ``GROUP BY j, i`` of three means of
products over the 6 GB float64 store of ``bench_quadratic.py --make``, 1.9 M groups), R (the whole table copied into space chunks, the rechunk
of ``bench_rechunk.py`` as ``COPY ... STORED AS ZARR``), S (a COPY of the northern half with
``t2m - 273.15`` as float64 into space chunks: on workers a round of blockwise tasks, then the
rechunk's rounds), W (a COPY of a 24-step running mean of t2m: on workers a round of tasks
rolling runs of chunks along time), F (a COPY of the FFT of t2m along lon, complex64: on workers
a stage of tasks each transforming a run of blocks and writing them as whole chunks of the
target); the COPYs' targets removed before each run, not timed; no hash arm. A (an anomaly's
zonal mean, ``t2m`` minus its monthly climatology per cell, a broadcast join: on workers the
climatology's partial states, then its rows broadcast to the tasks reading the grid) has the arm
``2 workers (hash join)`` instead of the hash arm: ``zarrfusion.broadcast_join = false``,
DataFusion's hash join on the cluster (its plan before broadcast joins ran on workers). AC (a COPY
of each cell's anomaly into space chunks: on workers the climatology's stage, its rows broadcast
to a round of blockwise tasks, then the rechunk's rounds; no hash arm). B and D (reductions in
bands: the 3-hourly means and the diurnal cycle of every cell, reduced to a line; on workers each
task finishes a run of the bands and sends their rows; no hash arm). DC (D's mean and spread
written to Zarr as ``bench_climate.py``'s diurnal-zarr: on workers each task finishes a run of the
bands of latitudes and sends their rows, which the session gathers one task after the other and
writes a band at a time; no hash arm).

Arms (every run a fresh shell process; workers started fresh for each run, not timed):

* ``local 1 core (dense)``: ``taskset -c 0 zarrfusion ...``, zarrfusion's dense reduction
  (the best single-node plan; the ratios' base);
* ``local 2 cores (dense)``: the same in one process on both cores;
* ``2 workers (dense)``: workers pinned to cores 0 and 1 (``taskset``), the session unpinned and
  ``zarrfusion.bytes_per_task`` such that the reduction gets one task per worker: each task
  folds its blocks into partial states, merged by group position in the session (the default
  for two tasks, ``zarrfusion.state_merge = 'auto'``);
* ``2 workers (dense, merge tree)`` (Q1, Q3, QM): the same with ``zarrfusion.state_merge =
  'tree'``: the states shuffled by group position between the workers, each merging a share of
  the groups, then merged once more in the session (the default from three tasks a stage);
* ``2 workers (hash)``: the same with ``zarrfusion.dense_reduction = false``: DataFusion's
  partial and final aggregates over distributed scans (the cluster's plan before the dense
  reduction ran on workers).

and for F the peer, ``xarray + xrft, Dask 2 workers``: ``xrft.fft`` of the store opened with
Dask (a chunk per time step), cast to complex64 and written with zstd level 3 (zarrfusion's
type and codec) by a ``distributed.LocalCluster`` of two single-threaded worker processes with
the same memory limit; its time is the computation's (opening, transform, write), without the
cluster's start, and its peak RSS the client's, the workers' beside it. For QM the peer
``Dask 2 workers`` computes the three means as ``bench_quadratic.py``'s dask arm does
(``da.from_zarr`` in the store's chunks, ``dask.compute`` of the three) on the same kind of
cluster; its time is the computation's (the means brought to the client), without the cluster's
start and without printing the 1.9 M rows (the shell's time includes its start, planning and
printing them), which it then prints, untimed, for the answers' check.

A session with one worker runs a one-task stage in its own process (datafusion-distributed's
routing), so "one worker" is the ``local 1 core`` arm. Times are the shell's wall time
(process start to exit, the store's opening included); peak RSS is ``VmHWM`` of the shell
(read every 5 ms while it runs) and of each worker. Network bytes are the ``output_bytes`` of every network
boundary in one ``EXPLAIN ANALYZE`` run (a broadcast boundary, ``NetworkBroadcastExec``, reports
none: A's broadcast rows are not in the count); bytes read are the scanned chunks' bytes on disk and
decoded. Appends a section to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import re
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECHUNK_TARGET = Path("/tmp/bench_cluster_rechunk.zarr")
SELECTION_TARGET = Path("/tmp/bench_cluster_selection.zarr")
ROLLING_TARGET = Path("/tmp/bench_cluster_rolling.zarr")
FFT_TARGET = Path("/tmp/bench_cluster_fft.zarr")
ANOMALY_TARGET = Path("/tmp/bench_cluster_anomaly.zarr")
DIURNAL_TARGET = Path("/tmp/bench_cluster_diurnal.zarr")
QUERIES = {
    "Q1": "SELECT lat, avg(t2m) FROM era5 GROUP BY lat ORDER BY lat",
    "Q3": "SELECT lat, lon, avg(t2m*t2m) FROM era5 GROUP BY lat, lon",
    # The rechunk of bench_rechunk.py (time chunks to space chunks) as a COPY of the table:
    # on workers, each writes its runs of the target's chunks (a round per stage).
    "R": f"COPY era5 TO '{RECHUNK_TARGET}' STORED AS ZARR OPTIONS ('chunks' 'time=264,lat=16,lon=16')",
    # A COPY of a selection with a computed variable: on workers, a round of blockwise tasks
    # (the expression chunk by chunk into the intermediate store), then the rechunk's rounds.
    "S": f"COPY (SELECT time, lat, lon, t2m - 273.15 AS t2m_c FROM era5 WHERE lat > 0) TO "
    f"'{SELECTION_TARGET}' STORED AS ZARR OPTIONS ('chunks' 'time=264,lat=16,lon=16')",
    # A COPY of a 24-step running mean: on workers, a round of tasks each rolling a run of chunks
    # along time (straight into the target's chunks when they fit).
    "W": "COPY (SELECT time, lat, lon, avg(t2m) OVER w AS t2m_24 FROM era5 WINDOW w AS (PARTITION BY "
    "lat, lon ORDER BY time ROWS BETWEEN 23 PRECEDING AND CURRENT ROW)) TO "
    f"'{ROLLING_TARGET}' STORED AS ZARR",
    # A COPY of a transform by whole lines (each chunk holds whole lines of lon): on workers, a
    # stage of tasks each transforming a run of blocks into whole chunks of the target.
    "F": f"COPY (SELECT * FROM fft('era5', 't2m', dims => 'lon')) TO '{FFT_TARGET}' STORED AS ZARR",
    # An anomaly's zonal mean (a broadcast join): on workers, the climatology's partial states,
    # then its rows broadcast to the tasks reading the grid, whose GROUP BY gives partial states.
    # Each cell's time mean through rechunk(...) (time chunks to space chunks, as bench_rechunk.py):
    # on workers, the copy's rounds into the rechunked store in work_dir, then the dense
    # reduction of that store in tasks (partial states), all on the workers; the hash arm
    # scans the rechunked store under DataFusion's partial aggregates instead.
    "RC": "SELECT lat, lon, avg(t2m) FROM rechunk('era5', time => 264, lat => 16, lon => 16) "
    "GROUP BY lat, lon ORDER BY lat, lon",
    # Quadratic Means (the "Optimizing Cubed" seed, bench_quadratic.py's query) on its own 6 GB
    # store of float64 u, v (QUERY_STORES).
    "QM": "SELECT j, i, avg(u*u) AS uu, avg(v*v) AS vv, avg(u*v) AS uv FROM quad GROUP BY j, i ORDER BY j, i",
    # Reductions in bands (more group state than one pass holds), reduced to a line as
    # bench_climate.py's queries of the same names: the 3-hourly means of every cell (91 M groups,
    # in bands of time) and the diurnal cycle's mean and spread of every cell (25 M groups, in
    # bands of latitudes). On workers each task folds and finishes a run of the bands and sends
    # their rows (the result crosses the network, not states); the outer aggregate runs in the
    # session. No hash arm: DataFusion's hash aggregation took 41.5 s (B) and did not finish in
    # 300 s (D) on one machine (bench_climate.py).
    "B": "SELECT count(m) AS n, sum(m) AS m FROM (SELECT date_bin(INTERVAL '3 hours', time) AS t, "
    "lat, lon, avg(t2m) AS m FROM era5 GROUP BY 1, 2, 3)",
    "D": "SELECT count(m) AS n, sum(m + s) AS m FROM (SELECT extract(hour FROM time) AS h, lat, lon, "
    "avg(t2m) AS m, stddev_pop(t2m) AS s FROM era5 GROUP BY 1, 2, 3)",
    # D written to Zarr (bench_climate.py's diurnal-zarr): on workers each task finishes a run of
    # the bands of latitudes and sends their rows; the session gathers the tasks one after the
    # other (InOrderGatherExec, the later ones' rows held or spilled until their turn) and writes
    # a band at a time.
    "DC": "COPY (SELECT extract(hour FROM time) AS hour, lat, lon, avg(t2m) AS m, "
    "stddev_pop(t2m) AS s FROM era5 GROUP BY 1, 2, 3) TO "
    f"'{DIURNAL_TARGET}' STORED AS ZARR OPTIONS ('dims' 'hour,lat,lon', "
    "'chunks' 'hour=1,lat=721,lon=1440', 'codec' 'zstd')",
    "A": "WITH clim AS (SELECT extract(month FROM time) AS month, lat, lon, avg(t2m) AS c FROM era5 "
    "GROUP BY 1, 2, 3) SELECT era5.time, era5.lat, avg(era5.t2m - clim.c) AS a FROM era5 JOIN clim "
    "ON extract(month FROM era5.time) = clim.month AND era5.lat = clim.lat AND era5.lon = clim.lon "
    "GROUP BY 1, 2",
    # A COPY of each cell's anomaly against its monthly climatology into space chunks: on workers
    # the climatology's partial states, then its rows broadcast to the round of blockwise tasks
    # (each holding it beside its chunks), then the rechunk's rounds.
    "AC": "COPY (WITH clim AS (SELECT extract(month FROM time) AS month, lat, lon, avg(t2m) AS c "
    "FROM era5 GROUP BY 1, 2, 3) SELECT era5.time, era5.lat, era5.lon, era5.t2m - clim.c AS a "
    "FROM era5 JOIN clim ON extract(month FROM era5.time) = clim.month AND era5.lat = clim.lat "
    f"AND era5.lon = clim.lon) TO '{ANOMALY_TARGET}' STORED AS ZARR OPTIONS "
    "('chunks' 'time=264,lat=16,lon=16')",
}
# Queries over another store than --store: (table name, store, its variables), made by
# `bench/bench_quadratic.py --make`.
QUERY_STORES = {"QM": ("quad", ROOT / "bench" / "data" / "quad.zarr", ("u", "v"))}
# The COPYs' targets, removed before each run.
COPY_TARGETS = {
    "R": RECHUNK_TARGET,
    "S": SELECTION_TARGET,
    "W": ROLLING_TARGET,
    "F": FFT_TARGET,
    "AC": ANOMALY_TARGET,
    "DC": DIURNAL_TARGET,
}
UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
# F's peer: xrft over Dask on two worker processes (argv: store, target, memory limit). Prints the
# computation's seconds and each worker's peak RSS.
DASK_FFT = '''
import resource, sys, time
import xarray as xr, xrft, zarr
from dask.distributed import Client, LocalCluster
store, target, memory = sys.argv[1:4]
with LocalCluster(n_workers=2, threads_per_worker=1, memory_limit=memory, processes=True) as cluster, Client(cluster) as client:
    start = time.perf_counter()
    ds = xr.open_zarr(store, chunks={"time": 1})
    spectrum = xrft.fft(ds.t2m, dim="lon").astype("complex64").rename("t2m")
    out = spectrum.to_dataset()
    for variable in out.variables.values():
        variable.encoding = {}  # the source's (v2 compressors) do not apply to a v3 store
    codec = zarr.codecs.ZstdCodec(level=3)
    out.to_zarr(target, mode="w", encoding={"t2m": {"compressors": [codec]}})
    elapsed = time.perf_counter() - start
    peaks = client.run(lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    print("count")
    print(spectrum.size)
    print(f"elapsed {elapsed}", file=sys.stderr)
    print(f"workers {' '.join(str(v) for v in peaks.values())}", file=sys.stderr)
'''

# QM's peer: the three means over Dask on two worker processes (argv: store, memory limit), as
# bench_quadratic.py's dask arm computes them (da.from_zarr in the store's chunks). Prints the
# computation's seconds and each worker's peak RSS; then, not timed, the means as the shell's CSV
# rows (j, i, uu, vv, uv) for the answers' check.
DASK_QM = '''
import resource, sys, time
import dask, dask.array as da, numpy as np
from dask.distributed import Client, LocalCluster
store, memory = sys.argv[1:3]
with LocalCluster(n_workers=2, threads_per_worker=1, memory_limit=memory, processes=True) as cluster, Client(cluster) as client:
    start = time.perf_counter()
    u = da.from_zarr(store, component="u")
    v = da.from_zarr(store, component="v")
    means = [m[0] for m in dask.compute((u * u).mean(axis=0), (v * v).mean(axis=0), (u * v).mean(axis=0))]
    elapsed = time.perf_counter() - start
    peaks = client.run(lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
print(f"elapsed {elapsed}", file=sys.stderr)
print(f"workers {' '.join(str(v) for v in peaks.values())}", file=sys.stderr)
j, i = np.indices(means[0].shape)
rows = np.column_stack([j.ravel(), i.ravel(), *(m.ravel() for m in means)])
out = sys.stdout
out.write("j,i,uu,vv,uv\\n")
for row in rows:
    out.write(f"{int(row[0])},{int(row[1])},{float(row[2])!r},{float(row[3])!r},{float(row[4])!r}\\n")
'''


def binary() -> Path:
    target = os.environ.get("CARGO_TARGET_DIR") or Path.home() / ".cache" / "zarrfusion-target"
    return Path(os.environ.get("ZARRFUSION_BIN", Path(target) / "debug" / "zarrfusion"))


def start_worker(core: int, memory: str) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen(
        ["taskset", "-c", str(core), str(binary()), "worker", "--listen", "127.0.0.1:0", "--memory-limit", memory],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    ready, _, _ = select.select([p.stdout], [], [], 60)
    if not ready:
        p.kill()
        raise RuntimeError("a worker did not start within 60 s")
    line = p.stdout.readline().strip()
    return p, line.rsplit(" ", 1)[-1]


def vm_hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run_child_rss(args: list[str], pin: str | None, program: list[str] | None = None) -> tuple[float, int, str]:
    """The shell's wall time, its own peak RSS and stdout.

    The peak is the child's VmHWM, read every 5 ms until it exits, not ``ru_maxrss``:
    a forked child's ``ru_maxrss`` starts at this process's RSS, which grows with the
    answers it keeps (~40 MB per Q3 answer)."""
    argv = (["taskset", "-c", pin] if pin else []) + (program or [str(binary())]) + args
    out_path = Path("/tmp/bench_cluster.out")
    with open(out_path, "w") as out, open("/tmp/bench_cluster.err", "w") as err:
        start = time.perf_counter()
        p = subprocess.Popen(argv, stdout=out, stderr=err)
        peak = 0
        while p.poll() is None:
            try:
                peak = max(peak, vm_hwm(p.pid))
            except (OSError, ValueError):
                pass
            time.sleep(0.005)
        elapsed = time.perf_counter() - start
    if p.returncode != 0:
        raise RuntimeError(f"{argv} failed: {Path('/tmp/bench_cluster.err').read_text()[-2000:]}")
    return elapsed, peak, out_path.read_text()


def run_dask(script: str, args: list[str]) -> tuple[float, int, str, list[int]]:
    """A Dask peer (``DASK_FFT``, ``DASK_QM``): the computation's seconds, the client's peak
    RSS, its stdout (what the shell prints for the same query) and each Dask worker's peak RSS."""
    _, peak, out = run_child_rss([script, *args], None, program=[sys.executable, "-c"])
    err = Path("/tmp/bench_cluster.err").read_text()
    elapsed = float(re.search(r"elapsed (\S+)", err).group(1))
    workers = [int(v) for v in re.search(r"workers (.*)", err).group(1).split()]
    return elapsed, peak, out, workers


def network_bytes(explain: str) -> tuple[float, float]:
    """Bytes out of every network boundary and rows scanned, from EXPLAIN ANALYZE."""
    total = 0.0
    for line in explain.splitlines():
        if "Network" in line and "output_bytes=" in line:
            m = re.search(r"output_bytes=([\d.]+) ?([KMG]?B)", line)
            if m:
                total += float(m.group(1)) * UNITS[m.group(2)]
    scanned = 0.0
    for line in explain.splitlines():
        if "ZarrScanExec" in line and "output_rows=" in line:
            m = re.search(r"output_rows=([\d.]+) ?([KMB]?)", line)
            if m:
                scanned = float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "B": 1e9}[m.group(2)]
    return total, scanned


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--queries", default="Q1,Q3")
    ap.add_argument("--store", default=str(ROOT / "bench" / "data" / "era5_1gb.zarr"))
    ap.add_argument("--memory", default="2GB", help="each worker's and the session's allowed_mem")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    if not binary().exists():
        sys.exit(f"{binary()} is not built: cargo build --workspace")
    hash_plan = "SET zarrfusion.dense_reduction = false"
    rows = []
    stores = {}
    for q in args.queries.split(","):
        sql = QUERIES[q]
        table, store, variables = QUERY_STORES.get(q, ("era5", args.store, ("t2m",)))
        store = str(store)
        if not Path(store).exists():
            sys.exit(f"{store} is missing (QM's: python bench/bench_quadratic.py --make)")
        on_disk = sum(
            f.stat().st_size
            for v in variables
            for f in Path(store, v).rglob("*")
            if f.is_file() and not f.name.startswith(".")
        )
        stores[q] = (store, variables, on_disk)
        create = f"CREATE EXTERNAL TABLE {table} STORED AS ZARR LOCATION '{store}'"
        arms = {
            "local 1 core (dense)": (None, "0", [create, sql]),
            "local 2 cores (dense)": (None, None, [create, sql]),
            "2 workers (dense)": (2, None, [create, sql]),
            "2 workers (hash)": (2, None, [hash_plan, create, sql]),
        }
        if q in ("Q1", "Q3", "QM"):
            arms["2 workers (dense, merge tree)"] = (2, None, ["SET zarrfusion.state_merge = 'tree'", create, sql])
        if q in COPY_TARGETS or q in ("B", "D"):
            del arms["2 workers (hash)"]
        if q == "F":
            arms["xarray + xrft, Dask 2 workers"] = ("dask", None, [])
        if q == "QM":
            arms["Dask 2 workers"] = ("dask", None, [])
        if q == "A":
            # The cluster's plan before broadcast joins ran on workers: DataFusion's hash join.
            del arms["2 workers (hash)"]
            arms["2 workers (hash join)"] = (2, None, ["SET zarrfusion.broadcast_join = false", create, sql])
        answers = {}
        explain_net = {}
        for arm, (workers, pin, statements) in arms.items():
            try:
                measured = run_arm(q, arm, workers, pin, statements, args, store, sql, answers, explain_net)
            except RuntimeError as e:
                # A peer that cannot do the work within the budget: said, not shrunk.
                print(f"{q} {arm}: failed: {e}", flush=True)
                rows.append((q, arm, "failed", str(e).split(" failed: ", 1)[-1], None, None))
                continue
            rows.append(measured)
        same = len({"\n".join(_round(a) for a in v) for v in answers.values()}) == 1
        rows.append((q, "answers identical (6 significant digits)", same, None, None, None))
        for arm, net in explain_net.items():
            rows.append((q, "network", (arm, *net), on_disk, None, None))
    report(rows, args, stores)


def run_arm(q, arm, workers, pin, statements, args, store, sql, answers, explain_net):
    """One arm of query ``q``: a warm-up and ``args.repeat`` runs; its row of the report.
    Raises ``RuntimeError`` when a run fails."""
    times, rss, worker_rss = [], [], []
    for i in range(args.repeat + 1):
        procs, hwm = [], []
        extra = ["-m", args.memory]
        if q in COPY_TARGETS:
            subprocess.run(["rm", "-rf", str(COPY_TARGETS[q])], check=True)
        if workers == "dask":
            if q == "F":
                elapsed, peak, out, hwm = run_dask(DASK_FFT, [store, str(COPY_TARGETS[q]), args.memory])
            else:
                elapsed, peak, out, hwm = run_dask(DASK_QM, [store, args.memory])
        else:
            if workers:
                started = [start_worker(core, args.memory) for core in range(workers)]
                procs = [p for p, _ in started]
                extra += ["--workers", ",".join(a for _, a in started)]
                # One task per worker: the scan's decoded bytes over the workers.
                statements_run = ["SET zarrfusion.bytes_per_task = 1", *statements]
            else:
                statements_run = statements
            try:
                cmd = [*extra, "-q", "--format", "csv"]
                for s in statements_run:
                    cmd += ["-c", s]
                elapsed, peak, out = run_child_rss(cmd, pin)
                if workers and i == 0 and q not in COPY_TARGETS:
                    setup = [x for s in statements_run[:-1] for x in ("-c", s)]
                    explain = run_child_rss([*extra, "-q", *setup, "-c", f"EXPLAIN ANALYZE {sql}"], None)[2]
                    explain_net[arm] = network_bytes(explain)
                hwm = [vm_hwm(p.pid) for p in procs]
            finally:
                for p in procs:
                    p.terminate()
                for p in procs:
                    p.wait(timeout=30)
        answers[arm] = sorted(out.strip().splitlines()[1:])
        if i == 0:
            continue  # warm-up: page cache
        times.append(elapsed)
        rss.append(peak)
        if hwm:
            worker_rss.append(max(hwm))
        print(f"{q} {arm} run {i}: {elapsed:.2f} s, RSS {peak / 2**20:.0f} MiB"
              + (f", workers {', '.join(f'{h / 2**20:.0f}' for h in hwm)} MiB" if hwm else ""), flush=True)
    return (q, arm, min(times), statistics.median(times), max(rss), max(worker_rss) if worker_rss else None)


def _round(line: str) -> str:
    out = []
    for cell in line.split(","):
        try:
            out.append(f"{float(cell):.6g}")
        except ValueError:
            out.append(cell)
    return ",".join(out)


def report(rows, args, stores) -> None:
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
    load = os.getloadavg()
    lines = [
        f"## Cluster benchmark {now} (issue 27: one core vs two pinned workers: dense reductions, rechunk)",
        "",
        f"- Command: `python bench/bench_cluster.py --repeat {args.repeat} --queries {args.queries}`",
        f"- Machine: {os.cpu_count()} cores; load average {load[0]:.2f} at the end. zarrfusion: `{binary()}`.",
        *(
            f"- {q}: store `{store}` ({', '.join(variables)} chunks {on_disk / 1e6:.1f} MB on disk)."
            for q, (store, variables, on_disk) in stores.items()
        ),
        f"- allowed_mem {args.memory} (the session's and each worker's).",
        f"- Each arm: a warm-up run, then {args.repeat} runs; best and median of the shell's wall time.",
        "",
        "| query | arm | best s | median s | vs 1 core (dense) | shell peak RSS MiB | worker peak RSS MiB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    base = {q: best for q, arm, best, *_ in rows if arm == "local 1 core (dense)" and best != "failed"}
    notes = []
    for q, arm, a, b, c, d in rows:
        if arm.startswith("answers"):
            notes.append(f"- {q}: answers identical across arms (6 significant digits): {'yes' if a else 'NO'}")
        elif arm == "network":
            which, net, scanned = a
            rows_scanned = (f"{scanned / 1e6:.1f} M rows scanned" if scanned
                            else "no rows scanned as rows (the cells folded where they are decoded)")
            notes.append(
                f"- {q}, {which}: {net / 1e3:.1f} kB crossed the network (every network boundary's output; "
                f"a broadcast boundary reports none), "
                f"{rows_scanned}, {b / 1e6:.0f} MB on disk: {100 * net / b:.4f} % of the bytes on disk"
            )
        elif a == "failed":
            first = next((line for line in b.splitlines() if "Error" in line), b.splitlines()[0])
            lines.append(f"| {q} | {arm} | failed | | | | |")
            notes.append(f"- {q}, {arm}: failed: `{first.strip()[:400]}`")
        else:
            ratio = f"{base[q] / a:.2f}x" if q in base else "-"
            lines.append(
                f"| {q} | {arm} | {a:.2f} | {b:.2f} | {ratio} | {c / 2**20:.0f} | {'' if d is None else f'{d / 2**20:.0f}'} |"
            )
    lines += ["", *notes, ""]
    text = "\n".join(lines)
    print(text)
    if not args.no_record:
        with open(ROOT / "bench" / "RESULTS.md", "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()

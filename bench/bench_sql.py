#!/usr/bin/env python3
"""Peer benchmark for issue 2 ("Zarr stores as SQL tables"): zarrfusion vs xarray vs xarray-sql.

    .venv/bin/python bench/make_era5.py          # once: writes bench/data/*.zarr
    .venv/bin/python bench/bench_sql.py [--quick] [--peers zarrfusion,xarray,xarray-sql]

Every measurement is a fresh subprocess, so its peak RSS and I/O are its own:

* zarrfusion: the binary from $ZARRFUSION_BIN (default
  ~/.cache/zarrfusion-target/debug/zarrfusion, built by scripts/test or scripts/demo), run as
  ``zarrfusion -q --format csv -c "CREATE EXTERNAL TABLE era5 STORED AS ZARR LOCATION '<store>'" -c "<query>"``;
  skipped with a message when the binary does not exist.
* xarray: ``xr.open_zarr(store, chunks=None)`` and the numpy computation
  (this script, ``--child xarray``).
* xarray-sql: ``xr.open_zarr(store, chunks=None)``, ``xarray_sql.Context().from_dataset('era5', ds)``
  (partitions = the store's chunks unless --xsql-chunks), ``ctx.sql(q).to_arrow_table()``
  (this script, ``--child xarray-sql``).

Per run the parent records: process wall time; peak RSS (``ru_maxrss`` from ``wait4`` on that
child); bytes read (``rchar`` of ``/proc/<pid>/io``, read after the child exited but before it
is reaped, i.e. every byte the process got from read()/pread() syscalls, page cache or not).
Python children also report their own in-process time (open + register + query + result in
memory) and the rchar delta over that span. Results are compared between peers.
Writes/appends a section to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DATA = HERE / "data"
ERA5 = DATA / "era5_1gb.zarr"
MILLION = DATA / "million_chunks.zarr"
RESULTS = HERE / "RESULTS.md"
DEFAULT_BIN = Path.home() / ".cache" / "zarrfusion-target" / "debug" / "zarrfusion"
PEERS = ["zarrfusion", "xarray", "xarray-sql"]


def sql_queries(t_lo: str, t_hi: str) -> dict[str, str]:
    return {
        "Q1": "SELECT lat, avg(t2m) FROM era5 GROUP BY lat ORDER BY lat",
        "Q2": (
            "SELECT count(*), avg(t2m) FROM era5 WHERE lat BETWEEN 30 AND 60 AND lon BETWEEN 0 AND 40 "
            f"AND time >= TIMESTAMP '{t_lo}' AND time < TIMESTAMP '{t_hi}'"
        ),
        "Q3": "SELECT lat, lon, avg(t2m*t2m) FROM era5 GROUP BY lat, lon",
    }


def read_io(pid: int | str = "self") -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


def xarray_answer(ds, what: str, t_lo: str, t_hi: str) -> dict:
    """The xarray/numpy equivalent of query ``what`` on ``ds`` (opened with chunks=None)."""
    import numpy as np

    t2m = ds["t2m"]
    if what == "Q1":
        m = t2m.mean(("time", "lon"))
        order = np.argsort(m["lat"].values, kind="stable")
        return {"lat": m["lat"].values[order], "v": m.values[order]}
    if what == "Q2":
        lo = np.datetime64(t_lo, "ns")
        hi = np.datetime64(t_hi, "ns") - np.timedelta64(1, "ns")  # time < t_hi
        box = t2m.sel(lat=slice(60, 30), lon=slice(0, 40), time=slice(lo, hi))
        vals = box.values
        return {"count": np.array([vals.size]), "v": np.array([float(np.nanmean(vals))])}
    if what == "Q3":
        m = (t2m**2).mean("time")
        lat2, lon2 = np.meshgrid(m["lat"].values, m["lon"].values, indexing="ij")
        return {"lat": lat2.ravel(), "lon": lon2.ravel(), "v": m.values.ravel()}
    raise SystemExit(f"unknown query {what}")


def arrow_answer(tbl, what: str) -> dict:
    """A SQL answer (pyarrow table of the query's columns, in order) as the arrays compare() takes."""
    cols = [c.to_numpy() for c in tbl.columns]
    if what == "Q1":
        return {"lat": cols[0], "v": cols[1]}
    if what == "Q2":
        return {"count": cols[0], "v": cols[1]}
    if what == "Q3":
        return {"lat": cols[0], "lon": cols[1], "v": cols[2]}
    if what == "count":
        return {"count": cols[0]}
    raise SystemExit(f"unknown query {what}")


# ======================================================================================
# child side: one peer, one query, one process
# ======================================================================================

def child(args) -> int:
    """Run one query in this process; print one JSON line; save the result as .npz."""
    import numpy as np

    peer, what = args.child
    import xarray as xr  # noqa: F401  (imports are not timed)
    if peer == "xarray-sql":
        import xarray_sql as xql
    if what == "null":  # startup baseline: imports only
        print(json.dumps({"t_total": 0.0, "rchar_span": 0}))
        return 0

    io0 = read_io()["rchar"]
    t0 = time.perf_counter()
    ds = xr.open_zarr(args.store, chunks=None)
    t_open = time.perf_counter() - t0
    res: dict[str, np.ndarray] = {}
    info: dict = {}

    if peer == "xarray":
        res = xarray_answer(ds, what, args.t_lo, args.t_hi)
        t_reg = 0.0
    elif peer == "xarray-sql":
        t1 = time.perf_counter()
        ctx = xql.Context()
        chunks = {"time": args.xsql_chunks} if args.xsql_chunks else None
        ctx.from_dataset(args.table, ds, chunks=chunks)
        t_reg = time.perf_counter() - t1
        tbl = ctx.sql(args.sql).to_arrow_table()
        info["columns"] = tbl.column_names
        res = arrow_answer(tbl, what)
    else:
        raise SystemExit(f"unknown peer {peer}")
    t_total = time.perf_counter() - t0
    io1 = read_io()["rchar"]
    rows = len(next(iter(res.values())))
    if args.out:
        np.savez(args.out, **{k: np.asarray(v) for k, v in res.items()})
    print(json.dumps({"t_open": t_open, "t_register": t_reg, "t_total": t_total,
                      "rchar_span": io1 - io0, "rows": rows, **info}))
    return 0


# ======================================================================================
# parent side
# ======================================================================================

class Run(dict):
    """One subprocess: wall, maxrss_mb, rchar, read_bytes, cpu_s, rc, timed_out, killed, stdout, child."""


def run_proc(argv: list[str], timeout: float, mem_limit_gb: float, stdout_path: Path) -> Run:
    import psutil

    killed = {"why": None}
    with open(stdout_path, "wb") as out, tempfile.TemporaryFile() as err:
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        p = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
        done = threading.Event()

        def watchdog():
            try:
                pp = psutil.Process(p.pid)
            except psutil.Error:
                return
            while not done.wait(0.5):
                if time.perf_counter() - t0 > timeout:
                    killed["why"] = f"timeout > {timeout:.0f} s"
                elif mem_limit_gb:
                    try:
                        rss = pp.memory_info().rss + sum(c.memory_info().rss for c in pp.children(recursive=True))
                    except psutil.Error:
                        continue
                    if rss > mem_limit_gb * 2**30:
                        killed["why"] = f"RSS > {mem_limit_gb:g} GiB"
                if killed["why"]:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    return

        th = threading.Thread(target=watchdog, daemon=True)
        th.start()
        os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
        wall = time.perf_counter() - t0
        try:
            io = read_io(p.pid)
        except OSError:
            io = {"rchar": -1, "read_bytes": -1}
        _, status, ru = os.wait4(p.pid, 0)
        done.set()
        p.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    r = Run(wall=wall, maxrss_mb=ru.ru_maxrss / 1024, rchar=io["rchar"], read_bytes=io["read_bytes"],
            cpu_s=ru.ru_utime + ru.ru_stime, rc=p.returncode, killed=killed["why"], stderr=stderr[-2000:],
            load1=load, stdout_path=str(stdout_path))
    return r


def child_argv(peer: str, what: str, store: Path, sql: str, out: Path | None, a, table="era5") -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", peer, what, "--store", str(store),
            "--sql", sql, "--table", table, "--t-lo", a.t_lo or "", "--t-hi", a.t_hi or ""]
    if a.xsql_chunks:
        argv += ["--xsql-chunks", str(a.xsql_chunks)]
    if out:
        argv += ["--out", str(out)]
    return argv


def zf_argv(zbin: str, store: Path, sql: str, table="era5") -> list[str]:
    return [zbin, "-q", "--format", "csv",
            "-c", f"CREATE EXTERNAL TABLE {table} STORED AS ZARR LOCATION '{store}'", "-c", sql]


def last_json(path: Path) -> dict:
    try:
        lines = [l for l in Path(path).read_text().splitlines() if l.startswith("{")]
        return json.loads(lines[-1]) if lines else {}
    except OSError:
        return {}


def load_zf_csv(path: Path, qid: str):
    import numpy as np
    import pandas as pd

    df = pd.read_csv(path)
    c = [df[k].to_numpy() for k in df.columns]
    if qid == "Q1":
        return {"lat": c[0].astype("float64"), "v": c[1].astype("float64")}
    if qid == "Q2":
        return {"count": np.asarray(c[0]), "v": c[1].astype("float64")}
    if qid == "Q3":
        return {"lat": c[0].astype("float64"), "lon": c[1].astype("float64"), "v": c[2].astype("float64")}
    if qid == "count":
        return {"count": np.asarray(c[0])}
    raise ValueError(qid)


def compare(qid: str, ref: dict, got: dict, rtol=1e-5) -> str:
    """'ok' or a description of the first difference."""
    import numpy as np

    if ref is None or got is None:
        return "n/a"
    try:
        if qid == "Q2":
            if int(ref["count"][0]) != int(got["count"][0]):
                return f"count {int(got['count'][0])} != {int(ref['count'][0])}"
            if not np.isclose(float(got["v"][0]), float(ref["v"][0]), rtol=rtol, atol=0):
                return f"avg {float(got['v'][0])!r} != {float(ref['v'][0])!r}"
            return "ok"
        keys = ["lat"] if qid == "Q1" else ["lat", "lon"]
        if len(got["v"]) != len(ref["v"]):
            return f"{len(got['v'])} rows != {len(ref['v'])}"

        def sort(d):
            o = np.lexsort(tuple(np.asarray(d[k], dtype="float64") for k in reversed(keys)))
            return {k: np.asarray(d[k], dtype="float64")[o] for k in keys + ["v"]}

        r, g = sort(ref), sort(got)
        if qid == "Q1" and not np.array_equal(np.asarray(got["lat"], dtype="float64"), r["lat"]):
            return "Q1 rows not ordered by lat"
        for k in keys:
            if not np.allclose(g[k], r[k], rtol=0, atol=1e-6):
                i = int(np.argmax(np.abs(g[k] - r[k])))
                return f"{k}[{i}] {g[k][i]} != {r[k][i]}"
        bad = ~np.isclose(g["v"], r["v"], rtol=rtol, atol=0)
        if bad.any():
            i = int(np.argmax(bad))
            return f"{bad.sum()} values differ, e.g. row {i}: {g['v'][i]!r} != {r['v'][i]!r}"
        rel = float(np.max(np.abs(g["v"] - r["v"]) / np.abs(r["v"])))
        return f"ok (max rel diff {rel:.1e})"
    except Exception as e:  # noqa: BLE001
        return f"compare failed: {e}"


def chunk_stats(t_lo: str, t_hi: str) -> dict:
    """Q2: which t2m chunks intersect the box/time filter, from the coordinate values."""
    import numpy as np
    import xarray as xr

    ds = xr.open_zarr(ERA5, chunks=None)
    chunks = ds["t2m"].encoding["chunks"]
    shape = ds["t2m"].shape
    tv = ds["time"].values
    masks = [
        (tv >= np.datetime64(t_lo, "ns")) & (tv < np.datetime64(t_hi, "ns")),
        (ds["lat"].values >= 30) & (ds["lat"].values <= 60),
        (ds["lon"].values >= 0) & (ds["lon"].values <= 40),
    ]
    idx = [np.flatnonzero(m) for m in masks]
    touched = [np.unique(i // c) for i, c in zip(idx, chunks)]
    nchunks = [math.ceil(s / c) for s, c in zip(shape, chunks)]
    hit_bytes = 0
    for a in touched[0]:
        for b in touched[1]:
            for c in touched[2]:
                f = ERA5 / "t2m" / f"{a}.{b}.{c}"
                hit_bytes += f.stat().st_size if f.exists() else 0
    all_bytes = sum(f.stat().st_size for f in (ERA5 / "t2m").iterdir() if f.name[0].isdigit())
    chunk_raw = int(np.prod(chunks)) * 4
    return {
        "shape": shape, "chunks": chunks, "total_chunks": int(np.prod(nchunks)),
        "hit_chunks": int(np.prod([len(t) for t in touched])), "hit_per_dim": [len(t) for t in touched],
        "cells": int(np.prod([len(i) for i in idx])), "hit_disk_bytes": hit_bytes, "all_disk_bytes": all_bytes,
        "hit_raw_bytes": int(np.prod([len(t) for t in touched])) * chunk_raw, "all_raw_bytes": int(np.prod(shape)) * 4,
        "time_steps": len(idx[0]), "lat_vals": len(idx[1]), "lon_vals": len(idx[2]),
    }


def fmt_s(x):
    if x is None:
        return "-"
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def compiling_now() -> bool:
    import psutil

    for p in psutil.process_iter(["name"]):
        if (p.info["name"] or "") in ("rustc", "cargo", "cc1", "cc1plus", "ld", "lld", "mold"):
            return True
    return False


def parent(a) -> int:
    import numpy as np
    import xarray as xr

    if not (ERA5 / ".zmetadata").exists() or not (MILLION / "zarr.json").exists():
        print("missing stores: run .venv/bin/python bench/make_era5.py first", file=sys.stderr)
        return 2
    peers = [p.strip() for p in a.peers.split(",") if p.strip()]
    zbin = os.environ.get("ZARRFUSION_BIN", str(DEFAULT_BIN))
    notes = []
    if "zarrfusion" in peers and not (os.path.isfile(zbin) and os.access(zbin, os.X_OK)):
        msg = f"zarrfusion binary not found at {zbin} (set ZARRFUSION_BIN or build with `cargo build --release -p zarrfusion-cli`): skipping the zarrfusion peer"
        print("NOTE: " + msg, flush=True)
        notes.append(msg)
        peers.remove("zarrfusion")
    repeats = 1 if a.quick else a.repeats
    qids = [q.strip() for q in a.queries.split(",") if q.strip()]

    ds = xr.open_zarr(ERA5, chunks=None)
    tv = ds["time"].values
    nt = tv.size
    fmt = lambda t: str(np.datetime_as_string(t, unit="s")).replace("T", " ")  # noqa: E731
    a.t_lo, a.t_hi = fmt(tv[nt // 4]), fmt(tv[nt // 2])
    queries = sql_queries(a.t_lo, a.t_hi)
    tmp = Path(tempfile.mkdtemp(prefix="zf_bench_"))
    print(f"store {ERA5}: t2m{tuple(ds['t2m'].shape)}, time {fmt(tv[0])} .. {fmt(tv[-1])}; "
          f"Q2 time window [{a.t_lo}, {a.t_hi})", flush=True)
    print(f"peers: {', '.join(peers)}; runs per query: first + best of {repeats}; tmp {tmp}", flush=True)

    # ---- startup baselines (subtracted from rchar) ----
    base = {}
    for peer in peers:
        if peer == "zarrfusion":
            argv = [zbin, "-q", "--format", "csv", "-c", "SELECT 1"]
        else:
            argv = child_argv(peer, "null", ERA5, "", None, a)
        r = run_proc(argv, 120, a.mem_limit_gb, tmp / f"null_{peer}.out")
        base[peer] = r
        print(f"  baseline {peer:10s}: startup {r['wall']:.3f} s, rchar {r['rchar'] / 1e6:.1f} MB, RSS {r['maxrss_mb']:.0f} MB", flush=True)

    # ---- queries ----
    results: dict[tuple[str, str], dict] = {}
    answers: dict[tuple[str, str], dict | None] = {}
    for qid in qids:
        sql = queries[qid]
        print(f"\n{qid}: {sql}", flush=True)
        for peer in peers:
            runs = []
            for i in range(1 + repeats):
                out = tmp / f"{qid}_{peer}_{i}"
                if peer == "zarrfusion":
                    argv = zf_argv(zbin, ERA5, sql)
                    r = run_proc(argv, a.timeout, a.mem_limit_gb, out.with_suffix(".csv"))
                    r["t_engine"] = r["wall"]
                    r["bytes"] = r["rchar"] - base[peer]["rchar"]
                else:
                    argv = child_argv(peer, qid, ERA5, sql, out.with_suffix(".npz"), a)
                    r = run_proc(argv, a.timeout, a.mem_limit_gb, out.with_suffix(".json"))
                    c = last_json(out.with_suffix(".json"))
                    r["child"] = c
                    r["t_engine"] = c.get("t_total")
                    r["bytes"] = c.get("rchar_span", r["rchar"] - base[peer]["rchar"])
                r["ok"] = r["rc"] == 0 and not r["killed"]
                runs.append(r)
                status = "ok" if r["ok"] else f"FAILED rc={r['rc']} {r['killed'] or ''} {r['stderr'][-400:]}"
                print(f"  {peer:10s} run {i}: engine {fmt_s(r['t_engine'])} s, process {fmt_s(r['wall'])} s, "
                      f"RSS {r['maxrss_mb']:.0f} MB, read {r['bytes'] / 1e6:.1f} MB, cpu {r['cpu_s']:.1f} s, "
                      f"load {r['load1']:.1f}: {status}", flush=True)
                if not r["ok"]:
                    break
            good = [r for r in runs if r["ok"]]
            first = runs[0]
            best = min(good[1:] or good, key=lambda r: r["t_engine"]) if good else None
            results[(qid, peer)] = {
                "first": first, "best": best, "ok": bool(good) and len(good) == len(runs),
                "maxrss_mb": max(r["maxrss_mb"] for r in runs),
                "bytes": min((r["bytes"] for r in good), default=None),
                "process_best": min((r["wall"] for r in good[1:] or good), default=None),
                "load_max": max(r["load1"] for r in runs),
            }
            ans = None
            if good:
                try:
                    if peer == "zarrfusion":
                        ans = load_zf_csv(Path(good[-1]["stdout_path"]), qid)
                    else:
                        z = np.load(tmp / f"{qid}_{peer}_{runs.index(good[-1])}.npz")
                        ans = {k: z[k] for k in z.files}
                except Exception as e:  # noqa: BLE001
                    print(f"  could not load {peer} answer: {e}")
            answers[(qid, peer)] = ans
            if ans is not None:
                results[(qid, peer)]["rows"] = len(ans["v"]) if "v" in ans else len(next(iter(ans.values())))

    # ---- correctness: every peer against xarray (else against the first peer with an answer) ----
    checks = {}
    for qid in qids:
        ref_peer = "xarray" if answers.get((qid, "xarray")) is not None else next(
            (p for p in peers if answers.get((qid, p)) is not None), None)
        for peer in peers:
            if peer == ref_peer:
                checks[(qid, peer)] = "reference"
            else:
                ref = answers.get((qid, ref_peer)) if ref_peer else None
                checks[(qid, peer)] = compare(qid, ref, answers.get((qid, peer)))
        if qid == "Q2" and answers.get((qid, ref_peer)) is not None:
            r = answers[(qid, ref_peer)]
            results[("Q2", "answer")] = {"count": int(r["count"][0]), "avg": float(r["v"][0])}

    # ---- million chunks ----
    million = {}
    if not a.skip_million:
        print(f"\nmillion chunks: {MILLION}", flush=True)
        msql = "SELECT count(*) FROM m"
        for peer in peers:
            if peer == "xarray":
                continue
            out = tmp / f"million_{peer}"
            if peer == "zarrfusion":
                r = run_proc(zf_argv(zbin, MILLION, msql, table="m"), a.million_timeout, a.mem_limit_gb, out.with_suffix(".csv"))
                ans = None
                if r["rc"] == 0 and not r["killed"]:
                    ans = int(load_zf_csv(out.with_suffix(".csv"), "count")["count"][0])
                r["t_engine"], r["answer"] = r["wall"], ans
            else:
                argv = child_argv(peer, "count", MILLION, msql, out.with_suffix(".npz"), a, table="m")
                r = run_proc(argv, a.million_timeout, a.mem_limit_gb, out.with_suffix(".json"))
                c = last_json(out.with_suffix(".json"))
                r["child"] = c
                r["t_engine"] = c.get("t_total")
                ans = None
                if r["rc"] == 0 and not r["killed"]:
                    ans = int(np.load(out.with_suffix(".npz"))["count"][0])
                r["answer"] = ans
            million[peer] = r
            tdesc = f"> {a.million_timeout:.0f} s (killed: {r['killed']})" if r["killed"] else (
                f"{fmt_s(r['t_engine'])} s" if r["rc"] == 0 else f"FAILED rc={r['rc']}: {r['stderr'][-400:]}")
            print(f"  {peer:10s}: {tdesc}; process {fmt_s(r['wall'])} s, RSS {r['maxrss_mb']:.0f} MB, "
                  f"count = {r['answer']}", flush=True)

    stats = chunk_stats(a.t_lo, a.t_hi) if "Q2" in qids else None
    report = render(a, peers, qids, queries, results, checks, base, million, stats, notes, zbin, repeats)
    print("\n" + report)
    if not a.no_write:
        new = not RESULTS.exists()
        with open(RESULTS, "a") as f:
            if new:
                f.write("# Peer benchmark results (issue 2: Zarr stores as SQL tables)\n\n"
                        "Produced by `bench/bench_sql.py`; see bench/README.md for the method. "
                        "Each run appends a section.\n\n")
            f.write(report + "\n")
        print(f"appended to {RESULTS}")
    if a.keep_tmp:
        print(f"outputs kept in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def render(a, peers, qids, queries, results, checks, base, million, stats, notes, zbin, repeats) -> str:
    import psutil

    mem = psutil.virtual_memory().total / 2**30
    cpu = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import xarray
        import zarr
        import xarray_sql
        import datafusion
        vers = (f"xarray {xarray.__version__}, zarr {zarr.__version__}, xarray-sql {xarray_sql_version()}, "
                f"datafusion (python) {datafusion.__version__}")
    except Exception:  # noqa: BLE001
        vers = "?"
    cmd = " ".join(shlex.quote(x) for x in [".venv/bin/python", "bench/bench_sql.py"] + sys.argv[1:])
    L = []
    L.append(f"## Run {_dt.datetime.now().strftime('%Y-%m-%d %H:%M')}\n")
    L.append(f"- Command: `{cmd}` (ZARRFUSION_BIN={zbin})")
    L.append(f"- Machine: {os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, {platform.system()} {platform.release()}, "
             f"Python {platform.python_version()}; {vers}")
    L.append(f"- Store: `bench/data/era5_1gb.zarr` (Zarr v2, t2m{tuple(stats['shape']) if stats else ''} float32, "
             f"chunks {tuple(stats['chunks']) if stats else ''}, blosc lz4; "
             + (f"{stats['all_raw_bytes'] / 1e9:.3f} GB raw, {stats['all_disk_bytes'] / 1e9:.3f} GB on disk)" if stats else ")"))
    L.append(f"- Runs: each a fresh process; first run + best of {repeats} more. The store is in the page cache "
             "(the machine has far more RAM than the store), so `first` is not a cold-disk read.")
    L.append(f"- xarray-sql partitions: {'time=' + str(a.xsql_chunks) if a.xsql_chunks else 'the store chunks (1, 721, 1440) (its default)'}")
    comp = any(r.get("load_max", 0) > 1.5 for r in results.values())
    L.append(f"- 1-min load average during runs: up to {max((r.get('load_max', 0) for r in results.values()), default=0):.1f}"
             + (" (another process, e.g. a cargo build, was using CPU: times are inflated)" if comp else ""))
    for n in notes:
        L.append(f"- NOTE: {n}")
    L.append("")
    L.append("`engine s` = zarrfusion: the whole process (registration + query + CSV to stdout); "
             "python peers: open_zarr + registration + query + result in memory (interpreter start and imports excluded). "
             "`read MB` = rchar from /proc/<pid>/io (bytes returned by read syscalls): zarrfusion minus its `SELECT 1` "
             "baseline; python peers the rchar delta over the timed span. RSS = peak resident set of the process.\n")
    if qids:
        L.append("| query | peer | engine s (best) | engine s (first) | process s (best) | peak RSS MB | read MB | rows | vs zarrfusion | correct |")
        L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
        all_peers = ["zarrfusion"] + [p for p in peers if p != "zarrfusion"]
        for qid in qids:
            zf = results.get((qid, "zarrfusion"))
            for peer in all_peers:
                r = results.get((qid, peer))
                if r is None:
                    if peer == "zarrfusion":
                        L.append(f"| {qid} | zarrfusion | pending | pending | pending | pending | pending | | | binary not available |")
                    continue
                b, f = r["best"], r["first"]
                ratio = ""
                if peer != "zarrfusion" and zf and zf.get("best") and b:
                    ratio = f"{b['t_engine'] / zf['best']['t_engine']:.1f}x"
                elif peer == "zarrfusion":
                    ratio = "1.0x"
                ok = checks.get((qid, peer), "")
                if not r["ok"]:
                    ok = f"FAILED: {f['killed'] or 'rc=' + str(f['rc'])}"
                L.append(f"| {qid} | {peer} | {fmt_s(b['t_engine']) if b else '-'} | {fmt_s(f.get('t_engine'))} | "
                         f"{fmt_s(r['process_best'])} | {r['maxrss_mb']:.0f} | "
                         f"{(r['bytes'] / 1e6) if r['bytes'] is not None else float('nan'):.1f} | {r.get('rows', '')} | {ratio} | {ok} |")
        L.append("")
        L.append("Ratios are peer engine time / zarrfusion engine time (best runs); target: >= 5x vs xarray-sql on every query.\n")
        summ = []
        for qid in qids:
            zf = results.get((qid, "zarrfusion"))
            if not (zf and zf.get("best")):
                continue
            parts = []
            for peer in ("xarray-sql", "xarray"):
                r = results.get((qid, peer))
                if r and r.get("best"):
                    x = r["best"]["t_engine"] / zf["best"]["t_engine"]
                    parts.append(f"{x:.1f}x vs {peer}" + ((" (target met)" if x >= 5 else " (target NOT met)") if peer == "xarray-sql" else ""))
            if parts:
                summ.append(f"- {qid}: zarrfusion " + ", ".join(parts))
        if summ:
            L.append("Speed-ups (best runs):\n")
            L.extend(summ)
            L.append("")
        L.append("Queries:\n")
        for qid in qids:
            L.append(f"- {qid}: `{queries[qid]}`")
        L.append("")
    L.append("Startup baselines (process with no query): " + ", ".join(
        f"{p} {base[p]['wall']:.2f} s / {base[p]['rchar'] / 1e6:.1f} MB rchar / {base[p]['maxrss_mb']:.0f} MB RSS" for p in base) + "\n")
    if stats:
        s = stats
        ans = results.get(("Q2", "answer"))
        L.append(f"Q2 selectivity: the filter keeps {s['time_steps']} of {s['shape'][0]} time steps, {s['lat_vals']} lats, "
                 f"{s['lon_vals']} lons = {s['cells']:,} cells"
                 + (f" (answer: count {ans['count']:,}, avg {ans['avg']:.6f})" if ans else "") + ". "
                 f"Chunks are whole (lat, lon) fields, so the box cannot skip chunks; only the time filter does: "
                 f"{s['hit_chunks']} of {s['total_chunks']} chunks intersect (per dim {s['hit_per_dim']}), "
                 f"{s['hit_disk_bytes'] / 1e6:.1f} MB on disk of {s['all_disk_bytes'] / 1e6:.1f} MB "
                 f"({s['hit_raw_bytes'] / 1e6:.1f} MB decoded of {s['all_raw_bytes'] / 1e6:.1f} MB). "
                 "A reader that reads only intersecting chunks should show `read MB` near the on-disk figure for Q2.\n")
    if million or not a.skip_million:
        L.append("Million-chunk store (`bench/data/million_chunks.zarr`, v3, t2m (1000000, 4, 4) in chunks (1, 4, 4), "
                 "18 chunks written; `time` one chunk): registration + `SELECT count(*)` (expected 16,000,000).\n")
        L.append("| peer | time | process s | peak RSS MB | read MB | count | details |")
        L.append("|---|---:|---:|---:|---:|---:|---|")
        if "zarrfusion" not in million:
            L.append("| zarrfusion | pending | | | | | binary not available |")
        for peer, r in million.items():
            if r["killed"]:
                t = f"> {a.million_timeout:.0f} s" if "timeout" in r["killed"] else f"killed ({r['killed']})"
            elif r["rc"] != 0:
                t = f"failed (rc {r['rc']})"
            else:
                t = f"{fmt_s(r['t_engine'])} s"
            c = r.get("child") or {}
            det = ""
            if c:
                det = f"open_zarr {c.get('t_open', 0):.2f} s, from_dataset {c.get('t_register', 0):.2f} s, query {c['t_total'] - c.get('t_open', 0) - c.get('t_register', 0):.2f} s"
            elif r["rc"] != 0 and not r["killed"]:
                det = r["stderr"][-200:].replace("\n", " ").replace("|", "/")
            rb = r["rchar"] - base.get(peer, {}).get("rchar", 0) if r["rchar"] >= 0 else float("nan")
            L.append(f"| {peer} | {t} | {fmt_s(r['wall'])} | {r['maxrss_mb']:.0f} | {rb / 1e6:.1f} | {r['answer'] if r['answer'] is not None else '-'} | {det} |")
        L.append("")
    return "\n".join(L)


def xarray_sql_version() -> str:
    try:
        from importlib.metadata import version
        return version("xarray-sql")
    except Exception:  # noqa: BLE001
        return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="first run + 1 repeat instead of first + 3")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats after the first run (default 3)")
    ap.add_argument("--peers", default=",".join(PEERS), help="comma-separated subset of " + ",".join(PEERS))
    ap.add_argument("--queries", default="Q1,Q2,Q3", help="comma-separated subset of Q1,Q2,Q3")
    ap.add_argument("--skip-million", action="store_true", help="skip the million-chunk registration test")
    ap.add_argument("--timeout", type=float, default=900, help="per-run timeout in seconds (default 900)")
    ap.add_argument("--million-timeout", type=float, default=300, help="million-chunk test timeout (default 300)")
    ap.add_argument("--mem-limit-gb", type=float, default=12, help="kill a run whose RSS exceeds this (GiB)")
    ap.add_argument("--xsql-chunks", type=int, default=0, help="xarray-sql partition size along time (default: store chunks)")
    ap.add_argument("--keep-tmp", action="store_true", help="keep the per-run outputs (CSV/npz) in the temp folder")
    ap.add_argument("--no-write", action="store_true", help="do not append to bench/RESULTS.md")
    # child mode (internal)
    ap.add_argument("--child", nargs=2, metavar=("PEER", "QUERY"), help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--sql", help=argparse.SUPPRESS)
    ap.add_argument("--table", default="era5", help=argparse.SUPPRESS)
    ap.add_argument("--t-lo", help=argparse.SUPPRESS)
    ap.add_argument("--t-hi", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    return parent(a)


if __name__ == "__main__":
    sys.exit(main())

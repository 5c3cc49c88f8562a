#!/usr/bin/env python3
"""Object-store peer benchmark (issue 23, part 1): the three foundation queries of
bench_sql.py on the ERA5-like store served by a local S3 server with 0, 20 and 100 ms
added to every request, zarrfusion against xarray + zarr-python and xarray-sql reading
the same bucket.

    .venv/bin/pip install -r bench/requirements.txt && .venv/bin/pip install -r bench/requirements-s3.txt
    .venv/bin/python bench/make_era5.py                      # once: bench/data/era5_1gb.zarr
    .venv/bin/python bench/bench_s3.py --quick               # latencies 0,20,100; appends to RESULTS.md

    # a small store while developing (24 time steps, ~57 MB), printed only:
    .venv/bin/python bench/bench_s3.py --make-store bench/data/era5_small.zarr --nt 24
    .venv/bin/python bench/bench_s3.py --store bench/data/era5_small.zarr --latencies 0,20 --quick --no-write

The server is the tests' (tests/s3/s3_server.py): moto's S3 server on 127.0.0.1, in this
process, with the store uploaded to bucket ``bench`` under its directory name, and the
fault proxy in front of it, which adds the latency (``proxy.configure(latency_ms=...)``)
and counts requests, bytes and the most requests in flight. Every peer reads through the
proxy. ``--s3-server s3s`` serves the store with s3s-fs instead (Rust, its own process:
moto spends ~12 ms of CPU per GET on the same two cores, which bounds every peer at low
latency). Every measurement is a fresh subprocess on the same cores:

* zarrfusion: ``$ZARRFUSION_BIN`` (default ~/.cache/zarrfusion-target/debug/zarrfusion)
  ``-q --format csv -c "CREATE EXTERNAL TABLE era5 STORED AS ZARR LOCATION 's3://bench/<store>'
  OPTIONS ('aws.endpoint' '<proxy>', 'aws.allow_http' 'true', credentials, region)" -c "<query>"``,
  default io_concurrency (64); skipped with a message when the binary does not exist.
* xarray-obstore: ``xr.open_zarr(zarr.storage.ObjectStore(obstore.store.S3Store(...)), chunks=None)``
  and the xarray/numpy computation of bench_sql.py (``bench_sql.xarray_answer``).
* xarray-s3fs: the same on ``zarr.storage.FsspecStore.from_url("s3://bench/<store>", storage_options=...)``
  (s3fs / aiobotocore).
* xarray-sql: ``xarray_sql.Context().from_dataset("era5", ds)`` on the dataset opened as for
  xarray-obstore (``--xsql-via s3fs`` for the other), ``ctx.sql(q).to_arrow_table()``.

Both zarr-python stores run at zarr's default ``async.concurrency`` (10 chunk reads in flight).
Python children time store construction + open_zarr + query + answer in memory (imports
excluded, as in bench_sql.py); zarrfusion's time is its whole process. Peak RSS is the
child's VmHWM (not ``ru_maxrss``, which here includes this process's RSS: see run_proc); requests, bytes and the most in flight come from the proxy,
reset before each run; "MB needed" is the on-disk size of the chunks that intersect the
query. Answers are checked against xarray on the local store (bench_sql.compare). A
physical-limit line times one GET of every chunk object through the proxy, 64 at once
(obstore), at each latency, and one at a time at 0 ms (the server's own cost per GET).

Parts 2 and 3 of the issue (the window loader, Quadratic Means under allowed_mem) are
bench_s3_loader.py and bench_s3_quadratic.py, on this module's Server and run_proc.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import resource
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
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests" / "s3"))
import bench_sql as bs  # noqa: E402  (queries, xarray equivalents, compare, run_proc)
import s3_server  # noqa: E402

ERA5 = HERE / "data" / "era5_1gb.zarr"
RESULTS = HERE / "RESULTS.md"
README = HERE / "README.md"
DEFAULT_BIN = Path.home() / ".cache" / "zarrfusion-target" / "debug" / "zarrfusion"
PEERS = ["zarrfusion", "xarray-obstore", "xarray-s3fs", "xarray-sql"]
BUCKET = "bench"


# ======================================================================================
# child side
# ======================================================================================

def open_store(via: str, conn: dict):
    """A zarr-python store of the bucket through the proxy (``via`` obstore or s3fs), or a local path."""
    import zarr

    if via == "obstore":
        from obstore.store import S3Store

        s3 = S3Store(conn["bucket"], prefix=conn["prefix"], endpoint=conn["endpoint"],
                     access_key_id=conn["key"], secret_access_key=conn["secret"], region=conn["region"],
                     client_options={"allow_http": True})
        return zarr.storage.ObjectStore(s3, read_only=True)
    if via == "s3fs":
        options = {"key": conn["key"], "secret": conn["secret"], "endpoint_url": conn["endpoint"],
                   "client_kwargs": {"region_name": conn["region"]}}
        return zarr.storage.FsspecStore.from_url(f"s3://{conn['bucket']}/{conn['prefix']}",
                                                 storage_options=options, read_only=True)
    if via == "local":
        return conn["path"]
    raise SystemExit(f"unknown store kind {via}")


def child(a) -> int:
    """One peer, one query (or the physical-limit GETs) in this process; prints one JSON line."""
    import numpy as np
    import xarray as xr
    import zarr  # noqa: F401

    peer, what = a.child
    conn = json.loads(a.conn)
    if peer == "limit":
        return child_limit(conn, int(what))
    if peer == "xarray-sql":
        import xarray_sql as xql
        via = a.xsql_via
    else:
        via = {"xarray-obstore": "obstore", "xarray-s3fs": "s3fs", "xarray-local": "local"}[peer]
    if via == "obstore":
        import obstore  # noqa: F401
    elif via == "s3fs":
        import s3fs  # noqa: F401

    t0 = time.perf_counter()
    ds = xr.open_zarr(open_store(via, conn), chunks=None)
    t_open = time.perf_counter() - t0
    if peer == "xarray-sql":
        ctx = xql.Context()
        ctx.from_dataset("era5", ds)
        res = bs.arrow_answer(ctx.sql(a.sql).to_arrow_table(), what)
    else:
        res = bs.xarray_answer(ds, what, a.t_lo, a.t_hi)
    t_total = time.perf_counter() - t0
    np.savez(a.out, **{k: np.asarray(v) for k, v in res.items()})
    print(json.dumps({"t_open": t_open, "t_total": t_total, "vmhwm_kb": vmhwm_kb()}))
    return quit_now()


def vmhwm_kb() -> int:
    """This process's peak RSS since exec (kB)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def quit_now() -> int:
    """Leaves without interpreter shutdown: obstore 0.12.1's runtime sometimes aborts the
    process (SIGABRT) while Python tears it down, after the work and its output are done."""
    sys.stdout.flush()
    os._exit(0)


def child_limit(conn: dict, concurrency: int) -> int:
    """GETs every key of ``conn["keys"]`` (whole objects) through obstore, ``concurrency`` at once."""
    import obstore
    from obstore.store import S3Store

    store = S3Store(conn["bucket"], prefix=conn["prefix"], endpoint=conn["endpoint"],
                    access_key_id=conn["key"], secret_access_key=conn["secret"], region=conn["region"],
                    client_options={"allow_http": True})

    async def run() -> int:
        sem = asyncio.Semaphore(concurrency)

        async def one(key: str) -> int:
            async with sem:
                return len(await (await obstore.get_async(store, key)).bytes_async())

        return sum(await asyncio.gather(*(one(k) for k in conn["keys"])))

    t0 = time.perf_counter()
    nbytes = asyncio.run(run())
    print(json.dumps({"t_total": time.perf_counter() - t0, "bytes": nbytes}))
    return quit_now()


# ======================================================================================
# parent side
# ======================================================================================

def store_layout(store: Path, t_lo: str, t_hi: str) -> dict:
    """Chunk keys of t2m and the on-disk bytes each query needs (chunks intersecting it)."""
    import numpy as np
    import xarray as xr

    meta = json.loads((store / "t2m" / ".zarray").read_text())  # Zarr v2, as make_era5.py writes
    sep = meta.get("dimension_separator", ".")
    chunks = meta["chunks"]
    ds = xr.open_zarr(store, chunks=None)
    tv = ds["time"].values
    masks = {
        "Q2": [(tv >= np.datetime64(t_lo, "ns")) & (tv < np.datetime64(t_hi, "ns")),
               (ds["lat"].values >= 30) & (ds["lat"].values <= 60),
               (ds["lon"].values >= 0) & (ds["lon"].values <= 40)],
    }
    keys = sorted(p.name for p in (store / "t2m").iterdir() if p.name[0].isdigit())
    size = {k: (store / "t2m" / k).stat().st_size for k in keys}
    out = {"keys": [f"t2m/{k}" for k in keys], "chunks": chunks, "shape": meta["shape"],
           "all_bytes": sum(size.values()),
           "other_bytes": sum(p.stat().st_size for p in store.rglob("*") if p.is_file()) - sum(size.values())}
    need = {"Q1": out["all_bytes"], "Q3": out["all_bytes"]}
    touched = [set((np.flatnonzero(m) // c).tolist()) for m, c in zip(masks["Q2"], chunks)]
    need["Q2"] = sum(s for k, s in size.items()
                     if all(int(i) in t for i, t in zip(k.split(sep), touched)))
    out["need"] = need
    out["q2_chunks"] = sum(1 for k in keys if all(int(i) in t for i, t in zip(k.split(sep), touched)))
    return out


def run_proc(argv: list[str], timeout: float, mem_limit_gb: float, stdout_path: Path) -> dict:
    """bench_sql.run_proc with the peak RSS taken from the child's VmHWM instead of ``ru_maxrss``.

    ``ru_maxrss`` from ``wait4`` is at least the parent's RSS here: Python starts children
    with vfork, and at exec Linux records the high-water mark of the (shared, parent's)
    address space in the child's maxrss; this parent holds moto's copy of the store (~0.7 GB
    for era5_1gb), so every child would show >= that. VmHWM in /proc/<pid>/status is the
    high-water mark of the child's own address space after exec; a thread reads it every
    10 ms (once /proc/<pid>/cmdline is the child's argv, i.e. after exec) and kills the run
    past ``timeout`` or ``mem_limit_gb`` of RSS."""
    want = "\0".join(argv)
    peak = {"kb": 0}
    killed = {"why": None}
    with open(stdout_path, "wb") as out, tempfile.TemporaryFile() as err:
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        p = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
        done = threading.Event()

        def watch():
            while not done.is_set():
                try:
                    if open(f"/proc/{p.pid}/cmdline").read().rstrip("\0") == want:
                        status = dict(l.split(":", 1) for l in open(f"/proc/{p.pid}/status") if ":" in l)
                        if "VmHWM" in status:
                            peak["kb"] = max(peak["kb"], int(status["VmHWM"].split()[0]))
                        if mem_limit_gb and int(status.get("VmRSS", "0 kB").split()[0]) > mem_limit_gb * 2**20:
                            killed["why"] = f"RSS > {mem_limit_gb:g} GiB"
                except (OSError, ValueError):
                    pass
                if time.perf_counter() - t0 > timeout:
                    killed["why"] = f"timeout > {timeout:.0f} s"
                if killed["why"]:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    return
                done.wait(0.01)

        th = threading.Thread(target=watch, daemon=True)
        th.start()
        os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
        wall = time.perf_counter() - t0
        done.set()
        th.join()
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    return {"wall": wall, "maxrss_mb": peak["kb"] / 1024, "cpu_s": ru.ru_utime + ru.ru_stime, "rc": p.returncode,
            "killed": killed["why"], "stderr": stderr[-2000:], "load1": load, "stdout_path": str(stdout_path)}


class Server:
    """The S3 server + proxy, and the CPU time they spend: this process's (the proxy, and
    moto's server when ``backend`` is ``"moto"``) plus the s3s-fs process's for ``"s3s"``."""

    def __init__(self, store: Path, backend: str = "moto"):
        self.name = store.name
        self.backend = backend
        t0 = time.perf_counter()
        self.s3 = s3_server.start({self.name: store}, bucket=BUCKET, backend=backend)
        self.upload_s = time.perf_counter() - t0
        self.proxy = self.s3.proxy
        self.conn = {"bucket": BUCKET, "prefix": self.name, "endpoint": self.s3.proxy_endpoint,
                     "key": s3_server.ACCESS_KEY, "secret": s3_server.SECRET_KEY, "region": s3_server.REGION}

    def measure(self, argv: list[str], timeout: float, mem_limit_gb: float, stdout: Path) -> dict:
        """Runs one measurement (run_proc) with the proxy's counts and the server's CPU time."""
        self.settle()
        self.proxy.reset()
        with self.proxy._lock:  # the per-path GET counts (the proxy keeps them for its faults)
            self.proxy.seen = {}
        cpu0 = self.cpu_s()
        r = run_proc(argv, timeout, mem_limit_gb, stdout)
        r["server_cpu_s"] = self.cpu_s() - cpu0
        self.settle()
        r["proxy"] = self.proxy.stats()
        with self.proxy._lock:
            r["proxy"]["get_objects"] = len(self.proxy.seen)  # distinct paths GET asked for
        r["ok"] = r["rc"] == 0 and not r["killed"]
        return r

    def cpu_s(self) -> float:
        """CPU seconds spent so far by the server and the proxy."""
        ru = resource.getrusage(resource.RUSAGE_SELF)
        total = ru.ru_utime + ru.ru_stime
        if self.s3._s3s is not None:
            import psutil

            t = psutil.Process(self.s3._s3s.pid).cpu_times()
            total += t.user + t.system
        return total

    def settle(self, wait: float = 5.0) -> None:
        """Waits until the proxy has finished every request of the previous run (a client may
        exit before the proxy's thread counts the bytes it sent), so a reset starts from zero."""
        end = time.monotonic() + wait
        time.sleep(0.05)
        while getattr(self.proxy, "_in_flight", 0) and time.monotonic() < end:
            time.sleep(0.05)


def child_argv(peer: str, what: str, conn: dict, a, sql: str = "", out: Path | None = None) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", peer, what, "--conn", json.dumps(conn),
            "--sql", sql, "--t-lo", a.t_lo, "--t-hi", a.t_hi, "--xsql-via", a.xsql_via]
    return argv + (["--out", str(out)] if out else [])


def zf_argv(zbin: str, server: Server, sql: str) -> list[str]:
    options = ", ".join(f"'{k}' '{v}'" for k, v in server.s3.options().items())
    create = (f"CREATE EXTERNAL TABLE era5 STORED AS ZARR LOCATION 's3://{BUCKET}/{server.name}' "
              f"OPTIONS ({options})")
    return [zbin, "-q", "--format", "csv", "-c", create, "-c", sql]


def check_peers(peers: list[str], zbin: str, xsql_via: str) -> tuple[list[str], list[str]]:
    """Drops the peers that cannot run here, with a note saying why."""
    notes, keep = [], []
    for peer in peers:
        why = None
        if peer == "zarrfusion":
            if not (os.path.isfile(zbin) and os.access(zbin, os.X_OK)):
                why = f"zarrfusion binary not found at {zbin} (set ZARRFUSION_BIN or run scripts/test): skipped"
        else:
            mod = {"xarray-obstore": "obstore", "xarray-s3fs": "s3fs",
                   "xarray-sql": f"xarray_sql, {'obstore' if xsql_via == 'obstore' else 's3fs'}"}[peer]
            rc = subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True, text=True)
            if rc.returncode != 0:
                why = f"{peer}: `import {mod}` failed ({rc.stderr.strip().splitlines()[-1]}): skipped"
        if why:
            print("NOTE: " + why, flush=True)
            notes.append(why)
        else:
            keep.append(peer)
    return keep, notes


def load_answer(peer: str, qid: str, r: dict):
    import numpy as np

    if peer == "zarrfusion":
        return bs.load_zf_csv(Path(r["stdout_path"]), qid)
    z = np.load(r["npz"])
    return {k: z[k] for k in z.files}


def parent(a) -> int:
    import numpy as np
    import xarray as xr

    store = Path(a.store).resolve()
    if not (store / ".zmetadata").exists():
        print(f"missing store {store}: run .venv/bin/python bench/make_era5.py first", file=sys.stderr)
        return 2
    zbin = os.environ.get("ZARRFUSION_BIN", str(DEFAULT_BIN))
    peers, notes = check_peers([p.strip() for p in a.peers.split(",") if p.strip()], zbin, a.xsql_via)
    qids = [q.strip() for q in a.queries.split(",") if q.strip()]
    latencies = [float(x) for x in a.latencies.split(",")]
    repeats = 1 if a.quick else a.repeat
    tv = xr.open_zarr(store, chunks=None)["time"].values
    fmt = lambda t: str(np.datetime_as_string(t, unit="s")).replace("T", " ")  # noqa: E731
    a.t_lo, a.t_hi = fmt(tv[tv.size // 4]), fmt(tv[tv.size // 2])  # as bench_sql.py
    queries = bs.sql_queries(a.t_lo, a.t_hi)
    layout = store_layout(store, a.t_lo, a.t_hi)
    tmp = Path(tempfile.mkdtemp(prefix="zf_bench_s3_"))
    load0 = os.getloadavg()
    print(f"store {store}: t2m{tuple(layout['shape'])} chunks {tuple(layout['chunks'])}, "
          f"{len(layout['keys'])} chunk objects, {layout['all_bytes'] / 1e6:.1f} MB; Q2 window [{a.t_lo}, {a.t_hi})", flush=True)
    print(f"peers: {', '.join(peers)}; latencies {a.latencies} ms; first + best of {repeats}; tmp {tmp}", flush=True)

    # ---- reference answers: xarray on the local store ----
    refs, ref_times = {}, {}
    for qid in qids:
        out = tmp / f"ref_{qid}.npz"
        r = run_proc(child_argv("xarray-local", qid, {"path": str(store)}, a, queries[qid], out),
                        a.timeout, a.mem_limit_gb, tmp / f"ref_{qid}.json")
        if r["rc"] != 0 or r["killed"]:
            print(f"reference {qid} failed: {r['killed'] or r['stderr'][-400:]}", file=sys.stderr)
            return 1
        z = np.load(out)
        refs[qid] = {k: z[k] for k in z.files}
        ref_times[qid] = bs.last_json(tmp / f"ref_{qid}.json").get("t_total")
        print(f"reference {qid} (xarray, local store): {ref_times[qid]:.2f} s", flush=True)

    print("starting the S3 server and uploading ...", flush=True)
    server = Server(store, a.s3_server)
    print(f"  {server.s3.endpoint} behind proxy {server.s3.proxy_endpoint}; upload {server.upload_s:.1f} s", flush=True)
    limit_conn = dict(server.conn, keys=layout["keys"])
    results: dict[tuple, dict] = {}
    limits: dict[tuple, dict] = {}
    try:
        for lat in latencies:
            server.proxy.configure(latency_ms=lat)
            # ---- physical limit: every chunk object, 64 GETs at once (and one at a time at 0 ms) ----
            for conc in ([a.limit_concurrency] + ([1] if lat == 0 else [])):
                runs = [server.measure(child_argv("limit", str(conc), limit_conn, a), a.timeout, a.mem_limit_gb,
                                       tmp / f"limit_{lat:g}_{conc}_{i}.json") for i in range(1 + repeats)]
                for r in runs:
                    r["t"] = bs.last_json(Path(r["stdout_path"])).get("t_total") if r["ok"] else None
                good = [r for r in runs if r["t"] is not None]
                best = min(good, key=lambda r: r["t"]) if good else runs[0]
                limits[(lat, conc)] = best
                print(f"{lat:g} ms: GET all {len(layout['keys'])} chunks, {conc} at once: "
                      f"{bs.fmt_s(best['t'])} s, {best['proxy']['bytes'] / 1e6:.1f} MB, most in flight "
                      f"{best['proxy']['max_in_flight']}, server CPU {best['server_cpu_s']:.1f} s"
                      + ("" if best["ok"] else f" FAILED {best['killed'] or best['stderr'][-300:]}"), flush=True)
            for qid in qids:
                sql = queries[qid]
                for peer in peers:
                    runs = []
                    if peer == "zarrfusion":
                        # Its opening cache starts empty for each query and latency: the
                        # first run opens cold (two round trips), the repeats warm (one,
                        # every object revalidated with a conditional request).
                        os.environ["ZARRFUSION_CACHE_DIR"] = str(tmp / f"zf_cache_{qid}_{lat:g}")
                    for i in range(1 + repeats):
                        out = tmp / f"{qid}_{lat:g}_{peer}_{i}"
                        if peer == "zarrfusion":
                            r = server.measure(zf_argv(zbin, server, sql), a.timeout, a.mem_limit_gb, out.with_suffix(".csv"))
                            r["t"] = r["wall"]
                        else:
                            r = server.measure(child_argv(peer, qid, server.conn, a, sql, out.with_suffix(".npz")),
                                               a.timeout, a.mem_limit_gb, out.with_suffix(".json"))
                            r["npz"] = str(out.with_suffix(".npz"))
                            c = bs.last_json(out.with_suffix(".json")) if r["ok"] else {}
                            r["t"] = c.get("t_total")
                            r["maxrss_mb"] = max(r["maxrss_mb"], c.get("vmhwm_kb", 0) / 1024)
                        runs.append(r)
                        p = r["proxy"]
                        status = "ok" if r["ok"] else f"FAILED rc={r['rc']} {r['killed'] or ''} {r['stderr'][-400:]}"
                        print(f"{qid} {lat:>5g} ms {peer:14s} run {i}: {bs.fmt_s(r['t'])} s (process {bs.fmt_s(r['wall'])}), "
                              f"RSS {r['maxrss_mb']:.0f} MB, GET {p['methods'].get('GET', 0)}, {p['bytes'] / 1e6:.1f} MB, "
                              f"in flight {p['max_in_flight']}, server CPU {r['server_cpu_s']:.1f} s, "
                              f"load {r['load1']:.1f}: {status}", flush=True)
                        if not r["ok"]:
                            break
                    good = [r for r in runs if r["ok"]]
                    best = min(good[1:] or good, key=lambda r: r["t"]) if good else None
                    check = "n/a"
                    if good:
                        try:
                            check = bs.compare(qid, refs[qid], load_answer(peer, qid, good[-1]))
                        except Exception as e:  # noqa: BLE001
                            check = f"could not load the answer: {e}"
                    results[(qid, lat, peer)] = {"first": runs[0], "best": best, "ok": len(good) == len(runs),
                                                 "maxrss_mb": max(r["maxrss_mb"] for r in runs),
                                                 "load_max": max(r["load1"] for r in runs), "check": check}
                    print(f"  -> {check}", flush=True)
                    for f in tmp.glob(f"{qid}_{lat:g}_{peer}_*"):
                        f.unlink()
    finally:
        server.s3.stop()
    load1 = os.getloadavg()
    report = render(a, store, peers, qids, latencies, queries, results, limits, layout, notes, zbin, repeats,
                    ref_times, server, (load0, load1))
    print("\n" + report)
    if not a.no_write:
        with open(RESULTS, "a") as f:
            f.write("\n" + report + "\n")
        print(f"appended to {RESULTS}")
    if a.keep_tmp:
        print(f"outputs kept in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def versions() -> str:
    from importlib.metadata import version

    names = ["xarray", "zarr", "numpy", "xarray-sql", "datafusion", "obstore", "s3fs", "fsspec",
             "aiobotocore", "botocore", "moto", "Werkzeug"]
    out = []
    for n in names:
        try:
            out.append(f"{n} {version(n)}")
        except Exception:  # noqa: BLE001
            out.append(f"{n} ?")
    return ", ".join(out)


def render(a, store, peers, qids, latencies, queries, results, limits, layout, notes, zbin, repeats,
           ref_times, server, loads) -> str:
    import psutil

    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    mem = psutil.virtual_memory().total / 2**30
    env = [f"ZARRFUSION_BIN={shlex.quote(os.environ['ZARRFUSION_BIN'])}"] if "ZARRFUSION_BIN" in os.environ else []
    cmd = " ".join(env + [shlex.quote(x) for x in [".venv/bin/python", "bench/bench_s3.py"] + sys.argv[1:]])
    load_max = max((r["load_max"] for r in results.values()), default=0.0)
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        head = "?"
    zinfo = "not run"
    if "zarrfusion" in peers:
        zinfo = f"`{zbin}` (built {_dt.datetime.fromtimestamp(os.path.getmtime(zbin)).strftime('%Y-%m-%d %H:%M')}, tree at {head} + uncommitted work)"
    mb = lambda b: f"{b / 1e6:.1f}"  # noqa: E731
    L = [f"## Object-store benchmark, {_dt.datetime.now().strftime('%Y-%m-%d %H:%M')} (issue 23)\n"]
    L.append(f"- Command: `{cmd}`")
    L.append(f"- Machine: {os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, {platform.system()} {platform.release()}, "
             f"Python {platform.python_version()}. Load average (1/5/15 min) {loads[0][0]:.2f}/{loads[0][1]:.2f}/{loads[0][2]:.2f} "
             f"at the start, {loads[1][0]:.2f}/{loads[1][1]:.2f}/{loads[1][2]:.2f} at the end, 1-min up to {load_max:.1f} "
             "during the runs (sampled at each run's start).")
    L.append(f"- Versions: {versions()}. zarrfusion: {zinfo}.")
    L.append(f"- Store: `{os.path.relpath(store, ROOT)}` (Zarr v2, t2m{tuple(layout['shape'])} float32, chunks "
             f"{tuple(layout['chunks'])}, blosc lz4): {len(layout['keys'])} chunk objects, {mb(layout['all_bytes'])} MB, "
             f"plus {layout['other_bytes'] / 1e3:.0f} kB of metadata and coordinates; uploaded to "
             + ("moto's S3 server (in the benchmark's own process)" if server.backend == "moto"
                else "s3s-fs (a Rust S3 server, its own process, serving hard links of the store's files)")
             + f" in {server.upload_s:.0f} s. Every peer reads through the fault "
             "proxy, which adds the latency to every request before forwarding it.")
    L.append(f"- Runs: each a fresh process; first run + best of {repeats} more. Python peers: store construction + "
             "open_zarr + query + answer in memory (imports excluded); zarrfusion: the whole process. Proxy counts "
             "and server CPU are those of the best run.")
    for n in notes:
        L.append(f"- NOTE: {n}")
    L.append("")

    L.append("Physical limit: one GET of every chunk object through the proxy with obstore (Rust client), "
             "whole objects, wall time of the GETs:\n")
    L.append("| latency ms | GETs at once | s | MB | most in flight | server CPU s |")
    L.append("|---:|---:|---:|---:|---:|---:|")
    for (lat, conc), r in limits.items():
        L.append(f"| {lat:g} | {conc} | {bs.fmt_s(r['t'])} | {mb(r['proxy']['bytes'])} | "
                 f"{r['proxy']['max_in_flight']} | {r['server_cpu_s']:.1f} |")
    seq = limits.get((0.0, 1))
    if seq and seq.get("t"):
        L.append(f"\nOne at a time at 0 ms the server takes {seq['t'] / len(layout['keys']) * 1e3:.1f} ms per chunk GET "
                 f"({len(layout['keys'])} GETs of ~{layout['all_bytes'] / len(layout['keys']) / 1e6:.1f} MB): moto "
                 "and the proxy are Python in one process, so they bound every peer's throughput.")
    L.append("")

    L.append("| query | latency ms | peer | best s | first s | process s | vs zarrfusion | peak RSS MB | GET | HEAD/LIST | MB fetched | MB needed | most in flight | faults | server CPU s | correct |")
    L.append("|---|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|")
    for qid in qids:
        for lat in latencies:
            zf = results.get((qid, lat, "zarrfusion"))
            for peer in (["zarrfusion"] if "zarrfusion" not in peers else []) + peers:
                r = results.get((qid, lat, peer))
                if r is None:
                    L.append(f"| {qid} | {lat:g} | {peer} | pending | | | | | | | | {mb(layout['need'][qid])} | | | | binary not available |")
                    continue
                b, f = r["best"], r["first"]
                src = b or f
                p = src["proxy"]
                ratio = ""
                if peer == "zarrfusion":
                    ratio = "1.0x" if b else ""
                elif b and zf and zf.get("best"):
                    ratio = f"{b['t'] / zf['best']['t']:.1f}x"
                faults = sum(p["faults"].values())
                check = r["check"] if r["ok"] else f"FAILED: {f['killed'] or 'rc=' + str(f['rc'])}"
                L.append(f"| {qid} | {lat:g} | {peer} | {bs.fmt_s(b['t']) if b else '-'} | {bs.fmt_s(f['t'])} | "
                         f"{bs.fmt_s(src['wall'])} | {ratio} | {r['maxrss_mb']:.0f} | {p['methods'].get('GET', 0)} | "
                         f"{p['methods'].get('HEAD', 0)}/{p['lists']} | {mb(p['bytes'])} | {mb(layout['need'][qid])} | "
                         f"{p['max_in_flight']} | {faults} | {src['server_cpu_s']:.1f} | {check} |")
    L.append("")
    L.append("`vs zarrfusion` = peer best / zarrfusion best at the same latency (above 1.0x: zarrfusion is faster). "
             "`MB needed` = on-disk size of the t2m chunks that intersect the query (Q2: the "
             f"{layout['q2_chunks']} chunks of its time window); metadata and coordinates come on top.\n")

    L.append("Latency sensitivity (best s; target of issue 23: zarrfusion at 100 ms within 1.5x of 0 ms):\n")
    L.append("| query | peer | " + " | ".join(f"{lat:g} ms" for lat in latencies) + " | 100 ms / 0 ms |")
    L.append("|---|---|" + "---:|" * len(latencies) + "---:|")
    for qid in qids:
        for peer in peers:
            bests = [(results.get((qid, lat, peer)) or {}).get("best") for lat in latencies]
            cells = [bs.fmt_s(b["t"]) if b else "-" for b in bests]
            b0 = (results.get((qid, 0.0, peer)) or {}).get("best")
            b100 = (results.get((qid, 100.0, peer)) or {}).get("best")
            ratio = f"{b100['t'] / b0['t']:.2f}x" if b0 and b100 else "-"
            if peer == "zarrfusion" and b0 and b100:
                ratio += " (met)" if b100["t"] <= 1.5 * b0["t"] else " (NOT met)"
            L.append(f"| {qid} | {peer} | " + " | ".join(cells) + f" | {ratio} |")
    L.append("")
    L.append("Reference (xarray on the local store, for the correctness check): "
             + ", ".join(f"{q} {bs.fmt_s(t)} s" for q, t in ref_times.items()) + ".\n")
    L.append("Queries:\n")
    for qid in qids:
        L.append(f"- {qid}: `{queries[qid]}`")
    L.append("")
    return "\n".join(L)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=str(ERA5), help="local store to upload and query (default bench/data/era5_1gb.zarr)")
    ap.add_argument("--latencies", default="0,20,100", help="added latency per request, ms (default 0,20,100)")
    ap.add_argument("--repeat", type=int, default=2, help="timed repeats after the first run (default 2)")
    ap.add_argument("--quick", action="store_true", help="first run + 1 repeat")
    ap.add_argument("--peers", default=",".join(PEERS), help="comma-separated subset of " + ",".join(PEERS))
    ap.add_argument("--queries", default="Q1,Q2,Q3", help="comma-separated subset of Q1,Q2,Q3")
    ap.add_argument("--s3-server", choices=("moto", "s3s"), default="moto",
                    help="the S3 server: moto (Python, in this process) or s3s-fs (Rust; ZARRFUSION_S3S_FS or PATH)")
    ap.add_argument("--xsql-via", default="obstore", choices=["obstore", "s3fs"], help="xarray-sql's zarr store")
    ap.add_argument("--limit-concurrency", type=int, default=64, help="GETs at once for the physical-limit line")
    ap.add_argument("--timeout", type=float, default=900, help="per-run timeout in seconds (default 900)")
    ap.add_argument("--mem-limit-gb", type=float, default=12, help="kill a run whose RSS exceeds this (GiB)")
    ap.add_argument("--keep-tmp", action="store_true", help="keep the per-run outputs")
    ap.add_argument("--no-write", action="store_true", help="print only; do not append to bench/RESULTS.md")
    ap.add_argument("--make-store", metavar="PATH", help="write an ERA5-like store of --nt time steps to PATH and exit")
    ap.add_argument("--nt", type=int, default=24, help="time steps for --make-store (default 24: ~57 MB)")
    # child mode (internal)
    ap.add_argument("--child", nargs=2, metavar=("PEER", "QUERY"), help=argparse.SUPPRESS)
    ap.add_argument("--conn", help=argparse.SUPPRESS)
    ap.add_argument("--sql", default="", help=argparse.SUPPRESS)
    ap.add_argument("--t-lo", help=argparse.SUPPRESS)
    ap.add_argument("--t-hi", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    if a.make_store:
        import make_era5

        make_era5.make_era5(a.nt, path=Path(a.make_store).resolve())
        return 0
    return parent(a)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Object-store benchmark, part 3 (issue 23): Quadratic Means (bench_quadratic.py) with its
source in the local S3 server's bucket, behind the latency proxy of bench_s3.py, at 0, 20
and 100 ms added to every request, under allowed_mem 2 GB.

    .venv/bin/python bench/bench_quadratic.py --make              # once: bench/data/quad.zarr (T=200: 6.1 GB)
    .venv/bin/python bench/bench_s3_quadratic.py                  # latencies 0,20,100; appends to RESULTS.md

    # while developing (T=20, 0.6 GB; printed only):
    .venv/bin/python bench/bench_quadratic.py --make --store bench/data/quad_dev.zarr --t 20
    .venv/bin/python bench/bench_s3_quadratic.py --store bench/data/quad_dev.zarr --latencies 0,100 --no-write

Arms, each a fresh subprocess per latency (imports, and 0.5 s for their side effects to
settle, excluded from the time, as bench_quadratic.py):

* zarrfusion: ``SessionContext(allowed_mem=..., work_dir=...)``,
  ``register_zarr("quad", "s3://bench/quad.zarr", **options)`` (the proxy's endpoint and
  credentials), bench_quadratic.SQL, ``to_xarray()``; default io_concurrency (64);
* dask: ``da.from_zarr`` of the arrays opened on ``zarr.storage.ObjectStore`` (obstore)
  over the same bucket, the three means computed together (threads).

bench_quadratic.py's other peers are not run here: numpy holds u and v whole (12 GB for
T=200, 6x the budget) and cubed was not installed in the bench venv.

Peak RSS is the child's VmHWM (bench_s3.run_proc); what allowed_mem bounds is the part of it
above the child's VmRSS after its imports (the interpreter, numpy, xarray, the extension's
code), reported beside it; GETs, bytes,
distinct objects and the most requests in flight come from the proxy. Answers are checked
against the means computed in this process from the local store, one time chunk at a time
(relative 1e-9).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import bench_quadratic as bq  # noqa: E402  (SQL, result names)
import bench_s3 as b3  # noqa: E402  (S3 server + proxy, VmHWM run_proc, stores)
import bench_s3_loader as b3l  # noqa: E402  (report helpers: machine, command)
from measure import parse_mem  # noqa: E402

ARMS = ["zarrfusion", "dask"]
RESULTS = HERE / "RESULTS.md"


def child(a) -> int:
    import numpy as np

    arm = a.child
    conn = json.loads(a.conn)
    if arm == "zarrfusion":
        import xarray
        import zarrfusion as zf

        xarray.Dataset({"x": ("d", np.zeros(1))})  # xarray's lazy imports, as bench_quadratic.py
    elif arm == "dask":
        import dask
        import dask.array as da
        import obstore  # noqa: F401
        import zarr
    else:
        raise SystemExit(f"unknown arm {arm}")
    time.sleep(0.5)
    start_kb = vmrss_kb()
    anon = AnonSampler()
    t0 = time.perf_counter()
    if arm == "zarrfusion":
        ctx = zf.SessionContext(allowed_mem=a.allowed_mem, work_dir=a.work_dir)
        ctx.register_zarr("quad", f"s3://{conn['bucket']}/{conn['prefix']}", **conn["options"])
        from zarrfusion.grid import table_to_xarray

        # The query's answer (Arrow), then the grids rebuilt from it in
        # Python: allowed_mem bounds the first; the second is the
        # interpreter's copy of the answer.
        table = ctx.sql(bq.SQL).to_arrow_table()
        query_kb, query_anon_kb = b3.vmhwm_kb(), anon.stop()
        grids = table_to_xarray(table, ctx._raw._zarr_columns(), None)
        means = [grids[name].values for name in bq.NAMES]
    else:
        group = zarr.open_group(b3.open_store("obstore", conn), mode="r")
        with dask.config.set(scheduler="threads", num_workers=a.threads):
            u, v = da.from_zarr(group["u"]), da.from_zarr(group["v"])
            means = [m[0] for m in dask.compute((u * u).mean(axis=0), (v * v).mean(axis=0), (u * v).mean(axis=0))]
        query_kb, query_anon_kb = b3.vmhwm_kb(), anon.stop()
    t = time.perf_counter() - t0
    np.save(a.out, np.stack(means))
    print(json.dumps({"seconds": t, "vmhwm_kb": b3.vmhwm_kb(), "query_kb": query_kb,
                      "start_kb": start_kb, "query_anon_kb": query_anon_kb, "start_anon_kb": anon.start_kb}))
    return b3.quit_now()


class AnonSampler:
    """The peak of this process's anonymous resident memory (RssAnon: the heap
    and stacks, not the pages of code and files mapped in), sampled every 2 ms
    from a thread until stopped. VmHWM counts the pages of the extension's code
    that the query runs for the first time too; allowed_mem bounds the data."""

    def __init__(self) -> None:
        self.start_kb = self.peak_kb = status_kb("RssAnon")
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(0.002):
            self.peak_kb = max(self.peak_kb, status_kb("RssAnon"))

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        self.peak_kb = max(self.peak_kb, status_kb("RssAnon"))
        return self.peak_kb


def status_kb(field: str) -> int:
    """A field of /proc/self/status in kB (0 when absent)."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def vmrss_kb() -> int:
    """This process's resident set now (kB): the interpreter and the imports,
    before any work."""
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def reference(store: Path):
    """The three means from the local store, one time chunk at a time."""
    import numpy as np
    import zarr

    u, v = zarr.open_array(str(store), path="u", mode="r"), zarr.open_array(str(store), path="v", mode="r")
    acc = np.zeros((3,) + u.shape[2:])
    ct = u.chunks[0]
    for t in range(0, u.shape[0], ct):
        a, b = u[t:t + ct, 0], v[t:t + ct, 0]
        acc[0] += (a * a).sum(axis=0)
        acc[1] += (b * b).sum(axis=0)
        acc[2] += (a * b).sum(axis=0)
    return acc / u.shape[0]


def parent(a) -> int:
    import numpy as np
    import zarr

    store = Path(a.store).resolve()
    if not (store / "zarr.json").exists():
        print(f"missing {store}: run .venv/bin/python bench/bench_quadratic.py --make first", file=sys.stderr)
        return 2
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    latencies = [float(x) for x in a.latencies.split(",")]
    u = zarr.open_array(str(store), path="u", mode="r")
    files = [p for p in store.rglob("*") if p.is_file()]
    chunk_files = [p for p in files if p.parent.name == "c" or "/c/" in p.as_posix()]
    need = sum(p.stat().st_size for p in chunk_files)
    budget = parse_mem(a.allowed_mem)
    load0 = os.getloadavg()
    print(f"{store}: u, v {u.shape} {u.dtype} chunks {u.chunks}; {len(chunk_files)} chunk objects, {need / 1e9:.2f} GB; "
          f"allowed_mem {a.allowed_mem}; arms {', '.join(arms)}; latencies {a.latencies} ms", flush=True)
    t0 = time.perf_counter()
    ref = reference(store)
    print(f"reference (numpy, local store, one chunk at a time): {time.perf_counter() - t0:.1f} s", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="zf-bench-s3-quad-", dir=HERE / "data"))
    print("starting the S3 server and uploading ...", flush=True)
    server = b3.Server(store)
    print(f"  upload {server.upload_s:.1f} s", flush=True)
    conn = dict(server.conn, options=server.s3.options())
    results: dict[tuple, dict] = {}
    try:
        for lat in latencies:
            server.proxy.configure(latency_ms=lat)
            for arm in arms:
                runs = []
                for i in range(1 + a.repeat):
                    work = tmp / f"{arm}-{lat:g}-{i}-work"
                    work.mkdir()
                    out = tmp / f"{arm}.npy"
                    argv = [sys.executable, str(Path(__file__).resolve()), "--child", arm, "--conn", json.dumps(conn),
                            "--allowed-mem", a.allowed_mem, "--work-dir", str(work), "--threads", str(a.threads),
                            "--out", str(out)]
                    r = server.measure(argv, a.timeout, a.mem_limit_gb, tmp / f"{arm}-{lat:g}-{i}.json")
                    c = b3.bs.last_json(Path(r["stdout_path"])) if r["ok"] else {}
                    r["t"] = c.get("seconds")
                    r["ok"] = r["ok"] and r["t"] is not None
                    r["maxrss_mb"] = max(r["maxrss_mb"], c.get("vmhwm_kb", 0) / 1024)
                    # What the work added to the process (the interpreter and its
                    # imports excluded): what allowed_mem bounds.
                    r["work_mb"] = r["maxrss_mb"] - c.get("start_kb", 0) / 1024
                    # The same, up to the query's answer (before the answer is
                    # turned into xarray's grids in Python).
                    r["query_mb"] = (c.get("query_kb", 0) - c.get("start_kb", 0)) / 1024
                    # Of which anonymous memory (sampled): the data, without
                    # the pages of code the query ran for the first time.
                    r["anon_mb"] = (c.get("query_anon_kb", 0) - c.get("start_anon_kb", 0)) / 1024
                    r["check"] = "-"
                    if r["ok"]:
                        got = np.load(out)
                        r["check"] = "ok" if np.allclose(got, ref, rtol=1e-9, atol=0) else \
                            f"DIFFERS (max rel {float(np.nanmax(np.abs(got / ref - 1))):.1e})"
                    shutil.rmtree(work, ignore_errors=True)
                    runs.append(r)
                    p = r["proxy"]
                    print(f"{lat:>5g} ms {arm:10s} run {i}: "
                          + (f"{r['t']:.2f} s, RSS {r['maxrss_mb']:.0f} MB, GET {p['methods'].get('GET', 0)} "
                             f"({p['get_objects']} objects), {p['bytes'] / 1e6:.1f} MB, in flight {p['max_in_flight']}, "
                             f"server CPU {r['server_cpu_s']:.1f} s, load {r['load1']:.1f}, {r['check']}"
                             if r["ok"] else f"FAILED rc={r['rc']} {r['killed'] or ''} {r['stderr'][-600:]}"), flush=True)
                    if not r["ok"]:
                        break
                good = [r for r in runs if r["ok"]]
                results[(lat, arm)] = {"best": min(good, key=lambda r: r["t"]) if good else None, "first": runs[0],
                                       "maxrss_mb": max(r["maxrss_mb"] for r in runs),
                                       "work_mb": max(r.get("work_mb", r["maxrss_mb"]) for r in runs),
                                       "query_mb": max(r.get("query_mb", 0.0) for r in runs),
                                       "anon_mb": max(r.get("anon_mb", 0.0) for r in runs)}
    finally:
        server.s3.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    text = render(a, store, u, arms, latencies, results, len(chunk_files), need, budget, server, (load0, os.getloadavg()))
    print("\n" + text)
    if not a.no_write:
        with open(RESULTS, "a") as f:
            f.write("\n" + text + "\n")
        print(f"appended to {RESULTS}")
    return 0


def render(a, store, u, arms, latencies, results, n_chunks, need, budget, server, loads) -> str:
    from importlib.metadata import version

    vers = []
    for n in ("zarrfusion", "dask", "zarr", "xarray", "numpy", "obstore", "moto"):
        try:
            vers.append(f"{n} {version(n)}")
        except Exception:  # noqa: BLE001
            vers.append(f"{n} ?")
    load_max = max((r["first"]["load1"] for r in results.values()), default=0.0)
    L = [f"## Object-store benchmark, part 3: Quadratic Means from the bucket, "
         f"{_dt.datetime.now().strftime('%Y-%m-%d %H:%M')} (issue 23)\n"]
    L.append(f"- Command: `{b3l.command('bench_s3_quadratic.py')}`")
    L.append(f"- Machine: {b3l.machine(loads)}, 1-min up to {load_max:.1f} at the runs' starts.")
    L.append(f"- Versions: {', '.join(vers)}.")
    L.append(f"- Store: `{os.path.relpath(store, ROOT)}` (Zarr v3, u and v {u.shape} {u.dtype}, chunks {u.chunks}, "
             f"uncompressed): {n_chunks} chunk objects, {need / 1e6:.1f} MB, uploaded to moto's S3 server in "
             f"{server.upload_s:.0f} s (moto spools objects over 5 MB to temporary files); every arm reads through the "
             "latency proxy.")
    L.append(f"- allowed_mem {a.allowed_mem} ({budget / 2**20:.0f} MiB); {a.threads} threads for dask; each run a fresh "
             f"process, {1 + a.repeat} run(s) per arm and latency, the fastest shown; time excludes imports.")
    L.append(f"- Query (zarrfusion): `{bq.SQL}`; dask: `(u*u).mean(0)`, `(v*v).mean(0)`, `(u*v).mean(0)` computed "
             "together on `da.from_zarr` over zarr-python + obstore. numpy and cubed of bench_quadratic.py are not "
             "run: numpy holds u and v whole (over 6x the budget), cubed is not installed in this venv.")
    L.append("")
    L.append("| latency ms | arm | s | peak RSS MiB | above start MiB | query above start MiB | query anon above start MiB "
             "| anon over allowed_mem MiB | GET | objects | MB fetched | MB needed | most in flight | faults | server CPU s "
             "| correct |")
    L.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for lat in latencies:
        for arm in arms:
            x = results.get((lat, arm))
            if x is None:
                continue
            r = x["best"]
            if r is None:
                f = x["first"]
                L.append(f"| {lat:g} | {arm} | FAILED | {x['maxrss_mb']:.0f} | | | | | | | | | | "
                         f"{f['killed'] or 'rc ' + str(f['rc'])}: {f['stderr'][-160:].replace(chr(10), ' ').replace('|', '/')} |")
                continue
            p = r["proxy"]
            anon = x["anon_mb"] * 2**20
            L.append(f"| {lat:g} | {arm} | {r['t']:.2f} | {x['maxrss_mb']:.0f} | {x['work_mb']:.0f} | "
                     f"{x['query_mb']:.0f} | {x['anon_mb']:.0f} | {max(0, anon - budget) / 2**20:.0f} | "
                     f"{p['methods'].get('GET', 0)} | {p['get_objects']} | {p['bytes'] / 1e6:.1f} | {need / 1e6:.1f} | "
                     f"{p['max_in_flight']} | {sum(p['faults'].values())} | {r['server_cpu_s']:.1f} | {r['check']} |")
    L.append("")
    L.append("Against issue 23's targets (at 100 ms: time within 1.5x of 0 ms; the memory the query took, peak "
             "anonymous RSS above the process's start up to its answer, within allowed_mem):\n")
    L.append("| arm | " + " | ".join(f"{lat:g} ms s" for lat in latencies)
             + " | 100 ms / 0 ms | peak RSS MiB (all runs) | above start MiB (all runs) | query above start MiB "
             "(all runs) | query anon above start MiB (all runs) | targets |")
    L.append("|---|" + "---:|" * len(latencies) + "---:|---:|---:|---:|---:|---|")
    for arm in arms:
        bests = [(results.get((lat, arm)) or {}).get("best") for lat in latencies]
        b0 = (results.get((0.0, arm)) or {}).get("best")
        b100 = (results.get((100.0, arm)) or {}).get("best")
        peak = max((x["maxrss_mb"] for k, x in results.items() if k[1] == arm), default=0.0)
        work = max((x["work_mb"] for k, x in results.items() if k[1] == arm), default=0.0)
        query = max((x["query_mb"] for k, x in results.items() if k[1] == arm), default=0.0)
        anon = max((x["anon_mb"] for k, x in results.items() if k[1] == arm), default=0.0)
        ratio, verdict = "-", "-"
        if b0 and b100:
            q = b100["t"] / b0["t"]
            ratio = f"{q:.2f}x"
            verdict = ("time met" if q <= 1.5 else "time NOT met") + ", " + \
                ("memory met" if anon * 2**20 <= budget else "memory NOT met")
        L.append(f"| {arm} | " + " | ".join(f"{b['t']:.2f}" if b else "-" for b in bests)
                 + f" | {ratio} | {peak:.0f} | {work:.0f} | {query:.0f} | {anon:.0f} | {verdict} |")
    L.append("")
    L.append("`objects` = distinct object paths GET asked for (GET - objects = repeated GETs; no faults were injected). "
             "`MB needed` = on-disk size of every chunk of u and v (the query reads all of them). Peak RSS: the child's "
             "VmHWM; above start: VmHWM minus the VmRSS after the imports, before the work (the interpreter, numpy, "
             "xarray and the extension's code are not the work's); query above start: the same up to the query's "
             "answer (zarrfusion: the Arrow table, before Python turns it into xarray's grids; dask: the three means); "
             "query anon: the peak of RssAnon (sampled every 2 ms) above its value at the start, up to the answer: the "
             "memory the data took, without the pages of the extension's code that the query ran for the first time "
             "(file-backed, counted in VmHWM; not what allowed_mem bounds). "
             "The budget applies to zarrfusion (allowed_mem); "
             "dask has none and is shown for comparison.\n")
    return "\n".join(L)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=str(bq.STORE), help="local store to upload (default bench/data/quad.zarr)")
    ap.add_argument("--latencies", default="0,20,100", help="added latency per request, ms (default 0,20,100)")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ",".join(ARMS))
    ap.add_argument("--allowed-mem", default="2GB")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="dask threads")
    ap.add_argument("--repeat", type=int, default=0, help="extra runs per arm and latency (default 0)")
    ap.add_argument("--timeout", type=float, default=900, help="per-run timeout in seconds (default 900)")
    ap.add_argument("--mem-limit-gb", type=float, default=12, help="kill a run whose RSS exceeds this (GiB)")
    ap.add_argument("--no-write", action="store_true", help="print only; do not append to bench/RESULTS.md")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--conn", help=argparse.SUPPRESS)
    ap.add_argument("--work-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    return parent(a)


if __name__ == "__main__":
    sys.exit(main())

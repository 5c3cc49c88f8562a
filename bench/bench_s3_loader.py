#!/usr/bin/env python3
"""Object-store benchmark, part 2 (issue 23): the window loader of bench_loader.py reading
its store from the local S3 server of bench_s3.py, with 0, 20 and 100 ms added to every
request.

    .venv/bin/python bench/make_loader_data.py --no-small        # once: bench/data/era5_loader.zarr
    .venv/bin/python bench/bench_s3_loader.py                     # latencies 0,20,100; appends to RESULTS.md

    # while developing (a store of 8 time steps; printed only):
    .venv/bin/python bench/bench_s3_loader.py --store bench/data/loader_dev.zarr --latencies 0,100 --quick --no-write

The store (bench_loader.py's era5_loader.zarr: t2m/u10/v10, one chunk per time step) is
uploaded to bucket ``bench`` of moto's server, behind the latency proxy (bench_s3.Server).
Arms, each a fresh subprocess per latency and window size:

* zarrfusion: ``ctx.open_zarr("s3://bench/<store>", variables=..., **options)`` with the
  proxy's endpoint and credentials as options, ``.windows(..., valid="all", cache=False)``
  (the valid-window index built in the background from the bucket while the first
  batches are served) ``.loader(batch_size=256, shuffle="block", seed=0, drop_last=True,
  prefetch=8)``, as bench_loader.py;
* zarrfusion-cached: the same with the index from the index cache, primed by an untimed
  subprocess before the measured one (its requests are not counted);
* numpy: bench_loader.NumpyBlockLoader on ``zarr.storage.ObjectStore(obstore S3Store)``
  (zarr-python's 10 reads in flight; synchronous: no read ahead).

Metrics (bench_loader.timed_phases, inside the child after imports): first batch
(construction to first batch), samples/s over ``--batches`` batches with no step, then the
time ``next()`` blocks per batch with a simulated 10 ms step (p50/p95 over
``--wait-batches``, after ``--warmup``). zarrfusion then waits for ``len(windows)`` (the
rest of the index pass, for cache=False) so that every run's requests cover the same work.
Peak RSS is the child's VmHWM (bench_s3.run_proc); GETs, bytes, distinct objects and the
most requests in flight come from the proxy. "MB needed" is the on-disk size of the chunks
of the time steps the delivered batches came from, plus, for cache=False, the whole store
(the index pass reads every chunk of the variables once).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import bench_loader as bl  # noqa: E402  (loaders, timed phases, windows, expected counts)
import bench_s3 as b3  # noqa: E402  (S3 server + proxy, VmHWM run_proc, stores)

ARMS = ["zarrfusion", "zarrfusion-cached", "numpy"]
RESULTS = HERE / "RESULTS.md"


# ======================================================================================
# child side
# ======================================================================================

def zf_windows(zf, conn: dict, win: int, ov: int, cache):
    options = conn["options"]
    ds = zf.SessionContext().open_zarr(f"s3://{conn['bucket']}/{conn['prefix']}", variables=bl.VARS, **options)
    return ds.windows(input_dims={"lat": win, "lon": win}, input_overlap={"lat": ov, "lon": ov}, valid="all",
                      cache=cache)


def child(a) -> int:
    import numpy as np

    arm, w = a.child[0], int(a.child[1])
    win, ov = bl.WINDOWS[w]
    conn = json.loads(a.conn)
    info: dict = {"arm": arm, "w": w}
    if arm.startswith("zarrfusion") or arm == "prime":
        import zarrfusion as zf
    else:
        import obstore  # noqa: F401
        import zarr  # noqa: F401
    if arm == "prime":  # builds the index into the cache directory (untimed by the parent)
        t0 = time.perf_counter()
        n = len(zf_windows(zf, conn, win, ov, a.cache_dir))
        print(json.dumps({"n_windows": n, "t_total": time.perf_counter() - t0}))
        return b3.quit_now()

    def count_t(b):
        tv = (b.get("coords") or {}).get("time")
        return int(b["t2m"].shape[0]), (len(np.unique(np.asarray(tv))) if tv is not None else None)

    times: set = set()

    def on_batch(b):
        times.update(np.unique(np.asarray(b["coords"]["time"]).astype("datetime64[ns]").astype(np.int64)).tolist())

    t0 = time.perf_counter()
    if arm.startswith("zarrfusion"):
        windows = zf_windows(zf, conn, win, ov, a.cache_dir if arm == "zarrfusion-cached" else False)
        loader = windows.loader(batch_size=a.batch_size, shuffle="block", seed=a.seed, drop_last=True,
                                prefetch=a.prefetch)
        loader.set_epoch(0)
        it = iter(loader)
    elif arm == "numpy":
        it = iter(bl.NumpyBlockLoader(b3.open_store("obstore", conn), win, ov, a.batch_size, a.seed, a.np_group))
    else:
        raise SystemExit(f"unknown arm {arm}")
    b = next(it)
    info["t_first"] = time.perf_counter() - t0
    on_batch(b)
    check = "ok"
    for v in bl.VARS:
        x = np.asarray(b[v])
        if x.shape != (a.batch_size, win, win) or x.dtype != np.float32:
            check = f"{v} shape {x.shape} {x.dtype} != ({a.batch_size}, {win}, {win}) float32"
        elif np.isnan(x).any():
            check = f"{v} has NaN in batch 0"
    if check == "ok":  # the samples against the local copy of the store (not through the proxy)
        check = bl.verify_against_store(conn["path"], b, win)
    info["check"] = check
    info.update(bl.timed_phases(it, a, count_t, t0, on_batch))
    if arm.startswith("zarrfusion"):
        try:
            info["stats"] = {k: (v if isinstance(v, (int, float, str)) else str(v)) for k, v in dict(loader.stats()).items()}
        except Exception as e:  # noqa: BLE001
            info["stats"] = f"stats() failed: {e}"
        tl = time.perf_counter()
        info["n_windows"] = int(len(windows))  # cache=False: waits for the rest of the index pass
        info["t_len"] = time.perf_counter() - tl
        info["index"] = f"{windows.index_source} ({windows.index_seconds:.2f} s)"
    info["times"] = sorted(times)
    info["vmhwm_kb"] = b3.vmhwm_kb()
    print(json.dumps(info))
    return b3.quit_now()


# ======================================================================================
# parent side
# ======================================================================================

def chunk_bytes(store: Path) -> dict[int, int]:
    """{time index: on-disk bytes of that time step's chunks over VARS} (one chunk per step)."""
    import zarr

    g = zarr.open_group(str(store), mode="r")
    if g["t2m"].chunks[0] != 1:
        raise SystemExit("expected one time step per chunk, as make_loader_data.py writes")
    out: dict[int, int] = {}
    for v in bl.VARS:
        for p in (store / v).iterdir():
            if p.name[0].isdigit():
                t = int(p.name.split(".")[0])
                out[t] = out.get(t, 0) + p.stat().st_size
    return out


def child_argv(arm: str, w: int, conn: dict, a, cache_dir: str = "") -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child", arm, str(w), "--conn", json.dumps(conn),
            "--batch-size", str(a.batch_size), "--batches", str(a.batches), "--warmup", str(a.warmup),
            "--wait-batches", str(a.wait_batches), "--seed", str(a.seed), "--prefetch", str(a.prefetch),
            "--np-group", str(a.np_group), "--cache-dir", cache_dir]


def parent(a) -> int:
    import numpy as np

    store = Path(a.store).resolve()
    if not (store / ".zmetadata").exists():
        print(f"missing {store}: run .venv/bin/python bench/make_loader_data.py --no-small first", file=sys.stderr)
        return 2
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    wins = [int(x) for x in a.windows.split(",") if x.strip()]
    latencies = [float(x) for x in a.latencies.split(",")]
    notes = []
    try:
        import zarrfusion  # noqa: F401
    except Exception as e:  # noqa: BLE001
        notes.append(f"`import zarrfusion` failed ({e}): zarrfusion arms skipped")
        arms = [x for x in arms if not x.startswith("zarrfusion")]
    info = bl.store_info(store)
    exp = bl.expected_windows(store)
    sizes = chunk_bytes(store)
    import zarr
    tvals = bl.decode_time(zarr.open_group(str(store), mode="r")).astype("datetime64[ns]").astype(np.int64)
    t_index = {int(t): i for i, t in enumerate(tvals)}
    tmp = Path(tempfile.mkdtemp(prefix="zf_bench_s3_loader_"))
    load0 = os.getloadavg()
    print(f"store {store}: {', '.join(bl.VARS)} {tuple(info['shape'])}, chunks {tuple(info['chunks'])}, "
          f"{sum(sizes.values()) / 1e6:.1f} MB of chunks; arms {', '.join(arms)}; latencies {a.latencies} ms", flush=True)
    print("starting the S3 server and uploading ...", flush=True)
    server = b3.Server(store)
    print(f"  upload {server.upload_s:.1f} s", flush=True)
    conn = dict(server.conn, path=str(store), options=server.s3.options())
    results: dict[tuple, dict] = {}
    try:
        for lat in latencies:
            server.proxy.configure(latency_ms=lat)
            for w in wins:
                for arm in arms:
                    cache_dir = ""
                    prime = None
                    if arm == "zarrfusion-cached":
                        cache_dir = tempfile.mkdtemp(prefix="zf-index-", dir=tmp)
                        prime = server.measure(child_argv("prime", w, conn, a, cache_dir), a.timeout, a.mem_limit_gb,
                                               tmp / "prime.json")
                        if not prime["ok"]:
                            print(f"{lat:g} ms {w}x{w} prime FAILED {prime['killed'] or prime['stderr'][-400:]}", flush=True)
                    runs = []
                    for i in range(1 + a.repeat):
                        r = server.measure(child_argv(arm, w, conn, a, cache_dir), a.timeout, a.mem_limit_gb,
                                           tmp / f"{arm}_{w}_{lat:g}_{i}.json")
                        c = b3.bs.last_json(Path(r["stdout_path"])) if r["ok"] else {}
                        r.update(c)
                        r["ok"] = r["ok"] and "samples_s" in c
                        r["maxrss_mb"] = max(r["maxrss_mb"], c.get("vmhwm_kb", 0) / 1024)
                        steps = {t_index[t] for t in c.get("times", []) if t in t_index}
                        r["n_steps"] = len(steps)
                        r["need"] = sum(sizes.values()) if arm == "zarrfusion" else sum(sizes[t] for t in steps)
                        r.pop("times", None)
                        runs.append(r)
                        p = r["proxy"]
                        if r["ok"]:
                            print(f"{lat:>5g} ms {w}x{w} {arm:17s} run {i}: first {r['t_first']:.3f} s, "
                                  f"{bl.fmt_rate(r['samples_s'])} samples/s, wait p50 {r['wait_median_ms']:.2f} "
                                  f"p95 {r['wait_p95_ms']:.2f} ms, RSS {r['maxrss_mb']:.0f} MB, GET {p['methods'].get('GET', 0)} "
                                  f"({p['get_objects']} objects), {p['bytes'] / 1e6:.1f} MB (needed {r['need'] / 1e6:.1f}), "
                                  f"in flight {p['max_in_flight']}, load {r['load1']:.1f}, {r['check']}"
                                  + (f", index {r['index']}, len {r['n_windows']} in {r['t_len']:.2f} s" if 'index' in r else ""),
                                  flush=True)
                        else:
                            print(f"{lat:>5g} ms {w}x{w} {arm} run {i} FAILED rc={r['rc']} {r['killed'] or ''} "
                                  f"{r['stderr'][-600:]}", flush=True)
                            break
                    good = [r for r in runs if r["ok"]]
                    results[(lat, w, arm)] = {"best": max(good, key=lambda r: r["samples_s"]) if good else None,
                                              "first": runs[0], "prime": prime, "runs": runs}
                    if cache_dir:
                        shutil.rmtree(cache_dir, ignore_errors=True)
    finally:
        server.s3.stop()
    text = render(a, store, arms, wins, latencies, results, info, exp, sizes, server, notes, (load0, os.getloadavg()))
    print("\n" + text)
    if not a.no_write:
        with open(RESULTS, "a") as f:
            f.write("\n" + text + "\n")
        print(f"appended to {RESULTS}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def versions() -> str:
    from importlib.metadata import version

    out = []
    for n in ("zarrfusion", "zarr", "xarray", "numpy", "obstore", "moto", "Werkzeug"):
        try:
            out.append(f"{n} {version(n)}")
        except Exception:  # noqa: BLE001
            out.append(f"{n} ?")
    return ", ".join(out)


def machine(loads) -> str:
    import psutil

    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    return (f"{os.cpu_count()} cores ({cpu}), {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}. Load average (1/5/15 min) "
            f"{loads[0][0]:.2f}/{loads[0][1]:.2f}/{loads[0][2]:.2f} at the start, "
            f"{loads[1][0]:.2f}/{loads[1][1]:.2f}/{loads[1][2]:.2f} at the end")


def command(script: str) -> str:
    return " ".join(shlex.quote(x) for x in [".venv/bin/python", f"bench/{script}"] + sys.argv[1:])


def render(a, store, arms, wins, latencies, results, info, exp, sizes, server, notes, loads) -> str:
    mb = lambda b: f"{b / 1e6:.1f}"  # noqa: E731
    load_max = max((r["load1"] for x in results.values() for r in x["runs"]), default=0.0)
    L = [f"## Object-store benchmark, part 2: the window loader from the bucket, "
         f"{_dt.datetime.now().strftime('%Y-%m-%d %H:%M')} (issue 23)\n"]
    L.append(f"- Command: `{command('bench_s3_loader.py')}`")
    L.append(f"- Machine: {machine(loads)}, 1-min up to {load_max:.1f} at the runs' starts.")
    L.append(f"- Versions: {versions()}.")
    L.append(f"- Store: `{os.path.relpath(store, ROOT)}` ({', '.join(bl.VARS)} {tuple(info['shape'])} float32, chunks "
             f"{tuple(info['chunks'])}, blosc lz4; {len(sizes) * len(bl.VARS)} chunk objects, {mb(sum(sizes.values()))} MB) "
             f"uploaded to moto's S3 server in {server.upload_s:.0f} s; every arm reads through the latency proxy.")
    L.append(f"- Per run (a fresh process; first of {1 + a.repeat} run(s) kept unless a repeat was faster): first "
             f"batch; samples/s over {a.batches} batches with no step; then a {bl.STEP_S * 1e3:.0f} ms simulated step per "
             f"batch, {a.warmup} warm-up batches and the wait in `next()` over {a.wait_batches} batches. Batch "
             f"{a.batch_size}, shuffle=\"block\", seed {a.seed}, prefetch {a.prefetch}; numpy: {a.np_group} chunks at a time.")
    for n in notes:
        L.append(f"- NOTE: {n}")
    L.append("")
    for w in wins:
        win, ov = bl.WINDOWS[w]
        L.append(f"### {win}x{win} windows, overlap {ov}; {exp[w][0]:,} valid windows\n")
        L.append("| latency ms | arm | samples/s | first batch s | wait p50 ms | wait p95 ms | peak RSS MB | GET | objects | "
                 "MB fetched | MB needed | most in flight | faults | index | correct |")
        L.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
        for lat in latencies:
            for arm in arms:
                x = results.get((lat, w, arm))
                if x is None:
                    continue
                r = x["best"]
                if r is None:
                    f = x["first"]
                    L.append(f"| {lat:g} | {arm} | FAILED | | | | | | | | | | | | {f['killed'] or 'rc ' + str(f['rc'])} |")
                    continue
                p = r["proxy"]
                idx = r.get("index", "-")
                if "n_windows" in r:
                    idx += f"; len {r['n_windows']:,}" + (" ok" if r["n_windows"] == exp[w][0] else " WRONG") + \
                        f", {r['t_len']:.2f} s after the waits"
                L.append(f"| {lat:g} | {arm} | {bl.fmt_rate(r['samples_s'])} | {r['t_first']:.3f} | {r['wait_median_ms']:.2f} | "
                         f"{r['wait_p95_ms']:.2f} | {r['maxrss_mb']:.0f} | {p['methods'].get('GET', 0)} | {p['get_objects']} | "
                         f"{mb(p['bytes'])} | {mb(r['need'])} | {p['max_in_flight']} | {sum(p['faults'].values())} | {idx} | "
                         f"{r['check']} |")
        L.append("")
    L.append("Against issue 23's targets (at 100 ms: samples/s within 1.5x of 0 ms; median wait under 1 ms):\n")
    L.append("| window | arm | " + " | ".join(f"samples/s {lat:g} ms" for lat in latencies)
             + " | 0 ms / 100 ms | wait p50 at 100 ms | targets |")
    L.append("|---|---|" + "---:|" * len(latencies) + "---:|---:|---|")
    for w in wins:
        for arm in arms:
            bests = [(results.get((lat, w, arm)) or {}).get("best") for lat in latencies]
            cells = [bl.fmt_rate(b["samples_s"]) if b else "-" for b in bests]
            b0 = (results.get((0.0, w, arm)) or {}).get("best")
            b100 = (results.get((100.0, w, arm)) or {}).get("best")
            ratio, wait, verdict = "-", "-", "-"
            if b0 and b100:
                q = b0["samples_s"] / b100["samples_s"]
                ratio, wait = f"{q:.2f}x", f"{b100['wait_median_ms']:.2f} ms"
                verdict = ("throughput met" if q <= 1.5 else "throughput NOT met") + ", " + \
                    ("wait met" if b100["wait_median_ms"] < 1 else "wait NOT met")
            L.append(f"| {w}x{w} | {arm} | " + " | ".join(cells) + f" | {ratio} | {wait} | {verdict} |")
    L.append("")
    primes = [(k, x["prime"]) for k, x in results.items() if x.get("prime")]
    if primes:
        L.append("Index cache priming (untimed for zarrfusion-cached, a separate process before it): "
                 + "; ".join(f"{k[1]}x{k[1]} at {k[0]:g} ms {b3.bs.fmt_s(p['wall'])} s, GET {p['proxy']['methods'].get('GET', 0)}"
                             for k, p in primes) + ".\n")
    L.append("`objects` = distinct object paths GET asked for (GET - objects = repeated GETs: retries or re-reads; "
             "no faults were injected). `MB needed` = on-disk size of the chunks (3 variables) of the time steps the "
             "delivered batches came from; for zarrfusion with cache=False the whole store, which the index pass "
             "reads (the run waits for it with len(windows) after the waits; it covers the delivered steps). Bytes fetched beyond that are read ahead "
             "for batches the run never asked for. Peak RSS: the child's VmHWM (no allowed_mem applies to the loader).\n")
    return "\n".join(L)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=str(bl.BIG), help="local store to upload (default bench/data/era5_loader.zarr)")
    ap.add_argument("--latencies", default="0,20,100", help="added latency per request, ms (default 0,20,100)")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ",".join(ARMS))
    ap.add_argument("--windows", default="5,48", help="comma-separated subset of 5,48")
    ap.add_argument("--repeat", type=int, default=0, help="extra runs per configuration (default 0)")
    ap.add_argument("--quick", action="store_true", help="50 / 3 / 20 batches instead of 200 / 5 / 100")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--batches", type=int, default=200, help="throughput batches after the first (default 200)")
    ap.add_argument("--warmup", type=int, default=5, help="warm-up batches with the 10 ms step")
    ap.add_argument("--wait-batches", type=int, default=100, help="batches whose wait is recorded (default 100)")
    ap.add_argument("--prefetch", type=int, default=8, help="zarrfusion loader prefetch (default 8)")
    ap.add_argument("--np-group", type=int, default=4, help="numpy arm: time chunks decoded at a time (default 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600, help="per-run timeout in seconds (default 600)")
    ap.add_argument("--mem-limit-gb", type=float, default=12, help="kill a run whose RSS exceeds this (GiB)")
    ap.add_argument("--no-write", action="store_true", help="print only; do not append to bench/RESULTS.md")
    ap.add_argument("--child", nargs=2, metavar=("ARM", "W"), help=argparse.SUPPRESS)
    ap.add_argument("--conn", help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.quick:
        a.batches, a.warmup, a.wait_batches = 50, 3, 20
    if a.child:
        return child(a)
    return parent(a)


if __name__ == "__main__":
    sys.exit(main())

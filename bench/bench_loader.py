#!/usr/bin/env python3
"""ML data-loader benchmark (issue 3): zarrfusion's window loader vs xbatcher + torch DataLoader vs numpy.

    .venv/bin/python bench/make_loader_data.py       # once: writes bench/data/era5_loader*.zarr
    .venv/bin/python bench/bench_loader.py [--quick] [--arms zarrfusion,zarrfusion-cached,numpy,numpy-global,xbatcher]
                                           [--windows 5,48] [--no-write]

Store: bench/data/era5_loader.zarr (168 hourly steps of t2m/u10/v10 on the 721 x 1440 grid,
2.09 GB raw, one chunk per time step per variable; u10/v10 NaN on a fixed ~5 % mask).

Window configurations (the same semantics in every arm):

    5x5   window 5 x 5 over (lat, lon), overlap 4  (stride 1):  717 x 1436 origins per time step
    48x48 window 48 x 48 over (lat, lon), overlap 32 (stride 16):  43 x 88 origins per time step

A sample is one time step x one window; window origins along a dimension of length N are
0, s, 2s, ... up to N - w (no padding, no wrap-around in longitude: xbatcher's rule), in the
store's index order (lat descending as stored). A window is valid when none of its cells is
NaN in any of the three variables (valid="all"); invalid windows are never delivered.
Batches are 256 samples.

Arms (each measured configuration runs in a fresh subprocess, so its peak RSS is its own):

* zarrfusion:  ``ctx.open_zarr(store, variables=...).windows(input_dims, input_overlap,
  valid="all").loader(batch_size=256, shuffle="block", seed=0, drop_last=True, prefetch=8)``.
  ``cache=False``: the valid-window index is built in the background (one pass over the
  store, at the lowest thread priority) while the loader serves the first batches from the
  blocks it reads itself; the throughput and wait phases overlap the rest of that pass. Skipped (rows marked pending) when ``import zarrfusion`` fails.
* zarrfusion-cached:  the same with the index loaded from the index cache (primed,
  untimed, before the timed part): a training script's second and later runs.
* xbatcher:  ``xbatcher.BatchGenerator(xr.open_zarr(store, chunks=None)[vars],
  input_dims={lat: w, lon: w}, input_overlap=..., batch_dims={time: 1})`` wrapped in
  ``xbatcher.loaders.torch.MapDataset`` (``transform`` = ``torch.as_tensor(ds.to_array().values)``:
  one (3, 1, w, w) tensor per sample; xbatcher's default ``to_tensor`` only handles one variable) and ``torch.utils.data.DataLoader(batch_size=256, shuffle=True,
  num_workers=2, drop_last=True)``; a NaN sample is dropped by the dataset / collate_fn
  (so its batches hold the valid samples among 256 drawn ones; samples/s counts only
  valid samples). For 5x5 the full store has 173 million windows, and xbatcher's
  BatchGenerator builds one Python dict per window up front (~55 GB, ~15 min): not
  feasible, so its 5x5 run uses the first ``--xbatcher-nt-5`` time step(s) of the store
  (throughput per sample does not depend on that: every sample decodes its own chunks).
* numpy:  a plain hand-written block-random loader with zarr-python: the time chunks in a
  seeded random order, ``--np-group`` chunks at a time decoded into memory, every valid
  window of those chunks once in random order (validity by a summed-area table of the NaN
  mask), windows gathered with numpy fancy indexing; synchronous, no prefetch.
* numpy-global: uniformly random (t, i, j) origins over the whole store for each batch,
  reading the chunks they need with zarr-python (LRU cache of the last 8 time steps),
  NaN windows redrawn; shows the cost of a global shuffle on time-chunked data.

Metrics per arm and window size (inside the child, after imports):

* first batch s:  loader construction (open, index build, workers) -> first batch in hand;
* samples/s:  ``--batches`` batches after the first, no training step;
* wait ms (median, p95):  after ``--warmup`` batches with a simulated 10 ms training step
  (``time.sleep(0.01)`` between batches), the time ``next()`` blocks, over ``--wait-batches``;
* peak RSS:  sampled by the parent every 0.1 s over the child and all its descendants
  (sum of RSS, and sum of PSS which counts pages shared by forked workers once).

``--small`` (default on) repeats the arms on bench/data/era5_loader_small.zarr (1/4 of the
time steps) to check that peak RSS does not grow with the dataset. Appends a section to
bench/RESULTS.md unless --no-write.
"""

from __future__ import annotations

import argparse
import collections
import datetime as _dt
import json
import os
import platform
import shlex
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
BIG = DATA / "era5_loader.zarr"
SMALL = DATA / "era5_loader_small.zarr"
RESULTS = HERE / "RESULTS.md"
VARS = ["t2m", "u10", "v10"]
ARMS = ["zarrfusion", "zarrfusion-cached", "numpy", "numpy-global", "xbatcher"]
WINDOWS = {5: (5, 4), 48: (48, 32)}  # size -> (window, overlap)
STEP_S = 0.010  # simulated training step
SKIP_RC = 3  # child exit code: arm not available


# ======================================================================================
# child side: one arm, one window size, one store, one process
# ======================================================================================

def decode_time(g):
    """CF 'hours since ...' int64 -> datetime64[ns] (numpy arms read zarr directly)."""
    import numpy as np
    import pandas as pd

    t = g["time"]
    units = t.attrs.get("units", "hours since 1970-01-01")
    unit, ref = units.split(" since ")
    unit = {"hours": "h", "minutes": "min", "seconds": "s", "days": "D"}[unit.strip()]
    return (pd.Timestamp(ref.strip()) + pd.to_timedelta(np.asarray(t[:]), unit=unit)).to_numpy()


def origins(n: int, w: int, stride: int) -> int:
    return (n - w) // stride + 1


def window_sums(sat, w: int, s: int, ni: int, nj: int):
    """Sums of the w x w windows at origins (i*s, j*s) from a summed-area table sat[..., 1+lat, 1+lon]."""
    r0, r1 = slice(0, (ni - 1) * s + 1, s), slice(w, w + (ni - 1) * s + 1, s)
    c0, c1 = slice(0, (nj - 1) * s + 1, s), slice(w, w + (nj - 1) * s + 1, s)
    return sat[..., r1, c1] - sat[..., r0, c1] - sat[..., r1, c0] + sat[..., r0, c0]


class NumpyBlockLoader:
    """Time chunks in random order, `group` chunks decoded at a time, their valid windows shuffled."""

    def __init__(self, store, w, overlap, batch, seed, group):
        import numpy as np
        import zarr

        # a path, or a zarr-python store object (bench_s3_loader.py: a bucket through obstore)
        g = zarr.open_group(str(store) if isinstance(store, (str, os.PathLike)) else store, mode="r")
        self.arrs = [g[v] for v in VARS]
        self.nt, self.nlat, self.nlon = self.arrs[0].shape
        self.ct = self.arrs[0].chunks[0]
        self.time, self.lat, self.lon = decode_time(g), g["lat"][:], g["lon"][:]
        self.w, self.s = w, w - overlap
        self.ni, self.nj = origins(self.nlat, w, self.s), origins(self.nlon, w, self.s)
        self.batch, self.group = batch, group
        self.rng = np.random.default_rng(seed)
        self.blocks = [(t0, min(self.nt, t0 + self.ct)) for t0 in range(0, self.nt, self.ct)]

    def _load(self, blocks):
        import numpy as np

        data = [np.concatenate([a[t0:t1] for t0, t1 in blocks]) for a in self.arrs]
        tidx = np.concatenate([np.arange(t0, t1) for t0, t1 in blocks])
        bad = np.isnan(data[0])
        for d in data[1:]:
            bad |= np.isnan(d)
        # summed-area table: NaN count of each window
        sat = np.zeros((bad.shape[0], self.nlat + 1, self.nlon + 1), dtype=np.int32)
        np.cumsum(np.cumsum(bad, axis=1, dtype=np.int32), axis=2, out=sat[:, 1:, 1:])
        cnt = window_sums(sat, self.w, self.s, self.ni, self.nj)
        valid = np.flatnonzero(cnt.ravel() == 0)
        views = [np.lib.stride_tricks.sliding_window_view(d, (self.w, self.w), axis=(1, 2)) for d in data]
        return views, tidx, self.rng.permutation(valid)

    def _gather(self, views, tidx, flat):
        import numpy as np

        tt, ii, jj = np.unravel_index(flat, (len(tidx), self.ni, self.nj))
        ii, jj = ii * self.s, jj * self.s
        out = {v: d[tt, ii, jj] for v, d in zip(VARS, views)}  # (n, w, w) copies out of the window views
        out["coords"] = {"time": self.time[tidx[tt]], "lat": self.lat[ii], "lon": self.lon[jj]}
        return out

    def __iter__(self):
        import numpy as np

        order = [self.blocks[k] for k in self.rng.permutation(len(self.blocks))]
        parts, have = [], 0
        for g0 in range(0, len(order), self.group):
            data, tidx, perm = self._load(order[g0:g0 + self.group])
            pos = 0
            while pos < len(perm):
                take = min(self.batch - have, len(perm) - pos)
                parts.append(self._gather(data, tidx, perm[pos:pos + take]))
                pos += take
                have += take
                if have == self.batch:
                    if len(parts) == 1:
                        yield parts[0]
                    else:
                        out = {v: np.concatenate([p[v] for p in parts]) for v in VARS}
                        out["coords"] = {k: np.concatenate([p["coords"][k] for p in parts]) for k in parts[0]["coords"]}
                        yield out
                    parts, have = [], 0
        # drop_last


class NumpyGlobalLoader:
    """Uniformly random (t, i, j) origins over the whole store; LRU cache of decoded time steps."""

    def __init__(self, store, w, overlap, batch, seed, cache=8):
        import numpy as np
        import zarr

        g = zarr.open_group(str(store), mode="r")
        self.arrs = [g[v] for v in VARS]
        self.nt, self.nlat, self.nlon = self.arrs[0].shape
        self.time, self.lat, self.lon = decode_time(g), g["lat"][:], g["lon"][:]
        self.w, self.s = w, w - overlap
        self.ni, self.nj = origins(self.nlat, w, self.s), origins(self.nlon, w, self.s)
        self.batch, self.ncache = batch, cache
        self.cache = collections.OrderedDict()
        self.rng = np.random.default_rng(seed)

    def _step(self, t):
        if t in self.cache:
            self.cache.move_to_end(t)
            return self.cache[t]
        d = [a[t] for a in self.arrs]
        self.cache[t] = d
        if len(self.cache) > self.ncache:
            self.cache.popitem(last=False)
        return d

    def __iter__(self):
        import numpy as np

        w = self.w
        while True:
            rows = {v: [] for v in VARS}
            co = {"time": [], "lat": [], "lon": []}
            n = 0
            while n < self.batch:
                flat = self.rng.integers(0, self.nt * self.ni * self.nj, self.batch - n)
                tt, ii, jj = np.unravel_index(np.sort(flat), (self.nt, self.ni, self.nj))
                for t, i, j in zip(tt.tolist(), (ii * self.s).tolist(), (jj * self.s).tolist()):
                    d = self._step(t)
                    win = [x[i:i + w, j:j + w].copy() for x in d]  # copies: a view would pin the whole field
                    if any(np.isnan(x).any() for x in win):
                        continue
                    for v, x in zip(VARS, win):
                        rows[v].append(x)
                    co["time"].append(self.time[t]); co["lat"].append(self.lat[i]); co["lon"].append(self.lon[j])
                    n += 1
            perm = self.rng.permutation(self.batch)  # the origins were sorted by t for locality
            out = {v: np.stack(rows[v])[perm] for v in VARS}
            out["coords"] = {k: np.asarray(x)[perm] for k, x in co.items()}
            yield out


def timed_phases(it, a, count_t, t0: float, on_batch=None) -> dict:
    """After the first batch: samples/s over ``a.batches`` batches with no training step, then
    ``a.warmup`` batches with the simulated step, then the time ``next()`` blocks over
    ``a.wait_batches`` batches with the step (``time.sleep(STEP_S)`` between batches).
    ``count_t(batch)`` -> (samples, distinct time steps); ``on_batch(batch)`` sees every batch."""
    import numpy as np

    on_batch = on_batch or (lambda b: None)
    nb = a.batches
    n, tsets = 0, []
    t1 = time.perf_counter()
    for _ in range(nb):
        b = next(it)
        on_batch(b)
        k, tb = count_t(b)
        n += k
        tsets.append(tb)
    t_thr = time.perf_counter() - t1
    for _ in range(a.warmup):
        on_batch(next(it))
        time.sleep(STEP_S)
    waits = []
    for _ in range(a.wait_batches):
        tw = time.perf_counter()
        b = next(it)
        waits.append(time.perf_counter() - tw)
        on_batch(b)
        time.sleep(STEP_S)
    t_all = time.perf_counter() - t0
    tk = [x for x in tsets if x is not None]
    return {
        "batches": nb, "samples": n, "t_thr": t_thr,
        "samples_s": n / t_thr if t_thr > 0 else None,
        "mean_batch": n / nb if nb else None,
        "t_per_batch": float(np.mean(tk)) if tk else None,
        "wait_median_ms": float(np.median(waits)) * 1e3 if waits else None,
        "wait_p95_ms": float(np.percentile(waits, 95)) * 1e3 if waits else None,
        "wait_max_ms": float(np.max(waits)) * 1e3 if waits else None,
        "wait_n": len(waits), "warmup": a.warmup, "t_all": t_all,
    }


def child(a) -> int:
    import numpy as np

    arm, w, store = a.child[0], int(a.child[1]), a.child[2]
    win, ov = WINDOWS[w]
    info: dict = {"arm": arm, "w": w, "store": store}
    # ---- imports (not timed) ----
    if arm.startswith("zarrfusion"):
        try:
            import zarrfusion as zf
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"skip": f"import zarrfusion failed: {type(e).__name__}: {e}"}), flush=True)
            return SKIP_RC
        info["version"] = getattr(zf, "__version__", "?")
    elif arm == "xbatcher":
        import dask  # noqa: F401
        import torch
        import xarray as xr
        import xbatcher
        from torch.utils.data import DataLoader, default_collate
        from xbatcher.loaders.torch import MapDataset
        torch.set_num_threads(1)
    else:
        import zarr  # noqa: F401

    def count_t(b):  # (n samples, n distinct time steps)
        if arm == "xbatcher":
            x, t = b
            return int(x.shape[0]), len(set(t.tolist()))
        c = b.get("coords") or {}
        tv = c.get("time")
        nt = len(np.unique(np.asarray(tv))) if tv is not None else None
        return int(b["t2m"].shape[0]), nt

    # zarrfusion: "zarrfusion" builds the valid-window index (cache off);
    # "zarrfusion-cached" finds it in the index cache, primed here untimed
    # (the second and later runs of a training script).
    zf_cache: object = False
    if arm == "zarrfusion-cached":
        import tempfile

        zf_cache = tempfile.mkdtemp(prefix="zf-bench-index-")
        primed = zf.SessionContext().open_zarr(store, variables=VARS).windows(
            input_dims={"lat": win, "lon": win}, input_overlap={"lat": ov, "lon": ov}, valid="all", cache=zf_cache)
        len(primed)  # waits for the index, which is stored in the cache when complete
    # ---- construction + first batch (timed) ----
    t0 = time.perf_counter()
    if arm.startswith("zarrfusion"):
        ctx = zf.SessionContext()
        ds = ctx.open_zarr(store, variables=VARS)
        windows = ds.windows(input_dims={"lat": win, "lon": win}, input_overlap={"lat": ov, "lon": ov}, valid="all",
                             cache=zf_cache)
        loader = windows.loader(batch_size=a.batch_size, shuffle="block", seed=a.seed, drop_last=True, prefetch=a.prefetch)
        loader.set_epoch(0)
        it = iter(loader)
    elif arm == "numpy":
        it = iter(NumpyBlockLoader(store, win, ov, a.batch_size, a.seed, a.np_group))
    elif arm == "numpy-global":
        it = iter(NumpyGlobalLoader(store, win, ov, a.batch_size, a.seed))
    elif arm == "xbatcher":
        ds = xr.open_zarr(store, **({} if a.xbatcher_chunks == "dask" else {"chunks": None}))[VARS]
        if w == 5 and a.xbatcher_nt_5 > 0:
            ds = ds.isel(time=slice(0, a.xbatcher_nt_5))
        info["xbatcher_nt"] = int(ds.sizes["time"])
        t_ix = time.perf_counter()
        bgen = xbatcher.BatchGenerator(ds, input_dims={"lat": win, "lon": win},
                                       input_overlap={"lat": ov, "lon": ov}, batch_dims={"time": 1})
        info["t_index"] = time.perf_counter() - t_ix
        info["n_patches"] = len(bgen)

        class ValidMapDataset(MapDataset):
            """xbatcher's MapDataset; a sample with a NaN is dropped (None), its time index kept."""

            def __getitem__(self, idx):
                x = super().__getitem__(idx)
                if torch.isnan(x).any():
                    return None
                return x, self.X_generator._batch_selectors.selectors[idx][0]["time"].start

        def collate(items):
            items = [x for x in items if x is not None]
            return default_collate(items) if items else (torch.empty(0), torch.empty(0))

        def to_tensor(x):  # xbatcher's default to_tensor squeezes 'variable', which fails for 3 variables
            return torch.as_tensor(x.to_array().values)  # (3 variables, time 1, w, w)

        dl = DataLoader(ValidMapDataset(bgen, transform=to_tensor), batch_size=a.batch_size, shuffle=True, num_workers=a.workers,
                        collate_fn=collate, drop_last=True, generator=torch.Generator().manual_seed(a.seed))
        it = iter(dl)
    else:
        raise SystemExit(f"unknown arm {arm}")
    b = next(it)
    t_first = time.perf_counter() - t0
    n0, tb0 = count_t(b)
    check = "ok"
    if arm != "xbatcher":
        for v in VARS:
            x = np.asarray(b[v])
            if x.shape != (a.batch_size, win, win) or x.dtype != np.float32:
                check = f"{v} shape {x.shape} {x.dtype} != ({a.batch_size}, {win}, {win}) float32"
            elif np.isnan(x).any():
                check = f"{v} has NaN in batch 0"
        if arm.startswith("zarrfusion") and check == "ok":
            check = verify_against_store(store, b, win)
    else:
        x = b[0]
        if tuple(x.shape[1:]) != (3, 1, win, win) or torch.isnan(x).any():
            check = f"shape {tuple(x.shape)} or NaN"
    info["check"] = check

    info.update({"t_first": t_first, "first_n": n0})
    info.update(timed_phases(it, a, count_t, t0))
    if arm.startswith("zarrfusion"):
        info["index"] = f"{windows.index_source} ({windows.index_seconds:.2f} s)"
        if isinstance(zf_cache, str):
            import shutil

            shutil.rmtree(zf_cache, ignore_errors=True)
        try:
            info["stats"] = {k: (v if isinstance(v, (int, float, str)) else str(v)) for k, v in dict(loader.stats()).items()}
        except Exception as e:  # noqa: BLE001
            info["stats"] = f"stats() failed: {e}"
        tl = time.perf_counter()
        try:
            info["n_windows"] = int(len(windows))
        except Exception as e:  # noqa: BLE001
            info["n_windows"] = f"len() failed: {e}"
        info["t_len"] = time.perf_counter() - tl
    if arm == "xbatcher":
        del it  # shut the workers down before exiting
    print(json.dumps(info), flush=True)
    return 0


def verify_against_store(store, b, win) -> str:
    """zarrfusion only: do a few samples equal the store at their coordinates (origin or centre)?"""
    import numpy as np

    try:
        import zarr

        c = b.get("coords") or {}
        if not all(k in c for k in ("time", "lat", "lon")):
            return f"ok (coords {sorted(c)}: not verified against the store)"
        g = zarr.open_group(str(store), mode="r")
        tv, lat, lon = decode_time(g), g["lat"][:], g["lon"][:]
        ct = np.asarray(c["time"])
        if not np.issubdtype(ct.dtype, np.datetime64):
            return f"ok (coords time dtype {ct.dtype}: not verified)"
        how = None
        for k in range(min(8, len(ct))):
            t = int(np.searchsorted(tv, ct[k].astype(tv.dtype)))
            i = int(np.flatnonzero(lat == np.asarray(c["lat"])[k])[0])
            j = int(np.flatnonzero(lon == np.asarray(c["lon"])[k])[0])
            got = np.asarray(b["t2m"][k])
            ok = []
            for name, (i0, j0) in (("origin", (i, j)), ("centre", (i - win // 2, j - win // 2))):
                if i0 >= 0 and j0 >= 0 and np.array_equal(g["t2m"][t, i0:i0 + win, j0:j0 + win], got):
                    ok.append(name)
            if not ok:
                return f"sample {k}: t2m differs from the store at its coords"
            how = ok[0]
        return f"ok (8 samples equal the store; coords = window {how})"
    except Exception as e:  # noqa: BLE001
        return f"ok (not verified: {type(e).__name__}: {e})"


# ======================================================================================
# parent side
# ======================================================================================

def run_child(argv: list[str], timeout: float) -> dict:
    """Run one child; sample RSS/PSS of its process tree every 0.1 s; return its JSON + measurements."""
    import psutil

    peak = {"rss": 0, "pss": 0, "main_rss": 0}
    load = [os.getloadavg()[0]]
    killed = {"why": None}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
        done = threading.Event()

        def sampler():
            try:
                pp = psutil.Process(p.pid)
            except psutil.Error:
                return
            k = 0
            while not done.wait(0.1):
                k += 1
                if k % 20 == 0:
                    load.append(os.getloadavg()[0])
                if time.perf_counter() - t0 > timeout:
                    killed["why"] = f"timeout > {timeout:.0f} s"
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    return
                try:
                    procs = [pp] + pp.children(recursive=True)
                    rss = pss = 0
                    for q in procs:
                        try:
                            mi = q.memory_full_info()
                            rss += mi.rss
                            pss += getattr(mi, "pss", mi.rss)
                            if q is pp:
                                peak["main_rss"] = max(peak["main_rss"], mi.rss)
                        except psutil.Error:
                            pass
                    peak["rss"] = max(peak["rss"], rss)
                    peak["pss"] = max(peak["pss"], pss)
                except psutil.Error:
                    pass

        th = threading.Thread(target=sampler, daemon=True)
        th.start()
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        done.set()
        th.join()
        # any leftover workers of a killed child
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        rc = os.waitstatus_to_exitcode(status)
        load.append(os.getloadavg()[0])
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
    lines = [l for l in stdout.splitlines() if l.startswith("{")]
    res = json.loads(lines[-1]) if lines else {}
    maxrss = ru.ru_maxrss * 1024
    res.update({
        "rc": rc, "wall": wall, "killed": killed["why"], "stderr": stderr[-1500:],
        "rss_mb": max(peak["rss"], maxrss) / 2**20, "pss_mb": peak["pss"] / 2**20,
        "main_rss_mb": max(peak["main_rss"], maxrss) / 2**20, "load_max": max(load),
    })
    return res


def child_argv(arm: str, w: int, store: Path, a, batches: int, warmup: int, wait_batches: int) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child", arm, str(w), str(store),
            "--batch-size", str(a.batch_size), "--batches", str(batches), "--warmup", str(warmup),
            "--wait-batches", str(wait_batches), "--seed", str(a.seed), "--prefetch", str(a.prefetch),
            "--workers", str(a.workers), "--np-group", str(a.np_group), "--xbatcher-nt-5", str(a.xbatcher_nt_5),
            "--xbatcher-chunks", a.xbatcher_chunks]


def budget(arm: str, a) -> tuple[int, int, int]:
    """(throughput batches, warm-up batches, wait batches) for an arm."""
    if arm == "xbatcher":
        return a.xbatcher_batches, a.xbatcher_warmup, a.xbatcher_wait_batches
    if arm == "numpy-global":
        return a.global_batches, 1, a.global_batches
    return a.batches, a.warmup, a.wait_batches


def expected_windows(store: Path, nt_override: int | None = None) -> dict[int, tuple[int, int]]:
    """{w: (valid windows, all windows)} from the NaN mask of time step 0 (the mask is fixed in time)."""
    import numpy as np
    import zarr

    g = zarr.open_group(str(store), mode="r")
    nt, nlat, nlon = g["t2m"].shape
    if nt_override:
        nt = nt_override
    bad = np.zeros((nlat, nlon), dtype=bool)
    for v in VARS:
        bad |= np.isnan(g[v][0])
    sat = np.zeros((nlat + 1, nlon + 1), dtype=np.int64)
    sat[1:, 1:] = bad.cumsum(0).cumsum(1)
    out = {}
    for w, (win, ov) in WINDOWS.items():
        s = win - ov
        cnt = window_sums(sat, win, s, origins(nlat, win, s), origins(nlon, win, s))
        out[w] = (int((cnt == 0).sum()) * nt, cnt.size * nt)
    return out


def store_info(store: Path) -> dict:
    import zarr

    g = zarr.open_group(str(store), mode="r")
    a = g["t2m"]
    files = [p for p in store.rglob("*") if p.is_file()]
    return {"shape": a.shape, "chunks": a.chunks, "raw": a.nbytes * len(VARS),
            "disk": sum(p.stat().st_size for p in files)}


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for pkg in ("zarrfusion", "xbatcher", "torch", "xarray", "zarr", "dask", "numpy"):
        try:
            parts.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            parts.append(f"{pkg} (not installed)")
    return ", ".join(parts)


def compiling_now() -> bool:
    import psutil

    for p in psutil.process_iter(["name"]):
        if (p.info["name"] or "") in ("rustc", "cargo", "cc1", "cc1plus", "ld", "lld", "mold"):
            return True
    return False


def f1(x, nd=1):
    return "-" if x is None else f"{x:,.{nd}f}"


def fmt_rate(x):
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def parent(a) -> int:
    for s in (BIG,) + ((SMALL,) if a.small else ()):
        if not (s / ".zmetadata").exists():
            print(f"missing {s}: run .venv/bin/python bench/make_loader_data.py first", file=sys.stderr)
            return 2
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    for x in arms:
        if x not in ARMS:
            print(f"unknown arm {x}; choose from {','.join(ARMS)}", file=sys.stderr)
            return 2
    wins = [int(x) for x in a.windows.split(",") if x.strip()]
    info = store_info(BIG)
    exp = expected_windows(BIG)
    print(f"store {BIG}: {', '.join(VARS)} {tuple(info['shape'])} float32, chunks {tuple(info['chunks'])}, "
          f"{info['raw'] / 1e9:.3f} GB raw, {info['disk'] / 1e9:.3f} GB on disk", flush=True)
    for w in wins:
        print(f"  {w}x{w}: {exp[w][0]:,} valid windows of {exp[w][1]:,}", flush=True)
    notes = []
    if compiling_now():
        notes.append("a compiler (cargo/rustc) was running when the benchmark started: times are inflated")
    results: dict[tuple[str, int, str], dict] = {}
    plan = [(arm, w, "big") for w in wins for arm in arms]
    if a.small:
        plan += [(arm, w, "small") for w in wins for arm in arms
                 if arm in ("zarrfusion", "zarrfusion-cached", "numpy") or (arm == "xbatcher" and not (w == 5 and a.xbatcher_nt_5 > 0))]
    skipped: dict[str, str] = {}
    for arm, w, which in plan:
        if arm in skipped:
            continue
        store = BIG if which == "big" else SMALL
        nb, nw, nwait = budget(arm, a)
        argv = child_argv(arm, w, store, a, nb, nw, nwait)
        print(f"\n{arm} {w}x{w} on {store.name}: {nb} batches + {nw} warm-up + {nwait} waited, "
              f"timeout {a.timeout:.0f} s", flush=True)
        r = run_child(argv, a.timeout)
        if r.get("skip") or r["rc"] == SKIP_RC:
            skipped[arm] = r.get("skip", "not available")
            print(f"  SKIPPED: {skipped[arm]} (rows marked pending)", flush=True)
            continue
        r["ok"] = r["rc"] == 0 and not r["killed"] and "samples_s" in r
        results[(arm, w, which)] = r
        if r["ok"]:
            extra = f", index {r['t_index']:.1f} s for {r['n_patches']:,} patches" if "t_index" in r else ""
            if "n_windows" in r:
                extra += f", len(windows) {r['n_windows']} in {r['t_len']:.3f} s"
            print(f"  first batch {r['t_first']:.3f} s, {fmt_rate(r['samples_s'])} samples/s "
                  f"({r['samples']} samples in {r['t_thr']:.2f} s), wait median {f1(r['wait_median_ms'], 2)} ms "
                  f"p95 {f1(r['wait_p95_ms'], 2)} ms, peak RSS {r['rss_mb']:.0f} MB (PSS {r['pss_mb']:.0f}, "
                  f"main {r['main_rss_mb']:.0f}), load {r['load_max']:.1f}, check: {r['check']}{extra}", flush=True)
        else:
            print(f"  FAILED rc={r['rc']} {r['killed'] or ''}: {r['stderr'][-800:]}", flush=True)
    text = report(a, arms, wins, results, skipped, exp, info, notes)
    print("\n" + text)
    if not a.no_write:
        with open(RESULTS, "a") as f:
            f.write("\n" + text + "\n")
        print(f"appended to {RESULTS}")
    return 0


def report(a, arms, wins, results, skipped, exp, info, notes) -> str:
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
    cmd = " ".join(shlex.quote(x) for x in [".venv/bin/python", "bench/bench_loader.py"] + sys.argv[1:])
    loads = [r["load_max"] for r in results.values()]
    L = []
    L.append(f"## Loader run {_dt.datetime.now().strftime('%Y-%m-%d %H:%M')} (issue 3: ML window loader)\n")
    L.append(f"- Command: `{cmd}`")
    L.append(f"- Machine: {os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, {platform.system()} {platform.release()}, "
             f"Python {platform.python_version()}; {versions()}")
    L.append(f"- Store: `bench/data/era5_loader.zarr` (Zarr v2 written by xarray, t2m/u10/v10 {tuple(info['shape'])} float32, "
             f"chunks {tuple(info['chunks'])}, blosc lz4; {info['raw'] / 1e9:.3f} GB raw, {info['disk'] / 1e9:.3f} GB on disk; "
             "u10/v10 NaN on a fixed 5.05 % of cells); in the page cache")
    L.append(f"- Batches of {a.batch_size}; per run: first batch, then samples/s over N batches without a training step, "
             f"then {STEP_S * 1e3:.0f} ms simulated training step per batch: warm-up batches, then the waited batches "
             f"(N / warm-up / waited: zarrfusion and numpy {a.batches} / {a.warmup} / {a.wait_batches}, "
             f"xbatcher {a.xbatcher_batches} / {a.xbatcher_warmup} / {a.xbatcher_wait_batches} (it is slow), "
             f"numpy-global {a.global_batches} / 1 / {a.global_batches})")
    L.append(f"- 1-min load average during the runs: up to {max(loads, default=0):.1f}"
             + (" (another process, e.g. a cargo build, was using CPU: times are inflated)" if max(loads, default=0) > 1.5 else ""))
    for arm, why in skipped.items():
        L.append(f"- **{arm} arm pending**: {why}")
    for n in notes:
        L.append(f"- NOTE: {n}")
    L.append("")
    order = ARMS
    for w in wins:
        win, ov = WINDOWS[w]
        L.append(f"### {win}x{win} windows, overlap {ov} (stride {win - ov}); {exp[w][0]:,} valid windows of {exp[w][1]:,}\n")
        L.append("| arm | samples/s | vs xbatcher | first batch s | wait median ms | wait p95 ms | peak RSS MB (tree) | peak PSS MB | "
                 "mean batch | time steps / batch | notes |")
        L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        xb = results.get(("xbatcher", w, "big"))
        xb_rate = xb["samples_s"] if xb and xb.get("ok") else None
        for arm in order:
            if arm not in arms:
                continue
            r = results.get((arm, w, "big"))
            if arm in skipped or r is None:
                L.append(f"| {arm} | pending | | | | | | | | | {skipped.get(arm, 'not run')} |")
                continue
            if not r["ok"]:
                L.append(f"| {arm} | FAILED | | | | | | | | | {r['killed'] or 'rc ' + str(r['rc'])}: "
                         f"{r['stderr'][-160:].replace(chr(10), ' ').replace('|', '/')} |")
                continue
            ratio = f"{r['samples_s'] / xb_rate:,.1f}x" if xb_rate and r["samples_s"] else "-"
            note = []
            if arm == "xbatcher":
                note.append(f"index {r['t_index']:.1f} s, {r['n_patches']:,} patches over {r['xbatcher_nt']} time step(s)")
            if arm.startswith("zarrfusion"):
                note.append(f"index {r.get('index')}")
                note.append(f"len(windows) {r.get('n_windows')} ({'= expected' if r.get('n_windows') == exp[w][0] else 'expected ' + format(exp[w][0], ',')}) in {r.get('t_len', 0):.3f} s")
                if isinstance(r.get("stats"), dict):
                    note.append("stats " + ", ".join(f"{k} {v}" for k, v in r["stats"].items()))
            if r["check"] != "ok":
                note.append(r["check"])
            L.append(f"| {arm} | {fmt_rate(r['samples_s'])} | {ratio} | {r['t_first']:.3f} | {f1(r['wait_median_ms'], 2)} | "
                     f"{f1(r['wait_p95_ms'], 2)} | {r['rss_mb']:.0f} | {r['pss_mb']:.0f} | {f1(r['mean_batch'])} | "
                     f"{f1(r['t_per_batch'])} | {'; '.join(note)} |")
        L.append("")
    small = [(k, r) for k, r in results.items() if k[2] == "small"]
    if small:
        s_nt = None
        try:
            s_nt = store_info(SMALL)["shape"][0]
        except Exception:  # noqa: BLE001
            pass
        L.append(f"Peak RSS against dataset size: the same runs on `era5_loader_small.zarr` ({s_nt} time steps, "
                 f"vs {info['shape'][0]}):\n")
        L.append("| arm | window | RSS MB (tree) big | RSS MB (tree) small | PSS MB big | PSS MB small | big / small (PSS) |")
        L.append("|---|---|---:|---:|---:|---:|---:|")
        for (arm, w, _), r in sorted(small, key=lambda kv: (kv[0][1], order.index(kv[0][0]))):
            b = results.get((arm, w, "big"))
            if not (b and b["ok"] and r["ok"]):
                big_s = f"{b['rss_mb']:.0f}" if b and b["ok"] else "-"
                small_s = f"{r['rss_mb']:.0f}" if r["ok"] else "FAILED"
                L.append(f"| {arm} | {w}x{w} | {big_s} | {small_s} | | | |")
                continue
            L.append(f"| {arm} | {w}x{w} | {b['rss_mb']:.0f} | {r['rss_mb']:.0f} | {b['pss_mb']:.0f} | {r['pss_mb']:.0f} | "
                     f"{b['pss_mb'] / r['pss_mb']:.2f} |")
        L.append("")
    L.append("Semantics (all arms): a sample = one time step x one window over (lat, lon) in the store's index order; "
             "origins 0, s, 2s, ... <= N - w (no padding, no longitude wrap); valid = no NaN in t2m, u10 or v10 anywhere "
             "in the window. zarrfusion: `windows(input_dims, input_overlap, valid=\"all\").loader(batch_size=256, "
             "shuffle=\"block\", seed=0, drop_last=True, prefetch=8)`; numpy: time chunks in random order, "
             f"{a.np_group} at a time decoded, all their valid windows in random order (synchronous); numpy-global: "
             "uniformly random origins over the whole store per batch (zarr-python reads, LRU cache of 8 time steps); "
             "xbatcher: `BatchGenerator(xr.open_zarr(store" + (", chunks=None" if a.xbatcher_chunks != "dask" else "")
             + ")[vars], input_dims={lat: w, lon: w}, input_overlap, batch_dims={time: 1})` -> "
             f"`xbatcher.loaders.torch.MapDataset` -> `DataLoader(batch_size=256, shuffle=True, num_workers={a.workers}, "
             "drop_last=True)`, NaN samples dropped in the collate_fn (`mean batch` = valid samples per batch of 256 "
             "drawn). samples/s counts delivered valid samples. `time steps / batch`: distinct time steps in a batch "
             "(how mixed a batch is). First batch: from loader construction (store open, index) to the first batch, "
             "imports excluded. Peak RSS: sum over the process and its workers, sampled every 0.1 s "
             "(PSS counts pages shared between forked workers once). "
             + (f"xbatcher 5x5 runs on the first {a.xbatcher_nt_5} time step(s) only: on the whole store its "
                f"BatchGenerator would build {exp[5][1]:,} selectors up front (one dict per window)." if 5 in wins and a.xbatcher_nt_5 > 0 else ""))
    L.append("")
    return "\n".join(L)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer batches (50 / 3 / 20; xbatcher 3 / 1 / 3; numpy-global 2 / 1 / 2)")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ",".join(ARMS))
    ap.add_argument("--windows", default="5,48", help="comma-separated subset of 5,48")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--batches", type=int, default=200, help="throughput batches after the first (default 200)")
    ap.add_argument("--warmup", type=int, default=5, help="warm-up batches with the 10 ms step before waits are recorded")
    ap.add_argument("--wait-batches", type=int, default=100, help="batches whose wait is recorded (default 100)")
    ap.add_argument("--xbatcher-batches", type=int, default=5, help="xbatcher throughput batches (default 5)")
    ap.add_argument("--xbatcher-warmup", type=int, default=2, help="xbatcher warm-up batches (default 2)")
    ap.add_argument("--xbatcher-wait-batches", type=int, default=6, help="xbatcher waited batches (default 6)")
    ap.add_argument("--xbatcher-nt-5", type=int, default=1,
                    help="time steps xbatcher's 5x5 run uses (0 = whole store, infeasible: ~55 GB of selectors)")
    ap.add_argument("--xbatcher-chunks", choices=["none", "dask"], default="none",
                    help="xr.open_zarr(chunks=None) (default, 2x faster per sample) or dask chunks")
    ap.add_argument("--global-batches", type=int, default=3, help="numpy-global throughput and waited batches")
    ap.add_argument("--workers", type=int, default=2, help="torch DataLoader workers (default 2)")
    ap.add_argument("--np-group", type=int, default=4, help="numpy arm: time chunks decoded at a time (default 4)")
    ap.add_argument("--prefetch", type=int, default=8, help="zarrfusion loader prefetch (default 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-small", dest="small", action="store_false",
                    help="skip the RSS-vs-dataset-size runs on era5_loader_small.zarr")
    ap.add_argument("--timeout", type=float, default=300, help="per-run timeout in seconds (default 300)")
    ap.add_argument("--no-write", action="store_true", help="do not append to bench/RESULTS.md")
    ap.add_argument("--child", nargs=3, metavar=("ARM", "W", "STORE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.quick:
        a.batches, a.warmup, a.wait_batches = 50, 3, 20
        a.xbatcher_batches, a.xbatcher_warmup, a.xbatcher_wait_batches, a.global_batches = 3, 1, 3, 2
    if a.child:
        return child(a)
    return parent(a)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Issue 28 benchmark: xarray's everyday climate operations in plain SQL.

    .venv/bin/python bench/make_era5.py                  # once: bench/data/era5_1gb.zarr
    .venv/bin/python bench/bench_climate.py [--repeats 3] [--queries daily,climatology,coarsen]
                                            [--arms zarrfusion,zarrfusion-hash,...]

On the hourly ERA5-like store (264 x 721 x 1440 float32, 1.1 GB decoded, one
chunk per hour), each query computed to a result in memory by every arm, each
run a fresh subprocess (peak RSS of its process tree sampled every 0.05 s by
bench/measure.py; the time is the arm's own, from opening the store to the
result in memory):

  daily        the daily mean of every cell
               SQL: GROUP BY date_trunc('day', time), lat, lon
               xarray: ds.t2m.resample(time="1D").mean()
  climatology  the monthly climatology of every cell
               SQL: GROUP BY extract(month FROM time), lat, lon
               xarray: ds.t2m.groupby("time.month").mean()
  coarsen      the first day on a 2x2 coarser grid (the bins are coarsen's blocks)
               SQL: GROUP BY time, floor((lat - 89.75) / 0.5), floor(lon / 0.5)
                    WHERE time < '2020-01-02'
               xarray: ds.t2m.isel(time=slice(0, 24)).coarsen(lat=2, lon=2, boundary="pad").mean()
  rolling      the 24-hour running mean of every cell (its count and sum)
               SQL: avg(t2m) OVER (PARTITION BY lat, lon ORDER BY time
                    ROWS BETWEEN 23 PRECEDING AND CURRENT ROW)
               xarray: ds.t2m.astype("float64").rolling(time=24, min_periods=1).mean()
  cumulative   the running total of every cell from the first hour (its count and sum)
               SQL: sum(t2m) OVER (PARTITION BY lat, lon ORDER BY time)  (the default frame:
                    from the series' start to the row)
               xarray: ds.t2m.astype("float64").cumsum("time")
  remaining    the total of every cell from each hour to the last (its count and sum)
               SQL: sum(t2m) OVER (PARTITION BY lat, lon ORDER BY time DESC)  (the default
                    frame against the grid's order: from the row to the series' end)
               xarray: the reversed series' cumsum("time"), reversed back
  rolling-zarr the same 24-hour running mean of every cell written to a new Zarr store
               (v3, float64, the source's chunks (1, 721, 1440), zstd level 3, with coordinates)
               SQL: COPY (SELECT time, lat, lon, avg(t2m) OVER (...) AS m FROM era5)
                    TO '...' STORED AS ZARR OPTIONS ('chunks' 'time=1,lat=721,lon=1440', 'codec' 'zstd')
               xarray: that result .to_dataset(name="m").to_zarr(..., encoding: the same chunks and codec)
               (the store's count and sum are read back after the timer stops)
  daily-zarr   the daily mean of every cell written to a new Zarr store (v3, float64 as
               SQL's avg, one chunk (1, 721, 1440) per day, zstd level 3, with coordinates)
               SQL: COPY (SELECT date_trunc('day', time) AS time, lat, lon, avg(t2m) AS m
                    FROM era5 GROUP BY 1, 2, 3) TO '...' STORED AS ZARR OPTIONS (the same chunks, 'codec' 'zstd')
               xarray: ds.t2m.resample(time="1D").mean() as float64, .to_zarr(...) as rolling-zarr
  anomaly      each hour's anomaly against the monthly climatology of its cell,
               reduced to a zonal mean time series (a join with the climatology)
               SQL: WITH clim AS (... GROUP BY extract(month FROM time), lat, lon)
                    SELECT time, lat, avg(t2m - c) FROM era5 JOIN clim ON
                    extract(month FROM era5.time) = clim.month AND lat, lon equal GROUP BY 1, 2
               xarray: (t2m.groupby("time.month") - t2m.groupby("time.month").mean()).mean("lon")
                       (float64, as SQL)
  anomaly-window  the same anomaly's zonal mean written as a window (the climatology as
               `avg(t2m) OVER (PARTITION BY extract(month FROM time), lat, lon)`)
               xarray: as anomaly
  anomaly-rolling  the 24-hour running mean of every cell's anomaly against its monthly
               climatology (the climatology joined in, then rolled), reduced to its count
               and sum of squares
               SQL: avg(era5.t2m - clim.c) OVER (PARTITION BY lat, lon ORDER BY time
                    ROWS BETWEEN 23 PRECEDING AND CURRENT ROW) over era5 JOIN clim (as anomaly)
               xarray: (t2m.groupby("time.month") - its mean).rolling(time=24, min_periods=1).mean()
                       (float64, as SQL)
  resample-3h  the 3-hourly mean of every cell (91 M groups, more group state than one pass
               holds: the dense reduction runs in bands of time bins), its count and sum
               SQL: GROUP BY date_bin(INTERVAL '3 hours', time), lat, lon
               xarray: ds.t2m.resample(time="3h").mean()
  resample-3h-zarr  the same 3-hourly means written to a new Zarr store (as daily-zarr:
               float64, one chunk (1, 721, 1440) per bin, zstd level 3, with coordinates;
               2.2 GB of float64 written as the reduction's bands come)
               xarray: ds.t2m.resample(time="3h").mean() as float64, .to_zarr(...) as rolling-zarr
  diurnal      the mean and standard deviation of every cell at each hour of the day (25 M
               groups, more group state than one pass holds; the hours repeat along time, so
               the dense reduction runs in bands of latitudes), their count and sum
               SQL: GROUP BY extract(hour FROM time), lat, lon: avg(t2m), stddev_pop(t2m)
               xarray: hours = ds.t2m.groupby("time.hour"); hours.mean() + hours.std()
  diurnal-zarr the same mean and spread written to a new Zarr store (v3, float64, chunks
               (1, 721, 1440), zstd level 3; the reduction's bands of latitudes written as they
               come, each chunk in four parts)
               xarray: the mean and std as a dataset, .to_zarr(...) as rolling-zarr
  read         the physical floor: one read of every chunk (SQL: sum(t2m);
               xarray: the array loaded and summed); the coarsen query reads 1/11 of it

Arms:
  zarrfusion       the Python package (ZARRFUSION_PYTHON, default
                   ~/.cache/zarrfusion-venv/bin/python), allowed_mem 2GB, SQL to an Arrow table
  zarrfusion-hash  the same with zarrfusion.dense_reduction, rolling_window and
                   broadcast_join off: DataFusion's hash aggregation, its sort +
                   window and its hash join, the plans these queries had before issue 28
  xarray-flox      xr.open_zarr(chunks=None), the variable loaded (numpy in memory), flox's default engine
                   (xarray uses flox when it is installed)
  xarray-numbagg   the same with engine="numbagg" (groupby/resample only: coarsen does not use flox)
  xarray-dask      xr.open_zarr(store) (the store's chunks), dask threads with 2 workers, flox
  xarray-sql       the same SQL through xarray_sql (partitions = the store's chunks)

Each run's address space is capped (--mem-limit-gb, default 12 GiB): a run
that needs more fails with its MemoryError (reported, not retried). Every arm's answer is checked against xarray-flox's (group count and the sum of the
means, relative 1e-6). A section with the exact command is appended to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from measure import report, run_child  # noqa: E402

STORE = HERE / "data" / "era5_1gb.zarr"
RESULTS = HERE / "RESULTS.md"
ZF_PYTHON = os.environ.get("ZARRFUSION_PYTHON", str(Path.home() / ".cache" / "zarrfusion-venv" / "bin" / "python"))
ARMS = ["zarrfusion", "zarrfusion-hash", "xarray-flox", "xarray-numbagg", "xarray-dask", "xarray-sql"]
QUERIES = ["read", "daily", "climatology", "coarsen", "rolling", "cumulative", "remaining",
           "rolling-zarr", "daily-zarr", "anomaly", "anomaly-window", "anomaly-rolling", "resample-3h",
           "resample-3h-zarr", "diurnal", "diurnal-zarr"]
# Where rolling-zarr writes (removed before and after each run).
OUT = HERE / "data" / "rolling_out.zarr"
ROLLING = ("avg(t2m) OVER (PARTITION BY lat, lon ORDER BY time ROWS BETWEEN 23 PRECEDING AND "
           "CURRENT ROW)")

SQL = {
    "read": "SELECT sum(t2m) AS m FROM era5",
    "daily": "SELECT date_trunc('day', time) AS day, lat, lon, avg(t2m) AS m FROM era5 GROUP BY 1, 2, 3",
    "climatology": "SELECT extract(month FROM time) AS month, lat, lon, avg(t2m) AS m FROM era5 GROUP BY 1, 2, 3",
    "coarsen": "SELECT time, floor((lat - 89.75) / 0.5) AS la, floor(lon / 0.5) AS lo, avg(t2m) AS m "
               "FROM era5 WHERE time < TIMESTAMP '2020-01-02' GROUP BY 1, 2, 3",
    # The running mean of every cell, reduced to its count and sum so that
    # no arm holds 274 M rows of result.
    "rolling": "SELECT count(m) AS n, sum(m) AS m FROM (SELECT avg(t2m) OVER (PARTITION BY lat, lon "
               "ORDER BY time ROWS BETWEEN 23 PRECEDING AND CURRENT ROW) AS m FROM era5)",
    "cumulative": "SELECT count(m) AS n, sum(m) AS m FROM (SELECT sum(t2m) OVER (PARTITION BY lat, lon "
                  "ORDER BY time) AS m FROM era5)",
    "remaining": "SELECT count(m) AS n, sum(m) AS m FROM (SELECT sum(t2m) OVER (PARTITION BY lat, lon "
                 "ORDER BY time DESC) AS m FROM era5)",
    "rolling-zarr": f"COPY (SELECT time, lat, lon, {ROLLING} AS m FROM era5) TO '{OUT}' STORED AS "
                    "ZARR OPTIONS ('chunks' 'time=1,lat=721,lon=1440', 'codec' 'zstd')",
    "daily-zarr": "COPY (SELECT date_trunc('day', time) AS time, lat, lon, avg(t2m) AS m FROM era5 "
                  f"GROUP BY 1, 2, 3) TO '{OUT}' STORED AS ZARR OPTIONS ('chunks' 'time=1,lat=721,lon=1440', "
                  "'codec' 'zstd')",
    # 3-hourly means of every cell (91 M groups: more group state than one
    # pass holds), reduced to their count and sum as the rolling mean is.
    "resample-3h": "SELECT count(m) AS n, sum(m) AS m FROM (SELECT date_bin(INTERVAL '3 hours', time) "
                   "AS t, lat, lon, avg(t2m) AS m FROM era5 GROUP BY 1, 2, 3)",
    "resample-3h-zarr": "COPY (SELECT date_bin(INTERVAL '3 hours', time) AS time, lat, lon, avg(t2m) AS m "
                        f"FROM era5 GROUP BY 1, 2, 3) TO '{OUT}' STORED AS ZARR OPTIONS ('chunks' "
                        "'time=1,lat=721,lon=1440', 'codec' 'zstd')",
    # The diurnal cycle's mean and spread of every cell (25 M groups, over
    # the state one pass holds; the hours repeat along time), reduced to the
    # count and the sum of mean + spread.
    "diurnal": "SELECT count(m) AS n, sum(m + s) AS m FROM (SELECT extract(hour FROM time) AS h, lat, "
               "lon, avg(t2m) AS m, stddev_pop(t2m) AS s FROM era5 GROUP BY 1, 2, 3)",
    # The same mean and spread written to a new Zarr store (the reduction's
    # bands of latitudes written as they come).
    "diurnal-zarr": "COPY (SELECT extract(hour FROM time) AS hour, lat, lon, avg(t2m) AS m, "
                    "stddev_pop(t2m) AS s FROM era5 GROUP BY 1, 2, 3) TO "
                    f"'{OUT}' STORED AS ZARR OPTIONS ('dims' 'hour,lat,lon', "
                    "'chunks' 'hour=1,lat=721,lon=1440', 'codec' 'zstd')",
    "anomaly": "WITH clim AS (SELECT extract(month FROM time) AS month, lat, lon, avg(t2m) AS c "
               "FROM era5 GROUP BY 1, 2, 3) "
               "SELECT era5.time, era5.lat, avg(era5.t2m - clim.c) AS m FROM era5 JOIN clim "
               "ON extract(month FROM era5.time) = clim.month AND era5.lat = clim.lat "
               "AND era5.lon = clim.lon GROUP BY 1, 2",
    "anomaly-window": "SELECT time, lat, avg(a) AS m FROM (SELECT time, lat, lon, t2m - avg(t2m) OVER "
                      "(PARTITION BY extract(month FROM time), lat, lon) AS a FROM era5) GROUP BY 1, 2",
    # Its sum of squares: running means of anomalies sum to nearly zero.
    "anomaly-rolling": "WITH clim AS (SELECT extract(month FROM time) AS month, lat, lon, avg(t2m) AS c "
                       "FROM era5 GROUP BY 1, 2, 3) "
                       "SELECT count(m) AS n, sum(m * m) AS m FROM (SELECT avg(era5.t2m - clim.c) OVER "
                       "(PARTITION BY era5.lat, era5.lon ORDER BY era5.time ROWS BETWEEN 23 PRECEDING "
                       "AND CURRENT ROW) AS m FROM era5 JOIN clim ON extract(month FROM era5.time) = "
                       "clim.month AND era5.lat = clim.lat AND era5.lon = clim.lon)",
}


def child(arm: str, query: str, mem_limit_gb: float) -> dict:
    """One run of `query` by `arm`, in this process: seconds, groups, checksum
    (imports are not timed). Its address space is capped at `mem_limit_gb`:
    an arm that needs more fails with its MemoryError instead of taking the
    machine down."""
    import resource

    cap = int(mem_limit_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    import numpy as np

    if arm.startswith("zarrfusion"):
        import zarrfusion as zf

        started = time.perf_counter()
        off = {"zarrfusion.dense_reduction": "false", "zarrfusion.rolling_window": "false",
               "zarrfusion.broadcast_join": "false"}
        config = off if arm == "zarrfusion-hash" else None
        ctx = zf.SessionContext(allowed_mem="2GB", config=config)
        ctx.register_zarr("era5", str(STORE))
        clear_out()
        table = ctx.sql(SQL[query]).to_arrow_table()
        seconds = time.perf_counter() - started
        if query.endswith("-zarr"):
            return {"seconds": seconds, **written()}
        return {"seconds": seconds, **answer(query, table)}
    if arm == "xarray-sql":
        if query.endswith("-zarr"):
            return {"skipped": "xarray-sql answers Arrow tables; it does not write Zarr"}
        import xarray as xr
        import xarray_sql

        started = time.perf_counter()
        ds = xr.open_zarr(STORE, chunks=None)
        ctx = xarray_sql.Context()
        ctx.from_dataset("era5", ds)
        table = ctx.sql(SQL[query]).to_arrow_table()
        seconds = time.perf_counter() - started
        return {"seconds": seconds, **answer(query, table)}

    import xarray as xr

    if arm == "xarray-dask":
        import dask

        dask.config.set(scheduler="threads", num_workers=2)
    started = time.perf_counter()
    if arm == "xarray-dask":
        ds = xr.open_zarr(STORE)
        t2m = ds.t2m
    else:
        # In memory: loaded first (grouping the lazily indexed backend array
        # indexes zarr with arrays of the whole grid: over 20 GB).
        t2m = xr.open_zarr(STORE, chunks=None).t2m.load()
    kwargs = {"engine": "numbagg"} if arm == "xarray-numbagg" else {}
    if query == "read":
        out = t2m.astype("float64").sum()
    elif query == "daily":
        out = t2m.resample(time="1D").mean(**kwargs)
    elif query == "daily-zarr":
        # float64, as SQL's avg.
        out = t2m.resample(time="1D").mean(**kwargs).astype("float64")
    elif query == "climatology":
        out = t2m.groupby("time.month").mean(**kwargs)
    elif query == "resample-3h":
        out = t2m.resample(time="3h").mean(**kwargs)
    elif query == "diurnal":
        # xarray's std: ddof=0, as SQL's stddev_pop.
        hours = t2m.groupby("time.hour")
        out = hours.mean(**kwargs) + hours.std(**kwargs)
    elif query == "resample-3h-zarr":
        out = t2m.resample(time="3h").mean(**kwargs).astype("float64")
    elif query == "diurnal-zarr":
        hours = t2m.groupby("time.hour")
        out = xr.Dataset({"m": hours.mean(**kwargs).astype("float64"),
                          "s": hours.std(**kwargs).astype("float64")})
    elif query == "coarsen":
        if arm == "xarray-numbagg":
            return {"skipped": "coarsen does not go through flox"}
        out = t2m.isel(time=slice(0, 24)).coarsen(lat=2, lon=2, boundary="pad").mean()
    elif query in ("rolling", "rolling-zarr"):
        if arm == "xarray-numbagg":
            return {"skipped": "xarray's rolling already uses numbagg (when installed) in the xarray-flox arm"}
        # float64, as SQL's avg; min_periods=1: SQL's frames at the start.
        out = t2m.astype("float64").rolling(time=24, min_periods=1).mean()
    elif query == "cumulative":
        if arm == "xarray-numbagg":
            return {"skipped": "cumsum does not go through flox or numbagg"}
        # float64, as SQL's sum; NaN skipped (a cell with no value yet: 0
        # here, NULL in SQL; the store has none).
        out = t2m.astype("float64").cumsum("time")
    elif query == "remaining":
        if arm == "xarray-numbagg":
            return {"skipped": "cumsum does not go through flox or numbagg"}
        back = {"time": slice(None, None, -1)}
        out = t2m.astype("float64").isel(back).cumsum("time").isel(back)
    elif query in ("anomaly", "anomaly-window"):
        # float64, as SQL's subtraction and avg.
        t64 = t2m.astype("float64")
        months = t64.groupby("time.month")
        out = (months - months.mean(**kwargs)).mean("lon")
    elif query == "anomaly-rolling":
        t64 = t2m.astype("float64")
        months = t64.groupby("time.month")
        out = (months - months.mean(**kwargs)).rolling(time=24, min_periods=1).mean()
    if query.endswith("-zarr"):
        from zarr.codecs import ZstdCodec

        clear_out()
        ds = out if isinstance(out, xr.Dataset) else out.to_dataset(name="m")
        encoding = {v: {"chunks": (1, 721, 1440), "compressors": [ZstdCodec(level=3)]}
                    for v in ds.data_vars}
        if arm == "xarray-dask":
            # dask's rolling splits lat and lon; a Zarr chunk may not span dask chunks.
            ds = ds.chunk({"lat": -1, "lon": -1})
        for v in ds.variables.values():
            # The source's v2 codecs and chunks do not carry over; CF time encoding does.
            v.encoding = {k: v.encoding[k] for k in ("units", "calendar", "dtype") if k in v.encoding}
        ds.to_zarr(OUT, mode="w-", zarr_format=3, consolidated=True, encoding=encoding)
        seconds = time.perf_counter() - started
        return {"seconds": seconds, **written()}
    values = np.asarray(out.values, dtype="float64")
    seconds = time.perf_counter() - started
    if query in ("rolling", "cumulative", "remaining", "resample-3h", "diurnal"):
        return {"seconds": seconds, "groups": int(np.count_nonzero(~np.isnan(values))),
                "checksum": float(np.nansum(values))}
    if query in ("anomaly", "anomaly-window"):
        # Anomalies sum to zero: their squares are the checksum.
        return {"seconds": seconds, "groups": int(values.size), "checksum": float(np.nansum(values**2))}
    if query == "anomaly-rolling":
        return {"seconds": seconds, "groups": int(np.count_nonzero(~np.isnan(values))),
                "checksum": float(np.nansum(values**2))}
    return {"seconds": seconds, "groups": int(values.size), "checksum": float(np.nansum(values))}


def clear_out() -> None:
    import shutil

    shutil.rmtree(OUT, ignore_errors=True)


def written() -> dict:
    """The count and sum of the values a -zarr query wrote (read
    back step by step with zarr-python), then the store removed."""
    import numpy as np
    import zarr

    m = zarr.open_group(str(OUT), mode="r")["m"]
    assert m.shape in ((264, 721, 1440), (11, 721, 1440), (88, 721, 1440), (24, 721, 1440)), m.shape
    count, total = 0, 0.0
    for i in range(m.shape[0]):
        hour = np.asarray(m[i], dtype="float64")
        count += int(np.count_nonzero(~np.isnan(hour)))
        total += float(np.nansum(hour))
    clear_out()
    return {"groups": count, "checksum": total}


def answer(query: str, table) -> dict:
    """Group count and checksum of an SQL arm's Arrow table (the rolling
    query: its count and sum of the running means)."""
    import numpy as np

    m = table.column("m").to_numpy(zero_copy_only=False).astype("float64")
    if query in ("rolling", "cumulative", "remaining", "anomaly-rolling", "resample-3h", "diurnal"):
        return {"groups": int(table.column("n")[0].as_py()), "checksum": float(m[0])}
    if query in ("anomaly", "anomaly-window"):
        return {"groups": table.num_rows, "checksum": float(np.nansum(m**2))}
    return {"groups": table.num_rows, "checksum": float(np.nansum(m))}


def codec_floor() -> dict:
    """The codec's floor for rolling-zarr: zstd level 3 (numcodecs, the
    codec both arms write with) encoding 24 hours of running means (computed
    with numpy from 47 hours of the store), on one thread and on two,
    scaled to the 264 hours."""
    from concurrent.futures import ThreadPoolExecutor

    import numcodecs
    import numpy as np
    import zarr

    t2m = zarr.open_group(str(STORE), mode="r")["t2m"]
    hours = np.asarray(t2m[:47], dtype="float64")
    sums = np.nancumsum(hours, axis=0)
    counts = np.cumsum(~np.isnan(hours), axis=0)
    chunks = [np.ascontiguousarray((sums[i] - sums[i - 24]) / (counts[i] - counts[i - 24]))
              for i in range(23, 47)]
    codec = numcodecs.Zstd(level=3)
    out = {}
    for threads in (1, 2):
        started = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            encoded = list(pool.map(codec.encode, chunks))
        out[threads] = (time.perf_counter() - started) * 264 / 24
    ratio = sum(c.nbytes for c in chunks) / sum(len(e) for e in encoded)
    return {"one_thread_s": out[1], "two_threads_s": out[2], "ratio": ratio}


def python_for(arm: str) -> str:
    return ZF_PYTHON if arm.startswith("zarrfusion") else sys.executable


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--queries", default=",".join(QUERIES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--mem-limit-gb", type=float, default=12,
                    help="address space cap of each run (default 12 GiB); a run over it fails")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        if a.child[0] == "floor":
            print(json.dumps(codec_floor()))
        else:
            print(json.dumps(child(*a.child, a.mem_limit_gb)))
        return 0
    if not STORE.exists():
        sys.exit(f"{STORE} is missing: run bench/make_era5.py first")

    results: dict[tuple[str, str], list[dict]] = {}
    for query in a.queries.split(","):
        for arm in a.arms.split(","):
            runs = []
            for _ in range(a.repeats):
                r = run_child([python_for(arm), __file__, "--child", arm, query,
                               "--mem-limit-gb", str(a.mem_limit_gb)], a.timeout)
                runs.append(r)
                print(query, arm, r, flush=True)
                if "error" in r or "skipped" in r:
                    break
            results[(query, arm)] = runs

    floor = None
    if "rolling-zarr" in a.queries.split(","):
        done = subprocess.run([sys.executable, __file__, "--child", "floor", "-"], capture_output=True,
                              text=True, check=True)
        floor = json.loads(done.stdout.strip().splitlines()[-1])
        print("codec floor", floor, flush=True)
    load = os.getloadavg()[0]
    lines = [
        f"## Climate operations in SQL (issue 28), {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"Command: `.venv/bin/python bench/bench_climate.py {' '.join(sys.argv[1:])}`".rstrip() + "  ",
        f"Machine: {os.cpu_count()} cores, {platform.platform()}; store {STORE.name} "
        f"(264 x 721 x 1440 float32, one chunk per hour); 1-minute load average at the end {load:.2f}.  ",
        f"zarrfusion at `{git_head()}`, allowed_mem 2GB. Time: best and median of {a.repeats} fresh "
        "processes (opening the store to the result in memory, or for the -zarr queries to "
        "the new store written); peak RSS: the largest of the runs' "
        "process trees. Ratio: the fastest xarray arm's best time over this arm's best time.",
        "",
        "| query | arm | best s | median s | peak RSS MiB | vs fastest xarray | groups | answer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for query in a.queries.split(","):
        ok = {arm: runs for (q, arm), runs in results.items() if q == query and runs and "seconds" in runs[-1]}
        xarray_best = min((min(r["seconds"] for r in runs) for arm, runs in ok.items()
                           if arm.startswith("xarray") and arm != "xarray-sql"), default=None)
        reference = ok.get("xarray-flox", [None])[-1]
        for arm in a.arms.split(","):
            runs = results.get((query, arm), [])
            if not runs:
                continue
            last = runs[-1]
            if "seconds" not in last:
                why = last.get("skipped") or last.get("error", "?")
                lines.append(f"| {query} | {arm} | - | - | - | - | - | {why} |")
                continue
            times = [r["seconds"] for r in runs]
            best, median = min(times), statistics.median(times)
            rss = max(r["peak_rss"] for r in runs) / 2**20
            ratio = f"{xarray_best / best:.2f}x" if xarray_best else "-"
            answer = "reference" if arm == "xarray-flox" else check(last, reference)
            lines.append(f"| {query} | {arm} | {best:.2f} | {median:.2f} | {rss:.0f} | {ratio} | "
                         f"{last['groups']} | {answer} |")
    if floor:
        lines += ["", f"Codec floor of rolling-zarr (zstd level 3 encoding the 264 hours of float64 running "
                  f"means, numcodecs, measured on 24 and scaled; compression ratio {floor['ratio']:.2f}): "
                  f"{floor['one_thread_s']:.2f} s on one thread, {floor['two_threads_s']:.2f} s on two."]
    report(lines, RESULTS, not a.no_write)
    return 0


def check(got: dict, reference: dict | None) -> str:
    if reference is None:
        return "no reference"
    same_groups = got["groups"] == reference["groups"]
    a, b = got["checksum"], reference["checksum"]
    close = abs(a - b) <= 1e-6 * max(abs(b), 1.0)
    return "same" if same_groups and close else f"DIFFERS ({got['groups']} groups, sum {a:.6g} vs {b:.6g})"


def git_head() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


if __name__ == "__main__":
    raise SystemExit(main())

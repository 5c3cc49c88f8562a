"""A session with workers: queries through two ``zarrfusion worker`` processes (the shell's
binary, which ``cargo test --workspace`` builds into ``$CARGO_TARGET_DIR/debug``) give xarray's
answers, ``EXPLAIN`` shows the stages, and a worker nobody listens on fails the query naming it."""

from __future__ import annotations

import os
import pathlib
import select
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pandas as pd
import pytest
import xarray as xr

import zarrfusion as zf

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "s3"))
import s3_server  # noqa: E402


def _binary() -> pathlib.Path:
    target = os.environ.get("CARGO_TARGET_DIR") or pathlib.Path.home() / ".cache" / "zarrfusion-target"
    return pathlib.Path(target) / "debug" / "zarrfusion"


def _start_workers(n: int) -> tuple[list[subprocess.Popen], list[str]]:
    """``n`` worker processes on free loopback ports, and their addresses."""
    binary = _binary()
    if not binary.exists():
        pytest.fail(f"{binary} is not built: run `cargo build --workspace` first")
    processes, addresses = [], []
    try:
        for _ in range(n):
            p = subprocess.Popen(
                [str(binary), "worker", "--listen", "127.0.0.1:0"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            processes.append(p)
            ready, _, _ = select.select([p.stdout], [], [], 60)
            assert ready, "the worker did not say where it listens within 60 s"
            line = p.stdout.readline().strip()
            assert line.startswith("zarrfusion worker listening on "), line
            addresses.append(line.rsplit(" ", 1)[-1])
    except BaseException:
        _stop(processes)
        raise
    return processes, addresses


def _stop(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        p.terminate()
    for p in processes:
        p.wait(timeout=30)


def _distributed_plan(ctx: zf.SessionContext, sql: str) -> str:
    """The distributed plan ``EXPLAIN`` shows of ``sql``."""
    plan = ctx.sql(f"EXPLAIN {sql}").to_pandas()
    return plan.loc[plan["plan_type"] == "distributed_plan", "plan"].iloc[0]


@pytest.fixture(scope="module")
def workers():
    processes, addresses = _start_workers(2)
    yield addresses
    _stop(processes)


@pytest.mark.parametrize("store", ["v2_basic.zarr", "v3_basic.zarr"])
def test_group_by_through_two_workers_equals_xarray(fixtures, workers, store):
    # Every block of the scan a task of its own.
    ctx = zf.SessionContext(workers=workers, config={"zarrfusion.bytes_per_task": 1})
    ctx.register_zarr("t", fixtures / store)
    sql = "SELECT lat, avg(t2m) AS t, max(u10) AS u FROM t WHERE lon >= 0 GROUP BY lat ORDER BY lat"
    distributed = _distributed_plan(ctx, sql)
    # The tasks' partial states gathered into the session and merged there
    # by group position.
    assert "tasks=" in distributed and "NetworkCoalesceExec" in distributed, distributed
    assert "merges=partial states by group position" in distributed, distributed
    got = ctx.sql(sql).to_pandas()
    ds = xr.open_zarr(fixtures / store, chunks=None).load()
    ds = ds.where(ds.lon >= 0, drop=True)
    want = pd.DataFrame(
        {"t": ds.t2m.mean(["time", "lon"]).to_series(), "u": ds.u10.max(["time", "lon"]).to_series()}
    ).sort_index()
    assert got["lat"].to_numpy().tolist() == want.index.to_numpy().tolist()
    np.testing.assert_allclose(got["t"], want["t"], rtol=1e-6)
    np.testing.assert_allclose(got["u"], want["u"], rtol=1e-12)


def test_states_merge_in_a_tree_through_three_workers_and_equal_xarray(fixtures):
    # Three tasks (a block per chunk, a task per worker): the states are
    # shuffled between the workers by group position, merged there, and
    # once more in the session.
    processes, addresses = _start_workers(3)
    try:
        config = {"zarrfusion.bytes_per_task": 1, "zarrfusion.target_partition_bytes": 1}
        ctx = zf.SessionContext(workers=addresses, config=config)
        ctx.register_zarr("t", fixtures / "climate.zarr")
        sql = (
            "SELECT lat, lon, avg(t2m) AS t, max(u10) AS u, count(t2m) AS n FROM t "
            "WHERE t2m > 280 GROUP BY lat, lon ORDER BY lat, lon"
        )
        distributed = _distributed_plan(ctx, sql)
        assert "a level of the merge tree" in distributed, distributed
        assert "NetworkShuffleExec" in distributed and "tasks=3" in distributed, distributed
        got = ctx.sql(sql).to_pandas()
        ctx.sql("SET zarrfusion.state_merge = 'session'").collect()
        assert "a level of the merge tree" not in _distributed_plan(ctx, sql)
        in_session = ctx.sql(sql).to_pandas()
    finally:
        _stop(processes)
    ds = xr.open_zarr(fixtures / "climate.zarr", chunks=None).load()
    warm = ds.t2m.where(ds.t2m > 280)
    want = pd.DataFrame(
        {
            "t": warm.mean("time").to_series(),
            "u": ds.u10.where(ds.t2m > 280).max("time").to_series(),
            "n": warm.count("time").to_series(),
        }
    )
    want = want[want["n"] > 0].sort_index()
    assert list(zip(got["lat"], got["lon"])) == list(want.index)
    np.testing.assert_allclose(got["t"], want["t"], rtol=1e-6)
    np.testing.assert_allclose(got["u"], want["u"], rtol=1e-12)
    np.testing.assert_array_equal(got["n"], want["n"])
    pd.testing.assert_frame_equal(got, in_session)


def test_a_copy_of_a_whole_table_is_written_by_the_workers_and_equals_xarray(fixtures, workers, tmp_path):
    """``COPY t TO ... STORED AS ZARR``: the rechunk's tasks run on the two
    worker processes (the distributed plan shows them in a stage of two
    tasks under a network boundary) and write the target's chunks, which
    the session commits; xarray reads the source back in the chunks asked
    for, and nothing else is left beside the target."""
    ctx = zf.SessionContext(workers=workers, config={"zarrfusion.bytes_per_task": 1})
    ctx.register_zarr("t", fixtures / "v3_basic.zarr")
    out = tmp_path / "copy.zarr"
    sql = f"COPY t TO '{out}' STORED AS ZARR OPTIONS ('chunks' 'time=2,lat=1')"
    distributed = _distributed_plan(ctx, sql)
    assert "RechunkTasksExec" in distributed and "tasks=2" in distributed, distributed
    assert "Network" in distributed, distributed
    ctx.sql(sql).collect()
    got = xr.open_zarr(out, chunks=None).load()
    want = xr.open_zarr(fixtures / "v3_basic.zarr", chunks=None).load()
    xr.testing.assert_identical(got, want)
    assert xr.open_zarr(out).t2m.encoding["chunks"] == (2, 1, 2)
    assert [p.name for p in tmp_path.iterdir()] == ["copy.zarr"]


def test_a_copy_through_intermediate_arrays_runs_a_round_per_stage_on_the_workers(workers, tmp_path):
    """Time chunks to space chunks in 300 KB: the rechunk goes through
    intermediate arrays, each stage a round of tasks on the two worker
    processes (the distributed plan shows rounds 0 and 1), the intermediate
    arrays in a scratch store of the session's work_dir, erased at the end;
    xarray reads the demo table's values back in the chunks asked for."""
    demo = pathlib.Path(__file__).resolve().parents[2] / "demo" / "era5.zarr"
    work = tmp_path / "work"
    work.mkdir()
    ctx = zf.SessionContext(
        workers=workers,
        allowed_mem="300KB",
        config={"zarrfusion.bytes_per_task": 1, "zarrfusion.work_dir": str(work)},
    )
    ctx.register_zarr("era5", demo)
    out = tmp_path / "space.zarr"
    sql = f"COPY era5 TO '{out}' STORED AS ZARR OPTIONS ('chunks' 'time=96,lat=1,lon=2')"
    distributed = _distributed_plan(ctx, sql)
    assert "round=0" in distributed and "round=1" in distributed, distributed
    ctx.sql(sql).collect()
    got = xr.open_zarr(out, chunks=None).load()
    # The table's variables: those over (time, lat, lon).
    want = xr.open_zarr(demo, chunks=None).load().drop_vars("lsm")
    xr.testing.assert_identical(got, want)
    assert xr.open_zarr(out).t2m.encoding["chunks"] == (96, 1, 2)
    assert list(work.iterdir()) == [], list(work.rglob("*"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["space.zarr", "work"]


def test_a_rechunk_table_s_copy_runs_on_the_workers_and_its_answer_equals_xarray(workers, tmp_path):
    """``rechunk(...)`` in 300 KB: the copy into the rechunked store runs on
    the two worker processes as a round of tasks per stage (through
    intermediate arrays), writing into the store the session made in its
    work_dir, one round after the other; then the workers reduce it (the
    dense reduction's partial states, each task once the last round's
    counts say every chunk is there) and the answer is xarray's zonal
    means; the work_dir is empty once the query is done."""
    demo = pathlib.Path(__file__).resolve().parents[2] / "demo" / "era5.zarr"
    work = tmp_path / "work"
    work.mkdir()
    ctx = zf.SessionContext(
        workers=workers,
        allowed_mem="300KB",
        config={"zarrfusion.bytes_per_task": 1, "zarrfusion.work_dir": str(work)},
    )
    ctx.register_zarr("era5", demo)
    distributed = _rechunked_zonal_means(ctx, demo)
    assert "round=0" in distributed and "round=1" in distributed and "Network" in distributed, distributed
    assert list(work.iterdir()) == [], list(work.rglob("*"))


def _rechunked_zonal_means(ctx: zf.SessionContext, demo: pathlib.Path) -> str:
    """Checks that the zonal means of ``t2m`` and ``v10`` over ``era5`` read
    in chunks of (96, 1, 2), in 300 KB, run in rounds then the dense
    reduction of the rechunked store on the workers, and are xarray's;
    gives the distributed plan."""
    sql = (
        "SELECT lat, avg(t2m) AS t, min(v10) AS v FROM rechunk('era5', time => 96, lat => 1, lon => 2) "
        "GROUP BY lat"
    )
    distributed = _distributed_plan(ctx, sql)
    assert "copied and scanned by the cluster's workers" in distributed, distributed
    assert "AfterExec: after round 1 of the rechunk" in distributed, distributed
    assert "DenseReductionExec" in distributed and "ZarrScanExec" not in distributed, distributed
    ds = xr.open_zarr(demo, chunks=None).load()
    # Sorted here: a sort in the session would want more than 300 KB.
    got = ctx.sql(sql).to_pandas().set_index("lat").sort_index()
    want_t = ds.t2m.mean(["time", "lon"]).to_series().sort_index()
    want_v = ds.v10.min(["time", "lon"]).to_series().sort_index()
    assert got.index.tolist() == want_t.index.tolist()
    np.testing.assert_allclose(got["t"], want_t, rtol=1e-6)
    np.testing.assert_array_equal(got["v"], want_v)
    return distributed


def test_a_rechunk_joined_with_a_table_runs_on_the_workers_and_equals_xarray(workers, tmp_path):
    """``rechunk(...)`` on one side of a hash join: its copy, its scan and
    the join all run on the worker processes (before, the plan was refused:
    the copy could run in the session only); the answer is xarray's."""
    demo = pathlib.Path(__file__).resolve().parents[2] / "demo" / "era5.zarr"
    work = tmp_path / "work"
    work.mkdir()
    ctx = zf.SessionContext(
        workers=workers,
        config={"zarrfusion.bytes_per_task": 1, "zarrfusion.work_dir": str(work)},
    )
    ctx.register_zarr("era5", demo)
    sql = (
        "SELECT a.lat, avg(b.u10 - a.t2m) AS d, count(*) AS n "
        "FROM rechunk('era5', time => 96, lat => 4) a JOIN era5 b "
        "ON a.time = b.time AND a.lat = b.lat AND a.lon = b.lon GROUP BY a.lat"
    )
    distributed = _distributed_plan(ctx, sql)
    assert "copied and scanned by the cluster's workers" in distributed, distributed
    assert "HashJoinExec" in distributed and "RechunkTasksExec" in distributed, distributed
    ds = xr.open_zarr(demo, chunks=None).load()
    got = ctx.sql(sql).to_pandas().set_index("lat").sort_index()
    want = (ds.u10 - ds.t2m).mean(["time", "lon"]).to_series().sort_index()
    assert got.index.tolist() == want.index.tolist()
    np.testing.assert_allclose(got["d"], want, rtol=1e-5)
    assert (got["n"] == ds.sizes["time"] * ds.sizes["lon"]).all()
    assert list(work.iterdir()) == [], list(work.rglob("*"))


def test_a_rechunk_from_a_bucket_through_a_work_dir_in_it_runs_on_the_workers(workers):
    """``rechunk(...)`` of a store in an S3 bucket with the work_dir in the
    bucket too, in 300 KB (through intermediate arrays): the workers read
    the source, write the intermediate arrays and the rechunked store into
    the bucket one round after the other, then scan it there for the
    ``GROUP BY``; the answer is xarray's and nothing is left under the
    work_dir."""
    demo = pathlib.Path(__file__).resolve().parents[2] / "demo" / "era5.zarr"
    server = s3_server.start({"era5.zarr": demo}, bucket="rechunked")
    try:
        ctx = zf.SessionContext(
            workers=workers,
            allowed_mem="300KB",
            config={"zarrfusion.bytes_per_task": 1, "zarrfusion.work_dir": "s3://rechunked/work"},
        )
        ctx.register_zarr("era5", "s3://rechunked/era5.zarr", **server.options())
        distributed = _rechunked_zonal_means(ctx, demo)
        assert "s3://rechunked/work/zarrfusion-rechunked-" in distributed, distributed
        del ctx
        _assert_work_emptied(server)
    finally:
        server.stop()


def _assert_work_emptied(server) -> None:
    """Nothing is left under ``work/`` in the test server's bucket once the
    session's plans are gone (their stores are erased from a thread of
    their own: waited for up to 10 s)."""
    import gc

    gc.collect()
    deadline = time.monotonic() + 10
    while server.keys("work/") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.keys("work/") == [], server.keys("work/")


def test_an_anomaly_broadcasts_its_climatology_to_the_workers_and_equals_xarray(workers):
    """A monthly anomaly's zonal mean over the demo store: the climatology
    (a ``GROUP BY`` of its own, on the workers) runs once as a stage and its
    rows are broadcast to the tasks reading the grid, with no hash join; the
    answer is xarray's ``groupby("time.month") - climatology``."""
    demo = pathlib.Path(__file__).resolve().parents[2] / "demo" / "era5.zarr"
    ctx = zf.SessionContext(workers=workers, config={"zarrfusion.bytes_per_task": 1})
    ctx.register_zarr("era5", demo)
    sql = (
        "WITH clim AS (SELECT extract(month FROM time) AS month, lat, lon, avg(t2m) AS c "
        "FROM era5 GROUP BY 1, 2, 3) "
        "SELECT era5.time, era5.lat, avg(era5.t2m - clim.c) AS a FROM era5 JOIN clim "
        "ON extract(month FROM era5.time) = clim.month AND era5.lat = clim.lat AND era5.lon = clim.lon "
        "GROUP BY 1, 2"
    )
    distributed = _distributed_plan(ctx, sql)
    assert "NetworkBroadcastExec" in distributed and "broadcast=[clim" in distributed, distributed
    assert "HashJoinExec" not in distributed, distributed
    got = ctx.sql(sql).to_pandas().set_index(["time", "lat"]).sort_index()
    ds = xr.open_zarr(demo, chunks=None).load()
    t2m = ds.t2m.astype("float64")
    anomaly = t2m.groupby("time.month") - t2m.groupby("time.month").mean("time")
    want = anomaly.mean("lon").to_series().sort_index()
    assert got.index.tolist() == want.index.tolist()
    np.testing.assert_allclose(got["a"], want, rtol=1e-9, atol=1e-9)


def _selection_answer(demo: pathlib.Path) -> xr.Dataset:
    """xarray's answer to the selection COPY below: the northern half,
    degrees Celsius as float64 (273.15 is a float64) and the wind speed
    as float32 (computed from float32 components, as DataFusion does)."""
    ds = xr.open_zarr(demo, chunks=None).load()
    north = ds.where(ds.lat > 0, drop=True)
    return xr.Dataset(
        {
            "t2m_c": north.t2m.astype("float64") - 273.15,
            "wind": np.sqrt(north.u10 * north.u10 + north.v10 * north.v10),
        }
    )


def _assert_selection(got: xr.Dataset, want: xr.Dataset) -> None:
    for name in ("time", "lat", "lon"):
        np.testing.assert_array_equal(got[name].values, want[name].values)
    for name, rtol in (("t2m_c", 1e-12), ("wind", 1e-6)):
        assert got[name].dims == ("time", "lat", "lon")
        assert got[name].dtype == want[name].dtype, (name, got[name].dtype, want[name].dtype)
        np.testing.assert_allclose(got[name].values, want[name].values, rtol=rtol)


SELECTION = (
    "COPY (SELECT time, lat, lon, t2m - 273.15 AS t2m_c, sqrt(u10 * u10 + v10 * v10) AS wind "
    "FROM era5 WHERE lat > 0) TO '{target}' STORED AS ZARR OPTIONS ('chunks' 'time=7,lat=11,lon=16'{extra})"
)


def _demo_with_work_dir(workers: list[str], tmp_path: pathlib.Path):
    """The demo store, an empty work_dir in ``tmp_path`` and a session with
    ``workers`` (a task per block) using it, the demo registered as ``era5``."""
    demo = pathlib.Path(__file__).resolve().parents[2] / "demo" / "era5.zarr"
    work = tmp_path / "work"
    work.mkdir()
    ctx = zf.SessionContext(
        workers=workers, config={"zarrfusion.bytes_per_task": 1, "zarrfusion.work_dir": str(work)}
    )
    ctx.register_zarr("era5", demo)
    return demo, work, ctx


def test_a_selection_copy_makes_its_chunks_and_rechunks_them_on_the_workers(workers, tmp_path):
    """``COPY (SELECT ... computed ... WHERE lat > 0)``: the two worker
    processes evaluate the expressions chunk by chunk into the
    intermediate store in the session's work_dir (a round of blockwise
    tasks), then rechunk it into the target (a round of rechunk tasks
    planned when they run); the values are xarray's and the work_dir is
    empty afterwards."""
    demo, work, ctx = _demo_with_work_dir(workers, tmp_path)
    out = tmp_path / "north.zarr"
    sql = SELECTION.format(target=out, extra="")
    distributed = _distributed_plan(ctx, sql)
    assert "BlockwiseTasksExec" in distributed and "RechunkTasksExec" in distributed, distributed
    assert "planned when it runs" in distributed and "tasks=2" in distributed, distributed
    ctx.sql(sql).collect()
    got = xr.open_zarr(out, chunks=None).load()
    _assert_selection(got, _selection_answer(demo))
    assert xr.open_zarr(out).t2m_c.encoding["chunks"] == (7, 11, 16)
    assert list(work.iterdir()) == [], list(work.rglob("*"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["north.zarr", "work"]


def test_a_selection_copy_from_a_bucket_to_a_bucket_through_a_work_dir_in_it(workers, tmp_path):
    """The same COPY with the source, the work_dir and the target in an S3
    bucket: the workers read the source, write and read the intermediate
    store and write the target's chunks there; the session stores the
    metadata last. xarray reads the values back; nothing is left under the
    work_dir and no claim on the target."""
    demo = pathlib.Path(__file__).resolve().parents[2] / "demo" / "era5.zarr"
    server = s3_server.start({"era5.zarr": demo}, bucket="selection")
    try:
        ctx = zf.SessionContext(
            workers=workers,
            config={"zarrfusion.bytes_per_task": 1, "zarrfusion.work_dir": "s3://selection/work"},
        )
        ctx.register_zarr("era5", "s3://selection/era5.zarr", **server.options())
        through = "".join(f", '{k}' '{v}'" for k, v in server.options().items())
        sql = SELECTION.format(target="s3://selection/north.zarr", extra=through)
        ctx.sql(sql).collect()
        copied = server.download("north.zarr", tmp_path / "north.zarr")
        _assert_selection(xr.open_zarr(copied, chunks=None).load(), _selection_answer(demo))
        assert not any(".zarrfusion-write" in key for key in server.keys("north.zarr/"))
        assert server.keys("work/") == [], server.keys("work/")
    finally:
        server.stop()


def test_a_rolling_copy_rolls_its_chunks_on_the_workers_and_equals_xarray(workers, tmp_path):
    """``COPY (SELECT ..., avg(t2m) OVER (... ROWS BETWEEN 23 PRECEDING AND
    CURRENT ROW) ...)``: the two worker processes roll runs of chunks along
    time (a round of blockwise tasks travelling with the window) and write
    the target's chunks; the values are xarray's ``rolling(time=24,
    min_periods=1).mean()``."""
    demo = pathlib.Path(__file__).resolve().parents[2] / "demo" / "era5.zarr"
    ctx = zf.SessionContext(workers=workers, config={"zarrfusion.bytes_per_task": 1})
    ctx.register_zarr("era5", demo)
    out = tmp_path / "running.zarr"
    sql = (
        "COPY (SELECT time, lat, lon, avg(t2m) OVER w AS m FROM era5 WINDOW w AS "
        "(PARTITION BY lat, lon ORDER BY time ROWS BETWEEN 23 PRECEDING AND CURRENT ROW)) "
        f"TO '{out}' STORED AS ZARR OPTIONS ('chunks' 'time=24')"
    )
    distributed = _distributed_plan(ctx, sql)
    assert "BlockwiseTasksExec" in distributed and "rolled along time" in distributed, distributed
    assert "tasks=2" in distributed, distributed
    ctx.sql(sql).collect()
    got = xr.open_zarr(out, chunks=None).load()
    t2m = xr.open_zarr(demo, chunks=None).load().t2m.astype("float64")
    want = t2m.rolling(time=24, min_periods=1).mean()
    np.testing.assert_array_equal(got.time.values, want.time.values)
    np.testing.assert_allclose(got.m.values, want.values, rtol=1e-12)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["running.zarr"]


def test_a_copied_reduction_in_bands_of_latitudes_is_written_a_band_at_a_time_through_workers(
    workers, hourly_store, tmp_path
):
    """``COPY`` of the diurnal cycle of every cell (more groups than one pass
    holds, so it runs in bands of latitudes): the two worker processes each
    finish a run of the bands; the session gathers them one task after the
    other and writes a band at a time. The store is xarray's
    ``groupby("time.hour")`` mean and spread (NaN holes, latitudes
    descending as stored)."""
    store, assert_diurnal = hourly_store
    config = {"zarrfusion.bytes_per_task": 1, "zarrfusion.dense_state_bytes": 65536}
    ctx = zf.SessionContext(workers=workers, config=config)
    ctx.register_zarr("h", store)
    out = tmp_path / "diurnal.zarr"
    copy = (
        "COPY (SELECT extract(hour FROM time) AS hour, lat, lon, avg(t2m) AS t2m, "
        f"stddev_pop(t2m) AS s FROM h GROUP BY 1, lat, lon) TO '{out}' STORED AS ZARR "
        "OPTIONS ('dims' 'hour,lat,lon', 'chunks' 'hour=5,lat=4,lon=3')"
    )
    distributed = _distributed_plan(ctx, copy)
    for part in ["InOrderGatherExec", "NetworkCoalesceExec", "of lat per write (its bands)", "tasks=2"]:
        assert part in distributed, distributed
    ctx.sql(copy).collect()
    assert_diurnal(out)


def test_an_anomaly_copy_makes_its_chunks_on_the_workers_and_equals_xarray(workers, tmp_path):
    """``COPY`` of a monthly anomaly and of its 24-hour running mean (variables
    reading a climatology joined in): the climatology runs once as a stage of
    its own on the workers and its rows are broadcast to the blockwise tasks,
    which make the chunks on the two worker processes (no hash join); the
    values are xarray's ``groupby("time.month") - climatology`` and its
    ``rolling(time=24, min_periods=1).mean()``, and the work_dir is empty
    afterwards."""
    demo, work, ctx = _demo_with_work_dir(workers, tmp_path)
    clim = (
        "WITH clim AS (SELECT extract(month FROM time) AS month, lat, lon, avg(t2m) AS c "
        "FROM era5 GROUP BY 1, 2, 3) "
    )
    joined = (
        "FROM era5 JOIN clim ON extract(month FROM era5.time) = clim.month "
        "AND era5.lat = clim.lat AND era5.lon = clim.lon"
    )
    t2m = xr.open_zarr(demo, chunks=None).load().t2m.astype("float64")
    anomaly = t2m.groupby("time.month") - t2m.groupby("time.month").mean("time")
    running = (
        "avg(era5.t2m - clim.c) OVER (PARTITION BY era5.lat, era5.lon ORDER BY era5.time "
        "ROWS BETWEEN 23 PRECEDING AND CURRENT ROW)"
    )
    cases = {
        "anomaly": ("era5.t2m - clim.c", anomaly, "time=7,lat=11,lon=16"),
        "running": (running, anomaly.rolling(time=24, min_periods=1).mean(), "time=24"),
    }
    for name, (value, want, chunks) in cases.items():
        out = tmp_path / f"{name}.zarr"
        query = f"{clim}SELECT era5.time, era5.lat, era5.lon, {value} AS a {joined}"
        sql = f"COPY ({query}) TO '{out}' STORED AS ZARR OPTIONS ('chunks' '{chunks}')"
        distributed = _distributed_plan(ctx, sql)
        step = next(line for line in distributed.splitlines() if "BlockwiseTasksExec" in line)
        assert "broadcast=[clim" in step and "tasks=its stage's" in step, distributed
        assert "NetworkBroadcastExec" in distributed and "HashJoinExec" not in distributed, distributed
        ctx.sql(sql).collect()
        got = xr.open_zarr(out, chunks=None).load()
        want = want.transpose("time", "lat", "lon")
        np.testing.assert_array_equal(got.time.values, want.time.values)
        np.testing.assert_array_equal(got.lat.values, want.lat.values)
        np.testing.assert_allclose(got.a.values, want.values, rtol=1e-9, atol=1e-9)
    assert list(work.iterdir()) == [], list(work.rglob("*"))


def test_transforms_run_on_the_workers_and_equal_xrft(workers):
    """``fft(...)`` along two dimensions, and the ``ifft`` of a view of it
    (a chain, transformed block by block without a store between them),
    through the two worker processes: blocks of whole lines dealt to a
    stage of two tasks; the values are xrft's (the fixture's expected
    stores)."""
    from test_fft import FFT, close, expected

    ctx = zf.SessionContext(
        workers=workers,
        config={"zarrfusion.bytes_per_task": 1, "zarrfusion.target_partition_bytes": 2000},
    )
    grid = FFT / "data" / "grid.zarr"
    forward = f"SELECT * FROM fft('{grid}', 'z', dims => 'lat,lon')"
    ctx.sql(f"CREATE VIEW spectrum AS {forward}").collect()
    back = "SELECT * FROM ifft('spectrum', 'z', dims => 'freq_lat,freq_lon', lag => '30,90')"
    for sql, name, dims in [
        (forward, "lat_lon", ["time", "freq_lat", "freq_lon"]),
        (back, "chain_lat_lon", ["time", "lat", "lon"]),
    ]:
        distributed = _distributed_plan(ctx, sql)
        assert "FftExec" in distributed and "tasks=2" in distributed, distributed
        assert "Network" in distributed, distributed
        close(ctx.sql(sql).to_xarray(dims=dims)["z"], expected(name), 1e-9)


def _four_step_session(workers: list[str], tmp_path: pathlib.Path) -> tuple[zf.SessionContext, pathlib.Path]:
    """A session of the two workers that takes the four-step path, a block
    per task, with its ``work_dir`` (which it gives) in ``tmp_path``."""
    work = tmp_path / "work"
    work.mkdir()
    config = {
        "zarrfusion.bytes_per_task": 1,
        "zarrfusion.fft_strategy": "four_step",
        "zarrfusion.work_dir": str(work),
    }
    return zf.SessionContext(workers=workers, config=config), work


def test_four_step_passes_run_on_the_workers_and_equal_xrft(workers, tmp_path):
    """An FFT along ``lat`` by the four-step path: its two passes run on the
    two worker processes, a stage each, one after the other, writing into
    the scratch store the session made in ``work_dir`` (a directory every
    worker sees); the output is read there too, once the second pass's
    counts are in. The values are xrft's; joined with the grid, the join
    runs on the workers and its sums are xrft's spectrum's; nothing is
    left in ``work_dir``."""
    from test_fft import FFT, close, expected

    ctx, work = _four_step_session(workers, tmp_path)
    sql = f"SELECT * FROM fft('{FFT / 'data' / 'grid.zarr'}', 'z', dims => 'lat')"
    distributed = _distributed_plan(ctx, sql)
    assert distributed.count("four-step pass ") == 2, distributed
    assert "passes on the cluster's workers" in distributed and "Network" in distributed, distributed
    assert "AfterExec: after pass 1 of the four-step transform" in distributed, distributed
    close(ctx.sql(sql).to_xarray(dims=["time", "freq_lat", "lon"])["z"], expected("lat_f64"), 1e-9)
    assert list(work.iterdir()) == []

    grid = xr.open_zarr(FFT / "data" / "grid.zarr", consolidated=False).load()
    lat0 = float(grid.lat[0])
    ctx.register_zarr("grid", FFT / "data" / "grid.zarr")
    joined = (
        f"SELECT a.freq_lat, sum(b.z * a.z['re']) AS s FROM fft('{FFT / 'data' / 'grid.zarr'}', 'z', "
        f"dims => 'lat') a JOIN grid b ON a.time = b.time AND a.lon = b.lon WHERE b.lat = {lat0} "
        "GROUP BY a.freq_lat"
    )
    distributed = _distributed_plan(ctx, joined)
    assert "HashJoinExec" in distributed and "AfterExec: after pass 1" in distributed, distributed
    got = ctx.sql(joined).to_pandas().set_index("freq_lat").sort_index()["s"]
    spectrum = expected("lat_f64")
    want = (grid.z.isel(lat=0) * spectrum.real).sum(["time", "lon"]).to_series().sort_index()
    np.testing.assert_allclose(got.index.values, want.index.values.astype(float), rtol=1e-9)
    np.testing.assert_allclose(got.values, want.values, rtol=1e-9, atol=1e-9 * float(np.abs(want).max()))
    assert list(work.iterdir()) == []


def test_a_detrended_four_step_transform_fits_its_trend_on_the_workers_and_equals_xrft(workers, tmp_path):
    """An FFT along ``lon`` by the four-step path with ``detrend =>
    'linear'``: the trend of every line is fitted in a stage of its own on
    the two worker processes (``DetrendFitExec``, runs of the source's
    chunks), its sums broadcast to every task of the first pass
    (``FittedExec``), which removes it from the pieces of lines it reads;
    nothing of it runs in the session. The values are xrft's (the
    fixture's ``detrend_linear_1d``: ``xrft.fft(..., detrend='linear')``),
    and nothing is left in ``work_dir``."""
    from test_fft import FFT, close, expected

    ctx, work = _four_step_session(workers, tmp_path)
    sql = f"SELECT * FROM fft('{FFT / 'data' / 'grid.zarr'}', 'z', dims => 'lon', detrend => 'linear')"
    distributed = _distributed_plan(ctx, sql)
    fit = [line for line in distributed.splitlines() if "DetrendFitExec" in line]
    assert len(fit) == 1 and "tasks=2" in fit[0], distributed
    assert "FittedExec: after the detrend's fit" in distributed, distributed
    assert distributed.count("four-step pass ") == 2, distributed
    close(ctx.sql(sql).to_xarray(dims=["time", "lat", "freq_lon"])["z"], expected("detrend_linear_1d"), 1e-9)
    assert list(work.iterdir()) == []


def test_a_staged_transform_s_first_stage_runs_on_the_workers_and_equals_numpy(workers, tmp_path):
    """An FFT along ``y`` and ``x`` whose planes do not fit the session's
    ``allowed_mem`` is staged: its first stage (along ``y``, by whole lines)
    runs on the two worker processes, a stage of two tasks storing their
    blocks into the store the session made in ``work_dir`` (a directory
    every worker sees); the stage after it transforms that store along
    ``x`` on the workers too, its tasks reading once the first stage's
    counts (broadcast to each) say every block is stored. The
    spectrum is numpy's ``fft2`` shifted as xrft shifts it (coordinates from
    0 by 1, so xrft's phase and amplitude factors are 1), and nothing is
    left in ``work_dir``."""
    data, store = _planes(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    config = {"zarrfusion.bytes_per_task": 1, "zarrfusion.work_dir": str(work)}
    ctx = zf.SessionContext(workers=workers, allowed_mem=_PLANES_MEMORY, config=config)
    sql = f"SELECT * FROM fft('{store}', 'v', dims => 'y,x')"
    distributed = _distributed_plan(ctx, sql)
    for part in ["strategy=staged: along [y] by whole lines", "first stage on the cluster's workers", "Network"]:
        assert part in distributed, distributed
    assert "BlockwiseTasksExec" in distributed and "tasks=2" in distributed, distributed
    reading = next(line for line in distributed.splitlines() if "FftExec:" in line)
    assert "tasks=its stage's" in reading and "NetworkBroadcastExec" in distributed, distributed
    _assert_fft2(ctx.sql(sql).to_xarray(dims=["t", "freq_y", "freq_x"])["v"], data)
    assert list(work.iterdir()) == []


def test_a_staged_detrended_transform_fits_its_trend_on_the_workers_and_equals_numpy(workers, tmp_path):
    """The staged FFT with ``detrend => 'constant'`` (xrft removes each
    plane's mean over both dimensions at once, which the first stage's
    lines along ``y`` do not hold): the plane means are fitted in a stage
    of their own on the two worker processes (``DetrendFitExec``), their
    sums broadcast to every task of the first stage (``FittedExec``). The
    spectrum is numpy's ``fft2`` of the planes less their means, and
    nothing is left in ``work_dir``."""
    data, store = _planes(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    config = {"zarrfusion.bytes_per_task": 1, "zarrfusion.work_dir": str(work)}
    ctx = zf.SessionContext(workers=workers, allowed_mem=_PLANES_MEMORY, config=config)
    sql = f"SELECT * FROM fft('{store}', 'v', dims => 'y,x', detrend => 'constant')"
    distributed = _distributed_plan(ctx, sql)
    for part in [
        "strategy=staged: along [y] by whole lines",
        "first stage on the cluster's workers",
        "FittedExec: after the detrend's fit",
        "BlockwiseTasksExec",
    ]:
        assert part in distributed, distributed
    fit = [line for line in distributed.splitlines() if "DetrendFitExec" in line]
    assert len(fit) == 1 and "tasks=2" in fit[0], distributed
    centred = data - data.mean(axis=(1, 2), keepdims=True)
    _assert_fft2(ctx.sql(sql).to_xarray(dims=["t", "freq_y", "freq_x"])["v"], centred)
    assert list(work.iterdir()) == []


def test_a_staged_transform_from_a_bucket_through_a_work_dir_in_it_runs_on_the_workers(workers, tmp_path):
    """The same staged FFT with the store and the work_dir in an S3
    bucket: the workers read the store, store the first stage in the
    bucket and read it back for the later stage; numpy's ``fft2``, and
    nothing is left under the work_dir."""
    data, store = _planes(tmp_path)
    server = s3_server.start({"planes.zarr": store}, bucket="staged")
    try:
        config = {"zarrfusion.bytes_per_task": 1, "zarrfusion.work_dir": "s3://staged/work"}
        ctx = zf.SessionContext(workers=workers, allowed_mem=_PLANES_MEMORY, config=config)
        ctx.register_zarr("planes", "s3://staged/planes.zarr", **server.options())
        sql = "SELECT * FROM fft('planes', 'v', dims => 'y,x')"
        distributed = _distributed_plan(ctx, sql)
        assert "first stage on the cluster's workers" in distributed, distributed
        assert "s3://staged/work/zarrfusion-fft-staged-" in distributed, distributed
        _assert_fft2(ctx.sql(sql).to_xarray(dims=["t", "freq_y", "freq_x"])["v"], data)
        del ctx
        _assert_work_emptied(server)
    finally:
        server.stop()


# A plane needs over 20 MB, more than half of what this limit leaves beside
# the kernel's threads; half the limit holds them and blocks of whole lines
# of y.
_PLANES_MEMORY = 2 * (os.cpu_count() or 1) * 3 * 16384 * 16 + 24 * 2**20


def _planes(tmp_path: pathlib.Path) -> tuple[np.ndarray, pathlib.Path]:
    """Random planes ``v`` over (t 2, y 1024, x 512), float64, in chunks of
    (1, 1024, 32), coordinates from 0 by 1, written by xarray: the values
    and the store."""
    data = np.random.default_rng(7).standard_normal((2, 1024, 512))
    store = tmp_path / "planes.zarr"
    coords = {"t": [0.0, 1.0], "y": np.arange(1024.0), "x": np.arange(512.0)}
    xr.Dataset({"v": (("t", "y", "x"), data)}, coords=coords).to_zarr(
        store, encoding={"v": {"chunks": (1, 1024, 32), "compressors": None}}, zarr_format=3, consolidated=False
    )
    return data, store


def _assert_fft2(got: xr.DataArray, data: np.ndarray) -> None:
    """``got`` is numpy's ``fft2`` of ``data`` along its last two axes,
    shifted as xrft shifts it (coordinates from 0 by 1, so xrft's phase and
    amplitude factors are 1)."""
    want = np.fft.fftshift(np.fft.fft2(data, axes=(1, 2)), axes=(1, 2))
    freqs = {d: np.fft.fftshift(np.fft.fftfreq(n)) for d, n in [("freq_y", 1024), ("freq_x", 512)]}
    for d, f in freqs.items():
        np.testing.assert_allclose(got[d].values, f, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got.values, want, rtol=0, atol=1e-9 * np.abs(want).max())


def test_a_copy_of_a_transform_is_written_by_the_workers_and_equals_xrft(workers, tmp_path):
    """``COPY`` of an FFT along ``lat`` through the two worker processes:
    each task transforms a run of blocks and writes them as whole chunks of
    the target the session staged; the session commits it. xarray reads
    the store back as xrft's spectrum, and nothing else is left."""
    from test_fft import FFT, close, expected

    ctx = zf.SessionContext(
        workers=workers,
        config={"zarrfusion.bytes_per_task": 1, "zarrfusion.target_partition_bytes": 2000},
    )
    out = tmp_path / "spectrum.zarr"
    sql = (
        f"COPY (SELECT * FROM fft('{FFT / 'data' / 'grid.zarr'}', 'z', dims => 'lat')) "
        f"TO '{out}' STORED AS ZARR OPTIONS ('chunks' 'time=1,lon=5')"
    )
    distributed = _distributed_plan(ctx, sql)
    assert "BlockwiseTasksExec" in distributed and "tasks=2" in distributed, distributed
    assert "tasks on the cluster's workers" in distributed and "Network" in distributed, distributed
    ctx.sql(sql).collect()
    got = xr.open_zarr(out, consolidated=False).load()
    assert got.z.encoding["chunks"] == (1, got.sizes["freq_lat"], 5)
    close(got.z, expected("lat_f64"), 1e-9)
    assert [p.name for p in tmp_path.iterdir()] == ["spectrum.zarr"]


def test_a_copy_of_a_transform_from_a_bucket_to_a_bucket_is_written_by_the_workers(workers, tmp_path):
    """The same COPY of a transform with the source and the target in an S3
    bucket: the workers read the blocks and write the target's chunks
    under the prefix the session claimed; the session stores the metadata
    last. xarray reads xrft's spectrum back, and no claim is left."""
    from test_fft import FFT, close, expected

    server = s3_server.start({"grid.zarr": FFT / "data" / "grid.zarr"}, bucket="spectra")
    try:
        ctx = zf.SessionContext(
            workers=workers,
            config={"zarrfusion.bytes_per_task": 1, "zarrfusion.target_partition_bytes": 2000},
        )
        ctx.register_zarr("grid", "s3://spectra/grid.zarr", **server.options())
        through = "".join(f", '{k}' '{v}'" for k, v in server.options().items())
        sql = (
            "COPY (SELECT * FROM fft('grid', 'z', dims => 'lat')) TO 's3://spectra/spectrum.zarr' "
            f"STORED AS ZARR OPTIONS ('chunks' 'time=1,lon=5'{through})"
        )
        distributed = _distributed_plan(ctx, sql)
        assert "BlockwiseTasksExec" in distributed and "tasks=2" in distributed, distributed
        ctx.sql(sql).collect()
        copied = server.download("spectrum.zarr", tmp_path / "spectrum.zarr")
        close(xr.open_zarr(copied, consolidated=False).load().z, expected("lat_f64"), 1e-9)
        assert not any(".zarrfusion-write" in key for key in server.keys("spectrum.zarr/"))
    finally:
        server.stop()


def test_a_worker_nobody_listens_on_fails_the_query_naming_it(fixtures, workers):
    nobody = "127.0.0.1:1"
    ctx = zf.SessionContext(workers=[workers[0], nobody], config={"zarrfusion.bytes_per_task": 1})
    ctx.register_zarr("t", fixtures / "v3_basic.zarr")
    with pytest.raises(Exception, match=nobody):
        ctx.sql("SELECT lat, avg(t2m) FROM t GROUP BY lat").to_pandas()


def test_workers_are_a_list_of_addresses():
    with pytest.raises(TypeError, match="list"):
        zf.SessionContext(workers="127.0.0.1:50051")
    with pytest.raises(ValueError, match="workers"):
        zf.SessionContext(workers=["ftp://node:1"])


def test_a_worker_killed_mid_query_fails_it_in_bounded_time_and_a_copy_leaves_nothing(fixtures, tmp_path):
    """Two workers read a bucket through the tests' proxy at 1.5 s a
    request, so the query is in flight for seconds; one worker is killed
    (SIGKILL) one second in, or stopped (SIGSTOP). The query fails within 60 s (no hang, no
    partial result) with an error naming the killed worker and its stage,
    and so does a COPY of a GROUP BY (its partial aggregates computed on
    the workers) to Zarr, a COPY of the whole table (its chunks written
    by the workers) and a COPY of a selection with a computed variable (its
    chunks made by the workers), leaving nothing in the target's directory
    (nor in the work_dir). Before
    that, the whole-table COPY to the bucket, its chunks written by the
    workers, gives xarray the source's values, and so does a COPY through
    intermediate arrays in a work_dir in the bucket."""
    demo = pathlib.Path(__file__).resolve().parents[2] / "demo" / "era5.zarr"
    server = s3_server.start({"v3_basic.zarr": fixtures / "v3_basic.zarr", "era5.zarr": demo}, bucket="cluster")
    processes, addresses = _start_workers(2)
    try:
        ctx = zf.SessionContext(workers=addresses, config={"zarrfusion.bytes_per_task": 1})
        ctx.register_zarr("t", "s3://cluster/v3_basic.zarr", **server.options())
        through = ", ".join(f"'{k}' '{v}'" for k, v in server.options().items())
        to_bucket = f"COPY t TO 's3://cluster/whole.zarr' STORED AS ZARR OPTIONS ('chunks' 'time=2,lat=1', {through})"
        plan = ctx.sql(f"EXPLAIN {to_bucket}").to_pandas()
        assert "RechunkTasksExec" in plan["plan"].str.cat(), plan
        ctx.sql(to_bucket).collect()
        copied = server.download("whole.zarr", tmp_path / "whole.zarr")
        want = xr.open_zarr(fixtures / "v3_basic.zarr", chunks=None).load()
        xr.testing.assert_identical(xr.open_zarr(copied, chunks=None).load(), want)
        assert not any(".zarrfusion-write" in key for key in server.keys("whole.zarr/"))
        # Through intermediate arrays in a work_dir in the bucket: the
        # workers read the source from the bucket, write and read the
        # intermediate arrays there, and nothing is left under the work_dir.
        ctx = zf.SessionContext(
            workers=addresses,
            allowed_mem="300KB",
            config={"zarrfusion.bytes_per_task": 1, "zarrfusion.work_dir": "s3://cluster/work"},
        )
        ctx.register_zarr("era5", "s3://cluster/era5.zarr", **server.options())
        staged = tmp_path / "staged.zarr"
        sql = f"COPY era5 TO '{staged}' STORED AS ZARR OPTIONS ('chunks' 'time=96,lat=1,lon=2')"
        plan = ctx.sql(f"EXPLAIN {sql}").to_pandas()
        assert "round=1" in plan["plan"].str.cat(), plan
        ctx.sql(sql).collect()
        want = xr.open_zarr(demo, chunks=None).load().drop_vars("lsm")
        xr.testing.assert_identical(xr.open_zarr(staged, chunks=None).load(), want)
        assert server.keys("work/") == [], server.keys("work/")
        for case in ("query", "copy", "whole copy", "selection copy", "stopped"):
            ctx = zf.SessionContext(workers=addresses, config={"zarrfusion.bytes_per_task": 1})
            ctx.register_zarr("t", "s3://cluster/v3_basic.zarr", **server.options())
            server.proxy.configure(latency_ms=1500)
            out = tmp_path / case.replace(" ", "_")
            out.mkdir()
            sql = {
                "query": "SELECT lat, avg(t2m) FROM t GROUP BY lat",
                "stopped": "SELECT lat, avg(t2m) FROM t GROUP BY lat",
                "copy": f"COPY (SELECT lat, avg(t2m) AS t FROM t GROUP BY lat) TO '{out / 'means.zarr'}' STORED AS ZARR",
                "whole copy": f"COPY t TO '{out / 'whole.zarr'}' STORED AS ZARR OPTIONS ('chunks' 'time=2,lat=1')",
                "selection copy": f"COPY (SELECT time, lat, lon, t2m * 2 AS t2 FROM t) TO '{out / 'sel.zarr'}' "
                "STORED AS ZARR OPTIONS ('chunks' 'time=2,lat=1')",
            }[case]
            outcome: dict = {}

            def run() -> None:
                try:
                    outcome["rows"] = ctx.sql(sql).to_pandas()
                except Exception as e:  # the failure this test waits for
                    outcome["error"] = e

            started = time.monotonic()
            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            if case in ("whole copy", "selection copy"):
                # Planning reads the source's metadata through the slow
                # proxy; the workers get their tasks once the session has
                # staged the target (its temporary directory beside it).
                deadline = time.monotonic() + 60
                while not any(p.name.endswith(".zarrfusion-tmp") for p in out.iterdir()):
                    assert time.monotonic() < deadline and thread.is_alive(), f"not staged: {outcome}"
                    time.sleep(0.05)
            time.sleep(1.0)
            assert thread.is_alive(), f"{case}: done before the worker was killed: {outcome}"
            if case == "stopped":
                # Alive but silent (SIGSTOP): its connections stay open, so
                # only the keep-alive pings (20 s unanswered) end the wait.
                os.kill(processes[1].pid, signal.SIGSTOP)
                thread.join(timeout=60)
                processes[1].kill()
            else:
                processes[1].kill()
                thread.join(timeout=60)
            processes[1].wait(timeout=30)
            elapsed = time.monotonic() - started
            assert not thread.is_alive(), f"{case}: still running 60 s after the worker was killed"
            assert "error" in outcome, f"{case}: answered without a worker: {outcome}"
            message = str(outcome["error"])
            print(f"{case}: failed after {elapsed:.1f} s: {message}")
            assert f"worker http://{addresses[1]}" in message and "stage" in message, message
            assert list(out.iterdir()) == [], f"{case}: left {list(out.rglob('*'))}"
            server.proxy.configure()
            processes_left, addresses_left = _start_workers(1)
            processes[1], addresses[1] = processes_left[0], addresses_left[0]
    finally:
        _stop(processes)
        server.stop()

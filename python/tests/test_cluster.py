"""A session with workers: queries through two ``zarrfusion worker`` processes (the shell's
binary, which ``cargo test --workspace`` builds into ``$CARGO_TARGET_DIR/debug``) give xarray's
answers, ``EXPLAIN`` shows the stages, and a worker nobody listens on fails the query naming it."""

from __future__ import annotations

import os
import pathlib
import select
import subprocess

import numpy as np
import pandas as pd
import pytest
import xarray as xr

import zarrfusion as zf


def _binary() -> pathlib.Path:
    target = os.environ.get("CARGO_TARGET_DIR") or pathlib.Path.home() / ".cache" / "zarrfusion-target"
    return pathlib.Path(target) / "debug" / "zarrfusion"


@pytest.fixture(scope="module")
def workers():
    binary = _binary()
    if not binary.exists():
        pytest.fail(f"{binary} is not built: run `cargo build --workspace` first")
    processes, addresses = [], []
    try:
        for _ in range(2):
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
        yield addresses
    finally:
        for p in processes:
            p.terminate()
            p.wait(timeout=30)


@pytest.mark.parametrize("store", ["v2_basic.zarr", "v3_basic.zarr"])
def test_group_by_through_two_workers_equals_xarray(fixtures, workers, store):
    # Every block of the scan a task of its own.
    ctx = zf.SessionContext(workers=workers, config={"zarrfusion.bytes_per_task": 1})
    ctx.register_zarr("t", fixtures / store)
    sql = "SELECT lat, avg(t2m) AS t, max(u10) AS u FROM t WHERE lon >= 0 GROUP BY lat ORDER BY lat"
    plan = ctx.sql(f"EXPLAIN {sql}").to_pandas()
    distributed = plan.loc[plan["plan_type"] == "distributed_plan", "plan"].iloc[0]
    assert "tasks=" in distributed and "NetworkShuffleExec" in distributed, distributed
    got = ctx.sql(sql).to_pandas()
    ds = xr.open_zarr(fixtures / store, chunks=None).load()
    ds = ds.where(ds.lon >= 0, drop=True)
    want = pd.DataFrame(
        {"t": ds.t2m.mean(["time", "lon"]).to_series(), "u": ds.u10.max(["time", "lon"]).to_series()}
    ).sort_index()
    assert got["lat"].to_numpy().tolist() == want.index.to_numpy().tolist()
    np.testing.assert_allclose(got["t"], want["t"], rtol=1e-6)
    np.testing.assert_allclose(got["u"], want["u"], rtol=1e-12)


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

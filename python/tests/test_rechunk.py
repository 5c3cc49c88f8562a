"""ctx.rechunk against xarray and zarr-python: the rechunked store holds the
same dataset (values, coordinates, attributes, encoding) in the requested
chunks, under a budget that forces intermediate arrays; failures and
refusals leave nothing."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import xarray as xr
import zarr

import zarrfusion as zf


def leftovers(work):
    """Intermediate stores left anywhere under a work directory (the session
    keeps its temporary directory there while it lives)."""
    return [root for root, _, _ in os.walk(work) if "zarrfusion-rechunk" in root]


@pytest.mark.parametrize("store", ["rechunk_source.zarr", "rechunk_source_v2.zarr"])
@pytest.mark.parametrize("allowed_mem", ["256MB", "160KB"])
def test_rechunk_keeps_the_dataset_and_applies_the_chunks(fixtures, tmp_path, store, allowed_mem):
    work = tmp_path / "work"
    ctx = zf.SessionContext(allowed_mem=allowed_mem, work_dir=work)
    target = tmp_path / "out.zarr"
    summary = ctx.rechunk(fixtures / store, target, {"time": 37, "lat": 4, "lon": 4})
    source = xr.open_zarr(fixtures / store)
    out = xr.open_zarr(target)
    xr.testing.assert_identical(source.load(), out.load())
    assert out.t.attrs["units"] == "K" and out.attrs["title"] == "rechunk source"
    for name in ("t", "q"):
        assert zarr.open_array(target, path=name).chunks == (37, 4, 4)
        assert summary["arrays"][name]["chunks"][-1] == [37, 4, 4]
    assert zarr.open_array(target, path="time").chunks == (37,)
    if allowed_mem == "160KB":
        # One time step per chunk to space chunks in a few source chunks of
        # memory: through an intermediate array.
        if store == "rechunk_source.zarr":
            assert summary["arrays"]["t"]["stages"] > 1
        assert all(a["projected_memory"] <= 160 * 1024 for a in summary["arrays"].values())
    assert summary["target_bytes"] <= summary["bytes_written"]
    assert leftovers(work) == []


def test_rechunk_by_table_name_and_refusals(fixtures, tmp_path):
    ctx = zf.SessionContext(allowed_mem="64KB")
    ctx.register_zarr("src", fixtures / "rechunk_source.zarr")
    target = tmp_path / "out.zarr"
    with pytest.raises(zf.ZarrFusionError, match="Rechunk.*allowed_mem"):
        ctx.rechunk("src", target, {"time": 37, "lat": 29})
    with pytest.raises(zf.ZarrFusionError, match="unknown dimension 'level'"):
        ctx.rechunk("src", target, {"level": 1})
    assert not target.exists()
    roomy = zf.SessionContext()
    roomy.register_zarr("src", fixtures / "rechunk_source.zarr")
    roomy.rechunk("src", target, {"time": 10})
    assert zarr.open_array(target, path="t").chunks == (10, 29, 31)
    with pytest.raises(zf.ZarrFusionError, match="already exists"):
        zf.SessionContext().rechunk(fixtures / "rechunk_source.zarr", target, {"time": 5})
    assert zarr.open_array(target, path="t").chunks == (10, 29, 31)
    # Threads: at most 1024 (2^64 - 1 hung, starting threads until the
    # system refused one); a rechunk with the most runs no more than a
    # worker a task.
    for threads, words in [(2**64 - 1, "at most 1024"), (1025, "at most 1024"), (-1, "must be an integer")]:
        with pytest.raises(ValueError, match=f"threads: .*{words}"):
            roomy.rechunk("src", tmp_path / "never.zarr", {"time": 5}, threads=threads)
    assert not (tmp_path / "never.zarr").exists()
    roomy.rechunk("src", tmp_path / "many.zarr", {"time": 5}, threads=1024)
    assert zarr.open_array(tmp_path / "many.zarr", path="t").chunks == (5, 29, 31)


def test_a_failing_rechunk_leaves_nothing(fixtures, tmp_path):
    target = tmp_path / "out.zarr"
    with pytest.raises(zf.ZarrFusionError, match="bad_corrupt_chunk"):
        zf.SessionContext(work_dir=tmp_path / "work").rechunk(fixtures / "bad_corrupt_chunk.zarr", target, {})
    assert sorted(os.listdir(tmp_path)) == ["work"]
    assert leftovers(tmp_path / "work") == []


@pytest.mark.parametrize("allowed_mem", ["256MB", "160KB"])
def test_dataframe_rechunk_and_sql_rechunk_read_the_same_dataset(fixtures, tmp_path, allowed_mem):
    """df.rechunk and SQL rechunk(...) against xarray on the source; the
    temporary copy goes once the results are read."""
    work = tmp_path / "work"
    ctx = zf.SessionContext(allowed_mem=allowed_mem, work_dir=work)
    ctx.register_zarr("src", fixtures / "rechunk_source.zarr")
    expected = xr.open_zarr(fixtures / "rechunk_source.zarr")[["t", "q"]].load()
    chunks = {"time": 37, "lat": 4, "lon": 4}
    frames = {
        "dataframe": ctx.table("src").rechunk(chunks),
        "sql": ctx.sql("SELECT * FROM rechunk('src', time => 37, lat => 4, lon => 4)"),
    }
    for df in frames.values():
        got = df.to_xarray()
        xr.testing.assert_allclose(got[["t", "q"]], expected, rtol=0, atol=0)
    plan = ctx.sql("EXPLAIN SELECT * FROM rechunk('src', time => 37, lat => 4, lon => 4)").to_pandas()
    assert plan["plan"].str.contains(r"RechunkExec.*t: \[1, \d+, \d+\] -> .*\[37, 4, 4\]").any()
    # Row-wise operations before the rechunk are kept.
    box = ctx.table("src").filter("lat > 0").select("time", "lat", "lon", "t").rechunk({"lat": 3})
    got = box.to_xarray().t
    xr.testing.assert_allclose(got, expected.t.where(expected.lat > 0, drop=True), rtol=0, atol=0)
    del frames, box, got
    import gc

    gc.collect()
    assert leftovers(work) == []


def test_a_group_by_of_a_rechunked_frame_reduces_the_rechunked_store(fixtures, tmp_path):
    """``df.rechunk(...)`` then a ``GROUP BY`` over dimensions (and the same
    in SQL): the dense reduction of the rechunked store, after the copy, in
    a budget that sends the copy through intermediate arrays; each cell's
    time mean and the zonal extremes are xarray's; nothing is left."""
    work = tmp_path / "work"
    ctx = zf.SessionContext(allowed_mem="160KB", work_dir=work)
    ctx.register_zarr("src", fixtures / "rechunk_source.zarr")
    ds = xr.open_zarr(fixtures / "rechunk_source.zarr").load()
    per_cell = ctx.table("src").rechunk({"time": ds.sizes["time"], "lat": 4, "lon": 4})
    per_cell = per_cell.aggregate(["lat", "lon"], ["avg(t) AS t", "count(q) AS n"])
    sql = (
        f"SELECT lat, min(q) AS lo, max(t) AS hi FROM rechunk('src', time => {ds.sizes['time']}, lat => 4) "
        "WHERE lon > 0 GROUP BY lat"
    )
    for df in [per_cell, ctx.sql(sql)]:
        shown = io.StringIO()
        df.explain(file=shown)
        plan = shown.getvalue()
        assert "DenseReductionExec" in plan and "RechunkExec" in plan, plan
        assert "AggregateExec" not in plan, plan
    got = per_cell.to_xarray()
    xr.testing.assert_allclose(got.t, ds.t.mean("time"), rtol=1e-6)
    xr.testing.assert_equal(got.n.astype("int64"), ds.q.count("time").astype("int64"))
    got = ctx.sql(sql).to_pandas().set_index("lat").sort_index()
    east = ds.where(ds.lon > 0, drop=True)
    np.testing.assert_array_equal(got["lo"], east.q.min(["time", "lon"]).to_series().sort_index())
    np.testing.assert_array_equal(got["hi"], east.t.max(["time", "lon"]).to_series().sort_index())
    del per_cell, got
    import gc

    gc.collect()
    assert leftovers(work) == []


def test_dataframe_rechunk_refuses_what_it_cannot_do(fixtures, tmp_path):
    ctx = zf.SessionContext(work_dir=tmp_path / "work")
    ctx.register_zarr("src", fixtures / "rechunk_source.zarr")
    with pytest.raises(zf.ZarrFusionError, match="row-wise operations"):
        ctx.table("src").aggregate(["lat"], ["avg(t) AS t"]).rechunk({"lat": 2})
    with pytest.raises(zf.ZarrFusionError, match="unknown dimension 'level'"):
        ctx.table("src").rechunk({"level": 2})
    small = zf.SessionContext(allowed_mem="16KB", work_dir=tmp_path / "work")
    small.register_zarr("src", fixtures / "rechunk_source.zarr")
    with pytest.raises(zf.ZarrFusionError, match="cannot fit allowed_mem"):
        small.table("src").rechunk({"time": 37, "lat": 29}).collect()


def test_an_object_store_work_dir_is_used_for_intermediates(fixtures, tmp_path):
    # An unregistered URL scheme: the rechunk fails where its intermediate
    # arrays go (the engine's tests run the same through an in-memory store).
    ctx = zf.SessionContext(allowed_mem="160KB", work_dir="nowhere://bucket/scratch")
    with pytest.raises(Exception, match="work_dir.*nowhere"):
        ctx.rechunk(fixtures / "rechunk_source.zarr", tmp_path / "out.zarr", {"time": 37, "lat": 4, "lon": 4})
    assert not (tmp_path / "out.zarr").exists()
    # One pass needs no intermediates: no work_dir is touched.
    ctx = zf.SessionContext(work_dir="nowhere://bucket/scratch")
    ctx.rechunk(fixtures / "rechunk_source.zarr", tmp_path / "one.zarr", {"lat": 7})
    assert (tmp_path / "one.zarr").is_dir()

"""SQL and DataFrame results against xarray and pandas, on the committed fixtures."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import xarray as xr

import zarrfusion as zf


def open_xr(path):
    return xr.open_zarr(path, chunks=None).load()


@pytest.mark.parametrize("store", ["v2_basic.zarr", "v3_basic.zarr"])
def test_group_by_lat_equals_xarray(ctx, fixtures, store):
    ctx.register_zarr("t", fixtures / store)
    got = ctx.sql("SELECT lat, avg(t2m) AS t, max(u10) AS u FROM t GROUP BY lat ORDER BY lat").to_pandas()
    ds = open_xr(fixtures / store)
    want = pd.DataFrame(
        {
            "t": ds.t2m.mean(["time", "lon"]).to_series(),
            "u": ds.u10.max(["time", "lon"]).to_series(),
        }
    ).sort_index()
    assert got["lat"].to_numpy().tolist() == want.index.to_numpy().tolist()
    np.testing.assert_allclose(got["t"], want["t"], rtol=1e-6)
    np.testing.assert_allclose(got["u"], want["u"], rtol=1e-12)


def test_dataframe_methods_equal_pandas(ctx, fixtures):
    ctx.register_zarr("t", fixtures / "v3_basic.zarr")
    ds = open_xr(fixtures / "v3_basic.zarr")
    frame = ds.to_dataframe().reset_index()
    df = (
        ctx.table("t")
        .filter("lat >= 15 AND t2m IS NOT NULL")
        .select("time", "lat", "lon", "t2m * 2 AS t2")
        .sort("lat DESC", "lon", "time")
        .limit(7, offset=2)
    )
    got = df.to_pandas()
    want = frame[(frame.lat >= 15) & frame.t2m.notna()].assign(t2=lambda f: f.t2m * 2)
    want = want.sort_values(["lat", "lon", "time"], ascending=[False, True, True]).iloc[2:9]
    assert df.columns == ["time", "lat", "lon", "t2"]
    np.testing.assert_array_equal(got["lat"].to_numpy(), want["lat"].to_numpy())
    np.testing.assert_array_equal(got["time"].to_numpy(), want["time"].to_numpy())
    np.testing.assert_allclose(got["t2"], want["t2"], rtol=1e-6)

    agg = ctx.table("t").aggregate(["lon"], ["count(t2m) AS n", "sum(u10) AS s"]).sort("lon").to_pandas()
    want = frame.groupby("lon").agg(n=("t2m", "count"), s=("u10", "sum")).reset_index()
    np.testing.assert_array_equal(agg["n"], want["n"])
    np.testing.assert_allclose(agg["s"], want["s"], rtol=1e-12)
    assert ctx.table("t").count() == frame.shape[0]
    # Limits and offsets up to 2^63 - 1 (DataFusion's), past it a ValueError.
    assert len(ctx.table("t").limit(2**63 - 1, offset=2).to_pandas()) == frame.shape[0] - 2
    assert len(ctx.table("t").limit(2**63 - 1, offset=2**63 - 1).to_pandas()) == 0
    for count, offset, name in [(2**64 - 1, 2, "count"), (5, 2**63, "offset"), (-1, 0, "count"), (1, -2, "offset")]:
        with pytest.raises(ValueError, match=f"limit: {name} must be from 0 to 9223372036854775807"):
            ctx.table("t").limit(count, offset=offset)
    with pytest.raises(ValueError, match="show: n must be from 0"):
        ctx.table("t").show(2**64)


def test_arrow_stream_and_schema(ctx, fixtures):
    ctx.register_zarr("t", fixtures / "v3_basic.zarr")
    df = ctx.sql("SELECT lat, lon, t2m FROM t WHERE time = TIMESTAMP '2020-01-01T00:00:00' ORDER BY lat, lon")
    table = pa.table(df)
    assert table.equals(df.to_arrow_table())
    assert pa.schema(df).names == ["lat", "lon", "t2m"]
    assert df.schema().field("t2m").type == pa.float32()
    batches = df.collect()
    assert sum(b.num_rows for b in batches) == table.num_rows == 20
    reader = pa.RecordBatchReader.from_stream(df)
    assert reader.read_all().num_rows == 20


def test_polars_and_duckdb_read_the_stream(ctx, fixtures):
    ctx.register_zarr("t", fixtures / "v3_basic.zarr")
    df = ctx.sql("SELECT lat, count(*) AS n FROM t GROUP BY lat ORDER BY lat")
    polars = pytest.importorskip("polars")
    assert polars.from_arrow(pa.table(df))["n"].to_list() == [24] * 5


def test_show_and_explain(ctx, fixtures, capsys):
    ctx.register_zarr("t", fixtures / "v3_basic.zarr")
    df = ctx.sql("SELECT lat, avg(t2m) FROM t GROUP BY lat")
    df.show(3)
    shown = capsys.readouterr().out
    assert shown.count("\n") >= 5 and "lat" in shown
    df.explain()
    assert "DenseReduction" in capsys.readouterr().out


def test_the_plan_drawn_as_dot_and_svg(ctx, fixtures, tmp_path, monkeypatch):
    import shutil

    ctx.register_zarr("t", fixtures / "v3_basic.zarr")
    df = ctx.sql("SELECT lat, avg(t2m) FROM t GROUP BY lat")
    dot = df.explain_dot()
    assert dot.startswith("digraph plan {") and "DenseReductionExec" in dot
    assert "projected_memory=" in dot and "metrics:" not in dot
    # Labels wrap at spaces wherever the (checkout-dependent) paths push them.
    analyzed = df.explain_dot(analyze=True).replace("\\l    ", " ")
    assert "metrics: output_rows=" in analyzed and "blocks_read=" in analyzed
    if shutil.which("dot"):
        svg = df.explain_svg(tmp_path / "plan.svg")
        assert "<svg" in svg and (tmp_path / "plan.svg").read_text() == svg
    else:
        print("Graphviz's dot is not installed: SVG not drawn")
    # Without Graphviz, a clear error.
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(zf.ZarrFusionError, match="install Graphviz"):
        df.explain_svg()


def test_settings_and_memory_budget(fixtures):
    ctx = zf.SessionContext(allowed_mem="4KB", config={"zarrfusion.dense_reduction": True})
    ctx.register_zarr("t", fixtures / "v3_basic.zarr")
    # Grouped by the hour of day first (its keys repeat along time), the
    # reduction does not fit 4 KB in one pass: it runs in bands of latitudes.
    by_hour = "SELECT extract(hour FROM time) AS h, lat, lon, avg(t2m) FROM t GROUP BY 1, lat, lon"
    assert "keys of lat" in ctx.sql(f"EXPLAIN {by_hour}").to_pandas()["plan"].str.cat()
    # (Its rows come band by band: sorted here, as an ORDER BY would have
    # DataFusion sort them, which needs more than 4 KB.)
    hours_in_bands = ctx.sql(by_hour).to_pandas().sort_values(["h", "lat", "lon"], ignore_index=True)
    # Grouped by time first, it runs in bands of time steps within 4 KB.
    every_cell = "SELECT time, lat, lon, avg(t2m) FROM t GROUP BY time, lat, lon"
    in_bands = ctx.sql(every_cell).to_pandas()
    with pytest.raises(ValueError, match="allowed_mem"):
        zf.SessionContext(allowed_mem="lots")
    with pytest.raises(ValueError, match="config"):
        zf.SessionContext(config={"zarrfusion.no_such_setting": "1"})
    # SET resizes the pool of the same session.
    ctx.sql("SET zarrfusion.allowed_mem = '1GB'")
    one_pass = ctx.sql(every_cell).to_pandas()
    assert len(one_pass) == 6 * 5 * 4
    numbers = in_bands.select_dtypes("number").columns
    assert len(numbers) == 3
    np.testing.assert_allclose(in_bands[numbers].to_numpy(float), one_pass[numbers].to_numpy(float), rtol=1e-12)
    assert list(in_bands.time) == list(one_pass.time)
    hours = ctx.sql(by_hour).to_pandas().sort_values(["h", "lat", "lon"], ignore_index=True)
    assert len(hours) == 4 * 5 * 4
    pd.testing.assert_frame_equal(hours_in_bands, hours, rtol=1e-12)
    # Where not even a band of one latitude fits, refused with the numbers.
    ctx.sql("SET zarrfusion.allowed_mem = '2kb'")
    with pytest.raises(zf.ZarrFusionError, match="memory"):
        ctx.sql(by_hour).to_pandas()
    with pytest.raises(zf.ZarrFusionError, match="zarrfusion.allowed_mem"):
        ctx.sql("SET zarrfusion.allowed_mem = 'lots'")
    # config takes zarrfusion.allowed_mem as SET does, the argument's pool.
    configured = zf.SessionContext(config={"zarrfusion.allowed_mem": "2KB"})
    configured.register_zarr("t", fixtures / "v3_basic.zarr")
    with pytest.raises(zf.ZarrMemoryError, match="2.0 KB"):
        configured.sql(by_hour).to_pandas()
    assert configured.sql("SHOW datafusion.runtime.memory_limit").to_pandas()["value"][0] == "2K"
    with pytest.raises(ValueError, match="zarrfusion.allowed_mem"):
        zf.SessionContext(config={"zarrfusion.allowed_mem": "lots"})
    with pytest.raises(ValueError, match="given twice"):
        zf.SessionContext(allowed_mem="1GB", config={"ZARRFUSION.allowed_mem": "4KB"})
    # Reads in flight: at most 4096, refused past it by every door.
    with pytest.raises(ValueError, match="io_concurrency.*at most 4096"):
        zf.SessionContext(io_concurrency=5000)
    with pytest.raises(ValueError, match="io_concurrency.*at most 4096"):
        zf.SessionContext(config={"zarrfusion.io_concurrency": str(2**62)})
    with pytest.raises(zf.ZarrFusionError, match="io_concurrency.*at most 4096"):
        ctx.sql("SET zarrfusion.io_concurrency = 4097")
    zf.SessionContext(io_concurrency=4096).sql("SET zarrfusion.io_concurrency = 4096")
    # Rows a batch and partitions: at most 2^24 and 1024 (more panicked in
    # sorts and the dense reduction), by every door.
    with pytest.raises(ValueError, match="batch_size.*at most 16777216"):
        zf.SessionContext(batch_size=2**62)
    with pytest.raises(ValueError, match="target_partitions.*at most 1024"):
        zf.SessionContext(target_partitions=2**64 - 1)
    with pytest.raises(ValueError, match="target_partitions.*at most 1024"):
        zf.SessionContext(config={"datafusion.execution.target_partitions": "1025"})
    with pytest.raises(zf.ZarrFusionError, match="batch_size.*at most 16777216"):
        ctx.sql("SET datafusion.execution.batch_size = 18446744073709551615")
    # Retries whose backoff object_store cannot draw are refused when set.
    with pytest.raises(zf.ZarrFusionError, match="retry.backoff.base must be a number above 1"):
        ctx.sql("SET zarrfusion.retry.backoff.base = 1")
    ctx.sql("SET zarrfusion.allowed_mem = '1GB'")
    ctx.sql("SET datafusion.execution.batch_size = 16777216")
    assert len(ctx.sql("SELECT * FROM t ORDER BY lat").to_pandas()) == 6 * 5 * 4


def test_errors_are_exceptions_with_the_engine_message(ctx, fixtures):
    with pytest.raises(zf.ZarrFusionError, match="SQL|sql|Expected"):
        ctx.sql("SELEC 1")
    with pytest.raises(zf.ZarrFusionError, match="nope"):
        ctx.sql("SELECT * FROM nope")
    with pytest.raises(zf.ZarrFusionError, match="does_not_exist"):
        ctx.register_zarr("x", fixtures / "does_not_exist.zarr")
    with pytest.raises(ValueError, match="unknown Zarr table option"):
        ctx.register_zarr("x", fixtures / "v3_basic.zarr", colour="red")
    ctx.register_zarr("bad", fixtures / "bad_corrupt_chunk.zarr")
    with pytest.raises(zf.ZarrFusionError, match=r"bad_corrupt_chunk.zarr.*chunk"):
        ctx.sql("SELECT * FROM bad").to_pandas()
    with pytest.raises(ValueError, match="filter"):
        ctx.sql("SELECT 1 AS a").filter("no_such_column > 1")


def test_errors_are_typed_and_say_where(fixtures, tmp_path):
    """A corrupt chunk is a ZarrDataError (an OSError) naming store, array,
    chunk and key as attributes; a missing store a ZarrDataError naming the
    store; a refusal for allowed_mem a ZarrMemoryError (a MemoryError); bad
    SQL a plain ZarrFusionError without a location; all ZarrFusionErrors."""
    ctx = zf.SessionContext()
    ctx.register_zarr("bad", fixtures / "bad_corrupt_chunk.zarr")
    with pytest.raises(zf.ZarrDataError) as caught:
        ctx.sql("SELECT * FROM bad").to_pandas()
    e = caught.value
    assert isinstance(e, OSError) and isinstance(e, zf.ZarrFusionError)
    assert e.store.endswith("bad_corrupt_chunk.zarr") and e.array, vars(e)
    assert isinstance(e.chunk, list) and all(isinstance(i, int) for i in e.chunk), vars(e)
    # The key is the corrupt chunk's object in the store.
    assert e.key.startswith(e.array + "/") and (fixtures / "bad_corrupt_chunk.zarr" / e.key).is_file(), vars(e)
    assert e.array in str(e) and e.key in str(e)
    with pytest.raises(zf.ZarrDataError) as caught:
        ctx.register_zarr("x", fixtures / "does_not_exist.zarr")
    assert caught.value.store.endswith("does_not_exist.zarr") and caught.value.chunk is None
    small = zf.SessionContext(allowed_mem="64KB")
    small.register_zarr("src", fixtures / "rechunk_source.zarr")
    with pytest.raises(zf.ZarrMemoryError, match="allowed_mem") as caught:
        small.rechunk("src", tmp_path / "out.zarr", {"time": 37, "lat": 29})
    assert isinstance(caught.value, MemoryError) and caught.value.store is None
    with pytest.raises(zf.ZarrFusionError) as caught:
        ctx.sql("SELEC 1")
    assert type(caught.value) is zf.ZarrFusionError and caught.value.store is None


def test_ctrl_c_cancels_a_running_query(ctx, ctrl_c):
    df = ctx.sql("SELECT sum(value) FROM generate_series(1, 100000000000)")
    ctrl_c(0.5)
    with pytest.raises(KeyboardInterrupt):
        df.to_pandas()


def test_a_join_on_all_dimensions_equals_xarray(ctx, fixtures):
    # Two stores on the same grid (chunked differently, v2 and v3): the join
    # is a zip of aligned blocks, then a dense reduction, not a hash join.
    ctx.register_zarr("a", fixtures / "raw_v2.zarr")
    ctx.register_zarr("b", fixtures / "raw_v3.zarr")
    sql = (
        "SELECT a.lat, avg(a.t - b.q) AS d, count(b.n) AS n FROM a JOIN b "
        "ON a.time = b.time AND a.lat = b.lat AND a.lon = b.lon GROUP BY a.lat ORDER BY a.lat"
    )
    plan = "\n".join(ctx.sql("EXPLAIN " + sql).to_pandas()["plan"])
    assert "HashJoinExec" not in plan and "DenseReductionExec" in plan, plan
    got = ctx.sql(sql).to_pandas()
    a, b = open_xr(fixtures / "raw_v2.zarr"), open_xr(fixtures / "raw_v3.zarr")
    want = (a.t - b.q).mean(["time", "lon"]).to_series().sort_index()
    assert got["lat"].to_numpy().tolist() == want.index.to_numpy().tolist()
    np.testing.assert_allclose(got["d"], want.to_numpy(), rtol=1e-6)
    assert got["n"].tolist() == [int(b.n.sizes["time"] * b.n.sizes["lon"])] * len(got)


def test_a_long_regular_coordinate_is_never_held_whole(tmp_path):
    """A 1-D store written by xarray whose time coordinate has 2^24 float64
    values (128 MB, `numpy.arange(n) * 1e-3`) is registered and queried
    with a filter on time under allowed_mem 48 MB, in a fresh process: the
    coordinate is checked a piece at a time and held as its formula, so the
    process's peak memory grows by less than 64 MB over registration and
    query (by more than the 128 MB coordinate when that was held; measured
    after a first query, whose ~60 MB of runtime set-up is not the
    coordinate's), and the answer is numpy's."""
    from peak_memory import run_child

    n, chunk = 1 << 24, 1 << 20
    t = np.arange(n) * 1e-3
    v = (np.arange(n) % 1000).astype(np.float32)
    ds = xr.Dataset({"v": ("t", v)}, coords={"t": t})
    encoding = {"t": {"chunks": (chunk,)}, "v": {"chunks": (chunk,)}}
    ds.to_zarr(tmp_path / "long.zarr", encoding=encoding, zarr_format=3, consolidated=False)
    lo, hi = 1000.0, 2000.0
    script = f"""
import zarrfusion as zf
ctx = zf.SessionContext(allowed_mem="48MB")
ctx.sql("SELECT 1").to_arrow_table()  # the process's first query costs ~60 MB of its own
before = reset_peak()
ctx.register_zarr("long", {str(tmp_path / "long.zarr")!r})
got = ctx.sql("SELECT count(*) AS n, min(t) AS lo, max(t) AS hi, sum(CAST(v AS DOUBLE)) AS s "
              "FROM long WHERE t >= {lo} AND t < {hi}").to_arrow_table().to_pydict()
print(json.dumps({{"got": {{k: c[0] for k, c in got.items()}}, "grown": status("VmHWM") - before}}))
"""
    report = run_child(script)
    inside = (t >= lo) & (t < hi)
    got = report["got"]
    assert got["n"] == inside.sum()
    assert got["lo"] == t[inside].min() and got["hi"] == t[inside].max()
    assert got["s"] == pytest.approx(v[inside].astype(np.float64).sum(), rel=1e-12)
    assert report["grown"] < 64e6, f"peak memory grew by {report['grown'] / 2**20:.0f} MiB"


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("dtype", ["complex64", "complex128", "float16"])
def test_complex_and_half_precision_values_equal_numpy(tmp_path, dtype, zarr_format):
    """Complex values (a struct of real and imaginary parts) and float16
    (as float32, NaN as null) scanned by SQL equal what xarray wrote, odd
    counts of values included; Zarr v2 complex arrays (written with a null
    fill value) open too."""
    rng = np.random.default_rng(7)
    values = rng.normal(size=(3, 7))
    if dtype.startswith("complex"):
        values = values + 1j * rng.normal(size=(3, 7))
    else:
        values[1, 2] = np.nan
    values = values.astype(dtype)
    store = tmp_path / f"{dtype}.zarr"
    xr.Dataset({"z": (("a", "b"), values)}).to_zarr(store, zarr_format=zarr_format, consolidated=False)
    ctx = zf.SessionContext()
    ctx.register_zarr("t", str(store))
    got = ctx.sql("SELECT a, b, z FROM t ORDER BY a, b").to_arrow_table().to_pylist()
    assert [(r["a"], r["b"]) for r in got] == [(a, b) for a in range(3) for b in range(7)]
    for r in got:
        want = values[r["a"], r["b"]]
        if dtype.startswith("complex"):
            assert (r["z"]["re"], r["z"]["im"]) == (float(want.real), float(want.imag))
        elif np.isnan(want):
            assert r["z"] is None
        else:
            assert r["z"] == float(want)


def test_ctrl_c_cancels_the_opening_of_a_store_that_does_not_answer(ctrl_c):
    """A store behind a server that accepts connections and never answers:
    Ctrl-C interrupts ``register_zarr`` within two seconds."""
    import socket
    import time

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    port = server.getsockname()[1]
    ctx = zf.SessionContext()
    ctrl_c(0.5)
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            ctx.register_zarr(
                "t", f"http://127.0.0.1:{port}/store.zarr", **{"client.timeout": "20s", "retry.max_retries": "0"}
            )
        assert time.monotonic() - started < 2.5
    finally:
        server.close()


def test_a_dimension_of_a_trillion_positions_filters_at_once_and_ctrl_c_stops_a_scan_of_it(trillion_store, ctrl_c):
    import time

    ctx = zf.SessionContext()
    ctx.register_zarr("t", trillion_store)
    # Comparisons with literals select positions at once, past 2^32 too.
    started = time.monotonic()
    got = ctx.sql("SELECT x FROM t WHERE x IN (5, 4294967301, 999999999999) OR x > 999999999998 ORDER BY x")
    assert got.to_pandas()["x"].tolist() == [5, 4294967301, 999999999999]
    assert time.monotonic() - started < 5
    # Any other filter goes through the rows: 10^12 of them, stopped by Ctrl-C.
    df = ctx.sql("SELECT count(*) FROM t WHERE x % 7 = 3")
    ctrl_c(0.5)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        df.to_pandas()
    assert time.monotonic() - started < 2.5

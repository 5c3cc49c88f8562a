"""DataFrame.to_zarr and COPY ... STORED AS ZARR, read back by xarray."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import xarray as xr

import zarrfusion as zf


def open_xr(path):
    return xr.open_zarr(path, chunks=None).load()


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("store", ["v2_basic.zarr", "v3_basic.zarr"])
def test_xarray_reads_what_to_zarr_wrote(ctx, fixtures, tmp_path, store, zarr_format):
    ctx.register_zarr("t", fixtures / store)
    src = open_xr(fixtures / store)
    lat0 = float(src.lat.values[2])
    out = tmp_path / "out.zarr"
    rows = ctx.sql(f"SELECT time, lat, lon, t2m * 2 AS t2, u10 FROM t WHERE lat <= {lat0}").to_zarr(
        out, chunks={"time": 4}, zarr_format=zarr_format, codec="blosc"
    )
    got = open_xr(out)
    want = src.where(src.lat <= lat0, drop=True)
    assert rows == want.t2m.size
    assert got.t2.dims == ("time", "lat", "lon") and got.u10.dtype == want.u10.dtype
    np.testing.assert_array_equal(got.time.values, want.time.values)
    # Latitude descends in the store and in the output.
    np.testing.assert_array_equal(got.lat.values, want.lat.values)
    np.testing.assert_array_equal(got.lon.values, want.lon.values)
    np.testing.assert_allclose(got.t2.values, (want.t2m * 2).values, rtol=1e-6)
    np.testing.assert_array_equal(got.u10.values, want.u10.values)
    # Attributes as xarray shows them: a variable copied as it is keeps its
    # own (units, long_name), a computed one has none, the coordinates keep
    # theirs; what decoding used (fill values, time units) is the writer's.
    def attrs(da):
        return {k: v for k, v in da.attrs.items() if k != "_zarrs"}

    assert src.u10.attrs and attrs(got.u10) == src.u10.attrs
    assert attrs(got.t2) == {}
    for d in ("time", "lat", "lon"):
        assert attrs(got[d]) == src[d].attrs, d


def test_copy_statement_writes_a_reduction(ctx, fixtures, tmp_path):
    ctx.register_zarr("t", fixtures / "v2_basic.zarr")
    out = tmp_path / "mean.zarr"
    ctx.sql(f"COPY (SELECT lat, lon, avg(t2m) AS t FROM t GROUP BY lat, lon) TO '{out}' STORED AS ZARR").collect()
    got = open_xr(out)
    want = open_xr(fixtures / "v2_basic.zarr").t2m.mean("time")
    np.testing.assert_allclose(got.t.sortby("lat").values, want.sortby("lat").values, rtol=1e-6)


def test_any_table_with_named_dims(ctx, tmp_path):
    out = tmp_path / "values.zarr"
    ctx.sql("SELECT * FROM (VALUES (3, 2.5), (1, 1.5), (2, NULL)) AS v(x, y)").to_zarr(out, dims=["x"], zarr_format=2)
    got = open_xr(out)
    assert got.x.values.tolist() == [1, 2, 3]
    np.testing.assert_array_equal(got.y.values, [1.5, np.nan, 2.5])


def test_failed_and_refused_writes_leave_nothing(ctx, fixtures, tmp_path):
    ctx.register_zarr("t", fixtures / "v2_basic.zarr")
    with pytest.raises(zf.ZarrFusionError, match="not a grid"):
        ctx.sql("SELECT lat, t2m FROM t").to_zarr(tmp_path / "dup.zarr")
    with pytest.raises(zf.ZarrFusionError, match="(?i)cast"):
        ctx.sql(
            "SELECT time, lat, lon, CASE WHEN lat < 30 THEN CAST(concat('x', lon) AS DOUBLE) ELSE t2m END AS t FROM t"
        ).to_zarr(tmp_path / "midway.zarr")
    with pytest.raises(ValueError, match="codec"):
        ctx.sql("SELECT time, lat, lon, t2m FROM t").to_zarr(tmp_path / "codec.zarr", codec="lzma")
    assert list(tmp_path.iterdir()) == []
    existing = tmp_path / "existing.zarr"
    existing.mkdir()
    (existing / "keep.txt").write_text("data")
    with pytest.raises(zf.ZarrFusionError, match="already exists"):
        ctx.sql("SELECT time, lat, lon, t2m FROM t").to_zarr(existing)
    assert [p.name for p in existing.iterdir()] == ["keep.txt"]


def test_ctrl_c_cancels_a_write_and_leaves_nothing(ctx, tmp_path, ctrl_c):
    out = tmp_path / "slow.zarr"
    df = ctx.sql("SELECT 1 AS x, sum(value) AS y FROM generate_series(1, 100000000000)")
    ctrl_c(0.5)
    with pytest.raises(KeyboardInterrupt):
        df.to_zarr(out, dims=["x"])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "store,zarr_format",
    [
        ("v2_basic.zarr", 3),
        ("v2_basic.zarr", 2),
        ("v3_basic.zarr", 3),
        ("cf_packed.zarr", 3),
        ("cf_packed_v3.zarr", 3),
        ("cf_time.zarr", 3),
    ],
)
def test_a_whole_table_is_copied_as_stored(fixtures, tmp_path, store, zarr_format):
    # The table as it is: its arrays are copied chunk by chunk (packed
    # values stay packed, times CF-encoded), so xarray decodes the same
    # dataset, rechunked, within a budget smaller than the table's rows.
    ctx = zf.SessionContext(allowed_mem="1MB")
    ctx.register_zarr("t", fixtures / store)
    df = ctx.table("t")
    plan = ctx.sql(f"EXPLAIN COPY t TO '{tmp_path / 'unused.zarr'}' STORED AS ZARR").to_arrow_table()
    assert "ArrayCopyExec" in " ".join(plan["plan"].to_pylist())
    src = open_xr(fixtures / store)
    dim = [c for c in df.columns if c in src.dims][-1]
    out = tmp_path / "out.zarr"
    rows = df.to_zarr(out, chunks={dim: 2}, zarr_format=zarr_format, codec="gzip")
    got = open_xr(out)
    variables = [c for c in df.columns if c not in src.dims]
    assert sorted(got.data_vars) == sorted(variables)
    want = src[variables]
    assert rows == want[variables[0]].size
    xr.testing.assert_identical(got, want)
    for name in variables:
        assert got[name].encoding["chunks"][list(got[name].dims).index(dim)] == 2


@pytest.mark.parametrize("store", ["cf_packed.zarr", "cf_packed_v3.zarr", "cal_noleap.zarr"])
def test_a_copied_selection_keeps_the_attributes_xarray_shows(ctx, fixtures, tmp_path, store):
    # Packed (scale_factor, add_offset, _FillValue) and model-calendar
    # sources: the values are written decoded, so only the attributes
    # xarray shows after decoding travel (units, long_name), never the
    # packing or the source's time units.
    ctx.register_zarr("t", fixtures / store)
    # Times undecoded: attributes other than the time's are the same, and a
    # model calendar needs no cftime.
    src = xr.open_zarr(fixtures / store, decode_times=False)
    out = tmp_path / "out.zarr"
    ctx.sql(f"COPY (SELECT * FROM t WHERE lat > 0) TO '{out}' STORED AS ZARR").collect()
    got = xr.open_zarr(out)
    for name in [*src.data_vars, "lat", "lon"]:
        kept = {k: v for k, v in got[name].attrs.items() if k != "_zarrs"}
        assert kept == src[name].attrs, name
    # The copy's time is the source's dates, in the source's calendar (as
    # xarray writes cftime dates back).
    calendar = src.time.attrs.get("calendar", "proleptic_gregorian")
    if calendar == "noleap":
        assert got.time.encoding["calendar"] == "noleap"


def test_copies_keep_a_model_calendar(ctx, fixtures, tmp_path):
    # xarray writes cftime dates back in their calendar: so do the COPY of a
    # selection (chunk by chunk), of an aggregate (from rows) and of a
    # transform, so that xarray reads the same noleap dates back.
    ctx.register_zarr("t", fixtures / "cal_noleap.zarr")
    src = open_xr(fixtures / "cal_noleap.zarr")
    assert src.time.encoding["calendar"] == "noleap"

    def same_dates(got, want):
        assert got.time.encoding["calendar"] == "noleap"
        assert list(got.time.values) == list(want.time.values)

    selection = tmp_path / "selection.zarr"
    ctx.sql(
        f"COPY (SELECT * FROM t WHERE time >= TIMESTAMP '2000-02-20' AND time < TIMESTAMP '2000-03-10') "
        f"TO '{selection}' STORED AS ZARR"
    ).collect()
    got, want = open_xr(selection), src.sel(time=slice("2000-02-20", "2000-03-09"))
    assert want.sizes["time"] == 18  # 28 days of February in noleap
    same_dates(got, want)
    xr.testing.assert_equal(got.tas.transpose(*want.tas.dims).reset_coords(drop=True), want.tas.reset_coords(drop=True))

    monthly = tmp_path / "monthly.zarr"
    ctx.sql(
        f"COPY (SELECT date_trunc('month', time) AS time, lat, lon, avg(tas) AS tas FROM t GROUP BY 1, lat, lon) "
        f"TO '{monthly}' STORED AS ZARR"
    ).collect()
    got, want = open_xr(monthly), src.tas.resample(time="MS").mean()
    same_dates(got, want)
    np.testing.assert_allclose(got.tas.transpose(*want.dims).values, want.values, rtol=1e-6)
    # A time plus a day steps over the calendar's days: the 28th of
    # February's next day is the 1st of March, written in the calendar.
    shifted = tmp_path / "shifted.zarr"
    ctx.sql(
        f"COPY (SELECT time + INTERVAL '1 day' AS time, lat, lon, tas FROM t WHERE time = TIMESTAMP '2000-02-28') "
        f"TO '{shifted}' STORED AS ZARR"
    ).collect()
    got = open_xr(shifted)
    assert got.time.encoding["calendar"] == "noleap"
    assert list(got.time.values) == [t for t in src.time.values if (t.month, t.day) == (3, 1)]

    spectrum = tmp_path / "spectrum.zarr"
    store = fixtures.parent / "fft" / "data" / "noleap_6h.zarr"
    ctx.sql(f"COPY (SELECT * FROM fft('{store}', 'v', dims => 'lat')) TO '{spectrum}' STORED AS ZARR").collect()
    same_dates(open_xr(spectrum), xr.open_zarr(store, consolidated=False))


@pytest.mark.parametrize("store", ["v2_basic.zarr", "v3_basic.zarr"])
def test_a_copied_reduction_keeps_the_attributes_as_xarray_does(ctx, fixtures, tmp_path, store):
    # xarray's reductions keep their coordinates' and variable's
    # attributes (units, long_name): so does a COPY of an aggregate, whose
    # rows are laid out as a grid again.
    ctx.register_zarr("t", fixtures / store)
    src = open_xr(fixtures / store)

    def attrs(da):
        return {k: v for k, v in da.attrs.items() if k != "_zarrs"}

    zonal = tmp_path / "zonal.zarr"
    ctx.sql(f"COPY (SELECT lat, lon, avg(t2m) AS t2m FROM t GROUP BY lat, lon) TO '{zonal}' STORED AS ZARR").collect()
    want = src.t2m.mean("time")
    got = open_xr(zonal)
    for d in ("lat", "lon"):
        assert want[d].attrs and attrs(got[d]) == want[d].attrs, d
    daily = tmp_path / "daily.zarr"
    df = ctx.sql("SELECT date_trunc('day', time) AS time, lat, lon, avg(t2m) AS t2m FROM t GROUP BY 1, lat, lon")
    df.to_zarr(daily)
    want = src.t2m.resample(time="1D").mean()
    got = open_xr(daily)
    for d in ("time", "lat", "lon"):
        assert attrs(got[d]) == want[d].attrs, d
    # The variable keeps its own too, as xarray's resample does (a column
    # named otherwise is another variable: none).
    assert want.attrs and attrs(got.t2m) == want.attrs
    np.testing.assert_allclose(got.t2m.transpose(*want.dims).values, want.values, rtol=1e-6)


def test_resampling_and_coarsening_in_bands_equal_xarray(fixtures, tmp_path):
    # With the group state held at once cut to a few hundred bytes, a
    # resampling and a coarsening of descending latitudes run in bands of
    # their first grouped dimension's keys; their rows (band after band) are
    # written and read back as xarray's answer, or queried as pandas'.
    src = open_xr(fixtures / "climate.zarr")

    def banded(sql, bound):
        ctx = zf.SessionContext(config={"zarrfusion.dense_state_bytes": str(bound)})
        ctx.register_zarr("c", fixtures / "climate.zarr")
        plan = ctx.sql(f"EXPLAIN {sql}").to_pandas()["plan"].str.cat()
        assert ", bands=" in plan, plan
        return ctx

    daily_sql = "SELECT date_trunc('day', time) AS time, lat, lon, avg(t2m) AS t2m FROM c GROUP BY 1, lat, lon"
    coarse_sql = "SELECT floor(lat / 10) * 10 AS lat, lon, max(u10) AS u10 FROM c GROUP BY 1, 2"
    out = tmp_path / "daily.zarr"
    banded(daily_sql, 1024).sql(f"COPY ({daily_sql}) TO '{out}' STORED AS ZARR").collect()
    want = src.t2m.resample(time="1D").mean()
    got = open_xr(out).t2m.transpose(*want.dims)
    np.testing.assert_array_equal(got.time.values, want.time.values)
    np.testing.assert_allclose(got.values, want.values, rtol=1e-6)
    # The bins' rows in the reduction's order (bins ascending), band after band.
    rows = banded(coarse_sql, 256).sql(coarse_sql).to_pandas().set_index(["lat", "lon"]).u10
    assert list(rows.index) == sorted(rows.index)
    cells = src.u10.to_dataframe().reset_index()
    cells["lat"] = np.floor(cells.lat / 10) * 10
    want = cells.groupby(["lat", "lon"]).u10.max()
    assert list(rows.index) == list(want.index)
    np.testing.assert_allclose(rows.values, want.values, rtol=1e-6)


def test_a_climatology_over_the_bound_runs_in_bands_of_latitudes_equal_to_xarray(fixtures, tmp_path):
    # The months repeat along time, so a monthly climatology cannot be cut
    # by its first grouped dimension; over a bound one latitude's groups fit,
    # it runs in bands of latitudes (EXPLAIN: keys of lat) instead of
    # DataFusion's hash aggregation. Its rows come band by band, not in the
    # grid's order: the COPY writes them a band at a time, xarray's answer.
    src = open_xr(fixtures / "climate.zarr")
    # 2 KB: the 180 groups' state (8.6 KB) does not fit, one latitude's does.
    ctx = zf.SessionContext(config={"zarrfusion.dense_state_bytes": "2048"})
    ctx.register_zarr("c", fixtures / "climate.zarr")
    sql = (
        "SELECT extract(month FROM time) AS month, lat, lon, avg(t2m) AS t2m, "
        "stddev_pop(u10) AS u10 FROM c GROUP BY 1, 2, 3"
    )
    plan = ctx.sql(f"EXPLAIN {sql}").to_pandas()["plan"].str.cat()
    assert "DenseReductionExec" in plan and " keys of lat" in plan, plan
    assert "AggregateExec" not in plan, plan
    out = tmp_path / "clim.zarr"
    ctx.sql(f"COPY ({sql}) TO '{out}' STORED AS ZARR OPTIONS ('dims' 'month,lat,lon')").collect()
    got = open_xr(out)
    by_month = src.groupby("time.month")
    for name, want in [("t2m", by_month.mean().t2m), ("u10", by_month.std().u10)]:
        have = got[name].transpose(*want.dims)
        for d in want.dims:
            np.testing.assert_array_equal(have[d].values, want[d].values)
        np.testing.assert_allclose(have.values, want.values, rtol=1e-5)
    # Its rows as pandas groups them, in the order ORDER BY asks.
    rows = ctx.sql(f"{sql} ORDER BY 1, 2, 3").to_pandas()
    cells = src.to_dataframe().reset_index()
    cells["month"] = cells.time.dt.month
    want = cells.groupby(["month", "lat", "lon"]).agg(t2m=("t2m", "mean"))
    assert list(zip(rows.month, rows.lat, rows.lon)) == list(want.index)
    np.testing.assert_allclose(rows.t2m.values, want.t2m.values, rtol=1e-5)


def test_copied_reduction_is_written_as_its_rows_come_equal_to_xarray(fixtures, tmp_path):
    # A COPY of a dense reduction is written a slab of chunks at a time as
    # its rows come (EXPLAIN: streamed=...), in bands, inside an allowed_mem
    # where the rows and grid the collecting writer holds do not fit (a
    # filter on values makes it collect: refused). The store is xarray's
    # answer; latitudes named anew are written ascending (the rows came
    # descending, as stored), the count as int64.
    src = open_xr(fixtures / "climate.zarr")
    # 128 KB: the reduction in bands (64 KB) and a slab of two bins; the
    # collecting sink's 10,900 rows (435 KB) and grid (175 KB) do not fit.
    ctx = zf.SessionContext(allowed_mem="128KB", config={"zarrfusion.dense_state_bytes": "4096"})
    ctx.register_zarr("c", fixtures / "climate.zarr")
    sql = (
        "SELECT date_bin(INTERVAL '12 hours', time) AS time, lat AS la, lon, avg(t2m) AS t2m, "
        "count(t2m) AS n FROM c GROUP BY 1, lat, lon"
    )
    out = tmp_path / "streamed.zarr"
    copy = f"COPY ({sql}) TO '{out}' STORED AS ZARR OPTIONS ('dims' 'time,la,lon', 'chunks' 'time=2')"
    plan = ctx.sql(f"EXPLAIN {copy}").to_pandas()["plan"].str.cat()
    assert "streamed=" in plan and ", bands=" in plan, plan
    ctx.sql(copy).collect()
    got = open_xr(out)
    resampled = src.t2m.resample(time="12h")
    for name, want in [("t2m", resampled.mean()), ("n", resampled.count())]:
        want = want.rename(lat="la").sortby("la")
        have = got[name].transpose(*want.dims)
        for d in want.dims:
            np.testing.assert_array_equal(have[d].values, want[d].values)
        np.testing.assert_allclose(have.values, want.values, rtol=1e-6)
    assert list(got.la.values) == sorted(got.la.values) and got.n.dtype == np.int64
    with pytest.raises(Exception, match="Resources exhausted"):
        ctx.sql(
            f"COPY (SELECT * FROM ({sql}) WHERE n >= 0) TO '{tmp_path / 'collected.zarr'}' "
            "STORED AS ZARR OPTIONS ('dims' 'time,la,lon')"
        ).collect()
    assert not (tmp_path / "collected.zarr").exists()


def test_copied_reduction_in_bands_of_latitudes_is_xarray_s_diurnal_cycle(hourly_store, tmp_path):
    # The hours of the day repeat along time, so a reduction by hour, lat and
    # lon over the state one pass may hold runs in bands of latitudes, its
    # rows band by band; its COPY writes a band at a time (EXPLAIN:
    # streamed=... (its bands)), the chunks a band boundary cuts (bands of 6
    # latitudes, chunks of 4) in parts. The store is xarray's diurnal cycle
    # (groupby("time.hour"): mean and std with ddof=0), NaN holes included,
    # its latitudes descending as stored.
    store, assert_diurnal = hourly_store
    ctx = zf.SessionContext(allowed_mem="1MB", config={"zarrfusion.dense_state_bytes": "65536"})
    ctx.register_zarr("h", store)
    out = tmp_path / "diurnal.zarr"
    copy = (
        "COPY (SELECT extract(hour FROM time) AS hour, lat, lon, avg(t2m) AS t2m, "
        f"stddev_pop(t2m) AS s FROM h GROUP BY 1, lat, lon) TO '{out}' STORED AS ZARR "
        "OPTIONS ('dims' 'hour,lat,lon', 'chunks' 'hour=5,lat=4,lon=3')"
    )
    plan = ctx.sql(f"EXPLAIN {copy}").to_pandas()["plan"].str.cat()
    assert "streamed=6 of lat per write (its bands)" in plan and "bands=4 of 6 keys of lat" in plan, plan
    ctx.sql(copy).collect()
    assert_diurnal(out)


def test_copied_climate_results_equal_xarray_in_any_row_order(ctx, fixtures, tmp_path):
    # A dense reduction's rows arrive in the grid's order (latitude
    # descending as stored) and are laid out as they are; rows in another
    # order, or a coordinate the grid sorts the other way, find their cells
    # one by one. Either way the store is xarray's answer. The fixture has
    # NaN holes and a cell with no value all day (its mean is missing).
    ctx.register_zarr("c", fixtures / "climate.zarr")
    src = open_xr(fixtures / "climate.zarr")

    def copied(name, sql, options=""):
        out = tmp_path / f"{name}.zarr"
        ctx.sql(f"COPY ({sql}) TO '{out}' STORED AS ZARR {options}").collect()
        return open_xr(out)

    def same(got, want):
        got = got.transpose(*want.dims)
        for d in want.dims:
            np.testing.assert_array_equal(got[d].values, want[d].values)
        np.testing.assert_allclose(got.values, want.values, rtol=1e-6)

    daily_sql = "SELECT date_trunc('day', time) AS time, lat, lon, avg(t2m) AS t2m, count(t2m) AS n FROM c GROUP BY 1, lat, lon"
    daily = copied("daily", daily_sql)
    resampled = src.t2m.resample(time="1D")
    assert np.isnan(resampled.mean().sel(time="2019-11-11", lat=40, lon=120))  # a day with no value
    same(daily.t2m, resampled.mean())
    same(daily.n, resampled.count())
    assert daily.n.dtype == np.int64
    # The same rows in another order: the same store.
    shuffled = copied("shuffled", f"SELECT * FROM ({daily_sql}) ORDER BY time DESC, lat ASC, lon DESC")
    xr.testing.assert_identical(shuffled, daily)

    monthly = copied(
        "monthly", "SELECT extract(month FROM time) AS month, lat, lon, avg(t2m) AS t2m FROM c GROUP BY 1, lat, lon",
        "OPTIONS ('dims' 'month,lat,lon')",
    )
    same(monthly.t2m, src.t2m.groupby("time.month").mean())

    # floor(lat / 20) * 20 named lat: written descending as the stored
    # latitude is, though the reduction gives its keys ascending.
    coarse = copied(
        "coarse",
        "SELECT time, floor(lat / 20) * 20 AS lat, lon, avg(t2m) AS t2m FROM c "
        "WHERE time < TIMESTAMP '2019-11-03' GROUP BY 1, 2, 3",
    )
    want = src.t2m.sel(time=slice(None, "2019-11-02T18")).coarsen(lat=2).mean()
    want = want.assign_coords(lat=np.floor(want.lat.values / 20) * 20)
    same(coarse.t2m, want)
    assert list(coarse.lat.values) == [40.0, 20.0, 0.0]

"""Dates of model calendars (noleap, 360_day, all_leap, julian) against
xarray's answers on the cftime dates it decodes them to: the days of the
year and of the week count the calendar's own days, in rows and in the
dense reduction's groups."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

import zarrfusion as zf

STORES = ["cal_noleap.zarr", "cal_360_day.zarr", "cal_all_leap.zarr", "cal_julian.zarr"]


@pytest.mark.parametrize("store", STORES)
def test_days_of_the_year_and_of_the_week_are_cftimes(ctx, fixtures, store):
    src = xr.open_zarr(fixtures / store, chunks=None)
    assert src.time.encoding["calendar"] not in ("standard", "gregorian", "proleptic_gregorian")
    ctx.register_zarr("t", fixtures / store)
    got = ctx.sql(
        "SELECT DISTINCT time, extract(doy FROM time) AS doy, date_part('dow', time) AS dow, "
        "extract(isodow FROM time) AS isodow FROM t ORDER BY time"
    ).to_arrow_table().to_pydict()
    assert len(got["time"]) == src.sizes["time"]
    weekday = src.time.dt.dayofweek.values  # Monday 0
    assert got["doy"] == src.time.dt.dayofyear.values.tolist()
    assert got["dow"] == ((weekday + 1) % 7).tolist()  # SQL: Sunday 0
    assert got["isodow"] == (weekday + 1).tolist()  # ISO: Monday 1


@pytest.mark.parametrize("dense", [True, False])
def test_a_daily_climatology_of_a_noleap_store_is_xarrays(fixtures, dense):
    # In a leap year of the Gregorian calendar the 1st of March of `noleap`
    # is day 60, not 61: a day-of-year climatology groups as xarray's.
    ctx = zf.SessionContext()
    ctx.sql(f"SET zarrfusion.dense_reduction = {str(dense).lower()}").collect()
    ctx.register_zarr("t", fixtures / "cal_noleap.zarr")
    sql = "SELECT extract(doy FROM time) AS dayofyear, lat, lon, avg(tas) AS tas FROM t GROUP BY 1, lat, lon"
    plan = " ".join(ctx.sql(f"EXPLAIN {sql}").to_arrow_table()["plan"].to_pylist())
    assert ("DenseReductionExec" in plan) == dense
    got = ctx.sql(sql).to_xarray(dims=["dayofyear", "lat", "lon"])
    src = xr.open_zarr(fixtures / "cal_noleap.zarr", chunks=None).load()
    want = src.tas.groupby("time.dayofyear").mean()
    assert got.sizes["dayofyear"] == want.sizes["dayofyear"] == 365
    got = got.tas.transpose(*want.dims).sortby(["dayofyear", "lat", "lon"])
    want = want.sortby(["dayofyear", "lat", "lon"])
    np.testing.assert_array_equal(got.dayofyear.values, want.dayofyear.values)
    np.testing.assert_allclose(got.values, want.values, rtol=1e-6, equal_nan=True)


@pytest.mark.parametrize("dense", [True, False])
def test_pentads_of_a_noleap_store_are_xarrays(fixtures, dense):
    # Bins of five model days (xarray's resample(time="5D") on cftime dates):
    # 73 of them in a noleap year, the 28th of February and the 1st of March
    # one day apart.
    ctx = zf.SessionContext()
    ctx.sql(f"SET zarrfusion.dense_reduction = {str(dense).lower()}").collect()
    ctx.register_zarr("t", fixtures / "cal_noleap.zarr")
    sql = (
        "SELECT date_bin(INTERVAL '5 days', time, TIMESTAMP '2000-01-01') AS time, lat, lon, avg(tas) AS tas "
        "FROM t GROUP BY 1, lat, lon"
    )
    plan = " ".join(ctx.sql(f"EXPLAIN {sql}").to_arrow_table()["plan"].to_pylist())
    assert ("DenseReductionExec" in plan) == dense
    got = ctx.sql(sql).to_xarray()
    src = xr.open_zarr(fixtures / "cal_noleap.zarr", chunks=None).load()
    want = src.tas.resample(time="5D").mean()
    assert got.sizes["time"] == want.sizes["time"] == 73
    assert list(got.time.values) == list(want.time.values)
    got = got.tas.transpose(*want.dims).sortby(["lat", "lon"])
    np.testing.assert_allclose(got.values, want.sortby(["lat", "lon"]).values, rtol=1e-6, equal_nan=True)

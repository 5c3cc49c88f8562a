"""to_xarray rebuilds the dataset xarray reads from the same store."""

from __future__ import annotations

import pytest
import xarray as xr


@pytest.mark.parametrize(
    "store", ["v2_basic.zarr", "v3_basic.zarr", "desc_lat.zarr", "cal_noleap.zarr", "cal_360_day.zarr", "cal_julian.zarr"]
)
def test_select_star_round_trips(ctx, fixtures, store):
    # Model calendars' dates come back as the cftime dates xarray decodes.
    ctx.register_zarr("t", fixtures / store)
    got = ctx.sql("SELECT * FROM t").to_xarray()
    want = xr.open_zarr(fixtures / store, chunks=None).load()
    xr.testing.assert_equal(got, want)
    for name in want.variables:
        assert got[name].attrs == want[name].attrs, name


def test_window_store_round_trips_with_attributes(ctx, window_store):
    ctx.register_zarr("w", window_store)
    got = ctx.table("w").to_xarray()
    want = xr.open_zarr(window_store, chunks=None).load()
    xr.testing.assert_equal(got, want)
    assert got.a.attrs == {"units": "K", "long_name": "variable a"}


def test_reduction_result_is_a_grid(ctx, fixtures):
    ctx.register_zarr("t", fixtures / "v3_basic.zarr")
    got = ctx.sql("SELECT lat, lon, avg(t2m) AS t2m FROM t GROUP BY lat, lon").to_xarray()
    want = xr.open_zarr(fixtures / "v3_basic.zarr", chunks=None).t2m.mean("time").load()
    xr.testing.assert_allclose(got.t2m.sortby(["lat", "lon"]), want.sortby(["lat", "lon"]), rtol=1e-6)


def test_not_a_grid_is_a_clear_error(ctx, fixtures):
    ctx.register_zarr("t", fixtures / "v3_basic.zarr")
    with pytest.raises(ValueError, match="not a grid"):
        ctx.sql("SELECT lat, lon, t2m FROM t").to_xarray()
    with pytest.raises(ValueError, match="no dimension|none of"):
        ctx.sql("SELECT t2m FROM t").to_xarray()
    with pytest.raises(ValueError, match="dims"):
        ctx.sql("SELECT lat FROM t").to_xarray(dims=["nope"])


@pytest.mark.parametrize("order", ["lat DESC, lon", "lon DESC, lat", "lat, lon DESC"])
def test_any_row_order_gives_the_same_grid(ctx, fixtures, order):
    # desc_lat's latitude descends: "lat DESC, lon" is the grid's C order
    # (reshaped as it is), the others are scattered into place.
    ctx.register_zarr("t", fixtures / "desc_lat.zarr")
    got = ctx.sql(f"SELECT lat, lon, v FROM t ORDER BY {order}").to_xarray()
    want = xr.open_zarr(fixtures / "desc_lat.zarr", chunks=None).load()
    xr.testing.assert_equal(got, want)
    assert got.v.values.flags.writeable


def test_a_repeated_combination_is_not_a_grid(ctx):
    # As many rows as cells, but (1, 1) twice and (1, 2) missing.
    rows = "VALUES (1.0, 1.0, 5.0), (1.0, 1.0, 6.0), (2.0, 1.0, 7.0), (2.0, 2.0, 8.0)"
    with pytest.raises(ValueError, match="exactly once"):
        ctx.sql(f"SELECT column1 AS y, column2 AS x, column3 AS v FROM ({rows})").to_xarray(dims=["y", "x"])

"""Dates of model calendars (noleap, 360_day, all_leap, julian) against
xarray's answers on the cftime dates it decodes them to: the days of the
year and of the week count the calendar's own days, in rows and in the
dense reduction's groups."""

from __future__ import annotations

from datetime import timedelta

import cftime
import numpy as np
import pytest
import xarray as xr

import zarrfusion as zf

STORES = ["cal_noleap.zarr", "cal_360_day.zarr", "cal_all_leap.zarr", "cal_julian.zarr"]


def _session(store, setting, on):
    """A session with `store` registered as t and `zarrfusion.<setting>`
    (a rule) on or off."""
    ctx = zf.SessionContext()
    ctx.sql(f"SET zarrfusion.{setting} = {str(on).lower()}").collect()
    ctx.register_zarr("t", store)
    return ctx


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
    ctx = _session(fixtures / "cal_noleap.zarr", "dense_reduction", dense)
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
    ctx = _session(fixtures / "cal_noleap.zarr", "dense_reduction", dense)
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


@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize("store", ["cal_noleap.zarr", "cal_all_leap.zarr", "cal_julian.zarr"])
def test_weeks_of_a_model_calendar_start_on_its_mondays(fixtures, store, dense):
    # date_trunc('week') over a model calendar's dates: the Monday counted
    # back over the calendar's own days (cftime's dayofweek), the weekly
    # means as xarray groups them by those Mondays.
    ctx = _session(fixtures / store, "dense_reduction", dense)
    sql = "SELECT date_trunc('week', time) AS week, lat, lon, avg(tas) AS tas FROM t GROUP BY 1, lat, lon"
    plan = " ".join(ctx.sql(f"EXPLAIN {sql}").to_arrow_table()["plan"].to_pylist())
    assert ("DenseReductionExec" in plan) == dense
    got = ctx.sql(f"{sql} ORDER BY week, lat, lon").to_arrow_table().to_pydict()
    src = xr.open_zarr(fixtures / store, chunks=None).load()
    mondays = [
        cftime.datetime(d.year, d.month, d.day, calendar=d.calendar) - timedelta(days=int(w))
        for d, w in zip(src.time.values, src.time.dt.dayofweek.values)  # Monday 0
    ]
    weeks = xr.DataArray([m.strftime("%Y-%m-%d") for m in mondays], dims="time", name="week")
    want = src.tas.groupby(weeks).mean().transpose("week", "lat", "lon").sortby(["lat", "lon"])
    got_weeks = sorted({w.strftime("%Y-%m-%d") for w in got["week"]})
    assert got_weeks == list(want.week.values)
    # Each row: its week, cell and mean against xarray's.
    assert all(w.hour == 0 and w.minute == 0 for w in got["week"])
    lats, lons = list(want.lat.values), list(want.lon.values)
    values = np.array(got["tas"], dtype=float).reshape(len(got_weeks), len(lats), len(lons))
    assert got["lat"][: len(lats) * len(lons) : len(lons)] == lats
    np.testing.assert_allclose(values, want.values, rtol=1e-6, equal_nan=True)


def _fields(t):
    return (t.year, t.month, t.day, t.hour, t.minute)


def _month_before(t):
    # A month back by the date's fields, the day clamped to the calendar's
    # last day of that month (its length from cftime: the next 1st minus this 1st).
    year, month = (t.year, t.month - 1) if t.month > 1 else (t.year - 1, 12)
    first = cftime.datetime(year, month, 1, calendar=t.calendar)
    following = cftime.datetime(year + month // 12, month % 12 + 1, 1, calendar=t.calendar)
    day = min(t.day, (following - first).days)
    return cftime.datetime(year, month, day, t.hour, t.minute, calendar=t.calendar)


@pytest.mark.parametrize("store", STORES)
def test_differences_and_steps_of_model_times_are_cftimes(ctx, fixtures, store):
    # `-` and `+` over a model calendar's times count its own days, as
    # cftime's arithmetic does: steps between times, times since the first
    # (a literal read as a date of the calendar), a time plus a day and six
    # hours, and minus a month.
    src = xr.open_zarr(fixtures / store, chunks=None)
    times = list(src.time.values)
    ctx.register_zarr("t", fixtures / store)
    first = times[0].strftime("%Y-%m-%d %H:%M:%S")
    got = ctx.sql(
        f"SELECT t, t - lag(t) OVER (ORDER BY t) AS step, t - TIMESTAMP '{first}' AS since, "
        "t + INTERVAL '1 day 6 hours' AS later, t - INTERVAL '1 month' AS month_before "
        "FROM (SELECT DISTINCT time AS t FROM t) ORDER BY t"
    ).to_arrow_table().to_pydict()
    assert [_fields(t) for t in got["t"]] == [_fields(t) for t in times]
    assert got["step"] == [None] + [b - a for a, b in zip(times, times[1:])]
    assert got["since"] == [t - times[0] for t in times]
    assert [_fields(t) for t in got["later"]] == [_fields(t + timedelta(days=1, hours=6)) for t in times]
    assert [_fields(t) for t in got["month_before"]] == [_fields(_month_before(t)) for t in times]
    # The results are times of the calendar again: their days of the year
    # are cftime's.
    doy = ctx.sql(
        "SELECT DISTINCT time, extract(doy FROM time + INTERVAL '1 day') AS doy FROM t ORDER BY time"
    ).to_arrow_table().to_pydict()["doy"]
    assert doy == [(t + timedelta(days=1)).dayofyr for t in times]


@pytest.mark.parametrize("dense", [True, False])
def test_a_daily_360_day_store_groups_by_the_dates_its_numbers_encode(fixtures, dense):
    # Its 30th of February has no timestamp, so the coordinate keeps its
    # numbers; extract and date_trunc still read the model's dates, as
    # xarray's groupby and resample do on the cftime dates it decodes.
    ctx = _session(fixtures / "cal_360_day_daily.zarr", "dense_reduction", dense)
    src = xr.open_zarr(fixtures / "cal_360_day_daily.zarr", chunks=None).load()
    units, calendar = src.time.encoding["units"], src.time.encoding["calendar"]
    assert calendar == "360_day" and (2, 30) in [(t.month, t.day) for t in src.time.values]
    for key, want in [
        ("extract(month FROM time)", src.tas.groupby("time.month").mean().rename(month="key")),
        ("extract(doy FROM time)", src.tas.groupby("time.dayofyear").mean().rename(dayofyear="key")),
        ("date_trunc('month', time)", src.tas.resample(time="MS").mean().rename(time="key")),
        # Weeks of the model's days from an origin before the store's
        # first day (the 29th of January starts the first) and from
        # 1970-01-01 of the calendar when none is given.
        (
            "date_bin(INTERVAL '7 days', time, TIMESTAMP '2000-01-01')",
            src.tas.resample(time="7D", origin=cftime.Datetime360Day(2000, 1, 1)).mean().rename(time="key"),
        ),
        (
            "date_bin(INTERVAL '7 days', time)",
            src.tas.resample(time="7D", origin=cftime.Datetime360Day(1970, 1, 1)).mean().rename(time="key"),
        ),
    ]:
        sql = f"SELECT {key} AS key, lat, lon, avg(tas) AS tas FROM t GROUP BY 1, lat, lon"
        plan = " ".join(ctx.sql(f"EXPLAIN {sql}").to_arrow_table()["plan"].to_pylist())
        assert ("DenseReductionExec" in plan) == dense, plan
        got = ctx.sql(f"{sql} ORDER BY key, lat, lon").to_arrow_table().to_pydict()
        want = want.transpose("key", "lat", "lon").sortby(["key", "lat", "lon"])
        keys = want.key.values
        if keys.dtype == object:  # cftime month starts: as numbers of the store's units
            keys = cftime.date2num(list(keys), units, calendar)
        assert sorted(set(got["key"])) == [float(k) for k in keys], key
        values = np.array(got["tas"], dtype=float).reshape(want.shape)
        np.testing.assert_allclose(values, want.values, rtol=1e-6, equal_nan=True)
    # Weeks start on the calendar's Mondays (cftime's dayofweek 0).
    got = ctx.sql("SELECT DISTINCT time, date_trunc('week', time) AS week FROM t ORDER BY time").to_arrow_table()
    mondays = [t - timedelta(days=int(w)) for t, w in zip(src.time.values, src.time.dt.dayofweek.values)]
    assert got["week"].to_pylist() == list(cftime.date2num(mondays, units, calendar).astype(float))


@pytest.mark.parametrize("dense", [True, False])
def test_bins_of_dates_kept_as_numbers_are_written_as_those_dates(fixtures, tmp_path, dense):
    # A daily 360_day store's pentads and month starts are numbers of its
    # units; COPY writes them with those units and the calendar, so that
    # xarray reads back the cftime dates of its own resample.
    ctx = _session(fixtures / "cal_360_day_daily.zarr", "dense_reduction", dense)
    src = xr.open_zarr(fixtures / "cal_360_day_daily.zarr", chunks=None).load()
    for key, want in [
        ("date_bin(INTERVAL '5 days', time, TIMESTAMP '2000-01-01')", src.tas.resample(time="5D").mean()),
        ("date_trunc('month', time)", src.tas.resample(time="MS").mean()),
    ]:
        out = tmp_path / f"bins_{len(key)}.zarr"
        ctx.sql(
            f"COPY (SELECT {key} AS start, lat, lon, avg(tas) AS tas FROM t GROUP BY 1, lat, lon) "
            f"TO '{out}' STORED AS ZARR OPTIONS ('dims' 'start,lat,lon')"
        ).collect()
        got = xr.open_zarr(out, chunks=None).load()
        assert got.start.encoding["calendar"] == "360_day", key
        assert list(got.start.values) == list(want.time.values), key
        np.testing.assert_allclose(
            got.tas.transpose("start", "lat", "lon").sortby(["lat", "lon"]).values,
            want.transpose("time", "lat", "lon").sortby(["lat", "lon"]).values,
            rtol=1e-6,
            equal_nan=True,
        )


@pytest.mark.parametrize("rolling", [True, False])
@pytest.mark.parametrize(
    "store, distance, days",
    [
        ("cal_noleap.zarr", "INTERVAL '1 day'", 1),
        ("cal_noleap.zarr", "INTERVAL '2 days 12 hours'", 2.5),
        ("cal_360_day.zarr", "INTERVAL '30 days'", 30),
        ("cal_julian.zarr", "INTERVAL '3 days'", 3),
        ("cal_all_leap.zarr", "INTERVAL '1 day'", 1),
        # Times kept as numbers (hours): distances in hours, a 360_day
        # month of 30 days, 36 hours holding the times one whole day back.
        ("cal_360_day_daily.zarr", "INTERVAL '2 days'", 2),
        ("cal_360_day_daily.zarr", "INTERVAL '1 month'", 30),
        ("cal_360_day_daily.zarr", "INTERVAL '36 hours'", 1.5),
    ],
)
def test_range_frames_over_model_times_count_the_calendars_days(fixtures, store, distance, days, rolling):
    # A RANGE frame of days over a model calendar's times holds the times
    # within that many of the calendar's days (cftime's differences): from
    # a noleap 1st of March, a day back is the 28th of February (two
    # Gregorian days); a 360_day month is 30 days. The oracle averages
    # each cell's values over the times s with 0 <= t - s <= the distance.
    ctx = _session(fixtures / store, "rolling_window", rolling)
    sql = (
        f"SELECT time, lat, lon, avg(tas) OVER (PARTITION BY lat, lon ORDER BY time "
        f"RANGE BETWEEN {distance} PRECEDING AND CURRENT ROW) AS m, "
        f"count(tas) OVER (PARTITION BY lat, lon ORDER BY time "
        f"RANGE BETWEEN {distance} PRECEDING AND CURRENT ROW) AS n FROM t"
    )
    plan = " ".join(ctx.sql(f"EXPLAIN {sql}").to_arrow_table()["plan"].to_pylist())
    assert ("RollingWindowExec" in plan) == rolling, plan
    got = ctx.sql(f"{sql} ORDER BY time, lat, lon").to_arrow_table().to_pydict()
    src = xr.open_zarr(fixtures / store, chunks=None).load().transpose("time", "lat", "lon").sortby(["lat", "lon"])
    times = list(src.time.values)
    values = src.tas.values.astype(float)
    want_m, want_n = [], []
    for i, t in enumerate(times):
        inside = [j for j, s in enumerate(times) if timedelta(0) <= t - s <= timedelta(days=days)]
        window = values[inside]
        n = (~np.isnan(window)).sum(axis=0)
        with np.errstate(invalid="ignore"):
            m = np.where(n > 0, np.nansum(window, axis=0) / np.maximum(n, 1), np.nan)
        want_m.extend(m.ravel().tolist())
        want_n.extend(n.ravel().tolist())
    assert got["n"] == want_n
    got_m = np.array([np.nan if v is None else v for v in got["m"]], dtype=float)
    np.testing.assert_allclose(got_m, want_m, rtol=1e-6, equal_nan=True)


@pytest.mark.parametrize("dense", [True, False])
def test_dates_select_times_kept_as_numbers_as_xarray_sel_does(fixtures, dense):
    # A daily 360_day store's times are filtered by its dates (the 30th of
    # February too), as xarray's sel on its cftime index; the filter is one
    # on the dimension, pruned in the scan.
    ctx = _session(fixtures / "cal_360_day_daily.zarr", "dense_reduction", dense)
    src = xr.open_zarr(fixtures / "cal_360_day_daily.zarr", chunks=None).load()
    day = cftime.Datetime360Day
    for where, want in [
        ("time BETWEEN '2000-02-10' AND '2000-02-30'", src.sel(time=slice(day(2000, 2, 10), day(2000, 2, 30)))),
        ("time >= TIMESTAMP '2000-03-05 00:00:00'", src.sel(time=slice(day(2000, 3, 5), None))),
        ("time < '2000-02-30'", src.where(src.time < day(2000, 2, 30), drop=True)),
        ("time IN ('2000-02-29', '2000-02-30')", src.sel(time=[day(2000, 2, 29), day(2000, 2, 30)])),
    ]:
        sql = f"SELECT lat, lon, avg(tas) AS tas, count(*) AS n FROM t WHERE {where} GROUP BY lat, lon"
        plan = " ".join(ctx.sql(f"EXPLAIN {sql}").to_arrow_table()["plan"].to_pylist())
        assert "FilterExec" not in plan, plan
        got = ctx.sql(f"{sql} ORDER BY lat, lon").to_arrow_table().to_pydict()
        want = want.tas.transpose("time", "lat", "lon").sortby(["lat", "lon"])
        assert got["n"] == [want.sizes["time"]] * 4, where
        np.testing.assert_allclose(got["tas"], want.mean("time").values.ravel(), rtol=1e-6)


def _months_from(origin, months, t):
    """The start of the bin of `months` months from `origin` holding `t`:
    the latest of origin + k * months months (the day kept, or the month's
    last day of the calendar) not after t, found by walking k."""
    starts = []
    for k in range(-400, 400):
        total = origin.year * 12 + origin.month - 1 + k * months
        year, month = divmod(total, 12)
        first = cftime.datetime(year, month + 1, 1, calendar=t.calendar)
        following = cftime.datetime(year + (month + 1) // 12, (month + 1) % 12 + 1, 1, calendar=t.calendar)
        day = min(origin.day, (following - first).days)
        starts.append(cftime.datetime(year, month + 1, day, origin.hour, calendar=t.calendar))
    return max(s for s in starts if s <= t)


@pytest.mark.parametrize("dense", [True, False])
def test_dates_kept_as_numbers_bin_by_months_and_step_as_cftime_does(fixtures, dense):
    # A daily 360_day store keeps its times as numbers; date_bin by months
    # counts their dates' months (seasons from December as xarray's
    # resample QS-DEC; months from the 16th against a walk over cftime
    # month steps), and + and - step over the calendar as cftime's
    # arithmetic, giving numbers of the same units, or durations.
    ctx = _session(fixtures / "cal_360_day_daily.zarr", "dense_reduction", dense)
    src = xr.open_zarr(fixtures / "cal_360_day_daily.zarr", chunks=None).load()
    units, calendar = src.time.encoding["units"], src.time.encoding["calendar"]
    times = list(src.time.values)
    day = cftime.Datetime360Day
    seasons = src.tas.resample(time="QS-DEC").mean()
    for key, want_keys, want in [
        (
            "date_bin(INTERVAL '3 months', time, TIMESTAMP '1999-12-01')",
            list(seasons.time.values),
            seasons.rename(time="key"),
        ),
        (
            "date_bin(INTERVAL '1 month', time, TIMESTAMP '2000-01-16 12:00:00')",
            None,
            src.tas.groupby(
                xr.DataArray(
                    cftime.date2num([_months_from(day(2000, 1, 16, 12), 1, t) for t in times], units, calendar),
                    dims="time",
                    name="key",
                )
            ).mean(),
        ),
    ]:
        sql = f"SELECT {key} AS key, lat, lon, avg(tas) AS tas FROM t GROUP BY 1, lat, lon"
        plan = " ".join(ctx.sql(f"EXPLAIN {sql}").to_arrow_table()["plan"].to_pylist())
        assert ("DenseReductionExec" in plan) == dense, plan
        got = ctx.sql(f"{sql} ORDER BY key, lat, lon").to_arrow_table().to_pydict()
        want = want.transpose("key", "lat", "lon").sortby(["key", "lat", "lon"])
        keys = want_keys if want_keys is not None else list(want.key.values)
        if want_keys is not None:
            keys = cftime.date2num(keys, units, calendar)
        assert sorted(set(got["key"])) == [float(k) for k in keys], key
        values = np.array(got["tas"], dtype=float).reshape(want.shape)
        np.testing.assert_allclose(values, want.values, rtol=1e-6, equal_nan=True)

    got = ctx.sql(
        "SELECT t, t + INTERVAL '1 day 6 hours' AS later, t - INTERVAL '1 month' AS month_before, "
        "t - lag(t) OVER (ORDER BY t) AS step, t - '2000-02-28' AS since, "
        "extract(day FROM t + INTERVAL '1 day') AS next_day "
        "FROM (SELECT DISTINCT time AS t FROM t) ORDER BY t"
    ).to_arrow_table().to_pydict()
    encode = lambda ts: list(cftime.date2num(ts, units, calendar).astype(float))  # noqa: E731
    assert got["t"] == encode(times)
    assert got["later"] == encode([t + timedelta(days=1, hours=6) for t in times])
    assert got["month_before"] == encode([_month_before(t) for t in times])
    assert got["step"] == [None] + [b - a for a, b in zip(times, times[1:])]
    assert got["since"] == [t - day(2000, 2, 28) for t in times]
    assert got["next_day"] == [(t + timedelta(days=1)).day for t in times]


@pytest.mark.parametrize("store", STORES)
def test_bins_of_months_start_on_the_calendars_days(ctx, fixtures, store):
    # date_bin by months over a model calendar's times starts its bins on
    # the origin's day of the calendar's months, or its last day of a
    # shorter one (a noleap February ends on the 28th, an all_leap one on
    # the 29th), as a walk over cftime month steps finds them. A 360_day
    # store's times are timestamps only while none is a 29th or 30th of
    # February: bins from the 30th start there, an error naming the date.
    src = xr.open_zarr(fixtures / store, chunks=None)
    times = list(src.time.values)
    ctx.register_zarr("t", fixtures / store)
    day = 16 if store == "cal_360_day.zarr" else 30
    origin = cftime.datetime(2000, 1, day, 6, calendar=times[0].calendar)
    for months in [1, 2]:
        got = ctx.sql(
            f"SELECT DISTINCT time, date_bin(INTERVAL '{months} months', time, "
            f"TIMESTAMP '2000-01-{day} 06:00:00') AS m FROM t ORDER BY time"
        ).to_arrow_table().to_pydict()
        assert [_fields(t) for t in got["time"]] == [_fields(t) for t in times]
        want = [_fields(_months_from(origin, months, t)) for t in times]
        assert [_fields(m) for m in got["m"]] == want, (store, months)
    if store == "cal_360_day.zarr":
        with pytest.raises(zf.ZarrFusionError, match="has no bin of 1 months from 2000-01-30 with a timestamp"):
            ctx.sql("SELECT date_bin(INTERVAL '1 month', time, TIMESTAMP '2000-01-30') FROM t").collect()

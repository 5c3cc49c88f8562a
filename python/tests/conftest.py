"""Shared fixtures of the Python tests: the committed zarr-python stores
under tests/fixtures/data, and small stores written here by xarray."""

from __future__ import annotations

import _thread
import faulthandler
import os
import pathlib
import signal
import threading

import numpy as np
import pytest

FIXTURES = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "data"


@pytest.fixture(autouse=True, scope="session")
def index_cache_dir(tmp_path_factory) -> pathlib.Path:
    """Keeps the window-index cache of the test run out of the user's home."""
    path = tmp_path_factory.mktemp("zarrfusion-cache")
    os.environ["ZARRFUSION_CACHE_DIR"] = str(path)
    return path


#: Seconds one test may take before the run is stopped with every thread's
#: stack (``ZARRFUSION_TEST_TIMEOUT`` changes it; 0 turns it off). A test
#: parked in the engine does not run Python's signal handlers, so the
#: watchdog is faulthandler's thread, which ends the process: a hang fails
#: the run in minutes, naming the test in the dumped stacks, instead of
#: running into CI's limit.
TEST_TIMEOUT_S = float(os.environ.get("ZARRFUSION_TEST_TIMEOUT", "300"))


@pytest.fixture(scope="session")
def real_stderr(request):
    """The terminal's standard error, which pytest's capture replaces
    while tests run (the watchdog's dump must reach the log)."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    if capture is None:
        fd = os.dup(2)
    else:
        with capture.global_and_fixture_disabled():
            fd = os.dup(2)
    with os.fdopen(fd, "w") as stream:
        yield stream


@pytest.fixture
def ctrl_c():
    """Presses Ctrl-C during the test, as a user at a terminal would:
    ``ctrl_c(0.5)`` interrupts the main thread half a second later. For the
    test, SIGINT raises ``KeyboardInterrupt`` whatever the process inherited:
    a process started in the background by a non-interactive shell ignores
    SIGINT, and then ``interrupt_main`` does nothing (the test would wait for
    a query that never ends)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timers = []

    def press(after: float) -> None:
        timer = threading.Timer(after, _thread.interrupt_main)
        timers.append(timer)
        timer.start()

    try:
        yield press
    finally:
        for timer in timers:
            timer.cancel()
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(autouse=True)
def time_limit(real_stderr):
    """Stops the whole run if this test takes over ``TEST_TIMEOUT_S``."""
    if TEST_TIMEOUT_S <= 0:
        yield
        return
    faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True, file=real_stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def fixtures() -> pathlib.Path:
    return FIXTURES


@pytest.fixture
def long_store(tmp_path):
    """Writes, with xarray, v(time, x 64) of random normals (seed 3) with
    time in one chunk and x in chunks of 16 (blocks of whole x lines span
    every time step): ``long_store(rows)`` returns the store's path and
    the values."""
    import xarray as xr

    def write(rows: int) -> tuple[pathlib.Path, np.ndarray]:
        values = np.random.default_rng(3).standard_normal((rows, 64))
        store = tmp_path / "long.zarr"
        xr.Dataset(
            {"v": (("time", "x"), values)}, coords={"time": np.arange(float(rows)), "x": np.arange(64) * 0.5}
        ).to_zarr(store, encoding={"v": {"chunks": (rows, 16)}})
        return store, values

    return write


@pytest.fixture
def hourly_store(tmp_path):
    """Writes, with xarray, t2m(time 96 hours, lat 24 descending, lon 8) of
    random normals (seed 7) with 5 % NaN holes, in chunks of (24, 4, 8), to
    ``hours.zarr``: returns its path and ``assert_diurnal(store)``, which
    checks that ``store`` holds xarray's diurnal cycle of it
    (``groupby("time.hour")``: ``t2m`` the mean, ``s`` the std with ddof=0)
    over ``hour, lat, lon``, latitudes descending as in the source."""
    import pandas as pd
    import xarray as xr

    rng = np.random.default_rng(7)
    t2m = rng.normal(280, 5, (96, 24, 8)).astype("float32")
    t2m[rng.random(t2m.shape) < 0.05] = np.nan
    coords = {
        "time": pd.date_range("2020-01-01", periods=96, freq="h"),
        "lat": np.arange(23, -1, -1) * 2.0 - 20,
        "lon": np.arange(8) * 5.0,
    }
    src = xr.Dataset({"t2m": (("time", "lat", "lon"), t2m)}, coords=coords)
    path = tmp_path / "hours.zarr"
    src.to_zarr(path, encoding={"t2m": {"chunks": (24, 4, 8)}})

    def assert_diurnal(store: pathlib.Path) -> None:
        got = xr.open_zarr(store, chunks=None).load()
        hours = src.t2m.groupby("time.hour")
        for name, want in [("t2m", hours.mean()), ("s", hours.std(ddof=0))]:
            have = got[name].transpose(*want.dims)
            for d in want.dims:
                np.testing.assert_array_equal(have[d].values, want[d].values)
            np.testing.assert_allclose(have.values, want.values, rtol=1e-6)
        assert list(got.lat.values) == list(coords["lat"])

    return path, assert_diurnal


@pytest.fixture
def ctx():
    import zarrfusion as zf

    return zf.SessionContext()


@pytest.fixture(scope="session")
def window_store(tmp_path_factory) -> pathlib.Path:
    """A (time=7, lat=19, lon=23) store with two float32 variables, missing
    values in both, and chunks (2, 6, 8) so windows cross chunk edges."""
    import pandas as pd
    import xarray as xr

    rng = np.random.default_rng(12)
    shape = (7, 19, 23)
    a = rng.normal(size=shape).astype("float32")
    b = rng.normal(size=shape).astype("float32")
    a[rng.random(shape) < 0.01] = np.nan
    b[rng.random(shape) < 0.01] = np.nan
    a[:, 2:4, 17:20] = np.nan  # a hole every time step
    b[5] = np.nan  # a time step without any valid window
    ds = xr.Dataset(
        {"a": (("time", "lat", "lon"), a), "b": (("time", "lat", "lon"), b)},
        coords={
            "time": pd.date_range("2020-01-01", periods=7, freq="6h"),
            "lat": np.linspace(45.0, -45.0, 19).astype("float32"),
            "lon": np.arange(23, dtype="float64") * 1.5,
        },
        attrs={"title": "window test"},
    )
    ds.a.attrs.update(units="K", long_name="variable a")
    path = tmp_path_factory.mktemp("stores") / "windows.zarr"
    ds.to_zarr(path, encoding={v: {"chunks": (2, 6, 8)} for v in ("a", "b")}, zarr_format=3)
    return path


@pytest.fixture(scope="session")
def forecast_store(tmp_path_factory) -> pathlib.Path:
    """A (time=40 every 6 h, lat=21, lon=26) store for samples of inputs
    and targets: t2m and u10 (float32) and precip (float64), missing values
    scattered in each plus a hole in t2m at time 9, chunks (8, 8, 8) so
    history, lead times and windows cross chunk edges."""
    import pandas as pd
    import xarray as xr

    rng = np.random.default_rng(24)
    shape = (40, 21, 26)
    t2m = (280 + 10 * rng.normal(size=shape)).astype("float32")
    u10 = rng.normal(size=shape).astype("float32")
    precip = rng.gamma(0.5, 2.0, size=shape)
    for v, share in ((t2m, 0.002), (u10, 0.004), (precip, 0.003)):
        v[rng.random(shape) < share] = np.nan
    t2m[9, 5:9, 10:14] = np.nan
    ds = xr.Dataset(
        {"t2m": (("time", "lat", "lon"), t2m), "u10": (("time", "lat", "lon"), u10),
         "precip": (("time", "lat", "lon"), precip)},
        coords={
            "time": pd.date_range("2021-03-01", periods=40, freq="6h"),
            "lat": np.linspace(50.0, 30.0, 21).astype("float32"),
            "lon": np.arange(26, dtype="float64") * 0.25,
        },
    )
    path = tmp_path_factory.mktemp("stores") / "forecast.zarr"
    ds.to_zarr(path, encoding={v: {"chunks": (8, 8, 8)} for v in ds.data_vars}, zarr_format=3)
    return path


@pytest.fixture(scope="session")
def two_sources(tmp_path_factory) -> dict:
    """Two stores on one grid, written by xarray: ``era5`` every 6 h with
    t2m (time, lat, lon), z (time, level=3, lat, lon) and a static lsm
    (lat, lon); ``imerg`` every 3 h with precip (time, lat, lon) on a
    larger grid around era5's (two more rows on each side), chunked
    differently. Returns their paths and the numpy values."""
    import pandas as pd
    import xarray as xr

    rng = np.random.default_rng(31)
    nt, ny, nx = 24, 21, 26
    lat = np.linspace(50.0, 30.0, ny)
    lon = np.arange(nx) * 0.25
    t2m = (280 + 8 * rng.normal(size=(nt, ny, nx))).astype("float32")
    z = (np.array([5000.0, 15000.0, 50000.0])[None, :, None, None] + 100 * rng.normal(size=(nt, 3, ny, nx))).astype("float32")
    lsm = rng.random((ny, nx)).astype("float32")
    t2m[rng.random(t2m.shape) < 0.002] = np.nan
    z[rng.random(z.shape) < 0.001] = np.nan
    era5 = xr.Dataset(
        {"t2m": (("time", "lat", "lon"), t2m), "z": (("time", "level", "lat", "lon"), z), "lsm": (("lat", "lon"), lsm)},
        coords={"time": pd.date_range("2022-01-01", periods=nt, freq="6h"), "level": [1000, 850, 500],
                "lat": lat, "lon": lon},
    )
    big_lat = np.linspace(50.0 + 2 * 1.0, 30.0 - 2 * 1.0, ny + 4)  # the same 1-degree rows, two more each side
    precip = rng.gamma(0.4, 2.0, size=(2 * nt, ny + 4, nx)).astype("float32")
    precip[rng.random(precip.shape) < 0.003] = np.nan
    imerg = xr.Dataset(
        {"precip": (("time", "lat", "lon"), precip)},
        coords={"time": pd.date_range("2022-01-01", periods=2 * nt, freq="3h"), "lat": big_lat, "lon": lon},
    )
    root = tmp_path_factory.mktemp("sources")
    era5.to_zarr(root / "era5.zarr", encoding={"t2m": {"chunks": (5, 8, 8)}, "z": {"chunks": (4, 2, 9, 9)}}, zarr_format=3)
    imerg.to_zarr(root / "imerg.zarr", encoding={"precip": {"chunks": (7, 10, 13)}}, zarr_format=3)
    # A source on another grid, and one every 4 hours, for the errors.
    imerg.assign_coords(lat=big_lat + 0.5).to_zarr(root / "shifted.zarr", zarr_format=3)
    imerg.isel(time=slice(0, 36)).assign_coords(
        time=pd.date_range("2022-01-01", periods=36, freq="4h")
    ).to_zarr(root / "four_hourly.zarr", zarr_format=3)
    return {
        "era5": root / "era5.zarr", "imerg": root / "imerg.zarr", "shifted": root / "shifted.zarr",
        "four_hourly": root / "four_hourly.zarr",
        "t2m": t2m, "z": z, "lsm": lsm, "precip": precip,
    }


@pytest.fixture
def trillion_store(tmp_path) -> pathlib.Path:
    """A v3 store whose one array ``t`` runs along ``x``: 10^12 positions,
    no coordinate array, nothing written (every chunk the fill value)."""
    import json

    path = tmp_path / "long.zarr"
    (path / "t").mkdir(parents=True)
    (path / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    (path / "t" / "zarr.json").write_text(json.dumps({
        "zarr_format": 3, "node_type": "array", "shape": [10**12], "data_type": "float32",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [10**6]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0.0, "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        "dimension_names": ["x"], "attributes": {},
    }))
    return path

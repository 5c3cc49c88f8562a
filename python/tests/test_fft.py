"""DataFrame.fft / DataFrame.ifft against xrft's outputs (the expected stores
under tests/fixtures/fft, written by make_fft_fixtures.py with xrft), the
round trip without storing the spectrum, and the spectrum through Zarr as
xarray reads it (complex)."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import xarray as xr

import zarrfusion as zf

FFT = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "fft"


def transform_in_child(tmp_path: pathlib.Path, allowed_mem: str, store: pathlib.Path, call: str) -> dict:
    """Runs `ctx.table("t").<call>` over `store` under `allowed_mem` in a
    fresh process and writes it to `tmp_path / "spec.zarr"`; returns its
    EXPLAIN text (`plan`), the rows written (`rows`) and how many bytes its
    peak resident memory grew by while writing (`grown`, see peak_memory)."""
    from peak_memory import run_child

    script = f"""
import io
import zarrfusion as zf
ctx = zf.SessionContext(allowed_mem={allowed_mem!r}, work_dir={str(tmp_path / "work")!r})
ctx.register_zarr("t", {str(store)!r})
spec = ctx.table("t").{call}
plan = io.StringIO()
spec.explain(file=plan)
before = reset_peak()
rows = spec.to_zarr({str(tmp_path / "spec.zarr")!r})
print(json.dumps({{"plan": plan.getvalue(), "rows": rows, "grown": status("VmHWM") - before}}))
"""
    return run_child(script)


def expected(name: str) -> xr.DataArray:
    ds = xr.open_zarr(FFT / "expected" / f"{name}.zarr", consolidated=False).load()
    return ds.re + 1j * ds.im


def close(got: xr.DataArray, want: xr.DataArray, rtol: float) -> None:
    # Both in increasing coordinates (xrft leaves unshifted frequencies in
    # numpy's order; to_xarray sorts).
    want = want.sortby(list(want.dims))
    got = got.transpose(*want.dims).sortby(list(want.dims))
    for d in want.dims:
        np.testing.assert_allclose(got[d].values.astype(float), want[d].values.astype(float), rtol=1e-9)
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got.values, want.values, rtol=0, atol=rtol * scale)


@pytest.fixture
def grid(ctx):
    ctx.register_zarr("grid", FFT / "data" / "grid.zarr")
    return ctx


@pytest.mark.parametrize(
    "name, variable, kwargs, rtol",
    [
        ("lat_f64", "z", {"dims": ["lat"]}, 1e-9),
        ("lat_f32", "t2m", {"dims": "lat"}, 1e-4),
        ("lat_lon", "z", {"dims": ["lat", "lon"]}, 1e-9),
        ("real_lon", "z", {"dims": ["lat", "lon"], "real_dim": "lon"}, 1e-9),
        ("window_hann", "z", {"dims": ["lat", "lon"], "window": "hann"}, 1e-9),
        ("detrend_linear_1d", "z", {"dims": "lon", "detrend": "linear"}, 1e-9),
        ("lon_numpy", "z", {"dims": "lon", "true_phase": False, "true_amplitude": False}, 1e-9),
    ],
)
def test_fft_matches_xrft(grid, name, variable, kwargs, rtol):
    ds = grid.table("grid").fft(variable, **kwargs).to_xarray()
    got = ds[variable]
    assert np.iscomplexobj(got.values)
    assert got.dtype == (np.complex64 if variable == "t2m" else np.complex128)
    close(got, expected(name), rtol)


def test_ifft_of_a_real_signal_matches_xrft(ctx):
    ctx.register_zarr("s", FFT / "data" / "spectrum_like.zarr")
    got = ctx.table("s").ifft("s", dims=["freq_x"], lag=45).to_xarray()["s"]
    close(got, expected("ifft_lag"), 1e-9)


def test_fft_then_ifft_returns_the_input_without_storing_the_spectrum(grid):
    spec = grid.table("grid").fft("z", dims=["lat", "lon"])
    assert "freq_lat" in spec.columns and "freq_lon" in spec.columns
    back = spec.ifft("z", dims=["freq_lat", "freq_lon"]).to_xarray()["z"].sortby("lat")
    original = xr.open_zarr(FFT / "data" / "grid.zarr", consolidated=False).z.load().sortby("lat")
    np.testing.assert_allclose(back.lat.values, original.lat.values, atol=1e-9)
    np.testing.assert_allclose(back.lon.values, original.lon.values, atol=1e-9)
    np.testing.assert_allclose(back.values.real, original.values, atol=1e-9 * float(np.abs(original).max()))
    np.testing.assert_allclose(back.values.imag, 0, atol=1e-9 * float(np.abs(original).max()))


def test_the_seed_demo_chains_through_a_view_in_sql(grid):
    # xrft.idft(xrft.dft(t2m, dim='lat', ...), dim='freq_lat', ..., lag=45):
    # the spectrum is a view, read by ifft in SQL and on a DataFrame.
    grid.sql(
        "CREATE VIEW spectrum AS SELECT * FROM fft('grid', 't2m', dims => 'lat', "
        "true_phase => true, true_amplitude => true)"
    )
    want = expected("chain_seed_demo")
    got = grid.sql(
        "SELECT * FROM ifft('spectrum', 't2m', dims => 'freq_lat', true_phase => true, "
        "true_amplitude => true, lag => 45)"
    ).to_xarray()["t2m"]
    close(got, want, 1e-4)
    back = grid.table("spectrum").ifft("t2m", dims="freq_lat", true_phase=True, true_amplitude=True, lag=45)
    close(back.to_xarray()["t2m"], want, 1e-4)


def test_a_spectrum_written_to_zarr_reads_back_as_complex_in_xarray(grid, tmp_path):
    target = tmp_path / "spec.zarr"
    grid.table("grid").fft("t2m", dims="lat").to_zarr(target)
    ds = xr.open_zarr(target)
    assert ds.t2m.dtype == np.complex64
    assert ds.freq_lat.attrs["direct_lag"] == 0.0
    assert ds.freq_lat.attrs["spacing"] == pytest.approx(1 / (9 * 20.0))
    close(ds.t2m.load(), expected("lat_f32"), 1e-4)


def test_bad_fft_calls_name_the_problem(grid):
    with pytest.raises(Exception, match="unknown window 'kaiser'"):
        grid.table("grid").fft("z", dims="lat", window="kaiser")
    with pytest.raises(Exception, match="unknown dimension 'height'"):
        grid.table("grid").fft("z", dims="height")
    with pytest.raises(Exception, match="applies to a Zarr table or to an fft/ifft result"):
        grid.table("grid").filter("lat > 0").fft("z", dims="lon")


def test_the_device_argument_chooses_where_transforms_run():
    ctx = zf.SessionContext(device="cpu")
    ctx.register_zarr("grid", FFT / "data" / "grid.zarr")
    assert ctx.table("grid").fft("z", dims="lat").count() == 4 * 9 * 12
    ctx = zf.SessionContext(device="cuda")
    ctx.register_zarr("grid", FFT / "data" / "grid.zarr")
    with pytest.raises(Exception, match="no GPU is usable"):
        ctx.table("grid").fft("z", dims="lat").count()


def test_a_block_of_whole_lines_larger_than_the_budget_is_rechunked_first(tmp_path, long_store):
    """(time 6000, x 64) with time in one chunk: a block of whole x lines in
    the store's chunks takes ~15 MB; under a budget leaving 4 MB beside the
    kernel's threads, the variable is copied into smaller time chunks in
    work_dir first, and the answer is numpy's."""
    import io
    import os

    store, values = long_store(6000)
    kernel = (os.cpu_count() or 1) * 3 * 16384 * 16
    work = tmp_path / "work"
    ctx = zf.SessionContext(allowed_mem=kernel + (4 << 20), work_dir=work)
    ctx.register_zarr("long", store)
    spec = ctx.table("long").fft("v", dims="x", true_phase=False, true_amplitude=False, shift=False)
    plan = io.StringIO()
    spec.explain(file=plan)
    assert "rechunked to [" in plan.getvalue(), plan.getvalue()
    got = spec.to_xarray()["v"].transpose("time", "freq_x").values
    want = np.fft.fft(values, axis=1)
    # to_xarray sorts the frequencies; numpy's are in fftfreq order.
    order = np.argsort(np.fft.fftfreq(64, 0.5))
    np.testing.assert_allclose(got, want[:, order], atol=1e-9 * np.abs(want).max())
    # COPY of the transform takes the same path, block by block.
    spec.to_zarr(tmp_path / "spec.zarr")
    stored = xr.open_zarr(tmp_path / "spec.zarr").v.transpose("time", "freq_x").values
    np.testing.assert_allclose(stored, want, atol=1e-9 * np.abs(want).max())
    assert not list(work.rglob("*rechunked-fft*"))


def test_a_line_larger_than_the_budget_takes_the_four_step_path_and_matches_numpy(tmp_path):
    """A 1-D complex64 signal of 2^26 values (512 MB) written by zarr-python,
    transformed under allowed_mem 256 MB: no line fits, so the planner
    chooses the four-step path (EXPLAIN says so), the spectrum is written to
    Zarr block by block with the peak memory of the process growing by less
    than the budget, and every chunk of it matches numpy.fft.fft."""
    import zarr

    n, chunk = 1 << 26, 1 << 20
    rng = np.random.default_rng(26)
    signal = zarr.create_array(
        tmp_path / "long.zarr",
        name="s",
        shape=(n,),
        chunks=(chunk,),
        dtype="complex64",
        dimension_names=["t"],
        fill_value=0,
    )
    # Small integers, which zstd stores in a fraction of their 512 MB: the
    # test's disk footprint (input, spectrum, scratch) stays near 1.2 GB.
    for start in range(0, n, 8 * chunk):
        size = 8 * chunk
        part = rng.integers(-8, 8, size).astype(np.float32) + 1j * rng.integers(-8, 8, size).astype(np.float32)
        signal[start : start + size] = part.astype(np.complex64)

    # In a fresh process, so its peak resident memory is the transform's.
    call = 'fft("s", dims="t", true_phase=False, true_amplitude=False, shift=False)'
    report = transform_in_child(tmp_path, "256MB", tmp_path / "long.zarr", call)
    assert "strategy=four-step" in report["plan"], report["plan"]
    assert report["rows"] == n
    assert report["grown"] < 256e6, f"peak memory grew by {report['grown'] / 2**20:.0f} MiB"

    want = np.fft.fft(signal[:])
    stored = zarr.open_group(tmp_path / "spec.zarr", mode="r")
    got = stored["s"]
    assert got.dtype == np.complex64 and got.shape == (n,)
    np.testing.assert_allclose(stored["freq_t"][: 1 << 16], np.fft.fftfreq(n)[: 1 << 16], rtol=1e-12)
    np.testing.assert_allclose(stored["freq_t"][-(1 << 16) :], np.fft.fftfreq(n)[-(1 << 16) :], rtol=1e-12)
    # float32 input: rustfft and numpy round differently; the error of an FFT
    # of length n grows like log2(n) * eps32 * the largest magnitude.
    atol = 1e-5 * np.abs(want).max()
    for start in range(0, n, 8 * chunk):
        np.testing.assert_allclose(got[start : start + 8 * chunk], want[start : start + 8 * chunk], rtol=0, atol=atol)
    # The scratch arrays of the four steps are gone once the query ends.
    assert not list((tmp_path / "work").rglob("*four-step*"))


def test_a_chain_larger_than_the_budget_stores_the_inner_transform_first(tmp_path):
    """fft then ifft of a 1-D complex64 signal of 2^24 values (128 MB),
    written by zarr-python, chained on DataFrames under allowed_mem 96 MB:
    the inverse cannot read the forward transform block by block, so the
    forward one is stored in work_dir first (EXPLAIN says so), both by the
    four-step path; the process's peak memory grows by less than the budget,
    the result is the input, and work_dir is emptied. (At 64 MB the growth
    was 45 to 55 MiB, once 75: the runtime's own ~20 MB, thread stacks,
    FFT plans and allocator arenas, is a third of so small a budget.)"""
    import zarr

    n, chunk = 1 << 24, 1 << 16
    rng = np.random.default_rng(24)
    signal = zarr.create_array(
        tmp_path / "long.zarr", name="s", shape=(n,), chunks=(chunk,), dtype="complex64",
        dimension_names=["t"], fill_value=0,
    )
    for start in range(0, n, 64 * chunk):
        size = 64 * chunk
        part = rng.integers(-8, 8, size).astype(np.float32) + 1j * rng.integers(-8, 8, size).astype(np.float32)
        signal[start : start + size] = part.astype(np.complex64)
    plain = "true_phase=False, true_amplitude=False"
    call = f'fft("s", dims="t", {plain}).ifft("s", dims="freq_t", {plain})'
    report = transform_in_child(tmp_path, "96MB", tmp_path / "long.zarr", call)
    assert "strategy=chained: fft along [t] by four-step" in report["plan"], report["plan"]
    assert report["plan"].count("four-step in") == 2, report["plan"]
    assert report["rows"] == n
    assert report["grown"] < 96e6, f"peak memory grew by {report['grown'] / 2**20:.0f} MiB"
    back = zarr.open_group(tmp_path / "spec.zarr", mode="r")
    np.testing.assert_allclose(back["t"][: 1 << 10], np.arange(1 << 10), atol=1e-9)
    got, want = back["s"], signal
    for start in range(0, n, 64 * chunk):
        np.testing.assert_allclose(got[start : start + 64 * chunk], want[start : start + 64 * chunk], rtol=0, atol=1e-4)
    assert not list((tmp_path / "work").rglob("*.zarr"))


def test_a_plane_larger_than_the_budget_is_transformed_one_dimension_at_a_time(tmp_path):
    """A 2-D FFT of 2048 × 2048 planes (float32, written by zarr-python in
    256 × 256 chunks) under allowed_mem 96 MB: a block whole along both
    dimensions (a plane read and transformed) does not fit, so the planner
    stages the transform (EXPLAIN says so): along lat into work_dir, then
    along lon from there, with the process's peak memory growing by less
    than the budget; the stored spectrum matches numpy.fft.fft2."""
    import zarr

    shape, chunks = (3, 2048, 2048), (1, 256, 256)
    rng = np.random.default_rng(2)
    values = rng.standard_normal(shape, dtype=np.float32)
    z = zarr.create_array(
        tmp_path / "planes.zarr",
        name="v",
        shape=shape,
        chunks=chunks,
        dtype="float32",
        dimension_names=["time", "lat", "lon"],
        fill_value=0,
    )
    z[:] = values
    call = 'fft("v", dims=["lat", "lon"], true_phase=False, true_amplitude=False, shift=False)'
    report = transform_in_child(tmp_path, "96MB", tmp_path / "planes.zarr", call)
    assert "strategy=staged: along [lat]" in report["plan"], report["plan"]
    assert report["rows"] == values.size
    assert report["grown"] < 96e6, f"peak memory grew by {report['grown'] / 2**20:.0f} MiB"

    stored = zarr.open_group(tmp_path / "spec.zarr", mode="r")
    got = stored["v"][:]
    want = np.fft.fft2(values.astype(np.float64), axes=(1, 2))
    assert got.dtype == np.complex64 and got.shape == shape
    np.testing.assert_allclose(stored["freq_lat"][:], np.fft.fftfreq(2048), rtol=1e-12)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    # The first stage's store is gone once the query ends.
    assert not list((tmp_path / "work").rglob("*staged*"))

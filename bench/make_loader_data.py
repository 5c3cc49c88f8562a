#!/usr/bin/env python3
"""Write the ML data-loader benchmark stores (issue 3; synthetic, deterministic) under bench/data/.

    .venv/bin/python bench/make_loader_data.py [--nt 168] [--small-nt 42] [--force] [--no-small]

bench/data/era5_loader.zarr
    ERA5-like, laid out like ARCO-ERA5: Zarr v2, consolidated metadata (.zmetadata),
    written by xarray ``to_zarr``, one time step per chunk (time-chunked).
      time  hourly from 2020-01-01T00, CF-encoded int64 "hours since 1900-01-01"
      lat   721 values, 90 .. -90 (descending, step 0.25), float32
      lon   1440 values, 0 .. 359.75 (step 0.25), float32
      t2m   (time, lat, lon) float32, chunks (1, 721, 1440), blosc lz4 + shuffle, no NaN
      u10   (time, lat, lon) float32, same chunks/codec, NaN on the fixed mask (below)
      v10   (time, lat, lon) float32, same chunks/codec, NaN on the fixed mask (below)
    168 time steps (7 days) by default: 3 * 168 * 721 * 1440 * 4 B = 2.093 GB uncompressed.

    The NaN mask ("ice/lake mask") is the same for every time step and for u10 and v10:
    every cell south of -82 deg (lat <= -82.0, 33 rows: an ice cap) plus 24 rectangular
    "lakes" of 6..15 x 10..30 cells at seeded random places between 70N and 60S; about
    5 % of the cells. t2m has no missing values. So with valid="all" (no NaN in any
    variable) a window is dropped iff it touches the mask.

bench/data/era5_loader_small.zarr
    The same, with --small-nt time steps (default 42 = 1/4): used to show that a loader's
    peak RSS does not grow with the size of the dataset. Its data equals the first
    --small-nt time steps of the big store.

The fields are smooth plausible values (t2m as in make_era5.py; u10/v10 a zonal jet
pattern plus moving waves) plus Gaussian noise, built and written one 24-hour slab at a
time (never the whole array in memory). Existing stores are kept unless --force.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time as _time
import warnings
from pathlib import Path

import numcodecs
import numpy as np
import pandas as pd
import xarray as xr

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
BIG = DATA / "era5_loader.zarr"
SMALL = DATA / "era5_loader_small.zarr"

NLAT, NLON = 721, 1440
T0 = "2020-01-01T00:00:00"
TIME_ENCODING = {"units": "hours since 1900-01-01", "calendar": "proleptic_gregorian", "dtype": "int64"}
VARS = ("t2m", "u10", "v10")
ATTRS = {
    "t2m": {"units": "K", "long_name": "2 metre temperature"},
    "u10": {"units": "m s**-1", "long_name": "10 metre U wind component"},
    "v10": {"units": "m s**-1", "long_name": "10 metre V wind component"},
}

warnings.filterwarnings("ignore")


def grid(nt: int):
    time = pd.date_range(T0, periods=nt, freq="h")
    lat = np.linspace(90.0, -90.0, NLAT).astype("float32")  # 90, 89.75, ..., -90 (exact in float32)
    lon = (np.arange(NLON) * 0.25).astype("float32")  # 0 .. 359.75
    assert lat[0] == 90 and lat[-1] == -90 and lat[688] == -82
    return time, lat, lon


def nan_mask(lat: np.ndarray, seed: int = 2024) -> np.ndarray:
    """(lat, lon) bool, True where u10/v10 are missing. Same for every time step."""
    m = np.zeros((NLAT, NLON), dtype=bool)
    m[lat <= -82.0, :] = True  # ice cap: 33 rows
    r = np.random.default_rng(seed)
    i_lo, i_hi = int(np.argmin(np.abs(lat - 70))), int(np.argmin(np.abs(lat + 60)))
    for _ in range(24):
        h, w = int(r.integers(6, 16)), int(r.integers(10, 31))
        i = int(r.integers(i_lo, i_hi - h))
        j = int(r.integers(0, NLON - w))
        m[i:i + h, j:j + w] = True
    return m


class Fields:
    """t2m/u10/v10 at one hour; deterministic given the seed and the hour sequence."""

    def __init__(self, lat, lon, seed=1979):
        self.rng = np.random.default_rng(seed)
        phi = np.deg2rad(lat.astype("float64"))[:, None]
        lam = np.deg2rad(lon.astype("float64"))[None, :]
        self.phi, self.lam, self.lon = phi, lam, lon.astype("float64")[None, :]
        f = np.zeros((lat.size, lon.size))
        r = np.random.default_rng(seed + 1)
        for _ in range(8):
            k, m = r.integers(1, 6), r.integers(1, 6)
            f += r.uniform(0.3, 1.0) * np.sin(k * lam + r.uniform(0, 2 * np.pi)) * np.cos(m * phi + r.uniform(0, 2 * np.pi))
        land = f / np.abs(f).max() > 0.3
        land[lat <= -65, :] = True
        s = np.sin(phi)
        self.base = 299.0 - 45.0 * s**2 - 12.0 * np.clip(s, 0, None) - np.where(land, 4.0, 0.0) * np.abs(s)
        self.diurnal_amp = np.where(land, 4.0, 0.5)
        self.cosphi = np.cos(phi)
        # zonal wind: easterly trades, westerly jets near +-45 deg, weaker over land
        self.u_base = (-6.0 * np.exp(-((np.rad2deg(phi) / 15.0) ** 2))
                       + 9.0 * np.exp(-(((np.abs(np.rad2deg(phi)) - 45.0) / 12.0) ** 2))) * np.where(land, 0.6, 1.0)
        self.mask = nan_mask(lat)

    def step(self, h: float) -> dict[str, np.ndarray]:
        phi, lam = self.phi, self.lam
        wave = np.sin(3 * lam - 2 * np.pi * h / 144.0 + 2 * phi) * self.cosphi
        wave2 = np.cos(5 * lam - 2 * np.pi * h / 90.0 - phi) * self.cosphi**2
        local_hour = (h + self.lon / 15.0) % 24.0
        diurnal = np.cos(2 * np.pi * (local_hour - 14.0) / 24.0) * self.diurnal_amp
        t = self.base + 3.0 * wave + 1.5 * wave2 + diurnal + self.rng.normal(0.0, 0.4, wave.shape)
        u = self.u_base + 4.0 * wave2 + self.rng.normal(0.0, 1.0, wave.shape)
        v = 5.0 * np.cos(3 * lam - 2 * np.pi * h / 144.0 + 2 * phi) * self.cosphi + self.rng.normal(0.0, 1.0, wave.shape)
        u[self.mask] = np.nan
        v[self.mask] = np.nan
        return {"t2m": t.astype("float32"), "u10": u.astype("float32"), "v10": v.astype("float32")}


def make_store(path: Path, nt: int, block: int = 24) -> None:
    time, lat, lon = grid(nt)
    fields = Fields(lat, lon)
    comp = (numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE),)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    t_start = _time.time()
    for i0 in range(0, nt, block):
        i1 = min(nt, i0 + block)
        hours = ((time[i0:i1] - time[0]) / pd.Timedelta("1h")).to_numpy()
        data = {v: np.empty((i1 - i0, NLAT, NLON), dtype="float32") for v in VARS}
        for k, h in enumerate(hours):
            for v, a in fields.step(float(h)).items():
                data[v][k] = a
        ds = xr.Dataset(
            {v: (("time", "lat", "lon"), data[v], ATTRS[v]) for v in VARS},
            coords={
                "time": ("time", time[i0:i1].values, {"long_name": "time"}),
                "lat": ("lat", lat, {"units": "degrees_north", "long_name": "latitude"}),
                "lon": ("lon", lon, {"units": "degrees_east", "long_name": "longitude"}),
            },
            attrs={"source": "synthetic ERA5-like loader benchmark data from bench/make_loader_data.py (not real ERA5)"},
        )
        if i0 == 0:
            ds["time"].encoding = dict(TIME_ENCODING)
            enc = {v: {"chunks": (1, NLAT, NLON), "compressors": comp, "_FillValue": np.float32("nan")} for v in VARS}
            enc["lat"] = {"_FillValue": None}
            enc["lon"] = {"_FillValue": None}
            ds.to_zarr(tmp, zarr_format=2, consolidated=True, mode="w", encoding=enc)
        else:
            ds.to_zarr(tmp, zarr_format=2, consolidated=True, mode="a", append_dim="time")
        del data, ds
        print(f"  {path.name}: wrote time steps {i0}..{i1 - 1} of {nt} ({_time.time() - t_start:.1f} s)", flush=True)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def du(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def describe(path: Path) -> None:
    ds = xr.open_zarr(path, chunks=None)
    raw = sum(ds[v].size * 4 for v in VARS)
    n, b = du(path)
    m = np.isnan(ds["u10"].isel(time=0).values)
    print(f"{path.name}: {', '.join(f'{v}{tuple(ds[v].shape)}' for v in VARS)} float32, chunks "
          f"{ds['t2m'].encoding.get('chunks')} = {raw / 1e9:.3f} GB uncompressed; {n} files, {b / 1e9:.3f} GB on disk; "
          f"time {ds.time.values[0]} .. {ds.time.values[-1]}; NaN mask {m.mean() * 100:.2f} % of cells in u10/v10", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nt", type=int, default=168, help="hourly time steps in era5_loader.zarr (default 168: 2.09 GB raw)")
    ap.add_argument("--small-nt", type=int, default=42, help="time steps in era5_loader_small.zarr (default 42 = 1/4)")
    ap.add_argument("--no-small", action="store_true", help="do not write era5_loader_small.zarr")
    ap.add_argument("--force", action="store_true", help="rewrite stores that already exist")
    args = ap.parse_args()
    DATA.mkdir(parents=True, exist_ok=True)
    todo = [(BIG, args.nt)] + ([] if args.no_small else [(SMALL, args.small_nt)])
    for path, nt in todo:
        if args.force or not (path / ".zmetadata").exists():
            print(f"writing {path} ({nt} time steps)", flush=True)
            make_store(path, nt)
        else:
            print(f"kept {path} (use --force to rewrite)")
    for path, _ in todo:
        describe(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

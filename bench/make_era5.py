#!/usr/bin/env python3
"""Write the benchmark stores (synthetic, deterministic) under bench/data/.

    .venv/bin/python bench/make_era5.py [--nt 264] [--force]

bench/data/era5_1gb.zarr
    ERA5-like, laid out like ARCO-ERA5: Zarr v2, consolidated metadata (.zmetadata),
    written by xarray ``to_zarr``; one chunk per hour.
      time  hourly from 2020-01-01T00, CF-encoded int64 "hours since 1900-01-01"
      lat   721 values, 90 .. -90 (descending, step 0.25), float32
      lon   1440 values, 0 .. 359.75 (step 0.25), float32
      t2m   (time, lat, lon) float32, chunks (1, 721, 1440), blosc lz4 + shuffle
    264 time steps by default: 264 * 721 * 1440 * 4 B = 1.096 GB (1.02 GiB) uncompressed.
    The field is a smooth plausible 2 m temperature (latitude profile, land/sea
    contrast, moving synoptic waves, diurnal cycle) plus Gaussian noise, built one
    time step at a time (never the whole array in memory).

bench/data/million_chunks.zarr
    Zarr v3 with consolidated metadata, written with zarr-python directly:
      time  (1_000_000,) int64 "hours since 1900-01-01", ONE chunk, fully written
      t2m   (time, y, x) = (1_000_000, 4, 4) float32, chunks (1, 4, 4): a grid of
            1_000_000 chunks of which only 18 are written (three small regions);
            the rest read as the fill value (NaN).
    y and x have no coordinate arrays (integer index dimensions).

Both stores are deleted and rewritten when --force is given, else kept if present.
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
import zarr

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
ERA5 = DATA / "era5_1gb.zarr"
MILLION = DATA / "million_chunks.zarr"

NLAT, NLON = 721, 1440
T0 = "2020-01-01T00:00:00"
TIME_ENCODING = {"units": "hours since 1900-01-01", "calendar": "proleptic_gregorian", "dtype": "int64"}

warnings.filterwarnings("ignore")


def grid(nt: int):
    time = pd.date_range(T0, periods=nt, freq="h")
    lat = np.linspace(90.0, -90.0, NLAT).astype("float32")  # 90, 89.75, ..., -90 (exact in float32)
    lon = (np.arange(NLON) * 0.25).astype("float32")  # 0 .. 359.75
    assert lat[0] == 90 and lat[-1] == -90 and lat[240] == 30 and lat[120] == 60
    return time, lat, lon


class Field:
    """t2m(hour) on the 0.25 degree grid; deterministic given the seed."""

    def __init__(self, lat, lon, seed=1979):
        self.rng = np.random.default_rng(seed)
        phi = np.deg2rad(lat.astype("float64"))[:, None]
        lam = np.deg2rad(lon.astype("float64"))[None, :]
        self.phi, self.lam, self.lon = phi, lam, lon.astype("float64")[None, :]
        # land mask from a few low-wavenumber waves, Antarctica south of -65
        f = np.zeros((lat.size, lon.size))
        r = np.random.default_rng(seed + 1)
        for _ in range(8):
            k, m = r.integers(1, 6), r.integers(1, 6)
            f += r.uniform(0.3, 1.0) * np.sin(k * lam + r.uniform(0, 2 * np.pi)) * np.cos(m * phi + r.uniform(0, 2 * np.pi))
        land = f / np.abs(f).max() > 0.3
        land[lat <= -65, :] = True
        self.land = land
        s = np.sin(phi)
        # boreal winter: NH colder; land colder at high latitudes
        self.base = 299.0 - 45.0 * s**2 - 12.0 * np.clip(s, 0, None) - np.where(land, 4.0, 0.0) * np.abs(s)
        self.diurnal_amp = np.where(land, 4.0, 0.5)
        self.cosphi = np.cos(phi)

    def step(self, h: float) -> np.ndarray:
        phi, lam = self.phi, self.lam
        wave = np.sin(3 * lam - 2 * np.pi * h / 144.0 + 2 * phi) * self.cosphi
        wave2 = np.cos(5 * lam - 2 * np.pi * h / 90.0 - phi) * self.cosphi**2
        local_hour = (h + self.lon / 15.0) % 24.0
        diurnal = np.cos(2 * np.pi * (local_hour - 14.0) / 24.0) * self.diurnal_amp
        t = self.base + 3.0 * wave + 1.5 * wave2 + diurnal
        t += self.rng.normal(0.0, 0.4, t.shape)
        return t.astype("float32")


def make_era5(nt: int, block: int = 24, path: Path = ERA5) -> None:
    """Writes the store to ``path`` (bench_s3.py --make-store writes smaller ones elsewhere)."""
    time, lat, lon = grid(nt)
    field = Field(lat, lon)
    comp = (numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE),)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    t_start = _time.time()
    for i0 in range(0, nt, block):
        i1 = min(nt, i0 + block)
        hours = ((time[i0:i1] - time[0]) / pd.Timedelta("1h")).to_numpy()
        data = np.empty((i1 - i0, NLAT, NLON), dtype="float32")
        for k, h in enumerate(hours):
            data[k] = field.step(float(h))
        ds = xr.Dataset(
            {"t2m": (("time", "lat", "lon"), data, {"units": "K", "long_name": "2 metre temperature"})},
            coords={
                "time": ("time", time[i0:i1].values, {"long_name": "time"}),
                "lat": ("lat", lat, {"units": "degrees_north", "long_name": "latitude"}),
                "lon": ("lon", lon, {"units": "degrees_east", "long_name": "longitude"}),
            },
            attrs={"source": "synthetic ERA5-like benchmark data from bench/make_era5.py (not real ERA5)"},
        )
        if i0 == 0:
            ds["time"].encoding = dict(TIME_ENCODING)
            enc = {
                "t2m": {"chunks": (1, NLAT, NLON), "compressors": comp},
                "lat": {"_FillValue": None},
                "lon": {"_FillValue": None},
            }
            ds.to_zarr(tmp, zarr_format=2, consolidated=True, mode="w", encoding=enc)
        else:
            ds.to_zarr(tmp, zarr_format=2, consolidated=True, mode="a", append_dim="time")
        print(f"  era5: wrote time steps {i0}..{i1 - 1} of {nt} ({_time.time() - t_start:.1f} s)", flush=True)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def make_million(n: int = 1_000_000) -> None:
    tmp = MILLION.with_name(MILLION.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    g = zarr.open_group(str(tmp), mode="w", zarr_format=3)
    g.attrs["source"] = "bench/make_era5.py: a chunk grid of 1e6 chunks, only a few written"
    zstd = zarr.codecs.ZstdCodec(level=3)
    t = g.create_array(
        "time", shape=(n,), chunks=(n,), dtype="int64", fill_value=0, compressors=(zstd,),
        dimension_names=["time"],
        attributes={"units": "hours since 1900-01-01", "calendar": "proleptic_gregorian", "long_name": "time"},
    )
    start = int((pd.Timestamp(T0) - pd.Timestamp("1900-01-01")) / pd.Timedelta("1h"))
    t[:] = start + np.arange(n, dtype="int64")
    v = g.create_array(
        "t2m", shape=(n, 4, 4), chunks=(1, 4, 4), dtype="float32", fill_value=float("nan"),
        compressors=(zstd,), dimension_names=["time", "y", "x"],
        attributes={"units": "K", "long_name": "2 metre temperature"},
    )
    rng = np.random.default_rng(7)
    for lo, hi in ((0, 10), (500_000, 500_005), (n - 3, n)):
        v[lo:hi] = (280.0 + rng.normal(0, 5, (hi - lo, 4, 4))).astype("float32")
    zarr.consolidate_metadata(str(tmp))
    shutil.rmtree(MILLION, ignore_errors=True)
    tmp.rename(MILLION)


def du(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nt", type=int, default=264, help="hourly time steps in era5_1gb.zarr (>= 256)")
    ap.add_argument("--force", action="store_true", help="rewrite stores that already exist")
    args = ap.parse_args()
    DATA.mkdir(parents=True, exist_ok=True)
    if args.force or not (ERA5 / ".zmetadata").exists():
        print(f"writing {ERA5}", flush=True)
        make_era5(args.nt)
    else:
        print(f"kept {ERA5} (use --force to rewrite)")
    if args.force or not (MILLION / "zarr.json").exists():
        print(f"writing {MILLION}", flush=True)
        make_million()
    else:
        print(f"kept {MILLION} (use --force to rewrite)")

    ds = xr.open_zarr(ERA5, chunks=None)
    raw = ds.t2m.size * 4
    n, b = du(ERA5)
    print(f"{ERA5.name}: t2m{tuple(ds.t2m.shape)} float32 = {raw / 1e9:.3f} GB uncompressed; "
          f"{n} files, {b / 1e9:.3f} GB on disk; time {ds.time.values[0]} .. {ds.time.values[-1]}")
    m = xr.open_zarr(MILLION, chunks=None)
    n, b = du(MILLION)
    print(f"{MILLION.name}: t2m{tuple(m.t2m.shape)} chunks {m.t2m.encoding.get('chunks')}; {n} files, {b / 1e6:.2f} MB on disk")
    return 0


if __name__ == "__main__":
    sys.exit(main())

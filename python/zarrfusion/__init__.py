"""zarrfusion: SQL, array operations and ML window loading over Zarr stores.

A thin Python layer over the Rust engine (``zarrfusion._zarrfusion``)::

    import zarrfusion as zf

    ctx = zf.SessionContext(allowed_mem="4GB")
    ctx.register_zarr("era5", "era5.zarr")
    df = ctx.sql("SELECT lat, avg(t2m) AS t FROM era5 GROUP BY lat")
    df.to_pandas()

    ds = ctx.open_zarr("era5.zarr", variables=["t2m"])
    windows = ds.windows(input_dims={"lat": 5, "lon": 5}, input_overlap={"lat": 4, "lon": 4})
    for batch in windows.loader(batch_size=256, shuffle="block", seed=0):
        batch["t2m"]  # numpy array (256, 5, 5)
"""

from ._zarrfusion import __version__, network_stats
from .context import SessionContext
from .dataframe import DataFrame
from .errors import ZarrDataError, ZarrFusionError, ZarrMemoryError, ZarrPermissionError
from .loader import Dataset, WindowLoader, Windows

__all__ = [
    "DataFrame",
    "Dataset",
    "SessionContext",
    "WindowLoader",
    "Windows",
    "ZarrDataError",
    "ZarrFusionError",
    "ZarrMemoryError",
    "ZarrPermissionError",
    "__version__",
    "network_stats",
]

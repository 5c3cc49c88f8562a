"""Rebuilding gridded xarray datasets from tabular results."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Mapping, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow
    import xarray

# Attributes xarray consumes when decoding (they live in `.encoding`, not `.attrs`).
_ENCODING_ATTRS = {"_FillValue", "missing_value", "scale_factor", "add_offset", "_ARRAY_DIMENSIONS", "dtype"}
_TIME_ENCODING_ATTRS = {"units", "calendar"}


def _attrs(name: str, columns: Mapping[str, tuple], is_time: bool) -> dict:
    if name not in columns:
        return {}
    attrs = json.loads(columns[name][1])
    drop = _ENCODING_ATTRS | (_TIME_ENCODING_ATTRS if is_time else set())
    return {k: v for k, v in attrs.items() if k not in drop}


def _model_dates(values, calendar: str):
    """Timestamps standing for the dates of a model calendar (their fields)
    as the cftime dates xarray decodes such a calendar's times to."""
    import cftime
    import numpy as np
    import pandas as pd

    return np.array(
        [
            cftime.datetime(t.year, t.month, t.day, t.hour, t.minute, t.second, t.microsecond, calendar=calendar)
            for t in pd.DatetimeIndex(values)
        ],
        dtype=object,
    )


def table_to_xarray(
    table: "pyarrow.Table",
    columns: Mapping[str, tuple],
    dims: Sequence[str] | None = None,
) -> "xarray.Dataset":
    """The grid an Arrow table holds, as an ``xarray.Dataset``.

    ``columns`` maps the names of registered Zarr dimensions and variables to
    ``(is_dimension, attributes as JSON, coordinate descends)``; columns whose
    Arrow field metadata marks them as dimensions (``zarr.dimension``, as
    ``fft`` results do) are dimensions too, with the attributes in
    ``zarr.attributes``. Coordinates come out sorted, descending where the
    coordinate descends. Complex columns (``{re, im}`` structs) become
    complex arrays. Times of a model calendar (``zarr.calendar`` in their
    field metadata: ``noleap``, ``360_day``, ...) become its cftime dates, as
    ``xarray.open_zarr`` decodes them.
    """
    import numpy as np
    import pandas as pd
    import pyarrow as pa
    import xarray as xr

    columns = dict(columns)
    for field in table.schema:
        meta = field.metadata or {}
        if b"zarr.dimension" in meta and field.name not in columns:
            attrs = meta.get(b"zarr.attributes", b"{}").decode()
            columns[field.name] = (True, attrs, meta[b"zarr.dimension"] == b"descending")
    complex_columns = {}
    for field in table.schema:
        t = field.type
        if pa.types.is_struct(t) and [t.field(i).name for i in range(t.num_fields)] == ["re", "im"]:
            column = table.column(field.name)
            re = column.combine_chunks().field("re").to_numpy(zero_copy_only=False)
            im = column.combine_chunks().field("im").to_numpy(zero_copy_only=False)
            complex_columns[field.name] = re + 1j * im if re.dtype == np.float64 else (re + 1j * im).astype(np.complex64)
    if complex_columns:
        table = table.drop_columns(list(complex_columns))
    names = table.column_names
    if dims is None:
        dims = [n for n in names if columns.get(n, (False, "", False))[0]]
        if not dims:
            raise ValueError(
                "to_xarray: none of the result's columns "
                f"({', '.join(names)}) is a dimension of a registered Zarr table; pass dims=[...]"
            )
    else:
        dims = [dims] if isinstance(dims, str) else list(dims)
        for d in dims:
            if d not in names:
                raise ValueError(f"dims: '{d}' is not a column of the result ({', '.join(names)})")
    frame = table.to_pandas()
    codes = []
    coords = {}
    for d in dims:
        column = frame[d]
        if column.isna().any():
            raise ValueError(f"to_xarray: dimension column '{d}' has NULLs, so the result is not a grid")
        code, uniques = pd.factorize(column, sort=True)
        uniques = np.asarray(uniques)
        if columns.get(d, (False, "", False))[2]:  # the store's coordinate descends
            code = len(uniques) - 1 - code
            uniques = uniques[::-1]
        codes.append(code)
        coords[d] = uniques
    calendars = {f.name: (f.metadata or {}).get(b"zarr.calendar", b"").decode() for f in table.schema}
    times = {d for d in dims if np.issubdtype(coords[d].dtype, np.datetime64)}
    for d in times:
        if calendars.get(d):
            coords[d] = _model_dates(coords[d], calendars[d])
    sizes = tuple(len(coords[d]) for d in dims)
    cells = int(np.prod(sizes, dtype=np.int64))
    flat = np.ravel_multi_index(codes, sizes) if len(frame) else np.zeros(0, dtype=np.int64)
    # As many rows as cells, each cell hit: every combination exactly once.
    if len(frame) == cells:
        hit = np.zeros(cells, dtype=bool)
        hit[flat] = True
    if len(frame) != cells or not hit.all():
        raise ValueError(
            f"to_xarray: the result is not a grid over ({', '.join(dims)}): "
            f"{len(frame)} rows for {cells} combinations of {len(sizes)} dimensions of sizes {sizes}; "
            "every combination of dimension values must appear exactly once"
        )
    # Rows already in C order of the grid (a dense reduction's result, an
    # ORDER BY of the dimensions) are reshaped as they are.
    in_order = bool((flat == np.arange(cells)).all())
    data_vars = {}
    for name in names + list(complex_columns):
        if name in dims:
            continue
        values = complex_columns[name] if name in complex_columns else frame[name].to_numpy()
        if in_order:
            out = values if values.flags.writeable else values.copy()
        else:
            out = np.empty(cells, dtype=values.dtype)
            out[flat] = values
        is_time = np.issubdtype(values.dtype, np.datetime64)
        data_vars[name] = (dims, out.reshape(sizes), _attrs(name, columns, is_time))
    coord_vars = {
        d: (d, coords[d], _attrs(d, columns, d in times)) for d in dims
    }
    return xr.Dataset(data_vars, coords=coord_vars)

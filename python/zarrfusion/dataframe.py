"""Lazy queries: build with SQL-text expressions, run into Arrow, pandas or xarray.

Every method that runs the query releases the GIL while it runs and can be
interrupted with Ctrl-C (the query is cancelled and ``KeyboardInterrupt``
raised). A ``DataFrame`` is an Arrow stream producer (``__arrow_c_stream__``),
so ``pyarrow.table(df)``, ``polars.from_arrow(df)`` and DuckDB read it
without a copy.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Mapping, Sequence, TextIO

if TYPE_CHECKING:  # pragma: no cover
    import pandas
    import pyarrow
    import xarray

    from .context import SessionContext


class DataFrame:
    """A query over registered tables, planned but not run."""

    def __init__(self, raw: Any, ctx: "SessionContext") -> None:
        self._raw = raw
        self._ctx = ctx

    def _wrap(self, raw: Any) -> "DataFrame":
        return DataFrame(raw, self._ctx)

    # Building --------------------------------------------------------------
    def select(self, *exprs: str) -> "DataFrame":
        """Keeps SQL expressions: ``df.select("lat", "t2m - 273.15 AS t")``."""
        return self._wrap(self._raw.select(*exprs))

    def filter(self, predicate: str) -> "DataFrame":
        """Keeps the rows where a SQL condition holds."""
        return self._wrap(self._raw.filter(predicate))

    def aggregate(self, group_by: Sequence[str], aggs: Sequence[str]) -> "DataFrame":
        """Groups by expressions and aggregates: ``df.aggregate(["lat"], ["avg(t2m) AS t"])``."""
        if isinstance(group_by, str):
            group_by = [group_by]
        if isinstance(aggs, str):
            aggs = [aggs]
        return self._wrap(self._raw.aggregate(list(group_by), list(aggs)))

    def sort(self, *exprs: str) -> "DataFrame":
        """Sorts: ``df.sort("lat DESC", "lon")`` (``NULLS FIRST``/``LAST`` allowed)."""
        return self._wrap(self._raw.sort(*exprs))

    def limit(self, count: int, offset: int = 0) -> "DataFrame":
        """At most ``count`` rows after skipping ``offset`` (each from 0 to
        2^63 - 1, DataFusion's bound; ``ValueError`` past it)."""
        return self._wrap(self._raw.limit(count, offset))

    def rechunk(self, chunks: Mapping[str, int]) -> "DataFrame":
        """The same rows, read in new chunks: ``df.rechunk({"time": 240,
        "lat": 16, "lon": 16})`` (SQL ``rechunk('table', time => 240, ...)``).

        Applies to a Zarr table and row-wise operations on it (``select``,
        ``filter``, ``limit``). When the frame runs, the store is copied into
        the new chunks inside the session's ``allowed_mem`` (through
        intermediate arrays in ``work_dir`` when one pass does not fit; a
        rechunk that cannot fit is refused before it starts), then read;
        the copy is removed when the frame's results are done. To keep the
        rechunked store, use ``ctx.rechunk(source, target, chunks)``.
        """
        return self._wrap(self._raw.rechunk({str(d): int(n) for d, n in chunks.items()}))

    def fft(
        self,
        variable: str | None = None,
        *,
        dims: str | Sequence[str],
        real_dim: str | None = None,
        shift: bool = True,
        detrend: str | None = None,
        window: str | None = None,
        true_phase: bool = True,
        true_amplitude: bool = True,
        spacing_tol: float = 1e-3,
        prefix: str = "freq_",
    ) -> "DataFrame":
        """The FFT of ``variable`` along ``dims``, as ``xrft.fft`` computes it
        (SQL ``fft('table', 'variable', dims => 'lat', ...)``): one row per
        output cell, the transformed dimensions renamed ``freq_<dim>`` with
        xrft's frequencies, the values complex (``{"re", "im"}`` structs;
        ``to_xarray()`` gives a complex array).

        Applies to a Zarr table or to another transform's output. Options are
        xrft's: ``real_dim`` (real transform along that dimension), ``shift``,
        ``detrend`` (``"constant"``, ``"linear"``), ``window`` (``"hann"``,
        ``"hamming"``, ``"blackman"``, ``"tukey"``, ...), ``true_phase``,
        ``true_amplitude``, ``spacing_tol``, ``prefix``. Runs block by block
        inside the session's ``allowed_mem``; a line larger than the budget
        takes the four-step path through ``work_dir`` (one dimension, no
        ``detrend``; ``config={"zarrfusion.fft_strategy": ...}`` chooses).
        """
        options = _fft_options(
            dims=dims, real_dim=real_dim, shift=shift, detrend=detrend, window=window,
            true_phase=true_phase, true_amplitude=true_amplitude,
            spacing_tol=spacing_tol, prefix=prefix,
        )
        return self._wrap(self._raw.fft(variable, False, options))

    def ifft(
        self,
        variable: str | None = None,
        *,
        dims: str | Sequence[str],
        real_dim: str | None = None,
        shift: bool = True,
        true_phase: bool = True,
        true_amplitude: bool = True,
        lag: float | Sequence[float] | None = None,
        spacing_tol: float = 1e-3,
        prefix: str = "freq_",
    ) -> "DataFrame":
        """The inverse FFT of ``variable`` along the frequency dimensions
        ``dims``, as ``xrft.ifft`` computes it (SQL ``ifft(...)``): the
        ``freq_`` prefix is removed from the dimensions' names, positions are
        offset by ``lag`` (one per dimension; default each coordinate's
        ``direct_lag``, which ``fft`` sets, else 0).

        ``spec = df.fft("t2m", dims=["lat"]); back = spec.ifft("t2m",
        dims=["freq_lat"], lag=45)`` runs both transforms block by block
        without storing the spectrum.
        """
        options = _fft_options(
            dims=dims, real_dim=real_dim, shift=shift, true_phase=true_phase,
            true_amplitude=true_amplitude, lag=lag, spacing_tol=spacing_tol, prefix=prefix,
        )
        return self._wrap(self._raw.fft(variable, True, options))

    # Looking ---------------------------------------------------------------
    @property
    def columns(self) -> list[str]:
        """Column names."""
        return self._raw.columns

    def schema(self) -> "pyarrow.Schema":
        """The result's Arrow schema."""
        import pyarrow as pa

        return pa.schema(self._raw)

    def explain(self, verbose: bool = False, analyze: bool = False, file: TextIO | None = None) -> None:
        """Prints the plan; ``analyze=True`` runs the query and adds its metrics."""
        print(self._raw._explain(verbose, analyze), file=file or sys.stdout)

    def explain_dot(self, analyze: bool = False) -> str:
        """The physical plan as Graphviz DOT: one box per operator with what
        ``explain`` shows of it (chunk grids, tasks, projected memory);
        ``analyze=True`` runs the query first and adds each operator's
        metrics (rows, bytes, times)."""
        return self._raw._explain_dot(analyze)

    def explain_svg(self, path: str | os.PathLike | None = None, analyze: bool = False) -> str:
        """The plan drawn as SVG (needs Graphviz's ``dot`` on ``PATH``);
        written to ``path`` when given. In Jupyter,
        ``IPython.display.SVG(df.explain_svg())`` shows it."""
        svg = self._raw._render_svg(self.explain_dot(analyze))
        if path is not None:
            with open(os.fspath(path), "w", encoding="utf-8") as out:
                out.write(svg)
        return svg

    def show(self, n: int = 20, file: TextIO | None = None) -> None:
        """Prints the first ``n`` rows as a table."""
        print(self._raw._show(n), file=file or sys.stdout)

    def __repr__(self) -> str:
        return f"DataFrame(columns={self.columns})"

    # Running ---------------------------------------------------------------
    def count(self) -> int:
        """Number of rows."""
        return self._raw.count()

    def collect(self) -> list["pyarrow.RecordBatch"]:
        """Runs the query; its record batches."""
        return self.to_arrow_table().to_batches()

    def to_arrow_table(self) -> "pyarrow.Table":
        """Runs the query into a ``pyarrow.Table`` (the batches are not copied)."""
        import pyarrow as pa

        return pa.RecordBatchReader.from_stream(self._raw._collect()).read_all()

    def to_pandas(self) -> "pandas.DataFrame":
        """Runs the query into a ``pandas.DataFrame``."""
        return self.to_arrow_table().to_pandas()

    def to_xarray(self, dims: Sequence[str] | None = None) -> "xarray.Dataset":
        """Runs the query and rebuilds a gridded ``xarray.Dataset``.

        ``dims`` are the dimension columns (default: the result's columns that
        are dimensions of a registered Zarr table, in column order); every
        other column becomes a variable. Coordinates are sorted (descending
        where the store's coordinate descends). Attributes of columns named like a
        Zarr variable or coordinate are restored. A result whose dimension
        columns do not form a grid (a missing or repeated combination) raises
        ``ValueError``.
        """
        from .grid import table_to_xarray

        return table_to_xarray(self.to_arrow_table(), self._ctx._raw._zarr_columns(), dims)

    def to_zarr(
        self,
        path: str | os.PathLike,
        *,
        chunks: Mapping[str, int] | None = None,
        codec: str = "zstd",
        zarr_format: int = 3,
        dims: Sequence[str] | None = None,
    ) -> int:
        """Runs the query and writes the result as a new Zarr store at ``path``
        (``COPY ... STORED AS ZARR``); returns the number of rows written.

        Dimension columns (``dims``, default: the result's columns that are
        dimensions of a registered Zarr table) become dimensions with
        coordinate arrays, every other column a variable; missing cells and
        NULLs become NaN. ``chunks`` gives chunk lengths per dimension,
        ``codec`` is ``"zstd"``, ``"gzip"``, ``"blosc"`` or ``"none"``. The
        write is atomic: on an error or Ctrl-C nothing appears at ``path``,
        and an existing ``path`` is never replaced. A whole Zarr table as it
        is (``ctx.table("era5")``) is copied array by array, as stored, and
        a selection of one by its dimensions with computed float variables
        is written chunk by chunk: both inside ``allowed_mem`` however large
        they are.
        """
        options = {"codec": codec, "zarr_format": str(zarr_format)}
        if chunks:
            options["chunks"] = ",".join(f"{d}={int(n)}" for d, n in chunks.items())
        if dims:
            options["dims"] = ",".join(dims)
        return self._raw._to_zarr(os.fspath(path), options)

    def __arrow_c_stream__(self, requested_schema: Any = None) -> Any:
        return self._raw.__arrow_c_stream__(requested_schema)

    def __arrow_c_schema__(self) -> Any:
        return self._raw.__arrow_c_schema__()


def _fft_options(**options: Any) -> list[tuple[str, str]]:
    """Keyword arguments as the SQL functions' ``name => value`` pairs."""
    pairs = []
    for name, value in options.items():
        if value is None:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = value
        elif isinstance(value, (list, tuple)):
            text = ",".join(str(v) for v in value)
        else:
            text = str(value)
        pairs.append((name, text))
    return pairs

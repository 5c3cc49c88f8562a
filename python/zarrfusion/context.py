"""The session: tables, SQL, settings, and datasets opened for windowing."""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from . import _zarrfusion
from .dataframe import DataFrame
from .loader import Dataset


class SessionContext:
    """A zarrfusion session.

    ``allowed_mem`` bounds the memory queries may use (``"4GB"``, ``"512MB"``
    or a number of bytes); ``work_dir`` is where intermediate files go: a
    local path (DataFusion's spill files go there too) or an object-store
    URL (``"s3://bucket/scratch"``: a rechunk's intermediate arrays);
    ``device`` is where FFTs run: ``"auto"`` (a GPU when one is usable, else
    the CPU), ``"cpu"`` or ``"cuda"``; ``io_concurrency`` is how many
    object-store reads an operator keeps in flight ahead of its decoders
    (default 64, 0 for none; their chunks count in ``allowed_mem``);
    ``allowed_locations`` restricts the stores, work directories and
    ``COPY``/``CREATE EXTERNAL TABLE`` locations statements may reach to
    these directories and URL prefixes (for a service running SQL written
    by others; SQL cannot change it; see docs/security.md); ``config`` sets
    any session setting, e.g. ``{"zarrfusion.dense_reduction": "false"}``
    (``"zarrfusion.allowed_mem"`` too, as ``SET`` takes it, in place of the
    argument);
    ``workers`` runs queries on a cluster of ``zarrfusion worker``
    processes (``["host1:50051", "host2:50051"]``; see docs/distributed.md):
    each worker's ``allowed_mem`` is its own ``--memory-limit``, and this
    session's ``allowed_mem`` stands for it while planning (a task that
    cannot fit it is refused before any worker is asked).
    """

    def __init__(
        self,
        allowed_mem: str | int | None = None,
        work_dir: str | os.PathLike | None = None,
        *,
        target_partitions: int | None = None,
        batch_size: int | None = None,
        device: str | None = None,
        io_concurrency: int | None = None,
        config: Mapping[str, Any] | None = None,
        allowed_locations: Sequence[str | os.PathLike] | None = None,
        workers: Sequence[str] | None = None,
    ) -> None:
        if isinstance(allowed_locations, (str, os.PathLike)):
            raise TypeError("allowed_locations must be a list of directories and URLs, not one string")
        if isinstance(workers, str):
            raise TypeError("workers must be a list of host:port addresses, not one string")
        # How to open this session again (a loader pickled for DataLoader
        # workers reopens its store in a session made with these).
        self._arguments = dict(
            allowed_mem=allowed_mem,
            work_dir=None if work_dir is None else os.fspath(work_dir),
            target_partitions=target_partitions,
            batch_size=batch_size,
            device=device,
            io_concurrency=io_concurrency,
            config=None if config is None else dict(config),
            allowed_locations=None if allowed_locations is None else [os.fspath(p) for p in allowed_locations],
            workers=None if workers is None else [str(w) for w in workers],
        )
        settings = None if config is None else {str(k): _setting(v) for k, v in config.items()}
        if device is not None:
            settings = {**(settings or {}), "zarrfusion.device": str(device)}
        if io_concurrency is not None:
            if isinstance(io_concurrency, bool) or not isinstance(io_concurrency, int) or io_concurrency < 0:
                raise ValueError(f"io_concurrency must be a non-negative integer, got {io_concurrency!r}")
            settings = {**(settings or {}), "zarrfusion.io_concurrency": str(io_concurrency)}
        self._raw = _zarrfusion.SessionContext(
            allowed_mem=allowed_mem,
            work_dir=None if work_dir is None else os.fspath(work_dir),
            target_partitions=target_partitions,
            batch_size=batch_size,
            config=settings,
            allowed_locations=self._arguments["allowed_locations"],
            workers=self._arguments["workers"],
        )

    def register_zarr(self, name: str, path: str | os.PathLike, **options: Any) -> None:
        """Registers a Zarr store (path or URL) as table ``name``.

        Options are those of ``CREATE EXTERNAL TABLE ... STORED AS ZARR OPTIONS``:
        ``dims="lat,lon"``, ``group=...``, ``pushdown=False``, ``aws.region=...``
        (pass dotted keys with ``**{"aws.region": "us-west-2"}``).
        """
        self._raw.register_zarr(name, os.fspath(path), **options)

    def sql(self, query: str) -> DataFrame:
        """Plans a SQL statement (DDL and ``SET`` run at once)."""
        return DataFrame(self._raw.sql(query), self)

    def table(self, name: str) -> DataFrame:
        """The whole of a registered table."""
        return DataFrame(self._raw.table(name), self)

    def deregister_table(self, name: str) -> bool:
        """Removes a table; ``True`` when it existed."""
        return self._raw.deregister_table(name)

    def tables(self) -> list[str]:
        """Names of the tables in the default schema."""
        return self._raw.table_names()

    def open_zarr(
        self,
        path: str | os.PathLike | Mapping[str, str | os.PathLike],
        variables: Sequence[str] | Mapping[str, Sequence[str]] | None = None,
        dims: str | Sequence[str] | None = None,
        **options: Any,
    ) -> Dataset:
        """Opens Zarr stores for windowing (see :meth:`Dataset.windows`).

        ``path`` is one store, or ``{name: store}`` for several sources
        joined on their coordinates (the first is the reference whose grid
        the windows follow). ``variables`` are the data variables to cut
        windows from (``{name: [...]}`` per source); by default every
        variable over the dimension set ``dims``, itself by default the one
        with the most dimensions. Variables of one store over several
        dimension sets (surface fields beside pressure levels) become one
        source each.
        """
        if isinstance(variables, str):
            variables = [variables]
        if isinstance(path, Mapping):
            stores = {str(k): os.fspath(v) for k, v in path.items()}
            if isinstance(variables, Mapping):
                unknown = set(variables) - set(stores)
                if unknown:
                    raise ValueError(f"variables: no source named {sorted(unknown)[0]!r} (sources: {', '.join(stores)})")
                per = {k: None if variables.get(k) is None else list(variables[k]) for k in stores}
            elif variables is None:
                per = {k: None for k in stores}
            else:
                raise ValueError("variables: give {source: [variables]} for several sources")
            description_path: Any = stores
            description_variables: Any = per
            sources = [(k, stores[k], per[k]) for k in stores]
        else:
            if isinstance(variables, Mapping):
                raise ValueError("variables: a dict needs several sources ({name: store} as path)")
            description_path = os.fspath(path)
            description_variables = None if variables is None else list(variables)
            sources = [(description_path, description_path, description_variables)]
        description = dict(
            session=self._arguments,
            path=description_path,
            variables=description_variables,
            dims=dims if dims is None or isinstance(dims, str) else list(dims),
            options=dict(options),
        )
        raw = self._raw.open_zarr(sources, dims=description["dims"], **options)
        return Dataset(raw, description)

    def rechunk(
        self,
        source: str | os.PathLike,
        target: str | os.PathLike,
        chunks: Mapping[str, int],
        *,
        threads: int | None = None,
    ) -> dict[str, Any]:
        """Copies every array of the Zarr store ``source`` (a path, a URL or
        a registered table's name) into a new store at ``target`` with the
        chunk lengths ``chunks`` (``{"time": 240, "lat": 16}``; other
        dimensions keep theirs), values and encoding unchanged.

        Runs inside the session's ``allowed_mem`` (2 GiB when unset): a plan
        that cannot fit is refused before anything is read; when one pass
        would read the input over and over, it goes through intermediate
        arrays in ``work_dir``, removed at the end. The target appears only
        when complete. Returns per array the stages, chunk shapes, tasks and
        projected memory, and the bytes read and written. ``threads``
        (default: the cores) is at most 1024; no more run than there are
        tasks.
        """
        return self._raw.rechunk(os.fspath(source), os.fspath(target), dict(chunks), threads)

    def __repr__(self) -> str:
        return f"SessionContext(tables={self.tables()})"


def _setting(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)

"""The exceptions zarrfusion raises.

Bad arguments are ``ValueError``. Everything else is a
:class:`ZarrFusionError`, with where it happened when the engine knows it:
``store`` (the location as given), ``array`` (its path in the store),
``chunk`` (grid indices) and ``key`` (the chunk's key), else ``None``. Its
subclasses are also the built-in exception of their kind, so generic
handlers catch them too::

    try:
        ctx.sql("SELECT avg(t2m) FROM era5").collect()
    except zf.ZarrDataError as e:       # also an OSError
        print(e.store, e.array, e.chunk)
"""

from __future__ import annotations


class ZarrFusionError(Exception):
    """An error from the zarrfusion engine: bad SQL, unreadable data, a
    refused plan. ``store``, ``array``, ``chunk`` and ``key`` say where,
    when known (``None`` otherwise)."""

    def __init__(self, message: str, store: str | None = None, array: str | None = None,
                 chunk: list[int] | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.store = store
        self.array = array
        self.chunk = chunk
        self.key = key


class ZarrDataError(ZarrFusionError, OSError):
    """A store, array or chunk that cannot be opened, read or decoded
    (missing or malformed metadata, a corrupt or truncated chunk, a request
    that failed after its retries); also an ``OSError``."""


class ZarrMemoryError(ZarrFusionError, MemoryError):
    """A plan refused because it cannot fit ``allowed_mem`` (the message
    has the numbers); also a ``MemoryError``."""


class ZarrPermissionError(ZarrFusionError, PermissionError):
    """A location the session may not reach (not under its
    ``allowed_locations``), or an option that would reach past them;
    ``store`` is the location as given. Also a ``PermissionError``."""


__all__ = ["ZarrDataError", "ZarrFusionError", "ZarrMemoryError", "ZarrPermissionError"]

"""Training windows cut from Zarr just in time.

``Dataset.windows`` starts building an index of the valid windows (one pass
over the data in the background, no copy of it); ``Windows.loader`` yields
batches, starting before the index is complete as dicts of numpy
arrays assembled on Rust threads::

    {"t2m": array (batch, 5, 5), ..., "coords": {dim: origin coordinate},
     "index": {dim: origin index}}

The arrays own the memory Rust filled: nothing is copied on the way to
Python, ``torch.from_numpy`` shares it, and DLPack consumers
(``jax.numpy.from_dlpack``, ``cupy.from_dlpack``) take it as is.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Mapping



class Dataset:
    """A Zarr store opened for windowing (``SessionContext.open_zarr``)."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    @property
    def dims(self) -> list[str]:
        """Dimension names, outermost first."""
        return self._raw.dims

    @property
    def sizes(self) -> dict[str, int]:
        """Dimension lengths."""
        return dict(self._raw.sizes)

    @property
    def variables(self) -> list[str]:
        """The variables windows are cut from."""
        return self._raw.variables

    def windows(
        self,
        input_dims: Mapping[str, int],
        input_overlap: Mapping[str, int] | None = None,
        valid: str | float = "all",
        where: str | None = None,
        *,
        block_size: str | int | None = None,
        threads: int | None = None,
        cache: bool | str | os.PathLike | None = True,
    ) -> "Windows":
        """The valid windows of a shape (xbatcher's names).

        - ``input_dims``: cells per window along each window dimension; every
          other dimension is one cell per window (squeezed from batches).
        - ``input_overlap``: cells shared by neighbouring windows; the stride
          is ``size - overlap``.
        - ``valid``: ``"all"`` keeps windows without a missing value in any
          variable, ``"any"`` keeps every window, a fraction keeps windows
          with at least that share of non-missing values.
        - ``where``: a SQL condition on coordinates selecting the cells
          windows are cut from (``"time >= '2020-01-01'"``).
        - ``block_size``: decoded bytes of the blocks windows are read in.
        - ``threads``: threads building the index in the background, at the
          lowest priority (0: blocks are indexed only as a loader reads them
          and when ``len()`` is asked for).
        - ``cache``: keep the valid-window index on disk and reuse it while
          the data, the window shape, ``where`` and ``valid`` are unchanged.
          ``True`` uses ``$ZARRFUSION_CACHE_DIR`` or the user's cache
          directory, a path uses that directory, ``False`` builds every time.
        """
        return Windows(
            self._raw.windows(
                dict(input_dims),
                None if input_overlap is None else dict(input_overlap),
                valid,
                where,
                block_size,
                threads,
                cache,
            )
        )

    def __repr__(self) -> str:
        return repr(self._raw)


class Windows:
    """The valid windows of a dataset; ``len()`` is their number.

    The index of valid windows is built in the background: ``len()``, the
    ``index_*`` properties, sharded loaders and ``shuffle="full"`` wait for
    it; a single-process loader in block or storage order starts at once.
    """

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    def __len__(self) -> int:
        return len(self._raw)

    @property
    def index_progress(self) -> tuple[int, int]:
        """Blocks of the valid-window index built so far, and in all."""
        return tuple(self._raw.index_progress)

    @property
    def variables(self) -> list[str]:
        """The variables in each batch."""
        return self._raw.variables

    @property
    def window_shape(self) -> dict[str, int]:
        """Window dimensions and sizes."""
        return dict(self._raw.window_shape)

    @property
    def index_source(self) -> str:
        """``"cache"`` when the valid-window index was loaded from the cache, else ``"built"``; waits for it."""
        return self._raw.index_source

    @property
    def index_seconds(self) -> float:
        """Seconds spent building the valid-window index (0 when cached); waits for it."""
        return self._raw.index_seconds

    def loader(
        self,
        batch_size: int = 256,
        shuffle: str | None = "block",
        seed: int = 0,
        drop_last: bool = False,
        prefetch: int = 8,
        threads: int | None = None,
        shard: tuple[int, int] | None = None,
        buffer_size: str | int = "256MB",
    ) -> "WindowLoader":
        """A loader of batches.

        - ``shuffle``: ``None`` (storage order), ``"block"`` (blocks in random
          order, windows drawn at random from ``buffer_size`` bytes of decoded
          blocks) or ``"full"`` (a permutation of all windows; reads window by window).
        - ``seed`` makes every order reproducible; ``set_epoch`` changes it per epoch.
        - ``shard=(rank, world_size)`` takes this rank's disjoint share; with
          ``drop_last`` every rank yields the same number of batches.
        - ``prefetch`` batches are assembled ahead on ``threads`` Rust threads.

        Under the session's ``allowed_mem``, a loader whose buffer, batches
        and decoding threads do not fit is refused (``ValueError`` with the
        numbers), and chunks read ahead from an object store get what they
        leave (``loader.memory``).
        """
        if shuffle is False:
            shuffle = None
        elif shuffle is True:
            shuffle = "block"
        raw = self._raw.loader(batch_size, shuffle, seed, drop_last, prefetch, threads, shard, buffer_size)
        return WindowLoader(raw)

    def __repr__(self) -> str:
        return repr(self._raw)


class WindowLoader:
    """Batches of windows, epoch after epoch; ``len()`` is batches per epoch."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    def __len__(self) -> int:
        return len(self._raw)

    @property
    def num_samples(self) -> int:
        """Windows per epoch for this shard."""
        return self._raw.num_samples

    @property
    def batch_size(self) -> int:
        return self._raw.batch_size

    @property
    def epoch(self) -> int:
        return self._raw.epoch

    def set_epoch(self, epoch: int) -> None:
        """Seeds the next iteration's order (as ``DistributedSampler.set_epoch``)."""
        self._raw.set_epoch(epoch)

    def __iter__(self) -> Iterator[dict]:
        return iter(self._raw)

    @property
    def memory(self) -> dict:
        """The bytes an epoch holds at its peak, by part: ``buffer`` (decoded
        blocks windows are drawn from), ``batches`` (prefetched and being
        planned), ``decoding`` (a block per thread), ``read_ahead`` (chunks
        read ahead from an object store, fitted to what the rest leaves of
        ``allowed_mem``) and ``total``."""
        return self._raw.memory

    def stats(self) -> dict:
        """Batches, samples, blocks and bytes read, decode and assembly thread
        time, and the time the consumer waited, over all epochs."""
        return self._raw.stats()

    def torch(self) -> Any:
        """This loader as a ``torch.utils.data.IterableDataset`` yielding
        tensors that share the batches' memory; use it with
        ``DataLoader(loader.torch(), batch_size=None)`` or iterate it.
        Time coordinates become int64 tensors (nanoseconds since 1970)."""
        return _torch_dataset_class()(self)


def _as_tensor(value: Any) -> Any:
    """A numpy array as a tensor sharing its memory; times (torch has no
    datetime type) as int64 counts of their unit (nanoseconds since 1970
    for CF times); strings stay numpy arrays."""
    import torch

    if value.dtype.kind in "fiub":
        return torch.from_numpy(value)
    if value.dtype.kind in "mM":
        return torch.from_numpy(value.view("int64"))
    return value


def _as_tensors(batch: dict) -> dict:
    out = {}
    for key, value in batch.items():
        if isinstance(value, dict):
            out[key] = {k: _as_tensor(v) for k, v in value.items()}
        else:
            out[key] = _as_tensor(value)
    return out


_TORCH_CLASS = None


def _torch_dataset_class() -> type:
    global _TORCH_CLASS
    if _TORCH_CLASS is None:
        try:
            import torch.utils.data
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("WindowLoader.torch() needs PyTorch: pip install torch") from e

        class TorchWindowLoader(torch.utils.data.IterableDataset):
            """A window loader as a PyTorch iterable dataset of tensors."""

            def __init__(self, loader: WindowLoader) -> None:
                super().__init__()
                self.loader = loader

            def __iter__(self):
                return (_as_tensors(b) for b in self.loader)

            def __len__(self) -> int:
                return len(self.loader)

            def set_epoch(self, epoch: int) -> None:
                self.loader.set_epoch(epoch)

        _TORCH_CLASS = TorchWindowLoader
    return _TORCH_CLASS


__all__ = ["Dataset", "Windows", "WindowLoader"]

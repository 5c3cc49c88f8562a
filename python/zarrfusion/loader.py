"""Training windows cut from Zarr just in time.

``Dataset.windows`` starts building an index of the valid windows (one pass
over the data in the background, no copy of it); ``Windows.loader`` yields
batches, starting before the index is complete as dicts of numpy
arrays assembled on Rust threads::

    {"t2m": array (batch, 5, 5), ..., "coords": {dim: origin coordinate},
     "index": {dim: origin index}}

With ``history`` and ``targets`` (lead times) a sample has inputs and
targets, each a stack of channels (``stack="channels"``)::

    {"inputs": array (batch, channels, 64, 64), "targets": array (batch, channels', 64, 64),
     "coords": {...}, "index": {...}, "jitter": {dim: offsets}}

The arrays own the memory Rust filled: nothing is copied on the way to
Python, ``torch.from_numpy`` shares it, and DLPack consumers
(``jax.numpy.from_dlpack``, ``cupy.from_dlpack``) take it as is.

A loader resumes mid-epoch (``state_dict``/``load_state_dict``), pickles
as the description it was opened with (a ``DataLoader`` worker started by
``spawn`` reopens the store), and under ``DataLoader(num_workers=k)`` its
workers split the epoch between them (``WindowLoader.torch``).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Iterable, Iterator, Mapping, Sequence


class Dataset:
    """A Zarr store opened for windowing (``SessionContext.open_zarr``)."""

    def __init__(self, raw: Any, description: dict) -> None:
        self._raw = raw
        self._description = description

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
        """The variables windows are cut from, source after source."""
        return self._raw.variables

    @property
    def sources(self) -> list[dict]:
        """Each source (a store's variables over one dimension set; the
        first is the reference): ``{"name", "dims", "variables"}``."""
        return [{"name": n, "dims": d, "variables": v} for n, d, v in self._raw.sources]

    def windows(
        self,
        input_dims: Mapping[str, int],
        input_overlap: Mapping[str, int] | None = None,
        valid: str | float = "all",
        where: str | None = None,
        *,
        history: Mapping[str, int] | None = None,
        targets: Mapping[str, str | Sequence[str]] | None = None,
        inputs: Sequence[str] | None = None,
        jitter: Mapping[str, int] | None = None,
        block_size: str | int | None = None,
        threads: int | None = None,
        cache: bool | str | os.PathLike | None = True,
    ) -> "Windows":
        """The valid windows of a shape (xbatcher's names), or samples of
        inputs and targets.

        - ``input_dims``: cells per window along each window dimension; every
          other dimension is one cell per window (squeezed from batches).
        - ``input_overlap``: cells shared by neighbouring windows; the stride
          is ``size - overlap``.
        - ``valid``: ``"all"`` keeps windows without a missing value in any
          variable, ``"any"`` keeps every window, a fraction keeps windows
          with at least that share of non-missing values; with targets, a
          rule per role: ``{"inputs": 0.9, "targets": "all"}`` (each
          counted over that role's channels).
        - ``history``: ``{dim: steps}``, the input steps along ``dim`` (the
          *lead dimension*, usually ``time``) ending at the sample's own.
        - ``targets``: ``{variable: lead}`` or ``{variable: [leads]}``, lead
          times along the lead dimension in steps (``"+1"``) or in its
          coordinate's units (``"+6h"``, ``"+30min"``, ``"+1d"``: a whole
          number of its evenly spaced steps). Without ``history`` the lead
          dimension is the only one outside ``input_dims`` holding times.
          Every step a sample uses lies in the selection (``where``).
        - ``inputs``: the input variables (default: all of the dataset's;
          an empty list is refused). Channels keep the dataset's order.
        - ``jitter``: ``{dim: cells}``, a random offset per sample and
          epoch along window dimensions within ``±cells`` (and the
          selection), the same for every channel of the sample; seeded by
          the loader's ``seed``, reported in ``batch["jitter"]``. An offset
          whose window breaks a validity rule is drawn again (8 times at
          most, then none).
        - ``where``: a SQL condition on coordinates selecting the cells
          windows are cut from (``"time >= '2020-01-01'"``).
        - ``block_size``: decoded bytes of the blocks windows are read in.
        - ``threads``: threads building the index in the background, at the
          lowest priority (0: blocks are indexed only as a loader reads them
          and when ``len()`` is asked for).
        - ``cache``: keep the valid-window index on disk and reuse it while
          the data, the window shape, ``where`` and ``valid`` are unchanged.
          ``True`` uses ``$ZARRFUSION_CACHE_DIR`` or the user's cache
          directory, a path uses that directory, an object-store URL
          (``"s3://bucket/cache"``, reached with the options its bucket's
          stores were opened with) a prefix there, which the ranks of a job
          on several machines share while they build the index; ``False``
          builds every time.
        """
        if isinstance(inputs, str):
            inputs = [inputs]
        if where is not None and not isinstance(where, str):
            raise TypeError(f"where: expected a SQL condition (str), got {where!r}")
        if not (cache is None or isinstance(cache, (bool, str, os.PathLike))):
            raise TypeError(f"cache: expected True, False, a directory or an object-store URL, got {cache!r}")
        arguments = dict(
            input_dims=_mapping("input_dims", input_dims),
            input_overlap=None if input_overlap is None else _mapping("input_overlap", input_overlap),
            valid=dict(valid) if isinstance(valid, Mapping) else valid,
            where=where,
            block_size=block_size,
            threads=threads,
            cache=os.fspath(cache) if isinstance(cache, os.PathLike) else cache,
            history=None if history is None else _mapping("history", history),
            targets=None if targets is None else _targets(targets),
            inputs=None if inputs is None else _names("inputs", inputs),
            jitter=None if jitter is None else _mapping("jitter", jitter),
        )
        raw = self._raw.windows(*arguments.values())
        return Windows(raw, {**self._description, "windows": arguments})

    def __repr__(self) -> str:
        return repr(self._raw)


class Windows:
    """The valid windows of a dataset; ``len()`` is their number.

    The index of valid windows is built in the background: ``len()``, the
    ``index_*`` properties, sharded loaders and ``shuffle="full"`` wait for
    it; a single-process loader in block or storage order starts at once.
    """

    def __init__(self, raw: Any, description: dict) -> None:
        self._raw = raw
        self._description = description

    def __len__(self) -> int:
        return len(self._raw)

    @property
    def index_progress(self) -> tuple[int, int]:
        """Blocks of the valid-window index built so far, and in all."""
        return tuple(self._raw.index_progress)

    @property
    def index_counts(self) -> dict:
        """Where the index's blocks came from so far: ``blocks`` (in all),
        ``indexed``, ``read`` (from values this process read) and
        ``from_other_processes``: processes building the same index with
        the same cache directory (DataLoader workers, ranks on one machine)
        share its blocks there, each block read by one of them."""
        return self._raw.index_counts

    @property
    def index_memory(self) -> dict:
        """The bytes building the index in the background holds while it is
        incomplete: ``threads`` indexing blocks (as many as half of the
        session's ``allowed_mem`` holds; none when one block does not fit,
        and blocks are then indexed by the loaders that read them),
        ``decoding`` (a block per thread), ``read_ahead`` (chunks read ahead
        of them from an object store) and ``total``; zeros once complete.
        A loader counts it in its ``memory``."""
        return self._raw.index_memory

    @property
    def variables(self) -> list[str]:
        """The variables in each batch."""
        return self._raw.variables

    @property
    def window_shape(self) -> dict[str, int]:
        """Window dimensions and sizes (the lead dimension spans every step a sample uses)."""
        return dict(self._raw.window_shape)

    @property
    def lead_dim(self) -> str | None:
        """The dimension of history and lead times, when there is one."""
        return self._raw.lead_dim

    @property
    def channels(self) -> dict[str, list[dict]]:
        """Per role (``inputs``, then ``targets``), its channels in batch
        order: ``{"variable": name, "step": steps from the sample's own}``,
        with the coordinate of each channel dimension (``"level": 500.0``).
        Steps come outermost (oldest first), then the variables in
        ``variables`` order, so a stacked ``(B, C, ...)`` array reshapes to
        ``(B, steps, variables, ...)`` when every step has the same
        variables."""
        return _channels(self._raw.channels)

    def statistics(self) -> dict[str, dict[str, Any]]:
        """Per variable: ``count``, ``mean``, ``std`` (population), ``min``,
        ``max`` of the non-missing values in the selected cells (``where``),
        computed by the engine's dense reduction inside ``allowed_mem`` and
        kept in the cache beside the window index (``cache``). A variable
        whose channels run along a dimension (pressure levels) has one
        value per channel: lists, with that dimension's coordinates under
        its name (``{"level": [1000, 850, 500], "mean": [...], ...}``)."""
        keys = ("count", "mean", "std", "min", "max")
        out = {}
        for name, parts in self._raw.statistics():
            if len(parts) == 1 and not parts[0][0]:
                values = parts[0][1]
                out[name] = {k: (int(v) if k == "count" else v) for k, v in zip(keys, values)}
                continue
            entry: dict[str, Any] = {}
            for dim, _ in parts[0][0]:
                entry[dim] = [dict(at)[dim] for at, _ in parts]
            for i, k in enumerate(keys):
                entry[k] = [int(values[i]) if k == "count" else values[i] for _, values in parts]
            out[name] = entry
        return out

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
        shard: tuple[int, int] | str | None = None,
        buffer_size: str | int = "256MB",
        stack: str | None = None,
        normalize: bool | Mapping[str, Mapping[str, float]] | None = None,
    ) -> "WindowLoader":
        """A loader of batches.

        - ``shuffle``: ``None`` (storage order), ``"block"`` (blocks in random
          order, windows drawn at random from ``buffer_size`` bytes of decoded
          blocks) or ``"full"`` (a permutation of all windows; reads window by
          window, whole chunks each, read ahead from an object store in the
          permutation's order; the block shuffle reads each chunk once).
        - ``seed`` makes every order reproducible; ``set_epoch`` changes it per epoch.
        - ``shard=(rank, world_size)`` takes this rank's disjoint share; with
          ``drop_last`` every rank yields the same number of batches.
          ``shard="auto"`` takes the rank and world size of
          ``torch.distributed`` when it is initialized (else of JAX's
          processes, else the whole).
        - ``prefetch`` batches are assembled ahead on ``threads`` Rust threads.
        - ``stack="channels"``: one contiguous float32 array per role,
          ``(batch, channels, *window)``, channels as ``Windows.channels``
          lists them; otherwise one array per variable (per role with
          targets: ``(batch, steps, *window)``).
        - ``normalize``: ``True`` (``Windows.statistics()``) or a dict like
          it, ``{variable: {"mean": m, "std": s}}``: ``(x - mean) / std``
          is applied in Rust while assembling (float32 out; a variable with
          ``std`` 0 is only centered).

        Under the session's ``allowed_mem``, a loader whose buffer, batches
        and decoding threads do not fit is refused (``ValueError`` with the
        numbers), and chunks read ahead from an object store get what they
        leave (``loader.memory``).
        """
        if shuffle is False:
            shuffle = None
        elif shuffle is True:
            shuffle = "block"
        if shuffle is not None and not isinstance(shuffle, str):
            raise TypeError(f"shuffle: expected None, 'block' or 'full', got {shuffle!r}")
        if not isinstance(drop_last, bool):
            raise TypeError(f"drop_last: expected True or False, got {drop_last!r}")
        if isinstance(shard, str):
            if shard != "auto":
                raise ValueError(f"shard: {shard!r} is not (rank, world_size), 'auto' or None")
            shard = _auto_shard()
        if stack not in (None, "channels"):
            raise ValueError(f"stack: {stack!r} is not 'channels' or None")
        if normalize is True:
            normalize = self.statistics()
        elif normalize is False:
            normalize = None
        if normalize is not None:
            normalize = _scales(normalize, self.variables, self._raw.statistics_parts())
        arguments = dict(
            batch_size=batch_size,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            prefetch=prefetch,
            threads=threads,
            shard=None if shard is None else tuple(shard),
            buffer_size=buffer_size,
            stack=stack,
            normalize=normalize,
        )
        return WindowLoader(_raw_loader(self._raw, arguments), {**self._description, "loader": arguments})

    def __repr__(self) -> str:
        return repr(self._raw)


class WindowLoader:
    """Batches of windows, epoch after epoch; ``len()`` is batches per epoch."""

    def __init__(self, raw: Any, description: dict, worker: tuple[int, int] | None = None) -> None:
        self._raw = raw
        self._description = description
        self._worker = worker
        # The process this loader's threads run in (see _torch).
        self._pid = os.getpid()
        # The position load_state_dict restored, for DataLoader workers
        # (epoch, batches consumed); cleared by set_epoch.
        self._resume: tuple[int, int] | None = None

    def __len__(self) -> int:
        return len(self._raw)

    @property
    def channels(self) -> dict[str, list[dict]]:
        """Per role, the channels of its arrays in batch order (``Windows.channels``)."""
        return _channels(self._raw.channels)

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
        """Seeds the next iteration's order (as ``DistributedSampler.set_epoch``);
        the next iteration starts that epoch from its beginning."""
        self._raw.set_epoch(epoch)
        self._resume = None

    def __iter__(self) -> Iterator[dict]:
        return iter(self._raw)

    def state_dict(self, batches: int | None = None) -> dict:
        """Where the training loop is: the epoch and how many of its batches
        it consumed (``batches``; by default, how many this loader yielded:
        pass the count when the batches came through ``DataLoader``
        workers), with the options that fix the order. Plain values: it
        pickles and goes into a checkpoint as is."""
        a = self._description["loader"]
        return {
            "epoch": self.epoch,
            "batches": self._raw.position if batches is None else int(batches),
            "batch_size": a["batch_size"],
            "shuffle": a["shuffle"],
            "seed": a["seed"],
            "drop_last": a["drop_last"],
            "shard": None if a["shard"] is None else list(a["shard"]),
            "buffer_size": a["buffer_size"],
            "windows": _windows_key(self._description),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues the epoch of ``state`` after the batches it consumed:
        the next iteration (or, through ``torch()``, the next iterations of
        ``DataLoader`` workers, until ``set_epoch``) yields exactly the
        batches an uninterrupted epoch would have yielded after them. The
        options that fix the order must be the same (``ValueError`` names
        the first that is not)."""
        mine = self.state_dict()
        for key in ("windows", "batch_size", "shuffle", "seed", "drop_last", "shard", "buffer_size"):
            if key not in state:
                raise ValueError(f"load_state_dict: the state has no {key!r}")
            if _normalized(state[key]) != _normalized(mine[key]):
                raise ValueError(
                    f"load_state_dict: {key} is {state[key]!r} in the state but {mine[key]!r} in this loader"
                )
        epoch, batches = state.get("epoch"), state.get("batches")
        for key, value in (("epoch", epoch), ("batches", batches)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"load_state_dict: {key} must be a non-negative integer, got {value!r}")
        self._restore(epoch, batches)

    def _restore(self, epoch: int, batches: int) -> None:
        """Resumes epoch ``epoch`` after its first ``batches`` batches."""
        self._raw.resume_at(epoch, batches)
        self._resume = (epoch, batches)

    def __reduce__(self):
        # Pickled as its description (for DataLoader workers started by
        # spawn or forkserver): reopened where it is unpickled. The workers
        # index what they need; this process's background index threads
        # stop, so as not to take their cores (what this process asks of the
        # index later it indexes in the asking thread).
        self._raw.stop_background_index()
        return (_reopen_loader, (self._description, self._worker, self.epoch, self._resume))

    def _for_worker(self, worker: int, workers: int) -> "WindowLoader":
        """This loader's share for DataLoader worker ``worker`` of
        ``workers``, opened afresh (in the worker's process), at the epoch
        and resumed position of this one."""
        if self._resume is None:
            return _reopen_loader(self._description, (worker, workers), self.epoch, None)
        # The DataLoader takes batches from its workers in turn from worker
        # 0, skipping those that ended: worker w goes on with the share the
        # next batch would have come from after `consumed` (and those
        # after it in turn), past the batches of it consumed.
        epoch, consumed = self._resume
        share, skip = self._raw.resume_workers(epoch, consumed, workers)[worker]
        loader = _reopen_loader(self._description, (share, workers), epoch, None)
        loader._raw.resume_at(epoch, skip)
        return loader

    @property
    def memory(self) -> dict:
        """The bytes an epoch holds at its peak, by part: ``buffer`` (decoded
        blocks windows are drawn from), ``batches`` (prefetched and being
        planned), ``decoding`` (a block per thread), ``index`` (the window
        index being built beside it, until complete: see
        :attr:`Windows.index_memory`), ``read_ahead`` (chunks read ahead from
        an object store, fitted to what the rest leaves of ``allowed_mem``)
        and ``total``."""
        return self._raw.memory

    def stats(self) -> dict:
        """Batches, samples, blocks and bytes read, decode and assembly thread
        time, and the time the consumer waited, over all epochs; and what the
        sources' object stores fetched since they were opened (by every loader
        of these windows and the window index): ``requests``,
        ``bytes_fetched``, ``read_ahead_hits`` (reads served from chunks
        requested ahead), ``read_ahead_misses`` (reads of chunks nobody had
        requested ahead, each a round trip waited for) and
        ``read_ahead_requests``. Zero for local files."""
        return self._raw.stats()

    def torch(self) -> Any:
        """This loader as a ``torch.utils.data.IterableDataset`` yielding
        tensors that share the batches' memory; use it with
        ``DataLoader(loader.torch(), batch_size=None)`` or iterate it.
        Time coordinates become int64 tensors (nanoseconds since 1970).

        Under ``DataLoader(num_workers=k)`` each worker process reopens the
        store and yields its own stream of the epoch: in block or storage
        order, a contiguous run of the epoch's blocks of its own (each
        worker of each rank is a stream, see ``docs/loader.md``), so
        workers decode disjoint blocks and start at once; under the full
        shuffle, runs of whole batches of the rank's share. No window comes
        twice, none is missing; with ``drop_last`` every rank yields as
        many batches (in block or storage order every worker of every rank
        does; under the full shuffle a rank's workers take turns at its
        whole batches, so they may differ by one). ``len()`` counts
        the batches without workers: with ``k`` workers each ends its own
        stream with a short batch (without ``drop_last``), or the streams
        drop up to a batch each (with it). They share the cores
        (``threads`` defaults to the cores over ``k``, the windows' background
        index threads to half that, none on 2 cores). With a cache directory
        (the default) the workers, and ranks on the same machine, share the
        blocks of an index they build: each block is read by one of them.
        Start them with
        ``spawn`` or ``forkserver`` (``multiprocessing_context="spawn"``):
        the loader's threads do not survive ``fork``, so a forked worker
        raises an error saying so."""
        from ._torch import TorchWindowLoader

        return TorchWindowLoader(self)

def _mapping(name: str, value: Any) -> dict:
    """``{dimension: number}`` arguments as a dict; a ``TypeError`` naming
    ``name`` for anything but a mapping with string keys."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise TypeError(f"{name}: expected {{dimension: cells}}, got {value!r}")
    return dict(value)


def _names(name: str, value: Any) -> list[str]:
    """Variable names given as any iterable of strings (a list, a tuple,
    a mapping's keys); a ``TypeError`` naming ``name`` otherwise."""
    names = None if isinstance(value, (str, bytes)) or not isinstance(value, Iterable) else list(value)
    if names is None or not all(isinstance(v, str) for v in names):
        raise TypeError(f"{name}: expected a list of variable names, got {value!r}")
    return names


def _targets(value: Any) -> dict:
    """``targets`` as ``{variable: lead or [leads]}`` (leads as strings)."""
    if not isinstance(value, Mapping):
        raise TypeError(f"targets: expected {{variable: lead or [leads]}}, got {value!r}")
    out = {}
    for variable, leads in value.items():
        if isinstance(leads, str):
            out[variable] = leads
            continue
        listed = list(leads) if isinstance(leads, Iterable) and not isinstance(leads, bytes) else None
        if listed is None or not all(isinstance(lead, str) for lead in listed):
            raise TypeError(f"targets: {variable!r} takes a lead time like '+6h' or '+1', or a list of them, not {leads!r}")
        out[variable] = listed
    return out


def _auto_shard() -> tuple[int, int] | None:
    """The rank and world size of torch.distributed when it is initialized,
    else of JAX's processes when there are several, else None."""
    torch = sys.modules.get("torch")
    if torch is not None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    jax = sys.modules.get("jax")
    if jax is not None and jax.process_count() > 1:
        return jax.process_index(), jax.process_count()
    return None


def _listed(value: Any) -> list[float]:
    """A scalar as a one-item list; a list as floats."""
    if isinstance(value, (list, tuple)):
        return [float(v) for v in value]
    return [float(value)]


def _scales(normalize: Mapping, variables: list[str], parts: list[int]) -> dict:
    """``normalize`` checked: per variable, ``mean`` and ``std`` as numbers,
    or lists of one per part (level) when the variable has several."""
    if not isinstance(normalize, Mapping):
        raise ValueError("normalize: expected True or {variable: {'mean': m, 'std': s}}")
    out = {}
    for name, n in zip(variables, parts):
        if name not in normalize:
            raise ValueError(f"normalize: no statistics for variable {name!r}")
        try:
            means, stds = _listed(normalize[name]["mean"]), _listed(normalize[name]["std"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"normalize: {name!r} needs numbers 'mean' and 'std'") from None
        if len(means) == 1 and n > 1:
            means, stds = means * n, stds * n
        if len(means) != n or len(stds) != n:
            raise ValueError(f"normalize: {name!r} has {n} channels per step, not {len(means)} means and {len(stds)} stds")
        out[name] = {"mean": means, "std": stds}
    return out


def _channels(raw: list) -> dict[str, list[dict]]:
    """Per role, its channels as dicts (a channel dimension's coordinate under its name)."""
    return {
        role: [{"variable": v, "step": step, **dict(at)} for v, step, at in channels] for role, channels in raw
    }


def _raw_loader(raw_windows: Any, arguments: dict, worker: tuple[int, int] | None = None) -> Any:
    """The engine's loader of ``arguments`` (``Windows.loader``'s, checked)."""
    a = dict(arguments)
    normalize = a.pop("normalize")
    scales = None
    if normalize is not None:
        scales = [list(zip(_listed(s["mean"]), _listed(s["std"]))) for s in normalize.values()]
    return raw_windows.loader(
        a["batch_size"], a["shuffle"], a["seed"], a["drop_last"], a["prefetch"], a["threads"], a["shard"],
        a["buffer_size"], worker, a["stack"] == "channels", scales,
    )


def _windows_key(description: dict) -> dict:
    """What makes the windows of a loader: store, variables, shape, rules, samples."""
    w = description["windows"]
    return {
        "path": description["path"],
        "variables": description["variables"],
        "dims": description["dims"],
        **{k: w.get(k) for k in ("input_dims", "input_overlap", "valid", "where", "history", "targets", "inputs", "jitter")},
    }


def _normalized(value: Any) -> Any:
    """Tuples as lists, dicts recursively: a state survives JSON."""
    if isinstance(value, (list, tuple)):
        return [_normalized(v) for v in value]
    if isinstance(value, dict):
        return {k: _normalized(v) for k, v in value.items()}
    return value


def _reopen_loader(
    description: dict, worker: tuple[int, int] | None, epoch: int, resume: tuple[int, int] | None
) -> WindowLoader:
    """A loader opened again from its description: session, store, windows
    (their index from the cache when the first process saved it), loader,
    with a DataLoader worker's share when ``worker`` is given."""
    from .context import SessionContext

    ctx = SessionContext(**description["session"])
    dataset = ctx.open_zarr(
        description["path"], variables=description["variables"], dims=description["dims"], **description["options"]
    )
    windows_arguments = dict(description["windows"])
    if worker is not None and windows_arguments.get("threads") is None:
        # The workers share the machine's cores: half of a worker's share
        # builds the index in the background, beside its loader's threads
        # (none on a few cores, where the blocks a worker's batches need
        # first are read faster without them).
        windows_arguments["threads"] = (os.cpu_count() or 1) // worker[1] // 2
    windows = dataset.windows(**windows_arguments)
    arguments = dict(description["loader"])
    if worker is None:
        loader = windows.loader(**arguments)
    else:
        if arguments["threads"] is None:
            # The workers share the machine's cores.
            arguments["threads"] = max(1, (os.cpu_count() or 1) // worker[1])
        raw = _raw_loader(windows._raw, arguments, tuple(worker))
        loader = WindowLoader(raw, {**windows._description, "loader": description["loader"]}, tuple(worker))
    loader.set_epoch(epoch)
    if resume is not None:
        loader._restore(*resume)
    return loader


__all__ = ["Dataset", "Windows", "WindowLoader"]

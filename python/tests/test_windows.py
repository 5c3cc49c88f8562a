"""The window loader against numpy: the same windows, the same counts,
reproducible shuffles, disjoint shards, clear argument errors."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import xarray as xr
from numpy.lib.stride_tricks import sliding_window_view

import zarrfusion as zf

SIZE = {"lat": 5, "lon": 4}


def arrays(store):
    ds = xr.open_zarr(store, chunks=None).load()
    return ds, ds.a.values, ds.b.values


def valid_origins(a, b, size, stride, min_fraction=None):
    """(t, i, j) of every window kept, by numpy (stride 1 views, then stepped)."""
    missing = np.isnan(a).astype(int) + np.isnan(b).astype(int)
    counts = sliding_window_view(missing, size, axis=(1, 2)).sum(axis=(-2, -1))
    counts = counts[:, :: stride[0], :: stride[1]]
    cells = 2 * size[0] * size[1]
    if min_fraction is None:
        keep = counts == 0
    else:
        keep = (cells - counts) >= min_fraction * cells
    t, i, j = np.nonzero(keep)
    return {(int(x), int(y) * stride[0], int(z) * stride[1]) for x, y, z in zip(t, i, j)}


def drain(loader):
    seen = []
    for batch in loader:
        idx = batch["index"]
        seen.extend(zip(idx["time"].tolist(), idx["lat"].tolist(), idx["lon"].tolist()))
    return seen


@pytest.mark.parametrize("overlap,valid", [({"lat": 4, "lon": 3}, "all"), ({"lat": 2, "lon": 0}, "all"), ({"lat": 4, "lon": 3}, 0.9), ({}, "any")])
def test_count_and_windows_equal_numpy(ctx, window_store, overlap, valid):
    ds, a, b = arrays(window_store)
    windows = ctx.open_zarr(window_store, variables=["a", "b"]).windows(SIZE, overlap, valid=valid)
    stride = (SIZE["lat"] - overlap.get("lat", 0), SIZE["lon"] - overlap.get("lon", 0))
    if valid == "any":
        t, i, j = np.meshgrid(
            np.arange(7), np.arange(0, 19 - 5 + 1, stride[0]), np.arange(0, 23 - 4 + 1, stride[1]), indexing="ij"
        )
        expected = set(zip(t.ravel().tolist(), i.ravel().tolist(), j.ravel().tolist()))
    else:
        expected = valid_origins(a, b, (5, 4), stride, None if valid == "all" else valid)
    assert len(windows) == len(expected)
    loader = windows.loader(batch_size=10, shuffle=None)
    assert len(loader) == -(-len(expected) // 10)
    count = 0
    for batch in loader:
        assert batch["a"].shape[1:] == (5, 4) and batch["a"].dtype == np.float32
        for k, (t, i, j) in enumerate(zip(batch["index"]["time"], batch["index"]["lat"], batch["index"]["lon"])):
            assert (t, i, j) in expected
            np.testing.assert_array_equal(batch["a"][k], a[t, i : i + 5, j : j + 4])
            np.testing.assert_array_equal(batch["b"][k], b[t, i : i + 5, j : j + 4])
            assert batch["coords"]["time"][k] == ds.time.values[t]
            assert batch["coords"]["lat"][k] == ds.lat.values[i]
            assert batch["coords"]["lon"][k] == ds.lon.values[j]
            count += 1
        if valid == "all":
            assert not np.isnan(batch["a"]).any() and not np.isnan(batch["b"]).any()
    assert count == len(expected)


def test_window_size_changes_need_no_rewrite(ctx, window_store):
    _, a, b = arrays(window_store)
    dataset = ctx.open_zarr(window_store)
    for size in (1, 3, 7):
        windows = dataset.windows({"lat": size, "lon": size}, {"lat": size - 1, "lon": size - 1})
        assert len(windows) == len(valid_origins(a, b, (size, size), (1, 1)))


def test_where_selects_by_coordinates(ctx, window_store):
    _, a, b = arrays(window_store)
    windows = ctx.open_zarr(window_store).windows(SIZE, {"lat": 4, "lon": 3}, where="time >= '2020-01-01T12:00:00' AND lat <= 30")
    # time index >= 2; lat (45 .. -45 step 5) <= 30 from index 3.
    sub_a, sub_b = a[2:, 3:], b[2:, 3:]
    assert len(windows) == len(valid_origins(sub_a, sub_b, (5, 4), (1, 1)))
    origins = drain(windows.loader(batch_size=64, shuffle=None))
    assert min(t for t, _, _ in origins) >= 2 and min(i for _, i, _ in origins) >= 3


@pytest.mark.parametrize("shuffle", ["block", "full"])
def test_shuffles_are_seeded_and_cover_every_window(ctx, window_store, shuffle):
    windows = ctx.open_zarr(window_store).windows(SIZE, {"lat": 4, "lon": 3})
    loader = windows.loader(batch_size=32, shuffle=shuffle, seed=3, buffer_size="20KB")
    first = drain(loader)
    again = drain(loader)
    assert first == again
    assert sorted(first) == sorted(drain(windows.loader(batch_size=32, shuffle=None)))
    assert len(set(first)) == len(first) == len(windows)
    loader.set_epoch(1)
    assert drain(loader) != first
    other_seed = windows.loader(batch_size=32, shuffle=shuffle, seed=4, buffer_size="20KB")
    assert drain(other_seed) != first
    assert first != sorted(first)


@pytest.mark.parametrize("shuffle", [None, "block"])
@pytest.mark.parametrize("drop_last", [False, True])
def test_loader_starts_before_the_index_is_complete(ctx, window_store, shuffle, drop_last):
    """threads=0: no background indexing, so before the first batch only the
    blocks in the loader's buffer are indexed; the batches are the same as
    from a complete index, and len() completes the index in the caller."""
    _, a, b = arrays(window_store)
    dataset = ctx.open_zarr(window_store)
    options = dict(input_dims=SIZE, input_overlap={"lat": 4, "lon": 3}, cache=False, threads=0, block_size=1)
    loader_options = dict(batch_size=8, shuffle=shuffle, seed=5, drop_last=drop_last, prefetch=1, buffer_size=1)

    early = dataset.windows(**options)
    assert "indexing" in repr(early)
    batches = iter(early.loader(**loader_options))
    first = next(batches)
    done, blocks = early.index_progress
    assert 0 < done < blocks
    early_batches = [first, *batches]

    complete = dataset.windows(**options)
    expected = valid_origins(a, b, (5, 4), (1, 1))
    assert len(complete) == len(expected)
    assert complete.index_progress == (blocks, blocks)
    assert len(early) == len(expected)
    complete_batches = list(complete.loader(**loader_options))
    assert len(early_batches) == len(complete_batches) == len(complete.loader(**loader_options))
    for x, y in zip(early_batches, complete_batches):
        for dim in ("time", "lat", "lon"):
            np.testing.assert_array_equal(x["index"][dim], y["index"][dim])
        np.testing.assert_array_equal(x["a"], y["a"])
    seen = [o for batch in early_batches for o in zip(*(batch["index"][d].tolist() for d in ("time", "lat", "lon")))]
    assert len(set(seen)) == len(seen)
    assert set(seen) <= expected
    assert len(seen) == (len(expected) // 8 * 8 if drop_last else len(expected))


@pytest.mark.parametrize("drop_last", [False, True])
def test_shards_and_workers_start_before_the_index_is_complete(ctx, window_store, drop_last):
    """threads=0: no background indexing. A rank's worker starts on its own
    blocks (with drop_last, once every stream's first blocks are indexed),
    and yields the same batches as from a complete index."""
    from zarrfusion.loader import _raw_loader

    dataset = ctx.open_zarr(window_store)
    options = dict(input_dims=SIZE, input_overlap={"lat": 4, "lon": 3}, cache=False, threads=0, block_size=1)
    loader_options = dict(batch_size=4, shuffle="block", seed=5, drop_last=drop_last, prefetch=1, threads=1,
                          buffer_size=1, shard=(1, 2), stack=None, normalize=None)

    # Worker 1 of 2 of rank 1 of 2, over these windows.
    early = dataset.windows(**options)
    batches = iter(_raw_loader(early._raw, loader_options, (1, 2)))
    first = next(batches)
    done, blocks = early.index_progress
    assert 0 < done < blocks
    early_batches = [first, *batches]

    complete = dataset.windows(**options)
    assert len(complete) > 0
    complete_batches = list(_raw_loader(complete._raw, loader_options, (1, 2)))
    assert len(early_batches) == len(complete_batches) > 1
    for x, y in zip(early_batches, complete_batches):
        for dim in ("time", "lat", "lon"):
            np.testing.assert_array_equal(x["index"][dim], y["index"][dim])


@pytest.mark.parametrize("shuffle", [None, "block", "full"])
@pytest.mark.parametrize("world", [2, 3])
def test_shards_are_disjoint_and_cover_everything(ctx, window_store, shuffle, world):
    windows = ctx.open_zarr(window_store).windows(SIZE, {"lat": 4, "lon": 3})
    seen = []
    for rank in range(world):
        loader = windows.loader(batch_size=16, shuffle=shuffle, seed=1, shard=(rank, world))
        loader.set_epoch(2)
        got = drain(loader)
        assert len(got) == loader.num_samples
        seen.extend(got)
    assert len(seen) == len(set(seen)) == len(windows)
    counts = set()
    for rank in range(world):
        loader = windows.loader(batch_size=16, shuffle=shuffle, seed=1, shard=(rank, world), drop_last=True)
        loader.set_epoch(2)
        batches = list(loader)
        assert all(len(b["index"]["lat"]) == 16 for b in batches)
        assert len(batches) == len(loader)
        counts.add(len(batches))
    # As many batches on every rank: the whole batches of the smallest share.
    if shuffle == "full":
        assert counts == {len(windows) // world // 16}
    else:
        shares = [windows.loader(batch_size=16, shuffle=shuffle, seed=1, shard=(r, world)) for r in range(world)]
        for share in shares:
            share.set_epoch(2)
        assert counts == {min(share.num_samples for share in shares) // 16}


def test_batches_are_numpy_arrays_shared_without_copy(ctx, window_store):
    windows = ctx.open_zarr(window_store, variables=["a"]).windows(SIZE, {"lat": 4, "lon": 3})
    batch = next(iter(windows.loader(batch_size=8, seed=0)))
    assert set(batch) == {"a", "coords", "index"}
    x = batch["a"]
    assert x.flags["C_CONTIGUOUS"] and x.flags["OWNDATA"] is False
    y = np.from_dlpack(x)
    assert np.shares_memory(x, y)
    assert batch["coords"]["time"].dtype.kind == "M"


def test_stats_count_batches_and_reads(ctx, window_store):
    windows = ctx.open_zarr(window_store).windows(SIZE, {"lat": 4, "lon": 3})
    loader = windows.loader(batch_size=50, seed=0, prefetch=2, threads=2)
    n = sum(1 for _ in loader)
    stats = loader.stats()
    assert stats["batches"] == n == len(loader)
    assert stats["samples"] == len(windows)
    assert stats["blocks_read"] > 0 and stats["bytes_read"] > 0
    assert stats["wait_time_s"] >= 0 and stats["decode_time_s"] > 0


def test_torch_iterable_dataset(ctx, window_store):
    torch = pytest.importorskip("torch")
    windows = ctx.open_zarr(window_store).windows(SIZE, {"lat": 4, "lon": 3})
    dataset = windows.loader(batch_size=16, seed=0).torch()
    assert isinstance(dataset, torch.utils.data.IterableDataset)
    batch = next(iter(torch.utils.data.DataLoader(dataset, batch_size=None)))
    assert batch["a"].shape == (16, 5, 4) and batch["a"].dtype == torch.float32
    # The same windows as the numpy batches; times as int64 nanoseconds.
    plain = next(iter(windows.loader(batch_size=16, seed=0)))
    np.testing.assert_array_equal(batch["a"].numpy(), plain["a"])
    assert batch["coords"]["time"].dtype == torch.int64
    np.testing.assert_array_equal(batch["coords"]["time"].numpy(), plain["coords"]["time"].astype("int64"))
    np.testing.assert_array_equal(batch["index"]["lat"].numpy(), plain["index"]["lat"])


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        ({"input_dims": {"lat": 5, "depth": 2}}, "input_dims"),
        ({"input_dims": {"lat": 20}}, "input_dims"),
        ({"input_dims": {"lat": 5}, "input_overlap": {"lat": 5}}, "input_overlap"),
        ({"input_dims": {"lat": 5}, "input_overlap": {"lon": 1}}, "input_overlap"),
        ({"input_dims": {"lat": 5}, "valid": "most"}, "valid"),
        ({"input_dims": {"lat": 5}, "valid": 1.5}, "valid"),
        ({"input_dims": {"lat": 5}, "where": "a > 0"}, "where"),
        ({"input_dims": {"lat": 5}, "where": "lat >"}, "where"),
    ],
)
def test_bad_window_arguments_name_the_argument(ctx, window_store, kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        ctx.open_zarr(window_store).windows(**kwargs)


def test_bad_loader_arguments_name_the_argument(ctx, window_store):
    with pytest.raises(ValueError, match="variables"):
        ctx.open_zarr(window_store, variables=["a", "nope"])
    windows = ctx.open_zarr(window_store).windows(SIZE)
    for kwargs, argument in [
        ({"batch_size": 0}, "batch_size"),
        ({"shuffle": "sometimes"}, "shuffle"),
        ({"shard": (2, 2)}, "shard"),
        ({"buffer_size": "huge"}, "buffer_size"),
        # Integers out of range: a ValueError naming the argument (was
        # pyo3's OverflowError naming nothing).
        ({"batch_size": -1}, "batch_size: must be an integer from 0 to 2\\^64 - 1, got -1"),
        ({"seed": 2**64}, "seed: must be an integer from 0 to 2\\^64 - 1"),
        ({"prefetch": -3}, "prefetch: must be"),
        ({"threads": -2}, "threads: must be"),
        ({"shard": (-1, 4)}, "shard: must be"),
        ({"shard": "0/4"}, "shard"),
    ]:
        with pytest.raises(ValueError, match=argument):
            windows.loader(**kwargs)
    with pytest.raises(TypeError, match="batch_size: expected an integer, got 1.5"):
        windows.loader(batch_size=1.5)
    with pytest.raises(ValueError, match="threads: must be"):
        ctx.open_zarr(window_store).windows(SIZE, threads=-1)
    # numpy's integers are integers.
    assert len(next(iter(windows.loader(batch_size=np.int64(4), seed=np.uint64(3))))["a"]) == 4


HOSTILE_NUMBERS = [2**64, 2**64 - 1, 2**63, 2**62, 2**31, -1, 0]


@pytest.mark.parametrize("n", HOSTILE_NUMBERS)
def test_absurd_sizes_and_counts_are_refused_or_bounded_never_a_crash(ctx, window_store, n):
    """Every size, count and position a user passes to the window API,
    from 0 and -1 to 2^64: refused with a Python exception naming what is
    wrong (ValueError; OverflowError where it does not fit the argument's
    integer type), or taken (a jitter or block size larger than the data is
    bounded by it); never a crash, a hang or an allocation of the size
    asked for (the loader's memory check refuses batches that large)."""
    import itertools

    ds = ctx.open_zarr(window_store)

    def first_batches(windows, **kwargs):
        loader = windows.loader(**kwargs)
        return sum(1 for _ in itertools.islice(loader, 2))

    attempts = [
        ("input_dims", lambda: len(ds.windows({"lat": n, "lon": 2}, cache=False))),
        ("input_overlap", lambda: len(ds.windows({"lat": 3, "lon": 2}, {"lat": n}, cache=False))),
        ("history", lambda: len(ds.windows({"lat": 3, "lon": 2}, history={"time": n}, cache=False))),
        ("jitter", lambda: len(ds.windows({"lat": 3, "lon": 2}, jitter={"lat": n}, cache=False))),
        ("block_size", lambda: len(ds.windows({"lat": 3, "lon": 2}, block_size=n, cache=False))),
        ("targets", lambda: len(ds.windows({"lat": 3, "lon": 2}, targets={"a": f"+{n}"}, cache=False))),
        ("batch_size", lambda: first_batches(ds.windows(SIZE, cache=False), batch_size=n)),
        ("prefetch", lambda: first_batches(ds.windows(SIZE, cache=False), prefetch=n)),
        ("seed", lambda: first_batches(ds.windows(SIZE, cache=False), seed=n)),
        ("threads", lambda: len(ds.windows({"lat": 3, "lon": 2}, threads=n, cache=False))),
        ("threads", lambda: first_batches(ds.windows(SIZE, cache=False), threads=n)),
        ("shard", lambda: first_batches(ds.windows(SIZE, cache=False), shard=(n, 4))),
        ("shard", lambda: first_batches(ds.windows(SIZE, cache=False), shard=(0, n))),
    ]
    for argument, attempt in attempts:
        try:
            attempt()
        except OverflowError:
            assert n < 0 or n >= 2**63, (argument, n)
        except ValueError as e:
            assert argument in str(e) or "allowed_mem" in str(e), (argument, n, str(e))
    loader = ds.windows(SIZE, cache=False).loader()
    state = loader.state_dict()
    for key in ("epoch", "batches"):
        resumed = ds.windows(SIZE, cache=False).loader()
        try:
            resumed.load_state_dict({**state, key: n})
            sum(1 for _ in itertools.islice(resumed, 2))
        except OverflowError:
            assert n < 0 or n >= 2**63, (key, n)
        except ValueError as e:
            assert "load_state_dict" in str(e), (key, n, str(e))


def test_corrupt_chunk_is_an_error_naming_it(ctx, fixtures):
    windows_of = ctx.open_zarr(fixtures / "bad_corrupt_chunk.zarr")
    with pytest.raises(zf.ZarrFusionError, match="chunk"):
        windows = windows_of.windows({windows_of.dims[-1]: 1})
        list(windows.loader(batch_size=4, shuffle=None))


def test_index_cache_is_reused_and_invalidated_by_a_rewrite(ctx, window_store, tmp_path):
    import shutil

    import zarr

    store = tmp_path / "copy.zarr"
    shutil.copytree(window_store, store)
    cache = tmp_path / "cache"
    overlap = {"lat": 4, "lon": 3}

    def open_windows(**kwargs):
        kwargs.setdefault("cache", cache)
        return zf.SessionContext().open_zarr(store).windows(SIZE, overlap, **kwargs)

    first = open_windows()
    assert first.index_source == "built" and first.index_seconds > 0
    again = open_windows()
    assert again.index_source == "cache" and again.index_seconds == 0
    assert len(again) == len(first)
    assert drain(again.loader(batch_size=7, shuffle=None)) == drain(first.loader(batch_size=7, shuffle=None))
    assert open_windows(cache=False).index_source == "built"
    # Another rule or window shape is another index.
    assert open_windows(valid=0.9).index_source == "built"
    # Rewriting one chunk invalidates the cached index.
    group = zarr.open_group(str(store), mode="r+")
    group["a"][1, 8:12, 8:12] = np.nan
    rebuilt = open_windows()
    assert rebuilt.index_source == "built"
    _, a, b = arrays(store)
    assert len(rebuilt) == len(valid_origins(a, b, (5, 4), (1, 1))) < len(first)
    # A corrupt cache file is a miss, not an error.
    for f in cache.iterdir():
        f.write_bytes(f.read_bytes()[:20])
    damaged = open_windows()
    assert damaged.index_source == "built" and len(damaged) == len(rebuilt)


SHARED_CHILD = """
import json, pathlib, sys, time
import zarrfusion as zf
store, options, cache, session, threads, ready, go = sys.argv[1:8]
dataset = zf.SessionContext(**json.loads(session)).open_zarr(store, **json.loads(options))
pathlib.Path(ready).touch()
while not pathlib.Path(go).exists():
    time.sleep(0.001)
w = dataset.windows({"lat": 5, "lon": 4}, {"lat": 4, "lon": 3}, cache=cache, threads=int(threads), block_size=1)
n = len(w)
print(json.dumps({"len": n, **w.index_counts}))
"""


def index_in_two_processes(
    store, cache, local_store, tmp_path, options=None, session=None, threads=0
) -> list[dict]:
    """Builds the (5, 4) windows' index of ``store`` in two processes at
    once with ``cache`` (``options`` opening the store, ``session`` the
    arguments of their sessions, ``threads`` index threads each), checks
    that they read each block once between them and both count numpy's
    windows (of ``local_store``, its copy on disk), and returns their
    ``index_counts``."""
    import json
    import subprocess
    import sys
    import time

    _, a, b = arrays(local_store)
    expected = len(valid_origins(a, b, (5, 4), (1, 1)))
    go = tmp_path / "go"
    ready = [tmp_path / f"ready{k}" for k in range(2)]
    arguments = [str(store), json.dumps(options or {}), str(cache), json.dumps(session or {}), str(threads)]
    argv = [sys.executable, "-c", SHARED_CHILD, *arguments]
    children = [subprocess.Popen([*argv, str(r), str(go)], stdout=subprocess.PIPE, text=True) for r in ready]
    try:
        deadline = time.monotonic() + 60
        while not all(r.exists() for r in ready):
            assert time.monotonic() < deadline and all(c.poll() is None for c in children)
            time.sleep(0.01)
        go.touch()
        results = [json.loads(c.communicate(timeout=120)[0]) for c in children]
    finally:
        for c in children:
            c.kill()
    blocks = results[0]["blocks"]
    assert blocks > 20, results
    for r in results:
        assert r["len"] == expected and r["indexed"] == blocks, results
        assert r["read"] + r["from_other_processes"] == blocks, results
    # Every block read once in all (each process alone would read all).
    assert sum(r["read"] for r in results) == blocks, results
    return results


def test_processes_building_one_index_share_its_blocks(window_store, tmp_path):
    """Two processes building the same index with the same cache directory
    (as DataLoader workers and ranks on one machine do) read each block
    once between them, and both get the whole index, equal to numpy's."""
    cache = tmp_path / "cache"
    index_in_two_processes(window_store, cache, window_store, tmp_path)
    # The finished index is in the cache, and nothing else is left there.
    assert [p.suffix for p in cache.iterdir()] == [".idx"]


def test_a_killed_process_s_claims_are_taken_over(window_store, tmp_path):
    """Blocks left claimed by a process that is gone (killed while reading)
    are read by the next process instead of waited for, and blocks an
    unfinished build wrote are reused."""
    import gc
    import json
    import subprocess
    import sys
    import threading
    import time

    cache = tmp_path / "cache"

    def open_windows():
        return zf.SessionContext().open_zarr(window_store).windows(
            SIZE, {"lat": 4, "lon": 3}, cache=cache, threads=0, block_size=1
        )

    # An unfinished build: one batch, then the windows are dropped.
    first = open_windows()
    batches = iter(first.loader(batch_size=2, shuffle=None, prefetch=1))
    next(batches)
    blocks = first.index_counts["blocks"]
    del batches, first
    gc.collect()
    (shared,) = cache.glob("*.blocks")
    listing = None
    while listing != sorted(shared.iterdir()):  # until the loader's threads are done
        listing = sorted(shared.iterdir())
        time.sleep(0.2)
    written = {p.stem for p in shared.glob("*.block")}
    assert written and not list(shared.glob("*.claim.*"))
    # Every other block claimed by a process of this machine that is gone.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    boot = pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    host = "".join(c if c.isalnum() else "_" for c in pathlib.Path("/proc/sys/kernel/hostname").read_text().strip())
    for k in range(blocks):
        if str(k) not in written:
            (shared / f"{k}.claim").write_text(json.dumps({"pid": gone.pid, "host": host, "boot": boot, "nonce": "x"}))
    again = open_windows()
    counts = {}
    thread = threading.Thread(target=lambda: counts.update(len=len(again), **again.index_counts), daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "waited for a process that is gone"
    _, a, b = arrays(window_store)
    assert counts["len"] == len(valid_origins(a, b, (5, 4), (1, 1)))
    assert counts["from_other_processes"] == len(written)
    assert counts["read"] == blocks - len(written)


@pytest.mark.parametrize("shuffle", [None, "block", "full"])
@pytest.mark.parametrize("shard", [None, (1, 3)])
def test_resume_continues_the_epoch_exactly(ctx, window_store, shuffle, shard):
    """A loader restored from ``state_dict()`` mid-epoch yields exactly the
    batches an uninterrupted run yields after that point, then the next
    epoch as usual."""
    import pickle

    windows = ctx.open_zarr(window_store).windows(SIZE, {"lat": 4, "lon": 3})
    options = dict(batch_size=9, shuffle=shuffle, seed=11, shard=shard, buffer_size="20KB")
    whole = windows.loader(**options)
    whole.set_epoch(3)
    uninterrupted = [batch["index"] for batch in whole]
    assert len(uninterrupted) > 4

    first = windows.loader(**options)
    first.set_epoch(3)
    consumed = []
    for batch in first:
        consumed.append(batch["index"])
        if len(consumed) == 4:
            break
    state = pickle.loads(pickle.dumps(first.state_dict()))
    assert state["epoch"] == 3 and state["batches"] == 4

    resumed = windows.loader(**options)
    resumed.load_state_dict(state)
    assert resumed.epoch == 3
    rest = [batch["index"] for batch in resumed]
    assert len(consumed) + len(rest) == len(uninterrupted)
    for got, want in zip(consumed + rest, uninterrupted):
        for dim in ("time", "lat", "lon"):
            np.testing.assert_array_equal(got[dim], want[dim])
    # Resuming is for one iteration: the next starts the epoch afresh.
    assert len(drain(resumed)) == whole.num_samples


def test_an_absurd_world_size_is_refused_naming_shard(ctx, window_store):
    """Every rank and worker is a stream the loader keeps a count of: a
    world size beyond a million streams is an error, not an allocation."""
    windows = ctx.open_zarr(window_store).windows(SIZE, {"lat": 4, "lon": 3})
    with pytest.raises(ValueError, match="shard"):
        windows.loader(batch_size=8, shard=(0, 10**15), drop_last=True)
    loader = windows.loader(batch_size=8, shard=(0, 2**20), drop_last=True)
    with pytest.raises(ValueError, match="workers"):
        loader._raw.resume_workers(0, 0, 2)


def test_a_state_of_other_options_is_refused_naming_them(ctx, window_store):
    windows = ctx.open_zarr(window_store).windows(SIZE, {"lat": 4, "lon": 3})
    state = windows.loader(batch_size=16, seed=1).state_dict()
    for kwargs, argument in [
        ({"batch_size": 8, "seed": 1}, "batch_size"),
        ({"batch_size": 16, "seed": 2}, "seed"),
        ({"batch_size": 16, "seed": 1, "shuffle": "full"}, "shuffle"),
        ({"batch_size": 16, "seed": 1, "shard": (0, 2)}, "shard"),
    ]:
        with pytest.raises(ValueError, match=argument):
            windows.loader(**kwargs).load_state_dict(state)
    with pytest.raises(ValueError, match="batches"):
        windows.loader(batch_size=16, seed=1).load_state_dict({**state, "batches": -1})


def test_a_loader_pickles_by_its_description(ctx, window_store):
    """Pickled (as DataLoader workers started by spawn receive it), a loader
    reopens its store and yields the same batches."""
    import pickle

    windows = ctx.open_zarr(window_store, variables=["a"]).windows(SIZE, {"lat": 4, "lon": 3})
    loader = windows.loader(batch_size=10, seed=4)
    copy = pickle.loads(pickle.dumps(loader))
    assert drain(copy) == drain(loader)
    assert copy.batch_size == 10


def _dataloader_windows(dataset, workers, context, **kwargs):
    import torch

    loader = torch.utils.data.DataLoader(
        dataset, batch_size=None, num_workers=workers, multiprocessing_context=context if workers else None, **kwargs
    )
    seen = []
    for batch in loader:
        idx = batch["index"]
        seen.append(list(zip(idx["time"].tolist(), idx["lat"].tolist(), idx["lon"].tolist())))
    return seen


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
@pytest.mark.parametrize("shuffle", ["block", "full"])
def test_dataloader_workers_split_the_windows(ctx, window_store, context, shuffle):
    """Real DataLoader worker processes: together they yield every window
    once (none yields another's), with the batch sizes of one loader."""
    pytest.importorskip("torch")
    _, a, b = arrays(window_store)
    expected = valid_origins(a, b, (5, 4), (1, 1))
    windows = ctx.open_zarr(window_store).windows(SIZE, {"lat": 4, "lon": 3})
    loader = windows.loader(batch_size=16, shuffle=shuffle, seed=2)
    batches = _dataloader_windows(loader.torch(), 3, context)
    seen = [w for batch in batches for w in batch]
    assert len(seen) == len(set(seen)) == len(expected)
    assert set(seen) == expected
    if shuffle == "full":
        # Runs of whole batches of one sequence: as one loader's batches.
        assert len(batches) == len(loader) and all(len(batch) == 16 for batch in batches[:-1])
    else:
        # A stream per worker, each ending in its own short batch.
        streams = [loader._for_worker(w, 3) for w in range(3)]
        assert len(batches) == sum(len(stream) for stream in streams)
        assert sum(len(batch) < 16 for batch in batches) <= 3


def test_a_forked_dataloader_worker_says_to_use_spawn(ctx, window_store):
    """fork() copies the loader but not its threads: the worker raises an
    error naming the way out instead of waiting forever."""
    pytest.importorskip("torch")
    windows = ctx.open_zarr(window_store).windows(SIZE, {"lat": 4, "lon": 3})
    with pytest.raises(RuntimeError, match="spawn"):
        _dataloader_windows(windows.loader(batch_size=16).torch(), 2, "fork")


def test_dataloader_workers_and_ranks_are_disjoint_complete_and_equal(ctx, window_store):
    """Two ranks of two workers each, drop_last: every rank yields the same
    number of full batches, and no window comes twice."""
    pytest.importorskip("torch")
    windows = ctx.open_zarr(window_store).windows(SIZE, {"lat": 4, "lon": 3})
    # Each worker of each rank is a stream; without drop_last the streams
    # hold every window once; with it each yields the whole batches the
    # fewest-windowed stream fills, a prefix of its windows.
    streams = {}
    for rank in range(2):
        whole = windows.loader(batch_size=8, seed=2, shard=(rank, 2))
        for worker in range(2):
            streams[rank, worker] = drain(whole._for_worker(worker, 2))
    everything = [w for stream in streams.values() for w in stream]
    assert len(everything) == len(set(everything)) == len(windows)
    quota = min(len(stream) for stream in streams.values()) // 8
    assert quota > 0
    counts, seen = set(), []
    for rank in range(2):
        loader = windows.loader(batch_size=8, seed=2, shard=(rank, 2), drop_last=True)
        for worker in range(2):
            assert drain(loader._for_worker(worker, 2)) == streams[rank, worker][: quota * 8]
        batches = _dataloader_windows(loader.torch(), 2, "spawn")
        counts.add(len(batches))
        assert all(len(batch) == 8 for batch in batches)
        seen.extend(w for batch in batches for w in batch)
    assert counts == {2 * quota}
    assert len(seen) == len(set(seen)) == 4 * quota * 8


@pytest.mark.parametrize("drop_last", [False, True])
def test_dataloader_resumes_under_workers(ctx, window_store, drop_last):
    """Consume some batches through workers, save the state with the count
    consumed, restore it in a new loader: the workers yield the rest of the
    epoch exactly, also past the end of a worker's stream."""
    pytest.importorskip("torch")
    windows = ctx.open_zarr(window_store).windows(SIZE, {"lat": 4, "lon": 3})
    options = dict(batch_size=7, seed=9, shuffle="block", drop_last=drop_last)
    uninterrupted = _dataloader_windows(windows.loader(**options).torch(), 3, "spawn")
    for consumed in (5, len(uninterrupted) - 2):
        state = windows.loader(**options).state_dict(batches=consumed)
        resumed = windows.loader(**options)
        resumed.load_state_dict(state)
        rest = _dataloader_windows(resumed.torch(), 3, "spawn")
        assert rest == uninterrupted[consumed:]


def _rank_windows(rank, world, port, store, out):
    """One rank of test_shard_auto_takes_the_rank_of_torch_distributed."""
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        windows = zf.SessionContext().open_zarr(store).windows(SIZE, {"lat": 4, "lon": 3})
        loader = windows.loader(batch_size=8, seed=3, shard="auto", drop_last=True)
        with open(out / f"rank{rank}.json", "w") as f:
            json.dump({"batches": len(loader), "windows": drain(loader)}, f)
    finally:
        dist.destroy_process_group()


def test_shard_auto_takes_the_rank_of_torch_distributed(window_store, tmp_path):
    """Two real torch.distributed ranks (gloo on 127.0.0.1) with
    shard="auto": disjoint shares, as many batches each."""
    import json
    import socket

    torch = pytest.importorskip("torch")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_rank_windows, args=(2, port, window_store, tmp_path), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["batches"] == ranks[1]["batches"] > 0
    seen = [tuple(w) for r in ranks for w in r["windows"]]
    assert len(seen) == len(set(seen)) == 2 * ranks[0]["batches"] * 8
    windows = zf.SessionContext().open_zarr(window_store).windows(SIZE, {"lat": 4, "lon": 3})
    fewest = min(windows.loader(batch_size=8, seed=3, shard=(r, 2)).num_samples for r in range(2))
    assert len(seen) == fewest // 8 * 8 * 2
    # Without torch.distributed initialized, "auto" is the whole.
    assert len(windows.loader(batch_size=8, shard="auto")) == len(windows.loader(batch_size=8))


def test_dataloader_pins_batches_when_asked(ctx, window_store):
    """pin_memory=True: the batches arrive in page-locked memory, equal to
    the loader's (needs a CUDA device; skipped without one)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device to pin memory for")
    windows = ctx.open_zarr(window_store).windows(SIZE, {"lat": 4, "lon": 3})
    loader = windows.loader(batch_size=16, seed=0)
    dataloader = torch.utils.data.DataLoader(
        loader.torch(), batch_size=None, num_workers=2, multiprocessing_context="spawn", pin_memory=True
    )
    batches = list(dataloader)
    assert all(b["a"].is_pinned() and b["index"]["lat"].is_pinned() for b in batches)
    plain = list(windows.loader(batch_size=16, seed=0).torch())
    assert len(batches) == len(plain) == len(loader)
    seen = {w for b in batches for w in zip(*(b["index"][d].tolist() for d in ("time", "lat", "lon")))}
    assert seen == {w for b in plain for w in zip(*(b["index"][d].tolist() for d in ("time", "lat", "lon")))}


def test_where_on_a_dimension_of_a_trillion_positions(trillion_store):
    """Over a dimension longer than 2^26 positions ``where`` takes
    comparisons with literals (selected at once, however long the
    dimension); any other condition is refused saying why."""
    ds = zf.SessionContext().open_zarr(trillion_store)
    windows = ds.windows({"x": 10}, where="x >= 999999999900", cache=False)
    # Windows of 10 every 10 positions (no overlap) over the last 100.
    assert len(windows) == 10
    batch = next(iter(windows.loader(batch_size=100, shuffle=None)))
    assert sorted(batch["index"]["x"].tolist()) == list(range(999999999900, 10**12, 10))
    with pytest.raises(ValueError, match=r"where.*x % Int64\(7\) = Int64\(3\).*'x' has 1000000000000 positions.*comparisons with literals"):
        ds.windows({"x": 10}, where="x % 7 = 3", cache=False)

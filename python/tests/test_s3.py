"""Stores in a real S3 server (moto's, on 127.0.0.1, with a fault-injecting
proxy in front: tests/s3/s3_server.py) answer exactly as the same stores on
disk; transient faults are retried to the same answers, exhausted retries
fail naming store, array, chunk key and HTTP status, and latency is hidden
by reading ahead."""

from __future__ import annotations

import json
import pathlib
import sys
import time

import numpy as np
import pytest

import zarrfusion as zf

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "s3"))
import s3_server  # noqa: E402
from conftest import FIXTURES  # noqa: E402

STORES = [
    "v2_basic.zarr",
    "v3_basic.zarr",
    "codec_v3_zstd.zarr",
    "codec_v2_blosc_lz4.zarr",
    "codec_v2_zlib.zarr",
    "cf_packed.zarr",
    "cf_packed_v3.zarr",
    "raw_v3.zarr",
    "raw_v2.zarr",
    "nan_holes.zarr",
    "codec_v3_sharded_unwritten.zarr",
]
# Retries come fast in the tests.
FAST_RETRIES = {"retry.backoff.init_backoff": "5ms", "retry.backoff.max_backoff": "20ms"}


def grid(seed: int):
    """t(time 8, lat 48, lon 64) of random float32 values."""
    import xarray as xr

    rng = np.random.default_rng(seed)
    return xr.Dataset(
        {"t": (("time", "lat", "lon"), rng.normal(size=(8, 48, 64)).astype("float32"))},
        coords={
            "time": np.arange(8),
            "lat": np.linspace(60.0, -60.0, 48),
            "lon": np.arange(64) * 1.0,
        },
    )


@pytest.fixture(scope="module")
def many_store(tmp_path_factory) -> pathlib.Path:
    """A store of 64 chunks, written by xarray."""
    many = tmp_path_factory.mktemp("s3") / "many.zarr"
    grid(3).to_zarr(many, encoding={"t": {"chunks": (2, 12, 16)}}, consolidated=True, zarr_format=2)
    return many


@pytest.fixture(scope="module")
def sharded_store(tmp_path_factory) -> pathlib.Path:
    """A Zarr v3 store of 16 shards (2, 24, 32), each of 8 inner chunks
    (1, 12, 16), written by xarray."""
    sharded = tmp_path_factory.mktemp("s3") / "sharded.zarr"
    encoding = {"t": {"chunks": (1, 12, 16), "shards": (2, 24, 32)}}
    grid(5).to_zarr(sharded, encoding=encoding, consolidated=False, zarr_format=3)
    return sharded


@pytest.fixture(scope="module")
def holes_store(tmp_path_factory) -> pathlib.Path:
    """t(time 24, lat 48, lon 64) in 192 chunks (2, 12, 16), a tenth of the
    values missing, written by xarray."""
    holes = tmp_path_factory.mktemp("s3") / "holes.zarr"
    ds = grid(11)
    ds = ds.isel(time=np.arange(24) % 8).assign_coords(time=np.arange(24))
    rng = np.random.default_rng(11)
    ds["t"] = ds.t.where(rng.random(ds.t.shape) > 0.1)
    ds.to_zarr(holes, encoding={"t": {"chunks": (2, 12, 16)}}, consolidated=True, zarr_format=2)
    return holes


@pytest.fixture(scope="module")
def steps_store(tmp_path_factory) -> pathlib.Path:
    """a and b (time 40, lat 19, lon 23), a chunk per time step, some
    values missing, written by xarray: blocks of windows over lat and lon
    read chunks no other block reads."""
    import xarray as xr

    rng = np.random.default_rng(40)
    shape = (40, 19, 23)
    values = {}
    for name in ("a", "b"):
        v = rng.normal(size=shape).astype("float32")
        v[rng.random(shape) < 0.01] = np.nan
        values[name] = (("time", "lat", "lon"), v)
    ds = xr.Dataset(values, coords={"time": np.arange(40), "lat": np.arange(19.0), "lon": np.arange(23.0)})
    path = tmp_path_factory.mktemp("s3") / "steps.zarr"
    ds.to_zarr(path, encoding={v: {"chunks": (1, 19, 23)} for v in ("a", "b")}, zarr_format=3)
    return path


@pytest.fixture(scope="module")
def s3(many_store, sharded_store, holes_store):
    """The server, with the fixture stores, the 'many chunks' store, the
    sharded one and one with holes."""
    uploads = {name: FIXTURES / name for name in STORES}
    uploads["many.zarr"] = many_store
    uploads["sharded.zarr"] = sharded_store
    uploads["holes.zarr"] = holes_store
    server = s3_server.start(uploads, bucket="fixtures")
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def quiet_proxy(s3):
    s3.proxy.configure()
    s3.proxy.reset()


def rows(ctx: zf.SessionContext, location: str, options: dict, sql: str) -> list[tuple]:
    ctx.register_zarr("t", location, **options)
    table = ctx.sql(sql).to_arrow_table()
    ctx.deregister_table("t")
    return [tuple(r.values()) for r in table.to_pylist()]


def same(a: list[tuple], b: list[tuple]) -> bool:
    """Equal rows, NaN equal to NaN."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            if isinstance(u, float) and isinstance(v, float) and np.isnan(u) and np.isnan(v):
                continue
            if u != v:
                return False
    return True


def queries(fixtures: pathlib.Path, store: str) -> list[str]:
    """A full ordered scan, a reduction over the first dimension and a
    filtered scan of the store's table, whose dimensions and columns the
    xarray oracle of the Rust tests lists."""
    oracle = sorted((fixtures.parent / "expected").glob(f"{store.removesuffix('.zarr')}__*.json"))[0]
    expected = json.loads(oracle.read_text())
    dims = [f'"{d}"' for d in expected["dims"]]
    value = next(f'"{c["name"]}"' for c in expected["columns"] if c["name"] not in expected["dims"])
    order, first = ", ".join(dims), dims[0]
    return [
        f"SELECT * FROM t ORDER BY {order}",
        f"SELECT {first}, avg({value}) AS m, count({value}) AS n FROM t GROUP BY {first} ORDER BY {first}",
        f"SELECT * FROM t WHERE {first} > (SELECT min({first}) FROM t) ORDER BY {order} LIMIT 7",
    ]


@pytest.mark.parametrize("store", STORES)
def test_stores_in_s3_answer_as_on_disk(s3, fixtures, store):
    ctx = zf.SessionContext()
    for sql in queries(fixtures, store):
        want = rows(ctx, str(fixtures / store), {}, sql)
        assert want, sql
        got = rows(ctx, f"s3://fixtures/{store}", s3.options(), sql)
        assert same(got, want), f"{store}: {sql}"
    assert s3.proxy.stats()["requests"] > 0


def test_an_s3_store_equals_xarray(s3, fixtures):
    import xarray as xr

    ctx = zf.SessionContext()
    ctx.register_zarr("t", "s3://fixtures/v3_basic.zarr", **s3.options())
    got = ctx.sql("SELECT lat, avg(t2m) AS m FROM t GROUP BY lat ORDER BY lat").to_pandas()
    want = xr.open_zarr(fixtures / "v3_basic.zarr").t2m.mean(["time", "lon"]).sortby("lat")
    np.testing.assert_allclose(got["m"].to_numpy(), want.to_numpy(), rtol=1e-6)


@pytest.mark.parametrize("fault", ["500", "503", "429", "reset", "truncate"])
def test_transient_faults_are_retried_to_the_same_answer(s3, fixtures, fault):
    ctx = zf.SessionContext()
    sql = "SELECT * FROM t ORDER BY time, lat, lon"
    want = rows(ctx, str(fixtures / "v3_basic.zarr"), {}, sql)
    s3.proxy.configure(fault=fault, first_n=2)
    got = rows(ctx, "s3://fixtures/v3_basic.zarr", s3.options(**FAST_RETRIES), sql)
    assert same(got, want)
    stats = s3.proxy.stats()
    # Every object read was refused twice first.
    assert stats["faults"].get(fault, 0) >= 2 * 8, stats


def test_the_proxy_link_carries_the_answers_at_its_bandwidth(s3):
    """The fault proxy's link (the benchmarks' slow network,
    ``bandwidth_mb_s``): the answers in flight share it, so a query takes
    at least the bytes sent over the bandwidth, and its answer is the one
    without a limit."""
    query = "SELECT lat, avg(t2m) AS m FROM t GROUP BY lat ORDER BY lat"
    ctx = zf.SessionContext()
    ctx.register_zarr("t", "s3://fixtures/v2_basic.zarr", **s3.options())
    want = ctx.sql(query).to_pandas()
    rate = 2e3
    s3.proxy.configure(bandwidth_mb_s=rate / 1e6)
    s3.proxy.reset()
    try:
        start = time.perf_counter()
        got = ctx.sql(query).to_pandas()
        elapsed = time.perf_counter() - start
    finally:
        s3.proxy.configure()
    sent = s3.proxy.stats()["bytes"]
    assert sent > 500, sent
    assert elapsed >= 0.95 * sent / rate, (elapsed, sent)
    assert got.equals(want)
    with pytest.raises(ValueError, match="bandwidth_mb_s"):
        s3.proxy.configure(bandwidth_mb_s=-1)


@pytest.mark.parametrize("fault", ["503", "429", "reset"])
def test_network_stats_count_every_request_and_retried_error(s3, fault):
    """zf.network_stats() counts what the proxy saw: every request sent,
    retries included, and every answer the client retried."""
    ctx = zf.SessionContext()
    s3.proxy.configure(fault=fault, first_n=1)
    before = zf.network_stats()
    ctx.register_zarr("t", "s3://fixtures/v2_basic.zarr", **s3.options(**FAST_RETRIES))
    ctx.sql("SELECT lat, avg(t2m) FROM t GROUP BY lat").collect()
    after = zf.network_stats()
    stats = s3.proxy.stats()
    assert stats["faults"][fault] > 0, stats
    assert after["requests"] - before["requests"] == stats["requests"], (before, after, stats)
    assert after["errors"] - before["errors"] == stats["faults"][fault], (before, after, stats)


def test_exhausted_retries_fail_naming_store_array_chunk_and_status(s3):
    ctx = zf.SessionContext()
    s3.proxy.configure(fault="503", match=r"/t2m/c/0/1/0$")
    options = s3.options(**FAST_RETRIES, **{"retry.max_retries": "2"})
    ctx.register_zarr("t", "s3://fixtures/v3_basic.zarr", **options)
    start = time.monotonic()
    with pytest.raises(zf.ZarrDataError) as failure:
        ctx.sql("SELECT sum(t2m) FROM t").to_arrow_table()
    assert time.monotonic() - start < 20
    message = str(failure.value)
    for part in ["s3://fixtures/v3_basic.zarr", "t2m", "t2m/c/0/1/0", "503", "after 2 retries"]:
        assert part in message, message
    e = failure.value
    assert isinstance(e, OSError) and (e.store, e.array, e.key) == ("s3://fixtures/v3_basic.zarr", "t2m", "t2m/c/0/1/0")
    # The first attempt and two retries, nothing more.
    assert s3.proxy.stats()["faults"]["503"] == 3


def on_demand_and_ahead(s3, location: str, sql: str) -> tuple[dict, dict]:
    """``sql`` over the table at ``location``, at 30 ms a request, reading on
    demand (io_concurrency 0) and ahead (32): the answers (pandas) and the
    (seconds, proxy statistics) of each, by io_concurrency."""
    answers, stats = {}, {}
    for concurrency in (0, 32):
        ctx = zf.SessionContext(io_concurrency=concurrency, target_partitions=2)
        ctx.register_zarr("t", location, **s3.options())
        s3.proxy.configure(latency_ms=30)
        s3.proxy.reset()
        start = time.monotonic()
        answers[concurrency] = ctx.sql(sql).to_pandas()
        stats[concurrency] = (time.monotonic() - start, s3.proxy.stats())
    return answers, stats


def test_reads_run_ahead_of_the_decoder_one_get_per_chunk(s3):
    """64 chunks at 30 ms a request: read ahead, many requests are in flight
    at once and each chunk is one GET (no HEAD); reading on demand, at most
    a decode thread's worth are."""
    sql = "SELECT lat, avg(t) AS m FROM t GROUP BY lat ORDER BY lat"
    answers, stats = on_demand_and_ahead(s3, "s3://fixtures/many.zarr", sql)
    assert answers[0].equals(answers[32])
    ahead = stats[32][1]
    assert ahead["methods"] == {"GET": 64}, ahead
    assert ahead["max_in_flight"] >= 16, ahead
    assert stats[0][1]["max_in_flight"] <= 4, stats[0]
    assert stats[32][0] < stats[0][0], stats


@pytest.mark.parametrize(
    "where, shards",
    [
        # Every shard whole: one GET each.
        ("", 16),
        # Three quarters of the lat rows of the first shard row (lat > 15:
        # 18 of its 24): those 8 shards are fetched whole, once each, and
        # their index and inner chunks cut out of that one answer.
        ("WHERE lat > 15", 8),
    ],
)
def test_shards_are_read_ahead_whole_one_get_each(s3, sharded_store, where, shards):
    """A sharded store from the bucket at 30 ms a request: the shards a
    query covers at least half of are requested ahead of the decoder, many
    at once, each with one GET (not its index and then its inner chunks),
    and the answers are xarray's."""
    import xarray as xr

    sql = f"SELECT lat, avg(t) AS m, count(t) AS n FROM t {where} GROUP BY lat ORDER BY lat"
    answers, stats = on_demand_and_ahead(s3, "s3://fixtures/sharded.zarr", sql)
    ahead = stats[32][1]
    assert ahead["methods"] == {"GET": shards}, ahead
    assert ahead["max_in_flight"] >= min(shards, 8), ahead
    assert stats[32][0] < stats[0][0], stats
    t = xr.open_zarr(sharded_store, consolidated=False).t
    if where:
        t = t.where(t.lat > 15, drop=True)
    want = t.mean(["time", "lon"]).sortby("lat")
    for got in answers.values():
        np.testing.assert_allclose(got["lat"].to_numpy(), want.lat.to_numpy())
        np.testing.assert_allclose(got["m"].to_numpy(), want.to_numpy(), rtol=1e-5, atol=1e-6)
        assert (got["n"] == 8 * 64).all()


def test_a_small_part_of_each_shard_is_read_by_ranges(s3, sharded_store):
    """A box covering little of each shard it touches reads that shard's
    index and the inner chunks it needs by ranges, not the whole shard:
    fewer bytes than the shards hold, the answer xarray's."""
    import xarray as xr

    ctx = zf.SessionContext(io_concurrency=32)
    ctx.register_zarr("t", "s3://fixtures/sharded.zarr", **s3.options())
    s3.proxy.reset()
    sql = "SELECT time, avg(t) AS m FROM t WHERE lat > 50 AND lon < 10 GROUP BY time ORDER BY time"
    got = ctx.sql(sql).to_pandas()
    stats = s3.proxy.stats()
    shard_bytes = sum(
        p.stat().st_size for p in (sharded_store / "t" / "c").rglob("*") if p.is_file()
    )
    assert 0 < stats["bytes"] < shard_bytes / 8, (stats, shard_bytes)
    t = xr.open_zarr(sharded_store, consolidated=False).t
    want = t.where((t.lat > 50) & (t.lon < 10), drop=True).mean(["lat", "lon"])
    np.testing.assert_allclose(got["m"].to_numpy(), want.to_numpy(), rtol=1e-5, atol=1e-6)


def test_explain_shows_the_read_ahead(s3, fixtures):
    ctx = zf.SessionContext(io_concurrency=16)
    ctx.register_zarr("t", "s3://fixtures/many.zarr", **s3.options())
    plan = ctx.sql("EXPLAIN SELECT lat, avg(t) FROM t GROUP BY lat").to_pandas().to_string()
    assert "16 reads in flight" in plan, plan
    ctx.register_zarr("local", str(fixtures / "v3_basic.zarr"))
    plan = ctx.sql("EXPLAIN SELECT lat, avg(t2m) FROM local GROUP BY lat").to_pandas().to_string()
    assert "read_ahead" not in plan, plan


def test_bad_retry_options_are_clear_errors(s3):
    ctx = zf.SessionContext()
    with pytest.raises(Exception, match="retry.max_retries"):
        ctx.register_zarr("t", "s3://fixtures/v3_basic.zarr", **s3.options(**{"retry.max_retries": "many"}))
    with pytest.raises(Exception, match="unknown option retry.tries"):
        ctx.register_zarr("t", "s3://fixtures/v3_basic.zarr", **s3.options(**{"retry.tries": "3"}))


def test_the_loader_opens_from_s3_without_listing_chunks(s3, tmp_path):
    """Windows from the bucket equal windows from disk; opening (the
    window-index cache key included) lists nothing, asks for the versions
    of every variable's metadata object at once (one round trip, not one
    per variable), and a second open takes the index from the cache."""
    local = zf.SessionContext().open_zarr(FIXTURES / "raw_v3.zarr").windows({"lat": 2, "lon": 2}, cache=False)
    cache = tmp_path / "cache"

    def remote():
        return (
            zf.SessionContext()
            .open_zarr("s3://fixtures/raw_v3.zarr", **s3.options())
            .windows({"lat": 2, "lon": 2}, cache=cache)
        )

    s3.proxy.configure(latency_ms=60)
    s3.proxy.reset()
    first = remote()
    assert first.index_source == "built"
    assert len(first) == len(local)
    again = remote()
    assert again.index_source == "cache" and len(again) == len(first)
    stats = s3.proxy.stats()
    assert stats["lists"] == 0, stats
    heads = stats["methods"].get("HEAD", 0)
    # raw_v3's variables, a zarr.json each, asked for once an opening.
    assert heads >= 4 and heads % 2 == 0, stats
    assert stats["max_in_flight_by_method"]["HEAD"] == heads // 2, stats


def test_processes_share_the_index_s_blocks_through_a_cache_in_the_bucket(s3, window_store, tmp_path):
    """Two processes building one index with their cache in the bucket (as
    the ranks of a job on several machines do) read each block once between
    them, both count numpy's windows, the finished index is left in the
    bucket and the shared blocks are not, and a later process takes the
    whole index from there."""
    from test_windows import index_in_two_processes

    s3.upload("windows.zarr", window_store)
    store, options = "s3://fixtures/windows.zarr", s3.options()
    cache = "s3://fixtures/shared-index-cache"
    index_in_two_processes(store, cache, window_store, tmp_path, options)
    left = s3.keys("shared-index-cache/")
    assert len(left) == 1 and left[0].endswith(".idx"), left
    again = zf.SessionContext().open_zarr(store, **options).windows(
        {"lat": 5, "lon": 4}, {"lat": 4, "lon": 3}, cache=cache, threads=0, block_size=1
    )
    assert again.index_source == "cache" and not again.index_seconds
    from test_windows import arrays, valid_origins

    _, a, b = arrays(window_store)
    assert len(again) == len(valid_origins(a, b, (5, 4), (1, 1)))


def test_ranks_sharing_a_cache_in_the_bucket_fetch_each_chunk_once_between_them(s3, steps_store, tmp_path):
    """Two processes building one index with their cache in the bucket,
    index threads and their read-ahead running, fetch each chunk once
    between them (where no two blocks read a chunk): a block is claimed
    when a process's schedule decides it, before its read-ahead requests
    the block's chunks, and blocks the other holds are skipped. (Claimed
    only when read, each process's read-ahead fetched nearly every chunk.)"""
    from test_windows import index_in_two_processes

    s3.upload("steps.zarr", steps_store)
    options, session = s3.options(), {"io_concurrency": 4}
    cache = "s3://fixtures/steps-index-cache"
    # Requests take long enough for both to be building the index at once.
    s3.proxy.configure(latency_ms=20)
    index_in_two_processes("s3://fixtures/steps.zarr", cache, steps_store, tmp_path, options, session, threads=2)
    gets = s3.proxy.stats()["gets_by_array"]
    chunks = {name: sum(1 for p in (steps_store / name / "c").rglob("*") if p.is_file()) for name in ("a", "b")}
    assert chunks == {"a": 40, "b": 40}
    fetched = {name: gets.get(f"/fixtures/steps.zarr/{name}", 0) for name in ("a", "b")}
    # Each chunk once, and a few more: a read-ahead request of a block
    # another process took over is not always cancelled before it is sent.
    for name in ("a", "b"):
        assert chunks[name] <= fetched[name] <= chunks[name] + 4, (fetched, gets)


def test_an_index_without_threads_fetches_nothing_before_a_loader_says_what_it_needs(s3, steps_store):
    """Windows whose index has no background threads (as in DataLoader
    workers) request no chunk from the bucket until something reads the
    index: a sharded loader then has it read the blocks its first batch
    needs first. (The index's read-ahead once requested the first blocks of
    the storage order as the windows were made, and the loader read those
    before its own.) The batches equal those from local files."""
    s3.upload("steps.zarr", steps_store)

    def windows(store, options):
        return zf.SessionContext(io_concurrency=4).open_zarr(store, **options).windows(
            {"lat": 8, "lon": 8}, {"lat": 4, "lon": 4}, valid="all", cache=False, threads=0, block_size=1
        )

    def batches(w):
        loader = w.loader(batch_size=16, shuffle="block", seed=3, shard=(1, 4), drop_last=True)
        return [b["a"] for b in loader]

    remote = windows("s3://fixtures/steps.zarr", s3.options())
    chunk_gets = lambda: sum(s3.proxy.stats()["gets_by_array"].get(f"/fixtures/steps.zarr/{v}", 0) for v in "ab")
    time.sleep(1.0)
    assert chunk_gets() == 0, s3.proxy.stats()["gets_by_array"]
    got, want = batches(remote), batches(windows(steps_store, {}))
    assert chunk_gets() > 0
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_a_cache_in_a_bucket_is_held_to_the_allowed_locations(s3, window_store, tmp_path):
    """A cache outside the session's allowed locations (a URL or a
    directory) is refused, naming the argument; nothing is written there."""
    ctx = zf.SessionContext(allowed_locations=[str(window_store)])
    dataset = ctx.open_zarr(window_store)
    for cache in ["s3://fixtures/elsewhere-cache", tmp_path / "elsewhere"]:
        with pytest.raises(ValueError, match="cache: .*allowed_locations"):
            dataset.windows({"lat": 2, "lon": 2}, cache=cache)
    assert s3.keys("elsewhere-cache/") == []
    assert not (tmp_path / "elsewhere").exists()


def test_opening_asks_for_metadata_and_coordinates_together(s3):
    """Registration costs round trips, not requests one after another: the
    candidate metadata documents are asked for together, then every
    coordinate array's chunks."""
    ctx = zf.SessionContext()
    s3.proxy.configure(latency_ms=60)
    s3.proxy.reset()
    ctx.register_zarr("t", "s3://fixtures/many.zarr", **s3.options())
    stats = s3.proxy.stats()
    # zarr.json and .zmetadata, then the chunks of time, lat and lon.
    assert stats["max_in_flight"] >= 3, stats
    assert stats["lists"] == 0, stats
    assert ctx.sql("SELECT count(*) AS n FROM t").to_arrow_table().to_pylist() == [{"n": 8 * 48 * 64}]


def test_a_store_opened_before_opens_in_one_round_trip_and_sees_every_change(s3, tmp_path, monkeypatch):
    """The second opening of a store asks for its metadata documents and
    coordinate chunks all at once, each only if it changed (the server
    answers 304 for those that did not): one round trip instead of two. A
    coordinate rewritten between openings is read again, never taken stale
    from the cache; a damaged cache file is a miss; with the cache turned
    off, opening reads as it did without one."""
    import xarray as xr

    monkeypatch.setenv("ZARRFUSION_CACHE_DIR", str(tmp_path / "cache"))
    local = tmp_path / "reopened.zarr"
    ds = grid(13)
    ds.to_zarr(local, encoding={"lat": {"chunks": (12,)}}, consolidated=True, zarr_format=2)
    s3.upload("reopened.zarr", local)
    sql = "SELECT min(lat) AS lo, max(lat) AS hi, avg(CAST(t AS DOUBLE)) AS m FROM t"

    def opened(settings: dict | None = None) -> tuple[dict, dict, int]:
        ctx = zf.SessionContext(config=settings)
        s3.proxy.configure(latency_ms=150)
        s3.proxy.reset()
        before = zf.network_stats()["not_modified"]
        ctx.register_zarr("t", "s3://fixtures/reopened.zarr", **s3.options())
        stats = s3.proxy.stats()
        not_modified = zf.network_stats()["not_modified"] - before
        s3.proxy.configure()
        return ctx.sql(sql).to_arrow_table().to_pylist()[0], stats, not_modified

    def want(ds) -> dict:
        return {"lo": float(ds.lat.min()), "hi": float(ds.lat.max()), "m": float(ds.t.astype("float64").mean())}

    def check(got: dict, ds) -> None:
        expected = want(ds)
        assert got["lo"] == expected["lo"] and got["hi"] == expected["hi"], (got, expected)
        assert got["m"] == pytest.approx(expected["m"], rel=1e-12)

    # zarr.json (absent), .zmetadata, then time (1 chunk), lat (4), lon (1).
    first, cold, none = opened()
    check(first, ds)
    gets = cold["methods"]["GET"]
    assert gets == 8 and none == 0, cold
    assert cold["max_in_flight"] < gets, cold
    assert list((tmp_path / "cache" / "opening").iterdir()), "nothing was kept"

    second, warm, not_modified = opened()
    check(second, ds)
    assert warm["methods"] == {"GET": gets}, warm
    # All at once: one round trip.
    assert warm["max_in_flight"] == gets, warm
    # Everything but the absent zarr.json came back "not modified".
    assert warm["statuses"].get("304") == gets - 1 == not_modified, warm

    # Two of lat's chunks change: they are read again, the rest is not.
    moved = ds.assign_coords(lat=ds.lat.values + np.where(np.arange(48) < 24, 0.25, 0.0))
    moved.to_zarr(local, mode="w", encoding={"lat": {"chunks": (12,)}}, consolidated=True, zarr_format=2)
    s3.upload("reopened.zarr", local)
    third, changed, not_modified = opened()
    check(third, moved)
    assert changed["max_in_flight"] == gets, changed
    assert changed["statuses"].get("304") == not_modified == gets - 3, changed

    # A damaged cache file: the opening reads as the first did.
    for file in (tmp_path / "cache" / "opening").iterdir():
        file.write_bytes(file.read_bytes()[:40])
    fourth, damaged, not_modified = opened()
    check(fourth, moved)
    assert not_modified == 0 and damaged["max_in_flight"] < gets, damaged

    # Turned off: no conditional request, two round trips.
    fifth, off, not_modified = opened({"zarrfusion.open_cache": "false"})
    check(fifth, moved)
    assert not_modified == 0 and off["max_in_flight"] < gets and "304" not in off["statuses"], off


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_group_without_consolidated_metadata_opens_in_a_few_round_trips(s3, tmp_path, zarr_format):
    """A group of 12 variables written by xarray without consolidated
    metadata: one LIST of the group, then the metadata documents of all 15
    children asked for together (not one round trip per array); the
    variables' sums equal xarray's."""
    import xarray as xr

    base = grid(7)
    ds = xr.Dataset({f"v{i:02d}": base.t * (i + 1) for i in range(12)}, coords=base.coords)
    local = tmp_path / "wide.zarr"
    ds.to_zarr(local, consolidated=False, zarr_format=zarr_format)
    name = f"wide_v{zarr_format}.zarr"
    s3.upload(name, local)
    ctx = zf.SessionContext()
    s3.proxy.configure(latency_ms=60)
    s3.proxy.reset()
    ctx.register_zarr("w", f"s3://fixtures/{name}", **s3.options())
    stats = s3.proxy.stats()
    assert stats["lists"] == 1, stats
    # 15 children: zarr.json each (v3), .zarray and .zattrs each (v2), asked
    # for together (one after another, one would be in flight), each once:
    # beside them, the root's candidates and the 3 coordinates' chunks.
    documents = 15 if zarr_format == 3 else 30
    assert stats["max_in_flight_by_method"]["GET"] >= 12, stats
    assert stats["methods"]["GET"] <= documents + 8, stats
    sums = ", ".join(f"sum(CAST(v{i:02d} AS DOUBLE)) AS v{i:02d}" for i in range(12))
    got = ctx.sql(f"SELECT {sums} FROM w").to_arrow_table().to_pylist()[0]
    for i in range(12):
        want = float(ds[f"v{i:02d}"].astype("float64").sum())
        assert got[f"v{i:02d}"] == pytest.approx(want, rel=1e-9)


def test_copy_to_s3_writes_a_store_xarray_reads(s3, tmp_path):
    """A COPY of a selection with a computed variable from a bucket to a
    bucket: read ahead from the source, written chunks first and metadata
    last; zarr-python reads the written store (downloaded) as xarray
    computes it from the source."""
    import xarray as xr

    ctx = zf.SessionContext(io_concurrency=16, work_dir=str(tmp_path / "work"))
    ctx.register_zarr("t", "s3://fixtures/many.zarr", **s3.options())
    s3.proxy.configure(latency_ms=20)
    s3.proxy.reset()
    ctx.sql(
        "COPY (SELECT time, lat, lon, t * 2 + 1 AS u FROM t WHERE lat > 0) "
        "TO 's3://fixtures/copies/north.zarr' STORED AS ZARR OPTIONS ('chunks' 'time=4,lat=8,lon=32')"
    ).collect()
    stats = s3.proxy.stats()
    # The source's 64 chunks were read ahead (several in flight), each once.
    assert stats["max_in_flight"] >= 4, stats
    got = xr.open_zarr(s3.download("copies/north.zarr", tmp_path / "north.zarr"))
    source = xr.open_zarr(s3.download("many.zarr", tmp_path / "many.zarr"))
    want = (source.t * 2 + 1).sel(lat=source.lat > 0)
    np.testing.assert_allclose(got.u.to_numpy(), want.to_numpy().astype("float64"), rtol=1e-6)
    np.testing.assert_array_equal(got.lat.to_numpy(), want.lat.to_numpy())
    assert got.u.encoding["chunks"] == (4, 8, 32)


def test_a_copy_to_s3_writes_with_the_options_it_is_given(s3, tmp_path):
    """The table is read straight from the server; the COPY's own OPTIONS
    name the proxy's endpoint: every write goes through the proxy (the
    bucket's registered store, the table's, would have bypassed it), and
    xarray reads back the source's values. Object-store options with a
    local target are refused, not ignored."""
    import xarray as xr

    ctx = zf.SessionContext()
    ctx.register_zarr("t", "s3://fixtures/v3_basic.zarr", **s3.options(through_proxy=False))
    s3.proxy.reset()
    through_proxy = ", ".join(f"'{k}' '{v}'" for k, v in s3.options().items())
    ctx.sql(f"COPY t TO 's3://fixtures/copies/own.zarr' STORED AS ZARR OPTIONS ({through_proxy})").collect()
    puts = s3.proxy.stats()["methods"].get("PUT", 0)
    written = s3.keys("copies/own.zarr/")
    assert written and puts >= len(written), (puts, written)
    got = xr.open_zarr(s3.download("copies/own.zarr", tmp_path / "own.zarr"))
    want = xr.open_zarr(FIXTURES / "v3_basic.zarr")
    np.testing.assert_array_equal(got.t2m.to_numpy(), want.t2m.to_numpy())
    with pytest.raises(zf.ZarrFusionError, match="local path"):
        ctx.sql(f"COPY t TO '{tmp_path / 'local.zarr'}' STORED AS ZARR OPTIONS ('aws.region' 'x')").collect()
    assert not (tmp_path / "local.zarr").exists()


def test_a_bucket_given_disagreeing_options_refuses_statements_without_options(s3, tmp_path):
    """Two tables reach one bucket through different endpoints (the proxy,
    and the server straight): each reads with its own client and answers
    as xarray does, and a COPY or a table on the bucket without options is
    refused naming the differing key (never a value), writing nothing,
    instead of using whichever table came last. Options differing only in
    retries leave the bucket's client usable."""
    import xarray as xr

    want = xr.open_zarr(FIXTURES / "v3_basic.zarr").t2m.to_numpy()
    agreeing = zf.SessionContext()
    agreeing.register_zarr("a", "s3://fixtures/v3_basic.zarr", **s3.options())
    agreeing.register_zarr("b", "s3://fixtures/v3_basic.zarr", **s3.options(**{"retry.max_retries": "2"}))
    agreeing.sql("COPY a TO 's3://fixtures/copies/agreeing.zarr' STORED AS ZARR").collect()
    got = xr.open_zarr(s3.download("copies/agreeing.zarr", tmp_path / "agreeing.zarr"))
    np.testing.assert_array_equal(got.t2m.to_numpy(), want)

    ctx = zf.SessionContext()
    ctx.register_zarr("proxied", "s3://fixtures/v3_basic.zarr", **s3.options())
    ctx.register_zarr("straight", "s3://fixtures/v3_basic.zarr", **s3.options(through_proxy=False))
    s3.proxy.reset()
    gets = []
    for table in ("proxied", "straight"):
        total = ctx.sql(f"SELECT sum(t2m) AS s, count(t2m) AS n FROM {table}").to_arrow_table().to_pydict()
        assert total["n"][0] == np.isfinite(want).sum()
        assert total["s"][0] == pytest.approx(float(np.nansum(want.astype("float64"))), rel=1e-6)
        gets.append(s3.proxy.stats()["methods"].get("GET", 0))
    # Each read with its own client: only the proxied table's went through the proxy.
    assert gets[0] > 0 and gets[1] == gets[0], gets
    with pytest.raises(zf.ZarrFusionError, match="aws.endpoint") as refused:
        ctx.sql("COPY proxied TO 's3://fixtures/copies/ambiguous.zarr' STORED AS ZARR").collect()
    assert "cannot tell which" in str(refused.value)
    assert s3.proxy_endpoint not in str(refused.value) and s3.endpoint not in str(refused.value)
    assert s3.keys("copies/ambiguous.zarr/") == []
    with pytest.raises(zf.ZarrFusionError, match="cannot tell which"):
        ctx.register_zarr("bare", "s3://fixtures/v3_basic.zarr")
    # With its own options the COPY goes through.
    options = ", ".join(f"'{k}' '{v}'" for k, v in s3.options().items())
    ctx.sql(f"COPY straight TO 's3://fixtures/copies/ambiguous.zarr' STORED AS ZARR OPTIONS ({options})").collect()
    got = xr.open_zarr(s3.download("copies/ambiguous.zarr", tmp_path / "ambiguous.zarr"))
    np.testing.assert_array_equal(got.t2m.to_numpy(), want)


def _host() -> str:
    """This machine's name as zarrfusion's claims carry it."""
    import re
    import socket

    return re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())


def test_two_copies_to_one_prefix_at_once_write_one_store_and_erase_nothing_of_it(s3, tmp_path):
    """Two sessions COPY a table to one prefix at once (60 ms a request, so
    that both are under way together): one writes the store, the other is
    refused before it writes (the prefix is claimed, or already written)
    and erases nothing of it; xarray reads the store whole, and no claim is
    left."""
    import threading

    import xarray as xr

    s3.proxy.configure(latency_ms=60)
    outcomes: dict[int, str | None] = {}

    def copy(i: int) -> None:
        ctx = zf.SessionContext()
        ctx.register_zarr("t", "s3://fixtures/many.zarr", **s3.options())
        try:
            ctx.sql("COPY t TO 's3://fixtures/copies/race.zarr' STORED AS ZARR").collect()
            outcomes[i] = None
        except zf.ZarrFusionError as e:
            outcomes[i] = str(e)

    threads = [threading.Thread(target=copy, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    refused = [e for e in outcomes.values() if e is not None]
    assert len(outcomes) == 2 and len(refused) == 1, outcomes
    assert "another write holds it" in refused[0] or "already exists" in refused[0], refused
    s3.proxy.configure()
    keys = s3.keys("copies/race.zarr/")
    assert not any(k.endswith(".zarrfusion-write") for k in keys), keys
    got = xr.open_zarr(s3.download("copies/race.zarr", tmp_path / "race.zarr"))
    want = xr.open_zarr(s3.download("many.zarr", tmp_path / "many.zarr"))
    for name in want.data_vars:
        np.testing.assert_array_equal(got[name].to_numpy(), want[name].to_numpy())


def test_a_copy_takes_over_a_killed_writers_prefix_of_this_machine_only(s3, tmp_path):
    """A claim and chunks left by a process of this boot of this machine
    that is gone (killed mid-copy) are erased by the next COPY to the
    prefix, which writes the store; a claim of another machine's writer, or
    of a machine with the same host name but another boot id, is reported,
    and nothing under its prefix is touched."""
    import json
    import subprocess

    import xarray as xr

    client = s3.client()
    gone = subprocess.Popen(["true"])
    gone.wait()
    boot = pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    claims = (
        ("copies/killed.zarr", _host(), boot),
        ("copies/elsewhere.zarr", "x" + _host(), boot),
        ("copies/same-name.zarr", _host(), "another-boot"),
    )
    for prefix, host, their_boot in claims:
        claim = {"pid": gone.pid, "host": host, "boot": their_boot, "started": 1}
        client.put_object(Bucket=s3.bucket, Key=f"{prefix}/.zarrfusion-write", Body=json.dumps(claim).encode())
        client.put_object(Bucket=s3.bucket, Key=f"{prefix}/t2m/c/9/9/9", Body=b"left by the killed write")
    ctx = zf.SessionContext()
    ctx.register_zarr("t", "s3://fixtures/v3_basic.zarr", **s3.options())
    ctx.sql("COPY t TO 's3://fixtures/copies/killed.zarr' STORED AS ZARR").collect()
    keys = s3.keys("copies/killed.zarr/")
    assert "copies/killed.zarr/t2m/c/9/9/9" not in keys and "copies/killed.zarr/.zarrfusion-write" not in keys, keys
    got = xr.open_zarr(s3.download("copies/killed.zarr", tmp_path / "killed.zarr"))
    want = xr.open_zarr(FIXTURES / "v3_basic.zarr")
    np.testing.assert_array_equal(got.t2m.to_numpy(), want.t2m.to_numpy())

    for prefix in ("copies/elsewhere.zarr", "copies/same-name.zarr"):
        before = sorted(s3.keys(f"{prefix}/"))
        with pytest.raises(zf.ZarrFusionError, match="another write holds it"):
            ctx.sql(f"COPY t TO 's3://fixtures/{prefix}' STORED AS ZARR").collect()
        assert sorted(s3.keys(f"{prefix}/")) == before


def test_a_failed_copy_to_s3_leaves_no_object_under_the_prefix(s3):
    """Every write of one chunk is refused: the COPY fails with the server's
    status after its retries, and erases what it wrote, so nothing is left
    under the target prefix (nor its metadata, written last)."""
    ctx = zf.SessionContext()
    options = s3.options(**FAST_RETRIES, **{"retry.max_retries": "1"})
    ctx.register_zarr("t", "s3://fixtures/many.zarr", **options)
    s3.proxy.configure(fault="503", methods="PUT", match=r"/copies/failed\.zarr/t/c/1/")
    with pytest.raises(Exception) as failure:
        ctx.sql(
            "COPY (SELECT * FROM t) TO 's3://fixtures/copies/failed.zarr' STORED AS ZARR "
            "OPTIONS ('chunks' 'time=2,lat=12,lon=16', 'zarr_format' '3')"
        ).collect()
    assert "503" in str(failure.value), failure.value
    assert s3.proxy.stats()["faults"].get("503", 0) >= 2
    assert s3.keys("copies/failed.zarr/") == []
    # The same COPY goes through once the server takes writes again.
    s3.proxy.configure()
    ctx.sql(
        "COPY (SELECT * FROM t) TO 's3://fixtures/copies/failed.zarr' STORED AS ZARR "
        "OPTIONS ('chunks' 'time=2,lat=12,lon=16', 'zarr_format' '3')"
    ).collect()
    assert "copies/failed.zarr/zarr.json" in s3.keys("copies/failed.zarr/")


def test_a_copy_of_an_aggregate_to_s3_writes_a_store_xarray_reads_or_nothing(s3, tmp_path):
    """A result written from rows (daily means, GROUP BY a time truncated
    to the day) to a bucket: xarray reads back its resample of the source,
    coordinates with their attributes. When a chunk cannot be written the
    COPY fails with the server's status and leaves no object under the
    prefix; once the server takes writes again it goes through."""
    import xarray as xr

    ctx = zf.SessionContext()
    ctx.register_zarr("t", "s3://fixtures/v3_basic.zarr", **s3.options(**FAST_RETRIES, **{"retry.max_retries": "1"}))
    daily = (
        "COPY (SELECT date_trunc('day', time) AS time, lat, lon, avg(t2m) AS t2m FROM t GROUP BY 1, lat, lon) "
        "TO 's3://fixtures/copies/{name}.zarr' STORED AS ZARR OPTIONS ('chunks' 'lat=2')"
    )
    plan = " ".join(ctx.sql("EXPLAIN " + daily.format(name="plan")).to_arrow_table()["plan"].to_pylist())
    assert "ZarrSink: target=s3://fixtures/copies/plan.zarr" in plan, plan
    ctx.sql(daily.format(name="daily")).collect()
    got = xr.open_zarr(s3.download("copies/daily.zarr", tmp_path / "daily.zarr"))
    source = xr.open_zarr(FIXTURES / "v3_basic.zarr")
    want = source.t2m.resample(time="1D").mean()
    np.testing.assert_allclose(got.t2m.transpose(*want.dims).to_numpy(), want.to_numpy(), rtol=1e-6)
    np.testing.assert_array_equal(got.time.to_numpy(), want.time.to_numpy())
    for d in ("lat", "lon"):
        assert {k: v for k, v in got[d].attrs.items() if k != "_zarrs"} == source[d].attrs, d
    assert got.t2m.encoding["chunks"][1] == 2

    s3.proxy.configure(fault="503", methods="PUT", match=r"/copies/failed_rows\.zarr/t2m/c/0/1/")
    with pytest.raises(Exception) as failure:
        ctx.sql(daily.format(name="failed_rows")).collect()
    assert "503" in str(failure.value), failure.value
    assert s3.proxy.stats()["faults"].get("503", 0) >= 2
    assert s3.keys("copies/failed_rows.zarr/") == []
    s3.proxy.configure()
    ctx.sql(daily.format(name="failed_rows")).collect()
    assert "copies/failed_rows.zarr/zarr.json" in s3.keys("copies/failed_rows.zarr/")


def test_rechunk_from_s3_reads_ahead_of_its_tasks(s3, tmp_path):
    """ctx.rechunk of a store in the bucket: many chunk reads in flight,
    each chunk one GET, and the rechunked store holds the source's values
    (zarr-python reads both)."""
    import xarray as xr

    answers = {}
    for concurrency in (0, 16):
        ctx = zf.SessionContext(io_concurrency=concurrency)
        ctx.register_zarr("t", "s3://fixtures/many.zarr", **s3.options())
        s3.proxy.configure(latency_ms=30)
        s3.proxy.reset()
        target = tmp_path / f"out{concurrency}.zarr"
        ctx.rechunk("s3://fixtures/many.zarr", target, {"time": 8, "lat": 6, "lon": 64}, threads=2)
        answers[concurrency] = s3.proxy.stats()
        got = xr.open_zarr(target)
        assert got.t.encoding["chunks"] == (8, 6, 64)
    source = xr.open_zarr(s3.download("many.zarr", tmp_path / "many.zarr"))
    np.testing.assert_array_equal(got.t.to_numpy(), source.t.to_numpy())
    ahead, demand = answers[16], answers[0]
    assert ahead["methods"]["GET"] == demand["methods"]["GET"], answers
    assert ahead["max_in_flight"] >= 8, ahead
    assert demand["max_in_flight"] <= 4, demand


def test_rechunk_stages_read_a_work_dir_in_s3_ahead(s3, fixtures, tmp_path):
    """A rechunk through intermediate arrays in a work_dir in the bucket:
    the later stages read the stage before ahead of their tasks (several
    requests in flight, inside the read-ahead's share of allowed_mem),
    nothing is left under the work_dir, and the target holds the source's
    values."""
    import xarray as xr

    source = fixtures / "rechunk_source.zarr"
    stats, summaries = {}, {}
    for concurrency in (0, 16):
        ctx = zf.SessionContext(
            allowed_mem="160KB", io_concurrency=concurrency, work_dir=f"s3://fixtures/work{concurrency}"
        )
        # The bucket's store, with the server's endpoint and keys.
        ctx.register_zarr("any", "s3://fixtures/many.zarr", **s3.options())
        s3.proxy.configure(latency_ms=30)
        s3.proxy.reset()
        target = tmp_path / f"out{concurrency}.zarr"
        summaries[concurrency] = ctx.rechunk(source, target, {"time": 37, "lat": 4, "lon": 4}, threads=2)
        stats[concurrency] = s3.proxy.stats()
        xr.testing.assert_identical(xr.open_zarr(source).load(), xr.open_zarr(target).load())
        assert s3.keys(f"work{concurrency}/") == []
    assert summaries[16]["arrays"]["t"]["stages"] > 1, summaries[16]
    ahead, demand = stats[16], stats[0]
    # The second stage's reads ahead: a quarter of 160KB holds 6 of its
    # input chunks; reading on demand, each of the 2 workers waits for its own.
    assert ahead["max_in_flight"] >= 5, ahead
    assert demand["max_in_flight"] <= 3, demand


def test_the_loader_reads_blocks_ahead_from_s3(s3, many_store):
    """Batches from the bucket equal batches from disk, with many chunk
    reads in flight ahead of the loader's threads."""
    local = many_store

    def batches(location, **options):
        ds = zf.SessionContext(io_concurrency=16).open_zarr(location, **options)
        windows = ds.windows({"lat": 6, "lon": 6}, block_size="64KB", cache=False)
        loader = windows.loader(batch_size=64, seed=3, threads=2, buffer_size="256KB")
        return [(b["t"].copy(), {k: v.copy() for k, v in b["index"].items()}) for b in loader]

    want = batches(local)
    s3.proxy.configure(latency_ms=30)
    s3.proxy.reset()
    got = batches("s3://fixtures/many.zarr", **s3.options())
    stats = s3.proxy.stats()
    assert len(got) == len(want) > 0
    for (a, ia), (b, ib) in zip(got, want):
        np.testing.assert_array_equal(a, b)
        for k in ia:
            np.testing.assert_array_equal(ia[k], ib[k])
    assert stats["max_in_flight"] >= 8, stats


def test_a_sharded_loader_builds_the_index_from_s3_through_the_read_ahead(s3, holes_store):
    """Rank 1 of 4 with drop_last and validity rules, its index built while
    it loads (two index threads already reading when the loader asks for
    the blocks it needs first): the same batches as from disk, and every
    chunk the index threads, the loader's planner and its threads read was
    requested ahead of them (before, preferring blocks dropped the requests
    of the blocks being read, each of whose chunks then cost a round trip)."""

    def batches(location, **options):
        ds = zf.SessionContext(io_concurrency=16).open_zarr(location, **options)
        windows = ds.windows({"lat": 6, "lon": 6}, history={"time": 2}, valid=0.95, block_size="16KB",
                             cache=False, threads=2)
        loader = windows.loader(batch_size=8, seed=5, threads=2, shard=(1, 4), drop_last=True)
        got = [(b["inputs"]["t"].copy(), b["index"]["time"].copy(), b["index"]["lat"].copy()) for b in loader]
        return got, loader.stats()

    want, local = batches(holes_store)
    assert local["requests"] == local["read_ahead_hits"] == local["read_ahead_misses"] == 0, local
    s3.proxy.configure(latency_ms=20)
    s3.proxy.reset()
    got, stats = batches("s3://fixtures/holes.zarr", **s3.options())
    proxy = s3.proxy.stats()
    assert len(got) == len(want) > 0
    for (a, ta, la), (b, tb, lb) in zip(got, want):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(ta, tb)
        np.testing.assert_array_equal(la, lb)
    assert stats["read_ahead_hits"] >= 192, stats
    assert stats["read_ahead_misses"] <= 2, stats
    # What the stores counted went over the wire.
    assert 0 < stats["requests"] <= sum(proxy["methods"].values()), (stats, proxy)
    assert stats["bytes_fetched"] <= proxy["bytes"], (stats, proxy)


def test_the_full_shuffle_reads_its_windows_ahead_from_s3(s3, holes_store):
    """Under the full shuffle the chunks of the windows next in the epoch's
    sequence are read ahead of the loader's threads, many in flight, and
    each window is decoded by the next free thread (before, a window's
    chunks were fetched when the thread assembling its batch decoded it, a
    round trip after another): the same batches as from disk, from the start
    and resumed mid-epoch, every chunk read served by the read-ahead, which
    the loader's memory counts."""

    def run(location, resume=0, **options):
        ds = zf.SessionContext(io_concurrency=16).open_zarr(location, **options)
        windows = ds.windows({"lat": 6, "lon": 6}, history={"time": 2}, valid=0.8, cache=False)
        assert len(windows) > 0  # the index complete: what follows is the loader's
        loader = windows.loader(batch_size=8, seed=5, threads=2, shuffle="full", shard=(1, 4), drop_last=True)
        if resume:
            loader.load_state_dict(loader.state_dict(batches=resume))
        before = loader.stats()
        got = [
            tuple(a.copy() for a in (b["inputs"]["t"], b["index"]["time"], b["index"]["lat"], b["index"]["lon"]))
            for b in loader
        ]
        after = loader.stats()
        counts = {k: after[k] - before[k] for k in ("requests", "read_ahead_hits", "read_ahead_misses")}
        return got, counts, loader.memory

    want, local, memory = run(holes_store)
    assert local == {"requests": 0, "read_ahead_hits": 0, "read_ahead_misses": 0}
    assert memory["read_ahead"] == 0, memory
    assert len(want) > 20
    for resume in (0, 7):
        s3.proxy.configure(latency_ms=10)
        s3.proxy.reset()
        got, counts, memory = run("s3://fixtures/holes.zarr", resume, **s3.options())
        proxy = s3.proxy.stats()
        assert len(got) == len(want) - resume
        for g, w in zip(got, want[resume:]):
            for a, b in zip(g, w):
                np.testing.assert_array_equal(a, b)
        # Windows of 2 steps of 6x6 cells over chunks of (2, 12, 16), 1 to 8
        # chunks each: every chunk read ahead (16 in flight), none on demand.
        assert counts["read_ahead_hits"] >= 8 * len(got), counts
        assert counts["read_ahead_misses"] <= 2, counts
        assert proxy["max_in_flight"] >= 8, proxy
        assert 0 < memory["read_ahead"] <= memory["total"], memory


def test_a_loader_handed_to_workers_stops_this_process_indexing(s3, holes_store):
    """Pickling a loader (what a DataLoader does for its spawned workers,
    which index what they need) stops the background index threads of
    this process after the blocks they are reading; the index still
    completes here when asked for, in the asking thread, its chunks read
    ahead, to the same windows as from disk."""
    import pickle

    want = len(zf.SessionContext().open_zarr(holes_store).windows({"lat": 6, "lon": 6}, valid=0.95, cache=False))
    s3.proxy.configure(latency_ms=20)
    ds = zf.SessionContext(io_concurrency=4).open_zarr("s3://fixtures/holes.zarr", **s3.options())
    windows = ds.windows({"lat": 6, "lon": 6}, valid=0.95, block_size="16KB", cache=False, threads=2)
    loader = windows.loader(batch_size=8, seed=5, shard=(1, 4), drop_last=True)
    deadline = time.monotonic() + 30
    while windows.index_progress[0] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    pickle.dumps(loader)
    stopped, blocks = windows.index_progress
    time.sleep(1.0)
    later, _ = windows.index_progress
    # The two threads finish the blocks they were reading, and stop.
    assert 2 <= stopped and later <= stopped + 2 < blocks, (stopped, later, blocks)
    before = loader.stats()
    assert len(windows) == want > 0
    after = loader.stats()
    # Indexed here, the chunks still read ahead of the asking thread.
    assert after["read_ahead_hits"] >= before["read_ahead_hits"] + blocks - later, (before, after)
    assert after["read_ahead_misses"] <= before["read_ahead_misses"] + 2, (before, after)


def test_the_loaders_read_ahead_fits_allowed_mem(s3, many_store):
    """Under allowed_mem, a loader's chunks read ahead get what its buffer,
    batches and decoding threads leave (its index complete): room for 6 chunks plans at most 6
    (16 and more without a limit), the whole within allowed_mem, with the
    same batches; a loader whose buffer does not fit is refused with the
    numbers."""

    def run(**session):
        ctx = zf.SessionContext(io_concurrency=16, **session)
        ds = ctx.open_zarr("s3://fixtures/many.zarr", **s3.options())
        windows = ds.windows({"lat": 6, "lon": 6}, block_size="64KB", cache=False, threads=0)
        len(windows)  # the index complete: it holds nothing beside the loader
        loader = windows.loader(batch_size=64, seed=3, threads=2, buffer_size="256KB")
        s3.proxy.configure(latency_ms=30)
        s3.proxy.reset()
        batches = [b["t"].copy() for b in loader]
        return loader.memory, batches, s3.proxy.stats()

    free, want, free_stats = run()
    assert free_stats["max_in_flight_by_method"]["GET"] >= 12, free_stats
    fixed = free["buffer"] + free["batches"] + free["decoding"]
    chunk = 2 * 12 * 16 * 4  # a float32 chunk of t
    memory, got, _ = run(allowed_mem=fixed + 6 * chunk)
    assert memory["buffer"] == free["buffer"] and memory["read_ahead"] <= 6 * chunk, (memory, free)
    assert memory["total"] <= fixed + 6 * chunk, memory
    assert free["read_ahead"] >= 16 * chunk, free
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    ctx = zf.SessionContext(allowed_mem=fixed // 2)
    windows = ctx.open_zarr("s3://fixtures/many.zarr", **s3.options()).windows(
        {"lat": 6, "lon": 6}, block_size="64KB", cache=False, threads=0
    )
    with pytest.raises(ValueError, match=r"allowed_mem: the loader needs .* \(buffer_size\)"):
        windows.loader(batch_size=64, threads=2, buffer_size="256KB")


def test_the_index_being_built_holds_at_most_half_of_allowed_mem(s3, holes_store):
    """While the window index is built from a bucket, its threads and their
    read-ahead take at most half of allowed_mem: as many threads as blocks
    fit, the chunks read ahead (and GETs in flight) in what they leave; a
    loader counts what the index holds until it is complete, and one that
    fits only without it is refused, naming it; the windows are those from
    disk."""
    want = len(zf.SessionContext().open_zarr(holes_store).windows({"lat": 6, "lon": 6}, valid=0.95, cache=False))
    chunk = 2 * 12 * 16 * 4  # a float32 chunk of t

    def windows_of(**session):
        ctx = zf.SessionContext(io_concurrency=16, **session)
        ds = ctx.open_zarr("s3://fixtures/holes.zarr", **s3.options())
        return ds.windows({"lat": 6, "lon": 6}, valid=0.95, block_size="16KB", cache=False, threads=8)

    # Long enough a wait that GETs pile up in flight even when the server
    # (moto, in this process) answers slowly on a loaded machine.
    s3.proxy.configure(latency_ms=100)
    s3.proxy.reset()
    free = windows_of()
    m = free.index_memory
    block = m["decoding"] // 8
    assert m["threads"] == 8 and block > 0 and m["read_ahead"] >= 16 * chunk, m
    assert len(free) == want
    assert free.index_memory == {"threads": 0, "decoding": 0, "read_ahead": 0, "total": 0}
    assert s3.proxy.stats()["max_in_flight_by_method"]["GET"] >= 12, s3.proxy.stats()
    loader_fixed = sum(free.loader(batch_size=4, threads=1, buffer_size="16KB").memory[k]
                       for k in ("buffer", "batches", "decoding"))

    # Half of the limit holds the loader's fixed part: fewer index threads.
    limit = 2 * max(loader_fixed, 2 * block + block // 2)
    s3.proxy.reset()
    tight = windows_of(allowed_mem=limit)
    m = tight.index_memory
    assert m["threads"] == min(8, (limit // 2) // block) < 8, (m, block, limit)
    assert m["decoding"] == m["threads"] * block and m["total"] <= limit // 2, (m, limit)
    assert 0 < m["read_ahead"] <= limit // 2 - m["decoding"], (m, limit)
    loader = tight.loader(batch_size=4, threads=1, buffer_size="16KB")
    memory = loader.memory
    if tight.index_progress[0] < tight.index_progress[1]:
        assert memory["index"] == m["total"], (memory, m)
    assert memory["total"] <= limit, (memory, limit)
    assert len(tight) == want
    ahead = m["read_ahead"] // chunk
    got = s3.proxy.stats()["max_in_flight_by_method"]["GET"]
    assert got <= ahead + m["threads"] + 2, (got, ahead, m)

    # A loader that fits beside a complete index, not beside one being built.
    limit = loader_fixed + block // 2
    refused = windows_of(allowed_mem=limit)
    assert refused.index_memory["total"] > block // 2, refused.index_memory
    with pytest.raises(ValueError, match=r"allowed_mem: .* held by the window index being built"):
        refused.loader(batch_size=4, threads=1, buffer_size="16KB")
    assert len(refused) == want
    assert refused.loader(batch_size=4, threads=1, buffer_size="16KB").memory["index"] == 0


def test_session_retry_settings_apply_to_stores_built_after_them(s3):
    """SET zarrfusion.retry.* gives the retries of the stores built from
    then on; a table's own retry option wins; bad values are refused when
    set."""
    s3.proxy.configure(fault="503", match=r"/t2m/c/0/1/0$")
    ctx = zf.SessionContext()
    ctx.sql("SET zarrfusion.retry.max_retries = 1").collect()
    ctx.sql("SET zarrfusion.retry.backoff.init_backoff = '5ms'").collect()
    ctx.sql("SET zarrfusion.client.timeout = '20s'").collect()
    ctx.register_zarr("t", "s3://fixtures/v3_basic.zarr", **s3.options())
    with pytest.raises(Exception, match="after 1 retries"):
        ctx.sql("SELECT sum(t2m) FROM t").collect()
    assert s3.proxy.stats()["faults"]["503"] == 2
    s3.proxy.reset()
    ctx.register_zarr("u", "s3://fixtures/v3_basic.zarr", **s3.options(**{"retry.max_retries": "3"}))
    with pytest.raises(Exception, match="after 3 retries"):
        ctx.sql("SELECT sum(t2m) FROM u").collect()
    assert s3.proxy.stats()["faults"]["503"] == 4
    for setting in ["zarrfusion.retry.retry_timeout = 'soon'", "zarrfusion.client.connect_timeout = 'never'"]:
        with pytest.raises(Exception, match="duration"):
            ctx.sql(f"SET {setting}").collect()
    with pytest.raises(Exception):
        ctx.sql("SET zarrfusion.retry.max_retries = 'many'").collect()


def test_an_fft_from_s3_reads_ahead_and_equals_the_local_one(s3, many_store):
    """fft(...) over a variable in the bucket: the blocks' chunks are read
    ahead (EXPLAIN says so, many GETs in flight) and the spectrum equals the
    one of the same store on disk."""
    sql = "SELECT * FROM fft('t', 't', dims => 'lon') ORDER BY time, lat, freq_lon"
    local = zf.SessionContext()
    local.register_zarr("t", str(many_store))
    want = local.sql(sql).to_arrow_table()
    ctx = zf.SessionContext(io_concurrency=16)
    ctx.register_zarr("t", "s3://fixtures/many.zarr", **s3.options())
    plan = ctx.sql("EXPLAIN " + sql).to_pandas().to_string()
    assert "reads in flight" in plan, plan
    s3.proxy.configure(latency_ms=30)
    s3.proxy.reset()
    got = ctx.sql(sql).to_arrow_table()
    stats = s3.proxy.stats()
    assert got.equals(want)
    assert stats["methods"] == {"GET": 64}, stats
    assert stats["max_in_flight"] >= 8, stats


def test_an_fft_rechunked_into_a_work_dir_in_s3_reads_the_copy_ahead(s3, tmp_path, long_store):
    """fft along x of a variable whose blocks of whole x lines do not fit
    the budget: the variable is copied into smaller chunks in a work_dir in
    the bucket first, then the transform (and the COPY of it) reads the
    copy's chunks ahead of its task, as many GETs in flight as EXPLAIN
    plans where reading on demand has one or two. Both answers are numpy's,
    and nothing is left under the work_dir."""
    import os
    import re

    import xarray as xr

    store, values = long_store(24000)
    want = np.fft.fft(values, axis=1)
    kernel = (os.cpu_count() or 1) * 3 * 16384 * 16
    fft = "fft('long', 'v', dims => 'x', true_phase => false, true_amplitude => false, shift => false)"
    stats, planned = {}, {}
    for concurrency in (0, 16):
        work = f"s3://fixtures/fftwork{concurrency}"
        ctx = zf.SessionContext(allowed_mem=kernel + (8 << 20), io_concurrency=concurrency, work_dir=work)
        # The bucket's endpoint and keys, for the work_dir.
        ctx.register_zarr("any", "s3://fixtures/many.zarr", **s3.options())
        ctx.register_zarr("long", store)
        out = tmp_path / f"spec{concurrency}.zarr"
        for name, sql in (("select", f"SELECT * FROM {fft}"), ("copy", f"COPY (SELECT * FROM {fft}) TO '{out}' STORED AS ZARR")):
            plan = ctx.sql("EXPLAIN " + sql).to_pandas().to_string()
            assert "rechunked to [" in plan or name == "copy", plan
            found = re.search(r"(\d+) reads in flight", plan)
            assert (found is not None) == (concurrency > 0), plan
            planned[name] = int(found.group(1)) if found else 0
            s3.proxy.configure(latency_ms=30)
            s3.proxy.reset()
            if name == "select":
                spec = ctx.table("long").fft("v", dims="x", true_phase=False, true_amplitude=False, shift=False)
                got = spec.to_xarray()["v"].transpose("time", "freq_x").values
                order = np.argsort(np.fft.fftfreq(64, 0.5))
                np.testing.assert_allclose(got, want[:, order], atol=1e-9 * np.abs(want).max())
                del spec
            else:
                ctx.sql(sql).collect()
                stored = xr.open_zarr(out).v.transpose("time", "freq_x").values
                np.testing.assert_allclose(stored, want, atol=1e-9 * np.abs(want).max())
            stats[(name, concurrency)] = s3.proxy.stats()
            assert s3.keys(f"fftwork{concurrency}/") == []
        if concurrency:
            assert min(planned.values()) >= 3, planned
    for name in ("select", "copy"):
        ahead, demand = stats[(name, 16)], stats[(name, 0)]
        assert ahead["methods"]["GET"] == demand["methods"]["GET"], stats
        assert ahead["max_in_flight_by_method"]["GET"] >= planned[name], (name, planned, ahead)
        assert demand["max_in_flight_by_method"]["GET"] <= 2, (name, demand)


def most_gets_in_flight(stats: dict, array: str) -> int:
    """The most GETs the proxy saw in flight at once of the arrays whose
    path ends with ``array``."""
    return max((n for a, n in stats["max_gets_in_flight_by_array"].items() if a.endswith(array)), default=0)


def test_the_four_step_path_with_a_work_dir_in_s3_reads_its_intermediates_ahead(s3, tmp_path):
    """A 1-D complex64 signal of 2^20 values written by zarr-python, under an
    allowed_mem no line fits: the four-step path keeps its intermediates in a
    work_dir in the bucket, its second pass reads the columns ahead and the
    output's blocks the spectrum (more GETs of each in flight than reading on
    demand), the spectrum is numpy's both ways, and nothing is left under the
    work_dir."""
    import zarr

    n = 1 << 20
    rng = np.random.default_rng(20)
    values = (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(np.complex64)
    signal = zarr.create_array(
        tmp_path / "signal.zarr", name="s", shape=(n,), chunks=(1 << 16,), dtype="complex64",
        dimension_names=["t"], fill_value=0,
    )
    signal[:] = values
    want = np.fft.fft(values.astype(np.complex128))
    stats = {}
    for concurrency in (0, 16):
        ctx = zf.SessionContext(
            allowed_mem="12MB", io_concurrency=concurrency, work_dir=f"s3://fixtures/fourwork{concurrency}"
        )
        ctx.register_zarr("any", "s3://fixtures/many.zarr", **s3.options())
        ctx.register_zarr("t", tmp_path / "signal.zarr")
        spec = ctx.table("t").fft("s", dims="t", true_phase=False, true_amplitude=False, shift=False)
        plan = ctx.sql(
            "EXPLAIN SELECT * FROM fft('t', 's', dims => 't', true_phase => false, "
            "true_amplitude => false, shift => false)"
        ).to_pandas().to_string()
        assert "strategy=four-step" in plan, plan
        assert ("the second pass reads columns, read_ahead=" in plan) == (concurrency > 0), plan
        s3.proxy.configure(latency_ms=30)
        s3.proxy.reset()
        out = tmp_path / f"spec{concurrency}.zarr"
        spec.to_zarr(out)
        stats[concurrency] = s3.proxy.stats()
        got = zarr.open_group(out, mode="r")["s"][:]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
        del spec
        assert s3.keys(f"fourwork{concurrency}/") == []
    # (The two plans differ: with reading ahead, an eighth of allowed_mem is
    # set aside for it, and the passes' blocks are smaller.)
    ahead, demand = stats[16], stats[0]
    for array in ("/columns", "/spectrum"):
        assert most_gets_in_flight(ahead, array) >= 4, (array, stats)
        assert 1 <= most_gets_in_flight(demand, array) <= 2, (array, stats)


def test_the_four_step_path_reads_a_source_in_s3_ahead(s3, tmp_path):
    """A 1-D complex64 signal of 2^20 values in 128 chunks, written by
    zarr-python and uploaded to the bucket, under an allowed_mem no line
    fits: the four-step path's first pass reads the source's chunks ahead
    (EXPLAIN says how far; more GETs in flight than reading on demand, and
    no more GETs), and the spectrum is numpy's both ways."""
    import zarr

    n = 1 << 20
    rng = np.random.default_rng(21)
    values = (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(np.complex64)
    local = tmp_path / "signal.zarr"
    signal = zarr.create_array(
        local, name="s", shape=(n,), chunks=(1 << 13,), dtype="complex64", dimension_names=["t"], fill_value=0,
    )
    signal[:] = values
    s3.upload("four_step_signal.zarr", local)
    want = np.fft.fft(values.astype(np.complex128))
    stats = {}
    for concurrency in (0, 16):
        ctx = zf.SessionContext(allowed_mem="12MB", io_concurrency=concurrency, work_dir=tmp_path / f"work{concurrency}")
        ctx.register_zarr("t", "s3://fixtures/four_step_signal.zarr", **s3.options())
        args = "'t', 's', dims => 't', true_phase => false, true_amplitude => false, shift => false"
        plan = ctx.sql(f"EXPLAIN SELECT * FROM fft({args})").to_pandas().to_string()
        assert "strategy=four-step" in plan, plan
        assert ("the first pass reads the source, read_ahead=" in plan) == (concurrency > 0), plan
        spec = ctx.table("t").fft("s", dims="t", true_phase=False, true_amplitude=False, shift=False)
        s3.proxy.configure(latency_ms=30)
        s3.proxy.reset()
        out = tmp_path / f"spec{concurrency}.zarr"
        spec.to_zarr(out)
        stats[concurrency] = s3.proxy.stats()
        s3.proxy.configure(latency_ms=0)
        got = zarr.open_group(out, mode="r")["s"][:]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    ahead, demand = stats[16], stats[0]
    assert demand["methods"]["GET"] >= 128, stats
    assert ahead["methods"]["GET"] <= demand["methods"]["GET"], stats
    assert most_gets_in_flight(ahead, "four_step_signal.zarr/s") >= 6, stats
    assert 1 <= most_gets_in_flight(demand, "four_step_signal.zarr/s") <= 2, stats

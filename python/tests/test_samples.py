"""Samples of inputs and targets against numpy: history and lead times,
validity per role, channel order, jitter, statistics and normalization,
and clear errors for bad arguments."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

VARIABLES = ["t2m", "u10", "precip"]
SIZE = 8
STRIDE = 4


def load(store):
    ds = xr.open_zarr(store, chunks=None).load()
    return ds, {v: ds[v].values for v in VARIABLES}


def expected_samples(data, history, targets, valid_inputs, valid_targets, nt=40, ny=21, nx=26):
    """(t, i, j) -> (inputs, targets) stacked as the loader documents:
    steps outermost, then variables; targets sorted by lead, then variable."""
    leads = sorted({(lead, v) for v, ls in targets.items() for lead in ls}, key=lambda p: (p[0], VARIABLES.index(p[1])))
    first = min([1 - history] + [lead for lead, _ in leads])
    last = max([0] + [lead for lead, _ in leads])
    out = {}
    for t in range(-first, nt - last):
        for i in range(0, ny - SIZE + 1, STRIDE):
            for j in range(0, nx - SIZE + 1, STRIDE):
                box = (slice(i, i + SIZE), slice(j, j + SIZE))
                inputs = np.stack([data[v][(t + s, *box)] for s in range(1 - history, 1) for v in VARIABLES])
                target = np.stack([data[v][(t + lead, *box)] for lead, v in leads]) if leads else None
                ok = np.isnan(inputs).sum() <= (1 - valid_inputs) * inputs.size + 1e-9
                if target is not None:
                    ok &= np.isnan(target).sum() <= (1 - valid_targets) * target.size + 1e-9
                if ok:
                    out[(t, i, j)] = (inputs, target)
    return out


def samples_of(loader):
    got = {}
    for batch in loader:
        idx = batch["index"]
        for k, key in enumerate(zip(idx["time"].tolist(), idx["lat"].tolist(), idx["lon"].tolist())):
            assert key not in got
            got[key] = (batch["inputs"][k], batch["targets"][k] if "targets" in batch else None)
    return got


def open_windows(ctx, store, **kwargs):
    kwargs.setdefault("cache", False)
    return ctx.open_zarr(store, variables=VARIABLES).windows(
        {"lat": SIZE, "lon": SIZE}, {"lat": SIZE - STRIDE, "lon": SIZE - STRIDE}, **kwargs
    )


@pytest.mark.parametrize("shuffle", [None, "block", "full"])
def test_history_and_lead_times_equal_numpy(ctx, forecast_store, shuffle):
    ds, data = load(forecast_store)
    windows = open_windows(
        ctx, forecast_store, history={"time": 2}, targets={"t2m": "+6h", "precip": ["+6h", "+12h"]},
        valid={"inputs": 0.99, "targets": "all"},
    )
    expected = expected_samples(data, 2, {"t2m": [1], "precip": [1, 2]}, 0.99, 1.0)
    assert len(windows) == len(expected)
    assert windows.lead_dim == "time"
    assert windows.channels == {
        "inputs": [{"variable": v, "step": s} for s in (-1, 0) for v in VARIABLES],
        "targets": [{"variable": "t2m", "step": 1}, {"variable": "precip", "step": 1}, {"variable": "precip", "step": 2}],
    }
    loader = windows.loader(batch_size=16, shuffle=shuffle, stack="channels", seed=3)
    got = samples_of(loader)
    assert got.keys() == expected.keys()
    for key, (inputs, targets) in got.items():
        assert inputs.dtype == np.float32 and inputs.shape == (6, SIZE, SIZE)
        np.testing.assert_array_equal(inputs, expected[key][0].astype(np.float32))
        np.testing.assert_array_equal(targets, expected[key][1].astype(np.float32))
    # The time reported is the sample's own step, with its coordinate.
    batch = next(iter(windows.loader(batch_size=4, shuffle=None, stack="channels")))
    t = batch["index"]["time"]
    assert (batch["coords"]["time"] == ds.time.values[t]).all()


def test_per_variable_arrays_keep_their_type(ctx, forecast_store):
    _, data = load(forecast_store)
    windows = open_windows(ctx, forecast_store, history={"time": 3}, targets={"precip": "+1"}, valid="any")
    batch = next(iter(windows.loader(batch_size=5, shuffle="block", seed=1)))
    assert set(batch["inputs"]) == set(VARIABLES) and set(batch["targets"]) == {"precip"}
    assert batch["inputs"]["t2m"].shape == (5, 3, SIZE, SIZE) and batch["inputs"]["t2m"].dtype == np.float32
    assert batch["inputs"]["precip"].dtype == np.float64
    assert batch["targets"]["precip"].shape == (5, 1, SIZE, SIZE)
    for k in range(5):
        t, i, j = (int(batch["index"][d][k]) for d in ("time", "lat", "lon"))
        box = (slice(i, i + SIZE), slice(j, j + SIZE))
        for v in VARIABLES:
            np.testing.assert_array_equal(batch["inputs"][v][k], data[v][(slice(t - 2, t + 1), *box)])
        np.testing.assert_array_equal(batch["targets"]["precip"][k, 0], data["precip"][(t + 1, *box)])


def test_lead_times_in_steps_and_in_hours_agree(ctx, forecast_store):
    a = open_windows(ctx, forecast_store, targets={"u10": "+12h"}, inputs=["t2m"])
    b = open_windows(ctx, forecast_store, targets={"u10": "+2"}, inputs=["t2m"])
    assert len(a) == len(b)
    assert a.channels == b.channels == {
        "inputs": [{"variable": "t2m", "step": 0}],
        "targets": [{"variable": "u10", "step": 2}],
    }
    ga = samples_of(a.loader(batch_size=32, shuffle=None, stack="channels"))
    gb = samples_of(b.loader(batch_size=32, shuffle=None, stack="channels"))
    assert ga.keys() == gb.keys()
    for key in ga:
        np.testing.assert_array_equal(ga[key][1], gb[key][1])


def in_calendar(forecast_store, folder, start, freq, units, calendar):
    """The forecast store's values over 40 steps of dates of a model
    calendar (xarray decodes them to cftime's), written into `folder`."""
    ds = xr.open_zarr(forecast_store, chunks=None).load()
    ds = ds.assign_coords(time=xr.date_range(start, periods=40, freq=freq, calendar=calendar, use_cftime=True))
    ds.time.encoding = {"units": units, "calendar": calendar}
    path = folder / f"forecast_{calendar}.zarr"
    ds.to_zarr(path, encoding={v: {"chunks": (8, 8, 8)} for v in VARIABLES}, zarr_format=3)
    return path


@pytest.fixture(scope="module")
def noleap_store(forecast_store, tmp_path_factory):
    """6-hourly from 2000-02-20: the steps cross the 29th of February, which
    the model lacks."""
    folder = tmp_path_factory.mktemp("noleap")
    return in_calendar(forecast_store, folder, "2000-02-20", "6h", "hours since 2000-01-01", "noleap")


@pytest.fixture(scope="module")
def day360_store(forecast_store, tmp_path_factory):
    """Daily from 2000-02-10 in `360_day`: the 29th and 30th of February have
    no timestamp (the coordinate keeps its numbers, days since 2000-01-01)."""
    folder = tmp_path_factory.mktemp("day360")
    return in_calendar(forecast_store, folder, "2000-02-10", "D", "days since 2000-01-01", "360_day")


def test_lead_times_over_dates_kept_as_numbers(ctx, day360_store):
    # The time coordinate is numbers here, and still the lead dimension,
    # stepping by the calendar's days.
    ds, data = load(day360_store)
    assert [d.day for d in ds.time.values[18:21]] == [28, 29, 30]
    windows = open_windows(
        ctx, day360_store, history={"time": 2}, targets={"t2m": "+1d", "precip": "+48h"},
        valid={"inputs": 0.99, "targets": "all"},
    )
    assert windows.lead_dim == "time"
    assert windows.channels["targets"] == [{"variable": "t2m", "step": 1}, {"variable": "precip", "step": 2}]
    expected = expected_samples(data, 2, {"t2m": [1], "precip": [2]}, 0.99, 1.0)
    got = samples_of(windows.loader(batch_size=32, shuffle=None, stack="channels"))
    assert got.keys() == expected.keys()
    for key, (inputs, targets) in got.items():
        np.testing.assert_array_equal(inputs, expected[key][0].astype(np.float32))
        np.testing.assert_array_equal(targets, expected[key][1].astype(np.float32))


def test_lead_times_count_a_model_calendars_own_days(ctx, noleap_store):
    ds, data = load(noleap_store)
    # cftime's arithmetic: every step is 6 hours, across the 28th of February too.
    steps = np.diff(ds.time.values)
    assert all(step == np.timedelta64(6, "h") for step in steps)
    windows = open_windows(
        ctx, noleap_store, history={"time": 2}, targets={"t2m": "+6h", "precip": "+1d"},
        valid={"inputs": 0.99, "targets": "all"},
    )
    assert windows.channels["targets"] == [{"variable": "t2m", "step": 1}, {"variable": "precip", "step": 4}]
    expected = expected_samples(data, 2, {"t2m": [1], "precip": [4]}, 0.99, 1.0)
    got = samples_of(windows.loader(batch_size=16, shuffle="block", stack="channels", seed=5))
    assert got.keys() == expected.keys()
    for key, (inputs, targets) in got.items():
        np.testing.assert_array_equal(inputs, expected[key][0].astype(np.float32))
        np.testing.assert_array_equal(targets, expected[key][1].astype(np.float32))
    # A lead time that is no whole number of steps is refused, naming the step.
    with pytest.raises(ValueError, match="not a whole number of the steps of 'time' \\(6h\\)"):
        open_windows(ctx, noleap_store, targets={"t2m": "+3h"})


def test_jitter_is_seeded_reported_and_keeps_the_rules(ctx, forecast_store):
    _, data = load(forecast_store)
    windows = open_windows(
        ctx, forecast_store, history={"time": 2}, targets={"t2m": "+6h"}, valid={"inputs": 0.99, "targets": "all"},
        jitter={"lat": 3, "lon": 2},
    )
    anchors = expected_samples(data, 2, {"t2m": [1]}, 0.99, 1.0)

    def epoch(seed, e):
        loader = windows.loader(batch_size=20, shuffle=None, seed=seed, stack="channels")
        loader.set_epoch(e)
        seen = []
        for batch in loader:
            for k in range(len(batch["inputs"])):
                t, i, j = (int(batch["index"][d][k]) for d in ("time", "lat", "lon"))
                di, dj = int(batch["jitter"]["lat"][k]), int(batch["jitter"]["lon"][k])
                assert abs(di) <= 3 and abs(dj) <= 2
                assert (t, i - di, j - dj) in anchors
                assert 0 <= i and i + SIZE <= 21 and 0 <= j and j + SIZE <= 26
                box = (slice(i, i + SIZE), slice(j, j + SIZE))
                inputs = np.stack([data[v][(t + s, *box)] for s in (-1, 0) for v in VARIABLES])
                np.testing.assert_array_equal(batch["inputs"][k], inputs.astype(np.float32))
                target = data["t2m"][(t + 1, *box)]
                np.testing.assert_array_equal(batch["targets"][k, 0], target)
                assert not np.isnan(target).any()
                assert np.isnan(inputs).sum() <= 0.01 * inputs.size
                seen.append((t, i, j, di, dj))
        return seen

    first = epoch(5, 0)
    assert len(first) == len(anchors)
    assert epoch(5, 0) == first
    other = epoch(5, 1)
    assert [s[:3] for s in other] != [s[:3] for s in first]
    offsets = {(s[3], s[4]) for s in first}
    assert len(offsets) > 10  # offsets spread over the bounds


def test_statistics_and_normalization_equal_numpy(ctx, forecast_store, tmp_path):
    _, data = load(forecast_store)
    windows = open_windows(
        ctx, forecast_store, history={"time": 2}, targets={"t2m": "+6h"}, valid="any",
        where="time >= '2021-03-03'", cache=tmp_path,
    )
    stats = windows.statistics()
    part = {v: data[v][8:] for v in VARIABLES}  # 2021-03-03 is the ninth step
    for v in VARIABLES:
        values = part[v][~np.isnan(part[v])].astype(np.float64)
        assert stats[v]["count"] == values.size
        np.testing.assert_allclose(stats[v]["mean"], values.mean(), rtol=1e-9)
        np.testing.assert_allclose(stats[v]["std"], values.std(), rtol=1e-7)
        assert stats[v]["min"] == pytest.approx(values.min()) and stats[v]["max"] == pytest.approx(values.max())
    assert list(tmp_path.glob("*.stats.json"))
    assert windows.statistics() == stats  # from the cache
    loader = windows.loader(batch_size=8, shuffle=None, stack="channels", normalize=True)
    batch = next(iter(loader))
    for k in range(8):
        t, i, j = (int(batch["index"][d][k]) for d in ("time", "lat", "lon"))
        box = (slice(i, i + SIZE), slice(j, j + SIZE))
        for c, (s, v) in enumerate((s, v) for s in (-1, 0) for v in VARIABLES):
            expected = (data[v][(t + s, *box)] - stats[v]["mean"]) / stats[v]["std"]
            np.testing.assert_allclose(batch["inputs"][k, c], expected, rtol=2e-5, atol=2e-5)
        expected = (data["t2m"][(t + 1, *box)] - stats["t2m"]["mean"]) / stats["t2m"]["std"]
        np.testing.assert_allclose(batch["targets"][k, 0], expected, rtol=2e-5, atol=2e-5)
    # Given statistics, and per-variable arrays normalized to float32.
    given = {v: {"mean": 1.0, "std": 2.0} for v in VARIABLES}
    batch = next(iter(windows.loader(batch_size=2, shuffle=None, normalize=given)))
    t, i, j = (int(batch["index"][d][0]) for d in ("time", "lat", "lon"))
    assert batch["inputs"]["precip"].dtype == np.float32
    np.testing.assert_allclose(
        batch["inputs"]["precip"][0, 1], (data["precip"][t, i : i + SIZE, j : j + SIZE] - 1.0) / 2.0, rtol=1e-6, atol=1e-6
    )


def test_resume_with_targets_and_jitter_is_exact(ctx, forecast_store):
    windows = open_windows(ctx, forecast_store, history={"time": 2}, targets={"t2m": "+1"}, valid=0.9, jitter={"lon": 2})
    loader = windows.loader(batch_size=7, shuffle="block", seed=9, stack="channels", buffer_size="64KB")
    loader.set_epoch(2)
    whole = [(b["inputs"].copy(), b["index"]["time"].copy(), b["jitter"]["lon"].copy()) for b in loader]
    resumed = windows.loader(batch_size=7, shuffle="block", seed=9, stack="channels", buffer_size="64KB")
    resumed.load_state_dict({**loader.state_dict(), "epoch": 2, "batches": 5})
    rest = [(b["inputs"], b["index"]["time"], b["jitter"]["lon"]) for b in resumed]
    assert len(rest) == len(whole) - 5
    for (a, ta, ja), (b, tb, jb) in zip(whole[5:], rest):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(ta, tb)
        np.testing.assert_array_equal(ja, jb)


def test_torch_tensors_of_roles(ctx, forecast_store):
    torch = pytest.importorskip("torch")
    windows = open_windows(ctx, forecast_store, history={"time": 2}, targets={"t2m": "+6h"}, valid="any")
    batch = next(iter(windows.loader(batch_size=4, stack="channels").torch()))
    assert isinstance(batch["inputs"], torch.Tensor) and batch["inputs"].shape == (4, 6, SIZE, SIZE)
    assert batch["targets"].shape == (4, 1, SIZE, SIZE) and batch["targets"].dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs,argument,words",
    [
        (dict(targets={"sst": "+6h"}), "targets", "unknown variable 'sst'"),
        (dict(targets={"t2m": "+20d"}), "targets", "spans"),
        (dict(targets={"t2m": "+3h"}), "targets", "whole number"),
        (dict(targets={"t2m": "+6 parsecs"}), "targets", "lead time"),
        (dict(history={"lat": 2}), "history", "window dimension"),
        (dict(history={"level": 2}), "history", "unknown dimension"),
        (dict(history={"time": 0}), "history", "at least 1"),
        (dict(history={"time": 41}), "history", "spans"),
        (dict(jitter={"time": 1}), "jitter", "not a window dimension"),
        (dict(valid={"outputs": "all"}), "valid", "unknown role"),
        (dict(inputs=["t2m", "t2m"]), "inputs", "twice"),
        (dict(inputs=["sst"]), "inputs", "unknown variable"),
        (dict(targets={"t2m": "+1"}, where="time < '2021-03-01T06:00:00'"), "targets", "spans"),
    ],
)
def test_bad_sample_arguments_name_the_argument(ctx, forecast_store, kwargs, argument, words):
    with pytest.raises(ValueError, match=argument) as error:
        open_windows(ctx, forecast_store, **kwargs)
    assert words in str(error.value)


def test_bad_loader_arguments_for_samples(ctx, forecast_store):
    windows = open_windows(ctx, forecast_store, targets={"t2m": "+1"})
    with pytest.raises(ValueError, match="stack"):
        windows.loader(stack="variables")
    with pytest.raises(ValueError, match="normalize: no statistics for variable 'u10'"):
        windows.loader(normalize={"t2m": {"mean": 0, "std": 1}, "precip": {"mean": 0, "std": 1}})
    with pytest.raises(ValueError, match="normalize"):
        windows.loader(normalize={v: {"mean": "warm"} for v in VARIABLES})


# Several sources: era5 (6-hourly; surface, pressure levels and a static
# field) and imerg (3-hourly, on a larger grid around era5's).

SOURCES_VARIABLES = {"era5": ["t2m", "z", "lsm"], "imerg": ["precip"]}


def open_sources(ctx, two, **kwargs):
    kwargs.setdefault("cache", False)
    ds = ctx.open_zarr({"era5": two["era5"], "imerg": two["imerg"]}, variables=SOURCES_VARIABLES)
    return ds, ds.windows({"lat": SIZE, "lon": SIZE}, {"lat": SIZE - STRIDE, "lon": SIZE - STRIDE}, **kwargs)


def planes(two, t, i, j):
    """The input channels of era5 step t at (i, j), in documented order:
    t2m, z at each level, lsm, precip (imerg's step 2t, rows i + 2)."""
    box = (slice(i, i + SIZE), slice(j, j + SIZE))
    return [two["t2m"][(t, *box)], *[two["z"][(t, k, *box)] for k in range(3)], two["lsm"][box],
            two["precip"][(2 * t, slice(i + 2, i + 2 + SIZE), box[1])]]


@pytest.mark.parametrize("shuffle", ["block", "full"])
def test_two_sources_join_on_coordinates(ctx, two_sources, shuffle):
    two = two_sources
    ds, windows = open_sources(
        ctx, two, history={"time": 2}, targets={"t2m": "+6h", "precip": "+6h"},
        valid={"inputs": 0.99, "targets": "all"},
    )
    assert [s["name"] for s in ds.sources] == ["era5", "era5", "era5", "imerg"]
    assert ds.variables == ["t2m", "z", "lsm", "precip"]
    per_step = ["t2m", "z", "z", "z", "lsm", "precip"]
    channels = windows.channels
    assert [c["variable"] for c in channels["inputs"]] == per_step * 2
    assert [c["step"] for c in channels["inputs"]] == [-1] * 6 + [0] * 6
    assert [c.get("level") for c in channels["inputs"][:6]] == [None, 1000, 850, 500, None, None]
    assert [(c["variable"], c["step"]) for c in channels["targets"]] == [("t2m", 1), ("precip", 1)]
    expected = {}
    for t in range(1, 23):
        for i in range(0, 21 - SIZE + 1, STRIDE):
            for j in range(0, 26 - SIZE + 1, STRIDE):
                inputs = np.stack(planes(two, t - 1, i, j) + planes(two, t, i, j))
                box = (slice(i, i + SIZE), slice(j, j + SIZE))
                targets = np.stack([two["t2m"][(t + 1, *box)], two["precip"][(2 * t + 2, slice(i + 2, i + 2 + SIZE), box[1])]])
                if np.isnan(inputs).sum() <= 0.01 * inputs.size and not np.isnan(targets).any():
                    expected[(t, i, j)] = (inputs, targets)
    assert len(windows) == len(expected)
    got = samples_of(windows.loader(batch_size=10, shuffle=shuffle, seed=2, stack="channels", buffer_size="100KB"))
    assert got.keys() == expected.keys()
    for key, (inputs, targets) in got.items():
        assert inputs.shape == (12, SIZE, SIZE)
        np.testing.assert_array_equal(inputs, expected[key][0])
        np.testing.assert_array_equal(targets, expected[key][1])
    # Per variable: z keeps its levels as channels, one array per variable.
    batch = next(iter(windows.loader(batch_size=3, shuffle=None)))
    assert batch["inputs"]["z"].shape == (3, 6, SIZE, SIZE)
    assert batch["inputs"]["lsm"].shape == (3, 2, SIZE, SIZE)
    assert "level" not in batch["index"]


def test_statistics_of_several_sources(ctx, two_sources):
    two = two_sources
    _, windows = open_sources(ctx, two, history={"time": 2}, valid="any", where="time >= '2022-01-02T00:00:00'")
    stats = windows.statistics()
    # era5 from its fifth step, imerg from its ninth (the same time).
    for name, values in (("t2m", two["t2m"][4:]), ("lsm", two["lsm"]), ("precip", two["precip"][8:])):
        v = values[~np.isnan(values)].astype(np.float64)
        assert stats[name]["count"] == v.size, name
        np.testing.assert_allclose(stats[name]["mean"], v.mean(), rtol=1e-9)
        np.testing.assert_allclose(stats[name]["std"], v.std(), rtol=1e-7)
    # Per level: z's channels each have their own.
    assert stats["z"]["level"] == [1000, 850, 500]
    for k in range(3):
        v = two["z"][4:, k]
        v = v[~np.isnan(v)].astype(np.float64)
        assert stats["z"]["count"][k] == v.size
        np.testing.assert_allclose(stats["z"]["mean"][k], v.mean(), rtol=1e-9)
        np.testing.assert_allclose(stats["z"]["std"][k], v.std(), rtol=1e-7)
    # Normalized per channel, levels by their own statistics.
    batch = next(iter(windows.loader(batch_size=2, shuffle=None, stack="channels", normalize=True)))
    t, i, j = (int(batch["index"][d][0]) for d in ("time", "lat", "lon"))
    box = (slice(i, i + SIZE), slice(j, j + SIZE))
    for k in range(3):  # the sample's own step: channels 6 + 1 + k
        expected = (two["z"][(t, k, *box)] - stats["z"]["mean"][k]) / stats["z"]["std"][k]
        np.testing.assert_allclose(batch["inputs"][0, 7 + k], expected, rtol=1e-4, atol=1e-4)
    expected = (two["precip"][(2 * t, slice(i + 2, i + 2 + SIZE), box[1])] - stats["precip"]["mean"]) / stats["precip"]["std"]
    np.testing.assert_allclose(batch["inputs"][0, 11], expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="'z' has 3 channels per step, not 2 means"):
        windows.loader(normalize={**stats, "z": {"mean": [1, 2], "std": [1, 1]}})


def test_sources_on_other_grids_or_steps_are_refused(ctx, two_sources):
    two = two_sources
    shifted = ctx.open_zarr({"era5": two["era5"], "shifted": two["shifted"]}, variables={"era5": ["t2m"], "shifted": ["precip"]})
    with pytest.raises(ValueError, match="sources: source 'shifted': its 'lat' .* is not the grid of 'era5'"):
        shifted.windows({"lat": SIZE, "lon": SIZE}, history={"time": 2}, cache=False)
    four = ctx.open_zarr({"era5": two["era5"], "imerg": two["four_hourly"]}, variables={"era5": ["t2m"], "imerg": ["precip"]})
    with pytest.raises(ValueError, match="source 'imerg': has no time 2022-01-01T06:00:00"):
        four.windows({"lat": SIZE, "lon": SIZE}, history={"time": 2}, cache=False)
    # Selecting the steps both have makes it work.
    ok = four.windows({"lat": SIZE, "lon": SIZE}, cache=False, valid="any", where="time <= '2022-01-01T00:00:00'")
    assert len(ok) == 2 * 3  # one step, windows of 8 every 8 cells
    with pytest.raises(ValueError, match="no source named 'era'"):
        ctx.open_zarr({"era5": two["era5"]}, variables={"era": ["t2m"]})
    with pytest.raises(ValueError, match="unknown variable 'sst' of 'imerg'"):
        ctx.open_zarr({"era5": two["era5"], "imerg": two["imerg"]}, variables={"era5": ["t2m"], "imerg": ["sst"]})
    both = ctx.open_zarr({"a": two["imerg"], "b": two["imerg"]}, variables={"a": ["precip"], "b": ["precip"]})
    with pytest.raises(ValueError, match="'precip' is a variable of 'a' and of 'b'"):
        both.windows({"lat": SIZE, "lon": SIZE}, cache=False)


def test_several_sources_resume_and_pickle(ctx, two_sources):
    import pickle

    _, windows = open_sources(ctx, two_sources, history={"time": 2}, targets={"t2m": "+1"}, valid="any", jitter={"lat": 2})
    loader = windows.loader(batch_size=9, shuffle="block", seed=4, stack="channels")
    whole = [b["inputs"].copy() for b in loader]
    again = pickle.loads(pickle.dumps(loader))
    again.load_state_dict({**loader.state_dict(), "batches": 3})
    rest = [b["inputs"] for b in again]
    assert len(rest) == len(whole) - 3
    for a, b in zip(whole[3:], rest):
        np.testing.assert_array_equal(a, b)


def test_shards_of_several_sources_are_disjoint_and_complete(ctx, two_sources):
    _, windows = open_sources(ctx, two_sources, history={"time": 2}, targets={"precip": "+1"}, valid=0.99)
    everything = set(samples_of(windows.loader(batch_size=16, shuffle=None, stack="channels")))
    seen = []
    for rank in range(3):
        loader = windows.loader(batch_size=16, shuffle="block", seed=5, shard=(rank, 3), stack="channels")
        keys = list(samples_of(loader))
        assert len(keys) == loader.num_samples
        seen.extend(keys)
    assert len(seen) == len(set(seen)) == len(everything)
    assert set(seen) == everything



def test_several_sources_from_s3_equal_the_same_on_disk(ctx, two_sources):
    """Both stores in the real S3 server (moto behind the latency proxy): the
    same batches as from disk, every source's chunks read ahead."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "s3"))
    import s3_server

    two = two_sources
    server = s3_server.start({"era5.zarr": two["era5"], "imerg.zarr": two["imerg"]}, bucket="sources")
    try:
        server.proxy.configure(latency_ms=20)
        kwargs = dict(history={"time": 2}, targets={"precip": "+6h"}, valid={"inputs": 0.99, "targets": "all"},
                      jitter={"lon": 2}, cache=False)

        def batches(stores, **options):
            ds = ctx.open_zarr(stores, variables=SOURCES_VARIABLES, **options)
            windows = ds.windows({"lat": SIZE, "lon": SIZE}, {"lat": SIZE - STRIDE, "lon": SIZE - STRIDE}, **kwargs)
            loader = windows.loader(batch_size=12, shuffle="block", seed=8, stack="channels", buffer_size="200KB")
            return [(b["inputs"], b["targets"], b["index"]["time"]) for b in loader]

        local = batches({"era5": two["era5"], "imerg": two["imerg"]})
        remote = batches({"era5": "s3://sources/era5.zarr", "imerg": "s3://sources/imerg.zarr"}, **server.options())
        assert len(local) == len(remote) > 10
        for (a, b, c), (x, y, z) in zip(local, remote):
            np.testing.assert_array_equal(a, x)
            np.testing.assert_array_equal(b, y)
            np.testing.assert_array_equal(c, z)
        in_flight = server.proxy.stats()["max_gets_in_flight_by_array"]
        assert in_flight.get("/sources/imerg.zarr/precip", 0) > 1, in_flight
    finally:
        server.stop()

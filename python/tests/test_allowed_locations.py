"""SessionContext(allowed_locations=...): a session restricted to some
directories reads, writes and works only under them, from every method."""

from __future__ import annotations

import shutil

import pytest
import xarray as xr

import zarrfusion as zf


@pytest.fixture
def places(fixtures, tmp_path):
    """inside/ (allowed) and outside/, each with a copy of the same store."""
    for side in ("inside", "outside"):
        shutil.copytree(fixtures / "v3_basic.zarr", tmp_path / side / "s.zarr")
    return tmp_path


def test_reads_inside_answer_as_xarray_and_everything_outside_is_refused(places):
    inside, outside = places / "inside" / "s.zarr", places / "outside" / "s.zarr"
    ctx = zf.SessionContext(allowed_locations=[places / "inside"])
    expected = float(xr.open_zarr(outside, chunks=None)["t2m"].mean())
    got = ctx.sql(f"SELECT avg(t2m) AS m FROM read_zarr('{inside}')").to_pandas()["m"][0]
    assert got == pytest.approx(expected, rel=1e-6)
    # Unrestricted, the store outside answers the same: only the list refuses it.
    free = zf.SessionContext().sql(f"SELECT avg(t2m) AS m FROM read_zarr('{outside}')").to_pandas()
    assert free["m"][0] == pytest.approx(expected, rel=1e-6)

    attempts = [
        lambda: ctx.sql(f"SELECT * FROM read_zarr('{outside}')").collect(),
        lambda: ctx.register_zarr("o", outside),
        lambda: ctx.open_zarr(str(outside)),
        lambda: ctx.rechunk(str(inside), places / "outside" / "r.zarr", {"time": 1}),
        lambda: ctx.sql(f"SELECT * FROM read_zarr('{inside}')").to_zarr(places / "outside" / "c.zarr"),
    ]
    for attempt in attempts:
        with pytest.raises(zf.ZarrPermissionError) as raised:
            attempt()
        assert isinstance(raised.value, PermissionError)
        assert "allowed_locations" in str(raised.value)
        assert raised.value.store is not None and "outside" in raised.value.store
    assert sorted(p.name for p in (places / "outside").iterdir()) == ["s.zarr"]


def test_the_list_cannot_be_changed_from_sql_or_given_as_one_string(places):
    ctx = zf.SessionContext(allowed_locations=[str(places / "inside")])
    for sql in ("SET zarrfusion.allowed_locations = ''", "RESET zarrfusion.allowed_locations"):
        with pytest.raises(zf.ZarrFusionError, match="when the session is built"):
            ctx.sql(sql)
    with pytest.raises(zf.ZarrPermissionError):
        ctx.sql(f"SET zarrfusion.work_dir = '{places / 'outside' / 'work'}'")
    assert not (places / "outside" / "work").exists()
    with pytest.raises(TypeError, match="list"):
        zf.SessionContext(allowed_locations=str(places / "inside"))
    with pytest.raises(ValueError, match="allowed_locations"):
        zf.SessionContext(allowed_locations=["s3://"])

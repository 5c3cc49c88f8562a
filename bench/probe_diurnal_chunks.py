"""Probe (issue 28): the diurnal mean and spread of every cell of the 1 GB store written to Zarr
in bands of latitudes, with chunks that span the bands and with chunks the bands meet.

A reduction in bands of a later dimension writes a band at a time; a chunk that a band boundary
cuts is written in parts (read back and encoded again by each band). This times the same COPY
with each chunk shape given, in one process, one after the other (the store removed between
runs), and prints the plan's ``streamed=`` line. Run after bench/make_era5.py:

    python bench/probe_diurnal_chunks.py hour=1,lat=721,lon=1440 hour=1,lat=181,lon=1440

Nothing is written to bench/RESULTS.md (copy the lines there).
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import zarrfusion as zf

STORE = Path(__file__).resolve().parent / "data" / "era5_1gb.zarr"


def main() -> None:
    out = Path(tempfile.mkdtemp(prefix="zf-diurnal-")) / "out.zarr"
    try:
        for chunks in sys.argv[1:]:
            shutil.rmtree(out, ignore_errors=True)
            ctx = zf.SessionContext(allowed_mem="2GB")
            ctx.register_zarr("era5", str(STORE))
            sql = ("COPY (SELECT extract(hour FROM time) AS hour, lat, lon, avg(t2m) AS m, "
                   "stddev_pop(t2m) AS s FROM era5 GROUP BY 1, 2, 3) "
                   f"TO '{out}' STORED AS ZARR OPTIONS ('dims' 'hour,lat,lon', 'chunks' '{chunks}', "
                   "'codec' 'zstd')")
            plan = str(ctx.sql("EXPLAIN " + sql).to_arrow_table().column(1)[1].as_py())
            started = time.perf_counter()
            ctx.sql(sql).to_arrow_table()
            seconds = time.perf_counter() - started
            streamed = re.search(r"streamed=[^,|]*", plan)
            print(f"{chunks}: {seconds:.2f} s, {streamed.group(0) if streamed else 'collected'}",
                  flush=True)
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)


if __name__ == "__main__":
    main()

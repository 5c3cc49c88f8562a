#!/usr/bin/env bash
# Two builds of the shell on the three FFT paths, alternating, with their
# outputs compared value for value: a check that a change to the FFT code
# (a refactor) changes neither answers nor speed nor memory.
#
#   bash bench/check_fft_paths.sh BEFORE_BIN AFTER_BIN [nt] [runs]
#
# The store is bench_fft.py's (float32 t2m, time nt x lat 721 x lon 1440,
# chunks (8, 145, 1440); nt 384 is 1.6 GB raw), written under
# bench/data/fft_paths_<nt>.zarr when missing with the test venv's
# zarr-python. Each build runs, in a fresh process at allowed_mem 1GB:
# - lines: COPY of fft along lat (whole lines in the store's chunks);
# - staged: COPY of fft along lat and lon with fft_strategy four_step
#   (the first dimension four-step into work_dir, then the second);
# - chained: COPY of ifft (real_dim) of a view of fft along lat with
#   fft_strategy four_step (the inner transform stored in work_dir first).
# Prints one line per run (build, path, wall seconds, peak RSS KB), then
# whether each array of the two builds' last outputs is identical.
set -euo pipefail
BEFORE=$1
AFTER=$2
NT=${3:-384}
RUNS=${4:-2}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-$HOME/.cache/zarrfusion-venv/bin/python}
STORE=$HERE/data/fft_paths_$NT.zarr
mkdir -p "$HERE/data"
WORK=$(mktemp -d "$HERE/data/fft-paths-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
"$PY" - "$HERE" "$STORE" "$NT" <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import bench_fft
bench_fft.STORE = Path(sys.argv[2])
bench_fft.make_store(int(sys.argv[3]))
EOF
fft="true_phase => false, true_amplitude => false, shift => false"
declare -A SQL=(
  [lines]="COPY (SELECT * FROM fft('era5', 't2m', dims => 'lat', $fft)) TO 'OUT' STORED AS ZARR"
  [staged]="COPY (SELECT * FROM fft('era5', 't2m', dims => 'lat,lon', $fft)) TO 'OUT' STORED AS ZARR"
  [chained]="COPY (SELECT * FROM ifft('spectrum', 't2m', dims => 'freq_lat', $fft, real_dim => 'freq_lat')) TO 'OUT' STORED AS ZARR"
)
for run in $(seq "$RUNS"); do
  for build in before after; do
    bin=$BEFORE; [ "$build" = after ] && bin=$AFTER
    for path in lines staged chained; do
      out=$WORK/$build-$path.zarr
      rm -rf "$out"
      /usr/bin/time -f "$build $path %e s %M KB" -o "$WORK/time" "$bin" -q -m 1GB \
        --work-dir "$WORK" \
        -c "CREATE EXTERNAL TABLE era5 STORED AS ZARR LOCATION '$STORE'" \
        -c "SET zarrfusion.fft_strategy = '$([ $path = lines ] && echo auto || echo four_step)'" \
        -c "CREATE VIEW spectrum AS SELECT * FROM fft('era5', 't2m', dims => 'lat', $fft)" \
        -c "${SQL[$path]//OUT/$out}" > /dev/null
      cat "$WORK/time"
    done
  done
done
"$PY" - "$WORK" <<'EOF'
import sys
import numpy as np
import zarr
work = sys.argv[1]
for path in ["lines", "staged", "chained"]:
    a = zarr.open_group(f"{work}/before-{path}.zarr", mode="r")
    b = zarr.open_group(f"{work}/after-{path}.zarr", mode="r")
    for name in sorted(a.array_keys()):
        same = np.array_equal(a[name][...], b[name][...], equal_nan=True)
        print(path, name, a[name].shape, a[name].dtype, "identical" if same else "DIFFERENT")
EOF

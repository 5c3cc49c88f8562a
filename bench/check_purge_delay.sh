#!/usr/bin/env bash
# The speed and RSS cost of making mimalloc return freed pages at once
# (MIMALLOC_PURGE_DELAY=0) against its default delay, on the three
# foundation queries over the local ERA5-like store (bench/make_era5.py).
# Each run is a fresh shell process; the two settings alternate.
#
#   bash bench/check_purge_delay.sh [runs]      # default 5 runs of each
#
# Prints one line per run: query, setting, wall seconds, peak RSS (KB),
# then the medians.
set -euo pipefail
Z=${ZARRFUSION_BIN:-$HOME/.cache/zarrfusion-target/debug/zarrfusion}
S=${STORE:-$(cd "$(dirname "$0")" && pwd)/data/era5_1gb.zarr}
RUNS=${1:-5}
declare -A QUERIES=(
  [Q1]="SELECT lat, avg(t2m) FROM era5 GROUP BY lat ORDER BY lat"
  [Q2]="SELECT count(*), avg(t2m) FROM era5 WHERE lat BETWEEN 30 AND 60 AND lon BETWEEN 0 AND 40 AND time >= TIMESTAMP '2020-01-03 18:00:00' AND time < TIMESTAMP '2020-01-06 12:00:00'"
  [Q3]="SELECT lat, lon, avg(t2m*t2m) FROM era5 GROUP BY lat, lon"
)
out=$(mktemp)
for q in Q1 Q2 Q3; do
  for _ in $(seq "$RUNS"); do
    for mode in default purge0; do
      if [ "$mode" = purge0 ]; then export MIMALLOC_PURGE_DELAY=0; else unset MIMALLOC_PURGE_DELAY; fi
      /usr/bin/time -f "%e %M" -o "$out.t" "$Z" -q --format csv \
        -c "CREATE EXTERNAL TABLE era5 STORED AS ZARR LOCATION '$S'" -c "${QUERIES[$q]}" > /dev/null
      echo "$q $mode $(cat "$out.t")" | tee -a "$out"
    done
  done
done
echo "median: query setting seconds peak-RSS-MB"
for q in Q1 Q2 Q3; do
  for mode in default purge0; do
    median() { awk -v q=$q -v m=$mode -v c="$1" '$1==q && $2==m {print $c}' "$out" | sort -n |
      awk '{v[NR]=$1} END {i=int((NR+1)/2); print (NR%2 ? v[i] : (v[i]+v[i+1])/2)}'; }
    echo "$q $mode $(median 3) $(( $(median 4 | cut -d. -f1) / 1024 ))"
  done
done
rm -f "$out" "$out.t"

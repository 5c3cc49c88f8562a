#!/usr/bin/env bash
# The 24-hour running mean of every cell of the local ERA5-like store
# (bench/make_era5.py, 1 GB, a whole map per hourly chunk) under memory
# limits its first plan does not fit: the blocks and partitions the window
# fits itself to (EXPLAIN), the wall time and the peak RSS of a fresh shell
# process, or the refusal with its numbers. Budgets alternate run by run.
#
#   bash bench/check_rolling_budget.sh [runs] [budgets...]   # default 3 runs of 2GB 1GB 512MB 300MB 256MB
#
# Prints one line per run: budget, wall seconds, peak RSS (KB), then each
# budget's plan (or refusal).
set -euo pipefail
Z=${ZARRFUSION_BIN:-$HOME/.cache/zarrfusion-target/debug/zarrfusion}
S=${STORE:-$(cd "$(dirname "$0")" && pwd)/data/era5_1gb.zarr}
RUNS=${1:-3}
shift || true
BUDGETS=("$@")
[ ${#BUDGETS[@]} -gt 0 ] || BUDGETS=(2GB 1GB 512MB 300MB 256MB)
Q="SELECT count(m) AS n, sum(m) AS m FROM (SELECT avg(t2m) OVER (PARTITION BY lat, lon ORDER BY time ROWS BETWEEN 23 PRECEDING AND CURRENT ROW) AS m FROM era5)"
run() {
  "$Z" -q --format csv -c "SET zarrfusion.allowed_mem = '$1'" \
    -c "CREATE EXTERNAL TABLE era5 STORED AS ZARR LOCATION '$S'" -c "$2"
}
t=$(mktemp)
for _ in $(seq "$RUNS"); do
  for b in "${BUDGETS[@]}"; do
    if /usr/bin/time -f "%e %M" -o "$t" bash -c "$(declare -f run); Z='$Z' S='$S' run '$b' \"\$0\"" "$Q" > /dev/null 2>&1; then
      echo "$b $(cat "$t")"
    else
      echo "$b refused"
    fi
  done
done
for b in "${BUDGETS[@]}"; do
  echo "== $b"
  run "$b" "EXPLAIN $Q" 2>&1 | grep -o "RollingWindowExec: [^|\"]*\|needs [^|\"]*" | head -1
done
rm -f "$t"

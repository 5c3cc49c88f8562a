#!/usr/bin/env bash
# Two builds of zarrfusion (the shell and the Python package) through the
# zarrfusion arm of the five peer benchmarks, alternating: a check that a
# change to the engine (a refactor) costs neither speed nor memory.
#
#   bash bench/check_before_after.sh BEFORE AFTER [reps] [benches]
#
# BEFORE and AFTER are folders, each with the shell binary `zarrfusion`
# and the Python package unpacked in `py/` (the wheel of
# `pip wheel --no-build-isolation --no-deps ./python`, built with
# MATURIN_PEP517_ARGS="--profile dev --locked", as CI builds it). `benches`
# is a subset of "sql quadratic rechunk fft loader" (default: all five);
# reps (default 2) alternations of before, then after. Each benchmark runs
# with --no-write and prints its own table; the stores are the benchmarks'
# own (bench/make_era5.py, bench_quadratic.py --make,
# bench/make_loader_data.py; bench_fft.py writes nt 384 when missing).
# Between runs it waits for the page cache's writes to reach the disk
# (`sync`), so that one run's written store does not slow the next.
set -euo pipefail
BEFORE=$1
AFTER=$2
REPS=${3:-2}
BENCHES=${4:-"sql quadratic rechunk fft loader"}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-$HOME/.cache/zarrfusion-venv/bin/python}
cd "$HERE/.."
for rep in $(seq 1 "$REPS"); do
    for build in before after; do
        dir=$BEFORE
        [ "$build" = after ] && dir=$AFTER
        export ZARRFUSION_BIN=$dir/zarrfusion PYTHONPATH=$dir/py
        for b in $BENCHES; do
            sync
            sleep 5
            echo "=== rep $rep $build $b $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
            case $b in
            sql) "$PY" bench/bench_sql.py --peers zarrfusion --quick --skip-million --no-write ;;
            quadratic) "$PY" bench/bench_quadratic.py --arms zarrfusion --no-write ;;
            rechunk) "$PY" bench/bench_rechunk.py --arms zarrfusion --no-write ;;
            fft) "$PY" bench/bench_fft.py --nt 384 --arms zarrfusion --no-write ;;
            loader) "$PY" bench/bench_loader.py --arms zarrfusion --quick --no-small --no-write ;;
            *) echo "unknown benchmark $b" >&2; exit 2 ;;
            esac
        done
    done
done

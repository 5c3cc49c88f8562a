"""Measuring a benchmark arm run in its own subprocess: wall time is the arm's
own (it prints a JSON object as its last line), peak RSS is that of the
process tree, sampled every 0.05 s."""

from __future__ import annotations

import json
from pathlib import Path
import subprocess
import time


def parse_mem(text: str) -> int:
    """Bytes in a size written like ``500MB`` or ``2GB`` (binary units)."""
    units = {"kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}
    t = text.strip().lower()
    for u, m in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * m)
    return int(t)


def tree_rss(proc) -> int:
    """Resident bytes of ``proc`` and its children."""
    import psutil

    try:
        ps = [proc] + proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in ps:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def run_child(cmd: list[str], timeout: float) -> dict:
    """Runs ``cmd``, killed after ``timeout`` seconds; returns the JSON object
    it printed last, with ``peak_rss``, or ``{"error": its last stderr line}``."""
    import psutil

    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = psutil.Process(p.pid)
    peak = 0
    started = time.perf_counter()
    while p.poll() is None:
        peak = max(peak, tree_rss(proc))
        time.sleep(0.05)
        if time.perf_counter() - started > timeout:
            p.kill()
    stdout, stderr = p.communicate()
    if p.returncode != 0:
        return {"error": (stderr.strip().splitlines() or ["?"])[-1][:300]}
    result = json.loads(stdout.strip().splitlines()[-1])
    result["peak_rss"] = peak
    return result


def report(lines: list[str], results: Path, write: bool) -> None:
    """Prints a results section and, when ``write``, appends it to ``results``."""
    text = "\n".join(lines)
    print(text)
    if write:
        with open(results, "a") as f:
            f.write("\n" + text + "\n")


def print_arm(r: dict, extra: str = "") -> None:
    """Prints an arm's line as it ends: its error, or its time, peak RSS,
    ``extra``, check and note."""
    if "error" in r:
        print(f"{r['arm']}: ERROR {r['error']}", flush=True)
        return
    print(f"{r['arm']}: {r['seconds']:.2f} s, peak RSS {r['peak_rss'] / 2**20:.0f} MiB{extra}, "
          f"check {r['check']} {r.get('note', '')}", flush=True)


def arm_table(results: list[dict], base: dict | None, budget: int, notes=None, digits: int = 2) -> list[str]:
    """The lines of a results table of arms run under ``budget`` bytes: seconds,
    how much faster the ``base`` arm was, peak RSS and how far over the budget,
    the check, and ``notes(result)`` (or the result's ``note``)."""
    lines = [
        "| arm | seconds | zarrfusion is | peak RSS MiB | RSS over allowed_mem MiB | check | notes |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['arm']} | - | - | - | - | error | {r['error']} |")
            continue
        ratio = "-"
        if base and r is not base:
            x = r["seconds"] / base["seconds"]
            ratio = f"{x:.{digits}f}x faster" if x >= 1 else f"{1 / x:.{digits}f}x slower"
        note = notes(r) if notes else r.get("note", "")
        lines.append(f"| {r['arm']} | {r['seconds']:.2f} | {ratio} | {r['peak_rss'] / 2**20:.0f} | "
                     f"{max(0, r['peak_rss'] - budget) / 2**20:.0f} | {r.get('check', '')} | {note} |")
    return lines


def arm_arguments(ap, arms: list[str], allowed_mem: str):
    """Adds the options every per-arm benchmark takes to ``ap`` and parses
    them; ``--child ARM DST MEM WORK THREADS`` is how an arm's subprocess is
    started (see :func:`run_arms`)."""
    import argparse
    import os

    ap.add_argument("--allowed-mem", default=allowed_mem)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--arms", default=",".join(arms))
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    return ap.parse_args()


def run_child_arm(a, child) -> bool:
    """In an arm's subprocess (``a.child`` set): runs ``child(arm, dst,
    mem, work, threads)`` and prints its JSON result; returns whether it did."""
    if not a.child:
        return False
    arm, dst, mem, work, threads = a.child
    print(json.dumps(child(arm, dst, mem, work, int(threads))))
    return True


def run_arms(script: str, a, tmp: Path, check, extra=None) -> list[dict]:
    """Runs each arm of ``a.arms`` as ``script --child ...`` in its own
    subprocess with a fresh output path and work_dir under ``tmp``; adds
    ``check(arm, dst)`` (and ``extra(arm, dst)``'s fields) to each result,
    removes the outputs and prints a line per arm."""
    import shutil
    import sys

    results = []
    for arm in a.arms.split(","):
        dst = tmp / f"{arm}.zarr"
        work = tmp / f"{arm}-work"
        work.mkdir()
        cmd = [sys.executable, script, "--child", arm, str(dst), a.allowed_mem, str(work), str(a.threads)]
        r = run_child(cmd, a.timeout)
        r["arm"] = arm
        if "error" not in r:
            r.update(extra(arm, dst) if extra else {}, check=check(arm, dst))
        shutil.rmtree(dst, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        for f in tmp.glob(f"{arm}.*.npy"):
            f.unlink()
        results.append(r)
        io = (f", read {r['read_bytes'] / 2**30:.2f} GiB, written {r['written_bytes'] / 2**30:.2f} GiB"
              if "read_bytes" in r else "")
        print_arm(r, io)
    return results

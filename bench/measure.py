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

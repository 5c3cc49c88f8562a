"""Runs a script in a fresh Python process and reports how much its peak
resident memory grew, for the tests that hold zarrfusion to a budget.

The peak is VmHWM from /proc/self/status, reset first through
/proc/self/clear_refs: ru_maxrss would carry the parent's peak across exec."""

from __future__ import annotations

import json
import subprocess
import sys

# Defines `status(key)` (bytes of a /proc/self/status field) and
# `reset_peak()` (sets VmHWM to the current RSS and returns that RSS).
HELPERS = """
import json
def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")
"""


def run_child(script: str) -> dict:
    """Runs `HELPERS` then `script` in a fresh interpreter; returns the JSON
    object the script prints on its last line."""
    done = subprocess.run([sys.executable, "-c", HELPERS + script], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])

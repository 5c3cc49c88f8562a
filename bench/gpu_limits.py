#!/usr/bin/env python3
"""The physical limits of benchmark 3's GPU path (issue 5), with CuPy.

    python3 bench/gpu_limits.py [--nt 1008]

Prints the host-to-device and device-to-host bandwidth of pageable and of
page-locked (pinned) host memory (1 GiB, best of three), and the time of
cuFFT along lat on benchmark 3's array shape (nt, 721, 1440) float32 held
on the device (best of three, after the first call that makes the plan).
With these, the least a transform of host data can take is its bytes over
the pinned bandwidth each way plus the on-device transform.
"""

from __future__ import annotations

import argparse
import time

import cupy as cp
import numpy as np


def bandwidth(n: int, pinned: bool) -> tuple[float, float]:
    if pinned:
        host = np.frombuffer(cp.cuda.alloc_pinned_memory(n * 4), np.float32, n)
    else:
        host = np.empty(n, np.float32)
    host[:] = 1.0
    device = cp.empty(n, cp.float32)
    up = down = float("inf")
    for _ in range(3):
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        device.set(host)
        cp.cuda.Device().synchronize()
        up = min(up, time.perf_counter() - t)
        t = time.perf_counter()
        device.get(out=host)
        cp.cuda.Device().synchronize()
        down = min(down, time.perf_counter() - t)
    return n * 4 / up / 1e9, n * 4 / down / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nt", type=int, default=1008)
    a = parser.parse_args()
    n = 1 << 28
    for pinned in (False, True):
        up, down = bandwidth(n, pinned)
        print(f"{'pinned' if pinned else 'pageable'}: host->device {up:.1f} GB/s, device->host {down:.1f} GB/s")
    x = cp.random.random((a.nt, 721, 1440), dtype=cp.float32)
    best = float("inf")
    for _ in range(4):
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        y = cp.fft.fft(x, axis=1)
        cp.cuda.Device().synchronize()
        best = min(best, time.perf_counter() - t)
        del y
    print(f"cuFFT along lat of ({a.nt}, 721, 1440) float32 on the device: {best:.3f} s")


if __name__ == "__main__":
    main()

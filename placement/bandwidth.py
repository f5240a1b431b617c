"""Memory bandwidths for the speed model: a short CPU read probe and the GPU's spec-sheet figure."""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

DEFAULT_GPU_BW = 500e9      # assumed when there is no GPU to ask: a typical 12 GB card (RTX 4070: 504 GB/s)

# Published peak memory bandwidth (bytes/s) by name fragment, for drivers that report no memory
# clock. Checked in order, so the more specific names come first.
KNOWN_GPU_BW: tuple[tuple[str, float], ...] = (
    ("H200", 4800e9), ("H100 PCIe", 2000e9), ("H100", 3350e9), ("A100-SXM4-80GB", 2039e9),
    ("A100", 1555e9), ("L40S", 864e9), ("L4", 300e9), ("A10", 600e9), ("T4", 320e9),
    ("RTX 5090", 1792e9), ("RTX 4090", 1008e9), ("RTX 4080", 717e9), ("RTX 4070 Ti", 504e9),
    ("RTX 4070", 504e9), ("RTX 4060 Ti", 288e9), ("RTX 3090", 936e9), ("RTX 3080", 760e9),
    ("RTX 3060", 360e9),
)


def gpu_peak_bandwidth(name: str, memory_clock_khz: int = 0, bus_width_bits: int = 0) -> float | None:
    """Peak bandwidth from the memory clock and bus width (double data rate), else by card name."""
    if memory_clock_khz > 0 and bus_width_bits > 0:
        return 2.0 * memory_clock_khz * 1e3 * bus_width_bits / 8
    for fragment, bw in KNOWN_GPU_BW:
        if fragment.lower() in name.lower():
            return bw
    return None


def measure_cpu_bandwidth(nbytes: int = 256 << 20, repeats: int = 8, threads: int | None = None) -> float:
    """Read bandwidth in bytes/s: every core takes the maximum of its slice of a buffer larger than
    most caches (numpy's reductions release the GIL, so threads read in parallel as the matvecs do).
    The maximum of unsigned 64-bit integers: numpy's widest-SIMD reduction, so the cores wait on
    memory, not on the arithmetic. A float32 sum (pairwise, ~15 GB/s) or an int64 sum (~25) read
    too low on the Xeon of BENCHMARKS.md's "Mission size" section, where this reads 30-31 GB/s and
    the Q6_K matvec streams at 28-29. Best of `repeats`; 256 MiB: ~0.1 s to fill on a desktop
    (0.6 s in that VM, whose first touch of a page is slow), a 64 MiB buffer sits partly in a
    server's L3."""
    threads = threads or os.cpu_count() or 1
    buf = np.ones(nbytes // 8, dtype=np.uint64)
    chunks = np.array_split(buf, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(np.max, chunks))
            best = min(best, time.perf_counter() - t0)
    return buf.nbytes / best

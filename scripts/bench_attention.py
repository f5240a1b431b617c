"""Time the fused CPU trunk's attention kernel (layer_fused._attend_serial: one decode token's
heads over its keys, scores + softmax + weighted values) at a few context lengths.

    python scripts/bench_attention.py [--heads 9 --kv-heads 3 --head-dim 64] [--keys 128,1024,4096]

Compare two trees by running it under each (PYTHONPATH=TREE, a fresh NUMBA_CACHE_DIR per tree).
One thread; prints min and median microseconds per call over --reps calls.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from cpu_kernels import layer_fused


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2-135M: 9)")
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--keys", default="128,1024,4096", help="context lengths (keys seen by the token)")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    keys = [int(x) for x in args.keys.split(",")]
    if min(keys) < 1 or args.head_dim < 1 or args.kv_heads < 1 or args.heads % args.kv_heads:
        ap.error("--keys and --head-dim must be positive, --heads a multiple of --kv-heads")
    rng = np.random.default_rng(0)
    d, n_head, n_kv = args.head_dim, args.heads, args.kv_heads
    q = rng.standard_normal((1, n_head * d)).astype(np.float32)
    o = np.zeros((1, n_head * d), np.float32)
    for n_keys in keys:
        kc, vc = (rng.standard_normal((n_keys, n_kv, d)).astype(np.float32) for _ in range(2))
        call = (q, kc, vc, o, n_keys - 1, n_head, n_kv, d, d, 1.0 / d ** 0.5, 0, 0)
        layer_fused._attend_serial(*call)
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            layer_fused._attend_serial(*call)
            times.append(time.perf_counter() - t0)
        print(f"{n_head} heads ({n_kv} kv) x {n_keys} keys, d={d}: min {min(times) * 1e6:.0f} us, "
              f"median {statistics.median(times) * 1e6:.0f} us")


if __name__ == "__main__":
    main()

"""Time the fused CPU trunk's attention kernel (kv_attention.attend: one decode token's heads over
its keys, scores + softmax + weighted values) at a few context lengths.

    python scripts/bench_attention.py [--heads 9 --kv-heads 3 --head-dim 64] [--keys 128,1024,4096] [-t 1] [-ctk f16]

Compare two trees by running it under each (PYTHONPATH=TREE, a fresh NUMBA_CACHE_DIR per tree).
Prints min and median microseconds per call over --reps calls, and the cache's bytes read per
second (K and V once per token).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from cpu_kernels import kv_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2-135M: 9)")
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--keys", default="128,1024,4096", help="context lengths (keys seen by the token)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("-ctk", "--cache-type", choices=("f16", "f32"), default="f16", help="K and V cache storage")
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
        if args.cache_type == "f16":
            kc, vc = (x.astype(np.float16).view(np.uint16) for x in (kc, vc))
        call = (args.threads, q, kc, vc, o, n_keys - 1, n_head, n_kv, d, d, np.float32(1.0 / d ** 0.5), 0, 0)
        kv_attention.attend(*call)
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            kv_attention.attend(*call)
            times.append(time.perf_counter() - t0)
        gbps = (kc.nbytes + vc.nbytes) / min(times) / 1e9
        print(f"{n_head} heads ({n_kv} kv) x {n_keys} keys, d={d}, {args.cache_type}, {args.threads} thread(s): "
              f"min {min(times) * 1e6:.0f} us, median {statistics.median(times) * 1e6:.0f} us, {gbps:.1f} GB/s")


if __name__ == "__main__":
    main()

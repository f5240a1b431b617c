#!/usr/bin/env python3
"""Benchmark cpu_kernels.matvec against this machine's memory read bandwidth and a torch baseline.

    python scripts/bench_matvec.py [--quick] [--json PATH] [--threads N] [--kernel int|float|both] [--cpu-time]
                                   [--ks 1,2,3,4,8] [--types Q4_K,Q8_0] [--shapes LABELS] [--baseline DIR]
                                   [--pool-mib 2048]

1. Read bandwidth: a parallel Numba streaming sum over a --pool-mib float32 array, best of 3.
2. For each type, FFN shape and k in {1, 2, 3, 4, 8}: median time of `matvec` on random valid
   blocks. "cold": every call reads a different copy of the matrix, copies spanning --pool-mib
   (default 2048 MiB: 4x the 480 MiB L3 of the dev machine; 512 MiB before 2026-11-23, which that
   L3 mostly held), as a real decode step streams weights from DRAM; the copies are taken in turn
   across kernels and k (before 2026-11-26 each kernel's cold calls read the same 9 copies, so on
   matrices of a few MB the second kernel, e.g. --baseline's, read them from the L3). "hot": the same
   copy every call (it may sit in cache: the kernel's compute-bound speed). Reported per row:
   weight GB/s (bytes of quantized weights / time), % of the measured bandwidth, multiply-adds/s,
   and per-token cost relative to k=1 ((ms_k / k) / ms_1). Times are medians over rounds that call
   every (k, kernel) once in turn, so a drift of the VM's speed reaches all of them alike (since
   2026-11-26; before, each row's calls ran back to back). Minimums also go to the JSON: on a
   shared machine the minimum shows the kernel, the median the neighbours.
   --kernel: "int" is matvec's default (matvec_int: int8 activations, integer dot products with
   the lowering simd_int picked, e.g. "int-avx512vnni"), "float" the exact path (exact=True),
   "both" (default) runs each row with both, side by side; the JSON rows carry a "kernel" field.
3. torch baseline: the matrix dequantized once to float32, then `torch.matmul(x, W.T)`.
4. First matvec call in a fresh process with a warm Numba cache (import + call).
5. Issue 11's targets per matrix: k=1's % of the bandwidth and each k's time over k=1's (the
   first --ks value), from the medians and the minimums.

--repeats N: the timed rounds (default 5 with --quick, else 9).
--quick: Q4_K, Q5_K, Q6_K, Q8_0, Q4_0 on the Qwen3.6-27B FFN shapes only (< 3 minutes on 2 threads).
--ks: the token counts (default 1,2,3,4,8; e.g. 1,4,8,16,64 for prompt batches); --types: a subset.
--shapes: shape labels, e.g. "gemma3-270m output,qwen3.6-27b up" (the output layer only when named),
or ROWSxCOLS (e.g. 131072x1536).
--baseline DIR: also time DIR/cpu_kernels (an older copy, e.g. `git archive REV cpu_kernels | tar -x
-C DIR`) imported under another name, each row right after the current kernel's: before/after side
by side in one run (kernel "int-base" / "float-base").
--tiled-from N / --lanes-from N: run this tree's k >= N on the tiled kernels / on token lanes (path
crossovers, e.g. --types Q4_0 --ks 12,16 --lanes-from 1 against --lanes-from 999).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

import numba
import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize
from numba import njit, prange

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from cpu_kernels.formats import SUPPORTED_TYPES, format_of  # noqa: E402
from cpu_kernels.matvec import matvec  # noqa: E402
from cpu_kernels import matvec_tiled  # noqa: E402
from cpu_kernels.matvec_int import INT_TYPES  # noqa: E402
from cpu_kernels.matvec_testdata import F16_FIELDS  # noqa: E402
from cpu_kernels.simd_int import ISA  # noqa: E402

# (label, rows, cols): rows = outputs, cols = inputs; FFN up/gate (n_embd -> n_ff) and down.
SHAPES = [
    ("qwen3.6-27b up", 17408, 5120), ("qwen3.6-27b down", 5120, 17408),
    ("smollm2-135m up", 1536, 576), ("smollm2-135m down", 576, 1536),
    ("gemma3-270m up", 2048, 640), ("gemma3-270m down", 640, 2048),
]
# only with --shapes: the vocabulary projection, Gemma 3's largest matrix (~2/3 of a decode step)
EXTRA_SHAPES = [("gemma3-270m output", 262144, 640)]
QUICK_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q4_0)
KS = (1, 2, 3, 4, 8)
POOL_MIB = 2048     # > 4x the last-level cache of the machines this runs on (480 MiB L3 the largest)


@njit(parallel=True, nogil=True, fastmath=True, cache=True)
def _stream_sum(a, n_parts):
    partial = np.zeros(n_parts, np.float32)
    for p in prange(n_parts):
        seg = a[p * a.size // n_parts:(p + 1) * a.size // n_parts]
        s = np.float32(0.0)
        for i in range(seg.size):
            s += seg[i]
        partial[p] = s
    return partial.sum()


# Wall clock by default; --cpu-time (with --threads 1) uses the calling thread's CPU time, which a
# wait for a time slice does not inflate: on a shared machine the 2-thread wall times snap to the
# scheduler's 4 ms slices, and CPU time is then the only steady measure of the kernel (memory
# stalls still count: the core is busy waiting for them).
CLOCK = time.perf_counter


def read_bandwidth_gbps(n_bytes: int = 1 << 30, repeats: int = 3) -> float:
    a = np.ones(n_bytes // 4, np.float32)
    n_parts = 4 * numba.get_num_threads()
    _stream_sum(a, n_parts)
    best = math.inf
    for _ in range(repeats):
        t0 = CLOCK()
        _stream_sum(a, n_parts)
        best = min(best, CLOCK() - t0)
    return a.nbytes / best / 1e9


class WeightPool:
    """n_bytes of random bytes; per type the float16 fields of every block are made finite."""

    def __init__(self, rng: np.random.Generator, n_bytes: int):
        self.bytes = rng.integers(0, 256, n_bytes, dtype=np.uint8)
        self.rng = rng
        self.qtype = None

    def matrices(self, qtype: int, rows: int, cols: int) -> list[np.ndarray]:
        fmt = format_of(qtype)
        nbytes = rows * fmt.row_bytes(cols)
        if qtype != self.qtype:
            self._fill(qtype, fmt)
            self.qtype = qtype
        n = max(1, self.bytes.size // nbytes)
        return [self.bytes[i * nbytes:(i + 1) * nbytes].reshape(rows, -1) for i in range(n)]

    def _fill(self, qtype, fmt) -> None:
        if qtype in (T.F32, T.F16, T.BF16):
            itemsize = 4 if qtype == T.F32 else 2
            values = self.rng.standard_normal(self.bytes.size // itemsize).astype(np.float32)
            if qtype == T.F16:
                values = values.astype(np.float16)
            elif qtype == T.BF16:
                values = (values.view(np.uint32) >> 16).astype(np.uint16)
            self.bytes[:] = values.view(np.uint8)
        else:
            blocks = self.bytes[: self.bytes.size // fmt.block_bytes * fmt.block_bytes].reshape(-1, fmt.block_bytes)
            for off in F16_FIELDS[T(qtype)]:
                scale = self.rng.uniform(1e-3, 2e-2, blocks.shape[0]).astype(np.float16)
                blocks[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)


def time_ms(fn, repeats: int) -> tuple[float, float]:
    """(median, min) wall time of fn(i) for i < repeats, in ms."""
    times = []
    for i in range(repeats):
        t0 = CLOCK()
        fn(i)
        times.append(CLOCK() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3


def time_interleaved(fns, repeats: int) -> list[tuple[float, float]]:
    """(median, min) wall time of each fn in ms, over `repeats` rounds that call every fn once."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for t, fn in zip(times, fns):
            t0 = CLOCK()
            fn()
            t.append(CLOCK() - t0)
    return [(statistics.median(t) * 1e3, min(t) * 1e3) for t in times]


def first_call_seconds() -> float:
    """Import + first matvec in a fresh interpreter (after this process filled the cache)."""
    code = ("import time; t = time.perf_counter(); import numpy as np; "
            "from cpu_kernels.matvec import matvec; "
            "matvec(np.zeros((4, 144), np.uint8), 12, np.ones((1, 256), np.float32)); "
            "print(time.perf_counter() - t)")
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def load_baseline(root: str):
    """DIR/cpu_kernels imported as the package `cpu_kernels_baseline`; returns its matvec."""
    import importlib.util

    pkg = os.path.join(os.path.abspath(root), "cpu_kernels")
    spec = importlib.util.spec_from_file_location("cpu_kernels_baseline", os.path.join(pkg, "__init__.py"),
                                                  submodule_search_locations=[pkg])
    module = importlib.util.module_from_spec(spec)
    sys.modules["cpu_kernels_baseline"] = module
    spec.loader.exec_module(module)
    return importlib.import_module("cpu_kernels_baseline.matvec").matvec


def _row(qtype, label, rows, cols, k, kernel, cold, cold_min, hot, hot_min, torch_ms, base_ms, nbytes, bw) -> dict:
    """One result row (times in ms; per_token_vs_k1 against the same kernel's k=1 time)."""
    gbps = nbytes / cold / 1e6
    return {
        "type": T(qtype).name, "shape": label, "rows": rows, "cols": cols, "k": k, "kernel": kernel,
        "ms": round(cold, 4), "weight_gbps": round(gbps, 2), "pct_of_bw": round(100 * gbps / bw, 1),
        "per_token_vs_k1": round(cold / k / base_ms, 3),
        "gmacs": round(rows * cols * k / cold / 1e6, 2),
        "ms_min": round(cold_min, 4), "ms_hot": round(hot, 4), "ms_hot_min": round(hot_min, 4),
        "weight_gbps_hot": round(nbytes / hot / 1e6, 2),
        "torch_ms": round(torch_ms, 4), "weight_bytes": int(nbytes),
    }


def print_targets(rows: list[dict], ks: list[int], bw: float) -> None:
    """Issue 11's targets per matrix and kernel: k=1's share of the read bandwidth, and each k's
    call time over k=1's (k=4 <= 1.25x, k=8 <= 1.6x), from the medians and from the minimums."""
    by_key: dict[tuple, dict[int, dict]] = {}
    for r in rows:
        by_key.setdefault((r["type"], r["shape"], r["kernel"]), {})[r["k"]] = r
    base = ks[0]
    print(f"\ntargets: % of bandwidth at k={base}, and time(k) / time(k={base}), median (min)")
    for (qtype, shape, kernel), per_k in by_key.items():
        if base not in per_k:
            continue
        b = per_k[base]
        pct_min = 100 * b["weight_bytes"] / b["ms_min"] / 1e6 / bw
        line = f"{qtype:7} {shape:18} {kernel:20} {b['pct_of_bw']:5.1f} ({pct_min:5.1f}) %bw"
        for k in ks[1:]:
            if k in per_k:
                line += f"  k={k}: {per_k[k]['ms'] / b['ms']:5.2f} ({per_k[k]['ms_min'] / b['ms_min']:5.2f})x"
        print(line)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 main types, 27B shapes, fewer repeats")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--pool-mib", type=int, default=POOL_MIB,
                    help="MiB the cold copies of each matrix span, and the bandwidth probe reads (keep it well above the L3)")
    ap.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    ap.add_argument("--kernel", choices=("int", "float", "both"), default="both",
                    help="matvec's default integer kernel, the exact float kernel, or both (default)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time with the thread's CPU time (use with --threads 1 on a busy machine)")
    ap.add_argument("--repeats", type=int, help="timed rounds, cold and hot each; a round calls every (k, kernel) "
                    "once (default: 5 with --quick, else 9; more for steadier medians on a noisy machine)")
    ap.add_argument("--ks", default=",".join(map(str, KS)), help="token counts, comma-separated (first: the base)")
    ap.add_argument("--types", help="quant types, comma-separated (default: --quick's or all)")
    ap.add_argument("--shapes", help="shape labels or ROWSxCOLS, comma-separated (default: --quick's or all but "
                    + ", ".join(x[0] for x in EXTRA_SHAPES) + ")")
    ap.add_argument("--baseline", help="a directory holding an older cpu_kernels to time side by side")
    ap.add_argument("--tiled-from", type=int, help="override matvec_tiled.tiled_min_k (this tree only): "
                    "the k from which the tiled kernels run instead of the row kernels")
    ap.add_argument("--lanes-from", type=int, help="override matvec_tiled.LANES_MIN_K for both kinds and every type, "
                    "the ones kept on quads on AVX2 too (this tree only): the k from which the tiled kernels run "
                    "on token lanes instead of token quads")
    args = ap.parse_args(argv)
    if args.pool_mib < 512:     # the pool holds at least one copy of the largest matrix (F32, 27B shape: 356 MB)
        ap.error(f"--pool-mib must be at least 512, got {args.pool_mib}")
    if args.repeats is not None and args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    ks = [int(k) for k in args.ks.split(",")]
    if args.tiled_from is not None:         # path crossovers: time one path against the other
        matvec_tiled.TILED_MIN_K = args.tiled_from
    if args.lanes_from is not None:
        matvec_tiled.LANES_MIN_K.update(k=args.lanes_from, pair=args.lanes_from)
        matvec_tiled.QUADS_ON_YMM = frozenset()     # every type, whatever the lowering
    if args.cpu_time:
        if args.threads != 1:
            ap.error("--cpu-time measures one thread: use --threads 1")
        global CLOCK
        CLOCK = time.thread_time
    numba.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)

    types = QUICK_TYPES if args.quick else [T(t) for t in SUPPORTED_TYPES]
    if args.types:
        names = {q.name: q for q in map(T, SUPPORTED_TYPES)}     # q4_k as Q4_K, as llama.cpp's tools take them
        wanted = [x.strip().upper() for x in args.types.split(",")]
        unknown = [x for x in wanted if x not in names]
        if unknown:
            ap.error(f"--types: unknown {', '.join(unknown)}; known: {', '.join(names)}")
        types = [names[x] for x in wanted]
    shapes = SHAPES[:2] if args.quick else SHAPES
    if args.shapes:
        known = {x[0]: x for x in SHAPES + EXTRA_SHAPES}
        wanted = [x.strip() for x in args.shapes.split(",")]
        unknown = [x for x in wanted if x not in known and not re.fullmatch(r"[1-9]\d*x[1-9]\d*", x)]
        if unknown:
            ap.error(f"--shapes: unknown {', '.join(unknown)}; known: {', '.join(known)}, or ROWSxCOLS")
        shapes = [known[x] if x in known else (x, *map(int, x.split("x"))) for x in wanted]
    repeats = args.repeats or (5 if args.quick else 9)
    rng = np.random.default_rng(0)

    pool_bytes = args.pool_mib << 20
    bw = read_bandwidth_gbps(pool_bytes)
    clock = "thread CPU time" if args.cpu_time else "wall clock"
    print(f"threads {args.threads}; {clock}; read bandwidth (parallel streaming sum, {args.pool_mib} MiB, best of 3): "
          f"{bw:.1f} GB/s; weights cycle through {args.pool_mib} MiB")
    pool = WeightPool(rng, pool_bytes)
    rows_out = []
    kernels = ("int", "float") if args.kernel == "both" else (args.kernel,)
    fns = {"int": matvec, "float": matvec}
    if args.baseline:
        fns.update({"int-base": load_baseline(args.baseline), "float-base": None})
        fns["float-base"] = fns["int-base"]
        kernels = tuple(x for kern in kernels for x in (kern, f"{kern}-base"))
    print(f"integer lowering: {ISA}")
    hdr = f"{'type':7} {'shape':18} {'kernel':20} {'k':>2} {'cold ms':>8} {'GB/s':>6} {'%bw':>5} {'GMAC/s':>7} {'tok/k1':>6} " \
          f"{'hot ms':>7} {'torch ms':>8}"
    print(hdr)
    for qtype in types:
        for label, rows, cols in shapes:
            if cols % format_of(qtype).block_elems:      # e.g. a K type on Gemma 3's 640 inputs
                print(f"{qtype.name:7} {label:18} skipped: {cols} inputs are not whole {qtype.name} blocks")
                continue
            mats = pool.matrices(qtype, rows, cols)
            w_hot = mats[0]
            # cold copies in turn (stride 7 where it walks them all): none read twice before the pool wraps
            spare = max(1, len(mats) - 1)
            stride = 7 if math.gcd(7, spare) == 1 else 1
            turn = itertools.count()

            def cold_copy():
                return mats[(1 + next(turn) * stride % spare) % len(mats)]
            w_f32 = torch.from_numpy(dequantize(w_hot, qtype).astype(np.float32))
            # every (k, kernel) call of a repeat before the next repeat: the VM's speed drifts by up to
            # 2x within a minute, and timed one after another k = 1 and k = 8 (or a kernel and its
            # --baseline) could fall in different phases of it (docs/history.md, "Zen 5: row lanes for one
            # token and Q4_0's batches")
            cases = []
            xs = {k: rng.standard_normal((k, cols)).astype(np.float32) for k in ks}
            for k, x in xs.items():
                out = np.empty((k, rows), np.float32)
                for kernel in kernels:
                    if kernel.startswith("int") and int(qtype) not in INT_TYPES:
                        continue
                    fns[kernel](w_hot, qtype, x, out, exact=kernel.startswith("float"))     # compile / warm up
                    cases.append((k, kernel, x, out))

            def run_case(case, w):
                _, kernel, x, out = case
                fns[kernel](w, qtype, x, out, exact=kernel.startswith("float"))
            cold = time_interleaved([lambda c=c: run_case(c, cold_copy()) for c in cases], repeats)
            hot = time_interleaved([lambda c=c: run_case(c, w_hot) for c in cases], repeats)
            torch_ms = {}
            for k, x in xs.items():
                xt = torch.from_numpy(x)
                torch.matmul(xt, w_f32.T)
                torch_ms[k], _ = time_ms(lambda i: torch.matmul(xt, w_f32.T), repeats)
            base_ms = {}
            for (k, kernel, _, _), (c_med, c_min), (h_med, h_min) in zip(cases, cold, hot):
                name = kernel.replace("int", f"int-{ISA}", 1) if kernel.startswith("int") else kernel
                base_ms.setdefault(kernel, c_med)
                row = _row(qtype, label, rows, cols, k, name, c_med, c_min, h_med, h_min, torch_ms[k],
                           base_ms[kernel], w_hot.nbytes, bw)
                rows_out.append(row)
                print(f"{row['type']:7} {label:18} {name:20} {k:>2} {c_med:8.2f} {row['weight_gbps']:6.1f} "
                      f"{row['pct_of_bw']:5.1f} {row['gmacs']:7.1f} {row['per_token_vs_k1']:6.2f} {h_med:7.2f} "
                      f"{torch_ms[k]:8.2f}", flush=True)
            del w_f32
    print_targets(rows_out, ks, bw)
    first = first_call_seconds()
    print(f"first matvec call in a fresh process, warm cache (import + call): {first:.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"read_bw_gbps": round(bw, 2), "pool_mib": args.pool_mib, "threads": args.threads, "quick": args.quick,
                       "isa": ISA, "cpu_time": args.cpu_time,
                       "first_call_warm_cache_s": round(first, 3), "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()

"""Where a decode step's time goes, fused CPU trunk next to the torch trunk, in one run.

    python scripts/profile_decode.py [MODEL] [-t 2] [-n 40] [--reps 3] [--cpu-time]
    python scripts/profile_decode.py MODEL -t 1 --cpu-time --k 1,2,3,4,5,6,7,8 [-n 4] [--reps 2]
Loads the model twice: with the fused layer kernels (cpu_kernels/layer_fused.py and gdn_block.py:
one Numba call per attention half, FFN half, Gated DeltaNet half and MoE FFN half) and with HYBRIDRT_FUSED_LAYERS=0's torch trunk ops. Their entry
points are wrapped with timers; the two alternate, n decode steps each after a warm-up, best of
--reps, and the output head is also timed alone. --cpu-time: the calling thread's CPU time instead
of wall time (use with -t 1, where all the work is on that thread; immune to other processes'
load on a shared machine). --k: the fused trunk alone, verify-sized batches of each k instead (each
step keeps its first token, as a verify does, so a recurrent state rolls back within its ring), the
parts of a step per k.
"""
from __future__ import annotations

import argparse
import time

import torch

import hybridrt.runtime.backends.cpu as cpu_backends
from cpu_kernels import gdn_block, layer_fused, moe_block
from hybridrt.runtime.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--n-steps", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cpu-time", action="store_true")
    ap.add_argument("--k", default="", help="comma-separated batch sizes: the fused trunk's verify-sized steps")
    args = ap.parse_args()
    clock = time.thread_time if args.cpu_time else time.perf_counter

    parts = ("attention half", "GDN half", "FFN half", "MoE half", "matvec", "ffn_glu")
    spent = dict.fromkeys(parts, 0.0)

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += clock() - t0
        return wrapper

    layer_fused.attention_block = timed("attention half", layer_fused.attention_block)
    layer_fused.ffn_block = timed("FFN half", layer_fused.ffn_block)
    gdn_block.gdn_block = timed("GDN half", gdn_block.gdn_block)
    moe_block.moe_block = timed("MoE half", moe_block.moe_block)
    cpu_backends.matvec = timed("matvec", cpu_backends.matvec)
    cpu_backends.ffn_glu = timed("ffn_glu", cpu_backends.ffn_glu)

    if args.k:
        by_batch(args, [int(k) for k in args.k.split(",")], clock, spent, parts)
        return
    runs = {}
    for fused in (True, False):
        runs["fused" if fused else "torch trunk"] = load_model(args.model, threads=args.threads, fused_layers=fused)
    m = runs["fused"]
    buf = torch.empty(1, m.n_vocab)
    best = {}
    for _ in range(args.reps):
        for name, model in runs.items():
            # a fresh session per rep: a recurrent (qwen35) state cannot roll back past its last batch
            s = model.session(256)
            s.eval(list(range(100, 120)), logits="last")
            for _ in range(5):
                s.eval([500], logits="last", out=buf)
            spent.update(dict.fromkeys(parts, 0.0))
            t0 = clock()
            for _ in range(args.n_steps):
                s.eval([500], logits="last", out=buf)
            total = (clock() - t0) / args.n_steps * 1e3
            if name not in best or total < best[name][0]:
                best[name] = (total, {p: v / args.n_steps * 1e3 for p, v in spent.items()})
    x = torch.randn(1, m.n_embd)
    head = float("inf")
    for _ in range(args.reps):
        t0 = clock()
        for _ in range(args.n_steps):
            m.output(x, out=buf)
        head = min(head, (clock() - t0) / args.n_steps * 1e3)
    print(f"{m.gguf.path}, {args.threads} threads, {'CPU' if args.cpu_time else 'wall'} time, "
          f"best of {args.reps} x {args.n_steps} steps; output head alone {head:.2f} ms")
    for name, (total, p) in best.items():
        kernels = " + ".join(f"{k} {v:.2f}" for k, v in p.items() if v > 0)
        print(f"  {name:12s} {total:6.2f} ms/token = {kernels} + other {total - sum(p.values()):.2f}")
    print(f"  fused / torch trunk speed: {best['torch trunk'][0] / best['fused'][0]:.2f}x")


def by_batch(args, ks: list[int], clock, spent: dict, parts: tuple) -> None:
    """Steps of k tokens (each keeps its first: the next starts one position on), best of --reps."""
    m = load_model(args.model, threads=args.threads)
    # each step leaves one token in the context: 20 prompt tokens, then (1 + n_steps) per k per rep
    s = m.session(20 + args.reps * len(ks) * (1 + args.n_steps) + max(ks), k_max=max(ks))
    s.eval(list(range(100, 120)), logits="last")
    best: dict[int, tuple[float, dict]] = {}

    def step(k: int) -> None:
        p = s.n_past
        s.eval(list(range(300, 300 + k)), logits="all")
        s.truncate(p + 1)

    for _ in range(args.reps):
        for k in ks:
            step(k)                                 # warm this batch size's kernels
            spent.update(dict.fromkeys(parts, 0.0))
            t0 = clock()
            for _ in range(args.n_steps):
                step(k)
            total = (clock() - t0) / args.n_steps * 1e3
            if k not in best or total < best[k][0]:
                best[k] = (total, {p: v / args.n_steps * 1e3 for p, v in spent.items()})
    print(f"{m.gguf.path}, {args.threads} threads, {'CPU' if args.cpu_time else 'wall'} time, "
          f"best of {args.reps} x {args.n_steps} steps of k tokens")
    for k, (total, p) in best.items():
        kernels = " + ".join(f"{name} {v:.1f}" for name, v in p.items() if v > 0)
        print(f"  k = {k}: {total:7.1f} ms = {kernels} + other {total - sum(p.values()):.1f}")


if __name__ == "__main__":
    main()

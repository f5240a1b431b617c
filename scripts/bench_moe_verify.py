#!/usr/bin/env python3
"""Grouped-by-expert CPU verify: routed-expert bytes read and time per step vs the batch size k.

    python scripts/bench_moe_verify.py [--model FILE] [--experts 256] [--used 8] [--n-embd 512]
                                       [--ff 256] [--trials 30] [--threads N] [--json PATH]

A verify step of k tokens through one qwen35moe layer's routed experts, on the CPU (the mmap, as a
plan leaves them): each token's router picks `used` of `experts`. "grouped" is hybridrt's path
(`RoutedExperts`): each touched expert's fused k-input FFN runs once over the tokens routed to it, so
its weights are read once per step. "separate" runs the same experts one token at a time, reading
an expert again for every token that chose it (k x used expert reads). Bytes are quantized weight
bytes read from the experts' tensors; times are medians over `trials` random batches (new inputs,
so new routes, every trial; the JSON has minimums too: on a shared machine the minimum shows the
kernels, the median the neighbours). "expected" is the bandwidth model's share for independent routing,
experts x (1 - (1 - used/experts)^k) experts read, the planner's formula.

Without --model the file is a tiny-but-wide Q4_K_M qwen35moe from scripts/make_model.py (one layer
pair, 1-2 minutes to build the first time, cached in the temp dir): the default 256 experts with 8
used is the Qwen3.6-35B-A3B ratio; the experts are narrower (n_embd 512, ff 256, so the file stays
small) but the share of experts a batch touches depends only on the ratio and the routes.
Random weights route random inputs close to independently; real text routes consecutive tokens to
the same experts more often, so real savings are at least these.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def build_file(experts: int, used: int, n_embd: int, ff: int) -> Path:
    import make_model

    path = Path(tempfile.gettempdir()) / f"bench-moe-{experts}x{used}-{n_embd}-{ff}.gguf"
    if not path.exists():
        dims = dict(n_layer=2, n_embd=n_embd, n_head=4, n_head_kv=2, head_dim=128, n_rot=64,
                    ssm_head_dim=128, ssm_k_heads=2, ssm_v_heads=4, n_expert=experts, n_expert_used=used,
                    n_ff_exp=ff, n_ff_shexp=ff)
        make_model.write_model(path, "qwen35moe", mix="q4_k_m", seed=0, dims=dims)
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a qwen35moe / qwen3next GGUF (default: build a tiny-but-wide one)")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--used", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--ff", type=int, default=256, help="expert FFN width")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None, help="Numba and torch threads (default: all)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    import numba
    import torch

    from hybridrt.runtime.loader import load_model

    if args.threads:
        numba.set_num_threads(args.threads)
        torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else build_file(args.experts, args.used, args.n_embd, args.ff)
    model = load_model(path)
    ffn = model.layers[args.layer].ffn.ffn         # the FFN half's MoE
    experts = ffn.experts
    n_expert, n_used = len(experts.experts), ffn.n_used
    per_expert = experts.experts[0].nbytes
    rng = np.random.default_rng(0)

    def routes(k: int):
        x = torch.from_numpy(rng.standard_normal((k, model.n_embd)).astype(np.float32))
        probs = torch.softmax(ffn.router(x), dim=-1)
        top_p, top_e = torch.topk(probs, n_used, dim=-1)
        return x, top_e, top_p / top_p.sum(-1, keepdim=True)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    experts(*routes(8))                 # compile / warm the kernels before timing
    rows = []
    for k in range(1, 9):
        grouped_t, separate_t, touched = [], [], []
        for _ in range(args.trials):
            x, top_e, w = routes(k)
            touched.append(len(torch.unique(top_e)))
            grouped_t.append(timed(lambda: experts(x, top_e, w)))
            separate_t.append(timed(lambda: [experts(x[i:i + 1], top_e[i:i + 1], w[i:i + 1]) for i in range(k)]))
        grouped_b = statistics.mean(touched) * per_expert
        separate_b = k * n_used * per_expert
        expected = n_expert * (1 - (1 - n_used / n_expert) ** k)
        rows.append({"k": k, "experts_read": statistics.mean(touched), "expected_experts": expected,
                     "grouped_bytes": grouped_b, "separate_bytes": separate_b,
                     "grouped_ms": 1e3 * statistics.median(grouped_t),
                     "separate_ms": 1e3 * statistics.median(separate_t),
                     "grouped_ms_min": 1e3 * min(grouped_t), "separate_ms_min": 1e3 * min(separate_t)})

    print(f"{path.name}: layer {args.layer}, {n_expert} experts, {n_used} used, "
          f"{per_expert / 1024:,.1f} KiB per expert (gate+up+down), {args.trials} trials per k, "
          f"{numba.get_num_threads()} Numba threads")
    print(f"{'k':>2} {'experts read':>13} {'expected':>9} {'grouped KiB':>12} {'separate KiB':>13} "
          f"{'bytes':>6} {'grouped ms':>11} {'separate ms':>12} {'time':>6}")
    for r in rows:
        print(f"{r['k']:>2} {r['experts_read']:>13.1f} {r['expected_experts']:>9.1f} "
              f"{r['grouped_bytes'] / 1024:>12,.0f} {r['separate_bytes'] / 1024:>13,.0f} "
              f"{r['grouped_bytes'] / r['separate_bytes']:>6.2f} {r['grouped_ms']:>11.2f} "
              f"{r['separate_ms']:>12.2f} {r['grouped_ms'] / r['separate_ms']:>6.2f}")
    if args.json:
        args.json.write_text(json.dumps({"model": str(path), "layer": args.layer, "experts": n_expert,
                                         "used": n_used, "expert_bytes": per_expert,
                                         "threads": numba.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

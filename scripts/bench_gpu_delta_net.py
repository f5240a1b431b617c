"""Time one Gated DeltaNet layer call on a GPU: the torch ops vs the Triton kernels.

    python scripts/bench_gpu_delta_net.py [--heads 48] [--head-dim 128] [--channels 10240] [--ks 1,2,4,8]

Defaults are Qwen3.6-27B's GDN layer: 48 value heads with a 128 x 128 state each, a causal conv of
kernel 4 over 10240 channels (q and k of 16 key heads, v of 48 value heads). A k-token call is a
verify batch: the recurrence writes k - 1 snapshots into a ring, as a speculative step does. For
each k: the torch path, the Triton recurrence with its default launch and at other (value block
width, warps) shapes, and the conv both as `causal_conv` returns it and fused (conv state and ring history written in
the kernel). Without a CUDA GPU it prints one line and exits 0.
"""
from __future__ import annotations

import argparse
import sys

import torch

from gpu_kernels.delta_net import causal_conv, delta_rule
from gpu_kernels.norms import l2_norm

# (value block width, warps) launch shapes tried for the recurrence; the default is (32, 4)
SHAPES = ((16, 2), (16, 4), (32, 4), (32, 8), (64, 8))


def time_us(fn, reps: int) -> float:
    """Mean microseconds per call over `reps` calls, after a warm-up (compilation) call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def bench_delta_net(device: str = "cuda", H: int = 48, d: int = 128, C: int = 10240, K: int = 4,
                    ks=(1, 2, 4, 8), reps: int = 200) -> list[dict]:
    """One row per k: microseconds per layer call of each path, and the Triton recurrence's
    effective bandwidth (state read and written once, plus k - 1 snapshots)."""
    from gpu_kernels.triton_delta_net import causal_conv_triton, delta_rule_triton

    dev = torch.device(device)
    rows = []
    for k in ks:
        q = l2_norm(torch.randn(k, H, d, device=dev), 1e-6) / d ** 0.5
        kk = l2_norm(torch.randn(k, H, d, device=dev), 1e-6)
        v, g, beta = torch.randn(k, H, d, device=dev), -torch.rand(k, H, device=dev), torch.rand(k, H, device=dev)
        state, ring = torch.zeros(H, d, d, device=dev), torch.zeros(max(k - 1, 1), H, d, d, device=dev)
        x, conv_state, w = torch.randn(k, C, device=dev), torch.randn(K - 1, C, device=dev), torch.randn(C, K, device=dev)
        history = torch.empty(K - 1 + k, C, device=dev)
        row = {"k": k,
               "torch": time_us(lambda: delta_rule(q, kk, v, g, beta, state, ring, kernel="torch"), reps),
               "conv_torch": time_us(lambda: causal_conv(x, conv_state, w, kernel="torch"), reps),
               "conv_triton": time_us(lambda: causal_conv(x, conv_state, w, kernel="triton"), reps),
               "conv_fused": time_us(lambda: causal_conv_triton(x, conv_state, w, history), reps)}
        for bv, warps in SHAPES:
            row[f"bv{bv}w{warps}"] = time_us(
                lambda: delta_rule_triton(q, kk, v, g, beta, state, ring, block_v=bv, num_warps=warps), reps)
        row["triton"] = time_us(lambda: delta_rule(q, kk, v, g, beta, state, ring, kernel="triton"), reps)
        state_bytes = H * d * d * 4
        row["triton_gbs"] = (2 + k - 1) * state_bytes / (row["triton"] * 1e-6) / 1e9
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=48)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--channels", type=int, default=10240)
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu_delta_net: no CUDA GPU here, nothing to time")
        return 0
    ks = tuple(int(k) for k in args.ks.split(","))
    rows = bench_delta_net("cuda", args.heads, args.head_dim, args.channels, ks=ks, reps=args.reps)
    print(f"{torch.cuda.get_device_name()}: H {args.heads}, d {args.head_dim}, conv channels {args.channels}; "
          f"microseconds per layer call (mean of {args.reps})")
    names = [f"bv{bv}w{warps}" for bv, warps in SHAPES]
    print(f"{'k':>2} {'torch':>8} {'triton':>8} {' '.join(f'{n:>7}' for n in names)} {'GB/s':>6} {'x':>5} | "
          f"{'conv torch':>10} {'triton':>7} {'fused':>7}")
    for r in rows:
        bvs = " ".join(f"{r[n]:7.1f}" for n in names)
        print(f"{r['k']:2d} {r['torch']:8.1f} {r['triton']:8.1f} {bvs} {r['triton_gbs']:6.0f} "
              f"{r['torch'] / r['triton']:5.1f} | {r['conv_torch']:10.1f} {r['conv_triton']:7.1f} {r['conv_fused']:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

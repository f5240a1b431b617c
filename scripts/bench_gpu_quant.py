"""Throughput of gpu_kernels' torch dequantize and QuantLinear at Qwen3.6-27B's FFN shape.

    python scripts/bench_gpu_quant.py [--device cpu|cuda] [--threads N] [--dtype float32|float16]

For each type: a whole 17408 x 5120 FFN matrix (ffn_gate/ffn_up) held as GGUF bytes is decoded tile
by tile into one scratch tile, as QuantLinear does on every call; then QuantLinear itself for k = 1
and k = 4 rows. Block payloads are random bytes with finite float16 scales (decode speed does not
depend on the values).
"""
from __future__ import annotations

import argparse
import time

import torch
from gguf.constants import GGMLQuantizationType as T

from gpu_kernels.qlinear import TILE_ELEMS, QuantLinear
from gpu_kernels.quant import block_shape, dequantize_torch, row_bytes

N_FF, N_EMBD = 17408, 5120
SCALE_OFFSETS = {T.Q4_K: (0, 2), T.Q6_K: (208,), T.Q8_0: (0,)}


def random_blocks(qtype: T, n_rows: int, n_cols: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(qtype))
    _, nbytes = block_shape(qtype)
    raw = torch.randint(0, 256, (n_rows, row_bytes(qtype, n_cols)), dtype=torch.uint8, generator=g)
    blocks = raw.view(-1, nbytes)
    for off in SCALE_OFFSETS[qtype]:
        scales = (torch.rand(blocks.shape[0], 1, generator=g) * 1e-2).to(torch.float16)
        blocks[:, off:off + 2] = scales.view(torch.uint8)
    return raw.to(device)


def timed(fn, reps: int, device: torch.device) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    print(f"device {device}, compute {args.dtype}, torch threads {torch.get_num_threads()}, "
          f"shape {N_FF} x {N_EMBD}, tile {TILE_ELEMS // N_EMBD} rows")
    print(f"{'type':6} {'MiB':>7} {'dequant ms':>11} {'Mweights/s':>11} {'GB/s out':>9} {'k=1 ms':>8} {'k=4 ms':>8}")
    for qtype in (T.Q4_K, T.Q6_K, T.Q8_0):
        raw = random_blocks(qtype, N_FF, N_EMBD, device)
        lin = QuantLinear(raw, qtype, N_EMBD, N_FF, dtype)
        tile = lin.scratch.tile(lin.tile_rows, N_EMBD)

        def dequant_all():
            for r0 in range(0, N_FF, lin.tile_rows):
                r1 = min(r0 + lin.tile_rows, N_FF)
                dequantize_torch(raw[r0:r1], qtype, N_EMBD, dtype, out=tile[:r1 - r0])

        t = timed(dequant_all, args.reps, device)
        n = N_FF * N_EMBD
        x = torch.randn(4, N_EMBD, device=device)
        t1 = timed(lambda: lin(x[:1]), args.reps, device)
        t4 = timed(lambda: lin(x), args.reps, device)
        print(f"{qtype.name:6} {raw.numel() / 2**20:7.1f} {t * 1e3:11.1f} {n / t / 1e6:11.0f} "
              f"{n * dtype.itemsize / t / 1e9:9.2f} {t1 * 1e3:8.1f} {t4 * 1e3:8.1f}")


if __name__ == "__main__":
    main()

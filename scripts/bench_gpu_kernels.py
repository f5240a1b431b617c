"""Time the fused Triton quantized matvec at Qwen3.6-27B's FFN shapes against the torch tile path
and a dense float16 matmul.

    python scripts/bench_gpu_kernels.py [--ks 1,2,4,8,16] [--sweep] [--json]
    python scripts/bench_gpu_kernels.py --interpret-smoke      # no GPU: tiny shapes, interpreted

For each matrix (ffn_gate/ffn_up 17408 x 5120 and ffn_down 5120 x 17408 in the types a Q4_K_M file
uses, plus Q8_0, Q5_K and Q4_0) and each batch of k tokens: the kernel's time, the weight bytes it
reads per second and that as a share of the card's bandwidth (a 1 GiB device-to-device copy,
read + write), the torch tile path (QuantLinear(kernel="torch"), float16 as the runtime binds it on
a GPU) and a dense float16 matmul of the same shape. Times are medians of triton.testing.do_bench,
which flushes the L2 cache between calls (an H100's 50 MB L2 would otherwise hold a whole Q4_K
matrix; in a model every matrix is read cold). `--sweep` adds the kernel at other launch shapes
(BLOCK_N, warps) and with FMA contraction. Payloads are random bytes with finite float16 scales
(speed does not depend on the values). The launch column is BLOCK_N x warps, "m" for tiles with
the rows in the middle, "+fma" with contraction. Without a CUDA GPU it prints one line and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

N_FF, N_EMBD = 17408, 5120
# (tensor, rows, columns, type name): Q4_K_M's ffn_gate/up and ffn_down, then other common types
MATRICES = (("ffn_gate", N_FF, N_EMBD, "Q4_K"), ("ffn_down", N_EMBD, N_FF, "Q6_K"),
            ("ffn_down", N_EMBD, N_FF, "Q4_K"), ("ffn_gate", N_FF, N_EMBD, "Q8_0"),
            ("ffn_gate", N_FF, N_EMBD, "Q5_K"), ("ffn_gate", N_FF, N_EMBD, "Q4_0"))
SMOKE_MATRICES = (("smoke", 32, 512, "Q4_K"), ("smoke", 32, 512, "Q6_K"), ("smoke", 32, 512, "Q8_0"))
# byte offsets of the float16 scales in one block
F16_OFFSETS = {"Q4_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
SWEEP = ((8, 2), (8, 4), (16, 4), (16, 8), (32, 4), (32, 8))     # (BLOCK_N, num_warps)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="1,2,4,8,16", help="batch sizes (tokens per call, at most 16)")
    ap.add_argument("--sweep", action="store_true", help="also time other launch shapes and FMA contraction")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    ap.add_argument("--interpret-smoke", action="store_true",
                    help="no GPU needed: tiny shapes on the CPU under TRITON_INTERPRET=1, to show the script runs")
    return ap.parse_args(argv)


def random_blocks(qtype: int, type_name: str, n_rows: int, n_cols: int, device: torch.device) -> torch.Tensor:
    """Random GGUF rows with finite float16 scales around 1e-3."""
    from gpu_kernels.quant import block_shape, row_bytes

    g = torch.Generator(device=device).manual_seed(n_rows * 7 + qtype)
    raw = torch.randint(0, 256, (n_rows, row_bytes(qtype, n_cols)), dtype=torch.uint8, device=device, generator=g)
    blocks = raw.view(-1, block_shape(qtype)[1])
    for off in F16_OFFSETS[type_name]:
        scales = torch.rand(blocks.shape[0], 1, device=device, generator=g) * 2e-3
        blocks[:, off:off + 2] = scales.half().view(torch.uint8)
    return raw


def make_timer(device: torch.device):
    """ms per call: do_bench's median with L2 flushes on a GPU, a best-of-3 wall clock otherwise."""
    if device.type == "cuda":
        from triton.testing import do_bench
        return lambda fn: do_bench(fn, warmup=25, rep=200, return_mode="median")

    def wall(fn) -> float:
        fn()
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best * 1e3
    return wall


def copy_bandwidth(device: torch.device, timer, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy, counting the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (timer(lambda: dst.copy_(src)) / 1e3)


def bench(args: argparse.Namespace, device: torch.device) -> dict:
    from gguf.constants import GGMLQuantizationType as T

    from gpu_kernels.qlinear import QuantLinear
    from gpu_kernels.matvec_table import DEFAULT, MatvecParams
    from gpu_kernels.triton_matvec import matvec_triton

    timer = make_timer(device)
    ks = [int(k) for k in args.ks.split(",")]
    if not all(1 <= k <= 16 for k in ks):
        raise SystemExit(f"--ks: batch sizes must be 1..16, got {args.ks}")
    copy_bps = copy_bandwidth(device, timer, (1 << 30) if device.type == "cuda" else (1 << 26))
    matrices = SMOKE_MATRICES if args.interpret_smoke else MATRICES
    rows = []
    for tensor, n_out, n_in, type_name in matrices:
        qtype = int(T[type_name])
        raw = random_blocks(qtype, type_name, n_out, n_in, device)
        torch_path = QuantLinear(raw, qtype, n_in, n_out, torch.float16, kernel="torch")
        exact = QuantLinear(raw, qtype, n_in, n_out, torch.float32, kernel="torch")     # the check, untimed
        dense = torch.randn(n_out, n_in, dtype=torch.float16, device=device)
        x_all = torch.randn(max(ks), n_in, device=device)
        first = DEFAULT.plan(qtype, n_out, n_in)[0]
        default = (first.block_n, first.num_warps, first.rows_mid)
        shapes = [default + (False,)]
        if args.sweep:
            shapes += [(bn, w, mid, False) for bn, w in SWEEP for mid in (False, True) if (bn, w, mid) != default]
            shapes += [default + (True,)]
        for k in ks:
            x = x_all[:k].contiguous()
            x16 = x.half()
            ref = exact(x)
            torch_ms = timer(lambda: torch_path(x))
            dense_ms = timer(lambda: torch.matmul(x16, dense.t()))
            for block_n, warps, rows_mid, fusion in shapes:
                def fused():
                    return matvec_triton(raw, qtype, n_in, x, params=MatvecParams(block_n, warps, rows_mid),
                                         fp_fusion=fusion)
                err = ((fused() - ref).abs().max() / ref.abs().max()).item()
                ms = timer(fused)
                gbps = raw.numel() / (ms / 1e3) / 1e9
                rows.append({"tensor": tensor, "type": type_name, "n_out": n_out, "n_in": n_in, "k": k,
                             "block_n": block_n, "num_warps": warps, "rows_mid": rows_mid, "fp_fusion": fusion,
                             "weight_bytes": raw.numel(), "triton_ms": ms, "weight_gbps": gbps,
                             "bandwidth_share": gbps * 1e9 / copy_bps, "torch_ms": torch_ms,
                             "dense_f16_ms": dense_ms, "speedup_vs_torch": torch_ms / ms,
                             "speedup_vs_dense_f16": dense_ms / ms, "max_rel_diff_vs_torch_f32": err})
        del raw, torch_path, exact, dense
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (TRITON_INTERPRET=1)"
    return {"device": name, "copy_gbps": copy_bps / 1e9, "ks": ks, "rows": rows}


def print_table(result: dict) -> None:
    print(f"{result['device']}: device-to-device copy {result['copy_gbps']:.0f} GB/s (read + write)")
    print(f"{'tensor':9} {'type':5} {'shape':>12} {'MiB':>6} {'k':>3} {'launch':>10} {'ms':>8} {'GB/s':>7} "
          f"{'% bw':>5} {'torch ms':>9} {'x torch':>8} {'f16 ms':>8} {'x f16':>6} {'diff':>8}")
    for r in result["rows"]:
        launch = f"{r['block_n']}x{r['num_warps']}{'m' if r['rows_mid'] else ''}{'+fma' if r['fp_fusion'] else ''}"
        print(f"{r['tensor']:9} {r['type']:5} {r['n_out']:>6}x{r['n_in']:<5} {r['weight_bytes'] / 2**20:6.1f} "
              f"{r['k']:3} {launch:>10} {r['triton_ms']:8.3f} {r['weight_gbps']:7.0f} "
              f"{100 * r['bandwidth_share']:5.1f} {r['torch_ms']:9.3f} {r['speedup_vs_torch']:8.1f} "
              f"{r['dense_f16_ms']:8.3f} {r['speedup_vs_dense_f16']:6.2f} {r['max_rel_diff_vs_torch_f32']:8.1e}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.interpret_smoke:
        # Triton reads this when the kernels are decorated: before gpu_kernels is imported
        os.environ["TRITON_INTERPRET"] = "1"
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("bench_gpu_kernels: needs a CUDA GPU (none found); --interpret-smoke runs tiny shapes on the CPU")
        return 0
    from gpu_kernels.triton_support import require_triton
    require_triton("bench_gpu_kernels.py")
    result = bench(args, device)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Host time per call of the device trunk's pieces: what bounds a decode step on a GPU today.

A decode step launches a few kernels per matrix and per layer, each on tiny shapes, so the GPU
waits on the host; the step's time is the sum of these per-call costs (BENCHMARKS.md "GPU check").

    python scripts/bench_gpu_launch.py            # on a CUDA GPU: each piece called back to back
    python scripts/bench_gpu_launch.py --stub     # anywhere: the Triton launches replaced by a
                                                  # no-op, so only the Python wrappers are timed

Each figure is the best of 5 rounds of N back-to-back calls (the GPU synchronized once per round),
shapes of SmolLM2-135M (576-wide rows, 9 heads of 64 over 3 KV heads, a Q8_0 576 -> 1536 matrix).
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def cases(device: str):
    import torch
    from gguf.constants import GGMLQuantizationType as T

    from gpu_kernels.qlinear import QuantLinear
    from gpu_kernels.quant import row_bytes
    from gpu_kernels.rotary import rotary_rows, rotary_table
    from gpu_kernels.triton_act_quant import act_round_trip_triton
    from gpu_kernels.triton_attention import attention_rows_triton
    from gpu_kernels.triton_matvec import device_rows, matvec_triton
    from gpu_kernels.triton_norms import norm_rows_triton
    from gpu_kernels.triton_rotary import rotary_triton

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 255, (1536, row_bytes(T.Q8_0, 576)), dtype=torch.uint8, generator=gen)
    blocks[:, ::34], blocks[:, 1::34] = 0, 0x3C      # every block's float16 scale 1.0 (no Inf / NaN)
    raw = device_rows(blocks, T.Q8_0, 576, device)
    lin = QuantLinear(raw, T.Q8_0, 576, 1536, kernel="triton", int8_activations=True)
    x = torch.randn(1, 576, generator=gen).to(device)
    w = torch.randn(576, generator=gen).to(device)
    q = torch.randn(1, 9, 64, generator=gen).to(device)
    rows = rotary_rows(rotary_table(4096, 64, 1e4, False, device=device), 100, 1)
    cache = torch.randn(4096, 3, 64, generator=gen).half().to(device)
    pieces = {
        "torch add (reference)": lambda: x + x,
        "matvec_triton Q8_0 576 -> 1536": lambda: matvec_triton(raw, T.Q8_0, 576, x),
        "act_round_trip_triton": lambda: act_round_trip_triton(x, 32, True),
        "QuantLinear (round trip + matvec)": lambda: lin(x),
        "norm_rows_triton": lambda: norm_rows_triton(x, w, 1e-5, True),
        "rotary_triton": lambda: rotary_triton(q, rows.cos, rows.sin, 64, False),
        "attention_rows_triton (101 keys)": lambda: attention_rows_triton(q, cache, cache, 100, 0.125),
    }
    return pieces, lin


def stub_launches() -> None:
    """Replace every Triton kernel's launch by a no-op (the wrappers' Python is all that runs)."""
    import gpu_kernels.triton_act_quant as act
    import gpu_kernels.triton_attention as attn
    import gpu_kernels.triton_matvec as mv
    import gpu_kernels.triton_norms as norms
    import gpu_kernels.triton_rotary as rot

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    for module, name in ((mv, "_matvec_kernel"), (act, "_act_round_trip_kernel"), (norms, "_norm_rows_kernel"),
                         (rot, "_rotary_kernel"), (attn, "_attention_rows_kernel")):
        setattr(module, name, NoLaunch())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stub", action="store_true", help="no GPU needed: time the wrappers with no-op launches")
    ap.add_argument("-n", type=int, default=2000, help="calls per round")
    args = ap.parse_args(argv)
    if args.n < 1:
        ap.error("-n must be >= 1")
    if args.stub:
        os.environ.setdefault("TRITON_INTERPRET", "1")     # kernels decorate without a GPU
    import torch

    if args.stub:
        stub_launches()
        device, sync, what = "cpu", (lambda: None), "Triton launches stubbed, CPU tensors"
    elif torch.cuda.is_available():
        device, sync, what = "cuda", torch.cuda.synchronize, torch.cuda.get_device_name()
    else:
        print("bench_gpu_launch: needs a CUDA GPU (none found); --stub times the wrappers alone")
        return 0
    print(f"{what}: host microseconds per call (best of 5 rounds of {args.n})")
    pieces, lin = cases(device)
    for name, fn in pieces.items():
        for _ in range(min(50, args.n)):
            fn()
        sync()
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(args.n):
                fn()
            sync()
            best = min(best, (time.perf_counter() - t) / args.n)
        print(f"  {name:36s} {best * 1e6:7.1f}")
    # the calls above were all of one token: the matrix's k = 1 launch
    direct = [k for k, runner in lin._launch.by_k[1].launches.direct.items() if runner is not None]
    print(f"matvec launches through the compiled kernel's own launcher (checked_runner): "
          f"{'on' if direct else 'off'} (HYBRIDRT_DIRECT_LAUNCH={os.environ.get('HYBRIDRT_DIRECT_LAUNCH', '1')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""RMSNorm and the L2 norm over the last dimension in one Triton launch: one program per row.

Why: in torch a norm is six kernels (the float copy, the square, the mean, rsqrt, two products),
and a verify batch on a GPU reduces token by token for batch invariance (norms.token_rows_reduce),
six per token. On a GPU every one of those is a launch, and launches bounded the first decode
steps measured there (BENCHMARKS, "GPU check"). Here each row is one program that reads the row
once, sums its squares in a fixed-shape tree and writes the scaled row.

Batch invariance: a row's program runs the same code whatever the number of rows (the row count
is the grid, never inside the kernel), so a token's bits are the same alone or in a verify batch.
The bits differ from torch's (another summation order): within float32 rounding of the sum.
"""
from __future__ import annotations

import torch

from .triton_support import have_triton, interpreting, pow2_at_least, require_triton

MAX_ROW = 1 << 15       # a row is held in one program's registers: model widths go to 8192 or so


def fits(x: torch.Tensor) -> bool:
    """Whether `x` can take the Triton norm: a CUDA tensor (or any under the interpreter) with
    rows the kernel holds."""
    return (x.is_cuda or interpreting()) and have_triton() and 0 < x.shape[-1] <= MAX_ROW and x.numel() > 0


if have_triton():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n"])
    def _norm_rows_kernel(x_ptr, w_ptr, y_ptr, n, eps, MEAN: tl.constexpr, HAS_W: tl.constexpr,
                          BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
        ss = tl.sum(x * x, axis=0)
        if MEAN:
            ss = ss / n
        scale = tl.math.div_rn(1.0, tl.math.sqrt_rn(ss + eps))
        y = x * scale
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * n + cols, y, mask=mask)


def norm_rows_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float, mean: bool) -> torch.Tensor:
    """x * rsqrt(mean (or sum) of x^2 over the last dimension + eps) [* weight], float32, x's shape."""
    require_triton("the fused norm")
    n = x.shape[-1]
    if not fits(x):
        raise ValueError(f"norm_rows_triton: needs a CUDA tensor (or TRITON_INTERPRET=1) with rows of "
                         f"1..{MAX_ROW}, got {x.device} {tuple(x.shape)}")
    if weight is not None and (weight.numel() != n or weight.device != x.device):
        raise ValueError(f"norm_rows_triton: weight must hold {n} values on {x.device}, "
                         f"got {tuple(weight.shape)} on {weight.device}")
    xc = x.contiguous()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    w = weight.contiguous() if weight is not None else xc      # any pointer: HAS_W=False never reads it
    rows = xc.numel() // n
    _norm_rows_kernel[(rows,)](xc, w, y, n, float(eps), MEAN=mean, HAS_W=weight is not None,
                               BLOCK=pow2_at_least(n), num_warps=4 if n <= 4096 else 8,
                               enable_fp_fusion=True)     # Triton 3.9's default, said outright (a later default may differ)
    return y

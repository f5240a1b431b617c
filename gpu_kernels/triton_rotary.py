"""Rotary position embeddings (rotary.apply_rotary) in one Triton launch: one program per head row.

Why: torch spends about ten kernels on a rotation (slices' products, differences, the concatenation
of the rotated and the untouched dimensions), for q and for k in every attention layer; on a GPU
those launches bounded the first decode steps measured (BENCHMARKS, "GPU check").

The products and sums are torch's, rounded as torch rounds them (a * cos - b * sin with each product
rounded: the kernel launches with enable_fp_fusion=False), so the bits are apply_rotary's.
"""
from __future__ import annotations

import torch

from .triton_support import have_triton, interpreting, pow2_at_least, require_triton


def fits(x: torch.Tensor, rows) -> bool:
    """Whether x [tokens, heads, head_dim] (float32, last dimension contiguous) and the gathered
    cos / sin rows [tokens, 1, n_rot / 2] can take the kernel (anything else keeps torch's ops)."""
    return ((x.is_cuda or interpreting()) and have_triton() and x.dim() == 3 and x.stride(2) == 1
            and x.dtype == rows.cos.dtype == rows.sin.dtype == torch.float32
            and x.numel() > 0 and rows.cos.shape[0] == x.shape[0] and rows.cos.stride(-1) == 1
            and rows.sin.stride(0) == rows.cos.stride(0) and rows.sin.stride(-1) == 1)


if have_triton():
    import triton
    import triton.language as tl

    @triton.jit
    def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, n_heads, head_dim, sx_t, sx_h, sc_t,
                       HALF: tl.constexpr, NEOX: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        t = pid // n_heads
        h = pid % n_heads
        i = tl.arange(0, BH)
        m = i < HALF
        c = tl.load(cos_ptr + t * sc_t + i, mask=m, other=0.0)
        s = tl.load(sin_ptr + t * sc_t + i, mask=m, other=0.0)
        if NEOX:
            ia = i
            ib = i + HALF
        else:
            ia = 2 * i
            ib = 2 * i + 1
        src = x_ptr + t * sx_t + h * sx_h
        dst = y_ptr + pid * head_dim
        a = tl.load(src + ia, mask=m, other=0.0)
        b = tl.load(src + ib, mask=m, other=0.0)
        tl.store(dst + ia, a * c - b * s, mask=m)
        tl.store(dst + ib, b * c + a * s, mask=m)
        j = tl.arange(0, BD)
        rest = (j >= 2 * HALF) & (j < head_dim)        # dimensions past n_rot pass through
        tl.store(dst + j, tl.load(src + j, mask=rest, other=0.0), mask=rest)


def rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_rot: int, neox: bool) -> torch.Tensor:
    """x float32 [tokens, heads, head_dim] rotated by cos / sin [tokens, 1, n_rot / 2]: a new
    contiguous tensor, bitwise apply_rotary's torch result."""
    require_triton("the fused rotary embedding")
    if x.dtype != torch.float32 or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"rotary_triton: float32 x, cos and sin, got {x.dtype}, {cos.dtype}, {sin.dtype}")
    n_tok, n_heads, head_dim = x.shape
    half = n_rot // 2
    if n_rot % 2 or not 0 < n_rot <= head_dim or cos.shape[-1] != half or sin.shape[-1] != half:
        raise ValueError(f"rotary_triton: n_rot {n_rot} against head_dim {head_dim} and cos / sin "
                         f"rows of {cos.shape[-1]}")
    y = torch.empty(n_tok, n_heads, head_dim, dtype=torch.float32, device=x.device)
    _rotary_kernel[(n_tok * n_heads,)](
        x, cos, sin, y, n_heads, head_dim, x.stride(0), x.stride(1), cos.stride(0),
        HALF=half, NEOX=neox, BH=pow2_at_least(half), BD=pow2_at_least(head_dim),
        num_warps=1 if head_dim <= 128 else 2, enable_fp_fusion=False)
    return y

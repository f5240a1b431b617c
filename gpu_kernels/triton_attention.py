"""Attention of decode and verify rows over a float KV cache in one Triton launch.

Why: attention.attend's bit-stable small-batch path runs about ten torch kernels per query row (the
cast of every cached row to float32, a permute, two matmuls, the scale, softmax, the copy out), in
every attention layer; on a GPU those launches bounded the first decode steps measured there
(BENCHMARKS, "GPU check"), and the cast re-reads the whole history each step. Here one program
takes one query row and one KV head (its group of query heads), walks the keys it may see in
blocks of BT with an online softmax, and reads each cached key and value once, as stored.

Batch invariance: the query rows of a call sit at consecutive positions p0, p0 + 1, ...; row t's
program sees keys [lo(t), p0 + t] and runs the same code whatever the number of rows (the grid),
so a token's bits are the same alone or in a verify batch. The products run as IEEE float32 dots
(no TF32). The bits differ from the torch path's (another summation and softmax order): within
float32 rounding.

Not yet measured at long contexts: one program walks all of a row's keys, so a decode step runs
only n_kv programs (4 for Qwen3.6-27B), each over the whole context. At tens of thousands of keys
that leaves most of a GPU idle; splitting the keys into fixed blocks of positions (so the split, and
a token's bits, do not depend on the batch) with a combine pass (flash-decoding) is the step after.
"""
from __future__ import annotations

import torch

from .triton_support import have_triton, interpreting, pow2_at_least, require_triton

BLOCK_KEYS = 32
MAX_HEAD_DIM = 256


def fits(q: torch.Tensor, k_cache, v_cache) -> bool:
    """Float caches [n_ctx, n_kv, d] (q8_0 ones keep the torch path) with rows the kernel holds."""
    return ((q.is_cuda or interpreting()) and have_triton() and isinstance(k_cache, torch.Tensor)
            and isinstance(v_cache, torch.Tensor) and k_cache.is_floating_point() and v_cache.is_floating_point()
            and q.shape[-1] <= MAX_HEAD_DIM and v_cache.shape[-1] <= MAX_HEAD_DIM
            and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.shape[1] % k_cache.shape[1] == 0)


if have_triton():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["p0", "first", "window"])
    def _attention_rows_kernel(q_ptr, k_ptr, v_ptr, o_ptr, p0, first, window, scale,
                               sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h,
                               GROUP: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                               DV: tl.constexpr, BDV: tl.constexpr, BT: tl.constexpr, P0_IN_MEMORY: tl.constexpr):
        t = tl.program_id(0)
        kvh = tl.program_id(1)
        if P0_IN_MEMORY:        # a captured graph's step: the first position is read, not baked in
            pos = tl.load(p0).to(tl.int32) + t
        else:
            pos = p0 + t
        lo = first
        if window > 0:
            lo = tl.maximum(first, pos - window + 1)
        hi = pos + 1
        g = tl.arange(0, G)
        heads = kvh * GROUP + g
        d = tl.arange(0, BD)
        dv = tl.arange(0, BDV)
        q = tl.load(q_ptr + t.to(tl.int64) * sq_t + heads[:, None] * sq_h + d[None, :],
                    mask=(g[:, None] < GROUP) & (d[None, :] < D), other=0.0).to(tl.float32)
        m_i = tl.full((G,), float("-inf"), tl.float32)
        l_i = tl.zeros((G,), tl.float32)
        acc = tl.zeros((G, BDV), tl.float32)
        keys = tl.arange(0, BT)
        for start in range(lo, hi, BT):
            idx = start + keys
            live = idx < hi
            row = idx.to(tl.int64)
            k = tl.load(k_ptr + row[:, None] * sk_t + kvh * sk_h + d[None, :],
                        mask=live[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + row[:, None] * sv_t + kvh * sv_h + dv[None, :],
                        mask=live[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o_ptr + t.to(tl.int64) * so_t + heads[:, None] * so_h + dv[None, :], out,
                 mask=(g[:, None] < GROUP) & (dv[None, :] < DV))


def attention_rows_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, p0: int | torch.Tensor,
                          scale: float, window: int = 0, first: int = 0) -> torch.Tensor:
    """q [k, n_head, d] at positions p0 .. p0 + k - 1 over float caches [n_ctx, n_kv, d] that already
    hold those rows; keys before `first` do not exist, a window > 0 is llama.cpp's SWA (key p visible
    from query p' iff p' - p < window). p0 may be a one-element int tensor on q's device, which the
    kernel reads (a CUDA graph replays each step's; the same bits as the int, which the rows'
    bounds are then not checked against). Returns float32 [k, n_head, d_v]."""
    require_triton("the fused attention")
    if not fits(q, k_cache, v_cache):
        raise ValueError(f"attention_rows_triton: needs float caches with contiguous rows, head dims up to "
                         f"{MAX_HEAD_DIM} and whole query-head groups (q {tuple(q.shape)}, "
                         f"caches {tuple(k_cache.shape)} {k_cache.dtype})")
    n_tok, n_head, d = q.shape
    n_kv, d_v = k_cache.shape[1], v_cache.shape[2]
    in_memory = isinstance(p0, torch.Tensor)
    if not in_memory and (p0 < first or p0 + n_tok > k_cache.shape[0]):
        raise ValueError(f"attention_rows_triton: rows {p0}..{p0 + n_tok - 1} outside the cache "
                         f"(first {first}, {k_cache.shape[0]} rows)")
    group = n_head // n_kv
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(n_tok, n_head, d_v, dtype=torch.float32, device=q.device)
    bd, bdv = pow2_at_least(d), pow2_at_least(d_v)
    _attention_rows_kernel[(n_tok, n_kv)](
        q, k_cache, v_cache, out, p0, first, window, float(scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, G=max(16, pow2_at_least(group)), D=d, BD=bd, DV=d_v, BDV=bdv, BT=BLOCK_KEYS, P0_IN_MEMORY=in_memory,
        num_warps=4 if max(bd, bdv) <= 128 else 8,
        # one stage: Triton's default three pipeline the key/value tiles through shared memory, which
        # at head_dim 256 took 116800 B (over the 99 KiB an sm_86 / sm_89 block may have: no launch on
        # an RTX 30 / 40 card) and spilled at 128 registers; one stage takes 51264 B and 64-76
        # registers (scripts/kernel_report.py, BENCHMARKS "Device kernels: static report")
        num_stages=1,
        # FMA contraction as Triton 3.9 compiles it by default, said outright: a Triton whose default
        # turns it off would otherwise change these bits silently
        enable_fp_fusion=True)
    return out

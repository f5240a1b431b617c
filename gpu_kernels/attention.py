"""Causal attention of k new query rows over a KV cache, with GQA and an optional sliding window.

Greedy speculative decoding needs a token's result to be bitwise the same whether it is evaluated
alone or inside a k-token verify batch. A batched kernel picks different blockings for different k,
so small batches (decode and verify) go row by row: every row runs the same ops on the same shapes
as a lone decode step would. Long batches (prompt processing) use one masked SDPA call.

A cache is a float tensor [n_ctx, n_kv, d] or q8_0 blocks (`hybridrt.runtime.kv_cache.Q8Rows`: an object
with `.shape` and uint8 `.blocks` [n_ctx, n_kv, d / 32, 34]). One call reads every key/value row
it needs as float32 once (a cast, or a q8_0 dequantization: both elementwise, so a row's floats do
not depend on how many rows are read with it) and each query row then slices its own range.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from placement.constants import CACHE_TYPES

from .triton_attention import attention_rows_triton
from .triton_attention import fits as triton_attention_fits

ROWWISE_MAX = 32   # batches up to this many tokens take the bit-stable row-by-row path
# float32 scores one prompt SDPA call may hold ([heads, query rows, keys]): 64 MiB. On a GPU torch's
# SDPA takes its math path here (float32 operands, a mask and GQA rule out the fused kernels), which
# materializes the scores, their softmax and the GQA-widened K and V: for a 512-token chunk at the
# end of a 32k context that is ~5 GB the plan never reserved. Longer prompts' rows go in blocks.
SDPA_SCORES_MAX = 1 << 24
Q8_0_BLOCK, Q8_0_BYTES = CACHE_TYPES["q8_0"]     # ggml's block_q8_0: f16 scale + 32 int8


def q8_0_quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., d] values -> uint8 [..., d / 32, 34] q8_0 blocks, bytes identical to gguf-py's
    (and so ggml's) quantizer: d = amax / 127 in float32, q = round-half-away(x * (1 / d))."""
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // Q8_0_BLOCK, Q8_0_BLOCK)
    d = xb.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    a = xb * inv
    # gguf-py's np_roundf: floor(|a|) + floor(2 * frac), which rounds 0.49999997 down where
    # floor(|a| + 0.5) would not
    mag = torch.floor(a.abs())
    q = torch.sign(a) * (mag + torch.floor(2 * (a.abs() - mag)))
    out = torch.empty(*xb.shape[:-1], Q8_0_BYTES, dtype=torch.uint8, device=x.device)
    out[..., :2] = d.half().view(torch.uint8)
    out[..., 2:] = q.to(torch.int8).view(torch.uint8)
    return out


def q8_0_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [..., nb, 34] q8_0 blocks -> float32 [..., nb * 32] (gguf-py's q * d, bitwise)."""
    d = blocks[..., :2].view(torch.float16).float()
    return blocks[..., 2:].view(torch.int8).float().mul_(d).flatten(-2)


def _float_rows(cache, lo: int, hi: int) -> torch.Tensor:
    """Cache rows [lo, hi) as float32 [hi - lo, n_kv, d]."""
    if isinstance(cache, torch.Tensor):
        return cache[lo:hi].float()
    return q8_0_dequantize(cache.blocks[lo:hi])


def _window_start(pos: int, window: int, first: int) -> int:
    # llama.cpp's standard SWA: key p0 is visible from query p1 iff p1 - p0 < window
    return max(first, pos - window + 1) if window > 0 else first


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: list[int],
           scale: float, window: int = 0, first: int = 0, at: torch.Tensor | None = None) -> torch.Tensor:
    """q: [k, n_head, d]; caches: [n_ctx, n_kv, d] (float or q8_0) already holding the new rows at `positions`
    (ascending, contiguous); keys before position `first` do not exist (an MTP block's cache starts
    at position 1). `at`: the same positions as a tensor on q's device, given when the step runs
    from static buffers (a CUDA graph): then no Python int of the step reaches a kernel. Returns
    [k, n_head, d_v] float32."""
    if at is not None:
        return _attend_at(q, k_cache, v_cache, at, scale, window, first)
    n_tok, n_head, d = q.shape
    n_kv, d_v = k_cache.shape[1], v_cache.shape[2]
    group = n_head // n_kv
    if (n_tok <= ROWWISE_MAX and q.is_cuda and triton_attention_fits(q, k_cache, v_cache)
            and positions[-1] - positions[0] == n_tok - 1):
        # one launch for every row and head, the cache read as stored (the rows below: ten per row)
        return attention_rows_triton(q, k_cache, v_cache, positions[0], scale, window, first)
    base, last = _window_start(positions[0], window, first), positions[-1]
    all_keys = _float_rows(k_cache, base, last + 1)
    all_vals = _float_rows(v_cache, base, last + 1)
    if n_tok <= ROWWISE_MAX:
        out = torch.empty(n_tok, n_head, d_v, dtype=torch.float32, device=q.device)
        for i, pos in enumerate(positions):
            lo = _window_start(pos, window, first) - base
            keys = all_keys[lo:pos + 1 - base].permute(1, 2, 0)     # [n_kv, d, T]
            vals = all_vals[lo:pos + 1 - base].permute(1, 0, 2)     # [n_kv, T, d_v]
            qi = q[i].float().view(n_kv, group, d)
            probs = torch.softmax(torch.matmul(qi, keys) * scale, dim=-1)
            out[i] = torch.matmul(probs, vals).view(n_head, d_v)
        return out
    # [1, heads, T, d] views of the rows: torch's SDPA takes a fused kernel (flash, memory-efficient)
    # only for 4-d operands, on CUDA and on the CPU; 3-d ones run the math path (on 2 CPU threads
    # 13.7 vs 6.5 ms for a 512-token Gemma 3 layer, docs/history.md, "Prompt attention on
    # kv_attention"). A CPU trunk attends in kv_attention (hybridrt.runtime.backends.attend_on_cpu); this
    # path serves the device, bf16 caches and the torch-only trunk (HYBRIDRT_FUSED_LAYERS=0).
    keys = all_keys[None].transpose(1, 2)
    vals = all_vals[None].transpose(1, 2)
    key_pos = torch.arange(base, last + 1, device=q.device)
    query_pos = torch.tensor(positions, device=q.device).unsqueeze(1)
    visible = key_pos.unsqueeze(0) <= query_pos
    if window > 0:
        visible &= query_pos - key_pos.unsqueeze(0) < window
    n_keys = last + 1 - base
    block = max(1, SDPA_SCORES_MAX // (n_head * n_keys))
    if block >= n_tok:
        out = F.scaled_dot_product_attention(
            q.float()[None].transpose(1, 2), keys, vals, attn_mask=visible, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    # blocks of query rows, each group of query heads folded into the rows of its KV head: K and V
    # are read as they are ([1, n_kv, T, d]), never widened to every query head
    out = torch.empty(n_tok, n_head, d_v, dtype=torch.float32, device=q.device)
    qg = q.float().view(n_tok, n_kv, group, d).permute(1, 2, 0, 3)           # [n_kv, group, rows, d]
    for a in range(0, n_tok, block):
        b = min(a + block, n_tok)
        qb = qg[:, :, a:b].reshape(1, n_kv, group * (b - a), d)
        mask = visible[a:b].repeat(group, 1)                                 # [group * rows, T]
        ob = F.scaled_dot_product_attention(qb, keys, vals, attn_mask=mask, scale=scale)
        out[a:b] = ob.view(n_kv, group, b - a, d_v).permute(2, 0, 1, 3).reshape(b - a, n_head, d_v)
    return out


def _attend_at(q: torch.Tensor, k_cache, v_cache, at: torch.Tensor, scale: float, window: int,
               first: int) -> torch.Tensor:
    """attend() with the positions in a device tensor (`at`, consecutive): the fused kernel reads
    the first one from memory and gives the same bits as with an int; elsewhere (q8_0 caches, the
    CPU standing in for the device) each row attends over the whole cache with the keys it may not
    see masked, so nothing depends on the step's length. That path reads every cached row, however
    few are filled: fine for tests and short contexts, not a GPU's long ones (the caches are zeroed
    at allocation, so unfilled rows are finite and their masked weights exactly 0)."""
    n_tok, n_head, d = q.shape
    if n_tok <= ROWWISE_MAX and q.is_cuda and triton_attention_fits(q, k_cache, v_cache):
        return attention_rows_triton(q, k_cache, v_cache, at[:1], scale, window, first)
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        # reading every cached row each step is no way to run a GPU's long contexts: such a step
        # (a q8_0 cache, which the fused kernel does not read) is not captured and stays eager
        raise RuntimeError("attention over this KV cache has no graph form (the fused kernel reads float caches)")
    n_ctx, n_kv, d_v = k_cache.shape[0], k_cache.shape[1], v_cache.shape[2]
    group = n_head // n_kv
    keys = _float_rows(k_cache, 0, n_ctx).permute(1, 2, 0)       # [n_kv, d, T]
    vals = _float_rows(v_cache, 0, n_ctx).permute(1, 0, 2)       # [n_kv, T, d_v]
    key_pos = torch.arange(n_ctx, device=q.device)
    query_pos = at.unsqueeze(1)
    hidden = (key_pos.unsqueeze(0) > query_pos) | (key_pos.unsqueeze(0) < first)
    if window > 0:
        hidden |= query_pos - key_pos.unsqueeze(0) >= window
    out = torch.empty(n_tok, n_head, d_v, dtype=torch.float32, device=q.device)
    for i in range(n_tok):          # row by row: a token's bits do not depend on the batch
        qi = q[i].float().view(n_kv, group, d)
        scores = (torch.matmul(qi, keys) * scale).masked_fill(hidden[i], float("-inf"))
        out[i] = torch.matmul(torch.softmax(scores, dim=-1), vals).view(n_head, d_v)
    return out

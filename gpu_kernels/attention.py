"""Causal attention of k new query rows over a KV cache, with GQA and an optional sliding window.

Greedy speculative decoding needs a token's result to be bitwise the same whether it is evaluated
alone or inside a k-token verify batch. A batched kernel picks different blockings for different k,
so small batches (decode and verify) go row by row: every row runs the same ops on the same shapes
as a lone decode step would. Long batches (prompt processing) use one masked SDPA call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ROWWISE_MAX = 32   # batches up to this many tokens take the bit-stable row-by-row path


def _window_start(pos: int, window: int, first: int) -> int:
    # llama.cpp's standard SWA: key p0 is visible from query p1 iff p1 - p0 < window
    return max(first, pos - window + 1) if window > 0 else first


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: list[int],
           scale: float, window: int = 0, first: int = 0) -> torch.Tensor:
    """q: [k, n_head, d]; caches: [n_ctx, n_kv, d] already holding the new rows at `positions`
    (ascending, contiguous); keys before position `first` do not exist (an MTP block's cache starts
    at position 1). Returns [k, n_head, d_v] float32."""
    n_tok, n_head, d = q.shape
    n_kv, d_v = k_cache.shape[1], v_cache.shape[2]
    group = n_head // n_kv
    if n_tok <= ROWWISE_MAX:
        out = torch.empty(n_tok, n_head, d_v, dtype=torch.float32, device=q.device)
        for i, pos in enumerate(positions):
            lo = _window_start(pos, window, first)
            keys = k_cache[lo:pos + 1].float().permute(1, 2, 0)     # [n_kv, d, T]
            vals = v_cache[lo:pos + 1].float().permute(1, 0, 2)     # [n_kv, T, d_v]
            qi = q[i].float().view(n_kv, group, d)
            probs = torch.softmax(torch.matmul(qi, keys) * scale, dim=-1)
            out[i] = torch.matmul(probs, vals).view(n_head, d_v)
        return out
    last = positions[-1]
    lo = _window_start(positions[0], window, first)
    keys = k_cache[lo:last + 1].float().permute(1, 0, 2)            # [n_kv, T, d]
    vals = v_cache[lo:last + 1].float().permute(1, 0, 2)
    key_pos = torch.arange(lo, last + 1, device=q.device)
    query_pos = torch.tensor(positions, device=q.device).unsqueeze(1)
    visible = key_pos.unsqueeze(0) <= query_pos
    if window > 0:
        visible &= query_pos - key_pos.unsqueeze(0) < window
    out = F.scaled_dot_product_attention(
        q.float().permute(1, 0, 2), keys, vals, attn_mask=visible, scale=scale, enable_gqa=True)
    return out.permute(1, 0, 2)

"""One decode step's attention for a batch of sequences over a float16 (or float32) KV cache: the
train-mtp teacher's (hybridrt.train_mtp.torch_model), which decodes 256 sequences at once.

torch's CPU scaled_dot_product_attention (and batched matmuls) read such a cache at ~10 GB/s for a
single query row per sequence, so late in a 256-token continuation attention was about half of a
teacher step (docs/history.md, "The train-mtp teacher's decode attention"). Here each (sequence, KV
head) item streams its keys and values once for all the query heads that share them, in parallel
over items, with kv_attention's steps (the runtime's decode attention): up to four heads' scores a
key step with their reduction trees merged, a vectorized exp, the weighted values in registers over
all the keys. A cache of 256 sequences does not fit any CPU cache, so the step is bound by its
bytes: the teacher keeps float16, as `hybridrt run` does (fd140c0).

Results match torch's float32 attention to rounding, not bit for bit; every float step is fixed by
the code (no fastmath), so the teacher's text does not depend on how LLVM vectorized a given build.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .kv_attention import exp_shift_at, group_scores, group_values, sum_at
from .simd_int import CACHE


@njit(cache=CACHE, nogil=True, parallel=True)
def attend_decode(q, k_cache, v_cache, n_keys, visible, scale, out):
    """out[i, h] = softmax(scale q[i, h] . K[i, g]^T over visible keys) V[i, g], g = h // (n_head / n_kv).

    q (b, n_head, d) float32; k_cache (b, n_kv, n_ctx, d), v_cache (b, n_kv, n_ctx, dv) float32 or
    float16 bits (uint16), C-contiguous (whole buffers, read by flat offsets), keys 0 .. n_keys - 1 filled (finite: an
    invisible key's row is still read, with weight 0); visible (b, n_keys) bool (padding and
    out-of-window keys False; a row needs one True); out (b, n_head, dv) float32."""
    b, n_head, d = q.shape
    n_kv, n_ctx, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    group = n_head // n_kv
    flat = out.reshape(out.size)
    for item in prange(b * n_kv):
        i, g = item // n_kv, item % n_kv
        scores = np.empty(group * n_keys, np.float32)      # head hh's at hh * n_keys
        q_off = (i * n_head + g * group) * d
        for h0 in range(0, group, 4):
            group_scores(min(4, group - h0), q, q_off + h0 * d, k_cache, item * n_ctx * d, d, n_keys, d, scale,
                         scores, h0 * n_keys, d * k_cache.itemsize if h0 == 0 else 0)
        total = np.empty(group, np.float32)
        for hh in range(group):
            best = np.float32(-np.inf)
            for j in range(n_keys):
                if visible[i, j]:
                    best = max(best, scores[hh * n_keys + j])
                else:
                    scores[hh * n_keys + j] = -np.inf      # exp gives 0
            exp_shift_at(scores, hh * n_keys, n_keys, best)
            total[hh] = sum_at(scores, hh * n_keys, n_keys)
        o_off = (i * n_head + g * group) * dv
        for h0 in range(0, group, 4):
            group_values(min(4, group - h0), scores, h0 * n_keys, v_cache, item * n_ctx * dv, dv, n_keys, dv, flat,
                         o_off + h0 * dv, dv * v_cache.itemsize if h0 == 0 else 0)
        for hh in range(group):
            inv = np.float32(1.0) / total[hh]
            for c in range(dv):
                flat[o_off + hh * dv + c] *= inv

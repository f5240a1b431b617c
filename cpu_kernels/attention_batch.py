"""One decode step's attention for a batch of sequences over a float32 KV cache: the train-mtp
teacher's (hybridrt.train_mtp.torch_model), which decodes 256 sequences at once.

torch's CPU scaled_dot_product_attention (and batched matmuls) read such a cache at ~10 GB/s for a
single query row per sequence, so late in a 256-token continuation attention was about half of a
teacher step (BENCHMARKS.md, session 18). Here each (sequence, KV head) item streams its keys and
values once for all the query heads that share them, in parallel over items: ~2x torch's speed, now
bound by the arithmetic (the dot products' horizontal sums), not the cache's bytes.

The dot products are matvec_simd.dot_f32's (fixed order: the same bits in every compilation), the
rest plain float32 loops, so results match torch's float32 attention to rounding, not bit for bit,
and the teacher's text does not depend on how LLVM vectorized a given build.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .matvec_simd import dot_f32
from .simd_int import CACHE


@njit(cache=CACHE, nogil=True, inline="always")
def _axpy(a, x, y):
    for c in range(x.shape[0]):
        y[c] += a * x[c]


@njit(cache=CACHE, nogil=True, parallel=True)
def attend_decode(q, k_cache, v_cache, n_keys, visible, scale, out):
    """out[i, h] = softmax(scale q[i, h] . K[i, g]^T over visible keys) V[i, g], g = h // (n_head / n_kv).

    q (b, n_head, d) float32; k_cache (b, n_kv, n_ctx, d), v_cache (b, n_kv, n_ctx, dv) float32,
    C-contiguous (Numba does not vectorize a non-contiguous array's rows: pass whole buffers, not
    views cut to n_keys), keys 0 .. n_keys - 1 filled; visible (b, n_keys) bool (padding and
    out-of-window keys False; a row needs one True); out (b, n_head, dv) float32."""
    b, n_head, d = q.shape
    n_kv, dv = k_cache.shape[1], v_cache.shape[3]
    group = n_head // n_kv
    for item in prange(b * n_kv):
        i, g = item // n_kv, item % n_kv
        h0 = g * group
        scores = np.empty((group, n_keys), np.float32)
        best = np.full(group, -np.inf, np.float32)
        for j in range(n_keys):
            if not visible[i, j]:
                continue
            krow = k_cache[i, g, j]
            for hh in range(group):
                s = dot_f32(q[i, h0 + hh], krow) * scale
                scores[hh, j] = s
                best[hh] = max(best[hh], s)
        total = np.zeros(group, np.float32)
        for j in range(n_keys):
            if visible[i, j]:
                for hh in range(group):
                    e = np.float32(math.exp(scores[hh, j] - best[hh]))
                    scores[hh, j] = e
                    total[hh] += e
        acc = np.zeros((group, dv), np.float32)
        for j in range(n_keys):
            if not visible[i, j]:
                continue
            vrow = v_cache[i, g, j]
            for hh in range(group):
                _axpy(scores[hh, j] / total[hh], vrow, acc[hh])
        out[i, h0:h0 + group] = acc

"""A Gated DeltaNet layer half in one Numba call: qwen35 / qwen35moe / qwen3next on the fused CPU trunk.

    h + W_out (RMSNorm(delta_rule(l2norm(silu(conv(W_qkv x))), ...); ssm_norm) * silu(W_z x)),
    x = RMSNorm(h; attn_norm)

The torch path (hybridrt.models.qwen35.GatedDeltaNet) runs this as ~30 single-threaded torch ops per
layer plus a Python loop over a batch's tokens: on the 27B (48 GDN layers of 48 value heads with a
128 x 128 state each) that was most of the ~120 ms a token spent outside the matrices. Here the
projections share one parallel region (`layer_fused._project`: qkv, z and beta together; alpha
apart), the conv, norms and gates run in plain loops, and the recurrence runs one value head per
work item over all of a batch's tokens, so a head's 64 KB state stays in the core's cache for the
whole batch and is streamed twice per token (decay and S^T k, then the rank-1 update and S^T q).

Bit identity across the batch (as layer_fused): every value head and every token runs the same
operations in the same order whether it comes alone or in a verify batch, and a head is computed
by one thread, so a token's result does not depend on k or on the thread count. The state is
updated in place; in a verify batch (`capture`) the conv input history and the state after each
token but the last go to the snapshot ring's slices (hybridrt.runtime.snapshot_ring), as the torch path
writes them. The same holds across sequences: a step over several sessions' rows (runtime/batch.py)
runs gdn_block's own steps, the projections and the gated norm once over all rows (each row computed
from itself alone) and gdn_recurrence per sequence on its own state and ring (FusedGDNBlock.batched).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .ffn import _exp, _sigmoid
from .ffn import _silu as _silu64
from .layer_fused import NONE, _project, _residual, _rms_scale, copy_2d, rms_norm_rows
from .simd_int import CACHE

# a batch's recurrence work (value heads x state size x tokens) from which its heads are split
# over the threads; below it waking them costs more than it saves (the tiny test models)
PARALLEL_MIN_STATE = 1 << 16


@njit(cache=CACHE, nogil=True, inline="always")
def _silu(x):
    """SiLU of a float32 value as float32 (computed in float64, as the FFN's activation)."""
    return np.float32(_silu64(np.float64(x)))


@njit(cache=CACHE, nogil=True, inline="always")
def _softplus(x):
    """log(1 + e^x) as torch's softplus (x itself above 20), in float64."""
    x = np.float64(x)
    return x if x > 20.0 else math.log1p(_exp(x))


@njit(cache=CACHE, nogil=True, inline="always")
def _head_step(S, decay, beta, q, k, v, kv, o):
    """One token of one value head: S = decay S; u = beta (v - S^T k); S += k u^T; o = S^T q.
    S [d_k, d_v] in place, o [d_v] written; kv [d_v] scratch. Two passes over S, each row a vector."""
    dk, dv = S.shape
    for j in range(dv):
        kv[j] = 0.0
        o[j] = 0.0
    for i in range(dk):
        ki = k[i]
        for j in range(dv):
            s = S[i, j] * decay
            S[i, j] = s
            kv[j] += s * ki
    for j in range(dv):
        kv[j] = beta * (v[j] - kv[j])          # u
    for i in range(dk):
        ki, qi = k[i], q[i]
        for j in range(dv):
            s = S[i, j] + ki * kv[j]
            S[i, j] = s
            o[j] += s * qi


@njit(cache=CACHE, nogil=True, inline="always")
def _head(j, S, decay, beta, qk, v, key_head, S_snap, capture, core, d):
    """Value head j over every token of the batch (its state S[j] in place)."""
    n = qk.shape[0]
    kv = np.empty(d, np.float32)
    o = np.empty(d, np.float32)
    g = key_head[j]
    for t in range(n):
        _head_step(S[j], decay[t, j], beta[t, j], qk[t, 0, g], qk[t, 1, g], v[t, j], kv, o)
        for i in range(d):
            core[t, j * d + i] = o[i]
        if capture and t < n - 1:
            # (a slice assignment, though Numba compiles a formatted shape message into it, ~13 s
            # of a cold start in the two head loops: with a loop here 4-8 token verify batches'
            # GDN halves measured 15-25 % slower in two alternating pairs on a noisy machine;
            # to remeasure quiet)
            S_snap[t, j] = S[j]


@njit(cache=CACHE, nogil=True, parallel=True)
def _heads_parallel(S, decay, beta, qk, v, key_head, S_snap, capture, core, d):
    for j in prange(S.shape[0]):
        _head(j, S, decay, beta, qk, v, key_head, S_snap, capture, core, d)


@njit(cache=CACHE, nogil=True)
def _heads_serial(S, decay, beta, qk, v, key_head, S_snap, capture, core, d):
    for j in range(S.shape[0]):
        _head(j, S, decay, beta, qk, v, key_head, S_snap, capture, core, d)


# The element-wise parts around the recurrence (the causal conv with its SiLU over every channel, the
# gated output norm over every value head) split over the threads from this many (channel, token)
# pairs: on the 27B (10240 channels, 48 heads) they ran on the calling thread, ~0.25 ms a layer and
# token, a third of a GDN core at k = 1 and more of a verify batch's. Each element is computed by the
# same code whichever thread takes it, so the bits do not depend on the threads.
PARALLEL_MIN_CHANNELS = 1 << 13


@njit(cache=CACHE, nogil=True, inline="always")
def _conv_channels(hist, conv_w, mixed, lo, hi):
    """mixed[t, c] = SiLU(sum_j hist[t + j, c] conv_w[c, j]) for channels lo .. hi - 1, every token."""
    width = conv_w.shape[1]
    for c in range(lo, hi):
        for t in range(mixed.shape[0]):
            acc = hist[t, c] * conv_w[c, 0]
            for j in range(1, width):
                acc = acc + hist[t + j, c] * conv_w[c, j]
            mixed[t, c] = _silu(acc)


@njit(cache=CACHE, nogil=True, parallel=True)
def _conv_parallel(hist, conv_w, mixed, n_parts):
    C = conv_w.shape[0]
    for p in prange(n_parts):
        _conv_channels(hist, conv_w, mixed, p * C // n_parts, (p + 1) * C // n_parts)


@njit(cache=CACHE, nogil=True)
def _conv_serial(hist, conv_w, mixed):
    _conv_channels(hist, conv_w, mixed, 0, conv_w.shape[0])


@njit(cache=CACHE, nogil=True, inline="always")
def _gated_norm_head(core, z, ssm_norm, eps, d, y, jv):
    """Value head jv of every token: RMSNorm(core; ssm_norm) times SiLU of the gate z."""
    lo = jv * d
    for t in range(core.shape[0]):
        rs = _rms_scale(core[t], lo, d, eps)
        for i in range(d):
            y[t, lo + i] = ((core[t, lo + i] * rs) * ssm_norm[i]) * _silu(z[t, lo + i])


@njit(cache=CACHE, nogil=True, parallel=True)
def _gated_norm_parallel(core, z, ssm_norm, eps, d, y):
    for jv in prange(core.shape[1] // d):
        _gated_norm_head(core, z, ssm_norm, eps, d, y, jv)


@njit(cache=CACHE, nogil=True)
def _gated_norm_serial(core, z, ssm_norm, eps, d, y):
    for jv in range(core.shape[1] // d):
        _gated_norm_head(core, z, ssm_norm, eps, d, y, jv)


@njit(cache=CACHE, nogil=True, inline="always")
def _spread(n_threads, n_channels, k):
    """Whether the element-wise parts (the conv, the gated norm) of k tokens split over the threads
    (PARALLEL_MIN_CHANNELS, counted in conv channels)."""
    return n_threads > 1 and n_channels * k >= PARALLEL_MIN_CHANNELS


@njit(cache=CACHE, nogil=True, inline="always")
def gdn_in(h, n_threads, int_types, float_path, attn_norm, eps,
           wqkv, tqkv, eqkv, iqkv, wz, tz, ez, iz, wb, tb, eb, ib, wa, ta, ea, ia,
           n_channels, n_v_heads, d, n_k_heads, ba_packed):
    """gdn_block's input side: x = RMSNorm(h; attn_norm) through the input projections ->
    (qkv [k, C], z [k, Hv d], b [k, Hv], a [k, Hv]), beta and alpha before their gates. Every row is
    computed from its own h row alone, so the rows may be several sequences'."""
    k = h.shape[0]
    C, nz, nb = n_channels, n_v_heads * d, n_v_heads * (2 if ba_packed else 1)
    x = rms_norm_rows(h, attn_norm, eps)
    proj = np.empty((k, C + nz + nb), np.float32)
    _project(n_threads, int_types, float_path, wqkv, tqkv, eqkv, iqkv, C, wz, tz, ez, iz, nz, wb, tb, eb, ib, nb,
             x, proj)
    b = np.empty((k, n_v_heads), np.float32)
    a = np.empty((k, n_v_heads), np.float32)
    if ba_packed:
        r = n_v_heads // n_k_heads
        for t in range(k):
            for jv in range(n_v_heads):
                g, i = jv // r, jv % r
                b[t, jv] = proj[t, C + nz + g * 2 * r + i]
                a[t, jv] = proj[t, C + nz + g * 2 * r + r + i]
    else:
        copy_2d(b, proj[:, C + nz:])
        _project(n_threads, int_types, float_path, wa, ta, ea, ia, n_v_heads, wa, ta, ea, ia, NONE,
                 wa, ta, ea, ia, NONE, x, a)
    return np.ascontiguousarray(proj[:, :C]), np.ascontiguousarray(proj[:, C:C + nz]), b, a


@njit(cache=CACHE, nogil=True, inline="always")
def gdn_recurrence(n_threads, qkv, b, a, conv_w, dt_bias, ssm_a, eps, conv_state, S, conv_hist, S_snap, capture,
                   n_k_heads, tiled, core):
    """One sequence's tokens from the input projections to the gated norm: qkv [k, C] (C = 2 Hk d
    + Hv d, the pre-conv rows), b and a [k, Hv] -> core [k, Hv d] (rows of the caller's), the
    recurrence's output. conv_state [K-1, C] and S [Hv, d, d] are that sequence's, updated in place;
    with `capture`, conv_hist [>= K-1+k, C] gets [old conv state; qkv] and S_snap [>= k-1, Hv, d, d]
    the state after each token but the last. tiled: value head j reads key head j % Hk (qwen35),
    else j // (Hv / Hk) (qwen3next)."""
    k, C = qkv.shape
    n_v_heads, d = S.shape[0], S.shape[1]
    key_dim = n_k_heads * d
    rows = conv_state.shape[0]
    # the conv over [old state; new rows], token by token, then SiLU
    hist = np.empty((rows + k, C), np.float32)
    copy_2d(hist[:rows], conv_state)
    copy_2d(hist[rows:], qkv)
    qk = np.empty((k, 2, n_k_heads, d), np.float32)      # q and k per key head, normed (q scaled)
    v = np.empty((k, n_v_heads, d), np.float32)
    mixed_rows = np.empty((k, C), np.float32)
    if _spread(n_threads, C, k):
        _conv_parallel(hist, conv_w, mixed_rows, 4 * n_threads)
    else:
        _conv_serial(hist, conv_w, mixed_rows)
    q_scale = np.float32(1.0 / math.sqrt(d))
    for t in range(k):
        mixed = mixed_rows[t]
        for part in range(2):
            for g in range(n_k_heads):
                lo = part * key_dim + g * d
                ss = 0.0
                for i in range(d):
                    x = np.float64(mixed[lo + i])
                    ss += x * x
                r = np.float32(1.0 / math.sqrt(ss + eps))
                if part == 0:
                    r = r * q_scale
                for i in range(d):
                    qk[t, part, g, i] = mixed[lo + i] * r
        for jv in range(n_v_heads):
            for i in range(d):
                v[t, jv, i] = mixed[2 * key_dim + jv * d + i]
    copy_2d(conv_state, hist[k:])
    if capture:
        copy_2d(conv_hist[:rows + k], hist)
    # gates of every (token, value head)
    decay = np.empty((k, n_v_heads), np.float32)
    beta = np.empty((k, n_v_heads), np.float32)
    for t in range(k):
        for jv in range(n_v_heads):
            beta[t, jv] = np.float32(_sigmoid(np.float64(b[t, jv])))
            g = np.float64(ssm_a[jv]) * _softplus(a[t, jv] + dt_bias[jv])
            decay[t, jv] = np.float32(_exp(g))
    r = n_v_heads // n_k_heads
    key_head = np.empty(n_v_heads, np.int64)
    for jv in range(n_v_heads):
        key_head[jv] = jv % n_k_heads if tiled else jv // r
    if n_threads > 1 and n_v_heads * d * d * k >= PARALLEL_MIN_STATE:
        _heads_parallel(S, decay, beta, qk, v, key_head, S_snap, capture, core, d)
    else:
        _heads_serial(S, decay, beta, qk, v, key_head, S_snap, capture, core, d)


@njit(cache=CACHE, nogil=True, inline="always")
def gated_norm(n_threads, core, z, ssm_norm, eps, n_channels):
    """RMSNorm(core; ssm_norm) * SiLU(z) per value head of every row -> y [k, Hv d], the output
    projection's input. Each (row, head) is computed alone, so the rows may be several sequences'."""
    y = np.empty(core.shape, np.float32)
    d = ssm_norm.shape[0]
    if _spread(n_threads, n_channels, core.shape[0]):
        _gated_norm_parallel(core, z, ssm_norm, eps, d, y)
    else:
        _gated_norm_serial(core, z, ssm_norm, eps, d, y)
    return y


@njit(cache=CACHE, nogil=True, inline="always")
def gdn_core(n_threads, qkv, z, b, a, conv_w, dt_bias, ssm_a, ssm_norm, eps, conv_state, S,
             conv_hist, S_snap, capture, n_k_heads, tiled):
    """Everything of a GDN layer between its input and output projections, for one sequence's k
    tokens: gdn_recurrence, then gated_norm -> y [k, Hv d]."""
    k, C = qkv.shape
    core = np.empty((k, S.shape[0] * S.shape[1]), np.float32)
    gdn_recurrence(n_threads, qkv, b, a, conv_w, dt_bias, ssm_a, eps, conv_state, S, conv_hist, S_snap, capture,
                   n_k_heads, tiled, core)
    return gated_norm(n_threads, core, z, ssm_norm, eps, C)


@njit(cache=CACHE, nogil=True, inline="always")
def gdn_out(h, y, n_threads, int_types, float_path, attn_norm, eps, wo, to, eo, io):
    """gdn_block's output side: h + W_out y (attn_norm only stands in for _residual's unused post-norm)."""
    out = np.empty(h.shape, np.float32)
    _project(n_threads, int_types, float_path, wo, to, eo, io, h.shape[1], wo, to, eo, io, NONE, wo, to, eo, io, NONE,
             y, out)
    return _residual(h, out, attn_norm, False, eps)


@njit(cache=CACHE, nogil=True)
def gdn_block(h, n_threads, int_types, float_path, attn_norm, eps,
              wqkv, tqkv, eqkv, iqkv, wz, tz, ez, iz, wb, tb, eb, ib, wa, ta, ea, ia, wo, to, eo, io,
              conv_w, dt_bias, ssm_a, ssm_norm, conv_state, S, conv_hist, S_snap, capture, n_k_heads, tiled,
              ba_packed):
    """h (k, n_embd) float32 -> h + GDN(RMSNorm(h; attn_norm)) (the module docstring), the layer's
    recurrent state advanced by the k tokens. Matrices as layer_fused's (w, type, block, path);
    ba_packed: wb is qwen3next's ssm_ba (per key head [beta of its r value heads | alpha of them])
    and wa is not read; else wb and wa are ssm_beta and ssm_alpha.
    Its steps are the ones a batch of several sequences runs: gdn_in, gated_norm and gdn_out over
    all its rows, gdn_recurrence once per sequence on that sequence's state and ring."""
    n_v_heads, d = S.shape[0], S.shape[1]
    qkv, z, b, a = gdn_in(h, n_threads, int_types, float_path, attn_norm, eps, wqkv, tqkv, eqkv, iqkv,
                          wz, tz, ez, iz, wb, tb, eb, ib, wa, ta, ea, ia, conv_w.shape[0], n_v_heads, d, n_k_heads,
                          ba_packed)
    y = gdn_core(n_threads, qkv, z, b, a, conv_w, dt_bias, ssm_a, ssm_norm, eps,
                 conv_state, S, conv_hist, S_snap, capture, n_k_heads, tiled)
    return gdn_out(h, y, n_threads, int_types, float_path, attn_norm, eps, wo, to, eo, io)

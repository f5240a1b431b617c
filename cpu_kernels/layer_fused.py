"""One transformer layer half in one Numba call: the fused CPU trunk for decode and verify steps.

A small model's decode step on the CPU was mostly overhead: ~20 torch ops per layer (norms, rotary,
row-wise attention, residual adds) at 5-40 us each, and four small matvec calls per layer each
crossing torch -> numpy -> Numba. Here a layer's attention half

    h + post_norm(W_o attend(rotary(qk_norm(W_q,k,v rms_norm(h))), KV cache))

and its FFN half

    h + post_norm(W_down (act(W_gate x) * W_up x)),  x = rms_norm(h)

are each one call (`attention_block`, `ffn_block`) that runs the projections with matvec_int's
`block_dots` (int8 activations; a legacy type's batch of LANES_MIN_ROWS+ rows on its token-lane
`tile_sums`) or matvec's float `tile_products` (the exact path, and the types with no integer
kernel), matrix by matrix as `use_int` decides, and everything between them in plain loops. The
projections of one step are one parallel region (q, k and v together; gate and up together), or
a plain loop when the matrices are too small to pay for waking the other threads.

Bit identity across the batch: every step works on one token row at a time with the same
operations whatever k is (activation rows are quantized one by one; block_dots and tile_products are
bit-stable across k; norms and rotary are per row, and attention (kv_attention) splits its work by
positions alone), so a token's result is the same alone or in a verify batch, on any number of
threads (tests/test_layer_fused.py). The KV cache here is f32, f16 or q8_0 [n_ctx, n_kv, d] (K and
V each, as -ctk / -ctv; kv_attention's "KV cache rows"); the backend keeps the torch path for bf16 caches and for prompt batches (> 32 tokens).
"""
from __future__ import annotations

import math
import warnings

import numpy as np
from numba import njit, prange, types
from numba.extending import overload
from numba.core.errors import NumbaPerformanceWarning

from .blocks import decode_rows_serial
from .int_blocks import SPECS
from .ffn import _act_times, _sigmoid, ffn_glu
from .formats import format_of
from .matvec import float_tag, tile_products
from .matvec_amx import MAX_TOKENS, uses_amx
from .matvec_int import act_block, block_dots, types_tag
from .matvec_tiled import TILE_UNITS, chunk_steps, tile_sums, token_lanes
from .kv_attention import attend, cache_store
from .matvec_simd import TILE_ROWS
from .quantize_act import PAD_LEGACY, QK_K, QK_LEGACY, RESIDUAL_MAX_TOKENS, _quantize_rows, _quantize_rows_residual
from .simd_int import CACHE

ROWS_PER_UNIT = 16          # a unit of parallel work: 16 output rows of one matrix
GROUPS_PER_THREAD = 4       # work items per thread, so a slow core does not hold up the region
PARALLEL_MIN_WEIGHTS = 1 << 17   # below this a projection runs on the calling thread alone
# rows of int8 activations (2 per token with the residual pass) from which a legacy matrix runs on
# matvec_int's token lanes instead of block_dots: 1.5-2.4x faster at 16-32 rows on small matrices
# (Zen 4, docs/history.md, "Token lanes inside the fused layer kernels"); the K-quants' tiles lose
# to block_dots at <= 32 rows there.
# Measured before the token lanes took rows 4 at a time (4478651), so kept apart from
# matvec_tiled.LANES_MIN_K, which was re-measured then on the 27B's shapes.
LANES_MIN_ROWS = 14

# _project_serial is compiled with parallel=True on purpose and has no prange
# ((?s): the text follows Numba's colour codes and a newline)
warnings.filterwarnings("ignore", message="(?s).*The keyword argument 'parallel=True' was specified",
                        category=NumbaPerformanceWarning)

# "no matrix" as _project's row count: a numpy scalar types as int64, where a literal 0 would make
# Numba compile a separate specialisation of _project (and of both kernels below it) per call site
NONE = np.intp(0)


def matrix_operands(raw: np.ndarray, qtype: int, integer: bool, residual: bool = False) -> tuple:
    """(raw rows, type, block, path) as the kernels below take a matrix. path: 0 the float kernel, 1
    block_dots on int8 activations (the type must have an integer kernel), 2 the same with a second
    int8 pass on the first one's rounding (quantize_act.with_residual_rows; `residual`); block is the
    activation block on the integer path, the weight block on the float path.
    Every matrix goes in as a read-only view, so all of them are one Numba type (one compilation)."""
    raw = raw.view(np.uint8).view()
    raw.flags.writeable = False
    block = act_block(qtype) if integer else format_of(qtype).block_elems
    return raw, int(qtype), block, (2 if residual else 1) if integer else 0


def kernel_types(type_paths) -> tuple:
    """The kernels' (int_types, float_path) arguments for matrices given as (qtype, integer) pairs
    (integer: the matrix runs on the integer path). int_types: the integer matrices' types as a
    compile-time set (matvec_int.types_tag); the kernels carry only these types' integer code, and
    every integer matrix of a call must have one of them (another type would write nothing).
    float_path: the float-path matrices' types as a compile-time set (matvec.float_tag), () when
    there are none: then the float kernel is not compiled in at all (most of a cold compile when
    every matrix has an integer kernel); a float-path matrix of another type would write nothing. A
    model passes the pairs of all its layers: one compilation serves them all."""
    type_paths = list(type_paths)
    floats = [qt for qt, integer in type_paths if not integer]
    return types_tag(qt for qt, integer in type_paths if integer), (float_tag(floats) if floats else ())


# --------------------------------------------------------------------------- row-wise helpers

@njit(cache=CACHE, nogil=True, inline="always")
def _rms_scale(x, lo, n, eps):
    """1 / sqrt(mean(x[lo:lo+n]^2) + eps) as float32 (sum in float64, index order)."""
    ss = 0.0
    for i in range(lo, lo + n):
        v = np.float64(x[i])
        ss += v * v
    return np.float32(1.0 / math.sqrt(ss / n + eps))


@njit(cache=CACHE, nogil=True)
def rms_norm_rows(x, w, eps):
    """rms_norm of every row of x (k, n) with weight w (n,)."""
    k, n = x.shape
    out = np.empty((k, n), np.float32)
    for t in range(k):
        r = _rms_scale(x[t], 0, n, eps)
        for i in range(n):
            out[t, i] = (x[t, i] * r) * w[i]
    return out


@njit(cache=CACHE, nogil=True)
def quant_buffers(m, n, block):
    """Zeroed (q, d, s) for m activation rows of n values as matvec_int reads them
    (quantize_act.quantize_rows's layout and padding)."""
    n_pad = n if block == QK_K else (n + PAD_LEGACY - 1) // PAD_LEGACY * PAD_LEGACY
    group = 16 if block == QK_K else QK_LEGACY
    return (np.zeros((m, n_pad), np.int8), np.zeros((m, n_pad // block), np.float32),
            np.zeros((m, n_pad // group), np.int16))


@njit(cache=CACHE, nogil=True)
def quantize_into(x, block, residual, q, d, s):
    """x's rows into quant_buffers' (q, d, s); with `residual`, 2k rows: x's, then their int8
    rounding residuals (quantize_act.with_residual_rows)."""
    group = 16 if block == QK_K else QK_LEGACY
    if residual:
        _quantize_rows_residual(x, block, group, q, d, s)
    else:
        _quantize_rows(x, block, group, q, d, s)


@njit(cache=CACHE, nogil=True)
def _quantized(x, block, residual):
    """x's rows as matvec_int reads them, in buffers of their own (quantize_into)."""
    k, n = x.shape
    q, d, s = quant_buffers(2 * k if residual else k, n, block)
    quantize_into(x, block, residual, q, d, s)
    return q, d, s


# --------------------------------------------------------------------------- projections
# Up to three matrices (q, k, v or gate, up) that read the same rows x write their outputs side by
# side in `out`: matrix m's row r goes to column off_m + r. Work is split in units of 16 rows.

def _legacy_types(int_types):
    """int_types (a types_tag) less its K-quant types: the token-lane branch of _project_group runs
    32-weight blocks only, so a K-quant file (the 27B) compiles no lane code at all (a tag with no
    type emits an empty switch), where the whole tag's would be dead code in every fused kernel."""
    raise NotImplementedError("_legacy_types runs inside Numba kernels")


@overload(_legacy_types, inline="always")
def _legacy_types_code(int_types):
    chosen = types_tag(qt for qt, ty in zip(sorted(SPECS), int_types)
                       if isinstance(ty, types.Boolean) and SPECS[qt][0] != "k")

    def code(int_types):
        return chosen
    return code


def _float_rows(float_path, w, qt, be, r_lo, r_hi, x, buf, part, acc, out, off):
    """out[:, off + r] = (W x)[r] for rows r_lo .. r_hi - 1 of one matrix on the float path
    (matvec.tile_products, 4 rows at a time); compiled in only where float_path is a float_tag, with
    the decoders of its types only."""
    raise NotImplementedError("_float_rows runs inside Numba kernels")


@overload(_float_rows, inline="always")
def _float_rows_code(float_path, w, qt, be, r_lo, r_hi, x, buf, part, acc, out, off):
    if len(float_path) == 0:
        def none(float_path, w, qt, be, r_lo, r_hi, x, buf, part, acc, out, off):
            pass
        return none

    def rows(float_path, w, qt, be, r_lo, r_hi, x, buf, part, acc, out, off):
        for r0 in range(r_lo, r_hi, TILE_ROWS):
            nr = min(TILE_ROWS, r_hi - r0)
            tile_products(w, (qt,) + float_path, be, r0, nr, x, buf, part, acc)
            for t in range(x.shape[0]):
                for r in range(nr):
                    out[t, off + r0 + r] = acc[t, r]
    return rows


@njit(cache=CACHE, nogil=True, inline="always")
def _project_group(g, n_groups, int_types, float_path, w0, t0, e0, i0, n0, w1, t1, e1, i1, n1, w2, t2, e2, i2, n2,
                   x, q32, d32, s32, q256, d256, s256, la, lb, lc, out):
    k = x.shape[0]
    u0 = (n0 + ROWS_PER_UNIT - 1) // ROWS_PER_UNIT
    u1 = (n1 + ROWS_PER_UNIT - 1) // ROWS_PER_UNIT
    u2 = (n2 + ROWS_PER_UNIT - 1) // ROWS_PER_UNIT
    n_units = u0 + u1 + u2
    # np.empty, not np.zeros: in a parallel=True function np.zeros becomes a parallel loop of its
    # own; every element of these is written before it is read
    buf = np.empty((TILE_ROWS, 1024), np.float32)       # the float path's decode tile (matvec.CHUNK)
    part = np.empty(4 * TILE_ROWS, np.float32)
    acc = np.empty((k, TILE_ROWS), np.float32)
    # the token-lane tile of a legacy matrix (la: q32's rows as matvec_tiled.token_lanes lays them out)
    k_pad = 16 * la.shape[0]
    lane_acc = np.empty((ROWS_PER_UNIT, k_pad), np.float32)
    lane_steps = (x.shape[1] + 2 * QK_LEGACY - 1) // (2 * QK_LEGACY)      # block pairs of a row
    lane_chunk = chunk_steps(min(k_pad, 16 * TILE_UNITS), 2 * QK_LEGACY) if k_pad else 1
    u_first = g * n_units // n_groups
    for u in range(u_first, (g + 1) * n_units // n_groups):
        if u < u0:
            w, qt, be, is_int, rows, off, r_lo = w0, t0, e0, i0, n0, 0, u * ROWS_PER_UNIT
        elif u < u0 + u1:
            w, qt, be, is_int, rows, off, r_lo = w1, t1, e1, i1, n1, n0, (u - u0) * ROWS_PER_UNIT
        else:
            w, qt, be, is_int, rows, off, r_lo = w2, t2, e2, i2, n2, n0 + n1, (u - u0 - u1) * ROWS_PER_UNIT
        r_hi = min(rows, r_lo + ROWS_PER_UNIT)
        if is_int:
            # block_dots: one token (decode) 4 rows a pass (or one, per matvec_int.SINGLE_ROWS);
            # verify batches in groups of rows by tokens (the same bits as row by row, less float
            # and fold work per (row, token)). Residual matrices take all 2k rows (_project sums
            # them), the others the first k, x's own
            q, d, s = (q256, d256, s256) if be == QK_K else (q32, d32, s32)
            kr = 2 * k if is_int == 2 else k
            if be == QK_LEGACY and k_pad:
                # a batch of 14+ rows: the prompt GEMM's token lanes, one pass over the weights for
                # up to 64 rows where block_dots takes one per 4 (the same bits)
                tile_sums((qt,) + _legacy_types(int_types), w, r_lo, r_hi - r_lo, la, lb, lc, lane_steps, lane_chunk,
                          TILE_UNITS, lane_acc)
                for t in range(kr):
                    for r in range(r_hi - r_lo):
                        out[t, off + r_lo + r] = lane_acc[r, t]
            else:
                # warm where the unit before it (same matrix, same thread) prefetched these rows
                cold = u == u_first or r_lo == 0
                block_dots((qt,) + int_types, w, r_lo, r_hi - r_lo, q[:kr], d[:kr], s[:kr], out, off + r_lo, cold)
        else:
            _float_rows(float_path, w, qt, be, r_lo, r_hi, x, buf, part, acc, out, off)


@njit(cache=CACHE, nogil=True, parallel=True)
def _project_parallel(n_groups, int_types, float_path, w0, t0, e0, i0, n0, w1, t1, e1, i1, n1, w2, t2, e2, i2, n2,
                      x, q32, d32, s32, q256, d256, s256, la, lb, lc, out):
    for g in prange(n_groups):
        _project_group(g, n_groups, int_types, float_path, w0, t0, e0, i0, n0, w1, t1, e1, i1, n1, w2, t2, e2, i2, n2,
                       x, q32, d32, s32, q256, d256, s256, la, lb, lc, out)


# parallel=True without a prange: the same loop compiles ~2x faster than under a plain njit (measured
# on the 1536 x 576 Q4_1 gate: 58 vs 117 us); it runs on the calling thread, no threads woken
@njit(cache=CACHE, nogil=True, parallel=True)
def _project_serial(int_types, float_path, w0, t0, e0, i0, n0, w1, t1, e1, i1, n1, w2, t2, e2, i2, n2,
                    x, q32, d32, s32, q256, d256, s256, la, lb, lc, out):
    _project_group(0, 1, int_types, float_path, w0, t0, e0, i0, n0, w1, t1, e1, i1, n1, w2, t2, e2, i2, n2,
                   x, q32, d32, s32, q256, d256, s256, la, lb, lc, out)


@njit(cache=CACHE, nogil=True)
def _project(n_threads, int_types, float_path, w0, t0, e0, i0, n0, w1, t1, e1, i1, n1, w2, t2, e2, i2, n2, x, out):
    """out[:, off_m + r] = (W_m x)[r] for the three matrices (n_m = 0: absent). e_m: the matrix's
    activation block when i_m > 0 (integer path: 32 or 256), else its weight block size (float
    path); i_m as matrix_operands' path (2: the residual pass too)."""
    k, n_in = x.shape
    if k > RESIDUAL_MAX_TOKENS:     # a prompt-sized batch: one int8 pass (quantize_act's docstring)
        i0, i1, i2 = min(i0, 1), min(i1, 1), min(i2, 1)
    q32, d32, s32 = np.zeros((k, 0), np.int8), np.zeros((k, 0), np.float32), np.zeros((k, 0), np.int16)
    q256, d256, s256 = q32, d32, s32          # empty unless some matrix reads them
    r32 = (i0 == 2 and n0 and e0 == QK_LEGACY) or (i1 == 2 and n1 and e1 == QK_LEGACY) or (i2 == 2 and n2 and e2 == QK_LEGACY)
    r256 = (i0 == 2 and n0 and e0 == QK_K) or (i1 == 2 and n1 and e1 == QK_K) or (i2 == 2 and n2 and e2 == QK_K)
    if (i0 and n0 and e0 == QK_LEGACY) or (i1 and n1 and e1 == QK_LEGACY) or (i2 and n2 and e2 == QK_LEGACY):
        q32, d32, s32 = _quantized(x, QK_LEGACY, r32)
    if (i0 and n0 and e0 == QK_K) or (i1 and n1 and e1 == QK_K) or (i2 and n2 and e2 == QK_K):
        q256, d256, s256 = _quantized(x, QK_K, r256)
    la, lb, lc = np.zeros((0, 0), np.int8), np.zeros((0, 0), np.float32), np.zeros((0, 0), np.int32)
    if q32.shape[0] >= LANES_MIN_ROWS and q32.shape[1]:
        la, lb, lc = token_lanes(q32, d32, s32, False)
    residual = r32 or r256
    # residual matrices write both halves of their 2k output rows here, summed into `out` below
    wide = np.empty((2 * k, out.shape[1]), np.float32) if residual else out
    units = ((n0 + ROWS_PER_UNIT - 1) // ROWS_PER_UNIT + (n1 + ROWS_PER_UNIT - 1) // ROWS_PER_UNIT
             + (n2 + ROWS_PER_UNIT - 1) // ROWS_PER_UNIT)
    # Always through the parallel kernel: LLVM makes the row loop ~2x faster inside a parfor than
    # in a plain loop here (measured); too small a product runs it on this thread alone.
    if n_threads > 1 and (n0 + n1 + n2) * n_in >= PARALLEL_MIN_WEIGHTS:
        _project_parallel(min(units, GROUPS_PER_THREAD * n_threads), int_types, float_path, w0, t0, e0, i0, n0,
                          w1, t1, e1, i1, n1, w2, t2, e2, i2, n2, x, q32, d32, s32, q256, d256, s256, la, lb, lc, wide)
    else:
        _project_serial(int_types, float_path, w0, t0, e0, i0, n0, w1, t1, e1, i1, n1, w2, t2, e2, i2, n2,
                        x, q32, d32, s32, q256, d256, s256, la, lb, lc, wide)
    if residual:
        for t in range(k):
            for c in range(n0 + n1 + n2):
                im = i0 if c < n0 else (i1 if c < n0 + n1 else i2)
                out[t, c] = wide[t, c] + wide[k + t, c] if im == 2 else wide[t, c]


# --------------------------------------------------------------------------- attention

@njit(cache=CACHE, nogil=True, inline="always")
def _rotate(x, lo, cos, sin, pos, n_rot, neox):
    """Rotary embedding of x[lo : lo + n_rot] at `pos` in place (neox: pairs (i, i + n_rot/2),
    else adjacent pairs), as gpu_kernels.rotary.apply_rotary computes it."""
    half = n_rot // 2
    for i in range(half):
        c, s = cos[pos, i], sin[pos, i]
        ia, ib = (lo + i, lo + i + half) if neox else (lo + 2 * i, lo + 2 * i + 1)
        a, b = x[ia], x[ib]
        x[ia] = a * c - b * s
        x[ib] = b * c + a * s


@njit(cache=CACHE, nogil=True, inline="always")
def copy_2d(dst, src):
    """dst[:, :] = src for two 2-D arrays of one shape. Numba's slice assignment compiles a
    formatted shape-mismatch message (string joins: ~3 s of a cold start per calling kernel); this
    loop raises a constant one."""
    if dst.shape[0] != src.shape[0] or dst.shape[1] != src.shape[1]:
        raise ValueError("copy_2d: shapes differ")
    for i in range(src.shape[0]):
        for j in range(src.shape[1]):
            dst[i, j] = src[i, j]


@njit(cache=CACHE, nogil=True)
def _residual(h, a, post_norm, has_post, eps):
    """h + a, or h + rms_norm(a, post_norm) (Gemma's post-norms), row by row."""
    k, n = h.shape
    out = np.empty((k, n), np.float32)
    for t in range(k):
        r = _rms_scale(a[t], 0, n, eps) if has_post else np.float32(1.0)
        for i in range(n):
            out[t, i] = h[t, i] + ((a[t, i] * r) * post_norm[i] if has_post else a[t, i])
    return out


@njit(cache=CACHE, nogil=True)
def _store_kv(kv, off, k_norm, qk_norm, eps, cos, sin, n_rot, neox, k_cache, v_cache, start, n_kv, d, dv):
    """Keys (k-normed, rotated) and values of kv's rows (row t: position start + t; keys at columns
    off .. off + n_kv d, values after them) into the caches."""
    nk = n_kv * d
    krow, vrow = np.empty(d, np.float32), np.empty(dv, np.float32)     # new rows before they are stored
    for t in range(kv.shape[0]):
        pos = start + t
        for g in range(n_kv):
            for i in range(d):
                krow[i] = kv[t, off + g * d + i]
            if qk_norm:
                r = _rms_scale(krow, 0, d, eps)
                for i in range(d):
                    krow[i] = (krow[i] * r) * k_norm[i]
            _rotate(krow, 0, cos, sin, pos, n_rot, neox)
            cache_store(k_cache[pos, g], krow)
            for i in range(dv):
                vrow[i] = kv[t, off + nk + g * dv + i]
            cache_store(v_cache[pos, g], vrow)


@njit(cache=CACHE, nogil=True)
def attention_kv(h, n_threads, int_types, float_path, attn_norm, eps, wk, tk, ek, ik, wv, tv, ev, iv,
                 k_norm, qk_norm, cos, sin, n_rot, neox, k_cache, v_cache, start, n_kv, d, dv):
    """Only the KV-cache rows attention_block writes for h (k, n_embd) at positions start ..
    start+k-1, bit for bit (the same row norm, projections and key code), without the queries,
    the attention, the output projection or anything after it: an MTP head catching up on
    committed tokens needs nothing else from them (their outputs are never read)."""
    k = h.shape[0]
    x = rms_norm_rows(h, attn_norm, eps)
    kv = np.empty((k, n_kv * (d + dv)), np.float32)
    _project(n_threads, int_types, float_path, wk, tk, ek, ik, n_kv * d, wv, tv, ev, iv, n_kv * dv, wv, tv, ev, iv, NONE,
             x, kv)
    _store_kv(kv, 0, k_norm, qk_norm, eps, cos, sin, n_rot, neox, k_cache, v_cache, start, n_kv, d, dv)


@njit(cache=CACHE, nogil=True)
def attention_block(h, n_threads, int_types, float_path, attn_norm, post_norm, has_post, eps,
                    wq, tq, eq, iq, wk, tk, ek, ik, wv, tv, ev, iv, wo, to, eo, io,
                    q_norm, k_norm, qk_norm, gated, cos, sin, n_rot, neox,
                    k_cache, v_cache, start, n_head, n_kv, d, dv, scale, window, first):
    """h (k, n_embd) float32 at positions start .. start+k-1 -> h + attention(h), writing the
    k new key/value rows into the caches (n_ctx, n_kv, d): float32, float16 as uint16 bits, or q8_0
    blocks uint8 (n_ctx, n_kv, d / 32, 34). Weights: raw ggml rows
    (readonly uint8, one type each), with e*/i* as `_project` takes them; int_types, float_path:
    `kernel_types` of (at least) these matrices. gated (qwen35): wq's rows hold [q_h | gate_h] per
    head, and each head's output is multiplied by sigmoid(gate_h) before the output projection.
    The three steps are the ones a batch of several sequences runs (attention_qkv and attention_out
    over all its rows, attention_rows once per sequence on its own cache)."""
    qkv = attention_qkv(h, n_threads, int_types, float_path, attn_norm, eps, wq, tq, eq, iq, wk, tk, ek, ik,
                        wv, tv, ev, iv, n_head, n_kv, d, dv, gated)
    k = h.shape[0]
    q = np.empty((k, n_head * d), np.float32)
    o = np.empty((k, n_head * dv), np.float32)
    attention_rows(n_threads, qkv, q, o, q_norm, k_norm, qk_norm, gated, eps, cos, sin, n_rot, neox,
                   k_cache, v_cache, start, n_head, n_kv, d, dv, scale, window, first)
    return attention_out(h, qkv, o, n_threads, int_types, float_path, post_norm, has_post, eps, wo, to, eo, io,
                         gated, n_head, d, dv)


@njit(cache=CACHE, nogil=True, inline="always")
def attention_qkv(h, n_threads, int_types, float_path, attn_norm, eps, wq, tq, eq, iq, wk, tk, ek, ik,
                  wv, tv, ev, iv, n_head, n_kv, d, dv, gated):
    """attention_block's projections: rms_norm(h) times q, k and v side by side, (k, nq_rows +
    n_kv d + n_kv dv) with nq_rows = n_head d (2 n_head d when gated: [q_h | gate_h] per head)."""
    k = h.shape[0]
    nq_rows = 2 * n_head * d if gated else n_head * d
    nk = n_kv * d
    x = rms_norm_rows(h, attn_norm, eps)
    qkv = np.empty((k, nq_rows + nk + n_kv * dv), np.float32)
    _project(n_threads, int_types, float_path, wq, tq, eq, iq, nq_rows, wk, tk, ek, ik, nk, wv, tv, ev, iv,
             n_kv * dv, x, qkv)
    return qkv


@njit(cache=CACHE, nogil=True, inline="always")
def attention_rows(n_threads, qkv, q, o, q_norm, k_norm, qk_norm, gated, eps, cos, sin, n_rot, neox,
                   k_cache, v_cache, start, n_head, n_kv, d, dv, scale, window, first):
    """What attention_block does for one sequence's rows of qkv (attention_qkv's), token t at
    position start + t on that sequence's caches and rotary table: the queries (q-normed, rotated)
    into q (k, n_head d), the keys (k-normed, rotated) and values into the caches, and the attention
    output into o (k, n_head dv). q and o are scratch rows of the caller's."""
    k = qkv.shape[0]
    nq_rows = 2 * n_head * d if gated else n_head * d
    for t in range(k):
        pos = start + t
        for hd in range(n_head):
            src = hd * 2 * d if gated else hd * d
            for i in range(d):
                q[t, hd * d + i] = qkv[t, src + i]
        for hd in range(n_head):
            if qk_norm:
                r = _rms_scale(q[t], hd * d, d, eps)
                for i in range(d):
                    q[t, hd * d + i] = (q[t, hd * d + i] * r) * q_norm[i]
            _rotate(q[t], hd * d, cos, sin, pos, n_rot, neox)
    _store_kv(qkv, nq_rows, k_norm, qk_norm, eps, cos, sin, n_rot, neox, k_cache, v_cache, start, n_kv, d, dv)
    attend(n_threads, q, k_cache, v_cache, o, start, n_head, n_kv, d, dv, scale, window, first)


@njit(cache=CACHE, nogil=True, inline="always")
def attention_out(h, qkv, o, n_threads, int_types, float_path, post_norm, has_post, eps, wo, to, eo, io,
                  gated, n_head, d, dv):
    """attention_block's end: o (attention_rows' outputs of every row) gated by sigmoid(gate_h)
    where gated (qkv's gate columns), times wo, [post-normed,] added to h."""
    k, n_embd = h.shape
    if gated:
        for t in range(k):
            for hd in range(n_head):
                for i in range(dv):
                    gate = np.float32(_sigmoid(np.float64(qkv[t, hd * 2 * d + d + i])))
                    o[t, hd * dv + i] = o[t, hd * dv + i] * gate
    a = np.empty((k, n_embd), np.float32)
    _project(n_threads, int_types, float_path, wo, to, eo, io, n_embd, wo, to, eo, io, NONE, wo, to, eo, io, NONE, o, a)
    return _residual(h, a, post_norm, has_post, eps)


@njit(cache=CACHE, nogil=True)
def ffn_block(h, n_threads, int_types, float_path, ffn_norm, post_norm, has_post, eps,
              wg, tg, eg, ig, wu, tu, eu, iu, wd, td, ed, i_d, act):
    """h (k, n_embd) -> h + [post_norm](W_down (act(W_gate x) * W_up x)), x = rms_norm(h);
    act as cpu_kernels.ffn.ACTIVATIONS (0: SiLU, 1: GELU-tanh); int_types, float_path as for attention_block."""
    k, n_embd = h.shape
    n_ff = wg.shape[0]
    x = rms_norm_rows(h, ffn_norm, eps)
    gu = np.empty((k, 2 * n_ff), np.float32)
    _project(n_threads, int_types, float_path, wg, tg, eg, ig, n_ff, wu, tu, eu, iu, n_ff, wu, tu, eu, iu, NONE, x, gu)
    hidden = np.empty((k, n_ff), np.float32)
    for t in range(k):
        for r in range(n_ff):
            hidden[t, r] = _act_times(gu[t, r], gu[t, n_ff + r], act)
    y = np.empty((k, n_embd), np.float32)
    _project(n_threads, int_types, float_path, wd, td, ed, i_d, n_embd, wd, td, ed, i_d, NONE, wd, td, ed, i_d, NONE,
             hidden, y)
    return _residual(h, y, post_norm, has_post, eps)


@njit(cache=CACHE, nogil=True)
def mtp_head_step(embed, ids, embed_scale, hidden, n_threads, int_types, float_path, eps, enorm, hnorm, eh,
                  attn, ffn, head_norm, head, logits):
    """A trained MTP head's step as one call: for tokens `ids`, each with the target's hidden of
    the position before it, the embedding rows (embed = (flat bytes, row bytes, type tag, n_embd),
    times embed_scale), x = eh_proj [RMSNorm(e; enorm) ; RMSNorm(h; hnorm)], attention_block (its
    arguments after float_path: attn, the start position among them), ffn_block (ffn),
    RMSNorm(x; head_norm), and the output rows head = (w, t, e, i) of the last token into logits
    (1, n_out). Returns the normed output hidden (k, n_embd) a chained draft continues from. The
    same kernels as the head's separate calls, so the same bits; one call because a draft comes
    right after a verify streamed every cache, where each small call paid for its code and data
    (SmolLM2: ~20 of them, ~0.1 ms of a 0.4 ms draft)."""
    k, n = hidden.shape
    flat, row_bytes, tag, n_cols = embed
    e = np.empty((k, n_cols), np.float32)
    decode_rows_serial(flat, row_bytes, tag, n_cols, ids, e)
    if embed_scale != 1.0:
        for t in range(k):
            for c in range(n_cols):
                e[t, c] = e[t, c] * np.float32(embed_scale)
    x = np.empty((k, n_cols + n), np.float32)
    copy_2d(x[:, :n_cols], rms_norm_rows(e, enorm, eps))
    copy_2d(x[:, n_cols:], rms_norm_rows(hidden, hnorm, eps))
    we, te, ee, ie = eh
    y = np.empty((k, n), np.float32)
    _project(n_threads, int_types, float_path, we, te, ee, ie, n, we, te, ee, ie, NONE, we, te, ee, ie, NONE, x, y)
    a = attention_block(y, n_threads, int_types, float_path, *attn)
    f = ffn_block(a, n_threads, int_types, float_path, *ffn)
    normed = rms_norm_rows(f, head_norm, eps)
    wh, th, eh_, ih = head
    _project(n_threads, int_types, float_path, wh, th, eh_, ih, logits.shape[1], wh, th, eh_, ih, NONE,
             wh, th, eh_, ih, NONE, normed[k - 1:], logits)
    return normed


def ffn_tile_tokens(gate: tuple, up: tuple) -> range:
    """The batch sizes ffn_block_tiles serves for these gate and up (matrix_operands tuples): those
    at which both are on the integer path and taken by the AMX tiles (matvec_amx.uses_amx); an
    empty range without AMX or for narrow rows. Worked out once per layer, not per call."""
    (wg, tg, _, ig), (wu, tu, _, iu) = gate, up
    n_in = wg.shape[1] * format_of(tg).block_elems // format_of(tg).block_bytes
    ks = [k for k in range(1, MAX_TOKENS + 1)
          if ig and iu and uses_amx(tg, k, wg.shape[0], n_in) and uses_amx(tu, k, wu.shape[0], n_in)]
    return range(ks[0], ks[-1] + 1) if ks else range(0)


def ffn_block_tiles(h, ffn_norm, post_norm, has_post, eps, gate, up, down, act: str):
    """ffn_block's result bit for bit for a wide model's verify batch (k in ffn_tile_tokens): the same
    row norm and residual code around ffn.ffn_glu, whose gate and up then run on the AMX tiles
    (matvec_int's bits) with the same activation code, and down through `matvec`. act: the
    activation's name (ffn.ACTIVATIONS). Separate calls from Python: the tile kernels are parallel
    regions of their own."""
    x = rms_norm_rows(h, ffn_norm, eps)
    y = ffn_glu(x, gate[0], gate[1], up[0], up[1], down[0], down[1], act, exact=False,
                down_residual=down[3] == 2)
    return _residual(h, y, post_norm, has_post, eps)

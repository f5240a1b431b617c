"""Attention of decode and verify tokens over the fused CPU trunk's KV cache (layer_fused's half).

Why its own kernel: the first one looped over (token, head) items and, per key, made a view of the
cache row, one dot product with its own reduction tree and a libm exp: ~110 cycles per (head, key)
at head size 64, so SmolLM2 decoded at 0.74x llama.cpp's speed at depth 4096 (docs/history.md,
"Attention over a long KV cache") while it led at short contexts. Here:

- keys go in fixed chunks of CHUNK_KEYS by absolute position, and a work item is one (token, chunk,
  KV head) with all the query heads that share that KV head: the cache rows are read once for the
  group, and a long context splits into enough items for every thread even when there is one KV
  head (Gemma 3);
- a step of the scores takes up to four query heads over one key (or fewer heads over two or
  four keys): the key widened once, four independent fma chains, and the four dot products'
  halving trees sharing their shuffles (`_make_scores`, `_reduce_trees`);
- exp is a vectorized polynomial (`_exp_ir`, within 2 ulp), the sums fixed-order 16-lane vectors;
- the weighted values keep their accumulators in registers over all the chunk's keys, a slice of
  64 elements at a time, each value row widened once for the heads (`_make_weighted_sum`);
- each item keeps its chunk's unnormalized weighted values with its max and sum; the chunks of a
  (token, head) are merged in chunk order (rescaled by exp(max_c - max));
- the first KV head's item prefetches whole positions a few keys ahead (`_prefetch_row`).

Bit identity: every float step is spelled out in LLVM IR or in plain sequential loops (no fastmath),
and which items exist depends only on the token's position, the window and `first` — not on k, on
the token's place in the batch or on the threads — so a token's output is the same bits alone or in
a verify batch, serially or in parallel, compiled here or loaded from another process's cache.

KV cache rows: one position and KV head is float32 [d], float16 [d] as its uint16 bits (Numba has no
float16 on the CPU) or q8_0 uint8 [d / 32, 34] (ggml's block: float16 scale, 32 int8), K and V each
either, the same values as the torch trunk's caches (gpu_kernels.attention): a float16 value is
widened exactly when read and rounded to nearest even (torch's .half()) once, when written; a q8_0
row is quantized as gguf-py does when written and read as float32(q) * float32(d).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .matvec_simd import (LANES, _F16, _F32, _I8, _I16, _I32, _array, _fma, _load_vec, _reduce_tree, _splat,
                          f32_to_f16_bits, load_f16)
from .simd_int import CACHE, _intrinsic, prefetch

CHUNK_KEYS = 128     # keys per work item: fixed, so the merge's order never depends on the threads
PREFETCH_KEYS = 16   # how many keys ahead the score and value loops ask for their cache rows


# --------------------------------------------------------------------------- IR building blocks

def _c_array(ty, dtypes):
    return isinstance(ty, types.Array) and ty.layout == "C" and ty.dtype in dtypes


def _elem_ptr(context, builder, aryty, ary, idx):
    return builder.gep(_array(context, builder, aryty, ary).data, [idx])


def _load_f32(builder, ptr, n, half):
    """n values at ptr (float32, or float16 bits widened exactly) as <n x float>, n >= 1."""
    if half:
        h = builder.bitcast(_load_vec(builder, ptr, _I16, n, 2), ir.VectorType(_F16, n))
        return builder.fpext(h, ir.VectorType(_F32, n))
    return _load_vec(builder, ptr, _F32, n, 4)


def _prefetch_row(builder, row_ptr, ahead, n_bytes):
    """Prefetch the n_bytes at row_ptr + ahead elements (a cache row a few keys on), a line at a
    time. A position's rows hold every KV head side by side and an item reads one head's: the item
    of the first head asks for the whole position (the next heads' items, which run next on the
    same thread, then find it in L2), the others for nothing. Strided by the other heads' rows, the
    pattern the hardware prefetcher missed: without this a layer's attention from memory took 3.3x
    its time from L3, with it 1.6-2x (SmolLM2, 4096 keys, docs/history.md, "Attention over a long KV cache")."""
    base = builder.bitcast(builder.gep(row_ptr, [ahead]), _I8.as_pointer())
    i64 = n_bytes.type
    n_lines = builder.udiv(builder.add(n_bytes, ir.Constant(i64, 63)), ir.Constant(i64, 64))
    with cgutils.for_range(builder, n_lines) as loop:
        prefetch(builder, builder.gep(base, [builder.mul(loop.index, ir.Constant(i64, 64))]))


# Cephes' expf: exp(x) = 2^t exp(r), t = round(x log2 e), r = x - t ln 2 in two parts, exp(r) a
# degree-7 polynomial; within 2 ulp over the range used here (x <= 0: scores minus their max; tested)
_EXP_LO = -87.0           # below: 0 (2^t must stay a normal float)
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def _exp_ir(b, x):
    """exp of every lane of x (<n x float>, lanes <= 0; NaN stays NaN): fixed IR, so the same bits
    in every lane position and every compilation."""
    n = x.type.count
    vty = x.type

    def c(v):
        return ir.Constant(vty, [v] * n)
    under = b.fcmp_ordered("<", x, c(_EXP_LO))
    ordered = b.fcmp_ordered("ord", x, x)
    xc = b.select(under, c(_EXP_LO), x)
    t = _intrinsic(b, f"llvm.floor.v{n}f32", vty, [_fma(b, xc, c(1.44269504088896341), c(0.5))])
    t = b.select(ordered, t, c(0.0))
    r = _fma(b, t, c(-0.693359375), xc)
    r = _fma(b, t, c(2.12194440e-4), r)
    p = c(_EXP_POLY[0])
    for coef in _EXP_POLY[1:]:
        p = _fma(b, p, r, c(coef))
    y = b.fadd(_fma(b, p, b.fmul(r, r), r), c(1.0))
    iv = ir.VectorType(_I32, n)
    bits = b.shl(b.add(b.fptosi(t, iv), ir.Constant(iv, [127] * n)), ir.Constant(iv, [23] * n))
    y = b.fmul(y, b.bitcast(bits, vty))
    return b.select(under, c(0.0), y)


def _vec_loop(builder, n, body):
    """body(i, width) over i = 0, 16, ... in 16-lane steps, then the n % 16 tail one lane a step."""
    n_vec = builder.udiv(n, ir.Constant(n.type, LANES))
    with cgutils.for_range(builder, n_vec) as loop:
        body(builder.mul(loop.index, ir.Constant(n.type, LANES)), LANES)
    done = builder.mul(n_vec, ir.Constant(n.type, LANES))
    with cgutils.for_range(builder, builder.sub(n, done)) as loop:
        body(builder.add(done, loop.index), 1)


# --------------------------------------------------------------------------- intrinsics

def _reduce_trees(builder, vecs):
    """The lane sums of 16-lane vectors, each by _reduce_tree's additions (lanes i and i + n/2 at
    every stage), four trees at a time sharing their shuffles: 15 instructions per four sums, where
    four separate trees take 48."""
    def sh(u, w, idx):
        return builder.shuffle_vector(u, w, ir.Constant(ir.VectorType(_I32, len(idx)), idx))
    sums = []
    zero = ir.Constant(vecs[0].type, [0.0] * LANES)
    for q0 in range(0, len(vecs), 4):
        A, B, C, D = (vecs[q0:q0 + 4] + [zero] * 3)[:4]
        half = list(range(8))
        ab = builder.fadd(sh(A, B, half + [16 + x for x in half]), sh(A, B, [8 + x for x in half] + [24 + x for x in half]))
        cd = builder.fadd(sh(C, D, half + [16 + x for x in half]), sh(C, D, [8 + x for x in half] + [24 + x for x in half]))
        lo = [x + o for o in (0, 8, 16, 24) for x in range(4)]       # tree r in lanes 4r .. 4r + 3
        x4 = builder.fadd(sh(ab, cd, lo), sh(ab, cd, [x + 4 for x in lo]))
        x2 = builder.fadd(sh(x4, x4, [0, 1, 4, 5, 8, 9, 12, 13]), sh(x4, x4, [2, 3, 6, 7, 10, 11, 14, 15]))
        x1 = builder.fadd(sh(x2, x2, [0, 2, 4, 6]), sh(x2, x2, [1, 3, 5, 7]))
        sums += [builder.extract_element(x1, ir.Constant(_I32, r)) for r in range(min(4, len(vecs) - q0))]
    return sums


def _make_scores(n_heads: int, n_keys: int):
    """`scores(q, q_off, k, k_off, k_stride, n, d, scale, out, out_off, out_stride, pf_bytes)`: for
    heads r < R and keys j < n (n a multiple of J), out[out_off + r * out_stride + j] = scale * (q
    row q_off + r d) . (k row k_off + j k_stride), each dot in dot_f32's order (16-lane fma
    accumulators in index order, a halving tree, the tail one product at a time). R heads x J keys
    a step: each key vector is widened once for the R heads, each query vector loaded once for the J
    keys, and R J independent accumulators keep the fma units busy. q float32, k float32 or float16
    bits. pf_bytes: how much of the row PREFETCH_KEYS keys on each key asks for (0: none)."""
    R, J = n_heads, n_keys
    vf = ir.VectorType(_F32, LANES)

    @intrinsic
    def scores(typingctx, q, q_off, k, k_off, k_stride, n, d, scale, out, out_off, out_stride, pf_bytes):
        if not _c_array(q, (types.float32,)) or not _c_array(k, (types.float32, types.uint16)) \
                or not _c_array(out, (types.float32,)):
            return None
        half = k.dtype == types.uint16
        sig = types.void(q, types.intp, k, types.intp, types.intp, types.intp, types.intp, types.float32, out,
                         types.intp, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            qv, q_off_v, kv, k_off_v, k_stride_v, n_v, d_v, scale_v, out_v, out_off_v, out_stride_v, pf_v = args
            i64 = n_v.type
            pq = [_elem_ptr(context, builder, signature.args[0], qv, builder.add(q_off_v, builder.mul(d_v, ir.Constant(i64, r))))
                  for r in range(R)]
            pk0 = _elem_ptr(context, builder, signature.args[2], kv, k_off_v)
            po = [_elem_ptr(context, builder, signature.args[8], out_v,
                            builder.add(out_off_v, builder.mul(out_stride_v, ir.Constant(i64, r)))) for r in range(R)]
            n_vec = builder.udiv(d_v, ir.Constant(i64, LANES))
            done = builder.mul(n_vec, ir.Constant(i64, LANES))
            with cgutils.for_range(builder, builder.udiv(n_v, ir.Constant(i64, J))) as keys:
                j0 = builder.mul(keys.index, ir.Constant(i64, J))
                pk = [builder.gep(pk0, [builder.mul(builder.add(j0, ir.Constant(i64, j)), k_stride_v)]) for j in range(J)]
                for j in range(J):
                    _prefetch_row(builder, pk[j], builder.mul(k_stride_v, ir.Constant(i64, PREFETCH_KEYS)), pf_v)
                accs = [cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * LANES)) for _ in range(R * J)]
                with cgutils.for_range(builder, n_vec) as loop:
                    i = builder.mul(loop.index, ir.Constant(i64, LANES))
                    kx = [_load_f32(builder, builder.gep(pk[j], [i]), LANES, half) for j in range(J)]
                    for r in range(R):
                        qx = _load_f32(builder, builder.gep(pq[r], [i]), LANES, False)
                        for j in range(J):
                            acc = accs[r * J + j]
                            builder.store(_fma(builder, qx, kx[j], builder.load(acc)), acc)
                sums = _reduce_trees(builder, [builder.load(acc) for acc in accs])
                for r in range(R):
                    for j in range(J):
                        s = cgutils.alloca_once_value(builder, sums[r * J + j])
                        with cgutils.for_range(builder, builder.sub(d_v, done)) as loop:
                            i = builder.add(done, loop.index)
                            x = builder.load(builder.gep(pq[r], [i]))
                            y = builder.extract_element(_load_f32(builder, builder.gep(pk[j], [i]), 1, half),
                                                        ir.Constant(_I32, 0))
                            builder.store(builder.fadd(builder.load(s), builder.fmul(x, y)), s)
                        builder.store(builder.fmul(builder.load(s), scale_v),
                                      builder.gep(po[r], [builder.add(j0, ir.Constant(i64, j))]))
            return context.get_dummy_value()
        return sig, codegen
    return scores


def _make_weighted_sum(n_heads: int):
    """`wsum(p, p_off, v, v_off, v_stride, n, dv, out, out_off, pf_bytes)`: for heads r < R and
    elements e < dv, out[out_off + r * dv + e] = sum over keys j < n, in key order, of
    p[p_off + r * n + j] * v[v_off + j * v_stride + e] (fma from 0). The values go in slices of 64
    elements (then 16, then 1) whose accumulators stay in registers over all the keys, each value
    vector widened once for the R heads. p float32, v float32 or float16 bits; pf_bytes: as the
    scores' (asked for in the first slice's pass)."""
    R = n_heads

    @intrinsic
    def wsum(typingctx, p, p_off, v, v_off, v_stride, n, dv, out, out_off, pf_bytes):
        if not _c_array(p, (types.float32,)) or not _c_array(v, (types.float32, types.uint16)) \
                or not _c_array(out, (types.float32,)):
            return None
        half = v.dtype == types.uint16
        sig = types.void(p, types.intp, v, types.intp, types.intp, types.intp, types.intp, out, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            pv, p_off_v, vv, v_off_v, v_stride_v, n_v, dv_v, out_v, out_off_v, pf_v = args
            i64 = n_v.type
            pp = [_elem_ptr(context, builder, signature.args[0], pv, builder.add(p_off_v, builder.mul(n_v, ir.Constant(i64, r))))
                  for r in range(R)]
            po = [_elem_ptr(context, builder, signature.args[7], out_v, builder.add(out_off_v, builder.mul(dv_v, ir.Constant(i64, r))))
                  for r in range(R)]
            pv0 = _elem_ptr(context, builder, signature.args[2], vv, v_off_v)

            def one_slice(e, nv, lanes, pf):
                """elements e .. e + nv * lanes of every head, over all the keys"""
                vf = ir.VectorType(_F32, lanes)
                accs = [cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * lanes)) for _ in range(R * nv)]
                with cgutils.for_range(builder, n_v) as loop:
                    row = builder.gep(pv0, [builder.add(builder.mul(loop.index, v_stride_v), e)])
                    _prefetch_row(builder, row, builder.mul(v_stride_v, ir.Constant(i64, PREFETCH_KEYS)), pf)
                    xs = [_load_f32(builder, builder.gep(row, [ir.Constant(i64, s * lanes)]), lanes, half) for s in range(nv)]
                    for r in range(R):
                        w = _splat(builder, builder.load(builder.gep(pp[r], [loop.index])), lanes)
                        for s in range(nv):
                            acc = accs[r * nv + s]
                            builder.store(_fma(builder, w, xs[s], builder.load(acc)), acc)
                for r in range(R):
                    for s in range(nv):
                        dst = builder.gep(po[r], [builder.add(e, ir.Constant(i64, s * lanes))])
                        builder.store(builder.load(accs[r * nv + s]), builder.bitcast(dst, vf.as_pointer()), align=4)

            zero = ir.Constant(i64, 0)
            done = zero
            for width, nv, lanes in ((64, 4, LANES), (LANES, 1, LANES), (1, 1, 1)):
                count = builder.udiv(builder.sub(dv_v, done), ir.Constant(i64, width))
                with cgutils.for_range(builder, count) as loop:
                    e = builder.add(done, builder.mul(loop.index, ir.Constant(i64, width)))
                    first = builder.icmp_unsigned("==", e, zero)      # the first slice's pass
                    one_slice(e, nv, lanes, builder.select(first, pf_v, zero))
                done = builder.add(done, builder.mul(count, ir.Constant(i64, width)))
            return context.get_dummy_value()
        return sig, codegen
    return wsum


# heads x keys a scores step takes: four heads sharing a key, fewer heads over more keys
scores_4x1, scores_3x1, scores_2x2, scores_1x4 = (_make_scores(r, j) for r, j in ((4, 1), (3, 1), (2, 2), (1, 4)))
scores_2x1, scores_1x1 = _make_scores(2, 1), _make_scores(1, 1)
wsum_4, wsum_3, wsum_2, wsum_1 = (_make_weighted_sum(r) for r in (4, 3, 2, 1))


@intrinsic
def exp_shift_at(typingctx, x, i0, n, m):
    """x[i0 + i] = exp(x[i0 + i] - m) for i < n (x float32, C-contiguous; values <= m)."""
    if not _c_array(x, (types.float32,)):
        return None
    sig = types.void(x, types.intp, types.intp, types.float32)

    def codegen(context, builder, signature, args):
        base = _elem_ptr(context, builder, signature.args[0], args[0], args[1])

        def body(i, width):
            p = builder.gep(base, [i])
            v = builder.fsub(_load_vec(builder, p, _F32, width, 4), _splat(builder, args[3], width))
            builder.store(_exp_ir(builder, v), builder.bitcast(p, v.type.as_pointer()), align=4)
        _vec_loop(builder, args[2], body)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def exp_f32(typingctx, x):
    """exp(x) for x <= 0, the same bits as exp_shift_at gives for that lane value."""
    if x != types.float32:
        return None
    sig = types.float32(x)

    def codegen(context, builder, signature, args):
        v = builder.insert_element(ir.Constant(ir.VectorType(_F32, 1), ir.Undefined), args[0], ir.Constant(_I32, 0))
        return builder.extract_element(_exp_ir(builder, v), ir.Constant(_I32, 0))
    return sig, codegen


@intrinsic
def sum_at(typingctx, x, i0, n):
    """sum of x[i0 : i0 + n] in a fixed order: 16-lane accumulators, a halving tree, the tail."""
    if not _c_array(x, (types.float32,)):
        return None
    sig = types.float32(x, types.intp, types.intp)
    vf = ir.VectorType(_F32, LANES)

    def codegen(context, builder, signature, args):
        base = _elem_ptr(context, builder, signature.args[0], args[0], args[1])
        n = args[2]
        n_vec = builder.udiv(n, ir.Constant(n.type, LANES))
        acc = cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * LANES))
        with cgutils.for_range(builder, n_vec) as loop:
            p = builder.gep(base, [builder.mul(loop.index, ir.Constant(n.type, LANES))])
            builder.store(builder.fadd(builder.load(acc), _load_vec(builder, p, _F32, LANES, 4)), acc)
        s = cgutils.alloca_once_value(builder, _reduce_tree(builder, builder.load(acc), LANES))
        done = builder.mul(n_vec, ir.Constant(n.type, LANES))
        with cgutils.for_range(builder, builder.sub(n, done)) as loop:
            builder.store(builder.fadd(builder.load(s), builder.load(builder.gep(base, [builder.add(done, loop.index)]))), s)
        return builder.load(s)
    return sig, codegen


@intrinsic
def axpy_at(typingctx, a, x, ix, y, iy, n):
    """y[iy + i] = fma(a, x[ix + i], y[iy + i]) for i < n (x float32 or float16 bits, y float32)."""
    if not _c_array(x, (types.float32, types.uint16)) or not _c_array(y, (types.float32,)):
        return None
    half = x.dtype == types.uint16
    sig = types.void(types.float32, x, types.intp, y, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        px = _elem_ptr(context, builder, signature.args[1], args[1], args[2])
        py = _elem_ptr(context, builder, signature.args[3], args[3], args[4])

        def body(i, width):
            q = builder.gep(py, [i])
            xv = _load_f32(builder, builder.gep(px, [i]), width, half)
            yv = _fma(builder, _splat(builder, args[0], width), xv, _load_vec(builder, q, _F32, width, 4))
            builder.store(yv, builder.bitcast(q, yv.type.as_pointer()), align=4)
        _vec_loop(builder, args[5], body)
        return context.get_dummy_value()
    return sig, codegen


# --------------------------------------------------------------------------- KV cache rows

def cache_store(row, x):
    """Write float32 x [d] into one cache row (a position's KV head), in the cache's storage."""


def _chunk_rows(cache, g, j0, n):
    """(array, offset, stride, prefetch bytes): rows j0 .. j0 + n - 1 of KV head g as float32 or
    float16 bits at array[offset + j * stride :] (flat elements) — the cache itself, or (q8_0)
    dequantized — and how many bytes of each later row the loops over them should prefetch (the
    whole position for head 0, see _prefetch_row; none for the others, or a dequantized copy)."""


def _is_q8_0_cache(cache):
    return isinstance(cache, types.Array) and cache.ndim == 4 and cache.dtype == types.uint8


@njit(cache=CACHE, nogil=True)
def _q8_0_dequantize_row(row, out, off):
    for b in range(row.shape[0]):
        d = load_f16(row[b], 0)
        for i in range(32):
            out[off + 32 * b + i] = np.float32(np.int8(row[b, 2 + i])) * d


@njit(cache=CACHE, nogil=True)
def _q8_0_quantize_row(row, x):
    for b in range(row.shape[0]):
        amax = np.float32(0.0)
        for i in range(32):
            amax = max(amax, abs(x[32 * b + i]))
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        bits = f32_to_f16_bits(d)
        row[b, 0], row[b, 1] = np.uint8(bits & 0xFF), np.uint8(bits >> 8)
        for i in range(32):
            # gguf-py's np_roundf: floor(|a|) + floor(2 frac(|a|)), half away from zero
            a = x[32 * b + i] * inv
            mag = np.floor(abs(a))
            q = mag + np.floor(np.float32(2.0) * (abs(a) - mag))
            row[b, 2 + i] = np.uint8(np.int8(-q if a < 0 else q) & 0xFF)


@njit(cache=CACHE, nogil=True)
def _f16_store_row(row, x):
    for i in range(row.shape[0]):
        row[i] = f32_to_f16_bits(x[i])


@njit(cache=CACHE, nogil=True)
def _f32_store_row(row, x):
    for i in range(row.shape[0]):
        row[i] = x[i]


@njit(cache=CACHE, nogil=True)
def _q8_0_rows(cache, g, j0, n):
    d = cache.shape[2] * 32
    out = np.empty(n * d, np.float32)
    for j in range(n):
        _q8_0_dequantize_row(cache[j0 + j, g], out, j * d)
    return out, 0, d, 0


@njit(cache=CACHE, nogil=True)
def _cache_rows(cache, g, j0):
    position = cache.shape[1] * cache.shape[2]
    return cache, j0 * position + g * cache.shape[2], position, position * cache.itemsize if g == 0 else 0


# (not inline="always": Numba's inliner trips over the loops of the q8_0 helpers; these are calls)
@overload(cache_store)
def _cache_store_impl(row, x):
    if isinstance(row, types.Array) and row.ndim == 2 and row.dtype == types.uint8:
        return lambda row, x: _q8_0_quantize_row(row, x)
    if row.ndim == 1 and row.dtype == types.float32:
        return lambda row, x: _f32_store_row(row, x)
    if row.ndim == 1 and row.dtype == types.uint16:
        return lambda row, x: _f16_store_row(row, x)


@overload(_chunk_rows, inline="always")
def _chunk_rows_impl(cache, g, j0, n):
    if _is_q8_0_cache(cache):
        return lambda cache, g, j0, n: _q8_0_rows(cache, g, j0, n)
    if cache.ndim == 3 and cache.dtype in (types.float32, types.uint16):
        return lambda cache, g, j0, n: _cache_rows(cache, g, j0)


# --------------------------------------------------------------------------- the kernel

@njit(cache=CACHE, nogil=True, inline="always")
def _key_range(pos, window, first):
    """First and last key a token at pos sees (inclusive)."""
    return (max(first, pos - window + 1) if window > 0 else first), pos


@njit(cache=CACHE, nogil=True, inline="always")
def group_scores(r, q, q_off, k, k_off, k_stride, n, d, scale, out, out_off, pf):
    """Scores of r (1-4) query heads (q rows q_off, q_off + d, ...) over n keys into out[out_off +
    head * n + key]: four heads share each key; fewer take two or four keys a step."""
    if r == 4:
        scores_4x1(q, q_off, k, k_off, k_stride, n, d, scale, out, out_off, n, pf)
    elif r == 3:
        scores_3x1(q, q_off, k, k_off, k_stride, n, d, scale, out, out_off, n, pf)
    elif r == 2:
        m = n - n % 2
        scores_2x2(q, q_off, k, k_off, k_stride, m, d, scale, out, out_off, n, pf)
        scores_2x1(q, q_off, k, k_off + m * k_stride, k_stride, n - m, d, scale, out, out_off + m, n, pf)
    else:
        m = n - n % 4
        scores_1x4(q, q_off, k, k_off, k_stride, m, d, scale, out, out_off, n, pf)
        scores_1x1(q, q_off, k, k_off + m * k_stride, k_stride, n - m, d, scale, out, out_off + m, n, pf)


@njit(cache=CACHE, nogil=True, inline="always")
def group_values(r, p, p_off, v, v_off, v_stride, n, dv, out, out_off, pf):
    """out[out_off + head * dv + e] = sum over the n keys of the head's weights (p[p_off + head * n
    + key]) times value element e, for r (1-4) heads."""
    if r == 4:
        wsum_4(p, p_off, v, v_off, v_stride, n, dv, out, out_off, pf)
    elif r == 3:
        wsum_3(p, p_off, v, v_off, v_stride, n, dv, out, out_off, pf)
    elif r == 2:
        wsum_2(p, p_off, v, v_off, v_stride, n, dv, out, out_off, pf)
    else:
        wsum_1(p, p_off, v, v_off, v_stride, n, dv, out, out_off, pf)


@njit(cache=CACHE, nogil=True, inline="always")
def _attend_chunk(item, t, c, g, q, k_cache, v_cache, start, n_head, n_kv, d, dv, scale, window, first,
                  parts, stats):
    """Item (token t, chunk c, KV head g): for each query head of the group, its chunk's max score,
    sum of exp(score - max) and those weights times the values (unnormalized), into parts / stats."""
    lo, pos = _key_range(start + t, window, first)
    j0 = max(lo, c * CHUNK_KEYS)
    n = min(pos, c * CHUNK_KEYS + CHUNK_KEYS - 1) - j0 + 1
    group = n_head // n_kv
    scores = np.empty(group * n, np.float32)          # head hh's scores at hh * n
    kb, k_off, k_stride, k_pf = _chunk_rows(k_cache, g, j0, n)
    q_off = (t * n_head + g * group) * d
    for h0 in range(0, group, 4):
        group_scores(min(4, group - h0), q, q_off + h0 * d, kb, k_off, k_stride, n, d, scale, scores, h0 * n,
                     k_pf if h0 == 0 else 0)
    for h in range(group):
        best = np.float32(-np.inf)
        for j in range(n):
            best = max(best, scores[h * n + j])
        exp_shift_at(scores, h * n, n, best)
        stats[item * group + h, 0] = best
        stats[item * group + h, 1] = sum_at(scores, h * n, n)
    vb, v_off, v_stride, v_pf = _chunk_rows(v_cache, g, j0, n)
    p_off = item * group * dv
    for h0 in range(0, group, 4):
        group_values(min(4, group - h0), scores, h0 * n, vb, v_off, v_stride, n, dv, parts, p_off + h0 * dv,
                     v_pf if h0 == 0 else 0)


@njit(cache=CACHE, nogil=True, inline="always")
def _merge(th, out, parts, stats, item0, chunk0, start, n_head, n_kv, dv, window, first):
    """out[(t * n_head + h) * dv :] (o flat) = the weighted values of (token t, head h) over its
    chunks, in chunk order."""
    t, h = th // n_head, th % n_head
    group = n_head // n_kv
    g, hh = h // group, h % group
    _, pos = _key_range(start + t, window, first)
    n_chunks = pos // CHUNK_KEYS - chunk0[t] + 1
    best = np.float32(-np.inf)
    for c in range(n_chunks):
        best = max(best, stats[(item0[t] + c * n_kv + g) * group + hh, 0])
    o_off = (t * n_head + h) * dv
    for i in range(dv):
        out[o_off + i] = 0.0
    total = np.float32(0.0)
    for c in range(n_chunks):
        row = (item0[t] + c * n_kv + g) * group + hh
        w = exp_f32(stats[row, 0] - best)
        total += stats[row, 1] * w
        axpy_at(w, parts, row * dv, out, o_off, dv)
    inv = np.float32(1.0) / total
    for i in range(dv):
        out[o_off + i] *= inv


@njit(cache=CACHE, nogil=True)
def _items(k, start, n_kv, window, first):
    """Token t's items are item0[t] .. item0[t + 1] - 1: (chunk chunk0[t] + i // n_kv, KV head i % n_kv)."""
    item0, chunk0 = np.empty(k + 1, np.intp), np.empty(k, np.intp)
    n = 0
    for t in range(k):
        lo, pos = _key_range(start + t, window, first)
        item0[t], chunk0[t] = n, lo // CHUNK_KEYS
        n += (pos // CHUNK_KEYS - lo // CHUNK_KEYS + 1) * n_kv
    item0[k] = n
    return item0, chunk0


@njit(cache=CACHE, nogil=True, inline="always")
def _item_at(item, item0, chunk0, n_kv):
    t = 0
    while item0[t + 1] <= item:
        t += 1
    i = item - item0[t]
    return t, chunk0[t] + i // n_kv, i % n_kv


# No fastmath anywhere here (see the module docstring): the serial and the parallel loop run the
# same inlined item code, and the same merge.
@njit(cache=CACHE, nogil=True, parallel=True)
def _chunks_parallel(item0, chunk0, q, k_cache, v_cache, start, n_head, n_kv, d, dv, scale, window, first,
                     parts, stats):
    for item in prange(item0[-1]):
        t, c, g = _item_at(item, item0, chunk0, n_kv)
        _attend_chunk(item, t, c, g, q, k_cache, v_cache, start, n_head, n_kv, d, dv, scale, window, first,
                      parts, stats)


ATTEND_PARALLEL_MIN = 1 << 15    # (token, head) x keys x head size products before attention forks


@njit(cache=CACHE, nogil=True)
def attend(n_threads, q, k_cache, v_cache, o, start, n_head, n_kv, d, dv, scale, window, first):
    """o (k, n_head * dv) = softmax(scale q K^T) V per token and head, token t at position start + t
    seeing keys max(first, pos - window + 1) .. pos (window 0: from first); q (k, n_head * d) float32,
    o float32, both C-contiguous; caches (n_ctx, n_kv, d) float32 or float16 bits, or q8_0
    (n_ctx, n_kv, d / 32, 34)."""
    k = q.shape[0]
    item0, chunk0 = _items(k, start, n_kv, window, first)
    n_items = item0[k]
    group = n_head // n_kv
    parts = np.empty(n_items * group * dv, np.float32)
    stats = np.empty((n_items * group, 2), np.float32)
    if n_threads > 1 and n_items > 1 and k * n_head * (start + k) * d >= ATTEND_PARALLEL_MIN:
        _chunks_parallel(item0, chunk0, q, k_cache, v_cache, start, n_head, n_kv, d, dv, scale, window, first,
                         parts, stats)
    else:
        for item in range(n_items):
            t, c, g = _item_at(item, item0, chunk0, n_kv)
            _attend_chunk(item, t, c, g, q, k_cache, v_cache, start, n_head, n_kv, d, dv, scale, window, first,
                          parts, stats)
    out = o.reshape(o.size)
    for th in range(k * n_head):
        _merge(th, out, parts, stats, item0, chunk0, start, n_head, n_kv, dv, window, first)

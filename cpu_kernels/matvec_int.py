"""The k-input quantized matvec on int8 activations: integer dot products, as llama.cpp does.

Why: with float activations every weight must become a float32 before its fma (matvec.py), about
half an instruction per weight, so the float kernel is decode-bound at 15-25 % of read bandwidth.
Here the activations are quantized once per call (quantize_act: int8 blocks with a float scale)
and a weight block only has to become bytes: nibbles masked and shifted into 64-byte vectors in
element order, then multiplied with the activation bytes 64 at a time (simd_int: vpdpbusd), the
K-quant sub-block scales applied to the raw sums (two chunks' packed to int16, one vpdpwssd; IQ4_XS,
whose looked-up level bytes reach 241, in int32). IQ4_NL / IQ4_XS levels come from one vpshufb.
Every weight stream is prefetched a kilobyte ahead (the rows are short, side by side streams).

Per (token, row) every path computes the same exact integers and applies the same float steps in
the same order (the numerics block below): one float lane per (token, row), so a token's result is
bit-identical whatever k is, where the token sits in the batch, how many threads run, and which
of the kernels below computed it (tested for every type):

    k <= 5      block_dots, register groups: a group of rows by tokens (4 rows x 1 token for
                decode, 4 x 2 or 2 x 4 for verify batches; a single row where SINGLE_ROWS says
                this CPU streams short rows faster one at a time), each row's step decoded into
                registers once and dotted with each token in 64-byte vectors (integers over 16
                lanes), the group's lanes folded (exactly) and packed into one vector: one sitofp
                + fma per term for the whole group, so the float steps cost little per (row, token).
                Where TWO_PHASES says so (Q8_0's short rows on AMD Zen), a group's rows are read
                one after another, their block sums kept in a stack buffer for the group's float
                steps: side by side, short rows stream from memory at half speed there.
    k >= 6      tiled, token quads: rows in tiles, columns in chunks whose activations stay in
                L1, each step decoded once per 16 tokens into a stack buffer; the activations
                interleaved by 16 bytes per 4 tokens, each 16 weight bytes broadcast to the 4
                tokens: one vpdpbusd per 64 products, each token's integers in its own 4 lanes,
                float state in an L1 buffer.
    row lanes   on AVX-512 VNNI (ROW_LANES_HOST), in place of both above from 1-4 tokens (per
                type) to the token lanes' k: block_dots takes 16 rows at a time, transposed so
                each lane holds one row (matvec_rowlanes): one vpdpbusd multiplies 4 weights of
                16 rows by a token's broadcast activation dword, nothing is folded, and a step's
                transposes are shared by the tokens of a pass (up to 8). Q8_0 on the 27B FFN
                shapes: 8 tokens cost 1.2-1.5x one, against 2.2-2.9x in the token quads.
    k >= 12     tiled, token lanes (legacy types: k >= 10), the prompt GEMM: the activations
                transposed, 16 tokens' 4-byte groups in one vector (k padded to 16); each 4
                weight bytes broadcast and one vpdpbusd adds 4 products for 16 tokens, so every
                integer lands in its token's lane. Rows go 4 at a time: each activation
                vector loaded once for the 4 rows, each weight broadcast folded into its
                vpdpbusd as a memory operand (the weights are its signed side, the activations
                stored as a + 128 its unsigned side, the offset taken off per row and block).

Accuracy: the integer parts are exact, so the result is the float64 product of the dequantized
weights with the *dequantized int8 activations* up to float32 rounding of the scaling steps; vs
float activations it carries the activation quantization error (|x - q dx| <= dx / 2 per value),
as llama.cpp's CPU backend does. matvec(..., exact=True) keeps the float kernel.
"""
from __future__ import annotations

import numpy as np
import numba
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from gguf.constants import GGMLQuantizationType as _T

from .formats import type_tag
from .int_blocks import INT_TYPES, types_tag  # noqa: F401  (public here: matvec's users import them from here)
from .int_blocks import (K_SUB, SPECS, PairBlock, _bcast_dword, _by_type, _c64, _c_2d, _decoded, _loop, _max_k_lookup,
                         _opaque, _prefetch_ahead, _qtype_arg, _steps, _Tokens, _weight_row, act_block, steps_per_row)
from .matvec_rowlanes import PASS_TOKENS, ROW_LANES, ROW_LANES_HOST, row_lanes_dot, row_lanes_from
from .matvec_simd import _array, _fma, _load_vec, _splat
from .quantize_act import QK_K, QK_LEGACY, quantize_rows
from .simd_int import (CACHE, F32, I8, I16, I32, I64, IntBlockIR, _concat, _intrinsic, dpbusd, dpwssd, packs,
                       pmaddwd)

GROUPS_PER_THREAD = 4











# --------------------------------------------------------------------------- numerics
# Every path computes, per (token, row), the same exact integers and the same float operations in
# the same order (bit identity across k, batch position, threads and kernels):
#
#   K step (super-block) i:  isum = sum_e q_e a_e sc(e) [+ sum_g off_g bs_g]  msum = sum_g m_g bs_g
#                            y = fma(float(isum), d dx, y);  y = fma(float(msum), -dmin dx, y)
#   legacy block b (A, B of a pair step, in order):
#                            isum = sum_e q_e a_e + off bs_b
#                            y = fma(float(isum), d_b dx_b, y);  y = fma(float(bs_b), m_b dx_b, y)
#
# starting from y = 0 (the msum / bs_b terms only for the types with mins). One float lane per
# (token, row): the kernels differ only in how they reach the integers and which lanes hold which
# tokens.

K_FOLD = ((16, range(8), range(8, 16)), (8, range(4), range(4, 8)), (4, [0, 1], [2, 3]), (2, [0], [1]))
# legacy: lanes 0-7 block A, 8-15 block B -> per token [A, B]
PAIR_FOLD = ((16, [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]), (8, [0, 1, 4, 5], [2, 3, 6, 7]),
             (4, [0, 2], [1, 3]))


def _fold(b, vecs, per, lo, hi):
    """vecs hold whole tokens of `per` lanes each. Returns vectors holding, token by token in the
    same order, the lanes v[lo] + v[hi]; each pair of input vectors becomes one output vector."""
    out = []
    for j in range(0, len(vecs), 2):
        u = vecs[j]
        w = vecs[j + 1] if j + 1 < len(vecs) else None
        n = u.type.count
        toks = [t * per for t in range(n // per)] + ([] if w is None else [n + t * per for t in range(n // per)])

        def idx(sel):
            lanes = [base + x for base in toks for x in sel]
            return ir.Constant(ir.VectorType(I32, len(lanes)), lanes)
        other = u if w is None else w
        out.append(b.add(b.shuffle_vector(u, other, idx(lo)), b.shuffle_vector(u, other, idx(hi))))
    return out


def _fold_all(b, vecs, stages):
    for per, lo, hi in stages:
        vecs = _fold(b, vecs, per, list(lo), list(hi))
    assert len(vecs) == 1
    return vecs[0]


def _concat_all(b, vecs):
    while len(vecs) > 1:
        vecs = [_concat(b, vecs[j], vecs[j + 1]) for j in range(0, len(vecs), 2)]
    return vecs[0]


def _lanes(b, vec, idx):
    return b.shuffle_vector(vec, ir.Constant(vec.type, ir.Undefined), ir.Constant(ir.VectorType(I32, len(idx)), idx))


def _vec1(b, x):
    return b.insert_element(ir.Constant(ir.VectorType(x.type, 1), ir.Undefined), x, ir.Constant(I32, 0))


# --------------------------------------------------------------------------- lane groups
# A group is g (1, 2 or 4) (row, token) pairs, one float lane each: g tokens of one row (k = 2..15)
# or g rows for one token (k = 1). Each pair's step is dotted in 64-byte vectors (its integers
# spread over 16 lanes), folded exactly to one lane (two for a legacy pair: A, B), and the group
# scaled together: one sitofp + fma per term for g pairs. An entry is (vb, (q, d, s)): the decoded
# step of its row, (v, blk) or a function emitting the decoder (rows decoded one after the other,
# each next to its dot product: 4 decoded blocks at once would not fit the registers), and its
# token's activation row pointers.



def _k_group(b, entries, i, facc):
    """facc (g lanes) after super-block i."""
    g = len(entries)
    accs, bss, dxs, ds, ms, m16 = [], [], [], [], [], []
    for vb, (q, d, s) in entries:
        v, blk = _decoded(vb)
        a_ptr = b.gep(q, [b.mul(i, _c64(QK_K))])
        # raw sums of 4 products per lane (vpdpbusd), two chunks' packed to int16 (exact: at most
        # 4 x 63 x 127) and scaled with one vpdpwssd: lane 4L + j of chunk c holds elements of
        # 128-bit lane L, whose scale is sc16[c]'s pair lane 8 L (16 elements: 8 pair lanes)
        raws = [dpbusd(b, v.zeros(I32, 16), blk.chunks[c], _load_vec(b, b.gep(a_ptr, [_c64(64 * c)]), I8, 64, 1),
                       blk.wide) for c in range(4)]
        acc = v.zeros(I32, 16)
        if blk.wide:
            for c in range(4):
                acc = b.add(acc, b.mul(raws[c], blk.sc32(v, c)))
        else:
            for c in (0, 2):
                scw = v.shuf(blk.sc16[c], [x for L in range(4) for x in [8 * L] * 4 + [32 + 8 * L] * 4], blk.sc16[c + 1])
                acc = dpwssd(b, acc, packs(b, raws[c], raws[c + 1]), scw)
        bs = _load_vec(b, b.gep(s, [b.mul(i, _c64(16))]), I16, 16, 2)
        if blk.off16 is not None:
            acc = b.add(acc, v.concat(pmaddwd(b, blk.off16, bs), v.zeros(I32, 8)))
        accs.append(acc)
        bss.append(bs)
        dxs.append(_vec1(b, b.load(b.gep(d, [i]))))
        ds.append(_vec1(b, blk.d))
        ms.append(None if blk.min16 is None else _vec1(b, blk.negdmin))
        m16.append(blk.min16)
    fv = ir.VectorType(F32, g)
    dx = _concat_all(b, dxs)
    isum = _fold_all(b, accs, K_FOLD)
    facc = _fma(b, b.sitofp(isum, fv), b.fmul(_concat_all(b, ds), dx), facc)
    if ms[0] is not None:
        mins = []
        for j in range(0, g, 2):
            if j + 1 < g:
                mins.append(pmaddwd(b, _concat(b, m16[j], m16[j + 1]), _concat(b, bss[j], bss[j + 1])))
            else:
                mins.append(pmaddwd(b, m16[j], bss[j]))
        msum = _fold_all(b, mins, K_FOLD[1:])
        facc = _fma(b, b.sitofp(msum, fv), b.fmul(_concat_all(b, ms), dx), facc)
    return facc


def _pair_dot(b, v, blk, q, i):
    """The raw integer sums of block pair i of a decoded weight step with one token: 16 lanes of
    4-product sums (vpdpbusd), block A's in lanes 0-7, B's in 8-15."""
    a = _load_vec(b, b.gep(q, [b.mul(i, _c64(64))]), I8, 64, 1)
    return dpbusd(b, v.zeros(I32, 16), blk.w, a, blk.wide)


def _pair_group(b, entries, i, facc):
    """facc (g lanes) after block pair i: block A's terms, then block B's."""
    accs, d2, m2 = [], [], []
    for vb, (q, d, s) in entries:
        v, blk = _decoded(vb)
        accs.append(_pair_dot(b, v, blk, q, i))
        d2.append(blk.d2)
        m2.append(blk.m2)
    ab = _fold_all(b, accs, PAIR_FOLD)         # 2g lanes: pair 0 A, pair 0 B, pair 1 A, ...
    return _pair_terms(b, ab, [t for _, t in entries], d2, m2 if blk.m2 is not None else None, blk.off, i, facc)


def _pair_terms(b, ab, toks, d2, m2, off, i, facc):
    """facc after block pair i, from the entries' block sums (ab: entry e's blocks A and B in lanes
    2e, 2e + 1), each entry's token's activation rows (toks: (q, d, s) pointers), its weight scales
    d2 and mins m2 (None: the type has none) and the type's integer offset: the offset and the
    float steps (the numerics block)."""
    g = len(toks)
    bs2, dx2 = [], []
    for q, d, s in toks:
        bs2.append(b.sext(_load_vec(b, b.gep(s, [b.mul(i, _c64(2))]), I16, 2, 2), ir.VectorType(I32, 2)))
        dx2.append(_load_vec(b, b.gep(d, [b.mul(i, _c64(2))]), F32, 2, 4))
    fv = ir.VectorType(F32, g)
    bs = _concat_all(b, bs2)
    if off:                 # the type's constants: the same for every entry
        ab = b.add(ab, b.mul(bs, ir.Constant(bs.type, [off] * (2 * g))))
    dx, dw = _concat_all(b, dx2), _concat_all(b, d2)
    mw = None if m2 is None else _concat_all(b, m2)
    for h in range(2):
        sel = [2 * u + h for u in range(g)]
        dxh = _lanes(b, dx, sel)
        facc = _fma(b, b.sitofp(_lanes(b, ab, sel), fv), b.fmul(_lanes(b, dw, sel), dxh), facc)
        if mw is not None:
            facc = _fma(b, b.sitofp(_lanes(b, bs, sel), fv), b.fmul(_lanes(b, mw, sel), dxh), facc)
    return facc


# --------------------------------------------------------------------------- token lanes (prompts)
# For 16 and more tokens the activations are transposed (quantize_lanes): 16 tokens' 4-byte
# groups side by side in one 64-byte vector. A decoded weight step goes to a small stack buffer;
# each 4 weight bytes are broadcast to all lanes and one vpdpbusd adds 4 products for 16 tokens,
# so a token's integers land in its own lane: no folding, and every scaling step is one vector
# instruction for 16 tokens. This is the prompt-processing GEMM: per 16 tokens and 256 weights
# 64 vpdpbusd plus about 25 instructions of scales, vs about 16 instructions per token above.
# Rows go 4 at a time (_k_lanes, _pair_lanes): one row alone loaded a 64-byte activation vector per
# vpdpbusd and L1 could not feed more than ~1 a cycle; 4 rows share it, and their weights, stored
# once per step (not once per token vector: LLVM spilled and reloaded the decoded step then), are
# read back through an opaque pointer as broadcasts that fold into the vpdpbusd. Q4_K at k = 512,
# one core, an L2-resident matrix: 78 -> 157 G multiply-adds/s (BENCHMARKS.md, session 24).


def _offset_128(v, blk):
    """128 sum_j sc(j) w_j over a decoded K super-block, splat to i32 x 16: what activations offset
    by 128 add to its scaled integer sum (sc(j): weight j's sub-block scale)."""
    b = v.b
    ones = v.bconst(1, 64)
    acc = v.zeros(I32, 16)
    for c in range(4):
        acc = b.add(acc, b.mul(dpbusd(b, v.zeros(I32, 16), blk.chunks[c], ones), blk.sc32(v, c)))
    total = _intrinsic(b, "llvm.vector.reduce.add.v16i32", I32, [acc])
    return _splat(b, b.shl(total, ir.Constant(I32, 7)), 16)


def _store_bytes(b, buf, off, vec):
    b.store(vec, b.bitcast(b.gep(buf, [_c64(off)]), vec.type.as_pointer()), align=1)


# --------------------------------------------------------------------------- token quads (verify-sized batches)
# K-quants, 4 tokens a unit: the activations interleaved by 16 bytes (quantize_tiled): one 64-byte
# vector holds the same 16 columns of 4 tokens. A decoded weight step goes to a stack buffer once;
# each 16 weight bytes are broadcast to the 4 tokens and one vpdpbusd adds 64 products, each token's
# integers in its own 4 lanes. The sub-block scales are applied after the raw sums: two sub-blocks'
# sums packed to int16 (exact: at most 8 products of |q| <= 31 or 4 of |q| <= 63, times 127) and one
# vpdpwssd with their scales. Per 4 tokens and 256 weights: 16 vpdpbusd, 4-8 packs and vpdpwssd,
# one fold of 4 lanes per token; the float steps are the numerics block's, one lane per token.

class _QuadStep:
    """A decoded step as the quad kernels read it: its bytes in a stack buffer and, for a K step,
    the scale words of each pair of raw sums."""

    def __init__(self, v, blk, wbuf, sub):
        b = v.b
        if isinstance(blk, PairBlock):
            blk = [blk]
        self.blks = blk if isinstance(blk, list) else None      # legacy: one or two block pairs
        chunks = [x.w for x in blk] if self.blks else blk.chunks
        for c, chunk in enumerate(chunks):
            _store_bytes(b, wbuf, 64 * c, chunk)
        # read back through a pointer LLVM cannot see is wbuf: else it forwards the stores and
        # broadcasts each 16 bytes with a shuffle (16 more vector instructions a step) instead
        # of a broadcast load (a load port, free)
        self.wbuf = _opaque(b, wbuf)
        if self.blks:
            return
        self.blk = blk
        self.per_raw = sub // 16            # 16-byte groups per raw sum
        n_raw = 16 // self.per_raw

        def scale_lane(m):        # the lane of sc16[chunk] holding raw sum m's scale (8 lanes a group)
            g = m * self.per_raw
            return g // 4, (g % 4) * 8
        self.scw = []
        if blk.wide:        # each raw sum times its sub-block's scale in int32 (KBlock.wide)
            self.scm = []
            for m in range(n_raw):
                c, lane = scale_lane(m)
                sc = b.sext(b.extract_element(blk.sc16[c], ir.Constant(I32, lane)), I32)
                self.scm.append(_splat(b, sc, 16))
            return
        for p in range(n_raw // 2):
            (c, lo), (_, hi) = scale_lane(2 * p), scale_lane(2 * p + 1)
            self.scw.append(v.shuf(blk.sc16[c], ([lo] * 4 + [hi] * 4) * 4))


def _bcast16(b, buf, off):
    """16 bytes of the buffer at off, in all four 128-bit lanes (a load-port broadcast)."""
    x = _load_vec(b, b.gep(buf, [_c64(off)]), I8, 16, 1)
    return b.shuffle_vector(x, ir.Constant(x.type, ir.Undefined), ir.Constant(ir.VectorType(I32, 64), list(range(16)) * 4))


def _per_token4(v, bs01, bs23, coef16):
    """sum_g coef16[g] bs[t, g] as i32 x 16, token t's share in lanes 4t .. 4t+3 (bs01, bs23: the
    16-value sums of tokens 0, 1 and 2, 3)."""
    b = v.b
    c2 = v.concat(coef16, coef16)
    x, y = pmaddwd(b, bs01, c2), pmaddwd(b, bs23, c2)        # [t 8 lanes, t' 8 lanes]
    lo = [8 * t + j for t in range(4) for j in range(4)]
    return b.add(v.shuf(x, lo, y), v.shuf(x, [i + 4 for i in lo], y))


def _k_quad(v, st, i, rows, facc):
    """facc (4 tokens) after super-block i; rows: the unit's (q, d, s) rows (quantize_tiled)."""
    b = v.b
    q, d, s = rows
    blk = st.blk
    step_q = b.gep(q, [b.mul(i, _c64(4 * QK_K))])
    raws = []
    for m in range(16 // st.per_raw):
        acc = v.zeros(I32, 16)
        for g in range(m * st.per_raw, (m + 1) * st.per_raw):
            a = _load_vec(b, b.gep(step_q, [_c64(64 * g)]), I8, 64, 1)
            acc = dpbusd(b, acc, _bcast16(b, st.wbuf, 16 * g), a, blk.wide)
        raws.append(acc)
    isum = v.zeros(I32, 16)
    for p, scw in enumerate(st.scw):
        isum = dpwssd(b, isum, packs(b, raws[2 * p], raws[2 * p + 1]), scw)
    if blk.wide:
        for raw, sc in zip(raws, st.scm):
            isum = b.add(isum, b.mul(raw, sc))
    if blk.off16 is not None or blk.min16 is not None:
        step_s = b.gep(s, [b.mul(i, _c64(64))])                  # 16 sums of 4 tokens
        bs01 = _load_vec(b, step_s, I16, 32, 2)
        bs23 = _load_vec(b, b.gep(step_s, [_c64(32)]), I16, 32, 2)
    if blk.off16 is not None:
        isum = b.add(isum, _per_token4(v, bs01, bs23, blk.off16))
    halves = [4 * t + h for t in range(4) for h in (0, 1)]
    if blk.min16 is not None:         # fold isum and msum together: [isum t0..t3, msum t0..t3]
        msum = _per_token4(v, bs01, bs23, blk.min16)
        pair = b.add(v.shuf(isum, halves + [16 + x for x in halves], msum),
                     v.shuf(isum, [x + 2 for x in halves] + [18 + x for x in halves], msum))
        sums = b.add(v.shuf(pair, list(range(0, 16, 2))), v.shuf(pair, list(range(1, 16, 2))))
        isum4, msum4 = v.shuf(sums, [0, 1, 2, 3]), v.shuf(sums, [4, 5, 6, 7])
    else:
        pair = b.add(v.shuf(isum, halves), v.shuf(isum, [x + 2 for x in halves]))
        isum4 = b.add(v.shuf(pair, [0, 2, 4, 6]), v.shuf(pair, [1, 3, 5, 7]))
    fv = ir.VectorType(F32, 4)
    dx = _load_vec(b, b.gep(d, [b.mul(i, _c64(4))]), F32, 4, 4)
    facc = _fma(b, b.sitofp(isum4, fv), b.fmul(v.fsplat(blk.d, 4), dx), facc)
    if blk.min16 is not None:
        facc = _fma(b, b.sitofp(msum4, fv), b.fmul(v.fsplat(blk.negdmin, 4), dx), facc)
    return facc


def _pair_quad(v, st, i, rows, facc):
    """facc (4 tokens) after block pairs i (and i + 1 when st holds two), legacy types, 4 tokens
    interleaved as for _k_quad: the blocks' raw sums folded to [A t0..t3, B t0..t3, ...], then the
    numerics block's float terms block by block (A, B, C, D), each conversion and scale product
    done once for all blocks' lanes."""
    b = v.b
    q, d, s = rows
    blk = st.blks[0]
    n_blk = 2 * len(st.blks)
    step_q = b.gep(q, [b.mul(i, _c64(4 * 2 * QK_LEGACY))])
    raws = []
    for h in range(n_blk):
        acc = v.zeros(I32, 16)
        for g in (2 * h, 2 * h + 1):
            a = _load_vec(b, b.gep(step_q, [_c64(64 * g)]), I8, 64, 1)
            acc = dpbusd(b, acc, _bcast16(b, st.wbuf, 16 * g), a, blk.wide)
        raws.append(acc)
    halves = [4 * t + h for t in range(4) for h in (0, 1)]
    pairs = [b.add(v.shuf(x, halves + [16 + j for j in halves], y), v.shuf(x, [j + 2 for j in halves] + [18 + j for j in halves], y))
             for x, y in zip(raws[0::2], raws[1::2])]          # [block A: t0 t0 t1 t1 .., block B: ..]
    if len(pairs) == 1:
        ab = b.add(v.shuf(pairs[0], list(range(0, 16, 2))), v.shuf(pairs[0], list(range(1, 16, 2))))
    else:
        ab = b.add(v.shuf(pairs[0], list(range(0, 32, 2)), pairs[1]), v.shuf(pairs[0], list(range(1, 32, 2)), pairs[1]))
    n = 4 * n_blk
    bs = b.sext(_load_vec(b, b.gep(s, [b.mul(i, _c64(8))]), I16, n, 2), ir.VectorType(I32, n))
    if blk.off:
        ab = b.add(ab, b.mul(bs, ir.Constant(bs.type, [blk.off] * n)))
    dx = _load_vec(b, b.gep(d, [b.mul(i, _c64(8))]), F32, n, 4)
    per_block = [j // 4 for j in range(n)]
    fv = ir.VectorType(F32, n)
    terms = [(b.sitofp(ab, fv), b.fmul(v.shuf(_concat_all(b, [x.d2 for x in st.blks]), per_block), dx))]
    if blk.m2 is not None:
        terms.append((b.sitofp(bs, fv), b.fmul(v.shuf(_concat_all(b, [x.m2 for x in st.blks]), per_block), dx)))
    for h in range(n_blk):
        sel = list(range(4 * h, 4 * h + 4))
        for x, scale in terms:
            facc = _fma(b, v.shuf(x, sel), v.shuf(scale, sel), facc)
    return facc


def _k_lanes_stage(rows, bufs):
    """Before a step's loop over token vectors: each row's decoded weights and scales to its stack
    buffers (once per step, not per vector), and the offsets _k_lanes takes off (None: wide)."""
    for (v, blk), (wbuf, sbuf, mbuf, obuf) in zip(rows, bufs):
        b = v.b
        for c in range(4):
            _store_bytes(b, wbuf, 64 * c, blk.chunks[c])
            _store_bytes(b, sbuf, 64 * c, b.bitcast(blk.sc32(v, c), ir.VectorType(I8, 64)))
        if blk.off16 is not None:
            _store_bytes(b, obuf, 0, blk.off16)
        if blk.min16 is not None:
            _store_bytes(b, mbuf, 0, blk.min16)
    return None if rows[0][1].wide else [_offset_128(v, blk) for v, blk in rows]


def _k_lanes(rows, i, vecs, faccs, bufs, sub, offset):
    """faccs[r][n] (16 tokens each) after super-block i of each row; rows: the rows' decoded steps
    (v, blk), bufs[r] their stack buffers; vecs: per token vector its (qT, dT, sT) rows. A group of
    4 rows takes one vector a pass: per 4-byte column one activation load and 4 broadcasts (folded
    into the instructions) feed 4 vpdpbusd; a row alone takes vectors in pairs, each broadcast
    serving both."""
    b = rows[0][0].b
    v0 = rows[0][0]
    wide = rows[0][1].wide
    wbufs = [_opaque(b, x[0]) for x in bufs]
    sbufs = [_opaque(b, x[1]) for x in bufs]
    step_q = [b.gep(q, [b.mul(i, _c64(64 * 64))]) for q, _, _ in vecs]
    rn = [(r, n) for r in range(len(rows)) for n in range(len(vecs))]
    isum = {x: v0.zeros(I32, 16) for x in rn}
    # Weights of at most 63 are vpdpbusd's signed side, so their broadcast folds into the instruction
    # as a memory operand; the activations become its unsigned side as a + 128 (one xor per vector,
    # shared by the rows), and the 128 sum(sc w) this adds is taken off each row once (exact).
    swap = offset is not None
    for e0 in range(0, QK_K, sub):
        raw = {x: v0.zeros(I32, 16) for x in rn}
        for j in range(e0 // 4, (e0 + sub) // 4):
            acts = [_load_vec(b, b.gep(p, [_c64(64 * j)]), I8, 64, 1) for p in step_q]
            if not swap:        # token_lanes stores a K-quant's activations as a + 128
                acts = [v0.bxor(a, 0x80) for a in acts]
            for r, wbuf in enumerate(wbufs):
                wj = _bcast_dword(b, wbuf, 4 * j, I8, 64)
                for n, a in enumerate(acts):
                    raw[r, n] = dpbusd(b, raw[r, n], a, wj) if swap else dpbusd(b, raw[r, n], wj, a, wide)
        for r, sbuf in enumerate(sbufs):
            sc = _bcast_dword(b, sbuf, 4 * (16 * (e0 // 64) + (e0 % 64) // 4), I32, 16)
            for n in range(len(vecs)):
                isum[r, n] = b.add(isum[r, n], b.mul(raw[r, n], sc))
    bs = []
    for _, _, s in vecs:
        step_s = b.gep(s, [b.mul(i, _c64(8 * 16))])          # int32 elements: 8 pairs of 16 tokens
        bs.append([_load_vec(b, b.gep(step_s, [_c64(16 * j)]), I16, 32, 4) for j in range(8)])
    fv = ir.VectorType(F32, 16)
    dx = [_load_vec(b, b.gep(d, [b.mul(i, _c64(16))]), F32, 16, 4) for _, d, _ in vecs]
    out = []
    for r, ((v, blk), (_, _, mbuf, obuf)) in enumerate(zip(rows, bufs)):
        xs = [isum[r, n] for n in range(len(vecs))]
        if swap:
            xs = [b.sub(x, offset[r]) for x in xs]
        if blk.off16 is not None:
            ob = _opaque(b, obuf)
            for j in range(8):
                oj = _bcast_dword(b, ob, 4 * j, I16, 32)
                xs = [dpwssd(b, x, bsn[j], oj) for x, bsn in zip(xs, bs)]
        fr = [_fma(b, b.sitofp(x, fv), b.fmul(v.fsplat(blk.d, 16), dxn), f) for x, dxn, f in zip(xs, dx, faccs[r])]
        if blk.min16 is not None:
            mb = _opaque(b, mbuf)
            msum = [v.zeros(I32, 16) for _ in vecs]
            for j in range(8):
                mj = _bcast_dword(b, mb, 4 * j, I16, 32)
                msum = [dpwssd(b, x, bsn[j], mj) for x, bsn in zip(msum, bs)]
            fr = [_fma(b, b.sitofp(x, fv), b.fmul(v.fsplat(blk.negdmin, 16), dxn), f)
                  for x, dxn, f in zip(msum, dx, fr)]
        out.append(fr)
    return out


def _pair_lanes_stage(rows, bufs):
    """Before a step's loop over token vectors: each row's block pair to its weight buffer as
    vpdpbusd's signed side (a wide type's offset bytes back to its signed weights), and 128 sum(w)
    of each block, splat to i32 x 16 (rows[r] -> [A's, B's]): what activations stored as a + 128
    add to a block's raw sum."""
    out = []
    for (v, blk), wb in zip(rows, bufs):
        b = v.b
        w = v.bxor(blk.w, 0x80) if blk.wide else blk.w
        _store_bytes(b, wb[0], 0, w)
        sums = dpbusd(b, v.zeros(I32, 16), v.bconst(1, 64), w)       # 4-weight sums, A in lanes 0-7
        corr = []
        for h in range(2):
            half = v.shuf(sums, list(range(8 * h, 8 * h + 8)))
            total = _intrinsic(b, "llvm.vector.reduce.add.v8i32", I32, [half])
            corr.append(_splat(b, b.shl(total, ir.Constant(I32, 7)), 16))
        out.append(corr)
    return out


def _pair_lanes(rows, i, vecs, faccs, bufs, corr):
    """faccs[r][n] (16 tokens each) after block pair i of each row: block A's terms, then block
    B's; rows 4 at a time as _k_lanes' (one activation load for the rows, each weight broadcast
    folded into its vpdpbusd), a block's raw sums less corr (_pair_lanes_stage). A wide type's
    integer offset (-128) is the one its staged weights already took off."""
    b = rows[0][0].b
    v0, blk0 = rows[0]
    wbufs = [_opaque(b, x[0]) for x in bufs]
    off = 0 if blk0.wide else blk0.off
    fv = ir.VectorType(F32, 16)
    out = [list(f) for f in faccs]
    for h in range(2):
        blk_i = b.add(b.mul(i, _c64(2)), _c64(h))
        blk_q = [b.gep(q, [b.mul(blk_i, _c64(8 * 64))]) for q, _, _ in vecs]
        raw = {(r, n): v0.zeros(I32, 16) for r in range(len(rows)) for n in range(len(vecs))}
        for j in range(8):
            acts = [_load_vec(b, b.gep(p, [_c64(64 * j)]), I8, 64, 1) for p in blk_q]
            for r, wbuf in enumerate(wbufs):
                wj = _bcast_dword(b, wbuf, 4 * (8 * h + j), I8, 64)
                for n, a in enumerate(acts):
                    # wide: avx2's vpmaddubsw would saturate on a + 128 times |w| up to 128
                    raw[r, n] = dpbusd(b, raw[r, n], a, wj, blk0.wide)
        for n, (_, d, s) in enumerate(vecs):
            bs = _load_vec(b, b.gep(s, [b.mul(blk_i, _c64(16))]), I32, 16, 4)
            dx = _load_vec(b, b.gep(d, [b.mul(blk_i, _c64(16))]), F32, 16, 4)
            for r, (v, blk) in enumerate(rows):
                x = b.sub(raw[r, n], corr[r][h])
                if off:
                    x = b.add(x, b.mul(bs, ir.Constant(bs.type, [off] * 16)))
                dh = v.fsplat(b.extract_element(blk.d2, ir.Constant(I32, h)), 16)
                out[r][n] = _fma(b, b.sitofp(x, fv), b.fmul(dh, dx), out[r][n])
                if blk.m2 is not None:
                    mh = v.fsplat(b.extract_element(blk.m2, ir.Constant(I32, h)), 16)
                    out[r][n] = _fma(b, b.sitofp(bs, fv), b.fmul(mh, dx), out[r][n])
    return out



# block pairs a two-phase group reads per row before folding them: a Q8_0 row shorter than
# TWO_PHASE_BYTES whole (rows read in chunks side by side stream as badly as in steps: 27B's
# 5440-byte rows at 49 % of bandwidth in chunks of 32 pairs)
PHASE_STEPS = 64
PHASE_ROWS = 4       # most rows of a two-phase group (its buffers' size)


def _two_phase_pairs(b, decode, nbytes, wrows, rb, trows, n_steps, zero, bufs):
    """facc of a legacy group (len(wrows) rows by len(trows) tokens) after its steps, computed in
    two phases per chunk of PHASE_STEPS block pairs: each row's chunk read on its own, its block
    sums for every token (the row's lanes folded: integers, the same sums in any order) and its
    scales written to `bufs` (stack buffers: i32, f32, f32); then the group's offset and float
    steps per block pair from there, as _pair_group's. The same bits as reading the rows side by
    side, which on AMD Zen 4 streams short rows from memory at about half speed (four streams 680
    bytes apart: 16-20 GB/s against 36-40 for one, a plain byte-reading loop measured the same)."""
    n_rows, n_toks = len(wrows), len(trows)
    raw, dws, mws = bufs
    vrow, v2 = ir.VectorType(I32, 2 * n_toks), ir.VectorType(F32, 2)
    meta = {}       # the type's offset and whether it has mins: known once a step is decoded

    def at(base, slot, j, width, vty):
        idx = b.mul(b.add(b.mul(slot, _c64(n_rows)), _c64(j)), _c64(width))
        return b.bitcast(b.gep(base, [idx]), vty.as_pointer())

    def chunk(c, state):
        c0 = b.mul(c, _c64(PHASE_STEPS))
        c1 = b.add(c0, _c64(PHASE_STEPS))
        c1 = b.select(b.icmp_signed("<", c1, n_steps), c1, n_steps)
        for j in range(n_rows):
            def read(vbs, i, _, j=j):
                v, blk = _decoded(vbs[0])
                slot = b.sub(i, c0)
                sums = _fold_all(b, [_pair_dot(b, v, blk, tr[0], i) for tr in trows], PAIR_FOLD)
                b.store(sums, at(raw, slot, j, 2 * n_toks, vrow), align=8)
                b.store(blk.d2, at(dws, slot, j, 2, v2), align=8)
                if blk.m2 is not None:
                    b.store(blk.m2, at(mws, slot, j, 2, v2), align=8)
                meta["off"], meta["min"] = blk.off, blk.m2 is not None
                return []
            # one row's chunk, then the next row's: the lookahead runs on into it (rb bytes on)
            _steps(b, "pair", decode, nbytes, [wrows[j]], rb, c0, c1, [], read, rb)

        def fold(i, st):
            slot = b.sub(i, c0)
            ab = _concat_all(b, [b.load(at(raw, slot, j, 2 * n_toks, vrow), align=8) for j in range(n_rows)])
            d2 = [b.load(at(dws, slot, j, 2, v2), align=8) for j in range(n_rows) for _ in trows]
            m2 = [b.load(at(mws, slot, j, 2, v2), align=8) for j in range(n_rows) for _ in trows] \
                if meta["min"] else None
            return [_pair_terms(b, ab, [t for _ in range(n_rows) for t in trows], d2, m2, meta["off"], i, st[0])]
        return _loop(b, c0, c1, state, fold)
    n_chunks = b.sdiv(b.add(n_steps, _c64(PHASE_STEPS - 1)), _c64(PHASE_STEPS))
    return _loop(b, _c64(0), n_chunks, [zero], chunk)[0]


def _make_grid_dot(name: str, shapes: dict, two_phase: dict | None = None):
    """A register kernel: `name`(qtype, n, w, r, xq, xd, xs, t0, out, oc) computes the lane group
    shapes[n] = (n_rows, n_toks, n_real): out[t0 + u, oc + j] = (row r + j) . (activation row
    t0 + u) for j < n_rows, u < n_real, one lane per (row, token), float state in registers for the
    whole row; lanes u >= n_real (groups are powers of two) repeat token n_real - 1 and are not
    stored (at compile time: their integer work folds away where it duplicates another lane's).
    Each row's step is decoded once (next to its first dot product) and dotted with every token
    of the group; the fold and the float steps run once per group for all its lanes, so wider
    groups spend less per (row, token) on them. Every lane takes the numerics block's steps
    whatever the group, so the bits are the same in any shape. two_phase (default: this CPU's
    TWO_PHASES): qtype -> the most tokens of a legacy group whose rows, when shorter than
    TWO_PHASE_BYTES, are read one after another (_two_phase_pairs) instead of side by side."""

    def lane_dot(typingctx, qtype, n_lanes, w, r, xq, xd, xs, t0, out, oc):
        if not _c_2d(w, xq, xd, xs, out):
            return None
        qt_type, only = _qtype_arg(qtype)
        sig = types.void(qt_type, types.intp, w, types.intp, xq, xd, xs, types.intp, out, types.intp)

        def codegen(context, builder, signature, args):
            b = builder
            qt_, n_, w_, r_, xq_, xd_, xs_, t0_, out_, oc_ = args
            done = b.append_basic_block(f"{name}.done")
            phases = TWO_PHASES if two_phase is None else two_phase

            def phase_bufs():
                """The two-phase buffers, allocated where the pass runs (the caller frees them with
                llvm.stackrestore): as entry-block allocas their 12 KB in every frame of the fused
                layer kernels cost Gemma 3's FFN half 25 % more time, where no row takes them."""
                out = []
                for elty, n in ((I32, 2 * GRID_TOKENS), (F32, 2), (F32, 2)):
                    p = b.alloca(ir.ArrayType(elty, PHASE_STEPS * PHASE_ROWS * n))
                    p.align = 64
                    out.append(b.bitcast(p, elty.as_pointer()))
                return out

            def emit(qt, kind, decode, nbytes):
                by_n = b.switch(n_, done)
                for n, (n_rows, n_toks, n_real) in shapes.items():
                    bb = b.append_basic_block(f"{name}.n{n}")
                    by_n.add_case(ir.Constant(I64, n), bb)
                    b.position_at_end(bb)
                    # lanes past the n_real tokens repeat the last one and are not stored (groups
                    # are powers of two). A legacy group's fold ends in 2 lanes per (row, token):
                    # at most 8 fit one vector, so a wider group runs as passes over the tokens.
                    toks = [b.add(t0_, _c64(min(u, n_real - 1))) for u in range(n_toks)]
                    per_pass = n_toks if kind == "k" else max(1, min(n_toks, 8 // n_rows))
                    for u0 in range(0, n_toks, per_pass):
                        if u0 < n_real:
                            group_pass(qt, kind, decode, nbytes, n_rows, toks[u0:u0 + per_pass], n_real - u0)
                    b.branch(done)
                b.position_at_end(b.append_basic_block(f"{name}.unreachable"))

            def group_pass(qt, kind, decode, nbytes, n_rows, toks, n_store):
                n_toks = len(toks)
                rows = [b.add(r_, _c64(j)) for j in range(n_rows)]
                wrows, rbs = zip(*[_weight_row(context, b, signature.args[2], w_, x) for x in rows])
                tok = _Tokens(context, b, signature.args[4:7], (xq_, xd_, xs_))
                trows = [tok.rows(t) for t in toks]
                group = _k_group if kind == "k" else _pair_group
                n_steps = b.sdiv(rbs[0], _c64(nbytes))
                if kind != "k":
                    n_steps = b.sdiv(b.add(n_steps, _c64(1)), _c64(2))

                def step(vbs, i, state):
                    entries = [(vb, t) for vb in vbs for t in trows]      # lane j * n_toks + u
                    return [group(b, entries, i, state[0])]
                g = n_rows * n_toks
                zero = ir.Constant(ir.VectorType(F32, g), [0.0] * g)
                # after this pass the caller takes the next rows (row_dot: the next row)
                nxt = b.mul(rbs[0], _c64(n_rows))
                if kind == "pair" and 1 < n_rows <= PHASE_ROWS and n_toks <= phases.get(qt, 0):
                    short = b.icmp_signed("<", rbs[0], _c64(TWO_PHASE_BYTES))
                    with b.if_else(short) as (linear, side_by_side):
                        with linear:
                            sp = _intrinsic(b, "llvm.stacksave", I8.as_pointer(), [])
                            f_lin = _two_phase_pairs(b, decode, nbytes, wrows, rbs[0], trows, n_steps, zero,
                                                     phase_bufs())
                            _intrinsic(b, "llvm.stackrestore", ir.VoidType(), [sp])
                            bb_lin = b.basic_block
                        with side_by_side:
                            (f_sbs,) = _steps(b, kind, decode, nbytes, list(wrows), rbs[0], _c64(0), n_steps, [zero],
                                              step, nxt)
                            bb_sbs = b.basic_block
                    facc = b.phi(zero.type)
                    facc.add_incoming(f_lin, bb_lin)
                    facc.add_incoming(f_sbs, bb_sbs)
                else:
                    (facc,) = _steps(b, kind, decode, nbytes, list(wrows), rbs[0], _c64(0), n_steps, [zero], step, nxt)
                O = _array(context, b, signature.args[8], out_)
                width = cgutils.unpack_tuple(b, O.shape, 2)[1]
                for j in range(n_rows):
                    for u in range(min(n_toks, n_store)):
                        lane = ir.Constant(I32, j * n_toks + u)
                        b.store(b.extract_element(facc, lane),
                                b.gep(O.data, [b.add(b.mul(toks[u], width), b.add(oc_, _c64(j)))]))

            _by_type(b, qt_, done, emit, only)
            b.position_at_end(done)
            return context.get_dummy_value()
        return sig, codegen
    lane_dot.__name__ = name
    return intrinsic(lane_dot)


# row_dot(qtype, n, w, r, xq, xd, xs, t0, out, oc): out[t0 + u, oc] = (row r of W) . (activation row
# t0 + u) for u < n (1 to 4). w: (rows, row_bytes) uint8 of type qtype; xq int8, xd float32, xs
# int16 rows from quantize_act.quantize_rows with the block act_block(qtype); out float32 (k, >= oc
# + 1). Unchecked: the caller validated shapes.
row_dot = _make_grid_dot("row_dot", {4: (1, 4, 4), 3: (1, 4, 3), 2: (1, 2, 2), 1: (1, 1, 1)})
# rows_dot(qtype, n, w, r0, xq, xd, xs, t, out, oc0): out[t, oc0 + u] = (row r0 + u) . (activation
# row t): the k = 1 kernel, the lane folding shared by n rows, each step of each row decoded once.
rows_dot = _make_grid_dot("rows_dot", {4: (4, 1, 1), 2: (2, 1, 1), 1: (1, 1, 1)})
# grid_dot(qtype, n, w, r0, xq, xd, xs, t0, out, oc0): n tokens t0 .. t0 + n - 1 of rows r0 ..:
# 4 rows by 2 tokens (n = 2), 2 rows by 4 tokens (n = 3, 4; for 3 the fourth lane repeats the
# third token, unstored), out[t0 + u, oc0 + j]: verify-sized batches, 8 lanes a group.
grid_dot = _make_grid_dot("grid_dot", {4: (2, 4, 4), 3: (2, 4, 3), 2: (4, 2, 2)})


def _make_row_acc(n_rows: int):
    """row_acc for groups of n_rows rows: n_rows > 1 only on token lanes (it emits nothing for
    token quads; lane_rows says which layout takes it)."""

    def row_acc(typingctx, qtype, w, r, xa, xb, xc, u0, n, s0, s1, acc, ar):
        if not _c_2d(w, xa, xb, xc, acc):
            return None
        unit = 16 if xc.dtype == types.int32 else 4
        qt_type, only = _qtype_arg(qtype)
        sig = types.void(qt_type, w, types.intp, xa, xb, xc, types.intp, types.intp, types.intp, types.intp,
                         acc, types.intp)

        def codegen(context, builder, signature, args):
            return _row_acc_code(context, builder, signature, args, unit, only, n_rows)
        return sig, codegen
    row_acc.__name__ = "row_acc" if n_rows == 1 else f"rows{n_rows}_acc"
    return intrinsic(row_acc)


def _row_acc_code(context, b, signature, args, unit, only, n_rows):
    qt_, w_, r_, xa_, xb_, xc_, u0_, n_, s0_, s1_, acc_, ar_ = args
    done = b.append_basic_block("row_acc.done")
    bufs = []
    for _ in range(n_rows):
        row_bufs = [cgutils.alloca_once(b, ir.ArrayType(I8, 256)) for _ in range(2)] + \
            [cgutils.alloca_once(b, ir.ArrayType(I8, 32)) for _ in range(2)]
        bufs.append([b.bitcast(p, I8.as_pointer()) for p in row_bufs])

    def emit(qt, kind, decode, nbytes):
        if n_rows > 1 and unit != 16:
            return
        wrows, rbs = zip(*[_weight_row(context, b, signature.args[1], w_, b.add(r_, _c64(j)))
                           for j in range(n_rows)])
        rb = rbs[0]
        tok = _Tokens(context, b, signature.args[3:6], (xa_, xb_, xc_))
        A = _array(context, b, signature.args[10], acc_)
        acc_width = cgutils.unpack_tuple(b, A.shape, 2)[1]
        acc_rows = [b.gep(A.data, [b.mul(b.add(ar_, _c64(j)), acc_width)]) for j in range(n_rows)]
        acc_row = acc_rows[0]
        wrow = wrows[0]
        fv = ir.VectorType(F32, unit)

        def apply(vbs, i, state):
            decoded = [_decoded(x) for x in vbs]      # before the loop over units: once per step
            vb = decoded[0]
            quad = _QuadStep(*vb, bufs[0][0], K_SUB.get(qt)) if unit == 4 else None
            staged = None
            if unit == 16:
                staged = (_k_lanes_stage if kind == "k" else _pair_lanes_stage)(decoded, bufs)

            def units(first, count):
                """count (1 or 2) consecutive units from unit `first`."""
                us = [b.add(first, _c64(x)) for x in range(count)]
                ps = [[b.bitcast(b.gep(row, [b.mul(u, _c64(unit))]), fv.as_pointer()) for u in us]
                      for row in acc_rows]
                faccs = [[b.load(p, align=4) for p in pr] for pr in ps]
                if unit == 16 and kind == "k":
                    faccs = _k_lanes(decoded, i, [tok.rows(u) for u in us], faccs, bufs,
                                     K_SUB.get(qt), staged)
                elif unit == 16:
                    faccs = _pair_lanes(decoded, i, [tok.rows(u) for u in us], faccs, bufs, staged)
                else:
                    faccs = [[(_k_quad if kind == "k" else _pair_quad)(vb[0], quad, i, tok.rows(us[0]),
                                                                        faccs[0][0])]]
                for pr, fr in zip(ps, faccs):
                    for p, f in zip(pr, fr):
                        b.store(f, p, align=4)

            # token lanes: vectors in pairs (each broadcast weight dword serves two), then the odd one
            per = 2 if unit == 16 and n_rows == 1 else 1
            _loop(b, _c64(0), b.sdiv(n_, _c64(per)), [], lambda j, _: units(b.add(u0_, b.mul(j, _c64(per))), per) or [])
            if per == 2:
                odd = b.icmp_signed("!=", b.srem(n_, _c64(2)), _c64(0))
                with b.if_then(odd):
                    units(b.add(u0_, b.sub(n_, _c64(1))), 1)
            return []
        # the tile's next row (group) reads this chunk next
        step_bytes = nbytes if kind == "k" else 2 * nbytes
        nxt = b.add(b.mul(rb, _c64(n_rows)), b.mul(s0_, _c64(step_bytes)))
        s_rest = s0_
        if unit == 4 and kind == "pair":
            # legacy quads take two full block pairs a step: their folds and float terms share
            # vectors (16 lanes instead of 8); an odd pair and the odd last block after
            n_full = b.sdiv(b.sdiv(rb, _c64(nbytes)), _c64(2))
            e = b.select(b.icmp_signed("<", s1_, n_full), s1_, n_full)
            n_dbl = b.select(b.icmp_signed(">", e, s0_), b.sdiv(b.sub(e, s0_), _c64(2)), _c64(0))

            def double(j, _):
                i = b.add(s0_, b.mul(j, _c64(2)))
                _prefetch_ahead(b, [wrow], b.mul(i, _c64(step_bytes)), b.mul(s0_, _c64(step_bytes)),
                                b.mul(s1_, _c64(step_bytes)), nxt, 2 * step_bytes)
                vs = [IntBlockIR(b, b.gep(wrow, [b.mul(b.add(i, _c64(h)), _c64(step_bytes))]), None) for h in (0, 1)]
                st = _QuadStep(vs[0], [decode(x, 2) for x in vs], bufs[0][0], None)

                def one_unit(u, _):
                    p = b.bitcast(b.gep(acc_row, [b.mul(u, _c64(unit))]), fv.as_pointer())
                    b.store(_pair_quad(vs[0], st, i, tok.rows(u), b.load(p, align=4)), p, align=4)
                    return []
                _loop(b, u0_, b.add(u0_, n_), [], one_unit)
                return []
            _loop(b, _c64(0), n_dbl, [], double)
            s_rest = b.add(s0_, b.mul(n_dbl, _c64(2)))
        _steps(b, kind, decode, nbytes, list(wrows), rb, s_rest, s1_, [], apply, nxt)

    _by_type(b, qt_, done, emit, only)
    b.position_at_end(done)
    return context.get_dummy_value()


# row_acc(qtype, w, r, xa, xb, xc, u0, n, s0, s1, acc, ar): acc[ar, unit (u0 + j) + l] for l < unit,
# j < n, after steps s0 .. s1-1 of row r. xa, xb, xc from quantize_tiled: token quads (xc int16) ->
# unit 4; transposed token vectors (xc int32) -> unit 16, token lanes. Each step is decoded once into
# registers (token lanes: and a stack buffer) and applied to all n units before the next step is read.
row_acc = _make_row_acc(1)
# the same for rows r .. r + 3 into acc rows ar .. ar + 3, on token lanes only
rows4_acc = _make_row_acc(4)
LANE_ROWS = 4


ROW_TILE = 8          # rows sharing an L1-resident chunk of the activations (token quads)
ROW_TILE_LANES = 32   # the same for token lanes: the activations of 16+ tokens cost more to stream
TILE_UNITS = 4        # token quads (16 tokens) or token vectors (64) per pass over a chunk
# K-quants on token lanes take a whole prompt chunk (512 tokens) in one pass: a super-block's decode
# (Q6_K's bit assembly, Q4_K's scales and mins) is paid once per row for all its tokens, where passes
# of 4 vectors paid it 8 times. Their chunks are one super-block either way (ACT_L1_BYTES); the
# legacy types' pairs are cheap to decode and want their chunks L1-sized (32 units: ~1.4x slower).
# Side by side, 2 threads, the 27B FFN shapes, k = 512 (BENCHMARKS.md, session 23): Q4_K 1.46x,
# Q5_K and Q3_K 1.3-1.4x, Q6_K 1.04-1.07x faster; a Q4_K_M llama's pp512 1.20x end to end.
TILE_UNITS_K_LANES = 32
ACT_L1_BYTES = 24576  # activation bytes of a chunk (all the pass's tokens) kept in L1
# k from which matvec runs the tiled kernels (below: block_dots, state in registers). Measured on
# the 27B FFN shapes, 2 threads (bench_matvec.py --quick --ks 1,3,4,5,8 --tiled-from 999 against
# 3, BENCHMARKS.md "Register groups of rows by tokens"): block_dots takes 0.5-0.9x the quads' time
# at 3 and 4 tokens for all five types and 0.7-1.0x at 5 (one type 1.06x); at 8 the quads are
# faster for four of five (one pass over the weights where block_dots makes two).
TILED_MIN_K = 6


def tiled_min_k(qtype: int) -> int:
    """The k from which matvec runs the tiled kernels: a type in row lanes keeps them (block_dots)
    up to the token lanes' k, where the token quads would take over at TILED_MIN_K."""
    return LANES_MIN_K[SPECS[int(qtype)][0]] if int(qtype) in ROW_LANES_HOST else TILED_MIN_K
# k from which the tiled kernel runs on token lanes (transposed activations, padded to 16 tokens)
# instead of token quads. Measured on the 27B FFN shapes, 2 threads, from memory, with the lanes'
# rows 4 at a time (bench_matvec.py --lanes-from 1 against 999, BENCHMARKS.md session 24), lanes /
# quads: K-quants 1.09-1.63 at 8 tokens, 0.76-0.91 at 12, 0.48-0.87 at 16-32; legacy types
# (Q4_0, Q5_0, Q8_0) 0.93-1.10 at 8, 0.66-0.74 at 10, 0.64-0.74 at 12.
# hybridrt.warmup's batches (1, 4, 8, 16, 40 tokens) compile both layouts for either kind.
LANES_MIN_K = {"k": 12, "pair": 10}


def uses_lanes(qtype: int, k: int) -> bool:
    return k >= LANES_MIN_K[SPECS[int(qtype)][0]]


@intrinsic
def lane_rows(typingctx, xc):
    """LANE_ROWS on token lanes (xc int32: quantize_tiled's transposed sums), 1 on token quads."""
    n = LANE_ROWS if isinstance(xc, types.Array) and xc.dtype == types.int32 else 1
    return types.intp(xc), lambda context, builder, signature, args: _c64(n)


@njit(cache=CACHE, nogil=True, inline="always")
def tile_sums(qtype, w, r0, n_rows, xa, xb, xc, n_steps, chunk, units, acc):
    """acc[r, t] = row r0 + r (r < n_rows) . token t, for all tokens of the (padded) activations:
    column chunks of `chunk` steps, each swept by the tile's rows for `units` units of tokens.
    xa, xb, xc: quantize_tiled's token quads (4 tokens) or token vectors (16)."""
    n_units = xa.shape[0]           # token quads (4 tokens) or token vectors (16)
    acc[:n_rows] = 0.0
    for u0 in range(0, n_units, units):
        n = min(units, n_units - u0)
        for s0 in range(0, n_steps, chunk):
            s1 = min(n_steps, s0 + chunk)
            r = 0
            if lane_rows(xc) > 1:
                while r + LANE_ROWS <= n_rows:
                    rows4_acc(qtype, w, r0 + r, xa, xb, xc, u0, n, s0, s1, acc, r)
                    r += LANE_ROWS
            while r < n_rows:
                row_acc(qtype, w, r0 + r, xa, xb, xc, u0, n, s0, s1, acc, r)
                r += 1


GRID_TOKENS = 4      # most tokens a grid_dot pass takes (2 rows by 4 tokens: 8 lanes)

# Single-row groups. On AMD Zen (LLVM's host CPU "znver*"), with both cores streaming from memory,
# rows shorter than SINGLE_ROW_BYTES read faster one row at a time than in groups of 4 side by
# side: Zen 4, 2 threads, k = 1, GB/s of 33.8 (BENCHMARKS.md "A Zen 4 machine: single-row groups"):
# Q8_0 262144 x 640 (Gemma 3's output layer) 18.7 -> 31.0, Q6_K 17408 x 5120 18 -> 33, Q4_K 25 ->
# 34, while the 17408-input rows (9.8-18 KB) keep their speed in groups of 4 and the light legacy
# types (Q4_0 .. Q5_1, IQ4_NL), whose single rows are bound by their folds, run slower alone. At
# k = 2 single rows win for Q6_K only: Q8_0's short rows take two-phase groups (below), and its
# 3072-8192-byte rows read faster in groups of 4 rows x 2 tokens (cold, 2 threads, session 23:
# 17408 x 5120 3.85 vs 5.08 ms, 4096 x 7680 1.39 vs 1.94; 8192 x 3072 and 14336 x 4096 level),
# where Q6_K's lose by half (17408 x 5120 3.63 vs 2.33 ms in groups). The Xeon measured in
# sessions 6-8 (and where no measurement says otherwise) keeps the groups of 4. The bits are the
# same either way.
SINGLE_ROW_BYTES = 8192
SINGLE_ROW_CPUS = ("znver",)
SINGLE_ROW_MAX_K = {int(_T.Q4_K): 1, int(_T.Q5_K): 1, int(_T.Q6_K): 2, int(_T.Q8_0): 1}
# Q8_0's rows under TWO_PHASE_BYTES on the same CPUs: groups again, each row read on its own before
# the group's float steps (_two_phase_pairs), for k <= 2. Zen 4, 2 threads, from memory, best of 3
# `bench_matvec.py` runs against single rows (BENCHMARKS.md, session 15): 262144 x 640 (Gemma 3's
# output layer) k = 1 4.57 vs 5.13 ms, k = 2 5.81 vs 6.84; 131072 x 1536 and 98304 x 2048 k = 1
# within 2 %, k = 2 15 % faster; 3072 columns k = 2 faster but k = 1 slower (6.60 vs 5.67 ms), so
# those rows (3264 bytes) stay single. The lighter legacy types lose by it (their folds, not their
# bytes, bound them: Q4_0 640 columns k = 1 3.95 vs 3.70 ms in groups side by side).
TWO_PHASE_BYTES = 3072
TWO_PHASE_MAX_K = {int(_T.Q8_0): 2}


def single_row_table(cpu_name: str) -> dict[int, int]:
    """qtype -> the largest k (1 or 2) read a row at a time on this CPU; absent: groups of rows."""
    return dict(SINGLE_ROW_MAX_K) if cpu_name.startswith(SINGLE_ROW_CPUS) else {}


def two_phase_table(cpu_name: str) -> dict[int, int]:
    """qtype -> the largest k whose short rows are read in two-phase groups on this CPU."""
    return dict(TWO_PHASE_MAX_K) if cpu_name.startswith(SINGLE_ROW_CPUS) else {}


# this host's, fixed at import: they enter the compiled kernels (whose on-disk cache is per CPU)
SINGLE_ROWS = single_row_table(llvm.get_host_cpu_name())
TWO_PHASES = two_phase_table(llvm.get_host_cpu_name())


single_row_max_k = _max_k_lookup(SINGLE_ROWS, "single_row_max_k")      # SINGLE_ROWS[qtype]
two_phase_max_k = _max_k_lookup(TWO_PHASES, "two_phase_max_k")         # TWO_PHASES[qtype]


@njit(cache=CACHE, nogil=True, inline="always")
def single_rows(qtype, k, row_bytes):
    """Whether rows of row_bytes read one at a time for k tokens: where SINGLE_ROWS lists the type
    up to k, for rows shorter than SINGLE_ROW_BYTES, unless two-phase groups take them."""
    if row_bytes < TWO_PHASE_BYTES and two_phase_max_k(qtype) >= k:
        return False
    return single_row_max_k(qtype) >= k and row_bytes < SINGLE_ROW_BYTES


@njit(cache=CACHE, nogil=True)
def block_dots(qtype, w, r0, n_rows, xq, xd, xs, out, oc0, cold=True):
    """out[t, oc0 + j] for every token t and j < n_rows: rows r0 .. r0 + n_rows - 1. The types of
    ROW_LANES_HOST, from its k on: 16 rows at a time in row lanes (matvec_rowlanes), tokens in
    passes of up to PASS_TOKENS, and the rows past a multiple of 16 as the others: tokens in passes
    of up to GRID_TOKENS, each pass over the rows in grid_dot groups (a row left over: row_dot),
    a last single token by rows_dots. The same bits for any rows and tokens asked (a row or a token
    at a time included), with fewer fold and float steps per (row, token): for k = 2 about the time of
    k = 1 on small matrices (the float and fold steps, not the weights, bound those).
    cold: row r0's group of 16 was not prefetched by a call on the rows just before it (row lanes
    prefetch the next group as they go; a cold group is asked for whole before its first step)."""
    k = xq.shape[0]
    if k >= row_lanes_from(qtype):
        n16 = n_rows - n_rows % ROW_LANES
        for j in range(0, n16, ROW_LANES):
            t0 = 0
            while t0 < k:
                n = min(PASS_TOKENS, k - t0)
                row_lanes_dot(qtype, n, w, r0 + j, xq, xd, xs, t0, out, oc0 + j, cold and j == 0 and t0 == 0)
                t0 += n
        r0, n_rows, oc0 = r0 + n16, n_rows - n16, oc0 + n16
    t0 = 0
    while t0 < k:
        if k - t0 < 2:
            rows_dots(qtype, w, r0, n_rows, xq, xd, xs, t0, out, oc0)
            t0 += 1
            continue
        nt = min(k - t0, GRID_TOKENS)
        j = 0
        rstep = 4 if nt == 2 else 2
        if nt == 2 and single_rows(qtype, 2, w.shape[1]):
            rstep = n_rows + 1      # a row at a time (row_dot below)
        while n_rows - j >= rstep:
            grid_dot(qtype, nt, w, r0 + j, xq, xd, xs, t0, out, oc0 + j)
            j += rstep
        while j < n_rows:
            row_dot(qtype, nt, w, r0 + j, xq, xd, xs, t0, out, oc0 + j)
            j += 1
        t0 += nt


@njit(cache=CACHE, nogil=True, inline="always")
def rows_dots(qtype, w, r0, n_rows, xq, xd, xs, t, out, oc0):
    """out[t, oc0 + j] for j < n_rows: rows r0 .. r0 + n_rows - 1 for token t, in passes of 4, 2, 1
    rows (less float and fold work per row than a row at a time; the same bits), or a row at a
    time where SINGLE_ROWS says this CPU streams short rows faster so."""
    single = single_rows(qtype, 1, w.shape[1])
    j = 0
    while j < n_rows:
        n = 1 if single else (4 if n_rows - j >= 4 else (2 if n_rows - j >= 2 else 1))
        rows_dot(qtype, n, w, r0 + j, xq, xd, xs, t, out, oc0 + j)
        j += n


@njit(cache=CACHE, nogil=True, parallel=True)
def _matvec_int_kernel(w, qtype, xq, xd, xs, out, n_groups):
    rows = w.shape[0]
    for g in prange(n_groups):
        lo, hi = group_rows(g, n_groups, rows)
        block_dots(qtype, w, lo, hi - lo, xq, xd, xs, out, lo)


@njit(cache=CACHE, nogil=True, parallel=True)
def _matvec_tiled_kernel(w, qtype, xa, xb, xc, k_pad, out, n_steps, chunk, units, row_tile, n_groups):
    rows = w.shape[0]
    k = out.shape[0]
    n_tiles = (rows + row_tile - 1) // row_tile
    for g in prange(n_groups):
        acc = np.empty((row_tile, k_pad), np.float32)
        for tile in range(g * n_tiles // n_groups, (g + 1) * n_tiles // n_groups):
            r0 = tile * row_tile
            n_rows = min(row_tile, rows - r0)
            tile_sums(qtype, w, r0, n_rows, xa, xb, xc, n_steps, chunk, units, acc)
            for t in range(k):
                for r in range(n_rows):
                    out[t, r0 + r] = acc[r, t]


@njit(cache=True, nogil=True, inline="always")
def group_rows(g, n_groups, rows):
    """Rows lo .. hi - 1 of parallel work item g of n_groups: whole groups of ROW_LANES rows (the
    last item takes what is left), so row lanes cover every row of a multiple of 16."""
    n = rows // ROW_LANES
    lo = g * n // n_groups * ROW_LANES
    hi = rows if g == n_groups - 1 else (g + 1) * n // n_groups * ROW_LANES
    return lo, hi


def n_row_groups(rows: int) -> int:
    """Parallel work items: a few per thread so a slow core does not hold up the call."""
    return max(1, min(rows, GROUPS_PER_THREAD * numba.get_num_threads()))


def tiling(qtype: int, w_shape: tuple[int, int], k: int) -> tuple[int, int, int, int, int]:
    """(steps per row, steps per column chunk, token units per pass, rows per tile, parallel work
    items) of the tiled kernel for k tokens and a (rows, row_bytes) weight matrix."""
    rows, row_bytes = w_shape
    k_quant = SPECS[int(qtype)][0] == "k"
    step_cols = QK_K if k_quant else 2 * QK_LEGACY
    unit = 16 if uses_lanes(qtype, k) else 4
    units = TILE_UNITS_K_LANES if k_quant and unit == 16 else TILE_UNITS
    tokens = min(-(-k // unit) * unit, unit * units)
    # big tiles share each activation chunk among more rows, but leave 2 tiles per thread at least
    row_tile = max(ROW_TILE, min(ROW_TILE_LANES if unit == 16 else ROW_TILE, rows // (2 * numba.get_num_threads())))
    n_tiles = -(-rows // row_tile)
    return steps_per_row(qtype, row_bytes), chunk_steps(tokens, step_cols), units, row_tile, n_row_groups(n_tiles)


@njit(cache=CACHE, nogil=True)
def chunk_steps(tokens, step_cols):
    """Steps per column chunk of the tiled kernels: the chunk's activations, `tokens` tokens of
    `step_cols` bytes a step, stay within ACT_L1_BYTES (tiling's, and the fused layer kernels')."""
    return max(1, ACT_L1_BYTES // (tokens * step_cols))


def quantize_for(qtype: int, x: np.ndarray):
    """x's rows quantized as the integer kernel of `qtype` reads them: (q, d, s)."""
    return quantize_rows(x, act_block(qtype))


def quantize_tiled(qtype: int, x: np.ndarray):
    """The activations of the tiled kernel for x's k >= tiled_min_k(qtype) rows: (xa, xb, xc, k_pad).

    Token quads: quantize_for's rows with zero rows up to a multiple of 4 tokens, interleaved per
    4 tokens Q by 16 columns: xa[Q, 64 g + 16 t + i] = q[4 Q + t, 16 g + i] (one 64-byte vector
    holds 16 columns of the 4 tokens), xb[Q, 4 b + t] = d[4 Q + t, b], and xc the sums as xa by 16
    (K-quants: a super-block's 16 sums of each token side by side) or as xb (legacy). Token lanes:
    padded to 16 tokens and transposed per 16-token vector V: xa[V, 64 e4 + 4 l + i] = q[16 V + l,
    4 e4 + i] (4-byte groups of 16 tokens side by side), xb[V, 16 b + l] = d[16 V + l, b], and xc the
    16-value sums as i16 pairs (K-quants) or the 32-value sums as int32 (legacy), laid out as xb."""
    k = x.shape[0]
    unit = 16 if uses_lanes(qtype, k) else 4
    k_pad = -(-k // unit) * unit
    q, d, s = quantize_rows(x, act_block(qtype), pad_rows=k_pad - k)
    if unit == 4:
        nu = k_pad // 4

        def quads(a, group):
            return np.ascontiguousarray(a.reshape(nu, 4, -1, group).transpose(0, 2, 1, 3)).reshape(nu, -1)
        return quads(q, 16), quads(d, 1), quads(s, 16 if act_block(qtype) == QK_K else 1), k_pad
    xa, xb, xc = token_lanes(q, d, s, act_block(qtype) == QK_K)
    return xa, xb, xc, k_pad


@njit(cache=CACHE, nogil=True)
def _lanes_of(a, k):
    """out[V, 16 j + l] = a[16 V + l, j] for the first k rows of a (rows past them: 0)."""
    nv = (k + 15) // 16
    m = a.shape[1]
    out = np.zeros((nv, 16 * m), a.dtype)
    for v in range(nv):
        n = min(16, k - 16 * v)
        for j in range(m):          # written in order; 16 rows read a column at a time
            for lane in range(n):
                out[v, 16 * j + lane] = a[16 * v + lane, j]
    return out


@njit(cache=CACHE, nogil=True)
def token_lanes(q, d, s, k_quant):
    """Quantized activation rows (quantize_rows' q, d, s) as the token-lane tiled kernel reads them,
    padded with zero rows to 16 tokens: xa int8 (16 tokens' 4-byte groups side by side, each value
    as a + 128 in its byte: the kernels' unsigned side), xb
    float32 (the scales, 16 tokens a vector), xc int32 (the sums: K-quants' 16-value sums as i16
    pairs, legacy types' 32-value sums widened). quantize_tiled's layout, and the fused layer
    kernels' (layer_fused) for their legacy matrices' batches of 14+ rows."""
    k = q.shape[0]
    xa = _lanes_of(q.view(np.int32), k).view(np.int8)
    xa ^= np.int8(-128)     # as a + 128: the unsigned side of _k_lanes' and _pair_lanes' vpdpbusd
    if k_quant:
        xc = _lanes_of(s.view(np.int32), k)
    else:
        xc = _lanes_of(s.astype(np.int32), k)
    return xa, _lanes_of(d, k), xc


def matvec_int_into(w: np.ndarray, qtype: int, x: np.ndarray, out: np.ndarray, xq=None) -> np.ndarray:
    """out = W x on int8 activations. Operands already checked (matvec.check_operands); xq: x
    already quantized for this type by quantize_for (k < tiled_min_k(qtype)) or quantize_tiled."""
    k = x.shape[0]
    if k < tiled_min_k(qtype):
        q, d, s = quantize_for(qtype, x) if xq is None else xq
        _matvec_int_kernel(w, type_tag(qtype), q, d, s, out, n_row_groups(w.shape[0]))
        return out
    xa, xb, xc, k_pad = quantize_tiled(qtype, x) if xq is None else xq
    _matvec_tiled_kernel(w, type_tag(qtype), xa, xb, xc, k_pad, out, *tiling(qtype, w.shape, k))
    return out

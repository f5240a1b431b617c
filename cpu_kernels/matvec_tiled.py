"""The tiled integer kernels: batches of 6+ tokens (token quads) and prompt chunks (token lanes).

Why tiles: from about 6 tokens on, a weight step decoded once is worth keeping for many tokens,
and the activations of a column chunk are worth keeping in L1 for many rows. `matvec_int_into`
sends k >= tiled_min_k(qtype) here (matvec_int keeps the register groups and row lanes of decode
and verify steps): rows in tiles (ROW_TILE), columns in chunks whose activations stay in L1
(ACT_L1_BYTES), each tile's sums in an L1 buffer (tile_sums), two layouts of the activations:

    token quads   k >= TILED_MIN_K: each step decoded once per 16 tokens into a stack buffer, the
                  activations interleaved by 16 bytes per 4 tokens, each 16 weight bytes broadcast
                  to the 4 tokens: one vpdpbusd per 64 products, each token's integers in its own
                  4 lanes.
    token lanes   k >= LANES_MIN_K (the prompt GEMM): the activations transposed, 16 tokens'
                  4-byte groups in one vector (k padded to 16); each 4 weight bytes broadcast and
                  one vpdpbusd adds 4 products for 16 tokens, so every integer lands in its token's
                  lane. Rows go 4 at a time (the weights as vpdpbusd's signed side, the activations
                  stored as a + 128 its unsigned side, the offset taken off per row and block).

Both compute matvec_int's numerics (its "numerics" block) in the same order, so a token's result
is bit-identical to the register groups' whatever k is. layer_fused and ffn reuse tile_sums and the
activation layouts (quantize_tiled, token_lanes) for their own batches.
"""
from __future__ import annotations

import numba
import numpy as np
from gguf.constants import GGMLQuantizationType as GT
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .formats import int_kernel_of
from .int_blocks import (K_SUB, PairBlock, _bcast_dword, _by_type, _c64, _c_2d, _concat_all, _decoded,
                         _loop, _opaque, _prefetch_ahead, _qtype_arg, _steps, _Tokens, _weight_row, act_block,
                         n_row_groups, steps_per_row)
from .matvec_rowlanes import NEVER, PASS_TOKENS, ROW_LANES_HOST
from .matvec_simd import _array, _fma, _load_vec, _splat
from .quantize_act import QK_K, QK_LEGACY, quantize_rows
from .simd_int import CACHE, ISA, F32, I8, I16, I32, IntBlockIR, _intrinsic, dpbusd, dpwssd, packs, pmaddwd


# --------------------------------------------------------------------------- token lanes (prompts)
# For 16 and more tokens the activations are transposed (quantize_lanes): 16 tokens' 4-byte
# groups side by side in one 64-byte vector. A decoded weight step goes to a small stack buffer;
# each 4 weight bytes are broadcast to all lanes and one vpdpbusd adds 4 products for 16 tokens,
# so a token's integers land in its own lane: no folding, and every scaling step is one vector
# instruction for 16 tokens. This is the prompt-processing GEMM: per 16 tokens and 256 weights
# 64 vpdpbusd plus about 25 instructions of scales, vs about 16 instructions per token in
# matvec_int's register groups.
# Rows go 4 at a time (_k_lanes, _pair_lanes): one row alone loaded a 64-byte activation vector per
# vpdpbusd and L1 could not feed more than ~1 a cycle; 4 rows share it, and their weights, stored
# once per step (not once per token vector: LLVM spilled and reloaded the decoded step then), are
# read back through an opaque pointer as broadcasts that fold into the vpdpbusd. Q4_K at k = 512,
# one core, an L2-resident matrix: 78 -> 157 G multiply-adds/s (4478651).


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
# Side by side, 2 threads, the 27B FFN shapes, k = 512 (9682ccf): Q4_K 1.46x,
# Q5_K and Q3_K 1.3-1.4x, Q6_K 1.04-1.07x faster; a Q4_K_M llama's pp512 1.20x end to end.
TILE_UNITS_K_LANES = 32
ACT_L1_BYTES = 24576  # activation bytes of a chunk (all the pass's tokens) kept in L1
# k from which matvec runs the tiled kernels (below it: block_dots, state in registers). Measured on
# the 27B FFN shapes, 2 threads (bench_matvec.py --quick --ks 1,3,4,5,8 --tiled-from 999 against
# 3, docs/history.md, "Register groups of rows by tokens"): block_dots takes 0.5-0.9x the quads' time
# at 3 and 4 tokens for all five types and 0.7-1.0x at 5 (one type 1.06x); at 8 the quads are
# faster for four of five (one pass over the weights where block_dots makes two).
TILED_MIN_K = 6
# On the avx2 lowering, where the K-quants and IQ4 types never take the token lanes, a type in row
# lanes keeps them through one full pass and the token quads take 9 tokens on. Measured on an AMD
# EPYC Zen 3, 17408 x 5120, 2 threads, from memory (bench_matvec.py --tiled-from 999 against the
# quads), ms at 6 / 8 / 12 / 16 tokens, row lanes against quads: Q4_K 9.3 / 9.6 / 15.5 / 18.9 against
# 10.9 / 11.0 / 15.4 / 20.8, Q6_K 8.5 / 8.6 / 13.7 / 16.1 against 9.7 / 9.9 / 13.9 / 18.1, Q5_K
# 11.3 / 11.4 / 16.5 / 20.8 against 12.2 / 12.6 / 17.5 / 22.5, Q3_K 12.6 / 11.7 / 20.3 / 24.9
# against 13.5 / 13.2 / 17.7 / 22.4; Q2_K, IQ4_NL and IQ4_XS as Q5_K.
YMM_ROW_LANES_MAX_K = PASS_TOKENS


def tiled_min_k(qtype: int) -> int:
    """The k from which matvec runs the tiled kernels: a type in row lanes keeps them (block_dots)
    up to the token lanes' k, where the token quads would take over at TILED_MIN_K; on a lowering
    where it takes no token lanes, up to YMM_ROW_LANES_MAX_K."""
    if int(qtype) not in ROW_LANES_HOST:
        return TILED_MIN_K
    lanes = lanes_min_k(qtype)
    return lanes if lanes < NEVER else YMM_ROW_LANES_MAX_K + 1
# k from which the tiled kernel runs on token lanes (transposed activations, padded to 16 tokens)
# instead of token quads. Measured on the 27B FFN shapes, 2 threads, from memory, with the lanes'
# rows 4 at a time (bench_matvec.py --lanes-from 1 against 999, 69a6fa9, 3317039), lanes /
# quads: K-quants 1.09-1.63 at 8 tokens, 0.76-0.91 at 12, 0.48-0.87 at 16-32; legacy types
# (Q4_0, Q5_0, Q8_0) 0.93-1.10 at 8, 0.66-0.74 at 10, 0.64-0.74 at 12.
# hybridrt.runtime.warmup's batches (1, 4, 8, 16, 40 tokens) compile both layouts for either kind.
LANES_MIN_K = {"k": 12, "pair": 10}


# On ymm ISAs (AVX2, no AVX-512 VNNI: a 16-lane vector is two halves there) the token lanes lose to
# the token quads at every k for these types; they stay on quads. Measured on the 27B FFN shape
# 17408 x 5120, 2 threads, AMD EPYC with AVX2 only (bench_matvec.py --lanes-from 999 against 1,
# ms at 16 / 32 tokens, quads against lanes): Q4_K 21.3 / 40.1 against 29.7 / 53.9, Q6_K 18.0 / 34.2
# against 21.4 / 40.1, Q8_0 37.8 / 74.7 against 52.3 / 106.4, IQ4_NL 40.5 / 79.6 against 50.8 / 107.6;
# Q5_K 25.3 / 50.9 against 51.3 / 93.3, Q3_K 23.5 / 46.9 against 27.7 / 47.4, Q2_K 23.5 / 51.6 against
# 51.7 / 98.2, IQ4_XS 40.8 / 80.9 against 56.5 / 88.9. Q4_0, Q4_1, Q5_0 and Q5_1 keep the lanes there
# (lanes faster: Q4_1 18.5 / 32.5 against 29.3 / 57.0, Q5_1 23.1 / 40.0 against 59.9 / 119.7).
QUADS_ON_YMM = frozenset({GT.Q8_0, GT.IQ4_NL, GT.Q2_K, GT.Q3_K, GT.Q4_K, GT.Q5_K, GT.Q6_K, GT.IQ4_XS})


def lanes_min_k(qtype: int, isa: str = ISA) -> int:
    """The k from which `qtype`'s tiled kernel runs on token lanes under the integer lowering `isa`."""
    if isa != "avx512vnni" and int(qtype) in QUADS_ON_YMM:
        return NEVER
    return LANES_MIN_K[int_kernel_of(qtype).family]


def uses_lanes(qtype: int, k: int) -> bool:
    return k >= lanes_min_k(qtype)


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


def tiling(qtype: int, w_shape: tuple[int, int], k: int) -> tuple[int, int, int, int, int]:
    """(steps per row, steps per column chunk, token units per pass, rows per tile, parallel work
    items) of the tiled kernel for k tokens and a (rows, row_bytes) weight matrix."""
    rows, row_bytes = w_shape
    k_quant = int_kernel_of(qtype).family == "k"
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

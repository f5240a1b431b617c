"""The k-input quantized matvec on int8 activations: integer dot products, as llama.cpp does.

Why: with float activations every weight must become a float32 before its fma (matvec.py), about
half an instruction per weight, so the float kernel is decode-bound at 15-25 % of read bandwidth.
Here the activations are quantized once per call (quantize_act: int8 blocks with a float scale)
and a weight block only has to become bytes: nibbles masked and shifted into 64-byte vectors in
element order, then multiplied with the activation bytes 64 at a time (simd_int: vpmaddubsw +
vpdpwssd, or vpdpbusd), the sub-block scales applied inside the integer sum.

Per 256-weight super-block (K-quants; q: weight integers, a: activation int8, bs: 16-value sums of
a, scales sc and mins m per sub-block, dx the activation block scale):

    isum = sum_c dpwssd(maddubs(q_c, a_c), sc_c)  [+ pmaddwd(-offset * sc, bs)  Q3_K, Q6_K]
    facc += float(isum) * (d * dx)                 16 float lanes per (token, row)
    macc += float(pmaddwd(m, bs)) * (-dmin * dx)   8 lanes, Q2_K Q4_K Q5_K only

Per pair of 32-weight blocks (legacy types, weights as unsigned bytes: q, or q + 128 for Q8_0):

    isum = dpbusd(q, a) [+ offset * bs32 into lanes 0 and 8]   lanes 0-7 block A, 8-15 block B
    facc += float(isum) * (d_w * dx)  [+ m_w * (dx * bs32), Q4_1 Q5_1]

A row's result is reduce(facc) + reduce(macc) in a fixed order. Weight-stationary: a block is
decoded once into registers and applied to up to 4 tokens before the next block is read; k > 4
takes the row again from L1 for the next tokens. Bit identity across k: a (token, row) result is
the same integer sums and the same float operations wherever the token sits in the batch (the
token loop is unrolled; no lane or order depends on the others), tested for every type.

Accuracy: the integer parts are exact, so the result is the float64 product of the dequantized
weights with the *dequantized int8 activations* up to float32 rounding of the scaling steps; vs
float activations it carries the activation quantization error (|x - q dx| <= dx / 2 per value),
as llama.cpp's CPU backend does. matvec(..., exact=True) keeps the float kernel.
"""
from __future__ import annotations

import numpy as np
import numba
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from gguf.constants import GGMLQuantizationType as _T

from .matvec_kquants import k_scales_mins, q3_k_scales
from .matvec_simd import _array, _fma, _load_vec
from .quantize_act import QK_K, QK_LEGACY, quantize_rows
from .simd_int import CACHE, F32, I8, I16, I32, I64, IntBlockIR, _concat, dpbusd, dpwssd, maddubs, pmaddwd

GROUPS_PER_THREAD = 4




def _f32x2(b, x, y):
    v = b.insert_element(ir.Constant(ir.VectorType(F32, 2), ir.Undefined), x, ir.Constant(I32, 0))
    return b.insert_element(v, y, ir.Constant(I32, 1))




# --------------------------------------------------------------------------- K-quant decoders
# Each returns the super-block's weights in element order: 4 chunks of 64 unsigned bytes, the
# per-pair-lane scale vectors (i16 x 32) of each chunk, and the integer bsum coefficients.

class KBlock:
    def __init__(self, chunks, sc16, d, off16=None, min16=None, negdmin=None):
        self.chunks, self.sc16, self.d, self.off16, self.min16, self.negdmin = chunks, sc16, d, off16, min16, negdmin


def _sc16_per_32(v, sc8):
    """Chunk c's pair lanes take sub-block 2c (lanes 0-15) and 2c+1 (16-31): 32-weight sub-blocks."""
    return [v.shuf(sc8, [2 * c + i // 16 for i in range(32)]) for c in range(4)]


def _sc16_per_16(v, sc16):
    """Chunk c's pair lanes take sub-blocks 4c .. 4c+3, 8 lanes each: 16-weight sub-blocks."""
    return [v.shuf(sc16, [4 * c + i // 8 for i in range(32)]) for c in range(4)]


def _q4_k(v):
    # d @0, dmin @2, scales @4, qs[128] @16: byte 32c + l holds element 64c + l (low) and 64c+32+l
    sc, m = k_scales_mins(v, 4)
    chunks = []
    for c in range(4):
        q = v.bytes(16 + 32 * c, 32)
        chunks.append(v.concat(v.band(q, 15), v.bshr(q, 4)))
    m8 = v.i16(m)
    return KBlock(chunks, _sc16_per_32(v, v.i16(sc)), v.f16(0), min16=v.shuf(m8, [g // 2 for g in range(16)]),
                  negdmin=v.fneg(v.f16(2)))


def _q5_k(v):
    # as Q4_K with qh[32] @16 (bit j of qh[l]: 5th bit of element l of sub-block j), qs @48
    sc, m = k_scales_mins(v, 4)
    qh = v.bytes(16, 32)
    chunks = []
    for c in range(4):
        q = v.bytes(48 + 32 * c, 32)
        lo = v.b.or_(v.band(q, 15), v.bshl(v.band(v.bshr(qh, 2 * c), 1), 4))
        hi = v.b.or_(v.bshr(q, 4), v.bshl(v.band(v.bshr(qh, 2 * c + 1), 1), 4))
        chunks.append(v.concat(lo, hi))
    m8 = v.i16(m)
    return KBlock(chunks, _sc16_per_32(v, v.i16(sc)), v.f16(0), min16=v.shuf(m8, [g // 2 for g in range(16)]),
                  negdmin=v.fneg(v.f16(2)))


def _q6_k(v):
    # ql[128] @0, qh[64] @128, int8 scales[16] @192, d @208. Element 128h + 32t + l: nibble t>>1
    # of ql[64h + 32(t&1) + l], bits 2t of qh[32h + l]; q - 32 with scale (128h + 32t + l) // 16.
    sc = v.b.trunc(v.s8(192, 16), ir.VectorType(I16, 16))
    chunks = []
    for h in range(2):
        qh = v.bytes(128 + 32 * h, 32)
        ql = [v.bytes(64 * h, 32), v.bytes(64 * h + 32, 32)]
        quarters = []
        for t in range(4):
            low = v.band(v.bshr(ql[t & 1], 4 * (t >> 1)), 15)
            quarters.append(v.b.or_(low, v.bshl(v.band(v.bshr(qh, 2 * t), 3), 4)))
        chunks += [v.concat(quarters[0], quarters[1]), v.concat(quarters[2], quarters[3])]
    return KBlock(chunks, _sc16_per_16(v, sc), v.f16(208), off16=v.bmul(sc, -32))


def _q3_k(v):
    # hmask[32] @0, qs[64] @32, scales[12] @96, d @108. Element 128h + 32s + l: bits 2s of
    # qs[32h + l], plus 4 when bit 4h + s of hmask[l] is set; value q - 4, scale (element // 16).
    sc = v.i16(q3_k_scales(v))
    hm = v.bytes(0, 32)
    chunks = []
    for h in range(2):
        qs = v.bytes(32 + 32 * h, 32)
        quarters = [v.b.or_(v.band(v.bshr(qs, 2 * s), 3), v.bshl(v.band(v.bshr(hm, 4 * h + s), 1), 2))
                    for s in range(4)]
        chunks += [v.concat(quarters[0], quarters[1]), v.concat(quarters[2], quarters[3])]
    return KBlock(chunks, _sc16_per_16(v, sc), v.f16(108), off16=v.bmul(sc, -4))


def _q2_k(v):
    # scales[16] @0 (low nibble scale, high nibble min, per 16 weights), qs[64] @16, d @80,
    # dmin @82. Element 128h + 32s + l: bits 2s of qs[32h + l].
    sm = v.u8(0, 16)
    chunks = []
    for h in range(2):
        qs = v.bytes(16 + 32 * h, 32)
        quarters = [v.band(v.bshr(qs, 2 * s), 3) for s in range(4)]
        chunks += [v.concat(quarters[0], quarters[1]), v.concat(quarters[2], quarters[3])]
    return KBlock(chunks, _sc16_per_16(v, v.i16(v.and_(sm, 15))), v.f16(80), min16=v.i16(v.shr(sm, 4)),
                  negdmin=v.fneg(v.f16(82)))


# --------------------------------------------------------------------------- legacy decoders
# Each takes n_blk = 2 (a pair of blocks) or 1 (the odd last block: the second half is zeros)
# and returns 64 unsigned weight bytes, the block scales per lane, the integer offset and the
# per-block mins (lanes 0 and 8).

class PairBlock:
    def __init__(self, w, d2, off=0, m2=None, wide=False):
        self.w, self.d2, self.off, self.m2, self.wide = w, d2, off, m2, wide


def _pair(v, n_blk, block_bytes, one_block, off=0, with_min=False, wide=False):
    """Assemble a PairBlock from one_block(v, byte_off) -> (32 weight bytes, d, m)."""
    b = v.b
    parts = [one_block(v, j * block_bytes) for j in range(n_blk)]
    zero = ir.Constant(F32, 0.0)
    if n_blk == 1:
        parts.append((v.zeros(I8, 32), zero, zero))
    w = v.concat(parts[0][0], parts[1][0])
    d2 = _f32x2(b, parts[0][1], parts[1][1])
    m2 = _f32x2(b, parts[0][2], parts[1][2]) if with_min else None
    return PairBlock(w, d2, off, m2, wide)


def _nibbles32(v, off):
    q = v.bytes(off, 16)
    return v.concat(v.band(q, 15), v.bshr(q, 4))


def _fifth_bits(v, off):
    """Bit j of the u32 at off as the 5th bit (16) of byte lane j, j < 32."""
    bits = v.bits_of(v.u32(off), 0, 32)
    return v.bshl(v.b.trunc(bits, ir.VectorType(I8, 32)), 4)


def _q4_0(v, n_blk):
    return _pair(v, n_blk, 18, lambda v, o: (_nibbles32(v, o + 2), v.f16(o), None), off=-8)


def _q4_1(v, n_blk):
    return _pair(v, n_blk, 20, lambda v, o: (_nibbles32(v, o + 4), v.f16(o), v.f16(o + 2)), with_min=True)


def _q5_0(v, n_blk):
    return _pair(v, n_blk, 22, lambda v, o: (v.b.or_(_nibbles32(v, o + 6), _fifth_bits(v, o + 2)), v.f16(o), None),
                 off=-16)


def _q5_1(v, n_blk):
    return _pair(v, n_blk, 24, lambda v, o: (v.b.or_(_nibbles32(v, o + 8), _fifth_bits(v, o + 4)), v.f16(o), v.f16(o + 2)),
                 with_min=True)


def _q8_0(v, n_blk):
    # int8 weights as offset bytes w + 128 (vpdpbusd's unsigned side), the 128 taken off with bs32
    return _pair(v, n_blk, 34, lambda v, o: (v.bxor(v.bytes(o + 2, 32), 0x80), v.f16(o), None), off=-128, wide=True)


# --------------------------------------------------------------------------- the row kernel

# qtype -> (kind, decoder, weight bytes per step): a K step is one super-block, a legacy step a pair.
SPECS = {
    int(_T.Q4_K): ("k", _q4_k, 144), int(_T.Q5_K): ("k", _q5_k, 176), int(_T.Q6_K): ("k", _q6_k, 210),
    int(_T.Q3_K): ("k", _q3_k, 110), int(_T.Q2_K): ("k", _q2_k, 84),
    int(_T.Q4_0): ("pair", _q4_0, 18), int(_T.Q4_1): ("pair", _q4_1, 20), int(_T.Q5_0): ("pair", _q5_0, 22),
    int(_T.Q5_1): ("pair", _q5_1, 24), int(_T.Q8_0): ("pair", _q8_0, 34),
}
INT_TYPES = frozenset(SPECS)


def act_block(qtype: int) -> int:
    """The activation block (256 or 32) the integer kernel of `qtype` reads."""
    return QK_K if SPECS[int(qtype)][0] == "k" else QK_LEGACY




def steps_per_row(qtype: int, row_bytes: int) -> int:
    """Steps of a weight row: super-blocks (K-quants) or pairs of blocks, the odd last one a step."""
    kind, _, nbytes = SPECS[int(qtype)]
    n = row_bytes // nbytes
    return n if kind == "k" else (n + 1) // 2


def _c64(x):
    return ir.Constant(I64, x)


# --------------------------------------------------------------------------- token groups
# A group is g (1, 2 or 4) tokens whose float accumulators share one vector of 4g lanes, lanes
# 4u .. 4u+3 for token u. After a step's integer dot products, each token's i32 lanes are folded
# (exactly) to 4 partial sums, the group's partials packed into one vector and scaled by one
# sitofp + fma: a token's float work per step is a quarter of a 16-lane accumulator's, and an
# 8- or 16-token pass keeps its float state in 2-4 registers (a pass with 16-lane accumulators
# per token spilled beyond 4 tokens). Which i32 lanes make a partial, and every float operation
# on it, are the same for g = 1, 2, 4 and in both accumulator modes below: bit identity across k.

K_FOLD = ((16, range(8), range(8, 16)), (8, range(4), range(4, 8)))       # partial l: lanes l, l+4, l+8, l+12
# legacy: lanes 0-7 block A, 8-15 block B -> per token [A, A, B, B] partials
PAIR_FOLD = ((16, [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]), (8, [0, 1, 4, 5], [2, 3, 6, 7]))


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


def _spread(b, vec, idx):
    return b.shuffle_vector(vec, ir.Constant(vec.type, ir.Undefined), ir.Constant(ir.VectorType(I32, len(idx)), idx))


def _k_group(v, blk, i, toks, facc):
    """facc (4g lanes) + the group's share of super-block i; toks: per token its (q, d, s) rows."""
    b = v.b
    g = len(toks)
    accs, bss, dxs = [], [], []
    for q, d, s in toks:
        a_ptr = b.gep(q, [b.mul(i, _c64(QK_K))])
        # alone, a token runs two integer chains (chunks 0, 1 and 2, 3): half the dpwssd latency
        chains = [v.zeros(I32, 16)] * (2 if g == 1 else 1)
        for c in range(4):
            a = _load_vec(b, b.gep(a_ptr, [_c64(64 * c)]), I8, 64, 1)
            n = c * len(chains) // 4
            chains[n] = dpwssd(b, chains[n], maddubs(b, blk.chunks[c], a), blk.sc16[c])
        acc = chains[0] if len(chains) == 1 else b.add(chains[0], chains[1])
        bs = _load_vec(b, b.gep(s, [b.mul(i, _c64(16))]), I16, 16, 2)
        if blk.off16 is not None:
            acc = b.add(acc, v.concat(pmaddwd(b, blk.off16, bs), v.zeros(I32, 8)))
        accs.append(acc)
        bss.append(bs)
        dxs.append(b.load(b.gep(d, [i])))
    n = 4 * g
    fv = ir.VectorType(F32, n)
    dx = _spread(b, _concat_all(b, [_f32x1(b, x) for x in dxs]), [u for u in range(g) for _ in range(4)])
    part = _fold_all(b, accs, K_FOLD)
    facc = _fma(b, b.sitofp(part, fv), b.fmul(v.fsplat(blk.d, n), dx), facc)
    if blk.min16 is not None:
        ms = []
        for j in range(0, g, 2):
            if j + 1 < g:
                ms.append(pmaddwd(b, v.concat(blk.min16, blk.min16), v.concat(bss[j], bss[j + 1])))
            else:
                ms.append(pmaddwd(b, blk.min16, bss[j]))
        mins = _fold_all(b, ms, K_FOLD[1:])
        facc = _fma(b, b.sitofp(mins, fv), b.fmul(v.fsplat(blk.negdmin, n), dx), facc)
    return facc


def _f32x1(b, x):
    return b.insert_element(ir.Constant(ir.VectorType(F32, 1), ir.Undefined), x, ir.Constant(I32, 0))


def _pair_group(v, blk, i, toks, facc):
    """facc (4g lanes) + the group's share of block pair i (lanes per token: A, A, B, B)."""
    b = v.b
    g = len(toks)
    accs, bs2, dx2 = [], [], []
    for q, d, s in toks:
        a = _load_vec(b, b.gep(q, [b.mul(i, _c64(64))]), I8, 64, 1)
        accs.append(dpbusd(b, v.zeros(I32, 16), blk.w, a, blk.wide))
        bs2.append(b.sext(_load_vec(b, b.gep(s, [b.mul(i, _c64(2))]), I16, 2, 2), ir.VectorType(I32, 2)))
        dx2.append(_load_vec(b, b.gep(d, [b.mul(i, _c64(2))]), F32, 2, 4))
    n = 4 * g
    fv = ir.VectorType(F32, n)
    aabb = [2 * u + h for u in range(g) for h in (0, 0, 1, 1)]
    part = _fold_all(b, accs, PAIR_FOLD)
    # the block sums in lanes A and B of each token, 0 in the others (Z: a lane of the zero vector)
    bs = _concat_all(b, bs2)
    z = 2 * g
    bsv = b.shuffle_vector(bs, v.zeros(I32, 2 * g), ir.Constant(ir.VectorType(I32, n),
                                                                [x for u in range(g) for x in (2 * u, z, 2 * u + 1, z)]))
    if blk.off:
        part = b.add(part, b.mul(bsv, ir.Constant(bsv.type, [blk.off] * n)))
    dx = _spread(b, _concat_all(b, dx2), aabb)
    tile = [h for _ in range(g) for h in (0, 0, 1, 1)]
    facc = _fma(b, b.sitofp(part, fv), b.fmul(_spread(b, blk.d2, tile), dx), facc)
    if blk.m2 is not None:
        facc = _fma(b, b.sitofp(bsv, fv), b.fmul(_spread(b, blk.m2, tile), dx), facc)
    return facc


# --------------------------------------------------------------------------- the row kernels

class _Tokens:
    """Data pointers and row widths of xq, xd, xs: the (q, d, s) rows of any token."""

    def __init__(self, context, b, tys, vals):
        self.b = b
        self.arrs = []
        for aty, val in zip(tys, vals):
            A = _array(context, b, aty, val)
            self.arrs.append((A.data, cgutils.unpack_tuple(b, A.shape, 2)[1]))

    def rows(self, tok):
        return tuple(self.b.gep(data, [self.b.mul(tok, width)]) for data, width in self.arrs)


def _weight_row(context, b, aty, w, r):
    W = _array(context, b, aty, w)
    rb = cgutils.unpack_tuple(b, W.shape, 2)[1]
    return b.gep(W.data, [b.mul(r, rb)]), rb


def _loop(b, start, end, init, body):
    """for i in range(start, end): state = body(i, state); returns the final state (a list)."""
    entry = b.basic_block
    head = b.append_basic_block("int.head")
    loop = b.append_basic_block("int.body")
    done = b.append_basic_block("int.done")
    b.branch(head)
    b.position_at_end(head)
    i = b.phi(I64)
    i.add_incoming(start, entry)
    state = []
    for x in init:
        p = b.phi(x.type)
        p.add_incoming(x, entry)
        state.append(p)
    b.cbranch(b.icmp_signed("<", i, end), loop, done)
    b.position_at_end(loop)
    new = body(i, state)
    end_bb = b.basic_block
    i.add_incoming(b.add(i, _c64(1)), end_bb)
    for p, x in zip(state, new):
        p.add_incoming(x, end_bb)
    b.branch(head)
    b.position_at_end(done)
    return state


def _steps(b, kind, decode, nbytes, wrow, rb, i0, i1, init, apply):
    """Steps i0 .. i1-1 of a weight row: state = apply(v, blk, i, state) after decoding step i.
    A legacy row of an odd number of blocks ends in a step of one block (the other half zeros)."""
    def step(i, state, n_blk):
        if kind == "k":
            v = IntBlockIR(b, b.gep(wrow, [b.mul(i, _c64(nbytes))]), None)
            return apply(v, decode(v), i, state)
        v = IntBlockIR(b, b.gep(wrow, [b.mul(i, _c64(2 * nbytes))]), None)
        return apply(v, decode(v, n_blk), i, state)

    if kind == "k":
        return _loop(b, i0, i1, init, lambda i, s: step(i, s, None))
    n_blocks = b.sdiv(rb, _c64(nbytes))
    n_full = b.sdiv(n_blocks, _c64(2))
    end = b.select(b.icmp_signed("<", i1, n_full), i1, n_full)
    state = _loop(b, i0, end, init, lambda i, s: step(i, s, 2))
    has_tail = b.icmp_signed(">", i1, n_full)
    before = b.basic_block
    tail = b.append_basic_block("int.tail")
    join = b.append_basic_block("int.join")
    b.cbranch(has_tail, tail, join)
    b.position_at_end(tail)
    tailed = step(n_full, state, 1)
    tail_end = b.basic_block
    b.branch(join)
    b.position_at_end(join)
    merged = []
    for x, y in zip(state, tailed):          # all phis first: LLVM wants them at the top of the block
        p = b.phi(x.type)
        p.add_incoming(x, before)
        p.add_incoming(y, tail_end)
        merged.append(p)
    return merged


def _token_sum(b, facc, u):
    """Token u's result from its 4 lanes: (l0 + l2) + (l1 + l3), as token_sum below."""
    lane = [b.extract_element(facc, ir.Constant(I32, 4 * u + j)) for j in range(4)]
    return b.fadd(b.fadd(lane[0], lane[2]), b.fadd(lane[1], lane[3]))


def _by_type(b, qtype, done, emit):
    """switch over SPECS on qtype; emit(kind, decode, nbytes) writes each case's code."""
    by_type = b.switch(qtype, done)
    for qt, spec in SPECS.items():
        bb = b.append_basic_block(f"int.t{qt}")
        by_type.add_case(ir.Constant(I64, qt), bb)
        b.position_at_end(bb)
        emit(*spec)
        b.branch(done)


@intrinsic
def row_dot(typingctx, qtype, n_tok, w, r, xq, xd, xs, t0, out, oc):
    """out[t0 + t, oc] = (row r of W) . (activation row t0 + t), for t < n_tok (1, 2 or 4).

    Float state in registers for the whole row. w: (rows, row_bytes) uint8 of type qtype; xq int8,
    xd float32, xs int16 rows from quantize_act.quantize_rows with the block act_block(qtype); out
    float32 (k, >= oc + 1). Unchecked: the caller validated shapes.
    """
    for a in (w, xq, xd, xs, out):
        if not isinstance(a, types.Array) or a.layout != "C" or a.ndim != 2:
            return None
    sig = types.void(types.int64, types.intp, w, types.intp, xq, xd, xs, types.intp, out, types.intp)

    def codegen(context, builder, signature, args):
        b = builder
        qt, ntok, w_, r_, xq_, xd_, xs_, t0_, out_, oc_ = args
        done = b.append_basic_block("row_dot.done")

        def emit(kind, decode, nbytes):
            by_tok = b.switch(ntok, done)
            for n in (4, 2, 1):
                bb = b.append_basic_block(f"row_dot.n{n}")
                by_tok.add_case(ir.Constant(I64, n), bb)
                b.position_at_end(bb)
                wrow, rb = _weight_row(context, b, signature.args[2], w_, r_)
                tok = _Tokens(context, b, signature.args[4:7], (xq_, xd_, xs_))
                toks = [tok.rows(b.add(t0_, _c64(u))) for u in range(n)]
                group = _k_group if kind == "k" else _pair_group
                n_steps = b.sdiv(rb, _c64(nbytes))
                if kind != "k":
                    n_steps = b.sdiv(b.add(n_steps, _c64(1)), _c64(2))
                zero = ir.Constant(ir.VectorType(F32, 4 * n), [0.0] * (4 * n))
                (facc,) = _steps(b, kind, decode, nbytes, wrow, rb, _c64(0), n_steps, [zero],
                                 lambda v, blk, i, s: [group(v, blk, i, toks, s[0])])
                O = _array(context, b, signature.args[8], out_)
                width = cgutils.unpack_tuple(b, O.shape, 2)[1]
                for u in range(n):
                    row = b.gep(O.data, [b.mul(b.add(t0_, _c64(u)), width)])
                    b.store(_token_sum(b, facc, u), b.gep(row, [oc_]))
                b.branch(done)
            b.position_at_end(b.append_basic_block("row_dot.unreachable"))

        _by_type(b, qt, done, emit)
        b.position_at_end(done)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def row_groups(typingctx, qtype, w, r, xq, xd, xs, tg0, ng, s0, s1, acc, a0):
    """acc[a0 + j, :] += steps s0 .. s1-1 of row r for token group tg0 + j (tokens 4(tg0 + j) + u,
    u < 4), j < ng. Float state in acc (float32 (rows, 16)): each step is decoded once into
    registers and applied to all ng groups. xq's rows must cover 4 (tg0 + ng) tokens."""
    for a in (w, xq, xd, xs, acc):
        if not isinstance(a, types.Array) or a.layout != "C" or a.ndim != 2:
            return None
    sig = types.void(types.int64, w, types.intp, xq, xd, xs, types.intp, types.intp, types.intp, types.intp,
                     acc, types.intp)

    def codegen(context, builder, signature, args):
        b = builder
        qt, w_, r_, xq_, xd_, xs_, tg0_, ng_, s0_, s1_, acc_, a0_ = args
        done = b.append_basic_block("row_groups.done")

        def emit(kind, decode, nbytes):
            wrow, rb = _weight_row(context, b, signature.args[1], w_, r_)
            tok = _Tokens(context, b, signature.args[3:6], (xq_, xd_, xs_))
            A = _array(context, b, signature.args[10], acc_)
            group = _k_group if kind == "k" else _pair_group
            fv = ir.VectorType(F32, 16)

            def apply(v, blk, i, state):
                def one_group(j, _):
                    first = b.mul(b.add(tg0_, j), _c64(4))
                    toks = [tok.rows(b.add(first, _c64(u))) for u in range(4)]
                    p = b.bitcast(b.gep(A.data, [b.mul(b.add(a0_, j), _c64(16))]), fv.as_pointer())
                    b.store(group(v, blk, i, toks, b.load(p, align=4)), p, align=4)
                    return []
                _loop(b, _c64(0), ng_, [], one_group)
                return []
            _steps(b, kind, decode, nbytes, wrow, rb, s0_, s1_, [], apply)

        _by_type(b, qt, done, emit)
        b.position_at_end(done)
        return context.get_dummy_value()
    return sig, codegen


@njit(cache=CACHE, nogil=True, inline="always")
def row_dots(qtype, w, r, xq, xd, xs, out, oc):
    """out[t, oc] for every token t: row r in passes of 4, 2, 1 tokens."""
    k = xq.shape[0]
    t0 = 0
    while t0 < k:
        n = 4 if k - t0 >= 4 else (2 if k - t0 >= 2 else 1)
        row_dot(qtype, n, w, r, xq, xd, xs, t0, out, oc)
        t0 += n


@njit(cache=CACHE, nogil=True, inline="always")
def token_sum(acc, j, u):
    """Token u of group row j of acc: (l0 + l2) + (l1 + l3), as the register kernel's _token_sum."""
    return (acc[j, 4 * u] + acc[j, 4 * u + 2]) + (acc[j, 4 * u + 1] + acc[j, 4 * u + 3])


ROW_TILE = 8          # rows sharing an L1-resident chunk of the activations
TILE_GROUPS = 4       # token groups (16 tokens) per pass over a chunk: weights decoded once per 16 tokens
ACT_L1_BYTES = 16384  # activation bytes of a chunk (all the pass's tokens) kept in L1
TILED_MIN_K = 4       # k from which matvec runs the tiled kernel (below: row_dots, state in registers)


@njit(cache=CACHE, nogil=True, inline="always")
def tile_sums(qtype, w, r0, n_rows, xq, xd, xs, n_steps, chunk, acc):
    """acc[r * G + j] = the float lanes of row r0 + r (r < n_rows) for token group j < G = rows of
    xq / 4: column chunks of `chunk` steps, each swept by the tile's rows for 16 tokens at a time."""
    n_grp = xq.shape[0] // 4
    acc[: n_rows * n_grp] = 0.0
    for tg0 in range(0, n_grp, TILE_GROUPS):
        ng = min(TILE_GROUPS, n_grp - tg0)
        for s0 in range(0, n_steps, chunk):
            s1 = min(n_steps, s0 + chunk)
            for r in range(n_rows):
                row_groups(qtype, w, r0 + r, xq, xd, xs, tg0, ng, s0, s1, acc, r * n_grp + tg0)


@njit(cache=CACHE, nogil=True, parallel=True)
def _matvec_int_kernel(w, qtype, xq, xd, xs, out, n_groups):
    rows = w.shape[0]
    for g in prange(n_groups):
        for r in range(g * rows // n_groups, (g + 1) * rows // n_groups):
            row_dots(qtype, w, r, xq, xd, xs, out, r)


@njit(cache=CACHE, nogil=True, parallel=True)
def _matvec_tiled_kernel(w, qtype, xq, xd, xs, out, n_steps, chunk, n_groups):
    rows = w.shape[0]
    k = out.shape[0]
    n_grp = xq.shape[0] // 4
    n_tiles = (rows + ROW_TILE - 1) // ROW_TILE
    for g in prange(n_groups):
        acc = np.empty((ROW_TILE * n_grp, 16), np.float32)
        for tile in range(g * n_tiles // n_groups, (g + 1) * n_tiles // n_groups):
            r0 = tile * ROW_TILE
            n_rows = min(ROW_TILE, rows - r0)
            tile_sums(qtype, w, r0, n_rows, xq, xd, xs, n_steps, chunk, acc)
            for t in range(k):
                for r in range(n_rows):
                    out[t, r0 + r] = token_sum(acc, r * n_grp + t // 4, t % 4)


def n_row_groups(rows: int) -> int:
    """Parallel work items: a few per thread so a slow core does not hold up the call."""
    return max(1, min(rows, GROUPS_PER_THREAD * numba.get_num_threads()))


def n_tile_groups(rows: int) -> int:
    return n_row_groups((rows + ROW_TILE - 1) // ROW_TILE)


def tiling(qtype: int, row_bytes: int, k: int) -> tuple[int, int]:
    """(steps per row, steps per column chunk) of the tiled kernel for k tokens."""
    step_cols = QK_K if SPECS[int(qtype)][0] == "k" else 2 * QK_LEGACY
    tokens = min(-(-k // 4) * 4, 4 * TILE_GROUPS)
    return steps_per_row(qtype, row_bytes), max(1, ACT_L1_BYTES // (tokens * step_cols))


def quantize_for(qtype: int, x: np.ndarray):
    """x's rows quantized as the integer kernel of `qtype` reads them: (q, d, s)."""
    return quantize_rows(x, act_block(qtype))


def quantize_tiled(qtype: int, x: np.ndarray):
    """As quantize_for, with zero rows up to a multiple of 4 tokens (the tiled kernel's groups)."""
    return quantize_rows(x, act_block(qtype), pad_rows=-x.shape[0] % 4)


def matvec_int_into(w: np.ndarray, qtype: int, x: np.ndarray, out: np.ndarray, xq=None) -> np.ndarray:
    """out = W x on int8 activations. Operands already checked (matvec.check_operands); xq: x
    already quantized for this type (quantize_for or quantize_tiled), e.g. shared by gate and up."""
    k = x.shape[0]
    if k < TILED_MIN_K:
        q, d, s = quantize_for(qtype, x) if xq is None else xq
        _matvec_int_kernel(w, int(qtype), q, d, s, out, n_row_groups(w.shape[0]))
        return out
    q, d, s = quantize_tiled(qtype, x) if xq is None or xq[0].shape[0] % 4 else xq
    n_steps, chunk = tiling(qtype, w.shape[1], k)
    _matvec_tiled_kernel(w, int(qtype), q, d, s, out, n_steps, chunk, n_tile_groups(w.shape[0]))
    return out

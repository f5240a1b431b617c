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
from .matvec_simd import _array, _fma, _load_vec, _reduce_tree
from .quantize_act import QK_K, QK_LEGACY, quantize_rows
from .simd_int import CACHE, F32, I8, I16, I32, I64, IntBlockIR, dpbusd, dpwssd, maddubs, pmaddwd

GROUPS_PER_THREAD = 4
TOKEN_TILES = (4, 2, 1)     # tokens per row pass: unrolled copies of the token step (8 spills: no faster)

_F32V16 = ir.VectorType(F32, 16)
_F32V8 = ir.VectorType(F32, 8)


def _f32x2(b, x, y):
    v = b.insert_element(ir.Constant(ir.VectorType(F32, 2), ir.Undefined), x, ir.Constant(I32, 0))
    return b.insert_element(v, y, ir.Constant(I32, 1))


_LANE0_AND_8 = [0] + [2] * 7 + [1] + [2] * 7     # shuffle (v2 ++ zeros2): v[0] in lane 0, v[1] in lane 8
_HALF_EACH = [0] * 8 + [1] * 8


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


def _k_token(v, blk, a_ptr, dx, s_ptr, facc, macc):
    """One token's contribution of one super-block: (facc, macc) updated."""
    b = v.b
    # two integer chains (chunks 0, 1 and 2, 3): half the dpwssd latency on the critical path
    accs = [v.zeros(I32, 16), v.zeros(I32, 16)]
    for c in range(4):
        a = _load_vec(b, b.gep(a_ptr, [ir.Constant(I64, 64 * c)]), I8, 64, 1)
        accs[c // 2] = dpwssd(b, accs[c // 2], maddubs(b, blk.chunks[c], a), blk.sc16[c])
    acc = b.add(accs[0], accs[1])
    bs = _load_vec(b, s_ptr, I16, 16, 2)
    if blk.off16 is not None:
        corr = pmaddwd(b, blk.off16, bs)
        acc = b.add(acc, v.concat(corr, v.zeros(I32, 8)))
    facc = _fma(b, b.sitofp(acc, _F32V16), v.fsplat(b.fmul(blk.d, dx), 16), facc)
    if blk.min16 is not None:
        mins = b.sitofp(pmaddwd(b, blk.min16, bs), _F32V8)
        macc = _fma(b, mins, v.fsplat(b.fmul(blk.negdmin, dx), 8), macc)
    return facc, macc


# --------------------------------------------------------------------------- legacy decoders
# Each takes n_blk = 2 (a pair of blocks) or 1 (the odd last block: the second half is zeros)
# and returns 64 unsigned weight bytes, the block scales per lane, the integer offset and the
# per-block mins (lanes 0 and 8).

class PairBlock:
    def __init__(self, w, dv, off=0, mv=None, wide=False):
        self.w, self.dv, self.off, self.mv, self.wide = w, dv, off, mv, wide


def _pair(v, n_blk, block_bytes, one_block, off=0, with_min=False, wide=False):
    """Assemble a PairBlock from one_block(v, byte_off) -> (32 weight bytes, d, m)."""
    b = v.b
    parts = [one_block(v, j * block_bytes) for j in range(n_blk)]
    zero = ir.Constant(F32, 0.0)
    if n_blk == 1:
        parts.append((v.zeros(I8, 32), zero, zero))
    w = v.concat(parts[0][0], parts[1][0])
    dv = v.shuf(_f32x2(b, parts[0][1], parts[1][1]), _HALF_EACH)
    mv = None
    if with_min:
        mv = v.shuf(_f32x2(b, parts[0][2], parts[1][2]), _LANE0_AND_8, ir.Constant(ir.VectorType(F32, 2), [0.0, 0.0]))
    return PairBlock(w, dv, off, mv, wide)


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


def _pair_token(v, blk, a_ptr, d_ptr, s_ptr, facc):
    b = v.b
    a = _load_vec(b, a_ptr, I8, 64, 1)
    acc = dpbusd(b, v.zeros(I32, 16), blk.w, a, blk.wide)
    bs2 = b.sext(_load_vec(b, s_ptr, I16, 2, 2), ir.VectorType(I32, 2))
    if blk.off:
        corr = b.mul(bs2, ir.Constant(ir.VectorType(I32, 2), [blk.off] * 2))
        acc = b.add(acc, v.shuf(corr, _LANE0_AND_8, v.zeros(I32, 2)))
    dx2 = _load_vec(b, d_ptr, F32, 2, 4)
    facc = _fma(b, b.sitofp(acc, _F32V16), b.fmul(blk.dv, v.shuf(dx2, _HALF_EACH)), facc)
    if blk.mv is not None:
        s2 = b.fmul(dx2, b.sitofp(bs2, ir.VectorType(F32, 2)))
        facc = _fma(b, blk.mv, v.shuf(s2, _LANE0_AND_8, ir.Constant(ir.VectorType(F32, 2), [0.0, 0.0])), facc)
    return facc


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


class _Row:
    """Pointers of one row pass: weight row, and per token its q, d, s rows and output slot."""

    def __init__(self, context, builder, sig, args, n_tok):
        b = builder
        _, _, w, r, xq, xd, xs, t0, out, oc = args
        W = _array(context, b, sig.args[2], w)
        self.rb = cgutils.unpack_tuple(b, W.shape, 2)[1]
        self.wrow = b.gep(W.data, [b.mul(r, self.rb)])
        rows = []
        for arr, aty in ((xq, sig.args[4]), (xd, sig.args[5]), (xs, sig.args[6]), (out, sig.args[8])):
            A = _array(context, b, aty, arr)
            width = cgutils.unpack_tuple(b, A.shape, 2)[1]
            rows.append([b.gep(A.data, [b.mul(b.add(t0, ir.Constant(I64, t)), width)]) for t in range(n_tok)])
        self.q, self.d, self.s, out_rows = rows
        self.n_cols = cgutils.unpack_tuple(b, _array(context, b, sig.args[4], xq).shape, 2)[1]
        self.out = [b.gep(p, [oc]) for p in out_rows]


def _loop(b, count, init, body):
    """for i in range(count): state = body(i, state); returns the final state (a list of values)."""
    entry = b.basic_block
    head = b.append_basic_block("int.head")
    loop = b.append_basic_block("int.body")
    done = b.append_basic_block("int.done")
    b.branch(head)
    b.position_at_end(head)
    i = b.phi(I64)
    i.add_incoming(ir.Constant(I64, 0), entry)
    state = []
    for x in init:
        p = b.phi(x.type)
        p.add_incoming(x, entry)
        state.append(p)
    b.cbranch(b.icmp_signed("<", i, count), loop, done)
    b.position_at_end(loop)
    new = body(i, state)
    end = b.basic_block
    i.add_incoming(b.add(i, ir.Constant(I64, 1)), end)
    for p, x in zip(state, new):
        p.add_incoming(x, end)
    b.branch(head)
    b.position_at_end(done)
    return state


def _emit_k_row(b, row, decode, step_bytes, n_tok):
    n_blocks = b.sdiv(row.n_cols, ir.Constant(I64, QK_K))
    zero16, zero8 = ir.Constant(_F32V16, [0.0] * 16), ir.Constant(_F32V8, [0.0] * 8)

    def body(i, state):
        v = IntBlockIR(b, b.gep(row.wrow, [b.mul(i, ir.Constant(I64, step_bytes))]), None)
        blk = decode(v)
        new = []
        for t in range(n_tok):
            a_ptr = b.gep(row.q[t], [b.mul(i, ir.Constant(I64, QK_K))])
            dx = b.load(b.gep(row.d[t], [i]))
            s_ptr = b.gep(row.s[t], [b.mul(i, ir.Constant(I64, 16))])
            new += _k_token(v, blk, a_ptr, dx, s_ptr, state[2 * t], state[2 * t + 1])
        return new

    state = _loop(b, n_blocks, [zero16, zero8] * n_tok, body)
    for t in range(n_tok):
        y = b.fadd(_reduce_tree(b, state[2 * t], 16), _reduce_tree(b, state[2 * t + 1], 8))
        b.store(y, row.out[t])


def _emit_pair_row(b, row, decode, block_bytes, n_tok):
    n_blocks = b.sdiv(row.rb, ir.Constant(I64, block_bytes))     # weight blocks (odd counts allowed)
    zero16 = ir.Constant(_F32V16, [0.0] * 16)

    def step(i, state, n_blk):
        v = IntBlockIR(b, b.gep(row.wrow, [b.mul(i, ir.Constant(I64, 2 * block_bytes))]), None)
        blk = decode(v, n_blk)
        return [_pair_token(v, blk, b.gep(row.q[t], [b.mul(i, ir.Constant(I64, 64))]),
                            b.gep(row.d[t], [b.mul(i, ir.Constant(I64, 2))]),
                            b.gep(row.s[t], [b.mul(i, ir.Constant(I64, 2))]), state[t])
                for t in range(n_tok)]

    n_pairs = b.sdiv(n_blocks, ir.Constant(I64, 2))
    state = _loop(b, n_pairs, [zero16] * n_tok, lambda i, s: step(i, s, 2))
    # the odd last block: activations are padded to pairs, the weight half is zeros
    has_tail = b.icmp_signed("!=", b.srem(n_blocks, ir.Constant(I64, 2)), ir.Constant(I64, 0))
    before = b.basic_block
    tail = b.append_basic_block("int.tail")
    join = b.append_basic_block("int.join")
    b.cbranch(has_tail, tail, join)
    b.position_at_end(tail)
    tailed = step(n_pairs, state, 1)
    tail_end = b.basic_block
    b.branch(join)
    b.position_at_end(join)
    merged = []
    for t in range(n_tok):          # all phis first: LLVM wants them at the top of the block
        p = b.phi(_F32V16)
        p.add_incoming(state[t], before)
        p.add_incoming(tailed[t], tail_end)
        merged.append(p)
    for t in range(n_tok):
        b.store(_reduce_tree(b, merged[t], 16), row.out[t])


@intrinsic
def row_dot(typingctx, qtype, n_tok, w, r, xq, xd, xs, t0, out, oc):
    """out[t0 + t, oc] = (row r of W) . (activation row t0 + t), for t < n_tok (1, 2 or 4).

    w: (rows, row_bytes) uint8 of type qtype; xq int8, xd float32, xs int16 rows from
    quantize_act.quantize_rows with the block act_block(qtype); out float32 (k, >= oc + 1).
    Unchecked: the caller validated shapes.
    """
    for a in (w, xq, xd, xs, out):
        if not isinstance(a, types.Array) or a.layout != "C" or a.ndim != 2:
            return None
    sig = types.void(types.int64, types.intp, w, types.intp, xq, xd, xs, types.intp, out, types.intp)

    def codegen(context, builder, signature, args):
        b = builder
        done = b.append_basic_block("row_dot.done")
        by_type = b.switch(args[0], done)
        for qt, (kind, decode, nbytes) in SPECS.items():
            type_bb = b.append_basic_block(f"row_dot.t{qt}")
            by_type.add_case(ir.Constant(I64, qt), type_bb)
            b.position_at_end(type_bb)
            by_tok = b.switch(args[1], done)
            for n_tok in TOKEN_TILES:
                tok_bb = b.append_basic_block(f"row_dot.t{qt}.n{n_tok}")
                by_tok.add_case(ir.Constant(I64, n_tok), tok_bb)
                b.position_at_end(tok_bb)
                row = _Row(context, b, signature, args, n_tok)
                if kind == "k":
                    _emit_k_row(b, row, decode, nbytes, n_tok)
                else:
                    _emit_pair_row(b, row, decode, nbytes, n_tok)
                b.branch(done)
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


@njit(cache=CACHE, nogil=True, parallel=True)
def _matvec_int_kernel(w, qtype, xq, xd, xs, out, n_groups):
    rows = w.shape[0]
    for g in prange(n_groups):
        for r in range(g * rows // n_groups, (g + 1) * rows // n_groups):
            row_dots(qtype, w, r, xq, xd, xs, out, r)


def n_row_groups(rows: int) -> int:
    """Parallel work items: a few per thread so a slow core does not hold up the call."""
    return max(1, min(rows, GROUPS_PER_THREAD * numba.get_num_threads()))


def quantize_for(qtype: int, x: np.ndarray):
    """x's rows quantized as the integer kernel of `qtype` reads them: (q, d, s)."""
    return quantize_rows(x, act_block(qtype))


def matvec_int_into(w: np.ndarray, qtype: int, x: np.ndarray, out: np.ndarray, xq=None) -> np.ndarray:
    """out = W x on int8 activations. Operands already checked (matvec.check_operands); xq: x
    already quantized for this type (quantize_for), e.g. shared by gate and up."""
    q, d, s = quantize_for(qtype, x) if xq is None else xq
    _matvec_int_kernel(w, int(qtype), q, d, s, out, n_row_groups(w.shape[0]))
    return out

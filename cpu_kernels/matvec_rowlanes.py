"""Row lanes: 16 weight rows in the 16 int32 lanes of a vector, one vector per token.

Why: the register groups (matvec_int.block_dots) dot each (row, token) pair in 64-byte vectors, so
every pair's 16 partial sums must be folded to one lane and every sub-block scale applied per pair:
at 4 tokens ~19 vector instructions per (row, token, super-block), of which 4 are vpdpbusd (counted
in the IR), and k = 4 cost 1.4-1.8x k = 1 on the 27B shapes, k = 8 2.5-4x (token quads). Here 16
rows' steps are transposed (vector j, lane r: weight dword j of row r), so one vpdpbusd multiplies 4
weights of 16 rows by the same 4 activation bytes of one token, broadcast from memory into the
instruction: every integer lands in its row's lane, nothing is folded, and a sub-block's scales are
one vpmulld for 16 rows. The transposes (4 stages of in-lane and 128-bit-lane shuffles per 16 x 16
dwords) are paid once per step for all the tokens of a pass; Q4_K, Q5_K and Q6_K transpose their raw
bytes and decode in the lanes (one instruction per 16 rows where the row decoders spend one per
row), the other types transpose their rows' decoded steps. A K-quant pass of 2+ tokens stages the
weights in L1 and loops over sub-blocks, each sub-block's weight vectors kept in registers for all
the tokens (straight-line code let LLVM order the work token by token and spill them). On the avx2
lowering (no vpdpbusd) the types with a bounded weight byte sum a sub-block's vpmaddubsw outputs in
int16 and widen them once, by the scales (i16_sum_dwords): the same integers for fewer multiplies.

Memory: the 16 rows of a group are one contiguous block; on AMD Zen the next group is prefetched
into L2 a slice per step (NEXT_GROUP_PREFETCH: 16 short rows read side by side stream at ~60 % of
one row's speed on Zen 4).

Per (token, row) the integers and the float steps are matvec_int's numerics block, in its order, so
the bits are those of every other kernel there.
"""
from __future__ import annotations

import itertools

from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .formats import LANE_DECODER, QUANT_TYPES
from .int_blocks import (K_SUB, _bcast_dword, _by_type, _c64, _c_2d, _decoded, _loop, _max_k_lookup, _opaque,
                         _qtype_arg, _steps, _Tokens, _weight_row)
from .matvec_simd import _array, _fma, _load_vec, _splat
from .quantize_act import QK_K, QK_LEGACY
from .simd_int import F32, I8, I16, I32, ISA, IntBlockIR, _intrinsic, dpbusd, dpwssd, maddubs, pmaddwd, prefetch

ROW_LANES = 16


# Two-source shuffles of <16 x i32> that x86 runs as one non-destructive instruction each, as
# (low, high) output masks: vpunpck{l,h}dq, vpunpck{l,h}qdq (within 128-bit lanes), vshufi32x4.
def _lane_masks():
    def per_lane(f):
        return [x for L in range(4) for x in f(4 * L)]

    def lanes(sel):         # 128-bit lanes 0-3 of A, 4-7 of B
        return [4 * x + j if x < 4 else 16 + 4 * (x - 4) + j for x in sel for j in range(4)]
    return {"dq": (per_lane(lambda o: [o, 16 + o, o + 1, 17 + o]), per_lane(lambda o: [o + 2, 18 + o, o + 3, 19 + o])),
            "qdq": (per_lane(lambda o: [o, o + 1, 16 + o, 17 + o]), per_lane(lambda o: [o + 2, o + 3, 18 + o, 19 + o])),
            "l01": (lanes([0, 1, 4, 5]), lanes([2, 3, 6, 7])),
            "l02": (lanes([0, 2, 4, 6]), lanes([1, 3, 5, 7]))}


LANE_MASKS = _lane_masks()


def _run_stages(V, stages, shuffle):
    """V after the stages, each pairing vectors dist apart: shuffle(a, b, mask) makes one output."""
    for kind, dist in stages:
        lo, hi = LANE_MASKS[kind]
        out = list(V)
        for i in range(len(V)):
            if (i // dist) % 2 == 0:
                out[i], out[i + dist] = shuffle(V[i], V[i + dist], lo), shuffle(V[i], V[i + dist], hi)
        V = out
    return V


def _label_shuffle(a, b, mask):
    return [(a + b)[k] for k in mask]


def _transpose_plan(n):
    """(slot order, concat levels, stages, column of each output) of a transpose of 16 rows of n
    dwords: rows concatenated in pairs up to 16 lanes, then 4 - levels stages of the shuffles above
    (found by trying them on labels); the slot order puts row r in lane r."""
    V = [[(s, c) for c in range(n)] for s in range(16)]
    levels = 0
    while len(V[0]) < 16:
        h = len(V) // 2
        V = [V[i] + V[i + h] for i in range(h)]
        levels += 1
    dists = [1 << k for k in range(4 - levels)]
    for kinds in itertools.permutations(LANE_MASKS, len(dists)):
        for order in itertools.permutations(dists):
            W = _run_stages(V, list(zip(kinds, order)), _label_shuffle)
            lane_slot = [x for x, _ in W[0]]
            if all(len({c for _, c in w}) == 1 and [x for x, _ in w] == lane_slot for w in W) \
                    and sorted(lane_slot) == list(range(16)):
                slot_row = [0] * 16
                for lane, slot in enumerate(lane_slot):
                    slot_row[slot] = lane
                return slot_row, levels, list(zip(kinds, order)), [w[0][1] for w in W]
    raise AssertionError(f"no transpose of 16 x {n}")


TRANSPOSE_PLANS = {n: _transpose_plan(n) for n in (4, 8, 16)}


def _transpose16(b, rows):
    """16 vectors <n x i32> (n = 4, 8, 16) -> n vectors <16 x i32>: out[j] lane r = rows[r][j]."""
    n = rows[0].type.count
    slot_row, levels, stages, cols = TRANSPOSE_PLANS[n]
    V = [rows[r] for r in slot_row]
    for _ in range(levels):
        h = len(V) // 2
        m = V[0].type.count
        V = [b.shuffle_vector(V[i], V[i + h], ir.Constant(ir.VectorType(I32, 2 * m), list(range(2 * m))))
             for i in range(h)]
    V = _run_stages(V, stages, lambda x, y, mask: b.shuffle_vector(x, y, ir.Constant(ir.VectorType(I32, 16), mask)))
    by_col = [None] * n
    for c, vec in zip(cols, V):
        by_col[c] = vec
    return by_col


def _as_i32(b, vec):
    n = vec.type.count * vec.type.element.width // 32
    return b.bitcast(vec, ir.VectorType(I32, n))


def _row_vector(b, scalars):
    vec = ir.Constant(ir.VectorType(scalars[0].type, len(scalars)), ir.Undefined)
    for j, x in enumerate(scalars):
        vec = b.insert_element(vec, x, ir.Constant(I32, j))
    return vec


class LaneStep:
    """A step (super-block) of 16 rows in row lanes: chunks() yields (c, W) for c = 0..3, W the 16
    weight vectors of chunk c (lane r: bytes 64 c + 4 j .. + 3 of row r, unsigned); scale(s) the
    sub-block scales (i32 per lane); coef(p) the 8 i16-pair vectors that dot the activations' 16-value
    sums (coef_scale times the type's off16 or min16 pairs; off: they enter the integer sum, else the
    mins' float term); d, negdmin <16 x float>; wide as KBlock's."""

    def __init__(self, chunks, scale, coef, coef_scale, off, d, negdmin, wide=False):
        self.chunks, self.scale, self.coef, self.coef_scale, self.off = chunks, scale, coef, coef_scale, off
        self.d, self.negdmin, self.wide = d, negdmin, wide


# formats.QUANT_TYPES' IntKernel.weight_max: the largest weight byte a type's lanes multiply
WEIGHT_MAX = {t.qtype: t.integer.weight_max for t in QUANT_TYPES if t.integer and t.integer.weight_max}


def i16_sum_dwords(qtype: int, isa: str = ISA) -> int:
    """How many consecutive dword steps (4 weights each) of one scale the avx2 lowering sums in
    int16 before a single vpmaddwd (0: none, each step is a dpbusd into int32). Without VNNI a
    dpbusd is a vpmaddubsw, a vpmaddwd by ones and a vpaddd, two of them on the multiply pipes (one
    step a cycle: scripts/probe_int8_peak.py); n vpmaddubsw outputs added as int16 (vpaddw) and then
    multiplied by the scale pairs (or by ones) take n + 1 multiplies instead of 2n, and a K-quant's
    sub-block saves its vpmulld too. The integers are the same: exact while an int16 sum cannot
    saturate, each vpmaddubsw lane being two products of a weight byte <= weight_max and an int8
    activation of magnitude <= 128 (Q4_K 8 steps, Q5_K 4, Q6_K 2; a wide type's bytes, up to 255,
    would give 0: those have no weight_max)."""
    umax = WEIGHT_MAX.get(int(qtype))
    if isa != "avx2" or not umax:
        return 0
    return 32767 // (2 * umax * 128)


def _i16_summed_dots(b, acc, steps, tokens, group, mult):
    """acc[u] + token u's 4-product dword sums of `steps` ((weight vector, byte offset of the
    activation dword) each, one scale for all), on the avx2 lowering: `group` steps' vpmaddubsw
    outputs added as int16 (i16_sum_dwords), each such sum widened by one vpmaddwd by `mult` (the
    scale in both int16 halves of a lane, or ones). The tokens' chains interleaved."""
    part = []
    for n, (w, off) in enumerate(steps):
        p = [maddubs(b, w, _bcast_dword(b, a, off, I8, 64)) for a in tokens]
        part = p if n % group == 0 else [b.add(x, y) for x, y in zip(part, p)]
        if n % group == group - 1 or n == len(steps) - 1:
            acc = [b.add(x, pmaddwd(b, y, mult)) for x, y in zip(acc, part)]
    return acc


def _lanes_i32(v, n, x):
    return v.bconst(x, n, I32)


def _raw_dwords(b, ptrs, off, n):
    """Dwords off .. off + 4n of 16 rows' steps (ptrs), transposed: n vectors, lane r row r's."""
    return _transpose16(b, [_load_vec(b, b.gep(p, [_c64(off)]), I32, n, 1) for p in ptrs])


def _half_floats(b, x, shift):
    """The float16 in bits shift .. shift + 15 of each i32 lane, as <16 x float> (exact)."""
    if shift:
        x = b.lshr(x, ir.Constant(x.type, [shift] * 16))
    h = b.bitcast(b.trunc(x, ir.VectorType(I16, 16)), ir.VectorType(ir.HalfType(), 16))
    return b.fpext(h, ir.VectorType(F32, 16))


def _q4_k_lanes(b, v0, ptrs, fifth=False):
    """Q4_K (fifth=False) / Q5_K: d @0, dmin @2, scales @4 (int_blocks._k_scales_mins16), Q5_K's
    qh[32] @16, qs[128] @16 / @48. Everything decoded in the lanes, after the transposes of the raw
    bytes: one vector instruction per 16 rows where the row decoders spent one per row."""
    c32 = lambda x: _lanes_i32(v0, 16, x)
    h0, q0, q4, q8 = _raw_dwords(b, ptrs, 0, 4)

    def byte(x, j, shift, mask):          # (byte j of x) >> shift & mask, per lane
        return b.and_(b.lshr(x, c32(8 * j + shift)), c32(mask))

    def scale(j):
        if j < 4:
            return byte(q0, j, 0, 63)
        return b.or_(byte(q8, j - 4, 0, 15), b.shl(byte(q0, j - 4, 6, 3), c32(4)))

    def coef(j):            # min16 pairs (m_j, m_j): sub-block j's two 16-value sums share its min
        m = byte(q4, j, 0, 63) if j < 4 else b.or_(byte(q8, j - 4, 4, 15), b.shl(byte(q4, j - 4, 6, 3), c32(4)))
        return b.bitcast(b.mul(m, c32(0x10001)), ir.VectorType(I16, 32))
    qs_off = 48 if fifth else 16
    bytes64 = ir.VectorType(I8, 64)

    def chunks():
        qh = _raw_dwords(b, ptrs, 16, 8) if fifth else None
        for h in range(2):
            # qs byte 32 c + l: element 64 c + l (low nibble), 64 c + 32 + l (high); c = 2h, 2h + 1
            T = _raw_dwords(b, ptrs, qs_off + 64 * h, 16)
            for cc in range(2):
                c = 2 * h + cc
                W = [None] * 16
                for m in range(8):
                    x = b.bitcast(T[8 * cc + m], bytes64)
                    lo, hi = _as_i32(b, v0.band(x, 15)), _as_i32(b, v0.bshr(x, 4))     # byte shift: no mask
                    if fifth:       # bit j of qh[l]: the fifth bit of element l of sub-block j
                        lo = b.or_(lo, b.shl(b.and_(b.lshr(qh[m], c32(2 * c)), c32(0x01010101)), c32(4)))
                        hi = b.or_(hi, b.shl(b.and_(b.lshr(qh[m], c32(2 * c + 1)), c32(0x01010101)), c32(4)))
                    W[m], W[8 + m] = b.bitcast(lo, bytes64), b.bitcast(hi, bytes64)
                yield c, W
    return LaneStep(chunks, scale, coef, 1, False, _half_floats(b, h0, 0),
                    b.fneg(_half_floats(b, h0, 16)))


def _q5_k_lanes(b, v0, ptrs):
    return _q4_k_lanes(b, v0, ptrs, fifth=True)


def _q6_k_lanes(b, v0, ptrs):
    """Q6_K: ql[128] @0, qh[64] @128, int8 scales[16] @192, d @208. Element 128 h + 32 t + l: nibble
    t >> 1 of ql[64 h + 32 (t & 1) + l], bits 2t of qh[32 h + l] (int_blocks._q6_k). The offset
    -32 sc of each 16-value sum: its pairs are the scales themselves, the -32 applied to their sum."""
    c32 = lambda x: _lanes_i32(v0, 16, x)
    tail = _raw_dwords(b, ptrs, 178, 8)         # qh's last 14 bytes, the scales, d (bytes 206..209)

    def scale(s):           # where used: 16 vectors kept from the start would not fit the registers
        byte = 14 + s
        return b.ashr(b.shl(tail[byte // 4], c32(24 - 8 * (byte % 4))), c32(24))

    def coef(p):
        return b.bitcast(b.or_(b.and_(scale(2 * p), c32(0xFFFF)), b.shl(scale(2 * p + 1), c32(16))),
                         ir.VectorType(I16, 32))
    bytes64 = ir.VectorType(I8, 64)

    def chunks():
        # qh whole in one 16 x 16 transpose (dword 8 h + l / 4 for half h), not a 16 x 8 per half:
        # k = 8 10-15 % faster on the 27B shapes, Zen 5 (a4a8af9)
        qh = _raw_dwords(b, ptrs, 128, 16)
        for h in range(2):
            ql = _raw_dwords(b, ptrs, 64 * h, 16)    # ql dword 8 (t & 1) + l / 4 of half h
            for tt in range(2):
                W = [None] * 16
                for t in (2 * tt, 2 * tt + 1):
                    for m in range(8):
                        x = ql[8 * (t & 1) + m]
                        low = b.and_(b.lshr(x, c32(4)) if t >> 1 else x, c32(0x0F0F0F0F))
                        # bits 2t, 2t + 1 of each qh byte to bits 4, 5 (dword shifts: what crosses
                        # a byte boundary lands outside the mask)
                        y = qh[8 * h + m]
                        y = b.shl(y, c32(4 - 2 * t)) if t < 3 else b.lshr(y, c32(2))
                        W[8 * (t % 2) + m] = b.bitcast(b.or_(low, b.and_(y, c32(0x30303030))), bytes64)
                yield 2 * h + tt, W
    return LaneStep(chunks, scale, coef, -32, True, _half_floats(b, tail[7], 16), None)


def _decoded_lanes(b, dec):
    """Any K-quant, from its row decoders (int_blocks.KBlock): each row's decoded chunks and
    scales transposed."""
    v0, blk0 = dec[0]
    sixteen = _lanes_i32(v0, 16, 16)
    sc_pairs = _transpose16(b, [_as_i32(b, blk.sub_sc) for _, blk in dec])

    def scale(s):
        p = sc_pairs[s // 2]
        return b.ashr(b.shl(p, sixteen), sixteen) if s % 2 == 0 else b.ashr(p, sixteen)
    off = blk0.off16 is not None
    coefs = [b.bitcast(x, ir.VectorType(I16, 32))
             for x in _transpose16(b, [_as_i32(b, blk.off16 if off else blk.min16) for _, blk in dec])]
    coef = coefs.__getitem__

    def chunks():
        for c in range(4):
            yield c, [b.bitcast(x, ir.VectorType(I8, 64))
                      for x in _transpose16(b, [_as_i32(b, blk.chunks[c]) for _, blk in dec])]
    negdmin = None if blk0.min16 is None else _row_vector(b, [blk.negdmin for _, blk in dec])
    return LaneStep(chunks, scale, coef, 1, off, _row_vector(b, [blk.d for _, blk in dec]), negdmin, blk0.wide)


def lane_step(b, qt, vbs, ptrs):
    """The LaneStep of 16 rows' step: ptrs their step pointers, vbs their row decoders (the types
    without a lane decoder)."""
    if qt in LANE_DECODERS:
        return LANE_DECODERS[qt](b, IntBlockIR(b, ptrs[0], None), ptrs)
    return _decoded_lanes(b, [_decoded(x) for x in vbs])


def _k_row_lanes(b, st, i, trows, ybufs, sub, wbuf, prefetch_part, group=0):
    """ybufs[u] (<16 x float>* each, token u's float state) after super-block i of the 16 rows
    (st: their LaneStep); trows: the tokens' (q, d, s) activation rows. The float state lives in
    an L1 buffer, not in registers: a chunk's weight vectors and each token's integer sum must fit
    the 32 vector registers. group: i16_sum_dwords' (0 off the avx2 lowering)."""
    i32x16, f32x16 = ir.VectorType(I32, 16), ir.VectorType(F32, 16)
    zero = ir.Constant(i32x16, [0] * 16)
    step_q = [b.gep(q, [b.mul(i, _c64(QK_K))]) for q, _, _ in trows]
    isum = [zero for _ in trows]
    per_sub = sub // 4
    bytes64 = ir.VectorType(I8, 64)
    if wbuf is None:            # one token: each weight vector used once, straight from its transpose
        for c, W in st.chunks():
            prefetch_part(c)
            for j0 in range(0, 16, per_sub):
                raw = zero
                for j in range(j0, j0 + per_sub):
                    raw = dpbusd(b, raw, W[j], _bcast_dword(b, step_q[0], 64 * c + 4 * j, I8, 64), st.wide)
                isum[0] = b.add(isum[0], b.mul(raw, st.scale((64 * c + 4 * j0) // sub)))
    else:
        # the weights and scales to L1 (the transposes need the registers), then a loop over the
        # sub-blocks: its weight vectors loaded once for all tokens and kept in registers (straight
        # line code let LLVM order the work token by token and spill the weights)
        n_sub = QK_K // sub
        for c, W in st.chunks():
            prefetch_part(c)
            for j, x in enumerate(W):
                b.store(x, b.bitcast(b.gep(wbuf, [_c64(64 * (16 * c + j))]), bytes64.as_pointer()), align=64)
        for s in range(n_sub):
            sc = st.scale(s)
            if group:       # the scale in both int16 halves of its lane: vpmaddwd's pairs
                sc = b.or_(b.and_(sc, ir.Constant(i32x16, [0xFFFF] * 16)), b.shl(sc, ir.Constant(i32x16, [16] * 16)))
            b.store(sc, b.bitcast(b.gep(wbuf, [_c64(64 * (64 + s))]), i32x16.as_pointer()), align=64)
        wb = _opaque(b, wbuf)

        def one_sub(s, acc):
            W = [b.load(b.bitcast(b.gep(wb, [b.add(b.mul(s, _c64(sub * 16)), _c64(64 * jj))]), bytes64.as_pointer()),
                        align=64) for jj in range(per_sub)]
            sc = b.load(b.bitcast(b.gep(wb, [b.add(b.mul(s, _c64(64)), _c64(64 * 64))]), i32x16.as_pointer()),
                        align=64)
            a0 = [b.gep(sq, [b.mul(s, _c64(sub))]) for sq in step_q]
            if group:       # avx2: int16 sums of `group` steps, each times the scales by one vpmaddwd
                return _i16_summed_dots(b, acc, [(W[jj], 4 * jj) for jj in range(per_sub)], a0, group,
                                        b.bitcast(sc, ir.VectorType(I16, 32)))
            raw = [zero for _ in step_q]
            for jj in range(per_sub):        # the tokens' chains interleaved: vpdpbusd's latency hidden
                raw = [dpbusd(b, x, W[jj], _bcast_dword(b, a, 4 * jj, I8, 64), st.wide) for x, a in zip(raw, a0)]
            return [b.add(x, b.mul(r, sc)) for x, r in zip(acc, raw)]
        isum = _loop(b, _c64(0), _c64(n_sub), isum, one_sub)
    coefs = [st.coef(p) for p in range(8)]
    for u, ((q, d, s), yb) in enumerate(zip(trows, ybufs)):
        step_s = b.bitcast(b.gep(s, [b.mul(i, _c64(16))]), I8.as_pointer())
        cs = zero
        for p in range(8):
            cs = dpwssd(b, cs, coefs[p], _bcast_dword(b, step_s, 4 * p, I16, 32))
        if st.coef_scale != 1:
            cs = b.mul(cs, ir.Constant(i32x16, [st.coef_scale] * 16))
        x = b.add(isum[u], cs) if st.off else isum[u]
        dx = _splat(b, b.load(b.gep(d, [i])), 16)
        y = _fma(b, b.sitofp(x, f32x16), b.fmul(st.d, dx), b.load(yb, align=64))
        if not st.off:
            y = _fma(b, b.sitofp(cs, f32x16), b.fmul(st.negdmin, dx), y)
        b.store(y, yb, align=64)


class PairLanes:
    """A block pair of 16 rows in row lanes: W the 16 weight vectors (lane r: bytes 4 j .. 4 j + 3 of
    row r's 64 weights, vectors 0-7 block A, 8-15 block B, unsigned), d2 / m2 the blocks' scales /
    mins (<16 x float> each, m2 None without mins), off and wide as PairBlock's."""

    def __init__(self, W, d2, m2, off, wide):
        self.W, self.d2, self.m2, self.off, self.wide = W, d2, m2, off, wide


def _decoded_pair_lanes(b, dec):
    """Any 32-weight type, from its row decoders (int_blocks.PairBlock, a full pair or an odd last
    block): each row's 64 decoded weight bytes transposed, its scales and mins gathered."""
    blk0 = dec[0][1]
    W = [b.bitcast(x, ir.VectorType(I8, 64)) for x in _transpose16(b, [_as_i32(b, blk.w) for _, blk in dec])]
    d2 = [_row_vector(b, [b.extract_element(blk.d2, ir.Constant(I32, h)) for _, blk in dec]) for h in range(2)]
    m2 = None
    if blk0.m2 is not None:
        m2 = [_row_vector(b, [b.extract_element(blk.m2, ir.Constant(I32, h)) for _, blk in dec]) for h in range(2)]
    return PairLanes(W, d2, m2, blk0.off, blk0.wide)


def _q4_0_lanes(b, v0, ptrs):
    """A full Q4_0 pair (d @0, qs[16] @2; d @18, qs[16] @20) decoded in the lanes from its raw
    dwords: the rows' decoders and the 32 extracts and inserts that gather 16 rows' scales cost
    about twice the transposes, and at 8 tokens the shared steps are what keeps Q4_0 over 1.6x k = 1
    (docs/history.md, "Zen 5: row lanes for one token and Q4_0's batches"). Block A's quants sit 2
    bytes off the dwords: a funnel shift (vpshrdd) of two neighbours each."""
    c32 = lambda x: _lanes_i32(v0, 16, x)
    D = _raw_dwords(b, ptrs, 0, 8) + _raw_dwords(b, ptrs, 4, 8)[7:]       # the pair's dwords 0..8
    i32x16 = ir.VectorType(I32, 16)
    qa = [_intrinsic(b, "llvm.fshr.v16i32", i32x16, [D[m + 1], D[m], c32(16)]) for m in range(4)]
    bytes64 = ir.VectorType(I8, 64)
    W = []
    for q in (qa, D[5:9]):      # element l: the low nibble of qs[l], l + 16: its high nibble
        W += [b.bitcast(b.and_(x, c32(0x0F0F0F0F)), bytes64) for x in q]
        W += [b.bitcast(b.and_(b.lshr(x, c32(4)), c32(0x0F0F0F0F)), bytes64) for x in q]
    return PairLanes(W, [_half_floats(b, D[0], 0), _half_floats(b, D[4], 16)], None, -8, False)


# The 32-weight types decoded in the lanes (a full pair; an odd last block takes the row decoders),
# in passes of PAIR_LANES_MIN_TOKENS tokens or more. Q4_0 on the 27B shapes, Zen 5, 2 threads, from
# memory, the trees interleaved call by call (docs/history.md, "Zen 5: row lanes for one token and
# Q4_0's batches"): k = 8 1.52 ms against the row decoders' 2.21-2.23, k = 4 1.23-1.25 against
# 1.35-1.43, but k = 1 1.33-1.47 against 1.18-1.34 (faster from cache, slower from memory: not
# explained), so 1- and 2-token passes keep the rows'.
PAIR_LANES_MIN_TOKENS = 4

# type -> its decoder in the lanes, K-quants (a super-block) and 32-weight types (a pair) alike
# (formats.QUANT_TYPES rows with IntKernel.lane_decoder: _<kernel>_lanes above)
LANE_DECODERS = LANE_DECODER.bind(globals())


def pair_lanes(b, qt, vbs, ptrs, n_blk, n_toks):
    """The PairLanes of 16 rows' step for a pass of n_toks tokens: ptrs their step pointers, vbs
    their row decoders."""
    if n_blk == 2 and qt in LANE_DECODERS and n_toks >= PAIR_LANES_MIN_TOKENS:
        return LANE_DECODERS[qt](b, IntBlockIR(b, ptrs[0], None), ptrs)
    return _decoded_pair_lanes(b, [_decoded(x) for x in vbs])


def _pair_row_lanes(b, pl, i, trows, ybufs, prefetch_part, group=0):
    """ybufs[u] after block pair i of the 16 rows (pl: their PairLanes), the numerics block's terms
    per block (A, then B), a block's offset and min from the token's block sum. group:
    i16_sum_dwords' (0 off the avx2 lowering)."""
    i32x16, f32x16 = ir.VectorType(I32, 16), ir.VectorType(F32, 16)
    zero = ir.Constant(i32x16, [0] * 16)
    W, d2, m2 = pl.W, pl.d2, pl.m2
    for c in range(4):
        prefetch_part(c)
    step_q = [b.gep(q, [b.mul(i, _c64(2 * QK_LEGACY))]) for q, _, _ in trows]
    raws = []
    for h in range(2):
        raw = [zero for _ in trows]
        if group:       # avx2: int16 sums of `group` steps, each to int32 by one vpmaddwd by ones
            raw = _i16_summed_dots(b, raw, [(W[j], 4 * j) for j in range(8 * h, 8 * h + 8)], step_q, group,
                                   ir.Constant(ir.VectorType(I16, 32), [1] * 32))
        else:
            for j in range(8 * h, 8 * h + 8):       # the tokens' chains interleaved
                raw = [dpbusd(b, x, W[j], _bcast_dword(b, a, 4 * j, I8, 64), pl.wide) for x, a in zip(raw, step_q)]
        raws.append(raw)
    for u, ((q, d, s), yb) in enumerate(zip(trows, ybufs)):
        bs2 = b.sext(_load_vec(b, b.gep(s, [b.mul(i, _c64(2))]), I16, 2, 2), ir.VectorType(I32, 2))
        dx2 = _load_vec(b, b.gep(d, [b.mul(i, _c64(2))]), F32, 2, 4)
        y = b.load(yb, align=64)
        for h in range(2):
            bs = b.extract_element(bs2, ir.Constant(I32, h))
            x = raws[h][u]
            if pl.off:
                x = b.add(x, _splat(b, b.mul(bs, ir.Constant(I32, pl.off)), 16))
            dx = _splat(b, b.extract_element(dx2, ir.Constant(I32, h)), 16)
            y = _fma(b, b.sitofp(x, f32x16), b.fmul(d2[h], dx), y)
            if m2 is not None:
                y = _fma(b, _splat(b, b.sitofp(bs, F32), 16), b.fmul(m2[h], dx), y)
        b.store(y, yb, align=64)


# K-quant passes of this many tokens stage their weights in L1 and loop over sub-blocks. One token
# too: the straight-line pass of one token (each weight vector used once, from its transpose) ran
# Q4_K / Q5_K k = 1 at ~57 % of the read bandwidth on Zen 5, staged at ~72 % (dd107e5).
STAGE_MIN_TOKENS = 1
TOKEN_PASSES = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 6: 8, 7: 8, 8: 8}      # tokens -> the pass (compiled) that takes them
PASS_TOKENS = 8         # the most tokens of a pass (a row group takes more in several passes)


def token_passes(min_k: int) -> dict[int, int]:
    """tokens -> the pass that takes them, where no type takes the row lanes below min_k tokens.
    From 3 tokens on (the avx2 lowering's 4: YMM_ROW_LANES_MIN_K) 1 or 2 tokens reach the row
    lanes only as the end of a longer batch: the pass of 4 takes those (the last token repeated,
    as for 3), and each type compiles two pass sizes instead of four."""
    if min_k >= 3:
        return {n: 4 if n <= 4 else 8 for n in TOKEN_PASSES}
    return dict(TOKEN_PASSES)

# The fewest tokens from which each type's matrices run in row lanes (matvec_int.block_dots),
# measured on the 27B FFN shapes on Zen 4, 2 threads, from memory, against the register groups
# (docs/history.md, "Row lanes: 16 rows in a vector's lanes"): Q6_K's single rows stream faster at
# 1-2 tokens, the register groups fold Q4_1 / Q5_1's mins more cheaply at 1-2.
# The numbers are formats.QUANT_TYPES' (IntKernel.row_lanes_min_k).
ROW_LANES_MIN_K = {t.qtype: t.integer.row_lanes_min_k for t in QUANT_TYPES
                   if t.integer and t.integer.row_lanes_min_k is not None}
# Off AMD Zen (the Xeon of BENCHMARKS.md's "Mission size" section, LLVM: emeraldrapids) one token
# runs faster in matvec_int's register groups of 4 rows for every type that takes row lanes from 1:
# 27B FFN shapes, 2 threads, from memory, k = 1, e.g. Q4_K 17408 x 5120 2.02 -> 1.93 ms and
# 5120 x 17408 2.12 -> 1.81, Q8_0 3.87 -> 3.44, Q5_K 3.03 -> 2.75, Q3_K 48 -> 64 % of the read
# bandwidth; from 2 tokens on the row lanes match or beat the groups there as on Zen.
ROW_LANES_ZEN_CPUS = ("znver",)
NON_ZEN_MIN_K = 2
# On the avx2 lowering (a 16-lane vector is two ymm halves, a vpdpbusd three instructions on each)
# one and two tokens stay in the register groups, and from 4 tokens (a full pass) the row lanes win
# for the types formats.QUANT_TYPES gives a ymm_row_lanes_min_k. Measured on an AMD EPYC Zen 3 (LLVM:
# znver3), 2026-11-29: the Qwen3.6-27B's trunk (Q4_K, Q6_K), one thread, CPU time
# (`scripts/profile_decode.py MODEL -t 1 --cpu-time --k ...`, two alternating runs a tree), a step
# of k = 4 3.6-4.2 s against 5.3-5.6 s in the groups, k = 5 5.2-5.6 against 5.9-7.4, k = 6 5.9-6.0
# against 7.6-8.5, k = 8 7.2-7.3 against 9.2-10.2; k = 2 in row lanes 2.5-3.0 s against 2.3-2.4, k = 3
# (a pass of 4) 4.2-4.3 against 3.8-4.2 (a second pair of runs, with the change built: k = 4 3.5-4.1
# against 4.6-6.1 s, k = 8 6.8-7.3 against 9.1-11.4; docs/history.md "Row lanes on AVX2"). `bench_matvec.py --kernel int --ks 1,4,5 --threads 1
# --cpu-time` on 17408 x 5120, hot ms at 4 tokens, row lanes against groups: Q4_0 8.4 / 14.6, Q4_1
# 9.9 / 14.8, Q2_K 11.0 / 12.5, Q3_K 11.2 / 12.9, Q5_K 10.4 / 14.1, IQ4_NL 14.4 / 22.8, IQ4_XS 15.1 /
# 22.1; Q8_0 even at 4 and 1.3x slower at 5 (a pass of 8), Q5_0 and Q5_1 (the fifth bits spread in
# the lanes) 3-4x slower: those three keep the groups. With the int16 sums (i16_sum_dwords) 1 and 2
# tokens still lose to the groups (2026-11-30, 27B shapes, 2 threads, from memory: Q6_K 17408 x 5120
# k = 1 7.25 against 4.03 ms, Q4_K even). The ymm lowering with vpdpbusd (avxvnni) is unmeasured
# and keeps the groups.
YMM_ROW_LANES_MIN_K = {t.qtype: t.integer.ymm_row_lanes_min_k for t in QUANT_TYPES
                       if t.integer and t.integer.ymm_row_lanes_min_k is not None}


def row_lanes_table(cpu_name: str, isa: str) -> dict[int, int]:
    """qtype -> the fewest tokens from which its matrices run in row lanes on this CPU and integer
    lowering: AVX-512 VNNI per CPU, avx2 from YMM_ROW_LANES_MIN_K, none on the other lowerings."""
    if isa == "avx2":
        return dict(YMM_ROW_LANES_MIN_K)
    if isa != "avx512vnni":
        return {}
    if cpu_name.startswith(ROW_LANES_ZEN_CPUS):
        return dict(ROW_LANES_MIN_K)
    return {qt: max(k, NON_ZEN_MIN_K) for qt, k in ROW_LANES_MIN_K.items()}


ROW_LANES_HOST = row_lanes_table(llvm.get_host_cpu_name(), ISA)
NEVER = 1 << 30
HOST_TOKEN_PASSES = token_passes(min(ROW_LANES_HOST.values(), default=NEVER))

# Whether a group's steps also prefetch the next group (a slice per step, into L2). On AMD Zen
# (LLVM's "znver*") 16 short rows read side by side stream from memory at ~60 % of the speed of
# one, while the linear read of the next group runs at full speed. On the Xeon of BENCHMARKS.md's
# "Mission size" section (LLVM: emeraldrapids) the same prefetches cost 20-25 % at 2-8 tokens
# (27B FFN shapes, Q4_K / Q6_K / Q8_0, 2 threads, from memory: Q4_K 5120 x 17408 k = 4 3.07 ->
# 2.29 ms, k = 8 4.06 -> 3.27): software prefetches hold line fill buffers there, so they cap the
# misses in flight that the hardware L2 streamer would otherwise keep going over the group's rows.
# Fixed at import like matvec_int's per-CPU tables: it enters the compiled kernels, whose on-disk
# cache is per CPU.
NEXT_GROUP_PREFETCH = llvm.get_host_cpu_name().startswith(ROW_LANES_ZEN_CPUS)


row_lanes_from = _max_k_lookup(ROW_LANES_HOST, "row_lanes_from", NEVER)   # ROW_LANES_HOST[qtype], else NEVER


@intrinsic
def row_lanes_dot(typingctx, qtype, n, w, r0, xq, xd, xs, t0, out, oc, cold):
    """out[t0 + u, oc + j] = (row r0 + j) . (activation row t0 + u) for j < 16, u < n (1..8).
    cold: nothing prefetched this group (the first of a run of groups): all its lines are asked
    for before its first step. Code only for the types of ROW_LANES_HOST (none on the lowerings but
    avx512vnni and avx2):
    for another it writes nothing. Unchecked: the caller validated shapes."""
    if not _c_2d(w, xq, xd, xs, out):
        return None
    qt_type, only = _qtype_arg(qtype)
    sig = types.void(qt_type, types.intp, w, types.intp, xq, xd, xs, types.intp, out, types.intp, types.boolean)

    def codegen(context, builder, signature, args):
        b = builder
        qt_, n_, w_, r0_, xq_, xd_, xs_, t0_, out_, oc_, cold_ = args
        done = b.append_basic_block("row_lanes.done")

        def emit(qt, kind, decode, nbytes):
            by_n = b.switch(n_, done)
            for n_toks in sorted(set(HOST_TOKEN_PASSES.values())):
                bb = b.append_basic_block(f"row_lanes.t{n_toks}")
                for n, t in HOST_TOKEN_PASSES.items():
                    if t == n_toks:
                        by_n.add_case(ir.Constant(ir.IntType(64), n), bb)
                b.position_at_end(bb)
                token_pass(qt, kind, decode, nbytes, n_toks)
                b.branch(done)
            b.position_at_end(b.append_basic_block("row_lanes.unreachable"))

        def token_pass(qt, kind, decode, nbytes, n_toks):
            wrows, rbs = zip(*[_weight_row(context, b, signature.args[2], w_, b.add(r0_, _c64(j)))
                               for j in range(ROW_LANES)])
            tok = _Tokens(context, b, signature.args[4:7], (xq_, xd_, xs_))
            last = b.sub(n_, _c64(1))
            toks = [b.add(t0_, b.select(b.icmp_signed("<", _c64(u), n_), _c64(u), last)) for u in range(n_toks)]
            trows = [tok.rows(t) for t in toks]
            n_steps = b.sdiv(rbs[0], _c64(nbytes))
            step_bytes = nbytes
            if kind != "k":         # block pairs, an odd last block a step of its own
                n_steps = b.sdiv(b.add(n_steps, _c64(1)), _c64(2))
                step_bytes = 2 * nbytes
            f32x16 = ir.VectorType(F32, 16)
            # the buffers allocated here, freed at the end (not entry-block allocas: ~5 KB per
            # type and pass size in every frame of block_dots' callers cost the fused layer
            # kernels' old paths ~1.5x, as matvec_int's two-phase buffers did: docs/history.md, 2026-11-24)
            sp = _intrinsic(b, "llvm.stacksave", I8.as_pointer(), [])
            ybuf = b.alloca(ir.ArrayType(f32x16, n_toks))
            ybuf.align = 64
            ybufs = [b.gep(ybuf, [ir.Constant(I32, 0), ir.Constant(I32, u)]) for u in range(n_toks)]
            for yb in ybufs:
                b.store(ir.Constant(f32x16, [0.0] * 16), yb, align=64)

            wbuf = None
            if kind == "k" and n_toks >= STAGE_MIN_TOKENS:
                p = b.alloca(ir.ArrayType(I8, 64 * 80))
                p.align = 64
                wbuf = b.bitcast(p, I8.as_pointer())

            # where NEXT_GROUP_PREFETCH: the next group's rows (16 rows further on: one contiguous
            # block) are prefetched into L2 a slice per step (see NEXT_GROUP_PREFETCH)
            group_bytes = b.mul(rbs[0], _c64(ROW_LANES))
            if NEXT_GROUP_PREFETCH:
                with b.if_then(cold_):
                    _loop(b, _c64(0), b.sdiv(b.add(group_bytes, _c64(63)), _c64(64)), [],
                          lambda j, _: prefetch(b, b.gep(wrows[0], [b.mul(j, _c64(64))]), locality=2) or [])
            next_group = b.gep(wrows[0], [group_bytes])
            slice_bytes = ROW_LANES * step_bytes

            def step(vbs, i, _):
                base = b.gep(next_group, [b.mul(i, _c64(slice_bytes))])
                lines = list(range(0, slice_bytes, 64)) if NEXT_GROUP_PREFETCH else []

                def prefetch_part(c):       # a quarter of the lines with each chunk
                    for line in lines[c * len(lines) // 4:(c + 1) * len(lines) // 4]:
                        prefetch(b, b.gep(base, [_c64(line)]), locality=2)
                ptrs = [b.gep(w, [b.mul(i, _c64(step_bytes))]) for w in wrows]     # the 16 rows' step i
                if kind == "k":
                    # this group's next step into L1 as well (its lines are in L2 by the slices
                    # above): on Zen 5 the 16 rows' loads at a step's start otherwise wait on L2, the
                    # transposes behind them (27B shapes: Q4_K k = 1 / 8 7-10 % faster, Q6_K k = 4
                    # 7-9 %; Q4_0's pairs k = 1 6 % slower, so theirs stay as they were; docs/history.md, 2026-11-26)
                    for p in ptrs:
                        for off in range(0, step_bytes, 64):
                            prefetch(b, b.gep(p, [_c64(step_bytes + off)]), locality=3)
                    st = lane_step(b, qt, vbs, ptrs)
                    _k_row_lanes(b, st, i, trows, ybufs, K_SUB[qt], wbuf, prefetch_part, i16_sum_dwords(qt))
                else:
                    pl = pair_lanes(b, qt, vbs, ptrs, vbs[0].n_blk, n_toks)
                    _pair_row_lanes(b, pl, i, trows, ybufs, prefetch_part, i16_sum_dwords(qt))
                return []
            _steps(b, kind, decode, nbytes, list(wrows), rbs[0], _c64(0), n_steps, [], step)
            O = _array(context, b, signature.args[8], out_)
            width = cgutils.unpack_tuple(b, O.shape, 2)[1]
            for u, yb in enumerate(ybufs):
                def store(u=u, yb=yb):
                    p = b.gep(O.data, [b.add(b.mul(toks[u], width), oc_)])
                    b.store(b.load(yb, align=64), b.bitcast(p, f32x16.as_pointer()), align=4)
                if u == 0:
                    store()
                else:
                    with b.if_then(b.icmp_signed("<", _c64(u), n_)):
                        store()
            _intrinsic(b, "llvm.stackrestore", ir.VoidType(), [sp])

        # only the types that run in row lanes on this host: the others' code (4 pass sizes, with
        # vpdpbusd emulated on the portable and avx2 lowerings) cost minutes of compile, never run
        _by_type(b, qt_, done, lambda qt, *spec: emit(qt, *spec) if qt in ROW_LANES_HOST else None, only)
        b.position_at_end(done)
        return context.get_dummy_value()
    return sig, codegen

"""The quant types as integer IR: each type's step decoder (a K-quant super-block, or a pair of
32-weight blocks, into unsigned weight bytes in element order and their scales), the loop over a
row's steps with its prefetches, and the dispatch over types. The kernels built on them: matvec_int
(register groups), matvec_tiled (token quads, token lanes) and matvec_rowlanes (16 rows in the lanes)."""
from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .formats import FORMATS, INT_DECODER, UnsupportedQuantType, int_kernel_of, type_name
from .matvec_kquants import q3_k_scales
from .matvec_simd import _array, _load_vec, _splat
from .quantize_act import QK_K, QK_LEGACY
from .simd_int import F32, I8, I16, I32, I64, IntBlockIR, _concat, lut16, prefetch


def _f32x2(b, x, y):
    v = b.insert_element(ir.Constant(ir.VectorType(F32, 2), ir.Undefined), x, ir.Constant(I32, 0))
    return b.insert_element(v, y, ir.Constant(I32, 1))


# --------------------------------------------------------------------------- K-quant decoders
# Each returns the super-block's weights in element order: 4 chunks of 64 unsigned bytes, the
# per-pair-lane scale vectors (i16 x 32) of each chunk, and the integer bsum coefficients.

class KBlock:
    """wide: weight bytes up to 255 (IQ4_XS's offset levels): raw sums of 4 products can exceed
    int16, so the kernels scale them in int32 (one multiply per chunk) instead of packing them for
    vpdpwssd, and avx2's dpbusd splits the bytes (as for Q8_0)."""

    def __init__(self, chunks, sc16, d, sub_sc, off16=None, min16=None, negdmin=None, wide=False):
        self.chunks, self.sc16, self.d, self.off16, self.min16, self.negdmin = chunks, sc16, d, off16, min16, negdmin
        self.sub_sc = sub_sc        # the sub-block scales in order, i16 x 8 (32-weight) or x 16 (16-weight)
        self.wide = wide

    def sc32(self, v, c):
        """Chunk c's scales as i32 x 16, lane j that of raw-sum lane j (elements 4j .. 4j + 3)."""
        return v.b.sext(v.shuf(self.sc16[c], [2 * j for j in range(16)]), ir.VectorType(I32, 16))


def _sc16_per_16(v, sc16):
    """Chunk c's pair lanes take sub-blocks 4c .. 4c+3, 8 lanes each: 16-weight sub-blocks."""
    return [v.shuf(sc16, [4 * c + i // 8 for i in range(32)]) for c in range(4)]


def _k_scales_mins16(v):
    """Q4_K / Q5_K's 8 six-bit (scale, min) pairs (12 bytes at 4) as i16 x 16: scales in lanes
    0-7, mins in 8-15 (layout in matvec_kquants.k_scales_mins), unpacked in 16-bit lanes with two
    byte shuffles: about 6 vector instructions, the 4 chunk scale vectors and the mins one
    permute each."""
    x = v.bytes(4, 16)
    zero = v.zeros(I8, 16)

    def words(low_bytes):           # i16 lanes holding these bytes of x (None: 0)
        idx = []
        for j in low_bytes:
            idx += [16 if j is None else j, 16]
        return v.b.bitcast(v.shuf(x, idx, zero), ir.VectorType(I16, 16))
    # j < 4: sc = q[j] & 63, m = q[j+4] & 63; j >= 4: sc = q[j+4] & 15 | (q[j-4] >> 6) << 4,
    # m = q[j+4] >> 4 | (q[j] >> 6) << 4
    low = words([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11])
    low = v.band(v.bshr(low, [0] * 12 + [4] * 4), [63] * 4 + [15] * 4 + [63] * 4 + [15] * 4)
    high = words([None] * 4 + [0, 1, 2, 3] + [None] * 4 + [4, 5, 6, 7])
    return v.b.or_(low, v.band(v.bshr(high, 2), 0x30))


def _k_block_32(v, chunks, scm):
    """A Q4_K / Q5_K super-block: 32-weight sub-blocks, 8 scales and 8 mins in scm."""
    return KBlock(chunks, [v.shuf(scm, [2 * c] * 16 + [2 * c + 1] * 16) for c in range(4)], v.f16(0),
                  v.shuf(scm, list(range(8))), min16=v.shuf(scm, [8 + g // 2 for g in range(16)]),
                  negdmin=v.fneg(v.f16(2)))


def _q4_k(v):
    # d @0, dmin @2, scales @4, qs[128] @16: byte 32c + l holds element 64c + l (low nibble) and
    # 64c + 32 + l (high): chunk c is those 32 bytes in both halves, shifted by 0 and by 4
    return _k_block_32(v, [v.halves(16 + 32 * c, (0, 4), 15) for c in range(4)], _k_scales_mins16(v))


def _q5_k(v):
    # as Q4_K with qh[32] @16 (bit j of qh[l]: 5th bit of element l of sub-block j), qs @48
    chunks = []
    for c in range(4):
        fifth = v.bshl(v.halves(16, (2 * c, 2 * c + 1), 1), 4)
        chunks.append(v.b.or_(v.halves(48 + 32 * c, (0, 4), 15), fifth))
    return _k_block_32(v, chunks, _k_scales_mins16(v))


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
    return KBlock(chunks, _sc16_per_16(v, sc), v.f16(208), sc, off16=v.bmul(sc, -32))


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
    return KBlock(chunks, _sc16_per_16(v, sc), v.f16(108), sc, off16=v.bmul(sc, -4))


def _q2_k(v):
    # scales[16] @0 (low nibble scale, high nibble min, per 16 weights), qs[64] @16, d @80,
    # dmin @82. Element 128h + 32s + l: bits 2s of qs[32h + l].
    sm = v.u8(0, 16)
    chunks = []
    for h in range(2):
        qs = v.bytes(16 + 32 * h, 32)
        quarters = [v.band(v.bshr(qs, 2 * s), 3) for s in range(4)]
        chunks += [v.concat(quarters[0], quarters[1]), v.concat(quarters[2], quarters[3])]
    sc = v.i16(v.and_(sm, 15))
    return KBlock(chunks, _sc16_per_16(v, sc), v.f16(80), sc, min16=v.i16(v.shr(sm, 4)), negdmin=v.fneg(v.f16(82)))


# IQ4_NL / IQ4_XS: 4-bit indices into 16 non-linear signed levels, looked up (vpshufb) as the level
# + 128, an unsigned byte for vpdpbusd; the 128 is taken off with the activation block sums.
IQ4_OFFSET_LEVELS = [x + 128 for x in (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)]


def _iq4_xs(v):
    # d @0, scales_h (u16) @2, scales_l[4] @4, qs[128] @8. Sub-block j (32 weights): scale
    # (low nibble j of scales_l | bits 2j of scales_h << 4) - 32; its 16 bytes at 8 + 16 j hold
    # elements 32j + l (low nibble) and 32j + 16 + l (high).
    low = v.and_(v.shr(v.shuf(v.u8(4, 4), [0, 0, 1, 1, 2, 2, 3, 3]), [0, 4] * 4), 15)
    high = v.and_(v.shr(v.splat(v.u32(2), 8), [2 * j for j in range(8)]), 3)     # bits 0-15: scales_h
    sc8 = v.i16(v.add(v.b.or_(low, v.shl(high, 4)), -32))
    chunks = [lut16(v.b, v.concat(_nibbles32(v, 8 + 32 * c), _nibbles32(v, 24 + 32 * c)), IQ4_OFFSET_LEVELS)
              for c in range(4)]
    return KBlock(chunks, [v.shuf(sc8, [2 * c] * 16 + [2 * c + 1] * 16) for c in range(4)], v.f16(0), sc8,
                  off16=v.bmul(v.shuf(sc8, [g // 2 for g in range(16)]), -128), wide=True)


# --------------------------------------------------------------------------- legacy decoders
# Each takes n_blk = 2 (a pair of blocks) or 1 (the odd last block: the second half is zeros)
# and returns 64 unsigned weight bytes, the block scales per lane, the integer offset and the
# per-block mins (lanes 0 and 8).

class PairBlock:
    def __init__(self, w, d2, off=0, m2=None, wide=False):
        self.w, self.d2, self.off, self.m2, self.wide = w, d2, off, m2, wide


def _dm_pair(v, block_bytes):
    """(d2, m2) of a full pair of a type whose blocks start with d, m (f16): one load of the step's
    first 32 bytes (inside it: a block is >= 20 bytes), the four halves picked and converted at
    once. One at a time (scalar load, conversion, insert: ~4 instructions each) they cost Q4_1 ~7 %
    more at k = 1; the same for d alone measured slower for the types without a min."""
    b = v.b
    assert 2 * block_bytes >= 32 and block_bytes + 4 <= 32 and block_bytes % 2 == 0
    words = _load_vec(b, v.base, I16, 16, 1)
    h = block_bytes // 2
    pick = b.shuffle_vector(words, ir.Constant(words.type, ir.Undefined), ir.Constant(ir.VectorType(I32, 4), [0, h, 1, h + 1]))
    f = b.fpext(b.bitcast(pick, ir.VectorType(ir.HalfType(), 4)), ir.VectorType(F32, 4))
    undef = ir.Constant(f.type, ir.Undefined)
    return (b.shuffle_vector(f, undef, ir.Constant(ir.VectorType(I32, 2), [0, 1])),
            b.shuffle_vector(f, undef, ir.Constant(ir.VectorType(I32, 2), [2, 3])))


def _pair(v, n_blk, block_bytes, one_block, off=0, with_min=False, wide=False):
    """Assemble a PairBlock from one_block(v, byte_off) -> (32 weight bytes, d, m) (a full pair
    with mins takes its d and m from _dm_pair: one_block's then compile away)."""
    b = v.b
    parts = [one_block(v, j * block_bytes) for j in range(n_blk)]
    zero = ir.Constant(F32, 0.0)
    if n_blk == 1:
        parts.append((v.zeros(I8, 32), zero, zero))
    w = v.concat(parts[0][0], parts[1][0])
    if with_min and n_blk == 2:
        d2, m2 = _dm_pair(v, block_bytes)
        return PairBlock(w, d2, off, m2, wide)
    d2 = _f32x2(b, parts[0][1], parts[1][1])
    m2 = _f32x2(b, parts[0][2], parts[1][2]) if with_min else None
    return PairBlock(w, d2, off, m2, wide)


def _nibbles32(v, off):
    """A 32-weight block's 16 nibble bytes in element order: low nibbles, then high nibbles (the
    16 bytes in both halves, shifted per half: a block pair's two become one vector op each)."""
    q = v.bytes(off, 16)
    w = v.b.bitcast(v.concat(q, q), ir.VectorType(I16, 16))
    return v.band(v.b.bitcast(v.bshr(w, [0] * 8 + [4] * 8), ir.VectorType(I8, 32)), 15)


def _fifth_bits(v, off):
    """Bit j of the u32 at off as the 5th bit (16) of byte lane j, j < 32: the word as a lane mask
    selecting 16 (AVX-512: one kmov and one zero-masked byte move, where shifting the word into 32
    dword lanes and narrowing them took ~10 instructions a block and made Q5_0 / Q5_1 decode-bound
    at half Q4_0's speed)."""
    mask = v.b.bitcast(v.u32(off), ir.VectorType(ir.IntType(1), 32))
    return v.b.select(mask, v.bconst(16, 32), v.zeros(I8, 32))


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


def _iq4_nl(v, n_blk):
    return _pair(v, n_blk, 18, lambda v, o: (lut16(v.b, _nibbles32(v, o + 2), IQ4_OFFSET_LEVELS), v.f16(o), None),
                 off=-128, wide=True)


def _q8_0(v, n_blk):
    # int8 weights as offset bytes w + 128 (vpdpbusd's unsigned side), the 128 taken off with bs32
    return _pair(v, n_blk, 34, lambda v, o: (v.bxor(v.bytes(o + 2, 32), 0x80), v.f16(o), None), off=-128, wide=True)


# --------------------------------------------------------------------------- the row kernel

# qtype -> (family, decoder, block bytes) of the types with an integer kernel (formats.QUANT_TYPES:
# _<kernel> above): a K step is one super-block, a legacy ("pair") step two blocks.
SPECS = {qt: (FORMATS[qt].integer.family, decode, FORMATS[qt].block_bytes)
         for qt, decode in INT_DECODER.bind(globals()).items()}
INT_TYPES = frozenset(SPECS)


def act_block(qtype: int) -> int:
    """The activation block (256 or 32) the integer kernel of `qtype` reads."""
    return int_kernel_of(qtype).act_block


def steps_per_row(qtype: int, row_bytes: int) -> int:
    """Steps of a weight row: super-blocks (K-quants) or pairs of blocks, the odd last one a step."""
    kind, _, nbytes = SPECS[int(qtype)]
    n = row_bytes // nbytes
    return n if kind == "k" else (n + 1) // 2


def _c64(x):
    return ir.Constant(I64, x)


def _bcast_dword(b, ptr, byte_off, elty, n):
    """The 4 bytes at ptr + byte_off in every dword of an <n x elty> vector (a load-port broadcast)."""
    x = b.load(b.bitcast(b.gep(ptr, [_c64(byte_off)]) if byte_off else ptr, I32.as_pointer()), align=1)
    return b.bitcast(_splat(b, x, 16), ir.VectorType(elty, n))


# K-quant sub-block (weights sharing one scale): 32 for Q4_K / Q5_K, 16 for the others
K_SUB = {qt: FORMATS[qt].integer.sub_block for qt, (kind, _, _) in SPECS.items() if kind == "k"}


def _concat_all(b, vecs):
    """One vector of vecs' lanes in order (a power of two of equal vectors)."""
    while len(vecs) > 1:
        vecs = [_concat(b, vecs[j], vecs[j + 1]) for j in range(0, len(vecs), 2)]
    return vecs[0]


def _decoded(vb):
    return vb() if callable(vb) else vb


def _opaque(b, ptr):
    """ptr through an empty asm: LLVM can no longer see it is the stack buffer just written, so it
    neither forwards the stores (building each broadcast with shuffles) nor hoists the broadcasts
    out of the loop over token vectors (spilling 64 of them and reloading each as a 64-byte vector):
    each stays one 4-byte broadcast load."""
    return b.call(ir.InlineAsm(ir.FunctionType(ptr.type, [ptr.type]), "", "=r,0"), [ptr])


# --------------------------------------------------------------------------- the row kernels

class _Tokens:
    """Data pointers and row widths of the three activation arrays: the rows of any token (or
    token vector, for the transposed arrays)."""

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


PREFETCH_BYTES = 1024    # how far ahead of a step each weight stream is prefetched


def _prefetch_ahead(b, wrows, off, start, end, nxt, step_bytes):
    """Prefetch, for each weight stream, the step PREFETCH_BYTES past byte `off` of its row; a
    stream reads bytes start .. end and the kernel then reads on at byte `nxt` of the same row
    pointer (the next pass's row, or the next row's chunk), so the lookahead runs on there. It
    is at most one stream long: a chunk shorter than that (the tiled kernels' many-token passes)
    looks ahead into the next row's chunk only, not into a chunk needed a whole pass later."""
    dist = b.sub(end, start)
    dist = b.select(b.icmp_signed("<", dist, _c64(PREFETCH_BYTES)), dist, _c64(PREFETCH_BYTES))
    t = b.add(off, dist)
    t = b.select(b.icmp_signed("<", t, end), t, b.add(b.sub(t, end), nxt))
    for wrow in wrows:
        for line in range(0, step_bytes, 64):
            prefetch(b, b.gep(wrow, [b.add(t, _c64(line))]))


def _steps(b, kind, decode, nbytes, wrows, rb, i0, i1, init, apply, nxt=None):
    """Steps i0 .. i1-1 of the weight rows wrows: state = apply(vbs, i, state), vbs[r] row r's
    step i as a function emitting its decoder (returns (v, blk); emitted once, where first used).
    A legacy row of an odd number of blocks ends in a step of one block (the other half zeros).
    nxt: where (bytes from each row pointer) the kernel reads next after step i1 - 1: the
    streams are prefetched ahead, across that jump."""
    step_bytes = nbytes if kind == "k" else 2 * nbytes

    def step(i, state, n_blk):
        if nxt is not None:
            _prefetch_ahead(b, wrows, b.mul(i, _c64(step_bytes)), b.mul(i0, _c64(step_bytes)),
                            b.mul(i1, _c64(step_bytes)), nxt, step_bytes)
        def decoder(wrow):
            done = []

            def vb():
                if not done:
                    if kind == "k":
                        v = IntBlockIR(b, b.gep(wrow, [b.mul(i, _c64(nbytes))]), None)
                        done.append((v, decode(v)))
                    else:
                        v = IntBlockIR(b, b.gep(wrow, [b.mul(i, _c64(2 * nbytes))]), None)
                        done.append((v, decode(v, n_blk)))
                return done[0]
            vb.n_blk = n_blk        # a legacy step's blocks: 2, or 1 for an odd last block
            return vb
        return apply([decoder(w) for w in wrows], i, state)

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


def types_tag(qtypes) -> tuple:
    """A set of quant types as a compile-time constant: one element per type of SPECS (ascending),
    True where the type is in the set, 0.0 where not (a flat tuple: parallel loops cannot take
    nested ones). A kernel that picks a matrix's type at run time passes (qtype,) + types_tag(...)
    where the intrinsics take a qtype, and compiles only the set's decoders."""
    chosen = {int(q) for q in qtypes}
    return tuple(True if qt in chosen else 0.0 for qt in sorted(SPECS))


def _qtype_arg(qtype):
    """The intrinsics' type for the qtype argument, and what to emit code for: the one type of a
    type_tag, the set of a (qtype,) + types_tag tuple, or None (a plain int: every type in SPECS).
    The tag of a type without an integer kernel fails typing, naming the type."""
    if isinstance(qtype, types.UniTuple) and isinstance(qtype.dtype, types.Integer):
        if qtype.count not in SPECS:
            raise UnsupportedQuantType(f"{type_name(qtype.count)} has no integer kernel")
        return qtype, qtype.count
    if isinstance(qtype, types.BaseTuple) and len(qtype) == 1 + len(SPECS) and isinstance(qtype[0], types.Integer):
        return qtype, frozenset(qt for qt, ty in zip(sorted(SPECS), qtype[1:]) if isinstance(ty, types.Boolean))
    return types.int64, None


def _by_type(b, qtype, done, emit, only=None):
    """switch over SPECS on qtype; emit(qt, kind, decode, nbytes) writes each case's code. With
    `only` a compile-time type, just that type's code; a set, the switch over its types only (a
    type outside it writes nothing, as one outside SPECS)."""
    if isinstance(only, int):
        if only not in SPECS:
            raise UnsupportedQuantType(f"{type_name(only)} has no integer kernel")
        emit(only, *SPECS[only])
        b.branch(done)
        return
    if only is not None:
        qtype = b.extract_value(qtype, 0)
    by_type = b.switch(qtype, done)
    for qt, spec in SPECS.items():
        if only is not None and qt not in only:
            continue
        bb = b.append_basic_block(f"int.t{qt}")
        by_type.add_case(ir.Constant(I64, qt), bb)
        b.position_at_end(bb)
        emit(qt, *spec)
        b.branch(done)


def _c_2d(*arrays):
    return all(isinstance(a, types.Array) and a.layout == "C" and a.ndim == 2 for a in arrays)


def _max_k_lookup(table: dict[int, int], name: str, absent: int = 0):
    """An intrinsic name(qtype): table[qtype] (`absent` where absent), a constant for one type's tag, a
    select chain for a set or a plain int."""
    def lookup(typingctx, qtype):
        qt_type, only = _qtype_arg(qtype)
        sig = types.intp(qt_type)

        def codegen(context, builder, signature, args):
            if isinstance(only, int):
                return _c64(table.get(only, absent))
            q = args[0] if only is None else builder.extract_value(args[0], 0)
            out = _c64(absent)
            for qt, k in table.items():
                if only is None or qt in only:
                    out = builder.select(builder.icmp_signed("==", q, _c64(qt)), _c64(k), out)
            return out
        return sig, codegen
    lookup.__name__ = name
    return intrinsic(lookup)


GROUPS_PER_THREAD = 4


def n_row_groups(rows: int) -> int:
    """Parallel work items of a matvec call: a few per thread so a slow core does not hold up the call."""
    return max(1, min(rows, GROUPS_PER_THREAD * numba.get_num_threads()))

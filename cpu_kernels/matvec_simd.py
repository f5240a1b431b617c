"""Explicit SIMD building blocks for the k-input matvec, written as LLVM IR through Numba intrinsics.

Why IR and not plain Numba loops: a Numba block decoder reads uint8 and writes float32 through two
pointers LLVM cannot prove distinct, so after it fully unrolls a 32-element loop it leaves it scalar
(measured: one `vcvtsi2ss` per weight). And a dot product left to the loop vectoriser gets a lane
count and interleave that depend on the surrounding loop, so a token could sum in a different order
inside a batch of 3 than alone. Here every vector op is spelled out:

- lane decoders turn 16 or 32 quantized weights into float32 with one wide load per field;
- `dot_tile_<T>` multiplies R decoded weight rows by T activation rows with 16-lane `llvm.fma`
  accumulators (one per (token, row) pair) and a fixed halving-tree reduction, so the arithmetic of
  one (token, row) pair is the same instruction sequence whatever T is and whoever else is in the
  tile: that is the bit identity across k that greedy speculative parity needs.

Generic LLVM vector IR only (no target intrinsics): it lowers to AVX-512/AVX2/NEON as available.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

TILE_ROWS = 4      # R: weight rows decoded together and sharing every activation load
LANES = 16         # accumulator width; also the granularity of a dot (chunks are multiples of it)

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()
_F16 = ir.HalfType()


def _array(context, builder, aryty, value):
    return context.make_array(aryty)(context, builder, value=value)


def _byte_ptr(context, builder, aryty, value, byte_off):
    """i8* to element `byte_off` of a uint8 array (unchecked: callers index inside the row)."""
    data = _array(context, builder, aryty, value).data
    return builder.gep(data, [byte_off])


def _splat(builder, scalar, n):
    vty = ir.VectorType(scalar.type, n)
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _fma(builder, a, b, c):
    """a * b + c rounded once (llvm.fma on vectors: llvmlite's builder.fma takes scalars only)."""
    vty = a.type
    name = f"llvm.fma.v{vty.count}f32"
    fn = builder.module.globals.get(name)
    if fn is None:
        fn = ir.Function(builder.module, ir.FunctionType(vty, [vty, vty, vty]), name=name)
    return builder.call(fn, [a, b, c])


def _load_vec(builder, ptr, elty, n, align):
    return builder.load(builder.bitcast(ptr, ir.VectorType(elty, n).as_pointer()), align=align)


# ---------------------------------------------------------------------------------------------
# scalar loads of block headers


@intrinsic
def load_f16(typingctx, src, off):
    """The float16 at byte `off` of a uint8 array, as float32 (exact, subnormals and inf included)."""
    sig = types.float32(src, types.intp)

    def codegen(context, builder, signature, args):
        p = _byte_ptr(context, builder, signature.args[0], args[0], args[1])
        h = builder.load(builder.bitcast(p, _F16.as_pointer()), align=1)
        return builder.fpext(h, _F32)
    return sig, codegen


@intrinsic
def f16_bits_to_f32(typingctx, bits):
    """The float16 whose bits are the uint16 `bits`, as float32 (exact): how a float16 KV cache,
    kept as uint16 (Numba has no float16 on the CPU), is read."""
    if bits != types.uint16:
        return None
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], _F16), _F32)
    return sig, codegen


@intrinsic
def f32_to_f16_bits(typingctx, x):
    """float32 x rounded to float16 (to nearest, ties to even; inf past +-65504, as torch's
    .half()), returned as its uint16 bits."""
    if x != types.float32:
        return None
    sig = types.uint16(x)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], _F16), _I16)
    return sig, codegen


@intrinsic
def load_bf16(typingctx, src, off):
    """The bfloat16 at byte `off` of a uint8 array, as float32."""
    sig = types.float32(src, types.intp)

    def codegen(context, builder, signature, args):
        p = _byte_ptr(context, builder, signature.args[0], args[0], args[1])
        h = builder.load(builder.bitcast(p, _I16.as_pointer()), align=1)
        bits = builder.shl(builder.zext(h, _I32), ir.Constant(_I32, 16))
        return builder.bitcast(bits, _F32)
    return sig, codegen


@intrinsic
def load_f32(typingctx, src, off):
    """The float32 at byte `off` of a uint8 array (any alignment)."""
    sig = types.float32(src, types.intp)

    def codegen(context, builder, signature, args):
        p = _byte_ptr(context, builder, signature.args[0], args[0], args[1])
        return builder.load(builder.bitcast(p, _F32.as_pointer()), align=1)
    return sig, codegen


# ---------------------------------------------------------------------------------------------
# block decoders: one quantized block -> float32, as straight-line vector code


class BlockIR:
    """Vector IR helpers for writing one block decoder: integer lanes are i32, weights float32.

    `base` points at the block's first byte, `out` at its first float32 output. Emitters load every
    field they need before the first store: the loads then cannot be ordered after a store through
    `out`, which LLVM must assume may alias the source bytes.
    """

    def __init__(self, builder, base, out):
        self.b, self.base, self.out = builder, base, out

    def _vec_const(self, value, n):
        values = list(value) if isinstance(value, (list, tuple)) else [value] * n
        return ir.Constant(ir.VectorType(_I32, n), values)

    def u8(self, off, n):
        """n consecutive unsigned bytes at base + off."""
        p = self.b.gep(self.base, [ir.Constant(_I64, off)])
        return self.b.zext(_load_vec(self.b, p, _I8, n, 1), ir.VectorType(_I32, n))

    def s8(self, off, n):
        p = self.b.gep(self.base, [ir.Constant(_I64, off)])
        return self.b.sext(_load_vec(self.b, p, _I8, n, 1), ir.VectorType(_I32, n))

    def u32(self, off):
        p = self.b.gep(self.base, [ir.Constant(_I64, off)])
        return self.b.load(self.b.bitcast(p, _I32.as_pointer()), align=1)

    def f16(self, off):
        p = self.b.gep(self.base, [ir.Constant(_I64, off)])
        return self.b.fpext(self.b.load(self.b.bitcast(p, _F16.as_pointer()), align=1), _F32)

    def and_(self, a, m):
        return self.b.and_(a, self._vec_const(m, a.type.count))

    def shr(self, a, s):
        return self.b.lshr(a, self._vec_const(s, a.type.count)) if s else a

    def shl(self, a, s):
        return self.b.shl(a, self._vec_const(s, a.type.count)) if s else a

    def add(self, a, c):
        """a + c, c a vector or an int constant."""
        return self.b.add(a, c if isinstance(c, ir.Value) else self._vec_const(c, a.type.count))

    def or_(self, a, c):
        return self.b.or_(a, c)

    def shuf(self, a, idx, other=None):
        """Lanes of a (or of a ++ other when given) in the order idx."""
        other = ir.Constant(a.type, ir.Undefined) if other is None else other
        return self.b.shuffle_vector(a, other, ir.Constant(ir.VectorType(_I32, len(idx)), list(idx)))

    def bits_of(self, word, first, n):
        """Lane j: bit (first + j) of the i32 `word`."""
        v = self.b.lshr(_splat(self.b, word, n), self._vec_const([first + j for j in range(n)], n))
        return self.and_(v, 1)

    def to_f32(self, a):
        return self.b.sitofp(a, ir.VectorType(_F32, a.type.count))

    def splat(self, x, n):
        return _splat(self.b, x, n)

    def lanes(self, v, idx):
        """Float lanes of v in the order idx (e.g. [i] * 32 broadcasts lane i)."""
        return self.shuf(v, idx)

    def fmul(self, a, b):
        return self.b.fmul(a, b)

    def fneg(self, a):
        return self.b.fneg(a)

    def fma(self, a, b, c):
        return _fma(self.b, a, b, c)

    def store(self, elem_off, v):
        p = self.b.gep(self.out, [ir.Constant(_I64, elem_off)])
        self.b.store(v, self.b.bitcast(p, v.type.as_pointer()), align=4)


def block_decoder(emit):
    """Wrap `emit(BlockIR)` as an intrinsic `(src u8[::1], src_off, dst f32[::1], dst_off)`.

    It decodes the block at src[src_off:] into dst[dst_off:]; offsets are not bounds-checked.
    """
    @intrinsic
    def decode_block(typingctx, src, src_off, dst, dst_off):
        if src.layout != "C" or dst.layout != "C":
            return None
        sig = types.void(src, types.intp, dst, types.intp)

        def codegen(context, builder, signature, args):
            base = _byte_ptr(context, builder, signature.args[0], args[0], args[1])
            out = builder.gep(_array(context, builder, signature.args[2], args[2]).data, [args[3]])
            emit(BlockIR(builder, base, out))
            return context.get_dummy_value()
        return sig, codegen

    decode_block.__doc__ = emit.__doc__
    return decode_block


def _make_float_row_decoder(kind: str):
    """16 consecutive F32/F16/BF16 weights at byte offset -> float32 dst (no scale)."""
    vf32 = ir.VectorType(_F32, LANES)

    @intrinsic
    def decode_floats(typingctx, src, src_off, dst, dst_off):
        sig = types.void(src, types.intp, dst, types.intp)

        def codegen(context, builder, signature, args):
            src_v, src_off_v, dst_v, dst_off_v = args
            p = _byte_ptr(context, builder, signature.args[0], src_v, src_off_v)
            if kind == "f32":
                y = _load_vec(builder, p, _F32, LANES, 1)
            elif kind == "f16":
                y = builder.fpext(_load_vec(builder, p, _F16, LANES, 1), vf32)
            else:  # bf16: the top half of a float32
                bits = builder.zext(_load_vec(builder, p, _I16, LANES, 1), ir.VectorType(_I32, LANES))
                bits = builder.shl(bits, ir.Constant(ir.VectorType(_I32, LANES), [16] * LANES))
                y = builder.bitcast(bits, vf32)
            out = builder.gep(_array(context, builder, signature.args[2], dst_v).data, [dst_off_v])
            builder.store(y, builder.bitcast(out, vf32.as_pointer()), align=4)
            return context.get_dummy_value()
        return sig, codegen

    return decode_floats


decode_f32x16 = _make_float_row_decoder("f32")
decode_f16x16 = _make_float_row_decoder("f16")
decode_bf16x16 = _make_float_row_decoder("bf16")


# ---------------------------------------------------------------------------------------------
# the dot micro-kernel


def _reduce_tree(builder, v, n):
    """Sum of the n lanes of v by halving (lanes i and i + n/2 first): a fixed order."""
    while n > 1:
        half = n // 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half), list(range(half))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half), list(range(half, n))))
        v = builder.fadd(lo, hi)
        n = half
    return builder.extract_element(v, ir.Constant(_I32, 0)) if isinstance(v.type, ir.VectorType) else v


def _make_dot_tile(n_tokens: int, n_rows: int = TILE_ROWS):
    """`dot_tile(wbuf f32[R, C], x f32[k, n], t0, c0, length, part f32[::1])`.

    part[t * R + r] = sum over i < length of wbuf[r, i] * x[t0 + t, c0 + i], for t < n_tokens and
    r < R. `length` must be a positive multiple of LANES. Accumulators are 16-lane vectors updated
    by fma in index order, reduced by `_reduce_tree`: per (t, r) the same operations for any
    n_tokens, so a token's result does not depend on which tile it was computed in.
    """
    vf = ir.VectorType(_F32, LANES)

    @intrinsic
    def dot_tile(typingctx, wbuf, x, t0, c0, length, part):
        if wbuf.layout != "C" or x.layout != "C" or part.layout != "C":
            return None     # rows are addressed as data + row * n_cols
        sig = types.void(wbuf, x, types.intp, types.intp, types.intp, part)

        def codegen(context, builder, signature, args):
            wbuf_v, x_v, t0_v, c0_v, len_v, part_v = args
            W = _array(context, builder, signature.args[0], wbuf_v)
            X = _array(context, builder, signature.args[1], x_v)
            P = _array(context, builder, signature.args[5], part_v)
            w_cols = cgutils.unpack_tuple(builder, W.shape, 2)[1]
            x_cols = cgutils.unpack_tuple(builder, X.shape, 2)[1]
            w_rows = [builder.gep(W.data, [builder.mul(ir.Constant(_I64, r), w_cols)]) for r in range(n_rows)]
            x_rows = [builder.gep(X.data, [builder.add(builder.mul(builder.add(t0_v, ir.Constant(_I64, t)), x_cols), c0_v)])
                      for t in range(n_tokens)]

            entry = builder.basic_block
            loop = builder.append_basic_block("dot.loop")
            done = builder.append_basic_block("dot.done")
            builder.branch(loop)

            builder.position_at_end(loop)
            i = builder.phi(_I64)
            i.add_incoming(ir.Constant(_I64, 0), entry)
            acc = [[builder.phi(vf) for _ in range(n_rows)] for _ in range(n_tokens)]
            for row in acc:
                for a in row:
                    a.add_incoming(ir.Constant(vf, [0.0] * LANES), entry)
            ws = [_load_vec(builder, builder.gep(p, [i]), _F32, LANES, 4) for p in w_rows]
            xs = [_load_vec(builder, builder.gep(p, [i]), _F32, LANES, 4) for p in x_rows]
            new = [[_fma(builder, ws[r], xs[t], acc[t][r]) for r in range(n_rows)] for t in range(n_tokens)]
            i_next = builder.add(i, ir.Constant(_I64, LANES))
            i.add_incoming(i_next, loop)
            for t in range(n_tokens):
                for r in range(n_rows):
                    acc[t][r].add_incoming(new[t][r], loop)
            builder.cbranch(builder.icmp_signed("<", i_next, len_v), loop, done)

            builder.position_at_end(done)
            for t in range(n_tokens):
                for r in range(n_rows):
                    s = _reduce_tree(builder, new[t][r], LANES)
                    builder.store(s, builder.gep(P.data, [ir.Constant(_I64, t * n_rows + r)]))
            return context.get_dummy_value()
        return sig, codegen

    return dot_tile


dot_tile_1 = _make_dot_tile(1)
dot_tile_2 = _make_dot_tile(2)
dot_tile_3 = _make_dot_tile(3)
dot_tile_4 = _make_dot_tile(4)


@intrinsic
def dot_f32(typingctx, a, b):
    """sum_i a[i] * b[i] of two contiguous vectors of equal length, a float32, b float32 or float16
    bits (uint16: a float16 KV cache row, each value widened exactly), in a fixed order: 16-lane fma
    accumulators over the first n - n % 16 elements (lane j takes i = j mod 16), reduced by
    `_reduce_tree`, then the tail added one product at a time. As fast as a reassociated loop, but
    the same bits in every caller and every compilation (the loop vectoriser's choice of lanes would
    differ between, say, a cached kernel and a fresh one)."""
    def c_1d(dtype):
        return (types.Array(dtype, 1, "C"), types.Array(dtype, 1, "C", readonly=True))
    if a not in c_1d(types.float32) or b not in c_1d(types.float32) + c_1d(types.uint16):
        return None
    sig = types.float32(a, b)
    vf = ir.VectorType(_F32, LANES)
    half = b.dtype == types.uint16

    def load_b(builder, ptr, n):
        if not half:
            return _load_vec(builder, ptr, _F32, n, 4) if n > 1 else builder.load(ptr)
        if n == 1:
            return builder.fpext(builder.bitcast(builder.load(ptr), _F16), _F32)
        h = builder.bitcast(_load_vec(builder, ptr, _I16, n, 2), ir.VectorType(_F16, n))
        return builder.fpext(h, ir.VectorType(_F32, n))

    def codegen(context, builder, signature, args):
        av = _array(context, builder, signature.args[0], args[0])
        bv = _array(context, builder, signature.args[1], args[1])
        n = cgutils.unpack_tuple(builder, av.shape)[0]
        n_chunks = builder.udiv(n, ir.Constant(n.type, LANES))
        acc = cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * LANES))
        with cgutils.for_range(builder, n_chunks) as loop:
            i = builder.mul(loop.index, ir.Constant(n.type, LANES))
            va = _load_vec(builder, builder.gep(av.data, [i]), _F32, LANES, 4)
            vb = load_b(builder, builder.gep(bv.data, [i]), LANES)
            builder.store(_fma(builder, va, vb, builder.load(acc)), acc)
        s = cgutils.alloca_once_value(builder, _reduce_tree(builder, builder.load(acc), LANES))
        done = builder.mul(n_chunks, ir.Constant(n.type, LANES))
        with cgutils.for_range(builder, builder.sub(n, done)) as loop:
            i = builder.add(done, loop.index)
            prod = builder.fmul(builder.load(builder.gep(av.data, [i])), load_b(builder, builder.gep(bv.data, [i]), 1))
            builder.store(builder.fadd(builder.load(s), prod), s)
        return builder.load(s)
    return sig, codegen

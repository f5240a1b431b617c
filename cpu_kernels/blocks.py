"""Per-block decoders for every GGUF type hybridrt reads, bit-identical to gguf-py's dequantize.

Every decoder has the same signature, so callers can pick one per tensor and loop over blocks:

    decode_<type>(src: uint8[::1], off: int, out: float32[::1], out_off: int) -> None

It decodes the block whose bytes start at src[off] into out[out_off : out_off + block_elems].
F32, F16 and BF16 "blocks" are one element; `decode_row` decodes a row block by block.

Bit-exactness with gguf-py (numpy, float32 throughout): each value is computed with the same
float32 operations in the same order, e.g. Q4_K is (d*sc)*q - (dmin*m), Q4_1 is d*q + m. Integers
are converted to float32 before they meet a float32, because Numba would otherwise widen to float64.
No fastmath, so LLVM never contracts a*b+c into an FMA.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from .formats import FORMATS, ROW_DECODER

# The 16 non-linear levels of IQ4_NL / IQ4_XS (ggml's kvalues_iq4nl).
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                      dtype=np.int8)


@intrinsic
def bits_to_f32(typingctx, bits):
    """Reinterpret the low 32 bits of an integer as a float32 (keeps NaN payloads)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = args[0]
        width = v.type.width
        if width > 32:
            v = builder.trunc(v, ir.IntType(32))
        elif width < 32:
            v = builder.zext(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def f32_to_bits(typingctx, x):
    """The IEEE bits of a float32, as uint32."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(x), codegen


@njit(cache=True, inline="always")
def f16_bits_to_f32_bits(h):
    """IEEE half -> single bit pattern, exact (numpy's conversion: subnormals normalised, NaN payload kept)."""
    h = np.uint32(h)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exp = (h >> np.uint32(10)) & np.uint32(0x1F)
    mant = h & np.uint32(0x3FF)
    if exp == 0x1F:
        return sign | np.uint32(0x7F800000) | (mant << np.uint32(13))
    if exp != 0:
        return sign | ((exp + np.uint32(112)) << np.uint32(23)) | (mant << np.uint32(13))
    if mant == 0:
        return sign
    e = np.uint32(113)
    while (mant & np.uint32(0x400)) == 0:
        mant <<= np.uint32(1)
        e -= np.uint32(1)
    return sign | (e << np.uint32(23)) | ((mant & np.uint32(0x3FF)) << np.uint32(13))


@njit(cache=True, inline="always")
def load_f16(src, off):
    """The little-endian float16 at src[off], as float32."""
    return bits_to_f32(f16_bits_to_f32_bits(np.uint32(src[off]) | (np.uint32(src[off + 1]) << np.uint32(8))))


@njit(cache=True, inline="always")
def load_u32(src, off):
    return (np.uint32(src[off]) | (np.uint32(src[off + 1]) << np.uint32(8))
            | (np.uint32(src[off + 2]) << np.uint32(16)) | (np.uint32(src[off + 3]) << np.uint32(24)))


# ---------------------------------------------------------------- float types (block = 1 element)

@njit(cache=True, inline="always")
def decode_f32(src, off, out, out_off):
    out[out_off] = bits_to_f32(load_u32(src, off))


@njit(cache=True, inline="always")
def decode_f16(src, off, out, out_off):
    out[out_off] = load_f16(src, off)


@njit(cache=True, inline="always")
def decode_bf16(src, off, out, out_off):
    out[out_off] = bits_to_f32((np.uint32(src[off]) << np.uint32(16)) | (np.uint32(src[off + 1]) << np.uint32(24)))


# ---------------------------------------------------------------- legacy 32-element blocks

@njit(cache=True, inline="always")
def decode_q4_0(src, off, out, out_off):
    d = load_f16(src, off)
    for j in range(16):
        b = src[off + 2 + j]
        out[out_off + j] = d * np.float32(np.int32(b & 15) - 8)
        out[out_off + j + 16] = d * np.float32(np.int32(b >> 4) - 8)


@njit(cache=True, inline="always")
def decode_q4_1(src, off, out, out_off):
    d = load_f16(src, off)
    m = load_f16(src, off + 2)
    for j in range(16):
        b = src[off + 4 + j]
        out[out_off + j] = d * np.float32(b & 15) + m
        out[out_off + j + 16] = d * np.float32(b >> 4) + m


@njit(cache=True, inline="always")
def decode_q5_0(src, off, out, out_off):
    d = load_f16(src, off)
    qh = load_u32(src, off + 2)
    for j in range(16):
        b = np.uint32(src[off + 6 + j])
        lo = (b & np.uint32(15)) | (((qh >> np.uint32(j)) & np.uint32(1)) << np.uint32(4))
        hi = (b >> np.uint32(4)) | (((qh >> np.uint32(j + 16)) & np.uint32(1)) << np.uint32(4))
        out[out_off + j] = d * np.float32(np.int32(lo) - 16)
        out[out_off + j + 16] = d * np.float32(np.int32(hi) - 16)


@njit(cache=True, inline="always")
def decode_q5_1(src, off, out, out_off):
    d = load_f16(src, off)
    m = load_f16(src, off + 2)
    qh = load_u32(src, off + 4)
    for j in range(16):
        b = np.uint32(src[off + 8 + j])
        lo = (b & np.uint32(15)) | (((qh >> np.uint32(j)) & np.uint32(1)) << np.uint32(4))
        hi = (b >> np.uint32(4)) | (((qh >> np.uint32(j + 16)) & np.uint32(1)) << np.uint32(4))
        out[out_off + j] = d * np.float32(lo) + m
        out[out_off + j + 16] = d * np.float32(hi) + m


@njit(cache=True, inline="always")
def decode_q8_0(src, off, out, out_off):
    d = load_f16(src, off)
    for j in range(32):
        out[out_off + j] = np.float32(np.int8(src[off + 2 + j])) * d


@njit(cache=True, inline="always")
def decode_iq4_nl(src, off, out, out_off):
    d = load_f16(src, off)
    for j in range(16):
        b = src[off + 2 + j]
        out[out_off + j] = d * np.float32(IQ4_LEVELS[b & 15])
        out[out_off + j + 16] = d * np.float32(IQ4_LEVELS[b >> 4])


# ---------------------------------------------------------------- 256-element super-blocks

@njit(cache=True, inline="always")
def decode_q2_k(src, off, out, out_off):
    # scales[16] @0, qs[64] @16, d @80, dmin @82; element h*128 + s*32 + l is bits 2s of qs[h*32 + l]
    d = load_f16(src, off + 80)
    dmin = load_f16(src, off + 82)
    for h in range(2):
        for s in range(4):
            for half in range(2):
                sc = src[off + h * 8 + s * 2 + half]
                dl = d * np.float32(sc & 15)
                ml = dmin * np.float32(sc >> 4)
                for l in range(half * 16, half * 16 + 16):
                    q = (src[off + 16 + h * 32 + l] >> (2 * s)) & 3
                    out[out_off + h * 128 + s * 32 + l] = dl * np.float32(q) - ml


@njit(cache=True, inline="always")
def q3_k_scale(src, off, i):
    """Signed 6-bit scale i (0..15) of a Q3_K block whose 12 scale bytes start at src[off]."""
    if i < 8:
        low = np.int32(src[off + i]) & 15
    else:
        low = np.int32(src[off + i - 8]) >> 4
    high = (np.int32(src[off + 8 + (i & 3)]) >> (2 * (i >> 2))) & 3
    return (low | (high << 4)) - 32


@njit(cache=True, inline="always")
def decode_q3_k(src, off, out, out_off):
    # hmask[32] @0, qs[64] @32, scales[12] @96, d @108; element h*128 + s*32 + l: low 2 bits from
    # bits 2s of qs[h*32 + l], high bit j = 4h + s of hmask[l] (set means no -4 offset)
    d = load_f16(src, off + 108)
    for h in range(2):
        for s in range(4):
            j = h * 4 + s
            for half in range(2):
                dl = d * np.float32(q3_k_scale(src, off + 96, j * 2 + half))
                for l in range(half * 16, half * 16 + 16):
                    low = np.int32((src[off + 32 + h * 32 + l] >> (2 * s)) & 3)
                    hbit = np.int32((src[off + l] >> j) & 1)
                    out[out_off + h * 128 + s * 32 + l] = dl * np.float32(low - 4 + 4 * hbit)


@njit(cache=True, inline="always")
def k_scale_min(src, off, j):
    """6-bit (scale, min) of sub-block j (0..7) from the 12 packed bytes at src[off] (Q4_K, Q5_K)."""
    if j < 4:
        return np.int32(src[off + j]) & 63, np.int32(src[off + j + 4]) & 63
    sc = (np.int32(src[off + j + 4]) & 15) | ((np.int32(src[off + j - 4]) >> 6) << 4)
    m = (np.int32(src[off + j + 4]) >> 4) | ((np.int32(src[off + j]) >> 6) << 4)
    return sc, m


@njit(cache=True, inline="always")
def decode_q4_k(src, off, out, out_off):
    # d @0, dmin @2, scales[12] @4, qs[128] @16
    d = load_f16(src, off)
    dmin = load_f16(src, off + 2)
    for c in range(4):
        sc0, m0 = k_scale_min(src, off + 4, 2 * c)
        sc1, m1 = k_scale_min(src, off + 4, 2 * c + 1)
        d0 = d * np.float32(sc0)
        dm0 = dmin * np.float32(m0)
        d1 = d * np.float32(sc1)
        dm1 = dmin * np.float32(m1)
        for l in range(32):
            b = src[off + 16 + c * 32 + l]
            out[out_off + c * 64 + l] = d0 * np.float32(b & 15) - dm0
            out[out_off + c * 64 + 32 + l] = d1 * np.float32(b >> 4) - dm1


@njit(cache=True, inline="always")
def decode_q5_k(src, off, out, out_off):
    # d @0, dmin @2, scales[12] @4, qh[32] @16, qs[128] @48; sub-block j takes bit j of qh[l]
    d = load_f16(src, off)
    dmin = load_f16(src, off + 2)
    for c in range(4):
        sc0, m0 = k_scale_min(src, off + 4, 2 * c)
        sc1, m1 = k_scale_min(src, off + 4, 2 * c + 1)
        d0 = d * np.float32(sc0)
        dm0 = dmin * np.float32(m0)
        d1 = d * np.float32(sc1)
        dm1 = dmin * np.float32(m1)
        for l in range(32):
            b = src[off + 48 + c * 32 + l]
            qh = src[off + 16 + l]
            q0 = (b & 15) | (((qh >> (2 * c)) & 1) << 4)
            q1 = (b >> 4) | (((qh >> (2 * c + 1)) & 1) << 4)
            out[out_off + c * 64 + l] = d0 * np.float32(q0) - dm0
            out[out_off + c * 64 + 32 + l] = d1 * np.float32(q1) - dm1


@njit(cache=True, inline="always")
def decode_q6_k(src, off, out, out_off):
    # ql[128] @0, qh[64] @128, int8 scales[16] @192, d @208; two halves of 128 elements
    d = load_f16(src, off + 208)
    for h in range(2):
        ql = off + h * 64
        qh = off + 128 + h * 32
        sc = off + 192 + h * 8
        o = out_off + h * 128
        for l in range(32):
            i = l // 16
            a = src[ql + l]
            b = src[ql + l + 32]
            hb = src[qh + l]
            q0 = np.int32((a & 15) | ((hb & 3) << 4)) - 32
            q1 = np.int32((b & 15) | (((hb >> 2) & 3) << 4)) - 32
            q2 = np.int32((a >> 4) | (((hb >> 4) & 3) << 4)) - 32
            q3 = np.int32((b >> 4) | (((hb >> 6) & 3) << 4)) - 32
            out[o + l] = (d * np.float32(np.int8(src[sc + i]))) * np.float32(q0)
            out[o + l + 32] = (d * np.float32(np.int8(src[sc + i + 2]))) * np.float32(q1)
            out[o + l + 64] = (d * np.float32(np.int8(src[sc + i + 4]))) * np.float32(q2)
            out[o + l + 96] = (d * np.float32(np.int8(src[sc + i + 6]))) * np.float32(q3)


@njit(cache=True, inline="always")
def decode_iq4_xs(src, off, out, out_off):
    # d @0, u16 scales_h @2, scales_l[4] @4, qs[128] @8; 8 sub-blocks of 32 with signed 6-bit scales
    d = load_f16(src, off)
    scales_h = np.uint32(src[off + 2]) | (np.uint32(src[off + 3]) << np.uint32(8))
    for ib in range(8):
        low = (src[off + 4 + ib // 2] >> (4 * (ib % 2))) & 15
        high = (scales_h >> np.uint32(2 * ib)) & np.uint32(3)
        dl = d * np.float32(np.int32(np.uint32(low) | (high << np.uint32(4))) - 32)
        for l in range(16):
            b = src[off + 8 + ib * 16 + l]
            out[out_off + ib * 32 + l] = dl * np.float32(IQ4_LEVELS[b & 15])
            out[out_off + ib * 32 + 16 + l] = dl * np.float32(IQ4_LEVELS[b >> 4])


# ---------------------------------------------------------------- whole rows

# type -> block decoder (formats.QUANT_TYPES: decode_<kernel> above)
ROW_DECODERS = ROW_DECODER.bind(globals())


def block_row(kernels: dict, decoding: bool):
    """The @overload of a row function f(src, src_off, qtype, n_cols, dst, dst_off) that runs
    kernels[qtype] (block decoders when `decoding`, else encoders) over the row's blocks: the bytes
    side steps a block's bytes, the values side its elements. qtype is the type's formats.type_tag,
    so a kernel calling f compiles only that type's function (F32's tag is ())."""
    def typer(src, src_off, qtype, n_cols, dst, dst_off):
        if not isinstance(qtype, types.BaseTuple) or len(qtype) not in kernels:
            return None
        kernel, fmt = kernels[len(qtype)], FORMATS[len(qtype)]
        elems = fmt.block_elems
        src_step, dst_step = (fmt.block_bytes, elems) if decoding else (elems, fmt.block_bytes)

        def impl(src, src_off, qtype, n_cols, dst, dst_off):
            for b in range(n_cols // elems):
                kernel(src, src_off + src_step * b, dst, dst_off + dst_step * b)
        return impl
    return typer


def decode_row(src, src_off, qtype, n_cols, dst, dst_off):
    """Decode the n_cols values of the row starting at src[src_off] into dst[dst_off:]; qtype: the
    type's formats.type_tag (Numba code only)."""
    raise NotImplementedError("decode_row runs inside Numba kernels")


overload(decode_row, inline="always")(block_row(ROW_DECODERS, decoding=True))


# Lives here, not in dequant.py: Numba's cache only notices edits to the caller's own file, and the
# decoders above are inlined into this loop.
def _decode_rows(flat, row_bytes, qtype, n_cols, row_ids, out):
    """out[i] = row row_ids[i] of the tensor whose rows of row_bytes bytes are packed in flat;
    qtype: formats.type_tag of the tensor's type (one compilation per type a model holds)."""
    for i in prange(row_ids.shape[0]):
        decode_row(flat, row_ids[i] * row_bytes, qtype, n_cols, out[i], 0)


decode_rows = njit(parallel=True, cache=True)(_decode_rows)
# A decode step's few rows (its embedding rows): waking the thread pool right after a decode step
# streamed the weights costs ~35 us, three times what decoding one row does.
decode_rows_serial = njit(cache=True)(_decode_rows)

"""Matvec chunk decoders for the 256-weight super-block types: Q2_K..Q6_K and IQ4_XS.

`decode_chunk_<type>(src, b0, nb, dst)` decodes super-blocks b0 .. b0+nb-1 of one weight row into
dst[0 : nb*256] as float32 (layouts: shared/reference/gguf-quant-formats.md). A super-block is one
straight-line vector routine: its 8 or 16 sub-block scales are unpacked as one vector, each
sub-block's weights are a few wide loads, shifts and masks, one convert and one fma.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .matvec_legacy import IQ4_LEVELS
from .matvec_simd import block_decoder, load_f16


def k_scales_mins(v, off):
    """The 8 six-bit (scale, min) pairs of Q4_K/Q5_K packed in the 12 bytes at off, as i32 x 8.

    j < 4: sc = q[j] & 63, m = q[j+4] & 63;
    j >= 4: sc = (q[j+4] & 15) | (q[j-4] >> 6) << 4, m = (q[j+4] >> 4) | (q[j] >> 6) << 4.
    """
    q = v.u8(off, 16)                           # 12 scale bytes + 4 bytes of qs (unused)
    a = v.shuf(q, [0, 1, 2, 3, 8, 9, 10, 11])   # q[j] (j < 4), q[j+4] (j >= 4)
    b = v.shuf(q, [4, 5, 6, 7, 8, 9, 10, 11])   # q[j+4]
    c = v.shuf(q, [0, 1, 2, 3, 0, 1, 2, 3])     # q[j-4] (j >= 4)
    d = v.shuf(q, [4, 5, 6, 7, 4, 5, 6, 7])     # q[j]   (j >= 4)
    first_low_then_high = [0, 1, 2, 3, 12, 13, 14, 15]
    sc = v.shuf(v.and_(a, 63), first_low_then_high, v.or_(v.and_(a, 15), v.shl(v.shr(c, 6), 4)))
    m = v.shuf(v.and_(b, 63), first_low_then_high, v.or_(v.shr(a, 4), v.shl(v.shr(d, 6), 4)))
    return sc, m


def q3_k_scales(v):
    """The 16 signed 6-bit sub-block scales of Q3_K (12 bytes at 96), as i32 x 16, minus 32."""
    s_lo = v.u8(96, 8)                          # two loads: 16 bytes from 96 would leave the block
    s_hi = v.u8(104, 4)
    low8 = v.shuf(s_lo, list(range(8)) * 2)
    low = v.shuf(v.and_(low8, 15), list(range(8)) + list(range(24, 32)), v.shr(low8, 4))
    high = v.and_(v.shr(v.shuf(s_hi, [0, 1, 2, 3] * 4), [0] * 4 + [2] * 4 + [4] * 4 + [6] * 4), 3)
    return v.add(v.or_(low, v.shl(high, 4)), -32)


@block_decoder
def _q2_k(v):
    """Q2_K: scales[16] (low nibble scale, high nibble min); qs[64]; d; dmin. y = d*sc*q - dmin*m.

    Sub-block j (16 weights): half j>>3 (qs + 32*half), shift 2*((j>>1)&3), group j&1 (+16 bytes).
    """
    d, dmin = v.f16(80), v.f16(82)
    sc = v.u8(0, 16)
    dl = v.fmul(v.to_f32(v.and_(sc, 15)), v.splat(d, 16))
    ml = v.fneg(v.fmul(v.to_f32(v.shr(sc, 4)), v.splat(dmin, 16)))
    qs = [v.u8(16 + 16 * i, 16) for i in range(4)]
    for j in range(16):
        half, shift, group = j >> 3, (j >> 1) & 3, j & 1
        q = v.and_(v.shr(qs[2 * half + group], 2 * shift), 3)
        v.store(16 * j, v.fma(v.to_f32(q), v.lanes(dl, [j] * 16), v.lanes(ml, [j] * 16)))


@block_decoder
def _q3_k(v):
    """Q3_K: hmask[32]; qs[64]; scales[12] (6-bit, signed by -32); d. y = d*sc*(q - 4*(1-hbit)).

    Sub-blocks as Q2_K; the high bit of sub-block j is bit 4*half+shift of hmask[16*group + l].
    """
    d = v.f16(108)
    dl = v.fmul(v.to_f32(q3_k_scales(v)), v.splat(d, 16))
    hm = [v.u8(16 * g, 16) for g in range(2)]
    qs = [v.u8(32 + 16 * i, 16) for i in range(4)]
    for j in range(16):
        half, shift, group = j >> 3, (j >> 1) & 3, j & 1
        q = v.and_(v.shr(qs[2 * half + group], 2 * shift), 3)
        hbit = v.and_(v.shr(hm[group], 4 * half + shift), 1)
        q = v.add(v.add(q, v.shl(hbit, 2)), -4)
        v.store(16 * j, v.fmul(v.to_f32(q), v.lanes(dl, [j] * 16)))


@block_decoder
def _q4_k(v):
    """Q4_K: d, dmin; scales[12]; qs[128]. Chunk c of 64: low nibbles of qs[32c:32c+32] with
    sub-block 2c, then high nibbles with 2c+1. y = d*sc*q - dmin*m."""
    d, dmin = v.f16(0), v.f16(2)
    sc, m = k_scales_mins(v, 4)
    dsc = v.fmul(v.to_f32(sc), v.splat(d, 8))
    dm = v.fneg(v.fmul(v.to_f32(m), v.splat(dmin, 8)))
    qs = [v.u8(16 + 32 * c, 32) for c in range(4)]
    for c in range(4):
        for h in range(2):
            q = v.and_(v.shr(qs[c], 4 * h), 15)
            j = 2 * c + h
            v.store(64 * c + 32 * h, v.fma(v.to_f32(q), v.lanes(dsc, [j] * 32), v.lanes(dm, [j] * 32)))


@block_decoder
def _q5_k(v):
    """Q5_K: d, dmin; scales[12]; qh[32]; qs[128]. As Q4_K, plus bit j of qh[l] as the 5th bit of
    element l of sub-block j."""
    d, dmin = v.f16(0), v.f16(2)
    sc, m = k_scales_mins(v, 4)
    dsc = v.fmul(v.to_f32(sc), v.splat(d, 8))
    dm = v.fneg(v.fmul(v.to_f32(m), v.splat(dmin, 8)))
    qh = v.u8(16, 32)
    qs = [v.u8(48 + 32 * c, 32) for c in range(4)]
    for c in range(4):
        for h in range(2):
            j = 2 * c + h
            q = v.or_(v.and_(v.shr(qs[c], 4 * h), 15), v.shl(v.and_(v.shr(qh, j), 1), 4))
            v.store(64 * c + 32 * h, v.fma(v.to_f32(q), v.lanes(dsc, [j] * 32), v.lanes(dm, [j] * 32)))


@block_decoder
def _q6_k(v):
    """Q6_K: ql[128]; qh[64]; int8 scales[16]; d. Per half (ql += 64, qh += 32, scales += 8),
    quarter t of 32 weights: nibble (t >> 1) of ql[32*(t&1) + l], bits 2t..2t+1 of qh[l], scale
    2t + l//16. y = d*sc*(q - 32)."""
    d = v.f16(208)
    dsc = v.fmul(v.to_f32(v.s8(192, 16)), v.splat(d, 16))
    for half in range(2):
        ql = [v.u8(64 * half, 32), v.u8(64 * half + 32, 32)]
        qh = v.u8(128 + 32 * half, 32)
        for t in range(4):
            low = v.and_(v.shr(ql[t & 1], 4 * (t >> 1)), 15)
            q = v.add(v.or_(low, v.shl(v.and_(v.shr(qh, 2 * t), 3), 4)), -32)
            s = 8 * half + 2 * t
            v.store(128 * half + 32 * t, v.fmul(v.to_f32(q), v.lanes(dsc, [s] * 16 + [s + 1] * 16)))


@njit(cache=True, nogil=True)
def decode_chunk_q2_k(src, b0, nb, dst):
    for b in range(nb):
        _q2_k(src, (b0 + b) * 84, dst, b * 256)


@njit(cache=True, nogil=True)
def decode_chunk_q3_k(src, b0, nb, dst):
    for b in range(nb):
        _q3_k(src, (b0 + b) * 110, dst, b * 256)


@njit(cache=True, nogil=True)
def decode_chunk_q4_k(src, b0, nb, dst):
    for b in range(nb):
        _q4_k(src, (b0 + b) * 144, dst, b * 256)


@njit(cache=True, nogil=True)
def decode_chunk_q5_k(src, b0, nb, dst):
    for b in range(nb):
        _q5_k(src, (b0 + b) * 176, dst, b * 256)


@njit(cache=True, nogil=True)
def decode_chunk_q6_k(src, b0, nb, dst):
    for b in range(nb):
        _q6_k(src, (b0 + b) * 210, dst, b * 256)


@njit(cache=True, nogil=True)
def decode_chunk_iq4_xs(src, b0, nb, dst):
    # Table lookups stay scalar (see decode_chunk_iq4_nl).
    for b in range(nb):
        off = (b0 + b) * 136                      # d; scales_h (u16); scales_l[4]; qs[128]
        d = load_f16(src, off)
        scales_h = np.int32(src[off + 2]) | (np.int32(src[off + 3]) << 8)
        for ib in range(8):                       # 8 sub-blocks of 32 with 6-bit scales
            ls = ((np.int32(src[off + 4 + ib // 2]) >> (4 * (ib % 2))) & 15) | (((scales_h >> (2 * ib)) & 3) << 4)
            dl = d * np.float32(ls - 32)
            o = b * 256 + 32 * ib
            for j in range(16):
                q = np.int32(src[off + 8 + 16 * ib + j])
                dst[o + j] = dl * IQ4_LEVELS[q & 15]
                dst[o + 16 + j] = dl * IQ4_LEVELS[q >> 4]

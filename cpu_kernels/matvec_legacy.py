"""Matvec chunk decoders for the 32-weight block types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL.

`decode_chunk_<type>(src, b0, nb, dst)` decodes blocks b0 .. b0+nb-1 of one weight row (`src`, the
row's raw bytes) into dst[0 : nb*32] as float32. Layouts: shared/reference/gguf-quant-formats.md;
low nibbles are elements 0..15 of a block, high nibbles 16..31. The constant offset of the
symmetric types (-8, -16) is subtracted from the integer before the float step, as ggml does.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .matvec_simd import block_decoder, load_f16

IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                      dtype=np.float32)  # ggml's kvalues_iq4nl

_LOW_THEN_HIGH = list(range(32))    # shuffle of (low nibbles ++ high nibbles): elements 0..31


def _nibbles(v, off):
    qs = v.u8(off, 16)
    return v.shuf(v.and_(qs, 15), _LOW_THEN_HIGH, v.shr(qs, 4))


@block_decoder
def _q4_0(v):
    """Q4_0: d; qs[16]. y = d * (q - 8)."""
    d = v.f16(0)
    q = _nibbles(v, 2)
    v.store(0, v.fmul(v.to_f32(v.add(q, -8)), v.splat(d, 32)))


@block_decoder
def _q4_1(v):
    """Q4_1: d, m; qs[16]. y = d * q + m."""
    d, m = v.f16(0), v.f16(2)
    q = _nibbles(v, 4)
    v.store(0, v.fma(v.to_f32(q), v.splat(d, 32), v.splat(m, 32)))


@block_decoder
def _q5_0(v):
    """Q5_0: d; qh (u32, bit j is element j's 5th bit); qs[16]. y = d * (q - 16)."""
    d = v.f16(0)
    q = v.or_(_nibbles(v, 6), v.shl(v.bits_of(v.u32(2), 0, 32), 4))
    v.store(0, v.fmul(v.to_f32(v.add(q, -16)), v.splat(d, 32)))


@block_decoder
def _q5_1(v):
    """Q5_1: d, m; qh; qs[16]. y = d * q + m."""
    d, m = v.f16(0), v.f16(2)
    q = v.or_(_nibbles(v, 8), v.shl(v.bits_of(v.u32(4), 0, 32), 4))
    v.store(0, v.fma(v.to_f32(q), v.splat(d, 32), v.splat(m, 32)))


@block_decoder
def _q8_0(v):
    """Q8_0: d; int8 qs[32]. y = d * q."""
    d = v.f16(0)
    v.store(0, v.fmul(v.to_f32(v.s8(2, 32)), v.splat(d, 32)))


@njit(cache=True, nogil=True)
def decode_chunk_q4_0(src, b0, nb, dst):
    for b in range(nb):
        _q4_0(src, (b0 + b) * 18, dst, b * 32)


@njit(cache=True, nogil=True)
def decode_chunk_q4_1(src, b0, nb, dst):
    for b in range(nb):
        _q4_1(src, (b0 + b) * 20, dst, b * 32)


@njit(cache=True, nogil=True)
def decode_chunk_q5_0(src, b0, nb, dst):
    for b in range(nb):
        _q5_0(src, (b0 + b) * 22, dst, b * 32)


@njit(cache=True, nogil=True)
def decode_chunk_q5_1(src, b0, nb, dst):
    for b in range(nb):
        _q5_1(src, (b0 + b) * 24, dst, b * 32)


@njit(cache=True, nogil=True)
def decode_chunk_q8_0(src, b0, nb, dst):
    for b in range(nb):
        _q8_0(src, (b0 + b) * 34, dst, b * 32)


@njit(cache=True, nogil=True)
def decode_chunk_iq4_nl(src, b0, nb, dst):
    # A 16-entry table lookup has no portable vector form in LLVM IR: IQ4_NL stays scalar.
    for b in range(nb):
        off = (b0 + b) * 18                       # d; qs[16] (indices into IQ4_LEVELS)
        d = load_f16(src, off)
        for j in range(16):
            q = np.int32(src[off + 2 + j])
            dst[b * 32 + j] = d * IQ4_LEVELS[q & 15]
            dst[b * 32 + 16 + j] = d * IQ4_LEVELS[q >> 4]

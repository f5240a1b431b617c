"""Matvec chunk decoders for the unquantized types F32, F16 and BF16 (a "block" is one element).

`decode_chunk_<type>(src, e0, n, dst)` converts elements e0 .. e0+n-1 of one weight row into
dst[0 : n] as float32: 16 at a time in vector code, the tail of a row that is not a multiple of 16
one by one.
"""
from __future__ import annotations

from numba import njit

from .matvec_simd import LANES, decode_bf16x16, decode_f16x16, decode_f32x16, load_bf16, load_f16, load_f32


@njit(cache=True, nogil=True)
def decode_chunk_f32(src, e0, n, dst):
    main = n - n % LANES
    for i in range(0, main, LANES):
        decode_f32x16(src, 4 * (e0 + i), dst, i)
    for i in range(main, n):
        dst[i] = load_f32(src, 4 * (e0 + i))


@njit(cache=True, nogil=True)
def decode_chunk_f16(src, e0, n, dst):
    main = n - n % LANES
    for i in range(0, main, LANES):
        decode_f16x16(src, 2 * (e0 + i), dst, i)
    for i in range(main, n):
        dst[i] = load_f16(src, 2 * (e0 + i))


@njit(cache=True, nogil=True)
def decode_chunk_bf16(src, e0, n, dst):
    main = n - n % LANES
    for i in range(0, main, LANES):
        decode_bf16x16(src, 2 * (e0 + i), dst, i)
    for i in range(main, n):
        dst[i] = load_bf16(src, 2 * (e0 + i))

"""Quantize float32 rows into GGUF block formats (all 15 types hybridrt reads).

F32, F16, BF16 and the legacy Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 follow gguf-py's `gguf.quants.quantize`
bit for bit (same float32 operations, same tie rules). gguf-py has no quantizer for the K-quants
and IQ4_*; for those the scales come from a small search: least-squares refits per sub-block, then
the 4/6/8-bit super-block scales tried at their nearest integer and +-1, keeping whichever
reconstructs the sub-block with the least squared error. Rounding differs from llama.cpp's
(make_qkx2_quants etc.), the blocks are valid and the error is at the format's step size.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange
from numba.extending import overload

from .blocks import IQ4_LEVELS, bits_to_f32, block_row, f16_bits_to_f32_bits, f32_to_bits
from .formats import ENCODER, format_of, type_tag


# ---------------------------------------------------------------- scalar conversions

@njit(cache=True)
def f32_to_f16_bits(x):
    """float32 -> IEEE half bits, round to nearest even (numpy's astype(float16))."""
    f = f32_to_bits(np.float32(x))
    sign = (f >> np.uint32(16)) & np.uint32(0x8000)
    exp = np.int32((f >> np.uint32(23)) & np.uint32(0xFF))
    mant = f & np.uint32(0x7FFFFF)
    if exp == 0xFF:
        if mant == 0:
            return sign | np.uint32(0x7C00)
        m = mant >> np.uint32(13)
        return sign | np.uint32(0x7C00) | (m if m != 0 else np.uint32(1))
    if exp >= 143:                      # |x| >= 2^16: past the largest half even before rounding
        return sign | np.uint32(0x7C00)
    if exp <= 112:                      # half subnormal (or zero): units of 2^-24
        if exp < 102:
            return sign
        m = mant | np.uint32(0x800000)
        shift = np.uint32(126 - exp)
        q = m >> shift
        rem = m & ((np.uint32(1) << shift) - np.uint32(1))
        half = np.uint32(1) << (shift - np.uint32(1))
        if rem > half or (rem == half and (q & np.uint32(1)) != 0):
            q += np.uint32(1)
        return sign | q
    q = (np.uint32(exp - 112) << np.uint32(10)) | (mant >> np.uint32(13))
    rem = mant & np.uint32(0x1FFF)
    if rem > 0x1000 or (rem == 0x1000 and (q & np.uint32(1)) != 0):
        q += np.uint32(1)               # a carry into the exponent (or up to inf) is correct
    return sign | q


@njit(cache=True)
def f16_round(x):
    """x rounded to the nearest float16, as float32 (what a decoder will read back)."""
    return bits_to_f32(f16_bits_to_f32_bits(f32_to_f16_bits(x)))


@njit(cache=True)
def store_f16(dst, off, x):
    h = f32_to_f16_bits(x)
    dst[off] = np.uint8(h & np.uint32(0xFF))
    dst[off + 1] = np.uint8(h >> np.uint32(8))


@njit(cache=True)
def round_half_away(v):
    """gguf-py's np_roundf for a float32: nearest integer, ties away from zero."""
    a = abs(v)
    fl = np.int32(a)
    q = fl + (1 if a - np.float32(fl) >= np.float32(0.5) else 0)
    return -q if v < 0 else q


@njit(cache=True)
def nearest_int(v):
    return np.int32(np.floor(v + 0.5))


# ---------------------------------------------------------------- float types

@njit(cache=True)
def encode_f32(x, i, dst, off):
    b = f32_to_bits(x[i])
    for k in range(4):
        dst[off + k] = np.uint8((b >> np.uint32(8 * k)) & np.uint32(0xFF))


@njit(cache=True)
def encode_f16(x, i, dst, off):
    store_f16(dst, off, x[i])


@njit(cache=True)
def encode_bf16(x, i, dst, off):
    n = np.uint64(f32_to_bits(x[i]))
    if (n & np.uint64(0x7FFFFFFF)) > np.uint64(0x7F800000):   # NaN: keep it a quiet NaN
        n = (n & np.uint64(0xFFFF0000)) | np.uint64(64 << 16)
    n = (n + np.uint64(0x7FFF) + ((n >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    dst[off] = np.uint8(n & np.uint64(0xFF))
    dst[off + 1] = np.uint8((n >> np.uint64(8)) & np.uint64(0xFF))


# ---------------------------------------------------------------- legacy 32-element blocks (as gguf-py)

@njit(cache=True)
def signed_absmax(x, i, n):
    """The first element of largest magnitude in x[i:i+n], with its sign."""
    amax = np.float32(0)
    mx = np.float32(0)
    for j in range(n):
        a = abs(x[i + j])
        if a > amax:
            amax = a
            mx = x[i + j]
    return mx


@njit(cache=True)
def inverse(d):
    return np.float32(0) if d == 0 else np.float32(1) / d


@njit(cache=True)
def encode_q4_0(x, i, dst, off):
    d = signed_absmax(x, i, 32) / np.float32(-8)
    inv = inverse(d)
    store_f16(dst, off, d)
    for j in range(16):
        lo = min(np.int32(x[i + j] * inv + np.float32(8.5)), 15)
        hi = min(np.int32(x[i + j + 16] * inv + np.float32(8.5)), 15)
        dst[off + 2 + j] = np.uint8(lo | (hi << 4))


@njit(cache=True)
def encode_q4_1(x, i, dst, off):
    mn = x[i]
    mx = x[i]
    for j in range(32):
        mn = min(mn, x[i + j])
        mx = max(mx, x[i + j])
    d = (mx - mn) / np.float32(15)
    inv = inverse(d)
    store_f16(dst, off, d)
    store_f16(dst, off + 2, mn)
    for j in range(16):
        lo = min(np.int32((x[i + j] - mn) * inv + np.float32(0.5)), 15)
        hi = min(np.int32((x[i + j + 16] - mn) * inv + np.float32(0.5)), 15)
        dst[off + 4 + j] = np.uint8(lo | (hi << 4))


@njit(cache=True)
def pack_q5(q, dst, qh_off, qs_off):
    qh = np.uint32(0)
    for j in range(32):
        qh |= np.uint32(q[j] >> 4) << np.uint32(j)
    for k in range(4):
        dst[qh_off + k] = np.uint8((qh >> np.uint32(8 * k)) & np.uint32(0xFF))
    for j in range(16):
        dst[qs_off + j] = np.uint8((q[j] & 15) | ((q[j + 16] & 15) << 4))


@njit(cache=True)
def encode_q5_0(x, i, dst, off):
    d = signed_absmax(x, i, 32) / np.float32(-16)
    inv = inverse(d)
    store_f16(dst, off, d)
    q = np.empty(32, dtype=np.int32)
    for j in range(32):
        q[j] = min(np.int32(x[i + j] * inv + np.float32(16.5)), 31)
    pack_q5(q, dst, off + 2, off + 6)


@njit(cache=True)
def encode_q5_1(x, i, dst, off):
    mn = x[i]
    mx = x[i]
    for j in range(32):
        mn = min(mn, x[i + j])
        mx = max(mx, x[i + j])
    d = (mx - mn) / np.float32(31)
    inv = inverse(d)
    store_f16(dst, off, d)
    store_f16(dst, off + 2, mn)
    q = np.empty(32, dtype=np.int32)
    for j in range(32):
        q[j] = min(np.int32((x[i + j] - mn) * inv + np.float32(0.5)), 31)
    pack_q5(q, dst, off + 4, off + 8)


@njit(cache=True)
def encode_q8_0(x, i, dst, off):
    amax = np.float32(0)
    for j in range(32):
        amax = max(amax, abs(x[i + j]))
    d = amax / np.float32(127)
    inv = inverse(d)
    store_f16(dst, off, d)
    for j in range(32):
        dst[off + 2 + j] = np.uint8(round_half_away(x[i + j] * inv) & 0xFF)


# ---------------------------------------------------------------- scale searches (K-quants, IQ4)

@njit(cache=True)
def fit_affine(x, i, n, nmax):
    """Step s > 0 and offset m >= 0 for x[i:i+n] ~ s*q - m, q in 0..nmax: min/max start, then
    least-squares refits of (s, m) on the current q (each refit can only lower the error)."""
    mn = np.float32(0)
    mx = x[i]
    for j in range(n):
        mn = min(mn, x[i + j])
        mx = max(mx, x[i + j])
    if mx <= mn:
        return np.float32(0), -mn
    s = (mx - mn) / np.float32(nmax)
    m = -mn
    for _ in range(3):
        sq = 0.0
        sqq = 0.0
        sx = 0.0
        sqx = 0.0
        for j in range(n):
            q = min(max(nearest_int((x[i + j] + m) / s), 0), nmax)
            sq += q
            sqq += q * q
            sx += x[i + j]
            sqx += q * x[i + j]
        det = n * sqq - sq * sq
        if det <= 0:
            break
        s_new = (n * sqx - sq * sx) / det
        m_new = -(sx - s_new * sq) / n
        if m_new < 0:                      # the format subtracts a non-negative min: refit s alone
            m_new = 0.0
            s_new = sqx / sqq if sqq > 0 else 0.0
        if s_new <= 0:
            break
        s = np.float32(s_new)
        m = np.float32(m_new)
    return s, m


@njit(cache=True)
def affine_error(x, i, n, nmax, step, offset):
    """Squared error of x[i:i+n] rounded to step*q - offset, as the decoder computes it."""
    err = 0.0
    for j in range(n):
        q = 0 if step == 0 else min(max(nearest_int((x[i + j] + offset) / step), 0), nmax)
        e = np.float64(step * np.float32(q) - offset) - x[i + j]
        err += e * e
    return err


@njit(cache=True)
def affine_superblock(x, i, n_sub, sub_len, nmax, smax, sc, mins):
    """(d, dmin) and the integer sub-block scales/mins (0..smax) of an affine K-quant super-block."""
    steps = np.empty(n_sub, dtype=np.float32)
    offs = np.empty(n_sub, dtype=np.float32)
    for k in range(n_sub):
        steps[k], offs[k] = fit_affine(x, i + k * sub_len, sub_len, nmax)
    d = f16_round(steps.max() / np.float32(smax))
    dmin = f16_round(offs.max() / np.float32(smax))
    for k in range(n_sub):
        s0 = 0 if d == 0 else min(max(nearest_int(steps[k] / d), 0), smax)
        m0 = 0 if dmin == 0 else min(max(nearest_int(offs[k] / dmin), 0), smax)
        best = np.inf
        for s in range(max(s0 - 1, 0), min(s0 + 1, smax) + 1):
            for m in range(max(m0 - 1, 0), min(m0 + 1, smax) + 1):
                err = affine_error(x, i + k * sub_len, sub_len, nmax, d * np.float32(s), dmin * np.float32(m))
                if err < best:
                    best = err
                    sc[k] = s
                    mins[k] = m
    return d, dmin


@njit(cache=True)
def affine_q(x, i, nmax, step, offset):
    return 0 if step == 0 else min(max(nearest_int((x[i] + offset) / step), 0), nmax)


@njit(cache=True)
def fit_symmetric(x, i, n, lo, hi):
    """Scale s for x[i:i+n] ~ s*q, q in lo..hi (lo = -hi-1): the largest |x| maps to lo, then
    least-squares refits on the current q."""
    mx = signed_absmax(x, i, n)
    if mx == 0:
        return np.float32(0)
    s = mx / np.float32(lo)
    for _ in range(3):
        sqq = 0.0
        sqx = 0.0
        for j in range(n):
            q = min(max(nearest_int(x[i + j] / s), lo), hi)
            sqq += q * q
            sqx += q * x[i + j]
        if sqq == 0 or sqx == 0:
            break
        s = np.float32(sqx / sqq)
    return s


@njit(cache=True)
def symmetric_error(x, i, n, lo, hi, step):
    err = 0.0
    for j in range(n):
        q = 0 if step == 0 else min(max(nearest_int(x[i + j] / step), lo), hi)
        e = np.float64(step * np.float32(q)) - x[i + j]
        err += e * e
    return err


@njit(cache=True)
def symmetric_superblock(x, i, n_sub, sub_len, lo, hi, sc_lo, sc_hi, sc):
    """d and the signed integer sub-block scales (sc_lo..sc_hi) of a symmetric K-quant super-block."""
    steps = np.empty(n_sub, dtype=np.float32)
    for k in range(n_sub):
        steps[k] = fit_symmetric(x, i + k * sub_len, sub_len, lo, hi)
    d = f16_round(np.abs(steps).max() / np.float32(sc_hi))
    for k in range(n_sub):
        s0 = 0 if d == 0 else min(max(nearest_int(steps[k] / d), sc_lo), sc_hi)
        best = np.inf
        for s in range(max(s0 - 1, sc_lo), min(s0 + 1, sc_hi) + 1):
            err = symmetric_error(x, i + k * sub_len, sub_len, lo, hi, d * np.float32(s))
            if err < best:
                best = err
                sc[k] = s
    return d


@njit(cache=True)
def nearest_level(v):
    """Index of the IQ4 level nearest to v (levels are sorted)."""
    best = 0
    for k in range(1, 16):
        if abs(np.float32(IQ4_LEVELS[k]) - v) < abs(np.float32(IQ4_LEVELS[best]) - v):
            best = k
    return best


@njit(cache=True)
def iq4_error(x, i, n, scale):
    err = 0.0
    for j in range(n):
        q = 8 if scale == 0 else nearest_level(x[i + j] / scale)   # level 8 (= 1) nearest to 0
        e = np.float64(scale * np.float32(IQ4_LEVELS[q])) - x[i + j]
        err += e * e
    return err


@njit(cache=True)
def fit_iq4(x, i, n):
    """Scale s for x[i:i+n] ~ s*level: candidates around 'largest |x| maps to -127', each refit
    by least squares on its nearest levels; keep the best."""
    mx = signed_absmax(x, i, n)
    if mx == 0:
        return np.float32(0)
    best_s = mx / np.float32(-127)
    best = iq4_error(x, i, n, best_s)
    for t in range(-6, 7):
        s = mx / np.float32(-127 + 6 * t)
        sll = 0.0
        slx = 0.0
        for j in range(n):
            lv = np.float64(IQ4_LEVELS[nearest_level(x[i + j] / s)])
            sll += lv * lv
            slx += lv * x[i + j]
        if sll > 0 and slx != 0:
            s = np.float32(slx / sll)
        err = iq4_error(x, i, n, s)
        if err < best:
            best = err
            best_s = s
    return best_s


# ---------------------------------------------------------------- K-quant and IQ4 encoders

@njit(cache=True)
def encode_q2_k(x, i, dst, off):
    sc = np.zeros(16, dtype=np.int32)
    mins = np.zeros(16, dtype=np.int32)
    d, dmin = affine_superblock(x, i, 16, 16, 3, 15, sc, mins)
    for k in range(16):
        dst[off + k] = np.uint8(sc[k] | (mins[k] << 4))
    for k in range(64):
        dst[off + 16 + k] = 0
    for h in range(2):
        for s in range(4):
            for l in range(32):
                e = h * 128 + s * 32 + l
                k = e // 16
                q = affine_q(x, i + e, 3, d * np.float32(sc[k]), dmin * np.float32(mins[k]))
                dst[off + 16 + h * 32 + l] |= np.uint8(q << (2 * s))
    store_f16(dst, off + 80, d)
    store_f16(dst, off + 82, dmin)


@njit(cache=True)
def encode_q3_k(x, i, dst, off):
    sc = np.zeros(16, dtype=np.int32)
    d = symmetric_superblock(x, i, 16, 16, -4, 3, -32, 31, sc)
    for k in range(108):
        dst[off + k] = 0
    for k in range(16):
        u = sc[k] + 32
        if k < 8:
            dst[off + 96 + k] |= np.uint8(u & 15)
        else:
            dst[off + 96 + k - 8] |= np.uint8((u & 15) << 4)
        dst[off + 96 + 8 + (k & 3)] |= np.uint8((u >> 4) << (2 * (k >> 2)))
    for h in range(2):
        for s in range(4):
            for l in range(32):
                e = h * 128 + s * 32 + l
                step = d * np.float32(sc[e // 16])
                q = 0 if step == 0 else min(max(nearest_int(x[i + e] / step), -4), 3)
                dst[off + 32 + h * 32 + l] |= np.uint8(((q + 4) & 3) << (2 * s))
                dst[off + l] |= np.uint8(((q + 4) >> 2) << (h * 4 + s))
    store_f16(dst, off + 108, d)


@njit(cache=True)
def pack_k_scales(sc, mins, dst, off):
    """The 12-byte 6-bit (scale, min) packing of Q4_K/Q5_K (inverse of blocks.k_scale_min)."""
    for j in range(4):
        dst[off + j] = np.uint8((sc[j] & 63) | ((sc[j + 4] >> 4) << 6))
        dst[off + j + 4] = np.uint8((mins[j] & 63) | ((mins[j + 4] >> 4) << 6))
        dst[off + j + 8] = np.uint8((sc[j + 4] & 15) | ((mins[j + 4] & 15) << 4))


@njit(cache=True)
def encode_q4_k(x, i, dst, off):
    sc = np.zeros(8, dtype=np.int32)
    mins = np.zeros(8, dtype=np.int32)
    d, dmin = affine_superblock(x, i, 8, 32, 15, 63, sc, mins)
    store_f16(dst, off, d)
    store_f16(dst, off + 2, dmin)
    pack_k_scales(sc, mins, dst, off + 4)
    for c in range(4):
        for l in range(32):
            lo = affine_q(x, i + c * 64 + l, 15, d * np.float32(sc[2 * c]), dmin * np.float32(mins[2 * c]))
            hi = affine_q(x, i + c * 64 + 32 + l, 15, d * np.float32(sc[2 * c + 1]),
                          dmin * np.float32(mins[2 * c + 1]))
            dst[off + 16 + c * 32 + l] = np.uint8(lo | (hi << 4))


@njit(cache=True)
def encode_q5_k(x, i, dst, off):
    sc = np.zeros(8, dtype=np.int32)
    mins = np.zeros(8, dtype=np.int32)
    d, dmin = affine_superblock(x, i, 8, 32, 31, 63, sc, mins)
    store_f16(dst, off, d)
    store_f16(dst, off + 2, dmin)
    pack_k_scales(sc, mins, dst, off + 4)
    for l in range(32):
        dst[off + 16 + l] = 0
    for c in range(4):
        for l in range(32):
            lo = affine_q(x, i + c * 64 + l, 31, d * np.float32(sc[2 * c]), dmin * np.float32(mins[2 * c]))
            hi = affine_q(x, i + c * 64 + 32 + l, 31, d * np.float32(sc[2 * c + 1]),
                          dmin * np.float32(mins[2 * c + 1]))
            dst[off + 48 + c * 32 + l] = np.uint8((lo & 15) | ((hi & 15) << 4))
            dst[off + 16 + l] |= np.uint8(((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1)))


@njit(cache=True)
def encode_q6_k(x, i, dst, off):
    sc = np.zeros(16, dtype=np.int32)
    d = symmetric_superblock(x, i, 16, 16, -32, 31, -128, 127, sc)
    for k in range(192):
        dst[off + k] = 0
    for k in range(16):
        dst[off + 192 + k] = np.uint8(sc[k] & 0xFF)
    for h in range(2):
        for t in range(4):
            for l in range(32):
                e = h * 128 + t * 32 + l
                step = d * np.float32(sc[e // 16])
                u = 32 + (0 if step == 0 else min(max(nearest_int(x[i + e] / step), -32), 31))
                ql = off + h * 64 + l + (32 if t & 1 else 0)
                dst[ql] |= np.uint8((u & 15) << (4 if t >= 2 else 0))
                dst[off + 128 + h * 32 + l] |= np.uint8((u >> 4) << (2 * t))
    store_f16(dst, off + 208, d)


@njit(cache=True)
def encode_iq4_nl(x, i, dst, off):
    d = f16_round(fit_iq4(x, i, 32))
    store_f16(dst, off, d)
    for j in range(16):
        lo = 8 if d == 0 else nearest_level(x[i + j] / d)
        hi = 8 if d == 0 else nearest_level(x[i + j + 16] / d)
        dst[off + 2 + j] = np.uint8(lo | (hi << 4))


@njit(cache=True)
def encode_iq4_xs(x, i, dst, off):
    scales = np.empty(8, dtype=np.float32)
    for ib in range(8):
        scales[ib] = fit_iq4(x, i + ib * 32, 32)
    d = f16_round(np.abs(scales).max() / np.float32(31))
    scales_h = 0
    for ib in range(4):
        dst[off + 4 + ib] = 0
    for ib in range(8):
        s0 = 0 if d == 0 else min(max(nearest_int(scales[ib] / d), -32), 31)
        best = np.inf
        sc = s0
        for s in range(max(s0 - 1, -32), min(s0 + 1, 31) + 1):
            err = iq4_error(x, i + ib * 32, 32, d * np.float32(s))
            if err < best:
                best = err
                sc = s
        u = sc + 32
        dst[off + 4 + ib // 2] |= np.uint8((u & 15) << (4 * (ib % 2)))
        scales_h |= (u >> 4) << (2 * ib)
        step = d * np.float32(sc)
        for l in range(16):
            lo = 8 if step == 0 else nearest_level(x[i + ib * 32 + l] / step)
            hi = 8 if step == 0 else nearest_level(x[i + ib * 32 + 16 + l] / step)
            dst[off + 8 + ib * 16 + l] = np.uint8(lo | (hi << 4))
    store_f16(dst, off, d)
    dst[off + 2] = np.uint8(scales_h & 0xFF)
    dst[off + 3] = np.uint8(scales_h >> 8)


# ---------------------------------------------------------------- rows

# type -> block encoder (formats.QUANT_TYPES: encode_<kernel> above)
ROW_ENCODERS = ENCODER.bind(globals())


def encode_row(src, src_off, qtype, n_cols, dst, dst_off):
    """Quantize the n_cols float32 values at src[src_off] into the bytes dst[dst_off:]; qtype: the
    type's formats.type_tag (Numba code only)."""
    raise NotImplementedError("encode_row runs inside Numba kernels")


overload(encode_row)(block_row(ROW_ENCODERS, decoding=False))


@njit(parallel=True, cache=True)
def _encode_rows(x, qtype, n_cols, row_bytes, out):
    for r in prange(x.shape[0] // n_cols):
        encode_row(x, r * n_cols, qtype, n_cols, out, r * row_bytes)


def quantize(x: np.ndarray, qtype: int) -> np.ndarray:
    """float32 rows (rows, n_cols) (or one 1-D row) -> uint8 (rows, row_bytes) of type qtype."""
    fmt = format_of(qtype)
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    n_rows, n_cols = rows.shape
    row_bytes = fmt.row_bytes(n_cols)
    out = np.empty(n_rows * row_bytes, dtype=np.uint8)
    if out.size:
        _encode_rows(rows.reshape(-1), type_tag(fmt.qtype), n_cols, row_bytes, out)
    return out.reshape(n_rows, row_bytes)

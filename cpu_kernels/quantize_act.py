"""Activation rows quantized to int8 blocks, once per call, for the integer matvec (matvec_int).

llama.cpp does not multiply quantized weights with float activations: it quantizes each activation
row into the weight type's "vec_dot type" (Q8_K for the K-quants, Q8_0/Q8_1 for the 32-weight
types) and dots integers. This module makes those rows:

    q[t, i]  int8 in [-127, 127]       rint(x[t, i] * 127 / max|x|) for i in block b
    d[t, b]  float32 block scale       ggml's, see below (0 for an all-zero block)
    s[t, g]  int16 group sums          sum of q over group g (16 values for K, 32 for legacy)

block = 256 with 16-value sums for the K-quants (Q8_K: the sums serve the sub-block mins and the
constant offsets of Q3_K/Q6_K), block = 32 with 32-value sums for the legacy types (Q8_1's s).
The scales are ggml's, value for value, so the integer path multiplies what llama.cpp multiplies
(issue 11 item 4: closer to llama.cpp's numerics, not merely as close as the float path):
- Q8_K (block 256): d = 1 / (127 / max|x|), a float32 reciprocal of the quantizing factor
  (ggml's `1/iscale`; its sign flip for a negative maximum cancels in q * d);
- Q8_0 / Q8_1 (block 32): d = max|x| / 127 rounded to float16 (ggml stores it as ggml_half), kept
  here in a float32 array (exactly representable), while q uses the unrounded 127 / max|x| as ggml's
  quantize_row_q8_0/q8_1 do.
Rows are quantized independently, so a token's q, d, s are the same whatever else is in the batch.
Rows of the legacy layout are padded to a multiple of 64 values (zeros, d = 0, s = 0) so the kernel
can always take two blocks at a time.

Residual rows (`with_residual_rows`): one int8 pass carries ~2^-8 relative error per value, and over
a whole model that is llama.cpp's distance from the float32 forward (mean KL ~2-3e-3 on SmolLM2 /
Gemma 3). A second pass on what the first one rounded off, x = d1 q1 + d2 q2, leaves ~2^-16: the
matrices given it (hybridrt.runtime.backends.residual_activations) multiply 2k activation rows, [x; x - d1
q1], through the same integer kernels, and a token's output is the sum of its two rows' outputs,
still independent of k. Only batches of up to RESIDUAL_MAX_TOKENS rows take it: decode and verify
steps read weights from memory and pay ~8 % a step for it; a prompt batch is compute-bound, where
it would cost 1.6x (BENCHMARKS "A second int8 pass"), so prompts keep llama.cpp's one pass.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .formats import QK_K, QK_LEGACY     # the activation blocks: a K-quant super-block, a Q4_0 .. Q8_0 block

PAD_LEGACY = 64     # legacy rows padded to pairs of blocks
RESIDUAL_MAX_TOKENS = 32    # the largest batch that takes the residual pass (= the fused path's batches)


@njit(cache=True, nogil=True, inline="always")
def round_to_float16(v):
    """float32 v >= 0 rounded to the nearest float16 value (ties to even), returned as float32: what
    ggml's FP32_TO_FP16 stores (Numba has no float16 type on the CPU). Values past float16's range
    (> 65504, activations of ~8e6) become inf as they would in ggml."""
    if v < np.float32(6.103515625e-05):                     # float16 subnormals: multiples of 2^-24
        return np.float32(np.rint(v * np.float32(16777216.0)) / np.float32(16777216.0))
    bits = np.int32(np.float32(v).view(np.int32))
    bits = (bits + np.int32(0xFFF) + ((bits >> 13) & 1)) & np.int32(~0x1FFF)   # keep 10 mantissa bits
    r = np.int32(bits).view(np.float32)
    return r if r <= np.float32(65504.0) else np.float32(np.inf)


@njit(cache=True, nogil=True, fastmath={"nnan", "ninf", "nsz"}, inline="always")
def _quantize_row(x, block, group, q, d, s):
    """One row (1-D views). fastmath without reassociation (no NaN / inf / signed-zero care: the
    activations are finite): every value is computed by the same operations. The loops run over
    block slices from 0 (LLVM vectorizes those; over range(c0, c0 + block) it did not: 8x the
    time on a 512-token prompt's rows), and max|x| is the integer max of the bits without the
    sign, which orders finite floats as their magnitudes do (a float max reduction stays scalar
    without reassociation; either max is exact in any order)."""
    n = x.shape[0]
    bits = x.view(np.int32)
    for b in range(n // block):
        c0 = b * block
        xs, xb, qs = x[c0:c0 + block], bits[c0:c0 + block], q[c0:c0 + block]
        top = np.int32(0)
        for i in range(block):
            top = max(top, xb[i] & np.int32(0x7FFFFFFF))
        amax = np.int32(top).view(np.float32)
        # multiply by 127 / max|x| (one division per block) so the largest value maps to exactly
        # +-127; the scale as ggml stores it (module docstring)
        inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
        if block == QK_K:
            d[b] = np.float32(1.0) / inv if amax > 0 else np.float32(0.0)
        else:
            d[b] = round_to_float16(amax / np.float32(127.0))
        for i in range(block):
            qs[i] = np.int8(np.int32(min(max(np.rint(xs[i] * inv), np.float32(-127.0)), np.float32(127.0))))
    for g in range(n // group):
        qs = q[g * group:(g + 1) * group]
        acc = np.int32(0)
        for i in range(group):
            acc += np.int32(qs[i])
        s[g] = np.int16(acc)


@njit(cache=True, nogil=True)
def _quantize_rows(x, block, group, q, d, s):
    for t in range(x.shape[0]):
        _quantize_row(x[t], block, group, q[t], d[t], s[t])


@njit(cache=True, nogil=True, parallel=True)
def _quantize_rows_parallel(x, block, group, q, d, s):
    for t in prange(x.shape[0]):
        _quantize_row(x[t], block, group, q[t], d[t], s[t])


PARALLEL_MIN_ROWS = 16      # fewer rows: a parallel region costs more than it saves


def quantize_rows(x: np.ndarray, block: int, pad_rows: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q int8 (k, n_pad), d float32 (k, n_pad/block), s int16 (k, n_pad/group)) for x (k, n).

    block 256: Q8_K-like (group sums of 16). block 32: Q8_0-like (sums of 32, rows padded to 64).
    pad_rows: that many all-zero rows (q = d = s = 0) after the k rows.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    k, n = x.shape
    if n % block:
        raise ValueError(f"{n} activations are not a whole number of {block}-value blocks")
    if block == QK_K:
        group, n_pad = 16, n
    elif block == QK_LEGACY:
        group, n_pad = QK_LEGACY, -(-n // PAD_LEGACY) * PAD_LEGACY
    else:
        raise ValueError(f"activation block must be {QK_K} or {QK_LEGACY}, got {block}")
    q = np.zeros((k + pad_rows, n_pad), np.int8)
    d = np.zeros((k + pad_rows, n_pad // block), np.float32)
    s = np.zeros((k + pad_rows, n_pad // group), np.int16)
    (_quantize_rows_parallel if k >= PARALLEL_MIN_ROWS else _quantize_rows)(x, block, group, q, d, s)
    return q, d, s


@njit(cache=True, nogil=True, inline="always")
def _residual_row(x, q, d, block, r):
    """r = x - d q: what quantizing x (into q, d) rounded off (by block slices, as _quantize_row:
    a division per value kept the loop scalar)."""
    for b in range(x.shape[0] // block):
        lo, hi = b * block, (b + 1) * block
        xs, qs, rs, db = x[lo:hi], q[lo:hi], r[lo:hi], d[b]
        for i in range(block):
            rs[i] = xs[i] - np.float32(qs[i]) * db


@njit(cache=True, nogil=True)
def _with_residual_rows(x, block, out):
    k, n = x.shape
    group = 16 if block == QK_K else QK_LEGACY
    q = np.empty(n, np.int8)
    d = np.empty(n // block, np.float32)
    s = np.empty(n // group, np.int16)
    for t in range(k):
        _quantize_row(x[t], block, group, q, d, s)
        for i in range(n):
            out[t, i] = x[t, i]
        _residual_row(x[t], q, d, block, out[k + t])


@njit(cache=True, nogil=True)
def _quantize_rows_residual(x, block, group, q, d, s):
    """quantize_rows's (q, d, s) of with_residual_rows(x) (2k rows), without building those rows:
    each of x's rows quantized once, then its residual."""
    k, n = x.shape
    r = np.empty(n, np.float32)
    for t in range(k):
        _quantize_row(x[t], block, group, q[t], d[t], s[t])
        _residual_row(x[t], q[t], d[t], block, r)
        _quantize_row(r, block, group, q[k + t], d[k + t], s[k + t])


def with_residual_rows(x: np.ndarray, block: int) -> np.ndarray:
    """(2k, n) float32: x's k rows, then what quantizing each of them to int8 in `block`-value
    blocks (quantize_rows) rounds off, x - d q. The integer kernels on these rows, output rows t and
    k + t summed, give W x to ~2^-16 (module docstring)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    k, n = x.shape
    if n % block:
        raise ValueError(f"{n} activations are not a whole number of {block}-value blocks")
    out = np.empty((2 * k, n), np.float32)
    _with_residual_rows(x, block, out)
    return out


def dequantize_rows(q: np.ndarray, d: np.ndarray, n: int) -> np.ndarray:
    """The float32 activations the integer kernel actually multiplies (for references and tests)."""
    block = q.shape[1] // d.shape[1]
    return (q[:, :n].astype(np.float32).reshape(q.shape[0], -1, block)
            * d[:, : n // block, None]).reshape(q.shape[0], n)

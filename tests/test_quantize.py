"""cpu_kernels quantize: gguf-py-exact where gguf-py defines a quantizer, step-size-bounded elsewhere."""
from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from cpu_kernels.dequant import dequantize
from cpu_kernels.formats import FORMATS, UnsupportedQuantType
from cpu_kernels.quantize import quantize

GGUF_DEFINED = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
QUANT_TYPES = tuple(T(q) for q in FORMATS if T(q) not in (T.F32, T.F16, T.BF16))


def gguf_bytes(x, qtype):
    return np.ascontiguousarray(gguf_quantize(x, qtype)).view(np.uint8).reshape(x.shape[0], -1)


def test_f16_rounding_matches_numpy():
    """float32 -> float16 on random bit patterns across the whole range, plus the boundaries."""
    rng = np.random.default_rng(20)
    bits = rng.integers(0, 2**32, 400_000, dtype=np.uint64).astype(np.uint32)
    # concentrate on exponents where half rounding is delicate: subnormal, normal, overflow
    near = (rng.integers(95, 145, 400_000, dtype=np.uint32) << 23) | (bits & np.uint32(0x807FFFFF))
    edges = np.array([0.0, -0.0, 65504.0, 65519.996, 65520.0, -65520.0, 2.0**-24, 2.0**-25, 3 * 2.0**-25,
                      2.0**-14, 2.0**-14 - 2.0**-25, np.inf, -np.inf, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11],
                     dtype=np.float32)
    x = np.concatenate([bits.view(np.float32), near.view(np.float32), edges])
    got = quantize(x, T.F16).view(np.uint16)[0]
    with np.errstate(over="ignore"):
        expected = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], expected[~nan])
    assert np.isnan(got[nan].view(np.float16)).all()


def _gguf_reference_inputs(rng, n_rows, n_cols):
    """Gaussian rows of assorted magnitudes, an all-zero block, and rows on a half-integer grid whose
    extreme is pinned so that the scale is exactly 1 or 1/2 and rounding ties really happen."""
    x = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
    x *= (10.0 ** rng.uniform(-3, 3, (n_rows, 1))).astype(np.float32)
    x[0, :32] = 0
    grid = (rng.integers(-15, 16, (2, n_cols)) / 2).astype(np.float32)
    grid[:, ::32] = -8.0                    # Q4_0: d = -8 / -8 = 1; Q8_0: x*id = x*127/8 ...
    grid[1, 1::32] = 127.0                  # ... and here Q8_0's d = 1, so halves are exact ties
    return np.concatenate([x, grid])


@pytest.mark.parametrize("qtype", GGUF_DEFINED, ids=lambda t: t.name)
@pytest.mark.parametrize("n_rows", [1, 5, 17])
def test_matches_gguf_quantize(qtype, n_rows):
    rng = np.random.default_rng([int(qtype), n_rows])
    x = _gguf_reference_inputs(rng, n_rows, 256)
    assert np.array_equal(quantize(x, qtype), gguf_bytes(x, qtype))


def test_bf16_specials_match_gguf():
    rng = np.random.default_rng(21)
    bits = rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32)     # NaNs, Infs, subnormals
    x = bits.view(np.float32).reshape(1, -1)
    assert np.array_equal(quantize(x, T.BF16), gguf_bytes(x, T.BF16))


def nominal_steps(x, qtype):
    """The quantization step of the plain rule for each (sub-)block of the format:

    - affine formats (q in 0..nmax, value = step*q - offset): step = (max - min) / nmax over the
      sub-block; K-quants subtract a non-negative min, so their range always includes 0;
    - symmetric formats (q in -L..L-1, the largest |x| mapped to -L): step = max|x| / L;
    - IQ4 (16 non-linear levels spanning -127..113): the largest |x| maps to 127 and the levels
      average 16 units apart, so step = max|x| * 16 / 127."""
    def blocks(n):
        return x.reshape(-1, n)

    def affine(n, nmax, through_zero):
        b = blocks(n)
        lo = np.minimum(b.min(1), 0) if through_zero else b.min(1)
        return (b.max(1) - lo) / nmax

    def symmetric(n, levels):
        return np.abs(blocks(n)).max(1) / levels

    return {
        T.Q4_0: lambda: symmetric(32, 8), T.Q5_0: lambda: symmetric(32, 16),
        T.Q8_0: lambda: symmetric(32, 127),
        T.Q4_1: lambda: affine(32, 15, False), T.Q5_1: lambda: affine(32, 31, False),
        T.Q2_K: lambda: affine(16, 3, True), T.Q4_K: lambda: affine(32, 15, True),
        T.Q5_K: lambda: affine(32, 31, True),
        T.Q3_K: lambda: symmetric(16, 4), T.Q6_K: lambda: symmetric(16, 32),
        T.IQ4_NL: lambda: symmetric(32, 127) * 16, T.IQ4_XS: lambda: symmetric(32, 127) * 16,
    }[qtype]()


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_round_trip_error_within_step_bound(qtype):
    """Round-off of a step-s uniform quantizer has RMS s/sqrt(12). The bound is that prediction over
    the actual blocks of the input, plus 5% for rounding d, dmin to f16 and the sub-block scales to
    4/6/8 bits. gguf-py's quantizers land at 0.96-1.01x of it (the extreme element is exact, but
    levels -8..7 clip the opposite extreme a little); the searched K-quant/IQ4 scales at 0.75-0.95x.
    A wrong scale, packing or offset breaks it by far."""
    rng = np.random.default_rng(100 + int(qtype))
    n_rows, n_cols = 12, 4096          # long rows: the RMS of each row is within ~1% of its expectation
    x = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
    x *= (10.0 ** rng.uniform(-2, 2, (n_rows, 1))).astype(np.float32)
    raw = quantize(x, qtype)
    assert raw.shape == (n_rows, FORMATS[int(qtype)].row_bytes(n_cols))
    y = dequantize(raw, qtype, n_cols)
    y_gguf = gguf_dequantize(raw, qtype).reshape(y.shape)
    assert np.array_equal(y.view(np.uint32), y_gguf.view(np.uint32))
    for r in range(n_rows):          # rows differ in scale by 10^4: check each on its own
        predicted = np.sqrt(np.mean(nominal_steps(x[r], qtype) ** 2) / 12)
        rms = np.sqrt(np.mean((y[r].astype(np.float64) - x[r]) ** 2))
        assert rms <= 1.05 * predicted, (r, rms / predicted)


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_zero_and_constant_rows(qtype):
    n_cols = 512
    x = np.zeros((3, n_cols), dtype=np.float32)
    x[1] = 0.75
    x[2] = -3.0
    y = dequantize(quantize(x, qtype), qtype, n_cols)
    assert (y[0] == 0).all()
    # a constant row is one level of every format, up to the f16 rounding of its scale
    np.testing.assert_allclose(y[1:], x[1:], rtol=2e-3)


def test_bad_inputs():
    with pytest.raises(UnsupportedQuantType):
        quantize(np.zeros((1, 256), dtype=np.float32), T.IQ2_XXS)
    with pytest.raises(ValueError):
        quantize(np.zeros((1, 100), dtype=np.float32), T.Q4_K)

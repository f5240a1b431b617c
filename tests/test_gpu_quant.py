"""gpu_kernels.quant.dequantize_torch must be bitwise gguf-py's `gguf.quants.dequantize`."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from cpu_kernels.quantize import quantize
from gpu_kernels.quant import QUANTIZED_TYPES, SUPPORTED_TYPES, block_shape, dequantize_torch, row_bytes
from hybridrt.files.gguf_file import GGUFFile
from tests.real_models import GEMMA3, SMOLLM2, require

ALL = [T(q) for q in SUPPORTED_TYPES]


pytestmark = pytest.mark.usefixtures("single_thread")

FLOATS = (T.F32, T.F16, T.BF16)

# Byte offsets of the float16 scales inside one block of each quantized type.
F16_SCALES = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.IQ4_NL: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_XS: (0,),
}


def reference(raw: np.ndarray, qtype: int, n_cols: int) -> np.ndarray:
    return gguf_dequantize(raw, T(qtype)).reshape(raw.shape[0], n_cols).astype(np.float32, copy=False)


def assert_bitwise(got: torch.Tensor, expected: np.ndarray, what: str = ""):
    """Same bits, except that a NaN only has to stay a NaN: torch's f16 -> f32 conversion returns
    one canonical NaN where numpy keeps the payload (no real weight is a NaN)."""
    got = got.cpu().numpy()
    assert got.dtype == np.float32 and got.shape == expected.shape, what
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(got), nan), what
    mismatch = (got.view(np.uint32) != expected.view(np.uint32)) & ~nan
    assert not mismatch.any(), f"{what}: {mismatch.sum()} of {mismatch.size} differ, first at {np.argwhere(mismatch)[0]}"


def cols_for(qtype: int, n_blocks: int) -> int:
    elems, _ = block_shape(qtype)
    return n_blocks * (elems if elems > 1 else 32)


def quantized_rows(rng, qtype: int, n_rows: int, n_cols: int) -> np.ndarray:
    """Valid blocks: cpu_kernels' quantizer on Gaussian rows with spread-out magnitudes."""
    x = rng.standard_normal((n_rows, n_cols)) * 10.0 ** rng.uniform(-4, 2, (n_rows, 1))
    return quantize(x.astype(np.float32), qtype)


def random_bytes(rng, qtype: int, n_rows: int, n_cols: int) -> np.ndarray:
    """Every payload bit pattern (all 6-bit scales, hmask bits, signs), with finite f16 scales
    spanning subnormals to 10; float types get raw random bits, NaN and Inf included."""
    elems, nbytes = block_shape(qtype)
    raw = rng.integers(0, 256, (n_rows, n_cols // elems, nbytes), dtype=np.uint8)
    for off in F16_SCALES.get(T(qtype), ()):
        mag = 10.0 ** rng.uniform(-7, 1, raw.shape[:2] + (1,))
        raw[:, :, off:off + 2] = (rng.standard_normal(mag.shape) * mag).astype(np.float16).view(np.uint8)
    return raw.reshape(n_rows, -1)


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
@pytest.mark.parametrize("n_rows,n_blocks", [(1, 1), (5, 3), (33, 2)])
def test_quantized_blocks_match_gguf(qtype, n_rows, n_blocks):
    rng = np.random.default_rng([int(qtype), n_rows, n_blocks])
    n_cols = cols_for(qtype, n_blocks)
    raw = quantized_rows(rng, qtype, n_rows, n_cols)
    assert_bitwise(dequantize_torch(torch.from_numpy(raw), qtype, n_cols), reference(raw, qtype, n_cols), qtype.name)


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_random_bytes_match_gguf(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    n_cols = cols_for(qtype, 4)
    raw = random_bytes(rng, qtype, 64, n_cols)
    assert_bitwise(dequantize_torch(torch.from_numpy(raw), qtype, n_cols), reference(raw, qtype, n_cols), qtype.name)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.BF16], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_output_dtype_and_out_buffer(qtype, dtype):
    """Lower-precision results are the float32 values rounded once; `out` is filled in place."""
    rng = np.random.default_rng(7)
    n_cols = cols_for(qtype, 2)
    raw = torch.from_numpy(quantized_rows(rng, qtype, 9, n_cols))
    expected = torch.from_numpy(reference(raw.numpy(), qtype, n_cols)).to(dtype)
    got = dequantize_torch(raw, qtype, n_cols, dtype)
    assert got.dtype == dtype and torch.equal(got, expected)
    out = torch.full((9, n_cols), float("nan"), dtype=dtype)
    assert dequantize_torch(raw, qtype, n_cols, dtype, out=out) is out
    assert torch.equal(out, expected)


def test_row_slices_of_a_larger_tensor():
    """A tile is a row slice of the device copy: decoding it must not depend on where it starts."""
    rng = np.random.default_rng(3)
    raw = torch.from_numpy(quantized_rows(rng, T.Q4_K, 40, 512))
    whole = dequantize_torch(raw, T.Q4_K, 512)
    assert torch.equal(dequantize_torch(raw[13:29], T.Q4_K, 512), whole[13:29])


def test_float_result_is_not_an_alias_of_the_bytes():
    raw = torch.from_numpy(np.ones((2, 4), dtype=np.float32).view(np.uint8).copy())
    values = dequantize_torch(raw, T.F32, 4)
    values.zero_()
    assert raw.view(torch.float32).eq(1).all()


def test_bad_inputs_are_named():
    raw = torch.zeros(2, row_bytes(T.Q4_K, 256), dtype=torch.uint8)
    with pytest.raises(ValueError, match="Q4_K"):
        dequantize_torch(raw, T.Q4_K, 512)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_torch(raw.float(), T.Q4_K, 256)
    with pytest.raises(ValueError, match="IQ2_XXS"):
        dequantize_torch(raw, T.IQ2_XXS, 256)


def test_every_quantized_type_is_covered():
    assert set(QUANTIZED_TYPES) | {int(t) for t in FLOATS} == set(SUPPORTED_TYPES)
    assert len(SUPPORTED_TYPES) == 15


@pytest.mark.parametrize("path", [SMOLLM2, GEMMA3], ids=lambda p: p.name)
def test_real_model_tensors_match_gguf(path):
    """The first 2-D tensor of each type in the file (at most 512 rows of it), and one whole."""
    gguf = GGUFFile(require(path))
    seen = set()
    for name, info in gguf.tensors.items():
        if len(info.shape) != 2 or info.qtype in seen:
            continue
        seen.add(info.qtype)
        raw = gguf.tensor_bytes(name)[:512]
        got = dequantize_torch(torch.from_numpy(raw.copy()), info.qtype, info.shape[0])
        assert_bitwise(got, reference(raw, info.qtype, info.shape[0]), name)
    assert len(seen) >= 2

"""cpu_kernels dequantize must be bit-identical to gguf-py's `gguf.quants.dequantize`."""
from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import IQ4_NL as GGUF_IQ4_NL
from gguf.quants import dequantize as gguf_dequantize

from cpu_kernels import blocks
from cpu_kernels.dequant import SERIAL_ROWS, RowGather, dequantize, dequantize_rows, gather_rows
from cpu_kernels.formats import FORMATS, UnsupportedQuantType
from tests.real_models import GEMMA3, SMOLLM2, require

# Byte offsets of the float16 scales inside one block of each quantized type.
F16_SCALE_OFFSETS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.IQ4_NL: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_XS: (0,),
}
FLOAT_TYPES = (T.F32, T.F16, T.BF16)


def random_tensor(rng, qtype, n_rows, n_blocks):
    """(raw uint8 (n_rows, row_bytes), n_cols): random payload bytes, finite random f16 scales.

    Float types get fully random bit patterns (NaN and Inf included): both sides keep them bitwise.
    Scales span 1e-7..10 so f16 subnormals appear too."""
    fmt = FORMATS[int(qtype)]
    n_cols = n_blocks * fmt.block_elems * (32 if qtype in FLOAT_TYPES else 1)
    raw = rng.integers(0, 256, (n_rows, n_cols // fmt.block_elems, fmt.block_bytes), dtype=np.uint8)
    for off in F16_SCALE_OFFSETS.get(qtype, ()):
        mag = 10.0 ** rng.uniform(-7, 1, (n_rows, raw.shape[1], 1))
        scale = (rng.standard_normal(mag.shape) * mag).astype(np.float16)
        raw[:, :, off:off + 2] = scale.view(np.uint8)
    return raw.reshape(n_rows, -1), n_cols


def assert_bit_equal(got, expected, what=""):
    assert got.dtype == np.float32 and expected.dtype == np.float32, what
    assert got.shape == expected.shape, what
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), what


def reference(raw, qtype, n_cols):
    return gguf_dequantize(raw, T(qtype)).reshape(raw.shape[0], n_cols)


@pytest.mark.parametrize("qtype", [T(q) for q in FORMATS], ids=lambda t: t.name)
@pytest.mark.parametrize("n_rows,n_blocks", [(1, 1), (3, 2), (7, 3), (16, 1)])
def test_random_blocks_match_gguf(qtype, n_rows, n_blocks):
    rng = np.random.default_rng([int(qtype), n_rows, n_blocks])
    raw, n_cols = random_tensor(rng, qtype, n_rows, n_blocks)
    assert_bit_equal(dequantize(raw, qtype, n_cols), reference(raw, qtype, n_cols))


@pytest.mark.parametrize("qtype", [T(q) for q in FORMATS], ids=lambda t: t.name)
def test_block_decoder_matches_gguf(qtype):
    """The per-block decoders others call directly: one block at an odd output offset."""
    rng = np.random.default_rng(1000 + int(qtype))
    raw, _ = random_tensor(rng, qtype, 1, 2)
    fmt = FORMATS[int(qtype)]
    decode = getattr(blocks, f"decode_{qtype.name.lower()}")
    src = np.ascontiguousarray(raw[0])
    out = np.full(fmt.block_elems + 5, -1.0, dtype=np.float32)
    decode(src, fmt.block_bytes, out, 3)                                   # the second block
    second = src[fmt.block_bytes:2 * fmt.block_bytes].reshape(1, -1)
    expected = reference(second, qtype, fmt.block_elems)[0]
    assert_bit_equal(out[3:3 + fmt.block_elems], expected)
    assert (out[:3] == -1).all() and (out[3 + fmt.block_elems:] == -1).all()


def test_every_f16_pattern():
    raw = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.uint8).reshape(1, -1)
    assert_bit_equal(dequantize(raw, T.F16, 65536), reference(raw, T.F16, 65536))


def test_iq4_levels_are_ggmls():
    assert blocks.IQ4_LEVELS.tolist() == list(GGUF_IQ4_NL.kvalues)


def test_gather_rows_and_ranges():
    rng = np.random.default_rng(7)
    raw, n_cols = random_tensor(rng, T.Q4_K, 11, 2)
    full = dequantize(raw, T.Q4_K, n_cols)
    ids = np.array([10, 0, 3, 3, 7], dtype=np.int64)
    assert_bit_equal(gather_rows(raw, T.Q4_K, n_cols, ids), full[ids])
    assert_bit_equal(dequantize_rows(raw, T.Q4_K, n_cols, 4, 9), full[4:9])
    assert dequantize_rows(raw, T.Q4_K, n_cols, 5, 5).shape == (0, n_cols)
    assert_bit_equal(dequantize(raw.reshape(-1), T.Q4_K, n_cols), full)       # flat bytes
    readonly = raw.copy()
    readonly.flags.writeable = False                                       # mmap views are read-only
    assert_bit_equal(dequantize(readonly, T.Q4_K, n_cols), full)
    many = rng.integers(0, 11, SERIAL_ROWS + 5)                          # past the serial decode's rows
    assert_bit_equal(gather_rows(raw, T.Q4_K, n_cols, many), full[many])
    for bad in ([11], [-1], [0] * SERIAL_ROWS + [11], [-1] + [0] * SERIAL_ROWS):    # both decode paths
        with pytest.raises(IndexError):
            gather_rows(raw, T.Q4_K, n_cols, np.array(bad))
    gather = RowGather(readonly, T.Q4_K, n_cols)                           # an embedding's: reused
    assert_bit_equal(gather(ids), full[ids])
    assert_bit_equal(gather(ids[:1]), full[ids[:1]])
    with pytest.raises(IndexError):
        dequantize_rows(raw, T.Q4_K, n_cols, 3, 12)


def test_bad_inputs():
    raw = np.zeros((2, 18), dtype=np.uint8)
    with pytest.raises(UnsupportedQuantType, match="IQ2_XXS"):
        dequantize(raw, T.IQ2_XXS, 256)
    with pytest.raises(ValueError):
        dequantize(raw, T.Q4_0, 64)          # rows of 18 bytes hold 32 values, not 64
    with pytest.raises(ValueError):
        dequantize(raw, T.Q4_0, 48)          # not a whole number of blocks


def _sample_tensors(path, per_type, max_rows):
    """(name, qtype, n_cols, raw) for the first `per_type` tensors of each type, first rows only."""
    from hybridrt.files.gguf_file import GGUFFile

    f = GGUFFile(path)
    seen: dict[int, int] = {}
    for info in f.tensors.values():
        if seen.get(info.qtype, 0) >= per_type:
            continue
        seen[info.qtype] = seen.get(info.qtype, 0) + 1
        yield info.name, info.qtype, info.shape[0], f.tensor_bytes(info.name)[:max_rows]


@pytest.mark.parametrize("path", [SMOLLM2, GEMMA3], ids=["smollm2", "gemma3"])
def test_real_tensors_sample(path):
    require(path)
    types = set()
    for name, qtype, n_cols, raw in _sample_tensors(path, per_type=2, max_rows=512):
        assert_bit_equal(dequantize(raw, qtype, n_cols), reference(raw, qtype, n_cols), name)
        types.add(T(qtype).name)
    assert types >= {"F32", "Q8_0"}


@pytest.mark.slow
@pytest.mark.parametrize("path", [SMOLLM2, GEMMA3], ids=["smollm2", "gemma3"])
def test_every_real_tensor(path):
    from gguf import GGUFReader

    require(path)
    for t in GGUFReader(path).tensors:
        n_cols = int(t.shape[0])            # gguf-py's shape is in ggml order: row length first
        raw = np.asarray(t.data).view(np.uint8).reshape(-1, FORMATS[int(t.tensor_type)].row_bytes(n_cols))
        got = dequantize(raw, int(t.tensor_type), n_cols)
        assert_bit_equal(got, gguf_dequantize(raw, t.tensor_type).reshape(got.shape), t.name)

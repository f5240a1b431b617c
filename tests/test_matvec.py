"""cpu_kernels.matvec: accuracy against gguf-py's dequantize, bit identity across k and threads.

The float64-reference accuracy test runs the exact (float activation) path; bit identity holds for
both paths. The integer path's own accuracy tests are in test_matvec_int.py."""
from __future__ import annotations

import numba
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize

from cpu_kernels.formats import SUPPORTED_TYPES, UnsupportedQuantType, format_of
from cpu_kernels.matvec import decode_chunk, float_tag, matvec
from cpu_kernels.matvec_testdata import random_weights

ALL_TYPES = [T(t) for t in SUPPORTED_TYPES]
FLOAT_TYPES = (T.F32, T.F16, T.BF16)


def _cols(qtype, n_blocks_256=5):
    """A row length that is not a multiple of the 1024-column chunk (and, for float types, not of 16)."""
    return 256 * n_blocks_256 + (7 if qtype in FLOAT_TYPES else 0)


def _reference(w, qtype, x):
    return x.astype(np.float64) @ dequantize(w, qtype).astype(np.float64).T


@pytest.fixture(autouse=True)
def _two_threads():
    before = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    yield
    numba.set_num_threads(before)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matches_float64_reference(qtype):
    rng = np.random.default_rng(1000 + int(qtype))
    rows, cols = 37, _cols(qtype)                      # 37 rows: a partial 4-row tile
    w = random_weights(qtype, rows, cols, rng)
    for k in (1, 3, 8, 19):
        x = rng.standard_normal((k, cols)).astype(np.float32)
        y = matvec(w, qtype, x, exact=True)
        ref = _reference(w, qtype, x)
        assert y.shape == (k, rows) and y.dtype == np.float32
        rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
        assert rel <= 1e-5, f"{qtype.name} k={k}: relative error {rel:.2e}"


@pytest.mark.parametrize("exact", [True, False], ids=["float", "int"])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_token_result_does_not_depend_on_batch_or_threads(qtype, exact):
    rng = np.random.default_rng(2000 + int(qtype))
    rows, cols = 22, _cols(qtype, 6)
    w = random_weights(qtype, rows, cols, rng)
    x = rng.standard_normal((16, cols)).astype(np.float32)
    x[5] *= 1e3                                        # magnitudes differ between tokens
    alone = np.stack([matvec(w, qtype, x[t:t + 1], exact=exact)[0] for t in range(16)])
    for threads in (1, 2):
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        for k in (1, 2, 3, 4, 5, 8, 16):
            for start in sorted({0, 1, 16 - k}):
                if start + k > 16:
                    continue
                y = matvec(w, qtype, x[start:start + k], exact=exact)
                assert np.array_equal(y.view(np.uint32), alone[start:start + k].view(np.uint32)), \
                    f"{qtype.name}: tokens {start}..{start + k - 1} differ in a batch of {k}, {threads} threads"


def test_writes_into_preallocated_out():
    rng = np.random.default_rng(3)
    w = random_weights(T.Q4_K, 9, 512, rng)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    buf = np.full((8, 9), np.nan, np.float32)          # sized for k_max = 8; a prefix view is C-contiguous
    y = matvec(w, T.Q4_K, x, buf[:3])
    assert np.shares_memory(y, buf) and not np.isnan(buf[:3]).any() and np.isnan(buf[3:]).all()
    assert np.array_equal(y, matvec(w, T.Q4_K, x))


@pytest.mark.parametrize("exact", [True, False], ids=["float", "int"])
def test_zero_copy_mmap_rows(tmp_path, exact):
    rng = np.random.default_rng(4)
    w = random_weights(T.Q6_K, 13, 768, rng)
    path = tmp_path / "w.bin"
    path.write_bytes(b"\0" * 40 + w.tobytes())        # an unaligned offset, as tensors in a GGUF file
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=40, shape=w.shape)
    x = rng.standard_normal((2, 768)).astype(np.float32)
    assert np.array_equal(matvec(mm, T.Q6_K, x, exact=exact), matvec(w, T.Q6_K, x, exact=exact))


def test_rejects_bad_operands():
    rng = np.random.default_rng(5)
    w = random_weights(T.Q8_0, 4, 64, rng)
    with pytest.raises(ValueError, match="bytes per row"):
        matvec(w, T.Q8_0, np.zeros((1, 96), np.float32))
    with pytest.raises(ValueError, match="out must be"):
        matvec(w, T.Q8_0, np.zeros((2, 64), np.float32), np.zeros((1, 4), np.float32))
    with pytest.raises(UnsupportedQuantType, match="Q8_1"):
        matvec(w, T.Q8_1, np.zeros((1, 64), np.float32))


def test_format_table_matches_kernel_coverage():
    # Every type the format table admits has a kernel: a type added there must be added here too.
    rng = np.random.default_rng(6)
    for qtype in ALL_TYPES:
        fmt = format_of(qtype)
        cols = 256
        w = random_weights(qtype, 4, cols, rng)
        assert w.shape == (4, fmt.row_bytes(cols))
        y = matvec(w, qtype, np.ones((1, cols), np.float32))
        assert np.isfinite(y).all() and np.abs(y).sum() > 0


@numba.njit
def _decode_tagged(tagged, src, nb, dst):
    decode_chunk(tagged, src, 0, nb, dst)


def test_decode_chunk_among_a_type_set():
    """decode_chunk given (qtype,) + float_tag(types) carries only those types' decoders (the fused
    kernels' float path, see layer_fused.kernel_types): a type in the set decodes as the plain call,
    one outside it writes nothing, and a type with no decoder is refused when the tag is built."""
    rng = np.random.default_rng(7)
    tag = float_tag([T.F32, T.Q4_K])
    for qtype in (T.F32, T.Q4_K):
        fmt = format_of(qtype)
        w = random_weights(qtype, 1, 512, rng)
        nb = 512 // fmt.block_elems
        want, got = np.zeros(512, np.float32), np.zeros(512, np.float32)
        decode_chunk(int(qtype), w[0], 0, nb, want)
        _decode_tagged((int(qtype),) + tag, w[0], nb, got)
        assert np.array_equal(got, want) and np.abs(want).sum() > 0
    w = random_weights(T.Q8_0, 1, 512, rng)
    got = np.zeros(512, np.float32)
    _decode_tagged((int(T.Q8_0),) + tag, w[0], 16, got)
    assert not got.any()
    with pytest.raises(ValueError, match="no chunk decoder"):
        float_tag([T.Q8_1])

"""Synthetic weight matrices in every supported type, for matvec tests and benchmarks.

gguf-py can quantize the float and 32-weight types but not the K-quants or IQ4 types, so quantized
matrices are random bytes with every float16 block field (scale d, min dmin/m) overwritten by a
finite value of a realistic size: all bit patterns of the packed weights and sub-block scales
occur, and no block decodes to inf or NaN.
"""
from __future__ import annotations

import numpy as np
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import quantize

from .formats import QUANT_TYPES, format_of

# Byte offsets of the float16 fields in each block (formats.QUANT_TYPES).
F16_FIELDS = {t.qtype: t.f16_fields for t in QUANT_TYPES}


def random_weights(qtype: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """A (rows, row_bytes) uint8 matrix of type `qtype` with `cols` weights per row."""
    qtype = T(int(qtype))
    fmt = format_of(qtype)
    if not fmt.quantized:
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype).view(np.uint8)
    w = rng.integers(0, 256, (rows, fmt.row_bytes(cols)), dtype=np.uint8)
    blocks = w.reshape(rows, cols // fmt.block_elems, fmt.block_bytes)
    for off in F16_FIELDS[qtype]:
        scale = rng.uniform(1e-3, 2e-2, blocks.shape[:2]) * rng.choice([-1.0, 1.0], blocks.shape[:2])
        blocks[:, :, off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    return w

"""Dequantize GGUF tensors (raw row bytes, usually a zero-copy view of the mmap) to float32.

Results are bit-identical to gguf-py's `gguf.quants.dequantize`. Work is split over rows with
Numba's prange; the number of threads is whatever `numba.set_num_threads` says.
"""
from __future__ import annotations

import numpy as np

from .blocks import decode_rows
from .formats import format_of, type_tag


def _flat_rows(raw: np.ndarray, row_bytes: int) -> tuple[np.ndarray, int]:
    """raw as a 1-D contiguous uint8 array, and its row count."""
    if raw.dtype != np.uint8:
        raise TypeError(f"raw tensor bytes must be uint8, got {raw.dtype}")
    if raw.ndim == 2 and raw.shape[1] != row_bytes:
        raise ValueError(f"rows of {raw.shape[1]} bytes, expected {row_bytes}")
    flat = np.ascontiguousarray(raw).reshape(-1).view()
    # Tensors come as read-only mmap views; make every input read-only so Numba compiles (and
    # caches) one specialisation instead of two.
    flat.flags.writeable = False
    if flat.size % row_bytes:
        raise ValueError(f"{flat.size} bytes is not a whole number of {row_bytes}-byte rows")
    return flat, flat.size // row_bytes


def gather_rows(raw: np.ndarray, qtype: int, n_cols: int, row_ids: np.ndarray) -> np.ndarray:
    """Rows row_ids of a (rows, row_bytes) tensor, dequantized: float32 (len(row_ids), n_cols)."""
    fmt = format_of(qtype)
    flat, n_rows = _flat_rows(raw, fmt.row_bytes(n_cols))
    row_ids = np.asarray(row_ids, dtype=np.int64).reshape(-1)
    if row_ids.size and (row_ids.min() < 0 or row_ids.max() >= n_rows):
        raise IndexError(f"row id out of range [0, {n_rows})")
    out = np.empty((row_ids.size, n_cols), dtype=np.float32)
    if row_ids.size:
        decode_rows(flat, fmt.row_bytes(n_cols), type_tag(fmt.qtype), n_cols, row_ids, out)
    return out


def dequantize_rows(raw: np.ndarray, qtype: int, n_cols: int, start: int, stop: int) -> np.ndarray:
    """Rows start..stop-1, dequantized: float32 (stop - start, n_cols)."""
    fmt = format_of(qtype)
    _, n_rows = _flat_rows(raw, fmt.row_bytes(n_cols))
    if not 0 <= start <= stop <= n_rows:
        raise IndexError(f"rows [{start}, {stop}) outside [0, {n_rows})")
    return gather_rows(raw, qtype, n_cols, np.arange(start, stop, dtype=np.int64))


def dequantize(raw: np.ndarray, qtype: int, n_cols: int) -> np.ndarray:
    """A whole tensor of uint8 rows (rows, row_bytes) or its flat bytes, dequantized: (rows, n_cols)."""
    fmt = format_of(qtype)
    _, n_rows = _flat_rows(raw, fmt.row_bytes(n_cols))
    return gather_rows(raw, qtype, n_cols, np.arange(n_rows, dtype=np.int64))

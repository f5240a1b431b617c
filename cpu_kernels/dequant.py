"""Dequantize GGUF tensors (raw row bytes, usually a zero-copy view of the mmap) to float32.

Results are bit-identical to gguf-py's `gguf.quants.dequantize`. Work is split over rows with
Numba's prange; the number of threads is whatever `numba.set_num_threads` says.
"""
from __future__ import annotations

import numpy as np

from .blocks import decode_rows, decode_rows_serial
from .formats import format_of, type_tag

SERIAL_ROWS = 8     # gathers of at most this many rows (a step's embeddings) decode on the calling thread


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
    return RowGather(raw, qtype, n_cols)(row_ids)


class RowGather:
    """gather_rows of one tensor, its flat bytes prepared once: a decode step's embedding lookup
    runs right after the step streamed the weights out of every cache, where each numpy call on
    the way (the flat view, a bounds check by min/max) costs 10-25 us."""

    def __init__(self, raw: np.ndarray, qtype: int, n_cols: int):
        fmt = format_of(qtype)
        self.tag, self.n_cols, self.row_bytes = type_tag(fmt.qtype), n_cols, fmt.row_bytes(n_cols)
        self.flat, self.n_rows = _flat_rows(raw, self.row_bytes)

    def check_range(self, lo: int, hi: int) -> None:
        """Row ids from lo to hi (the least and the greatest) are rows of the tensor."""
        if lo < 0 or hi >= self.n_rows:
            raise IndexError(f"row id out of range [0, {self.n_rows})")

    def __call__(self, row_ids: np.ndarray) -> np.ndarray:
        row_ids = np.asarray(row_ids, dtype=np.int64).reshape(-1)
        out = np.empty((row_ids.size, self.n_cols), dtype=np.float32)
        if not row_ids.size:
            return out
        if row_ids.size <= SERIAL_ROWS:     # a decode step's few ids: Python's min / max cost less than numpy's
            ids = row_ids.tolist()
            self.check_range(min(ids), max(ids))
            decode_rows_serial(self.flat, self.row_bytes, self.tag, self.n_cols, row_ids, out)
        else:
            self.check_range(row_ids.min(), row_ids.max())
            decode_rows(self.flat, self.row_bytes, self.tag, self.n_cols, row_ids, out)
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

"""The k largest values of each logits row: sampling's top-k (hybridrt.decoding.sampling.top_k_rows: one
row a sampled token, 262,144 wide for Gemma 3) and the train-mtp teacher's (256 rows a step).

torch.topk took 43-56 ms a teacher step for Gemma 3 (256 x 262144 bfloat16 logits, 2 threads), about
a tenth of the step, and 434 us of a sampled decode step (one float32 row, one thread). Here each
row is streamed once: the k best so far kept sorted, and a chunk of 256 values looked at one by
one only when its largest beats the smallest kept; past the first chunks almost none does in real
logits, so the pass runs at the speed of an integer max over the row. (Rows rising from start to
end are the worst case, every value inserted: k times the work, still exact.)

The values are compared as integers: a float's bits, with the magnitude bits flipped when the sign
is set, order finite floats as the floats do (-0.0 just below +0.0). Ties keep the lower index
first, so the result does not depend on threads or on how LLVM vectorized the scan.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .simd_int import CACHE

CHUNK = 256      # values whose integer max is taken before any is looked at alone


@njit(cache=CACHE, nogil=True, inline="always")
def _order_key(bits, shift):
    """An int32 that orders float bit patterns (bfloat16: shift 15, float32: 31) as the floats."""
    x = np.int32(bits)
    mask = np.int32((np.int64(1) << shift) - 1)
    return (x & mask) ^ -((x >> shift) & np.int32(1))


@njit(cache=CACHE, nogil=True, inline="always")
def _keep(keys, ids, n_kept, key, idx):
    """Insert (key, idx) into the sorted kept lists (largest first; an equal key goes after the ones
    there, which came from lower indices). Returns the new count (at most len(keys))."""
    k = keys.shape[0]
    j = n_kept if n_kept < k else k - 1
    while j > 0 and keys[j - 1] < key:
        keys[j], ids[j] = keys[j - 1], ids[j - 1]
        j -= 1
    keys[j], ids[j] = key, idx
    return n_kept + 1 if n_kept < k else k


@njit(cache=CACHE, nogil=True, parallel=True)
def top_k_bits(bits, shift, ids):
    """ids[r] = the indices of the len(ids[r]) largest values of row r of `bits` (float bit patterns:
    uint16 bfloat16 with shift 15, uint32 float32 with shift 31), largest first, ties lower index
    first. Rows need at least ids.shape[1] values."""
    n_rows, n = bits.shape
    k = ids.shape[1]
    for r in prange(n_rows):
        row = bits[r]
        keys = np.empty(k, np.int32)
        kept = np.empty(k, np.int64)
        n_kept = 0
        for j in range(k):
            n_kept = _keep(keys, kept, n_kept, _order_key(row[j], shift), j)
        lo = k
        while lo < n:
            hi = min(lo + CHUNK, n)
            seg = row[lo:hi]
            best = _order_key(seg[0], shift)
            for j in range(1, hi - lo):
                best = max(best, _order_key(seg[j], shift))
            if best > keys[k - 1]:
                for j in range(hi - lo):
                    key = _order_key(seg[j], shift)
                    if key > keys[k - 1]:
                        n_kept = _keep(keys, kept, n_kept, key, lo + j)
            lo = hi
        for j in range(k):      # (a row assigned from an array compiles a formatted error message)
            ids[r, j] = kept[j]

"""The k-input quantized matvec: y[t] = W x[t] for k activation rows, one pass over W's bytes.

During a speculative verify step a CPU-resident layer sees k tokens. Decode is bound by reading
weights, so each weight chunk is decoded once (into a small float32 tile that stays in L1) and
applied to all k activation rows before the next chunk is read.

Kernel shape (`_matvec_kernel`): output rows are split into tiles of TILE_ROWS (4) rows, tiles into
contiguous groups, groups run in parallel (prange). Per tile, columns go in CHUNK (1024) steps:
decode the 4 rows' chunk, then `dot_tile_T` (matvec_simd) for tokens in groups of up to 4: 16 fma
accumulators, 8 vector loads per 16 fmas. A chunk's partial sums are added to `out` in chunk order.

Bit identity: a (token, row) result is the same sequence of float operations however many tokens
are in the call, where the token sits in it, and how many threads run (tiles, chunks and the
accumulator lanes are fixed; threads only change which core computes a tile). Tested for every type.

This float kernel is the exact path: activations stay float32, a result is within float32
rounding of the float64 product of the dequantized weights (tests: relative error <= 1e-5).
`matvec` runs it for `exact=True` and for the types matvec_int has no integer kernel for (float
and IQ types); otherwise the default is matvec_int's integer dot products on int8 activations.
"""
from __future__ import annotations

import functools

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from hybridrt.runtime.config import ENV

from . import matvec_float, matvec_kquants, matvec_legacy
from .formats import CHUNK_DECODER, format_of
from .matvec_amx import AMX, AMX_REFUSAL, matvec_amx_into, uses_amx
from .matvec_int import INT_TYPES, act_block, matvec_int_into
from .matvec_simd import LANES, TILE_ROWS, dot_tile_1, dot_tile_2, dot_tile_3, dot_tile_4
from .quantize_act import RESIDUAL_MAX_TOKENS, with_residual_rows

CHUNK = 1024        # columns decoded per step: 4 rows x 4 KiB of float32 stay in L1 with x's chunk
TOKEN_TILE = 4      # tokens per dot micro-kernel call (16 accumulators + 8 operands < 32 registers)
GROUPS_PER_THREAD = 4

# type -> chunk decoder (formats.QUANT_TYPES: decode_chunk_<kernel> of the three modules)
CHUNK_DECODERS = CHUNK_DECODER.bind({**vars(matvec_float), **vars(matvec_legacy), **vars(matvec_kquants)})


def _chunk_dispatch(decoders: list):
    """decode_chunk's body for (qtype, decoder) pairs: `if qtype == q: decoder(...) else: <the rest>`,
    one type per level. Every QUANT_TYPES row has a decoder (CHUNK_DECODER.bind checked it) and
    matvec / the fused kernels take a type only through formats.format_of, so the empty end of the
    chain is never reached."""
    if not decoders:
        @njit(nogil=True)
        def unreachable(qtype, src, b0, nb, dst):
            pass
        return unreachable
    (qt, decode), rest = decoders[0], _chunk_dispatch(decoders[1:])

    @njit(nogil=True)
    def dispatch(qtype, src, b0, nb, dst):
        if qtype == qt:
            decode(src, b0, nb, dst)
        else:
            rest(qtype, src, b0, nb, dst)
    return dispatch


_decode_chunk_by_type = _chunk_dispatch(list(CHUNK_DECODERS.items()))
_DECODER_TYPES = sorted(CHUNK_DECODERS)


def float_tag(qtypes) -> tuple:
    """A set of quant types as a compile-time constant for the float path, as int_blocks.types_tag
    is for the integer kernels: one element per CHUNK_DECODERS type (ascending), True where the type
    is in the set, 0.0 where not. decode_chunk and tile_products given (qtype,) + float_tag(...)
    compile only the set's decoders: all fifteen cost the 27B's cold compile ~20 s (docs/history.md,
    "Fewer compilations on a cold start"), while a Q4_K_M file's float-path matrices are F32 alone."""
    chosen = {int(q) for q in qtypes}
    unknown = chosen - set(_DECODER_TYPES)
    if unknown:
        raise ValueError(f"no chunk decoder for quant types {sorted(unknown)}")
    return tuple(True if qt in chosen else 0.0 for qt in _DECODER_TYPES)


@functools.cache
def _dispatch_among(chosen: frozenset):
    """decode_chunk's body for the types in `chosen` only (CHUNK_DECODERS' order); a type outside
    them writes nothing (fused.py's _covering refuses such a matrix at load time)."""
    return _chunk_dispatch([(qt, decode) for qt, decode in CHUNK_DECODERS.items() if qt in chosen])


def _decode_by_type(qtype, src, b0, nb, dst):
    raise NotImplementedError("_decode_by_type runs inside Numba kernels")


@overload(_decode_by_type)
def _decode_by_type_code(qtype, src, b0, nb, dst):
    """A plain integer qtype: the chain over every type; (qtype,) + float_tag(...): over the tag's."""
    if isinstance(qtype, types.Integer):
        def every(qtype, src, b0, nb, dst):
            _decode_chunk_by_type(qtype, src, b0, nb, dst)
        return every
    if not (isinstance(qtype, types.BaseTuple) and len(qtype) == 1 + len(_DECODER_TYPES)
            and isinstance(qtype[0], types.Integer)):
        raise TypeError(f"decode_chunk's qtype is an integer or (qtype,) + float_tag(...), not {qtype}")
    chain = _dispatch_among(frozenset(qt for qt, ty in zip(_DECODER_TYPES, qtype[1:])
                                      if isinstance(ty, types.Boolean)))

    def among(qtype, src, b0, nb, dst):
        chain(qtype[0], src, b0, nb, dst)
    return among


@njit(cache=True, nogil=True)
def decode_chunk(qtype, src, b0, nb, dst):
    """Blocks b0 .. b0+nb-1 of the row `src` (raw bytes) -> dst[: nb * block_elems] as float32.
    qtype: the type, or (type,) + float_tag(types) to compile only those types' decoders."""
    _decode_by_type(qtype, src, b0, nb, dst)


@njit(cache=True, nogil=True)
def dot_tokens(buf, x, t0, n_tok, c0, length, part):
    """part[t * R + r] = sum_i buf[r, i] * x[t0 + t, c0 + i] for t < n_tok (<= 4), i < length."""
    main = length - length % LANES
    if main > 0:
        if n_tok == 4:
            dot_tile_4(buf, x, t0, c0, main, part)
        elif n_tok == 3:
            dot_tile_3(buf, x, t0, c0, main, part)
        elif n_tok == 2:
            dot_tile_2(buf, x, t0, c0, main, part)
        else:
            dot_tile_1(buf, x, t0, c0, main, part)
    else:
        part[:] = 0.0
    # Tail of an unquantized row whose length is not a multiple of 16: in index order, per pair.
    for t in range(n_tok):
        for r in range(TILE_ROWS):
            s = part[t * TILE_ROWS + r]
            for i in range(main, length):
                s += buf[r, i] * x[t0 + t, c0 + i]
            part[t * TILE_ROWS + r] = s


@njit(cache=True, nogil=True, inline="always")
def tile_products(w, qtype, block_elems, r0, n_rows, x, buf, part, acc):
    """acc[t, r] = (W x[t])[r0 + r] for all k tokens and r < n_rows, chunk by chunk (qtype as
    decode_chunk takes it)."""
    k, n_in = x.shape
    for c0 in range(0, n_in, CHUNK):
        length = min(CHUNK, n_in - c0)
        for r in range(n_rows):
            decode_chunk(qtype, w[r0 + r], c0 // block_elems, length // block_elems, buf[r])
        for t0 in range(0, k, TOKEN_TILE):
            n_tok = min(TOKEN_TILE, k - t0)
            dot_tokens(buf, x, t0, n_tok, c0, length, part)
            for t in range(n_tok):
                for r in range(n_rows):
                    if c0 == 0:
                        acc[t0 + t, r] = part[t * TILE_ROWS + r]
                    else:
                        acc[t0 + t, r] += part[t * TILE_ROWS + r]


@njit(cache=True, nogil=True, parallel=True)
def _matvec_kernel(w, qtype, block_elems, x, out, n_groups):
    rows = w.shape[0]
    k = x.shape[0]
    n_tiles = (rows + TILE_ROWS - 1) // TILE_ROWS
    for g in prange(n_groups):
        buf = np.zeros((TILE_ROWS, CHUNK), np.float32)
        part = np.zeros(TOKEN_TILE * TILE_ROWS, np.float32)
        acc = np.zeros((k, TILE_ROWS), np.float32)
        for tile in range(g * n_tiles // n_groups, (g + 1) * n_tiles // n_groups):
            r0 = tile * TILE_ROWS
            n_rows = min(TILE_ROWS, rows - r0)
            tile_products(w, qtype, block_elems, r0, n_rows, x, buf, part, acc)
            for t in range(k):
                for r in range(n_rows):
                    out[t, r0 + r] = acc[t, r]


def n_groups_for(rows: int) -> int:
    """Parallel work items: a few per thread so a slow core does not hold up the call."""
    n_tiles = (rows + TILE_ROWS - 1) // TILE_ROWS
    return max(1, min(n_tiles, GROUPS_PER_THREAD * numba.get_num_threads()))


def check_operands(w: np.ndarray, qtype: int, x: np.ndarray, out: np.ndarray | None):
    """Validate shapes and dtypes; return (w as uint8, block_elems, x as C float32, out)."""
    fmt = format_of(qtype)
    if w.ndim != 2 or not w.flags.c_contiguous:
        raise ValueError(f"w must be a C-contiguous (rows, row_bytes) array, got {w.dtype} {w.shape}")
    if w.dtype != np.uint8:     # e.g. an F16 matrix as float16: the same bytes
        w = w.view(np.uint8)
    if w.flags.writeable:       # read-only as mmap views are: one Numba type, one compilation per kernel
        w = w.view()
        w.flags.writeable = False
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"x must be (k, n_in), got shape {x.shape}")
    k, n_in = x.shape
    if fmt.row_bytes(n_in) != w.shape[1]:
        raise ValueError(f"{fmt.name}: {n_in} inputs need {fmt.row_bytes(n_in)} bytes per row, w has {w.shape[1]}")
    rows = w.shape[0]
    if out is None:
        out = np.empty((k, rows), np.float32)
    elif out.shape != (k, rows) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32 of shape {(k, rows)}, got {out.dtype} {out.shape}")
    return w, fmt.block_elems, x, out


# The default of `exact` where a caller passes None (HYBRIDRT_EXACT_ACTIVATIONS=1: float activations
# everywhere, e.g. for a whole test session compared with a float64 reference); a loaded model's
# backends pass their RuntimeConfig's choice.
EXACT_DEFAULT = ENV.exact


def kernel_summary(exact: bool | None = None, residual: bool = False) -> str:
    """Which kernels run the mmap'd matrices in this process, in one line (bench reports it, as
    llama.cpp prints its system info). residual: whether some matrices take the second int8 pass."""
    if EXACT_DEFAULT if exact is None else exact:
        return "float32 activations (exact)"
    from .simd_int import ISA

    tiles = "AMX tiles for verify batches" if AMX else f"no AMX tiles ({AMX_REFUSAL})"
    second = ", a second int8 pass on attention / FFN-down inputs of decode steps" if residual else ""
    return f"int8 activations{second}, {ISA} integer dot products, {tiles}"


def use_int(qtype: int, exact: bool | None) -> bool:
    """Whether a call runs the integer kernel: not asked to be exact, and the type has one."""
    return not (EXACT_DEFAULT if exact is None else exact) and int(qtype) in INT_TYPES


def matvec(w: np.ndarray, qtype: int, x: np.ndarray, out: np.ndarray | None = None, *,
           exact: bool | None = None, residual: bool = False) -> np.ndarray:
    """out[t, r] = sum_i W[r, i] * x[t, i] for W stored as ggml type `qtype`.

    w: raw bytes (rows, row_bytes) as in the file (a zero-copy mmap view is fine); row r holds output
    row r. x: (k, n_in) float32, any k >= 1, one pass over w. out: optional (k, rows) float32
    C-contiguous buffer to write into. Releases the GIL; runs on numba's threads.
    exact: False runs the integer kernel on int8-quantized x (matvec_int, or matvec_amx's tile
    kernels for verify batches on CPUs with AMX; relative error ~5e-3, llama.cpp's numerics), True
    the float32 kernel (float32 rounding only); None: EXACT_DEFAULT.
    residual: on the integer path, a second int8 pass on what the first one rounds off
    (quantize_act.with_residual_rows: 2k rows, each token's two outputs summed; ~2^-16 relative),
    for batches of up to RESIDUAL_MAX_TOKENS rows (prompt batches keep one pass).
    Either way a token's result does not depend on k or on the other tokens.
    """
    w, block_elems, x, out = check_operands(w, qtype, x, out)
    if x.shape[0] == 0 or w.shape[0] == 0:
        return out
    if x.shape[1] == 0:
        out.fill(0.0)
        return out
    if residual and x.shape[0] <= RESIDUAL_MAX_TOKENS and use_int(qtype, exact):
        k = x.shape[0]
        both = matvec(w, qtype, with_residual_rows(x, act_block(qtype)), exact=False)
        np.add(both[:k], both[k:], out=out)
        return out
    if use_int(qtype, exact):
        if uses_amx(qtype, x.shape[0], w.shape[0], x.shape[1]):     # verify batches on AMX tiles: the same bits
            return matvec_amx_into(w, qtype, x, out)
        return matvec_int_into(w, qtype, x, out)
    _matvec_kernel(w, int(qtype), block_elems, x, out, n_groups_for(w.shape[0]))
    return out

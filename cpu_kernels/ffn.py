"""A gated FFN layer on k token rows, all three matrices quantized in the mmap:

    y = W_down (act(W_gate x) * (W_up x))

Gate and up run in one parallel loop: a tile of 4 output rows computes its gate products and its
up products back to back (x's chunks stay in L2) and writes act(gate) * up straight into the hidden
buffer, so the gate and up outputs never go to memory. Then the down projection is a matvec. Each
weight byte is read once per call for any k, and a token's output does not depend on k (same
kernels and accumulation order as `matvec`).

As `matvec`, the default runs the integer kernels (matvec_int): x is quantized once and gate and
up read the same int8 rows when their types share an activation block (from 4 tokens, a tile of
rows gets its gate and up sums for all tokens from matvec_int's tiled kernels, token groups or
token lanes, before act(gate) * up); `exact=True` runs the float32 kernels.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from .matvec import CHUNK, TOKEN_TILE, check_operands, matvec, n_groups_for, tile_products, use_int
from .matvec_amx import matvec_amx_into, uses_amx
from .matvec_int import act_block, block_dots, group_rows, n_row_groups, quantize_for, type_tag
from .matvec_tiled import quantize_tiled, tile_sums, tiled_min_k, tiling
from .matvec_simd import TILE_ROWS
from .simd_int import CACHE

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@dataclass
class FfnScratch:
    """Preallocated buffers for up to k_max rows; ffn_glu returns a view of `out`."""
    hidden: np.ndarray    # (k_max, n_ff) float32
    out: np.ndarray       # (k_max, n_embd) float32

    @classmethod
    def allocate(cls, k_max: int, n_ff: int, n_embd: int) -> "FfnScratch":
        return cls(np.empty((k_max, n_ff), np.float32), np.empty((k_max, n_embd), np.float32))


@intrinsic
def _f64_from_bits(typingctx, bits):
    """The float64 whose bits are the int64 `bits` (a bitcast LLVM vectorizes)."""
    if bits != types.int64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())
    return types.float64(bits), codegen


_LN2_HI, _LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10   # ln 2 split: n * hi exact


@njit(cache=True, nogil=True, inline="always")
def _exp(x):
    """e^x in float64 from arithmetic alone (a loop of these vectorizes; libm's exp is a call per
    value): n = round(x / ln 2), r = x - n ln 2 (Cody-Waite), e^r by its Taylor series to r^13
    (|r| <= ln2 / 2: error < 1e-17), times 2^n from the exponent bits. Within an ulp or two of
    libm; x clamped to +-708 (e^708 ~ 3e307, far past where the activations saturate)."""
    x = min(max(x, -708.0), 708.0)
    n = np.floor(x * 1.4426950408889634 + 0.5)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = 1.6059043836821613e-10
    p = p * r + 2.08767569878681e-09
    p = p * r + 2.505210838544172e-08
    p = p * r + 2.755731922398589e-07
    p = p * r + 2.7557319223985893e-06
    p = p * r + 2.48015873015873e-05
    p = p * r + 0.0001984126984126984
    p = p * r + 0.001388888888888889
    p = p * r + 0.008333333333333333
    p = p * r + 0.041666666666666664
    p = p * r + 0.16666666666666666
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    return p * _f64_from_bits((np.int64(n) + 1023) << 52)


@njit(cache=True, nogil=True, inline="always")
def _silu(g):
    """SiLU of a float64, g / (1 + e^-g), in float64 (see _act_times)."""
    return np.divide(g, 1.0 + _exp(-g))


@njit(cache=True, nogil=True, inline="always")
def _sigmoid(g):
    """1 / (1 + e^-g) of a float64, in float64 (qwen35's gates)."""
    return np.divide(1.0, 1.0 + _exp(-g))


@njit(cache=True, nogil=True, inline="always")
def _act_times(g, u, act):
    """act(g) * u in float64: SiLU g / (1 + e^-g); GELU-tanh 0.5 g (1 + tanh z) = g / (1 + e^-2z),
    z = sqrt(2 / pi) (g + 0.044715 g^3) (no cancellation where tanh z is near -1). _exp is plain
    arithmetic and np.divide has no zero check (Python's `/` would branch to raise), so a row's
    loop vectorizes, and any loop shape gives the same bits."""
    g = np.float64(g)
    if act == 0:
        a = _silu(g)
    else:
        a = np.divide(g, 1.0 + _exp(-2.0 * _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)))
    return np.float32(a * np.float64(u))


@njit(cache=True, nogil=True)
def _act_times_rows(gate, up, hidden, act):
    for t in range(gate.shape[0]):
        for i in range(gate.shape[1]):
            hidden[t, i] = _act_times(gate[t, i], up[t, i], act)


@njit(cache=True, nogil=True, parallel=True)
def _gate_up_kernel(w_gate, t_gate, be_gate, w_up, t_up, be_up, x, hidden, act, n_groups):
    rows = w_gate.shape[0]
    k = x.shape[0]
    n_tiles = (rows + TILE_ROWS - 1) // TILE_ROWS
    for g in prange(n_groups):
        buf = np.zeros((TILE_ROWS, CHUNK), np.float32)
        part = np.zeros(TOKEN_TILE * TILE_ROWS, np.float32)
        gate = np.zeros((k, TILE_ROWS), np.float32)
        up = np.zeros((k, TILE_ROWS), np.float32)
        for tile in range(g * n_tiles // n_groups, (g + 1) * n_tiles // n_groups):
            r0 = tile * TILE_ROWS
            n_rows = min(TILE_ROWS, rows - r0)
            tile_products(w_gate, t_gate, be_gate, r0, n_rows, x, buf, part, gate)
            tile_products(w_up, t_up, be_up, r0, n_rows, x, buf, part, up)
            for t in range(k):
                for r in range(n_rows):
                    hidden[t, r0 + r] = _act_times(gate[t, r], up[t, r], act)


@njit(cache=CACHE, nogil=True, parallel=True)
def _gate_up_int_kernel(w_gate, t_gate, w_up, t_up, xq, xd, xs, hidden, act, n_groups):
    rows = w_gate.shape[0]
    k = xq.shape[0]
    for g in prange(n_groups):
        lo, hi = group_rows(g, n_groups, rows)
        gate = np.empty((k, hi - lo), np.float32)
        up = np.empty((k, hi - lo), np.float32)
        block_dots(t_gate, w_gate, lo, hi - lo, xq, xd, xs, gate, 0)
        block_dots(t_up, w_up, lo, hi - lo, xq, xd, xs, up, 0)
        for t in range(k):
            for r in range(hi - lo):
                hidden[t, lo + r] = _act_times(gate[t, r], up[t, r], act)


@njit(cache=CACHE, nogil=True, parallel=True)
def _gate_up_tiled_kernel(w_gate, t_gate, w_up, t_up, xa, xb, xc, k_pad, hidden, act, n_steps, chunk, units,
                          row_tile, n_groups):
    """As _gate_up_int_kernel for k >= tiled_min_k (of both types): a tile of rows' gate and up sums
    for all tokens (matvec_tiled.tile_sums: each weight chunk decoded once per pass of tokens), then act(gate) * up."""
    rows = w_gate.shape[0]
    k = hidden.shape[0]
    n_tiles = (rows + row_tile - 1) // row_tile
    for g in prange(n_groups):
        gate = np.empty((row_tile, k_pad), np.float32)
        up = np.empty((row_tile, k_pad), np.float32)
        for tile in range(g * n_tiles // n_groups, (g + 1) * n_tiles // n_groups):
            r0 = tile * row_tile
            n_rows = min(row_tile, rows - r0)
            tile_sums(t_gate, w_gate, r0, n_rows, xa, xb, xc, n_steps, chunk, units, gate)
            tile_sums(t_up, w_up, r0, n_rows, xa, xb, xc, n_steps, chunk, units, up)
            for t in range(k):
                for r in range(n_rows):
                    hidden[t, r0 + r] = _act_times(gate[r, t], up[r, t], act)


def ffn_glu(x: np.ndarray, w_gate: np.ndarray, t_gate: int, w_up: np.ndarray, t_up: int,
            w_down: np.ndarray, t_down: int, act: str = "silu",
            scratch: FfnScratch | None = None, *, exact: bool | None = None,
            down_residual: bool = False) -> np.ndarray:
    """(k, n_embd) float32 = W_down (act(W_gate x) * W_up x) for x of shape (k, n_embd).

    Weights are raw (rows, row_bytes) byte matrices in ggml layout (gate/up: n_ff rows, down:
    n_embd rows) with their ggml type ids. act: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma).
    With `scratch`, no allocation: the result is a view of scratch.out, valid until the next call.
    exact: as for `matvec` (False: int8 activations, True: float32, None: the process default).
    down_residual: the down projection takes `matvec`'s second int8 pass (residual=True).
    """
    if act not in ACTIVATIONS:
        raise ValueError(f"unknown FFN activation {act!r} (expected one of {', '.join(ACTIVATIONS)})")
    k = x.shape[0]
    n_ff = w_gate.shape[0]
    if w_up.shape[0] != n_ff:
        raise ValueError(f"gate has {n_ff} rows but up has {w_up.shape[0]}")
    hidden = None if scratch is None else scratch.hidden[:k]
    out = None if scratch is None else scratch.out[:k]
    w_gate, be_gate, x, hidden = check_operands(w_gate, t_gate, x, hidden)
    w_up, be_up, _, _ = check_operands(w_up, t_up, x, hidden)
    if k > 0 and n_ff > 0:
        if x.shape[1] == 0:
            hidden.fill(0.0)
        elif use_int(t_gate, exact) and use_int(t_up, exact) and uses_amx(t_gate, k, n_ff, x.shape[1]) \
                and uses_amx(t_up, k, n_ff, x.shape[1]):
            # verify batches on AMX tiles: gate and up each in one call (the same bits as below)
            gate = matvec_amx_into(w_gate, t_gate, x, np.empty((k, n_ff), np.float32))
            _act_times_rows(gate, matvec_amx_into(w_up, t_up, x, np.empty((k, n_ff), np.float32)), hidden,
                            ACTIVATIONS[act])
        elif use_int(t_gate, exact) and use_int(t_up, exact) and act_block(t_gate) == act_block(t_up) \
                and k >= max(tiled_min_k(t_gate), tiled_min_k(t_up)):
            xa, xb, xc, k_pad = quantize_tiled(t_gate, x)
            _gate_up_tiled_kernel(w_gate, type_tag(t_gate), w_up, type_tag(t_up), xa, xb, xc, k_pad, hidden,
                                  ACTIVATIONS[act], *tiling(t_gate, w_gate.shape, k))
        elif use_int(t_gate, exact) and use_int(t_up, exact) and act_block(t_gate) == act_block(t_up):
            xq, xd, xs = quantize_for(t_gate, x)
            _gate_up_int_kernel(w_gate, type_tag(t_gate), w_up, type_tag(t_up), xq, xd, xs, hidden,
                                ACTIVATIONS[act], n_row_groups(n_ff))
        else:
            _gate_up_kernel(w_gate, int(t_gate), be_gate, w_up, int(t_up), be_up, x, hidden,
                            ACTIVATIONS[act], n_groups_for(n_ff))
    return matvec(w_down, t_down, hidden, out, exact=exact, residual=down_residual)

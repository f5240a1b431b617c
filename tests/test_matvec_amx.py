"""Verify batches on AMX tiles (cpu_kernels.matvec_amx): matvec_int's result, bit for bit.

The tile kernels compute the same exact integers as matvec_int and replay its float steps in the
same order, so for every type they cover, every k they take and any row count (a tail of rows % 16
goes to matvec_int's register groups), the output must equal matvec_int's own kernels exactly; and,
as matvec_int's, within float32 rounding of the float64 product of the dequantized weights with the
dequantized int8 activations. On a CPU without AMX-INT8 (or where the OS refuses the tile state)
these tests skip, and the refusal test checks that the dispatch then never picks the tiles.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize

from cpu_kernels import matvec_amx
from cpu_kernels.ffn import ffn_glu
from cpu_kernels.matvec import check_operands, matvec
from cpu_kernels.matvec_int import matvec_int_into, quantize_for
from cpu_kernels.matvec_testdata import random_weights
from cpu_kernels.quantize_act import dequantize_rows
from test_matvec import _two_threads  # noqa: F401  (autouse: 2 numba threads)
from test_matvec_int import _cols, _x    # odd block counts, outliers, an all-zero block

AMX_TYPES = [T(t) for t in sorted(matvec_amx.AMX_TYPES)]
needs_amx = pytest.mark.skipif(not matvec_amx.AMX, reason=f"no AMX tiles here: {matvec_amx.AMX_REFUSAL}")


@needs_amx
@pytest.mark.parametrize("qtype", AMX_TYPES, ids=lambda t: t.name)
def test_tiles_give_matvec_int_bits(qtype):
    rng = np.random.default_rng(300 + int(qtype))
    for rows in (37, 64):                      # a tail of 5 rows; whole tiles only
        w = random_weights(qtype, rows, _cols(qtype), rng)
        for k in (2, 3, 4, 5, 8, 9, 13, 16):   # tiles of 4, 8 and 16 tokens, partly filled
            x = _x(rng, k, _cols(qtype))
            wv, _, xc, out = check_operands(w, int(qtype), x, None)
            ref = matvec_int_into(wv, int(qtype), xc, np.empty_like(out))
            got = matvec_amx.matvec_amx_into(wv, int(qtype), xc, out)
            assert np.array_equal(got, ref), f"{qtype.name} rows={rows} k={k}: tiles differ from matvec_int"


@needs_amx
@pytest.mark.parametrize("qtype", AMX_TYPES, ids=lambda t: t.name)
def test_tiles_exact_on_quantized_activations(qtype):
    rng = np.random.default_rng(400 + int(qtype))
    rows, cols = 48, _cols(qtype)
    w = random_weights(qtype, rows, cols, rng)
    wd = dequantize(w, qtype).astype(np.float64)
    x = _x(rng, 11, cols)
    wv, _, xc, out = check_operands(w, int(qtype), x, None)
    y = matvec_amx.matvec_amx_into(wv, int(qtype), xc, out)
    q, d, _ = quantize_for(qtype, x)
    ref = dequantize_rows(q, d, cols).astype(np.float64) @ wd.T
    rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert rel <= 2e-6, f"{qtype.name}: relative error {rel:.2e} vs the quantized activations"


@needs_amx
def test_matvec_and_ffn_take_the_tiles_with_each_tokens_bits():
    """matvec and ffn_glu dispatch verify batches to the tiles; each token keeps its k = 1 bits."""
    rng = np.random.default_rng(7)
    n_embd, n_ff = matvec_amx.MIN_COLS, 96
    wg, wu = random_weights(T.Q4_0, n_ff, n_embd, rng), random_weights(T.Q8_0, n_ff, n_embd, rng)
    wd = random_weights(T.Q5_0, n_embd, n_ff, rng)
    k = 12
    assert matvec_amx.uses_amx(T.Q4_0, k, n_ff, n_embd) and matvec_amx.uses_amx(T.Q8_0, k, n_ff, n_embd)
    assert not matvec_amx.uses_amx(T.Q5_0, k, n_embd, n_ff)          # short rows: matvec_int
    x = rng.standard_normal((k, n_embd)).astype(np.float32)
    y = ffn_glu(x, wg, T.Q4_0, wu, T.Q8_0, wd, T.Q5_0, act="silu")
    for t in range(k):
        assert np.array_equal(y[t], ffn_glu(x[t:t + 1], wg, T.Q4_0, wu, T.Q8_0, wd, T.Q5_0, act="silu")[0])
    w = random_weights(T.Q5_K, 80, matvec_amx.MIN_COLS, rng)
    y = matvec(w, T.Q5_K, x)
    for t in range(k):
        assert np.array_equal(y[t], matvec(w, T.Q5_K, x[t:t + 1])[0])


def test_refusal_keeps_matvec_int():
    """HYBRIDRT_AMX=0 (as a CPU without AMX) turns the tiles off, saying why; nothing else changes."""
    code = ("from cpu_kernels import matvec_amx as m; "
            "print(m.AMX, m.AMX_REFUSAL, m.uses_amx(8, 8, 64, 8192))")
    env = dict(os.environ, HYBRIDRT_AMX="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["False", "HYBRIDRT_AMX=0", "False"]


@needs_amx
def test_fused_ffn_half_on_tiles_has_the_fused_kernels_bits():
    """A wide model's verify batch through layer_fused.ffn_block_tiles (gate and up on the tiles)
    gives ffn_block's bits (the all-Numba fused FFN half), token by token."""
    from cpu_kernels import layer_fused
    from cpu_kernels.ffn import ACTIVATIONS
    rng = np.random.default_rng(11)
    n_embd, n_ff = matvec_amx.MIN_COLS, 96       # down: 3 blocks a row (short rows: matvec_int)
    for types_, act, post in (((T.Q4_0, T.Q4_0, T.Q8_0), "silu", False), ((T.Q5_K, T.Q5_K, T.Q4_1), "gelu_tanh", True),
                            ((T.Q8_0, T.Q4_1, T.Q5_0), "silu", True), ((T.Q4_0, T.Q4_0, T.F32), "silu", False)):
        ops = [layer_fused.matrix_operands(random_weights(t, r, c, rng) if t != T.F32 else
                                           (0.05 * rng.standard_normal((r, c))).astype(np.float32).view(np.uint8),
                                           t, t != T.F32)         # an F32 down: the float path
               for t, (r, c) in zip(types_, [(n_ff, n_embd), (n_ff, n_embd), (n_embd, n_ff)])]
        int_types, float_path = layer_fused.kernel_types((op[1], op[3]) for op in ops)
        norm, post_w = (rng.uniform(0.5, 1.5, n_embd).astype(np.float32) for _ in range(2))
        h = rng.standard_normal((8, n_embd)).astype(np.float32)
        fused = layer_fused.ffn_block(h, 2, int_types, float_path, norm, post_w, post, 1e-6, *ops[0], *ops[1], *ops[2],
                                      ACTIVATIONS[act])
        k = 8
        assert k in layer_fused.ffn_tile_tokens(ops[0], ops[1])
        tiles = layer_fused.ffn_block_tiles(h, norm, post_w, post, 1e-6, ops[0], ops[1], ops[2], act)
        assert np.array_equal(tiles, fused), f"{types_[0].name}: tiles differ from the fused kernel"
        assert 2 not in layer_fused.ffn_tile_tokens(ops[0], ops[1])

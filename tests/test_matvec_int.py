"""The integer matvec (cpu_kernels.matvec_int) on int8-quantized activations.

1. Exactness: against float64 on the dequantized weights and the *dequantized int8 activations*
   the kernel only rounds its float32 scaling steps (relative error ~1e-7).
2. Against float activations: every output is within the bound the activation quantization allows,
   |y - W x| <= sum_i |W[r, i]| * d[t, block(i)] / 2 (each value is off by at most half a step).
3. Every lowering (avx512vnni, avxvnni, avx2, portable) gives the same bits: integer sums are exact
   and the float steps after them are the same (whole kernels here; the ops alone in test_simd_int.py).
4. Prompt-sized batches (token quads, and token lanes from 10 (legacy) or 12 (K) tokens, several
   column chunks and row tiles)
   give every token the bits it gets alone, on 1 and 2 threads; so do block_dots (a row at a time)
   and rows_dots, the entry points of fused kernels.
Bit identity across k <= 16 and threads is in test_matvec.py (both paths).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize

from cpu_kernels.matvec import matvec
from cpu_kernels.formats import type_tag
from cpu_kernels.int_blocks import SPECS
from cpu_kernels.matvec_int import (INT_TYPES, PHASE_STEPS, TWO_PHASE_BYTES, _make_grid_dot, act_block, block_dots,
                                    grid_dot, quantize_for, row_dot, rows_dot, rows_dots, single_row_table,
                                    two_phase_table)
from cpu_kernels.matvec_tiled import LANES_MIN_K, TILED_MIN_K, lanes_min_k, tiled_min_k
from cpu_kernels.matvec_rowlanes import PASS_TOKENS, ROW_LANES, ROW_LANES_HOST, WEIGHT_MAX, row_lanes_dot, row_lanes_table
from cpu_kernels.matvec_testdata import random_weights
from cpu_kernels.quantize_act import RESIDUAL_MAX_TOKENS, dequantize_rows, quantize_rows, with_residual_rows
from cpu_kernels.simd_int import ISA, runnable_isas
from test_matvec import _two_threads  # noqa: F401  (autouse: 2 numba threads)

INT = [T(t) for t in sorted(INT_TYPES)]
ROOT = Path(__file__).resolve().parent.parent


def _cols(qtype):
    # legacy: an odd number of 32-blocks (the kernel takes pairs), K: 5 super-blocks
    return 32 * 41 if act_block(qtype) == 32 else 256 * 5


def _x(rng, k, cols):
    x = rng.standard_normal((k, cols)).astype(np.float32)
    x[:, 40:80] *= 30.0                                # outliers: blocks with a coarse scale
    x[0, : 2 * act_block(T.Q4_0)] = 0.0                # an all-zero block (d = 0)
    return x


@pytest.mark.parametrize("qtype", INT, ids=lambda t: t.name)
def test_exact_on_quantized_activations(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    rows, cols = 37, _cols(qtype)
    w = random_weights(qtype, rows, cols, rng)
    wd = dequantize(w, qtype).astype(np.float64)
    # row lanes, token quads, quads + a padded quad, token lanes (legacy) or quads (K), token lanes
    for k in (1, 3, 8, 19, 41):
        x = _x(rng, k, cols)
        y = matvec(w, qtype, x)
        q, d, _ = quantize_for(qtype, x)
        ref = dequantize_rows(q, d, cols).astype(np.float64) @ wd.T
        rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
        assert rel <= 2e-6, f"{qtype.name} k={k}: relative error {rel:.2e} vs the quantized activations"


@pytest.mark.parametrize("qtype", INT, ids=lambda t: t.name)
def test_within_activation_quantization_bound(qtype):
    rng = np.random.default_rng(200 + int(qtype))
    rows, cols = 29, _cols(qtype)
    w = random_weights(qtype, rows, cols, rng)
    wd = dequantize(w, qtype).astype(np.float64)
    x = _x(rng, 5, cols)
    y = matvec(w, qtype, x).astype(np.float64)
    exact = matvec(w, qtype, x, exact=True).astype(np.float64)
    ref = x.astype(np.float64) @ wd.T
    _, d, _ = quantize_for(qtype, x)
    half_step = np.repeat(d[:, : cols // act_block(qtype)], act_block(qtype), axis=1) / 2
    bound = half_step.astype(np.float64) @ np.abs(wd).T                  # (k, rows)
    slack = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(wd).T)        # float32 rounding
    assert np.all(np.abs(y - ref) <= bound + slack), f"{qtype.name}: an output is outside the quantization bound"
    # and the exact path is much closer than the bound allows the integer one to be
    assert np.all(np.abs(exact - ref) <= slack)
    rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert rel < 3e-2, f"{qtype.name}: relative error {rel:.2e} vs float activations"


@pytest.mark.parametrize("qtype", INT, ids=lambda t: t.name)
def test_residual_pass_is_within_its_quantization_bound(qtype):
    """matvec(residual=True): the second int8 pass quantizes what the first rounds off, so every
    output is within half a step of the *residual's* scale (~2^-16 of |x|, not 2^-8), through every
    kernel (a row, token quads, token lanes / tiles: 2k rows), each token with the bits it gets
    alone; a prompt-sized batch takes one pass."""
    rng = np.random.default_rng(300 + int(qtype))
    rows, cols = 29, _cols(qtype)
    w = random_weights(qtype, rows, cols, rng)
    wd = dequantize(w, qtype).astype(np.float64)
    for k in (1, 3, 8, 20, RESIDUAL_MAX_TOKENS):
        x = _x(rng, k, cols)
        y = matvec(w, qtype, x, residual=True).astype(np.float64)
        ref = x.astype(np.float64) @ wd.T
        both = with_residual_rows(x, act_block(qtype))
        assert np.array_equal(both[:k], x)
        q, d, _ = quantize_for(qtype, x)
        assert np.array_equal(both[k:], x - dequantize_rows(q, d, cols))
        _, d2, _ = quantize_for(qtype, both[k:])
        half_step = np.repeat(d2[:, : cols // act_block(qtype)], act_block(qtype), axis=1) / 2
        bound = half_step.astype(np.float64) @ np.abs(wd).T
        slack = 2e-6 * (np.abs(x).astype(np.float64) @ np.abs(wd).T)      # float32 rounding of the two sums
        assert np.all(np.abs(y - ref) <= bound + slack), f"{qtype.name} k={k}: outside the residual's bound"
        one = matvec(w, qtype, x).astype(np.float64)
        rel, rel_one = (np.linalg.norm(v - ref) / np.linalg.norm(ref) for v in (y, one))
        assert rel < rel_one / 50, f"{qtype.name} k={k}: {rel:.2e} with the second pass, {rel_one:.2e} without"
        alone = np.concatenate([matvec(w, qtype, x[t:t + 1], residual=True) for t in range(k)])
        assert np.array_equal(alone, y.astype(np.float32)), f"{qtype.name} k={k}: a token's bits depend on k"
    x = _x(rng, RESIDUAL_MAX_TOKENS + 1, cols)
    assert np.array_equal(matvec(w, qtype, x, residual=True), matvec(w, qtype, x))
    # the exact path ignores `residual`
    assert np.array_equal(matvec(w, qtype, x, exact=True, residual=True), matvec(w, qtype, x, exact=True))


def test_quantize_rows_blocks():
    rng = np.random.default_rng(3)
    x = _x(rng, 3, 512)
    for block, group in ((256, 16), (32, 32)):
        q, d, s = quantize_rows(x, block)
        assert q.dtype == np.int8 and d.dtype == np.float32 and s.dtype == np.int16
        assert q.min() >= -127 and q.max() <= 127
        blocks = x.reshape(3, -1, block)
        amax = np.abs(blocks).max(-1)
        if block == 256:        # ggml's Q8_K: d = 1 / iscale, iscale = 127 / max|x|
            assert np.array_equal(d, np.float32(1) / (np.float32(127) / amax))
        else:                   # ggml's Q8_0 / Q8_1: d = max|x| / 127 stored as float16
            assert np.array_equal(d, (amax / np.float32(127)).astype(np.float16).astype(np.float32))
        assert np.array_equal(np.abs(q.reshape(3, -1, block)).max(-1)[d > 0], np.full(np.sum(d > 0), 127))
        # q as ggml rounds it: rint(x * (127 / max|x|)) in float32, value for value
        with np.errstate(divide="ignore"):
            inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
        assert np.array_equal(q.reshape(3, -1, block), np.clip(np.rint(blocks * inv[..., None]), -127, 127))
        assert np.array_equal(s, q.reshape(3, -1, group).astype(np.int32).sum(-1))
        # the residual pass's rows: x, then x - d q in float32, value for value
        assert np.array_equal(with_residual_rows(x, block), np.concatenate([x, x - dequantize_rows(q, d, 512)]))
        err = np.abs(dequantize_rows(q, d, 512) - x).reshape(3, -1, block)
        assert np.all(err <= d[..., None] * (0.5 + 1e-6) + amax[..., None] * 2.0 ** -11)
    # float16 scales: subnormal (tiny blocks), rounding to even, and the all-zero block
    x = np.zeros((1, 128), np.float32)
    x[0, 0], x[0, 32], x[0, 64] = 3e-6, 1.0, -1234.5
    _, d, _ = quantize_rows(x, 32)
    assert np.array_equal(d[0], (np.float32([3e-6, 1.0, 1234.5, 0.0]) / np.float32(127))
                          .astype(np.float16).astype(np.float32))
    q, d, s = quantize_rows(np.ones((1, 96), np.float32), 32)          # 3 blocks: padded to 4
    assert q.shape == (1, 128) and d.shape == (1, 4) and s.shape == (1, 4)
    assert not q[0, 96:].any() and d[0, 3] == 0 and s[0, 3] == 0


def test_gate_of_a_zero_row_is_zero():
    rng = np.random.default_rng(4)
    for qtype in INT:
        w = random_weights(qtype, 4, 256, rng)
        y = matvec(w, qtype, np.zeros((2, 256), np.float32))
        assert np.array_equal(y, np.zeros_like(y)), qtype.name


_ISA_SCRIPT = """
import json, sys
import numpy as np
from cpu_kernels.matvec import matvec
from cpu_kernels import simd_int
req = json.load(open(sys.argv[1]))
data = np.load(req["data"])
res = {}
for name in req["types"]:
    x = data["x_" + name]          # 1 and 2 tokens (row kernels), 5 (register groups), 41 (token lanes)
    ks = (1, 2, 5, 41) if name in req["lanes"] else (1, 2, 5)
    res[name] = [matvec(data["w_" + name], int(data["t_" + name]), x[:k]).view(np.uint32).tolist() for k in ks]
json.dump({"isa": simd_int.ISA, "res": res}, open(req["out"], "w"))
"""


def _other_isas():
    """The lowerings besides the host's. The ops they differ in are checked in every lowering in
    test_simd_int.py (seconds); whole kernels compiled in another lowering take minutes each, so the
    default suite compiles them in avx2 (Zen 1-3's lowering: ymm halves, row lanes from 4 tokens)
    and -m slow in all."""
    return [pytest.param(i, marks=() if i == "avx2" else pytest.mark.slow) for i in runnable_isas() if i != ISA]


@pytest.mark.parametrize("isa", _other_isas())
def test_every_lowering_gives_the_same_bits(tmp_path, isa):
    rng = np.random.default_rng(5)
    arrays, names = {}, []
    for qtype in INT:
        cols = _cols(qtype)
        arrays[f"w_{qtype.name}"] = random_weights(qtype, 21, cols, rng)      # a row-lane group and 5 rows
        arrays[f"t_{qtype.name}"] = np.int64(qtype)
        arrays[f"x_{qtype.name}"] = _x(rng, 41, cols)
        names.append(qtype.name)
    np.savez(tmp_path / "data.npz", **arrays)
    # token lanes on one type of each of their paths (a K-quant with mins, one with offsets, the wide
    # K-quant; a 32-weight type with a min, one with an offset, a wide one): each type compiles its
    # own tiled kernel in the subprocess, all twelve would add minutes to every ISA
    lanes = [T.Q4_K, T.Q6_K, T.IQ4_XS, T.Q4_1, T.Q5_0, T.Q8_0]
    req = {"data": str(tmp_path / "data.npz"), "types": names, "out": str(tmp_path / "out.json"),
           "lanes": [t.name for t in lanes]}
    (tmp_path / "req.json").write_text(json.dumps(req))
    env = dict(os.environ, HYBRIDRT_INT_ISA=isa, NUMBA_CACHE_DIR=str(tmp_path / "cache"), NUMBA_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-c", _ISA_SCRIPT, str(tmp_path / "req.json")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["isa"] == isa
    for qtype in INT:
        x = arrays[f"x_{qtype.name}"]
        ks = (1, 2, 5, 41) if qtype in lanes else (1, 2, 5)
        here = [matvec(arrays[f"w_{qtype.name}"], qtype, x[:k]).view(np.uint32).tolist() for k in ks]
        assert here == got["res"][qtype.name], f"{qtype.name}: {isa} differs from {ISA}"


@numba.njit
def _by_rows(qtype, w, xq, xd, xs, out, rows_at_once):
    if rows_at_once:
        for t in range(xq.shape[0]):
            rows_dots(qtype, w, 0, w.shape[0], xq, xd, xs, t, out, 0)
    else:
        for r in range(w.shape[0]):
            block_dots(qtype, w, r, 1, xq, xd, xs, out, r)


@numba.njit
def _by_block_dots(qtype, w, r0, n_rows, xq, xd, xs, out, oc0):
    block_dots(qtype, w, r0, n_rows, xq, xd, xs, out, oc0)


@pytest.mark.parametrize("qtype", INT, ids=lambda t: t.name)
def test_register_groups_give_each_token_its_own_bits(qtype):
    """block_dots' groups of rows by tokens (4 x 2, 2 x 4, 2 x 4 with a repeated fourth token for
    3, row_dot for a row left over, rows_dots for a last token) give every (row, token) the bits
    of the token alone: every k up to 9 (the passes 4 + 4 + 1 included), odd row counts and an
    offset row range written at an offset column."""
    rng = np.random.default_rng(500 + int(qtype))
    rows, cols = 23, 32 * 11 if act_block(qtype) == 32 else 256 * 3
    w = random_weights(qtype, rows, cols, rng)
    x = _x(rng, 9, cols)
    x[4] *= 1e3
    alone = np.stack([matvec(w, qtype, x[t:t + 1])[0] for t in range(9)]).view(np.uint32)
    for k in range(1, 10):
        q, d, s = quantize_for(qtype, x[:k])
        for r0, n_rows in ((0, rows), (2, 5), (3, 3), (1, 1)):
            out = np.full((k, n_rows + 2), np.nan, np.float32)
            _by_block_dots(type_tag(qtype), w, r0, n_rows, q, d, s, out, 1)
            assert np.array_equal(out[:, 1:1 + n_rows].view(np.uint32), alone[:k, r0:r0 + n_rows]), \
                f"{qtype.name}: k = {k}, rows {r0} .. {r0 + n_rows - 1}"
            assert np.isnan(out[:, 0]).all() and np.isnan(out[:, -1]).all()     # nothing outside the range


@numba.njit
def _in_groups(qtype, w, xq, xd, xs, out, rows_per_group):
    """Every row for every token in fixed groups, whatever SINGLE_ROWS picks on this host: k = 1
    by rows_dot groups of 1, 2 or 4 rows; k = 2 by grid_dot (4 rows x 2 tokens) or row_dot (1 x 2)."""
    for r in range(0, w.shape[0], rows_per_group):
        if xq.shape[0] == 1:
            rows_dot(qtype, rows_per_group, w, r, xq, xd, xs, 0, out, r)
        elif rows_per_group == 4:
            grid_dot(qtype, 2, w, r, xq, xd, xs, 0, out, r)
        else:
            for j in range(rows_per_group):
                row_dot(qtype, 2, w, r + j, xq, xd, xs, 0, out, r + j)


@pytest.mark.parametrize("qtype", INT, ids=lambda t: t.name)
def test_single_row_and_grouped_rows_give_the_same_bits(qtype):
    """SINGLE_ROWS (a row at a time on CPUs that stream short rows faster so) changes only the
    order of work: one row, two or four side by side give each (row, token) the same bits."""
    rng = np.random.default_rng(900 + int(qtype))
    rows, cols = 24, 32 * 21 if act_block(qtype) == 32 else 256 * 3
    w = random_weights(qtype, rows, cols, rng)
    for k in (1, 2):
        x = _x(rng, k, cols)
        q, d, s = quantize_for(qtype, x)
        res = {}
        for per in ((1, 2, 4) if k == 1 else (1, 4)):
            out = np.full((k, rows), np.nan, np.float32)
            _in_groups(type_tag(qtype), w, q, d, s, out, per)
            res[per] = out.view(np.uint32)
        for per, got in res.items():
            assert np.array_equal(got, res[1]), f"{qtype.name}: k = {k}, {per} rows a group"


def test_single_rows_only_where_measured():
    zen = single_row_table("znver4", "avx512vnni")
    assert zen[int(T.Q8_0)] == 1 and zen[int(T.Q6_K)] == 2 and zen[int(T.Q4_K)] == 1
    assert int(T.Q4_0) not in zen and int(T.Q4_1) not in zen       # fold-bound alone: kept in groups
    for isa in ("avx512vnni", "avx2"):
        assert single_row_table("sapphirerapids", isa) == {} and single_row_table("generic", isa) == {}
    assert two_phase_table("znver4") == {int(T.Q8_0): 2}            # its rows under TWO_PHASE_BYTES
    assert two_phase_table("sapphirerapids") == {} and two_phase_table("generic") == {}
    # Zen 3's avx2 lowering: Q8_0's rows in groups (its short ones two-phase), the K-quants alone
    zen3 = single_row_table("znver3", "avx2")
    assert int(T.Q8_0) not in zen3 and zen3[int(T.Q6_K)] == 2 and zen3[int(T.Q4_K)] == 1


# two-phase groups forced for every legacy type, whatever this host's TWO_PHASES says
PAIRS = [T(t) for t in sorted(INT_TYPES) if SPECS[t][0] == "pair"]
rows_dot_two_phase = _make_grid_dot("rows_dot_two_phase", {4: (4, 1, 1), 2: (2, 1, 1)},
                                    two_phase={int(t): 4 for t in PAIRS})
grid_dot_two_phase = _make_grid_dot("grid_dot_two_phase", {4: (2, 4, 4), 3: (2, 4, 3), 2: (4, 2, 2)},
                                    two_phase={int(t): 4 for t in PAIRS})


@numba.njit
def _two_phase_groups(qtype, w, xq, xd, xs, out, rows_per_group):
    for r in range(0, w.shape[0], rows_per_group):
        if xq.shape[0] == 1:
            rows_dot_two_phase(qtype, rows_per_group, w, r, xq, xd, xs, 0, out, r)
        else:
            grid_dot_two_phase(qtype, xq.shape[0], w, r, xq, xd, xs, 0, out, r)


@pytest.mark.parametrize("qtype", PAIRS, ids=lambda t: t.name)
def test_two_phase_groups_give_the_same_bits(qtype):
    """Rows read one after another (their sums and scales through stack buffers, then the group's
    float steps) give each (row, token) the bits of a row read alone: an odd last block, and rows
    of more than one chunk of PHASE_STEPS block pairs where the type's rows stay under
    TWO_PHASE_BYTES."""
    rng = np.random.default_rng(1700 + int(qtype))
    block_bytes = SPECS[int(qtype)][2]
    long_blocks = 2 * PHASE_STEPS + 3
    for n_blocks in (21, long_blocks) if long_blocks * block_bytes < TWO_PHASE_BYTES else (21,):
        rows, cols = 24, 32 * n_blocks
        w = random_weights(qtype, rows, cols, rng)
        for k in (1, 2, 3, 4):
            x = _x(rng, k, cols)
            q, d, s = quantize_for(qtype, x)
            alone = np.full((k, rows), np.nan, np.float32)
            for t in range(k):
                for r in range(rows):
                    _one_row(type_tag(qtype), w, r, q[t:t + 1], d[t:t + 1], s[t:t + 1], alone[t:t + 1])
            for per in ((2, 4) if k == 1 else (4,) if k == 2 else (2,)):
                out = np.full((k, rows), np.nan, np.float32)
                _two_phase_groups(type_tag(qtype), w, q, d, s, out, per)
                assert np.array_equal(out.view(np.uint32), alone.view(np.uint32)), \
                    f"{qtype.name}: {n_blocks} blocks, k = {k}, {per} rows a group"


@numba.njit
def _row_lane_groups(qtype, w, r0, n_groups, xq, xd, xs, out, oc0):
    k = xq.shape[0]
    for g in range(n_groups):
        t0 = 0
        while t0 < k:
            n = min(PASS_TOKENS, k - t0)
            row_lanes_dot(qtype, n, w, r0 + ROW_LANES * g, xq, xd, xs, t0, out, oc0 + ROW_LANES * g, g == 0)
            t0 += n


@pytest.mark.parametrize("qtype", INT, ids=lambda t: t.name)
def test_row_lanes_give_the_register_groups_bits(qtype):
    """matvec_rowlanes (16 rows in the lanes of a vector, the weights transposed; Q4_K, Q5_K and
    Q6_K decoded in the lanes from their raw bytes) gives every (row, token) the bits of the
    register groups, a row at a time: every pass size (1, 2, 4 with a repeated token, 8) and two
    passes (11 tokens), groups at an odd row offset written at an offset column; a 32-weight type's
    rows end in an odd block (a step of one; Q4_0's full pairs decoded in the lanes from 4 tokens)."""
    if int(qtype) not in ROW_LANES_HOST:
        pytest.skip(f"{qtype.name} takes no row lanes in this host's lowering ({ISA})")
    rng = np.random.default_rng(700 + int(qtype))
    rows, cols = 37, 32 * 25 if act_block(qtype) == 32 else 256 * 3
    w = random_weights(qtype, rows, cols, rng)
    x = _x(rng, 11, cols)
    x[4] *= 1e3
    for k in (1, 2, 3, 5, 8, 11):
        q, d, s = quantize_for(qtype, x[:k])
        ref = np.empty((k, rows), np.float32)
        _by_rows(type_tag(qtype), w, q, d, s, ref, False)       # block_dots a row at a time: no row lanes
        out = np.full((k, 2 * ROW_LANES + 2), np.nan, np.float32)
        _row_lane_groups(type_tag(qtype), w, 3, 2, q, d, s, out, 1)
        assert np.array_equal(out[:, 1:-1].view(np.uint32), ref[:, 3:3 + 2 * ROW_LANES].view(np.uint32)), \
            f"{qtype.name}: k = {k}"
        assert np.isnan(out[:, 0]).all() and np.isnan(out[:, -1]).all()     # nothing outside the groups


# the quant bytes (start, stop) of each block of the types with a formats weight_max
_QUANT_BYTES = {T.Q4_0: (2, 18), T.Q4_1: (4, 20), T.Q4_K: (16, 144), T.Q5_K: (16, 176), T.Q6_K: (0, 192)}


def test_every_weight_max_is_tested():
    assert set(WEIGHT_MAX) == {int(t) for t in _QUANT_BYTES}


@pytest.mark.parametrize("qtype", list(_QUANT_BYTES), ids=lambda t: t.name)
def test_row_lanes_at_the_integer_extremes(qtype):
    """Every weight at its largest value (every quant bit set: formats' weight_max) and every
    activation at +-127: the sums the avx2 lowering keeps in int16 (matvec_rowlanes.i16_sum_dwords)
    at their largest, still the register groups' bits (a sum that saturated or wrapped would not be)."""
    if int(qtype) not in ROW_LANES_HOST:
        pytest.skip(f"{qtype.name} takes no row lanes in this host's lowering ({ISA})")
    rng = np.random.default_rng(900 + int(qtype))
    rows, cols = 16, 256 * 2
    w = random_weights(qtype, rows, cols, rng)
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = w.reshape(rows, cols // block_elems, block_bytes)
    lo, hi = _QUANT_BYTES[qtype]
    blocks[:, :, lo:hi] = 0xFF
    x = np.ones((8, cols), np.float32)
    x[1::2] *= -1.0
    x[2, 256:] *= -1.0
    q, d, s = quantize_for(qtype, x)
    assert np.abs(q[:, :cols]).min() == 127
    ref = np.empty((8, rows), np.float32)
    _by_rows(type_tag(qtype), w, q, d, s, ref, False)
    out = np.full((8, ROW_LANES), np.nan, np.float32)
    _row_lane_groups(type_tag(qtype), w, 0, 1, q, d, s, out, 0)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32)), qtype.name


def test_row_lanes_where_measured():
    """block_dots takes row lanes where they were measured faster. AVX-512 VNNI: on AMD Zen Q4_K and
    Q8_0 from 1 token, Q6_K and Q4_1 from 3; elsewhere (Intel) one token stays in the register groups,
    so 2; matvec keeps their batches out of the token quads (tiled from the token lanes' k). avx2:
    the K-quants, IQ4 types, Q4_0 and Q4_1 from 4 tokens on any CPU, Q5_0 / Q5_1 / Q8_0 never; the
    types the token quads take there keep the row lanes up to a full pass. avxvnni: none."""
    assert row_lanes_table("emeraldrapids", "avxvnni") == {} and row_lanes_table("znver4", "portable") == {}
    zen, intel = row_lanes_table("znver4", "avx512vnni"), row_lanes_table("emeraldrapids", "avx512vnni")
    assert zen[int(T.Q4_K)] == 1 and zen[int(T.Q6_K)] == 3 and zen[int(T.Q8_0)] == 1 and zen[int(T.Q4_1)] == 3
    assert intel[int(T.Q4_K)] == 2 and intel[int(T.Q6_K)] == 3 and intel[int(T.Q8_0)] == 2 and intel[int(T.Q4_1)] == 3
    assert set(zen) == set(intel)
    ymm = row_lanes_table("znver3", "avx2")
    assert ymm == row_lanes_table("skylake", "avx2") and set(ymm.values()) == {4}
    assert {T.Q4_K, T.Q5_K, T.Q6_K, T.Q4_0, T.Q4_1, T.IQ4_NL}.issubset(ymm) and not {T.Q5_0, T.Q5_1, T.Q8_0} & set(ymm)
    if ISA == "avx2":
        assert ROW_LANES_HOST == ymm
        assert tiled_min_k(T.Q4_K) == tiled_min_k(T.IQ4_NL) == PASS_TOKENS + 1
        assert tiled_min_k(T.Q4_1) == LANES_MIN_K["pair"] and tiled_min_k(T.Q8_0) == TILED_MIN_K
        return
    if ISA != "avx512vnni":
        assert ROW_LANES_HOST == {}
        return
    assert ROW_LANES_HOST in (zen, intel)
    assert tiled_min_k(T.Q4_K) == LANES_MIN_K["k"] and tiled_min_k(T.Q8_0) == LANES_MIN_K["pair"]


@numba.njit
def _one_row(qtype, w, r, xq, xd, xs, out):
    rows_dot(qtype, 1, w, r, xq, xd, xs, 0, out, r)


@pytest.mark.parametrize("qtype", INT, ids=lambda t: t.name)
def test_prompt_batches_give_each_token_its_own_bits(qtype):
    rng = np.random.default_rng(300 + int(qtype))
    rows, cols = 37, 32 * 75 if act_block(qtype) == 32 else 256 * 9     # several column chunks
    w = random_weights(qtype, rows, cols, rng)
    x = _x(rng, 72, cols)
    x[7] *= 1e3
    alone = np.stack([matvec(w, qtype, x[t:t + 1])[0] for t in range(72)]).view(np.uint32)
    for threads in (1, 2):
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        for k, start in ((9, 2), (16, 0), (17, 3), (33, 7), (40, 0), (65, 6)):
            y = matvec(w, qtype, x[start:start + k]).view(np.uint32)
            assert np.array_equal(y, alone[start:start + k]), f"{qtype.name}: batch of {k} from {start}, {threads} threads"
    q, d, s = quantize_for(qtype, x[:3])
    for rows_at_once in (False, True):
        out = np.empty((3, rows), np.float32)
        _by_rows(int(qtype), w, q, d, s, out, rows_at_once)
        assert np.array_equal(out.view(np.uint32), alone[:3]), f"{qtype.name}: rows_at_once={rows_at_once}"


def test_token_lanes_where_they_win():
    """On the AVX-512 VNNI lowering every type takes the token lanes from its kind's k; on the ymm
    lowerings the K-quants, IQ4_NL / IQ4_XS and Q8_0 stay on the token quads, which were faster there
    at every k (matvec_tiled.QUADS_ON_YMM), and the other 32-weight types keep the lanes."""
    for qtype in INT:
        kind = LANES_MIN_K["k" if qtype in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS) else "pair"]
        assert lanes_min_k(qtype, "avx512vnni") == kind, qtype.name
        on_quads = qtype in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS, T.IQ4_NL, T.Q8_0)
        assert lanes_min_k(qtype, "avx2") == (1 << 30 if on_quads else kind), qtype.name

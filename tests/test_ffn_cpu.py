"""cpu_kernels.ffn.ffn_glu against a float64 reference, and its bit identity across k (float and int paths)."""
from __future__ import annotations

import math

import numba
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize

from cpu_kernels.ffn import FfnScratch, ffn_glu
from cpu_kernels.matvec import matvec
from cpu_kernels.matvec_testdata import random_weights


def _reference(x, wg, tg, wu, tu, wd, td, act):
    x = x.astype(np.float64)
    g = x @ dequantize(wg, tg).astype(np.float64).T
    u = x @ dequantize(wu, tu).astype(np.float64).T
    if act == "silu":
        a = g / (1.0 + np.exp(-g))
    else:
        a = 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)))
    return (a * u) @ dequantize(wd, td).astype(np.float64).T


@pytest.fixture(autouse=True)
def _two_threads():
    before = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    yield
    numba.set_num_threads(before)


# (gate/up type, down type, activation): the layouts of the real models (SmolLM2 Q4_1; Gemma 3
# Q5_0 gate/up with Q4_K or Q6_K down; Q4_K_M 27B Q4_K with Q6_K down) plus mixed gate/up types.
CASES = [
    ((T.Q4_1, T.Q4_1), T.Q4_1, "silu"),
    ((T.Q5_0, T.Q5_0), T.Q6_K, "gelu_tanh"),
    ((T.Q5_0, T.Q5_0), T.Q4_K, "gelu_tanh"),
    ((T.Q4_K, T.Q4_K), T.Q6_K, "silu"),
    ((T.Q8_0, T.F16), T.Q5_K, "silu"),
]


@pytest.mark.parametrize("exact", [True, False], ids=["float", "int"])
@pytest.mark.parametrize("types,t_down,act", CASES, ids=lambda c: str(c))
def test_ffn_matches_float64_reference(types, t_down, act, exact):
    (tg, tu) = types
    rng = np.random.default_rng(int(tg) * 100 + int(t_down))
    n_embd, n_ff = 512, 1280                          # n_ff: a partial 1024-column chunk in down
    wg = random_weights(tg, n_ff, n_embd, rng)
    wu = random_weights(tu, n_ff, n_embd, rng)
    wd = random_weights(t_down, n_embd, n_ff, rng)
    for k in (1, 4, 7, 18):
        x = rng.standard_normal((k, n_embd)).astype(np.float32)
        y = ffn_glu(x, wg, tg, wu, tu, wd, t_down, act=act, exact=exact)
        ref = _reference(x, wg, tg, wu, tu, wd, t_down, act)
        assert y.shape == (k, n_embd) and y.dtype == np.float32
        rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
        # int: x and the hidden vector are each quantized to int8 blocks (~0.5 % per matvec on
        # Gaussian data, see test_matvec_int's per-output bound)
        assert rel <= (1e-5 if exact else 3e-2), f"k={k}: relative error {rel:.2e}"


@pytest.mark.parametrize("exact", [True, False], ids=["float", "int"])
def test_ffn_token_result_does_not_depend_on_batch(exact):
    rng = np.random.default_rng(7)
    n_embd, n_ff = 256, 768
    wg, wu = random_weights(T.Q4_K, n_ff, n_embd, rng), random_weights(T.Q4_K, n_ff, n_embd, rng)
    wd = random_weights(T.Q6_K, n_embd, n_ff, rng)
    x = rng.standard_normal((21, n_embd)).astype(np.float32)     # 21: token lanes (>= 16) and a padded vector
    scratch = FfnScratch.allocate(21, n_ff, n_embd)
    batch = ffn_glu(x, wg, T.Q4_K, wu, T.Q4_K, wd, T.Q6_K, act="silu", scratch=scratch, exact=exact).copy()
    assert np.shares_memory(ffn_glu(x[:2], wg, T.Q4_K, wu, T.Q4_K, wd, T.Q6_K, scratch=scratch, exact=exact),
                            scratch.out)
    for t in range(21):
        alone = ffn_glu(x[t:t + 1], wg, T.Q4_K, wu, T.Q4_K, wd, T.Q6_K, act="silu", exact=exact)
        assert np.array_equal(alone.view(np.uint32), batch[t:t + 1].view(np.uint32))


@pytest.mark.parametrize("exact", [True, False], ids=["float", "int"])
def test_gate_and_up_are_the_matvec_results(exact):
    # The fused gate/up loop must give exactly what two matvecs give (same kernels, same order).
    rng = np.random.default_rng(8)
    n_embd, n_ff = 256, 64
    wg, wu = random_weights(T.Q8_0, n_ff, n_embd, rng), random_weights(T.Q8_0, n_ff, n_embd, rng)
    eye = np.eye(n_ff, dtype=np.float32)              # down = identity (F32): y is the hidden vector
    wd = eye.view(np.uint8).reshape(n_ff, n_ff * 4)
    x = rng.standard_normal((3, n_embd)).astype(np.float32)
    h = ffn_glu(x, wg, T.Q8_0, wu, T.Q8_0, wd[:, :], T.F32, act="silu", exact=exact)
    g = matvec(wg, T.Q8_0, x, exact=exact).astype(np.float64)
    u = matvec(wu, T.Q8_0, x, exact=exact).astype(np.float64)
    expected = (g / (1.0 + np.exp(-g)) * u).astype(np.float32)
    assert np.allclose(h, expected, rtol=1e-6, atol=1e-7)


def test_rejects_unknown_activation():
    rng = np.random.default_rng(9)
    w = random_weights(T.Q8_0, 32, 32, rng)
    with pytest.raises(ValueError, match="activation"):
        ffn_glu(np.zeros((1, 32), np.float32), w, T.Q8_0, w, T.Q8_0, w, T.Q8_0, act="relu")


def test_activations_match_float64_and_do_not_depend_on_the_loop():
    """SiLU and GELU-tanh on _exp (arithmetic only, so a row's loop vectorizes) are within float32
    rounding of numpy's float64 forms, over the range activations reach and past where they
    saturate; and a row computed at once equals its values computed one at a time (the vector body
    and the scalar tail of a vectorized loop give the same bits)."""
    from cpu_kernels.ffn import ACTIVATIONS, _act_times_rows

    rng = np.random.default_rng()
    g = np.concatenate([rng.standard_normal(2000) * 4, np.linspace(-800, 800, 51)]).astype(np.float32)[None, :]
    u = rng.uniform(0.5, 2.0, g.shape).astype(np.float32)
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    z = math.sqrt(2 / math.pi) * (g64 + 0.044715 * g64 ** 3)
    # 0.5 g (1 + tanh z) as g / (1 + e^-2z): the same function without the cancellation of 1 + tanh z
    # near -1, which leaves a float64 tanh form only absolutely accurate there
    refs = {"silu": g64 / (1 + np.exp(np.clip(-g64, -700, 700))) * u64,
            "gelu_tanh": g64 / (1 + np.exp(np.clip(-2 * z, -700, 700))) * u64}
    for name, ref in refs.items():
        out = np.empty_like(g)
        _act_times_rows(g, u, out, ACTIVATIONS[name])
        err = np.abs(out - ref) / np.maximum(np.abs(ref), 1e-30)
        assert np.all((err <= 2e-7) | (np.abs(out - ref) <= 1e-37)), f"{name}: max relative error {err.max():.2e}"
        one = np.empty((1, 1), np.float32)
        for i in rng.choice(g.shape[1], 64, replace=False):
            _act_times_rows(g[:, i:i + 1], u[:, i:i + 1], one, ACTIVATIONS[name])
            assert one[0, 0] == out[0, i] or (np.isnan(one[0, 0]) and np.isnan(out[0, i]))

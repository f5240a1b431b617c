"""cpu_kernels.kv_attention (the fused CPU trunk's attention over its KV cache) against float64 on
fresh random inputs, and the bit identities greedy speculative parity rests on: a token alone or in
a verify batch, one thread or two, whichever (heads x keys) step computed a score."""
from __future__ import annotations

import math

import numba
import numpy as np
import pytest

from cpu_kernels import kv_attention as ka
from cpu_kernels.matvec_simd import dot_f32
from kv_helpers import random_kv_caches


def _reference(q, kc, vc, start, n_head, n_kv, scale, window, first):
    """float64 softmax attention of each token's heads over the keys it sees (caches as float)."""
    k, d, dv = q.shape[0], kc.shape[2], vc.shape[2]
    out = np.zeros((k, n_head * dv))
    for t in range(k):
        pos = start + t
        lo = max(first, pos - window + 1) if window else first
        for h in range(n_head):
            g = h // (n_head // n_kv)
            s = scale * (kc[lo:pos + 1, g].astype(np.float64) @ q[t, h * d:(h + 1) * d].astype(np.float64))
            p = np.exp(s - s.max())
            out[t, h * dv:(h + 1) * dv] = (p / p.sum()) @ vc[lo:pos + 1, g].astype(np.float64)
    return out


def _q8_0(x):
    """x [n, n_kv, d] as a q8_0 cache (ggml blocks written by the kernel's own store) and as read."""
    n, n_kv, d = x.shape
    blocks = np.zeros((n, n_kv, d // 32, 34), np.uint8)
    for j in range(n):
        for g in range(n_kv):
            _store(blocks[j, g], np.ascontiguousarray(x[j, g]))
    scale = blocks[..., :2].copy().view(np.float16).astype(np.float32)
    return blocks, (blocks[..., 2:].view(np.int8).astype(np.float32) * scale).reshape(n, n_kv, d)


@numba.njit
def _store(row, x):
    ka.cache_store(row, x)


def _caches(rng, n_ctx, n_kv, d, dv, kind):
    """(K, V) as the kernel takes them and as float32 values the reference reads."""
    kf = 2 * rng.standard_normal((n_ctx, n_kv, d)).astype(np.float32)
    vf = rng.standard_normal((n_ctx, n_kv, dv)).astype(np.float32)
    if kind == "f32":
        return kf, vf, kf, vf
    if kind == "f16":
        k16, v16 = kf.astype(np.float16), vf.astype(np.float16)
        return k16.view(np.uint16), v16.view(np.uint16), k16.astype(np.float32), v16.astype(np.float32)
    (kq, kr), (vq, vr) = _q8_0(kf), _q8_0(vf)
    return kq, vq, kr, vr


# group sizes 1-6 cover every scores step (4x1, 3x1, 2x2 + 2x1, 1x4 + 1x1) and a remainder group;
# head sizes off 16 the tails; the contexts one chunk, several, and a window inside a chunk
CASES = [  # n_head, n_kv, d, dv, start, k, window, first, cache
    (9, 3, 64, 64, 700, 1, 0, 0, "f16"),
    (4, 1, 256, 256, 300, 3, 0, 0, "f16"),
    (4, 2, 40, 40, 600, 2, 130, 5, "f32"),
    (8, 8, 32, 32, 129, 4, 0, 0, "f32"),
    (6, 1, 24, 24, 260, 2, 0, 17, "f16"),
    (10, 2, 64, 64, 90, 5, 37, 0, "q8_0"),
    (6, 2, 32, 80, 200, 3, 0, 0, "f32"),
    (2, 2, 16, 16, 0, 1, 0, 0, "f32"),
]


@pytest.mark.parametrize("n_head,n_kv,d,dv,start,k,window,first,cache", CASES)
def test_attend_matches_float64(n_head, n_kv, d, dv, start, k, window, first, cache):
    rng = np.random.default_rng()
    kc, vc, kf, vf = _caches(rng, start + k + 3, n_kv, d, dv, cache)
    q = rng.standard_normal((k, n_head * d)).astype(np.float32)
    scale = 1 / math.sqrt(d)
    o = np.full((k, n_head * dv), np.nan, np.float32)
    ka.attend(2, q, kc, vc, o, start, n_head, n_kv, d, dv, scale, window, first)
    want = _reference(q, kf, vf, start, n_head, n_kv, scale, window, first)
    assert np.abs(o - want).max() <= 2e-6 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("n_head,n_kv,d,dv,start,k,window,first,cache", CASES)
def test_attend_bits_do_not_depend_on_batch_or_threads(n_head, n_kv, d, dv, start, k, window, first, cache):
    rng = np.random.default_rng()
    kc, vc, _, _ = _caches(rng, start + k + 3, n_kv, d, dv, cache)
    q = rng.standard_normal((k, n_head * d)).astype(np.float32)
    runs = []
    for threads in (1, 2):
        o = np.zeros((k, n_head * dv), np.float32)
        ka.attend(threads, q, kc, vc, o, start, n_head, n_kv, d, dv, np.float32(0.1), window, first)
        runs.append(o)
    assert np.array_equal(runs[0], runs[1])
    for t in range(k):      # each token alone, at its own position
        o = np.zeros((1, n_head * dv), np.float32)
        ka.attend(2, q[t:t + 1], kc, vc, o, start + t, n_head, n_kv, d, dv, np.float32(0.1), window, first)
        assert np.array_equal(o[0], runs[0][t]), t


@numba.njit
def _scores_via(r, q, k, n, d, out):
    ka.group_scores(r, q, 0, k, 0, d, n, d, np.float32(1.0), out, 0, 0)


@numba.njit
def _dots(q, k, r, n, d, out):
    for h in range(r):
        for j in range(n):
            out[h * n + j] = dot_f32(q[h * d:(h + 1) * d], k[j * d:(j + 1) * d])


@pytest.mark.parametrize("d", [16, 40, 64, 7])
def test_every_scores_step_is_dot_f32(d):
    """Each (heads x keys) step sums each score as dot_f32 does: the same bits whichever step, and
    however many keys (tails of the 2- and 4-key steps included), computed it."""
    rng = np.random.default_rng()
    for r in (1, 2, 3, 4):
        for n in (1, 2, 3, 5, 8):
            q = rng.standard_normal(r * d).astype(np.float32)
            k = rng.standard_normal(n * d).astype(np.float16)
            got, want = np.empty(r * n, np.float32), np.empty(r * n, np.float32)
            _scores_via(r, q, k.view(np.uint16), n, d, got)
            _dots(q, k.view(np.uint16), r, n, d, want)
            assert np.array_equal(got, want), (r, n)


@numba.njit
def _exp_all(x, out):
    for i in range(x.shape[0]):
        out[i] = ka.exp_f32(x[i])


@numba.njit
def _exp_shift_all(x, m):
    ka.exp_shift_at(x, 0, x.shape[0], m)


def test_exp_is_within_two_ulp_and_lanes_agree():
    rng = np.random.default_rng()
    x = np.concatenate([-rng.uniform(0, 87, 100_000), -rng.uniform(0, 1e-3, 1000), [0.0, -1e-30, -86.99]]).astype(np.float32)
    got = np.empty_like(x)
    _exp_all(x, got)
    want = np.exp(x.astype(np.float64))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    assert (np.abs(got - want) / ulp).max() <= 2.0
    assert got[-3] == 1.0
    # below the float range's end: 0; NaN stays NaN
    under = np.array([-87.5, -200.0, -np.inf, np.nan], np.float32)
    out = np.empty_like(under)
    _exp_all(under, out)
    assert out[0] == out[1] == out[2] == 0.0 and np.isnan(out[3])
    # the vector loop (16 lanes, then a 1-lane tail) gives each value the scalar's bits
    vec = x[:1000].copy()
    _exp_shift_all(vec, np.float32(0.0))
    assert np.array_equal(vec, got[:1000])


@pytest.mark.parametrize("cache", ["f32", "f16", "q8_0", "bf16"])
@pytest.mark.parametrize("n_new,start,window,first", [(40, 0, 0, 0), (70, 5, 32, 0), (3, 60, 0, 1)])
def test_attend_on_cpu_matches_torch_attend(cache, n_new, start, window, first):
    """The CPU trunk's attention (hybridrt.runtime.backends.attend_on_cpu: kv_attention for f32 / f16 /
    q8_0 caches, prompt batches included) gives torch's attend within float32 rounding, on the
    same cache objects a session holds; a bf16 cache takes torch's path."""
    import torch

    from gpu_kernels.attention import attend
    from hybridrt.runtime.backends.fused import _fused_cache_view, attend_on_cpu

    n_head, n_kv, d = 6, 2, 64
    torch.manual_seed(n_new + start)
    kc, vc = random_kv_caches(cache, start + n_new + 4, n_kv, d)
    q = torch.randn(n_new, n_head, d)
    positions = list(range(start, start + n_new))
    got = attend_on_cpu(q, kc, vc, positions, 0.125, window, first)
    want = attend(q, kc, vc, positions, 0.125, window, first)
    assert got.shape == want.shape == (n_new, n_head, d)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    if cache != "bf16":     # kv_attention's own bits, not a fallback to torch's
        o = np.empty((n_new, n_head * d), np.float32)
        ka.attend(2, q.reshape(n_new, -1).numpy(), _fused_cache_view(kc), _fused_cache_view(vc), o, start, n_head,
                  n_kv, d, d, 0.125, window, first)
        assert np.array_equal(got.reshape(n_new, -1).numpy(), o)
    # a negative control: another window is caught
    if window:
        other = attend(q, kc, vc, positions, 0.125, window + 8, first)
        assert not torch.allclose(got, other, atol=2e-5, rtol=1e-4)


def test_state_zeros_every_storage_and_empty_shapes():
    """A session's buffers from calloc (kv_cache.state_zeros): zero, contiguous, writable, of the
    dtype asked, the empty ring of k_max = 1 included, after memory a dirty buffer freed."""
    import numpy as np
    import torch

    from hybridrt.runtime.kv_cache import state_zeros

    dirty = np.full(1 << 22, 7, np.uint8)     # a block of non-zero bytes, freed for calloc to hand back
    del dirty
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.uint8):
        t = state_zeros(64, 8, 128, dtype=dtype)
        assert t.shape == (64, 8, 128) and t.dtype == dtype and t.is_contiguous() and not t.any()
        t[3, 2, 1] = 1
        assert t.sum() == 1
    assert state_zeros(4, 0, 2).shape == (4, 0, 2)

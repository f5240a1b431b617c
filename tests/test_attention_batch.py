"""cpu_kernels.attention_batch.attend_decode (the train-mtp teacher's decode attention) against a
float64 reference on fresh random inputs: grouped heads, padding and sliding-window masks, caches
filled to fewer rows than they hold."""
from __future__ import annotations

import numpy as np
import pytest

from cpu_kernels.attention_batch import attend_decode


def _reference(q, k, v, visible, scale):
    """float64 softmax attention of each query head over its KV head's visible keys."""
    b, n_head, _ = q.shape
    group = n_head // k.shape[1]
    out = np.zeros((b, n_head, v.shape[-1]))
    for i in range(b):
        keys = np.flatnonzero(visible[i])
        for h in range(n_head):
            g = h // group
            s = scale * (k[i, g, keys].astype(np.float64) @ q[i, h].astype(np.float64))
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v[i, g, keys].astype(np.float64)
    return out


@pytest.mark.parametrize("cache", ["f32", "f16"])
@pytest.mark.parametrize("n_head,n_kv,d,dv", [(4, 4, 32, 32), (9, 3, 64, 64), (4, 1, 256, 256), (6, 2, 32, 48)])
def test_attend_decode_matches_float64(n_head, n_kv, d, dv, cache):
    rng = np.random.default_rng()
    b, n_ctx, n = 5, 40, int(rng.integers(2, 40))
    q = rng.standard_normal((b, n_head, d)).astype(np.float32)
    k = 2 * rng.standard_normal((b, n_kv, n_ctx, d)).astype(np.float32)
    v = rng.standard_normal((b, n_kv, n_ctx, dv)).astype(np.float32)
    # row 0 sees everything; the others a left padding, a sliding window or random holes
    visible = np.ones((b, n), bool)
    visible[1, :n // 2] = False
    visible[2, :max(0, n - 3)] = False
    visible[3] = rng.random(n) < 0.5
    visible[4, :] = False
    visible[4, n - 1] = True
    visible[3, 0] = True
    out = np.full((b, n_head, dv), np.nan, np.float32)
    scale = np.float32(1 / np.sqrt(d))
    kc, vc = k, v
    if cache == "f16":          # the teacher's cache: float16 bits, each value widened exactly
        kc, vc = k.astype(np.float16).view(np.uint16), v.astype(np.float16).view(np.uint16)
        k, v = (x.view(np.float16).astype(np.float32) for x in (kc, vc))     # what the reference reads

    def attend(vis, o):
        attend_decode(q, kc, vc, n, vis, scale, o)
    attend(visible, out)
    want = _reference(q, k[:, :, :n], v[:, :, :n], visible, float(scale))
    err = np.abs(out - want).max()
    assert err < 2e-5 * max(1.0, np.abs(want).max()), err
    # a negative control: the kernel ignores masked keys, so unmasking one moves the result
    visible[1, 0] = True
    moved = np.empty_like(out)
    attend(visible, moved)
    assert np.abs(moved[1] - out[1]).max() > 1e-4

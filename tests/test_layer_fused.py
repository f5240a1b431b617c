"""cpu_kernels.layer_fused and gdn_block: a layer's attention half, FFN half and Gated DeltaNet half in
one call, against float64 references on fresh random inputs, and a token's result (and a GDN
half's state and snapshot ring) bitwise independent of the batch and of the serial / parallel
choice. One file, so that one worker compiles the kernels' shared type set once."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from cpu_kernels import gdn_block, layer_fused
from cpu_kernels.dequant import dequantize
from cpu_kernels.ffn import ACTIVATIONS
from cpu_kernels.matvec import float_tag
from cpu_kernels.matvec_int import types_tag
from cpu_kernels.matvec_simd import dot_f32, f16_bits_to_f32, f32_to_f16_bits
from cpu_kernels.matvec_testdata import random_weights
from gpu_kernels.attention import q8_0_dequantize, q8_0_quantize
from gpu_kernels.rotary import rotary_table

N_EMBD, N_HEAD, N_KV, HEAD, N_ROT, N_FF, N_CTX = 512, 4, 2, 128, 64, 1024, 64
EPS = 1e-6
# int8x2 (the residual pass on every integer matrix): measured over 30 draws per case, attention
# median 4-5e-5, max 1.0e-4 (llama-q4_1), FFN median 4.6-6.3e-5, max 7.4e-5; one pass is ~1e-2
RESIDUAL_BOUND = 1e-3
# the kernels' compile-time type sets: every type of the cases below, so all cases share a
# compilation (two: with and without the float path). One set for all three halves: the callees they
# share (the matrix code) then compile once; a set per half cost this file 996 s against 813 on
# 2026-11-29. The float path holds these types' decoders, not all fifteen (CHUNK_DECODERS): the others
# are checked inside the fused halves by tests/test_unusual_layouts.py
CASE_TYPES = (T.Q4_1, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K, T.IQ4_XS, T.IQ4_NL)
TYPES = types_tag(CASE_TYPES)
FLOATS = float_tag((T.F32,) + CASE_TYPES)


def _float_path(ops):
    """float_path for these matrix_operands tuples: every decoder's type where one is on the float
    path (as TYPES for the integer ones), so all cases share a compilation."""
    return FLOATS if not all(op[3] for op in ops) else ()


def _matrix(rng, qtype, rows, cols, integer):
    """integer: False (the float path), True (int8 activations) or 2 (int8 with the residual pass)."""
    raw = random_weights(qtype, rows, cols, rng)
    w64 = dequantize(raw, qtype, cols).reshape(rows, cols).astype(np.float64)
    if qtype == T.F32:
        w64 *= 0.05         # random_weights' F32 values are N(0, 1): keep activations O(1)
        raw = w64.astype(np.float32).view(np.uint8)
    return layer_fused.matrix_operands(raw, qtype, bool(integer), residual=integer == 2), w64


def _rms(x, w):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w


def _rotate64(x, cos, sin, neox):
    """x [..., d] at one position, first N_ROT dims rotated, float64."""
    y, half = x.copy(), N_ROT // 2
    ia = np.arange(half) if neox else 2 * np.arange(half)
    ib = ia + half if neox else ia + 1
    y[..., ia] = x[..., ia] * cos - x[..., ib] * sin
    y[..., ib] = x[..., ib] * cos + x[..., ia] * sin
    return y


class Layer:
    """Random weights of one attention half; `ref` is its float64 forward."""

    def __init__(self, rng, types, integer, qk_norm, post, neox, window, first=0, gated=False):
        dims = [(N_HEAD * HEAD * (2 if gated else 1), N_EMBD), (N_KV * HEAD, N_EMBD), (N_KV * HEAD, N_EMBD), (N_EMBD, N_HEAD * HEAD)]
        self.ops, self.w = zip(*(_matrix(rng, t, r, c, integer if t != T.F32 else False) for t, (r, c) in zip(types, dims)))
        self.norm = rng.uniform(0.5, 1.5, N_EMBD).astype(np.float32)
        self.post = rng.uniform(0.5, 1.5, N_EMBD).astype(np.float32)
        self.q_norm = rng.uniform(0.5, 1.5, HEAD).astype(np.float32)
        self.k_norm = rng.uniform(0.5, 1.5, HEAD).astype(np.float32)
        self.qk_norm, self.has_post, self.neox, self.window, self.first = qk_norm, post, neox, window, first
        self.gated = gated
        table = rotary_table(N_CTX, N_ROT, 10000.0, neox)
        self.cos, self.sin = table.cos.numpy(), table.sin.numpy()

    def run(self, h, k_cache, v_cache, start, n_threads=1):
        return layer_fused.attention_block(
            h, n_threads, TYPES, _float_path(self.ops), self.norm, self.post, self.has_post, EPS,
            *self.ops[0], *self.ops[1], *self.ops[2], *self.ops[3], self.q_norm, self.k_norm, self.qk_norm,
            self.gated, self.cos, self.sin, N_ROT, self.neox,
            k_cache, v_cache, start, N_HEAD, N_KV, HEAD, HEAD, 1 / math.sqrt(HEAD), self.window, self.first)

    def ref(self, h, k_cache, v_cache, start, cache="f32"):
        """float64: returns (h + attention, the caches with the new rows), the new rows rounded as
        a cache of type `cache` stores them before they are attended over."""
        wq, wk, wv, wo = self.w
        h64 = h.astype(np.float64)
        x = _rms(h64, self.norm)
        q = (x @ wq.T).reshape(-1, N_HEAD, (2 if self.gated else 1) * HEAD)
        q, gate = q[..., :HEAD], q[..., HEAD:].reshape(len(h), -1)      # gated: [q_h | gate_h] per head
        k = (x @ wk.T).reshape(-1, N_KV, HEAD)
        v = (x @ wv.T).reshape(-1, N_KV, HEAD)
        if self.qk_norm:
            q, k = _rms(q, self.q_norm), _rms(k, self.k_norm)
        keys, vals = k_cache.astype(np.float64), v_cache.astype(np.float64)
        out = np.empty((len(h), N_HEAD * HEAD))
        for t in range(len(h)):
            pos = start + t
            cos, sin = self.cos[pos].astype(np.float64), self.sin[pos].astype(np.float64)
            q[t], keys[pos] = _rotate64(q[t], cos, sin, self.neox), _rotate64(k[t], cos, sin, self.neox)
            vals[pos] = v[t]
            keys[pos], vals[pos] = _stored(keys[pos], cache), _stored(vals[pos], cache)
        for t in range(len(h)):
            pos = start + t
            lo = max(self.first, pos - self.window + 1) if self.window else self.first
            for hd in range(N_HEAD):
                g = hd // (N_HEAD // N_KV)
                s = keys[lo:pos + 1, g] @ q[t, hd] / math.sqrt(HEAD)
                p = np.exp(s - s.max())
                out[t, hd * HEAD:(hd + 1) * HEAD] = (p / p.sum()) @ vals[lo:pos + 1, g]
        if self.gated:
            out = out / (1 + np.exp(-gate))
        a = out @ wo.T
        return h64 + (_rms(a, self.post) if self.has_post else a), keys, vals


def _caches(rng, start, cache="f32"):
    """K and V caches with `start` random rows as the kernel takes them: float32, float16 (its
    uint16 bits) or q8_0 (uint8 blocks [.., HEAD / 32, 34], the torch trunk's quantizer)."""
    k = np.zeros((N_CTX, N_KV, HEAD), np.float32)
    v = np.zeros((N_CTX, N_KV, HEAD), np.float32)
    k[:start] = rng.standard_normal((start, N_KV, HEAD))
    v[:start] = rng.standard_normal((start, N_KV, HEAD))
    if cache == "f16":
        return k.astype(np.float16).view(np.uint16), v.astype(np.float16).view(np.uint16)
    if cache == "q8_0":
        return tuple(q8_0_quantize(torch.from_numpy(c)).numpy() for c in (k, v))
    return k, v


def _values(c):
    """A cache's values as float32 (float16 bits widened, q8_0 blocks dequantized)."""
    if c.dtype == np.uint8:
        return q8_0_dequantize(torch.from_numpy(c)).numpy()
    return c.view(np.float16).astype(np.float32) if c.dtype == np.uint16 else c


def _stored(rows, cache):
    """float64 rows as a cache of that type holds them (float16 or q8_0 rounding)."""
    if cache == "f16":
        return rows.astype(np.float16).astype(np.float64)
    if cache == "q8_0":
        return _values(q8_0_quantize(torch.from_numpy(rows.astype(np.float32))).numpy()).astype(np.float64)
    return rows


def _rel(got, ref, base):
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref - base))


ATTN_CASES = {   # types of q, k, v, o; q/k norm, post-norm, neox, window, gated (qwen35: out *= sigmoid(gate))
    "llama-f32": ((T.F32,) * 4, False, False, False, 0, False),
    "llama-q4_1": ((T.Q4_1,) * 4, False, False, False, 0, False),
    "qwen3-q8_0": ((T.Q8_0,) * 4, True, False, True, 0, False),
    "gemma3-mixed": ((T.Q5_0, T.Q5_0, T.Q8_0, T.Q4_K), True, True, True, 7, False),
    "qwen35-gated": ((T.Q4_K, T.Q4_K, T.Q6_K, T.Q4_K), True, False, True, 0, True),
}


PATHS = dict(argvalues=[False, True, 2], ids=["float", "int8", "int8x2"])   # _matrix's `integer`


@pytest.mark.parametrize("cache", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("integer", **PATHS)
@pytest.mark.parametrize("case", list(ATTN_CASES))
def test_attention_block_matches_float64(case, integer, cache):
    types, qk_norm, post, neox, window, gated = ATTN_CASES[case]
    rng = np.random.default_rng()
    layer = Layer(rng, types, integer, qk_norm, post, neox, window, gated=gated)
    start, k = int(rng.integers(5, 30)), 3
    h = rng.standard_normal((k, N_EMBD)).astype(np.float32)
    kc, vc = _caches(rng, start, cache)
    ref, ref_k, ref_v = layer.ref(h, _values(kc), _values(vc), start, cache)
    got = layer.run(h, kc, vc, start)
    err = _rel(got, ref, h)
    # float path: float32 rounding; a float16 cache adds a float16 ulp where a new row's float32
    # value and the float64 reference round apart (100 draws a case: median 3e-7, max 8.1e-5, so
    # 5e-4); int8 path: activation quantization (|dx| <= d / 2 per value), which the softmax
    # amplifies: measured over 150 draws per case, median 1.1-1.3e-2, max 3.4e-2 (llama-q4_1: no
    # q/k norm, the sharpest scores; float16 cache: the same), so 8e-2; a wrong or unwritten row
    # is O(1)
    # q8_0 cache: a new value that lands on the other side of a quantization level than the
    # float64 reference's moves by 1/127 of its block's max (100 draws a case: median 2e-7, max
    # 7e-4 on the output and the rows, so 5e-3)
    # int8x2 (the residual pass): ~2^-16 per activation instead of 2^-8: RESIDUAL_BOUND
    float_bound = {"f32": 2e-6, "f16": 5e-4, "q8_0": 5e-3}[cache]
    # qwen35-gated: the gate's own int8 noise on top (450 draws over the three caches: median 2.7e-2,
    # max 9.2e-2, so 0.15)
    int8_bound = 0.15 if gated else 8e-2
    bound = {False: float_bound, True: int8_bound, 2: max(float_bound, RESIDUAL_BOUND)}[integer]
    assert err <= bound, f"{case}: relative error {err:.3g}"
    row_bound = bound if cache != "f16" or integer is True else 1e-3       # float16 rows: 2^-11 relative (max 6.6e-5)
    assert _rel(_values(kc)[start:start + k], ref_k[start:start + k], 0) <= row_bound
    assert _rel(_values(vc)[start:start + k], ref_v[start:start + k], 0) <= row_bound
    assert not kc[start + k:].any()             # nothing written past the batch


@pytest.mark.parametrize("cache", ["f16", "q8_0"])
@pytest.mark.parametrize("integer", [False, True], ids=["float", "int8"])
def test_cache_rows_are_the_float32_rows_stored_as_torch_stores_them(integer, cache):
    """A float16 or q8_0 cache stores exactly what a float32 cache gets, rounded as the torch
    trunk's caches round it (torch's .half(); gguf-py's q8_0 quantizer, byte for byte), in the same
    rows; what attends over them is test_attention_block_matches_float64's."""
    types, qk_norm, post, neox, window, gated = ATTN_CASES["gemma3-mixed"]
    rng = np.random.default_rng()
    layer = Layer(rng, types, integer, qk_norm, post, neox, window, gated=gated)
    start, k = 21, 4
    h = rng.standard_normal((k, N_EMBD)).astype(np.float32)
    kq, vq = _caches(rng, start, cache)
    before = kq.copy(), vq.copy()
    k32, v32 = _values(kq).copy(), _values(vq).copy()
    layer.run(h, k32, v32, start)
    layer.run(h, kq, vq, start)
    new = slice(start, start + k)
    for stored, rows, old in ((kq, k32, before[0]), (vq, v32, before[1])):
        if cache == "f16":
            want = rows[new].astype(np.float16).view(np.uint16)
        else:
            want = q8_0_quantize(torch.from_numpy(rows[new])).numpy()
        assert np.array_equal(stored[new], want)
        assert np.array_equal(np.delete(stored, np.r_[new], axis=0), np.delete(old, np.r_[new], axis=0))


def test_attention_block_window_and_first_position_are_honoured():
    """A key outside the window (or before `first`) must not count: changing it changes nothing."""
    rng = np.random.default_rng()
    for window, first in ((5, 0), (0, 4)):
        layer = Layer(rng, (T.Q8_0,) * 4, True, True, False, True, window, first)
        start = 20
        h = rng.standard_normal((2, N_EMBD)).astype(np.float32)
        kc, vc = _caches(rng, start)
        got = layer.run(h, kc.copy(), vc.copy(), start)
        hidden = first if first else start - window      # this row is invisible to both tokens
        kc[hidden - 1], vc[hidden - 1] = 50.0, 50.0
        assert np.array_equal(layer.run(h, kc.copy(), vc.copy(), start), got)
        kc[hidden + 1] += 1.0                            # and this one is seen
        assert not np.array_equal(layer.run(h, kc.copy(), vc.copy(), start), got)


@pytest.mark.parametrize("integer", [True, 2], ids=["int8", "int8x2"])
@pytest.mark.parametrize("cache", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("case", ["llama-q4_1", "gemma3-mixed", "qwen35-gated"])
def test_attention_block_token_does_not_depend_on_the_batch_or_threads(case, cache, integer):
    types, qk_norm, post, neox, window, gated = ATTN_CASES[case]
    rng = np.random.default_rng()
    layer = Layer(rng, types, integer, qk_norm, post, neox, window, gated=gated)
    start, n = 30, 16
    h = rng.standard_normal((n, N_EMBD)).astype(np.float32)
    kc, vc = _caches(rng, start, cache)
    k1, v1 = kc.copy(), vc.copy()
    singles = np.concatenate([layer.run(h[t:t + 1], k1, v1, start + t) for t in range(n)])
    # threads 2: the parallel regions; 16 tokens (8 with the residual pass): legacy types on token lanes
    for k, threads in ((2, 1), (3, 2), (8, 2), (8, 1), (16, 2)):
        kb, vb = kc.copy(), vc.copy()
        batched = np.concatenate([layer.run(h[i:i + k], kb, vb, start + i, threads) for i in range(0, n, k)])
        assert np.array_equal(batched, singles), f"batch of {k}, {threads} threads"
        assert np.array_equal(kb, k1) and np.array_equal(vb, v1)


FFN_CASES = {   # gate, up, down types; activation; post-norm
    "llama-f32": ((T.F32,) * 3, "silu", False),
    "llama-q4_1": ((T.Q4_1,) * 3, "silu", False),
    "gemma3-q5_0-q6_k": ((T.Q5_0, T.Q5_0, T.Q6_K), "gelu_tanh", True),
    "k-quants": ((T.Q4_K, T.Q4_K, T.Q8_0), "silu", True),
    "iq4": ((T.IQ4_XS, T.IQ4_XS, T.IQ4_NL), "silu", False),
}


def _ffn(rng, case, integer, down_only=False):
    types, act, post = FFN_CASES[case]
    dims = [(N_FF, N_EMBD), (N_FF, N_EMBD), (N_EMBD, N_FF)]
    ops, w = zip(*(_matrix(rng, t, r, c, integer if t != T.F32 else False) for t, (r, c) in zip(types, dims)))
    norm, post_w = (rng.uniform(0.5, 1.5, N_EMBD).astype(np.float32) for _ in range(2))

    def run(h, n_threads=1):
        return layer_fused.ffn_block(h, n_threads, TYPES, _float_path(ops), norm, post_w, post, EPS,
                                     *ops[0], *ops[1], *ops[2], ACTIVATIONS[act])

    def ref(h):
        h64 = h.astype(np.float64)
        x = _rms(h64, norm)
        g, u = x @ w[0].T, x @ w[1].T
        with np.errstate(over="ignore"):        # exp(-g) = inf for g << 0: silu's limit, -0.0
            a = g / (1 + np.exp(-g)) if act == "silu" else \
                0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))
        y = (a * u) @ w[2].T
        return h64 + (_rms(y, post_w) if post else y)
    return run, ref


@pytest.mark.parametrize("integer", **PATHS)
@pytest.mark.parametrize("case", list(FFN_CASES))
def test_ffn_block_matches_float64(case, integer):
    rng = np.random.default_rng()
    run, ref = _ffn(rng, case, integer)
    h = rng.standard_normal((3, N_EMBD)).astype(np.float32)
    err = _rel(run(h), ref(h), h)
    # int8: measured over 150 draws per case, median 1.2-1.6e-2, max 2.1e-2 (k-quants); a wrong row is O(1)
    assert err <= {False: 2e-6, True: 5e-2, 2: RESIDUAL_BOUND}[integer], f"{case}: relative error {err:.3g}"


@pytest.mark.parametrize("integer", [True, 2], ids=["int8", "int8x2"])
def test_ffn_block_token_does_not_depend_on_the_batch_or_threads(integer):
    rng = np.random.default_rng()
    run, _ = _ffn(rng, "gemma3-q5_0-q6_k", integer, down_only=True)
    h = rng.standard_normal((32, N_EMBD)).astype(np.float32)
    singles = np.concatenate([run(h[t:t + 1]) for t in range(32)])
    # 14+ int8 rows (16 tokens; 8 with the residual pass): the Q5_0 matrices on token lanes
    for k, threads in ((2, 1), (3, 2), (8, 2), (16, 2), (32, 1)):
        assert np.array_equal(np.concatenate([run(h[i:i + k], threads) for i in range(0, 32, k)]), singles), k


def test_rms_norm_rows_matches_float64_and_the_binders_cpu_norm_is_it():
    from hybridrt.runtime.backends import rms_norm_on_cpu
    rng = np.random.default_rng()
    x = (rng.standard_normal((3, 576)) * rng.uniform(0.01, 30, (3, 1))).astype(np.float32)
    w = rng.standard_normal(576).astype(np.float32)
    ref = x.astype(np.float64) / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w
    got = layer_fused.rms_norm_rows(x, w, 1e-6)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    on_cpu = rms_norm_on_cpu(torch.from_numpy(x[1:]), torch.from_numpy(w), 1e-6)    # a row view: copied
    assert torch.equal(on_cpu, torch.from_numpy(got[1:]))


def test_kernel_types_must_cover_every_matrix():
    """The compile-time type set and float flag leave other types' code out, so a matrix outside
    them would write nothing: the binder refuses such a layer at load time."""
    from hybridrt.runtime.backends.fused import _covering

    ops = [(None, int(T.Q4_1), 32, True), (None, int(T.F32), 1, False)]
    assert layer_fused.kernel_types((op[1], op[3]) for op in ops) == (types_tag([T.Q4_1]), float_tag([T.F32]))
    assert layer_fused.kernel_types((op[1], op[3]) for op in ops[:1])[1] == ()
    kernel_types = (types_tag([T.Q4_1, T.Q6_K]), float_tag([T.F32, T.Q5_0]))
    assert _covering(kernel_types, ops) is kernel_types
    with pytest.raises(ValueError):
        _covering((types_tag([T.Q8_0]), float_tag([T.F32])), ops)   # Q4_1 missing
    with pytest.raises(ValueError):
        _covering((types_tag([T.Q4_1]), ()), ops)                   # the float path missing
    with pytest.raises(ValueError):
        _covering((types_tag([T.Q4_1]), float_tag([T.F16])), ops)   # F32 missing from it


@numba.njit
def _dot_f32(a, b):
    return dot_f32(a, b)


def test_dot_f32_matches_float64():
    rng = np.random.default_rng()
    for n in (0, 1, 15, 16, 17, 64, 128, 131):
        a, b = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
        got, ref = float(_dot_f32(a, b)), float(a.astype(np.float64) @ b.astype(np.float64))
        assert abs(got - ref) <= 1e-5 * max(1.0, float(np.abs(a).astype(np.float64) @ np.abs(b))), n
        # b as float16 bits (a float16 cache row): each value widened exactly, the same order
        b16 = b.astype(np.float16)
        assert _dot_f32(a, b16.view(np.uint16)) == _dot_f32(a, b16.astype(np.float32)), n


@numba.njit
def _round_trip(x, bits, back):
    for i in range(x.shape[0]):
        bits[i] = f32_to_f16_bits(x[i])
        back[i] = f16_bits_to_f32(bits[i])


def test_float16_conversions_are_torchs():
    """float32 -> float16 bits and back, as torch's .half() / .float(): ties to even, subnormals,
    overflow to inf, signed zeros."""
    rng = np.random.default_rng()
    x = (rng.standard_normal(4096) * 10.0 ** rng.uniform(-10, 6, 4096)).astype(np.float32)
    x[:9] = [0.0, -0.0, 65504.0, 65519.99, 65520.0, -1e6, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26]
    bits, back = np.empty(x.shape, np.uint16), np.empty(x.shape, np.float32)
    _round_trip(x, bits, back)
    want = torch.from_numpy(x).half()
    assert np.array_equal(bits, want.view(torch.int16).numpy().view(np.uint16))
    assert np.array_equal(back.view(np.uint32), want.float().numpy().view(np.uint32))


_ATTEND_SCRIPT = """
import sys, numpy as np
from cpu_kernels import kv_attention as ka
rng = np.random.default_rng(7)
n_head, n_kv, d, start, k = 4, 2, 128, 300, 3
q = rng.standard_normal((k, n_head * d)).astype(np.float32)
kc, vc = (rng.standard_normal((320, n_kv, d)).astype(np.float32) for _ in range(2))
o1, o2 = np.zeros((k, n_head * d), np.float32), np.zeros((k, n_head * d), np.float32)
ka.attend(1, q, kc, vc, o1, start, n_head, n_kv, d, d, np.float32(0.088), 200, 0)
ka.attend(2, q, kc, vc, o2, start, n_head, n_kv, d, d, np.float32(0.088), 200, 0)
print(o1.view(np.uint32).sum(dtype=np.uint64), bool(np.array_equal(o1, o2)))
"""


def test_attention_kernels_agree_compiled_or_loaded_from_the_cache(tmp_path):
    """The serial and the parallel attention kernel give the same bits whether this process compiled
    them or loaded them from a cache another process wrote (with reassociation they did not: each
    compilation vectorized the score dots its own way)."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    runs = [subprocess.run([sys.executable, "-c", _ATTEND_SCRIPT], cwd=Path(__file__).resolve().parent.parent,
                           env=env, capture_output=True, text=True, timeout=600) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    (fresh_sum, fresh_equal), (loaded_sum, loaded_equal) = (r.stdout.split() for r in runs)
    assert fresh_equal == loaded_equal == "True" and fresh_sum == loaded_sum


def test_a_plain_cpu_models_final_norm_is_the_compiled_one(tiny_llama):
    """The trunk's final norm runs rms_norm_rows on a plain CPU trunk (torch's ops cost ~3x as much
    after a decode step), torch's rms_norm wherever a plan executes."""
    from hybridrt.runtime.backends import rms_norm_on_cpu
    from hybridrt.runtime.loader import load_model
    m = load_model(tiny_llama)
    fused_trunk = m.binder.config.mode.fused
    assert (m.norm is rms_norm_on_cpu) == fused_trunk
    h = torch.randn(3, m.n_embd)
    want = layer_fused.rms_norm_rows(h.numpy(), m.output_norm.numpy(), m.eps)
    assert not fused_trunk or torch.equal(m.final_norm(h), torch.from_numpy(want))


# --------------------------------------------------------------------------- Gated DeltaNet half

HK, HV, D, K_CONV = 2, 4, 128, 4         # key heads, value heads, head size, conv width
C = 2 * HK * D + HV * D                  # conv channels: q, k, v


class GDNLayer:
    """Random weights of one GDN half (tiled: value head j reads key head j % HK, qwen35; else
    j // (HV / HK) with beta and alpha packed per key head in one matrix, qwen3next); `ref` is
    its float64 forward."""

    def __init__(self, rng, qtype, integer, tiled=True):
        packed = not tiled
        dims = [(C, N_EMBD), (HV * D, N_EMBD), (2 * HV if packed else HV, N_EMBD), (HV, N_EMBD), (N_EMBD, HV * D)]
        self.ops, self.w = zip(*(_matrix(rng, qtype, r, c, integer) for r, c in dims))
        self.norm = rng.uniform(0.5, 1.5, N_EMBD).astype(np.float32)
        self.conv_w = (rng.standard_normal((C, K_CONV)) * 0.5).astype(np.float32)
        self.dt_bias = rng.uniform(-1, 1, HV).astype(np.float32)
        self.ssm_a = -rng.uniform(0.1, 2.0, HV).astype(np.float32)
        self.ssm_norm = rng.uniform(0.5, 1.5, D).astype(np.float32)
        self.tiled, self.packed = tiled, packed

    def state(self, rng):
        return ((rng.standard_normal((K_CONV - 1, C)) * 0.5).astype(np.float32),
                (rng.standard_normal((HV, D, D)) * 0.1).astype(np.float32))

    def run(self, h, conv, S, k_max=0, n_threads=1):
        """h + GDN(h), conv and S advanced in place; with k_max > 0 the batch is captured into a
        ring of that size, returned as (conv history, state snapshots)."""
        hist = np.zeros((K_CONV - 1 + k_max, C), np.float32)
        snap = np.zeros((max(k_max - 1, 0), HV, D, D), np.float32)
        out = gdn_block.gdn_block(h, n_threads, TYPES, _float_path(self.ops), self.norm, EPS,
                                  *self.ops[0], *self.ops[1], *self.ops[2], *self.ops[3], *self.ops[4],
                                  self.conv_w, self.dt_bias, self.ssm_a, self.ssm_norm, conv, S, hist, snap,
                                  k_max > 0, HK, self.tiled, self.packed)
        return out, hist, snap

    def ref(self, h, conv, S):
        """float64 forward (tests/reference/ref_qwen35.py's equations); returns (out, conv, S)."""
        wqkv, wz, wb, wa, wo = self.w
        x = _rms(h.astype(np.float64), self.norm)
        qkv, z = x @ wqkv.T, (x @ wz.T).reshape(len(h), HV, D)
        if self.packed:
            r = HV // HK
            ba = (x @ wb.T).reshape(len(h), HK, 2 * r)
            b, a = ba[..., :r].reshape(len(h), HV), ba[..., r:].reshape(len(h), HV)
        else:
            b, a = x @ wb.T, x @ wa.T
        beta = 1 / (1 + np.exp(-b))
        g = self.ssm_a * np.log1p(np.exp(a + self.dt_bias))
        key_head = np.arange(HV) % HK if self.tiled else np.arange(HV) // (HV // HK)
        conv, S = conv.astype(np.float64), S.astype(np.float64)
        y = np.empty((len(h), HV, D))
        for t in range(len(h)):
            window = np.concatenate([conv, qkv[t:t + 1]])
            conv = window[1:]
            c = np.einsum("kc,ck->c", window, self.conv_w)
            c = c / (1 + np.exp(-c))
            q, k = c[:HK * D].reshape(HK, D), c[HK * D:2 * HK * D].reshape(HK, D)
            v = c[2 * HK * D:].reshape(HV, D)
            q = q / np.sqrt((q * q).sum(-1, keepdims=True) + EPS) / math.sqrt(D)
            k = k / np.sqrt((k * k).sum(-1, keepdims=True) + EPS)
            for j in range(HV):
                Sj = S[j] * np.exp(g[t, j])
                u = beta[t, j] * (v[j] - Sj.T @ k[key_head[j]])
                S[j] = Sj + np.outer(k[key_head[j]], u)
                y[t, j] = S[j].T @ q[key_head[j]]
        y = _rms(y, self.ssm_norm) * (z / (1 + np.exp(-z)))
        return h + y.reshape(len(h), HV * D) @ wo.T, conv, S


@pytest.mark.parametrize("integer", **PATHS)
@pytest.mark.parametrize("qtype,tiled", [(T.Q4_K, True), (T.Q8_0, False)], ids=["qwen35-q4_k", "qwen3next-q8_0"])
def test_gdn_block_matches_float64(qtype, tiled, integer):
    # One fixed draw: these random layers can be ill-conditioned for the int8 paths (a head's state
    # decayed to ~0, a key vector near zero before its L2 norm), where the activations' rounding
    # gives relative errors up to 2.4 (300 unseeded draws of the Q4_K layer: median 0.015, 14 % over
    # 5e-2), while the float path stays at float32 rounding in every draw.
    rng = np.random.default_rng(0)
    layer = GDNLayer(rng, qtype, integer, tiled)
    conv, S = layer.state(rng)
    h = rng.standard_normal((3, N_EMBD)).astype(np.float32)
    ref, ref_conv, ref_S = layer.ref(h, conv, S)
    got, _, _ = layer.run(h, conv, S)
    # float path: float32 rounding through the recurrence (the state is O(1)); int8: the
    # activations' quantization, as layer_fused's FFN half (measured: see test_layer_fused)
    bound = {False: 2e-5, True: 5e-2, 2: RESIDUAL_BOUND}[integer]
    assert _rel(got, ref, h) <= bound
    assert _rel(conv, ref_conv, 0) <= bound and _rel(S, ref_S, 0) <= bound


@pytest.mark.parametrize("integer", [True, 2], ids=["int8", "int8x2"])
def test_gdn_token_state_and_ring_do_not_depend_on_the_batch_or_threads(integer):
    rng = np.random.default_rng()
    layer = GDNLayer(rng, T.Q4_K, integer)
    conv0, S0 = layer.state(rng)
    n = 8
    h = rng.standard_normal((n, N_EMBD)).astype(np.float32)
    conv1, S1 = conv0.copy(), S0.copy()
    singles, states, convs = [], [], [conv0.copy()]
    for t in range(n):
        singles.append(layer.run(h[t:t + 1], conv1, S1)[0])
        states.append(S1.copy())
        convs.append(conv1.copy())
    singles = np.concatenate(singles)
    for k, threads in ((2, 1), (4, 2), (8, 2), (8, 1)):
        convb, Sb = conv0.copy(), S0.copy()
        outs = []
        for i in range(0, n, k):
            out, hist, snap = layer.run(h[i:i + k], convb, Sb, k_max=k, n_threads=threads)
            outs.append(out)
            # the ring: S after each token but the last, and the conv inputs from the batch's start
            for t in range(k - 1):
                assert np.array_equal(snap[t], states[i + t]), (k, threads, t)
            for m in range(k + 1):
                assert np.array_equal(hist[m:m + K_CONV - 1], convs[i + m]), (k, threads, m)
        assert np.array_equal(np.concatenate(outs), singles), f"batch of {k}, {threads} threads"
        assert np.array_equal(Sb, S1) and np.array_equal(convb, conv1)

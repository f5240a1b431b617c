"""q8_0 KV cache: the block codec matches gguf-py byte for byte, attention over a q8_0 cache stays
within a bound derived from the block error, rollback and batch-size independence stay exact, and
speculative greedy decoding with a q8_0 cache equals plain greedy decoding with the same cache."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType as T

from gpu_kernels.attention import attend, q8_0_dequantize, q8_0_quantize
from hybridrt.errors import UserError
from hybridrt.decoding.generate import generate
from hybridrt.runtime.kv_cache import KVCache, KVTypes, cache_dtype, kv_cache_type
from hybridrt.decoding.sampling import SamplerConfig
from hybridrt.decoding.speculative.loop import SpecConfig
from hybridrt.decoding.speculative.sources import build_source
from tests.real_models import SMOLLM2, require
from tests.spec_helpers import ECHO_PROMPT


def _values(rng, shape):
    """Blocks of very different magnitudes, one all-zero block, and exact rounding ties."""
    x = (rng.standard_normal(shape) * rng.uniform(1e-3, 50.0, shape[:-1] + (1,))).astype(np.float32)
    x.reshape(-1, 32)[0] = 0.0
    tie = x.reshape(-1, 32)[1]
    tie[:] = np.arange(32, dtype=np.float32) - 15.5          # -15.5 .. 14.5
    tie[31] = 127.0                                            # amax 127, d = 1: x / d are exact .5 ties
    return x


def test_codec_matches_gguf_py():
    rng = np.random.default_rng(0)
    x = _values(rng, (37, 3, 64))
    want = quants.quantize(x, T.Q8_0)                          # (37, 3, 68) bytes
    got = q8_0_quantize(torch.from_numpy(x))
    assert got.shape == (37, 3, 2, 34)
    np.testing.assert_array_equal(got.reshape(want.shape).numpy(), want)
    np.testing.assert_array_equal(q8_0_dequantize(got).numpy(), quants.dequantize(want, T.Q8_0))


def test_cache_types_and_memory():
    assert cache_dtype("q8_0") == KVTypes("q8_0", "q8_0")
    assert cache_dtype("q8_0/f16") == KVTypes("q8_0", torch.float16)
    assert kv_cache_type("q8_0", "q8_0") == "q8_0" and kv_cache_type("q8_0", "f32") == "q8_0/f32"
    with pytest.raises(UserError):
        cache_dtype("q4_0")
    f32 = KVCache(2, 64, 3, 64, 64, cache_dtype("f32"), "cpu")
    q8 = KVCache(2, 64, 3, 64, 64, cache_dtype("q8_0"), "cpu")
    assert q8.nbytes * 128 == f32.nbytes * 34                  # 34 bytes per 32 values vs 4 per value
    with pytest.raises(UserError, match="multiple of 32"):
        KVCache(1, 8, 1, 48, 48, cache_dtype("q8_0"), "cpu")


@pytest.mark.parametrize("n_tok", [1, 4, 40])      # row by row (decode, verify) and the SDPA path
def test_attention_q8_within_derived_bound(n_tok):
    """Per value, q8_0 changes K and V by at most half a step plus the f16 rounding of the scale:
    |dx| <= amax / 254 + amax * 2^-11 (block amax). A score then moves by at most
    eps = scale * |q|_1 * max|dK|, each probability by a factor within exp(+-2 eps), so an output
    moves by at most (exp(2 eps) - 1) * max|V| + max|dV| (+ float32 rounding)."""
    rng = np.random.default_rng(1)
    n_ctx, n_head, n_kv, d = 96, 6, 2, 64
    scale = 1 / math.sqrt(d)
    k = torch.from_numpy(rng.standard_normal((n_ctx, n_kv, d)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((n_ctx, n_kv, d)).astype(np.float32))
    q = torch.from_numpy(rng.standard_normal((n_tok, n_head, d)).astype(np.float32))
    positions = list(range(n_ctx - n_tok, n_ctx))
    exact = KVCache(1, n_ctx, n_kv, d, d, cache_dtype("f32"), "cpu")
    q8 = KVCache(1, n_ctx, n_kv, d, d, cache_dtype("q8_0"), "cpu")
    exact.write(0, 0, k, v)
    q8.write(0, 0, k, v)
    want = attend(q, exact.k[0], exact.v[0], positions, scale)
    got = attend(q, q8.k[0], q8.v[0], positions, scale)

    def step(x):
        amax = x.reshape(-1, 32).abs().amax(dim=1)
        return float((amax / 254 + amax * 2.0 ** -11).max())
    eps = scale * float(q.abs().sum(dim=-1).max()) * step(k)
    bound = (math.exp(2 * eps) - 1) * float(v.abs().max()) + step(v) + 1e-5
    err = float((got - want).abs().max())
    assert 0 < err <= bound
    # the bound is not vacuous: the error is a small fraction of the values
    assert err < 0.05 * float(want.abs().max())


@pytest.fixture(scope="module")
def smollm2():
    from hybridrt.runtime.loader import load_model

    return load_model(require(SMOLLM2))


@pytest.mark.usefixtures("single_thread")
def test_q8_rollback_and_batch_independence(smollm2):
    """A q8_0 session rolled back and re-run gives bitwise the logits of a fresh one, and a token's
    logits are the same alone and inside a 4-token verify batch."""
    ids = smollm2.tokenize("The quick brown fox jumps over the lazy dog, and then it")
    fresh = smollm2.session(128, "q8_0")
    one_by_one = torch.cat([fresh.eval(ids[:8])[-1:]] + [fresh.eval([t]) for t in ids[8:12]])

    s = smollm2.session(128, "q8_0")
    s.eval(ids[:8])
    s.eval([1, 2, 3, 4, 5, 6])          # garbage, then rolled back
    s.truncate(8)
    batched = torch.cat([s.eval(ids[7:8], start_pos=7), s.eval(ids[8:12])])
    assert torch.equal(batched[1:], one_by_one[1:])
    s.truncate(9)
    assert torch.equal(s.eval(ids[9:12]), one_by_one[2:])


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("cache_type", ["q8_0", "q8_0/f16"])
def test_q8_speculative_greedy_parity(smollm2, cache_type):
    greedy = SamplerConfig(temp=0.0)
    ids = smollm2.tokenize(ECHO_PROMPT)
    want, _ = generate(smollm2, smollm2.session(512, cache_type), ids, 24, greedy)
    spec = SpecConfig(n_max=4)
    session = smollm2.session(512, cache_type, k_max=spec.k_max)
    source = build_source("ngram-simple", session, greedy, spec, cache_type=cache_type)
    got, stats = generate(smollm2, session, ids, 24, greedy, source, spec)
    assert got == want
    assert stats.spec.acceptance_rate > 0.5


@pytest.mark.slow
@pytest.mark.usefixtures("single_thread")
def test_q8_logits_error_smollm2(smollm2):
    """The BENCHMARKS.md figures (run with -s to print them): a 300-token greedy continuation,
    teacher-forced in 16-token batches (the row-by-row path) through an f32 and a q8_0 cache."""
    prompt = smollm2.tokenize(ECHO_PROMPT)
    cont, _ = generate(smollm2, smollm2.session(1024), prompt, 300, SamplerConfig(temp=0.0), stop_ids=set())
    ids = prompt + cont
    logits = {}
    for ct in ("f32", "q8_0"):
        s = smollm2.session(1024, ct)
        logits[ct] = torch.cat([s.eval(ids[lo:lo + 16]) for lo in range(0, len(ids), 16)])
    logp, logq = (torch.log_softmax(logits[ct].double(), dim=-1) for ct in ("f32", "q8_0"))
    kl = (logp.exp() * (logp - logq)).sum(dim=-1)
    top1 = (logits["f32"].argmax(-1) == logits["q8_0"].argmax(-1)).double().mean().item()
    mem = {ct: smollm2.session(4096, ct).state.kv.nbytes for ct in ("f32", "f16", "q8_0")}
    print(f"\nSmolLM2-135M q8_0 vs f32 KV cache over {len(ids)} positions: mean KL {kl.mean():.2e}, "
          f"max KL {kl.max():.2e}, top-1 agreement {100 * top1:.2f}%; KV at 4096 tokens: "
          + ", ".join(f"{ct} {n / 2**20:.1f} MiB" for ct, n in mem.items()))
    assert kl.mean() < 1e-2 and top1 > 0.97

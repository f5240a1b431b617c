"""The float64 references (tests/reference) against llama.cpp's teacher-forced logits.

Marker ``oracle``: needs the llama-cpp-python venv (tests/oracle_llamacpp.py skips without it).
F32 files must agree to 1e-3 (what is left is llama.cpp's F16 KV cache and float32 sums);
quantized files differ by llama.cpp's 8-bit activation quantization, hence the looser bounds.

The MTP step is not compared with llama.cpp: this build's llama_batch_ext_set_embd_state (the
only way to hand its MTP context a hidden state) is a stub returning false. The unmarked tests at
the end check the reference's MTP step for what the notes pin down without an oracle.
"""
from __future__ import annotations

import numpy as np
import pytest

import make_model
from oracle_llamacpp import llamacpp_logits
from reference import RefLlama, RefQwen35

N_POS = 160


def _compare(path, ref_cls, seed: int):
    ref = ref_cls(path)
    n_vocab = ref.W("token_embd.weight").shape[0]
    tokens = np.random.default_rng(seed).integers(0, n_vocab, N_POS).tolist()
    ours = ref.forward(tokens)
    theirs = llamacpp_logits(path, tokens).astype(np.float64)
    assert ours.shape == theirs.shape
    rel = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs - theirs.mean(1, keepdims=True))
    top1 = float(np.mean(ours.argmax(1) == theirs.argmax(1)))
    return rel, top1


@pytest.mark.oracle
@pytest.mark.parametrize("fixture,ref_cls", [("tiny_qwen35", RefQwen35),
                                             ("tiny_qwen35_mtp", RefQwen35),
                                             ("tiny_qwen3", RefLlama),
                                             ("tiny_llama", RefLlama)])
def test_f32_logits_match_llamacpp(fixture, ref_cls, request):
    rel, top1 = _compare(request.getfixturevalue(fixture), ref_cls, seed=11)
    assert rel <= 1e-3 and top1 >= 0.99, (rel, top1)


@pytest.mark.oracle
@pytest.mark.parametrize("mix,max_rel,min_top1", [("q8_0", 5e-2, 0.95), ("q4_k_m", 5e-2, 0.95)])
def test_quantized_qwen35_logits_match_llamacpp(mix, max_rel, min_top1, tmp_path):
    path = make_model.write_model(tmp_path / f"q-{mix}.gguf", "qwen35", mtp=True, mix=mix, seed=3)
    rel, top1 = _compare(path, RefQwen35, seed=12)
    assert rel <= max_rel and top1 >= min_top1, (rel, top1)


@pytest.mark.oracle
def test_reference_would_catch_a_rotary_sign_error(tiny_qwen35, monkeypatch):
    """The F32 bound is tight enough to see a real bug: flip the rotary direction."""
    from reference import common, ref_qwen35
    real_rope = common.rope
    monkeypatch.setattr(ref_qwen35, "rope", lambda x, pos, n, base, neox:
                        real_rope(x, -pos, n, base, neox))
    rel, _ = _compare(tiny_qwen35, RefQwen35, seed=11)
    assert rel > 1e-2


def test_mtp_step_chains_and_keeps_its_own_kv(tiny_qwen35_mtp):
    ref = RefQwen35(tiny_qwen35_mtp)
    tokens = np.random.default_rng(5).integers(0, ref.W("token_embd.weight").shape[0], 24)
    trunk = ref.hidden(tokens)
    logits, hidden = ref.mtp_forward(tokens, trunk)
    assert logits.shape == (23, ref.W("output.weight").shape[0]) and hidden.shape == (23, ref.n_embd)
    # the returned hidden is RMS-normalised by shared_head_norm and the logits are head(hidden)
    np.testing.assert_allclose(logits, hidden @ ref.W("output.weight").T, rtol=1e-12, atol=1e-12)
    # step by step with one cache gives the teacher-forced rows; a fresh cache (no history) does not
    cache = ref.new_mtp_cache()
    for p in range(1, 10):
        lg, h = ref.mtp_step(int(tokens[p]), trunk[p - 1], p, cache)
    np.testing.assert_allclose(lg, logits[8], rtol=1e-10, atol=1e-10)
    assert sorted(cache.kv.k) == list(range(1, 10))
    lone, _ = ref.mtp_step(int(tokens[9]), trunk[8], 9, ref.new_mtp_cache())
    assert np.abs(lone - logits[8]).max() > 1e-6
    # the trunk hidden enters: the same token with another position's hidden drafts differently
    other, _ = ref.mtp_step(int(tokens[9]), trunk[3], 9, ref.new_mtp_cache())
    assert np.abs(other - lone).max() > 1e-6


def test_files_without_mtp_refuse_the_mtp_step(tiny_qwen35):
    ref = RefQwen35(tiny_qwen35)
    with pytest.raises(ValueError):
        ref.mtp_step(1, np.zeros(ref.n_embd), 1, ref.new_mtp_cache())


@pytest.mark.oracle
@pytest.mark.parametrize("mix,max_rel,min_top1", [("f32", 1e-3, 0.99), ("q8_0", 5e-2, 0.9), ("q4_k_m", 5e-2, 0.9)])
def test_qwen35moe_logits_match_llamacpp(mix, max_rel, min_top1, tmp_path):
    """qwen35moe (issue 14): the MoE FFN (softmax router, top-k renormalised, gated shared expert)
    in every block, with an MTP block, against llama.cpp's qwen35moe loader. Quantized files are
    held to the issue's 5e-2; their top-1 bound is looser than the dense files' because llama.cpp's
    8-bit activations also flip near-tied expert choices of the random tiny router (measured 0.944
    on q4_k_m with rel 3.3e-2)."""
    path = make_model.write_model(tmp_path / f"moe-{mix}.gguf", "qwen35moe", mtp=True, mix=mix, seed=4)
    rel, top1 = _compare(path, RefQwen35, seed=13)
    print(f"\nqwen35moe {mix}: rel {rel:.3g}, top-1 {top1:.3f}")
    assert rel <= max_rel and top1 >= min_top1, (rel, top1)

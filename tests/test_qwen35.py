"""qwen35 (GDN hybrid + gated attention + MTP) against the float64 reference, and rollback."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import make_model
from hybridrt.runtime.loader import load_model
from hybridrt.runtime.snapshot_ring import SnapshotRing
from tests.reference.ref_qwen35 import RefQwen35

TOKENS = [int(t) for t in np.random.default_rng(7).integers(3, 300, 40)]


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def build(tmp_path, name, **kw):
    return make_model.write_model(tmp_path / f"{name}.gguf", "qwen35", **kw)


@pytest.mark.parametrize("case,kw", [
    ("gdn-layer", dict(dims={"n_layer": 1})),                                   # one Gated DeltaNet layer
    ("attention-layer", dict(dims={"n_layer": 1, "full_attention_interval": 1})),  # one gated attention layer
    ("whole-model", dict(mtp=True)),
    ("whole-model-q8_0", dict(mtp=True, mix="q8_0", seed=3)),
])
def test_logits_match_float64_reference(tmp_path, case, kw):
    path = build(tmp_path, case, **kw)
    model = load_model(path, exact_activations=True)   # float32 activations: the exact path
    got = model.session(128).eval(TOKENS).numpy()
    ref = RefQwen35(path).forward(TOKENS)       # same (dequantized) weights, float64 everywhere
    assert rel_err(got, ref) <= 1e-4
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.99


def test_prefill_matches_token_by_token(tiny_qwen35):
    model = load_model(tiny_qwen35)
    whole = model.session(128).eval(TOKENS)
    s = model.session(128)
    steps = torch.cat([s.eval([t]) for t in TOKENS])
    assert float((whole - steps).abs().max() / whole.abs().max()) <= 1e-4


def test_mtp_head_matches_reference(tiny_qwen35_mtp):
    model, ref = load_model(tiny_qwen35_mtp), RefQwen35(tiny_qwen35_mtp)
    s = model.session(128)
    s.eval(TOKENS, logits="none")
    trunk_hidden = s.hidden
    # teacher-forced: position p feeds TOKENS[p] with the trunk hidden of p - 1
    logits, hidden = model.mtp.step(s.state, torch.tensor(TOKENS[1:]), trunk_hidden[:-1], start_pos=1)
    ref_logits, ref_hidden = ref.mtp_forward(TOKENS)
    assert rel_err(logits.numpy(), ref_logits) <= 1e-4
    assert rel_err(hidden.numpy(), ref_hidden) <= 1e-4


def _rollback_logits(model, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify 4 tokens after a 12-token prefix, keep `keep` of them, continue with other tokens;
    and the same continuation from a session that never saw the rejected tokens."""
    prefix, verify, other = TOKENS[:12], TOKENS[12:16], [5, 6, 7]
    s = model.session(128, k_max=4)
    s.eval(prefix, logits="none")
    s.eval(verify)
    s.truncate(12 + keep)
    got = s.eval(other)
    clean = model.session(128, k_max=4)
    clean.eval(prefix + verify[:keep], logits="none")
    return got, clean.eval(other)


@pytest.mark.parametrize("keep", [1, 2, 3, 4])
def test_rollback_is_bitwise_equal_to_never_seeing_rejected_tokens(tiny_qwen35, keep):
    got, expected = _rollback_logits(load_model(tiny_qwen35), keep)
    assert torch.equal(got, expected)


def test_rollback_oracle_catches_a_noop_restore(tiny_qwen35, monkeypatch):
    monkeypatch.setattr(SnapshotRing, "restore", lambda self, n_keep, conv, S: None)
    got, expected = _rollback_logits(load_model(tiny_qwen35), keep=2)
    assert not torch.equal(got, expected)


def test_ring_is_allocated_once_for_k_max(tiny_qwen35):
    model = load_model(tiny_qwen35)
    s = model.session(64, k_max=4)
    ring = s.state.ring
    S_ptr, conv_ptr = ring.S.data_ptr(), ring.conv_hist.data_ptr()
    assert ring.S.shape[1] == 3          # N = k_max - 1 slots: the live state is the last one
    for step in range(5):
        s.eval(TOKENS[step * 4:step * 4 + 4])
        s.truncate(s.n_past - 2)
    assert (ring.S.data_ptr(), ring.conv_hist.data_ptr()) == (S_ptr, conv_ptr)


def test_rollback_outside_the_last_batch_is_a_clear_error(tiny_qwen35):
    from hybridrt.errors import UserError

    s = load_model(tiny_qwen35).session(64, k_max=4)
    s.eval(TOKENS[:10])
    s.eval(TOKENS[10:13])
    with pytest.raises(UserError, match="cannot roll the recurrent state back"):
        s.truncate(9)


def test_mtp_catch_up_writes_the_kv_a_step_writes(tiny_qwen35_mtp):
    """MTPHead.write_kv (a catch-up on committed tokens) leaves the MTP KV as step() does, bit for
    bit, without the block's attention and FFN."""
    model = load_model(tiny_qwen35_mtp)
    caches = []
    for name in ("step", "write_kv"):
        s = model.session(128)
        s.eval(TOKENS, logits="none")
        args = (s.state, torch.tensor(TOKENS[1:]), s.hidden[:-1], 1)
        model.mtp.step(*args, logits=False) if name == "step" else model.mtp.write_kv(*args)
        caches.append((s.state.mtp_kv.k[0].clone(), s.state.mtp_kv.v[0].clone()))
    assert caches[0][0][1:len(TOKENS)].abs().sum() > 0
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])

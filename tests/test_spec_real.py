"""Speculative decoding on the real models: greedy output identical to plain decoding for n-gram
lookup and draft models (itself: every draft accepted; a layer-truncated copy: most rejected), on
prompts where drafts are accepted and where they are rejected; and, at temp 0.7, exact sampling
accepting more often than "sample the target and accept on equality" on the same drafts."""
from __future__ import annotations

import pytest

from hybridrt.decoding.generate import generate
from hybridrt.runtime.loader import load_model
from hybridrt.decoding.sampling import SamplerConfig, filtered_probs
from hybridrt.decoding.speculative import acceptance
from hybridrt.decoding.speculative.loop import SpecConfig
from hybridrt.decoding.speculative.sources import build_source
from tests.real_models import GEMMA3, SMOLLM2, require
from tests.spec_helpers import ADVERSARIAL_PROMPT, ECHO_PROMPT, write_truncated_draft

GREEDY = SamplerConfig(temp=0.0)
N_GEN = 32


pytestmark = pytest.mark.usefixtures("single_thread")


class Case:
    """A model, its derived drafts and the plain greedy reference per prompt (computed once)."""

    def __init__(self, path, tmp_dir, draft_layers):
        self.model = load_model(path)
        self.truncated = load_model(write_truncated_draft(path, tmp_dir / "draft.gguf", draft_layers))
        self.refs = {}

    def prompt(self, name):
        return self.model.tokenize(ECHO_PROMPT if name == "echo" else ADVERSARIAL_PROMPT)

    def ref(self, name):
        if name not in self.refs:
            self.refs[name], _ = generate(self.model, self.model.session(512), self.prompt(name), N_GEN, GREEDY)
        return self.refs[name]

    def spec(self, name, spec_type, n_max, draft=None, sampler=GREEDY):
        spec = SpecConfig(n_max=n_max)
        session = self.model.session(512, k_max=spec.k_max)
        source = build_source(spec_type, session, sampler, spec, draft_model=draft)
        return generate(self.model, session, self.prompt(name), N_GEN, sampler, source, spec)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return Case(require(SMOLLM2), tmp_path_factory.mktemp("smol"), draft_layers=8)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return Case(require(GEMMA3), tmp_path_factory.mktemp("gemma"), draft_layers=6)


@pytest.mark.parametrize("n_max", [1, 2, 3, 4, 8])
def test_smollm2_ngram_parity(smollm2, n_max):
    out, stats = smollm2.spec("echo", "ngram-simple", n_max)
    assert out == smollm2.ref("echo")
    assert stats.spec.acceptance_rate > 0.8 and max(stats.spec.accepted) == n_max
    out, stats = smollm2.spec("adversarial", "ngram-simple", n_max)
    assert out == smollm2.ref("adversarial")
    assert sum(stats.spec.drafted) > 0 and stats.spec.acceptance_rate < 0.5


@pytest.mark.parametrize("n_max", [1, 2, 3, 4, 8])
def test_smollm2_draft_model_parity(smollm2, n_max):
    out, stats = smollm2.spec("adversarial", "draft-simple", n_max, draft=smollm2.truncated)
    assert out == smollm2.ref("adversarial")
    assert stats.spec.acceptance_rate < 1.0          # rejections happen
    out, stats = smollm2.spec("echo", "draft-simple", n_max, draft=smollm2.model)
    assert out == smollm2.ref("echo") and stats.spec.acceptance_rate == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("n_max", [1, 2, 3, 4, 8])
def test_gemma3_parity(gemma3, n_max):
    for name in ("echo", "adversarial"):
        out, _ = gemma3.spec(name, "ngram-simple", n_max)
        assert out == gemma3.ref(name)
        out, _ = gemma3.spec(name, "draft-simple", n_max, draft=gemma3.truncated)
        assert out == gemma3.ref(name)
    out, stats = gemma3.spec("echo", "draft-simple", n_max, draft=gemma3.model)
    assert out == gemma3.ref("echo") and stats.spec.acceptance_rate == 1.0


def test_sampled_acceptance_beats_sample_and_match(smollm2, monkeypatch):
    """At temp 0.7, on the very drafts the draft model sampled and the target's logits for them,
    the expected number of drafts kept per step under min(1, p/q) exceeds that of sampling the
    target and accepting on equality (which keeps draft x with probability p(x))."""
    totals = {"exact": 0.0, "match": 0.0, "kept": 0, "drafted": 0}
    real_call = acceptance.SampledAcceptor.__call__

    def measure(self, logits, draft):
        p_ids, p_probs = filtered_probs(logits[:len(draft)], self.cfg)
        run_exact = run_match = 1.0
        for i, x in enumerate(draft.tokens):
            p_x = float(p_probs[i][p_ids[i] == x].sum())
            q_x = float(draft.q_probs[i][draft.q_ids[i] == x].sum())
            run_exact *= min(1.0, p_x / q_x)
            run_match *= p_x
            totals["exact"] += run_exact       # P(draft i kept) = product over the prefix
            totals["match"] += run_match
        verdict = real_call(self, logits, draft)
        totals["kept"] += verdict.n_accepted
        totals["drafted"] += len(draft)
        return verdict

    monkeypatch.setattr(acceptance.SampledAcceptor, "__call__", measure)
    draft = load_model(write_truncated_draft(SMOLLM2, smollm2.truncated.gguf.path.replace("draft.gguf", "d16.gguf"), 16))
    for seed in (4, 5, 6):          # ~450 drafts
        sampler = SamplerConfig(temp=0.7, top_k=40, top_p=0.95, min_p=0.05, seed=seed)
        for name in ("adversarial", "echo"):
            smollm2.spec(name, "draft-simple", 3, draft=draft, sampler=sampler)
    n = totals["drafted"]
    print(f"temp 0.7, {n} sampled drafts: expected acceptance exact {totals['exact'] / n:.3f}, "
          f"sample-and-match {totals['match'] / n:.3f}; observed exact {totals['kept'] / n:.3f}")
    # min(1, p/q) >= p holds draft by draft, so the bound is about the size of the gain, which grows
    # as the draft parts from the target: with this 16-layer draft 10-31 % over seeds 4-6, 7-9 and
    # 10-12 (a 24-layer one gained 3-7 %, too close to any bound for a change of prompt or numerics)
    assert totals["exact"] > 1.05 * totals["match"]

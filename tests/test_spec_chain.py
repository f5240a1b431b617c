"""A lookup and a model source in one run (`--spec-type ngram-simple,draft-mtp`): the names a
--spec-type list may hold and the order a chain asks them in, greedy parity with plain decoding
with each source drafting some steps (fixed lengths and adaptive), and per-source figures."""
from __future__ import annotations

import numpy as np
import pytest

from hybridrt.cli.run import adaptive_default
from hybridrt.errors import UserError
from hybridrt.decoding.generate import generate
from hybridrt.decoding.sampling import SamplerConfig
from hybridrt.decoding.speculative.draft_chain import DraftChain
from hybridrt.decoding.speculative.loop import SpecConfig
from hybridrt.decoding.speculative.sources import build_source
from hybridrt.decoding.speculative.spec_types import model_spec_type, spec_type_parts
from tests.test_spec_loop import qwen3, qwen35  # noqa: F401  (the loaded tiny models, module fixtures)

pytestmark = pytest.mark.usefixtures("single_thread")

GREEDY = SamplerConfig(temp=0.0)
CHAIN = "ngram-simple,draft-mtp"


def repetitive_prompt(seed: int) -> list[int]:
    """A phrase said three times, then new tokens: the lookup has a match only part of the time."""
    rng = np.random.default_rng(seed)
    phrase = [int(t) for t in rng.integers(3, 300, 6)]
    return phrase * 3 + [int(t) for t in rng.integers(3, 300, 4)]


def run(model, ids, spec_type, n_max, n=40, sampler=GREEDY, draft_model=None, **kw):
    spec = SpecConfig(n_max=n_max, **kw)
    session = model.session(256, k_max=spec.k_max)
    source = build_source(spec_type, session, sampler, spec, draft_model)
    return generate(model, session, ids, n, sampler, source, spec, stop_ids=set()) + (source,)


def plain(model, ids, n=40):
    out, _ = generate(model, model.session(256), ids, n, GREEDY, stop_ids=set())
    return out


def test_spec_type_lists():
    assert spec_type_parts("draft-mtp") == ("draft-mtp",)
    # llama.cpp's preference: lookups first, whatever order the list is written in
    assert spec_type_parts("draft-mtp,ngram-simple") == ("ngram-simple", "draft-mtp")
    assert spec_type_parts("ngram-simple, draft-simple") == ("ngram-simple", "draft-simple")
    assert model_spec_type(CHAIN) == "draft-mtp" and model_spec_type("ngram-simple") == "ngram-simple"
    assert adaptive_default(CHAIN) and adaptive_default("draft-mtp") and not adaptive_default("ngram-simple")
    assert adaptive_default("ngram-simple", shared_steps=True)      # serve's shared steps
    for bad, msg in (("draft-mtp,draft-simple", "at most one"), ("none,draft-mtp", "not none"),
                     ("ngram-simple,ngram-simple", "once"), ("ngram-simple,eagle", "unknown --spec-type 'eagle'")):
        with pytest.raises(UserError, match=msg):
            spec_type_parts(bad)


@pytest.mark.parametrize("n_max", [1, 2, 3, 8])
def test_chain_greedy_parity_with_both_sources_drafting(qwen35, n_max):
    for seed in (0, 1):
        ids = repetitive_prompt(seed)
        out, stats, source = run(qwen35, ids, CHAIN, n_max)
        assert isinstance(source, DraftChain) and source.name == CHAIN
        assert out == plain(qwen35, ids)
        by = stats.spec.by_source
        assert by["ngram-simple"][0] > 0 and by["draft-mtp"][0] > 0, by
        # every drafting step is credited to exactly one source
        assert sum(s for s, _, _ in by.values()) == sum(1 for d in stats.spec.drafted if d)
        assert sum(d for _, d, _ in by.values()) == sum(stats.spec.drafted)
        assert sum(a for _, _, a in by.values()) == sum(stats.spec.accepted)
        assert "ngram-simple accepted" in stats.spec.summary()


def test_chain_adaptive_parity_and_the_gate_on_the_model_source(qwen35):
    ids = repetitive_prompt(2)
    out, stats, source = run(qwen35, ids, CHAIN, 3, adaptive=True)
    assert out == plain(qwen35, ids)
    mtp = source.sources[-1]
    assert mtp.picker.gate is not None      # the confidence gate weighs the model source's drafts


def test_chain_with_a_draft_model(qwen3):
    ids = repetitive_prompt(3)
    ref = plain(qwen3, ids)
    for n_max in (1, 3):
        out, stats, _ = run(qwen3, ids, "draft-simple,ngram-simple", n_max, draft_model=qwen3)
        assert out == ref
        assert stats.spec.by_source.get("ngram-simple", [0])[0] > 0
    with pytest.raises(UserError, match="draft-simple"):
        build_source(CHAIN, qwen3.session(64, k_max=2), GREEDY, SpecConfig(), draft_model=qwen3)


def test_sampled_chain_runs_both_kinds_of_draft(qwen35):
    """At temp > 0 a lookup draft is one-hot (q = delta) and a head draft carries its q: each step's
    draft comes from one source, so the acceptance rule stays the one test_spec_acceptance checks."""
    sampler = SamplerConfig(temp=0.8, top_k=40, top_p=1.0, min_p=0.0, seed=5)
    ids = repetitive_prompt(4)
    out, stats, _ = run(qwen35, ids, CHAIN, 3, n=48, sampler=sampler)
    assert len(out) == 48
    assert set(stats.spec.by_source) <= {"ngram-simple", "draft-mtp"} and stats.spec.by_source


def test_each_source_of_a_chain_has_its_own_length_policy(qwen35):
    from hybridrt.decoding.speculative.loop import length_policies

    spec = SpecConfig(n_max=3, adaptive=True)
    session = qwen35.session(64, k_max=spec.k_max)
    chain = build_source(CHAIN, session, GREEDY, spec)
    policies = length_policies(chain, spec)
    assert set(policies) == {"ngram-simple", "draft-mtp"}
    mtp = chain.sources[-1]
    assert mtp.picker.gate.__self__ is policies["draft-mtp"] and policies["draft-mtp"].gating
    assert not policies["ngram-simple"].gating
    # the drafter is the lookup exactly where it has a match
    ids = repetitive_prompt(5)[:18]             # the phrase three times
    session.eval(ids, logits="none")
    chain.observe(0, ids, session.hidden)
    assert chain.drafter(ids[0]) == "ngram-simple"          # (last phrase token, first one): seen, and followed
    unseen = next(t for t in range(3, 300) if t not in ids)
    assert chain.drafter(unseen) == "draft-mtp"
    assert length_policies(chain, SpecConfig(n_max=3)) == {}


@pytest.mark.parametrize("spec_type, compiles", [(CHAIN, True), ("draft-mtp", True), ("ngram-simple", False)])
def test_bench_compiles_the_head_before_timing(qwen35, monkeypatch, capsys, spec_type, compiles):
    """`bench --spec-type` with a head warms it up first: a trained head's kernels compiled inside the
    timed run (SmolLM2 at -r 1: 0.75x plain, 27 % of the time drafting)."""
    import json

    import hybridrt.runtime.warmup
    from hybridrt.cli.bench import _bench_spec

    calls = []
    monkeypatch.setattr(hybridrt.runtime.warmup, "compile_head", lambda m, cache_type: calls.append((m, cache_type)))
    _bench_spec(qwen35, spec_type, 2, None, None, "echo", "none", 8, 8, 1, True, 20.0, None, "f16")
    assert calls == ([(qwen35, "f16")] if compiles else [])
    result = json.loads(capsys.readouterr().out)
    assert result["identical"] and result["spec"]["source"] == (CHAIN if spec_type == CHAIN else spec_type)

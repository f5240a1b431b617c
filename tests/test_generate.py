"""Plain and speculative decoding (one loop, with and without a draft source) agree on the edges of -n."""
from __future__ import annotations

import pytest

from hybridrt.generate import generate
from hybridrt.loader import load_model
from hybridrt.sampling import SamplerConfig
from hybridrt.speculative.loop import SpecConfig
from hybridrt.speculative.sources import build_source

PROMPT = [5, 6, 7, 8, 5, 6, 7]


@pytest.mark.parametrize("n_predict", [0, 1, 5])
def test_n_predict_is_exact_with_and_without_drafts(tiny_qwen35_mtp, n_predict):
    model = load_model(tiny_qwen35_mtp)
    greedy = SamplerConfig(temp=0.0)
    plain, stats = generate(model, model.session(64), PROMPT, n_predict, greedy, stop_ids=set())
    assert len(plain) == n_predict and stats.stopped_by == "n_predict"
    session = model.session(64, k_max=4)
    spec = SpecConfig(n_max=3)
    source = build_source("draft-mtp", session, greedy, spec)
    tokens, _ = generate(model, session, PROMPT, n_predict, greedy, source, spec, stop_ids=set())
    assert tokens == plain

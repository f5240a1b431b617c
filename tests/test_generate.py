"""Plain and speculative decoding (one loop, with and without a draft source) agree on the edges of -n."""
from __future__ import annotations

import pytest

from hybridrt.decoding.generate import generate
from hybridrt.runtime.loader import load_model
from hybridrt.decoding.sampling import SamplerConfig
from hybridrt.decoding.speculative.loop import SpecConfig
from hybridrt.decoding.speculative.sources import build_source

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


def test_the_python_api_decodes_plainly_and_speculatively(tiny_qwen3):
    """The Python API used as `hybridrt`'s docstring shows it: the same greedy tokens with drafts
    as without; importing the package alone loads no torch."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", "import sys, hybridrt; assert 'torch' not in sys.modules"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    from hybridrt import SamplerConfig, SpecConfig, build_source, load_model
    from hybridrt.decoding.generate import generate

    m = load_model(tiny_qwen3)
    ids = PROMPT * 3
    greedy = SamplerConfig(temp=0.0)
    plain, _ = generate(m, m.session(128), ids, 24, greedy, stop_ids=set())
    spec = SpecConfig(n_max=3)
    s = m.session(128, k_max=spec.k_max)
    tokens, stats = generate(m, s, ids, 24, greedy, build_source("ngram-simple", s, greedy, spec), spec, stop_ids=set())
    assert tokens == plain and len(plain) == 24 and stats.spec.steps > 0

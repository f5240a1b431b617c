"""The two real models end to end: greedy continuations, bit-stable batching, truncation."""
from __future__ import annotations

import pytest
import torch

from hybridrt.decoding.generate import generate
from hybridrt.runtime.loader import load_model
from hybridrt.decoding.sampling import SamplerConfig
from tests.real_models import GEMMA3, SMOLLM2, require


@pytest.fixture(scope="module")
def smollm2():
    return load_model(require(SMOLLM2))


@pytest.fixture(scope="module")
def gemma3():
    return load_model(require(GEMMA3))


def greedy(model, text: str, n: int) -> str:
    ids = model.tokenize(text)
    out, _ = generate(model, model.session(256), ids, n, SamplerConfig(temp=0.0))
    return model.detokenize(out)


def test_smollm2_knows_paris(smollm2):
    assert " Paris" in greedy(smollm2, "The capital of France is", 8)


def test_gemma3_greedy_continuation(gemma3):
    assert greedy(gemma3, "The capital of France is", 8).startswith(" the capital of the country of France")


@pytest.mark.parametrize("name", ["smollm2", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_verify_batch_is_bitwise_equal_to_single_steps(name, request):
    """Greedy speculative parity rests on this: a token's logits do not depend on how many tokens
    share its forward."""
    model = request.getfixturevalue(name)
    prompt = model.tokenize("Speculative decoding checks several drafted tokens in one pass, so")
    follow = model.tokenize(" the logits of each token must not depend on the batch", add_special=False)
    one = model.session(128)
    one.eval(prompt, logits="none")
    singles = torch.cat([one.eval([t], logits="all") for t in follow])
    for k in (2, 3, 5, len(follow)):
        batched = model.session(128)
        batched.eval(prompt, logits="none")
        rows = torch.cat([batched.eval(follow[i:i + k]) for i in range(0, len(follow), k)])
        assert torch.equal(rows, singles), f"batch of {k} differs"


def test_truncate_forgets_rejected_tokens(smollm2):
    ids = smollm2.tokenize("One two three four five six")
    ref = smollm2.session(64)
    expected = ref.eval(ids[:4] + [ids[5]])[-1]
    s = smollm2.session(64)
    s.eval(ids)              # sees ids[4] and ids[5] at positions 4, 5
    s.truncate(4)
    got = s.eval([ids[5]])[-1]
    assert torch.equal(got, expected)

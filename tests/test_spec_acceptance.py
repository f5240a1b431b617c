"""The acceptance rule on synthetic target/draft distributions: greedy prefix matching, exactness of
speculative sampling (the emitted tokens are distributed as plain sampling from p), the analytic
acceptance probabilities, and the advantage over "sample the target and accept on equality"."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridrt.decoding.sampling import SamplerConfig, argmax_rows, dense_probs, filtered_probs
from hybridrt.decoding.speculative.acceptance import SampledAcceptor, Verdict, accept_greedy, sample_and_match
from hybridrt.decoding.speculative.draft import Draft

V = 8
CFG = SamplerConfig(temp=0.7, top_k=6, top_p=0.97, min_p=0.02)
TRIALS = 12000


def tv(counts: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - p).sum())


def tv_bound(p: np.ndarray, n: int) -> float:
    """About 5 standard deviations of the empirical TV distance of n draws from p."""
    return 5 * 0.5 * float(np.sqrt(p * (1 - p) / n).sum()) + 1e-3


@pytest.fixture
def rows():
    g = torch.Generator().manual_seed(11)
    target = torch.randn(3, V, generator=g) * 1.5       # rows verify d1, d2, then the bonus row
    draft = target[:2] + torch.randn(2, V, generator=g)  # a related but different draft model
    return target, draft


def test_argmax_rows_is_torch_argmax():
    """numpy's argmax stands in for torch's on CPU rows: the same index for random rows, ties
    (the first), a NaN (the first NaN), strided views, one row or many, and other dtypes."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 262144, generator=g)
    x[1, 7] = x[1, 9] = x[1].max() + 1.0                    # a tie: the first
    x[2, 100] = float("nan")
    x[2, 50] = float("nan")
    x[3] = 0.0                                               # all equal: index 0
    x[4, -1] = float("inf")
    for rows in (x, x[:, ::3], x[1], x[2:3], x.to(torch.bfloat16), x.double()):
        want = torch.argmax(rows, dim=-1).reshape(-1).tolist()
        assert argmax_rows(rows) == want


def test_greedy_keeps_the_matching_prefix():
    logits = torch.full((4, V), -1.0)
    for i, t in enumerate([3, 5, 1, 7]):
        logits[i, t] = 2.0
    assert accept_greedy(logits, [3, 5, 1]) == Verdict(3, 7)
    assert accept_greedy(logits, [3, 4, 1]) == Verdict(1, 5)
    assert accept_greedy(logits, [0, 5, 1]) == Verdict(0, 3)
    assert accept_greedy(logits[:1], []) == Verdict(0, 3)


def _draw_draft(q_logits: torch.Tensor | None, fixed: list[int], gen: torch.Generator) -> Draft:
    if q_logits is None:
        return Draft(list(fixed))
    ids, probs = filtered_probs(q_logits, CFG)
    tokens = [int(ids[i][torch.multinomial(probs[i], 1, generator=gen)]) for i in range(ids.shape[0])]
    return Draft(tokens, list(ids), list(probs))


def _emitted(verdict: Verdict, draft: Draft) -> list[int]:
    return draft.tokens[:verdict.n_accepted] + [verdict.next_token]


def _run(acceptor, target, q_logits, fixed, seed=0):
    gen = torch.Generator().manual_seed(seed + 1000)
    first, second, n_acc = np.zeros(V), np.zeros(V), 0
    for _ in range(TRIALS):
        draft = _draw_draft(q_logits, fixed, gen)
        verdict = acceptor(target, draft)
        out = _emitted(verdict, draft)
        first[out[0]] += 1
        if verdict.n_accepted >= 1:
            second[out[1]] += 1     # row 1 is fixed here, so given d1 kept, token 2 ~ p[1]
        n_acc += verdict.n_accepted >= 1
    return first, second, n_acc / TRIALS


@pytest.mark.parametrize("kind", ["sampled-q", "one-hot"])
def test_sampled_acceptance_reproduces_the_target_distribution(rows, kind):
    target, draft_logits = rows
    p = dense_probs(target, CFG).numpy().astype(np.float64)
    acceptor = SampledAcceptor(V, CFG, torch.Generator().manual_seed(5))
    fixed = [int(torch.argmax(draft_logits[0])), int(torch.argmax(draft_logits[1]))]
    q_logits = draft_logits if kind == "sampled-q" else None
    first, second, rate = _run(acceptor, target, q_logits, fixed)
    assert tv(first, p[0]) <= tv_bound(p[0], TRIALS)
    assert tv(second, p[1]) <= tv_bound(p[1], int(second.sum()))
    # analytic first-draft acceptance: sum(min(p, q)) for sampled drafts, p(x) for one-hot ones
    if kind == "sampled-q":
        q = dense_probs(draft_logits, CFG).numpy().astype(np.float64)
        expected = float(np.minimum(p[0], q[0]).sum())
    else:
        expected = float(p[0][fixed[0]])
    assert abs(rate - expected) <= 5 * np.sqrt(expected * (1 - expected) / TRIALS) + 1e-3


def test_a_biased_rule_is_caught(rows):
    """Negative control for the TV check: resampling rejections from p instead of the residual
    norm(max(0, p - q)) over-produces the draft's favourite tokens and must fail the bound."""
    target, draft_logits = rows
    p = dense_probs(target, CFG).numpy().astype(np.float64)

    class ResampleFromP(SampledAcceptor):
        def _sample_residual(self, p_ids, p_probs, draft, i, x):
            return self._sample(p_ids, p_probs)

    first, _, _ = _run(ResampleFromP(V, CFG, torch.Generator().manual_seed(5)), target, draft_logits, [0, 0])
    assert tv(first, p[0]) > tv_bound(p[0], TRIALS)


def test_residual_is_the_normalised_positive_part(rows):
    target, draft_logits = rows
    p = dense_probs(target[:1], CFG)[0].numpy().astype(np.float64)
    q_ids, q_probs = filtered_probs(draft_logits[:1], CFG)
    q = dense_probs(draft_logits[:1], CFG)[0].numpy().astype(np.float64)
    residual = np.maximum(p - q, 0)
    residual /= residual.sum()
    acceptor = SampledAcceptor(V, CFG, torch.Generator().manual_seed(3))
    p_ids, p_probs = filtered_probs(target[:1], CFG)
    draft = Draft([int(q_ids[0, 0])], list(q_ids), list(q_probs))
    counts = np.zeros(V)
    for _ in range(TRIALS):
        counts[acceptor._sample_residual(p_ids[0], p_probs[0], draft, 0, draft.tokens[0])] += 1
    assert tv(counts, residual) <= tv_bound(residual, TRIALS)
    assert counts[residual == 0].sum() == 0


def test_acceptance_beats_sample_and_match_on_the_same_drafts(rows):
    """min(1, p/q) keeps a sampled draft with probability sum(min(p, q)); sampling the target and
    comparing keeps it with sum(p q), which is never larger."""
    target, draft_logits = rows
    gen = torch.Generator().manual_seed(9)
    acceptor = SampledAcceptor(V, CFG, torch.Generator().manual_seed(1))
    ours = theirs = 0
    for _ in range(1500):
        draft = _draw_draft(draft_logits, [], gen)
        ours += acceptor(target, draft).n_accepted
        theirs += sample_and_match(target, draft, CFG, gen).n_accepted
    p = dense_probs(target, CFG).numpy()
    q = dense_probs(draft_logits, CFG).numpy()
    assert np.minimum(p[0], q[0]).sum() > (p[0] * q[0]).sum()
    assert ours > 1.1 * theirs

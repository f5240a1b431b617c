"""Adaptive draft length: the policy's choice from acceptance and verify cost, and greedy parity with
plain decoding when the length changes every step."""
from __future__ import annotations

import pytest

from hybridrt.speculative.adaptive import DraftLengthPolicy
from hybridrt.speculative.draft_forced import ForcedSource
from hybridrt.speculative.sources import build_source
from tests.test_spec_loop import GREEDY, N_GEN, plain, prompt, qwen3, qwen35, spec_run  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("single_thread")


def feed(policy: DraftLengthPolicy, steps: int, accept, verify_s, draft_s: float = 0.001) -> list[int]:
    """Run the policy against a simulated source: accept(n) -> kept drafts, verify_s(k) -> seconds."""
    chosen = []
    for _ in range(steps):
        n = policy.choose()
        chosen.append(n)
        policy.observe(n, accept(n), verify_s(n + 1), draft_s * n)
    return chosen


def test_drafts_that_are_always_rejected_turn_drafting_off_with_probes():
    p = DraftLengthPolicy(n_max=4, probe_every=8)
    chosen = feed(p, 80, accept=lambda n: 0, verify_s=lambda k: 0.010 + 0.002 * (k - 1))
    assert p.acceptance < 0.2          # the prior (two trials at 0.6) against ~10 weighted failures
    tail = chosen[20:]
    assert tail.count(0) >= 0.8 * len(tail)            # plain steps, mostly
    assert 1 in tail and max(tail) == 1                 # a single-draft probe now and then, never more


def test_drafts_that_are_always_accepted_with_cheap_verify_use_n_max():
    p = DraftLengthPolicy(n_max=6)
    chosen = feed(p, 30, accept=lambda n: n, verify_s=lambda k: 0.010 + 0.0005 * (k - 1))
    assert chosen[-16:].count(6) >= 14 and min(chosen[-16:]) >= 5 and p.acceptance > 0.9   # + neighbour probes


def test_expensive_verify_shortens_the_window():
    """At acceptance 0.5, a verify whose cost doubles per extra token makes one draft the best."""
    cheap, costly = DraftLengthPolicy(n_max=5), DraftLengthPolicy(n_max=5)
    half = lambda n: min(n, 1) if n else 0                  # noqa: E731  (accept ~ half the judged drafts)
    feed(cheap, 40, accept=half, verify_s=lambda k: 0.010 + 0.0002 * (k - 1))
    feed(costly, 40, accept=half, verify_s=lambda k: 0.010 * k)
    assert cheap.choose() > costly.choose() >= 0
    assert costly.expected_rate(costly.choose()) >= max(costly.expected_rate(n) for n in range(6)) - 1e-12


def test_verify_cost_interpolates_and_extrapolates():
    p = DraftLengthPolicy(n_max=8)
    p.observe(0, 0, 0.010, 0.0)       # k = 1
    p.observe(3, 1, 0.016, 0.003)     # k = 4
    assert p.verify_cost(1) == 0.010 and p.verify_cost(4) == 0.016
    assert p.verify_cost(2) == pytest.approx(0.012) and p.verify_cost(7) == pytest.approx(0.022)


@pytest.mark.parametrize("corrupt", [0.0, 0.5, 1.0])
def test_adaptive_length_keeps_greedy_parity(qwen3, corrupt):
    """Forced drafts (the target's own continuation, a share of them corrupted): whatever length the
    policy picks each step, the output is plain decoding's."""
    ids = prompt(3)
    ref = plain(qwen3, ids)

    def source_of(session, spec):
        return ForcedSource(None, ref, len(ids), qwen3.n_vocab, corrupt=corrupt, seed=1)

    out, stats, _, _ = spec_run(qwen3, ids, source_of, n_max=5, adaptive=True)
    assert out == ref
    assert sum(stats.spec.chosen_histogram) == stats.spec.steps
    assert all(d <= c for d, c in zip(stats.spec.drafted, stats.spec.chosen))
    if corrupt == 1.0:                  # nothing is ever accepted: the policy stops asking for 5
        assert stats.spec.chosen[-1] < 5


@pytest.mark.parametrize("gate", [True, False])
def test_adaptive_mtp_parity(qwen35, gate):
    ids = prompt(5)
    ref = plain(qwen35, ids)
    out, stats, _, source = spec_run(qwen35, ids, lambda s, spec: build_source("draft-mtp", s, GREEDY, spec, None),
                                     n_max=3, adaptive=True, gate=gate)
    assert out == ref and len(out) == N_GEN
    assert (source.picker.gate is not None) == gate


def test_confidence_table_learns_acceptance_per_tenth():
    p = DraftLengthPolicy(n_max=3, gating=True)
    assert p.accept_given(0.95) == pytest.approx(0.95) and p.accept_given(0.15) == pytest.approx(0.15)   # prior
    for _ in range(60):     # confident drafts right 20 % of the time, unsure ones 90 %: the table follows
        p.observe(1, 0, 0.012, 0.001, conf=[0.95])
        p.observe(1, 1, 0.012, 0.001, conf=[0.15])
        p.observe(2, 1, 0.013, 0.002, conf=[0.15, 0.95])     # the second was judged: rejected
    assert p.accept_given(0.93) < 0.3 and p.accept_given(0.12) > 0.75
    assert p.accept_given(0.55) == pytest.approx(0.55)       # untouched tenth: still the prior


def test_gate_keeps_only_drafts_that_pay_for_their_verify():
    """Verify of 2 tokens costs 1.36x one (SmolLM2 on this CPU): a draft needs ~40 % to pay."""
    p = DraftLengthPolicy(n_max=3, gating=True)
    p.observe(0, 0, 0.010, 0.0)
    p.observe(1, 1, 0.0136, 0.0005, conf=[0.85])
    p.observe(2, 1, 0.0190, 0.0010, conf=[0.85, 0.25])
    assert p.keep_draft(0, 0.92) and not p.keep_draft(0, 0.2)
    assert p.keep_draft(0, 0.95) and p.keep_draft(1, 0.95)     # a confident chain goes on
    assert p.keep_draft(0, 0.65) and not p.keep_draft(1, 0.45)  # cumulative 0.65 * 0.45 does not pay


def test_gated_drafting_that_does_not_pay_turns_into_plain_steps():
    """Every gated step pays a head row and keeps nothing: plain steps win, with probes."""
    p = DraftLengthPolicy(n_max=3, gating=True, probe_every=8)
    chosen = []
    for _ in range(80):
        n = p.choose()
        chosen.append(n)
        if n:
            p.observe(0, 0, 0.010, 0.002, gated=True)     # the gate refused the first row
        else:
            p.observe(0, 0, 0.010, 0.0)
    assert chosen[0] >= 1 and chosen[20:].count(0) >= 0.8 * len(chosen[20:]) and 1 in chosen[20:]


def test_one_bad_first_gated_step_does_not_outweigh_the_probes():
    """Gemma 3 on a prompt its head predicts (64 % accepted, 1.28x plain at N = 1): the first
    gated step was refused (1 token for a verify and two head rows), then every probe accepted its
    draft. The first probe that pays must bring drafting back, not move a decayed mean 10 %."""
    p = DraftLengthPolicy(n_max=3, gating=True, probe_every=16)
    assert p.choose() >= 1
    p.observe(1, 0, 0.0143, 0.0018, conf=[0.6], gated=True)
    chosen = []
    for _ in range(40):
        n = p.choose()
        chosen.append(n)
        if n:
            p.observe(1, 1, 0.0139, 0.0010, conf=[0.7])        # 2 tokens in 14.9 ms
        else:
            p.observe(0, 0, 0.0123, 0.0)                        # 1 token in 12.3 ms
    first_probe = chosen.index(1)
    assert first_probe <= 17 and chosen[first_probe + 1:].count(0) <= 3


def test_plain_step_cost_is_measured_not_extrapolated():
    """After the first drafting step the policy takes one plain step to measure t(1): with t(4) =
    2x t(1) and 20 % acceptance, drafting does not pay, and without that measurement the
    extrapolated t(1) (0.93 t(4)) made it look as if it did."""
    p = DraftLengthPolicy(n_max=3)
    chosen = feed(p, 40, accept=lambda n: 1 if n and p.drafting_steps % 5 == 0 else 0,
                  verify_s=lambda k: 0.020 if k == 1 else 0.034 + 0.004 * (k - 2))
    assert chosen[0] == 3 and chosen[1] == 0
    assert chosen[10:].count(0) >= 0.8 * len(chosen[10:])

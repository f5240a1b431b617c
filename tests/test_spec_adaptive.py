"""Adaptive draft length: the policy's choice from acceptance and verify cost, and greedy parity with
plain decoding when the length changes every step."""
from __future__ import annotations

import pytest

from hybridrt.decoding.generate import generate
from hybridrt.decoding.sampling import SamplerConfig
from hybridrt.decoding.speculative.adaptive import DraftLengthPolicy
from hybridrt.decoding.speculative.draft_forced import ForcedSource
from hybridrt.decoding.speculative.loop import SpecConfig
from hybridrt.decoding.speculative.sources import build_source
from tests.test_spec_loop import GREEDY, N_GEN, plain, prompt, qwen3, qwen35, spec_run  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("single_thread")
SAMPLED = SamplerConfig(temp=0.7, seed=5)


def Policy(**kw) -> DraftLengthPolicy:
    """A policy that keeps every timing it is shown (these sources are simulated: no first call
    loads a kernel)."""
    return DraftLengthPolicy(skip_first_timings=False, **kw)


def feed(policy: DraftLengthPolicy, steps: int, accept, verify_s, draft_s: float = 0.001) -> list[int]:
    """Run the policy against a simulated source: accept(n) -> kept drafts, verify_s(k) -> seconds."""
    chosen = []
    for _ in range(steps):
        n = policy.choose()
        chosen.append(n)
        policy.observe(n, accept(n), verify_s(n + 1), draft_s * n)
    return chosen


def test_drafts_that_are_always_rejected_turn_drafting_off_with_probes():
    p = Policy(n_max=4, probe_every=8)
    chosen = feed(p, 80, accept=lambda n: 0, verify_s=lambda k: 0.010 + 0.002 * (k - 1))
    assert p.acceptance < 0.2          # the prior (two trials at 0.6) against ~10 weighted failures
    tail = chosen[20:]
    assert tail.count(0) >= 0.8 * len(tail)            # plain steps, mostly
    assert 1 in tail and max(tail) == 1                 # a single-draft probe now and then, never more


def test_probes_back_off_while_plain_steps_keep_winning_and_reset_when_drafting_does():
    p = Policy(n_max=2, probe_every=4)
    chosen = feed(p, 120, accept=lambda n: 0, verify_s=lambda k: 0.010 + 0.004 * (k - 1))
    probes = [i for i, n in enumerate(chosen) if n and i > 3]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:2] == [8, 16] and set(gaps[2:]) == {16}
    again = feed(p, 80, accept=lambda n: n, verify_s=lambda k: 0.010 + 0.001 * (k - 1))
    assert again[-10:].count(0) <= 1 and p.probe_gap == 4


def test_drafts_that_are_always_accepted_with_cheap_verify_use_n_max():
    p = Policy(n_max=6)
    chosen = feed(p, 30, accept=lambda n: n, verify_s=lambda k: 0.010 + 0.0005 * (k - 1))
    assert chosen[-16:].count(6) >= 14 and min(chosen[-16:]) >= 5 and p.acceptance > 0.9   # + neighbour probes


def test_expensive_verify_shortens_the_window():
    """At acceptance 0.5, a verify whose cost doubles per extra token makes one draft the best."""
    cheap, costly = Policy(n_max=5), Policy(n_max=5)
    half = lambda n: min(n, 1) if n else 0                  # noqa: E731  (accept ~ half the judged drafts)
    feed(cheap, 40, accept=half, verify_s=lambda k: 0.010 + 0.0002 * (k - 1))
    feed(costly, 40, accept=half, verify_s=lambda k: 0.010 * k)
    assert cheap.choose() > costly.choose() >= 0
    assert costly.expected_rate(costly.choose()) >= max(costly.expected_rate(n) for n in range(6)) - 1e-12


def test_verify_cost_interpolates_and_extrapolates():
    p = Policy(n_max=8)
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
    p = Policy(n_max=3, gating=True)
    assert p.accept_given(0.95) == pytest.approx(0.95) and p.accept_given(0.15) == pytest.approx(0.15)   # prior
    for _ in range(60):     # confident drafts right 20 % of the time, unsure ones 90 %: the table follows
        p.observe(1, 0, 0.012, 0.001, conf=[0.95])
        p.observe(1, 1, 0.012, 0.001, conf=[0.15])
        p.observe(2, 1, 0.013, 0.002, conf=[0.15, 0.95])     # the second was judged: rejected
    assert p.accept_given(0.93) < 0.3 and p.accept_given(0.12) > 0.75
    # an untouched tenth: the prior, scaled by the head's calibration (here 2 hits per 2.2 of top-1 mass)
    scale = (p.judged_hits + 1) / (p.judged_top1 + 1)
    assert 0.85 < scale < 0.95 and p.accept_given(0.55) == pytest.approx(0.55 * scale)


def test_gate_keeps_only_drafts_that_pay_for_their_verify():
    """Verify of 2 tokens costs 1.36x one (SmolLM2 on this CPU): a draft needs ~40 % to pay."""
    p = Policy(n_max=3, gating=True)
    p.observe(0, 0, 0.010, 0.0)
    p.observe(1, 1, 0.0136, 0.0005, conf=[0.85])
    p.observe(2, 1, 0.0190, 0.0010, conf=[0.85, 0.25])
    assert p.keep_draft(0, 0.92) and not p.keep_draft(0, 0.2)
    assert p.keep_draft(0, 0.95) and p.keep_draft(1, 0.95)     # a confident chain goes on
    assert p.keep_draft(0, 0.65) and not p.keep_draft(1, 0.45)  # cumulative 0.65 * 0.45 does not pay


def gated_step(p: DraftLengthPolicy, top1: float, right: bool, verify_s=(0.0123, 0.0139), draft_s=0.0010):
    """One gated drafting step of one draft as the loop runs it: the gate weighs the head's first row;
    a kept draft is judged by the verify, a refused one against the verify's last row."""
    if p.keep_draft(0, top1):
        p.observe(1, int(right), verify_s[1], draft_s, conf=[top1])
    else:
        p.observe(0, 0, verify_s[0], draft_s, gated=True, refused=(top1, float(right)))


def run_gated(p: DraftLengthPolicy, rows, steps: int, verify_s=(0.0123, 0.0139)) -> list[int]:
    chosen = []
    for _ in range(steps):
        n = p.choose()
        chosen.append(n)
        if n:
            gated_step(p, *next(rows), verify_s=verify_s)
        else:
            p.observe(0, 0, verify_s[0], 0.0)
    return chosen


def test_gated_drafting_that_does_not_pay_turns_into_plain_steps():
    """A head sure of itself (top-1 0.5-0.9) and always wrong: the table learns it, and plain steps
    win, with probes."""
    p = Policy(n_max=3, gating=True, probe_every=8)
    rows = iter([(0.5 + 0.1 * (i % 5), False) for i in range(200)])
    chosen = run_gated(p, rows, 80)
    assert chosen[0] >= 1 and chosen[20:].count(0) >= 0.8 * len(chosen[20:]) and 1 in chosen[20:]
    assert p.accept_given(0.75) < 0.3


def test_gated_steps_that_lose_less_than_a_head_row_keep_drafting():
    """Drafts at the break-even (top-1 0.25, right 20 %: a 2-token verify plus a row costs 1.21
    plain steps) lose ~0.01 token a step: drafting goes on, as a plain stretch would last until a
    probe; the same head right 0 % of the time loses more than a row's worth and goes plain."""
    for right, drafting in ((lambda i: i % 5 == 0, True), (lambda i: False, False)):
        p = Policy(n_max=1, gating=True)
        p.observe(0, 0, 0.0123, 0.0)
        rows = iter([(0.25, right(i)) for i in range(400)])
        chosen = run_gated(p, rows, 60)
        assert (chosen[20:].count(0) <= 2) if drafting else (chosen[20:].count(0) >= 30), chosen


def test_gated_gain_is_the_mean_over_rows_of_what_the_gate_would_do():
    """gated_gain reads each row's gain from a per-tenth table: the same as asking _pays row by row."""
    import random
    rng = random.Random()
    for _ in range(20):
        p = Policy(n_max=2, gating=True)
        p.observe(0, 0, rng.uniform(0.004, 0.006), 0.0)
        p.observe(1, rng.randint(0, 1), rng.uniform(0.004, 0.007), rng.uniform(0.0002, 0.001), conf=[rng.random()])
        for _ in range(rng.randint(1, 60)):
            top1 = rng.random()
            p.keep_draft(0, top1)
            p.observe(1, int(rng.random() < top1), 0.005, 0.0005, conf=[top1])
        d, v1, v2 = p._draft_cost(), p.verify_cost(1), p.verify_cost(2)
        want = weight = 0.0
        for age, top1 in enumerate(reversed(p.first_top1)):
            a = p.accept_given(top1)
            want += 0.9 ** age * (1 + a - (v2 + d) / v1 if p._pays(0, a, 1.0) else -d / v1)
            weight += 0.9 ** age
        assert p.gated_gain() == pytest.approx(want / weight, rel=1e-9, abs=1e-12)


def test_first_row_sums_follow_the_recent_rows():
    """gated_gain and the chain prior read per-tenth sums kept as rows come and go: after any
    number of rows (the oldest leaving at 32) they equal the sums over the rows still held."""
    import random
    from hybridrt.decoding.speculative.adaptive import tenth
    rng = random.Random()
    p = Policy(n_max=2, gating=True)
    for n in range(1, 120):
        p.keep_draft(0, rng.random() ** 0.5)
        rows = list(reversed(p.first_top1))
        want_w, want_c = [0.0] * 10, [0] * 10
        for age, top1 in enumerate(rows):
            want_w[tenth(top1)] += 0.9 ** age
            want_c[tenth(top1)] += 1
        assert len(rows) == min(n, 32) and p.first_counts == want_c
        assert p.first_weights == pytest.approx(want_w, rel=1e-9, abs=1e-12)


def test_a_gated_drafts_token_and_confidence_are_its_rows_argmax_and_softmax():
    """The picker's numpy shortcut for a CPU float32 row gives the first argmax (as argmax_rows,
    so a gated draft proposes what an ungated one would) and the softmax probability of it."""
    import torch
    from hybridrt.decoding.speculative.draft import argmax_top1
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        for _ in range(20):
            row = (3 * torch.randn(4096, generator=g)).to(dtype)
            row[17] = row[4000] = row.max() + 1         # a tie: the first index wins
            best, top1 = argmax_top1(row)
            want = torch.softmax(row.double(), dim=-1)
            assert best == 17 and top1 == pytest.approx(float(want[17]), rel=1e-5)


def test_refused_drafts_teach_the_gate():
    """Drafts at top-1 0.1-0.2 that the target accepts 60 % of the time: the prior (15 %) refuses
    them, and only judging the refused ones shows the gate they pay."""
    p = Policy(n_max=1, gating=True)
    p.observe(0, 0, 0.0123, 0.0)
    p.observe(1, 1, 0.0160, 0.0010, conf=[0.95])       # a 2-token verify costs 1.3x: p > 0.28 pays
    assert not p.keep_draft(0, 0.12)
    rows = iter([(0.12, i % 5 < 3) for i in range(400)])
    run_gated(p, rows, 60, verify_s=(0.0123, 0.0160))
    assert p.accept_given(0.12) > 0.45 and p.keep_draft(0, 0.12)


def test_a_few_refused_first_rows_do_not_stop_a_good_head():
    """Gemma 3's head on a prompt it predicts (64 % accepted, 1.28x plain at N = 1): its first two
    rows were unsure and wrong, the rest mostly sure. Drafting must go on (the rate-based
    choice went plain for the next 32 steps)."""
    p = Policy(n_max=3, gating=True, probe_every=16)
    p.observe(0, 0, 0.0123, 0.0)
    rows = iter([(0.07, False), (0.08, False)] + [(0.7 + 0.02 * (i % 10), i % 3 != 0) for i in range(100)])
    chosen = run_gated(p, rows, 40)
    assert chosen.count(0) <= 3


def test_plain_step_cost_is_measured_not_extrapolated():
    """After the first drafting step the policy takes one plain step to measure t(1): with t(4) =
    2x t(1) and 20 % acceptance, drafting does not pay, and without that measurement the
    extrapolated t(1) (0.93 t(4)) made it look as if it did."""
    p = Policy(n_max=3)
    chosen = feed(p, 40, accept=lambda n: 1 if n and p.drafting_steps % 5 == 0 else 0,
                  verify_s=lambda k: 0.020 if k == 1 else 0.034 + 0.004 * (k - 2))
    assert chosen[0] == 3 and chosen[1] == 0
    assert chosen[10:].count(0) >= 0.8 * len(chosen[10:])


@pytest.mark.parametrize("self_draft", [True, False])
def test_refused_drafts_are_judged_against_the_right_row(qwen3, tiny_qwen3, tmp_path, monkeypatch, self_draft):
    """The gate refuses every first draft: each step verifies one token, and its last row judges the
    refused draft, which must come out exactly as (refused token == plain decoding's next token)."""
    from hybridrt.runtime.loader import load_model
    from scripts import make_model
    from tests.test_spec_loop import prompt as make_prompt
    draft_model = qwen3 if self_draft else load_model(make_model.write_model(tmp_path / "d.gguf", "qwen3", seed=1))
    judged, drafts = [], []
    monkeypatch.setattr(DraftLengthPolicy, "choose", lambda self: 1)
    monkeypatch.setattr(DraftLengthPolicy, "keep_draft", lambda self, i, top1: False)
    real_observe = DraftLengthPolicy.observe
    monkeypatch.setattr(DraftLengthPolicy, "observe",
                        lambda self, *a, **kw: judged.append(a[6]) or real_observe(self, *a, **kw))
    ids = make_prompt(11)
    ref = plain(qwen3, ids)

    def source_of(session, spec):
        src = build_source("draft-simple", session, GREEDY, spec, draft_model=draft_model)
        propose = src.propose
        src.propose = lambda *a: drafts.append(propose(*a)) or drafts[-1]
        return src

    out, stats, _, _ = spec_run(qwen3, ids, source_of, n_max=3, adaptive=True)
    assert out == ref
    rows = [(j, d) for j, d in enumerate(drafts) if d.refused is not None]
    assert len(rows) == len(drafts) == len(out) - 1 and all(len(d) == 0 for _, d in rows)
    expect = [float(int(d.refused.ids[0]) == ref[j + 1]) for j, d in rows]
    got = [judged[j][1] for j, _ in rows]
    assert got == expect
    assert (min(expect) == 1.0) if self_draft else (sum(expect) < len(expect))


def test_acceptance_chance_is_the_overlap_of_p_and_q():
    import torch
    from hybridrt.decoding.sampling import filtered_probs, make_generator
    from hybridrt.decoding.speculative.acceptance import SampledAcceptor
    from hybridrt.decoding.speculative.draft import Draft
    cfg = SamplerConfig(temp=0.8, top_k=40)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 300, generator=g) * 3
    q_ids, q_probs = filtered_probs(logits[1:] + torch.randn(1, 300, generator=g), cfg)   # near p
    acc = SampledAcceptor(300, cfg, make_generator(0))
    acc(logits, Draft([int(q_ids[0][0])], [q_ids[0]], [q_probs[0]]))
    p_ids, p_probs = filtered_probs(logits[1:], cfg)
    p = torch.zeros(300, dtype=torch.float64).index_add_(0, p_ids[0], p_probs[0].double())
    q = torch.zeros(300, dtype=torch.float64).index_add_(0, q_ids[0], q_probs[0].double())
    want = float(torch.minimum(p, q).sum())
    assert 0.0 < want < 0.9
    assert acc.acceptance_chance(q_ids[0], q_probs[0]) == pytest.approx(want, abs=1e-6)


def test_refused_sampled_drafts_are_judged_by_overlap(qwen3, monkeypatch):
    """temp > 0 with the target as its own draft model: p = q at every refused draft's row, so each
    judged chance is 1 (up to the rounding of a batched against a one-token forward)."""
    from tests.test_spec_loop import prompt as make_prompt
    judged = []
    monkeypatch.setattr(DraftLengthPolicy, "choose", lambda self: 1)
    monkeypatch.setattr(DraftLengthPolicy, "keep_draft", lambda self, i, top1: False)
    real_observe = DraftLengthPolicy.observe
    monkeypatch.setattr(DraftLengthPolicy, "observe",
                        lambda self, *a, **kw: judged.append(a[6]) or real_observe(self, *a, **kw))
    src = lambda session, spec: build_source("draft-simple", session, SAMPLED, spec, draft_model=qwen3)  # noqa: E731
    spec_run(qwen3, make_prompt(12), src, n_max=2, sampler=SAMPLED, adaptive=True)
    chances = [j[1] for j in judged]
    assert len(chances) >= 30 and min(chances) > 0.999



def test_a_chain_stops_before_a_row_that_could_not_pay():
    """SmolLM2-like costs (a row 13 % of a plain step, a 3-token verify 1.5x): after an unsure first
    draft even a sure second one could not pay for its row and the longer verify, so the head is not
    asked for it. After a sure first draft it is asked where chained rows have been sure, and not
    where they have been unsure (the gate would refuse most of them: their rows are lost)."""
    def policy(chained_top1: float) -> DraftLengthPolicy:
        p = Policy(n_max=3, gating=True)
        p.observe(0, 0, 0.0062, 0.0)
        p.observe(1, 1, 0.0070, 0.0008, conf=[0.9])
        p.observe(2, 1, 0.0093, 0.0016, conf=[0.9, 0.3])
        for _ in range(8):      # rows the head computed: a sure first, then a chained one
            p.keep_draft(0, 0.97)
            p.keep_draft(1, chained_top1)
        return p

    for chained in (0.95, 0.15):
        p = policy(chained)
        assert p.keep_draft(0, 0.35) and not p.worth_row(1)
        assert p.keep_draft(0, 0.97) and p.worth_row(1) == (chained > 0.5)


def test_the_source_asks_before_computing_a_chained_row(qwen35):
    """draft-mtp with a picker whose `worth` refuses row 1: every proposal stops after one draft."""
    from hybridrt.decoding.speculative.loop import SpecConfig
    from tests.test_spec_loop import prompt as make_prompt
    spec = SpecConfig(n_max=3)
    session = qwen35.session(128, k_max=spec.k_max)
    src = build_source("draft-mtp", session, GREEDY, spec)
    asked = []
    src.picker.worth = lambda i: asked.append(i) or False
    ids = make_prompt(5)
    out, stats = generate(qwen35, session, ids, 12, GREEDY, src, spec, stop_ids=set())
    assert out == plain(qwen35, ids, n=12)
    # asked once a proposal (the last may have room for one draft only: the -n cap, nothing to ask)
    assert max(stats.spec.drafted) == 1 and set(asked) == {1}
    assert sum(stats.spec.drafted) - 1 <= len(asked) <= sum(stats.spec.drafted)


def test_one_stalled_plain_step_does_not_start_a_run_of_rejected_drafts():
    """Gemma 3 on random tokens: a head sure of itself (top-1 0.9) and never right. One plain step
    stalled 3x by a neighbour on the machine made a weighted-mean t(1) ~20 % too high: a 2-token
    verify plus a row then looked cheaper than a plain step, the gate kept every draft, and no plain
    step came to correct t(1) (40 rejected drafts in 63 steps, 0.81x plain)."""
    p = Policy(n_max=3, gating=True)
    t1, t2, row = 0.0105, 0.0113, 0.0010
    drafted = 0
    for step in range(64):
        n = p.choose()
        if n == 0:
            p.observe(0, 0, 3 * t1 if step == 12 else t1, 0.0)
        elif p.keep_draft(0, 0.9):
            p.observe(1, 0, t2, row, conf=[0.9])
            drafted += 1
        else:
            p.observe(0, 0, t1, row, gated=True, refused=(0.9, 0.0))
    assert p.verify_cost(1) == pytest.approx(t1) and drafted <= 10


def test_a_stale_plain_step_cost_is_measured_again():
    """t(1) measured in a slow stretch (2x) and then never again, as every step drafts: while
    drafting pays little on the estimates, a plain step re-measures it within REFRESH_STEPS and
    the rejected drafts stop."""
    p = Policy(n_max=1)
    for _ in range(5):
        p.observe(0, 0, 0.020, 0.0)
    chosen = feed(p, 60, accept=lambda n: 1 if n and p.drafting_steps % 8 == 0 else 0,
                  verify_s=lambda k: 0.010 if k == 1 else 0.0115)
    first_plain = chosen.index(0)
    assert first_plain <= 17 and chosen[40:].count(0) >= 15, chosen


def test_a_verify_is_never_taken_as_cheaper_than_a_shorter_one():
    """A 2-token verify timed below a plain step (a stale t(1), or a t(2) from a fast stretch) is
    taken at t(1): it does all of a plain step's work."""
    p = Policy(n_max=3)
    p.observe(0, 0, 0.0110, 0.0)
    p.observe(1, 0, 0.0104, 0.001)
    p.observe(3, 0, 0.0130, 0.003)
    assert p.verify_cost(1) == p.verify_cost(2) == 0.0110
    assert p.verify_cost(3) == pytest.approx(0.0117) and p.verify_cost(4) == 0.0130


def test_a_first_plain_timing_above_a_longer_verify_is_measured_again_at_once():
    """Gemma 3 on random tokens: the run's one plain-step timing came out ~5 % slow, a 2-token verify
    then looked cheaper than a plain step and the gate kept rejected drafts for the 16 steps until
    t(1) was refreshed. A t(1) of fewer than three timings above a longer verify's is measured again
    at once, and drafting that does not pay stops within a few steps."""
    p = Policy(n_max=1, gating=True)
    p.observe(0, 0, 0.0130, 0.0)                # the slow first plain step
    rows = iter([(0.3, False)] * 200)            # kept by the gate: 2-token verifies, never right
    chosen = run_gated(p, rows, 40, verify_s=(0.0123, 0.0125))
    assert chosen[:4].count(0) >= 1 and chosen[8:].count(0) >= 28, chosen
    assert p.verify_cost(1) == pytest.approx(0.0123)


def test_a_plain_stretch_lasts_until_its_probe():
    """Once plain steps win, the policy stays plain until its probe however t(1) moves: plain steps
    teach it nothing about drafts, and a fresh t(1) above the last 2-token verifies' flipped steps
    back to drafting, each resetting the probe gap (so probes did not back off)."""
    p = Policy(n_max=1, gating=True, probe_every=16)
    rows = iter([(0.5, False)] * 400)
    for _ in range(80):                  # gated steps of an always-wrong head until plain wins
        run_gated(p, rows, 1)
        if p.plain_streak:
            break
    assert p.plain_streak == 1 and p.probe_gap == 16
    zeros = 0
    while p.choose() == 0:
        zeros += 1
        p.observe(0, 0, 0.0145, 0.0)     # plain steps now dearer than the last 2-token verifies
    # plain up to the step that would be the probe's (plain_streak 1 .. 15 of 16), where the choice
    # is made again on the new t(1); before, drafting won back 3 steps into the stretch
    assert zeros == 14, zeros


def test_a_new_run_keeps_what_was_learned_and_drops_the_stretch():
    p = Policy(n_max=2, probe_every=4)
    feed(p, 40, accept=lambda n: 0, verify_s=lambda k: 0.010 + 0.004 * (k - 1))
    assert p.plain_streak > 0 or p.probe_gap > p.probe_every       # inside a plain stretch
    learned = (dict(p.verify_s), p.accept_hits, p.accept_trials, p.draft_s, list(p.bin_trials))
    p.new_run()
    assert (p.plain_streak, p.probe_gap) == (0, p.probe_every)
    assert (dict(p.verify_s), p.accept_hits, p.accept_trials, p.draft_s, list(p.bin_trials)) == learned


@pytest.mark.parametrize("gate", [True, False])
def test_kept_policies_continue_into_the_next_sequence(qwen35, gate):
    """generate(policies=kept): the first sequence fills `kept` with its source's policy;
    the next one continues that same policy (its timings grow on), with the new source's picker
    asking it, and both outputs are plain decoding's."""
    kept = {}
    for seed in (5, 6):
        ids = prompt(seed)
        ref = plain(qwen35, ids)
        spec = SpecConfig(n_max=3, adaptive=True, gate=gate)
        session = qwen35.session(256, k_max=spec.k_max)
        source = build_source("draft-mtp", session, GREEDY, spec, None)
        out, _ = generate(qwen35, session, ids, N_GEN, GREEDY, source, spec, stop_ids=set(),
                                      policies=kept)
        assert out == ref
        policy = kept[source.name]
        if seed == 5:
            first, first_drafting = policy, policy.drafting_steps
            assert policy.verify_s
        else:
            assert policy is first and policy.drafting_steps >= first_drafting
        if gate:
            assert source.picker.gate == policy.keep_draft
    other = SpecConfig(n_max=2, adaptive=True)          # another n_max: a policy of its own
    session = qwen35.session(256, k_max=other.k_max)
    source = build_source("draft-mtp", session, GREEDY, other, None)
    generate(qwen35, session, prompt(7), 8, GREEDY, source, other, stop_ids=set(), policies=kept)
    assert kept[source.name] is not first and kept[source.name].n_max == 2


def test_the_first_timing_of_each_verify_size_and_of_the_drafts_is_not_kept():
    p = DraftLengthPolicy(n_max=2)
    p.observe(0, 0, 1.0, 0.0)            # the first plain step: its kernels' first call
    assert 1 not in p.verify_s
    p.observe(0, 0, 0.010, 0.0)
    assert p.verify_s[1] == 0.010
    p.observe(1, 1, 2.0, 0.5)            # the first 2-token verify and the first draft
    assert 2 not in p.verify_s and p.draft_s is None
    assert p.acceptance > p.prior_accept            # what was accepted still counts
    p.observe(1, 0, 0.012, 0.001)
    assert p.verify_s[2] == 0.012 and p.draft_s == 0.001


@pytest.mark.parametrize("skip", [True, False])
def test_a_first_call_that_loads_kernels_does_not_stop_drafting(skip):
    """Each verify size's and the drafts' first call costs 100 ms more (a fresh process loading
    machine code) on a source whose drafts are accepted 60 % of the time at 10 % of a step each:
    drafting pays, and a policy that skips first timings drafts; one that kept them (the negative
    control) stays plain."""
    p = DraftLengthPolicy(n_max=1, skip_first_timings=skip, probe_every=16)
    seen, accepted = set(), iter([1, 1, 0, 1, 0] * 40)
    chosen = []
    for _ in range(80):
        n = p.choose()
        k = n + 1
        verify = 0.010 + 0.001 * n + (0.1 if k not in seen else 0.0)
        draft = 0.001 * n + (0.1 if n and "draft" not in seen else 0.0)
        seen.add(k)
        if n:
            seen.add("draft")
        chosen.append(n)
        p.observe(n, next(accepted) if n else 0, verify, draft)
    drafting = sum(chosen[20:])
    assert drafting >= 50 if skip else drafting <= 10, chosen


def test_seeded_verify_costs_start_a_policy_as_observed_ones():
    """run's warm-up times each verify size with every kernel loaded (warmup.verify_costs): a policy
    seeded with those timings holds their medians, and its first own timings are kept, not dropped."""
    p = DraftLengthPolicy(n_max=2)
    p.seed_verify_costs({1: [0.010, 0.012, 0.011], 2: [0.013, 0.020, 0.012], 3: [0.015, 0.015, 0.016]})
    assert (p.verify_s[1], p.verify_s[2], p.verify_s[3]) == (0.011, 0.013, 0.015)
    assert p.verify_cost(2) == 0.013
    p.observe(1, 1, 0.014, 0.002)
    assert list(p.verify_recent[2]) == [0.013, 0.020, 0.012, 0.014] and p.draft_s == 0.002


def test_a_shared_step_raises_the_bar_for_drafts():
    """Drafts accepted about half the time at a verify of +30 % a token pay for one sequence (1.5
    tokens for 1.4 plain steps' time) but not for a step shared with three others, whose four
    tokens the longer verify slows too (`others`): that policy stays plain but for its probes."""
    def source():
        judged = iter(range(10 ** 6))
        return lambda n: n if n and next(judged) % 2 else 0      # every other drafting step keeps all

    cost = lambda k: 0.010 + 0.003 * (k - 1)        # noqa: E731
    alone, shared = Policy(n_max=3), Policy(n_max=3, others=3)
    a = feed(alone, 60, accept=source(), verify_s=cost)[20:]
    b = feed(shared, 60, accept=source(), verify_s=cost)[20:]
    assert a.count(0) <= 0.2 * len(a), a
    assert b.count(0) >= 0.8 * len(b), b


def test_verify_costs_are_kept_per_sharing_level():
    """Timings of a step shared with three others are not a lone step's: each level keeps its own,
    and a level comes back to what it had learned (the warm-up's lone timings included)."""
    p = Policy(n_max=3)
    p.seed_verify_costs({1: [0.010], 2: [0.012], 4: [0.020]})
    p.share(3)
    assert p.verify_s == {} and p.others == 3
    p.observe(0, 0, 0.040, 0.0)
    p.observe(0, 0, 0.041, 0.0)
    assert p.verify_s == {1: 0.040}
    p.share(0)
    assert p.verify_s == {1: 0.010, 2: 0.012, 4: 0.020} and p.others == 0
    p.share(3)
    assert p.verify_s == {1: 0.040} and len(p.verify_recent[1]) == 2

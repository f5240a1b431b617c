"""Shared steps across sessions (runtime/step_batcher.py, issue 57 items 2-3): sessions decoding on
their own threads, their evals run together, each output equal to the same request alone: greedy,
with and without n-gram drafts, different prompt lengths (a prompt longer than a chunk among them),
different arrival times, and a generation cancelled mid-way; a placed model's sessions too, whose
steps and own work take the device in turn."""
from __future__ import annotations

import threading
import time

import pytest

from hybridrt.decoding.generate import generate
from hybridrt.decoding.sampling import SamplerConfig
from hybridrt.decoding.speculative.loop import SpecConfig
from hybridrt.decoding.speculative.sources import build_source
from hybridrt.runtime.loader import load_model
from hybridrt.runtime.step_batcher import StepBatcher

pytestmark = pytest.mark.usefixtures("single_thread")
GREEDY = SamplerConfig(temp=0.0)
SPEC = SpecConfig(n_max=3)


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    # repeats inside, so n-gram lookup finds drafts
    base = [(seed * 7919 + 13 * i) % (vocab - 10) + 5 for i in range(max(4, n // 3))]
    return (base * 4)[:n]


def _generate(model, ids, n, spec_type, session=None, on_token=None):
    session = session or model.session(1024, k_max=SPEC.k_max)
    source = build_source(spec_type, session, GREEDY, SPEC) if spec_type != "none" else None
    out, _ = generate(model, session, ids, n, GREEDY, source, SPEC if source else None, stop_ids=set(),
                      on_token=on_token)
    return out


def _on_threads(serve, n: int, batcher: StepBatcher, timeout: float = 120) -> list[BaseException]:
    """serve(i) for i < n, each on a thread of its own, then the batcher stopped; what they raised."""
    errors = []

    def guarded(i):
        try:
            serve(i)
        except BaseException as e:      # noqa: BLE001 - returned to the test
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    batcher.stop()
    return errors


def _each_alone_and_together(model, cases, max_tokens: int = 0) -> StepBatcher:
    """cases: (prompt length, tokens, draft source, arrival delay s). Each request generated alone,
    then all of them on their own threads sharing one StepBatcher's steps; asserts every output
    equals the request alone and returns the (stopped) batcher for its counts."""
    prompts = [_prompt(i, n, model.n_vocab) for i, (n, *_rest) in enumerate(cases)]
    alone = [_generate(model, p, n, spec) for p, (_, n, spec, _) in zip(prompts, cases)]

    batcher = StepBatcher(model, max_tokens=max_tokens)
    results: dict[int, list[int]] = {}

    def serve(i):
        _, n, spec, delay = cases[i]
        time.sleep(delay)
        session = model.session(1024, k_max=SPEC.k_max)
        with batcher.member(session):
            results[i] = _generate(model, prompts[i], n, spec, session)

    errors = _on_threads(serve, len(cases), batcher)
    assert not errors, errors
    assert [results[i] for i in range(len(cases))] == alone
    assert batcher.steps < batcher.evals, "no step was shared"
    return batcher


@pytest.mark.parametrize("fixture,max_tokens", [("tiny_llama", 0), ("tiny_qwen3", 0), ("tiny_llama", 6)])
def test_shared_steps_equal_each_request_alone(fixture, max_tokens, request):
    model = load_model(request.getfixturevalue(fixture))
    cases = [  # (prompt length, tokens, draft source, arrival delay s)
        (5, 24, "none", 0.0), (40, 16, "ngram-simple", 0.0), (700, 12, "none", 0.01),
        (9, 30, "ngram-simple", 0.02), (17, 8, "none", 0.0), (3, 20, "ngram-simple", 0.05)]
    batcher = _each_alone_and_together(model, cases, max_tokens)
    assert batcher.rows >= sum(n for n, *_ in cases)


def test_a_cancelled_generation_leaves_and_the_others_go_on(tiny_llama):
    model = load_model(tiny_llama)
    prompts = [_prompt(i, 6 + i, model.n_vocab) for i in range(3)]
    alone = [_generate(model, p, 20, "ngram-simple") for p in prompts]
    batcher = StepBatcher(model)
    results, seen = {}, {}

    def serve(i):
        session = model.session(1024, k_max=SPEC.k_max)
        seen[i] = 0

        def on_token(token):
            seen[i] += 1
            return i == 1 and seen[i] >= 5          # request 1's client goes away after 5 tokens

        with batcher.member(session):
            results[i] = _generate(model, prompts[i], 20, "ngram-simple", session, on_token)

    assert not _on_threads(serve, 3, batcher)
    assert results[0] == alone[0] and results[2] == alone[2]
    assert results[1] == alone[1][:len(results[1])] and len(results[1]) < 20
    assert not batcher._members and not batcher._waiting


def _placed(path, n_ctx: int, **request):
    """path under a plan with the CPU standing in for the device: one FFN layer on the "device",
    part of the next, the rest in the mmap (tests/test_placed_run.py)."""
    from hybridrt.runtime.place import PlacementRequest
    from tests.test_placed_run import load_placed

    return load_placed(path, PlacementRequest(n_ctx=n_ctx, **request), 1, 2.5)


def test_placed_sessions_share_steps_with_their_own_drafts(tiny_qwen35_q4):
    """A plan: the steps run on the batcher's thread, the MTP head's drafts on the sessions' own,
    both on the device's one dequantization tile and the crossings' host buffers; every output
    equals the request alone."""
    model = _placed(tiny_qwen35_q4, 1024, spec_type="draft-mtp", spec_draft_n_max=3)
    cases = [(5, 16, "draft-mtp", 0.0), (9, 12, "none", 0.0), (3, 20, "draft-mtp", 0.01), (12, 10, "none", 0.02)]
    batcher = _each_alone_and_together(model, cases)
    assert batcher.device_turn is not None


def test_steps_and_members_own_work_take_the_device_in_turn(tiny_llama, monkeypatch):
    """With a plan no shared step runs while a member does its own work (here on_token: 3, 6 and
    9 ms a token for the three sessions, so the others' evals wait longer than the gather window),
    which could write the device's buffers under the step; a CPU trunk's batcher has no such turn."""
    from hybridrt.runtime import step_batcher

    assert StepBatcher(load_model(tiny_llama)).device_turn is None
    placed = _placed(tiny_llama, 256, spec_type="ngram-simple", spec_draft_n_max=3)
    steps, own = [], []
    eval_batch = step_batcher.eval_batch

    def timed_eval_batch(*args, **kwargs):
        t0 = time.perf_counter()
        out = eval_batch(*args, **kwargs)
        steps.append((t0, time.perf_counter()))
        return out

    monkeypatch.setattr(step_batcher, "eval_batch", timed_eval_batch)
    batcher = StepBatcher(placed)

    def serve(i):
        def on_token(token):
            t0 = time.perf_counter()
            time.sleep(0.003 * (i + 1))
            own.append((t0, time.perf_counter()))

        session = placed.session(256, k_max=SPEC.k_max)
        with batcher.member(session):
            _generate(placed, _prompt(i, 6 + i, placed.n_vocab), 10, "none", session, on_token)

    errors = _on_threads(serve, 3, batcher)
    assert not errors, errors
    assert batcher.steps < batcher.evals and len(own) == 30
    overlaps = [(s, o) for s in steps for o in own if s[0] < o[1] and o[0] < s[1]]
    assert not overlaps, f"{len(overlaps)} steps ran during a member's own work"


def test_a_member_knows_how_many_share_its_steps(tiny_llama):
    """Session.sharing: the other members of its batcher (what its adaptive length weighs a longer
    verify against), 0 outside."""
    model = load_model(tiny_llama)
    batcher = StepBatcher(model)
    a, b = model.session(64), model.session(64)
    try:
        with batcher.member(a):
            assert a.sharing == 0
            with batcher.member(b):
                assert a.sharing == b.sharing == 1
            assert a.sharing == 0
        assert a.sharing == b.sharing == 0
    finally:
        batcher.stop()


def test_a_late_member_is_waited_for_half_a_step(tiny_llama):
    """The gather window: at least GATHER_S, else half the last decode step's time, so a session a
    little late still joins the step (step_batcher's docstring)."""
    from hybridrt.runtime import step_batcher as sb

    model = load_model(tiny_llama)
    batcher = StepBatcher(model)
    try:
        early, late = model.session(64), model.session(64)
        with batcher._cond:
            batcher._members |= {id(early), id(late)}
            batcher._step_s = 0.1
            now = time.perf_counter()
            batcher._waiting[id(early)] = sb._Eval(early, early.rewind_for([1], None), "all", now - 0.03)
            assert not batcher._ready()             # 30 ms of a 50 ms window
            batcher._waiting[id(early)].since = now - 0.06
            assert batcher._ready()
            batcher._step_s = 0.0                   # no step timed yet: GATHER_S
            batcher._waiting[id(early)].since = time.perf_counter() - 2 * sb.GATHER_S
            assert batcher._ready()
            batcher._waiting.clear()
            batcher._members.clear()
    finally:
        batcher.stop()


def test_batch_tokens_bound_a_step_oldest_first(tiny_llama):
    """--batch-tokens: evals longest waiting first while their rows fit, at most one prompt chunk,
    the oldest always (a 512-token chunk in a 6-token budget)."""
    from hybridrt.runtime import step_batcher as sb

    model = load_model(tiny_llama)
    sessions = [model.session(1024) for _ in range(4)]
    sizes = {0: 700, 1: 4, 2: 1, 3: 600}           # a prompt, a verify, a decode, another prompt

    def take(max_tokens, ages):
        batcher = StepBatcher(model, max_tokens=max_tokens)
        try:
            now = time.perf_counter()
            with batcher._cond:
                for i, age in ages.items():
                    batcher._waiting[i] = sb._Eval(sessions[i], sessions[i].rewind_for(list(range(1, sizes[i] + 1)), None),
                                                   "last", now - age)
                return [next(i for i, s in enumerate(sessions) if s is j.session) for j in batcher._take()]
        finally:
            batcher._waiting.clear()
            batcher.stop()

    ages = {0: 3.0, 1: 2.0, 2: 1.0, 3: 4.0}
    assert take(0, ages) == [3, 1, 2]             # one chunk (the older prompt's), every small eval
    assert take(6, ages) == [3]                   # the oldest runs alone when nothing else fits
    assert take(517, ages) == [3, 1, 2]           # 512 + 4 + 1
    assert take(515, ages) == [3, 2]              # the verify waits, the decode still fits
    assert take(5, {1: 2.0, 2: 1.0, 0: 0.5}) == [1, 2]


def test_recurrent_sessions_share_steps_with_their_own_drafts(tiny_qwen35_mtp):
    """qwen35 with its MTP head: sessions drafting (draft-mtp) and not, each advancing its own
    Gated DeltaNet state and snapshot ring in shared steps and rolling back alone; every output
    equals the request alone."""
    model = load_model(tiny_qwen35_mtp)
    cases = [(5, 16, "draft-mtp", 0.0), (9, 12, "none", 0.0), (3, 20, "draft-mtp", 0.01), (12, 10, "none", 0.02)]
    _each_alone_and_together(model, cases)

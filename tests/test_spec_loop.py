"""The speculative loop on tiny models: greedy parity with plain decoding for every draft source and
window size, rollback (caught when broken), the MTP KV rewrite, stop / -n inside an accepted
window, and sampled runs that never draw a token twice."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import make_model
from hybridrt.decoding.generate import generate
from hybridrt.runtime.loader import load_model
from hybridrt.decoding.sampling import SamplerConfig
from hybridrt.runtime.session import PROMPT_CHUNK, Session
from hybridrt.runtime.snapshot_ring import SnapshotRing
from hybridrt.decoding.speculative import acceptance
from hybridrt.decoding.speculative.draft import Draft, DraftSource
from hybridrt.decoding.speculative.draft_forced import ForcedSource
from hybridrt.decoding.speculative.loop import SpecConfig
from hybridrt.decoding.speculative.sources import build_source
from hybridrt.errors import UserError

GREEDY = SamplerConfig(temp=0.0)
N_GEN = 40


PROMPT_LEN = 10


def prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 300, n)]


def plain(model, ids, n=N_GEN, sampler=GREEDY, stop_ids=frozenset()):
    out, _ = generate(model, model.session(256), ids, n, sampler, stop_ids=set(stop_ids))
    return out


def spec_run(model, ids, source_of, n_max, n=N_GEN, sampler=GREEDY, stop_ids=frozenset(), **kw):
    """source_of(session, spec) -> a fresh source; returns (tokens, stats, session, source)."""
    spec = SpecConfig(n_max=n_max, **kw)
    session = model.session(256, k_max=spec.k_max)
    source = source_of(session, spec)
    out, stats = generate(model, session, ids, n, sampler, source, spec, stop_ids=set(stop_ids))
    return out, stats, session, source


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def qwen35(tiny_qwen35_mtp):
    return load_model(tiny_qwen35_mtp)


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3):
    """Attention only (tiny llama files fall into one repeated token; qwen3's output varies)."""
    return load_model(tiny_qwen3)


def forced(model, ids, ref, corrupt, inner=None, seed=1):
    return lambda session, spec: ForcedSource(inner(session, spec) if inner else None, ref, len(ids),
                                              model.n_vocab, corrupt, seed)


def mtp(session, spec):
    return build_source("draft-mtp", session, GREEDY, spec)


class Repeat(DraftSource):
    """Only what DraftSource requires (a name, observe, catch_up, propose): the protocol's defaults
    are the rest. Proposes the certain token again."""
    name = "repeat"

    def observe(self, start, tokens, hidden):
        pass

    def catch_up(self):
        pass

    def propose(self, certain, pos, n_max):
        return Draft([certain] * n_max)


@pytest.mark.parametrize("adaptive", [False, True])
def test_the_loop_uses_only_what_the_source_protocol_declares(qwen3, adaptive):
    """A source with the three required methods runs plain and adaptive speculation (length
    policies, the drafter's choice, the gate's picker: all through DraftSource's members), alone
    and in a chain behind a lookup; a member the loop read without declaring it fails here."""
    from hybridrt.decoding.speculative.draft_chain import DraftChain
    from hybridrt.decoding.speculative.draft_ngram import NgramSource

    ids = prompt(3)
    for source_of in (lambda session, spec: Repeat(), lambda session, spec: DraftChain([NgramSource(), Repeat()])):
        out, stats, _, _ = spec_run(qwen3, ids, source_of, 3, adaptive=adaptive)
        assert out == plain(qwen3, ids) and sum(stats.spec.drafted) > 0


@pytest.mark.parametrize("n_max", [1, 2, 3, 4, 8])
def test_mtp_greedy_parity(qwen35, n_max):
    for seed in (0, 1):
        ids = prompt(seed)
        out, stats, _, _ = spec_run(qwen35, ids, mtp, n_max)
        assert out == plain(qwen35, ids)
        assert sum(stats.spec.drafted) > 0


@pytest.mark.parametrize("name", ["qwen35", "qwen3"])
@pytest.mark.parametrize("n_max", [1, 3, 8])
def test_parity_with_rejections_at_every_offset(name, n_max, request):
    """Drafts are the true continuation with tokens corrupted at random: the kept prefix length
    varies over the whole window, so every rollback offset is exercised."""
    model = request.getfixturevalue(name)
    ids = prompt(3)
    ref = plain(model, ids)
    out, stats, _, _ = spec_run(model, ids, forced(model, ids, ref, corrupt=0.3), n_max)
    assert out == ref
    hist = stats.spec.histogram
    assert sum(1 for h in hist if h) >= min(3, n_max + 1), hist   # several distinct kept lengths
    assert 0 < stats.spec.acceptance_rate < 1


def test_the_largest_verify_batch_keeps_parity(qwen3):
    """--spec-draft-n-max's limit: the certain token and MAX_DRAFTS drafts stay on the kernels plain
    steps take (the batch-stable small-batch path and the second int8 pass), so nearly-all-accepted
    windows of the full length give plain decoding's tokens."""
    from cpu_kernels.quantize_act import RESIDUAL_MAX_TOKENS
    from gpu_kernels.attention import ROWWISE_MAX
    from hybridrt.cli.options import MAX_DRAFTS

    assert MAX_DRAFTS + 1 == ROWWISE_MAX == RESIDUAL_MAX_TOKENS
    ids = prompt(4)
    ref = plain(qwen3, ids, n=3 * ROWWISE_MAX)
    out, stats, _, _ = spec_run(qwen3, ids, forced(qwen3, ids, ref, corrupt=0.02), MAX_DRAFTS, n=3 * ROWWISE_MAX)
    assert out == ref
    assert stats.spec.histogram[-1] > 0, stats.spec.histogram      # some windows kept whole


def test_broken_recurrent_rollback_is_caught(qwen35, monkeypatch):
    ids = prompt(3)
    ref = plain(qwen35, ids)
    monkeypatch.setattr(SnapshotRing, "restore", lambda self, n_keep, conv, S: None)
    out, _, _, _ = spec_run(qwen35, ids, forced(qwen35, ids, ref, corrupt=0.3), 3)
    assert out != ref


def test_broken_kv_rollback_is_caught(qwen3, monkeypatch):
    ids = prompt(3)
    ref = plain(qwen3, ids)
    monkeypatch.setattr(Session, "truncate", lambda self, n: None)
    out, _, _, _ = spec_run(qwen3, ids, forced(qwen3, ids, ref, corrupt=0.3), 3)
    assert out != ref


def test_forced_accept_and_reject(qwen35):
    ids = prompt(4)
    ref = plain(qwen35, ids)
    out, stats, _, _ = spec_run(qwen35, ids, forced(qwen35, ids, ref, 0.0, inner=mtp), 4)
    assert out == ref and stats.spec.acceptance_rate == 1.0
    assert stats.spec.steps <= -(-N_GEN // 5) + 1
    out, stats, _, _ = spec_run(qwen35, ids, forced(qwen35, ids, ref, 1.0, inner=mtp), 4)
    assert out == ref and stats.spec.acceptance_rate == 0.0 and stats.spec.steps == N_GEN - 1


def test_mtp_kv_is_rewritten_from_trunk_hiddens(qwen35):
    """After a run whose drafts were all accepted, every committed MTP KV entry must equal a
    teacher-forced MTP pass over the final sequence with the trunk's hiddens (not the chained
    MTP hiddens the drafts were made with)."""
    ids = prompt(5)
    ref = plain(qwen35, ids)
    out, _, session, source = spec_run(qwen35, ids, forced(qwen35, ids, ref, 0.0, inner=mtp), 3)
    assert out == ref
    synced = source.inner.synced
    assert synced >= len(ids) + len(out) - 4
    seq = ids + out
    fresh = qwen35.session(256)
    fresh.eval(seq, logits="none")
    qwen35.mtp.step(fresh.state, torch.tensor(seq[1:synced]), fresh.hidden[:synced - 1], start_pos=1, logits=False)
    got, want = session.state.mtp_kv, fresh.state.mtp_kv
    for a, b in ((got.k[0], want.k[0]), (got.v[0], want.v[0])):
        assert torch.allclose(a[1:synced], b[1:synced], rtol=1e-4, atol=1e-5)


def _continues_like_fresh(model, session, seq):
    """The session, rewound to `seq`, must give the logits a fresh session gives after `seq`
    (prompt prefilled, then token by token: the path whose logits the loop reproduces bitwise)."""
    assert session.n_past == len(seq)
    nxt = 7
    fresh = model.session(256)
    fresh.eval(seq[:PROMPT_LEN], logits="none")
    for t in seq[PROMPT_LEN:]:
        fresh.eval([t], logits="none")
    assert torch.equal(session.eval([nxt]), fresh.eval([nxt]))


@pytest.mark.parametrize("name", ["qwen35", "qwen3"])
def test_stop_token_inside_an_accepted_window(name, request):
    model = request.getfixturevalue(name)
    ids = prompt(6)
    ref = plain(model, ids)
    # a stop token that first appears mid-window: everything after it is undone
    k = next(i for i in range(5, len(ref)) if ref[i] not in ref[:i])
    out, stats, session, _ = spec_run(model, ids, forced(model, ids, ref, 0.0), 8, stop_ids={ref[k]})
    assert out == ref[:k] == plain(model, ids, stop_ids={ref[k]})
    assert stats.stopped_by == "eog"
    _continues_like_fresh(model, session, ids + out)


@pytest.mark.parametrize("name", ["qwen35", "qwen3"])
def test_n_cap_inside_a_window(name, request):
    model = request.getfixturevalue(name)
    ids = prompt(7)
    ref = plain(model, ids)
    for n in (1, 2, 6, 11):
        out, stats, session, _ = spec_run(model, ids, forced(model, ids, ref, 0.0), 8, n=n)
        assert out == ref[:n] and stats.stopped_by == "n_predict"
        # the last token is in the KV when it was a kept draft, not when it was the certain token
        assert session.n_past in (len(ids) + n - 1, len(ids) + n)
        _continues_like_fresh(model, session, (ids + out)[:session.n_past])


def test_context_end(qwen3):
    """A full context ends the generation with its last token emitted (it needs no forward), with
    drafts as without them."""
    ids = prompt(8)
    spec = SpecConfig(n_max=8)
    plain_out, stats = generate(qwen3, qwen3.session(24), ids, -1, GREEDY, stop_ids=set())
    assert len(plain_out) == 24 - len(ids) + 1 and stats.stopped_by == "context"
    session = qwen3.session(24, k_max=spec.k_max)
    source = forced(qwen3, ids, plain(qwen3, ids, n=-1), 0.0)(session, spec)
    out, stats = generate(qwen3, session, ids, -1, GREEDY, source, spec, stop_ids=set())
    assert out == plain_out and stats.stopped_by == "context"


def test_no_draft_loop_is_plain_sampling(qwen3):
    """With no drafts the loop draws exactly what plain sampling draws, seed for seed."""
    ids = prompt(9)
    sampler = SamplerConfig(temp=0.9, top_k=20, top_p=0.95, min_p=0.0, seed=3)
    out, _, _, _ = spec_run(qwen3, ids, lambda s, spec: None, 3, sampler=sampler)
    assert out == plain(qwen3, ids, sampler=sampler)


def test_sampled_steps_never_draw_a_token_twice(qwen3, monkeypatch):
    """Each step draws one token (a correction or the bonus) that becomes the next certain token;
    it is emitted as drawn and never re-sampled, including on steps with no drafts at all."""
    ids = prompt(10)
    ref = plain(qwen3, ids)
    draws, steps = [], []
    real_call = acceptance.SampledAcceptor.__call__

    def spy(self, logits, draft):
        verdict = real_call(self, logits, draft)
        steps.append((list(draft.tokens), verdict))
        return verdict

    monkeypatch.setattr(acceptance.SampledAcceptor, "__call__", spy)
    sampler = SamplerConfig(temp=0.8, top_k=0, top_p=1.0, min_p=0.0, seed=1)

    class Flaky(ForcedSource):     # no drafts on every third step: a plain step inside the loop
        def propose(self, certain, pos, n_max):
            draws.append(certain)
            return super().propose(certain, pos, n_max) if len(draws) % 3 else super().propose(certain, pos, 0)

    out, stats, _, _ = spec_run(qwen3, ids, lambda s, spec: Flaky(None, ref, len(ids), qwen3.n_vocab, 0.3, 2),
                                4, sampler=sampler)
    rebuilt, certain = [], draws[0]
    for i, (drafted, verdict) in enumerate(steps):
        assert draws[i] == certain              # the token drawn last step, unchanged
        rebuilt += [certain] + drafted[:verdict.n_accepted]
        certain = verdict.next_token
    assert out[:len(rebuilt)] == rebuilt and len(out) - len(rebuilt) <= 1
    assert len(steps) == stats.spec.steps and any(not d for d, _ in steps)


def test_draft_model_parity_and_self_draft(qwen3, tiny_qwen3, tmp_path):
    other = load_model(make_model.write_model(tmp_path / "draft.gguf", "qwen3", seed=1))
    ids = prompt(11)
    ref = plain(qwen3, ids)
    for n_max in (1, 3, 8):
        for draft, full in ((qwen3, True), (other, False)):
            src = lambda session, spec: build_source("draft-simple", session, GREEDY, spec, draft_model=draft)
            out, stats, _, _ = spec_run(qwen3, ids, src, n_max)
            assert out == ref
            if full:
                assert stats.spec.acceptance_rate == 1.0


def test_draft_model_vocabulary_must_match(qwen3, tmp_path):
    other = load_model(make_model.write_model(tmp_path / "q.gguf", "qwen3", dims={"n_vocab": 512}))
    session = qwen3.session(64, k_max=4)
    with pytest.raises(UserError, match="vocabulary"):
        build_source("draft-simple", session, GREEDY, SpecConfig(), draft_model=other)


def test_ngram_parity_on_a_repetitive_prompt(qwen3):
    ids = prompt(12, 6) * 4
    ref = plain(qwen3, ids)
    for n_max in (1, 2, 3, 4, 8):
        out, _, _, _ = spec_run(qwen3, ids, lambda s, spec: build_source("ngram-simple", s, GREEDY, spec), n_max)
        assert out == ref


@pytest.mark.parametrize("kind", ["draft-mtp", "draft-simple"])
def test_catching_up_apart_gives_the_same_drafts(kind, qwen35, qwen3):
    """A model source defers committed tokens to its next proposal; `catch_up` (the loop calls it
    after a run of plain steps, timed apart) processes them first. The drafts must not change."""
    model = qwen35 if kind == "draft-mtp" else qwen3
    ids = prompt(9)
    ref = plain(model, ids, n=12)
    seq = ids + ref[:8]
    drafts = []
    for apart in (False, True):
        spec = SpecConfig(n_max=3)
        session = model.session(256, k_max=spec.k_max)
        source = build_source(kind, session, GREEDY, spec, model if kind == "draft-simple" else None)
        session.eval(ids, logits="none")
        source.observe(0, ids, session.hidden)
        for p in range(len(ids), len(seq)):          # plain steps, one token each
            session.eval([seq[p]], logits="none")
            source.observe(p, [seq[p]], session.hidden)
        if apart:
            source.catch_up()
        drafts.append(source.propose(ref[8], len(seq), 3).tokens)
    assert drafts[0] and drafts[0] == drafts[1]


@pytest.mark.parametrize("name", ["qwen35", "qwen3"])
def test_each_token_is_shown_with_the_logits_row_plain_decoding_drew_it_from(name, request):
    """on_logits (the server's logprobs) sees every emitted token once, just before on_token, with
    the row plain decoding drew it from: the prompt's last row, a verify row that checked a kept
    draft, or the row after the last kept one (rejections at every offset)."""
    model = request.getfixturevalue(name)
    ids = prompt(13)
    seen_plain, seen_spec, order = [], [], []
    ref, _ = generate(model, model.session(256), ids, N_GEN, GREEDY, stop_ids=set(),
                      on_logits=lambda t, row: seen_plain.append((t, row.clone())))
    spec = SpecConfig(n_max=3)
    session = model.session(256, k_max=spec.k_max)
    source = forced(model, ids, ref, corrupt=0.3)(session, spec)
    out, stats = generate(model, session, ids, N_GEN, GREEDY, source, spec, stop_ids=set(),
                          on_token=lambda t: order.append(("token", t)),
                          on_logits=lambda t, row: (seen_spec.append((t, row.clone())), order.append(("row", t))))
    assert out == ref and 0 < stats.spec.acceptance_rate < 1
    assert [t for t, _ in seen_plain] == [t for t, _ in seen_spec] == ref
    assert order == [x for t in ref for x in (("row", t), ("token", t))]
    for (t, a), (_, b) in zip(seen_plain, seen_spec):
        assert int(torch.argmax(b)) == t
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["qwen3", "qwen35"])
def test_prompt_rows_are_visited_once_in_each_decoder(name, request):
    """on_prompt_row (the server's echo + logprobs) sees, inside the decoder's own prefill, the row
    predicting each prompt token after the first (position i - 1's logits), across prompt chunks,
    and decoding goes on as without it."""
    model = request.getfixturevalue(name)
    ids = prompt(14, n=PROMPT_CHUNK + 9)
    n_ctx = len(ids) + N_GEN + 8
    want = model.session(n_ctx).eval(ids, logits="all")
    ref, _ = generate(model, model.session(n_ctx), ids, N_GEN, GREEDY, stop_ids=set())
    for spec_n in (None, 2):
        seen = []
        visit = lambda i, row: seen.append((i, row.clone()))  # noqa: E731
        if spec_n is None:
            out, _ = generate(model, model.session(n_ctx), ids, N_GEN, GREEDY, stop_ids=set(), on_prompt_row=visit)
        else:
            spec = SpecConfig(n_max=spec_n)
            session = model.session(n_ctx, k_max=spec.k_max)
            source = forced(model, ids, ref, corrupt=0.3)(session, spec)
            out, _ = generate(model, session, ids, N_GEN, GREEDY, source, spec, stop_ids=set(), on_prompt_row=visit)
        assert out == ref
        assert [i for i, _ in seen] == list(range(1, len(ids)))
        torch.testing.assert_close(torch.stack([r for _, r in seen]), want[:-1], rtol=0, atol=1e-4)

"""The built-in MTP head drafting over a reduced vocabulary (speculative/draft_vocab.py,
`build_source(..., draft_vocab=V)`): greedy outputs token for token those of plain decoding, drafts
only ever inside the draft vocabulary, the view's logits bitwise the full head's at its rows,
sampled drafts keeping the target's distribution, how the V tokens are chosen, and bad values
refused in one line."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import make_model
from hybridrt.errors import UserError
from hybridrt.decoding.generate import generate
from hybridrt.runtime.loader import load_model
from hybridrt.decoding.sampling import SamplerConfig
from hybridrt.decoding.speculative.draft_vocab import bundled_text, choose_draft_vocab, draft_head
from hybridrt.decoding.speculative.loop import SpecConfig
from hybridrt.decoding.speculative.sources import build_source
from hybridrt.files.tokenizer import CONTROL
from tests.test_spec_loop import GREEDY, N_GEN, plain, prompt
from tests.test_train_mtp import check_reduced_vocab_exact

V = 64      # of the tiny files' 355 tokens
SAMPLED = SamplerConfig(temp=0.8, top_k=40, top_p=0.95, min_p=0.0, seed=5)

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def qwen35(tiny_qwen35_mtp):
    return load_model(tiny_qwen35_mtp)


def run(model, ids, n_max, draft_vocab, sampler=GREEDY):
    """A speculative run whose source checks that every draft (and every candidate of a sampled
    draft's q) is in the draft vocabulary of its step; (tokens, stats, source, drafts)."""
    spec = SpecConfig(n_max=n_max)
    session = model.session(256, k_max=spec.k_max)
    source = build_source("draft-mtp", session, sampler, spec, draft_vocab=draft_vocab)
    drafts, propose = [], source.propose

    def recording(*args):
        draft = propose(*args)
        proposed = draft.tokens + [t for q_ids in draft.q_ids or [] for t in q_ids.tolist()]
        assert set(proposed) <= set(source.draft_ids.tolist())
        drafts.extend(proposed)
        return draft
    source.propose = recording
    out, stats = generate(model, session, ids, N_GEN, sampler, source, spec, stop_ids=set())
    return out, stats, source, drafts


@pytest.mark.parametrize("n_max", [1, 2, 3, 4])
def test_greedy_parity(qwen35, n_max):
    for seed in (0, 1):
        ids = prompt(seed)
        out, stats, source, drafts = run(qwen35, ids, n_max, V)
        assert out == plain(qwen35, ids)
        assert V < len(source.draft_ids) <= 2 * V and sum(stats.spec.drafted) > 0


def test_sampled_drafts_stay_in_the_draft_vocabulary(qwen35):
    _, stats, _, drafts = run(qwen35, prompt(2), 3, V, SAMPLED)
    assert sum(stats.spec.drafted) > 0 and len(set(drafts)) > 1


def test_sampled_drafts_keep_the_target_distribution(qwen35):
    check_reduced_vocab_exact(qwen35, flatten=True, draft_vocab=V)


@pytest.mark.parametrize("mix", ["f32", "q8_0", "q4_k_m"])
def test_draft_logits_are_the_full_heads_rows(tmp_path, mix):
    """Bitwise, the chosen rows and the sequence's own, on the float and the integer kernels
    (q4_k_m: a Q6_K head, as Qwen3.6-27B's), one row (a draft) and several."""
    m = load_model(make_model.write_model(tmp_path / f"{mix}.gguf", "qwen35", mtp=True, mix=mix, seed=1))
    head = draft_head(m, V)
    assert head.static.n_out == V and head.static.raw.nbytes * m.n_vocab == m.mtp.head.raw.nbytes * V
    h = torch.randn(4, m.n_embd, generator=torch.Generator().manual_seed(0))
    ids = prompt(0)
    for added in ([], ids[:5], ids):
        head.add_tokens(added)
        assert V < head.n_out <= 2 * V if added else head.n_out == V
        for rows in (h[:1], h):
            assert torch.equal(head.head(rows), m.mtp.head(rows)[:, head.draft_ids])
    # a draft: the head's block as it is, the logits of those rows into a row wider than them
    s = m.session(32)
    s.eval(ids, logits="none")
    tok, hid = torch.tensor(ids[1:]), s.hidden[:-1]
    full, row = torch.empty(1, m.n_vocab), torch.full((1, head.max_out), float("nan"))
    h_full = m.mtp.draft(s.state, tok, hid, 1, out=full)
    h_draft = head.draft(s.state, tok, hid, 1, out=row)
    assert torch.equal(h_full, h_draft) and torch.equal(row[:, :head.n_out], full[:, head.draft_ids])


def test_the_sequence_adds_its_own_tokens_once_and_up_to_v(qwen35):
    head = draft_head(qwen35, V)
    static = set(head.draft_ids.tolist())
    outside = [t for t in range(qwen35.n_vocab) if t not in static]
    head.add_tokens(outside[:3] + outside[:3] + sorted(static)[:4])
    assert head.draft_ids[V:].tolist() == outside[:3]
    head.add_tokens(outside)
    assert head.n_out == head.max_out == 2 * V and head.draft_ids[V:].tolist() == outside[:V]
    assert len(set(head.draft_ids.tolist())) == 2 * V


def test_chosen_rows_are_built_once_and_size_0_is_the_head(qwen35):
    assert draft_head(qwen35, V).static is draft_head(qwen35, V).static
    assert draft_head(qwen35, 0) is qwen35.mtp and draft_head(qwen35, qwen35.n_vocab) is qwen35.mtp


def test_chain_gives_the_view_to_its_mtp_source(qwen35):
    session = qwen35.session(64)
    chain = build_source("ngram-simple,draft-mtp", session, GREEDY, SpecConfig(), draft_vocab=V)
    assert chain.sources[-1].mtp.size == V


def test_choice_is_eog_then_bundled_text_then_ascending_text_ids(qwen35):
    tok, n = qwen35.tokenizer, qwen35.n_vocab
    ids = choose_draft_vocab(tok, n, V)
    assert torch.equal(ids, choose_draft_vocab(tok, n, V))       # deterministic
    assert ids.tolist() == sorted(set(ids.tolist())) and len(ids) == V
    assert set(tok.eog_ids) <= set(ids.tolist())
    counts = np.bincount(np.concatenate([tok.encode(t, add_special=False) for t in bundled_text()]), minlength=n)
    seen = np.flatnonzero(counts)
    assert len(seen) > V        # the tiny vocabulary: the text alone fills V
    chosen = set(ids.tolist()) - set(tok.eog_ids)
    assert min(counts[list(chosen)]) >= max(np.delete(counts, ids.numpy()))     # the most frequent
    # past the text: the other text tokens by id, control tokens last
    control = set(np.flatnonzero(np.asarray(tok.token_types) == CONTROL).tolist()) - set(tok.eog_ids)
    size = n - len(control)
    wide = set(choose_draft_vocab(tok, n, size).tolist())
    assert not wide & control and len(wide) == size
    up_to = choose_draft_vocab(tok, n, len(seen) + len(tok.eog_ids) + 5).tolist()
    unseen = sorted(set(range(n)) - set(seen.tolist()) - control - set(tok.eog_ids))
    assert sorted(set(up_to) - set(seen.tolist()) - set(tok.eog_ids)) == unseen[:5]


@pytest.mark.parametrize("size", [-1, 356, 10**9])
def test_bad_sizes_are_one_line_errors(qwen35, size):
    assert qwen35.n_vocab == 355
    with pytest.raises(UserError) as err:
        build_source("draft-mtp", qwen35.session(32), GREEDY, SpecConfig(), draft_vocab=size)
    assert "\n" not in str(err.value) and "--spec-draft-vocab" in str(err.value)


def test_a_draft_vocab_needs_the_mtp_source_and_the_built_in_head(qwen35, monkeypatch):
    with pytest.raises(UserError, match="needs --spec-type draft-mtp"):
        build_source("ngram-simple", qwen35.session(32), GREEDY, SpecConfig(), draft_vocab=V)
    monkeypatch.setattr(qwen35, "mtp", object())      # a trained head (--mtp-head) stands in
    with pytest.raises(UserError, match="built-in MTP head"):
        draft_head(qwen35, V)


def test_warm_up_builds_the_rows_the_run_drafts_with(qwen35):
    from hybridrt.decoding.speculative.draft_vocab import _CHOSEN_ROWS
    from hybridrt.runtime.warmup import warm_up

    warm_up(qwen35, "draft-mtp", SpecConfig(n_max=2), GREEDY, "f32", draft_vocab=V + 1)
    assert V + 1 in _CHOSEN_ROWS[qwen35.mtp]


def test_run_takes_the_draft_vocab_and_prints_plain_decodings_text(tiny_qwen35_mtp):
    """`hybridrt run --spec-draft-vocab V` drafts over V tokens (the warm-up and the run's source) and
    prints greedy plain decoding's text; a V above the vocabulary is one error line."""
    import subprocess
    import sys

    def run_cli(*flags):
        return subprocess.run([sys.executable, "-c", "from hybridrt.cli.commands import main; main()", "run", "-m",
                               str(tiny_qwen35_mtp), "-p", "a b c", "-n", "12", "--temp", "0", "-t", "1",
                               "--no-display-prompt", *flags], capture_output=True, text=True)
    plain = run_cli("--spec-type", "none")
    drafted = run_cli("--spec-type", "draft-mtp", "--spec-draft-n-max", "2", "--spec-draft-vocab", "64")
    assert plain.returncode == 0 and drafted.returncode == 0, drafted.stderr
    assert drafted.stdout == plain.stdout and plain.stdout
    too_big = run_cli("--spec-type", "draft-mtp", "--spec-draft-vocab", "100000")
    assert too_big.returncode == 2 and len(too_big.stderr.strip().splitlines()) == 1, too_big.stderr
    assert "--spec-draft-vocab 100000" in too_big.stderr


def test_bench_takes_the_draft_vocab(tiny_qwen35_mtp):
    """`hybridrt bench --spec-type draft-mtp --spec-draft-vocab V`: the speculative run drafts over V
    tokens (its JSON says which V) and its greedy output equals plain decoding's."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", "from hybridrt.cli.commands import main; main()", "bench", "-m",
                        str(tiny_qwen35_mtp), "--spec-type", "draft-mtp", "--spec-draft-n-max", "2",
                        "--spec-draft-vocab", "64", "-n", "12", "-r", "1", "-t", "1", "--cpu-bw", "10", "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["draft_vocab"] == 64 and out["identical"] and out["spec"]["steps"] > 0

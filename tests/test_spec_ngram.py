"""The prompt-lookup index: longest match first, most recent occurrence wins, copies that run into
their own drafts, constant work per appended token, and agreement with a brute-force scan."""
from __future__ import annotations

import random

from hybridrt.decoding.speculative.draft_ngram import NgramIndex, NgramSource


def brute_force(seq: list[int], n_max: int, n_min: int, n_draft: int) -> list[int]:
    """Scan the whole history: longest suffix n-gram with an earlier occurrence, latest one."""
    L = len(seq)
    for n in range(min(n_max, L), n_min - 1, -1):
        key = seq[L - n:]
        for start in range(L - n - 1, -1, -1):
            if seq[start:start + n] == key:
                ext = list(seq)
                for i in range(n_draft):
                    ext.append(ext[start + n + i])
                return ext[L:]
    return []


def index_of(seq: list[int], n_max=4, n_min=2) -> NgramIndex:
    idx = NgramIndex(n_max, n_min)
    idx.extend(seq)
    return idx


def test_longest_match_wins_over_a_more_recent_shorter_one():
    # "1 2 3" is followed by 7 (once); the bigram "2 3" alone was last followed by 9
    seq = [1, 2, 3, 7, 8, 5, 2, 3, 9, 4, 1, 2]
    assert index_of(seq).lookup(3, 2) == [7, 8]
    assert index_of(seq, n_max=2).lookup(3, 2) == [9, 4]


def test_most_recent_occurrence_wins():
    seq = [5, 6, 1, 5, 6, 2, 0, 5]
    assert index_of(seq).lookup(6, 1) == [2]


def test_copy_runs_into_its_own_drafts():
    seq = [1, 2, 3, 1, 2]           # + certain 3: period 3, drafts continue the cycle
    assert index_of(seq).lookup(3, 7) == [1, 2, 3, 1, 2, 3, 1]


def test_no_match_gives_no_draft():
    assert index_of([1, 2, 3, 4]).lookup(5, 4) == []
    assert NgramIndex().lookup(1, 3) == []


def test_matches_brute_force_on_random_sequences():
    rng = random.Random(4)
    for _ in range(200):
        seq = [rng.randrange(6) for _ in range(rng.randrange(1, 60))]
        idx = index_of(seq[:-1], n_max=5, n_min=2)
        assert idx.lookup(seq[-1], 6) == brute_force(seq, 5, 2, 6), seq


def test_work_per_token_is_bounded():
    """Each append adds at most one entry per n-gram size, however long the history."""
    idx = NgramIndex(4, 2)
    rng = random.Random(0)
    for i in range(3000):
        before = sum(len(d) for d in idx.follow)
        idx.append(rng.randrange(50))
        assert sum(len(d) for d in idx.follow) - before <= 3


def test_source_follows_observed_tokens_only():
    src = NgramSource(3, 2)
    src.observe(0, [1, 2, 3, 4, 1, 2], None)
    assert src.propose(3, 6, 3).tokens == [4, 1, 2]
    src.observe(6, [3, 9], None)         # the step kept 3 and 9 (drafts 4.. rejected)
    assert src.propose(1, 8, 2).tokens == []
    src.observe(8, [1, 2], None)
    assert src.propose(3, 10, 2).tokens == [9, 1]

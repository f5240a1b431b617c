"""Prompt lookup (`--spec-type ngram-simple`): find the longest recent n-gram of prompt + output
that ends the sequence and propose what followed it.

The index maps each n-gram (n_min <= n <= n_max) to the position right after its most recent
occurrence; appending a token adds one entry per n, so the work per token is O(n_max) no matter
how long the history grows. Only committed tokens enter it (rejected drafts never do), so it
needs no rollback. Drafts are one-hot (q = delta), which the acceptance rule handles exactly.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .draft import Draft, DraftSource


class NgramIndex:
    def __init__(self, n_max: int = 4, n_min: int = 2):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes must satisfy 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_max, self.n_min = n_max, n_min
        self.tokens: list[int] = []
        self.follow: list[dict[tuple[int, ...], int]] = [dict() for _ in range(n_max + 1)]

    def append(self, token: int) -> None:
        # the n-grams that end just before `token` now have a known follower: this one
        t, j = self.tokens, len(self.tokens)
        for n in range(self.n_min, min(self.n_max, j) + 1):
            self.follow[n][tuple(t[j - n:j])] = j    # later occurrences overwrite: most recent wins
        t.append(token)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.append(token)

    def lookup(self, suffix_last: int, n_draft: int) -> list[int]:
        """Drafts to follow tokens + [suffix_last], longest matching n-gram first."""
        t, j = self.tokens, len(self.tokens)
        for n in range(min(self.n_max, j + 1), self.n_min - 1, -1):
            key = tuple(t[j - n + 1:j]) + (suffix_last,)
            # the newest occurrence may end one token earlier, followed by suffix_last itself
            # (a run such as "x x x"), which the index cannot hold yet
            start = j if j >= n and tuple(t[j - n:j]) == key else self.follow[n].get(key)
            if start is None:
                continue
            # copy what followed; a match near the end runs on into the drafts themselves
            # (period shorter than the draft: "abcabc" -> "abc...")
            out: list[int] = []
            seq_len = j + 1
            for i in range(n_draft):
                src = start + i
                out.append(t[src] if src < j else suffix_last if src == j else out[src - seq_len])
            return out
        return []


class NgramSource(DraftSource):
    name = "ngram-simple"

    def __init__(self, n_max: int = 4, n_min: int = 2):
        self.index = NgramIndex(n_max, n_min)

    def observe(self, start: int, tokens: Sequence[int], hidden: torch.Tensor | None) -> None:
        if start != len(self.index.tokens):
            raise ValueError(f"ngram index holds {len(self.index.tokens)} tokens, observed start {start}")
        self.index.extend(tokens)

    def catch_up(self) -> None:
        pass            # the index is updated as tokens are observed

    def has_match(self, certain: int) -> bool:
        """Whether propose would draft anything after `certain` (a chain asks before sizing the step)."""
        return bool(self.index.lookup(certain, 1))

    def propose(self, certain: int, pos: int, n_max: int) -> Draft:
        return Draft(self.index.lookup(certain, n_max))

"""A measuring instrument for `hybridrt bench --spec-force` and the tests: drafts whose fate is
known in advance.

It runs a real source for its cost (MTP forwards, draft-model forwards, lookups), then replaces
the proposal by the target's own greedy continuation (every draft is accepted at temp 0), by
tokens that differ from it (every draft is rejected), or by the continuation with each token
corrupted with a given probability (rejections at every offset of the window).
"""
from __future__ import annotations

import random
from typing import Sequence

import torch

from .draft import Draft, DraftSource


class ForcedSource(DraftSource):
    def __init__(self, inner: DraftSource | None, reference: Sequence[int], prompt_len: int, n_vocab: int,
                 corrupt: float = 0.0, seed: int = 0):
        """reference: the target's greedy output for this prompt (the tokens at positions
        prompt_len, prompt_len + 1, ...); corrupt: 0 forces acceptance, 1 rejection."""
        self.inner, self.reference, self.prompt_len, self.n_vocab = inner, list(reference), prompt_len, n_vocab
        self.corrupt, self.rng = corrupt, random.Random(seed)
        self.name = f"forced({inner.name if inner is not None else 'none'}, corrupt={corrupt:g})"

    def observe(self, start: int, tokens: Sequence[int], hidden: torch.Tensor | None) -> None:
        if self.inner is not None:
            self.inner.observe(start, tokens, hidden)

    def catch_up(self) -> None:
        if self.inner is not None:
            self.inner.catch_up()

    def propose(self, certain: int, pos: int, n_max: int) -> Draft:
        n = len(self.inner.propose(certain, pos, n_max)) if self.inner is not None else n_max
        first = pos + 1 - self.prompt_len          # index in `reference` of the token after `certain`
        tokens = self.reference[first:first + n]
        return Draft([(t + 1) % self.n_vocab if self.rng.random() < self.corrupt else t for t in tokens])

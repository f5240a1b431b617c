"""Several draft sources in one run (`--spec-type ngram-simple,draft-mtp`), as llama.cpp mixes an
implementation without a model with one that has one: each step asks them in order of preference and
the first that proposes anything drafts that step. Prompt lookup goes first: it costs a dictionary
lookup, proposes only where the text repeats itself, and is right there far more often than a small
head (SmolLM2's trained head: 75 % of the lookup's drafts correct at the 35 % of held-out positions
where it has one, against the head's 44 % at those positions; BENCHMARKS.md, "Speculative decoding"). The head
drafts everywhere else.

Every source sees every committed token (`observe`), whichever drafted, so each keeps its own
state (the MTP KV, the n-gram index) as it would alone. A model source skipped for a step defers
those tokens and writes them with its next proposal, as after a plain step. With adaptive length
each source has its own policy, the model source's confidence gate on its own picker
(`loop.length_policies`).
"""
from __future__ import annotations

from typing import Sequence

import torch

from .draft import Draft, DraftSource


class DraftChain(DraftSource):
    def __init__(self, sources: Sequence[DraftSource]):
        if len(sources) < 2:
            raise ValueError("a draft chain needs at least two sources")
        self.sources = list(sources)
        self.name = ",".join(s.name for s in self.sources)

    def observe(self, start: int, tokens: Sequence[int], hidden: torch.Tensor | None) -> None:
        for s in self.sources:
            s.observe(start, tokens, hidden)

    def catch_up(self) -> None:
        for s in self.sources:
            s.catch_up()

    def members(self) -> Sequence[DraftSource]:
        return self.sources

    def has_match(self, certain: int) -> bool:
        return any(s.has_match(certain) for s in self.sources)

    def drafter(self, certain: int) -> str:
        """The source that drafts after `certain` (given room for a draft): the first lookup with a
        match, else the model source. The loop sizes the step with that source's length policy."""
        for s in self.sources:
            if s.has_match(certain):
                return s.name
        return self.sources[-1].name

    def propose(self, certain: int, pos: int, n_max: int) -> Draft:
        draft = Draft()
        for s in self.sources:
            draft = s.propose(certain, pos, n_max)
            if len(draft) or draft.gated:       # a gated model draft: its refused row is judged too
                draft.source = s.name
                return draft
        return draft

"""What a draft source is to the decoding loop, and how a model-based source turns its logits
into draft tokens (argmax at temp 0; a sample of the transformed distribution q at temp > 0).

A source sees the committed sequence through `observe` (tokens the target has evaluated and kept,
with the target's final hidden states) and proposes up to n tokens to follow the certain token.
It never commits anything itself: what the target rejects simply never reaches `observe`, so a
source's own state (MTP KV, draft-model KV, n-gram index) only has to stay consistent with it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import numpy as np
import torch

from ..sampling import SamplerConfig, argmax_rows, filtered_probs

if TYPE_CHECKING:
    from ..constraint import Constraint


@dataclass
class Draft:
    """Proposed tokens and, for sampled drafts, the distribution each was drawn from (one row of
    `filtered_probs` per token: candidate ids [m] and probabilities [m]). q None means one-hot.
    `conf`: the top-1 probability of each draft's row, where a picker gate asked for it; `refused`:
    one more row was computed but the gate turned its token down (what it would have proposed).
    `source`: which source of a chain (draft_chain.py) proposed it, for the per-source figures."""
    tokens: list[int] = field(default_factory=list)
    q_ids: list[torch.Tensor] | None = None
    q_probs: list[torch.Tensor] | None = None
    conf: list[float] = field(default_factory=list)
    refused: "RefusedDraft | None" = None
    source: str = ""

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def gated(self) -> bool:
        return self.refused is not None

    def cut(self, n: int) -> "Draft":
        """The first n drafts (itself when that is all of them): a lookup's proposal up to the first
        token a constraint forbids. A refused draft no longer follows the last kept one."""
        if n >= len(self.tokens):
            return self
        return Draft(self.tokens[:n], None if self.q_ids is None else self.q_ids[:n],
                     None if self.q_probs is None else self.q_probs[:n], self.conf[:n], None, self.source)


ONE = torch.ones(1)     # a greedy draft's q: its argmax with probability 1 (never written)


@dataclass
class RefusedDraft:
    """A draft the confidence gate turned down: its row's top-1 probability and the distribution q
    it would have been drawn from (ids [m], probs [m]; at temp 0 the argmax with probability 1).
    When every kept draft is accepted, the verify's last row is the target's row at its position,
    so the loop can still judge it (adaptive.py learns the gate's calibration from these too)."""
    conf: float
    ids: torch.Tensor
    probs: torch.Tensor


class DraftSource(Protocol):
    """What the generation loop (generate.py, loop.py) uses of a source, and nothing else. The
    sources subclass it for the defaults below: a single source that always drafts and whose
    drafts are not weighed (a lookup's); a model source sets `picker`, a lookup overrides
    `has_match`, a chain `members` and `drafter`."""
    name: str
    # where adaptive length installs its confidence gate (loop.length_policies): a model source's
    # DraftPicker; None: the drafts carry no probability to weigh (a lookup's, forced ones)
    picker: DraftPicker | None = None

    def observe(self, start: int, tokens: Sequence[int], hidden: torch.Tensor | None) -> None:
        """The target evaluated and kept `tokens` at positions [start, start + n); `hidden` holds
        its final-normed hidden state of each (rows [n, n_embd]). Calls cover every position once,
        in order, starting at 0."""

    def catch_up(self) -> None:
        """Process what observe() has deferred (a model source evaluates committed tokens in one
        batch with its next proposal). The loop calls it before a proposal that follows a run of
        plain steps and times it apart, so a draft's measured cost does not grow with the plain
        steps before it (which made probing drafts look too dear to ever pay)."""

    def propose(self, certain: int, pos: int, n_max: int) -> Draft:
        """Up to n_max tokens to follow `certain`, the token known to come at position `pos`."""

    def has_match(self, certain: int) -> bool:
        """Whether propose() could draft anything after `certain`: a chain asks before sizing the
        step, so that a lookup without a match leaves the step to the next source."""
        return True

    def members(self) -> Sequence[DraftSource]:
        """The sources that draft, each learning its own length policy (loop.length_policies): a
        chain's, else the source itself."""
        return (self,)

    def drafter(self, certain: int) -> str:
        """The name of the member that drafts after `certain` (given room): its length policy sizes
        the step."""
        return self.name


def argmax_top1(logits_row: torch.Tensor) -> tuple[int, float]:
    """A logits row's argmax (the first, as argmax_rows) and its softmax probability. numpy on a
    CPU float32 row: torch's softmax and max were ~7 us of every gated draft, this ~4 us."""
    if logits_row.device.type == "cpu" and logits_row.dtype == torch.float32:
        row = logits_row.detach().numpy()
        best = int(row.argmax())
        return best, 1.0 / float(np.exp(row - row[best]).sum())
    best = argmax_rows(logits_row)[0]
    return best, float(torch.softmax(logits_row.float(), dim=-1)[best])


class DraftPicker:
    """Chooses each draft token from a draft model's (or MTP head's) logits row.

    temp 0: the argmax (q one-hot). temp > 0: a sample from filtered_probs under the same
    SamplerConfig as the target, and q is that distribution, so acceptance is min(1, p/q).
    `p_min` ends the draft at the first position whose top-1 probability is below it. `gate`
    (set by the adaptive length policy): gate(i, top-1 probability) decides whether draft i is
    worth its place in the verify batch; a refusal ends the draft too. Neither changes which
    token a kept draft is, so outputs stay exact. `worth` (set with the gate): worth(i) decides,
    before a source computes row i >= 1, whether it could pay even if the head were sure of it.
    `constraint` (set by the loop for a constrained generation, speculative/loop.py): each row is
    masked with the constraint's state after the drafts before it and the chosen token advances
    it, so a draft the grammar forbids is never proposed and q is the masked distribution."""

    def __init__(self, cfg: SamplerConfig, gen: torch.Generator, p_min: float = 0.0,
                 gate: Callable[[int, float], bool] | None = None):
        self.cfg, self.gen, self.p_min, self.gate = cfg, gen, p_min, gate
        self.worth: Callable[[int], bool] | None = None
        self.constraint: "Constraint | None" = None

    def wants(self, i: int) -> bool:
        """Whether to compute the row of draft i (i >= 1) at all (not after a draft that completes
        the grammar: only an end-of-generation token could follow)."""
        c = self.constraint
        return (self.worth is None or self.worth(i)) and (c is None or not c.finished(c.depth))

    def _admit(self, draft: Draft, top1: float, ids: torch.Tensor, probs: torch.Tensor) -> bool:
        if top1 < self.p_min:
            return False
        if self.gate is not None:
            if not self.gate(len(draft.tokens), top1):
                draft.refused = RefusedDraft(top1, ids, probs)
                return False
            draft.conf.append(top1)
        return True

    def start(self) -> Draft:
        return Draft([], None, None) if self.cfg.greedy else Draft([], [], [])

    def add(self, draft: Draft, logits_row: torch.Tensor, row_ids: torch.Tensor | None = None) -> bool:
        """Append a token chosen from logits_row [V]; False (nothing appended) when p_min stops it
        or the constraint allows none of the row's tokens. `row_ids`: the token id of each row (a
        draft vocabulary's head), None for the whole vocabulary; the appended draft is a row index."""
        c = self.constraint
        if c is not None and not c.apply(logits_row, row_ids):
            return False
        if not self._choose(draft, logits_row):
            return False
        if c is not None:
            row = draft.tokens[-1]
            c.advance(row if row_ids is None else int(row_ids[row]))
        return True

    def _choose(self, draft: Draft, logits_row: torch.Tensor) -> bool:
        if self.cfg.greedy:
            if self.p_min > 0.0 or self.gate is not None:
                best, top1 = argmax_top1(logits_row)
                if not self._admit(draft, top1, torch.tensor([best]), ONE):
                    return False
                draft.tokens.append(best)
                return True
            draft.tokens.append(argmax_rows(logits_row)[0])
            return True
        ids, probs = filtered_probs(logits_row.unsqueeze(0), self.cfg)
        ids, probs = ids[0], probs[0]
        if not self._admit(draft, float(probs[0]), ids, probs):      # rows are sorted: probs[0] is the top-1
            return False
        choice = torch.multinomial(probs, 1, generator=self.gen)
        draft.tokens.append(int(ids[choice]))
        draft.q_ids.append(ids)
        draft.q_probs.append(probs)
        return True

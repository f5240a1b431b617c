"""The speculative step of the generation loop (generate.py), one for every draft source.

Each step starts from a certain token c at position P (drawn from the logits of P - 1: it is never
drawn again). The source proposes drafts d1..dn after c, and ONE target forward over
[c, d1, ..., dn] at [P, P + n] yields logits at every position: row i verifies d(i+1), and the
row after the last kept draft gives the next certain token (the correction after a rejection, or
the bonus token). There is no separate commit pass. Rollback after keeping a drafts is
`session.truncate(P + 1 + a)`: attention KV by length, recurrent state from the snapshot ring.
Only kept tokens are shown to the source, so its state follows the committed sequence.

A stop token, a complete grammar or the -n cap inside the kept window ends generation there, and
the target (and through `observe`, the source) is rewound to the last emitted token. Without a
source the loop takes no such step: a plain step is one forward of c.

Under a constraint (constraint.py) the drafts are proposed under it (a model source's picker masks
each row with the state after the drafts before it; a lookup's drafts are cut at the first one the
grammar forbids), verify row i is masked with the state after c and d1..di, acceptance runs on the
masked rows as on any others, and the constraint rolls back to the kept tokens with the KV. Every
row a kept token or the next certain token comes from is then the row plain constrained decoding
draws it from, so greedy output is plain constrained decoding's and sampled output keeps its
distribution.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...errors import UserError
from ...models.base import Model
from ..sampling import SamplerConfig
from ...runtime.session import Session
from ...runtime.trace import Tracer, maybe_span
from .acceptance import SampledAcceptor, Verdict, accept_greedy
from .adaptive import DraftLengthPolicy
from .draft import Draft, DraftSource
from .stats import SpecStats

if TYPE_CHECKING:
    from ..constraint import Constraint
    from ..generate import Output

# plain steps after which a source's deferred work is done apart from the next proposal (and not
# counted as its cost): fewer go in one batch with it, as after a drafting step
CATCH_UP_AFTER = 4


@dataclass(frozen=True)
class SpecConfig:
    n_max: int = 3          # --spec-draft-n-max: most drafts per step
    n_min: int = 0          # --spec-draft-n-min: a shorter proposal is dropped (plain step)
    p_min: float = 0.0      # --spec-draft-p-min: model drafts stop below this top-1 probability
    adaptive: bool = False  # choose each step's length within n_max (speculative/adaptive.py)
    gate: bool = True       # adaptive only: weigh each model draft by its confidence (adaptive.py)

    def __post_init__(self):
        if self.n_max < 0 or self.n_min < 0:
            raise UserError("--spec-draft-n-max and --spec-draft-n-min must be >= 0")
        if not 0.0 <= self.p_min <= 1.0:
            raise UserError("--spec-draft-p-min must be in [0, 1]")
        if self.n_min > self.n_max:
            raise UserError(f"--spec-draft-n-min {self.n_min} is above --spec-draft-n-max {self.n_max}: "
                            "no proposal could be kept")

    @property
    def k_max(self) -> int:
        """Largest verify batch: the certain token plus n_max drafts."""
        return self.n_max + 1


def length_policies(source: DraftSource | None, spec: SpecConfig,
                    kept: dict[str, DraftLengthPolicy] | None = None) -> dict[str, DraftLengthPolicy]:
    """Adaptive length: a policy per source that may draft, keyed by its name. A chain's lookup and
    its model source each learn their own acceptance and draft cost (SmolLM2: the lookup's drafts
    67 % accepted and free, the head's 38 % at 12 % of a step each): one policy over both sized the
    head's steps by the lookup's acceptance and priced the head's rows at the lookup's cost. A model
    source's drafts are each weighed by their confidence (its picker's gate, adaptive.py).
    `kept`: policies of earlier sequences to continue (DraftLengthPolicy.new_run), by source name;
    new ones are added to it."""
    if not spec.adaptive or source is None:
        return {}
    policies = {}
    for s in source.members():
        policy = kept.get(s.name) if kept is not None else None
        if policy is not None and policy.n_max == spec.n_max:
            policy.new_run()
        else:
            policy = DraftLengthPolicy(spec.n_max)
            if kept is not None:
                kept[s.name] = policy
        policies[s.name] = policy
        policy.gating = s.picker is not None and spec.gate
        if policy.gating:
            s.picker.gate, s.picker.worth = policy.keep_draft, policy.worth_row
    return policies


class Speculation:
    """The steps of one generation with a draft source: propose, verify in one forward, accept,
    roll back what was not kept, show the source the kept tokens; `step` is one of them, `finish`
    completes the figures (SpecStats). Holds the verify buffer (`logits`, spec.k_max rows) that
    the prompt's last row is written into as well. `constraint`: the generation's (None: none); its
    state is the emitted tokens' when a step starts and ends."""

    def __init__(self, model: Model, session: Session, source: DraftSource, spec: SpecConfig,
                 sampler: SamplerConfig, gen: torch.Generator, trace: Tracer | None = None,
                 policies: dict[str, DraftLengthPolicy] | None = None, constraint: "Constraint | None" = None):
        if session.k_max < spec.k_max:
            raise UserError(f"the session's k_max {session.k_max} is below --spec-draft-n-max + 1 = {spec.k_max}")
        self.session, self.source, self.spec, self.sampler, self.trace = session, source, spec, sampler, trace
        self.accept = (lambda logits, draft: accept_greedy(logits, draft.tokens)) if sampler.greedy \
            else SampledAcceptor(model.n_vocab, sampler, gen)
        self.stats = SpecStats(source.name, spec.n_max)
        self.logits = torch.empty(spec.k_max, model.n_vocab)
        self.policies = length_policies(source, spec, policies)
        self.plain_run = CATCH_UP_AFTER     # steps since the last one that verified drafts (the prompt: many)
        self.no_draft = Draft()
        self.constraint = constraint
        for s in source.members():          # model sources draft under the constraint's masks
            if s.picker is not None:
                s.picker.constraint = constraint

    def step(self, certain: int, out: "Output") -> tuple[int, torch.Tensor] | None:
        """One step from the emitted certain token at the session's end: the next certain token and
        the logits row it was drawn from, or None when a stop rule ended the generation inside the
        kept window (out.stats.stopped_by says which)."""
        session, source, spec, stats = self.session, self.source, self.spec, self.stats
        pos = session.n_past
        # a chain's drafter this step: its first source with something to propose (a lookup: a match)
        policy = self.policies.get(source.drafter(certain)) if self.policies else None
        if policy is not None:
            policy.share(session.sharing)
        chosen = policy.choose() if policy is not None else spec.n_max
        # drafts past the -n cap or the context could never be emitted
        room = min(chosen, session.n_ctx - pos - 1)
        if out.room >= 0:
            room = min(room, out.room)

        if room > 0 and self.plain_run >= CATCH_UP_AFTER:
            # what the source deferred over the prompt and a run of plain steps: not this draft's
            # cost (after a drafting step, or a few plain ones, the deferred tokens go in one batch
            # with the proposal, and count in it)
            source.catch_up()
        constraint = self.constraint
        base = constraint.depth if constraint is not None else 0     # the emitted tokens, c the last
        t0 = time.perf_counter()
        with maybe_span(self.trace, "draft", "spec"):
            draft = source.propose(certain, pos, room) if room > 0 else self.no_draft
            if constraint is not None:
                draft = draft.cut(constraint.follow(base, draft.tokens))
        gated = draft.gated         # a row computed, its token turned down by the confidence gate
        if 0 < len(draft) < spec.n_min:
            draft = self.no_draft   # too short: a plain step (and a refused draft after it goes unjudged)
            if constraint is not None:
                constraint.rollback_to(base)
        t1 = time.perf_counter()
        with maybe_span(self.trace, f"verify {1 + len(draft)}", "spec"):
            logits = session.eval([certain] + draft.tokens, start_pos=pos, logits="all", out=self.logits)
            if constraint is not None:
                constraint.mask_rows(logits, base, len(draft) + 1)
        t2 = time.perf_counter()
        verdict: Verdict = self.accept(logits, draft)
        refused = None
        if draft.refused is not None and verdict.n_accepted == len(draft):
            # the last row is the target's at the refused draft's position: judge it for the gate
            r = draft.refused
            chance = float(verdict.next_token == int(r.ids[0])) if self.sampler.greedy \
                else self.accept.acceptance_chance(r.ids, r.probs)
            refused = (r.conf, chance)

        # emit the kept drafts up to a stop token or the cap; the rest of the window is undone
        kept = draft.tokens[:verdict.n_accepted]
        n_before = len(out.tokens)
        for i, token in enumerate(kept):
            if out.emit(token, logits[i]):      # row i verified draft i + 1
                break
        n_emit = len(out.tokens) - n_before
        if session.n_past > pos + 1 + n_emit:
            session.truncate(pos + 1 + n_emit)
        if constraint is not None:
            constraint.rollback_to(base + n_emit)
        source.observe(pos, [certain] + kept[:n_emit], session.hidden[:1 + n_emit])
        self.plain_run = 0 if len(draft) else self.plain_run + 1
        stats.record(len(draft), verdict.n_accepted, chosen, draft.source)
        if policy is not None:
            # a step's cost is everything after its draft: the verify and what the loop does with it
            # (acceptance, rollback, showing the source the kept tokens; 0.09 ms of a SmolLM2 step,
            # 0.26 ms of a Gemma 3 one with its 262k-wide rows), not the verify alone
            policy.observe(len(draft), verdict.n_accepted, time.perf_counter() - t1, t1 - t0, draft.conf, gated,
                           refused)
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        if out.stats.stopped_by:
            return None
        if constraint is not None:
            constraint.advance(verdict.next_token)
        return verdict.next_token, logits[verdict.n_accepted]

    def finish(self, decode_s: float) -> SpecStats:
        """The figures, once the generation's decode time is known (the rest of it: `other_s`)."""
        self.stats.other_s = max(0.0, decode_s - self.stats.draft_s - self.stats.verify_s)
        return self.stats


"""The speculative decoding loop, one for every draft source (and for none).

Each step starts from a certain token c at position P (drawn from the logits of P - 1: it is never
drawn again). The source proposes drafts d1..dn after c, and ONE target forward over
[c, d1, ..., dn] at [P, P + n] yields logits at every position: row i verifies d(i+1), and the
row after the last kept draft gives the next certain token (the correction after a rejection, or
the bonus token). There is no separate commit pass. Rollback after keeping a drafts is
`session.truncate(P + 1 + a)`: attention KV by length, recurrent state from the snapshot ring.
Only kept tokens are shown to the source, so its state follows the committed sequence.

A stop token or the -n cap inside the kept window ends generation there, and the target (and
through `observe`, the source) is rewound to the last emitted token.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import UserError
from ..generate import GenerationStats, Output, visit_prompt_rows
from ..models.base import Model
from ..sampling import SamplerConfig, make_generator, sample_token
from ..session import PROMPT_CHUNK, Session
from ..trace import Tracer, maybe_span
from .acceptance import SampledAcceptor, Verdict, accept_greedy
from .adaptive import DraftLengthPolicy
from .draft import Draft, DraftSource
from .stats import SpecStats

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
    for s in getattr(source, "sources", [source]):
        policy = kept.get(s.name) if kept is not None else None
        if policy is not None and policy.n_max == spec.n_max:
            policy.new_run()
        else:
            policy = DraftLengthPolicy(spec.n_max)
            if kept is not None:
                kept[s.name] = policy
        policies[s.name] = policy
        picker = getattr(s, "picker", None)
        policy.gating = picker is not None and spec.gate
        if policy.gating:
            picker.gate, picker.worth = policy.keep_draft, policy.worth_row
    return policies


def prefill(session: Session, prompt_ids: list[int], source: DraftSource | None,
            out: torch.Tensor, visit: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
    """Evaluate the prompt chunk by chunk, showing each chunk's hiddens to the source, which then
    processes the whole prompt (its share of prompt time, not of the first draft's); returns the
    logits row of the last prompt token. `visit` as `generate.prefill`'s."""
    if not prompt_ids:
        raise UserError("empty prompt")
    if session.n_past:
        session.truncate(0)
    for lo in range(0, len(prompt_ids), PROMPT_CHUNK):
        chunk = prompt_ids[lo:lo + PROMPT_CHUNK]
        last = lo + PROMPT_CHUNK >= len(prompt_ids)
        if visit is None:
            logits = session.eval(chunk, start_pos=lo, logits="last" if last else "none", out=out)
        else:
            rows = session.eval(chunk, start_pos=lo, logits="all")
            visit_prompt_rows(visit, lo, rows, len(prompt_ids))
            if last:
                logits = out[:1].copy_(rows[-1:])
        if source is not None:
            source.observe(lo, chunk, session.hidden)
    if source is not None:
        source.catch_up()
    return logits[0]


def speculative_generate(model: Model, session: Session, prompt_ids: list[int], n_predict: int,
                         sampler: SamplerConfig, source: DraftSource | None, spec: SpecConfig = SpecConfig(),
                         on_token: Callable[[int], None] | None = None, stop_ids: set[int] | None = None,
                         gen: torch.Generator | None = None, trace: Tracer | None = None,
                         on_logits: Callable[[int, torch.Tensor], None] | None = None,
                         on_prompt_row: Callable[[int, torch.Tensor], None] | None = None,
                         policies: dict[str, DraftLengthPolicy] | None = None) -> tuple[list[int], GenerationStats]:
    """Generate up to n_predict tokens (< 0: until a stop token or a full context) with drafts
    from `source` (None: plain decoding through the same loop). Output and stopping rules are
    those of `generate.generate` (a true return from `on_token` stops there too, and
    `on_logits(token, row)` sees each token's target logits row just before it, `on_prompt_row`
    the prompt's rows as `generate.prefill`'s `visit`); at temp 0 the
    tokens are identical to it. `source` must be fresh (it follows this one sequence) and
    `session.k_max` at least spec.k_max. `policies`: adaptive length's policies to continue from
    earlier sequences and keep learning in (`length_policies`' `kept`; a server keeps one such
    dict per session); None: fresh ones."""
    stop_ids = model.tokenizer.eog_ids if stop_ids is None else stop_ids
    if session.k_max < spec.k_max:
        raise UserError(f"the session's k_max {session.k_max} is below --spec-draft-n-max + 1 = {spec.k_max}")
    gen = make_generator(sampler.seed) if gen is None else gen
    accept = (lambda logits, draft: accept_greedy(logits, draft.tokens)) if sampler.greedy \
        else SampledAcceptor(model.n_vocab, sampler, gen)
    stats = GenerationStats(n_prompt=len(prompt_ids))
    spec_stats = SpecStats(source.name if source is not None else "none", spec.n_max)
    stats.spec = spec_stats
    logits_buf = torch.empty(spec.k_max, model.n_vocab)     # every verify writes into this
    no_draft = Draft()
    plain_run = CATCH_UP_AFTER  # steps since the last one that verified drafts (the prompt: many)
    policies = length_policies(source, spec, policies)

    t0 = time.perf_counter()
    certain_row = prefill(session, prompt_ids, source, logits_buf, on_prompt_row)    # the row `certain` came from
    certain = sample_token(certain_row, sampler, gen)
    stats.prompt_s = time.perf_counter() - t0

    out = Output(stats, stop_ids, n_predict, on_token, on_logits)
    t_start = time.perf_counter()
    while True:
        if n_predict == 0:
            stats.stopped_by = "n_predict"
            break
        if out.emit(certain, certain_row):
            break
        pos = session.n_past
        if pos >= session.n_ctx:
            stats.stopped_by = "context"
            break
        # a chain's drafter this step: its first source with something to propose (a lookup: a match)
        policy = policies.get(source.drafter(certain) if hasattr(source, "drafter") else source.name) \
            if policies else None
        chosen = policy.choose() if policy is not None else spec.n_max
        # drafts past the -n cap or the context could never be emitted
        room = min(chosen, session.n_ctx - pos - 1)
        if n_predict >= 0:
            room = min(room, n_predict - len(out.tokens))

        if source is not None and room > 0 and plain_run >= CATCH_UP_AFTER:
            # what the source deferred over the prompt and a run of plain steps: not this draft's
            # cost (after a drafting step, or a few plain ones, the deferred tokens go in one batch
            # with the proposal, and count in it)
            source.catch_up()
        t0 = time.perf_counter()
        with maybe_span(trace, "draft", "spec"):
            draft = source.propose(certain, pos, room) if source is not None and room > 0 else no_draft
        gated = draft.gated         # a row computed, its token turned down by the confidence gate
        if 0 < len(draft) < spec.n_min:
            draft = no_draft    # too short: a plain step (and a refused draft after it goes unjudged)
        t1 = time.perf_counter()
        with maybe_span(trace, f"verify {1 + len(draft)}", "spec"):
            logits = session.eval([certain] + draft.tokens, start_pos=pos, logits="all", out=logits_buf)
        t2 = time.perf_counter()
        verdict: Verdict = accept(logits, draft)
        refused = None
        if draft.refused is not None and verdict.n_accepted == len(draft):
            # the last row is the target's at the refused draft's position: judge it for the gate
            r = draft.refused
            chance = float(verdict.next_token == int(r.ids[0])) if sampler.greedy \
                else accept.acceptance_chance(r.ids, r.probs)
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
        if source is not None:
            source.observe(pos, [certain] + kept[:n_emit], session.hidden[:1 + n_emit])
        plain_run = 0 if len(draft) else plain_run + 1
        spec_stats.record(len(draft), verdict.n_accepted, chosen, draft.source)
        if policy is not None:
            # a step's cost is everything after its draft: the verify and what the loop does with it
            # (acceptance, rollback, showing the source the kept tokens; 0.09 ms of a SmolLM2 step,
            # 0.26 ms of a Gemma 3 one with its 262k-wide rows), not the verify alone
            policy.observe(len(draft), verdict.n_accepted, time.perf_counter() - t1, t1 - t0, draft.conf, gated,
                           refused)
        spec_stats.draft_s += t1 - t0
        spec_stats.verify_s += t2 - t1
        if stats.stopped_by:
            break
        certain, certain_row = verdict.next_token, logits[verdict.n_accepted]
    stats.decode_s = time.perf_counter() - t_start
    spec_stats.other_s = max(0.0, stats.decode_s - spec_stats.draft_s - spec_stats.verify_s)
    stats.n_decode = out.n_decode
    return out.tokens, stats

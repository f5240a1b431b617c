"""The generation engine: prefill the prompt, then one decode loop, with a draft source or without.

Plain decoding is speculation with no draft source. Every step starts from a certain token c at
position P, drawn from the logits of P - 1 and never drawn again: it is emitted (or ends the
generation), then the target runs at P. Without a source that is one forward of c, and the next
certain token is drawn from its row; with one, `speculative.loop.Speculation` has the source
propose drafts after c, verifies them in one forward and keeps what the acceptance rule keeps
(greedy: token for token plain decoding's output; sampled: the same distribution). Under a
constraint (constraint.py) every row a token is drawn from is masked with the grammar's state
before that token, drafts and verify rows included, so the same holds of constrained decoding. The
stop rules (an end-of-generation token, a complete grammar, the -n cap, the caller's `on_token`, a
full context) and the figures (`GenerationStats`) are this module's alone.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from placement.constants import PROMPT_CHUNK

from ..errors import UserError
from ..models.base import Model
from .sampling import SamplerConfig, make_generator, sample_token
from ..runtime.session import Session
from .speculative.loop import SpecConfig, Speculation

if TYPE_CHECKING:
    from .constraint import Constraint
    from .speculative.adaptive import DraftLengthPolicy
    from .speculative.draft import DraftSource
    from .speculative.stats import SpecStats
    from ..runtime.trace import Tracer


@dataclass
class GenerationStats:
    n_prompt: int = 0
    prompt_s: float = 0.0
    n_decode: int = 0            # tokens produced after the first one (llama.cpp's "eval" count)
    decode_s: float = 0.0
    stopped_by: str = ""         # "eog", "grammar" (complete: only an end-of-generation token could
                                 # follow), "n_predict", "context" or "callback" (on_token said stop)
    extra: dict = field(default_factory=dict)
    spec: "SpecStats | None" = None     # the draft source's figures (None: no source)

    @property
    def prompt_tps(self) -> float:
        return self.n_prompt / self.prompt_s if self.prompt_s else 0.0

    @property
    def decode_tps(self) -> float:
        return self.n_decode / self.decode_s if self.decode_s else 0.0


@dataclass
class Output:
    """The tokens a generation emits and the rules that end it: an end-of-generation token (not
    emitted), a complete grammar (the constraint has consumed each token before it is emitted),
    the -n cap, or `on_token` asking to stop. The context's end is the loop's to check: it knows
    the position of its next forward."""
    stats: GenerationStats
    stop_ids: set[int]
    n_predict: int
    on_token: Callable[[int], None] | None = None
    on_logits: Callable[[int, torch.Tensor], None] | None = None
    constraint: "Constraint | None" = None
    tokens: list[int] = field(default_factory=list)

    def emit(self, token: int, row: torch.Tensor) -> bool:
        """Emit `token`, drawn from the target's logits `row`, unless it ends the generation; True
        when the generation ends here (stats.stopped_by says why)."""
        if token in self.stop_ids:
            self.stats.stopped_by = "eog"
            return True
        self.tokens.append(token)
        if self.on_logits is not None:
            self.on_logits(token, row)
        if self.on_token is not None and self.on_token(token):
            self.stats.stopped_by = "callback"
            return True
        if self.constraint is not None and self.constraint.finished(len(self.tokens)):
            self.stats.stopped_by = "grammar"
            return True
        if 0 <= self.n_predict <= len(self.tokens):
            self.stats.stopped_by = "n_predict"
            return True
        return False

    @property
    def room(self) -> int:
        """Tokens the -n cap still allows (-1: no cap)."""
        return self.n_predict - len(self.tokens) if self.n_predict >= 0 else -1

    @property
    def n_decode(self) -> int:
        """The forwards decode speed counts: the first token came from the prompt's logits, and each
        emitted token had a forward after it but the last, unless an end-of-generation token
        (drawn from the last one's forward) ended the generation."""
        n = len(self.tokens)
        return n if self.stats.stopped_by == "eog" else max(0, n - 1)


def prefill(session: Session, prompt_ids: list[int], source: "DraftSource | None" = None,
            out: torch.Tensor | None = None, visit: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
    """Evaluate the prompt from position 0, chunk by chunk; returns the logits row of its last token
    (in `out` when given). A draft source sees each chunk's hiddens, then processes the whole
    prompt (its share of prompt time, not of the first draft's). `visit(i, row)`, if given, sees
    the row that predicts prompt token i (the logits of position i - 1) for i = 1 .. n - 1: the
    prompt's own log-likelihood, as an OpenAI `echo` + `logprobs` request asks; chunk by chunk, so
    the rows of a long prompt are never all held at once."""
    if len(prompt_ids) == 0:
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
            for j in range(rows.shape[0]):      # the last prompt token's row predicts no prompt token
                if lo + j + 1 < len(prompt_ids):
                    visit(lo + j + 1, rows[j])
            if last:
                logits = rows[-1:] if out is None else out[:1].copy_(rows[-1:])
        if source is not None:
            source.observe(lo, chunk, session.hidden)
    if source is not None:
        source.catch_up()
    return logits[0]


def draw(row: torch.Tensor, sampler: SamplerConfig, gen: torch.Generator, constraint: "Constraint | None") -> int:
    """The next token from the target's row (masked in place under a constraint, which then
    consumes it)."""
    token = sample_token(row, sampler, gen, constraint)
    if constraint is not None:
        constraint.advance(token)
    return token


def generate(model: Model, session: Session, prompt_ids: list[int], n_predict: int, sampler: SamplerConfig,
             source: "DraftSource | None" = None, spec: SpecConfig | None = None, *,
             on_token: Callable[[int], bool | None] | None = None, stop_ids: set[int] | None = None,
             gen: torch.Generator | None = None, trace: "Tracer | None" = None,
             on_logits: Callable[[int, torch.Tensor], None] | None = None,
             on_prompt_row: Callable[[int, torch.Tensor], None] | None = None,
             policies: "dict[str, DraftLengthPolicy] | None" = None,
             between_steps: Callable[[], None] | None = None,
             constraint: "Constraint | None" = None) -> tuple[list[int], GenerationStats]:
    """Generate up to n_predict tokens (n_predict < 0: until an end-of-generation token or the
    context is full; 0: the prompt is evaluated, nothing is generated). Stop tokens (`stop_ids`,
    default the tokenizer's end-of-generation ids) are not included in the output.

    `source`: a fresh draft source for this one sequence (speculative/sources.build_source), None
    for plain decoding; `spec` its limits (default SpecConfig()), and `session.k_max` must be at
    least spec.k_max. At temp 0 the tokens are plain decoding's whatever the source; sampled, each
    seed draws what plain sampling draws wherever no draft is proposed. `policies`: adaptive
    length's policies to continue from earlier sequences and keep learning in
    (`speculative.loop.length_policies`' `kept`; a server keeps one such dict per session); None:
    fresh ones. `trace`: draft and verify spans.

    `on_token` sees each token as it is produced; a true return value stops generation there (a
    server's stop string or a client that went away). `on_logits(token, row)`, called just before
    `on_token`, sees the target's logits row the token was drawn from (valid only during the call:
    the buffer is reused); `on_prompt_row(i, row)` the prompt's rows, as `prefill`'s `visit`.
    `between_steps()` is called before each decoding step, after the last one's tokens were emitted:
    outside any step and its timed window (adaptive length times a step's draft and verify), where
    a server's sessions of one placed model hand each other the device (server/pool.py).

    `constraint`: a fresh constraint.Constraint for this sequence (None: unconstrained). Every token
    is drawn from its row masked with the grammar's state; the output ends where the grammar is
    complete (stopped_by "grammar") or at an end-of-generation token it allows."""
    stop_ids = model.tokenizer.eog_ids if stop_ids is None else stop_ids
    gen = make_generator(sampler.seed) if gen is None else gen
    stats = GenerationStats(n_prompt=len(prompt_ids))
    drafting = None if source is None else Speculation(model, session, source, spec or SpecConfig(), sampler,
                                                       gen, trace, policies, constraint)
    # every forward writes its logits into this buffer: a verify's k_max rows, or a plain step's one
    logits_buf = torch.empty(1, model.n_vocab) if drafting is None else drafting.logits

    t0 = time.perf_counter()
    row = prefill(session, prompt_ids, source, logits_buf, on_prompt_row)
    token = draw(row, sampler, gen, constraint)     # the certain token, drawn from `row`
    stats.prompt_s = time.perf_counter() - t0

    out = Output(stats, stop_ids, n_predict, on_token, on_logits, constraint)
    t0 = time.perf_counter()
    while n_predict != 0 and not out.emit(token, row):
        if session.n_past >= session.n_ctx:
            stats.stopped_by = "context"
            break
        if between_steps is not None:
            between_steps()
        if drafting is None:        # plain decoding: one forward of the certain token, nothing else
            row = session.eval([token], logits="last", out=logits_buf)[0]
            token = draw(row, sampler, gen, constraint)
        else:
            step = drafting.step(token, out)
            if step is None:        # a stop rule ended the generation inside the kept window
                break
            token, row = step
    if n_predict == 0:
        stats.stopped_by = "n_predict"
    stats.decode_s = time.perf_counter() - t0
    if drafting is not None:
        stats.spec = drafting.finish(stats.decode_s)
    stats.n_decode = out.n_decode
    return out.tokens, stats

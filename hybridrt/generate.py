"""Plain autoregressive decoding: prefill the prompt, then one token per forward.

This is the baseline every speculative mode must reproduce token for token at temp 0.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from .models.base import Model
from .sampling import SamplerConfig, make_generator, sample_token
from .session import PROMPT_CHUNK, Session

if TYPE_CHECKING:
    from .speculative.stats import SpecStats


@dataclass
class GenerationStats:
    n_prompt: int = 0
    prompt_s: float = 0.0
    n_decode: int = 0            # tokens produced after the first one (llama.cpp's "eval" count)
    decode_s: float = 0.0
    stopped_by: str = ""         # "eog", "n_predict", "context" or "callback" (on_token said stop)
    extra: dict = field(default_factory=dict)
    spec: "SpecStats | None" = None     # set by the speculative loop

    @property
    def prompt_tps(self) -> float:
        return self.n_prompt / self.prompt_s if self.prompt_s else 0.0

    @property
    def decode_tps(self) -> float:
        return self.n_decode / self.decode_s if self.decode_s else 0.0


@dataclass
class Output:
    """The tokens a generation emits and the rules that end it, one place for plain and speculative
    decoding alike: an end-of-generation token (not emitted), the -n cap, or `on_token` asking to
    stop. The context's end is the caller's to check: it knows the position of its next forward."""
    stats: GenerationStats
    stop_ids: set[int]
    n_predict: int
    on_token: Callable[[int], None] | None = None
    on_logits: Callable[[int, torch.Tensor], None] | None = None
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
        if 0 <= self.n_predict <= len(self.tokens):
            self.stats.stopped_by = "n_predict"
            return True
        return False

    @property
    def n_decode(self) -> int:
        """The forwards decode speed counts: the first token came from the prompt's logits, and each
        emitted token had a forward after it but the last, unless an end-of-generation token
        (drawn from the last one's forward) ended the generation."""
        n = len(self.tokens)
        return n if self.stats.stopped_by == "eog" else max(0, n - 1)


def prefill(session: Session, prompt_ids: list[int], out: torch.Tensor | None = None,
            visit: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
    """Evaluate the prompt; returns the logits row of its last token (in `out` when given).
    `visit(i, row)`, if given, sees the row that predicts prompt token i (the logits of position
    i - 1) for i = 1 .. n - 1: the prompt's own log-likelihood, as an OpenAI `echo` + `logprobs`
    request asks; chunk by chunk, so the rows of a long prompt are never all held at once."""
    if visit is None:
        return session.eval(prompt_ids, start_pos=0, logits="last", out=out)[0]
    if session.n_past:
        session.truncate(0)
    for lo in range(0, len(prompt_ids), PROMPT_CHUNK):
        rows = session.eval(prompt_ids[lo:lo + PROMPT_CHUNK], start_pos=lo, logits="all")
        visit_prompt_rows(visit, lo, rows, len(prompt_ids))
    last = rows[-1]
    return last if out is None else out[0].copy_(last)


def visit_prompt_rows(visit: Callable[[int, torch.Tensor], None], lo: int, rows: torch.Tensor, n_prompt: int) -> None:
    """visit(i, row) for the rows of a prompt chunk starting at `lo`, i the prompt token each row
    predicts (the last prompt token's row predicts no prompt token)."""
    for j in range(rows.shape[0]):
        if lo + j + 1 < n_prompt:
            visit(lo + j + 1, rows[j])


def generate(model: Model, session: Session, prompt_ids: list[int], n_predict: int,
             sampler: SamplerConfig, on_token: Callable[[int], None] | None = None,
             stop_ids: set[int] | None = None,
             on_logits: Callable[[int, torch.Tensor], None] | None = None,
             on_prompt_row: Callable[[int, torch.Tensor], None] | None = None) -> tuple[list[int], GenerationStats]:
    """Generate up to n_predict tokens (n_predict < 0: until an end-of-generation token or the
    context is full). Stop tokens are not included in the output. `on_token` sees each token as
    it is produced; a true return value stops generation there (a server's stop string or a
    client that went away). `on_logits(token, row)`, called just before `on_token`, sees the
    target's logits row the token was drawn from (valid only during the call: the buffer is reused);
    `on_prompt_row(i, row)` the prompt's rows, as `prefill`'s `visit`."""
    stop_ids = model.tokenizer.eog_ids if stop_ids is None else stop_ids
    gen = make_generator(sampler.seed)
    stats = GenerationStats(n_prompt=len(prompt_ids))
    logits_buf = torch.empty(1, model.n_vocab)

    t0 = time.perf_counter()
    logits = prefill(session, prompt_ids, out=logits_buf, visit=on_prompt_row)
    stats.prompt_s = time.perf_counter() - t0

    out = Output(stats, stop_ids, n_predict, on_token, on_logits)
    t0 = time.perf_counter()
    while n_predict != 0:
        token = sample_token(logits, sampler, gen)
        if out.emit(token, logits):
            break
        if session.n_past >= session.n_ctx:
            stats.stopped_by = "context"
            break
        logits = session.eval([token], logits="last", out=logits_buf)[0]
    else:
        stats.stopped_by = "n_predict"     # -n 0: the prompt is evaluated, nothing is generated
    stats.decode_s = time.perf_counter() - t0
    stats.n_decode = out.n_decode
    return out.tokens, stats

"""A decoding session: one sequence's caches and position, and the single `eval` entry point that
serves prefill, decode and k-token verify alike; `eval_batch` runs several sessions' evals in shared
steps."""
from __future__ import annotations

from typing import Literal, Protocol, Sequence

import torch

from placement.constants import PROMPT_CHUNK

from ..errors import UserError
from .batch import BatchSeq, StepBatch, pack_rows
from .executor import Executor
from .kv_cache import kv_cache_type


class Evaluable(Protocol):
    """What a session needs of a model (models.base.Model; kept structural so that this module and
    the model base do not import each other)."""
    n_ctx_train: int
    executor: object
    plan: object

    def new_state(self, n_ctx: int, cache_type: str, k_max: int): ...
    def forward(self, state, tokens: torch.Tensor, start_pos: int) -> torch.Tensor: ...
    def forward_batch(self, batch, tokens: torch.Tensor) -> torch.Tensor: ...
    def begin_step(self, state, start_pos: int, n: int) -> bool: ...
    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor: ...
    def truncate_state(self, state, n: int) -> None: ...


class Session:
    def __init__(self, model: Evaluable, n_ctx: int | None = None, cache_type: str = "f32", k_max: int = 4):
        plan = model.plan
        n_ctx = n_ctx or (plan.options.n_ctx if plan is not None else min(model.n_ctx_train, 4096))
        if n_ctx > model.n_ctx_train:
            raise UserError(f"context {n_ctx} is larger than the model's training context {model.n_ctx_train}")
        if n_ctx < 1:
            raise UserError(f"context must be positive, got {n_ctx}")
        if plan is not None:
            _check_against_plan(plan.options, n_ctx, cache_type, k_max)
        self.model, self.n_ctx = model, n_ctx
        self.executor = model.executor or Executor(torch.device("cpu"))   # models built without the loader
        self.k_max = k_max      # largest verify batch whose per-token state can be rolled back
        self.state = model.new_state(n_ctx, cache_type, k_max)
        self.n_past = 0
        self.hidden: torch.Tensor | None = None     # final-normed hidden states of the last eval
        # set while the session's generation shares steps with other sessions (runtime/step_batcher.py):
        # its evals go there, to run in one forward with theirs
        self.stepper = None

    @property
    def sharing(self) -> int:
        """Other sessions whose steps this one's share now (0 when it decodes alone)."""
        return self.stepper.others() if self.stepper is not None else 0

    def eval(self, tokens: Sequence[int] | torch.Tensor, start_pos: int | None = None,
             logits: Literal["all", "last", "none"] = "all",
             out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run `tokens` at positions [start_pos, start_pos + n); start_pos defaults to the end of
        what the session holds, and a smaller one first truncates. Returns float32 logits
        [n, n_vocab] ("all"), [1, n_vocab] ("last") or None; `out` is an optional buffer to write
        them into (decoding loops reuse one sized for k_max)."""
        tok = self.rewind_for(tokens, start_pos)
        if self.stepper is not None:
            return self.stepper.eval(self, tok, logits, out)
        self._advance(tok, logits == "all")
        if logits == "none":
            return None
        rows = self.hidden if logits == "all" else self.hidden[-1:]
        if out is not None:
            out = out[:rows.shape[0]]
        return self.model.logits(rows, out=out)

    def rewind_for(self, tokens: Sequence[int] | torch.Tensor, start_pos: int | None) -> torch.Tensor:
        """eval's first half: the tokens as a row, checked to fit after start_pos (default: the
        end), the session truncated to start_pos. They are then to run after n_past."""
        tok = _token_row(tokens)
        start = self.n_past if start_pos is None else start_pos
        if start > self.n_past:
            raise ValueError(f"start_pos {start} is past the {self.n_past} tokens in the session")
        self._check_fits(start, tok.shape[0])
        if start < self.n_past:
            self.truncate(start)
        return tok

    def _check_fits(self, start: int, n: int) -> None:
        if start + n > self.n_ctx:
            raise UserError(f"{start + n} tokens do not fit the context of {self.n_ctx} "
                            f"(raise -c or shorten the prompt)")
        if n == 0:
            raise ValueError("eval needs at least one token")

    def _advance(self, tok: torch.Tensor, keep_all: bool) -> None:
        """tok after the session's n_past tokens, in forwards of up to PROMPT_CHUNK; self.hidden:
        every row's final hidden (keep_all), else the last forward's."""
        chunks = []
        for lo in range(0, tok.shape[0], PROMPT_CHUNK):
            chunk = tok[lo:lo + PROMPT_CHUNK]
            h = self.executor.forward(self.model, self.state, chunk, self.n_past)
            self.n_past += chunk.shape[0]
            if keep_all:
                chunks.append(h)
        self.hidden = h if not keep_all else torch.cat(chunks) if len(chunks) > 1 else chunks[0]

    def truncate(self, n: int) -> None:
        """Keep the first n tokens; everything after them is forgotten."""
        if not 0 <= n <= self.n_past:
            raise ValueError(f"cannot truncate {self.n_past} tokens to {n}")
        self.model.truncate_state(self.state, n)
        self.n_past = n


def eval_batch(sessions: Sequence[Session], token_lists: Sequence[Sequence[int] | torch.Tensor],
               logits: Literal["all", "last", "none"] = "all") -> list[torch.Tensor | None]:
    """Session.eval for several sessions of one model in shared steps: session i's tokens run after
    its n_past tokens, and its logits ([n_i, n_vocab], [1, n_vocab] or None as `logits` says) are
    entry i of the list. Bit for bit what each session's own eval would return: sessions whose
    tokens fit a decode / verify step share forwards of up to ROWWISE_MAX rows (every matrix read
    once for all of them, runtime/batch.py), one with more (a prompt) runs its own, and the output
    head runs once over each forward's rows. Sessions roll back as before (Session.truncate)."""
    if len(sessions) != len(token_lists):
        raise ValueError(f"{len(sessions)} sessions, {len(token_lists)} token lists")
    if not sessions:
        return []
    model = sessions[0].model
    if any(s.model is not model for s in sessions):
        raise ValueError("sessions of different models cannot share a step")
    if len({id(s) for s in sessions}) != len(sessions):
        raise ValueError("a session appears twice in one step")
    toks = [_token_row(t) for t in token_lists]
    for s, tok in zip(sessions, toks):
        s._check_fits(s.n_past, tok.shape[0])
    groups = pack_rows([tok.shape[0] for tok in toks])
    for group in groups:
        if len(group) == 1:
            s = sessions[group[0]]
            s._advance(toks[group[0]], logits == "all")
            continue
        batch = StepBatch(tuple(BatchSeq(sessions[i].state, sessions[i].n_past, toks[i].shape[0]) for i in group))
        h = sessions[group[0]].executor.forward_batch(model, batch, torch.cat([toks[i] for i in group]))
        for i, rows in zip(group, batch.rows):
            sessions[i].hidden = h[rows]
            sessions[i].n_past += toks[i].shape[0]
    if logits == "none":
        return [None] * len(sessions)
    # the output head once per forward's group, not over every row at once: a device head's call
    # of more than ROWWISE_MAX rows is a prompt GEMM, whose bits are not a decode row's
    out: list[torch.Tensor | None] = [None] * len(sessions)
    for group in groups:
        rows = [sessions[i].hidden if logits == "all" else sessions[i].hidden[-1:] for i in group]
        for i, g in zip(group, model.logits(torch.cat(rows)).split([r.shape[0] for r in rows])):
            out[i] = g
    return out


def _token_row(tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)


def _check_against_plan(options, n_ctx: int, cache_type: str, k_max: int) -> None:
    """A session of a placed model must fit what its plan reserved on the device."""
    if n_ctx > options.n_ctx:
        raise UserError(f"a context of {n_ctx} is more than the plan reserved ({options.n_ctx}): "
                        f"plan with -c {n_ctx}")
    planned = kv_cache_type(options.cache_type_k, options.cache_type_v)
    if cache_type != planned:
        raise UserError(f"KV cache type {cache_type} differs from the plan's {planned}")
    if k_max > options.batch:
        raise UserError(f"verify batches of {k_max} tokens need more than the plan reserved "
                        f"({options.batch}): plan with --spec-draft-n-max {k_max - 1}")

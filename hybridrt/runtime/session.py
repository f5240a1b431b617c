"""A decoding session: one sequence's caches and position, and the single `eval` entry point that
serves prefill, decode and k-token verify alike."""
from __future__ import annotations

from typing import Literal, Protocol, Sequence

import torch

from placement.constants import PROMPT_CHUNK

from ..errors import UserError
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

    def eval(self, tokens: Sequence[int] | torch.Tensor, start_pos: int | None = None,
             logits: Literal["all", "last", "none"] = "all",
             out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run `tokens` at positions [start_pos, start_pos + n); start_pos defaults to the end of
        what the session holds, and a smaller one first truncates. Returns float32 logits
        [n, n_vocab] ("all"), [1, n_vocab] ("last") or None; `out` is an optional buffer to write
        them into (decoding loops reuse one sized for k_max)."""
        tok = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
        n = tok.shape[0]
        start = self.n_past if start_pos is None else start_pos
        if start > self.n_past:
            raise ValueError(f"start_pos {start} is past the {self.n_past} tokens in the session")
        if start + n > self.n_ctx:
            raise UserError(f"{start + n} tokens do not fit the context of {self.n_ctx} "
                            f"(raise -c or shorten the prompt)")
        if n == 0:
            raise ValueError("eval needs at least one token")
        if start < self.n_past:
            self.truncate(start)
        chunks = []
        for lo in range(0, n, PROMPT_CHUNK):
            chunk = tok[lo:lo + PROMPT_CHUNK]
            h = self.executor.forward(self.model, self.state, chunk, start + lo)
            self.n_past = start + lo + chunk.shape[0]
            if logits == "all":
                chunks.append(h)
        self.hidden = h if logits != "all" else torch.cat(chunks) if len(chunks) > 1 else chunks[0]
        if logits == "none":
            return None
        rows = self.hidden if logits == "all" else self.hidden[-1:]
        if out is not None:
            out = out[:rows.shape[0]]
        return self.model.logits(rows, out=out)

    def truncate(self, n: int) -> None:
        """Keep the first n tokens; everything after them is forgotten."""
        if not 0 <= n <= self.n_past:
            raise ValueError(f"cannot truncate {self.n_past} tokens to {n}")
        self.model.truncate_state(self.state, n)
        self.n_past = n


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

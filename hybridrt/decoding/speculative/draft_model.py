"""A separate draft model (`--spec-type draft-simple -md DRAFT.gguf`): a smaller GGUF with the
target's vocabulary, run in its own Session.

Its KV is rolled back like the target's: each proposal first evaluates the committed tokens the
draft has not seen (starting where its last kept state ends, which truncates whatever it had
drafted past that), then drafts one token per forward. Drafts the target accepted are already in
the draft's KV exactly as the draft would have computed them, so they are kept, not recomputed.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ...errors import UserError
from ...models.base import Model
from .draft import Draft, DraftPicker, DraftSource

EAGER_TOKENS = 64    # a prompt is evaluated as it is observed (counted as prompt time)


def check_same_vocab(target: Model, draft: Model) -> None:
    """Drafted ids are fed to the target as they are, so both must mean the same tokens."""
    t_tokens = target.gguf.get("tokenizer.ggml.tokens")
    d_tokens = draft.gguf.get("tokenizer.ggml.tokens")
    if target.n_vocab != draft.n_vocab or t_tokens is None or d_tokens is None or list(t_tokens) != list(d_tokens):
        raise UserError(f"draft model {draft.gguf.path} does not share the target's vocabulary "
                        f"({draft.n_vocab} vs {target.n_vocab} tokens or different token texts)")


class DraftModelSource(DraftSource):
    name = "draft-simple"

    def __init__(self, draft: Model, n_ctx: int, picker: DraftPicker, k_max: int, cache_type: str = "f32"):
        if draft.spec.recurrent:
            # a recurrent state can only roll back inside its last batch, and drafting runs one
            # forward per token
            raise UserError(f"draft model {draft.gguf.path}: {draft.arch} has recurrent layers; "
                            f"use an attention-only draft (llama, qwen3, gemma3)")
        self.session = draft.session(n_ctx, cache_type, k_max)
        self.picker = picker
        self.synced = 0              # draft KV positions [0, synced) hold committed tokens
        self.pending: list[int] = []  # committed tokens at positions >= synced
        self.drafted: list[int] = []  # tokens the draft evaluated at positions synced + 1 ...
        self.row = torch.empty(1, draft.n_vocab)

    def observe(self, start: int, tokens: Sequence[int], hidden: torch.Tensor | None) -> None:
        for j, token in enumerate(tokens):
            pos = start + j
            if pos < self.synced:
                continue
            # the draft's own forward of an accepted draft token is still valid
            k = pos - self.synced
            if not self.pending and self.drafted and self.drafted[0] == token and k == 0:
                self.synced += 1
                self.drafted.pop(0)
                continue
            self.drafted = []
            self.pending.append(int(token))
        if len(self.pending) >= EAGER_TOKENS:
            self.session.eval(self.pending, start_pos=self.synced, logits="none")
            self.synced += len(self.pending)
            self.pending = []

    def catch_up(self) -> None:
        if self.pending:
            self.session.eval(self.pending, start_pos=self.synced, logits="none")
            self.synced += len(self.pending)
            self.pending = []

    def propose(self, certain: int, pos: int, n_max: int) -> Draft:
        draft = self.picker.start()
        tokens = self.pending + [certain]
        start = pos + 1 - len(tokens)
        if start != self.synced:
            raise ValueError(f"draft model synced to {self.synced}, asked to draft from position {start}")
        self.drafted, self.pending = [], []
        if n_max <= 0:
            # still keep the draft's KV up with the committed tokens
            self.session.eval(tokens, start_pos=start, logits="none")
            self.synced = pos + 1
            return draft
        logits = self.session.eval(tokens, start_pos=start, logits="last", out=self.row)[0]
        self.synced = pos + 1
        for i in range(n_max):
            if not self.picker.add(draft, logits) or i == n_max - 1 or not self.picker.wants(i + 1):
                break
            logits = self.session.eval(draft.tokens[-1:], logits="last", out=self.row)[0]
            self.drafted.append(draft.tokens[-1])
        return draft

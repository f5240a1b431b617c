"""MTP self-speculation (`--spec-type draft-mtp`): the model's own NextN head drafts the tokens.

The MTP entry at position j takes token t_j and the trunk's final hidden h_(j-1) and predicts
t_(j+1); it writes the head's own KV at j. Drafting from the certain token c at position P:
  1. one batched MTP call over the committed positions it has not yet seen with trunk hiddens
     (the tokens accepted last step) plus c, with h from the target's verify pass; this both
     rewrites those positions' MTP KV with trunk-quality inputs and yields the first draft;
  2. chained calls, each feeding the previous draft with the MTP's own output hidden.
Chained entries beyond the accepted prefix are overwritten by step 1 of the next proposal
before anything reads them, so the MTP KV needs no explicit rollback.
Position 0 has no previous hidden, so (as in llama.cpp, and the float64 reference) the MTP
sequence starts at position 1. A prompt is written as soon as it is observed.

A trained head (`--mtp-head`, hybridrt.models.mtp_head) may cover only a draft vocabulary: its logits
row i is token `draft_ids[i]`. The picker chooses among those rows and the choice (and, sampled,
q's candidate ids) is mapped back to token ids, so q is exactly zero off the draft vocabulary and
the acceptance rule (min(1, p/q), residual max(0, p - q)) needs nothing special. `draft_vocab`
V > 0 drafts the built-in head the same way, over V rows of its output and the rows of the
sequence's own tokens, added as they are observed (draft_vocab.SequenceDraftHead).
"""
from __future__ import annotations

from typing import Sequence

import torch

from placement.constants import PROMPT_CHUNK

from ...errors import UserError
from ...models.base import MTPHead
from ...runtime.session import Session
from .draft import Draft, DraftPicker, DraftSource
from .draft_vocab import SequenceDraftHead, draft_head

EAGER_TOKENS = 64    # observed tokens are written in batches this large (a prompt: as prompt time, with
                     # the rest of it written by the loop's prefill through catch_up)


class MTPSource(DraftSource):
    name = "draft-mtp"

    def __init__(self, session: Session, picker: DraftPicker, draft_vocab: int = 0):
        if session.model.mtp is None:
            raise UserError(f"--spec-type draft-mtp: {session.model.arch} model has no MTP (nextn) head")
        mtp = draft_head(session.model, draft_vocab)        # model.mtp itself at draft_vocab 0
        self.mtp: MTPHead = mtp
        self.state, self.picker = session.state, picker
        self.synced = 1      # MTP KV positions [1, synced) were written from trunk hiddens
        self.tokens: list[int] = []                 # committed tokens at positions >= synced
        self.prev_hidden: list[torch.Tensor] = []   # trunk hidden of the position before each
        self.last_hidden: torch.Tensor | None = None    # trunk hidden of the last observed position
        self.vocab = mtp if isinstance(mtp, SequenceDraftHead) else None     # a draft vocabulary that grows
        self.row = torch.empty(1, mtp.max_out)

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """Token id of each logits row (None: the full vocabulary)."""
        return self.mtp.draft_ids

    def observe(self, start: int, tokens: Sequence[int], hidden: torch.Tensor | None) -> None:
        for j, token in enumerate(tokens):
            if start + j >= self.synced:
                self.tokens.append(int(token))
                self.prev_hidden.append(self.last_hidden)
            self.last_hidden = hidden[j:j + 1]
        if self.vocab is not None:
            self.vocab.add_tokens(tokens)
        if len(self.tokens) >= EAGER_TOKENS:
            self.catch_up()

    def _write(self, tokens: list[int], hiddens: torch.Tensor, start: int) -> torch.Tensor:
        """MTP entries for `tokens` at [start, +n) from the trunk hiddens before each, the last
        one's draft logits into self.row; returns the MTP output hidden of the last. Earlier
        chunks (a proposal after a long prompt) write only their KV, which is all that is read of them."""
        tok = torch.tensor(tokens, dtype=torch.int64)
        last = (len(tokens) - 1) // PROMPT_CHUNK * PROMPT_CHUNK
        for lo in range(0, last, PROMPT_CHUNK):
            self.mtp.write_kv(self.state, tok[lo:lo + PROMPT_CHUNK], hiddens[lo:lo + PROMPT_CHUNK], start + lo)
        return self.mtp.draft(self.state, tok[last:], hiddens[last:], start + last, out=self.row)

    def catch_up(self) -> None:
        """The deferred tokens' MTP KV only (MTPHead.write_kv): nothing reads their outputs."""
        if self.tokens:
            tok, hiddens = torch.tensor(self.tokens, dtype=torch.int64), torch.cat(self.prev_hidden)
            for lo in range(0, len(tok), PROMPT_CHUNK):
                self.mtp.write_kv(self.state, tok[lo:lo + PROMPT_CHUNK], hiddens[lo:lo + PROMPT_CHUNK],
                                  self.synced + lo)
            self.synced += len(self.tokens)
            self.tokens, self.prev_hidden = [], []

    def propose(self, certain: int, pos: int, n_max: int) -> Draft:
        draft = self.picker.start()
        if n_max <= 0:
            return draft
        tokens = self.tokens + [certain]
        hiddens = torch.cat(self.prev_hidden + [self.last_hidden])
        start = pos + 1 - len(tokens)
        if start != self.synced:
            raise ValueError(f"MTP synced to {self.synced}, asked to draft from position {start}")
        h = self._write(tokens, hiddens, start)
        self.synced, self.tokens, self.prev_hidden = pos + 1, [], []
        for i in range(n_max):
            if not self.add(draft, self.row[0, :self.mtp.n_out]) or i == n_max - 1 or not self.picker.wants(i + 1):
                break
            h = self.mtp.draft(self.state, torch.tensor(draft.tokens[-1:]), h, pos + 1 + i, out=self.row)
        return draft

    def add(self, draft: Draft, logits_row: torch.Tensor) -> bool:
        """Append the token the picker chooses from the head's logits row; with a draft vocabulary
        the chosen row (and q's candidate rows, or a refused draft's) are renamed to token ids."""
        ids = self.draft_ids
        if not self.picker.add(draft, logits_row, ids):
            if draft.refused is not None and ids is not None:
                draft.refused.ids = ids[draft.refused.ids]
            return False
        if ids is not None:
            draft.tokens[-1] = int(ids[draft.tokens[-1]])
            if draft.q_ids is not None:
                draft.q_ids[-1] = ids[draft.q_ids[-1]]
        return True

"""A built-in MTP head drafting over a reduced vocabulary (`build_source(..., draft_vocab=V)`).

A qwen35 NextN head computes its draft logits with the model's own output head: 248,320 Q6_K rows
(~1 GB) on Qwen3.6-27B, read by every draft. A draft vocabulary keeps V of those rows, gathered
once into a matrix of their own (the same quantized bytes, run by the same CPU kernel, so its
logits are bit for bit the full head's at those rows), and drafts only among them as a trained
head's draft vocabulary does (`--mtp-head`, train-mtp --draft-vocab): row i is token
`draft_ids[i]`, MTPSource maps the picker's choice back to token ids, q is exactly zero off the
draft vocabulary, and verification stays full-vocabulary, so outputs are exact (greedy: token for
token; sampled: the target's distribution, the residual max(0, p - q) covering the tokens the head
cannot propose).

Which V tokens, with no training text (choose_draft_vocab, deterministic for a given file):
  1. the tokenizer's end-of-generation tokens (every answer ends with one);
  2. the tokens of a bundled text (train_mtp.prompts.TRAIN_PROMPTS and the printable ASCII
     characters, tokenized with the model's own tokenizer), most frequent first;
  3. then the rest of the tokens that stand for text (normal, user-defined, byte) in ascending id:
     GGUF vocabularies list BPE tokens in merge order and SentencePiece pieces by score (Gemma 3's
     normal pieces: scores strictly falling with id), so a lower id is a token the tokenizer's own
     corpus had more of: a frequency prior every file carries;
  4. control, unused and unknown tokens last.
Ties keep the lower id. The ids are kept in ascending order (the rows' order in the file); they and
their rows are built once per model and size. Each sequence adds the rows of its own tokens, its
prompt and its output so far, as the source observes them (SequenceDraftHead: up to V more, a row
copied per new token): what a model writes repeats its prompt and itself, and on Gemma 3's 262k
vocabulary those tokens took the share of the target's tokens inside V = 4096 from 82 to 95 %.
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

from ...runtime.backends import CpuQuantLinear
from ...errors import UserError
from ...models.base import MTPHead
from ...models.qwen35 import NextNHead
from ...files.tokenizer import BYTE, NORMAL, USER_DEFINED

FLAG = "--spec-draft-vocab"
TEXT_TYPES = (NORMAL, USER_DEFINED, BYTE)
# the chosen ids and their rows, per head and size: a server builds a source per request, and
# 32k rows of the 27B's head are a 134 MB copy
_CHOSEN_ROWS: "weakref.WeakKeyDictionary[NextNHead, dict[int, tuple]]" = weakref.WeakKeyDictionary()


def check_draft_vocab(size: int, n_vocab: int) -> None:
    if not 0 <= size <= n_vocab:
        raise UserError(f"{FLAG} {size}: must be in [0, {n_vocab}], the model's vocabulary "
                        f"(0: all of it)")


def bundled_text() -> list[str]:
    """The training prompts, and each printable ASCII character alone and after a space: the pieces
    any English text or code can be spelled with, which SentencePiece vocabularies list last
    (Gemma 3: "m", "'", "[" or "3" at ids above 236,000)."""
    from ...train_mtp.prompts import TRAIN_PROMPTS

    chars = [chr(c) for c in range(33, 127)]
    return [p.text for p in TRAIN_PROMPTS] + chars + [" " + c for c in chars]


def choose_draft_vocab(tokenizer, n_vocab: int, size: int) -> torch.Tensor | None:
    """The `size` token ids chosen for a draft vocabulary (ascending), as the module docstring orders them;
    None for the full vocabulary (0 or n_vocab). n_vocab: the output head's rows (a file may have
    more rows than tokenizer entries: the extra ones rank with control tokens)."""
    check_draft_vocab(size, n_vocab)
    if size in (0, n_vocab):
        return None
    counts = np.zeros(n_vocab, dtype=np.int64)
    for text in bundled_text():
        ids = np.asarray(tokenizer.encode(text, add_special=False), dtype=np.int64)
        np.add.at(counts, ids[ids < n_vocab], 1)
    types = np.asarray(tokenizer.token_types)[:n_vocab]
    is_text = np.zeros(n_vocab, dtype=bool)
    is_text[:len(types)] = np.isin(types, TEXT_TYPES)
    is_eog = np.zeros(n_vocab, dtype=bool)
    is_eog[[i for i in tokenizer.eog_ids if i < n_vocab]] = True
    ids = np.arange(n_vocab)
    # np.lexsort: the last key sorts first
    order = np.lexsort((ids, ~is_text, -counts, ~is_eog))[:size]
    return torch.from_numpy(np.sort(order))


class GatheredRows:
    """Rows `ids` of a backend that cannot be cut (a device or traced head): the full product, then
    the rows. The same values, none of the saving; on a GPU the head is a small part of a draft."""

    def __init__(self, linear, ids: torch.Tensor):
        self.linear, self.ids = linear, ids
        self.n_out = len(ids)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = self.linear(x)[:, self.ids]
        return rows if out is None else out.copy_(rows)


def head_rows(linear, ids: torch.Tensor):
    """A backend computing rows `ids` of `linear`: on the CPU a copy of those rows' quantized bytes
    run by the same kernel with the same activation settings; rows are independent in every
    kernel, so each is bitwise the full matrix's row."""
    if type(linear) is not CpuQuantLinear:
        return GatheredRows(linear, ids)
    return _cpu_rows(linear, np.ascontiguousarray(linear.raw[ids.numpy()]))


def _cpu_rows(linear: CpuQuantLinear, raw: np.ndarray) -> CpuQuantLinear:
    return CpuQuantLinear(raw, linear.qtype, linear.n_in, raw.shape[0], f"{linear.name}[{raw.shape[0]} draft rows]",
                          exact=linear.exact, residual=linear.residual)


def _into(rows, x: torch.Tensor, out: torch.Tensor) -> None:
    if out.is_contiguous():
        rows(x, out=out)
    else:       # columns of a several-row result
        out.copy_(rows(x))


class SequenceDraftHead(MTPHead):
    """The built-in head drafting over one sequence's draft vocabulary: the V tokens chosen for the
    model (their rows shared by every sequence) and the sequence's own tokens outside them (its
    prompt and what it has committed, as MTPSource observes them; at most V more, first come). The
    text a model writes repeats its prompt and itself: on the 32 held-out prompts, 64 greedy tokens
    each, the V = 4096 chosen tokens held 82 % of SmolLM2's tokens and 82 % of Gemma 3's, with the
    sequence's own 88 % and 95 % (scripts/bench_draft_vocab.py). Logits row i is token
    draft_ids[i], as in a trained head with a draft vocabulary."""

    def __init__(self, mtp: NextNHead, size: int, n_vocab: int):
        self.mtp, self.size = mtp, size
        self.static_ids, self.static = _static_rows(mtp, size, n_vocab)
        self.max_out = 2 * size
        self.ids = torch.empty(self.max_out, dtype=torch.int64)
        self.ids[:size] = self.static_ids
        self.known = np.zeros(n_vocab, dtype=bool)
        self.known[self.static_ids.numpy()] = True
        self.n_out, self.extra = size, None
        # the added rows' bytes (pages are only touched as rows come)
        self._extra_raw = np.empty((size, mtp.head.raw.shape[1]), dtype=np.uint8) \
            if type(mtp.head) is CpuQuantLinear else None

    @property
    def draft_ids(self) -> torch.Tensor:
        return self.ids[:self.n_out]

    def add_tokens(self, tokens) -> None:
        """Rows for the tokens not yet in the draft vocabulary (first come, up to max_out rows)."""
        t = np.asarray(tokens, dtype=np.int64)
        new = list(dict.fromkeys(t[~self.known[t]].tolist()))[:self.max_out - self.n_out]
        if not new:
            return
        self.known[new] = True
        lo, self.n_out = self.n_out - self.size, self.n_out + len(new)
        self.ids[self.size + lo:self.n_out] = torch.tensor(new)
        head, hi = self.mtp.head, self.n_out - self.size
        if self._extra_raw is None:
            self.extra = GatheredRows(head, self.ids[self.size:self.n_out])
        else:       # only the new rows are copied: the buffer holds the earlier ones
            self._extra_raw[lo:hi] = head.raw[new]
            self.extra = _cpu_rows(head, self._extra_raw[:hi])

    def head(self, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.empty(h.shape[0], self.n_out) if out is None else out
        _into(self.static, h, y[:, :self.size])
        if self.extra is not None:
            _into(self.extra, h, y[:, self.size:self.n_out])
        return y

    def step(self, state, tokens: torch.Tensor, hidden: torch.Tensor, start_pos: int,
             logits: bool = True, out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """NextNHead.step with the logits of the draft vocabulary's rows."""
        _, h = self.mtp.step(state, tokens, hidden, start_pos, logits=False)
        return (self.head(h, out=out) if logits else None), h

    def draft(self, state, tokens: torch.Tensor, hidden: torch.Tensor, start_pos: int,
              out: torch.Tensor) -> torch.Tensor:
        """NextNHead.draft: the last token's logits into out [1, >= n_out]; its output hidden."""
        _, h = self.step(state, tokens, hidden, start_pos, logits=False)
        self.head(h[-1:], out=out)
        return h[-1:]

    def write_kv(self, state, tokens: torch.Tensor, hidden: torch.Tensor, start_pos: int) -> None:
        self.mtp.write_kv(state, tokens, hidden, start_pos)


def _static_rows(mtp, size: int, n_vocab: int):
    """The V chosen ids of the model and their rows of the head, built once per head and size."""
    built = _CHOSEN_ROWS.setdefault(mtp, {})
    if size not in built:
        ids = choose_draft_vocab(mtp.model.tokenizer, n_vocab, size)
        built[size] = ids, head_rows(mtp.head, ids)
    return built[size]


def draft_head(model, size: int) -> MTPHead:
    """What MTPSource drafts with: model.mtp at size 0 (or the model's vocabulary), else a
    SequenceDraftHead over `size` tokens and the sequence's own."""
    mtp = model.mtp
    check_draft_vocab(size, model.n_vocab)
    if size in (0, model.n_vocab):
        return mtp
    if not isinstance(mtp, NextNHead):
        raise UserError(f"{FLAG} applies to a model's built-in MTP head; a trained head (--mtp-head) "
                        f"takes its draft vocabulary when trained (train-mtp --draft-vocab)")
    return SequenceDraftHead(mtp, size, model.n_vocab)

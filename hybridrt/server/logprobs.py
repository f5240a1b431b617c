"""Token log-probabilities for OpenAI's `logprobs`: what each token was worth to the model.

A value is log softmax of the target's raw logits row the token was drawn from (llama-server's
default, `post_sampling_probs` off): temperature, top-k / top-p / min-p do not change it, so the
same text scores the same under any sampler, and speculative decoding reports exactly what plain
decoding reports (the verify pass's row is the target's row for that position).

Which tokens a response lists: those whose text it shows. A stop string's text is never shown,
so a token that lies wholly inside it (or after it) is dropped, as llama-server does; a token
whose text starts before the stop string stays. `LogprobTrack` follows the decoded text offsets
to decide that, also per streamed chunk.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..decoding.sampling import top_k_rows

MAX_TOP_CHAT = 20          # OpenAI's bounds on top_logprobs (chat) and logprobs (completions);
MAX_TOP_COMPLETION = 5     # llama-server allows more, clients written for OpenAI never ask it


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float | None                   # None: the first prompt token (nothing predicts it)
    top: tuple[tuple[int, float], ...]      # the n most likely tokens at that position, best first


def token_logprob(row: torch.Tensor, token: int, n_top: int) -> TokenLogprob:
    """The entry of `token` drawn from logits `row`, with the n_top most likely alternatives."""
    lp = torch.log_softmax(row.float(), dim=-1)
    top = ()
    if n_top > 0:
        values, ids = top_k_rows(lp[None], min(n_top, lp.shape[0]))
        top = tuple(zip(ids[0].tolist(), values[0].tolist()))
    return TokenLogprob(token, float(lp[token]), top)


class LogprobTrack:
    """Entries of the generated tokens, released as the text they decode to is shown.

    `add(entry, text_len)` records a token and the length of the text its decoding added (0 for
    a token ending inside a multi-byte character); `shown(total)` returns the entries not yet
    released whose text starts before `total` characters of shown text; `rest(stopped)` the
    remaining ones at the end (all of them unless a stop string cut the text)."""

    def __init__(self, start: int = 0):
        self.entries: list[tuple[TokenLogprob, int]] = []     # (entry, offset of its text)
        self.text_len = start
        self.released = 0

    def add(self, entry: TokenLogprob, text_len: int) -> None:
        self.entries.append((entry, self.text_len))
        self.text_len += text_len

    def shown(self, total: int) -> list[tuple[TokenLogprob, int]]:
        j = self.released
        while j < len(self.entries) and self.entries[j][1] < total:
            j += 1
        out, self.released = self.entries[self.released:j], j
        return out

    def rest(self, stopped: bool, total: int) -> list[tuple[TokenLogprob, int]]:
        return self.shown(total) if stopped else self.shown(float("inf"))


def _piece(tokenizer, token: int) -> bytes:
    return tokenizer.token_to_piece(token, special=True)


def chat_logprobs(entries: list[tuple[TokenLogprob, int]], tokenizer) -> dict:
    """The chat completion's `choice.logprobs` object (or a chunk's) for these entries."""
    def one(token: int, logprob: float) -> dict:
        raw = _piece(tokenizer, token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}
    content = []
    for e, _ in entries:
        content.append({**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]})
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[tuple[TokenLogprob, int]], tokenizer, n_top: int) -> dict:
    """The legacy completion's `choice.logprobs`: parallel lists, top alternatives as dicts (as
    OpenAI: two alternatives with the same text collapse into one key), text offsets into the
    choice's text (the prompt's included with `echo`)."""
    def text(token: int) -> str:
        return _piece(tokenizer, token).decode("utf-8", errors="replace")
    tops = []
    for e, _ in entries:
        if e.logprob is None:
            tops.append(None)
            continue
        d: dict[str, float] = {}
        for t, v in e.top[:n_top]:
            d.setdefault(text(t), v)
        tops.append(d)
    return {"tokens": [text(e.token) for e, _ in entries], "token_logprobs": [e.logprob for e, _ in entries],
            "top_logprobs": tops, "text_offset": [off for _, off in entries]}

"""Request bodies in, response bodies out, in OpenAI's shapes (plus llama.cpp's `timings`).

Validation is by hand rather than with a model library: the rules are few, and each failure must
name the offending field in the OpenAI error's `param`. Unknown fields are ignored, as OpenAI's
clients send several (`user`, `stream_options`) that change nothing here; the penalties, which
would change the distribution, are refused unless neutral (presence / frequency 0, repeat 1), and so
are structured output and tool calls (`tools`, `response_format`, llama-server's `grammar` /
`json_schema`) until the server implements them.
Sampling defaults are llama-server's (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05).
"""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Literal

from ..files.chat_template import ChatTemplateError
from ..decoding.generate import GenerationStats
from ..models.base import Model
from ..decoding.sampling import SamplerConfig
from .errors import bad_request
from .logprobs import MAX_TOP_CHAT, MAX_TOP_COMPLETION, TokenLogprob, chat_logprobs, completion_logprobs

MAX_STOPS = 16
# sampling penalties clients may send, and the value that means none (llama.cpp's repeat_penalty too)
PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repeat_penalty": 1.0}
# structured output and tool calls: `hybridrt run` constrains (--json-schema, --grammar, --regex),
# the server does not yet; a client that sends these expects them honoured, so each is refused by
# name rather than answered with free text (absent, null or its "off" value passes)
NOT_YET = {"tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
           "response_format": ({"type": "text"},), "grammar": ("",), "json_schema": ({},)}
ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True)
class ModelCard:
    """What the server serves: the id /v1/models lists (the known name given to -m, else the file's stem)."""
    id: str
    n_ctx: int
    created: int

    def check(self, body: dict) -> str:
        """The name a response carries: the request's `model`, whatever it is (as llama.cpp's server:
        one model is served, and clients set up for another name, e.g. gpt-4o, still work)."""
        name = body.get("model")
        if name is None:
            return self.id
        if not isinstance(name, str):
            raise bad_request("'model' must be a string", "model")
        return name


@dataclass(frozen=True)
class GenRequest:
    kind: Literal["chat", "text"]
    model: str
    prompt_ids: list[int]
    max_tokens: int              # -1: until an end-of-generation token or a full context
    sampler: SamplerConfig
    stop: tuple[str, ...]
    stream: bool
    ignore_eos: bool = False     # llama.cpp server's extension: end-of-generation tokens do not stop
    n_logprobs: int | None = None   # None: no logprobs; else how many top alternatives per token
    echo: bool = False           # completions: the prompt's text (and, with logprobs, its scores) first


@dataclass
class GenResult:
    text: str                    # the whole completion (non-streaming responses)
    finish_reason: str           # "stop" or "length"
    stats: GenerationStats
    n_completion: int            # tokens generated, a stop string's tokens included
    logprobs: list[tuple[TokenLogprob, int]] | None = None    # (entry, text offset) per shown token


# ------------------------------------------------------------------------------- fields
def _number(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"'{key}' must be a number", key)
    if value < lo or value > hi or (lo_open and value == lo):
        raise bad_request(f"'{key}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}", key)
    return float(value)


def _integer(body: dict, key: str, default: int | None, lo: int, hi: int = 2**63 - 1) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{key}' must be an integer", key)
    if not lo <= value <= hi:
        raise bad_request(f"'{key}' must be between {lo} and {hi}, got {value}", key)
    return value


def _boolean(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"'{key}' must be a boolean", key)
    return value


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOPS:
        raise bad_request(f"'stop' takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    return tuple(stops)


def _common(body: dict, card: ModelCard, kind: Literal["chat", "text"], prompt_ids: list[int],
            prompt_param: str) -> GenRequest:
    if not prompt_ids:
        raise bad_request("the prompt is empty", prompt_param)
    if len(prompt_ids) >= card.n_ctx:
        raise bad_request(f"the prompt is {len(prompt_ids)} tokens and the context is {card.n_ctx}: "
                          f"it leaves no room to generate (shorten the prompt or raise -c)",
                          prompt_param, code="context_length_exceeded")
    _integer(body, "n", 1, 1, 1)      # one choice per request
    echo = kind == "text" and _boolean(body, "echo")
    max_tokens = _integer(body, "max_completion_tokens", None, 1) if kind == "chat" else None
    if max_tokens is None:
        # 0 only with echo: score the prompt, generate nothing (OpenAI's legacy completions)
        max_tokens = _integer(body, "max_tokens", None, 0 if echo else 1)
    stream, ignore_eos = _boolean(body, "stream"), _boolean(body, "ignore_eos")
    sampler = SamplerConfig(
        temp=_number(body, "temperature", 0.8, 0.0, 2.0),
        top_k=_integer(body, "top_k", 40, 0),
        top_p=_number(body, "top_p", 0.95, 0.0, 1.0, lo_open=True),
        min_p=_number(body, "min_p", 0.05, 0.0, 1.0),
        seed=_integer(body, "seed", -1, -1),
    )
    for key, neutral in PENALTIES.items():
        if _number(body, key, neutral, -math.inf, math.inf) != neutral:
            raise bad_request(f"'{key}' is not supported: only {neutral:g} (no penalty)", key)
    for key, off in NOT_YET.items():
        if body.get(key) is not None and body[key] not in off:
            raise bad_request(f"'{key}' is not supported by the server yet (no structured output or tool calls; "
                              f"`hybridrt run` takes --json-schema / --grammar / --regex)", key)
    return GenRequest(kind, card.check(body), prompt_ids, -1 if max_tokens is None else max_tokens, sampler,
                      _stops(body), stream, ignore_eos, _logprobs(body, kind), echo)


def _logprobs(body: dict, kind: Literal["chat", "text"]) -> int | None:
    """How many top alternatives per token the request wants, or None for no logprobs. Chat:
    `logprobs` true, `top_logprobs` 0-20; completions: `logprobs` 0-5 (null: none)."""
    if kind == "text":
        return _integer(body, "logprobs", None, 0, MAX_TOP_COMPLETION)
    wanted = _boolean(body, "logprobs")
    top = _integer(body, "top_logprobs", None, 0, MAX_TOP_CHAT)
    if top is not None and not wanted:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


def _content(message: dict, i: int) -> str:
    """A message's text: a string, or OpenAI's list of parts of which only text is supported."""
    content = message.get("content")
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def parse_chat(body: dict, model: Model, card: ModelCard) -> GenRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad_request(f"messages[{i}] must be an object with a role in {', '.join(ROLES)}", f"messages[{i}]")
        plain.append({"role": m["role"], "content": _content(m, i)})
    card.check(body)       # a bad `model` is a 400 before any template work
    try:
        text = model.tokenizer.apply_chat_template(plain, add_generation_prompt=True)
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from None
    # as `hybridrt run --chat`: the rendered template's control tokens are parsed as such
    return _common(body, card, "chat", model.tokenize(text, add_special=True, parse_special=True), "messages")


def parse_completion(body: dict, model: Model, card: ModelCard) -> GenRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = model.tokenize(prompt, add_special=True, parse_special=False) if prompt else []
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < model.n_vocab for t in prompt):
            raise bad_request(f"'prompt' token ids must be in [0, {model.n_vocab})", "prompt")
        ids = list(prompt)
    else:
        raise bad_request("'prompt' must be a string, a list of one string or a list of token ids", "prompt")
    return _common(body, card, "text", ids, "prompt")


# ------------------------------------------------------------------------------- responses
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(n_prompt: int, n_completion: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


def timings(stats: GenerationStats, n_completion: int) -> dict:
    """llama-server's `timings` object (milliseconds; speculative counts when drafting)."""
    prompt_ms, predicted_ms = stats.prompt_s * 1e3, stats.decode_s * 1e3
    out = {
        "prompt_n": stats.n_prompt, "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / stats.n_prompt if stats.n_prompt else 0.0,
        "prompt_per_second": stats.prompt_tps,
        "predicted_n": n_completion, "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / stats.n_decode if stats.n_decode else 0.0,
        "predicted_per_second": stats.decode_tps,
    }
    if stats.spec is not None and stats.spec.source != "none":
        out.update(draft_n=sum(stats.spec.drafted), draft_n_accepted=sum(stats.spec.accepted),
                   draft_tokens_per_step=stats.spec.tokens_per_step)
    return out


def _envelope(req: GenRequest, rid: str, created: int, chunk: bool) -> dict:
    obj = {"chat": ("chat.completion", "chat.completion.chunk"), "text": ("text_completion", "text_completion")}
    return {"id": rid, "object": obj[req.kind][chunk], "created": created, "model": req.model,
            "system_fingerprint": None}


def logprobs_body(req: GenRequest, entries, tokenizer) -> dict | None:
    """A choice's `logprobs` for these (entry, offset) pairs, in the request's kind's shape."""
    if req.n_logprobs is None or entries is None:
        return None
    if req.kind == "chat":
        return chat_logprobs(entries, tokenizer)
    return completion_logprobs(entries, tokenizer, req.n_logprobs)


def completion_body(req: GenRequest, rid: str, created: int, result: GenResult, tokenizer=None) -> dict:
    choice = {"index": 0, "finish_reason": result.finish_reason, "logprobs": logprobs_body(req, result.logprobs, tokenizer)}
    if req.kind == "chat":
        choice["message"] = {"role": "assistant", "content": result.text}
    else:
        choice["text"] = result.text
    return {**_envelope(req, rid, created, chunk=False), "choices": [choice],
            "usage": usage(len(req.prompt_ids), result.n_completion),
            "timings": timings(result.stats, result.n_completion)}


def chunk_body(req: GenRequest, rid: str, created: int, text: str | None = None, first: bool = False,
               result: GenResult | None = None, entries=None, tokenizer=None) -> dict:
    """One streamed chunk: the first carries the assistant role, the last (with `result`) the
    finish reason, `usage` and `timings`; `entries` the logprobs of the tokens whose text it shows
    (the last chunk: those of tokens that showed no text of their own)."""
    finish = result.finish_reason if result is not None else None
    logprobs = logprobs_body(req, entries, tokenizer) if entries else None
    if req.kind == "chat":
        delta = {"role": "assistant", "content": ""} if first else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
    body = {**_envelope(req, rid, created, chunk=True), "choices": [choice]}
    if result is not None:
        body["usage"] = usage(len(req.prompt_ids), result.n_completion)
        body["timings"] = timings(result.stats, result.n_completion)
    return body


def model_list(card: ModelCard) -> dict:
    return {"object": "list", "data": [{"id": card.id, "object": "model", "created": card.created,
                                        "owned_by": "hybridrt", "meta": {"n_ctx": card.n_ctx}}]}


def now() -> int:
    return int(time.time())

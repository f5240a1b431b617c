"""Request bodies in, response bodies out, in OpenAI's shapes (plus llama.cpp's `timings`).

Validation is by hand rather than with a model library: the rules are few, and each failure must
name the offending field in the OpenAI error's `param`. Unknown fields are ignored, as OpenAI's
clients send several (`user`, `stream_options`) that change nothing here; the penalties, which
would change the distribution, are refused unless neutral (presence / frequency 0, repeat 1), and so
are the legacy `functions` / `function_call` (use `tools`). Structured output (`response_format`,
llama-server's `grammar` / `json_schema`) and tool calls (`tools`, `tool_choice`) become a
`Grammar` and a `ToolRequest` here, checked and compiled before the request is queued, so a bad
schema or an unknown tool is a 400 naming its field.
Sampling defaults are llama-server's (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05).
"""
from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass
from typing import Literal

from ..decoding.constraint import Grammar, compile_grammar, lark_literal
from ..errors import UserError
from ..files.chat_template import ChatTemplateError
from ..decoding.generate import GenerationStats
from ..models.base import Model
from ..decoding.sampling import SamplerConfig
from .errors import bad_request
from .logprobs import MAX_TOP_CHAT, MAX_TOP_COMPLETION, TokenLogprob, chat_logprobs, completion_logprobs
from .tools import Tool, ToolCall, ToolRequest, template_messages, tool_format, tool_grammar

MAX_STOPS = 16
# sampling penalties clients may send, and the value that means none (llama.cpp's repeat_penalty too)
PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repeat_penalty": 1.0}
# OpenAI's legacy function calling: clients send `tools` now; refused by name rather than ignored
NOT_YET = {"functions": ([],), "function_call": ("none",)}
ROLES = ("system", "user", "assistant", "tool", "developer")
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")      # OpenAI's rule for a function's name


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
    grammar: Grammar | None = None       # the constraint every drawn token obeys (None: free text)
    tools: ToolRequest | None = None     # chat: the tools whose calls the reply is parsed for


@dataclass
class GenResult:
    text: str                    # the whole completion (non-streaming responses)
    finish_reason: str           # "stop", "length" or "tool_calls"
    stats: GenerationStats
    n_completion: int            # tokens generated, a stop string's tokens included
    logprobs: list[tuple[TokenLogprob, int]] | None = None    # (entry, text offset) per shown token
    tool_calls: list[ToolCall] | None = None                 # the calls parsed from the reply


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
            prompt_param: str, grammar: Grammar | None = None, tools: ToolRequest | None = None) -> GenRequest:
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
            raise bad_request(f"'{key}' (legacy function calling) is not supported: send 'tools' and 'tool_choice'",
                              key)
    return GenRequest(kind, card.check(body), prompt_ids, -1 if max_tokens is None else max_tokens, sampler,
                      _stops(body), stream, ignore_eos, _logprobs(body, kind), echo, grammar, tools)


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


def _message(m, i: int) -> dict:
    """A message as the template reads it: role and text, an assistant's earlier tool calls, a tool
    result's call id and name."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise bad_request(f"messages[{i}] must be an object with a role in {', '.join(ROLES)}", f"messages[{i}]")
    out = {"role": m["role"], "content": _content(m, i)}
    calls = m.get("tool_calls")
    if m["role"] == "assistant" and calls:
        ok = isinstance(calls, list) and all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
            and isinstance(c["function"].get("arguments", ""), (str, dict)) for c in calls)
        if not ok:
            raise bad_request(f"messages[{i}].tool_calls must be a list of {{id, type, function: {{name, arguments}}}}",
                              f"messages[{i}].tool_calls")
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["function"]["name"], "arguments": c["function"].get("arguments", "{}")}}
                             for c in calls]
    if m["role"] == "tool":
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                out[key] = m[key]
    return out


def _structured(body: dict, tools: bool) -> tuple[Grammar | None, dict | None]:
    """What `response_format` or llama-server's `grammar` / `json_schema` ask for: the compiled
    grammar, and the JSON schema itself (tools under "auto" allow it beside their calls)."""
    asked = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            schema = fmt.get("schema") or {"type": "object"}      # llama-server also reads a schema here
            asked.append(("response_format", "json_schema", schema))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise bad_request("'response_format.json_schema' must be an object with a 'schema' object",
                                  "response_format")
            asked.append(("response_format", "json_schema", spec.get("schema") or {"type": "object"}))
        elif kind != "text":
            raise bad_request("'response_format.type' must be 'text', 'json_object' or 'json_schema'", "response_format")
    if body.get("json_schema") not in (None, {}):
        if not isinstance(body["json_schema"], dict):
            raise bad_request("'json_schema' must be a JSON schema object", "json_schema")
        asked.append(("json_schema", "json_schema", body["json_schema"]))
    if body.get("grammar") not in (None, ""):
        if not isinstance(body["grammar"], str):
            raise bad_request("'grammar' must be a string (GBNF or Lark)", "grammar")
        asked.append(("grammar", "grammar", body["grammar"]))
    if len(asked) > 1:
        raise bad_request(f"give one of response_format, json_schema and grammar, not {' and '.join(a[0] for a in asked)}",
                          asked[1][0])
    if not asked:
        return None, None
    field, kind, value = asked[0]
    if kind == "grammar" and tools:
        raise bad_request("'grammar' cannot be combined with tools (the tool calls have a grammar of their own)", field)
    text = value if kind == "grammar" else json.dumps(value)
    return _compile(field, kind, text), value if kind == "json_schema" else None


def _compile(field: str, kind: str, text: str) -> Grammar:
    try:
        return compile_grammar(kind, text, source=f"'{field}'")
    except UserError as e:
        raise bad_request(str(e), field) from None


def _tools(body: dict, model: Model) -> ToolRequest | None:
    """The request's tools and tool_choice, or None when no call may be made."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of {type: function, function: {name, description, parameters}}", "tools")
    parsed = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad_request(f"tools[{i}] must be {{type: function, function: {{name, ...}}}} with a name of "
                              f"letters, digits, _ and - (at most 64)", f"tools[{i}]")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}]")
        parsed.append(Tool(name, str(fn.get("description") or ""), params))
    names = {t.name for t in parsed}
    if len(names) != len(parsed):
        raise bad_request("'tools' has two functions of the same name", "tools")
    if choice in (None, "auto", "required", "none"):
        choice = choice or "auto"
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        choice = choice["function"].get("name")
        if choice not in names:
            raise bad_request(f"'tool_choice' names {choice!r}, which is not in 'tools'", "tool_choice")
    else:
        raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or {type: function, function: {name}}",
                          "tool_choice")
    if choice == "none":
        return None
    return ToolRequest(tool_format(model.tokenizer.chat_template), tuple(parsed), choice,
                       _boolean(body, "parallel_tool_calls") if body.get("parallel_tool_calls") is not None else True)


def parse_chat(body: dict, model: Model, card: ModelCard) -> GenRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    plain = [_message(m, i) for i, m in enumerate(messages)]
    card.check(body)       # a bad `model` is a 400 before any template work
    tools = _tools(body, model)
    grammar, response_schema = _structured(body, tools is not None)
    if tools is not None:
        found = tool_grammar(tools, lambda text: lark_literal(model.tokenizer, text), response_schema)
        # the response schema, if any, is part of the tools' grammar (None: a native format's free reply)
        grammar = _compile("tools", *found) if found is not None else None
    rendered, extra = template_messages(plain, tools)
    try:
        text = model.tokenizer.apply_chat_template(rendered, add_generation_prompt=True, **extra)
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from None
    # as `hybridrt run --chat`: the rendered template's control tokens are parsed as such
    return _common(body, card, "chat", model.tokenize(text, add_special=True, parse_special=True), "messages",
                   grammar, tools)


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
    if body.get("tools") not in (None, []):
        raise bad_request("'tools' are for /v1/chat/completions", "tools")
    grammar, _ = _structured(body, tools=False)
    return _common(body, card, "text", ids, "prompt", grammar)


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
        if result.tool_calls:
            choice["message"] = {"role": "assistant", "content": result.text or None,
                                 "tool_calls": [c.openai() for c in result.tool_calls]}
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


def tool_call_chunks(req: GenRequest, rid: str, created: int, calls: list[ToolCall]) -> list[dict]:
    """The streamed chunks of a reply's tool calls, in OpenAI's delta shape: per call, one chunk
    with its index, id, type and name (arguments ""), then one with its arguments."""
    out = []
    for i, call in enumerate(calls):
        head = {"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        for delta in (head, {"index": i, "function": {"arguments": call.arguments}}):
            out.append({**_envelope(req, rid, created, chunk=True),
                        "choices": [{"index": 0, "delta": {"tool_calls": [delta]}, "finish_reason": None,
                                     "logprobs": None}]})
    return out


def model_list(card: ModelCard) -> dict:
    return {"object": "list", "data": [{"id": card.id, "object": "model", "created": card.created,
                                        "owned_by": "hybridrt", "meta": {"n_ctx": card.n_ctx}}]}


def now() -> int:
    return int(time.time())

#!/usr/bin/env python3
"""Load test of `hybridrt serve`: C concurrent clients for D seconds, loopback only, with
cancellations and malformed requests mixed in; exits 0 only when every check holds.

    python scripts/load_serve.py [MODEL] [-t 2] [--parallel 4] [-c 1024] [--clients 64] [--duration 120]
        [--seed 0] [--warmup 0.2] [--rss-growth-mib 64] [--serve-args FLAGS] [--json]

MODEL: a known name or a GGUF path (default smollm2-135m). `hybridrt serve -m MODEL -t T --parallel P
-c CTX --max-queue 2C` starts on a free 127.0.0.1 port (scripts/bench_serve.py's Server). Each
client has at most one request in flight, so C would do for live clients alone; the other C are
for requests whose clients have just left and whose handlers have not yet noticed (a client's next
request can reach the server first), so that a 503 means requests held long after their clients
left (the "let go" check measures that). Then C clients (one event loop: the `openai` package's
AsyncOpenAI for well-formed requests, httpx for the rest), each looping until D seconds have
passed: it draws a kind of request (seeded by --seed and its index) and sends it.
  chat, chat_stream, text, text_stream   /v1/chat/completions and /v1/completions, max_tokens 1-32,
        greedy or seeded sampling, sometimes ignore_eos: 200, a finish reason, usage; "length" means
        exactly max_tokens tokens, and ignore_eos means "length"
  extras        chat with a model name the server does not serve and unknown fields (both ignored,
                as llama-server): 200, and the answer carries the name sent
  tools         chat with two tools (bounded schemas), tool_choice auto / required / named,
                streaming or not: a forced call that ended is a call of a known tool with JSON args
  json_object   chat with response_format json_object: a reply that ended is a JSON object
  cancel_mid    a streaming request (ignore_eos, 128 tokens) whose client leaves after 1-4 text chunks
  cancel_early  the same, its client leaving right after the headers, before any chunk
  abort         a request written on a raw socket that is closed at once (the client never sees
                an answer; streaming or not)
  give_up       a non-streaming request (ignore_eos, 128 tokens) whose client times out after
                0.3-1.5 s
  malformed     one of: bad JSON, bytes that are not UTF-8, a JSON array, missing messages / prompt,
                known fields of the wrong type, negative max_tokens, a bad response_format
                (unknown type, a nonsense schema, a json_schema that is not an object), a prompt
                longer than the context, a tool_choice naming no tool, an unknown path, a wrong
                method: each must get its 4xx (400, 404, 405) with an OpenAI-shaped error body
Meanwhile one thread reads the server's RSS (/proc/PID/status VmRSS) every second, and another
its /health (requests waiting and sessions in use) beside the clients' count of requests in flight.

Checks (the summary lists each, PASS or FAIL):
  answers          every request got what its kind expects (above); no exception but those a
                   cancellation causes on purpose; no client still waiting 120 s after the end
  no 5xx           no client saw one and /metrics counted none
  sessions         after the clients stopped and the server went idle (at most 30 s, so cancelled
                   generations can end): /metrics' sessions in use and requests waiting are 0,
                   and /health answers 200 "ok"
  requests         /metrics' requests by endpoint and status (the two generation endpoints: 404 /
                   405 are answered before any endpoint counts them) equal what the clients saw,
                   plus the requests whose answer no client saw (abort, give_up), which the server
                   counts as 200 (a stream, or an answer that beat the disconnect) or 499
  tokens           /metrics' completion tokens minus those of every usage the clients read lies
                   between the text chunks the cancel_mid clients saw (a token each at least) and
                   max_tokens summed over the requests whose usage no client read
  cancelled        /metrics' cancelled generations lie between the cancel_mid requests (each was
                   decoding when its client left, with ~124 of its tokens to go) and all the
                   requests left on purpose (one that left while queued never decodes)
  let go           a request whose client left stops counting as waiting or in use within 1 s on
                   average: by Little's law, the mean of the /health samples' requests held beyond
                   those in flight over the rate at which clients left (before 4694251 a queued
                   request whose client had left held its place until a worker reached it)
  rss              the largest RSS sample after the warm-up (the first --warmup of the run) less
                   the first sample after it is at most --rss-growth-mib. 64 MiB: the model's
                   weights, the sessions' KV caches and the step buffers are allocated before the
                   first request, so what a request allocates is transient (its logits rows,
                   SmolLM2's are 192 KiB each; Python objects); the first 20 % of the run lets the
                   allocator's per-thread arenas and the Numba / torch caches reach their working
                   size (SmolLM2 on 2 cores: +130 MiB in the first 10 s, then flat). Two minutes
                   of 64 clients on 2 cores are ~1500 requests (00bcbea: 1516), so 64 MiB is
                   ~43 KiB kept per request, a quarter of one leaked logits row, and far above
                   the allocator's noise once warm (that run: +1.5 MiB after the warm-up).
  server           still running, its log free of tracebacks and internal-error lines

Output: a per-kind table (requests, statuses seen, completed generations, completion tokens,
cancelled on purpose, problems), RSS, the /metrics figures and the checks; --json: one JSON object
on stdout instead. Progress goes to stderr. Exit 0: every check holds; 1: a check failed (one
`error:` line on stderr names them) or the server did not start; 2: bad arguments (one `error:` line).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_mission import Parser, gguf_path, host, log  # noqa: E402
from bench_serve import HOST, SERVER_FLAGS, Server, prompts, serve_flags  # noqa: E402
from hybridrt.errors import UserError  # noqa: E402
from hybridrt.files.gguf_file import GGUFError  # noqa: E402

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
COUNTED = (CHAT, TEXT)          # the endpoints whose requests /metrics counts by status
MAX_TOKENS = (1, 2, 4, 8, 16, 32)
LEAVE_TOKENS = 128              # max_tokens of the requests whose clients leave (ignore_eos: they would run on)
DRAIN_S = 120.0                 # how long the clients' last requests may take after the end
IDLE_S = 30.0                   # how long the server may take to free its sessions after that
LET_GO_S = 1.0                  # the "let go" check's bound
QUESTIONS = ("Name three colours of the rainbow.", "What is the capital of France?", "Count to five.",
             "Write one sentence about the sea.", "Why is the sky blue?", "Give me a word that rhymes with cat.")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"enum": ["Paris", "Oslo"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                               "required": ["city", "days"]}}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                           "parameters": {"type": "object", "properties": {"zone": {"const": "UTC"}},
                                                          "required": ["zone"]}}}]
TOOL_NAMES = {t["function"]["name"] for t in TOOLS}


class Wrong(Exception):
    """A request's answer was not what its kind expects."""


@dataclass
class Result:
    """What one client saw of one request. status None: it never saw one (it left first)."""
    endpoint: str | None            # one of COUNTED, or None for a request /metrics does not count
    status: int | None = None
    completion_tokens: int | None = None    # the usage read (a generation that ended)
    left: bool = False              # the client left on purpose before the end
    unread_tokens: int = 0          # max_tokens of a generation whose usage no client read
    chunks: int = 0                 # text chunks seen before leaving (cancel_mid)


@dataclass
class KindTally:
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)     # status (or "none") -> requests
    completed: int = 0
    completion_tokens: int = 0
    left: int = 0
    problems: int = 0

    def row(self) -> dict:
        return {"requests": self.requests, "statuses": {str(k): v for k, v in sorted(self.statuses.items(), key=str)},
                "completed": self.completed, "completion_tokens": self.completion_tokens, "left": self.left,
                "problems": self.problems}


@dataclass
class Ctx:
    url: str
    port: int
    n_ctx: int
    oa: object          # openai.AsyncOpenAI
    hx: object          # httpx.AsyncClient
    kinds: dict[str, KindTally] = field(default_factory=dict)
    seen: Counter = field(default_factory=Counter)          # (endpoint, status) as the clients saw them
    unseen: Counter = field(default_factory=Counter)        # endpoint -> requests whose status no client saw
    usage_tokens: int = 0
    unread_tokens: int = 0
    mid_chunks: int = 0
    problems: list[str] = field(default_factory=list)
    inflight: int = 0               # requests sent and not yet answered or left

    def record(self, kind: str, res: Result, problem: str | None) -> None:
        t = self.kinds[kind]
        t.requests += 1
        t.statuses[res.status if res.status is not None else "none"] += 1
        if res.endpoint is not None:
            if res.status is None:
                self.unseen[res.endpoint] += 1
            else:
                self.seen[res.endpoint, res.status] += 1
        if res.completion_tokens is not None:
            t.completed += 1
            t.completion_tokens += res.completion_tokens
            self.usage_tokens += res.completion_tokens
        t.left += res.left
        self.unread_tokens += res.unread_tokens
        self.mid_chunks += res.chunks
        if problem is not None:
            t.problems += 1
            self.problems.append(f"{kind}: {problem}")


# --- the kinds of request -------------------------------------------------------------------------
def sampling(rng: random.Random) -> dict:
    return {"temperature": 0.0} if rng.random() < 0.5 else {"temperature": 0.8, "seed": rng.randrange(1 << 16)}


def messages(rng: random.Random) -> list[dict]:
    return [{"role": "user", "content": rng.choice(QUESTIONS)}]


def check_usage(finish: str | None, usage, max_tokens: int, ignore_eos: bool, res: Result,
                finishes: tuple[str, ...] = ("stop", "length")) -> None:
    if usage is None:
        raise Wrong("no usage")
    if finish not in finishes:
        raise Wrong(f"finish_reason {finish!r}")
    n = usage.completion_tokens
    if n > max_tokens or (finish == "length" and n != max_tokens):
        raise Wrong(f"{n} completion tokens with finish_reason {finish!r}, max_tokens {max_tokens}")
    if ignore_eos and finish != "length":
        raise Wrong(f"ignore_eos, yet finish_reason {finish!r}")
    res.completion_tokens = n


async def openai_call(res: Result, make):
    """The request (an awaitable of the openai client); its status in res, a non-200 a Wrong."""
    import openai

    try:
        out = await make
    except openai.APIStatusError as e:
        res.status = e.status_code
        raise Wrong(f"HTTP {e.status_code}: {e.message}") from None
    res.status = 200
    return out


async def plain(ctx: Ctx, rng: random.Random, res: Result, chat: bool, stream: bool) -> None:
    res.endpoint = CHAT if chat else TEXT
    n, ignore_eos = rng.choice(MAX_TOKENS), rng.random() < 0.3
    kw = dict(model="load", max_tokens=n, stream=stream, extra_body={"ignore_eos": True} if ignore_eos else None,
              **sampling(rng))
    api = ctx.oa.chat.completions if chat else ctx.oa.completions
    if chat:
        kw["messages"] = messages(rng)
    else:
        kw["prompt"] = rng.choice(prompts(16))
    answer = await openai_call(res, api.create(**kw))
    if stream:
        finish = usage = None
        async for chunk in answer:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            usage = chunk.usage or usage
    else:
        finish, usage = answer.choices[0].finish_reason, answer.usage
    check_usage(finish, usage, n, ignore_eos, res)


async def extras(ctx: Ctx, rng: random.Random, res: Result) -> None:
    res.endpoint = CHAT
    n, name = rng.choice(MAX_TOKENS), rng.choice(("gpt-4o-mini", "some/other-model"))
    answer = await openai_call(res, ctx.oa.chat.completions.create(
        model=name, messages=messages(rng), max_tokens=n, user="load", **sampling(rng),
        extra_body={"x_load_test": {"nested": [1, "two", None]}, "priority": -3}))
    check_usage(answer.choices[0].finish_reason, answer.usage, n, False, res)
    if answer.model != name:
        raise Wrong(f"model {answer.model!r} in the answer, {name!r} sent")


async def tools(ctx: Ctx, rng: random.Random, res: Result) -> None:
    res.endpoint = CHAT
    n, stream = 64, rng.random() < 0.5
    choice = rng.choice(("auto", "required", {"type": "function", "function": {"name": "get_time"}}))
    answer = await openai_call(res, ctx.oa.chat.completions.create(
        model="load", messages=[{"role": "user", "content": "What will the weather be in Oslo for 3 days?"}],
        tools=TOOLS, tool_choice=choice, max_tokens=n, stream=stream, **sampling(rng)))
    if stream:
        finish = usage = None
        calls: dict[int, list[str]] = {}
        async for chunk in answer:
            usage = chunk.usage or usage
            if not chunk.choices:
                continue
            finish = chunk.choices[0].finish_reason or finish
            for d in chunk.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(d.index, ["", ""])
                entry[0] = d.function.name or entry[0]
                entry[1] += d.function.arguments or ""
        found = [tuple(v) for _, v in sorted(calls.items())]
    else:
        finish, usage = answer.choices[0].finish_reason, answer.usage
        found = [(c.function.name, c.function.arguments) for c in answer.choices[0].message.tool_calls or []]
    check_usage(finish, usage, n, False, res, ("stop", "length", "tool_calls"))
    if choice != "auto" and finish != "length" and (finish != "tool_calls" or not found):
        raise Wrong(f"tool_choice {choice!r}: finish_reason {finish!r} with {len(found)} calls")
    if (finish == "tool_calls") != bool(found):
        raise Wrong(f"finish_reason {finish!r} with {len(found)} calls")
    for name, arguments in found:
        if name not in TOOL_NAMES or not isinstance(json.loads(arguments), dict):
            raise Wrong(f"a call of {name!r} with arguments {arguments!r}")


async def json_object(ctx: Ctx, rng: random.Random, res: Result) -> None:
    res.endpoint = CHAT
    n = 32
    answer = await openai_call(res, ctx.oa.chat.completions.create(
        model="load", messages=messages(rng), response_format={"type": "json_object"}, max_tokens=n, **sampling(rng)))
    choice = answer.choices[0]
    check_usage(choice.finish_reason, answer.usage, n, False, res)
    if choice.finish_reason == "stop" and not isinstance(json.loads(choice.message.content), dict):
        raise Wrong(f"reply {choice.message.content!r} is not a JSON object")


def leaving_body(rng: random.Random, chat: bool, stream: bool) -> dict:
    body = {"model": "load", "max_tokens": LEAVE_TOKENS, "ignore_eos": True, "stream": stream, **sampling(rng)}
    return {**body, "messages": messages(rng)} if chat else {**body, "prompt": rng.choice(prompts(16))}


def sse_data(line: str):
    """A server-sent event's data (None for other lines); an error event is a Wrong."""
    if not line.startswith("data: "):
        return None
    data = line[len("data: "):]
    if data == "[DONE]":
        return data
    body = json.loads(data)
    if "error" in body:
        raise Wrong(f"error event: {body['error']}")
    return body


async def cancel_mid(ctx: Ctx, rng: random.Random, res: Result) -> None:
    chat = rng.random() < 0.5
    res.endpoint, res.unread_tokens = (CHAT if chat else TEXT), LEAVE_TOKENS
    want = rng.randint(1, 4)
    async with ctx.hx.stream("POST", ctx.url + res.endpoint, json=leaving_body(rng, chat, True)) as r:
        res.status = r.status_code
        if r.status_code != 200:
            raise Wrong(f"HTTP {r.status_code}")
        async for line in r.aiter_lines():
            body = sse_data(line)
            if body == "[DONE]":
                raise Wrong(f"the stream ended after {res.chunks} text chunks ({LEAVE_TOKENS} tokens, ignore_eos)")
            if body is not None and body["choices"]:
                choice = body["choices"][0]
                if (choice.get("delta") or {}).get("content") or choice.get("text"):
                    res.chunks += 1
                    if res.chunks == want:
                        break
        res.left = True         # leaving the block closes the connection mid-body


async def cancel_early(ctx: Ctx, rng: random.Random, res: Result) -> None:
    chat = rng.random() < 0.5
    res.endpoint, res.unread_tokens = (CHAT if chat else TEXT), LEAVE_TOKENS
    async with ctx.hx.stream("POST", ctx.url + res.endpoint, json=leaving_body(rng, chat, True)) as r:
        res.status = r.status_code
        if r.status_code != 200:
            raise Wrong(f"HTTP {r.status_code}")
        res.left = True


async def abort(ctx: Ctx, rng: random.Random, res: Result) -> None:
    chat = rng.random() < 0.5
    res.endpoint, res.unread_tokens, res.left = (CHAT if chat else TEXT), LEAVE_TOKENS, True
    body = json.dumps(leaving_body(rng, chat, rng.random() < 0.5)).encode()
    _, writer = await asyncio.open_connection(HOST, ctx.port)
    writer.write(f"POST {res.endpoint} HTTP/1.1\r\nHost: {HOST}:{ctx.port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    writer.close()
    await writer.wait_closed()


async def give_up(ctx: Ctx, rng: random.Random, res: Result) -> None:
    import httpx

    chat = rng.random() < 0.5
    res.endpoint = CHAT if chat else TEXT
    try:
        r = await ctx.hx.post(ctx.url + res.endpoint, json=leaving_body(rng, chat, False),
                              timeout=rng.uniform(0.3, 1.5))
    except httpx.TimeoutException:
        res.left, res.unread_tokens = True, LEAVE_TOKENS
        return
    res.status = r.status_code      # it beat the timeout: a whole answer
    if r.status_code != 200:
        raise Wrong(f"HTTP {r.status_code}: {r.text[:200]}")
    body = r.json()
    if body["usage"]["completion_tokens"] != LEAVE_TOKENS:
        raise Wrong(f"{body['usage']['completion_tokens']} tokens, {LEAVE_TOKENS} asked with ignore_eos")
    res.completion_tokens = LEAVE_TOKENS


def malformed_cases(n_ctx: int) -> list[tuple[str, str, str, dict, int]]:
    """(name, method, path, httpx request arguments, the status it must get)."""
    chat = {"model": "load", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    text = {"model": "load", "prompt": "Hello", "max_tokens": 4}
    post = [
        ("bad JSON", CHAT, {"content": b'{"messages": [{"role": "user", "content": "hi"}'}),
        ("not UTF-8", TEXT, {"content": b'{"prompt": "\xff\xfe"}'}),
        ("a JSON array", TEXT, {"json": [1, 2, 3]}),
        ("missing messages", CHAT, {"json": {"model": "load", "max_tokens": 4}}),
        ("missing prompt", TEXT, {"json": {"model": "load", "max_tokens": 4}}),
        ("messages of the wrong type", CHAT, {"json": {**chat, "messages": "hello"}}),
        ("temperature of the wrong type", CHAT, {"json": {**chat, "temperature": "hot"}}),
        ("stream of the wrong type", TEXT, {"json": {**text, "stream": "yes"}}),
        ("max_tokens of the wrong type", TEXT, {"json": {**text, "max_tokens": "8"}}),
        ("model of the wrong type", CHAT, {"json": {**chat, "model": 7}}),
        ("negative max_tokens", CHAT, {"json": {**chat, "max_tokens": -3}}),
        ("negative max_tokens", TEXT, {"json": {**text, "max_tokens": -1}}),
        ("response_format of an unknown type", CHAT, {"json": {**chat, "response_format": {"type": "yaml"}}}),
        ("a nonsense json_schema", CHAT, {"json": {**chat, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}}),
        ("a json_schema that is not an object", TEXT, {"json": {**text, "response_format": {
            "type": "json_schema", "json_schema": "object"}}}),
        ("a prompt longer than the context", TEXT, {"json": {**text, "prompt": "word " * (n_ctx + 16)}}),
        ("tool_choice naming no tool", CHAT, {"json": {**chat, "tools": TOOLS, "tool_choice": {
            "type": "function", "function": {"name": "nope"}}}}),
    ]
    return [(name, "POST", path, kw, 400) for name, path, kw in post] + [
        ("an unknown path", "POST", "/v1/nothing", {"json": chat}, 404),
        ("a wrong method", "GET", TEXT, {}, 405),
    ]


async def malformed(ctx: Ctx, rng: random.Random, res: Result) -> None:
    name, method, path, kw, want = rng.choice(malformed_cases(ctx.n_ctx))
    res.endpoint = path if path in COUNTED and method == "POST" else None
    r = await ctx.hx.request(method, ctx.url + path, **kw)
    res.status = r.status_code
    if r.status_code != want:
        raise Wrong(f"{name}: HTTP {r.status_code}, {want} expected: {r.text[:200]}")
    try:
        error = r.json()["error"]
        shaped = set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
    except (ValueError, KeyError, TypeError):
        shaped = False
    if not shaped:
        raise Wrong(f"{name}: not an OpenAI error body: {r.text[:200]}")


# kind -> (group, weight, request)
KINDS = {
    "chat": ("normal", 10, lambda ctx, rng, res: plain(ctx, rng, res, chat=True, stream=False)),
    "chat_stream": ("normal", 10, lambda ctx, rng, res: plain(ctx, rng, res, chat=True, stream=True)),
    "text": ("normal", 8, lambda ctx, rng, res: plain(ctx, rng, res, chat=False, stream=False)),
    "text_stream": ("normal", 10, lambda ctx, rng, res: plain(ctx, rng, res, chat=False, stream=True)),
    "extras": ("normal", 4, extras),
    "tools": ("normal", 4, tools),
    "json_object": ("normal", 4, json_object),
    "cancel_mid": ("cancel", 8, cancel_mid),
    "cancel_early": ("cancel", 6, cancel_early),
    "abort": ("cancel", 4, abort),
    "give_up": ("cancel", 4, give_up),
    "malformed": ("malformed", 16, malformed),
}


async def client(ctx: Ctx, seed: int, index: int, deadline: float) -> None:
    rng = random.Random(f"{seed}:{index}")
    names, weights = list(KINDS), [w for _, w, _ in KINDS.values()]
    while time.monotonic() < deadline:
        kind = rng.choices(names, weights)[0]
        res, problem = Result(None), None
        ctx.inflight += 1
        try:
            await KINDS[kind][2](ctx, rng, res)
        except Wrong as e:
            problem = str(e)
        except Exception as e:      # noqa: BLE001 - any other exception is a finding, reported with its kind
            problem = f"{type(e).__name__}: {e}"
        ctx.inflight -= 1
        ctx.record(kind, res, problem)


# --- the server's side ----------------------------------------------------------------------------
class Every(threading.Thread):
    """read() every second until stop(): its (seconds since start, value) samples, None skipped."""

    def __init__(self, read):
        super().__init__(daemon=True)
        self.read, self.samples, self.t0 = read, [], time.monotonic()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            value = self.read()
            if value is not None:
                self.samples.append((time.monotonic() - self.t0, value))
            self._stop_event.wait(1.0)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def vm_rss(pid: int) -> int | None:
    """A process's resident memory in bytes (None once it is gone: the "server" check says so)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            line = next(line for line in fh if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) * 1024


def held_beyond(ctx: Ctx) -> int | None:
    """The requests the server holds (/health: waiting + in use) beyond those the clients have in
    flight, which every request the server holds was sent by, unless its client left."""
    before = ctx.inflight
    try:
        with urllib.request.urlopen(ctx.url + "/health", timeout=5) as r:
            health = json.load(r)
    except (OSError, ValueError):
        return None
    return health["requests_waiting"] + health["sessions_in_use"] - max(before, ctx.inflight)


def rss_figures(samples: list[tuple[float, int]], warm_s: float) -> dict | None:
    """MiB: the first sample at or after warm_s, the largest from there on, the growth between them."""
    after = [rss for t, rss in samples if t >= warm_s]
    if not after:
        return None
    mib = 2 ** 20
    return {"start": round(samples[0][1] / mib, 1), "first_after_warmup": round(after[0] / mib, 1),
            "max_after_warmup": round(max(after) / mib, 1), "growth": round((max(after) - after[0]) / mib, 1),
            "end": round(samples[-1][1] / mib, 1),
            "series": [[round(t, 1), round(rss / mib, 1)] for t, rss in samples]}


def held_figures(excess: list[int], n_left: int, duration: float) -> dict | None:
    """The requests held beyond those in flight, sampled every second: their mean and largest; and
    let_go_s, by Little's law how long the server went on holding a request after its client left,
    on average: the mean excess over the rate at which clients left (an upper bound: requests in
    flight that the server has not yet received, or has answered but the client not yet read,
    lower the excess)."""
    if not excess:
        return None
    mean = statistics.fmean(excess)
    return {"mean": round(mean, 2), "max": max(excess), "samples": len(excess),
            "let_go_s": round(mean * duration / n_left, 3) if n_left else None}


REQUEST_LINE = re.compile(r'^hybridrt_requests_total\{endpoint="([^"]*)",status="(\d+)"\} (\S+)$')


def parse_metrics(text: str) -> tuple[dict[str, float], Counter]:
    """/metrics' plain values by name, and its requests by (endpoint, status)."""
    values, requests = {}, Counter()
    for line in text.splitlines():
        m = REQUEST_LINE.match(line)
        if m:
            requests[m[1], int(m[2])] = int(float(m[3]))
        elif line and not line.startswith("#") and "{" not in line:
            name, value = line.split()
            values[name] = float(value)
    return values, requests


async def settle(ctx: Ctx) -> tuple[dict | None, dict[str, float], Counter]:
    """After the clients: wait (IDLE_S at most) until no session is in use, no request waits and
    /metrics has counted every request the clients sent to the counted endpoints (a handler whose
    client left may still be polling for the disconnect); then /health's answer and /metrics."""
    sent = {ep: sum(n for (e, _), n in ctx.seen.items() if e == ep) + ctx.unseen[ep] for ep in COUNTED}
    deadline = time.monotonic() + IDLE_S
    while True:
        values, requests = parse_metrics((await ctx.hx.get(ctx.url + "/metrics", timeout=10)).text)
        counted = {ep: sum(n for (e, _), n in requests.items() if e == ep) for ep in COUNTED}
        idle = values.get("hybridrt_sessions_in_use") == 0 and values.get("hybridrt_requests_waiting") == 0
        if (idle and all(counted[ep] >= sent[ep] for ep in COUNTED)) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    r = await ctx.hx.get(ctx.url + "/health", timeout=10)
    health = {"http_status": r.status_code, **(r.json() if r.status_code == 200 else {})}
    return health, values, requests


# --- the checks -----------------------------------------------------------------------------------
def check_requests(ctx: Ctx, requests: Counter) -> tuple[bool, str]:
    """Per counted endpoint: the server's count of each status equals the clients', but for the
    requests no client saw answered, which add to 200 or 499 alone."""
    ok, parts = True, []
    for ep in COUNTED:
        server = {st: n for (e, st), n in requests.items() if e == ep}
        clients = {st: n for (e, st), n in ctx.seen.items() if e == ep}
        extra = {st: server.get(st, 0) - clients.get(st, 0) for st in set(server) | set(clients)}
        extra = {st: n for st, n in extra.items() if n}
        fits = all(n > 0 and st in (200, 499) for st, n in extra.items()) and sum(extra.values()) == ctx.unseen[ep]
        ok &= fits
        parts.append(f"{ep}: server {dict(sorted(server.items()))}, clients {dict(sorted(clients.items()))} "
                     f"+ {ctx.unseen[ep]} unseen" + ("" if fits else " MISMATCH"))
    return ok, "; ".join(parts)


def checks(ctx: Ctx, args, values: dict[str, float], requests: Counter, health: dict | None, rss: dict | None,
           held: dict | None, server_alive: bool, log_lines: list[str], stuck: int) -> list[dict]:
    def group_problems(group: str) -> list[str]:
        names = {k for k, (g, _, _) in KINDS.items() if g == group}
        return [p for p in ctx.problems if p.split(":", 1)[0] in names]

    out = []

    def check(name: str, ok: bool, detail: str) -> None:
        out.append({"name": name, "ok": bool(ok), "detail": detail})

    for group, what in (("normal", "well-formed requests answered as asked"),
                        ("cancel", "cancellations raised nothing unexpected"),
                        ("malformed", "malformed requests got their 4xx with an OpenAI error")):
        found = group_problems(group)
        check(f"answers: {group}", not found, what if not found else f"{len(found)} problems, first: {found[:3]}")
    check("clients finished", stuck == 0, f"{stuck} clients still waiting {DRAIN_S:.0f} s after the end" if stuck
          else "every client's last request ended")
    seen_5xx = sum(n for (_, st), n in ctx.seen.items() if st >= 500)
    server_5xx = sum(n for (_, st), n in requests.items() if st >= 500)
    check("no 5xx", seen_5xx == 0 and server_5xx == 0, f"clients saw {seen_5xx}, /metrics counted {server_5xx}")
    in_use, waiting = values.get("hybridrt_sessions_in_use"), values.get("hybridrt_requests_waiting")
    health_ok = health is not None and health.get("http_status") == 200 and health.get("status") == "ok"
    check("sessions", in_use == 0 and waiting == 0 and health_ok,
          f"in use {in_use}, waiting {waiting} (after at most {IDLE_S:.0f} s idle); /health {health}")
    check("requests", *check_requests(ctx, requests))
    tokens = values.get("hybridrt_tokens_predicted_total", -1)
    extra = tokens - ctx.usage_tokens
    check("tokens", ctx.mid_chunks <= extra <= ctx.unread_tokens,
          f"/metrics {tokens:g} = usage read {ctx.usage_tokens} + {extra:g} of left requests "
          f"(bounds {ctx.mid_chunks}..{ctx.unread_tokens})")
    cancelled = values.get("hybridrt_requests_cancelled_total", -1)
    mid = ctx.kinds["cancel_mid"].left
    left = sum(t.left for t in ctx.kinds.values())
    check("cancelled", mid <= cancelled <= left, f"/metrics {cancelled:g} cancelled generations; {mid} left "
          f"mid-stream, {left} left on purpose in all")
    if held is None or held["let_go_s"] is None:
        check("let go", held is not None, "no request left on purpose" if held else "no /health sample")
    else:
        check("let go", held["let_go_s"] <= LET_GO_S,
              f"requests held beyond the clients' in flight: mean {held['mean']}, max {held['max']}; "
              f"a request held {held['let_go_s']} s after its client left, on average (bound {LET_GO_S:g})")
    if rss is None:
        check("rss", False, "no RSS sample after the warm-up")
    else:
        check("rss", rss["growth"] <= args.rss_growth_mib,
              f"{rss['first_after_warmup']} MiB after the warm-up, max {rss['max_after_warmup']} MiB: "
              f"+{rss['growth']} MiB (bound {args.rss_growth_mib:g})")
    check("server", server_alive and not log_lines, ("running" if server_alive else "EXITED") +
          (f"; its log: {log_lines[:3]}" if log_lines else ", log clean"))
    return out


BAD_LOG = re.compile(r"Traceback|Exception in ASGI|request failed|internal error|^hybridrt serve: /")


# --- the run --------------------------------------------------------------------------------------
async def load(args, server: Server) -> dict:
    import httpx
    from openai import AsyncOpenAI

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=args.clients)
    async with AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600.0) as oa, \
            httpx.AsyncClient(timeout=600.0, limits=limits) as hx:
        ctx = Ctx(server.url, server.port, args.ctx_size, oa, hx, kinds={k: KindTally() for k in KINDS})
        rss_sampler, held_sampler = Every(lambda: vm_rss(server.proc.pid)), Every(lambda: held_beyond(ctx))
        rss_sampler.start()
        held_sampler.start()
        t0 = time.monotonic()
        deadline = t0 + args.duration
        tasks = [asyncio.create_task(client(ctx, args.seed, i, deadline)) for i in range(args.clients)]
        every = max(1.0, min(10.0, args.duration / 6))
        while time.monotonic() < deadline:
            await asyncio.sleep(min(every, max(0.0, deadline - time.monotonic())))
            done = sum(t.requests for t in ctx.kinds.values())
            rss = rss_sampler.samples[-1][1] / 2**20 if rss_sampler.samples else float("nan")
            log(f"  {time.monotonic() - t0:5.0f}/{args.duration:g} s: {done} requests, {len(ctx.problems)} problems, "
                f"server RSS {rss:.0f} MiB")
        log(f"  the clients finish their last requests (at most {DRAIN_S:.0f} s)")
        _, pending = await asyncio.wait(tasks, timeout=DRAIN_S)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        held_sampler.stop()
        log("  waiting for the server to go idle, then /metrics")
        health, values, requests = await settle(ctx)
        rss_sampler.stop()
    server_alive = server.proc.poll() is None
    log_lines = [line for line in server.output().splitlines() if BAD_LOG.search(line)]
    rss = rss_figures(rss_sampler.samples, args.warmup * args.duration)
    held = held_figures([v for _, v in held_sampler.samples], sum(t.left for t in ctx.kinds.values()), args.duration)
    result = {"kinds": {k: t.row() for k, t in ctx.kinds.items()},
              "requests": sum(t.requests for t in ctx.kinds.values()),
              "completed": sum(t.completed for t in ctx.kinds.values()),
              "completion_tokens_read": ctx.usage_tokens, "rss_mib": rss, "held": held, "health": health,
              "metrics": {k: values.get(k) for k in METRICS_SHOWN},
              "metrics_requests": {f"{ep} {st}": n for (ep, st), n in sorted(requests.items())},
              "problems": ctx.problems[:20], "n_problems": len(ctx.problems)}
    result["checks"] = checks(ctx, args, values, requests, health, rss, held, server_alive, log_lines, len(pending))
    result["ok"] = all(c["ok"] for c in result["checks"])
    return result


METRICS_SHOWN = ("hybridrt_tokens_predicted_total", "hybridrt_prompt_tokens_total", "hybridrt_requests_cancelled_total",
                 "hybridrt_sessions_in_use", "hybridrt_requests_waiting", "hybridrt_decode_tokens_per_second",
                 "hybridrt_batch_steps_total", "hybridrt_batch_rows_total")


def table(result: dict) -> str:
    head = ("kind", "requests", "statuses", "completed", "tokens", "left", "problems")
    body = [(k, str(r["requests"]), " ".join(f"{s}:{n}" for s, n in r["statuses"].items()) or "-", str(r["completed"]),
             str(r["completion_tokens"]), str(r["left"]), str(r["problems"])) for k, r in result["kinds"].items()]
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i in (0, 2) else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
             for line in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("model", nargs="?", default="smollm2-135m", metavar="MODEL",
                    help="a known name or a GGUF path (default: smollm2-135m)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="serve's -t")
    ap.add_argument("-np", "--parallel", type=int, default=4, help="serve's --parallel (llama-server's default 4)")
    ap.add_argument("-c", "--ctx-size", type=int, default=1024, help="serve's -c")
    ap.add_argument("--clients", type=int, default=64, help="concurrent clients")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    ap.add_argument("--seed", type=int, default=0, help="seeds each client's draws of kinds and parameters")
    ap.add_argument("--warmup", type=float, default=0.2, help="fraction of --duration before RSS must stay flat")
    ap.add_argument("--rss-growth-mib", type=float, default=64.0, help="largest RSS growth after the warm-up")
    ap.add_argument("--serve-args", default="", metavar="FLAGS", help="more `hybridrt serve` flags, quoted")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the table")
    return ap.parse_args(argv)


def check_args(args: argparse.Namespace) -> Path:
    """Every input checked before the server starts (UserError: one error line, exit 2)."""
    for flag, value, least in (("-t", args.threads, 1), ("--parallel", args.parallel, 1), ("--clients", args.clients, 1),
                               ("--duration", args.duration, 2), ("-c", args.ctx_size, 64),
                               ("--rss-growth-mib", args.rss_growth_mib, 0)):
        if value < least:
            raise UserError(f"{flag} {value:g}: must be >= {least}")
    if args.clients > 1024:
        raise UserError(f"--clients {args.clients}: at most 1024")
    if not 0 <= args.warmup < 1:
        raise UserError(f"--warmup {args.warmup:g}: a fraction of the run in [0, 1)")
    args.serve_flags = serve_flags(args.serve_args, "--serve-args", SERVER_FLAGS | {"--max-queue"})
    return gguf_path(args.model)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        path = check_args(args)
        machine = {"command": ["scripts/load_serve.py", *argv], **host(False)}
        log(f"{machine['cpu']}, {machine['cores']} cores, load {machine['load_avg']:.2f}")
        flags = ["--max-queue", str(2 * args.clients), *args.serve_flags]
        log(f"{path.name}: hybridrt serve --parallel {args.parallel} -t {args.threads} -c {args.ctx_size} "
            f"{' '.join(flags)}")
        server = Server(path, args.threads, args.parallel, args.ctx_size, flags)
    except (UserError, GGUFError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, (UserError, GGUFError)) else 1      # bad input, or a server that failed
    try:
        log(f"{args.clients} clients for {args.duration:g} s (seed {args.seed})")
        result = asyncio.run(load(args, server))
    finally:
        server.close()
    settings = {"model": path.name, "threads": args.threads, "parallel": args.parallel, "ctx_size": args.ctx_size,
                "clients": args.clients, "duration_s": args.duration, "seed": args.seed, "warmup": args.warmup,
                "rss_growth_mib": args.rss_growth_mib, "serve_args": args.serve_flags}
    if args.json:
        print(json.dumps({"machine": machine, "settings": settings, **result}))
    else:
        print(f"{machine['cpu']} ({machine['cores']} cores), {machine['date']}, commit {machine['commit']}; "
              f"{path.name}, --parallel {args.parallel}, -t {args.threads}, {args.clients} clients, "
              f"{args.duration:g} s, seed {args.seed}")
        print(table(result))
        m, rss = result["metrics"], result["rss_mib"]
        print(f"{result['requests']} requests, {result['completed']} generations completed, "
              f"{result['completion_tokens_read']} completion tokens read; /metrics: "
              f"{m['hybridrt_tokens_predicted_total']:g} tokens predicted, "
              f"{m['hybridrt_requests_cancelled_total']:g} cancelled, decode {m['hybridrt_decode_tokens_per_second']:.1f} t/s")
        if rss:
            print(f"RSS MiB: start {rss['start']}, after warm-up {rss['first_after_warmup']}, "
                  f"max {rss['max_after_warmup']} (+{rss['growth']}), end {rss['end']}")
        for c in result["checks"]:
            print(f"{'PASS' if c['ok'] else 'FAIL'}  {c['name']}: {c['detail']}")
    failed = [c["name"] for c in result["checks"] if not c["ok"]]
    if failed:
        print(f"error: load test failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

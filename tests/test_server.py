"""`hybridrt serve` end to end: a server process on a free 127.0.0.1 port with SmolLM2, spoken to
with the real `openai` client and with raw HTTP (httpx). Greedy answers equal
`hybridrt.decoding.generate.generate` on the same prompt; errors are OpenAI-shaped JSON with the right
status; a client that leaves frees its session; a full queue answers 503; a bounded load test of
mixed requests leaves every session free and the server's RSS flat. Nothing leaves loopback."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
import torch

from hybridrt.errors import UserError
from hybridrt.decoding.generate import generate
from hybridrt.decoding.sampling import SamplerConfig
from hybridrt.server.logprobs import LogprobTrack, TokenLogprob
from hybridrt.server.stops import StopScanner
from tests.real_models import SMOLLM2, require

HOST = "127.0.0.1"
MODEL = "smollm2-135m"
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"

# the in-process reference decoding must not spin a second thread pool on the cores the server uses
pytestmark = pytest.mark.usefixtures("single_thread")


# ----------------------------------------------------------------------------- unit: stop strings
def _scan(stops, pieces):
    s = StopScanner(tuple(stops))
    out = "".join(s.push(p) for p in pieces)
    return out + ("" if s.stopped else s.flush()), s.stopped


def test_stop_scanner_spans_pieces_and_never_emits_the_stop():
    assert _scan(["END"], ["ab", "cE", "N", "Dxyz"]) == ("abc", True)
    assert _scan(["END"], ["ab", "cE", "N"]) == ("abcEN", False)          # held back, then flushed
    assert _scan(["\n", "c"], ["ab", "c\nd"]) == ("ab", True)              # the earliest stop wins
    assert _scan([], ["a", "b"]) == ("ab", False)


def test_logprob_track_releases_a_token_once_its_text_shows():
    e = [TokenLogprob(t, -1.0, ()) for t in range(4)]
    track = LogprobTrack()
    for entry, n in zip(e, (1, 0, 2, 3)):       # text offsets 0, 1, 1, 3 (token 1: half a character)
        track.add(entry, n)
    assert [x for x, _ in track.shown(1)] == e[:1] and track.shown(1) == []
    assert track.shown(2) == [(e[1], 1), (e[2], 1)]
    assert track.rest(stopped=True, total=3) == []            # token 3 lies wholly in a stop string
    assert track.rest(stopped=False, total=3) == [(e[3], 3)]


def test_a_session_keeps_its_length_policies_between_requests(tiny_qwen35_mtp):
    """The pool continues adaptive length's policies from one request to the next on a session
    (generate's `policies`): one per session, greedy and sampled requests apart; each
    request's output is still plain decoding's."""
    from hybridrt.runtime.loader import load_model
    from hybridrt.server.metrics import Metrics
    from hybridrt.server.pool import ServeConfig, SessionPool
    from hybridrt.server.schemas import GenRequest
    from hybridrt.decoding.speculative.loop import SpecConfig

    m = load_model(tiny_qwen35_mtp)
    pool = SessionPool(m, ServeConfig(n_ctx=256, spec_type="draft-mtp", spec=SpecConfig(n_max=2, adaptive=True), n_parallel=2),
                       Metrics(2))
    s0, s1 = pool.sessions
    ids = [5, 9, 31, 7, 12, 40]
    ref, _ = generate(m, m.session(256), ids, 12, SamplerConfig(temp=0.0), stop_ids=set())
    seen = []
    for session, temp in ((s0, 0.0), (s0, 0.0), (s1, 0.0), (s0, 0.7)):
        req = GenRequest("text", "m", ids, 12, SamplerConfig(temp=temp, seed=3), (), False, ignore_eos=True)
        out, _ = pool._generate(session, req, lambda token: False, None, None)
        if temp == 0.0:
            assert out == ref
        kept = pool._policies[(id(session), temp == 0.0)]
        assert len(kept) == 1
        seen.extend(kept.values())
    assert seen[1] is seen[0]                                  # the same session's next greedy request
    assert seen[2] is not seen[0] and seen[3] is not seen[0]     # another session; a sampled request
    assert len(pool._policies) == 3


def test_serve_warm_up_starts_every_sessions_policies_from_its_timings(tiny_qwen35_mtp):
    """serve's warm-up (warmup.warm_up, before the pool's sessions are made) times the verify sizes;
    each session's greedy and sampled policies start from a copy of those timings, and a request
    continues its session's copy, with plain decoding's output."""
    from hybridrt.runtime.loader import load_model
    from hybridrt.server.metrics import Metrics
    from hybridrt.server.pool import ServeConfig, SessionPool
    from hybridrt.server.schemas import GenRequest
    from hybridrt.decoding.speculative.loop import SpecConfig
    from hybridrt.runtime.warmup import warm_up

    m = load_model(tiny_qwen35_mtp)
    spec = SpecConfig(n_max=2, adaptive=True)
    policies = warm_up(m, "draft-mtp", spec, SamplerConfig(temp=0.0), "f16")
    pool = SessionPool(m, ServeConfig(n_ctx=256, spec_type="draft-mtp", spec=spec, n_parallel=2), Metrics(2),
                       policies=policies)
    kept = [pool._policies[(id(s), greedy)]["draft-mtp"] for s in pool.sessions for greedy in (True, False)]
    assert len({id(p) for p in kept} | {id(policies["draft-mtp"])}) == 5       # copies, one each
    assert all(sorted(p.verify_s) == [1, 2, 3] and p.draft_timed for p in kept)
    ids = [5, 9, 31, 7, 12, 40]
    ref, _ = generate(m, m.session(256), ids, 12, SamplerConfig(temp=0.0), stop_ids=set())
    req = GenRequest("text", "m", ids, 12, SamplerConfig(temp=0.0), (), False, ignore_eos=True)
    out, _ = pool._generate(pool.sessions[0], req, lambda token: False, None, None)
    assert out == ref and pool._policies[(id(pool.sessions[0]), True)]["draft-mtp"] is kept[0]
    assert SessionPool(m, ServeConfig(n_ctx=64, n_parallel=1), Metrics(1))._policies == {}


def test_serve_without_the_stack_prints_one_install_line(monkeypatch):
    from hybridrt.cli import serve as cli_serve

    monkeypatch.setitem(sys.modules, "uvicorn", None)        # import uvicorn -> ImportError
    with pytest.raises(UserError, match=r"pip install 'hybridrt\[serve\]'"):
        cli_serve._server_stack()


def test_serve_bad_flags_are_one_line_errors():
    r = subprocess.run([sys.executable, "-c", "from hybridrt.cli.commands import main; main()", "serve", "-m", MODEL,
                        "-ctk", "q4_0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert r.stderr.startswith("error: unsupported KV cache type 'q4_0'")


# ----------------------------------------------------------------------------- the server process
def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, log_path, *args: str):
        self.port = _free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        cmd = [sys.executable, "-c", "from hybridrt.cli.commands import main; main()", "serve", "-m", MODEL,
               "--host", HOST, "--port", str(self.port), "--log-level", "warning", "-t", "1", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300      # a fresh clone compiles every kernel first (minutes beside another worker)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {open(log_path).read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError(f"server did not come up: {open(log_path).read()}")

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def wait_idle(self, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if (h["sessions_in_use"] == 0 and h["requests_waiting"] == 0) or time.monotonic() > deadline:
                return h
            time.sleep(0.05)

    def rss(self) -> int:
        return psutil.Process(self.proc.pid).memory_info().rss

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require(SMOLLM2)
    s = Server(tmp_path_factory.mktemp("serve") / "serve.log", "-c", "512", "--parallel", "2",
               "--spec-type", "ngram-simple", "--spec-draft-n-max", "4")
    yield s
    s.close()


@pytest.fixture(scope="module")
def model():
    from hybridrt.runtime.loader import load_model

    return load_model(require(SMOLLM2))


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _greedy_text(model, ids, n) -> str:
    out, _ = generate(model, model.session(512, "f16"), ids, n, SamplerConfig(temp=0.0))   # serve's default cache
    stream = model.tokenizer.stream()
    return "".join(stream.push(t) for t in out) + stream.flush()


def _chat_ids(model, messages):
    text = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return model.tokenize(text, add_special=True, parse_special=True)


def _sse_events(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ----------------------------------------------------------------------------- OpenAI client
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = server.health()
    assert h["status"] == "ok" and h["sessions"] == 2


def test_chat_greedy_equals_generate(client, model):
    want = _greedy_text(model, _chat_ids(model, CHAT), 24)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(_chat_ids(model, CHAT))
    assert 0 < r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    timings = r.model_extra["timings"]
    assert timings["prompt_n"] == r.usage.prompt_tokens and timings["predicted_per_second"] > 0
    assert "draft_n" in timings                  # the server speculates (ngram-simple)

    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_any_model_name_is_served_and_neutral_penalties_pass(server, model):
    """As llama.cpp's server: one model is served, whatever `model` a client names (clients set up for
    another server still work), and the name comes back; penalties at their neutral values pass."""
    body = {"model": "gpt-4o", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "presence_penalty": 0,
            "frequency_penalty": 0.0, "repeat_penalty": 1}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "gpt-4o"
    assert r.json()["choices"][0]["text"] == _greedy_text(model, model.tokenize(PROMPT), 8)


def test_completion_greedy_and_stop_strings(client, model):
    want = _greedy_text(model, model.tokenize(PROMPT), 16)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    stop = want.strip()[2:5]
    cut = want[:want.index(stop)]
    for stops in (stop, ["@@never@@", stop]):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stops)
        assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
        streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                                  stop=stops, stream=True))
        assert "".join(c.choices[0].text for c in streamed) == cut
        assert streamed[-1].choices[0].finish_reason == "stop"


def _log_softmax_rows(model, ids, n):
    """The rows plain greedy decoding draws its n tokens from, as log-probabilities."""
    rows = []
    out, _ = generate(model, model.session(512, "f16"), ids, n, SamplerConfig(temp=0.0),
                      on_logits=lambda t, row: rows.append(torch.log_softmax(row.float(), -1)))
    return out, rows


def test_chat_logprobs_are_the_targets_own(client, model):
    """Each token's logprob is log softmax of the target's row it was drawn from (the server
    speculates: those rows come from verify passes), top_logprobs best first, and the streamed
    chunks carry the same entries as the whole answer."""
    out, rows = _log_softmax_rows(model, _chat_ids(model, CHAT), 12)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert [bytes(c.bytes) for c in content] == [model.tokenizer.token_to_piece(t) for t in out]
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c, t, lp in zip(content, out, rows):
        assert abs(c.logprob - float(lp[t])) < 1e-3
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token      # greedy: the best
        assert [x.logprob for x in c.top_logprobs] == sorted((x.logprob for x in c.top_logprobs), reverse=True)
        assert abs(c.top_logprobs[1].logprob - float(torch.topk(lp, 2).values[1])) < 1e-3
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [(c.token, round(c.logprob, 4)) for c in streamed] == [(c.token, round(c.logprob, 4)) for c in content]
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_echo_scores_the_prompt(client, model):
    """echo + logprobs + max_tokens 0 (how evaluation harnesses score text): the prompt's tokens,
    each with log P(token | the tokens before it), the first one None, offsets into the text."""
    ids = model.tokenize(PROMPT)
    lp = torch.log_softmax(model.session(512, "f16").eval(ids, logits="all").float(), -1)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    c = r.choices[0]
    assert c.text == PROMPT and r.usage.completion_tokens == 0
    assert c.logprobs.tokens == [model.tokenizer.token_to_piece(t).decode() for t in ids]
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(c.logprobs.token_logprobs[i] - float(lp[i - 1, ids[i]])) < 1e-3
        assert len(c.logprobs.top_logprobs[i]) <= 2
    assert all(c.text[o:].startswith(t) for o, t in zip(c.logprobs.text_offset, c.logprobs.tokens))
    # echo with a continuation: the prompt's entries, then the generated tokens' after the prompt's text
    out, rows = _log_softmax_rows(model, ids, 6)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, echo=True, logprobs=1, temperature=0)
    c = r.choices[0]
    assert c.text == PROMPT + _greedy_text(model, ids, 6)
    assert c.logprobs.text_offset[len(ids)] == len(PROMPT)
    for got, t, row in zip(c.logprobs.token_logprobs[len(ids):], out, rows):
        assert abs(got - float(row[t])) < 1e-3
    # the prompt's scores now come from the decoder's own prefill (one evaluation of the prompt)
    assert c.logprobs.token_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(c.logprobs.token_logprobs[i] - float(lp[i - 1, ids[i]])) < 1e-3
    # a one-token prompt: nothing to score, its entry still comes first
    one = model.tokenizer.token_to_piece(ids[0]).decode()
    r = client.completions.create(model=MODEL, prompt=[ids[0]], max_tokens=2, echo=True, logprobs=0, temperature=0)
    c = r.choices[0]
    assert c.text.startswith(one) and c.logprobs.token_logprobs[0] is None and c.logprobs.tokens[0] == one
    assert len(c.logprobs.tokens) == 3 and c.logprobs.text_offset[1] == len(one)


def test_completion_logprobs_stop_where_the_text_stops(client, model):
    """A stop string's tokens are not listed (their text is never shown)."""
    want = _greedy_text(model, model.tokenize(PROMPT), 16)
    stop = want.strip()[2:5]
    cut = want[:want.index(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop, logprobs=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == cut and lp.tokens and all(o < len(cut) for o in lp.text_offset)
    assert "".join(lp.tokens).startswith(cut) and not "".join(lp.tokens[:-1]).startswith(cut + stop)


def test_seeded_sampling_is_reproducible(client):
    def ask():
        return client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0.9,
                                              top_p=0.9, seed=1234).choices[0].message.content
    assert ask() == ask()


# ----------------------------------------------------------------------------- raw HTTP
def test_raw_http_stream_shapes(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(r)
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert last["object"] == "text_completion" and last["choices"][0]["finish_reason"] == "length"
    assert last["usage"]["completion_tokens"] == 6 and last["timings"]["predicted_n"] == 6
    assert all("usage" not in e for e in events[:-2])


BAD = [
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0]"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": 5}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": [""]}, 400, "stop"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": PROMPT, "ignore_eos": 1}, 400, "ignore_eos"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 2}, 400, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "model": 7}, 400, "model"),
    ("/v1/chat/completions", {"messages": CHAT, "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": PROMPT, "frequency_penalty": -1}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": PROMPT, "repeat_penalty": 1.1}, 400, "repeat_penalty"),
    ("/v1/completions", {"prompt": "word " * 600}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": {"a": 1}}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 3}, 400, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 6}, 400, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    # tools and structured output (tests/test_server_tools.py has the rest): misuse is named
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/completions", {"prompt": PROMPT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, 400, "functions"),
    ("/v1/completions", {"prompt": PROMPT, "json_schema": "{}"}, 400, "json_schema"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{b[2]}-{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert "Traceback" not in r.text


def test_malformed_and_unknown(server, client):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(server.url + "/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    from openai import BadRequestError

    with pytest.raises(BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
    assert server.health()["status"] == "ok"


def test_ignore_eos_generates_max_tokens(server):
    """llama.cpp server's `ignore_eos`: the end-of-generation token does not stop the completion.
    Greedy after "... Paris." this model ends its turn at once; told to ignore that, it writes on."""
    body = {"model": MODEL, "prompt": "Q: What is the capital of France?\nA: Paris.", "max_tokens": 40,
            "temperature": 0}
    plain = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
    assert plain["choices"][0]["finish_reason"] == "stop" and plain["usage"]["completion_tokens"] < 40
    r = httpx.post(server.url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=120).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 40


def test_disconnect_mid_stream_frees_the_session(server):
    # ignore_eos: the request must still be running when the client gives up, whatever it samples
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0.8, "seed": 1, "stream": True,
            "ignore_eos": True}
    before = _metric(server, "hybridrt_requests_cancelled_total")
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
    assert server.wait_idle(10.0)["sessions_in_use"] == 0
    deadline = time.monotonic() + 10
    while _metric(server, "hybridrt_requests_cancelled_total") == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(server, "hybridrt_requests_cancelled_total") == before + 1

    # a non-streaming client that gives up is noticed too (the handler polls for the disconnect)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=1.0)
    assert server.wait_idle(10.0)["sessions_in_use"] == 0
    deadline = time.monotonic() + 10
    while _metric(server, "hybridrt_requests_cancelled_total") == before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(server, "hybridrt_requests_cancelled_total") == before + 2


def test_event_loop_stays_responsive_while_decoding(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 120, "temperature": 0.8, "seed": 2, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        waits = []
        for _ in range(5):
            t0 = time.monotonic()
            assert server.health()["sessions_in_use"] >= 1
            waits.append(time.monotonic() - t0)
    assert max(waits) < 1.0, waits
    assert server.wait_idle()["sessions_in_use"] == 0


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def test_metrics_text(server, client):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.headers["content-type"].startswith("text/plain")
    for name in ("hybridrt_prompt_tokens_per_second", "hybridrt_decode_tokens_per_second",
                 "hybridrt_spec_acceptance_rate", "hybridrt_spec_tokens_per_step", "hybridrt_tokens_predicted_total"):
        assert _metric(server, name) > 0, name
    assert 'hybridrt_requests_total{endpoint="/v1/completions",status="200"}' in r.text
    # two sessions of SmolLM2 share steps: every step served at least one eval, each eval a row or more
    steps, evals = _metric(server, "hybridrt_batch_steps_total"), _metric(server, "hybridrt_batch_evals_total")
    assert 0 < steps <= evals <= _metric(server, "hybridrt_batch_rows_total")


# ----------------------------------------------------------------------------- queue and load
def test_a_request_whose_client_left_while_queued_gives_up_its_place(tiny_llama):
    """A queued job whose client leaves (Job.cancel) leaves the queue at once: it no longer counts
    in `waiting` nor against --max-queue, and no session ever decodes it. Before, it held its
    place until a worker reached it, and under load live clients got 503s (scripts/load_serve.py)."""
    import asyncio

    from hybridrt.runtime.loader import load_model
    from hybridrt.server.errors import APIError
    from hybridrt.server.metrics import Metrics
    from hybridrt.server.pool import Job, ServeConfig, SessionPool
    from hybridrt.server.schemas import GenRequest

    metrics = Metrics(1)
    pool = SessionPool(load_model(tiny_llama), ServeConfig(n_ctx=64, n_parallel=1, max_queue=2), metrics)
    loop = asyncio.new_event_loop()
    req = GenRequest("text", "m", [5, 9, 31], 4, SamplerConfig(temp=0.0), (), False, ignore_eos=True)
    jobs = [Job(req, loop) for _ in range(3)]
    for job in jobs:                # no worker yet: one session's worth and max_queue wait
        pool.submit(job)
    with pytest.raises(APIError) as full:
        pool.submit(Job(req, loop))
    assert full.value.status == 503 and pool.waiting == 3
    jobs[1].cancel()
    assert pool.waiting == 2
    jobs.append(Job(req, loop))
    pool.submit(jobs[-1])           # the place the leaver gave up
    pool.start()
    try:
        for job in (jobs[0], jobs[2], jobs[3]):
            kind, result = loop.run_until_complete(asyncio.wait_for(job.get(), 60))
            assert kind == "done" and result.n_completion == 4
    finally:
        pool.stop()
        loop.close()
    assert pool.in_use == pool.waiting == 0
    assert metrics.completion_tokens == 12 and metrics.cancelled == 0     # the leaver never decoded


def test_full_queue_answers_503(tmp_path):
    require(SMOLLM2)
    # plain decoding (no --spec-type) on a run-time q8_0 K / f16 V cache
    s = Server(tmp_path / "serve1.log", "-c", "256", "--parallel", "1", "--max-queue", "1", "-ctk", "q8_0", "-ctv", "f16")
    try:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
        with ThreadPoolExecutor(4) as ex:
            rs = list(ex.map(lambda _: httpx.post(s.url + "/v1/completions", json=body, timeout=60), range(4)))
        codes = sorted(r.status_code for r in rs)
        assert codes.count(200) >= 2 and set(codes) <= {200, 503} and 503 in codes
        for r in rs:
            if r.status_code == 503:
                assert r.json()["error"]["code"] == "queue_full"
        assert s.wait_idle()["sessions_in_use"] == 0
    finally:
        s.close()


def _load_request(url: str, i: int) -> tuple[str, int]:
    """One request of the mix; returns (what it was, what happened). Every branch is bounded by
    the client timeout."""
    kind = i % 8
    chat = {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i % 5 + 2}."}]}
    text = {"model": MODEL, "prompt": f"{i}: {PROMPT}"}
    with httpx.Client(timeout=60) as c:
        if kind in (0, 1):
            r = c.post(url + "/v1/chat/completions", json={**chat, "max_tokens": 5, "temperature": 0})
            ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 5
            return "valid", ok
        if kind in (2, 3):
            body = {**(chat if kind == 2 else text), "max_tokens": 6, "stream": True,
                    "stop": [" ", "\n"] if kind == 3 else None}
            path = "/v1/chat/completions" if kind == 2 else "/v1/completions"
            with c.stream("POST", url + path, json=body) as r:
                events = _sse_events(r)
            return "valid", r.status_code == 200 and events[-1] == "[DONE]" and "usage" in events[-2]
        if kind == 4:
            r = c.post(url + "/v1/completions", json={**text, "max_tokens": 6, "stop": ".", "temperature": 0})
            return "valid", r.status_code == 200 and "." not in r.json()["choices"][0]["text"]
        if kind == 5:       # the client leaves after the first token
            with c.stream("POST", url + "/v1/completions", json={**text, "max_tokens": 300, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        break
            return "cancelled", r.status_code == 200
        if kind == 6:
            bad = [{"messages": []}, {"messages": CHAT, "top_p": 7}, {"prompt": "x " * 600}, {"stop": 3, "prompt": "a"}]
            path = "/v1/chat/completions" if i % 4 < 2 else "/v1/completions"
            r = c.post(url + path, json=bad[i % 4])
            return "bad", 400 <= r.status_code < 500 and "error" in r.json()
        r = c.post(url + "/v1/chat/completions", json={**chat, "max_tokens": 5, "temperature": 0.7, "seed": i})
        return "valid", r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_bounded_load(server):
    """Two rounds of 64 mixed requests from 8 concurrent clients: all answered as they should be,
    no session left in use, RSS after the second round within 10 % of after the first."""
    rss = []
    for round_ in range(2):
        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as ex:
            results = list(ex.map(lambda i: _load_request(server.url, i), range(64)))
        failed = [(i, kind) for i, (kind, ok) in enumerate(results) if not ok]
        assert not failed, f"round {round_}: {failed}"
        assert time.monotonic() - t0 < 120
        h = server.wait_idle()
        assert h["sessions_in_use"] == 0 and h["requests_waiting"] == 0
        rss.append(server.rss())
    assert abs(rss[1] - rss[0]) <= 0.10 * rss[0], rss
    assert server.proc.poll() is None

"""The server's tool calls and structured output (issue 58 items 3-4): each tool-call format's
parser and stream splitter on strings; forced calls on the tiny qwen35 file under each native
format's template, valid against their schemas and equal with and without MTP speculation; and
SmolLM2 (the generic format: its template knows no tools) spoken to with the real `openai`
client: non-streaming and streaming calls, `response_format` parsed, an agent loop (call, tool
result, answer), and the 400s."""
from __future__ import annotations

import json

import jsonschema
import pytest

from hybridrt.decoding.sampling import SamplerConfig
from hybridrt.server.tools import FORMATS, ReplySplitter, Tool, ToolRequest, parse_reply, tool_format

pytest.importorskip("llguidance")
pytestmark = pytest.mark.usefixtures("single_thread")

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
                                            "unit": {"enum": ["C", "F"]}}, "required": ["city", "days"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
# for a random-weight model: every value bounded, so a forced call ends (a free string rarely does)
BOUNDED = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
              "city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
              "metric": {"type": "boolean"}}, "required": ["city", "days"]}}},
           {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
              "zone": {"const": "UTC"}}, "required": ["zone"]}}}]
N_CTX = 2048         # the tiny files' byte-level vocabulary spends a token on most characters

# templates of the two `<tool_call>` families, written for these tests in the shape of the real
# ones (Qwen3: JSON inside the block; Qwen3.5 / 3.6: <function=...> with <parameter=...>)
HERMES = ("{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
          "Call with <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n{% endif %}"
          "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
          "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
          "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN_XML = ("{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
            "Reply <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>"
            "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{% if tools %}Environment: ipython{% endif %}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
          "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}")


def _request(fmt: str, choice: str = "auto", parallel: bool = True) -> ToolRequest:
    return ToolRequest(FORMATS[fmt], tuple(Tool(t["function"]["name"], "", t["function"]["parameters"]) for t in TOOLS),
                       choice, parallel)


# ----------------------------------------------------------------------------- formats and parsing
def test_the_template_says_the_format():
    assert tool_format(HERMES).name == "hermes"
    assert tool_format(QWEN_XML).name == "qwen3-xml"
    assert tool_format(LLAMA3).name == "llama3-json"
    assert tool_format(None).name == tool_format("{{ messages }}").name == "generic"


@pytest.mark.parametrize("fmt, text, content, calls", [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>',
     "Let me look.", [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "days": 2})]),
    ("hermes", "<tool_call>\n{\"name\": broken\n</tool_call>", "<tool_call>\n{\"name\": broken\n</tool_call>", []),
    ("qwen3-xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
                  "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
     None, [("get_weather", {"city": "New York", "days": 3})]),
    ("llama3-json", '{"name": "get_time", "parameters": {"zone": "CET"}}', None, [("get_time", {"zone": "CET"})]),
    ("llama3-json", "It is sunny.", "It is sunny.", []),
    ("generic", '{"tool_calls": [{"name": "get_time", "arguments": {"zone": "X"}}]}', None, [("get_time", {"zone": "X"})]),
    ("generic", '{"response": "Hello"}', "Hello", []),
])
def test_replies_parse_into_calls_and_content(fmt, text, content, calls):
    got_content, got = parse_reply(text, _request(fmt))
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_the_splitter_passes_content_until_a_call_and_holds_a_possible_marker():
    s = ReplySplitter(_request("hermes"))
    out = [s.push(p) for p in ("Sure", ", one moment <", "tool_", "call>\n{\"name\": \"get_time\", ",
                                '"arguments": {"zone": "UTC"}}\n</tool_call>')]
    assert out == ["Sure", ", one moment ", "", "", ""]
    rest, calls = s.finish()
    assert rest == "" and [c.name for c in calls] == ["get_time"]
    s = ReplySplitter(_request("hermes"))
    assert s.push("a <b") == "a <b" and s.push(" <tool") == " " and s.finish() == ("<tool", [])
    s = ReplySplitter(_request("llama3-json"))
    assert s.push("  ") == "" and s.push("Hi") == "  Hi"


# ----------------------------------------------------------------------------- the tiny qwen35 file
def _serve_in_process(path, template: str | None, spec_type: str = "none"):
    from starlette.testclient import TestClient

    from hybridrt.decoding.speculative.loop import SpecConfig
    from hybridrt.runtime.loader import load_model
    from hybridrt.server.app import create_app
    from hybridrt.server.metrics import Metrics
    from hybridrt.server.pool import ServeConfig, SessionPool
    from hybridrt.server.schemas import ModelCard

    m = load_model(path)
    if template is not None:
        m.tokenizer.chat_template, m.tokenizer._compiled_template = template, None
    pool = SessionPool(m, ServeConfig(n_ctx=N_CTX, spec_type=spec_type, spec=SpecConfig(n_max=3)), Metrics(1))
    return TestClient(create_app(m, pool, ModelCard("tiny", N_CTX, 0), Metrics(1)))


@pytest.mark.parametrize("template, fmt", [(HERMES, "hermes"), (QWEN_XML, "qwen3-xml"), (LLAMA3, "llama3-json"),
                                          (None, "generic")], ids=["hermes", "qwen3-xml", "llama3-json", "generic"])
def test_forced_calls_are_valid_and_speculation_changes_nothing(tiny_qwen35_mtp, template, fmt):
    """A random-weight model under tool_choice "required" / a named function still writes calls
    that parse and validate against their tools' schemas; greedy replies with MTP drafts equal
    plain decoding's."""
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": BOUNDED, "temperature": 0,
            "max_tokens": 300}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED}
    choices = ("required", {"type": "function", "function": {"name": "get_time"}})
    replies = {}
    for spec in ("none", "draft-mtp"):
        with _serve_in_process(tiny_qwen35_mtp, template, spec) as client:
            for choice in choices:
                r = client.post("/v1/chat/completions", json={**body, "tool_choice": choice,
                                                                 "parallel_tool_calls": fmt != "generic"})
                assert r.status_code == 200, r.text
                replies[spec, json.dumps(choice)] = r.json()["choices"][0]
    for (spec, choice), reply in replies.items():
        if reply["finish_reason"] == "length":          # a call cut by max_tokens is content, never a broken call
            assert "tool_calls" not in reply["message"]
            continue
        assert reply["finish_reason"] == "tool_calls", reply
        for call in reply["message"]["tool_calls"]:
            name = call["function"]["name"]
            assert name == "get_time" if "get_time" in choice else name in schemas
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])
    for choice in choices:
        plain, spec = replies["none", json.dumps(choice)], replies["draft-mtp", json.dumps(choice)]
        strip = [[(c["function"]["name"], c["function"]["arguments"]) for c in r["message"].get("tool_calls") or []]
                 for r in (plain, spec)]
        assert strip[0] == strip[1] and plain["message"]["content"] == spec["message"]["content"]
    assert any(r["finish_reason"] == "tool_calls" for r in replies.values())


def test_a_special_token_marker_is_named_in_the_grammar(tiny_qwen35):
    """Where the vocabulary spells a marker as one special token, the grammar references that
    token (the model's own way to write it); else it is text."""
    from hybridrt.decoding.constraint import lark_literal
    from hybridrt.runtime.loader import load_model

    tok = load_model(tiny_qwen35).tokenizer
    assert lark_literal(tok, "<|im_end|>") == f"<[{tok.encode('<|im_end|>', add_special=False, parse_special=True)[0]}]>"
    assert lark_literal(tok, "<tool_call>") == '"<tool_call>"'


# ----------------------------------------------------------------------------- SmolLM2 and the openai client
@pytest.fixture(scope="module")
def client(tmp_path_factory):
    import openai

    from tests.real_models import SMOLLM2, require
    from tests.test_server import Server

    require(SMOLLM2)
    s = Server(tmp_path_factory.mktemp("serve-tools") / "serve.log", "-c", "1024", "--spec-type", "ngram-simple",
               "--spec-draft-n-max", "4")
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
    s.close()


QUESTION = [{"role": "user", "content": "What will the weather be in Paris for the next 2 days?"}]


def test_openai_client_tool_calls_streaming_and_not(client):
    plain = client.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=100)
    choice = plain.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    for name, args in calls:
        jsonschema.validate(json.loads(args), SCHEMAS[name])
    stream = client.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS, tool_choice="required",
                                            temperature=0, max_tokens=100, stream=True)
    streamed: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for d in delta.tool_calls or []:
            entry = streamed.setdefault(d.index, ["", ""])
            if d.function.name:
                assert d.id.startswith("call_") and d.type == "function"
                entry[0] = d.function.name
            entry[1] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and [tuple(v) for _, v in sorted(streamed.items())] == calls


def test_openai_client_response_format_parses(client):
    from pydantic import BaseModel, Field

    class City(BaseModel):      # bounded strings: a 135M model can run one on until max_tokens
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)
        population: int

    r = client.chat.completions.parse(model="m", messages=[{"role": "user", "content": "Describe Paris as JSON."}],
                                      response_format=City, temperature=0, max_tokens=400)
    assert r.choices[0].finish_reason == "stop" and isinstance(r.choices[0].message.parsed, City)
    r = client.chat.completions.create(model="m", messages=QUESTION, response_format={"type": "json_object"},
                                       temperature=0, max_tokens=200)
    # free strings may run to the limit; a reply that ended is a JSON object
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(r.choices[0].message.content), dict)


def test_an_agent_loop_calls_reads_the_result_and_answers(client):
    messages = list(QUESTION)
    first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=100).choices[0].message
    messages.append(first.model_dump(exclude_none=True))
    for call in first.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                         "content": json.dumps({"forecast": ["sunny", "rain"], "unit": "C"})})
    answer = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0,
                                            max_tokens=100).choices[0]
    # under "auto" the generic format's reply is {"response": ...} or more calls; either parses
    assert answer.finish_reason in ("stop", "tool_calls")
    assert answer.message.content or answer.message.tool_calls


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0]"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"grammar": "root ::= (", }, "grammar"),
    ({"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "grammar"),
    ({"grammar": 'root ::= "a"', "tools": TOOLS}, "grammar"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_and_format_fields_are_400s_naming_them(client, body, param):
    import openai

    known = {k: v for k, v in body.items() if k not in ("grammar", "json_schema")}     # llama-server's go in the body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=QUESTION, max_tokens=4, **known,
                                       extra_body={k: v for k, v in body.items() if k not in known})
    assert e.value.status_code == 400 and e.value.body["param"] == param


def test_llama_server_grammar_fields_constrain(client):
    r = client.completions.create(model="m", prompt="The answer is", max_tokens=20, temperature=0,
                                  extra_body={"grammar": 'root ::= ("yes" | "no") "."'})
    assert r.choices[0].text in ("yes.", "no.") and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=300, temperature=0,
                                       extra_body={"json_schema": {"type": "object", "properties": {
                                           "days": {"type": "integer"}}, "required": ["days"]}})
    assert isinstance(json.loads(r.choices[0].message.content)["days"], int)


def test_constrained_replies_equal_plain_constrained_decoding(client):
    """The server (n-gram speculation on) and in-process plain decoding under the same schema give
    the same greedy reply."""
    from hybridrt.decoding.constraint import Constraint, compile_grammar
    from hybridrt.decoding.generate import generate
    from hybridrt.runtime.loader import load_model
    from tests.real_models import SMOLLM2, require

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city", "days"]}
    served = client.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=60,
                                            response_format={"type": "json_schema",
                                                             "json_schema": {"name": "q", "schema": schema}})
    m = load_model(require(SMOLLM2))
    ids = m.tokenize(m.tokenizer.apply_chat_template(QUESTION), add_special=True, parse_special=True)
    constraint = Constraint(compile_grammar("json_schema", json.dumps(schema)), m.tokenizer, m.n_vocab)
    out, _ = generate(m, m.session(1024), ids, 60, SamplerConfig(temp=0.0), constraint=constraint)
    assert served.choices[0].message.content == m.detokenize([t for t in out if t not in m.tokenizer.eog_ids])


@pytest.mark.slow
def test_gemma3_calls_a_tool_with_and_without_drafts():
    """Gemma 3 (the generic format: its file has no template that knows tools): a forced call parses
    and validates, and n-gram drafts change nothing."""
    from tests.real_models import GEMMA3, require

    body = {"messages": QUESTION, "tools": TOOLS, "tool_choice": "required", "temperature": 0, "max_tokens": 100,
            "parallel_tool_calls": False}       # one call: left to it, the 270M model calls on and on
    calls = []
    for spec in ("none", "ngram-simple"):
        with _serve_in_process(require(GEMMA3), None, spec) as c:
            reply = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert reply["finish_reason"] == "tool_calls", reply
        calls.append([(x["function"]["name"], x["function"]["arguments"]) for x in reply["message"]["tool_calls"]])
    assert calls[0] == calls[1]
    for name, args in calls[0]:
        jsonschema.validate(json.loads(args), SCHEMAS[name])

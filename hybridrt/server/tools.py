"""Tool calls: how a model family writes them, the grammar that forces a valid one, and the parser
that turns the model's text back into OpenAI `tool_calls`.

One table, `FORMATS`, says per family how a call looks in the model's text; the chat template
decides which family a model is (`tool_format`):
- "hermes": `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call
  (Qwen2.5 / Qwen3, Hermes; templates that print `<tool_call>` themselves).
- "qwen3-xml": `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>`
  (Qwen3-Coder, Qwen3.5 / 3.6: templates that print `<function=`). String values are raw text,
  others JSON.
- "llama3-json": the whole reply is `{"name": ..., "parameters": {...}}` (Llama 3.1-3.3 templates).
- "generic": the template knows no tools (SmolLM2's, Gemma 3's, ChatML): the tools are described
  in a system message and the reply is always one JSON object, `{"tool_calls": [...]}` or
  `{"response": "..."}`, held to that shape by a JSON schema (as llama.cpp's generic format does:
  a small model that was never taught a call syntax still answers in one).

`tool_choice` "required" or a named function constrains the reply to calls (of that function),
each call's arguments to its `parameters` schema; "auto" leaves native formats free and parses
whatever calls the model wrote; "none" neither renders the tools nor parses calls.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from ..decoding.constraint import JSON_OPTIONS, generation_schema

# the reply's JSON in the generic format: whitespace as the schema constraint allows it
_GENERIC_SYSTEM = (
    "You can call the following tools. Each is given as a JSON schema of its arguments.\n\n{tools}\n\n"
    "Answer with a single JSON object and nothing else: either {{\"tool_calls\": [{{\"name\": <tool name>, "
    "\"arguments\": <arguments object>}}]}} to call tools, or {{\"response\": <your answer>}} to answer "
    "directly.")


@dataclass(frozen=True)
class ToolFormat:
    name: str
    native: bool                 # the chat template renders `tools` and tool messages itself
    open: str | None = None      # text that starts a call block (None: the reply as a whole)
    close: str | None = None


FORMATS = {f.name: f for f in (
    ToolFormat("hermes", native=True, open="<tool_call>", close="</tool_call>"),
    ToolFormat("qwen3-xml", native=True, open="<tool_call>", close="</tool_call>"),
    ToolFormat("llama3-json", native=True),
    ToolFormat("generic", native=False),
)}


def tool_format(template: str | None) -> ToolFormat:
    """The family a chat template belongs to, from what it prints."""
    t = template or ""
    if "tools" in t and "<tool_call>" in t:
        return FORMATS["qwen3-xml" if "<function=" in t else "hermes"]
    if "tools" in t and ("<|python_tag|>" in t or "<|start_header_id|>" in t):
        return FORMATS["llama3-json"]
    return FORMATS["generic"]


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict             # a JSON schema of the arguments object

    def openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asked of tools. choice: "auto", "required", or a tool's name."""
    format: ToolFormat
    tools: tuple[Tool, ...]
    choice: str
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def callable(self) -> tuple[Tool, ...]:
        return self.tools if self.choice in ("auto", "required") else tuple(t for t in self.tools if t.name == self.choice)


@dataclass
class ToolCall:
    name: str
    arguments: str               # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int | None = None) -> dict:
        body = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return body if index is None else {"index": index, **body}


# ------------------------------------------------------------------------------- prompts
def template_messages(messages: list[dict], req: ToolRequest | None) -> tuple[list[dict], dict]:
    """The messages and extra template variables to render. Native formats get `tools` (OpenAI's
    shape) and the messages as they are (assistant calls' arguments as objects, as Hugging Face
    templates iterate them); the generic format gets a system message describing the tools, and
    calls and results written as the JSON it asks the model for."""
    native = req is None or req.format.native
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m["role"] == "assistant" and calls:
            if native:
                out.append({**m, "tool_calls": [_call_with_object(c) for c in calls]})
            else:
                body = {"tool_calls": [{"name": c["function"]["name"], "arguments": _arguments_object(c)} for c in calls]}
                out.append({"role": "assistant", "content": json.dumps(body, ensure_ascii=False)})
        elif m["role"] == "tool" and not native:
            result = {"tool_response": {"name": m.get("name"), "tool_call_id": m.get("tool_call_id"),
                                        "content": m["content"]}}
            out.append({"role": "user", "content": json.dumps(result, ensure_ascii=False)})
        else:
            out.append(m)
    if req is None:
        return out, {}
    if native:
        return out, {"tools": [t.openai() for t in req.tools]}
    listing = "\n".join(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                                   ensure_ascii=False) for t in req.tools)
    system = _GENERIC_SYSTEM.format(tools=listing)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "role": "system", "content": out[0]["content"] + "\n\n" + system}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, {}


def _arguments_object(call: dict):
    args = call["function"].get("arguments", "{}")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args


def _call_with_object(call: dict) -> dict:
    return {**call, "function": {**call["function"], "arguments": _arguments_object(call)}}


# ------------------------------------------------------------------------------- grammars
def _schema(schema: dict) -> str:
    """An inline JSON schema for a Lark grammar, read as `run`'s schemas are (whitespace, defaults)."""
    return json.dumps({**generation_schema(schema), "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def _call_object(tool: Tool, args_key: str = "arguments") -> dict:
    return {"type": "object", "properties": {"name": {"const": tool.name}, args_key: tool.parameters},
            "required": ["name", args_key], "additionalProperties": False}


def _any(schemas: list[dict]) -> dict:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def tool_grammar(req: ToolRequest, marker, response_schema: dict | None = None) -> tuple[str, str] | None:
    """The constraint for a request as (kind, text) for constraint.compile_grammar, or None when
    the reply is free (a native format under "auto" without response_format). `marker(text)` gives
    the Lark for a call delimiter: a special token's reference where the vocabulary has it as one
    token, else the quoted text. `response_schema`: response_format's schema, the other thing the
    reply may be under "auto"."""
    tools = req.callable()
    fmt = req.format.name
    if fmt == "generic":
        calls = {"type": "array", "items": _any([_call_object(t) for t in tools]), "minItems": 1}
        if not req.parallel:
            calls["maxItems"] = 1
        replies = [{"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                    "additionalProperties": False}]
        if not req.forced:
            replies.append({"type": "object", "properties": {"response": response_schema or {"type": "string"}},
                            "required": ["response"], "additionalProperties": False})
        return "json_schema", _schema(_any(replies))
    if fmt == "llama3-json":
        schemas = [_call_object(t, "parameters") for t in tools]
        if not req.forced:
            if response_schema is None:
                return None
            schemas.append(response_schema)
        return "json_schema", _schema(_any(schemas))
    if not req.forced and response_schema is None:
        return None
    if fmt == "hermes":
        body = f"%json {_schema(_any([_call_object(t) for t in tools]))}"
        rules = []
    else:
        body = "(" + " | ".join(f"fn_{i}" for i in range(len(tools))) + ")"
        rules = [_xml_function_rule(i, t) for i, t in enumerate(tools)]
        rules.append('xml_text[stop="\\n</parameter>"]: /(.|\\n)*/')    # a string value, up to its closing tag
    call = f'{marker(req.format.open)} "\\n" {body} "\\n" {marker(req.format.close)}'
    calls = 'call ("\\n" call)*' if req.parallel else "call"
    start = calls if req.forced else f"%json {_schema(response_schema)} | {calls}"
    lines = [f"start: {start}", f"call: {call}", *rules]
    return "grammar", "\n".join(lines) + "\n"


def _lark_string(text: str) -> str:
    return json.dumps(text)


def _xml_function_rule(i: int, tool: Tool) -> str:
    """fn_i: one qwen3-xml function block, its parameters in the schema's order, the required ones
    always present, the others optional; a string parameter's value is raw text up to the closing
    tag, any other a JSON value of its schema."""
    props = tool.parameters.get("properties") or {}
    required = set(tool.parameters.get("required") or ())
    parts = []
    for name, schema in props.items():
        head = _lark_string(f"<parameter={name}>\n")
        words = _raw_words(schema)
        if words:
            value = "(" + " | ".join(_lark_string(w) for w in words) + ") " + _lark_string("\n</parameter>")
        elif _raw_string(schema):
            value = "xml_text"       # ends with the closing tag (length, pattern and format not enforced)
        else:
            value = f'%json {_schema(schema if isinstance(schema, dict) else {})} {_lark_string(chr(10) + "</parameter>")}'
        part = f"({head} {value} \"\\n\")"
        parts.append(part if name in required else part + "?")
    return f'fn_{i}: {_lark_string(f"<function={tool.name}>" + chr(10))} {" ".join(parts)} "</function>"'


def _raw_words(schema) -> list[str]:
    """The values of a parameter that is one of fixed strings (enum / const), written raw."""
    if not isinstance(schema, dict):
        return []
    words = schema.get("enum", [schema["const"]] if "const" in schema else [])
    return words if words and all(isinstance(w, str) for w in words) else []


def _raw_string(schema) -> bool:
    """Whether qwen3-xml writes a parameter's value as raw text (a string) rather than JSON."""
    return isinstance(schema, dict) and (schema.get("type") == "string" or bool(_raw_words(schema)))


# ------------------------------------------------------------------------------- parsing
_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>\n?(.*?)</function>", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _json_call(text: str, args_key: str = "arguments") -> ToolCall | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _xml_call(text: str, tools: dict[str, Tool]) -> ToolCall | None:
    m = _XML_FUNCTION.search(text)
    if m is None:
        return None
    name = m.group(1).strip()
    props = (tools[name].parameters.get("properties") or {}) if name in tools else {}
    args = {}
    for p in _XML_PARAMETER.finditer(m.group(2)):
        key, raw = p.group(1).strip(), p.group(2)
        if _raw_string(props.get(key)):
            args[key] = raw
        else:
            try:
                args[key] = json.loads(raw)
            except json.JSONDecodeError:
                args[key] = raw
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def parse_reply(text: str, req: ToolRequest) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished reply. Text that does not parse as a call stays content (a
    model under "auto" may write a malformed one; nothing is lost)."""
    fmt = req.format
    if fmt.name == "generic":
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        if isinstance(obj, dict) and isinstance(obj.get("tool_calls"), list):
            calls = [c for c in (_json_call(json.dumps(x)) for x in obj["tool_calls"] if isinstance(x, dict)) if c]
            if calls:
                return None, calls
        if isinstance(obj, dict) and "response" in obj:
            r = obj["response"]
            return (r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)), []
        return text, []
    if fmt.name == "llama3-json":
        stripped = text.strip()
        call = _json_call(stripped, "parameters") if stripped.startswith("{") else None
        return (None, [call]) if call is not None and any(t.name == call.name for t in req.tools) else (text, [])
    calls, content, rest = [], [], text
    tools = {t.name: t for t in req.tools}
    while True:
        start = rest.find(fmt.open)
        if start < 0:
            content.append(rest)
            break
        end = rest.find(fmt.close, start)
        block = rest[start + len(fmt.open):end if end >= 0 else len(rest)]
        call = _xml_call(block, tools) if fmt.name == "qwen3-xml" else _json_call(block.strip())
        if call is None:
            content.append(rest[start:])
            break
        content.append(rest[:start])
        calls.append(call)
        if end < 0:
            break
        rest = rest[end + len(fmt.close):]
    text_out = "".join(content).strip() if calls else "".join(content)
    return (text_out or None) if calls else text_out, calls


class ReplySplitter:
    """A streamed reply's text in, the part that is plain content out, as soon as it is sure not
    to start a call: a marked format passes text up to a call's opening marker (holding back what
    could be its start), then holds the rest; a whole-reply format holds everything from a reply
    that opens like a call (llama3-json: "{"; generic: every reply, it is JSON). `finish` parses
    what was held."""

    def __init__(self, req: ToolRequest):
        self.req = req
        self.held = ""           # text not yet passed on
        self.calling = req.format.name == "generic"

    def push(self, text: str) -> str:
        self.held += text
        if self.calling:
            return ""
        opener = self.req.format.open
        if opener is None:                    # llama3-json: decided by the first visible character
            stripped = self.held.lstrip()
            if not stripped:
                return ""
            if stripped.startswith("{"):
                self.calling = True
                return ""
            return self._pass(len(self.held))
        at = self.held.find(opener)
        if at >= 0:
            self.calling = True
            return self._pass(at)
        keep = max((n for n in range(1, len(opener)) if self.held.endswith(opener[:n])), default=0)
        return self._pass(len(self.held) - keep)

    def _pass(self, n: int) -> str:
        out, self.held = self.held[:n], self.held[n:]
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the rest of the content, the calls)."""
        if not self.calling:
            return self._pass(len(self.held)), []
        content, calls = parse_reply(self.held, self.req)
        self.held = ""
        return content or "", calls

"""Render a GGUF file's `tokenizer.chat_template` (a Hugging Face Jinja template) into a prompt string.

Templates come from model files, so they run in Jinja's immutable sandbox. The globals and filters
are the ones Hugging Face templates rely on: `raise_exception`, `strftime_now`, `tojson` with
non-ASCII kept, and `trim_blocks`/`lstrip_blocks` so the whitespace matches what the model saw in
training.
"""
from __future__ import annotations

import json
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import UserError


class ChatTemplateError(UserError):
    """The template is missing, does not parse, or raised while rendering."""


def _raise_exception(message: str):
    raise ChatTemplateError(f"chat template: {message}")


def _tojson(value, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# What llama.cpp renders when a GGUF carries no tokenizer.chat_template (its chatml fallback)
CHATML_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                   "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse: {e.message} (line {e.lineno})") from None


def render_chat_template(template: jinja2.Template, messages: list[dict], add_generation_prompt: bool,
                         bos_token: str, eos_token: str, **extra) -> str:
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ChatTemplateError(f"chat message must be a dict with 'role' and 'content', got {m!r}")
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token, **extra)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from None

"""Chat templates: the model's own (tokenizer.chat_template) compiled as HF transformers does, and
built-in ones for model families whose GGUFs often ship without one."""

from __future__ import annotations

import json
from collections.abc import Collection
from datetime import datetime

from jinja2 import Template, TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgedecode.model.tokenizer_models import TokenizerError

# Gemma's turn format: no system role (a system message opens the first user turn), "assistant" is
# "model", contents trimmed, roles alternate. BOS is left to the model's add_bos flag.
GEMMA_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set first_prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 is even) -%}"
    "{{ raise_exception('roles must alternate user/assistant/user/... after an optional system message') }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
    "{{ (first_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
# Built-in templates by the control tokens that identify the family.
_BUILTIN_TEMPLATES = ((frozenset({"<start_of_turn>", "<end_of_turn>"}), GEMMA_TEMPLATE),)


def builtin_template(control_tokens: Collection[str]) -> str | None:
    """The built-in template for a vocabulary with these control tokens, or None if no family matches."""
    for needed, template in _BUILTIN_TEMPLATES:
        if needed <= set(control_tokens):
            return template
    return None


def _raise_exception(message: str) -> None:
    raise TokenizerError(f"chat template error: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_template(source: str) -> Template:
    """Compile a chat template in the sandboxed environment HF transformers uses (same globals and filters)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise TokenizerError(f"cannot compile the chat template: {exc}") from exc

"""How a chat model is told of tools and reads back its own calls and their results.

A template with a tool format of its own renders the request's ``tools`` itself and the messages in
OpenAI's shape (an assistant turn's ``tool_calls``, ``role: "tool"`` results): Qwen 2/3's (Hermes
style: ``<tool_call>`` blocks, recognised by that tag) and Llama 3.1+'s (a bare ``{"name": ...,
"parameters": ...}`` object, recognised by ``<|python_tag|>``). Any other template (SmolLM2's,
Gemma 3's) gets the generic prompt: a system note listing the tools as JSON and asking for Hermes-style
``<tool_call>`` blocks; past calls are written back as that text in the assistant's turn and results
as a user turn of ``<tool_response>`` blocks, so that templates that know only system, user and
assistant (and Gemma's, which wants them alternating) render them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes a tool call: ``open`` + ``{"name": NAME, ARGUMENTS_KEY: ARGUMENTS}`` +
    ``close``, calls separated by ``separator``; ``native``: the chat template renders tools itself."""

    name: str
    open: str
    close: str
    arguments_key: str
    native: bool
    separator: str = "\n"
    parallel: bool = True  # the format writes several calls in one answer

    def header(self, function: str) -> str:
        """The text of a call to ``function`` up to its arguments."""
        return f"{self.open}{{{json.dumps('name')}: {json.dumps(function)}, {json.dumps(self.arguments_key)}: "

    def tail(self) -> str:
        """The text of a call after its arguments."""
        return "}" + self.close

    def write(self, function: str, arguments: str) -> str:
        """A call as the model writes it (``arguments``: the JSON text)."""
        return self.header(function) + arguments + self.tail()


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "arguments", native=True)
LLAMA3 = ToolFormat("llama3", "", "", "parameters", native=True, parallel=False)
GENERIC = ToolFormat("generic", "<tool_call>\n", "\n</tool_call>", "arguments", native=False)

GENERIC_PROMPT = """You can call functions to answer. The functions, as JSON schemas:
<tools>
{tools}
</tools>
To call a function, answer with nothing but, for each call:
<tool_call>
{{"name": <the function's name>, "arguments": <its arguments, a JSON object>}}
</tool_call>
Each call's result comes back in a <tool_response></tool_response> block."""


def tool_format(template: str) -> ToolFormat:
    """The tool format of a chat template's source (``GENERIC`` when it has none of its own)."""
    if "tools" in template and "<tool_call>" in template:
        return HERMES
    if "tools" in template and "<|python_tag|>" in template:
        return LLAMA3
    return GENERIC


def chat_messages(
    messages: Sequence[Mapping[str, object]], tools: Sequence[Mapping[str, object]] | None, form: ToolFormat
) -> list[dict]:
    """``messages`` (validated: roles system, user, assistant, tool; contents text) as the template of
    ``form`` takes them, with the generic prompt for ``tools`` where the template has no tool format."""
    if form.native:
        return [_native(message) for message in messages]
    rendered: list[dict] = []
    for message in messages:
        role, content = message["role"], str(message.get("content") or "")
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if rendered and rendered[-1].get("tool_results"):
                rendered[-1]["content"] += "\n" + block
            else:
                rendered.append({"role": "user", "content": block, "tool_results": True})
            continue
        if role == "assistant" and message.get("tool_calls"):
            calls = [
                form.write(str(call["function"]["name"]), str(call["function"]["arguments"]))
                for call in message["tool_calls"]  # type: ignore[attr-defined]
            ]
            content = "\n".join(([content] if content else []) + calls)
        rendered.append({"role": role, "content": content})
    for message in rendered:
        message.pop("tool_results", None)
    if tools:
        note = GENERIC_PROMPT.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
        if rendered[0]["role"] == "system":
            rendered[0]["content"] = f"{rendered[0]['content']}\n\n{note}" if rendered[0]["content"] else note
        else:
            rendered.insert(0, {"role": "system", "content": note})
    return rendered


def _native(message: Mapping[str, object]) -> dict:
    """A message for a template with a tool format: arguments as objects (as HF transformers passes
    them; the template writes them with ``tojson``), content None as empty."""
    native = {key: value for key, value in message.items() if value is not None}
    native.setdefault("content", "")
    calls = message.get("tool_calls")
    if calls:
        native["tool_calls"] = [
            {**call, "function": {**call["function"], "arguments": _arguments(call["function"]["arguments"])}}
            for call in calls  # type: ignore[attr-defined]
        ]
    return native


def _arguments(text: object) -> object:
    try:
        return json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError:
        return text

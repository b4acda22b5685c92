"""What a chat request asks of its answer's form: ``response_format`` (JSON, or JSON under a schema)
and ``tools`` / ``tool_choice`` / ``parallel_tool_calls``, validated and turned into one grammar.

The grammar (llguidance's: a JSON schema, or Lark with the schemas embedded) is compiled against the
model's tokenizer later, off the event loop (``runtime.constraint.GrammarCompiler``). With tools, the
answer is either text (or, with a ``response_format``, JSON) or calls written in the model's tool
format (``tool_prompt``), each call's arguments held to its function's parameter schema:

* ``auto``: text or calls (a text that starts as a call would is a call);
* ``required``: one call, or more with ``parallel_tool_calls: true`` where the format has parallel
  calls (one by default, as llama.cpp's server does: a small model asked for calls in a row tends to
  repeat its first until ``max_tokens``);
* a named function: calls of that function only;
* ``none``: the tools are neither shown nor callable.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from edgedecode.daemon.tool_prompt import ToolFormat
from edgedecode.errors import RequestError
from edgedecode.runtime.constraint import JSON_LAYOUT, json_schema_grammar, lark_grammar

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class Tool:
    """One function the model may call: its name and parameter schema, and the tool object as given."""

    name: str
    parameters: dict[str, Any]
    spec: dict[str, Any]


@dataclass(frozen=True)
class OutputRule:
    """A request's constraint: ``grammar`` (llguidance's text; None: free text) and, when its answer
    may be calls, the ``tools`` shown to the model (the grammar says which it may call) in ``form``.
    ``param`` names the field a grammar error is of."""

    grammar: str | None
    tools: tuple[Tool, ...] = ()
    form: ToolFormat | None = None
    param: str = "response_format"

    @property
    def calls(self) -> bool:
        """Whether the answer may hold tool calls."""
        return bool(self.tools)


def parse_tools(body: dict) -> tuple[Tool, ...]:
    """The request's ``tools`` (an empty tuple for none), each a function with a valid name and an
    object parameter schema (default: no parameters)."""
    tools = body.get("tools")
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of function tools", "tools")
    parsed, names = [], set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict):
            raise RequestError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', "tools")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise RequestError(f"tools[{i}].function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -", "tools")
        if name in names:
            raise RequestError(f"tools[{i}]: a second function named {name!r}", "tools")
        names.add(name)
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        parsed.append(Tool(name, parameters, tool))
    return tuple(parsed)


def output_rule(body: dict, form: ToolFormat) -> OutputRule | None:
    """The request's constraint, or None when it asks for free text (tools in ``form``, the
    model's tool format)."""
    answer = _response_schema(body.get("response_format"))
    tools = parse_tools(body)
    choice = _tool_choice(body.get("tool_choice"), tools)
    if not tools or choice == "none":
        return None if answer is None else OutputRule(json_schema_grammar(answer))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    callable_tools = tools if choice in ("auto", "required") else tuple(t for t in tools if t.name == choice)
    lark = _tools_lark(callable_tools, form, choice == "auto", answer, form.parallel and parallel is True)
    return OutputRule(lark_grammar(lark), tools, form, "tools")


def _response_schema(response_format: object) -> dict[str, Any] | None:
    """The JSON schema a ``response_format`` holds the answer to (None: free text)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise RequestError("response_format must be an object", "response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise RequestError('response_format.json_schema must be an object with a "name"', "response_format")
        schema = spec.get("schema", ANY_OBJECT)
        if not isinstance(schema, dict):
            raise RequestError("response_format.json_schema.schema must be a JSON schema object", "response_format")
        return schema
    raise RequestError('response_format.type must be "text", "json_object" or "json_schema"', "response_format")


def _tool_choice(choice: object, tools: tuple[Tool, ...]) -> str:
    """``tool_choice`` as "none", "auto", "required" or a function's name."""
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise RequestError(f'tool_choice "{choice}" needs tools', "tool_choice")
        return str(choice)
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise RequestError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in {tool.name for tool in tools}:
        raise RequestError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return name


def _tools_lark(
    tools: tuple[Tool, ...], form: ToolFormat, optional: bool, answer: dict[str, Any] | None, parallel: bool
) -> str:
    """A Lark grammar: calls of ``tools`` in ``form`` (or, ``optional``, an answer instead: text that
    does not start as a call would, or JSON under ``answer``)."""
    lines = ["calls: call" + (f" ({json.dumps(form.separator)} call)*" if parallel else "")]
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    for i, tool in enumerate(tools):
        lines.append(f"call_{i}: {json.dumps(form.header(tool.name))} args_{i} {json.dumps(form.tail())}")
        lines.append(f"args_{i}: %json {_laid_out(declared_only(tool.parameters))}")
    if not optional:
        return "\n".join(["start: calls", *lines])
    if answer is not None:
        return "\n".join(["start: answer | calls", f"answer: %json {_laid_out(answer)}", *lines])
    text = f"TEXT: /(.|\\n)+/ & ~/{_regex_literal(call_marker(form))}(.|\\n)*/"
    return "\n".join(["start: TEXT | calls", text, *lines])


def declared_only(schema: object) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists its properties and
    says nothing of others: a call's arguments are the parameters the function declares (JSON
    Schema's default would let a small model invent more)."""
    if isinstance(schema, list):
        return [declared_only(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    walked = {key: declared_only(value) if key not in ("enum", "const", "default", "examples") else value
              for key, value in schema.items()}  # fmt: skip
    if isinstance(schema.get("properties"), dict):
        walked["properties"] = {name: declared_only(sub) for name, sub in schema["properties"].items()}
        walked.setdefault("additionalProperties", False)
    return walked


def call_marker(form: ToolFormat) -> str:
    """What an answer of calls starts with (and a text answer never does): the format's opening tag,
    or '{"' where calls are bare objects."""
    return form.open.strip() or '{"'


def _laid_out(schema: dict[str, Any]) -> str:
    """A schema for Lark's ``%json``, laid out as ``runtime.constraint.JSON_LAYOUT`` says."""
    return json.dumps({**schema, "x-guidance": JSON_LAYOUT})


def _regex_literal(text: str) -> str:
    """``text`` as a regex matching it literally, inside a Lark /.../ (slashes escaped too)."""
    return re.sub(r"([\\.^$|?*+()\[\]{}/])", r"\\\1", text).replace("\n", "\\n")

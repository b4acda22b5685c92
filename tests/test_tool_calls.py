"""Tools and structured answers without the model: the request fields checked (400s naming the field),
the grammar each asks for, the prompt a template without a tool format gets, and the calls read back
from a model's text however the stream splits it, in the shapes the official client parses."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from edgedecode.daemon.openai_responses import ChoiceResult, ResponseShape
from edgedecode.daemon.output_rules import output_rule
from edgedecode.daemon.tool_calls import ToolCallReader
from edgedecode.daemon.tool_prompt import GENERIC, HERMES, LLAMA3, chat_messages, tool_format
from edgedecode.errors import RequestError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
USAGE = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),  # no json_schema object
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format"),  # no name
        ({"tools": {"name": "f"}}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_a_malformed_response_format_or_tools_is_refused_naming_the_field(body, param):
    with pytest.raises(RequestError) as refused:
        output_rule(body, GENERIC)
    assert refused.value.param == param


def test_free_text_asks_for_no_grammar_and_tool_choice_none_hides_the_tools():
    assert output_rule({}, GENERIC) is None
    assert output_rule({"response_format": {"type": "text"}}, GENERIC) is None
    assert output_rule({"tools": [WEATHER], "tool_choice": "none"}, GENERIC) is None
    json_only = output_rule(
        {"tools": [WEATHER], "tool_choice": "none", "response_format": {"type": "json_object"}}, GENERIC
    )
    assert json_only is not None and json_only.grammar and not json_only.calls


def test_the_tools_grammar_holds_each_call_to_its_function_and_choice():
    rule = output_rule({"tools": [WEATHER, TIME], "tool_choice": "required"}, GENERIC)
    assert rule is not None and rule.calls and rule.param == "tools"
    lark = rule.grammar
    assert "start: calls" in lark and "TEXT" not in lark  # required: calls only
    assert '"city": {"type": "string"}' in lark  # the parameters' schema is in the grammar
    named = output_rule(
        {"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, GENERIC
    )
    assert named is not None
    named_lark = named.grammar
    assert "get_time" in named_lark and "get_weather" not in named_lark  # only the named function is callable
    assert [tool.name for tool in named.tools] == ["get_weather", "get_time"]  # both are shown
    auto = output_rule({"tools": [WEATHER]}, GENERIC)
    assert auto is not None and "start: TEXT | calls" in auto.grammar


def test_a_template_with_its_own_tool_format_is_recognised():
    # the parts of a template that tell its format, written here (no model's template is copied)
    hermes = "{% if tools %}<tools>{{ tools | tojson }}</tools> answer in <tool_call></tool_call>{% endif %}"
    llama = "{% if tools %}{{ tools | tojson }}{% endif %}{% if m.tool_calls %}<|python_tag|>{% endif %}"
    assert tool_format(hermes) is HERMES
    assert tool_format(llama) is LLAMA3
    assert tool_format("{% for message in messages %}{{ message['content'] }}{% endfor %}") is GENERIC


def test_the_generic_prompt_lists_the_tools_and_writes_past_calls_and_results_as_text():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [call, {**call, "id": "call_2"}]},
        {"role": "tool", "content": "rain", "tool_call_id": "call_1"},
        {"role": "tool", "content": "sun", "tool_call_id": "call_2"},
    ]
    rendered = chat_messages(messages, [WEATHER], GENERIC)
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]  # results: one user turn
    assert rendered[0]["content"].startswith("Be brief.\n\n") and json.dumps(WEATHER) in rendered[0]["content"]
    assert rendered[2]["content"] == "\n".join([GENERIC.write("get_weather", '{"city": "Oslo"}')] * 2)
    assert rendered[3]["content"] == "<tool_response>\nrain\n</tool_response>\n<tool_response>\nsun\n</tool_response>"
    assert chat_messages(messages[1:2], [WEATHER], GENERIC)[0]["role"] == "system"  # a system turn of its own
    native = chat_messages(messages, [WEATHER], HERMES)
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # objects, as HF passes them
    assert native[3] == messages[3]


CALLS_TEXT = GENERIC.write("get_weather", '{"city": "Rome {1}", "unit": "c"}') + "\n" + GENERIC.write("get_time", "{}")


@pytest.mark.parametrize("step", [1, 2, 3, 7, len(CALLS_TEXT)])
def test_calls_read_back_the_same_however_the_text_is_split(step):
    reader = ToolCallReader(GENERIC, ["get_weather", "get_time"])
    contents, deltas = [], []
    for start in range(0, len(CALLS_TEXT), step):
        content, got = reader.feed(CALLS_TEXT[start : start + step])
        contents.append(content)
        deltas += got
    contents.append(reader.finish())
    assert "".join(contents) == ""
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in reader.calls] == [
        ("get_weather", '{"city": "Rome {1}", "unit": "c"}'),
        ("get_time", "{}"),
    ]
    # the deltas, concatenated per index as the client does, give the same calls
    by_index: dict[int, list[str]] = {}
    for delta in deltas:
        by_index.setdefault(delta.index, []).append(delta.arguments)
    assert ["".join(parts) for _, parts in sorted(by_index.items())] == [
        c["function"]["arguments"] for c in reader.calls
    ]
    assert [d.name for d in deltas if d.id is not None] == ["get_weather", "get_time"]


@pytest.mark.parametrize("text", ["Hello there.", "<tool", "<b>bold</b>", '{"name" is not a call in this format'])
def test_text_that_is_not_a_call_is_content(text):
    reader = ToolCallReader(GENERIC, ["get_weather"])
    out = [reader.feed(char)[0] for char in text] + [reader.finish()]
    assert "".join(out) == text and reader.calls == []


def test_llama3_calls_are_bare_objects():
    text = LLAMA3.write("get_weather", '{"city": "Oslo"}')
    assert text == '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    reader = ToolCallReader(LLAMA3, ["get_weather"])
    assert reader.feed(text)[0] == "" and reader.calls[0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_tool_calls_in_openai_shapes_whole_and_streamed():
    shape = ResponseShape("chat", "tiny")
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    whole = ChatCompletion.model_validate(shape.whole([ChoiceResult("", "tool_calls", None, calls)], USAGE))
    message = whole.choices[0].message
    assert message.content is None and message.tool_calls and message.tool_calls[0].function.name == "get_time"
    reader = ToolCallReader(GENERIC, ["get_time"])
    _, deltas = reader.feed(GENERIC.write("get_time", "{}"))
    chunk = ChatCompletionChunk.model_validate(shape.chunk(tool_calls=[d.to_json() for d in deltas]))
    streamed = chunk.choices[0].delta.tool_calls
    assert streamed and streamed[0].function and streamed[0].function.name == "get_time"
    assert streamed[0].function.arguments == "{}"


def test_a_call_carries_only_the_parameters_its_function_declares():
    from edgedecode.daemon.output_rules import declared_only

    schema = {
        "type": "object",
        "properties": {"where": {"type": "object", "properties": {"city": {"type": "string"}}}},
        "$defs": {"open": {"type": "object", "properties": {}, "additionalProperties": True}},
        "enum": [{"properties": {}}],  # values, not schemas: left as they are
    }
    declared = declared_only(schema)
    assert declared["additionalProperties"] is False
    assert declared["properties"]["where"]["additionalProperties"] is False
    assert declared["$defs"]["open"]["additionalProperties"] is True  # what a schema says is kept
    assert declared["enum"] == [{"properties": {}}] and "additionalProperties" not in schema  # a copy

"""Structured answers and tool calls against a real daemon on 127.0.0.1 (SmolLM2, its KV pulled from a
real prefill server), through the official ``openai`` client and LangChain: JSON under schemas with
nested objects, arrays, enums and required fields, streamed and whole, always parses and validates;
``chat.completions.parse`` fills a Pydantic model; a tool call goes out as ``tool_calls`` (streamed as
deltas the client reassembles) and its result comes back in the next turn, whose KV the conversation
reuses; a schema llguidance cannot compile is a 400 naming the feature."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pytest
from openai import BadRequestError, OpenAI
from pydantic import BaseModel, Field
from serving_helpers import pulling_daemon

TOKEN = "structured-secret"
MODEL = "smollm2-135m-instruct"
PROMPTS = ["Describe a person as JSON.", "Make up a record for a library member, in JSON."]
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "maxLength": 8}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
            "active": {"type": "boolean"},
        },
        "required": ["address", "tags", "active"],
        "additionalProperties": False,
    },
    "list": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"id": {"type": "integer"}, "kind": {"enum": ["book", "film"]}},
                    "required": ["id", "kind"],
                    "additionalProperties": False,
                },
                "maxItems": 2,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int
    role: Literal["admin", "user", "guest"]


@pytest.fixture(scope="module")
def daemon(prefill_server, tmp_path_factory):
    server = pulling_daemon(tmp_path_factory.mktemp("structured"), prefill_server.url, TOKEN)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(daemon) -> OpenAI:
    return OpenAI(base_url=daemon.url + "/v1", api_key=TOKEN, timeout=180, max_retries=0)


def _json_schema(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_answers_under_a_schema_parse_and_validate_whole_and_streamed(client, name):
    for i, prompt in enumerate(PROMPTS):
        args = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "response_format": _json_schema(name),
            "temperature": 0.8,
            "seed": i,
            "max_tokens": 160,
        }
        whole = client.chat.completions.create(**args)
        chunks = list(client.chat.completions.create(**args, stream=True))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "stop"
        assert streamed == whole.choices[0].message.content  # seeded: the same answer both ways
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 3  # streamed, piece by piece
        jsonschema.validate(json.loads(streamed), SCHEMAS[name])


def test_json_object_answers_an_object_or_says_length(client):
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give a JSON object with a greeting."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=80,
    )
    choice = completion.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content or ""), dict)
    else:
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")


def test_parse_fills_a_pydantic_model(client):
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person."}],
        response_format=Person,
        temperature=0.7,
        seed=1,
        max_tokens=120,
    )
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and completion.choices[0].finish_reason == "stop"


def test_a_tool_round_trip_with_the_official_client(client):
    """tool_choice required: a call to the tool, its arguments valid under its parameters; streamed, the
    client's own stream helper reassembles the same call from the deltas; the result goes back as a
    ``role: "tool"`` message in the same conversation, whose KV the next turn reuses, and the model answers."""
    session = {"session_id": "weather"}
    args = {"model": MODEL, "tools": [WEATHER], "tool_choice": "required", "temperature": 0, "max_tokens": 60}
    first = client.chat.completions.create(messages=ASK, extra_body=session, **args)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    with client.chat.completions.stream(messages=ASK, **args) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (call.function.name, call.function.arguments)
    ]

    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], temperature=0, max_tokens=40, extra_body=session
    )
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content or answer.message.tool_calls
    assert second.model_extra["edgedecode"]["kv"]["reused_tokens"] > 0  # the first turn's prompt, kept


def test_a_named_function_is_the_one_called_and_none_calls_nothing(client):
    time_tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    named = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, time_tool],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0,
        max_tokens=40,
    )
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["get_time"]
    none = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=16
    )
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


@pytest.mark.parametrize(
    "body, param, named",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
         "response_format", "strnig"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"d": {"type": "string", "format": "colour"}}}}}]}, "tools", "colour"),
    ],
)  # fmt: skip
def test_what_cannot_be_compiled_is_a_400_naming_it(client, body, param, named):
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, **body)
    assert refused.value.body["param"] == param and named in refused.value.body["message"]


def test_langchain_structured_output_and_tools(daemon, monkeypatch):
    for tracing in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2"):
        monkeypatch.delenv(tracing, raising=False)
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        base_url=daemon.url + "/v1", api_key=TOKEN, model=MODEL, temperature=0, max_tokens=120, max_retries=0
    )
    person = chat.with_structured_output(Person, method="json_schema").invoke("Describe a person.")
    assert isinstance(person, Person)

    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """The current weather in a city."""
        return f"18 degrees {unit} in {city}"

    tooled = chat.bind_tools([get_weather], tool_choice="get_weather")
    asked = [HumanMessage("What is the weather in Paris?")]
    called = tooled.invoke(asked)
    (call,) = called.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}
    streamed = None
    for chunk in tooled.stream(asked):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None and [c["args"] for c in streamed.tool_calls] == [call["args"]]
    result = ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"])
    answer = chat.bind_tools([get_weather]).invoke([*asked, called, result])
    assert answer.content or answer.tool_calls

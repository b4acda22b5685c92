"""Constrained decoding on SmolLM2's real vocabulary (runtime/constraint.py): the mask the decode loop
applies equals llguidance's own per-token answer, whatever is sampled under it parses and validates
against its schema, grammars compile once, and what llguidance cannot compile is named. Then the
real decode loop under a schema."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from edgedecode.runtime.constraint import GrammarCompiler, GrammarError, json_schema_grammar
from edgedecode.runtime.sampler import Sampler, SamplingParams

# schemas whose every string and array is bounded, so that a random walk under them ends
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 5}, "capital": {"type": "boolean"}},
                "required": ["name", "capital"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        },
        "required": ["city", "tags"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def grammars(smollm2_model) -> GrammarCompiler:
    spec = smollm2_model.spec
    return GrammarCompiler(smollm2_model.tokenizer, spec.vocab_size, spec.stop_token_ids)


def test_the_mask_keeps_exactly_the_tokens_llguidance_allows(grammars, smollm2_model):
    """At each step of a walk, the masked row is the logits where llguidance's byte-per-token answer
    (compute_logit_bias, another path than the bitmask) allows a token, -inf elsewhere; float32 and float16."""
    vocab = smollm2_model.spec.vocab_size
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float16):
        mask = grammars.compile(json_schema_grammar(SCHEMAS[0])).start()
        oracle = grammars.compile(json_schema_grammar(SCHEMAS[0])).start()._matcher
        for _ in range(12):
            logits = rng.standard_normal(vocab).astype(dtype)
            row = mask.apply(logits)
            allowed = np.frombuffer(oracle.compute_logit_bias(), np.uint8)[:vocab] > 0
            assert row.dtype == dtype
            np.testing.assert_array_equal(row, np.where(allowed, logits, dtype(-np.inf)).astype(dtype))
            assert logits.dtype == dtype and np.isfinite(logits).all()  # the raw row is left as it was
            token = int(np.flatnonzero(allowed)[rng.integers(allowed.sum())])
            if token in smollm2_model.spec.stop_token_ids:
                break
            mask.accept(token)
            assert oracle.consume_token(token)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["flat", "nested"])
@pytest.mark.parametrize("seed", range(4))
def test_whatever_is_sampled_under_the_mask_parses_and_validates(grammars, smollm2_model, schema, seed):
    """Random logits, sampled at temperature 1: the walk ends by itself, and its text is valid JSON
    under the schema, laid out with json.dumps' separators."""
    spec, tokenizer = smollm2_model.spec, smollm2_model.tokenizer
    rng = np.random.default_rng(seed)
    mask = grammars.compile(json_schema_grammar(schema)).start()
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
    tokens: list[int] = []
    for _ in range(400):
        token = sampler.pick(mask.apply(rng.standard_normal(spec.vocab_size).astype(np.float32) * 4))
        if token in spec.stop_token_ids:
            break
        mask.accept(token)
        tokens.append(token)
        if mask.finished:
            break
    text = tokenizer.decode(tokens)
    assert mask.finished or tokens, text
    answer = json.loads(text)
    jsonschema.validate(answer, schema)
    assert text == json.dumps(answer, ensure_ascii=False)


def test_a_grammar_compiles_once(grammars):
    grammar = json_schema_grammar(SCHEMAS[1])
    assert grammars.compile(grammar) is grammars.compile(grammar)


@pytest.mark.parametrize(
    "schema, named",
    [
        ({"type": "strnig"}, "strnig"),
        ({"type": "string", "format": "colour"}, "colour"),
        ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
        ({"$ref": "#/definitions/missing"}, "missing"),
    ],
)
def test_what_cannot_be_compiled_is_named(grammars, schema, named):
    with pytest.raises(GrammarError, match=named):
        grammars.compile(json_schema_grammar(schema))


def test_the_decode_loop_under_a_schema_answers_valid_json(decoder, smollm2_model, grammars):
    """The real model, greedy, a chat prompt asking for a person: the loop ends by itself ("stop")
    with JSON the schema accepts; without the grammar the same prompt is not that JSON."""
    prompt = smollm2_model.tokenizer.encode_chat([{"role": "user", "content": "Describe a person as JSON."}])
    grammar = grammars.compile(json_schema_grammar(SCHEMAS[0]))
    params = SamplingParams(max_tokens=60)
    tokens = list(decoder.generate(prompt, params, constraint=grammar.start()))
    assert decoder.stats.finish_reason == "stop"
    jsonschema.validate(json.loads(smollm2_model.tokenizer.decode(tokens)), SCHEMAS[0])
    exact = list(decoder.generate(prompt, SamplingParams(max_tokens=len(tokens)), constraint=grammar.start()))
    assert exact == tokens and decoder.stats.finish_reason == "stop"  # complete on the last token allowed
    cut = list(decoder.generate(prompt, SamplingParams(max_tokens=len(tokens) - 1), constraint=grammar.start()))
    assert cut == tokens[:-1] and decoder.stats.finish_reason == "length"
    free = smollm2_model.tokenizer.decode(list(decoder.generate(prompt, params)))
    with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(free), SCHEMAS[0])
    scored = list(decoder.generate_scored(prompt, params, top=2, constraint=grammar.start()))
    assert [s.token for s in scored] == tokens  # log-probabilities change nothing of the pick
    assert all(s.logprob <= 0 and np.isfinite(s.logprob) for s in scored)


# A chat template with a Hermes-style tool format, written for this test in the way Qwen 2/3's renders tools
# (no model's template is copied): the tools as JSON in the system turn, past calls as <tool_call> blocks,
# results as <tool_response> blocks in a user turn.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    '\nCall one as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_a_template_with_a_tool_format_renders_the_tools_and_the_calls_follow_it(
    smollm2_reader, smollm2_spec, smollm2_model, decoder
):
    """The template renders the request's tools and the turn's past call and result itself; the answer's
    call is written in its format and reads back as the OpenAI call."""
    import dataclasses
    from types import SimpleNamespace

    from edgedecode.daemon.openai_api import parse_request
    from edgedecode.daemon.tool_calls import ToolCallReader
    from edgedecode.daemon.tool_prompt import HERMES
    from edgedecode.model.tokenizer import Tokenizer

    spec = dataclasses.replace(smollm2_spec, chat_template=HERMES_TEMPLATE)
    tokenizer = Tokenizer.from_gguf(smollm2_reader, spec)
    model = SimpleNamespace(record=smollm2_model.record, spec=spec, tokenizer=tokenizer)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    body = {
        "messages": [
            {"role": "user", "content": "Weather in Oslo, then Rome?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        ],
        "tools": [WEATHER],
        "tool_choice": "required",
        "temperature": 0,  # greedy: the call ends well within max_tokens (sampled, its string could run on)
    }
    request = parse_request(body, "chat", model, default_max_tokens=40, session_header=None)  # type: ignore[arg-type]
    prompt = tokenizer.decode(request.prompt_ids.tolist(), skip_special=False)
    assert json.dumps(WEATHER) in prompt  # the template's own rendering of the tools
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in prompt
    assert "<tool_response>\nrain\n</tool_response>" in prompt
    assert request.output is not None and request.output.form is HERMES
    grammars = GrammarCompiler(tokenizer, spec.vocab_size, spec.stop_token_ids)
    grammar = grammars.compile(request.output.grammar or "")
    tokens = list(decoder.generate(request.prompt_ids, request.params, constraint=grammar.start()))
    text = tokenizer.decode(tokens)
    assert text.startswith('<tool_call>\n{"name": "get_weather", "arguments": {') and text.endswith("}\n</tool_call>")
    reader = ToolCallReader(HERMES, ["get_weather"])
    reader.feed(text)
    (read,) = reader.calls
    assert read["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(read["function"]["arguments"]), WEATHER["function"]["parameters"])

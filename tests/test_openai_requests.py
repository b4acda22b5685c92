"""The daemon's request validation (``openai_api.parse_request``) on a stand-in model: what a
request may ask for, and the 4xx each refusal is answered with."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from edgedecode.daemon.openai_api import APIRequestError, parse_request

VOCAB, CONTEXT = 1000, 64


class _Tokenizer:
    """One token per character (its code point), and a chat template of one token per message."""

    def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def encode_chat(self, messages: list[dict], *, special_in_content: bool = False, tools=None) -> list[int]:
        return [1 + i for i, _ in enumerate(messages)] + [ord(c) % VOCAB for m in messages for c in m["content"]]


MODEL = SimpleNamespace(
    record=SimpleNamespace(name="tiny"),
    spec=SimpleNamespace(vocab_size=VOCAB, context_length=CONTEXT),
    tokenizer=_Tokenizer(),
)


def parse(body: dict, kind: str = "text"):
    return parse_request(body, kind, MODEL, default_max_tokens=16, session_header=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "body, status, param, code",
    [
        ({"prompt": ""}, 400, "prompt", None),  # was a 422 from the engine, after the request had queued
        ({"prompt": "hi", "model": "gpt-4o"}, 404, "model", "model_not_found"),
        ({"prompt": "hi", "logprobs": 6}, 400, "logprobs", None),
        ({"prompt": "hi", "logprobs": -1}, 400, "logprobs", None),
        ({"prompt": "hi", "logprobs": True}, 400, "logprobs", None),
        ({"prompt": "hi", "logprobs": 1.5}, 400, "logprobs", None),
        ({"prompt": "hi", "top_logprobs": 2}, 400, "top_logprobs", None),  # chat's field
        ({"prompt": "hi", "echo": "yes"}, 400, "echo", None),
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),  # 0 only with echo
        ({"prompt": "hi", "suffix": "!"}, 400, "suffix", None),
        ({"prompt": "hi", "presence_penalty": 1.5}, 400, "presence_penalty", None),
        ({"prompt": "hi", "frequency_penalty": -0.5}, 400, "frequency_penalty", None),
        ({"prompt": "hi", "best_of": 3}, 400, "best_of", None),  # best_of must equal n
        ({"prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of", None),
        ({"prompt": "hi", "n": 9}, 400, "n", None),
        ({"prompt": "hi", "n": 0}, 400, "n", None),
        ({"prompt": "hi", "n": 2.5}, 400, "n", None),
        ({"prompt": [1] * CONTEXT, "echo": True, "max_tokens": 1}, 400, "prompt", "context_length_exceeded"),
        ({"prompt": [1] * (CONTEXT + 1), "echo": True, "max_tokens": 0}, 400, "prompt", "context_length_exceeded"),
    ],
)
def test_what_the_server_cannot_honour_is_refused_naming_the_field(body, status, param, code):
    with pytest.raises(APIRequestError) as refused:
        parse(body)
    assert (refused.value.http_status, refused.value.param, refused.value.http_code) == (status, param, code)


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"logprobs": 1}, "logprobs"),  # chat's logprobs is a boolean
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs
        ({"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"echo": True}, "echo"),  # a completions field: OpenAI refuses it on chat too
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 9}, "n"),
    ],
)
def test_chat_refusals_name_the_field(body, param):
    with pytest.raises(APIRequestError) as refused:
        parse({"messages": CHAT, **body}, kind="chat")
    assert (refused.value.http_status, refused.value.param) == (400, param)


def test_logprobs_n_and_echo_as_parsed():
    chat = parse({"messages": CHAT, "logprobs": True, "top_logprobs": 20, "n": 8}, kind="chat")
    assert (chat.logprobs, chat.n, chat.echo, chat.prompt_logprobs) == (20, 8, False, False)
    assert parse({"messages": CHAT, "logprobs": True}, kind="chat").logprobs == 0
    assert parse({"messages": CHAT, "logprobs": False, "top_logprobs": 0}, kind="chat").logprobs is None
    text = parse({"prompt": "hi", "logprobs": 0, "n": 2, "best_of": 2})
    assert (text.logprobs, text.n, text.echo) == (0, 2, False)
    echo = parse({"prompt": "hi", "echo": True, "logprobs": 1, "max_tokens": 0})
    assert (echo.logprobs, echo.echo, echo.prompt_logprobs, echo.params.max_tokens) == (1, True, True, 0)
    full = parse({"prompt": [1] * CONTEXT, "echo": True, "max_tokens": 0})  # nothing generated: it may fill the context
    assert (len(full.prompt_ids), full.params.max_tokens, full.prompt_logprobs) == (CONTEXT, 0, False)


def test_each_choice_samples_with_its_own_reproducible_seed():
    seeded = parse({"prompt": "hi", "n": 3, "seed": 42, "temperature": 1})
    seeds = [seeded.choice_params(i).seed for i in range(3)]
    assert seeds[0] == 42 and len(set(seeds)) == 3
    assert seeds == [parse({"prompt": "hi", "n": 3, "seed": 42}).choice_params(i).seed for i in range(3)]
    unseeded = parse({"prompt": "hi", "n": 2})
    assert unseeded.choice_params(1).seed is None and unseeded.choice_params(1).max_tokens == 16


def test_fields_at_their_neutral_values_are_accepted():
    neutral = {"logprobs": False, "presence_penalty": 0, "frequency_penalty": 0.0, "echo": False, "best_of": 1}
    request = parse({"messages": [{"role": "user", "content": "hi"}], "n": None, **neutral}, kind="chat")
    assert request.params.max_tokens == 16
    assert (request.logprobs, request.n, request.echo) == (None, 1, False)
    assert parse({"prompt": "hi", "logprobs": None, "echo": None, "best_of": None}).logprobs is None


def test_a_null_max_completion_tokens_leaves_max_tokens_in_force():
    assert parse({"prompt": "hi", "max_completion_tokens": None, "max_tokens": 2}).params.max_tokens == 2
    assert parse({"prompt": "hi", "max_completion_tokens": 3, "max_tokens": 2}).params.max_tokens == 3

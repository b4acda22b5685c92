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

    def encode_chat(self, messages: list[dict], *, special_in_content: bool = False) -> list[int]:
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
        ({"prompt": "hi", "logprobs": 5}, 400, "logprobs", None),
        ({"prompt": "hi", "echo": True}, 400, "echo", None),
        ({"prompt": "hi", "suffix": "!"}, 400, "suffix", None),
        ({"prompt": "hi", "presence_penalty": 1.5}, 400, "presence_penalty", None),
        ({"prompt": "hi", "frequency_penalty": -0.5}, 400, "frequency_penalty", None),
        ({"prompt": "hi", "best_of": 3}, 400, "best_of", None),
        ({"prompt": "hi", "n": 2}, 400, "n", None),
    ],
)
def test_what_the_server_cannot_honour_is_refused_naming_the_field(body, status, param, code):
    with pytest.raises(APIRequestError) as refused:
        parse(body)
    assert (refused.value.http_status, refused.value.param, refused.value.http_code) == (status, param, code)


def test_fields_at_their_neutral_values_are_accepted():
    neutral = {"logprobs": False, "presence_penalty": 0, "frequency_penalty": 0.0, "echo": False, "best_of": 1}
    request = parse({"messages": [{"role": "user", "content": "hi"}], "n": None, **neutral}, kind="chat")
    assert request.params.max_tokens == 16


def test_a_null_max_completion_tokens_leaves_max_tokens_in_force():
    assert parse({"prompt": "hi", "max_completion_tokens": None, "max_tokens": 2}).params.max_tokens == 2
    assert parse({"prompt": "hi", "max_completion_tokens": 3, "max_tokens": 2}).params.max_tokens == 3

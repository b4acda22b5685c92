"""Log-probabilities, echo and several choices from a real decode daemon (the real model, the
session's prefill server) on 127.0.0.1: every response checked against the ``openai`` package's own
response models, streamed and whole; the echo's prompt log-probabilities against the engine's own
teacher-forced ones; and the context's limit as a 400."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
from openai import OpenAI
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from serving_helpers import pulling_daemon

TOKEN = "logprobs-secret"
MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
CONTEXT = 2048  # server_config's max_context


@pytest.fixture(scope="module")
def daemon(prefill_server, tmp_path_factory):
    server = pulling_daemon(tmp_path_factory.mktemp("logprobs-daemon"), prefill_server.url, TOKEN)
    yield server
    server.stop()


def _client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=TOKEN, timeout=120, max_retries=0)


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}
    request = urllib.request.Request(server.url + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _events(server, path: str, body: dict) -> list[dict]:
    """The JSON events of a streamed answer, up to ``data: [DONE]``."""
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}
    request = urllib.request.Request(server.url + path, json.dumps({**body, "stream": True}).encode(), headers)
    events = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            if line.startswith(b"data: "):
                data = line[6:].strip()
                if data == b"[DONE]":
                    return events
                events.append(json.loads(data))
    raise AssertionError("the stream ended without [DONE]")


def _completion_chunk(event: dict) -> Completion:
    """A streamed completions chunk validated as the openai package's Completion, whose choices' finish_reason
    it types non-null although OpenAI streams null until the last chunk (as this server does)."""
    choices = [{**choice, "finish_reason": choice["finish_reason"] or "length"} for choice in event["choices"]]
    return Completion.model_validate({**event, "choices": choices})


def _chat_entries(choice) -> list:
    return choice.logprobs.content if choice.logprobs is not None and choice.logprobs.content else []


# --- chat ------------------------------------------------------------------------------------------------


def test_chat_logprobs_of_a_greedy_answer_whole_and_streamed(daemon):
    body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 12, "logprobs": True}
    status, whole = _post(daemon, "/v1/chat/completions", {**body, "top_logprobs": 3})
    assert status == 200, whole
    parsed = ChatCompletion.model_validate(whole)
    choice = parsed.choices[0]
    answer, content = choice.message.content, choice.logprobs.content
    assert answer and "Paris" in answer and len(content) == parsed.usage.completion_tokens
    assert "".join(entry.token for entry in content) == answer  # plain ASCII: each token's text whole
    for entry in content:
        assert entry.bytes == list(entry.token.encode()) and entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == entry.top_logprobs[0].logprob and entry.token == entry.top_logprobs[0].token
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)

    events = _events(daemon, "/v1/chat/completions", {**body, "top_logprobs": 3})
    chunks = [ChatCompletionChunk.model_validate(event) for event in events]
    text, streamed = "", []
    for chunk in chunks:
        delta = chunk.choices[0].delta
        entries = _chat_entries(chunk.choices[0])
        assert "".join(e.token for e in entries) == (delta.content or "")  # each chunk carries its tokens
        text += delta.content or ""
        streamed += entries
    assert text == answer
    assert [e.token for e in streamed] == [e.token for e in content]
    np.testing.assert_allclose([e.logprob for e in streamed], [e.logprob for e in content], atol=1e-5)

    # the openai client parses the same
    client = _client(daemon).chat.completions.create(**body, top_logprobs=1)
    assert [e.token for e in client.choices[0].logprobs.content] == [e.token for e in content]


def test_chat_logprobs_of_a_stream_cut_by_a_stop_string(daemon):
    body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 12, "logprobs": True}
    events = _events(daemon, "/v1/chat/completions", {**body, "stop": ["Paris"]})
    chunks = [ChatCompletionChunk.model_validate(event) for event in events]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    tokens = [e.token for c in chunks if c.choices for e in _chat_entries(c.choices[0])]
    spelled = "".join(tokens)
    assert "Paris" not in text
    # every token whose text was sent, the one running into the stop string included, nothing after it
    assert spelled.startswith(text) and (text + "Paris").startswith(spelled)
    assert len("".join(tokens[:-1])) < len(text)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


# --- completions -------------------------------------------------------------------------------------------


def test_completion_logprobs_whole_and_streamed(daemon):
    body = {"model": MODEL, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 6, "logprobs": 2}
    status, whole = _post(daemon, "/v1/completions", body)
    assert status == 200, whole
    choice = Completion.model_validate(whole).choices[0]
    logprobs = choice.logprobs
    n = whole["usage"]["completion_tokens"]
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == n > 0
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(n)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 2 and top[token] == logprob == max(top.values())  # greedy: the most likely

    events = _events(daemon, "/v1/completions", body)
    chunks = [_completion_chunk(event) for event in events]
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for key, values in streamed.items():
                values += getattr(chunk.choices[0].logprobs, key)
    assert streamed["tokens"] == logprobs.tokens and streamed["text_offset"] == logprobs.text_offset
    np.testing.assert_allclose(streamed["token_logprobs"], logprobs.token_logprobs, atol=1e-5)


def test_echo_log_likelihood_equals_the_engines_own(daemon, decoder, smollm2_model):
    """What lm-evaluation-harness asks: the continuation's log-likelihood given its context."""
    tokenizer = smollm2_model.tokenizer
    context, continuation = "Question: What is the capital of France?\nAnswer:", " The capital of France is Paris."
    ids = tokenizer.encode(context + continuation)
    n_context = len(tokenizer.encode(context))
    assert ids[:n_context] == tokenizer.encode(context)  # the continuation starts at a token boundary
    body = {"model": MODEL, "prompt": context + continuation, "echo": True, "logprobs": 1, "temperature": 0}
    status, whole = _post(daemon, "/v1/completions", {**body, "max_tokens": 0})
    assert status == 200, whole
    choice, report = whole["choices"][0], whole["edgedecode"]["kv"]
    logprobs = choice["logprobs"]
    assert choice["text"] == context + continuation and choice["finish_reason"] == "length"
    assert whole["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    assert (report["source"], report["local_reason"], report["computed_tokens"]) == (
        "local",
        "prompt_logprobs",
        len(ids),
    )
    assert report["pulled_tokens"] == 0 and report["wire_bytes"] == 0
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["text_offset"] == [len(tokenizer.decode(ids[:i])) for i in range(len(ids))]
    # the openai package types these lists without the nulls OpenAI's echo sends: validated after them
    strict = {key: values[1:] for key, values in logprobs.items()}
    Completion.model_validate({**whole, "choices": [{**choice, "logprobs": strict}]})

    # the same graph, teacher-forced here: log-softmax of every position's logits (a row's logits are the
    # same in any run, whatever its size, but as a lone last row in an attention tile: engine.chunk_sizes)
    decoder.reset()
    shifted = decoder.forward(np.asarray(ids), all_logits=True).astype(np.float64)
    shifted -= shifted.max(1, keepdims=True)
    reference = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
    expected = reference[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(logprobs["token_logprobs"][1:], expected, atol=1e-4)
    served = sum(logprobs["token_logprobs"][n_context:])
    assert served == pytest.approx(expected[n_context - 1 :].sum(), abs=1e-3)
    for i, top in enumerate(logprobs["top_logprobs"][1:]):
        token = logprobs["tokens"][i + 1]
        assert token in top and len(top) <= 2
        assert max(top.values()) == pytest.approx(reference[i].max(), abs=1e-4)

    # with max_tokens 1 (as the harness also sends) the prompt's entries are the same, then the token
    client = _client(daemon).completions.create(**body, max_tokens=1)
    echoed = client.choices[0].logprobs
    assert echoed.tokens[: len(ids)] == logprobs["tokens"] and len(echoed.tokens) == len(ids) + 1
    np.testing.assert_allclose(echoed.token_logprobs[1 : len(ids)], logprobs["token_logprobs"][1:], atol=1e-5)
    assert client.choices[0].text.startswith(context + continuation)
    assert echoed.text_offset[-1] == len(context + continuation)


def test_echo_streams_the_prompt_first(daemon):
    body = {"model": MODEL, "prompt": "One, two, three,", "echo": True, "logprobs": 0, "max_tokens": 3}
    events = _events(daemon, "/v1/completions", {**body, "temperature": 0})
    chunks = [e for e in events if e["choices"]]
    assert chunks[0]["choices"][0]["text"] == "One, two, three,"
    first = chunks[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None and all(lp is not None for lp in first["token_logprobs"][1:])
    assert events[-1]["edgedecode"]["kv"]["local_reason"] == "prompt_logprobs"
    without = _events(daemon, "/v1/completions", {**body, "logprobs": None, "temperature": 0})
    assert [e["choices"][0]["logprobs"] for e in without if e["choices"]] == [None] * len(without)
    assert without[-1]["edgedecode"]["kv"]["local_reason"] is None  # no log-probabilities: pulled as usual
    assert without[0]["choices"][0]["text"] == "One, two, three,"


# --- several choices ---------------------------------------------------------------------------------------


def test_several_choices_whole_and_streamed(daemon, smollm2_model):
    prompt_tokens = len(smollm2_model.tokenizer.encode_chat(QUESTION))
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 11}
    status, whole = _post(daemon, "/v1/chat/completions", {**body, "logprobs": True})
    assert status == 200, whole
    parsed = ChatCompletion.model_validate(whole)
    assert [c.index for c in parsed.choices] == [0, 1, 2]
    assert parsed.usage.prompt_tokens == prompt_tokens  # the prompt counted (and pulled) once
    assert parsed.usage.completion_tokens == sum(len(c.logprobs.content) for c in parsed.choices)
    texts = [c.message.content for c in parsed.choices]
    assert len(set(texts)) > 1  # each choice samples with its own seed
    again = ChatCompletion.model_validate(_post(daemon, "/v1/chat/completions", body)[1])
    assert [c.message.content for c in again.choices] == texts  # and reproduce

    events = _events(daemon, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    chunks = [ChatCompletionChunk.model_validate(event) for event in events]
    streamed = {0: "", 1: "", 2: ""}
    finished = []
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        streamed[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finished.append(choice.index)
    assert finished == [0, 1, 2] and list(streamed.values()) == texts  # the same seeds, streamed
    assert sum(1 for c in chunks[:-1] if c.choices[0].delta.role == "assistant") == 3
    assert "edgedecode" in events[-2] and chunks[-1].usage.completion_tokens == parsed.usage.completion_tokens

    greedy = _client(daemon).completions.create(model=MODEL, prompt="The sky is", max_tokens=4, n=2, temperature=0)
    assert [c.index for c in greedy.choices] == [0, 1] and greedy.choices[0].text == greedy.choices[1].text
    status, error = _post(daemon, "/v1/completions", {"prompt": "hi", "n": 9})
    assert status == 400 and error["error"]["param"] == "n" and "8" in error["error"]["message"]


# --- refusals and the context ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"messages": QUESTION, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": QUESTION, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": QUESTION, "echo": True}, "echo"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 6}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 4}, "best_of"),
    ],
)
def test_refusals_name_the_field(daemon, path, body, param):
    status, error = _post(daemon, path, body)
    assert (status, error["error"]["type"], error["error"]["param"]) == (400, "invalid_request_error", param), error


def test_a_prompt_over_the_context_is_a_400_naming_the_limit(daemon, smollm2_model):
    for path, body, param in (
        ("/v1/completions", {"prompt": [1] * CONTEXT}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * CONTEXT}]}, "messages"),
        ("/v1/completions", {"prompt": [1] * (CONTEXT + 1), "echo": True, "max_tokens": 0}, "prompt"),
        ("/v1/completions", {"prompt": [1] * 2000, "max_tokens": 100}, "max_tokens"),
    ):
        status, error = _post(daemon, path, body)
        assert (status, error["error"]["code"], error["error"]["param"]) == (400, "context_length_exceeded", param)
        assert f"holds {CONTEXT}" in error["error"]["message"], error
    # an echo that generates nothing may fill the context: nothing runs after its last token
    status, whole = _post(daemon, "/v1/completions", {"prompt": [28] * CONTEXT, "echo": True, "max_tokens": 0})
    assert status == 200 and whole["usage"]["prompt_tokens"] == CONTEXT
    assert whole["choices"][0]["text"] == smollm2_model.tokenizer.decode([28] * CONTEXT)

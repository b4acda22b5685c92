"""The OpenAI-compatible requests of the decode daemon, validated and tokenized (their answers'
text and shapes: ``openai_responses``).

``POST /v1/chat/completions`` and ``POST /v1/completions``, with up to ``MAX_CHOICES`` choices (``n``),
log-probabilities (``logprobs``/``top_logprobs``) and, for completions, ``echo``; ``stream``
answers with server-sent events ending in ``data: [DONE]``. Beyond the OpenAI fields, requests may
carry ``session_id`` (a conversation whose KV the daemon keeps between turns; the
``X-Session-Id`` header works too), ``top_k`` and ``ttft_target_ms`` (a time-to-first-token
target for this request, 0 for none, overriding ``daemon.ttft_target_ms``); every final response
or chunk carries an ``edgedecode`` object with the turn's timings and where its KV came from.
Chat requests may ask for JSON (``response_format``) and offer ``tools`` (``output_rules``: the
constraint; ``tool_prompt``: how the model is told of them and of past calls and results).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from edgedecode.daemon.output_rules import OutputRule, output_rule
from edgedecode.daemon.tool_prompt import chat_messages, tool_format
from edgedecode.errors import RequestError
from edgedecode.model.loader import LoadedModel
from edgedecode.runtime.logprobs import MAX_TOP
from edgedecode.runtime.sampler import SamplingParams

if TYPE_CHECKING:  # the type only: llguidance is imported where grammars are made
    from edgedecode.runtime.constraint import Grammar

MAX_STOP_STRINGS = 4
# Choices one request may ask for: they run one after the other in the request's slot (the prompt's
# KV pulled or computed once), so n choices take n times one choice's decode time.
MAX_CHOICES = 8
MAX_LEGACY_LOGPROBS = 5  # /v1/completions' logprobs (alternatives per position), as OpenAI bounds it
# Fields this server does not implement; a request that asks for one (any value but null, false, 0 or
# empty) is refused rather than answered as if the field were not there.
_UNSUPPORTED = (
    "functions",
    "function_call",
    "logit_bias",
    "suffix",
    "presence_penalty",
    "frequency_penalty",
)
_CHAT_ONLY = ("tools", "tool_choice", "response_format")  # chat completions' fields, refused on /v1/completions


class APIRequestError(RequestError):
    """An invalid completion request; ``code`` is OpenAI's error code where it has one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message, param)
        self.http_code = code


class ModelNotFoundError(APIRequestError):
    """A request for a model this server does not serve (404 ``model_not_found``, as OpenAI answers)."""

    http_status = 404


@dataclass(frozen=True)
class CompletionRequest:
    """A validated completion request, tokenized."""

    kind: str  # "chat" or "text"
    prompt_ids: np.ndarray
    params: SamplingParams
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    session_id: str | None
    user: str | None
    ttft_target_ms: float | None = None  # this request's time-to-first-token target (None: the daemon's)
    n: int = 1  # choices, generated one after the other in the request's slot
    logprobs: int | None = None  # alternatives per position with each token's log-probability (None: none asked)
    echo: bool = False  # completions: the prompt's text (and, with logprobs, its tokens' log-probabilities) first
    output: OutputRule | None = None  # the answer's form (response_format, tools); None: free text
    grammar: Grammar | None = None  # ``output``'s grammar, compiled (by the daemon, off the event loop)

    @property
    def prompt_logprobs(self) -> bool:
        """Whether the prompt's tokens are scored too (echo with logprobs): its KV is computed here."""
        return self.echo and self.logprobs is not None

    def choice_params(self, index: int) -> SamplingParams:
        """The sampling of choice ``index``: choice 0 samples with the request's seed, each further one
        with a seed derived from it and its index, so that seeded choices differ yet reproduce."""
        seed = self.params.seed
        if index == 0 or seed is None:
            return self.params
        derived = int(np.random.SeedSequence((seed, index)).generate_state(1, np.uint64)[0])
        return replace(self.params, seed=derived)


def parse_request(
    body: dict,
    kind: str,
    model: LoadedModel,
    *,
    default_max_tokens: int,
    session_header: str | None,
    max_context: int | None = None,
    allow_special_tokens: bool = False,
) -> CompletionRequest:
    """Validate an OpenAI request body of ``kind`` ("chat" or "text") and tokenize its prompt.

    ``max_context`` (default: the model's) bounds prompt + completion: an explicit ``max_tokens``
    beyond it is refused (context_length_exceeded), the default is cut to fit. Client text spells
    control tokens only with ``allow_special_tokens``; otherwise ``<|im_start|>`` is plain text.
    """
    for name in _UNSUPPORTED + (_CHAT_ONLY if kind == "text" else ()):
        if body.get(name):
            raise APIRequestError(
                f"{name} is not supported by this server{' on /v1/completions' * (name in _CHAT_ONLY)}", name
            )
    if body.get("model") not in (None, model.record.name):
        raise ModelNotFoundError(
            f"this server serves {model.record.name!r}, not {body['model']!r}", "model", "model_not_found"
        )
    n = _choices(body)
    logprobs = _chat_logprobs(body) if kind == "chat" else _text_logprobs(body)
    echo = _echo(body, kind)
    output = _output_rule(body, model) if kind == "chat" else None
    prompt_ids = (
        _chat_prompt(body, model, allow_special_tokens, output)
        if kind == "chat"
        else _text_prompt(body, model, allow_special_tokens)
    )
    params = _sampling(
        body,
        len(prompt_ids),
        max_context or model.spec.context_length,
        default_max_tokens,
        model.spec.vocab_size,
        echo,
    )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIRequestError("stream must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIRequestError("stream_options must be an object", "stream_options")
    session_id = body.get("session_id", session_header)
    user = body.get("user")
    for name, value in (("session_id", session_id), ("user", user)):
        if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 256):
            raise APIRequestError(f"{name} must be a string of 1 to 256 characters", name)
    target = body.get("ttft_target_ms")
    return CompletionRequest(
        kind,
        prompt_ids,
        params,
        stream,
        bool(options.get("include_usage", False)),
        _stop(body.get("stop")),
        session_id,
        user,
        None if target is None else _number(target, "ttft_target_ms", float, 0, 3_600_000),
        n,
        logprobs,
        echo,
        output,
    )


def _choices(body: dict) -> int:
    """``n`` (1 to MAX_CHOICES); ``best_of`` only where it changes nothing: equal to ``n``."""
    n = 1 if body.get("n") is None else _number(body["n"], "n", int, 1, MAX_CHOICES)
    best_of = body.get("best_of")
    if best_of is not None and _number(best_of, "best_of", int, 1, None) != n:
        raise APIRequestError(
            f"best_of must equal n ({n}): this server returns every choice it generates, it does not rank them",
            "best_of",
        )
    return n


def _chat_logprobs(body: dict) -> int | None:
    """Chat's ``logprobs`` (a boolean) and ``top_logprobs`` (0 to 20, only with logprobs): the
    alternatives per position, or None when no log-probabilities are asked for."""
    asked = body.get("logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise APIRequestError("logprobs must be a boolean", "logprobs")
    top = body.get("top_logprobs")
    top = 0 if top is None else _number(top, "top_logprobs", int, 0, MAX_TOP)
    if top and not asked:
        raise APIRequestError("top_logprobs needs logprobs: true", "top_logprobs")
    return top if asked else None


def _text_logprobs(body: dict) -> int | None:
    """Completions' ``logprobs``: 0 to 5 alternatives per position (0: the chosen token's only), null
    or false for none. ``top_logprobs`` is chat's field."""
    if body.get("top_logprobs"):
        raise APIRequestError("top_logprobs is a chat completions field; here logprobs takes 0 to 5", "top_logprobs")
    asked = body.get("logprobs")
    if asked is None or asked is False:
        return None
    return _number(asked, "logprobs", int, 0, MAX_LEGACY_LOGPROBS)


def _echo(body: dict, kind: str) -> bool:
    """Completions' ``echo``; chat completions have no such field and OpenAI refuses it there."""
    echo = body.get("echo")
    if kind == "chat":
        if echo:
            raise APIRequestError("echo is a completions field (/v1/completions), not a chat one", "echo")
        return False
    if echo is not None and not isinstance(echo, bool):
        raise APIRequestError("echo must be a boolean", "echo")
    return bool(echo)


def _sampling(
    body: dict, prompt_tokens: int, max_context: int, default_max_tokens: int, vocab_size: int, echo: bool = False
) -> SamplingParams:
    """The sampling fields, each checked against its range so that nothing fails once generation runs.

    ``max_tokens`` 0 is taken with ``echo`` only (the prompt scored, nothing generated: the prompt
    may then fill the whole context); otherwise the context holds the prompt and one token at least."""
    given = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    asked = None if body.get(given) is None else _number(body[given], given, int, 0 if echo else 1, None)
    room = max_context - prompt_tokens
    if room < (0 if asked == 0 else 1):
        generated = "" if asked == 0 else " including at least one generated token"
        raise APIRequestError(
            f"the prompt has {prompt_tokens} tokens; this server's context holds {max_context}{generated}",
            "messages" if "messages" in body else "prompt",
            "context_length_exceeded",
        )
    if asked is None:
        max_tokens = min(default_max_tokens, room)
    else:
        max_tokens = asked
        if max_tokens > room:
            raise APIRequestError(
                f"this server's context holds {max_context} tokens; the prompt has {prompt_tokens} "
                f"and {given} asks for {max_tokens} more (at most {room} fit)",
                given,
                "context_length_exceeded",
            )
    top_p = _number(body.get("top_p", 1.0), "top_p", float, 0, 1)
    if top_p == 0:
        raise APIRequestError("top_p must be in (0, 1]: 0 would keep no token", "top_p")
    seed = body.get("seed")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(body.get("temperature", 1.0), "temperature", float, 0, None),
        top_p=top_p,
        top_k=_number(body.get("top_k", 0), "top_k", int, 0, vocab_size),
        seed=None if seed is None else _number(seed, "seed", int, 0, 2**64 - 1),
    )


def _number(value, name: str, kind: type, low: float, high: float | None):
    """``value`` as ``kind`` (int or float), finite and within [low, high] (no upper bound: None)."""
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not numeric or (kind is int and not float(value).is_integer()):
        raise APIRequestError(f"{name} must be {'an integer' if kind is int else 'a finite number'}", name)
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise APIRequestError(f"{name} must be {bounds}, not {value}", name)
    return kind(value)


def _output_rule(body: dict, model: LoadedModel) -> OutputRule | None:
    if not any(body.get(name) is not None for name in _CHAT_ONLY):
        return None
    try:
        return output_rule(body, tool_format(model.tokenizer.chat_template))
    except RequestError as exc:
        raise APIRequestError(str(exc), exc.param) from exc


def _chat_prompt(body: dict, model: LoadedModel, allow_special_tokens: bool, output: OutputRule | None) -> np.ndarray:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIRequestError("messages must be a non-empty list", "messages")
    checked = [_message(message, i) for i, message in enumerate(messages)]
    specs = [tool.spec for tool in output.tools] if output is not None and output.tools else None
    native = False
    if specs or any(m["role"] == "tool" or "tool_calls" in m for m in checked):  # the template's tool format matters
        form = output.form if output is not None and output.form else tool_format(model.tokenizer.chat_template)
        checked, native = chat_messages(checked, specs, form), form.native
    ids = model.tokenizer.encode_chat(checked, special_in_content=allow_special_tokens, tools=specs if native else None)
    return np.asarray(ids, np.int64)


def _message(message: object, index: int) -> dict:
    """A chat message, checked: a role of system (developer), user, assistant or tool and text content;
    an assistant's ``tool_calls`` (its content may then be null), a tool result's ``tool_call_id``."""
    roles = ("system", "developer", "user", "assistant", "tool")
    if not isinstance(message, dict) or message.get("role") not in roles:
        raise APIRequestError(f"messages[{index}] needs a role of {', '.join(roles)}", "messages")
    role = "system" if message["role"] == "developer" else message["role"]
    calls = message.get("tool_calls") if role == "assistant" else None
    if calls is not None and not (isinstance(calls, list) and all(_is_call(call) for call in calls)):
        raise APIRequestError(
            f'messages[{index}].tool_calls must be a list of {{"id", "type": "function", "function": '
            '{"name", "arguments"}}',
            "messages",
        )
    content = message.get("content")
    checked: dict = {"role": role, "content": "" if content is None and calls else _content_text(content, index)}
    if calls:
        checked["tool_calls"] = calls
    if role == "tool":
        call_id = message.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise APIRequestError(f"messages[{index}].tool_call_id must be a string", "messages")
        checked["tool_call_id"] = call_id
    return checked


def _is_call(call: object) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return (
        isinstance(function, dict)
        and isinstance(function.get("name"), str)
        and isinstance(function.get("arguments"), str)
    )


def _content_text(content, index: int) -> str:
    """A message's text: a string, or a list of text parts (other part types are refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise APIRequestError(f"messages[{index}].content must be a string or a list of text parts", "messages")


def _text_prompt(body: dict, model: LoadedModel, allow_special_tokens: bool) -> np.ndarray:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        ids = model.tokenizer.encode(prompt, parse_special=allow_special_tokens)
        if not ids:
            raise APIRequestError("prompt is empty: it must hold at least one token", "prompt")
        return np.asarray(ids, np.int64)
    vocab = model.spec.vocab_size
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt)
    ):
        return np.asarray(prompt, np.int64)
    raise APIRequestError(
        f"prompt must be a string or one list of token ids in [0, {vocab}) (batched prompts are not supported)",
        "prompt",
    )


def _stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stops):
        raise APIRequestError(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS}", "stop")
    return tuple(stops)

"""The OpenAI-compatible request and response shapes of the decode daemon.

``POST /v1/chat/completions`` and ``POST /v1/completions`` with one choice (n = 1); ``stream``
answers with server-sent events ending in ``data: [DONE]``. Beyond the OpenAI fields, requests may
carry ``session_id`` (a conversation whose KV the daemon keeps between turns; the
``X-Session-Id`` header works too), ``top_k`` and ``ttft_target_ms`` (a time-to-first-token
target for this request, 0 for none, overriding ``daemon.ttft_target_ms``); every final response
or chunk carries an ``edgedecode`` object with the turn's timings and where its KV came from.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass

import numpy as np

from edgedecode.errors import RequestError
from edgedecode.model.loader import LoadedModel
from edgedecode.runtime.sampler import SamplingParams

MAX_STOP_STRINGS = 4
# Fields this server does not implement; a request that asks for one (any value but null, false, 0 or
# empty) is refused rather than answered as if the field were not there.
_UNSUPPORTED = (
    "tools",
    "functions",
    "tool_choice",
    "function_call",
    "logit_bias",
    "response_format",
    "logprobs",
    "top_logprobs",
    "echo",
    "suffix",
    "presence_penalty",
    "frequency_penalty",
)
_ONE_ONLY = ("n", "best_of")  # several choices per request are not supported


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
    for name in _UNSUPPORTED:
        if body.get(name):
            raise APIRequestError(f"{name} is not supported by this server", name)
    if body.get("model") not in (None, model.record.name):
        raise ModelNotFoundError(
            f"this server serves {model.record.name!r}, not {body['model']!r}", "model", "model_not_found"
        )
    for name in _ONE_ONLY:
        if body.get(name, 1) not in (None, 1):
            raise APIRequestError(f"only {name} = 1 is supported", name)
    prompt_ids = (
        _chat_prompt(body, model, allow_special_tokens)
        if kind == "chat"
        else _text_prompt(body, model, allow_special_tokens)
    )
    params = _sampling(
        body, len(prompt_ids), max_context or model.spec.context_length, default_max_tokens, model.spec.vocab_size
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
    )


def _sampling(
    body: dict, prompt_tokens: int, max_context: int, default_max_tokens: int, vocab_size: int
) -> SamplingParams:
    """The sampling fields, each checked against its range so that nothing fails once generation runs."""
    room = max_context - prompt_tokens
    if room < 1:
        raise APIRequestError(
            f"the prompt has {prompt_tokens} tokens; this server's context holds {max_context} "
            "including at least one generated token",
            "messages" if "messages" in body else "prompt",
            "context_length_exceeded",
        )
    given = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if body.get(given) is None:
        max_tokens = min(default_max_tokens, room)
    else:
        max_tokens = _number(body[given], given, int, 1, None)
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


def _chat_prompt(body: dict, model: LoadedModel, allow_special_tokens: bool) -> np.ndarray:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIRequestError("messages must be a non-empty list", "messages")
    rendered = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "developer", "user", "assistant"):
            raise APIRequestError(f"messages[{i}] needs a role of system, developer, user or assistant", "messages")
        role = "system" if message["role"] == "developer" else message["role"]
        rendered.append({"role": role, "content": _content_text(message.get("content"), i)})
    return np.asarray(model.tokenizer.encode_chat(rendered, special_in_content=allow_special_tokens), np.int64)


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


class StopText:
    """Cuts generated text at the first stop string, holding back a tail that could start one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text safe to emit now; after a stop string, nothing more."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self._pending += text
        cut = min((i for i in (self._pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self._pending = self._pending[:cut], ""
            return out
        keep = len(self._pending) - self._hold
        out, self._pending = self._pending[: max(keep, 0)], self._pending[max(keep, 0) :]
        return out

    def flush(self) -> str:
        """What is held back, once generation has ended."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out


@dataclass
class ResponseShape:
    """Builds the JSON objects of one response (chat or text, streamed or whole)."""

    kind: str
    model: str

    def __post_init__(self) -> None:
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        self.id = f"{prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())

    def _envelope(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str | None = None, *, first: bool = False, finish_reason: str | None = None) -> dict:
        """One streamed chunk: a text delta, or the final one with its finish reason."""
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._envelope("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._envelope("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        """The last chunk of a stream asked to include usage: no choices, the counts."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._envelope(obj), "choices": [], "usage": usage}

    def whole(self, text: str, finish_reason: str, usage: dict) -> dict:
        """The non-streamed response."""
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            return {**self._envelope("chat.completion"), "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._envelope("text_completion"), "choices": [choice], "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """The OpenAI usage object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }

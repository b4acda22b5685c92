"""The OpenAI-compatible request and response shapes of the decode daemon.

``POST /v1/chat/completions`` and ``POST /v1/completions``, with up to ``MAX_CHOICES`` choices (``n``),
log-probabilities (``logprobs``/``top_logprobs``) and, for completions, ``echo``; ``stream``
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
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from edgedecode.errors import RequestError
from edgedecode.model.loader import LoadedModel
from edgedecode.runtime.logprobs import MAX_TOP, ScoredToken
from edgedecode.runtime.sampler import SamplingParams

MAX_STOP_STRINGS = 4
# Choices one request may ask for: they run one after the other in the request's slot (the prompt's
# KV pulled or computed once), so n choices take n times one choice's decode time.
MAX_CHOICES = 8
MAX_LEGACY_LOGPROBS = 5  # /v1/completions' logprobs (alternatives per position), as OpenAI bounds it
# Fields this server does not implement; a request that asks for one (any value but null, false, 0 or
# empty) is refused rather than answered as if the field were not there.
_UNSUPPORTED = (
    "tools",
    "functions",
    "tool_choice",
    "function_call",
    "logit_bias",
    "response_format",
    "suffix",
    "presence_penalty",
    "frequency_penalty",
)


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
    for name in _UNSUPPORTED:
        if body.get(name):
            raise APIRequestError(f"{name} is not supported by this server", name)
    if body.get("model") not in (None, model.record.name):
        raise ModelNotFoundError(
            f"this server serves {model.record.name!r}, not {body['model']!r}", "model", "model_not_found"
        )
    n = _choices(body)
    logprobs = _chat_logprobs(body) if kind == "chat" else _text_logprobs(body)
    echo = _echo(body, kind)
    prompt_ids = (
        _chat_prompt(body, model, allow_special_tokens)
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


# A token's entry in a response's log-probabilities: (characters of its choice's text before the
# token's, the token scored, or a bare token id for the prompt's first token, which has no log-probability)
Entry = tuple[int, ScoredToken | int]
_NO_ENTRIES: list[Entry] = []  # what an untracked TokenText hands out (never appended to)


class TokenDecoder(Protocol):
    """``model.tokenizer.StreamDecoder`` as TokenText uses it."""

    def feed(self, token_id: int) -> str: ...

    def flush(self) -> str: ...

    @property
    def held(self) -> int: ...


class TokenText:
    """One choice's tokens to the text sent: UTF-8 sequences completed (the tokenizer's stream
    decoder), stop strings cut (StopText); with ``tracked``, each token's entry is handed out with
    the text that completes the token's text, so that a stream's log-probabilities line up with its
    text.

    A token's text runs from the first character its bytes contribute to, to the end of the character
    its last byte completes: a token that starts a multi-byte character goes out with the token that
    ends it. Text held back because it could start a stop string holds its tokens' entries back with
    it. A stop string cuts the tokens whose text is wholly in it (or after it); a token whose text
    starts before the cut and runs into it goes out with the text sent of it. Untracked, a token costs
    what the text alone costs.
    """

    def __init__(self, decoder: TokenDecoder, stops: tuple[str, ...], *, base: int = 0, tracked: bool = False) -> None:
        self._decoder = decoder
        self._stop = StopText(stops)
        self._base = base  # characters before this text in the choice's (the echoed prompt's)
        self._tracked = tracked
        self._decoded = 0  # characters decoded so far
        self._sent = 0  # characters handed out so far
        self._waiting: deque[list] = deque()  # [entry payload, start, end (None: the decoder holds part of it)]

    @property
    def stopped(self) -> bool:
        return self._stop.stopped

    def feed(self, token: int, payload: ScoredToken | int | None = None) -> tuple[str, list[Entry]]:
        """Add one token (``payload``: its entry, when tracked); the text to send now and the
        entries of the tokens that text completes."""
        text = self._decoder.feed(token)
        if not self._tracked:
            return self._stop.feed(text), _NO_ENTRIES
        start = self._decoded
        self._decoded += len(text)
        if text:  # the tokens whose character this one completed
            for waiting in self._waiting:
                if waiting[2] is None:
                    waiting[2] = self._decoded
        end = None if self._decoder.held else self._decoded
        self._waiting.append([token if payload is None else payload, start, end])
        return self._send(self._stop.feed(text))

    def finish(self) -> tuple[str, list[Entry]]:
        """The rest, once the choice's tokens have all been fed."""
        text = self._decoder.flush()
        if not self._tracked:
            return self._stop.feed(text) + self._stop.flush(), _NO_ENTRIES
        self._decoded += len(text)
        for waiting in self._waiting:
            if waiting[2] is None:
                waiting[2] = self._decoded
        return self._send(self._stop.feed(text) + self._stop.flush())

    def _send(self, out: str) -> tuple[str, list[Entry]]:
        self._sent += len(out)
        waiting, entries = self._waiting, []
        while waiting and waiting[0][2] is not None and waiting[0][2] <= self._sent:
            payload, start, _ = waiting.popleft()
            entries.append((self._base + start, payload))
        if self._stop.stopped:  # the cut: what starts before it goes with it, the rest never goes
            while waiting and waiting[0][1] < self._sent:
                payload, start, _ = waiting.popleft()
                entries.append((self._base + start, payload))
            waiting.clear()
        return out, entries


class TokenSpelling(Protocol):
    """What ResponseShape needs of the tokenizer: a token's bytes."""

    def token_bytes(self, token_id: int, *, skip_special: bool = True) -> bytes: ...


@dataclass(frozen=True)
class ChoiceResult:
    """One whole choice: its text, why it ended, its tokens' entries (None: none asked for)."""

    text: str
    finish_reason: str
    entries: list[Entry] | None = None


@dataclass
class ResponseShape:
    """Builds the JSON objects of one response (chat or text, streamed or whole).

    ``tokenizer`` spells the tokens of log-probabilities: a token's ``bytes`` are its raw bytes
    (special tokens' literal text included); its ``token`` string is those bytes as UTF-8, or, where
    they are not valid UTF-8 on their own (part of a character), ``bytes:\\xe2\\x80`` as OpenAI spells them.
    """

    kind: str
    model: str
    tokenizer: TokenSpelling | None = None

    def __post_init__(self) -> None:
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        self.id = f"{prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self._spellings: dict[int, tuple[str, list[int]]] = {}

    def _envelope(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(
        self,
        text: str | None = None,
        *,
        index: int = 0,
        first: bool = False,
        finish_reason: str | None = None,
        entries: list[Entry] | None = None,
    ) -> dict:
        """One streamed chunk of choice ``index``: a text delta with the entries of the tokens it
        completes (None: no log-probabilities asked for), or the final one with its finish reason."""
        logprobs = None if entries is None else self.logprobs(entries)
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return {**self._envelope("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._envelope("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        """The last chunk of a stream asked to include usage: no choices, the counts."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._envelope(obj), "choices": [], "usage": usage}

    def whole(self, choices: Sequence[ChoiceResult], usage: dict) -> dict:
        """The non-streamed response."""
        shaped = []
        for index, choice in enumerate(choices):
            logprobs = None if choice.entries is None else self.logprobs(choice.entries)
            if self.kind == "chat":
                shaped.append(
                    {
                        "index": index,
                        "message": {"role": "assistant", "content": choice.text},
                        "logprobs": logprobs,
                        "finish_reason": choice.finish_reason,
                    }
                )
            else:
                shaped.append(
                    {"index": index, "text": choice.text, "logprobs": logprobs, "finish_reason": choice.finish_reason}
                )
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {**self._envelope(obj), "choices": shaped, "usage": usage}

    def logprobs(self, entries: list[Entry]) -> dict:
        """A choice's ``logprobs`` object for ``entries``: chat's ``{"content": [...], "refusal":
        null}``, or completions' ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``."""
        if self.kind == "chat":
            content = []
            for _, scored in entries:
                assert isinstance(scored, ScoredToken)  # chat scores generated tokens only
                token, data = self._spell(scored.token)
                alternatives = [
                    self._alternative(int(t), float(v)) for t, v in zip(scored.top_ids, scored.top_logprobs)
                ]
                content.append({"token": token, "logprob": scored.logprob, "bytes": data, "top_logprobs": alternatives})
            return {"content": content, "refusal": None}
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for offset, scored in entries:
            offsets.append(offset)
            if isinstance(scored, int):  # the prompt's first token: nothing before it to be scored on
                tokens.append(self._spell(scored)[0])
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            tokens.append(self._spell(scored.token)[0])
            token_logprobs.append(scored.logprob)
            # the most likely tokens, and the chosen one where it is not among them (as OpenAI does)
            top = {self._spell(int(t))[0]: float(v) for t, v in zip(scored.top_ids, scored.top_logprobs)}
            top.setdefault(tokens[-1], scored.logprob)
            top_logprobs.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    def _alternative(self, token_id: int, logprob: float) -> dict:
        token, data = self._spell(token_id)
        return {"token": token, "logprob": logprob, "bytes": data}

    def _spell(self, token_id: int) -> tuple[str, list[int]]:
        """A token's string and bytes (cached: the same alternatives come back at many positions)."""
        spelled = self._spellings.get(token_id)
        if spelled is None:
            if self.tokenizer is None:
                raise RuntimeError("a response with log-probabilities needs the tokenizer to spell its tokens")
            data = self.tokenizer.token_bytes(token_id, skip_special=False)
            try:
                token = data.decode("utf-8")
            except UnicodeDecodeError:
                token = "bytes:" + "".join(f"\\x{b:02x}" for b in data)
            spelled = self._spellings[token_id] = (token, list(data))
        return spelled


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """The OpenAI usage object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }

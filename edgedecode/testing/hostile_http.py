"""Hostile requests for both servers (issue 15 item 2): a catalogue of bodies, values, headers and
paths a client may send, each with the answer it must get, and ``send`` to try one.

Every case is one request. Bad input must get a precise 4xx in OpenAI's error shape
(``{"error": {"message", "type", "param", "code"}}``) naming the field at fault where there is one;
a few extreme but valid requests must get a 200 (never a 5xx). The one exception to the shape: a
request aiohttp cannot parse (a header line over its 8190-byte limit) is answered by aiohttp itself,
before any middleware, with a plain-text 400. What takes more than one request (slow headers and
bodies, clients that leave mid-stream, floods) is in ``hostile_clients``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from edgedecode.config import Config
from edgedecode.serving.json_body import MAX_DEPTH

ANY = object()  # a case that does not check the error's param
OOV = 10**9  # a token id beyond any vocabulary
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
PREFILL = "/v1/prefill"


@dataclass(frozen=True)
class Target:
    """A server under test: ``server`` is "daemon" or "prefill"."""

    server: str
    url: str
    token: str


@dataclass(frozen=True)
class Case:
    """One hostile request and the answer it must get (``param``/``code``: the error's, when checked)."""

    name: str
    server: str  # "daemon" or "prefill"
    path: str
    body: bytes | None
    status: int
    param: Any = ANY
    code: Any = ANY
    method: str = "POST"
    auth: str | None = "token"  # "token": the server's bearer token; None: none; else this token
    headers: tuple[tuple[str, str], ...] = ()
    shaped: bool = True  # False: aiohttp answers before any handler (a request it cannot parse), in plain text


@dataclass
class Result:
    """What a case got: its status (None: no answer within the bound), the time, and what is wrong."""

    case: Case
    status: int | None
    seconds: float
    error: dict | None = None
    problems: list[str] = field(default_factory=list)


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def _chat(**fields: Any) -> bytes:
    return _json({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, **fields})


def _text(prompt: Any = "Say hi.", **fields: Any) -> bytes:
    return _json({"prompt": prompt, "max_tokens": 2, **fields})


def _nested(key: str, depth: int) -> bytes:
    return b'{"' + key.encode() + b'": ' + b"[" * depth + b"]" * depth + b"}"


def _with_raw(body: bytes, raw: str) -> bytes:
    """``body`` (a JSON object) with ``raw`` (JSON text json.dumps would not write) as its last member."""
    return body[:-1] + b", " + raw.encode() + b"}"


def _cases(server: str, rows: list[tuple[Any, ...]]) -> list[Case]:
    """Cases from (name, path, body, status, param[, code]) rows."""
    return [Case(name, server, path, body, status, param, *code) for name, path, body, status, param, *code in rows]


def _message(content: Any, role: str = "user") -> bytes:
    return _json({"messages": [{"role": role, "content": content}]})


def daemon_cases(config: Config, model: str) -> list[Case]:
    """The daemon's catalogue for a server running ``config`` and serving ``model``."""
    over = config.daemon.max_context + 1
    deep_param = "messages" + "[0]" * (MAX_DEPTH - 1)
    rows: list[tuple[Any, ...]] = [
        # malformed bodies
        ("not JSON", CHAT, b"{not json", 400, None),
        ("truncated JSON", CHAT, b'{"messages": [', 400, None),
        ("empty body", CHAT, b"", 400, None),
        ("a JSON array", CHAT, b"[1, 2]", 400, None),
        ("not UTF-8", CHAT, b"\xff\xfe{}", 400, None),
        ("nested 100k deep", CHAT, _nested("messages", 100_000), 400, None),
        ("nested past the limit", CHAT, _nested("messages", MAX_DEPTH + 8), 400, deep_param),
        ("a 5000-digit integer", CHAT, _with_raw(_chat(), '"seed": 1' + "0" * 5000), 400, "seed"),
        ("NaN literal", CHAT, _with_raw(_chat(), '"temperature": NaN'), 400, "temperature"),
        ("Infinity literal", CHAT, _with_raw(_chat(), '"top_p": Infinity'), 400, "top_p"),
        ("float overflow", CHAT, _with_raw(_chat(), '"top_p": 1e400'), 400, "top_p"),
        (
            "lone surrogate",
            CHAT,
            b'{"messages": [{"role": "user", "content": "a\\ud800"}]}',
            400,
            "messages[0].content",
        ),
        # wrong types
        ("messages a string", CHAT, _json({"messages": "hi"}), 400, "messages"),
        ("messages empty", CHAT, _json({"messages": []}), 400, "messages"),
        ("a message a number", CHAT, _json({"messages": [5]}), 400, "messages"),
        ("role function", CHAT, _message("x", role="function"), 400, "messages"),  # legacy; "tool" is taken
        (
            "tool_calls a string",
            CHAT,
            _json({"messages": [{"role": "assistant", "content": None, "tool_calls": "call"}]}),
            400,
            "messages",
        ),
        ("tools a string", CHAT, _chat(tools="get_weather"), 400, "tools"),
        ("response_format a string", CHAT, _chat(response_format="json"), 400, "response_format"),
        (
            "a schema that does not compile",
            CHAT,
            _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}),
            400,
            "response_format",
        ),
        ("content a number", CHAT, _message(5), 400, "messages"),
        ("content an image", CHAT, _message([{"type": "image_url"}]), 400, "messages"),
        ("max_tokens a string", CHAT, _chat(max_tokens="5"), 400, "max_tokens"),
        ("max_tokens a fraction", CHAT, _chat(max_tokens=2.5), 400, "max_tokens"),
        ("max_tokens a boolean", CHAT, _chat(max_tokens=True), 400, "max_tokens"),
        ("temperature a string", CHAT, _chat(temperature="hot"), 400, "temperature"),
        ("stream a string", CHAT, _chat(stream="yes"), 400, "stream"),
        ("stream_options a string", CHAT, _chat(stream_options="x"), 400, "stream_options"),
        ("stop a number", CHAT, _chat(stop=5), 400, "stop"),
        ("user an object", CHAT, _chat(user={"id": 1}), 400, "user"),
        ("session_id empty", CHAT, _chat(session_id=""), 400, "session_id"),
        ("session_id 300 characters", CHAT, _chat(session_id="s" * 300), 400, "session_id"),
        ("top_k a fraction", CHAT, _chat(top_k=1.5), 400, "top_k"),
        # sampling parameters and budgets out of range
        ("temperature negative", CHAT, _chat(temperature=-1), 400, "temperature"),
        ("top_p 0", CHAT, _chat(top_p=0), 400, "top_p"),
        ("top_p above 1", CHAT, _chat(top_p=1.5), 400, "top_p"),
        ("top_k negative", CHAT, _chat(top_k=-1), 400, "top_k"),
        ("top_k a billion", CHAT, _chat(top_k=OOV), 400, "top_k"),
        ("seed negative", CHAT, _chat(seed=-1), 400, "seed"),
        ("seed 2^64", CHAT, _chat(seed=2**64), 400, "seed"),
        ("max_tokens 0", CHAT, _chat(max_tokens=0), 400, "max_tokens"),
        ("max_tokens negative", CHAT, _chat(max_tokens=-5), 400, "max_tokens"),
        ("max_tokens a billion", CHAT, _chat(max_tokens=OOV), 400, "max_tokens", "context_length_exceeded"),
        ("max_completion_tokens a billion", CHAT, _chat(max_completion_tokens=OOV), 400, "max_completion_tokens"),
        ("ttft_target_ms negative", CHAT, _chat(ttft_target_ms=-1), 400, "ttft_target_ms"),
        ("ttft_target_ms huge", CHAT, _chat(ttft_target_ms=1e300), 400, "ttft_target_ms"),
        # token ids
        ("token id negative", TEXT, _text([1, -1]), 400, "prompt"),
        ("token id out of vocabulary", TEXT, _text([1, OOV]), 400, "prompt"),
        ("token id a fraction", TEXT, _text([1.5]), 400, "prompt"),
        ("token id a boolean", TEXT, _text([True]), 400, "prompt"),
        ("token id a string", TEXT, _text(["1"]), 400, "prompt"),
        ("batched token ids", TEXT, _text([[1, 2], [3]]), 400, "prompt"),
        ("no token ids", TEXT, _text([]), 400, "prompt"),
        ("empty prompt", TEXT, _text(""), 400, "prompt"),
        # stop lists
        ("10000 stop strings", CHAT, _chat(stop=["x"] * 10_000), 400, "stop"),
        ("an empty stop string", CHAT, _chat(stop=[""]), 400, "stop"),
        # prompts over the context
        ("token ids over the context", TEXT, _text([0] * over), 400, "prompt", "context_length_exceeded"),
        ("text over the context", CHAT, _message("hi " * over), 400, "messages", "context_length_exceeded"),
        ("prompt + max_tokens over it", TEXT, _text([0] * (over - 2), max_tokens=8), 400, "max_tokens"),
        # fields, models, limits
        ("tools", CHAT, _chat(tools=[{"type": "function"}]), 400, "tools"),
        ("logprobs 6", TEXT, _text(logprobs=6), 400, "logprobs"),
        ("top_logprobs without logprobs", CHAT, _chat(top_logprobs=3), 400, "top_logprobs"),
        ("top_logprobs 21", CHAT, _chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
        ("echo on chat", CHAT, _chat(echo=True), 400, "echo"),
        ("presence_penalty", CHAT, _chat(presence_penalty=1.5), 400, "presence_penalty"),
        ("n 9", CHAT, _chat(n=9), 400, "n"),
        ("best_of above n", TEXT, _text(n=2, best_of=3), 400, "best_of"),
        ("another model", CHAT, _chat(model="gpt-4o"), 404, "model", "model_not_found"),
        ("a model that is a list", CHAT, _chat(model=[model]), 404, "model", "model_not_found"),
        ("body over the limit", CHAT, _chat(pad="x" * (config.daemon.max_body_bytes + 1)), 413, None),
    ]
    cases = _cases("daemon", rows)
    cases += [
        Case("no bearer token", "daemon", CHAT, _chat(), 401, None, "unauthorized", auth=None),
        Case("a wrong bearer token", "daemon", CHAT, _chat(), 401, None, "unauthorized", auth="wrong"),
        Case("GET a POST endpoint", "daemon", CHAT, None, 405, None, method="GET"),
        Case("an unknown path", "daemon", "/v1/embeddings", _chat(), 404, None),
        Case("a header line over 8 KiB", "daemon", CHAT, _chat(), 400, headers=(("X-Big", "x" * 9000),), shaped=False),
        Case(
            "X-Session-Id of 300 chars",
            "daemon",
            CHAT,
            _chat(),
            400,
            "session_id",
            headers=(("X-Session-Id", "s" * 300),),
        ),
    ]
    # extreme but valid: answered (2 tokens), never a 5xx
    cases += [
        Case(name, "daemon", path, body, 200)
        for name, path, body in (
            ("temperature 1e-308", TEXT, _text(temperature=1e-308)),
            ("temperature 1e308", TEXT, _text(temperature=1e308)),
            ("top_p 1e-300", TEXT, _text(top_p=1e-300, temperature=1)),
            ("seed 2^64-1", TEXT, _text(seed=2**64 - 1, temperature=1)),
            ("a 100 KB stop string", TEXT, _text(stop=["y" * 100_000])),
            ("token id 0", TEXT, _text([0])),
            ("unknown fields are ignored", CHAT, _chat(colour="blue", metadata={"a": [1]})),
        )
    ]
    return cases


def prefill_cases(config: Config, model: str) -> list[Case]:
    """The prefill server's catalogue for a server running ``config`` and serving ``model``."""
    ids = {"token_ids": [1, 2, 3]}
    too_long = {"token_ids": [0] * (config.prefill.max_prompt_tokens + 1)}
    resume = PREFILL + "/transfers/nope"
    rows: list[tuple[Any, ...]] = [
        ("not JSON", PREFILL, b"{not json", 400, None),
        ("nested 100k deep", PREFILL, _nested("token_ids", 100_000), 400, None),
        ("a 5000-digit token id", PREFILL, b'{"token_ids": [1, ' + b"7" * 5000 + b"]}", 400, "token_ids[1]"),
        ("NaN budget", PREFILL, b'{"token_ids": [1], "budget": NaN}', 400, "budget"),
        ("budget a string", PREFILL, _json({**ids, "budget": "0.5"}), 400, "budget"),
        ("budget negative", PREFILL, _json({**ids, "budget": -1}), 400, "budget"),
        ("budget 0", PREFILL, _json({**ids, "budget": 0}), 400, "budget"),
        ("budget above 1", PREFILL, _json({**ids, "budget": 2}), 400, "budget"),
        ("budget below any payload", PREFILL, _json({**ids, "budget": 1e-300}), 422, "budget", "budget_too_small"),
        ("held_tokens negative", PREFILL, _json({**ids, "held_tokens": -1}), 400, "held_tokens"),
        ("held_tokens a fraction", PREFILL, _json({**ids, "held_tokens": 1.5}), 400, "held_tokens"),
        ("held_tokens the whole prompt", PREFILL, _json({**ids, "held_tokens": 3}), 400, "held_tokens"),
        ("token id out of vocabulary", PREFILL, _json({"token_ids": [1, OOV]}), 400, "token_ids"),
        ("token id negative", PREFILL, _json({"token_ids": [-1]}), 400, "token_ids"),
        ("token id a fraction", PREFILL, _json({"token_ids": [1.5]}), 400, "token_ids"),
        ("token_ids a string", PREFILL, _json({"token_ids": "1 2"}), 400, "token_ids"),
        ("no token ids", PREFILL, _json({"token_ids": []}), 400, "token_ids"),
        ("text a number", PREFILL, _json({"text": 5}), 400, "text"),
        ("two prompts", PREFILL, _json({"text": "hi", **ids}), 400, "token_ids"),
        ("no prompt", PREFILL, b"{}", 400, "token_ids"),
        ("messages a string", PREFILL, _json({"messages": "hi"}), 400, "messages"),
        ("messages empty", PREFILL, _json({"messages": []}), 400, "messages"),
        ("policy unknown", PREFILL, _json({**ids, "policy": "best"}), 400, "policy"),
        ("allowed_tiers without fp16", PREFILL, _json({**ids, "allowed_tiers": ["int4"]}), 400, "allowed_tiers"),
        ("allowed_tiers numbers", PREFILL, _json({**ids, "allowed_tiers": [5]}), 400, "allowed_tiers"),
        ("an unknown field", PREFILL, _json({**ids, "colour": 1}), 400, "colour"),
        ("another model", PREFILL, _json({**ids, "model": "other"}), 400, "model"),
        ("a prompt over the limit", PREFILL, _json(too_long), 400, "token_ids"),
        ("body over the limit", PREFILL, _json({**ids, "pad": "x" * (config.prefill.max_body_bytes + 1)}), 413, None),
        ("resume: unknown transfer", resume, _json({"held_tokens": 1}), 404, "transfer_id", "transfer_not_found"),
        ("resume: no held_tokens", resume, _json({"budget": 0.5}), 400, "held_tokens"),
        ("resume: NaN budget", resume, b'{"held_tokens": 1, "budget": NaN}', 400, "budget"),
    ]
    cases = _cases("prefill", rows)
    cases += [
        Case("no bearer token", "prefill", PREFILL, _json(ids), 401, None, "unauthorized", auth=None),
        Case("GET a POST endpoint", "prefill", PREFILL, None, 405, None, method="GET"),
        Case(
            "a header line over 8 KiB",
            "prefill",
            PREFILL,
            _json(ids),
            400,
            headers=(("X-Big", "x" * 9000),),
            shaped=False,
        ),
        Case("a valid prefill", "prefill", PREFILL, _json({**ids, "model": model, "budget": 0.5}), 200),
    ]
    return cases


async def send(http: aiohttp.ClientSession, target: Target, case: Case, bound_s: float) -> Result:
    """Send ``case`` to ``target`` and judge the answer: the status, the error's OpenAI shape and its
    param and code; an answer that takes longer than ``bound_s`` is a hang."""
    headers = {"Content-Type": "application/json", **dict(case.headers)}
    token = target.token if case.auth == "token" else case.auth
    if token:
        headers["Authorization"] = f"Bearer {token}"
    started = time.perf_counter()
    try:
        async with http.request(
            case.method,
            target.url + case.path,
            data=case.body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=bound_s),
        ) as response:
            body, status, content_type = await response.read(), response.status, response.content_type
    except TimeoutError:
        return Result(case, None, time.perf_counter() - started, problems=[f"no answer within {bound_s:g} s"])
    except aiohttp.ClientError as exc:
        return Result(case, None, time.perf_counter() - started, problems=[f"the connection failed: {exc!r}"])
    result = Result(case, status, time.perf_counter() - started)
    if status != case.status:
        result.problems.append(f"status {status}, expected {case.status}")
    if status >= 400 and case.shaped:
        result.error = _error_shape(body, content_type, result.problems)
        if result.error is not None:
            for key in ("param", "code"):
                expected = getattr(case, key)
                if expected is not ANY and result.error.get(key) != expected:
                    result.problems.append(f"{key} {result.error.get(key)!r}, expected {expected!r}")
    return result


def _error_shape(body: bytes, content_type: str, problems: list[str]) -> dict | None:
    """The ``error`` object of an OpenAI-shaped error body; a problem noted when it is not one."""
    try:
        error = json.loads(body)["error"] if content_type == "application/json" else None
    except (ValueError, KeyError, TypeError):
        error = None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str) or "type" not in error:
        problems.append(f"not an OpenAI error: {content_type} {body[:120]!r}")
        return None
    return error

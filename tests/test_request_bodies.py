"""Request bodies and responses at the HTTP layer both servers share: every hostile JSON body is a
400 naming its field, and every response — a 500 from a bug included — is counted exactly once."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from aiohttp import web
from serving_helpers import ThreadedApp

from edgedecode.serving.http import OUTCOME, error_middleware, read_json
from edgedecode.serving.json_body import MAX_DEPTH, BodyError, parse_json_object


@pytest.mark.parametrize(
    "body, param, message",
    [
        (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "nested deeper"),
        (
            b'{"messages": ' + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b"}",
            "messages" + "[0]" * (MAX_DEPTH - 1),
            "nested more than",
        ),
        (b'{"seed": ' + b"9" * 5000 + b"}", "seed", "an integer of 5000 digits"),
        (b'{"max_tokens": -' + b"9" * 21 + b"}", "max_tokens", "an integer of 21 digits"),
        (b'{"max_tokens": 1e400}', "max_tokens", "beyond the range of a float"),
        (b'{"temperature": NaN}', "temperature", "NaN is not a JSON number"),
        (b'{"top_p": -Infinity}', "top_p", "-Infinity is not a JSON number"),
        (b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages[0].content", "lone UTF-16 surrogate"),
        (b'{"\\udfff": 1}', "\udfff", "lone UTF-16 surrogate"),
        (b'{"stop": ["ok", "\\udbff"]}', "stop[1]", "lone UTF-16 surrogate"),
        (b"[1, 2]", None, "must be a JSON object"),
        (b'{"a": 1,}', None, "not valid JSON"),
        (b"\xff\xfe{}", None, "not valid JSON"),
    ],
)
def test_hostile_bodies_are_refused_naming_the_field(body, param, message):
    with pytest.raises(BodyError, match=message) as caught:
        parse_json_object(body)
    assert caught.value.param == param


def test_plain_bodies_parse_unchanged():
    body = {
        "messages": [{"role": "user", "content": "Grüße 👋 <|im_start|>"}],
        "seed": 2**64 - 1,
        "temperature": 0.7,
        "stop": None,
        "stream": True,
        "token_ids": list(range(5000)),
        "nested": [[[{"deep": [1.5e300]}]]],
    }
    assert parse_json_object(json.dumps(body).encode()) == body


class _App:
    """A tiny app behind the shared middleware: counts every response by path and status."""

    def __init__(self) -> None:
        self.counted: list[tuple[str, str]] = []
        app = web.Application(middlewares=[error_middleware((), lambda r, s: self.counted.append((r.path, s)))])

        async def echo(request: web.Request) -> web.Response:
            return web.json_response(await read_json(request, 5))

        async def bug(_: web.Request) -> web.Response:
            raise ZeroDivisionError("a bug")

        async def broken_stream(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse()
            await response.prepare(request)
            await response.write(b"data: 1\n\n")
            request[OUTCOME] = "500"  # the stream failed after its status line went out
            await response.write_eof()
            return response

        app.router.add_post("/echo", echo)
        app.router.add_get("/bug", bug)
        app.router.add_get("/stream", broken_stream)
        self.server = ThreadedApp(app)


def _call(url: str, body: bytes | None = None) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body), timeout=30) as response:
            text = response.read().decode()
            return response.status, text
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_every_response_is_counted_once_and_errors_are_json():
    app = _App()
    try:
        url = app.server.url
        assert _call(url + "/echo", b'{"a": 1}') == (200, '{"a": 1}')
        status, error = _call(url + "/echo", b'{"temperature": NaN}')
        assert (status, error["error"]["param"], error["error"]["type"]) == (
            400,
            "temperature",
            "invalid_request_error",
        )
        status, error = _call(url + "/bug")
        assert status == 500 and "ZeroDivisionError" in error["error"]["message"]
        assert _call(url + "/stream")[0] == 200
        assert _call(url + "/nowhere")[0] == 404
        assert sorted(app.counted) == sorted(
            [("/echo", "200"), ("/echo", "400"), ("/bug", "500"), ("/stream", "500"), ("/nowhere", "404")]
        )
    finally:
        app.server.stop()

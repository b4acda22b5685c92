"""What both servers share on the HTTP side: bearer-token auth, JSON errors, /healthz and /metrics,
and running an aiohttp app until it is told to stop."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import signal
import ssl
from collections.abc import Awaitable, Callable, Sequence

import psutil
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from edgedecode.errors import EdgeDecodeError
from edgedecode.serving.header_deadline import start_site
from edgedecode.serving.json_body import parse_json_object

logger = logging.getLogger(__name__)
UNAUTHENTICATED_PATHS = frozenset({"/healthz"})  # liveness only: says nothing about the model or the data
# What a server prints on stdout once it listens; whoever starts one as a child reads its URL from it.
LISTENING_LINE = "edgedecode {server} listening on {url}"
LISTENING = re.compile(r"listening on (https?://\S+)")


def json_error(
    status: int,
    message: str,
    *,
    kind: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """An error in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


# A handler whose answer went wrong after its status line was sent (a stream cut short by an error,
# a client gone mid-stream) records the status to count here, e.g. request[OUTCOME] = "500".
OUTCOME = web.RequestKey("edgedecode_outcome", str)
ResponseCounter = Callable[[web.Request, str], None]


def error_middleware(auth_tokens: Sequence[str], count: ResponseCounter | None = None):
    """Middleware: bearer-token auth (any of the non-empty ``auth_tokens`` is accepted, two while a
    token is rotated; none given: no auth), every error answered as JSON
    (aiohttp's own too: 413 for an oversized body, 404, 405; an ``EdgeDecodeError`` as its class
    declares, see ``error_response``), and ``count(request, status)`` called exactly once per
    request with the status it ended with ("499" when the client went away first)."""

    accepted = [token.encode() for token in auth_tokens if token]

    @web.middleware
    async def middleware(request: web.Request, handler):
        status = "499"
        try:
            response = await _answer(request, handler, accepted)
            status = request.get(OUTCOME, str(response.status))
            return response
        finally:
            if count is not None:
                count(request, status)

    return middleware


async def _answer(request: web.Request, handler, accepted: list[bytes]) -> web.StreamResponse:
    if accepted and request.path not in UNAUTHENTICATED_PATHS:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        presented = given.strip().encode()
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(presented, token) for token in accepted):
            reason = "missing bearer token" if not given else "wrong bearer token"
            return json_error(
                401,
                f"unauthorized: {reason} (send 'Authorization: Bearer <token>')",
                kind="authentication_error",
                code="unauthorized",
                headers={"WWW-Authenticate": "Bearer"},
            )
    try:
        return await handler(request)
    except EdgeDecodeError as exc:
        return error_response(exc, request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "request_too_large" if exc.status == 413 else "invalid_request_error"
        return json_error(exc.status, exc.text or exc.reason, kind=kind, code=str(exc.status))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:  # a bug: the client gets a JSON 500, the log the traceback, the server goes on
        logger.exception("unhandled error serving %s %s", request.method, request.path)
        return json_error(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")


def error_response(exc: EdgeDecodeError, request: web.Request) -> web.Response:
    """The one mapping from an edgedecode error to an HTTP answer: the status, OpenAI error type,
    code, param and Retry-After its class declares (``errors.py``); a 5xx is logged with its traceback."""
    if exc.http_status >= 500:
        logger.error("%s %s failed: %s", request.method, request.path, exc, exc_info=exc)
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
    return json_error(
        exc.http_status, str(exc), kind=exc.http_type, code=exc.http_code, param=exc.param, headers=headers
    )


async def read_json(request: web.Request, timeout: float) -> dict:
    """The request body as a JSON object whose every value a handler can take as it is: a
    ``BodyError`` (400) naming the field otherwise (413 when too large, 408 when it does not arrive
    within ``timeout`` seconds). See ``parse_json_object`` for what is refused."""
    try:
        async with asyncio.timeout(timeout):
            body = await request.read()  # aiohttp raises HTTPRequestEntityTooLarge past client_max_size
    except TimeoutError:
        raise web.HTTPRequestTimeout(text=f"the request body did not arrive within {timeout:g} s") from None
    return parse_json_object(body)


async def write_within(response: web.StreamResponse, data: bytes, timeout: float) -> None:
    """Write to a streamed response; a client that takes more than ``timeout`` seconds to accept it
    counts as gone (ConnectionResetError), so it cannot hold the server's resources forever."""
    try:
        async with asyncio.timeout(timeout):
            await response.write(data)
    except TimeoutError:
        raise ConnectionResetError(f"the client accepted nothing for {timeout:g} s") from None


def process_gauges(registry: CollectorRegistry) -> None:
    """Register the process's resident memory (psutil) on ``registry``, read at each scrape."""
    process = psutil.Process()
    Gauge(
        "edgedecode_process_resident_memory_bytes", "Resident set size of this process.", registry=registry
    ).set_function(lambda: process.memory_info().rss)


def add_common_routes(app: web.Application, registry: CollectorRegistry) -> None:
    """GET /healthz (the process answers) and GET /metrics (Prometheus text format)."""

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def metrics(_: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)


async def serve_until_stopped(
    app: web.Application,
    host: str,
    port: int,
    *,
    header_timeout: float,
    ssl_context: ssl.SSLContext | None = None,
    on_listening: Callable[[str], Awaitable[None] | None] | None = None,
) -> None:
    """Run ``app`` on host:port (port 0: any free one) until SIGTERM or SIGINT, then shut down cleanly;
    HTTPS only with ``ssl_context`` (``edgedecode.tls.server_tls``), else plain HTTP.

    A connection whose request headers take longer than ``header_timeout`` seconds to arrive is closed
    (see ``header_deadline``). ``on_listening`` gets the bound URL once the socket accepts connections.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner, site = await start_site(
        app, host, port, header_timeout=header_timeout, ssl_context=ssl_context, handle_signals=False, access_log=None
    )
    try:
        url = site.name  # the real port when 0 was asked for
        if on_listening is not None:
            result = on_listening(url)
            if asyncio.iscoroutine(result):
                await result
        await stop.wait()
        logger.info("shutting down")
    finally:
        await runner.cleanup()

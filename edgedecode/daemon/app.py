"""``edgedecode serve``: the decode daemon's HTTP API (aiohttp), OpenAI-compatible.

* ``POST /v1/chat/completions``, ``POST /v1/completions`` — JSON, or server-sent events with ``stream``;
* ``GET /v1/models``;
* ``GET /healthz`` (the process answers), ``GET /readyz`` (the model is loaded, the worker is
  alive; says where KV comes from), ``GET /metrics`` (Prometheus).

Handlers are module-level functions reading the app's state (``SERVICE``, ``SETTINGS``); the routes
are one table (``setup_routes``); the service, and the embedded prefill server when there is one, are
resources of the app's ``cleanup_ctx``: started before it serves, closed after.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from aiohttp import web

from edgedecode.config import Config, DaemonConfig
from edgedecode.daemon.embedded import EmbeddedPrefill
from edgedecode.daemon.metrics import DaemonMetrics
from edgedecode.daemon.openai_api import parse_request
from edgedecode.daemon.openai_responses import ChoiceResult, Entry, ResponseShape, usage
from edgedecode.daemon.service import DecodeService
from edgedecode.daemon.tool_calls import ToolCallReader
from edgedecode.daemon.turn import Turn
from edgedecode.serving import systemd
from edgedecode.serving.http import OUTCOME, add_common_routes, error_middleware, json_error, read_json, write_within

logger = logging.getLogger(__name__)
SERVICE = web.AppKey("service", DecodeService)
SETTINGS = web.AppKey("settings", DaemonConfig)
_ENDPOINTS = {"/v1/chat/completions": "chat_completions", "/v1/completions": "completions"}


def create_app(
    service: DecodeService, config: Config, metrics: DaemonMetrics, embedded: EmbeddedPrefill | None = None
) -> web.Application:
    """The daemon's aiohttp application around ``service`` (and the embedded prefill server whose
    URL the service pulls from, if any), both started and closed with the app."""
    settings = config.daemon

    def count(request: web.Request, status: str) -> None:
        if request.path in _ENDPOINTS:
            metrics.requests.labels(_ENDPOINTS[request.path], status).inc()

    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[error_middleware((settings.auth_token, settings.previous_auth_token), count)],
    )
    app[SERVICE] = service
    app[SETTINGS] = settings
    if embedded is not None:
        app.cleanup_ctx.append(_running(embedded))
    app.cleanup_ctx.append(_started(service))
    setup_routes(app)
    add_common_routes(app, metrics.registry)
    return app


def setup_routes(app: web.Application) -> None:
    """The daemon's own routes (``add_common_routes`` adds /healthz and /metrics)."""
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/readyz", readyz)


def _started(service: DecodeService):
    async def lifetime(_: web.Application) -> AsyncIterator[None]:
        await service.start()
        yield
        await service.close()

    return lifetime


def _running(embedded: EmbeddedPrefill):
    async def lifetime(_: web.Application) -> AsyncIterator[None]:
        systemd.notify("STATUS=starting the embedded prefill server")
        await embedded.start()
        yield
        await embedded.stop()

    return lifetime


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "text")


async def models(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    card = {
        "id": service.model.record.name,
        "object": "model",
        "created": 0,
        "owned_by": "edgedecode",
        "max_context": service.max_context,
    }
    return web.json_response({"object": "list", "data": [card]})


async def readyz(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    ready = service.healthy()
    body = {
        "status": "ready" if ready else "unhealthy",
        "model": service.model.record.name,
        "prefill": {"url": service.remote.url(), "breaker": service.remote.breaker.state},
        "slots": {"total": len(service.pool.slots), "busy": service.pool.busy, "queued": service.pool.queued},
    }
    return web.json_response(body, status=200 if ready else 503)


async def _completion(request: web.Request, kind: str) -> web.StreamResponse:
    arrived = time.perf_counter()
    service, settings = request.app[SERVICE], request.app[SETTINGS]
    # A bad request (400), a full queue (429) or short memory (503) raises; the middleware answers.
    parsed = parse_request(
        await read_json(request, settings.client_timeout_s),
        kind,
        service.model,
        default_max_tokens=settings.max_tokens,
        session_header=request.headers.get("X-Session-Id"),
        max_context=service.max_context,
        allow_special_tokens=settings.allow_special_tokens,
    )
    parsed = await service.constrained(parsed)
    async with service.turn(parsed, parsed.user or request.remote or "unknown", arrived) as turn:
        shape = ResponseShape(kind, service.model.record.name, service.model.tokenizer)
        if parsed.stream:
            return await _stream(request, turn, shape, settings.client_timeout_s)
        return await _whole(request, turn, shape)


async def _whole(request: web.Request, turn: Turn, shape: ResponseShape) -> web.Response:
    parsed = turn.request
    tracked = parsed.logprobs is not None
    texts: list[list[str]] = [[] for _ in range(parsed.n)]
    entries: list[list[Entry]] = [[] for _ in range(parsed.n)]
    choices: list[ChoiceResult] = []
    try:
        async with aclosing(turn.pieces()) as pieces:
            async for piece in pieces:
                if request.transport is None:  # the client went away: stop generating, free the slot
                    raise ConnectionResetError("the client went away before its answer was complete")
                texts[piece.index].append(piece.text)
                entries[piece.index] += piece.entries or ()
                if piece.finish_reason is not None:
                    text, scored = "".join(texts[piece.index]), entries[piece.index] if tracked else None
                    reader = _calls_reader(turn)
                    if reader is None:
                        choices.append(ChoiceResult(text, piece.finish_reason, scored))
                        continue
                    content = reader.feed(text)[0] + reader.finish()
                    finish = _finish_reason(piece.finish_reason, reader)
                    choices.append(ChoiceResult(content, finish, scored, reader.calls or None))
    except ConnectionResetError:
        logger.info("client disconnected before its answer was complete")
        raise  # counted as 499 by the middleware; aiohttp has no one to answer
    except Exception as exc:
        logger.exception("generation failed")
        return json_error(500, f"generation failed: {exc}", kind="server_error")
    body = shape.whole(choices, usage(len(parsed.prompt_ids), turn.completion_tokens))
    body["edgedecode"] = turn.report.to_json()
    return web.json_response(body)


def _calls_reader(turn: Turn) -> ToolCallReader | None:
    """A reader of one choice's tool calls, for a request whose answer may make them."""
    rule = turn.request.output
    if rule is None or rule.form is None or not rule.calls:
        return None
    return ToolCallReader(rule.form, [tool.name for tool in rule.tools])


def _finish_reason(reason: str, reader: ToolCallReader | None) -> str:
    """A choice's finish reason: "tool_calls" for one that ended with calls made, as OpenAI says it."""
    return "tool_calls" if reader is not None and reader.calls and reason == "stop" else reason


async def _stream(request: web.Request, turn: Turn, shape: ResponseShape, timeout_s: float) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    parsed = turn.request
    chat, last = parsed.kind == "chat", parsed.n - 1

    async def send(obj) -> None:
        data = f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()
        await write_within(response, data, timeout_s)

    try:
        begun = 0  # choices whose first chunk went out
        reader = _calls_reader(turn)  # the choice's tool calls, where it may make them
        if chat:
            await send(shape.chunk(first=True))
            begun = 1
        async with aclosing(turn.pieces()) as pieces:
            async for piece in pieces:
                if chat and piece.index == begun:  # a further choice begins: its role first
                    await send(shape.chunk(index=piece.index, first=True))
                    begun += 1
                    reader = _calls_reader(turn)
                text, deltas = (piece.text, []) if reader is None else reader.feed(piece.text)
                if piece.finish_reason is not None and reader is not None:
                    text += reader.finish()
                if text or piece.entries:
                    await send(shape.chunk(text, index=piece.index, entries=piece.entries))
                if deltas:
                    await send(shape.chunk(index=piece.index, tool_calls=[delta.to_json() for delta in deltas]))
                if piece.finish_reason is not None and piece.index < last:
                    finish = _finish_reason(piece.finish_reason, reader)
                    await send(shape.chunk(index=piece.index, finish_reason=finish))
        # the last choice's final chunk carries the report, complete once the pieces have ended
        final = shape.chunk(index=last, finish_reason=_finish_reason(turn.finish_reason, reader))
        final["edgedecode"] = turn.report.to_json()
        await send(final)
        if parsed.include_usage:
            await send(shape.usage_chunk(usage(len(parsed.prompt_ids), turn.completion_tokens)))
    except ConnectionResetError as exc:  # the client went away (or stopped reading); the turn is cancelled
        request[OUTCOME] = "499"
        logger.info("client disconnected: %s", exc)
        return response
    except Exception as exc:
        logger.exception("generation failed")
        request[OUTCOME] = "500"
        await send(
            {"error": {"message": f"generation failed: {exc}", "type": "server_error", "param": None, "code": None}}
        )
    await write_within(response, b"data: [DONE]\n\n", timeout_s)
    await response.write_eof()
    return response

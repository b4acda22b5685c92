"""``edgedecode serve``: the decode daemon's HTTP API (aiohttp), OpenAI-compatible.

* ``POST /v1/chat/completions``, ``POST /v1/completions`` — JSON, or server-sent events with ``stream``;
* ``GET /v1/models``;
* ``GET /healthz`` (the process answers), ``GET /readyz`` (the model is loaded, the worker is
  alive; says where KV comes from), ``GET /metrics`` (Prometheus).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import cast

from aiohttp import web

from edgedecode.config import Config
from edgedecode.daemon.metrics import DaemonMetrics
from edgedecode.daemon.openai_api import ChoiceResult, Entry, ResponseShape, parse_request, usage
from edgedecode.daemon.service import DecodeService, Piece
from edgedecode.serving.http import (
    OUTCOME,
    add_common_routes,
    error_middleware,
    json_error,
    read_json,
    write_within,
)

logger = logging.getLogger(__name__)
SERVICE_KEY = web.AppKey("decode_service", DecodeService)


def create_app(service: DecodeService, config: Config, metrics: DaemonMetrics) -> web.Application:
    """The daemon's aiohttp application around a loaded ``service``."""
    settings = config.daemon
    endpoints = {"/v1/chat/completions": "chat_completions", "/v1/completions": "completions"}

    def count(request: web.Request, status: str) -> None:
        if request.path in endpoints:
            metrics.requests.labels(endpoints[request.path], status).inc()

    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[error_middleware((settings.auth_token, settings.previous_auth_token), count)],
    )
    app[SERVICE_KEY] = service
    model_name = service.model.record.name

    async def completions(request: web.Request, kind: str) -> web.StreamResponse:
        arrived = time.perf_counter()
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
        turn = service.turn(parsed, parsed.user or request.remote or "unknown", arrived)
        await turn.open()
        shape = ResponseShape(kind, model_name, service.model.tokenizer)
        if parsed.stream:
            return await _stream(request, turn, shape, parsed.include_usage)
        tracked = parsed.logprobs is not None
        texts: list[list[str]] = [[] for _ in range(parsed.n)]
        entries: list[list[Entry]] = [[] for _ in range(parsed.n)]
        choices: list[ChoiceResult] = []
        try:
            # Turn.pieces is an async generator, which service.py annotates as the wider AsyncIterator
            async with aclosing(cast("AsyncGenerator[Piece, None]", turn.pieces())) as pieces:
                async for piece in pieces:
                    if request.transport is None:  # the client went away: stop generating, free the slot
                        raise ConnectionResetError("the client went away before its answer was complete")
                    texts[piece.index].append(piece.text)
                    entries[piece.index] += piece.entries or ()
                    if piece.finish_reason is not None:
                        text, scored = "".join(texts[piece.index]), entries[piece.index] if tracked else None
                        choices.append(ChoiceResult(text, piece.finish_reason, scored))
        except ConnectionResetError:
            logger.info("client disconnected before its answer was complete")
            raise  # counted as 499 by the middleware; aiohttp has no one to answer
        except Exception as exc:
            logger.exception("generation failed")
            return json_error(500, f"generation failed: {exc}", kind="server_error")
        body = shape.whole(choices, usage(len(parsed.prompt_ids), turn.completion_tokens))
        body["edgedecode"] = turn.report.to_json()
        return web.json_response(body)

    async def _stream(request: web.Request, turn, shape: ResponseShape, include_usage: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        chat, last = turn.request.kind == "chat", turn.request.n - 1

        async def send(obj) -> None:
            data = f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()
            await write_within(response, data, settings.client_timeout_s)

        try:
            begun = 0  # choices whose first chunk went out
            if chat:
                await send(shape.chunk(first=True))
                begun = 1
            async with aclosing(turn.pieces()) as pieces:
                async for piece in pieces:
                    if chat and piece.index == begun:  # a further choice begins: its role first
                        await send(shape.chunk(index=piece.index, first=True))
                        begun += 1
                    if piece.text or piece.entries:
                        await send(shape.chunk(piece.text, index=piece.index, entries=piece.entries))
                    if piece.finish_reason is not None and piece.index < last:
                        await send(shape.chunk(index=piece.index, finish_reason=piece.finish_reason))
            # the last choice's final chunk carries the report, complete once the pieces have ended
            final = shape.chunk(index=last, finish_reason=turn.finish_reason)
            final["edgedecode"] = turn.report.to_json()
            await send(final)
            if include_usage:
                await send(shape.usage_chunk(usage(len(turn.request.prompt_ids), turn.completion_tokens)))
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
        await write_within(response, b"data: [DONE]\n\n", settings.client_timeout_s)
        await response.write_eof()
        return response

    async def chat(request: web.Request) -> web.StreamResponse:
        return await completions(request, "chat")

    async def text(request: web.Request) -> web.StreamResponse:
        return await completions(request, "text")

    async def models(_: web.Request) -> web.Response:
        card = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "edgedecode",
            "max_context": service.max_context,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def readyz(_: web.Request) -> web.Response:
        ready = service.healthy()
        body = {
            "status": "ready" if ready else "unhealthy",
            "model": model_name,
            "prefill": {"url": service.prefill_url(), "breaker": service.breaker.state},
            "slots": {"total": len(service.pool.slots), "busy": service.pool.busy, "queued": service.pool.queued},
        }
        return web.json_response(body, status=200 if ready else 503)

    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", text)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/readyz", readyz)
    add_common_routes(app, metrics.registry)
    return app

"""``edgedecode prefill-server``: the prefill node's HTTP API (aiohttp).

* ``POST /v1/prefill`` — JSON in (see ``PrefillRequest.parse``), a streamed EDKV payload out
  (chunked, ``application/x-edkv``), frame by frame. Response headers summarise it
  (``X-EDKV-Tokens``, ``X-EDKV-Wire-Bytes``, ``X-EDKV-FP16-Bytes``, ``X-Prefix-Reused-Tokens``; ``X-Prefill-Seconds``,
  the server's time, and ``X-Prefill-Compute-Seconds``, its prefill pass's part: 0 for a resume);
  the receiver trusts only the payload itself. Its header names the transfer the prefill is kept
  under for a while (EDKV 1.1 ``transfer``), when the transfer store has room.
* ``POST /v1/prefill/transfers/{transfer_id}`` — JSON in (see ``ResumeRequest.parse``: the
  ``held_tokens`` the receiver has, a budget for the rest), the payload of the kept prefill's
  positions from there on, as above; nothing is computed again. 404 ``transfer_not_found`` once
  the transfer expired.
* ``POST /v1/prefill/held`` — JSON ``{"blocks": [...]}`` in (a prompt's block-chain hashes, ``kv.prefix``),
  ``{"held_tokens": N, "block_tokens": B}`` out: how many leading tokens of that prompt the prefix cache holds
  now, answered at once (not queued behind prefills), so that a daemon can price a pull before asking for it.
* ``GET /v1/models`` — the served model with its KV contract and producer fingerprint.
* ``GET /healthz``, ``GET /metrics``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from edgedecode.config import Config
from edgedecode.errors import ServerBusyError
from edgedecode.kv.prefix import HELD_PATH
from edgedecode.kv.tiers import Tier
from edgedecode.prefill.service import PrefillResult, PrefillService, ResumeRequest
from edgedecode.serving.http import (
    OUTCOME,
    add_common_routes,
    error_middleware,
    process_gauges,
    read_json,
    write_within,
)

logger = logging.getLogger(__name__)
EDKV_CONTENT_TYPE = "application/x-edkv"
SERVICE_KEY = web.AppKey("prefill_service", PrefillService)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class PrefillMetrics:
    """The prefill server's Prometheus metrics, on their own registry."""

    def __init__(self, service: PrefillService) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "edgedecode_prefill_requests_total", "Prefill requests by HTTP status.", ["status"], registry=registry
        )
        self.held_queries = Counter(
            "edgedecode_prefill_held_queries_total",
            "Held queries (POST /v1/prefill/held: what the prefix cache holds of a prompt) by HTTP status.",
            ["status"],
            registry=registry,
        )
        self.seconds = Histogram(
            "edgedecode_prefill_seconds",
            "Prefill, scoring and encoding time per request.",
            registry=registry,
            buckets=(0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100),
        )
        self.tokens = Counter(
            "edgedecode_prefill_tokens_total",
            "Prompt tokens by where their KV came from (computed, or the prefix cache).",
            ["source"],
            registry=registry,
        )
        self.sent_bytes = Counter("edgedecode_prefill_sent_bytes_total", "EDKV bytes sent.", registry=registry)
        self.fp16_bytes = Counter(
            "edgedecode_prefill_fp16_equivalent_bytes_total", "FP16 bytes of the KV sent.", registry=registry
        )
        self.tier_tokens = Counter(
            "edgedecode_prefill_tier_tokens_total", "Tokens sent per KV tier.", ["tier"], registry=registry
        )
        self.stage_seconds = Histogram(
            "edgedecode_prefill_stage_seconds",
            "Wall time per stage of a request (prefill, observe, export, importance, allocate, quantize, assemble, "
            "compress, frame); the writer's stages run on several threads at once.",
            ["stage"],
            registry=registry,
            buckets=(0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30),
        )
        self.queue = Gauge("edgedecode_prefill_queue_depth", "Prefill requests waiting or running.", registry=registry)
        cache = service.cache
        Gauge("edgedecode_prefix_cache_bytes", "Bytes of KV in the prefix cache.", registry=registry).set_function(
            lambda: cache.nbytes
        )
        Gauge("edgedecode_prefix_cache_entries", "Prompts in the prefix cache.", registry=registry).set_function(
            lambda: len(cache)
        )
        process_gauges(registry)


def create_app(service: PrefillService, config: Config) -> web.Application:
    """The prefill server's aiohttp application around a loaded ``service``."""
    settings = config.prefill
    metrics = PrefillMetrics(service)

    def count(request: web.Request, status: str) -> None:
        if request.path == HELD_PATH:
            metrics.held_queries.labels(status).inc()
        elif request.path.startswith("/v1/prefill"):
            metrics.requests.labels(status).inc()

    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[error_middleware((settings.auth_token, settings.previous_auth_token), count)],
    )
    app[SERVICE_KEY] = service
    waiting = 0

    def queued(handler: Handler) -> Handler:
        """``handler`` behind the bounded queue (429 when full), counted in the queue gauge."""

        async def run(request: web.Request) -> web.StreamResponse:
            nonlocal waiting
            if waiting >= settings.max_queue:
                raise ServerBusyError(
                    f"{waiting} prefill requests are queued (limit {settings.max_queue}); retry later"
                )
            waiting += 1
            metrics.queue.inc()
            try:
                return await handler(request)
            finally:
                waiting -= 1
                metrics.queue.dec()

        return run

    async def _prefill(request: web.Request) -> web.StreamResponse:
        # A bad request (400), a budget no payload meets or a prompt too long (422) raises; the middleware answers.
        parsed = service.parse(await read_json(request, settings.client_timeout_s))
        return await _send(request, await service.prefill(parsed))

    async def resume(request: web.Request) -> web.StreamResponse:
        body = await read_json(request, settings.client_timeout_s)
        parsed = ResumeRequest.parse(request.match_info["transfer_id"], body)
        return await _send(request, await service.resume(parsed))  # an unknown transfer raises (404)

    async def _send(request: web.Request, result: PrefillResult) -> web.StreamResponse:
        """Stream ``result``'s payload, frame by frame, and count it."""
        encoded = result.encoded
        metrics.seconds.observe(result.seconds)
        for stage, seconds in result.stages.items():
            metrics.stage_seconds.labels(stage).observe(seconds)
        metrics.tokens.labels("prefix_cache").inc(result.reused_tokens)
        metrics.tokens.labels("computed").inc(result.computed_tokens)
        for tier, count in encoded.tier_counts().items():
            metrics.tier_tokens.labels(tier).inc(count)
        response = web.StreamResponse(
            headers={
                "Content-Type": EDKV_CONTENT_TYPE,
                "X-EDKV-Tokens": str(len(encoded.tiers)),
                "X-EDKV-Wire-Bytes": str(encoded.wire_bytes),
                "X-EDKV-FP16-Bytes": str(encoded.fp16_bytes),
                "X-Prefix-Reused-Tokens": str(result.reused_tokens),
                "X-Prefill-Seconds": f"{result.seconds:.4f}",
                "X-Prefill-Compute-Seconds": f"{result.stages.get('prefill', 0.0):.4f}",
            }
        )
        response.enable_chunked_encoding()
        try:
            await response.prepare(request)  # a client that left while its prefill ran is gone here
            for frame in encoded.frames:
                await write_within(response, frame, settings.client_timeout_s)
                metrics.sent_bytes.inc(len(frame))
        except ConnectionResetError as exc:
            logger.info("client gone before the end of its payload: %s", exc)
            request[OUTCOME] = "499"
            if request.transport is not None:
                request.transport.abort()
            return response
        await response.write_eof()
        metrics.fp16_bytes.inc(encoded.fp16_bytes)
        return response

    async def held(request: web.Request) -> web.Response:
        held_tokens = service.held_tokens(await read_json(request, settings.client_timeout_s))
        return web.json_response({"held_tokens": held_tokens, "block_tokens": service.cache.block_tokens})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [model_card(service)]})

    app.router.add_post("/v1/prefill", queued(_prefill))
    app.router.add_post("/v1/prefill/transfers/{transfer_id}", queued(resume))
    app.router.add_post(HELD_PATH, held)
    app.router.add_get("/v1/models", models)
    add_common_routes(app, metrics.registry)
    return app


def model_card(service: PrefillService) -> dict:
    """The served model, its KV contract and the producer fingerprint its payloads carry."""
    engine = service.engine
    return {
        "id": service.model.record.name,
        "object": "model",
        "owned_by": "edgedecode",
        "kv_contract": dataclasses.asdict(engine.spec.kv_contract),
        "producer": dataclasses.asdict(engine.producer),
        "max_prompt_tokens": service.max_prompt_tokens,
        "tier_profile": {
            "allowed": [t.name for t in service.profile.allowed],
            "tiers": [t.name for t in Tier],
            "source": service.profile.source,
        },
    }

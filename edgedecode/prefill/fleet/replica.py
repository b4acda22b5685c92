"""One replica of the prefill tier: the prefill server itself, relayed through Ray Serve.

Each replica runs the unchanged prefill server (``server.create_app`` around a ``PrefillService``
built from the configuration) on a loopback port of its own, and ``forward`` relays a request to
it and its answer back, piece by piece as the server writes it: the API, its checks, errors,
bearer-token auth, queue limit and metrics are the prefill server's own. The replica's name (its
Serve id) starts its transfer ids, so a resume finds it (``route.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from ray import serve

from edgedecode.config import Config
from edgedecode.model.loader import load_model
from edgedecode.prefill.fleet.faults import relay_stall_bytes
from edgedecode.prefill.fleet.route import Route
from edgedecode.prefill.fleet.router import STATS_BLOCKS_KEY
from edgedecode.prefill.run import build_service
from edgedecode.prefill.server import create_app
from edgedecode.serving.header_deadline import start_site

logger = logging.getLogger(__name__)
RELAY_BYTES = 1 << 20  # the server's answer is relayed in pieces of at most this many bytes
HOP_HEADERS = frozenset({"connection", "content-length", "transfer-encoding", "keep-alive", "host"})


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request to the tier, as the ingress read it."""

    method: str
    path: str
    query_string: str
    headers: tuple[tuple[str, str], ...]
    body: bytes


@dataclass(frozen=True)
class ResponseHead:
    """The status line and headers of a replica's answer, relayed before its body."""

    status: int
    headers: tuple[tuple[str, str], ...]
    replica: str  # the name of the replica that answered


class PrefillReplica:
    """A Serve deployment: the prefill server of ``config`` on a loopback port, relayed."""

    async def __init__(self, config: Config) -> None:  # type: ignore[misc]  # Serve awaits an async constructor
        self.name = serve.get_replica_context().replica_id.unique_id
        self._closers: list[Callable[[], Awaitable[None]]] = []  # what __del__ closes, in reverse order
        model = await asyncio.to_thread(load_model, config.model.name)
        self.service = await asyncio.to_thread(build_service, model, config, self.name)
        self._closers.append(lambda: asyncio.to_thread(self.service.close))
        self.runner, site = await start_site(
            create_app(self.service, config),
            "127.0.0.1",
            0,
            header_timeout=config.prefill.header_timeout_s,
            handle_signals=False,
            access_log=None,
        )
        self._closers.append(self.runner.cleanup)
        self.url = f"http://127.0.0.1:{site.port}"
        # no read timeout: a prefill may wait in the server's queue; the caller going away cancels it
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=10), auto_decompress=False
        )
        self._closers.append(self.session.close)
        logger.info("prefill replica %s serving on %s", self.name, self.url)

    async def forward(self, route: Route, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
        """The answer of this replica's prefill server to ``request``: its ``ResponseHead``, then
        its body in pieces as they come. A request for another replica's metrics (it is gone) is
        answered 404 here."""
        if route.replica and route.replica != self.name and request.path == "/metrics":
            yield ResponseHead(404, (("Content-Type", "text/plain"),), self.name)
            yield f"replica {route.replica} is not serving (it stopped or was replaced)\n".encode()
            return
        url = self.url + request.path + (f"?{request.query_string}" if request.query_string else "")
        headers = [(k, v) for k, v in request.headers if k.lower() not in HOP_HEADERS]
        stall_bytes = relay_stall_bytes() if request.path == "/v1/prefill" else None  # tests only (faults.py)
        async with self.session.request(request.method, url, headers=headers, data=request.body) as response:
            kept = tuple((k, v) for k, v in response.headers.items() if k.lower() not in HOP_HEADERS)
            yield ResponseHead(response.status, kept, self.name)
            async for piece in response.content.iter_chunked(RELAY_BYTES):
                if stall_bytes is not None and len(piece) >= stall_bytes:
                    yield piece[:stall_bytes]
                    await asyncio.Event().wait()  # held until the test kills this replica
                if stall_bytes is not None:
                    stall_bytes -= len(piece)
                yield piece

    def check_health(self) -> None:
        """Serve's health check: unhealthy (restarted) once a prefill has run far too long."""
        if not self.service.healthy():
            raise RuntimeError(f"prefill replica {self.name}: one prefill has been running too long")

    def record_routing_stats(self) -> dict:
        """What the router learns of this replica: the prefixes its cache holds."""
        # list() of a dict copies it without releasing the GIL: safe beside the worker thread's updates
        return {STATS_BLOCKS_KEY: frozenset(self.service.cache.block_hashes())}

    async def __del__(self) -> None:
        """Serve stops the replica (after its requests finished, within the graceful timeout), maybe
        before its constructor finished: close what it opened."""
        while self._closers:
            await self._closers.pop()()

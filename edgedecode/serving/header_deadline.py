"""A deadline for request headers: close a connection whose request headers have not all arrived within
``header_timeout`` seconds (slowloris), which aiohttp's server does not do by itself.

aiohttp 3.x's ``web_protocol.RequestHandler`` has a ``keepalive_timeout`` (idle connections, also armed at
connection start, 3630 s by default), a ``lingering_time`` (an unread body after the response) and line
size limits, but no limit on how long a request line and headers may take. This module adds one without
touching aiohttp's internals:

* ``HeaderDeadlineSite`` listens like ``web.TCPSite`` but wraps each protocol aiohttp makes in a
  ``HeaderDeadline``, which forwards every callback and runs the timer: armed at ``connection_made`` and,
  once a request is over, at the next byte that arrives (the first byte of the next request on a keep-alive
  connection; an idle keep-alive connection stays aiohttp's business);
* ``header_deadline_middleware`` (outermost, so it also sees requests that other middlewares refuse) runs
  once aiohttp has parsed a request's headers: it stops the timer and marks the request in progress until
  both its handling task is done (the response written: aiohttp runs handler and ``finish_response`` in one
  task per request) and its body has all arrived (``StreamReader.on_eof``: bytes of an unread body that aiohttp
  drains after the response are not the next request's).

Requests that never reach the middleware are a parse error (aiohttp answers 400 and closes the connection, so
the running timer only bounds how long that takes) and an ``Expect`` other than 100-continue (417 before any
middleware; such a connection may then be cut once idle). Pipelined bytes that arrive while a request is in
progress do not arm the timer: the first byte after it does, so a request whose headers began during the
previous one gets at most ``header_timeout`` from that byte.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any, cast

from aiohttp import web

logger = logging.getLogger(__name__)


class HeaderDeadline(asyncio.Protocol):
    """One connection's protocol: aiohttp's ``inner`` protocol plus the header timer (see the module doc)."""

    def __init__(self, inner: asyncio.Protocol, timeout: float, loop: asyncio.AbstractEventLoop) -> None:
        self._inner = inner
        self._timeout = timeout
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._in_progress = 0  # requests whose headers were parsed and which are not over yet

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # a stream server's transports are Transports
        self._arm()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._in_progress == 0 and self._timer is None:
            self._arm()  # the first byte of the next request
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._transport = None
        self._inner.connection_lost(exc)

    def request_started(self) -> None:
        """A request's headers are all there: stop the timer until the request is over."""
        self._disarm()
        self._in_progress += 1

    def request_over(self) -> None:
        """A request's response is written and its body has all arrived: the next byte starts the timer."""
        self._in_progress -= 1

    def _arm(self) -> None:
        self._timer = self._loop.call_later(self._timeout, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self._transport is None:
            return
        peer = self._transport.get_extra_info("peername")
        logger.info(
            "closing the connection from %s: its request headers did not arrive within %g s", peer, self._timeout
        )
        self._transport.abort()  # not close(): nothing worth flushing, and a client that reads nothing can't hold it


@web.middleware
async def header_deadline_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Tell the connection's ``HeaderDeadline`` (if any) that this request's headers arrived, and when the
    request is over (its task done and its body all received)."""
    transport = request.transport
    deadline = transport.get_protocol() if transport is not None else None
    task = asyncio.current_task()
    if not isinstance(deadline, HeaderDeadline) or task is None:
        return await handler(request)
    deadline.request_started()
    pending = 2

    def one_done(*_: object) -> None:
        nonlocal pending
        pending -= 1
        if pending == 0:
            deadline.request_over()

    task.add_done_callback(one_done)
    request.content.on_eof(one_done)
    return await handler(request)


def add_header_deadline(app: web.Application) -> None:
    """Put ``header_deadline_middleware`` first in ``app``'s middlewares (before the app is set up)."""
    if header_deadline_middleware not in app.middlewares:
        app.middlewares.insert(0, header_deadline_middleware)


class HeaderDeadlineSite(web.BaseSite):
    """A TCP site like ``web.TCPSite`` whose connections are cut when a request's headers take longer than
    ``header_timeout`` seconds. The runner's app needs ``add_header_deadline`` (checked at start).

    With an ``ssl_context`` it serves HTTPS only; the TLS handshake must also end within ``header_timeout``
    (the header timer starts once it has)."""

    __slots__ = ("_header_timeout", "_host", "_port")

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        *,
        header_timeout: float,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if header_timeout <= 0:
            raise ValueError(f"header_timeout must be > 0, not {header_timeout}")
        super().__init__(runner, ssl_context=ssl_context)
        self._host = host
        self._port = port
        self._header_timeout = header_timeout

    @property
    def name(self) -> str:
        """The site's URL (``https://`` with TLS), with the bound port once started."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{'https' if self._ssl_context else 'http'}://{host}:{self.port}"

    @property
    def port(self) -> int:
        """The bound port once started (the real one when 0 was asked for), the asked one before."""
        # start() stores what loop.create_server returned (a Server); BaseSite types it as AbstractServer
        server = cast("asyncio.Server | None", self._server)
        if server is not None and server.sockets:
            return server.sockets[0].getsockname()[1]
        return self._port

    async def start(self) -> None:
        runner = self._runner
        if not isinstance(runner, web.AppRunner) or header_deadline_middleware not in runner.app.middlewares:
            # without it every connection would be cut header_timeout after it opened, requests or not
            raise RuntimeError("HeaderDeadlineSite needs an AppRunner whose app went through add_header_deadline")
        await super().start()
        server = runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: HeaderDeadline(server(), self._header_timeout, loop),
            self._host,
            self._port,
            backlog=self._backlog,
            ssl=self._ssl_context,
            ssl_handshake_timeout=self._header_timeout if self._ssl_context else None,
        )


async def start_site(
    app: web.Application,
    host: str,
    port: int,
    *,
    header_timeout: float,
    ssl_context: ssl.SSLContext | None = None,
    **runner_kwargs: Any,
) -> tuple[web.AppRunner, HeaderDeadlineSite]:
    """Set ``app`` up (an ``AppRunner`` with ``runner_kwargs``) and listen on host:port (0: any free port)
    with the header deadline, over TLS with ``ssl_context``. The caller owns the runner: ``await
    runner.cleanup()`` stops everything."""
    add_header_deadline(app)
    runner = web.AppRunner(app, **runner_kwargs)
    await runner.setup()
    site = HeaderDeadlineSite(runner, host, port, header_timeout=header_timeout, ssl_context=ssl_context)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, site

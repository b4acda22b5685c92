"""The one lifecycle of both servers under systemd: serve until SIGTERM/SIGINT, READY=1 with a
status line once listening, watchdog pings while the server says it is healthy, STOPPING=1 on the
way out. Without systemd (no NOTIFY_SOCKET) the notifications are no-ops."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable

from aiohttp import web

from edgedecode.serving import systemd
from edgedecode.serving.http import serve_until_stopped


async def serve_as_service(
    app: web.Application,
    host: str,
    port: int,
    *,
    header_timeout: float,
    ssl_context: ssl.SSLContext | None,
    announce: Callable[[str], None],
    status: Callable[[str], str],
    healthy: Callable[[], bool],
) -> None:
    """Serve ``app`` on host:port until stopped (HTTPS with ``ssl_context``); ``announce`` gets the
    bound URL, ``status(url)`` the line systemd shows, and the watchdog is pinged only while
    ``healthy()``. The caller closes what the app used once this returns (or raises)."""
    watchdog: list[asyncio.Task] = []

    async def listening(url: str) -> None:
        announce(url)
        systemd.notify("READY=1", f"STATUS={status(url)}")
        interval = systemd.watchdog_interval()
        if interval is not None:
            watchdog.append(asyncio.create_task(systemd.run_watchdog(healthy, interval)))

    try:
        await serve_until_stopped(
            app, host, port, header_timeout=header_timeout, ssl_context=ssl_context, on_listening=listening
        )
    finally:
        systemd.notify("STOPPING=1")
        for task in watchdog:
            task.cancel()

"""Start the prefill server: load the model, build the prefill graph, serve until stopped."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

from edgedecode.config import Config
from edgedecode.model.loader import LoadedModel
from edgedecode.prefill.server import create_app
from edgedecode.prefill.service import PrefillService
from edgedecode.serving import systemd
from edgedecode.serving.http import serve_until_stopped

logger = logging.getLogger(__name__)


def run_prefill_server(model: LoadedModel, config: Config, announce: Callable[[str], None]) -> None:
    """Serve ``model`` per ``config.prefill`` until SIGTERM/SIGINT; ``announce`` gets the bound URL."""
    settings = config.prefill
    service = PrefillService(
        model,
        device=config.model.device,
        threads=config.model.threads or None,
        max_prompt_tokens=settings.max_prompt_tokens,
        prefix_cache_bytes=settings.prefix_cache_mb << 20,
        encode_threads=settings.encode_threads or os.cpu_count() or 1,
        allow_special_tokens=settings.allow_special_tokens,
    )

    async def main() -> None:
        async def listening(url: str) -> None:
            announce(url)
            systemd.notify("READY=1", f"STATUS=prefilling {model.record.name} at {url}")
            interval = systemd.watchdog_interval()
            if interval is not None:
                watchdog.append(asyncio.create_task(systemd.run_watchdog(lambda: True, interval)))

        watchdog: list[asyncio.Task] = []
        try:
            await serve_until_stopped(
                create_app(service, config),
                settings.host,
                settings.port,
                header_timeout=settings.header_timeout_s,
                on_listening=listening,
            )
        finally:
            systemd.notify("STOPPING=1")
            for task in watchdog:
                task.cancel()
            service.close()

    asyncio.run(main())

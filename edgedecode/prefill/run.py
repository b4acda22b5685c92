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
from edgedecode.serving.heap import return_freed_buffers
from edgedecode.serving.lifecycle import serve_as_service
from edgedecode.tls import server_tls

logger = logging.getLogger(__name__)


def build_service(model: LoadedModel, config: Config, transfer_id_prefix: str = "") -> PrefillService:
    """The prefill service of ``model`` as ``config`` sets it up (``[model]`` and ``[prefill]``)."""
    settings = config.prefill
    return PrefillService(
        model,
        device=config.model.device,
        threads=config.model.threads or None,
        max_prompt_tokens=settings.max_prompt_tokens,
        prefix_cache_bytes=settings.prefix_cache_mb << 20,
        transfer_bytes=settings.transfer_cache_mb << 20,
        transfer_ttl_s=settings.transfer_ttl_s,
        encode_threads=settings.encode_threads or os.cpu_count() or 1,
        allow_special_tokens=settings.allow_special_tokens,
        transfer_id_prefix=transfer_id_prefix,
    )


def run_prefill_server(model: LoadedModel, config: Config, announce: Callable[[str], None]) -> None:
    """Serve ``model`` per ``config.prefill`` until SIGTERM/SIGINT; ``announce`` gets the bound URL."""
    settings = config.prefill
    return_freed_buffers()  # transient prefills and payloads leave the process (serving/heap.py)
    ssl_context = server_tls(settings.tls_cert_file, settings.tls_key_file)  # checked by load_config
    service = build_service(model, config)

    async def main() -> None:
        try:
            await serve_as_service(
                create_app(service, config),
                settings.host,
                settings.port,
                header_timeout=settings.header_timeout_s,
                ssl_context=ssl_context,
                announce=announce,
                status=lambda url: f"prefilling {model.record.name} at {url}",
                healthy=service.healthy,
            )
        finally:
            service.close()

    asyncio.run(main())

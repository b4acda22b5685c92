"""Start the decode daemon: the decode engines, then the HTTP API, with the embedded prefill server
when no URL is configured; report readiness and watchdog pings to systemd."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from edgedecode.config import Config
from edgedecode.daemon.app import create_app
from edgedecode.daemon.embedded import EmbeddedPrefill
from edgedecode.daemon.metrics import DaemonMetrics
from edgedecode.daemon.service import DecodeService
from edgedecode.model.loader import LoadedModel
from edgedecode.runtime.engine import Engine
from edgedecode.runtime.session import decode_options
from edgedecode.serving.heap import release_free_pages, return_freed_buffers
from edgedecode.serving.lifecycle import serve_as_service
from edgedecode.tls import server_tls

logger = logging.getLogger(__name__)


def build_engines(model: LoadedModel, config: Config) -> list[Engine]:
    """The decode engines of ``config.daemon.slots`` slots: one onnxruntime session of the INT4 decode
    graph, each engine with its own KV buffers of ``config.daemon.max_context`` tokens."""
    d, m = config.daemon, config.model
    options = decode_options(m.device)
    threads = m.threads or None
    first = Engine(model, options, max_context=d.max_context, device=m.device, threads=threads)
    return [first] + [
        Engine(model, options, max_context=d.max_context, device=m.device, threads=threads, share=first)
        for _ in range(d.slots - 1)
    ]


def run_daemon(model: LoadedModel, config: Config, config_path: Path | None, announce: Callable[[str], None]) -> None:
    """Serve ``model`` per ``config.daemon`` until SIGTERM/SIGINT; ``announce`` gets the bound URL."""
    settings = config.daemon
    return_freed_buffers()  # the daemon's RSS follows its KV budget (serving/heap.py)
    release_free_pages()  # what parsing the model's vocabulary freed, before the weights are mapped
    ssl_context = server_tls(settings.tls_cert_file, settings.tls_key_file)  # checked by load_config

    async def main() -> None:
        embedded = None
        prefill_url: Callable[[], str | None]  # the prefill server now (None while it is down)
        if settings.local_prefill_only:
            prefill_url, prefill_token = (lambda: None), ""
        elif settings.prefill_url:
            prefill_url, prefill_token = (lambda: settings.prefill_url), settings.prefill_token
        else:  # started with the app, before it serves
            embedded = EmbeddedPrefill(config_path, model.record.name)
            prefill_url, prefill_token = (lambda: embedded.url), embedded.token
        metrics = DaemonMetrics()
        engines = build_engines(model, config)
        service = DecodeService(model, engines, config, metrics, prefill_url, prefill_token)
        service.planner.calibrate_local(engines[0])  # ~1.5 s on 2 cores, before any request
        await serve_as_service(
            create_app(service, config, metrics, embedded),
            settings.host,
            settings.port,
            header_timeout=settings.header_timeout_s,
            ssl_context=ssl_context,
            announce=announce,
            status=lambda url: f"serving {model.record.name} at {url}; KV from {prefill_url()}",
            healthy=service.healthy,
        )

    asyncio.run(main())

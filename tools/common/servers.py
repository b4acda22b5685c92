"""Real edgedecode servers on 127.0.0.1 for the tools that run them (benchmarks, load and fault tests): a
server's config file, a server process for the length of a block, and a streamed completion timed by the
client."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgedecode.client.chat import ChatError, stream_events
from edgedecode.serving.process import ServerStartError, start_server, stop_server


def toml_config(path: Path, sections: Mapping[str, Mapping[str, Any]]) -> Path:
    """Write ``{section: {key: value}}`` ({"daemon": {"slots": 1}, ...}) as a TOML config (values as JSON
    literals) at ``path``; returns ``path``."""
    lines = []
    for section, settings in sections.items():
        lines += [f"[{section}]", *(f"{key} = {json.dumps(value)}" for key, value in settings.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


@contextlib.contextmanager
def running(args: list[str], log: Path, **options: Any) -> Iterator[tuple[subprocess.Popen, str]]:
    """``edgedecode <args> --port 0`` until the block ends, its stderr into ``log``; yields the process and
    its URL. ``options`` go to ``start_server`` (``env``, ``launcher``).

    Raises:
        ServerStartError: it did not start (the message ends with its log's tail).
    """
    with open(log, "wb") as stderr:
        try:
            process, url = start_server(args, stderr=stderr, **options)
        except ServerStartError as exc:
            raise ServerStartError(f"{exc}; its log:\n{log.read_text()[-3000:]}") from None
        try:
            yield process, url
        finally:
            stop_server(process)


@dataclass(frozen=True)
class StreamedCompletion:
    """A streamed completion as the client saw it."""

    ttft_s: float | None  # the first text, or the whole answer's time when none came; None: failed before any
    seconds: float  # until the stream ended (or failed)
    report: dict | None  # the daemon's ``edgedecode`` object of the turn (the last one sent)
    error: str | None  # the daemon's error (before or during the stream), or why it could not be reached


def streamed_completion(url: str, body: dict, timeout: float = 600) -> StreamedCompletion:
    """POST ``body`` to ``url``/v1/completions as a stream (``body`` must ask for one) and time it."""
    ttft_s, report, error = None, None, None
    started = time.perf_counter()
    try:
        for event in stream_events(url, "/v1/completions", body, timeout=timeout):
            if "error" in event:  # the generation failed after the answer had begun
                error = f"the daemon failed mid-stream: {event['error'].get('message')}"
                break
            if ttft_s is None and any(choice.get("text") for choice in event.get("choices", [])):
                ttft_s = time.perf_counter() - started
            report = event.get("edgedecode", report)
    except ChatError as exc:
        error = str(exc)
    seconds = time.perf_counter() - started
    if ttft_s is None and error is None:
        ttft_s = seconds  # no text at all: the whole answer's time
    return StreamedCompletion(ttft_s, seconds, report, error)

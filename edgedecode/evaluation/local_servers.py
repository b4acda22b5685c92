"""Real edgedecode servers on 127.0.0.1 for the evaluation tools: a config file written from
settings, and a server process that lives for a ``with`` block."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from edgedecode.serving.process import ServerStartError, start_server, stop_server


def write_config(path: Path, sections: Mapping[str, Mapping[str, Any]]) -> Path:
    """Write ``sections`` ({"daemon": {"slots": 1}, ...}) as a TOML config at ``path``; returns it."""
    lines = []
    for section, settings in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in settings.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


@contextlib.contextmanager
def running(args: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """``edgedecode <args> --port 0`` (its stderr into ``log``) until the block ends; yields its URL.

    Raises:
        ServerStartError: it did not start (the message ends with its log's tail).
    """
    with open(log, "wb") as stderr:
        try:
            process, url = start_server(args, env=env, stderr=stderr)
        except ServerStartError as exc:
            raise ServerStartError(f"{exc}; its log:\n{log.read_text()[-3000:]}") from None
        try:
            yield url
        finally:
            stop_server(process)

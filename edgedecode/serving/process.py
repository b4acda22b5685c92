"""Start an edgedecode server as a child process and learn its URL from the line it prints."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import IO

from edgedecode.errors import EdgeDecodeError
from edgedecode.serving.http import LISTENING

START_TIMEOUT_SECONDS = 900  # a first start may fetch the model and build its graphs


class ServerStartError(EdgeDecodeError):
    """The server exited or stayed silent before it listened."""


def start_server(
    args: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    stderr: IO | None = None,
    launcher: Sequence[str] = (),
    timeout: float = START_TIMEOUT_SECONDS,
) -> tuple[subprocess.Popen, str]:
    """Run ``[*launcher] python -m edgedecode *args --port 0`` (e.g. ``serve --config F``); return the
    process and the URL it listens on. ``launcher`` prefixes the command (e.g. ``taskset -c 0,1``);
    ``env`` adds to this process's environment (without its systemd notify socket)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("NOTIFY_SOCKET", None)
    command = [*launcher, sys.executable, "-m", "edgedecode", *args, "--port", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=full_env)
    deadline = time.monotonic() + timeout
    assert process.stdout is not None  # stdout=PIPE
    for line in process.stdout:
        match = LISTENING.search(line)
        if match:
            return process, match.group(1)
        if time.monotonic() > deadline:
            break
    stop_server(process)
    raise ServerStartError(f"`edgedecode {' '.join(args)}` did not start (exit status {process.poll()})")


def stop_server(process: subprocess.Popen, timeout: float = 30) -> None:
    """Terminate the server and wait for it (kill it if it does not stop within ``timeout``)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

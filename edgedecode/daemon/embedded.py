"""The embedded prefill endpoint: with no prefill URL configured, the daemon runs
``edgedecode prefill-server`` as a child process on 127.0.0.1 (any free port, a fresh random token),
so one command gives the whole prefill -> EDKV -> decode path on one machine.

The child dies with the daemon (Linux parent-death signal, and terminate on shutdown); if it exits
on its own it is restarted after a pause, while requests prefill locally meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import secrets
import signal
import sys
from pathlib import Path

from edgedecode.errors import EdgeDecodeError
from edgedecode.serving.http import LISTENING

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1
# The child serves only this daemon, on loopback: its own token alone, plain HTTP (a [prefill] TLS
# certificate in a shared config file is for the prefill node's name, which 127.0.0.1 is not).
_CHILD_ENV = {
    "EDGEDECODE_PREFILL_PREVIOUS_AUTH_TOKEN": "",
    "EDGEDECODE_PREFILL_TLS_CERT_FILE": "",
    "EDGEDECODE_PREFILL_TLS_KEY_FILE": "",
    "PYTHONUNBUFFERED": "1",
}


class EmbeddedPrefillError(EdgeDecodeError):
    """The embedded prefill server did not start."""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):  # not Linux: shutdown still terminates the child
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class EmbeddedPrefill:
    """A child ``edgedecode prefill-server`` of the daemon's model, bound to 127.0.0.1."""

    def __init__(
        self, config_path: Path | None, model_name: str, *, start_timeout: float = 900.0, restart_delay: float = 5.0
    ) -> None:
        self.config_path = config_path
        self.model_name = model_name  # given to the child: a --model of the daemon's is not in its config
        self.token = secrets.token_urlsafe(24)
        self.start_timeout = start_timeout
        self.restart_delay = restart_delay
        self.url: str | None = None  # None while the child is not serving
        self._process: asyncio.subprocess.Process | None = None
        self._watch: asyncio.Task | None = None
        self._stopping = False

    async def start(self) -> str:
        """Start the child and wait until it serves; returns its URL."""
        command = [sys.executable, "-m", "edgedecode", "prefill-server", "--host", "127.0.0.1", "--port", "0"]
        command += ["--model", self.model_name]
        if self.config_path is not None:
            command += ["--config", str(self.config_path)]
        env = {**os.environ, **_CHILD_ENV, "EDGEDECODE_PREFILL_AUTH_TOKEN": self.token}
        env.pop("NOTIFY_SOCKET", None)  # the child must not report readiness for the daemon's unit
        self._process = await asyncio.create_subprocess_exec(
            *command, stdout=asyncio.subprocess.PIPE, env=env, preexec_fn=_die_with_parent
        )
        try:
            self.url = await asyncio.wait_for(self._read_url(), self.start_timeout)
        except (TimeoutError, EmbeddedPrefillError) as exc:
            await self._terminate()
            raise EmbeddedPrefillError(f"the embedded prefill server did not start: {exc or 'timed out'}") from None
        self._watch = asyncio.create_task(self._supervise())
        logger.info("embedded prefill server at %s (pid %d)", self.url, self._process.pid)
        return self.url

    def _child(self) -> tuple[asyncio.subprocess.Process, asyncio.StreamReader]:
        """The child start() made last and its stdout pipe."""
        process = self._process
        assert process is not None and process.stdout is not None, "start() made the child with stdout=PIPE"
        return process, process.stdout

    async def _read_url(self) -> str:
        process, stdout = self._child()
        while True:
            line = await stdout.readline()
            if not line:
                raise EmbeddedPrefillError(f"it exited with status {await process.wait()}")
            match = LISTENING.search(line.decode(errors="replace"))
            if match:
                return match.group(1)

    async def _supervise(self) -> None:
        """Drain the child's output; restart it when it exits on its own."""
        while not self._stopping:
            process, stdout = self._child()
            while await stdout.readline():
                pass
            status = await process.wait()
            self.url = None
            if self._stopping:
                return
            logger.error(
                "the embedded prefill server exited with status %s; restarting in %.0f s", status, self.restart_delay
            )
            await asyncio.sleep(self.restart_delay)
            try:
                await self.start()
                return  # start() runs a fresh supervisor
            except EmbeddedPrefillError as exc:
                logger.error("%s", exc)
                return

    async def stop(self) -> None:
        """Terminate the child and wait for it."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
        await self._terminate()

    async def _terminate(self) -> None:
        process = self._process
        if process is None or process.returncode is not None:
            return
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            process.kill()
            await process.wait()

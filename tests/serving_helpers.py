"""Helpers for the serving tests: real servers as subprocesses, and aiohttp apps in a thread."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from aiohttp import web

LISTENING = re.compile(r"listening on (http://\S+)")
START_TIMEOUT = 600


class ServerProcess:
    """``python -m edgedecode <command> --port 0 ...`` with its URL; stderr goes to a log file."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self._log_file = open(log, "wb")  # noqa: SIM115 - closed in stop()
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.process = subprocess.Popen([sys.executable, "-m", "edgedecode", *args, "--port", "0"],
                                        stdout=subprocess.PIPE, stderr=self._log_file, text=True, env=full_env)
        deadline = time.monotonic() + START_TIMEOUT
        self.url = None
        for line in self.process.stdout:
            match = LISTENING.search(line)
            if match:
                self.url = match.group(1)
                break
            if time.monotonic() > deadline:
                break
        if self.url is None:
            self.stop()
            raise RuntimeError(f"{args[0]} did not start; its log:\n{log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log_file.close()


class ThreadedApp:
    """An aiohttp application served on 127.0.0.1 from its own event loop in a thread."""

    def __init__(self, app: web.Application) -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(app,), daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the test app did not start")

    def _run(self, app: web.Application) -> None:
        asyncio.set_event_loop(self.loop)
        self._runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self._ready.set()
        self.loop.run_forever()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)

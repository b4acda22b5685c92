"""Helpers for the serving tests: real servers as subprocesses, aiohttp apps in a thread, and a raw
TCP upstream for the link shaper."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from edgedecode.config import Config
from edgedecode.serving.process import ServerStartError, start_server, stop_server
from edgedecode.testing.metrics_scrape import scrape_metrics

START_TIMEOUT = 600
PREFILL_TOKEN = "prefill-secret"  # the bearer token of the session's prefill server (conftest.py)
# the session's prefill server: timeouts short enough for the slowloris and slow-body tests, a short queue for floods
PREFILL_SETTINGS = {"header_timeout_s": 1.0, "client_timeout_s": 2.0, "max_queue": 4}


def metric_samples(url: str, token: str, path: str = "/metrics") -> dict[str, float]:
    """Every sample of a server's /metrics (or ``path``), keyed ``name{k=v,...}`` (``scrape_metrics``)."""
    return scrape_metrics(url, token, path)


def slot_kv_bytes_per_token(spec) -> int:
    """Bytes of KV one token takes in a CPU decode slot as shipped on this host: float16 where edgedecode's
    DecodeAttention runs (runtime.session.decode_kv_dtype), else float32. Tests that size a memory budget
    in tokens of a slot derive it from this, so they hold whichever the host ships."""
    from edgedecode.runtime.session import decode_options

    return spec.kv_bytes_per_token_fp16 // 2 * decode_options("cpu").kv_np_dtype.itemsize


def lighthouse_chat(sentences: int) -> list[dict]:
    """A chat prompt asking to summarize ``sentences`` repetitions of one sentence (~12 tokens each)."""
    sentence = "The lighthouse keeper wrote down the weather every morning before dawn."
    return [{"role": "user", "content": "Summarize: " + " ".join([sentence] * sentences)}]


def server_config(
    directory: Path, name: str, *, prefill_token: str, budget: float, prefill: dict | None = None, **daemon
) -> str:
    """A TOML config for test servers (threads and context sized for the CI machine); ``daemon``
    adds or overrides [daemon] keys, ``prefill`` [prefill] keys. Returns its path."""
    settings = {"slots": 2, "max_context": 2048, "budget": budget, "prefill_token": prefill_token, **daemon}
    prefill_settings = {"prefix_cache_mb": 64, "max_prompt_tokens": 2048, **(prefill or {})}
    lines = ["[model]", "threads = 2", "[daemon]"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in settings.items()]
    lines += ["[prefill]"] + [f"{key} = {json.dumps(value)}" for key, value in prefill_settings.items()]
    path = directory / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@dataclass(frozen=True)
class Endpoint:
    """A running server as a test sees it: its URL, bearer token and configuration."""

    url: str
    token: str
    config: Config


class ServerProcess:
    """``python -m edgedecode <args> --port 0`` with its URL; stderr goes to a log file."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self.config: Config | None = None  # what it runs, for a test that needs its limits (set by its fixture)
        self._log_file = open(log, "wb")  # noqa: SIM115 - closed in stop()
        try:
            self.process, self.url = start_server(args, env=env, stderr=self._log_file, timeout=START_TIMEOUT)
        except ServerStartError as exc:
            self._log_file.close()
            raise RuntimeError(f"{exc}; its log:\n{log.read_text()[-3000:]}") from None

    def stop(self) -> None:
        stop_server(self.process)
        self._log_file.close()


def pulling_daemon(directory: Path, prefill_url: str, token: str, budget: float = 0.3) -> ServerProcess:
    """``edgedecode serve`` with the test config, pulling from ``prefill_url`` (whose token is
    PREFILL_TOKEN) at ``budget``, its clients authenticated by ``token``; its log in ``directory``."""
    config = server_config(directory, "daemon", prefill_token=PREFILL_TOKEN, budget=budget)
    return ServerProcess(
        ["serve", "--config", config, "--prefill-url", prefill_url],
        directory / "daemon.log",
        env={"EDGEDECODE_DAEMON_AUTH_TOKEN": token},
    )


class ThreadedApp:
    """An aiohttp application served on 127.0.0.1 from its own event loop in a thread."""

    @classmethod
    def posting(cls, path: str, handler) -> ThreadedApp:
        """An application answering POST ``path`` with ``handler``, served."""
        app = web.Application()
        app.router.add_post(path, handler)
        return cls(app)

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


class ByteUpstream:
    """A TCP server on 127.0.0.1: to ``b"send <n>\\n"`` it answers n bytes and closes; to anything
    else it echoes the line. A context manager (closed on exit)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(10)
            with conn:
                line = conn.makefile("rb").readline()
                if line.startswith(b"send "):
                    conn.sendall(b"x" * int(line.split()[1]))
                else:
                    conn.sendall(line)

    def close(self) -> None:
        self._closed = True
        self._thread.join(5)
        self.sock.close()

    def __enter__(self) -> ByteUpstream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def receive(port: int, request: bytes, expect: int) -> tuple[bytes, float]:
    """Send ``request`` through 127.0.0.1:``port``; what came back (until EOF) and how long it took."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        started = time.perf_counter()
        conn.sendall(request)
        got = bytearray()
        while len(got) < expect:
            piece = conn.recv(1 << 16)
            if not piece:
                break
            got += piece
        return bytes(got), time.perf_counter() - started

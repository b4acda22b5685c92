"""``edgedecode chat``: an interactive, streaming chat against the decode daemon.

Each turn is one OpenAI-style streamed chat completion with the whole conversation and a session id,
so the daemon reuses the KV it holds and pulls only the new tokens' KV. After each answer a status
line shows the time to first token, decode tokens/s, the KV bytes pulled and their tier mix.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from edgedecode.errors import EdgeDecodeError
from edgedecode.serving.process import ServerStartError, start_server, stop_server
from edgedecode.tls import client_tls


class ChatError(EdgeDecodeError):
    """The daemon could not be reached or answered with an error."""


@dataclass(frozen=True)
class ChatSettings:
    url: str | None
    token: str
    config_path: Path | None
    model: str | None  # the daemon started here runs it; a daemon at url must serve it (None: whatever it serves)
    ca_file: Path | None  # PEM CA certificates that verify an https daemon (None: the system's)
    system: str | None
    max_tokens: int
    temperature: float


@dataclass
class TurnResult:
    """One answer and the daemon's report on it."""

    text: str
    report: dict
    completion_tokens: int
    seconds: float


class ChatClient:
    """A conversation with the daemon at ``url``."""

    def __init__(
        self,
        url: str,
        token: str = "",
        system: str | None = None,
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        timeout: float = 600,
        ca_file: Path | None = None,
        model: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model  # sent with each turn, so a daemon serving another model refuses it
        self.token = token
        try:
            self.tls = client_tls(str(ca_file or ""))
        except OSError as exc:  # ssl.SSLError too
            raise ChatError(f"cannot verify the daemon with the CA certificates of {ca_file}: {exc}") from None
        self.system = system
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.timeout = timeout
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (a new session id)."""
        self.session_id = secrets.token_hex(8)
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def send(self, text: str, out: TextIO) -> TurnResult:
        """Send a user message, write the answer to ``out`` as it streams, and remember both."""
        self.messages.append({"role": "user", "content": text})
        body = {
            "messages": self.messages,
            "stream": True,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "session_id": self.session_id,
            "stream_options": {"include_usage": True},
        }
        if self.model is not None:
            body["model"] = self.model
        started = time.perf_counter()
        pieces: list[str] = []
        report: dict[str, Any] = {}
        completion = 0
        try:
            for event in stream_events(self.url, "/v1/chat/completions", body, self.token, self.timeout, self.tls):
                if "error" in event:
                    raise ChatError(f"the daemon failed: {event['error'].get('message')}")
                for choice in event.get("choices", []):
                    piece = choice.get("delta", {}).get("content")
                    if piece:
                        pieces.append(piece)
                        out.write(piece)
                        out.flush()
                report = event.get("edgedecode", report)
                completion = event.get("usage", {}).get("completion_tokens", completion)
        except BaseException:
            self.messages.pop()
            raise
        text_out = "".join(pieces)
        self.messages.append({"role": "assistant", "content": text_out})
        return TurnResult(text_out, report, completion, time.perf_counter() - started)


def stream_events(
    url: str, path: str, body: dict, token: str = "", timeout: float = 600, tls: ssl.SSLContext | None = None
) -> Iterator[dict]:
    """POST ``body`` to the daemon at ``url`` + ``path`` and yield the JSON of each server-sent event
    until ``[DONE]``; an https daemon is verified with ``tls`` (None: the system's CAs). Raises
    ChatError with the daemon's message on an HTTP error."""
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url.rstrip("/") + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=tls) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                yield json.loads(data)
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        with contextlib.suppress(ValueError, KeyError, TypeError):
            detail = json.loads(detail)["error"]["message"]
        raise ChatError(f"the daemon answered {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ChatError(f"cannot reach the daemon at {url}: {exc}") from None


def status_line(result: TurnResult) -> str:
    """The per-turn summary shown after each answer."""
    report, kv = result.report, result.report.get("kv", {})
    parts = [
        f"TTFT {report.get('ttft_ms', 0):.0f} ms",
        f"{report.get('decode_tokens_per_second', 0):.1f} tok/s",
        f"{result.completion_tokens} tokens",
    ]
    if kv.get("source") == "prefill_server":
        tiers = " ".join(f"{name} {count}" for name, count in kv.get("tiers", {}).items())
        parts.append(
            f"KV pulled {kv.get('wire_bytes', 0) / 1024:.1f} KiB for {kv.get('pulled_tokens', 0)} tokens "
            f"(b {kv.get('b_wire') or 0:.3f}; {tiers})"
        )
    else:
        by_plan = "by plan" if kv.get("decision") == "local" else "no prefill server"
        parts.append(f"KV computed locally ({kv.get('fallback_reason') or by_plan})")
    if kv.get("decision"):
        parts.append(f"plan {kv['decision']}: {kv.get('why')}")
    if kv.get("reused_tokens"):
        parts.append(f"{kv['reused_tokens']} tokens reused from earlier turns")
    return "[" + "; ".join(parts) + "]"


def start_daemon(config_path: Path | None, model: str | None = None) -> tuple[subprocess.Popen, str]:
    """Start ``edgedecode serve`` (of ``model``, None: its config's) on a free loopback port for this
    chat; returns it and its URL."""
    args = ["serve", "--host", "127.0.0.1"] + (["--config", str(config_path)] if config_path is not None else [])
    args += ["--model", model] if model is not None else []
    try:
        return start_server(args)
    except ServerStartError as exc:
        raise ChatError(f"the decode daemon did not start: {exc}") from None


def run_chat(
    settings: ChatSettings, stdin: TextIO = sys.stdin, out: TextIO = sys.stdout, err: TextIO = sys.stderr
) -> None:
    """The interactive loop: a line in, the streamed answer and its status line out."""
    process = None
    url = settings.url
    if url is None:
        err.write("starting the decode daemon (and its prefill server)...\n")
        process, url = start_daemon(settings.config_path, settings.model)
    client = ChatClient(
        url,
        settings.token,
        settings.system,
        max_tokens=settings.max_tokens,
        temperature=settings.temperature,
        ca_file=settings.ca_file,
        model=settings.model,
    )
    interactive = stdin.isatty()
    try:
        while True:
            if interactive:
                out.write("> ")
                out.flush()
            line = stdin.readline()
            if not line or line.strip() == "/exit":
                break
            text = line.strip()
            if not text:
                continue
            if text == "/reset":
                client.reset()
                err.write("[new conversation]\n")
                continue
            result = client.send(text, out)
            out.write("\n")
            out.flush()
            err.write(status_line(result) + "\n")
            err.flush()
    except KeyboardInterrupt:
        err.write("\n")
    finally:
        if process is not None:
            stop_server(process)

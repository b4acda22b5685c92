"""Hostile clients beyond one request (issue 15 item 2), for either server: headers or bodies sent
slowly (slowloris), clients that leave mid-stream or while their answer is computed, and floods past
the queue; and ``healthy``, the request a server must still answer afterwards.

Each behaviour returns a ``Finding``: whether the server bounded it as configured, how long that
took, and what it answered.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from dataclasses import dataclass, field

import aiohttp

from edgedecode.testing.hostile_http import CHAT, PREFILL, TEXT, Target

SLACK_S = 2.0  # beyond a configured timeout, what a loaded box may add before it counts as a hang
DRIP_S = 0.2  # a slowloris client's pause between bytes


@dataclass
class Finding:
    """What one hostile behaviour got from a server."""

    name: str
    server: str
    ok: bool
    seconds: float  # how long the server took to bound it (or the request took)
    detail: str
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)


def _auth(target: Target) -> dict[str, str]:
    return {"Authorization": f"Bearer {target.token}"} if target.token else {}


def _healthy_request(target: Target) -> tuple[str, dict]:
    if target.server == "daemon":
        return CHAT, {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, "temperature": 0}
    return PREFILL, {"token_ids": [1, 2, 3], "budget": 1.0}


async def healthy(http: aiohttp.ClientSession, target: Target, bound_s: float = 120.0) -> tuple[bool, float]:
    """Whether ``target`` answers a plain request (a 2-token chat, a 3-token prefill) with a 200 and
    a whole answer within ``bound_s``; and how long it took."""
    path, body = _healthy_request(target)
    started = time.perf_counter()
    try:
        async with http.post(
            target.url + path, json=body, headers=_auth(target), timeout=aiohttp.ClientTimeout(total=bound_s)
        ) as response:
            data = await response.read()
            ok = response.status == 200 and (b'"choices"' in data if target.server == "daemon" else data[:4] == b"EDKV")
    except (TimeoutError, aiohttp.ClientError):
        ok = False
    return ok, time.perf_counter() - started


def _host_port(target: Target) -> tuple[str, int]:
    host, _, port = target.url.removeprefix("http://").rpartition(":")
    return host.strip("[]"), int(port)


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes | None:
    """What the server sent before closing the connection (None: still open after ``seconds``)."""
    got = bytearray()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            while piece := await reader.read(65536):
                got += piece
            return bytes(got)
    return None


async def slow_headers(
    http: aiohttp.ClientSession, target: Target, header_timeout_s: float, connections: int = 8
) -> Finding:
    """``connections`` clients send a request's headers one byte every DRIP_S; each must be cut within
    ``header_timeout_s`` (plus SLACK_S) while a plain request is answered meanwhile."""
    host, port = _host_port(target)
    path = CHAT if target.server == "daemon" else PREFILL
    pad = "y" * int((header_timeout_s + SLACK_S) / DRIP_S + 10)  # outlasts the bound
    request = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nX-Drip: {pad}\r\n\r\n".encode()

    async def drip() -> float | None:
        """Seconds until the server cut this connection (None: it let the whole request in)."""
        reader, writer = await asyncio.open_connection(host, port)
        started = time.perf_counter()
        try:
            for byte in request:
                writer.write(bytes([byte]))
                await writer.drain()
                if await _closed_within(reader, DRIP_S) is not None:
                    return time.perf_counter() - started
            return None
        except ConnectionError:
            return time.perf_counter() - started
        finally:
            writer.close()

    cut, (served, served_s) = await asyncio.gather(
        asyncio.gather(*(drip() for _ in range(connections))), _after(0.5, healthy(http, target))
    )
    times = [t for t in cut if t is not None]
    worst = max(times, default=float("inf"))
    ok = len(times) == connections and worst <= header_timeout_s + SLACK_S and served
    detail = (
        f"{len(times)}/{connections} dripping connections cut, the last after {worst:.2f} s "
        f"(header_timeout_s {header_timeout_s:g}); a plain request meanwhile: {'served' if served else 'FAILED'} "
        f"in {served_s:.2f} s"
    )
    return Finding("slow headers (slowloris)", target.server, ok, worst, detail)


async def _after(delay_s: float, work):
    await asyncio.sleep(delay_s)
    return await work


async def slow_body(target: Target, client_timeout_s: float) -> Finding:
    """A client sends its headers and 10 of the 1000 body bytes it announced, then nothing: it must
    get a 408 in OpenAI's error shape within ``client_timeout_s`` (plus SLACK_S)."""
    host, port = _host_port(target)
    path = CHAT if target.server == "daemon" else PREFILL
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {target.token}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    reader, writer = await asyncio.open_connection(host, port)
    started = time.perf_counter()
    try:
        writer.write(head.encode() + b'{"messages')
        await writer.drain()
        status_line, body = await _response(reader, client_timeout_s + SLACK_S)
    finally:
        writer.close()
    seconds = time.perf_counter() - started
    try:
        shaped = isinstance(json.loads(body)["error"]["message"], str)
    except (ValueError, KeyError, TypeError):
        shaped = False
    ok = status_line.startswith(b"HTTP/1.1 408") and shaped and seconds <= client_timeout_s + SLACK_S
    detail = f"answered {status_line.decode(errors='replace') or 'nothing'} after {seconds:.2f} s " + (
        f"(client_timeout_s {client_timeout_s:g})"
    )
    return Finding("slow body", target.server, ok, seconds, detail)


async def _response(reader: asyncio.StreamReader, seconds: float) -> tuple[bytes, bytes]:
    """The status line and body of the HTTP response arriving within ``seconds`` (b"", b"": none)."""
    try:
        async with asyncio.timeout(seconds):
            head = await reader.readuntil(b"\r\n\r\n")
            status_line, _, header_lines = head.partition(b"\r\n")
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in header_lines.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ),
                0,
            )
            return status_line, await reader.readexactly(length)
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError):
        return b"", b""


async def slots(http: aiohttp.ClientSession, daemon: Target) -> dict[str, int]:
    """The daemon's slot use from /readyz: {"total", "busy", "queued"}."""
    async with http.get(daemon.url + "/readyz", headers=_auth(daemon)) as response:
        return (await response.json())["slots"]


async def _until_free(http: aiohttp.ClientSession, daemon: Target, bound_s: float) -> float | None:
    started = time.perf_counter()
    while time.perf_counter() - started < bound_s:
        if (await slots(http, daemon))["busy"] == 0:
            return time.perf_counter() - started
        await asyncio.sleep(0.02)
    return None


async def leave(http: aiohttp.ClientSession, daemon: Target, *, stream: bool, bound_s: float = 2.0) -> Finding:
    """A client asks the daemon (one idle slot) for a long completion, streamed or not, and hangs up
    once it is being generated (a few events in, or its slot busy): the slot must be free again within
    ``bound_s``."""
    host, port = _host_port(daemon)
    async with http.get(daemon.url + "/v1/models", headers=_auth(daemon)) as response:
        max_context = (await response.json())["data"][0]["max_context"]
    long = max_context // 2  # tokens: far longer than the bound takes to generate
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": long, "temperature": 1, "stream": stream})
    request = (
        f"POST {TEXT} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {daemon.token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    )
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request.encode())
        await writer.drain()
        if stream:
            got = b""
            async with asyncio.timeout(120):
                while got.count(b"data:") < 3:
                    got += await reader.read(4096)
        else:
            async with asyncio.timeout(120):
                while (await slots(http, daemon))["busy"] == 0:
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # well into its generation
    finally:
        writer.transport.abort()  # the client is gone: a reset, nothing more read
    freed = await _until_free(http, daemon, bound_s)
    name = "client leaves mid-stream" if stream else "client leaves while its answer is generated"
    detail = "slot free again " + (
        f"{freed:.2f} s after the client left" if freed is not None else f"NOT within {bound_s:g} s"
    )
    return Finding(name, "daemon", freed is not None, freed if freed is not None else bound_s, detail)


async def leave_mid_payload(http: aiohttp.ClientSession, prefill: Target, bound_s: float = 30.0) -> Finding:
    """A client asks the prefill server for a payload and hangs up after its first 64 KiB: the server
    must go on answering others."""
    host, port = _host_port(prefill)
    body = json.dumps({"token_ids": list(range(1, 101)), "budget": 1.0})
    request = (
        f"POST {PREFILL} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {prefill.token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    )
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request.encode())
        await writer.drain()
        first = b""
        async with asyncio.timeout(bound_s):
            while len(first) < 65536 and (piece := await reader.read(65536)):  # the headers and some payload
                first += piece
    finally:
        writer.transport.abort()
    served, seconds = await healthy(http, prefill, bound_s)
    detail = (
        f"left after {len(first)} bytes; a plain prefill then: {'served' if served else 'FAILED'} in {seconds:.2f} s"
    )
    return Finding(
        "client leaves mid-payload", "prefill", served and first.startswith(b"HTTP/1.1 200"), seconds, detail
    )


async def flood(http: aiohttp.ClientSession, target: Target, requests: int, bound_s: float = 300.0) -> Finding:
    """``requests`` at once, more than the server's slots and queue hold: each is answered (200, or
    429 ``queue_full`` with a Retry-After), none with a 5xx, none hangs; a plain request after."""
    path, body = _healthy_request(target)
    if target.server == "daemon":
        body = {**body, "max_tokens": 8}
    statuses: collections.Counter[str] = collections.Counter()
    problems: list[str] = []

    async def one() -> None:
        try:
            async with http.post(
                target.url + path, json=body, headers=_auth(target), timeout=aiohttp.ClientTimeout(total=bound_s)
            ) as response:
                data = await response.read()
                statuses[str(response.status)] += 1
                if response.status == 429:
                    code = json.loads(data)["error"]["code"]
                    if code != "queue_full" or "Retry-After" not in response.headers:
                        problems.append(f"a 429 with code {code!r}, Retry-After {response.headers.get('Retry-After')}")
                elif response.status != 200:
                    problems.append(f"status {response.status}: {data[:200]!r}")
        except (TimeoutError, aiohttp.ClientError) as exc:
            statuses["no answer"] += 1
            problems.append(repr(exc))

    started = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(requests)))
    seconds = time.perf_counter() - started
    served, _ = await healthy(http, target)
    ok = not problems and statuses["429"] > 0 and served
    detail = (
        f"{requests} at once: {dict(statuses)} in {seconds:.2f} s; then a plain request "
        f"{'served' if served else 'FAILED'}" + (f"; {problems[:3]}" if problems else "")
    )
    return Finding(f"flood of {requests}", target.server, ok, seconds, detail, statuses)

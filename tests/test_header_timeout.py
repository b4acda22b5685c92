"""Slowloris: a connection whose request headers do not all arrive within the header timeout is closed,
and nothing else is (idle keep-alive connections, slow handlers, slow bodies, long streams).

A tiny app is served through ``header_deadline.start_site``, the code path ``serve_until_stopped`` uses,
and talked to with raw sockets."""

from __future__ import annotations

import asyncio
import logging
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Iterator

import pytest
from aiohttp import web

from edgedecode.serving.header_deadline import start_site
from edgedecode.tls import client_tls, server_tls

TIMEOUT = 0.5  # the server's header timeout in these tests
REQUEST = b"GET /hello HTTP/1.1\r\nHost: test\r\nUser-Agent: drip\r\nAccept: */*\r\n\r\n"


def _app() -> web.Application:
    async def hello(_: web.Request) -> web.Response:
        return web.Response(text="hello")

    async def slow(_: web.Request) -> web.Response:
        await asyncio.sleep(3 * TIMEOUT)
        return web.Response(text="slow done")

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for i in range(4):
            await response.write(f"part{i};".encode())
            await asyncio.sleep(0.3)
        await response.write_eof()
        return response

    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    app = web.Application()
    app.router.add_get("/hello", hello)
    app.router.add_get("/slow", slow)
    app.router.add_get("/stream", stream)
    app.router.add_post("/echo", echo)
    return app


class _Server:
    """The app, served with the header deadline from its own event loop in a thread (HTTPS with ``ssl_context``)."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.runner, site = self.loop.run_until_complete(
                start_site(_app(), "127.0.0.1", 0, header_timeout=TIMEOUT, ssl_context=ssl_context, access_log=None)
            )
            self.port = site.port
            started.set()
            self.loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("the test server did not start")

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    server = _Server()
    yield server.port
    server.stop()


@pytest.fixture(scope="module")
def tls_port(tls_files) -> Iterator[int]:
    server = _Server(server_tls(str(tls_files.cert), str(tls_files.key)))
    yield server.port
    server.stop()


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _closed(sock: socket.socket, wait: float) -> bytes | None:
    """What the server sent before closing, if it closes within ``wait`` seconds; None if it is still open."""
    received = b""
    deadline = time.monotonic() + wait
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            return None
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk
    return None


def _response(sock: socket.socket, wait: float = 5.0) -> bytes:
    """One complete response with a Content-Length body, read within ``wait`` seconds."""
    data = b""
    deadline = time.monotonic() + wait
    while True:
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            length = next(
                int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
            )
            if len(body) >= length:
                return data
        left = deadline - time.monotonic()
        assert left > 0, f"no complete response within {wait} s: {data!r}"
        sock.settimeout(left)
        chunk = sock.recv(4096)
        assert chunk, f"the server closed the connection mid-response: {data!r}"
        data += chunk


def test_dripped_headers_are_cut_after_the_timeout(port: int, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="edgedecode.serving.header_deadline")
    sock = _connect(port)
    started = time.monotonic()
    received, closed_at = b"", None
    with sock:
        for byte in REQUEST:  # 70 bytes at 0.1 s: the whole request would take 7 s
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed_at = time.monotonic()
                break
            got = _closed(sock, 0.1)
            if got is not None:
                received, closed_at = got, time.monotonic()
                break
            if time.monotonic() - started > 4 * TIMEOUT:
                break
    assert closed_at is not None, "a client dripping its headers was still connected after 4x the timeout"
    assert TIMEOUT * 0.8 <= closed_at - started <= TIMEOUT + 0.5
    assert received == b"", "a client whose headers never completed got a response"
    cut = [r for r in caplog.records if "did not arrive within" in r.getMessage()]
    assert len(cut) == 1 and cut[0].levelno == logging.INFO


def test_silent_connection_is_cut_after_the_timeout(port: int) -> None:
    with _connect(port) as sock:
        started = time.monotonic()
        assert _closed(sock, 4 * TIMEOUT) == b"", "a connection that sent nothing stayed open"
        assert time.monotonic() - started >= TIMEOUT * 0.8


def test_idle_keepalive_connection_is_not_cut(port: int) -> None:
    with _connect(port) as sock:
        sock.sendall(REQUEST)
        assert _response(sock).endswith(b"hello")
        assert _closed(sock, 3 * TIMEOUT) is None, "an idle keep-alive connection was cut by the header timer"
        sock.sendall(REQUEST)
        first = _response(sock)
        assert first.startswith(b"HTTP/1.1 200") and first.endswith(b"hello")


def test_pipelined_requests_then_idle_keepalive(port: int) -> None:
    with _connect(port) as sock:
        sock.sendall(REQUEST + REQUEST)
        answers = b""
        deadline = time.monotonic() + 5
        while answers.count(b"hello") < 2 and time.monotonic() < deadline:
            sock.settimeout(deadline - time.monotonic())
            chunk = sock.recv(4096)
            assert chunk, "the server closed a pipelined connection"
            answers += chunk
        assert answers.count(b"HTTP/1.1 200") == 2
        assert _closed(sock, 3 * TIMEOUT) is None, "an idle connection was cut after pipelined requests"
        sock.sendall(REQUEST)
        assert _response(sock).endswith(b"hello")


def test_slow_handler_and_long_stream_are_not_cut(port: int) -> None:
    with _connect(port) as slow, _connect(port) as stream:
        slow.sendall(b"GET /slow HTTP/1.1\r\nHost: test\r\n\r\n")
        stream.sendall(b"GET /stream HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
        streamed = _closed(stream, 5)  # Connection: close, so the response ends with the connection
        assert _response(slow).endswith(b"slow done")
    assert streamed is not None and streamed.startswith(b"HTTP/1.1 200")
    assert all(f"part{i};".encode() in streamed for i in range(4)) and streamed.endswith(b"0\r\n\r\n")


def test_slow_body_after_complete_headers_is_not_cut(port: int) -> None:
    body = b"0123456789"
    with _connect(port) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: test\r\nContent-Length: %d\r\n\r\n" % len(body))
        for byte in body:  # 10 bytes at 0.15 s: 3x the header timeout
            time.sleep(0.15)
            sock.sendall(bytes([byte]))
        assert _response(sock).endswith(body)


def test_unread_body_then_idle_keepalive_is_not_cut(port: int) -> None:
    body = b"0123456789"
    with _connect(port) as sock:  # a refusal before the body is read (405 here, 429 or 401 in the servers)
        sock.sendall(b"POST /hello HTTP/1.1\r\nHost: test\r\nContent-Length: %d\r\n\r\n" % len(body))
        assert _response(sock).startswith(b"HTTP/1.1 405")
        for byte in body:  # the rest of the body, drained by aiohttp after the response, is not a next request
            time.sleep(0.05)
            sock.sendall(bytes([byte]))
        assert _closed(sock, 3 * TIMEOUT) is None, "an idle keep-alive connection was cut after an unread body"
        sock.sendall(REQUEST)
        assert _response(sock).endswith(b"hello")


DRIP_INTERVAL_S = 0.1  # at least this between two bytes of a dripper: its whole request takes 14 header timeouts


def test_many_dripping_connections_are_cut_and_others_served(port: int) -> None:
    """50 clients drip their request a byte every DRIP_INTERVAL_S (or slower, on a loaded machine): had a byte
    re-armed the deadline, each would get its whole request in (len(REQUEST) bytes: 14 timeouts at least) and be
    answered. None is answered, every one is cut before its request is complete, and a normal request sent while
    they drip is served. No wall-clock bound: the margin is the drip's own length, which load only lengthens."""
    count = 50
    selector = selectors.DefaultSelector()
    drippers = [_connect(port) for _ in range(count)]
    try:
        for sock in drippers:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        open_ = set(drippers)
        served = False
        position = 0
        while open_ and position < len(REQUEST):
            for sock in list(open_):
                try:
                    sock.send(REQUEST[position : position + 1])
                except OSError:
                    open_.discard(sock)
                    selector.unregister(sock)
            position += 1
            if not served and position == 2:  # drippers are connected and dripping: a normal request
                with _connect(port) as normal:
                    normal.sendall(REQUEST)
                    assert _response(normal, wait=30).endswith(b"hello")
                served = True
            for key, _ in selector.select(timeout=DRIP_INTERVAL_S):
                try:
                    data = key.fileobj.recv(4096)
                except ConnectionResetError:
                    data = b""
                assert data == b"", "a dripping client got a response"
                open_.discard(key.fileobj)
                selector.unregister(key.fileobj)
    finally:
        selector.close()
        for sock in drippers:
            sock.close()
    assert not open_, f"{len(open_)} of {count} dripping connections still open after dripping all {position} bytes"
    assert position < len(REQUEST), "a dripper got its whole request in"
    assert served


def test_over_tls_a_connection_that_never_starts_its_handshake_is_cut(tls_port: int) -> None:
    with _connect(tls_port) as sock:
        started = time.monotonic()
        assert _closed(sock, 4 * TIMEOUT) == b"", "a TLS connection that sent no ClientHello stayed open"
        assert TIMEOUT * 0.8 <= time.monotonic() - started <= TIMEOUT + 0.5


def test_over_tls_requests_are_answered_and_dripped_headers_cut(tls_port: int, tls_files) -> None:
    context = client_tls(str(tls_files.ca))
    with context.wrap_socket(_connect(tls_port), server_hostname="127.0.0.1") as sock:
        sock.sendall(REQUEST)
        assert _response(sock).endswith(b"hello")
    with context.wrap_socket(_connect(tls_port), server_hostname="127.0.0.1") as sock:
        started = time.monotonic()  # the handshake is over: the header timer runs from here
        sock.sendall(REQUEST[:20])
        assert _closed(sock, 4 * TIMEOUT) == b"", "a TLS client whose headers never completed stayed connected"
        assert TIMEOUT * 0.8 <= time.monotonic() - started <= TIMEOUT + 0.5

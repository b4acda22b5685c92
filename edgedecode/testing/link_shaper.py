"""A bandwidth and latency shaping TCP proxy on loopback, for tests and benchmarks of the KV pull.

``LinkShaper(upstream_host, upstream_port, rate_bytes_per_s=..., delay_s=...)`` listens on
127.0.0.1 (a free port; ``url`` is ``http://127.0.0.1:<port>``) and forwards every connection to the
upstream server, both ways. Every piece read from either side is held back ``delay_s`` after it was
read (a one-way delay, so a round trip takes about ``2 * delay_s`` more); the upstream → client
direction, the one the KV payload flows in, is also paced by a token bucket of ``rate_bytes_per_s``
shared by all connections (one link), whose burst is small (10 ms of the rate, within 4–64 KiB).
``set_rate`` changes the rate at once, also while a transfer is under way (step or random-walk
traces); ``reset_after(n)`` resets the connection that carries the n-th next byte downstream (a
link failure mid-transfer). The client → upstream direction is not rate limited.

The proxy runs its own asyncio event loop in a thread: ``start()`` (also done by the constructor
unless ``start=False``) and ``stop()`` are called from any other thread; ``stop()`` closes the
listening socket and every open connection. Memory is bounded: each direction of a connection queues
at most ``QUEUE_PIECES`` pieces of at most ``PIECE_BYTES`` before it stops reading (TCP backpressure).
Counters: ``connections`` accepted, ``bytes_down`` (upstream → client) and ``bytes_up`` forwarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

PIECE_BYTES = 64 << 10
QUEUE_PIECES = 64
MAX_WAIT_S = 0.05  # a pacing wait is cut into steps this long, so a new rate takes effect soon
_EOF = b""


class TokenBucket:
    """Bytes per second with a small burst; ``take(n)`` waits until ``n`` bytes may go (n ≤ burst)."""

    def __init__(self, rate_bytes_per_s: float) -> None:
        self.rate = float(rate_bytes_per_s)
        self._tokens = self.burst
        self._at = time.monotonic()

    @property
    def burst(self) -> float:
        return min(max(self.rate * 0.01, 4096.0), 65536.0)

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now

    async def take(self, n: int) -> None:
        """Wait until ``n`` bytes may go (at most a burst's worth is waited for: a rate lowered
        meanwhile shrinks the burst, and the rest is owed) and take them."""
        while True:
            self._refill()
            need = min(n, self.burst)
            if self._tokens >= need:
                self._tokens -= n
                return
            await asyncio.sleep(min((need - self._tokens) / self.rate, MAX_WAIT_S))


class LinkShaper:
    """A shaped link from 127.0.0.1:<port> to ``upstream_host:upstream_port`` (see the module docstring)."""

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        rate_bytes_per_s: float,
        delay_s: float = 0.0,
        start: bool = True,
    ) -> None:
        if rate_bytes_per_s <= 0 or delay_s < 0:
            raise ValueError("need rate_bytes_per_s > 0 and delay_s >= 0")
        self.upstream = (upstream_host, upstream_port)
        self.delay_s = float(delay_s)
        self.connections = 0
        self.bytes_down = 0
        self.bytes_up = 0
        self.port = 0
        self._rate = float(rate_bytes_per_s)
        self._reset_at: int | None = None  # bytes_down at which the connection sending is reset
        self._bucket: TokenBucket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        if start:
            self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def rate_bytes_per_s(self) -> float:
        return self._rate

    def set_rate(self, rate_bytes_per_s: float) -> None:
        """Change the upstream → client rate now (from any thread)."""
        if rate_bytes_per_s <= 0:
            raise ValueError("need rate_bytes_per_s > 0")
        self._rate = float(rate_bytes_per_s)
        loop, bucket = self._loop, self._bucket
        if loop is not None and bucket is not None:
            loop.call_soon_threadsafe(setattr, bucket, "rate", self._rate)

    def reset_after(self, n_bytes: int) -> None:
        """Reset (abort) the connection that carries the ``n_bytes``-th byte downstream from now, once:
        the client gets the bytes before it, then a reset. Thread-safe enough for tests: one writer."""
        self._reset_at = self.bytes_down + n_bytes

    def start(self, timeout_s: float = 10.0) -> None:
        if self._thread is not None:
            raise RuntimeError("the shaper was started already")
        self._thread = threading.Thread(target=self._run, name="link-shaper", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError("the link shaper did not start")
        if self._error is not None:
            raise RuntimeError(f"the link shaper did not start: {self._error}") from self._error

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close the listening socket and every connection, and end the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        with contextlib.suppress(RuntimeError):  # the loop may have stopped meanwhile
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout_s)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout_s)

    def __enter__(self) -> LinkShaper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- on the shaper's loop -------------------------------------------------------------------

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            self._bucket = TokenBucket(self._rate)
            self._server = loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
            self.port = self._server.sockets[0].getsockname()[1]
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        upstream_writer: asyncio.StreamWriter | None = None
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
            pumps = [
                asyncio.create_task(self._pump(client_reader, upstream_writer, shaped=False)),
                asyncio.create_task(self._pump(upstream_reader, client_writer, shaped=True)),
            ]
            try:  # until both directions ended, or one failed (a reset): then the other goes too
                await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
            finally:
                for pump in pumps:
                    pump.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        except OSError:
            pass  # the upstream refused: the client's connection is closed below
        except asyncio.CancelledError:
            pass  # stop(): this task ends here (asyncio's stream callback would log a cancelled one)
        finally:
            self._tasks.discard(task)
            for writer in (client_writer, upstream_writer):
                if writer is not None:
                    writer.close()
                    with contextlib.suppress(OSError, asyncio.CancelledError):
                        await writer.wait_closed()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, shaped: bool) -> None:
        """Forward ``reader`` to ``writer``: each piece no sooner than ``delay_s`` after it was read,
        and (``shaped``) paced by the bucket; half-closes ``writer`` at the end of ``reader``."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_PIECES)
        loop = asyncio.get_running_loop()

        async def read() -> None:
            try:
                while True:
                    piece = await reader.read(PIECE_BYTES)
                    await queue.put((loop.time(), piece))
                    if not piece:
                        return
            except OSError:
                await queue.put((loop.time(), _EOF))

        reading = asyncio.create_task(read())
        try:
            while True:
                read_at, piece = await queue.get()
                wait = read_at + self.delay_s - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not piece:
                    if writer.can_write_eof():
                        with contextlib.suppress(OSError):
                            writer.write_eof()
                    return
                await self._send(writer, piece, shaped)
        finally:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading

    async def _send(self, writer: asyncio.StreamWriter, piece: bytes, shaped: bool) -> None:
        view = memoryview(piece)
        while view:
            bucket = self._bucket
            # half a burst at a time: what a late wake-up accrues is not lost to the burst cap
            size = len(view) if not shaped or bucket is None else min(len(view), int(bucket.burst) // 2)
            if shaped and bucket is not None:
                await bucket.take(size)
            if shaped and self._reset_at is not None and self.bytes_down + size >= self._reset_at:
                size = self._reset_at - self.bytes_down
                self._reset_at = None
                writer.write(view[:size])
                self.bytes_down += size
                with contextlib.suppress(OSError):
                    await writer.drain()
                writer.transport.abort()
                raise ConnectionResetError("the link shaper reset the connection (reset_after)")
            if shaped:  # counted before it is written: a reader that got it sees it counted
                self.bytes_down += size
            else:
                self.bytes_up += size
            writer.write(view[:size])
            await writer.drain()
            view = view[size:]

"""The decode daemon's one onnxruntime thread: every active generation takes one step in turn.

Generations are Python iterators (``Engine.generate``); the worker advances each by one token per
turn, round-robin, so concurrent requests share the device token by token and none waits for
another to finish. A generation that yields None is waiting for something outside the worker (its
KV still arriving): nothing is delivered, and it gets its turn again; when every active generation
waits, the worker sleeps ``PENDING_SLEEP_S`` between rounds rather than spin. Tokens go back to
the event loop through ``call_soon_threadsafe``; a consumer that reads slowly only lets its own
queue grow (bounded by its max_tokens), it never stalls the loop or the worker.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator

logger = logging.getLogger(__name__)
_DONE = object()
PENDING_SLEEP_S = 0.002


class Generation:
    """One submitted iterator and the asyncio queue its items are delivered to."""

    def __init__(self, steps: Iterator, loop: asyncio.AbstractEventLoop, on_done: Callable[[], None] | None) -> None:
        self._steps = steps
        self._loop = loop
        self._on_done = on_done
        self._queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.pending = False  # its last step yielded None: it waits for something outside the worker

    def cancel(self) -> None:
        """Stop at the next turn (the client went away); thread-safe."""
        self.cancelled = True

    def _deliver(self, item) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _end(self, item) -> None:
        """Run ``on_done``, then deliver the last item (the end, or an exception), in one loop callback:
        whoever sees the end also sees what ``on_done`` did (a slot released before the next request)."""
        self._loop.call_soon_threadsafe(self._finish, item)

    def _finish(self, item) -> None:
        try:
            if self._on_done is not None:
                self._on_done()
        finally:
            self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator:
        """The items as they come; re-raises the iterator's exception."""
        while True:
            item = await self._queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class DecodeWorker:
    """The thread that runs every generation, one step per turn."""

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue[Generation | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="edgedecode-decode", daemon=True)
        self.active = 0
        self.last_step = time.monotonic()  # when the worker last finished a step (watchdog)
        self._thread.start()

    def submit(self, steps: Iterator, on_done: Callable[[], None] | None = None) -> Generation:
        """Start running ``steps`` (call on the event loop); iterate the result for its items.
        ``on_done`` runs on the event loop once the worker is finished with ``steps`` (ended, failed
        or cancelled): only then may what they use be reused."""
        generation = Generation(steps, asyncio.get_running_loop(), on_done)
        self._inbox.put(generation)
        return generation

    def healthy(self, stall_seconds: float) -> bool:
        """Alive, and either idle or making progress within ``stall_seconds``."""
        return self._thread.is_alive() and (self.active == 0 or time.monotonic() - self.last_step < stall_seconds)

    def stop(self) -> None:
        """Finish after the current step; pending generations are closed."""
        self._inbox.put(None)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        active: deque[Generation] = deque()
        waiting = 0  # generations in a row that yielded None
        while True:
            try:
                while True:  # take everything submitted; block only when there is nothing to run
                    item = self._inbox.get(block=not active)
                    if item is None:
                        for generation in active:
                            self._close(generation)
                        return
                    active.append(item)
                    self.active = len(active)
            except queue.Empty:
                pass
            generation = active.popleft()
            if generation.cancelled:
                self._close(generation)
            elif self._step(generation):
                active.append(generation)
            self.active = len(active)
            self.last_step = time.monotonic()
            waiting = waiting + 1 if generation.pending else 0
            if active and waiting >= len(active):  # a whole round of generations waiting
                time.sleep(PENDING_SLEEP_S)
                waiting = 0

    def _step(self, generation: Generation) -> bool:
        """Advance one item; False once the generation is over."""
        try:
            item = next(generation._steps)
            generation.pending = item is None
            if item is not None:
                generation._deliver(item)
            return True
        except StopIteration:
            generation._end(_DONE)
        except Exception as exc:  # delivered to the request; the worker goes on with the others
            logger.exception("generation failed")
            generation._end(exc)
        return False

    @staticmethod
    def _close(generation: Generation) -> None:
        close = getattr(generation._steps, "close", None)
        if close is not None:
            close()
        generation._end(_DONE)

"""KV slots of the decode daemon and the fair, bounded queue of requests waiting for one.

A slot is one decode engine's KV buffers (all engines share one onnxruntime session). A
conversation (session id) keeps its slot between turns while the slot is idle, so its next turn
reuses the KV it holds; when every slot is taken by other conversations, the least recently used
idle one is reassigned. KV is reused only within a conversation: a request's answer never depends
on what other conversations ran before it (their prefix KV was quantized for other prompts).
Waiting requests are served round-robin across clients, first come first served within a client,
so one client's burst cannot starve the others. A turn holds its slot as a ``SlotLease``.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

import numpy as np

from edgedecode.errors import ServerBusyError
from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.runtime.engine import GenerationStats
from edgedecode.runtime.handoff import KVSource, StreamedKV
from edgedecode.runtime.logprobs import ScoredRun, ScoredToken
from edgedecode.runtime.sampler import SamplingParams

if TYPE_CHECKING:  # the type only: llguidance is imported where grammars are made
    from edgedecode.runtime.constraint import TokenMask


class DecodeEngine(Protocol):
    """What the daemon's pipeline uses of a slot's engine (``runtime.engine.Engine`` is the real one)."""

    @property
    def max_context(self) -> int: ...

    @property
    def length(self) -> int:
        """Cache slots in use (resident KV)."""
        ...

    @property
    def kv_bytes_per_slot(self) -> int: ...

    @property
    def kv_preallocated(self) -> bool:
        """Whether the KV buffers are allocated whole from the start (then reserved whole)."""
        ...

    @property
    def held_positions(self) -> np.ndarray:
        """The true position of each held token, one per cache slot in use."""
        ...

    def reset(self) -> None:
        """Forget the cached context."""
        ...

    def evict(self, positions: np.ndarray) -> None:
        """Drop the KV of the held tokens at ``positions``."""
        ...

    def release_unused(self) -> None:
        """Give back the memory of the KV buffer past the slots in use."""
        ...

    @property
    def stats(self) -> GenerationStats:
        """What the last generation did (complete once its iterator is exhausted)."""
        ...

    def reusable_prefix(self, prompt_ids: np.ndarray) -> int: ...

    def restore(self, prompt_ids: np.ndarray, payload: bytes | bytearray | memoryview) -> int:
        """Take a kept conversation's KV back from its EDKV payload; returns the positions to keep."""
        ...

    def export_positions(self) -> tuple[KVSnapshot, np.ndarray]:
        """The held KV over every position processed, and which positions it holds."""
        ...

    def given_importance(self) -> np.ndarray:
        """The importance that came with each position's KV, NaN where none came."""
        ...

    @property
    def windowed_from(self) -> int:
        """The first position whose KV the windowed layers hold too (0: all)."""
        ...

    @property
    def windowed_tail(self) -> int:
        """Tokens at the end of a held context that nothing may drop (the windowed tail; 0: no windows)."""
        ...

    def open_kv_stream(self, prompt_ids: np.ndarray, keep: int = 0, head: int = 0) -> StreamedKV: ...

    def compute_head(self, stream: StreamedKV) -> None:
        """Run a split stream's head positions through the graph (on the worker thread)."""
        ...

    def generate(
        self,
        prompt_ids: np.ndarray,
        params: SamplingParams,
        kv: KVSource = None,
        keep: int = 0,
        *,
        constraint: TokenMask | None = None,
    ) -> Iterator[int]: ...

    def generate_scored(
        self,
        prompt_ids: np.ndarray,
        params: SamplingParams,
        kv: KVSource = None,
        keep: int = 0,
        *,
        top: int = 0,
        constraint: TokenMask | None = None,
    ) -> Iterator[ScoredToken]:
        """``generate``, each token with its log-probability and the ``top`` most likely tokens'."""
        ...

    def score_prompt(self, prompt_ids: np.ndarray, top: int = 0) -> Iterator[ScoredRun]:
        """Compute the prompt but its last token here, yielding its tokens' log-probabilities run by run."""
        ...


class QueueFullError(ServerBusyError):
    """Too many requests are waiting for a slot."""


@dataclass(eq=False)
class Slot:
    """One engine's KV buffers and the conversation that holds them."""

    engine: DecodeEngine
    index: int
    session_id: str | None = None
    resumed: bool = False  # taken by the conversation that held it before: its KV may be reused
    previous_session: str | None = None  # taken from this conversation, whose KV it still holds
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class _Waiter:
    session_id: str | None
    future: asyncio.Future


class SlotPool:
    """Hands out slots to requests, fairly across clients, with at most ``max_queue`` waiting."""

    def __init__(self, engines: Sequence[DecodeEngine], max_queue: int) -> None:
        self.slots = [Slot(engine, i) for i, engine in enumerate(engines)]
        self.max_queue = max_queue
        self._waiting: OrderedDict[str, deque[_Waiter]] = OrderedDict()  # by client, in turn order

    @property
    def queued(self) -> int:
        return sum(len(waiters) for waiters in self._waiting.values())

    @property
    def busy(self) -> int:
        return sum(slot.busy for slot in self.slots)

    async def acquire(self, client: str, session_id: str | None) -> Slot:
        """A slot for this request: the conversation's own when it is idle, else a free or the least
        recently used idle one; waits its turn when all are busy.

        Raises:
            QueueFullError: ``max_queue`` requests are already waiting.
        """
        if not self._waiting:
            slot = self._pick(session_id)
            if slot is not None:
                return self._take(slot, session_id)
        if self.queued >= self.max_queue:
            raise QueueFullError(f"{self.queued} requests are waiting for a decode slot (limit {self.max_queue})")
        waiter = _Waiter(session_id, asyncio.get_running_loop().create_future())
        self._waiting.setdefault(client, deque()).append(waiter)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release(waiter.future.result())  # handed a slot just as the request went away
            else:
                self._forget(client, waiter)
            raise

    def release(self, slot: Slot) -> None:
        """Give the slot back (the conversation keeps its KV in it) and serve the next waiter."""
        slot.busy = False
        slot.last_used = time.monotonic()
        while self._waiting:
            client, waiters = next(iter(self._waiting.items()))
            candidate = self._pick(waiters[0].session_id)
            if candidate is None:
                return
            waiter = waiters.popleft()
            del self._waiting[client]
            if waiters:  # the client goes to the back of the round
                self._waiting[client] = waiters
            if not waiter.future.done():
                waiter.future.set_result(self._take(candidate, waiter.session_id))

    def _pick(self, session_id: str | None) -> Slot | None:
        idle = [slot for slot in self.slots if not slot.busy]
        if not idle:
            return None
        if session_id is not None:
            for slot in idle:
                if slot.session_id == session_id:
                    return slot
        free = [slot for slot in idle if slot.session_id is None]
        return free[0] if free else min(idle, key=lambda slot: slot.last_used)

    @staticmethod
    def _take(slot: Slot, session_id: str | None) -> Slot:
        slot.busy = True
        slot.resumed = session_id is not None and slot.session_id == session_id
        slot.previous_session = None if slot.resumed else slot.session_id
        slot.session_id = session_id
        return slot

    def idle_held(self) -> list[Slot]:
        """Idle slots holding a conversation's KV, least recently used first."""
        return sorted((s for s in self.slots if not s.busy and s.session_id is not None), key=lambda s: s.last_used)

    def hold(self, slot: Slot) -> None:
        """Mark an idle slot busy (its KV is being moved out) until ``release``."""
        if slot.busy:
            raise RuntimeError("the slot is in use")
        slot.busy = True

    def _forget(self, client: str, waiter: _Waiter) -> None:
        waiters = self._waiting.get(client)
        if waiters is not None and waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self._waiting[client]


class SlotLease:
    """One turn's hold on a slot of ``pool``: ``async with lease as slot`` waits its turn for one
    (``SlotPool.acquire``; QueueFullError past ``max_queue``) and gives it back on the way out, its
    KV memory reservation settled first (``settle``), so the next waiter is served.

    Leaving on an exception (the turn failed, or went away while its KV was arriving), or with
    ``ingest_may_write`` set, gives the slot back only once the ``ingest`` thread is done with what
    it was handed: it may still be writing into the slot's buffers.
    """

    def __init__(
        self,
        pool: SlotPool,
        client: str,
        session_id: str | None,
        *,
        settle: Callable[[Slot], None],
        ingest: Executor,
    ) -> None:
        self._pool = pool
        self._client = client
        self._session_id = session_id
        self._settle = settle
        self._ingest = ingest
        self._slot: Slot | None = None
        self.ingest_may_write = False  # a fetch into the slot was cancelled: its last piece may still be fed

    async def __aenter__(self) -> Slot:
        self._slot = await self._pool.acquire(self._client, self._session_id)
        return self._slot

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if exc_type is None and not self.ingest_may_write:
            self._give_back()
            return
        done = asyncio.get_running_loop().run_in_executor(self._ingest, _nothing)
        done.add_done_callback(lambda _: self._give_back())
        if exc_type is None:  # a turn that leaves normally returns once its slot is back
            await asyncio.wait([done])

    def _give_back(self) -> None:
        slot = self._slot
        assert slot is not None, "given back once, after it was taken"
        self._slot = None
        self._settle(slot)
        self._pool.release(slot)


def _nothing() -> None:
    """What the ingest thread runs before a lease that may have left it writing gives its slot back."""

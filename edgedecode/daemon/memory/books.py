"""The books of the decode daemon's KV memory: ``daemon.kv_memory_mb`` counted over the conversations
the store keeps compressed and every decode slot's reservation (``MemoryLedger`` adds a turn's calls).

Bytes that do not fit make room through the pressure ladder's rungs over the stored conversations, in
order, each only as far as needed (the ledger's module docstring numbers the whole ladder):

2. re-tier the stored conversations, least recently stored first (``ConversationStore.retier``): to INT4
   over all of them, then from INT4 to INT3 (rotated) over all of them;
3. drop their least important tokens (``ConversationStore.drop``);
4. evict them (``ConversationStore.evict``), counted.

A re-encode (rungs 2 and 3) holds its scratch as working memory (``memory.working``); where that does
not fit, the ladder goes on to its next rung. The books may be called from any thread: those that add
bytes (``reserve``, ``keep``, ``put``, ``make_room``) one at a time; they encode, so the daemon calls
them on its ingest thread.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import Executor

import numpy as np

from edgedecode.daemon.memory.conversation import (
    DEFAULT_TIER,
    RETIER_TIERS,
    LadderStep,
    StoredConversation,
    reencode_scratch_nbytes,
)
from edgedecode.daemon.memory.store import ConversationStore
from edgedecode.daemon.memory.working import KVMemoryError, WorkingMemory
from edgedecode.daemon.metrics import ConversationMetrics
from edgedecode.daemon.slots import SlotPool
from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.kv.tiers import Tier


class MemoryBooks:
    """The KV memory budget over ``pool``'s slots and ``store`` (see the module docstring).

    Args:
        store: the compressed conversations; at most ``store.max_sessions`` conversations are kept,
            resident or compressed.
        pool: the slots (none: a budget over stored conversations only).
        budget_bytes: ``daemon.kv_memory_mb``.
        reserve_bytes: ``daemon.memory_reserve_mb``.
        ingest: the thread that writes into the slots' KV and does every KV encode (None: asyncio's default).
        metrics: where sessions, KV memory and the ladder are counted (None: nowhere).
        working_bytes: ``daemon.working_memory_mb`` (None: working memory counted, never refused).
        prompt_run_bytes: a prompt run's working memory by (rows, past) (``runtime.runner.prompt_run_bytes``
            for the model; None: the turns' prompt runs hold none).

    Raises:
        KVMemoryError: the slots' KV buffers, allocated whole up front (CUDA), exceed the budget.
    """

    def __init__(
        self,
        store: ConversationStore,
        pool: SlotPool,
        *,
        budget_bytes: int,
        reserve_bytes: int = 0,
        ingest: Executor | None = None,
        metrics: ConversationMetrics | None = None,
        working_bytes: int | None = None,
        prompt_run_bytes: Callable[[int, int], int] | None = None,
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.store = store
        self.pool = pool
        self.budget_bytes = budget_bytes
        self.reserve_bytes = reserve_bytes
        self._ingest = ingest
        self._metrics = metrics
        self.working = WorkingMemory(working_bytes)
        self._prompt_run_bytes = prompt_run_bytes
        self.bytes_per_slot_token = pool.slots[0].engine.kv_bytes_per_slot if pool.slots else 0
        self._reservations = {slot.index: 0 for slot in pool.slots}
        self._carried = 0  # bytes of conversations taken from the store for a slot, not yet in it
        self._peak_nbytes = 0  # the most nbytes has been (edgedecode_kv_memory_peak_bytes)
        self._lock = threading.Lock()  # the counts above
        self._growing = threading.Lock()  # one call that adds bytes at a time
        self._floor = {
            s.index: s.engine.max_context * self.bytes_per_slot_token * s.engine.kv_preallocated for s in pool.slots
        }
        if sum(self._floor.values()) > budget_bytes:
            raise KVMemoryError(
                f"the {len(pool.slots)} slots' KV buffers, allocated whole on the device, take "
                f"{_mib(sum(self._floor.values()))}: more than daemon.kv_memory_mb ({_mib(budget_bytes)}); "
                "raise it, or lower daemon.slots or daemon.max_context"
            )
        for slot in pool.slots:
            self.reserve(slot.index, self._floor[slot.index])
        if metrics is not None:
            for state, busy in (("active", True), ("resident", False)):
                metrics.sessions.labels(state).set_function(functools.partial(self._sessions, busy))
                metrics.kv_memory.labels(state).set_function(functools.partial(self._held, busy))
            metrics.working_memory.set_function(lambda: self.working.nbytes)
            if working_bytes is not None:
                metrics.working_memory_allowance.set(working_bytes)
            metrics.working_memory_peak.set_function(lambda: self.working.peak_nbytes)

    @property
    def nbytes(self) -> int:
        """Bytes counted against the budget: stored conversations and reservations."""
        return self.store.nbytes + self.reserved_nbytes

    @property
    def compressed_nbytes(self) -> int:
        return self.store.nbytes

    @property
    def reserved_nbytes(self) -> int:
        """Bytes reserved for the slots' KV (and conversations on their way into a slot)."""
        return sum(self._reservations.values()) + self._carried

    def reserved(self, slot: int) -> int:
        """Bytes reserved for slot ``slot``'s KV."""
        return self._reservations.get(slot, 0)

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit the budget as it is, without the ladder."""
        return self.nbytes + nbytes <= self.budget_bytes

    def make_room(self, nbytes: int) -> list[LadderStep]:
        """The ladder's rungs over the stored conversations (2 to 4), until ``nbytes`` more fit.

        Returns:
            What the rungs did, in order (empty when they already fit).

        Raises:
            KVMemoryError: even evicting every stored conversation leaves too little; nothing is changed.
        """
        with self._growing:
            return self._make_room(nbytes)

    def reserve(self, slot: int, nbytes: int) -> list[LadderStep]:
        """``make_room(nbytes)``, then count ``nbytes`` for slot ``slot``'s KV until ``release``."""
        with self._growing:
            steps = self._make_room(nbytes)
            with self._lock:
                self._reservations[slot] = self._reservations.get(slot, 0) + nbytes
            self._publish()
        return steps

    def release(self, slot: int, nbytes: int) -> None:
        """Give back ``nbytes`` of slot ``slot``'s reservation."""
        with self._lock:
            held = self._reservations.get(slot, 0)
            if not 0 <= nbytes <= held:
                raise ValueError(f"cannot release {nbytes} bytes: {held} are reserved")
            self._reservations[slot] = held - nbytes

    def keep(self, entry: StoredConversation, max_sessions: int | None = None) -> list[LadderStep]:
        """Keep ``entry`` in the store (``ConversationStore.add``), then run rungs 2 to 4 as far as the
        budget needs; the conversation itself is re-tiered, trimmed and, as the very last resort,
        evicted like any other. Returns what the store did, in order."""
        with self._growing:
            steps = self.store.add(entry, max_sessions)
            steps += self._relieve(0)
            self._publish()
        return steps

    def put(
        self,
        session_id: str,
        snapshot: KVSnapshot,
        importance: np.ndarray | None = None,
        tiers: Tier | np.ndarray = DEFAULT_TIER,
        window_from: int = 0,
    ) -> list[LadderStep]:
        """Compress ``snapshot`` as the conversation's KV (``ConversationStore.compress``), then ``keep`` it."""
        return self.keep(self.store.compress(session_id, snapshot, importance, tiers, window_from))

    def _make_room(self, nbytes: int) -> list[LadderStep]:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if self.reserved_nbytes + nbytes > self.budget_bytes:
            raise KVMemoryError(
                f"{_mib(nbytes)} more of KV do not fit the KV memory budget of {_mib(self.budget_bytes)} "
                f"(daemon.kv_memory_mb) even with every idle conversation evicted: {_mib(self.reserved_nbytes)} "
                "are reserved (the decode slots' KV)"
            )
        return self._relieve(nbytes)

    def _relieve(self, nbytes: int) -> list[LadderStep]:
        """Rungs 2 to 4, each over the stored conversations, least recently put first, repeated while
        it frees something, until ``nbytes`` more fit."""
        store = self.store

        def retier_to(tier: Tier) -> Callable[[str, int], LadderStep | None]:
            return lambda session, _: self._reencoding(session, lambda: store.retier(session, tier))

        rungs: tuple[Callable[[str, int], LadderStep | None], ...] = (
            *(retier_to(tier) for tier in RETIER_TIERS),
            lambda session, shortfall: self._reencoding(session, lambda: store.drop(session, shortfall)),
            lambda session, _: store.evict(session, "memory"),
        )
        steps: list[LadderStep] = []
        for rung in rungs:
            freed = True
            while freed:
                freed = False
                for session in store.sessions():
                    with self._lock:
                        shortfall = self.nbytes + nbytes - self.budget_bytes
                    if shortfall <= 0:
                        return steps
                    step = rung(session, shortfall)
                    if step is not None:
                        steps.append(step)
                        freed = True
        return steps

    def _reencoding(self, session: str, rung: Callable[[], LadderStep | None]) -> LadderStep | None:
        """``rung()``, a re-encode of the stored ``session``, with its scratch held as working memory;
        None (nothing done: the ladder goes on to its next rung) where the scratch does not fit."""
        entry = self.store.peek(session)
        if entry is None:
            return None
        try:
            with self.working.scratch(reencode_scratch_nbytes(entry), "re-encoding a kept conversation"):
                return rung()
        except KVMemoryError:
            return None

    def _publish(self) -> None:
        self._peak_nbytes = max(self._peak_nbytes, self.nbytes)
        if self._metrics is not None:
            self._metrics.kv_memory_peak.set(self._peak_nbytes)

    def _sessions(self, busy: bool) -> int:
        return sum(slot.busy == busy and slot.session_id is not None for slot in self.pool.slots)

    def _held(self, busy: bool) -> int:
        return sum(self.reserved(slot.index) for slot in self.pool.slots if slot.busy == busy)


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"

"""The decode daemon's KV memory, kept in one ledger: ``daemon.kv_memory_mb`` (the KV of every
conversation the daemon keeps, in its slots and compressed in the store), ``daemon.memory_reserve_mb``
(system memory a turn must leave available), every slot's reservation, the pressure ladder, and the
working memory of turns and of the ingest thread against ``daemon.working_memory_mb`` (``memory.working``).

A turn reserves, for its slot, the bytes of the KV it will hold: the slots its kept prefix holds, its
new prompt tokens and its completion, before anything is fetched (``admit``); when it ends the
reservation shrinks to the KV the slot holds (``settle``; on CPU the buffer's pages past it go back
to the OS, so the process's memory follows the reservations). On CUDA a slot's KV buffers are
allocated whole at start: each slot reserves all of it for good, and only compressed conversations
come and go. A conversation whose slot is taken by another keeps its KV, compressed (INT8), and its
next turn takes it back through the engine's EDKV reader (``resume``), so that turn pulls or computes
only its new tokens.

When a turn's room does not fit, the ladder runs its rungs in order, each only as far as needed:

1. idle conversations resident in their slots are compressed into the store, least recently used first;
2. re-tier the stored conversations, least recently stored first (``ConversationStore.retier``);
3. drop their least important tokens (``ConversationStore.drop``);
4. evict them (``ConversationStore.evict``), counted;
5. the turn's own conversation loses the KV of its least important kept tokens (sinks and the
   windowed tail stay; ranked as in the store: importance from the pull, else position), so a
   conversation longer than the budget goes on as a window with attention sinks.

What still does not fit is a 503 naming the budget (``KVMemoryError``), before anything was fetched;
so is a turn whose KV would eat into ``memory_reserve_mb``, or whose prompt runs do not fit the
working memory left beside the other turns'.

Threads: ``admit``, ``resume`` and ``settle`` run on the event loop; everything that encodes, decodes
or writes KV (exports, restores, evictions, and rungs 2-4, which re-encode) runs on the ingest
thread, so the loop never waits on it. The books (the public methods without ``async``) may be called
from any thread: those that add bytes (``reserve``, ``keep``, ``put``, ``make_room``) one at a time.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np
import psutil

from edgedecode.daemon.memory.conversation import (
    DEFAULT_TIER,
    LadderStep,
    StoredConversation,
    own_drop_order,
    reencode_scratch_nbytes,
    restore_scratch_nbytes,
)
from edgedecode.daemon.memory.store import ConversationStore
from edgedecode.daemon.memory.working import KVMemoryError, WorkingMemory
from edgedecode.daemon.metrics import ConversationMetrics
from edgedecode.daemon.slots import Slot, SlotPool
from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire import KVFormatError
from edgedecode.runtime.engine import PREFILL_CHUNK_TOKENS
from edgedecode.runtime.kvcache import KVInjectionError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resume:
    """Where a turn's conversation found its earlier KV."""

    keep: int  # prompt positions the slot holds for the turn (its KV is reused)
    how: str  # "new" (none), "resident" (in its slot), "compressed" (back from the store) or "evicted"
    restored_tiers: dict[str, int] = field(default_factory=dict)  # tokens per tier the store kept them at


class MemoryLedger:
    """The daemon's KV memory over ``pool``'s slots and ``store`` (see the module docstring).

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

    # --- the books ----------------------------------------------------------------------------------

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
        rungs: tuple[Callable[[str, int], LadderStep | None], ...] = (
            lambda session, _: self._reencoding(session, lambda: store.retier(session)),
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

    # --- a turn's calls (on the event loop) ---------------------------------------------------------

    async def resume(self, slot: Slot, session_id: str | None, prompt_ids: np.ndarray, *, reuse: bool = True) -> Resume:
        """What ``slot`` holds of the conversation ``session_id`` for a turn of ``prompt_ids``. A slot
        taken from another conversation first keeps that one's KV compressed (when the store keeps
        any), then takes this conversation's compressed KV, if the store has it, back into the slot;
        a payload refused for this prompt is discarded and the reason logged ("compressed", 0 kept).
        ``reuse`` False: the turn keeps nothing of it (it computes its whole prompt)."""
        if slot.resumed:
            keep = slot.engine.reusable_prefix(prompt_ids) if reuse else 0
            return Resume(keep, "resident" if keep else "new")
        # Taken first, so that keeping the slot's previous conversation does not count it against
        # max_sessions; its bytes stay counted (carried) until it is restored.
        entry = self._take(session_id) if session_id is not None else None
        carried = 0 if entry is None else entry.nbytes
        try:
            previous, slot.previous_session = slot.previous_session, None
            await self._move_out(slot, previous)
            with self._lock:  # the slot carries them now (settle gives them back)
                self._carried -= carried
                self._reservations[slot.index] += carried
            carried = 0
            if entry is None:
                evicted = session_id is not None and self.store.evicted(session_id)
                return Resume(0, "evicted" if evicted else "new")
            resumed = await self._restore(slot, entry, prompt_ids)
            return resumed if reuse else Resume(0, resumed.how, resumed.restored_tiers)
        finally:
            if carried:
                with self._lock:
                    self._carried -= carried

    async def admit(self, slot: Slot, keep: int, new_tokens: int) -> int:
        """Reserve room for ``slot`` to hold the KV of the prompt's first ``keep`` positions (what it
        holds of them) and ``new_tokens`` more (the rest of the prompt and the completion), climbing
        the ladder as far as needed; returns how many of the conversation's own kept tokens the last
        rung evicted (0 almost always).

        Raises:
            KVMemoryError: the new KV would leave less than ``memory_reserve_mb`` of system memory
                available, or it cannot fit even with every other conversation compressed and
                evicted and this one's droppable kept tokens evicted (503).
        """
        self._check_available(new_tokens * self.bytes_per_slot_token)
        if self._prompt_run_bytes is not None and new_tokens > 0:
            rows = min(PREFILL_CHUNK_TOKENS, new_tokens)
            self.working.hold_turn(slot.index, self._prompt_run_bytes(rows, keep + new_tokens))
        evicted = 0
        while True:
            kept_slots = int(np.searchsorted(slot.engine.held_positions, keep))
            need = (kept_slots + new_tokens) * self.bytes_per_slot_token - self.reserved(slot.index)
            try:
                await self._reserve(slot, need)
                return evicted
            except KVMemoryError:
                if evicted:
                    raise  # the last rung ran once, as far as the budget needed: it did not fit after all
                evicted = await self._evict_own_tokens(slot, kept_slots, need)
                if not evicted:
                    raise

    def settle(self, slot: Slot) -> None:
        """Shrink ``slot``'s reservation to the KV it holds now (a turn ended, or failed)."""
        held = max(slot.engine.length * self.bytes_per_slot_token, self._floor[slot.index])
        reserved = self.reserved(slot.index)
        if reserved > held:
            self.release(slot.index, reserved - held)
        self.working.release_turn(slot.index)
        slot.engine.release_unused()

    def _check_available(self, need: int) -> None:
        """Refuse KV that would eat into the system memory reserve (``memory_reserve_mb``)."""
        available = psutil.virtual_memory().available
        if available - need < self.reserve_bytes:
            raise KVMemoryError(
                f"not enough memory for this request: its KV needs {need >> 20} MiB, "
                f"{available >> 20} MiB are available and {self.reserve_bytes >> 20} MiB are kept in reserve"
            )

    async def _reserve(self, slot: Slot, need: int) -> None:
        """Add ``need`` bytes to ``slot``'s reservation, through the ladder short of its last rung."""
        if need <= 0:
            return
        await self._compress_idle_until_fits(need)
        loop = asyncio.get_running_loop()
        self._log(await loop.run_in_executor(self._ingest, self.reserve, slot.index, need))

    async def _compress_idle_until_fits(self, nbytes: int) -> None:
        """Rung 1: while ``nbytes`` more do not fit the budget as it is, move idle resident
        conversations (least recently used first) into the store."""
        while not self.fits(nbytes):
            idle = self.pool.idle_held()
            if not idle:
                return
            slot = idle[0]
            self.pool.hold(slot)
            try:
                session, slot.session_id = slot.session_id, None
                await self._move_out(slot, session)
            finally:
                self.pool.release(slot)

    async def _evict_own_tokens(self, slot: Slot, kept_slots: int, need: int) -> int:
        """Rung 5: evict the least important of the slot's first ``kept_slots`` tokens, as many as
        the budget needs once every compressed conversation is gone; returns how many (0, and
        nothing evicted, when even all its droppable tokens would not do)."""
        engine = slot.engine
        count = -(-(self.reserved_nbytes + need - self.budget_bytes) // self.bytes_per_slot_token)
        positions = np.asarray(engine.held_positions[:kept_slots])
        evicted = own_drop_order(positions, engine.given_importance()[positions], engine.windowed_tail, count)
        if evicted is None:
            return 0
        await asyncio.get_running_loop().run_in_executor(self._ingest, engine.evict, evicted)
        if self._metrics is not None:
            self._metrics.active_evicted.inc(count)
        logger.warning(
            "KV memory: evicted %d of the %d kept tokens of the active conversation %s to fit daemon.kv_memory_mb",
            count,
            kept_slots,
            slot.session_id,
        )
        return count

    def _take(self, session_id: str) -> StoredConversation | None:
        """The conversation out of the store, its bytes still counted (carried) until a slot holds them."""
        with self._lock:
            entry = self.store.take(session_id)
            if entry is not None:
                self._carried += entry.nbytes
        return entry

    async def _restore(self, slot: Slot, entry: StoredConversation, prompt_ids: np.ndarray) -> Resume:
        counts = np.bincount(entry.tiers, minlength=len(Tier))
        tiers = {tier.name: int(counts[tier]) for tier in Tier if counts[tier]}
        try:  # its KV as the slot holds it (nothing more where the slot's buffers are reserved whole)
            await self._reserve(slot, entry.n_kept * self.bytes_per_slot_token - self._floor[slot.index])
        except KVMemoryError:
            self.settle(slot)  # gives its compressed bytes back: it is evicted
            self.store.record_eviction(entry.session_id, "memory")
            logger.info("KV memory: evict %s (%d tokens): no room to restore it", entry.session_id, entry.n_tokens)
            return Resume(0, "evicted")
        try:
            loop = asyncio.get_running_loop()
            staged = restore_scratch_nbytes(entry) if slot.engine.kv_preallocated else 0  # CPU: read into the slot
            with self.working.scratch(staged, "a restore"):
                keep = await loop.run_in_executor(self._ingest, slot.engine.restore, prompt_ids, entry.payload)
        except KVMemoryError as exc:
            self.settle(slot)
            self.store.record_eviction(entry.session_id, "memory")
            logger.info("KV memory: evict %s (%d tokens): %s", entry.session_id, entry.n_tokens, exc)
            return Resume(0, "evicted")
        except (KVFormatError, KVInjectionError) as exc:
            logger.warning("the kept KV of conversation %s was not restored: %s", entry.session_id, exc)
            keep = 0
        self.settle(slot)  # down to what it holds of this prompt
        return Resume(keep, "compressed", tiers)

    async def _move_out(self, slot: Slot, session: str | None) -> None:
        """Keep the slot's conversation ``session`` compressed, if max_sessions leaves room for it
        beside the conversations resident in slots (else it is evicted, counted); empty the slot."""
        entry = None
        if session is not None and slot.engine.length > 0:
            if self._room_in_store() > 0:
                entry = await self._compressed(slot, session)
            else:
                self.store.record_eviction(session, "max_sessions")
        slot.engine.reset()
        self.settle(slot)
        if entry is None:
            return
        await self._compress_idle_until_fits(entry.nbytes)  # idle residents go before any kept one is evicted
        loop = asyncio.get_running_loop()
        self._log(await loop.run_in_executor(self._ingest, self.keep, entry, max(self._room_in_store(), 1)))

    async def _compressed(self, slot: Slot, session: str) -> StoredConversation | None:
        """The slot's conversation compressed for the store (its KV still counted in the slot's
        reservation meanwhile), read from the slot in place on the CPU with no token dropped, else
        from a copy held as working-memory scratch; None where nothing of it can be kept, or the copy
        does not fit the working memory (the conversation is evicted, counted)."""
        engine, loop = slot.engine, asyncio.get_running_loop()
        length, processed = engine.length, int(engine.held_positions[-1]) + 1
        in_place = not engine.kv_preallocated and processed == length
        copied = 0 if in_place else (length + (processed if processed != length else 0)) * self.bytes_per_slot_token
        try:
            with self.working.scratch(copied, "moving a conversation to the store"):
                snapshot, held = await loop.run_in_executor(self._ingest, engine.export_positions, True)
                importance, window_from = engine.given_importance(), engine.windowed_from
                if window_from >= snapshot.n_tokens:  # its windowed layers hold nothing to go on from (kv.window)
                    logger.info("KV memory: nothing of %s can be kept: its KV ends before its window", session)
                    return None
                tiers = np.where(held, Tier.INT8, Tier.DROP).astype(np.uint8)
                return await loop.run_in_executor(
                    self._ingest, self.store.compress, session, snapshot, importance, tiers, window_from
                )
        except KVMemoryError as exc:
            self.store.record_eviction(session, "memory")
            logger.info("KV memory: evict %s (%d tokens): %s", session, length, exc)
            return None

    def _room_in_store(self) -> int:
        """Conversations the store may hold beside those resident in slots (max_sessions in all)."""
        return self.store.max_sessions - sum(slot.session_id is not None for slot in self.pool.slots)

    @staticmethod
    def _log(steps: list[LadderStep]) -> None:
        for step in steps:
            logger.info(
                "KV memory: %s %s (%d tokens, %d bytes freed, %s)",
                step.action,
                step.session_id,
                step.tokens,
                step.freed_nbytes,
                step.reason,
            )


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"

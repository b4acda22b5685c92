"""The decode daemon's KV memory: the slots' KV and the compressed conversations under one budget.

Every slot reserves, in the ``ConversationStore``'s budget (``daemon.kv_memory_mb``), the bytes of
KV it holds: a turn reserves room for the slots its kept prefix holds, its new prompt tokens and its
completion before anything is fetched (``admit``), and gives back what it did not use when it ends
(``settle``; on CPU the buffer's pages past what it holds go back to the OS, so the process's memory
follows the reservations). On CUDA a slot's KV buffers are allocated whole on the device at start:
each slot reserves all of it for good, and only compressed conversations come and go.

A conversation whose slot is taken by another keeps its KV, compressed (the EDKV tiers, INT8), and
its next turn takes it back through the engine's EDKV reader (``resume``), so that turn pulls or
computes only its new tokens.

When a turn's room does not fit, the pressure ladder runs in order, as far as needed: idle
conversations resident in their slots are compressed into the store (float32 to INT8), least
recently used first; then the store's own rungs over compressed conversations (re-tier to INT4, drop
their least important tokens, evict the least recently used — counted); as the last resort the
turn's own conversation loses the KV of its least important kept tokens (sinks and the recent window
stay; ranked as in the store: importance from the pull, else position), so a conversation longer
than the budget goes on as a window with attention sinks. What still does not fit is a 503 naming the budget
(``KVMemoryError``), before anything was fetched.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import Executor

import numpy as np

from edgedecode.daemon.conversations import ConversationStore, KVMemoryError, LadderStep, StoredConversation
from edgedecode.daemon.metrics import ConversationMetrics
from edgedecode.daemon.slots import Slot, SlotPool
from edgedecode.kv.importance import drop_ranking
from edgedecode.kv.policy import pinned_mask
from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire import KVFormatError
from edgedecode.runtime.kvcache import KVInjectionError

logger = logging.getLogger(__name__)
Resumed = tuple[int, dict[str, int], str]  # positions kept, tokens per tier they were kept at, how it resumed


class KVMemory:
    """The slots' reservations and the conversation store (see the module docstring).

    ``max_sessions``: conversations kept at once, resident in a slot or compressed (as many as
    slots: none is kept once its slot is taken); ``ingest``: the thread that writes into the slots'
    KV (exports, restores and evictions run there, after any ingest still under way);
    ``preallocated``: the slots' KV buffers are allocated whole up front (CUDA), and reserved whole.

    Raises:
        KVMemoryError: the slots' preallocated buffers alone exceed the budget.
    """

    def __init__(
        self,
        pool: SlotPool,
        budget_bytes: int,
        max_sessions: int,
        bytes_per_slot_token: int,
        ingest: Executor,
        metrics: ConversationMetrics,
        preallocated: bool = False,
    ) -> None:
        self.pool = pool
        self.store = ConversationStore(budget_bytes, max_sessions, metrics)
        self.bytes_per_slot_token = bytes_per_slot_token
        self.ingest = ingest
        self.metrics = metrics
        self.floor = {slot: slot.engine.max_context * bytes_per_slot_token * preallocated for slot in pool.slots}
        preallocated_nbytes = sum(self.floor.values())
        if preallocated_nbytes > budget_bytes:
            raise KVMemoryError(
                f"the {len(pool.slots)} slots' KV buffers, allocated whole on the device, take "
                f"{preallocated_nbytes / (1 << 20):.1f} MiB: more than daemon.kv_memory_mb "
                f"({budget_bytes / (1 << 20):.1f} MiB); "
                "raise it, or lower daemon.slots or daemon.max_context"
            )
        for slot, floor in self.floor.items():
            self.store.reserve(floor)
            slot.reserved = floor
        for state, busy in (("active", True), ("resident", False)):
            metrics.sessions.labels(state).set_function(functools.partial(self._sessions, busy))
            metrics.kv_memory.labels(state).set_function(functools.partial(self._reserved, busy))

    def _sessions(self, busy: bool) -> int:
        return sum(slot.busy == busy and slot.session_id is not None for slot in self.pool.slots)

    def _reserved(self, busy: bool) -> int:
        return sum(slot.reserved for slot in self.pool.slots if slot.busy == busy)

    async def admit(self, slot: Slot, keep: int, new_tokens: int) -> int:
        """Reserve room in the budget for ``slot`` to hold the KV of the prompt's first ``keep``
        positions (what it holds of them) and ``new_tokens`` more (the rest of the prompt and the
        completion), relieving pressure as the ladder says; returns how many of the conversation's
        own kept tokens the last rung evicted (0 almost always).

        Raises:
            KVMemoryError: it cannot fit even with every other conversation compressed and evicted
                and this one's droppable kept tokens evicted (503).
        """
        evicted = 0
        while True:
            kept_slots = int(np.searchsorted(slot.engine.held_positions, keep))
            need = (kept_slots + new_tokens) * self.bytes_per_slot_token - slot.reserved
            try:
                await self._reserve(slot, need)
                return evicted
            except KVMemoryError:
                if evicted:
                    raise  # the last rung ran once, as far as the budget needed: it did not fit after all
                evicted = await self._evict_own_tokens(slot, kept_slots, need)
                if not evicted:
                    raise

    async def _reserve(self, slot: Slot, need: int) -> None:
        """Add ``need`` bytes to ``slot``'s reservation, through the ladder short of its last rung."""
        if need <= 0:
            return
        await self._compress_idle_until_fits(need)
        self._log(self.store.reserve(need))  # the store's own rungs: re-tier, drop, evict compressed ones
        slot.reserved += need

    async def _compress_idle_until_fits(self, nbytes: int) -> None:
        """The ladder's first rung: while ``nbytes`` more do not fit the budget as it is, move idle
        resident conversations (least recently used first) into the store, float32 to INT8."""
        while not self.store.fits(nbytes):
            idle = self.pool.idle_held()
            if not idle:
                return
            await self._compress_idle(idle[0])

    async def _evict_own_tokens(self, slot: Slot, kept_slots: int, need: int) -> int:
        """The last rung: evict the least important of the slot's first ``kept_slots`` tokens, as
        many as the budget needs once every compressed conversation is gone; returns how many (0,
        and nothing evicted, when even all its droppable tokens would not do)."""
        shortfall = self.store.reserved_nbytes + need - self.store.budget_bytes
        positions = np.array(slot.engine.held_positions[:kept_slots])
        tail = np.arange(kept_slots) >= kept_slots - slot.engine.windowed_tail
        droppable = np.flatnonzero(~pinned_mask(positions) & ~tail)  # the windowed tail stays (kv.window)
        count = -(-shortfall // self.bytes_per_slot_token)
        if not 0 < count <= len(droppable):
            return 0
        ranking = drop_ranking(slot.engine.given_importance()[positions], positions)
        order = droppable[np.argsort(ranking[droppable], kind="stable")]
        await asyncio.get_running_loop().run_in_executor(self.ingest, slot.engine.evict, positions[order[:count]])
        self.metrics.active_evicted.inc(count)
        logger.warning(
            "KV memory: evicted %d of the %d kept tokens of the active conversation %s to fit daemon.kv_memory_mb",
            count,
            kept_slots,
            slot.session_id,
        )
        return count

    def settle(self, slot: Slot) -> None:
        """Shrink ``slot``'s reservation to the KV it holds now (a turn ended, or failed)."""
        held = max(slot.engine.length * self.bytes_per_slot_token, self.floor[slot])
        if slot.reserved > held:
            self.store.release(slot.reserved - held)
            slot.reserved = held
        slot.engine.release_unused()

    async def resume(self, slot: Slot, session_id: str | None, prompt_ids: np.ndarray) -> Resumed:
        """Before a turn uses a slot taken from another conversation: keep that one's KV compressed
        (when the store keeps any), then take this conversation's compressed KV, if the store has
        it, back into the slot. Returns (positions of the prompt kept, tokens per tier it was kept
        at, how the conversation resumes: "compressed", "evicted" (its KV was discarded under
        pressure: it starts again) or "new"). A payload refused for this prompt is discarded and
        the reason logged ("compressed", 0 positions kept)."""
        # Taken first, so that keeping the slot's previous conversation does not count it against
        # max_sessions; its bytes stay counted until it is restored.
        entry = self.store.take(session_id, keep_counted=True) if session_id is not None else None
        carried = 0 if entry is None else entry.nbytes
        try:
            previous, slot.previous_session = slot.previous_session, None
            await self._move_to_store(slot, previous)
            slot.reserved, carried = slot.reserved + carried, 0  # the slot carries them now (settle gives them back)
            if entry is None:
                return 0, {}, "evicted" if session_id is not None and self.store.evicted(session_id) else "new"
            return await self._restore(slot, entry, prompt_ids)
        finally:
            if carried:
                self.store.release(carried)

    async def _restore(self, slot: Slot, entry: StoredConversation, prompt_ids: np.ndarray) -> Resumed:
        counts = np.bincount(entry.tiers, minlength=len(Tier))
        tiers = {tier.name: int(counts[tier]) for tier in Tier if counts[tier]}
        try:  # its KV as the slot holds it (nothing more where the slot's buffers are reserved whole)
            await self._reserve(slot, entry.n_kept * self.bytes_per_slot_token - self.floor[slot])
        except KVMemoryError:
            self.settle(slot)  # gives its compressed bytes back: it is evicted
            self.store.record_eviction(entry.session_id, "memory")
            logger.info("KV memory: evict %s (%d tokens): no room to restore it", entry.session_id, entry.n_tokens)
            return 0, {}, "evicted"
        loop = asyncio.get_running_loop()
        try:
            keep = await loop.run_in_executor(self.ingest, slot.engine.restore, prompt_ids, entry.payload)
        except (KVFormatError, KVInjectionError) as exc:
            logger.warning("the kept KV of conversation %s was not restored: %s", entry.session_id, exc)
            keep = 0
        self.settle(slot)  # down to what it holds of this prompt
        return keep, tiers, "compressed"

    async def _compress_idle(self, slot: Slot) -> None:
        """Move an idle slot's conversation into the store; the slot is free for anyone afterwards."""
        self.pool.hold(slot)
        try:
            session, slot.session_id = slot.session_id, None
            await self._move_to_store(slot, session)
        finally:
            self.pool.release(slot)

    async def _move_to_store(self, slot: Slot, session: str | None) -> None:
        """Keep the slot's conversation ``session`` compressed, if max_sessions leaves room for it
        beside the conversations resident in slots (else it is evicted, counted); empty the slot."""
        engine = slot.engine
        snapshot = None
        if session is not None and engine.length > 0:
            if self._room_in_store() > 0:
                loop = asyncio.get_running_loop()
                snapshot, held = await loop.run_in_executor(self.ingest, engine.export_positions)
                importance, window_from = engine.given_importance(), engine.windowed_from
                if window_from >= snapshot.n_tokens:  # its windowed layers hold nothing to go on from (kv.window)
                    logger.info("KV memory: nothing of %s can be kept: its KV ends before its window", session)
                    snapshot = None
            else:
                self.store.record_eviction(session, "max_sessions")
        engine.reset()
        self.settle(slot)
        if snapshot is None or session is None:
            return
        tiers = np.where(held, Tier.INT8, Tier.DROP).astype(np.uint8)
        loop = asyncio.get_running_loop()
        entry = await loop.run_in_executor(None, self.store.compress, session, snapshot, importance, tiers, window_from)
        await self._compress_idle_until_fits(entry.nbytes)  # idle residents go before any kept one is evicted
        self._log(self.store.add(entry, max(self._room_in_store(), 1)))

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

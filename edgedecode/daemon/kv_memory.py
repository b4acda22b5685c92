"""The decode daemon's KV memory: the slots' KV and the compressed conversations under one budget.

Every slot reserves, in the ``ConversationStore``'s budget (``daemon.kv_memory_mb``), the bytes of
KV it holds: a turn reserves room for its prompt and its completion before anything is fetched
(``admit``), and gives back what it did not use when it ends (``settle``). A conversation whose
slot is taken by another keeps its KV, compressed (``retain``: the EDKV tiers, INT8), and its next
turn takes it back through the engine's EDKV reader (``restore``), so that turn pulls or computes
only its new tokens.

When a turn's room does not fit, the pressure ladder runs in order, as far as needed: the store's
own rungs over compressed conversations (re-tier to INT4, drop their least important tokens, evict
the least recently used — counted), then idle conversations resident in their slots are compressed
into the store, least recently used first (their slots' reservations shrink to the compressed
size), and the store's rungs run again. What still does not fit is a 503 naming the budget
(``KVMemoryError``), before anything was fetched.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import Executor

import numpy as np

from edgedecode.daemon.conversations import ConversationStore, KVMemoryError
from edgedecode.daemon.metrics import ConversationMetrics
from edgedecode.daemon.slots import Slot, SlotPool
from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire import KVFormatError
from edgedecode.runtime.kvcache import KVInjectionError

logger = logging.getLogger(__name__)


class KVMemory:
    """The slots' reservations and the conversation store (see the module docstring).

    ``retained``: conversations the store keeps besides those resident in slots (0: none is kept
    once its slot is taken); ``ingest``: the thread that writes into the slots' KV (exports and
    restores run there, after any ingest still under way).
    """

    def __init__(
        self,
        pool: SlotPool,
        budget_bytes: int,
        retained: int,
        bytes_per_slot_token: int,
        ingest: Executor,
        metrics: ConversationMetrics,
    ) -> None:
        self.pool = pool
        self.store = ConversationStore(budget_bytes, max(retained, 1), metrics)
        self.retained = retained
        self.bytes_per_slot_token = bytes_per_slot_token
        self.ingest = ingest
        for state, busy in (("active", True), ("resident", False)):
            metrics.sessions.labels(state).set_function(functools.partial(self._sessions, busy))
            metrics.kv_memory.labels(state).set_function(functools.partial(self._reserved, busy))

    def _sessions(self, busy: bool) -> int:
        return sum(slot.busy == busy and slot.session_id is not None for slot in self.pool.slots)

    def _reserved(self, busy: bool) -> int:
        return sum(slot.reserved for slot in self.pool.slots if slot.busy == busy)

    async def admit(self, slot: Slot, tokens: int) -> None:
        """Reserve room in the budget for ``slot`` to hold ``tokens`` positions of KV (the prompt and
        the completion), relieving pressure as the ladder says.

        Raises:
            KVMemoryError: it cannot fit even with every other conversation compressed and evicted (503).
        """
        need = tokens * self.bytes_per_slot_token - slot.reserved
        if need <= 0:
            return
        idle = self.pool.idle_held()  # resident conversations, least recently used first
        while True:
            try:
                self.store.reserve(need)  # the store's own rungs first
                break
            except KVMemoryError:
                idle = [s for s in idle if not s.busy and s.session_id is not None]  # not taken meanwhile
                if not idle:
                    raise
                await self._compress_idle(idle.pop(0))
        slot.reserved += need

    def settle(self, slot: Slot) -> None:
        """Shrink ``slot``'s reservation to the KV it holds now (a turn ended, or failed)."""
        held = slot.engine.length * self.bytes_per_slot_token
        if slot.reserved > held:
            self.store.release(slot.reserved - held)
            slot.reserved = held

    async def retain(self, slot: Slot) -> None:
        """Before a turn uses a slot taken from another conversation: keep that one's KV compressed
        (when the store keeps any), and free the slot's reservation."""
        previous, slot.previous_session = slot.previous_session, None
        await self._move_to_store(slot, previous)

    async def restore(self, slot: Slot, session_id: str | None, prompt_ids: np.ndarray) -> tuple[int, dict[str, int]]:
        """Take the conversation's compressed KV back into ``slot`` (it must hold nothing of it):
        (positions of the prompt kept, tokens per tier it was kept at); (0, {}) when the store holds
        none of it or it is refused for this prompt (then it is discarded, and the reason logged)."""
        entry = self.store.take(session_id) if session_id is not None else None
        if entry is None:
            return 0, {}
        loop = asyncio.get_running_loop()
        try:
            keep = await loop.run_in_executor(self.ingest, slot.engine.restore, prompt_ids, entry.payload)
        except (KVFormatError, KVInjectionError) as exc:
            logger.warning("the kept KV of conversation %s was not restored: %s", session_id, exc)
            return 0, {}
        counts = np.bincount(entry.tiers, minlength=len(Tier))
        return keep, {tier.name: int(counts[tier]) for tier in Tier if counts[tier]}

    async def _compress_idle(self, slot: Slot) -> None:
        """Move an idle slot's conversation into the store; the slot is free for anyone afterwards."""
        self.pool.hold(slot)
        try:
            session, slot.session_id = slot.session_id, None
            await self._move_to_store(slot, session)
        finally:
            self.pool.release(slot)

    async def _move_to_store(self, slot: Slot, session: str | None) -> None:
        engine = slot.engine
        snapshot = None
        if session is not None and self.retained > 0 and engine.length > 0:
            loop = asyncio.get_running_loop()
            snapshot, held = await loop.run_in_executor(self.ingest, engine.export_positions)
        self.store.release(slot.reserved)
        slot.reserved = 0
        if snapshot is None or session is None:
            return
        tiers = np.where(held, Tier.INT8, Tier.DROP).astype(np.uint8)
        steps = await asyncio.get_running_loop().run_in_executor(None, self.store.put, session, snapshot, None, tiers)
        for step in steps:
            logger.info(
                "KV memory: %s %s (%d tokens, %d bytes freed, %s)",
                step.action,
                step.session_id,
                step.tokens,
                step.freed_nbytes,
                step.reason,
            )

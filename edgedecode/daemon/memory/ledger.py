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
thread, so the loop never waits on it. The books (``memory.books``: the public methods without ``async``) may be
called from any thread: those that add bytes (``reserve``, ``keep``, ``put``, ``make_room``) one at a time.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import numpy as np
import psutil

from edgedecode.daemon.memory.books import MemoryBooks
from edgedecode.daemon.memory.conversation import (
    LadderStep,
    StoredConversation,
    own_drop_order,
    restore_scratch_nbytes,
)
from edgedecode.daemon.memory.working import KVMemoryError
from edgedecode.daemon.slots import Slot
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


class MemoryLedger(MemoryBooks):
    """The daemon's KV memory over ``pool``'s slots and ``store`` (see the module docstring): the books
    (``MemoryBooks``, whose arguments it takes) and a turn's calls on them, on the event loop."""

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

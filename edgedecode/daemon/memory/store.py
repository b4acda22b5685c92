"""The conversation store: idle conversations' KV kept compressed in memory, least recently put first.

A conversation (session id) whose KV leaves its decode slot is put here as one EDKV payload, every
token at INT8 unless told otherwise (``memory.conversation``); its next turn takes the payload back
for the engine's EDKV reader (``Engine.restore``), so that turn computes or pulls only its new tokens.

The store has no budget of its own: ``MemoryLedger`` counts its bytes against ``daemon.kv_memory_mb``
and decides when its conversations are re-tiered, trimmed or evicted, through the operations here
that each do one of those to one conversation and say how many bytes it freed. Beyond
``max_sessions`` conversations, a put evicts the least recently put ones.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import numpy as np

from edgedecode.daemon.memory.conversation import (
    DEFAULT_TIER,
    MIN_KEPT_FRACTION,
    LadderStep,
    StoredConversation,
    compress,
    dropped,
    retiered,
)
from edgedecode.daemon.metrics import ConversationMetrics
from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.kv.tiers import Tier

logger = logging.getLogger(__name__)

REMEMBERED_EVICTIONS = 4096  # evicted conversations remembered, so that their next turn is reported as such


class ConversationStore:
    """Idle conversations' KV, compressed, at most ``max_sessions`` of them (see the module docstring).

    Thread-safe, and no call waits on an encode: encoding (``compress``, ``retier``, ``drop``) runs
    outside the store's lock, which guards only its map and counts; a re-tier or drop whose
    conversation was taken or replaced meanwhile changes nothing.

    Args:
        max_sessions: conversations kept at once (>= 1); a put beyond it evicts the least recently put one.
        metrics: where the "compressed" state, re-tiers and evictions are counted (None: nowhere).
        min_kept_fraction: the drop rung's floor, a share of each conversation's tokens.
        workers: threads that quantize and compress each payload (``encode_payload``).
    """

    def __init__(
        self,
        max_sessions: int,
        metrics: ConversationMetrics | None = None,
        *,
        min_kept_fraction: float = MIN_KEPT_FRACTION,
        workers: int = 1,
    ) -> None:
        if max_sessions < 1 or not 0 < min_kept_fraction <= 1 or workers < 1:
            raise ValueError(
                "max_sessions >= 1, min_kept_fraction in (0, 1] and workers >= 1 are required, "
                f"got {max_sessions}, {min_kept_fraction}, {workers}"
            )
        self.max_sessions = max_sessions
        self.min_kept_fraction = min_kept_fraction
        self.workers = workers
        self._metrics = metrics
        self._entries: OrderedDict[str, StoredConversation] = OrderedDict()  # least recently put first
        self._nbytes = 0
        self._evicted: OrderedDict[str, str] = OrderedDict()  # conversation -> reason, most recent last
        self._lock = threading.Lock()
        self._publish()

    @property
    def nbytes(self) -> int:
        """Bytes of the conversations held, as the KV memory budget counts them."""
        return self._nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._entries

    def sessions(self) -> list[str]:
        """The conversations held, least recently put first."""
        with self._lock:
            return list(self._entries)

    def compress(
        self,
        session_id: str,
        snapshot: KVSnapshot,
        importance: np.ndarray | None = None,
        tiers: Tier | np.ndarray = DEFAULT_TIER,
        window_from: int = 0,
    ) -> StoredConversation:
        """The conversation compressed (``memory.conversation.compress``), not kept: ``add`` keeps it."""
        return compress(session_id, snapshot, importance, tiers, window_from, workers=self.workers)

    def add(self, entry: StoredConversation, max_sessions: int | None = None) -> list[LadderStep]:
        """Keep ``entry`` as its conversation's KV (replacing what the store held for it), the most
        recently put, with at most ``max_sessions`` conversations in all (default and upper bound:
        the store's); returns the evictions that keeps to."""
        keep_at_most = self.max_sessions if max_sessions is None else min(max(max_sessions, 1), self.max_sessions)
        with self._lock:
            replaced = self._entries.pop(entry.session_id, None)
            if replaced is not None:
                self._nbytes -= replaced.nbytes
            overflow = list(self._entries)[: max(len(self) + 1 - keep_at_most, 0)]  # least recently put
            steps = [self._evict(oldest, "max_sessions") for oldest in overflow]
            self._entries[entry.session_id] = entry
            self._nbytes += entry.nbytes
            self._publish()
        return steps

    def take(self, session_id: str) -> StoredConversation | None:
        """Remove and return the conversation's stored KV; None when the store does not hold it."""
        with self._lock:
            entry = self._entries.pop(session_id, None)
            if entry is not None:
                self._nbytes -= entry.nbytes
                self._publish()
        return entry

    def peek(self, session_id: str) -> StoredConversation | None:
        """The conversation's stored KV, left in the store and in its place; None when not held."""
        with self._lock:
            return self._entries.get(session_id)

    def retier(self, session_id: str, tier: Tier = Tier.INT4) -> LadderStep | None:
        """Re-tier the conversation's unpinned tokens to ``tier`` (``memory.conversation.retiered``: INT4, then
        INT3), in its place; None when it frees nothing (or the store no longer holds it)."""
        entry = self.peek(session_id)
        if entry is None:
            return None
        return self._replace(entry, retiered(entry, tier, workers=self.workers), "retier")

    def drop(self, session_id: str, shortfall: int) -> LadderStep | None:
        """DROP the conversation's least important droppable tokens, about as many as free
        ``shortfall`` bytes (``memory.conversation.dropped``), in its place; None when it frees
        nothing (or the store no longer holds it)."""
        entry = self.peek(session_id)
        if entry is None:
            return None
        return self._replace(entry, dropped(entry, shortfall, self.min_kept_fraction, workers=self.workers), "drop")

    def evict(self, session_id: str, reason: str = "memory") -> LadderStep | None:
        """Discard the conversation's KV, counted as an eviction for ``reason``; None when not held."""
        with self._lock:
            if session_id not in self._entries:
                return None
            step = self._evict(session_id, reason)
            self._publish()
        return step

    def record_eviction(self, session_id: str, reason: str) -> None:
        """Count a conversation whose KV the daemon discarded without it ever being stored (e.g. no
        room is kept for compressed ones), as an eviction for ``reason``."""
        with self._lock:
            self._note_eviction(session_id, reason)

    def evicted(self, session_id: str) -> str | None:
        """Why the conversation's KV was evicted (and forget it), or None when it was not (lately)."""
        with self._lock:
            return self._evicted.pop(session_id, None)

    def _replace(self, entry: StoredConversation, smaller: StoredConversation | None, action: str) -> LadderStep | None:
        """Put ``smaller`` in ``entry``'s place if the store still holds ``entry`` and it frees bytes."""
        if smaller is None:
            return None
        freed = entry.nbytes - smaller.nbytes
        with self._lock:
            if freed <= 0 or self._entries.get(entry.session_id) is not entry:
                return None
            self._entries[entry.session_id] = smaller
            self._nbytes -= freed
            self._publish()
        changed = entry.tiers != smaller.tiers
        self._count_retier(entry.tiers[changed], smaller.tiers[changed])
        return LadderStep(action, entry.session_id, int(np.count_nonzero(changed)), freed)

    def _evict(self, session_id: str, reason: str) -> LadderStep:
        entry = self._entries.pop(session_id)
        self._nbytes -= entry.nbytes
        self._note_eviction(session_id, reason)
        logger.info(
            "evicted conversation %s (%d tokens, %d bytes): %s", session_id, entry.n_tokens, entry.nbytes, reason
        )
        return LadderStep("evict", session_id, entry.n_tokens, entry.nbytes, reason)

    def _note_eviction(self, session_id: str, reason: str) -> None:
        self._evicted.pop(session_id, None)
        self._evicted[session_id] = reason
        if len(self._evicted) > REMEMBERED_EVICTIONS:
            self._evicted.popitem(last=False)
        if self._metrics is not None:
            self._metrics.evictions.labels(reason).inc()

    def _count_retier(self, old: np.ndarray, new: np.ndarray) -> None:
        if self._metrics is None or len(old) == 0:
            return
        pairs, counts = np.unique(np.stack([old, new], axis=1), axis=0, return_counts=True)
        for (high, low), count in zip(pairs, counts):
            self._metrics.retier.labels(Tier(int(high)).name, Tier(int(low)).name).inc(int(count))

    def _publish(self) -> None:
        if self._metrics is not None:
            self._metrics.sessions.labels("compressed").set(len(self._entries))
            self._metrics.kv_memory.labels("compressed").set(self._nbytes)

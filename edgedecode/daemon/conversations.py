"""The conversation store: idle conversations' KV kept compressed in memory, under one KV memory budget.

A conversation (session id) whose KV leaves its decode slot is put here as one EDKV payload, every
token at INT8 unless told otherwise; its next turn takes the payload back for the engine's EDKV
reader (``Engine.open_kv_stream``), so that turn computes or pulls only its new tokens.

The budget counts what the store holds (payloads, and the tier map, importance and pins beside each)
plus what the daemon reserves outside it (``reserve``: the slots' KV). When more must fit, the
pressure ladder relieves idle conversations, least recently put first, each rung over all of them
and only as far as needed before the next:

1. re-tier: every token above INT4 goes to INT4, except the pinned ones (attention sinks and the
   recent window, ``kv.policy.pinned_mask``), which keep their tier. The window is the prefill
   policy's 64 tokens, but at most a quarter of the conversation (``store_pins``): with 64, a
   conversation of a few short turns would be pinned whole, and the ladder could only evict it;
2. drop: the least important unpinned tokens become DROP, down to ``min_kept_fraction`` of the
   conversation's tokens. Positions are kept (the engine decodes after the gaps as after any dropped
   token) and the header still lists every token, so the next prompt is checked against all of them;
3. evict: whole conversations go, counted (``edgedecode_session_evictions_total{reason="memory"}``).

"Least important" ranks by the importance that came with the KV (``kv.importance.drop_ranking``): a
pull's EDKV ``importance``, the prefill side's attention scaled to mean 1, which the payload the store
keeps carries on (so a restored conversation brings it back); tokens computed or generated on this
box rank as an average one. A conversation without any ranks by position importance
(``kv.importance.position_importance``): the oldest tokens after the sinks go first, a sliding window
with attention sinks (StreamingLLM). Attention is the better order where there is one (dropping a
quarter of a 512-token context by it costs about half the KL of dropping by position:
tools/drop_quality.py, docs/memory.md). Pinned tokens are never dropped.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from edgedecode.daemon.metrics import ConversationMetrics
from edgedecode.errors import EdgeDecodeError
from edgedecode.kv.importance import drop_ranking
from edgedecode.kv.policy import RECENT_TOKENS, pinned_mask
from edgedecode.kv.quant import token_nbytes
from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.kv.tiers import Tier
from edgedecode.kv.window import carried_from, tail_tokens, window_start
from edgedecode.kv.wire import EDKVHeader, EDKVReader, encode_payload
from edgedecode.model.spec import KVContract

logger = logging.getLogger(__name__)

DEFAULT_TIER = Tier.INT8  # SmolLM2: KL at the decode graph's noise floor (docs/serving.md, tools/bench_store.py)
RETIER_TIER = Tier.INT4
MIN_KEPT_FRACTION = 0.5  # the drop rung keeps at least this share of a conversation's tokens
_DROP_MARGIN = 1.05  # the drop rung aims this much past the shortfall: its byte estimate is approximate
REMEMBERED_EVICTIONS = 4096  # evicted conversations remembered, so that their next turn is reported as such


class KVMemoryError(EdgeDecodeError):
    """The KV memory budget cannot hold what is asked, even with every idle conversation evicted (503)."""

    http_status = 503
    http_code = "insufficient_memory"
    retry_after_s = 5


@dataclass(frozen=True)
class LadderStep:
    """One thing the store did to one idle conversation to make room, or to keep max_sessions."""

    action: str  # "retier" (to INT4), "drop" (least important tokens) or "evict"
    session_id: str
    tokens: int  # tokens re-tiered, dropped, or held by the evicted conversation
    freed_nbytes: int
    reason: str = "memory"  # "memory" (the budget) or "max_sessions" (evictions only)


@dataclass(frozen=True, eq=False)
class StoredConversation:
    """An idle conversation's KV, compressed: one whole EDKV stream (feed ``payload`` to an
    ``EDKVReader`` or ``Engine.open_kv_stream``) and what the ladder needs beside it."""

    session_id: str
    payload: bytes
    chunk_nbytes: int  # of the payload, in chunk frames: the KV itself, what dropping tokens shrinks
    contract: KVContract
    tiers: np.ndarray  # uint8 [n]: each token's tier in the payload, the same in every layer
    importance: np.ndarray  # float32 [n]: what the drop rung keeps (given with the KV, or position importance)
    pinned: np.ndarray  # bool [n]: attention sinks and the recent window, never re-tiered or dropped
    window_from: int = 0  # first token whose KV the windowed layers hold (kv.window); 0: every token's

    @property
    def n_tokens(self) -> int:
        """Tokens of the conversation, dropped ones included."""
        return len(self.tiers)

    @property
    def n_kept(self) -> int:
        return int(np.count_nonzero(self.tiers != Tier.DROP))

    @property
    def nbytes(self) -> int:
        """Bytes held, as the budget counts them."""
        return len(self.payload) + self.tiers.nbytes + self.importance.nbytes + self.pinned.nbytes


class ConversationStore:
    """Idle conversations' KV, compressed, at most ``max_sessions`` of them, within ``budget_bytes``.

    ``nbytes`` (stored conversations plus reservations) never exceeds ``budget_bytes`` after any
    public call. Safe to call from several threads: ``put`` compresses outside the store's lock, but
    the ladder's re-encoding runs under it.

    Args:
        budget_bytes: the KV memory budget (``daemon.kv_memory_mb``).
        max_sessions: conversations the store keeps at once (>= 1); a put beyond it evicts the least
            recently put one.
        metrics: where the "compressed" state and the ladder are counted (None: nowhere).
        min_kept_fraction: the drop rung's floor, a share of each conversation's tokens.
        workers: threads that quantize and compress each payload (``encode_payload``).
    """

    def __init__(
        self,
        budget_bytes: int,
        max_sessions: int,
        metrics: ConversationMetrics | None = None,
        *,
        min_kept_fraction: float = MIN_KEPT_FRACTION,
        workers: int = 1,
    ) -> None:
        if budget_bytes < 0 or max_sessions < 1 or not 0 < min_kept_fraction <= 1 or workers < 1:
            raise ValueError(
                "budget_bytes >= 0, max_sessions >= 1, min_kept_fraction in (0, 1] and workers >= 1 are required, "
                f"got {budget_bytes}, {max_sessions}, {min_kept_fraction}, {workers}"
            )
        self._budget_bytes = budget_bytes
        self._max_sessions = max_sessions
        self.min_kept_fraction = min_kept_fraction
        self.workers = workers
        self._metrics = metrics
        self._entries: OrderedDict[str, StoredConversation] = OrderedDict()  # least recently put first
        self._compressed_nbytes = 0
        self._reserved_nbytes = 0
        self._peak_nbytes = 0
        self._evicted: OrderedDict[str, str] = OrderedDict()  # conversation -> reason, most recent last
        self._lock = threading.Lock()
        self._publish()

    @property
    def budget_bytes(self) -> int:
        return self._budget_bytes

    @property
    def max_sessions(self) -> int:
        return self._max_sessions

    @property
    def nbytes(self) -> int:
        """Bytes counted against the budget: stored conversations and reservations."""
        return self._compressed_nbytes + self._reserved_nbytes

    @property
    def peak_nbytes(self) -> int:
        """The most ``nbytes`` has been since the store was made."""
        return self._peak_nbytes

    @property
    def compressed_nbytes(self) -> int:
        return self._compressed_nbytes

    @property
    def reserved_nbytes(self) -> int:
        return self._reserved_nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._entries

    def put(
        self,
        session_id: str,
        snapshot: KVSnapshot,
        importance: np.ndarray | None = None,
        tiers: Tier | np.ndarray = DEFAULT_TIER,
        window_from: int = 0,
    ) -> list[LadderStep]:
        """Keep ``snapshot`` as the conversation's KV (replacing what the store held for it), compressed.

        Args:
            session_id: the conversation.
            snapshot: its KV (``Engine.export_kv``), tokens at their true positions.
            importance: float [n], the importance that came with each token's KV (``Engine.given_importance``;
                NaN where none did), kept in the payload; None: none at all. The drop rung ranks by
                ``kv.importance.drop_ranking`` of it.
            tiers: the starting tier of every token, or uint8 [n] Tier codes.
            window_from: the first token whose KV the windowed layers hold (``Engine.windowed_from``): the
                payload's window starts there or later (kv.window), and the windowed tail is never dropped.

        Returns:
            What the store did to keep ``max_sessions`` and the budget, in order. The conversation
            itself is re-tiered, trimmed and, as the very last resort, evicted like any other idle one.

        Raises:
            ValueError: tiers or importance not shaped [n], importance negative or infinite, no tokens, or KV
                that ``encode_payload`` refuses.
        """
        return self.add(self.compress(session_id, snapshot, importance, tiers, window_from))

    def compress(
        self,
        session_id: str,
        snapshot: KVSnapshot,
        importance: np.ndarray | None = None,
        tiers: Tier | np.ndarray = DEFAULT_TIER,
        window_from: int = 0,
    ) -> StoredConversation:
        """``put``'s first half: the conversation compressed, not yet kept (the store is unchanged);
        ``add`` keeps it. Lets the caller make room for ``nbytes`` its own way in between."""
        return self._compressed(session_id, snapshot, importance, tiers, window_from)

    def add(self, entry: StoredConversation, max_sessions: int | None = None) -> list[LadderStep]:
        """``put``'s second half: keep ``entry`` (from ``compress``), with at most ``max_sessions``
        conversations in all (default and upper bound: the store's); returns what the store did."""
        keep_at_most = self.max_sessions if max_sessions is None else min(max(max_sessions, 1), self.max_sessions)
        with self._lock:
            replaced = self._entries.pop(entry.session_id, None)
            if replaced is not None:
                self._compressed_nbytes -= replaced.nbytes
            overflow = list(self._entries)[: max(len(self) + 1 - keep_at_most, 0)]  # least recently put
            steps = [self._evict(oldest, "max_sessions") for oldest in overflow]
            self._entries[entry.session_id] = entry
            self._compressed_nbytes += entry.nbytes
            steps += self._relieve(0)
            self._publish()
        return steps

    def record_eviction(self, session_id: str, reason: str) -> None:
        """Count a conversation whose KV the daemon discarded without it ever being stored (e.g. no
        room is kept for compressed ones), as an eviction for ``reason``."""
        with self._lock:
            self._note_eviction(session_id, reason)

    def evicted(self, session_id: str) -> str | None:
        """Why the conversation's KV was evicted (and forget it), or None when it was not (lately)."""
        with self._lock:
            return self._evicted.pop(session_id, None)

    def take(self, session_id: str, keep_counted: bool = False) -> StoredConversation | None:
        """Remove and return the conversation's stored KV; None when the store does not hold it.
        ``keep_counted``: its bytes stay counted, as reserved (``release`` them once it is gone)."""
        with self._lock:
            entry = self._entries.pop(session_id, None)
            if entry is not None:
                self._compressed_nbytes -= entry.nbytes
                if keep_counted:
                    self._reserved_nbytes += entry.nbytes
                self._publish()
        return entry

    def peek(self, session_id: str) -> StoredConversation | None:
        """The conversation's stored KV, left in the store and in its place; None when not held."""
        with self._lock:
            return self._entries.get(session_id)

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit under the budget as the store is, without the ladder."""
        return self.nbytes + nbytes <= self.budget_bytes

    def make_room(self, nbytes: int) -> list[LadderStep]:
        """Apply the pressure ladder until ``nbytes`` more fit under the budget (nothing is held).

        Returns:
            What the ladder did, in order (empty when they already fit).

        Raises:
            KVMemoryError: even evicting every stored conversation leaves too little; nothing is changed.
        """
        with self._lock:
            steps = self._make_room(nbytes)
            self._publish()
        return steps

    def reserve(self, nbytes: int) -> list[LadderStep]:
        """``make_room(nbytes)``, then count ``nbytes`` held outside the store (e.g. a slot's KV) until
        ``release``: stored conversations then have that much less of the budget."""
        with self._lock:
            steps = self._make_room(nbytes)
            self._reserved_nbytes += nbytes
            self._publish()
        return steps

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` of what ``reserve`` counted."""
        with self._lock:
            if not 0 <= nbytes <= self._reserved_nbytes:
                raise ValueError(f"cannot release {nbytes} bytes: {self._reserved_nbytes} are reserved")
            self._reserved_nbytes -= nbytes

    def _make_room(self, nbytes: int) -> list[LadderStep]:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if self._reserved_nbytes + nbytes > self.budget_bytes:
            raise KVMemoryError(
                f"{_mib(nbytes)} more of KV do not fit the KV memory budget of {_mib(self.budget_bytes)} "
                f"(daemon.kv_memory_mb) even with every idle conversation evicted: {_mib(self._reserved_nbytes)} "
                "are reserved (the decode slots' KV)"
            )
        return self._relieve(nbytes)

    def _compressed(
        self,
        session_id: str,
        snapshot: KVSnapshot,
        importance: np.ndarray | None,
        tiers: Tier | np.ndarray,
        window_from: int,
    ) -> StoredConversation:
        n = snapshot.n_tokens
        if n == 0:
            raise ValueError(f"nothing to store for conversation {session_id!r}: its KV holds no tokens")
        tier_map = np.full(n, tiers, np.uint8) if isinstance(tiers, Tier) else np.asarray(tiers)
        if tier_map.shape != (n,):
            raise ValueError(f"tiers must be one Tier or one code per token [{n}], got shape {list(tier_map.shape)}")
        positions = np.asarray(snapshot.positions, np.int64)
        given = np.full(n, np.nan, np.float32) if importance is None else np.asarray(importance, np.float32)
        known = given[~np.isnan(given)]
        if given.shape != (n,) or not (np.isfinite(known) & (known >= 0)).all():
            raise ValueError(f"importance must be float [{n}], >= 0 or NaN, got shape {list(given.shape)}")
        given_or_none = given if len(known) else None  # none known: no importance field at all
        payload, chunk_nbytes = self._encoded(snapshot, given_or_none, tier_map, window_from)
        return StoredConversation(
            session_id,
            payload,
            chunk_nbytes,
            snapshot.contract,
            tier_map.astype(np.uint8),
            drop_ranking(given, positions),
            store_pins(positions),
            window_from,
        )

    def _encoded(
        self, snapshot: KVSnapshot, importance: np.ndarray | None, tiers: np.ndarray, window_from: int
    ) -> tuple[bytes, int]:
        """The EDKV payload of ``snapshot`` at ``tiers`` carrying ``importance`` (the windowed layers from
        ``window_from`` or their tail on, kv.window), and its bytes in chunk frames."""
        start = carried_from(tiers != Tier.DROP, snapshot.contract, window_from)
        frames = list(encode_payload(snapshot, tiers, workers=self.workers, importance=importance, window_start=start))
        return b"".join(frames), sum(len(frame) for frame in frames[1:-1])  # less the header and the trailer

    def _relieve(self, nbytes: int) -> list[LadderStep]:
        """The ladder: each rung over the stored conversations, least recently put first, repeated
        while it frees something, until ``nbytes`` more fit."""
        steps: list[LadderStep] = []
        rungs: tuple[Callable[[StoredConversation, int], LadderStep | None], ...] = (
            self._retier,
            self._drop,
            lambda entry, _: self._evict(entry.session_id, "memory"),
        )
        for rung in rungs:
            freed = True
            while freed:
                freed = False
                for entry in list(self._entries.values()):
                    shortfall = self.nbytes + nbytes - self.budget_bytes
                    if shortfall <= 0:
                        return steps
                    step = rung(entry, shortfall)
                    if step is not None:
                        steps.append(step)
                        freed = True
        return steps

    def _retier(self, entry: StoredConversation, shortfall: int) -> LadderStep | None:
        """Every unpinned token above INT4 to INT4 (tier codes rise as precision falls)."""
        lower = ~entry.pinned & (entry.tiers < RETIER_TIER)
        if not lower.any():
            return None
        return self._reencoded(entry, np.where(lower, np.uint8(RETIER_TIER), entry.tiers), "retier")

    def _drop(self, entry: StoredConversation, shortfall: int) -> LadderStep | None:
        """DROP the least important droppable tokens whose estimated bytes cover the shortfall."""
        order = _drop_order(entry, self.min_kept_fraction)
        if len(order) == 0:
            return None
        freed_estimate = np.cumsum(_token_shares(entry)[order])
        count = min(int(np.searchsorted(freed_estimate, shortfall * _DROP_MARGIN)) + 1, len(order))
        tiers = entry.tiers.copy()
        tiers[order[:count]] = Tier.DROP
        return self._reencoded(entry, tiers, "drop")

    def _reencoded(self, entry: StoredConversation, tiers: np.ndarray, action: str) -> LadderStep | None:
        """Replace ``entry`` (in its LRU place) by its KV encoded at ``tiers``; None when that frees nothing."""
        payload, chunk_nbytes = self._encoded(*_decoded(entry), tiers, entry.window_from)
        smaller = replace(entry, payload=payload, chunk_nbytes=chunk_nbytes, tiers=tiers)
        freed = entry.nbytes - smaller.nbytes
        if freed <= 0:
            return None
        self._entries[entry.session_id] = smaller
        self._compressed_nbytes -= freed
        changed = entry.tiers != tiers
        self._count_retier(entry.tiers[changed], tiers[changed])
        return LadderStep(action, entry.session_id, int(np.count_nonzero(changed)), freed)

    def _evict(self, session_id: str, reason: str) -> LadderStep:
        entry = self._entries.pop(session_id)
        self._compressed_nbytes -= entry.nbytes
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
        self._peak_nbytes = max(self._peak_nbytes, self.nbytes)
        if self._metrics is not None:
            self._metrics.kv_memory_peak.set(self._peak_nbytes)
            self._metrics.sessions.labels("compressed").set(len(self._entries))
            self._metrics.kv_memory.labels("compressed").set(self._compressed_nbytes)


def store_pins(positions: np.ndarray) -> np.ndarray:
    """bool [n]: the tokens of a stored conversation the ladder leaves alone: the attention sinks and
    the recent window, which is at most a quarter of the conversation (the newest tokens carry the
    most for its next turn; INT4 on them costs the most, docs/serving.md)."""
    return pinned_mask(positions, recent=min(RECENT_TOKENS, len(positions) // 4))


def drop_order(tiers: np.ndarray, pinned: np.ndarray, importance: np.ndarray, room: int) -> np.ndarray:
    """Indices of at most ``room`` tokens the drop rung may drop (kept and not pinned), least
    important first (ties: oldest first)."""
    droppable = np.flatnonzero((tiers != Tier.DROP) & ~pinned)
    if room <= 0 or len(droppable) == 0:
        return droppable[:0]
    return droppable[np.argsort(importance[droppable], kind="stable")][:room]


def _drop_order(entry: StoredConversation, min_kept_fraction: float) -> np.ndarray:
    """The entry's ``drop_order`` down to ``min_kept_fraction`` of its tokens."""
    room = entry.n_kept - math.ceil(min_kept_fraction * entry.n_tokens)
    kept = entry.tiers != Tier.DROP
    tail = (
        np.arange(entry.n_tokens) >= window_start(kept, tail_tokens(entry.contract))
        if tail_tokens(entry.contract)
        else False
    )
    return drop_order(entry.tiers, entry.pinned | tail, entry.importance, room)


def _token_shares(entry: StoredConversation) -> np.ndarray:
    """float64 [n]: each token's estimated share of the payload's chunk bytes, in proportion to its
    tier's size before zstd (zstd shrinks every tier a little, INT8 the most)."""
    c = entry.contract
    raw = np.array([token_nbytes(tier, c.n_kv_heads, c.head_dim) for tier in Tier])[entry.tiers]
    return entry.chunk_nbytes * raw / raw.sum()


def _decoded(entry: StoredConversation) -> tuple[KVSnapshot, np.ndarray | None]:
    """The entry's KV as a float32 snapshot of all its tokens (dropped ones, and windowed cells before the
    payload's window, hold zeros), and the importance its payload carries."""
    buffers: list[np.ndarray] = []

    def full_size(header: EDKVHeader) -> np.ndarray:
        c = header.contract
        buffers.append(np.zeros((c.n_layers, 2, c.n_kv_heads, header.n_tokens, c.head_dim), np.float32))
        return buffers[0]

    reader = EDKVReader(entry.contract, max_tokens=entry.n_tokens, target_factory=full_size)
    reader.feed(entry.payload)
    header = reader.finish()
    kv = buffers[0]
    if header.n_kept < header.n_tokens:  # the reader wrote the kept tokens compacted: move them to their slots
        kv[:, :, :, header.kept] = kv[:, :, :, : header.n_kept].copy()
        kv[:, :, :, ~header.kept] = 0
    snapshot = KVSnapshot(header.contract, header.token_ids, header.positions, kv[:, 0], kv[:, 1], header.producer)
    return snapshot, header.importance


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"

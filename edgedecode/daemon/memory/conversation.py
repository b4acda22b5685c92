"""A stored conversation: an idle conversation's KV as one EDKV payload, and the pure functions that
make it and make it smaller (the ladder's re-tier and drop rungs re-encode it).

Every function here is numpy and zstd work on values it is given, with no shared state: the daemon
runs them on its ingest thread, never on the event loop.

Re-tier: every token above INT4 goes to INT4, except the pinned ones (attention sinks and the recent
window, ``kv.policy.pinned_mask``), which keep their tier. The window is the prefill policy's 64
tokens, but at most a quarter of the conversation (``store_pins``): with 64, a conversation of a few
short turns would be pinned whole, and the ladder could only evict it. Then, before anything is
dropped, the same tokens go from INT4 to INT3, rotated before quantizing (``STORE_ROTATION``, EDKV 1.3:
the engine and the store's reader undo it): 15 % fewer bytes at a mean KL of 0.009 on SmolLM2, where
dropping 12.5 % of the tokens saves 11 % at 0.010-0.011 and a quarter 22 % at 0.027-0.028; unrotated,
INT3 re-quantized from INT4 costs 0.034, worse than dropping (docs/memory-drop.md). (The rotation's blocks
of 32 channels tile every head size the store's INT4 layout, groups of 32, takes.)

Drop: the least important unpinned tokens become DROP, down to ``min_kept_fraction`` of the
conversation's tokens. Positions are kept (the engine decodes after the gaps as after any dropped
token) and the header still lists every token, so the next prompt is checked against all of them.
"Least important" ranks by the importance that came with the KV (``kv.importance.drop_ranking``): a
pull's EDKV ``importance``, the prefill side's attention scaled to mean 1, which the payload carries
on (so a restored conversation brings it back); tokens computed or generated on this box rank as an
average one. A conversation without any ranks by position importance
(``kv.importance.position_importance``): the oldest tokens after the sinks go first, a sliding window
with attention sinks (StreamingLLM). Attention is the better order where there is one (dropping a
quarter of a 512-token context by it costs about half the KL of dropping by position:
tools/drop_quality.py, docs/memory.md). Pinned tokens are never dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from edgedecode.kv.importance import drop_ranking
from edgedecode.kv.policy import RECENT_TOKENS, pinned_mask
from edgedecode.kv.quant import token_nbytes
from edgedecode.kv.rotation import DEFAULT_ROTATION, Rotation
from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.kv.tiers import Tier
from edgedecode.kv.window import carried_from, tail_tokens, window_start
from edgedecode.kv.wire import EDKVHeader, EDKVReader, encode_payload
from edgedecode.model.spec import KVContract

DEFAULT_TIER = Tier.INT8  # SmolLM2: KL at the decode graph's noise floor (docs/serving.md, tools/bench_store.py)
RETIER_TIERS = (Tier.INT4, Tier.INT3)  # the re-tier rungs' tiers, in order
STORE_ROTATION = Rotation(DEFAULT_ROTATION.kind, DEFAULT_ROTATION.seed, (Tier.INT3,), DEFAULT_ROTATION.block)
MIN_KEPT_FRACTION = 0.5  # the drop rung keeps at least this share of a conversation's tokens
_DROP_MARGIN = 1.05  # the drop rung aims this much past the shortfall: its byte estimate is approximate


@dataclass(frozen=True)
class LadderStep:
    """One thing done to one idle conversation to make room, or to keep max_sessions."""

    action: str  # "retier" (to INT4, or from INT4 to INT3), "drop" (least important tokens) or "evict"
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
        """Bytes held, as the KV memory budget counts them."""
        return len(self.payload) + self.tiers.nbytes + self.importance.nbytes + self.pinned.nbytes


def compress(
    session_id: str,
    snapshot: KVSnapshot,
    importance: np.ndarray | None = None,
    tiers: Tier | np.ndarray = DEFAULT_TIER,
    window_from: int = 0,
    *,
    workers: int = 1,
) -> StoredConversation:
    """The conversation's KV compressed.

    Args:
        session_id: the conversation.
        snapshot: its KV (``Engine.export_kv``), tokens at their true positions.
        importance: float [n], the importance that came with each token's KV (``Engine.given_importance``;
            NaN where none did), kept in the payload; None: none at all. The drop rung ranks by
            ``kv.importance.drop_ranking`` of it.
        tiers: the starting tier of every token, or uint8 [n] Tier codes.
        window_from: the first token whose KV the windowed layers hold (``Engine.windowed_from``): the
            payload's window starts there or later (kv.window), and the windowed tail is never dropped.
        workers: threads that quantize and compress the payload (``encode_payload``).

    Raises:
        ValueError: tiers or importance not shaped [n], importance negative or infinite, no tokens, or KV
            that ``encode_payload`` refuses.
    """
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
    payload, chunk_nbytes = _encoded(snapshot, given_or_none, tier_map, window_from, workers)
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


def retiered(entry: StoredConversation, tier: Tier, *, workers: int = 1) -> StoredConversation | None:
    """``entry`` with every unpinned token above ``tier`` (one of ``RETIER_TIERS``) at ``tier`` (tier codes rise as
    precision falls); None when no token can go lower."""
    if tier not in RETIER_TIERS:
        raise ValueError(f"the store re-tiers to {' or '.join(t.name for t in RETIER_TIERS)}, not {tier.name}")
    lower = ~entry.pinned & (entry.tiers < tier)
    if not lower.any():
        return None
    return _reencoded(entry, np.where(lower, np.uint8(tier), entry.tiers), workers)


def dropped(
    entry: StoredConversation, shortfall: int, min_kept_fraction: float, *, workers: int = 1
) -> StoredConversation | None:
    """``entry`` with its least important droppable tokens DROPped, as many as their estimated bytes
    cover ``shortfall`` (and no more than leave ``min_kept_fraction`` of its tokens); None when none
    may be dropped."""
    order = _drop_order(entry, min_kept_fraction)
    if len(order) == 0:
        return None
    freed_estimate = np.cumsum(_token_shares(entry)[order])
    count = min(int(np.searchsorted(freed_estimate, shortfall * _DROP_MARGIN)) + 1, len(order))
    tiers = entry.tiers.copy()
    tiers[order[:count]] = Tier.DROP
    return _reencoded(entry, tiers, workers)


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


def own_drop_order(positions: np.ndarray, importance: np.ndarray, windowed_tail: int, count: int) -> np.ndarray | None:
    """The positions of the ``count`` least important tokens an active conversation may lose of those
    it holds at ``positions`` (with the ``importance`` that came with their KV, NaN where none did):
    never the attention sinks, the recent window or the last ``windowed_tail`` (kv.window); ranked as
    the drop rung ranks (``drop_ranking``). None when ``count`` is not in (0, what may go]."""
    tail = np.arange(len(positions)) >= len(positions) - windowed_tail
    droppable = np.flatnonzero(~pinned_mask(positions) & ~tail)
    if not 0 < count <= len(droppable):
        return None
    ranking = drop_ranking(importance, positions)
    return positions[droppable[np.argsort(ranking[droppable], kind="stable")][:count]]


def _encoded(
    snapshot: KVSnapshot, importance: np.ndarray | None, tiers: np.ndarray, window_from: int, workers: int
) -> tuple[bytes, int]:
    """The EDKV payload of ``snapshot`` at ``tiers`` carrying ``importance`` (the windowed layers from
    ``window_from`` or their tail on, kv.window), and its bytes in chunk frames."""
    start = carried_from(tiers != Tier.DROP, snapshot.contract, window_from)
    rotation = STORE_ROTATION if (tiers == Tier.INT3).any() else None  # a payload without INT3 stays EDKV 1.2
    frames = list(
        encode_payload(snapshot, tiers, workers=workers, importance=importance, window_start=start, rotation=rotation)
    )
    return b"".join(frames), sum(len(frame) for frame in frames[1:-1])  # less the header and the trailer


def reencode_scratch_nbytes(entry: StoredConversation) -> int:
    """Bytes a re-encode of ``entry`` (re-tier or drop) decodes it into: float32 KV of all its tokens, and a
    second copy of its kept tokens' where some were dropped (``_decoded``)."""
    return (entry.n_tokens + (entry.n_kept if entry.n_kept < entry.n_tokens else 0)) * _float32_bytes_per_token(entry)


def restore_scratch_nbytes(entry: StoredConversation) -> int:
    """Bytes a restore of ``entry`` stages its kept tokens in where the slot's KV is on the device (float32
    host staging); on the CPU the reader writes into the slot itself."""
    return entry.n_kept * _float32_bytes_per_token(entry)


def _float32_bytes_per_token(entry: StoredConversation) -> int:
    c = entry.contract
    return c.n_layers * 2 * c.n_kv_heads * c.head_dim * np.dtype(np.float32).itemsize


def _reencoded(entry: StoredConversation, tiers: np.ndarray, workers: int) -> StoredConversation:
    """``entry``'s KV encoded again at ``tiers``."""
    snapshot, importance = _decoded(entry)
    payload, chunk_nbytes = _encoded(snapshot, importance, tiers, entry.window_from, workers)
    return replace(entry, payload=payload, chunk_nbytes=chunk_nbytes, tiers=tiers)


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

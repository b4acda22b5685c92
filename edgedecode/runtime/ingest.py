"""KV received into a sequence's slots from elsewhere: a snapshot, EDKV streams, a stored EDKV payload.

Each source writes the KV of the prompt's tokens it brings into the cache's slots after the kept
ones (a slice assignment, the EDKV reader dequantizing in place, or on CUDA an upload of what it
staged), then ``Sequence.receive`` records which tokens those slots hold. The checks that the KV is
the prompt's and fits run before anything is written (``KVCache.check_injectable``, ``check_prompt_match``
at a stream's header, ``Sequence.check_receivable``).
"""

from __future__ import annotations

import logging

import numpy as np

from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.kv.wire import EDKVHeader, EDKVReader
from edgedecode.runtime.handoff import SegmentReader, StreamedKV
from edgedecode.runtime.kvcache import KVInjectionError
from edgedecode.runtime.sequence import Sequence

logger = logging.getLogger(__name__)


def injectable_count(positions: np.ndarray, prompt_ids: np.ndarray) -> int:
    """Tokens of received KV used: everything before the prompt's last token, which runs here."""
    return int(np.searchsorted(positions, len(prompt_ids) - 1))


def inject_snapshot(sequence: Sequence, prompt_ids: np.ndarray, kv: KVSnapshot, first_slot: int, n: int) -> None:
    """Write the KV of ``kv``'s first ``n`` tokens (checked to be the prompt's) into the slots from
    ``first_slot`` on, and record them."""
    sequence.cache.update(first_slot, kv.keys[:, :, :n], kv.values[:, :, :n])
    sequence.receive(prompt_ids, first_slot, kv.positions[:n])


def segment_reader(sequence: Sequence, prompt_ids: np.ndarray) -> SegmentReader:
    """Opens the EDKV reader of one segment of a stream of ``prompt_ids``'s KV: at its header it checks the
    tokens are the prompt's, start at the segment's first position or later and fit the slots from its
    first slot on, then dequantizes every chunk straight into those slots (``KVCache.ingest_target``)."""
    cache = sequence.cache

    def open_reader(first_position: int, first_slot: int) -> EDKVReader:
        def target(header: EDKVHeader) -> np.ndarray:
            cache.check_prompt_match(header.token_ids, header.positions, prompt_ids)
            sequence.check_receivable(header.positions, first_position, first_slot)
            return cache.ingest_target(first_slot, header.n_kept)

        return EDKVReader(
            cache.spec.kv_contract,
            max_tokens=sequence.max_context - first_slot,
            target_factory=target,
            value_limits=cache.value_limits,
        )

    return open_reader


def adopt_segments(sequence: Sequence, stream: StreamedKV, prompt_ids: np.ndarray) -> int:
    """Make the KV the ended segments of ``stream`` wrote the content of the slots after its kept and head
    ones, and record it; returns how many tokens that is (0 where a segment cut before its window leaves
    the windowed layers short: the rest of the prompt is then computed here)."""
    _, positions, importance = stream.adopted()
    injected = injectable_count(positions, prompt_ids)
    window_from = stream.window_from
    if stream.local_from < stream.covered:
        logger.warning(
            "the KV pulled for positions %d..%d ends before its window does: computing them here instead",
            stream.keep + stream.head,
            stream.covered,
        )
        injected = window_from = 0
    first_slot = stream.kept_slots + stream.head
    spans = [(segment.first_slot, segment.slots) for segment in stream.segments] if injected else []
    sequence.cache.commit_ingest(spans, first_slot + injected)
    sequence.receive(prompt_ids, first_slot, positions[:injected], importance[:injected], window_from=window_from)
    return injected


def restore_payload(sequence: Sequence, prompt_ids: np.ndarray, payload: bytes | bytearray | memoryview) -> None:
    """Read a conversation's KV kept as one EDKV payload (tokens at positions 0, 1, 2, ..., dropped ones
    included) into the empty sequence's slots, and keep the leading positions where it matches ``prompt_ids``.

    Raises:
        KVFormatError: the payload is refused (contract, integrity, size): nothing is kept.
    """
    cache = sequence.cache

    def target(header: EDKVHeader) -> np.ndarray:
        if header.n_kept > sequence.max_context:
            raise KVInjectionError(f"{header.n_kept} kept tokens exceed the context buffer of {sequence.max_context}")
        return cache.ingest_target(0, header.n_kept)

    reader = EDKVReader(
        cache.spec.kv_contract,
        max_tokens=cache.spec.context_length,
        target_factory=target,
        value_limits=cache.value_limits,
    )
    reader.feed(payload)
    header = reader.finish()
    n = min(header.n_tokens, len(prompt_ids))
    matches = (header.positions[:n] == np.arange(n)) & (header.token_ids[:n] == prompt_ids[:n])
    common = int(np.argmin(matches)) if not matches.all() else n
    slots = int(header.slots_before[common])
    cache.commit_ingest([(0, slots)], slots)
    sequence.receive(
        prompt_ids[:common],
        0,
        header.positions[:common],
        None if header.importance is None else header.importance[:common],
        kept=header.kept[:common],
        window_from=header.windowed_slot(common),
    )

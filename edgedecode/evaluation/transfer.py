"""A KV handoff through the real wire format, in one process: encode, decode, verify."""

from __future__ import annotations

import numpy as np

from edgedecode.kv.policy import TierProfile
from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.kv.wire import decode_snapshot, encode_payload
from edgedecode.model.spec import KVContract
from edgedecode.prefill.pipeline import EncodedKV, ScoredPrefill, encode_within_budget


def through_wire(scored: ScoredPrefill, budget: float, policy: str, receiver: KVContract, *,
                 profile: TierProfile | None = None, pdtrim_head_fraction: float = 0.5) -> tuple[KVSnapshot, EncodedKV]:
    """What a decoder with contract ``receiver`` gets for this prefill at ``budget`` under ``policy``."""
    encoded = encode_within_budget(scored, budget, policy, profile=profile, pdtrim_head_fraction=pdtrim_head_fraction)
    return decode_snapshot(b"".join(encoded.frames), receiver), encoded


def with_tiers(snapshot: KVSnapshot, tiers: np.ndarray, receiver: KVContract) -> KVSnapshot:
    """The snapshot sent with explicitly chosen tiers (no budget), as the receiver decodes it."""
    return decode_snapshot(b"".join(encode_payload(snapshot, tiers)), receiver)

"""A KV handoff through the real wire format, in one process: encode, decode, verify."""

from __future__ import annotations

import numpy as np

from edgedecode.kv.rotation import Rotation
from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.kv.wire import decode_snapshot, encode_payload
from edgedecode.model.spec import KVContract


def with_tiers(
    snapshot: KVSnapshot, tiers: np.ndarray, receiver: KVContract, rotation: Rotation | None = None
) -> KVSnapshot:
    """The snapshot sent with explicitly chosen tiers (no budget), as the receiver decodes it (``rotation``: the
    tiers rotated before quantizing, EDKV 1.3)."""
    return decode_snapshot(b"".join(encode_payload(snapshot, tiers, rotation=rotation)), receiver)

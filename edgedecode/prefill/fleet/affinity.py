"""When the prefill tier sends a prompt to the replica whose prefix cache holds it rather than to the least busy one.

A cache hit saves the replica the prefill of the tokens it holds; each request queued ahead costs a whole
request's time. On a GPU replica the encoding (scoring, quantizing, compressing the KV), not the prefill,
dominates a request (docs/performance.md: 4k tokens at b 0.3, 57 ms of prefill in 248 ms), so a hit rarely pays
for even one request of queue: the holder is preferred only while the wait its extra queue is expected to add is
no more than the prefill the hit saves — and never when it has more than ``imbalance`` requests more in hand
than the least busy (``fleet.affinity_imbalance``), which is the whole rule while a replica's speeds are not
known yet. The router (``router.py``) and the fleet simulation (``tools/sim/fleet.py``) both decide with it.
"""

from __future__ import annotations


def prefer_holder(extra_requests: int, imbalance: int, request_s: float | None, saved_s: float | None) -> bool:
    """Whether a prompt goes to the replica that holds its prefix, which has ``extra_requests`` more in hand than
    the least busy replica, where a request there takes ``request_s`` and the hit saves ``saved_s`` (either None:
    not known, the request count alone decides)."""
    if extra_requests > imbalance:
        return False
    if request_s is None or saved_s is None:
        return True
    return extra_requests * request_s <= saved_s

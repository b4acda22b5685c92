"""Fault injection for the tier's own tests: a replica that stops relaying a payload part way.

Serve takes each piece a replica relays as soon as it is yielded, so a replica killed while the client is still
receiving has usually handed its whole answer over already: the stream completes and nothing is cut. To cut a
stream for real, a test names a file in ``EDGEDECODE_FLEET_FAULT_FILE`` (in the environment the replicas start
with) and writes a byte count into it: each prefill answer that begins while the file exists relays that many
bytes of its body and then holds the rest until the replica is killed. Unset (as it is everywhere but in tests),
nothing is read and nothing changes.
"""

from __future__ import annotations

import os
from pathlib import Path

FAULT_FILE_ENV = "EDGEDECODE_FLEET_FAULT_FILE"


def relay_stall_bytes() -> int | None:
    """The body bytes a prefill answer beginning now relays before it stalls; None: no fault (the usual case)."""
    path = os.environ.get(FAULT_FILE_ENV)
    if not path:
        return None
    try:
        return int(Path(path).read_text())
    except FileNotFoundError:
        return None

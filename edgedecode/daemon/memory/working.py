"""The decode daemon's working memory: what a turn's work costs beyond the KV that ``daemon.kv_memory_mb``
counts, held against its own allowance, ``daemon.working_memory_mb``.

Two kinds, both transient:

- a turn's prompt runs: onnxruntime's working memory for a run of up to PREFILL_CHUNK_TOKENS rows
  after the turn's kept context (``runtime.runner.prompt_run_bytes``: the attention probabilities of
  every head, the projections and the MLP's activations), given back to the OS when each prompt run
  ends on the CPU (the arena shrinks). A turn holds its largest run's estimate from admission until
  its slot is settled.
- the ingest thread's scratch: the float32 copy of a conversation's KV that a move to the store makes
  where it cannot read the slot in place (tokens dropped, or KV on the device), and the decoded KV of
  a restore or of a stored conversation re-encoded by the ladder, each held while it runs.

What does not fit is refused as the KV budget refuses (``KVMemoryError``, 503): a turn before anything
is fetched, a move to the store or a restore by evicting the conversation (counted), a re-encode by
leaving it to the ladder's next rung.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from edgedecode.errors import EdgeDecodeError
from edgedecode.runtime.engine import PREFILL_CHUNK_TOKENS


class KVMemoryError(EdgeDecodeError):
    """A turn's KV does not fit the memory the daemon may use for it, even with every idle
    conversation evicted, or it would eat into the system memory reserve, or its work does not fit
    the working-memory allowance beside the other turns' (503)."""

    http_status = 503
    http_code = "insufficient_memory"
    retry_after_s = 5


# What the process keeps after its first turns beyond any one turn's work: glibc's and onnxruntime's bookkeeping,
# the arena's first region, Python objects. Measured: 22 MiB after a 2048-token turn (tools/bench/rss_breakdown.py),
# 10-23 MiB above the KV and the counted working memory in tools/bench/memory.py's 128-conversation cells.
RESIDUE_BYTES = 32 << 20


def sized_allowance_bytes(
    prompt_run_bytes: Callable[[int, int], int], slots: int, max_context: int, float32_bytes_per_token: int
) -> int:
    """The allowance ``daemon.working_memory_mb = 0`` stands for: every slot's turn running its largest
    prompt run (PREFILL_CHUNK_TOKENS rows after ``max_context`` positions) while the ingest thread holds a
    float32 copy of a ``max_context``-token conversation's KV (the most one move, restore or re-encode needs
    short of a move with dropped tokens), plus the process's residue (``RESIDUE_BYTES``, never held by a turn)."""
    rows = min(PREFILL_CHUNK_TOKENS, max_context)
    return slots * prompt_run_bytes(rows, max_context) + max_context * float32_bytes_per_token + RESIDUE_BYTES


class WorkingMemory:
    """The working-memory book: held bytes by holder against ``allowance_bytes`` (None: counted, never
    refused). Thread-safe."""

    def __init__(self, allowance_bytes: int | None) -> None:
        if allowance_bytes is not None and allowance_bytes < 0:
            raise ValueError(f"allowance_bytes must be >= 0, got {allowance_bytes}")
        self.allowance_bytes = allowance_bytes
        self._turns: dict[int, int] = {}  # by slot
        self._scratch = 0
        self.peak_nbytes = 0  # the most held at once
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes held now: the turns' prompt runs and the ingest thread's scratch."""
        return sum(self._turns.values()) + self._scratch

    def hold_turn(self, slot: int, nbytes: int) -> None:
        """Hold ``nbytes`` for the prompt runs of the turn on slot ``slot`` (replacing what it held) until
        ``release_turn``.

        Raises:
            KVMemoryError: they do not fit the allowance beside what the others hold; nothing changes.
        """
        with self._lock:
            self._add(nbytes - self._turns.get(slot, 0), f"the prompt runs of this turn need {_mib(nbytes)}")
            self._turns[slot] = nbytes

    def release_turn(self, slot: int) -> None:
        """Give back what the turn on slot ``slot`` held (none: a no-op)."""
        with self._lock:
            self._turns.pop(slot, None)

    @contextlib.contextmanager
    def scratch(self, nbytes: int, what: str) -> Iterator[None]:
        """Hold ``nbytes`` of scratch for ``what`` for the block.

        Raises:
            KVMemoryError: they do not fit the allowance beside what the others hold (the block does not run).
        """
        with self._lock:
            self._add(nbytes, f"{what} needs {_mib(nbytes)} of scratch")
            self._scratch += nbytes
        try:
            yield
        finally:
            with self._lock:
                self._scratch -= nbytes

    def _add(self, nbytes: int, why: str) -> None:
        """Check that ``nbytes`` more fit (under the lock) and count the peak they make."""
        held = self.nbytes
        if self.allowance_bytes is not None and nbytes > 0 and held + nbytes > self.allowance_bytes:
            raise KVMemoryError(
                f"{why}: more than the working memory left of daemon.working_memory_mb "
                f"({_mib(self.allowance_bytes)}, {_mib(held)} held by other work)"
            )
        self.peak_nbytes = max(self.peak_nbytes, held + nbytes)


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"

"""A turn's deadline: when its first token is due under its time-to-first-token target.

Made once per turn from the target (``daemon.ttft_target_ms``, or the request's ``ttft_target_ms``)
and the request's arrival, as an absolute time (``time.perf_counter()`` seconds), and passed to
everything that plans or watches the turn's KV, which asks it for the time left (``left_s``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Deadline:
    """When something is due (``at``, ``time.perf_counter()`` seconds) under ``target_s``, the turn's
    time-to-first-token target; without a target (None) nothing is ever due."""

    target_s: float | None = None
    at: float = math.inf

    @classmethod
    def for_turn(cls, target_ms: float, arrived: float) -> Deadline:
        """The deadline of a turn that arrived at ``arrived`` under a target of ``target_ms`` (<= 0: none)."""
        return cls(target_ms / 1e3, arrived + target_ms / 1e3) if target_ms > 0 else cls()

    @classmethod
    def within(cls, seconds: float) -> Deadline:
        """Due ``seconds`` from now (a plan's own deadline, for a turn without a target)."""
        return cls(seconds, time.perf_counter() + seconds)

    def left_s(self) -> float | None:
        """Seconds left until it is due (negative once past); None without a target."""
        return None if self.target_s is None else self.at - time.perf_counter()

    def earlier(self, seconds: float) -> Deadline:
        """Due ``seconds`` sooner (what must be ready before the last step does)."""
        return replace(self, at=self.at - seconds)

"""A circuit breaker for the prefill endpoint: after repeated failures, skip it for a while."""

from __future__ import annotations

import time
from collections.abc import Callable


class CircuitBreaker:
    """Closed: calls go through. ``failures`` consecutive failures open it: calls are refused for
    ``reset_seconds``; then one trial call is let through (half-open), whose outcome closes or
    reopens it.
    """

    def __init__(self, failures: int, reset_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.failure_threshold = failures
        self.reset_seconds = reset_seconds
        self._clock = clock
        self._failures = 0
        self._opened_at: float | None = None
        self._trial_running = False

    @property
    def state(self) -> str:
        """ "closed", "open" or "half-open"."""
        if self._opened_at is None:
            return "closed"
        return "half-open" if self._clock() - self._opened_at >= self.reset_seconds else "open"

    def allow(self) -> bool:
        """Whether a call may go to the endpoint now (in half-open state, only one at a time)."""
        state = self.state
        if state == "closed":
            return True
        if state == "half-open" and not self._trial_running:
            self._trial_running = True
            return True
        return False

    def record_success(self) -> None:
        self._failures, self._opened_at, self._trial_running = 0, None, False

    def record_failure(self) -> None:
        self._failures += 1
        if self._trial_running or self._failures >= self.failure_threshold:
            self._opened_at = self._clock()
        self._trial_running = False

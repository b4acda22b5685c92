"""A circuit breaker for the prefill endpoint: after repeated failures, skip it for a while."""

from __future__ import annotations

import time
from collections.abc import Callable


class CircuitBreaker:
    """Closed: calls go through. ``failures`` consecutive failures open it: calls are refused for
    ``reset_seconds``; then one trial call is let through (half-open), whose outcome closes or
    reopens it. A trial whose outcome is never recorded (its caller went away, or did not call
    after all) is given up ``reset_seconds`` after it began and another is let through, so the
    breaker cannot stay half-open for good. ``on_transition`` is told "open" each time the breaker
    opens and "closed" each time it closes again.
    """

    def __init__(
        self,
        failures: int,
        reset_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        on_transition: Callable[[str], None] | None = None,
    ) -> None:
        self.failure_threshold = failures
        self.reset_seconds = reset_seconds
        self._clock = clock
        self._on_transition = on_transition
        self._failures = 0
        self._opened_at: float | None = None
        self._trial_since: float | None = None  # when the running trial was let through

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
        now = self._clock()
        if state == "half-open" and (self._trial_since is None or now - self._trial_since >= self.reset_seconds):
            self._trial_since = now
            return True
        return False

    def record_success(self) -> None:
        reopened = self._opened_at is not None
        self._failures, self._opened_at, self._trial_since = 0, None, None
        if reopened:
            self._tell("closed")

    def record_failure(self) -> None:
        self._failures += 1
        if self._trial_since is not None or self._failures >= self.failure_threshold:
            was_open = self.state == "open"
            self._opened_at = self._clock()
            if not was_open:
                self._tell("open")
        self._trial_since = None

    def _tell(self, transition: str) -> None:
        if self._on_transition is not None:
            self._on_transition(transition)

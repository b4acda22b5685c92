"""A clock the test moves by hand, for code that takes an injected ``clock: Callable[[], float]``."""

from __future__ import annotations


class FakeClock:
    """Seconds that pass only when a test adds to ``now`` (starting at 1000, far from zero)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

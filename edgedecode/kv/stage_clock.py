"""Where a payload's time goes: CPU and wall seconds per named stage, summed over calls and threads.

CPU time is the calling thread's (``time.thread_time``) by default, so stages run on several threads at once add up
to the work done, and other processes on a shared machine do not inflate it as they inflate wall time. Work a stage
hands to threads it does not run on (onnxruntime's intra-op pool) is not counted; a clock on ``time.process_time``
counts it, and is right wherever one stage runs at a time (a benchmark's serial run).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class StageClock:
    """Accumulates ``cpu_s``, ``wall_s`` and ``calls`` per stage name; safe to use from several threads."""

    def __init__(self, cpu_clock: Callable[[], float] = time.thread_time) -> None:
        self.cpu_clock = cpu_clock
        self.cpu_s: dict[str, float] = defaultdict(float)
        self.wall_s: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the block as ``name``."""
        cpu, wall = self.cpu_clock(), time.perf_counter()
        try:
            yield
        finally:
            cpu, wall = self.cpu_clock() - cpu, time.perf_counter() - wall
            with self._lock:
                self.cpu_s[name] += cpu
                self.wall_s[name] += wall
                self.calls[name] += 1

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{stage: {"cpu_s", "wall_s", "calls"}}`` in the order the stages first ran."""
        with self._lock:
            return {name: {"cpu_s": self.cpu_s[name], "wall_s": self.wall_s[name], "calls": self.calls[name]}
                    for name in self.calls}  # fmt: skip


class _Unclocked(StageClock):
    """A clock that records nothing (the default)."""

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        yield


UNCLOCKED = _Unclocked()

"""Rate traces for the link shaper: how a shaped link's bandwidth changes over one request.

A trace is a pure function ``rate_at(elapsed_s, bytes_down) -> bytes/s`` of the time since it
started and of the bytes the shaper forwarded downstream since then:

* ``constant(rate)``: one rate throughout;
* ``step(high, low, at_bytes=... | at_s=...)``: ``high`` until the link has carried ``at_bytes``
  (so the step lands inside a transfer whatever its timing) or until ``at_s`` seconds, then ``low``;
* ``random_walk(lo, hi, every_s, seed)``: a new rate every ``every_s`` seconds, a walk in log
  space (each step multiplies the rate by ``exp(u)``, u uniform in ±``log_step``, reflected at the
  bounds); the sequence depends only on the seed and the step index, so every replay is the same.

``TracePlayer(shaper, trace)`` plays a trace on a ``LinkShaper`` from a background thread:
``start()`` resets the clock and the byte count to zero and sets the first rate, the thread then
polls every ``tick_s`` and calls ``set_rate`` whenever the trace's rate changes; ``stop()`` ends
the thread and leaves the last rate in place. Each play records every change as (seconds since
start, bytes/s) in ``changes`` and the bytes forwarded every ``sample_every_s`` in ``progress``
(seconds, bytes), for plots; ``goodput_bps()`` is the rate the bytes actually came at (the link
may deliver less than its rate: the proxy's own speed, or a reader that falls behind). Start and
stop it around each request. ``describe(trace)`` gives a
trace's kind and parameters for a report.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Protocol

import numpy as np

from edgedecode.testing.link_shaper import LinkShaper

MBIT = 125_000.0  # bytes per second in one Mbit/s


class RateTrace(Protocol):
    """A link's rate over one request."""

    def rate_at(self, elapsed_s: float, bytes_down: int) -> float:
        """The rate (bytes/s) ``elapsed_s`` after the start, with ``bytes_down`` forwarded since."""
        ...


@dataclass(frozen=True)
class Constant:
    """One rate throughout."""

    rate: float

    def rate_at(self, elapsed_s: float, bytes_down: int) -> float:
        return self.rate


@dataclass(frozen=True)
class Step:
    """``high``, then ``low`` from the moment ``at_bytes`` have gone down or ``at_s`` have passed."""

    high: float
    low: float
    at_bytes: int | None = None
    at_s: float | None = None

    def rate_at(self, elapsed_s: float, bytes_down: int) -> float:
        stepped = (self.at_bytes is not None and bytes_down >= self.at_bytes) or (
            self.at_s is not None and elapsed_s >= self.at_s
        )
        return self.low if stepped else self.high


@dataclass
class RandomWalk:
    """A seeded walk of the rate in log space between ``lo`` and ``hi`` (see the module docstring)."""

    lo: float
    hi: float
    every_s: float
    seed: int
    start: float  # the first rate
    log_step: float
    _rates: list[float] = field(init=False, repr=False, compare=False)
    _rng: np.random.Generator = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._rates = [self.start]
        self._rng = np.random.default_rng(self.seed)

    def rate_at(self, elapsed_s: float, bytes_down: int) -> float:
        index = max(int(elapsed_s / self.every_s), 0)
        low, high = math.log(self.lo), math.log(self.hi)
        while len(self._rates) <= index:
            x = math.log(self._rates[-1]) + self._rng.uniform(-self.log_step, self.log_step)
            x = 2 * high - x if x > high else 2 * low - x if x < low else x
            self._rates.append(math.exp(min(max(x, low), high)))
        return self._rates[index]


def constant(rate: float) -> Constant:
    """One rate (bytes/s) throughout."""
    if rate <= 0:
        raise ValueError("need rate > 0")
    return Constant(float(rate))


def step(high: float, low: float, *, at_bytes: int | None = None, at_s: float | None = None) -> Step:
    """``high`` (bytes/s) until ``at_bytes`` have gone down or ``at_s`` seconds have passed (exactly
    one of the two), then ``low``."""
    if high <= 0 or low <= 0:
        raise ValueError("need high > 0 and low > 0")
    if (at_bytes is None) == (at_s is None):
        raise ValueError("give exactly one of at_bytes and at_s")
    if (at_bytes is not None and at_bytes < 0) or (at_s is not None and at_s < 0):
        raise ValueError("need at_bytes >= 0 or at_s >= 0")
    return Step(float(high), float(low), at_bytes, at_s)


def random_walk(
    lo: float = 5 * MBIT,
    hi: float = 100 * MBIT,
    every_s: float = 0.1,
    seed: int = 0,
    *,
    start: float | None = None,
    log_step: float = 0.25,
) -> RandomWalk:
    """A rate (bytes/s) between ``lo`` and ``hi`` changing every ``every_s`` seconds: a walk in log
    space, each step ×exp(u) with u uniform in ±``log_step`` (±0.25: ×0.78 to ×1.28), reflected at
    the bounds; it starts at ``start`` (default: the geometric mean of the bounds)."""
    if not 0 < lo < hi or every_s <= 0 or log_step <= 0:
        raise ValueError("need 0 < lo < hi, every_s > 0 and log_step > 0")
    first = math.sqrt(lo * hi) if start is None else float(start)
    if not lo <= first <= hi:
        raise ValueError(f"start {first} is outside [{lo}, {hi}]")
    return RandomWalk(float(lo), float(hi), float(every_s), seed, first, float(log_step))


def describe(trace: RateTrace) -> dict:
    """The trace's kind and parameters (for a report)."""
    params: dict[str, object] = {}
    if is_dataclass(trace):
        params = {f.name: getattr(trace, f.name) for f in fields(trace) if f.init}
    return {"kind": type(trace).__name__, **params}


class TracePlayer:
    """Plays ``trace`` on ``shaper`` from a background thread (see the module docstring)."""

    def __init__(
        self, shaper: LinkShaper, trace: RateTrace, *, tick_s: float = 0.005, sample_every_s: float = 0.05
    ) -> None:
        self.shaper = shaper
        self.trace = trace
        self.tick_s = tick_s
        self.sample_every_s = sample_every_s
        self.changes: list[tuple[float, float]] = []  # (seconds since start, bytes/s)
        self.progress: list[tuple[float, int]] = []  # (seconds since start, bytes forwarded since)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started_at = 0.0
        self._bytes_at_start = 0
        self._first_seen: tuple[float, int] | None = None  # the first poll that saw bytes: (seconds, bytes)
        self._last_new: tuple[float, int] | None = None  # the last poll that saw new bytes

    def start(self) -> None:
        """Restart the trace now: time and bytes from zero, its first rate set before this returns."""
        self.stop()
        self.changes, self.progress = [], []
        self._first_seen = self._last_new = None
        self._stop = threading.Event()
        self._started_at = time.monotonic()
        self._bytes_at_start = self.shaper.bytes_down
        self._poll()
        self._thread = threading.Thread(target=self._run, name="link-trace", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread (the shaper keeps the last rate); a no-op when not playing."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.progress.append(self._reading())  # progress ends where the request did

    def goodput_bps(self) -> float | None:
        """Bytes per second from the first poll that saw bytes to the last that saw new ones (at the
        player's tick resolution); None until bytes arrived over at least one tick."""
        if self._first_seen is None or self._last_new is None or self._last_new[0] <= self._first_seen[0]:
            return None
        return (self._last_new[1] - self._first_seen[1]) / (self._last_new[0] - self._first_seen[0])

    def __enter__(self) -> TracePlayer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            self._poll()

    def _reading(self) -> tuple[float, int]:
        """(seconds since start, bytes forwarded since)."""
        return time.monotonic() - self._started_at, self.shaper.bytes_down - self._bytes_at_start

    def _poll(self) -> None:
        elapsed, forwarded = self._reading()
        rate = self.trace.rate_at(elapsed, forwarded)
        if not self.changes or rate != self.changes[-1][1]:
            self.shaper.set_rate(rate)
            self.changes.append((elapsed, rate))
        if not self.progress or elapsed - self.progress[-1][0] >= self.sample_every_s:
            self.progress.append((elapsed, forwarded))
        if forwarded and self._first_seen is None:
            self._first_seen = (elapsed, forwarded)
        if forwarded and (self._last_new is None or forwarded > self._last_new[1]):
            self._last_new = (elapsed, forwarded)

"""The decode daemon's KV memory and RSS over time, sampled while tools/bench/memory.py sends
turns: every ``SAMPLE_EVERY_S`` the process's RSS (psutil) and, on its own thread, a scrape of
``/metrics`` (``edgedecode_kv_memory_bytes{state}`` and, where the daemon exports it,
``edgedecode_kv_memory_peak_bytes``, the high-water mark the budget has counted).

A scrape waits for the daemon's event loop and competes with its onnxruntime threads for the
cores (on 2 busy cores a scrape takes up to a few hundred ms); a sampler that falls behind keeps
its schedule, skipping the ticks it missed, so a sample's time is when it was taken and the rate
achieved is reported. Short peaks between samples are what the peak gauge is for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType

import psutil

from edgedecode.testing.metrics_scrape import scrape_metrics

SAMPLE_EVERY_S = 0.1
STATES = ("active", "resident", "compressed")
PEAK = "edgedecode_kv_memory_peak_bytes"
SCRAPE_TIMEOUT_S = 5.0


def scrape(url: str, timeout: float = SCRAPE_TIMEOUT_S) -> dict[str, float]:
    """Every sample of the daemon's /metrics, keyed ``name{k=v,...}`` (labels sorted; ``name{}`` for none)."""
    return scrape_metrics(url, timeout=timeout)


def kv_memory(samples: dict[str, float]) -> dict[str, float]:
    """Bytes of KV the budget counts, by state."""
    return {state: samples.get(f"edgedecode_kv_memory_bytes{{state={state}}}", 0.0) for state in STATES}


class MemorySampler:
    """A context manager sampling the daemon at ``url`` (process ``pid``) until it exits, on two
    threads, so that a slow scrape does not hold up the RSS.

    ``kv_rows``: ``[t_s, active, resident, compressed, peak]``, bytes (``peak`` None where the daemon
    exports no peak gauge; a failed scrape is no row); ``rss_rows``: ``[t_s, rss]``; ``t_s`` since
    the sampler started.
    """

    def __init__(self, url: str, pid: int) -> None:
        self.url = url
        self.process = psutil.Process(pid)
        self.kv_rows: list[list[float | None]] = []
        self.rss_rows: list[list[float]] = []
        self.started = time.perf_counter()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._every, args=(self._kv, self.kv_rows), name="kv-sampler", daemon=True),
            threading.Thread(target=self._every, args=(self._rss, self.rss_rows), name="rss-sampler", daemon=True),
        ]

    def __enter__(self) -> MemorySampler:
        self.started = time.perf_counter()
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def now(self) -> float:
        """Seconds since the sampler started (the rows' clock)."""
        return time.perf_counter() - self.started

    def _every(self, sample: Callable[[float], list | None], rows: list) -> None:
        """Append ``sample(now)`` to ``rows`` every ``SAMPLE_EVERY_S`` (missed ticks are skipped)."""
        tick = 0
        while not self._stop.is_set():
            row = sample(round(self.now(), 3))
            if row is not None:
                rows.append(row)
            tick = max(tick + 1, int(self.now() / SAMPLE_EVERY_S) + 1)
            self._stop.wait(max(tick * SAMPLE_EVERY_S - self.now(), 0.0))

    def _kv(self, t: float) -> list[float | None] | None:
        try:
            samples = scrape(self.url)
        except OSError:  # the daemon is going away, or its loop was held past the timeout
            return None
        states = kv_memory(samples)
        return [t, *(states[s] for s in STATES), samples.get(PEAK + "{}")]

    def _rss(self, t: float) -> list[float] | None:
        try:
            return [t, float(self.process.memory_info().rss)]
        except psutil.Error:  # the daemon has exited
            return None

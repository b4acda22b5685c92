"""The edge box's own prefill speed: seconds to prefill a prompt of n tokens through the INT4 decode graph.

``LocalPrefillModel`` interpolates log(seconds) linearly in log(n) between measured points (a power
law between neighbours), extrapolating with the slope over the last (first) octave or more.

Why not a fit of a + b·n + c·n²: the engine prefills in runs of at most PREFILL_CHUNK_TOKENS (512 then)
tokens, so the curvature measured within one run (16..512 tokens) does not continue past it, and c
is set by a few percent of noise at 512. Calibrated at 16, 128 and 512 tokens on 2 CPU cores
(SmolLM2-135M, 6 calibrations), the quadratic predicted 1.18-1.24x the measured prefill at 1024
tokens and 1.41-1.56x at 2000; the log-log interpolation 1.02-1.03x and 0.94-0.97x, and 0.96-1.02x
at 300 for both. (Interpolating seconds, rather than log seconds, in log n was 1.3-1.4x off between
the points: prefill time is close to proportional to n.)

Points live in half-octave bands of n; a band's point is a moving average (``smoothing``: the weight
of the newest sample) of log n and log seconds, so recent prefills count more and memory is bounded
by the number of bands. Predictions are monotonic non-decreasing in n: band values are made
non-decreasing (pool adjacent violators), the slope past the last band is held in [1, 2] (each
further chunk costs at least as much as the first) and below the first in [0, 1].
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from edgedecode.runtime.engine import Engine

CALIBRATION_LENGTHS = (16, 128, 512)
BANDS_PER_OCTAVE = 2
_LN2 = math.log(2.0)
_PATTERN_TOKENS = 64  # distinct ids in the synthetic calibration prompt


@dataclass(frozen=True)
class _Curve:
    """The fitted points (ascending log n, non-decreasing log seconds) and the end slopes."""

    log_n: np.ndarray
    log_s: np.ndarray
    slope_below: float
    slope_above: float


def _pool_adjacent_violators(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The weighted least-squares non-decreasing sequence closest to ``values`` (a few points)."""
    means: list[float] = []
    sizes: list[float] = []
    counts: list[int] = []
    for value, weight in zip(values.tolist(), weights.tolist()):
        means.append(value)
        sizes.append(weight)
        counts.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            weight_sum = sizes[-2] + sizes[-1]
            merged = (means[-2] * sizes[-2] + means[-1] * sizes[-1]) / weight_sum
            count = counts[-2] + counts[-1]
            del means[-1], sizes[-1], counts[-1]
            means[-1], sizes[-1], counts[-1] = merged, weight_sum, count
    return np.repeat(np.asarray(means), counts)


def _end_slope(log_n: np.ndarray, log_s: np.ndarray, end: int, low: float, high: float) -> float:
    """Slope of log seconds in log n from point ``end`` (0 or -1) to the nearest point at least an
    octave away (else the farthest one), clipped to [low, high]; 1 (proportional) with a single point."""
    if len(log_n) < 2:
        return 1.0
    far = np.flatnonzero(np.abs(log_n - log_n[end]) >= _LN2 - 1e-9)
    nearest_far = (far[0], far[-1]) if len(far) else (len(log_n) - 1, 0)  # (from the first, from the last)
    other = int(nearest_far[0] if end == 0 else nearest_far[1])
    slope = (log_s[other] - log_s[end]) / (log_n[other] - log_n[end])
    return float(np.clip(slope, low, high))


class LocalPrefillModel:
    """Seconds this box takes to prefill n prompt tokens locally, learned from (n, seconds) samples.

    Give it points with ``calibrate`` (a short measurement on an engine) or from samples; refine it
    with ``observe`` after each real local prefill. Until it has a point, it predicts infinity
    (local prefill not to be counted on). ``calibrate``/``observe`` may run on one thread while
    ``predict_seconds`` runs on others.
    """

    def __init__(self, samples: Iterable[tuple[int, float]] = (), *, smoothing: float = 0.3) -> None:
        """``samples``: (n_tokens, seconds) pairs, e.g. from a calibration, taken as they are (several
        in one band are averaged as ``observe`` does). ``smoothing`` in (0, 1]: the weight a new
        sample gets in its band's moving average (1 keeps only the newest)."""
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], not {smoothing}")
        self.smoothing = smoothing
        self.calibration_seconds = 0.0  # wall time of the calibration that built this model, if any
        self._bands: dict[int, tuple[float, float]] = {}  # band -> (mean log n, mean log seconds)
        self._lock = threading.Lock()
        self._curve: _Curve | None = None
        for n_tokens, seconds in samples:
            self._add(n_tokens, seconds, blend=False)

    def calibrate(
        self,
        engine: Engine,
        lengths: Sequence[int] = CALIBRATION_LENGTHS,
        *,
        runs: int = 3,
        budget_seconds: float = 1.5,
        clock: Callable[[], float] = time.perf_counter,
    ) -> LocalPrefillModel:
        """Measure ``engine.prefill`` (computed locally) on synthetic prompts of each of ``lengths``
        tokens (those the engine's context holds: a length past it is measured at the longest prompt
        it takes), the median of ``runs`` runs per length (runs past the second are skipped once
        ``budget_seconds`` have passed), and make those medians this model's points (earlier ones
        are dropped). Returns the model itself; ``calibration_seconds`` is how long it took.

        The prompts repeat a fixed run of ordinary token ids from the vocabulary's first eighth
        (past the special tokens). The engine is left reset (nothing cached). Run it on the engine's
        own thread, before serving. ``clock`` times each prefill (the wall clock; a test may count CPU time
        instead, which a loaded machine inflates far less); the budget and ``calibration_seconds`` are wall time.
        """
        if runs < 1:
            raise ValueError(f"runs must be at least 1, not {runs}")
        vocab = int(engine.spec.vocab_size)
        start = min(vocab // 8, max(vocab - _PATTERN_TOKENS, 0))
        pattern = start + np.arange(_PATTERN_TOKENS, dtype=np.int64) * 7 % min(_PATTERN_TOKENS, vocab)
        began = time.perf_counter()
        samples = []
        try:
            engine.prefill(pattern[:1])  # warm-up: first-run allocations are not prefill speed
            for n_tokens in sorted({min(n, engine.max_context - 1) for n in lengths}):
                prompt = np.resize(pattern, n_tokens)
                times = []
                for run in range(runs):
                    if run >= 2 and time.perf_counter() - began > budget_seconds:
                        break
                    tic = clock()
                    engine.prefill(prompt)
                    times.append(clock() - tic)
                samples.append((n_tokens, float(np.median(times))))
        finally:
            engine.reset()
        with self._lock:
            self._bands.clear()
            self._curve = None
        for n_tokens, seconds in samples:
            self._add(n_tokens, seconds, blend=False)
        self.calibration_seconds = time.perf_counter() - began
        return self

    @property
    def ready(self) -> bool:
        """Whether there is at least one sample to predict from."""
        return self._curve is not None

    def points(self) -> list[tuple[float, float]]:
        """The model's points, (n_tokens, seconds) in ascending n, as predictions pass through them."""
        curve = self._curve
        if curve is None:
            return []
        return list(zip(np.exp(curve.log_n).tolist(), np.exp(curve.log_s).tolist()))

    def observe(self, n_tokens: int, seconds: float) -> None:
        """Take in a real local prefill of ``n_tokens`` tokens that took ``seconds`` (ignored unless
        both are positive): the model's point for its band (the current prediction there if the band
        has none yet) moves toward it by ``smoothing``, in log n and log seconds."""
        self._add(n_tokens, seconds, blend=True)

    def _add(self, n_tokens: int, seconds: float, *, blend: bool) -> None:
        if n_tokens <= 0 or not seconds > 0.0 or not math.isfinite(seconds):
            return
        log_n, log_s = math.log(n_tokens), math.log(seconds)
        band = round(BANDS_PER_OCTAVE * log_n / _LN2)
        with self._lock:
            held = self._bands.get(band)
            if held is None and blend and self._curve is not None:
                held = (log_n, math.log(self.predict_seconds(n_tokens)))
            if held is not None:
                keep = 1.0 - self.smoothing
                log_n = keep * held[0] + self.smoothing * log_n
                log_s = keep * held[1] + self.smoothing * log_s
            self._bands[band] = (log_n, log_s)
            self._curve = self._fit()

    def _fit(self) -> _Curve:
        points = np.array([self._bands[band] for band in sorted(self._bands)])
        log_n, log_s = points[:, 0], _pool_adjacent_violators(points[:, 1], np.ones(len(points)))
        return _Curve(
            log_n=log_n,
            log_s=log_s,
            slope_below=_end_slope(log_n, log_s, 0, 0.0, 1.0),
            slope_above=_end_slope(log_n, log_s, -1, 1.0, 2.0),
        )

    def predict_seconds(self, n_tokens: int) -> float:
        """Predicted seconds to prefill ``n_tokens`` tokens here: 0 for none, infinity before any
        point (see ``ready``); non-decreasing in n."""
        if n_tokens <= 0:
            return 0.0
        curve = self._curve
        if curve is None:
            return math.inf
        x = math.log(n_tokens)
        if x < curve.log_n[0]:
            y = curve.log_s[0] + curve.slope_below * (x - curve.log_n[0])
        elif x > curve.log_n[-1]:
            y = curve.log_s[-1] + curve.slope_above * (x - curve.log_n[-1])
        else:
            y = float(np.interp(x, curve.log_n, curve.log_s))
        return math.exp(y)

    def predict_between(self, start: int, end: int) -> float:
        """Predicted seconds to compute prompt positions [start, end) here after those before them
        (a split's head, a cut pull's rest): 0 for none, infinity before any point."""
        if end <= start:
            return 0.0
        if self._curve is None:
            return math.inf
        return max(self.predict_seconds(end) - self.predict_seconds(start), 0.0)

    def tokens_per_second(self, n_tokens: int) -> float:
        """Predicted prefill speed for a prompt of ``n_tokens`` tokens (0 before any point)."""
        seconds = self.predict_seconds(n_tokens)
        return n_tokens / seconds if 0 < seconds < math.inf else 0.0

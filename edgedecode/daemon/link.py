"""What the daemon knows of the link to each prefill server, learned from every pull.

For one endpoint a ``LinkModel`` keeps three moving averages across pulls:

* goodput (bytes/s) of the payload transfer: the bytes of a pull's body after its first network
  read over the time from the first read to the last (the first read's bytes arrived before its
  clock reading, so they are left out). A pull that says too little about it (its body in one
  read, or fewer than ``min_transfer_bytes`` after the first) teaches only the rest. The average is
  kept in seconds per byte (a harmonic mean of the rates): fetch times predicted from it are
  averages of times, and a collapse weighs as much as the time it costs;
* round-trip time: from sending the request to the response headers, less the server's own
  compute time as it reports it (``X-Prefill-Seconds``), floored at 0. A server that does not
  report its time has it folded into the round trip (and its compute time per token stays unknown);
* the server's compute time per prompt token it was asked for.

Each average is an exponentially weighted mean: a new pull weighs ``alpha`` of it once a few pulls
are in. Its confidence (the weight of what it has seen) halves every ``half_life_s`` of idleness;
once below ``min_weight`` the average is unknown again (None), and the next pull counts in full.
With the defaults (alpha 0.3, min_weight 0.1, half-life 60 s) a lone pull stays known for about 3
minutes of idleness, a steady history for about 5.

``LinkModels`` holds one model per endpoint URL and exports the goodput and round-trip estimates as
gauges, set after every pull that taught them (a gauge keeps its last value while the estimate
ages; it is never set to NaN).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge

from edgedecode.daemon.kv_pull import PullResult

MIN_TRANSFER_BYTES = 64 << 10


@dataclass(frozen=True)
class LinkEstimate:
    """A link's estimates now; None where unknown (never learned, or forgotten after idleness)."""

    goodput_bps: float | None  # payload bytes per second
    rtt_s: float | None  # request sent to response headers, less the server's compute time
    server_s_per_token: float | None  # the prefill server's compute time per prompt token asked


class DecayingMean:
    """An exponentially weighted mean whose weight halves every ``half_life_s`` without samples.

    A sample weighs 1 against the (decayed) weight of the past samples, capped at ``1/alpha - 1`` (so a
    sample weighs at least ``alpha`` of the mean); the mean is None while the weight of all it has seen
    is below ``min_weight``.
    """

    def __init__(self, alpha: float, half_life_s: float, min_weight: float) -> None:
        if not 0 < alpha <= 1 or half_life_s <= 0 or min_weight <= 0:
            raise ValueError("need 0 < alpha <= 1, half_life_s > 0 and min_weight > 0")
        self.max_weight = 1 / alpha - 1
        self.half_life_s = half_life_s
        self.min_weight = min_weight
        self._mean = 0.0
        self._weight = 0.0
        self._at = 0.0

    def weight(self, now: float) -> float:
        """The weight of the samples seen, as of ``now``."""
        if self._weight == 0.0:
            return 0.0
        return self._weight * 0.5 ** (max(now - self._at, 0.0) / self.half_life_s)

    def add(self, sample: float, now: float) -> None:
        past = self.weight(now)
        past = 0.0 if past < self.min_weight else min(past, self.max_weight)  # forgotten: the sample is all
        self._mean = (past * self._mean + sample) / (past + 1)
        self._weight = past + 1
        self._at = now

    def value(self, now: float) -> float | None:
        return self._mean if self.weight(now) >= self.min_weight else None


class LinkModel:
    """The link to one prefill endpoint: goodput, round-trip time and server compute time per token.

    ``clock``: seconds (monotonic) for the idle decay; ``on_update``: called with the estimate after
    every observation.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        half_life_s: float = 60.0,
        alpha: float = 0.3,
        min_weight: float = 0.1,
        min_transfer_bytes: int = MIN_TRANSFER_BYTES,
        clock: Callable[[], float] = time.monotonic,
        on_update: Callable[[LinkEstimate], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.min_transfer_bytes = min_transfer_bytes
        self.clock = clock
        self.on_update = on_update
        self._seconds_per_byte = DecayingMean(alpha, half_life_s, min_weight)
        self._rtt = DecayingMean(alpha, half_life_s, min_weight)
        self._server_per_token = DecayingMean(alpha, half_life_s, min_weight)

    def observe(self, result: PullResult, tokens: int) -> None:
        """Learn from a successful pull of ``tokens`` prompt tokens' KV (those asked for: the prompt
        less the held tokens)."""
        now = self.clock()
        if result.transfer_bytes >= max(self.min_transfer_bytes, 1) and result.transfer_seconds > 0:
            self._seconds_per_byte.add(result.transfer_seconds / result.transfer_bytes, now)
        server = result.server_seconds
        if server is not None and not (math.isfinite(server) and server >= 0):
            server = None  # a nonsensical report teaches nothing about the server
        self._rtt.add(max(result.headers_seconds - (server or 0.0), 0.0), now)
        if server is not None and tokens > 0:
            self._server_per_token.add(server / tokens, now)
        if self.on_update is not None:
            self.on_update(self.estimate())

    def estimate(self) -> LinkEstimate:
        now = self.clock()
        seconds_per_byte = self._seconds_per_byte.value(now)
        return LinkEstimate(
            None if not seconds_per_byte else 1 / seconds_per_byte,
            self._rtt.value(now),
            self._server_per_token.value(now),
        )

    def predict_fetch_s(self, wire_bytes: int, tokens: int) -> float | None:
        """Predicted time of a pull of ``tokens`` prompt tokens whose payload is ``wire_bytes``: round
        trip + server compute + transfer; None while the goodput or the round trip is unknown. The
        server's compute counts as 0 while unknown (a server that does not report it has it in the
        round trip)."""
        estimate = self.estimate()
        if estimate.goodput_bps is None or estimate.rtt_s is None:
            return None
        server = 0.0 if estimate.server_s_per_token is None else estimate.server_s_per_token * max(tokens, 0)
        return estimate.rtt_s + server + max(wire_bytes, 0) / estimate.goodput_bps


class LinkModels:
    """A ``LinkModel`` per prefill endpoint URL (made on first use), exported on ``registry`` as
    ``edgedecode_link_goodput_bytes_per_second{endpoint}`` and ``edgedecode_link_rtt_seconds{endpoint}``.

    ``clock`` is every ``LinkModel``'s (the others keep their defaults).
    """

    def __init__(self, registry: CollectorRegistry, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._make = functools.partial(LinkModel, clock=clock)
        self._models: dict[str, LinkModel] = {}
        self.goodput = Gauge(
            "edgedecode_link_goodput_bytes_per_second",
            "Estimated payload goodput from each prefill endpoint (moving average over pulls).",
            ["endpoint"],
            registry=registry,
        )
        self.rtt = Gauge(
            "edgedecode_link_rtt_seconds",
            "Estimated round-trip time to each prefill endpoint, its compute time excluded (moving average).",
            ["endpoint"],
            registry=registry,
        )

    def get(self, url: str) -> LinkModel:
        """The model of the endpoint at ``url`` (a trailing slash does not make another endpoint)."""
        endpoint = url.rstrip("/")
        model = self._models.get(endpoint)
        if model is None:
            model = self._models[endpoint] = self._make(
                endpoint, on_update=lambda estimate: self._publish(endpoint, estimate)
            )
        return model

    def __contains__(self, url: str) -> bool:
        return url.rstrip("/") in self._models

    def _publish(self, endpoint: str, estimate: LinkEstimate) -> None:
        if estimate.goodput_bps is not None:
            self.goodput.labels(endpoint).set(estimate.goodput_bps)
        if estimate.rtt_s is not None:
            self.rtt.labels(endpoint).set(estimate.rtt_s)

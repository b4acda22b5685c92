"""What the daemon knows of the link to each prefill server, learned from every pull that got an answer.

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
* the server's compute time per prompt token it was asked for, and — from a server that says which part of its
  time was the prefill itself (``X-Prefill-Compute-Seconds``) — apart from it, the rest of its time (observation
  pass, scoring, encoding) per token sent. Then a prefix-cache hit, which saves the compute but not the encoding,
  is priced as such; from a server that does not say, its whole time counts per computed token.

A pull cut short (by the daemon's watch, or broken off) teaches all three from what it measured
before the cut; a split's pull (``observe(..., goodput=False)``) teaches the round trip and the
server's time only, so a box that splits its turns still learns a tier's queueing.

Each average is an exponentially weighted mean: a new pull weighs ``alpha`` of it once a few pulls
are in. Its confidence (the weight of what it has seen) halves every ``half_life_s`` of idleness.
With the defaults (alpha 0.3, min_weight 0.1, half-life 60 s) a lone pull stays fresh for about 3
minutes of idleness, a steady history for about 5. Once the confidence is below ``min_weight`` the
estimate is **stale**: it is still what was last learned, not forgotten (a box behind a slow link
does not become fast by idling), but it is assumed worse by ``stale_margin``: every time it
predicts (seconds per byte, round trip, server time per token) is ``stale_margin`` times the
remembered one. The next pull then counts in full (the stale past does not dilute it), so a link
that changed while idle is learned again from that one pull.

``LinkModels`` holds one model per endpoint URL and exports the goodput and round-trip estimates as
gauges, set after every pull that taught them (a gauge keeps its last value while the estimate
ages; it is never set to NaN). Given a ``LinkStore`` it also keeps each endpoint's remembered
estimate on disk after every pull and starts from it (stale) after a restart.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Gauge

from edgedecode.daemon.pull.segment import PullResult

MIN_TRANSFER_BYTES = 64 << 10
STALE_MARGIN = 1.5  # daemon.link_stale_margin: a stale estimate's times, against the remembered ones
STATE_KEYS = ("seconds_per_byte", "rtt_s", "server_s_per_token", "server_s_per_sent_token")  # LinkModel.state()


class LinkStoreLike(Protocol):
    """Where ``LinkModels`` keeps each endpoint's state across restarts (``pull.link_store.LinkStore``)."""

    def load(self, endpoint: str) -> Mapping[str, float | None] | None: ...

    def save(self, endpoint: str, state: Mapping[str, float | None]) -> None: ...


@dataclass(frozen=True)
class LinkEstimate:
    """A link's estimates now; None where never learned. ``stale``: some of them are remembered past
    their idle lapse, and so already worsened by the model's ``stale_margin``."""

    goodput_bps: float | None  # payload bytes per second
    rtt_s: float | None  # request sent to response headers, less the server's compute time
    server_s_per_token: float | None  # the prefill server's compute time per prompt token asked
    stale: bool = False
    server_s_per_sent_token: float | None = None  # the rest of the server's time per token sent (see the module)


class DecayingMean:
    """An exponentially weighted mean whose weight halves every ``half_life_s`` without samples.

    A sample weighs 1 against the (decayed) weight of the past samples, capped at ``1/alpha - 1`` (so a
    sample weighs at least ``alpha`` of the mean). While the weight of all it has seen is below
    ``min_weight`` the mean has lapsed: ``value`` is None, ``remembered`` still the last mean, and
    the next sample replaces it.
    """

    def __init__(self, alpha: float, half_life_s: float, min_weight: float) -> None:
        if not 0 < alpha <= 1 or half_life_s <= 0 or min_weight <= 0:
            raise ValueError("need 0 < alpha <= 1, half_life_s > 0 and min_weight > 0")
        self.max_weight = 1 / alpha - 1
        self.half_life_s = half_life_s
        self.min_weight = min_weight
        self._mean: float | None = None
        self._weight = 0.0
        self._at = 0.0

    def weight(self, now: float) -> float:
        """The weight of the samples seen, as of ``now``."""
        if self._weight == 0.0:
            return 0.0
        return self._weight * 0.5 ** (max(now - self._at, 0.0) / self.half_life_s)

    def add(self, sample: float, now: float) -> None:
        past = self.weight(now)
        if past < self.min_weight or self._mean is None:  # lapsed: the sample is all
            self._mean, self._weight = sample, 1.0
        else:
            past = min(past, self.max_weight)
            self._mean = (past * self._mean + sample) / (past + 1)
            self._weight = past + 1
        self._at = now

    def value(self, now: float) -> float | None:
        """The mean while its weight is at least ``min_weight``, else None."""
        return self._mean if self.weight(now) >= self.min_weight else None

    @property
    def remembered(self) -> float | None:
        """The last mean whatever its weight (None before any sample)."""
        return self._mean

    def remember(self, mean: float) -> None:
        """Hold ``mean`` as a lapsed mean (weight 0), as after a long idle time: ``remembered`` but
        no ``value``, replaced by the next sample."""
        self._mean, self._weight = mean, 0.0


class LinkModel:
    """The link to one prefill endpoint: goodput, round-trip time and server compute time per token.

    ``stale_margin``: how much worse a stale estimate is assumed (its times multiplied by it, >= 1);
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
        stale_margin: float = STALE_MARGIN,
        clock: Callable[[], float] = time.monotonic,
        on_update: Callable[[LinkEstimate], None] | None = None,
    ) -> None:
        if not stale_margin >= 1:
            raise ValueError(f"stale_margin must be >= 1 (a stale link is assumed no better), not {stale_margin}")
        self.endpoint = endpoint
        self.min_transfer_bytes = min_transfer_bytes
        self.stale_margin = stale_margin
        self.clock = clock
        self.on_update = on_update
        self._seconds_per_byte = DecayingMean(alpha, half_life_s, min_weight)
        self._rtt = DecayingMean(alpha, half_life_s, min_weight)
        self._server_per_token = DecayingMean(alpha, half_life_s, min_weight)
        self._server_per_sent_token = DecayingMean(alpha, half_life_s, min_weight)
        self._observed_at = clock()  # the clock at the last observation, or when this model was made

    def observe(self, result: PullResult, tokens: int, *, sent_tokens: int = 0, goodput: bool = True) -> None:
        """Learn from a pull whose server computed ``tokens`` prompt tokens (the prompt less what its prefix cache
        held) and encoded ``sent_tokens`` (the prompt less what the receiver held), that got its response headers,
        whole or cut short (by the watch, or a failure): a cut pull's bytes and time teach the goodput as a whole
        pull's do. ``goodput`` False: its transfer is not the link's (a split's pull shares the cores with the
        head's compute, which slows its ingest); only the round trip and the server's time are learned."""
        now = self._observed_at = self.clock()
        if goodput and result.transfer_bytes >= max(self.min_transfer_bytes, 1) and result.transfer_seconds > 0:
            self._seconds_per_byte.add(result.transfer_seconds / result.transfer_bytes, now)
        server = result.server_seconds
        if server is not None and not (math.isfinite(server) and server >= 0):
            server = None  # a nonsensical report teaches nothing about the server
        self._rtt.add(max(result.headers_seconds - (server or 0.0), 0.0), now)
        compute = result.server_compute_seconds
        if server is not None and compute is not None:  # split: unless it does not add up (then neither part)
            if math.isfinite(compute) and 0 <= compute <= server and sent_tokens > 0:
                if tokens > 0:
                    self._server_per_token.add(compute / tokens, now)
                self._server_per_sent_token.add((server - compute) / sent_tokens, now)
        elif server is not None and tokens > 0:  # a server that does not split its time: all of it per computed token
            self._server_per_token.add(server / tokens, now)
        if self.on_update is not None:
            self.on_update(self.estimate())

    def since_observed(self) -> float:
        """Seconds since a pull last taught this model, or since it was made (e.g. restored at a
        restart) if none has."""
        return self.clock() - self._observed_at

    def estimate(self) -> LinkEstimate:
        """The estimates now: fresh ones as learned, stale ones worsened by ``stale_margin``."""
        now = self.clock()
        timed = (self._timed(mean, now) for mean in self._means)
        (seconds_per_byte, rtt, per_token, per_sent), stale = zip(*timed, strict=True)
        goodput = None if not seconds_per_byte else 1 / seconds_per_byte
        return LinkEstimate(goodput, rtt, per_token, any(stale), per_sent)

    @property
    def _means(self) -> tuple[DecayingMean, DecayingMean, DecayingMean, DecayingMean]:
        """The averages in ``STATE_KEYS`` order."""
        return self._seconds_per_byte, self._rtt, self._server_per_token, self._server_per_sent_token

    def _timed(self, mean: DecayingMean, now: float) -> tuple[float | None, bool]:
        """(a time the model predicts from ``mean``, whether it is stale)."""
        fresh = mean.value(now)
        if fresh is not None or mean.remembered is None:
            return fresh, False
        return mean.remembered * self.stale_margin, True

    def state(self) -> dict[str, float | None]:
        """What the model remembers, as stored by ``LinkStore`` (``STATE_KEYS``; None: never learned)."""
        return {key: mean.remembered for key, mean in zip(STATE_KEYS, self._means, strict=True)}

    def restore(self, state: Mapping[str, float | None]) -> None:
        """Start from ``state`` (as ``state()`` gave it, e.g. before a restart), held as stale."""
        for key, mean in zip(STATE_KEYS, self._means, strict=True):
            value = state.get(key)
            if value is not None:
                mean.remember(value)

    def predict_fetch_s(self, wire_bytes: int, tokens: int, sent_tokens: int = 0) -> float | None:
        """Predicted time of a pull whose server computes ``tokens`` prompt tokens and sends ``sent_tokens``' KV in
        ``wire_bytes``: round trip + server time + transfer (``stale_margin`` times slower while the estimate is
        stale); None while the goodput or the round trip was never learned. The server's time counts as 0 where
        unknown (a server that does not report it has it in the round trip)."""
        estimate = self.estimate()
        if estimate.goodput_bps is None or estimate.rtt_s is None:
            return None
        server = (estimate.server_s_per_token or 0.0) * max(tokens, 0)
        server += (estimate.server_s_per_sent_token or 0.0) * max(sent_tokens, 0)
        return estimate.rtt_s + server + max(wire_bytes, 0) / estimate.goodput_bps


class LinkModels:
    """A ``LinkModel`` per prefill endpoint URL (made on first use), exported on ``registry`` as
    ``edgedecode_link_goodput_bytes_per_second{endpoint}`` and ``edgedecode_link_rtt_seconds{endpoint}``.

    ``stale_margin`` and ``clock`` are every ``LinkModel``'s (the others keep their defaults);
    ``store``, when given, starts each model from its stored state and stores it after every pull.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        stale_margin: float = STALE_MARGIN,
        store: LinkStoreLike | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._make = functools.partial(LinkModel, stale_margin=stale_margin, clock=clock)
        self.store = store
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
                endpoint, on_update=lambda estimate: self._updated(endpoint, estimate)
            )
            state = None if self.store is None else self.store.load(endpoint)
            if state is not None:
                model.restore(state)
        return model

    def __contains__(self, url: str) -> bool:
        return url.rstrip("/") in self._models

    def _updated(self, endpoint: str, estimate: LinkEstimate) -> None:
        self._publish(endpoint, estimate)
        if self.store is not None:
            self.store.save(endpoint, self._models[endpoint].state())

    def _publish(self, endpoint: str, estimate: LinkEstimate) -> None:
        if estimate.goodput_bps is not None:
            self.goodput.labels(endpoint).set(estimate.goodput_bps)
        if estimate.rtt_s is not None:
            self.rtt.labels(endpoint).set(estimate.rtt_s)


class Reprobes:
    """When a turn planned local should pull instead, to measure its link again (``daemon.link_reprobe_s``).

    A box whose remembered link keeps every turn local never pulls, so it never sees the link get
    faster. A re-probe is due for an endpoint once neither a pull has taught its model nor a
    re-probe has been made for ``every_s`` seconds (0: never); ``due`` answering True counts as the
    re-probe. Its cost is bounded by the pull's watch, which cuts a pull running late and computes
    the rest here, and by the breaker for an endpoint that fails.
    """

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if every_s < 0:
            raise ValueError(f"every_s must be >= 0 (0: never), not {every_s}")
        self.every_s = every_s
        self.clock = clock
        self._last: dict[str, float] = {}  # endpoint -> when it was last re-probed

    def due(self, endpoint: str, model: LinkModel) -> bool:
        """Whether a turn to ``endpoint`` (its link ``model``) re-probes now (then counted as done)."""
        if not self.every_s or model.since_observed() < self.every_s:
            return False
        now = self.clock()
        if now - self._last.get(endpoint, -math.inf) < self.every_s:
            return False
        self._last[endpoint] = now
        return True

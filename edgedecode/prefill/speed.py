"""The prefill server's own speed, as a prefill tier routes by it (``fleet/affinity.py``): running means of the
seconds its requests take and of the seconds its prefill takes a computed prompt token."""

from __future__ import annotations

from dataclasses import dataclass

SPEED_WEIGHT = 0.1  # a request's weight in the running means


@dataclass(frozen=True)
class ServerSpeed:
    """Seconds a request takes, and prefill seconds a computed prompt token."""

    request_s: float
    prefill_s_per_token: float


class SpeedMeter:
    """Running means of a server's requests' seconds and of its prefill's seconds a computed token."""

    def __init__(self) -> None:
        self._request_s: float | None = None
        self._token_s: float | None = None

    def add(self, seconds: float, prefill_s: float, computed_tokens: int) -> None:
        """One request took ``seconds``, of which ``prefill_s`` computed ``computed_tokens`` prompt tokens."""
        self._request_s = running_mean(self._request_s, seconds)
        if computed_tokens > 0:
            self._token_s = running_mean(self._token_s, prefill_s / computed_tokens)

    def speed(self) -> ServerSpeed | None:
        """The means, once a request that computed tokens was seen."""
        if self._request_s is None or self._token_s is None:
            return None
        return ServerSpeed(self._request_s, self._token_s)


def running_mean(mean: float | None, sample: float) -> float:
    """``mean`` (None: no sample yet) with ``sample`` added at ``SPEED_WEIGHT``."""
    return sample if mean is None else (1 - SPEED_WEIGHT) * mean + SPEED_WEIGHT * sample

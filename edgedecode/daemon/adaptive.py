"""Where a turn's KV comes from under a time-to-first-token target: pulled from the prefill server at
the highest budget the link delivers in time, or computed on this box.

Quality ranks remote budgets from 1.0 (FP16) down to the quality floor ``min_budget`` (the lowest
budget whose perplexity cost the quality harness measured within +2 %), then local prefill. The plan
is the best-ranked option predicted to meet the target; when none is, the fastest one. Without a
target, or while the link is unknown (no pull yet, or idle long enough for its estimate to lapse),
the configured budget is asked for, as before — and that pull teaches the link model.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

# Budgets tried from the best down; those below the quality floor are never asked for.
BUDGET_LADDER = (1.0, 0.75, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1)


@dataclass(frozen=True)
class KVPlan:
    """How a turn gets its KV: ``decision`` "remote" (at ``budget``) or "local"; ``predicted_s`` is
    the predicted time to have it (None when nothing was predicted); ``why`` says what decided."""

    decision: str
    budget: float | None
    predicted_s: float | None
    why: str


@dataclass(frozen=True)
class PlanInputs:
    """What the planner knows about one turn."""

    target_s: float | None  # time left for the KV under the turn's target; None: no target
    fixed_budget: float  # the configured budget
    wire_bytes: Callable[[float], int]  # expected payload bytes at a budget
    predict_remote_s: Callable[[int], float | None]  # link model: seconds to pull this many wire bytes
    local_s: float  # local prefill model: seconds to compute the tokens here
    min_budget: float  # the quality floor


def plan_kv(inputs: PlanInputs) -> KVPlan:
    """The plan for one turn (see the module docstring)."""
    fixed = inputs.fixed_budget
    if inputs.target_s is None:
        return KVPlan("remote", fixed, None, "no target: the configured budget")
    options = [
        (budget, inputs.predict_remote_s(inputs.wire_bytes(budget)))
        for budget in BUDGET_LADDER
        if budget >= inputs.min_budget
    ]
    if not options or any(seconds is None for _, seconds in options):
        return KVPlan("remote", fixed, None, "link unknown: the configured budget")
    remote = [(budget, float(seconds)) for budget, seconds in options if seconds is not None]
    for budget, seconds in remote:  # best quality first
        if seconds <= inputs.target_s:
            return KVPlan("remote", budget, seconds, "the best budget the link delivers within the target")
    if inputs.local_s <= inputs.target_s:
        return KVPlan("local", None, inputs.local_s, "no budget at or above the floor meets the target; local does")
    budget, seconds = remote[-1]  # the lowest budget allowed is the fastest pull
    if inputs.local_s < seconds:
        return KVPlan("local", None, inputs.local_s, "nothing meets the target; local is fastest")
    return KVPlan("remote", budget, seconds, "nothing meets the target; the floor budget is fastest")


class SegmentWatch:
    """Decides, while a segment downloads, when to stop waiting for it because its goodput collapsed.

    Called (as ``kv_pull.Watch``) with the seconds since the segment's request was sent, the body
    bytes received and the bytes the server announced. Goodput is measured over the last
    ``window_s`` of the body (since its start until that much has passed). Once ``min_observe_s``
    of body has been seen, the segment is cut when, at that goodput, it would end after
    ``deadline_s`` while another way to get its remaining tokens, ``rest_s(goodput, tokens)``
    seconds from now (a resume at a lower budget, or computing them here), ends before ``margin``
    of the segment's own projected end. ``tokens`` is the segment's token count, the remaining
    ones estimated in proportion to the bytes still to come. Without an announced size it never cuts.
    """

    def __init__(
        self,
        deadline_s: float,
        tokens: int,
        rest_s: Callable[[float, int], float],
        *,
        window_s: float = 0.3,
        min_observe_s: float = 0.2,
        margin: float = 0.8,
    ) -> None:
        self.deadline_s = deadline_s
        self.tokens = tokens
        self.rest_s = rest_s
        self.window_s = window_s
        self.min_observe_s = min_observe_s
        self.margin = margin
        self._samples: deque[tuple[float, int]] = deque()  # (seconds, bytes received) of recent calls
        self._body_started: float | None = None
        self.goodput_bps: float | None = None  # at the last call, over the window

    def __call__(self, elapsed: float, received: int, announced: int | None) -> str | None:
        if received == 0 or announced is None or announced <= 0:
            return None
        if self._body_started is None:
            self._body_started = elapsed
        samples = self._samples
        samples.append((elapsed, received))
        while len(samples) > 2 and samples[1][0] <= elapsed - self.window_s:
            samples.popleft()
        span = elapsed - samples[0][0]
        if elapsed - self._body_started < self.min_observe_s or span <= 0:
            return None
        self.goodput_bps = (received - samples[0][1]) / span
        left = max(announced - received, 0)
        projected = elapsed + (left / self.goodput_bps if self.goodput_bps > 0 else math.inf)
        if projected <= self.deadline_s:
            return None
        tokens_left = math.ceil(self.tokens * left / announced)
        rest = elapsed + self.rest_s(self.goodput_bps, tokens_left)
        if rest >= self.margin * projected:
            return None
        return (
            f"goodput fell to {self.goodput_bps * 8e-6:.2f} Mbit/s: the segment would end at "
            f"{projected:.2f} s, past its deadline of {self.deadline_s:.2f} s; the rest another way by {rest:.2f} s"
        )

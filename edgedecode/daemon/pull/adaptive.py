"""Where a turn's KV comes from: pulled from the prefill server at a budget the link delivers in
time, computed on this box, or both (a split) — whichever costs the least quality among those that
make it, the fastest of them where they cost the same.

Every option has a quality cost, the Δ perplexity the served model's calibration measured for it at the
prompt's length (``QualityCosts``, from ``pull.calibration``). "In time" is the turn's target when it has one
(``daemon.ttft_target_ms``, or the request's). Without one, a daemon whose budget is not pinned plans with its
default objective: the best quality whose predicted time is within ``PlanInputs.near_fastest`` (1.1) of the
fastest option's, or within ``near_fastest_s`` (0.1 s) of it where that is more (so that a turn of a fraction
of a second does not trade quality for a few tens of milliseconds); with ``daemon.budget`` pinned and no
target, the pinned budget is asked for, as before. The plan is, among the options predicted in time, those
within ``QUALITY_TIE_PCT`` of the best cost, the fastest; when none is in time, the fastest of all. The
quality floor: no option costing more than ``QUALITY_FLOOR_PCT`` (+2 %) at the prompt's length is planned, and
no budget below ``min_budget`` (by default the calibration's lowest measured budget within the floor) is asked
for. Every remote prediction is the link model's times the learned ``remote_correction`` (how much longer
pulls took than predicted). While the link is unknown (no pull from this endpoint yet) the default budget is
asked for — and that pull teaches the link model; under the default objective it carries a deadline (local
prefill's predicted time, with the same slack) so that the segment watch cuts it and computes the rest here if
the link turns out slow. A link idle long enough for its estimate to go stale is still planned for, from the
remembered estimate worsened by the link model's ``stale_margin`` (``pull.link``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

# Budgets tried from the best down; those below the quality floor are never asked for.
BUDGET_LADDER = (1.0, 0.75, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1)
QUALITY_TIE_PCT = 0.1  # options whose Δ perplexity differs by less than this count as the same quality
QUALITY_FLOOR_PCT = 2.0  # no option that costs more (at the prompt's length) is planned


@dataclass(frozen=True)
class QualityCosts:
    """Δ perplexity (%) of each way to get the KV: remote budgets by prompt length (measured points:
    linear in the budget between them, linear in log2 of the length between lengths, the nearest
    length's beyond them; each length's costs made non-increasing in the budget, since the measured
    means are noisy; below a length's lowest measured budget, unknown: infinite) and local prefill.
    The served model's come from its calibration (``pull.calibration``)."""

    remote: Mapping[int, Mapping[float, float]]
    local: float = 0.0

    def of_budget(self, budget: float, tokens: int = 1024) -> float:
        """Δ PPL (%) of a pull at ``budget`` for a prompt of ``tokens`` tokens (inf: never measured that low)."""
        lengths = sorted(self.remote)
        at = int(np.searchsorted(lengths, max(tokens, 1)))
        if at == 0 or at == len(lengths) or lengths[at] == tokens:  # at or beyond a measured length
            return self._at_length(self.remote[lengths[min(at, len(lengths) - 1)]], budget)
        below, above = lengths[at - 1], lengths[at]
        costs = [self._at_length(self.remote[length], budget) for length in (below, above)]
        if not all(math.isfinite(cost) for cost in costs):
            return math.inf
        return float(np.interp(np.log2(tokens), np.log2([below, above]), costs))

    @staticmethod
    def _at_length(points: Mapping[float, float], budget: float) -> float:
        budgets = np.array(sorted(points, reverse=True))  # from the best down
        if budget < budgets[-1] - 1e-9:
            return math.inf
        costs = np.maximum.accumulate([points[b] for b in budgets])  # never cheaper at a lower budget
        return float(np.interp(budget, budgets[::-1], costs[::-1]))


@dataclass(frozen=True)
class KVPlan:
    """How a turn gets its KV: ``decision`` "remote" (at ``budget``) or "local"; ``predicted_s`` is
    the predicted time to have it (None when nothing was predicted); ``why`` says what decided."""

    decision: str
    budget: float | None
    predicted_s: float | None
    why: str
    head: int = 0  # "split": leading tokens computed here while the rest's KV is pulled at ``budget``
    pull_s: float | None = None  # the pull as the link model predicts it, uncorrected ("split": the tail's, alone)
    deadline_s: float | None = None  # no target of the turn's own: when the KV should be in (the segment watch's)


@dataclass(frozen=True)
class PlanInputs:
    """What the planner knows about one turn."""

    target_s: float | None  # time left for the KV under the turn's target; None: no target
    fixed_budget: float  # the pinned budget, or the model's default one (asked while the link is unknown)
    wire_bytes: Callable[[float], int]  # expected payload bytes at a budget
    predict_remote_s: Callable[[int], float | None]  # link model: seconds to pull this many wire bytes
    local_s: float  # local prefill model: seconds to compute the tokens here
    min_budget: float  # the quality floor
    quality: QualityCosts  # the served model's (pull.calibration)
    tokens: int = 0  # the tokens whose KV the plan gets (0: no split is considered)
    context_tokens: int = 0  # the whole prompt's, for its quality costs (0: ``tokens``)
    local_head_s: Callable[[int], float] | None = None  # seconds to compute the first n of them here
    split_slowdown: float = 1.0  # a split's pull takes this much longer than alone (the head's compute competes)
    near_fastest: float | None = None  # no target: plan the best quality within this factor of the fastest
    near_fastest_s: float = 0.0  # ... or within this many seconds of it, where that is more
    remote_correction: float = 1.0  # pulls take this much longer than the link model predicts (learned)


SPLIT_FRACTIONS = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875)  # heads tried for a split, of the tokens


def plan_kv(inputs: PlanInputs) -> KVPlan:
    """The plan for one turn (see the module docstring)."""
    fixed = inputs.fixed_budget
    target_s, near = inputs.target_s, inputs.near_fastest
    if target_s is None and near is None:
        return KVPlan("remote", fixed, None, "no target: the configured budget")
    predicted = [
        (budget, inputs.predict_remote_s(inputs.wire_bytes(budget)))
        for budget in BUDGET_LADDER
        if budget >= inputs.min_budget
    ]
    if not predicted or any(seconds is None for _, seconds in predicted):
        deadline_s = None if target_s is not None or near is None else _near(inputs, inputs.local_s)
        return KVPlan("remote", fixed, None, "link unknown: the default budget", deadline_s=deadline_s)
    correction = inputs.remote_correction
    predicted = [(budget, None if seconds is None else seconds * correction) for budget, seconds in predicted]
    quality = inputs.quality
    options = [
        KVPlan("remote", budget, float(seconds), f"b {budget:g}", pull_s=float(seconds) / correction)
        for budget, seconds in predicted
        if seconds is not None
    ]
    options.append(KVPlan("local", None, inputs.local_s, "local prefill"))
    options += _splits(inputs, predicted)

    length = inputs.context_tokens or inputs.tokens

    def cost(option: KVPlan) -> float:
        if option.budget is None:
            return quality.local
        pulled = 1 - option.head / inputs.tokens if option.head else 1.0
        return (1 - pulled) * quality.local + pulled * quality.of_budget(option.budget, length)

    # the quality floor at this prompt's length (local prefill is always kept: it is the fallback)
    options = [option for option in options if option.budget is None or cost(option) <= QUALITY_FLOOR_PCT]

    def seconds(option: KVPlan) -> float:
        return math.inf if option.predicted_s is None else option.predicted_s

    goal = "meets the target"
    if target_s is None:
        assert near is not None
        target_s = _near(inputs, min(seconds(option) for option in options))
        goal = f"is within {near:g}x or {1e3 * inputs.near_fastest_s:.0f} ms of the fastest"
    meeting = [option for option in options if seconds(option) <= target_s]
    if meeting:
        best = min(cost(option) for option in meeting)
        chosen = min((option for option in meeting if cost(option) <= best + QUALITY_TIE_PCT), key=seconds)
        why = f"{chosen.why}: the fastest of the best quality (Δ PPL {cost(chosen):+.2f} %) that {goal}"
    else:
        chosen = min(options, key=seconds)
        why = f"{chosen.why}: nothing meets the target; the fastest"
    deadline_s = target_s if inputs.target_s is None and math.isfinite(target_s) else None
    return KVPlan(chosen.decision, chosen.budget, chosen.predicted_s, why, chosen.head, chosen.pull_s, deadline_s)


def _near(inputs: PlanInputs, fastest_s: float) -> float:
    """The latest a plan may be predicted under the default objective, the fastest option taking ``fastest_s``."""
    assert inputs.near_fastest is not None
    return max(inputs.near_fastest * fastest_s, fastest_s + inputs.near_fastest_s)


def _splits(inputs: PlanInputs, predicted: list[tuple[float, float | None]]) -> list[KVPlan]:
    """Split options: a head computed here while the tail's KV is pulled at a budget, both at once;
    ready when the slower of the two is (the server still prefills the whole prompt: its compute
    and the round trip stay, only the tail's bytes travel). The pull is predicted
    ``split_slowdown`` times slower than alone: the head's compute and the tail's ingest share the
    box's cores."""
    if inputs.local_head_s is None or inputs.tokens < 2:
        return []
    splits = []
    for budget, full_s in predicted:
        if full_s is None:
            continue
        for fraction in SPLIT_FRACTIONS:
            head = int(inputs.tokens * fraction)
            if not 0 < head < inputs.tokens:
                continue
            tail_bytes = int(inputs.wire_bytes(budget) * (inputs.tokens - head) / inputs.tokens)
            tail_s = inputs.predict_remote_s(tail_bytes)
            if tail_s is None:
                continue
            seconds = max(inputs.local_head_s(head), tail_s * inputs.split_slowdown)
            why = f"{head} tokens here, the rest at b {budget:g}"
            splits.append(KVPlan("split", budget, seconds, why, head, tail_s))
    return splits


class SegmentWatch:
    """Decides, while a segment downloads, when to stop waiting for it because its goodput collapsed.

    Called (as ``pull.segment.Watch``) with the seconds since the segment's request was sent, the body
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

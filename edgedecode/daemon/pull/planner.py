"""The KV planner: where each turn's KV comes from, and what the daemon learned to decide it.

It owns what the daemon learns as it serves — the link to each prefill endpoint (``pull.link``), this
box's own prefill speed (``pull.local_speed``), how much slower a split's pull runs than alone, when a
link last measured long ago is due a re-probe — and it is the only place a plan's inputs are built:
``plan`` for a turn's KV, ``plan_rest`` for what a cut or broken pull left, and the ``watch`` that
decides, while a segment downloads, whether the rest should come another way. The choice itself is
``pull.adaptive.plan_kv``'s.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from edgedecode.config import DaemonConfig
from edgedecode.daemon.metrics import DaemonMetrics
from edgedecode.daemon.pull.adaptive import (
    BUDGET_LADDER,
    QUALITY_FLOOR_PCT,
    SPLIT_FRACTIONS,
    KVPlan,
    PlanInputs,
    SegmentWatch,
    plan_kv,
)
from edgedecode.daemon.pull.calibration import ModelCalibration
from edgedecode.daemon.pull.deadline import Deadline
from edgedecode.daemon.pull.link import DecayingMean, LinkModels, Reprobes
from edgedecode.daemon.pull.link_store import LinkStore
from edgedecode.daemon.pull.local_speed import CALIBRATION_LENGTHS, LocalPrefillModel
from edgedecode.daemon.pull.segment import PullResult
from edgedecode.daemon.pull.server_prefixes import ServerPrefixes
from edgedecode.kv.window import tail_budget
from edgedecode.model.spec import KVContract
from edgedecode.runtime.handoff import StreamedKV

if TYPE_CHECKING:
    from edgedecode.runtime.engine import Engine

NEAR_FASTEST = 1.1  # the default objective: the best quality within this factor of the fastest option
NEAR_FASTEST_S = 0.1  # ... or within this many seconds of it, where that is more (tools/bench/adaptive_default.py)
REMOTE_CORRECTION_BOUNDS = (0.8, 3.0)  # a learned correction of the link model's predictions stays within these


class KVPlanner:
    """Plans turns' KV for the daemon configured by ``settings``, for a model whose KV is
    ``fp16_bytes_per_token`` at FP16 under ``contract`` and whose quality ``calibration`` measured;
    counts its decisions and re-probes in ``metrics``, and exports the link estimates on its registry.

    ``local_speed`` starts without a point (local prefill predicted never to finish): ``daemon/run.py``
    calibrates it on a real engine before serving (``calibrate_local``), and every local prefill
    refines it — unless ``daemon.local_prefill_tokens_per_s`` pins it (prefill time proportional to
    the tokens at that speed, never measured).

    Without a target (``daemon.ttft_target_ms`` 0 and none in the request) a daemon whose
    ``daemon.budget`` is 0 (not pinned) plans every turn with the default objective (``NEAR_FASTEST``);
    a pinned budget is asked for as it is. ``daemon.min_budget`` 0 and an unpinned budget take the
    calibration's (``ModelCalibration.min_budget``, ``default_budget``).

    ``clock`` (seconds, monotonic) ages what it learned: the link estimates, re-probes, unanswered pulls
    and the measured slowdowns (tests inject one, so that "measured too long ago" does not depend on
    how fast the box runs the turns between).
    """

    def __init__(
        self,
        settings: DaemonConfig,
        fp16_bytes_per_token: int,
        contract: KVContract,
        metrics: DaemonMetrics,
        calibration: ModelCalibration,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.fp16_bytes_per_token = fp16_bytes_per_token
        self.contract = contract
        self.metrics = metrics
        store = LinkStore(Path(settings.state_dir)) if settings.state_dir else None
        self.links = LinkModels(metrics.registry, stale_margin=settings.link_stale_margin, store=store, clock=clock)
        pinned = settings.local_prefill_tokens_per_s
        self.local_speed = LocalPrefillModel([(n, n / pinned) for n in CALIBRATION_LENGTHS] if pinned else ())
        self.calibration = calibration
        self.quality = calibration.quality(settings.local_dppl_pct)
        self.min_budget = settings.min_budget or calibration.min_budget
        self.budget = settings.budget or max(calibration.default_budget, self.min_budget)
        self.near_fastest = None if settings.budget else NEAR_FASTEST
        # how much longer a split's pull takes than alone, as measured on this box (the configured
        # prior until a split has been seen, and again after hours without one)
        self.split_slowdown = DecayingMean(alpha=0.3, half_life_s=3600.0, min_weight=0.1)
        # how much longer a whole pull takes than the link model predicted (1 until measured)
        self.remote_correction = DecayingMean(alpha=0.3, half_life_s=3600.0, min_weight=0.1)
        self.reprobes = Reprobes(settings.link_reprobe_s, clock)
        self.prefixes = ServerPrefixes()  # what each prefill server's prefix cache holds, as its answers said
        self._unanswered: dict[str, float] = {}  # endpoint -> when a pull from it last got no answer in time

    def plans(self, kv_deadline: Deadline) -> bool:
        """Whether a turn with ``kv_deadline`` is planned from the link and the server (a target, or the default
        objective), not pulled at the pinned budget whatever they are."""
        return kv_deadline.target_s is not None or self.near_fastest is not None

    def pull_could_win(self, url: str, keep: int, prompt_tokens: int) -> bool:
        """Whether pulling some of the prompt after ``keep`` from ``url`` could beat computing it all here were the
        server to compute none of it: the link known, and the round trip, the encoding and the smallest budget's
        bytes of the least a plan pulls (a split's shortest tail, or the whole) predicted faster than the local
        prefill (else no answer about the server's prefix cache can make a pull part of the plan)."""
        tokens = max(prompt_tokens - keep, 1)
        pulled = tokens - int(tokens * max(SPLIT_FRACTIONS)) if self.local_speed.ready and tokens > 1 else tokens
        wire_bytes = int(self.budget_for(pulled, self.min_budget) * pulled * self.fp16_bytes_per_token)
        best_s = self.links.get(url).predict_fetch_s(wire_bytes, 0, pulled)
        return best_s is not None and best_s * self.corrections()[0] < self.local_speed.predict_seconds(tokens)

    def kv_deadline(self, deadline: Deadline) -> Deadline:
        """When a turn's KV must be in: before its prompt's last token runs and is sampled."""
        return deadline.earlier(self.local_speed.predict_seconds(1) if self.local_speed.ready else 0.0)

    def budget_for(self, tokens: int, budget: float | None = None) -> float:
        """The budget asked for ``tokens`` tokens' KV: ``budget`` (default: the configured one), raised
        so the payload may use at least ``min_wire_bytes`` (a few KB saved are not worth dropping a
        short prompt's tokens) and, for a model with sliding windows, so its never-dropped tail fits
        (``kv.window.tail_budget``: a short Gemma prompt is all tail)."""
        s = self.settings
        fp16_bytes = max(tokens, 1) * self.fp16_bytes_per_token
        floor = max(s.min_wire_bytes / fp16_bytes, tail_budget(max(tokens, 1), self.contract))
        return min(1.0, max(self.budget if budget is None else budget, floor))

    def plan(self, url: str, keep: int, prompt_tokens: int, deadline: Deadline, *, server_held: int = 0) -> KVPlan:
        """Where the KV of the prompt's positions after ``keep`` should come from to be in by
        ``deadline`` (``pull.adaptive``), counted by decision; the server is believed to hold the
        prompt's first ``server_held`` tokens in its prefix cache (``prefixes``), so it computes only
        the rest. A plan to compute it here for an endpoint nothing has measured for
        ``daemon.link_reprobe_s`` becomes the best pull instead (a re-probe, counted)."""
        target_s = deadline.left_s()
        plan = self._plan(url, keep, prompt_tokens, target_s, server_held)
        if plan.decision == "local" and self.reprobes.due(url, self.links.get(url)):
            self.metrics.reprobes.inc()
            plan = self._plan(url, keep, prompt_tokens, target_s, server_held, reprobe=True)
        self.metrics.decisions.labels(plan.decision).inc()
        return plan

    def plan_rest(
        self, url: str, stream: StreamedKV, budget: float, deadline: Deadline, goodput_bps: float | None
    ) -> KVPlan:
        """Where ``stream``'s positions after those it covers should come from, the link judged by
        ``goodput_bps`` (the last segment's recent goodput; None: the link model's estimate); computed
        here, they start from ``stream.local_from``."""
        n = len(stream.prompt_ids)
        tokens = n - stream.covered
        estimate = self.links.get(url).estimate()
        goodput = estimate.goodput_bps if goodput_bps is None else goodput_bps
        rtt = estimate.rtt_s or 0.0

        def predict(wire_bytes: int) -> float | None:
            return None if goodput is None else rtt + wire_bytes / goodput if goodput > 0 else float("inf")

        return plan_kv(
            PlanInputs(
                target_s=deadline.left_s(),
                fixed_budget=budget,
                wire_bytes=lambda b: int(self.budget_for(tokens, b) * tokens * self.fp16_bytes_per_token),
                predict_remote_s=predict,
                local_s=self.local_speed.predict_between(stream.local_from, n),
                min_budget=min(self.min_budget, budget),
                quality=self.quality,
                context_tokens=n,
            )
        )

    def resume_budget(self, prompt_tokens: int, budget: float) -> float | None:
        """The lowest budget the rest of a segment asked at ``budget`` could be resumed at (``plan_rest``): of the
        ladder's budgets from ``min_budget`` (or ``budget``, if lower) up, the lowest whose quality cost at the
        prompt's length is within the planner's floor; None where none is (the rest would be computed here)."""
        low = min(self.min_budget, budget)
        within = [
            b for b in BUDGET_LADDER if b >= low and self.quality.of_budget(b, prompt_tokens) <= QUALITY_FLOOR_PCT
        ]
        return min(within, default=None)

    def watch(self, url: str, stream: StreamedKV, budget: float, deadline: Deadline) -> SegmentWatch:
        """The watch of the segment of ``stream``'s positions from those it covers to the prompt's end, asked at
        ``budget``, which should end by ``deadline`` (it has a target)."""
        end = len(stream.prompt_ids)
        link = self.links.get(url)
        floor_budget = self.resume_budget(end, budget)

        def rest_s(goodput: float, tokens_left: int) -> float:
            """Seconds to get the segment's last ``tokens_left`` tokens another way: resumed at the
            lowest budget a resume may take at this goodput (``resume_budget``: never the one the planner
            would refuse at this prompt's length), or computed here (all the segment's positions, where its
            EDKV window leaves the windowed layers of the part before the cut out: kv.window)."""
            rtt = link.estimate().rtt_s or 0.0
            remote = float("inf")
            if floor_budget is not None and goodput > 0:
                wire = self.budget_for(tokens_left, floor_budget) * tokens_left * self.fp16_bytes_per_token
                remote = rtt + wire / goodput
            header = stream.header
            windowed = header is not None and header.window is not None and header.window.start > 0
            local_start = stream.keep + stream.head if windowed else end - tokens_left
            return min(remote, self.local_speed.predict_between(local_start, end))

        left_s = deadline.left_s()
        assert left_s is not None, "a segment is watched only under a target"
        return SegmentWatch(left_s, end - stream.covered, rest_s)

    def learn_segment(
        self, url: str, result: PullResult, tokens: int, *, sent_tokens: int = 0, goodput: bool = True
    ) -> None:
        """What a segment that got its answer's headers measured teaches the link to ``url`` (``LinkModel.observe``:
        ``tokens`` the server computed for it, ``sent_tokens`` it encoded; ``goodput`` False: not its transfer)."""
        self._unanswered.pop(url.rstrip("/"), None)
        self.links.get(url).observe(result, tokens, sent_tokens=sent_tokens, goodput=goodput)

    def learn_unfinished(self, url: str, last: PullResult) -> None:
        """A pull from ``url`` under the default objective ended at its deadline without all its KV,
        ``last`` its last segment: if that was cut or timed out (not a failure: an endpoint that fails
        is the breaker's) and the link's goodput is still unknown — no answer (its headers) came, or
        too few bytes to measure it, whatever tokens they held — then while it stays unknown the turns
        after it compute here until a re-probe is due (``daemon.link_reprobe_s``) rather than wait on
        the endpoint again. (A short pull that came whole but taught no goodput is probed again.)"""
        if last.ended in ("cut", "timeout") and self.links.get(url).estimate().goodput_bps is None:
            self._unanswered[url.rstrip("/")] = self.clock()

    def _silent(self, url: str) -> bool:
        """Whether plans to ``url`` should not wait on it: the default objective, a link not learned,
        and a pull that got no answer in time less than ``daemon.link_reprobe_s`` ago."""
        since = self._unanswered.get(url.rstrip("/"))
        if since is None or self.near_fastest is None or self.links.get(url).estimate().goodput_bps is not None:
            return False
        return not self.settings.link_reprobe_s or self.clock() - since < self.settings.link_reprobe_s

    def learn_split(self, seconds: float, predicted_s: float) -> None:
        """A split's complete pull took ``seconds`` where the link model predicted ``predicted_s`` alone."""
        self.split_slowdown.add(seconds / predicted_s, self.clock())

    def learn_pull(self, seconds: float, predicted_s: float) -> None:
        """A whole pull (one segment, not a split's) took ``seconds`` where the link model predicted
        ``predicted_s``: the ratio teaches the correction every remote prediction is multiplied by."""
        self.remote_correction.add(seconds / predicted_s, self.clock())

    def corrections(self) -> tuple[float, float]:
        """(the remote correction, the split slowdown) as plans use them now: learned, bounded; the
        split's configured prior while none was measured."""
        now = self.clock()
        low, high = REMOTE_CORRECTION_BOUNDS
        remote = min(max(self.remote_correction.value(now) or 1.0, low), high)
        split = max(self.split_slowdown.value(now) or self.settings.split_slowdown, 1.0)
        return remote, split

    def calibrate_local(self, engine: Engine) -> None:
        """Measure this box's prefill speed on ``engine`` (its thread, before serving), unless pinned."""
        if not self.settings.local_prefill_tokens_per_s:
            self.local_speed.calibrate(engine)

    def learn_local_prefill(self, tokens: int, seconds: float) -> None:
        """A local prefill of ``tokens`` prompt tokens took ``seconds`` (nothing learned when the speed is pinned)."""
        if not self.settings.local_prefill_tokens_per_s:
            self.local_speed.observe(tokens, seconds)

    def _plan(
        self,
        url: str,
        keep: int,
        prompt_tokens: int,
        target_s: float | None,
        server_held: int,
        *,
        reprobe: bool = False,
    ) -> KVPlan:
        """``plan``'s plan for ``target_s`` seconds left; ``reprobe``: the best pull, local prefill left out."""
        link = self.links.get(url)
        if not reprobe and self._silent(url):
            why = "the last probe of this endpoint got no answer in time: computed here until a re-probe"
            return KVPlan("local", None, self.local_speed.predict_between(keep, prompt_tokens), why)
        tokens = prompt_tokens - keep
        server_tokens = prompt_tokens - server_held  # what the server computes (its cache holds the rest)
        fp16_bytes = max(tokens, 1) * self.fp16_bytes_per_token
        local = self.local_speed
        remote_correction, split_slowdown = self.corrections()
        plan = plan_kv(
            PlanInputs(
                target_s=target_s,
                fixed_budget=self.budget,
                wire_bytes=lambda budget: int(self.budget_for(tokens, budget) * fp16_bytes),
                predict_remote_s=lambda wire_bytes: link.predict_fetch_s(wire_bytes, server_tokens, tokens),
                local_s=math.inf if reprobe else local.predict_seconds(tokens),
                min_budget=self.min_budget,
                quality=self.quality,
                tokens=tokens,
                context_tokens=prompt_tokens,
                local_head_s=None if reprobe else lambda head: local.predict_between(keep, keep + head),
                split_slowdown=split_slowdown,
                near_fastest=self.near_fastest,
                near_fastest_s=NEAR_FASTEST_S,
                remote_correction=remote_correction,
            )
        )
        if reprobe:
            plan = dataclasses.replace(plan, why=f"re-probing a link last measured long ago: {plan.why}")
        return plan

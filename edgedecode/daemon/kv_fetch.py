"""Fetch a turn's KV from the prefill server in segments, adapting while it arrives.

The first segment asks for the prompt after the positions held, at the plan's budget. Under a
time-to-first-token target a ``SegmentWatch`` follows its goodput: when the link collapses so far
that the segment would end past the deadline and the rest could come sooner another way, the
segment is cut — its verified tokens stay — and the rest is planned again from where the link now
is: resumed from the server at the best budget that still arrives in time (the server keeps the
prefill under the payload's ``transfer`` reference, so nothing is computed again), or computed on
this box. A segment that fails part way (a reset connection, a truncated body) keeps what it
verified the same way, and the rest is resumed or computed. At most ``MAX_SEGMENTS`` requests are
made per turn, all of them within the pull settings' total timeout (``daemon.fetch_timeout_s``):
each segment gets what is left of it, so a peer that breaks off every segment cannot hold a turn
for several timeouts. Whatever no segment covers is computed here when the engine processes the
prompt.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import aiohttp

from edgedecode.daemon.adaptive import KVPlan, PlanInputs, QualityCosts, SegmentWatch, plan_kv
from edgedecode.daemon.kv_pull import (
    KVPullError,
    PullResult,
    PullSettings,
    SegmentRequest,
    first_segment,
    pull_segment,
    resume_segment,
)
from edgedecode.daemon.link import LinkModel
from edgedecode.daemon.local_speed import LocalPrefillModel
from edgedecode.runtime.handoff import StreamedKV

logger = logging.getLogger(__name__)
MAX_SEGMENTS = 4


@dataclass(frozen=True)
class SegmentReport:
    """One segment of a fetch: the budget asked and what it brought."""

    budget: float
    result: PullResult

    def to_json(self) -> dict:
        r = self.result
        return {
            "budget": self.budget,
            "tokens": r.tokens,
            "wire_bytes": r.wire_bytes,
            "fetch_ms": round(r.seconds * 1e3, 2),
            "ended": r.ended,
        }


@dataclass
class FetchOutcome:
    """What a fetch brought: its segments, and the failure that ended it, if any."""

    segments: list[SegmentReport] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def results(self) -> list[PullResult]:
        return [segment.result for segment in self.segments]

    @property
    def failure(self) -> KVPullError | None:
        """Why the fetch did not bring everything, when a failure is why: the first failure of a fetch
        whose last segment is not complete (a resume that failed after it is a consequence)."""
        if not self.segments or self.segments[-1].result.complete:
            return None
        return next((r.failure for r in self.results if r.failure is not None), None)


class KVFetch:
    """Fetches one turn's KV into a ``StreamedKV`` (see the module docstring).

    ``link``: the endpoint's link model (taught by every segment that got an answer, complete or
    cut; ``teach_goodput`` False: its round trip and server time only); ``local``: this box's prefill
    speed; ``min_budget``: the quality floor; ``quality``: what each way to get the rest costs;
    ``fp16_bytes_per_token``: the model's FP16 KV size.
    """

    def __init__(
        self,
        http: aiohttp.ClientSession,
        settings: PullSettings,
        ingest: Executor,
        link: LinkModel,
        local: LocalPrefillModel,
        *,
        min_budget: float,
        quality: QualityCosts,
        fp16_bytes_per_token: int,
        wire_budget: Callable[[int, float], float],
        teach_goodput: bool = True,
    ) -> None:
        self.http = http
        self.settings = settings
        self.ingest = ingest
        self.link = link
        self.local = local
        self.min_budget = min_budget
        self.quality = quality
        self.fp16_bytes_per_token = fp16_bytes_per_token
        self.wire_budget = wire_budget  # (tokens, budget) -> the budget asked (raised for tiny payloads)
        # False while other work shares the CPU (a split): its transfers are not the link's goodput
        self.teach_goodput = teach_goodput

    async def run(self, stream: StreamedKV, budget: float, deadline: float | None) -> FetchOutcome:
        """Fetch the KV of ``stream``'s prompt after the positions it covers (kept, or its head)
        into it, starting at ``budget``; ``deadline`` (``time.perf_counter()`` seconds) is when the
        KV should be in, None for no target."""
        started = time.perf_counter()
        total_s = self.settings.timeout.total
        give_up = None if total_s is None else started + total_s  # every segment ends by then
        outcome = FetchOutcome()
        prompt_ids = stream.prompt_ids
        n = len(prompt_ids)
        request: SegmentRequest | None = first_segment(prompt_ids, stream.covered, budget, self.settings.policy)
        computed = n - stream.keep  # what the server prefills for the first segment (a split's head too)
        while request is not None:
            watch = self._watch(deadline, stream, n) if deadline is not None else None
            settings = self.settings if give_up is None else self._until(give_up)
            result = await pull_segment(
                self.http, settings, request, stream, self.ingest, self.fp16_bytes_per_token, watch
            )
            outcome.segments.append(SegmentReport(request.budget, result))
            if result.headers_seconds > 0:  # answered: what it measured teaches, even if it was cut short
                asked = computed if request.path == "/v1/prefill" else 0  # a resume computes nothing
                self.link.observe(result, asked, goodput=self.teach_goodput)
            if result.failure is not None:
                logger.warning("KV segment at budget %.3g ended: %s", request.budget, result.failure)
            elif result.cut_reason:
                logger.info("KV segment cut after %d tokens: %s", result.tokens, result.cut_reason)
            out_of_time = give_up is not None and time.perf_counter() >= give_up
            request = None if out_of_time else self._next(stream, n, outcome, deadline, watch)
        outcome.seconds = time.perf_counter() - started
        return outcome

    def _until(self, give_up: float) -> PullSettings:
        """The pull settings with the total timeout cut to what is left until ``give_up``."""
        t = self.settings.timeout
        left = aiohttp.ClientTimeout(
            total=max(give_up - time.perf_counter(), 1e-3),  # 0 would mean no timeout at all
            connect=t.connect,
            sock_read=t.sock_read,
            sock_connect=t.sock_connect,
            ceil_threshold=t.ceil_threshold,
        )
        return dataclasses.replace(self.settings, timeout=left)

    def _watch(self, deadline: float, stream: StreamedKV, end: int) -> SegmentWatch:
        """The watch of the segment of ``stream``'s positions [covered, end) that should end by ``deadline``."""

        def rest_s(goodput: float, tokens_left: int) -> float:
            """Seconds to get the segment's last ``tokens_left`` tokens another way: resumed at the
            floor budget at this goodput, or computed here (all the segment's positions, where its EDKV window
            leaves the windowed layers of the part before the cut out: kv.window)."""
            rtt = self.link.estimate().rtt_s or 0.0
            wire = self.wire_budget(tokens_left, self.min_budget) * tokens_left * self.fp16_bytes_per_token
            remote = rtt + wire / goodput if goodput > 0 else float("inf")
            header = stream.header
            windowed = header is not None and header.window is not None and header.window.start > 0
            local_start = stream.keep + stream.head if windowed else end - tokens_left
            return min(remote, self.local.predict_between(local_start, end))

        return SegmentWatch(deadline - time.perf_counter(), end - stream.covered, rest_s)

    def _next(
        self,
        stream: StreamedKV,
        n: int,
        outcome: FetchOutcome,
        deadline: float | None,
        watch: SegmentWatch | None,
    ) -> SegmentRequest | None:
        """The next segment's request, or None when the rest is computed here (or nothing is left)."""
        last = outcome.segments[-1]
        if last.result.ended == "complete" or stream.covered >= n - 1 or len(outcome.segments) >= MAX_SEGMENTS:
            return None  # the prompt's last token runs here anyway
        if last.result.ended == "timeout" and last.result.tokens == 0:
            return None  # nothing verified in all that time: the same endpoint would likely fare no better
        if last.result.ended in ("rejected", "too_large", "bad_payload"):
            return None  # asking again would get the same answer
        transfer = next((s.header.transfer for s in reversed(stream.segments) if s.header and s.header.transfer), None)
        if transfer is None:
            return None  # the server keeps no transfer to resume
        plan = self._plan_rest(stream, n, last.budget, deadline, watch)
        logger.info("the KV of positions %d..%d: %s (%s)", stream.covered, n, plan.decision, plan.why)
        if plan.decision != "remote" or plan.budget is None:
            return None
        stream.resume()
        return resume_segment(transfer.id, stream.covered, plan.budget, self.settings.policy)

    def _plan_rest(
        self, stream: StreamedKV, n: int, budget: float, deadline: float | None, watch: SegmentWatch | None
    ) -> KVPlan:
        """Where ``stream``'s positions [covered, n) should come from, the link judged by the last segment's
        recent goodput (the link model's estimate when it had none); computed here, they start from
        ``stream.local_from``."""
        tokens = n - stream.covered
        estimate = self.link.estimate()
        goodput = watch.goodput_bps if watch is not None and watch.goodput_bps is not None else estimate.goodput_bps
        rtt = estimate.rtt_s or 0.0

        def predict(wire_bytes: int) -> float | None:
            return None if goodput is None else rtt + wire_bytes / goodput if goodput > 0 else float("inf")

        return plan_kv(
            PlanInputs(
                target_s=None if deadline is None else deadline - time.perf_counter(),
                fixed_budget=budget,
                wire_bytes=lambda b: int(self.wire_budget(tokens, b) * tokens * self.fp16_bytes_per_token),
                predict_remote_s=predict,
                local_s=self.local.predict_between(stream.local_from, n),
                min_budget=min(self.min_budget, budget),
                quality=self.quality,
                context_tokens=n,
            )
        )

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
from concurrent.futures import Executor
from dataclasses import dataclass, field

import aiohttp

from edgedecode.daemon.pull.deadline import Deadline
from edgedecode.daemon.pull.planner import KVPlanner
from edgedecode.daemon.pull.segment import (
    KVPullError,
    PullResult,
    PullSettings,
    SegmentRequest,
    first_segment,
    pull_segment,
    resume_segment,
)
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

    @property
    def wire_bytes(self) -> int:
        return sum(r.wire_bytes for r in self.results)

    @property
    def fp16_bytes(self) -> int:
        return sum(r.fp16_bytes for r in self.results)

    @property
    def tier_counts(self) -> dict[str, int]:
        """Tokens per tier over every segment (tiers with none left out)."""
        tiers: dict[str, int] = {}
        for result in self.results:
            for name, count in result.tier_counts.items():
                if count:
                    tiers[name] = tiers.get(name, 0) + count
        return tiers

    @property
    def server_seconds(self) -> float | None:
        """The prefill server's own time over the segments that reported it (None: none did)."""
        reported = [r.server_seconds for r in self.results if r.server_seconds is not None]
        return sum(reported) if reported else None


class KVFetch:
    """Fetches one turn's KV from the prefill server at ``url`` into a ``StreamedKV`` (see the module
    docstring); ``planner`` plans and watches its segments and learns from each that got an answer
    (``teach_goodput`` False: its round trip and server time only), and from the first what the
    server's prefix cache held of the prompt (``server_held``: the tokens the planner believed it held).
    """

    def __init__(
        self,
        http: aiohttp.ClientSession,
        settings: PullSettings,
        ingest: Executor,
        planner: KVPlanner,
        *,
        teach_goodput: bool = True,
        server_held: int = 0,
    ) -> None:
        self.http = http
        self.settings = settings
        self.ingest = ingest
        self.planner = planner
        # False while other work shares the CPU (a split): its transfers are not the link's goodput
        self.teach_goodput = teach_goodput
        self.server_held = server_held

    async def run(self, stream: StreamedKV, budget: float, deadline: Deadline) -> FetchOutcome:
        """Fetch the KV of ``stream``'s prompt after the positions it covers (kept, or its head)
        into it, starting at ``budget``; under a target, ``deadline`` is when the KV should be in."""
        started = time.perf_counter()
        total_s = self.settings.timeout.total
        give_up = None if total_s is None else started + total_s  # every segment ends by then
        url = self.settings.url
        outcome = FetchOutcome()
        prompt_ids = stream.prompt_ids
        n = len(prompt_ids)
        request: SegmentRequest | None = first_segment(prompt_ids, stream.covered, budget, self.settings.policy)
        computed = n - stream.keep  # what the server prefills for the first segment (a split's head too)
        while request is not None:
            watch = self.planner.watch(url, stream, request.budget, deadline) if deadline.target_s is not None else None
            settings = self.settings if give_up is None else self._until(give_up)
            result = await pull_segment(
                self.http, settings, request, stream, self.ingest, self.planner.fp16_bytes_per_token, watch
            )
            outcome.segments.append(SegmentReport(request.budget, result))
            if result.headers_seconds > 0:  # answered: what it measured teaches, even if it was cut short
                asked = 0  # a resume computes nothing
                if request.path == "/v1/prefill":
                    reused = result.server_reused_tokens
                    if result.server_compute_seconds is not None:  # its time split: a hit teaches both parts
                        asked = n - (reused or 0)
                    else:  # all its time per computed token: learned from pulls it computed whole (its time also
                        asked = 0 if reused else computed  # encodes every token sent, which a hit does not save)
                    self.planner.prefixes.learn(url, prompt_ids, self.server_held, reused)
                sent = n - int(request.body["held_tokens"])
                self.planner.learn_segment(url, result, asked, sent_tokens=sent, goodput=self.teach_goodput)
            if result.failure is not None:
                logger.warning("KV segment at budget %.3g ended: %s", request.budget, result.failure)
            elif result.cut_reason:
                logger.info("KV segment cut after %d tokens: %s", result.tokens, result.cut_reason)
            out_of_time = give_up is not None and time.perf_counter() >= give_up
            goodput = None if watch is None else watch.goodput_bps
            request = None if out_of_time else self._next(stream, n, outcome, deadline, goodput)
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

    def _next(
        self, stream: StreamedKV, n: int, outcome: FetchOutcome, deadline: Deadline, goodput_bps: float | None
    ) -> SegmentRequest | None:
        """The next segment's request, or None when the rest is computed here (or nothing is left);
        ``goodput_bps``: the last segment's recent goodput, if it was watched."""
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
        plan = self.planner.plan_rest(self.settings.url, stream, last.budget, deadline, goodput_bps)
        logger.info("the KV of positions %d..%d: %s (%s)", stream.covered, n, plan.decision, plan.why)
        if plan.decision != "remote" or plan.budget is None:
            return None
        stream.resume()
        return resume_segment(transfer.id, stream.covered, plan.budget, self.settings.policy)

"""The prefill server as the decode daemon reaches it: one owner for the HTTP session, the circuit
breaker and the ingest thread.

``PrefillRemote.pull`` gets a turn's KV as the planner says — pulled into the slot while it
downloads, computed here, or both at once (a split) — or falls back to computing it here when the
server is down, skipped by the breaker, or fails (a reason counted and logged). It returns what it
did as a value (``Pull``), for the turn to report. The ingest thread writes every pulled byte into
the slots' KV buffers; the memory ledger runs its KV encodes and restores there too, so that the
event loop never does that work.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import aiohttp
import numpy as np

from edgedecode.config import DaemonConfig
from edgedecode.daemon.metrics import DaemonMetrics
from edgedecode.daemon.pull.adaptive import KVPlan
from edgedecode.daemon.pull.breaker import CircuitBreaker
from edgedecode.daemon.pull.deadline import Deadline
from edgedecode.daemon.pull.fetch import FetchOutcome, KVFetch
from edgedecode.daemon.pull.held_query import HeldQuery
from edgedecode.daemon.pull.planner import KVPlanner
from edgedecode.daemon.pull.segment import PullSettings
from edgedecode.daemon.slots import DecodeEngine
from edgedecode.runtime.handoff import StreamedKV
from edgedecode.tls import client_tls

logger = logging.getLogger(__name__)
# aiohttp rounds a timeout above its ceil threshold (5 s by default) up to the next whole second of the event loop's
# clock, so a pull could outlive fetch_timeout_s by up to a second: no timeout of a pull is rounded
NO_ROUNDING = math.inf
# a probe of an unknown link under the default objective is given up after this many times its deadline
# (1.1x local prefill's predicted time); what arrived by then is kept, the rest computed here
PROBE_WAIT = 1.0
# ... but not before this: first contact (a connection, the server's first prefill) can outlast a short prompt's
# local prefill, and a probe given up with nothing learned leaves every later turn computing here until the
# re-probe (with the own kernels' packed prompts, README's 41-token turn got 0 bytes from the embedded server by its
# ~0.2 s deadline). Once bytes flow the segment watch judges the link by its goodput as before.
PROBE_MIN_WAIT_S = 1.0


@dataclass(frozen=True)
class Fetched:
    """What a fetch brought into its stream."""

    outcome: FetchOutcome
    tokens: int  # positions of the stream it covered (0: nothing arrived)
    fallback: str | None = None  # why the rest is computed here (a KVPullError reason), if a failure is why
    useful: bool = True  # the turn decodes from the stream: something arrived, or it has a head computed here


@dataclass(frozen=True)
class Pull:
    """What ``PrefillRemote.pull`` made of a turn's KV: decode from ``stream`` (None: compute the
    prompt here); for a split, ``tail`` fetches the rest into it while the head is computed."""

    stream: StreamedKV | None = None
    tail: asyncio.Task[Fetched] | None = None
    plan: KVPlan | None = None  # None: nothing was planned (no server, the breaker, local_prefill_only)
    budget: float | None = None  # first asked of the prefill server
    fetched: Fetched | None = None  # what the fetch brought (a split's comes with its tail)
    fallback: str | None = None  # why no pull was even tried (a KVPullError reason)
    server_held: int = 0  # leading prompt tokens the plan priced as held in the server's prefix cache


class PrefillRemote:
    """The prefill server at ``url()`` (None while it is down), asked with ``token``, as
    ``settings`` configure the daemon; ``planner`` plans each pull and learns from it, ``metrics``
    count what the pulls brought and every fallback. ``start`` before the first pull (on the
    serving event loop), ``close`` at the end."""

    def __init__(
        self,
        url: Callable[[], str | None],
        token: str,
        settings: DaemonConfig,
        planner: KVPlanner,
        metrics: DaemonMetrics,
    ) -> None:
        self.url = url
        self.settings = settings
        self.planner = planner
        self.metrics = metrics
        self._token = token
        self.breaker = CircuitBreaker(
            settings.breaker_failures,
            settings.breaker_reset_s,
            on_transition=lambda to: metrics.breaker_transitions.labels(to).inc(),
        )
        self.ingest = ThreadPoolExecutor(1, thread_name_prefix="edgedecode-ingest")
        self.held_query = HeldQuery()
        self._http: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Open the HTTP session that pulls KV; an https prefill server's certificate is verified
        against ``daemon.prefill_ca_file`` (else the system's CAs)."""
        tls = client_tls(self.settings.prefill_ca_file)
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls, timeout_ceil_threshold=NO_ROUNDING))

    async def close(self) -> None:
        """Close the session, then wait for the ingest thread to finish what it was handed."""
        if self._http is not None:
            await self._http.close()
        self.ingest.shutdown(wait=True)

    async def pull(self, engine: DecodeEngine, prompt_ids: np.ndarray, keep: int, deadline: Deadline) -> Pull:
        """The KV of ``prompt_ids`` after the ``keep`` positions ``engine`` holds, in by ``deadline``
        as far as the plan can: once it is in, the stream; a split's at once, with the task fetching
        its tail (the engine computes the head meanwhile); no stream to compute the prompt here (by
        plan, or as a fallback named in the result)."""
        if self.settings.local_prefill_only:
            return Pull()  # by configuration, not a fallback
        url = self.url()
        if url is None:
            return Pull(fallback=self._fallback("unreachable", "no prefill server is running"))
        if not self.breaker.allow():
            return Pull(
                fallback=self._fallback("breaker_open", f"the circuit breaker skips {url} after repeated failures")
            )
        if self._http is None:
            raise RuntimeError("the prefill remote was not started (await start() first)")
        kv_deadline = self.planner.kv_deadline(deadline)
        server_held = await self._server_held(url, prompt_ids, keep, kv_deadline)
        plan = self.planner.plan(url, keep, len(prompt_ids), kv_deadline, server_held=server_held)
        if plan.decision == "local" or plan.budget is None:
            logger.info("prefilling %d tokens locally by plan: %s", len(prompt_ids) - keep, plan.why)
            return Pull(plan=plan, server_held=server_held)
        settings = self._settings(url)
        if kv_deadline.target_s is None and plan.deadline_s is not None:  # the default objective's: watched too
            kv_deadline = Deadline.within(plan.deadline_s)
            if plan.predicted_s is None:  # a probe of an unknown link: waited on for a bounded time only
                settings = self._settings(url, max(PROBE_WAIT * plan.deadline_s, PROBE_MIN_WAIT_S))
        stream = engine.open_kv_stream(prompt_ids, keep, head=plan.head)
        budget = self.planner.budget_for(len(prompt_ids) - keep - plan.head, plan.budget)
        if plan.head:
            fetch = KVFetch(
                self._http, settings, self.ingest, self.planner, teach_goodput=False, server_held=server_held
            )
            tail = asyncio.create_task(self._fetch(fetch, stream, budget, kv_deadline, plan))
            return Pull(stream, tail, plan, budget, server_held=server_held)
        fetch = KVFetch(self._http, settings, self.ingest, self.planner, server_held=server_held)
        fetched = await self._fetch(fetch, stream, budget, kv_deadline, plan)
        if plan.deadline_s is not None:  # the default objective's pull, given up on at its deadline or not
            self.planner.learn_unfinished(url, fetched.outcome.segments[-1].result)
        return Pull(stream if fetched.useful else None, None, plan, budget, fetched, server_held=server_held)

    async def _server_held(self, url: str, prompt_ids: np.ndarray, keep: int, kv_deadline: Deadline) -> int:
        """The leading tokens of ``prompt_ids`` the server at ``url`` holds: what it answers a held query where the
        answer can move the plan (``held_query``: it plans, and a pull could beat computing here), else what this
        daemon learned it holds."""
        planner, n = self.planner, len(prompt_ids)
        believed = planner.prefixes.held_tokens(url, prompt_ids)
        link = planner.links.get(url).estimate()
        if not (planner.plans(kv_deadline) and self.held_query.worth_asking(url, n, believed, link)):
            return believed
        if not planner.pull_could_win(url, keep, n):
            return believed
        assert self._http is not None and link.rtt_s is not None  # pull() checked the first, worth_asking the second
        answered = await self.held_query.ask(self._http, self._settings(url), prompt_ids, link.rtt_s)
        return believed if answered is None else answered

    def _settings(self, url: str, total_s: float | None = None) -> PullSettings:
        """The pull settings for ``url``; ``total_s`` shortens the whole fetch's timeout."""
        s = self.settings
        total = s.fetch_timeout_s if total_s is None else min(s.fetch_timeout_s, total_s)
        timeout = aiohttp.ClientTimeout(
            total=total,
            sock_connect=s.connect_timeout_s,
            sock_read=s.idle_read_timeout_s,
            ceil_threshold=NO_ROUNDING,
        )
        return PullSettings(url, self._token, s.policy, s.max_payload_bytes, timeout)

    async def _fetch(
        self, fetch: KVFetch, stream: StreamedKV, budget: float, deadline: Deadline, plan: KVPlan
    ) -> Fetched:
        """Run ``fetch`` into ``stream``, counted, and tell the breaker how the endpoint did. A pull
        that came whole in one segment teaches the planner how long it took against ``plan``'s
        prediction (a split's tail: the split slowdown; a whole pull: the remote correction)."""
        start = stream.covered
        outcome = await fetch.run(stream, budget, deadline)
        tokens = stream.covered - start
        self._count(outcome, tokens)
        if plan.pull_s and len(outcome.segments) == 1 and outcome.segments[0].result.complete:
            learn = self.planner.learn_split if plan.head else self.planner.learn_pull
            learn(outcome.seconds, plan.pull_s)
        failure = outcome.failure
        if failure is None:
            self.breaker.record_success()
            return Fetched(outcome, tokens)
        if failure.endpoint_fault:  # also when part arrived: an endpoint that always breaks off is skipped too
            self.breaker.record_failure()
        if tokens or stream.head:  # what arrived is kept; the rest is computed here
            message = f"computing the KV after position {stream.covered} here: {failure}"
            return Fetched(outcome, tokens, self._fallback(failure.reason, message))
        return Fetched(outcome, tokens, self._fallback(failure.reason, f"prefilling locally: {failure}"), useful=False)

    def _count(self, outcome: FetchOutcome, tokens: int) -> None:
        """The fetch's time, and what it brought when anything arrived (``tokens`` positions)."""
        self.metrics.kv_fetch.observe(outcome.seconds)
        if not tokens:
            return
        for name, count in outcome.tier_counts.items():
            self.metrics.kv_tier_tokens.labels(name).inc(count)
        self.metrics.kv_wire_bytes.inc(outcome.wire_bytes)
        self.metrics.kv_fp16_bytes.inc(outcome.fp16_bytes)

    def _fallback(self, reason: str, message: str) -> str:
        self.metrics.fallbacks.labels(reason).inc()
        logger.warning("%s (%s)", message, reason)
        return reason

"""The decode daemon's request pipeline, independent of HTTP.

Per turn: wait fairly for a KV slot, keep the KV the slot still holds for this prompt, check that
memory allows the rest, pull the rest's KV from the prefill server into the slot while it downloads
(or prefill locally when the server fails, times out, is skipped by the circuit breaker or sends a
bad payload), then decode on the worker thread and stream the text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import psutil

from edgedecode.config import Config
from edgedecode.daemon.adaptive import KVPlan, PlanInputs, QualityCosts, plan_kv
from edgedecode.daemon.breaker import CircuitBreaker
from edgedecode.daemon.kv_fetch import FetchOutcome, KVFetch
from edgedecode.daemon.kv_memory import KVMemory
from edgedecode.daemon.kv_pull import PullSettings
from edgedecode.daemon.link import DecayingMean, LinkModels, Reprobes
from edgedecode.daemon.link_store import LinkStore
from edgedecode.daemon.local_speed import LocalPrefillModel
from edgedecode.daemon.metrics import DaemonMetrics
from edgedecode.daemon.openai_api import CompletionRequest, Entry, TokenText
from edgedecode.daemon.slots import DecodeEngine, Slot, SlotPool
from edgedecode.daemon.worker import DecodeWorker, Generation
from edgedecode.errors import EdgeDecodeError
from edgedecode.kv.window import tail_budget
from edgedecode.model.loader import LoadedModel
from edgedecode.runtime.engine import GenerationStats
from edgedecode.runtime.handoff import StreamedKV
from edgedecode.runtime.logprobs import ScoredRun, ScoredToken
from edgedecode.tls import client_tls

logger = logging.getLogger(__name__)
WORKER_STALL_SECONDS = 60.0  # a step taking longer than this marks the daemon unhealthy (watchdog)


class AdmissionError(EdgeDecodeError):
    """Not enough memory to take the request now (answered with 503)."""

    http_status = 503
    http_code = "insufficient_memory"
    retry_after_s = 5


@dataclass
class TurnReport:
    """Where a turn's KV came from and what the turn took; sent as the ``edgedecode`` object."""

    kv_source: str = "local"  # "prefill_server" or "local" (a fallback names its reason)
    fallback_reason: str | None = None
    local_reason: str | None = None  # "prompt_logprobs": the request needs the prompt computed here (echo + logprobs)
    prompt_tokens: int = 0
    resume: str = "new"  # where the conversation's earlier KV was: "new" (none), "resident" (in its
    # slot), "compressed" (in the conversation store) or "evicted" (discarded under pressure: re-prefilled)
    reused_tokens: int = 0  # positions whose KV the slot held from the conversation's earlier turns
    restored_tokens: int = 0  # of those, positions whose KV came back from the compressed store
    restored_tiers: dict[str, int] = field(default_factory=dict)  # the tiers they were kept at (tokens)
    evicted_tokens: int = 0  # kept tokens whose KV this turn evicted to fit daemon.kv_memory_mb
    pulled_tokens: int = 0  # prompt positions whose KV the prefill server sent and the engine used
    computed_tokens: int = 0  # prompt positions run through the decode graph here (at least the last)
    budget: float | None = None  # first asked of the prefill server
    segments: list[dict] = field(default_factory=list)  # every request of the fetch (kv_fetch.SegmentReport)
    wire_bytes: int = 0
    fp16_bytes: int = 0
    tiers: dict[str, int] = field(default_factory=dict)
    fetch_seconds: float = 0.0
    server_seconds: float | None = None  # the prefill server's share of fetch_seconds, as it reports it
    ttft_seconds: float = 0.0
    decode_tokens_per_second: float = 0.0
    slot: int = -1
    decision: str | None = None  # the KV plan: "remote", "local" or "split" (None: no plan, e.g. no server)
    head_tokens: int = 0  # a split's leading tokens computed here while the rest was pulled
    predicted_seconds: float | None = None  # the plan's predicted time to have the KV
    ttft_target_seconds: float | None = None

    @property
    def target_met(self) -> bool | None:
        """Whether the first token came within the target (None: no target)."""
        return None if self.ttft_target_seconds is None else self.ttft_seconds <= self.ttft_target_seconds

    def to_json(self) -> dict:
        return {
            "kv": {
                "source": self.kv_source,
                "fallback_reason": self.fallback_reason,
                "local_reason": self.local_reason,
                "resume": self.resume,
                "reused_tokens": self.reused_tokens,
                "restored_tokens": self.restored_tokens,
                "restored_tiers": self.restored_tiers,
                "evicted_tokens": self.evicted_tokens,
                "pulled_tokens": self.pulled_tokens,
                "computed_tokens": self.computed_tokens,
                "budget": self.budget,
                "segments": self.segments,
                "wire_bytes": self.wire_bytes,
                "fp16_bytes": self.fp16_bytes,
                "b_wire": round(self.wire_bytes / self.fp16_bytes, 4) if self.fp16_bytes else None,
                "tiers": self.tiers,
                "fetch_ms": round(self.fetch_seconds * 1e3, 2),
                "prefill_server_ms": None if self.server_seconds is None else round(self.server_seconds * 1e3, 2),
                "decision": self.decision,
                "head_tokens": self.head_tokens,
                "predicted_ms": None if self.predicted_seconds is None else round(self.predicted_seconds * 1e3, 2),
            },
            "ttft_target_ms": None if self.ttft_target_seconds is None else round(self.ttft_target_seconds * 1e3, 2),
            "ttft_target_met": self.target_met,
            "ttft_ms": round(self.ttft_seconds * 1e3, 2),
            "decode_tokens_per_second": round(self.decode_tokens_per_second, 2),
            "slot": self.slot,
        }


class DecodeService:
    """The worker thread, the slot pool over the decode engines it is given (one per slot) and the
    link to the prefill server.

    ``model`` gives the tokenizer, the model's name and its KV size; ``engines`` (``daemon.run.
    build_engines`` makes the real ones, on one onnxruntime session) are the slots' engines, all of
    the same ``max_context``.
    """

    def __init__(
        self,
        model: LoadedModel,
        engines: Sequence[DecodeEngine],
        config: Config,
        metrics: DaemonMetrics,
        prefill_url: Callable[[], str | None],
        prefill_token: str,
    ) -> None:
        if not engines:
            raise ValueError("the decode service needs at least one engine")
        self.model = model
        self.config = config
        self.metrics = metrics
        self.prefill_url = prefill_url  # the prefill server now (None while it is down)
        self._prefill_token = prefill_token
        d = config.daemon
        self.max_context = engines[0].max_context
        self.kv_bytes_per_slot_token = engines[0].kv_bytes_per_slot
        self.pool = SlotPool(engines, d.max_queue)
        self.worker = DecodeWorker()
        self.breaker = CircuitBreaker(
            d.breaker_failures, d.breaker_reset_s, on_transition=lambda to: metrics.breaker_transitions.labels(to).inc()
        )
        self._ingest = ThreadPoolExecutor(1, thread_name_prefix="edgedecode-ingest")
        self._http: aiohttp.ClientSession | None = None
        self._releasing: set[asyncio.Future] = set()  # slots waiting for their fetch to end
        self.memory = KVMemory(
            self.pool,
            d.kv_memory_mb << 20,
            d.max_sessions,
            self.kv_bytes_per_slot_token,
            self._ingest,
            metrics.conversations,
            preallocated=engines[0].kv_preallocated,
        )
        store = LinkStore(Path(d.state_dir)) if d.state_dir else None
        self.links = LinkModels(metrics.registry, stale_margin=d.link_stale_margin, store=store)
        self.local_speed = LocalPrefillModel()  # daemon/run.py calibrates it on a real engine before serving
        self.quality = QualityCosts(local=d.local_dppl_pct)
        # how much longer a split's pull takes than alone, as measured on this box (the configured
        # value until a split has been seen, and again after hours without one)
        self.split_slowdown = DecayingMean(alpha=0.3, half_life_s=3600.0, min_weight=0.1)
        self.reprobes = Reprobes(d.link_reprobe_s)
        metrics.resident_kv.set_function(
            lambda: sum(slot.engine.length for slot in self.pool.slots) * self.kv_bytes_per_slot_token
        )
        metrics.queue_depth.set_function(lambda: self.pool.queued)
        metrics.active.set_function(lambda: self.pool.busy)
        metrics.breaker_open.set_function(lambda: float(self.breaker.state == "open"))

    async def start(self) -> None:
        """Open the HTTP client used to pull KV (call on the serving event loop); an https prefill
        server's certificate is verified against ``daemon.prefill_ca_file`` (else the system's CAs)."""
        tls = client_tls(self.config.daemon.prefill_ca_file)
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls))

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
        self.worker.stop()
        self._ingest.shutdown(wait=True)

    def healthy(self) -> bool:
        """The worker thread is alive and not stuck (what the systemd watchdog pings on)."""
        return self.worker.healthy(WORKER_STALL_SECONDS)

    def turn(self, request: CompletionRequest, client: str, arrived: float) -> Turn:
        """A turn for ``request``; ``await turn.open()`` then iterate ``turn.pieces()``."""
        return Turn(self, request, client, arrived)

    def _admit(self, new_tokens: int) -> None:
        """Refuse a request whose KV would eat into the configured memory reserve."""
        need = new_tokens * self.kv_bytes_per_slot_token
        available = psutil.virtual_memory().available
        reserve = self.config.daemon.memory_reserve_mb << 20
        if available - need < reserve:
            raise AdmissionError(
                f"not enough memory for this request: its KV needs {need >> 20} MiB, "
                f"{available >> 20} MiB are available and {reserve >> 20} MiB are kept in reserve"
            )

    async def _pull(
        self, slot: Slot, prompt_ids: np.ndarray, keep: int, report: TurnReport, target_s: float | None
    ) -> tuple[StreamedKV | None, asyncio.Task | None]:
        """Pull the KV of the prompt after ``keep`` into the slot as the plan for ``target_s`` says
        (the time left under the turn's target; None: none): (the stream, None) once it is in; (None,
        None) to prefill locally (by plan, or as a fallback whose reason is in ``report``); for a
        split plan at once (the stream, the task fetching its tail) — the engine computes the head
        meanwhile."""
        url = self.prefill_url()
        if self.config.daemon.local_prefill_only:
            return None, None  # by configuration, not a fallback
        if url is None:
            self._fallback(report, "unreachable", "no prefill server is running")
            return None, None
        if not self.breaker.allow():
            self._fallback(report, "breaker_open", f"the circuit breaker skips {url} after repeated failures")
            return None, None
        if self._http is None:
            raise RuntimeError("the decode service was not started (await start() first)")
        tokens = len(prompt_ids) - keep
        if target_s is not None:  # the KV must be in before the prompt's last token runs and is sampled
            target_s -= self.local_speed.predict_seconds(1) if self.local_speed.ready else 0.0
        plan = self.plan(url, keep, len(prompt_ids), target_s)
        if plan.decision == "local" and self.reprobes.due(url, self.links.get(url)):
            self.metrics.reprobes.inc()
            plan = self.plan(url, keep, len(prompt_ids), target_s, reprobe=True)
        report.decision, report.predicted_seconds, report.head_tokens = plan.decision, plan.predicted_s, plan.head
        self.metrics.decisions.labels(plan.decision).inc()
        if plan.decision == "local" or plan.budget is None:
            logger.info("prefilling %d tokens locally by plan: %s", tokens, plan.why)
            return None, None
        stream = slot.engine.open_kv_stream(prompt_ids, keep, head=plan.head)
        report.budget = self.budget_for(tokens - plan.head, plan.budget)
        deadline = None if target_s is None else time.perf_counter() + target_s
        if plan.head:
            fetching = self._fetch(self._fetcher(url, teach_goodput=False), stream, report, deadline, plan.pull_s)
            return stream, asyncio.create_task(fetching)
        return (stream if await self._fetch(self._fetcher(url), stream, report, deadline) else None), None

    def _fetcher(self, url: str, teach_goodput: bool = True) -> KVFetch:
        d = self.config.daemon
        assert self._http is not None
        settings = PullSettings(
            url,
            self._prefill_token,
            d.policy,
            d.max_payload_bytes,
            aiohttp.ClientTimeout(
                total=d.fetch_timeout_s, sock_connect=d.connect_timeout_s, sock_read=d.idle_read_timeout_s
            ),
        )
        return KVFetch(
            self._http,
            settings,
            self._ingest,
            self.links.get(url),
            self.local_speed,
            min_budget=d.min_budget,
            quality=self.quality,
            fp16_bytes_per_token=self.model.spec.kv_bytes_per_token_fp16,
            wire_budget=self.budget_for,
            teach_goodput=teach_goodput,
        )

    async def _fetch(
        self,
        fetch: KVFetch,
        stream: StreamedKV,
        report: TurnReport,
        deadline: float | None,
        split_pull_s: float | None = None,
    ) -> bool:
        """Run ``fetch`` into ``stream`` and account for it; whether the stream is of use to the
        turn (something arrived, or it has a head computed here), else the turn prefills locally.
        ``split_pull_s``: a split's tail pull as predicted alone; what it took teaches the split
        slowdown."""
        start = stream.covered
        assert report.budget is not None
        outcome = await fetch.run(stream, report.budget, deadline)
        self._record_fetch(outcome, stream, start, report)
        if split_pull_s and len(outcome.segments) == 1 and outcome.segments[0].result.complete:
            self.split_slowdown.add(outcome.seconds / split_pull_s, time.monotonic())
        failure = outcome.failure
        arrived = stream.covered > start
        if failure is None:
            self.breaker.record_success()
        elif failure.endpoint_fault:  # also when part arrived: an endpoint that always breaks off is skipped too
            self.breaker.record_failure()
        if failure is None:
            return True
        if arrived or stream.head:  # what arrived is kept; the rest is computed here
            self._fallback(report, failure.reason, f"computing the KV after position {stream.covered} here: {failure}")
            return True
        self._fallback(report, failure.reason, f"prefilling locally: {failure}")
        return False

    def _fallback(self, report: TurnReport, reason: str, message: str) -> None:
        report.fallback_reason = reason
        self.metrics.fallbacks.labels(reason).inc()
        logger.warning("%s (%s)", message, reason)

    def budget_for(self, tokens: int, budget: float | None = None) -> float:
        """The budget asked for ``tokens`` tokens' KV: ``budget`` (default: the configured one), raised
        so the payload may use at least ``min_wire_bytes`` (a few KB saved are not worth dropping a
        short prompt's tokens) and, for a model with sliding windows, so its never-dropped tail fits
        (``kv.window.tail_budget``: a short Gemma prompt is all tail)."""
        d = self.config.daemon
        fp16_bytes = max(tokens, 1) * self.model.spec.kv_bytes_per_token_fp16
        floor = max(d.min_wire_bytes / fp16_bytes, tail_budget(max(tokens, 1), self.model.spec.kv_contract))
        return min(1.0, max(d.budget if budget is None else budget, floor))

    def plan(self, url: str, keep: int, prompt_tokens: int, target_s: float | None, *, reprobe: bool = False) -> KVPlan:
        """Where the KV of the prompt's positions after ``keep`` should come from to arrive within
        ``target_s`` (see adaptive.py); ``reprobe``: the best pull, local prefill left out."""
        link = self.links.get(url)
        d = self.config.daemon
        tokens = prompt_tokens - keep
        fp16_bytes = max(tokens, 1) * self.model.spec.kv_bytes_per_token_fp16
        local = self.local_speed
        plan = plan_kv(
            PlanInputs(
                target_s=target_s,
                fixed_budget=d.budget,
                wire_bytes=lambda budget: int(self.budget_for(tokens, budget) * fp16_bytes),
                predict_remote_s=lambda wire_bytes: link.predict_fetch_s(wire_bytes, tokens),
                local_s=math.inf if reprobe else local.predict_seconds(tokens),
                min_budget=d.min_budget,
                quality=self.quality,
                tokens=tokens,
                context_tokens=prompt_tokens,
                local_head_s=None if reprobe else lambda head: local.predict_between(keep, keep + head),
                split_slowdown=max(self.split_slowdown.value(time.monotonic()) or d.split_slowdown, 1.0),
            )
        )
        if reprobe:
            plan = dataclasses.replace(plan, why=f"re-probing a link last measured long ago: {plan.why}")
        return plan

    def _record_fetch(self, outcome: FetchOutcome, stream: StreamedKV, start: int, report: TurnReport) -> None:
        """Put what the fetch brought (positions from ``start`` on) in the report and the metrics."""
        results = outcome.results
        report.segments = [segment.to_json() for segment in outcome.segments]
        report.fetch_seconds = outcome.seconds
        self.metrics.kv_fetch.observe(outcome.seconds)
        if stream.covered == start:
            return  # nothing arrived: the turn prefills locally
        report.kv_source = "prefill_server"
        report.pulled_tokens = stream.covered - start  # until the engine says which it computed (Turn.pieces)
        report.wire_bytes = sum(r.wire_bytes for r in results)
        report.fp16_bytes = sum(r.fp16_bytes for r in results)
        tiers: dict[str, int] = {}
        for result in results:
            for name, count in result.tier_counts.items():
                if count:
                    tiers[name] = tiers.get(name, 0) + count
                    self.metrics.kv_tier_tokens.labels(name).inc(count)
        report.tiers = tiers
        reported = [r.server_seconds for r in results if r.server_seconds is not None]
        report.server_seconds = sum(reported) if reported else None
        self.metrics.kv_wire_bytes.inc(report.wire_bytes)
        self.metrics.kv_fp16_bytes.inc(report.fp16_bytes)

    def _release_after_ingest(self, slot: Slot) -> None:
        """Give the slot back once the ingest thread is done with it (it may still be writing into it)."""
        done = asyncio.get_running_loop().run_in_executor(self._ingest, lambda: None)
        done.add_done_callback(lambda _: self._release(slot))

    def _release_after_fetch(self, slot: Slot, fetching: asyncio.Task) -> None:
        """Give the slot back once its fetch has ended (cancelled if the turn ended first) and the
        ingest thread is done with it."""

        async def release() -> None:
            fetching.cancel()  # a no-op once it has ended
            await asyncio.gather(fetching, return_exceptions=True)
            self._release_after_ingest(slot)

        self._releasing.add(task := asyncio.ensure_future(release()))
        task.add_done_callback(self._releasing.discard)

    def _release(self, slot: Slot) -> None:
        """The turn is over with ``slot``: its reservation shrinks to the KV it holds; serve the next."""
        self.memory.settle(slot)
        self.pool.release(slot)


@dataclass(frozen=True)
class ChoiceEnd:
    """The worker's item after one choice's tokens: the engine's stats of it (None: nothing was
    generated, max_tokens 0)."""

    index: int
    stats: GenerationStats | None


class ChoiceCuts:
    """The choices the event loop ended (a stop string in their text): the worker stops generating
    them at their next token. Written on the event loop, read on the worker (one int)."""

    def __init__(self) -> None:
        self.last = -1  # choices up to this index are ended

    def cut(self, index: int) -> None:
        self.last = max(self.last, index)

    def __contains__(self, index: int) -> bool:
        return index <= self.last


def _turn_steps(
    engine: DecodeEngine,
    request: CompletionRequest,
    stream: StreamedKV | None,
    keep: int,
    cuts: ChoiceCuts,
    arrived: threading.Event | None = None,
) -> Iterator[object]:
    """A turn on the worker: the prompt's KV (a split's head computed while its tail arrives: None
    while waiting, the worker serves the others meanwhile; an echo with logprobs computes and scores
    the whole prompt here, yielding its ScoredRuns), then each choice's tokens (ints, or ScoredTokens
    with logprobs) and its ChoiceEnd. Choices after the first keep the prompt's KV the engine holds
    and run its last token again."""
    prompt = request.prompt_ids
    if arrived is not None:
        assert stream is not None
        engine.compute_head(stream)
        while not arrived.is_set():
            yield None
    if request.prompt_logprobs:
        yield from engine.score_prompt(prompt, request.logprobs or 0)
        keep = engine.reusable_prefix(prompt)
    for index in range(request.n):
        params = request.choice_params(index)
        if params.max_tokens == 0:  # echo only
            yield ChoiceEnd(index, None)
            continue
        if index:
            stream, keep = None, engine.reusable_prefix(prompt)
        steps = (
            engine.generate(prompt, params, kv=stream, keep=keep)
            if request.logprobs is None
            else engine.generate_scored(prompt, params, kv=stream, keep=keep, top=request.logprobs)
        )
        for item in steps:
            yield item
            if index in cuts:
                break
        yield ChoiceEnd(index, dataclasses.replace(engine.stats))


@dataclass
class Piece:
    """What a turn hands out: text of choice ``index`` with the entries of the tokens it completes
    (None: no log-probabilities asked for); the last piece of a choice has its ``finish_reason``."""

    index: int
    text: str
    entries: list[Entry] | None = None
    finish_reason: str | None = None


class Turn:
    """One request's way through the pipeline: ``open()`` (slot, KV), then ``pieces()`` (text)."""

    def __init__(self, service: DecodeService, request: CompletionRequest, client: str, arrived: float) -> None:
        self.service = service
        self.request = request
        self.client = client
        self.arrived = arrived
        self.report = TurnReport(prompt_tokens=len(request.prompt_ids))
        self.finish_reason = "length"  # the last choice's
        self.completion_tokens = 0  # over every choice
        self._slot: Slot | None = None
        self._generation: Generation | None = None
        self._cuts = ChoiceCuts()

    async def open(self) -> None:
        """Take a slot, keep what it holds of the prompt, pull the rest's KV (or fall back) and
        start decoding. Raises QueueFullError or AdmissionError (nothing held afterwards).

        An echo with logprobs computes its whole prompt here (a pulled KV brings no logits to score
        the prompt's tokens with): nothing is kept or pulled, the report says kv source "local" with
        local_reason "prompt_logprobs". An echo that generates nothing needs no KV at all."""
        service, request = self.service, self.request
        slot = await service.pool.acquire(self.client, request.session_id)
        try:
            engine, report = slot.engine, self.report
            if slot.resumed:
                keep = 0 if request.prompt_logprobs else engine.reusable_prefix(request.prompt_ids)
                report.resume = "resident" if keep else "new"
            else:
                resumed = await service.memory.resume(slot, request.session_id, request.prompt_ids)
                keep, report.restored_tiers, report.resume = resumed
                keep = 0 if request.prompt_logprobs else keep
                report.restored_tokens = keep
            new_tokens = len(request.prompt_ids) - keep + request.params.max_tokens
            service._admit(new_tokens)
            report.evicted_tokens = await service.memory.admit(slot, keep, new_tokens)
            report.reused_tokens, report.slot = keep, slot.index
            target_ms = (
                service.config.daemon.ttft_target_ms if request.ttft_target_ms is None else request.ttft_target_ms
            )
            self.report.ttft_target_seconds = target_ms / 1e3 if target_ms > 0 else None
            left = None if target_ms <= 0 else target_ms / 1e3 - (time.perf_counter() - self.arrived)
            if request.prompt_logprobs:
                stream, fetching = None, None
                report.local_reason = "prompt_logprobs"
            elif request.params.max_tokens == 0:
                stream, fetching = None, None
            else:
                stream, fetching = await service._pull(slot, request.prompt_ids, keep, self.report, left)
        except BaseException:
            service._release_after_ingest(slot)
            raise
        self._slot = slot
        if fetching is None:
            steps = _turn_steps(engine, request, stream, keep, self._cuts)
            self._generation = service.worker.submit(steps, on_done=lambda: service._release(slot))
            return
        assert stream is not None
        arrived = threading.Event()
        fetching.add_done_callback(lambda _: arrived.set())
        steps = _turn_steps(engine, request, stream, keep, self._cuts, arrived)
        self._generation = service.worker.submit(steps, on_done=lambda: service._release_after_fetch(slot, fetching))

    async def pieces(self) -> AsyncIterator[Piece]:
        """The generated text as it comes, choice after choice (stop strings cut it; with echo, each
        choice starts with the prompt's text); then ``finish_reason``, ``completion_tokens`` and
        ``report`` are final."""
        service, metrics, request = self.service, self.service.metrics, self.request
        generation, slot = self._generation, self._slot
        if generation is None or slot is None:
            raise RuntimeError("the turn was not opened (await open() first)")
        tokenizer = service.model.tokenizer
        tracked = request.logprobs is not None
        runs: list[ScoredRun] = []  # the prompt's scores (echo with logprobs)
        echo: tuple[str, list[Entry] | None] | None = None
        index, ended = 0, False  # the choice the worker's items are of; whether a stop string ended it
        text: TokenText | None = None  # that choice's text, once it has begun
        decode_steps, decode_seconds = 0, 0.0
        previous = 0.0  # when the last token came (0: none yet)
        try:
            async for item in generation:
                if isinstance(item, ScoredRun):
                    runs.append(item)
                    continue
                if not previous:
                    previous = self._first_out(slot.engine.stats)
                if ended and not isinstance(item, ChoiceEnd):
                    continue  # tokens of a choice a stop string ended, until the worker sees it
                if text is None:  # the choice begins
                    if request.echo:
                        echo = echo or self._echo(runs)
                        yield Piece(index, echo[0], echo[1])
                    base = len(echo[0]) if echo else 0
                    text = TokenText(tokenizer.stream_decoder(), request.stop, base=base, tracked=tracked)
                if isinstance(item, ChoiceEnd):
                    if not ended:
                        out, entries = text.finish()
                        stopped = text.stopped or (item.stats is not None and item.stats.finish_reason == "stop")
                        self.finish_reason = finish = "stop" if stopped else "length"
                        yield Piece(index, out, entries if tracked else None, finish)
                    if item.stats is not None:
                        decode_steps += item.stats.decode_steps
                        decode_seconds += item.stats.decode_seconds
                        if index == 0:
                            self._teach_local_speed(item.stats)
                    index, text, ended = index + 1, None, False
                    continue
                now = time.perf_counter()
                if self.completion_tokens:
                    metrics.inter_token.observe(now - previous)
                previous = now
                self.completion_tokens += 1
                metrics.generated.inc()
                token = item.token if isinstance(item, ScoredToken) else item
                out, entries = text.feed(token, item if tracked else None)
                if out or entries:
                    yield Piece(index, out, entries if tracked else None)
                if text.stopped:  # the rest of this choice is cut: say so now, not after the worker's next step
                    self._cuts.cut(index)
                    self.finish_reason, ended = "stop", True
                    yield Piece(index, "", [] if tracked else None, "stop")
                    if index == request.n - 1:
                        return
            self.report.decode_tokens_per_second = decode_steps / decode_seconds if decode_seconds > 0 else 0.0
        finally:
            generation.cancel()  # a no-op once it has ended; stops it when the client went away
            self._account()

    def _first_out(self, stats: GenerationStats) -> float:
        """The prompt is processed (the first token, or the end of an echo's choice): time to first
        token and what the engine computed of the prompt."""
        now = time.perf_counter()
        metrics = self.service.metrics
        self.report.ttft_seconds = now - self.arrived
        self._record_prompt(stats)
        metrics.ttft.observe(self.report.ttft_seconds)
        if self.report.target_met is not None:
            metrics.ttft_target.labels(str(self.report.target_met).lower()).inc()
        return now

    def _echo(self, runs: list[ScoredRun]) -> tuple[str, list[Entry] | None]:
        """The prompt's text as each choice of an echo starts with it, with its tokens' entries
        (the first token's without a log-probability) where logprobs are asked for."""
        request = self.request
        tracked = request.logprobs is not None
        text = TokenText(self.service.model.tokenizer.stream_decoder(), (), tracked=tracked)
        scored = iter(
            [
                ScoredToken(int(run.token_ids[i]), float(run.logprobs[i]), run.top_ids[i], run.top_logprobs[i])
                for run in runs
                for i in range(len(run.token_ids))
            ]
        )
        parts, entries = [], []
        for position, token in enumerate(request.prompt_ids.tolist()):
            out, released = text.feed(token, token if position == 0 or not tracked else next(scored))
            parts.append(out)
            entries += released
        out, released = text.finish()
        return "".join(parts) + out, (entries + released) if tracked else None

    def _teach_local_speed(self, stats: GenerationStats) -> None:
        """A turn whose prompt was computed here times the local prefill (not an echo's scoring: its
        logits of every position take longer than a prefill's)."""
        computed = len(self.request.prompt_ids) - self.report.reused_tokens
        if self.report.kv_source == "local" and computed > 0 and not self.request.prompt_logprobs:
            self.service.local_speed.observe(computed, stats.prefill_seconds)

    def _record_prompt(self, stats: GenerationStats) -> None:
        """Which prompt positions the engine computed (known once the first token is out)."""
        report = self.report
        if self.request.prompt_logprobs:  # scored here whole, its last token run when the choice began
            report.computed_tokens = report.prompt_tokens
            return
        if self.request.params.max_tokens == 0:
            return  # nothing ran
        report.computed_tokens = stats.computed_tokens
        if report.kv_source == "prefill_server":
            report.pulled_tokens = report.prompt_tokens - report.reused_tokens - stats.computed_tokens

    def _account(self) -> None:
        metrics, report = self.service.metrics, self.report
        pulled = report.pulled_tokens if report.kv_source == "prefill_server" else 0
        metrics.kv_tokens.labels("reused").inc(report.reused_tokens)
        metrics.kv_tokens.labels("pulled").inc(pulled)
        metrics.kv_tokens.labels("computed").inc(max(report.prompt_tokens - report.reused_tokens - pulled, 0))

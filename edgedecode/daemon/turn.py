"""A turn: one completion request's way through the daemon, as a handful of calls on its owners.

``Turn.open``: a slot (``SlotLease``), what it holds of the conversation and room for the rest
(``MemoryLedger.resume``, ``admit``), the prompt's KV (``PrefillRemote.pull``), then decoding on the
worker (``DecodeWorker.submit``). ``Turn.pieces``: the text as it comes. The slot goes back once the
worker is done with the generation (it ended, or ``close`` stopped it) and nothing else writes into
its KV buffers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from edgedecode.daemon.openai_api import CompletionRequest
from edgedecode.daemon.openai_responses import Entry, TokenText
from edgedecode.daemon.pull.deadline import Deadline
from edgedecode.daemon.pull.remote import Fetched, Pull
from edgedecode.daemon.report import TurnReport
from edgedecode.daemon.slots import DecodeEngine, SlotLease
from edgedecode.daemon.steps import ChoiceCuts, ChoiceEnd, turn_steps
from edgedecode.daemon.worker import Generation
from edgedecode.runtime.engine import GenerationStats
from edgedecode.runtime.logprobs import ScoredRun, ScoredToken

if TYPE_CHECKING:
    from edgedecode.daemon.service import DecodeService

logger = logging.getLogger(__name__)


@dataclass
class Piece:
    """What a turn hands out: text of choice ``index`` with the entries of the tokens it completes
    (None: no log-probabilities asked for); the last piece of a choice has its ``finish_reason``."""

    index: int
    text: str
    entries: list[Entry] | None = None
    finish_reason: str | None = None


class Turn:
    """One request's way through the daemon (see the module docstring): ``await open()``, then
    iterate ``pieces()``, whose end closes the turn; or ``async with service.turn(...) as turn``.

    ``arrived``: when the request arrived (``time.perf_counter()``), from which its time to first
    token counts and its deadline is set, once (``daemon.ttft_target_ms`` or the request's own).
    """

    def __init__(self, service: DecodeService, request: CompletionRequest, client: str, arrived: float) -> None:
        self._service = service
        self.request = request
        self.client = client
        self.arrived = arrived
        target_ms = service.config.daemon.ttft_target_ms if request.ttft_target_ms is None else request.ttft_target_ms
        self.deadline = Deadline.for_turn(target_ms, arrived)
        self.report = TurnReport(prompt_tokens=len(request.prompt_ids), ttft_target_seconds=self.deadline.target_s)
        self.finish_reason = "length"  # the last choice's
        self.completion_tokens = 0  # over every choice
        self._engine: DecodeEngine | None = None
        self._generation: Generation | None = None
        self._tail: asyncio.Task[Fetched] | None = None
        self._lease: SlotLease | None = None
        self._holding = contextlib.AsyncExitStack()  # the lease, from open() until the turn is over
        self._ended: asyncio.Future[None] | None = None  # the worker let go of the generation
        self._closed: asyncio.Task[None] | None = None
        self._cuts = ChoiceCuts()

    async def __aenter__(self) -> Turn:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        """Take a slot, keep what it holds of the prompt, make room for the rest, get its KV (pulled,
        computed here, or both) and start decoding. Raises QueueFullError or KVMemoryError (nothing
        held afterwards).

        An echo with logprobs computes its whole prompt here (a pulled KV brings no logits to score
        the prompt's tokens with): nothing is kept or pulled, the report says kv source "local" with
        local_reason "prompt_logprobs". An echo that generates nothing needs no KV at all."""
        service, request, report = self._service, self.request, self.report
        async with contextlib.AsyncExitStack() as holding:
            self._lease = service.lease(self.client, request.session_id)
            slot = await holding.enter_async_context(self._lease)
            reuse = not request.prompt_logprobs
            resume = await service.memory.resume(slot, request.session_id, request.prompt_ids, reuse=reuse)
            new_tokens = len(request.prompt_ids) - resume.keep + request.params.max_tokens
            report.evicted_tokens = await service.memory.admit(slot, resume.keep, new_tokens)
            report.resumed(resume, slot.index)
            pull = await self._pull(slot.engine, resume.keep)
            report.pulled(pull)
            self._decode(slot.engine, resume.keep, pull)
            self._holding = holding.pop_all()

    async def close(self) -> None:
        """Stop the turn's generation if it still runs (the client went away) and return once its slot
        is given back. Safe to call more than once, and after an ``open`` that failed (nothing held)."""
        if self._generation is None:
            return
        self._generation.cancel()  # a no-op once it has ended
        await asyncio.shield(self._closing())

    async def _pull(self, engine: DecodeEngine, keep: int) -> Pull:
        request = self.request
        if request.prompt_logprobs:
            self.report.local_reason = "prompt_logprobs"
            return Pull()
        if request.params.max_tokens == 0:
            return Pull()
        return await self._service.remote.pull(engine, request.prompt_ids, keep, self.deadline)

    def _decode(self, engine: DecodeEngine, keep: int, pull: Pull) -> None:
        """Start the turn's steps on the worker; a split's wait for its tail (``arrived``) without
        holding the worker."""
        arrived = None
        if pull.tail is not None:
            self._tail, arrived = pull.tail, threading.Event()
            pull.tail.add_done_callback(self._tail_fetched)
            pull.tail.add_done_callback(lambda _: arrived.set())
        self._engine = engine
        self._ended = asyncio.get_running_loop().create_future()
        steps = turn_steps(engine, self.request, pull.stream, keep, self._cuts, arrived)
        self._generation = self._service.worker.submit(steps, on_done=self._generation_ended)

    def _tail_fetched(self, tail: asyncio.Task[Fetched]) -> None:
        if tail.cancelled():
            return
        failure = tail.exception()
        if failure is not None:
            logger.error("the KV fetch of a split turn failed", exc_info=failure)
            return
        self.report.fetched(tail.result())

    def _generation_ended(self) -> None:
        """The worker let go of the generation (on the event loop): the slot may go back."""
        assert self._ended is not None
        self._ended.set_result(None)
        self._closing()

    def _closing(self) -> asyncio.Task[None]:
        if self._closed is None:
            self._closed = asyncio.ensure_future(self._give_back())
        return self._closed

    async def _give_back(self) -> None:
        """Once the worker is done with the generation, the slot goes back. A split whose tail was
        still coming (the client went away) first cancels the tail's fetch and waits for it; the slot
        then goes back once the ingest thread is done too (a fetch cancelled while the ingest thread
        feeds it a piece does not wait for that piece)."""
        assert self._ended is not None and self._lease is not None
        await self._ended
        if self._tail is not None and not self._tail.done():
            self._tail.cancel()
            await asyncio.gather(self._tail, return_exceptions=True)
            self._lease.ingest_may_write = True
        await self._holding.aclose()

    async def pieces(self) -> AsyncGenerator[Piece, None]:
        """The generated text as it comes, choice after choice (stop strings cut it; with echo, each
        choice starts with the prompt's text); then ``finish_reason``, ``completion_tokens`` and
        ``report`` are final."""
        service, metrics, request = self._service, self._service.metrics, self.request
        generation, engine = self._generation, self._engine
        if generation is None or engine is None:
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
                    previous = self._first_out(engine.stats)
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
            self._account()
            await self.close()  # stops the generation when the client went away

    def _first_out(self, stats: GenerationStats) -> float:
        """The prompt is processed (the first token, or the end of an echo's choice): time to first
        token and what the engine computed of the prompt."""
        now = time.perf_counter()
        metrics = self._service.metrics
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
        text = TokenText(self._service.model.tokenizer.stream_decoder(), (), tracked=tracked)
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
            self._service.planner.learn_local_prefill(computed, stats.prefill_seconds)

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
        metrics, report = self._service.metrics, self.report
        pulled = report.pulled_tokens if report.kv_source == "prefill_server" else 0
        metrics.kv_tokens.labels("reused").inc(report.reused_tokens)
        metrics.kv_tokens.labels("pulled").inc(pulled)
        metrics.kv_tokens.labels("computed").inc(max(report.prompt_tokens - report.reused_tokens - pulled, 0))

"""The decode daemon's owners, wired together, independent of HTTP.

- ``pool`` (``slots.SlotPool``): the KV slots over the decode engines it is given, and the fair queue;
- ``memory`` (``memory.ledger.MemoryLedger``): ``daemon.kv_memory_mb`` and ``memory_reserve_mb``, every
  slot's reservation, the compressed conversations (``memory.store.ConversationStore``) and the
  pressure ladder;
- ``planner`` (``pull.planner.KVPlanner``): where each turn's KV comes from, and what the daemon
  learned of its links and its own speed to decide it;
- ``remote`` (``pull.remote.PrefillRemote``): the prefill server's HTTP session, the circuit breaker
  and the ingest thread;
- ``worker`` (``worker.DecodeWorker``): the one onnxruntime thread;
- ``grammars`` (``runtime.constraint.GrammarCompiler``): the grammars of structured answers and tool
  calls, compiled against the model's tokenizer once each.

A request is a ``turn.Turn`` over them (docs/architecture.md: a turn's life in six steps).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from functools import cached_property

from edgedecode.config import Config
from edgedecode.daemon.memory.ledger import MemoryLedger
from edgedecode.daemon.memory.store import ConversationStore
from edgedecode.daemon.memory.working import sized_allowance_bytes
from edgedecode.daemon.metrics import DaemonMetrics
from edgedecode.daemon.openai_api import CompletionRequest
from edgedecode.daemon.pull import calibration as calibrations
from edgedecode.daemon.pull.planner import KVPlanner
from edgedecode.daemon.pull.remote import PrefillRemote
from edgedecode.daemon.slots import DecodeEngine, SlotLease, SlotPool
from edgedecode.daemon.turn import Turn
from edgedecode.daemon.worker import DecodeWorker
from edgedecode.errors import RequestError
from edgedecode.model.loader import LoadedModel
from edgedecode.runtime.constraint import GrammarCompiler
from edgedecode.runtime.runner import prompt_run_bytes

WORKER_STALL_SECONDS = 60.0  # a step taking longer than this marks the daemon unhealthy (watchdog)

logger = logging.getLogger(__name__)


class DecodeService:
    """The daemon's owners for ``model`` (its tokenizer, name and KV size) over ``engines`` (one per
    slot, all of the same ``max_context``; ``daemon.run.build_engines`` makes the real ones, on one
    onnxruntime session), pulling from the prefill server at ``prefill_url()`` (None while it is
    down) with ``prefill_token``. ``start`` it on the serving event loop before the first turn, and
    ``close`` it after the last. ``clock`` ages what the planner learned (``KVPlanner``).

    Raises:
        KVMemoryError: the slots' KV buffers, allocated whole up front (CUDA), exceed daemon.kv_memory_mb.
    """

    def __init__(
        self,
        model: LoadedModel,
        engines: Sequence[DecodeEngine],
        config: Config,
        metrics: DaemonMetrics,
        prefill_url: Callable[[], str | None],
        prefill_token: str,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not engines:
            raise ValueError("the decode service needs at least one engine")
        d = config.daemon
        self.model = model
        self.config = config
        self.metrics = metrics
        self.max_context = engines[0].max_context
        self.pool = SlotPool(engines, d.max_queue)
        self.worker = DecodeWorker()
        spec = model.spec
        calibration = calibrations.for_model(model.record.name)
        self.planner = KVPlanner(d, spec.kv_bytes_per_token_fp16, spec.kv_contract, metrics, calibration, clock)
        self.remote = PrefillRemote(prefill_url, prefill_token, d, self.planner, metrics)
        self.memory = MemoryLedger(
            ConversationStore(d.max_sessions, metrics.conversations),
            self.pool,
            budget_bytes=d.kv_memory_mb << 20,
            reserve_bytes=d.memory_reserve_mb << 20,
            ingest=self.remote.ingest,
            metrics=metrics.conversations,
            working_bytes=self._working_bytes(d.working_memory_mb),
            prompt_run_bytes=functools.partial(prompt_run_bytes, spec),
        )
        kv_bytes_per_slot_token = engines[0].kv_bytes_per_slot
        metrics.resident_kv.set_function(
            lambda: sum(slot.engine.length for slot in self.pool.slots) * kv_bytes_per_slot_token
        )
        metrics.queue_depth.set_function(lambda: self.pool.queued)
        metrics.active.set_function(lambda: self.pool.busy)
        metrics.breaker_open.set_function(lambda: float(self.remote.breaker.state == "open"))

    def _working_bytes(self, working_memory_mb: int) -> int:
        """``daemon.working_memory_mb`` in bytes; 0: sized for this model, its slots and max_context (logged)."""
        if working_memory_mb:
            return working_memory_mb << 20
        spec = self.model.spec
        float32_per_token = 2 * spec.kv_bytes_per_token_fp16
        sized = sized_allowance_bytes(
            functools.partial(prompt_run_bytes, spec), len(self.pool.slots), self.max_context, float32_per_token
        )
        logger.info("daemon.working_memory_mb = 0: %d MiB of working memory", sized >> 20)
        return sized

    async def start(self) -> None:
        """Open what pulls KV (on the serving event loop)."""
        await self.remote.start()

    async def close(self) -> None:
        """Close the pulls' session, stop the worker (generations in flight are closed) and the ingest thread."""
        self.worker.stop()
        await self.remote.close()

    def healthy(self) -> bool:
        """The worker thread is alive and not stuck (what the systemd watchdog pings on)."""
        return self.worker.healthy(WORKER_STALL_SECONDS)

    @cached_property
    def grammars(self) -> GrammarCompiler:
        """The model's grammars (made on the first request that asks for one)."""
        spec = self.model.spec
        return GrammarCompiler(self.model.tokenizer, spec.vocab_size, spec.stop_token_ids)

    async def constrained(self, request: CompletionRequest) -> CompletionRequest:
        """``request`` with its output rule's grammar compiled (on a thread: a complex schema takes a
        while; a cached one is immediate); a grammar that does not compile is a 400 naming its field."""
        rule = request.output
        if rule is None or rule.grammar is None:
            return request
        try:
            grammar = await asyncio.to_thread(self.grammars.compile, rule.grammar)
        except RequestError as exc:
            raise RequestError(f"{rule.param}: {exc}", rule.param) from exc
        return dataclasses.replace(request, grammar=grammar)

    def turn(self, request: CompletionRequest, client: str, arrived: float) -> Turn:
        """A turn for ``request`` from ``client``, arrived at ``arrived`` (``time.perf_counter()``)."""
        return Turn(self, request, client, arrived)

    def lease(self, client: str, session_id: str | None) -> SlotLease:
        """A turn's hold on a slot for conversation ``session_id`` of ``client`` (``async with``)."""
        return SlotLease(self.pool, client, session_id, settle=self.memory.settle, ingest=self.remote.ingest)

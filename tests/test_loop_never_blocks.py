"""The daemon's event loop never blocks (docs/serving.md, issue 27): turns run under memory pressure,
with 32 idle conversations kept compressed that the pressure ladder re-tiers, trims and evicts, while
asyncio's debug mode times every callback the loop runs. A callback of 50 ms or more (asyncio logs
"Executing <...> took N seconds") fails the test: every KV encode and decode must run off the loop.

The real model and the real daemon pipeline (``DecodeService``, its slots, worker and ingest
thread), prefilling locally so that the run is about memory, not the network."""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
from serving_helpers import slot_kv_bytes_per_token

from edgedecode.config import load_config
from edgedecode.daemon.metrics import DaemonMetrics
from edgedecode.daemon.openai_api import CompletionRequest
from edgedecode.daemon.run import build_engines
from edgedecode.daemon.service import DecodeService
from edgedecode.runtime.sampler import SamplingParams

SLOW_CALLBACK_S = 0.05  # the threshold
IDLE = 32  # conversations kept compressed when the pressure turn comes
SLOTS = 2
CONVERSATION_TOKENS = 96
# SmolLM2 keeps ~11.5 KB of KV a token at INT8 in the store: 32 stored conversations of ~100 tokens and
# 2 resident ones fit 48 MiB; the pressure turn's 40 MiB of slot KV (900 tokens of float32, 1800 of
# float16: pressure_tokens) do not fit beside them even with every one re-tiered to INT4, then INT3, and
# trimmed to half: some are evicted.
KV_MEMORY_MB = 48
PRESSURE_MB = 40


class SlowCallbacks(logging.Handler):
    """asyncio's debug-mode warnings of callbacks that ran past ``loop.slow_callback_duration``."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Executing") and " took " in message:
            self.seen.append(message)


def prompt(seed: int, n: int) -> np.ndarray:
    """``n`` ordinary token ids (past the special tokens), distinct for each ``seed``."""
    return np.random.default_rng(seed).integers(1000, 40000, n).astype(np.int64)


def completion(prompt_ids: np.ndarray, session_id: str) -> CompletionRequest:
    return CompletionRequest("text", prompt_ids, SamplingParams(max_tokens=4), False, False, (), session_id, None)


def sample(service: DecodeService, name: str, **labels: str) -> float:
    value = service.metrics.registry.get_sample_value(name, labels)
    assert value is not None, name
    return value


def test_turns_under_memory_pressure_never_block_the_event_loop(smollm2_model):
    pressure_tokens = (PRESSURE_MB << 20) // slot_kv_bytes_per_token(smollm2_model.spec)
    config = load_config(
        None,
        env={},
        overrides={
            "daemon": {
                "slots": SLOTS,
                "max_context": 2048,
                "max_sessions": IDLE + SLOTS,
                "kv_memory_mb": KV_MEMORY_MB,
                "memory_reserve_mb": 0,
                "local_prefill_only": True,
            },
            "model": {"threads": 2},
        },
    )
    service = DecodeService(
        smollm2_model, build_engines(smollm2_model, config), config, DaemonMetrics(), lambda: None, ""
    )
    conversations = [prompt(index, CONVERSATION_TOKENS) for index in range(IDLE + SLOTS)]
    pressure = prompt(IDLE + SLOTS, pressure_tokens)
    slow = SlowCallbacks()
    asyncio_logger = logging.getLogger("asyncio")

    async def turn(prompt_ids: np.ndarray, session_id: str) -> dict:
        answered = service.turn(completion(prompt_ids, session_id), "client", time.perf_counter())
        await answered.open()
        async for _ in answered.pieces():
            pass
        return answered.report.to_json()

    async def scenario() -> tuple[float, dict]:
        await service.start()  # before the daemon serves (it loads the system's CA certificates): not a turn
        try:
            await asyncio.sleep(0)  # every callback from here on is timed
            asyncio.get_running_loop().slow_callback_duration = SLOW_CALLBACK_S
            asyncio_logger.addHandler(slow)
            for index, prompt_ids in enumerate(conversations):  # each moves the least recent one out of its slot
                await turn(prompt_ids, f"c{index}")
            stored = sample(service, "edgedecode_sessions", state="compressed")
            report = await turn(pressure, "pressure")
            return stored, report
        finally:
            asyncio_logger.removeHandler(slow)
            await service.close()

    stored, report = asyncio.run(scenario(), debug=True)
    assert stored == IDLE
    assert report["kv"]["computed_tokens"] == pressure_tokens  # the pressure turn was served
    retiered = sample(service, "edgedecode_kv_retier_total", **{"from": "INT8", "to": "INT4"})
    to_int3 = sample(service, "edgedecode_kv_retier_total", **{"from": "INT4", "to": "INT3"})
    dropped = sample(service, "edgedecode_kv_retier_total", **{"from": "INT3", "to": "DROP"})
    evicted = sample(service, "edgedecode_session_evictions_total", reason="memory")
    assert retiered > 0 and to_int3 > 0 and dropped > 0 and evicted > 0  # every rung over the stored ones ran
    assert slow.seen == []

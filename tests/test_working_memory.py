"""daemon.working_memory_mb: the working memory of turns (their prompt runs) and of the ingest thread (KV
scratch) is counted against its own allowance, and what does not fit is refused (issue 34)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from edgedecode.config import ConfigError, load_config
from edgedecode.daemon.memory.working import RESIDUE_BYTES, KVMemoryError, WorkingMemory, sized_allowance_bytes
from edgedecode.runtime.engine import PREFILL_CHUNK_TOKENS
from edgedecode.runtime.runner import prompt_run_bytes

MIB = 1 << 20


def test_turns_hold_their_prompt_runs_until_released_and_what_does_not_fit_changes_nothing():
    book = WorkingMemory(10 * MIB)
    book.hold_turn(0, 6 * MIB)
    book.hold_turn(1, 3 * MIB)
    with pytest.raises(KVMemoryError, match=r"daemon\.working_memory_mb \(10\.0 MiB, 9\.0 MiB held"):
        book.hold_turn(2, 2 * MIB)
    assert book.nbytes == 9 * MIB  # the refused turn holds nothing
    book.hold_turn(0, 7 * MIB)  # a turn's hold replaces what its slot held: 1 MiB more
    assert book.nbytes == 10 * MIB
    book.release_turn(0)
    book.release_turn(5)  # a slot that holds nothing
    book.hold_turn(2, 2 * MIB)
    assert (book.nbytes, book.peak_nbytes) == (5 * MIB, 10 * MIB)
    assert KVMemoryError.http_status == 503


def test_scratch_is_held_for_its_block_only_and_refused_beyond_the_allowance():
    book = WorkingMemory(4 * MIB)
    book.hold_turn(0, 1 * MIB)
    with book.scratch(3 * MIB, "a restore"):
        assert book.nbytes == 4 * MIB
        with (
            pytest.raises(KVMemoryError, match=r"a re-encode needs 1\.0 MiB of scratch"),
            book.scratch(1 * MIB, "a re-encode"),
        ):
            pytest.fail("a block whose scratch does not fit must not run")
    assert book.nbytes == 1 * MIB
    with pytest.raises(RuntimeError), book.scratch(2 * MIB, "a failed export"):
        raise RuntimeError("the export failed")
    assert book.nbytes == 1 * MIB  # given back when the block fails too
    unbounded = WorkingMemory(None)  # counted, never refused
    unbounded.hold_turn(0, 1 << 40)
    assert unbounded.peak_nbytes == 1 << 40


def test_a_prompt_runs_estimate_grows_with_its_rows_and_past_and_covers_the_measured_peak(smollm2_model):
    spec = smollm2_model.spec
    run = prompt_run_bytes(spec, PREFILL_CHUNK_TOKENS, 2048)
    assert prompt_run_bytes(spec, 16, 2048) < run < prompt_run_bytes(spec, PREFILL_CHUNK_TOKENS, 4096)
    # the attention probabilities alone: every head's row over the whole past, float32
    assert run >= PREFILL_CHUNK_TOKENS * spec.n_heads * 2048 * 4
    assert run >= 23 * MIB  # a 256-row run at past 2048 raised the peak RSS ~23 MiB over its KV (runner.py)


def test_the_default_allowance_holds_every_slots_largest_prompt_run_and_one_conversations_float32_kv(smollm2_model):
    from edgedecode.daemon.metrics import DaemonMetrics
    from edgedecode.daemon.run import build_engines
    from edgedecode.daemon.service import DecodeService

    spec = smollm2_model.spec
    config = load_config(None, env={}, overrides={"daemon": {"slots": 2, "max_context": 512}, "model": {"threads": 2}})
    service = DecodeService(
        smollm2_model, build_engines(smollm2_model, config), config, DaemonMetrics(), lambda: None, ""
    )
    asyncio.run(service.close())
    sized = 2 * prompt_run_bytes(spec, PREFILL_CHUNK_TOKENS, 512) + 512 * 2 * spec.kv_bytes_per_token_fp16
    assert service.memory.working.allowance_bytes == sized + RESIDUE_BYTES
    rows_times_past = sized_allowance_bytes(lambda rows, past: rows * past, 3, 100, 10)
    assert rows_times_past == 3 * 100 * 100 + 100 * 10 + RESIDUE_BYTES  # rows <= past


def test_config_working_memory_default_and_validation():
    assert load_config(None, env={}).daemon.working_memory_mb == 0  # sized at start
    assert load_config(None, env={}, overrides={"daemon": {"working_memory_mb": 64}}).daemon.working_memory_mb == 64
    with pytest.raises(ConfigError, match=r"daemon\.working_memory_mb >= 0"):
        load_config(None, env={}, overrides={"daemon": {"working_memory_mb": -1}})


def test_a_turn_whose_prompt_runs_do_not_fit_beside_another_is_a_503_and_the_other_keeps_serving(smollm2_model):
    from edgedecode.daemon.metrics import DaemonMetrics
    from edgedecode.daemon.openai_api import parse_request
    from edgedecode.daemon.run import build_engines
    from edgedecode.daemon.service import DecodeService

    def request(text: str):
        body = {"prompt": text, "temperature": 0, "max_tokens": 6}
        return parse_request(body, "text", smollm2_model, default_max_tokens=6, session_header=None)

    first, second = request("The capital of France is"), request("The largest planet of the solar system is")
    spec = smollm2_model.spec
    need = [prompt_run_bytes(spec, len(r.prompt_ids) + 6, len(r.prompt_ids) + 6) for r in (first, second)]
    allowance_mb = -(-max(need) // MIB)  # room for either turn's prompt runs, not for both
    assert sum(need) > allowance_mb * MIB
    config = load_config(
        None,
        env={},
        overrides={
            "daemon": {"slots": 2, "max_context": 256, "working_memory_mb": allowance_mb, "local_prefill_only": True},
            "model": {"threads": 2},
        },
    )
    service = DecodeService(
        smollm2_model, build_engines(smollm2_model, config), config, DaemonMetrics(), lambda: None, ""
    )

    async def text_of(turn) -> str:
        return "".join([piece.text async for piece in turn.pieces()])

    async def scenario() -> tuple[str, str, str]:
        await service.start()
        try:
            serving = service.turn(first, "a", time.perf_counter())
            await serving.open()
            assert service.memory.working.nbytes == need[0]
            with pytest.raises(KVMemoryError, match=r"daemon\.working_memory_mb"):
                await service.turn(second, "b", time.perf_counter()).open()
            served = await text_of(serving)  # the turn that fit is answered whole
            await serving.close()
            for _ in range(100):  # the refused turn's slot goes back once the ingest thread is done with it
                if not service.pool.busy:
                    break
                await asyncio.sleep(0.01)
            assert service.memory.working.nbytes == 0  # settled turns hold no working memory
            async with service.turn(second, "b", time.perf_counter()) as later:  # alone, it fits
                answered_later = await text_of(later)
            async with service.turn(first, "a", time.perf_counter()) as again:
                answered_again = await text_of(again)
            return served, answered_later, answered_again
        finally:
            await service.close()

    served, answered_later, answered_again = asyncio.run(scenario())
    assert served and answered_later
    assert served == answered_again  # greedy, a new conversation: the refusal beside it changed nothing
    assert service.memory.working.peak_nbytes <= allowance_mb * MIB


def test_an_export_for_the_store_reads_host_kv_in_place_unless_tokens_were_dropped(smollm2_model):
    from edgedecode.model.graph import GraphOptions
    from edgedecode.runtime.engine import Engine

    engine = Engine(smollm2_model, GraphOptions.for_device("decode", "cpu"), max_context=64, device="cpu", threads=2)
    engine.prefill(np.arange(100, 120, dtype=np.int64))
    copied, held = engine.export_positions()
    viewed, held_too = engine.export_positions(view=True)
    assert np.shares_memory(viewed.keys, engine.cache.host) and np.shares_memory(viewed.values, engine.cache.host)
    assert not np.shares_memory(copied.keys, engine.cache.host)
    np.testing.assert_array_equal(viewed.keys, copied.keys)
    np.testing.assert_array_equal(viewed.values, copied.values)
    np.testing.assert_array_equal(viewed.token_ids, copied.token_ids)
    np.testing.assert_array_equal(viewed.positions, copied.positions)
    assert held.all() and held_too.all()
    engine.evict(np.array([5, 6]))
    spread, held = engine.export_positions(view=True)  # tokens dropped: spread over every position, a copy
    assert not np.shares_memory(spread.keys, engine.cache.host)
    assert spread.n_tokens == 20 and not held[[5, 6]].any() and held.sum() == 18
    assert not spread.keys[:, :, [5, 6]].any()

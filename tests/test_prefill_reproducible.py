"""The prefill server's answer does not depend on its prefix cache: the same prompt (and request)
gives the same EDKV payload bytes, KV and importance whether the cache holds none, part or all of it.

Root cause of the differences this guards against: on onnxruntime's CPU provider, the attention of a
run of 1, 129, 257, ... rows computes its last row (alone in its 128-row tile) on another path that
rounds differently, so that token's KV, and everything after it, differed in the last bits from the
same prompt processed in other runs; a cache hit used to leave such runs (the token before the
observation window alone, or 257 rows where the cold path ran 256 and more). The engine never runs
such a row now (``chunk_sizes``, ``prefill.pipeline.prefill_observed``).
"""

from __future__ import annotations

import numpy as np
import pytest

from edgedecode.evaluation.texts import pydoc_corpus, token_windows
from edgedecode.kv.importance import OBSERVATION_WINDOW
from edgedecode.kv.prefix import DEFAULT_BLOCK_TOKENS
from edgedecode.prefill.pipeline import prefill_and_score
from edgedecode.prefill.prefix_cache import PrefixCache
from edgedecode.prefill.service import PrefillService
from edgedecode.runtime.engine import GQA_ROW_TILE, PREFILL_CHUNK_TOKENS, chunk_sizes

CACHE_BYTES = 256 << 20
BUDGET = 0.3  # mixed tiers: the tier map depends on every token's importance
W, BLOCK = OBSERVATION_WINDOW, DEFAULT_BLOCK_TOKENS


@pytest.fixture(scope="module")
def service(smollm2_model):
    built = PrefillService(smollm2_model, threads=2, max_prompt_tokens=2047, prefix_cache_bytes=CACHE_BYTES)
    yield built
    built.close()


@pytest.fixture(scope="module")
def texts(smollm2_model) -> list[np.ndarray]:
    """Three unrelated 900-token texts."""
    return token_windows(smollm2_model.tokenizer, pydoc_corpus(), 900, 3)


def _payload(service: PrefillService, ids: np.ndarray, **fields) -> tuple[bytes, int]:
    """(EDKV payload bytes, prompt tokens reused from the cache) of one request."""
    request = service.parse({"token_ids": [int(t) for t in ids], "budget": BUDGET, **fields})
    result = service._prefill(request)
    return b"".join(result.encoded.frames), result.reused_tokens


def _cold(service: PrefillService, ids: np.ndarray, **fields) -> bytes:
    """The payload from an empty cache (the service's cache is empty afterwards too)."""
    service.cache = PrefixCache(CACHE_BYTES)
    payload, reused = _payload(service, ids, **fields)
    service.cache = PrefixCache(CACHE_BYTES)
    assert reused == 0
    return payload


def test_runs_never_leave_a_row_alone_in_its_attention_tile():
    for n in range(1, 3 * PREFILL_CHUNK_TOKENS + 3):
        sizes = chunk_sizes(n)
        assert sum(sizes) == n and max(sizes) <= PREFILL_CHUNK_TOKENS
        assert n == 1 or all(size % GQA_ROW_TILE != 1 for size in sizes), (n, sizes)
    assert chunk_sizes(0) == [] and chunk_sizes(PREFILL_CHUNK_TOKENS + 1) == [PREFILL_CHUNK_TOKENS - 1, 2]
    assert chunk_sizes(GQA_ROW_TILE + 1) == [GQA_ROW_TILE - 1, 2]


def test_a_long_prompt_runs_in_256_row_runs():
    """The prefill's working memory follows a run's rows (docs/performance.md: 74 MiB less at the peak
    of a 2048-token prompt on the 0.5B shape than in 512-row runs)."""
    assert chunk_sizes(2047) == [256] * 7 + [255]


def test_only_a_row_alone_in_its_attention_tile_gets_other_kv(service, texts):
    """What the guarantee rests on (onnxruntime CPU): a position's KV is the same in any run of
    rows, except as the last of a run of 1, 129, 257, ... rows."""
    engine, ids = service.engine, texts[0][:300]

    def kv(sizes):
        engine.reset()
        start = 0
        for size in sizes:
            engine.sequence.stage(ids[start : start + size])
            engine.runner.run(size, False)
            start += size
        return engine.export_kv()

    whole = kv([300])
    for sizes, lone in [
        ([2, 3, 64, 17, 100, 114], []),
        ([40, 2, 2, 128, 128], []),
        ([300 - 2 * 40 - 1] + [2] * 40 + [1], [299]),
        ([40, 2, 129, 129], [170, 299]),
        ([43, 257], [299]),
    ]:
        split = kv(sizes)
        differ = np.flatnonzero(
            (split.keys != whole.keys).any(axis=(0, 1, 3)) | (split.values != whole.values).any(axis=(0, 1, 3))
        )
        first = differ[0] if len(differ) else None
        assert first == (lone[0] if lone else None), sizes  # and every position after it differs too


@pytest.mark.parametrize(
    "reused",
    [
        1,  # from the first token: runs of 256 + 256 + 55 rows where the cold path runs 256 + 256 + 56
        BLOCK,
        600 - W - 2 * PREFILL_CHUNK_TOKENS - 1,  # leaves 513 rows before the window: 256 + 255 + 2 run
        600 - W - 2 * GQA_ROW_TILE - 1,  # leaves 257 rows: 255 + 2 run
        600 - W - 1,  # ends one row before the window: two rows run, not one
        600 - W,  # ends where the window starts
        600 - W + 5,  # ends inside the window, which always runs
        599,  # the whole prompt but its last token
    ],
)
def test_kv_and_importance_do_not_depend_on_the_reused_prefix(service, texts, reused):
    engine, ids = service.engine, texts[1][:600]
    cold = prefill_and_score(engine, ids)
    warm = prefill_and_score(engine, ids, kv=cold.snapshot.slots(0, reused))
    assert 0 < engine.stats.injected_tokens <= min(reused, 600 - W)
    np.testing.assert_array_equal(warm.snapshot.keys, cold.snapshot.keys)
    np.testing.assert_array_equal(warm.snapshot.values, cold.snapshot.values)
    np.testing.assert_array_equal(warm.snapshot.positions, cold.snapshot.positions)
    np.testing.assert_array_equal(warm.importance, cold.importance)


def test_the_same_prompt_twice_gives_the_same_payload_bytes(service, texts):
    ids = texts[0][: 10 * BLOCK + 20]  # a full hit covers the token before the window and part of the window
    service.cache = PrefixCache(CACHE_BYTES)
    first, reused_first = _payload(service, ids)
    second, reused_second = _payload(service, ids)
    assert (reused_first, reused_second) == (0, len(ids) - W)
    assert second == first
    third, _ = _payload(service, ids, held_tokens=100)  # and again, for a client holding a prefix
    assert third == _cold(service, ids, held_tokens=100)


def test_a_shared_prefix_from_another_prompt_gives_the_payload_of_an_empty_cache(service, texts):
    a, other = texts[0], texts[2]
    # B shares 300 tokens (4 blocks reused) with A, then 513 rows run before its window
    b = np.concatenate([a[:300], other[: 4 * BLOCK + PREFILL_CHUNK_TOKENS + 1 + W - 300]])
    expected = _cold(service, b)
    _payload(service, a)
    got, reused = _payload(service, b)
    assert reused == 4 * BLOCK
    assert got == expected


@pytest.mark.parametrize(
    "shared, length",
    [
        (3 * BLOCK + 8, 3 * BLOCK + 1 + W),  # the hit ends one token before B's window
        (4 * BLOCK + 4, 4 * BLOCK + 14),  # the hit ends inside B's window
    ],
)
def test_a_shared_prefix_ending_at_or_in_the_window_gives_the_payload_of_an_empty_cache(service, texts, shared, length):
    a, other = texts[1], texts[2]
    b = np.concatenate([a[:shared], other[: length - shared]])
    expected = _cold(service, b)
    _payload(service, a)
    got, reused = _payload(service, b)
    assert 0 < reused <= length - W
    assert got == expected


def test_a_prefill_running_past_the_stall_limit_marks_the_server_unhealthy(service, monkeypatch):
    """The prefill server's watchdog pings only while healthy(): a request stuck in the single
    worker stops them (systemd restarts the server) instead of holding every later request."""
    import asyncio

    import edgedecode.prefill.service as module

    assert service.healthy()
    seen: list[bool] = []
    run = service._prefill
    monkeypatch.setattr(module, "PREFILL_STALL_SECONDS", 0.0)  # any running prefill counts as stuck
    monkeypatch.setattr(service, "_prefill", lambda request: seen.append(service.healthy()) or run(request))
    asyncio.run(service.prefill(service.parse({"text": "The weather today"})))
    assert seen == [False]
    assert service.healthy()  # idle again

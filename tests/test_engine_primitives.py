"""The engine's public run primitives the prefill side builds on: start, forward, run_with_queries."""

from __future__ import annotations

import numpy as np
import pytest

from edgedecode.errors import EdgeDecodeError
from edgedecode.runtime.engine import PREFILL_CHUNK_TOKENS
from edgedecode.runtime.kvcache import KVCache, KVInjectionError


def test_start_adopts_a_leading_prefix_and_the_window_pass_returns_its_queries(prefiller, logit_vectors):
    ids = logit_vectors["prose_ids"]
    n, spec = len(ids), prefiller.spec
    prefiller.prefill(ids)
    whole = prefiller.export_kv()

    prefiller.start(ids, whole, 10)
    assert (prefiller.length, prefiller.next_position) == (10, 10)
    assert (prefiller.stats.prompt_tokens, prefiller.stats.injected_tokens) == (n, 10)
    adopted = prefiller.export_kv()
    np.testing.assert_array_equal(adopted.keys, whole.keys[:, :, :10])
    np.testing.assert_array_equal(adopted.positions, np.arange(10))

    prefiller.forward(ids[10:-8])
    queries, positions = prefiller.run_with_queries(ids[-8:])
    assert queries.shape == (spec.n_layers, 8, spec.n_heads * spec.head_dim)
    np.testing.assert_array_equal(positions, np.arange(n - 8, n))
    assert prefiller.length == n and prefiller.reusable_prefix(ids) == n - 1


def test_start_and_run_with_queries_refuse_what_they_cannot_do(prefiller, decoder, logit_vectors):
    ids = logit_vectors["prose_ids"]
    prefiller.prefill(ids)
    whole = prefiller.export_kv()
    with pytest.raises(KVInjectionError, match=r"positions 0\.\.2"):
        prefiller.start(ids, whole.slots(5), 3)  # the KV does not start at position 0
    with pytest.raises(KVInjectionError, match=r"positions 0\.\.2"):
        prefiller.start(ids, None, 3)
    with pytest.raises(ValueError, match="injected"):
        prefiller.start(ids, whole, len(ids))  # the last token always runs here
    prefiller.start(ids)
    with pytest.raises(ValueError, match="one run"):
        prefiller.run_with_queries(np.zeros(PREFILL_CHUNK_TOKENS + 1, np.int64))
    with pytest.raises(EdgeDecodeError, match="emit_queries"):
        decoder.run_with_queries(ids[:4])


def test_evicting_held_tokens_keeps_the_others_in_order_and_the_conversation_going(decoder, logit_vectors):
    ids = logit_vectors["prose_ids"]
    decoder.prefill(ids)
    whole = decoder.export_kv()
    evicted = np.array([5, 9, 10, 11])
    decoder.evict(evicted)
    kept = ~np.isin(whole.positions, evicted)
    after = decoder.export_kv()
    np.testing.assert_array_equal(after.positions, whole.positions[kept])
    np.testing.assert_array_equal(after.token_ids, whole.token_ids[kept])
    np.testing.assert_array_equal(after.keys, whole.keys[:, :, kept])
    np.testing.assert_array_equal(after.values, whole.values[:, :, kept])
    assert decoder.length == len(ids) - len(evicted) and decoder.next_position == len(ids)
    assert decoder.reusable_prefix(np.append(ids, 7)) == len(ids)  # the conversation goes on from its end
    assert np.isfinite(decoder.step(7)).all() and decoder.next_position == len(ids) + 1
    with pytest.raises(KVInjectionError, match="held"):
        decoder.evict(np.array([9]))  # already gone


def test_release_unused_gives_the_pages_past_the_held_slots_back(smollm2_spec):
    psutil = pytest.importorskip("psutil")
    process = psutil.Process()
    cache = KVCache(smollm2_spec, 2048)
    s = smollm2_spec
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((s.n_layers, s.n_kv_heads, 2048, s.head_dim), np.float32)
    cache.update(0, keys, keys)
    kept = keys[:, :, :16].copy()
    del keys
    filled = process.memory_info().rss
    cache.length = 16
    cache.release_unused()
    freed = filled - process.memory_info().rss
    per_token = 2 * s.n_layers * s.n_kv_heads * s.head_dim * 4
    assert freed >= 0.9 * (2048 - 16) * per_token, (freed, per_token)
    np.testing.assert_array_equal(cache.host[:, 0, 0, :, :16], kept)  # the held rows stay
    assert not cache.host[:, :, 0, :, 16:].any()  # the rest read as zeros

"""The engine's public run primitives the prefill side builds on: start, forward, run_with_queries."""

from __future__ import annotations

import numpy as np
import pytest

from edgedecode.errors import EdgeDecodeError
from edgedecode.runtime.engine import PREFILL_CHUNK_TOKENS
from edgedecode.runtime.kvcache import KVInjectionError


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

"""Token importance from the prefill graph's observation queries, against the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

from edgedecode.kv.importance import attention_importance, position_importance


@pytest.fixture(scope="module")
def observer(smollm2_model):
    from edgedecode.model.graph import GraphOptions
    from edgedecode.runtime.engine import Engine

    return Engine(smollm2_model, GraphOptions("prefill"), max_context=256, threads=2)


def test_observed_queries_and_scores_match_the_reference(observer, smollm2_model, smollm2_reader, logit_vectors):
    from edgedecode.model.reference import reference_forward
    from edgedecode.model.weights import load_tensors
    from edgedecode.prefill.pipeline import prefill_observed

    spec = smollm2_model.spec
    ids = logit_vectors["prose_ids"]
    reference = reference_forward(spec, load_tensors(smollm2_reader, spec, dense=False), ids.tolist())
    observer.prefill(ids)
    whole = observer.export_kv()
    queries, positions = prefill_observed(observer, ids, 8)
    after = observer.export_kv()

    np.testing.assert_array_equal(positions, np.arange(len(ids) - 8, len(ids)))
    np.testing.assert_allclose(queries, reference.queries[:, -8:], atol=2e-3)
    np.testing.assert_allclose(after.keys, whole.keys, atol=1e-4)  # the window's own pass gives the same KV
    ours = attention_importance(spec, queries, positions, after.keys, after.positions)
    theirs = attention_importance(spec, reference.queries[:, -8:], positions, reference.keys, np.arange(len(ids)))
    np.testing.assert_allclose(ours, theirs, atol=1e-3)
    # Each query head's softmax row sums to one: per layer, heads × window in total.
    np.testing.assert_allclose(ours.sum(axis=1), spec.n_heads * 8, rtol=1e-4)
    # Causality: the first window query sees nothing after itself.
    first = attention_importance(spec, queries[:, :1], positions[:1], after.keys, after.positions)
    assert np.all(first[:, positions[0] + 1 :] == 0)


def test_position_prior_ranks_sinks_then_recency():
    score = position_importance(np.arange(100), sinks=4)
    order = np.argsort(-score, kind="stable")
    assert set(order[:4]) == {0, 1, 2, 3}
    assert list(order[4:8]) == [99, 98, 97, 96] and order[-1] == 4

"""Importance from the pull: the prefill side's attention travels with the KV (EDKV 1.2 ``importance``),
the decode engine keeps it per position, the conversation store carries it on, and the drop rung
ranks by it rather than by position."""

from __future__ import annotations

import numpy as np
import pytest

from edgedecode.daemon.memory.conversation import drop_order
from edgedecode.daemon.memory.store import ConversationStore
from edgedecode.evaluation.texts import pydoc_corpus, token_windows
from edgedecode.kv.importance import position_importance, relative_importance
from edgedecode.kv.tiers import Tier
from edgedecode.model.graph import GraphOptions
from edgedecode.prefill.pipeline import encode_within_budget, prefill_and_score
from edgedecode.runtime.engine import Engine
from edgedecode.runtime.sampler import SamplingParams

pytestmark = pytest.mark.model

PROMPT_TOKENS = 160
ANSWER_TOKENS = 6


@pytest.fixture(scope="module")
def pulled(smollm2_model, prefiller):
    """A decode engine that pulled a prompt's KV from the prefill pipeline (b 0.3) and answered it,
    and the prefill side's importance of that prompt."""
    prompt = token_windows(smollm2_model.tokenizer, pydoc_corpus(), PROMPT_TOKENS, 1)[0]
    scored = prefill_and_score(prefiller, prompt)
    payload = b"".join(encode_within_budget(scored, 0.3).frames)
    engine = Engine(smollm2_model, GraphOptions(), max_context=512, threads=2)
    stream = engine.open_kv_stream(prompt)
    stream.feed(payload)
    answer = list(engine.generate(prompt, SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0), kv=stream))
    return engine, prompt, relative_importance(scored.importance), len(answer)


def test_the_engine_keeps_the_pulled_importance_and_none_for_what_it_computed(pulled):
    engine, prompt, sent, answered = pulled
    given = engine.given_importance()
    n = len(prompt)
    assert len(given) == engine.next_position
    held = np.asarray(engine.held_positions)
    pulled_held = held[held < n - 1]
    assert len(pulled_held) < n - 1  # the sender dropped some tokens at b 0.3
    # every pulled token held (the last prompt token runs here) has the sender's value, as float16
    np.testing.assert_array_equal(given[pulled_held], sent[pulled_held].astype(np.float16).astype(np.float32))
    assert np.isnan(np.delete(given[: n - 1], pulled_held)).all()  # dropped by the sender: not held, none kept
    assert np.isnan(given[n - 1 :]).all() and answered > 0  # computed here: the last prompt token and the answer


def test_the_store_ranks_a_pulled_conversation_by_attention_and_a_restore_brings_it_back(pulled, smollm2_model):
    engine, prompt, _, _ = pulled
    snapshot, held = engine.export_positions()
    given = engine.given_importance()
    entry = ConversationStore(1).compress("c", snapshot, given, np.where(held, Tier.INT8, Tier.DROP))
    known = ~np.isnan(given)
    np.testing.assert_array_equal(entry.importance[known], given[known])
    assert (entry.importance[~known] == 1.0).all()  # computed here: an average token
    # the drop rung's first victims are the least attended unpinned tokens, not the oldest
    order = drop_order(entry.tiers, entry.pinned, entry.importance, room=16)
    droppable = np.flatnonzero(~entry.pinned & (entry.tiers != Tier.DROP))
    np.testing.assert_array_equal(np.sort(entry.importance[order]), np.sort(entry.importance[droppable])[:16])
    by_position = drop_order(entry.tiers, entry.pinned, position_importance(snapshot.positions), room=16)
    assert set(order.tolist()) != set(by_position.tolist())
    # a restore from the stored payload brings the importance back with the KV
    other = Engine(smollm2_model, GraphOptions(), max_context=512, threads=2)
    keep = other.restore(snapshot.token_ids, entry.payload)
    assert keep > len(prompt) - 1
    np.testing.assert_array_equal(other.given_importance()[:keep], given[:keep])

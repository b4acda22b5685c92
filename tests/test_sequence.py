"""The per-sequence context on its own (no model, no graph): what the cache's slots hold as tokens are
received, computed, kept and evicted."""

from __future__ import annotations

import numpy as np
import pytest

from edgedecode.model.spec import ModelSpec
from edgedecode.runtime.kvcache import KVCache, KVInjectionError
from edgedecode.runtime.sequence import ContextOverflowError, Sequence

PROMPT = np.arange(100, 112, dtype=np.int64)  # token id = 100 + position


def tiny_spec(**windows) -> ModelSpec:
    return ModelSpec(
        name="tiny",
        architecture="llama",
        n_layers=2,
        hidden_size=8,
        ffn_size=16,
        n_heads=1,
        n_kv_heads=1,
        head_dim=4,
        rope_theta=10000.0,
        rope_dim=4,
        norm_eps=1e-6,
        vocab_size=200,
        context_length=64,
        bos_token_id=None,
        eos_token_id=0,
        add_bos=False,
        add_space_prefix=False,
        stop_token_ids=(0,),
        chat_template=None,
        tokenizer_model="gpt2",
        tokenizer_pre="default",
        tokenizer_hash="tok",
        tied_embeddings=True,
        **windows,
    )


def sequence(max_context: int = 16, **windows) -> Sequence:
    spec = tiny_spec(**windows)
    return Sequence(KVCache(spec, max_context), spec)


def compute(seq: Sequence, token_ids: np.ndarray) -> None:
    """What a graph run does to the sequence (ModelRunner.run without the graph)."""
    start = seq.length
    seq.stage(token_ids)
    seq.advance(len(token_ids))
    seq.length = start + len(token_ids)


def test_received_dropped_tokens_take_no_slot_but_keep_their_history_and_importance():
    seq = sequence()
    positions = np.arange(6)
    kept = np.array([True, True, True, False, True, True])
    importance = np.linspace(0.5, 1.0, 6, dtype=np.float32)
    seq.receive(PROMPT, 0, positions, importance, kept=kept)
    assert seq.length == 5 and seq.next_position == 6
    np.testing.assert_array_equal(seq.held_positions, [0, 1, 2, 4, 5])
    np.testing.assert_array_equal(seq.tokens[:5], PROMPT[[0, 1, 2, 4, 5]])
    np.testing.assert_array_equal(seq.given_importance(), importance)  # the dropped position's too
    assert seq.reusable_prefix(PROMPT) == 6  # the dropped token's id is known: the prefix reaches past it


def test_computed_tokens_follow_the_last_held_position_and_come_with_no_importance():
    seq = sequence()
    seq.receive(PROMPT, 0, np.array([0, 1, 3]), np.ones(3, np.float32))  # position 2 dropped on the way
    compute(seq, PROMPT[4:6])
    compute(seq, PROMPT[6:7])  # a decode step
    np.testing.assert_array_equal(seq.held_positions, [0, 1, 3, 4, 5, 6])
    np.testing.assert_array_equal(seq.tokens[: seq.length], PROMPT[[0, 1, 3, 4, 5, 6]])
    given = seq.given_importance()
    assert len(given) == 7 and (given[[0, 1, 3]] == 1).all() and np.isnan(given[4:]).all()


def test_keep_truncates_only_to_a_prefix_that_ends_at_a_held_token():
    seq = sequence()
    seq.receive(PROMPT, 0, np.array([0, 1, 2, 4, 5]))
    edited = PROMPT.copy()
    edited[4] += 1
    assert seq.reusable_prefix(edited) == 3  # cut back to the held token before the first difference
    with pytest.raises(KVInjectionError, match="does not end at a held token"):
        seq.keep(PROMPT, 4)
    with pytest.raises(KVInjectionError, match="holds 6 of this prompt"):
        seq.keep(PROMPT, 7)
    assert seq.keep(PROMPT, 3) == 3 and seq.next_position == 3


def test_evicting_keeps_the_windowed_layers_start_on_the_same_token():
    seq = sequence(sliding_window=4, sliding_layers=(0,))
    seq.receive(PROMPT, 0, np.arange(10), window_from=6)
    assert seq.windowed_from == 6
    seq.evict(np.array([1, 2, 8]))
    assert seq.window_from == 4 and seq.windowed_from == 6
    np.testing.assert_array_equal(seq.held_positions, [0, 3, 4, 5, 6, 7, 9])
    with pytest.raises(KVInjectionError, match="held"):
        seq.evict(np.array([2]))  # already gone


def test_a_token_whose_window_reaches_before_the_windowed_kv_cannot_run():
    seq = sequence(sliding_window=4, sliding_layers=(0,))
    seq.receive(PROMPT, 0, np.arange(10), window_from=8)
    with pytest.raises(KVInjectionError, match="windowed layers hold KV from slot 8"):
        seq.check_window()  # the token at slot 10 attends to slots 7..10
    assert seq.reusable_prefix(PROMPT) == 0
    seq.receive(PROMPT, 0, np.arange(10), window_from=7)
    seq.check_window()


def test_staging_past_the_context_is_refused_before_anything_is_written():
    seq = sequence(max_context=8)
    compute(seq, PROMPT[:6])
    with pytest.raises(ContextOverflowError, match="9 tokens exceed the context of 8"):
        seq.stage(PROMPT[6:9])
    assert seq.length == 6 and not seq.tokens[6:].any()

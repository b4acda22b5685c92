"""Windowed KV end to end on a tiny Gemma 3 (window 5, layers 0-4 windowed): the prefill policy keeps the
prompt's tail whole, the windowed layers travel for the tail only, and a decoder given that stream answers
exactly as one given every cell; where a cut stream cannot be continued, the engine computes the prompt."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from synthetic_gguf import TinyLlama, write_tiny_llama

from edgedecode.daemon.memory.conversation import store_pins
from edgedecode.daemon.memory.ledger import MemoryLedger
from edgedecode.daemon.memory.store import ConversationStore
from edgedecode.daemon.slots import SlotPool
from edgedecode.evaluation.scoring import score_continuation
from edgedecode.kv.tiers import Tier
from edgedecode.kv.window import tail_tokens, window_start
from edgedecode.kv.wire import EDKVReader
from edgedecode.model.fetch import register_gguf
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import load_model
from edgedecode.prefill.pipeline import encode_within_budget, prefill_and_score, served_payload, through_wire
from edgedecode.runtime.engine import Engine
from edgedecode.runtime.sampler import SamplingParams

TYPES = {name: QType.Q4_0 for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
TYPES |= {"token_embd": QType.Q8_0, "output": QType.Q8_0}
CONTEXT = 256
PROMPT = np.random.default_rng(5).integers(0, 95, 200)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EDGEDECODE_HOME", str(tmp_path_factory.mktemp("home")))
        dims = TinyLlama(key_length=128, kv_heads=1, layers=6)
        path = write_tiny_llama(
            tmp_path_factory.mktemp("gguf") / "g.gguf", TYPES, dims, seed=4, tied=True, arch="gemma3"
        )
        model = load_model(register_gguf(path, "tiny-gemma3").name)
        prefiller = Engine(model, GraphOptions("prefill", "float32", 0), max_context=CONTEXT, threads=2)
        yield model, prefill_and_score(prefiller, PROMPT)


def decoder(model) -> Engine:
    """A fresh decode engine: its buffers start as zeros, unlike those of one that held this prompt before."""
    return Engine(model, GraphOptions("decode", "float32", 0), max_context=CONTEXT, threads=2)


def answer(engine: Engine, frames: list[bytes], cut_after: int | None = None) -> tuple[list[int], np.ndarray, int]:
    """Stream ``frames`` (all, or the first ``cut_after`` then a cut) into ``engine``; greedy tokens, the
    first token's logits and how many tokens' KV the engine took from the stream."""
    stream = engine.open_kv_stream(PROMPT)
    for frame in frames[:cut_after]:
        stream.feed(frame)
    if cut_after is not None:
        stream.cut()
    logits = engine.prefill(PROMPT, kv=stream).copy()
    injected = engine.stats.injected_tokens
    return greedy(engine), logits, injected


def greedy(engine: Engine) -> list[int]:
    """Six greedy tokens after the prompt the engine holds (its last token run again)."""
    return list(engine.generate(PROMPT, SamplingParams(max_tokens=6, stop_token_ids=()), keep=len(PROMPT) - 1))


def test_the_policy_keeps_the_tail_whole_and_spends_what_the_window_saves(gemma):
    model, scored = gemma
    contract, n = model.spec.kv_contract, len(PROMPT)
    tail = tail_tokens(contract)
    assert tail == 5 + 64 and n > tail
    plain = encode_within_budget(scored, 0.15)
    windowed = encode_within_budget(scored, 0.15, windowed=True)
    for encoded in (plain, windowed):
        assert (encoded.tiers[:-tail] == Tier.DROP).any() and not (encoded.tiers[-tail:] == Tier.DROP).any()
        assert encoded.b_wire <= 0.15
    # before the tail a token costs 1/6 of its bytes (one global layer of six): fewer dropped, more kept high
    assert np.count_nonzero(windowed.tiers == Tier.DROP) < np.count_nonzero(plain.tiers == Tier.DROP)
    header = EDKVReader(contract, max_tokens=CONTEXT, target_factory=lambda h: np.zeros((6, 2, 1, n, 128), np.float32))
    header.feed(b"".join(windowed.frames))
    assert header.finish().window.start == n - tail


def test_a_windowed_stream_decodes_exactly_as_the_full_one(gemma):
    model, scored = gemma
    # drops before the tail; INT8 (per-token groups) elsewhere: INT4 keys share scales across the tokens of a
    # section, so a windowed layer's tail-only section quantizes them differently (not worse) than a full one
    dropped = encode_within_budget(scored, 0.3).tiers == Tier.DROP
    tiers = np.where(dropped, Tier.DROP, Tier.INT8).astype(np.uint8)
    start = window_start(tiers != Tier.DROP, tail_tokens(model.spec.kv_contract))
    full = list(served_payload(scored.snapshot, tiers, {}, np.ones(len(PROMPT))))
    cut = list(served_payload(scored.snapshot, tiers, {}, np.ones(len(PROMPT)), window_start=start))
    kept_before = np.count_nonzero(tiers[:start] != Tier.DROP)
    cells = (kept_before / 6 + len(PROMPT) - start) / (kept_before + len(PROMPT) - start)  # 5 of 6 layers: tail only
    assert sum(map(len, cut)) < (cells + 0.05) * sum(map(len, full))
    engine = decoder(model)
    tokens, logits, injected = answer(engine, cut)
    assert engine.windowed_from == start and injected == np.count_nonzero(tiers[:-1] != Tier.DROP)
    expected_tokens, expected_logits, _ = answer(decoder(model), full)
    np.testing.assert_array_equal(logits, expected_logits)
    assert tokens == expected_tokens


def test_a_stream_cut_before_its_window_is_computed_here_and_answers_as_a_local_prefill(gemma, caplog):
    model, scored = gemma
    encoded = encode_within_budget(scored, 1.0, windowed=True)  # chunks of 128 tokens; the window from 131
    engine = decoder(model)
    with caplog.at_level(logging.WARNING, logger="edgedecode.runtime.engine"):
        tokens, logits, injected = answer(engine, encoded.frames, cut_after=2)  # the header and tokens 0..127
    assert "computing them here" in caplog.text and injected == 0
    local = decoder(model)
    expected_logits = local.prefill(PROMPT).copy()
    np.testing.assert_array_equal(logits, expected_logits)
    assert tokens == greedy(local)


def test_a_prompt_that_leaves_the_window_reuses_nothing_of_a_windowed_pull(gemma):
    model, scored = gemma
    engine = decoder(model)
    answer(engine, encode_within_budget(scored, 1.0, windowed=True).frames)
    assert engine.reusable_prefix(np.concatenate([PROMPT, [1, 2]])) == len(PROMPT)
    edited = PROMPT.copy()
    edited[100] = (edited[100] + 1) % 95  # before the window's start: the windowed layers hold no KV there
    assert engine.reusable_prefix(edited) == 0


def test_the_store_keeps_a_windowed_conversations_tail_and_never_claims_cells_it_was_not_given(gemma):
    model, scored = gemma
    contract, n = model.spec.kv_contract, len(PROMPT)
    store = ConversationStore(max_sessions=4)
    store.add(store.compress("a", scored.snapshot, window_from=150))
    entry = store.peek("a")
    assert entry is not None and entry.window_from == 150
    reader = EDKVReader(contract, max_tokens=CONTEXT, target_factory=lambda h: np.zeros((6, 2, 1, n, 128), np.float32))
    reader.feed(entry.payload)
    assert reader.finish().window.start == 150  # later than the tail's start, n - 69
    restored, whole = decoder(model), decoder(model)
    store.add(store.compress("whole", scored.snapshot))  # windowed from the tail's start (131) on
    logits = []
    for engine, session in ((restored, "a"), (whole, "whole")):
        keep = engine.restore(PROMPT, store.peek(session).payload)
        assert keep == len(PROMPT) - 1
        logits.append(engine.prefill(PROMPT, keep=keep).copy())
    assert restored.windowed_from == 150 and whole.windowed_from == n - tail_tokens(contract)
    np.testing.assert_array_equal(logits[0], logits[1])  # INT8 rows are per token: the tail is the same
    edited = PROMPT.copy()
    edited[100] = (edited[100] + 1) % 95  # before the window: the restored prefix holds no windowed KV to go on
    assert whole.restore(edited, store.peek("whole").payload) == 0 and whole.windowed_from == whole.next_position
    retiered = np.where(store_pins(scored.snapshot.positions), Tier.INT8, Tier.INT4).astype(np.uint8)
    store.add(store.compress("b", scored.snapshot, tiers=retiered))  # what the ladder's first rung leaves
    entry = store.peek("b")
    assert entry is not None
    # below that: the drop rung (tokens before the tail carry one layer of six, so it frees little)
    small = ConversationStore(max_sessions=4)
    MemoryLedger(small, SlotPool([], 1), budget_bytes=entry.nbytes * 92 // 100).put("b", scored.snapshot)
    dropped = small.peek("b")
    assert dropped is not None and (dropped.tiers == Tier.DROP).any()
    assert not (dropped.tiers[-tail_tokens(contract) :] == Tier.DROP).any()


def test_a_windowed_snapshot_through_the_wire_scores_as_the_full_one(gemma):
    """``through_wire(windowed=True)`` (what the quality harness scores): the windowed layers' cells
    before the window arrive as zeros, which no sliding layer attends to, so a continuation scores
    exactly as from the whole stream at the same tiers (every token FP16 at b 1.0)."""
    model, scored = gemma
    contract = model.spec.kv_contract
    continuation = np.random.default_rng(6).integers(0, 95, 12)
    scores, sizes = [], []
    for windowed in (False, True):
        kv, encoded = through_wire(scored, 1.0, "ours", contract, windowed=windowed)
        assert (encoded.tiers == Tier.FP16).all()
        scores.append(score_continuation(decoder(model), PROMPT, continuation, kv))
        sizes.append(sum(len(frame) for frame in encoded.frames))
    assert sizes[1] < 0.8 * sizes[0]  # the windowed layers' cells before the tail were not sent
    np.testing.assert_array_equal(scores[0].log_probs, scores[1].log_probs)

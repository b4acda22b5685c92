"""The KV handoff through EDKV on the real model: prefill side scoring and budgets, streamed ingest
into the decoder's buffers, and bad payloads that leave the decoder serving."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edgedecode.kv.policy import POLICIES
from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire import (
    KVChecksumError,
    KVTruncatedError,
    decode_snapshot,
    encode_payload,
)
from edgedecode.prefill.pipeline import (
    PAYLOAD_CHUNK_TOKENS,
    BudgetTooSmallError,
    encode_within_budget,
    payload_meta,
    prefill_and_score,
    smallest_payload,
)
from edgedecode.runtime.kvcache import KVInjectionError
from edgedecode.runtime.sampler import SamplingParams

GREEDY_8 = SamplingParams(max_tokens=8, stop_token_ids=())


@pytest.fixture(scope="module")
def scorer(smollm2_model):
    from edgedecode.model.graph import GraphOptions
    from edgedecode.runtime.engine import Engine

    return Engine(smollm2_model, GraphOptions("prefill"), max_context=1024, threads=2)


@pytest.fixture(scope="module")
def long_prompt(smollm2_model):
    from pydoc_data.topics import topics

    return np.asarray(smollm2_model.tokenizer.encode(topics["specialnames"], parse_special=False)[:600], np.int64)


@pytest.fixture(scope="module")
def scored(scorer, long_prompt):
    return prefill_and_score(scorer, long_prompt)


def _stream(engine, prompt, payload: bytes, piece: int = 7777):
    reader = engine.open_kv_stream(prompt)
    for start in range(0, len(payload), piece):
        reader.feed(payload[start : start + piece])
    return engine.prefill(prompt, reader)


@pytest.mark.parametrize("budget", [0.5, 0.3, 0.15])
def test_every_policy_fits_the_wire_budget(scored, budget):
    for policy in POLICIES:
        encoded = encode_within_budget(scored, budget, policy)
        assert encoded.b_wire <= budget, policy
        assert encoded.b_wire < encoded.b_raw + 0.01  # zstd never inflates the payload noticeably
    ours = encode_within_budget(scored, budget)
    assert ours.b_wire > 0.9 * budget  # the refit uses the budget, not just the raw estimate
    all_int4 = len(b"".join(encode_payload(scored.snapshot, np.full(scored.snapshot.n_tokens, Tier.INT4, np.uint8))))
    assert (ours.tier_counts()["DROP"] > 0) == (all_int4 > budget * ours.fp16_bytes)  # DROP only when required


@pytest.mark.parametrize("policy", POLICIES)
def test_a_budget_below_the_smallest_payload_is_refused_naming_it_and_the_floor_is_served(scored, policy):
    """Header and framing alone (every token dropped) set the smallest payload; a budget below it is
    a BudgetTooSmallError naming that b at once (it used to loop forever), and that b is served."""
    smallest = smallest_payload(scored.snapshot, payload_meta(policy, 1e-6)).b_wire
    named = math.ceil(smallest * 1e4) / 1e4  # rounded up: asking for what the message names is enough
    with pytest.raises(BudgetTooSmallError, match=f"ask for at least {named:.4f}") as refused:
        encode_within_budget(scored, 1e-6, policy)
    assert refused.value.minimum > 1e-6
    floor = encode_within_budget(scored, smallest * 1.01, policy)
    assert floor.b_wire <= smallest * 1.01 and floor.tier_counts()["DROP"] > 0


def test_streamed_ingest_equals_snapshot_injection_and_fp16_is_lossless(
    exact_decoder, scored, long_prompt, smollm2_model
):
    contract = smollm2_model.spec.kv_contract
    payload = b"".join(encode_within_budget(scored, 1.0).frames)
    received = decode_snapshot(payload, contract)
    np.testing.assert_array_equal(received.keys, scored.snapshot.keys.astype(np.float16).astype(np.float32))
    via_snapshot = exact_decoder.prefill(long_prompt, kv=received).copy()
    via_stream = _stream(exact_decoder, long_prompt, payload)
    np.testing.assert_array_equal(via_stream, via_snapshot)
    assert exact_decoder.stats.injected_tokens == len(long_prompt) - 1
    reader = exact_decoder.open_kv_stream(long_prompt)
    reader.feed(payload)
    streamed_tokens = list(exact_decoder.generate(long_prompt, GREEDY_8, kv=reader))
    assert streamed_tokens == list(exact_decoder.generate(long_prompt, GREEDY_8, kv=received))


def test_dropped_tokens_arrive_compacted_with_their_positions(exact_decoder, scored, long_prompt):
    encoded = encode_within_budget(scored, 0.15)
    kept = encoded.tiers != Tier.DROP
    logits = _stream(exact_decoder, long_prompt, b"".join(encoded.frames), piece=1 << 20)
    last_kept = int(np.flatnonzero(kept)[-1])
    assert exact_decoder.next_position == len(long_prompt)
    assert exact_decoder.length == int(kept[: len(long_prompt) - 1].sum()) + (
        len(long_prompt) - min(last_kept + 1, len(long_prompt) - 1)
    )
    assert np.isfinite(logits).all()


def test_a_payload_for_another_prompt_is_refused_before_any_write(exact_decoder, scored, long_prompt):
    payload = b"".join(encode_within_budget(scored, 0.3).frames)
    other = long_prompt.copy()
    other[5] += 1
    exact_decoder.cache.host[:] = np.nan
    with pytest.raises(KVInjectionError, match="prompt's tokens"):
        _stream(exact_decoder, other, payload)
    assert np.isnan(exact_decoder.cache.host).all()
    exact_decoder.prefill(long_prompt[:50])  # the engine serves the next request
    assert exact_decoder.length == 50


def test_a_corrupt_or_cut_stream_fails_typed_and_the_engine_keeps_serving(decoder, scored, long_prompt):
    payload = bytearray(b"".join(encode_within_budget(scored, 0.3).frames))
    payload[len(payload) // 2] ^= 0xFF
    with pytest.raises(KVChecksumError):
        _stream(decoder, long_prompt, bytes(payload))
    with pytest.raises(KVTruncatedError):
        _stream(decoder, long_prompt, b"".join(encode_within_budget(scored, 0.3).frames)[:-40])
    reference = decoder.prefill(long_prompt).copy()
    assert decoder.length == len(long_prompt) and np.isfinite(reference).all()


# --- conversations: keeping the KV of an earlier turn ---------------------------------------------


def test_a_next_turn_keeps_the_held_prefix_and_matches_a_fresh_prefill(exact_decoder, long_prompt):
    first = long_prompt[:200]
    generated = list(exact_decoder.generate(first, GREEDY_8))
    extra = long_prompt[300:340]
    second = np.concatenate([first, generated, extra])
    keep = exact_decoder.reusable_prefix(second)
    assert keep == len(first) + len(generated) - 1  # the last generated token never ran
    kept_logits = exact_decoder.prefill(second, keep=keep).copy()
    assert exact_decoder.stats.reused_tokens == keep
    fresh_logits = exact_decoder.prefill(second)
    np.testing.assert_allclose(kept_logits, fresh_logits, atol=2e-3)
    diverged = second.copy()
    diverged[150] = (diverged[150] + 1) % 1000
    assert exact_decoder.reusable_prefix(diverged) == 150
    with pytest.raises(KVInjectionError, match="cannot keep"):
        exact_decoder.prefill(diverged, keep=151)


def test_a_streamed_suffix_lands_after_the_kept_prefix(exact_decoder, scorer, long_prompt):
    first, second = long_prompt[:300], long_prompt[:420]
    exact_decoder.prefill(first)
    keep = exact_decoder.reusable_prefix(second)
    assert keep == len(first)  # prefill runs every prompt token
    full = prefill_and_score(scorer, second)
    suffix = b"".join(encode_within_budget(full.from_position(keep), 1.0).frames)
    kept_logits = _stream_after(exact_decoder, second, suffix, keep).copy()
    assert exact_decoder.stats.reused_tokens == keep and exact_decoder.stats.injected_tokens == len(second) - 1 - keep
    whole = b"".join(encode_within_budget(full, 1.0).frames)
    # The kept prefix's KV came from the INT4 graph, the whole payload's from the fp32 prefill graph:
    # they differ by ~3e-3 in the logits; a suffix in the wrong slots would differ by whole units.
    whole_logits = _stream(exact_decoder, second, whole)
    np.testing.assert_allclose(kept_logits, whole_logits, atol=2e-2)
    assert kept_logits.argmax() == whole_logits.argmax()
    exact_decoder.prefill(first)
    with pytest.raises(KVInjectionError, match="inside the 300 positions"):
        _stream_after(exact_decoder, second, whole, keep)  # KV of positions the decoder keeps is refused


def _stream_after(engine, prompt, payload: bytes, keep: int):
    reader = engine.open_kv_stream(prompt, keep)
    reader.feed(payload)
    return engine.prefill(prompt, reader)


def test_engines_sharing_a_session_keep_separate_kv(smollm2_model, exact_decoder, long_prompt):
    from edgedecode.runtime.engine import Engine

    sibling = Engine(smollm2_model, exact_decoder.options, max_context=1024, threads=2, share=exact_decoder)
    assert sibling.session is exact_decoder.session
    a = exact_decoder.prefill(long_prompt[:50]).copy()
    b = sibling.prefill(long_prompt[100:180]).copy()
    np.testing.assert_allclose(sibling.prefill(long_prompt[:50]), a, atol=1e-4)
    np.testing.assert_allclose(exact_decoder.prefill(long_prompt[100:180]), b, atol=1e-4)


def _chunk_end(payload: bytes, chunks: int) -> int:
    """Bytes of ``payload`` up to the end of its first ``chunks`` chunk frames."""
    from edgedecode.kv.wire.frames import CHUNK_PREFIX, HEADER_CRC, HEADER_PREFIX

    _, _, _, length = HEADER_PREFIX.unpack_from(payload)
    pos = HEADER_PREFIX.size + length + HEADER_CRC.size
    for _ in range(chunks):
        _, _, size, _ = CHUNK_PREFIX.unpack_from(payload, pos)
        pos += CHUNK_PREFIX.size + size
    return pos


def test_a_cut_stream_keeps_its_verified_tokens_and_the_rest_is_computed_here(exact_decoder, scored, long_prompt):
    payload = b"".join(encode_within_budget(scored, 1.0).frames)
    whole_logits = _stream(exact_decoder, long_prompt, payload).copy()
    stream = exact_decoder.open_kv_stream(long_prompt)
    stream.feed(payload[: _chunk_end(payload, 4) + 1000])  # four chunks of 128 tokens, and part of the fifth
    assert stream.cut() == 4 * PAYLOAD_CHUNK_TOKENS == 512
    logits = exact_decoder.prefill(long_prompt, stream)
    assert exact_decoder.stats.injected_tokens == 512  # the other 88 positions ran through the decoder here
    assert exact_decoder.next_position == len(long_prompt)
    # KV of the last 88 positions from the INT4 graph instead of the fp32 prefill graph: ~1e-2 in the logits
    np.testing.assert_allclose(logits, whole_logits, atol=5e-2)
    assert logits.argmax() == whole_logits.argmax()


def test_a_resumed_segment_completes_a_cut_stream_exactly(exact_decoder, scored, long_prompt):
    payload = b"".join(encode_within_budget(scored, 1.0).frames)
    whole_logits = _stream(exact_decoder, long_prompt, payload).copy()
    stream = exact_decoder.open_kv_stream(long_prompt)
    stream.feed(payload[: _chunk_end(payload, 2) + 5])
    covered = stream.cut()
    assert covered == 2 * PAYLOAD_CHUNK_TOKENS == 256
    stream.resume()
    rest = b"".join(encode_within_budget(scored.from_position(covered), 1.0).frames)
    for start in range(0, len(rest), 5000):
        stream.feed(rest[start : start + 5000])
    logits = exact_decoder.prefill(long_prompt, stream)
    assert exact_decoder.stats.injected_tokens == len(long_prompt) - 1
    assert [segment.tokens for segment in stream.segments] == [256, len(long_prompt) - 256]
    np.testing.assert_array_equal(logits, whole_logits)  # FP16 either way: the same KV in the same slots


def test_a_resumed_segment_must_start_after_what_is_covered(exact_decoder, scored, long_prompt):
    payload = b"".join(encode_within_budget(scored, 1.0).frames)
    stream = exact_decoder.open_kv_stream(long_prompt)
    stream.feed(payload[: _chunk_end(payload, 2)])
    stream.cut()
    stream.resume()
    with pytest.raises(KVInjectionError, match="inside the 256 positions"):
        stream.feed(payload)  # the whole payload again: its first 256 positions are covered
    assert stream.cut() == 256  # nothing of the refused segment counts
    exact_decoder.prefill(long_prompt, stream)
    assert exact_decoder.stats.injected_tokens == 256


def test_a_conversation_kept_compressed_is_restored_and_answers_as_if_it_had_stayed(exact_decoder, scored, long_prompt):
    """KV exported over every position (dropped ones marked), kept at INT8 in one payload, restored for
    the next turn's prompt: the turn keeps everything but the last prompt token and its greedy answer
    equals that of the engine that kept its KV in place (INT8 per-token KV is lossless here)."""
    from edgedecode.daemon.memory.store import ConversationStore

    encoded = encode_within_budget(scored, 0.3)  # some tokens dropped: positions with no KV
    _stream(exact_decoder, long_prompt, b"".join(encoded.frames))
    first_answer = list(exact_decoder.generate(long_prompt, GREEDY_8, keep=exact_decoder.reusable_prefix(long_prompt)))
    follow_up = np.concatenate([long_prompt, first_answer, long_prompt[:20]])
    snapshot, held = exact_decoder.export_positions()
    assert len(held) == exact_decoder.next_position and held.sum() == exact_decoder.length < len(held)
    stayed_keep = exact_decoder.reusable_prefix(follow_up)
    stayed = list(exact_decoder.generate(follow_up, GREEDY_8, keep=stayed_keep))

    store = ConversationStore(4)
    store.add(store.compress("a", snapshot, tiers=np.where(held, Tier.INT8, Tier.DROP).astype(np.uint8)))
    entry = store.take("a")
    assert entry is not None and len(entry.payload) < 0.3 * (snapshot.keys.nbytes + snapshot.values.nbytes)  # INT8
    exact_decoder.prefill(long_prompt[:30])  # the slot served another conversation meanwhile
    keep = exact_decoder.restore(follow_up, entry.payload)
    assert keep == stayed_keep
    restored = list(exact_decoder.generate(follow_up, GREEDY_8, keep=keep))
    assert exact_decoder.stats.reused_tokens == keep
    assert restored == stayed


def test_a_restored_conversation_keeps_only_what_matches_the_new_prompt(exact_decoder, long_prompt):
    exact_decoder.prefill(long_prompt[:200])
    snapshot, held = exact_decoder.export_positions()
    from edgedecode.kv.wire import encode_payload as encode

    payload = b"".join(encode(snapshot, np.where(held, Tier.INT8, Tier.DROP).astype(np.uint8)))
    edited = long_prompt[:300].copy()
    edited[120] += 1  # the client changed its history at position 120
    assert exact_decoder.restore(edited, payload) == 120
    assert exact_decoder.length == 120 and exact_decoder.next_position == 120


def test_a_split_head_computed_here_meets_the_tail_pulled_meanwhile(exact_decoder, scored, long_prompt):
    """The engine runs the head while the tail's payload is fed (the daemon does both at once); the
    prompt's KV is then the head's own and the tail's pulled: close to a whole pull's, and the same
    next token."""
    whole = _stream(exact_decoder, long_prompt, b"".join(encode_within_budget(scored, 1.0).frames)).copy()
    head = 250
    stream = exact_decoder.open_kv_stream(long_prompt, 0, head=head)
    tail = b"".join(encode_within_budget(scored.from_position(head), 1.0).frames)
    stream.feed(tail[: len(tail) // 2])  # part of the tail arrives before the head is computed
    exact_decoder.compute_head(stream)
    stream.feed(tail[len(tail) // 2 :])
    logits = exact_decoder.prefill(long_prompt, stream)
    stats = exact_decoder.stats
    assert (stats.reused_tokens, stats.computed_tokens) == (0, head + 1)
    assert stats.injected_tokens == len(long_prompt) - head - 1
    np.testing.assert_allclose(logits, whole, atol=5e-2)  # the head's KV from the INT4 graph, not the fp32 one
    assert logits.argmax() == whole.argmax()
    with pytest.raises(ValueError, match="head must be"):
        exact_decoder.open_kv_stream(long_prompt, 0, head=len(long_prompt))

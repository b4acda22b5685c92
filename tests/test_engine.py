"""The engine on the real model: generation, KV export and injection, and its errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from greedy_helpers import TOP, first_divergence, step_margin

from edgedecode.model.registry import UnknownModelError
from edgedecode.model.spec import KVLayout
from edgedecode.runtime.engine import ContextOverflowError
from edgedecode.runtime.kvcache import KVInjectionError
from edgedecode.runtime.sampler import SamplingParams

GREEDY_32 = SamplingParams(max_tokens=32)
EXACT_NEAR_TIE = 0.01  # float32 summation-order noise of one logit in exact arithmetic


@pytest.mark.parametrize("prompt", ("prose", "code", "chat"))
def test_handoff_from_prefill_graph_matches_local_prefill(prompt, exact_decoder, prefiller, logit_vectors):
    """KV from the fp32 prefill graph, injected into the INT4 decoder, gives the same greedy tokens as
    the INT4 decoder prefilling itself, except past a near-tie (top-2 logit margin < EXACT_NEAR_TIE).

    The decoder computes in exact float arithmetic (accuracy level 0), where both KV sources are the same
    product of the same weights: the shipped level (int8 activations) moves logits by 0.2 on average and up
    to ~2 against exact arithmetic (SmolLM2, either kernel form), so there a divergence's margin says how that
    noise fell, not whether the KV arrived right. Each margin is read from the step that chose the token."""
    ids = logit_vectors[f"{prompt}_ids"]
    local = list(exact_decoder.generate_scored(ids, GREEDY_32, top=TOP))
    prefiller.prefill(ids)
    kv = prefiller.export_kv()
    handed = list(exact_decoder.generate_scored(ids, GREEDY_32, kv=kv, top=TOP))
    assert exact_decoder.stats.injected_tokens == len(ids) - 1
    split = first_divergence([s.token for s in local], [s.token for s in handed])
    if split is None:
        assert [s.token for s in local] == [s.token for s in handed]
        return
    local_margin = step_margin(local[split], handed[split].token)
    handed_margin = step_margin(handed[split], local[split].token)
    print(
        f"{prompt}: diverge at token {split}: local picks {local[split].token} by {local_margin:.3f}, "
        f"handoff picks {handed[split].token} by {handed_margin:.3f}"
    )
    assert 0 <= local_margin < EXACT_NEAR_TIE and 0 <= handed_margin < EXACT_NEAR_TIE


def test_greedy_generation_is_deterministic_and_stops_at_eos(decoder, smollm2_model):
    tok = smollm2_model.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "Say hello in one word."}])
    first = list(decoder.generate(ids, SamplingParams(max_tokens=64)))
    assert first == list(decoder.generate(ids, SamplingParams(max_tokens=64)))
    assert decoder.stats.finish_reason == "stop"
    assert 0 < len(first) < 64 and all(t not in smollm2_model.spec.stop_token_ids for t in first)


def test_seeded_sampling_reproduces_and_seeds_differ(decoder, logit_vectors):
    ids = logit_vectors["prose_ids"]
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=7)
    a = list(decoder.generate(ids, params))
    assert a == list(decoder.generate(ids, params))
    assert a != list(decoder.generate(ids, dataclasses.replace(params, seed=8)))


def test_exported_kv_round_trips_into_the_same_graph(exact_decoder, logit_vectors):
    """Exact arithmetic (acc0) so that running the last token alone computes what the full pass did;
    at acc4 MatMulNBits' int8 activation path differs between one row and many."""
    ids = logit_vectors["code_ids"]
    reference = exact_decoder.prefill(ids).copy()
    kv = exact_decoder.export_kv()
    assert kv.keys.shape == (30, 3, len(ids), 64) and kv.contract.layout.keys_post_rope
    np.testing.assert_allclose(exact_decoder.prefill(ids, kv=kv), reference, atol=1e-3)


def test_dropped_tokens_compact_with_true_positions(exact_decoder, smollm2_model, smollm2_reader, logit_vectors):
    """KV with some tokens dropped is stored compacted; the tokens run after it keep their true
    positions, so the result is the reference forward pass with the dropped keys hidden from them."""
    from edgedecode.kv.snapshot import KVProducer, KVSnapshot
    from edgedecode.model.reference import reference_forward
    from edgedecode.model.weights import load_tensors

    spec = smollm2_model.spec
    ids = logit_vectors["prose_ids"]
    resume = len(ids) - 5
    dropped = np.array([3, 7, 8, resume - 2])
    blocked = np.zeros((len(ids), len(ids)), bool)
    blocked[resume:, dropped] = True
    tensors = load_tensors(smollm2_reader, spec, dense=False)
    reference = reference_forward(spec, tensors, ids.tolist(), blocked=blocked)
    kept = np.setdiff1d(np.arange(resume), dropped)
    kv = KVSnapshot(
        spec.kv_contract,
        ids[kept],
        kept,
        reference.keys[:, :, kept],
        reference.values[:, :, kept],
        KVProducer("numpy-reference", "-", "float32"),
    )

    logits = exact_decoder.prefill(ids, kv=kv)

    assert exact_decoder.length == len(kept) + 5 and exact_decoder.next_position == len(ids)
    np.testing.assert_allclose(logits, reference.logits[-1], atol=1e-3)
    unblocked = reference_forward(spec, tensors, ids.tolist()).logits[-1]
    assert np.abs(unblocked - reference.logits[-1]).max() > 0.05  # the drop is visible: the check can fail


def test_unknown_model_is_a_clear_error():
    from edgedecode.model.loader import load_model

    with pytest.raises(UnknownModelError, match="no-such-model"):
        load_model("no-such-model")


def test_prompt_longer_than_context_is_refused(decoder):
    with pytest.raises(ContextOverflowError, match="2048"):
        decoder.prefill(np.full(decoder.max_context, 42))
    with pytest.raises(ContextOverflowError, match="empty"):
        decoder.prefill(np.array([], np.int64))


@pytest.fixture(scope="module")
def chat_kv(prefiller, logit_vectors):
    prefiller.prefill(logit_vectors["chat_ids"])
    return prefiller.export_kv()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda kv: dataclasses.replace(kv, keys=kv.keys[:, :2]), "keys have shape"),
        (lambda kv: dataclasses.replace(kv, values=kv.values[:-1]), "values have shape"),
        (
            lambda kv: dataclasses.replace(
                kv, contract=dataclasses.replace(kv.contract, layout=KVLayout(rope_order="interleaved"))
            ),
            "layout",
        ),
        (lambda kv: dataclasses.replace(kv, contract=dataclasses.replace(kv.contract, n_layers=24)), "n_layers"),
        (
            lambda kv: dataclasses.replace(kv, contract=dataclasses.replace(kv.contract, tokenizer_hash="0" * 64)),
            "tokenizer_hash",
        ),
        (lambda kv: dataclasses.replace(kv, positions=kv.positions + 3), "positions"),
        (lambda kv: dataclasses.replace(kv, token_ids=kv.token_ids[::-1].copy()), "prompt's tokens"),
        (lambda kv: dataclasses.replace(kv, positions=kv.positions[::-1].copy()), "strictly increasing"),
        # np.diff wraps: [..., 5, -2**63] looked increasing, and indexing the prompt raised IndexError
        (lambda kv: dataclasses.replace(kv, positions=np.append(kv.positions[:-1], -(2**63))), "strictly increasing"),
    ],
    ids=[
        "head-count",
        "layer-count",
        "layout",
        "contract-layers",
        "tokenizer",
        "positions",
        "other-prompt",
        "unordered",
        "wrapping",
    ],
)
def test_mismatched_kv_is_refused_by_name(change, message, decoder, chat_kv, logit_vectors):
    with pytest.raises(KVInjectionError, match=message):
        decoder.prefill(logit_vectors["chat_ids"], kv=change(chat_kv))


def test_max_tokens_runs_the_graph_only_for_tokens_still_needed(decoder, logit_vectors):
    ids = logit_vectors["prose_ids"]
    tokens = list(decoder.generate(ids, SamplingParams(max_tokens=5, stop_token_ids=())))
    assert len(tokens) == 5 and decoder.stats.finish_reason == "length"
    assert decoder.length == len(ids) + 4  # the fifth token's KV is never needed


def test_generation_ends_when_the_context_is_full(smollm2_model, logit_vectors):
    from edgedecode.model.graph import GraphOptions
    from edgedecode.runtime.engine import Engine

    small = Engine(smollm2_model, GraphOptions(), max_context=48, threads=2)
    ids = logit_vectors["prose_ids"]
    tokens = list(small.generate(ids, SamplingParams(max_tokens=100, stop_token_ids=())))
    assert small.stats.finish_reason == "context"
    assert small.length == 48 and len(tokens) == 48 - len(ids) + 1


@pytest.mark.parametrize("prompt", ("prose", "code", "chat"))
def test_a_resent_prompt_gets_the_same_greedy_answer_from_the_kv_it_kept(prompt, decoder, prefiller, logit_vectors):
    """A conversation that sends the same prompt again keeps all of it but the last token (whose KV
    the turn computes); the answer is the same bit for bit, whether the first time prefilled locally
    or took the KV from the prefill graph — the last prompt token always runs alone."""
    ids = logit_vectors[f"{prompt}_ids"]
    prefiller.prefill(ids)
    for kv in (None, prefiller.export_kv()):
        first_logits = decoder.prefill(ids, kv).copy()
        keep = decoder.reusable_prefix(ids)
        assert keep == len(ids) - 1
        np.testing.assert_array_equal(decoder.prefill(ids, keep=keep), first_logits)
        first = list(decoder.generate(ids, GREEDY_32, kv=kv))
        assert list(decoder.generate(ids, GREEDY_32, keep=decoder.reusable_prefix(ids))) == first

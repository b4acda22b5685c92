"""The prefill node's device path on real KV: SmolLM2's prefill scored by onnxruntime agrees with numpy's scores,
and the payloads the device coders encode under a budget, refits included, are byte for byte the reference's; on a
tiny Gemma 3 too, whose windowed layers travel for the tail only (EDKV 2.0)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from synthetic_gguf import TinyLlama, write_tiny_llama

from edgedecode.evaluation.texts import pydoc_corpus, token_windows
from edgedecode.kv.importance import OBSERVATION_WINDOW, attention_importance
from edgedecode.kv.stage_clock import StageClock
from edgedecode.kv.tiers import Tier
from edgedecode.model.fetch import register_gguf
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import load_model
from edgedecode.prefill.kv_device import DeviceCoder, KVDevice
from edgedecode.prefill.pipeline import ScoredPrefill, encode_within_budget, prefill_and_score, prefill_observed
from edgedecode.runtime.engine import Engine

BUDGETS = (1.0, 0.5, 0.3, 0.2, 0.15)


@pytest.fixture(scope="module")
def device():
    return KVDevice("cpu", 2)


@pytest.fixture(scope="module")
def smollm2(smollm2_model, prefiller, device):
    """A 700-token prose prompt's KV and its queries from the prefill graph."""
    prompt = token_windows(smollm2_model.tokenizer, pydoc_corpus(), 700, 1)[0]
    queries, positions = prefill_observed(prefiller, prompt, OBSERVATION_WINDOW)
    snapshot = prefiller.export_kv()
    return smollm2_model.spec, snapshot, queries, positions


@pytest.mark.model
def test_scores_on_the_device_agree_with_numpys(smollm2, device):
    spec, snapshot, queries, positions = smollm2
    ours = device.importance(spec, queries, positions, snapshot)
    theirs = attention_importance(spec, queries, positions, snapshot.keys, snapshot.positions)
    assert ours.shape == theirs.shape == (spec.n_layers, snapshot.n_tokens)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-6 * float(theirs.max()))
    # the attention each query spreads sums to one: every layer's scores add up to the queries' count
    np.testing.assert_allclose(ours.sum(axis=1), spec.n_heads * OBSERVATION_WINDOW, rtol=1e-4)


@pytest.mark.model
@pytest.mark.parametrize("budget", BUDGETS)
def test_budgeted_payloads_are_the_references_bytes(smollm2, device, budget):
    """The whole fit as the server runs it, refits included: the device path (here its CPU form, numpy and
    onnxruntime; and the device coder on the CPU EP) sends what the reference coder does."""
    spec, snapshot, queries, positions = smollm2
    scored = ScoredPrefill(snapshot, attention_importance(spec, queries, positions, snapshot.keys, snapshot.positions)
                           .sum(axis=0))  # fmt: skip
    reference = encode_within_budget(scored, budget)
    clock = StageClock()
    host = encode_within_budget(scored, budget, device=device, workers=2, clock=clock)
    assert host.frames == reference.frames
    assert clock.calls["quantize"] > 0 and clock.calls["compress"] > 0
    original = device.coder
    try:
        device.coder = lambda snap, rotation, int3: DeviceCoder(snap, device)  # the CUDA form, on the CPU EP
        assert encode_within_budget(scored, budget, device=device, workers=2).frames == reference.frames
    finally:
        device.coder = original


@pytest.mark.model
@pytest.mark.parametrize("budget", BUDGETS)
def test_the_fit_writes_one_payload_aimed_by_a_sample_of_its_chunks(smollm2, device, budget):
    """Real KV: where a tier could rise, the fit predicts zstd's gain from a sample of the chunks (once, or twice
    where the aim moved the tiers far) and writes one payload, within the fit's window of the budget; at b 1.0
    (everything FP16 already) it writes one and samples nothing."""
    spec, snapshot, queries, positions = smollm2
    scored = ScoredPrefill(snapshot, attention_importance(spec, queries, positions, snapshot.keys, snapshot.positions)
                           .sum(axis=0))  # fmt: skip
    clock = StageClock()
    encoded = encode_within_budget(scored, budget, device=device, clock=clock)
    samples = clock.calls.get("sample", 0)
    assert clock.calls["header"] - samples == 2, clock.as_dict()  # one payload planned and framed
    if (encoded.tiers == Tier.FP16).all():
        assert samples == 0
    else:
        assert 1 <= samples <= 2 and 0.99 <= encoded.b_wire / budget <= 1.0, (encoded.b_wire, budget)


@pytest.mark.model
def test_the_device_scores_pick_the_references_tiers(smollm2, device, prefiller):
    """Scores equal to float32 rounding rank the tokens alike: the tiers under each budget are the same."""
    spec, snapshot, queries, positions = smollm2
    numpy_scores = attention_importance(spec, queries, positions, snapshot.keys, snapshot.positions).sum(axis=0)
    device_scores = device.importance(spec, queries, positions, snapshot).sum(axis=0)
    for budget in BUDGETS:
        a = encode_within_budget(ScoredPrefill(snapshot, numpy_scores), budget).tiers
        b = encode_within_budget(ScoredPrefill(snapshot, device_scores), budget, device=device).tiers
        assert np.array_equal(a, b), budget


TYPES = {name: QType.Q4_0 for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
TYPES |= {"token_embd": QType.Q8_0, "output": QType.Q8_0}


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    """A tiny Gemma 3 (window 5, layers 0-4 windowed) and a 200-token prompt's scored prefill."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EDGEDECODE_HOME", str(tmp_path_factory.mktemp("home")))
        dims = TinyLlama(key_length=128, kv_heads=1, layers=6)
        path = write_tiny_llama(
            tmp_path_factory.mktemp("gguf") / "g.gguf", TYPES, dims, seed=4, tied=True, arch="gemma3"
        )
        model = load_model(register_gguf(path, "tiny-gemma3").name)
        prefiller = Engine(model, GraphOptions("prefill", "float32", 0), max_context=256, threads=2)
        prompt = np.random.default_rng(5).integers(0, 95, 200)
        yield prefill_and_score(prefiller, prompt), prefill_and_score(prefiller, prompt, device=KVDevice("cpu", 1))


@pytest.mark.parametrize("budget", [1.0, 0.3, 0.15])
@pytest.mark.parametrize("windowed", [False, True])
def test_windowed_gemma_payloads_are_the_references_bytes(tiny_gemma, device, budget, windowed):
    scored, on_device = tiny_gemma
    np.testing.assert_allclose(on_device.importance, scored.importance, rtol=1e-4)
    reference = encode_within_budget(scored, budget, windowed=windowed)
    assert encode_within_budget(scored, budget, windowed=windowed, device=device).frames == reference.frames

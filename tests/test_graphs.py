"""The built graphs against outside references: llama.cpp's logits and a numpy fp32 forward."""

from __future__ import annotations

import numpy as np
import pytest
from graph_helpers import prefill_against_llama_cpp

from edgedecode.model.reference import reference_forward
from edgedecode.model.weights import load_tensors

PROMPTS = ("prose", "code", "chat")


@pytest.fixture(scope="session")
def quantized_tensors(smollm2_reader, smollm2_model):
    return load_tensors(smollm2_reader, smollm2_model.spec, dense=False)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prefill_graph_argmax_equals_llama_cpp_at_scored_positions(prompt, prefiller, logit_vectors):
    diff = prefill_against_llama_cpp(prefiller, logit_vectors, prompt)
    # llama.cpp multiplies with int8-quantized activations, so an fp32 forward differs from it by about
    # as much as llama.cpp's own kernels differ from each other (max ~1.0, mean 0.1-0.3; see
    # tests/vectors/README.md). A wrong layout, norm or RoPE gives differences of 10 and more.
    assert diff.mean() < 0.3 and diff.max() < 2.5


@pytest.mark.parametrize("prompt", PROMPTS)
def test_exact_int4_graph_matches_numpy_reference(
    prompt, exact_decoder, quantized_tensors, smollm2_model, logit_vectors
):
    ids = logit_vectors[f"{prompt}_ids"]
    reference = reference_forward(smollm2_model.spec, quantized_tensors, ids.tolist())
    exact_decoder.reset()
    logits = exact_decoder.forward(ids, all_logits=True)
    kv = exact_decoder.export_kv()
    max_diff = float(np.abs(logits - reference.logits).max())
    print(f"{prompt}: INT4 acc0 graph vs numpy fp32 reference, max |logit diff| {max_diff:.2e}")
    assert max_diff < 1e-2
    np.testing.assert_allclose(kv.keys, reference.keys, atol=1e-3)
    np.testing.assert_allclose(kv.values, reference.values, atol=1e-3)


def test_chunked_prompt_equals_single_pass(exact_decoder, logit_vectors, monkeypatch):
    import edgedecode.runtime.engine as engine_module

    ids = logit_vectors["chat_ids"]
    exact_decoder.reset()
    single = exact_decoder.forward(ids, all_logits=True)
    monkeypatch.setattr(engine_module, "PREFILL_CHUNK_TOKENS", 7)
    exact_decoder.reset()
    chunked = exact_decoder.forward(ids, all_logits=True)
    np.testing.assert_allclose(chunked, single, atol=1e-3)


def test_fast_int4_graph_stays_close_to_exact(decoder, exact_decoder, logit_vectors):
    """accuracy_level 4 quantizes activations to int8: small logit noise, same argmax at clear margins."""
    ids = logit_vectors["prose_ids"]
    scored = logit_vectors["prose_scored_positions"]
    decoder.reset()
    exact_decoder.reset()
    fast, exact = decoder.forward(ids, all_logits=True), exact_decoder.forward(ids, all_logits=True)
    print(f"acc4 vs acc0 max |logit diff| {np.abs(fast - exact).max():.3f}")
    top2 = np.sort(exact[scored], axis=-1)[:, -2:]
    clear = scored[(top2[:, 1] - top2[:, 0]) > 1.0]
    np.testing.assert_array_equal(fast[clear].argmax(-1), exact[clear].argmax(-1))

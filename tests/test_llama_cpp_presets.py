"""SmolLM2 re-quantized the way llama.cpp's quantizer mixes types decodes equal to the numpy reference forward.

The test writes the real model's weights into one file as ``llama-quantize`` would for
``Q4_K_M --token-embedding-type bf16 --tensor-type 'blk\\.1[0-9]\\.ffn_down=q5_k'
--tensor-type 'ffn_(gate|up)=q5_1'`` (edgedecode/model/quant_mix.py). SmolLM2's 576-wide rows are not
whole 256-element super-blocks, so most matrices fall back from Q4_K to Q5_0 (Q6_K to Q8_0) and
only ffn_down (1536 wide) holds K-quants: the file has every type beside the original Q4_1 and
Q8_0 ones, one model at the cost of one.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from synthetic_gguf import requantized_copy

from edgedecode.model.fetch import register_gguf
from edgedecode.model.gguf_file import open_gguf
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import load_model
from edgedecode.model.quant_mix import llama_cpp_mix
from edgedecode.model.reference import reference_forward
from edgedecode.model.weights import load_tensors
from edgedecode.runtime.engine import Engine

PROMPT = "The river runs to the sea, and the sea is never full."
DECODE_STEPS = 3
OVERRIDES = {"token_embd": QType.BF16, r"blk\.1[0-9]\.ffn_down": QType.Q5_K, r"ffn_(gate|up)": QType.Q5_1}
NEW_TYPES = {QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.BF16}


@pytest.fixture(scope="module")
def requantized(smollm2_reader, smollm2_spec, tmp_path_factory):
    """(reader, loaded model, decode tensors) of SmolLM2 written in the mix and registered."""
    folder = tmp_path_factory.mktemp("q4_k_m")
    choose = llama_cpp_mix("Q4_K_M", smollm2_spec.n_layers, OVERRIDES)
    path = requantized_copy(smollm2_reader, folder / "smollm2-q4_k_m.gguf", choose)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDGEDECODE_HOME", str(folder / "home"))
        register_gguf(path, "smollm2-q4_k_m")
        model = load_model("smollm2-q4_k_m")
        reader = open_gguf(path)
        yield reader, model, load_tensors(reader, model.spec, dense=False)


def test_the_file_holds_every_new_type(requantized):
    reader, model, _ = requantized
    types = Counter(QType(t.tensor_type) for t in reader.tensors)
    assert set(types) == NEW_TYPES | {QType.F32}
    assert types[QType.F32] == 2 * model.spec.n_layers + 1  # the norms
    assert types[QType.Q5_K] == 10 and types[QType.BF16] == 1


def test_requantized_smollm2_decodes_equal_to_the_reference_forward(requantized):
    _, model, tensors = requantized
    ids = model.tokenizer.encode(PROMPT)
    engine = Engine(model, GraphOptions("decode", "float32", 0), max_context=64, threads=2)
    logits = [engine.forward(np.asarray(ids), all_logits=True)]
    tokens = list(ids)
    for _ in range(DECODE_STEPS):  # greedy decode steps, one token a graph run
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(engine.step(tokens[-1])[None].copy())
    ours = np.concatenate(logits)
    reference = reference_forward(model.spec, tensors, tokens)
    diff = np.abs(ours - reference.logits).max()
    print(f"{len(ids)} prompt tokens, then {tokens[len(ids) :]}; max |logit diff| vs numpy reference {diff:.2e}")
    np.testing.assert_allclose(ours, reference.logits, atol=1e-2)

"""tools/synth_gguf.py (issue 17): a GGUF of a model's shape with random weights registers and decodes
in edgedecode as a real file does, with the shape it was asked for."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from edgedecode.model.fetch import register_gguf
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import load_model
from edgedecode.runtime.engine import Engine
from edgedecode.runtime.sampler import SamplingParams

TOOLS = Path(__file__).resolve().parent.parent / "tools"


@pytest.fixture(scope="module")
def synth_gguf():
    sys.path.insert(0, str(TOOLS))
    try:
        import synth_gguf
    finally:
        sys.path.remove(str(TOOLS))
    return synth_gguf


def test_a_synthetic_file_has_its_shape_and_decodes(synth_gguf, smollm2_gguf, smollm2_model, tmp_path, monkeypatch):
    weight_type = "Q4_0"  # the published SmolLM2 file covers Q4_1
    monkeypatch.setenv("EDGEDECODE_HOME", str(tmp_path / "home"))
    shape = synth_gguf.SHAPES["tiny"]
    path = tmp_path / "tiny.gguf"
    synth_gguf.write_synthetic(path, shape, weight_type, smollm2_gguf)
    record = register_gguf(path, f"tiny-{weight_type.lower()}")
    model = load_model(record.name)
    spec = model.spec
    assert (spec.n_layers, spec.hidden_size, spec.n_heads, spec.n_kv_heads) == (2, 64, 4, 2)
    assert (spec.vocab_size, spec.head_dim) == (shape.vocab, 16)
    text = "Hello world, the synthetic model speaks."
    assert model.tokenizer.encode(text, add_bos=False) == smollm2_model.tokenizer.encode(text, add_bos=False)
    engine = Engine(model, GraphOptions.for_device("decode", "cpu"), max_context=64, threads=1)
    tokens = list(engine.generate(np.arange(10, 26), SamplingParams(max_tokens=8, stop_token_ids=())))
    assert len(tokens) == 8 and all(0 <= t < shape.vocab for t in tokens)

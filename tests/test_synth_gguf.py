"""tools/bench/synth_gguf.py (issue 17): a GGUF of a model's shape with random weights registers and decodes
in edgedecode (and llama.cpp, where installed) as a real file does, with the shape and types asked for."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader
from tool_modules import import_tools

from edgedecode.model.fetch import register_gguf
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import load_model
from edgedecode.runtime.engine import Engine
from edgedecode.runtime.sampler import SamplingParams


@pytest.fixture(scope="module")
def synth_gguf():
    return import_tools("bench.synth_gguf")[0]


@pytest.mark.parametrize("weight_type", ["Q4_0", "Q4_K_M"])  # the published SmolLM2 file covers Q4_1
def test_a_synthetic_file_has_its_shape_and_decodes(
    synth_gguf, smollm2_gguf, smollm2_model, tmp_path, monkeypatch, weight_type
):
    monkeypatch.setenv("EDGEDECODE_HOME", str(tmp_path / "home"))
    shape = synth_gguf.SHAPES["tiny"]
    path = tmp_path / "tiny.gguf"
    synth_gguf.write_synthetic(path, shape, weight_type, smollm2_gguf)
    record = register_gguf(path, f"tiny-{weight_type.lower()}")
    model = load_model(record.name)
    spec = model.spec
    assert (spec.n_layers, spec.hidden_size, spec.n_heads, spec.n_kv_heads) == (2, 256, 4, 2)
    assert (spec.vocab_size, spec.head_dim) == (shape.vocab, 64)
    text = "Hello world, the synthetic model speaks."
    assert model.tokenizer.encode(text, add_bos=False) == smollm2_model.tokenizer.encode(text, add_bos=False)
    engine = Engine(model, GraphOptions.for_device("decode", "cpu"), max_context=64, threads=1)
    tokens = list(engine.generate(np.arange(10, 26), SamplingParams(max_tokens=8, stop_token_ids=())))
    assert len(tokens) == 8 and all(0 <= t < shape.vocab for t in tokens)


def test_q4_k_m_mixes_types_as_llama_cpp(synth_gguf):
    """Q4_K for most matrices, Q6_K for attn_v and ffn_down on use_more_bits layers and for the tied
    embedding; Q5_0 / Q8_0 where rows are not whole super-blocks (Qwen2.5-0.5B's 896)."""
    llama = synth_gguf.tensor_types(synth_gguf.SHAPES["llama3.2-1b"], "Q4_K_M")  # 16 layers: 0, 1, 4, 7, ... 14, 15
    assert llama("token_embd.weight", 2048) == QType.Q6_K
    assert [llama(f"blk.{i}.attn_v.weight", 2048) == QType.Q6_K for i in range(16)] == [
        i in (0, 1, 4, 7, 10, 13, 14, 15) for i in range(16)
    ]
    assert llama("blk.4.ffn_down.weight", 8192) == QType.Q6_K and llama("blk.5.ffn_down.weight", 8192) == QType.Q4_K
    assert {llama(f"blk.4.{name}.weight", 2048) for name in ("attn_q", "attn_k", "attn_output", "ffn_gate")} == {
        QType.Q4_K
    }
    qwen = synth_gguf.tensor_types(synth_gguf.SHAPES["qwen2.5-0.5b"], "Q4_K_M")
    assert (qwen("token_embd.weight", 896), qwen("blk.0.attn_q.weight", 896)) == (QType.Q8_0, QType.Q5_0)
    assert (qwen("blk.0.attn_v.weight", 896), qwen("blk.0.ffn_down.weight", 4864)) == (QType.Q8_0, QType.Q6_K)


def test_a_synthetic_q4_k_m_file_decodes_in_llama_cpp(synth_gguf, smollm2_gguf, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    path = tmp_path / "tiny.gguf"
    synth_gguf.write_synthetic(path, synth_gguf.SHAPES["tiny"], "Q4_K_M", smollm2_gguf)
    types = {QType(t.tensor_type) for t in GGUFReader(path).tensors if len(t.shape) == 2}
    assert types == {QType.Q4_K, QType.Q6_K}
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, verbose=False)
    assert llm.n_vocab() == synth_gguf.SHAPES["tiny"].vocab
    token = next(iter(llm.generate(list(range(10, 26)), temp=0.0)))
    assert 0 <= token < llm.n_vocab()

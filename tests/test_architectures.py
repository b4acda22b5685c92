"""Every supported architecture (llama with llama3 RoPE factors, qwen2, qwen3, gemma3) on tiny synthetic
GGUFs: the spec read from metadata, and the prefill and decode graphs equal to the numpy reference."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import GGUFWriter
from graph_helpers import run_graph
from onnx import TensorProto
from synthetic_gguf import TinyLlama, write_tiny_llama

from edgedecode.model.fetch import register_gguf
from edgedecode.model.gguf_file import ModelFileError, open_gguf
from edgedecode.model.graph import GraphOptions, build_graph
from edgedecode.model.loader import load_model
from edgedecode.model.reference import reference_forward
from edgedecode.model.spec import ARCHITECTURES, ModelSpec
from edgedecode.model.weights import load_tensors
from edgedecode.runtime.engine import Engine

# The Gemma 3 270M file's mix: Q4_K q and gate/up, Q5_0 k and o, Q8_0 v, Q6_K down, a Q8_0 embedding.
TYPES = {
    "attn_q": QType.Q4_K,
    "attn_k": QType.Q5_0,
    "attn_v": QType.Q8_0,
    "attn_output": QType.Q5_0,
    "ffn_gate": QType.Q4_K,
    "ffn_up": QType.Q4_K,
    "ffn_down": QType.Q6_K,
    "token_embd": QType.Q8_0,
    "output": QType.Q6_K,
}
# (dimensions, tied): qwen3 and gemma3 have head_dim * heads != hidden, as the real ones do; gemma3 has six
# layers, so llama.cpp's default pattern makes layers 0-4 windowed (window 5) and layer 5 global.
MODELS = {
    "llama3": (TinyLlama(), False),
    "qwen2": (TinyLlama(), False),
    "qwen3": (TinyLlama(key_length=128), True),
    "gemma3": (TinyLlama(key_length=128, kv_heads=1, layers=6), True),
}
PROMPT = np.random.default_rng(3).integers(0, 95, 19)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (path, reader, spec) of each tiny model."""
    folder = tmp_path_factory.mktemp("archs")
    out = {}
    for i, (arch, (dims, tied)) in enumerate(MODELS.items()):
        path = write_tiny_llama(folder / f"{arch}.gguf", TYPES, dims, seed=10 + i, tied=tied, arch=arch)
        reader = open_gguf(path)
        out[arch] = path, reader, ModelSpec.from_gguf(reader, arch)
    return out


def test_each_architecture_maps_to_its_traits(models):
    specs = {arch: spec for arch, (_, _, spec) in models.items()}
    assert specs["llama3"].traits == ARCHITECTURES["llama"] and len(specs["llama3"].rope_freq_factors) == 32
    assert specs["llama3"].kv_contract.rope_scaling.startswith("llama3:")
    assert specs["qwen2"].traits.qkv_bias and specs["qwen3"].traits.qk_norm
    gemma = specs["gemma3"]
    assert (gemma.sliding_window, gemma.sliding_layers) == (5, (0, 1, 2, 3, 4))
    assert [gemma.rope_theta_of(i) for i in (4, 5)] == [10000.0, 1e6]
    contract = gemma.kv_contract
    assert (contract.sliding_window, contract.sliding_layers, contract.rope_local_theta) == (5, (0, 1, 2, 3, 4), 1e4)
    assert specs["qwen2"].kv_contract.mismatches(dataclasses.replace(specs["qwen2"], sliding_window=4).kv_contract)


@pytest.mark.parametrize("kind", ["prefill", "decode"])
@pytest.mark.parametrize("arch", list(MODELS))
def test_graphs_of_every_architecture_match_the_reference(arch, kind, models):
    _, reader, spec = models[arch]
    tensors = load_tensors(reader, spec, dense=kind == "prefill")
    logits = run_graph(spec, tensors, GraphOptions(kind, "float32", 0), PROMPT)
    reference = reference_forward(spec, tensors, PROMPT.tolist())
    print(f"{arch} {kind}: max |logit diff| vs numpy reference {np.abs(logits - reference.logits).max():.2e}")
    np.testing.assert_allclose(logits, reference.logits, atol=1e-4)


def test_a_float16_gemma3_graph_keeps_its_residual_stream_in_float32(models):
    """Gemma 3's residual stream passes float16's 65504 (layer 8 of 270M), so the float16 graph CUDA gets
    adds and normalizes it in float32; the blocks run in float16 and stay within its rounding."""
    _, reader, spec = models["gemma3"]
    tensors = load_tensors(reader, spec, dense=False)
    options = GraphOptions.for_device("decode", "cuda", 0)
    graph = build_graph(spec, tensors, options)
    initializers = {t.name: t.data_type for t in graph.graph.initializer}
    norms = [n for n in graph.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"]
    assert len(norms) == 2 * spec.n_layers and all(initializers[n.input[2]] == TensorProto.FLOAT for n in norms)
    logits = run_graph(spec, tensors, options, PROMPT)
    np.testing.assert_allclose(logits, reference_forward(spec, tensors, PROMPT.tolist()).logits, atol=0.03)


def test_the_sliding_window_and_local_rope_base_change_gemma3s_output(models):
    """Guards the test above: without its windows (or with one RoPE base) the reference differs."""
    _, reader, spec = models["gemma3"]
    tensors = load_tensors(reader, spec, dense=True)
    reference = reference_forward(spec, tensors, PROMPT.tolist()).logits
    for variant in (dict(sliding_layers=()), dict(rope_local_theta=spec.rope_theta)):
        other = reference_forward(dataclasses.replace(spec, **variant), tensors, PROMPT.tolist()).logits
        assert np.abs(other[6:] - reference[6:]).max() > 1e-2, variant


@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
def test_engine_decodes_step_by_step_as_the_reference(arch, models, tmp_path, monkeypatch):
    """Prompt chunks and single steps read the past KV through the window: logits and KV of every position
    equal the reference's over the whole sequence."""
    monkeypatch.setenv("EDGEDECODE_HOME", str(tmp_path / "home"))
    model = load_model(register_gguf(models[arch][0], arch).name)
    engine = Engine(model, GraphOptions("decode", "float32", 0), max_context=64, threads=2)
    tensors = load_tensors(models[arch][1], model.spec, dense=False)
    prompt, steps = PROMPT[:12], PROMPT[12:]
    logits = [engine.forward(prompt, all_logits=True)] + [engine.step(int(t))[None].copy() for t in steps]
    reference = reference_forward(model.spec, tensors, PROMPT.tolist())
    np.testing.assert_allclose(np.concatenate(logits), reference.logits, atol=1e-4)
    np.testing.assert_allclose(engine.export_kv().keys, reference.keys, atol=1e-4)


def _gguf_with(path, arch: str, **keys) -> ModelSpec:
    """The spec of a tiny gemma3/llama file carrying extra ``{arch}.KEY`` metadata."""
    write_tiny_llama(path, TYPES, TinyLlama(key_length=128), arch=arch)
    reader = open_gguf(path)
    writer = GGUFWriter(str(path.with_suffix(".extra.gguf")), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=field.types[-1])
    adders = {str: writer.add_string, float: writer.add_float32, int: writer.add_uint32, list: writer.add_array}
    for key, value in keys.items():
        adders[type(value)](f"{writer.arch}.{key}", value)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=QType(tensor.tensor_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return ModelSpec.from_gguf(open_gguf(path.with_suffix(".extra.gguf")), "extra")


@pytest.mark.parametrize(
    ("pattern", "sliding"), [(2, (0,)), (1, ()), ([False, True], (1,))], ids=["period 2", "period 1", "flags"]
)
def test_the_sliding_window_pattern_key_overrides_the_default(pattern, sliding, tmp_path):
    spec = _gguf_with(tmp_path / "model.gguf", "gemma3", **{"attention.sliding_window_pattern": pattern})
    assert spec.sliding_layers == sliding and spec.sliding_window == 5


@pytest.mark.parametrize(
    ("arch", "keys", "message"),
    [
        ("gemma3", {"final_logit_softcapping": 30.0}, "gemma3.final_logit_softcapping is set"),
        ("gemma3", {"attn_logit_softcapping": 50.0}, "gemma3.attn_logit_softcapping is set"),
        ("llama", {"rope.scaling.type": "yarn"}, "llama.rope.scaling.type 'yarn' is not supported"),
        ("llama", {"rope.scaling.type": "llama3"}, "'llama3' but the file has no rope_freqs.weight"),
    ],
)
def test_metadata_the_graphs_do_not_implement_is_refused(arch, keys, message, tmp_path):
    with pytest.raises(ModelFileError, match=message):
        _gguf_with(tmp_path / "model.gguf", arch, **keys)

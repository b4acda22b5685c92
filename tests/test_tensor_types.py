"""Every supported GGUF tensor type through both graph builders, on a tiny synthetic llama model.

The real model only exercises Q4_1 layers and a Q8_0 embedding; this writes a two-layer model
whose matrices are F32, F16, Q4_0, Q4_1 and Q8_0 (mixed inside one fused QKV), plus an untied
output head, and checks each built graph against the numpy reference on the same weights.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import GGUFWriter
from gguf.quants import quantize

from edgedecode.model.gguf_file import open_gguf
from edgedecode.model.graph import GraphOptions, build_graph
from edgedecode.model.reference import reference_forward
from edgedecode.model.spec import ModelSpec
from edgedecode.model.weights import load_tensors

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB, LAYERS = 64, 128, 4, 2, 96, 2
LAYER_TYPES = {  # mixed on purpose: q/k/v fuse across different bit widths
    "attn_q": QType.F16,
    "attn_k": QType.Q4_0,
    "attn_v": QType.Q8_0,
    "attn_output": QType.F32,
    "ffn_gate": QType.Q4_1,
    "ffn_up": QType.Q4_1,
    "ffn_down": QType.Q4_0,
}


def _add(writer: GGUFWriter, name: str, weight: np.ndarray, kind: QType) -> None:
    if kind == QType.F32:
        writer.add_tensor(name, weight.astype(np.float32))
    elif kind == QType.F16:
        writer.add_tensor(name, weight.astype(np.float16))
    else:
        writer.add_tensor(name, quantize(weight, kind), raw_dtype=kind)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    writer.add_token_types([1] * VOCAB)
    writer.add_token_merges([])
    writer.add_eos_token_id(VOCAB - 1)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    _add(writer, "token_embd.weight", matrix(VOCAB, HIDDEN), QType.F16)
    _add(writer, "output.weight", matrix(VOCAB, HIDDEN), QType.Q4_0)
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    shapes = {
        "attn_q": (HIDDEN, HIDDEN),
        "attn_k": (KV_HEADS * HIDDEN // HEADS, HIDDEN),
        "attn_v": (KV_HEADS * HIDDEN // HEADS, HIDDEN),
        "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }
    for layer in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        for name, kind in LAYER_TYPES.items():
            _add(writer, f"blk.{layer}.{name}.weight", matrix(*shapes[name]), kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny(tiny_gguf):
    reader = open_gguf(tiny_gguf)
    return reader, ModelSpec.from_gguf(reader, "tiny-llama")


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_every_supported_tensor_type_builds_a_graph_that_matches_the_reference(kind, tiny, tmp_path):
    reader, spec = tiny
    assert not spec.tied_embeddings
    tensors = load_tensors(reader, spec, dense=kind == "prefill")
    path = tmp_path / f"{kind}.onnx"
    onnx.save(build_graph(spec, tensors, GraphOptions(kind, "float32", 0)), path)
    ids = np.random.default_rng(1).integers(0, VOCAB, 19)
    reference = reference_forward(spec, tensors, ids.tolist())

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    past = np.zeros((1, KV_HEADS, 32, HIDDEN // HEADS), np.float32)
    feeds = {
        "input_ids": ids[None],
        "attention_mask": np.ones((1, len(ids)), np.int64),
        "position_ids": np.arange(len(ids), dtype=np.int64)[None],
        "logits_positions": np.arange(len(ids), dtype=np.int64),
    }
    feeds.update({f"past_key_values.{i}.{t}": past for i in range(LAYERS) for t in ("key", "value")})
    logits = session.run(["logits"], feeds)[0][0]
    print(f"{kind}: max |logit diff| vs numpy reference {np.abs(logits - reference.logits).max():.2e}")
    np.testing.assert_allclose(logits, reference.logits, atol=1e-3)


def test_float_weights_are_quantized_to_4_bits_for_the_decode_graph(tiny):
    reader, spec = tiny
    quantized = load_tensors(reader, spec, dense=False)
    dense = load_tensors(reader, spec, dense=True)
    q_f16, v_q8 = quantized.layers[0].qkv[0], quantized.layers[0].qkv[2]
    assert (q_f16.bits, v_q8.bits) == (4, 8)
    # min/max 4-bit blocks: error at most half a step of each block's scale
    step = np.repeat(q_f16.scales, 32, axis=1)
    assert np.all(np.abs(q_f16.dequantize() - dense.layers[0].qkv[0]) <= step / 2 + 1e-6)
    np.testing.assert_array_equal(v_q8.dequantize(), dense.layers[0].qkv[2])  # Q8_0 maps exactly

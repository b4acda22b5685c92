"""Re-quantized decode graphs (GraphOptions.weights): the quantizer's error bound, exact graphs, the native default."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgedecode.model.graph import GraphOptions, GraphOptionsError, build_graph
from edgedecode.model.loader import graph_key
from edgedecode.model.reference import reference_forward
from edgedecode.model.requant import (
    WeightFormat,
    parse_weight_format,
    requantize,
    requantize_layers,
)
from edgedecode.model.weights import BlockQuantized, load_tensors, quantize_asymmetric
from edgedecode.runtime.engine import Engine


@pytest.fixture(scope="module")
def native_tensors(smollm2_reader, smollm2_model):
    return load_tensors(smollm2_reader, smollm2_model.spec, dense=False)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    cols=st.integers(1, 300),
    bits=st.sampled_from([2, 4, 8]),
    block_size=st.sampled_from([16, 32, 64, 128]),
    seed=st.integers(0, 2**32 - 1),
)
def test_requantized_weight_is_within_half_a_step_of_the_original(rows, cols, bits, block_size, seed):
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    q = requantize(w, WeightFormat(bits, block_size))
    blocks = -(-cols // block_size)
    assert (q.bits, q.block_size, q.codes.shape, q.scales.shape) == (bits, block_size, (rows, cols), (rows, blocks))
    assert q.codes.max() < 2**bits
    step = np.repeat(q.scales, block_size, axis=1)[:, :cols]
    assert np.all(np.abs(q.dequantize() - w) <= step / 2 + 1e-5 * np.abs(w).max())


def test_requantizing_a_block_weight_starts_from_its_dequantized_values():
    w = np.random.default_rng(0).standard_normal((4, 96)).astype(np.float32)
    native = quantize_asymmetric(w, 4)
    coarse = requantize(native, WeightFormat(2, 64))
    np.testing.assert_array_equal(coarse.codes, quantize_asymmetric(native.dequantize(), 2, 64).codes)
    # min/max blocks keep each block's extremes, so the same format reproduces a weight already in it
    np.testing.assert_allclose(requantize(native, WeightFormat(4, 32)).dequantize(), native.dequantize(), atol=1e-5)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_packed_codes_follow_matmulnbits_order(bits):
    codes = np.random.default_rng(bits).integers(0, 2**bits, (3, 40), dtype=np.uint8)
    weight = BlockQuantized(codes, np.ones((3, 3), np.float32), None, bits, block_size=16)
    packed = weight.packed()  # [N, blocks, block_size*bits/8]; element i of a byte sits at bits i*bits
    per_byte = 8 // bits
    assert packed.shape == (3, 3, 16 // per_byte)
    unpacked = np.stack([(packed >> (i * bits)) & (2**bits - 1) for i in range(per_byte)], -1).reshape(3, 48)
    np.testing.assert_array_equal(unpacked[:, :40], codes)
    assert np.all(unpacked[:, 40:] == 2 ** (bits - 1))  # the short last block is padded with the zero point


@pytest.mark.parametrize("weights", ["q4b128", "q2b32"])
def test_requantized_decode_graph_equals_numpy_forward_of_the_requantized_weights(
    weights, smollm2_model, native_tensors
):
    """q4b128 has a short last block on every 576-wide input (576 = 4.5 x 128); q2b32 packs 4 codes a byte."""
    ids = smollm2_model.tokenizer.encode("The river runs to the sea, and the sea is never full.")
    engine = Engine(smollm2_model, GraphOptions("decode", "float32", 0, weights=weights), max_context=64, threads=2)
    logits = engine.forward(np.asarray(ids), all_logits=True)
    tensors = requantize_layers(native_tensors, parse_weight_format(weights))
    reference = reference_forward(smollm2_model.spec, tensors, ids)
    native = reference_forward(smollm2_model.spec, native_tensors, ids)
    print(
        f"{weights}: max |logit diff| vs numpy {np.abs(logits - reference.logits).max():.2e}; "
        f"vs native weights {np.abs(logits - native.logits).max():.2f}"
    )
    np.testing.assert_allclose(logits, reference.logits, atol=1e-2)
    assert np.abs(reference.logits - native.logits).max() > 0.5  # the weights really changed


def test_native_weights_are_the_default_graph(smollm2_spec, native_tensors):
    assert GraphOptions(weights="native") == GraphOptions()
    assert requantize_layers(native_tensors, None) is native_tensors
    graph = build_graph(smollm2_spec, native_tensors, GraphOptions())
    init = {t.name: t for t in graph.graph.initializer}
    nbits = [n for n in graph.graph.node if n.op_type == "MatMulNBits"]
    assert {next(a.i for a in n.attribute if a.name == "block_size") for n in nbits} == {32}
    down = native_tensors.layers[7].down
    qweight = np.frombuffer(init["layers.7.mlp.down.qweight"].raw_data, np.uint8).reshape(down.packed().shape)
    np.testing.assert_array_equal(qweight, down.packed())
    # 4-bit packing is GGUF-independent MatMulNBits order: element 2i in the low nibble
    np.testing.assert_array_equal(qweight[..., 0] & 0x0F, down.codes[:, 0::32])


def test_weight_format_is_part_of_the_cache_key_and_file_name(smollm2_model):
    native, coarse = GraphOptions(), GraphOptions(weights="q4b128")
    assert graph_key("a" * 64, native) != graph_key("a" * 64, coarse)
    assert smollm2_model.graph_path(coarse).name.startswith("decode-float32-acc4-q4b128-")
    assert "native" not in smollm2_model.graph_path(native).name


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"weights": "q3b32"}, "bits must be one of"),
        ({"weights": "q4b48"}, "power of two"),
        ({"weights": "q4b8"}, "power of two >= 16"),
        ({"weights": "int4"}, "q<bits>b<block_size>"),
        ({"kind": "prefill", "weights": "q4b32"}, "decode graph only"),
    ],
)
def test_invalid_weight_formats_are_refused(kwargs, message):
    with pytest.raises(GraphOptionsError, match=message):
        GraphOptions(**kwargs)

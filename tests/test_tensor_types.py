"""Every supported GGUF tensor type, unpacked and through both graph builders, on tiny synthetic llama models.

The real model only exercises Q4_1 layers and a Q8_0 embedding. These tests hold the unpacked
codes of every quantized type to the gguf package's own ``dequantize`` (bit for bit), check which
graph form each type gets, and build decode and prefill graphs of small models that mix the types
(inside one fused QKV too, tied and untied heads) against the numpy reference on the same weights.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from gguf import GGMLQuantizationType as QType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize
from graph_helpers import run_graph
from synthetic_gguf import DIMS, LAYERS, MIXES, write_mixes, write_tiny_llama

from edgedecode.model import graph as graph_module
from edgedecode.model.gguf_file import open_gguf
from edgedecode.model.graph import Q4_1_MODES, GraphOptions, build_graph
from edgedecode.model.reference import reference_forward
from edgedecode.model.spec import ModelSpec
from edgedecode.model.tensor_encode import encode
from edgedecode.model.tensor_types import BLOCK_TYPES, SUPPORTED_TENSOR_TYPES, unpack
from edgedecode.model.weights import load_block_quantized, load_tensors
from edgedecode.runtime.session import available_devices

# The graph form each quantized type maps to: (bits, block size, has offsets). MatMulNBits takes
# 2, 4 or 8 bits, so 4-bit types stay 4-bit and 5-, 6- and 8-bit ones become 8-bit codes.
GRAPH_FORMS = {
    QType.Q4_0: (4, 32, False),
    QType.Q4_1: (4, 32, True),
    QType.Q4_K: (4, 32, True),
    QType.Q5_0: (8, 32, False),
    QType.Q5_1: (8, 32, True),
    QType.Q5_K: (8, 32, True),
    QType.Q6_K: (8, 16, False),
    QType.Q8_0: (8, 32, False),
}


def test_the_mixes_cover_every_supported_type():
    used = {kind for mix in MIXES.values() for kind in mix.values()}
    assert used == SUPPORTED_TENSOR_TYPES and set(GRAPH_FORMS) == BLOCK_TYPES


@pytest.fixture(scope="module")
def mixes(tmp_path_factory):
    """name -> (reader, spec) of each mix written to a GGUF."""
    return write_mixes(tmp_path_factory.mktemp("mixes"))


def _scale_times_codes(codes, bits, block_size, scales, biases):
    """``scale·q + bias`` per sub-block (``scale·(q − 2**(bits−1))`` without bias): the Unpacked contract."""
    q = codes.reshape(codes.shape[0], -1, block_size).astype(np.float32)
    w = q * scales[..., None] + biases[..., None] if biases is not None else (q - 2 ** (bits - 1)) * scales[..., None]
    return w.reshape(codes.shape)


@pytest.mark.parametrize("kind", sorted(BLOCK_TYPES, key=lambda k: k.name), ids=lambda k: k.name)
def test_unpacked_codes_give_ggufs_dequantize_bit_for_bit(kind):
    """Random bytes reach every bit of every field; float16 fields that decode to inf/NaN do so on both sides."""
    block, block_bytes = GGML_QUANT_SIZES[kind]
    raw = np.random.default_rng(kind.value).integers(0, 256, (5, 3 * block_bytes), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        matrix = unpack(raw, kind)
        ours = _scale_times_codes(matrix.codes, matrix.bits, matrix.block_size, matrix.scales, matrix.biases)
        np.testing.assert_array_equal(ours, dequantize(raw, kind))
    assert matrix.codes.shape == (5, 3 * block) and int(matrix.codes.max()) < 2**matrix.bits
    assert matrix.scales.shape == (5, 3 * block // matrix.block_size)


def test_unpack_refuses_rows_of_partial_blocks():
    with pytest.raises(ValueError, match="not whole 144-byte blocks"):
        unpack(np.zeros((2, 150), np.uint8), QType.Q4_K)


@pytest.mark.parametrize("name", list(MIXES))
def test_every_quantized_matrix_maps_exactly_to_its_graph_form(name, mixes):
    """Symmetric types equal gguf's dequantize bit for bit; an asymmetric one's folded offset is rounded once."""
    reader, _ = mixes[name]
    for tensor in reader.tensors:
        kind = QType(tensor.tensor_type)
        if kind not in BLOCK_TYPES:
            continue
        form = load_block_quantized(tensor)
        assert (form.bits, form.block_size, form.offsets is not None) == GRAPH_FORMS[kind], tensor.name
        reference = dequantize(tensor.data, kind)
        ours = form.dequantize()
        if form.offsets is None:
            np.testing.assert_array_equal(ours, reference, err_msg=tensor.name)
        else:
            offsets = np.repeat(np.abs(form.offsets), form.block_size, axis=1)
            bound = np.spacing(offsets) + 2 * np.spacing(np.abs(reference))
            assert np.all(np.abs(ours - reference) <= bound), tensor.name


@pytest.mark.parametrize(("kind", "sibling"), [(QType.Q4_K, QType.Q4_1), (QType.Q5_K, QType.Q5_1)])
def test_k_quant_encoder_writes_what_gguf_reads_back(kind, sibling):
    """The K-quant writer (tensor_encode.encode) against gguf's decoder: about as close to the
    weights as gguf's own 32-block quantizer of the same width; Q6_K closer than a 5-bit one."""
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((16, 512)) * np.exp(rng.standard_normal((16, 1)))).astype(np.float32)

    def error(t: QType) -> float:
        return float(np.sqrt(np.mean((dequantize(encode(w, t), t) - w) ** 2) / np.mean(w**2)))

    assert error(kind) < 1.2 * error(sibling)
    assert error(QType.Q6_K) < 0.7 * error(QType.Q5_1)


GRAPHS = [("prefill", "correction")] + [("decode", mode) for mode in Q4_1_MODES]


@pytest.mark.parametrize("name", list(MIXES))
@pytest.mark.parametrize(("kind", "q4_1"), GRAPHS, ids=[f"{k}-{m}" for k, m in GRAPHS])
def test_every_mix_builds_graphs_that_match_the_reference(name, kind, q4_1, mixes):
    reader, spec = mixes[name]
    tensors = load_tensors(reader, spec, dense=kind == "prefill")
    ids = np.random.default_rng(1).integers(0, DIMS.vocab, 19)
    logits = run_graph(spec, tensors, GraphOptions(kind, "float32", 0, q4_1=q4_1), ids)
    reference = reference_forward(spec, tensors, ids.tolist())
    print(f"{name} {kind} {q4_1}: max |logit diff| vs numpy reference {np.abs(logits - reference.logits).max():.2e}")
    np.testing.assert_allclose(logits, reference.logits, atol=1e-4)


@pytest.mark.parametrize(("bar", "form"), [(0, "correction"), (10**12, "zero_point")])
def test_by_size_takes_the_correction_for_large_models_and_zero_points_for_small_ones(bar, form, monkeypatch, mixes):
    """``q4_1="by_size"`` (the CUDA default) builds the graph of the form the model's size calls for:
    the correction's nodes (``*.correction``) or float zero points, never both, and either computes
    what the reference does."""
    monkeypatch.setattr(graph_module, "BY_SIZE_CORRECTION_ELEMENTS", bar)
    reader, spec = mixes["tied 4-bit with offsets"]
    tensors = load_tensors(reader, spec, dense=False)
    assert graph_module.offset_form_by_size(tensors) == form
    options = GraphOptions("decode", "float32", 0, q4_1="by_size")
    names = {init.name for init in build_graph(spec, tensors, options).graph.initializer}
    for layer in range(spec.n_layers):
        for matmul in ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down"):
            assert (f"layers.{layer}.{matmul}.correction" in names) == (form == "correction")
            assert (f"layers.{layer}.{matmul}.zero_points" in names) == (form == "zero_point")
    ids = np.random.default_rng(1).integers(0, DIMS.vocab, 19)
    logits = run_graph(spec, tensors, options, ids)
    np.testing.assert_allclose(logits, reference_forward(spec, tensors, ids.tolist()).logits, atol=1e-4)


CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif("cuda" not in available_devices(), reason="needs onnxruntime-gpu with a CUDA device"),
    ],
)


@pytest.mark.parametrize("name", list(MIXES))
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_every_mix_as_shipped_for_cuda_stays_within_float16_rounding(name, device, mixes):
    """The float16 decode graph CUDA gets (float zero points for 4-bit offsets): scales, offsets and
    activations round to float16 (docs/model-formats.md), so logits of magnitude ~4 move by < 0.01."""
    reader, spec = mixes[name]
    tensors = load_tensors(reader, spec, dense=False)
    ids = np.random.default_rng(1).integers(0, DIMS.vocab, 19)
    logits = run_graph(spec, tensors, GraphOptions.for_device("decode", "cuda", 0), ids, device)
    reference = reference_forward(spec, tensors, ids.tolist())
    diff = np.abs(logits - reference.logits).max()
    print(f"{name} float16 on {device}: max |logit diff| vs numpy reference {diff:.2e}")
    np.testing.assert_allclose(logits, reference.logits, atol=0.03)


def _attribute(node: onnx.NodeProto, name: str) -> int:
    return next(a.i for a in node.attribute if a.name == name)


def test_decode_graph_keeps_each_type_at_its_own_bit_width(mixes):
    """Q4_K layers stay 4-bit next to 8-bit Q6_K ones in the same fused QKV and gate+up; the head is Q6_K's form."""
    reader, spec = mixes["k-quants"]
    graph = build_graph(spec, load_tensors(reader, spec, dense=False), GraphOptions())
    forms = {
        n.name: (_attribute(n, "bits"), _attribute(n, "block_size"))
        for n in graph.graph.node
        if n.op_type in ("MatMulNBits", "GatherBlockQuantized")
    }
    expected = {"embed": QType.Q4_K, "lm_head": QType.Q6_K}
    for i in range(spec.n_layers):
        layer = f"layers.{i}"
        expected |= {f"{layer}.attn.qkv.0": QType.Q4_K, f"{layer}.attn.qkv.1": QType.Q6_K}  # [q, k], [v]
        expected |= {f"{layer}.attn.o": QType.Q5_K, f"{layer}.mlp.down": QType.Q4_K}
        expected |= {f"{layer}.mlp.gate_up.0": QType.Q4_K, f"{layer}.mlp.gate_up.1": QType.Q6_K}
    assert forms == {node: GRAPH_FORMS[kind][:2] for node, kind in expected.items()}


@pytest.mark.parametrize("name", ["5-bit, tied Q6_K", "tied 4-bit with offsets", "tied 8-bit with offsets"])
def test_a_tied_head_reads_the_embeddings_codes_under_its_own_name(name, mixes):
    """Its own initializer, so onnxruntime can release it once prepacked while the gather keeps its mapping."""
    reader, spec = mixes[name]
    graph = build_graph(spec, load_tensors(reader, spec, dense=False), GraphOptions())
    head = next(n for n in graph.graph.node if n.name == "lm_head")
    gather = next(n for n in graph.graph.node if n.op_type == "GatherBlockQuantized")
    assert (head.input[1], gather.input[0]) == ("lm_head.qweight", "embed.qweight")
    codes = {t.name: t.raw_data for t in graph.graph.initializer}
    assert codes["lm_head.qweight"] == codes["embed.qweight"]


@pytest.mark.parametrize("kind", [QType.F16, QType.F32, QType.BF16], ids=lambda k: k.name)
def test_float_weights_are_quantized_to_4_bits_for_the_decode_graph(kind, tmp_path):
    types = dict.fromkeys(LAYERS, kind) | {"token_embd": QType.Q8_0}
    reader = open_gguf(write_tiny_llama(tmp_path / "float.gguf", types, DIMS, tied=True))
    spec = ModelSpec.from_gguf(reader, "float")
    quantized, dense = load_tensors(reader, spec, dense=False), load_tensors(reader, spec, dense=True)
    q = quantized.layers[0].qkv[0]
    assert (q.bits, q.block_size) == (4, 32)
    # min/max 4-bit blocks: error at most half a step of each block's scale
    step = np.repeat(q.scales, 32, axis=1)
    assert np.all(np.abs(q.dequantize() - dense.layers[0].qkv[0]) <= step / 2 + 1e-6)

"""The CUDA decode graph over edgedecode's own ops (model/graph_fused.py), checked where there is no GPU.

Structure: each layer is four FusedMatMulGGUF nodes around GroupQueryAttention, each reading its own matrices
(types and widths in its attributes), norm and residual; the head reads the tied table's own initializer; the
architectures FusedMatMulGGUF cannot express keep MatMulGGUF with the stock norms. Numbers: the graph as built,
run on onnxruntime's CPU provider with the CUDA ops' own glue and kernel sources under the host emulator
(emulated_cuda_ops.py), computes what the numpy reference computes to float16 rounding, over a prompt run and
single decode steps. And the runtime: the CUDA ops count as usable only with a CUDA driver and NVRTC, and a host
whose kernels cannot be prepared falls back to the stock ops, saying why once.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter

import numpy as np
import onnx
import pytest
from cuda_graph_cases import CASES, CUDA_OWN, FLOAT16_LOGITS_ATOL, IDS_COUNT, PROMPT_TOKENS, write_cases
from emulated_cuda_ops import build_library, decode, session
from synthetic_gguf import DIMS, MIXES

from edgedecode import kernels
from edgedecode.kernels import nvrtc
from edgedecode.model.graph import GraphOptions, build_graph
from edgedecode.model.graph_fused import unfused_reason
from edgedecode.model.reference import reference_forward
from edgedecode.model.spec import ModelSpec
from edgedecode.model.weights import load_tensors
from edgedecode.runtime import session as runtime_session

MASK_OPS = {"ReduceSum", "Sub", "Cast", "Shape", "Gather"}  # attention_mask -> GQA's lengths, and the selection
STOCK_GATE = {"Split", "Sigmoid", "Mul"}  # SiLU(gate) * up, where gate and up differ in type


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (reader, spec) of every case (cuda_graph_cases)."""
    cases = write_cases(tmp_path_factory.mktemp("cuda-graph"))
    return {name: (reader, spec) for name, (_, reader, spec) in cases.items()}


@pytest.fixture(scope="module")
def emulated_ops(tmp_path_factory):
    library = build_library(tmp_path_factory.mktemp("emulated-ops"))
    if library is None:
        pytest.skip("needs gcc and g++ to build the emulated CUDA ops")
    return library


def _stored(models, name):
    reader, spec = models[name]
    return spec, load_tensors(reader, spec, dense=False, as_stored=True)


def _graph(models, name) -> tuple[ModelSpec, object, onnx.GraphProto]:
    spec, tensors = _stored(models, name)
    return spec, tensors, build_graph(spec, tensors, CUDA_OWN).graph


def _attrs(node) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _check_reads(node, matrices, initializers, spec, norm=None, residual="", bias=None) -> None:
    """A FusedMatMulGGUF node reads ``matrices`` (their rows, types and widths), the float16 ``norm`` weight,
    the ``residual`` value and the float16 ``bias``, and nothing else."""
    attrs = _attrs(node)
    inputs = list(node.input) + [""] * (7 - len(node.input))
    assert attrs["K"] == matrices[0].shape[1] and attrs["epsilon"] == pytest.approx(spec.norm_eps)
    for s in range(3):
        if s < len(matrices):
            w = matrices[s]
            assert (attrs[f"N{s}"], attrs[f"ggml_type{s}"]) == (w.shape[0], int(w.kind)), (node.name, s)
            assert initializers[inputs[1 + s]].tobytes() == w.rows.tobytes(), (node.name, s)
        else:
            assert inputs[1 + s] == "" and f"N{s}" not in attrs
    widths = [w.shape[0] for w in matrices]
    assert attrs["N"] == (widths[0] if attrs["activation"] else sum(widths))
    for at, values in ((4, norm), (6, bias)):
        if values is None:
            assert inputs[at] == "", (node.name, at)
        else:
            np.testing.assert_array_equal(initializers[inputs[at]], np.asarray(values, np.float16))
    assert inputs[5] == residual, node.name


@pytest.mark.parametrize("name", list(MIXES))
def test_each_layer_is_four_fused_matmuls_around_attention(name, models):
    spec, tensors, graph = _graph(models, name)
    ops = Counter(n.op_type for n in graph.node)
    layers = spec.n_layers
    assert ops["FusedMatMulGGUF"] == 4 * layers + 1 and ops["GroupQueryAttention"] == layers
    assert ops["GatherGGUF"] == 1
    split_gates = sum(layer.gate_up[0].kind != layer.gate_up[1].kind for layer in tensors.layers)
    assert ops["Split"] == split_gates
    stock = STOCK_GATE if split_gates else set()
    assert set(ops) == {"FusedMatMulGGUF", "GroupQueryAttention", "GatherGGUF"} | MASK_OPS | stock


@pytest.mark.parametrize("name", list(MIXES))
def test_fused_nodes_read_their_weights_norms_and_residuals(name, models):
    """The residual stream runs embedding -> o -> down -> o -> ... -> head through the fused nodes' own outputs."""
    spec, tensors, graph = _graph(models, name)
    nodes = {n.name: n for n in graph.node}
    initializers = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    residual = nodes["embed"].output[0]
    for i, layer in enumerate(tensors.layers):
        qkv, attention, o = (nodes[f"layers.{i}.attn{part}"] for part in (".qkv", "", ".o"))
        _check_reads(qkv, layer.qkv, initializers, spec, norm=layer.attn_norm)
        assert qkv.input[0] == residual and attention.input[0] == qkv.output[0]
        _check_reads(o, [layer.o], initializers, spec, residual=residual)
        assert o.input[0] == attention.output[0]
        residual = o.output[0]
        gate_up, down = nodes[f"layers.{i}.mlp.gate_up"], nodes[f"layers.{i}.mlp.down"]
        _check_reads(gate_up, layer.gate_up, initializers, spec, norm=layer.ffn_norm)
        gated = layer.gate_up[0].kind == layer.gate_up[1].kind
        assert _attrs(gate_up)["activation"] == (1 if gated else 0) and gate_up.input[0] == residual
        _check_reads(down, [layer.down], initializers, spec, residual=residual)
        assert down.input[0] == (gate_up.output[0] if gated else nodes[f"layers.{i}.mlp.act"].output[0])
        residual = down.output[0]
    selected, head = nodes["select.residual"], nodes["lm_head"]
    table = tensors.embedding if tensors.lm_head is None else tensors.lm_head
    assert selected.input[:2] == [residual, "logits_positions"] and head.input[0] == selected.output[0]
    _check_reads(head, [table], initializers, spec, norm=tensors.output_norm)
    assert list(head.output) == ["logits"]
    if tensors.lm_head is None:  # tied: the embedding's very initializer, stored once
        assert head.input[1] == nodes["embed"].input[0] == "embed.rows"
        assert sum(t.name == "embed.rows" for t in graph.initializer) == 1


def test_qwen2s_bias_rides_in_the_fused_projection_and_qwen3s_qk_norm_precedes_attention(models):
    spec, tensors, graph = _graph(models, "qwen2")
    initializers = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    nodes = {n.name: n for n in graph.node}
    for i, layer in enumerate(tensors.layers):
        _check_reads(nodes[f"layers.{i}.attn.qkv"], layer.qkv, initializers, spec, layer.attn_norm, bias=layer.qkv_bias)
    assert not any(n.op_type == "Add" for n in graph.node)
    spec, _, graph = _graph(models, "qwen3")
    ops = Counter(n.op_type for n in graph.node)
    assert ops["FusedMatMulGGUF"] == 4 * spec.n_layers + 1
    assert ops["SimplifiedLayerNormalization"] == 2 * spec.n_layers  # per-head q and k norms, before GQA
    nodes = {n.name: n for n in graph.node}
    for i in range(spec.n_layers):
        name = f"layers.{i}.attn"
        assert nodes[f"{name}.split"].input[0] == nodes[f"{name}.qkv"].output[0]
        normed = [nodes[f"{name}.{x}_norm.merge"].output[0] for x in "qk"]
        assert list(nodes[name].input[:3]) == [*normed, nodes[f"{name}.split"].output[2]]


def test_gemma3_keeps_matmul_gguf_and_the_stock_norms(models):
    """Gemma 3's float32 residual stream and post-norms are what FusedMatMulGGUF cannot do: its CUDA graph reads
    every matrix with MatMulGGUF at accuracy level 0 (the CUDA op's only one) between the stock norms."""
    spec, tensors, graph = _graph(models, "gemma3")
    assert unfused_reason(spec, tensors)
    ops = Counter(n.op_type for n in graph.node)
    assert "FusedMatMulGGUF" not in ops and ops["SkipSimplifiedLayerNormalization"] == 2 * spec.n_layers
    matmuls = [n for n in graph.node if n.op_type == "MatMulGGUF"]
    assert len(matmuls) >= 4 * spec.n_layers and all(_attrs(n)["accuracy_level"] == 0 for n in matmuls)


@pytest.mark.parametrize(
    "change, says",
    [(dict(float16_residual=False), "float16"), (dict(post_norms=True), "residual add"), ({}, "")],
)
def test_each_trait_the_fused_op_cannot_express_is_named(change, says, models):
    spec, tensors = _stored(models, "qwen2")
    spec = dataclasses.replace(spec, traits=dataclasses.replace(spec.traits, **change))
    reason = unfused_reason(spec, tensors)
    assert (says in reason) if says else reason == ""


def test_a_matrix_outside_gguf_blocks_keeps_the_unfused_form(models):
    spec, tensors = _stored(models, "legacy")
    layer = tensors.layers[0]
    dense = dataclasses.replace(layer, o=layer.o.dequantize())
    assert "GGUF blocks" in unfused_reason(spec, dataclasses.replace(tensors, layers=[dense, *tensors.layers[1:]]))


def test_the_cpu_form_and_the_cuda_ops_accuracy_level(models):
    """The own ops' CPU graph keeps MatMulGGUF (no fused op on the CPU) at the asked accuracy level; the CUDA ops
    take float activations only, so the CUDA graph is built at level 0 whatever was asked."""
    spec, tensors = _stored(models, "legacy")
    cpu = GraphOptions.for_device("decode", "cpu", 4, kernels="gguf")
    assert cpu.accuracy_level == 4 and CUDA_OWN.accuracy_level == 0
    assert GraphOptions.for_device("decode", "cuda", 4).accuracy_level == 4  # the stock ops keep theirs
    assert not any(n.op_type == "FusedMatMulGGUF" for n in build_graph(spec, tensors, cpu).graph.node)


@pytest.mark.parametrize("name", CASES)
def test_the_cuda_graph_computes_the_reference_on_emulated_ops(name, models, emulated_ops):
    """Prompt rows (the M > 1 kernels) and single decode steps over the KV they wrote (the M = 1 kernels)."""
    spec, tensors = _stored(models, name)
    ids = np.random.default_rng(4).integers(0, DIMS.vocab, IDS_COUNT)
    graph = build_graph(spec, tensors, CUDA_OWN).SerializeToString()
    logits = decode(session(graph, emulated_ops), spec, ids, PROMPT_TOKENS)
    reference = reference_forward(spec, tensors, ids.tolist()).logits
    print(f"{name}: max |logit diff| vs numpy reference {np.abs(logits - reference).max():.4f}")
    np.testing.assert_allclose(logits, reference, atol=FLOAT16_LOGITS_ATOL)


def test_a_misread_norm_is_far_outside_the_tolerance(models, emulated_ops):
    """Guards the test above: the same graph with one layer's FFN norm weight doubled misses the reference."""
    spec, tensors = _stored(models, "legacy")
    model = build_graph(spec, tensors, CUDA_OWN)
    norm = next(t for t in model.graph.initializer if t.name == "layers.1.ffn_norm.weight")
    norm.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(norm) * np.float16(2), norm.name))
    ids = np.random.default_rng(4).integers(0, DIMS.vocab, IDS_COUNT)
    logits = decode(session(model.SerializeToString(), emulated_ops), spec, ids, PROMPT_TOKENS)
    miss = np.abs(logits - reference_forward(spec, tensors, ids.tolist()).logits).max()
    print(f"a doubled norm weight: max |logit diff| {miss:.3f}")
    assert miss > 5 * FLOAT16_LOGITS_ATOL


def test_cuda_ops_count_as_usable_only_with_a_driver_and_nvrtc():
    library = kernels.load()
    if not library.available:
        pytest.skip(library.reason)
    assert library.cuda == (library.cuda_reason == "")
    if library.cuda:
        assert nvrtc.find_nvrtc() is not None
    else:
        assert library.cuda_reason


def test_a_host_whose_kernels_cannot_be_prepared_decodes_with_the_stock_ops(monkeypatch, tmp_path, caplog):
    """The CUDA ops usable by the library's checks, but the kernels cannot be compiled for the card (here: no
    card, or NVRTC a file that is not NVRTC): the CUDA decode graph is the stock one, with the reason logged once."""
    library = kernels.load()
    if not library.available:
        pytest.skip(library.reason)
    monkeypatch.setattr(kernels, "load", lambda: dataclasses.replace(library, cuda=True, cuda_reason=""))
    monkeypatch.setenv("EDGEDECODE_NVRTC", str(tmp_path / "not-nvrtc.so"))
    monkeypatch.setenv(runtime_session.CUDA_KERNELS_OPT_IN, "on")
    monkeypatch.setenv("EDGEDECODE_HOME", str(tmp_path / "home"))
    runtime_session.kernel_form.cache_clear()
    runtime_session.cuda_kernels_problem.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=runtime_session.__name__):
            forms = [runtime_session.decode_options("cuda").kernels for _ in range(2)]
        assert forms == ["stock", "stock"]
        said = [r.getMessage() for r in caplog.records if "MatMulNBits" in r.getMessage()]
        assert len(said) == 1 and "could not be prepared" in said[0], said
    finally:
        runtime_session.kernel_form.cache_clear()
        runtime_session.cuda_kernels_problem.cache_clear()


def test_the_own_cuda_ops_are_opt_in(monkeypatch, caplog):
    """With CUDA ops the library could run, the CUDA decode graph is the stock one unless
    $EDGEDECODE_CUDA_KERNELS asks for them, said once in the log."""
    library = kernels.load()
    if not library.available:
        pytest.skip(library.reason)
    monkeypatch.setattr(kernels, "load", lambda: dataclasses.replace(library, cuda=True, cuda_reason=""))
    monkeypatch.delenv(runtime_session.CUDA_KERNELS_OPT_IN, raising=False)
    runtime_session.kernel_form.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=runtime_session.__name__):
            forms = [runtime_session.decode_options("cuda").kernels for _ in range(2)]
        assert forms == ["stock", "stock"]
        said = [r.getMessage() for r in caplog.records if "MatMulNBits" in r.getMessage()]
        assert len(said) == 1 and runtime_session.CUDA_KERNELS_OPT_IN in said[0], said
    finally:
        runtime_session.kernel_form.cache_clear()

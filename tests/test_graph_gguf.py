"""The decode graph's "gguf" kernel form: edgedecode's own MatMulGGUF / GatherGGUF over the GGUF's blocks as stored.

Structure (no kernel library needed): every quantized matrix of every type reaches its op byte for byte,
float matrices keep the stock form, a tied head reads the embedding's very initializer, and the graph
carries no correction or zero-point nodes. Numbers (with the library): each mix of types computes what
the numpy reference computes on the same weights, exactly at accuracy level 0 and within what int8
activations cost at level 4.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from graph_helpers import run_graph
from synthetic_gguf import DIMS, MIXES, write_mixes

from edgedecode import kernels
from edgedecode.model.graph import GraphOptions, GraphOptionsError, build_graph
from edgedecode.model.reference import reference_forward
from edgedecode.model.tensor_types import BLOCK_TYPES
from edgedecode.model.weights import load_tensors, unpermute_rows
from edgedecode.runtime.session import decode_options

GGUF = GraphOptions("decode", "float32", 0, kernels="gguf")
needs_kernels = pytest.mark.skipif(
    not kernels.load().available, reason=f"edgedecode's kernel library is not usable: {kernels.load().reason}"
)


@pytest.fixture(scope="module")
def mixes(tmp_path_factory):
    return write_mixes(tmp_path_factory.mktemp("mixes"))


def _stored(reader, spec):
    return load_tensors(reader, spec, dense=False, as_stored=True)


def _file_rows(reader, spec, name: str) -> np.ndarray:
    """A tensor's rows as the file stores them, in the graphs' (un-permuted) row order."""
    tensor = next(t for t in reader.tensors if t.name == name)
    rows = np.asarray(tensor.data, np.uint8).reshape(int(tensor.shape[-1]), -1)
    heads = {"attn_q": spec.n_heads, "attn_k": spec.n_kv_heads}.get(name.split(".")[-2])
    return rows[unpermute_rows(len(rows), heads)] if heads and spec.traits.qk_rows_permuted else rows


@pytest.mark.parametrize("name", list(MIXES))
def test_every_quantized_matrix_reaches_its_op_byte_for_byte(name, mixes):
    """Each block-typed tensor's rows are a slice of the initializer its MatMulGGUF/GatherGGUF reads (fused
    q/k/v and gate/up stacked in order) and the op names the file's type; float matrices become Q4_1 blocks
    (float tables Q8_0), so no stock op reads a weight."""
    reader, spec = mixes[name]
    graph = build_graph(spec, _stored(reader, spec), GGUF).graph
    data = {t.name: np.frombuffer(t.raw_data, np.uint8) for t in graph.initializer}
    by_type: dict[int, list[bytes]] = {}
    for node in graph.node:
        if node.op_type in ("MatMulGGUF", "GatherGGUF"):
            kind = next(a.i for a in node.attribute if a.name == "ggml_type")
            rows = node.input[1] if node.op_type == "MatMulGGUF" else node.input[0]
            by_type.setdefault(kind, []).append(data[rows].tobytes())
    for tensor in reader.tensors:
        kind = QType(tensor.tensor_type)
        if kind not in BLOCK_TYPES or len(tensor.shape) != 2:
            continue
        rows = _file_rows(reader, spec, tensor.name).tobytes()
        assert any(rows in stored for stored in by_type.get(int(kind), [])), f"{tensor.name} ({kind.name})"
    float_matrices = [t for t, kind in MIXES[name].items() if t != "token_embd" and kind not in BLOCK_TYPES]
    assert (int(QType.Q4_1) in by_type) == (bool(float_matrices) or QType.Q4_1 in MIXES[name].values())
    assert not any(n.op_type in ("MatMulNBits", "GatherBlockQuantized", "MatMul", "Gemm") for n in graph.node)
    assert not any(n.name.endswith((".correction", ".corrected")) for n in graph.node)
    assert not any(i.name.endswith(".zero_points") for i in graph.initializer)


@pytest.mark.parametrize("name", [n for n, types in MIXES.items() if "output" not in types])
def test_a_tied_head_reads_the_embedding_rows_themselves(name, mixes):
    """One initializer for the table and the head: onnxruntime maps it once, and nothing prepacks it."""
    reader, spec = mixes[name]
    graph = build_graph(spec, _stored(reader, spec), GGUF).graph
    head = next(n for n in graph.node if n.name == "lm_head")
    gather = next(n for n in graph.node if n.op_type == "GatherGGUF")
    assert head.op_type == "MatMulGGUF" and head.input[1] == gather.input[0] == "embed.rows"
    assert sum(i.name == "embed.rows" for i in graph.initializer) == 1


def test_the_kernel_form_is_for_the_decode_graph_only():
    with pytest.raises(GraphOptionsError, match="decode graph only"):
        GraphOptions("prefill", kernels="gguf")
    with pytest.raises(GraphOptionsError, match="kernels must be one of"):
        GraphOptions(kernels="mlas")


def test_the_shipped_decode_graph_uses_the_own_kernels_exactly_where_the_library_loads(monkeypatch):
    """decode_options is what the daemon, chat and generate build: "gguf" with a usable library, "stock"
    when it is missing or turned off (EDGEDECODE_KERNELS=off)."""
    expected = "gguf" if kernels.load().available else "stock"
    assert decode_options("cpu").kernels == expected


@needs_kernels
@pytest.mark.parametrize("name", list(MIXES))
def test_every_mix_matches_the_reference_exactly_at_accuracy_level_0(name, mixes):
    reader, spec = mixes[name]
    tensors = _stored(reader, spec)
    ids = np.random.default_rng(1).integers(0, DIMS.vocab, 19)
    logits = run_graph(spec, tensors, GGUF, ids)
    reference = reference_forward(spec, tensors, ids.tolist())
    print(f"{name}: max |logit diff| vs numpy reference {np.abs(logits - reference.logits).max():.2e}")
    np.testing.assert_allclose(logits, reference.logits, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("name", list(MIXES))
def test_int8_activations_cost_what_onnxruntimes_int8_activations_cost(name, mixes):
    """At accuracy level 4 both forms quantize activations to int8 blocks: the own ops per 32 elements, and
    per 256 for the K-quants (llama.cpp's Q8_0 / Q8_K rule), MatMulNBits per weight block (16 or 32). So
    the own ops' logits stay within the same order of the reference as MatMulNBits' (3x: coarser K-quant
    activation scales; measured ≤ 2.1x on these mixes), and far from what a wrong kernel would give."""
    reader, spec = mixes[name]
    stock = load_tensors(reader, spec, dense=False)
    ids = np.random.default_rng(2).integers(0, DIMS.vocab, 19)
    reference = reference_forward(spec, stock, ids.tolist()).logits
    ours = run_graph(spec, _stored(reader, spec), GraphOptions("decode", "float32", 4, kernels="gguf"), ids)
    theirs = run_graph(spec, stock, GraphOptions("decode", "float32", 4), ids)
    ours_err, theirs_err = np.abs(ours - reference).max(), np.abs(theirs - reference).max()
    print(f"{name}: max |logit diff| at level 4: own ops {ours_err:.2e}, MatMulNBits {theirs_err:.2e}")
    assert ours_err <= 3 * theirs_err

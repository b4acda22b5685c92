"""tools/bench/cuda_ops.py builds the forms it times as they are meant: onnxruntime's MatMulNBits forms run (on the
CPU here) and give each role's output widths; the fused op's nodes carry consistent attributes. The timing itself
needs the card."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

ort = pytest.importorskip("onnxruntime")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))
bench = importlib.import_module("cuda_ops")
sys.path.pop(0)
ROLES = ("qkv", "o", "gate_up", "down")  # the head's 136M weights would only slow this down


@pytest.mark.parametrize("file_type", ("Q4_0", "Q4_1", "Q4_K_M"))
@pytest.mark.parametrize("role", ROLES)
def test_onnxruntime_forms_run_with_the_roles_widths(role, file_type):
    for form in (f for f in bench.forms_for(file_type, role, "0.5b") if f.startswith("ort")):
        model, inputs, outputs = bench.build(form, role, "0.5b", file_type, 2, np.random.default_rng(0))
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        feeds = {name: np.full(shape, 0.01, np.float16) for name, shape in inputs.items()}
        assert [list(y.shape) for y in session.run(None, feeds)] == list(outputs.values()), form


def test_offsets_get_both_onnxruntime_forms_and_plain_types_one():
    assert bench.forms_for("Q4_1", "o", "1b") == [
        "ours_fused", "ours_matmul", "ort_matmul_correction", "ort_matmul_zero_point", "ort_role_correction",
        "ort_role_zero_point",
    ]  # fmt: skip
    assert bench.forms_for("Q4_0", "o", "1b") == ["ours_fused", "ours_matmul", "ort_matmul", "ort_role"]
    assert bench.role_types("Q4_K_M", "qkv", 896) == [6, 6, 8]  # K-quants fall back where K % 256 != 0


@pytest.mark.parametrize("role", ROLES)
def test_fused_nodes_declare_what_their_weights_hold(role):
    model, _, outputs = bench.build("ours_fused", role, "1b", "Q4_K_M", 1, np.random.default_rng(0))
    graph = onnx.load_model_from_string(model).graph
    (node,) = graph.node
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    sizes = {init.name: init.dims for init in graph.initializer}
    weights = [name for name in node.input[1:4] if name]
    assert [sizes[w][0] for w in weights] == [attrs[f"N{s}"] for s in range(len(weights))]
    assert list(outputs.values()) == [[1, 1, attrs["N"]]]
    assert bool(node.input[4] if len(node.input) > 4 else "") == (role in ("qkv", "gate_up"))

"""onnxruntime install checks, execution-provider errors and the graph build cache."""

from __future__ import annotations

import importlib.metadata

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgedecode.model import loader
from edgedecode.model.graph import GraphOptions, GraphOptionsError
from edgedecode.model.loader import graph_key
from edgedecode.runtime import session
from edgedecode.runtime.session import (
    RuntimeSetupError,
    available_devices,
    create_session,
)


def test_cpu_and_gpu_builds_installed_together_are_refused(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: "1.31.1")
    with pytest.raises(RuntimeSetupError, match="both onnxruntime and onnxruntime-gpu"):
        session.import_onnxruntime()


def test_exactly_one_build_is_installed_here():
    assert len(session.installed_onnxruntime()) == 1


@pytest.mark.skipif("cuda" in available_devices(), reason="this host has CUDA")
def test_cuda_without_the_provider_is_a_clear_error(smollm2_model):
    path = smollm2_model.graph(GraphOptions("decode", "float32", 4))
    with pytest.raises(RuntimeSetupError, match="CUDAExecutionProvider is not available"):
        create_session(path, device="cuda")


def test_unknown_device_is_refused(smollm2_model):
    with pytest.raises(RuntimeSetupError, match="unknown device 'tpu'"):
        create_session(smollm2_model.graph(GraphOptions()), device="tpu")


def test_graph_key_depends_on_weights_options_and_builder(monkeypatch):
    base = graph_key("a" * 64, GraphOptions("decode", "float32", 4))
    assert base != graph_key("b" * 64, GraphOptions("decode", "float32", 4))
    assert base != graph_key("a" * 64, GraphOptions("decode", "float32", 0))
    assert base != graph_key("a" * 64, GraphOptions("decode", "float16", 4))
    assert base != graph_key("a" * 64, GraphOptions("prefill", "float32", 4))
    monkeypatch.setattr("edgedecode.model.loader.BUILDER_VERSION", -1)
    assert base != graph_key("a" * 64, GraphOptions("decode", "float32", 4))


def test_a_built_graph_is_reused_not_rebuilt(smollm2_model):
    options = GraphOptions("decode", "float32", 4)
    path = smollm2_model.graph(options)
    before = path.stat().st_mtime_ns
    assert smollm2_model.graph(options) == path
    assert path.stat().st_mtime_ns == before
    assert path.name.startswith("decode-float32-acc4-")


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(kind="encode"), "graph kind"), (dict(dtype="int8"), "dtype"), (dict(accuracy_level=7), "accuracy_level")],
)
def test_invalid_graph_options_are_refused(kwargs, message):
    with pytest.raises(GraphOptionsError, match=message):
        GraphOptions(**kwargs)


@pytest.mark.parametrize(("setting", "expected"), [(None, "1"), ("0", "0"), ("1", "1")])
def test_thread_spinning_follows_edgedecode_spin(smollm2_model, monkeypatch, setting, expected):
    if setting is None:
        monkeypatch.delenv("EDGEDECODE_SPIN", raising=False)
    else:
        monkeypatch.setenv("EDGEDECODE_SPIN", setting)
    path = smollm2_model.graph(GraphOptions.for_device("decode", "cpu"))
    options = create_session(path, threads=1).get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == expected


def test_a_built_graph_keeps_its_initializers_in_a_side_file(smollm2_model):
    """onnxruntime maps the side file instead of copying the weights to the heap; protobuf would refuse
    a 3B-class graph in one message anyway."""
    path = smollm2_model.graph(GraphOptions("decode", "float32", 4))
    side = loader.side_file(path)
    assert side.stat().st_size > 50 * path.stat().st_size
    assert loader.graph_bytes(path) == path.stat().st_size + side.stat().st_size


def test_equal_initializers_are_stored_once_and_a_rebuild_replaces_the_files_whole(tmp_path):
    """A tied LM head's codes and the embedding's: one copy in the side file, two initializers to onnxruntime."""
    rng = np.random.default_rng(0)
    table, other = rng.standard_normal((2, 64, 64)).astype(np.float32)
    nodes = [helper.make_node("Add", ["a", "b"], ["ab"]), helper.make_node("Add", ["ab", "c"], ["y"])]
    tensors = [numpy_helper.from_array(x, name) for x, name in ((table, "a"), (table, "b"), (other, "c"))]
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 64])
    opsets = [helper.make_opsetid("", 17)]
    body = helper.make_graph(nodes, "tied", [], [output], tensors)
    model = helper.make_model(body, ir_version=8, opset_imports=opsets)
    graph = tmp_path / "tied.onnx"
    loader.write_graph(model, graph, loader.side_file(graph))

    saved = onnx.load(graph, load_external_data=False)
    stored = {t.name: {e.key: e.value for e in t.external_data} for t in saved.graph.initializer}
    assert stored["a"] == stored["b"] != stored["c"]
    assert int(stored["c"]["offset"]) % loader.SIDE_FILE_ALIGNMENT == 0
    assert loader.side_file(graph).stat().st_size == int(stored["c"]["offset"]) + other.nbytes
    session = create_session(graph, threads=1)  # maps the side file
    (y,) = session.run(None, {})
    np.testing.assert_array_equal(y, table + table + other)
    # another process building the same graph meanwhile: a new file renamed into place (never the mapped one
    # rewritten, which truncates it under the mapping: SIGBUS), the mapping intact
    mapped = loader.side_file(graph).stat().st_ino
    loader.write_graph(model, graph, loader.side_file(graph))
    assert loader.side_file(graph).stat().st_ino != mapped
    np.testing.assert_array_equal(session.run(None, {})[0], y)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tied.onnx", "tied.onnx.data"]

"""tools/bench/step_bytes.py (issue 17): the bytes a decode step reads, counted from the built graph and the GGUF."""

from __future__ import annotations

import pytest
from gguf import GGUFReader
from tool_modules import import_tools

from edgedecode.model.fetch import register_gguf
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import load_model


@pytest.fixture(scope="module")
def tools():
    return import_tools("bench.step_bytes", "bench.synth_gguf")


def test_a_decode_step_reads_every_weight_once_and_no_table_in_full(tools, smollm2_gguf, tmp_path, monkeypatch):
    """Q4_0 layers read 4-bit codes plus a float32 scale per 32; the tied Q8_0 head, 8-bit codes plus the
    same; the norms float32; RoPE caches and the embedding's gather are one row, not counted."""
    bench_bytes, synth_gguf = tools
    monkeypatch.setenv("EDGEDECODE_HOME", str(tmp_path / "home"))
    shape = synth_gguf.SHAPES["tiny"]
    path = tmp_path / "tiny.gguf"
    synth_gguf.write_synthetic(path, shape, "Q4_0", smollm2_gguf)
    model = load_model(register_gguf(path, "tiny-q4-0").name)
    options = GraphOptions.for_device("decode", "cpu")
    layer_weights = sum(n * k for n, k in synth_gguf.matrix_shapes(shape).values()) - shape.vocab * shape.hidden
    head = shape.vocab * shape.hidden
    norms = (2 * shape.layers + 1) * shape.hidden * 4
    expected = layer_weights * (4 + 32 / 32) // 8 + head * (8 + 32 / 32) // 8 + norms
    counted = bench_bytes.graph_weight_bytes(model.graph(options))
    assert expected <= counted <= expected + 1024  # plus a few int64 shape constants
    assert bench_bytes.gguf_weight_bytes(path) == sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
    assert bench_bytes.kv_bytes_per_token(model.spec, 4) == 2 * shape.layers * shape.kv_heads * shape.head_dim * 4

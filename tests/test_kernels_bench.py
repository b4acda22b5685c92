"""tools/bench/matmul_gguf.py: the cases it times are the presets' real types, and its two forms compute the same
product (so the times it prints compare like with like). No timing is asserted."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from edgedecode import kernels

BENCH = Path(__file__).resolve().parent.parent / "tools" / "bench" / "matmul_gguf.py"
pytestmark = pytest.mark.skipif(not kernels.load().available, reason=f"kernels unusable: {kernels.load().reason}")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("matmul_gguf", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_the_cases_are_the_types_each_preset_file_holds(bench):
    small = {(c.matrix, c.kind) for c in bench.cases("qwen2.5-0.5b", "Q4_K_M", ("gate_up", "down", "lm_head"))}
    # 896-wide rows are not whole super-blocks: Q4_K falls back to Q5_0, the head to Q8_0; down (4864) stays K
    assert small == {("gate_up", "Q5_0"), ("down", "Q4_K"), ("down", "Q6_K"), ("lm_head", "Q8_0")}
    assert {c.kind for c in bench.cases("llama3.2-1b", "Q4_K_M", ("lm_head",))} == {"Q6_K"}
    assert {c.kind for c in bench.cases("llama3.2-3b", "Q4_1", bench.MATRICES)} == {"Q4_1", "Q8_0"}


@pytest.mark.parametrize("kind", [QType.Q4_1, QType.Q5_0, QType.Q6_K], ids=lambda t: t.name)
def test_both_forms_compute_the_same_product(bench, kind):
    """At accuracy level 0 the GGUF op and MatMulNBits plus the correction are both exact up to float32 rounding."""
    from types import SimpleNamespace

    from edgedecode.model.weights import load_block_quantized

    case = bench.Case("test", "o", kind.name, 48, 512)
    rng = np.random.default_rng(3)
    rows = bench.random_rows(kind, case.n, case.k, rng)
    weights = load_block_quantized(SimpleNamespace(tensor_type=int(kind), data=rows))
    feed = {"A": rng.standard_normal((1, 3, case.k)).astype(np.float32)}
    ours = bench.session(bench.gguf_graph(rows, case, 2, 0), 1).run(None, feed)
    theirs = bench.session(bench.nbits_graph(weights, case, 2, 0), 1).run(None, feed)
    assert len(ours) == len(theirs) == 2
    assert ours[0].shape == theirs[0].shape == (1, 3, case.n)
    # the first copies are the same weight in both forms (the second differs by one byte, each its own way)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-4, atol=1e-4 * float(np.abs(theirs[0]).max()))
    assert not np.array_equal(ours[0], ours[1])  # distinct copies, so none is shared or cached

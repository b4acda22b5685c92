"""tools/bench/attention.py: its three variants compute the same attention over the same cache values (so the
times it prints compare like with like), and it counts the bytes a node reads. No timing is asserted."""

from __future__ import annotations

import numpy as np
import pytest
from tool_modules import import_tools

from edgedecode import kernels

pytestmark = pytest.mark.skipif(not kernels.load().available, reason=f"kernels unusable: {kernels.load().reason}")
(bench,) = import_tools("bench.attention")


def test_bytes_read_are_the_keys_and_values_of_the_past_and_the_new_token():
    geometry = bench.Geometry.of("smollm2-135m")
    assert geometry == bench.Geometry(9, 3, 64)
    assert bench.cache_bytes(geometry, 2047, 2) == 2 * 3 * 2048 * 64 * 2
    assert bench.Geometry.of("llama3.2-3b") == bench.Geometry(24, 8, 128)


@pytest.mark.parametrize("past", [5, 300])
def test_the_variants_compute_the_same_attention(past):
    """Each variant's caches hold the same random values (float16-rounded where the cache is float16) and the
    nodes get the same query, so their outputs agree to float16 rounding, copy by copy."""
    geometry = bench.Geometry(8, 2, 64)
    outputs = {}
    for variant in bench.VARIANTS:
        run = bench.Bench(variant, geometry, past, copies=3, threads=2)
        run.run()
        outputs[variant] = run.outputs.astype(np.float32)
    np.testing.assert_allclose(outputs["op-f16"], outputs["gqa-f32"], atol=0.01)
    np.testing.assert_allclose(outputs["gqa-f16"], outputs["gqa-f32"], atol=0.02)

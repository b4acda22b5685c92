"""tools/bench/decode.py and tools/bench/shapes.py on CUDA (issue 17 item 3): which engines run, the
memory each is charged with, and the table's cells. The GPU paths themselves run on a CUDA card only."""

from __future__ import annotations

import argparse
import shutil

import pytest
from tool_modules import import_tools

from edgedecode.runtime.session import decode_options


@pytest.fixture(scope="module")
def tools():
    return import_tools("bench.decode", "bench.shapes", "bench.cuda")


def options(**overrides) -> argparse.Namespace:
    return argparse.Namespace(
        **{"device": "cuda", "no_llama": False, "no_extras": False, "no_stock": False, **overrides}
    )


def test_llama_cpp_joins_the_cuda_run_only_when_built_with_gpu_offload(tools):
    bench_decode, _, _ = tools
    llama_cpp = pytest.importorskip("llama_cpp")
    offload = llama_cpp.llama_supports_gpu_offload()
    own_cpu = decode_options("cpu").kernels == "gguf"  # then the stock ops run beside, as "before"
    assert bench_decode.engine_names(options(device="cpu")) == ["edgedecode"] + ["edgedecode-stock"] * own_cpu + [
        "llama.cpp"
    ]
    assert bench_decode.engine_names(options(device="cpu", no_stock=True)) == ["edgedecode", "llama.cpp"]
    own_cuda = decode_options("cuda").kernels == "gguf"
    assert bench_decode.engine_names(options()) == ["edgedecode"] + ["edgedecode-stock"] * own_cuda + [
        "llama.cpp"
    ] * offload + ["edgedecode-no-graph"]
    assert bench_decode.engine_names(options(no_extras=True, no_llama=True)) == ["edgedecode"]


def test_gpu_memory_is_none_without_nvidia_smi_and_a_number_with_it(tools):
    _, _, bench_cuda = tools
    used = bench_cuda.gpu_memory_used_mib()
    if shutil.which("nvidia-smi") is None:
        assert used is None
    else:
        assert used is not None and used > 0


def result(device: str, memory: float | None, fraction: float | None) -> dict:
    """One bench_decode.py result of the shape it writes (two engines, one past length)."""
    row = {"prefill_tok_s": 1000.0, "decode_tok_s": 600.0, "bytes_per_token": 100e6}
    if fraction is not None:
        row["bandwidth_fraction"] = fraction
    theirs = {**row, "decode_tok_s": 400.0, "prefill_tok_s": 2000.0}
    key, share = (
        ("gpu_memory_mib", "gpu_memory_over_weights_and_kv")
        if device == "cuda"
        else ("peak_rss_mib", "rss_over_weights_and_kv")
    )
    engine = {key: memory, **({} if memory is None else {share: 2.0})}
    return {
        "shape": "qwen2.5-0.5b",
        "type": "Q4_0",
        "device": device,
        "engines": {"edgedecode": {**engine, "past": {"16": row}}, "llama.cpp": {**engine, "past": {"16": theirs}}},
    }


def test_the_cuda_table_charges_gpu_memory_and_keeps_rows_without_a_bandwidth_figure(tools):
    _, bench_shapes, _ = tools
    header, _, row = bench_shapes.table_rows([result("cuda", 900.0, None)])
    assert "GPU memory MiB" in header
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3:10] == ["600.0", "400.0", "**1.50×**", "100", "100", "0.50×", "900 (2.00×) / 900 (2.00×)"]


def test_the_cpu_table_keeps_peak_rss_and_the_bound(tools):
    _, bench_shapes, _ = tools
    header, _, row = bench_shapes.table_rows([result("cpu", None, 0.25)])
    assert "peak RSS MiB" in header
    assert "| 100 (25%) | 100 (25%) |" in row and row.endswith("| n/a / n/a |")


def test_a_failed_file_is_a_row_of_its_own(tools):
    _, bench_shapes, _ = tools
    rows = bench_shapes.table_rows([{"shape": "llama3.2-3b", "type": "Q4_K_M", "exit_status": 1}])
    assert rows[2] == "| llama3.2-3b | Q4_K_M | – | failed (exit 1) |"

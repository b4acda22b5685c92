"""Model sizes for the fleet simulation: what a replica and an edge box spend on one model, from measurements.

Each ``ModelSize`` says where its figures come from (``source``). SmolLM2-135M (``135m``, the default model) is
the real model: its replica service times are the prefill server's measured ``server_ms``
(``tools/bench/serve.py --prefill-device cuda`` on an H100, with the device encoder), its edge box's local prefill
the CPU benchmark's local-prefill TTFTs on the 2-core VM, its quality costs its own calibration. The 1B and 3B rows
are the synthetic GGUF shapes of Llama-3.2-1B and -3B (``tools/bench/synth_gguf.py``: the real tensor shapes,
random weights), measured for speed only:

* **replica**: the 135M server's measured time less its bare float16 prefill (the scoring, the EDKV encoding and
  the rest, which grow with the KV bytes: scaled by the shape's FP16 KV bytes per token) plus the shape's prompt at
  its measured prefill throughput on an H200 (onnxruntime's stock INT4 graph, Q4_0: the fastest type measured
  there, a stand-in for the float16 prefill graph, which was not measured at these sizes; an H100 has the same
  compute, which a prompt's prefill is bound by);
* **edge box**: the own kernels' prompt and decode throughput on 2 pinned Xeon cores (Q4_K_M, the file people
  download), at 16 and 512 prompt tokens (longer prompts at the 512-token rate);
* **quality**: the generic calibration (the worst measured model's costs), as the daemon plans for a model it has no
  calibration of.

``8b`` (Llama-3.1-8B's shape) is **on paper**: its KV bytes from the shape, every speed the 3B shape's scaled by
the parameter ratio (prefill) or the Q4_K_M file-size ratio (decode). Nothing of it was run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path

import numpy as np

from edgedecode.daemon.pull.calibration import ModelCalibration, generic, shipped
from edgedecode.daemon.pull.local_speed import LocalPrefillModel
from edgedecode.model.registry import DEFAULT_MODEL
from tools.common.cli import ROOT

BENCH_DIR = ROOT / "docs/bench"
SERVE_BENCH = BENCH_DIR / "serve-h100-edge2cpu-2026-12-07.json"  # the 135M prefill server on an H100, 16 threads
LOCAL_BENCH = BENCH_DIR / "serve-cpu-vm-2026-11-26.json"  # the 135M model's local prefill on the 2-core VM
BARE_PREFILL_BENCH = BENCH_DIR / "prefill-stages-cuda-h100-2026-12-07.json"  # the 135M float16 prefill alone, H100
GPU_SHAPES_BENCH = BENCH_DIR / "cuda-shapes-h200-own-2026-11-27.json"  # the shapes on an H200
CPU_SHAPES_BENCH = {
    "llama3.2-1b": BENCH_DIR / "cpu-shapes-xeon-2pinned-own-2026-11-27.json",
    "llama3.2-3b": BENCH_DIR / "cpu-shapes-3b-xeon-2pinned-own-2026-11-27.json",
}
SMOLLM2_KV_BYTES = 23040  # 30 layers x 3 KV heads x 64 x (K, V) x 2 bytes
SMOLLM2_DECODE_TOK_S = 40.0  # the 2-core edge box's decode speed (docs/serving.md's report: 43)
REPLICA_TYPE, EDGE_TYPE = "Q4_0", "Q4_K_M"
LLAMA3_8B_KV_BYTES = 32 * 8 * 128 * 2 * 2  # 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes
PARAMS_3B_OVER_8B = 3.21 / 8.03  # Llama-3.2-3B's parameters over Llama-3.1-8B's
Q4KM_BYTES_3B_OVER_8B = 2.02 / 4.92  # their Q4_K_M files, GB: a decode step reads the whole file


@dataclass(frozen=True)
class ModelSize:
    """One model as the simulation sees it: its KV bytes, the replica's service times and the edge box's speeds."""

    name: str
    kv_bytes_per_token: int  # FP16 K and V of every layer
    replica_prefill: tuple[tuple[int, float], ...]  # (prompt tokens, tokens/s) on the prefill node's GPU
    edge_prefill: tuple[tuple[int, float], ...]  # (prompt tokens, tokens/s) on the 2-core edge box
    edge_decode_tok_s: float
    calibrated: bool  # the default model's own quality costs; else the generic ones
    source: str

    @property
    def kv_ratio(self) -> float:
        """KV bytes per token over the 135M model's (what its scoring and encoding times scale by)."""
        return self.kv_bytes_per_token / SMOLLM2_KV_BYTES

    @cached_property
    def calibration(self) -> ModelCalibration:
        """The quality costs the daemon plans this model with."""
        calibrations = shipped()
        return calibrations[DEFAULT_MODEL] if self.calibrated else generic(calibrations.values())

    def local_model(self) -> LocalPrefillModel:
        """The edge box's local prefill time: the measured 135M TTFTs, or tokens at the measured rates (the
        model goes on past the longest at no less than its time per token)."""
        if self.name == "135m":
            rows = _bench(LOCAL_BENCH)["results"]["local prefill"]
            return LocalPrefillModel([(int(n), row["ttft_ms"] / 1e3) for n, row in rows.items()])
        return LocalPrefillModel([(n, n / tok_s) for n, tok_s in self.edge_prefill])

    def replica_seconds(self, points: dict[float, list[tuple[int, float]]]) -> dict[float, list[tuple[int, float]]]:
        """The 135M server's measured (tokens, seconds) per budget as this model's: the rest of the request scaled
        by the KV bytes, the bare prefill at this model's rate."""
        if self.name == "135m":
            return points
        return {
            budget: [
                (n, max(seconds - smollm2_bare_prefill_s(n), 0.0) * self.kv_ratio + n / self.replica_rate(n))
                for n, seconds in rows
            ]
            for budget, rows in points.items()
        }

    def replica_rate(self, tokens: int) -> float:
        """Prefill tokens/s on the replica for a prompt of ``tokens`` (the measured rates interpolated)."""
        lengths, rates = zip(*self.replica_prefill)
        return float(np.interp(tokens, lengths, rates))


@cache
def _bench(path: Path) -> dict:
    """A benchmark's raw JSON, read once."""
    return json.loads(path.read_text())


def smollm2_bare_prefill_s(tokens: int) -> float:
    """The 135M model's float16 prefill alone on the H100, interpolated from its measured prompts (0 at 0)."""
    cells = _bench(BARE_PREFILL_BENCH)["cells"]
    measured = sorted((cell["tokens"], cell["bare_prefill_wall_s"]) for cell in cells)
    lengths, seconds = zip(*[(0, 0.0), *measured])
    return float(np.interp(tokens, lengths, seconds))


def _engine_rows(path: Path, shape: str, kind: str, engine: str) -> dict[int, dict]:
    """The ``past`` rows (prompt length -> figures) of one shape, GGUF type and engine in a shapes benchmark."""
    for row in _bench(path)["results"]:
        if row["shape"] == shape and row["type"] == kind:
            return {int(n): figures for n, figures in row["engines"][engine]["past"].items()}
    raise LookupError(f"{path.name} has no {shape} {kind} row")


def measured_shape(name: str, shape: str) -> ModelSize:
    """A synthetic shape's size from the GPU and CPU shape benchmarks."""
    replica = _engine_rows(GPU_SHAPES_BENCH, shape, REPLICA_TYPE, "edgedecode-stock")
    edge = _engine_rows(CPU_SHAPES_BENCH[shape], shape, EDGE_TYPE, "edgedecode")
    rows = _bench(GPU_SHAPES_BENCH)["results"]
    kv_bytes = next(row for row in rows if row["shape"] == shape)["engines"]["edgedecode"]["kv_bytes_per_past_token"]
    return ModelSize(
        name=name,
        kv_bytes_per_token=int(kv_bytes),
        replica_prefill=tuple((n, row["prefill_tok_s"]) for n, row in sorted(replica.items()) if n >= 512),
        edge_prefill=tuple((n, row["prefill_tok_s"]) for n, row in sorted(edge.items())),
        edge_decode_tok_s=float(edge[max(edge)]["decode_tok_s"]),
        calibrated=False,
        source=(
            f"{shape} synthetic shape: replica {REPLICA_TYPE} prompt rate on an H200 ({GPU_SHAPES_BENCH.name}), "
            f"edge {EDGE_TYPE} on 2 Xeon cores ({CPU_SHAPES_BENCH[shape].name}), generic quality costs"
        ),
    )


def on_paper_8b(three_b: ModelSize) -> ModelSize:
    """Llama-3.1-8B's shape, extrapolated from the 3B shape (nothing of it measured)."""
    return ModelSize(
        name="8b",
        kv_bytes_per_token=LLAMA3_8B_KV_BYTES,
        replica_prefill=tuple((n, rate * PARAMS_3B_OVER_8B) for n, rate in three_b.replica_prefill),
        edge_prefill=tuple((n, rate * PARAMS_3B_OVER_8B) for n, rate in three_b.edge_prefill),
        edge_decode_tok_s=three_b.edge_decode_tok_s * Q4KM_BYTES_3B_OVER_8B,
        calibrated=False,
        source="on paper: Llama-3.1-8B's KV shape; speeds the 3B shape's scaled by parameters (prefill) and "
        "Q4_K_M file size (decode); generic quality costs",
    )


def sizes() -> dict[str, ModelSize]:
    """Every size the simulation knows, by name."""
    one_b = measured_shape("1b", "llama3.2-1b")
    three_b = measured_shape("3b", "llama3.2-3b")
    smollm2 = ModelSize(
        name="135m",
        kv_bytes_per_token=SMOLLM2_KV_BYTES,
        replica_prefill=(),
        edge_prefill=(),
        edge_decode_tok_s=SMOLLM2_DECODE_TOK_S,
        calibrated=True,
        source=f"SmolLM2-135M, the real model: replica {SERVE_BENCH.name}, edge {LOCAL_BENCH.name}, its calibration",
    )
    return {size.name: size for size in (smollm2, one_b, three_b, on_paper_8b(three_b))}

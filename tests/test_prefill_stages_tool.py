"""tools/bench/prefill_stages.py on a synthetic prefill: one budget's cell per path, its stages, the byte check
between the paths and the send through a local socket (the tool's own logic; the real model runs in the tool)."""

from __future__ import annotations

import argparse

import numpy as np
from test_kv_coder import _snapshot
from tool_modules import import_tools

from edgedecode.kv.policy import TierProfile
from edgedecode.prefill.kv_device import KVDevice
from edgedecode.prefill.pipeline import ScoredPrefill

(stages,) = import_tools("bench.prefill_stages")


def test_a_cell_times_every_stage_and_both_paths_send_the_same_bytes():
    snapshot = _snapshot(384)
    scored = ScoredPrefill(snapshot, np.random.default_rng(0).random(384).astype(np.float32))
    args = argparse.Namespace(device="cpu", runs=1, workers=2, level=3, fast_level=1)
    devices = {"reference": None, "device": KVDevice("cpu", 1)}
    cells = {path: stages.measure_cell(scored, 0.3, path, args, devices, TierProfile()) for path in devices}
    payloads = {path: cell.pop("payload") for path, cell in cells.items()}
    assert payloads["reference"] == payloads["device"]
    for path, cell in cells.items():
        assert cell["b_wire"] <= 0.3 and cell["encodes"] >= 1
        # the device path's coder fills chunks as the stage "assemble" where it computed them beforehand
        # (HostCoder: no kernels library), as "quantize" where it computes them as it fills (its section kernel)
        device = devices[path]
        filled = device.coder(snapshot).fill_stage if device else "quantize"
        assert {"allocate", "header", "quantize", "compress", "frame", filled} <= set(cell["stages_cpu_s"])
        assert cell["process_gbps_per_core"] > 0 and cell["implied_2core_gbps"] == 2 * cell["process_gbps_per_core"]
        assert cell["send"]["bytes"] == len(payloads[path])
        assert cell["encode_gbps_per_core"] > 0 and cell["parallel_wall_s"] > 0

#!/usr/bin/env python3
"""GPU kernels per decode token of the fp16 INT4 graph on CUDA, with and without CUDA graphs.

Traces a few decode steps with CUPTI (through torch.profiler, so it needs PyTorch beside
onnxruntime-gpu; onnxruntime's own profiler only times nodes on the host) and prints, per mode, the
kernels per token, their summed GPU time, and the kernels grouped by name.

    python tools/bench/cuda_kernels.py [--past 512] [--steps 20] [--top 25] [--q4-1 zero_point] [--json]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import collections

import numpy as np
from torch.profiler import ProfilerActivity, profile

from edgedecode.model.graph import DEVICE_Q4_1, Q4_1_MODES, GraphOptions
from edgedecode.model.loader import load_model
from edgedecode.runtime.engine import Engine
from tools.common import cli


def trace(engine: Engine, past: int, steps: int) -> dict:
    """Kernels of ``steps`` one-token steps after a ``past``-token prompt: count and GPU µs per token."""
    engine.prefill(np.arange(100, 100 + past, dtype=np.int64))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.forward(np.array([5]))
    count, gpu_us = collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.device_type.name == "CUDA":
            count[event.name] += 1
            gpu_us[event.name] += event.device_time_total
    return {
        "kernels_per_token": sum(count.values()) / steps,
        "gpu_us_per_token": sum(gpu_us.values()) / steps,
        "by_kernel": [
            {"name": name, "per_token": count[name] / steps, "gpu_us": gpu_us[name] / steps}
            for name, _ in gpu_us.most_common()
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    cli.add_model(parser)
    parser.add_argument("--past", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--q4-1",
        choices=Q4_1_MODES,
        default=DEVICE_Q4_1["cuda"],
        help="how the decode graph applies Q4_1's offsets (GraphOptions.q4_1)",
    )
    cli.add_json_flag(parser)
    args = parser.parse_args(argv)
    model = load_model(args.model)
    results = {}
    for cuda_graph in (True, False):
        engine = Engine(
            model,
            GraphOptions("decode", "float16", 4, q4_1=args.q4_1),
            max_context=args.past + args.steps + 8,
            device="cuda",
            cuda_graph=cuda_graph,
        )
        results["cuda_graph" if cuda_graph else "no_cuda_graph"] = trace(engine, args.past, args.steps)
    if args.json:
        cli.print_json(results, indent=2)
        return
    for mode, result in results.items():
        print(f"{mode}: {result['kernels_per_token']:.0f} kernels, {result['gpu_us_per_token']:.0f} µs GPU per token")
        for row in result["by_kernel"][: args.top]:
            print(f"  {row['per_token']:6.1f} × {row['gpu_us']:7.1f} µs  {row['name'][:100]}")


if __name__ == "__main__":
    cli.run(main)

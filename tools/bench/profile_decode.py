#!/usr/bin/env python3
"""Where a decode step's time goes: onnxruntime's profiler over greedy decode steps, by operator type.

    python tools/bench/profile_decode.py [--model NAME] [--past 16 2048] [--steps 32] [--threads 2] [--by-node]

For each past length it prefills that many prose tokens, runs --steps decode steps with the
profiler on, and prints per-operator-type milliseconds per step (median-free: the mean over the
profiled steps) and their share of the step; ``--by-node`` splits them by node role (the LM head, each
layer matrix summed over layers, ...). Prompt-processing runs are excluded from the figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import json
import re
from collections import defaultdict

from edgedecode.model.loader import load_model
from edgedecode.runtime.engine import Engine
from edgedecode.runtime.sampler import SamplingParams
from edgedecode.runtime.session import decode_options
from tools.bench.prompts import prompt_tokens
from tools.common import cli

LAYER_PREFIX = re.compile(r"^layers\.\d+\.")


def node_role(node_name: str) -> str:
    """A node's name without its layer index (``layers.3.mlp.down`` -> ``mlp.down``): one row per role."""
    return LAYER_PREFIX.sub("", node_name.removesuffix("_kernel_time"))


def op_times_per_step(trace_path: Path, steps: int, by_node: bool = False) -> dict[str, float]:
    """Milliseconds per decode step for each operator type (or node role, ``by_node``), from the last
    ``steps`` model runs."""
    events = json.loads(trace_path.read_text())
    runs = [e for e in events if e.get("name") == "model_run"]
    first_decode_ts = runs[-steps]["ts"]
    totals: dict[str, float] = defaultdict(float)
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and event["ts"] >= first_decode_ts:
            key = f"{event['args']['op_name']} {node_role(event['name'])}" if by_node else event["args"]["op_name"]
            totals[key] += event["dur"] / 1000.0
    totals["(whole step)"] = sum(e["dur"] for e in runs[-steps:]) / 1000.0
    return {op: ms / steps for op, ms in totals.items()}


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    cli.add_model(parser)
    cli.add_past(parser, [16, 2048])
    parser.add_argument("--steps", type=int, default=32)
    cli.add_threads(parser)
    cli.add_accuracy_level(parser)
    parser.add_argument("--by-node", action="store_true", help="One row per node role (layer index dropped).")
    args = parser.parse_args(argv)
    model = load_model(args.model)
    for past in args.past:
        engine = Engine(
            model,
            decode_options("cpu", args.accuracy_level),  # the graph the daemon ships here (the own kernels' form)
            max_context=past + args.steps + 8,
            threads=args.threads,
            profile=True,
        )
        for _ in engine.generate(
            prompt_tokens(model.tokenizer, past), SamplingParams(max_tokens=args.steps + 1, stop_token_ids=())
        ):
            pass
        trace = Path(engine.session.end_profiling())
        per_step = op_times_per_step(trace, args.steps, args.by_node)
        trace.unlink()
        whole = per_step.pop("(whole step)")
        print(f"past {past}: {whole:.2f} ms per decode step (onnxruntime run), {args.threads} threads")
        for op, ms in sorted(per_step.items(), key=lambda item: -item[1]):
            print(f"  {op:<52}{ms:8.3f} ms  {100 * ms / whole:5.1f} %")


if __name__ == "__main__":
    cli.run(main)

#!/usr/bin/env python3
"""Decode cost of graph forms and session variants on one model, alternating, in wall and CPU time.

Each variant is an Engine over the same model; runs alternate variant by variant so host drift hits
all alike. Per run: prefill ``past`` prose tokens, then time ``--steps`` single-token steps. CPU time
(this process's, all threads) is what the variant costs the cores; on a box other processes load, it
moves far less than wall time, so it ranks variants there. It is only comparable without thread
spinning (spinning threads burn CPU while idle), so spinning is off unless --spin.

    python tools/bench/cpu_variants.py --model NAME [--variants shipped stacked float16 1thread]
        [--past 16 512] [--steps 32] [--runs 3] [--threads 2] [--spin]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import os
import statistics
import time

from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import load_model
from edgedecode.runtime.engine import Engine
from tools.bench.prompts import prompt_tokens
from tools.common import cli

# name -> (GraphOptions fields over the CPU decode graph's, threads: None for --threads)
VARIANTS: dict[str, tuple[dict, int | None]] = {
    "shipped": ({}, None),
    "stacked": ({"q4_1": "stacked"}, None),
    "zero_point": ({"q4_1": "zero_point"}, None),
    "float16": ({"dtype": "float16"}, None),
    "accuracy0": ({"accuracy_level": 0}, None),
    "1thread": ({}, 1),
}


def make_engine(model, variant: str, threads: int, context: int) -> Engine:
    fields, variant_threads = VARIANTS[variant]
    shipped = GraphOptions.for_device("decode", "cpu")
    options = GraphOptions(**{**shipped.__dict__, **fields})
    return Engine(model, options, max_context=context, threads=variant_threads or threads)


def step_times_ms(engine: Engine, ids, steps: int) -> tuple[float, float]:
    """(wall, CPU) milliseconds per decode step after prefilling ``ids``."""
    logits = engine.prefill(ids)
    token = int(logits.argmax())
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        token = int(engine.step(token).argmax())
    return (time.perf_counter() - wall) * 1e3 / steps, (time.process_time() - cpu) * 1e3 / steps


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    cli.add_model(parser)
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["shipped", "stacked", "float16"])
    cli.add_past(parser, [16, 512])
    parser.add_argument("--steps", type=int, default=32)
    cli.add_runs(parser, 3)
    cli.add_threads(parser)
    parser.add_argument("--spin", action="store_true", help="leave onnxruntime's thread spinning on")
    args = parser.parse_args(argv)
    if not args.spin:
        os.environ["EDGEDECODE_SPIN"] = "0"
    model = load_model(args.model)
    context = max(args.past) + args.steps + 8
    engines = {name: make_engine(model, name, args.threads, context) for name in args.variants}
    prompts = {past: prompt_tokens(model.tokenizer, past) for past in args.past}
    times: dict[tuple[str, int], list[tuple[float, float]]] = {(n, p): [] for n in engines for p in args.past}
    for _ in range(args.runs):
        for past, ids in prompts.items():
            for name, engine in engines.items():
                times[(name, past)].append(step_times_ms(engine, ids, args.steps))
    print(f"{model.record.name}: median of {args.runs} alternating runs, {args.steps} steps, spinning {args.spin}")
    print(f"{'variant':<12}{'past':>6}{'wall ms':>10}{'CPU ms':>10}{'wall ratio':>12}{'CPU ratio':>11}")
    for past in args.past:
        base = [statistics.median(t[i] for t in times[(args.variants[0], past)]) for i in (0, 1)]
        for name in engines:
            wall, cpu = (statistics.median(t[i] for t in times[(name, past)]) for i in (0, 1))
            print(f"{name:<12}{past:>6}{wall:>10.2f}{cpu:>10.2f}{base[0] / wall:>11.2f}x{base[1] / cpu:>10.2f}x")


if __name__ == "__main__":
    cli.run(main)

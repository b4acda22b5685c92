#!/usr/bin/env python3
"""Decode speed of a float16 graph (float16 KV buffers: half the resident KV memory) against the
float32 graph on this machine's CPU (issue 14 item 4).

onnxruntime's GroupQueryAttention takes its KV in the graph's dtype, so float16 KV means the whole
decode graph in float16 (INT4 weights, float16 activations). For each dtype: one engine with a
``--max-context`` KV buffer, a pydoc prose prompt prefilled to each ``--past`` length, then
``--steps`` single-token decode steps timed; ``--passes`` rounds alternate the dtypes, and the
median ms per token of the passes is reported with the float16 ÷ float32 ratio, beside the KV bytes
each holds per cached token.

    python tools/bench/kv_dtype.py [--past 16 2048] [--steps 64] [--passes 3] [--threads 2]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import statistics
import time

import numpy as np

from edgedecode.evaluation.texts import pydoc_corpus, token_windows
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import load_model
from edgedecode.runtime.engine import Engine
from tools.common import cli

DTYPES = ("float32", "float16")


def step_seconds(engine: Engine, prompt: np.ndarray, past: int, steps: int) -> float:
    """Mean seconds of one decode step after ``past`` prompt tokens."""
    engine.prefill(prompt[:past])
    token = int(prompt[past])
    started = time.perf_counter()
    for _ in range(steps):
        engine.step(token)
    return (time.perf_counter() - started) / steps


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__)
    cli.add_past(p, [16, 2048])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--passes", type=int, default=3)
    cli.add_threads(p)
    args = p.parse_args(argv)
    model = load_model()
    context = max(args.past) + args.steps + 2
    (prompt,) = token_windows(model.tokenizer, pydoc_corpus(), context, 1)
    prompt = np.asarray(prompt, np.int64)
    engines = {
        dtype: Engine(model, GraphOptions("decode", dtype), max_context=context, threads=args.threads)
        for dtype in DTYPES
    }
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.passes):
        for past in args.past:
            for dtype, engine in engines.items():
                times.setdefault((dtype, past), []).append(step_seconds(engine, prompt, past, args.steps))
    print(f"{cli.cpu_name()}, {args.threads} threads, {args.passes} passes")
    print("| past | float32 ms/token | float16 ms/token | float16 ÷ float32 | KV bytes/token f32 / f16 |")
    print("|---:|---:|---:|---:|---|")
    per_token = {dtype: engine.kv_bytes_per_slot for dtype, engine in engines.items()}
    for past in args.past:
        f32, f16 = (statistics.median(times[(dtype, past)]) * 1e3 for dtype in DTYPES)
        print(
            f"| {past} | {f32:.2f} | {f16:.2f} | {f16 / f32:.2f}× | {per_token['float32']} / {per_token['float16']} |"
        )
    return 0


if __name__ == "__main__":
    cli.run(main)

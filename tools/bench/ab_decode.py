#!/usr/bin/env python3
"""Interleaved A/B of decode speed between two checkouts of edgedecode: same model, same machine.

Each run is a fresh process importing edgedecode from one checkout (checked), which builds the shipped
decode engine for the device and times ``--steps`` greedy decode steps after a prompt of each ``--past``
length (the median of ``--repeats`` generations). Runs alternate A B B A A B ... so host drift hits both
alike; the table gives, per checkout and past length, the median decode tok/s over the runs with its
min..max, and B ÷ A. Only the engine comes from the checkouts: this script, its prompts and the model are
the same for both.

    python tools/bench/ab_decode.py A_CHECKOUT B_CHECKOUT [--runs 6] [--past 16 512] [--steps 128]
        [--repeats 3] [--threads 2] [--device cpu|cuda] [--model NAME] [--json PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse
import json
import logging
import os
import statistics
import subprocess
import time
from typing import Any

from tools.bench.prompts import prompt_tokens
from tools.common import cli

logger = logging.getLogger(__name__)


def child(args: argparse.Namespace) -> None:
    """One run in this process, with edgedecode from ``args.child``: prints {"edgedecode": where it was
    imported from, "past": {n: decode tok/s}}."""
    sys.path.insert(0, str(args.child))  # before the first import of edgedecode: the checkout's, not ours
    import edgedecode
    from edgedecode.model.graph import GraphOptions
    from edgedecode.model.loader import load_model
    from edgedecode.runtime.engine import Engine
    from edgedecode.runtime.sampler import SamplingParams

    model = load_model(args.model)
    context = max(args.past) + args.steps + 1
    engine = Engine(
        model,
        GraphOptions.for_device("decode", args.device),
        max_context=context,
        threads=args.threads,
        device=args.device,
    )
    params = SamplingParams(max_tokens=args.steps + 1, stop_token_ids=())
    prompts = {past: prompt_tokens(model.tokenizer, past) for past in args.past}
    for _ in engine.generate(prompts[min(args.past)], params):  # warm-up, not measured
        pass
    rates = {}
    for past, prompt in prompts.items():
        samples = []
        for _ in range(args.repeats):
            for _ in engine.generate(prompt, params):
                pass
            samples.append(engine.stats.decode_tokens_per_second)
        rates[past] = statistics.median(samples)
    print(json.dumps({"edgedecode": str(Path(edgedecode.__file__).parent), "past": rates}))


def run_once(checkout: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One run in a fresh process importing edgedecode from ``checkout``."""
    settings = ["--past", *map(str, args.past), "--steps", str(args.steps), "--repeats", str(args.repeats)]
    settings += ["--threads", str(args.threads), "--device", args.device]
    settings += ["--model", args.model] if args.model else []
    command = [sys.executable, __file__, *settings, "--child", str(checkout)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the run on {checkout} failed:\n{done.stderr}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(result["edgedecode"]).resolve() != (checkout / "edgedecode").resolve():
        raise SystemExit(f"the run imported edgedecode from {result['edgedecode']}, not from {checkout}")
    return result


def spread(rates: list[float]) -> dict[str, Any]:
    """Median, min, max and every run's rate."""
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates), "runs": rates}


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__)
    p.add_argument("checkouts", nargs="*", type=Path, help="A and B: the repository roots to compare")
    cli.add_runs(p, 6, "runs of each checkout, interleaved")
    cli.add_past(p, [16, 512])
    p.add_argument("--steps", type=int, default=128, help="greedy decode steps per generation")
    p.add_argument("--repeats", type=int, default=3, help="generations per past length in one run")
    cli.add_threads(p)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    cli.add_model(p)
    cli.add_json_file(p)
    p.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        child(args)
        return 0
    if len(args.checkouts) != 2:
        p.error("give two checkouts, A and B")
    started = time.time()
    a, b = (path.resolve() for path in args.checkouts)
    load_before = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for index in range(args.runs):
        for name, checkout in [("A", a), ("B", b)] if index % 2 == 0 else [("B", b), ("A", a)]:
            runs[name].append(run_once(checkout, args))
            logger.info("run %d: %s %s", index + 1, name, runs[name][-1]["past"])
    report: dict[str, Any] = {
        **cli.record(__file__, argv, started),
        "a": a,
        "b": b,
        "settings": cli.settings(args, leave_out=("checkouts", "json", "child")),
        "load_average_before_after": [load_before, os.getloadavg()[0]],
        "past": {},
    }
    for past in map(str, args.past):
        rates = {name: [run["past"][past] for run in runs[name]] for name in runs}
        row: dict[str, Any] = {name: spread(r) for name, r in rates.items()}
        row["b_over_a"] = statistics.median(rates["B"]) / statistics.median(rates["A"])
        report["past"][past] = row
    if args.json is not None:
        cli.write_json(report, args.json)
    print(
        f"decode tok/s, {args.device}, {args.threads} threads, {args.steps} steps: median of {args.runs} "
        f"interleaved runs (each the median of {args.repeats} generations); load average "
        f"{report['load_average_before_after'][0]:.1f} -> {report['load_average_before_after'][1]:.1f}"
    )
    print(f"A: {a}\nB: {b}")
    print(f"{'past':>6}{'A median':>11}{'A min..max':>16}{'B median':>11}{'B min..max':>16}{'B/A':>8}")
    for past, row in report["past"].items():
        ra, rb = row["A"], row["B"]
        print(
            f"{past:>6}{ra['median']:>11.1f}{ra['min']:>8.1f}..{ra['max']:<6.1f}"
            f"{rb['median']:>11.1f}{rb['min']:>8.1f}..{rb['max']:<6.1f}{row['b_over_a']:>8.3f}"
        )
    return 0


if __name__ == "__main__":
    cli.run(main)

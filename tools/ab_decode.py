#!/usr/bin/env python3
"""Interleaved A/B of decode speed between two checkouts of edgedecode, same model, same machine.

Each run is a fresh process that imports edgedecode from one checkout (PYTHONPATH), builds the shipped
decode engine for the device, and times greedy decode steps after a prompt of each past length (the
median of ``--repeats`` generations). Runs alternate A B B A A B ... so host drift hits both alike.
Prints per checkout and past length the median decode tok/s over the runs with its min..max, and B/A.

    python tools/ab_decode.py A_CHECKOUT B_CHECKOUT [--rounds 6] [--past 16 512] [--steps 128]
        [--repeats 3] [--threads 2] [--device cpu|cuda] [--model NAME] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def child(args: argparse.Namespace) -> None:
    """One run in this process: {"edgedecode": where it was imported from, "past": {n: decode tok/s}}."""
    from bench_prompts import prompt_tokens

    import edgedecode
    from edgedecode.model.graph import GraphOptions
    from edgedecode.model.loader import load_model
    from edgedecode.runtime.engine import Engine
    from edgedecode.runtime.sampler import SamplingParams

    model = load_model(args.model)
    options = GraphOptions.for_device("decode", args.device)
    context = max(args.past) + args.steps + 1
    engine = Engine(model, options, max_context=context, threads=args.threads, device=args.device)
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


def run_once(checkout: Path, args: argparse.Namespace) -> dict:
    """One child run importing edgedecode from ``checkout``."""
    env = dict(os.environ, PYTHONPATH=str(checkout))
    command = [sys.executable, __file__, "--child", *sys.argv[1:]]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the run on {checkout} failed:\n{done.stderr}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(result["edgedecode"]).resolve() != (checkout / "edgedecode").resolve():
        raise SystemExit(f"the run imported edgedecode from {result['edgedecode']}, not from {checkout}")
    return result


def spread(rates: list[float]) -> dict:
    """Median, min, max and every run's rate."""
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates), "runs": rates}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkouts", nargs="*", type=Path, help="A and B: the repository roots to compare")
    parser.add_argument("--rounds", type=int, default=6, help="runs of each checkout")
    parser.add_argument("--past", type=int, nargs="+", default=[16, 512])
    parser.add_argument("--steps", type=int, default=128, help="greedy decode steps per generation")
    parser.add_argument("--repeats", type=int, default=3, help="generations per past length in one run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", default=None, help="a registered model (default: the default model)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if len(args.checkouts) != 2:
        parser.error("give two checkouts, A and B")
    a, b = (path.resolve() for path in args.checkouts)
    load_before = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for round_ in range(args.rounds):
        order = [("A", a), ("B", b)] if round_ % 2 == 0 else [("B", b), ("A", a)]
        for name, checkout in order:
            runs[name].append(run_once(checkout, args))
            print(f"round {round_ + 1}: {name} {runs[name][-1]['past']}", file=sys.stderr)
    summary: dict = {
        "a": str(a),
        "b": str(b),
        "device": args.device,
        "threads": args.threads,
        "rounds": args.rounds,
        "steps": args.steps,
        "repeats": args.repeats,
        "load_average_before_after": [load_before, os.getloadavg()[0]],
        "past": {},
    }
    for past in map(str, args.past):
        rates = {name: [run["past"][past] for run in runs[name]] for name in runs}
        row: dict = {name: spread(r) for name, r in rates.items()}
        row["b_over_a"] = statistics.median(rates["B"]) / statistics.median(rates["A"])
        summary["past"][past] = row
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(
        f"decode tok/s, {args.device}, {args.threads} threads, {args.steps} steps, median of {args.rounds} "
        f"interleaved runs (each the median of {args.repeats} generations); load average "
        f"{summary['load_average_before_after'][0]:.1f} -> {summary['load_average_before_after'][1]:.1f}"
    )
    print(f"A: {a}\nB: {b}")
    print(f"{'past':>6}{'A median':>11}{'A min..max':>16}{'B median':>11}{'B min..max':>16}{'B/A':>8}")
    for past, row in summary["past"].items():
        ra, rb = row["A"], row["B"]
        print(
            f"{past:>6}{ra['median']:>11.1f}{ra['min']:>8.1f}..{ra['max']:<6.1f}"
            f"{rb['median']:>11.1f}{rb['min']:>8.1f}..{rb['max']:<6.1f}{row['b_over_a']:>8.3f}"
        )


if __name__ == "__main__":
    main()

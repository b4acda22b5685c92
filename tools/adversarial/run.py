#!/usr/bin/env python3
"""Every adversarial run at the checkout's commit: the EDKV fuzz of each seed family, hostile HTTP (abuse), failing
prefill peers (faults) and load, each its own tool in a process of its own, one after another, each writing its JSON
into --out; then ``summary.json`` there: the commit (and whether the checkout was dirty) the run started at, each
part's command, exit status and wall time, and its headline figures.

    python -m tools.adversarial.run --out DIR [--parts fuzz abuse faults load] [--fuzz-cases 100000]
        [--fuzz-max-seconds S] [--idle-read-timeout-s 15] [--fetch-timeout-s 30]
        [--breaker-reset-s 60] [--clients 32] [--sequential 500]

Exit status 1 when any part reported a problem (its own exit status).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse
import json
import subprocess
import time
from typing import Any

from tools.common import cli

PARTS = ("fuzz", "abuse", "faults", "load")
FUZZ_FAMILIES = ("edkv1", "windowed", "segmented")


def commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """The tool command of each part asked for, keyed by the name of the JSON it writes into --out."""
    tool = str(Path(__file__).parent)
    found: dict[str, list[str]] = {}
    if "fuzz" in args.parts:
        for family in FUZZ_FAMILIES:
            fuzz = [f"{tool}/fuzz_kv.py", "--family", family, "--cases", str(args.fuzz_cases), "--seed", "1"]
            if args.fuzz_max_seconds is not None:
                fuzz += ["--max-seconds", str(args.fuzz_max_seconds)]
            found[f"fuzz-{family}"] = fuzz
    if "abuse" in args.parts:
        found["abuse"] = [f"{tool}/abuse.py"]
    if "faults" in args.parts:
        found["faults"] = [f"{tool}/faults.py", "--idle-read-timeout-s", str(args.idle_read_timeout_s)]
        found["faults"] += ["--fetch-timeout-s", str(args.fetch_timeout_s)]
        found["faults"] += ["--breaker-reset-s", str(args.breaker_reset_s)]
    if "load" in args.parts:
        found["load"] = [f"{tool}/load_test.py", "--clients", *map(str, args.clients)]
        found["load"] += ["--sequential", str(args.sequential), "--prefill", "remote"]
    return found


def headline(name: str, result: dict[str, Any]) -> dict[str, Any]:
    """The figures docs/reliability.md quotes from one part's JSON."""
    if name.startswith("fuzz"):
        return {"cases": result["cases"], "failures": result["failures"], "longest_case_ms": result["longest_case_ms"]}
    if name == "faults":
        return {"longest_fetch": result["longest_fetch"], "scenarios": len(result["scenarios"])}
    if name == "load":
        loads = {
            load["clients"]: {"answers": load["answers"], "failed": len(load["failed"])} for load in result["loads"]
        }
        return {"loads": loads, "sequential": result.get("sequential")}
    return {key: result[key] for key in ("wall_s",) if key in result}


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__doc__)
    parser.add_argument("--out", type=Path, required=True, help="where each part's JSON and summary.json go")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--fuzz-cases", type=int, default=100_000, help="cases per seed family")
    parser.add_argument("--fuzz-max-seconds", type=float, help="stop each family's fuzz after this long")
    # longer than the faults tool's own defaults (10 s, 20 s): on the 2-core box shared with other work a healthy
    # prefill, which the fault peer relays whole, took over 10 s to start arriving
    parser.add_argument("--idle-read-timeout-s", type=float, default=15.0, help="the faults daemon's")
    parser.add_argument("--fetch-timeout-s", type=float, default=30.0, help="the faults daemon's")
    # the breaker's cycle needs a turn after a failure (computed here) to end before the breaker half-opens: over
    # 10 s on the loaded box
    parser.add_argument("--breaker-reset-s", type=float, default=60.0, help="the faults daemon's")
    parser.add_argument("--clients", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--sequential", type=int, default=500)
    args = parser.parse_args(argv)
    summary: dict[str, Any] = cli.record(__file__, argv, time.time()) | {"parts": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for name, command in commands(args).items():
        path = args.out / f"{name}.json"
        argv_part = [sys.executable, *command, "--json", str(path)]
        print(f"== {name}: {' '.join(argv_part[1:])}", flush=True)
        started = time.perf_counter()
        with open(args.out / f"{name}.log", "wb") as log:
            status = subprocess.run(argv_part, stdout=log, stderr=subprocess.STDOUT, cwd=cli.ROOT).returncode
        part: dict[str, Any] = {"command": " ".join(["python", *command]), "exit_status": status}
        part["wall_s"] = round(time.perf_counter() - started, 1)
        if path.exists():
            part["headline"] = headline(name, json.loads(path.read_text()))
        summary["parts"][name] = part
        print(f"   exit {status}, {part['wall_s']:.0f} s: {part.get('headline')}", flush=True)
        cli.write_json(summary, args.out / "summary.json")
    return 1 if any(part["exit_status"] for part in summary["parts"].values()) else 0


if __name__ == "__main__":
    cli.run(main)

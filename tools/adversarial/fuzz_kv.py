#!/usr/bin/env python3
"""Fuzz the EDKV decoder: valid payloads from the real prefill pipeline on SmolLM2-135M, mutated (bits flipped in
header, chunks and trailer; truncation; chunks lost, repeated or reordered; header fields edited and resealed; zstd
bombs; huge declared lengths) and fed in random slices through the decode engine's stream reader into its KV
buffers. Every case must end in a typed refusal or a verified-correct ingest, nothing written from a refused chunk,
within a second and the allocation bound (tests/kvfuzz/oracle.py says exactly what is checked).

    python tools/adversarial/fuzz_kv.py --cases 100000 --seed 1       # the run in docs/reliability.md
    python tools/adversarial/fuzz_kv.py --seed 1 --case 4242          # replay one case of that run, saying what it did

Prints the outcomes by error type and mutation, the longest case and the peak allocation, and exits 1 if any case
crashed, hung, ingested wrong KV or allocated beyond its bound (each printed with its case number).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import collections
import faulthandler
import resource
import time

import numpy as np

from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import load_model
from edgedecode.model.registry import DEFAULT_MODEL
from edgedecode.runtime.engine import Engine
from tools.common import cli

# The fuzz lives with the tests it shares (tests/kvfuzz/, tests/test_kv_format.py), which import it as `kvfuzz`.
sys.path.append(str(cli.ROOT / "tests"))
from kvfuzz.draw import RandomDraw
from kvfuzz.mutations import Case, make_case
from kvfuzz.oracle import FuzzFailure, Outcome, reference_kv, run_case
from kvfuzz.seeds import CONTEXT, Seed, bits, build_seeds

WATCHDOG_S = 60  # a case still running after this long is a hang the in-process timer cannot report: dump and exit
SHOWN_FAILURES = 20


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__doc__)
    parser.add_argument("--cases", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--case", type=int, help="run only this case of the run, and print it")
    args = parser.parse_args(argv)
    model = load_model(DEFAULT_MODEL)
    prefill = Engine(model, GraphOptions("prefill"), max_context=CONTEXT, threads=1)
    decoder = Engine(model, GraphOptions.for_device("decode", "cpu"), max_context=CONTEXT, threads=1)
    seeds = build_seeds(model.tokenizer, prefill, decoder)
    for seed in seeds:
        check_seed(seed)
    print(f"{len(seeds)} seed payloads: " + "; ".join(f"{s.name} ({len(s.payload)} B)" for s in seeds))
    indices = range(args.cases) if args.case is None else [args.case]
    report = Report()
    started = time.perf_counter()
    for index in indices:
        faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
        case = make_case(seeds, RandomDraw(args.seed, index))
        if args.case is not None:
            print(f"case {index}: seed {case.seed.name!r}, {case.mutant.label}, {len(case.cuts) - 1} feeds")
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            outcome = run_case(decoder, case)
        except FuzzFailure as failure:
            report.fail(index, case.mutant.label, failure)
        except Exception:
            print(f"case {index} ({case.mutant.label}): the oracle itself failed", file=sys.stderr)
            raise
        else:
            report.add(index, case, outcome)
            if args.case is not None:
                print(outcome)
        rise_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before  # Linux: KiB
        report.rss_rise = max(report.rss_rise, (rise_kib << 10, index))
        if args.case is None and (index + 1) % 10_000 == 0:
            print(f"  {index + 1} cases, {time.perf_counter() - started:.0f} s", flush=True)
    faulthandler.cancel_dump_traceback_later()
    run = cli.command(__file__, ["--cases", str(args.cases), "--seed", str(args.seed)])
    report.print(run, time.perf_counter() - started)
    return 1 if report.failures else 0


def check_seed(seed: Seed) -> None:
    """The oracle's own decode of a seed must be its clean ingest, bit for bit."""
    if not np.array_equal(bits(reference_kv(seed.header, seed.bodies).astype(seed.clean.dtype)), bits(seed.clean)):
        raise SystemExit(f"the oracle disagrees with the reader on the clean seed {seed.name!r}")


FAMILIES = ("transport damage", "sender's edit, resealed", "unchanged bytes")


class Report:
    """Counts of outcomes (by mutation family) and failures, and the extremes."""

    def __init__(self) -> None:
        self.results: collections.Counter[tuple[str, str]] = collections.Counter()
        self.mutations: collections.Counter[str] = collections.Counter()
        self.seeds: collections.Counter[tuple[str, bool]] = collections.Counter()  # (seed, ingested)
        self.failures: collections.Counter[str] = collections.Counter()
        self.shown: list[str] = []
        self.partial = 0  # refused cases that kept a verified prefix
        self.slowest: tuple[float, int] = (0.0, -1)
        self.busiest: tuple[float, int] = (0.0, -1)
        self.peak: tuple[int, int] = (0, -1)
        self.zstd: tuple[int, int] = (0, -1)
        self.rss_rise: tuple[int, int] = (0, -1)  # the process's peak resident memory, raised by one case
        self.bound_share = 0.0

    def add(self, index: int, case: Case, outcome: Outcome) -> None:
        mutant = case.mutant
        family = FAMILIES[2] if mutant.payload == case.seed.payload else FAMILIES[1] if mutant.sealed else FAMILIES[0]
        self.results[outcome.result, family] += 1
        self.mutations[mutant.label.split(":")[0].split(",")[0]] += 1
        self.seeds[case.seed.name, outcome.result.startswith("ingested")] += 1
        self.partial += outcome.result.startswith("KV") and outcome.verified_tokens > 0
        self.slowest = max(self.slowest, (outcome.seconds, index))
        self.busiest = max(self.busiest, (outcome.cpu_seconds, index))
        self.peak = max(self.peak, (outcome.peak_bytes, index))
        self.zstd = max(self.zstd, (outcome.zstd_bytes, index))
        self.bound_share = max(self.bound_share, outcome.peak_bytes / outcome.bound_bytes)

    def fail(self, index: int, label: str, failure: FuzzFailure) -> None:
        self.failures[failure.kind] += 1
        if len(self.shown) < SHOWN_FAILURES:
            self.shown.append(f"case {index} ({label}): {failure}")

    def print(self, command: str, seconds: float) -> None:
        total = sum(self.results.values()) + sum(self.failures.values())
        print(f"\n{command}: {total} cases in {seconds:.0f} s")
        print(f"\n| outcome | {' | '.join(FAMILIES)} | all |\n|---|{'---:|' * (len(FAMILIES) + 1)}")
        by_result = collections.Counter[str]()
        for (result, _), count in self.results.items():
            by_result[result] += count
        for result, count in by_result.most_common():
            cells = " | ".join(str(self.results[result, family]) for family in FAMILIES)
            print(f"| {result} | {cells} | {count} |")
        print(f"\nrefused after keeping a verified prefix: {self.partial}")
        print("\n| mutation | cases |\n|---|---:|")
        for label, count in sorted(self.mutations.items()):
            print(f"| {label} | {count} |")
        print("\n| seed | ingested | refused |\n|---|---:|---:|")
        for name in dict.fromkeys(name for name, _ in self.seeds):
            print(f"| {name} | {self.seeds[name, True]} | {self.seeds[name, False]} |")
        print(
            f"\nlongest case: {self.slowest[0] * 1e3:.1f} ms wall (case {self.slowest[1]}); most CPU: "
            f"{self.busiest[0] * 1e3:.1f} ms (case {self.busiest[1]})"
        )
        print(
            f"peak traced allocation: {self.peak[0] / 2**20:.2f} MiB (case {self.peak[1]}); at most "
            f"{self.bound_share:.0%} of a case's bound"
        )
        print(f"largest zstd decompression context: {self.zstd[0] / 2**20:.2f} MiB (case {self.zstd[1]})")
        print(
            f"most a case raised the process's peak resident memory (any allocator): "
            f"{self.rss_rise[0] / 2**20:.1f} MiB (case {self.rss_rise[1]}); peak "
            f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB"
        )
        print(f"failures: {dict(self.failures) or 'none'}")
        for line in self.shown:
            print("  " + line)


if __name__ == "__main__":
    cli.run(main)

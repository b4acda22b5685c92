#!/usr/bin/env python3
"""Fuzz the EDKV decoder: valid payloads from the real prefill pipeline, mutated (bits flipped in header, chunks and
trailer; truncation; chunks lost, repeated or reordered; header fields edited and resealed; zstd bombs; huge declared
lengths; for a resume, the answer from another offset) and fed in random slices through the decode engine's stream
reader into its KV buffers. Every case must end in a typed refusal or a verified-correct ingest, nothing written from
a refused chunk, within a second and the allocation bound (tests/kvfuzz/oracle.py says exactly what is checked).

Seed families (``--family``): ``edkv1``, SmolLM2-135M payloads as EDKV 1.2 (importance), 1.1 and 1.0; ``windowed``,
EDKV 2.0 payloads of a sliding-window model (a tiny synthetic Gemma 3, ``tests/kvfuzz/windowed.py`` says why) and
the same prompt as 1.2; ``segmented``, resumed transfers: a SmolLM2 segment cut after some chunks, then the mutated
resume.

    python tools/adversarial/fuzz_kv.py --family edkv1 --cases 100000 --seed 1       # docs/reliability.md's runs
    python tools/adversarial/fuzz_kv.py --family edkv1 --seed 1 --case 4242          # replay one case of that run

Prints the outcomes by error type and mutation, the longest case and the peak allocation (``--json PATH``: also as
JSON, with the commit it ran at), and exits 1 if any case crashed, hung, ingested wrong KV or allocated beyond its
bound (each printed with its case number).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import collections
import faulthandler
import os
import resource
import signal
import tempfile
import time
from typing import Any

import numpy as np

from edgedecode.kv.tiers import Tier
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import load_model
from edgedecode.model.registry import DEFAULT_MODEL
from edgedecode.runtime.engine import Engine
from tools.common import cli

# The fuzz lives with the tests it shares (tests/kvfuzz/, tests/test_kv_format.py), which import it as `kvfuzz`.
sys.path.append(str(cli.ROOT / "tests"))
from kvfuzz import windowed
from kvfuzz.draw import RandomDraw
from kvfuzz.mutations import Case, make_case
from kvfuzz.oracle import FuzzFailure, Outcome, reference_kv, run_case
from kvfuzz.seeds import CONTEXT, Seed, bits, build_seeds
from kvfuzz.segmented import build_segmented_seeds

# A case still running after this long is a hang the in-process timer cannot report: a SIGALRM dumps every thread's
# stack and ends the process. A timer signal, not faulthandler.dump_traceback_later: that starts a thread per call,
# and a thread starting and ending beside each case's tracemalloc.start()/stop() is the race in CPython 3.11's
# tracemalloc (python/cpython#128679) that likely killed a windowed run after 60,000 cases (docs/reliability.md).
WATCHDOG_S = 60
SHOWN_FAILURES = 20


FAMILIES = ("edkv1", "windowed", "segmented")


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__doc__)
    parser.add_argument("--family", choices=FAMILIES, default="edkv1")
    parser.add_argument("--cases", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--case", type=int, help="run only this case of the run, and print it")
    parser.add_argument(
        "--max-seconds", type=float, help="stop after this long, reporting the cases run (the first ones of --cases)"
    )
    cli.add_json_file(parser)
    args = parser.parse_args(argv)
    head = cli.record(__file__, argv, time.time())  # the commit as the run starts: the checkout may move on
    faulthandler.register(signal.SIGALRM, chain=True)  # dump, then SIGALRM's default action: terminate
    with tempfile.TemporaryDirectory(prefix="fuzz-home-") as home:
        decoder, seeds = family_seeds(args.family, Path(home))
        for seed in seeds:
            check_seed(seed)
        print(f"{len(seeds)} seed payloads: " + "; ".join(f"{s.name} ({len(s.payload)} B)" for s in seeds))
        indices = range(args.cases) if args.case is None else [args.case]
        report = Report()
        started = time.perf_counter()
        for index in indices:
            if args.max_seconds is not None and time.perf_counter() - started > args.max_seconds:
                print(f"stopped after {args.max_seconds:.0f} s (--max-seconds): {index} of {args.cases} cases run")
                break
            signal.setitimer(signal.ITIMER_REAL, WATCHDOG_S)  # re-armed: the case's own minute
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
        signal.setitimer(signal.ITIMER_REAL, 0)
    seconds = time.perf_counter() - started
    run = cli.command(__file__, argv)
    report.print(run, seconds)
    if args.json and args.case is None:
        record = {**head, "family": args.family, "seeds": [s.name for s in seeds]}
        cli.write_json(record | report.to_json(seconds), args.json)
    return 1 if report.failures else 0


def family_seeds(family: str, home: Path) -> tuple[Engine, list[Seed]]:
    """The decode engine the ``family``'s cases run on and its seeds (``home``: a scratch EDGEDECODE_HOME for the
    windowed family's synthetic model)."""
    if family == "windowed":
        os.environ["EDGEDECODE_HOME"] = str(home)  # the synthetic model and its graphs stay out of the shared cache
        prefill, decoder = windowed.engines(windowed.tiny_gemma3(home))
        return decoder, windowed.build_windowed_seeds(prefill, decoder)
    model = load_model(DEFAULT_MODEL)
    prefill = Engine(model, GraphOptions("prefill"), max_context=CONTEXT, threads=1)
    decoder = Engine(model, GraphOptions.for_device("decode", "cpu"), max_context=CONTEXT, threads=1)
    if family == "segmented":
        return decoder, build_segmented_seeds(model.tokenizer, prefill, decoder)
    return decoder, build_seeds(model.tokenizer, prefill, decoder)


def check_seed(seed: Seed) -> None:
    """The oracle's own decode of a seed must be its clean ingest, bit for bit, in every cell the payload carries
    (an EDKV 2.0 window leaves some out: the reader does not write them)."""
    carried = (seed.header.cells != Tier.DROP)[:, seed.header.kept][:, None, None, :, None]
    oracle = bits(reference_kv(seed.header, seed.bodies).astype(seed.clean.dtype))
    if not np.array_equal(np.where(carried, oracle, 0), np.where(carried, bits(seed.clean), 0)):
        raise SystemExit(f"the oracle disagrees with the reader on the clean seed {seed.name!r}")


KINDS = ("transport damage", "sender's edit, resealed", "unchanged bytes")


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
        kind = KINDS[2] if mutant.payload == case.seed.payload else KINDS[1] if mutant.sealed else KINDS[0]
        self.results[outcome.result, kind] += 1
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

    def to_json(self, seconds: float) -> dict[str, Any]:
        """The run's counts and extremes as JSON."""
        outcomes: dict[str, dict[str, int]] = collections.defaultdict(dict)
        for (result, kind), count in self.results.items():
            outcomes[result][kind] = count
        return {
            "cases": sum(self.results.values()) + sum(self.failures.values()),
            "seconds": round(seconds, 1),
            "outcomes": outcomes,
            "mutations": dict(sorted(self.mutations.items())),
            "refused_after_verified_prefix": self.partial,
            "longest_case_ms": round(self.slowest[0] * 1e3, 1),
            "most_cpu_ms": round(self.busiest[0] * 1e3, 1),
            "peak_traced_allocation_bytes": self.peak[0],
            "peak_share_of_bound": round(self.bound_share, 3),
            "largest_zstd_context_bytes": self.zstd[0],
            "failures": dict(self.failures),
            "failures_shown": self.shown,
        }

    def print(self, command: str, seconds: float) -> None:
        total = sum(self.results.values()) + sum(self.failures.values())
        print(f"\n{command}: {total} cases in {seconds:.0f} s")
        print(f"\n| outcome | {' | '.join(KINDS)} | all |\n|---|{'---:|' * (len(KINDS) + 1)}")
        by_result = collections.Counter[str]()
        for (result, _), count in self.results.items():
            by_result[result] += count
        for result, count in by_result.most_common():
            cells = " | ".join(str(self.results[result, kind]) for kind in KINDS)
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

#!/usr/bin/env python3
"""Time to first token of the adaptive KV plan against fixed budgets and local prefill, over shaped
links (issue 13 item 6).

One prefill server (``--prefill-device``, its prefix cache off so every request computes) sits
behind a ``LinkShaper`` on loopback (one-way delay ``--rtt-ms``/2, a token bucket for the rate),
and one decode daemon per policy pulls through it: ``adaptive`` (``daemon.ttft_target_ms`` =
``--target-ms``), ``b1.0``, ``b0.5``, ``b0.3`` (that fixed budget, no target) and ``local``
(``local_prefill_only``). Every request is a streamed completion of a distinct pydoc prose window
of each ``--prompt-tokens`` length, ``--runs`` per cell; TTFT is measured by the client.

Cells: the ``constant`` trace at each ``--mbits`` link; ``step``, ``--step-mbits`` HIGH LOW (100 →
10) once the link has carried ``--step-at`` × the prompt's FP16 KV bytes (0.1: halfway through a
pull at the 0.2 floor, earlier in larger ones); ``walk``, a seeded random walk in log space between
``--walk-mbits`` LO HI (5–100) changing every 100 ms (seed from ``--seed``, the prompt length and
the run: every policy sees the same rates). Each trace restarts at every request.

The adaptive daemon is started afresh for each cell (a link model that knows nothing) and sent
``--warmups`` requests first (further distinct windows of the shortest prompt length, under the
cell's trace): the first, with the link unknown, is pulled at the configured budget 0.3 and
teaches the link model; measured requests keep teaching it, as in service. The other daemons are
stateless towards the link: each is started once and primed with one warm-up request at 1000
Mbit/s. Daemons run one request at a time (the same prefill server, one link).

A request whose first token has not come within ``--cell-timeout-s`` is censored (TTFT > cap): the
daemons' ``fetch_timeout_s`` is the cap, so the pull is cut there and the daemon falls back to
local prefill (its circuit breaker is set never to open, so later pulls are still tried); the
request is still recorded with its report, and medians and p95 count it as > cap.

Quality cost: for every (prompt, KV source) a request used — a budget, local prefill (the decode
graph's own prefill), or a composite of a split, a re-planned or a cut pull — Δ perplexity and KL of a
teacher-forced continuation (``--continuation-tokens``) against FP16 transfer, with the quality
harness's functions (tools/study/adaptive_quality.py).

The default target, 1.5 s, lies between a 2-core edge's own prefill of 1k tokens (about 1 s) and of
2k (2–5 s): local prefill meets it for short prompts only, a pull only over links fast enough for
its payload.

    python tools/bench/adaptive.py [--mbits 5 20 50 100 1000] [--rtt-ms 20] [--traces constant step walk]
        [--prompt-tokens 1024 2048 4096] [--runs 3] [--target-ms 1500] [--cell-timeout-s 60]
        [--prefill-device cpu|cuda] [--edge-cpus 0,1] [--threads 2] [--json PATH]
        [--write-docs] [--docs-dir docs] [--quick]
    python tools/bench/adaptive.py --report RUN.json [--write-docs --docs-dir DIR]   # a saved run's report
    python tools/bench/adaptive.py --report RUN.json --rescore --json OUT.json   # its quality scored again
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse
import contextlib
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

from edgedecode.evaluation.texts import pydoc_corpus, token_windows
from edgedecode.model.loader import LoadedModel, load_model
from edgedecode.testing.link_shaper import LinkShaper
from edgedecode.testing.link_traces import MBIT, RateTrace, TracePlayer, constant, describe, random_walk, step
from tools.bench.adaptive_report import LOCAL, POLICIES, print_summary, write_docs
from tools.bench.serve import add_placement, daemon_placement, prefill_placement, write_config
from tools.common import cli
from tools.common.servers import running, streamed_completion
from tools.study.adaptive_quality import Prompt, kv_used, quality_costs

PRIME_MBITS = 1000.0  # the rate the stateless daemons' one warm-up request runs at
WALK_EVERY_S = 0.1
PROGRESS_EVERY_S = 0.1  # bytes received are sampled this often for the JSON and the plot
REPLY_MARGIN_S = 300.0  # a censored request still waits this long past the cap for the daemon's fallback


@dataclass(frozen=True)
class Cell:
    """One link condition: a trace and, for the constant trace, its rate."""

    trace: str  # constant, step or walk
    mbits: float | None = None

    def label(self, args: argparse.Namespace) -> str:
        if self.trace == "constant":
            return f"constant {self.mbits:g} Mbit/s"
        if self.trace == "step":
            high, low = args.step_mbits
            return f"step {high:g}→{low:g} Mbit/s"
        low, high = args.walk_mbits
        return f"walk {low:g}–{high:g} Mbit/s"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    p.add_argument("--mbits", type=float, nargs="+", default=[5, 20, 50, 100, 1000], help="constant links")
    p.add_argument("--rtt-ms", type=float, default=20.0)
    p.add_argument("--traces", nargs="+", choices=("constant", "step", "walk"), default=["constant", "step", "walk"])
    p.add_argument("--step-mbits", type=float, nargs=2, default=[100, 10], metavar=("HIGH", "LOW"))
    p.add_argument("--step-at", type=float, default=0.1, help="step after this × the prompt's FP16 KV bytes")
    p.add_argument("--walk-mbits", type=float, nargs=2, default=[5, 100], metavar=("LO", "HI"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[1024, 2048, 4096])
    cli.add_runs(p, 3, help="requests per cell, policy and prompt length")
    p.add_argument("--warmups", type=int, default=1, help="requests teaching the adaptive daemon each cell's link")
    p.add_argument("--target-ms", type=float, default=1500.0, help="the adaptive daemon's TTFT target")
    p.add_argument("--cell-timeout-s", type=float, default=60.0, help="the cap on one request's TTFT")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--continuation-tokens", type=int, default=256)
    add_placement(p)
    cli.add_threads(p, help="onnxruntime threads of each server and of scoring")
    cli.add_json_file(p, help="write every raw result here")
    p.add_argument("--write-docs", action="store_true", help="write adaptive.md and adaptive.png")
    p.add_argument("--docs-dir", type=Path, default=Path("docs"))
    p.add_argument("--quick", action="store_true", help="20 and 100 Mbit/s, constant + step, 1024 tokens, 1 run")
    p.add_argument("--report", type=Path, default=None, help="report a saved run (its --json) instead of running")
    p.add_argument(
        "--rescore",
        action="store_true",
        help="with --report: score the quality of the saved run's KV again (split and cut turns included), "
        "write the run to --json",
    )
    args = p.parse_args(argv)
    if args.rescore and args.report is None:
        p.error("--rescore scores a saved run: name it with --report")
    if args.quick:
        args.mbits, args.traces, args.prompt_tokens, args.runs = [20, 100], ["constant", "step"], [1024], 1
    if args.runs < 1 or args.warmups < 0 or args.cell_timeout_s <= 0 or args.target_ms <= 0:
        p.error("need --runs >= 1, --warmups >= 0, --cell-timeout-s > 0 and --target-ms > 0")
    return args


def grid(args: argparse.Namespace) -> list[Cell]:
    """The cells in the order they run."""
    cells = [Cell("constant", m) for m in args.mbits] if "constant" in args.traces else []
    return cells + [Cell(trace) for trace in ("step", "walk") if trace in args.traces]


def load_prompts(model: LoadedModel, args: argparse.Namespace) -> tuple[dict[int, list[Prompt]], list[Prompt]]:
    """``--runs`` distinct windows per prompt length, and the warm-up windows (more of the shortest)."""
    corpus, shortest = pydoc_corpus(), min(args.prompt_tokens)
    prompts: dict[int, list[Prompt]] = {}
    warmups: list[Prompt] = []
    for n in args.prompt_tokens:
        extra = args.warmups if n == shortest else 0
        windows = token_windows(model.tokenizer, corpus, n + args.continuation_tokens + 1, args.runs + extra)
        made = [Prompt(n, i, w[:n], w[n:]) for i, w in enumerate(windows)]
        prompts[n], warmups = made[: args.runs], warmups + made[args.runs :]
    return prompts, warmups


def make_trace(cell: Cell, prompt: Prompt, fp16_bytes_per_token: int, args: argparse.Namespace) -> RateTrace:
    """The cell's trace for one request of ``prompt``."""
    if cell.trace == "constant":
        assert cell.mbits is not None
        return constant(cell.mbits * MBIT)
    if cell.trace == "step":
        high, low = args.step_mbits
        return step(high * MBIT, low * MBIT, at_bytes=int(args.step_at * prompt.tokens * fp16_bytes_per_token))
    low, high = args.walk_mbits
    return random_walk(low * MBIT, high * MBIT, WALK_EVERY_S, seed=args.seed + 7919 * prompt.tokens + prompt.index)


def policy_settings(name: str, args: argparse.Namespace, prefill_url: str) -> dict:
    """The [daemon] keys of one policy's daemon."""
    if name == LOCAL:
        return {"local_prefill_only": True}
    pull = {"prefill_url": prefill_url, "fetch_timeout_s": args.cell_timeout_s, "breaker_failures": 1_000_000}
    if name == "adaptive":
        return {**pull, "ttft_target_ms": args.target_ms}
    return {**pull, "budget": float(name.removeprefix("b"))}


@contextlib.contextmanager
def daemon(name: str, directory: Path, args: argparse.Namespace, prefill_url: str) -> Iterator[str]:
    """The daemon of policy ``name`` for the block; yields its URL."""
    config = write_config(directory, name, args, **policy_settings(name, args, prefill_url))
    with running(["serve", "--config", str(config)], directory / f"{name}.log", **daemon_placement(args)) as (_, url):
        yield url


def timed_request(url: str, prompt: Prompt, player: TracePlayer, args: argparse.Namespace) -> dict:
    """One streamed completion under the player's trace: client-side TTFT, censoring and the whole
    turn report (whatever fields the daemon sends)."""
    body = {"prompt": prompt.ids.tolist(), "max_tokens": args.max_tokens, "temperature": 0, "stream": True}
    player.start()
    try:
        done = streamed_completion(url, body, timeout=args.cell_timeout_s + REPLY_MARGIN_S)
    finally:
        player.stop()
    report = done.report
    ttft_ms = None if done.ttft_s is None else 1e3 * done.ttft_s
    goodput = player.goodput_bps()
    return {
        "prompt_tokens": prompt.tokens,
        "prompt": prompt.key,
        "ttft_ms": ttft_ms,
        "censored": ttft_ms is None or ttft_ms > 1e3 * args.cell_timeout_s,
        "error": done.error,
        "kv_used": kv_used(report),
        "report": report,
        "goodput_mbits": None if goodput is None else goodput / MBIT,  # what the link delivered
        "link": {
            "trace": describe(player.trace),
            "changes": [(round(t, 3), rate) for t, rate in player.changes],
            "progress": [(round(t, 3), forwarded) for t, forwarded in player.progress],
        },
    }


def cell_request(
    cell: Cell, policy: str, url: str, prompt: Prompt, player: TracePlayer, args, fp16_per_token: int
) -> dict:
    """One request of ``policy`` under the cell's trace, recorded and shown on stderr."""
    player.trace = make_trace(cell, prompt, fp16_per_token, args)
    record = {"cell": cell.label(args), "trace": cell.trace, "mbits": cell.mbits, "policy": policy, "run": prompt.index}
    record |= timed_request(url, prompt, player, args)
    print(progress_line(record), file=sys.stderr, flush=True)
    return record


def run_cell(
    cell: Cell, urls: dict[str, str], prompts: dict[int, list[Prompt]], player: TracePlayer, args, fp16_per_token: int
) -> list[dict]:
    """Every policy's requests in one cell, policy after policy (the adaptive daemon's requests
    back to back, so its link model does not idle between them)."""
    return [
        cell_request(cell, policy, url, prompt, player, args, fp16_per_token)
        for policy, url in urls.items()
        for windows in prompts.values()
        for prompt in windows
    ]


def progress_line(record: dict) -> str:
    ttft = "error" if record["ttft_ms"] is None else f"{record['ttft_ms']:.0f} ms"
    kv = (record["report"] or {}).get("kv", {})
    return (
        f"  {record['cell']} | {record['policy']} | {record['prompt_tokens']} tokens #{record['run']}: {ttft}"
        f"{' (censored)' if record['censored'] else ''}; {kv.get('decision')} {record['kv_used']}"
        f"{' (fallback: ' + kv['fallback_reason'] + ')' if kv.get('fallback_reason') else ''}"
    )


def run_grid(
    model: LoadedModel, prompts, warmups: list[Prompt], args: argparse.Namespace
) -> tuple[list[dict], list[dict]]:
    """Start the servers and the shaper, and run every cell: the measured requests, and the
    adaptive daemon's warm-up requests."""
    fp16_per_token = model.spec.kv_bytes_per_token_fp16
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        directory = Path(tmp)
        prefill_config = write_config(directory, "prefill", args)
        _, prefill_url = stack.enter_context(
            running(
                ["prefill-server", "--config", str(prefill_config)],
                directory / "prefill.log",
                **prefill_placement(args),
            )
        )
        host, port = prefill_url.removeprefix("http://").rsplit(":", 1)
        shaper = stack.enter_context(
            LinkShaper(host, int(port), rate_bytes_per_s=PRIME_MBITS * MBIT, delay_s=args.rtt_ms / 2e3)
        )
        player = TracePlayer(shaper, constant(PRIME_MBITS * MBIT), sample_every_s=PROGRESS_EVERY_S)
        steady = {
            name: stack.enter_context(daemon(name, directory, args, shaper.url))
            for name in POLICIES
            if name != "adaptive"
        }
        for url in steady.values():
            timed_request(url, warmups[0] if warmups else prompts[min(prompts)][0], player, args)
        results, warmed = [], []
        for cell in grid(args):
            print(f"{cell.label(args)}:", file=sys.stderr, flush=True)
            with daemon("adaptive", directory, args, shaper.url) as adaptive:
                for prompt in warmups:
                    warmed.append(cell_request(cell, "adaptive", adaptive, prompt, player, args, fp16_per_token))
                    if warmed[-1]["kv_used"] == LOCAL:
                        print("  the warm-up pull failed or was cut: the link stays unknown", file=sys.stderr)
                results += run_cell(cell, {"adaptive": adaptive}, prompts, player, args, fp16_per_token)
            results += run_cell(cell, steady, prompts, player, args, fp16_per_token)
        return results, warmed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = cli.saved_or_measured(args, lambda: measure(args, argv))
    if args.rescore:
        run = rescored(run, args.threads)
        if args.json:
            cli.write_json(run, args.json)
    print_summary(run)
    if args.write_docs:
        write_docs(run, args.docs_dir)
    return 0


def measure(args: argparse.Namespace, argv: list[str] | None) -> dict:
    """The whole grid (see the module docstring); returns the run's record."""
    started = time.time()
    model = load_model()
    prompts, warmups = load_prompts(model, args)
    results, warmed = run_grid(model, prompts, warmups, args)
    print("scoring the quality cost of the KV each request used", file=sys.stderr, flush=True)
    return {
        **cli.record(__file__, argv, started),
        "model": model.record.name,
        "args": cli.settings(args),
        "results": results,
        "warmups": warmed,
        "quality": quality_costs(model, prompts, results, args.continuation_tokens, args.threads),
        "wall_s": round(time.time() - started, 1),
    }


def rescored(run: dict, threads: int) -> dict:
    """A saved run with every request's KV label taken again from its report and the quality of those scored
    again (on ``threads``), with the prompts its arguments chose; the run's own scores kept under
    ``rescored.quality_before``."""
    model = load_model()
    if model.record.name != run["model"]:
        raise SystemExit(f"the run is of {run['model']}; this checkout's default model is {model.record.name}")
    saved = argparse.Namespace(**run["args"])
    prompts, _ = load_prompts(model, saved)
    results = [r | {"kv_used": kv_used(r["report"])} for r in run["results"]]
    print("scoring the quality cost of the KV each request used", file=sys.stderr, flush=True)
    quality = quality_costs(model, prompts, results, saved.continuation_tokens, threads)
    rescore = cli.record(__file__, None, time.time()) | {"quality_before": run["quality"]}
    return run | {"results": results, "quality": quality, "rescored": rescore}


if __name__ == "__main__":
    cli.run(main)

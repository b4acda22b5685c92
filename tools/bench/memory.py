#!/usr/bin/env python3
"""Many conversations under one KV memory budget (issue 14 item 6): completion, KV memory and RSS
against the budget, resume TTFT by how each turn resumed, and the quality cost of compressed resumes.

For each --conversations count N (each conversation --conversation-tokens long, one value per count
or one for all) and each --budgets fraction f, one decode daemon (--slots slots, local prefill,
max_sessions N) gets daemon.kv_memory_mb = f × the conversations' FP16 KV need (their final lengths
× FP16 bytes a token), rounded down to whole MiB; the N conversations take their --turns turns one
at a time in a shuffled order (--seed), each a streamed completion of --max-tokens greedy tokens
(tools/bench/memory_workload.py). A thread samples the daemon's KV memory (/metrics) and RSS every 100 ms
(tools/bench/memory_sampler.py). Every turn's client TTFT and turn report are kept; the report's
``kv.resume`` says whether the conversation was resident in its slot, came back from the compressed
store, or had been evicted (re-prefilled). The daemon's RSS growth over the cell (its most sampled
RSS less its RSS after start) is held to the budget plus the cell's daemon.working_memory_mb
(--working-memory-mb); the RSS goal's weights are the GGUF's bytes.

The default sizes make every cell feasible in principle: the largest turn (last prompt +
max_tokens, float32 in a slot: 2 × its FP16 bytes) must fit the budget with every other
conversation evicted. At 25 % of the FP16 need, N equal conversations of T tokens get a budget of
N × T × FP16 / 4 = N/8 × T float32 tokens: for N = 8 that is exactly one conversation, and whole
MiB (floor) hold it only when T is a multiple of 1024 (T × 46,080 B is then a whole number of MiB,
for SmolLM2). Hence 1024 tokens for 8 conversations; 512 for 32 and 256 for 128 keep the grid's
wall time reasonable on 2 cores.

Then (--resume-runs > 0) a dedicated measurement on its own daemon: a --resume-tokens conversation
is moved to the store (two other conversations take both slots), and its next turn
(--resume-new-tokens more) is sent, against the same prompt sent as a new conversation (prefilled
whole); medians of the runs. Finally (--quality-per-class > 0) conversations with compressed
resumes are replayed in process and scored (tools/study/memory_quality.py). The report, docs/memory.md
and docs/memory.png: tools/bench/memory_report.py and tools/bench/memory_docs.py.

    python tools/bench/memory.py [--conversations 8 32 128] [--conversation-tokens 1024 512 256]
        [--budgets 0.25 0.5 1.0] [--turns 3] [--max-tokens 8] [--seed 0] [--slots 2] [--working-memory-mb 0]
        [--resume-tokens 2048] [--resume-new-tokens 32] [--resume-runs 5] [--quality-per-class 4]
        [--threads 2] [--edge-cpus 0,1] [--json PATH] [--write-docs] [--docs-dir docs]
    python tools/bench/memory.py --report RUN.json [--write-docs --docs-dir DIR]   # a saved run's report
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse
import contextlib
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict

import numpy as np
import psutil

from edgedecode.config import DaemonConfig
from edgedecode.evaluation.texts import pydoc_corpus, token_windows
from edgedecode.model.loader import LoadedModel, load_model
from tools.bench.memory_docs import write_docs
from tools.bench.memory_report import print_summary, resume_kind
from tools.bench.memory_sampler import MemorySampler, scrape
from tools.bench.memory_workload import Budget, Conversation, budget, conversations, schedule
from tools.bench.serve import add_edge_cpus, daemon_placement
from tools.common import cli
from tools.common.servers import StreamedCompletion, running, streamed_completion, toml_config
from tools.study.memory_quality import quality

TURN_TIMEOUT_S = 600.0
END_METRICS = (  # kept from the daemon's /metrics at the end of a cell
    "edgedecode_session_evictions_total",
    "edgedecode_kv_retier_total",
    "edgedecode_active_kv_evicted_tokens_total",
    "edgedecode_kv_memory_peak_bytes",
    "edgedecode_working_memory_peak_bytes",
    "edgedecode_working_memory_allowance_bytes",
)
FILLER_TOKENS = 16  # the prompts of the conversations that push the long one out of its slot
RESUME_BUDGET_MB = 2048  # the 2k daemon's budget: never what decides there


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    p.add_argument("--conversations", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument(
        "--conversation-tokens", type=int, nargs="+", default=[1024, 512, 256], help="one per count, or one for all"
    )
    p.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5, 1.0], help="fractions of the FP16 need")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument(
        "--working-memory-mb",
        type=int,
        default=DaemonConfig.working_memory_mb,
        help="daemon.working_memory_mb of the cells' daemons (0: sized by the daemon)",
    )
    p.add_argument("--resume-tokens", type=int, default=2048)
    p.add_argument("--resume-new-tokens", type=int, default=32)
    p.add_argument("--resume-runs", type=int, default=5, help="0: skip the long-conversation resume")
    p.add_argument("--quality-per-class", type=int, default=4, help="conversations replayed per tier class")
    cli.add_threads(p, help="onnxruntime threads of the daemons and of scoring")
    add_edge_cpus(p)
    cli.add_json_file(p, help="write every raw result here")
    p.add_argument("--write-docs", action="store_true", help="write memory.md and memory.png")
    p.add_argument("--docs-dir", type=Path, default=Path("docs"))
    p.add_argument("--report", type=Path, default=None, help="report a saved run (its --json) instead of running")
    args = p.parse_args(argv)
    if len(args.conversation_tokens) == 1:
        args.conversation_tokens *= len(args.conversations)
    if len(args.conversation_tokens) != len(args.conversations):
        p.error("give one --conversation-tokens value, or one per --conversations count")
    if min(args.conversations) < args.slots or args.turns < 1 or args.max_tokens < 1 or args.resume_runs < 0:
        p.error(
            "need --conversations >= --slots (daemon.max_sessions), --turns >= 1, --max-tokens >= 1, --resume-runs >= 0"
        )
    return args


@contextlib.contextmanager
def daemon(directory: Path, name: str, args: argparse.Namespace, **settings) -> Iterator[tuple[subprocess.Popen, str]]:
    """A local-prefill daemon with ``settings`` as its [daemon] keys, for the block: (process, URL)."""
    config = toml_config(
        directory / f"{name}.toml",
        {
            "model": {"threads": args.threads},
            "daemon": {"slots": args.slots, "local_prefill_only": True, **settings},
        },
    )
    with running(["serve", "--config", str(config)], directory / f"{name}.log", **daemon_placement(args)) as started:
        yield started


def send_turn(url: str, session: str, prompt: np.ndarray, max_tokens: int) -> StreamedCompletion:
    """One greedy streamed turn of conversation ``session``."""
    body = {
        "prompt": prompt.tolist(),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "session_id": session,
    }
    return streamed_completion(url, body, timeout=TURN_TIMEOUT_S)


def run_cell(
    directory: Path, label: str, convs: list[Conversation], cell_budget: Budget, args, weights_bytes: int
) -> dict:
    """One daemon under ``cell_budget``, every conversation's turns in the shuffled order, sampled;
    ``weights_bytes``: the GGUF's size (the RSS goal's weights)."""
    started = time.perf_counter()
    max_context = max(len(c.ids) for c in convs) + args.max_tokens + 8
    settings = {
        "kv_memory_mb": cell_budget.mb,
        "working_memory_mb": args.working_memory_mb,
        "max_sessions": len(convs),
        "max_context": max_context,
    }
    records: list[dict] = []
    completed: set[int] = set()
    with daemon(directory, f"cell-{len(convs)}-{cell_budget.fraction:g}", args, **settings) as (process, url):
        rss_start = psutil.Process(process.pid).memory_info().rss
        with MemorySampler(url, process.pid) as sampler:
            for index, turn in schedule(len(convs), args.turns, args.seed):
                conv = convs[index]
                at = sampler.now()
                done = send_turn(url, conv.session, conv.prompt(turn), args.max_tokens)
                kv = None if done.report is None else done.report["kv"]
                record = {
                    "cell": label,
                    "conversation": index,
                    "turn": turn,
                    "prompt_tokens": len(conv.prompt(turn)),
                    "new_tokens": conv.new_tokens(turn),
                    "started_s": round(at, 3),
                    "ttft_ms": None if done.ttft_s is None else 1e3 * done.ttft_s,
                    "seconds": done.seconds,
                    "error": done.error,
                    "resume": None if kv is None else resume_kind(kv, index in completed),
                    "report": done.report,
                }
                if done.error is None:
                    completed.add(index)
                records.append(record)
                print(_progress(record), file=sys.stderr, flush=True)
        end = {key: value for key, value in scrape(url).items() if key.startswith(END_METRICS)}
    return {
        "label": label,
        "conversations": len(convs),
        "tokens": len(convs[0].ids) + args.max_tokens,
        "turns": args.turns,
        "budget": asdict(cell_budget) | {"nbytes": cell_budget.nbytes, "feasible": cell_budget.feasible},
        "rss_start_bytes": rss_start,
        "working_memory_bytes": int(
            end.get("edgedecode_working_memory_allowance_bytes{}", args.working_memory_mb << 20)
        ),
        "weights_bytes": weights_bytes,
        "records": records,
        "kv_samples": sampler.kv_rows,
        "rss_samples": sampler.rss_rows,
        "metrics_end": end,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def _progress(record: dict) -> str:
    outcome = record["error"] or f"TTFT {record['ttft_ms']:.0f} ms, {record['resume']}"
    return f"  {record['cell']} | conversation {record['conversation']} turn {record['turn']}: {outcome}"


def resume_2k(directory: Path, model: LoadedModel, args: argparse.Namespace) -> dict:
    """A long conversation's next turn resumed from the store against the same prompt prefilled whole
    (see the module docstring), ``--resume-runs`` times on one daemon."""
    long, filler = token_windows(
        model.tokenizer, pydoc_corpus(), args.resume_tokens + args.resume_new_tokens, 2
    )  # the second window's start is the fillers' prompt
    first, second, short = long[: args.resume_tokens], long, filler[:FILLER_TOKENS]
    settings = {
        "kv_memory_mb": RESUME_BUDGET_MB,
        "max_sessions": 4 * args.resume_runs + args.slots,
        "max_context": len(second) + args.max_tokens + 8,
    }
    runs = []
    with daemon(directory, "resume", args, **settings) as (_, url):
        send_turn(url, "warm-up", short, args.max_tokens)
        for run in range(args.resume_runs):
            send_turn(url, f"long-{run}", first, args.max_tokens)
            for name in ("b", "c"):  # the second takes the long conversation's slot: it goes to the store
                send_turn(url, f"filler-{name}-{run}", short, args.max_tokens)
            resumed = _succeeded(send_turn(url, f"long-{run}", second, args.max_tokens), run)
            fresh = _succeeded(send_turn(url, f"fresh-{run}", second, args.max_tokens), run)
            runs.append(
                {
                    "resume_ms": 1e3 * resumed.ttft_s,
                    "reprefill_ms": 1e3 * fresh.ttft_s,
                    "resumed_as": resumed.report["kv"].get("resume"),
                    "restored_tiers": resumed.report["kv"]["restored_tiers"],
                    "resume_report": resumed.report,
                    "reprefill_report": fresh.report,
                }
            )
            print(
                f"  {args.resume_tokens}-token resume run {run}: {runs[-1]['resume_ms']:.0f} ms resumed "
                f"({runs[-1]['resumed_as']}), {runs[-1]['reprefill_ms']:.0f} ms re-prefilled",
                file=sys.stderr,
                flush=True,
            )
    compressed = [r for r in runs if r["restored_tiers"]]  # the medians count only runs that did come back from it
    return {
        "context_tokens": args.resume_tokens,
        "new_tokens": args.resume_new_tokens,
        "runs": runs,
        "resume_ms": statistics.median(r["resume_ms"] for r in compressed) if compressed else None,
        "reprefill_ms": statistics.median(r["reprefill_ms"] for r in compressed) if compressed else None,
    }


def _succeeded(done: StreamedCompletion, run: int) -> StreamedCompletion:
    """``done``, which must have succeeded (the long-conversation measurement has no use for a failed turn)."""
    if done.error is not None or done.report is None or done.ttft_s is None:
        raise SystemExit(f"a turn of the long-conversation resume run {run} failed: {done.error}")
    return done


def run_grid(directory: Path, model: LoadedModel, args: argparse.Namespace, slot_per_token: int) -> tuple[list, dict]:
    """Every cell, in order: (the cells' records, each cell's conversations by its label)."""
    cells, by_label = [], {}
    for count, tokens in zip(args.conversations, args.conversation_tokens):
        convs = conversations(model.tokenizer, count, tokens, args.turns, args.max_tokens)
        for fraction in args.budgets:
            cell_budget = budget(convs, args.max_tokens, fraction, model.spec.kv_bytes_per_token_fp16, slot_per_token)
            label = f"{count} conversations, {100 * fraction:g} %"
            fits = "fits" if cell_budget.feasible else "DOES NOT FIT: not feasible in principle"
            print(
                f"{label}: {tokens} tokens each, budget {cell_budget.mb} MiB ({cell_budget.exact_bytes:,.0f} B "
                f"exact), largest turn {cell_budget.largest_turn_bytes / (1 << 20):.2f} MiB: {fits}",
                file=sys.stderr,
                flush=True,
            )
            cells.append(run_cell(directory, label, convs, cell_budget, args, model.record.size_bytes))
            by_label[label] = convs
    return cells, by_label


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = cli.saved_or_measured(args, lambda: measure(args, argv))
    print_summary(run)
    if args.write_docs:
        write_docs(run, args.docs_dir)
    return 0


def measure(args: argparse.Namespace, argv: list[str] | None) -> dict:
    """The whole grid (see the module docstring); returns the run's record."""
    started = time.time()
    model = load_model()
    slot_per_token = 2 * model.spec.kv_bytes_per_token_fp16  # the slots hold float32 KV
    with tempfile.TemporaryDirectory() as tmp:
        cells, by_label = run_grid(Path(tmp), model, args, slot_per_token)
        resume = resume_2k(Path(tmp), model, args) if args.resume_runs else None
    print("replaying and scoring compressed resumes", file=sys.stderr, flush=True)
    records = [r for cell in cells for r in cell["records"]]
    return {
        **cli.record(__file__, argv, started),
        "model": model.record.name,
        "args": cli.settings(args),
        "bytes_per_token": {"fp16": model.spec.kv_bytes_per_token_fp16, "slot": slot_per_token},
        "cells": cells,
        "resume_2k": resume,
        "quality": quality(model, by_label, records, args.quality_per_class, args.max_tokens, args.threads, args.seed),
        "wall_s": round(time.time() - started, 1),
    }


if __name__ == "__main__":
    cli.run(main)

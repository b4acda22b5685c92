#!/usr/bin/env python3
"""Where the decode daemon's memory goes: the process's RSS after each stage of what the daemon does
at start and on a turn, for onnxruntime's default CPU session settings and the variants that could
cut memory (the prefill chunk; no CPU memory arena; no weight prepacking) or that they replaced (the arena
kept after prompt runs, as before issue 34), each measured in a fresh
process with the daemon's heap settings (serving/heap.py).

Stages (a daemon's own order): Python and the imports; the model's spec and tokenizer (the GGUF
reader is dropped once they are read); the INT4 decode session the daemon ships, with --slots engines
(the weights: the GGUF's blocks mapped from the graph's side file in the own kernels' form, onnxruntime's
prepacked copies in the stock one; the slots' KV buffers commit no page yet); a --prompt-tokens turn
of prose (tools/bench/prompts.py) computed locally plus 16 decode steps (its KV, float32, and the
activations); the KV given back (``Engine.release_unused``: what stays is onnxruntime's working
memory); a second such turn. Then the peak (VmHWM) and how much of the graph's side file is resident
(onnxruntime maps it). Speed: the prefill's CPU ms per token over the two turns, and the median ms
per decode token of 64 steps after a 16-token prompt over --runs runs, each as a ratio against the
first variant measured in the same run.

    python tools/bench/rss_breakdown.py [--model NAME] [--variants NAME ...] [--prompt-tokens 2048] [--slots 2]
                                  [--max-context 4096] [--threads 2] [--runs 3] [--json FILE]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse
import json
import statistics
import subprocess
import time

from tools.common import cli

VARIANTS = {
    "default": {},
    "prefill chunk 512": {"chunk": 512},
    "prefill chunk 128": {"chunk": 128},
    "no CPU memory arena": {"arena": False, "shrink": False},  # no arena to shrink (onnxruntime refuses the option)
    "no prepacking": {"config": {"session.disable_prepacking": "1"}},
    "arena kept after prompt runs": {"shrink": False},
}
DEFAULT_VARIANTS = ["default", "prefill chunk 512", "no CPU memory arena"]  # no prepacking: ~70x slower decode


def measure(variant: dict, model_name: str | None, sizes: tuple[int, int, int, int, int]) -> dict:
    """The stages' RSS (MiB), the peak and the speeds in this process, under ``variant``'s settings."""
    import psutil

    from edgedecode.serving.heap import return_freed_buffers

    return_freed_buffers()
    prompt_tokens, slots, max_context, threads, runs = sizes
    process = psutil.Process()

    def rss_mib() -> float:
        return process.memory_info().rss / (1 << 20)

    stages = [("python", rss_mib())]
    import numpy as np

    from edgedecode.model.loader import load_model
    from edgedecode.runtime import engine as engine_module
    from edgedecode.runtime import runner as runner_module
    from edgedecode.runtime.engine import Engine
    from edgedecode.runtime.sampler import SamplingParams
    from edgedecode.runtime.session import decode_options, import_onnxruntime
    from tools.bench.prompts import prompt_tokens as prose

    ort = import_onnxruntime()
    stages.append(("imports (numpy, onnxruntime, tokenizers, ...)", rss_mib()))
    _configure_sessions(ort, variant)
    engine_module.PREFILL_CHUNK_TOKENS = variant.get("chunk", engine_module.PREFILL_CHUNK_TOKENS)
    runner_module.SHRINK_ARENA_AFTER_PROMPT_RUNS = variant.get("shrink", runner_module.SHRINK_ARENA_AFTER_PROMPT_RUNS)
    model = load_model(model_name)
    stages.append(("model spec and tokenizer", rss_mib()))
    options = decode_options("cpu")  # the graph the daemon ships here: the own kernels' form where they load
    first = Engine(model, options, max_context=max_context, device="cpu", threads=threads)
    engines = [first] + [
        Engine(model, options, max_context=max_context, device="cpu", threads=threads, share=first)
        for _ in range(slots - 1)
    ]
    stages.append((f"INT4 decode session, {slots} slots", rss_mib()))
    rng = np.random.default_rng(0)
    greedy = SamplingParams(max_tokens=16, temperature=0, stop_token_ids=())
    engine = engines[0]
    text = prose(model.tokenizer, prompt_tokens + 1)
    prefill_cpu = []
    for turn, prompt in enumerate((text[:-1], text[1:])):  # two prompts: the second reuses no prefix
        started = time.process_time()
        for _ in engine.generate(prompt, greedy):
            if not prefill_cpu[turn:]:
                prefill_cpu.append((time.process_time() - started) / prompt_tokens)
        stages.append((f"a {'second ' if turn else ''}{prompt_tokens}-token turn + 16 steps", rss_mib()))
        engine.reset()
        engine.release_unused()
        if not turn:
            stages.append(("its KV given back", rss_mib()))
    steps = SamplingParams(max_tokens=65, temperature=0, stop_token_ids=())
    per_token = []
    for _ in range(runs):
        started = time.perf_counter()
        list(engine.generate(rng.integers(100, model.spec.vocab_size, 16), steps))
        per_token.append((time.perf_counter() - started - engine.stats.prefill_seconds) / engine.stats.decode_steps)
    return {
        "stages": stages,
        "peak_mib": _peak_rss_mib(),
        "side_file_mib": _side_file_rss_mib(),
        "kv_bytes_per_token": engine.kv_bytes_per_slot,
        "prefill_cpu_ms_per_token": 1e3 * statistics.median(prefill_cpu),
        "decode_ms_per_token": 1e3 * statistics.median(per_token),
    }


def _peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def _side_file_rss_mib() -> float:
    """Resident MiB of the mappings of graph side files (``*.onnx.data``), which onnxruntime maps."""
    resident, in_side_file = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if not fields[0].endswith(":"):  # a mapping's header: address range, perms, offset, dev, inode, path
                in_side_file = fields[-1].endswith(".onnx.data")
            elif in_side_file and fields[0] == "Rss:":
                resident += int(fields[1])
    return resident / 1024


def _configure_sessions(ort, variant: dict) -> None:
    """Make every onnxruntime session this process creates use ``variant``'s settings."""
    base = ort.SessionOptions

    def options():
        made = base()
        made.enable_cpu_mem_arena = variant.get("arena", True)
        for key, value in variant.get("config", {}).items():
            made.add_session_config_entry(key, value)
        return made

    ort.SessionOptions = options


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    cli.add_model(parser)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=DEFAULT_VARIANTS)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--max-context", type=int, default=4096)
    cli.add_threads(parser)
    cli.add_runs(parser, 3)
    cli.add_json_file(parser)
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # a child process measuring one variant
    args = parser.parse_args(argv)
    sizes = (args.prompt_tokens, args.slots, args.max_context, args.threads, args.runs)
    if args.variant:
        print(json.dumps(measure(VARIANTS[args.variant], args.model, sizes)))
        return
    results = {}
    for name in args.variants:
        child = subprocess.run(
            [sys.executable, __file__, "--variant", name, *_size_args(args)], capture_output=True, text=True, check=True
        )
        results[name] = json.loads(child.stdout.strip().splitlines()[-1])
    _print(results, args.prompt_tokens)
    if args.json:
        cli.write_json(results, args.json, indent=2)


def _size_args(args: argparse.Namespace) -> list[str]:
    return [
        *([f"--model={args.model}"] if args.model else []),
        f"--prompt-tokens={args.prompt_tokens}",
        f"--slots={args.slots}",
        f"--max-context={args.max_context}",
        f"--threads={args.threads}",
        f"--runs={args.runs}",
    ]


def _print(results: dict, prompt_tokens: int) -> None:
    names = list(results)
    print("| stage | " + " | ".join(f"{name}: RSS MiB (Δ)" for name in names) + " |")
    print("|---|" + "---|" * len(names))
    for i, (stage, _) in enumerate(results[names[0]]["stages"]):
        cells = []
        for name in names:
            rss = results[name]["stages"][i][1]
            delta = rss - results[name]["stages"][i - 1][1] if i else 0.0
            cells.append(f"{rss:.0f} ({delta:+.0f})")
        print(f"| {stage} | " + " | ".join(cells) + " |")
    for label, key in (("peak (VmHWM)", "peak_mib"), ("of it the graph's side file, at the end", "side_file_mib")):
        print(f"| {label} | " + " | ".join(f"{results[name][key]:.0f}" for name in names) + " |")
    for label, key in (("prefill CPU", "prefill_cpu_ms_per_token"), ("decode at past 16", "decode_ms_per_token")):
        baseline = results[names[0]][key]
        cells = " | ".join(f"{r[key]:.2f} ({r[key] / baseline:.2f}×)" for r in results.values())
        print(f"| {label} ms/token (ratio) | {cells} |")
    kv_mib = results[names[0]]["kv_bytes_per_token"] * prompt_tokens / (1 << 20)
    print(f"\na {prompt_tokens}-token turn's KV: {kv_mib:.0f} MiB")


if __name__ == "__main__":
    cli.run(main)

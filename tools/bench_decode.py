#!/usr/bin/env python3
"""Decode and prefill speed of edgedecode's INT4 graph, against llama.cpp on the same GGUF when available.

Both engines get the same prompt tokens (CPython's pydoc_data prose), the same thread count and the
same greedy decoding (EOS ignored). Runs alternate between the engines so that host drift hits both
alike; the tables show medians over the runs and the ratio edgedecode / llama.cpp. Peak RSS is
measured in a fresh subprocess per engine (prompt of the largest past length, then decoding).

    python tools/bench_decode.py [--runs 5] [--threads 2] [--past 16 512 2048] [--json]

llama.cpp comes from the optional extra: pip install -e '.[bench]' (llama-cpp-python, built from source).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pydoc_data.topics import topics

import numpy as np

from edgedecode.decode.engine import Engine
from edgedecode.decode.sampler import SamplingParams
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import load_model

DECODE_STEPS = 64


def prompt_tokens(tokenizer, n: int) -> np.ndarray:
    """The first n tokens of CPython's bundled documentation prose."""
    text = "\n\n".join(topics[key] for key in sorted(topics))
    ids = tokenizer.encode(text[: n * 8])
    if len(ids) < n:
        raise SystemExit(f"not enough prose for a {n}-token prompt")
    return np.asarray(ids[:n], np.int64)


class EdgeDecodeRunner:
    name = "edgedecode"

    def __init__(self, model, threads: int, context: int, accuracy_level: int, device: str) -> None:
        dtype = "float16" if device == "cuda" else "float32"
        self.engine = Engine(model, GraphOptions("decode", dtype, accuracy_level), max_context=context,
                             threads=threads, device=device)

    def run(self, ids: np.ndarray) -> tuple[float, float]:
        """(prefill tokens/s, decode tokens/s) for one prompt."""
        params = SamplingParams(max_tokens=DECODE_STEPS + 1, stop_token_ids=())
        for _ in self.engine.generate(ids, params):
            pass
        stats = self.engine.stats
        return stats.prefill_tokens_per_second, stats.decode_tokens_per_second


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python's C API (the high-level eval() keeps only n_batch logit rows)."""

    name = "llama.cpp"

    def __init__(self, gguf_path, threads: int, context: int) -> None:
        import llama_cpp
        from llama_cpp import Llama

        self.api = llama_cpp
        self.llm = Llama(str(gguf_path), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, n_ubatch=512, logits_all=False, verbose=False, seed=0)
        self.ctx = self.llm._ctx.ctx
        self.vocab = self.llm.n_vocab()

    def _decode(self, tokens: list[int]) -> int:
        """Feed tokens (in n_batch pieces); return the greedy next token."""
        api = self.api
        for start in range(0, len(tokens), 512):
            piece = tokens[start:start + 512]
            array = (api.llama_token * len(piece))(*piece)  # must outlive the batch that points at it
            if api.llama_decode(self.ctx, api.llama_batch_get_one(array, len(piece))):
                raise RuntimeError("llama_decode failed")
        logits = np.ctypeslib.as_array(api.llama_get_logits_ith(self.ctx, -1), shape=(self.vocab,))
        return int(np.argmax(logits))

    def run(self, ids: np.ndarray) -> tuple[float, float]:
        self.api.llama_memory_clear(self.api.llama_get_memory(self.ctx), True)
        started = time.perf_counter()
        token = self._decode(ids.tolist())
        first = time.perf_counter()
        for _ in range(DECODE_STEPS):
            token = self._decode([token])
        done = time.perf_counter()
        return len(ids) / (first - started), DECODE_STEPS / (done - first)


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def make_runner(name: str, args, model):
    context = max(args.past) + DECODE_STEPS + 8
    if name == "llama.cpp":
        return LlamaCppRunner(model.record.gguf_path, args.threads, context)
    return EdgeDecodeRunner(model, args.threads, context, args.accuracy_level, args.device)


def peak_rss_mib(engine: str, args) -> float | None:
    """Peak RSS of a fresh process that runs one engine at the largest past length."""
    cmd = [sys.executable, __file__, "--rss-child", engine, "--threads", str(args.threads),
           "--accuracy-level", str(args.accuracy_level), "--past", str(max(args.past)), "--device", args.device]
    if args.model:
        cmd += ["--model", args.model]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        print(f"RSS run for {engine} failed: {result.stderr.strip()[-500:]}", file=sys.stderr)
        return None
    return float(result.stdout.strip().splitlines()[-1])


def rss_child(args) -> None:
    model = load_model(args.model)
    runner = make_runner(args.rss_child, args, model)
    runner.run(prompt_tokens(model.tokenizer, max(args.past)))
    print(own_peak_rss_mib())


def own_peak_rss_mib() -> float:
    """This process's peak RSS. Linux's ru_maxrss survives fork+exec (it would report the parent's
    peak), so read the per-address-space high-water mark VmHWM where there is one."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--past", type=int, nargs="+", default=[16, 512, 2048])
    parser.add_argument("--accuracy-level", type=int, default=4)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda runs the float16 graphs on onnxruntime-gpu (llama.cpp is then skipped: "
                             "the [bench] extra builds it for the CPU)")
    parser.add_argument("--no-llama", action="store_true", help="Skip llama.cpp even if it is installed.")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_child:
        return rss_child(args)

    model = load_model(args.model)
    with_llama = not args.no_llama and args.device == "cpu" and llama_cpp_available()
    names = ["edgedecode"] + (["llama.cpp"] if with_llama else [])
    runners = [make_runner(name, args, model) for name in names]
    prompts = {p: prompt_tokens(model.tokenizer, p) for p in args.past}
    samples = {(r.name, p): [] for r in runners for p in args.past}
    for runner in runners:  # warm-up, not measured
        runner.run(prompts[min(args.past)])
    for _ in range(args.runs):
        for past in args.past:
            for runner in runners:
                samples[(runner.name, past)].append(runner.run(prompts[past]))
    results = {"device": args.device, "threads": args.threads, "runs": args.runs, "decode_steps": DECODE_STEPS,
               "accuracy_level": args.accuracy_level, "machine": platform.processor() or platform.machine(),
               "engines": {}}
    for runner in runners:
        results["engines"][runner.name] = {
            "peak_rss_mib": peak_rss_mib(runner.name, args),
            "past": {str(p): {"prefill_tok_s": statistics.median(s[0] for s in samples[(runner.name, p)]),
                              "decode_tok_s": statistics.median(s[1] for s in samples[(runner.name, p)])}
                     for p in args.past},
        }
    if "llama.cpp" in results["engines"]:
        ours, theirs = (results["engines"][name]["past"] for name in ("edgedecode", "llama.cpp"))
        results["ratio_edgedecode_over_llama_cpp"] = {
            past: {metric: ours[past][metric] / theirs[past][metric] for metric in ("prefill_tok_s", "decode_tok_s")}
            for past in ours}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{args.device}: median of {args.runs} alternating runs, {args.threads} threads, "
          f"{DECODE_STEPS} greedy decode steps")
    print(f"{'engine':<12}{'past':>6}{'prefill tok/s':>15}{'decode tok/s':>14}{'decode ratio':>14}")
    engines = results["engines"]
    for past in map(str, args.past):
        for name, result in engines.items():
            row = result["past"][past]
            ratio = ""
            if name == "edgedecode" and "llama.cpp" in engines:
                ratio = f"{row['decode_tok_s'] / engines['llama.cpp']['past'][past]['decode_tok_s']:.2f}x"
            print(f"{name:<12}{past:>6}{row['prefill_tok_s']:>15.1f}{row['decode_tok_s']:>14.1f}{ratio:>14}")
    for name, result in engines.items():
        rss = result["peak_rss_mib"]
        print(f"peak RSS {name}: {'n/a' if rss is None else f'{rss:.0f} MiB'}")


if __name__ == "__main__":
    main()

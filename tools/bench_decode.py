#!/usr/bin/env python3
"""Decode and prefill speed of edgedecode's INT4 graph, against llama.cpp on the same GGUF when available.

Both engines get the same prompt tokens (CPython's pydoc_data prose), the same thread count and the
same greedy decoding (EOS ignored). Runs alternate between the engines so that host drift hits both
alike; the tables show medians over the runs and the ratio edgedecode / llama.cpp. Peak RSS is
measured in a fresh subprocess per engine (prompt of the largest past length, then decoding).

With --device cuda the two engines are edgedecode's decode step replayed as a CUDA graph and the
same graph run step by step without one ("edgedecode-no-graph"), so their ratio is measured on the
same card; each also reports first-token latency (short chat prompt, 2k-token prompt) and the
ingest of a 4k-token KV (upload alone; upload plus the first token; and, where the EDKV wire format
is installed, decoding an all-INT4 payload of it alone, and streaming that payload into the engine
then resuming).

    python tools/bench_decode.py [--runs 5] [--threads 2] [--past 16 512 2048] [--json]
    python tools/bench_decode.py --device cuda [--runs 7] [--no-rss] [--q4-1 zero_point] [--json]

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

from edgedecode.model.graph import DEVICE_Q4_1, Q4_1_MODES, GraphOptions
from edgedecode.model.loader import load_model
from edgedecode.runtime.engine import Engine
from edgedecode.runtime.sampler import SamplingParams

DECODE_STEPS = 64
INGEST_TOKENS = 4096  # the KV payload whose ingest --device cuda times
FIRST_TOKEN_PROMPTS = {"chat": None, "2k": 2048}  # None: a short chat prompt


def prompt_tokens(tokenizer, n: int) -> np.ndarray:
    """The first n tokens of CPython's bundled documentation prose."""
    text = "\n\n".join(topics[key] for key in sorted(topics))
    ids = tokenizer.encode(text[: n * 8])
    if len(ids) < n:
        raise SystemExit(f"not enough prose for a {n}-token prompt")
    return np.asarray(ids[:n], np.int64)


class EdgeDecodeRunner:
    def __init__(
        self,
        model,
        threads: int,
        context: int,
        accuracy_level: int,
        device: str,
        cuda_graph: bool = True,
        q4_1: str = "correction",
    ) -> None:
        dtype = "float16" if device == "cuda" else "float32"
        self.name = "edgedecode" if cuda_graph or device != "cuda" else "edgedecode-no-graph"
        self.engine = Engine(
            model,
            GraphOptions("decode", dtype, accuracy_level, q4_1=q4_1),
            max_context=context,
            threads=threads,
            device=device,
            cuda_graph=cuda_graph,
        )
        if device == "cuda" and cuda_graph and not self.engine.cuda_graph:
            raise SystemExit("onnxruntime refused CUDA graph capture for this graph (see the log)")

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
        self.llm = Llama(
            str(gguf_path),
            n_ctx=context,
            n_threads=threads,
            n_threads_batch=threads,
            n_batch=512,
            n_ubatch=512,
            logits_all=False,
            verbose=False,
            seed=0,
        )
        self.ctx = self.llm._ctx.ctx
        self.vocab = self.llm.n_vocab()

    def _decode(self, tokens: list[int]) -> int:
        """Feed tokens (in n_batch pieces); return the greedy next token."""
        api = self.api
        for start in range(0, len(tokens), 512):
            piece = tokens[start : start + 512]
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


def bench_context(args) -> int:
    longest = max(args.past) + DECODE_STEPS + 8
    return max(longest, INGEST_TOKENS + 8) if args.device == "cuda" else longest


def make_runner(name: str, args, model):
    context = bench_context(args)
    if name == "llama.cpp":
        return LlamaCppRunner(model.record.gguf_path, args.threads, context)
    return EdgeDecodeRunner(
        model,
        args.threads,
        context,
        args.accuracy_level,
        args.device,
        cuda_graph=name != "edgedecode-no-graph",
        q4_1=args.q4_1,
    )


def first_token_ms(engine: Engine, ids: np.ndarray) -> float:
    """From the call to generate() to the first token in hand (prompt pass, then sampling)."""
    started = time.perf_counter()
    next(iter(engine.generate(ids, SamplingParams(max_tokens=1, stop_token_ids=()))))
    return (time.perf_counter() - started) * 1e3


def ingest_ms(engine: Engine, ids: np.ndarray, kv, payload: bytes | None) -> dict[str, float]:
    """One ingest of ``kv`` (a snapshot of ``ids``): the KV upload alone (from the snapshot's dtype,
    and from float32 as the wire decoder returns it); resuming from it (prefill with kv: upload,
    then the last prompt token to first-token logits); and, given an EDKV payload of it, decoding
    the payload alone, and streaming it into the engine then resuming."""
    n = len(ids) - 1
    keys32, values32 = kv.keys.astype(np.float32), kv.values.astype(np.float32)
    started = time.perf_counter()
    engine.cache.update(0, keys32[:, :, :n], values32[:, :, :n])
    uploaded32 = time.perf_counter()
    engine.cache.update(0, kv.keys[:, :, :n], kv.values[:, :, :n])
    uploaded = time.perf_counter()
    engine.prefill(ids, kv=kv)
    resumed = time.perf_counter()
    times = {
        "upload_ms": (uploaded - uploaded32) * 1e3,
        "upload_from_float32_ms": (uploaded32 - started) * 1e3,
        "resume_ms": (resumed - uploaded) * 1e3,
    }
    if payload is not None:
        from edgedecode.kv.wire import decode_snapshot

        started = time.perf_counter()
        decode_snapshot(payload, engine.spec.kv_contract)
        times["edkv_int4_decode_ms"] = (time.perf_counter() - started) * 1e3
        started = time.perf_counter()
        reader = engine.open_kv_stream(ids)
        reader.feed(payload)
        engine.prefill(ids, reader)
        times["edkv_int4_stream_and_resume_ms"] = (time.perf_counter() - started) * 1e3
    return times


def int4_payload(kv) -> bytes | None:
    """An all-INT4 EDKV payload of ``kv``, or None where the wire format is not installed."""
    try:
        from edgedecode.kv.tiers import Tier
        from edgedecode.kv.wire import encode_payload
    except ImportError as exc:
        print(f"EDKV ingest not measured: {exc}", file=sys.stderr)
        return None
    return b"".join(encode_payload(kv, np.full(kv.n_tokens, Tier.INT4, np.uint8)))


def cuda_extras(runners, model, args) -> dict:
    """First-token latency and 4k-token KV ingest of each CUDA runner (medians over args.runs)."""
    tokenizer = model.tokenizer
    prompts = {
        name: (
            np.asarray(tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}]), np.int64)
            if n is None
            else prompt_tokens(tokenizer, n)
        )
        for name, n in FIRST_TOKEN_PROMPTS.items()
    }
    ingest_ids = prompt_tokens(tokenizer, INGEST_TOKENS)
    runners[0].engine.prefill(ingest_ids)
    kv = runners[0].engine.export_kv()
    payload = int4_payload(kv)
    extras = {}
    for runner in runners:
        first = {name: [] for name in prompts}
        ingests = []
        for _ in range(args.runs):
            for name, ids in prompts.items():
                first[name].append(first_token_ms(runner.engine, ids))
            ingests.append(ingest_ms(runner.engine, ingest_ids, kv, payload))
        extras[runner.name] = {
            "first_token_ms": {
                f"{name} ({len(prompts[name])} tokens)": statistics.median(v) for name, v in first.items()
            },
            f"ingest_{INGEST_TOKENS}_tokens": {key: statistics.median(i[key] for i in ingests) for key in ingests[0]},
        }
    if payload is not None:
        extras["edkv_int4_payload_bytes"] = len(payload)
    return extras


def cuda_machine() -> dict:
    """Card, driver and onnxruntime version, for the record."""
    import onnxruntime

    info = {"onnxruntime": onnxruntime.__version__, "python": platform.python_version()}
    try:
        query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        info["gpu"] = subprocess.run(query, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        info["gpu"] = f"unknown ({exc})"
    return info


def peak_rss_mib(engine: str, args) -> float | None:
    """Peak RSS of a fresh process that runs one engine at the largest past length."""
    cmd = [
        sys.executable,
        __file__,
        "--rss-child",
        engine,
        "--threads",
        str(args.threads),
        "--accuracy-level",
        str(args.accuracy_level),
        "--past",
        str(max(args.past)),
        "--device",
        args.device,
        "--q4-1",
        args.q4_1,
    ]
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


def plot_decode(results: dict, path: str) -> None:
    """Decode (and prefill) tokens/s against past length, one line per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (decode, prefill) = plt.subplots(1, 2, figsize=(11, 4))
    for name, engine in results["engines"].items():
        pasts = sorted(engine["past"], key=int)
        decode.plot([int(p) for p in pasts], [engine["past"][p]["decode_tok_s"] for p in pasts], marker="o", label=name)
        prefill.plot(
            [int(p) for p in pasts], [engine["past"][p]["prefill_tok_s"] for p in pasts], marker="o", label=name
        )
    where = results.get("gpu") or f"{results['machine']}, {results['threads']} threads"
    decode.set(xscale="log", xlabel="past length (tokens)", ylabel="decode tokens/s", title=f"Decode, {where}")
    prefill.set(xscale="log", xlabel="prompt length (tokens)", ylabel="prefill tokens/s", title="Prompt processing")
    for ax in (decode, prefill):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--past", type=int, nargs="+", default=[16, 512, 2048, 4096])
    parser.add_argument("--plot", help="Also draw decode tok/s against past length per engine into this PNG.")
    parser.add_argument("--accuracy-level", type=int, default=4)
    parser.add_argument(
        "--q4-1",
        choices=Q4_1_MODES,
        default=None,
        help="how the decode graph applies Q4_1's offsets (GraphOptions.q4_1; default: the "
        "device's shipped form, zero_point on cuda, correction on cpu)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda runs the float16 graphs on onnxruntime-gpu (llama.cpp is then skipped: "
        "the [bench] extra builds it for the CPU)",
    )
    parser.add_argument("--no-llama", action="store_true", help="Skip llama.cpp even if it is installed.")
    parser.add_argument("--no-rss", action="store_true", help="Skip the peak-RSS subprocess runs.")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.q4_1 = args.q4_1 or DEVICE_Q4_1[args.device]
    if args.rss_child:
        return rss_child(args)

    model = load_model(args.model)
    with_llama = not args.no_llama and args.device == "cpu" and llama_cpp_available()
    names = (
        ["edgedecode"]
        + (["llama.cpp"] if with_llama else [])
        + (["edgedecode-no-graph"] if args.device == "cuda" else [])
    )
    runners = [make_runner(name, args, model) for name in names]
    prompts = {p: prompt_tokens(model.tokenizer, p) for p in args.past}
    samples = {(r.name, p): [] for r in runners for p in args.past}
    for runner in runners:  # warm-up, not measured
        runner.run(prompts[min(args.past)])
    for _ in range(args.runs):
        for past in args.past:
            for runner in runners:
                samples[(runner.name, past)].append(runner.run(prompts[past]))
    results = {
        "device": args.device,
        "threads": args.threads,
        "runs": args.runs,
        "decode_steps": DECODE_STEPS,
        "accuracy_level": args.accuracy_level,
        "q4_1": args.q4_1,
        "machine": platform.processor() or platform.machine(),
        "context": bench_context(args),
        "engines": {},
    }
    if args.device == "cuda":
        results.update(cuda_machine())
    for runner in runners:
        results["engines"][runner.name] = {
            "peak_rss_mib": None if args.no_rss else peak_rss_mib(runner.name, args),
            "past": {
                str(p): {
                    "prefill_tok_s": statistics.median(s[0] for s in samples[(runner.name, p)]),
                    "decode_tok_s": statistics.median(s[1] for s in samples[(runner.name, p)]),
                }
                for p in args.past
            },
        }
    if args.device == "cuda":
        results["cuda"] = cuda_extras(runners, model, args)
        graph, plain = (results["engines"][name]["past"] for name in ("edgedecode", "edgedecode-no-graph"))
        results["ratio_graph_over_no_graph"] = {
            past: graph[past]["decode_tok_s"] / plain[past]["decode_tok_s"] for past in graph
        }
    if "llama.cpp" in results["engines"]:
        ours, theirs = (results["engines"][name]["past"] for name in ("edgedecode", "llama.cpp"))
        results["ratio_edgedecode_over_llama_cpp"] = {
            past: {metric: ours[past][metric] / theirs[past][metric] for metric in ("prefill_tok_s", "decode_tok_s")}
            for past in ours
        }
    if args.plot:
        plot_decode(results, args.plot)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"{args.device}: median of {args.runs} alternating runs, {args.threads} threads, "
        f"{DECODE_STEPS} greedy decode steps"
    )
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
    if args.device == "cuda":
        print(f"{results['gpu']}, onnxruntime {results['onnxruntime']}, context {results['context']}")
        for past, ratio in results["ratio_graph_over_no_graph"].items():
            print(f"past {past}: CUDA graph / no graph decode {ratio:.2f}x")
        for name, extra in results["cuda"].items():
            print(f"{name}: {json.dumps(extra)}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Decode and prefill speed of edgedecode's INT4 graph, against llama.cpp on the same GGUF when available.

Both engines get the same prompt tokens (CPython's pydoc_data prose), the same thread count and the
same greedy decoding (EOS ignored). Runs alternate between the engines so that host drift hits both
alike; the tables show medians over the runs and the ratio edgedecode / llama.cpp. Peak RSS is
measured in a fresh subprocess per engine (prompt of the largest past length, then decoding).

With --device cuda the engines are edgedecode's float16 decode step replayed as a CUDA graph (as shipped: on
its own fused CUDA ops where their kernels compile for the card; and on the stock MatMulNBits, "edgedecode-stock"),
llama.cpp with every layer on the same card (where llama-cpp-python was built with GPU offload: CMAKE_ARGS=
"-DGGML_CUDA=on"), and edgedecode's graph run step by step without a CUDA graph ("edgedecode-no-graph"),
so every ratio is measured on one card in one run; edgedecode's engines also report first-token latency
(short chat prompt, 2k-token prompt) and the ingest of a 4k-token KV (upload alone; upload plus the
first token; and, where the EDKV wire format is installed, decoding an all-INT4 payload of it alone, and
streaming that payload into the engine then resuming). --no-extras leaves out the no-graph engine and
those figures. Each engine's GPU memory is measured like its RSS, in a fresh process, and the card's
read bandwidth (PyTorch, in a process of its own) gives each engine's fraction of the bound.

On the CPU it also reports bytes read per token (tools/bench/step_bytes.py), this machine's read bandwidth
with the same threads (tools/bench/membw.py, measured in the same invocation), each engine's fraction of
that bound, RSS / (weights + KV), and the load average before and after (a loaded host shows itself).

    python tools/bench/decode.py [--model NAME | --gguf PATH | --shape NAME --type T] [--runs 5]
        [--threads 2] [--past 16 512 2048] [--json] [--json-out FILE] [--plot PNG]
    python tools/bench/decode.py --device cuda [--runs 7] [--no-rss] [--no-extras] [--q4-1 zero_point] [--json]

llama.cpp comes from the optional extra: pip install -e '.[bench]' (llama-cpp-python, built from source).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

# Import order matters on the CUDA test host (shared/GPU.md): llama.cpp's model loading crashes when numpy
# was imported before llama_cpp, and onnxruntime's import crashes when llama_cpp came first; onnxruntime
# (which imports numpy), then llama_cpp, works.
import contextlib

with contextlib.suppress(ImportError):
    import onnxruntime  # noqa: F401
try:
    import llama_cpp
except ImportError:
    llama_cpp = None

import argparse
import json
import os
import resource
import statistics
import subprocess
import time
from dataclasses import replace

import numpy as np

from edgedecode.model.graph import DEVICE_Q4_1, Q4_1_MODES, GraphOptions
from edgedecode.model.loader import load_model
from edgedecode.runtime.engine import Engine
from edgedecode.runtime.sampler import SamplingParams
from edgedecode.runtime.session import decode_options, spin_enabled
from edgedecode.serving.heap import release_free_pages, return_freed_buffers
from tools.bench.cuda import INGEST_TOKENS, cuda_extras, cuda_machine, gpu_memory_used_mib, gpu_read_bandwidth_gb_s
from tools.bench.membw import read_bandwidth_gb_s
from tools.bench.models import gguf_model, synthetic_model
from tools.bench.plots import plot_decode
from tools.bench.prompts import prompt_tokens
from tools.bench.step_bytes import gguf_weight_bytes, graph_weight_bytes, kv_bytes_per_token
from tools.bench.synth_gguf import SHAPES, WEIGHT_TYPES
from tools.common import cli

DECODE_STEPS = 64


class EdgeDecodeRunner:
    def __init__(
        self, name: str, model, options: GraphOptions, threads: int, context: int, device: str, cuda_graph: bool = True
    ) -> None:
        self.name = name
        self.engine = Engine(model, options, max_context=context, threads=threads, device=device, cuda_graph=cuda_graph)
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
    """llama.cpp through llama-cpp-python's C API (the high-level eval() keeps only n_batch logit rows).

    ``gpu``: every layer and the KV on the GPU, with flash attention, which llama.cpp's default "auto"
    turns on for a model whose layers all sit on a CUDA card (llama-cpp-python's Llama only takes on or
    off); logits still come back to the host for the greedy pick, as edgedecode's do.
    """

    name = "llama.cpp"

    def __init__(self, gguf_path, threads: int, context: int, gpu: bool = False) -> None:
        from llama_cpp import Llama

        self.api = llama_cpp
        self.llm = Llama(
            str(gguf_path),
            n_gpu_layers=-1 if gpu else 0,
            flash_attn=gpu,
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


def llama_cpp_available(device: str) -> bool:
    """Whether llama-cpp-python is installed and, for ``device`` "cuda", built with GPU offload."""
    return llama_cpp is not None and (device == "cpu" or llama_cpp.llama_supports_gpu_offload())


def engine_names(args) -> list[str]:
    """The engines to run: edgedecode as it ships (its own kernels where they load), edgedecode on
    onnxruntime's stock MatMulNBits ("edgedecode-stock", the form before the own kernels; where the shipped
    form is not already that, unless --no-stock), llama.cpp where it can run on ``args.device`` (unless
    --no-llama), and on CUDA edgedecode without CUDA graphs (unless --no-extras)."""
    with_stock = not args.no_stock and decode_options(args.device).kernels != "stock"
    with_llama = not args.no_llama and llama_cpp_available(args.device)
    with_no_graph = args.device == "cuda" and not args.no_extras
    return (
        ["edgedecode"]
        + (["edgedecode-stock"] if with_stock else [])
        + (["llama.cpp"] if with_llama else [])
        + (["edgedecode-no-graph"] if with_no_graph else [])
    )


def engine_options(name: str, args) -> GraphOptions:
    """The decode graph an edgedecode engine runs: the shipped one (decode_options), or with the stock ops
    (and --q4-1's offset form, where given)."""
    shipped = decode_options(args.device, args.accuracy_level)
    if name != "edgedecode-stock" and shipped.kernels != "stock":
        return shipped
    stock = GraphOptions.for_device("decode", args.device, args.accuracy_level)
    return stock if args.q4_1 is None else replace(stock, q4_1=args.q4_1)


def bench_context(args) -> int:
    longest = max(args.past) + DECODE_STEPS + 8
    return max(longest, INGEST_TOKENS + 8) if args.device == "cuda" else longest


def make_runner(name: str, args, model):
    context = bench_context(args)
    if name == "llama.cpp":
        return LlamaCppRunner(model.record.gguf_path, args.threads, context, gpu=args.device == "cuda")
    options = engine_options(name, args)
    return EdgeDecodeRunner(
        name, model, options, args.threads, context, args.device, cuda_graph=name != "edgedecode-no-graph"
    )


def engine_memory(engine: str, args) -> dict[str, float | None]:
    """Peak RSS of a fresh process that runs one engine at the largest past length and, on CUDA, the
    card's memory in use while that process holds it less before it started (the benchmark's own
    process sits idle meanwhile, so the difference is the child's: CUDA context, weights, KV, scratch)."""
    cmd = [
        sys.executable,
        __file__,
        "--memory-child",
        engine,
        "--threads",
        str(args.threads),
        "--accuracy-level",
        str(args.accuracy_level),
        "--past",
        str(max(args.past)),
        "--device",
        args.device,
        *(["--q4-1", args.q4_1] if args.q4_1 else []),
    ]
    if args.model:
        cmd += ["--model", args.model]
    before = gpu_memory_used_mib() if args.device == "cuda" else None
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        print(f"memory run for {engine} failed: {result.stderr.strip()[-500:]}", file=sys.stderr)
        return {"peak_rss_mib": None, "gpu_memory_mib": None}
    child = json.loads(result.stdout.strip().splitlines()[-1])
    held = child["gpu_memory_used_mib"]
    return {"peak_rss_mib": child["peak_rss_mib"], "gpu_memory_mib": None if None in (before, held) else held - before}


def memory_child(args) -> None:
    """Run one engine at the largest past length; print its peak RSS and, on CUDA, the card's memory in use.
    edgedecode's engines run under the decode daemon's heap settings (serving/heap.py: freed buffers go back to
    the OS, and what loading the model freed is released before the weights are mapped), as daemon/run.py does."""
    own = args.memory_child != LlamaCppRunner.name
    if own:
        return_freed_buffers()
    model = load_model(args.model)
    if own:
        release_free_pages()
    runner = make_runner(args.memory_child, args, model)
    runner.run(prompt_tokens(model.tokenizer, max(args.past)))
    held = gpu_memory_used_mib() if args.device == "cuda" else None
    print(json.dumps({"peak_rss_mib": own_peak_rss_mib(), "gpu_memory_used_mib": held}))


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


def choose_model(args) -> str | None:
    """The registered name of the model to run: --model, --gguf (registered here) or --shape/--type (written once)."""
    if args.gguf:
        return gguf_model(Path(args.gguf))
    if args.shape:
        return synthetic_model(args.shape, args.type)
    return args.model


def accounting(results: dict, model, runners: list, args) -> None:
    """Add bytes read per token, the bandwidth bound's fraction and memory / (weights + KV) to ``results``.

    Per engine: weights (edgedecode's: its built graph's initializers; llama.cpp: the GGUF's tensors)
    plus its KV (the graph's KV dtype / llama.cpp's default f16, per past token) at the mean past of the
    decode steps. The memory is the peak RSS on the CPU and the GPU memory on CUDA.
    """
    spec, gguf_path = model.spec, model.record.gguf_path
    gguf_bytes = gguf_weight_bytes(gguf_path)
    options = {r.name: r.engine.options for r in runners if r.name != "llama.cpp"}
    bandwidth = results["memory_bandwidth_gb_s"]
    memory_key, share_key = (
        ("gpu_memory_mib", "gpu_memory_over_weights_and_kv")
        if args.device == "cuda"
        else ("peak_rss_mib", "rss_over_weights_and_kv")
    )
    results["gguf_weight_bytes"] = gguf_bytes
    for name, engine in results["engines"].items():
        llama = name == "llama.cpp"
        kv_per_token = kv_bytes_per_token(spec, 2 if llama else options[name].kv_np_dtype.itemsize)
        weights = gguf_bytes if llama else graph_weight_bytes(model.graph_path(options[name]))
        engine.update(weight_bytes_per_token=weights, kv_bytes_per_past_token=kv_per_token)
        for past, row in engine["past"].items():
            read = weights + kv_per_token * (int(past) + DECODE_STEPS // 2)
            row["bytes_per_token"] = read
            if bandwidth:
                row["bandwidth_fraction"] = row["decode_tok_s"] * read / (bandwidth * 1e9)
        if engine.get(memory_key) is not None:
            held = gguf_bytes + kv_per_token * bench_context(args)
            engine[share_key] = engine[memory_key] * (1 << 20) / held


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", default=None, help="a registered model (default: the default model)")
    which.add_argument("--gguf", help="a GGUF file, registered with edgedecode so both engines run it")
    which.add_argument("--shape", choices=sorted(SHAPES), help="a synthetic GGUF of this shape (bench/synth_gguf.py)")
    parser.add_argument("--type", choices=WEIGHT_TYPES, default="Q4_0", help="--shape's weight type")
    cli.add_runs(parser, 5)
    cli.add_threads(parser)
    cli.add_past(parser, [16, 512, 2048, 4096])
    parser.add_argument("--plot", help="Also draw decode tok/s against past length per engine into this PNG.")
    cli.add_json_file(parser, "--json-out", help="Also write the results' JSON to this file.")
    cli.add_accuracy_level(parser)
    parser.add_argument(
        "--q4-1",
        choices=Q4_1_MODES,
        default=None,
        help="how the stock decode graph applies Q4_1's offsets (GraphOptions.q4_1; default: the "
        "device's shipped form, by size on cuda, correction on cpu)",
    )
    parser.add_argument(
        "--no-stock",
        action="store_true",
        help="Skip edgedecode on onnxruntime's stock MatMulNBits (run by default where the own kernels ship).",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda runs the float16 graphs on onnxruntime-gpu, and llama.cpp with every layer on the GPU "
        "where llama-cpp-python was built with GPU offload (else llama.cpp is skipped)",
    )
    parser.add_argument("--no-llama", action="store_true", help="Skip llama.cpp even if it is installed.")
    parser.add_argument("--no-rss", action="store_true", help="Skip the per-engine memory subprocess runs.")
    parser.add_argument(
        "--no-extras",
        action="store_true",
        help="On cuda, skip the no-CUDA-graph engine and the first-token and KV-ingest figures.",
    )
    cli.add_json_flag(parser)
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        return memory_child(args)

    args.model = choose_model(args)
    model = load_model(args.model)
    names = engine_names(args)
    load_before = os.getloadavg()
    bandwidth = gpu_read_bandwidth_gb_s() if args.device == "cuda" else read_bandwidth_gb_s(args.threads)
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
        "model": model.record.name,
        "gguf": str(model.record.gguf_path),
        "device": args.device,
        "threads": args.threads,
        "runs": args.runs,
        "decode_steps": DECODE_STEPS,
        "accuracy_level": args.accuracy_level,
        "q4_1": args.q4_1 or DEVICE_Q4_1[args.device],
        "kernels": {r.name: r.engine.options.kernels for r in runners if r.name != "llama.cpp"},
        # the own CUDA ops compute with float activations (level 0) whatever --accuracy-level asked
        "accuracy_levels": {r.name: r.engine.options.accuracy_level for r in runners if r.name != "llama.cpp"},
        "spinning": spin_enabled(),
        "machine": cli.cpu_name(),
        "load_average_before_after": [load_before[0], os.getloadavg()[0]],
        "memory_bandwidth_gb_s": bandwidth,
        "context": bench_context(args),
        "llama_cpp_python": llama_cpp.__version__ if "llama.cpp" in names else None,
        "engines": {},
    }
    if args.device == "cuda":
        results.update(cuda_machine())
    for runner in runners:
        results["engines"][runner.name] = {
            **({"peak_rss_mib": None, "gpu_memory_mib": None} if args.no_rss else engine_memory(runner.name, args)),
            "past": {
                str(p): {
                    "prefill_tok_s": statistics.median(s[0] for s in samples[(runner.name, p)]),
                    "decode_tok_s": statistics.median(s[1] for s in samples[(runner.name, p)]),
                }
                for p in args.past
            },
        }
    if "edgedecode-no-graph" in names:
        edgedecode_runners = [r for r in runners if r.name != "llama.cpp"]
        results["cuda"] = cuda_extras(edgedecode_runners, model, args.runs)
        graph, plain = (results["engines"][name]["past"] for name in ("edgedecode", "edgedecode-no-graph"))
        results["ratio_graph_over_no_graph"] = {
            past: graph[past]["decode_tok_s"] / plain[past]["decode_tok_s"] for past in graph
        }
    accounting(results, model, runners, args)
    if "llama.cpp" in results["engines"]:
        theirs = results["engines"]["llama.cpp"]["past"]
        for name, key in (
            ("edgedecode", "ratio_edgedecode_over_llama_cpp"),
            ("edgedecode-stock", "ratio_stock_over_llama_cpp"),
        ):
            if name in results["engines"]:
                ours = results["engines"][name]["past"]
                results[key] = {
                    past: {m: ours[past][m] / theirs[past][m] for m in ("prefill_tok_s", "decode_tok_s")}
                    for past in ours
                }
    if args.plot:
        plot_decode(results, args.plot)
    if args.json_out:
        cli.write_json(results, args.json_out, indent=2)
    if args.json:
        cli.print_json(results, indent=2)
        return
    print_table(results)


def print_table(results: dict) -> None:
    """The results as a plain-text table."""
    bandwidth = results["memory_bandwidth_gb_s"]
    print(
        f"{results['model']}, {results['device']}: median of {results['runs']} alternating runs, "
        f"{results['threads']} threads, {DECODE_STEPS} greedy decode steps; load average "
        f"{results['load_average_before_after'][0]:.1f} -> {results['load_average_before_after'][1]:.1f}; "
        f"read bandwidth {'not measured' if bandwidth is None else f'{bandwidth:.1f} GB/s'}"
    )
    print(
        f"{'engine':<20}{'past':>6}{'prefill tok/s':>15}{'decode tok/s':>14}{'decode ratio':>14}"
        f"{'MB/token':>10}{'of bound':>10}"
    )
    engines = results["engines"]
    for past in next(iter(engines.values()))["past"]:
        for name, result in engines.items():
            row = result["past"][past]
            ratio = ""
            if name.startswith("edgedecode") and "llama.cpp" in engines:
                ratio = f"{row['decode_tok_s'] / engines['llama.cpp']['past'][past]['decode_tok_s']:.2f}x"
            read = f"{row['bytes_per_token'] / 1e6:10.1f}" if "bytes_per_token" in row else ""
            read += f"{row['bandwidth_fraction']:10.0%}" if "bandwidth_fraction" in row else ""
            print(f"{name:<20}{past:>6}{row['prefill_tok_s']:>15.1f}{row['decode_tok_s']:>14.1f}{ratio:>14}{read}")
    for name, result in engines.items():
        for label, key, share_key in (
            ("peak RSS", "peak_rss_mib", "rss_over_weights_and_kv"),
            ("GPU memory", "gpu_memory_mib", "gpu_memory_over_weights_and_kv"),
        ):
            if key in result and (key != "gpu_memory_mib" or results["device"] == "cuda"):
                value, share = result[key], result.get(share_key)
                shown = "n/a" if value is None else f"{value:.0f} MiB"
                print(f"{label} {name}: {shown}{'' if share is None else f' ({share:.2f}x weights + KV)'}")
    if results["device"] == "cuda":
        print(f"{results['gpu']}, onnxruntime {results['onnxruntime']}, context {results['context']}")
        for past, ratio in results.get("ratio_graph_over_no_graph", {}).items():
            print(f"past {past}: CUDA graph / no graph decode {ratio:.2f}x")
        for name, extra in results.get("cuda", {}).items():
            print(f"{name}: {json.dumps(extra)}")


if __name__ == "__main__":
    cli.run(main)

#!/usr/bin/env python3
"""Time to first token through the real servers: KV pulled from the prefill server against the edge
box prefilling the prompt itself.

Starts one prefill server (``--prefill-device``; its prefix cache off, so every request computes)
and, one after the other, decode daemons on the CPU (optionally pinned with ``--edge-cpus``, e.g. two
cores of a bigger box to stand in for an edge device): one with ``local_prefill_only`` (the
baseline) and one per ``--budgets`` value pulling KV over HTTP. Every request is a streamed
completion of a distinct pydoc prose window of each ``--prompt-tokens`` length, ``--max-tokens``
long; each configuration gets one warm-up request first. Reported medians: client-side time to
first token, the daemon's KV fetch time (request to verified trailer, ingest included; in brackets
the prefill server's own prefill + scoring + encoding time, as it reports it), wire bytes
and b, decode tokens/s; and TTFT of local prefill ÷ TTFT of the pull (> 1: pulling is faster).

    python tools/bench/serve.py [--prompt-tokens 128 512 2048] [--budgets 1.0 0.3] [--runs 3]
                                [--prefill-device cpu|cuda] [--edge-cpus 0,1] [--threads N] [--json]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import platform
import statistics
import tempfile

import numpy as np

from edgedecode.client.chat import ChatError
from edgedecode.evaluation.texts import pydoc_corpus, token_windows
from edgedecode.model.loader import load_model
from edgedecode.serving.process import start_server, stop_server
from tools.common import cli
from tools.common.servers import streamed_completion, toml_config

LOCAL = "local prefill"


def add_placement(parser) -> None:
    """``--prefill-device`` (where the prefill server computes) and ``--edge-cpus``."""
    parser.add_argument("--prefill-device", choices=("cpu", "cuda"), default="cpu")
    add_edge_cpus(parser)


def add_edge_cpus(parser) -> None:
    """``--edge-cpus``: the CPUs the decode daemons are pinned to (``daemon_placement``)."""
    parser.add_argument("--edge-cpus", default=None, help="pin the daemons to these CPUs (taskset -c LIST)")


def prefill_placement(args) -> dict:
    """``start_server`` options of the prefill server: on ``--prefill-device``."""
    return {"env": {"EDGEDECODE_MODEL_DEVICE": args.prefill_device}}


def daemon_placement(args) -> dict:
    """``start_server`` options of a decode daemon: on the CPU, pinned to ``--edge-cpus`` if given."""
    launcher = ["taskset", "-c", args.edge_cpus] if args.edge_cpus else []
    return {"launcher": launcher, "env": {"EDGEDECODE_MODEL_DEVICE": "cpu"}}


def write_config(directory: Path, name: str, args, *, prefix_cache_mb: int = 0, **daemon) -> Path:
    """A TOML config for one server of the run (a prefill server's prefix cache off unless ``prefix_cache_mb``)."""
    longest = max(args.prompt_tokens)
    return toml_config(
        directory / f"{name}.toml",
        {
            "model": {"threads": args.threads},
            "daemon": {"slots": 1, "max_context": longest + args.max_tokens + 64, **daemon},
            "prefill": {"prefix_cache_mb": prefix_cache_mb, "max_prompt_tokens": longest + 64},
        },
    )


def one_request(url: str, prompt: np.ndarray, max_tokens: int) -> dict:
    """A streamed completion; client-side TTFT and the daemon's report of the turn."""
    body = {"prompt": prompt.tolist(), "max_tokens": max_tokens, "temperature": 0, "stream": True}
    done = streamed_completion(url, body)
    if done.error is not None or done.report is None or done.ttft_s is None:
        raise ChatError(done.error or "the daemon sent no report of the turn")
    report = done.report
    return {
        "ttft_ms": 1e3 * done.ttft_s,
        "fetch_ms": report["kv"]["fetch_ms"],
        "server_ms": report["kv"]["prefill_server_ms"],
        "wire_bytes": report["kv"]["wire_bytes"],
        "b_wire": report["kv"]["b_wire"],
        "source": report["kv"]["source"],
        "decode_tok_s": report["decode_tokens_per_second"],
    }


def measure(url: str, prompts: dict[int, list[np.ndarray]], args) -> dict[int, dict]:
    """Medians per prompt length (after one warm-up request)."""
    one_request(url, prompts[min(prompts)][0], args.max_tokens)
    results = {}
    for length, windows in prompts.items():
        runs = [one_request(url, ids, args.max_tokens) for ids in windows]
        sources = {run["source"] for run in runs}
        results[length] = {
            key: statistics.median(run[key] for run in runs)
            for key in ("ttft_ms", "fetch_ms", "server_ms", "wire_bytes", "b_wire", "decode_tok_s")
            if all(run[key] is not None for run in runs)
        }
        results[length]["kv_source"] = "/".join(sorted(sources))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.3])
    cli.add_runs(parser, 3)
    parser.add_argument("--max-tokens", type=int, default=8)
    add_placement(parser)
    cli.add_threads(parser, help="onnxruntime threads of each server")
    cli.add_json_flag(parser)
    args = parser.parse_args(argv)

    model = load_model()
    corpus = pydoc_corpus()
    prompts = {n: token_windows(model.tokenizer, corpus, n, args.runs) for n in args.prompt_tokens}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        prefill_config = write_config(directory, "prefill", args)
        prefill, prefill_url = start_server(
            ["prefill-server", "--config", str(prefill_config)], **prefill_placement(args)
        )
        try:
            modes = [(LOCAL, {"local_prefill_only": True})]
            modes += [(f"pull b={b:g}", {"prefill_url": prefill_url, "budget": b}) for b in args.budgets]
            for name, daemon in modes:
                config = write_config(directory, name.replace(" ", "_"), args, **daemon)
                process, url = start_server(["serve", "--config", str(config)], **daemon_placement(args))
                try:
                    results[name] = measure(url, prompts, args)
                finally:
                    stop_server(process)
        finally:
            stop_server(prefill)

    report = {
        "config": cli.settings(args, leave_out=["json"]),
        "machine": {"cpu": cli.cpu_name(), "python": platform.python_version()},
        "results": results,
    }
    if args.json:
        cli.print_json(report)
        return
    print(
        f"| mode | prompt tokens | TTFT ms | KV fetch ms (prefill server's) | wire KB | b_wire | decode tok/s "
        f"| TTFT {LOCAL} ÷ this |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, by_length in results.items():
        for length, row in by_length.items():
            ratio = results[LOCAL][length]["ttft_ms"] / row["ttft_ms"]
            fetch = f"{row['fetch_ms']:.0f} ({row.get('server_ms', float('nan')):.0f})" if name != LOCAL else "—"
            wire = f"{row['wire_bytes'] / 1024:.0f}" if name != LOCAL else "—"
            b = f"{row['b_wire']:.3f}" if name != LOCAL and "b_wire" in row else "—"
            print(
                f"| {name} | {length} | {row['ttft_ms']:.0f} | {fetch} | {wire} | {b} | "
                f"{row['decode_tok_s']:.1f} | {ratio:.2f}× |"
            )


if __name__ == "__main__":
    cli.run(main)

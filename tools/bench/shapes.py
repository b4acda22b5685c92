#!/usr/bin/env python3
"""The speed table of issue 17: tools/bench/decode.py over real model shapes and weight types, one command.

For each --shapes × --types pair it runs bench/decode.py on the synthetic GGUF of that shape and type
(tools/bench/synth_gguf.py: random weights, so speed and memory only, never quality; written once into
$EDGEDECODE_HOME/synth/), in its own process, edgedecode and llama.cpp alternating on the same file.
It writes every raw result and the whole table into --json-out, prints the table as Markdown, draws
--plot (decode tok/s against model size, and against past length), and says how long it took. A file
whose run fails is recorded with its exit status and the table goes on. Options it does not know go
to bench/decode.py: --device cuda (both engines on one card; the memory column is then GPU memory),
--no-extras, --no-rss, --q4-1.

    python tools/bench/shapes.py [--shapes smollm2-135m qwen2.5-0.5b llama3.2-1b llama3.2-3b]
        [--types Q4_0 Q4_1 Q4_K_M] [--past 16 512] [--runs 3] [--threads 2]
        [--json-out docs/bench/shapes.json] [--plot docs/bench/shapes.png]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import json
import subprocess
import tempfile
import time

from tools.bench.plots import plot_shapes
from tools.bench.synth_gguf import SHAPES, WEIGHT_TYPES
from tools.common import cli

BENCH = Path(__file__).resolve().parent / "decode.py"


def run_one(shape: str, weight_type: str, args, extra: list[str]) -> dict:
    """bench/decode.py's results for one synthetic file, from a process of its own; {"exit_status": N}
    where that process failed (its stderr is left on this one's)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        cmd = [sys.executable, str(BENCH), "--shape", shape, "--type", weight_type, "--runs", str(args.runs)]
        cmd += ["--threads", str(args.threads), "--past", *map(str, args.past), "--json-out", str(out), *extra]
        status = subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode
        return json.loads(out.read_text()) if status == 0 else {"exit_status": status}


def memory_cell(engine: dict, device: str) -> str:
    """An engine's peak RSS (CPU) or GPU memory (CUDA) in MiB and its multiple of weights + KV."""
    key, share_key = (
        ("gpu_memory_mib", "gpu_memory_over_weights_and_kv")
        if device == "cuda"
        else ("peak_rss_mib", "rss_over_weights_and_kv")
    )
    if engine.get(key) is None:
        return "n/a"
    return f"{engine[key]:.0f} ({engine[share_key]:.2f}×)"


def read_cell(row: dict | None) -> str:
    """MB a decode step reads and, where the bandwidth was measured, the fraction of the bound it reaches."""
    if row is None:
        return "–"
    share = f" ({row['bandwidth_fraction']:.0%})" if "bandwidth_fraction" in row else ""
    return f"{row['bytes_per_token'] / 1e6:.0f}{share}"


def table_rows(results: list[dict]) -> list[str]:
    """One Markdown row per file and past length: both engines' tok/s, the ratio, bytes and the bound,
    and each engine's memory (peak RSS on the CPU, GPU memory on CUDA)."""
    memory = "GPU memory" if any(r.get("device") == "cuda" for r in results) else "peak RSS"
    rows = [
        "| model | type | past | edgedecode decode tok/s | llama.cpp decode tok/s | ratio | edgedecode MB/token "
        f"(of bound) | llama.cpp MB/token (of bound) | prefill ratio | {memory} MiB ed / llama (× weights+KV) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for result in results:
        if "exit_status" in result:
            rows.append(f"| {result['shape']} | {result['type']} | – | failed (exit {result['exit_status']}) |")
            continue
        ours, theirs = result["engines"]["edgedecode"], result["engines"].get("llama.cpp")
        held = memory_cell(ours, result["device"])
        if theirs:
            held += f" / {memory_cell(theirs, result['device'])}"
        for past, row in ours["past"].items():
            other = theirs["past"][past] if theirs else None
            cells = [result["shape"], result["type"], past, f"{row['decode_tok_s']:.1f}"]
            if other:
                cells += [f"{other['decode_tok_s']:.1f}", f"**{row['decode_tok_s'] / other['decode_tok_s']:.2f}×**"]
            else:
                cells += ["–", "–"]
            cells += [read_cell(row), read_cell(other)]
            cells.append(f"{row['prefill_tok_s'] / other['prefill_tok_s']:.2f}×" if other else "–")
            cells.append(held)
            rows.append("| " + " | ".join(cells) + " |")
    return rows


def before_after_rows(results: list[dict]) -> list[str]:
    """One Markdown row per file and past length where edgedecode ran both ways: on onnxruntime's stock
    MatMulNBits (before the own kernels) and as shipped (the own kernels), each against llama.cpp."""
    memory = "GPU memory" if any(r.get("device") == "cuda" for r in results) else "peak RSS"
    rows = [
        "| model | type | past | stock decode tok/s | own kernels decode tok/s | own / stock | stock / llama.cpp | "
        f"own / llama.cpp | stock MB/token (of bound) | own MB/token (of bound) | {memory} MiB stock / own |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for result in results:
        engines = result.get("engines", {})
        if "edgedecode-stock" not in engines:
            continue
        own, stock, theirs = engines["edgedecode"], engines["edgedecode-stock"], engines.get("llama.cpp")
        held = f"{memory_cell(stock, result['device'])} / {memory_cell(own, result['device'])}"
        for past, row in own["past"].items():
            before, other = stock["past"][past], theirs["past"][past] if theirs else None
            cells = [
                result["shape"],
                result["type"],
                past,
                f"{before['decode_tok_s']:.1f}",
                f"{row['decode_tok_s']:.1f}",
            ]
            cells.append(f"{row['decode_tok_s'] / before['decode_tok_s']:.2f}×")
            for engine_row in (before, row):
                cells.append(f"**{engine_row['decode_tok_s'] / other['decode_tok_s']:.2f}×**" if other else "–")
            cells += [read_cell(before), read_cell(row), held]
            rows.append("| " + " | ".join(cells) + " |")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=[s for s in SHAPES if s != "tiny"])
    parser.add_argument("--types", nargs="+", choices=WEIGHT_TYPES, default=list(WEIGHT_TYPES))
    cli.add_past(parser, [16, 512])
    cli.add_runs(parser, 3)
    cli.add_threads(parser)
    cli.add_json_file(parser, "--json-out", help="every raw result and the table, written after every file")
    parser.add_argument("--plot", type=Path)
    args, extra = parser.parse_known_args(argv)  # the rest (--no-rss, --q4-1 ...) goes to bench/decode.py
    started = time.perf_counter()
    command = cli.command(__file__, argv)
    results = []
    for shape in args.shapes:
        for weight_type in args.types:
            result = run_one(shape, weight_type, args, extra)
            results.append({"shape": shape, "type": weight_type, **result})
            print(f"{shape} {weight_type}: done at {time.perf_counter() - started:.0f} s", file=sys.stderr)
            if args.json_out:  # after every file, so an interrupted run keeps what it measured
                summary = {"command": command, "elapsed_s": time.perf_counter() - started, "results": results}
                tables = {"table": table_rows(results), "before_after": before_after_rows(results)}
                cli.write_json({**summary, **tables}, args.json_out, indent=2)
    rows = table_rows(results) + [""] + before_after_rows(results)
    elapsed = time.perf_counter() - started
    if args.plot and any("engines" in r for r in results):
        plot_shapes([r for r in results if "engines" in r], args.plot)
    print("\n".join(rows))
    print(f"\n{command}: {elapsed / 60:.1f} min")


if __name__ == "__main__":
    cli.run(main)

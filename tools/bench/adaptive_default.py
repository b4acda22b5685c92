#!/usr/bin/env python3
"""What a new user gets: a daemon with no adaptive key set against local-only and a fixed b 0.3 pull,
time to first token, interleaved (issue 29's acceptance).

One prefill server on this box (on ``--prefill-device``: a GPU makes it a prefill node faster than
the edge; its prefix cache off, so every request computes, as for distinct prompts), and three
daemons, pinned to ``--edge-cpus`` if given (to stand in for a small edge box): ``default`` (no
[daemon] key but the prefill URL: the planner's default objective), ``b0.3`` (``daemon.budget =
0.3``, the old default) and ``local`` (``local_prefill_only``).
Each cell is a link: ``--mbits`` through the project's link shaper (one-way delay ``--rtt-ms``/2), or
``unshaped`` (straight to the prefill server). The default daemon is started afresh per cell (it
knows nothing of the link; its first request is the probe, reported apart) and the others once per
cell, each warmed by one request first (the prefill server's first requests are slower).
Requests go round by round, one of each policy per round, each round on its own distinct pydoc window of
``--prompt-tokens`` tokens (the same window for the three policies), the rounds' orders cycling through all six
permutations of the three (``ORDERS``), so that the box's load hits all three alike and, over every six rounds, each
policy goes before each other one as often as after it (with ``--server-holds-tokens`` the first pull of a round
pays the server's compute of the rest of the prompt, which the server then holds for the pulls after it): the
ratios default/local and default/min(local, b 0.3) are taken per round and summarised by their median (and the
medians of the TTFTs beside them).

``--server-holds-tokens N``: a prefill node faster than the box by its prefix cache (a shared document,
a RAG context). The server's prefix cache is on, and each round's first N tokens are a document it
already holds: the tool asked the server for that document alone before the round (as another client
would, straight to ``/v1/prefill``) and checked with ``/v1/prefill/held`` that it holds it. The
measured daemons have never seen it, so the local one computes the whole prompt, and the server only
the rest (then encodes the whole prompt's KV).

    python tools/bench/adaptive_default.py [--mbits 10] [--unshaped] [--prompt-tokens 1024] [--rounds 5]
        [--rtt-ms 20] [--server-holds-tokens 0] [--prefill-device cpu|cuda] [--edge-cpus 0,1] [--threads 2]
        [--json PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import contextlib
import itertools
import json
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Iterator

import numpy as np

from edgedecode.evaluation.texts import pydoc_corpus, token_windows
from edgedecode.kv.prefix import block_chain, chain_to_hex
from edgedecode.model.loader import load_model
from edgedecode.testing.link_shaper import LinkShaper
from edgedecode.testing.link_traces import MBIT
from tools.bench.serve import add_placement, daemon_placement, prefill_placement, write_config
from tools.common import cli
from tools.common.servers import running, streamed_completion

POLICIES = ("default", "b0.3", "local")
ORDERS = list(itertools.permutations(POLICIES))  # the rounds' orders, in turn


def settings(policy: str, url: str) -> dict:
    """The [daemon] keys of one policy's daemon behind ``url``."""
    if policy == "local":
        return {"local_prefill_only": True}
    return {"prefill_url": url} | ({"budget": 0.3} if policy == "b0.3" else {})


@contextlib.contextmanager
def daemon(policy: str, directory: Path, args, url: str, tag: str) -> Iterator[str]:
    config = write_config(directory, f"{policy}-{tag}", args, **settings(policy, url))
    log = directory / f"{policy}-{tag}.log"
    with running(["serve", "--config", str(config)], log, **daemon_placement(args)) as (_, daemon_url):
        yield daemon_url


def request(url: str, prompt, max_tokens: int) -> dict:
    body = {"prompt": prompt.tolist(), "max_tokens": max_tokens, "temperature": 0, "stream": True}
    done = streamed_completion(url, body)
    kv = (done.report or {}).get("kv", {})
    return {
        "ttft_ms": None if done.ttft_s is None else round(1e3 * done.ttft_s, 1),
        "decision": kv.get("decision"),
        "source": kv.get("source"),
        "budget": kv.get("budget"),
        "head_tokens": kv.get("head_tokens"),
        "server_held_tokens": kv.get("server_held_tokens"),
        "prefill_server_ms": kv.get("prefill_server_ms"),
        "predicted_ms": kv.get("predicted_ms"),
        "fetch_ms": kv.get("fetch_ms"),
        "wire_bytes": kv.get("wire_bytes"),
        "error": done.error,
    }


def hold_document(prefill_url: str, document: np.ndarray) -> int:
    """Have the prefill server prefill ``document`` (as another client would) and return how many of its tokens
    it then says it holds (``/v1/prefill/held``)."""
    body = json.dumps({"token_ids": document.tolist(), "budget": 0.3}).encode()
    headers = {"Content-Type": "application/json"}
    with urllib.request.urlopen(urllib.request.Request(prefill_url + "/v1/prefill", body, headers), timeout=600) as r:
        r.read()
    query = json.dumps({"blocks": chain_to_hex(block_chain(document))}).encode()
    with urllib.request.urlopen(urllib.request.Request(prefill_url + "/v1/prefill/held", query, headers)) as r:
        return json.loads(r.read())["held_tokens"]


def run_cell(label: str, target: str, steady: dict[str, str], windows, args, directory: Path) -> dict:
    """The rounds of one link: a fresh default daemon against the steady ones (with ``--server-holds-tokens``,
    each round's document held by the prefill server at ``args.prefill_url`` first)."""
    with daemon("default", directory, args, target, label.replace(" ", "_").replace("/", "")) as fresh:
        urls = {"default": fresh, **steady}
        probe = request(fresh, windows[0], args.max_tokens)
        print(f"{label}: the default daemon's first request (the probe): {probe}", file=sys.stderr, flush=True)
        rounds = []
        for i, prompt in enumerate(windows[1:]):
            held = (
                hold_document(args.prefill_url, prompt[: args.server_holds_tokens]) if args.server_holds_tokens else 0
            )
            order = ORDERS[i % len(ORDERS)]
            round_ = {policy: request(urls[policy], prompt, args.max_tokens) for policy in order}
            round_["server_held_before"] = held
            rounds.append(round_)
            line = ", ".join(
                f"{p} {round_[p]['ttft_ms']} ms ({round_[p]['decision'] or round_[p]['source']})" for p in order
            )
            print(f"  {label} round {i}: {line}; the server held {held} tokens", file=sys.stderr, flush=True)
    return {"cell": label, "probe": probe, "rounds": rounds, "summary": summarise(rounds)}


def summarise(rounds: list[dict]) -> dict:
    """Median TTFT per policy and the median per-round ratios."""

    def ttft(round_: dict, policy: str) -> float:
        return round_[policy]["ttft_ms"] or float("inf")

    return {
        "median_ttft_ms": {p: statistics.median(ttft(r, p) for r in rounds) for p in POLICIES},
        "default_over_local": statistics.median(ttft(r, "default") / ttft(r, "local") for r in rounds),
        "default_over_best_of_local_b03": statistics.median(
            ttft(r, "default") / min(ttft(r, "local"), ttft(r, "b0.3")) for r in rounds
        ),
        "default_decisions": [r["default"]["decision"] for r in rounds],
    }


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__)
    p.add_argument("--mbits", type=float, nargs="*", default=[10.0], help="shaped links")
    p.add_argument("--unshaped", action="store_true", help="also a cell straight to the prefill server")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rtt-ms", type=float, default=20.0)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument(
        "--server-holds-tokens",
        type=int,
        default=0,
        help="each prompt's first N tokens are already in the server's cache",
    )
    add_placement(p)
    cli.add_threads(p, help="onnxruntime threads of each server")
    cli.add_json_file(p, help="write every request here")
    args = p.parse_args(argv)
    if not 0 <= args.server_holds_tokens < args.prompt_tokens:
        p.error("--server-holds-tokens must be >= 0 and below --prompt-tokens")
    args.prompt_tokens = [args.prompt_tokens]  # as write_config takes it
    started = time.time()
    model = load_model()
    cells = [(f"{m:g} Mbit/s", m) for m in args.mbits] + ([("unshaped", None)] if args.unshaped else [])
    windows = token_windows(model.tokenizer, pydoc_corpus(), args.prompt_tokens[0], len(cells) * (args.rounds + 2))
    results = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        directory = Path(tmp)
        prefill_config = write_config(
            directory, "prefill", args, prefix_cache_mb=1024 if args.server_holds_tokens else 0
        )
        _, prefill_url = stack.enter_context(
            running(
                ["prefill-server", "--config", str(prefill_config)],
                directory / "prefill.log",
                **prefill_placement(args),
            )
        )
        host, port = prefill_url.removeprefix("http://").rsplit(":", 1)
        args.prefill_url = prefill_url
        for index, (label, mbits) in enumerate(cells):
            cell_windows = windows[index * (args.rounds + 2) : (index + 1) * (args.rounds + 2)]
            with contextlib.ExitStack() as cell_stack:
                target = prefill_url
                if mbits is not None:
                    shaper = cell_stack.enter_context(
                        LinkShaper(host, int(port), rate_bytes_per_s=mbits * MBIT, delay_s=args.rtt_ms / 2e3)
                    )
                    target = shaper.url
                steady = {
                    policy: cell_stack.enter_context(daemon(policy, directory, args, target, f"c{index}"))
                    for policy in ("b0.3", "local")
                }
                for url in steady.values():  # warm: the servers' first requests are not what is measured
                    request(url, cell_windows[0], args.max_tokens)
                results.append(run_cell(label, target, steady, cell_windows[1:], args, directory))
            print(f"{label}: {results[-1]['summary']}", file=sys.stderr, flush=True)
    record = {**cli.record(__file__, argv, started), "model": model.record.name, "args": cli.settings(args)}
    record |= {"cells": results, "wall_s": round(time.time() - started, 1)}
    if args.json:
        cli.write_json(record, args.json)
    cli.print_json({cell["cell"]: {"probe": cell["probe"], **cell["summary"]} for cell in results})
    return 0


if __name__ == "__main__":
    cli.run(main)

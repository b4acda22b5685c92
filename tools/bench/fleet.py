#!/usr/bin/env python3
"""The prefill tier on Ray Serve, measured on this machine (needs the [scale] extra).

1. **Relay cost**: the same prompts (token ids, no prefix cache) sent one at a time, alternately,
   to a plain ``edgedecode prefill-server`` and to a one-replica tier (Serve's proxy → ingress →
   replica → its prefill server on loopback), both running at once. Reported: medians of the time
   to the whole payload, of the server's own time (``X-Prefill-Seconds``) and of their difference,
   what carrying the payload added (robust to other load on the machine, which moves both).
2. **Affinity**: a multi-turn workload (``--conversations`` conversations sharing a system prompt,
   ``--turns`` turns each: a user message of ``--user-tokens`` and an answer of ``--answer-tokens``
   random token ids appended per turn; each round sends every conversation's next turn in a random
   order, ``--clients`` requests at once) against a two-replica tier routed by prefix affinity, then
   by plain round-robin. Reported:
   the prefix-cache hit rate (prompt tokens served from a replica's prefix cache ÷ prompt tokens,
   from the replicas' own counters), the best any router could do (every block-aligned prefix
   sent before, on one cache), and the medians of the replicas' prefill time per request.

    python tools/bench/fleet.py [--runs 5] [--prompt-tokens 512 2048] [--conversations 8] [--turns 4] [--json]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import json
import platform
import statistics
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from edgedecode.config import load_config
from edgedecode.kv.prefix import DEFAULT_BLOCK_TOKENS
from edgedecode.prefill.fleet.app import replica_names, start_fleet, stop_fleet
from edgedecode.serving.process import start_server, stop_server
from tools.common import cli

BUDGET = 0.3
VOCAB = 49152  # SmolLM2's; ids from [1000, VOCAB) avoid its control tokens


def write_config(directory: Path, name: str, args, *, replicas: int, routing: str, prefix_cache_mb: int) -> Path:
    text = f"""[model]
threads = {args.threads}
[prefill]
port = 0
prefix_cache_mb = {prefix_cache_mb}
max_prompt_tokens = 4096
[fleet]
replicas = {replicas}
replica_cpus = {args.replica_cpus}
routing = "{routing}"
"""
    path = directory / f"{name}.toml"
    path.write_text(text)
    return path


def prefill(url: str, token_ids: list[int]) -> dict:
    """One prefill request; the time to the whole payload and what the server reported."""
    body = json.dumps({"token_ids": token_ids, "budget": BUDGET}).encode()
    request = urllib.request.Request(url + "/v1/prefill", body, {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        size = len(response.read())
        headers = response.headers
    return {
        "seconds": time.perf_counter() - started,
        "bytes": size,
        "server_seconds": float(headers["X-Prefill-Seconds"]),
        "replica": headers.get("X-Prefill-Replica"),
    }


def relay_cost(args, directory: Path, rng: np.random.Generator) -> dict:
    """Part 1: a plain prefill server against a one-replica tier, the same prompts."""
    prompts = {n: [rng.integers(1000, VOCAB, n).tolist() for _ in range(args.runs)] for n in args.prompt_tokens}
    config = write_config(directory, "single", args, replicas=1, routing="affinity", prefix_cache_mb=0)
    process, single = start_server(["prefill-server", "--config", str(config)])
    try:
        tier = start_fleet(load_config(config, env={}), log_to_driver=False)
        try:
            urls = {"prefill-server": single, "ray tier, 1 replica": tier}
            for url in urls.values():
                prefill(url, prompts[min(prompts)][0])  # warm-up
            runs: dict[str, dict[int, list[dict]]] = {name: {n: [] for n in prompts} for name in urls}
            for n, windows in prompts.items():
                for ids in windows:
                    for name, url in urls.items():
                        runs[name][n].append(prefill(url, ids))
        finally:
            stop_fleet()
    finally:
        stop_server(process)
    return {
        name: {
            n: {
                "seconds": statistics.median(r["seconds"] for r in got),
                "server_seconds": statistics.median(r["server_seconds"] for r in got),
                "added_seconds": statistics.median(r["seconds"] - r["server_seconds"] for r in got),
                "bytes": statistics.median(r["bytes"] for r in got),
            }
            for n, got in by_length.items()
        }
        for name, by_length in runs.items()
    }


def conversations(args, rng: np.random.Generator) -> list[list[list[int]]]:
    """Each conversation's prompts, turn by turn (a shared system prompt, then its own turns)."""
    system = rng.integers(1000, VOCAB, args.system_tokens).tolist()
    prompts = []
    for _ in range(args.conversations):
        history, turns = list(system), []
        for _ in range(args.turns):
            history += rng.integers(1000, VOCAB, args.user_tokens).tolist()
            turns.append(list(history))
            history += rng.integers(1000, VOCAB, args.answer_tokens).tolist()
        prompts.append(turns)
    return prompts


def best_hit_tokens(prompts: list[list[int]]) -> int:
    """Prompt tokens a single cache holding every earlier prompt would serve (block-aligned)."""
    seen: set[tuple[int, ...]] = set()
    hits = 0
    for ids in prompts:
        blocks = len(ids) // DEFAULT_BLOCK_TOKENS
        held = 0
        while held < blocks and tuple(ids[: (held + 1) * DEFAULT_BLOCK_TOKENS]) in seen:
            held += 1
        hits += held * DEFAULT_BLOCK_TOKENS
        seen.update(tuple(ids[: (b + 1) * DEFAULT_BLOCK_TOKENS]) for b in range(blocks))
    return hits


def replica_tokens(url: str) -> dict[str, float]:
    totals = {"prefix_cache": 0.0, "computed": 0.0}
    for name in replica_names():
        with urllib.request.urlopen(f"{url}/metrics?replica={name}", timeout=30) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "edgedecode_prefill_tokens_total":
                    totals[sample.labels["source"]] += sample.value
    return totals


def affinity(args, directory: Path, rng: np.random.Generator) -> dict:
    """Part 2: the multi-turn workload against two replicas, by affinity and by round-robin."""
    workload = conversations(args, rng)
    rounds = [[workload[i][turn] for i in rng.permutation(len(workload))] for turn in range(args.turns)]
    order = [ids for turns in rounds for ids in turns]
    results = {"best_possible_hit_rate": best_hit_tokens(order) / sum(len(p) for p in order)}
    for routing in ("affinity", "round_robin"):
        config = write_config(directory, routing, args, replicas=2, routing=routing, prefix_cache_mb=args.cache_mb)
        url = start_fleet(load_config(config, env={}), log_to_driver=False)
        try:
            started = time.perf_counter()
            with ThreadPoolExecutor(args.clients) as pool:
                runs = []
                for turns in rounds:  # a conversation's next turn waits for its previous one
                    runs += list(pool.map(partial(prefill, url), turns))
            wall = time.perf_counter() - started
            tokens = replica_tokens(url)
        finally:
            stop_fleet()
        results[routing] = {
            "hit_rate": tokens["prefix_cache"] / (tokens["prefix_cache"] + tokens["computed"]),
            "median_server_seconds": statistics.median(r["server_seconds"] for r in runs),
            "wall_seconds": wall,
            "requests_per_replica": sorted(
                sum(r["replica"] == name for r in runs) for name in {r["replica"] for r in runs}
            ),
        }
    return results


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    cli.add_runs(parser, 5)
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[512, 2048])
    cli.add_threads(parser, 1, help="onnxruntime threads per server / replica")
    parser.add_argument("--replica-cpus", type=float, default=1.0)
    parser.add_argument("--conversations", type=int, default=9)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=192)
    parser.add_argument("--user-tokens", type=int, default=96)
    parser.add_argument("--answer-tokens", type=int, default=48)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--cache-mb", type=int, default=256, help="each replica's prefix cache (the default's)")
    parser.add_argument("--seed", type=int, default=0)
    cli.add_json_flag(parser)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        report = {
            "config": cli.settings(args, leave_out=["json"]),
            "machine": {"cpu": cli.cpu_name(), "python": platform.python_version()},
            "relay": relay_cost(args, Path(tmp), rng),
            "affinity": affinity(args, Path(tmp), rng),
        }
    if args.json:
        cli.print_json(report)
        return
    single, tier = report["relay"]["prefill-server"], report["relay"]["ray tier, 1 replica"]
    print(
        "| prompt tokens | payload KB | s: prefill-server (its own) | s: Ray tier (its replica's) "
        "| ms added: server, tier |"
    )
    print("|---:|---:|---|---|---|")
    for n in single:
        s, t = single[n], tier[n]
        print(
            f"| {n} | {s['bytes'] / 1024:.0f} | {s['seconds']:.3f} ({s['server_seconds']:.3f}) "
            f"| {t['seconds']:.3f} ({t['server_seconds']:.3f}) "
            f"| {1e3 * s['added_seconds']:.0f}, {1e3 * t['added_seconds']:.0f} |"
        )
    found = report["affinity"]
    print(f"\nbest possible prefix-cache hit rate: {found['best_possible_hit_rate']:.3f}")
    print("| routing | hit rate | median prefill s | wall s | requests per replica |")
    print("|---|---:|---:|---:|---|")
    for routing in ("affinity", "round_robin"):
        row = found[routing]
        print(
            f"| {routing} | {row['hit_rate']:.3f} | {row['median_server_seconds']:.3f} | {row['wall_seconds']:.1f} "
            f"| {row['requests_per_replica']} |"
        )


if __name__ == "__main__":
    cli.run(main)

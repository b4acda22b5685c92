#!/usr/bin/env python3
"""A live load test of a two-replica Ray Serve prefill tier on loopback, beside the simulation of
the same load (``tools/sim/fleet.py``), to check the simulator (needs the [scale] extra).

``--clients`` simulated edge clients, each a thread running conversations as ``tools/sim/fleet.py``'s
workload describes them (the same distributions and parameters, scaled down for this machine:
``--system-tokens``, ``--user-tokens``, ``--answer-tokens``, ``--think-s``, ``--gap-s``,
``--turns``), send what a decode daemon keeping its conversation's KV sends: the whole prompt as
token ids with ``held_tokens`` (the previous prompt and answer) at budget 0.3, and read the payload
to its end. Answers are not decoded (a client's "completion" is instant), so a turn's TTFT here is
the time to the whole payload. After ``--warmup-s``, ``--duration-s`` of turns are measured:
requests/s and TTFT p50/p95.

The simulation then runs the same load: the same number of boxes and workload parameters, two
replicas, the fixed 0.3 budget, affinity routing; its service times are a least-squares line of
the replicas' own reported time (``X-Prefill-Seconds``) against the tokens they computed (the
prompt less ``X-Prefix-Reused-Tokens``), from this run, each request's drawn times a measured
request's ratio to that line (the spread contention on this machine gives service times);
its link is loopback through the tier's relay, as measured in this run (goodput: payload bytes
over the time from response headers to the payload's end; round trip: the 10th percentile of the
headers' wait less the replica's own time). It runs ``--sim-factor`` times longer, for a steady
estimate. Printed: both, and sim ÷ live.

    python tools/sim/fleet_check.py [--clients 6] [--duration-s 180] [--json]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import json
import tempfile
import threading
import time
import urllib.request

import numpy as np

from edgedecode.config import load_config
from edgedecode.prefill.fleet.app import start_fleet, stop_fleet
from tools.common import cli
from tools.sim.fleet import ANSWER_SIGMA, THINK_SIGMA, USER_SIGMA, Link, ServiceModel, Workload, lognormal, simulate

BUDGET = 0.3
VOCAB_LOW, VOCAB_HIGH = 1000, 49152  # SmolLM2 ids without its control tokens
MAX_CONTEXT = 2048


def tier_config(directory: Path) -> Path:
    path = directory / "tier.toml"
    path.write_text(
        "[model]\nthreads = 1\n[prefill]\nport = 0\nmax_prompt_tokens = 2048\n[fleet]\nreplicas = 2\nreplica_cpus = 1\n"
    )
    return path


def pull(url: str, prompt: list[int], held: int) -> dict:
    """One request as a daemon sends it; when it started, its phases and what the replica reported."""
    body = json.dumps({"token_ids": prompt, "held_tokens": held, "budget": BUDGET}).encode()
    request = urllib.request.Request(url + "/v1/prefill", body, {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        headers_s = time.perf_counter() - started
        size = len(response.read())
        server_s = float(response.headers["X-Prefill-Seconds"])
        reused = int(response.headers["X-Prefix-Reused-Tokens"])
    total = time.perf_counter() - started
    return {
        "start": started,
        "ttft_s": total,
        "headers_s": headers_s,
        "transfer_s": total - headers_s,
        "server_s": server_s,
        "bytes": size,
        "computed_tokens": len(prompt) - reused,
    }


def client(url: str, workload: Workload, seed: int, until: float, out: list[dict]) -> None:
    """One edge client: conversations with think times until ``until`` (perf_counter)."""
    rng = np.random.default_rng(seed)
    system = np.random.default_rng(0).integers(VOCAB_LOW, VOCAB_HIGH, workload.system_tokens).tolist()
    time.sleep(rng.exponential(workload.conversation_gap_s))
    while time.perf_counter() < until:
        held: list[int] = []
        turns = int(rng.geometric(1 / workload.turns_mean))
        for turn in range(turns):
            user = rng.integers(
                VOCAB_LOW, VOCAB_HIGH, max(1, int(lognormal(rng, workload.user_median_tokens, USER_SIGMA)))
            )
            prompt = (held or system) + user.tolist()
            if len(prompt) > workload.max_context or time.perf_counter() >= until:
                break
            out.append(pull(url, prompt, max(len(held) - 1, 0)))
            answer = max(1, int(lognormal(rng, workload.answer_median_tokens, ANSWER_SIGMA)))
            held = prompt + rng.integers(VOCAB_LOW, VOCAB_HIGH, answer).tolist()
            if turn < turns - 1:
                time.sleep(lognormal(rng, workload.think_median_s, THINK_SIGMA))
        time.sleep(rng.exponential(workload.conversation_gap_s))


def figures(ttfts: list[float], seconds: float) -> dict:
    return {
        "requests_per_s": len(ttfts) / seconds,
        "ttft_p50_s": float(np.percentile(ttfts, 50)),
        "ttft_p95_s": float(np.percentile(ttfts, 95)),
    }


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=128)
    parser.add_argument("--user-tokens", type=float, default=48)
    parser.add_argument("--answer-tokens", type=float, default=64)
    parser.add_argument("--think-s", type=float, default=2.0, help="median think time between turns")
    parser.add_argument("--gap-s", type=float, default=3.0, help="mean gap between a client's conversations")
    parser.add_argument("--turns", type=float, default=3.0, help="mean turns per conversation")
    parser.add_argument("--warmup-s", type=float, default=30.0)
    parser.add_argument("--duration-s", type=float, default=180.0)
    parser.add_argument("--sim-factor", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--records", type=Path, help="write every live request's figures here (JSON)")
    cli.add_json_flag(parser)
    args = parser.parse_args(argv)
    workload = Workload(
        boxes=args.clients,
        conversation_gap_s=args.gap_s,
        turns_mean=args.turns,
        think_median_s=args.think_s,
        system_tokens=args.system_tokens,
        user_median_tokens=args.user_tokens,
        answer_median_tokens=args.answer_tokens,
        max_context=MAX_CONTEXT,
        decode_tok_s=float("inf"),
        first_step_s=0.0,
    )
    with tempfile.TemporaryDirectory() as tmp:
        url = start_fleet(load_config(tier_config(Path(tmp)), env={}), log_to_driver=False)
        try:
            records: list[dict] = []
            begin = time.perf_counter()
            until = begin + args.warmup_s + args.duration_s
            threads = [
                threading.Thread(target=client, args=(url, workload, args.seed + i, until, records))
                for i in range(args.clients)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            stop_fleet()
    if args.records:
        args.records.write_text(json.dumps([{**r, "start": r["start"] - begin} for r in records]))
    measured = [r for r in records if begin + args.warmup_s <= r["start"] < until]
    live = figures([r["ttft_s"] for r in measured], args.duration_s)

    slope, intercept = np.polyfit([r["computed_tokens"] for r in records], [r["server_s"] for r in records], 1)
    residuals = tuple(r["server_s"] / (intercept + slope * r["computed_tokens"]) for r in records)
    service = ServiceModel({BUDGET: [(n, intercept + slope * n) for n in (1, MAX_CONTEXT)]}, residuals)
    goodput = sum(r["bytes"] for r in records) / sum(r["transfer_s"] for r in records)
    rtt = float(np.percentile([r["headers_s"] - r["server_s"] for r in records], 10))
    sim_load = Workload(**{**vars(workload), "links": (Link(goodput * 8 / 1e6, rtt, 1.0),)})
    sim = simulate(
        sim_load,
        service,
        2,
        f"fixed-{BUDGET}",
        sim_s=args.duration_s * args.sim_factor,
        warmup_s=args.warmup_s,
        seed=args.seed,
    )
    report = {
        "config": cli.settings(args, leave_out=["json", "records"]),
        "fitted": {"service_s": [intercept, slope], "goodput_mbit_s": goodput * 8 / 1e6, "rtt_s": rtt},
        "live": {**live, "requests": len(measured)},
        "sim": {key: sim[key] for key in ("requests_per_s", "ttft_p50_s", "ttft_p95_s", "utilisation")},
    }
    if args.json:
        cli.print_json(report)
        return
    print(
        f"fitted: service {intercept * 1e3:.0f} ms + {slope * 1e3:.2f} ms/token; relay {goodput * 8 / 1e6:.0f} "
        f"Mbit/s, round trip {rtt * 1e3:.0f} ms; {len(measured)} live requests measured"
    )
    print("| | requests/s | TTFT p50 s | TTFT p95 s |\n|---|---:|---:|---:|")
    for name, row in (("live", report["live"]), ("simulated", report["sim"])):
        print(f"| {name} | {row['requests_per_s']:.2f} | {row['ttft_p50_s']:.3f} | {row['ttft_p95_s']:.3f} |")
    ratios = [report["sim"][k] / report["live"][k] for k in ("requests_per_s", "ttft_p50_s", "ttft_p95_s")]
    print("| sim ÷ live | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")


if __name__ == "__main__":
    cli.run(main)

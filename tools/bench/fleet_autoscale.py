#!/usr/bin/env python3
"""The prefill tier's autoscaling bounds under load, measured on one box (needs the [scale] extra).

Starts the tier (``edgedecode.prefill.fleet``) with ``fleet.min_replicas`` = ``--min``,
``fleet.max_replicas`` = ``--max`` (starting at the minimum) and ``fleet.target_ongoing_requests``
= 1 on a Ray instance of this process with ``--cpus`` CPUs (one per replica, more than ``--max``
so that the bound, not Ray's resources, is what stops the scaling), then ``--clients`` clients
each send prefill requests of ``--prompt-tokens`` random token ids back to back for ``--load-s``
seconds, then nothing for ``--idle-s``. The live replicas (``replica_names()``: Ray's named
replica actors, starting ones included) are counted every ``--sample-s``. Serve's autoscaler runs
with its own defaults (an upscale delay of 30 s, a downscale delay of 600 s); the tier exposes the
bounds and the target only.

Printed (JSON): the counts seen under load and after it, whether every count was within the
bounds, when the count first rose after the load began, the requests answered and refused, and
every sample.

    python tools/bench/fleet_autoscale.py [--min 1] [--max 2] [--cpus 3] [--clients 4] [--load-s 90] [--idle-s 20]
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
import urllib.error
import urllib.request

import numpy as np

from edgedecode.config import load_config
from edgedecode.prefill.fleet.app import replica_names, start_fleet, stop_fleet
from tools.common import cli

VOCAB_LOW, VOCAB_HIGH = 1000, 49152  # SmolLM2 ids without its control tokens


def tier_config(directory: Path, low: int, high: int) -> Path:
    path = directory / "tier.toml"
    path.write_text(
        "[model]\nthreads = 1\n[prefill]\nport = 0\nmax_prompt_tokens = 2048\n"
        f"[fleet]\nreplicas = {low}\nmin_replicas = {low}\nmax_replicas = {high}\n"
        "target_ongoing_requests = 1\nreplica_cpus = 1\ngraceful_shutdown_s = 30\n"
    )
    return path


def client(url: str, tokens: int, seed: int, until: float, outcomes: list[int]) -> None:
    """Prefill requests back to back until ``until`` (time.monotonic); each one's HTTP status in ``outcomes``."""
    rng = np.random.default_rng(seed)
    while time.monotonic() < until:
        body = json.dumps({"token_ids": rng.integers(VOCAB_LOW, VOCAB_HIGH, tokens).tolist(), "budget": 0.3})
        request = urllib.request.Request(url + "/v1/prefill", body.encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=300) as response:
                response.read()
                outcomes.append(response.status)
        except urllib.error.HTTPError as exc:
            outcomes.append(exc.code)


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--min", type=int, default=1)
    parser.add_argument("--max", type=int, default=2)
    parser.add_argument("--cpus", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--load-s", type=float, default=90.0)
    parser.add_argument("--idle-s", type=float, default=20.0)
    parser.add_argument("--sample-s", type=float, default=1.0)
    args = parser.parse_args(argv)
    if not 1 <= args.min <= args.max < args.cpus:
        parser.error("need 1 <= --min <= --max < --cpus")
    with tempfile.TemporaryDirectory() as directory:
        config = load_config(tier_config(Path(directory), args.min, args.max), env={})
        url = start_fleet(config, num_cpus=args.cpus, object_store_memory=256 << 20)
        try:
            started = time.monotonic()
            until = started + args.load_s
            outcomes: list[int] = []
            clients = [
                threading.Thread(target=client, args=(url, args.prompt_tokens, i, until, outcomes), daemon=True)
                for i in range(args.clients)
            ]
            for thread in clients:
                thread.start()
            samples = []
            while time.monotonic() < until + args.idle_s:
                now = time.monotonic() - started
                samples.append({"t_s": round(now, 1), "replicas": len(replica_names()), "load": now < args.load_s})
                time.sleep(args.sample_s)
            for thread in clients:
                thread.join()
        finally:
            stop_fleet()
    loaded = [s["replicas"] for s in samples if s["load"]]
    idle = [s["replicas"] for s in samples if not s["load"]]
    rose = next((s["t_s"] for s in samples if s["replicas"] > args.min), None)
    print(
        json.dumps(
            {
                "args": vars(args),
                "replicas_under_load": [min(loaded), max(loaded)],
                "replicas_after_load": [min(idle), max(idle)] if idle else None,
                "within_bounds": all(args.min <= s["replicas"] <= args.max for s in samples),
                "first_rose_at_s": rose,
                "answered": sum(status == 200 for status in outcomes),
                "refused": sum(status != 200 for status in outcomes),
                "samples": samples,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    cli.run(main)

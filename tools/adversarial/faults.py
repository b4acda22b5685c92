#!/usr/bin/env python3
"""Hostile and failing prefill peers against a decode daemon (issue 15 item 3).

A ``PrefillPeer`` (``edgedecode.testing.prefill_peers``) runs here on 127.0.0.1 in front of a
real prefill server (started here, or ``--prefill-url``), and a daemon started here pulls its KV
through it. Each scenario of ``peer_faults.SCENARIOS`` (the peer never answers, stalls mid-stream,
drips one byte at a time, resets the connection before or mid-stream, answers 500, sends another
model's or another prompt's payload) runs one turn under the fault and one with the peer healthy
again; then the breaker's cycle: the peer answers 500 ``breaker_failures`` times and recovers.

Prints, per scenario, how the turn got its KV (pull / pull+local / local), the fallback reason,
the turn's time and its KV fetch's (the daemon's report) against ``fetch_timeout_s``, the
breaker's state, the counter deltas, and how the next turn went; then the breaker's states and
counters over its cycle. Exit status 1 when a turn failed, ended another way than its scenario
allows, fetched longer than ``fetch_timeout_s`` (plus ``peer_faults.FETCH_SLACK_S``), or the next
turn did not pull again.

    python tools/adversarial/faults.py [--prefill-url URL --prefill-token T] [--fetch-timeout-s 20]
        [--idle-read-timeout-s 10] [--budget 0.5] [--breaker-failures 3] [--breaker-reset-s 10] [--json PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse
import asyncio
import contextlib
import dataclasses
import socket
import tempfile
import time

import aiohttp
from aiohttp import web

from edgedecode.testing import peer_faults
from edgedecode.testing.hostile_http import Target
from edgedecode.testing.prefill_peers import PrefillPeer
from tools.common import cli
from tools.common.servers import running, toml_config

TOKENS = {"daemon": "faults-daemon", "prefill": "faults-prefill"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    p.add_argument("--prefill-url", help="a running prefill server (default: one is started here)")
    p.add_argument("--prefill-token", default="")
    p.add_argument("--connect-timeout-s", type=float, default=3.0)
    p.add_argument("--idle-read-timeout-s", type=float, default=10.0)
    p.add_argument("--fetch-timeout-s", type=float, default=20.0)
    p.add_argument("--budget", type=float, default=0.5, help="the KV budget every turn asks of the peer")
    p.add_argument("--breaker-failures", type=int, default=3)
    p.add_argument("--breaker-reset-s", type=float, default=10.0)  # longer than a turn after a failure takes loaded
    cli.add_json_file(p, help="write every outcome here")
    return p.parse_args(argv)


def daemon_settings(args: argparse.Namespace, peer_url: str) -> dict:
    return {
        "prefill_url": peer_url,
        "slots": 1,
        "max_context": 2048,
        "connect_timeout_s": args.connect_timeout_s,
        "idle_read_timeout_s": args.idle_read_timeout_s,
        "fetch_timeout_s": args.fetch_timeout_s,
        "breaker_failures": args.breaker_failures,
        "breaker_reset_s": args.breaker_reset_s,
        # pinned: every turn asks the peer, so each fault meets a pull (a planned daemon computes short prompts
        # here, and after a pull that timed out unanswered computes every turn here until it probes the link again)
        "budget": args.budget,
    }


@contextlib.contextmanager
def prefill_server(args: argparse.Namespace, directory: Path):
    """(URL, token) of the prefill server: the given one, or one started here."""
    if args.prefill_url:
        yield args.prefill_url, args.prefill_token
        return
    path = toml_config(directory / "prefill.toml", {"model": {"threads": 2}, "prefill": {"max_prompt_tokens": 2048}})
    env = {"EDGEDECODE_PREFILL_AUTH_TOKEN": TOKENS["prefill"]}
    with running(["prefill-server", "--config", str(path)], directory / "prefill.log", env=env) as (_, url):
        yield url, TOKENS["prefill"]


async def serve_peer(peer: PrefillPeer) -> tuple[web.AppRunner, str]:
    """Serve the peer on 127.0.0.1 (a free port) from this event loop; (its runner, its URL)."""
    runner = web.AppRunner(peer.app(), access_log=None)
    await runner.setup()
    sock = socket.create_server(("127.0.0.1", 0))
    site = web.SockSite(runner, sock)
    await site.start()
    return runner, site.name


async def run(args: argparse.Namespace, directory: Path, prefill_url: str, prefill_token: str) -> dict:
    """Start the peer and the daemon behind it, then run every scenario and the breaker's cycle."""
    peer = PrefillPeer(prefill_url, prefill_token)
    runner, peer_url = await serve_peer(peer)
    settings = daemon_settings(args, peer_url)
    path = toml_config(directory / "daemon.toml", {"model": {"threads": 2}, "daemon": settings})
    env = {"EDGEDECODE_DAEMON_AUTH_TOKEN": TOKENS["daemon"]}
    started = contextlib.ExitStack()
    print("starting the daemon ...", flush=True)
    _, url = await asyncio.to_thread(
        started.enter_context, running(["serve", "--config", str(path)], directory / "daemon.log", env=env)
    )
    daemon = Target("daemon", url, TOKENS["daemon"])
    report: dict = {"daemon": settings, "scenarios": []}
    try:
        async with aiohttp.ClientSession() as http:
            for scenario in peer_faults.SCENARIOS:
                await peer_faults.close_breaker(http, daemon, peer, args.breaker_reset_s)
                outcome = await peer_faults.run_scenario(http, daemon, peer, scenario, args.fetch_timeout_s)
                report["scenarios"].append(
                    {
                        "scenario": scenario.name,
                        "fault": scenario.fault,
                        "turn": dataclasses.asdict(outcome.turn),
                        "bound_s": outcome.bound_s,
                        "fetch_bound_s": outcome.fetch_bound_s,
                        "breaker_after": outcome.breaker,
                        "counters": outcome.counters,
                        "next_turn": dataclasses.asdict(outcome.recovery),
                        "problems": outcome.problems,
                    }
                )
                print_outcome(outcome)
            cycle = await peer_faults.breaker_cycle(http, daemon, peer, args.breaker_failures, args.breaker_reset_s)
            report["breaker_cycle"] = dataclasses.asdict(cycle)
            print(
                f"breaker cycle ({args.breaker_failures} 500s, then recovered; reset {args.breaker_reset_s:g} s): "
                f"reasons {cycle.reasons}, states {cycle.states}, counters {cycle.counters}, {cycle.seconds:.1f} s"
            )
    finally:
        await asyncio.to_thread(started.close)
        await runner.cleanup()
    return report


def print_outcome(outcome: peer_faults.Outcome) -> None:
    t, r = outcome.turn, outcome.recovery
    verdict = "ok  " if not outcome.problems else "FAIL"
    print(
        f"{verdict} {outcome.scenario.name:32s} {t.status} {t.way:10s} {t.reason or '-':12s} {t.seconds:6.2f} s "
        f"(fetch {t.fetch_s or 0:.2f} s, bound {outcome.fetch_bound_s:g} s)  breaker {outcome.breaker:9s} "
        f"next turn {r.way} {r.seconds:.2f} s  "
        f"{outcome.counters}" + (f"  {outcome.problems}" if outcome.problems else ""),
        flush=True,
    )


def cycle_problems(cycle: dict, failures: int) -> list[str]:
    """What is wrong with the breaker's cycle: it must open after ``failures``, skip, and close again."""
    expected = ["http_error"] * failures + ["breaker_open", None, None]
    if cycle["reasons"] != expected:
        return [f"breaker cycle: reasons {cycle['reasons']}, expected {expected}"]
    if cycle["states"][-1] != "closed":
        return [f"breaker cycle: the breaker stayed {cycle['states'][-1]} after the peer recovered"]
    return []


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    head = cli.record(__file__, argv, started)  # the commit as the run starts
    with tempfile.TemporaryDirectory(prefix="faults-") as tmp, prefill_server(args, Path(tmp)) as (url, token):
        report = head | asyncio.run(run(args, Path(tmp), url, token))
    report["wall_s"] = round(time.time() - started, 1)
    problems = [f"{s['scenario']}: {p}" for s in report["scenarios"] for p in s["problems"]]
    problems += cycle_problems(report["breaker_cycle"], args.breaker_failures)
    slowest = max(report["scenarios"], key=lambda s: s["turn"]["seconds"])
    longest = max(report["scenarios"], key=lambda s: s["turn"]["fetch_s"] or 0.0)
    report["longest_fetch"] = {
        "scenario": longest["scenario"],
        "fetch_s": longest["turn"]["fetch_s"],
        "fetch_timeout_s": args.fetch_timeout_s,
        "over_s": round((longest["turn"]["fetch_s"] or 0.0) - args.fetch_timeout_s, 3),
    }
    worst = f"{slowest['turn']['seconds']:.2f} s ({slowest['scenario']}; its fetch {slowest['turn']['fetch_s']:.2f} s)"
    print(
        f"{len(report['scenarios'])} scenarios; slowest turn {worst}; longest fetch "
        f"{longest['turn']['fetch_s'] or 0.0:.3f} s ({longest['scenario']}) against fetch_timeout_s "
        f"{args.fetch_timeout_s:g}; {len(problems)} problems" + "".join(f"\n  {problem}" for problem in problems)
    )
    if args.json:
        cli.write_json(report, args.json)
    return 1 if problems else 0


if __name__ == "__main__":
    cli.run(main)

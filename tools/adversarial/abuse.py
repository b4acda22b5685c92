#!/usr/bin/env python3
"""Hostile HTTP against a decode daemon and a prefill server (issue 15 item 2).

Runs the catalogue of hostile requests (``edgedecode.testing.hostile_http``: malformed and deeply
nested JSON, wrong types, NaN / negative / huge sampling values and budgets, invalid and
out-of-vocabulary token ids, huge stop lists, prompts over the context, unknown fields and models,
auth, methods, body limits, and extreme but valid requests) against both servers, then the hostile
clients (``hostile_clients``: slow headers and bodies, clients that leave mid-stream or mid-payload,
floods past the queue), then a plain request to each. Prints every case with its status and time,
the counts by status, and the slowest answer.

Exit status 1 on any problem: a status, param or code other than the case's (a 5xx for bad input
among them), an answer that is not OpenAI's error shape, no answer within ``--bound-s`` (a hang),
a hostile client not bounded as configured, or a server that no longer answers a plain request.

Without URLs it starts a prefill server and a daemon (one slot, a queue of 2, short client
timeouts) on 127.0.0.1 in a temporary directory. With URLs, ``--config`` is the servers' config
(its limits shape the cases; the defaults otherwise):

    python tools/adversarial/abuse.py [--json PATH]
    python tools/adversarial/abuse.py --daemon-url http://127.0.0.1:8088 --daemon-token T \\
        --prefill-url http://127.0.0.1:8089 --prefill-token P [--config /etc/edgedecode/edgedecode.toml]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse
import asyncio
import collections
import contextlib
import tempfile
import time

import aiohttp

from edgedecode.config import Config, load_config
from edgedecode.testing import hostile_clients, hostile_http
from edgedecode.testing.hostile_http import Target
from tools.common import cli
from tools.common.servers import running, toml_config

SERVERS = {
    "model": {"threads": 2},
    "daemon": {"slots": 1, "max_queue": 2, "max_context": 2048, "client_timeout_s": 2.0, "header_timeout_s": 1.0},
    "prefill": {"max_prompt_tokens": 2048, "max_queue": 4, "client_timeout_s": 3.0, "header_timeout_s": 1.5},
}
TOKENS = {"daemon": "abuse-daemon", "prefill": "abuse-prefill"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    p.add_argument("--daemon-url")
    p.add_argument("--daemon-token", default="")
    p.add_argument("--prefill-url")
    p.add_argument("--prefill-token", default="")
    p.add_argument("--config", type=Path, help="the servers' config, when URLs are given")
    p.add_argument("--model", default="smollm2-135m-instruct", help="the served model's name")
    p.add_argument("--bound-s", type=float, default=60.0, help="no hostile request may take longer")
    cli.add_json_file(p, help="write every result here")
    args = p.parse_args(argv)
    if (args.daemon_url is None) != (args.prefill_url is None):
        p.error("give both --daemon-url and --prefill-url, or neither (both are started)")
    return args


@contextlib.contextmanager
def servers(args: argparse.Namespace):
    """(daemon, prefill, their config): the given ones, or a prefill server and a daemon started here."""
    if args.daemon_url:
        config = load_config(args.config, env={})
        yield (
            Target("daemon", args.daemon_url, args.daemon_token),
            Target("prefill", args.prefill_url, args.prefill_token),
            config,
        )
        return
    with tempfile.TemporaryDirectory(prefix="abuse-") as tmp:
        directory = Path(tmp)
        path = toml_config(directory / "servers.toml", SERVERS)
        env = {"EDGEDECODE_PREFILL_AUTH_TOKEN": TOKENS["prefill"], "EDGEDECODE_DAEMON_AUTH_TOKEN": TOKENS["daemon"]}
        print("starting a prefill server and a daemon ...", flush=True)
        with running(["prefill-server", "--config", str(path)], directory / "prefill.log", env=env) as (_, prefill_url):
            daemon_env = {**env, "EDGEDECODE_DAEMON_PREFILL_TOKEN": TOKENS["prefill"]}
            daemon_args = ["serve", "--config", str(path), "--prefill-url", prefill_url]
            with running(daemon_args, directory / "daemon.log", env=daemon_env) as (_, daemon_url):
                yield (
                    Target("daemon", daemon_url, TOKENS["daemon"]),
                    Target("prefill", prefill_url, TOKENS["prefill"]),
                    load_config(path, env={}),
                )


async def run(daemon: Target, prefill: Target, config: Config, args: argparse.Namespace) -> dict:
    """Every case and hostile client against both servers; the results as plain data."""
    cases = {
        "daemon": hostile_http.daemon_cases(config, args.model),
        "prefill": hostile_http.prefill_cases(config, args.model),
    }
    targets = {"daemon": daemon, "prefill": prefill}
    report: dict = {"cases": [], "clients": [], "healthy": {}}
    async with aiohttp.ClientSession() as http:
        for server, target in targets.items():
            for case in cases[server]:
                result = await hostile_http.send(http, target, case, args.bound_s)
                line = {
                    "server": server,
                    "case": case.name,
                    "status": result.status,
                    "expected": case.status,
                    "seconds": round(result.seconds, 3),
                    "param": None if result.error is None else result.error.get("param"),
                    "code": None if result.error is None else result.error.get("code"),
                    "problems": result.problems,
                }
                report["cases"].append(line)
                verdict = (
                    f"FAIL {case.name}  ({'; '.join(result.problems)})" if result.problems else f"ok   {case.name}"
                )
                print(f"[{server:7s}] {result.status or '---'} {result.seconds:6.2f} s  {verdict}", flush=True)
        slots_total = (await hostile_clients.slots(http, daemon))["total"]
        findings = [
            await hostile_clients.slow_headers(http, daemon, config.daemon.header_timeout_s),
            await hostile_clients.slow_headers(http, prefill, config.prefill.header_timeout_s),
            await hostile_clients.slow_body(daemon, config.daemon.client_timeout_s),
            await hostile_clients.slow_body(prefill, config.prefill.client_timeout_s),
            await hostile_clients.leave(http, daemon, stream=True),
            await hostile_clients.leave(http, daemon, stream=False),
            await hostile_clients.leave_mid_payload(http, prefill),
            await hostile_clients.flood(http, daemon, slots_total + config.daemon.max_queue + 3),
            await hostile_clients.flood(http, prefill, 4 * config.prefill.max_queue),
        ]
        for finding in findings:
            report["clients"].append(
                {
                    "server": finding.server,
                    "behaviour": finding.name,
                    "ok": finding.ok,
                    "seconds": round(finding.seconds, 2),
                    "detail": finding.detail,
                }
            )
            print(
                f"[{finding.server:7s}] {'ok  ' if finding.ok else 'FAIL'} {finding.name}: {finding.detail}", flush=True
            )
        for server, target in targets.items():
            served, seconds = await hostile_clients.healthy(http, target)
            report["healthy"][server] = {"served": served, "seconds": round(seconds, 2)}
    return report


def summarize(report: dict) -> list[str]:
    """Print counts by status and the slowest answer per server; return the problems found."""
    problems = []
    for server in ("daemon", "prefill"):
        lines = [line for line in report["cases"] if line["server"] == server]
        statuses = collections.Counter(str(line["status"]) for line in lines)
        slowest = max(lines, key=lambda line: line["seconds"])
        errors_5xx = sum(1 for line in lines if line["status"] is not None and line["status"] >= 500)
        hangs = sum(1 for line in lines if line["status"] is None)
        print(
            f"{server}: {len(lines)} requests, by status {dict(sorted(statuses.items()))}; 5xx {errors_5xx}, "
            f"no answer {hangs}; slowest {slowest['seconds']:.2f} s ({slowest['case']})"
        )
        problems += [f"{server}: {line['case']}: {'; '.join(line['problems'])}" for line in lines if line["problems"]]
        healthy = report["healthy"][server]
        served = "served" if healthy["served"] else "FAILED"
        print(f"{server}: a plain request afterwards {served} in {healthy['seconds']} s")
        if not healthy["served"]:
            problems.append(f"{server} no longer answers a plain request")
    problems += [f"{c['server']}: {c['behaviour']}: {c['detail']}" for c in report["clients"] if not c["ok"]]
    return problems


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    head = cli.record(__file__, argv, started)  # the commit as the run starts
    with servers(args) as (daemon, prefill, config):
        report = head | asyncio.run(run(daemon, prefill, config, args))
    report["wall_s"] = round(time.time() - started, 1)
    problems = summarize(report)
    print(f"{len(problems)} problems" + "".join(f"\n  {problem}" for problem in problems))
    if args.json:
        cli.write_json(report, args.json)
    return 1 if problems else 0


if __name__ == "__main__":
    cli.run(main)

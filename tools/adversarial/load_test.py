#!/usr/bin/env python3
"""Load and isolation against one real decode daemon pulling its KV from a real prefill server on 127.0.0.1 (or
computing it, ``--prefill local``): many streamed multi-turn chats at once, each answer held to the same
conversation's answer alone, and the daemon's memory over many requests.

For each --clients count C: C conversations (distinct subjects, --turns turns, greedy, --max-tokens)
run first one at a time ("alone"), then all at once, each client its own user (the daemon's
fair-queueing key) and session, every turn's prompt the same as alone. Each answer under load is classified
against the one alone: **exact** (the same text), **near-tie** (it departs from it only where the two tokens were
within --near-tie logits after the same context, ``testing.agreement.divergence_gap`` in process on the same INT4
graph: the KV took another path, e.g. compressed between turns instead of resident, or pulled instead of
computed) or **different** (a wider gap: wrong); a turn whose KV lost tokens to the memory ladder (dropped or
evicted tokens in its report) is counted as **lossy**, not compared. Reported per C: turns completed and failed,
the counts of each class, where the KV came from (pulled or computed), time to first token (p50 / p95 / max)
under load and alone, and fairness: Jain's index over the clients' mean TTFT, and the longest wait against the
median. Then --sequential short requests one after another, the daemon's RSS sampled after each: first, last,
max, and the least-squares slope over the last 80 % (KiB per request). The KV memory budget is checked at the end
against the daemon's peak gauge. With remote prefill the daemon's budget is pinned (--budget): every turn pulls.
Exit status 1 when a turn failed or an answer was different.

    python tools/adversarial/load_test.py [--clients 8 32] [--turns 2] [--max-tokens 16] [--slots 2]
                              [--kv-memory-mb 64] [--sequential 500] [--threads 2] [--prefill remote|local]
                              [--budget 0.5] [--json FILE]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp
import numpy as np
import psutil

from edgedecode.daemon.openai_api import parse_request
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import LoadedModel, load_model
from edgedecode.runtime.engine import Engine
from edgedecode.testing.agreement import divergence_gap
from edgedecode.testing.metrics_scrape import scrape_metrics
from tools.common import cli
from tools.common.servers import running, toml_config

SUBJECTS = (
    "the sea", "a mountain", "the city at night", "a forest", "the desert", "a river", "snow", "a market",
    "a library", "the moon", "a bridge", "rain", "a garden", "an old clock", "a train", "the wind",
)  # fmt: skip
FOLLOW_UPS = ("Another one, shorter?", "Now one about its colours.", "And its sounds?")


@dataclass
class Turn:
    """One streamed turn as the client saw it."""

    client: int
    turn: int
    messages: list[dict]
    answer: str = ""
    ttft_s: float | None = None
    error: str | None = None
    report: dict = field(default_factory=dict)


def conversation_opening(client: int) -> list[dict]:
    """The first user message of client ``client``'s conversation."""
    subject = SUBJECTS[client % len(SUBJECTS)]
    return [{"role": "user", "content": f"Write one sentence about {subject} (note {client})."}]


async def stream_turn(http: aiohttp.ClientSession, url: str, turn: Turn, session: str, max_tokens: int) -> Turn:
    """Send ``turn`` as a streamed chat completion and record what came back."""
    body = {
        "messages": turn.messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "session_id": session,
        "user": f"client-{turn.client}",
    }
    started = time.perf_counter()
    try:
        async with http.post(url + "/v1/chat/completions", json=body) as response:
            if response.status != 200:
                turn.error = f"{response.status}: {(await response.text())[:200]}"
                return turn
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                for choice in event.get("choices", []):
                    text = choice.get("delta", {}).get("content") or ""
                    if text and turn.ttft_s is None:
                        turn.ttft_s = time.perf_counter() - started
                    turn.answer += text
                turn.report = event.get("edgedecode", turn.report)
    except (TimeoutError, aiohttp.ClientError) as exc:
        turn.error = f"{type(exc).__name__}: {exc}"
    return turn


async def run_conversation(
    http: aiohttp.ClientSession, url: str, client: int, turns: int, max_tokens: int, session: str, said: dict | None
) -> list[Turn]:
    """Client ``client``'s turns in order; each next prompt carries the answer ``said`` gives for the
    turn (the alone run's), else this run's own."""
    messages = conversation_opening(client)
    done = []
    for number in range(turns):
        turn = await stream_turn(http, url, Turn(client, number, list(messages)), session, max_tokens)
        done.append(turn)
        if turn.error is not None:
            break
        answer = turn.answer if said is None else said[client, number]
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UPS[number % 3]}]
    return done


async def run_clients(url: str, clients: int, turns: int, max_tokens: int, tag: str, said: dict | None) -> list[Turn]:
    """``clients`` conversations at once (one at a time when ``said`` is None, the reference run)."""
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        if said is None:
            done = []
            for client in range(clients):
                done += await run_conversation(http, url, client, turns, max_tokens, f"{tag}-{client}", None)
            return done
        tasks = [
            run_conversation(http, url, client, turns, max_tokens, f"{tag}-{client}", said) for client in range(clients)
        ]
        return [turn for conversation in await asyncio.gather(*tasks) for turn in conversation]


ANSWER_CLASSES = ("exact", "near_tie", "different", "lossy", "failed")


def classify_answers(
    model: LoadedModel, engine: Engine, alone: list[Turn], loaded: list[Turn], near_tie: float
) -> list[dict]:
    """Each loaded turn's class against the same turn alone (``ANSWER_CLASSES``: see the module docstring), with
    the logit gap where the answers depart."""
    reference = {(t.client, t.turn): t for t in alone}
    classified = []
    for turn in loaded:
        mine = reference[turn.client, turn.turn]
        entry: dict = {"client": turn.client, "turn": turn.turn}
        if turn.error is not None:
            entry["class"] = "failed"
        elif turn.answer == mine.answer:
            entry["class"] = "exact"
        elif lossy(turn):
            entry["class"] = "lossy"
        else:
            request = parse_request(
                {"messages": turn.messages}, "chat", model, default_max_tokens=1, session_header=None
            )
            alone_ids, loaded_ids = (model.tokenizer.encode(t.answer, add_bos=False) for t in (mine, turn))
            gap = divergence_gap(engine, request.prompt_ids, alone_ids, loaded_ids)
            entry |= {"class": "near_tie" if gap <= near_tie else "different", "gap_logits": round(gap, 4)}
            entry |= {"alone": mine.answer, "loaded": turn.answer}
        classified.append(entry)
    return classified


def lossy(turn: Turn) -> bool:
    """Whether the turn's KV lost tokens under memory pressure (dropped in the store, or evicted
    from its own slot): its answer may then differ from the one alone by more than a near-tie."""
    kv = turn.report.get("kv", {})
    return bool(kv.get("restored_tiers", {}).get("DROP") or kv.get("evicted_tokens"))


def latency_summary(turns: list[Turn]) -> dict:
    """TTFT percentiles and fairness across clients."""
    ttfts = np.array([t.ttft_s for t in turns if t.ttft_s is not None])
    by_client: dict[int, list[float]] = {}
    for t in turns:
        if t.ttft_s is not None:
            by_client.setdefault(t.client, []).append(t.ttft_s)
    means = np.array([statistics.fmean(v) for v in by_client.values()])
    return {
        "ttft_p50_s": float(np.percentile(ttfts, 50)),
        "ttft_p95_s": float(np.percentile(ttfts, 95)),
        "ttft_max_s": float(ttfts.max()),
        "jain_fairness": float(means.sum() ** 2 / (len(means) * (means**2).sum())),
        "max_over_median_ttft": float(ttfts.max() / np.median(ttfts)),
    }


def sequential_rss(url: str, pid: int, requests: int, max_tokens: int) -> dict:
    """``requests`` short completions one after another, the daemon's RSS (MiB) after each."""
    process = psutil.Process(pid)
    rss = []
    for i in range(requests):
        body = {"prompt": f"Request {i}: count from {i} to {i + 5}.", "max_tokens": max_tokens, "temperature": 0}
        request = urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            json.load(response)
        rss.append(process.memory_info().rss / (1 << 20))
    tail = np.array(rss[len(rss) // 5 :])
    slope = np.polyfit(np.arange(len(tail)), tail, 1)[0] if len(tail) > 1 else 0.0
    return {
        "requests": requests,
        "rss_first_mib": rss[0],
        "rss_last_mib": rss[-1],
        "rss_max_mib": max(rss),
        "slope_kib_per_request": float(slope * 1024),
    }


def peak_kv_memory(url: str) -> float:
    """The daemon's ``edgedecode_kv_memory_peak_bytes``."""
    return scrape_metrics(url)["edgedecode_kv_memory_peak_bytes{}"]


def daemon_config(directory: Path, args: argparse.Namespace, prefill_url: str | None) -> Path:
    """The config of a daemon sized for the run, pulling from ``prefill_url`` (None: local prefill only)."""
    daemon = {
        "slots": args.slots,
        "max_context": 2048,
        "kv_memory_mb": args.kv_memory_mb,
        "max_sessions": max(max(args.clients), args.slots),
        "max_queue": max(args.clients) + 8,
    }
    # a pinned budget: every turn asks the prefill server (the planner would compute these short prompts here)
    remote = {"prefill_url": prefill_url, "budget": args.budget}
    daemon |= {"local_prefill_only": True} if prefill_url is None else remote
    return toml_config(directory / "daemon.toml", {"model": {"threads": args.threads}, "daemon": daemon})


@contextlib.contextmanager
def prefill_server(args: argparse.Namespace, directory: Path) -> Iterator[str | None]:
    """The URL of a prefill server started on 127.0.0.1 for the run (None with ``--prefill local``)."""
    if args.prefill == "local":
        yield None
        return
    config = toml_config(
        directory / "prefill.toml", {"model": {"threads": args.threads}, "prefill": {"max_prompt_tokens": 2048}}
    )
    with running(["prefill-server", "--config", str(config)], directory / "prefill.log") as (_, url):
        yield url


def run(args: argparse.Namespace) -> dict:
    """The whole load test (see the module docstring); returns its figures."""
    model = load_model()
    engine = Engine(model, GraphOptions.for_device("decode", "cpu"), max_context=2048, threads=args.threads)
    results: dict = {"settings": vars(args), "loads": []}
    with tempfile.TemporaryDirectory() as workdir, prefill_server(args, Path(workdir)) as prefill_url:
        config = daemon_config(Path(workdir), args, prefill_url)
        with running(["serve", "--config", str(config)], Path(workdir) / "daemon.log") as (process, url):
            for clients in args.clients:
                alone = asyncio.run(run_clients(url, clients, args.turns, args.max_tokens, f"alone{clients}", None))
                said = {(t.client, t.turn): t.answer for t in alone}
                started = time.perf_counter()
                loaded = asyncio.run(run_clients(url, clients, args.turns, args.max_tokens, f"load{clients}", said))
                wall = time.perf_counter() - started
                classified = classify_answers(model, engine, alone, loaded, args.near_tie)
                results["loads"].append(
                    {
                        "clients": clients,
                        "turns": len(loaded),
                        "failed": [t.error for t in loaded if t.error is not None],
                        "answers": {name: sum(c["class"] == name for c in classified) for name in ANSWER_CLASSES},
                        "departures": [c for c in classified if c["class"] in ("near_tie", "different")],
                        "kv_sources": {
                            "alone": dict(Counter(kv_source(t) for t in alone)),
                            "loaded": dict(Counter(kv_source(t) for t in loaded)),
                        },
                        "wall_s": wall,
                        "loaded": latency_summary(loaded),
                        "alone": latency_summary(alone),
                        "resumes": dict(Counter(t.report.get("kv", {}).get("resume") for t in loaded)),
                    }
                )
            if args.sequential:
                results["sequential"] = sequential_rss(url, process.pid, args.sequential, 8)
            results["kv_memory_peak_bytes"] = peak_kv_memory(url)
    results["kv_memory_budget_bytes"] = args.kv_memory_mb << 20
    return results


def kv_source(turn: Turn) -> str:
    """Where the turn's KV came from, as its report says ("prefill_server", "local"; "none" without a report)."""
    return str(turn.report.get("kv", {}).get("source", "none"))


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__doc__)
    parser.add_argument("--clients", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--kv-memory-mb", type=int, default=64)
    parser.add_argument("--sequential", type=int, default=500)
    cli.add_threads(parser)
    parser.add_argument("--near-tie", type=float, default=1.0, help="logits")
    parser.add_argument(
        "--prefill", choices=("remote", "local"), default="remote", help="a prefill server here, or local prefill"
    )
    parser.add_argument(
        "--budget", type=float, default=0.5, help="KV wire bytes / FP16 bytes every turn asks of the prefill server"
    )
    cli.add_json_file(parser, help="write the figures here")
    args = parser.parse_args(argv)
    head = cli.record(__file__, argv, time.time())  # the commit as the run starts
    results = head | run(args)
    for load in results["loads"]:
        lo, al, n = load["loaded"], load["alone"], load["answers"]
        print(
            f"{load['clients']} clients: {load['turns'] - len(load['failed'])}/{load['turns']} turns completed; "
            f"answers against alone: {n['exact']} exact, {n['near_tie']} near-tie, {n['different']} different, "
            f"{n['lossy']} with tokens lost to the memory ladder (not compared); KV {load['kv_sources']}; "
            "TTFT p50/p95/max "
            f"{lo['ttft_p50_s']:.2f}/{lo['ttft_p95_s']:.2f}/{lo['ttft_max_s']:.2f} s under load "
            f"({al['ttft_p50_s']:.2f} s alone), Jain {lo['jain_fairness']:.3f}, max/median "
            f"{lo['max_over_median_ttft']:.1f}; resumes {load['resumes']}; {load['wall_s']:.0f} s"
        )
    if "sequential" in results:
        s = results["sequential"]
        print(
            f"{s['requests']} sequential requests: RSS {s['rss_first_mib']:.0f} -> {s['rss_last_mib']:.0f} MiB "
            f"(max {s['rss_max_mib']:.0f}), slope {s['slope_kib_per_request']:+.2f} KiB/request over the last 80 %"
        )
    peak, budget = results["kv_memory_peak_bytes"], results["kv_memory_budget_bytes"]
    print(f"KV memory peak {peak / (1 << 20):.1f} MiB of a {budget >> 20} MiB budget")
    if args.json:
        cli.write_json(results, args.json, indent=2)
    bad = sum(len(load["failed"]) + load["answers"]["different"] for load in results["loads"])
    return 1 if bad else 0


if __name__ == "__main__":
    cli.run(main)

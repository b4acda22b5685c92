"""Hostile and failing prefill peers against a decode daemon (issue 15 item 3): scenarios, each one
``PrefillPeer`` fault under one turn, and the breaker's cycle over a peer that fails and recovers.

A scenario's turn must complete — through the pull, through local prefill (a fallback, its reason
counted), or part pulled and the rest computed — within the daemon's ``fetch_timeout_s`` plus the
prefill and decode of a short answer; and the next turn, the peer healthy again, must pull its KV
(no sticky failure). ``run_scenario`` and ``breaker_cycle`` say what happened, with the daemon's
counters' deltas and the breaker's state.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from edgedecode.testing.hostile_http import CHAT, Target
from edgedecode.testing.prefill_peers import PrefillPeer

ANSWER_SLACK_S = 30.0  # a loaded 2-core box: local prefill and a short answer after a failed pull
# past fetch_timeout_s, a pull only lets the ingest thread verify what arrived before it (at most 2 MiB, FEED_BYTES)
FETCH_SLACK_S = 0.5
SENTENCE = "The lighthouse keeper wrote down the weather every morning before dawn."  # 13 tokens
COUNTED = ("edgedecode_prefill_fallbacks_total", "edgedecode_prefill_breaker_transitions_total")


@dataclass(frozen=True)
class Scenario:
    """A peer fault and the ways a turn under it may end: ``ways`` of "pull", "pull+local" (part of
    the KV pulled, the rest computed), "local"; ``reasons``: the fallback reasons that fit it; ``cut``: the turn
    may also end with its pull cut by the planner's watch (the link collapsed: the rest computed sooner here, no
    fallback counted), as a turn planned under the default objective does against a stalling or dripping peer."""

    name: str
    fault: str
    ways: tuple[str, ...]
    reasons: tuple[str | None, ...]
    sentences: int = 12  # the prompt's length: about 13 tokens each (12: one EDKV chunk)
    cut: bool = False

    @property
    def prompt(self) -> str:
        return "Summarize: " + " ".join([SENTENCE] * self.sentences)


SCENARIOS = (
    Scenario("a healthy peer", "relay", ("pull",), (None,)),
    Scenario("never answers", "hang", ("local",), ("timeout",)),
    Scenario("stalls mid-stream", "stall", ("local", "pull+local"), ("timeout",), cut=True),
    # half of a long prompt's payload holds whole chunks: they are kept, and the rest is resumed from the
    # same peer, which stalls again; the whole fetch must still end within fetch_timeout_s ("local" when the
    # prefill server took longer than idle_read_timeout_s to compute it: the peer relays whole payloads)
    Scenario(
        "stalls mid-stream, a long prompt", "stall", ("pull+local", "local"), ("timeout",), sentences=55, cut=True
    ),
    Scenario("drips one byte at a time", "drip", ("local",), ("timeout",), cut=True),
    Scenario("resets the connection", "reset", ("local",), ("unreachable",)),
    Scenario("resets mid-stream", "reset_mid_stream", ("local", "pull+local"), ("truncated",)),
    Scenario("answers 500", "errors", ("local",), ("http_error",)),
    Scenario("sends another model's payload", "other_model", ("local",), ("bad_payload",)),
    Scenario("sends another prompt's payload", "other_prompt", ("local",), ("bad_payload",)),
)


@dataclass
class Turn:
    """One completion through the daemon: how it ended and how long it took."""

    status: int | None  # None: no answer in time
    way: str  # "pull", "pull+local", "local" or "error"
    reason: str | None  # the fallback reason
    seconds: float
    fetch_s: float | None = None  # the daemon's time fetching the KV (its report's kv.fetch_ms)
    segments: tuple[str, ...] = ()  # how each request of the fetch ended ("complete", "cut", a failure's reason)


@dataclass
class Outcome:
    """What a scenario's turn did, the recovery turn after it, and what the daemon counted."""

    scenario: Scenario
    turn: Turn
    recovery: Turn
    bound_s: float  # the turn's: the fetch's bound, then local prefill and a short answer
    fetch_bound_s: float  # the daemon's fetch_timeout_s (plus FETCH_SLACK_S)
    breaker: str  # after the scenario's turn
    counters: dict[str, float] = field(default_factory=dict)  # non-zero deltas

    @property
    def problems(self) -> list[str]:
        """Why the scenario failed: a turn that did not complete, ended the wrong way or too late."""
        s, t = self.scenario, self.turn
        found = []
        if t.status != 200:
            found.append(f"status {t.status}")
        cut = s.cut and t.reason is None and t.way in ("local", "pull+local") and t.segments[-1:] == ("cut",)
        if (t.way not in s.ways or t.reason not in s.reasons) and not cut:
            found.append(f"ended {t.way} ({t.reason}), expected {'/'.join(s.ways)} ({s.reasons})")
        if t.seconds > self.bound_s:
            found.append(f"took {t.seconds:.1f} s, bound {self.bound_s:.1f} s")
        if t.fetch_s is not None and t.fetch_s > self.fetch_bound_s:
            found.append(f"its KV fetch took {t.fetch_s:.1f} s, bound {self.fetch_bound_s:.1f} s")
        if (self.recovery.status, self.recovery.way) != (200, "pull"):
            found.append(f"the next turn with the peer healthy ended {self.recovery.way} ({self.recovery.reason})")
        return found


async def counters(http: aiohttp.ClientSession, daemon: Target) -> dict[str, float]:
    """The daemon's fallback and breaker-transition counters, keyed ``name{label}``."""
    async with http.get(daemon.url + "/metrics", headers={"Authorization": f"Bearer {daemon.token}"}) as response:
        text = await response.text()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in COUNTED:
                labels = ",".join(f"{key}={value}" for key, value in sample.labels.items())
                values[f"{sample.name}{{{labels}}}"] = sample.value
    return values


async def breaker_state(http: aiohttp.ClientSession, daemon: Target) -> str:
    """The daemon's breaker state from /readyz: closed, open or half-open."""
    async with http.get(daemon.url + "/readyz", headers={"Authorization": f"Bearer {daemon.token}"}) as response:
        return (await response.json())["prefill"]["breaker"]


async def turn(http: aiohttp.ClientSession, daemon: Target, bound_s: float, prompt: str = SCENARIOS[0].prompt) -> Turn:
    """One short greedy chat completion of ``prompt`` through ``daemon``: how its KV came and how long it took."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "temperature": 0}
    started = time.perf_counter()
    try:
        async with http.post(
            daemon.url + CHAT,
            json=body,
            headers={"Authorization": f"Bearer {daemon.token}"},
            timeout=aiohttp.ClientTimeout(total=bound_s + ANSWER_SLACK_S),
        ) as response:
            status, answer = response.status, await response.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError):
        return Turn(None, "error", None, time.perf_counter() - started)
    seconds = time.perf_counter() - started
    if status != 200:
        return Turn(status, "error", None, seconds)
    kv = answer["edgedecode"]["kv"]
    way = "local" if kv["source"] == "local" else "pull+local" if kv["fallback_reason"] else "pull"
    ended = tuple(segment["ended"] for segment in kv.get("segments", []))
    return Turn(status, way, kv["fallback_reason"], seconds, kv["fetch_ms"] / 1e3, ended)


async def run_scenario(
    http: aiohttp.ClientSession, daemon: Target, peer: PrefillPeer, scenario: Scenario, fetch_timeout_s: float
) -> Outcome:
    """One turn with ``peer`` faulty as ``scenario`` says, then one with it healthy again."""
    before = await counters(http, daemon)
    fetch_bound_s = fetch_timeout_s + FETCH_SLACK_S
    bound_s = fetch_bound_s + ANSWER_SLACK_S
    peer.set_fault(scenario.fault, burst=1)
    try:
        faulty = await turn(http, daemon, bound_s, scenario.prompt)
    finally:
        peer.set_fault("relay")
    state = await breaker_state(http, daemon)
    recovery = await turn(http, daemon, bound_s, scenario.prompt)
    after = await counters(http, daemon)
    deltas = {key: after[key] - before.get(key, 0.0) for key in after if after[key] != before.get(key, 0.0)}
    return Outcome(scenario, faulty, recovery, bound_s, fetch_bound_s, state, deltas)


@dataclass
class BreakerCycle:
    """The breaker over a peer that fails ``failures`` times and then recovers."""

    reasons: list[str | None]  # the fallback reason of each turn, in order
    states: list[str]  # the breaker after each turn
    counters: dict[str, float]  # non-zero deltas over the cycle
    seconds: float


async def close_breaker(http: aiohttp.ClientSession, daemon: Target, peer: PrefillPeer, reset_s: float) -> None:
    """Heal the peer and, if the breaker is not closed, wait out ``reset_s`` and send its trial turn."""
    peer.set_fault("relay")
    if await breaker_state(http, daemon) != "closed":
        await asyncio.sleep(reset_s)
        await turn(http, daemon, 120.0)


async def breaker_cycle(
    http: aiohttp.ClientSession, daemon: Target, peer: PrefillPeer, failures: int, reset_s: float
) -> BreakerCycle:
    """The peer answers 500 to ``failures`` turns (the daemon's ``breaker_failures``): they fall
    back and open the breaker; the next turn skips the peer; after ``reset_s`` the trial turn finds
    the peer recovered and closes the breaker; the turn after pulls too."""
    await close_breaker(http, daemon, peer, reset_s)
    before = await counters(http, daemon)
    started = time.perf_counter()
    reasons, states = [], []

    async def one() -> None:
        reasons.append((await turn(http, daemon, 120.0)).reason)
        states.append(await breaker_state(http, daemon))

    peer.set_fault("errors", burst=failures)
    for _ in range(failures + 1):
        await one()
    await asyncio.sleep(reset_s)
    await one()  # the trial
    await one()
    after = await counters(http, daemon)
    deltas = {key: after[key] - before.get(key, 0.0) for key in after if after[key] != before.get(key, 0.0)}
    return BreakerCycle(reasons, states, deltas, time.perf_counter() - started)

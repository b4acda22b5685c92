"""Hostile and failing prefill peers (issue 15 item 3): every turn completes, through the pull or
through local prefill, within the configured timeouts; the breaker opens on a failing peer and
closes again once it recovers; the counters say what happened.

The first part drives the daemon's pipeline in process (fake engines, as in
test_decode_pipeline.py) against peers that misbehave in ways a real server cannot be made to.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np
from aiohttp import web
from serving_helpers import ThreadedApp
from test_decode_pipeline import CONTRACT, HEAD_DIM, HEADS, LAYERS, FakeEngine, drive, fallbacks, make_service, run_turn

from edgedecode.kv.snapshot import KVProducer, KVSnapshot
from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire import TransferRef, encode_payload
from edgedecode.testing import peer_faults
from edgedecode.testing.hostile_http import Target

# --- in process: a peer that breaks off every segment after its first chunk ------------------------

LONG_PROMPT = np.arange(1, 901, dtype=np.int64)  # several EDKV chunks: a resume has something to ask for


class BreakingPeer:
    """Answers every prefill and resume with the payload's header and first chunk (real EDKV, with a
    transfer to resume), then goes silent with the connection open (``after`` "stall") or resets it
    ("reset")."""

    def __init__(self, after: str, frames: int = 2) -> None:
        self.after = after
        self.frames = frames  # sent before it breaks: the header (1), and the first chunk (2)
        self.requests: list[str] = []
        app = web.Application()
        app.router.add_post("/v1/prefill", self.answer)
        app.router.add_post("/v1/prefill/transfers/{transfer_id}", self.answer)
        self.server = ThreadedApp(app)
        self.url = self.server.url

    async def answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(request.path)
        held = body["held_tokens"]
        n = len(LONG_PROMPT) - held
        kv = np.random.default_rng(n).standard_normal((LAYERS, HEADS, n, HEAD_DIM)).astype(np.float32)
        snapshot = KVSnapshot(
            CONTRACT, LONG_PROMPT[held:], np.arange(held, len(LONG_PROMPT)), kv, kv, KVProducer("fake", "ab" * 32, "x")
        )
        frames = list(encode_payload(snapshot, np.full(n, Tier.FP16, np.uint8), transfer=TransferRef("t", 30)))
        response = web.StreamResponse(headers={"Content-Type": "application/x-edkv"})
        await response.prepare(request)
        await response.write(b"".join(frames[: self.frames]))
        if self.after == "reset":
            assert request.transport is not None
            request.transport.abort()
            return response
        for _ in range(200):  # at most 10 s; the daemon hangs up long before
            if request.transport is None or request.transport.is_closing():
                break
            await asyncio.sleep(0.05)
        return response


def test_a_segment_reset_after_its_first_chunk_keeps_that_chunk():
    """The bytes a broken segment had received since its last hand-over to the ingest thread (up
    to FEED_BYTES, 1 MiB: all of a short prompt's payload) were dropped, so nothing it sent was kept."""
    peer = BreakingPeer("reset")
    try:
        service = make_service(peer.url, [FakeEngine(max_context=1024)], fetch_timeout_s=5.0)
        report = drive(service, lambda: run_turn(service, LONG_PROMPT)).report
    finally:
        peer.server.stop()
    assert report.kv_source == "prefill_server"
    assert [segment["ended"] for segment in report.segments] == ["truncated"] * 4  # each resumed where it broke
    assert all(segment["tokens"] > 0 for segment in report.segments)  # and kept its chunk
    assert report.pulled_tokens == len(LONG_PROMPT) - 1 and report.computed_tokens == 1  # so all of it came


def test_a_segment_that_times_out_having_verified_nothing_is_not_resumed():
    """Its header names a transfer, but a peer that sent no whole chunk in idle_read_timeout_s would
    most likely stall a resume too: the rest is computed here at once."""
    peer = BreakingPeer("stall", frames=1)
    try:
        service = make_service(peer.url, [FakeEngine(max_context=1024)], fetch_timeout_s=3.0, idle_read_timeout_s=0.3)
        report = drive(service, lambda: run_turn(service, LONG_PROMPT)).report
    finally:
        peer.server.stop()
    assert (report.kv_source, report.fallback_reason) == ("local", "timeout")
    assert [segment["ended"] for segment in report.segments] == ["timeout"] and peer.requests == ["/v1/prefill"]
    assert report.fetch_seconds < 1.0


def test_a_stalled_pull_ends_at_its_timeout_not_rounded_up_to_a_whole_second():
    """aiohttp rounds a timeout over its ceil_threshold (5 s) up to the next whole second of the event loop's clock:
    a pull with fetch_timeout_s 20 ended 20.9 s after it began (docs/reliability.md). Started just after a whole
    second of that clock, a 5.2 s fetch timeout would end about 0.7 s late."""
    peer = BreakingPeer("stall", frames=1)
    try:
        service = make_service(peer.url, [FakeEngine(max_context=1024)], fetch_timeout_s=5.2, idle_read_timeout_s=30.0)

        async def scenario():
            await asyncio.sleep(1.05 - time.monotonic() % 1)  # the loop's clock is time.monotonic()
            return (await run_turn(service, LONG_PROMPT)).report

        report = drive(service, scenario)
    finally:
        peer.server.stop()
    assert [segment["ended"] for segment in report.segments] == ["timeout"]
    assert 5.2 <= report.fetch_seconds < 5.2 + 0.4


def test_a_peer_that_stalls_every_segment_holds_a_turn_no_longer_than_the_fetch_timeout_then_is_skipped():
    """Each segment kept what it verified and the rest was resumed from the same peer: up to 4
    segments of idle_read_timeout_s each (2 s here), past fetch_timeout_s (1 s); and since part of
    the KV arrived every time, the breaker counted the peer healthy and never opened. The budget is pinned: a
    daemon planning its turns would compute the second one here if the first brought too few bytes to measure the
    link (how many arrive before the stall is the box's speed), and never ask the peer again."""
    peer = BreakingPeer("stall")
    try:
        service = make_service(
            peer.url,
            [FakeEngine(max_context=1024)],
            budget=0.3,
            fetch_timeout_s=1.0,
            idle_read_timeout_s=0.5,
            breaker_failures=2,
        )

        async def scenario():
            return [(await run_turn(service, LONG_PROMPT)).report for _ in range(3)]

        first, second, third = drive(service, scenario)
    finally:
        peer.server.stop()
    for report in (first, second):
        assert (report.kv_source, report.fallback_reason) == ("prefill_server", "timeout")  # what arrived is used
        assert len(report.segments) >= 2 and report.segments[1]["ended"] == "timeout"  # a resume was tried
        assert report.fetch_seconds < 1.0 + 0.4
    assert (third.fallback_reason, third.segments) == ("breaker_open", [])
    assert len(peer.requests) == len(first.segments) + len(second.segments)  # the open breaker asked nothing
    assert fallbacks(service) == {"timeout": 2.0, "breaker_open": 1.0}
    transitions = service.metrics.registry.get_sample_value
    assert transitions("edgedecode_prefill_breaker_transitions_total", {"to": "open"}) == 1.0


# --- real servers: the session's daemon pulling through a PrefillPeer in front of the prefill server --


def _run(work):
    async def main():
        async with aiohttp.ClientSession() as http:
            return await work(http)

    return asyncio.run(main())


def test_the_breaker_opens_on_a_failing_peer_and_closes_again_once_it_recovers(hostile_daemon, prefill_peer):
    """The peer answers 500 twice (breaker_failures 2), then recovers: the breaker opens, skips the
    peer, lets a trial through after breaker_reset_s (8 s), closes, and every turn is answered."""
    peer, _ = prefill_peer
    daemon = Target("daemon", hostile_daemon.url, hostile_daemon.token)
    d = hostile_daemon.config.daemon
    cycle = _run(lambda http: peer_faults.breaker_cycle(http, daemon, peer, d.breaker_failures, d.breaker_reset_s))
    assert cycle.reasons == ["http_error", "http_error", "breaker_open", None, None]
    assert cycle.states == ["closed", "open", "open", "closed", "closed"]
    assert cycle.counters == {
        "edgedecode_prefill_fallbacks_total{reason=http_error}": 2.0,
        "edgedecode_prefill_fallbacks_total{reason=breaker_open}": 1.0,
        "edgedecode_prefill_breaker_transitions_total{to=open}": 1.0,
        "edgedecode_prefill_breaker_transitions_total{to=closed}": 1.0,
    }


def test_a_peer_sending_another_prompts_payload_costs_one_turn_a_local_prefill_and_the_next_pulls_again(
    hostile_daemon, prefill_peer
):
    """A well-formed payload from the real prefill server, for another prompt of the same length:
    refused at its header, counted, the turn prefilled here. (Every other fault: tools/adversarial/faults.py;
    those that must be waited out, in process above.)"""
    peer, _ = prefill_peer
    daemon = Target("daemon", hostile_daemon.url, hostile_daemon.token)
    d = hostile_daemon.config.daemon
    scenario = next(s for s in peer_faults.SCENARIOS if s.fault == "other_prompt")

    async def work(http):
        await peer_faults.close_breaker(http, daemon, peer, d.breaker_reset_s)
        return await peer_faults.run_scenario(http, daemon, peer, scenario, d.fetch_timeout_s)

    outcome = _run(work)
    assert not outcome.problems, outcome.problems
    assert outcome.counters == {f"edgedecode_prefill_fallbacks_total{{reason={outcome.turn.reason}}}": 1.0}

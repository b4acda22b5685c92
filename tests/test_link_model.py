"""The link model (daemon.pull.link): moving averages of goodput, round trip and server time per token,
their idle decay to a stale (not forgotten) estimate, predictions and gauges; what the planner
makes of a remembered link; the estimate kept across restarts (daemon.pull.link_store); and the pull's
own timings against a real aiohttp endpoint on 127.0.0.1 sending a real EDKV payload in timed pieces."""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry
from serving_helpers import ThreadedApp

from edgedecode.daemon.pull.adaptive import KVPlan, PlanInputs, plan_kv
from edgedecode.daemon.pull.calibration import shipped
from edgedecode.daemon.pull.link import STALE_MARGIN, LinkEstimate, LinkModel, LinkModels, Reprobes
from edgedecode.daemon.pull.link_store import LinkStore
from edgedecode.daemon.pull.segment import PullResult, PullSettings, first_segment, pull_segment
from edgedecode.kv.snapshot import KVProducer, KVSnapshot
from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire import EDKVReader, encode_payload
from edgedecode.model.spec import DECODER_KV_LAYOUT, KVContract
from edgedecode.runtime.handoff import StreamedKV
from edgedecode.testing.clock import FakeClock

MB = 1_000_000


def pull(goodput: float, rtt: float, server: float | None = 0.0, transfer_bytes: int = MB) -> PullResult:
    """A pull whose body after its first read came at ``goodput`` bytes/s, headers after ``rtt`` + ``server``."""
    return PullResult(
        wire_bytes=transfer_bytes + 4096,
        fp16_bytes=4 * transfer_bytes,
        tier_counts={"FP16": 100},
        seconds=rtt + (server or 0.0) + transfer_bytes / goodput,
        server_seconds=server,
        headers_seconds=rtt + (server or 0.0),
        transfer_seconds=transfer_bytes / goodput,
        transfer_bytes=transfer_bytes,
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_a_constant_link_is_learned_from_the_first_pull_and_stays(clock):
    link = LinkModel("http://p", clock=clock)
    assert link.estimate() == LinkEstimate(None, None, None)
    for _ in range(20):
        link.observe(pull(10 * MB, 0.02, server=0.1), tokens=1000)
        estimate = link.estimate()
        assert estimate.goodput_bps == pytest.approx(10 * MB)
        assert estimate.rtt_s == pytest.approx(0.02)
        assert estimate.server_s_per_token == pytest.approx(1e-4)
        clock.now += 1.0


def test_a_noisy_link_converges_to_its_mean_time_per_byte(clock):
    link = LinkModel("http://p", clock=clock)
    rates = [8 * MB, 12 * MB]  # alternating: the mean time per byte is that of 9.6 MB/s
    for i in range(200):
        link.observe(pull(rates[i % 2], 0.01 + 0.01 * (i % 2)), tokens=100)
        clock.now += 0.5
    estimate = link.estimate()
    assert estimate.goodput_bps == pytest.approx(9.6 * MB, rel=0.1)
    assert estimate.rtt_s == pytest.approx(0.015, rel=0.2)


def test_a_step_change_is_followed_within_a_few_pulls(clock):
    link = LinkModel("http://p", clock=clock)
    for _ in range(10):
        link.observe(pull(12.5 * MB, 0.02), tokens=100)  # 100 Mbit/s
        clock.now += 1.0
    link.observe(pull(1.25 * MB, 0.2), tokens=100)  # 10 Mbit/s, 10× the round trip
    first = link.estimate()
    assert first.goodput_bps is not None and first.rtt_s is not None
    assert 1.25 * MB < first.goodput_bps < 0.5 * 12.5 * MB  # a collapse weighs by the time it costs
    assert 0.02 < first.rtt_s < 0.2
    for _ in range(12):
        clock.now += 1.0
        link.observe(pull(1.25 * MB, 0.2), tokens=100)
    after = link.estimate()
    assert after.goodput_bps == pytest.approx(1.25 * MB, rel=0.05)
    assert after.rtt_s == pytest.approx(0.2, rel=0.05)


def test_after_a_long_idle_time_the_estimate_is_stale_not_forgotten(clock):
    link = LinkModel("http://p", half_life_s=60.0, stale_margin=1.5, clock=clock)
    link.observe(pull(10 * MB, 0.02, server=0.1), tokens=1000)
    clock.now += 150  # 2.5 half-lives: still fresh
    assert link.estimate() == LinkEstimate(pytest.approx(10 * MB), pytest.approx(0.02), pytest.approx(1e-4))
    fresh_s = link.predict_fetch_s(MB, 100)
    clock.now += 3600  # an hour idle: remembered, every time 1.5x the learned one
    assert link.estimate() == LinkEstimate(
        pytest.approx(10 * MB / 1.5), pytest.approx(0.03), pytest.approx(1.5e-4), stale=True
    )
    assert link.predict_fetch_s(MB, 100) == pytest.approx(1.5 * fresh_s)
    # the next pull is the estimate (the stale past does not dilute it): a changed link is learned from it
    link.observe(pull(1 * MB, 0.3, server=0.5), tokens=1000)
    assert link.estimate() == LinkEstimate(pytest.approx(1 * MB), pytest.approx(0.3), pytest.approx(5e-4))


def test_a_steady_history_stays_fresh_longer_than_a_lone_pull(clock):
    lone, steady = LinkModel("http://a", clock=clock), LinkModel("http://b", clock=clock)
    for _ in range(10):
        steady.observe(pull(10 * MB, 0.02), tokens=100)
    lone.observe(pull(10 * MB, 0.02), tokens=100)
    clock.now += 250
    assert lone.estimate().stale and not steady.estimate().stale
    clock.now += 100
    assert steady.estimate().stale


def test_a_reprobe_is_due_once_neither_a_pull_nor_a_reprobe_was_made_for_its_period(clock):
    link, reprobes = LinkModel("http://p", clock=clock), Reprobes(600.0, clock=clock)
    other = LinkModel("http://q", clock=clock)
    assert not reprobes.due("http://p", link)  # made (or restored at a restart) just now
    clock.now += 600
    assert reprobes.due("http://p", link)  # nothing measured it for 600 s
    assert not reprobes.due("http://p", link)  # just re-probed (its pull may fail before teaching anything)
    link.observe(pull(10 * MB, 0.02), tokens=100)
    clock.now += 599
    assert not reprobes.due("http://p", link)  # re-probed and measured 599 s ago
    clock.now += 1
    assert reprobes.due("http://p", link) and not reprobes.due("http://p", link)
    assert reprobes.due("http://q", other)  # per endpoint
    never = Reprobes(0.0, clock=clock)
    assert not never.due("http://q", other)
    with pytest.raises(ValueError, match="every_s"):
        Reprobes(-1.0)


def test_a_stale_margin_below_one_is_refused():
    with pytest.raises(ValueError, match="stale_margin"):
        LinkModel("http://p", stale_margin=0.9)


def test_short_pulls_teach_the_round_trip_but_not_the_goodput(clock):
    link = LinkModel("http://p", clock=clock)
    link.observe(pull(1 * MB, 0.02, transfer_bytes=0), tokens=10)  # the body came in one read
    link.observe(pull(1 * MB, 0.02, transfer_bytes=60_000), tokens=10)  # under 64 KiB after the first read
    estimate = link.estimate()
    assert estimate.goodput_bps is None and estimate.rtt_s == pytest.approx(0.02)
    assert link.predict_fetch_s(MB, 10) is None
    link.observe(pull(1 * MB, 0.02, transfer_bytes=70_000), tokens=10)
    assert link.estimate().goodput_bps == pytest.approx(1 * MB)


def test_a_split_pull_teaches_the_round_trip_and_server_time_but_not_the_goodput(clock):
    link = LinkModel("http://p", clock=clock)
    link.observe(pull(10 * MB, 0.02, server=0.1), tokens=1000)
    # a saturated tier: the split's pull waited 2 s for a replica; its ingest shared the cores with the head
    link.observe(pull(1 * MB, 2.0, server=0.2), tokens=1000, goodput=False)
    estimate = link.estimate()
    assert estimate.goodput_bps == pytest.approx(10 * MB)  # the slowed ingest is not the link's
    assert estimate.rtt_s == pytest.approx((0.02 + 2.0) / 2)  # the queueing is learned
    assert estimate.server_s_per_token == pytest.approx((1e-4 + 2e-4) / 2)


def test_the_round_trip_excludes_the_servers_reported_time_and_is_floored_at_zero(clock):
    link = LinkModel("http://p", clock=clock)
    result = pull(10 * MB, 0.0, server=0.5)
    link.observe(PullResult(**{**result.__dict__, "headers_seconds": 0.4}), tokens=100)  # a clock skew
    assert link.estimate().rtt_s == 0.0
    unreported = LinkModel("http://q", clock=clock)
    unreported.observe(PullResult(**{**result.__dict__, "server_seconds": None}), tokens=100)
    estimate = unreported.estimate()
    assert estimate.rtt_s == pytest.approx(0.5)  # the server's time stays in the round trip
    assert estimate.server_s_per_token is None
    unreported.observe(pull(10 * MB, 0.0, server=0.5), tokens=0)  # no tokens asked: no time per token
    assert unreported.estimate().server_s_per_token is None


def test_predict_fetch_s_adds_round_trip_server_compute_and_transfer(clock):
    link = LinkModel("http://p", clock=clock)
    assert link.predict_fetch_s(MB, 100) is None
    link.observe(pull(1 * MB, 0.02, server=0.1), tokens=1000)  # 1e-4 s per token
    assert link.predict_fetch_s(2 * MB, 500) == pytest.approx(0.02 + 0.05 + 2.0)
    assert link.predict_fetch_s(0, 0) == pytest.approx(0.02)
    unreported = LinkModel("http://q", clock=clock)
    unreported.observe(pull(1 * MB, 0.02, server=None), tokens=1000)
    assert unreported.predict_fetch_s(MB, 500) == pytest.approx(0.02 + 1.0)  # compute counts as 0


def test_a_server_that_splits_its_time_teaches_compute_per_computed_token_and_the_rest_per_token_sent(clock):
    link = LinkModel("http://p", clock=clock)
    whole = dataclasses.replace(pull(1 * MB, 0.02, server=0.5), server_compute_seconds=0.4)
    link.observe(whole, tokens=1000, sent_tokens=1000)  # 0.4 ms a computed token, 0.1 ms a token sent
    estimate = link.estimate()
    assert estimate.server_s_per_token == pytest.approx(4e-4)
    assert estimate.server_s_per_sent_token == pytest.approx(1e-4)
    # a prefix-cache hit: 64 tokens computed, 1000 sent; the encoding is priced, not only the 64 tokens
    assert link.predict_fetch_s(MB, 64, 1000) == pytest.approx(0.02 + 64 * 4e-4 + 0.1 + 1.0)
    hit = dataclasses.replace(pull(1 * MB, 0.02, server=0.13), server_compute_seconds=0.03)
    clock.now += 1.0
    link.observe(hit, tokens=64, sent_tokens=1000)  # a hit teaches both parts too
    assert link.estimate().server_s_per_sent_token == pytest.approx(1e-4)
    assert 4e-4 < link.estimate().server_s_per_token < 0.03 / 64
    # a report that does not add up (compute beyond the whole) teaches neither part
    before = link.estimate()
    link.observe(dataclasses.replace(pull(1 * MB, 0.02, server=0.1), server_compute_seconds=0.2), 10, sent_tokens=10)
    assert (link.estimate().server_s_per_token, link.estimate().server_s_per_sent_token) == (
        before.server_s_per_token,
        before.server_s_per_sent_token,
    )


def test_a_stored_estimate_from_before_the_split_server_time_is_still_loaded(clock, tmp_path):
    store = LinkStore(tmp_path)
    store.path("http://p").write_text(
        '{"version": 1, "endpoint": "http://p", "seconds_per_byte": 1e-6, "rtt_s": 0.02, "server_s_per_token": 1e-4}'
    )
    assert store.load("http://p") == {
        "seconds_per_byte": 1e-6,
        "rtt_s": 0.02,
        "server_s_per_token": 1e-4,
        "server_s_per_sent_token": None,
    }


def test_link_models_export_goodput_and_rtt_per_endpoint(clock):
    registry = CollectorRegistry()
    links = LinkModels(registry, clock=clock)

    def gauges(endpoint: str) -> tuple[float | None, float | None]:
        labels = {"endpoint": endpoint}
        return (
            registry.get_sample_value("edgedecode_link_goodput_bytes_per_second", labels),
            registry.get_sample_value("edgedecode_link_rtt_seconds", labels),
        )

    a = links.get("http://10.0.0.1:8000/")
    assert links.get("http://10.0.0.1:8000") is a and "http://10.0.0.1:8000/" in links
    assert gauges("http://10.0.0.1:8000") == (None, None)  # nothing learned: nothing exported (no NaN)
    a.observe(pull(5 * MB, 0.03, server=0.2, transfer_bytes=1000), tokens=100)  # too short for goodput
    assert gauges("http://10.0.0.1:8000") == (None, pytest.approx(0.03))
    a.observe(pull(5 * MB, 0.03, server=0.2), tokens=100)
    assert gauges("http://10.0.0.1:8000") == (pytest.approx(5 * MB), pytest.approx(0.03))
    b = links.get("http://10.0.0.2:8000")
    assert b is not a
    b.observe(pull(50 * MB, 0.001), tokens=100)
    assert gauges("http://10.0.0.2:8000") == (pytest.approx(50 * MB), pytest.approx(0.001))
    assert gauges("http://10.0.0.1:8000") == (pytest.approx(5 * MB), pytest.approx(0.03))


# --- what the planner makes of a remembered link --------------------------------------------------

FIRST_TURN_TOKENS = 316  # a 256-token system prompt and a user message (tools/sim/fleet.py's first turn)
FP16_BYTES_PER_TOKEN = 23040  # SmolLM2-135M
SLOW, FAST = pull(5e6 / 8, 0.08, server=0.02), pull(200e6 / 8, 0.015, server=0.02)  # 5 and 200 Mbit/s


def _plan(link: LinkModel, *, target_s: float = 1.0, local_s: float = 0.6, local_dppl: float = 0.0) -> KVPlan:
    """The daemon's plan for a first turn's KV with ``link`` (the configured budget is 0.3)."""
    fp16_bytes = FIRST_TURN_TOKENS * FP16_BYTES_PER_TOKEN
    return plan_kv(
        PlanInputs(
            target_s=target_s,
            fixed_budget=0.3,
            wire_bytes=lambda budget: int(budget * fp16_bytes),
            predict_remote_s=lambda wire_bytes: link.predict_fetch_s(wire_bytes, FIRST_TURN_TOKENS),
            local_s=local_s,
            min_budget=0.2,
            quality=shipped()["smollm2-135m-instruct"].quality(local_dppl),
        )
    )


def _idle_link(clock: FakeClock, *pulls: PullResult) -> LinkModel:
    """A link model that learned from ``pulls`` and was then idle for an hour (60 half-lives)."""
    link = LinkModel("http://p", clock=clock)
    for result in pulls:
        link.observe(result, tokens=FIRST_TURN_TOKENS)
        clock.now += 20.0
    clock.now += 3600.0
    assert link.estimate().stale
    return link


def test_a_link_never_pulled_from_asks_the_configured_budget(clock):
    plan = _plan(LinkModel("http://p", clock=clock))
    assert (plan.decision, plan.budget, plan.predicted_s) == ("remote", 0.3, None)


def test_a_slow_link_remembered_after_idleness_plans_local_prefill_or_a_small_budget(clock):
    link = _idle_link(clock, SLOW, SLOW)
    assert _plan(link).decision == "local"  # b 0.3 would take ~3.5 s at 5 Mbit/s
    # where local prefill is costly and slow too: the fastest pull allowed, below the configured 0.3
    costly = _plan(link, local_s=30.0, local_dppl=5.0)
    assert (costly.decision, costly.budget) == ("remote", 0.2) and costly.predicted_s is not None


def test_a_fast_link_remembered_after_idleness_plans_a_lossless_pull(clock):
    plan = _plan(_idle_link(clock, FAST, FAST))
    assert (plan.decision, plan.budget) == ("remote", 0.5), plan  # lossless, and faster than b 1.0 or local
    fresh = FAST.headers_seconds + 0.5 * FIRST_TURN_TOKENS * FP16_BYTES_PER_TOKEN / (200e6 / 8)
    assert plan.predicted_s == pytest.approx(STALE_MARGIN * fresh)  # planned with the margin


@pytest.mark.parametrize(("before", "now", "decision"), [(SLOW, FAST, "remote"), (FAST, SLOW, "local")])
def test_a_link_that_changed_while_idle_is_learned_again_from_one_pull(clock, before, now, decision):
    link = _idle_link(clock, before, before, before)
    link.observe(now, tokens=FIRST_TURN_TOKENS)
    estimate = link.estimate()
    assert not estimate.stale and estimate.goodput_bps == pytest.approx(now.transfer_bytes / now.transfer_seconds)
    assert _plan(link).decision == decision


# --- the link estimate kept across restarts ---------------------------------------------------------


def test_a_restarted_daemon_starts_from_the_stored_estimate_as_stale(clock, tmp_path):
    before = LinkModels(CollectorRegistry(), store=LinkStore(tmp_path), clock=clock)
    before.get("http://10.0.0.1:8000/").observe(SLOW, tokens=FIRST_TURN_TOKENS)
    assert [p.name for p in tmp_path.iterdir()] == [LinkStore(tmp_path).path("http://10.0.0.1:8000").name]

    after = LinkModels(CollectorRegistry(), store=LinkStore(tmp_path), clock=clock)
    restored = after.get("http://10.0.0.1:8000")
    assert restored.estimate() == LinkEstimate(
        pytest.approx(5e6 / 8 / STALE_MARGIN),
        pytest.approx(0.08 * STALE_MARGIN),
        pytest.approx(0.02 / FIRST_TURN_TOKENS * STALE_MARGIN),
        stale=True,
    )
    assert _plan(restored).decision == "local"
    assert after.get("http://10.0.0.2:8000").estimate() == LinkEstimate(None, None, None)  # another endpoint


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        '{"version": 2, "endpoint": "http://p", "seconds_per_byte": 1e-6}',
        '{"version": 1, "endpoint": "http://q", "seconds_per_byte": 1e-6}',
        '{"version": 1, "endpoint": "http://p", "seconds_per_byte": NaN}',
        '{"version": 1, "endpoint": "http://p", "seconds_per_byte": 0}',
        '{"version": 1, "endpoint": "http://p", "rtt_s": -1}',
        '{"version": 1, "endpoint": "http://p", "rtt_s": "0.1"}',
        "[1, 2]",
    ],
)
def test_a_stored_estimate_that_is_not_valid_is_ignored(clock, tmp_path, caplog, text):
    store = LinkStore(tmp_path)
    store.path("http://p").write_text(text)
    assert store.load("http://p") is None
    assert "ignoring the link estimate" in caplog.text
    links = LinkModels(CollectorRegistry(), store=store, clock=clock)
    assert links.get("http://p").estimate() == LinkEstimate(None, None, None)


def test_a_link_estimate_that_cannot_be_stored_is_logged_and_the_pull_still_teaches(clock, tmp_path, caplog):
    links = LinkModels(CollectorRegistry(), store=LinkStore(tmp_path / "missing"), clock=clock)
    link = links.get("http://p")
    link.observe(FAST, tokens=FIRST_TURN_TOKENS)
    assert "cannot store the link estimate" in caplog.text
    assert link.estimate().goodput_bps == pytest.approx(200e6 / 8)


# --- the pull's timings against a real endpoint ----------------------------------------------------

LAYERS, HEADS, HEAD_DIM, N_TOKENS = 4, 4, 64, 128  # 4 KiB per token at FP16: a 512 KiB payload
CONTRACT = KVContract("llama", LAYERS, HEADS, HEAD_DIM, 10000.0, DECODER_KV_LAYOUT, "tok")
PIECES, PIECE_GAP_S, SERVER_S = 8, 0.02, 0.05
STALL_S, READ_TIMEOUT_S = 2.0, 0.3  # a body going silent for longer than the pull's read timeout


def edkv_payload(token_ids: np.ndarray) -> bytes:
    rng = np.random.default_rng(0)
    n = len(token_ids)
    snapshot = KVSnapshot(
        CONTRACT,
        token_ids,
        np.arange(n),
        rng.standard_normal((LAYERS, HEADS, n, HEAD_DIM)).astype(np.float32),
        rng.standard_normal((LAYERS, HEADS, n, HEAD_DIM)).astype(np.float32),
        KVProducer("fake", "ab" * 32, "float32"),
    )
    return b"".join(encode_payload(snapshot, np.full(n, Tier.FP16, np.uint8)))


def piecewise(payload: bytes, stall_after: int | None = None):
    """A prefill handler: ``SERVER_S`` of compute, then ``payload`` in ``PIECES`` pieces ``PIECE_GAP_S``
    apart; with ``stall_after``, silent after that many pieces (until the client gives up)."""
    bounds = np.linspace(0, len(payload), PIECES + 1).astype(int)

    async def prefill(request: web.Request) -> web.StreamResponse:
        await request.json()
        await asyncio.sleep(SERVER_S)  # the server's compute, reported in its header
        response = web.StreamResponse(
            headers={"Content-Type": "application/x-edkv", "X-Prefill-Seconds": f"{SERVER_S:.4f}"}
        )
        await response.prepare(request)
        for i in range(PIECES):
            if i:
                await asyncio.sleep(STALL_S if i == stall_after else PIECE_GAP_S)
            await response.write(payload[bounds[i] : bounds[i + 1]])
        await response.write_eof()
        return response

    return prefill, bounds


def pull_from(prefill, prompt: np.ndarray, timeout: aiohttp.ClientTimeout) -> tuple[PullResult, StreamedKV, str]:
    """One segment pulled from ``prefill`` served on 127.0.0.1: (its result, the stream, the server's URL)."""
    server = ThreadedApp.posting("/v1/prefill", prefill)
    buffer = np.zeros((LAYERS, 2, HEADS, N_TOKENS, HEAD_DIM), np.float32)
    stream = StreamedKV(
        lambda position, slot: EDKVReader(CONTRACT, max_tokens=N_TOKENS, target_factory=lambda header: buffer),
        prompt,
        0,
        0,
    )
    settings = PullSettings(server.url + "/", "", "importance", 1 << 24, timeout)

    async def run() -> PullResult:
        async with aiohttp.ClientSession() as http:
            request = first_segment(prompt, 0, 1.0, "importance")
            return await pull_segment(http, settings, request, stream, ingest, 4 * 1024)

    try:
        with ThreadPoolExecutor(1) as ingest:
            result = asyncio.run(run())
    finally:
        server.stop()
    return result, stream, server.url


def test_a_pull_times_its_round_trip_and_transfer_and_teaches_the_link(clock):
    prompt = np.arange(1, N_TOKENS + 1, dtype=np.int64)
    payload = edkv_payload(prompt)
    prefill, bounds = piecewise(payload)
    result, stream, url = pull_from(prefill, prompt, aiohttp.ClientTimeout(total=10))

    assert stream.finished and result.wire_bytes == len(payload)
    assert result.tier_counts["FP16"] == N_TOKENS and result.server_seconds == pytest.approx(SERVER_S)
    assert result.headers_seconds >= SERVER_S  # the headers came after the server's compute
    true_rate = (len(payload) - bounds[1]) / ((PIECES - 1) * PIECE_GAP_S)  # bytes after the first piece / time
    assert (PIECES - 1) * PIECE_GAP_S * 0.9 <= result.transfer_seconds <= result.seconds
    assert bounds[1] > 0 and 0 < result.transfer_bytes <= len(payload) - 1
    links = LinkModels(CollectorRegistry(), clock=clock)
    link = links.get(url)
    link.observe(result, tokens=N_TOKENS)
    estimate = link.estimate()
    assert estimate.goodput_bps is not None and true_rate / 2 <= estimate.goodput_bps <= 2 * true_rate
    assert estimate.rtt_s is not None and 0 <= estimate.rtt_s < 0.1
    assert estimate.server_s_per_token == pytest.approx(SERVER_S / N_TOKENS)


def test_a_pull_broken_off_by_a_silent_link_counts_the_silence_in_its_transfer_time(clock):
    prompt = np.arange(1, N_TOKENS + 1, dtype=np.int64)
    payload = edkv_payload(prompt)
    prefill, bounds = piecewise(payload, stall_after=PIECES // 2)
    result, _, _ = pull_from(prefill, prompt, aiohttp.ClientTimeout(total=10, sock_read=READ_TIMEOUT_S))
    assert result.failure is not None and result.failure.reason == "timeout" and not result.complete
    assert result.wire_bytes == bounds[PIECES // 2] and result.transfer_bytes == bounds[PIECES // 2] - bounds[1]
    assert result.transfer_seconds >= READ_TIMEOUT_S + (PIECES // 2 - 1) * PIECE_GAP_S * 0.9
    link = LinkModel("http://p", clock=clock)
    link.observe(result, tokens=N_TOKENS)  # what the fetch does with a segment that got its headers
    # the goodput taught is the bytes over the time to the failure, not over the reads that came
    assert link.estimate().goodput_bps == pytest.approx(result.transfer_bytes / result.transfer_seconds)
    assert link.estimate().goodput_bps < result.transfer_bytes / READ_TIMEOUT_S

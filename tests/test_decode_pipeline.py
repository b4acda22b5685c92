"""The decode daemon's pipeline (DecodeService) without the model: fake engines in the slots, a real
aiohttp prefill endpoint on 127.0.0.1 serving real EDKV payloads (good or broken), the real pull
client, breaker, slot pool and worker thread. Runs in seconds."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest
from aiohttp import web
from serving_helpers import ThreadedApp

from edgedecode.config import load_config
from edgedecode.daemon.memory.ledger import KVMemoryError
from edgedecode.daemon.metrics import DaemonMetrics
from edgedecode.daemon.openai_api import CompletionRequest
from edgedecode.daemon.pull.local_speed import LocalPrefillModel
from edgedecode.daemon.pull.segment import KVPullError, PullResult
from edgedecode.daemon.report import TurnReport
from edgedecode.daemon.service import DecodeService
from edgedecode.daemon.turn import Turn
from edgedecode.kv.snapshot import KVProducer, KVSnapshot
from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire import EDKVHeader, EDKVReader, decode_snapshot, encode_payload
from edgedecode.model.spec import DECODER_KV_LAYOUT, KVContract
from edgedecode.runtime.engine import GenerationStats
from edgedecode.runtime.handoff import KVSource, SegmentReader, StreamedKV
from edgedecode.runtime.kvcache import KVInjectionError
from edgedecode.runtime.sampler import SamplingParams
from edgedecode.testing.clock import FakeClock

LAYERS, HEADS, HEAD_DIM = 2, 2, 64
CONTRACT = KVContract("llama", LAYERS, HEADS, HEAD_DIM, 10000.0, DECODER_KV_LAYOUT, "tok")
TOKENS = [101, 102, 103]  # what every fake generation yields
PROMPT = np.arange(1, 41, dtype=np.int64)


# --- a fake engine, and the model around it ---------------------------------------------------------


class FakeEngine:
    """Generates TOKENS; a stream opened on it is a real EDKV reader writing into a numpy buffer.

    ``hold``: while not set, a stream's header waits in the ingest thread (a slow ingest).
    ``used``: (kv source, tokens adopted from a stream, keep) of every generation.
    """

    def __init__(self, max_context: int = 128) -> None:
        self.max_context = max_context
        self.kv_bytes_per_slot = 4 * 2 * LAYERS * HEADS * HEAD_DIM
        self.stats = GenerationStats()
        self.length = 0
        self.buffer = np.zeros((LAYERS, 2, HEADS, max_context, HEAD_DIM), np.float32)
        self.history = np.zeros(0, np.int64)
        self.used: list[tuple[str, int, int]] = []
        self.hold: threading.Event | None = None
        self.header_arrived = threading.Event()
        self.ingesting = 0  # feeds in progress on the ingest thread
        self.reader_finishes = 0  # calls of the EDKV readers' finish()
        self.generated_while_ingesting = False
        self.heads: list[tuple[int, bool]] = []  # (head tokens, whether the stream had ended) per compute_head

    def reusable_prefix(self, prompt_ids: np.ndarray) -> int:
        n = min(len(self.history), len(prompt_ids) - 1)
        differ = np.flatnonzero(self.history[:n] != prompt_ids[:n])
        return int(differ[0]) if len(differ) else max(n, 0)

    def open_kv_stream(self, prompt_ids: np.ndarray, keep: int = 0, head: int = 0) -> StreamedKV:
        prompt_ids = np.asarray(prompt_ids, np.int64)
        self.length = keep

        def open_reader(first_position: int, first_slot: int) -> EDKVReader:
            def target(header: EDKVHeader) -> np.ndarray:
                self.header_arrived.set()
                if self.hold is not None:
                    self.hold.wait(10)
                if len(header.positions) and (
                    header.positions[0] < first_position
                    or header.positions[-1] >= len(prompt_ids)
                    or not np.array_equal(header.token_ids, prompt_ids[header.positions])
                ):
                    raise KVInjectionError("the KV's token ids are not the prompt's tokens after those covered")
                return self.buffer[:, :, :, first_slot:]

            reader = EDKVReader(CONTRACT, max_tokens=self.max_context - first_slot, target_factory=target)
            finish = reader.finish

            def counted_finish() -> EDKVHeader:
                self.reader_finishes += 1
                return finish()

            reader.finish = counted_finish  # type: ignore[method-assign]
            return reader

        return _TrackedStream(self, open_reader, prompt_ids, keep, head)

    def compute_head(self, stream: StreamedKV) -> None:
        self.heads.append((stream.head, stream.ended))

    kv_preallocated = False

    @property
    def held_positions(self) -> np.ndarray:
        return np.arange(self.length)  # every position held, one per slot

    def reset(self) -> None:
        self.length = 0

    def evict(self, positions: np.ndarray) -> None:
        raise AssertionError("the pipeline tests never evict an active conversation's tokens")

    def release_unused(self) -> None:
        self.buffer[:, :, :, self.length :] = 0

    def export_positions(self, view: bool = False) -> tuple[KVSnapshot, np.ndarray]:
        n = len(self.history)
        kv = self.buffer[:, :, :, :n]
        producer = KVProducer("fake", "ab" * 32, "float32")
        snapshot = KVSnapshot(CONTRACT, self.history.copy(), np.arange(n), kv[:, 0].copy(), kv[:, 1].copy(), producer)
        return snapshot, np.ones(n, bool)

    def given_importance(self) -> np.ndarray:
        return np.full(len(self.history), np.nan, np.float32)  # this fake keeps none

    windowed_from = 0  # CONTRACT has no sliding windows
    windowed_tail = 0

    def restore(self, prompt_ids: np.ndarray, payload: bytes) -> int:
        kept = decode_snapshot(payload, CONTRACT)
        n = min(len(kept.token_ids), len(prompt_ids))
        differ = np.flatnonzero(kept.token_ids[:n] != prompt_ids[:n])
        common = int(differ[0]) if len(differ) else n
        self.history, self.length = kept.token_ids[:common].copy(), common
        self.buffer[:, 0, :, :common] = kept.keys[:, :, :common]
        self.buffer[:, 1, :, :common] = kept.values[:, :, :common]
        return self.reusable_prefix(prompt_ids)

    def generate(
        self, prompt_ids: np.ndarray, params: SamplingParams, kv: KVSource = None, keep: int = 0, constraint=None
    ):
        if self.ingesting:
            self.generated_while_ingesting = True
        if isinstance(kv, StreamedKV):
            assert kv.owner is self and np.array_equal(kv.prompt_ids, prompt_ids)
            if not kv.ended:
                kv.finish()
            used = ("stream", len(kv.adopted()[0]), kv.keep)
        else:
            assert kv is None
            used = ("local", 0, keep)
        self.used.append(used)
        covered = kv.covered if isinstance(kv, StreamedKV) else keep
        head = kv.head if isinstance(kv, StreamedKV) else 0
        self.stats = GenerationStats(
            prompt_tokens=len(prompt_ids),
            injected_tokens=used[1],
            reused_tokens=used[2],
            computed_tokens=len(prompt_ids) - min(covered, len(prompt_ids) - 1) + head,
        )
        self.history, self.length = np.asarray(prompt_ids, np.int64), len(prompt_ids)
        self.stats.finish_reason = "length"
        tokens = TOKENS[: params.max_tokens]
        for i, token in enumerate(tokens):
            self.stats.generated_tokens += 1
            yield token
            if i + 1 < len(tokens):  # a token runs when the next one is asked for; the last never does
                self.history = np.append(self.history, token)


class _TrackedStream(StreamedKV):
    """A StreamedKV that tells its engine while the ingest thread feeds it."""

    def __init__(
        self, engine: FakeEngine, open_reader: SegmentReader, prompt_ids: np.ndarray, keep: int, head: int = 0
    ) -> None:
        super().__init__(open_reader, prompt_ids, keep, keep, owner=engine, head=head)
        self.engine = engine

    def feed(self, data) -> None:
        self.engine.ingesting += 1
        try:
            time.sleep(0.05)  # the ingest thread is still busy a while after the header
            super().feed(data)
        finally:
            self.engine.ingesting -= 1


class _Decoder:
    def feed(self, token: int) -> str:
        return f"<{token}>"

    def flush(self) -> str:
        return ""


MODEL = SimpleNamespace(
    spec=SimpleNamespace(
        kv_bytes_per_token_fp16=2 * 2 * LAYERS * HEADS * HEAD_DIM,
        kv_contract=CONTRACT,
        n_heads=HEADS,  # the shape prompt runs' working memory is estimated from
        ffn_size=4 * HEADS * HEAD_DIM,
        hidden_size=HEADS * HEAD_DIM,
    ),
    tokenizer=SimpleNamespace(stream_decoder=_Decoder),
    record=SimpleNamespace(name="fake"),
)
EXPECTED_TEXT = "".join(f"<{token}>" for token in TOKENS)


# --- a prefill endpoint serving real EDKV payloads -------------------------------------------------


def payload_for(token_ids: np.ndarray, held: int) -> bytes:
    """A real EDKV payload with KV of ``token_ids`` from position ``held`` on (all FP16)."""
    n = len(token_ids) - held
    rng = np.random.default_rng(n)
    snapshot = KVSnapshot(
        CONTRACT,
        token_ids[held:],
        np.arange(held, len(token_ids)),
        rng.standard_normal((LAYERS, HEADS, n, HEAD_DIM)).astype(np.float32),
        rng.standard_normal((LAYERS, HEADS, n, HEAD_DIM)).astype(np.float32),
        KVProducer("fake", "ab" * 32, "float32"),
    )
    return b"".join(encode_payload(snapshot, np.full(n, Tier.FP16, np.uint8)))


class PrefillEndpoint:
    """POST /v1/prefill answering as ``mode`` says; counts the requests and keeps their bodies."""

    def __init__(self) -> None:
        self.mode = "good"
        self.bodies: list[dict] = []
        self.server = ThreadedApp.posting("/v1/prefill", self.prefill)
        self.url = self.server.url

    async def prefill(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        token_ids, held = np.asarray(body["token_ids"], np.int64), body["held_tokens"]
        if self.mode == "http_error":
            return web.Response(status=500, text="the prefill graph failed")
        if self.mode == "redirect" and "redirected" not in request.query:  # to a good answer, on this server
            raise web.HTTPTemporaryRedirect("/v1/prefill?redirected=1")
        if self.mode == "rejected":
            return web.Response(status=400, text="bad request")
        if self.mode == "slow":
            await asyncio.sleep(1.0)
        payload = bytearray(payload_for(token_ids + (self.mode == "other-prompt"), held))
        if self.mode == "trickle":  # two quick pieces (the header in the first), then the rest after a pause
            response = web.StreamResponse(headers={"Content-Type": "application/x-edkv"})
            await response.prepare(request)
            half = len(payload) // 2
            for piece in (payload[:half], payload[half : half + 16]):
                await response.write(bytes(piece))
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)
            await response.write(bytes(payload[half + 16 :]))
            return response
        if self.mode == "corrupt":
            payload[len(payload) // 2] ^= 0x40
        elif self.mode == "truncated":
            payload = payload[: len(payload) // 2]
        return web.Response(
            body=bytes(payload), content_type="application/x-edkv", headers={"X-Prefill-Seconds": "0.001"}
        )


@pytest.fixture(scope="module")
def endpoint():
    served = PrefillEndpoint()
    yield served
    served.server.stop()


@pytest.fixture
def prefill(endpoint):
    endpoint.mode, endpoint.bodies = "good", []
    return endpoint


def closed_port_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# --- the pipeline ------------------------------------------------------------------------------------


def make_service(
    url: str | None, engines: list[FakeEngine] | None = None, clock: Callable[[], float] = time.monotonic, **daemon
) -> DecodeService:
    settings = {"slots": 1, "memory_reserve_mb": 0, "fetch_timeout_s": 0.4, "breaker_failures": 3} | daemon
    config = load_config(None, env={}, overrides={"daemon": settings})
    engines = engines or [FakeEngine()]
    return DecodeService(MODEL, engines, config, DaemonMetrics(), lambda: url, "", clock=clock)  # type: ignore[arg-type]


def request(prompt: np.ndarray = PROMPT, session: str | None = None) -> CompletionRequest:
    params = SamplingParams(max_tokens=len(TOKENS), stop_token_ids=())
    return CompletionRequest("text", prompt, params, False, False, (), session, None)


async def run_turn(service: DecodeService, prompt: np.ndarray = PROMPT, session: str | None = None) -> Turn:
    turn = service.turn(request(prompt, session), "client", time.perf_counter())
    await turn.open()
    text = "".join([piece.text async for piece in turn.pieces()])
    assert text == EXPECTED_TEXT
    return turn


def drive(service: DecodeService, scenario):
    """Run ``scenario()`` on a fresh event loop with the service started, then close it."""

    async def main():
        await service.start()
        try:
            return await scenario()
        finally:
            await service.close()

    return asyncio.run(main())


def fallbacks(service: DecodeService) -> dict[str, float]:
    """The fallback metric's non-zero counts by reason."""
    registry = service.metrics.registry
    values = {
        reason: registry.get_sample_value("edgedecode_prefill_fallbacks_total", {"reason": reason})
        for reason in KVPullError.REASONS
    }
    return {reason: value for reason, value in values.items() if value}


async def wait_until(condition, seconds: float = 3.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def test_a_good_pull_is_used(prefill):
    engine = FakeEngine()
    service = make_service(prefill.url, [engine])
    turn = drive(service, lambda: run_turn(service))
    report = turn.report
    assert (report.kv_source, report.fallback_reason) == ("prefill_server", None)
    assert report.tiers == {"FP16": len(PROMPT)}  # what the payload held
    assert (report.pulled_tokens, report.computed_tokens) == (len(PROMPT) - 1, 1)  # the last token runs here
    assert report.wire_bytes == len(payload_for(PROMPT, 0)) and report.server_seconds == 0.001
    assert engine.used == [("stream", len(PROMPT), 0)]
    assert engine.reader_finishes == 1  # the pull confirmed the stream; the engine reused its header
    np.testing.assert_array_equal(prefill.bodies[0]["token_ids"], PROMPT)
    assert fallbacks(service) == {} and service.remote.breaker.state == "closed"
    assert (turn.finish_reason, turn.completion_tokens) == ("length", len(TOKENS))
    assert not engine.generated_while_ingesting


@pytest.mark.parametrize(
    "mode, reason",
    [
        ("corrupt", "bad_payload"),
        ("truncated", "truncated"),
        ("other-prompt", "bad_payload"),  # the engine's stream target refuses it at the header
        ("slow", "timeout"),
        ("http_error", "http_error"),
        ("redirect", "http_error"),  # never followed
        ("rejected", "rejected"),
        ("refused", "unreachable"),
    ],
)
def test_a_failed_pull_falls_back_to_local_prefill_with_its_reason(prefill, mode, reason):
    prefill.mode = mode
    engine = FakeEngine()
    service = make_service(closed_port_url() if mode == "refused" else prefill.url, [engine])
    report = drive(service, lambda: run_turn(service)).report
    assert (report.kv_source, report.fallback_reason) == ("local", reason)
    assert engine.used == [("local", 0, 0)]
    assert fallbacks(service) == {reason: 1.0}
    assert len(prefill.bodies) == (mode != "refused")
    assert not engine.generated_while_ingesting  # the fallback waited for the ingest thread
    # a pull that got its answer's headers teaches the link model what it measured, failed or not
    answered = mode in ("corrupt", "truncated", "other-prompt")
    assert (service.planner.links.get(service.remote.url()).estimate().rtt_s is not None) == answered


def test_no_prefill_server_falls_back_as_unreachable(prefill):
    service = make_service(None)
    assert drive(service, lambda: run_turn(service)).report.fallback_reason == "unreachable"
    assert fallbacks(service) == {"unreachable": 1.0} and prefill.bodies == []


def test_the_breaker_opens_after_n_failures_and_skips_the_endpoint(prefill):
    prefill.mode = "http_error"
    service = make_service(prefill.url, breaker_failures=2, breaker_reset_s=60.0)

    async def scenario():
        return [(await run_turn(service)).report.fallback_reason for _ in range(4)]

    assert drive(service, scenario) == ["http_error", "http_error", "breaker_open", "breaker_open"]
    assert len(prefill.bodies) == 2  # the open breaker sent nothing to the endpoint
    assert fallbacks(service) == {"http_error": 2.0, "breaker_open": 2.0}
    assert service.metrics.registry.get_sample_value("edgedecode_prefill_breaker_open") == 1.0


def test_refused_requests_do_not_open_the_breaker(prefill):
    prefill.mode = "rejected"  # the endpoint is healthy; it refused this request
    service = make_service(prefill.url, breaker_failures=2)

    async def scenario():
        return [(await run_turn(service)).report.fallback_reason for _ in range(3)]

    assert drive(service, scenario) == ["rejected"] * 3
    assert len(prefill.bodies) == 3 and service.remote.breaker.state == "closed"


def test_a_slot_is_released_after_a_failed_pull_only_once_the_ingest_thread_is_done(prefill):
    engine = FakeEngine()
    engine.hold = threading.Event()  # the ingest thread stops at the stream's header
    service = make_service(prefill.url, [engine])

    async def scenario():
        opening = asyncio.create_task(service.turn(request(), "client", time.perf_counter()).open())
        assert await asyncio.to_thread(engine.header_arrived.wait, 5)
        opening.cancel()  # the request goes away while its KV is being ingested
        await asyncio.sleep(0.2)
        held_while_ingesting = service.pool.busy
        assert engine.hold is not None
        engine.hold.set()
        with pytest.raises(asyncio.CancelledError):
            await opening
        released = await wait_until(lambda: service.pool.busy == 0)
        return held_while_ingesting, released

    held_while_ingesting, released = drive(service, scenario)
    assert held_while_ingesting == 1  # the ingest thread may still write into the slot's buffers
    assert released
    assert engine.used == []  # nothing generated from the abandoned turn


def test_a_pull_timing_out_while_the_ingest_thread_works_falls_back_only_once_it_is_done(prefill, monkeypatch):
    monkeypatch.setattr("edgedecode.daemon.pull.segment.FEED_BYTES", 1)  # each network read goes to the ingest thread
    prefill.mode = "trickle"
    engine = FakeEngine()
    engine.hold = threading.Event()  # the ingest thread is stuck in the first piece past the pull's timeout
    service = make_service(prefill.url, [engine], fetch_timeout_s=0.3)
    release = threading.Timer(0.8, engine.hold.set)
    release.start()
    try:
        report = drive(service, lambda: run_turn(service)).report
    finally:
        release.cancel()
        engine.hold.set()
    assert (report.kv_source, report.fallback_reason) == ("local", "timeout")
    assert engine.used == [("local", 0, 0)]
    assert not engine.generated_while_ingesting


def test_a_session_keeps_its_slot_and_its_kv(prefill):
    engines = [FakeEngine(), FakeEngine()]
    service = make_service(prefill.url, engines, slots=2)
    follow_up = np.concatenate([PROMPT, TOKENS, np.arange(200, 210)])

    async def scenario():
        other = await run_turn(service, np.arange(50, 70), session="b")
        first = await run_turn(service, session="a")  # b's slot is now the least recently used
        again = await run_turn(service, follow_up, session="a")
        return first.report, other.report, again.report

    first, other, again = drive(service, scenario)
    assert other.slot != first.slot == again.slot
    keep = len(PROMPT) + len(TOKENS) - 1  # the last generated token never ran
    assert (first.reused_tokens, other.reused_tokens, again.reused_tokens) == (0, 0, keep)
    assert prefill.bodies[2]["held_tokens"] == keep  # only the rest of the prompt is asked for
    assert again.kv_source == "prefill_server" and again.pulled_tokens == len(follow_up) - keep - 1
    assert engines[first.slot].used[-1] == ("stream", len(follow_up) - keep, keep)
    assert service.pool.busy == 0


# --- adapting to the link under a time-to-first-token target ---------------------------------------

FP16_PER_TOKEN = MODEL.spec.kv_bytes_per_token_fp16


def teach_link(service: DecodeService, url: str, bytes_per_second: float, rtt_s: float = 0.01) -> None:
    """The link model of ``url`` as if one pull had measured this goodput and round trip."""
    transfer = 1 << 20
    service.planner.links.get(url).observe(
        PullResult(transfer, transfer, {}, 1.0, 0.0, rtt_s, transfer / bytes_per_second, transfer), len(PROMPT)
    )


def targeted(ms: float) -> CompletionRequest:
    return dataclasses.replace(request(), ttft_target_ms=ms)


async def targeted_turn(service: DecodeService, ms: float) -> Turn:
    turn = service.turn(targeted(ms), "client", time.perf_counter())
    await turn.open()
    assert "".join([piece.text async for piece in turn.pieces()]) == EXPECTED_TEXT
    return turn


def test_with_a_target_a_slower_link_gets_a_lower_budget(prefill):
    fp16 = len(PROMPT) * FP16_PER_TOKEN  # 10 KiB
    budgets = {}
    for name, rate in (("fast", fp16 / 0.01), ("slow", fp16 / 0.6)):  # FP16 in 10 ms, or in 600 ms
        prefill.bodies = []
        service = make_service(prefill.url, min_wire_bytes=0)
        # local would take seconds for any part of the prompt, a few ms for its last token alone (the
        # step after the KV): neither local prefill nor a split is in the running
        service.planner.local_speed = LocalPrefillModel([(1, 0.002), (2, 1.0), (16, 2.0), (128, 20.0)])
        teach_link(service, prefill.url, rate)
        turn = drive(service, lambda service=service: targeted_turn(service, 300.0))
        report = turn.report
        assert (report.kv_source, report.decision) == ("prefill_server", "remote")
        assert report.predicted_seconds is not None and report.predicted_seconds <= 0.3
        budgets[name] = prefill.bodies[0]["budget"]
        assert report.budget == budgets[name]
        assert service.metrics.registry.get_sample_value("edgedecode_kv_decisions_total", {"decision": "remote"}) == 1
        assert report.to_json()["ttft_target_ms"] == 300.0
    # fast: b 0.5 costs no more quality than b 1.0 (QualityCosts) and arrives sooner; slow: 0.3 of FP16 in ~180 ms
    assert budgets["fast"] == 0.5 and 0.2 <= budgets["slow"] <= 0.4


def test_a_link_too_slow_for_any_budget_goes_local_without_a_pull(prefill):
    service = make_service(prefill.url, min_wire_bytes=0, ttft_target_ms=200.0)  # the daemon's own target
    service.planner.local_speed = LocalPrefillModel([(16, 0.01), (128, 0.02)])
    teach_link(service, prefill.url, 1000.0)  # 1 kB/s: even the floor budget takes seconds
    turn = drive(service, lambda: run_turn(service))
    report = turn.report
    assert (report.kv_source, report.decision, report.fallback_reason) == ("local", "local", None)
    assert prefill.bodies == []  # nothing was asked of the endpoint
    assert fallbacks(service) == {}
    registry = service.metrics.registry
    assert registry.get_sample_value("edgedecode_kv_decisions_total", {"decision": "local"}) == 1
    assert registry.get_sample_value("edgedecode_ttft_target_total", {"met": "true"}) == 1
    assert report.to_json()["ttft_target_met"] is True


def test_a_link_that_keeps_every_turn_local_is_pulled_from_again_once_its_measure_is_old(prefill):
    """The planner's clock is injected: "measured too long ago" is the test's to say, not the box's speed."""
    reprobe_s = 60.0
    clock = FakeClock()
    service = make_service(prefill.url, clock=clock, min_wire_bytes=0, ttft_target_ms=200.0, link_reprobe_s=reprobe_s)
    service.planner.local_speed = LocalPrefillModel([(16, 0.01), (128, 0.02)])
    teach_link(service, prefill.url, 1000.0)  # 1 kB/s: every turn is planned here

    async def scenario() -> list[TurnReport]:
        first = await run_turn(service)  # the link was measured just now: no re-probe
        clock.now += reprobe_s * 1.5
        probe = await run_turn(service)  # measured too long ago: this turn pulls
        after = await run_turn(service)  # re-probed just now (and still slow on average): here again
        return [first.report, probe.report, after.report]

    first, probe, after = drive(service, scenario)
    assert [r.decision for r in (first, probe, after)] == ["local", "remote", "local"]
    assert probe.kv_source == "prefill_server" and len(prefill.bodies) == 1
    assert service.metrics.registry.get_sample_value("edgedecode_link_reprobes_total") == 1
    assert service.planner.links.get(prefill.url).since_observed() == 0  # the probe's pull taught the link


def test_an_unknown_link_asks_for_the_configured_budget_and_learns_from_the_pull(prefill):
    service = make_service(prefill.url, min_wire_bytes=0, ttft_target_ms=300.0)
    assert service.planner.links.get(prefill.url).predict_fetch_s(1000, 10) is None
    turn = drive(service, lambda: run_turn(service))
    assert (turn.report.decision, prefill.bodies[0]["budget"]) == ("remote", 0.3)
    assert service.planner.links.get(prefill.url).estimate().rtt_s is not None  # the pull taught the link model


# --- the KV memory budget and the conversations kept compressed ----------------------------------


def gauge(service: DecodeService, name: str, state: str) -> float | None:
    return service.metrics.registry.get_sample_value(name, {"state": state})


def test_a_conversation_whose_slot_is_taken_comes_back_from_the_store_and_pulls_only_new_tokens(prefill):
    service = make_service(prefill.url)  # one slot
    follow_up = np.concatenate([PROMPT, TOKENS, np.arange(200, 210)])

    async def scenario():
        await run_turn(service, session="a")
        other = await run_turn(service, np.arange(50, 70), session="b")  # takes a's slot: a is compressed
        compressed = gauge(service, "edgedecode_sessions", "compressed")
        again = await run_turn(service, follow_up, session="a")
        return other.report, compressed, again.report

    other, compressed, again = drive(service, scenario)
    keep = len(PROMPT) + len(TOKENS) - 1  # the last generated token never ran
    assert other.restored_tokens == 0 and compressed == 1
    assert again.reused_tokens == again.restored_tokens == keep and again.restored_tiers == {"INT8": keep}
    assert prefill.bodies[-1]["held_tokens"] == keep  # only the new tokens are pulled
    store = service.memory.store
    assert "a" not in store and "b" in store  # a was taken back out; b went in when a took its slot
    assert gauge(service, "edgedecode_sessions", "compressed") == 1
    assert gauge(service, "edgedecode_sessions", "resident") == 1


def test_under_pressure_an_idle_resident_conversation_is_compressed_to_make_room(prefill):
    engines = [FakeEngine(), FakeEngine()]
    for engine in engines:
        engine.kv_bytes_per_slot = 16 << 10  # a turn of 40 + 3 tokens reserves 688 KiB of the 1 MiB
    service = make_service(prefill.url, engines, slots=2, kv_memory_mb=1)

    async def scenario():
        first = await run_turn(service, session="a")
        peak = service.memory.nbytes
        second = await run_turn(service, np.arange(50, 90), session="b")  # does not fit beside a's resident KV
        return first.report, second.report, peak

    first, second, peak = drive(service, scenario)
    assert first.slot != second.slot and peak <= 1 << 20
    assert service.memory.nbytes <= 1 << 20
    assert "a" in service.memory.store  # a was compressed out of its slot rather than refused or lost
    assert gauge(service, "edgedecode_sessions", "compressed") == 1
    held = engines[second.slot].length * (16 << 10)
    assert gauge(service, "edgedecode_kv_memory_bytes", "resident") == held  # b's reservation, settled to its KV


def test_a_turn_larger_than_the_kv_budget_is_a_503_naming_it_and_the_daemon_keeps_serving(prefill):
    engine = FakeEngine()
    engine.kv_bytes_per_slot = 16 << 10
    service = make_service(prefill.url, [engine], kv_memory_mb=1)
    long_prompt = np.arange(1, 101)  # 100 + 3 tokens: 1.6 MiB of KV

    async def scenario():
        with pytest.raises(KVMemoryError, match=r"KV memory budget of 1(\.0)? MiB \(daemon\.kv_memory_mb\)") as refused:
            await service.turn(request(long_prompt), "client", time.perf_counter()).open()
        served = await run_turn(service)
        return refused.value, served.report

    refused, served = drive(service, scenario)
    assert refused.http_status == 503 and prefill.bodies and len(prefill.bodies) == 1  # nothing fetched for it
    assert served.kv_source == "prefill_server" and service.pool.busy == 0


def test_a_split_turn_computes_its_head_while_the_tail_is_pulled(prefill):
    fp16 = len(PROMPT) * FP16_PER_TOKEN
    engine = FakeEngine()
    service = make_service(prefill.url, [engine], min_wire_bytes=0)
    # here: 1 ms a token, so the whole prompt takes 40 ms; the link: 40 ms for b 0.5 of the whole prompt
    service.planner.local_speed = LocalPrefillModel([(1, 0.001), (16, 0.016), (128, 0.128)])
    teach_link(service, prefill.url, 0.5 * fp16 / 0.04, rtt_s=0.0)
    taught = service.planner.links.get(prefill.url).estimate()
    turn = drive(service, lambda: targeted_turn(service, 35.0))  # only both at once make 35 ms
    report = turn.report
    assert report.decision == "split" and report.head_tokens > 0, report
    # the split's pull taught the round trip (more than the 0 taught) and the server's time, not the goodput
    learned = service.planner.links.get(prefill.url).estimate()
    assert learned.goodput_bps == taught.goodput_bps and learned.rtt_s > taught.rtt_s == 0.0
    assert learned.server_s_per_token != taught.server_s_per_token
    assert [head for head, _ in engine.heads] == [report.head_tokens]  # computed once, on the worker
    assert prefill.bodies[0]["held_tokens"] == report.head_tokens  # only the tail is asked for
    assert report.kv_source == "prefill_server"
    assert report.computed_tokens == report.head_tokens + 1  # the head and the last token, here
    assert report.pulled_tokens == len(PROMPT) - report.head_tokens - 1
    assert service.pool.busy == 0
    assert service.planner.split_slowdown.value(time.monotonic()) is not None  # the pull's time against its prediction


def test_a_split_turn_that_ends_before_its_tail_arrived_gives_its_slot_back_once_the_fetch_is_over(prefill):
    fp16 = len(PROMPT) * FP16_PER_TOKEN
    engine = FakeEngine()
    engine.hold = threading.Event()  # the tail's ingest stops at its header
    service = make_service(prefill.url, [engine], min_wire_bytes=0)
    service.planner.local_speed = LocalPrefillModel([(1, 0.001), (16, 0.016), (128, 0.128)])
    teach_link(service, prefill.url, 0.5 * fp16 / 0.04, rtt_s=0.0)

    async def scenario():
        turn = service.turn(targeted(35.0), "client", time.perf_counter())
        await turn.open()  # a split: the generation is on the worker, waiting for the tail
        assert turn.report.decision == "split"
        assert await asyncio.to_thread(engine.header_arrived.wait, 5)
        assert turn._generation is not None
        turn._generation.cancel()  # the client went away
        await asyncio.sleep(0.3)
        held_while_fetching = service.pool.busy
        assert engine.hold is not None
        engine.hold.set()
        released = await wait_until(lambda: service.pool.busy == 0)
        return held_while_fetching, released

    held_while_fetching, released = drive(service, scenario)
    assert held_while_fetching == 1  # the fetch may still write into the slot's buffers
    assert released and engine.used == []  # nothing generated for the turn that went away


def test_kv_buffers_allocated_whole_up_front_are_reserved_whole(prefill):
    def engines(n: int) -> list[FakeEngine]:
        made = [FakeEngine(max_context=64) for _ in range(n)]
        for engine in made:
            engine.kv_preallocated = True  # as on CUDA
            engine.kv_bytes_per_slot = 8 << 10  # 512 KiB per slot, whatever it holds
        return made

    refused = r"3 slots' KV buffers.* 1\.5 MiB: more than daemon\.kv_memory_mb \(1\.0 MiB\)"
    with pytest.raises(KVMemoryError, match=refused):
        make_service(prefill.url, engines(3), slots=3, kv_memory_mb=1)  # 1.5 MiB of buffers

    service = make_service(prefill.url, engines(1), kv_memory_mb=1)
    assert service.memory.reserved_nbytes == 512 << 10

    async def scenario():
        await run_turn(service, session="a")
        after_turn = service.memory.reserved_nbytes
        await run_turn(service, np.arange(50, 70), session="b")  # a leaves the slot, compressed
        return after_turn

    after_turn = drive(service, scenario)
    assert after_turn == service.memory.reserved_nbytes == 512 << 10  # neither grows nor shrinks
    assert "a" in service.memory.store and service.memory.nbytes <= 1 << 20

"""A turn (``daemon.turn.Turn``) against fakes of its owners: the memory ledger, the remote and the
planner answer with values chosen per test; the slot pool, the slot lease and the worker thread are
the real ones, over a fake engine. Each test takes milliseconds: what the turn asks of its owners,
what it reports of their answers, and when its slot goes back."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from edgedecode.config import load_config
from edgedecode.daemon.memory.ledger import KVMemoryError, Resume
from edgedecode.daemon.metrics import DaemonMetrics
from edgedecode.daemon.openai_api import CompletionRequest
from edgedecode.daemon.pull.adaptive import KVPlan
from edgedecode.daemon.pull.deadline import Deadline
from edgedecode.daemon.pull.fetch import FetchOutcome, SegmentReport
from edgedecode.daemon.pull.remote import Fetched, Pull
from edgedecode.daemon.pull.segment import PullResult
from edgedecode.daemon.slots import SlotLease, SlotPool
from edgedecode.daemon.turn import Turn
from edgedecode.daemon.worker import DecodeWorker
from edgedecode.runtime.engine import GenerationStats
from edgedecode.runtime.logprobs import ScoredRun, ScoredToken
from edgedecode.runtime.sampler import SamplingParams

PROMPT = np.arange(1, 21, dtype=np.int64)
TOKENS = (7, 8, 9)
STREAM = SimpleNamespace(head=0)  # what the fake remote hands over as the pulled KV
SPLIT = SimpleNamespace(head=5)  # a split's: its first 5 positions are computed here


class Engine:
    """Yields TOKENS; says which KV it was given and what it computed of the prompt."""

    max_context = 64

    def __init__(self) -> None:
        self.stats = GenerationStats()
        self.used: list[tuple[object, int]] = []  # (kv, keep) of every generation
        self.heads: list[object] = []

    def reusable_prefix(self, prompt_ids: np.ndarray) -> int:
        return len(prompt_ids) - 1

    def compute_head(self, stream: object) -> None:
        self.heads.append(stream)

    def score_prompt(self, prompt_ids: np.ndarray, top: int = 0):
        n = len(prompt_ids) - 1
        top_ids = np.zeros((n, top), np.int64)
        yield ScoredRun(1, prompt_ids[1:], np.full(n, -1.0), top_ids, np.zeros((n, top)))

    def generate(
        self, prompt_ids: np.ndarray, params: SamplingParams, kv: object = None, keep: int = 0, constraint=None
    ):
        self.used.append((kv, keep))
        computed = 1 + kv.head if kv is not None else len(prompt_ids) - keep
        self.stats = GenerationStats(len(prompt_ids), computed_tokens=computed, prefill_seconds=0.01)
        for token in TOKENS[: params.max_tokens]:
            self.stats.generated_tokens += 1
            yield token

    def generate_scored(self, prompt_ids, params, kv=None, keep=0, *, top=0, constraint=None):
        for token in self.generate(prompt_ids, params, kv, keep):
            yield ScoredToken(token, -0.5, np.zeros(top, np.int64), np.zeros(top))


class Memory:
    """The memory ledger's calls, answered with ``resume``, or refused (``refuse``)."""

    def __init__(self, resume: Resume | None = None, refuse: bool = False) -> None:
        self.resume_with, self.refuse = resume or Resume(0, "new"), refuse
        self.asked: list[tuple[str, object]] = []
        self.settled = 0

    async def resume(self, slot, session_id, prompt_ids, *, reuse=True) -> Resume:
        self.asked.append(("resume", reuse))
        return self.resume_with if reuse else replace(self.resume_with, keep=0)

    async def admit(self, slot, keep: int, new_tokens: int) -> int:
        self.asked.append(("admit", (keep, new_tokens)))
        if self.refuse:
            raise KVMemoryError("not enough memory for this request")
        return 0

    def settle(self, slot) -> None:
        self.settled += 1


class Remote:
    """The remote's pull, answered with ``pull`` (or made by ``make`` on the running loop)."""

    def __init__(self, pull: Pull | None = None, make=None) -> None:
        self.answer, self.make = pull or Pull(), make
        self.asked: list[tuple[int, Deadline]] = []

    async def pull(self, engine, prompt_ids, keep: int, deadline: Deadline) -> Pull:
        self.asked.append((keep, deadline))
        return self.make() if self.make is not None else self.answer


class Planner:
    def __init__(self) -> None:
        self.local_prefills: list[tuple[int, float]] = []

    def learn_local_prefill(self, tokens: int, seconds: float) -> None:
        self.local_prefills.append((tokens, seconds))


class Decoder:
    def feed(self, token: int) -> str:
        return f"<{token}>"

    def flush(self) -> str:
        return ""

    held = 0


def service(memory: Memory, remote: Remote, **daemon) -> SimpleNamespace:
    """A DecodeService's owners as a turn sees them: fakes but for the pool, the lease and the worker."""
    engine = Engine()
    pool = SlotPool([engine], 4)  # type: ignore[list-item]
    ingest = ThreadPoolExecutor(1)
    owners = SimpleNamespace(
        config=load_config(None, env={}, overrides={"daemon": daemon}),
        metrics=DaemonMetrics(),
        model=SimpleNamespace(tokenizer=SimpleNamespace(stream_decoder=Decoder)),
        pool=pool,
        memory=memory,
        remote=remote,
        planner=Planner(),
        worker=DecodeWorker(),
        engine=engine,
        ingest=ingest,
    )
    owners.lease = lambda client, session_id: SlotLease(pool, client, session_id, settle=memory.settle, ingest=ingest)
    return owners


def request(max_tokens: int = 3, **fields) -> CompletionRequest:
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=())
    return replace(CompletionRequest("text", PROMPT, params, False, False, (), "s", None), **fields)


def run(owners: SimpleNamespace, scenario):
    async def main():
        try:
            return await scenario()
        finally:
            owners.worker.stop()
            owners.ingest.shutdown()

    return asyncio.run(main())


async def whole(owners: SimpleNamespace, asked: CompletionRequest) -> tuple[Turn, str]:
    async with Turn(owners, asked, "client", time.perf_counter()) as turn:  # type: ignore[arg-type]
        text = "".join([piece.text async for piece in turn.pieces()])
    return turn, text


def fetched(tokens: int, fallback: str | None = None) -> Fetched:
    result = PullResult(1000, 4000, {"INT8": tokens - 2, "DROP": 2}, 0.02, 0.005)
    return Fetched(FetchOutcome([SegmentReport(0.3, result)], 0.02), tokens, fallback)


def test_the_report_says_what_the_owners_answered():
    resume = Resume(12, "compressed", {"INT8": 12})
    plan = KVPlan("remote", 0.3, 0.05, "b 0.3")
    owners = service(Memory(resume), Remote(Pull(STREAM, None, plan, 0.3, fetched(7))))
    turn, text = run(owners, lambda: whole(owners, request()))
    kv = turn.report.to_json()["kv"]
    assert text == "<7><8><9>" and owners.engine.used == [(STREAM, 12)]
    assert (kv["resume"], kv["reused_tokens"], kv["restored_tokens"], kv["restored_tiers"]) == (
        "compressed",
        12,
        12,
        {"INT8": 12},
    )
    assert (kv["decision"], kv["budget"], kv["predicted_ms"], kv["source"]) == ("remote", 0.3, 50.0, "prefill_server")
    assert kv["why"] == "b 0.3"  # what decided the plan, as the planner said it
    assert (kv["wire_bytes"], kv["fp16_bytes"], kv["tiers"], kv["prefill_server_ms"]) == (
        1000,
        4000,
        {"INT8": 5, "DROP": 2},
        5.0,
    )
    assert kv["segments"] == [{"budget": 0.3, "tokens": 7, "wire_bytes": 1000, "fetch_ms": 20.0, "ended": "complete"}]
    # the engine computed the last prompt token; the rest after the 12 kept was pulled
    assert (kv["computed_tokens"], kv["pulled_tokens"]) == (1, len(PROMPT) - 12 - 1)
    assert owners.memory.asked == [("resume", True), ("admit", (12, len(PROMPT) - 12 + 3))]
    assert owners.planner.local_prefills == []  # a pulled prompt does not time local prefill
    assert owners.pool.busy == 0 and owners.memory.settled == 1


def test_a_prompt_computed_here_teaches_the_planner_its_local_speed_and_reports_a_fallback():
    owners = service(Memory(), Remote(Pull(fallback="breaker_open")))
    turn, _ = run(owners, lambda: whole(owners, request()))
    assert (turn.report.kv_source, turn.report.fallback_reason) == ("local", "breaker_open")
    assert owners.engine.used == [(None, 0)] and turn.report.computed_tokens == len(PROMPT)
    assert owners.planner.local_prefills == [(len(PROMPT), 0.01)]


def test_the_deadline_is_made_once_from_the_requests_target_and_handed_to_the_remote():
    owners = service(Memory(), Remote(), ttft_target_ms=500.0)
    arrived = time.perf_counter()

    async def scenario():
        async with Turn(owners, request(ttft_target_ms=250.0), "client", arrived) as turn:  # type: ignore[arg-type]
            return turn, [piece async for piece in turn.pieces()]

    turn, _ = run(owners, scenario)
    [(_, deadline)] = owners.remote.asked
    assert deadline is turn.deadline and deadline.at == arrived + 0.25 and deadline.target_s == 0.25
    assert turn.report.to_json()["ttft_target_ms"] == 250.0
    assert Turn(owners, request(), "c", arrived).deadline == Deadline(0.5, arrived + 0.5)  # type: ignore[arg-type]
    assert Turn(owners, request(ttft_target_ms=0.0), "c", arrived).deadline.left_s() is None  # type: ignore[arg-type]


def test_a_refused_turn_asks_the_remote_nothing_and_gives_its_slot_back_once_the_ingest_thread_is_done():
    owners = service(Memory(refuse=True), Remote())
    hold = threading.Event()

    async def scenario():
        owners.ingest.submit(hold.wait, 5)  # the ingest thread is busy (as with a pull into the slot)
        with pytest.raises(KVMemoryError):
            await Turn(owners, request(), "client", time.perf_counter()).open()  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        held = owners.pool.busy
        hold.set()
        for _ in range(100):
            if not owners.pool.busy:
                break
            await asyncio.sleep(0.01)
        return held

    assert run(owners, scenario) == 1
    assert owners.remote.asked == [] and owners.pool.busy == 0 and owners.memory.settled == 1


def test_an_echo_with_logprobs_keeps_and_pulls_nothing_and_an_echo_of_nothing_needs_no_kv():
    owners = service(Memory(Resume(12, "resident")), Remote(Pull(STREAM)))
    scored = request(echo=True, logprobs=0)
    turn, text = run(owners, lambda: whole(owners, scored))
    assert text.endswith("<7><8><9>") and owners.remote.asked == []
    assert owners.memory.asked[0] == ("resume", False)  # nothing of the prompt is kept: it is all scored here
    assert (turn.report.local_reason, turn.report.reused_tokens) == ("prompt_logprobs", 0)
    owners = service(Memory(), Remote(Pull(STREAM)))
    turn, text = run(owners, lambda: whole(owners, request(max_tokens=0, echo=True)))
    assert owners.remote.asked == [] and owners.engine.used == [] and turn.report.local_reason is None


def test_a_split_reports_its_tail_once_in_and_the_worker_waits_for_it():
    plan = KVPlan("split", 0.3, 0.04, "5 tokens here, the rest at b 0.3", head=5, pull_s=0.03)

    async def tail() -> Fetched:
        await asyncio.sleep(0.05)
        return fetched(14)

    owners = service(Memory(), Remote(make=lambda: Pull(SPLIT, asyncio.ensure_future(tail()), plan, 0.3)))
    turn, text = run(owners, lambda: whole(owners, request()))
    report = turn.report
    assert text == "<7><8><9>" and owners.engine.heads == [SPLIT] and owners.engine.used == [(SPLIT, 0)]
    assert (report.decision, report.head_tokens, report.kv_source, report.pulled_tokens) == (
        "split",
        5,
        "prefill_server",
        14,
    )
    assert owners.pool.busy == 0


def test_a_split_whose_client_goes_away_cancels_its_tail_and_gives_the_slot_back():
    plan = KVPlan("split", 0.3, 0.04, "5 tokens here, the rest at b 0.3", head=5, pull_s=0.03)
    cancelled = []

    async def tail() -> Fetched:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return fetched(14)

    owners = service(Memory(), Remote(make=lambda: Pull(SPLIT, asyncio.ensure_future(tail()), plan, 0.3)))

    async def scenario():
        turn = Turn(owners, request(), "client", time.perf_counter())  # type: ignore[arg-type]
        await turn.open()
        await asyncio.sleep(0.05)  # the worker computed the head and waits for the tail
        busy = owners.pool.busy
        await turn.close()  # the client went away
        return busy, turn

    busy, turn = run(owners, scenario)
    assert busy == 1 and cancelled == [True] and owners.engine.used == []
    assert owners.pool.busy == 0 and turn.report.kv_source == "local"

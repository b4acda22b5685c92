"""The KV planner as the daemon builds it, with speeds given, not measured (nothing here depends on the
machine). A probe of an unknown link that got no answer is not waited on again. Prefix-aware plans:
the daemon remembers what each prefill server's prefix cache holds from the
server's own answers (X-Prefix-Reused-Tokens), and the planner prices only the part of a prompt the
server will compute. A shared ~3k-token document with short questions, over a fast link, to a server
that computes 1000 tokens/s — as fast as this box — is pulled once the server holds the document,
computed here before."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from edgedecode.config import DaemonConfig
from edgedecode.daemon.metrics import DaemonMetrics
from edgedecode.daemon.pull.adaptive import BUDGET_LADDER, QUALITY_FLOOR_PCT
from edgedecode.daemon.pull.calibration import shipped
from edgedecode.daemon.pull.deadline import Deadline
from edgedecode.daemon.pull.local_speed import LocalPrefillModel
from edgedecode.daemon.pull.planner import KVPlanner
from edgedecode.daemon.pull.segment import KVPullError, PullResult
from edgedecode.daemon.pull.server_prefixes import ServerPrefixes
from edgedecode.kv.prefix import DEFAULT_BLOCK_TOKENS
from edgedecode.model.spec import DECODER_KV_LAYOUT, KVContract

URL = "http://prefill:8089"
DEFAULT_MODEL = "smollm2-135m-instruct"
FP16_BYTES_PER_TOKEN = 23040  # SmolLM2-135M
CONTRACT = KVContract("llama", 30, 3, 64, 10000.0, DECODER_KV_LAYOUT, "tok")
DOCUMENT = np.arange(10_000, 13_000, dtype=np.int64)  # 3000 tokens shared by every question


def _question(seed: int) -> np.ndarray:
    return np.concatenate([DOCUMENT, np.arange(seed * 100, seed * 100 + 40, dtype=np.int64)])


def _planner() -> KVPlanner:
    """A daemon with no adaptive key set, whose box prefills 1000 tokens/s and whose link to the
    server has carried one pull: 1 Gbit/s, 5 ms round trip, the server 1 ms per token it computed."""
    planner = KVPlanner(DaemonConfig(), FP16_BYTES_PER_TOKEN, CONTRACT, DaemonMetrics(), shipped()[DEFAULT_MODEL])
    planner.local_speed = LocalPrefillModel([(n, n / 1000) for n in (128, 512, 2048, 4096)])
    transfer = 20 << 20
    first = PullResult(
        wire_bytes=transfer,
        fp16_bytes=4 * transfer,
        tier_counts={"FP16": 1000},
        seconds=0.005 + 1.0 + transfer / 125e6,
        server_seconds=1.0,
        headers_seconds=1.005,
        transfer_seconds=transfer / 125e6,
        transfer_bytes=transfer,
    )
    planner.learn_segment(URL, first, 1000)
    return planner


def _plan(planner: KVPlanner, prompt: np.ndarray):
    held = planner.prefixes.held_tokens(URL, prompt)
    return planner.plan(URL, 0, len(prompt), Deadline(), server_held=held), held


def test_a_shared_document_is_pulled_once_the_server_holds_it():
    planner = _planner()
    first, held = _plan(planner, _question(1))
    assert held == 0 and first.decision == "local", first  # the server would compute all 3040 tokens too
    planner.prefixes.learn(URL, _question(1), 0, 0)  # a pull of it happened: the server keeps the prompt
    second, held = _plan(planner, _question(2))
    assert held == len(DOCUMENT) // DEFAULT_BLOCK_TOKENS * DEFAULT_BLOCK_TOKENS
    assert second.decision == "remote" and second.predicted_s is not None, second
    assert second.predicted_s < planner.local_speed.predict_seconds(len(_question(2))) / 2


def test_a_held_query_is_worth_its_round_trip_only_where_some_pull_could_beat_local_prefill():
    planner = _planner()  # 1 Gbit/s: a whole pull of 3040 tokens at b 0.2 takes ~0.1 s against 3 s here
    assert planner.plans(Deadline())  # no adaptive key: the default objective plans every turn
    assert planner.pull_could_win(URL, 0, len(_question(1)))
    slow = _planner()
    mb = 1 << 20
    collapsed = PullResult(mb, 4 * mb, {"FP16": 10}, 52.0, 1.0, 1.005, 51.0, mb)  # 20 kB/s
    for _ in range(10):  # the link collapsed: even a split's shortest tail (380 tokens at b 0.2) takes ~80 s
        slow.links.get(URL).observe(collapsed, 0)
    assert not slow.pull_could_win(URL, 0, len(_question(1)))
    middling = _planner()
    two_mb_s = PullResult(20 * mb, 80 * mb, {"FP16": 10}, 11.5, 1.0, 1.005, 10.0, 20 * mb)  # ~2 MB/s
    for _ in range(10):  # a whole pull at b 0.2 (14 MB) takes ~7 s, more than local; a split's tail (1.75 MB) ~1 s
        middling.links.get(URL).observe(two_mb_s, 0)
    assert middling.pull_could_win(URL, 0, len(_question(1)))
    pinned = KVPlanner(
        DaemonConfig(budget=0.3), FP16_BYTES_PER_TOKEN, CONTRACT, DaemonMetrics(), shipped()[DEFAULT_MODEL]
    )
    assert not pinned.plans(Deadline())  # a pinned budget pulls whatever the server holds


def test_a_server_that_missed_what_was_believed_held_is_not_believed_again_until_it_reports_a_hit():
    prefixes = ServerPrefixes()
    prompt = _question(1)
    prefixes.learn(URL, prompt, 0, 0)
    believed = prefixes.held_tokens(URL, _question(2))
    assert believed > 0
    prefixes.learn(URL, _question(2), believed, 0)  # its cache is off, or evicted the document
    assert prefixes.held_tokens(URL, _question(3)) == 0
    prefixes.learn(URL, _question(3), 0, 0)
    assert prefixes.held_tokens(URL, _question(3)) == 0  # still doubted: nothing remembered
    prefixes.learn(URL, _question(4), 0, 64)  # a hit: the cache works again
    assert prefixes.held_tokens(URL + "/", _question(4)) == len(_question(4)) // 64 * 64


def test_a_server_that_does_not_say_teaches_nothing():
    prefixes = ServerPrefixes()
    prefixes.learn(URL, _question(1), 0, None)
    assert prefixes.held_tokens(URL, _question(1)) == 0


def test_the_memory_is_bounded():
    prefixes = ServerPrefixes(max_blocks=10)
    prefixes.learn(URL, np.arange(64 * 8, dtype=np.int64), 0, 0)
    prefixes.learn(URL, np.arange(5000, 5000 + 64 * 8, dtype=np.int64), 0, 0)
    assert prefixes.held_tokens(URL, np.arange(64 * 8, dtype=np.int64)) == 0  # its first blocks went first
    assert prefixes.held_tokens(URL, np.arange(5000, 5000 + 64 * 8, dtype=np.int64)) == 64 * 8


@pytest.mark.parametrize("tokens", [1024, 3040])
def test_the_default_objective_keeps_a_pull_within_a_tenth_of_local_prefill(tokens):
    planner = _planner()
    prompt = np.arange(tokens, dtype=np.int64)
    plan, _ = _plan(planner, prompt)
    assert plan.predicted_s is not None
    assert plan.predicted_s <= 1.1 * planner.local_speed.predict_seconds(tokens) + 1e-9


def _ended(ended: str, *, headers_seconds: float = 0.0, tokens: int = 0, transfer_bytes: int = 0) -> PullResult:
    """A probe's only segment that ended ``ended`` ("complete", "cut" or a failure's reason)."""
    failure = None if ended in ("complete", "cut") else KVPullError(ended, f"the segment ended: {ended}")
    wire = transfer_bytes + 4096 * (headers_seconds > 0)
    return PullResult(
        wire, 0, {"int4": tokens} if tokens else {}, 1.0, None, headers_seconds=headers_seconds,
        transfer_seconds=0.9 if transfer_bytes else 0.0, transfer_bytes=transfer_bytes,
        complete=ended == "complete", cut_reason="past the deadline" if ended == "cut" else None, failure=failure,
    )  # fmt: skip


# a probe given up on at its deadline: no answer; an answer whose few bytes (under the link model's
# MIN_TRANSFER_BYTES) held no token, or a few tokens (cut by the watch, or its wait timed out)
GIVEN_UP = [
    _ended("timeout"),
    _ended("timeout", headers_seconds=0.3, transfer_bytes=20_000),
    _ended("timeout", headers_seconds=0.3, tokens=6, transfer_bytes=40_000),
    _ended("cut", headers_seconds=0.3, tokens=6, transfer_bytes=40_000),
]


@pytest.mark.parametrize("last", GIVEN_UP, ids=["no-answer", "few-bytes", "few-tokens-timeout", "few-tokens-cut"])
def test_an_unknown_link_whose_probe_was_given_up_on_untaught_is_not_waited_on_again(last):
    planner = KVPlanner(DaemonConfig(), FP16_BYTES_PER_TOKEN, CONTRACT, DaemonMetrics(), shipped()[DEFAULT_MODEL])
    planner.local_speed = LocalPrefillModel([(n, n / 1000) for n in (128, 512, 2048)])
    url, prompt = "http://slow:8089", _question(1)
    probe = planner.plan(url, 0, len(prompt), Deadline())
    assert probe.decision == "remote" and probe.predicted_s is None and probe.deadline_s is not None, probe
    if last.headers_seconds:
        planner.learn_segment(url, last, len(prompt))
    planner.learn_unfinished(url, last)
    assert planner.links.get(url).estimate().goodput_bps is None  # it taught no goodput
    after = planner.plan(url, 0, len(prompt), Deadline())
    assert after.decision == "local" and "no answer" in after.why, after
    pinned = KVPlanner(
        DaemonConfig(budget=0.3), FP16_BYTES_PER_TOKEN, CONTRACT, DaemonMetrics(), shipped()[DEFAULT_MODEL]
    )
    pinned.learn_unfinished(url, last)
    assert pinned.plan(url, 0, len(prompt), Deadline()).budget == 0.3  # a pinned budget is asked as before


@pytest.mark.parametrize(
    "last",
    [_ended("complete", headers_seconds=0.3, tokens=6, transfer_bytes=20_000), _ended("bad_payload")],
    ids=["whole-but-short", "failed"],
)
def test_a_probe_that_came_whole_or_failed_is_not_taken_for_an_unanswered_one(last):
    """A short pull that came whole is probed again (its link may be fast); a failure is the breaker's."""
    planner = KVPlanner(DaemonConfig(), FP16_BYTES_PER_TOKEN, CONTRACT, DaemonMetrics(), shipped()[DEFAULT_MODEL])
    url, prompt = "http://slow:8089", _question(1)
    if last.headers_seconds:
        planner.learn_segment(url, last, len(prompt))
    planner.learn_unfinished(url, last)
    after = planner.plan(url, 0, len(prompt), Deadline())
    assert after.decision == "remote" and after.predicted_s is None, after


def test_a_resume_is_priced_at_the_lowest_budget_the_planner_would_take_at_the_prompt_s_length():
    planner = _planner()
    quality = shipped()[DEFAULT_MODEL].quality()
    for tokens in (1024, 2048, 4096):
        lowest = planner.resume_budget(tokens, 0.3)
        assert lowest is not None and quality.of_budget(lowest, tokens) <= QUALITY_FLOOR_PCT
        below = [b for b in BUDGET_LADDER if planner.min_budget <= b < lowest]
        assert all(quality.of_budget(b, tokens) > QUALITY_FLOOR_PCT for b in below)
    assert planner.resume_budget(1024, 0.3) < planner.resume_budget(4096, 0.3)  # longer prompts tolerate less


@pytest.mark.parametrize("tokens", [1024, 4096])
def test_the_watch_cuts_a_steady_segment_only_for_a_resume_the_planner_would_make(tokens):
    # 10 Mbit/s from the start, the box too slow to compute the rest: only a cheaper resume could end sooner
    planner = _planner()
    planner.local_speed = LocalPrefillModel([(n, n / 50) for n in (128, 512, 2048, 4096)])
    stream = SimpleNamespace(prompt_ids=np.arange(tokens), header=None, keep=0, head=0, covered=0)
    watch = planner.watch(URL, stream, 0.3, Deadline.within(1.0))  # type: ignore[arg-type]  # what watch reads
    announced = int(0.3 * tokens * FP16_BYTES_PER_TOKEN)
    cuts = [watch(t / 100, int(1.25e6 * t / 100), announced) for t in range(1, 300)]
    cut = next((reason for reason in cuts if reason), None)
    resumable = planner.resume_budget(tokens, 0.3)
    assert resumable is not None
    # a resume at a lower budget than 0.3 is what would end sooner; where the planner would not plan one, no cut
    assert (cut is not None) == (resumable < 0.3), (tokens, resumable, cut)

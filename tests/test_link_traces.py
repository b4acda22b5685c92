"""Rate traces played on the link shaper: a constant rate, a step triggered by bytes or time, and a
seeded random walk; each replay starts from zero."""

from __future__ import annotations

import itertools
import math
import time

import pytest
from serving_helpers import ByteUpstream, receive

from edgedecode.testing.link_shaper import LinkShaper
from edgedecode.testing.link_traces import MBIT, TracePlayer, constant, describe, random_walk, step

HIGH, LOW = 40e6, 10e6  # bytes/s: fast enough that the transfers below take milliseconds


@pytest.fixture
def shaper():
    with ByteUpstream() as upstream, LinkShaper("127.0.0.1", upstream.port, rate_bytes_per_s=1e6) as link:
        yield link


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    """Poll ``condition`` until it holds (the player's thread polls the shaper on its own tick)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("the condition did not hold in time")
        time.sleep(0.005)


def _download(link: LinkShaper, size: int) -> None:
    data, _ = receive(link.port, f"send {size}\n".encode(), size)
    assert len(data) == size


def test_a_constant_trace_sets_its_rate_once(shaper):
    with TracePlayer(shaper, constant(HIGH)) as player:
        assert shaper.rate_bytes_per_s == HIGH
        assert player.goodput_bps() is None  # nothing has come yet
        _download(shaper, 2_000_000)  # 50 ms at HIGH: several of the player's ticks
    assert [rate for _, rate in player.changes] == [HIGH]
    assert player.progress[-1][1] >= 2_000_000
    goodput = player.goodput_bps()
    assert goodput is not None and goodput > 0


def test_a_step_trace_lowers_the_rate_once_its_byte_threshold_is_crossed(shaper):
    player = TracePlayer(shaper, step(HIGH, LOW, at_bytes=300_000))
    player.start()
    try:
        _download(shaper, 200_000)
        time.sleep(0.05)  # ten ticks of the player: still below the threshold, nothing may change
        assert shaper.rate_bytes_per_s == HIGH and len(player.changes) == 1
        _download(shaper, 200_000)
        _wait_for(lambda: len(player.changes) == 2)
        assert shaper.rate_bytes_per_s == LOW
        assert [rate for _, rate in player.changes] == [HIGH, LOW]

        player.start()  # a new request: the clock and the byte count start again from zero
        assert shaper.rate_bytes_per_s == HIGH and [rate for _, rate in player.changes] == [HIGH]
        _download(shaper, 200_000)
        time.sleep(0.05)
        assert shaper.rate_bytes_per_s == HIGH
    finally:
        player.stop()


def test_a_step_trace_can_be_triggered_by_time_instead():
    trace = step(HIGH, LOW, at_s=1.5)
    assert trace.rate_at(1.49, 10**9) == HIGH
    assert trace.rate_at(1.5, 0) == LOW


def test_a_step_trace_needs_exactly_one_trigger():
    with pytest.raises(ValueError, match="exactly one"):
        step(HIGH, LOW)
    with pytest.raises(ValueError, match="exactly one"):
        step(HIGH, LOW, at_bytes=1, at_s=1.0)


def test_a_random_walk_is_seeded_and_stays_within_its_bounds():
    lo, hi, every_s = 5 * MBIT, 100 * MBIT, 0.1

    def sequence(seed: int) -> list[float]:
        walk = random_walk(lo, hi, every_s, seed)
        return [walk.rate_at(k * every_s + every_s / 2, 0) for k in range(2000)]

    first = sequence(7)
    assert first == sequence(7)
    assert first != sequence(8)
    assert first[0] == pytest.approx(math.sqrt(lo * hi))
    assert all(lo <= rate <= hi for rate in first)
    assert min(first) < 2 * lo and max(first) > hi / 2  # it does wander over the range
    steps = [abs(math.log(b / a)) for a, b in itertools.pairwise(first)]
    assert 0 < max(steps) <= 0.25 + 1e-12  # each change is at most ×exp(±log_step)


def test_a_random_walk_replays_the_same_rates_at_the_same_times():
    walk = random_walk(seed=3)
    later = [walk.rate_at(t, 0) for t in (5.0, 0.25, 12.3)]  # asked out of order, then again
    assert later == [walk.rate_at(t, 0) for t in (5.0, 0.25, 12.3)]
    assert later == [random_walk(seed=3).rate_at(t, 0) for t in (5.0, 0.25, 12.3)]


def test_a_random_walk_refuses_bad_bounds():
    with pytest.raises(ValueError):
        random_walk(lo=10 * MBIT, hi=5 * MBIT)
    with pytest.raises(ValueError, match="outside"):
        random_walk(start=200 * MBIT)


def test_the_player_records_each_change_of_a_walk(shaper):
    walk = random_walk(1e6, 8e6, every_s=0.01, seed=1)
    with TracePlayer(shaper, walk) as player:
        _wait_for(lambda: len(player.changes) >= 5)
    times = [t for t, _ in player.changes]
    assert times == sorted(times)
    for t, rate in player.changes:
        assert rate == walk.rate_at(t, 0)  # the rate the walk has at the time it was set
    assert shaper.rate_bytes_per_s == player.changes[-1][1]


def test_a_trace_describes_its_parameters_for_reports():
    assert describe(step(HIGH, LOW, at_bytes=5)) == {
        "kind": "Step",
        "high": HIGH,
        "low": LOW,
        "at_bytes": 5,
        "at_s": None,
    }
    walk = random_walk(seed=4)
    walk.rate_at(1.0, 0)
    assert set(describe(walk)) == {"kind", "lo", "hi", "every_s", "seed", "start", "log_step"}
